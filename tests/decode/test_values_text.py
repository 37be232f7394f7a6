"""Column codecs, text format: Avro bytes decoded by plain fastavro give the expected values.

Expected values are written out by hand or computed independently of the
codec (datetime arithmetic, Decimal, a small array_out written here), never
with the codec's own parsers.
"""

from __future__ import annotations

import io
import math
import struct
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.decode.types import BUILTIN_TYPES, PgType, StaticCatalog
from cdcd.decode.values import (
    DATE_MAX,
    DATE_MIN,
    TIMESTAMP_MAX,
    TIMESTAMP_MIN,
    ColumnCodec,
    column_codec,
    numeric_typmod,
)

from .helpers import same

CATALOG = StaticCatalog(
    {
        16385: PgType(16385, "public", "citext", "b", "S", 0, 0, -1, ","),
        16386: PgType(16386, "public", "mood", "e", "E", 0, 0, -1, ","),
        16387: PgType(16387, "public", "_mood", "b", "A", 16386, 0, -1, ","),
        16388: PgType(16388, "public", "d_amount", "d", "N", 0, 1700, (10 << 16 | 2) + 4, ","),
        16389: PgType(16389, "public", "d_text", "d", "S", 0, 25, -1, ","),
        16390: PgType(16390, "public", "d_d_amount", "d", "N", 0, 16388, -1, ","),
        16391: PgType(16391, "public", "_d_amount", "b", "A", 16388, 0, -1, ","),
        16392: PgType(16392, "public", "d_int_array", "d", "A", 0, 1007, -1, ","),
        16393: PgType(16393, "public", "comp", "c", "C", 0, 0, -1, ","),
    }
)

BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, XML, FLOAT4, FLOAT8, MONEY, BPCHAR, VARCHAR = 114, 142, 700, 701, 790, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, INTERVAL, TIMETZ = 1082, 1083, 1114, 1184, 1186, 1266
NUMERIC, UUID, JSONB, INT4_ARRAY, TEXT_ARRAY, BOX_ARRAY = 1700, 2950, 3802, 1007, 1009, 1020
INT8_ARRAY, TIMESTAMPTZ_ARRAY, NUMERIC_ARRAY = 1016, 1185, 1231


def typmod(precision: int, scale: int) -> int:
    """numeric(precision, scale) type modifier as PostgreSQL 15 stores it (scale 11-bit signed)."""
    return ((precision << 16) | (scale & 0x7FF)) + 4


def codec_for(oid: int, mod: int = -1, dims: int = 1) -> ColumnCodec:
    return column_codec(oid, mod, CATALOG, dims)


def decode(codec: ColumnCodec, data: bytes) -> Any:
    schema = codec.avro_type
    parsed = fastavro.parse_schema(schema) if isinstance(schema, dict) else schema
    buf = io.BytesIO(data)
    value = fastavro.schemaless_reader(buf, parsed, None)
    assert buf.read() == b"", "trailing bytes after the value"
    return value


def text_value(oid: int, text: bytes, mod: int = -1, dims: int = 1) -> Any:
    """Encode ``text`` with the codec, decode with fastavro; to_python must agree."""
    codec = codec_for(oid, mod, dims)
    got = decode(codec, codec.from_text(text))
    assert same(codec.to_python(text), got)
    return got


MAX_TS = datetime(9999, 12, 31, 23, 59, 59, 999999)
MIN_TS = datetime(1, 1, 1)


# ------------------------------------------------------------------------ schemas


