"""The app an API process answers with from its first moment: 503 while the engine starts, then the routes.

Why: the engine takes tens of seconds to build and warm up on a GPU; an API process that only started
listening once it was ready left clients and load balancers polling `/health` with connections that
hung in the listen backlog (or were refused), and it still had its own start-up ahead: its imports,
the tokenizer, the routes. Here uvicorn runs from the start: `/health` answers 503 and every other
request a 503 with Retry-After, while `bring_up` (a coroutine the caller gives) waits for the engine
and builds the routes' state; the moment that is done the real app (`build_app`) takes every request,
and `/health` answers 200.

Once the engine is ready (`engine_ready()` says so, before this process has built its routes), a
request is held until the routes take over rather than refused: with several API processes, one of them
may answer 200 while another is still building its state, and a client that saw the 200 must not get a
503 from the other.

The real app's lifespan (it starts the body parser and the engine loop) runs when it takes over, and
its shutdown with the server's. A SIGTERM while the engine is still starting ends the server at once:
`bring_up` is cancelled and `on_stop_early` (for instance: kill an engine process still building) runs.
If `bring_up` fails, or returns None (nothing to serve: the engine failed elsewhere, or the server is
stopping), the server stops; `failure` then holds what it raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bridge.serve.guards import send_error

logger = logging.getLogger("bridge.serve")

RETRY_AFTER_S = "1"
STARTING_MESSAGE = "the server is starting: its engine is not ready yet (GET /health answers 200 once it is)"


class StartingApp:
    """ASGI app: 503s until `bring_up()`'s state is served by `build(state)`'s app (see the module doc)."""

    def __init__(self, bring_up: Callable[[], Awaitable[Any]], build: Callable[[Any], Any], *,
                 on_stop_early: Callable[[], None] | None = None,
                 engine_ready: Callable[[], bool] = lambda: False) -> None:
        self.bring_up = bring_up
        self.build = build
        self.on_stop_early = on_stop_early
        self.engine_ready = engine_ready
        self.server: Any = None  # the uvicorn server running this app: stopped when bring-up fails
        self.app: Any = None
        self.state: Any = None
        self.failure: BaseException | None = None
        self._task: asyncio.Task | None = None
        self._lifespan: _Lifespan | None = None
        self._settled: asyncio.Event | None = None  # set once the routes took over, or bring-up ended

    @property
    def ready(self) -> bool:
        return self.app is not None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._run_lifespan(receive, send)
            return
        app = self.app
        if app is None and self._settled is not None and self.engine_ready():
            await self._settled.wait()  # the routes are being built: this request is theirs
            app = self.app
        if app is not None:
            await app(scope, receive, send)
        elif scope["type"] == "http":
            if scope.get("path") == "/health":
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-length", b"0"), (b"retry-after", RETRY_AFTER_S.encode())]})
                await send({"type": "http.response.body", "body": b""})
            else:
                await send_error(send, 503, STARTING_MESSAGE, "ServiceUnavailableError",
                                 [(b"retry-after", RETRY_AFTER_S.encode())])

    async def drain(self) -> None:
        """The server's graceful-shutdown hook: the real app's drain, once there is one."""
        if self.state is not None:
            await self.state.drain()

    async def _run_lifespan(self, receive: Callable, send: Callable) -> None:
        await receive()  # lifespan.startup
        self._settled = asyncio.Event()
        self._task = asyncio.create_task(self._start(), name="bridge-bring-up")
        await send({"type": "lifespan.startup.complete"})
        logger.info("listening: /health answers 503 until the engine is ready")
        await receive()  # lifespan.shutdown
        try:
            await self._stop()
        finally:
            await send({"type": "lifespan.shutdown.complete"})

    async def _start(self) -> None:
        try:
            await self._bring_up()
        finally:
            assert self._settled is not None
            self._settled.set()

    async def _bring_up(self) -> None:
        try:
            state = await self.bring_up()
            if state is None:
                self._exit()
                return
            app = await asyncio.to_thread(self.build, state)
            lifespan = _Lifespan(app)
            self.state = state  # from here the server's drain reaches it
            await lifespan.startup()
            self._lifespan = lifespan
            self.app = app
            logger.info("ready: /health answers 200")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported by the caller after the server stops
            self.failure = exc
            self._exit()

    async def _stop(self) -> None:
        task = self._task
        if task is not None and not task.done():
            if self.on_stop_early is not None:
                self.on_stop_early()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._lifespan is not None:
            await self._lifespan.shutdown()

    def _exit(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class _Lifespan:
    """Drives an ASGI app's lifespan protocol (what uvicorn does for the app it was given)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.create_task(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        reply = await self._reply()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {reply.get('message', reply['type'])}")

    async def shutdown(self) -> None:
        await self._to_app.put({"type": "lifespan.shutdown"})
        reply = await self._reply()
        assert self._task is not None
        with contextlib.suppress(Exception):
            await self._task
        if reply["type"] != "lifespan.shutdown.complete":
            logger.error("the app's shutdown failed: %s", reply.get("message", reply["type"]))

    async def _reply(self) -> dict:
        """The app's next lifespan message; its exception if it raised instead."""
        assert self._task is not None
        getting = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({getting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            return getting.result()
        getting.cancel()
        self._task.result()  # raises what the app raised
        return {"type": "lifespan.failed", "message": "the app's lifespan ended without an answer"}


async def receive_when_ready(conn: Any) -> Any:
    """The one message a `multiprocessing` connection will carry, awaited without a thread (a thread
    blocked in `recv` would keep the process from exiting when the server stops first); None if the
    other end closed without sending."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    try:
        return conn.recv()
    except EOFError:
        return None


__all__ = ["STARTING_MESSAGE", "StartingApp", "receive_when_ready"]
