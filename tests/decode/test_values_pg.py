"""Column codecs against a real PostgreSQL 15 (integration).

For every SPEC §5 type, and arrays of each, a table gets one column per type;
rows hold representative and edge values (NULL, infinity, NaN, unicode,
empty arrays, large numerics ...). The pgoutput Insert payloads are read from
a slot (with several session time zones), run through the codecs and decoded with plain fastavro. The expected values
are computed independently by PostgreSQL itself in a normal SELECT:
``col::text`` for string-mapped types, ``extract(epoch ...)`` for dates and
times, ``encode(col, 'hex')`` for bytea, and so on.
"""

from __future__ import annotations

import io
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import fastavro
import psycopg2
import pytest
from support.pg import PgDatabase, read_pgoutput

from cdcd.decode.values import (
    DATE_MAX,
    DATE_MIN,
    TIME_MAX,
    TIMESTAMP_MAX,
    TIMESTAMP_MIN,
    ColumnCodec,
    column_codec,
)
from cdcd.protocol import PgOutputDecoder
from cdcd.protocol.messages import KIND_NULL, KIND_TEXT, Insert, Relation
from cdcd.source.catalog import PgCatalog, column_dimensions

from .helpers import same

pytestmark = pytest.mark.integration

SESSION = "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3"


def _clamp(value: Decimal, low: int, high: int) -> int:
    return int(min(max(value, Decimal(low)), Decimal(high)))


def _epoch_date(text: str) -> date:
    days = _clamp(Decimal(text) / 86400, DATE_MIN, DATE_MAX)
    return date(1970, 1, 1) + timedelta(days=days)


def _epoch_time(text: str) -> time:
    micros = _clamp(Decimal(text), 0, TIME_MAX)
    return (datetime(2000, 1, 1) + timedelta(microseconds=micros)).time()


def _epoch_timestamp(text: str) -> datetime:
    micros = _clamp(Decimal(text), TIMESTAMP_MIN, TIMESTAMP_MAX)
    return datetime(1970, 1, 1) + timedelta(microseconds=micros)


def _epoch_timestamptz(text: str) -> datetime:
    micros = _clamp(Decimal(text), TIMESTAMP_MIN, TIMESTAMP_MAX)
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)


def _float4(text: str) -> float:
    value: float = struct.unpack("<f", struct.pack("<f", float(text)))[0]
    return value


# How PostgreSQL computes the expected value (SQL on the value ``{}``) and how the
# resulting text becomes the Python value fastavro must return.
# format('%s', x) calls the type's output function; x::text is not always that
# (char(n)::text strips the padding, inet::text always shows the mask).
_AS_TEXT = ("CASE WHEN num_nulls({0}) = 0 THEN format('%s', {0}) END", str)
_EXPECT: dict[str, tuple[str, Callable[[str], Any]]] = {
    "text": _AS_TEXT,
    "int": ("{}::text", int),
    "bool": ("{}::text", lambda s: s == "true"),
    "float4": ("{}::text", _float4),
    "float8": ("{}::text", float),
    "decimal": ("{}::text", Decimal),
    "bytea": ("encode({}, 'hex')", bytes.fromhex),
    "uuid": ("{}::text", uuid.UUID),
    "date": ("extract(epoch from {})::text", _epoch_date),
    "time": ("(extract(epoch from {}) * 1000000)::text", _epoch_time),
    "timestamp": ("(extract(epoch from {}) * 1000000)::text", _epoch_timestamp),
    "timestamptz": ("(extract(epoch from {}) * 1000000)::text", _epoch_timestamptz),
}


@dataclass(frozen=True)
class Spec:
    """One column type: SQL type, values (SQL expressions), how to compute the expectation."""

    name: str
    sql_type: str
    values: tuple[str, ...]
    expect: str = "text"
    array: bool = True


