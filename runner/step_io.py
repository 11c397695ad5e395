"""What passes between the scheduler and the worker each step: the plan and the sampled result.

A module of its own so that both sides import it and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.request import Request

if TYPE_CHECKING:
    import torch


@dataclass
class SchedulerOutput:
    """One step's plan. `requests[i]` runs `num_scheduled_tokens[i]` tokens starting at its
    `num_computed_tokens`; `samples[i]` says whether that step completes everything the request
    knows, so the runner must sample its next token; `decoding[i]` whether the request is past its
    prompt when planned (a per-request phase: a one-token prefill chunk is not a decode).

    `decoding` may be left out: it is then read off the requests at construction, which is
    planning time (before `Scheduler.mark_launched` advances them).
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    decoding: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.decoding) != len(self.requests):
            self.decoding = [r.num_computed_tokens >= r.num_prompt_tokens for r in self.requests]

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def is_single_token(self) -> bool:
        """Every request runs exactly one token (decode attention kernels and graph buckets apply)."""
        return all(n == 1 for n in self.num_scheduled_tokens)

    @property
    def is_decode_only(self) -> bool:
        """Every request runs one token and is past its prompt. Counting tokens is not enough: on
        M-RoPE models a one-token prefill chunk needs its 3-D prompt position, not a decode one."""
        return self.is_single_token and all(self.decoding)


@dataclass
class StepResult:
    """What the runner hands back per scheduled request (None where it did not sample)."""

    sampled_token_ids: list[int | None]
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    # request_id -> (index of the first entry, entries) for the prompt positions computed this
    # step; entry i is the logprob dict of prompt token i (entry 0, the first token, is None).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] | None = None


@dataclass
class StepTokenMask:
    """The token masks of a step's constrained rows (structured outputs): `bitmask[k]` says which tokens
    logits row `rows[k]` (an index among the step's sampled rows) may take, packed as xgrammar packs it:
    bit b of int32 word w allows token 32 * w + b. A host tensor (pinned on a GPU), read once by the
    step's upload."""

    bitmask: torch.Tensor
    rows: list[int]


__all__ = ["SchedulerOutput", "StepResult", "StepTokenMask"]
