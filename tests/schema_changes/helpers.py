"""Shared pieces of the schema-change tests (issue 13): a table, a writer, waits, the oracle.

Every test follows one pattern: ``public.items`` is created, the daemon starts
streaming (``snapshot.mode: never``, so the rows reach Kafka as inserts made
after it streams), a few hundred rows are inserted, a writer thread runs
inserts, updates and deletes before, during and after the DDL, the writer
stops, and the test waits for two conditions, never a fixed time:

* the slot's ``confirmed_flush_lsn`` has reached the WAL position taken after
  the writer stopped, and
* no signal-table job covering the table is pending or running (for a DDL
  that rewrites rows: a ``schema-change:`` job for it exists and is done).

The daemon requests a heal before it confirms past the change that needs it
(otherwise a crash in between would lose the heal), so once the first
condition holds every heal the DDL needs is visible in the signal table.

Then the topic is read with plain fastavro, each record resolved to the
topic's newest schema (:func:`support.cdc.read_resolved_changes`), replayed in
(cdcd.lsn, cdcd.seq) order, and compared with ``SELECT *`` of PostgreSQL,
every row and every column, both sides normalized to one Python form
(:func:`normalize`). Failures name the table, the column, the key, and
PostgreSQL's value against the consumer's, with a few examples.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
from support.cdc import (
    PROJECT_ROOT,
    DaemonProcess,
    read_resolved_changes,
    replay,
    wait_for,
    wait_streaming,
    wait_wal_confirmed,
)
from support.pg import PgDatabase

TABLE = "items"
QUALIFIED = f"public.{TABLE}"
KEY = ("id",)
ROWS = 300

#: The table every test starts from. The writer touches only id, name, qty and
#: code, so the other columns are free for DDL (rename, drop, type changes).
CREATE = """CREATE TABLE items(
  id int PRIMARY KEY,
  name text NOT NULL,
  qty int NOT NULL,
  price numeric(10,2),
  code varchar(10) NOT NULL,
  note text)"""

HEAL_TIMEOUT_S = 60.0
CATCH_UP_TIMEOUT_S = 120.0


def populate(conn: psycopg2.extensions.connection, first: int, count: int,
             table: str = TABLE) -> None:
    """Rows ``first .. first+count-1`` (some notes and prices NULL)."""
    with conn.cursor() as cur:
        cur.execute(
            f"INSERT INTO {table}(id, name, qty, price, code, note) "
            "SELECT g, 'name-' || g, g %% 50, CASE WHEN g %% 11 = 0 THEN NULL "
            "ELSE ((g::int8 * 7919) %% 100000) / 100.0 END, 'c' || (g %% 1000), "
            "CASE WHEN g %% 7 = 0 THEN NULL ELSE 'note ' || g END "
            "FROM generate_series(%s::int, %s::int) g",
            (first, first + count - 1),
        )


# ----------------------------------------------------------------------------- the writer


class Workload:
    """Inserts, updates and deletes on ``items`` in a thread, 1-3 statements per transaction.

    Only single-row statements, so no statement of the test's own thread
    (single-row DML, DDL) can deadlock with it. Inserted ids start at 100 000.
    """

    def __init__(self, pg: PgDatabase, max_id: int, seed: int, pause_s: float = 0.002) -> None:
        self._conn = pg.connect()
        self._conn.autocommit = False
        self._rng = random.Random(seed)
        self._ids = list(range(1, max_id + 1))
        self._next_id = 100_000
        self._pause_s = pause_s
        self._stop = threading.Event()
        self._done = threading.Event()
        self.committed = 0
        self.counts = {"c": 0, "u": 0, "d": 0}
        self.failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Workload:
        self._thread.start()
        return self

    def _statement(self, cur: Any) -> None:
        rng = self._rng
        choice = rng.random()
        if choice < 0.3 or not self._ids:
            self._next_id += 1
            cur.execute(
                "INSERT INTO items(id, name, qty, code) VALUES (%s, %s, %s, %s)",
                (self._next_id, f"w{rng.randrange(10**6)}", rng.randrange(100),
                 f"w{self._next_id % 1000}"),
            )
            self._ids.append(self._next_id)
            self.counts["c"] += 1
        elif choice < 0.8:
            cur.execute("UPDATE items SET name = %s, qty = qty + 1 WHERE id = %s",
                        (f"u{rng.randrange(10**6)}", rng.choice(self._ids)))
            self.counts["u"] += 1
        else:
            victim = self._ids.pop(rng.randrange(len(self._ids)))
            cur.execute("DELETE FROM items WHERE id = %s", (victim,))
            self.counts["d"] += 1

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._conn.cursor() as cur:
                    for _ in range(self._rng.randrange(1, 4)):
                        self._statement(cur)
                self._conn.commit()
                self.committed += 1
                time.sleep(self._pause_s)  # pacing only: leave the daemon some CPU
        except psycopg2.Error as exc:  # reported by the test thread
            self.failure.append(exc)
        finally:
            self._done.set()

    def _check(self) -> None:
        if self.failure:
            raise AssertionError(f"the writer failed: {self.failure[0]!r}") from self.failure[0]

    def wait_more(self, transactions: int) -> None:
        """Wait until ``transactions`` more transactions are committed from now."""
        target = self.committed + transactions
        wait_for(lambda: self.committed >= target or self._done.is_set(), timeout_s=60,
                 interval_s=0.02, what=f"the writer to commit {target} transactions")
        self._check()

    def finish_quietly(self) -> None:
        """Stop (test teardown): the test already reported whatever went wrong."""
        self._stop.set()
        self._thread.join(60)

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert self._done.is_set() or not self._thread.is_alive(), "the writer did not stop"
        self._check()


# ----------------------------------------------------------------------------- one scenario


@dataclass
class Scenario:
    """A table under a writer and a daemon; see the module docstring."""

    pg: PgDatabase
    bootstrap: str
    config: Path
    start_daemon: Callable[[Path], DaemonProcess]
    daemon: DaemonProcess
    conn: psycopg2.extensions.connection
    rows: int
    workloads: list[Workload] = field(default_factory=list)
    history: list[DaemonProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append(self.daemon)

    @property
    def slot(self) -> str:
        return "cdcd_" + self.pg.dbname[:50]

    @property
    def prefix(self) -> str:
        return self.pg.dbname

    def topic(self, table: str = TABLE) -> str:
        return f"{self.prefix}.public.{table}"

    def relfilenode(self, table: str = TABLE) -> int:
        """The table's file: a rewrite gives it a new one."""
        row = self.pg.fetchone("SELECT relfilenode FROM pg_class WHERE oid = %s::regclass",
                               (f"public.{table}",))
        assert row is not None
        return int(row[0])

    def execute(self, statement: str, params: Any = None) -> None:
        with self.conn.cursor() as cur:
            cur.execute(statement, params)

    def writer(self, seed: int = 1) -> Workload:
        workload = Workload(self.pg, self.rows, seed).start()
        self.workloads.append(workload)
        return workload

    def ddl_under_load(self, statements: list[str], before: int = 20, after: int = 20,
                       seed: int = 1, rewrites: bool | None = None) -> Workload:
        """Writer on; ``before`` transactions; the DDL; ``after`` more; writer off.

        After each statement the writer commits a few transactions and the
        daemon confirms them, so each version reaches the daemon before the
        next statement: a version met with the catalog past a later DDL that
        dropped or re-added a column cannot be told apart and heals (no
        "another DDL happened since" guess). The version before the first
        statement needs no such wait: it is the recorded one, and a migration
        the catalog is already past is compared with the recorded state
        (``test_migration_before_first_relation``). ``rewrites`` (when not
        None) is the test's premise, asserted: the statements give the table a
        new file, or not.
        """
        files = self.relfilenode()
        workload = self.writer(seed)
        workload.wait_more(before)
        for statement in statements:
            self.execute(statement)
            workload.wait_more(5)
            wait_confirmed(self.pg, self.slot, self.daemon)
        workload.wait_more(after)
        workload.finish()
        if rewrites is not None:
            assert (self.relfilenode() != files) == rewrites, (
                f"premise: {statements} {'rewrite' if rewrites else 'do not rewrite'} the table")
        return workload

    def kill9(self) -> None:
        """SIGKILL the daemon and wait until its walsender has let go of the slot."""
        self.daemon.kill9()
        wait_for(lambda: self.pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE "
                                          "slot_name = %s AND active_pid IS NULL", (self.slot,)),
                 timeout_s=60, what="the walsender of the killed daemon to exit")

    def logs(self) -> str:
        """The logs of every daemon of this scenario, oldest first."""
        return "\n".join(daemon.log() for daemon in self.history)

    def restart(self) -> DaemonProcess:
        self.daemon = self.start_daemon(self.config)
        self.history.append(self.daemon)
        wait_streaming(self.pg, self.slot, self.daemon)
        return self.daemon

    def crash(self) -> DaemonProcess:
        """:meth:`kill9`, then :meth:`restart`: a crash the supervisor recovers from."""
        self.kill9()
        return self.restart()

    def settle(self, heal: bool) -> list[str]:
        """Wait for the daemon to confirm everything written and for its jobs on the
        table to end; return what is wrong (an expected heal that never finished)."""
        problems: list[str] = []
        wait_confirmed(self.pg, self.slot, self.daemon)
        if heal:
            try:
                wait_for(lambda: (jobs := heal_jobs(self.pg)) and all(j.status == "done"
                                                                     for j in jobs),
                         timeout_s=HEAL_TIMEOUT_S, interval_s=0.1,
                         what="a finished schema-change snapshot job")
            except AssertionError:
                problems.append(
                    f"{QUALIFIED}: no finished 'schema-change:' snapshot job in cdcd_signal "
                    f"{HEAL_TIMEOUT_S:.0f} s after the daemon confirmed the DDL (jobs: "
                    f"{[(j.id, j.status) for j in signal_jobs(self.pg)] or 'none'}); "
                    "the rewrite needs a heal (contract13)"
                )
        wait_for(lambda: not [j for j in signal_jobs(self.pg) if j.status in ("pending", "running")],
                 timeout_s=CATCH_UP_TIMEOUT_S, interval_s=0.1,
                 what=f"no pending/running snapshot job on {QUALIFIED}")
        return problems

    def settle_heals(self, tables: list[str]) -> list[str]:
        """Wait for the daemon to confirm everything written, for a finished heal of each of
        ``tables`` and for no job to be left; return the heals that never finished."""
        wait_confirmed(self.pg, self.slot, self.daemon)
        problems = wait_heals(self.pg, self.daemon, tables)
        wait_no_jobs(self.pg)
        wait_confirmed(self.pg, self.slot, self.daemon)
        return problems

    def compare(self, table: str = TABLE, key: tuple[str, ...] = KEY) -> list[str]:
        """Differences between PostgreSQL and the replayed topic (empty: equal)."""
        return kafka_differences(self.pg, self.bootstrap, self.prefix, table, key)

    def outcome(self, heal: bool, kinds: list[str]) -> tuple[list[str], str]:
        """:meth:`settle`, then what is wrong: the replayed topic against the table
        (:meth:`compare`) and each of ``kinds`` without its log line; and the daemon's log."""
        problems = self.settle(heal=heal)
        problems += self.compare()
        log = self.daemon.log()
        problems += missing_kinds(log, kinds)
        return problems, log


