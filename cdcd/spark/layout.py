"""Table layouts and their resolution: a writer's rows as a reader's rows (pure, pyarrow only).

A table's messages use several writer schemas over time; a DataFrame or a
mirror needs one layout, the *reader* (the newest schema, see
:mod:`cdcd.spark.decode`). Decoded rows move from their writer's layout to
the reader's by the rules plain Avro schema resolution applies to cdcd's
schemas (SPEC §5 "Schema changes"), plus exact type conversions:

* **Which writer column fills a reader column.** Each column has a name
  history: its ``aliases`` (earlier Avro names, oldest first, kept in every
  later schema) then its current name. A writer column and a reader column
  are the same column when one history is a prefix of the other (the same
  column at two points of its life; a rename makes the reader's history
  longer). Where two pairings compete, the longer shared history wins, then
  a renamed column over one that merely has the name now: after ``RENAME a TO
  b`` and ``ADD COLUMN a``, an old record's ``a`` lands in ``b``, as in
  PostgreSQL (fastavro 1.x would prefer the bare name match and put it in
  the new ``a``).
  Columns without such history (schemas without aliases) pair by PostgreSQL
  name, as before renames were tracked.
* **A reader column no writer column fills** gets the reader field's Avro
  ``default``: a column added with a constant default (``ADD COLUMN c T
  DEFAULT 'x'``, a fast default in PostgreSQL) reads ``'x'`` in rows written
  before it existed, exactly as PostgreSQL returns them. The default's Avro
  JSON (numbers, strings, code points 0-255 for bytes and decimals) becomes
  the Arrow value (``Decimal``, timestamp, date...). No default: null.
* **A writer column the reader lacks** is dropped.
* **A column whose type changed** (``ALTER COLUMN ... TYPE``) is converted
  with Arrow's casts where that is exact (int -> long -> double, decimal scale
  widening, decimal <-> text, date -> timestamp, ...); anything else fails
  with an error naming the table, column and types rather than guessing.

Types (SPEC §5 to Arrow; :mod:`cdcd.spark.dataframes` maps them to Spark):
boolean, int, long, float, double, string (uuid, json and the text forms
too), bytes -> binary; decimal(p,s) -> decimal128(p,s) when p <= 38, else
string holding the exact decimal text (Spark cannot hold more digits); date ->
date32; timestamp-micros -> timestamp[us, UTC]; local-timestamp-micros ->
timestamp[us]; time-micros -> int64, microseconds since midnight; arrays ->
lists with nullable elements, nested for more dimensions. Unions may list
``null`` first (``["null", T]``) or last (``[T, "null"]``, a column with a
non-null default). A union of several types (a column whose type changed
lists every type it has had, the current one first) is the current type:
:mod:`cdcd.spark.decode` converts values written in an older branch to it,
exactly, like any other type change.

Key columns are not taken from the row schema (a column's nullability says
nothing about the key: a column that joins the key stays nullable so that
older records resolve); they come from the message key's schema
(:func:`key_columns`, :meth:`RowLayout.with_key`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal
from functools import lru_cache
from typing import Any

import pyarrow as pa

from cdcd.errors import DefiniteError
from cdcd.naming import ORIGINAL_NAME_ATTRIBUTE

__all__ = [
    "CHANGE_COLUMNS",
    "MAX_SPARK_PRECISION",
    "Column",
    "ColumnType",
    "RowLayout",
    "arrow_column_type",
    "avro_of",
    "changes_arrow_schema",
    "column_array",
    "column_sources",
    "column_type",
    "convert_column",
    "convert_rows",
    "default_array",
    "key_columns",
    "newest_branch",
    "only_added_plain_columns",
    "row_schema_of",
    "to_reader",
    "union_branches",
]

MAX_SPARK_PRECISION = 38

# ----------------------------------------------------------------------------- types


@dataclass(frozen=True)
class ColumnType:
    """A column's type: the Avro mapping of SPEC §5, as Arrow sees it."""

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
PRIMITIVES = frozenset({"boolean", "int", "long", "float", "double", "string", "bytes"})
_LOGICAL = {
    ("int", "date"): "date",
    ("long", "time-micros"): "time",
    ("long", "timestamp-micros"): "timestamp",
    ("long", "local-timestamp-micros"): "local_timestamp",
}


