"""Large changes written by the executors: the driver commits file lists, not rows.

A micro-batch that brings a table many new rows (an initial build and each
later batch of it, the snapshot of a table added to the publication, a
re-snapshot into a new output) would otherwise be collected whole to the
driver. Instead, once the batch is decoded and reduced on the executors
(:func:`cdcd.spark.decode.decode_payloads`):

1. every Spark task reports a summary of each payload it holds
   (:func:`summarize_payloads`: row count, whether it only inserts, its newest
   change, per-partition high-water marks), keeping the payload itself only
   when it is small;
2. the driver picks the tables to write in bulk (:func:`bulk_tables`): keyed,
   only inserts and reads, at least ``bulk_rows`` changes, and either new to
   the mirror or an existing table whose layout and key the batch keeps and
   that has no held-back change nor recent delete to carry (the job decides
   that, :class:`BulkTarget`); it works out their state (reader schema, key,
   high-water marks) from the summaries alone;
3. each task applies its share of those tables' changes with the same pure
   code as the driver (:func:`cdcd.spark.tablestate.apply_batch` on an empty
   table, with the table's truncate and high-water marks), writes the rows as
   Parquet data files straight into the table's directory -- and, for a
   table with a history table, each row's one open version into the history
   table's directory -- and returns their add actions (path, size,
   statistics) (:func:`write_files`);
4. the driver commits one Delta transaction per table with those add
   actions, the batch's transaction id and the mirror's state
   (:meth:`cdcd.spark.store.MirrorStore.commit_files`); the history table
   first, with the same transaction id, as on the driver path.

Why appending is exact for an existing table: the driver path would look up
each change's key among the stored rows and, finding none, insert the row
(:func:`cdcd.spark.apply_runs.new_rows_only`). Each task proves the same
before it writes anything: it reads the stored key columns of the data files
whose min/max statistics admit one of its keys (file pruning, as the
driver's :meth:`~cdcd.spark.store.MirrorStore.read_touched` does) and checks
that none of its keys is there. A snapshot publishes in key order, so a later
batch of a build meets only the files of the batch before it at the boundary.
A task that finds a stored key writes nothing and reports a clash; the
driver then commits nothing for that table (files other tasks wrote belong
to no version) and has the executors rewrite the table
(:mod:`cdcd.spark.rewrite`, when the batch is large enough next to the table)
or applies its changes on the driver path. Held-back
key-change creates and recent deletes (the side tables) would interact with
the rows, so a table that has any goes to the driver path too.

A key's changes travel on one Kafka partition, read by one Spark task, so the
tasks' shares hold disjoint keys and their union is the batch. Data files a
crash leaves before the commit are referenced by no version: readers never
see them, and ``--vacuum`` removes them.

The driver holds the summaries (one row per task, topic and writer schema)
and one add action per data file: its memory no longer grows with the rows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.spark.decode import NativeChanges, SchemaLookup
from cdcd.spark.deltaio import pruned_dataset
from cdcd.spark.history import history_delta, history_schema
from cdcd.spark.layout import RowLayout
from cdcd.spark.rows import ApplyStats, conform
from cdcd.spark.tablestate import Stored, TableState, apply_batch, reader_changes

__all__ = [
    "ACTIONS_DDL",
    "BULK_ROWS",
    "ActionRows",
    "STAGE_PREFIX",
    "SUMMARY_DDL",
    "BulkTable",
    "BulkTarget",
    "actions_of",
    "applied_stats",
    "bulk_tables",
    "ipc",
    "large_keyed_topics",
    "read_ipc",
    "source_table",
    "stage_files",
    "stored_keys_among",
    "summarize_payloads",
    "summarized_state",
    "summary_by_topic",
    "summary_natives",
    "write_files",
]

#: A batch bringing a table at least this many new rows (inserts and reads of keys
#: it does not hold) is written by the executors; None: never (every batch
#: collected to the driver). ``cdcd mirror --bulk-rows`` sets it per run.
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
        # No truncate, no create carrying unchanged TOAST (a key change's second
        # half): what the rewrite path (:mod:`cdcd.spark.rewrite`) can apply by key.
        pa.field("by_key", pa.bool_()),
        pa.field("newest", pa.binary()),  # the change with the highest (lsn, seq), Arrow IPC
        pa.field("marks", pa.string()),  # JSON {partition: [lsn, seq]} of keyed changes
        pa.field("payload", pa.binary()),  # null when the task keeps the changes
    ]
)
_ACTIONS_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("kind", pa.string()),  # table, history, clash (nothing written) or none
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


def ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def read_ipc(data: bytes) -> pa.Table:
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


def _by_key(changes: pa.Table) -> bool:
    ops = changes.column("op")
    if pc.any(pc.equal(ops, "t")).as_py():
        return False
    toast = pc.fill_null(pc.list_value_length(changes.column("unchanged_toast")), 0)
    creates = pc.is_in(ops, pa.array(["c", "r"]))
    return not pc.any(pc.and_(creates, pc.greater(toast, 0))).as_py()


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
        rows["by_key"].append(_by_key(changes))
        rows["newest"].append(ipc(_newest(changes)))
        marks = _marks(changes) if identity not in (None, "[]") else {}
        rows["marks"].append(json.dumps({str(p): list(v) for p, v in marks.items()}))
        rows["payload"].append(payload)

    for group, payloads in groups.items():
        tables = [read_ipc(p["payload"]) for p in payloads]
        if sum(t.num_rows for t in tables) >= keep_below:
            add(group, pa.concat_tables(tables), None)  # stays here
        else:
            for table, payload in zip(tables, payloads, strict=True):
                if table.num_rows:
                    add(group, table, payload["payload"])
    if rows["topic"]:
        yield pa.RecordBatch.from_pydict(rows, schema=_SUMMARY_SCHEMA)


@dataclass(frozen=True)
class BulkTarget:
    """Where the executors may write a table's batch, as the job found it."""

    uri: str
    #: The table's state as stored (None: the table is new to the mirror).
    existing: TableState | None = None
    #: The history table to write the batch's versions to (None: none, or the batch
    #: is already in it), and the layout it holds (None: it is created).
    history_uri: str | None = None
    history_layout: RowLayout | None = None


