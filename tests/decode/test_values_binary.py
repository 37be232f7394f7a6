"""Column codecs, binary (typsend) format.

Binary values are built here with ``struct`` following PostgreSQL's send
functions; the expected text forms are what PostgreSQL 15 prints (checked
against a real server in test_values_pg.py). Properties tie the two formats
together: for every value, ``from_binary(send(v))`` must give the same Avro
bytes as ``from_text(out(v))``.
"""

from __future__ import annotations

import io
import math
import struct
import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.decode.types import BUILTIN_TYPES, PgType, StaticCatalog
from cdcd.decode.values import ColumnCodec, column_codec

CATALOG = StaticCatalog(
    {
        16385: PgType(16385, "public", "citext", "b", "S", 0, 0, -1, ","),
        16386: PgType(16386, "public", "mood", "e", "E", 0, 0, -1, ","),
        16387: PgType(16387, "public", "_mood", "b", "A", 16386, 0, -1, ","),
        16388: PgType(16388, "public", "d_amount", "d", "N", 0, 1700, (10 << 16 | 2) + 4, ","),
        16393: PgType(16393, "public", "comp", "c", "C", 0, 0, -1, ","),
        16394: PgType(16394, "public", "_comp", "b", "A", 16393, 0, -1, ","),
        16395: PgType(16395, "public", "floatrange", "r", "R", 0, 0, -1, ","),
        16396: PgType(16396, "public", "hstore", "b", "U", 0, 0, -1, ","),
    }
)

PG_EPOCH_DAYS = 10_957
PG_EPOCH_US = PG_EPOCH_DAYS * 86_400_000_000
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
NUMERIC_12_2 = ((12 << 16) | 2) + 4


def codec_for(oid: int, mod: int = -1, dims: int = 1) -> ColumnCodec:
    return column_codec(oid, mod, CATALOG, dims)


def decode(codec: ColumnCodec, data: bytes) -> Any:
    schema = codec.avro_type
    parsed = fastavro.parse_schema(schema) if isinstance(schema, dict) else schema
    buf = io.BytesIO(data)
    value = fastavro.schemaless_reader(buf, parsed, None)
    assert buf.read() == b""
    return value


def binary_value(oid: int, data: bytes, mod: int = -1, dims: int = 1) -> Any:
    codec = codec_for(oid, mod, dims)
    return decode(codec, codec.from_binary(data))


# ------------------------------------------------------------------------ typsend builders


def i16(v: int) -> bytes:
    return struct.pack("!h", v)


def i32(v: int) -> bytes:
    return struct.pack("!i", v)


def i64(v: int) -> bytes:
    return struct.pack("!q", v)


def f64(v: float) -> bytes:
    return struct.pack("!d", v)


def numeric_send(value: Decimal | str) -> bytes:
    """numeric_send: ndigits, weight, sign, dscale, base-10000 digits (no trailing zero digits)."""
    special = {"NaN": 0xC000, "Infinity": 0xD000, "-Infinity": 0xF000}
    if isinstance(value, str):
        return struct.pack("!hhHh", 0, 0, special[value], 0)
    sign, digit_tuple, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    dscale = max(-exponent, 0)
    digits = "".join(map(str, digit_tuple))
    if exponent < 0:
        digits = digits.rjust(-exponent + 1, "0")
    # Align the decimal digits to groups of 4 around the decimal point.
    frac_len = -exponent if exponent < 0 else 0
    int_part = digits[: len(digits) - frac_len] if frac_len else digits + "0" * exponent
    frac_part = digits[len(digits) - frac_len :] if frac_len else ""
    int_part = int_part.lstrip("0")
    int_part = "0" * (-len(int_part) % 4) + int_part
    frac_part = frac_part + "0" * (-len(frac_part) % 4)
    groups = [int(int_part[i : i + 4]) for i in range(0, len(int_part), 4)]
    weight = len(groups) - 1
    groups += [int(frac_part[i : i + 4]) for i in range(0, len(frac_part), 4)]
    while groups and groups[0] == 0:  # leading zero groups
        groups.pop(0)
        weight -= 1
    while groups and groups[-1] == 0:
        groups.pop()
    if not groups:
        weight = 0
    return struct.pack(
        f"!hhHh{len(groups)}H",
        len(groups),
        weight,
        0x4000 if sign and groups else 0,
        dscale,
        *groups,
    )


