"""Tables with every SPEC §5 type, a seeded random workload over them, and the oracle.

Tables:

* ``kitchen(id int PK, ...)`` -- one column per scalar type of SPEC §5 (and a
  column whose name needs sanitizing), plus ``doc text`` with
  ``STORAGE EXTERNAL`` holding 6 400 characters, so updates that leave it
  alone send it as unchanged TOAST; primary key changes too.
* ``arrays(k text, n int, PK(k, n), ...)`` -- arrays of most element types,
  a two-dimensional one, empty arrays and NULL elements.
* ``events(id bigserial PK, ...)`` -- the table that gets truncated.
* ``logbook(who, n, on_day)`` -- no key at all, ``REPLICA IDENTITY FULL``.

The oracle reads the tables back with psycopg2 and normalizes both sides to
comparable Python values, applying SPEC §5 independently of cdcd's code:
dates and timestamps clamp to 0001-01-01 .. 9999-12-31 23:59:59.999999
(``infinity``, BC and years past 9999), ``time`` becomes microseconds since
midnight (24:00:00 clamps), types mapped to strings compare with
PostgreSQL's text form (the type's output function, under ``TimeZone=UTC``,
``DateStyle=ISO``, ``IntervalStyle=postgres``), ``float4`` compares as
float32.
"""

from __future__ import annotations

import random
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2.extensions
from psycopg2 import sql

DATE_MIN, DATE_MAX = date(1, 1, 1), date(9999, 12, 31)
TS_MIN, TS_MAX = datetime(1, 1, 1), datetime(9999, 12, 31, 23, 59, 59, 999999)


# ----------------------------------------------------------------------------- value generators


def _maybe(rng: random.Random, value: Any, null_rate: float = 0.1) -> Any:
    return None if rng.random() < null_rate else value


def _text(rng: random.Random, n: int = 12) -> str:
    alphabet = "abcXYZ019 ,;'\"\\{}()[]éß漢🙂\t\n"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(n)))


def _decimal(rng: random.Random, digits: int, scale: int) -> str:
    unscaled = rng.randrange(-(10**digits) + 1, 10**digits)
    return str(Decimal(unscaled).scaleb(-scale))


def _date(rng: random.Random) -> str:
    special = ["infinity", "-infinity", "0044-03-15 BC", "0001-01-01", "9999-12-31", "10000-01-01"]
    if rng.random() < 0.3:
        return rng.choice(special)
    return date.fromordinal(
        rng.randrange(date(1900, 1, 1).toordinal(), date(2100, 1, 1).toordinal())
    ).isoformat()


def _clock(rng: random.Random) -> str:
    return f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}.{rng.randrange(10**6):06d}"


def _timestamp(rng: random.Random) -> str:
    special = ["infinity", "-infinity", "0001-01-01 00:00:00", "9999-12-31 23:59:59.999999",
               "10000-01-01 00:00:00", "0100-01-01 00:00:00 BC"]  # fmt: skip
    if rng.random() < 0.3:
        return rng.choice(special)
    return f"{_date_plain(rng)} {_clock(rng)}"


def _date_plain(rng: random.Random) -> str:
    return date.fromordinal(
        rng.randrange(date(1950, 1, 1).toordinal(), date(2080, 1, 1).toordinal())
    ).isoformat()


def _timestamptz(rng: random.Random) -> str:
    special = ["infinity", "-infinity", "10000-01-01 00:00:00+05", "0001-01-01 00:00:00+05",
               "0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999-01", "2024-03-10 02:30:00-08"]  # fmt: skip
    if rng.random() < 0.3:
        return rng.choice(special)
    offset = rng.choice(["+00", "+05:30", "-03", "+14", "-12:45"])
    return f"{_date_plain(rng)} {_clock(rng)}{offset}"


def _array(
    rng: random.Random, make: Callable[[random.Random], Any], null_rate: float = 0.15
) -> list[Any] | None:
    if rng.random() < 0.1:
        return None
    if rng.random() < 0.1:
        return []
    return [None if rng.random() < null_rate else make(rng) for _ in range(rng.randrange(1, 5))]


def _grid(rng: random.Random) -> list[list[int | None]] | None:
    if rng.random() < 0.1:
        return None
    if rng.random() < 0.1:
        return []
    rows, cols = rng.randrange(1, 4), rng.randrange(1, 4)
    return [
        [None if rng.random() < 0.1 else rng.randrange(-99, 99) for _ in range(cols)]
        for _ in range(rows)
    ]


