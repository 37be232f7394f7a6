"""Large changes written by the executors: the driver commits file lists, not rows.

A micro-batch that brings a table's first rows in bulk (an initial build, the
snapshot of a table added to the publication, a re-snapshot into a new output)
would otherwise be collected whole to the driver. Instead, once the batch is
decoded and reduced on the executors (:func:`cdcd.spark.decode.decode_payloads`):

1. every Spark task reports a summary of each payload it holds
   (:func:`summarize_payloads`: row count, whether it only inserts, its newest
   change, per-partition high-water marks), keeping the payload itself only
   when it is small;
2. the driver picks the tables to write in bulk (:func:`bulk_tables`): new to
   the mirror, no history table, keyed, only inserts and reads, at least
   ``bulk_rows`` changes; it works out their state (reader schema, key,
   high-water marks) from the summaries alone;
3. each task applies its share of those tables' changes with the same pure
   code as the driver (:func:`cdcd.spark.tablestate.apply_batch` on an empty
   table), writes the rows as Parquet data files straight into the table's
   directory, and returns their add actions (path, size, statistics)
   (:func:`write_files`);
4. the driver commits one Delta transaction per table with those add actions,
   the batch's transaction id and the mirror's state
   (:meth:`cdcd.spark.store.MirrorStore.commit_files`).

A key's changes travel on one Kafka partition, read by one Spark task, so the
tasks' shares hold disjoint keys and their union is the table. Data files a
crash leaves before the commit are referenced by no version: readers never
see them, and ``--vacuum`` removes them.

The driver holds the summaries (one row per task, topic and writer schema)
and one add action per data file: its memory no longer grows with the rows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.spark.decode import NativeChanges, SchemaLookup
from cdcd.spark.layout import RowLayout
from cdcd.spark.rows import ApplyStats
from cdcd.spark.tablestate import Stored, TableState, apply_batch, reader_changes

__all__ = [
    "ACTIONS_DDL",
    "BULK_ROWS",
    "STAGE_PREFIX",
    "SUMMARY_DDL",
    "BulkTable",
    "bulk_tables",
    "summarize_payloads",
    "write_files",
]

#: A table new to the mirror with at least this many changes in a batch is
#: written by the executors; None: never (every batch collected to the driver).
BULK_ROWS: int | None = 100_000
#: Data files of a bulk write go to ``<table>/<STAGE_PREFIX><batch>-<random>/``.
STAGE_PREFIX = "cdcd-files-b"

_SUMMARY_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("header", pa.binary()),
        pa.field("identity", pa.string()),
        pa.field("rows", pa.int64()),
        pa.field("inserts_only", pa.bool_()),
        pa.field("newest", pa.binary()),  # the change with the highest (lsn, seq), Arrow IPC
        pa.field("marks", pa.string()),  # JSON {partition: [lsn, seq]} of keyed changes
        pa.field("payload", pa.binary()),  # null when the task keeps the changes
    ]
)
_ACTIONS_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("path", pa.string()),
        pa.field("size", pa.int64()),
        pa.field("modification_time", pa.int64()),
        pa.field("stats", pa.string()),
        pa.field("partition_values", pa.string()),
        pa.field("applied", pa.list_(pa.int64())),  # the task's ApplyStats, on its first file
    ]
)
_SPARK_TYPES = {pa.string(): "string", pa.binary(): "binary", pa.int64(): "long",
                pa.bool_(): "boolean", pa.list_(pa.int64()): "array<long>"}  # fmt: skip


def _ddl(schema: pa.Schema) -> str:
    """``schema`` as a Spark DDL string (the types used here only)."""
    return ", ".join(f"{f.name} {_SPARK_TYPES[f.type]}" for f in schema)


SUMMARY_DDL = _ddl(_SUMMARY_SCHEMA)
ACTIONS_DDL = _ddl(_ACTIONS_SCHEMA)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _read_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _newest(changes: pa.Table) -> pa.Table:
    order = pc.sort_indices(
        changes.select(["lsn", "seq"]), [("lsn", "descending"), ("seq", "descending")]
    )
    return changes.take(order.slice(0, 1))


def _inserts_only(changes: pa.Table) -> bool:
    ops = changes.column("op")
    if not pc.all(pc.is_in(ops, pa.array(["c", "r"]))).as_py():
        return False
    # A create with unchanged TOAST values is a key change's second half.
    toast = pc.list_value_length(changes.column("unchanged_toast"))
    return not pc.any(pc.greater(pc.fill_null(toast, 0), 0)).as_py()


def _marks(changes: pa.Table) -> dict[int, tuple[int, int]]:
    meta = changes.select(["partition", "lsn", "seq"]).to_pydict()
    marks: dict[int, tuple[int, int]] = {}
    for partition, lsn, seq in zip(meta["partition"], meta["lsn"], meta["seq"], strict=True):
        if partition not in marks or (lsn, seq) > marks[partition]:
            marks[partition] = (lsn, seq)
    return marks


def summarize_payloads(
    batches: Iterable[pa.RecordBatch], keep_below: int
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: a summary of the decoded payloads of each (topic, writer
    schema, key) of the task, with the payloads themselves when they hold fewer than
    ``keep_below`` changes together (one row per payload then, one row in all if not)."""
    groups: dict[tuple[str, bytes, str | None], list[dict[str, Any]]] = {}
    for batch in batches:
        for payload in batch.to_pylist():
            group = (payload["topic"], payload["header"], payload["identity"])
            groups.setdefault(group, []).append(payload)
    rows: dict[str, list[Any]] = {name: [] for name in _SUMMARY_SCHEMA.names}

    def add(group: tuple[str, bytes, str | None], changes: pa.Table, payload: Any) -> None:
        topic, header, identity = group
        rows["topic"].append(topic)
        rows["header"].append(header)
        rows["identity"].append(identity)
        rows["rows"].append(changes.num_rows)
        rows["inserts_only"].append(_inserts_only(changes))
        rows["newest"].append(_ipc(_newest(changes)))
        marks = _marks(changes) if identity not in (None, "[]") else {}
        rows["marks"].append(json.dumps({str(p): list(v) for p, v in marks.items()}))
        rows["payload"].append(payload)

    for group, payloads in groups.items():
        tables = [_read_ipc(p["payload"]) for p in payloads]
        if sum(t.num_rows for t in tables) >= keep_below:
            add(group, pa.concat_tables(tables), None)  # stays here
        else:
            for table, payload in zip(tables, payloads, strict=True):
                if table.num_rows:
                    add(group, table, payload["payload"])
    if rows["topic"]:
        yield pa.RecordBatch.from_pydict(rows, schema=_SUMMARY_SCHEMA)


