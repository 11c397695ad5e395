"""Prompts in, requests out: every form `generate` accepts, validated before anything is scheduled.

A prompt is text, `{"prompt_token_ids": [...]}`, a whole-prompt tensor `{"prompt_embeds": t}`
(optionally with `prompt_is_token_ids` and ids at the True positions), or text/ids with
`multi_modal_data` whose placeholders expand to each item's rows (`runner.multimodal.placeholders`).
`PromptProcessor.process` checks every prompt of a call (shape, dtype, vocabulary, context,
NaN/Inf, sampling params) and raises a `ValueError` naming the first bad prompt before building
any request, so a rejected call leaves the engine exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from runner.engine.embeds_staging import (
    DeferredEmbeds,
    num_leading_prompts,
    refuse_not_finite,
    stage_calls_as_one,
    stage_or_check,
)
from runner.engine.parsed_prompt import ParsedPrompt
from runner.engine.structured_outputs import GrammarCompiler
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY
from runner.multimodal.placeholders import (
    PassthroughBatch,
    check_dense_tensor,
    expand_mm_prompt,
    placeholder_token,
)
from runner.multimodal.prompt_text import split_at_placeholders
from runner.multimodal.state import MultimodalState
from runner.request import PLACEHOLDER_TOKEN_ID, IncrementalDetokenizer, Request
from runner.sampling_params import SamplingParams
from runner.worker.host_upload import HostUploader
from runner.worker.model_states import ModelState

PromptType = str | dict[str, Any]

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "prompt_is_token_ids", "multi_modal_data"}
_MM_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids"}


class PromptProcessor:
    """Turns prompts into `Request`s for one engine (its tokenizer, vocabulary, context, media).

    `on_multimodal()` is called before the first multimodal prompt is accepted, so the
    engine can re-check what its model state allows with media (async scheduling, realtime).
    """

    def __init__(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        hidden_size: int,
        max_model_len: int,
        enable_prompt_embeds: bool,
        eos_token_ids: Sequence[int],
        mm: MultimodalState,
        device: torch.device,
        dtype: torch.dtype,
        model_state_cls: type[ModelState],
        hf_config: Any,
        on_multimodal: Callable[[], None],
        uploader: HostUploader | None = None,
        keep_device_embeds: bool = True,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.enable_prompt_embeds = enable_prompt_embeds
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.mm = mm
        self.device = device
        self.dtype = dtype
        self.model_state_cls = model_state_cls
        self.hf_config = hf_config
        self.on_multimodal = on_multimodal
        # On a GPU, embeds are checked (and kept, within a budget) on the device; off it, on the CPU.
        self.uploader = uploader if uploader is not None and uploader.cuda else None
        self.keep_device_embeds = keep_device_embeds
        # Structured outputs: each constrained request's grammar is compiled while its call is checked.
        self.grammars = grammars

    # ----------------------------------------------------------------------------- whole calls
    def process(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams],
                request_ids: Sequence[str], *, stream_text: bool = False) -> list[Request]:
        """Validate every prompt and its params, then build the requests (all or none).

        The call's passthrough items are hashed and checked together once every prompt is parsed
        (`PassthroughBatch`); an item whose content the encoder cache already holds was checked
        when it got there and is not read again.
        """
        result = self._process_calls([(prompts, params, request_ids, stream_text)])[0][0]
        if isinstance(result, ValueError):
            raise result
        return result

    def process_leading(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams],
                        request_ids: Sequence[str], *, leading_rows: int,
                        leading_prompts: int) -> tuple[list[Request], DeferredEmbeds | None]:
        """`process`, with the NaN/Inf check and upload of the prompt embeds past the call's leading
        prompts left to the returned `DeferredEmbeds` (None when nothing is left).

        The leading prompts are those the first step can take: the fewest whose rows reach
        `leading_rows` (the step's token budget), at most `leading_prompts` (its request limit).
        Everything else about every prompt (shape, vocabulary, context, params) is checked here. Why:
        a large call's host embeds spent their whole `memcpy` before the first step could launch, the GPU
        idle all along; the later prompts' part of it can run while the first step computes.
        """
        (result,), (deferred,) = self._process_calls([(prompts, params, request_ids, False)],
                                                     leading=(leading_rows, leading_prompts))
        if isinstance(result, ValueError):
            raise result
        return result, deferred

    def process_many(self, calls: Sequence[tuple[Sequence[PromptType], Sequence[SamplingParams],
                                                 Sequence[str], bool]]) -> list[list[Request] | ValueError]:
        """`process` for several independent calls `(prompts, params, request_ids, stream_text)` at once
        (a server tick's submissions): per call its requests, or the ValueError that refused it (all or
        none within a call, as `process`). Their host prompt embeds go to the device in one upload
        with one wait for the checks, where one call per request paid an upload and a wait each."""
        return self._process_calls(calls)[0]

    def _process_calls(self, calls: Sequence[tuple[Sequence[PromptType], Sequence[SamplingParams],
                                                   Sequence[str], bool]],
                       leading: tuple[int, int] | None = None,
                       ) -> tuple[list[list[Request] | ValueError], list[DeferredEmbeds | None]]:
        """`process_many`, and with `leading` = (rows, prompts) the embeds of each call's prompts past
        its leading ones (see `process_leading`) not checked yet: per call a `DeferredEmbeds` for them."""
        results: list[list[Request] | ValueError] = []
        deferred: list[DeferredEmbeds | None] = [None] * len(calls)
        parsed_calls: list[list[ParsedPrompt]] = []
        for prompts, _, _, _ in calls:
            try:
                passthrough = PassthroughBatch()
                with passthrough.collecting(self.dtype):
                    parsed = [self.parse(i, p, passthrough) for i, p in enumerate(prompts)]
                passthrough.finish(self.dtype, known=self.mm.cache.__contains__)
            except ValueError as exc:
                results.append(exc)
                continue
            results.append([])
            parsed_calls.append(parsed)
        live = [c for c, r in enumerate(results) if not isinstance(r, ValueError)]
        # How many of each call's prompts are checked now (the rest: by its DeferredEmbeds).
        now = [len(p) if leading is None else num_leading_prompts(p, *leading) for p in parsed_calls]
        staged_now = [parsed[:n] for parsed, n in zip(parsed_calls, now)]
        bad = None
        if self.uploader is not None and self.keep_device_embeds:
            bad = stage_calls_as_one(staged_now, self.dtype, self.uploader)
        for k, c in enumerate(live):
            prompts, params, request_ids, stream_text = calls[c]
            parsed = parsed_calls[k]
            try:
                if bad is not None:
                    refuse_not_finite(bad[k], self.dtype)
                else:
                    stage_or_check(staged_now[k], self.dtype, self.uploader, keep=self.keep_device_embeds)
                grammars = [self.check_params(i, pp, sp) for i, (pp, sp) in enumerate(zip(parsed, params))]
                results[c] = [self.make_request(rid, i, pp, sp, stream_text=stream_text, grammar=g)
                              for i, (rid, pp, sp, g)
                              in enumerate(zip(request_ids, parsed, params, grammars))]
            except ValueError as exc:
                results[c] = exc
                continue
            later = parsed[now[k]:]
            if any(p.embeds is not None for p in later):
                deferred[c] = DeferredEmbeds(later, results[c][now[k]:], now[k], self.dtype, self.uploader,
                                             self.keep_device_embeds)
        return results, deferred

    # ----------------------------------------------------------------------------- one prompt
    @staticmethod
    def _token_ids(i: int, ids: Any) -> list[int] | None:
        """`prompt_token_ids` as a list of ints (None stays None); anything else is a ValueError."""
        if ids is None:
            return None
        if isinstance(ids, torch.Tensor):
            check_dense_tensor(ids, f"prompt {i}: prompt_token_ids")
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"prompt {i}: prompt_token_ids must be a 1-D integer tensor or a list of "
                                 "ints")
            ids = ids.tolist()
        if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
            raise ValueError(f"prompt {i}: prompt_token_ids must be a list of ints")
        # Plain ints (the usual case) are recognised by one pass at C speed; anything else is
        # looked at token by token (int subclasses other than bool are ints too).
        if (not set(map(type, ids)) <= {int}
                and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError(f"prompt {i}: prompt_token_ids must be a list of ints")
        return list(ids)

    def _check_ids(self, i: int, ids: Sequence[int]) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):  # min/max: C speed
            return
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def _encode(self, i: int, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt {i}: a text prompt needs a tokenizer in the model directory")
        return list(self.tokenizer.encode(text))

    def parse(self, i: int, prompt: PromptType, passthrough: PassthroughBatch | None = None) -> ParsedPrompt:
        """Validate prompt `i`. `passthrough`: collect its passthrough items there, unhashed and
        unchecked, for the caller to `finish` with the rest of its call; without it they are
        finished here."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            return self.parse_multimodal(i, prompt, passthrough)
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt {i}: expected a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt {i}: unsupported keys {sorted(map(str, unknown))[:8]}; expected "
                             f"some of {sorted(_PROMPT_KEYS)}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt {i}: 'prompt' must be a str")
        embeds = prompt.get("prompt_embeds")
        ids = self._token_ids(i, prompt.get("prompt_token_ids"))

        if embeds is None:
            if "prompt_is_token_ids" in prompt:
                raise ValueError(f"prompt {i}: prompt_is_token_ids needs prompt_embeds")
            if ids is None:
                if text is None:
                    raise ValueError(f"prompt {i}: give 'prompt', 'prompt_token_ids' or 'prompt_embeds'")
                ids = self._encode(i, text)
            if not ids:
                raise ValueError(f"prompt {i}: the prompt is empty")
            self._check_ids(i, ids)
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(ids)} tokens exceed max_model_len {self.max_model_len}")
            return ParsedPrompt(text, ids)
        return self._parse_embeds(i, prompt, text, embeds, ids)

    def _parse_embeds(self, i: int, prompt: dict[str, Any], text: str | None, embeds: Any,
                      ids: list[int] | None) -> ParsedPrompt:
        if not self.enable_prompt_embeds:
            raise ValueError(f"prompt {i}: prompt_embeds given but the LLM was built with "
                             "enable_prompt_embeds=False")
        if not isinstance(embeds, torch.Tensor):
            raise ValueError(f"prompt {i}: prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
        check_dense_tensor(embeds, f"prompt {i}: prompt_embeds")
        if embeds.dim() != 2:
            raise ValueError(
                f"prompt {i}: prompt_embeds must be 2-D (n, hidden), got shape {tuple(embeds.shape)}")
        if not embeds.is_floating_point():
            raise ValueError(f"prompt {i}: prompt_embeds must be floating point, got {embeds.dtype}")
        n, hidden = embeds.shape
        if hidden != self.hidden_size:
            raise ValueError(f"prompt {i}: prompt_embeds hidden size {hidden} != the model's "
                             f"{self.hidden_size}")
        if n == 0:
            raise ValueError(f"prompt {i}: prompt_embeds has no rows")
        if n > self.max_model_len:
            raise ValueError(f"prompt {i}: {n} prompt_embeds rows exceed max_model_len {self.max_model_len}")
        mask = prompt.get("prompt_is_token_ids")
        token_ids = [PLACEHOLDER_TOKEN_ID] * n
        if mask is not None:
            if isinstance(mask, torch.Tensor):
                check_dense_tensor(mask, f"prompt {i}: prompt_is_token_ids")
            try:
                mask = torch.as_tensor(mask)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"prompt {i}: prompt_is_token_ids must be a bool tensor or list, got "
                                 f"{type(mask).__name__}") from None
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
                    if not 0 <= ids[p] < self.vocab_size:
                        raise ValueError(f"prompt {i}: token id {ids[p]} at position {p} is outside "
                                         f"the vocabulary [0, {self.vocab_size})")
                    token_ids[p] = ids[p]
            else:
                mask = None
        elif ids is not None and len(ids) != n:
            raise ValueError(f"prompt {i}: prompt_token_ids has {len(ids)} entries, prompt_embeds {n} rows")
        return ParsedPrompt(text, token_ids, embeds, mask)

    # ----------------------------------------------------------------------------- media prompts
    def placeholder_id(self, i: int, modality: str) -> int:
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

    def parse_multimodal(self, i: int, prompt: dict[str, Any],
                         passthrough: PassthroughBatch | None = None) -> ParsedPrompt:
        unknown = set(prompt) - _MM_PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt {i}: keys {sorted(map(str, unknown))[:8]} cannot go with "
                             "multi_modal_data (a whole-prompt tensor goes in as a 'prompt_embeds' item "
                             "behind <embeds>)")
        mm_data = prompt["multi_modal_data"]
        if not isinstance(mm_data, Mapping):
            raise ValueError(f"prompt {i}: multi_modal_data must be a dict {{modality: [items]}}")
        if not self.model_state_cls.supports_mm_inputs:  # raises, naming the model type and the reason
            self.model_state_cls.check_supported(self.hf_config, enable_prompt_embeds=False, has_mm=True)
        if PROMPT_EMBEDS_MODALITY in mm_data and not self.enable_prompt_embeds:
            raise ValueError(f"prompt {i}: a prompt_embeds item given but the LLM was built with "
                             "enable_prompt_embeds=False")
        text = prompt.get("prompt")
        ids = prompt.get("prompt_token_ids")
        positions = None
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt {i}: give 'prompt' or 'prompt_token_ids' with multi_modal_data")
            if self.tokenizer is None:
                raise ValueError(f"prompt {i}: a text prompt needs a tokenizer in the model directory")
            # Split at the placeholder strings: works whether or not the tokenizer knows them.
            strings = {placeholder_token(m, self.mm.encoders.get(m)): m for m in mm_data}
            ids, positions = split_at_placeholders(self.tokenizer, text, strings)
            placeholder_ids = {}
            for pos, m in positions:
                own = getattr(self.mm.encoders.get(m), "placeholder_token_id", None)
                if isinstance(own, int):
                    ids[pos] = own
                placeholder_ids.setdefault(m, ids[pos])
            placeholder_ids.update({m: 0 for m in mm_data if m not in placeholder_ids})
        else:
            ids = self._token_ids(i, ids)
            placeholder_ids = {m: self.placeholder_id(i, m) for m in mm_data}
            if len(set(placeholder_ids.values())) != len(placeholder_ids):
                raise ValueError(f"prompt {i}: two modalities share a placeholder token: {placeholder_ids}")
        self._check_ids(i, ids)
        self.on_multimodal()
        expanded = expand_mm_prompt(ids, mm_data, placeholder_ids, self.mm.encoders, self.hidden_size,
                                    where=f"prompt {i}", placeholder_positions=positions, dtype=self.dtype,
                                    passthrough=passthrough, uuids=prompt.get("multi_modal_uuids"))
        if not expanded.token_ids:
            raise ValueError(f"prompt {i}: the prompt is empty")
        if len(expanded.token_ids) > self.max_model_len:
            raise ValueError(f"prompt {i}: {len(expanded.token_ids)} tokens after placeholder expansion "
                             f"exceed max_model_len {self.max_model_len}")
        for feature in expanded.features:
            self.mm.cache.check_item_rows(feature.placeholder.num_embeds)
        # Every item takes >= 1 position, so the mask is all True exactly when there is no item.
        mask = expanded.is_token_ids if expanded.features else None
        return ParsedPrompt(text, expanded.token_ids, None, mask, expanded)

    # ----------------------------------------------------------------------------- requests
    def check_params(self, i: int, parsed: ParsedPrompt, params: SamplingParams) -> Any:
        """Refuse params the prompt or the engine cannot honour; the compiled grammar of a constrained
        request (structured outputs: a ValueError naming the field if it does not compile), else None."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"prompt {i}: sampling params must be SamplingParams, got {type(params).__name__}")
        if params.prompt_logprobs is not None and parsed.embeds is not None:
            self.model_state_cls.check_supported(self.hf_config, enable_prompt_embeds=True,
                                                 prompt_logprobs=True)
            raise ValueError(f"prompt {i}: prompt_logprobs are not available for a prompt-embeds prompt")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"prompt {i}: stop strings need a tokenizer in the model directory")
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise ValueError(f"prompt {i}: structured outputs are not available in this engine")
        return self.grammars.compile(params.structured_outputs, where=f"prompt {i}: ")

    def make_request(self, request_id: str, i: int, parsed: ParsedPrompt, params: SamplingParams, *,
                     stream_text: bool = False, grammar: Any = None) -> Request:
        """A request for a validated prompt. `stream_text`: keep its text up to date token by token
        (an incremental detokenizer), for callers that stream text deltas. `grammar`: the compiled
        grammar `check_params` returned (the request gets its own matcher over it)."""
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        req = Request(
            request_id=request_id, index=i, prompt_token_ids=parsed.token_ids, sampling_params=params,
            prompt=parsed.text, prompt_embeds=parsed.embeds, is_token_ids=parsed.is_token_ids,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, generator=generator,
        )
        if parsed.mm is not None:
            req.mm_features = parsed.mm.features
            self.mm.set_mrope_positions(req, parsed.mm.mrope_items)
        if (params.stop_strings or stream_text) and self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        if grammar is not None:
            req.grammar = self.grammars.request_grammar(grammar, sorted(self.eos_token_ids))
        return req


__all__ = ["ParsedPrompt", "PromptProcessor", "PromptType"]