def array_send(
    elements: list[bytes | None],
    element_oid: int,
    dims: list[int] | None = None,
    lower: list[int] | None = None,
) -> bytes:
    dims = dims if dims is not None else ([len(elements)] if elements else [])
    lower = lower if lower is not None else [1] * len(dims)
    head = struct.pack("!iiI", len(dims), int(any(e is None for e in elements)), element_oid)
    head += b"".join(struct.pack("!ii", d, lb) for d, lb in zip(dims, lower, strict=True))
    body = b"".join(i32(-1) if e is None else i32(len(e)) + e for e in elements)
    return head + body


def range_send(flags: int, lower: bytes | None = None, upper: bytes | None = None) -> bytes:
    out = bytes([flags])
    for bound in (lower, upper):
        if bound is not None:
            out += i32(len(bound)) + bound
    return out


def record_send(fields: list[tuple[int, bytes | None]]) -> bytes:
    out = i32(len(fields))
    for oid, data in fields:
        out += struct.pack("!I", oid) + (i32(-1) if data is None else i32(len(data)) + data)
    return out


# ------------------------------------------------------------------------ typed values


@pytest.mark.parametrize(
    ("oid", "data", "expected"),
    [
        (16, b"\x01", True),
        (16, b"\x00", False),
        (21, i16(-32768), -32768),
        (23, i32(INT32_MAX), INT32_MAX),
        (20, i64(INT64_MIN), INT64_MIN),
        (26, b"\xff\xff\xff\xff", 4294967295),
        (700, struct.pack("!f", 1.5), 1.5),
        (700, struct.pack("!f", -math.inf), -math.inf),
        (701, f64(0.1), 0.1),
        (701, f64(-0.0), -0.0),
        (25, "üñï ✓".encode(), "üñï ✓"),
        (1042, b"ab   ", "ab   "),
        (19, b"pg_class", "pg_class"),
        (16385, b"MiXeD", "MiXeD"),  # citext sends its text
        (16386, b"sad face", "sad face"),  # enum sends its label
        (114, b'{"a": 1}', '{"a": 1}'),
        (3802, b'\x01{"a": 1}', '{"a": 1}'),  # jsonb: version byte 1
        (4072, b"\x01$.a", "$.a"),  # jsonpath: version byte 1
        (142, b"<a>x</a>", "<a>x</a>"),
        (17, b"\x00\xff", b"\x00\xff"),
        (
            2950,
            bytes.fromhex("a0eebc999c0b4ef8bb6d6bb9bd380a11"),
            uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        ),
        (18, b"a", "a"),
        (18, b"\xe9", "\\351"),
        (18, b"\x00", ""),
        (1082, i32(0), date(2000, 1, 1)),
        (1082, i32(-1), date(1999, 12, 31)),
        (1082, i32(INT32_MAX), date(9999, 12, 31)),  # infinity
        (1082, i32(INT32_MIN), date(1, 1, 1)),  # -infinity
        (1082, i32(-800_000), date(1, 1, 1)),  # BC: clamped
        (1082, i32(3_000_000), date(9999, 12, 31)),  # year > 9999: clamped
        (1083, i64(0), time(0)),
        (1083, i64(86_400_000_000), time(23, 59, 59, 999999)),  # 24:00:00 clamped
        (1083, i64(45_296_789_012), time(12, 34, 56, 789012)),
        (1114, i64(0), datetime(2000, 1, 1)),
        (1114, i64(-1), datetime(1999, 12, 31, 23, 59, 59, 999999)),
        (1114, i64(INT64_MAX), datetime(9999, 12, 31, 23, 59, 59, 999999)),
        (1114, i64(INT64_MIN), datetime(1, 1, 1)),
        (1114, i64(-63_200_000_000_000_000), datetime(1, 1, 1)),  # BC
        (1184, i64(0), datetime(2000, 1, 1, tzinfo=UTC)),
        (1184, i64(INT64_MAX), datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
        (1700, numeric_send("NaN"), "NaN"),
        (1700, numeric_send("Infinity"), "Infinity"),
        (1700, numeric_send("-Infinity"), "-Infinity"),
        (1700, numeric_send(Decimal("0")), "0"),
        (1700, numeric_send(Decimal("1.000")), "1.000"),
        (1700, numeric_send(Decimal("-123.456")), "-123.456"),
        (1700, numeric_send(Decimal("1E-20")), "0.00000000000000000001"),
        (1700, numeric_send(Decimal("100000000")), "100000000"),
        (1700, numeric_send(Decimal("0.0001")), "0.0001"),
        (1700, numeric_send(Decimal("-0.00")), "0.00"),
        (1700, numeric_send(Decimal("1" + "0" * 5000 + ".5")), "1" + "0" * 5000 + ".5"),
        (1700, struct.pack("!hhHh2H", 2, 0, 0, 2, 12, 3400), "12.34"),
        (1700, struct.pack("!hhHh", 0, 0, 0, 3), "0.000"),  # zero keeps its display scale
    ],
)
def test_binary_values(oid: int, data: bytes, expected: Any) -> None:
    got = binary_value(oid, data)
    if isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == expected
        assert type(got) is type(expected)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (numeric_send(Decimal("1234567890.12")), Decimal("1234567890.12")),
        (numeric_send(Decimal("-0.01")), Decimal("-0.01")),
        (numeric_send(Decimal("5")), Decimal("5.00")),
        (numeric_send(Decimal("0")), Decimal("0.00")),
        (numeric_send(Decimal("1.50")), Decimal("1.50")),
    ],
)
def test_binary_decimal(data: bytes, expected: Decimal) -> None:
    got = binary_value(1700, data, NUMERIC_12_2)
    assert got == expected
    assert got.as_tuple().exponent == -2


