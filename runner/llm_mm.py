"""The multimodal and streaming half of `runner.LLM`: encoders, media prompts, realtime input.

Kept apart from `runner/llm.py` (the engine loop) because it is a different idea: how prompts
with media become requests, and how input reaches a request that is already running.

- `LLM(..., encoders={"image": enc})` or `llm.register_encoder(enc)`: any object meeting
  `runner.multimodal.encoder_protocol.EncoderProtocol`.
- `llm.generate({"prompt": "a <image> b <embeds>", "multi_modal_data": {"image": [img],
  "prompt_embeds": [tensor]}})`: placeholders expand to each item's rows (`runner.multimodal.placeholders`).
- Streaming (vLLM `LLMEngine`-style): `rid = llm.add_request(prompt, params)`, then
  `llm.step()` until `llm.has_unfinished_requests()` is False; `llm.append_input(rid, chunk)`
  at any point streams a chunk of a realtime encoder into the live request: its rows are fed at
  the request's next positions (one per decode step), so the tokens generated after the chunk
  depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY, EncoderProtocol
from runner.multimodal.placeholders import ExpandedPrompt, expand_mm_prompt, placeholder_token
from runner.multimodal.state import MultimodalState
from runner.outputs import RequestOutput
from runner.engine.request import Request
from runner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runner.multimodal.encoder_cache import EncoderCache

_MM_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


class MultimodalLLMMixin:
    """Mixed into `runner.LLM`; relies on its `runner`, `scheduler`, `tokenizer`, `config`, ..."""

    # ----------------------------------------------------------------------------- setup
    def _init_multimodal(self, encoders: Mapping[str, Any] | None, budget_tokens: int | None,
                         max_num_batched_tokens: int) -> None:
        if budget_tokens is None:
            budget_tokens = max(4 * max_num_batched_tokens, 16384)
        self.mm = MultimodalState(
            encoders, hidden_size=self.runner.hidden_size, dtype=self.runner.dtype, device=self.device,
            budget_tokens=budget_tokens, uses_mrope=self.model_state_cls.uses_mrope,
            supports_realtime=self.model_state_cls.supports_realtime,
        )
        self.runner.mm = self.mm
        self._live_requests: dict[str, Request] = {}

    @property
    def encoder_cache(self) -> EncoderCache:
        """The engine's encoder cache (counters: num_uploads, num_encoder_calls, ...)."""
        return self.mm.cache

    def register_encoder(self, encoder: EncoderProtocol) -> None:
        """Add (or replace) the encoder of `encoder.modality` (ValueError if it is not one)."""
        self._allow_mm(realtime=bool(getattr(encoder, "is_realtime", False)))
        self.mm.register_encoder(encoder)

    def _allow_mm(self, realtime: bool = False) -> None:
        """Multimodal input from now on: re-check the model state (async scheduling, realtime)."""
        if self.async_scheduling or realtime:
            self.async_scheduling = self.model_state_cls.check_supported(
                self.config, enable_prompt_embeds=self.enable_prompt_embeds,
                async_scheduling=self._async_scheduling_requested, has_mm=True, realtime=realtime)

    # ----------------------------------------------------------------------------- prompts
    def _placeholder_id(self, i: int, modality: str) -> int:
        encoder = self.mm.encoders.get(modality)
        own_id = getattr(encoder, "placeholder_token_id", None)
        if isinstance(own_id, int):
            return own_id
        token = placeholder_token(modality, encoder)
        if self.tokenizer is None:
            raise ValueError(f"prompt {i}: the placeholder {token!r} of {modality!r} needs a tokenizer")
        tid = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if not isinstance(tid, int) or (tid == unk and token != getattr(self.tokenizer, "unk_token", None)):
            raise ValueError(f"prompt {i}: the tokenizer has no placeholder token {token!r} for modality "
                             f"{modality!r}")
        return tid

    def _parse_mm_prompt(self, i: int, prompt: dict[str, Any]):
        from runner.llm import _ParsedPrompt

        unknown = set(prompt) - _MM_PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt {i}: keys {sorted(unknown)} cannot go with multi_modal_data (a "
                             "whole-prompt tensor goes in as a 'prompt_embeds' item behind <embeds>)")
        mm_data = prompt["multi_modal_data"]
        if not isinstance(mm_data, Mapping):
            raise ValueError(f"prompt {i}: multi_modal_data must be a dict {{modality: [items]}}")
        if not self.model_state_cls.supports_mm_inputs:
            self.model_state_cls.check_supported(self.config, enable_prompt_embeds=False, has_mm=True)
        text = prompt.get("prompt")
        ids = prompt.get("prompt_token_ids")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt {i}: give 'prompt' or 'prompt_token_ids' with multi_modal_data")
            if self.tokenizer is None:
                raise ValueError(f"prompt {i}: a text prompt needs a tokenizer in the model directory")
            ids = list(self.tokenizer.encode(text))
        else:
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            if not all(isinstance(t, int) for t in ids):
                raise ValueError(f"prompt {i}: prompt_token_ids must be a list of ints")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        placeholder_ids = {m: self._placeholder_id(i, m) for m in mm_data}
        if len(set(placeholder_ids.values())) != len(placeholder_ids):
            raise ValueError(f"prompt {i}: two modalities share a placeholder token: {placeholder_ids}")
        self._allow_mm()
        expanded = expand_mm_prompt(ids, mm_data, placeholder_ids, self.mm.encoders, self.runner.hidden_size,
                                    where=f"prompt {i}")
        if not expanded.token_ids:
            raise ValueError(f"prompt {i}: the prompt is empty")
        if len(expanded.token_ids) > self.max_model_len:
            raise ValueError(f"prompt {i}: {len(expanded.token_ids)} tokens after placeholder expansion "
                             f"exceed max_model_len {self.max_model_len}")
        for feature in expanded.features:
            self.mm.cache.check_item_rows(feature.placeholder.num_embeds)
        mask = None if bool(expanded.is_token_ids.all()) else expanded.is_token_ids
        return _ParsedPrompt(text, expanded.token_ids, None, mask, expanded)

    def _attach_mm(self, request: Request, expanded: ExpandedPrompt) -> None:
        request.mm_features = expanded.features
        self.mm.set_mrope_positions(request, expanded.mrope_items)

    def _mm_rows_pending(self) -> bool:
        return self.mm.realtime and self.mm.has_pending_rows(self.scheduler.running)

    # ----------------------------------------------------------------------------- streaming
    def add_request(self, prompt: str | dict[str, Any], sampling_params: SamplingParams | None = None) -> str:
        """Queue one prompt (any form `generate` accepts) and return its request id; run it with `step()`."""
        params = sampling_params or SamplingParams()
        parsed = self._parse_prompt(0, prompt)
        self._check_params(0, parsed, params)
        request = self._make_request(0, parsed, params)
        self.scheduler.add_request(request)
        self._live_requests[request.request_id] = request
        return request.request_id

    def append_input(self, request_id: str, chunk: Any, modality: str | None = None) -> None:
        """Stream `chunk` (an item of a realtime encoder) into a live request.

        `modality` may be left out when exactly one realtime encoder is registered. The chunk's
        rows are fed at the request's next positions without a token yet, one per decode step
        (right after any chunk still pending); the tokens sampled there stay the request's output.
        """
        request = self._live_requests.get(request_id)
        if request is None or request.is_finished:
            raise ValueError(f"no live request {request_id!r} (add it with add_request; finished requests "
                             "take no input)")
        if modality is None:
            realtime = [m for m, e in self.mm.encoders.items() if e.is_realtime]
            if len(realtime) != 1:
                raise ValueError(f"append_input needs modality= (realtime encoders registered: {realtime})")
            modality = realtime[0]
        if modality == PROMPT_EMBEDS_MODALITY:
            raise ValueError("append_input streams items of a realtime encoder, not prompt_embeds tensors")
        self.mm.append_feature(request, modality, chunk)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._live_requests.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the current output of every request added with
        `add_request` that the step advanced (`finished` tells the last one)."""
        out = self.scheduler.schedule()
        if out.num_reqs == 0:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: a request cannot fit the KV cache")
            return []
        result = self.runner.execute(out)
        self.scheduler.update(out, result)
        outputs = []
        for request in out.requests:
            if request.request_id in self._live_requests:
                outputs.append(request.to_output(self.tokenizer))
                if request.is_finished:
                    del self._live_requests[request.request_id]
        return outputs


__all__ = ["MultimodalLLMMixin"]
