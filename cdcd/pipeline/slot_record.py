"""The slot record: how ``run`` tells a lost slot from a first start.

A logical slot is the only record of which changes cdcd still owes its
consumers; when it is gone, creating a new one would skip the gap without a
trace (``cdcd.pipeline.resync``). The signal table (``cdcd.snapshot.store``)
therefore keeps one record per slot, ``slot:<slot>`` (type ``slot-state``),
written once cdcd has the slot and streams from it. The table lives in the
source database, so a promoted standby has the record too. A missing slot
with a record is lost; a missing slot without one is a first start (created
if ``create_slot``). Without a usable signal table
(``schema_changes.resnapshot: never``, ``snapshot.mode: never`` and none
created) a dropped slot cannot be told from a first start.

The startup plan's slot steps read and write it (:func:`check_slot`,
:func:`remember_slot`); ``cdcd resync`` marks it ``resyncing`` while it
works, so no daemon streams from a half-done resync.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from cdcd.errors import DefiniteError
from cdcd.snapshot.store import SignalTable
from cdcd.source.database import SourceDatabase
from cdcd.source.slots import RESYNC_HINT, SlotInfo, SlotLostError

__all__ = [
    "IN_USE",
    "RESYNCING",
    "SLOT_RECORD_TYPE",
    "check_slot",
    "remember_slot",
    "slot_record",
    "write_record",
]

log = logging.getLogger("cdcd.resync")

#: Signal-table rows that record a slot cdcd streams from (status done: never a job).
SLOT_RECORD_TYPE = "slot-state"
IN_USE = "in-use"
RESYNCING = "resyncing"


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


def write_record(
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
            write_record(signals, info.name, IN_USE, info)
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
