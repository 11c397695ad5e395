"""What can go wrong when generation runs behind a server, as exception types a caller can sort.

Bounded messages: a server's error text is quoted, but cut to `MAX_MESSAGE_CHARS` so a hostile or
broken server cannot make our exceptions (and logs) arbitrarily large.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MAX_MESSAGE_CHARS = 300


def bounded(text: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more chars)"


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
        self.server_message = bounded(server_message)
        super().__init__(f"HTTP {status}: {self.server_message}", attempts=attempts, status=status)


class RemoteModelMismatch(ValueError):
    """The server does not run this Bridge's base LLM (name or hidden size differ). Raised before
    any of the caller's embeddings is sent."""


class BatchGenerationError(RuntimeError):
    """Some prompts of a batch failed. `failed` maps prompt index -> its exception; `outputs` holds
    every prompt's `RequestOutput` in input order, `None` where it failed, so finished work is kept."""

    def __init__(self, failed: Mapping[int, BaseException], outputs: Sequence[Any]):
        self.failed = dict(sorted(failed.items()))
        self.outputs = list(outputs)
        shown = list(self.failed.items())[:3]
        detail = "; ".join(f"prompt {i}: {type(e).__name__}: {bounded(e, 200)}" for i, e in shown)
        more = f"; and {len(self.failed) - len(shown)} more" if len(self.failed) > len(shown) else ""
        done = len(self.outputs) - len(self.failed)
        super().__init__(
            f"{len(self.failed)} of {len(self.outputs)} prompts failed ({done} completed, kept in "
            f".outputs): {detail}{more}"
        )
