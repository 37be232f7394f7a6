"""Streaming: ``cdcd mirror`` (no ``--once``) follows the tables while changes flow.

The mirror runs as a child process from the start; the seeded workload of
:mod:`spark.alltypes` (every type, unchanged TOAST, primary key changes, a
keyless table) writes for a while, with a TRUNCATE in the middle. Once the
writes stop and the daemon confirmed them, the Parquet mirrors must equal
the tables within ``CONVERGE_S``; then SIGTERM stops the mirror with exit 0.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, wait_for
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

from spark.alltypes import KEYS, TypesWorkload, differences

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TABLES = tuple(KEYS)
WRITE_S = 20.0
CONVERGE_S = 90.0


def test_streaming_mirror_converges_after_writes_stop(
    pg: PgDatabase,
    broker: Any,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirrors: Callable[..., Any],
    tmp_path: Path,
) -> None:
    conn = pg.connect()
    workload = TypesWorkload(seed=4242)
    workload.create(conn)
    config = cdc_config(tables=[f"public.{t}" for t in TABLES])
    slot = "cdcd_" + pg.dbname[:50]
    output = tmp_path / "mirror"
    daemon = daemons(config)
    wait_for(
        lambda: pg.fetchall(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
        ),
        what="the daemon to start streaming",
    )
    writer = pg.connect()
    writer.autocommit = False
    workload.run(writer, 20)

    mirror = mirrors(config, output, once=False)
    wait_for(
        lambda: (output / ".cdcd-mirror" / "state.json").exists() or not mirror.alive(),
        timeout_s=180,
        interval_s=0.5,
        what="the mirror's first batch",
    )
    assert mirror.alive(), mirror.log()
    started = time.monotonic()
    truncated = False
    while time.monotonic() - started < WRITE_S:
        workload.transaction(writer)
        if not truncated and time.monotonic() - started > WRITE_S / 2:
            workload.truncate_events(conn)
            truncated = True
        time.sleep(0.03)
    workload.touch_all_tables(writer)
    stopped = time.monotonic()
    target = current_wal_lsn(conn)
    wait_for(
        lambda: slot_confirmed_flush_lsn(conn, slot) >= target, timeout_s=60, what="confirmation"
    )
    assert mirror.alive(), mirror.log()

    last: list[str] = []

    def converged() -> bool:
        try:
            last[:] = [p for table in TABLES for p in differences(conn, output, table)]
        except FileNotFoundError as exc:
            last[:] = [f"not mirrored yet: {exc}"]
        return not last

    deadline = stopped + CONVERGE_S
    while not converged():
        assert mirror.alive(), mirror.log()
        assert time.monotonic() < deadline, "mirror did not converge:\n" + "\n".join(last[:10])
        time.sleep(1.0)
    converge_s = time.monotonic() - stopped

    assert mirror.terminate(60) == 0, mirror.log()
    assert daemon.terminate() == 0, daemon.log()
    batches = len(re.findall(r"batch \d+: \d+ changes", mirror.log()))
    assert batches >= 3, mirror.log()  # it really streamed, in several micro-batches
    print(
        f"statements={sum(workload.statements.values())} batches={batches} "
        f"converged {converge_s:.1f} s after the writes stopped"
    )
