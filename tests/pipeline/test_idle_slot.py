"""Idle slots do not pin WAL: confirmation advances with no captured changes.

Writes go only to a table outside the publication and to another database;
keepalives (nothing in flight) must keep the slot's ``confirmed_flush_lsn``
moving, with heartbeats switched off too (so each mechanism is shown alone).
"""

from __future__ import annotations

import time

import pytest
from support.cdc import wait_streaming
from support.pg import slot_confirmed_flush_lsn

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("heartbeat_s", [0, 2], ids=["keepalives-only", "with-heartbeats"])
def test_confirmed_flush_advances_without_captured_changes(
    heartbeat_s: float, pg, pg_cluster, cdc_config, daemons
) -> None:
    conn = pg.connect()
    conn.cursor().execute("CREATE TABLE captured(id int PRIMARY KEY); CREATE TABLE other(id int)")
    daemon = daemons(cdc_config(tables=["public.captured"],
                                extra={"heartbeat": {"interval_s": heartbeat_s}}))
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot)
    other_db = f"{pg.dbname}_other"[:60]
    pg_cluster.create_database(other_db)
    try:
        start = slot_confirmed_flush_lsn(conn, slot)
        positions = []
        for i in range(8):
            conn.cursor().execute("INSERT INTO other SELECT generate_series(1, 200)")
            pg_cluster.execute(f"CREATE TABLE IF NOT EXISTS x{i}(v int); INSERT INTO x{i} "
                               "SELECT generate_series(1, 500)", dbname=other_db)
            time.sleep(1)
            positions.append(slot_confirmed_flush_lsn(conn, slot))
            if len(set(positions)) >= 3:
                break  # moved three times already: more samples would prove no more
        assert positions[-1] > start, f"confirmed_flush_lsn stuck at {start}"
        assert len(set(positions)) >= 3, f"confirmation moved too rarely: {positions}"
        assert positions == sorted(positions)
    finally:
        pg_cluster.drop_database(other_db)
    assert daemon.terminate() == 0, daemon.log()
