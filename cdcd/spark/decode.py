"""Decoding cdcd envelopes into typed columns, in batches (``mapInArrow``).

Why this shape
--------------
Every Kafka message names its *writer* schema in its first bytes (SPEC §6):
``C3 01`` + an 8-byte fingerprint whose schema is in ``<prefix>._schemas``, or
``00`` + a 4-byte Confluent registry id. A table's messages use several writer
schemas over time (a column added or dropped makes a new one; replays after
a crash may even interleave old and new ones). A DataFrame needs one schema,
so each table is decoded to one *reader* layout: the newest writer schema,
newest meaning "used by the change with the highest (``cdcd.lsn``,
``cdcd.seq``)" -- not the last one published, because a daemon replaying
after a crash republishes older schemas.

Decoding runs on the executors, one Arrow record batch at a time
(``mapInArrow``): per message, fastavro decodes the body with the message's
own writer schema; messages of one writer schema are then built into Arrow
column by column (one call per column, in the writer's layout) and moved to
the reader layout by PostgreSQL column name (the Avro field name, or the
original name kept in the field attribute ``cdcd.column`` when the name had
to be sanitized). There is no per-row UDF and no row objects on the driver.
:func:`decode_changes` does this for one topic; :func:`decode_payloads`
decodes every topic of a batch in one pass for the mirror, handing each
(topic, writer schema) group back as an Arrow IPC payload, so the driver
picks each table's reader layout after seeing all its writer schemas.

Resolution is by column name rather than Avro schema resolution, because the
mirror needs more than Avro's rules: a column that the reader lacks is
dropped, one the writer lacks is null, and a column whose type changed
(``ALTER COLUMN ... TYPE``) is converted with Arrow's casts where that is
exact (int -> long -> double, decimal scale widening, decimal <-> text,
date -> timestamp, ...); anything else fails with an error naming table,
column and types rather than guessing.

Types (SPEC §5 to Spark)
------------------------
boolean, int, long, float, double, string (uuid, json and the text forms too),
bytes -> BinaryType; decimal(p,s) -> DecimalType(p,s) when p <= 38, else
StringType holding the exact decimal text (Spark cannot hold more digits);
date -> DateType; timestamp-micros -> TimestampType (UTC instants);
local-timestamp-micros -> TimestampNTZType; time-micros -> LongType,
microseconds since midnight (Spark's Arrow bridge has no TIME type; this is
also what ``from_avro`` gives); arrays -> ArrayType with nullable elements,
nested for more dimensions. The logical types are stripped before fastavro
sees the schema, so values arrive as the raw ints and bytes Arrow wants,
without building ``datetime`` or ``Decimal`` objects per value.

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
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from fastavro import parse_schema, schemaless_reader

from cdcd.envelope.schemas import avro_namespace
from cdcd.errors import CdcdError, DefiniteError, TransientError
from cdcd.naming import CONFLUENT_MAGIC, ORIGINAL_NAME_ATTRIBUTE, SINGLE_OBJECT_MAGIC, schemas_topic

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType, StructType

    from cdcd.config.model import CdcdConfig
    from cdcd.spark.source import KafkaOptions

__all__ = [
    "CHANGE_COLUMNS",
    "PAYLOAD_DDL",
    "Column",
    "ColumnType",
    "DecodePlan",
    "HeaderUse",
    "NativeChanges",
    "RowLayout",
    "SchemaCatalog",
    "changes_arrow_schema",
    "changes_spark_schema",
    "convert_column",
    "convert_rows",
    "decode_arrow",
    "decode_batch",
    "decode_changes",
    "decode_native",
    "decode_payloads",
    "header_summary",
    "newest_version",
    "read_payloads",
    "to_reader",
    "wire_header",
]

MAX_SPARK_PRECISION = 38

# ----------------------------------------------------------------------------- types


@dataclass(frozen=True)
class ColumnType:
    """A column's type: the Avro mapping of SPEC §5, as Arrow and Spark see it."""

    kind: str  # boolean int long float double string bytes decimal date time timestamp local_timestamp array
    precision: int = 0
    scale: int = 0
    item: ColumnType | None = None

    @property
    def wide_decimal(self) -> bool:
        """A decimal Spark cannot hold: carried as its exact text."""
        return self.kind == "decimal" and self.precision > MAX_SPARK_PRECISION

    def arrow(self) -> pa.DataType:
        kind = self.kind
        if kind == "array":
            assert self.item is not None
            return pa.list_(pa.field("element", self.item.arrow()))
        if kind == "decimal":
            return pa.string() if self.wide_decimal else pa.decimal128(self.precision, self.scale)
        return _ARROW[kind]

    def spark(self) -> DataType:
        from pyspark.sql import types as T

        kind = self.kind
        if kind == "array":
            assert self.item is not None
            return T.ArrayType(self.item.spark(), containsNull=True)
        if kind == "decimal":
            return (
                T.StringType() if self.wide_decimal else T.DecimalType(self.precision, self.scale)
            )
        simple: dict[str, DataType] = {
            "boolean": T.BooleanType(),
            "int": T.IntegerType(),
            "long": T.LongType(),
            "float": T.FloatType(),
            "double": T.DoubleType(),
            "string": T.StringType(),
            "bytes": T.BinaryType(),
            "date": T.DateType(),
            "time": T.LongType(),
            "timestamp": T.TimestampType(),
            "local_timestamp": T.TimestampNTZType(),
        }
        return simple[kind]

    def describe(self) -> str:
        if self.kind == "decimal":
            return f"decimal({self.precision},{self.scale})"
        if self.kind == "array":
            assert self.item is not None
            return f"array<{self.item.describe()}>"
        return self.kind

    @property
    def needs_python_conversion(self) -> bool:
        """Arrow cannot take the raw Avro value as it is (decimal bytes)."""
        if self.kind == "decimal":
            return True
        return self.item is not None and self.item.needs_python_conversion