@pytest.mark.parametrize(
    ("oid", "mod", "dims", "schema"),
    [
        (BOOL, -1, 1, "boolean"),
        (INT2, -1, 1, "int"),
        (INT4, -1, 1, "int"),
        (INT8, -1, 1, "long"),
        (OID, -1, 1, "long"),
        (FLOAT4, -1, 1, "float"),
        (FLOAT8, -1, 1, "double"),
        (NUMERIC, -1, 1, "string"),
        (
            NUMERIC,
            typmod(12, 2),
            1,
            {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
        ),
        # Negative scale (PG 15): rounded to hundreds, up to 7 integer digits.
        (
            NUMERIC,
            typmod(5, -2),
            1,
            {"type": "bytes", "logicalType": "decimal", "precision": 7, "scale": 0},
        ),
        # Scale above precision (PG 15): pure fractions below 10^-2.
        (
            NUMERIC,
            typmod(3, 5),
            1,
            {"type": "bytes", "logicalType": "decimal", "precision": 5, "scale": 5},
        ),
        (TEXT, -1, 1, "string"),
        (VARCHAR, 14, 1, "string"),
        (BPCHAR, 9, 1, "string"),
        (NAME, -1, 1, "string"),
        (CHAR, -1, 1, "string"),
        (16385, -1, 1, "string"),  # citext
        (16386, -1, 1, "string"),  # enum
        (16389, -1, 1, "string"),  # domain over text
        (16393, -1, 1, "string"),  # composite
        (3904, -1, 1, "string"),  # int4range
        (4451, -1, 1, "string"),  # int4multirange
        (BYTEA, -1, 1, "bytes"),
        (UUID, -1, 1, {"type": "string", "logicalType": "uuid"}),
        (JSON, -1, 1, "string"),
        (JSONB, -1, 1, "string"),
        (DATE, -1, 1, {"type": "int", "logicalType": "date"}),
        (TIME, -1, 1, {"type": "long", "logicalType": "time-micros"}),
        (TIMESTAMP, -1, 1, {"type": "long", "logicalType": "local-timestamp-micros"}),
        (TIMESTAMPTZ, -1, 1, {"type": "long", "logicalType": "timestamp-micros"}),
        (INTERVAL, -1, 1, "string"),
        (TIMETZ, -1, 1, "string"),
        (MONEY, -1, 1, "string"),
        (XML, -1, 1, "string"),
        (22, -1, 1, "string"),  # int2vector: category 'A' but not an array
        (600, -1, 1, "string"),  # point has a typelem but is not an array
        (INT4_ARRAY, -1, 0, {"type": "array", "items": ["null", "int"]}),
        (INT4_ARRAY, -1, 1, {"type": "array", "items": ["null", "int"]}),
        (
            INT4_ARRAY,
            -1,
            2,
            {"type": "array", "items": ["null", {"type": "array", "items": ["null", "int"]}]},
        ),
        (
            NUMERIC_ARRAY,
            typmod(12, 2),
            1,
            {
                "type": "array",
                "items": [
                    "null",
                    {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
                ],
            },
        ),
        (16387, -1, 1, {"type": "array", "items": ["null", "string"]}),  # mood[]
        # Domains: base type mapping, the domain's typmod when the column has none.
        (16388, -1, 1, {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}),
        (
            16388,
            typmod(8, 1),
            1,
            {"type": "bytes", "logicalType": "decimal", "precision": 8, "scale": 1},
        ),
        (16390, -1, 1, {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}),
        (
            16391,
            -1,
            1,
            {
                "type": "array",
                "items": [
                    "null",
                    {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
                ],
            },
        ),
        (16392, -1, 0, {"type": "array", "items": ["null", "int"]}),  # domain over int4[]
    ],
)
def test_avro_types(oid: int, mod: int, dims: int, schema: Any) -> None:
    codec = codec_for(oid, mod, dims)
    assert codec.avro_type == schema
    fastavro.parse_schema(schema if isinstance(schema, dict) else {"type": schema})


def test_every_builtin_type_has_a_codec() -> None:
    """No built-in type makes column_codec fail; pseudo/unknown types map to string."""
    for oid in BUILTIN_TYPES:
        codec = codec_for(oid)
        fastavro.parse_schema(
            {
                "type": "record",
                "name": "r",
                "fields": [{"name": "f", "type": ["null", codec.avro_type]}],
            }
        )


def test_unknown_oid_is_key_error() -> None:
    with pytest.raises(KeyError):
        codec_for(999_999)


def test_numeric_typmod() -> None:
    assert numeric_typmod(-1) is None
    assert numeric_typmod(typmod(12, 2)) == (12, 2)
    assert numeric_typmod(typmod(1000, 1000)) == (1000, 1000)
    assert numeric_typmod(typmod(5, -2)) == (5, -2)
    assert numeric_typmod(typmod(1, -1000)) == (1, -1000)


# ------------------------------------------------------------------------ scalars


@pytest.mark.parametrize(
    ("oid", "text", "expected"),
    [
        (BOOL, b"t", True),
        (BOOL, b"f", False),
        (INT2, b"-32768", -32768),
        (INT2, b"32767", 32767),
        (INT4, b"-2147483648", -(2**31)),
        (INT4, b"0", 0),
        (INT8, b"-9223372036854775808", -(2**63)),
        (INT8, b"9223372036854775807", 2**63 - 1),
        (OID, b"4294967295", 4294967295),
        (FLOAT8, b"0.1", 0.1),
        (FLOAT8, b"-0", -0.0),
        (FLOAT8, b"Infinity", math.inf),
        (FLOAT8, b"-Infinity", -math.inf),
        (FLOAT8, b"NaN", math.nan),
        (FLOAT8, b"1.7976931348623157e+308", 1.7976931348623157e308),
        (FLOAT8, b"5e-324", 5e-324),
        (FLOAT4, b"1.5", 1.5),
        (FLOAT4, b"0.1", struct.unpack("<f", struct.pack("<f", 0.1))[0]),
        (FLOAT4, b"3.4028235e+38", struct.unpack("<f", struct.pack("<f", 3.4028235e38))[0]),
        (FLOAT4, b"NaN", math.nan),
        (FLOAT4, b"-Infinity", -math.inf),
        (TEXT, b"", ""),
        (TEXT, "üñíçødé ✓ 𝄞".encode(), "üñíçødé ✓ 𝄞"),
        (BPCHAR, b"ab   ", "ab   "),  # padding kept as sent
        (NAME, b"pg_class", "pg_class"),
        (CHAR, b"\\351", "\\351"),  # high-bit "char" prints as octal escape (PG 15)
        (16385, b"MiXeD", "MiXeD"),
        (16386, b"sad face", "sad face"),
        (16389, b"x", "x"),
        (JSON, b'  {"a" : [1, 2.50]} ', '  {"a" : [1, 2.50]} '),
        (JSONB, b'{"a": [1, 2.50]}', '{"a": [1, 2.50]}'),
        (BYTEA, b"\\x", b""),
        (BYTEA, b"\\x00ff10", b"\x00\xff\x10"),
        (BYTEA, b"\\xDEADbeef", b"\xde\xad\xbe\xef"),
        (BYTEA, b"abc", b"abc"),  # escape format
        (BYTEA, b"a\\\\b\\000\\377", b"a\\b\x00\xff"),
        (
            UUID,
            b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        ),
        (INTERVAL, b"-1 days +02:00:00", "-1 days +02:00:00"),
        (TIMETZ, b"04:05:06.789+02", "04:05:06.789+02"),
        (MONEY, b"-$1,234.56", "-$1,234.56"),
        (NUMERIC, b"NaN", "NaN"),
        (NUMERIC, b"-Infinity", "-Infinity"),
        (NUMERIC, b"1.000", "1.000"),
        (NUMERIC, b"1" + b"0" * 5000 + b".5", "1" + "0" * 5000 + ".5"),
    ],
)
def test_scalar_values(oid: int, text: bytes, expected: Any) -> None:
    assert same(text_value(oid, text), expected)


@pytest.mark.parametrize(
    ("precision", "scale", "text", "expected"),
    [
        (12, 2, b"0.00", Decimal("0.00")),
        (12, 2, b"1234567890.12", Decimal("1234567890.12")),
        (12, 2, b"-0.01", Decimal("-0.01")),
        (12, 2, b"9999999999.99", Decimal("9999999999.99")),
        (12, 2, b"-9999999999.99", Decimal("-9999999999.99")),
        (12, 2, b"-42", Decimal("-42.00")),  # fewer digits than the scale
        (12, 2, b"1.5", Decimal("1.50")),
        (12, 2, b"1.500", Decimal("1.50")),  # extra zero digits are exact
        (5, -2, b"12300", Decimal("12300")),
        (5, -2, b"-9999900", Decimal("-9999900")),
        (3, 5, b"0.00123", Decimal("0.00123")),
        (3, 5, b"-0.00999", Decimal("-0.00999")),
        (1000, 500, b"9" * 500 + b"." + b"9" * 500, Decimal("9" * 500 + "." + "9" * 500)),
        (1000, 0, b"-" + b"9" * 1000, Decimal("-" + "9" * 1000)),
        (1, 0, b"-1", Decimal("-1")),
        (2, 0, b"-99", Decimal("-99")),
        (3, 0, b"128", Decimal("128")),  # two's complement needs a second byte
        (3, 0, b"-128", Decimal("-128")),
        (3, 0, b"-129", Decimal("-129")),
    ],
)
def test_decimal_values(precision: int, scale: int, text: bytes, expected: Decimal) -> None:
    got = text_value(NUMERIC, text, typmod(precision, scale))
    assert got == expected
    assert got.as_tuple().exponent == -max(scale, 0)


@pytest.mark.parametrize("text", [b"NaN", b"Infinity", b"-Infinity", b"1.234", b"1000.00", b"abc", b""])
def test_decimal_unrepresentable(text: bytes) -> None:
    codec = codec_for(NUMERIC, typmod(5, 2))
    with pytest.raises(ValueError):
        codec.from_text(text)
    with pytest.raises(ValueError):
        codec.to_python(text)


@pytest.mark.parametrize(
    ("oid", "text"),
    [
        (BOOL, b"true"),
        (BOOL, b""),
        (INT4, b"x"),
        (INT8, b"9223372036854775808"),  # beyond int64: OverflowError
        (FLOAT8, b"nope"),
        (BYTEA, b"\\xabc"),
        (BYTEA, b"\\9"),
        (DATE, b"garbage"),
        (TIME, b"1:2:3"),
        (TIMESTAMP, b"2024-01-02"),
        (TIMESTAMPTZ, b"2024-01-02 03:04:05"),
        (TIMESTAMPTZ, b"2024-01-02 03:04:05.1234567+00 BC"),
        (INT4_ARRAY, b"{1,2"),
        (INT4_ARRAY, b"1,2}"),
        (INT4_ARRAY, b"{1,,2}"),
        (TEXT_ARRAY, b'{"a}'),
        (TEXT_ARRAY, b'{a"b}'),
        (TEXT_ARRAY, b"{a} x"),
    ],
)
def test_malformed_text_raises_value_error(oid: int, text: bytes) -> None:
    codec = codec_for(oid)
    with pytest.raises((ValueError, OverflowError)):
        codec.from_text(text)


# ------------------------------------------------------------------------ dates and times


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"2024-02-29", date(2024, 2, 29)),
        (b"1970-01-01", date(1970, 1, 1)),
        (b"1969-12-31", date(1969, 12, 31)),
        (b"0001-01-01", date(1, 1, 1)),
        (b"9999-12-31", date(9999, 12, 31)),
        (b"infinity", date(9999, 12, 31)),
        (b"-infinity", date(1, 1, 1)),
        (b"0044-03-15 BC", date(1, 1, 1)),
        (b"0001-12-31 BC", date(1, 1, 1)),
        (b"10000-01-01", date(9999, 12, 31)),
        (b"5874897-12-31", date(9999, 12, 31)),
    ],
)
def test_date(text: bytes, expected: date) -> None:
    assert text_value(DATE, text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"00:00:00", time(0, 0)),
        (b"12:34:56.789012", time(12, 34, 56, 789012)),
        (b"01:02:03.1", time(1, 2, 3, 100000)),
        (b"23:59:59.999999", time(23, 59, 59, 999999)),
        (b"24:00:00", time(23, 59, 59, 999999)),  # PostgreSQL allows 24:00:00: clamped
    ],
)
def test_time(text: bytes, expected: time) -> None:
    assert text_value(TIME, text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"2024-01-02 03:04:05.123456", datetime(2024, 1, 2, 3, 4, 5, 123456)),
        (b"2024-01-02 03:04:05", datetime(2024, 1, 2, 3, 4, 5)),
        (b"2000-02-29 00:00:00.5", datetime(2000, 2, 29, 0, 0, 0, 500000)),
        (b"1969-12-31 23:59:59.999999", datetime(1969, 12, 31, 23, 59, 59, 999999)),
        (b"0001-01-01 00:00:00", MIN_TS),
        (b"9999-12-31 23:59:59.999999", MAX_TS),
        (b"infinity", MAX_TS),
        (b"-infinity", MIN_TS),
        (b"0044-03-15 12:00:00 BC", MIN_TS),
        (b"10000-01-01 00:00:00", MAX_TS),
        (b"294276-12-31 23:59:59.999999", MAX_TS),
    ],
)
def test_timestamp(text: bytes, expected: datetime) -> None:
    assert text_value(TIMESTAMP, text) == expected


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"2024-01-02 03:04:05.123456+00", utc(2024, 1, 2, 3, 4, 5, 123456)),
        (b"2024-01-02 03:04:05.123456+05:30", utc(2024, 1, 1, 21, 34, 5, 123456)),
        (b"2024-07-01 12:00:00.1-03", utc(2024, 7, 1, 15, 0, 0, 100000)),
        (b"1900-01-01 00:00:00+00:19:32", utc(1899, 12, 31, 23, 40, 28)),  # Amsterdam LMT
        (b"1900-01-01 00:00:00-03:30:15", utc(1900, 1, 1, 3, 30, 15)),
        (b"2024-01-02 03:04:05+14", utc(2024, 1, 1, 13, 4, 5)),
        (b"infinity", utc(9999, 12, 31, 23, 59, 59, 999999)),
        (b"-infinity", utc(1, 1, 1)),
        (b"0044-03-15 12:00:00+00 BC", utc(1, 1, 1)),
        (b"0001-01-01 00:00:00+05", utc(1, 1, 1)),  # before 0001-01-01 UTC: clamped
        (b"0001-01-01 12:00:00+05", utc(1, 1, 1, 7)),
        (b"9999-12-31 23:00:00-05", utc(9999, 12, 31, 23, 59, 59, 999999)),
        # Year 10000 local but still 9999 in UTC: exact, not clamped.
        (b"10000-01-01 04:00:00+05", utc(9999, 12, 31, 23)),
        (b"10000-01-01 04:00:00.5+05:30", utc(9999, 12, 31, 22, 30, 0, 500000)),
        (b"10000-01-01 06:00:00+05", utc(9999, 12, 31, 23, 59, 59, 999999)),
        (b"0002-01-01 00:00:00+00 BC", utc(1, 1, 1)),
    ],
)
def test_timestamptz(text: bytes, expected: datetime) -> None:
    assert text_value(TIMESTAMPTZ, text) == expected


