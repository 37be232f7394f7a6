"""Reading one chunk of an incremental snapshot between two watermarks, and what it saw.

The chunk worker's half of the DBLog algorithm that ``cdcd.snapshot.incremental``
describes and drives: a worker thread on a connection of its own writes the
low watermark, reads the chunk in a REPEATABLE READ transaction whose first
statement records its snapshot (:class:`Visibility`), and writes the high
watermark; :class:`ChunkWindow` is the main thread's record of the keys the
stream changed meanwhile, checked against that snapshot at the high watermark.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from cdcd.errors import CdcdError, DefiniteError, TransientError
from cdcd.naming import WATERMARK_PREFIX
from cdcd.snapshot.rows import COLUMNS_SQL, CopyChunk, Key, TablePlan, catalog_columns, read_copy
from cdcd.snapshot.store import query_error
from cdcd.source.connection import connect
from cdcd.source.markers import MarkerTransactions

__all__ = [
    "ChunkRequest",
    "ChunkWindow",
    "ChunkWorker",
    "StalePlan",
    "TableGoneError",
    "Visibility",
]

log = logging.getLogger("cdcd.snapshot")

_XID_MASK = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Visibility:
    """Which transactions a read's snapshot saw (``pg_current_snapshot()``).

    pgoutput sends 32-bit xids, the snapshot 64-bit ones (epoch and xid); both
    are compared modulo 2^32, as PostgreSQL itself compares xids.
    """

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> Visibility:
        xmin, xmax, xip = text.split(":")
        return cls(
            int(xmin) & _XID_MASK,
            int(xmax) & _XID_MASK,
            frozenset(int(x) & _XID_MASK for x in xip.split(",") if x),
        )

    def sees(self, xid: int) -> bool:
        """Whether a committed ``xid`` was visible to the snapshot."""
        xid &= _XID_MASK
        if xid in self.xip:
            return False
        return ((xid - self.xmax) & _XID_MASK) >= 0x80000000  # xid precedes xmax


def _precedes(a: int, b: int) -> bool:
    """``a`` is an older xid than ``b`` (modulo 2^32)."""
    return ((a - b) & _XID_MASK) >= 0x80000000


class ChunkWindow:
    """The keys the stream changed around one chunk; decides which chunk rows survive.

    ``horizon`` is the xmin of a snapshot taken before the chunk's read
    started (the previous chunk's read, or a query when the table started):
    a transaction older than it had finished before the read began, so its
    changes before the low watermark cannot supersede the chunk and are not
    kept. That bounds memory when the stream lags far behind.

    ``opened_at`` is the publisher's count of transactions begun when the
    window opened (it records the table's changes from then on): see
    :meth:`unseen_earlier`.
    """

    def __init__(self, horizon: int | None = None, opened_at: int = 0) -> None:
        self.horizon = horizon
        self.opened_at = opened_at
        self.low_seen = False
        self.after_low: set[bytes] = set()
        self.before_low: list[tuple[int, bytes]] = []
        self.truncated_after_low = False
        self.truncates_before_low: list[int] = []

    def record(self, xid: int, key: bytes | None) -> None:
        """A change of the table in the stream; ``key`` None is a TRUNCATE."""
        if self.low_seen:
            if key is None:
                self.truncated_after_low = True
            else:
                self.after_low.add(key)
        elif self.horizon is not None and _precedes(xid & _XID_MASK, self.horizon):
            return  # finished before the read started: the read sees it
        elif key is None:
            self.truncates_before_low.append(xid)
        else:
            self.before_low.append((xid, key))

    @staticmethod
    def unseen_earlier(visibility: Visibility, published_earlier: list[int]) -> list[int]:
        """Transactions published before the window opened that the read did not see.

        PostgreSQL writes a commit record before it makes the transaction
        visible, and the stream can publish the transaction in between; with a
        synchronous standby the backend waits for the standby's reply in
        between. A read whose snapshot still had such a transaction in
        progress returns rows older than what the stream already published,
        and the window, opened later, holds no key of it to drop. Any such
        transaction means the chunk must be read again.
        """
        if not visibility.xip:
            return []
        return sorted({xid & _XID_MASK for xid in published_earlier} & visibility.xip)

    def superseded(self, visibility: Visibility) -> tuple[set[bytes], bool]:
        """Keys whose chunk rows must be dropped, and whether the whole chunk must be."""
        keys = set(self.after_low)
        keys.update(key for xid, key in self.before_low if not visibility.sees(xid))
        truncated = self.truncated_after_low or any(
            not visibility.sees(xid) for xid in self.truncates_before_low
        )
        return keys, truncated


@dataclass
class ChunkRequest:
    """One chunk to read, and what the worker found."""

    id: str
    plan: TablePlan
    after: Key | None
    limit: int | None  # None: the whole table (no key)
    ready: threading.Event = field(default_factory=threading.Event)
    chunk: CopyChunk | None = None  # COPY text, encoded on the main thread
    visibility: Visibility | None = None
    error: BaseException | None = None


class TableGoneError(DefiniteError):
    """The table being snapshotted was dropped or changed beyond reading."""


class StalePlan(TransientError):
    """The table's columns changed (ALTER TABLE) since its chunks were planned.

    Checked inside the chunk's read transaction, whose snapshot is taken
    after the low watermark and after the table's lock: a DDL committed
    before it is seen, and the chunk is read again with the new columns, so
    no chunk row lacks a column (or keeps an old name) that the stream
    already published.
    """


class ChunkWorker:
    """The thread that writes watermarks and reads chunks on its own connection.

    With ``markers`` (PostgreSQL 12 and 13, whose pgoutput sends no logical
    messages) each watermark's transaction is registered there before it
    commits, and the stream recognises it by its id (``cdcd.source.markers``).
    """

    def __init__(
        self, dsn: str, timeout_s: float, markers: MarkerTransactions | None = None
    ) -> None:
        self._dsn = dsn
        self._timeout_s = timeout_s
        self._markers = markers
        self._requests: queue.Queue[ChunkRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cdcd-incremental", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: ChunkRequest) -> None:
        self._requests.put(request)

    def close(self, timeout_s: float = 10.0) -> None:
        self._requests.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        conn: Any = None
        try:
            while True:
                request = self._requests.get()
                if request is None:
                    return
                try:
                    if conn is None or conn.closed:
                        conn = connect(self._dsn, timeout_s=self._timeout_s)
                    self._chunk(conn, request)
                except psycopg2.Error as exc:
                    request.error = _chunk_error(exc, request.plan.name)
                except CdcdError as exc:
                    request.error = exc
                except BaseException as exc:  # any failure fails the job, with the table named
                    log.debug("snapshot read of %s failed", request.plan.name, exc_info=True)
                    request.error = TableGoneError(
                        f"snapshot read of {request.plan.name} failed: {type(exc).__name__}: {exc}",
                        hint="this is a bug; report it with the log of a run with --debug",
                    )
                if request.error is not None:
                    request.ready.set()
        finally:
            if conn is not None and not conn.closed:
                conn.close()

    def _watermark(self, conn: Any, cursor: Any, content: str) -> None:
        """Commit a watermark: a transaction of its own, carried by the stream in commit order."""
        if self._markers is None:
            cursor.execute("SELECT pg_logical_emit_message(true, %s, %s)", (WATERMARK_PREFIX, content))
            return
        cursor.execute("BEGIN")
        try:
            self._markers.write(cursor, WATERMARK_PREFIX, content)
            cursor.execute("COMMIT")
        finally:
            # Failed before COMMIT: leave the connection usable for the next chunk.
            idle = psycopg2.extensions.TRANSACTION_STATUS_IDLE
            if not conn.closed and conn.info.transaction_status != idle:
                cursor.execute("ROLLBACK")

    def _chunk(self, conn: Any, request: ChunkRequest) -> None:
        with conn.cursor() as cursor:
            self._watermark(conn, cursor, f"low {request.id}")
            function = "pg_current_snapshot" if conn.server_version >= 130000 else "txid_current_snapshot"
            cursor.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            try:
                # The lock before the snapshot (LOCK takes none): a DDL that
                # committed while the read waited for it is then in the
                # snapshot. Locked after the snapshot, a table rewritten in
                # between reads as empty (its rows carry the rewrite's xid).
                cursor.execute(f"LOCK TABLE {request.plan.from_sql} IN ACCESS SHARE MODE")
                cursor.execute("SELECT to_regclass(%s)::oid", (request.plan.from_sql,))
                if int(cursor.fetchone()[0]) != request.plan.relation_id:
                    raise TableGoneError(
                        f"table {request.plan.name} was dropped and created again during its snapshot"
                    )
                cursor.execute(f"SELECT {function}()::text")
                request.visibility = Visibility.parse(cursor.fetchone()[0])
                cursor.execute(COLUMNS_SQL, (request.plan.relation_id,))
                if catalog_columns(cursor.fetchall()) != request.plan.catalog_columns:
                    raise StalePlan(f"the columns of {request.plan.name} changed during its snapshot")
                request.chunk = read_copy(cursor, request.plan, request.after, None, request.limit)
            finally:
                if not conn.closed:
                    cursor.execute("ROLLBACK")
            request.ready.set()
            self._watermark(conn, cursor, f"high {request.id}")


def _chunk_error(exc: psycopg2.Error, table: str) -> CdcdError:
    message = query_error(exc)
    if isinstance(exc, psycopg2.errors.UndefinedTable):
        return TableGoneError(f"table {table} disappeared during its snapshot: {message}")
    if isinstance(exc, psycopg2.errors.UndefinedColumn):  # renamed or dropped since planned
        return StalePlan(f"the columns of {table} changed during its snapshot: {message}")
    if isinstance(exc, psycopg2.OperationalError):
        return TransientError(f"snapshot read of {table} failed: {message}")
    return TableGoneError(
        f"snapshot read of {table} failed: {message}",
        hint="fix the table (or its privileges) and request the snapshot again",
    )
