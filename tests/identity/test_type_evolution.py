"""Every older record resolves to the topic's newest schema, whatever the DDL (issue 30).

A table goes through ten randomized DDL steps -- ``ALTER COLUMN TYPE`` between
types Avro cannot promote (text to int, numeric to int, int to text, ...),
renames, drops, re-adds under dropped columns' names, a type change and a
rename in one transaction -- with rows written after each, and
``schema_changes.resnapshot: never`` (so nothing re-publishes the rows: the
old records are all a consumer has). Then every record of the topic is read
with plain fastavro twice: with its own writer schema (what it carried) and
resolved to the newest value schema. Resolution must not fail, and every
field of the newest row record that the record carried (by name or alias)
must hold exactly the carried value (or that value through one of Avro's
own promotions: int to double, string to bytes); a field it did not carry
holds the field's default -- never a silent null.

Each table has its own seed; the default suite runs two tables (one stepping
in lock-step with the daemon, so the catalog matches each version; one in a
burst, so the daemon meets versions the catalog has moved past), the slow one
twelve.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from typing import Any

import fastavro
import pytest
from schema_changes.helpers import wait_confirmed, wait_streaming
from support.cdc import SchemaBook, avro_default, read_records, row_record

pytestmark = pytest.mark.integration

#: Column types, all holding small whole numbers; any of them converts to any
#: other through ``round(c::text::numeric)``.
TYPES = ("int", "bigint", "text", "varchar(20)", "numeric(10,2)", "numeric(12,3)", "float8")
STEPS = 10


@dataclass
class Table:
    """One table's randomized migration: its columns now, and the names used so far."""

    name: str
    seed: int
    columns: dict[str, str] = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)  # names of dropped columns
    fresh: int = 0
    next_id: int = 1
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.random = random.Random(self.seed)
        self.columns = {"a": "int", "b": "text", "c": "numeric(10,2)"}

    def create(self) -> str:
        columns = ", ".join(f"{c} {t}" for c, t in self.columns.items())
        return f"CREATE TABLE {self.name}(id int PRIMARY KEY, {columns})"

    def _new_name(self, reuse: bool) -> str:
        """A fresh name, or (``reuse``) sometimes the name of a dropped column.

        A name a column was renamed away from is never reused: Avro aliases
        carry no time, so one writer name would stand for two columns
        (docs/schema-changes.md, "Known limits").
        """
        if reuse and self.retired and self.random.random() < 0.5:
            return self.retired.pop(self.random.randrange(len(self.retired)))
        self.fresh += 1
        return f"n{self.fresh}"

    def step(self) -> list[str]:
        """The statements of one DDL step (run in one transaction)."""
        r = self.random
        kinds = ["type", "type", "rename", "type_rename", "add"]
        if len(self.columns) > 1:
            kinds.append("drop")
        kind = r.choice(kinds)
        column = r.choice(sorted(self.columns))
        out: list[str] = []
        if kind in ("type", "type_rename"):
            new_type = r.choice([t for t in TYPES if t != self.columns[column]])
            out.append(f"ALTER TABLE {self.name} ALTER COLUMN {column} TYPE {new_type} "
                       f"USING round({column}::text::numeric)::{new_type}")
            self.columns[column] = new_type
        if kind in ("rename", "type_rename"):
            new_name = self._new_name(reuse=False)
            out.append(f"ALTER TABLE {self.name} RENAME COLUMN {column} TO {new_name}")
            self.columns[new_name] = self.columns.pop(column)
        if kind == "drop":
            out.append(f"ALTER TABLE {self.name} DROP COLUMN {column}")
            del self.columns[column]
            self.retired.append(column)
        if kind == "add":
            new_name, new_type = self._new_name(reuse=True), r.choice(TYPES)
            default = f" DEFAULT {r.randrange(100)}" if r.random() < 0.5 else ""
            out.append(f"ALTER TABLE {self.name} ADD COLUMN {new_name} {new_type}{default}")
            self.columns[new_name] = new_type
        self.log += out
        return out

    def writes(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Rows after a step: two inserts, an update and a delete of earlier rows."""
        r = self.random
        names = sorted(self.columns)
        out: list[tuple[str, tuple[Any, ...]]] = []
        for _ in range(2):
            values = tuple(str(r.randrange(100)) for _ in names)
            out.append((f"INSERT INTO {self.name}(id, {', '.join(names)}) "
                        f"VALUES (%s{', %s' * len(names)})", (self.next_id, *values)))
            self.next_id += 1
        sets = ", ".join(f"{n} = %s" for n in names)
        out.append((f"UPDATE {self.name} SET {sets} WHERE id = %s",
                    (*(str(r.randrange(100)) for _ in names), r.randrange(1, self.next_id))))
        out.append((f"DELETE FROM {self.name} WHERE id = %s", (r.randrange(1, self.next_id),)))
        return out


def _run(conn: Any, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        for statement, params in statements:
            cur.execute(statement, params)
        cur.execute("COMMIT")


def _candidates(writer_row: dict[str, Any], reader_field: dict[str, Any]) -> list[str]:
    """The writer fields a reader field answers to: its name and its aliases."""
    names = [f["name"] for f in writer_row["fields"]]
    wanted = {reader_field["name"], *reader_field.get("aliases", ())}
    return [n for n in names if n in wanted]


def same(want: Any, got: Any) -> bool:
    """Equal and of one type, or equal through one of Avro's promotions
    (int/long to float/double, string to bytes: see docs/schema-changes.md)."""
    if type(got) is type(want):
        return bool(got == want)
    if isinstance(want, int) and isinstance(got, float):
        return float(want) == got
    if isinstance(want, str) and isinstance(got, bytes):
        return want.encode() == got
    return False


def check_topic(bootstrap: str, prefix: str, topic: str) -> tuple[int, list[str]]:
    """(records read, problems): each record resolved to the newest schema, against what it carried."""
    records = [r for r in read_records(bootstrap, [topic]) if r.value is not None]
    book = SchemaBook()
    book.load(bootstrap, prefix)
    newest = max(records, key=lambda r: (r.lsn, r.seq)).value
    assert newest is not None
    reader_json = book.raw[newest[2:10].hex()]
    reader = fastavro.parse_schema(reader_json)
    reader_row = row_record(reader_json)
    problems: list[str] = []
    for record in records:
        data = record.value
        assert data is not None
        fingerprint = data[2:10].hex()
        writer_row = row_record(book.raw[fingerprint])
        carried = fastavro.schemaless_reader(io.BytesIO(data[10:]), book.schemas[fingerprint], None)
        where = f"{topic} lsn={record.lsn:X} seq={record.seq}"
        try:
            resolved = fastavro.schemaless_reader(
                io.BytesIO(data[10:]), book.schemas[fingerprint], reader
            )
        except Exception as exc:  # noqa: BLE001 - reported with the record
            problems.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        assert isinstance(carried, dict) and isinstance(resolved, dict)
        for image in ("before", "after"):
            if carried[image] is None:
                if resolved[image] is not None:
                    problems.append(f"{where} {image}: null carried, {resolved[image]} resolved")
                continue
            for reader_field in reader_row["fields"]:
                name = reader_field["name"]
                sources = _candidates(writer_row, reader_field)
                if sources:
                    # A name can have been several columns' over time (a
                    # rename onto an earlier name): any of them, but a value
                    # the record carried.
                    wants = [carried[image][source] for source in sources]
                got = resolved[image][name]
                if not sources:
                    # fastavro hands a default back in its JSON form (see
                    # support.cdc.avro_default): compared as the decoded value.
                    wants = [avro_default(reader_field["type"], reader_field.get("default"))]
                    got = avro_default(reader_field["type"], got)
                if not any(same(want, got) for want in wants):
                    problems.append(
                        f"{where} {image}.{name} (from {sources}): carried {wants!r}, got {got!r}"
                    )
    return len(records), problems


def _migrate(pg: Any, daemon: Any, slot: str, tables: list[Table], lockstep: list[bool]) -> None:
    conn = pg.connect()
    for table in tables:
        _run(conn, table.writes())
    for _ in range(STEPS):
        for table, wait in zip(tables, lockstep, strict=True):
            _run(conn, [(s, ()) for s in table.step()])
            _run(conn, table.writes())
            if wait:
                wait_confirmed(pg, slot, daemon)
    wait_confirmed(pg, slot, daemon)


def _evolve(pg, cdc_config, broker, daemons, seeds: list[int]) -> None:
    tables = [Table(f"e{seed}", seed) for seed in seeds]
    for table in tables:
        pg.execute(table.create())
    config = cdc_config(
        tables=[f"public.{t.name}" for t in tables],
        extra={"schema_changes": {"resnapshot": "never", "check_interval_s": 0}},
    )
    daemon = daemons(config)
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot, daemon)
    _migrate(pg, daemon, slot, tables, [i % 2 == 0 for i in range(len(tables))])
    assert daemon.terminate() == 0, daemon.log()[-3000:]
    total, problems = 0, []
    for table in tables:
        count, found = check_topic(broker.bootstrap_servers, pg.dbname,
                                   f"{pg.dbname}.public.{table.name}")
        total += count
        if found:
            problems += [f"{table.name} (seed {table.seed}): {p}" for p in found[:10]]
            problems.append(f"{table.name} DDL: " + "; ".join(table.log))
    print(f"{len(tables)} tables x {STEPS} DDL steps: {total} records resolved")
    assert not problems, "\n".join(problems)


def test_ten_random_ddl_steps_resolve_with_plain_fastavro(pg, cdc_config, broker, daemons) -> None:
    _evolve(pg, cdc_config, broker, daemons, [3001, 3002])


@pytest.mark.slow
def test_many_random_ddl_sequences_resolve_with_plain_fastavro(
    pg, cdc_config, broker, daemons
) -> None:
    _evolve(pg, cdc_config, broker, daemons, list(range(4001, 4013)))
