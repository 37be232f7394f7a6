"""Decoding cdcd envelopes into typed Arrow columns, in batches (pure: no Spark, no Kafka).

Why this shape
--------------
Every Kafka message names its *writer* schema in its first bytes (SPEC §6,
:mod:`cdcd.consumer`). A table's messages use several writer schemas over
time (a column added, dropped or renamed makes a new one; replays after a
crash may even interleave old and new ones). A DataFrame needs one schema,
so each table is decoded to one *reader* layout: the newest writer schema,
newest meaning "used by the change with the highest (``cdcd.lsn``,
``cdcd.seq``)" -- not the last one published, because a daemon replaying
after a crash republishes older schemas.

Decoding runs on the executors, one Arrow record batch at a time
(``mapInArrow``, see :mod:`cdcd.spark.dataframes`): per message, fastavro
decodes the body with the message's own writer schema; messages of one
writer schema are then built into Arrow column by column (one call per
column, in the writer's layout) and moved to the reader layout by the
resolution rules of :mod:`cdcd.spark.layout` (aliases rename, defaults fill
columns an old record lacks, exact type conversions). There is no per-row
UDF and no row objects on the driver. :func:`decode_batch` does this for one
topic; :func:`decode_payloads` decodes every topic of a batch in one pass for
the mirror, handing each (topic, writer schema) group back as an Arrow IPC
payload, so the driver picks each table's reader layout after seeing all its
writer schemas.

Writer schemas come from a lookup function (``header -> envelope schema``),
usually :meth:`cdcd.consumer.SchemaCatalog.schema`; the logical types are
stripped before fastavro sees a schema, so values arrive as the raw ints and
bytes Arrow wants, without building ``datetime`` or ``Decimal`` objects per
value.

A column whose type changed is a union of every type it has had (the
current one first): each value is decoded in the branch it was written in
(:func:`_mark_branches` tells them apart) and converted to the current
type. For the mirror, :func:`decode_native` also reads each message key's
schema: the key columns are the change's identity (``NativeChanges.identity``),
which the row schema does not carry.

Decoded columns: ``topic``, ``partition``, ``offset``, ``lsn``, ``seq``,
``op``, ``ts_ms`` (cdcd's processing time), ``commit_ts`` (the commit time,
``source.ts_ms``), ``tx_id``, ``snapshot``, ``source_db``,
``source_schema``, ``source_table``, ``unchanged_toast`` (PostgreSQL column
names), ``before`` and ``after`` (structs of the table's columns by
PostgreSQL name). Tombstones (null values) carry nothing the preceding
delete did not, and are dropped.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from fastavro import parse_schema, schemaless_reader

from cdcd.consumer import wire_header
from cdcd.errors import DefiniteError
from cdcd.spark.layout import (
    CHANGE_COLUMNS,
    PRIMITIVES,
    ColumnType,
    RowLayout,
    changes_arrow_schema,
    column_array,
    column_type,
    convert_column,
    key_columns,
    row_schema_of,
    to_reader,
    union_branches,
)

__all__ = [
    "PAYLOAD_DDL",
    "DecodePlan",
    "HeaderUse",
    "NativeChanges",
    "SchemaLookup",
    "decode_arrow",
    "decode_batch",
    "decode_native",
    "decode_payloads",
    "newest_version",
    "read_payloads",
    "reduce_native",
]

#: ``wire header -> envelope schema``; raises when the schema cannot be found.
SchemaLookup = Callable[[bytes], Mapping[str, Any]]

# ----------------------------------------------------------------------------- writer-native decoding


def _strip_logical(schema: Any) -> Any:
    """A copy of ``schema`` without logical types: fastavro then returns raw ints/bytes."""
    if isinstance(schema, list):
        return [_strip_logical(s) for s in schema]
    if isinstance(schema, dict):
        out = {k: _strip_logical(v) for k, v in schema.items() if k != "logicalType"}
        if "logicalType" in schema and out.get("type") in PRIMITIVES and len(out) == 1:
            return out["type"]
        if out.get("type") == "bytes":
            out.pop("precision", None)
            out.pop("scale", None)
            if len(out) == 1:
                return "bytes"
        return out
    return schema


def _has_several_types(avro: Any) -> bool:
    """Whether a field type holds, anywhere, a union of several types."""
    if isinstance(avro, list):
        return union_branches(avro) is not None or any(_has_several_types(b) for b in avro)
    if isinstance(avro, dict) and avro.get("type") == "array":
        return _has_several_types(avro["items"])
    return False


def _mark_branches(stripped: Any, original: Any, names: Iterator[int]) -> Any:
    """``stripped`` (a field type without logical types) with each branch of every union
    of several types made a record of one field ``b<branch>``: a record of one field is
    encoded exactly as that field's value, so decoding tells which branch a value was
    written in (``{"b<branch>": value}``)."""
    if isinstance(original, list):
        several = union_branches(original) is not None
        out = []
        for b, (plain, branch) in enumerate(zip(stripped, original, strict=True)):
            marked = _mark_branches(plain, branch, names)
            if several and branch != "null":
                marked = {
                    "type": "record",
                    "name": f"cdcd_branch_{next(names)}",
                    "fields": [{"name": f"b{b}", "type": marked}],
                }
            out.append(marked)
        return out
    if isinstance(original, dict) and original.get("type") == "array":
        return {**stripped, "items": _mark_branches(stripped["items"], original["items"], names)}
    return stripped


def _mark_row(stripped: dict[str, Any], row: Mapping[str, Any], fields: set[str]) -> None:
    """:func:`_mark_branches` on the ``fields`` of the row record inside ``stripped``."""
    names = itertools.count()
    for avro_field in stripped.get("fields", ()):
        if avro_field.get("name") != "before":
            continue
        for record in avro_field["type"]:
            if isinstance(record, dict) and record.get("type") == "record":
                for plain, original in zip(record["fields"], row["fields"], strict=True):
                    if original["name"] in fields:
                        plain["type"] = _mark_branches(plain["type"], original["type"], names)


def _build(values: list[Any], avro: Any, target: ColumnType, what: str) -> pa.Array:
    """Raw values of a field type holding unions of several types (marked by
    :func:`_mark_branches`) as one array of ``target``, the column's current type:
    each branch's values are built in their own type and converted exactly."""
    if isinstance(avro, list):
        branches = union_branches(avro)
        if branches is None:
            (single,) = [b for b in avro if b != "null"]
            return _build(values, single, target, what)
        return _build_union(values, avro, target, what)
    if isinstance(avro, dict) and avro.get("type") == "array" and _has_several_types(avro):
        assert target.item is not None
        offsets: list[int] = [0]
        flat: list[Any] = []
        for value in values:
            if value is not None:
                flat.extend(value)
            offsets.append(len(flat))
        items = _build(flat, avro["items"], target.item, what)
        mask = pa.array([v is None for v in values], pa.bool_())
        return pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), items, type=target.arrow(), mask=mask
        )
    source = column_type(avro)
    try:
        return convert_column(column_array(values, source), source, target)
    except ValueError as exc:
        raise DefiniteError(
            f"{what} has values of type {source.describe()} that cannot be converted "
            f"exactly to its type {target.describe()}: {exc}",
            hint="re-snapshot the table under a new topic prefix",
        ) from None


