"""Requests on their way to the engine: received or being parsed, not yet submitted.

Why the engine loop wants to know: a greedy decode window runs up to 32 steps with no look at new
work, so a request whose body finishes parsing just after a window started waits for the whole window
(about 70 ms for the W1 model) before its prefill; in a burst of arrivals most requests met one. While
`Arrivals.count` is above zero the loop runs short windows instead, and full ones once the burst is in.

Each POST gets a ticket in the guards middleware (before its body is read); the handler's
`EngineLoop.submit` punches it, and the middleware punches it when the request ends in any other way
(a 400, a disconnect), so the count never leaks. The ticket travels in a context variable: the
handler runs in the middleware's task, or in a task that copied its context.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_TICKET: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("bridge_arrival", default=None)


class _Ticket:
    __slots__ = ("arrivals", "open", "started")

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.open = True
        self.started = time.monotonic()  # when the request arrived (before its body was read)

    def punch(self) -> None:
        if self.open:
            self.open = False
            self.arrivals.count -= 1
            self.arrivals.changed()


class Arrivals:
    """The number of requests between arrival and submission (read by the engine loop's thread)."""

    def __init__(self) -> None:
        self.count = 0
        self.listeners: list[Callable[[], None]] = []  # called on the event loop after each change

    def changed(self) -> None:
        for listener in self.listeners:
            listener()

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Around one request in the middleware: counted from here until submitted or ended."""
        ticket = _Ticket(self)
        self.count += 1
        self.changed()
        token = _TICKET.set(ticket)
        try:
            yield
        finally:
            ticket.punch()
            _TICKET.reset(token)


def arrived_at() -> float:
    """`time.monotonic()` when the current request arrived (0.0 outside a counted request): the
    tick trace shows how long a request took from arrival to the engine."""
    ticket = _TICKET.get()
    return ticket.started if ticket is not None else 0.0


def submitted() -> None:
    """The current request reached the engine's queue (no-op outside a counted request)."""
    ticket = _TICKET.get()
    if ticket is not None:
        ticket.punch()
