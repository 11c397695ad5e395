"""The offline API: `LLM(model_dir, ...)`, `generate`, and the streaming `add_request / step`.

Shaped like vLLM's `LLM` on purpose. Construction fails fast: the model directory's config is
read and checked against its model state's capabilities before a single weight loads. Everything
after that is a thin layer over one `runner.engine.core.EngineCore`: `generate` validates every
prompt of the call (`runner.engine.prompts`), adds the requests and steps the core until they are
done; the streaming calls add, step, abort and feed realtime input through the same core. After
every `generate` all KV blocks and request slots are free again.

One caller at a time: calls from several threads are serialised by a lock (each gets its own
correct result); sharing one engine between many clients is what `bridge serve` is for.
`shutdown()` (or leaving `with LLM(...) as llm:`) frees the GPU memory at once.
"""

from __future__ import annotations

import gc
import itertools
import logging
import pathlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from runner.config import EngineConfig, check_option_names
from runner.engine.core import EngineCore
from runner.engine.embeds_staging import DeferredEmbeds
from runner.engine.prompts import PromptProcessor, PromptType
from runner.engine.shut_down import ShutDown
from runner.engine.structured_outputs import GrammarCompiler
from runner.hf_config import load_tokenizer, text_config
from runner.multimodal.encoder_cache import EncoderCache
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY, EncoderProtocol
from runner.multimodal.state import MultimodalState
from runner.outputs import EngineStats, GenerationError, RequestOutput
from runner.request import Request
from runner.sampling_params import SamplingParams
from runner.warmup import warm_up
from runner.worker.kernel_compiles import kernel_compiles
from runner.worker.memory_report import memory_report
from runner.worker.model_files import check_model_files
from runner.worker.model_states import load_hf_config, resolve_model_state_cls

logger = logging.getLogger(__name__)


