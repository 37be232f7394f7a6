"""ALTER TABLE while an incremental snapshot of the table runs.

Chunks are planned (column list) once per table; a column added while the
snapshot runs must not be missing from the chunks read after it: the stream
already carries the column's new values, and a chunk row published after
them without the column would make consumers read the column's default
instead. The chunk read checks the table's columns in its own transaction
and is read again with the new ones (``StalePlan``).
"""

from __future__ import annotations

import pytest

from .helpers import (
    Writer,
    create_orders,
    mirrored,
    table_state,
    topic_changes,
    wait_caught_up,
    wait_streaming,
    when,
)
from .test_incremental import job, request

pytestmark = pytest.mark.integration


def test_column_added_during_snapshot_is_in_every_later_chunk(pg, broker, cdc_config, daemons) -> None:
    rows = 20_000
    conn = pg.connect()
    create_orders(conn, rows)
    slot = "cdcd_" + pg.dbname[:50]
    config = cdc_config(tables=["public.orders"], snapshot={"mode": "never", "chunk_rows": 200})
    daemon = daemons(config)
    wait_streaming(pg, slot, daemon=daemon)
    writer = Writer(pg, rows, seed=11, pause_s=0.001).start()
    job_id = request(config, "public.orders")

    def saved_chunks() -> int:
        current = job(pg, job_id)[1].get("current") or {}
        return int(current.get("chunks") or 0)

    when(lambda: saved_chunks() >= 5, what="5 delivered chunks")
    pg.execute("ALTER TABLE orders ADD COLUMN c text DEFAULT 'x'")
    # Rows far ahead of the snapshot's position get a value other than the default.
    pg.execute("UPDATE orders SET c = 'y' WHERE id % 3 = 0")
    when(lambda: job(pg, job_id)[0] == "done", timeout_s=300, what="the snapshot job to finish")
    writer.finish()
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    assert "reading the chunk again with the new columns" in daemon.log()

    replayed = mirrored(topic_changes(broker.bootstrap_servers, pg.dbname))
    for row in replayed.values():
        row.setdefault("c", "x")  # what Avro resolution gives a record written before the column
    expected = table_state(conn, "orders")
    wrong = [(k, replayed.get(k, {}).get("c"), v["c"]) for k, v in expected.items()
             if replayed.get(k, {}).get("c") != v["c"]]
    assert not wrong, f"{len(wrong)} rows differ in c (key, got, PostgreSQL): {wrong[:5]}"
    assert replayed == expected