SPECS: tuple[Spec, ...] = (
    Spec("bool", "bool", ("true", "false"), "bool"),
    Spec("i2", "int2", ("0", "-32768", "32767"), "int"),
    Spec("i4", "int4", ("0", "-2147483648", "2147483647", "42"), "int"),
    Spec("i8", "int8", ("0", "-9223372036854775808", "9223372036854775807"), "int"),
    Spec("oid", "oid", ("0", "4294967295"), "int"),
    Spec(
        "f4",
        "float4",
        ("1.5", "'NaN'", "'Infinity'", "'-Infinity'", "3.4028235e38", "1e-45", "'-0'", "0.1"),
        "float4",
    ),
    Spec(
        "f8",
        "float8",
        ("0.1", "'NaN'", "'Infinity'", "'-Infinity'", "1.7976931348623157e308", "5e-324", "'-0'"),
        "float8",
    ),
    Spec(
        "dec",
        "numeric(12,2)",
        ("0", "1234567890.12", "-0.01", "9999999999.99", "1.5", "-42"),
        "decimal",
    ),
    Spec(
        "dec_big",
        "numeric(1000,500)",
        ("repeat('9', 500) || '.' || repeat('9', 500)", "'-0.' || repeat('0', 499) || '1'"),
        "decimal",
    ),
    Spec("dec_neg", "numeric(5,-2)", ("12345", "-9999900", "0"), "decimal"),
    Spec("dec_frac", "numeric(3,5)", ("0.00123", "-0.00999", "0"), "decimal"),
    Spec(
        "num",
        "numeric",
        (
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "0",
            "1.000",
            "-123.456",
            "1e-20",
            "'1' || repeat('0', 5000) || '.5'",
            "0.0001",
            "'-0.00'",
        ),
    ),
    Spec(
        "txt",
        "text",
        (
            "''",
            "'hello'",
            "'üñíçødé ✓ 𝄞'",
            "E'line\\nbreak\\ttab'",
            "'with \"quotes\" and \\backslash'",
            "'{braces},commas;semi'",
            "'NULL'",
            "' spaces '",
            "'(paren)'",
        ),
    ),
    Spec("vc", "varchar(10)", ("'abc'", "''", "'ü'")),
    Spec("bpc", "char(5)", ("'ab'", "'abcde'", "''")),
    Spec("nm", "name", ("'pg_class'", "'ünï'")),
    Spec("ci", "citext", ("'MiXeD'", "'x y'")),
    Spec("mood", "mood", ("'happy'", "'sad face'")),
    Spec("dtext", "d_text", ("'domain text'",)),
    Spec("dmoney", "d_amount", ("12.5", "-99999999.99"), "decimal"),
    Spec("dint", "d_posint", ("1", "2147483647"), "int"),
    Spec("ch", '"char"', ("'a'", "'\\351'", "''", "'\"'")),
    Spec(
        "by",
        "bytea",
        ("'\\x'", "'\\x00ff10'", "'abc'::bytea", "decode(repeat('ab', 1000), 'hex')"),
        "bytea",
    ),
    Spec(
        "uu",
        "uuid",
        ("'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'00000000-0000-0000-0000-000000000000'"),
        "uuid",
    ),
    Spec("js", "json", ('\'{"a": [1, 2.50, "x"]}\'', "'\"str\"'", "'null'", "'  {\"s\" : 1} '")),
    Spec("jb", "jsonb", ('\'{"b": 1, "a": [true, null]}\'', "'\"ü\"'", "'1.50'", "'[]'")),
    Spec(
        "dt",
        "date",
        (
            "'2024-02-29'",
            "'infinity'",
            "'-infinity'",
            "'0044-03-15 BC'",
            "'10000-01-01'",
            "'0001-01-01'",
            "'9999-12-31'",
            "'1970-01-01'",
            "'1969-12-31'",
            "'5874897-12-31'",
        ),
        "date",
    ),
    Spec(
        "tm",
        "time",
        ("'00:00:00'", "'24:00:00'", "'12:34:56.789012'", "'23:59:59.999999'", "'01:02:03.1'"),
        "time",
    ),
    Spec(
        "ts",
        "timestamp",
        (
            "'2024-01-02 03:04:05.123456'",
            "'infinity'",
            "'-infinity'",
            "'0044-03-15 12:00:00 BC'",
            "'10000-01-01 00:00:00'",
            "'1969-12-31 23:59:59.999999'",
            "'0001-01-01 00:00:00'",
            "'9999-12-31 23:59:59.999999'",
            "'294276-12-31 23:59:59.999999'",
            "'2000-02-29 00:00:00.5'",
        ),
        "timestamp",
    ),
    Spec(
        "tstz",
        "timestamptz",
        (
            "'2024-01-02 03:04:05.123456+05:30'",
            "'infinity'",
            "'-infinity'",
            "'10000-01-01 04:00:00+05'",
            "'0001-01-01 00:00:00+00'",
            "'0001-01-01 12:00:00+00'",
            "'1900-01-01 00:00:00 Europe/Amsterdam'",
            "'1969-12-31 23:59:59.999999+00'",
            "'9999-12-31 23:59:59.999999+00'",
            "'0044-03-15 12:00:00+00 BC'",
            "'2024-07-01 12:00:00.1-03'",
        ),
        "timestamptz",
    ),
    Spec(
        "iv",
        "interval",
        (
            "'1 year 2 mons 3 days 04:05:06.5'",
            "'-1 days +02:00:00'",
            "'0'",
            "'-1 year -2 mons'",
            "'1 day -00:00:01'",
            "'-00:00:00.000001'",
            "'100000 hours'",
            "'178000000 years'",
            "'-178000000 years'",
            "'1 mon -1 days'",
            "'-1 mons 1 day -1 second'",
        ),
    ),
    Spec(
        "ttz",
        "timetz",
        ("'04:05:06.789+02'", "'04:05:06-03:30:15'", "'00:00:00+00'", "'24:00:00-15:59'"),
    ),
    Spec(
        "mny",
        "money",
        ("1234.56", "-1", "0", "-0.01", "'92233720368547758.07'", "'-92233720368547758.08'"),
    ),
    Spec(
        "ip",
        "inet",
        (
            "'192.168.0.1'",
            "'192.168.0.1/24'",
            "'10.0.0.0/8'",
            "'::1'",
            "'2001:db8::1/64'",
            "'::ffff:1.2.3.4'",
            "'::1.2.3.4'",
            "'fe80::1:0:0:0:1'",
            "'0.0.0.0/0'",
            "'::'",
            "'1:0:0:1:0:0:0:1'",
            "'1:0:0:1:0:0:1:1'",
            "'::2:3:4:5:6:7:8'",
            "'1:2:3:4:5:6:7::'",
            "'::0.0.1.2'",
        ),
    ),
    Spec(
        "cid",
        "cidr",
        ("'10.0.0.0/8'", "'192.168.0.0/24'", "'2001:db8::/32'", "'1.2.3.4/32'", "'::/0'"),
    ),
    Spec("mac", "macaddr", ("'08:00:2b:01:02:03'",)),
    Spec("mac8", "macaddr8", ("'08:00:2b:01:02:03:04:05'",)),
    Spec(
        "xm",
        "xml",
        (
            "'<a>x</a>'",
            "'<?xml version=\"1.0\"?><b/>'",
            "'text node'",
            '\'<?xml version="1.0" standalone="yes"?><c/>\'',
            '\'<?xml version="1.0" encoding="UTF-8"?>\n<d>ü</d>\'',
        ),
    ),
    Spec("bt", "bit(4)", ("B'1010'", "B'0000'")),
    Spec("vb", "varbit", ("B''", "B'1'", "B'101010101'")),
    Spec("pt", "point", ("'(1,2)'", "'(1e20,-0.5)'", "'(NaN,Infinity)'", "'(0.1,-0)'")),
    Spec("ln", "line", ("'{1,2,3}'", "'{0.5,-1,1e-10}'")),
    Spec("ls", "lseg", ("'[(1,2),(3,4)]'",)),
    Spec("bx", "box", ("'(1,2),(3,4)'", "'(1e15,1e16),(123456789012345,0.0001)'")),
    Spec("pa", "path", ("'[(1,2),(3,4)]'", "'((0,0),(1,1),(2,0))'")),
    Spec("pg", "polygon", ("'((0,0),(1,1),(2,0))'",)),
    Spec("cr", "circle", ("'<(1,2),3>'",)),
    Spec(
        "tsv",
        "tsvector",
        (
            "to_tsvector('english', 'The quick brown foxes jumped over the lazy dog')",
            "$$'a':1A,2B 'it''s' 'back\\\\slash':3C 'ünï':4$$::tsvector",
            "''::tsvector",
        ),
    ),
    Spec("tsq", "tsquery", ("'fat & (rat | !cat)'",)),
    Spec("i4r", "int4range", ("'[1,5)'", "'empty'", "'(,)'", "'[3,)'")),
    Spec("i8r", "int8range", ("'[1,9223372036854775806]'",)),
    Spec("nr", "numrange", ("'(1.5,2.50]'", "'(,0)'")),
    Spec("tsr", "tsrange", ("'[2020-01-01 10:00,2021-01-01)'", "'[-infinity,infinity]'")),
    Spec("tstzr", "tstzrange", ("'[2020-01-01 00:00+00,infinity)'",)),
    Spec("dr", "daterange", ("'[2020-01-01,2021-01-01]'", "'[0044-03-15 BC,)'")),
    Spec("i4mr", "int4multirange", ("'{[1,3), [5,7)}'", "'{}'")),
    Spec(
        "comp",
        "comp",
        (
            "ROW(1, 'a b', 1.5, '2020-01-01 00:00+00', ARRAY[1,NULL], 'happy', '\\x00ff')",
            "ROW(NULL, '', NULL, NULL, '{}', NULL, NULL)",
            "ROW(2, 'x\"y\\z(,)', 'NaN', 'infinity', ARRAY[3], 'sad face', '\\x')",
        ),
    ),
    Spec("lsn", "pg_lsn", ("'16/B374D848'", "'0/0'")),
    Spec("jp", "jsonpath", ("'$.a[*] ? (@ > 1)'", "'strict $.\"ü\"'")),
    Spec("x8", "xid8", ("'18446744073709551615'", "'3'")),
    Spec("xi", "xid", ("'4294967295'",)),
    Spec("ti", "tid", ("'(4294967295,65535)'", "'(0,1)'")),
    Spec("snap", "pg_snapshot", ("'10:20:10,14,15'", "'10:10:'")),
    Spec("i2v", "int2vector", ("'1 -2 3'", "''"), array=False),
    Spec("oidv", "oidvector", ("'1 4294967295'",), array=False),
    Spec("rc", "refcursor", ("'cursor name'",)),
    Spec("fr", "floatrange", ("'[1.5,2.5)'",)),
    Spec("rcl", "regclass", ("'pg_class'",)),
)

