"""`EngineCore`: the one object that owns an engine step.

It holds the scheduler, the model runner and the multimodal state, and decides how the next step
runs: a greedy decode window, a plain synchronous step, or an overlapped (async) step. Everything
that generates drives it the same way — `add_request`, `abort`, `step()` until
`has_unfinished()` is False — whether that is `LLM.generate`, the streaming
`LLM.add_request / step / append_input`, or the HTTP server's engine task. `step()` returns
`RequestDelta`s: for each request the step advanced, its new tokens (and text, when it streams
text) and, once it ends, why.

Async scheduling (vLLM's scheme; at most one step in flight). One `step()` call either

    launches step n (nothing in flight)                          -> no deltas yet
    plans + launches step n+1, then finishes step n              -> step n's deltas
    drains: finishes step n without launching                    -> step n's deltas

Planning n+1 is optimistic: every request sampling in step n has one more (pending) token, its KV
slot taken now, and its id is copied on the device from step n's sampled ids
(`runner.worker.pending_tokens`). Finishing step n is the one host sync: read its tokens,
append, stop checks. A request that stopped at step n was already planned into n+1: that output
is discarded (`Scheduler.finish_step` skips finished requests) and its blocks and slot are freed
once; what step n+1 still writes into them is ordered before any later use on the device stream.
A request whose pending tokens end it by length anyway is not planned again. A request sampling
with penalties needs every output id on the host, so while its last token is pending it sits the
overlapped step out. A constrained request (structured outputs) does not: its token mask needs the
token in flight, so the step is launched with its sampling deferred; once step n is finished (its
tokens read into the matchers) the masks start filling on the token masks' fill thread, while the
engine thread returns step n's deltas and plans step n+2 and the device runs step n+1's forward; the
fill is joined and step n+1 sampled just before step n+2 (or anything else) is launched behind it, and
before it is read (`_sample_deferred`). Constrained
requests never ride a decode window (each token's mask needs the one before it on the host). The core
drains, then plans synchronously, when overlapping needs the tokens' values: a preemption or nothing
plannable. When a decode window can follow the step in
flight, it is launched behind that step (its first input ids copied on the device from the step's
sampled ids, as for a step), and then the step is finished.

Decode windows overlap the same way (at most one window in flight besides the one being read). A
`step()` with a window in flight plans the next window as if that one's tokens were in (they count
as pending outputs; requests they end by length are left out), launches it behind the first, whose
last tokens become its first inputs on the device, then reads the first window and applies its
tokens. A request that stops on a token of the window read was already launched into the next:
those tokens are dropped. No window is launched behind while requests wait for admission (the
waiting ones would wait one window more) or when the server turns `pipeline_windows` off.

Tokens equal the synchronous loop's for greedy and seeded sampling (a seeded request owns its
generator). Unseeded sampling draws from the global generator, whose draws depend on the batch.

Open input (`Request.input_open`: a realtime request whose caller may still `append_input`). A chunk
appended between two `step()` calls takes the request's next positions without a token, so what the
engine has computed ahead of the caller decides where it lands. While any such request is unfinished
(waiting or running), every `step()` is lockstep: whatever is in flight (a window or an overlapped
step launched before the request arrived) is finished first, then one synchronous step runs, and
nothing is left on the device when `step()` returns. The open request thus gains at most one token
per `step()` and its chunks land where the synchronous loop (the CPU's) puts them, whatever the
device and options. The cost, while an open request is unfinished: every request runs one token per
`step()` with a host sync each (single decode steps still replay their CUDA graph), no decode
windows, no overlapped steps. `close_input` ends it: from the next `step()` on the policy above applies
again. With no open request the check is one empty-dict test per step.

Not thread-safe: one caller drives it (`runner.LLM` serialises its callers with a lock; the
server runs one engine task).
"""

from __future__ import annotations

from typing import Any

from runner.config import EngineConfig
from runner.engine.block_manager import BlockManager
from runner.engine.prefix_cache import PrefixCachingBlockManager
from runner.engine.scheduler import Scheduler
from runner.engine.token_masks import PendingMask, TokenMasks, constrained_rows
from runner.multimodal.encoder_cache import EncoderFailure
from runner.multimodal.state import MultimodalState
from runner.outputs import RequestDelta
from runner.request import Request, RequestStatus
from runner.step_io import SchedulerOutput
from runner.worker.decode_window import LaunchedWindow
from runner.worker.model_runner import ModelRunner
from runner.worker.step_sampling import LaunchedStep, sample_deferred


def _needs_host_tokens(request: Request, samples: bool) -> bool:
    """The request samples with penalties while its last token's value is still on the device."""
    return samples and request.num_pending_outputs > 0 and request.sampling_params.uses_penalties