@dataclass(frozen=True)
class BulkTable:
    """A table the executors write: its state before and after the batch, and where."""

    #: What the executors apply the changes to: the reader layout and key, the
    #: stored truncate and high-water marks.
    base: TableState
    #: The state the commit records.
    state: TableState
    target: BulkTarget
    changes: int

    @property
    def uri(self) -> str:
        return self.target.uri

    def document(self) -> dict[str, Any]:
        """What :func:`write_files` needs of the table (JSON, sent to the executors)."""
        return {
            "base": self.base.to_json(),
            "uri": self.target.uri,
            "existing": self.target.existing is not None,
            "history": self.target.history_uri,
        }


def summary_natives(
    topic: str, rows: Iterable[Mapping[str, Any]], schema_of: SchemaLookup, column: str
) -> list[NativeChanges]:
    out = []
    for row in rows:
        identity = None if row["identity"] is None else tuple(json.loads(row["identity"]))
        layout = RowLayout.from_envelope(schema_of(row["header"]))
        out.append(NativeChanges(topic, row["header"], layout, read_ipc(row[column]), (), identity))
    return out


def summary_by_topic(summary: pa.Table) -> dict[str, list[dict[str, Any]]]:
    """The rows of a batch's summary (:func:`summarize_payloads`), by topic, in order."""
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for row in summary.to_pylist():
        by_topic.setdefault(row["topic"], []).append(row)
    return dict(sorted(by_topic.items()))


def large_keyed_topics(
    summary: pa.Table, threshold: int, flag: str, schema_of: SchemaLookup
) -> Iterator[tuple[str, list[dict[str, Any]], list[NativeChanges], int]]:
    """The topics of a batch's ``summary`` with at least ``threshold`` changes, all
    written under one key (no keyless change, no truncate alone) and all of whose
    summary rows have ``flag`` (``inserts_only``, ``by_key``): (topic, its summary
    rows, their newest changes, the number of changes)."""
    for topic, rows in summary_by_topic(summary).items():
        total = sum(r["rows"] for r in rows)
        identities = {r["identity"] for r in rows}
        if (
            total < threshold
            or not all(r[flag] for r in rows)
            or len(identities) != 1
            or None in identities
            or "[]" in identities
        ):
            continue
        yield topic, rows, summary_natives(topic, rows, schema_of, "newest"), total


def source_table(natives: Sequence[NativeChanges]) -> tuple[str, str]:
    """The PostgreSQL (schema, table) of a topic's changes."""
    first = natives[0].changes.slice(0, 1).to_pylist()[0]
    return first["source_schema"], first["source_table"]