def wait_confirmed(pg: PgDatabase, slot: str, daemon: DaemonProcess) -> None:
    """Until the daemon confirmed everything written so far (``support.cdc.wait_wal_confirmed``)."""
    wait_wal_confirmed(pg.connect(), slot, daemon, CATCH_UP_TIMEOUT_S)


def tail(log: str, lines: int = 30) -> str:
    return "\n".join(log.splitlines()[-lines:])


# ----------------------------------------------------------------------------- signal table


@dataclass(frozen=True)
class Job:
    id: str
    type: str
    status: str
    tables: tuple[str, ...]
    progress: dict[str, Any]


def signal_jobs(pg: PgDatabase, table: str = QUALIFIED) -> list[Job]:
    """Jobs of the signal table (default ``cdcd_signal``) that cover ``table``."""
    if pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None:  # type: ignore[index]
        return []
    jobs = []
    for job_id, kind, status, data, progress in pg.fetchall(
        "SELECT id, type, status, data, progress FROM cdcd_signal ORDER BY created_at, id"
    ):
        data = data if isinstance(data, dict) else json.loads(data or "{}")
        progress = progress if isinstance(progress, dict) else json.loads(progress or "{}")
        tables = data.get("data-collections") or data.get("tables") or progress.get("tables") or []
        tables = [tables] if isinstance(tables, str) else list(tables)
        if table in tables or table in str(job_id):
            jobs.append(Job(str(job_id), str(kind), str(status), tuple(tables), progress))
    return jobs


