"""Slot loss, and ``cdcd resync``: the way back to consumers equal to the tables.

A logical slot is the only record of which changes cdcd still owes its
consumers. When it is gone, the changes made since cdcd last confirmed cannot
be streamed by anything: the server invalidated the slot (it fell more than
``max_slot_wal_keep_size`` behind, was idle longer than PostgreSQL 18's
``idle_replication_slot_timeout``, a recovery conflict), somebody dropped it,
or a standby was promoted without it (no failover slot, docs/failover.md).
Creating a new slot then would skip that gap without a trace, so ``cdcd run``
never does: it stops with exit code 3 and one line naming the cause and
``cdcd resync``.

How ``run`` knows that a missing slot was used before: the slot record in
the signal table (``cdcd.pipeline.slot_record``).

``cdcd resync -c FILE``, with the daemon stopped, first runs the steps of
``run``'s startup plan that it depends on (``cdcd.pipeline.startup``: the
connection, the server's settings, the role's privileges, the protocol and
failover support, the publication, and Kafka when there are tables), so it
refuses what ``run`` refuses with the same words, before it changes anything.
Then it:

1. marks the record ``resyncing`` (a daemon started meanwhile refuses to
   stream, and so does one started after an interrupted resync);
2. drops the invalidated slot, creates a new one (failover if configured) —
   a healthy slot is kept; its consistent point ``C`` is where the new
   stream starts;
3. publishes one truncate (``op=t``) per captured table, stamped
   ``cdcd.lsn = C - 1``: consumers drop what they hold, including rows
   deleted during the gap, which no snapshot could report. Every later
   message — the new slot's changes (commit LSNs from ``C`` on), the
   snapshot's rows — comes after it, by offset and by (``cdcd.lsn``,
   ``cdcd.seq``);
4. in one statement, records the slot as in use again and requests an
   incremental snapshot of every captured table (``resync:<slot>:<id>``),
   and cancels snapshot jobs of the old slot that the new one makes moot.

The next ``cdcd run`` streams from the new slot and runs that snapshot while
streaming (DBLog watermarks, ``cdcd.snapshot.incremental``): every row comes
back as ``op=r`` and the stream's own changes keep their order around it, so
consumers end equal to the tables. Until a table's snapshot has passed, its
consumers lack its older rows.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from cdcd.ack.tracker import AckTracker
from cdcd.config.model import CdcdConfig
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.errors import DefiniteError, TransientError
from cdcd.naming import format_table, split_table
from cdcd.pipeline.parts import SessionParts, real_parts, wire_format
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.schema_changes import SchemaChanges
from cdcd.pipeline.slot_record import IN_USE, RESYNCING, write_record
from cdcd.pipeline.startup import Startup, execute, sub_plan
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Truncate
from cdcd.sink.topics import topic_spec
from cdcd.snapshot.rows import plan_table
from cdcd.snapshot.store import CANCELLED, PENDING, RESYNC_JOB_PREFIX, RUNNING, SignalTable
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import SourceDatabase
from cdcd.source.slot_holder import slot_holder

__all__ = ["ResyncResult", "resync"]

log = logging.getLogger("cdcd.resync")

#: The steps of ``run``'s startup plan that resync depends on, before it changes anything.
RESYNC_CHECKS = sub_plan(
    "connect",
    "server",
    "privileges",
    "protocol",
    "failover",
    "signal table name",
    "shared publication",
    "publication",
)
#: Kafka, checked as ``run`` checks it, when there are truncates to publish.
KAFKA_CHECK = sub_plan("kafka")
#: How long resync waits for Kafka to acknowledge the truncates.
_DELIVERY_TIMEOUT_S = 60.0
#: PostgreSQL timestamps count microseconds from 2000-01-01.
_PG_EPOCH_US = 946_684_800 * 1_000_000


# ----------------------------------------------------------------------------- resync


@dataclass(frozen=True, slots=True)
class ResyncResult:
    slot: str
    created: bool  # a new slot (else a healthy one was kept)
    dropped: str | None  # why the old slot was dropped, if it was
    start: Lsn  # the slot's position: the new stream starts after it
    tables: tuple[str, ...]
    job_id: str | None
    signal_table: str


def resync(config: CdcdConfig) -> ResyncResult:
    """Do ``cdcd resync`` (module docstring); the daemon must not run on the slot meanwhile."""
    pg = config.postgres
    parts = real_parts(config, client_id="cdcd-resync")
    startup = Startup(
        config, dry_run=False, connect=parts.database, check_broker=parts.check_broker
    )
    try:
        execute(startup, RESYNC_CHECKS)
        db, signals = startup.database, startup.signal_table
        assert signals is not None  # the signal table name step raises for a bad name
        signals.ensure()
        tables = [format_table(s, t) for s, t in startup.captured_tables()]
        if tables:
            execute(startup, KAFKA_CHECK)
        info = db.slot_info(pg.slot)
        if info is not None and info.active_pid is not None:
            holder = slot_holder(db, info.active_pid).describe()
            raise DefiniteError(
                f"slot {pg.slot} is in use by {holder}",
                hint="stop cdcd (or whatever streams from the slot) before 'cdcd resync'",
            )
        two_phase = pg.protocol_version >= 3
        # From here until the snapshot is requested, no daemon may stream.
        write_record(signals, pg.slot, RESYNCING, info)
        dropped = None
        if info is not None and info.invalidated:
            dropped = str(db.lost_slot_error(info)).split("; ")[0]
            db.drop_slot(pg.slot)
            log.info("dropped the invalidated slot %s", pg.slot, extra={"slot": pg.slot})
            info = None
        created = info is None
        info = db.ensure_slot(pg.slot, True, two_phase, failover=pg.failover)
        if info.confirmed_flush_lsn is None:
            raise TransientError(f"slot {pg.slot} has no confirmed position yet; retry")
        start = info.confirmed_flush_lsn
        _truncate_topics(config, parts, db, signals, tables, start)
        job_id = None
        job = None
        if tables:
            job_id = f"{RESYNC_JOB_PREFIX}{pg.slot}:{uuid.uuid4().hex[:12]}"
            job = (
                job_id,
                # Addressed to this slot: other daemons sharing the signal table leave it alone.
                {"data-collections": tables, "type": "incremental", "reason": "resync", "slot": pg.slot},
            )
        _cancel_old_jobs(signals, pg.slot)
        write_record(signals, pg.slot, IN_USE, info, job)
        return ResyncResult(pg.slot, created, dropped, start, tuple(tables), job_id, signals.name)
    finally:
        if startup.db is not None:
            startup.db.close()


def _cancel_old_jobs(signals: SignalTable, slot: str) -> None:
    """Jobs of this slot (an unfinished initial snapshot, one it was running): the resync covers them."""
    rows = signals.db.query(
        f"UPDATE {signals.sql} SET status = %s, updated_at = now(), "
        "progress = progress || jsonb_build_object('error', 'superseded by cdcd resync') "
        "WHERE status IN (%s, %s) AND progress->>'slot' = %s RETURNING id",
        (CANCELLED, PENDING, RUNNING, slot),
    )
    for (job_id,) in rows:
        log.info("cancelled snapshot job %s: the resync snapshots every table", job_id)


def _truncate_topics(
    config: CdcdConfig,
    parts: SessionParts,
    db: SourceDatabase,
    signals: SignalTable,
    tables: list[str],
    start: Lsn,
) -> None:
    """Publish one ``op=t`` per table just below ``start``; wait until Kafka has them all."""
    if not tables:
        return
    kafka = config.kafka
    sink = parts.sink()
    try:
        tracker = AckTracker(start, classify=sink.delivery_failure)

        def ensure(topic: str) -> None:
            if kafka.create_topics:
                parts.ensure_topic(topic_spec(kafka, topic))

        wire = wire_format(config, sink, parts)
        catalog = PgCatalog(db.conn)
        relations = db.relation_cache(catalog, snapshot=True)
        publisher = Publisher(
            sink,
            tracker,
            EnvelopeEncoder(
                kafka.topic_prefix, db.database, wire, topics=config.postgres.topic_overrides()
            ),
            wire,
            include=lambda schema, table: True,
            ensure_topic=ensure,
            # Annotated as the snapshot's rows will be (defaults, earlier names).
            schema_tracker=SchemaChanges(db, catalog, signals, config.postgres.slot, False),
        )
        versions = tuple(
            plan_table(db, relations, *split_table(name), config.postgres.publication).version
            for name in tables
        )
        # One below the slot's position: no transaction's commit LSN can be
        # there (records are aligned; the position ends or precedes one), so
        # (cdcd.lsn, cdcd.seq) never collides with a change of the new slot.
        stamp = Lsn(int(start) - 1)
        now_us = time.time_ns() // 1000 - _PG_EPOCH_US
        publisher.begin_transaction(0, stamp, now_us)
        publisher.truncate(versions, Truncate(None, 0, tuple(v.relation_id for v in versions)))
        publisher.commit_transaction(stamp)
        deadline = time.monotonic() + _DELIVERY_TIMEOUT_S
        while tracker.pending_transactions:
            if tracker.failure is not None:
                raise tracker.failure
            if time.monotonic() > deadline:
                raise TransientError(
                    f"Kafka did not acknowledge the truncates within {_DELIVERY_TIMEOUT_S:.0f} s; "
                    "run 'cdcd resync' again"
                )
            sink.flush(0.1)
        if tracker.failure is not None:
            raise tracker.failure
        log.info(
            "published a truncate (op=t) at %s to the topic of each of %d tables",
            start,
            len(tables),
            extra={"lsn": str(start)},
        )
    finally:
        sink.close(5.0)

