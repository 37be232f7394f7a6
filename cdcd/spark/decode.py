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
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    RowLayout,
    changes_arrow_schema,
    column_array,
    to_reader,
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


@dataclass(frozen=True)
class _Writer:
    parsed: Any
    header_length: int
    layout: RowLayout
    fields: tuple[str, ...]


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
    writer = _Writer(
        parse_schema(_strip_logical(dict(envelope))),
        len(header),
        layout,
        tuple(c.field for c in layout.columns),
    )
    with _WRITERS_LOCK:
        if len(_WRITERS) > 4096:
            _WRITERS.clear()
        _WRITERS[key] = writer
    return writer


class _Group:
    """Decoded messages of one (topic, writer schema); columns are built at the end."""

    def __init__(self, topic: str, header: bytes, writer: _Writer) -> None:
        self.topic = topic
        self.header = header
        self.writer = writer
        self.records: list[Any] = []
        self.partitions: list[int] = []
        self.offsets: list[int] = []
        self.rows: list[int] = []

    def _struct(self, images: list[Any]) -> pa.Array:
        layout = self.writer.layout
        arrays = [
            column_array([None if image is None else image[c.field] for image in images], c.type)
            for c in layout.columns
        ]
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


def decode_native(batch: pa.RecordBatch | pa.Table, schema_of: SchemaLookup) -> list[NativeChanges]:
    """Decode Kafka rows (columns of :mod:`cdcd.spark.source`), each with its writer schema.

    Tombstones are skipped. A message that is not a cdcd envelope, or whose
    schema cannot be found, is an error naming topic, partition and offset.
    """
    with _gc_paused():
        return _decode_native(batch, schema_of)


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


def _decode_native(
    batch: pa.RecordBatch | pa.Table, schema_of: SchemaLookup
) -> list[NativeChanges]:
    values = batch.column("value").to_pylist()
    topics = batch.column("topic").to_pylist()
    partitions = batch.column("partition").to_pylist()
    offsets = batch.column("offset").to_pylist()
    groups: dict[tuple[str, bytes], _Group] = {}
    group: _Group | None = None
    for i, value in enumerate(values):
        if value is None:
            continue  # tombstone
        topic = topics[i]
        try:
            # Consecutive messages mostly share topic and writer schema.
            if group is None or topic != group.topic or not value.startswith(group.header):
                header = wire_header(value)
                group = groups.get((topic, header))
                if group is None:
                    group = _Group(topic, header, _writer_for(header, schema_of))
                    groups[(topic, header)] = group
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
            NativeChanges(g.topic, g.header, g.writer.layout, g.table(), tuple(g.rows))
            for g in groups.values()
        ]
    except (KeyError, TypeError, ValueError, pa.ArrowException) as exc:
        # fastavro returned a record that does not fit the envelope shape.
        raise DefiniteError(
            f"cannot decode {', '.join(sorted({t for t, _ in groups}))}: {exc}",
            hint="the topic holds a message cdcd did not write",
        ) from exc


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
        for native in decode_native(batch, plan.schema_of)
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
PAYLOAD_DDL = "topic string, header binary, payload binary"
_PAYLOAD_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("header", pa.binary()),
        pa.field("payload", pa.binary()),
    ]
)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def decode_payloads(
    batches: Iterable[pa.RecordBatch], schema_of: SchemaLookup
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body decoding every topic at once, each message with its writer schema.

    Tables have different columns, so their decoded changes travel as Arrow
    IPC payloads; :func:`read_payloads` turns them back into tables on the
    driver, which picks each table's reader layout once it has seen every
    writer schema of the batch.
    """
    for batch in batches:
        if not batch.num_rows:
            continue
        natives = decode_native(batch, schema_of)
        if natives:
            yield pa.RecordBatch.from_pydict(
                {
                    "topic": [n.topic for n in natives],
                    "header": [n.header for n in natives],
                    "payload": [_ipc(n.changes) for n in natives],
                },
                schema=_PAYLOAD_SCHEMA,
            )


def read_payloads(payloads: pa.Table, schema_of: SchemaLookup) -> dict[str, list[NativeChanges]]:
    """The output of :func:`decode_payloads`, by topic."""
    out: dict[str, list[NativeChanges]] = {}
    topics = payloads.column("topic").to_pylist()
    headers = payloads.column("header").to_pylist()
    for i, (topic, header) in enumerate(zip(topics, headers, strict=True)):
        data = payloads.column("payload")[i].as_buffer()
        changes = pa.ipc.open_stream(data).read_all()
        layout = RowLayout.from_envelope(schema_of(header))
        out.setdefault(topic, []).append(NativeChanges(topic, header, layout, changes, ()))
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