@pytest.mark.parametrize("special", ["NaN", "Infinity", "-Infinity"])
def test_binary_decimal_special_raises(special: str) -> None:
    with pytest.raises(ValueError, match=special):
        codec_for(1700, NUMERIC_12_2).from_binary(numeric_send(special))


def test_binary_decimal_too_many_digits_raises() -> None:
    with pytest.raises(ValueError):
        codec_for(1700, NUMERIC_12_2).from_binary(numeric_send(Decimal("1.234")))
    with pytest.raises(ValueError):
        codec_for(1700, NUMERIC_12_2).from_binary(numeric_send(Decimal("12345678901")))


# ------------------------------------------------------------------------ text renderings


def interval(micros: int, days: int, months: int) -> bytes:
    return struct.pack("!qii", micros, days, months)


def inet(family: int, bits: int, addr: bytes, is_cidr: int = 0) -> bytes:
    return bytes([family, bits, is_cidr, len(addr)]) + addr


V6 = bytes.fromhex


@pytest.mark.parametrize(
    ("oid", "data", "text"),
    [
        # interval, IntervalStyle=postgres
        (1186, interval(14_706_500_000, 3, 14), "1 year 2 mons 3 days 04:05:06.5"),
        (1186, interval(7_200_000_000, -1, 0), "-1 days +02:00:00"),
        (1186, interval(0, 0, 0), "00:00:00"),
        (1186, interval(0, 0, -14), "-1 years -2 mons"),
        (1186, interval(-1_000_000, 1, 0), "1 day -00:00:01"),
        (1186, interval(-1, 0, 0), "-00:00:00.000001"),
        (1186, interval(360_000_000_000_000, 0, 0), "100000:00:00"),
        (1186, interval(0, 0, 12 * 178_000_000), "178000000 years"),
        (1186, interval(0, -1, 1), "1 mon -1 days"),
        (1186, interval(-1_000_000, 1, -1), "-1 mons +1 day -00:00:01"),
        (1186, interval(0, 1, 1), "1 mon 1 day"),
        (1186, interval(1_500_000, 0, 13), "1 year 1 mon 00:00:01.5"),
        (1186, interval(-90_000_000, 0, 0), "-00:01:30"),
        # timetz: µs then zone seconds WEST of UTC
        (1266, struct.pack("!qi", 14_706_789_000, -7200), "04:05:06.789+02"),
        (1266, struct.pack("!qi", 14_706_000_000, 12615), "04:05:06-03:30:15"),
        (1266, struct.pack("!qi", 0, 0), "00:00:00+00"),
        (1266, struct.pack("!qi", 86_400_000_000, 57540), "24:00:00-15:59"),
        # money, C locale
        (790, i64(123456), "$1,234.56"),
        (790, i64(-100), "-$1.00"),
        (790, i64(0), "$0.00"),
        (790, i64(-1), "-$0.01"),
        (790, i64(INT64_MAX), "$92,233,720,368,547,758.07"),
        (790, i64(INT64_MIN), "-$92,233,720,368,547,758.08"),
        # inet / cidr (PGSQL_AF_INET = 2, PGSQL_AF_INET6 = 3)
        (869, inet(2, 32, bytes([192, 168, 0, 1])), "192.168.0.1"),
        (869, inet(2, 24, bytes([192, 168, 0, 1])), "192.168.0.1/24"),
        (869, inet(2, 0, bytes(4)), "0.0.0.0/0"),
        (869, inet(3, 128, V6("00000000000000000000000000000001")), "::1"),
        (869, inet(3, 64, V6("20010db8000000000000000000000001")), "2001:db8::1/64"),
        (869, inet(3, 128, V6("00000000000000000000ffff01020304")), "::ffff:1.2.3.4"),
        (869, inet(3, 128, V6("00000000000000000000000001020304")), "::1.2.3.4"),
        (869, inet(3, 128, V6("00000000000000000000000000000102")), "::102"),
        (869, inet(3, 128, V6("fe800000000000010000000000000001")), "fe80:0:0:1::1"),
        (869, inet(3, 128, bytes(16)), "::"),
        (869, inet(3, 128, V6("00010000000000010000000000000001")), "1:0:0:1::1"),
        (869, inet(3, 128, V6("00010000000000010000000000010001")), "1::1:0:0:1:1"),
        (869, inet(3, 128, V6("00000002000300040005000600070008")), "0:2:3:4:5:6:7:8"),
        (869, inet(3, 128, V6("00010002000300040005000600070000")), "1:2:3:4:5:6:7:0"),
        (869, inet(3, 128, V6("00010002000300040005000600000000")), "1:2:3:4:5:6::"),
        (650, inet(2, 8, bytes([10, 0, 0, 0]), 1), "10.0.0.0/8"),
        (650, inet(2, 32, bytes([1, 2, 3, 4]), 1), "1.2.3.4/32"),
        (650, inet(3, 0, bytes(16), 1), "::/0"),
        (650, inet(3, 32, V6("20010db8000000000000000000000000"), 1), "2001:db8::/32"),
        (829, bytes.fromhex("08002b010203"), "08:00:2b:01:02:03"),
        (774, bytes.fromhex("08002b0102030405"), "08:00:2b:01:02:03:04:05"),
        # bit strings
        (1560, i32(4) + b"\xa0", "1010"),
        (1562, i32(0), ""),
        (1562, i32(9) + b"\xaa\x80", "101010101"),
        # geometric, shortest float text as PostgreSQL 12+ prints it
        (600, f64(1) + f64(2), "(1,2)"),
        (600, f64(1e20) + f64(-0.5), "(1e+20,-0.5)"),
        (600, f64(math.nan) + f64(math.inf), "(NaN,Infinity)"),
        (600, f64(0.1) + f64(-0.0), "(0.1,-0)"),
        (600, f64(1e15) + f64(1e14), "(1e+15,100000000000000)"),
        (600, f64(1.5e-5) + f64(0.0001), "(1.5e-05,0.0001)"),
        (600, f64(123456789012345678) + f64(-1e-300), "(1.2345678901234568e+17,-1e-300)"),
        (628, f64(1) + f64(2) + f64(3), "{1,2,3}"),
        (601, f64(1) + f64(2) + f64(3) + f64(4), "[(1,2),(3,4)]"),
        (603, f64(3) + f64(4) + f64(1) + f64(2), "(3,4),(1,2)"),
        (602, b"\x00" + i32(2) + f64(1) + f64(2) + f64(3) + f64(4), "[(1,2),(3,4)]"),
        (602, b"\x01" + i32(1) + f64(0) + f64(0), "((0,0))"),
        (604, i32(3) + f64(0) + f64(0) + f64(1) + f64(1) + f64(2) + f64(0), "((0,0),(1,1),(2,0))"),
        (718, f64(1) + f64(2) + f64(3), "<(1,2),3>"),
        # tsvector: lexeme\0, npos, positions (weight in the top 2 bits)
        (
            3614,
            i32(3)
            + b"a\x00"
            + i16(2)
            + struct.pack("!HH", 1 | 3 << 14, 2 | 2 << 14)
            + b"back\\slash\x00"
            + i16(1)
            + struct.pack("!H", 3 | 1 << 14)
            + b"it's\x00"
            + i16(0),
            "'a':1A,2B 'back\\\\slash':3C 'it''s'",
        ),
        (3614, i32(0), ""),
        # misc
        (3220, struct.pack("!Q", 0x16_B374D848), "16/B374D848"),
        (3220, struct.pack("!Q", 0), "0/0"),
        (28, struct.pack("!I", 4294967295), "4294967295"),
        (5069, struct.pack("!Q", 2**64 - 1), "18446744073709551615"),
        (27, struct.pack("!IH", 4294967295, 65535), "(4294967295,65535)"),
        (5038, i32(2) + struct.pack("!QQQQ", 10, 20, 10, 14), "10:20:10,14"),
        (5038, i32(0) + struct.pack("!QQ", 10, 10), "10:10:"),
        (22, array_send([i16(1), i16(-2)], 21), "1 -2"),
        (30, array_send([struct.pack("!I", 4294967295)], 26), "4294967295"),
        (1790, b"cursor name", "cursor name"),
    ],
)
def test_text_renderings(oid: int, data: bytes, text: str) -> None:
    assert binary_value(oid, data) == text


