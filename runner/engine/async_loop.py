"""Async scheduling: the host work of step n+1 overlaps the device work of step n (vLLM's scheme).

With at most one step in flight, the loop runs

    launch(n)           forward + sampling enqueued; the sampled ids stay on the device
    schedule(n+1)       optimistic: every request sampling in step n has one more token (pending),
                        its KV slot taken now
    launch(n+1)         staged on the host; the pending ids are copied on the device from step n's
                        sampled ids (`ModelRunner._feed_pending_tokens`)
    finish(n)           the one host sync: read step n's tokens, append, stop checks, detokenize

so the GPU runs step n+1 while the host finishes step n. A request that stops at step n was
already planned into step n+1: that step's output for it is discarded (`Scheduler.finish_step`
skips finished requests) and its blocks and slot are freed once, when step n finishes; anything
step n+1 still writes into those blocks is ordered before any later use on the device stream.
A request whose pending tokens will end it by length anyway is not planned again.

A request that samples with penalties needs every output id on the host (the sampler counts
them there), so while its last token is pending it sits the overlapped step out and runs in the
next one (a batch of only such requests therefore runs synchronously).

The loop finishes the step in flight first ("drains") and plans synchronously when overlapping
cannot be done without the tokens' values:
- the next step cannot be planned without preempting (preemption recomputes from known tokens);
- a greedy decode window can run (it already runs many steps per sync);
- nothing can be planned (every running request is about to finish or waits for its penalties'
  token, or the pool is full).

Tokens are the same as the synchronous loop's for greedy and seeded sampling (a seeded request
owns its generator; a discarded step only advances the generator of a request that has ended).
Unseeded sampling draws from the global generator, whose draws depend on the batch, so its
tokens are random either way but not the same draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.worker.model_runner import LaunchedStep
from runner.engine.request import Request
from runner.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from runner.llm import LLM


def _needs_host_tokens(request: Request, samples: bool) -> bool:
    """The request samples with penalties while its last token's value is still on the device."""
    return samples and request.num_pending_outputs > 0 and request.sampling_params.uses_penalties


class AsyncLoop:
    """Runs `llm`'s scheduler and runner until every request is done, one step in flight."""

    def __init__(self, llm: LLM, bar) -> None:
        self.llm, self.bar = llm, bar
        self.scheduler, self.runner = llm.scheduler, llm.runner
        self.in_flight: LaunchedStep | None = None

    def run(self) -> None:
        scheduler = self.scheduler
        while scheduler.has_unfinished() or self.in_flight is not None:
            if self.in_flight is None:
                if self.llm._run_decode_window(self.bar):
                    continue
                so = scheduler.schedule()
                if so.num_reqs == 0:
                    raise RuntimeError("scheduler made no progress: a request cannot fit the KV cache")
                self._launch(so)
                continue
            if self.llm._decode_window_size() > 1:
                self._drain()
                continue
            so = scheduler.schedule(allow_preemption=False)
            if so is not None:
                so = scheduler.without(so, _needs_host_tokens)
            if so is None or so.num_reqs == 0:
                self._drain()
                continue
            prev = self.in_flight
            self._launch(so, prev)
            self.llm.num_async_steps += 1
            self._finish(prev)

    def _launch(self, so: SchedulerOutput, prev: LaunchedStep | None = None) -> None:
        self.in_flight = self.runner.launch(so, prev)
        self.scheduler.mark_launched(so)

    def _finish(self, step: LaunchedStep) -> None:
        finished = self.scheduler.finish_step(step.so, self.runner.finish(step))
        if finished:
            self.bar.update(len(finished))

    def _drain(self) -> None:
        step, self.in_flight = self.in_flight, None
        self._finish(step)


__all__ = ["AsyncLoop"]
