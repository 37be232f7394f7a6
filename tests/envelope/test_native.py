"""The compiled change encoder (``cdcd.envelope._native``) equals the pure-Python one.

``TableEncoder.encode_change`` is the C encoder where the extension is built;
``TableEncoder.change`` is always the pure-Python reference it falls back
to. These properties run both on the same random tables and rows and require
the same bytes, or the same exception (type, message and hint): every type
the C code parses itself (int2/4/8 and oid, strings, bool, numeric(p, s),
timestamptz, timestamp, date) with the text PostgreSQL prints and with text
it never prints, every type it hands to the converter, nulls, unchanged
TOAST with and without a fill image, binary values, key columns, ``[T,
"null"]`` unions of columns with defaults and key columns kept nullable.

With ``CDCD_PURE_PYTHON=1`` (the second CI pass) the comparisons skip and
``test_pure_python_is_forced`` checks that nothing compiled runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tracemalloc
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.decode.numeric import decimal_codec, int_from_text
from cdcd.decode.relations import ColumnDefault, TableVersion
from cdcd.decode.temporal import DATE_CODEC, TIMESTAMP_CODEC, TIMESTAMPTZ_CODEC
from cdcd.decode.types import StaticCatalog
from cdcd.decode.values import bool_from_text, column_codec, encode_text_value
from cdcd.envelope import rowcode
from cdcd.envelope.encoder import (
    OP_CREATE,
    OP_DELETE,
    OP_READ,
    OP_UPDATE,
    TableEncoder,
    make_stamp,
    make_stamp_python,
)
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Column, TupleData
from cdcd.protocol.native import PURE_ENV, native_status, pure_forced
from cdcd.sink.native import producer_factory
from cdcd.source.libpq import native_module

ROOT = Path(__file__).resolve().parents[2]
NATIVE = rowcode.NATIVE
compiled = pytest.mark.skipif(
    NATIVE is None, reason=f"compiled change encoder not in use: {native_status()}"
)
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _Wire:
    def header(self, topic: str, role: str, schema: dict[str, Any]) -> bytes:
        return b"\xc3\x01" + (b"K" if role == "key" else b"V") * 8


# -- values: what PostgreSQL prints, and what it never does --------------------------


def _digits(draw: st.DrawFn, low: int, high: int) -> str:
    return draw(st.text("0123456789", min_size=low, max_size=high))


#: Powers of two and their neighbours, either sign: every varint length boundary
#: (zig-zagged or not) and int64's ends.
_INT_EDGES = sorted(
    {
        sign * ((1 << bits) + delta)
        for bits in range(64)
        for delta in (-1, 0, 1)
        for sign in (1, -1)
    }
    | {(1 << 63) - 1, -(1 << 63), 1 << 63}
)
ints = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(lambda n: str(n).encode()),
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
    st.sampled_from(_INT_EDGES).map(lambda n: str(n).encode()),
    st.sampled_from(
        [b"", b"-", b"+5", b" 5", b"5 ", b"1_000", b"007", b"-0", b"12x", b"9" * 18, b"9" * 19,
         b"-9223372036854775808", b"9223372036854775807", b"9223372036854775808",
         b"\xd9\xa3", b"0x10"]
    ),
)  # fmt: skip
strings = st.one_of(
    st.binary(max_size=40),
    st.integers(8180, 8200).map(lambda n: b"s" * n),
)
bools = st.sampled_from([b"t", b"f", b"true", b"T", b"", b"x"])


@st.composite
def numerics(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(
            st.sampled_from(
                [b"NaN", b"Infinity", b"-Infinity", b"1e5", b".5", b"5.", b"-", b"", b"+1.00",
                 b"1.2.3", b"--1", b"1,5", b"-.5", b"0", b"-0.00"]
            )
        )  # fmt: skip
    sign = draw(st.sampled_from(["", "", "-"]))
    whole = _digits(draw, 1, 22)
    frac = _digits(draw, 0, 22)
    return f"{sign}{whole}{'.' + frac if frac else ''}".encode()


def _two(n: int) -> str:
    return f"{n:02d}"


@st.composite
def timestamps(draw: st.DrawFn, zone: bool, date_only: bool = False) -> bytes:
    if draw(st.integers(0, 30)) == 0:
        return draw(
            st.sampled_from([b"infinity", b"-infinity", b"", b"2024-05-06", b"garbage", b"2024"])
        )
    year = draw(st.one_of(st.integers(1, 9999), st.integers(0, 12000)))
    text = f"{year:04d}-{_two(draw(st.integers(0, 13)))}-{_two(draw(st.integers(0, 32)))}"
    if not date_only:
        hour, minute, second = (
            draw(st.integers(0, 25)),
            draw(st.integers(0, 61)),
            draw(st.integers(0, 61)),
        )
        text += f" {_two(hour)}:{_two(minute)}:{_two(second)}"
        digits = draw(st.integers(0, 7))
        if digits:
            text += "." + _digits(draw, digits, digits)
        if zone or draw(st.integers(0, 20)) == 0:
            if not zone or draw(st.integers(0, 20)) != 0:
                parts = draw(st.integers(1, 3))
                fields = [
                    draw(st.integers(0, 25)),
                    draw(st.integers(0, 61)),
                    draw(st.integers(0, 61)),
                ]
                text += draw(st.sampled_from("+-")) + ":".join(_two(f) for f in fields[:parts])
    if draw(st.integers(0, 20)) == 0:
        text += " BC"
    return text.encode()


@st.composite
def realistic_timestamps(draw: st.DrawFn, zone: bool) -> bytes:
    """What PostgreSQL prints (DateStyle ISO, any TimeZone): C must parse it."""
    from datetime import datetime, timedelta, timezone

    moment = draw(st.datetimes(datetime(1, 1, 2), datetime(9999, 12, 30)))
    text = moment.strftime("%Y-%m-%d %H:%M:%S")
    text = f"{moment.year:04d}" + text[text.index("-") :]
    if moment.microsecond:
        text += f".{moment.microsecond:06d}".rstrip("0")
    if zone:
        offset = draw(st.integers(-15 * 3600 - 59 * 60, 15 * 3600 + 59 * 60))
        sign = "+" if offset >= 0 else "-"
        hours, rest = divmod(abs(offset), 3600)
        minutes, seconds = divmod(rest, 60)
        text += f"{sign}{hours:02d}"
        if minutes or seconds:
            text += f":{minutes:02d}"
        if seconds:
            text += f":{seconds:02d}"
        del timedelta, timezone
    return text.encode()


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).encode()),
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"x", b""]),
)
uuids = st.one_of(st.uuids().map(lambda u: str(u).encode()), st.binary(max_size=10))
byteas = st.one_of(
    st.binary(max_size=20).map(lambda b: b"\\x" + b.hex().encode()), st.just(b"\\xz")
)
int_arrays = st.sampled_from([b"{1,2,NULL}", b"{}", b"{{1,2},{3,4}}", b"{x}", b"1"])


def _numeric_typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


#: Column types: name, (type OID, typmod), text values.
TYPES: list[tuple[str, int, int, st.SearchStrategy[bytes]]] = [
    ("int2", 21, -1, ints),
    ("int4", 23, -1, ints),
    ("int8", 20, -1, ints),
    ("oid", 26, -1, ints),
    ("text", 25, -1, strings),
    ("varchar", 1043, -1, strings),
    ("jsonb", 3802, -1, strings),
    ("bool", 16, -1, bools),
    ("numeric(12,2)", 1700, _numeric_typmod(12, 2), numerics()),
    ("numeric(18,0)", 1700, _numeric_typmod(18, 0), numerics()),
    ("numeric(30,10)", 1700, _numeric_typmod(30, 10), numerics()),
    ("numeric(5,-2)", 1700, _numeric_typmod(5, -2), numerics()),
    ("numeric(3,5)", 1700, _numeric_typmod(3, 5), numerics()),
    ("numeric", 1700, -1, numerics()),
    ("timestamptz", 1184, -1, st.one_of(timestamps(True), realistic_timestamps(True))),
    ("timestamp", 1114, -1, st.one_of(timestamps(False), realistic_timestamps(False))),
    ("date", 1082, -1, st.one_of(timestamps(False, date_only=True), realistic_timestamps(False).map(lambda t: t[:10]))),
    ("float8", 701, -1, floats),
    ("uuid", 2950, -1, uuids),
    ("bytea", 17, -1, byteas),
    ("int4[]", 1007, -1, int_arrays),
]  # fmt: skip


@st.composite
def tables(draw: st.DrawFn, types: list[int] | None = None) -> tuple[TableEncoder, list[int]]:
    """A table version of random columns, keys, defaults and optional keys; its encoder."""
    choices = st.sampled_from(types) if types else st.integers(0, len(TYPES) - 1)
    picks = draw(st.lists(choices, min_size=1, max_size=8))
    count = len(picks)
    keys = sorted(draw(st.sets(st.integers(0, count - 1), max_size=3)))
    catalog = StaticCatalog()
    columns = tuple(
        Column(1 if i in keys else 0, f"c{i}", TYPES[p][1], TYPES[p][2])
        for i, p in enumerate(picks)
    )
    codecs = tuple(column_codec(c.type_oid, c.type_modifier, catalog) for c in columns)
    with_defaults = draw(st.booleans())
    defaults = (
        tuple(ColumnDefault(0) if draw(st.booleans()) else None for _ in range(count))
        if with_defaults
        else ()
    )
    optional = tuple(draw(st.booleans()) for _ in range(count)) if draw(st.booleans()) else ()
    table = TableVersion(
        relation_id=16400,
        schema="public",
        table="t",
        version=1,
        replica_identity="d",
        columns=columns,
        codecs=codecs,
        key_indexes=tuple(keys),
        defaults=defaults,
        optional=optional,
    )
    return TableEncoder(table, "pg.public.t", "pg", "app", _Wire()), picks  # type: ignore[arg-type]


@st.composite
def images(draw: st.DrawFn, picks: list[int]) -> TupleData:
    kinds = []
    values: list[bytes | None] = []
    for p in picks:
        kind = draw(st.sampled_from(b"tttttttnub"))
        kinds.append(kind)
        values.append(draw(TYPES[p][3]) if kind in b"tb" else None)
    return TupleData(bytes(kinds), tuple(values))


def _outcome(call: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", call(*args))
    except Exception as exc:  # noqa: BLE001 - compared, type and all
        return ("error", type(exc), str(exc), getattr(exc, "hint", None))


# -- the properties ----------------------------------------------------------------


@compiled
@SETTINGS
@given(st.data())
def test_compiled_changes_equal_the_pure_ones(data: st.DataObject) -> None:
    encoder, picks = data.draw(tables())
    assert encoder.encode_change != encoder.change  # the compiled one
    op = data.draw(st.sampled_from([OP_CREATE, OP_UPDATE, OP_DELETE, OP_READ]))
    before = data.draw(st.one_of(st.none(), images(picks)))
    after = data.draw(st.one_of(st.none(), images(picks)))
    stamp = make_stamp(
        data.draw(st.integers(0, 2**32 - 1)),
        Lsn(data.draw(st.integers(0, 2**63 - 1))),
        data.draw(st.integers(-(2**40), 2**42)),
        data.draw(st.booleans()),
    )
    seq = data.draw(st.one_of(st.integers(0, 9000), st.integers(0, 2**40)))
    compiled_result = _outcome(encoder.encode_change, op, before, after, stamp, seq)
    assert compiled_result == _outcome(encoder.change, op, before, after, stamp, seq)


#: What PostgreSQL prints for the types the C code parses itself.
REALISTIC: dict[str, st.SearchStrategy[bytes]] = {
    "int2": st.integers(-(2**15), 2**15 - 1).map(lambda n: str(n).encode()),
    "int4": st.integers(-(2**31), 2**31 - 1).map(lambda n: str(n).encode()),
    "int8": st.integers(-(10**18) + 1, 10**18 - 1).map(lambda n: str(n).encode()),
    "text": st.binary(max_size=30),
    "varchar": st.binary(max_size=30),
    "jsonb": st.binary(max_size=30),
    "bool": st.sampled_from([b"t", b"f"]),
    "numeric(12,2)": st.decimals(-(10**10) + 1, 10**10 - 1, places=2).map(
        lambda d: str(d).encode()
    ),
    "timestamptz": realistic_timestamps(True),
    "timestamp": realistic_timestamps(False),
    "date": realistic_timestamps(False).map(lambda t: t[:10]),
}


@compiled
@SETTINGS
@given(st.data())
def test_plain_rows_take_the_compiled_path(data: st.DataObject) -> None:
    """Rows of what PostgreSQL prints never fall back to Python (a fallback spy says so)."""
    fast = [i for i, t in enumerate(TYPES) if t[0] in REALISTIC]
    encoder, picks = data.draw(tables(fast))
    calls: list[object] = []

    def spy(*args: Any) -> Any:
        calls.append(args)
        return encoder.change(*args)

    values = [data.draw(REALISTIC[TYPES[p][0]]) for p in picks]
    columns = []
    for text, branch, null in zip(
        encoder._text, encoder._branches, _null_branches(encoder), strict=True
    ):
        kind, precision, scale = rowcode.native_column(text)
        assert kind != rowcode.K_OTHER
        columns.append((kind, branch, null, text, precision, scale))
    assert NATIVE is not None
    codec = NATIVE.RowCodec(
        columns,
        encoder._key_indexes,
        encoder.key_header,
        encoder.value_header,
        encoder._source_prefix,
        spy,
        TupleData,
    )
    row = TupleData(b"t" * len(values), tuple(values))
    stamp = make_stamp(7, Lsn(1 << 33), 1_700_000_000_000)
    for op, before, after in (
        (OP_CREATE, None, row),
        (OP_UPDATE, row, row),
        (OP_DELETE, row, None),
    ):
        assert codec.change(op, before, after, stamp, 3) == encoder.change(
            op, before, after, stamp, 3
        )
    assert calls == []


def _null_branches(encoder: TableEncoder) -> list[bytes]:
    from cdcd.envelope.schemas import value_first

    table = encoder.table
    return [b"\x02" if value_first(table, i) else b"\x00" for i in range(len(table.columns))]


@compiled
@SETTINGS
@given(
    st.integers(0, 2**32 - 1),
    st.one_of(st.integers(0, 2**63 - 1), st.integers(2**63, 2**64 - 1)),
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**70), 2**70)),
    st.booleans(),
    st.integers(0, 2**45),
)
def test_compiled_stamps_equal_the_pure_ones(
    xid: int, lsn: int, commit_ms: int, snapshot: bool, now_ms: int
) -> None:
    assert make_stamp is not make_stamp_python
    args = (xid, Lsn(lsn), commit_ms, snapshot, now_ms)
    compiled_stamp = _outcome(make_stamp, *args)
    assert compiled_stamp == _outcome(make_stamp_python, *args)
    if compiled_stamp[0] == "ok":
        assert type(compiled_stamp[1]) is type(make_stamp_python(*args))
        assert (
            make_stamp(xid, Lsn(lsn), commit_ms, snapshot=snapshot, now_ms=now_ms)
            == compiled_stamp[1]
        )


@compiled
def test_compiled_stamps_read_the_clock() -> None:
    import time

    before = time.time_ns() // 1_000_000
    stamp = make_stamp(1, Lsn(2), 3)
    after = time.time_ns() // 1_000_000
    assert stamp.ts_ms in {
        make_stamp_python(1, Lsn(2), 3, now_ms=ms).ts_ms for ms in range(before, after + 1)
    }
    assert stamp[:5] == make_stamp_python(1, Lsn(2), 3)[:5]


# -- the C parsers, value by value ------------------------------------------------------

KINDS = {
    "int": (rowcode.K_INT, int_from_text, 0, 0),
    "bool": (rowcode.K_BOOL, bool_from_text, 0, 0),
    "timestamptz": (rowcode.K_TIMESTAMPTZ, TIMESTAMPTZ_CODEC.from_text, 0, 0),
    "timestamp": (rowcode.K_TIMESTAMP, TIMESTAMP_CODEC.from_text, 0, 0),
    "date": (rowcode.K_DATE, DATE_CODEC.from_text, 0, 0),
    "string": (rowcode.K_STRING, encode_text_value, 0, 0),
}


def _c_value(kind: int, value: bytes, precision: int = 0, scale: int = 0) -> bytes | None:
    assert NATIVE is not None
    result: bytes | None = NATIVE.encode_value(kind, value, precision, scale)
    return result


@compiled
@SETTINGS
@given(
    st.sampled_from(sorted(KINDS)),
    st.one_of(
        ints, strings, bools, timestamps(True), timestamps(False), realistic_timestamps(True)
    ),
)
def test_each_c_parser_equals_its_converter(name: str, value: bytes) -> None:
    """Where a C parser takes a value, it gives the converter's bytes; it never takes a value
    the converter refuses."""
    kind, convert, precision, scale = KINDS[name]
    c = _c_value(kind, value, precision, scale)
    if c is not None:
        assert c == convert(value)


@compiled
@SETTINGS
@given(
    st.integers(1, 40),
    st.integers(-5, 25),
    numerics(),
    st.decimals(allow_nan=False, allow_infinity=False, places=None),
)
def test_the_c_decimal_parser_equals_the_converter(
    precision: int, scale: int, text: bytes, number: Decimal
) -> None:
    codec = decimal_codec(precision, scale)
    shape = rowcode.native_column(codec.from_text)
    assert shape[0] == rowcode.K_DECIMAL
    for value in (text, str(number).encode(), f"{number:f}".encode()):
        c = _c_value(rowcode.K_DECIMAL, value, shape[1], shape[2])
        if c is not None:
            assert c == codec.from_text(value)


@compiled
@SETTINGS
@given(realistic_timestamps(True), realistic_timestamps(False), st.integers(-(2**63), 2**63 - 1))
def test_what_postgresql_prints_is_parsed_in_c(tz: bytes, ts: bytes, number: int) -> None:
    """The common case never needs the converter (a performance guarantee, not a correctness one)."""
    assert _c_value(rowcode.K_TIMESTAMPTZ, tz) == TIMESTAMPTZ_CODEC.from_text(tz)
    assert _c_value(rowcode.K_TIMESTAMP, ts) == TIMESTAMP_CODEC.from_text(ts)
    assert _c_value(rowcode.K_DATE, ts[:10]) == DATE_CODEC.from_text(ts[:10])
    text = str(number).encode()
    if len(text.lstrip(b"-")) <= 18:
        assert _c_value(rowcode.K_INT, text) == int_from_text(text)
    money = f"{number % 10**10 * (1 if number >= 0 else -1) / 100:.2f}".encode()
    codec = decimal_codec(12, 2)
    assert _c_value(rowcode.K_DECIMAL, money, 12, 2) == codec.from_text(money)


@compiled
def test_integer_edges_in_c() -> None:
    """Every varint length boundary and int64's ends, each way, through the C integer parser."""
    for n in _INT_EDGES:
        text = str(n).encode()
        c = _c_value(rowcode.K_INT, text)
        if len(text.lstrip(b"-")) <= 18:
            assert c == int_from_text(text), n
        else:
            assert c is None, n  # 19 digits and more: int() decides, and may raise