#: 2-D columns (declared ``type[][]``): only 2-D, empty and NULL values.
SPECS_2D: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("i4_2d", "int4", ("ARRAY[[1,2],[3,NULL]]", "ARRAY[[5]]", "'{}'"), "int"),
    ("txt_2d", "text", ("ARRAY[['a','b c'],['{\"}', NULL]]", "ARRAY[['NULL']]"), "text"),
    ("dec_2d", "numeric(12,2)", ("ARRAY[[1.5],[NULL]]",), "decimal"),
    (
        "tstz_2d",
        "timestamptz",
        ("ARRAY[['2020-01-01 00:00+00'::timestamptz, 'infinity']]",),
        "timestamptz",
    ),
    ("bx_2d", "box", ("ARRAY[['(1,2),(3,4)'::box, NULL]]",), "text"),
)

SETUP = """
CREATE EXTENSION citext;
CREATE TYPE mood AS ENUM ('happy', 'sad face');
CREATE DOMAIN d_text AS text;
CREATE DOMAIN d_amount AS numeric(10,2);
CREATE DOMAIN d_posint AS int4 CHECK (VALUE > 0);
CREATE TYPE floatrange AS RANGE (subtype = float8);
CREATE TYPE comp AS (a int, b text, c numeric, d timestamptz, e int[], f mood, g bytea);
"""