def _aware(rng: random.Random) -> datetime:
    seconds = rng.randrange(-2_000_000_000, 4_000_000_000)
    return datetime.fromtimestamp(seconds, UTC).replace(microsecond=rng.randrange(10**6))


@dataclass(frozen=True)
class Spec:
    """One column: its SQL type, a generator of values, and how the oracle compares it."""

    name: str
    sql_type: str
    gen: Callable[[random.Random], Any]
    expect: str = "py"  # py float4 float8 bytes text date ts tstz time textarr bytesarr


KITCHEN: list[Spec] = [
    Spec("c_bool", "bool", lambda r: r.choice(["t", "f"])),
    Spec("c_int2", "int2", lambda r: str(r.choice([-32768, 32767, 0, r.randrange(-999, 999)]))),
    Spec(
        "c_int4",
        "int4",
        lambda r: str(r.choice([-(2**31), 2**31 - 1, r.randrange(-(10**6), 10**6)])),
    ),
    Spec(
        "c_int8",
        "int8",
        lambda r: str(r.choice([-(2**63), 2**63 - 1, r.randrange(-(10**12), 10**12)])),
    ),
    Spec("c_oid", "oid", lambda r: str(r.choice([0, 2**32 - 1, r.randrange(10**6)]))),
    Spec(
        "c_float4",
        "float4",
        lambda r: r.choice(
            [
                "1.5",
                "-0",
                "3.4028235e38",
                "1e-45",
                "NaN",
                "Infinity",
                "-Infinity",
                repr(r.uniform(-1e6, 1e6)),
            ]
        ),
        "float4",
    ),  # fmt: skip
    Spec(
        "c_float8",
        "float8",
        lambda r: r.choice(
            [
                "1.7976931348623157e308",
                "5e-324",
                "NaN",
                "-Infinity",
                "0.1",
                repr(r.uniform(-1e9, 1e9)),
            ]
        ),
        "float8",
    ),  # fmt: skip
    Spec("c_numeric", "numeric(12,2)", lambda r: _decimal(r, 12, 2)),
    Spec(
        "c_numeric_free",
        "numeric",
        lambda r: r.choice(
            [
                "NaN",
                "Infinity",
                "-Infinity",
                "0.000000000001",
                "-0.5",
                "123456789012345678901234567890.123456789",
                _decimal(r, 20, 7),
            ]
        ),
        "text",
    ),  # fmt: skip
    Spec("c_numeric_wide", "numeric(45,5)", lambda r: _decimal(r, 45, 5), "text"),
    Spec("c_text", "text", _text),
    Spec("c_varchar", "varchar(20)", lambda r: _text(r, 20)),
    Spec("c_bpchar", "char(6)", lambda r: "".join(r.choice("abc ") for _ in range(r.randrange(7)))),
    Spec("c_name", "name", lambda r: f"n{r.randrange(10**6)}"),
    Spec("c_citext", "citext", lambda r: r.choice(["Hello", "WORLD", "MiXeD"])),
    Spec("c_enum", "mood", lambda r: r.choice(["sad", "ok", "happy"])),
    Spec("c_domain", "short_text", lambda r: _text(r, 30)),
    Spec("c_bytea", "bytea", lambda r: "\\x" + r.randbytes(r.randrange(20)).hex(), "bytes"),
    Spec("c_uuid", "uuid", lambda r: str(uuid.UUID(int=r.getrandbits(128))), "text"),
    Spec(
        "c_json",
        "json",
        lambda r: r.choice(['{"a": [1, 2.5, "x"],   "b": null}', "[ ]", '"s\\u00e9"', "12"]),
        "text",
    ),
    Spec(
        "c_jsonb",
        "jsonb",
        lambda r: r.choice(['{"b": {"c": [true, false]}, "a": 1}', '[1, "two"]', "null"]),
        "text",
    ),
    Spec("c_date", "date", _date, "date"),
    Spec(
        "c_time",
        "time",
        lambda r: r.choice(["24:00:00", "00:00:00", "23:59:59.999999", _clock(r)]),
        "time",
    ),
    Spec("c_timestamp", "timestamp", _timestamp, "ts"),
    Spec("c_timestamptz", "timestamptz", _timestamptz, "tstz"),
    Spec(
        "c_interval",
        "interval",
        lambda r: r.choice(
            [
                "1 year 2 mons 3 days 04:05:06.789",
                "-1 day",
                "00:00:00.000001",
                f"{r.randrange(1000)} days",
            ]
        ),
        "text",
    ),  # fmt: skip
    Spec(
        "c_timetz",
        "timetz",
        lambda r: r.choice(["12:34:56+05:30", "00:00:00-12", "23:59:59.5+00"]),
        "text",
    ),
    Spec("c_money", "money", lambda r: r.choice(["12.34", "-1000000.50", "0"]), "text"),
    Spec("c_inet", "inet", lambda r: r.choice(["192.168.0.1/24", "::1", "10.1.2.3"]), "text"),
    Spec("c_cidr", "cidr", lambda r: r.choice(["10.0.0.0/8", "2001:db8::/32"]), "text"),
    Spec(
        "c_macaddr",
        "macaddr",
        lambda r: r.choice(["08:00:2b:01:02:03", "ff:ff:ff:ff:ff:ff"]),
        "text",
    ),
    Spec("c_xml", "xml", lambda r: r.choice(['<a b="1">x &amp; y</a>', "<r/>"]), "text"),
    Spec("c_range", "int4range", lambda r: r.choice(["[1,10)", "empty", "(,5]", "[3,)"]), "text"),
    Spec("odd name-Ü", "int4", lambda r: str(r.randrange(100))),
]