def _build_union(values: list[Any], avro: list[Any], target: ColumnType, what: str) -> pa.Array:
    positions: dict[int, list[int]] = {}
    raws: dict[int, list[Any]] = {}
    for i, value in enumerate(values):
        if value is None:
            continue
        ((label, raw),) = value.items()
        branch = int(label[1:])
        positions.setdefault(branch, []).append(i)
        raws.setdefault(branch, []).append(raw)
    if not positions:
        return pa.nulls(len(values), target.arrow())
    # Concatenate nulls then each branch's values; each position takes its own.
    pieces = [pa.nulls(1, target.arrow())]
    chosen = [0] * len(values)
    start = 1
    for branch, where in positions.items():
        pieces.append(_build(raws[branch], avro[branch], target, what))
        for j, i in enumerate(where):
            chosen[i] = start + j
        start += len(where)
    return pa.concat_arrays(pieces).take(pa.array(chosen, pa.int64()))


@dataclass(frozen=True)
class _Writer:
    parsed: Any
    header_length: int
    layout: RowLayout
    fields: tuple[str, ...]
    #: Field name -> Avro type of the columns holding unions of several types
    #: (a column whose type changed), decoded by :func:`_build`.
    several: Mapping[str, Any] = field(default_factory=dict)


_WRITERS: dict[tuple[bytes, str], _Writer] = {}
_WRITERS_LOCK = threading.Lock()


