"""Large batches that change rows a table holds: the executors rewrite the table.

A micro-batch that brings an existing table many changes to rows it holds --
a re-snapshot (``op=r``) after a rewriting migration or ``cdcd snapshot
--table``, a large batch of updates and deletes -- would otherwise be
collected to the driver (:mod:`cdcd.spark.job`), whose memory then grows with
the batch. Instead, when the batch brings the table at least ``bulk_rows``
changes and at least :data:`REWRITE_FRACTION` of its stored rows:

1. the driver lists the data files of the table's current Delta version
   (paths, sizes and row counts from the log: no row) and works out the
   table's state from the batch's summaries (:func:`rewrite_tables`, as
   :mod:`cdcd.spark.bulk` does);
2. the executors bring each key's stored row and its changes together: both
   sides are cut into the same buckets by their key columns
   (:func:`bucket_of`: stretches of an integer key's stored range, so that
   the files written keep keys together for later batches' file pruning, or
   a hash; the changes in :func:`bucket_changes`, the stored rows read from
   the listed files in :func:`bucket_stored`) and co-grouped by (topic,
   bucket);
3. each bucket is applied with the same pure code as the driver's
   (:func:`cdcd.spark.tablestate.apply_batch` on the bucket's stored rows,
   with the table's truncate and high-water marks) and written as new Parquet
   data files into the table's directory, the rows the batch deleted into
   the recent-deletes side table's directory (:func:`apply_bucket`); the rows
   the batches before deleted age there too (:func:`aged_recent`, on the
   driver, a record batch at a time: only key-change creates read them, and
   those go to the driver path);
4. the driver commits one Delta transaction per table that removes the files
   it listed and adds the new ones, with the batch's transaction id and the
   mirror's state in the commit metadata
   (:meth:`cdcd.spark.store.MirrorStore.commit_rewrite`), the recent-deletes
   side table's version first.

Why it is exact: a key's stored row and all of the batch's changes of that
key land in one bucket, and :func:`~cdcd.spark.tablestate.apply_batch`
treats keys independently once nothing joins two keys: every rule it applies
(per-row versions, the table's truncate, per-partition high-water marks, a
change's TOAST columns from the stored row) reads only the key's own row and
changes and the table's state, which every bucket is given. A row the batch
does not change is written back as it was read (a re-snapshot that finds a
row unchanged rewrites its values; its row version moves to the snapshot's,
as on the driver path). The state the commit records is what the driver path
records: the high-water marks are the highest versions of the summaries.

What goes to the driver path instead (one place, :func:`rewrite_tables` and
the job's target):

* a table holding key-change creates back (the ``_cdcd_pending`` side
  table): such a create takes its TOAST values from a row deleted under
  another key, in another bucket;
* a batch with a create carrying unchanged TOAST values (a key change's
  second half, same reason) or with a truncate (it reaches every key);
* a batch with keyless changes, changes written under another key, or a
  change of the table's key or columns (the driver moves the stored rows);
* keys holding arrays (no stable bucket over them);
* a table with a history table (its versions would be closed and opened per
  bucket; the driver path does it);
* a table some of whose data files carry no row count (its size is unknown);
* a bucket that would hold a change back anyway: the driver commits nothing
  of that batch for the table and applies it itself.

A rewrite reads and writes the whole table, on the executors; the driver path
reads only the files the batch's keys fall in but holds the changes. Hence
the fraction: a batch of 100,000 changes to a billion-row table stays on the
driver path (it holds 100,000 changes), a re-snapshot of the table is
rewritten. A batch of new keys only is appended by :mod:`cdcd.spark.bulk`
first; if its executors find some keys stored, it is rewritten here.

A crash before the commit leaves data files no version references (readers
never see them, the replayed batch writes new ones, ``--vacuum`` removes
them); a crash between the side table's version and the commit leaves a side
table version no commit names.

What the driver holds: the summaries, the file list of the table (one entry
per data file) and one add action per file written -- not rows.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.spark.bulk import (
    ActionRows,
    ipc,
    large_keyed_topics,
    read_ipc,
    source_table,
    stage_files,
    summarized_state,
    summary_natives,
)
from cdcd.spark.decode import PAYLOAD_ROWS, SchemaLookup
from cdcd.spark.deltaio import pruned_dataset
from cdcd.spark.layout import RowLayout, changes_arrow_schema
from cdcd.spark.rows import (
    AGE,
    IDENTITY,
    RECENT_DELETE_BATCHES,
    ApplyStats,
    conform,
    recent_schema,
    state_schema,
)
from cdcd.spark.store import RECENT_DIR
from cdcd.spark.tablestate import Stored, TableState, apply_batch, reader_changes

__all__ = [
    "BUCKETED_DDL",
    "BUCKET_ROWS",
    "FILES_DDL",
    "REWRITE_FRACTION",
    "RewriteTable",
    "RewriteTarget",
    "StoredFiles",
    "aged_recent",
    "apply_bucket",
    "bucket_changes",
    "bucket_of",
    "bucket_stored",
    "listing",
    "rewrite_tables",
    "stored_files",
]

#: A batch that brings an existing table at least ``bulk_rows`` changes and at least
#: this fraction of its stored rows is applied by rewriting the table on the
#: executors; None: never.
REWRITE_FRACTION: float | None = 0.25
#: About this many stored rows and changes per bucket (what one Python worker holds).
BUCKET_ROWS = 200_000

_BUCKETED_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("bucket", pa.int32()),
        pa.field("payload", pa.binary()),  # Arrow IPC: changes, or stored rows
        pa.field("dropped", pa.int64()),  # changes older than the table's truncate
    ]
)
BUCKETED_DDL = "topic string, bucket int, payload binary, dropped long"
FILES_DDL = "topic string, path string"


@dataclass(frozen=True)
class StoredFiles:
    """The data files of the table version a rewrite reads, from the Delta log."""

    version: int
    paths: tuple[str, ...]  # relative to the table
    sizes: tuple[int, ...]
    #: Rows in them (None: some file has no row count).
    rows: int | None
    #: The smallest and largest value of an integer key of one column in them,
    #: from the log's statistics (None: another key, or no statistics).
    key_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class RewriteTarget:
    """A table the executors may rewrite, as the job found it."""

    uri: str
    existing: TableState
    files: StoredFiles


@dataclass(frozen=True)
class RewriteTable:
    """A table the executors rewrite: its state before and after the batch, and where."""

    base: TableState
    state: TableState
    target: RewriteTarget
    changes: int
    #: How many buckets the executors cut the table and the batch into.
    buckets: int

    def document(self) -> dict[str, Any]:
        """What the executors need of the table (JSON, sent to them)."""
        return {
            "base": self.base.to_json(),
            "uri": self.target.uri,
            "version": self.target.files.version,
            "buckets": self.buckets,
            "range": self.target.files.key_range,
        }


def rewrite_tables(
    summary: pa.Table,
    threshold: int,
    fraction: float,
    schema_of: SchemaLookup,
    target_of: Callable[[str, str, str], RewriteTarget | None],
    track_partitions: bool = True,
) -> dict[str, RewriteTable]:
    """The topics of a batch to apply by rewriting their table, with its state.

    ``target_of(topic, schema, table)`` answers where the table is and whether
    the executors may rewrite it (None: the driver applies the batch).
    """
    out: dict[str, RewriteTable] = {}
    for candidate in large_keyed_topics(summary, threshold, "by_key", schema_of):
        topic, rows, natives, total = candidate
        target = target_of(topic, *source_table(natives))
        if target is None or target.files.rows is None:
            continue
        if total < fraction * target.files.rows:
            continue  # small next to the table: the driver reads only what it touches
        states = summarized_state(
            topic, rows, natives, target.existing, schema_of, track_partitions
        )
        if states is None:
            continue
        base, after = states
        if tuple(json.loads(rows[0]["identity"])) != base.key:
            continue  # changes written under another key
        buckets = max(1, math.ceil((total + target.files.rows) / BUCKET_ROWS))
        out[topic] = RewriteTable(base, after, target, total, buckets)
    return out


def bucket_of(keys: pa.Table, buckets: int, key_range: Sequence[int] | None = None) -> pa.Array:
    """The bucket of each key (``keys``: the key columns, in the stored rows' types).

    The same in every worker process (no per-process hash seed). An integer
    key of one column with the stored rows' ``key_range`` (smallest, largest)
    by its place in that range: each bucket, so each data file the rewrite
    writes, then holds one stretch of keys, and later batches read only the
    files their keys fall in (:meth:`cdcd.spark.store.MirrorStore.read_touched`);
    keys outside the range go to the first or last bucket. Other keys by a CRC
    of their values' ``repr``.
    """
    if buckets == 1:
        return pa.array([0] * keys.num_rows, pa.int32())
    columns = [keys.column(name).to_pylist() for name in keys.column_names]
    if len(columns) == 1 and pa.types.is_integer(keys.schema.field(0).type):
        low, high = key_range if key_range is not None else (0, buckets - 1)
        span = high - low + 1
        last = buckets - 1
        values = [
            0 if v is None else min(last, max(0, (v - low) * buckets // span)) for v in columns[0]
        ]
    else:
        values = [
            zlib.crc32(repr(key).encode("utf-8")) % buckets for key in zip(*columns, strict=True)
        ]
    return pa.array(values, pa.int32())


def _by_bucket(
    topic: str, table: pa.Table, buckets: pa.Array, dropped: int
) -> Iterator[pa.RecordBatch]:
    """``table`` cut by ``buckets`` into :data:`BUCKETED_DDL` rows of at most
    ``PAYLOAD_ROWS`` each; ``dropped`` travels on the first."""
    order = pc.sort_indices(buckets)
    rows = table.take(order)
    sorted_buckets = buckets.take(order)
    out: dict[str, list[Any]] = {name: [] for name in _BUCKETED_SCHEMA.names}
    start = 0
    for entry in pc.value_counts(sorted_buckets).to_pylist():
        bucket, count = int(entry["values"]), int(entry["counts"])
        for offset in range(start, start + count, PAYLOAD_ROWS):
            out["topic"].append(topic)
            out["bucket"].append(bucket)
            out["payload"].append(
                ipc(rows.slice(offset, min(PAYLOAD_ROWS, start + count - offset)))
            )
            out["dropped"].append(dropped)
            dropped = 0
        start += count
    if dropped:  # every change of the task was older than the truncate
        out["topic"].append(topic)
        out["bucket"].append(0)
        out["payload"].append(ipc(table.slice(0, 0)))
        out["dropped"].append(dropped)
    if out["topic"]:
        yield pa.RecordBatch.from_pydict(out, schema=_BUCKETED_SCHEMA)


def _key_table(images: pa.ChunkedArray | pa.Array, state: TableState) -> pa.Table:
    schema = state_schema(state.layout)
    return pa.table(
        {
            name: pc.struct_field(images, name).cast(schema.field(name).type)
            for name in state.layout.key_names
        }
    )


def bucket_changes(
    batches: Iterable[pa.RecordBatch],
    tables: Mapping[str, dict[str, Any]],
    schema_of: SchemaLookup,
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body over decoded payloads: this task's changes of the ``tables``
    (topic -> :meth:`RewriteTable.document`) in the tables' reader layout, cut
    into buckets by key (:data:`BUCKETED_DDL`)."""
    wanted: dict[str, list[dict[str, Any]]] = {}
    for batch in batches:
        for payload in batch.to_pylist():
            if payload["topic"] in tables:
                wanted.setdefault(payload["topic"], []).append(payload)
    for topic, payloads in sorted(wanted.items()):
        document = tables[topic]
        state = TableState.from_json(document["base"])
        natives = summary_natives(topic, payloads, schema_of, "payload")
        _, changes, dropped = reader_changes(topic, state, natives, schema_of)
        images = pc.if_else(
            pc.equal(changes.column("op"), "d"), changes.column("before"), changes.column("after")
        )
        keys = _key_table(images, state)
        buckets = bucket_of(keys, document["buckets"], document["range"])
        yield from _by_bucket(topic, changes, buckets, dropped)


def bucket_stored(
    batches: Iterable[pa.RecordBatch],
    tables: Mapping[str, dict[str, Any]],
    storage_options: Mapping[str, str],
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body over :data:`FILES_DDL` rows: the stored rows of those data
    files (of the table version each document names), cut into buckets by key
    (:data:`BUCKETED_DDL`)."""
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    paths: dict[str, set[str]] = {}
    for batch in batches:
        for row in batch.to_pylist():
            paths.setdefault(row["topic"], set()).add(row["path"])
    for topic, wanted in sorted(paths.items()):
        document = tables[topic]
        state = TableState.from_json(document["base"])
        schema = state_schema(state.layout)
        delta = DeltaTable(
            document["uri"], version=document["version"], storage_options=dict(storage_options)
        )
        whole = delta.to_pyarrow_dataset()
        fragments = [f for f in whole.get_fragments() if f.path in wanted]
        if len(fragments) != len(wanted):
            raise DefiniteError(
                f"{document['uri']}: data files of version {document['version']} are gone",
                hint="do not run --optimize or --vacuum while cdcd mirror writes the tables",
            )
        if not fragments:
            continue
        file_format = fragments[0].format
        dataset = ds.FileSystemDataset(
            [file_format.make_fragment(f.path, f.filesystem) for f in fragments],
            schema=whole.schema,
            format=file_format,
            filesystem=fragments[0].filesystem,
        )
        for record_batch in dataset.to_batches():
            rows = conform(pa.Table.from_batches([record_batch]), schema, "stored rows")
            if rows.num_rows:
                keys = rows.select(list(state.layout.key_names))
                buckets = bucket_of(keys, document["buckets"], document["range"])
                yield from _by_bucket(topic, rows, buckets, 0)


def apply_bucket(
    changes_side: pa.Table,
    stored_side: pa.Table,
    *,
    tables: Mapping[str, dict[str, Any]],
    batch_id: int,
    storage_options: Mapping[str, str],
    target_file_size: int,
) -> pa.Table:
    """``cogroup(...).applyInArrow`` body: one bucket of one table, its changes
    (:func:`bucket_changes`) applied to its stored rows (:func:`bucket_stored`) and
    written as data files; their add actions (:data:`cdcd.spark.bulk.ACTIONS_DDL`,
    ``kind`` ``table``, or ``recent`` for the rows the batch deleted), or one
    ``held`` row when the bucket holds a change back (nothing written then)."""
    side = changes_side if changes_side.num_rows else stored_side
    topic = side.column("topic")[0].as_py()
    document = tables[topic]
    uri = document["uri"]
    state = TableState.from_json(document["base"])
    layout = state.layout
    changes_schema = changes_arrow_schema(layout).append(pa.field(IDENTITY, pa.list_(pa.string())))
    changes = pa.concat_tables(
        [changes_schema.empty_table()]
        + [read_ipc(p).cast(changes_schema) for p in changes_side.column("payload").to_pylist()]
    )
    schema = state_schema(layout)
    stored = pa.concat_tables(
        [schema.empty_table()]
        + [conform(read_ipc(p), schema, "stored rows")
           for p in stored_side.column("payload").to_pylist()]
    )  # fmt: skip
    dropped = int(pc.sum(changes_side.column("dropped")).as_py() or 0)
    out = ActionRows()
    if changes.num_rows:
        _, result = apply_batch(state, None, Stored(stored), changes, dropped)
        if result.pending is not None and result.pending.num_rows:
            out.add(topic, "held", None, {}, None)
            return out.table()
        rows, recent, stats = result.rows, result.recent_deletes, result.stats
    else:
        rows, recent, stats = stored, None, ApplyStats(stale=dropped)
    files: list[tuple[str, str, Mapping[str, Any]]] = []
    if rows.num_rows:
        # In key order: the files a bucket fills hold disjoint stretches of keys.
        rows = rows.sort_by([(name, "ascending") for name in layout.key_names])
        staged = stage_files(uri, rows, batch_id, storage_options, target_file_size)
        files += [("table", path, action) for path, action in staged]
    if recent is not None and recent.num_rows:
        staged = stage_files(
            f"{uri.rstrip('/')}/{RECENT_DIR}", recent, batch_id, storage_options, target_file_size
        )
        files += [("recent", path, action) for path, action in staged]
    applied: list[int] | None = list(stats.astuple())
    for kind, path, action in files:
        out.add(topic, kind, path, action, applied)
        applied = None
    if applied is not None:
        out.add(topic, "none", None, {}, applied)
    return out.table()


def listing(tables: Mapping[str, RewriteTable]) -> list[tuple[str, str]]:
    """(topic, path) of every data file the ``tables``' rewrites read."""
    return [(topic, path) for topic, table in sorted(tables.items())
            for path in table.target.files.paths]  # fmt: skip


def stored_files(actions: pa.Table, version: int, key: tuple[str, ...]) -> StoredFiles:
    """The :class:`StoredFiles` of a table version (its key columns ``key``) from its
    add actions (``DeltaTable.get_add_actions(flatten=True)``)."""
    names = actions.column_names
    counts = actions.column("num_records").to_pylist() if "num_records" in names else None
    rows: int | None = None
    if counts is not None and all(c is not None for c in counts):
        rows = int(sum(counts))
    key_range = None
    if len(key) == 1 and f"min.{key[0]}" in names and f"max.{key[0]}" in names:
        lows = actions.column(f"min.{key[0]}").to_pylist()
        highs = actions.column(f"max.{key[0]}").to_pylist()
        if lows and all(isinstance(v, int) and not isinstance(v, bool) for v in lows + highs):
            key_range = (min(lows), max(highs))
    return StoredFiles(
        version,
        tuple(actions.column("path").to_pylist()),
        tuple(int(s) for s in actions.column("size_bytes").to_pylist()),
        rows,
        key_range,
    )


def aged_recent(
    uri: str,
    version: int,
    layout: RowLayout,
    batch_id: int,
    storage_options: Mapping[str, str],
    target_file_size: int,
) -> pa.Table:
    """The rows the batches before deleted that the next batch still keeps, one batch
    older (what :func:`cdcd.spark.apply_runs.aged_deletes` keeps of them), written as
    data files into the recent-deletes side table's directory: their add actions
    (``kind`` ``recent``). Run by the driver, a record batch at a time: it holds one
    record batch of them, not the side table."""
    from deltalake import DeltaTable

    side = f"{uri.rstrip('/')}/{RECENT_DIR}"
    out = ActionRows()
    plain = pruned_dataset(
        DeltaTable(side, version=version, storage_options=dict(storage_options)), None
    )
    if plain is None:
        return out.table()
    schema = recent_schema(layout)
    kept = 0

    def aged() -> Iterator[pa.RecordBatch]:
        nonlocal kept
        for batch in plain.to_batches():
            rows = conform(pa.Table.from_batches([batch]), schema, "recent deletes")
            rows = rows.filter(pc.less(rows.column(AGE), RECENT_DELETE_BATCHES - 1))
            ages = pc.add(rows.column(AGE), 1).cast(pa.int32())
            rows = rows.set_column(schema.get_field_index(AGE), schema.field(AGE), ages)
            kept += rows.num_rows
            yield from rows.to_batches()

    staged = stage_files(
        side,
        pa.RecordBatchReader.from_batches(schema, aged()),
        batch_id,
        storage_options,
        target_file_size,
    )
    if kept:  # else no row is kept: no file (a version of nothing is no version)
        for path, action in staged:
            out.add("", "recent", path, action, None)
    return out.table()