ARRAYS: list[Spec] = [
    Spec("a_int4", "int4[]", lambda r: _array(r, lambda r: r.randrange(-(2**31), 2**31))),
    Spec(
        "a_text",
        "text[]",
        lambda r: _array(
            r, lambda r: r.choice(["a,b", "NULL", 'q"uote', "back\\slash", "", "{}", _text(r)])
        ),
    ),
    Spec(
        "a_numeric", "numeric(10,3)[]", lambda r: _array(r, lambda r: Decimal(_decimal(r, 10, 3)))
    ),
    Spec("a_tstz", "timestamptz[]", lambda r: _array(r, _aware)),
    Spec("a_ts", "timestamp[]", lambda r: _array(r, lambda r: _aware(r).replace(tzinfo=None))),
    Spec("a_date", "date[]", lambda r: _array(r, lambda r: _aware(r).date())),
    Spec("a_bool", "bool[]", lambda r: _array(r, lambda r: r.random() < 0.5)),
    Spec(
        "a_uuid",
        "uuid[]",
        lambda r: _array(r, lambda r: str(uuid.UUID(int=r.getrandbits(128)))),
        "textarr",
    ),
    Spec("a_float8", "float8[]", lambda r: _array(r, lambda r: r.uniform(-1e6, 1e6))),
    Spec("a_grid", "int4[][]", _grid),
    Spec(
        "a_bytea",
        "bytea[]",
        lambda r: _array(r, lambda r: psycopg2.Binary(r.randbytes(r.randrange(6)))),
        "bytesarr",
    ),
    Spec(
        "a_jsonb",
        "jsonb[]",
        lambda r: _array(r, lambda r: r.choice(['{"x": 1}', "[]", '"s"'])),
        "textarr",
    ),
    Spec(
        "a_interval",
        "interval[]",
        lambda r: _array(r, lambda r: f"{r.randrange(100)} days 01:02:03"),
        "textarr",
    ),
]

EXTRA_KITCHEN = [
    Spec("extra_note", "text", _text),
    Spec("extra_n", "int8", lambda r: str(r.randrange(10**9))),
]
EXTRA_ARRAYS = [Spec("a_extra", "int4[]", lambda r: _array(r, lambda r: r.randrange(10)))]
DROPPED_KITCHEN = ("c_money", "c_xml")
DROPPED_ARRAYS = ("a_bool",)

EVENTS = [Spec("kind", "text", lambda r: r.choice(["open", "close", "ping"])), Spec("at", "timestamptz", _timestamptz, "tstz"),
          Spec("note", "text", _text)]  # fmt: skip
LOGBOOK = [Spec("who", "text", lambda r: r.choice(["ann", "bob", "cy"])), Spec("n", "int4", lambda r: str(r.randrange(5))),
           Spec("on_day", "date", _date, "date")]  # fmt: skip