def _writer_for(header: bytes, schema_of: SchemaLookup) -> _Writer:
    """The parsed writer schema of ``header``, parsed once per process.

    Keyed by the schema text too: a registry id means different schemas in
    different registries.
    """
    envelope = schema_of(header)
    key = (header, json.dumps(envelope, sort_keys=True))
    writer = _WRITERS.get(key)
    if writer is not None:
        return writer
    layout = RowLayout.from_envelope(envelope)
    stripped = _strip_logical(dict(envelope))
    row = row_schema_of(envelope)
    several = {
        str(original["name"]): original["type"]
        for original in row["fields"]
        if _has_several_types(original["type"])
    }
    if several:
        _mark_row(stripped, row, set(several))
    writer = _Writer(
        parse_schema(stripped),
        len(header),
        layout,
        tuple(c.field for c in layout.columns),
        several,
    )
    with _WRITERS_LOCK:
        if len(_WRITERS) > 4096:
            _WRITERS.clear()
        _WRITERS[key] = writer
    return writer


class _Group:
    """Decoded messages of one (topic, writer schema); columns are built at the end."""

    def __init__(
        self, topic: str, header: bytes, writer: _Writer, key_header: bytes | None = None
    ) -> None:
        self.topic = topic
        self.header = header
        self.key_header = key_header
        self.writer = writer
        self.records: list[Any] = []
        self.partitions: list[int] = []
        self.offsets: list[int] = []
        self.rows: list[int] = []

    def _struct(self, images: list[Any]) -> pa.Array:
        layout = self.writer.layout
        several = self.writer.several
        arrays = []
        for c in layout.columns:
            values = [None if image is None else image[c.field] for image in images]
            if c.field in several:
                what = f"{self.topic}: column {c.name!r}"
                arrays.append(_build(values, several[c.field], c.type, what))
            else:
                arrays.append(column_array(values, c.type))
        return pa.StructArray.from_arrays(
            arrays,
            fields=list(layout.arrow_type()),
            mask=pa.array([image is None for image in images], pa.bool_()),
        )

    def table(self) -> pa.Table:
        records = self.records
        sources = [r["source"] for r in records]
        columns: dict[str, list[Any]] = {
            "topic": [self.topic] * len(records),
            "partition": self.partitions,
            "offset": self.offsets,
            "lsn": [s["lsn"] for s in sources],
            "seq": [s["seq"] for s in sources],
            "op": [r["op"] for r in records],
            "ts_ms": [r["ts_ms"] for r in records],
            "commit_ts": [s["ts_ms"] * 1000 for s in sources],
            "tx_id": [s["txId"] for s in sources],
            "snapshot": [s["snapshot"] for s in sources],
            "source_db": [s["db"] for s in sources],
            "source_schema": [s["schema"] for s in sources],
            "source_table": [s["table"] for s in sources],
            "unchanged_toast": [r["unchanged_toast"] for r in records],
        }
        arrays = [pa.array(columns[name], t) for name, t in CHANGE_COLUMNS]
        arrays.append(self._struct([r["before"] for r in records]))
        arrays.append(self._struct([r["after"] for r in records]))
        return pa.Table.from_arrays(arrays, schema=changes_arrow_schema(self.writer.layout))


