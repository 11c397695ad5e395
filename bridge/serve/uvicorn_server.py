"""uvicorn as `bridge serve` runs it: its config from the flags, and signals that drain, then exit 0."""

from __future__ import annotations

import argparse
import contextlib
import signal


def graceful_server(config):
    """A uvicorn server whose SIGTERM/SIGINT only start the graceful shutdown (uvicorn re-raises the
    signal after its shutdown, so the process would die of it); the process then exits 0."""
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

    return GracefulServer(config)


def uvicorn_config(app, args: argparse.Namespace):
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
                          limit_concurrency=None, access_log=False)