SETUP = """
CREATE EXTENSION IF NOT EXISTS citext;
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN short_text AS text CHECK (length(VALUE) < 100);
"""

KEYS = {"kitchen": ("id",), "arrays": ("k", "n"), "events": ("id",), "logbook": ()}


def _ident(name: str) -> sql.Composable:
    return sql.Identifier(name)


def _create_table(cur: Any, table: str, key_sql: str, specs: list[Spec], tail: str = "") -> None:
    columns = sql.SQL(", ").join(
        sql.SQL("{} {}").format(_ident(s.name), sql.SQL(s.sql_type)) for s in specs
    )
    cur.execute(sql.SQL("CREATE TABLE {} ({}{}{})").format(
        _ident(table), sql.SQL(key_sql), sql.SQL(", ") if key_sql else sql.SQL(""), columns
    ) + sql.SQL(tail))  # fmt: skip


# ----------------------------------------------------------------------------- workload


@dataclass
class TypesWorkload:
    """Seeded random transactions over the four tables; ``statements`` counts what ran."""

    seed: int
    rng: random.Random = field(init=False)
    kitchen: list[Spec] = field(default_factory=lambda: list(KITCHEN))
    arrays: list[Spec] = field(default_factory=lambda: list(ARRAYS))
    kitchen_ids: list[int] = field(default_factory=list)
    array_keys: list[tuple[str, int]] = field(default_factory=list)
    event_ids: list[int] = field(default_factory=list)
    logbook_rows: list[tuple[str, str, str]] = field(default_factory=list)
    next_id: int = 1
    statements: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def create(self, conn: psycopg2.extensions.connection) -> None:
        with conn.cursor() as cur:
            cur.execute(SETUP)
            _create_table(
                cur, "kitchen", "id int PRIMARY KEY", [*KITCHEN, Spec("doc", "text", _text)]
            )
            cur.execute("ALTER TABLE kitchen ALTER COLUMN doc SET STORAGE EXTERNAL")
            _create_table(cur, "arrays", "k text, n int, PRIMARY KEY (k, n)", ARRAYS)
            _create_table(cur, "events", "id bigserial PRIMARY KEY", EVENTS)
            _create_table(cur, "logbook", "", LOGBOOK)
            cur.execute("ALTER TABLE logbook REPLICA IDENTITY FULL")
        conn.commit()

    def _count(self, what: str) -> None:
        self.statements[what] = self.statements.get(what, 0) + 1

    def _values(self, specs: list[Spec]) -> tuple[sql.Composable, list[Any]]:
        rng = self.rng
        values = [_maybe(rng, s.gen(rng)) for s in specs]
        placeholders = sql.SQL(", ").join(sql.SQL("%s::" + s.sql_type) for s in specs)
        return placeholders, values

    def _insert(
        self,
        cur: Any,
        table: str,
        specs: list[Spec],
        fixed: dict[str, Any],
        fixed_sql: dict[str, str] | None = None,
    ) -> None:
        names = [*fixed, *(fixed_sql or {}), *(s.name for s in specs)]
        placeholders, values = self._values(specs)
        parts = [sql.SQL("%s")] * len(fixed) + [sql.SQL(v) for v in (fixed_sql or {}).values()]
        cur.execute(
            sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                _ident(table),
                sql.SQL(", ").join(map(_ident, names)),
                sql.SQL(", ").join([*parts, placeholders]),
            ),
            [*fixed.values(), *values],
        )

    def _update(
        self, cur: Any, table: str, specs: list[Spec], where: sql.Composable, params: list[Any]
    ) -> None:
        rng = self.rng
        chosen = rng.sample(specs, rng.randrange(1, min(5, len(specs)) + 1))
        sets = sql.SQL(", ").join(
            sql.SQL("{} = %s::" + s.sql_type).format(_ident(s.name)) for s in chosen
        )
        values = [_maybe(rng, s.gen(rng)) for s in chosen]
        cur.execute(
            sql.SQL("UPDATE {} SET {} WHERE ").format(_ident(table), sets) + where,
            [*values, *params],
        )

    def statement(self, cur: Any) -> None:
        rng = self.rng
        choice = rng.random()
        if choice < 0.14 or not self.kitchen_ids:
            key = self.next_id
            self.next_id += 1
            doc = f"doc-{self.seed}-{key}"
            self._insert(
                cur, "kitchen", self.kitchen, {"id": key}, {"doc": f"repeat(md5('{doc}'), 200)"}
            )
            self.kitchen_ids.append(key)
            self._count("kitchen insert")
        elif choice < 0.34:
            # Leaves doc alone: it is sent as unchanged TOAST.
            key = rng.choice(self.kitchen_ids)
            self._update(cur, "kitchen", self.kitchen, sql.SQL("id = %s"), [key])
            self._count("kitchen update, doc unchanged")
        elif choice < 0.38:
            key = rng.choice(self.kitchen_ids)
            cur.execute(
                "UPDATE kitchen SET doc = repeat(md5(%s), 150) WHERE id = %s",
                (f"{key}-{rng.random()}", key),
            )
            self._count("kitchen update of doc")
        elif choice < 0.41:
            key = rng.choice(self.kitchen_ids)
            new = self.next_id + 100_000
            self.next_id += 1
            cur.execute("UPDATE kitchen SET id = %s WHERE id = %s", (new, key))
            self.kitchen_ids.remove(key)
            self.kitchen_ids.append(new)
            self._count("kitchen primary key change")
        elif choice < 0.45:
            key = self.kitchen_ids.pop(rng.randrange(len(self.kitchen_ids)))
            cur.execute("DELETE FROM kitchen WHERE id = %s", (key,))
            self._count("kitchen delete")
        elif choice < 0.60 or not self.array_keys:
            key2 = (f"k{rng.randrange(50)}", rng.randrange(5))
            if key2 in self.array_keys:
                self._update(cur, "arrays", self.arrays, sql.SQL("k = %s AND n = %s"), list(key2))
                self._count("arrays update")
            else:
                self._insert(cur, "arrays", self.arrays, {"k": key2[0], "n": key2[1]})
                self.array_keys.append(key2)
                self._count("arrays insert")
        elif choice < 0.66:
            key2 = self.array_keys.pop(rng.randrange(len(self.array_keys)))
            cur.execute("DELETE FROM arrays WHERE k = %s AND n = %s", key2)
            self._count("arrays delete")
        elif choice < 0.80:
            placeholders, values = self._values(EVENTS)
            cur.execute(
                sql.SQL("INSERT INTO events (kind, at, note) VALUES ({}) RETURNING id").format(
                    placeholders
                ),
                values,
            )
            self.event_ids.append(cur.fetchone()[0])
            self._count("events insert")
        elif choice < 0.84 and self.event_ids:
            event = self.event_ids.pop(rng.randrange(len(self.event_ids)))
            cur.execute("DELETE FROM events WHERE id = %s", (event,))
            self._count("events delete")
        elif choice < 0.93 or not self.logbook_rows:
            entry = (rng.choice(["ann", "bob", "cy"]), str(rng.randrange(5)), _date(rng))
            cur.execute("INSERT INTO logbook VALUES (%s, %s::int4, %s::date)", entry)
            self.logbook_rows.append(entry)
            self._count("logbook insert")
        elif choice < 0.97:
            index = rng.randrange(len(self.logbook_rows))
            old = self.logbook_rows[index]
            new = (old[0], str(rng.randrange(5, 9)), old[2])
            cur.execute(
                "UPDATE logbook SET n = %s::int4 WHERE ctid = (SELECT ctid FROM logbook WHERE who = %s "
                "AND n = %s::int4 AND on_day = %s::date LIMIT 1)", (new[1], *old),
            )  # fmt: skip
            self.logbook_rows[index] = new
            self._count("logbook update")
        else:
            old = self.logbook_rows.pop(rng.randrange(len(self.logbook_rows)))
            cur.execute(
                "DELETE FROM logbook WHERE ctid = (SELECT ctid FROM logbook WHERE who = %s "
                "AND n = %s::int4 AND on_day = %s::date LIMIT 1)", old,
            )  # fmt: skip
            self._count("logbook delete")

    def transaction(self, conn: psycopg2.extensions.connection) -> None:
        with conn.cursor() as cur:
            for _ in range(self.rng.randrange(1, 5)):
                self.statement(cur)
        conn.commit()

    def run(self, conn: psycopg2.extensions.connection, transactions: int) -> None:
        for _ in range(transactions):
            self.transaction(conn)

    def add_columns(self, conn: psycopg2.extensions.connection) -> None:
        with conn.cursor() as cur:
            for table, specs in (("kitchen", EXTRA_KITCHEN), ("arrays", EXTRA_ARRAYS)):
                for spec in specs:
                    cur.execute(
                        sql.SQL("ALTER TABLE {} ADD COLUMN {} " + spec.sql_type).format(
                            _ident(table), _ident(spec.name)
                        )
                    )
        conn.commit()
        self.kitchen.extend(EXTRA_KITCHEN)
        self.arrays.extend(EXTRA_ARRAYS)
        self._count("add columns")

    def drop_columns(self, conn: psycopg2.extensions.connection) -> None:
        with conn.cursor() as cur:
            for table, names in (("kitchen", DROPPED_KITCHEN), ("arrays", DROPPED_ARRAYS)):
                for name in names:
                    cur.execute(
                        sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(_ident(table), _ident(name))
                    )
        conn.commit()
        self.kitchen = [s for s in self.kitchen if s.name not in DROPPED_KITCHEN]
        self.arrays = [s for s in self.arrays if s.name not in DROPPED_ARRAYS]
        self._count("drop columns")

    def truncate_events(self, conn: psycopg2.extensions.connection) -> None:
        with conn.cursor() as cur:
            cur.execute("TRUNCATE events")
        conn.commit()
        self.event_ids.clear()
        self._count("truncate")

    def touch_all_tables(self, conn: psycopg2.extensions.connection) -> None:
        """One change per table, so each publishes its current shape."""
        with conn.cursor() as cur:
            self._insert(cur, "kitchen", self.kitchen, {"id": self.next_id}, {"doc": "'short'"})
            self.kitchen_ids.append(self.next_id)
            self.next_id += 1
            key2 = (f"touch{self.next_id}", 0)
            self._insert(cur, "arrays", self.arrays, {"k": key2[0], "n": key2[1]})
            self.array_keys.append(key2)
        conn.commit()