@dataclass(frozen=True)
class Column:
    name: str
    sql_type: str
    expect: str
    array: bool


def _columns() -> list[Column]:
    columns: list[Column] = []
    for spec in SPECS:
        columns.append(Column(spec.name, spec.sql_type, spec.expect, False))
        if spec.array:
            columns.append(Column(f"{spec.name}_arr", spec.sql_type, spec.expect, True))
    for name, sql_type, _values, expect in SPECS_2D:
        columns.append(Column(name, sql_type, expect, True))
    return columns


def _row_values(row: int) -> list[str]:
    """SQL expressions of every column for row number ``row``."""
    out: list[str] = []
    for spec in SPECS:
        values = spec.values
        out.append(f"({values[row]})::{spec.sql_type}" if row < len(values) else "NULL")
        if spec.array:
            typed = [f"({v})::{spec.sql_type}" for v in values]
            arrays = (
                f"ARRAY[{', '.join(typed)}, NULL]::{spec.sql_type}[]",
                f"'{{}}'::{spec.sql_type}[]",
                "NULL",
                f"ARRAY[{typed[-1]}]::{spec.sql_type}[]",
            )
            out.append(arrays[row] if row < len(arrays) else "NULL")
    for _name, sql_type, values, _expect in SPECS_2D:
        out.append(f"({values[row]})::{sql_type}[]" if row < len(values) else "NULL")
    return out


