"""A lost slot stops the daemon with one line; ``cdcd resync`` brings consumers back.

The slot is pushed past ``max_slot_wal_keep_size`` while no daemon runs
(``pg_switch_wal`` and a checkpoint make the server give it up), after a gap
workload that inserts, updates and deletes. ``cdcd run`` must then exit 3
with one line naming the invalidation and ``cdcd resync`` -- never create a
new slot and skip the gap. After ``cdcd resync`` and a new ``cdcd run``
(with the workload going on), replaying each topic in (``cdcd.lsn``,
``cdcd.seq``) order equals the table: rows deleted during the gap are gone
too (the resync's truncate), every other row came back (``op=r``).
"""

from __future__ import annotations

import json
import urllib.request
from decimal import Decimal
from typing import Any

import pytest
from support.cdc import (
    read_changes,
    replay,
    run_cdcd,
    wait_for,
    wait_streaming,
    wait_wal_confirmed,
    write_config,
)
from support.pg import PgDatabase
from support.workload import KEYS, Workload, table_rows

from cdcd.tools.local.postgres import free_port

pytestmark = pytest.mark.integration

TABLES = ("accounts", "items", "ledger")


def _normalize(rows: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    # numeric without a typmod (ledger.amount) travels as its exact text
    return {
        key: {c: Decimal(v) if c == "amount" and isinstance(v, str) else v for c, v in row.items()}
        for key, row in rows.items()
    }


def _metric(port: int, series: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    return -1.0


def _job(db: PgDatabase, job_id: str) -> str | None:
    row = db.fetchone("SELECT status FROM cdcd_signal WHERE id = %s", (job_id,))
    return None if row is None else str(row[0])


def test_invalidated_slot_stops_run_and_resync_restores_equality(
    make_pg_cluster, broker, daemons, tmp_path
) -> None:
    cluster = make_pg_cluster(settings={"max_slot_wal_keep_size": "1MB"})
    cluster.create_database("app")
    db = PgDatabase(cluster=cluster, dbname="app")
    conn = db.connect()
    workload = Workload(seed=14)
    workload.create(conn)
    workload.run(conn, 40)
    slot, prefix = "lossy", "lossy"
    port = free_port()
    config = write_config(
        tmp_path / "cdcd.yaml", db.dsn, broker.bootstrap_servers, prefix=prefix, slot=slot,
        tables=[f"public.{t}" for t in TABLES],
        extra={
            "snapshot": {"mode": "initial", "chunk_rows": 20},
            "metrics": {"listen": f"127.0.0.1:{port}", "lag_sample_interval_s": 0.2},
        },
    )
    daemon = daemons(config)
    wait_streaming(db, slot)
    workload.run(conn, 20)
    # The slot's state on the server, sampled with the lag.
    wait_for(lambda: _metric(port, "cdcd_slot_retained_wal_bytes") > 0, what="retained WAL")
    assert _metric(port, 'cdcd_slot_wal_status{status="reserved"}') == 1
    assert _metric(port, 'cdcd_slot_wal_status{status="lost"}') == 0
    assert _metric(port, "cdcd_slot_wal_keep_size_bytes") == 1024 * 1024
    wait_wal_confirmed(conn, slot)
    assert daemon.terminate() == 0, daemon.log()

    # The gap: changes no slot will ever stream, deletes among them.
    deleted = db.fetchall("SELECT id FROM accounts ORDER BY id LIMIT 5")
    db.execute("DELETE FROM accounts WHERE id = ANY(%s)", ([r[0] for r in deleted],))
    workload.run(conn, 30)
    for _ in range(4):  # past max_slot_wal_keep_size, then a checkpoint gives the slot up
        db.execute("INSERT INTO ledger(account, amount, memo) VALUES (0, 0, 'switch')")
        db.execute("SELECT pg_switch_wal()")
    db.execute("CHECKPOINT")
    assert db.fetchone("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)) == ("lost",)

    refused = daemons(config)
    assert refused.wait(60) == 3, refused.log()
    errors = [line for line in refused.log().splitlines() if line.startswith("cdcd: error")]
    assert len(errors) == 1, refused.log()
    assert f"replication slot {slot} was invalidated by PostgreSQL (wal_removed" in errors[0]
    assert "max_slot_wal_keep_size (1MB)" in errors[0] and "cdcd resync" in errors[0], errors[0]
    # Nothing was created in its place.
    assert db.fetchone("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)) == ("lost",)
    check = run_cdcd("check", "-c", str(config))
    assert f"FAIL slot {slot}: replication slot {slot} was invalidated" in check.stdout, check.stdout

    done = run_cdcd("resync", "-c", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"dropped slot {slot}: replication slot {slot} was invalidated" in done.stdout
    job_id = done.stdout.split("requested incremental snapshot ")[1].split()[0]
    assert db.fetchone("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)) == ("reserved",)

    daemon = daemons(config)
    with workload.writing(db.connect(), pause_s=0.02):
        wait_for(lambda: _job(db, job_id) == "done", timeout_s=120, what="the resync snapshot")
    wait_wal_confirmed(conn, slot)
    assert daemon.terminate() == 0, daemon.log()

    for table in TABLES:
        changes = read_changes(broker.bootstrap_servers, prefix, [f"{prefix}.public.{table}"])
        assert any(c.value and c.value["op"] == "t" for c in changes), table
        mirrored = _normalize(replay(changes, KEYS[table]))
        assert mirrored == _normalize(table_rows(conn, table)), f"{table}: replay differs"
    record = db.fetchone("SELECT data FROM cdcd_signal WHERE id = %s", (f"slot:{slot}",))
    assert record is not None
    data = record[0] if isinstance(record[0], dict) else json.loads(record[0])
    assert data["state"] == "in-use"


def test_a_dropped_slot_is_lost_not_created_again(pg, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 10) g")
    config = cdc_config(tables=["public.t"])
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(config)
    wait_streaming(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    pg.execute("SELECT pg_drop_replication_slot(%s)", (slot,))  # or a promotion without it

    refused = daemons(config)
    assert refused.wait(60) == 3, refused.log()
    errors = [line for line in refused.log().splitlines() if line.startswith("cdcd: error")]
    assert len(errors) == 1, refused.log()
    assert f"replication slot {slot} is missing on the server cdcd connected to" in errors[0]
    assert "but cdcd streamed from it before" in errors[0] and "cdcd resync" in errors[0]
    assert not pg.fetchall("SELECT 1 FROM pg_replication_slots")  # not created again
    check = run_cdcd("check", "-c", str(config))
    assert f"FAIL slot {slot}: replication slot {slot} is missing" in check.stdout, check.stdout

    done = run_cdcd("resync", "-c", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"created slot {slot}: the stream starts after "), done.stdout
    job_id = done.stdout.split("requested incremental snapshot ")[1].split()[0]
    daemon = daemons(config)
    wait_for(lambda: _job(pg, job_id) == "done", timeout_s=60, what="the resync snapshot")
    assert daemon.terminate() == 0, daemon.log()