def union_branches(avro: Any) -> list[Any] | None:
    """The non-null branches of a field type that is a union of several types (a column
    whose type changed keeps every type it has had); None for any other type."""
    if not isinstance(avro, list):
        return None
    branches = [b for b in avro if b != "null"]
    return branches if len(branches) > 1 else None


def newest_branch(branches: list[Any]) -> Any:
    """The branch holding the column's current type: the first one listed.

    cdcd lists a column's current type first and appends the types it had
    before (``["null", <current>, <earlier>...]``; with a fast default
    ``[<current>, "null", ...]``), so older values keep their branch; they
    are converted to the current type.
    """
    return branches[0]


def _non_null(avro: list[Any]) -> Any:
    branches = [b for b in avro if b != "null"]
    if not branches:
        raise DefiniteError(f"unsupported Avro union {avro!r} in a row schema")
    return newest_branch(branches)


def column_type(avro: Any) -> ColumnType:
    """The :class:`ColumnType` of an Avro field type as cdcd writes them (of a union of
    several types: the newest, see :func:`newest_branch`)."""
    if isinstance(avro, list):
        return column_type(_non_null(avro))
    if isinstance(avro, str):
        if avro in PRIMITIVES:
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


def arrow_column_type(kind: pa.DataType) -> ColumnType:
    """The :class:`ColumnType` holding an Arrow type (Spark's Arrow types included)."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return ColumnType("array", item=arrow_column_type(kind.value_type))
    if pa.types.is_decimal(kind):
        return ColumnType("decimal", kind.precision, kind.scale)
    if pa.types.is_timestamp(kind):
        return ColumnType("timestamp" if kind.tz else "local_timestamp")
    if pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return ColumnType("string")
    if pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return ColumnType("bytes")
    for name, known in _ARROW.items():
        if kind == known and name != "time":
            return ColumnType(name)
    raise DefiniteError(f"a column of Arrow type {kind} has no mirror type")


def avro_of(ctype: ColumnType) -> Any:
    """An Avro type whose :func:`column_type` is ``ctype``."""
    if ctype.kind == "array":
        assert ctype.item is not None
        return {"type": "array", "items": ["null", avro_of(ctype.item)]}
    if ctype.kind == "decimal":
        return {"type": "bytes", "logicalType": "decimal",
                "precision": ctype.precision, "scale": ctype.scale}  # fmt: skip
    for (base, logical), kind in _LOGICAL.items():
        if kind == ctype.kind:
            return {"type": base, "logicalType": logical}
    return ctype.kind


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Column:
    """One table column: PostgreSQL name, Avro field name, type, key membership,
    Avro default (JSON text; None for no default or a null one) and earlier Avro names.

    Key membership is not in the row schema: it comes from the message key
    (:meth:`RowLayout.with_key`); layouts built from a row schema alone have none.
    """

    name: str
    field: str
    type: ColumnType
    key: bool
    default: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def history(self) -> tuple[str, ...]:
        """Every Avro name of the column, oldest first, the current one last."""
        return (*self.aliases, self.field)


def _default_text(avro_field: dict[str, Any]) -> str | None:
    if "default" not in avro_field or avro_field["default"] is None:
        return None
    return json.dumps(avro_field["default"], sort_keys=True)


@dataclass(frozen=True)
class RowLayout:
    """A table's columns in order, from an envelope schema."""

    columns: tuple[Column, ...]

    @classmethod
    def from_envelope(cls, envelope: Mapping[str, Any], key: Sequence[str] = ()) -> RowLayout:
        return cls.from_row(row_schema_of(envelope), key)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], key: Sequence[str] = ()) -> RowLayout:
        """The layout of a row record; ``key``: the PostgreSQL names of the key columns
        (from the message key's schema, :func:`key_columns`), in key order."""
        columns = []
        for avro_field in row["fields"]:
            columns.append(
                Column(
                    name=str(avro_field.get(ORIGINAL_NAME_ATTRIBUTE, avro_field["name"])),
                    field=str(avro_field["name"]),
                    type=column_type(avro_field["type"]),
                    key=False,
                    default=_default_text(avro_field),
                    aliases=tuple(str(a) for a in avro_field.get("aliases") or ()),
                )
            )
        return cls(tuple(columns)).with_key(key)

    def with_key(self, key: Sequence[str]) -> RowLayout:
        """This layout with ``key`` (PostgreSQL column names) as its key columns.

        A key column the row lacks is an error: the message key and the row
        record of one change always agree.
        """
        wanted = set(key)
        missing = wanted - set(self.names)
        if missing:
            raise DefiniteError(
                f"key column(s) {', '.join(sorted(missing))} are not columns of the row"
            )
        columns = tuple(replace(c, key=c.name in wanted) for c in self.columns)
        if columns == self.columns:
            return self
        return RowLayout(columns)

    @property
    def shape(self) -> RowLayout:
        """The layout without key membership: what decoding and conversions depend on."""
        return self.with_key(())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)

    @classmethod
    def from_arrow(cls, row: pa.StructType | pa.Schema, key: Sequence[str] = ()) -> RowLayout:
        """The layout of Arrow rows (a DataFrame's), each column by its Arrow type."""
        columns = tuple(
            Column(name=f.name, field=f.name, type=arrow_column_type(f.type), key=False)
            for f in row
        )
        return cls(columns).with_key(key)

    def envelope(self, name: str = "Envelope") -> dict[str, Any]:
        """A minimal envelope schema whose row record is this layout (key not included)."""
        fields = [
            {"name": c.field, ORIGINAL_NAME_ATTRIBUTE: c.name, "type": ["null", avro_of(c.type)],
             "default": None}
            for c in self.columns
        ]  # fmt: skip
        row = {"type": "record", "name": "Value", "fields": fields}
        return {
            "type": "record",
            "name": name,
            "fields": [
                {"name": "before", "type": ["null", row], "default": None},
                {"name": "after", "type": ["null", "Value"], "default": None},
            ],
        }

    def arrow_type(self) -> pa.StructType:
        return pa.struct([pa.field(c.name, c.type.arrow()) for c in self.columns])

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.type.arrow()) for c in self.columns])


