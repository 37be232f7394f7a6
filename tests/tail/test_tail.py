"""``cdcd tail``: the table topics decoded, one line per change, on both wire formats.

The daemon streams ``public.t``; the test inserts, updates and deletes rows,
adds a column with a default mid-topic (a new writer schema: records before
and after it are decoded each with its own), changes more rows, waits for the
daemon to confirm everything, then runs ``cdcd tail --from beginning
--exit-at-end --json``. Replaying what tail printed (by key, in
(lsn, seq) order) must give ``SELECT * FROM t`` afterwards; the text mode
prints the demo's line for the same records. Both with single-object
encoding (schemas in ``<prefix>._schemas``) and with the Confluent wire
format against a schema registry on loopback (the tests' ``FakeRegistry``,
which registers and serves schemas by id as a registry does).

``--from end`` shows only what arrives after it reached the end of the
topics (it says so on stderr; the test waits for that line, then writes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT, DaemonProcess, run_cdcd, wait_for
from support.pg import PgDatabase

from tests.envelope.test_registry import FakeRegistry
from tests.schema_changes.helpers import wait_confirmed, wait_streaming

pytestmark = pytest.mark.integration


def tail(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = run_cdcd("tail", "-c", str(config), *args)
    assert result.returncode == 0, result.stderr
    return result


def workload(pg: PgDatabase) -> None:
    """Changes before and after a schema change (ADD COLUMN with a default)."""
    pg.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 5) g")
    pg.execute("UPDATE t SET v = 'changed' WHERE id = 2")
    pg.execute("DELETE FROM t WHERE id = 3")
    pg.execute("ALTER TABLE t ADD COLUMN n int NOT NULL DEFAULT 7")
    pg.execute("INSERT INTO t VALUES (6, 'six', 60)")
    pg.execute("UPDATE t SET n = 11, v = 'after' WHERE id = 1")


def replay(lines: list[str]) -> dict[int, dict[str, Any]]:
    """tail --json lines applied by key in (lsn, seq) order."""
    changes = [json.loads(line) for line in lines if line.strip()]
    lsn = lambda c: tuple(int(x, 16) for x in c["lsn"].split("/"))  # noqa: E731
    table: dict[int, dict[str, Any]] = {}
    for change in sorted(changes, key=lambda c: (lsn(c), c["seq"])):
        if change["op"] in ("c", "u", "r"):
            # Written before ADD COLUMN n: no n in its writer schema; a reader resolving
            # to the newest schema gets the column's default (the DDL's 7).
            table[change["after"]["id"]] = {"n": 7, **change["after"]}
        elif change["op"] == "d":
            table.pop(change["before"]["id"], None)
    return table


def source(pg: PgDatabase) -> dict[int, dict[str, Any]]:
    return {r[0]: {"id": r[0], "v": r[1], "n": r[2]}
            for r in pg.fetchall("SELECT id, v, n FROM t")}


@pytest.fixture
def running(pg: PgDatabase, cdc_config: Callable[..., Path],
            daemons: Callable[[Path], DaemonProcess]) -> Iterator[Callable[..., Path]]:
    def start(**extra: Any) -> Path:
        pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        config = cdc_config(tables=["public.t"], extra=extra)
        daemon = daemons(config)
        wait_streaming(pg, "cdcd_" + pg.dbname[:50], daemon)
        workload(pg)
        wait_confirmed(pg, "cdcd_" + pg.dbname[:50], daemon)
        return config

    yield start


def check_tail(pg: PgDatabase, config: Path) -> None:
    result = tail(config, "--from", "beginning", "--exit-at-end", "--json")
    lines = result.stdout.splitlines()
    printed = replay(lines)
    assert printed == source(pg), result.stdout
    ops = [json.loads(line)["op"] for line in lines]
    assert ops.count("d") == 1 and ops.count(None) == 1, ops  # a delete and its tombstone
    # Records before the schema change have no n; after it, n is there.
    changes = [json.loads(line) for line in lines]
    first = next(c for c in changes if c["key"] == {"id": 1} and c["op"] == "c")
    latest = next(c for c in changes if c["key"] == {"id": 6})
    assert "n" not in first["after"] and first["table"] == "public.t", first
    assert latest["after"] == {"id": 6, "v": "six", "n": 60}, latest

    text = tail(config, "--from", "beginning", "--exit-at-end").stdout.splitlines()
    assert len(text) == len(lines) - 1, text  # the tombstone is not shown as a line
    insert = next(line for line in text if line.startswith("public.t c id=1 "))
    assert insert.endswith("v='v1'"), insert
    update = next(line for line in text if line.startswith("public.t u id=2 "))
    assert update.endswith("v: 'v2' -> 'changed'"), update
    last = next(line for line in text if line.startswith("public.t u id=1 "))
    # Its previous version in this read had no n (written before the column came).
    assert last.endswith("v: 'v1' -> 'after'  n: null -> 11"), last


def test_tail_single_object(pg: PgDatabase, running: Callable[..., Path]) -> None:
    check_tail(pg, running())


def test_tail_with_a_schema_registry(pg: PgDatabase, running: Callable[..., Path]) -> None:
    registry = FakeRegistry()
    try:
        config = running(schema_registry={"url": registry.url})
        assert registry.ids, "premise: the daemon registered its schemas"
        check_tail(pg, config)
    finally:
        registry.close()


def test_tail_from_the_end_shows_only_new_changes(pg: PgDatabase,
                                                  running: Callable[..., Path]) -> None:
    config = running()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcd", "tail", "-c", str(config), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=PROJECT_ROOT,
    )  # fmt: skip
    try:
        assert proc.stderr is not None and proc.stdout is not None
        notice = proc.stderr.readline()
        assert "at the end of 1 topic" in notice, notice
        pg.execute("INSERT INTO t VALUES (7, 'new', 1)")
        line = json.loads(proc.stdout.readline())
        assert (line["op"], line["after"]) == ("c", {"id": 7, "v": "new", "n": 1}), line
    finally:
        proc.terminate()
        proc.wait(30)
    assert wait_for(lambda: proc.returncode is not None)