def test_composite_and_range_renderings() -> None:
    ts = i64(0)
    assert binary_value(3904, range_send(0x02, i32(1), i32(5))) == "[1,5)"
    assert binary_value(3904, range_send(0x01)) == "empty"
    assert binary_value(3904, range_send(0x08 | 0x10)) == "(,)"
    assert binary_value(3904, range_send(0x02 | 0x10, i32(3))) == "[3,)"
    assert (
        binary_value(
            3906, range_send(0x04, numeric_send(Decimal("1.5")), numeric_send(Decimal("2.50")))
        )
        == "(1.5,2.50]"
    )
    assert binary_value(3908, range_send(0x02 | 0x10, ts)) == '["2000-01-01 00:00:00",)'
    assert (
        binary_value(3910, range_send(0x02 | 0x04, i64(INT64_MIN), i64(INT64_MAX)))
        == "[-infinity,infinity]"
    )
    assert (
        binary_value(3912, range_send(0x02, i32(-800_000), i32(0)))
        == '["0192-09-04 BC",2000-01-01)'  # as PostgreSQL prints it
    )
    first, second = range_send(0x02, i32(1), i32(3)), range_send(0x02, i32(5), i32(7))
    multirange = i32(2) + i32(len(first)) + first + i32(len(second)) + second
    assert binary_value(4451, multirange) == "{[1,3),[5,7)}"
    assert binary_value(4451, i32(0)) == "{}"
    composite = record_send(
        [
            (23, i32(1)),
            (25, b'x"y\\z(,)'),
            (1700, numeric_send("NaN")),
            (1184, i64(INT64_MAX)),
            (1007, array_send([i32(1), None], 23)),
            (16386, b"sad face"),
            (17, b"\x00\xff"),
            (25, b""),
            (25, None),
            (1009, array_send([b"a b", b"NULL", b"", None, b'q"\\'], 25, [5], [0])),
        ]
    )
    assert binary_value(16393, composite) == (
        '(1,"x""y\\\\z(,)",NaN,infinity,"{1,NULL}","sad face","\\\\x00ff","",,'
        '"[0:4]={""a b"",""NULL"","""",NULL,""q\\\\""\\\\\\\\""}")'
    )
    two_d = array_send([i32(1), i32(2), i32(3), i32(4)], 23, [2, 2], [1, 1])
    assert binary_value(16393, record_send([(1007, two_d)])) == '("{{1,2},{3,4}}")'
    box_array = array_send([f64(3) + f64(4) + f64(1) + f64(2), None], 603)
    assert binary_value(16393, record_send([(1020, box_array)])) == '("{(3,4),(1,2);NULL}")'
    assert (
        binary_value(16393, record_send([(16393, record_send([(23, None), (25, b"a")]))]))
        == '("(,a)")'
    )
    float4 = struct.pack("!f", 0.1)
    assert (
        binary_value(16393, record_send([(700, float4), (701, f64(0.1)), (16, b"\x01")]))
        == "(0.1,0.1,t)"
    )