def pg_fraction(micros: int) -> str:
    return "." + f"{micros:06d}".rstrip("0") if micros else ""


def pg_offset(seconds_east: int) -> str:
    sign = "+" if seconds_east >= 0 else "-"
    minutes, sec = divmod(abs(seconds_east), 60)
    hour, minute = divmod(minutes, 60)
    if sec:
        return f"{sign}{hour:02d}:{minute:02d}:{sec:02d}"
    if minute:
        return f"{sign}{hour:02d}:{minute:02d}"
    return f"{sign}{hour:02d}"


def pg_timestamp_text(local: datetime) -> str:
    return local.strftime("%Y-%m-%d %H:%M:%S").rjust(19, "0") + pg_fraction(local.microsecond)


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    st.integers(min_value=-(15 * 3600 + 59 * 60 + 59), max_value=15 * 3600 + 59 * 60 + 59),
)
def test_timestamptz_any_offset(local: datetime, offset: int) -> None:
    text = (
        f"{local.year:04d}"
        + local.strftime("-%m-%d %H:%M:%S")
        + pg_fraction(local.microsecond)
        + pg_offset(offset)
    ).encode()
    expected = local.replace(tzinfo=timezone(timedelta(seconds=offset))).astimezone(UTC)
    assert text_value(TIMESTAMPTZ, text) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999))
)
def test_timestamp_and_date_roundtrip(value: datetime) -> None:
    text = f"{value.year:04d}" + value.strftime("-%m-%d %H:%M:%S") + pg_fraction(value.microsecond)
    assert text_value(TIMESTAMP, text.encode()) == value
    assert text_value(TIMESTAMPTZ, (text + "+00").encode()) == value.replace(tzinfo=UTC)
    assert text_value(DATE, text[: text.index(" ")].encode()) == value.date()
    clock = value.time()
    assert (
        text_value(TIME, (f"{clock:%H:%M:%S}" + pg_fraction(clock.microsecond)).encode()) == clock
    )


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=300_000),
    st.integers(min_value=1, max_value=12),
    st.booleans(),
)
def test_out_of_range_years_clamp(year: int, month: int, bc: bool) -> None:
    if not bc and year <= 9999:
        return
    suffix = " BC" if bc else ""
    day_text = f"{year:04d}-{month:02d}-01"
    expected_date = date(1, 1, 1) if bc else date(9999, 12, 31)
    expected_ts = MIN_TS if bc else MAX_TS
    assert text_value(DATE, f"{day_text}{suffix}".encode()) == expected_date
    assert text_value(TIMESTAMP, f"{day_text} 12:00:00{suffix}".encode()) == expected_ts
    assert text_value(
        TIMESTAMPTZ, f"{day_text} 12:00:00+00{suffix}".encode()
    ) == expected_ts.replace(tzinfo=UTC)


