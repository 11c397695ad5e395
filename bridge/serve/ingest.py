"""Large request bodies parsed in worker processes: JSON and prompt-embeds payloads off the engine's GIL.

Why: the server's event loop, its engine loop and every stream share one interpreter lock. A
prompt-embeds request is a JSON body of megabytes, and `json.loads` and `load_prompt_embeds` (base64 +
archive checks + the tensor) hold the lock throughout; under many clients the bodies queue behind each
other for longer than the generation takes, and the engine idles. In a pool of spawned processes the
same work runs in parallel and the event loop only moves bytes: the body out, and each decoded
tensor's raw bytes back.

What a worker returns is plain data (the parsed JSON with each top-level `prompt_embeds` string
replaced by `PLACEHOLDER`, and per payload either `(bytes, dtype name, shape)` or the `ValueError`
message); the tensor is rebuilt with `torch.frombuffer`, so nothing from a client is ever unpickled
in either process, and a payload is validated by the same `load_prompt_embeds` as the inline path.

Both here and in a worker the JSON goes through `bridge.serve.json_body.loads_body` (`json.loads`,
with long base64 strings kept out of its character-by-character string scan).

Bodies up to `inline_bytes` are parsed in the event loop as before (the hop costs more than it
saves on small ones); with `workers=0` every body is (the CPU-device default: there the engine
needs the cores, and the default with several API processes). Either way a body's top-level payloads
are decoded as it is parsed (`decode_payloads`), before the route validates the request's model:
each payload string then still carries the bytes `json_body.py` decoded while checking it, which the
model's validated copy of the string does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request
from fastapi.routing import APIRoute

from bridge.serve.json_body import loads_body
from bridge.serve.metrics import ServeMetrics
from bridge.wire import load_prompt_embeds

logger = logging.getLogger(__name__)

PLACEHOLDER = "<bridge: decoded by the ingest pool>"
"""What a pre-decoded `prompt_embeds` string becomes in the parsed body (the payload itself stays in
the worker). Only positions matter: a client that sends this text gets it base64-decoded (a 400)."""

DEFAULT_INLINE_BYTES = 256 * 2**10


@dataclass(frozen=True)
class EmbedsSpec:
    """What a worker needs to validate payloads exactly as the inline path does."""

    enabled: bool
    hidden_size: int
    max_bytes: int
    max_rows: int
    max_prompts: int


@dataclass
class DecodedEmbeds:
    """One payload as the pool decoded it: a tensor, or the 400's message; and the worker's time."""

    tensor: torch.Tensor | None
    error: str | None
    seconds: float


@dataclass
class ParsedBody:
    data: Any
    embeds: list[DecodedEmbeds] | None  # aligned with the body's prompt_embeds list; None: not pre-decoded


def default_workers(device_type: str, *, api_processes: int = 1) -> int:
    """Half the cores, up to 8, on a GPU server with one API process; 0 on a CPU server (there the
    engine needs the cores) and with several API processes: those parse in their own event loops,
    in parallel already, and a pool's hop (the body out, the tensor back, over one pipe per pool)
    only added to each request's way (W1 behind 8 API processes, 64 clients: 0.87 of offline with a
    worker each, 0.88 parsing in the event loops, and start-up 32 s against 60 s)."""
    if device_type != "cuda" or api_processes > 1:
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


# ----------------------------------------------------------------------------- in the worker

def _init_worker() -> None:
    torch.set_num_threads(1)  # one payload per process at a time; no OpenMP teams fighting the engine


def _warm() -> int:
    return os.getpid()


def decode_payloads(data: Any, spec: EmbedsSpec) -> list[DecodedEmbeds] | None:
    """A parsed body's top-level `prompt_embeds` payloads, decoded and checked as the route would, each
    replaced by `PLACEHOLDER` in `data`; None (and `data` untouched) when it has none, or when the route
    refuses them unread (prompt embeds off, too many prompts). Every payload error is its 400's message."""
    embeds = data.get("prompt_embeds") if isinstance(data, dict) else None
    payloads = [embeds] if isinstance(embeds, str) else embeds
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        return None
    if not spec.enabled or len(payloads) > spec.max_prompts:
        return None
    decoded = []
    for payload in payloads:
        start = time.perf_counter()
        try:
            tensor = load_prompt_embeds(payload, hidden_size=spec.hidden_size, max_bytes=spec.max_bytes,
                                        max_rows=spec.max_rows, check_finite=False)
            decoded.append(DecodedEmbeds(tensor, None, time.perf_counter() - start))
        except ValueError as exc:
            decoded.append(DecodedEmbeds(None, str(exc), time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001 - hostile input: the route answers 400, the server lives
            message = f"prompt_embeds could not be decoded ({type(exc).__name__})"
            decoded.append(DecodedEmbeds(None, message, time.perf_counter() - start))
    data["prompt_embeds"] = PLACEHOLDER if isinstance(embeds, str) else [PLACEHOLDER] * len(payloads)
    return decoded


def parse_in_worker(body: bytes, spec: EmbedsSpec) -> tuple[str, Any, Any]:
    """("json_error", msg, pos) or ("ok", data, decoded | None). Runs in a pool process: each tensor goes
    back as its raw bytes, dtype name and shape (plain data: nothing of the client's is unpickled)."""
    try:
        data = loads_body(body)
    except json.JSONDecodeError as exc:
        return "json_error", exc.msg, exc.pos
    except UnicodeDecodeError as exc:  # json.loads decodes bytes itself; bad UTF-8 is a JSON error
        return "json_error", f"invalid UTF-8 ({exc.reason})", exc.start
    decoded = decode_payloads(data, spec)
    if decoded is None:
        embeds = data.get("prompt_embeds") if isinstance(data, dict) else None
        if isinstance(embeds, str) or (isinstance(embeds, list) and embeds and all(isinstance(p, str)
                                                                                   for p in embeds)):
            # refused unread by the route: not worth sending back
            data["prompt_embeds"] = PLACEHOLDER if isinstance(embeds, str) else [PLACEHOLDER] * len(embeds)
        return "ok", data, None
    out = []
    for d in decoded:
        if d.tensor is None:
            out.append((None, None, None, d.error, d.seconds))
        else:
            raw = d.tensor.contiguous().view(torch.uint8).numpy().tobytes()
            dtype = str(d.tensor.dtype).removeprefix("torch.")
            out.append((raw, dtype, tuple(d.tensor.shape), None, d.seconds))
    return "ok", data, out


# ----------------------------------------------------------------------------- in the server

def spawn_ingest_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of `workers` spawned processes (spawn: the server process holds CUDA state and threads
    that a fork would copy half-way). Nothing starts until work is submitted: see `warm_up`."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker)


def warm_up(pool: ProcessPoolExecutor, workers: int) -> list[Future]:
    """Start every worker of `pool` now (each imports torch: seconds); the futures resolve to their pids."""
    return [pool.submit(_warm) for _ in range(workers)]


def close_pool(pool: ProcessPoolExecutor) -> None:
    """Shut `pool` down without waiting, and end its workers. A worker still starting (importing torch)
    when the server stops never read its stop sentinel: the process's exit then waited on it forever
    (seen with a SIGTERM just after start-up). The workers hold nothing worth finishing.

    The pool's manager thread is then joined: it closes the pool's wake-up pipe on its way out, and
    Python 3.11's exit hook writes to that pipe without the pool's lock, so an exit racing the manager
    thread died with EBADF (exit status 1 for a clean stop)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    if manager is not None:
        manager.join(timeout=_MANAGER_JOIN_SECONDS)


_MANAGER_JOIN_SECONDS = 10.0  # the workers are terminated: the manager thread ends in milliseconds


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def _rebuild(raw: bytes | None, dtype: str | None, shape: tuple | None, error: str | None,
             seconds: float) -> DecodedEmbeds:
    if error is not None or raw is None:
        return DecodedEmbeds(None, error or "prompt_embeds could not be decoded", seconds)
    tensor = torch.frombuffer(bytearray(raw), dtype=_DTYPES[dtype]).view(shape)
    return DecodedEmbeds(tensor, None, seconds)


class BodyParser:
    """`await parse(body)`: the JSON value (json.JSONDecodeError like `json.loads`) and pre-decoded
    prompt embeds, from a pool of `workers` spawned processes for bodies over `inline_bytes`."""

    def __init__(self, spec: EmbedsSpec, *, workers: int, inline_bytes: int = DEFAULT_INLINE_BYTES,
                 metrics: ServeMetrics | None = None, pool: ProcessPoolExecutor | None = None) -> None:
        """`pool`: a `spawn_ingest_pool(workers)` already warmed up (an API process starts its pool
        while the engine builds); the parser owns it from here."""
        if workers < 0:
            raise ValueError(f"ingest workers must be >= 0, got {workers}")
        self.spec = spec
        self.metrics = metrics
        self.workers = workers
        self.inline_bytes = inline_bytes
        self._pool: ProcessPoolExecutor | None = pool

    def _new_pool(self) -> ProcessPoolExecutor:
        return spawn_ingest_pool(self.workers)

    async def start(self) -> None:
        """Start every worker now (each imports torch: seconds), not on the first large request."""
        if self.workers and self._pool is None:
            self._pool = self._new_pool()
            pids = await asyncio.gather(*map(asyncio.wrap_future, warm_up(self._pool, self.workers)))
            logger.info("ingest pool: %d worker processes (%s)", len(set(pids)), sorted(set(pids)))

    def close(self) -> None:
        if self._pool is not None:
            close_pool(self._pool)
            self._pool = None

    def _count(self, where: str) -> None:
        if self.metrics is not None:
            self.metrics.bodies_parsed.labels(where).inc()

    async def parse(self, body: bytes) -> ParsedBody:
        if self._pool is None or len(body) <= self.inline_bytes:
            self._count("inline")
            data = loads_body(body)
            # decoded here, while each payload still carries the bytes its base64 check decoded
            # (`json_body.py`): the request's validated model holds plain copies of the strings
            return ParsedBody(data, decode_payloads(data, self.spec))
        self._count("pool")
        loop = asyncio.get_running_loop()
        try:
            kind, data, decoded = await loop.run_in_executor(self._pool, parse_in_worker, body, self.spec)
        except BrokenProcessPool:
            # a worker died (killed for memory?): answer this request from here, replace the pool
            logger.error("an ingest worker died; restarting the pool and parsing this body in-process")
            self.close()
            self._pool = self._new_pool()
            data = loads_body(body)
            return ParsedBody(data, decode_payloads(data, self.spec))
        if kind == "json_error":
            raise json.JSONDecodeError(data, "", decoded)
        return ParsedBody(data, None if decoded is None else [_rebuild(*d) for d in decoded])


class IngestRequest(Request):
    """A Starlette request whose `json()` (what FastAPI calls to read a JSON body) goes through the
    app's `BodyParser`; the pre-decoded prompt embeds land in `request.state.prompt_embeds`."""

    async def body(self) -> bytes:
        """Starlette's `body()` without its copy: the guards middleware hands the body on as one chunk,
        and Starlette joins it with the stream's closing empty chunk (1.4 MB copied per W1 request)."""
        if not hasattr(self, "_body"):
            async with contextlib.aclosing(self.stream()) as stream:
                chunks = [chunk async for chunk in stream if chunk]
            self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            parsed = await self.app.state.body_parser.parse(await self.body())
            self._json = parsed.data
            self.state.prompt_embeds = parsed.embeds
        return self._json


class IngestRoute(APIRoute):
    """The route class of the app: hands FastAPI an `IngestRequest` (FastAPI's documented way to
    customise body reading), so the routes keep their pydantic bodies and `/openapi.json` its schema."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(IngestRequest(request.scope, request.receive))

        return route
