"""The compiled replication reader (``cdcd.source._libpq``) against psycopg2's, on a real walsender.

``ReplicationStream.read_batch`` reads through the compiled module where it is
built, and through psycopg2's ``read_message`` otherwise. Both must hand the
session the same payloads in the same order, the same WAL positions, and the
same errors (psycopg2 classes by SQLSTATE, sorted into transient and
definite). The compiled reader does not answer a keepalive's reply request
itself (psycopg2 does, with write = apply = 0): it reports it, once, so that
the session answers with its own positions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from support.pg import PgDatabase, create_slot, current_wal_lsn

from cdcd.errors import TransientError
from cdcd.protocol.lsn import Lsn
from cdcd.source import replication
from cdcd.source.libpq import native_module
from cdcd.source.replication import ReplicationStream

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0


def _compiled_available() -> bool:
    return native_module() is not None


needs_compiled = pytest.mark.skipif(
    not _compiled_available(), reason="cdcd.source._libpq is not built (or CDCD_PURE_PYTHON=1)"
)


def _stream(dsn: str, slot: str, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> ReplicationStream:
    with monkeypatch.context() as patch:
        if not compiled:
            patch.setattr(replication, "native_module", lambda: None)
        stream = ReplicationStream(dsn, slot, "pub", 2, timeout_s=10)
    return stream


def _read_until(stream: ReplicationStream, end: int, limit: int) -> Iterator[list[bytes]]:
    """Batches until the server's sent position reaches ``end`` and the socket is drained."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        batch = stream.read_batch(limit)
        assert len(batch) <= limit
        yield batch
        if len(batch) < limit:
            if stream.wal_end >= end:
                return
            assert time.monotonic() < deadline, f"wal_end {stream.wal_end} never reached {Lsn(end)}"
            stream.wait(0.2)


def _read_until_lost(stream: ReplicationStream, never: str) -> None:
    """Read until the stream raises the transient "connection lost" (``never``: the deadline passed)."""
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(TransientError, match="replication connection lost"):
        while True:
            assert time.monotonic() < deadline, never
            stream.read_batch(16)
            stream.wait(0.1)


@pytest.fixture
def two_slots(pg: PgDatabase) -> tuple[str, int]:
    """Two slots at the same point, then a varied load; returns (dsn, end of the load)."""
    pg.execute("CREATE TABLE t(id int PRIMARY KEY, note text, big text)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    conn = pg.connect()
    create_slot(conn, "a")
    create_slot(conn, "b")
    pg.execute("INSERT INTO t SELECT g, 'n' || g, NULL FROM generate_series(1, 3000) g")
    pg.execute("UPDATE t SET note = 'u' || id WHERE id % 7 = 0")
    pg.execute("DELETE FROM t WHERE id % 11 = 0")
    pg.execute("INSERT INTO t VALUES (100000, 'wide', repeat('x', 300000))")  # a large payload
    pg.execute("SELECT pg_logical_emit_message(true, 'p', 'hello')")
    for i in range(50):  # many small transactions: many messages per socket read
        pg.execute("INSERT INTO t VALUES (%s, 'small', NULL)", (200000 + i,))
    return pg.dsn, current_wal_lsn(conn)


@needs_compiled
@pytest.mark.parametrize("limit", [1, 7, 256])
def test_compiled_and_psycopg2_readers_return_the_same_stream(
    two_slots: tuple[str, int], limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, end = two_slots
    results = {}
    for slot, compiled in (("a", True), ("b", False)):
        stream = _stream(dsn, slot, compiled, monkeypatch)
        try:
            assert (stream._native is not None) is compiled  # the path under test runs
            stream.start(Lsn(0))
            payloads: list[bytes] = []
            last_starts = []
            for batch in _read_until(stream, end, limit):
                payloads += batch
                if batch:
                    last_starts.append(int(stream.data_start))
            results[compiled] = (payloads, last_starts)
        finally:
            stream.close()
    compiled_payloads, compiled_starts = results[True]
    pure_payloads, pure_starts = results[False]
    assert len(compiled_payloads) > 3000
    assert compiled_payloads == pure_payloads
    # The same last WAL start (batches may be cut differently, the end is the same).
    assert compiled_starts[-1] == pure_starts[-1]
    assert compiled_starts == sorted(compiled_starts)


@needs_compiled
def test_a_reply_request_is_reported_once_and_left_to_the_session(
    pg: PgDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walsender asks for a reply after half of wal_sender_timeout without one.

    The compiled reader reports the request and sends nothing: with no answer
    from the session either, the walsender ends the connection at its
    timeout, and the next read raises a transient error (reconnect).
    """
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    # For this test's database only: its walsenders ask after 1 s and give up after 2.
    pg.execute(f"ALTER DATABASE {pg.dbname} SET wal_sender_timeout = '2s'")
    create_slot(pg.connect(), "a")
    stream = _stream(pg.dsn, "a", True, monkeypatch)
    try:
        stream.start(Lsn(0))
        deadline = time.monotonic() + DEADLINE_S
        while not stream.reply_due():
            assert time.monotonic() < deadline, "no keepalive asked for a reply"
            stream.read_batch(16)
            stream.wait(0.1)
        assert not stream.reply_due()  # reported once
        _read_until_lost(stream, "the walsender kept an unanswered connection")
    finally:
        stream.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "psycopg2"])
def test_a_terminated_walsender_is_a_transient_error(
    pg: PgDatabase, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled and not _compiled_available():
        pytest.skip("cdcd.source._libpq is not built (or CDCD_PURE_PYTHON=1)")
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(pg.connect(), "a")
    stream = _stream(pg.dsn, "a", compiled, monkeypatch)
    try:
        stream.start(Lsn(0))
        pg.execute("INSERT INTO t VALUES (1)")
        end = current_wal_lsn(pg.connect())
        assert any(_read_until(stream, end, 256))
        pg.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'a'")
        _read_until_lost(stream, "the terminated walsender was never noticed")
    finally:
        stream.close()
