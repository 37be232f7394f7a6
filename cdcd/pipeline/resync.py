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

How ``run`` knows that a missing slot was used before: the signal table
(``cdcd.snapshot.store``) keeps one record per slot, ``slot:<slot>``
(type ``slot-state``), written once cdcd has the slot and streams from it.
The table lives in the source database, so a promoted standby has the record
too. A missing slot with a record is lost; a missing slot without one is a
first start (created if ``create_slot``). Without a usable signal table
(``schema_changes.resnapshot: never``, ``snapshot.mode: never`` and none
created) a dropped slot cannot be told from a first start.

``cdcd resync -c FILE``, with the daemon stopped:

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
from datetime import UTC, datetime
from typing import Any

from cdcd.ack.tracker import AckTracker
from cdcd.config.model import CdcdConfig
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.errors import DefiniteError, TransientError
from cdcd.naming import format_table, split_table
from cdcd.pipeline.parts import real_parts, wire_format
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.schema_changes import SchemaChanges
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Truncate
from cdcd.sink.topics import topic_spec
from cdcd.snapshot.rows import plan_table
from cdcd.snapshot.store import CANCELLED, PENDING, RESYNC_JOB_PREFIX, RUNNING, SignalTable
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import SourceDatabase
from cdcd.source.slot_holder import slot_holder
from cdcd.source.slots import RESYNC_HINT, SlotInfo, SlotLostError
from cdcd.source.versions import require_failover, require_protocol

__all__ = [
    "SLOT_RECORD_TYPE",
    "ResyncResult",
    "check_slot",
    "remember_slot",
    "resync",
    "slot_record",
]

log = logging.getLogger("cdcd.resync")

#: Signal-table rows that record a slot cdcd streams from (status done: never a job).
SLOT_RECORD_TYPE = "slot-state"
IN_USE = "in-use"
RESYNCING = "resyncing"
#: How long resync waits for Kafka to acknowledge the truncates.
_DELIVERY_TIMEOUT_S = 60.0
#: PostgreSQL timestamps count microseconds from 2000-01-01.
_PG_EPOCH_US = 946_684_800 * 1_000_000


def _record_id(slot: str) -> str:
    return f"slot:{slot}"


def slot_record(signals: SignalTable | None, slot: str) -> dict[str, Any] | None:
    """The record of ``slot`` in the signal table, or None (no record, or no table)."""
    if signals is None or not signals.exists():
        return None
    wanted = _record_id(slot)
    try:
        signals.check_layout()
        records = signals.records(SLOT_RECORD_TYPE, wanted)
    except DefiniteError as exc:
        # A table of another layout, or one this user may not read: the
        # session and check say so elsewhere; here it only costs the record.
        log.warning(
            "cannot read the record of slot %s in %s (%s): a missing slot would look like a "
            "first start",
            slot,
            signals.name,
            exc,
            extra={"slot": slot},
        )
        return None
    for record_id, data in records:
        if record_id == wanted and isinstance(data, dict):
            return data
    return None


def _write_record(
    signals: SignalTable,
    slot: str,
    state: str,
    info: SlotInfo | None,
    job: tuple[str, Any] | None = None,
) -> None:
    data = {
        "slot": slot,
        "state": state,
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
        "lsn": str(info.confirmed_flush_lsn) if info and info.confirmed_flush_lsn else None,
        "failover": bool(info and info.failover),
    }
    signals.record(_record_id(slot), SLOT_RECORD_TYPE, data, job)


def remember_slot(signals: SignalTable | None, info: SlotInfo) -> None:
    """Record that cdcd streams from this slot (once; ``run`` after the slot is verified)."""
    if signals is None:
        return
    record = slot_record(signals, info.name)
    if record is None or record.get("state") != IN_USE:
        try:
            _write_record(signals, info.name, IN_USE, info)
        except DefiniteError as exc:
            # Streaming does not need it; only telling a lost slot from a new one does.
            log.warning(
                "cannot record slot %s in %s (%s): should the slot go missing, cdcd could not "
                "tell it from a first start",
                info.name,
                signals.name,
                exc,
                extra={"slot": info.name},
            )
            return
        log.info(
            "recorded slot %s in %s: should it ever be missing, cdcd stops instead of "
            "skipping what it missed",
            info.name,
            signals.name,
            extra={"slot": info.name},
        )


