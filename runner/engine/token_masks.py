"""One step's token masks for its constrained requests, filled on the host from their matchers.

A constrained request's next token may only be one its grammar allows after the tokens the host has
read, so its mask can be filled only once its previous token is known. `EngineCore` fills it when the
step is launched if that token is known then. Otherwise (async scheduling: the previous step was still
on the device) the fill starts on this object's fill thread as soon as that step is read, and runs while
the engine thread hands out the step's outputs and plans the next step, and the device runs this step's
forward; the engine joins it just before it launches anything behind the step (`fill_in_background`).
xgrammar releases the GIL while it fills, so the two threads run side by side. The runner then uploads
the mask and applies it to the logits before sampling (`runner.worker.step_sampling`).

The masks go into two pinned host buffers used in turn. That is safe because a step's mask is filled
after the step two before it has been read (at most one step is in flight when another is launched),
so the upload that read a buffer last has run; and at most one fill runs at a time (each fill waits
for the one before it).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
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


class PendingMask:
    """A token mask being filled on the fill thread; `result()` waits for it."""

    __slots__ = ("_future", "_masks")

    def __init__(self, future: Future, masks: TokenMasks) -> None:
        self._future, self._masks = future, masks

    def result(self) -> StepTokenMask | None:
        if not self._future.done():
            started = time.perf_counter()
            self._future.result()
            self._masks.wait_seconds += time.perf_counter() - started
        return self._future.result()


class TokenMasks:
    """The host side of a runner's token masks: `vocab_size` columns, up to `max_rows` rows a step.

    `fill_seconds` adds up the time spent filling (on whichever thread), `wait_seconds` the time the
    engine thread waited for a background fill to end."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self.max_rows = max_rows
        self.pin = device.type == "cuda"
        self._buffers: list[torch.Tensor] | None = None  # allocated on the first constrained step
        self._turn = 0
        self._batch: Any = None
        self._threads = _fill_threads()
        self._executor: ThreadPoolExecutor | None = None  # the fill thread, started on first use
        self._last: Future | None = None  # the latest background fill
        self.num_filled_rows = 0
        self.num_background_fills = 0
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0

    def _next_buffer(self) -> torch.Tensor:
        if self._buffers is None:
            self._buffers = [torch.zeros(self.max_rows, self.words, dtype=torch.int32, pin_memory=self.pin)
                             for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn]

    def _wait_last(self) -> None:
        """Let the background fill in progress end (fills never overlap: they share buffers and the
        batch matcher)."""
        if self._last is not None:
            PendingMask(self._last, self).result()
            self._last = None

    def _open_rows(self, so: SchedulerOutput,
                   rows: list[tuple[int, Request]] | None) -> list[tuple[int, Request]]:
        """`so`'s constrained sampling rows (`rows`, when the caller has them already), less requests that
        finished after `so` was planned: their token there is discarded anyway."""
        rows = constrained_rows(so) if rows is None else rows
        return [(j, req) for j, req in rows if not req.is_finished]

    def fill(self, so: SchedulerOutput,
             rows: list[tuple[int, Request]] | None = None) -> StepTokenMask | None:
        """The masks of `so`'s constrained sampling rows, filled now (None: it has none)."""
        self._wait_last()
        rows = self._open_rows(so, rows)
        return self._fill(self._next_buffer()[: len(rows)], rows) if rows else None

    def fill_in_background(self, so: SchedulerOutput) -> PendingMask | None:
        """Start filling `so`'s masks on the fill thread (None: it has none). The caller must not feed
        those requests' matchers a token before `result()` returns."""
        self._wait_last()
        rows = self._open_rows(so, None)
        if not rows:
            return None
        bitmask = self._next_buffer()[: len(rows)]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bridge-token-masks")
        self._last = self._executor.submit(self._fill, bitmask, rows)
        self.num_background_fills += 1
        return PendingMask(self._last, self)

    def _fill(self, bitmask: torch.Tensor, rows: list[tuple[int, Request]]) -> StepTokenMask:
        started = time.perf_counter()
        n = len(rows)
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
        self.fill_seconds += time.perf_counter() - started
        return StepTokenMask(bitmask, [j for j, _ in rows])

    def close(self) -> None:
        """Wait for a fill in progress and stop the fill thread."""
        self._wait_last()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


__all__ = ["PendingMask", "TokenMasks", "constrained_rows"]