def test_clamp_bounds_are_what_fastavro_returns() -> None:
    assert decode(codec_for(DATE), codec_for(DATE).from_text(b"infinity")) == date.fromordinal(
        DATE_MAX + 719163
    )
    assert date(1970, 1, 1) + timedelta(days=DATE_MIN) == date(1, 1, 1)
    assert datetime(1970, 1, 1) + timedelta(microseconds=TIMESTAMP_MAX) == MAX_TS
    assert datetime(1970, 1, 1) + timedelta(microseconds=TIMESTAMP_MIN) == MIN_TS


def test_repeated_timestamp_values_stay_correct() -> None:
    """The one-entry memo must never hand out another value's encoding."""
    codec = codec_for(TIMESTAMPTZ)
    values = [
        b"2024-01-02 03:04:05+00",
        b"2024-01-02 03:04:05+00",
        b"infinity",
        b"2024-01-02 03:04:05+00",
        b"2024-01-02 03:04:06+00",
    ]
    got = [decode(codec, codec.from_text(v)) for v in values]
    assert got == [utc(2024, 1, 2, 3, 4, 5)] * 2 + [
        utc(9999, 12, 31, 23, 59, 59, 999999),
        utc(2024, 1, 2, 3, 4, 5),
        utc(2024, 1, 2, 3, 4, 6),
    ]