def test_kind_numbers_match_the_c_enum() -> None:
    if NATIVE is None:
        pytest.skip(f"compiled change encoder not in use: {native_status()}")
    for name in ("OTHER", "STRING", "INT", "BOOL", "DECIMAL", "TIMESTAMPTZ", "TIMESTAMP", "DATE"):
        assert getattr(NATIVE, f"K_{name}") == getattr(rowcode, f"K_{name}")


@compiled
def test_no_reference_leaks() -> None:
    """Millions of calls through the fast path and every fallback leave no objects behind."""
    catalog = StaticCatalog()
    columns = tuple(
        Column(1 if i == 0 else 0, f"c{i}", oid, -1) for i, oid in enumerate([20, 25, 1184, 701])
    )
    table = TableVersion(16400, "public", "t", 1, "d", columns,
                         tuple(column_codec(c.type_oid, -1, catalog) for c in columns), (0,))  # fmt: skip
    encoder = TableEncoder(table, "pg.public.t", "pg", "app", _Wire())  # type: ignore[arg-type]
    stamp = make_stamp(1, Lsn(5), 0)
    rows = [
        TupleData(b"tttt", (b"1", b"x", b"2024-05-06 12:00:00+00", b"1.5")),
        TupleData(b"tnut", (b"2", None, None, b"NaN")),
        TupleData(b"tttt", (b"3", b"y", b"infinity", b"1")),
        TupleData(b"nttt", (None, b"y", b"2024-05-06 12:00:00+00", b"1")),  # null key: error
        TupleData(b"tttt", (b"x", b"y", b"2024-05-06 12:00:00+00", b"1")),  # bad int: error
    ]

    def churn() -> None:
        for _ in range(2000):
            for row in rows:
                _outcome(encoder.encode_change, OP_UPDATE, row, row, stamp, 1)

    churn()
    tracemalloc.start()
    first, _ = tracemalloc.get_traced_memory()
    churn()
    second, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert second - first < 64 * 1024, second - first