def bulk_tables(
    summary: pa.Table,
    threshold: int,
    schema_of: SchemaLookup,
    target_of: Callable[[str, str, str], BulkTarget | None],
    track_partitions: bool = True,
) -> dict[str, BulkTable]:
    """The topics of a batch to write in bulk, by topic, with their table's state.

    ``target_of(topic, schema, table)`` answers where the table is and whether
    the executors may write its batch (None: the driver applies it).
    """
    out: dict[str, BulkTable] = {}
    for candidate in large_keyed_topics(summary, threshold, "inserts_only", schema_of):
        topic, rows, natives, total = candidate
        target = target_of(topic, *source_table(natives))
        if target is None:
            continue
        states = summarized_state(
            topic, rows, natives, target.existing, schema_of, track_partitions
        )
        if states is None:
            continue
        base, after = states
        if target.history_layout is not None and target.history_layout != base.layout.shape:
            continue  # the history table changes layout first
        out[topic] = BulkTable(base, after, target, total)
    return out


def summarized_state(
    topic: str,
    rows: Sequence[Mapping[str, Any]],
    natives: Sequence[NativeChanges],
    existing: TableState | None,
    schema_of: SchemaLookup,
    track_partitions: bool,
) -> tuple[TableState, TableState] | None:
    """A table's state before and after a batch, from the batch's summary ``rows`` (and
    their newest changes, ``natives``) alone: (what the executors apply the changes to:
    the reader layout and key, the stored truncate and high-water marks; what the
    commit records). None when the batch changes the stored table's layout or key
    (the driver moves the stored rows), or the key holds arrays (no hash join over
    them)."""
    state, _, _ = reader_changes(topic, existing, natives, schema_of)
    if existing is not None and (
        state.layout != existing.layout
        or state.key != existing.key
        or any(pa.types.is_nested(state.layout.arrow_schema().field(k).type) for k in state.key)
    ):
        return None
    base = replace(
        state,
        truncated_at=existing.truncated_at if existing is not None else None,
        high_water=dict(existing.high_water) if existing is not None else {},
    )
    marks: dict[int, tuple[int, int]] = dict(base.high_water)
    for row in rows:
        for partition, version in json.loads(row["marks"]).items():
            mark = (int(version[0]), int(version[1]))
            if int(partition) not in marks or mark > marks[int(partition)]:
                marks[int(partition)] = mark
    return base, replace(base, high_water=marks if track_partitions else {})


def _stage_adds(stage: str, storage_options: Mapping[str, str]) -> list[dict[str, Any]]:
    """The add actions of the staging table's one commit, as delta-rs wrote them.

    The staging table's log is deleted once read: the table's own commit
    takes the actions, and ``--vacuum`` (which skips ``_``-prefixed paths)
    would never remove it.
    """
    from deltalake.fs import DeltaStorageHandler

    handler = DeltaStorageHandler(stage, dict(storage_options))
    with handler.open_input_file("_delta_log/00000000000000000000.json") as log:
        lines = log.read().decode("utf-8").splitlines()
    handler.delete_dir("_delta_log")
    return [entry["add"] for entry in map(json.loads, lines) if "add" in entry]


def stored_keys_among(uri: str, keys: pa.Table, storage_options: Mapping[str, str]) -> bool:
    """Whether the Delta table at ``uri`` holds a row with one of the ``keys`` (a table
    of the key columns). Only the files whose min/max statistics admit some value of
    every key column are read, and of them only the key columns."""
    from deltalake import DeltaTable

    names = keys.column_names
    delta = DeltaTable(uri, storage_options=dict(storage_options))
    wanted = {name: pc.unique(keys.column(name).drop_null()) for name in names}
    plain = pruned_dataset(delta, wanted)
    if plain is None:
        return False
    for batch in plain.to_batches(columns=names):
        stored = pa.Table.from_batches([batch]).cast(keys.schema)
        if stored.join(keys, keys=names, join_type="inner").num_rows:
            return True
    return False


def _new_keys(changes: pa.Table, key_names: Sequence[str]) -> pa.Table:
    after = changes.column("after")
    return pa.table({name: pc.struct_field(after, name) for name in key_names})


def stage_files(
    uri: str,
    rows: pa.Table | pa.RecordBatchReader,
    batch_id: int,
    storage_options: Mapping[str, str],
    target_file_size: int,
) -> list[tuple[str, dict[str, Any]]]:
    """Write ``rows`` as data files into a directory of their own in the table's
    directory (a one-commit delta-rs staging table, whose statistics are the ones any
    delta-rs write records); (path relative to the table, add action) of each."""
    from deltalake import write_deltalake

    stage_dir = f"{STAGE_PREFIX}{batch_id}-{uuid.uuid4().hex}"
    stage = f"{uri.rstrip('/')}/{stage_dir}"
    write_deltalake(
        stage,
        rows,
        mode="error",
        storage_options=dict(storage_options),
        target_file_size=target_file_size,
    )
    return [(f"{stage_dir}/{add['path']}", add) for add in _stage_adds(stage, storage_options)]


