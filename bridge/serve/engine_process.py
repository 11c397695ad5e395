"""The engine in its own process (`bridge serve --engine-process`): the API process never steps the model.

Why: in one process the event loop (receiving bodies, streaming chunks), the ingest pool's result
threads and the engine's ticks share one interpreter lock: under many clients sending large
prompt-embeds bodies, steps and admission ticks wait for the lock several times as long as they run
offline (`benchmarks/serve.py`). vLLM runs its engine core in its own process
for the same reason. Here the spawned engine process builds the `LLM` and runs `EngineTicker` ticks
back to back; the API process keeps HTTP, parsing and streaming, with the same `EngineFront` as the
in-process loop, so routes, limits, metrics and shutdown behave the same.

Wire: two one-way pipes. Requests (`submit`, `abort`, `arriving`, `stop`) go from a sender thread in
the API process (a large submission never blocks the event loop while the engine is mid-step) to a
receiver thread in the engine process (the pipe never backs up while it steps); tick outcomes come
back to a receiver thread in the API process, which hands them to the event loop. Messages are
pickles between the two halves of one server (the client's payloads were already decoded with
`weights_only` checks before they got here); nothing a client sent is unpickled.

If the engine process dies, every live request fails (500 for streams in flight, 503 for new ones) and
`/health` answers 503. SIGINT/SIGTERM are the API process's to handle: the engine process ignores
them and exits when told to, or when its request pipe closes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bridge.serve.arrivals import Arrivals
from bridge.serve.engine_loop import EngineFront, EngineTicker, Submission, TickOutcome
from bridge.serve.metrics import EngineSnapshot, ServeMetrics

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0
"""How long the API process waits for the engine to load (weights, KV cache, graphs, warm-up)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the API process needs to know of the engine it did not build."""

    llm_dir: str
    hidden_size: int
    max_model_len: int
    device_type: str
    placeholders: dict[str, str]  # modality -> placeholder token text, per registered encoder
    snapshot: EngineSnapshot
    model_name: str
    sample_rates: dict[str, int] = dataclasses.field(default_factory=dict)  # the audio encoders' rates


class _TensorPickler(pickle.Pickler):
    """Pickles a message with its contiguous CPU tensors left out (by index) and collected."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if (type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu"
                and obj.is_contiguous() and not obj.requires_grad):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