# ----------------------------------------------------------------------------- oracle

SPECS = {
    "kitchen": {s.name: s for s in [*KITCHEN, *EXTRA_KITCHEN, Spec("doc", "text", _text)]},
    "arrays": {s.name: s for s in [*ARRAYS, *EXTRA_ARRAYS]},
    "events": {s.name: s for s in EVENTS},
    "logbook": {s.name: s for s in LOGBOOK},
}


def pg_date(text: str | None) -> date | None:
    if text is None:
        return None
    if text == "infinity":
        return DATE_MAX
    if text == "-infinity" or text.endswith(" BC"):
        return DATE_MIN
    year, month, day = text.split("-")
    if int(year) > 9999:
        return DATE_MAX
    return date(int(year), int(month), int(day))


def pg_timestamp(text: str | None, zone: bool) -> datetime | None:
    if text is None:
        return None
    if text in ("infinity", "-infinity") or text.endswith(" BC"):
        value = TS_MAX if text == "infinity" else TS_MIN
    else:
        if zone:
            assert text.endswith("+00"), text  # the oracle's session runs in UTC
            text = text[:-3]
        day, clock = text.split(" ")
        if int(day.split("-")[0]) > 9999:
            value = TS_MAX
        else:
            value = datetime.fromisoformat(f"{day}T{clock}")
    return value.replace(tzinfo=UTC) if zone else value


