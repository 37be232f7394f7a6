"""The initial snapshot: every captured table, consistent with the slot, before streaming.

How it stays consistent (no gap, no overlap beyond at-least-once):

1. The slot is created over a walsender connection with
   ``CREATE_REPLICATION_SLOT … LOGICAL pgoutput (SNAPSHOT 'export')``
   (PostgreSQL 15 syntax; ``TWO_PHASE true`` joins it for protocol v3; before
   15 the old ``EXPORT_SNAPSHOT`` keyword). PostgreSQL answers with the
   slot's *consistent point* and the name of a snapshot that sees exactly the
   transactions committed before it: every later commit is decoded by the
   slot, every earlier one is in the snapshot.
2. The snapshot exists only until that walsender connection runs another
   command or closes, so a small pool of ordinary connections imports it at
   once (``BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; SET TRANSACTION
   SNAPSHOT '…'``); from then on each holds its own copy and the walsender
   connection is closed. (A walsender that sits idle between commands is not
   subject to ``wal_sender_timeout``, measured on PostgreSQL 15, but it is not
   needed any more anyway.)
3. Tables are read in key order by keyset chunks (``cdcd.snapshot.rows``),
   a large table cut into key ranges from a block sample so that the pool's
   connections read ranges of it in parallel; tables without a primary key
   or replica identity index are read in physical order (a warning says so),
   in batches as COPY delivers them, a large one cut into block ranges read
   by ``ctid`` (PostgreSQL 14 and later). Reading happens on worker threads, and so
   does encoding: each chunk's COPY text becomes its messages (key, ``op=r``
   envelope, headers) in one call of the compiled encoder
   (``cdcd.snapshot.rows.encode_reads``), with ``cdcd.seq`` ranges taken from
   one counter. The calling (main) thread only produces them and tickets
   each chunk, since the ack tracker is single-threaded by design. A bounded
   queue between them makes a slow broker slow the readers down rather than
   fill memory: at most two encoded chunks per reader wait in it.
   With ``snapshot.processes`` set, worker processes read instead
   (``cdcd.snapshot.workers``): the planning connection exports its snapshot
   (the slot's) to them, each checks in with ``txid_current_snapshot()``
   (refused unless it equals the planner's), reads the ranges it is handed
   with the same code (``cdcd.snapshot.ranges``), produces with a producer of
   its own and reports a range done once flushed; this thread hands out the
   ranges and the ``cdcd.seq`` blocks, and records the tables.
4. Rows go out as ``op=r`` envelopes with ``source.snapshot=true``, header
   ``cdcd.lsn`` = the consistent point and ``cdcd.seq`` counting up across the
   whole snapshot, so they sort before every streamed change. Streaming then
   starts at the consistent point.

Crash safety: the job row ``initial:<slot>`` in the signal table
(``cdcd.snapshot.store``) is written *before* the slot is created and lists
each table once all its rows are acknowledged by Kafka. A daemon that dies
mid-snapshot finds, on restart, the slot and an unfinished job; the exported
snapshot is gone with the old process, so the remaining tables are completed
as an incremental snapshot while streaming from the consistent point —
dropping and recreating the slot instead would leave rows in Kafka that a
later snapshot no longer holds (deleted meanwhile) with no delete to remove
them.

Schema changes: planning reads each table's columns, files and fast
defaults *inside* the exported snapshot (plain SQL on the catalog sees it as
of the snapshot), and records them as the table's state
(``cdcd.pipeline.schema_changes``): the shape consumers are given, stamped
at the consistent point, so a migration at any moment after it is found at
the table's next ``Relation`` (or by the catalog check), never absorbed.

DDL during the snapshot never stops the daemon. PostgreSQL reads a table
through its *current* definition and files even under an old snapshot, so a
DDL committed after the consistent point but before a table is read can
make the read wrong: a rewrite (``ALTER COLUMN … TYPE``, a volatile
default, ``TRUNCATE``) leaves files whose rows the snapshot cannot see (the
table reads empty), a rename or drop makes the planned ``SELECT`` fail, and
two renamed columns could swap values. So a reader locks the table
(``ACCESS SHARE``, what the read takes anyway) before its first range and
compares the table then -- OID (``to_regclass``), files
(``pg_relation_filenode``) and column names (a ``SELECT * … LIMIT 0``), all of
which see the catalog as it is now -- with what the plan read inside the
snapshot. Once locked, no DDL can commit until the snapshot ends. If they
differ, or the read fails on a missing column, the table is handed to an
incremental snapshot (a job in the signal table, run once streaming starts):
rows already published are as of the consistent point, so the stream and
that snapshot bring them up to date. A table dropped since is skipped (the
stream publishes nothing more of it). Every read runs under a savepoint, so
one table's failure leaves the connection's snapshot usable for the others.

A migration that starts while a table is being read waits for the snapshot
to end (the read's lock); a reader that would then queue behind it (another
range of the table) waits at most :data:`cdcd.snapshot.ranges.LOCK_TIMEOUT_S` and hands the table
over instead. Without that the snapshot, the migration and the reader would
wait for each other forever: PostgreSQL sees no deadlock, because the
snapshot's transactions end only when cdcd has read everything.

Any exception in a reader thread, of any type, fails the snapshot with the
table named: the main thread raises it; nothing is reported as read that was
not.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors

from cdcd.ack.tracker import AckTracker, TxnTicket
from cdcd.decode.relations import RelationCache
from cdcd.envelope.encoder import TableEncoder, make_stamp
from cdcd.envelope.rowcode import Message
from cdcd.errors import CdcdError, DefiniteError, TransientError
from cdcd.naming import LSN_HEADER
from cdcd.protocol.lsn import Lsn
from cdcd.snapshot.progress import ProgressLog, TableProgress
from cdcd.snapshot.publisher import SchemaBaselines, SnapshotPublisher
from cdcd.snapshot.ranges import STORAGE_THEN_SQL, prepare_reader, read_error, read_guarded
from cdcd.snapshot.rows import (
    Key,
    TablePlan,
    block_split_points,
    encode_reads,
    estimate_rows,
    plan_table,
    split_points,
)
from cdcd.snapshot.store import query_error
from cdcd.snapshot.workers import (
    WorkerPool,
    WorkerSettings,
    WorkerTable,
    remote_error,
    usage_line,
)
from cdcd.source.connection import connect, quote_ident
from cdcd.source.database import SourceDatabase
from cdcd.source.slot_wait import wait_for_slot_creation

__all__ = ["ExportedSnapshot", "InitialSnapshot", "create_slot_with_snapshot"]

log = logging.getLogger("cdcd.snapshot")

_QUEUE_WAIT_S = 0.2

@dataclass
class ExportedSnapshot:
    """A slot just created with an exported snapshot, imported into ``pool``."""

    slot: str
    consistent_point: Lsn
    name: str
    pool: list[SourceDatabase]

    def close(self) -> None:
        for db in self.pool:
            db.close()
        self.pool = []


def create_slot_with_snapshot(
    dsn: str,
    slot: str,
    two_phase: bool,
    connections: int,
    timeout_s: float,
    *,
    beat: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> ExportedSnapshot:
    """Create ``slot`` exporting a snapshot, and import it into ``connections`` connections.

    The creation waits for every open transaction to end; meanwhile
    ``wait_for_slot_creation`` logs which, keeps ``beat`` going and cancels
    on ``stop``.
    """
    repl = connect(dsn, replication=True, timeout_s=timeout_s)
    try:
        version = int(repl.server_version)
        if version >= 150000:
            options = ["SNAPSHOT 'export'"] + (["TWO_PHASE true"] if two_phase else [])
            command = f"CREATE_REPLICATION_SLOT {quote_ident(slot)} LOGICAL pgoutput ({', '.join(options)})"
        elif two_phase:
            raise DefiniteError(
                "a two-phase slot with an exported snapshot needs PostgreSQL 15",
                hint="use postgres.protocol_version 1 or 2, or snapshot.mode: never",
            )
        else:
            command = f"CREATE_REPLICATION_SLOT {quote_ident(slot)} LOGICAL pgoutput EXPORT_SNAPSHOT"
        cursor = repl.cursor()

        def create() -> Any:
            cursor.execute(command)
            return cursor.fetchone()

        try:
            row = wait_for_slot_creation(
                create, conn=repl, dsn=dsn, slot=slot, beat=beat, stop=stop, timeout_s=timeout_s
            )
        except psycopg2.errors.DuplicateObject as exc:
            raise TransientError(f"slot {slot} was created concurrently by another client") from exc
        except psycopg2.errors.ObjectNotInPrerequisiteState as exc:
            raise DefiniteError(
                f"cannot create slot {slot}: {query_error(exc)}",
                hint="set wal_level = logical and max_replication_slots > 0, then restart",
            ) from exc
        except psycopg2.OperationalError as exc:
            raise TransientError(f"creating slot {slot} failed: {query_error(exc)}") from exc
        except psycopg2.Error as exc:
            raise DefiniteError(
                f"cannot create slot {slot}: {query_error(exc)}",
                hint="check the user's REPLICATION attribute and max_replication_slots",
            ) from exc
        _, point_text, snapshot_name, _ = row
        consistent_point = Lsn.parse(point_text)
        log.info(
            "created slot %s at consistent point %s with exported snapshot %s",
            slot,
            consistent_point,
            snapshot_name,
            extra={"slot": slot, "lsn": str(consistent_point)},
        )
        pool: list[SourceDatabase] = []
        try:
            for _ in range(max(1, connections)):
                db = SourceDatabase(dsn, timeout_s=timeout_s, bounded=False)  # reads whole tables
                pool.append(db)
                db.query("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                db.query("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
        except (CdcdError, psycopg2.Error):
            for db in pool:
                db.close()
            raise
        return ExportedSnapshot(slot, consistent_point, str(snapshot_name), pool)
    finally:
        repl.close()


# -- work handed between threads ---------------------------------------------------


@dataclass
class _Table:
    plan: TablePlan
    encoder: TableEncoder
    progress: TableProgress
    storage: tuple[int, ...] = ()  # the files as of the snapshot
    ranges_left: int = 0
    tickets: list[TxnTicket] = field(default_factory=list)
    all_read: bool = False
    reported: bool = False
    #: Why the table goes to an incremental snapshot instead (set on the main
    #: thread; readers only skip its ranges then).
    handed: str | None = None
    dropped: bool = False
    #: What a worker process is given of the table (``snapshot.processes``).
    shipped: WorkerTable | None = None


@dataclass(frozen=True)
class _Range:
    table: _Table
    # Keys (after, upper]; for a table without a key, ctid [after, upper).
    after: Key | None  # lower bound; None: from the start
    upper: Key | None  # upper bound; None: to the end


@dataclass(frozen=True)
class _Rows:
    table: _Table
    messages: Sequence[Message]  # encoded on the reader thread


@dataclass(frozen=True)
class _RangeDone:
    table: _Table


@dataclass(frozen=True)
class _HandOver:
    table: _Table
    reason: str
    dropped: bool = False  # gone since the snapshot: nothing to hand over


@dataclass(frozen=True)
class _WorkerDone:
    error: BaseException | None


class InitialSnapshot:
    """Reads every table of an exported snapshot and publishes it; see the module docstring."""

    def __init__(
        self,
        exported: ExportedSnapshot,
        tables: list[tuple[str, str]],
        *,
        publisher: SnapshotPublisher,
        tracker: AckTracker,
        poll: Callable[[float], Any],
        relations: RelationCache,
        publication: str,
        chunk_rows: int,
        metrics: Any,
        stop: threading.Event,
        beat: Callable[[], None],
        on_table_done: Callable[[str], None],
        schema: SchemaBaselines | None = None,
        processes: int = 0,
        workers: WorkerSettings | None = None,
    ) -> None:
        self.exported = exported
        self.tables = tables
        self.publisher = publisher
        self.tracker = tracker
        self.poll = poll
        self.relations = relations
        self.publication = publication
        self.chunk_rows = chunk_rows
        self.metrics = metrics
        self.stop = stop
        self.beat = beat
        self.on_table_done = on_table_done
        self.schema = schema
        if processes and workers is None:
            raise DefiniteError("snapshot worker processes without their settings", hint="this is a bug")
        #: Worker processes reading the snapshot (``cdcd.snapshot.workers``); 0: threads.
        self.processes = processes
        self.workers = workers
        #: How many read side by side: a table is cut into as many key ranges.
        self.readers = processes or len(exported.pool)
        self._abort = threading.Event()
        self._results: queue.Queue[_Rows | _RangeDone | _HandOver | _WorkerDone] = queue.Queue(
            maxsize=2 * max(1, len(exported.pool))
        )
        self._ranges: queue.Queue[_Range] = queue.Queue()
        self.rows = 0
        # cdcd.seq counts up across the whole snapshot; readers take ranges of it.
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._ts_ms = time.time_ns() // 1_000_000
        self._own_snapshot = ""  # the planning transaction's, with worker processes

    # -- planning (main thread, inside the snapshot) --------------------------------

    def _plan(self) -> list[_Table]:
        db = self.exported.pool[0]
        planned: list[_Table] = []
        for schema, table in self.tables:
            plan = plan_table(db, self.relations, schema, table, self.publication)
            encoder = self.publisher.snapshot_encoder(plan.version)
            if encoder is None:
                continue
            estimated = estimate_rows(db, plan.relation_id)
            storage = tuple(int(x) for x in db.scalar(STORAGE_THEN_SQL, (plan.relation_id,)) or ())
            if self.schema is not None:
                # The shape consumers get: the reference for later migrations.
                baseline = self.schema.read_baseline(db, plan.version, self.exported.consistent_point)
                self.schema.record_baseline(plan.name, baseline)
            planned.append(
                _Table(plan, encoder, TableProgress(plan.name, estimated, self.metrics), storage)
            )
            if self.processes:
                planned[-1].shipped = WorkerTable.of(plan, storage, encoder)
            points: list[Key] = []
            if plan.keyed:
                if estimated > 4 * self.chunk_rows:
                    points = split_points(db, plan, self.readers, estimated)
            else:
                if estimated > 4 * self.chunk_rows:
                    points = block_split_points(db, plan, self.readers)
                log.warning(
                    "table %s has no primary key or replica identity index: its snapshot is "
                    "read in physical order (%s), and its Kafka messages have null keys",
                    plan.name,
                    f"{len(points) + 1} block ranges" if points else "one pass",
                    extra={"table": plan.name},
                )
            bounds: list[Key | None] = [None, *points, None]
            for after, upper in zip(bounds, bounds[1:], strict=False):
                self._ranges.put(_Range(planned[-1], after, upper))
                planned[-1].ranges_left += 1
        return planned

    # -- reading (worker threads) ---------------------------------------------------

    def _put(self, item: _Rows | _RangeDone | _HandOver | _WorkerDone) -> None:
        while not self._abort.is_set():
            try:
                self._results.put(item, timeout=_QUEUE_WAIT_S)
                return
            except queue.Full:
                continue

    def _read(self, db: SourceDatabase) -> None:
        error: BaseException | None = None
        name = "a table"
        try:
            cursor = db.conn.cursor()
            prepare_reader(cursor)
            while not self._abort.is_set():
                try:
                    work = self._ranges.get_nowait()
                except queue.Empty:
                    break
                name = work.table.plan.name
                if work.table.handed is None and not work.table.dropped:
                    self._guarded(cursor, work)
                self._put(_RangeDone(work.table))
        except psycopg2.Error as exc:
            error = read_error(exc, name)
        except CdcdError as exc:
            error = exc
        except BaseException as exc:  # any failure fails the snapshot, with the table named
            log.debug("snapshot reader failed on %s", name, exc_info=True)
            error = DefiniteError(
                f"reading {name} for the snapshot failed: {type(exc).__name__}: {exc}",
                hint="this is a bug; report it with the log of a run with --debug",
            )
        finally:
            self._put(_WorkerDone(error))

    def _guarded(self, cursor: Any, work: _Range) -> None:
        """Lock, check and read one range under a savepoint (module docstring)."""
        table = work.table
        handed = read_guarded(
            cursor,
            table.plan,
            table.storage,
            work.after,
            work.upper,
            self.chunk_rows,
            lambda data, rows: self._emit(table, data, rows),
            self._abort.is_set,
        )
        if handed is not None:
            self._put(_HandOver(table, *handed))

    def _emit(self, table: _Table, data: bytes, rows: int) -> None:
        """Encode a chunk of COPY text here, on the reader thread; the main thread produces it."""
        with self._seq_lock:
            seq = self._seq
            self._seq += rows
        stamp = make_stamp(0, self.exported.consistent_point, self._ts_ms, snapshot=True)
        messages = encode_reads(table.encoder, data, stamp, seq, (LSN_HEADER, stamp.lsn_header))
        self._put(_Rows(table, messages))

    # -- publishing (main thread) ---------------------------------------------------

    def run(self) -> bool:
        """Read, publish and wait for delivery; False if stopped before the end."""
        started = time.monotonic()
        point = self.exported.consistent_point
        pool: WorkerPool | None = None
        try:
            if self.processes:
                # Started before planning: their interpreters start meanwhile.
                pool = self._start_workers()
            tables = self._plan()
            total_estimate = sum(t.progress.estimated for t in tables)
            log.info(
                "initial snapshot of %d tables (%s rows estimated) at %s with %d connections%s",
                len(tables),
                f"{total_estimate:,}",
                point,
                self.readers,
                " in worker processes" if pool is not None else "",
                extra={"lsn": str(point)},
            )
            progress = ProgressLog("initial snapshot")
            if pool is not None:
                finished = self._read_in_processes(pool, tables, progress)
            else:
                finished = self._read_in_threads(tables, progress)
            if not finished:
                return False
            while not all(t.reported for t in tables):
                self.poll(0.1)
                if not self._serve(tables, progress):
                    return False
        finally:
            if pool is not None:
                pool.close()
        elapsed = time.monotonic() - started
        log.info(
            "initial snapshot complete: %s rows of %d tables in %.1f s (%s rows/s), delivered",
            f"{self.rows:,}",
            len(tables),
            elapsed,
            f"{self.rows / max(elapsed, 1e-6):,.0f}",
            extra={"snapshot_rows": self.rows, "lsn": str(point)},
        )
        return True

    def _read_in_threads(self, tables: list[_Table], progress: ProgressLog) -> bool:
        """Reader threads on the pool's connections; this thread produces. False: stopped."""
        point = self.exported.consistent_point
        workers = [
            threading.Thread(target=self._read, args=(db,), name=f"cdcd-snapshot-{i}", daemon=True)
            for i, db in enumerate(self.exported.pool)
        ]
        for worker in workers:
            worker.start()
        live = len(workers)
        try:
            while live:
                try:
                    item = self._results.get(timeout=_QUEUE_WAIT_S)
                except queue.Empty:
                    item = None
                if isinstance(item, _Rows):
                    table, count = item.table, len(item.messages)
                    table.tickets.append(
                        self.publisher.snapshot_messages(table.encoder.topic, item.messages, point)
                    )
                    table.progress.chunk(count, count)
                    self.rows += count
                elif isinstance(item, _RangeDone):
                    item.table.ranges_left -= 1
                    item.table.all_read = item.table.ranges_left == 0
                elif isinstance(item, _HandOver):
                    self._hand_over(item)
                elif isinstance(item, _WorkerDone):
                    live -= 1
                    if item.error is not None:
                        raise item.error
                if not self._serve(tables, progress):
                    return False
        finally:
            self._abort.set()
            for worker in workers:
                worker.join(timeout=10)
        return True

    # -- reading in worker processes (snapshot.processes) ----------------------------

    def _start_workers(self) -> WorkerPool:
        """Export the snapshot from the planning transaction and spawn the workers on it.

        The planning connection imported the slot's exported snapshot, and a
        snapshot exported from it is that same snapshot; it stays importable
        while this transaction lasts, which is the whole initial snapshot.
        """
        assert self.workers is not None
        db = self.exported.pool[0]
        name = str(db.scalar("SELECT pg_export_snapshot()"))
        self._own_snapshot = str(db.scalar("SELECT txid_current_snapshot()::text"))
        return WorkerPool(
            self.processes,
            self.workers,
            name,
            self.exported.consistent_point,
            self._ts_ms,
            self.chunk_rows,
        )

    def _read_in_processes(
        self, pool: WorkerPool, tables: list[_Table], progress: ProgressLog
    ) -> bool:
        """Hand ranges to the workers and follow them until all exit. False: stopped."""
        pending: collections.deque[_Range] = collections.deque()
        while not self._ranges.empty():
            pending.append(self._ranges.get_nowait())
        reading: dict[int, _Range] = {}
        usage: list[tuple[int, float, float]] = []

        def dispatch(index: int) -> None:
            while pending:
                work = pending.popleft()
                table = work.table
                if table.handed is not None or table.dropped:
                    self._range_done(table)
                    continue
                reading[index] = work
                pool.send(index, ("range", table.shipped, work.after, work.upper))
                return
            pool.send(index, ("stop",))

        while pool.live:
            for index, message in pool.receive(_QUEUE_WAIT_S):
                work = reading.get(index)
                where = work.table.plan.name if work is not None else "no table yet"
                if message is None:
                    if self.stop.is_set():
                        return False  # stopping: a signal to the whole process group
                    raise TransientError(
                        f"snapshot worker {index} (pid {pool.pid(index)}) died while reading "
                        f"{where} (exit code {pool.exitcode(index)})"
                    )
                kind = message[0]
                if kind == "seq":
                    pool.send(index, ("seq", self._seq))
                    self._seq += int(message[1])
                elif kind == "rows":
                    assert work is not None
                    work.table.progress.chunk(int(message[1]), int(message[1]))
                    self.rows += int(message[1])
                elif kind == "done":
                    assert work is not None
                    del reading[index]
                    if message[1] is not None:
                        self._hand_over(_HandOver(work.table, *message[1]))
                    self._range_done(work.table)
                    dispatch(index)
                elif kind == "ready":
                    self._check_worker(index, int(message[1]), str(message[2]))
                    dispatch(index)
                elif kind == "failed":
                    if self.stop.is_set():
                        return False
                    text = str(message[2])
                    if work is not None and work.table.plan.name not in text:
                        text = f"snapshot of {work.table.plan.name}: {text}"
                    raise remote_error(str(message[1]), f"snapshot worker {index}: {text}", message[3])
                elif kind == "log":
                    logging.getLogger(str(message[2])).log(
                        int(message[1]), "snapshot worker %d: %s", index, message[3]
                    )
                elif kind == "exit":
                    usage.append((index, float(message[1]), float(message[2])))
                    pool.finished(index)
            if not self._serve(tables, progress):
                return False
        line, fields = usage_line(usage)
        log.info(line, extra=fields)
        return True

    def _check_worker(self, index: int, pid: int, seen: str) -> None:
        """A worker reads nothing unless its transaction holds the daemon's snapshot."""
        if seen != self._own_snapshot:
            raise DefiniteError(
                f"snapshot worker {index} (pid {pid}) does not hold the slot's exported "
                f"snapshot: its transaction sees {seen}, the daemon's {self._own_snapshot}",
                hint="this is a bug; report it with the PostgreSQL version",
            )
        log.info(
            "snapshot worker %d (pid %d) imported the snapshot: %s",
            index,
            pid,
            seen,
            extra={"snapshot_worker_pid": pid, "snapshot": seen},
        )

    @staticmethod
    def _range_done(table: _Table) -> None:
        table.ranges_left -= 1
        table.all_read = table.ranges_left == 0

    def _serve(self, tables: list[_Table], progress: ProgressLog) -> bool:
        """Delivery reports, failures, health, finished tables; False when stopping."""
        self.poll(0)
        if self.tracker.failure is not None:
            raise self.tracker.failure
        self.beat()
        for table in tables:
            if table.all_read and not table.reported:
                table.tickets = [t for t in table.tickets if not t.complete]
                if not table.tickets:
                    table.reported = True
                    table.progress.finish()
                    if table.handed is not None:
                        continue  # not done: a restart before the job exists reads it again
                    self.on_table_done(table.plan.name)
                    log.info(
                        "initial snapshot of %s delivered: %s rows, %d chunks",
                        table.plan.name,
                        f"{table.progress.rows:,}",
                        table.progress.chunks,
                        extra={"table": table.plan.name},
                    )
        progress.maybe(t.progress for t in tables)
        return not self.stop.is_set()


    def _hand_over(self, item: _HandOver) -> None:
        table = item.table
        if table.handed is not None or table.dropped:
            return
        if item.dropped:
            table.dropped = True
            log.warning(
                "initial snapshot of %s: %s; skipped (the stream carries nothing more of it)",
                table.plan.name,
                item.reason,
                extra={"table": table.plan.name},
            )
            return
        if self.schema is None:
            raise DefiniteError(
                f"the initial snapshot cannot read {table.plan.name}: {item.reason}",
                hint=f"run 'cdcd snapshot --table {table.plan.name}' once the daemon streams",
            )
        self.schema.hand_over(table.plan.name, item.reason)
        table.handed = item.reason
