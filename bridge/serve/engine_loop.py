"""The one driver of the engine: HTTP handlers submit and abort, only its ticks step the core.

Two halves. `EngineTicker.tick` is one *tick*: validate and add the submissions queued since the last
tick (`PromptProcessor.process`: all prompts of a submission or none), apply queued aborts, run one
`EngineCore.step()`, and snapshot the counters. `EngineFront` is the handlers' side on the event
loop: `submit` / `abort`, and `deliver`, which resolves the submitters' futures and hands every
`RequestDelta` to its request's asyncio queue. Requests from all connections share each step: that is
the engine's continuous batching.

`EngineLoop` joins the two in one process: its task hands each tick to a worker thread, so the event
loop stays free to accept connections and stream while the model runs, and the core is only ever
touched by one thread at a time. `bridge.serve.engine_process.EngineProcessFront` is the same front
with the ticker in another process (`bridge serve --engine-process`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bridge.serve.arrivals import Arrivals, arrived_at, submitted
from bridge.serve.metrics import EngineSnapshot, ServeMetrics
from runner.envs import TICK_TRACE
from runner.outputs import RequestDelta
from runner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runner.llm import LLM

logger = logging.getLogger(__name__)


DEFAULT_ARRIVAL_DECODE_WINDOW = 4
"""Decode steps per window while requests are arriving: admission waits at most this many steps."""


class QueueFull(Exception):
    """More live requests than `max_pending`: answered 503 with Retry-After."""


class ShuttingDown(Exception):
    """The server is draining: new requests are refused (503)."""


class EngineFailed(Exception):
    """The engine raised while stepping; the requests it was running are aborted."""


@dataclass
class Submission:
    """One HTTP request's prompts (already decoded), their params and request ids."""

    prompts: Sequence[Any]
    params: Sequence[SamplingParams]
    ids: Sequence[str]
    stream_text: bool
    future: asyncio.Future | None = None
    check_context: bool = True
    prompt_lens: list[int] = field(default_factory=list)
    token: int = 0  # names the submission across the engine process's pipe (sent without its future)
    owner: int = 0  # which API process sent it there (its connection's index)
    mm_items: int = 0  # media items in its prompts, and how many the encoder cache had (set by the tick)
    mm_hits: int = 0
    # time.monotonic() (one clock for every process of the host) for the tick trace: the HTTP request's
    # arrival, its submission after parsing and validation, its receipt by the engine process (0: none)
    arrived_at: float = 0.0
    submitted_at: float = 0.0
    received_at: float = 0.0


@dataclass
class TickOutcome:
    """What one tick did: per submission its error (None: added), the step's deltas, the counters."""

    added: list[tuple[Any, BaseException | None]]
    deltas: list[RequestDelta]
    snapshot: EngineSnapshot
    step_error: str | None = None  # the exception's type name: the step's requests were aborted
    mm_items: int = 0
    mm_hits: int = 0
    aborted_ids: list[str] = field(default_factory=list)
    admit_s: float | None = None  # None: nothing was submitted
    step_s: float | None = None  # None: no step ran (or it failed)


