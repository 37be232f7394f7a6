"""The replication socket's receive buffer: small to a server on this host, the kernel's otherwise.

Over loopback the walsender's CPU runs the receive path of every segment it
sends, and it sends one per change whenever cdcd's window is open; a small
buffer closes the window while the session pauses, so the walsender's sends
queue and travel together (``cdcd.source.replication``). Over a network the
window must cover the round trip, so only TCP to a loopback address is
limited: not a Unix-domain socket, not TCP to another address.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from support.pg import PgDatabase, create_slot

from cdcd.source.replication import (
    LOCAL_FILL_WAIT_S,
    LOCAL_RECEIVE_BUFFER_BYTES,
    REMOTE_FILL_WAIT_S,
    ReplicationStream,
    limit_local_receive_buffer,
)


def _rcvbuf(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def _tcp_pair(host: str, family: socket.AddressFamily = socket.AF_INET) -> Iterator[socket.socket]:
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()[:2]) as client:
            accepted, _ = server.accept()
            with accepted:
                yield client


@pytest.mark.parametrize(
    ("host", "family"), [("127.0.0.1", socket.AF_INET), ("127.0.0.2", socket.AF_INET), ("::1", socket.AF_INET6)]
)
def test_tcp_to_a_loopback_address_gets_the_small_buffer(host: str, family: socket.AddressFamily) -> None:
    try:
        pair = _tcp_pair(host, family)
        client = next(pair)
    except OSError as exc:  # no IPv6 on this host
        pytest.skip(f"cannot listen on {host}: {exc}")
    before = _rcvbuf(client)
    assert limit_local_receive_buffer(client.fileno())
    # Linux reports twice what was set (its bookkeeping overhead).
    assert _rcvbuf(client) == 2 * LOCAL_RECEIVE_BUFFER_BYTES < before
    client.sendall(b"still open")  # the duplicate it worked on was closed, not the socket
    pair.close()


def _outbound_address() -> str | None:
    """This host's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only routes are looked up
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_tcp_to_another_address_keeps_the_kernels_buffer() -> None:
    address = _outbound_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    pair = _tcp_pair(address)  # to this host's own address: the traffic never leaves it
    client = next(pair)
    before = _rcvbuf(client)
    assert not limit_local_receive_buffer(client.fileno())
    assert _rcvbuf(client) == before
    pair.close()


def test_a_unix_socket_is_left_alone() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        before = _rcvbuf(left)
        assert not limit_local_receive_buffer(left.fileno())
        assert _rcvbuf(left) == before


@pytest.mark.integration
def test_a_replication_connection_to_this_host_pauses_for_the_small_buffer(pg: PgDatabase) -> None:
    pg.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    create_slot(pg.connect(), "s")
    stream = ReplicationStream(pg.dsn, "s", "pub", 1, timeout_s=10)
    try:
        assert "127.0.0.1" in pg.dsn  # the test cluster listens on loopback TCP only
        with socket.socket(fileno=stream._conn.fileno()) as sock:
            try:
                assert _rcvbuf(sock) == 2 * LOCAL_RECEIVE_BUFFER_BYTES
            finally:
                sock.detach()  # psycopg2's socket: not ours to close
        assert stream.fill_wait_s == LOCAL_FILL_WAIT_S > REMOTE_FILL_WAIT_S
    finally:
        stream.close()


def test_a_socket_already_disconnected_is_left_alone() -> None:
    """The server went away between connecting and this: the stream's first read reports it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as unconnected:
        assert not limit_local_receive_buffer(unconnected.fileno())