ROWS = max(max(len(s.values) for s in SPECS), 4)


def _create_table(db: PgDatabase) -> None:
    db.execute(SETUP)
    defs = []
    for column in _columns():
        dims = "[][]" if column.name.endswith("_2d") else "[]" if column.array else ""
        defs.append(f'"{column.name}" {column.sql_type}{dims}')
    db.execute(f"CREATE TABLE t (id int PRIMARY KEY, {', '.join(defs)})")
    db.execute("ALTER TABLE t REPLICA IDENTITY FULL")
    db.capture(["t"])
    for row in range(ROWS):
        db.execute(f"INSERT INTO t VALUES ({row}, {', '.join(_row_values(row))})")
    # Lower-bound decorations and literal element text that needs escaping.
    db.execute(
        "INSERT INTO t (id, i4_arr, txt_arr, i4_2d) VALUES "
        '(1000, \'[0:2]={7,8,9}\', \'{"a\\\\b","", " x ","{",NULL}\', \'[0:1][-1:0]={{1,2},{3,4}}\')'
    )


def _expected(db: PgDatabase, timezone: str) -> dict[int, dict[str, Any]]:
    """Every column's expected Python value per row id, computed by PostgreSQL."""
    columns = _columns()
    selects = []
    for column in columns:
        expr = _EXPECT[column.expect][0]
        if column.array:
            # unnest() in the select list yields each element (a composite too) as one
            # value, in array order; in FROM it would expand a composite into columns.
            selects.append(
                f"ARRAY(SELECT {expr.format('e')} FROM "
                f'(SELECT unnest("{column.name}") AS e) AS elements)'
            )
            selects.append(f'array_dims("{column.name}")')
            selects.append(f'"{column.name}" IS NULL')
        else:
            selects.append(expr.format(f'"{column.name}"'))
    conn = psycopg2.connect(db.dsn_with(options=f"{SESSION} -c timezone={timezone}"))
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT id, {', '.join(selects)} FROM t ORDER BY id")
            rows = cur.fetchall()
    finally:
        conn.close()
    expected: dict[int, dict[str, Any]] = {}
    for row in rows:
        values = iter(row[1:])
        by_name: dict[str, Any] = {}
        for column in columns:
            convert = _EXPECT[column.expect][1]
            raw = next(values)
            if column.array:
                dims_text = next(values)
                is_null = next(values)
                by_name[column.name] = None if is_null else _reshape(raw, dims_text, convert)
            else:
                by_name[column.name] = None if raw is None else convert(raw)
        expected[row[0]] = by_name
    return expected


