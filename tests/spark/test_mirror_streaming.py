"""Streaming: ``cdcd mirror`` (no ``--once``) follows the tables while changes flow.

The mirror runs from the start, in this process on the shared Spark session
(:func:`cdcd.spark.cli.run_mirror`, what the command runs after building its
session, signal handling included); the seeded workload of
:mod:`spark.alltypes` (every type, unchanged TOAST, primary key changes, a
keyless table) writes for a while from another thread, with a TRUNCATE in
the middle. Once the writes stop and the daemon confirmed them, the Delta
mirrors must equal the tables within ``CONVERGE_S``; then SIGTERM stops the
mirror between batches with exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, wait_for, wait_streaming
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

from spark.alltypes import KEYS, TypesWorkload, differences

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TABLES = tuple(KEYS)
WRITE_S = 8.0
CONVERGE_S = 90.0


class _Scenario(threading.Thread):
    """Writes, waits for the mirror to converge, then sends SIGTERM to this process."""

    def __init__(self, pg: PgDatabase, workload: TypesWorkload, slot: str, output: Path) -> None:
        super().__init__(daemon=True)
        self.pg, self.workload, self.slot, self.output = pg, workload, slot, output
        self.failure: BaseException | None = None
        self.converge_s = float("nan")
        self.last: list[str] = []

    def run(self) -> None:
        try:
            self._run()
        except (AssertionError, Exception) as exc:  # noqa: BLE001 -- re-raised by the test thread
            self.failure = exc
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    def _converged(self, conn: Any) -> bool:
        try:
            self.last = [p for table in TABLES for p in differences(conn, self.output, table)]
        except FileNotFoundError as exc:
            self.last = [f"not mirrored yet: {exc}"]
        return not self.last

    def _run(self) -> None:
        conn = self.pg.connect()
        writer = self.pg.connect()
        writer.autocommit = False
        wait_for(
            lambda: any(self.output.glob("public.*/_delta_log/*.json")),
            timeout_s=180,
            interval_s=0.5,
            what="the mirror's first batch",
        )
        started = time.monotonic()
        truncated = False
        while time.monotonic() - started < WRITE_S:
            self.workload.transaction(writer)
            if not truncated and time.monotonic() - started > WRITE_S / 2:
                self.workload.truncate_events(conn)
                truncated = True
            time.sleep(0.03)
        self.workload.touch_all_tables(writer)
        stopped = time.monotonic()
        target = current_wal_lsn(conn)
        wait_for(
            lambda: slot_confirmed_flush_lsn(conn, self.slot) >= target,
            timeout_s=60,
            what="confirmation",
        )
        deadline = stopped + CONVERGE_S
        while not self._converged(conn):
            assert time.monotonic() < deadline, "mirror did not converge:\n" + "\n".join(
                self.last[:10]
            )
            time.sleep(1.0)
        self.converge_s = time.monotonic() - stopped


def test_streaming_mirror_converges_after_writes_stop(
    pg: PgDatabase,
    broker: Any,
    spark: Any,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from cdcd.config.model import load_config
    from cdcd.spark.cli import run_mirror

    conn = pg.connect()
    workload = TypesWorkload(seed=4242)
    workload.create(conn)
    config = cdc_config(tables=[f"public.{t}" for t in TABLES])
    slot = "cdcd_" + pg.dbname[:50]
    output = tmp_path / "mirror"
    daemon = daemons(config)
    wait_streaming(pg, slot, daemon)
    writer = pg.connect()
    writer.autocommit = False
    workload.run(writer, 20)

    scenario = _Scenario(pg, workload, slot, output)
    # A SIGTERM arriving after run_mirror restored the handlers must not end pytest.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        scenario.start()
        with caplog.at_level(logging.INFO, logger="cdcd.spark.job"):
            code = run_mirror(load_config(config), output, once=False, spark=spark, interval_s=1.0)
        scenario.join(120)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if scenario.failure is not None:
        raise scenario.failure
    assert code == 0
    assert daemon.terminate() == 0, daemon.log()
    batches = [r for r in caplog.records if "changes to" in r.getMessage()]
    assert len(batches) >= 3  # it really streamed, in several micro-batches
    print(
        f"statements={sum(workload.statements.values())} batches={len(batches)} "
        f"converged {scenario.converge_s:.1f} s after the writes stopped"
    )
