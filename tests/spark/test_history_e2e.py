"""History tables (SCD type 2) against PostgreSQL: the versions valid at every commit LSN equal the table then (issue 28).

A seeded random workload (``CDCD_HISTORY_SEED`` to pick another seed) over
a keyed table and a keyless one (``REPLICA IDENTITY FULL``, duplicate rows
included): inserts, updates (a row changed twice in one transaction too),
deletes, primary key changes, rows inserted and deleted in one transaction,
truncates, and columns added (plain and with a constant default) while the
daemon streams. After every transaction the test reads both tables back
from PostgreSQL and records them with the transaction id. ``cdcd mirror
--once --history`` runs three times (each a new streaming query from the
checkpoint), so batches end at arbitrary points of the history; the slow
variant writes more and runs the second as its own process (a new JVM).

Then, for every transaction that reached Kafka (its commit LSN ``L`` from the
replay, by transaction id), each history table filtered ``__start_lsn <= L <
__end_lsn`` (an open end being null) must equal the table as PostgreSQL held it
right after that commit, compared on the columns it had then.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, read_changes
from support.pg import PgDatabase

from cdcd.tools.local import LocalBroker
from spark.capture import start_capture
from spark.conftest import MirrorProcess

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pytest.importorskip("deltalake")

SEED = int(os.environ.get("CDCD_HISTORY_SEED", "2028"))
TABLES = ("hist_k", "hist_f")
SETUP = """
CREATE TABLE hist_k(id int PRIMARY KEY, v text, n int);
CREATE TABLE hist_f(a int, b text);
ALTER TABLE hist_f REPLICA IDENTITY FULL;
INSERT INTO hist_k SELECT g, 'v' || g, g FROM generate_series(1, 10) g;
INSERT INTO hist_f SELECT g % 4, 'b' || g FROM generate_series(1, 8) g;
"""

Snapshot = dict[str, tuple[tuple[str, ...], list[tuple[Any, ...]]]]


class Workload:
    """Random transactions on ``hist_k`` and ``hist_f``; records the tables after each."""

    def __init__(self, pg: PgDatabase, rng: random.Random) -> None:
        self.pg = pg
        self.rng = rng
        self.conn = pg.connect()
        self.conn.autocommit = False  # one transaction per call of transaction()
        self.next_id = 1000
        self.added = 0
        #: (txid, tables after the commit)
        self.states: list[tuple[int, Snapshot]] = []

    def _ids(self, cur: Any) -> list[int]:
        cur.execute("SELECT id FROM hist_k ORDER BY id")
        return [r[0] for r in cur.fetchall()]

    def _statement(self, cur: Any) -> None:
        rng = self.rng
        ids = self._ids(cur)
        kind = rng.choice(
            ["insert", "insert", "update", "update", "twice", "key", "delete", "flash",
             "f_insert", "f_update", "f_delete"]
        )  # fmt: skip
        if kind in ("update", "twice", "key", "delete") and not ids:
            kind = "insert"
        if kind == "insert":
            self.next_id += 1
            cur.execute(
                "INSERT INTO hist_k(id, v, n) VALUES (%s, %s, %s)",
                (self.next_id, f"v{rng.randrange(100)}", rng.randrange(1000)),
            )
        elif kind == "update":
            cur.execute(
                "UPDATE hist_k SET v = %s WHERE id = %s", (f"u{rng.randrange(100)}", rng.choice(ids))
            )
        elif kind == "twice":
            target = rng.choice(ids)
            cur.execute("UPDATE hist_k SET n = n + 1 WHERE id = %s", (target,))
            cur.execute("UPDATE hist_k SET n = n * 2, v = 'twice' WHERE id = %s", (target,))
        elif kind == "key":
            self.next_id += 1
            cur.execute("UPDATE hist_k SET id = %s WHERE id = %s", (self.next_id, rng.choice(ids)))
        elif kind == "delete":
            cur.execute("DELETE FROM hist_k WHERE id = %s", (rng.choice(ids),))
        elif kind == "flash":  # born and gone in one transaction: never a version
            self.next_id += 1
            cur.execute("INSERT INTO hist_k(id, v) VALUES (%s, 'flash')", (self.next_id,))
            cur.execute("DELETE FROM hist_k WHERE id = %s", (self.next_id,))
        elif kind == "f_insert":
            cur.execute("INSERT INTO hist_f VALUES (%s, %s)", (rng.randrange(5), f"b{rng.randrange(3)}"))
        elif kind == "f_update":
            cur.execute(
                "UPDATE hist_f SET b = %s WHERE ctid = (SELECT ctid FROM hist_f WHERE a = %s LIMIT 1)",
                (f"c{rng.randrange(50)}", rng.randrange(5)),
            )
        else:
            cur.execute(
                "DELETE FROM hist_f WHERE ctid = (SELECT ctid FROM hist_f WHERE a = %s LIMIT 1)",
                (rng.randrange(5),),
            )

    def transaction(self) -> None:
        rng = self.rng
        with self.conn.cursor() as cur:
            roll = rng.random()
            if roll < 0.04:
                cur.execute("TRUNCATE hist_k" if rng.random() < 0.5 else "TRUNCATE hist_k, hist_f")
            elif roll < 0.07:
                self.added += 1
                default = " DEFAULT 'fast'" if self.added % 2 else ""
                cur.execute(f"ALTER TABLE hist_k ADD COLUMN extra{self.added} text{default}")
            else:
                for _ in range(rng.randint(1, 3)):
                    self._statement(cur)
                if self.added and rng.random() < 0.3:
                    cur.execute(
                        f"UPDATE hist_k SET extra{self.added} = %s WHERE id IN "
                        "(SELECT id FROM hist_k ORDER BY random() LIMIT 2)",
                        (f"e{rng.randrange(10)}",),
                    )
            cur.execute("SELECT txid_current()")
            txid = cur.fetchone()[0]
        self.conn.commit()
        self.states.append((txid, self.snapshot()))

    def snapshot(self) -> Snapshot:
        out: Snapshot = {}
        with self.conn.cursor() as cur:
            for table in TABLES:
                cur.execute(f"SELECT * FROM {table}")
                names = tuple(d.name for d in cur.description)
                out[table] = (names, sorted(cur.fetchall(), key=repr))
        self.conn.commit()
        return out


def _history(output: Path, table: str) -> Any:
    from deltalake import DeltaTable

    return DeltaTable(str(output / f"public.{table}" / "_history")).to_pyarrow_table()


@pytest.mark.parametrize(
    ("stretch", "restart"),
    [(15, False), pytest.param(35, True, marks=pytest.mark.slow)],
    ids=["fast", "restarts"],
)
def test_history_is_the_table_at_every_commit(
    stretch: int,
    restart: bool,
    pg: PgDatabase,
    broker: LocalBroker,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirror_once: Callable[..., float],
    mirrors: Callable[..., MirrorProcess],
    tmp_path: Path,
) -> None:
    from cdcd.spark.history import valid_at

    pg.execute(SETUP)
    config = cdc_config(
        tables=[f"public.{t}" for t in TABLES],
        extra={"snapshot": {"mode": "initial"}, "schema_changes": {"resnapshot": "never"}},
    )
    capture = start_capture(pg, config, daemons)
    daemon = capture.daemon

    workload = Workload(pg, random.Random(SEED))
    output = tmp_path / "mirror"
    for run in range(3):
        for _ in range(stretch):
            workload.transaction()
        capture.confirmed()
        if restart and run == 1:  # a Spark restart: its own process
            process = mirrors(config, output, once=True, history=True)
            assert process.wait(600) == 0, process.log()
        else:
            mirror_once(config, output, history=True)
    assert daemon.terminate() == 0, daemon.log()

    commits: dict[int, int] = {}
    for change in read_changes(broker.bootstrap_servers, pg.dbname):
        if change.value is not None and not change.value["source"]["snapshot"]:
            commits[change.value["source"]["txId"]] = change.lsn
    histories = {table: _history(output, table) for table in TABLES}
    checked = 0
    for txid, state in workload.states:
        lsn = commits.get(txid)
        if lsn is None:
            continue  # DDL: nothing reached Kafka
        for table, (names, rows) in state.items():
            valid = valid_at(histories[table], lsn)
            have = sorted(
                (tuple(r.get(n) for n in names) for r in valid.to_pylist()), key=repr
            )
            assert have == rows, f"{table} at commit {lsn:X} (txid {txid}, seed {SEED})"
        checked += 1
    print(f"seed {SEED}: {checked} commits checked")
    # Most transactions wrote changes.
    assert checked >= 2 * stretch, (sorted(commits)[:5], [t for t, _ in workload.states][:5])
