"""When to try a request again, and how long to wait first.

A completion with prompt embeddings is idempotent (nothing on the server changes), so anything that
may be transient is retried: a refused or dropped connection, a timeout, a 5xx, 408 and 429. A
4xx otherwise means the request itself is wrong and is raised at once. Waits grow exponentially
with "equal jitter" (half fixed, half random) so that many clients retrying together spread out;
a server's `Retry-After` (seconds) is honoured up to the cap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx

RETRYABLE_STATUS = frozenset({408, 429})


def is_retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUS


def is_retryable_exception(exc: BaseException) -> bool:
    """Transport failures: refused/reset connections, timeouts, a server that hung up mid-response."""
    return isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.UnsupportedProtocol)


def describe_transport_error(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__}, timeout {timeout:g} s)"
    if isinstance(exc, httpx.ConnectError):
        return f"could not connect ({exc or 'connection refused'})"
    return f"{type(exc).__name__}: {exc or 'the connection failed'}"


@dataclass(frozen=True)
class Backoff:
    """Delay before retry number `attempt` (0-based): `base * 2**attempt`, capped, with jitter."""

    base: float = 0.5
    cap: float = 8.0

    def delay(
        self, attempt: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        if retry_after is not None and retry_after >= 0:
            return min(self.cap, retry_after)
        full = min(self.cap, self.base * (2**attempt))
        return full / 2 + (rng or random).uniform(0, full / 2)


def retry_after_seconds(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff
