"""Applying decoded change batches to a table's rows (pure: pyarrow only, no Spark, no files).

What a batch does to a table (SPEC §8)
--------------------------------------
Changes are applied in (``cdcd.lsn``, ``cdcd.seq``) order, which is commit
order: inserts, snapshot reads and updates are upserts by the table's key
(the replica identity), deletes remove the row, an update's
``unchanged_toast`` columns keep the value the row had, and a truncate
empties the table. The mirror follows the newest schema of the table, by
the resolution rules of :mod:`cdcd.spark.layout`: a column added upstream
appears, holding its Avro default in rows written before it existed (the
constant of ``ADD COLUMN ... DEFAULT``, as PostgreSQL returns it; null
without one), a renamed column keeps its values under its new name, a
dropped one disappears, and a changed type is converted where that is exact.
A table dropped and recreated under the same name arrives as a truncate
followed by the new table's changes; rows older than a truncate are removed
before anything is converted, so the old table's columns never have to fit
the new one's. Rows a re-snapshot publishes (``op=r``, after a rewrite)
are upserts like any other: they overwrite what the stream held.

Why every row carries a version
-------------------------------
A batch is a set of per-partition offset ranges, and Kafka orders records
only within a partition. Rows of one key always share a partition, but a
truncate has no key and lands on any partition, so a batch may hold a
truncate while changes committed *before* it, on other partitions, arrive
only in the next batch -- or changes committed after it arrive first. Each
mirrored row therefore keeps the (lsn, seq) of the change that wrote it
(the metadata columns ``_cdcd_lsn`` and ``_cdcd_seq``), and each table the
version of its last truncate:

* a truncate at T removes the rows older than T and nothing newer;
* a change older than the last truncate is ignored;
* a change not newer than its row's version is ignored (stale or repeated).

Duplicates: after a daemon crash the topics repeat a stretch of changes with
the same (lsn, seq) (SPEC §7). Within a batch they collapse to one. Across
batches, a keyed change whose version is not above the highest version
already applied *from the same partition* is a repeat -- the idempotent
producer appends to a partition in production order, so a version below
that high-water mark was either applied or repeats one that was. That also
covers a deleted row's repeated insert, which the per-row version cannot (the
row is gone). Truncates need no such rule: applying one twice changes
nothing.

A primary key change is published as delete(old key), tombstone,
create(new key) at seq, seq+1, seq+2 of one transaction, on two partitions,
and the create's unchanged TOAST columns can only come from the deleted row.
When a batch boundary splits the pair, the deleted rows of the last two
batches are kept for a create that comes later, and a create that comes first
is held back (with what follows it for its key) until its delete arrives, at
most three batches.

Tables without a key (no primary key nor identity index) are matched on the
whole old row (``REPLICA IDENTITY FULL``); their changes travel with a null
key on random partitions, so across batches only exact repeats of a row's
insert are recognised.

``rows`` here are only the stored rows a batch can touch (its keys), not
the whole table. The I/O around it -- the Delta tables, one MERGE per table
and batch, the Spark job -- is :mod:`cdcd.spark.mirror`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.naming import ORIGINAL_NAME_ATTRIBUTE
from cdcd.spark.decode import NativeChanges, SchemaLookup, newest_version
from cdcd.spark.layout import (
    RowLayout,
    changes_arrow_schema,
    convert_columns,
    default_array,
    row_schema_of,
    to_reader,
)

__all__ = [
    "AGE",
    "DEFERRALS",
    "META_LSN",
    "META_SEQ",
    "ApplyResult",
    "ApplyStats",
    "Stored",
    "TableState",
    "Version",
    "apply_batch",
    "apply_changes",
    "distinct_identities",
    "empty_rows",
    "evolve",
    "reader_changes",
    "state_schema",
    "table_dir_name",
]

log = logging.getLogger(__name__)

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


def _canonical(changes: pa.Table, layout: RowLayout) -> pa.Table:
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


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _older(lsn: pa.ChunkedArray, seq: pa.ChunkedArray, version: Version) -> pa.ChunkedArray:
    """Mask of rows whose (lsn, seq) is below ``version``."""
    return pc.or_(
        pc.less(lsn, version[0]),
        pc.and_(pc.equal(lsn, version[0]), pc.less(seq, version[1])),
    )


def _find_rows(
    rows: pa.Table, key_names: Sequence[str], keys: list[tuple[Any, ...]]
) -> dict[tuple[Any, ...], int]:
    """Row index of each key present in ``rows``."""
    if not keys or rows.num_rows == 0:
        return {}
    wanted = pa.table(
        {
            name: pa.array([key[i] for key in keys], rows.schema.field(name).type)
            for i, name in enumerate(key_names)
        }
    )
    indexed = rows.select(list(key_names)).append_column(
        "__cdcd_row", pa.array(range(rows.num_rows), pa.int64())
    )
    try:
        joined = indexed.join(wanted, keys=list(key_names), join_type="inner")
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        # Key types the hash join does not support (e.g. arrays): scan.
        wanted_set = set(keys)
        columns = [rows.column(name).to_pylist() for name in key_names]
        return {
            key: i
            for i, key in enumerate(zip(*(map(_hashable, c) for c in columns), strict=True))
            if key in wanted_set
        }
    found: dict[tuple[Any, ...], int] = {}
    key_columns = [joined.column(name).to_pylist() for name in key_names]
    for key, index in zip(
        zip(*key_columns, strict=True), joined.column("__cdcd_row").to_pylist(), strict=True
    ):
        found[tuple(_hashable(v) for v in key)] = index
    return found


def apply_changes(
    rows: pa.Table,
    changes: pa.Table,
    layout: RowLayout,
    *,
    truncated_at: Version | None = None,
    high_water: Mapping[int, Version] | None = None,
    pending: pa.Table | None = None,
    recent_deletes: pa.Table | None = None,
    history: bool = False,
) -> ApplyResult:
    """Apply decoded changes (:func:`cdcd.spark.layout.changes_arrow_schema`) to ``rows``.

    ``history``: also return what each change did (``events``), changes
    before a truncate of the batch included (for the history tables).

    ``rows`` is the mirror's working table (:func:`state_schema`; see
    :func:`evolve`). Returns the new rows, truncate version and per-partition
    high-water marks. Pure: nothing is written.

    A primary key change is published as delete(old key), tombstone and
    create(new key) at seq, seq+1, seq+2 of one transaction, on the two keys'
    partitions; the create's unchanged TOAST columns can only come from the
    deleted row. When a batch splits the pair, the create (and what follows
    it for its key) is returned in ``pending`` to be passed to the next
    batch, for at most ``MAX_DEFERRALS`` batches, and deleted rows are
    returned in ``recent_deletes`` for a create that comes after its delete.
    """
    rows = evolve(rows, layout)
    identities = _identities(changes, layout)
    changes = _canonical(changes, layout)
    incoming = changes.num_rows
    if pending is not None and pending.num_rows:
        pending = pending.select(pending_schema(layout).names).cast(pending_schema(layout))
        changes = pa.concat_tables([changes, pending.drop_columns([DEFERRALS])])
        deferrals_in = [0] * incoming + pending.column(DEFERRALS).to_pylist()
        identities += [layout.key_names] * pending.num_rows
    else:
        deferrals_in = [0] * incoming
    stats = ApplyStats()
    old_high_water = dict(high_water or {})
    new_high_water = dict(old_high_water)

    meta = changes.select(["partition", "lsn", "seq", "op"]).to_pydict()
    partitions, lsns, seqs, ops = meta["partition"], meta["lsn"], meta["seq"], meta["op"]
    seen: set[Version] = set()
    kept: list[int] = []
    for i in range(changes.num_rows):
        version = (lsns[i], seqs[i])
        op = ops[i]
        if op not in ("c", "r", "u", "d", "t"):
            raise DefiniteError(
                f"unknown change operation {op!r} at (lsn {lsns[i]}, seq {seqs[i]})"
            )
        # Keyed changes only (null keys land on any partition); held-back
        # changes passed the check before.
        if identities[i] and op != "t" and i < incoming:
            partition = partitions[i]
            mark = old_high_water.get(partition)
            if mark is not None and version <= mark:
                stats.duplicates += 1
                continue
            if partition not in new_high_water or version > new_high_water[partition]:
                new_high_water[partition] = version
        if version in seen:
            stats.duplicates += 1
            continue
        seen.add(version)
        kept.append(i)
    kept.sort(key=lambda i: (lsns[i], seqs[i]))

    recent = _recent_deletes(recent_deletes, layout)
    deleted: dict[Version, dict[str, Any]] = {}
    deferred: list[int] = []
    events: list[Event] | None = [] if history else None

    def apply_in_order(order: list[int]) -> None:
        # Each change is matched by the identity it was written with (a key
        # added, grown or dropped changes it from one change to the next), in
        # runs of consecutive changes with the same identity.
        nonlocal rows
        for identity, run in _runs(order, identities, layout):
            subset = changes.take(pa.array(run, pa.int64()))
            if identity:
                rows, run_deleted, held = _apply_keyed(
                    rows,
                    subset,
                    layout.with_key(identity),
                    stats,
                    recent,
                    [deferrals_in[i] for i in run],
                    events,
                )
                deleted.update(run_deleted)
                deferred.extend(run[j] for j in held)
            else:
                rows = _apply_keyless(rows, subset, layout, stats, events)

    truncate = truncated_at
    if events is None:
        # Truncates first: they bound everything else.
        for i in kept:
            if ops[i] == "t":
                stats.truncates += 1
                version = (lsns[i], seqs[i])
                if truncate is None or version > truncate:
                    truncate = version
        if truncate is not None and truncate != truncated_at and rows.num_rows:
            rows = rows.filter(
                pc.invert(_older(rows.column(META_LSN), rows.column(META_SEQ), truncate))
            )
        order = []
        for i in kept:
            if ops[i] == "t":
                continue
            if truncate is not None and (lsns[i], seqs[i]) < truncate:
                stats.stale += 1
                continue
            order.append(i)
        apply_in_order(order)
    else:
        # With history, the changes before a truncate of the batch made
        # versions too: the batch is applied in commit order, truncates in turn.
        stamps = changes.column("commit_ts").to_pylist()
        segment: list[int] = []
        for i in kept:
            version = (lsns[i], seqs[i])
            if ops[i] == "t":
                stats.truncates += 1
                if truncate is not None and version <= truncate:
                    continue
                apply_in_order(segment)
                segment = []
                truncate = version
                if rows.num_rows:
                    rows = rows.filter(
                        pc.invert(_older(rows.column(META_LSN), rows.column(META_SEQ), version))
                    )
                events.append(Event(None, None, version, None, "t", stamps[i]))
            elif truncated_at is not None and version < truncated_at:
                stats.stale += 1
            else:
                segment.append(i)
        apply_in_order(segment)
    stats.held_back = len(deferred)
    held_back = None
    if deferred:
        held_back = changes.take(pa.array(deferred, pa.int64())).append_column(
            DEFERRALS, pa.array([deferrals_in[i] + 1 for i in deferred], pa.int32())
        )
    return ApplyResult(
        rows,
        truncate,
        new_high_water,
        stats,
        held_back,
        _aged_deletes(recent_deletes, deleted, layout),
        events,
    )


#: Column of decoded changes (added by :func:`reader_changes`): the key columns of each
#: change's message key, () for a null key, null when unknown.
IDENTITY = "__cdcd_key"


_SEPARATOR = "\x00"  # not in PostgreSQL identifiers


def distinct_identities(changes: pa.Table) -> set[tuple[str, ...] | None]:
    """The identities (column ``IDENTITY``) the changes were written with."""
    if IDENTITY not in changes.column_names:
        return {None}
    joined = pc.binary_join(changes.column(IDENTITY), _SEPARATOR)
    return {_split(text) for text in pc.unique(joined).to_pylist()}


def _split(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(text.split(_SEPARATOR)) if text else ()


def _identities(changes: pa.Table, layout: RowLayout) -> list[tuple[str, ...]]:
    """Each change's identity (its key columns; () for none), the layout's when unknown."""
    if IDENTITY not in changes.column_names or not changes.num_rows:
        return [layout.key_names] * changes.num_rows
    joined = pc.binary_join(changes.column(IDENTITY), _SEPARATOR).combine_chunks()
    encoded = pc.dictionary_encode(joined)
    known = [_split(text) for text in encoded.dictionary.to_pylist()]
    values = [layout.key_names if key is None else key for key in known]
    return [
        layout.key_names if code is None else values[code] for code in encoded.indices.to_pylist()
    ]


def _runs(
    order: Sequence[int], identities: Sequence[tuple[str, ...]], layout: RowLayout
) -> list[tuple[tuple[str, ...], list[int]]]:
    """``order`` cut into runs of one identity. An identity naming a column the layout
    lacks (a key column dropped since) cannot match by key: its changes match whole rows."""
    names = set(layout.names)
    runs: list[tuple[tuple[str, ...], list[int]]] = []
    for i in order:
        identity = identities[i]
        if not set(identity) <= names:
            identity = ()
        if runs and runs[-1][0] == identity:
            runs[-1][1].append(i)
        else:
            runs.append((identity, [i]))
    return runs


def _recent_deletes(table: pa.Table | None, layout: RowLayout) -> dict[Version, dict[str, Any]]:
    if table is None or table.num_rows == 0:
        return {}
    names = layout.names
    out = {}
    for row in evolve(table.drop_columns([AGE]), layout).to_pylist():
        out[(row[META_LSN], row[META_SEQ])] = {name: row[name] for name in names}
    return out


def _aged_deletes(
    previous: pa.Table | None, deleted: dict[Version, dict[str, Any]], layout: RowLayout
) -> pa.Table | None:
    """This batch's deleted rows (age 0) and the previous ones still young enough."""
    schema = recent_schema(layout)
    parts = []
    if previous is not None and previous.num_rows:
        older = previous.filter(pc.less(previous.column(AGE), RECENT_DELETE_BATCHES - 1))
        if older.num_rows:
            aged = evolve(older.drop_columns([AGE]), layout).append_column(
                AGE, pc.add(older.column(AGE), 1).cast(pa.int32())
            )
            parts.append(aged)
    if deleted:
        parts.append(
            pa.Table.from_pylist(
                [
                    {**values, META_LSN: v[0], META_SEQ: v[1], AGE: 0}
                    for v, values in deleted.items()
                ],
                schema=schema,
            )
        )
    return pa.concat_tables(parts) if parts else None


def _change_records(changes: pa.Table) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = changes.select(
        ["lsn", "seq", "op", "commit_ts", "unchanged_toast", "before", "after"]
    ).to_pylist()
    return records


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


def _insert_events(
    events: list[Event], inserted: pa.Table, changes: pa.Table, layout: RowLayout
) -> None:
    """One bulk event for rows a batch only inserts: kept columnar (a first build)."""
    bulk = inserted.append_column("op", changes.column("op")).append_column(
        "commit_ts", changes.column("commit_ts")
    )
    events.append(Event(None, None, (-1, -1), None, "+", None, bulk))


def _new_rows_only(rows: pa.Table, changes: pa.Table, layout: RowLayout) -> pa.Table | None:
    """The rows ``changes`` add, if all they do is insert keys not stored yet (else None).

    The common case of a first build or an insert-heavy batch, computed on
    whole columns: no two changes share a key, none exists in ``rows``,
    each is an insert or snapshot read with its row image, and none keeps
    an unchanged TOAST value (which would need a partner).
    """
    if not changes.num_rows:
        return None
    ops = changes.column("op")
    after = changes.column("after")
    if not pc.all(pc.is_in(ops, pa.array(["c", "r"]))).as_py() or after.null_count:
        return None
    toast = pc.list_value_length(changes.column("unchanged_toast"))
    if pc.max(pc.fill_null(toast, 0)).as_py():
        return None
    key_names = layout.key_names
    keys = pa.table({name: pc.struct_field(after, name) for name in key_names})
    if any(pa.types.is_nested(f.type) for f in keys.schema):
        return None  # arrays as keys: the general path
    if keys.group_by(list(key_names)).aggregate([]).num_rows != changes.num_rows:
        return None
    if rows.num_rows:
        stored = rows.select(list(key_names))
        if stored.join(keys, keys=list(key_names), join_type="inner").num_rows:
            return None
    columns = [pc.struct_field(after, name) for name in layout.names]
    columns += [changes.column("lsn"), changes.column("seq")]
    return pa.Table.from_arrays(columns, schema=rows.schema)