# -- build and selection ----------------------------------------------------------------


def test_compiled_extensions_are_built_and_current() -> None:
    """Where a C compiler exists, the extensions are built, current and in use.

    A failure here means the extension did not build (see the output of
    ``pip install -e .``), or was built from an older C source: rebuild it.
    """
    if pure_forced():
        pytest.skip(f"{PURE_ENV} is set")
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the pure-Python path is expected")
    producer_factory()  # decides the sink's producer: loads cdcd.sink._rdkafka
    native_module()  # loads cdcd.source._libpq
    expected = {
        "cdcd.protocol._native": "compiled",
        "cdcd.envelope._native": "compiled",
        "cdcd.sink._rdkafka": "compiled",
        "cdcd.source._libpq": "compiled",
    }
    if not Path("/usr/include/librdkafka/rdkafka.h").is_file():
        # Its build needs librdkafka's header (.ci/setup installs librdkafka-dev).
        expected["cdcd.sink._rdkafka"] = "pure (not built)"
    assert native_status() == expected


def test_pure_python_is_forced() -> None:
    """``CDCD_PURE_PYTHON=1`` runs the pure-Python decoder and encoder, compiled or not."""
    script = (
        "from cdcd.protocol.native import native_status\n"
        "from cdcd.protocol.decoder import PgOutputDecoder\n"
        "from cdcd.envelope import rowcode\n"
        "assert not PgOutputDecoder(1).compiled\n"
        "assert rowcode.NATIVE is None\n"
        "print(sorted(native_status().values()))\n"
    )
    env = {**os.environ, PURE_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "['pure (CDCD_PURE_PYTHON set)', 'pure (CDCD_PURE_PYTHON set)']"


def test_the_build_succeeds_without_a_compiler(tmp_path: Path) -> None:
    """``pip install`` with no working compiler still installs: the extensions are optional."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    sources = ("cdcd/protocol/_native.c", "cdcd/envelope/_native.c", "cdcd/sink/_rdkafka.c",
               "cdcd/source/_libpq.c")  # fmt: skip
    for source in sources:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / source, tmp_path / source)
    env = {**os.environ, "CC": "/bin/false", "LDSHARED": "/bin/false"}
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "tmp"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "building optional extension" in (result.stdout + result.stderr).lower()
        or "failed" in (result.stdout + result.stderr).lower()
    )
    assert not list((tmp_path / "out").rglob("*.so"))


def test_a_stale_build_is_not_used(tmp_path: Path) -> None:
    """A compiled module built from another source than the .c beside it runs pure Python."""
    if NATIVE is None:
        pytest.skip(f"compiled change encoder not in use: {native_status()}")
    package = tmp_path / "cdcd" / "envelope"
    package.mkdir(parents=True)
    built = Path(NATIVE.__file__)
    shutil.copy(built, package / built.name)
    (package / "_native.c").write_text("/* changed since the build */\n")
    script = (
        "import sys, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('cdcd.envelope._native', {str(package / built.name)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['cdcd.envelope._native'] = module\n"
        "spec.loader.exec_module(module)\n"
        "from cdcd.protocol.native import load_native, native_status\n"
        "assert load_native('cdcd.envelope._native') is None\n"
        "print(native_status()['cdcd.envelope._native'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k != PURE_ENV},
    ).stdout  # fmt: skip
    assert out.strip() == "pure (stale build)"