def _eos_token_ids(model_dir: str, hf_config: Any, tokenizer) -> list[int]:
    ids: list[int] = []
    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except (OSError, ValueError):
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is not None:
        ids.extend(eos if isinstance(eos, list | tuple) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


class LLM:
    """An in-process generation engine over a local Hugging Face model directory.

    `LLM(model, encoders=None, **options)`: `options` are the fields of `runner.config.EngineConfig`,
    the one list of engine options (each with its help text; `bridge serve` has a flag per field), and
    a misspelt name is a TypeError naming the nearest one. `encoders` maps a modality to an object
    meeting the encoder protocol (`runner.multimodal.encoder_protocol`). `stats()` gives the engine's
    counters; `hidden_size` is the width a `prompt_embeds` tensor must have; `memory_report()` says
    where the device memory went.
    """

    def __init__(
        self, model: str | pathlib.Path, *, encoders: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        check_option_names(options)
        self._lock = threading.RLock()
        model_dir = str(model)
        check_model_files(model_dir)  # a damaged file is one error naming it, before anything loads
        hf_config = load_hf_config(model_dir)
        self.model_state_cls = resolve_model_state_cls(hf_config)
        requested = EngineConfig(model=model_dir, **options)
        realtime = any(getattr(e, "is_realtime", False) for e in (encoders or {}).values())
        verdict = self.model_state_cls.check_supported(
            hf_config, enable_prompt_embeds=requested.enable_prompt_embeds,
            async_scheduling=requested.async_scheduling, has_mm=bool(encoders), realtime=realtime)
        self._async_scheduling_requested = requested.async_scheduling
        self.engine_config = config = requested.resolve(hf_config)
        enable_prompt_embeds, seed = config.enable_prompt_embeds, config.seed
        self.config = hf_config
        self.enable_prompt_embeds = enable_prompt_embeds
        self.device = config.device
        self.seed = seed
        torch.manual_seed(seed)

        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config, self.tokenizer)
        budget = config.encoder_cache_budget or max(4 * config.max_num_batched_tokens, 16384)
        self.mm = MultimodalState(
            encoders, hidden_size=text_config(hf_config).hidden_size, dtype=config.dtype, device=self.device,
            budget_tokens=budget, uses_mrope=self.model_state_cls.uses_mrope,
            supports_realtime=self.model_state_cls.supports_realtime, max_num_seqs=config.max_num_seqs,
            encode_alone=config.batch_invariant,  # an item's rows never depend on its batch either
        )
        # Triton builds from here on are counted (profiling, graph capture, warm-up, then traffic)
        self.kernel_compiles = kernel_compiles() if self.device.type == "cuda" else None
        self.core = EngineCore(config, hf_config, mm=self.mm, eos_token_ids=tuple(self.eos_token_ids),
                               async_scheduling=verdict)
        self.use_cuda_graphs = config.use_cuda_graphs
        self.max_model_len = self.core.max_model_len
        self.processor = PromptProcessor(
            tokenizer=self.tokenizer, vocab_size=self.runner.vocab_size, hidden_size=self.runner.hidden_size,
            max_model_len=self.max_model_len, enable_prompt_embeds=enable_prompt_embeds,
            eos_token_ids=self.eos_token_ids, mm=self.mm, device=self.device, dtype=config.dtype,
            model_state_cls=self.model_state_cls, hf_config=hf_config, on_multimodal=self._allow_mm,
            uploader=self.runner.uploader,
            # prefix-cache keys hash the rows on the host: keep host tensors there
            keep_device_embeds=not config.enable_prefix_caching,
            grammars=GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids),
        )
        self._request_counter = itertools.count()
        # Requests added with `add_request` that `step()` reports on, and those a `generate` call
        # advanced meanwhile (reported by the next `step()`).
        self._live_requests: dict[str, Any] = {}
        self._advanced_live: set[str] = set()
        with self.runner.startup_phase("warm_up"):
            self.warmup_seconds = warm_up(self) if config.warmup else 0.0
        # what construction built: a count that grows past this under traffic is a cold first call
        self.kernel_compiles_at_ready = self.kernel_compiles.count if self.kernel_compiles else 0

    def reset_request_ids(self) -> None:
        """Number the next requests from 0 again (warm-up's dummy requests leave no trace)."""
        self._request_counter = itertools.count()

    # ----------------------------------------------------------------------------- parts
    def memory_report(self) -> dict:
        """Device memory by owner (weights, KV cache, activation peak, CUDA graph pools, staging
        buffers) and the KV pool in blocks and tokens (`runner.worker.memory_report`)."""
        return memory_report(self.runner)

    @property
    def runner(self):
        """The model runner (`runner.worker.model_runner.ModelRunner`)."""
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def encoder_cache(self) -> EncoderCache:
        """The engine's encoder cache (counters: num_uploads, num_encoder_calls, ...)."""
        return self.mm.cache

    @property
    def hidden_size(self) -> int:
        """The model's hidden size: the width of every `prompt_embeds` row."""
        return self.runner.hidden_size

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a request (generation config, config and tokenizer, merged)."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        self._eos_token_ids = list(ids)
        if getattr(self, "processor", None) is not None:
            self.processor.eos_token_ids = frozenset(int(i) for i in ids)
            if self.processor.grammars is not None:
                self.processor.grammars.set_eos_token_ids(self._eos_token_ids)

    # ----------------------------------------------------------------------------- settings
    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def decode_window(self) -> int:
        return self.core.decode_window

    @decode_window.setter
    def decode_window(self, value: int) -> None:
        self.core.decode_window = value

    # ----------------------------------------------------------------------------- counters
    def stats(self) -> EngineStats:
        """The engine's counters now (KV blocks, request slots, steps, preemptions, ...), for tests and
        monitoring."""
        core = self.core
        return EngineStats(
            num_total_blocks=core.block_manager.num_blocks,
            num_free_blocks=core.block_manager.num_free_blocks,
            num_total_slots=core.scheduler.max_num_seqs,
            num_free_slots=core.scheduler.num_free_slots,
            num_steps=core.runner.num_forward_steps,
            num_preemptions=core.scheduler.num_preemptions,
            num_async_steps=core.num_async_steps,
            num_pipelined_windows=core.num_pipelined_windows,
            num_windows_behind_steps=core.num_windows_behind_steps,
            num_lockstep_steps=core.num_lockstep_steps,
            kernel_compiles=self.kernel_compiles.count if self.kernel_compiles is not None else 0,
        )

    # ----------------------------------------------------------------------------- encoders
    def register_encoder(self, encoder: EncoderProtocol) -> None:
        """Add (or replace) the encoder of `encoder.modality` (ValueError if it is not one)."""
        with self._lock:
            self._allow_mm(realtime=bool(getattr(encoder, "is_realtime", False)))
            self.mm.register_encoder(encoder)

    def _allow_mm(self, realtime: bool = False) -> None:
        """Multimodal input from now on: re-check the model state (async scheduling, realtime)."""
        if self.core.async_scheduling or realtime:
            self.core.async_scheduling = self.model_state_cls.check_supported(
                self.config, enable_prompt_embeds=self.enable_prompt_embeds,
                async_scheduling=self._async_scheduling_requested, has_mm=True, realtime=realtime)

    # ----------------------------------------------------------------------------- generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order (`use_tqdm=True`: a progress bar on stderr;
        a library call prints nothing by default). Every prompt is validated before anything
        is returned: a `ValueError` naming the first bad one, and nothing of the call is left in the
        engine. Everything but the NaN/Inf check of prompt embeds is done before anything is
        scheduled; that check, for the prompts past those the first step takes, runs once that step
        is launched (their host copy overlaps its GPU time), and a bad one drops the whole call. A
        prompt that fails while running (its item's encoder raises or returns NaN/Inf) fails alone:
        the call ends with a `GenerationError` that names it and holds the other prompts' outputs."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        with self._lock:
            ids = [str(next(self._request_counter)) for _ in prompts]
            # The prompt embeds past what the first step takes are checked (and uploaded) once that
            # step is launched, so their host memcpy overlaps its GPU time (see `process_leading`).
            requests, later = self.processor.process_leading(
                prompts, params_list, ids, leading_rows=self.engine_config.max_num_batched_tokens,
                leading_prompts=self.engine_config.max_num_seqs)
            if not requests:
                return []
            bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm,
                       dynamic_ncols=True)
            pending = set(ids)
            for req in requests:
                self.core.add_request(req)
            try:
                while pending:
                    for delta in self.core.step():
                        if delta.request_id in self._live_requests:
                            self._advanced_live.add(delta.request_id)
                        elif delta.finished and delta.request_id in pending:
                            pending.discard(delta.request_id)
                            bar.update(1)
                    if later is not None:
                        later, deferred = None, later
                        self._run_deferred_check(deferred, requests)
            finally:
                for req in requests:  # an error or interrupt mid-run must not leak blocks or slots
                    if not req.is_finished:
                        self.core.abort(req.request_id)
                bar.close()
            outputs = [req.to_output(self.tokenizer) for req in requests]
            errors = {i: req.error for i, req in enumerate(requests) if req.error is not None}
            if errors:
                raise GenerationError(errors, [None if i in errors else o for i, o in enumerate(outputs)])
            return outputs

    def _run_deferred_check(self, deferred: DeferredEmbeds, requests: list[Request]) -> None:
        """Check the call's later prompt embeds; a bad one drops the call: its requests are aborted and
        the step in flight is finished (its outputs for them discarded) before the ValueError goes up,
        so the engine holds no trace of the call."""
        try:
            deferred.run()
        except ValueError:
            for req in requests:
                if not req.is_finished:
                    self.core.abort(req.request_id)
            for delta in self.core.settle():  # a live (streaming) request's progress is kept
                if delta.request_id in self._live_requests:
                    self._advanced_live.add(delta.request_id)
            raise

    # ----------------------------------------------------------------------------- streaming
    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
                    streaming_input: bool | None = None) -> str:
        """Queue one prompt (any form `generate` accepts) and return its request id; run it with `step()`.

        `streaming_input`: whether the request's input stays open for `append_input` until
        `close_input` (see `append_input` for the contract). Default: open when a realtime encoder is
        registered, else closed; True without a realtime encoder is a `ValueError`. Requests of
        `generate` are always closed.
        """
        if streaming_input is not None and not isinstance(streaming_input, bool):
            raise ValueError(f"streaming_input must be True, False or None, got "
                             f"{type(streaming_input).__name__}")
        params = sampling_params or SamplingParams()
        with self._lock:
            realtime = self.mm.realtime
            if streaming_input and not realtime:
                raise ValueError("streaming_input=True needs a realtime encoder (is_realtime=True) "
                                 "registered to stream chunks into the request")
            request_id = str(next(self._request_counter))
            (request,) = self.processor.process([prompt], [params], [request_id])
            request.input_open = realtime if streaming_input is None else streaming_input
            self.core.add_request(request)
            self._live_requests[request_id] = request
            return request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the current output of every request added with
        `add_request` that the step advanced (`finished` tells the last one). A request whose input
        is open gains at most one token per call (see `append_input`); others may gain a decode
        window's worth."""
        with self._lock:
            advanced = self._advanced_live
            self._advanced_live = set()
            if self.core.has_unfinished():
                advanced.update(d.request_id for d in self.core.step())
            outputs = []
            for request_id in sorted(advanced, key=int):
                request = self._live_requests.get(request_id)
                if request is None:
                    continue
                outputs.append(request.to_output(self.tokenizer))
                if request.is_finished:
                    del self._live_requests[request_id]
            return outputs

    def append_input(self, request_id: str, chunk: Any, modality: str | None = None) -> int:
        """Stream `chunk` (an item of a realtime encoder) into a live request whose input is open; returns
        the position of its first row.

        `modality` may be left out when exactly one realtime encoder is registered. The chunk's
        rows are fed at the request's next positions without a token yet, one per decode step
        (right after any chunk still pending); the tokens sampled there stay the request's output.

        The contract, the same on every device and with every engine option (CUDA graphs, decode
        windows, async scheduling, chunked prefill, prefix caching): while a request's input is open
        it never decodes past what its caller has seen. Each `step()` gives it at most one new token,
        and nothing for it is computed ahead of the call, so a chunk appended after a `step()` lands
        at the position that follows the tokens that call returned (plus chunks still pending). While
        any open request is unfinished the whole engine steps this way (no decode windows, no
        overlapped steps: one token per `step()` for every request); `close_input(request_id)` says
        the input is complete and the engine is back at full speed from the next `step()`. A request
        left open that reaches `max_tokens` or a stop ends as usual. `ValueError` for an unknown or
        finished request, or one whose input is closed.
        """
        with self._lock:
            request = self._live_request(request_id)
            if modality is None:
                realtime = [m for m, e in self.mm.encoders.items() if e.is_realtime]
                if len(realtime) != 1:
                    raise ValueError(f"append_input needs modality= (realtime encoders registered: "
                                     f"{realtime})")
                modality = realtime[0]
            if modality == PROMPT_EMBEDS_MODALITY:
                raise ValueError("append_input streams items of a realtime encoder, not prompt_embeds "
                                 "tensors")
            encoder = self.mm.encoders.get(modality)
            if not request.input_open and encoder is not None and encoder.is_realtime:
                raise ValueError(f"the input of request {request.request_id!r} is closed (close_input was "
                                 "called, or add_request had streaming_input=False): it takes no more chunks")
            return self.mm.append_feature(request, modality, chunk).placeholder.offset

    def close_input(self, request_id: str) -> None:
        """Say that a live request's input is complete: no more `append_input` for it, and from the next
        `step()` it decodes at full speed (decode windows, CUDA graphs, async steps), its pending
        chunks still fed where they were placed. Closing twice is harmless; an unknown or finished
        request is a `ValueError`."""
        with self._lock:
            request = self._live_request(request_id)
            self.core.close_input(request.request_id)

    def _live_request(self, request_id: str) -> Request:
        """The unfinished request `request_id` added with `add_request` (ValueError otherwise)."""
        request = self._live_requests.get(request_id)
        if request is None or request.is_finished:
            raise ValueError(f"no live request {str(request_id)[:64]!r} (add it with add_request; "
                             "finished requests take no input)")
        return request

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.core.abort(request_id)
            self._live_requests.pop(request_id, None)

    # ----------------------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Abort every request and free the GPU memory now (weights, KV cache, graphs, buffers). From
        then on every method that needs the engine raises `RuntimeError` (`runner.engine.shut_down`);
        a second `shutdown()` does nothing."""
        with self._lock:
            if isinstance(self.core, ShutDown):
                return
            self.core.shutdown()
            self.mm.items.reset()
            self.mm.cache.evict_unreferenced()
            self._live_requests.clear()
            self.core = self.mm = self.processor = self._live_requests = ShutDown()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


__all__ = ["LLM"]
