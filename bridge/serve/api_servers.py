"""Several API processes in front of one engine process (`bridge serve --api-server-count N`), as vLLM.

Why: with the engine in its own process, what limits a burst of large prompt-embeds bodies is the one
process that receives, parses and forwards them: a burst reaches the engine one body at a time. N API
processes share the port (the kernel hands each connection to one of them) and each talks to the
engine over its own pair of pipes, so ingest runs N-wide while the engine still batches every request
together.

Layout: this (parent) process launches the engine process, binds the sockets, starts the N API
processes while the engine builds (their imports take seconds each, as long as a small engine's
build), hands each the engine's description once it is ready, and then only watches. Each API
process listens on a socket of its own, all on the one port, so the kernel spreads connections
evenly (`listen_sockets.py`: a shared socket gave a burst to whichever process woke first). A port already
taken fails at once, not after the build. SIGTERM or SIGINT to it is passed to every API process, which
drains as a single server does (stops accepting, lets its running requests finish within
`--shutdown-timeout`, aborts the rest) and tells the engine it is done; the engine process ends when
all of them have; the parent exits 0, also when the signal came while API processes were still
starting. If an API process dies, the others are stopped and the parent exits 1: a server that
silently lost a share of its connections would be worse.

Metrics: each API process keeps its own; prometheus-client's multiprocess mode (a directory the
parent makes and removes) lets `/metrics` on any of them report the sum (see `metrics.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bridge.serve.engine_process import EngineInfo, EngineLink, EngineProcess
from bridge.serve.listen_sockets import listening_sockets

logger = logging.getLogger("bridge.serve")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def api_server_main(index: int, args: argparse.Namespace, link: EngineLink, sock: Any, ready: Any) -> None:
    """One API process: the same app as a single server, over its link to the engine process.

    Started while the engine builds, it serves at once (`starting.py`: `/health` 503 until the engine is
    ready) and meanwhile imports the routes' modules, loads the tokenizer and starts its ingest pool
    (each worker imports torch); then it waits on `ready` (a pipe from the parent) for the engine's
    `EngineInfo`, builds the routes' state and serves them. None on `ready` (the engine failed, or the
    server is stopping) ends it quietly. A SIGTERM or SIGINT before uvicorn takes the signals over
    only sets a flag (raising out of a handler in the middle of an import can hang it) and, once the
    server object exists, asks it to stop as soon as it runs."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api {index}]: %(message)s")
    stopping = threading.Event()
    server = None

    def stop_early(_signum, _frame) -> None:
        stopping.set()
        if server is not None:  # built, but uvicorn's own handlers are not in place yet: it stops at once
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_early)
    from bridge.serve.starting import StartingApp
    from bridge.serve.uvicorn_server import graceful_server, uvicorn_config

    bring_up = _BringUp(args, link, ready)
    starting = StartingApp(bring_up.run, _build_app, on_stop_early=bring_up.close,
                           engine_ready=bring_up.engine_ready)
    server = graceful_server(uvicorn_config(starting, args), drain=starting.drain)
    starting.server = server
    if stopping.is_set():
        bring_up.close()
        return
    try:
        server.run(sockets=[sock])
    finally:
        bring_up.close()
    if starting.failure is not None:
        logger.error("could not start serving: %s: %s", type(starting.failure).__name__, starting.failure)
        raise SystemExit(1)


def _build_app(state: Any) -> Any:
    from bridge.serve.app import build_app

    return build_app(state)


class _BringUp:
    """An API process's way to its routes' state: what does not need the engine is done while it
    builds (imports, the tokenizer of a plain model directory, the ingest pool's start), the rest
    once the parent hands over the engine's description."""

    def __init__(self, args: argparse.Namespace, link: EngineLink, ready: Any) -> None:
        self.args, self.link, self.ready = args, link, ready
        self.pool: Any = None  # the ingest pool until the state owns it
        self._lock = threading.Lock()  # `close` may come while `_prepare` starts the pool in its thread
        self._closed = False
        self._heard = False  # the parent's word on the engine has come (its EngineInfo, or None)

    def engine_ready(self) -> bool:
        """Whether the parent has handed over the engine's description (or is about to: it waits in
        the pipe), so that the routes are about to be built."""
        if self._heard:
            return True
        try:
            return self.ready.poll()
        except (OSError, EOFError):
            return False

    async def run(self) -> Any:
        args = self.args
        preparing = asyncio.create_task(asyncio.to_thread(self._prepare))
        try:
            info = await _receive_info(self.ready)
            self._heard = True
            guessed, warming, tokenizer = await preparing
        finally:
            if not preparing.done():
                preparing.cancel()
        if info is None:
            return None
        from bridge.serve.state_builder import ingest_workers, server_state

        if warming:
            await asyncio.gather(*map(asyncio.wrap_future, warming))
        if self.pool is not None and ingest_workers(args, info.device_type) != guessed:
            self._close_pool()
        if tokenizer is _NOT_LOADED or Path(info.llm_dir) != Path(args.path):
            tokenizer = _NOT_LOADED
        state = await asyncio.to_thread(server_state, args, engine_link=self.link, info=info,
                                        ingest_pool=self.pool, **_given(tokenizer))
        self.pool = None  # the app's body parser owns it now, and closes it at shutdown
        return state

    def _prepare(self) -> tuple[int, list, Any]:
        """In a thread, while the engine builds: the modules the routes need, the ingest pool's start,
        and the tokenizer when PATH is a plain model directory (the engine's own then)."""
        import bridge.serve.app  # noqa: F401 - imported now, not once the engine is ready
        from bridge.serve.engine_build import engine_device_type
        from bridge.serve.ingest import spawn_ingest_pool, warm_up
        from bridge.serve.state_builder import ingest_workers
        from runner.hf_config import load_tokenizer

        started = time.perf_counter()
        guessed = ingest_workers(self.args, engine_device_type(self.args))
        warming = []
        with self._lock:
            if guessed > 0 and not self._closed:
                self.pool = spawn_ingest_pool(guessed)
                warming = warm_up(self.pool, guessed)
        path = Path(self.args.path)
        tokenizer = _NOT_LOADED
        if (path / "config.json").is_file() and not (path / "meta.json").is_file():
            tokenizer = load_tokenizer(str(path))
        logger.info("prepared while the engine starts (%.2f s): the routes' modules%s%s",
                    time.perf_counter() - started, "" if tokenizer is _NOT_LOADED else ", the tokenizer",
                    f", {guessed} ingest workers starting" if warming else "")
        return guessed, warming, tokenizer

    def _close_pool(self) -> None:
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            from bridge.serve.ingest import close_pool

            close_pool(pool)

    def close(self) -> None:
        """Close the pool if the state never took it (a stop during start-up, or a failed start); one
        that `_prepare` would start after this is not started."""
        with self._lock:
            self._closed = True
        self._close_pool()