def _apply_keyed(
    rows: pa.Table,
    changes: pa.Table,
    layout: RowLayout,
    stats: ApplyStats,
    recent: Mapping[Version, dict[str, Any]],
    deferrals: Sequence[int],
    events: list[Event] | None = None,
) -> tuple[pa.Table, dict[Version, dict[str, Any]], list[int]]:
    """Fold the changes (in version order) into per-key states, then rebuild the rows.

    Returns the rows, the rows this batch deleted (by delete version) and the
    positions of the changes held back (see :func:`apply_changes`). ``events``:
    appended with what each applied change did to which row (:class:`Event`).
    """
    inserted = _new_rows_only(rows, changes, layout)
    if inserted is not None:
        stats.applied += inserted.num_rows
        if events is not None:
            _insert_events(events, inserted, changes, layout)
        return pa.concat_tables([rows, inserted]), {}, []
    key_names = layout.key_names
    names = layout.names
    records = _change_records(changes)
    keys: list[tuple[Any, ...]] = []
    for record in records:
        image = record["after"] if record["op"] != "d" else record["before"]
        if image is None:
            raise DefiniteError(
                f"change at (lsn {record['lsn']}, seq {record['seq']}) op {record['op']!r} "
                "has no row image"
            )
        keys.append(tuple(_hashable(image[k]) for k in key_names))

    found = _find_rows(rows, key_names, list(dict.fromkeys(keys)))
    current_rows = (
        rows.take(pa.array(list(found.values()), pa.int64())).to_pylist() if found else []
    )
    states: dict[tuple[Any, ...], tuple[dict[str, Any] | None, Version | None]] = {
        key: ({name: row[name] for name in names}, (row[META_LSN], row[META_SEQ]))
        for key, row in zip(found, current_rows, strict=True)
    }
    deleted: dict[Version, dict[str, Any]] = {}
    held_keys: set[tuple[Any, ...]] = set()
    held: list[int] = []
    for position, (key, record) in enumerate(zip(keys, records, strict=True)):
        if key in held_keys:
            held.append(position)
            continue
        values, version = states.get(key, (None, None))
        change_version = (record["lsn"], record["seq"])
        if version is not None and change_version <= version:
            stats.stale += 1
            continue
        if version is None and record["op"] in ("u", "d"):
            # The mirror never held this row: reported (a delete removes
            # nothing, an update is kept as an insert).
            stats.unmatched += 1
        new = dict(record["after"]) if record["op"] != "d" else None
        toast = [c for c in record["unchanged_toast"] or () if new is not None and c in new]
        previous = values
        if toast and previous is None and record["op"] == "c":
            partner = (change_version[0], change_version[1] - 2)
            previous = deleted.get(partner) or recent.get(partner)
            if previous is None and deferrals[position] < MAX_DEFERRALS:
                held_keys.add(key)
                held.append(position)
                continue
        stats.applied += 1
        if new is None:
            stats.deleted += 1
            if values is not None:
                deleted[change_version] = values
            states[key] = (None, change_version)
            if events is not None and values is not None:
                events.append(
                    Event(version, values, change_version, None, "d", record["commit_ts"])
                )
            continue
        for column in toast:
            if previous is not None:
                new[column] = previous.get(column)
                stats.toast_kept += 1
            else:
                stats.toast_missing += 1
        states[key] = (new, change_version)
        if events is not None:
            events.append(
                Event(
                    version if values is not None else None,
                    values,
                    change_version,
                    new,
                    record["op"],
                    record["commit_ts"],
                )
            )

    written = [
        {**values, META_LSN: version[0], META_SEQ: version[1]}
        for values, version in states.values()
        if values is not None and version is not None
    ]
    base = rows
    if found:
        mask = [True] * rows.num_rows
        for index in found.values():
            mask[index] = False
        base = rows.filter(pa.array(mask, pa.bool_()))
    if written:
        base = pa.concat_tables([base, pa.Table.from_pylist(written, schema=rows.schema)])
    return base, deleted, held


