"""Standby status updates written by cdcd itself, through psycopg2's own libpq
(:mod:`cdcd.source.libpq`).

Why not ``ReplicationCursor.send_feedback``: when a keepalive arrives,
psycopg2 moves its remembered flush position to the keepalive's ``wal_end``
whenever the last XLogData's start LSN is not beyond the last flush LSN the
client sent (``explicitly_flushed_lsn >= last_msg_data_start``), and sends it
on the next interval or reply request. A long-running transaction's Begin and
changes carry start LSNs from *before* the last confirmed commit, so that
condition holds while later, already-received transactions are still waiting
for Kafka: psycopg2 would confirm them before they are delivered, and a crash
would lose them. cdcd therefore never calls ``send_feedback`` (psycopg2's
explicit flush stays 0, so it never forwards after the first data message),
disables psycopg2's status interval, and sends the ``r`` message itself with
``PQputCopyData`` on the same connection. If the walsender ever asks for a
reply that psycopg2 answers, psycopg2 sends flush 0 (ignored by the server)
or the ``wal_end`` of a keepalive seen before any data (nothing was pending).

What cdcd reports (docs/synchronous.md): write = the end of the WAL it has
received, flush = apply = the confirmed position. A synchronous standby is
judged by these: ``synchronous_commit = on`` and ``remote_apply`` wait for
flush/apply (Kafka acknowledged), ``remote_write`` for write (received).
A keepalive that asks for a reply gets one at once from the session
(``ReplicationStream.reply_due``). The compiled reader
(``cdcd.source._libpq``) sends nothing itself; where psycopg2 reads, its own
answer (write = apply = 0) comes first, and PostgreSQL never moves a
synchronous commit's wait backwards on a lower position.
"""

from __future__ import annotations

import ctypes
import select
import struct
import time
from typing import Any

from cdcd.errors import TransientError
from cdcd.protocol.messages import PG_EPOCH_OFFSET_US
from cdcd.source import libpq

_STATUS = struct.Struct("!cQQQqB")


def _put_copy_data() -> Any:
    return libpq.required("PQputCopyData", (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int), ctypes.c_int)


def _flush() -> Any:
    return libpq.required("PQflush", (ctypes.c_void_p,), ctypes.c_int)


def status_update(written: int, flushed: int, applied: int, reply: bool = False) -> bytes:
    """The Standby Status Update message body (``r``)."""
    now_us = time.time_ns() // 1000 - PG_EPOCH_OFFSET_US
    return _STATUS.pack(b"r", written, flushed, applied, now_us, 1 if reply else 0)


def send_status(
    connection: Any, written: int, flushed: int, reply: bool = False, timeout_s: float = 10.0
) -> None:
    """Send one status update: write = ``written``, flush = apply = ``flushed``.

    Logical slots take ``confirmed_flush_lsn`` from the flush field; apply
    carries the same value (cdcd applies nothing after Kafka), so
    ``remote_apply`` waits exactly as ``on`` does. ``written`` below
    ``flushed`` is raised to it: nothing can be flushed before it is written.
    """
    pgconn = ctypes.c_void_p(connection.pgconn_ptr)
    body = status_update(max(written, flushed), flushed, flushed, reply)
    if _put_copy_data()(pgconn, body, len(body)) != 1:
        raise TransientError(f"sending standby status failed: {_error(pgconn)}")
    deadline = time.monotonic() + timeout_s
    flush = _flush()
    while True:
        pending = flush(pgconn)
        if pending == 0:
            return
        if pending < 0:
            raise TransientError(f"sending standby status failed: {_error(pgconn)}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransientError("sending standby status timed out (socket not writable)")
        select.select([], [connection.fileno()], [], remaining)


def _error(pgconn: ctypes.c_void_p) -> str:
    message = libpq.required("PQerrorMessage", (ctypes.c_void_p,), ctypes.c_char_p)(pgconn)
    return message.decode("utf-8", "replace").strip() if message else "unknown libpq error"
