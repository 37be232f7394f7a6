"""Incremental snapshots: watermark-delimited chunks read while streaming goes on.

One concern, the main thread's driver of incremental snapshot jobs: jobs
from the signal table, their tables one after another, each chunk's window
between its watermarks, and progress saved as Kafka acknowledges it. Reading
a chunk (the worker thread, its watermarks and snapshot) is
``cdcd.snapshot.chunks``.

The algorithm is DBLog's (Netflix, "DBLog: A Watermark Based Change-Data-Capture
Framework", 2020), which Debezium's incremental snapshots also follow. For
each chunk of a table, a worker thread on its own connection

1. writes a *low watermark* into the WAL: ``pg_logical_emit_message(true,
   'cdcd.watermark', 'low <chunk id>')`` in a transaction of its own (on
   PostgreSQL 12 and 13, whose pgoutput sends no messages, the stream
   recognises that transaction by its id instead, registered before it
   commits: ``cdcd.source.markers``, which explains why the order below
   holds all the same);
2. reads the chunk — the next ``snapshot.chunk_rows`` keys after the last
   chunk, in key order (``cdcd.snapshot.rows``) — inside a REPEATABLE READ
   transaction whose first statement records the snapshot
   (``pg_current_snapshot()``: xmin, xmax, in-progress xids);
3. hands the chunk (its COPY text, encoded in one compiled call on the main
   thread, ``cdcd.snapshot.rows.encode_reads``) over and writes the *high watermark*.

The main thread sees both watermarks in the change stream, in commit order,
between the table's ordinary changes. It publishes every change as always,
and additionally notes the key of each change to the table (the publisher's
``watch``). At the high watermark it drops from the chunk every row whose key
the stream changed where the read could not have seen it, and publishes the
rest as ``op=r`` envelopes inside the high watermark's transaction, stamped
with its commit LSN:

* any change after the low watermark (DBLog's rule: the read may or may not
  have seen it; the stream's version is the authority and is published
  before the chunk, any later change after it);
* a change *before* the low watermark by a transaction the read's snapshot
  still saw in progress. PostgreSQL writes a commit record before it makes
  the transaction visible, so a commit can precede the low watermark in the
  WAL and still be invisible to a read that started after the low watermark
  committed. DBLog's rule alone would then publish the chunk's older row
  after the newer change. Keys are therefore recorded from the previous high
  watermark (or the start of the table) on, with their xids, and checked
  against the read's snapshot.
* a TRUNCATE of the table under either rule drops the whole chunk.

Keys are recorded only from a point on (the table's start, the previous high
watermark); a transaction the stream published before that point but the
read's snapshot still saw in progress (the moment between its commit record
and its visibility, or all the while it waits for a synchronous standby)
escapes both rules. The publisher remembers the latest transactions' ids
(``Publisher.published_before``); a read that did not see one of those from
before the point is not published but read again
(``ChunkWindow.unseen_earlier``).

So a published chunk row is never older than what the stream published for
that key before it, and every later change follows it: replaying the topic
in (``cdcd.lsn``, ``cdcd.seq``) order gives the table. Chunks of one table
are strictly sequential (the next chunk starts after the previous one's last
key *read*), and the worker waits for the main thread to consume a chunk
before starting the next, so at most one chunk is held in memory and the
main loop never blocks on a read: it keeps serving the walsender.

Progress (``cdcd.snapshot.store``): after each chunk the job's state — the
table, the last key read, counts — is queued with the chunk's ticket, and
written to the signal table once every message of that chunk was
acknowledged by Kafka. A restart (crash, ``kill -9``, reconnect) resumes the
job after the last *delivered* chunk; chunks published after it are read and
published again, which is at-least-once like the rest of the stream. A new
session gets new chunk ids, so the replayed watermarks of an earlier run are
recognised as stale and ignored.

Schema changes (``cdcd.pipeline.schema_changes``, through ``SchemaBaselines``):
a table's shape as planned -- the catalog read after the WAL position that
stamps it -- becomes its recorded state once the table is read, unless the
stream recorded a later one meanwhile; and :meth:`IncrementalSnapshots.tick`
drives the periodic comparison of idle tables with the catalog, whose heals
are jobs of this driver. A reader thread's failure of any type fails the
job with the table named (``TableGoneError``), never the thread silently.

Tables without a primary key or replica identity index have no key to
de-duplicate by: they are read in one chunk, in memory, and rows changed
while it is read may be published stale (until their next change). A warning
says so; give the table a key to snapshot it incrementally with guarantees.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cdcd.ack.tracker import TxnTicket
from cdcd.decode.relations import RelationCache
from cdcd.envelope.encoder import TableEncoder
from cdcd.errors import DefiniteError, TransientError
from cdcd.naming import format_table, split_table
from cdcd.observability.metrics import Metrics
from cdcd.protocol.messages import LogicalMessage
from cdcd.snapshot.chunks import (
    ChunkRequest,
    ChunkWindow,
    ChunkWorker,
    StalePlan,
    TableGoneError,
    Visibility,
)
from cdcd.snapshot.daemons import DaemonRecord, other_daemons, register, slot_owner
from cdcd.snapshot.progress import ProgressLog, TableProgress
from cdcd.snapshot.publisher import SchemaBaselines, SnapshotPublisher
from cdcd.snapshot.rows import (
    CopyChunk,
    Key,
    TablePlan,
    estimate_rows,
    key_text,
    plan_table,
    published_leaves,
    published_units,
)
from cdcd.snapshot.store import (
    CANCELLED,
    DONE,
    HEAL_ID_PREFIX,
    PENDING,
    RESYNC_JOB_PREFIX,
    RUNNING,
    TRUNCATE_FIRST,
    Job,
    SignalTable,
    SignalTableGone,
    SignalTableUnavailable,
)
from cdcd.source.database import SourceDatabase
from cdcd.source.markers import MarkerTransactions

# ChunkWindow and Visibility: imported from here by older code and tests.
__all__ = ["ChunkWindow", "IncrementalSnapshots", "Visibility"]

log = logging.getLogger("cdcd.snapshot")

#: How often the signal table is read for new requests (and for cancellation),
#: or, while it does not exist, looked up in the catalog.
POLL_INTERVAL_S = 2.0

#: A chunk whose read missed a streamed commit is read again at once, then
#: after this delay, doubling up to :data:`REREAD_MAX_DELAY_S` (a commit that
#: waits for a synchronous standby stays invisible as long as the standby is away).
REREAD_DELAY_S = 0.05
REREAD_MAX_DELAY_S = 2.0


class FailedJobs:
    """Failed snapshot jobs: counted (``cdcd_snapshot_failures_total``); cdcd's own retried.

    A job cdcd requested itself (a heal after a schema change, the snapshot of
    ``cdcd resync``, the rest of an interrupted initial snapshot) leaves
    consumers with old or missing rows until it succeeds, so it is never given
    up on by itself: it stays ``running`` (so a restart retries it at once too)
    and is tried again after 1, 2, 4 … up to :data:`RETRY_MAX_S` seconds. An
    operator's request is marked failed (the operator asked, and reads why).
    """

    def __init__(self, metrics: Metrics | None) -> None:
        self._metrics = metrics
        self._attempts: dict[str, int] = {}
        self._resume_at = 0.0

    def count(self, tables: list[str]) -> None:
        if self._metrics is not None:
            for table in tables or ["-"]:
                self._metrics.snapshot_failure(table)

    def retry_in(self, job: Job) -> float:
        attempts = self._attempts.get(job.id, 0) + 1
        self._attempts[job.id] = attempts
        delay = min(RETRY_INITIAL_S * 2.0 ** (attempts - 1), RETRY_MAX_S)
        self._resume_at = time.monotonic() + delay
        return delay

    def attempts(self, job: Job) -> int:
        return self._attempts.get(job.id, 0)

    def may_resume(self) -> bool:
        return time.monotonic() >= self._resume_at

    def started(self, job: Job) -> None:
        if job.id in self._attempts:
            log.info("retrying snapshot job %s (attempt %d)", job.id, self._attempts[job.id] + 1)

    def done(self, job: Job) -> None:
        self._attempts.pop(job.id, None)


#: Backoff of a failed heal's retries.
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 300.0


@dataclass
class _TableRun:
    plan: TablePlan
    encoder: TableEncoder
    progress: TableProgress
    after: Key | None
    #: The shape this snapshot gives consumers, recorded when the table is read.
    baseline: object = None


class IncrementalSnapshots:
    """Runs snapshot jobs from the signal table alongside streaming; see the module docstring.

    Everything here runs on the session's main thread except the reads
    (``ChunkWorker``): :meth:`tick` from the main loop, :meth:`on_watermark`
    and the key recorder from inside the publisher.
    """

    def __init__(
        self,
        *,
        db: SourceDatabase,
        dsn: str,
        timeout_s: float,
        signals: SignalTable,
        slot: str,
        publication: str,
        publisher: SnapshotPublisher,
        relations: RelationCache,
        include: Callable[[str, str], bool],
        chunk_rows: int,
        metrics: Metrics | None,
        resume_initial: bool,
        on_job_done: Callable[[Job], None],
        table_ready: bool = True,
        markers: MarkerTransactions | None = None,
        schema: SchemaBaselines | None = None,
    ) -> None:
        self.db = db
        self.dsn = dsn
        self.timeout_s = timeout_s
        self.signals = signals
        self.slot = slot
        self.publication = publication
        self.publisher = publisher
        self.relations = relations
        self.include = include
        self.chunk_rows = chunk_rows
        self.metrics = metrics
        self.resume_initial = resume_initial
        self.on_job_done = on_job_done
        # False until the signal table is found (the daemon does not create
        # it for streaming alone; `cdcd snapshot` does): see _find_table.
        self._table_ready = table_ready
        self._table_noted = False
        self._run_id = uuid.uuid4().hex[:12]
        self._chunk_no = 0
        self._rereads = 0  # of the current chunk (ChunkWindow.unseen_earlier)
        # A chunk to read again at a monotonic time, and the table run it is of.
        self._reread_at: tuple[float, _TableRun] | None = None
        self._next_poll = 0.0
        self._poll_interval_s = POLL_INTERVAL_S
        self._job: Job | None = None
        self._job_log: ProgressLog | None = None
        self._tables: list[TableProgress] = []
        self._table: _TableRun | None = None
        self._request: ChunkRequest | None = None
        self._window = ChunkWindow()
        self._read_all = False  # every table of the job published, waiting for delivery
        self._unsaved: deque[tuple[TxnTicket, dict[str, Any]]] = deque()
        self._worker: ChunkWorker | None = None
        self._markers = markers
        self._schema = schema
        # Many daemons, one signal table (cdcd.snapshot.daemons): this one's
        # record, and the unaddressed requests left to the daemon capturing them.
        self._registered = False
        self._skip: set[str] = set()
        # A failed heal is retried after a backoff (FailedJobs).
        self._failures = FailedJobs(metrics)
        publisher.on_watermark(self.on_watermark)

    @property
    def active(self) -> bool:
        return self._job is not None

    # -- main loop --------------------------------------------------------------------

    def tick(self) -> None:
        """Called by the main loop often; cheap unless there is something to do."""
        request = self._request
        if request is not None:
            if request.error is not None:
                self._failed(request.error)
            elif self._worker is not None and not self._worker.alive:
                raise TransientError("the incremental snapshot worker thread stopped")
        pending = self._reread_at
        if pending is not None and time.monotonic() >= pending[0]:
            self._reread_at = None
            if self._table is pending[1] and self._request is None:
                self._dispatch()
        try:
            if self._unsaved:
                self._save_delivered()
            now = time.monotonic()
            if now >= self._next_poll:
                self._next_poll = now + self._poll_interval_s
                self._poll()
        except SignalTableGone as exc:
            self._table_gone(exc)
        if self._job_log is not None and self._tables:
            self._job_log.maybe(self._tables)
        if self._schema is not None:
            # Migrations of tables the stream shows nothing of (cdcd.pipeline.schema_changes).
            self._schema.catalog_check(self.include)

    def _poll(self) -> None:
        if not self._table_ready and not self._find_table():
            return
        if not self._registered:
            self._register()
        if self._job is None:
            if not self._failures.may_resume():
                return
            job = self.signals.next_job(self.slot, self._skip)
            if job is not None:
                self._start(job)
        else:
            self._check_cancelled()

    def _find_table(self) -> bool:
        """Whether the signal table is there now (a catalog lookup; nothing is created)."""
        signals = self.signals
        try:
            if not signals.exists():
                if not self._table_noted:
                    obstacle = signals.cannot_create()
                    log.info(
                        "the snapshot signal table %s does not exist (streaming does not need it): "
                        "incremental snapshots are unavailable until %s; cdcd looks for it every %g s",
                        signals.name,
                        f"a user allowed to creates it (this one cannot: {obstacle}; docs/snapshots.md)"
                        if obstacle
                        else "'cdcd snapshot' creates it",
                        self._poll_interval_s,
                    )
                    self._table_noted = True
                return False
            signals.check_layout()
        except SignalTableUnavailable as exc:
            if not self._table_noted:
                log.warning("%s; incremental snapshots are unavailable until it is fixed", exc)
                self._table_noted = True
            return False
        if self._table_noted:
            log.info("found the snapshot signal table %s: incremental snapshots are available", signals.name)
        self._table_ready = True
        self._table_noted = False
        return True

    def _table_gone(self, exc: SignalTableGone) -> None:
        """The table was dropped: stop its job (its progress went with it), look for it again."""
        if self._job is not None:
            log.warning("%s; snapshot job %s stopped", exc, self._job.id, extra={"job": self._job.id})
            self._abandon()
        else:
            log.warning("%s", exc)
        self._table_ready = False
        self._table_noted = True  # said once; the next line is when it is found again

    def close(self) -> None:
        self.publisher.unwatch()
        self.publisher.on_watermark(None)
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # -- jobs -------------------------------------------------------------------------

    def _captured(self) -> list[str]:
        """The tables this daemon captures (what its record says)."""
        units = published_units(
            self.db, self.publication, self.db.publication_tables(self.publication)
        )
        return [format_table(*unit) for unit in units if self.include(*unit)]

    def _register(self) -> None:
        """Write this daemon's record (cdcd.snapshot.daemons); once per session."""
        self._registered = True
        try:
            register(self.signals, self.slot, self.publication, self._captured())
        except SignalTableGone:
            raise
        except DefiniteError as exc:  # e.g. no INSERT privilege: jobs still work without it
            log.warning("could not record this daemon in the signal table: %s", exc)

    def _elsewhere(self, job: Job) -> DaemonRecord | None:
        """The other daemon an unaddressed request belongs to: it captures all its tables, we don't."""
        if job.address is not None or job.initial or not job.tables:
            return None
        mine = set(self._captured())
        if all(name in mine for name in job.tables):
            return None
        return slot_owner(other_daemons(self.signals, self.slot), job.tables)

    def _start(self, job: Job) -> None:
        owner = self._elsewhere(job)
        if owner is not None:
            # Not ours to run, nor to fail: back to pending for that daemon.
            self.signals.save(Job(job.id, job.type, PENDING, job.tables, {}))
            self._skip.add(job.id)
            log.info(
                "snapshot request %s of %s left to the daemon of slot %s, which captures it",
                job.id,
                ", ".join(job.tables),
                owner.slot,
                extra={"job": job.id},
            )
            return
        if job.initial and not self.resume_initial:
            reason = "snapshot.mode is never; the interrupted initial snapshot is not completed"
            log.warning(
                "%s (tables not done: %s); request one with 'cdcd snapshot'",
                reason,
                ", ".join(job.remaining) or "none",
            )
            job.status = CANCELLED
            job.progress["error"] = reason
            self.signals.save(job)
            return
        problem = self._validate(job)
        if problem is not None:
            log.error(
                "snapshot request %s of %s rejected: %s",
                job.id,
                ", ".join(job.tables) or "no table",
                problem,
                extra={"job": job.id},
            )
            self._failures.count(job.tables)
            self.signals.fail(job, problem)
            return
        self._failures.started(job)
        # A partitioned table published per leaf is snapshotted leaf by leaf,
        # each into the leaf's topic, as the stream carries it.
        job.tables = [
            format_table(*unit)
            for unit in published_units(
                self.db, self.publication, [split_table(name) for name in job.tables]
            )
        ]
        job.progress.setdefault("slot", self.slot)
        job.progress["tables"] = job.tables
        job.progress.setdefault("done", [])
        self._job = job
        self._read_all = False
        self._tables = []
        self._job_log = ProgressLog(f"incremental snapshot {job.id}")
        if job.initial:
            log.warning(
                "the initial snapshot of slot %s was interrupted; completing it as an incremental "
                "snapshot of %s (already delivered: %s)",
                self.slot,
                ", ".join(job.remaining),
                ", ".join(job.done_tables) or "none",
                extra={"job": job.id},
            )
        else:
            log.info(
                "incremental snapshot %s of %s %s",
                job.id,
                ", ".join(job.tables),
                "resumed" if job.progress.get("current") else "started",
                extra={"job": job.id},
            )
        self._next_table()

    def _validate(self, job: Job) -> str | None:
        if not job.tables:
            return "no tables named (data must be {\"data-collections\": [\"schema.table\", ...]})"
        published = set(self.db.publication_tables(self.publication))
        for name in job.tables:
            try:
                schema, table = split_table(name)
            except DefiniteError:
                return f"{name!r} is not schema.table"
            if not self.db.table_exists(schema, table):
                return f"table {name} does not exist"
            if (schema, table) == (self.signals.schema, self.signals.table):
                return f"{name} is the signal table"
            leaves = published_leaves(self.db, self.publication, schema, table)
            if not all(self.include(*unit) for unit in leaves or [(schema, table)]):
                return f"table {name} is not captured (postgres.tables)"
            if (schema, table) not in published and not leaves:
                return (
                    f"table {name} is not in publication {self.publication}; "
                    f"ALTER PUBLICATION {self.publication} ADD TABLE {name} first"
                )
        return None

    def _check_cancelled(self) -> None:
        job = self._job
        assert job is not None
        stored = self.signals.get(job.id)
        if stored is None or stored.status != RUNNING:
            log.warning(
                "snapshot job %s was %s in the signal table; stopping it",
                job.id,
                "deleted" if stored is None else f"set to {stored.status}",
                extra={"job": job.id},
            )
            self._abandon()

    def _abandon(self) -> None:
        self.publisher.unwatch()
        self._request = None  # its watermarks, if any come, no longer match
        self._table = None
        self._job = None
        self._job_log = None
        self._unsaved.clear()
        self._window = ChunkWindow()

    def _failed(self, error: BaseException) -> None:
        if isinstance(error, StalePlan) and self._table is not None and self._job is not None:
            self._replan(error)
            return
        if isinstance(error, TableGoneError) and self._job is not None:
            table = self._table.plan.name if self._table is not None else None
            self._job_failed(self._job, table, str(error))
            return
        raise error

    def _job_failed(self, job: Job, table: str | None, reason: str) -> None:
        """One loud ERROR line and a count; a heal of a table that still exists is retried."""
        tables = [table] if table is not None else job.remaining
        exists = table is None or self.db.table_exists(*split_table(table))
        # Jobs cdcd requested to make consumers exact (a heal, a resync's snapshot, the
        # initial snapshot) are retried: until they succeed, consumers hold wrong data.
        ours = job.initial or job.id.startswith((HEAL_ID_PREFIX, RESYNC_JOB_PREFIX))
        retry = self._failures.retry_in(job) if exists and ours else None
        self._failures.count(tables)
        if retry is None:
            log.error(
                "snapshot job %s of %s failed: %s", job.id, ", ".join(tables), reason,
                extra={"job": job.id, "table": ", ".join(tables)},
            )
            self.signals.fail(job, reason)
        else:
            log.error(
                "snapshot job %s of %s failed: %s; its consumers hold old or missing rows until "
                "it succeeds: retrying in %g s (attempt %d; fix the cause, or set the job's "
                "status to 'cancelled' in %s to give up)",
                job.id, ", ".join(tables), reason, retry, self._failures.attempts(job),
                self.signals.name,
                extra={"job": job.id, "table": ", ".join(tables)},
            )
            # What was saved (delivered chunks only), plus the reason: the retry resumes there.
            stored = self.signals.get(job.id) or job
            stored.progress["error"] = reason
            self.signals.save(Job(job.id, job.type, RUNNING, stored.tables, stored.progress))
        self._abandon()

    def _next_table(self) -> None:
        job = self._job
        assert job is not None
        self.publisher.unwatch()
        self._window = ChunkWindow()
        remaining = job.remaining
        if not remaining:
            self._table = None
            self._read_all = True
            if not self._unsaved:
                self._finish()
            return
        name = remaining[0]
        schema, table = split_table(name)
        try:
            plan = plan_table(self.db, self.relations, schema, table, self.publication)
        except DefiniteError as exc:  # dropped or emptied since the request was accepted
            self._job_failed(job, name, str(exc))
            return
        encoder = self.publisher.snapshot_encoder(plan.version)
        if encoder is None:
            raise DefiniteError(f"table {name} is not captured", hint="this is a bug; report it")
        current = job.progress.get("current")
        after: Key | None = None
        rows = chunks = 0
        if isinstance(current, dict) and current.get("table") == name:
            saved = current.get("after")
            after = tuple(str(v) for v in saved) if isinstance(saved, list) else None
            rows, chunks = int(current.get("rows", 0)), int(current.get("chunks", 0))
            log.info(
                "resuming the snapshot of %s after chunk %d (key %s, %s rows done)",
                name,
                chunks,
                key_text(after),
                f"{rows:,}",
                extra={"job": job.id, "table": name, "snapshot_chunks": chunks},
            )
        progress = TableProgress(name, estimate_rows(self.db, plan.relation_id), self.metrics, rows, chunks)
        self._tables.append(progress)
        if not plan.keyed:
            log.warning(
                "table %s has no primary key or replica identity index: its incremental snapshot "
                "is one read held in memory, and rows changed during it may be published stale "
                "until their next change",
                name,
                extra={"table": name},
            )
        baseline = None
        if self._schema is not None:
            # The WAL position first: a DDL before it is in what is read next.
            position = self.db.current_wal_lsn()
            baseline = self._schema.read_baseline(self.db, plan.version, position)
        self._table = _TableRun(plan, encoder, progress, after, baseline)
        function = "pg_current_snapshot" if self.db.server_version >= 130000 else "txid_current_snapshot"
        now = Visibility.parse(str(self.db.scalar(f"SELECT {function}()::text")))
        self._window = ChunkWindow(horizon=now.xmin, opened_at=self.publisher.begun)
        self.publisher.watch(plan.relation_id, self._record)
        self._dispatch()

    def _replan(self, reason: StalePlan) -> None:
        """Read the failed chunk again with the table's current columns."""
        run, job = self._table, self._job
        assert run is not None and job is not None
        schema, table = run.plan.version.schema, run.plan.version.table
        try:
            plan = plan_table(self.db, self.relations, schema, table, self.publication)
        except DefiniteError as exc:
            self._failed(TableGoneError(str(exc)))
            return
        if plan.relation_id != run.plan.relation_id:
            self._failed(TableGoneError(f"table {run.plan.name} was dropped and created again"))
            return
        encoder = self.publisher.snapshot_encoder(plan.version)
        if encoder is None:
            raise DefiniteError(f"table {run.plan.name} is not captured", hint="this is a bug; report it")
        log.info("%s; reading the chunk again with the new columns", reason, extra={"job": job.id})
        self._table = _TableRun(plan, encoder, run.progress, run.after, run.baseline)
        self._dispatch()

    def _dispatch(self) -> None:
        run = self._table
        assert run is not None
        self._reread_at = None
        self._chunk_no += 1
        request = ChunkRequest(
            f"{self._run_id}:{self._chunk_no}",
            run.plan,
            run.after,
            self.chunk_rows if run.plan.keyed else None,
        )
        self._request = request
        if self._worker is None or not self._worker.alive:
            self._worker = ChunkWorker(self.dsn, self.timeout_s, self._markers)
        self._worker.submit(request)

    def _record(self, xid: int, key: bytes | None) -> None:
        self._window.record(xid, key)

    # -- watermarks (inside the publisher, in the watermark's transaction) -----------

    def on_watermark(self, message: LogicalMessage) -> None:
        try:
            kind, _, ident = message.content.decode("ascii").partition(" ")
        except UnicodeDecodeError:
            return
        request = self._request
        if request is None or ident != request.id:
            log.debug("ignoring watermark %s %s (not the current chunk)", kind, ident)
            return
        if kind == "low":
            self._window.low_seen = True
            self._truncate_first()
            return
        if kind != "high":
            return
        if not self._window.low_seen:
            raise DefiniteError(
                f"high watermark of chunk {ident} arrived without its low watermark",
                hint="this is a bug; report it",
            )
        if not request.ready.is_set() or request.chunk is None or request.visibility is None:
            raise DefiniteError(
                f"high watermark of chunk {ident} arrived before its rows", hint="this is a bug; report it"
            )
        self._publish(request, request.chunk, request.visibility)

    def _truncate_first(self) -> None:
        """At the low watermark of a table's first chunk, a truncate if the job asks for one.

        There, and not with the chunk's rows at the high watermark: stream
        changes inside the window come after it and survive, the chunk then
        fills in the rest. Recorded with the next chunk's progress; a crash
        before that truncates again, which is harmless.
        """
        job, run = self._job, self._table
        if job is None or run is None:
            return
        name = run.plan.name
        truncated = list(job.progress.get("truncated") or [])
        if name not in (job.progress.get(TRUNCATE_FIRST) or []) or name in truncated:
            return
        self.publisher.snapshot_truncate(run.encoder)
        job.progress = {**job.progress, "truncated": [*truncated, name]}
        log.info(
            "truncate of %s published before its re-snapshot (its row filter changed)",
            name,
            extra={"job": job.id, "table": name},
        )

    def _publish(self, request: ChunkRequest, chunk: CopyChunk, visibility: Visibility) -> None:
        job, run = self._job, self._table
        assert job is not None and run is not None
        window = self._window
        unseen = window.unseen_earlier(visibility, self.publisher.published_before(window.opened_at))
        if unseen:
            # Read again in a window that opens now: it records those transactions'
            # later changes, and the next read sees them once they are visible.
            (log.info if self._rereads == 0 else log.debug)(
                "chunk %d of %s: its read did not yet see transaction(s) %s that the stream "
                "published before the chunk; reading it again",
                run.progress.chunks + 1,
                run.plan.name,
                ", ".join(str(x) for x in unseen),
                extra={"table": run.plan.name},
            )
            self._request = None
            self._window = ChunkWindow(horizon=visibility.xmin, opened_at=self.publisher.begun)
            if self._rereads == 0:
                self._dispatch()  # most such commits become visible within microseconds
            else:
                # One waiting for a synchronous standby may wait long: read less often.
                delay_s = min(REREAD_MAX_DELAY_S, REREAD_DELAY_S * 2 ** (self._rereads - 1))
                self._reread_at = (time.monotonic() + delay_s, run)
            self._rereads += 1
            return
        superseded, truncated = window.superseded(visibility)
        data = b"" if truncated else chunk.data
        ticket, sent = self.publisher.snapshot_copy_in_transaction(run.encoder, data, superseded)
        run.progress.chunk(chunk.rows, sent)
        finished = request.limit is None or chunk.rows < request.limit
        if chunk.last_key is not None:
            run.after = chunk.last_key
        state = dict(job.progress)
        state["chunks"] = int(state.get("chunks") or 0) + 1
        state["rows"] = int(state.get("rows") or 0) + chunk.rows
        if finished:
            state["done"] = [*job.done_tables, run.plan.name]
            state["current"] = None
        else:
            state["current"] = {
                "table": run.plan.name,
                "after": list(run.after) if run.after is not None else None,
                "chunks": run.progress.chunks,
                "rows": run.progress.rows,
            }
        job.progress = state
        self._unsaved.append((ticket, state))
        log.debug(
            "chunk %d of %s: %d rows read, %d published, %d superseded by the stream%s",
            run.progress.chunks,
            run.plan.name,
            chunk.rows,
            sent,
            chunk.rows - sent,
            " (truncated)" if truncated else "",
            extra={"table": run.plan.name, "snapshot_chunks": run.progress.chunks},
        )
        self._request = None
        self._rereads = 0
        # The next read starts after this one: what this one saw, it sees.
        self._window = ChunkWindow(horizon=visibility.xmin, opened_at=self.publisher.begun)
        if finished:
            run.progress.finish()
            log.info(
                "snapshot of %s read: %s rows in %d chunks (this run: %s rows, %d chunks)",
                run.plan.name,
                f"{run.progress.rows:,}",
                run.progress.chunks,
                f"{run.progress.rows - run.progress.resumed_rows:,}",
                run.progress.chunks - run.progress.resumed_chunks,
                extra={"job": job.id, "table": run.plan.name, "snapshot_chunks": run.progress.chunks},
            )
            if self._schema is not None and run.baseline is not None:
                # Every row now has the shape planned: the reference for later migrations.
                self._schema.record_baseline(run.plan.name, run.baseline)
            self._next_table()
        else:
            self._dispatch()

    # -- progress -----------------------------------------------------------------------

    def _save_delivered(self) -> None:
        latest: dict[str, Any] | None = None
        while self._unsaved and self._unsaved[0][0].complete:
            latest = self._unsaved.popleft()[1]
        job = self._job
        if latest is None or job is None:
            return
        self.signals.save(Job(job.id, job.type, RUNNING, job.tables, latest))
        if self._read_all and not self._unsaved:
            self._finish()

    def _finish(self) -> None:
        job = self._job
        assert job is not None
        job.status = DONE
        job.progress["current"] = None
        self.signals.save(job)
        rows = sum(t.rows for t in self._tables)
        rate = self._job_log.rate(self._tables) if self._job_log is not None else 0.0
        log.info(
            "snapshot job %s done: %s rows of %s, delivered (%s rows/s)",
            job.id,
            f"{rows:,}",
            ", ".join(job.tables),
            f"{rate:,.0f}",
            extra={"job": job.id, "snapshot_rows": rows},
        )
        self._failures.done(job)
        self._abandon()
        self.on_job_done(job)