@dataclass(frozen=True)
class NativeChanges:
    """Decoded changes of one topic written with one schema, in that schema's layout."""

    topic: str
    header: bytes
    layout: RowLayout
    changes: pa.Table
    rows: tuple[int, ...]  # positions of the messages in the input batch
    #: The key columns (PostgreSQL names) of the message keys; () for a table
    #: without a key (null keys); None when unknown (only truncates, or no keys read).
    identity: tuple[str, ...] | None = None


def decode_native(
    batch: pa.RecordBatch | pa.Table, schema_of: SchemaLookup, *, keys: bool = True
) -> list[NativeChanges]:
    """Decode Kafka rows (columns of :mod:`cdcd.spark.source`), each with its writer schema.

    ``keys``: also read the message keys' schemas, for each group's
    ``identity`` (the mirror needs it; a DataFrame of changes does not).

    Tombstones are skipped. A message that is not a cdcd envelope, or whose
    schema cannot be found, is an error naming topic, partition and offset.
    """
    with _gc_paused():
        return _decode_native(batch, schema_of, keys)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Decoding makes thousands of acyclic dicts; the cycle collector would rescan
    them all repeatedly (about 15% of the decode time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _key_header(key: bytes | None) -> bytes | None:
    return wire_header(key) if key else None


def _same_key_schema(key: bytes | None, header: bytes | None) -> bool:
    if not key:
        return header is None
    return header is not None and key.startswith(header)  # headers have a fixed length


def _decode_native(
    batch: pa.RecordBatch | pa.Table, schema_of: SchemaLookup, with_keys: bool
) -> list[NativeChanges]:
    values = batch.column("value").to_pylist()
    topics = batch.column("topic").to_pylist()
    partitions = batch.column("partition").to_pylist()
    offsets = batch.column("offset").to_pylist()
    read_keys = with_keys and "key" in batch.schema.names
    keys: list[bytes | None] = (
        batch.column("key").to_pylist() if read_keys else [None] * len(values)
    )
    # Grouped by key schema too: a table's identity can change (a primary key
    # added) while its row schema stays the same.
    groups: dict[tuple[str, bytes, bytes | None], _Group] = {}
    group: _Group | None = None
    for i, value in enumerate(values):
        if value is None:
            continue  # tombstone
        topic = topics[i]
        key = keys[i]
        try:
            # Consecutive messages mostly share topic, writer and key schema.
            if (
                group is None
                or topic != group.topic
                or not value.startswith(group.header)
                or not _same_key_schema(key, group.key_header)
            ):
                header = wire_header(value)
                key_header = _key_header(key)
                group = groups.get((topic, header, key_header))
                if group is None:
                    group = _Group(topic, header, _writer_for(header, schema_of), key_header)
                    groups[(topic, header, key_header)] = group
            group.records.append(
                schemaless_reader(
                    io.BytesIO(value[group.writer.header_length :]), group.writer.parsed, None
                )
            )
        except (ValueError, KeyError, TypeError, EOFError, IndexError, DefiniteError) as exc:
            raise DefiniteError(
                f"cannot decode {topic} [{partitions[i]}] offset {offsets[i]}: {exc}",
                hint="the topic holds a message cdcd did not write, or its writer schema is missing",
            ) from exc
        group.rows.append(i)
    for g in groups.values():
        g.partitions = [partitions[i] for i in g.rows]
        g.offsets = [offsets[i] for i in g.rows]
    try:
        return [
            NativeChanges(
                g.topic,
                g.header,
                g.writer.layout,
                g.table(),
                tuple(g.rows),
                _identity(g, schema_of) if read_keys else None,
            )
            for g in groups.values()
        ]
    except (KeyError, TypeError, ValueError, pa.ArrowException) as exc:
        # fastavro returned a record that does not fit the envelope shape.
        raise DefiniteError(
            f"cannot decode {', '.join(sorted({t for t, *_ in groups}))}: {exc}",
            hint="the topic holds a message cdcd did not write",
        ) from exc


def _identity(group: _Group, schema_of: SchemaLookup) -> tuple[str, ...] | None:
    """The key columns of a group's messages: the key schema's, () for null keys of row
    changes (a table without a key), None when only truncates (null keys) say nothing."""
    if group.key_header is not None:
        return key_columns(schema_of(group.key_header))
    if any(record["op"] != "t" for record in group.records):
        return ()
    return None


# ----------------------------------------------------------------------------- one topic


@dataclass(frozen=True)
class DecodePlan:
    """What executors need to decode one topic: the reader and every known writer schema.

    Schemas travel as JSON text so the plan pickles small and stays hashable;
    ``lookup`` (if given, e.g. a catalog's ``schema``) finds writer schemas
    that appear later. ``refresh`` (if given, a catalog's ``refresh``) is
    called once per task before decoding, and ``lookup`` then answers first:
    a query that outlives its plan sees schemas republished under a known
    fingerprint (see :mod:`cdcd.consumer`).
    """

    topic: str
    reader: str  # envelope schema JSON whose row record is the reader layout
    writers: tuple[tuple[bytes, str], ...]  # wire header -> envelope schema JSON
    lookup: SchemaLookup | None = field(default=None, compare=False)
    refresh: Callable[[], None] | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        topic: str,
        reader: Mapping[str, Any],
        writers: Mapping[bytes, Mapping[str, Any]],
        lookup: SchemaLookup | None = None,
        refresh: Callable[[], None] | None = None,
    ) -> DecodePlan:
        return cls(
            topic,
            json.dumps(reader, sort_keys=True),
            tuple(sorted((h, json.dumps(s, sort_keys=True)) for h, s in writers.items())),
            lookup,
            refresh,
        )

    @cached_property
    def layout(self) -> RowLayout:
        return RowLayout.from_envelope(json.loads(self.reader))

    def schema_of(self, header: bytes) -> Mapping[str, Any]:
        if self.lookup is not None and self.refresh is not None:
            return self.lookup(header)
        for known, text in self.writers:
            if known == header:
                parsed: dict[str, Any] = json.loads(text)
                return parsed
        if self.lookup is not None:
            return self.lookup(header)
        raise ValueError(f"writer schema {header.hex()} is not known")


