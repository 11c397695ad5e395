"""The API processes' listening sockets: a burst of connections spreads over all of them, and a port
that anything already holds (a second server's group included) is refused before a process starts."""

from __future__ import annotations

import socket

import pytest

from bridge.serve.listen_sockets import listening_sockets, reuse_port_balances

balancing = pytest.mark.skipif(not reuse_port_balances(), reason="SO_REUSEPORT balances only on Linux")


def _accept_all(sock: socket.socket) -> int:
    sock.setblocking(False)
    taken = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return taken
        conn.close()
        taken += 1


@balancing
def test_a_burst_of_connections_reaches_every_process_socket():
    socks = listening_sockets("127.0.0.1", 0, 4)
    clients = []
    try:
        assert len({s.fileno() for s in socks}) == 4
        port = socks[0].getsockname()[1]
        assert all(s.getsockname()[1] == port for s in socks)
        for _ in range(64):  # a burst, as 64 clients connecting at once
            clients.append(socket.create_connection(("127.0.0.1", port)))
        counts = [_accept_all(s) for s in socks]
    finally:
        for c in clients:
            c.close()
        for s in socks:
            s.close()
    assert sum(counts) == 64
    # the kernel hashes each connection's addresses; a share of 0 (the shared socket's usual outcome
    # under a burst) has odds of 4 * (3/4)**64, about 1e-8
    assert min(counts) > 0, counts
    assert max(counts) < 40, counts


def test_one_process_gets_one_plain_socket():
    """No group for a single process: nothing else of this user can join its port."""
    (sock,) = listening_sockets("127.0.0.1", 0, 1)
    try:
        if hasattr(socket, "SO_REUSEPORT"):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        assert sock.get_inheritable()  # handed to a spawned API process
    finally:
        sock.close()


@balancing
def test_a_port_held_by_another_server_is_refused():
    first = listening_sockets("127.0.0.1", 0, 2)
    port = first[0].getsockname()[1]
    try:
        with pytest.raises(OSError):  # a second group on the same port would silently split the traffic
            listening_sockets("127.0.0.1", port, 2)
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", port, 1)
    finally:
        for s in first:
            s.close()
    again = listening_sockets("127.0.0.1", port, 2)  # free again once the first group closed
    for s in again:
        s.close()


def test_a_port_held_by_a_plain_socket_is_refused():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        for count in (1, 3):
            with pytest.raises(OSError):
                listening_sockets("127.0.0.1", holder.getsockname()[1], count)
    finally:
        holder.close()


def test_count_must_be_positive():
    with pytest.raises(ValueError, match="count"):
        listening_sockets("127.0.0.1", 0, 0)