def key_columns(key_schema: Mapping[str, Any]) -> tuple[str, ...]:
    """The PostgreSQL names of the columns of a message key's record schema, in key order."""
    if key_schema.get("type") != "record":
        raise DefiniteError(f"message key schema {key_schema.get('name', '?')} is not a record")
    return tuple(
        str(f.get(ORIGINAL_NAME_ATTRIBUTE, f["name"])) for f in key_schema.get("fields", ())
    )


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
    """One Arrow array from raw Avro values (None for null), as fastavro gives them
    without logical types: bytes for decimals, ints for dates, times and timestamps."""
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


# ----------------------------------------------------------------------------- defaults

_INTEGERS = frozenset({"int", "long", "date", "time", "timestamp", "local_timestamp"})
_FLOAT_WORDS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _raw_default(value: Any, ctype: ColumnType) -> Any:
    """An Avro default in its JSON encoding as the raw value fastavro would decode.

    ``bytes`` and decimals are JSON strings whose code points 0-255 are the
    bytes (a decimal's big-endian two's-complement unscaled value); dates,
    times and timestamps are their int/long counts; arrays list their items.
    """
    kind = ctype.kind
    if value is None:
        return None
    if kind == "boolean" and isinstance(value, bool):
        return value
    if kind in _INTEGERS and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in ("float", "double"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value in _FLOAT_WORDS:
            return _FLOAT_WORDS[value]
    if kind == "string" and isinstance(value, str):
        return value
    if kind in ("bytes", "decimal") and isinstance(value, str):
        return value.encode("latin-1")  # UnicodeEncodeError (a ValueError) above U+00FF
    if kind == "array" and isinstance(value, list):
        assert ctype.item is not None
        item = ctype.item
        return [_raw_default(v, item) for v in value]
    raise ValueError(f"{value!r} is not a {ctype.describe()}")


@lru_cache(maxsize=1024)
def _default_scalar(column: Column) -> pa.Scalar:
    assert column.default is not None
    try:
        raw = _raw_default(json.loads(column.default), column.type)
        return column_array([raw], column.type)[0]
    except (ValueError, OverflowError, pa.ArrowException) as exc:
        raise DefiniteError(
            f"the Avro default {column.default} of column {column.name!r} "
            f"does not fit its type {column.type.describe()}: {exc}",
            hint="the schema was not written by cdcd, or this cdcd is older than the writer",
        ) from exc


def default_array(column: Column, length: int) -> pa.Array:
    """``length`` copies of ``column``'s default (nulls when it has none)."""
    if column.default is None:
        return pa.nulls(length, column.type.arrow())
    return pa.repeat(_default_scalar(column), length)


# ----------------------------------------------------------------------------- resolution


def _shares_history(reader: Column, writer: Column) -> int:
    """Length of the shared history when one column's history is a prefix of the other's, else 0.

    Two columns whose whole histories are equal must also have the same
    PostgreSQL name: sanitized Avro names can coincide for different columns.
    """
    ours, theirs = reader.history, writer.history
    n = min(len(ours), len(theirs))
    if ours[:n] != theirs[:n]:
        return 0
    if len(ours) == len(theirs) and reader.name != writer.name:
        return 0
    return n


@lru_cache(maxsize=4096)
def column_sources(writer: RowLayout, reader: RowLayout) -> tuple[int | None, ...]:
    """For each reader column, the index of the writer column holding its values (None: none).

    See the module docstring for the rules.
    """
    pairs: list[tuple[int, int, int, int, int]] = []
    for r, ours in enumerate(reader.columns):
        for w, theirs in enumerate(writer.columns):
            shared = _shares_history(ours, theirs)
            if shared:
                renamed = 0 if len(ours.history) != len(theirs.history) else 1
                pairs.append((0, -shared, renamed, r, w))
            elif (
                ours.name == theirs.name
                or theirs.field in ours.aliases
                or ours.field in theirs.aliases
            ):
                pairs.append((1, 0, 0, r, w))
    sources: list[int | None] = [None] * len(reader.columns)
    taken: set[int] = set()
    for *_, r, w in sorted(pairs):
        if sources[r] is None and w not in taken:
            sources[r] = w
            taken.add(w)
    return tuple(sources)


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


def convert_columns(
    columns: list[pa.Array], length: int, writer: RowLayout, reader: RowLayout, what: str
) -> list[pa.Array]:
    """``writer``'s column arrays (in its order) as ``reader``'s, by :func:`column_sources`.

    ``what`` names the table in errors.
    """
    out = []
    for column, source in zip(reader.columns, column_sources(writer, reader), strict=True):
        if source is None:
            out.append(default_array(column, length))
            continue
        old = writer.columns[source]
        try:
            out.append(convert_column(columns[source], old.type, column.type))
        except ValueError as exc:
            raise DefiniteError(
                f"{what}: column {column.name!r} changed type from "
                f"{old.type.describe()} to {column.type.describe()} and older values cannot "
                f"be converted exactly: {exc}",
                hint="re-snapshot the table under a new topic prefix, "
                "or mirror into a new output directory",
            ) from None
    return out


def convert_rows(
    array: pa.Array | pa.ChunkedArray, writer: RowLayout, reader: RowLayout, topic: str = ""
) -> pa.Array:
    """A struct array of ``writer`` rows as ``reader`` rows (see the module docstring)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if writer.shape == reader.shape:
        return array
    converted = convert_columns(array.flatten(), len(array), writer, reader, topic or "a topic")
    return pa.StructArray.from_arrays(
        converted, fields=list(reader.arrow_type()), mask=array.is_null()
    )


def to_reader(changes: pa.Table, writer: RowLayout, reader: RowLayout, topic: str = "") -> pa.Table:
    """Decoded changes in ``writer``'s layout, converted to ``reader``'s."""
    if writer.shape == reader.shape:
        return changes
    schema = changes_arrow_schema(reader)
    arrays = [changes.column(name) for name, _ in CHANGE_COLUMNS]
    arrays.append(convert_rows(changes.column("before"), writer, reader, topic))
    arrays.append(convert_rows(changes.column("after"), writer, reader, topic))
    return pa.Table.from_arrays(arrays, schema=schema)


def only_added_plain_columns(old: RowLayout, new: RowLayout) -> bool:
    """``new`` is ``old`` plus columns without a default nor history: Delta evolves that."""
    count = len(old.columns)
    if new.columns[:count] != old.columns:
        return False
    known = {name for c in old.columns for name in (c.name, *c.aliases)}
    return all(
        c.default is None and not c.key and not ({c.name, *c.aliases} & known)
        for c in new.columns[count:]
    )