def _server(db: SourceDatabase) -> str:
    """Where this connection went (with a multi-host DSN, the host libpq chose)."""
    info = db.conn.info
    return f"{info.host}:{info.port}"


def check_slot(db: SourceDatabase, signals: SignalTable | None, slot: str) -> SlotInfo | None:
    """The slot if it is usable or absent for good reason; raises ``SlotLostError`` otherwise.

    Lost: invalidated by the server, missing although the signal table
    records that cdcd used it, or a resync that did not finish.
    """
    info = db.slot_info(slot)
    record = slot_record(signals, slot)
    if record is not None and record.get("state") == RESYNCING:
        raise SlotLostError(
            f"a resync of replication slot {slot} started at {record.get('since')} did not "
            "finish (recorded in the signal table), so consumers may lack what it was to send",
            hint="run 'cdcd resync -c <this config file>' again",
        )
    if info is not None:
        if info.invalidated:
            raise db.lost_slot_error(info)
        return info
    if record is not None:
        position = f" at {record['lsn']}" if record.get("lsn") else ""
        raise SlotLostError(
            f"replication slot {slot} is missing on the server cdcd connected to "
            f"({_server(db)}), but cdcd streamed from it before (recorded since "
            f"{record.get('since')}{position} in {signals.name if signals else 'the signal table'}):"
            " it was dropped, or this server was promoted without it (a failover slot on "
            "synchronized standbys survives a promotion: postgres.failover); the changes "
            "made since cdcd last confirmed cannot be streamed",
            hint=RESYNC_HINT,
        )
    return None


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


def _captured(config: CdcdConfig, db: SourceDatabase, signals: SignalTable) -> list[str]:
    pg = config.postgres
    if pg.table_names:
        names = db.resolve_tables(pg, exclude=[(signals.schema, signals.table)])
    else:
        names = db.publication_tables(pg.publication)
    return [format_table(s, t) for s, t in names if (s, t) != (signals.schema, signals.table)]


def resync(config: CdcdConfig) -> ResyncResult:
    """Do ``cdcd resync`` (module docstring); the daemon must not run on the slot meanwhile."""
    pg = config.postgres
    with SourceDatabase(pg.dsn, timeout_s=pg.connect_timeout_s) as db:
        db.require_logical()
        require_protocol(db.server_version, pg.protocol_version)
        require_failover(db.server_version, pg.failover)
        signals = SignalTable(db, config.snapshot.signal_table)
        signals.ensure()
        db.ensure_publication(pg)
        tables = _captured(config, db, signals)
        info = db.slot_info(pg.slot)
        if info is not None and info.active_pid is not None:
            holder = slot_holder(db, info.active_pid).describe()
            raise DefiniteError(
                f"slot {pg.slot} is in use by {holder}",
                hint="stop cdcd (or whatever streams from the slot) before 'cdcd resync'",
            )
        two_phase = pg.protocol_version >= 3
        # From here until the snapshot is requested, no daemon may stream.
        _write_record(signals, pg.slot, RESYNCING, info)
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
        _truncate_topics(config, db, signals, tables, start)
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
        _write_record(signals, pg.slot, IN_USE, info, job)
        return ResyncResult(pg.slot, created, dropped, start, tuple(tables), job_id, signals.name)


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
    config: CdcdConfig, db: SourceDatabase, signals: SignalTable, tables: list[str], start: Lsn
) -> None:
    """Publish one ``op=t`` per table just below ``start``; wait until Kafka has them all."""
    if not tables:
        return
    kafka = config.kafka
    parts = real_parts(config, client_id="cdcd-resync")
    parts.check_broker()
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

