"""Column codecs: one pgoutput column value straight to its Avro binary encoding.

This is the hot path. For every column of a captured table a
:class:`ColumnCodec` is built once (from the type OID and type modifier of the
Relation message) and then called for every row: it turns the raw bytes
pgoutput sent in text format (``'t'``; cdcd never asks for binary values)
into the Avro binary encoding of the *non-null* value. Union branch bytes, record framing and error context
(table, column, LSN) are the caller's job. A codec raises ``ValueError`` (or
``OverflowError``) for a value it cannot represent; nothing is silently
dropped or approximated.

This module is the registry (:func:`column_codec`: type OID -> codec) and
holds the small scalar codecs; the rest is split by concern:
:mod:`~cdcd.decode.numeric` (integers, floats, numeric),
:mod:`~cdcd.decode.temporal` (date, time, timestamp[tz]) and
:mod:`~cdcd.decode.arrays`.

Type mapping (SPEC §5)
----------------------
bool -> boolean; int2/int4 -> int; int8/oid -> long; float4/float8 ->
float/double; numeric(p,s) -> bytes decimal(p,s); numeric without typmod ->
string (exact text, ``NaN``/``Infinity`` kept); uuid -> string uuid; bytea ->
bytes; date -> int date; time -> long time-micros; timestamp -> long
local-timestamp-micros; timestamptz -> long timestamp-micros (UTC); domains ->
their base type (the domain's typmod applies when the column has none);
arrays -> Avro arrays of ``["null", element]``, nested per dimension;
everything else (text-like types, json/jsonb, enums, composites, ranges,
interval, timetz, money, network, geometric, bit strings, tsvector, xml,
extension types such as citext ...) -> string holding PostgreSQL's text form.

* The walsender session is assumed to run with ``DateStyle=ISO,
  IntervalStyle=postgres, TimeZone=UTC, extra_float_digits>=1,
  bytea_output=hex`` (the source sets them).
* bytea text is hex (``\\x...``); the old escape format is accepted too.
* Text-like values are copied, not validated: pgoutput sends them in the
  database encoding, which cdcd requires to be UTF8 (``cdcd check``).

Speed
-----
Codecs are closures built once per column; the per-row work is slicing and
``int()`` on the bytes PostgreSQL sent (text values are not even decoded).
Varints use the table-driven ``encode_long``. ``tests/bench/bench_values.py``
measures the SPEC §9 row.
"""

from __future__ import annotations

import binascii
import uuid

from cdcd.avro.binary import FALSE, TRUE, VARINT_LAST, encode_long
from cdcd.decode.arrays import array_codec
from cdcd.decode.codec import ColumnCodec, resolve_domain
from cdcd.decode.numeric import (
    FLOAT4_CODEC,
    FLOAT8_CODEC,
    INT2_CODEC,
    INT4_CODEC,
    INT8_CODEC,
    OID_CODEC,
    decimal_codec,
    int_from_text,
    numeric_typmod,
)
from cdcd.decode.oids import (
    BOOL,
    BYTEA,
    DATE,
    FLOAT4,
    FLOAT8,
    INT2,
    INT4,
    INT8,
    NUMERIC,
    OID,
    TIME,
    TIMESTAMP,
    TIMESTAMPTZ,
    UUID,
)
from cdcd.decode.temporal import (
    DATE_CODEC,
    DATE_MAX,
    DATE_MIN,
    TIME_CODEC,
    TIME_MAX,
    TIMESTAMP_CODEC,
    TIMESTAMP_MAX,
    TIMESTAMP_MIN,
    TIMESTAMPTZ_CODEC,
)
from cdcd.decode.types import PgType, TypeCatalog

__all__ = [
    "DATE_MAX",
    "DATE_MIN",
    "TIMESTAMP_MAX",
    "TIMESTAMP_MIN",
    "TIME_MAX",
    "ColumnCodec",
    "bool_from_text",
    "column_codec",
    "encode_text_value",
    "int_from_text",
    "numeric_typmod",
]

_BACKSLASH = 0x5C


