"""The walsender connection: START_REPLICATION with pgoutput, reading, status updates.

Reading: the compiled ``cdcd.source._libpq`` takes a batch of XLogData
payloads straight from libpq on psycopg2's connection (``_libpq.c`` says
why), and notes keepalives: the server's sent position (``wal_end``) and
whether one asked for a reply, which the session then sends. Where it is not
built, or with ``CDCD_PURE_PYTHON=1``, psycopg2's ``read_message`` reads one
message per call and answers such keepalives itself, then the session sends
its own update at once. Status updates are otherwise sent by
``cdcd.source.feedback`` rather than psycopg2 — see that module for why
psycopg2's own feedback could confirm undelivered transactions.

pgoutput options by protocol version: v2 adds ``streaming on`` (large
in-progress transactions), v3 ``two_phase on`` (needs a two-phase slot), v4
``streaming parallel`` (PostgreSQL 16+; the session refuses a version the
server does not speak before it gets here, ``cdcd.source.versions``).
``messages true`` where pgoutput has it (14+), so that
``pg_logical_emit_message`` output (and cdcd's heartbeats and watermarks)
arrive; 12 and 13 would refuse the option (``cdcd.source.markers``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import select
import socket
from typing import Any

import psycopg2
import psycopg2.extras

from cdcd.errors import DefiniteError, TransientError
from cdcd.protocol.lsn import Lsn
from cdcd.source.connection import connect
from cdcd.source.feedback import send_status
from cdcd.source.libpq import native_module
from cdcd.source.sqlstate import error_code, psycopg2_error
from cdcd.source.versions import has_messages

#: psycopg2 must never send status updates on its own timer (see feedback.py).
_PSYCOPG_STATUS_INTERVAL_S = 10**7

#: SQLSTATEs with which the walsender refuses the stream for good: the
#: publication or slot does not exist (42704), the slot cannot be used
#: (55000: invalidated, another database, a physical slot, wal_level), an
#: option the server does not take (0A000, 22023: proto_version, two_phase),
#: no privilege (42501), the slot's plugin (58P01 no such file).
_DEFINITE_STREAM_CODES = frozenset({"42704", "55000", "0A000", "22023", "42501", "58P01"})
_ACTIVE_ELSEWHERE_CODE = "55006"  # object_in_use: the slot is active for another PID

# The same decisions by English text: only for errors without an SQLSTATE
# (psycopg2 errors made up on the client side).
_DEFINITE_STREAM = re.compile(
    r"publication .* does not exist|can no longer get changes|"
    r"proto(col)?_version|client sent proto_version|requested proto_version|"
    r"two_phase|does not support|is not supported|"
    r"replication slot .* does not exist|permission denied|"
    r"was created by a different|cannot use physical replication slot|"
    r"logical decoding requires|invalidated",
    re.IGNORECASE,
)
_ACTIVE_ELSEWHERE = re.compile(r"replication slot .* is active for PID", re.IGNORECASE)

#: The receive buffer of a replication connection to a server on this host
#: (TCP to a loopback address). Why small: the walsender flushes its socket
#: after every message, so whenever cdcd's TCP window is open each change
#: becomes a segment of its own, and over loopback the sender's CPU runs the
#: whole receive path of every segment. Profiled on the 1M-row drain, the
#: walsender's user time stayed at 1.6 µs per row while its kernel time went
#: from 1.4 µs (window closed: sends only queue) to 3.2 µs (open). A small
#: buffer closes the window within a millisecond of cdcd pausing (see
#: ``fill_wait_s``), so the walsender queues its sends and they travel in
#: large segments. On loopback the round trip is microseconds, so the window
#: never limits the rate. Connections over a network keep the kernel's
#: autotuning: there the window must cover the round trip.
LOCAL_RECEIVE_BUFFER_BYTES = 32 * 1024
#: How long the session pauses, while catching up, once a read has drained
#: the socket: long enough for the walsender to fill the small window above
#: and queue more behind it. With the kernel's large buffer a long pause only
#: delays (measured: 2 ms was worse than 0.5 there).
LOCAL_FILL_WAIT_S = 0.001
REMOTE_FILL_WAIT_S = 0.0005


def classify_stream_error(exc: psycopg2.Error, slot: str) -> TransientError | DefiniteError:
    """Sort a replication-connection error into retry or stop, by its SQLSTATE.

    The message is the server's, in its ``lc_messages`` language, so it only
    decides for errors that carry no SQLSTATE (see :mod:`cdcd.source.sqlstate`).
    """
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    code = error_code(exc)
    if code == _ACTIVE_ELSEWHERE_CODE or (not code and _ACTIVE_ELSEWHERE.search(message)):
        return TransientError(
            f"slot {slot} is in use by another connection ({message}); "
            "waiting for it to be released — if another cdcd runs on this slot, stop it"
        )
    if code in _DEFINITE_STREAM_CODES or (not code and _DEFINITE_STREAM.search(message)):
        return DefiniteError(
            f"replication on slot {slot} failed: {message}"
            + (f" (SQLSTATE {code})" if code else ""),
            hint="check postgres.publication, postgres.slot and postgres.protocol_version "
            "(PostgreSQL 12 and 13 speak 1, 14 up to 2, 15 up to 3, 16+ up to 4; "
            "3 needs a two-phase slot)",
        )
    return TransientError(f"replication connection lost: {message}")


def limit_local_receive_buffer(fd: int, size: int = LOCAL_RECEIVE_BUFFER_BYTES) -> bool:
    """Set ``SO_RCVBUF`` of socket ``fd`` to ``size`` if it is TCP to this host; whether it did.

    Unix-domain sockets and TCP to other hosts are left as they are.
    """
    with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: closing it leaves fd open
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        try:
            host = sock.getpeername()[0]
        except OSError:
            # Already disconnected: the stream's first read reports that,
            # classified; the buffer does not matter then.
            return False
        address = ipaddress.ip_address(host.split("%", 1)[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_loopback:
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        return True


def _option_ident(name: str) -> str:
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'


class ReplicationStream:
    """One walsender session on the slot."""

    #: ``server_version_num`` of the walsender's server (which options it
    #: takes); set from the connection, 0 (the oldest options) until then.
    server_version = 0
    #: How long the session pauses while catching up, once a read drained the
    #: socket: ``LOCAL_FILL_WAIT_S`` where the receive buffer is limited.
    fill_wait_s = REMOTE_FILL_WAIT_S
    #: ``postgres.origin``: ``none`` asks pgoutput to leave out replicated changes.
    origin = "any"

    def __init__(
        self,
        dsn: str,
        slot: str,
        publication: str,
        protocol_version: int,
        timeout_s: float = 10.0,
        origin: str = "any",
        application_name: str | None = None,
    ) -> None:
        self.slot = slot
        self.publication = publication
        self.protocol_version = protocol_version
        self.origin = origin  # "none" needs PostgreSQL 16 (refused at startup below)
        # The name synchronous_standby_names matches (postgres.application_name).
        self.application_name = application_name or slot
        self._conn = connect(
            dsn, replication=True, timeout_s=timeout_s, application_name=self.application_name
        )
        self._cursor: Any = self._conn.cursor()
        self.server_version = int(self._conn.server_version)
        self._psycopg_feedback: Any = None
        self._native = native_module()
        self._pgconn = int(self._conn.pgconn_ptr)
        if limit_local_receive_buffer(self._conn.fileno()):
            self.fill_wait_s = LOCAL_FILL_WAIT_S
        self._data_start = 0
        self._wal_end = 0
        self._reply_due = False

    def options(self) -> dict[str, str]:
        options = {
            "proto_version": str(self.protocol_version),
            "publication_names": _option_ident(self.publication),
        }
        if has_messages(self.server_version):
            options["messages"] = "true"
        if self.protocol_version >= 2:
            options["streaming"] = "parallel" if self.protocol_version >= 4 else "on"
        if self.protocol_version >= 3:
            options["two_phase"] = "on"
        if self.origin != "any":
            # pgoutput then leaves out changes that carry a replication origin
            # (applied by a subscription), so bidirectional setups do not loop.
            options["origin"] = self.origin
        # Never "binary": text values cost the server as much and cdcd less
        # (docs/performance.md), and every type has a text form.
        return options

    def start(self, start_lsn: Lsn) -> None:
        """START_REPLICATION at ``start_lsn`` (the server starts at the slot's
        confirmed position when that is later)."""
        try:
            self._cursor.start_replication(
                slot_name=self.slot,
                decode=False,
                start_lsn=int(start_lsn),
                options=self.options(),
                status_interval=_PSYCOPG_STATUS_INTERVAL_S,
            )
        except psycopg2.Error as exc:
            raise classify_stream_error(exc, self.slot) from exc

    def read_batch(self, limit: int) -> list[bytes]:
        """The payloads of up to ``limit`` messages that are ready now; fewer means the
        socket is drained. :attr:`data_start` is then the last one's WAL start.

        One call per batch rather than per message: the session's loop runs
        once per row, and a Python call is a measurable share of a row.
        """
        native = self._native
        if native is not None:
            result = native.read(self._pgconn, limit)
            if len(result) == 3:
                _, sqlstate, message = result
                exc = psycopg2_error(sqlstate, message)
                raise classify_stream_error(exc, self.slot) from exc
            payloads, data_start, wal_end, reply = result
            if data_start:
                self._data_start = data_start
            if wal_end:
                self._wal_end = wal_end
            if reply:
                self._reply_due = True
            return payloads  # type: ignore[no-any-return]
        read = self._cursor.read_message
        batch: list[bytes] = []
        append = batch.append
        try:
            for _ in range(limit):
                message = read()
                if message is None:
                    break
                append(message.payload)
                last = message
        except psycopg2.Error as exc:
            raise classify_stream_error(exc, self.slot) from exc
        if batch:
            self._data_start = last.data_start
        return batch

    @property
    def data_start(self) -> Lsn:
        """The WAL start of the last message :meth:`read_batch` returned."""
        return Lsn(self._data_start)

    @property
    def wal_end(self) -> Lsn:
        """The server's sent position from the last data or keepalive message."""
        if self._native is None:
            return Lsn(self._cursor.wal_end)
        return Lsn(self._wal_end)

    def wait(self, timeout_s: float) -> None:
        """Block until the socket is readable or the timeout passes."""
        select.select([self._conn], [], [], timeout_s)

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def reply_due(self) -> bool:
        """Whether a keepalive asked for a reply since the last call.

        The session then sends its status update at once, so the walsender
        and ``pg_stat_replication`` see cdcd's real positions. (psycopg2's
        ``read_message``, where it reads, has already answered with write =
        apply = 0, see feedback.py; the compiled reader leaves the answer to
        the session.)
        """
        if self._native is not None:
            due, self._reply_due = self._reply_due, False
            return due
        stamp = self._cursor.feedback_timestamp
        if stamp == self._psycopg_feedback:
            return False
        self._psycopg_feedback = stamp
        return True

    def send_status(self, written: Lsn, flushed: Lsn, reply: bool = False) -> None:
        """A standby status update: write = ``written`` (received), flush = apply = ``flushed``."""
        try:
            send_status(self._conn, int(written), int(flushed), reply)
        except psycopg2.Error as exc:
            raise classify_stream_error(exc, self.slot) from exc

    def close(self) -> None:
        if not self._conn.closed:
            self._conn.close()

    @property
    def closed(self) -> bool:
        return bool(self._conn.closed)