# ------------------------------------------------------------------------ properties


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=-(2**15), max_value=2**15 - 1),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
def test_integers_roundtrip(i2: int, i4: int, i8: int) -> None:
    assert text_value(INT2, str(i2).encode()) == i2
    assert text_value(INT4, str(i4).encode()) == i4
    assert text_value(INT8, str(i8).encode()) == i8


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float8_roundtrip(value: float) -> None:
    text = (
        "NaN"
        if math.isnan(value)
        else "Infinity"
        if value == math.inf
        else "-Infinity"
        if value == -math.inf
        else repr(value)
    )
    assert same(text_value(FLOAT8, text.encode()), value)


@st.composite
def decimal_columns(draw: st.DrawFn) -> tuple[int, int, Decimal]:
    precision = draw(st.integers(min_value=1, max_value=60))
    scale = draw(st.integers(min_value=-5, max_value=precision + 3))
    integer_digits = precision - scale
    digits = draw(st.text("0123456789", min_size=precision, max_size=precision))
    unscaled = int(digits) * draw(st.sampled_from([1, -1]))
    value = Decimal(f"{unscaled}E{-scale}")  # exact; scaleb would round to 28 digits
    assert integer_digits >= -3
    return precision, scale, value


@settings(max_examples=400, deadline=None)
@given(decimal_columns())
def test_decimal_roundtrip(column: tuple[int, int, Decimal]) -> None:
    precision, scale, value = column
    # numeric_out: exactly max(scale, 0) fractional digits, never an exponent.
    text = f"{value:.{max(scale, 0)}f}"
    got = text_value(NUMERIC, text.encode(), typmod(precision, scale))
    assert got == value