class EngineTicker:
    """Runs ticks on one `LLM`; the only code that touches its core while a server runs.

    `arriving` (a tick's argument) says requests are on their way: greedy decode windows are cut to
    `arrival_decode_window` steps so they are admitted after a few steps rather than a whole window.
    """

    def __init__(self, llm: LLM, *, arrival_decode_window: int | None = None) -> None:
        self.llm = llm
        self.core = llm.core
        self._compiles = llm.kernel_compiles  # None off CUDA, or without Triton's hooks
        self.full_decode_window = self.core.decode_window
        self.pipeline_windows = self.core.pipeline_windows
        self.arrival_decode_window = min(self.full_decode_window, DEFAULT_ARRIVAL_DECODE_WINDOW
                                         if arrival_decode_window is None else max(1, arrival_decode_window))
        self.processor = llm.processor
        self.max_model_len = llm.max_model_len
        self._builds_seen = self._compiles.count if self._compiles is not None else 0
        trace = TICK_TRACE.get()
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 - closed in close()

    def tick(self, subs: Sequence[Any], aborts: Sequence[str], arriving: bool) -> TickOutcome:
        """Admit `subs` (objects with Submission's prompts/params/ids/stream_text/check_context; each
        gets its `prompt_lens`), apply `aborts`, run one step if anything is unfinished."""
        started = time.perf_counter()
        tick_start = time.monotonic()
        added: list[tuple[Any, BaseException | None]] = []
        items = hits = 0
        seen: set[str] = set()
        cache = self.llm.mm.cache
        try:  # every submission's prompt embeds to the device in one upload
            calls = [(sub.prompts, sub.params, sub.ids, sub.stream_text) for sub in subs]
            processed = self.processor.process_many(calls)
        except Exception:  # noqa: BLE001 - a tokenizer or encoder choking: each submission on its own
            processed = [self._process_one(sub) for sub in subs]
        for sub, result in zip(subs, processed):
            try:
                if isinstance(result, BaseException):
                    raise result
                requests = result
                for i, req in enumerate(requests if sub.check_context else ()):
                    need = len(req.prompt_token_ids) + req.sampling_params.max_tokens
                    if need > self.max_model_len:
                        raise ValueError(
                            f"prompt {i}: this model's maximum context length is {self.max_model_len} "
                            "tokens, "
                            f"but {len(req.prompt_token_ids)} prompt tokens + max_tokens "
                            f"{req.sampling_params.max_tokens} = {need}; reduce max_tokens or the prompt")
                sub_items = sub_hits = 0
                for req in requests:
                    for feature in getattr(req, "mm_features", None) or ():
                        sub_items += 1
                        ident = feature.identifier
                        sub_hits += ident in cache or cache.is_referenced(ident) or ident in seen
                        seen.add(ident)
                    self.core.add_request(req)
                sub.prompt_lens = [len(r.prompt_token_ids) for r in requests]
                sub.mm_items, sub.mm_hits = sub_items, sub_hits
                items += sub_items
                hits += sub_hits
                added.append((sub, None))
            except ValueError as exc:  # the processor names the prompt and field: a 400
                added.append((sub, exc))
            except Exception as exc:  # noqa: BLE001 - a tokenizer or encoder choking on the input
                logger.warning("a submission failed validation with %s", type(exc).__name__, exc_info=True)
                added.append((sub, ValueError(f"the prompt could not be processed ({type(exc).__name__})")))
        aborted_ids = [rid for rid in aborts if self.core.abort(rid) is not None]
        admitted = time.perf_counter() - started
        deltas: list[RequestDelta] = []
        error = None
        step_s = None
        if self.core.has_unfinished():
            self.core.decode_window = self.arrival_decode_window if arriving else self.full_decode_window
            # While requests arrive, a window launched behind the one in flight would hold them back
            # one window more.
            self.core.pipeline_windows = self.pipeline_windows and not arriving
            stepped = time.perf_counter()
            try:
                deltas = self.core.step()
                step_s = time.perf_counter() - stepped
                self._report_builds()
            except Exception as exc:  # noqa: BLE001 - the loop must survive; its requests are aborted
                logger.exception("engine step failed; aborting its requests")
                error = type(exc).__name__
                for rid in list(self.core.scheduler.requests):
                    self.core.abort(rid)
                self.core.in_flight = self.core.window = None
        if self._trace is not None:
            s, compiles = self.core.scheduler, self._compiles
            self._trace.write(json.dumps({
                "t": tick_start, "admit_s": admitted, "step_s": step_s or 0.0, "subs": len(subs),
                "prompts": sum(len(sub.ids) for sub in subs), "arriving": int(arriving),
                "window": self.core.decode_window, "running": len(s.running), "waiting": len(s.waiting),
                "deltas": len(deltas), "finished": sum(d.finished for d in deltas),
                **_spans(subs), "owners": [getattr(sub, "owner", 0) for sub in subs],
                "builds": compiles.count if compiles is not None else 0}) + "\n")
        return TickOutcome(added, deltas, self.snapshot(), error, items, hits, aborted_ids,
                           admitted if subs else None, step_s)

    def _process_one(self, sub: Any) -> list | BaseException:
        try:
            return self.processor.process(sub.prompts, sub.params, sub.ids, stream_text=sub.stream_text)
        except Exception as exc:  # noqa: BLE001 - the tick's handler names it a 400
            return exc

    def _report_builds(self) -> None:
        """Log the Triton kernels a step built: the step's requests waited for them (the warm-up
        missed a specialisation; `bridge:kernel_compiles` counts them)."""
        compiles = self._compiles
        if compiles is None or compiles.count <= self._builds_seen:
            return
        new = compiles.count - self._builds_seen
        self._builds_seen = compiles.count
        shown = "; ".join(f"{name} ({took:.2f} s)" for name, took in compiles.recent[-min(new, 4):])
        logger.warning("an engine step built %d Triton kernel(s) while serving: %s", new, shown)

    def snapshot(self) -> EngineSnapshot:
        s, cache, compiles = self.core.scheduler, self.llm.mm.cache, self._compiles
        return EngineSnapshot(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_free_blocks=self.core.block_manager.num_free_blocks,
            num_total_blocks=self.core.block_manager.num_blocks,
            num_free_slots=s.num_free_slots, num_total_slots=s.max_num_seqs,
            encoder_calls=cache.num_encoder_calls, encoded_items=cache.num_encoded_items,
            passthrough_uploads=cache.num_uploads,
            kernel_compiles=compiles.count if compiles else 0,
            kernel_compile_seconds=compiles.seconds if compiles else 0.0)

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def _spans(subs: Sequence[Any]) -> dict[str, list[float]]:
    """First and last arrival / submission / engine receipt among a tick's submissions (trace fields;
    a time of 0.0 is unknown and left out)."""
    out = {}
    for key in ("arrived_at", "submitted_at", "received_at"):
        times = [t for t in (getattr(sub, key, 0.0) for sub in subs) if t]
        if times:
            out[key] = [min(times), max(times)]
    return out