def decode_batch(batch: pa.RecordBatch | pa.Table, plan: DecodePlan) -> pa.RecordBatch:
    """Decode one topic's Kafka rows to ``plan``'s reader layout, in input order."""
    reader = plan.layout
    parts = [
        (native.rows, to_reader(native.changes, native.layout, reader, plan.topic))
        for native in decode_native(batch, plan.schema_of, keys=False)
        if native.topic == plan.topic
    ]
    schema = changes_arrow_schema(reader)
    if not parts:
        return pa.RecordBatch.from_pylist([], schema=schema)
    table = pa.concat_tables([t for _, t in parts])
    positions = [p for rows, _ in parts for p in rows]
    if len(parts) > 1:
        order = sorted(range(len(positions)), key=positions.__getitem__)
        table = table.take(pa.array(order, pa.int64()))
    return table.combine_chunks().to_batches()[0]


def decode_arrow(batches: Iterable[pa.RecordBatch], plan: DecodePlan) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: decoded batches, empty ones skipped."""
    if plan.refresh is not None:
        plan.refresh()  # the task's messages were written before it started
    for batch in batches:
        if batch.num_rows:
            decoded = decode_batch(batch, plan)
            if decoded.num_rows:
                yield decoded


# ----------------------------------------------------------------------------- all topics at once

#: One row per (input batch, topic, writer schema): the decoded changes as an Arrow IPC stream.
PAYLOAD_DDL = "topic string, header binary, identity string, payload binary"
_PAYLOAD_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("header", pa.binary()),
        pa.field("identity", pa.string()),  # JSON list of key columns; null: unknown
        pa.field("payload", pa.binary()),
    ]
)


#: Changes per payload row of :func:`decode_payloads`.
PAYLOAD_ROWS = 50_000


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def reduce_native(native: NativeChanges, *, per_commit: bool = False) -> NativeChanges:
    """``native``'s changes with each key's runs of upserts collapsed to their last one.

    Exact for the mirror: per key (the message key; keyless changes are left
    alone), consecutive inserts, reads and updates between two deletes
    become the last of them, its unchanged TOAST columns filled from the run
    (the stored row supplies the rest, as before), its operation the run's
    first when that was an insert or read. Deletes stay (a key change's
    create takes its TOAST values from the deleted row), and so does any run
    holding a create with unchanged TOAST values (a key change's second
    half). A key's changes all travel on one Kafka partition, so reducing
    what one Spark task read loses nothing. ``per_commit``: runs end at a new
    commit LSN (history tables keep one version per transaction).
    """
    identity = native.identity
    changes = native.changes
    if not identity or changes.num_rows < 2:
        return native
    meta = changes.select(["lsn", "seq", "op", "unchanged_toast"]).to_pydict()
    lsns, seqs, ops, toasts = meta["lsn"], meta["seq"], meta["op"], meta["unchanged_toast"]
    image = pc.if_else(pc.equal(changes.column("op"), "d"), changes.column("before"),
                       changes.column("after"))  # fmt: skip
    key_values = [pc.struct_field(image, name).to_pylist() for name in identity]
    keys = [tuple(_hashable(v) for v in key) for key in zip(*key_values, strict=True)]
    dropped: set[int] = set()
    fills: dict[int, tuple[str, dict[str, Any]]] = {}  # kept change -> (op, TOAST values)
    after = changes.column("after")

    def finish(run: list[int]) -> None:
        if len(run) < 2 or any(ops[i] == "c" and toasts[i] for i in run):
            return
        last = run[-1]
        values: dict[str, Any] = {}
        for column in toasts[last] or ():
            for j in reversed(run[:-1]):
                if column not in (toasts[j] or ()):
                    values[column] = after[j].as_py()[column]
                    break
        op = ops[run[0]] if ops[run[0]] in ("c", "r") else ops[last]
        if values or op != ops[last]:
            fills[last] = (op, values)
        dropped.update(run[:-1])

    runs: dict[Any, list[int]] = {}
    for i in sorted(range(changes.num_rows), key=lambda i: (lsns[i], seqs[i])):
        if ops[i] not in ("c", "r", "u"):
            finish(runs.pop(keys[i], []))
            continue
        run = runs.setdefault(keys[i], [])
        if run and (lsns[run[-1]], seqs[run[-1]]) == (lsns[i], seqs[i]):
            dropped.add(i)  # a repeat (the daemon replayed it)
            continue
        if per_commit and run and lsns[run[-1]] != lsns[i]:
            finish(run)
            run = runs[keys[i]] = []
        run.append(i)
    for run in runs.values():
        finish(run)
    if not dropped:
        return native
    kept = [i for i in range(changes.num_rows) if i not in dropped and i not in fills]
    parts = [changes.take(pa.array(kept, pa.int64()))]
    if fills:
        rows = changes.take(pa.array(list(fills), pa.int64())).to_pylist()
        for row, (op, values) in zip(rows, fills.values(), strict=True):
            row["op"] = op
            row["after"] = {**row["after"], **values}
            row["unchanged_toast"] = [c for c in row["unchanged_toast"] or () if c not in values]
        parts.append(pa.Table.from_pylist(rows, schema=changes.schema))
    return replace(native, changes=pa.concat_tables(parts), rows=())


def decode_payloads(
    batches: Iterable[pa.RecordBatch], schema_of: SchemaLookup, per_commit: bool = False
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body decoding every topic at once, each message with its writer schema.

    Tables have different columns, so their decoded changes travel as Arrow
    IPC payloads; :func:`read_payloads` turns them back into tables on the
    driver, which picks each table's reader layout once it has seen every
    writer schema of the batch. Each task reduces what it read first
    (:func:`reduce_native`): the driver receives at most the last change of
    each key's run of upserts, deletes and keyless changes.
    """
    decoded: dict[tuple[str, bytes, str | None], list[pa.Table]] = {}
    first: dict[tuple[str, bytes, str | None], NativeChanges] = {}
    for batch in batches:
        if not batch.num_rows:
            continue
        for native in decode_native(batch, schema_of):
            group = (native.topic, native.header, _identity_text(native.identity))
            first.setdefault(group, native)
            decoded.setdefault(group, []).append(native.changes)
    natives = [
        reduce_native(
            replace(first[g], changes=pa.concat_tables(t), rows=()), per_commit=per_commit
        )
        for g, t in decoded.items()
    ]
    yield from payload_rows(natives)