def _reshape(flat: list[Any], dims_text: str | None, convert: Callable[[str], Any]) -> Any:
    items = [None if item is None else convert(item) for item in flat]
    if dims_text is None:  # empty array
        return []
    lengths = []
    for part in dims_text.split("=")[0].strip("[]").split("]["):
        low, high = (int(x) for x in part.split(":"))
        lengths.append(high - low + 1)
    for length in reversed(lengths[1:]):
        items = [items[i : i + length] for i in range(0, len(items), length)]
    return items


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."


def _decode(codec: ColumnCodec, data: bytes) -> Any:
    schema = (
        fastavro.parse_schema(codec.avro_type)
        if isinstance(codec.avro_type, dict)
        else codec.avro_type
    )
    return fastavro.schemaless_reader(io.BytesIO(data), schema, None)


def _read_inserts(db: PgDatabase, timezone: str) -> tuple[Relation, list[Insert]]:
    dsn = db.dsn_with(options=f"{SESSION} -c timezone={timezone}")
    payloads = read_pgoutput(dsn, "slot", "pub")
    decoder = PgOutputDecoder(1)
    relation: Relation | None = None
    inserts: list[Insert] = []
    for _lsn, payload in payloads:
        message = decoder.decode(payload)
        if isinstance(message, Relation):
            relation = message
        elif isinstance(message, Insert):
            inserts.append(message)
    assert relation is not None
    return relation, inserts


def _check(db: PgDatabase, timezone: str) -> None:
    relation, inserts = _read_inserts(db, timezone)
    expected = _expected(db, timezone)
    conn = db.connect()
    catalog = PgCatalog(conn)
    dims = column_dimensions(conn, relation.relation_id)
    codecs = [
        column_codec(c.type_oid, c.type_modifier, catalog, dims.get(c.name, 0))
        for c in relation.columns
    ]
    assert len(inserts) == len(expected)
    failures: list[str] = []
    for insert in inserts:
        assert insert.new.values[0] is not None
        row_id = _decode(codecs[0], codecs[0].from_text(insert.new.values[0]))
        want_row = expected[row_id]
        for index, column in enumerate(relation.columns[1:], start=1):
            kind = insert.new.kinds[index]
            raw = insert.new.values[index]
            want = want_row[column.name]
            codec = codecs[index]
            if kind == KIND_NULL:
                if want is not None:
                    failures.append(f"row {row_id} {column.name}: NULL sent, expected {want!r}")
                continue
            assert raw is not None
            assert kind == KIND_TEXT
            try:
                got = _decode(codec, codec.from_text(raw))
            except ValueError as exc:
                failures.append(f"row {row_id} {column.name}: {raw[:80]!r} raised {exc}")
                continue
            if not same(got, want):
                failures.append(
                    f"row {row_id} {column.name}: {raw[:80]!r} -> {_short(got)}, "
                    f"expected {_short(want)}"
                )
            python = codec.to_python(raw)
            if not same(python, want):
                failures.append(
                    f"row {row_id} {column.name}: to_python {_short(python)} != {_short(want)}"
                )
    assert not failures, "\n".join(failures)