@dataclass(frozen=True)
class BulkTable:
    """A table the executors write: its state after the batch, and where it goes."""

    state: TableState
    uri: str
    changes: int


def _natives(
    topic: str, rows: Iterable[Mapping[str, Any]], schema_of: SchemaLookup, column: str
) -> list[NativeChanges]:
    out = []
    for row in rows:
        identity = None if row["identity"] is None else tuple(json.loads(row["identity"]))
        layout = RowLayout.from_envelope(schema_of(row["header"]))
        out.append(
            NativeChanges(topic, row["header"], layout, _read_ipc(row[column]), (), identity)
        )
    return out


def bulk_tables(
    summary: pa.Table,
    threshold: int,
    schema_of: SchemaLookup,
    is_new: Any,
    track_partitions: bool = True,
) -> dict[str, BulkTable]:
    """The topics of a batch to write in bulk, by topic, with their table's state.

    ``is_new(topic, schema, table)`` answers whether the mirror has no table
    for the topic yet (and none with history): only then can the executors
    write the rows without reading any.
    """
    out: dict[str, BulkTable] = {}
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for row in summary.to_pylist():
        by_topic.setdefault(row["topic"], []).append(row)
    for topic, rows in sorted(by_topic.items()):
        total = sum(r["rows"] for r in rows)
        identities = {r["identity"] for r in rows}
        if (
            total < threshold
            or not all(r["inserts_only"] for r in rows)
            or len(identities) != 1
            or None in identities
            or "[]" in identities
        ):
            continue
        natives = _natives(topic, rows, schema_of, "newest")
        first = natives[0].changes.slice(0, 1).to_pylist()[0]
        new = is_new(topic, first["source_schema"], first["source_table"])
        if new is None:
            continue
        state, _, _ = reader_changes(topic, None, natives, schema_of)
        marks: dict[int, tuple[int, int]] = {}
        for row in rows:
            for partition, version in json.loads(row["marks"]).items():
                mark = (int(version[0]), int(version[1]))
                if int(partition) not in marks or mark > marks[int(partition)]:
                    marks[int(partition)] = mark
        state = replace(state, high_water=marks if track_partitions else {})
        out[topic] = BulkTable(state, new, total)
    return out


