"""The engine in its own process (`bridge serve --engine-process`): the API process never steps the model.

Why: in one process the event loop (receiving bodies, streaming chunks), the ingest pool's result
threads and the engine's ticks share one interpreter lock. On an H200 with 64 clients sending W1's
1.9 MB prompt-embeds bodies, prefill steps that take 10-20 ms offline took up to 67 ms in the server
and admission ticks 24-74 ms, all waiting for the lock. vLLM runs its engine core in its own process
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
import io
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from bridge.serve.arrivals import Arrivals
from bridge.serve.engine_build import build_ready_llm, resolve_model
from bridge.serve.engine_loop import EngineFront, EngineTicker, Submission, TickOutcome
from bridge.serve.metrics import EngineSnapshot, ServeMetrics
from runner.multimodal.placeholders import placeholder_token

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


@dataclass
class WireSubmission:
    """A submission as it crosses the pipe (no future); `prompt_lens` is filled by the tick."""

    token: int
    prompts: Any
    params: Any
    ids: Any
    stream_text: bool
    check_context: bool
    prompt_lens: list[int]


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
    released, where torch's pickled-storage path costs about 1 ms of GIL per 1 MB prompt-embeds
    tensor: in the engine process that time is taken from the step that is running."""
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

def _receive_forever(conn, inbox: queue.SimpleQueue) -> None:
    """Engine side: move every request message into `inbox` as soon as it arrives."""
    while True:
        try:
            inbox.put(_recv(conn))
        except (EOFError, OSError):
            inbox.put(("eof",))
            return


def engine_main(requests_conn, outcomes_conn, args: argparse.Namespace) -> None:
    """The engine process: build the LLM as `bridge serve` does, then tick until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        model = resolve_model(args.path)
        llm = build_ready_llm(model, args)
    except BaseException as exc:  # noqa: BLE001 - reported to the API process, which exits with it
        logger.exception("the engine could not be built")
        _send(outcomes_conn, ("failed", (isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"[:2000])))
        return
    ticker = EngineTicker(llm, arrival_decode_window=args.arrival_decode_window)
    placeholders = {m: placeholder_token(m, enc) for m, enc in llm.mm.encoders.items()}
    _send(outcomes_conn, ("ready", EngineInfo(str(model.llm_dir), llm.hidden_size, llm.max_model_len,
                                              llm.device.type, placeholders, ticker.snapshot(), model.name)))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive_forever, args=(requests_conn, inbox), daemon=True,
                     name="bridge-engine-inbox").start()
    subs: list[WireSubmission] = []
    aborts: list[str] = []
    arriving = 0
    running = True
    try:
        while running:
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
            for message in messages:
                kind = message[0]
                if kind == "submit":
                    subs.append(message[1])
                elif kind == "abort":
                    aborts.extend(message[1])
                elif kind == "arriving":
                    arriving = message[1]
                elif kind in ("stop", "eof"):
                    running = False
            if not running or not (subs or aborts or ticker.core.has_unfinished()):
                continue
            try:
                outcome = ticker.tick(subs, aborts, arriving > 0 or not inbox.empty())
            except Exception:  # noqa: BLE001 - a bug in a tick must not silently stall every client
                logger.exception("engine tick failed; failing the requests it held")
                _send(outcomes_conn, ("tick_failed", [sub.token for sub in subs]))
                subs, aborts = [], []
                continue
            subs, aborts = [], []
            outcome.added = [(sub.token, exc, sub.prompt_lens) for sub, exc in outcome.added]
            _send(outcomes_conn, ("tick", outcome))
    except (BrokenPipeError, EOFError, OSError):
        pass  # the API process is gone
    finally:
        ticker.close()
        llm.shutdown()


# ----------------------------------------------------------------------------- the API process

class EngineProcess:
    """The spawned engine process and the API process's ends of its two pipes."""

    def __init__(self, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")  # the API process may hold threads; never fork them
        self._requests_recv, self.requests = ctx.Pipe(duplex=False)
        self.outcomes, self._outcomes_send = ctx.Pipe(duplex=False)
        _widen(self.requests)
        self.process = ctx.Process(target=engine_main, name="bridge-engine",
                                   args=(self._requests_recv, self._outcomes_send, args))

    def start(self, timeout: float = READY_TIMEOUT_S) -> EngineInfo:
        """Start the process and wait until its engine is built. Raises what building it raised: a
        ValueError (a bad path or option, which `bridge serve` prints as one line) as a ValueError,
        anything else as a RuntimeError with its type and message."""
        self.process.start()
        self._requests_recv.close()
        self._outcomes_send.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.outcomes.poll(0.5):
                try:
                    kind, payload = _recv(self.outcomes)
                except EOFError:
                    break
                if kind == "ready":
                    logger.info("engine process %d ready", self.process.pid)
                    return payload
                self.close(timeout=10, send_stop=False)
                is_value_error, message = payload
                raise (ValueError if is_value_error else RuntimeError)(message)
            if not self.process.is_alive():
                break
        self.close(timeout=5)
        raise RuntimeError(f"the engine process exited (code {self.process.exitcode}) before it was ready")

    def close(self, timeout: float = 30.0, *, send_stop: bool = True) -> None:
        """Ask the engine to stop (unless the caller's sender thread did), wait, kill it if it hangs."""
        if send_stop:
            try:
                _send(self.requests, ("stop",))
            except (BrokenPipeError, OSError):
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        for conn in (self.requests, self.outcomes):
            conn.close()


class RemoteEngineLoop(EngineFront):
    """The front of an engine that runs in an `EngineProcess`.

    The task forwards queued submissions, aborts and the arrivals count to a sender thread; a
    receiver thread turns the engine's tick outcomes into `deliver` calls on the event loop.
    """

    def __init__(self, engine: EngineProcess, info: EngineInfo, *, max_pending: int, metrics: ServeMetrics,
                 arrivals: Arrivals | None = None) -> None:
        super().__init__(max_pending=max_pending, metrics=metrics, max_model_len=info.max_model_len,
                         snapshot=info.snapshot, arrivals=arrivals)
        self.engine = engine
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[int, Submission] = {}
        self._next_token = 0
        self._arriving_sent = 0
        self._alive = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self.arrivals.on_change = self._wake_up

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
                self._outbox.put(("submit", WireSubmission(sub.token, sub.prompts, sub.params, sub.ids,
                                                           sub.stream_text, sub.check_context, [])))
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
                _send(self.engine.requests, message)
            except (BrokenPipeError, OSError):
                return  # the receiver thread reports the death

    def _receive_forever(self) -> None:
        assert self._loop is not None
        while True:
            try:
                kind, payload = _recv(self.engine.outcomes)
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._engine_gone)
                return
            if kind == "tick":
                self._loop.call_soon_threadsafe(self._on_tick, payload)
            elif kind == "tick_failed":
                self._loop.call_soon_threadsafe(self._on_tick_failed, payload)

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
            logger.error("the engine process died (exit code %s); failing every live request",
                         self.engine.process.exitcode)
        pending, _ = self._take()
        self._fail_all(list(self._sent.values()) + pending, reason="engine process")
        self._sent.clear()
        with self._lock:
            self._aborts = []
        self._wake_up()

    async def _finish(self) -> None:
        self.arrivals.on_change = None
        self._outbox.put(("stop",))  # after every abort queued before it, from the one writer thread
        self._outbox.put(None)
        if self._threads:
            await asyncio.to_thread(self._threads[0].join, 5)
        await asyncio.to_thread(self.engine.close, send_stop=not self._threads)
        for thread in self._threads[1:]:
            thread.join(timeout=5)