# ------------------------------------------------------------------------ arrays


def pg_array_out(value: Any, delimiter: str = ",", always_quote: bool = False) -> str:
    """array_out for nested lists of str/None: the rules PostgreSQL uses to quote."""
    if isinstance(value, list):
        return "{" + delimiter.join(pg_array_out(v, delimiter, always_quote) for v in value) + "}"
    if value is None:
        return "NULL"
    needs = (
        always_quote
        or value == ""
        or value.upper() == "NULL"
        or any(c in value for c in '{}"\\' + delimiter + " \t\n\r\v\f")
    )
    if not needs:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.mark.parametrize(
    ("oid", "dims", "text", "expected"),
    [
        (INT4_ARRAY, 1, b"{}", []),
        (INT4_ARRAY, 2, b"{}", []),  # zero dimensions: empty for any declared count
        (INT4_ARRAY, 1, b"{1,NULL,3}", [1, None, 3]),
        (INT4_ARRAY, 1, b"{ 1 , 2 }", [1, 2]),
        (INT4_ARRAY, 1, b"[0:2]={7,8,9}", [7, 8, 9]),
        (INT4_ARRAY, 1, b"  [-5:-5]={4}", [4]),
        (INT4_ARRAY, 1, b"{null,Null}", [None, None]),
        (INT4_ARRAY, 2, b"{{1,2},{3,NULL}}", [[1, 2], [3, None]]),
        (INT4_ARRAY, 2, b"[0:1][-1:0]={{1,2},{3,4}}", [[1, 2], [3, 4]]),
        (INT4_ARRAY, 3, b"{{{1}},{{2}}}", [[[1]], [[2]]]),
        (INT4_ARRAY, 2, b"{ { 1 , 2 } , { 3 , 4 } }", [[1, 2], [3, 4]]),
        (TEXT_ARRAY, 1, b'{"a b",NULL,"NULL","",x}', ["a b", None, "NULL", "", "x"]),
        (
            TEXT_ARRAY,
            1,
            b'{"q\\"q","back\\\\slash","{","}",",",";"}',
            ['q"q', "back\\slash", "{", "}", ",", ";"],
        ),
        (TEXT_ARRAY, 1, b"{a\\,b,c\\\\d, e f ,\\ g\\ }", ["a,b", "c\\d", "e f", " g "]),
        (TEXT_ARRAY, 1, b'{"  spaced  ",nul,NULLS}', ["  spaced  ", "nul", "NULLS"]),
        (TEXT_ARRAY, 1, b"{\\NULL,N\\ULL}", ["NULL", "NULL"]),
        (TEXT_ARRAY, 1, '{ünï,"✓ 𝄞"}'.encode(), ["ünï", "✓ 𝄞"]),
        (TEXT_ARRAY, 2, b'{{"a,b","{c}"},{"}",NULL}}', [["a,b", "{c}"], ["}", None]]),
        (TEXT_ARRAY, 1, b'{"(1,2)","[3,4)"}', ["(1,2)", "[3,4)"]),
        (BOX_ARRAY, 1, b"{(1,1),(0,0);(3,3),(2,2)}", ["(1,1),(0,0)", "(3,3),(2,2)"]),
        (BOX_ARRAY, 1, b"{(1,1),(0,0);NULL}", ["(1,1),(0,0)", None]),
        (NUMERIC_ARRAY, 1, b"{1.50,NULL,-2}", [Decimal("1.50"), None, Decimal("-2.00")]),
        (
            TIMESTAMPTZ_ARRAY,
            1,
            b'{"2020-01-01 00:00:00+00",infinity,NULL}',
            [utc(2020, 1, 1), utc(9999, 12, 31, 23, 59, 59, 999999), None],
        ),
        (16387, 1, b'{happy,"sad face"}', ["happy", "sad face"]),
        (16391, 1, b"{12.5}", [Decimal("12.50")]),  # array of a domain with a typmod
        (16392, 0, b"{1,2}", [1, 2]),  # domain over an array
        (1001, 1, b'{"\\\\x00ff",abc}', [b"\x00\xff", b"abc"]),  # bytea[]
        (1000, 1, b"{t,f,NULL}", [True, False, None]),  # bool[]
    ],
)
def test_arrays(oid: int, dims: int, text: bytes, expected: Any) -> None:
    mod = typmod(12, 2) if oid == NUMERIC_ARRAY else -1
    assert same(text_value(oid, text, mod, dims), expected)