def _bytea_text(value: bytes) -> bytes:
    """bytea text (hex ``\\x0a0b``, or the pre-9.0 escape format) to the raw bytes."""
    if value[:2] == b"\\x":
        try:
            return binascii.unhexlify(value[2:])
        except binascii.Error as exc:
            raise ValueError(f"invalid bytea hex text: {exc}") from exc
    if _BACKSLASH not in value:
        return value
    out = bytearray()
    pos = 0
    n = len(value)
    while pos < n:
        c = value[pos]
        if c != _BACKSLASH:
            out.append(c)
            pos += 1
        elif value[pos + 1 : pos + 2] == b"\\":
            out.append(_BACKSLASH)
            pos += 2
        else:
            octal = value[pos + 1 : pos + 4]
            if len(octal) != 3 or not all(0x30 <= d <= 0x37 for d in octal):
                raise ValueError(f"invalid bytea escape at byte {pos} of {value[:40]!r}")
            out.append(int(octal, 8))
            pos += 4
    return bytes(out)


# --------------------------------------------------------------------------- codecs


def encode_text_value(value: bytes) -> bytes:
    """Avro string/bytes of the value as sent: length prefix, then the same bytes."""
    n = len(value)
    return (VARINT_LAST[n << 1] if n < 8192 else encode_long(n)) + value


def _to_str(value: bytes) -> str:
    return value.decode("utf-8")


#: Every type without an Avro type of its own: PostgreSQL's text form, as sent.
_STRING_CODEC = ColumnCodec("string", encode_text_value, _to_str)


_BOOL_TEXT = {b"t": TRUE, b"f": FALSE}


def bool_from_text(value: bytes) -> bytes:
    encoded = _BOOL_TEXT.get(value)
    if encoded is None:
        raise ValueError(f"invalid boolean {value!r}")
    return encoded


def _bool_to_python(value: bytes) -> bool:
    if value not in _BOOL_TEXT:
        raise ValueError(f"invalid boolean {value!r}")
    return value == b"t"


_BOOL_CODEC = ColumnCodec("boolean", bool_from_text, _bool_to_python)


def _bytea_from_text(value: bytes) -> bytes:
    return encode_text_value(_bytea_text(value))


_BYTEA_CODEC = ColumnCodec("bytes", _bytea_from_text, _bytea_text)


def _uuid_to_python(value: bytes) -> uuid.UUID:
    return uuid.UUID(value.decode("ascii"))


_UUID_CODEC = ColumnCodec(
    {"type": "string", "logicalType": "uuid"}, encode_text_value, _uuid_to_python
)


#: Codecs that depend on nothing but the type OID.
_FIXED_CODECS: dict[int, ColumnCodec] = {
    BOOL: _BOOL_CODEC,
    INT2: INT2_CODEC,
    INT4: INT4_CODEC,
    INT8: INT8_CODEC,
    OID: OID_CODEC,
    FLOAT4: FLOAT4_CODEC,
    FLOAT8: FLOAT8_CODEC,
    BYTEA: _BYTEA_CODEC,
    UUID: _UUID_CODEC,
    DATE: DATE_CODEC,
    TIME: TIME_CODEC,
    TIMESTAMP: TIMESTAMP_CODEC,
    TIMESTAMPTZ: TIMESTAMPTZ_CODEC,
}


def _scalar_codec(pg_type: PgType, typmod: int) -> ColumnCodec:
    fixed = _FIXED_CODECS.get(pg_type.oid)
    if fixed is not None:
        return fixed
    if pg_type.oid == NUMERIC:
        shape = numeric_typmod(typmod)
        if shape is not None:
            return decimal_codec(*shape)
        # Unconstrained numeric: any scale, NaN and infinities; keep the exact text.
    return _STRING_CODEC


def column_codec(
    type_oid: int, type_modifier: int, catalog: TypeCatalog, dimensions: int = 1
) -> ColumnCodec:
    """The codec of one column, from its Relation message facts.

    ``type_modifier`` is the column's atttypmod (-1 for none); ``dimensions``
    its declared array dimensions (pg_attribute.attndims; 0 or 1 mean one
    dimension, and it is ignored for non-array types). Raises KeyError for a
    type OID the catalog does not know.
    """
    pg_type, typmod = resolve_domain(catalog.lookup(type_oid), catalog, type_modifier)
    if pg_type.is_array:
        element_type, element_typmod = resolve_domain(
            catalog.lookup(pg_type.element_oid), catalog, typmod
        )
        element = _scalar_codec(element_type, element_typmod)
        return array_codec(element, element_type.delimiter.encode(), max(dimensions, 1))
    return _scalar_codec(pg_type, typmod)
