"""One step's token masks for its constrained requests, filled on the host from their matchers.

A constrained request's next token may only be one its grammar allows after the tokens the host has
read, so its mask can be filled only once its previous token is known. `EngineCore` fills it when the
step is launched if that token is known then, and otherwise (async scheduling: the previous step was
still on the device) right after finishing that step, while this step's forward runs; the runner then
uploads the mask and applies it to the logits before sampling (`runner.worker.step_sampling`).

The masks go into two pinned host buffers used in turn. That is safe because a step's mask is filled
after the step two before it has been read (at most one step is in flight when another is launched),
so the upload that read a buffer last has run.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from runner.request import Request
from runner.step_io import SchedulerOutput, StepTokenMask

# Below this many constrained rows, or with fewer than this many cores for its threads, the matchers are
# filled one by one: xgrammar's threaded batch fill costs a hand-off that pays only over several rows
# and several cores (on two cores it lost to the plain loop).
_BATCH_FILL_MIN_ROWS = 8
_BATCH_FILL_MIN_THREADS = 2


def _fill_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cores // 2)


def constrained_rows(so: SchedulerOutput) -> list[tuple[int, Request]]:
    """(index among the step's sampled rows, request) for each sampling request with a grammar."""
    out: list[tuple[int, Request]] = []
    j = 0
    for req, samples in zip(so.requests, so.samples):
        if samples:
            if req.grammar is not None:
                out.append((j, req))
            j += 1
    return out


class TokenMasks:
    """The host side of a runner's token masks: `vocab_size` columns, up to `max_rows` rows a step."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self.max_rows = max_rows
        self.pin = device.type == "cuda"
        self._buffers: list[torch.Tensor] | None = None  # allocated on the first constrained step
        self._turn = 0
        self._batch: Any = None
        self._threads = _fill_threads()
        self.num_filled_rows = 0

    def _next_buffer(self) -> torch.Tensor:
        if self._buffers is None:
            self._buffers = [torch.zeros(self.max_rows, self.words, dtype=torch.int32, pin_memory=self.pin)
                             for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn]

    def fill(self, so: SchedulerOutput,
             rows: list[tuple[int, Request]] | None = None) -> StepTokenMask | None:
        """The masks of `so`'s constrained sampling rows (`rows`, when the caller has them already;
        None: it has none). A request that finished after `so` was planned is left out: its token
        there is discarded anyway."""
        rows = [(j, req) for j, req in (constrained_rows(so) if rows is None else rows)
                if not req.is_finished]
        if not rows:
            return None
        n = len(rows)
        bitmask = self._next_buffer()[:n]
        matchers = [req.grammar.matcher for _, req in rows]
        if n < _BATCH_FILL_MIN_ROWS or self._threads < _BATCH_FILL_MIN_THREADS:
            for k, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, k)
        else:
            if self._batch is None:
                # only engines that met a constrained request get here (see structured_outputs)
                import xgrammar

                self._batch = xgrammar.BatchGrammarMatcher(max_threads=self._threads)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        self.num_filled_rows += n
        return StepTokenMask(bitmask, [j for j, _ in rows])


__all__ = ["TokenMasks", "constrained_rows"]
