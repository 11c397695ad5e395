"""uvicorn as `bridge serve` runs it: its config from the flags, signals that drain, then exit 0.

Shutdown order: on SIGTERM uvicorn stops accepting and waits for open connections, then runs the
app's lifespan shutdown. The app's `drain` (the engine front's: running requests get
`--shutdown-timeout` s, then each left is ended with an error event and `[DONE]`) starts with the
shutdown, not after uvicorn's wait, and uvicorn's own graceful timeout is set past it, so it never
cuts a stream before the stream's last event is written.

HTTP/1.0: uvicorn's httptools protocol answers a streaming response to an HTTP/1.0 request with
`Transfer-Encoding: chunked`, which RFC 9112 forbids (a 1.0 client cannot read it); its h11 protocol
closes the connection to end the body instead, as the RFC says. Each connection's request line is
read first, and a 1.0 connection is handed to h11, every other to httptools (uvicorn's own HTTP/2
dispatcher sniffs a connection's first bytes the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
from collections.abc import Awaitable, Callable

SHUTDOWN_GRACE_S = 5.0
"""What uvicorn's graceful timeout adds to `--shutdown-timeout`: time for the drained streams to write
their last events and close."""

MAX_REQUEST_LINE_BYTES = 8192
"""Bytes read while looking for the first request line's end; a longer line goes to httptools, which
refuses it."""


def graceful_server(config, drain: Callable[[], Awaitable[None]] | None = None):
    """A uvicorn server whose SIGTERM/SIGINT only start the graceful shutdown (uvicorn re-raises the
    signal after its shutdown, so the process would die of it); the process then exits 0. `drain`
    runs from the start of the shutdown, beside uvicorn's wait for open connections."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None) -> None:
            draining = asyncio.ensure_future(drain()) if drain is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if draining is not None:
                    if not draining.done():
                        draining.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await draining

    return GracefulServer(config)


def uvicorn_config(app, args: argparse.Namespace):
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=http_protocol(),
                          timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S,
                          limit_concurrency=None, access_log=False)


@functools.cache
def http_protocol():
    """The protocol class for `uvicorn.Config(http=...)`: httptools for HTTP/1.1 and h11 for HTTP/1.0
    connections; plain "h11" where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class VersionDispatch(asyncio.Protocol):
        """Reads a connection's request line, then hands the connection (and what it read) to the
        protocol for its HTTP version. Until then it is one of the server's connections, closed at
        shutdown or after the keep-alive timeout."""

        def __init__(self, config, server_state, app_state, _loop=None) -> None:
            self.config, self.server_state, self.app_state = config, server_state, app_state
            self.loop = _loop or asyncio.get_event_loop()
            self.transport = None
            self.timeout = None
            self.buffer = b""

        def connection_made(self, transport) -> None:
            self.transport = transport
            self.server_state.connections.add(self)
            self.timeout = self.loop.call_later(self.config.timeout_keep_alive, transport.close)

        def connection_lost(self, exc) -> None:
            self._forget()

        def eof_received(self) -> None:
            pass

        def shutdown(self) -> None:
            self.transport.close()

        def _forget(self) -> None:
            self.server_state.connections.discard(self)
            if self.timeout is not None:
                self.timeout.cancel()
                self.timeout = None

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            end = self.buffer.find(b"\n")
            if end < 0 and len(self.buffer) < MAX_REQUEST_LINE_BYTES:
                return
            line = self.buffer[: end if end >= 0 else len(self.buffer)].rstrip(b"\r")
            self._forget()
            cls = H11Protocol if line.endswith(b" HTTP/1.0") else HttpToolsProtocol
            protocol = cls(config=self.config, server_state=self.server_state, app_state=self.app_state,
                           _loop=self.loop)
            self.transport.set_protocol(protocol)
            protocol.connection_made(self.transport)
            protocol.data_received(self.buffer)

    return VersionDispatch