class EngineFront:
    """The handlers' side of the engine, on the event loop: live requests, their queues, delivery.

    A driver subclass moves the queued submissions and aborts to a ticker (`start` / `run`) and calls
    `deliver` with each `TickOutcome`; `_finish` is its last word at shutdown.
    """

    def __init__(self, *, max_pending: int, metrics: ServeMetrics, snapshot: EngineSnapshot,
                 arrivals: Arrivals | None = None) -> None:
        self.arrivals = arrivals or Arrivals()
        self.max_pending = max_pending
        self.metrics = metrics
        self._lock = threading.Lock()  # guards the two lists below (handlers append, the driver swaps)
        self._submissions: list[Submission] = []
        self._aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._live: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._task: asyncio.Task | None = None
        metrics.set_snapshot(snapshot, 0)  # the engine's gauges from the start, not from the first tick

    @property
    def healthy(self) -> bool:
        """False once the engine can no longer run requests (its process died)."""
        return True

    # ----------------------------------------------------------------------------- handlers' side
    @property
    def num_live(self) -> int:
        return len(self._live)

    async def submit(self, prompts: Sequence[Any], params: Sequence[SamplingParams], ids: Sequence[str],
                     *, stream_text: bool, check_context: bool = True) -> tuple[asyncio.Queue, list[int]]:
        """Queue prompts for the next tick; the queue their deltas arrive on (all of them, in order)
        and their prompt lengths once they are added. Raises QueueFull / ShuttingDown at once, or the
        ValueError validation gave. `check_context`: refuse prompt + max_tokens over the context
        (off when max_tokens was not given and stands for "up to the context")."""
        if self._stopping:
            raise ShuttingDown()
        if not self.healthy:
            raise EngineFailed("engine")
        if len(self._live) + len(ids) > self.max_pending:
            raise QueueFull()
        future = asyncio.get_running_loop().create_future()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.update((rid, queue) for rid in ids)
        self._live.update(ids)
        sub = Submission(prompts, params, ids, stream_text, future, check_context,
                         arrived_at=arrived_at(), submitted_at=time.monotonic())
        with self._lock:
            self._submissions.append(sub)
        submitted()
        self._wake_up()
        try:
            await future
        except BaseException:
            self.abort(ids)  # a validation error (nothing added), or the client left meanwhile
            raise
        return queue, sub.prompt_lens

    def abort(self, ids: Sequence[str]) -> None:
        """Abort requests (those finished already are ignored); applied before the next step."""
        live = [rid for rid in ids if rid in self._live]
        for rid in ids:
            self._queues.pop(rid, None)
        if not live:
            return
        for rid in live:
            self._live.discard(rid)
        with self._lock:
            self._aborts.extend(live)
        self._wake_up()

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _take(self) -> tuple[list[Submission], list[str]]:
        with self._lock:
            subs, self._submissions = self._submissions, []
            aborts, self._aborts = self._aborts, []
        return subs, aborts

    def _arriving(self) -> bool:
        return self.arrivals.count > 0 or bool(self._submissions)

    # ----------------------------------------------------------------------------- the driver's side
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self.run(), name="bridge-engine-loop")

    async def run(self) -> None:
        raise NotImplementedError

    def _fail_all(self, subs: Sequence[Submission], reason: str = "tick") -> None:
        for sub in subs:
            if sub.future is not None and not sub.future.done():
                sub.future.set_exception(EngineFailed(reason))
        for rid in list(self._live):
            queue = self._queues.pop(rid, None)
            if queue is not None:
                queue.put_nowait(EngineFailed(reason))
        with self._lock:
            self._aborts.extend(self._live)
        self._live.clear()

    def deliver(self, result: TickOutcome) -> None:
        """Back on the event loop: resolve the submitters, route the deltas, count."""
        for sub, exc in result.added:
            if sub.future is not None and not sub.future.done():
                if exc is None:
                    sub.future.set_result(None)
                else:
                    sub.future.set_exception(exc)
            elif exc is None:  # the submitter is gone (cancelled): drop what was added
                self.abort(sub.ids)
        for sub, exc in result.added:
            if exc is None:
                self.metrics.prompt_tokens.inc(sum(sub.prompt_lens))
        if result.admit_s is not None:
            self.metrics.tick_admit_seconds.observe(result.admit_s)
        if result.step_s is not None:
            self.metrics.step_seconds.observe(result.step_s)
        if result.aborted_ids:
            self.metrics.aborted.inc(len(result.aborted_ids))
        for delta in result.deltas:
            queue = self._queues.get(delta.request_id)
            self.metrics.generation_tokens.inc(len(delta.new_token_ids))
            if delta.finished:
                if delta.finish_reason in ("stop", "length"):
                    self.metrics.request_success.labels(delta.finish_reason).inc()
                self._live.discard(delta.request_id)
                self._queues.pop(delta.request_id, None)
            if queue is not None:
                queue.put_nowait(delta)
        if result.step_error is not None:
            failure = EngineFailed(result.step_error)
            for rid in list(self._live):
                queue = self._queues.pop(rid, None)
                if queue is not None:
                    queue.put_nowait(failure)
            self._live.clear()
        self.metrics.mm_items.inc(result.mm_items)
        self.metrics.mm_hits.inc(result.mm_hits)
        self.metrics.set_snapshot(result.snapshot, len(self._live))

    # ----------------------------------------------------------------------------- shutdown
    async def drain(self, timeout: float) -> None:
        """Refuse new work and let live requests finish for up to `timeout` s; then end each one that is
        left with `ShuttingDown` (a stream gets an error event and `[DONE]`, a waiting client a 503) and
        abort it in the engine. The server calls this as soon as a shutdown starts, so every stream is
        ended here, before the HTTP server stops waiting for its connections."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._live and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        if self._live:
            logger.warning("aborting %d requests still running at shutdown", len(self._live))
            for rid in list(self._live):
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(ShuttingDown())
            self.abort(list(self._live))

    async def stop(self, timeout: float) -> None:
        """`drain` (at once if it ran already), then end the task."""
        await self.drain(timeout)
        self._wake_up()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=max(5.0, timeout))
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        await self._finish()

    async def _finish(self) -> None:
        """The driver's last word (close files, end a process)."""