def _stage_adds(stage: str, storage_options: Mapping[str, str]) -> list[dict[str, Any]]:
    """The add actions of the staging table's one commit, as delta-rs wrote them."""
    from deltalake.fs import DeltaStorageHandler

    handler = DeltaStorageHandler(stage, dict(storage_options))
    with handler.open_input_file("_delta_log/00000000000000000000.json") as log:
        lines = log.read().decode("utf-8").splitlines()
    return [entry["add"] for entry in map(json.loads, lines) if "add" in entry]


def write_files(
    batches: Iterable[pa.RecordBatch],
    tables: Mapping[str, tuple[dict[str, Any], str]],
    batch_id: int,
    schema_of: SchemaLookup,
    storage_options: Mapping[str, str],
    target_file_size: int,
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body over decoded payloads: this task's rows of the ``tables``
    (topic -> (state as JSON, table URI)) written as data files; their add actions.

    The files go to a directory of their own in the table's directory, written
    by delta-rs as a one-commit staging table (its statistics are the ones any
    delta-rs write records); the driver commits the files to the table itself.
    """
    from deltalake import write_deltalake

    wanted: dict[str, list[dict[str, Any]]] = {}
    for batch in batches:
        for payload in batch.to_pylist():
            if payload["topic"] in tables:
                wanted.setdefault(payload["topic"], []).append(payload)
    out: dict[str, list[Any]] = {name: [] for name in _ACTIONS_SCHEMA.names}
    for topic, payloads in sorted(wanted.items()):
        document, uri = tables[topic]
        state = replace(TableState.from_json(document), high_water={})
        natives = _natives(topic, payloads, schema_of, "payload")
        state_now, changes, dropped = reader_changes(topic, state, natives, schema_of)
        _, result = apply_batch(state_now, None, Stored.empty(state_now.layout), changes, dropped)
        if not result.rows.num_rows:
            continue
        stage_dir = f"{STAGE_PREFIX}{batch_id}-{uuid.uuid4().hex}"
        stage = f"{uri.rstrip('/')}/{stage_dir}"
        write_deltalake(
            stage,
            result.rows,
            mode="error",
            storage_options=dict(storage_options),
            target_file_size=target_file_size,
        )
        for i, add in enumerate(_stage_adds(stage, storage_options)):
            out["topic"].append(topic)
            out["path"].append(f"{stage_dir}/{add['path']}")
            out["size"].append(int(add["size"]))
            out["modification_time"].append(int(add["modificationTime"]))
            out["stats"].append(add.get("stats"))
            out["partition_values"].append(json.dumps(add.get("partitionValues") or {}))
            out["applied"].append(list(result.stats.astuple()) if i == 0 else None)
    if out["topic"]:
        yield pa.RecordBatch.from_pydict(out, schema=_ACTIONS_SCHEMA)


def applied_stats(actions: pa.Table, topic: str) -> ApplyStats:
    """The sum of the tasks' apply statistics for ``topic``."""
    total = ApplyStats()
    rows = actions.filter(pc.equal(actions.column("topic"), topic))
    for values in rows.column("applied").to_pylist():
        if values is not None:
            total = total + ApplyStats(*values)
    return total