def _apply_keyless(
    rows: pa.Table,
    changes: pa.Table,
    layout: RowLayout,
    stats: ApplyStats,
    events: list[Event] | None = None,
) -> pa.Table:
    names = layout.names
    records = _change_records(changes)
    existing = rows.to_pylist()
    versions = {(r[META_LSN], r[META_SEQ]) for r in existing}
    live: list[dict[str, Any] | None] = list(existing)
    for record in records:
        change_version = (record["lsn"], record["seq"])
        if record["op"] in ("c", "r"):
            if change_version in versions:
                stats.duplicates += 1
                continue
            stats.applied += 1
            versions.add(change_version)
            live.append(
                {**record["after"], META_LSN: change_version[0], META_SEQ: change_version[1]}
            )
            if events is not None:
                events.append(
                    Event(None, None, change_version, record["after"], record["op"],
                          record["commit_ts"])
                )  # fmt: skip
            continue
        before = record["before"]
        match = None
        if before is not None:
            for index, row in enumerate(live):
                if row is not None and all(row[n] == before[n] for n in names):
                    match = index
                    break
        if match is None:
            stats.unmatched += 1
            continue
        matched = live[match]
        assert matched is not None
        if (matched[META_LSN], matched[META_SEQ]) >= change_version:
            stats.stale += 1
            continue
        stats.applied += 1
        old_version = (matched[META_LSN], matched[META_SEQ])
        old_values = {n: matched[n] for n in names}
        if record["op"] == "d":
            stats.deleted += 1
            live[match] = None
            if events is not None:
                events.append(
                    Event(old_version, old_values, change_version, None, "d", record["commit_ts"])
                )
            continue
        new = dict(record["after"])
        for column in record["unchanged_toast"] or ():
            if column in new:
                new[column] = matched.get(column)
                stats.toast_kept += 1
        live[match] = {**new, META_LSN: change_version[0], META_SEQ: change_version[1]}
        versions.add(change_version)
        if events is not None:
            events.append(
                Event(old_version, old_values, change_version, new, record["op"],
                      record["commit_ts"])
            )  # fmt: skip
    return pa.Table.from_pylist([r for r in live if r is not None], schema=rows.schema)


