"""History tables (SCD type 2): every version of every row, with its validity (pure, pyarrow only).

Beside a mirrored table's current state, ``cdcd mirror --history`` keeps a
Delta table with one row per *version* of a row: the table's columns plus

* ``__start_lsn`` / ``__end_lsn`` (bigint): the commit LSNs (``cdcd.lsn``)
  of the transaction that made the version and of the one that ended it; a
  version still valid has a null end;
* ``__start_at`` / ``__end_at``: those transactions' commit times;
* ``__op``: the change that made the version (``c``, ``u``, ``r``);
* ``__is_current``: the version is valid now (``__end_lsn`` is null).

So the table as PostgreSQL held it when the transaction with commit LSN
``L`` committed is ``__start_lsn <= L AND (L < __end_lsn OR __end_lsn IS
NULL)``. A delete ends the row's version; a truncate ends every version; a
key change (a delete of the old key and an insert of the new one) ends the
old key's version and starts the new key's. Versions are per transaction:
a row changed twice in one transaction gets one version (the state at the
commit), and a row inserted and deleted in one transaction none.

Two more rules: a re-snapshot (``op=r``) that finds a row unchanged starts no
version; and with a ``track_history_column_list`` (``tracked`` here),
a change to other columns only updates the current version in place.

How a batch becomes history
---------------------------
The mirror's apply step (:func:`cdcd.spark.apply.apply_changes` with
``history=True``) reports what each change did as :class:`Event`\\ s: which
stored row (by its version, the ``_cdcd_lsn``/``_cdcd_seq`` of the change
that wrote it) it replaced or deleted, and the row after it. The history
table keeps those two metadata columns on every version: the current
version of a row carries the same pair as the row in the current-state
table, so a change finds the version it ends by that pair, whether the table
has a key, has none, or changed its key. :func:`history_delta` turns the
events into the versions the batch starts (written whole) and the stored
versions it ends or updates in place (matched by the pair).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cdcd.spark.layout import RowLayout
from cdcd.spark.rows import META_LSN, META_SEQ, Event, Version

__all__ = [
    "END_AT",
    "END_LSN",
    "HISTORY_COLUMNS",
    "IS_CURRENT",
    "OP",
    "START_AT",
    "START_LSN",
    "HistoryDelta",
    "history_delta",
    "history_schema",
    "valid_at",
]

START_LSN = "__start_lsn"
END_LSN = "__end_lsn"
START_AT = "__start_at"
END_AT = "__end_at"
OP = "__op"
IS_CURRENT = "__is_current"

_TIMESTAMP = pa.timestamp("us", tz="UTC")
#: The history columns after the table's own, in order.
HISTORY_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    (START_LSN, pa.int64()),
    (END_LSN, pa.int64()),
    (START_AT, _TIMESTAMP),
    (END_AT, _TIMESTAMP),
    (OP, pa.string()),
    (IS_CURRENT, pa.bool_()),
    (META_LSN, pa.int64()),
    (META_SEQ, pa.int64()),
)


def history_schema(layout: RowLayout) -> pa.Schema:
    """A history table: the table's columns, then :data:`HISTORY_COLUMNS`."""
    schema = layout.arrow_schema()
    for name, kind in HISTORY_COLUMNS:
        schema = schema.append(pa.field(name, kind))
    return schema


def valid_at(history: pa.Table, lsn: int) -> pa.Table:
    """The versions valid when the transaction with commit LSN ``lsn`` committed."""
    import pyarrow.compute as pc

    started = pc.less_equal(history.column(START_LSN), lsn)
    not_ended = pc.or_kleene(
        pc.is_null(history.column(END_LSN)), pc.greater(history.column(END_LSN), lsn)
    )
    return history.filter(pc.and_kleene(started, not_ended))


@dataclass
class _Version:
    values: dict[str, Any]
    version: Version  # the (lsn, seq) of the change that last wrote it
    start: int | None = None
    start_at: Any = None
    op: str | None = None
    end: int | None = None
    end_at: Any = None


@dataclass
class HistoryDelta:
    """What a batch does to a history table."""

    #: New versions, ended within the batch or current (``history_schema`` rows).
    inserts: list[dict[str, Any]] = field(default_factory=list)
    #: Stored versions the batch ends or updates in place, by the version they
    #: were stored with: their columns after the batch (``history_schema`` rows
    #: without the start columns).
    updates: dict[Version, dict[str, Any]] = field(default_factory=dict)
    #: The batch's first truncate (version, commit time): it ends every stored
    #: version not in ``updates`` that is older than it.
    truncate: tuple[Version, Any] | None = None
    #: Current versions of rows the batch only inserted, columnar (``history_schema``).
    bulk: list[pa.Table] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.inserts and not self.updates and self.truncate is None and not self.bulk


