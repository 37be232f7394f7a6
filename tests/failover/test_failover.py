"""PostgreSQL 17 failover slots: ``cdcd check`` on the standby setup, and a promotion.

Each test builds a primary and a physical standby (tests/failover/standby.py).
The daemon's DSN lists both (``target_session_attrs=read-write``); with
``postgres.failover: true`` its slot is a failover slot that the standby
synchronizes. The primary is stopped with ``-m immediate`` in the middle of a
workload and the standby promoted: the daemon must reconnect by itself to
the new primary, find the synchronized slot there and go on from it. The
replayed topics must then equal the new primary's tables: nothing that
reached the standby is missing, and nothing the standby never got was
published (``synchronized_standby_slots`` holds cdcd back until the standby
has the WAL).
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from typing import Any

import psycopg2
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
from support.pg import PgDatabase, require_version
from support.workload import KEYS, Workload, table_rows

from cdcd.tools.local.postgres import LocalPostgres

from .standby import build_standby, standby_settings

pytestmark = pytest.mark.integration

TABLES = ("accounts", "items", "ledger")
SLOT = "cdcd_failover"


@pytest.fixture(autouse=True)
def _needs_17() -> None:
    require_version(17)


def _dsn(primary: LocalPostgres, standby: LocalPostgres) -> str:
    return (
        f"host={primary.host},{standby.host} port={primary.port},{standby.port} dbname=app "
        "user=postgres target_session_attrs=read-write"
    )


def _synced(primary: LocalPostgres, standby: LocalPostgres, db: PgDatabase) -> bool:
    """Whether the standby holds a persistent synchronized copy of the slot.

    The copy stays temporary until the primary's slot moves past where the
    standby's copy began, which takes a running-xacts record (the background
    writer logs one every 15 s) and then a round of the slot sync worker
    (which sleeps up to 30 s while nothing changes). Each poll here logs the
    record and wakes the worker (a configuration reload sets its latch), so
    the wait is not those timers'.
    """
    if db.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s "
                   "AND synced AND NOT temporary", (SLOT,)):
        return True
    primary.execute("SELECT pg_log_standby_snapshot()")
    standby.execute("SELECT pg_reload_conf()")
    return False


def _check(config: Any) -> list[str]:
    result = run_cdcd("check", "-c", str(config))
    print(result.stdout)  # the output docs/failover.md quotes
    return result.stdout.splitlines()


def _normalize(rows: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    # numeric without a typmod (ledger.amount) travels as its exact text
    return {
        key: {c: Decimal(v) if c == "amount" and isinstance(v, str) else v for c, v in row.items()}
        for key, row in rows.items()
    }


def test_check_says_what_the_standby_setup_lacks(make_pg_cluster, broker, tmp_path) -> None:
    primary = make_pg_cluster(version=17)
    primary.create_database("app")
    # Streams through a slot, but none of what slot synchronization needs.
    standby = build_standby(make_pg_cluster, primary, "sb1", {
        "primary_conninfo": f"host={primary.host} port={primary.port} user=postgres",
        "primary_slot_name": "sb1",
    })
    config = write_config(
        tmp_path / "cdcd.yaml", _dsn(primary, standby), broker.bootstrap_servers, slot=SLOT,
        postgres={"failover": True, "protocol_version": 4},
    )
    failed = [line for line in _check(config) if line.startswith("FAIL failover")]
    where = f"{standby.host}:{standby.port}"
    expected = [
        "FAIL failover: synchronized_standby_slots is empty on the primary",
        f"FAIL failover: standby {where}: sync_replication_slots is off",
        f"FAIL failover: standby {where}: hot_standby_feedback is off",
        f"FAIL failover: standby {where}: its slot sb1 is not in the primary's "
        "synchronized_standby_slots",
        f"FAIL failover: standby {where}: primary_conninfo names no dbname",
    ]
    for start in expected:
        assert sum(line.startswith(start) for line in failed) == 1, (start, failed)
    assert len(failed) == len(expected), failed
    assert "synchronized_standby_slots = 'sb1'" in failed[0]

    for name, value in standby_settings(primary, "sb1", "app").items():
        standby.set_setting(name, value)
    primary.set_setting("synchronized_standby_slots", "sb1")
    lines = _check(config)
    assert not [line for line in lines if line.startswith("FAIL failover")], lines
    assert f"ok   failover: standby {where}: ready to synchronize slot {SLOT} once it is a " \
        "failover slot" in lines, lines


def test_promotion_to_a_synchronized_standby(make_pg_cluster, broker, daemons, tmp_path) -> None:
    started = time.monotonic()
    primary = make_pg_cluster(version=17)
    primary.create_database("app")
    standby = build_standby(make_pg_cluster, primary, "sb1", standby_settings(primary, "sb1", "app"))
    # Set after the copy, on the primary only (see standby.py).
    primary.set_setting("synchronized_standby_slots", "sb1")
    old = PgDatabase(cluster=primary, dbname="app")
    workload = Workload(seed=17)
    workload.create(old.connect())
    workload.run(old.connect(), 30)
    dsn = _dsn(primary, standby)
    config = write_config(
        tmp_path / "cdcd.yaml", dsn, broker.bootstrap_servers, prefix="failover", slot=SLOT,
        tables=[f"public.{t}" for t in TABLES],
        postgres={"failover": True, "protocol_version": 4},
        # The initial snapshot's slot comes from the replication protocol:
        # cdcd turns it into a failover slot afterwards.
        extra={"snapshot": {"mode": "initial", "chunk_rows": 50}},
    )
    daemon = daemons(config)
    new = PgDatabase(cluster=standby, dbname="app")
    wait_for(lambda: old.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s "
                                  "AND active AND failover", (SLOT,)), what="a failover slot")
    wait_for(lambda: _synced(primary, standby, new), what="the slot synchronized to the standby")
    lines = _check(config)
    assert not [line for line in lines if line.startswith("FAIL failover")], lines
    assert f"ok   failover: standby {standby.host}:{standby.port}: slot {SLOT} synchronized " \
        "(confirmed" in "\n".join(lines), lines

    stop = threading.Event()
    failures: list[BaseException] = []
    on_new_primary = [0]

    def write() -> None:
        conn: Any = None
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                if conn is None or conn.closed:
                    conn = psycopg2.connect(dsn, connect_timeout=2)
                workload.transaction(conn)
                if conn.info.port == standby.port:
                    on_new_primary[0] += 1
                time.sleep(0.01)
            except (psycopg2.OperationalError, psycopg2.InterfaceError):
                # The primary went away mid-transaction: whether it committed
                # is for the standby to say; reconnect to whoever is primary.
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                failures.append(exc)
                return
        if conn is not None:
            conn.close()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        before = workload.committed
        wait_for(lambda: workload.committed >= before + 30, what="workload on the old primary")
        primary.stop("immediate")
        assert standby.execute("SELECT pg_promote()") == [(True,)]
        wait_streaming(new, SLOT, timeout_s=90)
        wait_for(lambda: on_new_primary[0] >= 30, what="workload on the new primary")
    finally:
        stop.set()
        writer.join(30)
    assert not failures, failures
    conn = new.connect()
    wait_wal_confirmed(conn, SLOT, timeout_s=60)
    assert daemon.alive(), daemon.log()
    assert daemon.terminate() == 0, daemon.log()
    assert "reconnecting" in daemon.log()

    for table in TABLES:
        changes = read_changes(broker.bootstrap_servers, "failover", [f"failover.public.{table}"])
        mirrored = _normalize(replay(changes, KEYS[table]))
        assert mirrored == _normalize(table_rows(conn, table)), f"{table}: replay differs"
    print(f"failover test: {time.monotonic() - started:.1f} s")
