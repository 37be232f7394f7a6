"""One run of changes applied to the rows: by key, or by whole row for keyless tables.

:func:`cdcd.spark.apply.apply_changes` orders a batch and cuts it into runs
of consecutive changes written with the same identity
(:func:`identity_runs`); each run is applied here -- keyed
(:func:`apply_keyed`: upserts with TOAST carry-over, deletes, a key
change's create held back until its delete arrives) or keyless
(:func:`apply_keyless`: matched on the whole old row). Pure: pyarrow only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.spark.layout import RowLayout
from cdcd.spark.rows import (
    AGE,
    IDENTITY,
    MAX_DEFERRALS,
    META_LSN,
    META_SEQ,
    RECENT_DELETE_BATCHES,
    ApplyStats,
    Event,
    Version,
    evolve,
    hashable,
    recent_schema,
)


def find_rows(
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
            for i, key in enumerate(zip(*(map(hashable, c) for c in columns), strict=True))
            if key in wanted_set
        }
    found: dict[tuple[Any, ...], int] = {}
    key_columns = [joined.column(name).to_pylist() for name in key_names]
    for key, index in zip(
        zip(*key_columns, strict=True), joined.column("__cdcd_row").to_pylist(), strict=True
    ):
        found[tuple(hashable(v) for v in key)] = index
    return found


SEPARATOR = "\x00"  # not in PostgreSQL identifiers


def distinct_identities(changes: pa.Table) -> set[tuple[str, ...] | None]:
    """The identities (column ``IDENTITY``) the changes were written with."""
    if IDENTITY not in changes.column_names:
        return {None}
    joined = pc.binary_join(changes.column(IDENTITY), SEPARATOR)
    return {split_identity(text) for text in pc.unique(joined).to_pylist()}


def split_identity(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(text.split(SEPARATOR)) if text else ()


def change_identities(changes: pa.Table, layout: RowLayout) -> list[tuple[str, ...]]:
    """Each change's identity (its key columns; () for none), the layout's when unknown."""
    if IDENTITY not in changes.column_names or not changes.num_rows:
        return [layout.key_names] * changes.num_rows
    joined = pc.binary_join(changes.column(IDENTITY), SEPARATOR).combine_chunks()
    encoded = pc.dictionary_encode(joined)
    known = [split_identity(text) for text in encoded.dictionary.to_pylist()]
    values = [layout.key_names if key is None else key for key in known]
    return [
        layout.key_names if code is None else values[code] for code in encoded.indices.to_pylist()
    ]


def identity_runs(
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


def recent_deletes_by_version(
    table: pa.Table | None, layout: RowLayout
) -> dict[Version, dict[str, Any]]:
    if table is None or table.num_rows == 0:
        return {}
    names = layout.names
    out = {}
    for row in evolve(table.drop_columns([AGE]), layout).to_pylist():
        out[(row[META_LSN], row[META_SEQ])] = {name: row[name] for name in names}
    return out


def aged_deletes(
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


def change_records(changes: pa.Table) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = changes.select(
        ["lsn", "seq", "op", "commit_ts", "unchanged_toast", "before", "after"]
    ).to_pylist()
    return records


def insert_events(
    events: list[Event], inserted: pa.Table, changes: pa.Table, layout: RowLayout
) -> None:
    """One bulk event for rows a batch only inserts: kept columnar (a first build)."""
    bulk = inserted.append_column("op", changes.column("op")).append_column(
        "commit_ts", changes.column("commit_ts")
    )
    events.append(Event(None, None, (-1, -1), None, "+", None, bulk))


def new_rows_only(rows: pa.Table, changes: pa.Table, layout: RowLayout) -> pa.Table | None:
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


def apply_keyed(
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
    inserted = new_rows_only(rows, changes, layout)
    if inserted is not None:
        stats.applied += inserted.num_rows
        if events is not None:
            insert_events(events, inserted, changes, layout)
        return pa.concat_tables([rows, inserted]), {}, []
    key_names = layout.key_names
    names = layout.names
    records = change_records(changes)
    keys: list[tuple[Any, ...]] = []
    for record in records:
        image = record["after"] if record["op"] != "d" else record["before"]
        if image is None:
            raise DefiniteError(
                f"change at (lsn {record['lsn']}, seq {record['seq']}) op {record['op']!r} "
                "has no row image"
            )
        keys.append(tuple(hashable(image[k]) for k in key_names))

    found = find_rows(rows, key_names, list(dict.fromkeys(keys)))
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


def apply_keyless(
    rows: pa.Table,
    changes: pa.Table,
    layout: RowLayout,
    stats: ApplyStats,
    events: list[Event] | None = None,
) -> pa.Table:
    names = layout.names
    records = change_records(changes)
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
