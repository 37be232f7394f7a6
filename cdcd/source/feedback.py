"""Standby status updates written by cdcd itself, through psycopg2's own libpq.

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
psycopg2's own answers to reply requests carry write = apply = 0; the
session follows each of them at once with a correct update
(``ReplicationStream.psycopg_replied``), and PostgreSQL never moves a
synchronous commit's wait backwards on a lower position.
"""

from __future__ import annotations

import ctypes
import select
import struct
import time
from typing import Any

from cdcd.errors import DefiniteError, TransientError
from cdcd.protocol.messages import PG_EPOCH_OFFSET_US

_STATUS = struct.Struct("!cQQQqB")
_libpq: ctypes.CDLL | None = None


def _load_libpq() -> ctypes.CDLL:
    """The libpq that psycopg2 itself uses (a second copy could not share its PGconn)."""
    global _libpq
    if _libpq is not None:
        return _libpq
    import psycopg2  # noqa: F401  (ensures psycopg2's libpq is mapped)

    path = None
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if "/libpq" in name and ".so" in name:
                path = name
                break
    if path is None:
        raise DefiniteError(
            "cannot find the libpq library used by psycopg2 in this process",
            hint="install psycopg2-binary, or psycopg2 built against a shared libpq",
        )
    lib = ctypes.CDLL(path)
    lib.PQputCopyData.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.PQputCopyData.restype = ctypes.c_int
    lib.PQflush.argtypes = [ctypes.c_void_p]
    lib.PQflush.restype = ctypes.c_int
    lib.PQerrorMessage.argtypes = [ctypes.c_void_p]
    lib.PQerrorMessage.restype = ctypes.c_char_p
    _libpq = lib
    return lib


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
    lib = _load_libpq()
    pgconn = ctypes.c_void_p(connection.pgconn_ptr)
    body = status_update(max(written, flushed), flushed, flushed, reply)
    if lib.PQputCopyData(pgconn, body, len(body)) != 1:
        raise TransientError(f"sending standby status failed: {_error(lib, pgconn)}")
    deadline = time.monotonic() + timeout_s
    while True:
        pending = lib.PQflush(pgconn)
        if pending == 0:
            return
        if pending < 0:
            raise TransientError(f"sending standby status failed: {_error(lib, pgconn)}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransientError("sending standby status timed out (socket not writable)")
        select.select([], [connection.fileno()], [], remaining)


def _error(lib: ctypes.CDLL, pgconn: ctypes.c_void_p) -> str:
    message = lib.PQerrorMessage(pgconn)
    return message.decode("utf-8", "replace").strip() if message else "unknown libpq error"
