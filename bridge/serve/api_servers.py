"""Several API processes in front of one engine process (`bridge serve --api-server-count N`), as vLLM.

Why: with the engine in its own process, what limits a burst of large prompt-embeds bodies is the one
process that receives, parses and forwards them (about 2.8 ms per 1.9 MB request on an H200 host:
64 requests reach the engine over 0.2 s). N API processes share the listening socket (the kernel
hands each connection to one of them) and each talks to the engine over its own pair of pipes, so
ingest runs N-wide while the engine still batches every request together.

Layout: this (parent) process starts the engine process, binds the socket, starts the N API
processes and then only watches. SIGTERM or SIGINT to it is passed to every API process, which drains
as a single server does (stops accepting, lets its running requests finish within
`--shutdown-timeout`, aborts the rest) and tells the engine it is done; the engine process ends when
all of them have; the parent exits 0. If an API process dies, the others are stopped and the parent
exits 1: a server that silently lost a share of its connections would be worse.

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
import time
from typing import Any

from bridge.serve.app import build_app
from bridge.serve.engine_process import EngineInfo, EngineLink, EngineProcess
from bridge.serve.state_builder import server_state
from bridge.serve.uvicorn_server import graceful_server, uvicorn_config

logger = logging.getLogger("bridge.serve")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def api_server_main(index: int, args: argparse.Namespace, info: EngineInfo, link: EngineLink,
                    sock: Any) -> None:
    """One API process: the same app as a single server, over its link to the engine process."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api {index}]: %(message)s")
    state = server_state(args, engine_link=link, info=info)
    graceful_server(uvicorn_config(build_app(state), args)).run(sockets=[sock])


def serve_with_api_servers(args: argparse.Namespace) -> int:
    """Start the engine process and `args.api_server_count` API processes; watch them until a signal."""
    import uvicorn

    count = args.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="bridge-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir  # inherited by the processes started below
    engine = EngineProcess(args, api_processes=count)
    try:
        info = engine.start()
    except BaseException:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    sock = uvicorn.Config(app=None, host=args.host, port=args.port).bind_socket()
    ctx = multiprocessing.get_context("spawn")
    apis = [ctx.Process(target=api_server_main, name=f"bridge-api-{i}", args=(i, args, info, link, sock))
            for i, link in enumerate(engine.links)]
    for process in apis:
        process.start()
    sock.close()
    for link in engine.links:  # the API processes hold their own ends now
        link.requests.close()
        link.outcomes.close()
    logger.info("serving %s as %r on http://%s:%d with %d API processes (pids %s) and engine process %d",
                args.path, args.served_model_name or info.model_name, args.host, args.port, count,
                [p.pid for p in apis], engine.process.pid)

    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            logger.info("signal %d: stopping the API processes", signum)
            for process in apis:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed = False
    try:
        while any(p.is_alive() for p in apis):
            time.sleep(0.2)
            dead = [p for p in apis if not p.is_alive() and p.exitcode != 0]
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
    codes = [p.exitcode for p in apis]
    return 1 if failed or any(codes) or engine.process.exitcode else 0
