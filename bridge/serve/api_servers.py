"""Several API processes in front of one engine process (`bridge serve --api-server-count N`), as vLLM.

Why: with the engine in its own process, what limits a burst of large prompt-embeds bodies is the one
process that receives, parses and forwards them (about 2.8 ms per 1.9 MB request on an H200 host:
64 requests reach the engine over 0.2 s). N API processes share the port (the kernel hands each
connection to one of them) and each talks to the engine over its own pair of pipes, so
ingest runs N-wide while the engine still batches every request together.

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
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import wait
from typing import Any

from bridge.serve.app import build_app
from bridge.serve.engine_build import engine_device_type
from bridge.serve.engine_process import EngineInfo, EngineLink, EngineProcess
from bridge.serve.ingest import close_pool, spawn_ingest_pool, warm_up
from bridge.serve.listen_sockets import listening_sockets
from bridge.serve.state_builder import ingest_workers, server_state
from bridge.serve.uvicorn_server import graceful_server, uvicorn_config

logger = logging.getLogger("bridge.serve")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
POLL_S = 0.1  # how often an API process waiting to start looks at its stop flag


def api_server_main(index: int, args: argparse.Namespace, link: EngineLink, sock: Any, ready: Any) -> None:
    """One API process: the same app as a single server, over its link to the engine process.

    Started while the engine builds: it starts its ingest pool meanwhile (each worker imports torch)
    and waits on `ready` (a pipe from the parent) for the engine's `EngineInfo`, or None (the engine
    failed, or the server is stopping): then it ends quietly. A SIGTERM or SIGINT before uvicorn takes
    the signals over only sets a flag (raising out of a handler in the middle of the pool's own locks
    can hang it), which every wait below checks, and which stops the server if it already exists."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api {index}]: %(message)s")
    stopping = threading.Event()
    server = None

    def stop_early(_signum, _frame) -> None:
        stopping.set()
        if server is not None:  # built, but uvicorn's own handlers are not in place yet
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_early)
    guessed = ingest_workers(args, engine_device_type(args))
    pool = spawn_ingest_pool(guessed) if guessed > 0 else None
    warming = warm_up(pool, guessed) if pool is not None else []
    info = None
    try:
        while not stopping.is_set() and not ready.poll(POLL_S):
            pass
        if not stopping.is_set():
            try:
                info = ready.recv()
            except EOFError:
                pass
        ready.close()
        while info is not None and warming and not stopping.is_set():
            warming = list(wait(warming, timeout=POLL_S).not_done)
        if info is None or stopping.is_set():
            return
        if pool is not None and ingest_workers(args, info.device_type) != guessed:
            close_pool(pool)
            pool = None
        state = server_state(args, engine_link=link, info=info, ingest_pool=pool)
        pool = None  # the app's body parser owns it now, and closes it at shutdown
    finally:
        if pool is not None:
            close_pool(pool)
    server = graceful_server(uvicorn_config(build_app(state), args), drain=state.drain)
    if stopping.is_set():
        server.should_exit = True  # a signal came while the app was being built: start, then stop
    server.run(sockets=[sock])


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
