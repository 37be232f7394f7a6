"""A table without a key is snapshotted in block ranges read side by side, each row once.

With no key to cut it by, a large keyless table is cut by physical position:
``ctid`` ranges of blocks, one per connection of the pool (PostgreSQL 14 and
later read just those blocks). Rows an update moves to another block during
the copy must still be read exactly once, as of the slot's consistent point:
visibility, not position, decides what each reader returns.

The table has ``REPLICA IDENTITY FULL`` so that its updates are published
(with their before images), and a column ``n`` that is unique by
construction and never updated, which the comparison uses as the row's
identity (PostgreSQL knows no key for it).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from .helpers import BackgroundWrites, topic_changes, wait_caught_up, wait_streaming

pytestmark = pytest.mark.integration

ROWS = 30_000


class Mover(BackgroundWrites):
    """Single-row updates that widen a row, so that its new version lands in another block."""

    def write(self, conn: Any) -> None:
        conn.autocommit = True
        rng = random.Random(11)
        with conn.cursor() as cur:
            count = 0
            while not self.stop.is_set():
                count += 1
                cur.execute(
                    "UPDATE events SET kind = %s, pad = repeat('y', 300) WHERE n = %s",
                    (f"moved-{count}", rng.randrange(1, ROWS + 1)),
                )


def _row(image: dict[str, Any]) -> tuple[Any, ...]:
    return image["n"], image["kind"], image["pad"]


def test_a_keyless_table_is_read_in_block_ranges_each_row_once(pg, broker, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE events(n int NOT NULL, kind text, pad text)")
    pg.execute("ALTER TABLE events REPLICA IDENTITY FULL")
    # Full pages (fillfactor 100): an update that widens a row cannot stay in its block.
    pg.execute(f"INSERT INTO events SELECT g, 'k', repeat('x', 60) FROM generate_series(1, {ROWS}) g")
    pg.execute("ANALYZE events")
    slot = "cdcd_" + pg.dbname[:50]
    mover = Mover(pg).start()
    daemon = daemons(
        cdc_config(tables=["public.events"], snapshot={"chunk_rows": 1_000, "parallelism": 3})
    )
    wait_streaming(pg, slot, timeout_s=600, daemon=daemon)
    mover.finish()
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    log = daemon.log()
    assert "table public.events has no primary key" in log, log
    assert "read in physical order (3 block ranges)" in log, log

    changes = topic_changes(broker.bootstrap_servers, pg.dbname, table="events")
    reads = [c for c in changes if c.value is not None and c.value["op"] == "r"]
    streamed = sorted(
        (c for c in changes if c.value is not None and c.value["op"] != "r"),
        key=lambda c: (c.lsn, c.seq),
    )
    assert sorted(c.value["after"]["n"] for c in reads) == list(range(1, ROWS + 1)), (
        "a row was read twice or not at all"
    )
    assert any(c.value["op"] == "u" for c in streamed), "no update after the consistent point"

    # Snapshot plus stream equal the table now.
    held = {c.value["after"]["n"]: _row(c.value["after"]) for c in reads}
    for change in streamed:
        value = change.value
        if value["op"] in ("u", "d"):
            held.pop(value["before"]["n"])
        if value["op"] in ("c", "u"):
            held[value["after"]["n"]] = _row(value["after"])
    now = {row[0]: tuple(row) for row in pg.fetchall("SELECT n, kind, pad FROM events")}
    assert held == now

    # And the snapshot is the table at the slot's point: now, with the stream undone.
    at_point = dict(now)
    for change in reversed(streamed):
        value = change.value
        if value["op"] in ("c", "u"):
            at_point.pop(value["after"]["n"])
        if value["op"] in ("u", "d"):
            at_point[value["before"]["n"]] = _row(value["before"])
    assert {c.value["after"]["n"]: _row(c.value["after"]) for c in reads} == at_point