def pg_time(text: str | None) -> int | None:
    if text is None:
        return None
    hours, minutes, seconds = text.split(":")
    whole, _, fraction = seconds.partition(".")
    micros = (int(hours) * 3600 + int(minutes) * 60 + int(whole)) * 1_000_000 + int(
        (fraction + "000000")[:6]
    )
    return min(micros, 86_399_999_999)


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


class _NaN:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NaN)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "NaN"


NAN = _NaN()


def _float(value: float | None, single: bool) -> Any:
    if value is None:
        return None
    if value != value:
        return NAN
    return _float32(value) if single else value


def expected_value(spec: Spec, value: Any) -> Any:
    kind = spec.expect
    if value is None:
        return None
    if kind == "float4":
        return _float(value, True)
    if kind == "float8":
        return _float(value, False)
    if kind == "bytes":
        return bytes(value)
    if kind == "date":
        return pg_date(value)
    if kind == "ts":
        return pg_timestamp(value, False)
    if kind == "tstz":
        return pg_timestamp(value, True)
    if kind == "time":
        return pg_time(value)
    if kind == "bytesarr":
        return [None if v is None else bytes(v) for v in value]
    return value


def actual_value(spec: Spec, value: Any) -> Any:
    if value is None:
        return None
    if spec.expect in ("float4", "float8"):
        return _float(value, False)
    return value


