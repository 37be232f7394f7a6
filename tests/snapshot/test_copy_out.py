"""COPY read without the GIL (``cdcd.source._libpq``) gives psycopg2's bytes, batches and errors.

Snapshots read COPY text through :func:`cdcd.snapshot.copyout.copy_text`,
which runs libpq itself on psycopg2's connection where the compiled module is
built. Held to ``cursor.copy_expert`` on the same rows: every character COPY
escapes, NULLs, empty strings, a TOASTed value, no rows at all; batches of
whole lines in any size; the psycopg2 error class of a failed statement, and
a connection that takes the next statement afterwards (after a failed COPY
and after an ``emit`` that raised mid-COPY).
"""

from __future__ import annotations

import io
from typing import Any

import psycopg2
import psycopg2.errors
import pytest
from support.native import status_when_pure

from cdcd.protocol.native import native_status
from cdcd.snapshot import copyout
from cdcd.snapshot.copyout import copy_text
from cdcd.source.libpq import NATIVE_MODULE, native_module

pytestmark = pytest.mark.integration
compiled = pytest.mark.skipif(
    native_module() is None, reason=f"compiled COPY reader not in use: {native_status()}"
)

QUERY = "SELECT * FROM tricky ORDER BY id"


@pytest.fixture
def tricky(pg: Any) -> Any:
    pg.execute("CREATE TABLE tricky(id int PRIMARY KEY, t text, n numeric, b bytea, j jsonb)")
    pg.execute(
        "INSERT INTO tricky SELECT g, "
        "CASE g % 6 WHEN 0 THEN NULL WHEN 1 THEN '' WHEN 2 THEN E'tab\\there\\nnew\\\\back\\rcr' "
        "WHEN 3 THEN 'ünïcødé ✓ 𝄞' WHEN 4 THEN '\\N' ELSE repeat(md5(g::text), 4000) END, "
        "g / 7.0, decode(md5(g::text), 'hex'), jsonb_build_object('g', g, 'q', E'a\"b\\\\c') "
        "FROM generate_series(1, 500) g"
    )
    return pg


def _connect(pg: Any) -> Any:
    """A connection in transaction mode, as the snapshot's are."""
    conn = pg.connect()
    conn.autocommit = False
    return conn


def _reference(conn: Any, query: str) -> bytes:
    buffer = io.BytesIO()
    conn.cursor().copy_expert(f"COPY ({query}) TO STDOUT", buffer)
    return buffer.getvalue()


def _batches(conn: Any, query: str, batch_rows: int) -> tuple[list[tuple[bytes, int]], int]:
    got: list[tuple[bytes, int]] = []
    rows = copy_text(conn.cursor(), query, batch_rows, lambda data, n: got.append((data, n)))
    return got, rows


@compiled
@pytest.mark.parametrize("batch_rows", [1, 7, 499, 500, 1 << 62])
def test_the_same_bytes_as_copy_expert_in_batches_of_whole_lines(
    tricky: Any, batch_rows: int
) -> None:
    conn = _connect(tricky)
    try:
        conn.cursor().execute("SELECT 1")  # a transaction is open: the compiled path runs
        expected = _reference(conn, QUERY)
        got, rows = _batches(conn, QUERY, batch_rows)
        assert rows == 500
        assert b"".join(data for data, _ in got) == expected
        assert sum(n for _, n in got) == 500
        assert all(data.endswith(b"\n") and data.count(b"\n") == n for data, n in got)
        assert all(n == batch_rows for _, n in got[:-1]) and 0 < got[-1][1] <= batch_rows
        assert _batches(conn, "SELECT * FROM tricky WHERE false", batch_rows) == ([], 0)
    finally:
        conn.close()


def test_psycopg2s_path_batches_the_same(tricky: Any) -> None:
    conn = _connect(tricky)
    try:
        expected = _reference(conn, QUERY)
        got: list[tuple[bytes, int]] = []
        rows = copyout._copy_expert(
            conn.cursor(), f"COPY ({QUERY}) TO STDOUT", 7, lambda d, n: got.append((d, n))
        )
        assert rows == 500 and b"".join(d for d, _ in got) == expected
        assert [n for _, n in got] == [7] * 71 + [3]
    finally:
        conn.close()


@compiled
def test_a_failed_copy_raises_psycopg2s_class_and_the_connection_goes_on(tricky: Any) -> None:
    conn = _connect(tricky)
    try:
        cursor = conn.cursor()
        cursor.execute("SAVEPOINT before_copy")
        with pytest.raises(psycopg2.errors.UndefinedColumn, match="no_such_column"):
            copy_text(cursor, "SELECT no_such_column FROM tricky", 10, lambda d, n: None)
        cursor.execute("ROLLBACK TO SAVEPOINT before_copy")
        cursor.execute("SELECT count(*) FROM tricky")
        assert cursor.fetchone() == (500,)
        with pytest.raises(psycopg2.errors.DivisionByZero):
            copy_text(
                cursor, "SELECT 1 / (id - 250) FROM tricky ORDER BY id", 10, lambda d, n: None
            )
        conn.rollback()
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)
    finally:
        conn.close()


@compiled
def test_an_exception_from_emit_stops_the_copy_and_leaves_the_connection_usable(
    tricky: Any,
) -> None:
    conn = _connect(tricky)
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT 1")
        seen: list[int] = []

        def emit(data: bytes, rows: int) -> None:
            seen.append(rows)
            raise RuntimeError("the queue is closed")

        with pytest.raises(RuntimeError, match="the queue is closed"):
            copy_text(cursor, QUERY, 10, emit)
        assert seen == [10]
        conn.rollback()  # the cancelled COPY aborted the transaction, as a failed statement does
        assert _batches(conn, QUERY, 1 << 62)[1] == 500
    finally:
        conn.close()


def test_a_connection_without_a_transaction_opens_one_as_psycopg2_does(tricky: Any) -> None:
    conn = _connect(tricky)
    try:
        assert conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        assert _batches(conn, QUERY, 1 << 62)[1] == 500
        assert conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_INTRANS
    finally:
        conn.close()


def test_pure_python_reads_through_psycopg2() -> None:
    load = "from cdcd.source.libpq import native_module\nassert native_module() is None"
    assert "CDCD_PURE_PYTHON" in status_when_pure(load, NATIVE_MODULE)
