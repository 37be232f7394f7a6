"""A daemon capturing a test's database, for the Spark end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.cdc import DaemonProcess, wait_for, wait_streaming
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn


@dataclass
class Capture:
    """A daemon streaming from ``pg`` on the slot of ``cdc_config``'s default."""

    daemon: DaemonProcess
    conn: Any
    slot: str

    def confirmed(self) -> None:
        """Wait until the daemon confirmed everything written so far (it is in Kafka)."""
        target = current_wal_lsn(self.conn)
        wait_for(
            lambda: slot_confirmed_flush_lsn(self.conn, self.slot) >= target, what="confirmation"
        )


def start_capture(
    pg: PgDatabase, config: Path, daemons: Callable[[Path], DaemonProcess]
) -> Capture:
    """Start a daemon on ``config`` and wait until its slot is active."""
    conn = pg.connect()
    conn.autocommit = True
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(config)
    wait_streaming(pg, slot, daemon)
    return Capture(daemon, conn, slot)
