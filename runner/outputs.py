"""Request outputs, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters at one moment (`LLM.stats()`): the KV pool and request slots (all free again
    after every `generate`), forward steps run, preemptions, steps launched behind another (async),
    decode windows launched behind a window or a step, steps run in lockstep for open realtime input,
    and Triton kernel builds since construction began (0 off CUDA)."""

    num_total_blocks: int
    num_free_blocks: int
    num_total_slots: int
    num_free_slots: int
    num_steps: int
    num_preemptions: int
    num_async_steps: int
    num_pipelined_windows: int
    num_windows_behind_steps: int
    num_lockstep_steps: int
    kernel_compiles: int

    @property
    def all_free(self) -> bool:
        """Every KV block and request slot is free (so after every `generate`)."""
        return self.num_free_blocks == self.num_total_blocks and self.num_free_slots == self.num_total_slots


@dataclass
class CompletionOutput:
    """One generated sequence: its tokens, text, why it stopped and (if asked) logprobs.

    `logprobs[i]` is a dict `{token_id: logprob}` for step i holding at least the sampled
    token. `finish_reason` is "stop" (EOS, stop string or stop token) or "length".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt. `prompt_token_ids` holds placeholder ids (0) where the prompt
    carried embeddings; `prompt_logprobs` is set only when asked for on a token prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the request failed while running (finish_reason "error")


@dataclass
class RequestDelta:
    """What one engine step added to a request (`EngineCore.step`): its new tokens, their text
    when the request streams text, their logprobs when asked for, and how it ended once it did.

    Text deltas hold back a possible stop string's prefix until it is known not to be one, so
    streamed text always adds up to the final `CompletionOutput.text`.

    A request's first delta also carries what its caller cannot know beforehand: its
    `prompt_logprobs` when it asked for them (complete: the prompt is prefilled before the first
    token), and its `prompt_token_ids` when placeholder expansion made them (a prompt with media items:
    each placeholder repeated for its item's rows); both None otherwise and on later deltas.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    new_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # what went wrong, with finish_reason "error"
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ids: list[int] | None = None


class GenerationError(RuntimeError):
    """Some prompts of a call failed while running (an encoder raised or returned NaN/Inf for one of
    their items, a server refused or dropped one); the others finished and their outputs are kept here.
    The one partial-failure error of every generation path: `LLM.generate`, `Bridge.generate` and the
    remote backend.

    `failed` maps the index of each failed prompt to what went wrong (the exception, or the engine's
    message); `errors` maps it to that as text; `outputs[i]` is the `RequestOutput` of prompt i, or
    None for a failed one.
    """

    def __init__(self, failed: Mapping[int, BaseException | str], outputs: Sequence[Any]) -> None:
        self.failed = dict(sorted(failed.items()))
        self.errors = {i: str(e) for i, e in self.failed.items()}
        self.outputs = list(outputs)
        shown = list(self.failed.items())[:3]
        detail = "; ".join(
            f"prompt {i}: " + (e if isinstance(e, str) else f"{type(e).__name__}: {e}")[:300]
            for i, e in shown)
        more = f"; and {len(self.failed) - len(shown)} more" if len(self.failed) > len(shown) else ""
        done = len(self.outputs) - len(self.failed)
        super().__init__(
            f"{len(self.failed)} of {len(self.outputs)} prompts failed ({done} completed, kept in .outputs): "
            f"{detail}{more}")
