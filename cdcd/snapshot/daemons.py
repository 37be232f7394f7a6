"""Daemons that share a database: each one's record of what it captures, in the signal table.

Sharding tables across daemons (one slot each) is the way to scale past one
walsender. Each daemon writes a row ``daemon:<slot>`` (type ``daemon``,
status ``done``, so never taken for a job) into its signal table when it
finds the table: its slot, publication and the tables it captures. Two
things read it:

* a daemon that claimed a request addressed to no slot (an operator's
  ``INSERT`` without ``data.slot``) for tables it does not capture leaves it
  pending for the daemon whose record captures them, instead of failing it;
* ``cdcd check`` lists the other daemons and the conflicts between them
  (one publication for different table sets, one table captured twice into
  the same topics).

A record whose slot no longer exists in this database is stale (the daemon
was retired with its slot) and ignored.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from cdcd.config.model import PostgresConfig
from cdcd.errors import ConfigError
from cdcd.naming import format_table
from cdcd.snapshot.rows import published_units
from cdcd.snapshot.store import DAEMON, RUNNING, SignalTable
from cdcd.source.database import SourceDatabase

__all__ = [
    "RECORD_PREFIX",
    "DaemonRecord",
    "failing_jobs",
    "Neighbour",
    "neighbours",
    "other_daemons",
    "publication_clash",
    "register",
    "sharing_report",
    "slot_owner",
]

RECORD_PREFIX = "daemon:"


@dataclass(frozen=True, slots=True)
class DaemonRecord:
    """What one daemon captures (a ``daemon:<slot>`` row)."""

    slot: str
    publication: str
    tables: tuple[str, ...]
    topic_prefix: str | None = None
    host: str | None = None
    pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "publication": self.publication,
            "tables": list(self.tables),
            "topic_prefix": self.topic_prefix,
            "host": self.host,
            "pid": self.pid,
        }

    @classmethod
    def from_json(cls, data: Any) -> DaemonRecord | None:
        if not isinstance(data, dict) or not isinstance(data.get("slot"), str):
            return None
        tables = data.get("tables")
        pid = data.get("pid")
        prefix = data.get("topic_prefix")
        return cls(
            slot=data["slot"],
            publication=str(data.get("publication") or ""),
            tables=tuple(str(t) for t in tables) if isinstance(tables, list) else (),
            topic_prefix=prefix if isinstance(prefix, str) else None,
            host=str(data["host"]) if data.get("host") is not None else None,
            pid=int(pid) if isinstance(pid, int) else None,
        )


def register(
    signals: SignalTable,
    slot: str,
    publication: str,
    tables: list[str],
    topic_prefix: str | None = None,
) -> None:
    """Write (or refresh) this daemon's record."""
    record = DaemonRecord(
        slot, publication, tuple(sorted(tables)), topic_prefix, socket.gethostname(), os.getpid()
    )
    signals.record(f"{RECORD_PREFIX}{slot}", DAEMON, record.to_json())


def _slots(db: SourceDatabase) -> set[str]:
    """The logical slots of this database."""
    rows = db.query(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'logical' "
        "AND database = current_database()"
    )
    return {str(r[0]) for r in rows}


def other_daemons(signals: SignalTable, slot: str) -> list[DaemonRecord]:
    """The records of the other daemons of this signal table whose slot still exists."""
    live = _slots(signals.db)
    out = []
    for _id, data in signals.records(DAEMON, RECORD_PREFIX):
        record = DaemonRecord.from_json(data)
        if record is not None and record.slot != slot and record.slot in live:
            out.append(record)
    return out


def slot_owner(others: list[DaemonRecord], tables: list[str]) -> DaemonRecord | None:
    """The other daemon that captures every one of ``tables``, if one does."""
    wanted = set(tables)
    for record in others:
        if wanted and wanted <= set(record.tables):
            return record
    return None


@dataclass(frozen=True, slots=True)
class Neighbour:
    """Another logical slot of this database, with its daemon's record if it has one here."""

    slot: str
    plugin: str
    active: bool
    record: DaemonRecord | None


