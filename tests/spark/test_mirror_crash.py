"""``cdcd mirror`` killed inside a MERGE commit, and a batch replayed after its commit (issue 17).

A Delta commit is data files first, then one log entry naming them; the
batch's progress (the ``txn`` action: Spark query id and batch id) and the
mirror state are in that entry. So:

* ``kill -9`` while a MERGE has written its data file but not the log entry
  (fault point ``cdcd.spark.faults.FAULT = "in-merge"``: the process SIGKILLs itself the
  moment such a file exists) leaves the table at its previous version, and
  the next run applies the batch once -- in a child process applying a
  batch without Spark (default suite), and with ``cdcd mirror`` itself
  against a table the daemon mirrors from PostgreSQL (``slow``);
* a failure right after the MERGE committed, before Spark recorded the batch
  as done, makes Spark replay the batch; the mirror recognises it by the
  table's transaction version and skips it (in
  ``test_mirror_migration_e2e.py``, which runs the mirror anyway).

Afterwards the table equals what was written (PostgreSQL's SELECT, read with
deltalake), and the Delta history holds exactly one commit per (query, batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT, DaemonProcess, wait_for, wait_streaming
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

pytest.importorskip("pyspark")
pytest.importorskip("deltalake")

from cdcd.spark.mirror import MirrorStore, read_mirror
from spark.test_mirror_apply import _store_batch, change, row

ROWS = 4000


def _commits(table: Path) -> list[tuple[str, int]]:
    """(app id, batch) of every commit that applied a batch, in ``table``'s history."""
    from deltalake import DeltaTable

    found = []
    for entry in DeltaTable(str(table)).history():
        if "cdcd.mirror" in entry:
            document = json.loads(entry["cdcd.mirror"])
            if document["kind"] == "batch":
                found.append((document["app"], document["batch"]))
    return found


def _uncommitted_files(table: Path) -> set[str]:
    """Data files on disk that no commit of the log ever added."""
    named = set()
    for log in (table / "_delta_log").glob("*.json"):
        for line in log.read_text().splitlines():
            action = json.loads(line)
            for kind in ("add", "remove"):
                if kind in action:
                    named.add(os.path.basename(action[kind]["path"]))
    return {p.name for p in table.glob("*.parquet")} - named


_CHILD = """
import sys
sys.path.insert(0, "tests")
import cdcd.spark.faults
from cdcd.spark.mirror import MirrorStore
cdcd.spark.faults.FAULT = sys.argv[2]
from spark.test_mirror_apply import _store_batch, change, row
store = MirrorStore(sys.argv[1])
store.open()
_store_batch(store, 1, [change("u", 50, i, after=row(i, "2.00", "x" * 400)) for i in range(0, 20000, 7)])
"""


def test_kill_9_inside_a_merge_commit_leaves_the_previous_version(tmp_path: Path) -> None:
    from deltalake import DeltaTable

    table = tmp_path / "public.t"
    store = MirrorStore(tmp_path)
    store.open()
    # Rows wide enough that the MERGE's rewritten file takes a while to write.
    _store_batch(
        store, 0, [change("c", 10, i, after=row(i, "1.00", "y" * 400)) for i in range(20000)]
    )
    before = read_mirror(str(table))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), "in-merge:1"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -9, child.stderr[-3000:]
    assert "written but not committed" in child.stderr
    assert _uncommitted_files(table), "the kill did not land between data files and commit"
    assert DeltaTable(str(table)).transaction_version("cdcd-mirror") == 0
    assert read_mirror(str(table)).equals(before)

    reopened = MirrorStore(tmp_path)  # the restart applies the batch, once
    reopened.open()
    _store_batch(
        reopened,
        1,
        [change("u", 50, i, after=row(i, "2.00", "x" * 400)) for i in range(0, 20000, 7)],
    )
    assert not _store_batch(reopened, 1, [change("c", 99, after=row(99999))]).tables  # replay
    rows = {r["id"]: r for r in read_mirror(str(table)).to_pylist()}
    assert len(rows) == 20000
    assert all(rows[i]["doc"] == ("x" if i % 7 == 0 else "y") * 400 for i in range(20000))
    assert Counter(_commits(table)) == {("cdcd-mirror", 0): 1, ("cdcd-mirror", 1): 1}


class _Source:
    """A table ``items`` the daemon mirrors into Kafka."""

    def __init__(self, pg: PgDatabase, cdc_config: Callable[..., Path], daemons: Any) -> None:
        self.conn = pg.connect()
        self.conn.autocommit = True
        self.cur = self.conn.cursor()
        self.cur.execute("CREATE TABLE items(id int PRIMARY KEY, doc text, n int)")
        self.config = cdc_config(tables=["public.items"])
        self.slot = "cdcd_" + pg.dbname[:50]
        wait_streaming(pg, self.slot, daemons(self.config))

    def run(self, *statements: str) -> None:
        for statement in statements:
            self.cur.execute(statement)
        target = current_wal_lsn(self.conn)
        wait_for(
            lambda: slot_confirmed_flush_lsn(self.conn, self.slot) >= target, what="confirmation"
        )

    def rows(self) -> dict[int, tuple[Any, ...]]:
        self.cur.execute("SELECT id, doc, n FROM items")
        return {row[0]: tuple(row) for row in self.cur.fetchall()}


def _mirrored(output: Path) -> dict[int, tuple[Any, ...]]:
    table = read_mirror(str(output / "public.items"))
    return {r["id"]: (r["id"], r["doc"], r["n"]) for r in table.to_pylist()}


CHANGES = (
    "UPDATE items SET n = -n WHERE id % 10 = 0",
    "DELETE FROM items WHERE id % 97 = 0",
    "INSERT INTO items VALUES (100000, 'new', 1)",
)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.integration
def test_cdcd_mirror_killed_inside_a_merge_commit_catches_up_once(
    pg: PgDatabase,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirrors: Callable[..., Any],
    mirror_once: Callable[[Path, Path], float],
    tmp_path: Path,
) -> None:
    source = _Source(pg, cdc_config, daemons)
    # Rows wide enough that the MERGE's rewritten file takes a while to write.
    source.run(
        f"INSERT INTO items SELECT g, repeat(md5(g::text), 12), g FROM generate_series(1, {ROWS}) g"
    )
    output = tmp_path / "mirror"
    table = output / "public.items"
    mirror_once(source.config, output)
    assert _mirrored(output) == source.rows()
    built = _commits(table)

    source.run(*CHANGES)
    killed = mirrors(source.config, output, once=True, fault="in-merge")
    assert killed.wait(300) == -9, killed.log()
    assert "written but not committed" in killed.log()
    assert _uncommitted_files(table), "the kill did not land between data files and commit"
    assert _commits(table) == built  # nothing of the batch is visible

    mirror_once(source.config, output)  # the restart applies the batch, once
    commits = _commits(table)
    assert len(commits) == len(built) + 1
    assert max(Counter(commits).values()) == 1, commits
    assert _mirrored(output) == source.rows()