class NoProgressError(RuntimeError):
    """Requests wait but none can be scheduled (a request cannot fit the KV cache)."""


class EngineCore:
    """Scheduler + model runner + step policy (decode windows, async scheduling); see the module doc.

    `config` must be resolved (`EngineConfig.resolve`). `async_scheduling` is the model state's
    verdict (`ModelState.check_supported`); `mm` holds the encoders and the encoder cache.
    """

    def __init__(self, config: EngineConfig, hf_config: Any, *, mm: MultimodalState,
                 eos_token_ids: tuple[int, ...], async_scheduling: bool) -> None:
        self.config = config
        self.mm = mm
        self.runner = ModelRunner(config, hf_config, eos_token_ids=eos_token_ids, mm=mm)
        self.max_model_len = self.runner.max_model_len
        num_blocks = self.runner.num_kv_blocks
        manager_cls = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.block_manager = manager_cls(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            on_admit=self.runner.add_request, on_release=self.runner.remove_request,
        )
        self.decode_window = config.decode_window
        self.async_scheduling = async_scheduling
        # Structured outputs: the token masks of each step's constrained rows, filled on the host, and how
        # many steps sampled only once the step before them was read (`_sample_deferred`).
        self.token_masks = TokenMasks(self.runner.vocab_size, config.max_num_seqs, config.device)
        self.num_deferred_samples = 0
        self.in_flight: LaunchedStep | None = None
        self._pending_mask: tuple[LaunchedStep, PendingMask | None] | None = None  # its fill, started
        # Steps launched while the previous one was still on the device (async scheduling).
        self.num_async_steps = 0
        # The decode window on the device whose tokens the host has not read; whether the next window
        # may be launched behind it, or behind an overlapped step (the server turns this off while
        # requests arrive); and how many were.
        self.window: LaunchedWindow | None = None
        self.pipeline_windows = True
        self.num_pipelined_windows = 0
        self.num_windows_behind_steps = 0
        # Unfinished requests whose input is open (finished ones are dropped at the next step), and how
        # many `step()` calls ran in lockstep for them (module doc).
        self._open_inputs: dict[str, Request] = {}
        self.num_lockstep_steps = 0

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue `request`; with `request.input_open` the engine runs in lockstep until it ends or its
        input is closed (module doc)."""
        self.scheduler.add_request(request)
        if request.input_open:
            self._open_inputs[request.request_id] = request

    def close_input(self, request_id: str) -> None:
        """The request's input is complete: from the next `step()` it runs under the normal policy (decode
        windows, overlapped steps). An unknown, finished or already closed id is ignored (the caller
        validates ids)."""
        request = self._open_inputs.pop(request_id, None)
        if request is not None:
            request.input_open = False

    @property
    def has_open_inputs(self) -> bool:
        """Whether some unfinished request's input is open (the next `step()` runs in lockstep)."""
        return bool(self._open_inputs) and self._prune_open_inputs()

    def _prune_open_inputs(self) -> bool:
        """Forget open requests that finished (stopped, aborted, failed); whether any is left. Only called
        while some are open, so a step with none pays one empty-dict test."""
        done = [rid for rid, request in self._open_inputs.items() if request.is_finished]
        for rid in done:
            del self._open_inputs[rid]
        return bool(self._open_inputs)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request now and free its KV blocks and slot (None if unknown or already finished).

        Safe with a step in flight: that step's output for the request is discarded when it lands.
        """
        self._open_inputs.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or self.window is not None

    # ----------------------------------------------------------------------------- the step
    def step(self) -> list[RequestDelta]:
        """Advance the engine by one step (or one decode window); the deltas of what it advanced.

        An encoder that fails on some items (raises, or returns NaN/Inf rows) fails only the
        requests holding those items: they finish with reason "error" and `Request.error` says
        which modality and what went wrong; the step runs again for the others on the next call.
        """
        try:
            lockstep = self._open_inputs and self._prune_open_inputs()  # one dict test while none is open
            advanced = self._lockstep() if lockstep else self._advance()
        except EncoderFailure as failure:
            advanced = self._fail_requests_with(failure)
        return [d for d in map(self._delta, advanced) if d is not None]

    def _lockstep(self) -> list[Request]:
        """A step while some input is open (module doc): what is in flight is finished, then one
        synchronous step runs; nothing is left on the device."""
        self.num_lockstep_steps += 1
        settled = self._settle()
        try:
            return settled + self._synchronous_step(progressed=bool(settled))
        except EncoderFailure as failure:  # the settled requests' deltas are kept
            return settled + self._fail_requests_with(failure)

    def settle(self) -> list[RequestDelta]:
        """Finish the step or decode window on the device without launching another; its deltas (none
        for requests aborted meanwhile, whose outputs are discarded). For a caller that dropped its
        requests mid-run and must leave no work in flight."""
        return [d for d in map(self._delta, self._settle()) if d is not None]

    def _settle(self) -> list[Request]:
        """`settle`, returning the requests whose outputs it may have changed."""
        advanced: list[Request] = []
        if self.in_flight is not None:
            advanced += self._drain()
        if self.window is not None:  # at most one window is in flight between steps
            window, self.window = self.window, None
            self.scheduler.update_window(window.so, self.runner.finish_decode_window(window), window.k)
            advanced += window.so.requests
        return advanced

    def _fail_requests_with(self, failure: EncoderFailure) -> list[Request]:
        failed = []
        for request in list(self.scheduler.requests.values()):
            bad = [f for f in request.mm_features if f.identifier in failure.failed]
            if bad:
                self.scheduler.abort_request(request.request_id)
                request.status = RequestStatus.FINISHED_ERROR
                request.error = (f"the {bad[0].modality} encoder failed on an item at position "
                                 f"{bad[0].placeholder.offset}: {failure.failed[bad[0].identifier]}")
                failed.append(request)
        if not failed:
            raise failure  # no request holds the items: not a per-request fault
        return failed

    def _advance(self) -> list[Request]:
        """One step of the policy; returns the requests whose outputs it may have changed."""
        scheduler = self.scheduler
        if self.window is not None:
            return self._next_window()
        if self.in_flight is None:
            window = self._run_decode_window()
            if window is not None:
                return window
            if self.async_scheduling:
                so = self._schedule_or_raise()
                if so.num_reqs:
                    self._launch(so)
                return []
            return self._synchronous_step()
        k = self._decode_window_size()
        if k > 1:
            return self._window_behind_step(k)
        so = scheduler.schedule(allow_preemption=False)
        if so is not None:
            so = scheduler.without(so, _needs_host_tokens)
        if so is None or so.num_reqs == 0:
            return self._drain()
        prev = self.in_flight
        self._launch(so, prev)
        self.num_async_steps += 1
        try:
            return self._finish(prev)
        finally:
            self._start_deferred_fill()

    def _schedule_or_raise(self, *, progressed: bool = False) -> SchedulerOutput:
        """Plan a step with nothing in flight; NoProgressError when requests wait but none fits (unless
        `progressed`: the caller advanced some already, and the next call raises)."""
        so = self.scheduler.schedule()
        if so.num_reqs == 0 and self.scheduler.has_unfinished() and not progressed:
            raise NoProgressError("scheduler made no progress: a request cannot fit the KV cache")
        return so

    def _synchronous_step(self, *, progressed: bool = False) -> list[Request]:
        """Plan, run and read one step with nothing in flight (`progressed`: see `_schedule_or_raise`)."""
        so = self._schedule_or_raise(progressed=progressed)
        if so.num_reqs == 0:
            return []
        self.scheduler.update(so, self.runner.execute(so, self.token_masks.fill(so)))
        return so.requests

    def _launch(self, so: SchedulerOutput, prev: LaunchedStep | None = None) -> None:
        """Launch `so` (behind `prev`, still in flight). A constrained request whose last token `prev`
        samples has no token mask yet: the step's sampling is then deferred to `_sample_deferred`, once
        `prev` is read, while this step's forward runs."""
        rows = constrained_rows(so)
        defer = prev is not None and any(q.num_pending_outputs for _, q in rows)
        mask = None if defer or not rows else self.token_masks.fill(so, rows)
        deferred_prev = prev is not None and prev.awaits_sampling
        self.in_flight = self.runner.launch(
            so, prev, token_mask=mask, defer_sampling=defer,
            before_reading_prev=(lambda: self._sample_deferred(prev)) if deferred_prev else None)
        self.scheduler.mark_launched(so)

    def _start_deferred_fill(self) -> None:
        """The step in flight samples once the step before it is read (now): start filling its masks on
        the fill thread; `_sample_deferred` joins it."""
        step = self.in_flight
        if step is not None and step.awaits_sampling:
            self._pending_mask = (step, self.token_masks.fill_in_background(step.so))

    def _sample_deferred(self, step: LaunchedStep) -> None:
        """Sample `step` if its sampling was deferred: its constrained requests' matchers have read their
        previous tokens (the step before it was read). Runs before anything is launched behind `step`
        and before it is read."""
        if not step.awaits_sampling:
            return
        pending, self._pending_mask = self._pending_mask, None
        if pending is not None and pending[0] is step:
            mask = pending[1].result() if pending[1] is not None else None
        else:
            mask = self.token_masks.fill(step.so)
        self.num_deferred_samples += 1
        sample_deferred(self.runner.sampler, step, self.runner.eos_token_ids, mask)

    def _finish(self, step: LaunchedStep) -> list[Request]:
        self._sample_deferred(step)
        self.scheduler.finish_step(step.so, self.runner.finish(step))
        return step.so.requests

    def _drain(self) -> list[Request]:
        step, self.in_flight = self.in_flight, None
        return self._finish(step)

    # ----------------------------------------------------------------------------- decode windows
    def _decode_window_size(self) -> int:
        """Greedy decode steps that may run back to back now (1: take a normal step)."""
        scheduler, runner = self.scheduler, self.runner
        if not runner.graphs:
            return 1
        k = scheduler.decode_window_size(self.decode_window, self.max_model_len)
        if k > 1 and self.mm.realtime and self.mm.has_pending_rows(scheduler.running):
            return 1  # decode windows skip the encoder-row gather
        return k if k > 1 and runner.can_replay(len(scheduler.window_requests())) else 1

    def _run_decode_window(self) -> list[Request] | None:
        """Launch a decode window if one can run now (nothing in flight) and advance through it; the
        requests it advanced, or None when no window can run."""
        k = self._decode_window_size()
        if k <= 1:
            return None
        so = self.scheduler.schedule_decode_window(k)
        if so is None:
            return None
        self.window = self._launch_window(so, k)
        return self._next_window()

    def _window_behind_step(self, k: int) -> list[Request]:
        """A decode window can follow the step in flight: launch it behind that step (its first inputs are
        the step's sampled ids, copied on the device), then finish the step, so the GPU goes from the step
        straight into the window instead of idling while the host reads the step and plans the window
        (between the last prefill step and the first window). Drains first when windows are not
        pipelined or the window cannot be planned now (KV pool short)."""
        step = self.in_flight
        so = self.scheduler.schedule_decode_window(k) if self.pipeline_windows else None
        if so is None:
            return self._drain()
        self._sample_deferred(step)
        self.window = self._launch_window(so, k, step)
        self.in_flight = None
        self.num_windows_behind_steps += 1
        return self._finish(step)

    def _launch_window(self, so: SchedulerOutput, k: int,
                       prev: LaunchedWindow | LaunchedStep | None = None) -> LaunchedWindow:
        window = self.runner.launch_decode_window(so, k, prev)
        self.scheduler.mark_window_launched(so, k)
        return window

    def _next_window(self) -> list[Request]:
        """Read the window in flight, having first launched the next one behind it when that can be
        planned without its tokens (`pipeline_windows`): the GPU then runs on while the host reads
        and applies them, instead of idling through every window boundary. The next window carries
        the requests that cannot have ended by length; one that stops on a token of this window has
        its next-window tokens dropped (and wasted), as inside a window."""
        current, nxt = self.window, None
        if self.pipeline_windows:
            k = self._decode_window_size()
            so = self.scheduler.schedule_decode_window(k) if k > 1 else None
            if so is not None:
                nxt = self._launch_window(so, k, current)
                self.num_pipelined_windows += 1
        self.window = nxt
        tokens = self.runner.finish_decode_window(current)
        self.scheduler.update_window(current.so, tokens, current.k)
        return current.so.requests

    # ----------------------------------------------------------------------------- outputs
    @staticmethod
    def _delta(request: Request) -> RequestDelta | None:
        """What `request` gained since its last delta (None: nothing new)."""
        new = len(request.output_token_ids) - request.num_emitted_tokens
        finished = request.is_finished
        if new <= 0 and (not finished or request.finish_emitted):
            return None
        request.finish_emitted = finished
        first = request.num_emitted_tokens
        request.num_emitted_tokens += max(new, 0)
        text = ""
        if request.detokenizer is not None:
            full = request.detokenizer.text
            stops = request.sampling_params.stop_strings
            # Hold back what could still become a stop string (it would be trimmed at the end).
            end = len(full) if finished or not stops else max(0, len(full) - max(map(len, stops)) + 1)
            if end > request.num_emitted_chars:
                text = full[request.num_emitted_chars : end]
                request.num_emitted_chars = end
        logprobs = None if request.logprobs is None else request.logprobs[first : request.num_emitted_tokens]
        delta = RequestDelta(
            request_id=request.request_id, new_token_ids=request.output_token_ids[first:],
            new_text=text, new_logprobs=logprobs, finished=finished,
            finish_reason=request.status.value if finished else None, stop_reason=request.stop_reason,
            error=request.error if finished else None,
        )
        if first == 0:  # the first delta: what the caller could not know when it submitted
            delta.prompt_logprobs = request.prompt_logprobs
            if request.mm_features:
                delta.prompt_token_ids = list(request.prompt_token_ids)
        return delta

    # ----------------------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Abort everything and release the device memory the runner holds."""
        self.settle()
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort_request(request_id)
        self.token_masks.close()
        self.runner.release()


__all__ = ["EngineCore", "NoProgressError"]