_ARROW: dict[str, pa.DataType] = {
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "bytes": pa.binary(),
    "date": pa.date32(),
    "time": pa.int64(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "local_timestamp": pa.timestamp("us"),
}
_PRIMITIVES = {"boolean", "int", "long", "float", "double", "string", "bytes"}
_LOGICAL = {
    ("int", "date"): "date",
    ("long", "time-micros"): "time",
    ("long", "timestamp-micros"): "timestamp",
    ("long", "local-timestamp-micros"): "local_timestamp",
}


def column_type(avro: Any) -> ColumnType:
    """The :class:`ColumnType` of an Avro field type as cdcd writes them."""
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        if len(branches) != 1:
            raise DefiniteError(f"unsupported Avro union {avro!r} in a row schema")
        return column_type(branches[0])
    if isinstance(avro, str):
        if avro in _PRIMITIVES:
            return ColumnType(avro)
        raise DefiniteError(f"unsupported Avro type {avro!r} in a row schema")
    if isinstance(avro, dict):
        base = avro.get("type")
        logical = avro.get("logicalType")
        if base == "array":
            return ColumnType("array", item=column_type(avro["items"]))
        if base == "bytes" and logical == "decimal":
            return ColumnType("decimal", int(avro["precision"]), int(avro.get("scale", 0)))
        kind = _LOGICAL.get((base, str(logical))) if isinstance(base, str) else None
        if kind is not None:
            return ColumnType(kind)
        # Unknown logical types fall back to the underlying type (Avro spec).
        return column_type(base)
    raise DefiniteError(f"unsupported Avro type {avro!r} in a row schema")


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Column:
    """One table column: PostgreSQL name, Avro field name, type, key membership."""

    name: str
    field: str
    type: ColumnType
    key: bool


@dataclass(frozen=True)
class RowLayout:
    """A table's columns in order, from an envelope schema."""

    columns: tuple[Column, ...]

    @classmethod
    def from_envelope(cls, envelope: Mapping[str, Any]) -> RowLayout:
        return cls.from_row(row_schema_of(envelope))

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RowLayout:
        columns = []
        for avro_field in row["fields"]:
            avro_type = avro_field["type"]
            columns.append(
                Column(
                    name=str(avro_field.get(ORIGINAL_NAME_ATTRIBUTE, avro_field["name"])),
                    field=str(avro_field["name"]),
                    type=column_type(avro_type),
                    # cdcd makes key columns required and every other column ["null", T].
                    key=not isinstance(avro_type, list),
                )
            )
        return cls(tuple(columns))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)

    def arrow_type(self) -> pa.StructType:
        return pa.struct([pa.field(c.name, c.type.arrow()) for c in self.columns])

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.type.arrow()) for c in self.columns])

    def spark_type(self) -> StructType:
        from pyspark.sql import types as T

        return T.StructType([T.StructField(c.name, c.type.spark(), True) for c in self.columns])