@pytest.mark.parametrize(
    ("dims", "text"),
    [
        (1, b"{{1,2},{3,4}}"),
        (2, b"{1,2}"),
        (2, b"{{{1}}}"),
        (2, b"{{1,2},3}"),
        (2, b"{1,{2}}"),
        (1, b"[1:1][1:1]={{5}}"),
    ],
)
def test_array_dimension_mismatch(dims: int, text: bytes) -> None:
    codec = codec_for(INT4_ARRAY, -1, dims)
    with pytest.raises(ValueError):
        codec.from_text(text)
    with pytest.raises(ValueError):
        codec.to_python(text)


texts = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), texts), max_size=8), st.booleans())
def test_text_array_roundtrip(items: list[str | None], always_quote: bool) -> None:
    text = pg_array_out(items, always_quote=always_quote).encode()
    assert text_value(TEXT_ARRAY, text) == items


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=4).flatmap(
        lambda width: st.lists(
            st.lists(
                st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
                min_size=width,
                max_size=width,
            ),
            min_size=1,
            max_size=4,
        )
    )
)
def test_int8_2d_array_roundtrip(rows: list[list[int | None]]) -> None:
    text = pg_array_out([[None if v is None else str(v) for v in row] for row in rows]).encode()
    assert text_value(INT8_ARRAY, text, dims=2) == rows


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), texts), min_size=1, max_size=6))
def test_box_delimiter_array_roundtrip(items: list[str | None]) -> None:
    # A box[] uses ';' as delimiter, so ',' inside elements needs no quoting.
    text = pg_array_out(items, delimiter=";").encode()
    assert text_value(BOX_ARRAY, text) == items