def neighbours(db: SourceDatabase, signals: SignalTable | None, slot: str) -> list[Neighbour]:
    """The other logical slots of this database (other cdcd daemons, or other clients)."""
    records: dict[str, DaemonRecord] = {}
    if signals is not None and signals.exists():
        for _id, data in signals.records(DAEMON, RECORD_PREFIX):
            record = DaemonRecord.from_json(data)
            if record is not None:
                records[record.slot] = record
    rows = db.query(
        "SELECT slot_name, plugin, active FROM pg_replication_slots WHERE slot_type = 'logical' "
        "AND database = current_database() AND slot_name <> %s ORDER BY slot_name",
        (slot,),
    )
    return [Neighbour(str(s), str(p), bool(a), records.get(str(s))) for s, p, a in rows]


def sharing_report(
    neighbours_: list[Neighbour], slot: str, publication: str, captured: list[str]
) -> list[tuple[bool, str]]:
    """``cdcd check``'s lines about the other daemons: (ok, text) each."""
    lines: list[tuple[bool, str]] = []
    mine = set(captured)
    for other in neighbours_:
        state = "streaming" if other.active else "not streaming now"
        record = other.record
        if record is None:
            lines.append((True, (
                f"daemons: slot {other.slot} ({other.plugin}, {state}) also decodes this database; "
                "no cdcd record of it in this signal table (another client, or a cdcd daemon "
                "with another snapshot.signal_table)"
            )))
            continue
        where = f" on {record.host} (pid {record.pid})" if record.host else ""
        lines.append((True, (
            f"daemons: slot {other.slot} ({state}{where}) is another cdcd daemon: publication "
            f"{record.publication}, {len(record.tables)} tables; jobs in the signal table are "
            "addressed to one slot each"
        )))
        theirs = set(record.tables)
        if record.publication == publication and theirs != mine:
            lines.append((False, (
                f"daemons: publication {publication} is also used by the daemon of slot "
                f"{other.slot}, which captures other tables ({_few(theirs - mine) or 'fewer'}); "
                "cdcd makes a publication it created follow its own postgres.tables, so each "
                "would drop the other's tables at start: give each daemon its own "
                "postgres.publication (docs/operations.md, sharding tables across daemons)"
            )))
        both = mine & theirs
        if both:
            lines.append((True, (
                f"daemons: {_few(both)} captured by slot {other.slot} too: both publish its "
                "changes (into the same topics unless their kafka.topic_prefix differ)"
            )))
    return lines


def _few(tables: set[str], shown: int = 3) -> str:
    names = sorted(tables)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def publication_clash(db: SourceDatabase, pg: PostgresConfig, signal_table: str) -> None:
    """Refuse to start on a publication another live daemon uses for other tables.

    cdcd makes a publication it created follow its own ``postgres.tables``:
    starting would drop the other daemon's tables from it, and that daemon
    would silently stop receiving their changes. Raises ``ConfigError``
    (exit 2) naming the other slot; nothing to do without a signal table
    (no records) or without a ``tables`` list (this daemon takes the
    publication as it is).
    """
    if not pg.table_names:
        return
    signals = SignalTable(db, signal_table)
    if not signals.exists():
        return
    tables = db.resolve_tables(pg, exclude=[(signals.schema, signals.table)])
    if db.publication_exists(pg.publication):
        # As the record has them: a partitioned table published per leaf is its leaves.
        tables = published_units(db, pg.publication, tables)
    mine = {format_table(*table) for table in tables}
    for other in other_daemons(signals, pg.slot):
        if other.publication == pg.publication and set(other.tables) != mine:
            raise ConfigError(
                f"publication {pg.publication} is used by the daemon of slot {other.slot}, which "
                f"captures other tables ({_few(set(other.tables) - mine) or 'fewer'}); starting "
                "would drop them from it",
                hint="give this daemon its own postgres.publication (docs/operations.md, sharding "
                f"tables across daemons), or drop slot {other.slot} if that daemon is retired",
            )


def failing_jobs(signals: SignalTable, slot: str) -> list[tuple[str, list[str], str]]:
    """``(id, tables, error)`` of this slot's jobs that failed and are being retried (heals)."""
    rows = signals.db.query(
        f"SELECT id FROM {signals.sql} WHERE status = %s AND progress ? 'error' "
        "AND progress->>'slot' = %s ORDER BY created_at, id",
        (RUNNING, slot),
    )
    out = []
    for (job_id,) in rows:
        job = signals.get(str(job_id))
        if job is not None:
            out.append((job.id, job.tables, str(job.progress.get("error"))))
    return out
