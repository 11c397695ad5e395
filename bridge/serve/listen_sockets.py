"""The listening sockets of N API processes: one each, balanced by the kernel, where the kernel can.

Why: N processes accepting from one shared socket do not share its connections. asyncio accepts up to
its backlog of pending connections whenever the socket turns readable, so the first process to wake
takes a burst whole or most of it, and that process then parses the burst alone while the others idle.
With `SO_REUSEPORT` (Linux) every process listens on its own socket bound to the same port and the
kernel spreads new connections over them by a hash of their addresses, which is how nginx and envoy
run several acceptors.

Where the option is missing (or does not balance: other systems give every connection to one of the
sockets), the processes share one socket as before. All sockets are bound and listening here, in the
parent, before any API process starts: a port already taken fails at once, and no connection waits on
a process that is still importing (it queues on that process's socket until it accepts).

A port is only joined when nothing listens on it: the port is first bound once without the option
(which fails while any socket, a second `bridge serve` included, holds it), then released and bound by
the group. Afterwards another process of the same user id (the kernel allows no other) could still
join the group and take a share of the connections.
"""

from __future__ import annotations

import socket
import sys

BACKLOG = 2048  # uvicorn's default


def reuse_port_balances() -> bool:
    """Whether this system spreads connections over sockets sharing a port (Linux's SO_REUSEPORT)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _bound(host: str, port: int, *, reuse_port: bool, listen: bool = True) -> socket.socket:
    # the address family as uvicorn picks it for the single-process server: IPv6 only for an IPv6 host
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on (host, port), one per API process; port 0 picks a free one for all.

    Distinct sockets in one SO_REUSEPORT group where that balances (see the module's docstring), else
    the same socket `count` times. Raises OSError (address in use, ...) with nothing left open."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if count == 1 or not reuse_port_balances():
        return [_bound(host, port, reuse_port=False)] * count
    probe = _bound(host, port, reuse_port=False, listen=False)  # EADDRINUSE if anything holds the port
    port = probe.getsockname()[1]
    probe.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(_bound(host, port, reuse_port=True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