def heal_jobs(pg: PgDatabase, table: str = QUALIFIED) -> list[Job]:
    """The automatic re-snapshots of ``table`` (contract13: id ``schema-change:...``)."""
    return [j for j in signal_jobs(pg, table) if j.id.startswith("schema-change:")]


def chunks_done(job: Job) -> int:
    current = job.progress.get("current") or {}
    return int(current.get("chunks") or 0) if isinstance(current, dict) else 0


# ----------------------------------------------------------------------------- daemon log


def schema_change_lines(log: str, table: str = QUALIFIED) -> list[str]:
    return [line for line in log.splitlines() if f"schema change on {table}:" in line]


def missing_kinds(log: str, kinds: list[str], table: str = QUALIFIED) -> list[str]:
    """One problem per kind with no ``schema change on <table>: <kind>`` INFO line."""
    lines = schema_change_lines(log, table)
    problems = []
    for kind in kinds:
        if not any(re.search(rf"schema change on {re.escape(table)}: {kind}\b", line)
                   for line in lines):
            problems.append(f"{table}: no log line 'schema change on {table}: {kind} ...' "
                            f"(schema-change lines: {lines or 'none'})")
    return problems


# ----------------------------------------------------------------------------- the oracle


def column_types(conn: psycopg2.extensions.connection, table: str) -> dict[str, str]:
    """Column -> ``format_type`` of the table's current columns, in order."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (f"public.{table}",),
        )
        return {str(name): str(kind) for name, kind in cur.fetchall()}


def normalize(value: Any, pg_type: str) -> Any:
    """One comparable form for psycopg2's, fastavro's and pyarrow's values (SPEC §5 mapping)."""
    if value is None:
        return None
    if pg_type.endswith("[]") and isinstance(value, list):
        return [normalize(item, pg_type[:-2]) for item in value]
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    if pg_type in ("json", "jsonb"):
        parsed = json.loads(value) if isinstance(value, str) else value
        return json.dumps(parsed, sort_keys=True)
    if pg_type == "numeric" and isinstance(value, str):
        return Decimal(value)  # numeric without typmod travels as its exact text
    return value