_NOT_LOADED = object()


def _given(tokenizer: Any) -> dict:
    return {} if tokenizer is _NOT_LOADED else {"tokenizer": tokenizer}


async def _receive_info(ready: Any) -> EngineInfo | None:
    from bridge.serve.starting import receive_when_ready

    try:
        return await receive_when_ready(ready)
    finally:
        ready.close()


def _stopped_by(exitcode: int | None, stopping: bool) -> bool:
    """Whether an API process ended as it should: 0, or killed by the SIGTERM/SIGINT the parent passed
    on while it was still starting (before uvicorn's handlers were in place)."""
    return exitcode == 0 or (stopping and exitcode in (-signal.SIGTERM, -signal.SIGINT))


def serve_with_api_servers(args: argparse.Namespace) -> int:
    """Start the engine process and `args.api_server_count` API processes; watch them until a signal."""
    count = args.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="bridge-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir  # inherited by the processes started below
    ctx = multiprocessing.get_context("spawn")
    try:  # first, so that a port already taken fails before anything starts
        socks = listening_sockets(args.host, args.port, count)
    except BaseException:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    logger.info("starting the engine process and %d API processes", count)
    engine = EngineProcess(args, api_processes=count)
    engine.launch()
    ready_pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
    apis = [ctx.Process(target=api_server_main, name=f"bridge-api-{i}", args=(i, args, link, sock, recv))
            for i, (link, sock, (recv, _)) in enumerate(zip(engine.links, socks, ready_pipes))]
    for process in apis:
        process.start()
    for sock in set(socks):  # the API processes hold their own now
        sock.close()
    for link in engine.links:  # the API processes hold their own ends now
        link.requests.close()
        link.outcomes.close()
    for recv, _ in ready_pipes:
        recv.close()

    stopping = False
    engine_ready = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            logger.info("signal %d: stopping the API processes", signum)
            for process in apis:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGTERM)
            if not engine_ready:  # still building (it ignores SIGTERM): nothing of it to drain
                engine.process.kill()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed = False
    try:
        try:
            info = engine.wait_ready()
        except BaseException:
            for _, send in ready_pipes:
                _tell(send, None)
            for process in apis:
                process.join(30)
                if process.is_alive():
                    process.kill()
            if stopping:  # a signal during start-up: a clean stop, not a failed build
                return 0
            raise
        engine_ready = True
        for _, send in ready_pipes:
            _tell(send, None if stopping else info)
        logger.info("serving %s as %r on http://%s:%d with %d API processes (pids %s) and engine process %d",
                    args.path, args.served_model_name or info.model_name, args.host, args.port, count,
                    [p.pid for p in apis], engine.process.pid)
        while any(p.is_alive() for p in apis):
            time.sleep(0.2)
            dead = [p for p in apis if not p.is_alive() and not _stopped_by(p.exitcode, stopping)]
            if dead and not stopping:
                failed = True
                logger.error("API process %s exited with %s; stopping the server", dead[0].name,
                             dead[0].exitcode)
                stop(signal.SIGTERM, None)
        # the engine process ends once every API process said stop (or went)
        engine.process.join(timeout=60)
        if engine.process.is_alive():
            logger.warning("the engine process did not stop; killing it")
            engine.process.kill()
            engine.process.join(5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    clean = all(_stopped_by(p.exitcode, stopping) for p in apis)
    return 1 if failed or not clean or engine.process.exitcode else 0


def _tell(send: Any, info: EngineInfo | None) -> None:
    """Hand one API process the engine's description (None: end), then close the pipe; an API process
    that already died leaves a broken pipe, which the watch loop then reports."""
    try:
        send.send(info)
    except (BrokenPipeError, OSError):
        pass
    finally:
        send.close()
