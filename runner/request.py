"""One generation request as the engine tracks it: tokens, progress, KV blocks, stop state.

The prompt is always a list of token ids, with placeholder id 0 where the prompt carries an
embedding row instead of a token. The placeholder never indexes the vocabulary: the
inputs_embeds assembly masks it and the prompt-embeds overlay writes the row. Keeping one id
list for every prompt kind lets the scheduler, block tables and preemption-by-recompute treat
all requests alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from runner.outputs import CompletionOutput, RequestOutput
from runner.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class TokenGrammar(Protocol):
    """A request's structured-outputs state as the request sees it (`runner.engine.structured_outputs`):
    it accepts each output token in order and says when the grammar has ended; a token it refused is
    kept in `rejected_token`."""

    rejected_token: int | None

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


def fast_decode(tokenizer) -> Callable[..., str]:
    """`tokenizer.decode` for a flat list of int ids. A Hugging Face tokenizer's `decode` walks every id
    through `to_py_obj` (an isinstance per id) and then calls its `_decode`, which is all a list of ints
    needs, at a fraction of the cost (`batch_decode` does the same walk over the whole batch). Other
    tokenizer objects keep their `decode`."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer._decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Text of the generated tokens, decoded a few tokens at a time (vLLM's offsets scheme).

    Decoding `ids[prefix_offset:]` and subtracting the text of `ids[prefix_offset:read_offset]`
    gives the new characters with correct spacing for SentencePiece/BPE tokenizers, at a
    cost independent of the sequence length. Incomplete UTF-8 (a trailing U+FFFD) is held back
    until the next token completes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, output_ids: list[int]) -> str:
        """Decode the newest token(s) of `output_ids`; returns the newly added text."""
        decode = self._decode
        prefix = decode(output_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(output_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(output_ids)
            self.text += new_text
            return new_text
        return ""

    def flush(self, output_ids: list[int]) -> None:
        """The request ended: add what was held back (a trailing incomplete character decodes as
        U+FFFD, as a one-shot decode of the ids gives), so the text equals the full decode."""
        decode = self._decode
        prefix = decode(output_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(output_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(output_ids)


@dataclass(eq=False)  # an entity, equal only to itself: a field-wise `==` is slow in list scans
class Request:
    """A request's whole life in the engine.

    `prompt_embeds` (n, hidden) and `is_token_ids` (bool n) are kept for the request's life so
    that a preempted request can be re-admitted (its overlay rows are uploaded again) and its
    prefill recomputed. `slot` is the row of the per-request state tensors (overlay, block
    table, token table) while the request is running; None otherwise.
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    is_token_ids: torch.Tensor | None = None
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    # Set when the step that finished the request is processed.
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # Multimodal state (runner.multimodal.placeholders / runner.multimodal.state): media and
    # passthrough items sorted by offset (realtime chunks are appended while the request runs);
    # M-RoPE prompt positions (3, n) and decode delta on M-RoPE models; chained prefix-cache hashes
    # of its full blocks.
    mm_features: list = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # Prompt tokens found in the prefix cache when the request was first admitted (vLLM's
    # num_cached_tokens); None until then.
    num_cached_tokens: int | None = None
    # Incremental outputs (EngineCore.step): output tokens and text characters already reported.
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    finish_emitted: bool = False
    # Why the request failed (status FINISHED_ERROR), e.g. its item's encoder raised.
    error: str | None = None
    # The caller may still stream input into it (`LLM.append_input`) until it closes it: the engine
    # then never decodes it past what the caller has seen (`EngineCore`, lockstep steps).
    input_open: bool = False
    # Structured outputs: the grammar's state after the output tokens (None: unconstrained). Its steps
    # sample through a token mask, never in a decode window (`Scheduler.decode_window_size`).
    grammar: TokenGrammar | None = None
    _real_prompt_ids: list[int] | None = field(default=None, repr=False)
    # Async scheduling (runner.engine.async_loop): tokens sampled on the device whose values the host has
    # not read yet. The scheduler plans the next step as if they were known (they count in
    # `num_tokens`); their ids are fed to that step on the device.
    num_pending_outputs: int = 0
    # Tokens whose KV the request needs: prompt plus everything generated so far (pending tokens
    # included). A plain field (kept in step by `append_output_token`) because the scheduler reads
    # it for every request every step.
    num_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    # ----------------------------------------------------------------------------- sizes
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def real_prompt_token_ids(self) -> list[int]:
        """Prompt ids at real-token positions only (what penalties may count), cached."""
        if self._real_prompt_ids is None:
            if self.is_token_ids is None:
                self._real_prompt_ids = (list(self.prompt_token_ids) if self.prompt_embeds is None else [])
            else:
                mask = self.is_token_ids.tolist()
                self._real_prompt_ids = [t for t, m in zip(self.prompt_token_ids, mask) if m]
        return self._real_prompt_ids

    def token_id_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    # ----------------------------------------------------------------------------- progress
    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the KV is gone, the generated tokens stay and are re-prefilled."""
        if self.num_pending_outputs:
            raise RuntimeError(f"request {self.request_id}: preempted with sampled tokens still in flight")
        self.num_computed_tokens = 0
        self.block_ids = []
        self.status = RequestStatus.WAITING
        self.num_preemptions += 1

    def add_pending_output(self) -> None:
        """A token was sampled on the device; its value is read later (`resolve_pending_output`)."""
        self.num_pending_outputs += 1
        self.num_tokens += 1

    def resolve_pending_output(self, token_id: int, logprob: float | None = None,
                               top_logprobs: dict[int, float] | None = None) -> None:
        """The oldest pending token's value arrived: it becomes an ordinary output token."""
        if self.num_pending_outputs < 1:
            raise RuntimeError(f"request {self.request_id}: a sampled token arrived with none pending")
        self.num_pending_outputs -= 1
        self.num_tokens -= 1
        self.append_output_token(token_id, logprob, top_logprobs)

    def drop_pending_outputs(self) -> None:
        """The request finished while tokens were still in flight: those are discarded."""
        self.num_tokens -= self.num_pending_outputs
        self.num_pending_outputs = 0

    @property
    def finishes_by_length_when_resolved(self) -> bool:
        """With its pending tokens read, the request will be at max_tokens or the context limit
        whatever their values: the scheduler does not plan another step for it."""
        if not self.num_pending_outputs:
            return False
        if self.num_output_tokens + self.num_pending_outputs >= self.sampling_params.max_tokens:
            return True
        return self.max_model_len is not None and self.num_tokens >= self.max_model_len

    def append_output_token(self, token_id: int, logprob: float | None = None,
                            top_logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1
        if self.grammar is not None:
            self.grammar.accept_token(token_id)
        if self.logprobs is not None:
            entry = dict(top_logprobs) if top_logprobs else {}
            if logprob is not None:
                entry[token_id] = logprob
                self.cumulative_logprob += logprob
            self.logprobs.append(entry)

    def check_stop(self) -> bool:
        """Decide, after a token was appended, whether the request is done (vLLM semantics).

        EOS and stop tokens stay in `token_ids` (not in the text); a stop string is trimmed from
        the text unless `include_stop_str_in_output` (the tokens that produced it stay).
        `min_tokens` suppresses every stop but the length limit. Unless a stop string ended it, a
        finished request's streamed text gets its held-back tail, so it equals the one-shot decode of
        its tokens. A request with a grammar stops when the grammar has ended (after EOS, even with
        `ignore_eos`), and fails if its grammar refused a token (the token mask should make that
        impossible).
        """
        done = self._check_stop()
        if done and self.detokenizer is not None and not isinstance(self.stop_reason, str):
            self.detokenizer.flush(self.output_token_ids)
        return done

    def _check_stop(self) -> bool:
        params = self.sampling_params
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if self.detokenizer is not None:
            new_text = self.detokenizer.step(self.output_token_ids)
        else:
            new_text = ""
        grammar = self.grammar
        if grammar is not None:
            if grammar.rejected_token is not None:
                self.status = RequestStatus.FINISHED_ERROR
                self.error = f"structured outputs: the grammar refused sampled token {grammar.rejected_token}"
                return True
            if grammar.is_terminated():
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if last in params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
                return True
            if new_text and params.stop_strings:
                hit = self._find_stop_string(new_text)
                if hit is not None:
                    self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, hit
                    return True
        if n_out >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        # Confirmed tokens only: under async scheduling `num_tokens` also counts tokens in flight.
        if self.max_model_len is not None and self.num_prompt_tokens + n_out >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def append_window_tokens(self, tokens: list[int]) -> int:
        """Append a decode window's tokens up to the one that stops the request; returns how many.

        Equal to `append_output_token` + `check_stop` token by token (which it runs when the request
        streams text or keeps logprobs); otherwise the stops are found without a per-token call: the
        length limits by arithmetic, EOS and stop ids by one scan: the per-token way kept the GPU idle
        at every window boundary.
        """
        if self.detokenizer is not None or self.logprobs is not None:
            for n, token in enumerate(tokens, 1):
                self.append_output_token(token)
                if self.check_stop():
                    return n
            return len(tokens)
        params = self.sampling_params
        n0 = len(self.output_token_ids)
        room = params.max_tokens - n0
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - self.num_prompt_tokens - n0)
        take = min(len(tokens), max(room, 1))  # a token is always appended before the checks
        eos = self.eos_token_ids if not params.ignore_eos else ()
        stop_ids = params.stop_token_ids
        n, status, reason = take, None, None
        if eos or stop_ids:
            first_checked = max(0, params.min_tokens - n0 - 1)  # stops count from min_tokens outputs on
            for i in range(first_checked, take):
                token = tokens[i]
                if token in eos:
                    n, status = i + 1, RequestStatus.FINISHED_STOPPED
                    break
                if token in stop_ids:
                    n, status, reason = i + 1, RequestStatus.FINISHED_STOPPED, token
                    break
        if status is None and n >= room:
            status = RequestStatus.FINISHED_LENGTH
        self.output_token_ids.extend(tokens[:n])
        self.num_tokens += n
        if status is not None:
            self.status, self.stop_reason = status, reason
        return n

    def _find_stop_string(self, new_text: str) -> str | None:
        """Search only the tail that the new text could have completed; trim the text at the hit (after
        it with `include_stop_str_in_output`: vLLM keeps the stop string, drops what follows it)."""
        text = self.detokenizer.text
        keep = self.sampling_params.include_stop_str_in_output
        for stop in self.sampling_params.stop_strings:
            start = max(0, len(text) - len(new_text) - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1:
                self.detokenizer.text = text[: idx + len(stop) if keep else idx]
                return stop
        return None

    # ----------------------------------------------------------------------------- output
    def to_output(self, tokenizer) -> RequestOutput:
        if self.detokenizer is not None:
            text = self.detokenizer.text
        elif tokenizer is not None:
            text = fast_decode(tokenizer)(self.output_token_ids,
                                          skip_special_tokens=self.sampling_params.skip_special_tokens)
        else:
            text = ""
        finish = self.status.value if self.is_finished else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.output_token_ids),
            finish_reason=finish,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[completion],
            finished=self.is_finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens or 0,
            error=self.error,
        )