# ------------------------------------------------------------------------ arrays


def test_binary_arrays() -> None:
    assert binary_value(1007, array_send([], 23)) == []
    assert binary_value(1007, array_send([], 23), dims=2) == []
    assert binary_value(1007, array_send([i32(1), None, i32(3)], 23)) == [1, None, 3]
    assert binary_value(1007, array_send([i32(7), i32(8)], 23, [2], [0])) == [7, 8]
    assert binary_value(
        1007, array_send([i32(1), i32(2), i32(3), None, i32(5), i32(6)], 23, [2, 3]), dims=2
    ) == [[1, 2, 3], [None, 5, 6]]
    assert binary_value(1007, array_send([i32(1), i32(2)], 23, [2, 1, 1]), dims=3) == [[[1]], [[2]]]
    assert binary_value(1009, array_send([b"a,b", None, b"NULL"], 25)) == ["a,b", None, "NULL"]
    assert binary_value(16387, array_send([b"happy"], 16386)) == ["happy"]
    assert binary_value(
        1231, array_send([numeric_send(Decimal("1.5")), None], 1700), NUMERIC_12_2
    ) == [Decimal("1.50"), None]
    assert binary_value(1185, array_send([i64(0), i64(INT64_MAX)], 1184)) == [
        datetime(2000, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ]
    assert binary_value(1020, array_send([f64(3) + f64(4) + f64(1) + f64(2)], 603)) == [
        "(3,4),(1,2)"
    ]
    assert binary_value(16394, array_send([record_send([(23, i32(1))]), None], 16393)) == [
        "(1)",
        None,
    ]


@pytest.mark.parametrize(
    ("dims", "data"),
    [
        (1, array_send([i32(1), i32(2), i32(3), i32(4)], 23, [2, 2])),
        (2, array_send([i32(1)], 23)),
    ],
)
def test_binary_array_dimension_mismatch(dims: int, data: bytes) -> None:
    with pytest.raises(ValueError, match="dimension"):
        codec_for(1007, -1, dims).from_binary(data)


# ------------------------------------------------------------------------ refused types


@pytest.mark.parametrize(
    ("oid", "data"),
    [
        (3615, b"\x00\x00\x00\x01"),  # tsquery
        (2205, struct.pack("!I", 1259)),  # regclass: sends an OID, prints a name
        (2206, struct.pack("!I", 23)),  # regtype
        (16395, range_send(0x02, f64(1.5), f64(2.5))),  # user-defined range: subtype unknown
        (16396, b"\x00\x00\x00\x00"),  # extension type (hstore)
        (3645, array_send([b"\x00\x00\x00\x00"], 3615)),  # tsquery[] with an element
    ],
)
def test_refused_binary_types(oid: int, data: bytes) -> None:
    codec = codec_for(oid)
    with pytest.raises(ValueError, match="binary=false"):
        codec.from_binary(data)
    text = b"{x}" if oid == 3645 else b"x"
    assert decode(codec, codec.from_text(text)) in ("x", ["x"])  # the text format still works


def test_composite_with_refused_field_raises() -> None:
    with pytest.raises(ValueError, match="binary=false"):
        codec_for(16393).from_binary(record_send([(23, i32(1)), (3615, b"\x00")]))


# ------------------------------------------------------------------------ text/binary agreement


def agree(oid: int, text: bytes, data: bytes, mod: int = -1, dims: int = 1) -> None:
    codec = codec_for(oid, mod, dims)
    assert codec.from_binary(data) == codec.from_text(text), (text, data)


def pg_fraction(micros: int) -> str:
    return "." + f"{micros:06d}".rstrip("0") if micros else ""


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(2**63) + 1, max_value=2**63 - 2))
def test_timestamp_text_and_binary_agree(pg_micros: int) -> None:
    unix = pg_micros + PG_EPOCH_US
    days, rest = divmod(unix, 86_400_000_000)
    if -719_162 <= days <= 2_932_896:
        moment = datetime(1970, 1, 1) + timedelta(microseconds=unix)
        text = (
            f"{moment.year:04d}"
            + moment.strftime("-%m-%d %H:%M:%S")
            + pg_fraction(moment.microsecond)
        )
        agree(1114, text.encode(), i64(pg_micros))
        agree(1184, (text + "+00").encode(), i64(pg_micros))
    # The binary-to-text renderer (used inside ranges) prints what the text parser reads.
    rendered = binary_value(3908, range_send(0x02 | 0x10, i64(pg_micros)))
    agree(1114, rendered[1:-2].strip('"').encode(), i64(pg_micros))


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(2**31) + 1, max_value=2**31 - 2))
def test_date_text_and_binary_agree(pg_days: int) -> None:
    rendered = binary_value(3912, range_send(0x02 | 0x10, i32(pg_days)))
    agree(1082, rendered[1:-2].strip('"').encode(), i32(pg_days))


