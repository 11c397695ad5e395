"""What can go wrong when generation runs behind a server, as exception types a caller can sort.

Bounded messages: a server's error text is quoted, but cut to `MAX_MESSAGE_CHARS` so a hostile or
broken server cannot make our exceptions (and logs) arbitrarily large.
"""

from __future__ import annotations

from bridge.messages import bounded

MAX_MESSAGE_CHARS = 300


class RemoteError(RuntimeError):
    """A request to the generation server failed (after `attempts` tries when it was retryable)."""

    def __init__(self, message: str, *, attempts: int = 1, status: int | None = None):
        super().__init__(message)
        self.attempts = attempts
        self.status = status


class RemoteHTTPError(RemoteError):
    """The server answered with an error status; `server_message` is what it said (bounded).
    A 4xx is never retried: sending the same request again would get the same answer."""

    def __init__(self, status: int, server_message: str, *, attempts: int = 1):
        self.server_message = bounded(server_message, MAX_MESSAGE_CHARS)
        super().__init__(f"HTTP {status}: {self.server_message}", attempts=attempts, status=status)


class RemoteModelMismatch(ValueError):
    """The server does not run this Bridge's base LLM (name or hidden size differ). Raised before
    any of the caller's embeddings is sent."""
