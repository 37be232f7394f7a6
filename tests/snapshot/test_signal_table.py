"""The signal table is created only when a feature needs it (issue 12).

A daemon that only streams adds nothing to the application's database; a
table that ``cdcd snapshot`` creates later is found by the running daemon
(no restart), and one dropped while cdcd runs is waited for again.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support.cdc import PROJECT_ROOT
from support.pg import create_publication, create_slot

from .helpers import (
    create_orders,
    mirrored,
    signal_row,
    table_state,
    topic_changes,
    wait_caught_up,
    wait_streaming,
    when,
)

pytestmark = pytest.mark.integration


def request(config, table: str) -> str:
    result = subprocess.run([sys.executable, "-m", "cdcd", "snapshot", "-c", str(config), "--table", table],
                            capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"requested incremental snapshot (\S+) of", result.stdout)
    assert match, result.stdout
    return match.group(1)


def signal_tables(pg) -> int:
    return int(pg.fetchone("SELECT count(*) FROM pg_class WHERE relname = 'cdcd_signal'")[0])


def test_streaming_creates_no_signal_table_and_a_requested_snapshot_still_runs(
    pg, broker, cdc_config, daemons
) -> None:
    rows = 3_000
    conn = pg.connect()
    create_orders(conn, rows)
    slot = "cdcd_" + pg.dbname[:50]
    config = cdc_config(tables=["public.orders"], snapshot={"mode": "never", "chunk_rows": 500},
                        extra={"schema_changes": {"resnapshot": "never"}})
    daemon = daemons(config)
    wait_streaming(pg, slot, daemon=daemon)
    pg.execute("UPDATE orders SET status = 'x' WHERE id <= 5")
    wait_caught_up(pg, slot)
    assert signal_tables(pg) == 0, "cdcd run with snapshot.mode never created the signal table"
    when(lambda: "incremental snapshots are unavailable until 'cdcd snapshot' creates it"
         in daemon.log(), what="the daemon to say it has no signal table")

    # `cdcd snapshot` creates it; the running daemon finds it and takes the snapshot.
    first = request(config, "public.orders")
    assert signal_tables(pg) == 1
    when(lambda: (signal_row(pg, first) or ("",))[0] == "done", what="the requested snapshot")
    assert "found the snapshot signal table public.cdcd_signal" in daemon.log()

    # Dropped while cdcd runs: it notices, keeps streaming, and finds it again.
    pg.execute("DROP TABLE cdcd_signal")
    when(lambda: "the snapshot signal table public.cdcd_signal is gone" in daemon.log(),
         what="the daemon to notice the dropped table")
    pg.execute("UPDATE orders SET status = 'y' WHERE id <= 3")
    second = request(config, "public.orders")
    when(lambda: (signal_row(pg, second) or ("",))[0] == "done", what="the second snapshot")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()

    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert len([c for c in changes if c.value and c.value["op"] == "r"]) == 2 * rows
    assert mirrored(changes) == table_state(conn, "orders")


def test_an_existing_slot_with_mode_initial_creates_no_signal_table(pg, broker, cdc_config, daemons) -> None:
    """No initial snapshot is taken of a slot cdcd did not create, so nothing needs the table."""
    conn = pg.connect()
    create_orders(conn, 10)
    slot = "cdcd_" + pg.dbname[:50]
    create_publication(conn, "cdcd", ["public.orders"])
    create_slot(conn, slot)
    daemon = daemons(cdc_config(tables=["public.orders"], snapshot={"mode": "initial"},
                                extra={"schema_changes": {"resnapshot": "never"}}))
    wait_streaming(pg, slot, daemon=daemon)
    pg.execute("UPDATE orders SET status = 'x' WHERE id = 1")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    assert signal_tables(pg) == 0
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert [c.value["op"] for c in changes if c.value] == ["u"]