class EngineLoop(EngineFront):
    """The front with the ticker in this process: each tick runs in a worker thread."""

    def __init__(self, llm: LLM, *, max_pending: int, metrics: ServeMetrics, arrivals: Arrivals | None = None,
                 arrival_decode_window: int | None = None) -> None:
        self.llm = llm
        self.ticker = EngineTicker(llm, arrival_decode_window=arrival_decode_window)
        super().__init__(max_pending=max_pending, metrics=metrics, snapshot=self.ticker.snapshot(),
                         arrivals=arrivals)

    @property
    def core(self):
        return self.ticker.core

    @property
    def full_decode_window(self) -> int:
        return self.ticker.full_decode_window

    def _tick(self, subs: list[Submission], aborts: list[str]) -> TickOutcome:
        return self.ticker.tick(subs, aborts, self._arriving())

    async def run(self) -> None:
        assert self._wake is not None
        while True:
            subs, aborts = self._take()
            if not subs and not aborts and not self.core.has_unfinished():
                if self._stopping and not self._live:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                result = await asyncio.to_thread(self._tick, subs, aborts)
            except Exception:  # noqa: BLE001 - a bug in a tick must not silently stall every client
                logger.exception("engine tick failed; failing the requests it held")
                self._fail_all(subs)
                continue
            self.deliver(result)

    async def _finish(self) -> None:
        self.ticker.close()