def source_rows(conn: psycopg2.extensions.connection, table: str,
                key: tuple[str, ...]) -> tuple[dict[str, str], dict[tuple[Any, ...], dict[str, Any]]]:
    """(column types, {key: normalized row}) of the table in PostgreSQL now."""
    types = column_types(conn, table)
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM public.{table}")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    out = {}
    for row in rows:
        normalized = {c: normalize(v, types[c]) for c, v in row.items()}
        out[tuple(normalized[k] for k in key)] = normalized
    return types, out


def kafka_rows(bootstrap: str, prefix: str, table: str, key: tuple[str, ...],
               types: dict[str, str]) -> tuple[list[str], dict[tuple[Any, ...], dict[str, Any]]]:
    """(PostgreSQL column names of the newest schema, {key: normalized row}) from the topic."""
    topic = f"{prefix}.public.{table}"
    read = read_resolved_changes(bootstrap, prefix, [topic], timeout_s=120, idle_s=2.0)
    assert read.changes, f"nothing published on {topic}"
    columns = read.row_columns(topic)
    avro_key = tuple(next(f for f, c in columns.items() if c == k) for k in key)
    out = {}
    for avro_row in replay(read.changes, avro_key).values():
        row = {columns[f]: normalize(v, types.get(columns[f], "")) for f, v in avro_row.items()}
        out[tuple(row[k] for k in key)] = row
    return list(columns.values()), out