def payload_rows(natives: Iterable[NativeChanges]) -> Iterator[pa.RecordBatch]:
    """Decoded changes as :data:`PAYLOAD_DDL` rows (what :func:`read_payloads` reads)."""
    # At most PAYLOAD_ROWS changes per payload: one value of a few MB, not one
    # the size of a task's share of a snapshot (the JVM holds each value whole).
    chunks = [
        (n, n.changes.slice(start, PAYLOAD_ROWS))
        for n in natives
        for start in range(0, n.changes.num_rows, PAYLOAD_ROWS)
    ]
    if chunks:
        yield pa.RecordBatch.from_pydict(
            {
                "topic": [n.topic for n, _ in chunks],
                "header": [n.header for n, _ in chunks],
                "identity": [_identity_text(n.identity) for n, _ in chunks],
                "payload": [_ipc(chunk) for _, chunk in chunks],
            },
            schema=_PAYLOAD_SCHEMA,
        )


def _identity_text(identity: tuple[str, ...] | None) -> str | None:
    return None if identity is None else json.dumps(list(identity))


def read_payloads(payloads: pa.Table, schema_of: SchemaLookup) -> dict[str, list[NativeChanges]]:
    """The output of :func:`decode_payloads`, by topic."""
    out: dict[str, list[NativeChanges]] = {}
    topics = payloads.column("topic").to_pylist()
    headers = payloads.column("header").to_pylist()
    identities = payloads.column("identity").to_pylist()
    for i, (topic, header, identity) in enumerate(zip(topics, headers, identities, strict=True)):
        data = payloads.column("payload")[i].as_buffer()
        changes = pa.ipc.open_stream(data).read_all()
        layout = RowLayout.from_envelope(schema_of(header))
        key = None if identity is None else tuple(json.loads(identity))
        out.setdefault(topic, []).append(NativeChanges(topic, header, layout, changes, (), key))
    return out


def newest_version(changes: pa.Table) -> tuple[int, int]:
    """The highest (lsn, seq) in decoded changes ((-1, -1) when empty)."""
    if changes.num_rows == 0:
        return (-1, -1)
    lsn = pc.max(changes.column("lsn")).as_py()
    seqs = changes.filter(pc.equal(changes.column("lsn"), lsn)).column("seq")
    return (int(lsn), int(pc.max(seqs).as_py()))


@dataclass(frozen=True)
class HeaderUse:
    """A writer schema seen in a topic, and the newest change written with it."""

    topic: str
    header: bytes
    lsn: int | None
    seq: int | None
    count: int

    @property
    def version(self) -> tuple[int, int]:
        return (self.lsn if self.lsn is not None else -1, self.seq if self.seq is not None else -1)