@pytest.fixture
def typed_table(pg: PgDatabase) -> PgDatabase:
    _create_table(pg)
    return pg


@pytest.mark.parametrize(
    "timezone", ["UTC", "Asia/Kolkata", "Europe/Amsterdam", "America/St_Johns"]
)
def test_text_mode(typed_table: PgDatabase, timezone: str) -> None:
    _check(typed_table, timezone=timezone)


def test_unrepresentable_values_raise(pg: PgDatabase) -> None:
    """NaN in numeric(p,s) (PostgreSQL refuses infinities there) and 2-D values in a 1-D column."""
    pg.execute(
        "CREATE TABLE bad (id int PRIMARY KEY, n numeric(5,2), a int4[]);"
        "ALTER TABLE bad REPLICA IDENTITY FULL"
    )
    pg.capture(["bad"])
    pg.execute("INSERT INTO bad VALUES (1, 'NaN', '{{1,2},{3,4}}'), (2, NULL, '[0:0][1:1]={{5}}')")
    conn = pg.connect()
    catalog = PgCatalog(conn)
    relation, inserts = _read_inserts(pg, "UTC")
    dims = column_dimensions(conn, relation.relation_id)
    codecs = [
        column_codec(c.type_oid, c.type_modifier, catalog, dims[c.name]) for c in relation.columns
    ]
    assert len(inserts) == 2
    for insert in inserts:
        for index in (1, 2):
            raw = insert.new.values[index]
            if raw is None:
                continue
            with pytest.raises(ValueError):
                codecs[index].from_text(raw)


def test_catalog_types(pg: PgDatabase) -> None:
    """PgCatalog reads non-builtin types; built-ins need no query; unknown OIDs are KeyError."""
    pg.execute(SETUP)
    conn = pg.connect()
    catalog = PgCatalog(conn)
    oids = dict(
        pg.execute(
            "SELECT typname, oid::int FROM pg_type WHERE typname IN "
            "('mood', 'd_amount', 'comp', 'citext', '_mood')"
        )
    )
    mood = catalog.lookup(oids["mood"])
    assert (mood.kind, mood.namespace, mood.name) == ("e", "public", "mood")
    domain = catalog.lookup(oids["d_amount"])
    assert (domain.kind, domain.base_oid, domain.base_modifier) == ("d", 1700, (10 << 16 | 2) + 4)
    assert catalog.lookup(oids["_mood"]).is_array
    assert catalog.lookup(oids["comp"]).kind == "c"
    assert catalog.lookup(oids["citext"]).name == "citext"
    conn.close()  # built-ins must not touch the (now closed) connection
    assert catalog.lookup(1184).name == "timestamptz"
    assert catalog.lookup(oids["mood"]).name == "mood"  # cached
    with pytest.raises(KeyError):
        PgCatalog(pg.connect()).lookup(4_000_000_000)
    codec = column_codec(oids["d_amount"], -1, PgCatalog(pg.connect()))
    assert codec.avro_type == {
        "type": "bytes",
        "logicalType": "decimal",
        "precision": 10,
        "scale": 2,
    }


def test_column_dimensions(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE dims (a int, b int[], c text[][], d int[][][], e int)")
    pg.execute("ALTER TABLE dims DROP COLUMN e")
    pg.execute("CREATE TABLE copied AS SELECT * FROM dims")
    conn = pg.connect()
    relid = {
        name: oid
        for name, oid in pg.execute(
            "SELECT relname, oid::int FROM pg_class WHERE relname IN ('dims', 'copied')"
        )
    }
    assert column_dimensions(conn, relid["dims"]) == {"a": 0, "b": 1, "c": 2, "d": 3}
    # CREATE TABLE AS loses the declared dimensions: 0 means "one" to column_codec.
    assert column_dimensions(conn, relid["copied"]) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert column_dimensions(conn, 0) == {}