@settings(max_examples=300, deadline=None)
@given(
    st.decimals(allow_nan=False, allow_infinity=False, places=None).filter(
        lambda d: abs(d.as_tuple().exponent) < 200 and len(d.as_tuple().digits) < 200
    )
)  # type: ignore[union-attr]
def test_numeric_text_and_binary_agree(value: Decimal) -> None:
    text = f"{value:f}"
    if value.as_tuple().exponent > 0:  # type: ignore[operator]
        text = f"{value.quantize(Decimal(1)):f}"
        value = Decimal(text)
    if text.startswith("-") and value == 0:
        text = text[1:]  # PostgreSQL never prints -0
    assert codec_for(1700).from_binary(numeric_send(value)) == codec_for(1700).from_text(
        text.encode()
    )


@settings(max_examples=300, deadline=None)
@given(st.integers(-(10**12) + 1, 10**12 - 1))
def test_decimal_text_and_binary_agree(cents: int) -> None:
    value = Decimal(cents).scaleb(-2)
    agree(1700, f"{value:.2f}".encode(), numeric_send(value), mod=(14 << 16 | 2) + 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), max_size=10))
def test_int_array_text_and_binary_agree(items: list[int | None]) -> None:
    text = "{" + ",".join("NULL" if v is None else str(v) for v in items) + "}"
    agree(1007, text.encode(), array_send([None if v is None else i32(v) for v in items], 23))


@settings(max_examples=200, deadline=None)
@given(st.floats(width=32), st.floats())
def test_floats_text_and_binary_agree(f4: float, f8: float) -> None:
    def pg(value: float) -> bytes:
        if math.isnan(value):
            return b"NaN"
        if math.isinf(value):
            return b"Infinity" if value > 0 else b"-Infinity"
        return repr(value).encode()

    for oid, data, value in ((700, struct.pack("!f", f4), f4), (701, f64(f8), f8)):
        if math.isnan(value):
            # Binary keeps the NaN's payload bits; any NaN decodes as NaN.
            assert math.isnan(binary_value(oid, data))
        else:
            agree(oid, pg(value), data)


# ------------------------------------------------------------------------ robustness


BUILTIN_CODECS = [(oid, codec_for(oid)) for oid in sorted(BUILTIN_TYPES)]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(BUILTIN_CODECS), st.binary(max_size=40))
def test_garbage_raises_only_value_errors(item: tuple[int, ColumnCodec], data: bytes) -> None:
    """Any input gives Avro bytes or ValueError/OverflowError, never another exception."""
    _oid, codec = item
    for convert in (codec.from_text, codec.from_binary):
        try:
            convert(data)
        except (ValueError, OverflowError):
            pass