def _send(conn, message: Any) -> None:
    """One message: a pickle of everything but its CPU tensors, then each tensor's bytes written from
    its own memory. The receiver reads them straight into the new tensors' storage with the GIL
    released, where torch's pickled-storage path holds the GIL for a copy of every byte: in the engine
    process that time is taken from the step that is running."""
    buf = io.BytesIO()
    pickler = _TensorPickler(buf)
    pickler.dump(message)
    specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in pickler.tensors]
    conn.send_bytes(pickle.dumps((specs, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL))
    fd = conn.fileno()
    for tensor in pickler.tensors:
        view = _bytes_of(tensor)
        while view:
            view = view[os.write(fd, view):]


def _recv(conn) -> Any:
    """The message `_send` sent. Unpickles only what our own engine / API process wrote (see above)."""
    specs, body = pickle.loads(conn.recv_bytes())  # noqa: S301
    fd = conn.fileno()
    tensors = []
    for dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        view = _bytes_of(tensor)
        while view:
            got = os.readv(fd, [view])
            if not got:
                raise EOFError("the pipe closed inside a message")
            view = view[got:]
        tensors.append(tensor)
    return _TensorUnpickler(io.BytesIO(body), tensors).load()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's storage as writable bytes (numpy has no bfloat16: viewed as uint8 first)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def _widen(conn) -> None:
    """Pipe buffers of 1 MiB (Linux, where allowed): a prompt-embeds tensor in a few writes, not 16."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass


# ----------------------------------------------------------------------------- the engine process

def _receive_forever(owner: int, conn, inbox: queue.SimpleQueue) -> None:
    """Engine side: move every request message of one API process into `inbox` as soon as it arrives."""
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            inbox.put((owner, ("eof",)))
            return
        if message[0] == "submit":
            message[1].received_at = time.monotonic()  # for the tick trace
        inbox.put((owner, message))


class _Owners:
    """Which API process each live request belongs to, and each tick's outcome split between them.

    API process 0 gets every tick's outcome: the engine's timings (so a histogram summed over processes
    counts each step once) and the snapshot, which the gauges show (their multiprocess mode keeps the
    most recent value of any process). Every other API process gets a tick's part only when it holds
    something of its own (admissions, deltas, aborts, a failed step): a part sent to each of N
    processes every tick cost the engine N pickles and writes per tick, and woke every API process's
    event loop, on the engine's one thread between its steps.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.of: dict[str, int] = {}

    def split(self, outcome: TickOutcome, aborts: dict[int, list[str]]) -> list[TickOutcome]:
        parts = [TickOutcome([], [], outcome.snapshot, outcome.step_error) for _ in range(self.count)]
        parts[0].admit_s, parts[0].step_s = outcome.admit_s, outcome.step_s
        for sub, exc in outcome.added:
            part = parts[sub.owner]
            part.added.append((sub.token, exc, sub.prompt_lens))
            if exc is None:
                self.of.update((rid, sub.owner) for rid in sub.ids)
                part.mm_items += sub.mm_items
                part.mm_hits += sub.mm_hits
        aborted = set(outcome.aborted_ids)
        for owner, ids in aborts.items():
            parts[owner].aborted_ids = [rid for rid in ids if rid in aborted]
        for rid in aborted:
            self.of.pop(rid, None)
        for delta in outcome.deltas:
            owner = self.of.get(delta.request_id)
            if owner is None:
                continue  # aborted by its API process meanwhile
            parts[owner].deltas.append(delta)
            if delta.finished:
                del self.of[delta.request_id]
        if outcome.step_error is not None:
            self.of.clear()  # the failed step's requests were all aborted
        return parts

    @staticmethod
    def wanted(owner: int, part: TickOutcome) -> bool:
        """Whether API process `owner` gets this part of a tick (see the class docstring)."""
        return owner == 0 or bool(part.added or part.deltas or part.aborted_ids or part.step_error)


class _Outbox:
    """The engine's messages to the API processes, written by a thread of its own, in order per API process.

    Why: a tick's outcome written from the engine's thread is time between one step and the next launch
    (a pickle and a pipe write per API process, a write that waits while that process is slow to read).
    While requests arrive, decode windows are not launched behind one another, so the GPU waited that
    long each tick. Here the engine's thread only queues them and goes on to its next step. A pipe that
    breaks (its API process went) is reported to the engine's inbox as that process's end."""

    def __init__(self, outcomes: list[Any], inbox: queue.SimpleQueue) -> None:
        self.outcomes, self.inbox = outcomes, inbox
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._gone: set[int] = set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bridge-engine-outbox")
        self._thread.start()

    def send(self, owner: int, message: Any) -> None:
        self._queue.put((owner, message))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            owner, message = item
            if owner in self._gone:
                continue
            try:
                _send(self.outcomes[owner], message)
            except (BrokenPipeError, OSError):
                self._gone.add(owner)
                self.inbox.put((owner, ("eof",)))

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout` s), then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)


def engine_main(connections: list[tuple[Any, Any]], args: argparse.Namespace, status: Any) -> None:
    """The engine process: build the LLM as `bridge serve` does, say "ready" (or "failed") on `status`
    to the process that started it, then tick until every API process (one `(requests, outcomes)` pipe
    pair each) has said stop or gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    logger.info("engine process %d started: building the engine", os.getpid())
    outcomes = [out for _, out in connections]
    # here, not at the module's top: the process that starts this one (`bridge serve`) imports the module
    # too, and launches the engine before it imports what the routes need
    imports = time.perf_counter()
    from bridge.serve.engine_build import audio_sample_rates, build_ready_llm, resolve_model
    from runner.multimodal.placeholders import placeholder_token

    resolving = time.perf_counter()
    try:
        model = resolve_model(args.path, verify=not args.no_verify)
        building = time.perf_counter()
        logger.info("the engine's modules imported (%.2f s) and its model resolved (%.2f s)",
                    resolving - imports, building - resolving)
        llm = build_ready_llm(model, args)
        logger.info("engine built in %.2f s", time.perf_counter() - building)
    except BaseException as exc:  # noqa: BLE001 - reported to the API process, which exits with it
        logger.exception("the engine could not be built")
        _send(status, ("failed", (isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"[:2000])))
        return
    ticker = EngineTicker(llm, arrival_decode_window=args.arrival_decode_window)
    placeholders = {m: placeholder_token(m, enc) for m, enc in llm.mm.encoders.items()}
    _send(status, ("ready", EngineInfo(str(model.llm_dir), llm.hidden_size, llm.max_model_len,
                                       llm.device.type, placeholders, ticker.snapshot(), model.name,
                                       audio_sample_rates(dict(llm.mm.encoders)))))
    status.close()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    for owner, (requests, _) in enumerate(connections):
        threading.Thread(target=_receive_forever, args=(owner, requests, inbox), daemon=True,
                         name=f"bridge-engine-inbox-{owner}").start()
    owners = _Owners(len(connections))
    outbox = _Outbox(outcomes, inbox)
    subs: list[Submission] = []
    aborts: dict[int, list[str]] = {}
    arriving = [0] * len(connections)
    done: set[int] = set()
    try:
        while len(done) < len(connections):
            busy = bool(subs or aborts or ticker.core.has_unfinished())
            try:
                messages = [inbox.get(block=not busy)]
            except queue.Empty:
                messages = []
            while True:
                try:
                    messages.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for owner, message in messages:
                kind = message[0]
                if kind == "submit":
                    subs.append(message[1])
                elif kind == "abort":
                    aborts.setdefault(owner, []).extend(message[1])
                elif kind == "arriving":
                    arriving[owner] = message[1]
                elif kind in ("stop", "eof"):
                    done.add(owner)
                    arriving[owner] = 0
                    gone = [rid for rid, o in owners.of.items() if o == owner]
                    if gone:  # an API process that left: its requests go
                        aborts.setdefault(owner, []).extend(gone)
            if not (subs or aborts or ticker.core.has_unfinished()):
                continue
            all_aborts = [rid for ids in aborts.values() for rid in ids]
            try:
                outcome = ticker.tick(subs, all_aborts, sum(arriving) > 0 or not inbox.empty())
            except Exception:  # noqa: BLE001 - a bug in a tick must not silently stall every client
                logger.exception("engine tick failed; failing the requests it held")
                for owner in {sub.owner for sub in subs} - done:
                    outbox.send(owner, ("tick_failed", [sub.token for sub in subs if sub.owner == owner]))
                subs, aborts = [], {}
                continue
            parts = owners.split(outcome, aborts)
            subs, aborts = [], {}
            for owner, part in enumerate(parts):
                if owner not in done and owners.wanted(owner, part):
                    outbox.send(owner, ("tick", part))
    finally:
        outbox.close()
        ticker.close()
        llm.shutdown()


# ----------------------------------------------------------------------------- the API process

@dataclass
class EngineLink:
    """One API process's ends of its two pipes to the engine process (`owner`: its index there)."""

    requests: Any
    outcomes: Any
    owner: int = 0


class EngineProcess:
    """The spawned engine process and, per API process, the two pipe ends it talks through."""

    def __init__(self, args: argparse.Namespace, *, api_processes: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")  # the API process may hold threads; never fork them
        self.links: list[EngineLink] = []
        engine_ends = []
        for owner in range(api_processes):
            requests_recv, requests = ctx.Pipe(duplex=False)
            outcomes, outcomes_send = ctx.Pipe(duplex=False)
            _widen(requests)
            _widen(outcomes_send)  # ticks queue up there while an API process is busy, not in the engine
            self.links.append(EngineLink(requests, outcomes, owner))
            engine_ends.append((requests_recv, outcomes_send))
        self._engine_ends = engine_ends
        # ready / failed come on a pipe of their own: the link pipes may already be in API processes
        self._status, self._status_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, name="bridge-engine",
                                   args=(engine_ends, args, self._status_send))

    def start(self, timeout: float = READY_TIMEOUT_S) -> EngineInfo:
        """Start the process and wait until its engine is built (`launch`, then `wait_ready`)."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process; it builds the engine while this process goes on (API processes start
        meanwhile: their imports overlap the engine's build and warm-up)."""
        self.process.start()
        for requests_recv, outcomes_send in self._engine_ends:
            requests_recv.close()
            outcomes_send.close()
        self._status_send.close()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> EngineInfo:
        """Wait until the launched engine is built. Raises what building it raised: a ValueError (a bad
        path or option, which `bridge serve` prints as one line) as a ValueError, anything else as a
        RuntimeError with its type and message."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # the status pipe or the process's end, whichever comes first: no polling interval between
            # the engine being ready and the API processes hearing of it
            woke = wait([self._status, self.process.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if self._status in woke:
                try:
                    kind, payload = _recv(self._status)
                except EOFError:
                    break
                self._status.close()
                if kind == "ready":
                    logger.info("engine process %d ready", self.process.pid)
                    return payload
                self.join(timeout=10)
                is_value_error, message = payload
                raise (ValueError if is_value_error else RuntimeError)(message)
            if not self.process.is_alive():
                break
        self._status.close()
        self.join(timeout=5)
        raise RuntimeError(f"the engine process exited (code {self.process.exitcode}) before it was ready")

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the engine to end (it does once every API process said stop or went), kill it if
        it hangs, close this process's pipe ends."""
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        for link in self.links:
            link.requests.close()
            link.outcomes.close()


class EngineProcessFront(EngineFront):
    """The front of an engine that runs in an `EngineProcess`, over one `EngineLink`.

    The task forwards queued submissions, aborts and the arrivals count to a sender thread; a
    receiver thread turns the engine's tick outcomes into `deliver` calls on the event loop. At the
    end it says stop (after every abort it queued) and, in the process that started the engine,
    waits for the engine to end (`on_finish`).
    """

    def __init__(self, link: EngineLink, info: EngineInfo, *, max_pending: int, metrics: ServeMetrics,
                 arrivals: Arrivals | None = None, on_finish: Callable[[], None] | None = None) -> None:
        super().__init__(max_pending=max_pending, metrics=metrics, snapshot=info.snapshot, arrivals=arrivals)
        self.link = link
        self.on_finish = on_finish
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[int, Submission] = {}
        self._next_token = 0
        self._arriving_sent = 0
        self._alive = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self.arrivals.listeners.append(self._wake_up)

    @property
    def healthy(self) -> bool:
        return self._alive

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for target, name in ((self._send_forever, "bridge-engine-outbox"),
                             (self._receive_forever, "bridge-engine-outcomes")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        super().start()

    async def run(self) -> None:
        assert self._wake is not None
        while True:
            subs, aborts = self._take()
            for sub in subs:
                self._next_token += 1
                sub.token = self._next_token
                self._sent[sub.token] = sub
                sub.owner = self.link.owner
                self._outbox.put(("submit", dataclasses.replace(sub, future=None)))
            if aborts:
                self._outbox.put(("abort", aborts))
            count = self.arrivals.count
            if count != self._arriving_sent:
                self._arriving_sent = count
                self._outbox.put(("arriving", count))
            if subs or aborts:
                continue
            if self._stopping and not self._live and not self._sent:
                return
            self._wake.clear()
            await self._wake.wait()

    def _send_forever(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                _send(self.link.requests, message)
            except (BrokenPipeError, OSError):
                return  # the receiver thread reports the death

    def _receive_forever(self) -> None:
        assert self._loop is not None
        while True:
            try:
                kind, payload = _recv(self.link.outcomes)
            except (EOFError, OSError):
                kind, payload = "gone", None
            handler = {"tick": self._on_tick, "tick_failed": self._on_tick_failed,
                       "gone": self._engine_gone}[kind]
            try:
                self._loop.call_soon_threadsafe(handler, *(() if payload is None else (payload,)))
            except RuntimeError:  # the event loop closed: the server is gone already
                return
            if kind == "gone":
                return

    def _on_tick(self, outcome: TickOutcome) -> None:
        added = []
        for token, exc, lens in outcome.added:
            sub = self._sent.pop(token)
            sub.prompt_lens = lens
            added.append((sub, exc))
        outcome.added = added
        self.deliver(outcome)
        if self._stopping:
            self._wake_up()

    def _on_tick_failed(self, tokens: list[int]) -> None:
        self._fail_all([self._sent.pop(token) for token in tokens if token in self._sent])

    def _engine_gone(self) -> None:
        if not self._alive:
            return
        self._alive = False
        if not self._stopping:
            logger.error("the engine process died; failing every live request")
        pending, _ = self._take()
        self._fail_all(list(self._sent.values()) + pending, reason="engine process")
        self._sent.clear()
        with self._lock:
            self._aborts = []
        self._wake_up()

    async def _finish(self) -> None:
        self.arrivals.listeners.remove(self._wake_up)
        self._outbox.put(("stop",))  # after every abort queued before it, from the one writer thread
        self._outbox.put(None)
        await asyncio.to_thread(self._threads[0].join, 5)
        if self.on_finish is not None:
            await asyncio.to_thread(self.on_finish)
        else:
            self.link.requests.close()
