"""ASGI middleware in front of every route: API key, body size, and request counting.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched. The body is read here up to `max_body_bytes` (a `Content-Length` over it is
refused before a byte is read) and replayed to the app; after the body, `receive` is the client's
again, so handlers still see `http.disconnect`.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bridge.serve.arrivals import Arrivals
from bridge.serve.metrics import ServeMetrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version", "/metrics",
                "/openapi.json", "/docs")


ARRIVED = "bridge.arrived"
BODY_RECEIVED = "bridge.body_received"
"""Scope keys: `time.perf_counter()` when the request started and when its body was in."""

DRAIN_LIMIT_BYTES = 64 * 2**20
"""After a 413, read (and drop) up to this much of the body, so that the client, which is still
sending, reads the answer instead of a connection reset; beyond it the connection is dropped."""


async def _drain(receive: Receive, limit: int) -> None:
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


async def send_error(send: Send, status: int, message: str, kind: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Guards:
    """Counts every response by route and status; checks the API key on /v1/*; caps the body."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 metrics: ServeMetrics, arrivals: Arrivals | None = None) -> None:
        self.app = app
        self.arrivals = arrivals or Arrivals()
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVED] = time.perf_counter()
        path = scope.get("path", "")
        route = path if path in KNOWN_ROUTES else "other"
        status_seen: list[int] = []

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, counting_send, path)
        finally:
            if status_seen:
                self.metrics.http_requests.labels(route, str(status_seen[0])).inc()

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        if self.api_key is not None and path.startswith("/v1/") and not self._authorized(scope):
            await send_error(send, 401, "missing or wrong API key (send Authorization: Bearer KEY)",
                             "AuthenticationError", [(b"www-authenticate", b"Bearer")])
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await send_error(send, 400, "invalid Content-Length", "BadRequestError")
                return
            if declared > self.max_body_bytes:
                await send_error(send, 413, f"request body of {declared} bytes is over the limit of "
                                 f"{self.max_body_bytes} bytes", "RequestTooLarge")
                await _drain(receive, DRAIN_LIMIT_BYTES)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        with self.arrivals.arriving():
            await self._with_body(scope, receive, send)

    async def _with_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_error(send, 413, f"request body is over the limit of {self.max_body_bytes} bytes",
                                 "RequestTooLarge")
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_LIMIT_BYTES)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        scope[BODY_RECEIVED] = time.perf_counter()
        self.metrics.body_seconds.observe(scope[BODY_RECEIVED] - scope[ARRIVED])
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False