def row_schema_of(envelope: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Value`` row record inside an envelope schema (the ``before`` field's type)."""
    for avro_field in envelope.get("fields", ()):
        if avro_field.get("name") == "before":
            for branch in avro_field["type"]:
                if isinstance(branch, dict) and branch.get("type") == "record":
                    return branch
    raise DefiniteError(
        f"schema {envelope.get('namespace', '')}.{envelope.get('name', '?')} is not a cdcd envelope"
    )


def is_envelope_for(envelope: Mapping[str, Any], topic: str) -> bool:
    return envelope.get("name") == "Envelope" and envelope.get("namespace") == avro_namespace(topic)


# ----------------------------------------------------------------------------- output schema

#: Decoded columns before ``before``/``after``, with their Arrow types.
CHANGE_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("topic", pa.string()),
    ("partition", pa.int32()),
    ("offset", pa.int64()),
    ("lsn", pa.int64()),
    ("seq", pa.int64()),
    ("op", pa.string()),
    ("ts_ms", pa.int64()),
    ("commit_ts", pa.timestamp("us", tz="UTC")),
    ("tx_id", pa.int64()),
    ("snapshot", pa.bool_()),
    ("source_db", pa.string()),
    ("source_schema", pa.string()),
    ("source_table", pa.string()),
    ("unchanged_toast", pa.list_(pa.field("element", pa.string()))),
)


def changes_arrow_schema(layout: RowLayout) -> pa.Schema:
    row = layout.arrow_type()
    return pa.schema(
        [pa.field(name, t) for name, t in CHANGE_COLUMNS]
        + [pa.field("before", row), pa.field("after", row)]
    )


def changes_spark_schema(layout: RowLayout) -> StructType:
    from pyspark.sql import types as T

    row = layout.spark_type()
    return T.StructType(
        [
            T.StructField("topic", T.StringType()),
            T.StructField("partition", T.IntegerType()),
            T.StructField("offset", T.LongType()),
            T.StructField("lsn", T.LongType()),
            T.StructField("seq", T.LongType()),
            T.StructField("op", T.StringType()),
            T.StructField("ts_ms", T.LongType()),
            T.StructField("commit_ts", T.TimestampType()),
            T.StructField("tx_id", T.LongType()),
            T.StructField("snapshot", T.BooleanType()),
            T.StructField("source_db", T.StringType()),
            T.StructField("source_schema", T.StringType()),
            T.StructField("source_table", T.StringType()),
            T.StructField("unchanged_toast", T.ArrayType(T.StringType(), True)),
            T.StructField("before", row),
            T.StructField("after", row),
        ]
    )


# ----------------------------------------------------------------------------- wire headers


def wire_header(value: bytes) -> bytes:
    """The schema-identifying prefix of a value: 10 bytes single-object, 5 Confluent."""
    if value[:2] == SINGLE_OBJECT_MAGIC and len(value) >= 10:
        return value[:10]
    if value[:1] == CONFLUENT_MAGIC and len(value) >= 5:
        return value[:5]
    raise ValueError(f"not a cdcd message (starts with {value[:10].hex() or 'nothing'})")


# ----------------------------------------------------------------------------- raw values to Arrow


def _unscaled(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


def _decimal_value(raw: bytes, scale: int) -> Decimal:
    # Exact: a Decimal built from text is never rounded to the context precision.
    return Decimal(f"{_unscaled(raw)}E-{scale}")


def _decimal_text(raw: bytes, scale: int) -> str:
    return format(_decimal_value(raw, scale), "f")


def _python_value(value: Any, ctype: ColumnType) -> Any:
    """A raw Avro value as a Python object Arrow takes, for types that need one."""
    if value is None:
        return None
    if ctype.kind == "decimal":
        return (
            _decimal_text(value, ctype.scale)
            if ctype.wide_decimal
            else _decimal_value(value, ctype.scale)
        )
    if ctype.kind == "array":
        assert ctype.item is not None
        item = ctype.item
        return [_python_value(v, item) for v in value]
    return value


def column_array(values: list[Any], ctype: ColumnType) -> pa.Array:
    """One Arrow array from raw Avro values (None for null)."""
    if ctype.kind == "decimal":
        if ctype.wide_decimal:
            scale = ctype.scale
            return pa.array(
                [None if v is None else _decimal_text(v, scale) for v in values], pa.string()
            )
        # decimal128 is 16-byte little-endian two's complement: build those bytes
        # and view them, rather than making a Decimal per value.
        fixed = pa.array(
            [
                None if v is None else _unscaled(v).to_bytes(16, "little", signed=True)
                for v in values
            ],
            pa.binary(16),
        )
        return fixed.view(ctype.arrow())
    if ctype.needs_python_conversion:
        values = [_python_value(v, ctype) for v in values]
    return pa.array(values, ctype.arrow())


# ----------------------------------------------------------------------------- conversions

#: PostgreSQL numeric(p,s) has at most 1000 digits: no rounding in this context.
_EXACT = Context(prec=2000, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _rescale_text(array: pa.Array, scale: int) -> pa.Array:
    """Decimal text at another scale, exactly (wide decimals travel as text)."""
    quantum = Decimal(1).scaleb(-scale)
    out: list[str | None] = []
    for text in array.to_pylist():
        if text is None:
            out.append(None)
            continue
        value = Decimal(text)
        rescaled = value.quantize(quantum, context=_EXACT)
        if rescaled != value:
            raise ValueError(f"{text} has more than {scale} decimals")
        out.append(format(rescaled, "f"))
    return pa.array(out, pa.string())


def convert_column(array: pa.Array, source: ColumnType, target: ColumnType) -> pa.Array:
    """``array`` of ``source`` values as ``target`` values, exactly, or ``ValueError``.

    Arrow's casts do the work (int -> long -> double, decimal rescaling,
    decimal <-> text, date -> timestamp, ...) and refuse anything lossy.
    """
    wanted = target.arrow()
    if source == target and array.type == wanted:
        return array
    try:
        converted = array.cast(wanted) if array.type != wanted else array
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise ValueError(str(exc)) from exc
    if target.wide_decimal and source.kind == "decimal" and source.scale != target.scale:
        converted = _rescale_text(converted, target.scale)
    return converted


def convert_rows(
    array: pa.Array, writer: RowLayout, reader: RowLayout, topic: str = ""
) -> pa.Array:
    """A struct array of ``writer`` rows as ``reader`` rows: by PostgreSQL column name."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if writer == reader:
        return array
    children = array.flatten()
    by_name = {c.name: (i, c) for i, c in enumerate(writer.columns)}
    converted = []
    for column in reader.columns:
        found = by_name.get(column.name)
        if found is None:
            converted.append(pa.nulls(len(array), column.type.arrow()))
            continue
        index, source = found
        try:
            converted.append(convert_column(children[index], source.type, column.type))
        except ValueError as exc:
            raise DefiniteError(
                f"{topic or 'a topic'}: column {column.name!r} changed type from "
                f"{source.type.describe()} to {column.type.describe()} and older values cannot "
                f"be converted exactly: {exc}",
                hint="re-snapshot the table under a new topic prefix, "
                "or mirror into a new output directory",
            ) from None
    return pa.StructArray.from_arrays(
        converted, fields=list(reader.arrow_type()), mask=array.is_null()
    )


def to_reader(changes: pa.Table, writer: RowLayout, reader: RowLayout, topic: str = "") -> pa.Table:
    """Decoded changes in ``writer``'s layout, converted to ``reader``'s."""
    if writer == reader:
        return changes
    schema = changes_arrow_schema(reader)
    arrays = [changes.column(name) for name, _ in CHANGE_COLUMNS]
    arrays.append(convert_rows(changes.column("before"), writer, reader, topic))
    arrays.append(convert_rows(changes.column("after"), writer, reader, topic))
    return pa.Table.from_arrays(arrays, schema=schema)


# ----------------------------------------------------------------------------- writer-native decoding

SchemaLookup = Callable[[bytes], Mapping[str, Any]]


def _strip_logical(schema: Any) -> Any:
    """A copy of ``schema`` without logical types: fastavro then returns raw ints/bytes."""
    if isinstance(schema, list):
        return [_strip_logical(s) for s in schema]
    if isinstance(schema, dict):
        out = {k: _strip_logical(v) for k, v in schema.items() if k != "logicalType"}
        if "logicalType" in schema and out.get("type") in _PRIMITIVES and len(out) == 1:
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


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class DecodePlan:
    """What executors need to decode one topic: the reader and every known writer schema.

    Schemas travel as JSON text so the plan pickles small and stays hashable;
    ``catalog`` (if given) finds writer schemas that appear later.
    """

    topic: str
    reader: str  # envelope schema JSON whose row record is the reader layout
    writers: tuple[tuple[bytes, str], ...]  # wire header -> envelope schema JSON
    catalog: SchemaCatalog | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        topic: str,
        reader: Mapping[str, Any],
        writers: Mapping[bytes, Mapping[str, Any]],
        catalog: SchemaCatalog | None = None,
    ) -> DecodePlan:
        return cls(
            topic,
            json.dumps(reader, sort_keys=True),
            tuple(sorted((h, json.dumps(s, sort_keys=True)) for h, s in writers.items())),
            catalog,
        )

    @cached_property
    def layout(self) -> RowLayout:
        return RowLayout.from_envelope(json.loads(self.reader))

    def schema_of(self, header: bytes) -> Mapping[str, Any]:
        for known, text in self.writers:
            if known == header:
                parsed: dict[str, Any] = json.loads(text)
                return parsed
        if self.catalog is not None:
            return self.catalog.schema(header)
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
    for batch in batches:
        if batch.num_rows:
            decoded = decode_batch(batch, plan)
            if decoded.num_rows:
                yield decoded


def decode_changes(raw: DataFrame, plan: DecodePlan) -> DataFrame:
    """The decoded changes of ``plan.topic`` in ``raw`` (Kafka rows), computed on executors."""
    from pyspark.sql import functions as F

    return raw.where(F.col("topic") == plan.topic).mapInArrow(
        partial(decode_arrow, plan=plan), changes_spark_schema(plan.layout)
    )


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
    batches: Iterable[pa.RecordBatch], catalog: SchemaCatalog
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
        natives = decode_native(batch, catalog.schema)
        if natives:
            yield pa.RecordBatch.from_pydict(
                {
                    "topic": [n.topic for n in natives],
                    "header": [n.header for n in natives],
                    "payload": [_ipc(n.changes) for n in natives],
                },
                schema=_PAYLOAD_SCHEMA,
            )


def read_payloads(payloads: pa.Table, catalog: SchemaCatalog) -> dict[str, list[NativeChanges]]:
    """The output of :func:`decode_payloads`, by topic."""
    out: dict[str, list[NativeChanges]] = {}
    topics = payloads.column("topic").to_pylist()
    headers = payloads.column("header").to_pylist()
    for i, (topic, header) in enumerate(zip(topics, headers, strict=True)):
        data = payloads.column("payload")[i].as_buffer()
        changes = pa.ipc.open_stream(data).read_all()
        layout = RowLayout.from_envelope(catalog.schema(header))
        out.setdefault(topic, []).append(NativeChanges(topic, header, layout, changes, ()))
    return out


def newest_version(changes: pa.Table) -> tuple[int, int]:
    """The highest (lsn, seq) in decoded changes ((-1, -1) when empty)."""
    if changes.num_rows == 0:
        return (-1, -1)
    lsn = pc.max(changes.column("lsn")).as_py()
    seqs = changes.filter(pc.equal(changes.column("lsn"), lsn)).column("seq")
    return (int(lsn), int(pc.max(seqs).as_py()))


# ----------------------------------------------------------------------------- header summary


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


_HEADER_SQL = (
    "CASE WHEN value IS NULL THEN NULL "
    "WHEN substring(value, 1, 2) = X'C301' THEN substring(value, 1, 10) "
    "WHEN substring(value, 1, 1) = X'00' THEN substring(value, 1, 5) "
    "ELSE substring(value, 1, 2) END"
)
_LSN_TEXT = "CAST(try_element_at(filter(headers, h -> h.key = 'cdcd.lsn'), 1).value AS STRING)"
_SEQ_TEXT = "CAST(try_element_at(filter(headers, h -> h.key = 'cdcd.seq'), 1).value AS STRING)"
_LSN_SQL = (
    f"shiftleft(try_cast(conv(substring_index({_LSN_TEXT}, '/', 1), 16, 10) AS BIGINT), 32) "
    f"+ try_cast(conv(substring_index({_LSN_TEXT}, '/', -1), 16, 10) AS BIGINT)"
)
_SEQ_SQL = f"try_cast({_SEQ_TEXT} AS BIGINT)"


def header_summary(raw: DataFrame) -> list[HeaderUse]:
    """Per topic and writer schema: the newest (lsn, seq) and the number of messages.

    A small aggregation over the message headers and the first bytes of the
    values; no Avro decoding.
    """
    from pyspark.sql import functions as F

    rows = (
        raw.where(F.col("value").isNotNull())
        .select(
            F.col("topic"),
            F.expr(_HEADER_SQL).alias("header"),
            F.struct(F.expr(_LSN_SQL).alias("lsn"), F.expr(_SEQ_SQL).alias("seq")).alias("v"),
        )
        .groupBy("topic", "header")
        .agg(F.max("v").alias("v"), F.count(F.lit(1)).alias("n"))
        .collect()
    )
    return [
        HeaderUse(
            row["topic"], bytes(row["header"]), row["v"]["lsn"], row["v"]["seq"], int(row["n"])
        )
        for row in rows
    ]


# ----------------------------------------------------------------------------- registry


def _registry_status(exc: BaseException) -> int | None:
    """The HTTP status of the registry's answer, or None if ``exc`` is not an answer."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    return exc.http_status_code if isinstance(exc, SchemaRegistryError) else None


def _no_answer(exc: BaseException) -> bool:
    """Whether the registry request failed before any answer: connection, timeout, TLS.

    The registry client raises SchemaRegistryError for every answer; without
    one it raises its HTTP library's errors: httpx's or httpx2's
    ``TransportError`` (which cdcd does not import: the client picks the
    library) or, with older clients, requests' errors, which are OSErrors.
    """
    if isinstance(exc, OSError):
        return True
    return any(
        cls.__name__ == "TransportError" and cls.__module__.partition(".")[0] in ("httpx", "httpx2")
        for cls in type(exc).__mro__
    )


def _registry_error(exc: Exception, what: str) -> CdcdError | None:
    """Classify a failed registry lookup of ``what`` (e.g. ``schema id 7``).

    Not found (404) is definite: the message cannot be decoded without it.
    No answer, a timeout (408), throttling (429) or a server error (5xx) is
    transient: the registry may answer later, so the lookup is retried (the
    catalog caches only what it found; the Spark task fails and is retried,
    or the mirror exits 1). Refused credentials and other client errors are
    definite. None: ``exc`` is neither an answer nor a failure to get one
    (a bug), for the caller to raise as it is.
    """
    status = _registry_status(exc)
    if status is None:
        if _no_answer(exc):
            return TransientError(
                f"the schema registry did not answer the lookup of {what}: "
                f"{type(exc).__name__}: {exc}"
            )
        return None
    if status == 404:
        return DefiniteError(
            f"{what} not found in the schema registry: {exc}",
            hint="was the topic written by cdcd with this schema_registry.url?",
        )
    if status in (408, 429) or status >= 500:
        return TransientError(f"the schema registry failed the lookup of {what}: {exc}")
    if status in (401, 403):
        return DefiniteError(
            f"the schema registry refused the lookup of {what}: {exc}",
            hint="check the credentials in schema_registry.config",
        )
    return DefiniteError(f"the schema registry rejected the lookup of {what}: {exc}")


# ----------------------------------------------------------------------------- catalog


class SchemaCatalog:
    """Writer schemas by wire header, from ``<prefix>._schemas`` or the schema registry.

    Single-object mode reads the compacted ``_schemas`` topic incrementally up
    to its probed end (the daemon publishes a schema, acknowledged, before
    any message uses it, so a header seen in a table topic is always found
    after a refresh). Registry mode asks the registry by id. The catalog
    pickles (without its registry client), so executors can look up writer
    schemas that appear after a streaming query started.
    """

    def __init__(
        self,
        prefix: str,
        kafka: KafkaOptions | None = None,
        *,
        registry_url: str | None = None,
        registry_config: Mapping[str, str] | None = None,
        registry_client: Any | None = None,
    ) -> None:
        self.prefix = prefix
        self._kafka = kafka
        self._registry_url = registry_url
        self._registry_config = dict(registry_config or {})
        self._registry_client = registry_client
        self._schemas: dict[bytes, dict[str, Any]] = {}
        self._published: dict[bytes, int] = {}  # header -> offset of its last publication
        self._positions: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_registry_client"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: CdcdConfig, kafka: KafkaOptions) -> SchemaCatalog:
        return cls(
            config.kafka.topic_prefix,
            kafka,
            registry_url=config.schema_registry.url,
            registry_config=config.schema_registry.config,
        )

    @property
    def uses_registry(self) -> bool:
        return self._registry_client is not None or bool(self._registry_url)

    def _registry(self) -> Any:
        if self._registry_client is None:
            from confluent_kafka.schema_registry import SchemaRegistryClient

            self._registry_client = SchemaRegistryClient.new_client(
                {"url": self._registry_url, **self._registry_config}
            )
        return self._registry_client

    @property
    def schemas_topic(self) -> str:
        return schemas_topic(self.prefix)

    def refresh(self) -> None:
        """Read what was published to ``<prefix>._schemas`` since the last refresh."""
        if self.uses_registry or self._kafka is None:
            return
        from cdcd.spark.source import KafkaClient, KafkaOptions, KafkaRange, read_range

        options = KafkaOptions(
            bootstrap_servers=self._kafka.bootstrap_servers,
            client_config=self._kafka.client_config,
            topics=(self.schemas_topic,),
            probe_timeout_s=self._kafka.probe_timeout_s,
            poll_timeout_s=self._kafka.poll_timeout_s,
        )
        with self._lock:
            with KafkaClient(options) as client:
                partitions = client.discover()
                starts = {
                    tp: self._positions.get(tp, client.watermarks(*tp)[0]) for tp in partitions
                }
                ends = client.probe_ends(partitions, starts)
            for (topic, partition), end in ends.items():
                start = starts[(topic, partition)]
                for batch in read_range(options, KafkaRange(topic, partition, start, end)):
                    keys = batch.column("key").to_pylist()
                    values = batch.column("value").to_pylist()
                    offsets = batch.column("offset").to_pylist()
                    for key, value, offset in zip(keys, values, offsets, strict=True):
                        if key is None or value is None:
                            continue
                        try:
                            header = SINGLE_OBJECT_MAGIC + bytes.fromhex(key.decode("ascii"))
                            schema = json.loads(value)
                        except (ValueError, UnicodeDecodeError) as exc:
                            raise DefiniteError(
                                f"{topic} offset {offset} is not a cdcd schema record: {exc}"
                            ) from exc
                        self._schemas[header] = schema
                        self._published[header] = offset
                self._positions[(topic, partition)] = end

    def schema(self, header: bytes) -> dict[str, Any]:
        """The writer schema of ``header``; refreshes once when it is unknown."""
        found = self._schemas.get(header)
        if found is not None:
            return found
        if self.uses_registry:
            if header[:1] != CONFLUENT_MAGIC:
                raise DefiniteError(
                    f"message header {header.hex()} is not the Confluent wire format, "
                    "but schema_registry.url is set"
                )
            schema_id = int.from_bytes(header[1:5], "big")
            try:
                registered = self._registry().get_schema(schema_id)
            except Exception as exc:  # the client raises its HTTP library's errors too
                error = _registry_error(exc, f"schema id {schema_id}")
                if error is None:
                    raise
                raise error from exc
            schema: dict[str, Any] = json.loads(registered.schema_str)
            self._schemas[header] = schema
            return schema
        self.refresh()
        found = self._schemas.get(header)
        if found is None:
            raise DefiniteError(
                f"writer schema {header.hex()} is not in {self.schemas_topic}",
                hint="was the topic written by cdcd with this topic_prefix and wire format?",
            )
        return found

    def latest(self, topic: str) -> tuple[bytes, dict[str, Any]] | None:
        """The most recently published envelope schema of ``topic``, or None.

        Only a default for readers that cannot look at the data first (a
        streaming query's schema is fixed when it starts).
        """
        if self.uses_registry:
            subject = f"{topic}-value"
            try:
                registered = self._registry().get_latest_version(subject)
            except Exception as exc:  # the client raises its HTTP library's errors too
                if _registry_status(exc) == 404:
                    return None  # nothing registered for the topic yet
                error = _registry_error(exc, f"subject {subject}")
                if error is None:
                    raise
                raise error from exc
            header = CONFLUENT_MAGIC + int(registered.schema_id).to_bytes(4, "big")
            schema: dict[str, Any] = json.loads(registered.schema.schema_str)
            self._schemas[header] = schema
            return header, schema
        self.refresh()
        candidates = [
            (offset, header)
            for header, offset in self._published.items()
            if is_envelope_for(self._schemas[header], topic)
        ]
        if not candidates:
            return None
        _, header = max(candidates)
        return header, self._schemas[header]

    def known(self, topic: str) -> dict[bytes, dict[str, Any]]:
        """Every envelope schema of ``topic`` seen so far."""
        return {h: s for h, s in self._schemas.items() if is_envelope_for(s, topic)}