def _history_rows(events: list[Any], layout: RowLayout) -> pa.Table:
    """The open versions a batch of new rows starts (the driver's own construction)."""
    delta = history_delta(events)
    assert not delta.updates and delta.truncate is None  # new keys end no stored version
    schema = history_schema(layout)
    return pa.concat_tables(
        [pa.Table.from_pylist(delta.inserts, schema=schema)]
        + [conform(bulk, schema, "new versions") for bulk in delta.bulk]
    )


class ActionRows:
    """Rows of :data:`ACTIONS_DDL`: add actions of data files a task wrote, by topic."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name in _ACTIONS_SCHEMA.names}

    def add(self, topic: str, kind: str, path: str | None, action: Mapping[str, Any],
            applied: list[int] | None) -> None:  # fmt: skip
        out = self.columns
        out["topic"].append(topic)
        out["kind"].append(kind)
        out["path"].append(path)
        out["size"].append(int(action["size"]) if "size" in action else None)
        out["modification_time"].append(
            int(action["modificationTime"]) if "modificationTime" in action else None
        )
        out["stats"].append(action.get("stats"))
        out["partition_values"].append(json.dumps(action.get("partitionValues") or {}))
        out["applied"].append(applied)

    def table(self) -> pa.Table:
        return pa.Table.from_pydict(self.columns, schema=_ACTIONS_SCHEMA)

    def batches(self) -> Iterator[pa.RecordBatch]:
        if self.columns["topic"]:
            yield pa.RecordBatch.from_pydict(self.columns, schema=_ACTIONS_SCHEMA)


def write_files(
    batches: Iterable[pa.RecordBatch],
    tables: Mapping[str, dict[str, Any]],
    batch_id: int,
    schema_of: SchemaLookup,
    storage_options: Mapping[str, str],
    target_file_size: int,
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body over decoded payloads: this task's rows of the ``tables``
    (topic -> :meth:`BulkTable.document`) written as data files; their add actions
    (``kind`` ``table`` or ``history``), or one ``clash`` row for a table that
    already holds one of the task's keys (nothing written for it then)."""
    wanted: dict[str, list[dict[str, Any]]] = {}
    for batch in batches:
        for payload in batch.to_pylist():
            if payload["topic"] in tables:
                wanted.setdefault(payload["topic"], []).append(payload)
    out = ActionRows()
    add = out.add

    for topic, payloads in sorted(wanted.items()):
        document = tables[topic]
        uri = document["uri"]
        state = TableState.from_json(document["base"])
        natives = summary_natives(topic, payloads, schema_of, "payload")
        state_now, changes, dropped = reader_changes(
            topic, state, natives, schema_of, keep_truncated=document["history"] is not None
        )
        layout = state_now.layout
        if document["existing"] and changes.num_rows:
            if stored_keys_among(uri, _new_keys(changes, layout.key_names), storage_options):
                add(topic, "clash", None, {}, None)
                continue
        history = document["history"] is not None
        _, result = apply_batch(
            state_now, None, Stored.empty(layout), changes, dropped, history=history
        )
        files: list[tuple[str, str | None, Mapping[str, Any]]] = []
        if result.rows.num_rows:
            staged = stage_files(uri, result.rows, batch_id, storage_options, target_file_size)
            files += [("table", path, action) for path, action in staged]
        if history and result.events:
            versions = _history_rows(result.events, layout)
            if versions.num_rows:
                staged = stage_files(
                    document["history"], versions, batch_id, storage_options, target_file_size
                )
                files += [("history", path, action) for path, action in staged]
        # The task's statistics travel on its first row (one even with nothing written).
        stats: list[int] | None = list(result.stats.astuple())
        for kind, path, action in files or [("none", None, {})]:
            add(topic, kind, path, action, stats)
            stats = None
    yield from out.batches()


def actions_of(actions: pa.Table, topic: str, kind: str) -> pa.Table:
    """The rows of ``actions`` (from :func:`write_files`) of ``topic`` and ``kind``."""
    mask = pc.and_(pc.equal(actions.column("topic"), topic), pc.equal(actions.column("kind"), kind))
    return actions.filter(mask)


def applied_stats(actions: pa.Table, topic: str) -> ApplyStats:
    """The sum of the tasks' apply statistics for ``topic``."""
    total = ApplyStats()
    rows = actions.filter(pc.equal(actions.column("topic"), topic))
    for values in rows.column("applied").to_pylist():
        if values is not None:
            total = total + ApplyStats(*values)
    return total
