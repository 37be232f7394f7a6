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
the whole table. This module folds a batch's changes into them
(:func:`apply_changes`); one run of changes of one identity is
:mod:`cdcd.spark.apply_runs`, the row tables and results
:mod:`cdcd.spark.rows`, a table's state between batches and one batch of one
table :mod:`cdcd.spark.tablestate`. The I/O around it -- the Delta tables,
one MERGE per table and batch, the Spark job -- is :mod:`cdcd.spark.mirror`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.spark.apply_runs import (
    aged_deletes,
    apply_keyed,
    apply_keyless,
    change_identities,
    distinct_identities,
    identity_runs,
    recent_deletes_by_version,
)
from cdcd.spark.layout import RowLayout
from cdcd.spark.rows import (
    AGE,
    DEFERRALS,
    META_LSN,
    META_SEQ,
    ApplyResult,
    ApplyStats,
    Event,
    Version,
    canonical,
    conform,
    empty_rows,
    evolve,
    older,
    pending_schema,
    state_schema,
)

__all__ = [
    "AGE",
    "DEFERRALS",
    "META_LSN",
    "META_SEQ",
    "ApplyResult",
    "ApplyStats",
    "Event",
    "Version",
    "apply_changes",
    "conform",
    "distinct_identities",
    "empty_rows",
    "evolve",
    "state_schema",
]


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
    identities = change_identities(changes, layout)
    changes = canonical(changes, layout)
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

    recent = recent_deletes_by_version(recent_deletes, layout)
    deleted: dict[Version, dict[str, Any]] = {}
    deferred: list[int] = []
    events: list[Event] | None = [] if history else None

    def apply_in_order(order: list[int]) -> None:
        # Each change is matched by the identity it was written with (a key
        # added, grown or dropped changes it from one change to the next), in
        # runs of consecutive changes with the same identity.
        nonlocal rows
        for identity, run in identity_runs(order, identities, layout):
            subset = changes.take(pa.array(run, pa.int64()))
            if identity:
                rows, run_deleted, held = apply_keyed(
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
                rows = apply_keyless(rows, subset, layout, stats, events)

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
                pc.invert(older(rows.column(META_LSN), rows.column(META_SEQ), truncate))
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
                        pc.invert(older(rows.column(META_LSN), rows.column(META_SEQ), version))
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
        aged_deletes(recent_deletes, deleted, layout),
        events,
    )