def _select_expr(spec: Spec) -> sql.Composable:
    if spec.expect in ("text", "date", "ts", "tstz", "time"):
        # The type's output function, as pgoutput sends it (inet's ::text adds a /32).
        return sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE format('%s', {0}) END").format(
            _ident(spec.name)
        )
    if spec.expect == "textarr":
        return sql.SQL("{}::text[]").format(_ident(spec.name))
    return _ident(spec.name)


def table_columns(conn: psycopg2.extensions.connection, table: str) -> list[str]:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            (f"public.{table}",),
        )
        names = [row[0] for row in cur.fetchall()]
    conn.commit()
    return names


def source_rows(conn: psycopg2.extensions.connection, table: str) -> list[dict[str, Any]]:
    """Every row of ``table``, normalized for comparison."""
    columns = table_columns(conn, table)
    specs = SPECS[table]
    with conn.cursor() as cur:
        cur.execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'")
        exprs = [_select_expr(specs[c]) if c in specs else _ident(c) for c in columns]
        cur.execute(sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(exprs), _ident(table)))
        rows = cur.fetchall()
    conn.commit()
    plain = Spec("", "", lambda r: None)
    return [
        {c: expected_value(specs.get(c, plain), v) for c, v in zip(columns, row, strict=True)}
        for row in rows
    ]


def mirror_rows(mirror: Path, table: str) -> tuple[list[str], list[dict[str, Any]], Any]:
    """(column names, normalized rows, Arrow schema) of the Delta table ``DIR/public.<table>``.

    Read by deltalake (delta-rs), not by the code that wrote it: the files
    its log lists, without the row-version columns.
    """
    from cdcd.spark.mirror import read_mirror

    data = read_mirror(str(mirror / f"public.{table}"))
    specs = SPECS[table]
    plain = Spec("", "", lambda r: None)
    rows = [
        {c: actual_value(specs.get(c, plain), v) for c, v in r.items()} for r in data.to_pylist()
    ]
    return data.column_names, rows, data.schema


def _sort_key(row: dict[str, Any], key: tuple[str, ...]) -> Any:
    if key:
        return tuple(row[k] for k in key)
    return repr(sorted(row.items()))


def differences(
    conn: psycopg2.extensions.connection, mirror: Path, table: str, limit: int = 5
) -> list[str]:
    """What differs between the source table and its mirror (empty: equal)."""
    columns = table_columns(conn, table)
    names, actual, _ = mirror_rows(mirror, table)
    if names != columns:
        return [f"{table}: columns {names} != source {columns}"]
    expected = source_rows(conn, table)
    key = KEYS[table]
    if key:
        by_key_expected = {_sort_key(r, key): r for r in expected}
        by_key_actual = {_sort_key(r, key): r for r in actual}
    else:
        by_key_expected = {}
        for r in expected:
            by_key_expected.setdefault(_sort_key(r, key), []).append(r)
        by_key_actual = {}
        for r in actual:
            by_key_actual.setdefault(_sort_key(r, key), []).append(r)
    problems = []
    missing = sorted(set(by_key_expected) - set(by_key_actual), key=repr)
    extra = sorted(set(by_key_actual) - set(by_key_expected), key=repr)
    if missing:
        problems.append(f"{table}: {len(missing)} rows missing from the mirror, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{table}: {len(extra)} rows only in the mirror, e.g. {extra[:3]}")
    for k in sorted(set(by_key_expected) & set(by_key_actual), key=repr):
        want, got = by_key_expected[k], by_key_actual[k]
        if want == got:
            continue
        if isinstance(want, list):
            problems.append(f"{table} {k}: {len(want)} source rows vs {len(got)} in the mirror")
        else:
            for column in columns:
                if want[column] != got[column]:
                    problems.append(
                        f"{table} {k} {column}: source {want[column]!r} mirror {got[column]!r}"
                    )
        if len(problems) >= limit:
            break
    return problems