# ----------------------------------------------------------------------------- table state


def table_dir_name(schema: str, table: str) -> str:
    """``<schema>.<table>`` made safe as one directory name (see the module docstring)."""

    def escape(part: str) -> str:
        part = part.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")
        return "%2E" + part[1:] if part.startswith(".") else part

    return f"{escape(schema)}.{escape(table)}"


@dataclass
class TableState:
    """What each mirror commit records of its table (commit metadata ``cdcd.mirror``)."""

    topic: str
    schema: str
    table: str
    envelope: dict[str, Any]  # the reader schema the rows follow
    schema_version: Version
    truncated_at: Version | None = None
    high_water: dict[int, Version] = field(default_factory=dict)
    #: The key columns (PostgreSQL names) of the newest change's message key; () for none.
    key: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def dir_name(self) -> str:
        return table_dir_name(self.schema, self.table)

    @property
    def layout(self) -> RowLayout:
        return RowLayout.from_envelope(self.envelope, self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "schema": self.schema,
            "table": self.table,
            "envelope": self.envelope,
            "schema_version": list(self.schema_version),
            "truncated_at": list(self.truncated_at) if self.truncated_at is not None else None,
            "high_water": {str(p): list(v) for p, v in sorted(self.high_water.items())},
            "key": list(self.key),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TableState:
        truncated = data.get("truncated_at")
        return cls(
            topic=data["topic"],
            schema=data["schema"],
            table=data["table"],
            envelope=data["envelope"],
            schema_version=(int(data["schema_version"][0]), int(data["schema_version"][1])),
            truncated_at=(int(truncated[0]), int(truncated[1])) if truncated else None,
            high_water={
                int(p): (int(v[0]), int(v[1])) for p, v in data.get("high_water", {}).items()
            },
            key=tuple(data["key"]) if "key" in data else _required_columns(data["envelope"]),
        )


def _required_columns(envelope: Mapping[str, Any]) -> tuple[str, ...]:
    """The key of a state recorded before keys were recorded: its non-union columns
    (what older mirrors took for the key; the next keyed change records the real one)."""
    return tuple(
        str(f.get(ORIGINAL_NAME_ATTRIBUTE, f["name"]))
        for f in row_schema_of(envelope)["fields"]
        if not isinstance(f["type"], list)
    )


# ----------------------------------------------------------------------------- one batch of one table


@dataclass
class Stored:
    """What the mirror holds of a table between batches, in the layout it was written with."""

    rows: pa.Table  # state_schema
    pending: pa.Table | None = None  # pending_schema: held-back changes
    recent_deletes: pa.Table | None = None  # recent_schema

    @classmethod
    def empty(cls, layout: RowLayout) -> Stored:
        return cls(empty_rows(layout))


def _version_mask(
    lsn: pa.ChunkedArray | pa.Array, seq: pa.ChunkedArray | pa.Array, version: Version
) -> pa.ChunkedArray:
    """Mask of rows whose (lsn, seq) is at or above ``version``."""
    return pc.invert(_older(lsn, seq, version))


def _newest_truncate(natives: Sequence[NativeChanges], since: Version | None) -> Version | None:
    """The highest (lsn, seq) of a truncate in ``natives``, or ``since`` if higher."""
    newest = since
    for native in natives:
        changes = native.changes
        truncates = changes.filter(pc.equal(changes.column("op"), "t"))
        if truncates.num_rows:
            version = newest_version(truncates)
            if newest is None or version > newest:
                newest = version
    return newest


def reader_changes(
    topic: str,
    existing: TableState | None,
    natives: Sequence[NativeChanges],
    schema_of: SchemaLookup,
    keep_truncated: bool = False,
) -> tuple[TableState, pa.Table, int]:
    """The table's state with its newest schema and key, the batch's changes in that
    layout (plus the column ``IDENTITY``: each change's key columns), and how many
    changes were dropped as older than a truncate.

    Newest: the writer schema of the change with the highest (lsn, seq), in
    this batch or applied before (a replay may bring older schemas). Changes
    older than the table's newest truncate (in this batch or before) are
    dropped before they are converted: after ``DROP TABLE`` and ``CREATE
    TABLE`` the old table's changes need not fit the new table's columns.
    """
    candidates = [(newest_version(n.changes), n.header) for n in natives if n.changes.num_rows]
    version, header = max(candidates)
    envelope: Mapping[str, Any] = schema_of(header)
    # The key likewise: the message key of the newest change that has one
    # (truncates say nothing about it).
    keys = [
        (newest_version(n.changes), n.identity)
        for n in natives
        if n.changes.num_rows and n.identity is not None
    ]
    key_version, key = max(keys) if keys else ((-1, -1), None)
    if existing is not None and existing.schema_version > version:
        envelope, version = existing.envelope, existing.schema_version
    if existing is not None and (key is None or existing.schema_version > key_version):
        key = existing.key
    if existing is None:
        first = next(n for n in natives if n.changes.num_rows).changes.slice(0, 1).to_pylist()[0]
        existing = TableState(
            topic=topic,
            schema=first["source_schema"],
            table=first["source_table"],
            envelope=dict(envelope),
            schema_version=version,
        )
    shape = RowLayout.from_envelope(envelope)
    if key is None or not set(key) <= set(shape.names):
        key = ()
    state = replace(existing, envelope=dict(envelope), schema_version=version, key=tuple(key))
    reader = state.layout
    # With history (``keep_truncated``), changes before a truncate of this
    # batch are kept: they made versions too.
    truncate = (
        existing.truncated_at
        if keep_truncated
        else _newest_truncate(natives, existing.truncated_at)
    )
    parts = []
    dropped = 0
    for native in natives:
        changes = native.changes
        if truncate is not None and changes.num_rows:
            kept = changes.filter(
                _version_mask(changes.column("lsn"), changes.column("seq"), truncate)
            )
            dropped += changes.num_rows - kept.num_rows
            changes = kept
        converted = to_reader(changes, native.layout, reader, topic)
        identity = pa.array(
            [None if native.identity is None else list(native.identity)] * converted.num_rows,
            pa.list_(pa.string()),
        )
        parts.append(converted.append_column(IDENTITY, identity))
    return state, pa.concat_tables(parts), dropped


def _since(table: pa.Table | None, version: Version | None, lsn: str, seq: str) -> pa.Table | None:
    if table is None or version is None or not table.num_rows:
        return table
    return table.filter(_version_mask(table.column(lsn), table.column(seq), version))


def apply_batch(
    state: TableState,
    previous: RowLayout | None,
    stored: Stored,
    changes: pa.Table,
    dropped: int = 0,
    history: bool = False,
) -> tuple[TableState, ApplyResult]:
    """Apply one batch of a table: ``changes`` (from :func:`reader_changes`) to ``stored``.

    ``previous`` is the layout ``stored`` was written with (None: the
    table is new, or its layout is ``state``'s). Rows older than the batch's
    newest truncate are dropped before the rest moves to the new layout
    (:func:`evolve`); ``dropped`` changes (older than a truncate) count as
    stale. Returns the new state (not yet stored) and what was applied.
    ``history``: report what each change did (``ApplyResult.events``); the
    rows a truncate of the batch removes are then kept until it comes.
    """
    if history:
        try:
            return _apply_batch(
                state, previous, stored, changes, dropped, history=True, keep_truncated=True
            )
        except DefiniteError as exc:
            # Rows before a DROP TABLE + CREATE TABLE need not fit the new
            # table: its history then starts at the truncate.
            log.warning("%s: history of the rows before a truncate left out: %s", state.name, exc)
    return _apply_batch(state, previous, stored, changes, dropped, history=history)


def _apply_batch(
    state: TableState,
    previous: RowLayout | None,
    stored: Stored,
    changes: pa.Table,
    dropped: int,
    *,
    history: bool,
    keep_truncated: bool = False,
) -> tuple[TableState, ApplyResult]:
    layout = state.layout
    truncate = state.truncated_at
    ops = changes.column("op")
    truncates = changes.filter(pc.equal(ops, "t"))
    if truncates.num_rows:
        version = newest_version(truncates)
        if truncate is None or version > truncate:
            truncate = version
    kept_since = state.truncated_at if keep_truncated else truncate
    rows = _since(stored.rows, kept_since, META_LSN, META_SEQ)
    assert rows is not None
    pending = _since(stored.pending, truncate, "lsn", "seq")
    recent = _since(stored.recent_deletes, truncate, META_LSN, META_SEQ)
    source = previous if previous is not None else layout
    rows = evolve(rows, layout, state.name, source)
    if source != layout:
        if pending is not None and pending.num_rows:
            deferrals = pending.column(DEFERRALS)
            pending = to_reader(
                pending.drop_columns([DEFERRALS]), source, layout, state.topic
            ).append_column(DEFERRALS, deferrals)
        if recent is not None and recent.num_rows:
            ages = recent.column(AGE)
            recent = evolve(recent.drop_columns([AGE]), layout, state.name, source).append_column(
                AGE, ages
            )
    result = apply_changes(
        rows,
        changes,
        layout,
        truncated_at=state.truncated_at,
        high_water=state.high_water,
        pending=pending,
        recent_deletes=recent,
        history=history,
    )
    result.stats.stale += dropped
    return replace(state, truncated_at=result.truncated_at, high_water=result.high_water), result