def differences(table: str, types: dict[str, str], expected: dict[tuple[Any, ...], dict[str, Any]],
                columns: list[str], actual: dict[tuple[Any, ...], dict[str, Any]],
                source: str, limit: int = 3) -> list[str]:
    """What ``source`` (the consumer's view) gets wrong about PostgreSQL's table."""
    problems = []
    if set(columns) != set(types):
        problems.append(
            f"public.{table}: columns in PostgreSQL {sorted(types)} but in {source} "
            f"{sorted(columns)}"
        )
    missing = sorted(set(expected) - set(actual), key=repr)
    extra = sorted(set(actual) - set(expected), key=repr)
    if missing:
        problems.append(f"public.{table}: {len(missing)} of {len(expected)} rows missing from "
                        f"{source}, e.g. keys {missing[:limit]}")
    if extra:
        problems.append(f"public.{table}: {len(extra)} rows in {source} that PostgreSQL does not "
                        f"have, e.g. {[actual[k] for k in extra[:limit]]}")
    by_column: dict[str, list[str]] = {}
    for k in sorted(set(expected) & set(actual), key=repr):
        want, got = expected[k], actual[k]
        for column in types:
            if column in got and want[column] != got[column]:
                by_column.setdefault(column, []).append(
                    f"key {k}: PostgreSQL {want[column]!r}, {source} {got[column]!r}"
                )
    common = len(set(expected) & set(actual))
    for column, examples in by_column.items():
        problems.append(
            f"public.{table}.{column} ({types[column]}) differs in {len(examples)} of {common} "
            f"rows: " + "; ".join(examples[:limit])
        )
    return problems


def kafka_differences(pg: PgDatabase, bootstrap: str, prefix: str, table: str = TABLE,
                      key: tuple[str, ...] = KEY) -> list[str]:
    conn = pg.connect()
    types, expected = source_rows(conn, table, key)
    try:
        columns, actual = kafka_rows(bootstrap, prefix, table, key, types)
    except AssertionError as exc:  # unresolvable records: that is the finding
        return [f"public.{table}: {exc}"]
    return differences(table, types, expected, columns, actual, "Kafka")


def report(problems: list[str], log: str | None = None) -> str:
    text = "\n".join(problems)
    if log is not None:
        text += "\n--- daemon log (schema-change lines) ---\n" + "\n".join(
            line for line in log.splitlines() if "schema change" in line or "schema_changes" in line
        )
    return text


# ----------------------------------------------------------------------------- issue 24: baselines


@dataclass(frozen=True)
class Case:
    statements: tuple[str, ...]  # {t}: the table
    kinds: tuple[str, ...]  # schema-change kinds the log must name
    heals_when_written: bool  # a re-snapshot even when the next Relation shows it


RECREATED = "CREATE TABLE {t}(id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL, " \
            "code varchar(10) NOT NULL, colour text DEFAULT 'blue')"

CASES = {
    "fast_default": Case(("ALTER TABLE {t} ADD COLUMN region text DEFAULT 'eu'",),
                         ("add_column_default",), False),
    "rewrite": Case(("ALTER TABLE {t} ALTER COLUMN qty TYPE bigint USING qty * 10",
                     "ALTER TABLE {t} ADD COLUMN r float8 DEFAULT random()"),
                    ("type_change_rewrite",), True),
    "rename": Case(("ALTER TABLE {t} RENAME COLUMN note TO memo",), ("rename_column",), False),
    "drop_column": Case(("ALTER TABLE {t} DROP COLUMN price",), ("drop_column",), False),
    "recreate": Case((f"BEGIN; DROP TABLE {{t}}; {RECREATED}; COMMIT",), ("recreate",), False),
    "identity": Case(("ALTER TABLE {t} DROP CONSTRAINT {t}_pkey, ADD PRIMARY KEY (id, code)",),
                     ("identity",), False),
}


def migrate_idle(sc: Scenario, tables: dict[str, str]) -> None:
    """Run each case's DDL on its table (case -> table); nothing is written afterwards."""
    for name, table in tables.items():
        for statement in CASES[name].statements:
            sc.execute(statement.format(t=table))


def create_items(conn: psycopg2.extensions.connection, table: str, rows: int) -> None:
    """A table shaped like ``items`` under another name, with ``rows`` rows."""
    with conn.cursor() as cur:
        cur.execute(CREATE.replace("CREATE TABLE items(", f"CREATE TABLE {table}(", 1))
    populate(conn, 1, rows, table)


