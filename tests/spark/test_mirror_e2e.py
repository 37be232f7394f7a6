"""End to end: PostgreSQL -> daemon -> broker -> ``cdcd mirror --once`` -> Parquet == tables.

A seeded random workload over tables with every SPEC §5 type and arrays
(:mod:`spark.alltypes`), with the daemon killed with SIGKILL mid-stream
(twice), so the topics hold replayed duplicates. ``cdcd mirror --once`` runs
twice as a child process: after the first stretch, then after
``ALTER TABLE ... ADD COLUMN``, more changes, ``DROP COLUMN``, a
``TRUNCATE`` and more changes -- so the second run applies to an existing
mirror, evolves its schema and resumes from its checkpoint. After each run
every table's Parquet equals the source table, row for row and value for
value, read with pyarrow and compared typed with a psycopg2 SELECT.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from support.cdc import DaemonProcess, read_changes, wait_for
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

from spark.alltypes import KEYS, TypesWorkload, differences, mirror_rows

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pa = pytest.importorskip("pyarrow")

TABLES = tuple(KEYS)


def _write_with_a_crash(
    pg: PgDatabase,
    workload: TypesWorkload,
    transactions: int,
    daemon: DaemonProcess,
    start_daemon: Callable[[], DaemonProcess],
    kill_after_s: float,
) -> DaemonProcess:
    """Run ``transactions`` in a thread; SIGKILL and restart the daemon meanwhile."""
    conn = pg.connect()
    conn.autocommit = False
    done = threading.Event()
    failure: list[psycopg2.Error] = []

    def write() -> None:
        try:
            for _ in range(transactions):
                workload.transaction(conn)
                time.sleep(0.004)
        except psycopg2.Error as exc:  # reported by the test thread
            failure.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    time.sleep(kill_after_s)
    daemon.kill9()
    daemon = start_daemon()
    writer.join(120)
    assert done.is_set(), "the workload did not finish"
    if failure:
        raise failure[0]
    return daemon


def _wait_confirmed(pg: PgDatabase, slot: str) -> None:
    conn = pg.connect()
    target = current_wal_lsn(conn)
    wait_for(
        lambda: slot_confirmed_flush_lsn(conn, slot) >= target,
        timeout_s=120,
        what="the daemon to confirm the whole workload",
    )


def _mirror_once(mirrors: Callable[..., Any], config: Path, output: Path) -> float:
    started = time.monotonic()
    process = mirrors(config, output, once=True)
    code = process.wait(300)
    assert code == 0, process.log()
    return time.monotonic() - started


def _assert_mirrored(pg: PgDatabase, output: Path) -> None:
    conn = pg.connect()
    problems = [p for table in TABLES for p in differences(conn, output, table)]
    assert not problems, "\n".join(problems)


def test_mirror_once_equals_every_table(
    pg: PgDatabase,
    broker: Any,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirrors: Callable[..., Any],
    tmp_path: Path,
) -> None:
    conn = pg.connect()
    workload = TypesWorkload(seed=20261121)
    workload.create(conn)
    config = cdc_config(tables=[f"public.{t}" for t in TABLES])
    slot = "cdcd_" + pg.dbname[:50]
    output = tmp_path / "mirror"

    def start() -> DaemonProcess:
        return daemons(config)

    daemon = start()
    wait_for(
        lambda: pg.fetchall(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
        ),
        what="the daemon to start streaming",
    )

    # Stretch 1: every type, unchanged TOAST, key changes, a crash.
    daemon = _write_with_a_crash(pg, workload, 150, daemon, start, kill_after_s=0.8)
    _wait_confirmed(pg, slot)
    first_s = _mirror_once(mirrors, config, output)
    _assert_mirrored(pg, output)

    # Stretch 2: the schema changes, a truncate, another crash.
    writer = pg.connect()
    writer.autocommit = False
    workload.add_columns(conn)
    workload.run(writer, 20)
    daemon = _write_with_a_crash(pg, workload, 80, daemon, start, kill_after_s=0.5)
    workload.drop_columns(conn)
    workload.run(writer, 20)
    workload.truncate_events(conn)
    workload.run(writer, 40)
    workload.touch_all_tables(writer)
    _wait_confirmed(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    second_s = _mirror_once(mirrors, config, output)
    _assert_mirrored(pg, output)

    # The run really had duplicates to cope with, and every kind of statement.
    prefix = pg.dbname
    positions = Counter(
        (c.topic, c.lsn, c.seq)
        for c in read_changes(
            broker.bootstrap_servers, prefix, [f"{prefix}.public.{t}" for t in TABLES]
        )
    )
    duplicates = sum(n - 1 for n in positions.values() if n > 1)
    for statement in ("kitchen update, doc unchanged", "kitchen primary key change", "logbook update",
                      "logbook delete", "arrays delete", "truncate"):  # fmt: skip
        assert workload.statements.get(statement, 0) > 0, workload.statements

    _, _, schema = mirror_rows(output, "kitchen")
    types = {name: schema.field(name).type for name in schema.names}
    assert types["c_timestamptz"] == pa.timestamp("us", tz="UTC")
    assert types["c_timestamp"] == pa.timestamp("us")
    assert types["c_date"] == pa.date32()
    assert types["c_time"] == pa.int64()
    assert types["c_numeric"] == pa.decimal128(12, 2)
    assert types["c_numeric_wide"] == pa.string()  # more digits than Spark's decimal holds
    assert types["c_float4"] == pa.float32()
    assert types["c_bytea"] == pa.binary()
    assert "c_money" not in types and types["extra_n"] == pa.int64()
    _, _, array_schema = mirror_rows(output, "arrays")
    assert array_schema.field("a_grid").type == pa.list_(pa.list_(pa.int32()))
    assert array_schema.field("a_numeric").type == pa.list_(pa.decimal128(10, 3))
    print(
        f"statements={dict(workload.statements)} duplicates={duplicates} "
        f"mirror runs: {first_s:.1f} s, {second_s:.1f} s"
    )
    assert duplicates > 0, "the kills left no duplicates: the test did not exercise de-duplication"