def _in_place(event: Event, tracked: frozenset[str] | None) -> bool:
    """The change keeps the row's version: an unchanged re-snapshot, or (with tracked
    columns) a change to untracked columns only."""
    old, new = event.old_values, event.values
    if old is None or new is None:
        return False
    if event.op == "r" and old == new:
        return True
    if tracked is not None and event.op in ("u", "r"):
        return all(old.get(c) == new.get(c) for c in tracked if c in new)
    return False


def history_delta(events: Iterable[Event], tracked: Sequence[str] | None = None) -> HistoryDelta:
    """The versions ``events`` (one batch, commit order) start, end and update."""
    tracked_set = frozenset(tracked) if tracked is not None else None
    delta = HistoryDelta()
    opened: dict[Version, _Version] = {}  # started in this batch, still valid
    stored: dict[Version, _Version] = {}  # stored versions touched, by the version stored
    current: dict[Version, Version] = {}  # a touched stored version's row version now -> stored

    def end_opened(version: Version, lsn: int, at: Any) -> None:
        ended = opened.pop(version)
        assert ended.start is not None
        if ended.start < lsn:  # a version born and ended in one transaction never existed
            ended.end, ended.end_at = lsn, at
            delta.inserts.append(_row(ended))

    def stored_version(version: Version, values: dict[str, Any] | None) -> Version:
        """The stored version (by the version it was stored with) whose row is now at
        ``version``; no longer tracked as current."""
        origin = current.pop(version, version)
        if origin not in stored:
            assert values is not None
            stored[origin] = _Version(dict(values), version)
        return origin

    bulks: list[pa.Table] = []
    for event in events:
        if event.bulk is not None:
            bulks.append(event.bulk)
            continue
        if bulks:
            # Rare (a batch that also changes rows it bulk-inserted): row by row.
            for bulk in bulks:
                for row in bulk.to_pylist():
                    version = (row.pop(META_LSN), row.pop(META_SEQ))
                    op, at = row.pop("op"), row.pop("commit_ts")
                    opened[version] = _Version(row, version, version[0], at, op)
            bulks = []
        lsn = event.version[0]
        if event.op == "t":
            if delta.truncate is None:
                delta.truncate = (event.version, event.commit_ts)
            for version in [v for v in opened if v < event.version]:
                end_opened(version, lsn, event.commit_ts)
            for version in [v for v in current if v < event.version]:
                ended = stored[current.pop(version)]
                ended.end, ended.end_at = lsn, event.commit_ts
            continue
        old = event.old_version
        if old is not None:
            if event.values is not None and _in_place(event, tracked_set):
                if old in opened:
                    moved = opened.pop(old)
                    moved.values, moved.version = dict(event.values), event.version
                    opened[event.version] = moved
                else:
                    origin = stored_version(old, event.old_values)
                    kept = stored[origin]
                    kept.values, kept.version = dict(event.values), event.version
                    current[event.version] = origin
                continue
            if old in opened:
                end_opened(old, lsn, event.commit_ts)
            else:
                ended = stored[stored_version(old, event.old_values)]
                ended.end, ended.end_at = lsn, event.commit_ts
        if event.values is not None:
            opened[event.version] = _Version(
                dict(event.values), event.version, lsn, event.commit_ts, event.op
            )
    for version in list(opened):
        delta.inserts.append(_row(opened.pop(version)))
    delta.updates = {origin: _row(v) for origin, v in stored.items()}
    delta.bulk = [_bulk_rows(bulk) for bulk in bulks]
    return delta


def _bulk_rows(bulk: pa.Table) -> pa.Table:
    """Inserted rows (columns, versions, op, commit_ts) as current versions."""
    count = bulk.num_rows
    rows = bulk.drop_columns([META_LSN, META_SEQ, "op", "commit_ts"])
    columns = {
        START_LSN: bulk.column(META_LSN),
        END_LSN: pa.nulls(count, pa.int64()),
        START_AT: bulk.column("commit_ts"),
        END_AT: pa.nulls(count, _TIMESTAMP),
        OP: bulk.column("op"),
        IS_CURRENT: pa.array([True] * count, pa.bool_()),
        META_LSN: bulk.column(META_LSN),
        META_SEQ: bulk.column(META_SEQ),
    }
    for name, kind in HISTORY_COLUMNS:
        rows = rows.append_column(pa.field(name, kind), columns[name].cast(kind))
    return rows


def _row(version: _Version) -> dict[str, Any]:
    return {
        **version.values,
        START_LSN: version.start,
        END_LSN: version.end,
        START_AT: version.start_at,
        END_AT: version.end_at,
        OP: version.op,
        IS_CURRENT: version.end is None,
        META_LSN: version.version[0],
        META_SEQ: version.version[1],
    }