def write_some(conn: psycopg2.extensions.connection, table: str) -> None:
    """A few row changes of ``table`` (whatever its columns now): its next Relation follows."""
    with conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET name = 'after-' || id WHERE id % 10 = 0 AND id <= 3000")
        cur.execute(f"DELETE FROM {table} WHERE id % 25 = 1 AND id <= 3000")
        cur.execute(f"INSERT INTO {table}(id, name, qty, code) SELECT g, 'late-' || g, g % 7, "
                    "'l' || g % 1000 FROM generate_series(2000000001, 2000000020) g")


def wait_heals(pg: PgDatabase, daemon: DaemonProcess, tables: list[str],
               timeout_s: float = HEAL_TIMEOUT_S) -> list[str]:
    """Wait until every table named has a finished ``schema-change:`` job; the missing ones."""
    def done(table: str) -> bool:
        jobs = heal_jobs(pg, f"public.{table}")
        return bool(jobs) and all(j.status == "done" for j in jobs)

    def healed() -> bool:
        if not daemon.alive():
            raise AssertionError(f"the daemon exited ({daemon.proc.returncode}):\n"
                                 + tail(daemon.log()))
        return all(done(t) for t in tables)

    try:
        wait_for(healed, timeout_s=timeout_s, interval_s=0.2, what="the heals to finish")
    except AssertionError:
        return [f"public.{t}: no finished 'schema-change:' job within {timeout_s:.0f} s (jobs: "
                f"{[(j.id, j.status) for j in signal_jobs(pg, f'public.{t}')] or 'none'})"
                for t in tables if not done(t)]
    return []


def wait_no_jobs(pg: PgDatabase) -> None:
    """No snapshot job of any table pending or running."""
    def idle() -> bool:
        if pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None:  # type: ignore[index]
            return True
        return not pg.fetchall("SELECT 1 FROM cdcd_signal WHERE status IN ('pending', 'running') "
                               "AND type IN ('execute-snapshot', 'initial')")

    wait_for(idle, timeout_s=CATCH_UP_TIMEOUT_S, interval_s=0.2,
             what="no pending or running snapshot job")


# ----------------------------------------------------------------------------- cdcd mirror --once

SPARK_ENV = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}

def mirror_once(config: Path, output: Path, log: Path) -> None:
    with open(log, "wb") as out:
        result = subprocess.run(
            [sys.executable, "-m", "cdcd", "mirror", "-c", str(config), "--output", str(output),
             "--once"],
            cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=300,
            env={**os.environ, **SPARK_ENV},
        )
    assert result.returncode == 0, log.read_text(encoding="utf-8", errors="replace")[-5000:]


def mirror_differences(conn: Any, output: Path, table: str) -> list[str]:
    types, expected = source_rows(conn, table, KEY)
    path = output / f"public.{table}"
    if not path.exists():
        return [f"public.{table}: no mirror at {path}"]
    from cdcd.spark.mirror import read_mirror

    data = read_mirror(str(path))
    actual = {}
    for row in data.to_pylist():
        normalized = {c: normalize(v, types.get(c, "")) for c, v in row.items()}
        actual[tuple(normalized[k] for k in KEY)] = normalized
    return differences(table, types, expected, data.column_names, actual, "the mirror")


def wait_initial_snapshot(pg: PgDatabase, slot: str, daemon: DaemonProcess) -> None:
    """Until the initial snapshot is delivered and the daemon streams.

    Not the slot's ``active`` alone: the walsender that creates the slot
    holds it active during the copy too.
    """
    def done() -> bool:
        if not daemon.alive():
            raise AssertionError(f"the daemon exited ({daemon.proc.returncode}):\n"
                                 + tail(daemon.log()))
        if pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None:  # type: ignore[index]
            return False
        row = pg.fetchone("SELECT status FROM cdcd_signal WHERE id = %s", (f"initial:{slot}",))
        return row is not None and row[0] == "done"

    wait_for(done, timeout_s=CATCH_UP_TIMEOUT_S, interval_s=0.1,
             what="the initial snapshot to be delivered")
    wait_streaming(pg, slot, daemon)
