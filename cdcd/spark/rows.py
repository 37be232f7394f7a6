"""The mirror's row tables and what applying a batch reports (pure: pyarrow only).

The working table of a mirrored table is its columns plus the row version
(``_cdcd_lsn``, ``_cdcd_seq``: the change that wrote the row;
:func:`state_schema`); :func:`evolve` moves stored rows to a new layout,
:func:`conform` checks and casts what was read back. :class:`ApplyStats`,
:class:`ApplyResult` and :class:`Event` are what
:func:`cdcd.spark.apply.apply_changes` returns; the side tables' schemas
(held-back changes, recent deletes) are here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.spark.layout import RowLayout, changes_arrow_schema, convert_columns, default_array

META_LSN = "_cdcd_lsn"
META_SEQ = "_cdcd_seq"

Version = tuple[int, int]

# ----------------------------------------------------------------------------- row tables


def state_schema(layout: RowLayout) -> pa.Schema:
    """The mirror's working table: the row columns plus the row versions."""
    return (
        layout.arrow_schema()
        .append(pa.field(META_LSN, pa.int64()))
        .append(pa.field(META_SEQ, pa.int64()))
    )


def empty_rows(layout: RowLayout) -> pa.Table:
    return state_schema(layout).empty_table()


def evolve(
    rows: pa.Table, layout: RowLayout, table: str = "", previous: RowLayout | None = None
) -> pa.Table:
    """``rows`` (a :func:`state_schema` table) with ``layout``'s columns.

    ``previous`` is the layout the rows were written with, when it differs:
    columns then resolve as decoded changes do (:mod:`cdcd.spark.layout`): a
    renamed column keeps its values under its new name, one added since
    holds its Avro default (null without one), a dropped one goes, a changed
    type is converted exactly or refused. Without ``previous`` the rows'
    columns are taken by name, and a missing one gets its default.
    """
    what = f"mirror of {table or 'a table'}"
    for name in (META_LSN, META_SEQ):
        if name not in rows.column_names:
            raise DefiniteError(f"{what}: row versions are missing")
    target = state_schema(layout)
    length = rows.num_rows
    if previous is not None and previous != layout:
        try:
            columns = [rows.column(c.name) for c in previous.columns]
        except KeyError as exc:
            raise DefiniteError(f"{what}: stored rows lack column {exc}") from exc
        arrays = convert_columns(columns, length, previous, layout, what)
    else:
        arrays = []
        for column in layout.columns:
            if column.name not in rows.column_names:
                arrays.append(default_array(column, length))
                continue
            values = rows.column(column.name)
            wanted = column.type.arrow()
            if values.type != wanted:
                try:
                    values = values.cast(wanted)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                    raise DefiniteError(
                        f"{what}: column {column.name!r} changed type from "
                        f"{values.type} to {wanted} and its rows cannot be converted: {exc}",
                        hint="mirror into a new output directory",
                    ) from exc
            arrays.append(values)
    arrays.append(rows.column(META_LSN))
    arrays.append(rows.column(META_SEQ))
    return pa.Table.from_arrays(arrays, schema=target)


def conform(table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """``table`` in exactly ``schema``: its columns selected and cast (Spark's Arrow and
    Delta readers may widen types); a ``DefiniteError`` naming ``what`` when they do not fit."""
    if table.schema.equals(schema):
        return table
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as exc:
        raise DefiniteError(f"{what} do not have the expected columns: {exc}") from exc


def canonical(changes: pa.Table, layout: RowLayout) -> pa.Table:
    """Decoded changes in exactly :func:`changes_arrow_schema` (Spark's Arrow may differ)."""
    return conform(changes, changes_arrow_schema(layout), "decoded changes")


# ----------------------------------------------------------------------------- apply


@dataclass
class ApplyStats:
    applied: int = 0
    duplicates: int = 0
    stale: int = 0
    deleted: int = 0
    truncates: int = 0
    toast_kept: int = 0
    toast_missing: int = 0
    unmatched: int = 0
    held_back: int = 0

    def __add__(self, other: ApplyStats) -> ApplyStats:
        return ApplyStats(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, ...]:
        return (
            self.applied,
            self.duplicates,
            self.stale,
            self.deleted,
            self.truncates,
            self.toast_kept,
            self.toast_missing,
            self.unmatched,
            self.held_back,
        )


@dataclass
class ApplyResult:
    rows: pa.Table
    truncated_at: Version | None
    high_water: dict[int, Version]
    stats: ApplyStats
    #: Changes held back for the next batch (see :func:`apply_changes`), with ``DEFERRALS``.
    pending: pa.Table | None = None
    #: Rows deleted by this batch and the one before (``state_schema`` plus ``AGE``).
    recent_deletes: pa.Table | None = None
    #: With ``history``: what each applied change did, in commit order (:class:`Event`).
    events: list[Event] | None = None


DEFERRALS = "__cdcd_deferrals"
AGE = "__cdcd_age"
#: Batches a key-change create waits for its delete before it is applied without it.
MAX_DEFERRALS = 3
#: Batches a deleted row is kept for a key-change create that arrives later.
RECENT_DELETE_BATCHES = 2


def pending_schema(layout: RowLayout) -> pa.Schema:
    return changes_arrow_schema(layout).append(pa.field(DEFERRALS, pa.int32()))


def recent_schema(layout: RowLayout) -> pa.Schema:
    return state_schema(layout).append(pa.field(AGE, pa.int32()))


def hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    return value


def older(lsn: pa.ChunkedArray, seq: pa.ChunkedArray, version: Version) -> pa.ChunkedArray:
    """Mask of rows whose (lsn, seq) is below ``version``."""
    return pc.or_(
        pc.less(lsn, version[0]),
        pc.and_(pc.equal(lsn, version[0]), pc.less(seq, version[1])),
    )


#: Column of decoded changes (added by :func:`reader_changes`): the key columns of each
#: change's message key, () for a null key, null when unknown.
IDENTITY = "__cdcd_key"


@dataclass(frozen=True)
class Event:
    """What one applied change did to one row, for the history tables.

    ``old_version``/``old_values``: the row it replaced or deleted (its
    (lsn, seq) and columns), None when it made a new row; ``values``: the
    row after it (unchanged TOAST filled in), None for a delete; a truncate
    is ``op="t"`` with ``version`` its own (lsn, seq).
    """

    old_version: Version | None
    old_values: dict[str, Any] | None
    version: Version
    values: dict[str, Any] | None
    op: str
    commit_ts: Any
    #: Rows a batch only inserts (new keys), whole (``op="+"``, ``version`` unused):
    #: the row columns, ``_cdcd_lsn``/``_cdcd_seq``, ``op`` and ``commit_ts``.
    bulk: pa.Table | None = None
