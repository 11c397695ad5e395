"""The offline API: `LLM(model_dir, ...)` and `LLM.generate(prompts, sampling_params)`.

Shaped like vLLM's `LLM` on purpose. Construction fails fast: the model directory's config is
read and checked against its model state's capabilities before a single weight loads. `generate`
validates every prompt of the call before any of them is scheduled, then runs the
schedule -> execute -> update loop until all are done, and returns one `RequestOutput` per prompt
in input order. After every call all KV blocks and request slots are free again.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runner.engine.async_loop import AsyncLoop
from runner.engine.block_manager import BlockManager
from runner.worker.kv_cache import determine_num_blocks
from runner.llm_mm import MultimodalLLMMixin
from runner.multimodal.placeholders import ExpandedPrompt
from runner.worker.model_runner import DEFAULT_DECODE_WINDOW, MAX_DECODE_WINDOW, ModelRunner
from runner.worker.model_states import load_hf_config, resolve_model_state_cls
from runner.outputs import RequestOutput
from runner.engine.prefix_cache import PrefixCachingBlockManager
from runner.engine.request import PLACEHOLDER_TOKEN_ID, IncrementalDetokenizer, Request
from runner.sampling_params import SamplingParams
from runner.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "prompt_is_token_ids", "multi_modal_data"}
# Extra room reserved on the GPU beyond the profiled peak: CUDA graphs, allocator slack.
_GPU_HEADROOM_BYTES = 1 << 30


def _resolve_dtype(dtype: str | torch.dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        found = getattr(text, "dtype", None) or getattr(config, "dtype", None)
        if isinstance(found, str):
            found = _DTYPES.get(found.replace("torch.", ""))
        return found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class _ParsedPrompt:
    text: str | None
    token_ids: list[int]
    embeds: torch.Tensor | None = None
    is_token_ids: torch.Tensor | None = None
    mm: ExpandedPrompt | None = None


def _check_embeds_finite(parsed: list[_ParsedPrompt]) -> None:
    """NaN/Inf in any prompt's embeds is a ValueError naming the first such prompt.

    One host sync per device for the whole call instead of one per prompt (64 prompts on a GPU
    paid 64 round trips before anything was scheduled).
    """
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, p in enumerate(parsed):
        if p.embeds is not None:
            by_device.setdefault(p.embeds.device, []).append((i, p.embeds))
    bad = []
    for items in by_device.values():
        finite = torch.stack([torch.isfinite(e).all() for _, e in items]).tolist()
        bad += [i for (i, _), ok in zip(items, finite) if not ok]
    if bad:
        raise ValueError(f"prompt {min(bad)}: prompt_embeds contains NaN or Inf")


class LLM(MultimodalLLMMixin):
    """An in-process generation engine over a local Hugging Face model directory.

    Arguments beyond vLLM's familiar ones: `num_kv_blocks` fixes the KV pool size (otherwise it
    comes from `kv_cache_memory` bytes, or on the GPU from `gpu_memory_utilization` after a
    profiling step; 256 MiB on the CPU). `decode_window` is how many greedy decode steps run back
    to back between host syncs when every running request is a plain greedy decode (default 32
    with CUDA graphs, 1 otherwise; nothing waiting is admitted inside a window, so a smaller
    window trades throughput for admission latency). `async_scheduling` (default on, except with
    multimodal input) plans and launches step n+1 while step n runs on the device
    (`runner.engine.async_loop`); the outputs are the synchronous loop's. Counters for tests and monitoring:
    `num_free_blocks`, `num_total_blocks`, `num_free_slots`, `num_total_slots`, `num_steps`,
    `num_preemptions`, `num_async_steps` (steps launched while the previous one was in flight).
    """

    def __init__(
        self,
        model: str | pathlib.Path,
        *,
        enable_prompt_embeds: bool = False,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        decode_window: int | None = None,
        encoders: Mapping[str, Any] | None = None,
        enable_prefix_caching: bool = False,
        async_scheduling: bool | None = None,
        encoder_cache_budget: int | None = None,
    ) -> None:
        model_dir = str(model)
        config = load_hf_config(model_dir)
        self.model_state_cls = resolve_model_state_cls(config)
        self.async_scheduling = self.model_state_cls.check_supported(
            config, enable_prompt_embeds=enable_prompt_embeds, async_scheduling=async_scheduling,
            has_mm=bool(encoders),
            realtime=any(getattr(e, "is_realtime", False) for e in (encoders or {}).values()))
        self._async_scheduling_requested = async_scheduling
        self.config = config
        self.enable_prompt_embeds = enable_prompt_embeds

        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        on_gpu = device.type == "cuda"
        max_num_seqs = max_num_seqs or (256 if on_gpu else 32)
        max_num_batched_tokens = max_num_batched_tokens or (8192 if on_gpu else 2048)
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        context = getattr(text, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = context
        elif max_model_len < 1 or max_model_len > context:
            raise ValueError(
                f"max_model_len must be in [1, {context}] (the model's context), got {max_model_len}")
        self.seed = seed
        torch.manual_seed(seed)

        self.tokenizer = self._load_tokenizer(model_dir)
        self.eos_token_ids = self._eos_token_ids(model_dir)
        self.runner = ModelRunner(
            model_dir, config, dtype=_resolve_dtype(dtype, config), device=device,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size,
            enable_prompt_embeds=enable_prompt_embeds, eos_token_ids=tuple(self.eos_token_ids),
        )
        peak = self.runner.profile_peak_memory() if on_gpu and kv_cache_memory is None else 0
        num_blocks = determine_num_blocks(
            self.runner.kv_spec, device, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            peak_activation_bytes=peak + (_GPU_HEADROOM_BYTES if on_gpu else 0),
        )
        if num_blocks * block_size < max_model_len:
            logger.warning("KV cache holds %d tokens; max_model_len lowered from %d", num_blocks * block_size,
                           max_model_len)
            max_model_len = num_blocks * block_size
            self.runner.set_max_model_len(max_model_len)
        self.max_model_len = max_model_len
        self.runner.allocate_kv_cache(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_manager = (PrefixCachingBlockManager(num_blocks, block_size) if enable_prefix_caching
                              else BlockManager(num_blocks, block_size))
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            on_admit=self.runner.add_request, on_release=self.runner.remove_request,
        )
        self.use_cuda_graphs = on_gpu and not enforce_eager
        if self.use_cuda_graphs:
            self.runner.capture_cuda_graphs()
        # Greedy decode steps run up to this many at a time between host syncs (CUDA graphs only).
        if decode_window is None:
            decode_window = DEFAULT_DECODE_WINDOW if self.use_cuda_graphs else 1
        if not 1 <= decode_window <= MAX_DECODE_WINDOW:
            raise ValueError(f"decode_window must be in [1, {MAX_DECODE_WINDOW}], got {decode_window}")
        self.decode_window = decode_window
        # Steps launched while the previous one was still on the device (async scheduling).
        self.num_async_steps = 0
        self._request_counter = itertools.count()
        self._init_multimodal(encoders, encoder_cache_budget, max_num_batched_tokens)

    # ----------------------------------------------------------------------------- helpers
    @staticmethod
    def _load_tokenizer(model_dir: str):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("no tokenizer in %s (%s): text prompts and stop strings unavailable",
                           model_dir, exc)
            return None

    def _eos_token_ids(self, model_dir: str) -> list[int]:
        ids: list[int] = []
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
        except (OSError, ValueError):
            eos = getattr(self.config, "eos_token_id", None)
        if eos is not None:
            ids.extend(eos if isinstance(eos, list | tuple) else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(int(i) for i in ids))

    def get_tokenizer(self):
        return self.tokenizer

    # ----------------------------------------------------------------------------- counters
    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.num_free_slots

    @property
    def num_total_slots(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def num_steps(self) -> int:
        """Forward passes run so far (tests check that a rejected call ran none)."""
        return self.runner.num_forward_steps

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ----------------------------------------------------------------------------- validation
    def _parse_prompt(self, i: int, prompt: PromptType) -> _ParsedPrompt:
        vocab = self.runner.vocab_size
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            return self._parse_mm_prompt(i, prompt)
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt {i}: expected a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt {i}: unsupported keys {sorted(unknown)}; expected some of "
                             f"{sorted(_PROMPT_KEYS)}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt {i}: 'prompt' must be a str")
        embeds = prompt.get("prompt_embeds")
        ids = prompt.get("prompt_token_ids")
        if ids is not None:
            if isinstance(ids, torch.Tensor):
                ids = ids.tolist()
            if not isinstance(ids, Sequence) or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"prompt {i}: prompt_token_ids must be a list of ints")
            ids = list(ids)

        if embeds is None:
            if "prompt_is_token_ids" in prompt:
                raise ValueError(f"prompt {i}: prompt_is_token_ids needs prompt_embeds")
            if ids is None:
                if text is None:
                    raise ValueError(f"prompt {i}: give 'prompt', 'prompt_token_ids' or 'prompt_embeds'")
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i}: a text prompt needs a tokenizer in the model directory")
                ids = list(self.tokenizer.encode(text))
            if not ids:
                raise ValueError(f"prompt {i}: the prompt is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(ids)} tokens exceed max_model_len {self.max_model_len}")
            return _ParsedPrompt(text, ids)

        if not self.enable_prompt_embeds:
            raise ValueError(f"prompt {i}: prompt_embeds given but the LLM was built with "
                             "enable_prompt_embeds=False")
        if not isinstance(embeds, torch.Tensor):
            raise ValueError(f"prompt {i}: prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
        if embeds.dim() != 2:
            raise ValueError(
                f"prompt {i}: prompt_embeds must be 2-D (n, hidden), got shape {tuple(embeds.shape)}")
        if not embeds.is_floating_point():
            raise ValueError(f"prompt {i}: prompt_embeds must be floating point, got {embeds.dtype}")
        n, hidden = embeds.shape
        if hidden != self.runner.hidden_size:
            raise ValueError(f"prompt {i}: prompt_embeds hidden size {hidden} != the model's "
                             f"{self.runner.hidden_size}")
        if n == 0:
            raise ValueError(f"prompt {i}: prompt_embeds has no rows")
        if n > self.max_model_len:
            raise ValueError(f"prompt {i}: {n} prompt_embeds rows exceed max_model_len {self.max_model_len}")
        mask = prompt.get("prompt_is_token_ids")
        token_ids = [PLACEHOLDER_TOKEN_ID] * n
        if mask is not None:
            mask = torch.as_tensor(mask)
            if mask.dtype != torch.bool:
                raise ValueError(f"prompt {i}: prompt_is_token_ids must be bool, got {mask.dtype}")
            if tuple(mask.shape) != (n,):
                raise ValueError(f"prompt {i}: prompt_is_token_ids has shape {tuple(mask.shape)}, "
                                 f"prompt_embeds has {n} rows")
            mask = mask.cpu()
            positions = mask.nonzero().flatten().tolist()
            if positions:
                if ids is None or len(ids) != n:
                    raise ValueError(f"prompt {i}: prompt_is_token_ids marks token positions, so "
                                     f"prompt_token_ids must be given with {n} entries")
                for p in positions:
                    if not 0 <= ids[p] < vocab:
                        raise ValueError(f"prompt {i}: token id {ids[p]} at position {p} is outside "
                                         f"the vocabulary [0, {vocab})")
                    token_ids[p] = ids[p]
            else:
                mask = None
        elif ids is not None and len(ids) != n:
            raise ValueError(f"prompt {i}: prompt_token_ids has {len(ids)} entries, prompt_embeds {n} rows")
        return _ParsedPrompt(text, token_ids, embeds, mask)

    def _check_params(self, i: int, parsed: _ParsedPrompt, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"prompt {i}: sampling params must be SamplingParams, got {type(params).__name__}")
        if params.prompt_logprobs is not None and parsed.embeds is not None:
            self.model_state_cls.check_supported(self.config, enable_prompt_embeds=True, prompt_logprobs=True)
            raise ValueError(f"prompt {i}: prompt_logprobs are not available for a prompt-embeds prompt")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"prompt {i}: stop strings need a tokenizer in the model directory")

    # ----------------------------------------------------------------------------- generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
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

        # Validate everything before anything is scheduled.
        parsed = [self._parse_prompt(i, p) for i, p in enumerate(prompts)]
        _check_embeds_finite(parsed)
        for i, (pp, sp) in enumerate(zip(parsed, params_list)):
            self._check_params(i, pp, sp)
        requests = [self._make_request(i, pp, sp) for i, (pp, sp) in enumerate(zip(parsed, params_list))]
        if not requests:
            return []

        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        for req in requests:
            self.scheduler.add_request(req)
        try:
            self._run_until_done(bar)
        finally:
            for req in requests:  # an error or interrupt mid-run must not leak blocks or slots
                if not req.is_finished:
                    self.scheduler.abort_request(req.request_id)
            bar.close()
        return [req.to_output(self.tokenizer) for req in requests]

    def _run_until_done(self, bar) -> None:
        if self.async_scheduling:
            AsyncLoop(self, bar).run()
            return
        scheduler, runner = self.scheduler, self.runner
        while scheduler.has_unfinished():
            if self._run_decode_window(bar):
                continue
            out = scheduler.schedule()
            if out.num_reqs == 0:
                raise RuntimeError("scheduler made no progress: a request cannot fit the KV cache")
            result = runner.execute(out)
            finished = scheduler.update(out, result)
            if finished:
                bar.update(len(finished))

    def _decode_window_size(self) -> int:
        """Greedy decode steps that may run back to back now (1: take a normal step)."""
        scheduler, runner = self.scheduler, self.runner
        if not runner.graphs:
            return 1
        k = scheduler.decode_window_size(self.decode_window, self.max_model_len)
        if k > 1 and self._mm_rows_pending():  # decode windows skip the encoder-row gather
            return 1
        return k if k > 1 and runner.can_replay(len(scheduler.running)) else 1

    def _run_decode_window(self, bar) -> bool:
        """Run one decode window if one can run now (nothing in flight); whether it ran."""
        k = self._decode_window_size()
        if k <= 1:
            return False
        out = self.scheduler.schedule_decode_window(k)
        if out is None:
            return False
        finished = self.scheduler.update_window(out, self.runner.execute_decode_window(out, k))
        if finished:
            bar.update(len(finished))
        return True

    def _make_request(self, i: int, parsed: _ParsedPrompt, params: SamplingParams) -> Request:
        request_id = str(next(self._request_counter))
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        req = Request(
            request_id=request_id, index=i, prompt_token_ids=parsed.token_ids, sampling_params=params,
            prompt=parsed.text, prompt_embeds=parsed.embeds, is_token_ids=parsed.is_token_ids,
            eos_token_ids=frozenset(self.eos_token_ids), max_model_len=self.max_model_len,
            generator=generator,
        )
        if parsed.mm is not None:
            self._attach_mm(req, parsed.mm)
        if params.stop_strings:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return req


__all__ = ["LLM"]
