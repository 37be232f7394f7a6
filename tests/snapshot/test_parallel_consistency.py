"""A snapshot read by several connections is one consistent point, whatever moves meanwhile.

The initial snapshot cuts ``orders`` into key ranges, one per connection of
its pool, each connection in a transaction of its own that imported the slot's
exported snapshot. During the copy, concurrent transactions move rows from
one range to another (a key change: ``id`` to a negative id, into the first
range, or beyond the largest id, into the last), and the usual writer
inserts, updates and deletes.

Afterwards, from what consumers hold (every message of the topic, replayed)
and a ``SELECT`` of the table:

* snapshot plus stream equal the table (no row missing, none left over);
* the snapshot reads hold each key once and equal the table *at the slot's
  consistent point*: the table now with every streamed change undone, in
  reverse order, from its before image (REPLICA IDENTITY FULL). A reader
  that took a snapshot of its own, later than the slot's, would read a row
  that moved into its range after the point under its new key as well: that
  row twice, which this comparison finds.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

import pytest

from cdcd.tools.local.process import pid_alive

from .helpers import (
    BackgroundWrites,
    Writer,
    create_orders,
    mirrored,
    normalize,
    table_state,
    topic_changes,
    wait_caught_up,
    wait_streaming,
)

pytestmark = pytest.mark.integration

ROWS = 20_000


class Mover(BackgroundWrites):
    """Transactions that each move one row into another reader's key range."""

    moved = 0

    def write(self, conn: Any) -> None:
        rng = random.Random(7)
        with conn.cursor() as cur:
            while not self.stop.is_set():
                source = rng.randrange(1, ROWS + 1)
                # Low keys go past the end (the last range), high ones below
                # zero (the first); both in one transaction, with another write.
                target = "-nextval('moved')" if source > ROWS // 2 else f"{10 * ROWS} + nextval('moved')"
                cur.execute("BEGIN")
                cur.execute(f"UPDATE orders SET id = {target} WHERE id = %s", (source,))
                cur.execute("UPDATE orders SET status = 'moved-with' WHERE id = %s",
                            (rng.randrange(1, ROWS + 1),))
                cur.execute("COMMIT")
                self.moved += cur.rowcount
                time.sleep(0.002)


def _at_point(now: dict[Any, dict[str, Any]], streamed: list[Any]) -> dict[Any, dict[str, Any]]:
    """``now`` with every streamed change undone, latest first, from its before image."""
    state = dict(now)
    for change in sorted(streamed, key=lambda c: (c.lsn, c.seq), reverse=True):
        value = change.value
        if value["op"] in ("c", "u"):
            state.pop(value["after"]["id"], None)
        if value["op"] in ("u", "d"):
            state[value["before"]["id"]] = normalize(value["before"])
    return state


def worker_snapshots(log: str) -> dict[int, str]:
    """The snapshot each worker process reported, by pid (``snapshot.processes``)."""
    found = re.findall(r"snapshot worker \d+ \(pid (\d+)\) imported the snapshot: (\S+)", log)
    return {int(pid): seen for pid, seen in found}


@pytest.mark.parametrize("processes", [0, 3], ids=["threads", "processes"])
def test_parallel_readers_copy_one_point_while_rows_move_between_their_ranges(
    pg, broker, cdc_config, daemons, processes: int
) -> None:
    conn = pg.connect()
    create_orders(conn, ROWS)
    pg.execute("ALTER TABLE orders REPLICA IDENTITY FULL")
    pg.execute("CREATE SEQUENCE moved")
    slot = "cdcd_" + pg.dbname[:50]
    mover = Mover(pg).start()
    writer = Writer(pg, ROWS, seed=3).start()
    daemon = daemons(
        cdc_config(
            tables=["public.orders"],
            snapshot={"chunk_rows": 500, "parallelism": 3, "processes": processes},
        )
    )
    wait_streaming(pg, slot, timeout_s=600, daemon=daemon)
    moved_during = mover.moved
    mover.finish()
    writer.finish()
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    log = daemon.log()
    assert "with 3 connections" in log, log
    if processes:
        # Every worker's transaction reports one and the same snapshot.
        seen = worker_snapshots(log)
        assert len(seen) == 3 and len(set(seen.values())) == 1, log

    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    now = table_state(conn, "orders")
    assert mirrored(changes) == now  # snapshot + stream = SELECT

    reads = [c for c in changes if c.value is not None and c.value["op"] == "r"]
    keys = [c.value["after"]["id"] for c in reads]
    assert len(keys) == len(set(keys)), "a row was read twice"
    # One cdcd.seq counter over every reader (thread or process): unique, no gap.
    assert sorted(c.seq for c in reads) == list(range(len(reads)))
    assert len({c.lsn for c in reads}) == 1
    streamed = [c for c in changes if c.value is not None and c.value["op"] != "r"]
    moves = [c for c in streamed if c.value["op"] == "c" and c.value["after"]["id"] < 0 or
             c.value["op"] == "c" and c.value["after"]["id"] > 10 * ROWS]
    assert moves, f"no row moved between ranges after the consistent point ({moved_during} moved)"
    snapshot = {c.value["after"]["id"]: normalize(c.value["after"]) for c in reads}
    assert snapshot == _at_point(now, streamed), "the snapshot is not the table at the slot's point"


def test_a_worker_process_that_does_not_import_the_snapshot_fails_it(
    pg, broker, cdc_config, daemons
) -> None:
    """Worker 1 skips ``SET TRANSACTION SNAPSHOT`` (a fault point) while commits go on:
    its own snapshot is later than the slot's, and the daemon refuses to let it
    read, exits 3 naming it, and leaves no worker process behind."""
    conn = pg.connect()
    create_orders(conn, 2_000)
    writer = Writer(pg, 2_000, seed=5).start()
    daemon = daemons(
        cdc_config(tables=["public.orders"], snapshot={"processes": 2}),
        hooks={"cdcd.snapshot.workers.FAULT_NO_IMPORT_WORKER": 1},
    )
    code = daemon.wait(120)
    writer.finish()
    log = daemon.log()
    assert code == 3, log
    assert re.search(r"snapshot worker 1 \(pid \d+\) does not hold the slot's exported snapshot", log), log
    pids = [int(p) for p in re.findall(r"snapshot worker \d \(pid (\d+)\)", log)]
    assert pids and not any(pid_alive(pid) for pid in pids), log


def test_a_failing_worker_process_fails_the_snapshot_naming_the_table(
    pg, broker, cdc_config, daemons
) -> None:
    """A row too large for the producer's ``message.max.bytes`` fails the worker
    that produces it: the daemon exits 3 naming the table, and no worker is left."""
    conn = pg.connect()
    create_orders(conn, 500)
    pg.execute("UPDATE orders SET note = repeat('x', 60000) WHERE id = 250")
    daemon = daemons(
        cdc_config(
            tables=["public.orders"],
            snapshot={"processes": 2},
            kafka={"producer": {"message.max.bytes": 30000}},
        )
    )
    code = daemon.wait(120)
    log = daemon.log()
    assert code == 3, log
    assert re.search(r"snapshot worker \d: snapshot of public\.orders: .*too large", log), log
    pids = [int(p) for p in re.findall(r"snapshot worker \d \(pid (\d+)\)", log)]
    assert pids and not any(pid_alive(pid) for pid in pids), log
