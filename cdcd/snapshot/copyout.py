"""Reading ``COPY … TO STDOUT`` text on a psycopg2 connection, in batches of whole rows.

psycopg2's ``copy_expert`` takes the GIL back for every row it reads, to call
the target's ``write()``. A snapshot reads COPY on reader threads while the
session thread holds the GIL encoding and producing, so each of those
re-acquisitions waits: on the 1M-row ``orders`` table a COPY next to one
GIL-holding thread took 1.86 s instead of 0.68 s. The compiled
``cdcd.source._libpq`` runs the same libpq calls on psycopg2's own
connection and library with the GIL released for a whole batch of rows
(``_libpq.c`` says how). Where it is not built, or with
``CDCD_PURE_PYTHON=1``, ``copy_expert`` reads the rows and this module cuts
them into the same batches.

Either way :func:`copy_text` gives ``emit(data, rows)`` whole lines of COPY
text, ``batch_rows`` rows at a time (the last batch shorter), and raises the
psycopg2 error of a failed statement (``psycopg2.errors`` class by SQLSTATE,
so ``except psycopg2.errors.UndefinedColumn`` and cdcd's SQLSTATE
classification work the same on both paths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.extensions

from cdcd.source.libpq import native_module
from cdcd.source.sqlstate import psycopg2_error

#: ``emit(data, rows)``: whole lines of COPY text and how many.
Emit = Callable[[bytes, int], None]


def copy_text(cursor: Any, query: str, batch_rows: int, emit: Emit) -> int:
    """Run ``COPY (query) TO STDOUT`` on ``cursor``'s connection; batches to ``emit``; the row count."""
    sql = f"COPY ({query}) TO STDOUT"
    connection = cursor.connection
    native = native_module()
    # psycopg2 opens a transaction with the first statement it runs itself:
    # a connection that has none open yet reads through psycopg2.
    idle = (
        connection.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        and not connection.autocommit
    )
    if native is None or idle:
        return _copy_expert(cursor, sql, batch_rows, emit)
    result = native.copy_out(connection.pgconn_ptr, sql, batch_rows, emit)
    if isinstance(result, tuple):
        _, sqlstate, message = result
        raise psycopg2_error(sqlstate, message)
    rows: int = result
    return rows


def _copy_expert(cursor: Any, sql: str, batch_rows: int, emit: Emit) -> int:
    stream = _Batches(batch_rows, emit)
    cursor.copy_expert(sql, stream)
    stream.close()
    return stream.rows


class _Batches:
    """A file-like ``copy_expert`` target: psycopg2 writes one row per call."""

    def __init__(self, batch_rows: int, emit: Emit) -> None:
        self._batch_rows = batch_rows
        self._emit = emit
        self._parts: list[bytes] = []
        self.rows = 0

    def write(self, data: bytes | memoryview) -> int:
        self._parts.append(bytes(data))
        if len(self._parts) >= self._batch_rows:
            self._flush()
        return len(data)

    def _flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts = []
            rows = data.count(b"\n")  # one per write, in fact; counted all the same
            self.rows += rows
            self._emit(data, rows)

    def close(self) -> None:
        self._flush()
