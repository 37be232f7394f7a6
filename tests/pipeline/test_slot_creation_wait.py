"""Creating the slot waits for open transactions: cdcd says for which, stays alive, stops on request.

A new logical slot (``pg_create_logical_replication_slot`` with
``snapshot.mode: never``, ``CREATE_REPLICATION_SLOT … SNAPSHOT 'export'``
with ``initial``) is usable only once every transaction that held an xid
when creation began has ended. Here an application transaction stays open
(``BEGIN; INSERT``) while ``cdcd run`` starts on a fresh slot: the daemon
must log the pid of that transaction, keep pinging the systemd watchdog and
extending its start timeout while it waits, and stream once it commits; a
SIGTERM during the wait must cancel the creation (no slot left behind) and
exit 0. A role without pg_read_all_stats still learns the blocking pids and
prepared transactions.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, read_changes, wait_for, wait_streaming

from cdcd.source.database import SourceDatabase

pytestmark = pytest.mark.integration

#: The daemons here report what the creation waits for every second, not every
#: 5 s (cdcd.source.slot_wait.SLOT_WAIT_LOG_INTERVAL_S, a test hook): the
#: first report, which each test waits for, comes 4 s sooner. The in-process
#: test below keeps the production interval (it counts the beats before it).
FAST_REPORTS = {"cdcd.source.slot_wait.SLOT_WAIT_LOG_INTERVAL_S": 1.0}

MODES = pytest.mark.parametrize(
    "snapshot_mode", ["never", "initial"], ids=["sql-function", "exported-snapshot"]
)


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET (short path: sun_path limit)."""
    directory = tempfile.mkdtemp(prefix="cdcd-notify-")
    path = str(Path(directory) / "n.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield path, sock
    finally:
        sock.close()
        shutil.rmtree(directory, ignore_errors=True)


def _hold_transaction(pg: Any) -> tuple[Any, int]:
    """An application session with an open transaction that holds an xid."""
    conn = pg.connect()
    conn.cursor().execute("SET application_name = 'long_txn_app'")
    conn.autocommit = False
    conn.cursor().execute("INSERT INTO t VALUES (1, 'held')")
    return conn, conn.get_backend_pid()


def _wait_line(daemon: DaemonProcess, slot: str, pid: int) -> str:
    def line() -> str | None:
        assert daemon.alive(), daemon.log()
        for text in daemon.log().splitlines():
            if f"creating slot {slot}: waiting" in text and f"pid {pid} (" in text:
                return text
        return None

    found: str = wait_for(line, timeout_s=60, what=f"a log line naming pid {pid}")
    return found


def _notifications(sock: socket.socket, pings: int, timeout_s: float = 30.0) -> list[str]:
    """sd_notify lines received until ``pings`` WATCHDOG=1 and an EXTEND_TIMEOUT_USEC arrived."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline and not (
        lines.count("WATCHDOG=1") >= pings
        and any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in lines)
    ):
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            lines += sock.recv(4096).decode().split("\n")
        except TimeoutError:
            break
    return lines


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.recv(4096)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)


@MODES
def test_slot_creation_names_the_open_transaction_then_streams(
    snapshot_mode: str, pg, broker, cdc_config, tmp_path: Path, notify_socket
) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    holder, holder_pid = _hold_transaction(pg)
    slot = "cdcd_" + pg.dbname[:50]
    prefix = pg.dbname
    config = cdc_config(tables=["public.t"], extra={"snapshot": {"mode": snapshot_mode}})
    path, sock = notify_socket
    daemon = DaemonProcess(
        config,
        tmp_path / "daemon.log",
        # A watchdog ping every second.
        env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"},
        hooks=FAST_REPORTS,
    )
    try:
        line = _wait_line(daemon, slot, holder_pid)
        assert "application 'long_txn_app'" in line, line
        assert "idle in transaction" in line, line
        assert "1 transaction that started before it" in line, line
        # Still waiting (the transaction is open), yet the watchdog keeps being
        # fed and systemd's start timeout extended (READY=1 comes after the slot).
        _drain(sock)
        lines = _notifications(sock, pings=3)
        assert lines.count("WATCHDOG=1") >= 3, (lines, daemon.log())
        assert "EXTEND_TIMEOUT_USEC=30000000" in lines, lines
        assert not any(line.startswith("READY=1") for line in lines), lines

        holder.commit()
        # Only a write after the slot exists is sure to be streamed: one that
        # begins while the creation is still finishing may land before the
        # slot's consistent point (seen as an empty topic, now and then).
        wait_streaming(pg, slot, timeout_s=60)
        pg.execute("INSERT INTO t VALUES (2, 'after')")
        expected = 2 if snapshot_mode == "initial" else 1  # the held row is in the snapshot
        changes = read_changes(
            broker.bootstrap_servers, prefix, [f"{prefix}.public.t"], expected=expected
        )
        rows = {(c.value["op"], c.value["after"]["v"]) for c in changes if c.value is not None}
        assert ("c", "after") in rows, (rows, daemon.log())
        if snapshot_mode == "initial":
            assert ("r", "held") in rows, rows
        assert daemon.terminate() == 0, daemon.log()
    finally:
        if daemon.alive():
            daemon.kill9()


@MODES
def test_stop_while_waiting_for_slot_creation_cancels_it(
    snapshot_mode: str, pg, cdc_config, daemons
) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    holder, holder_pid = _hold_transaction(pg)
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(cdc_config(tables=["public.t"], extra={"snapshot": {"mode": snapshot_mode}}),
                     hooks=FAST_REPORTS)
    _wait_line(daemon, slot, holder_pid)

    assert daemon.terminate(timeout_s=30) == 0, daemon.log()
    assert f"cancelling the creation of slot {slot}" in daemon.log()
    # The half-made slot is gone although the transaction is still open.
    assert not pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    assert holder.status == 2  # psycopg2.extensions.STATUS_IN_TRANSACTION
    holder.rollback()


def test_wait_report_names_prepared_and_hidden_transactions(
    pg, pg_cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A role without pg_read_all_stats still learns which pids and prepared transactions block."""
    role = f"r_{pg.dbname}"[:60]
    gid = f"gx_{pg.dbname}"[:60]
    pg.execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    pg_cluster.execute(f'CREATE ROLE "{role}" LOGIN REPLICATION')
    holder, holder_pid = _hold_transaction(pg)  # superuser's: details hidden from the role
    pg.execute(f"BEGIN; INSERT INTO t VALUES (3, 'prepared'); PREPARE TRANSACTION '{gid}'")
    db = SourceDatabase(pg.dsn_with(user=role))
    beats: list[float] = []
    outcome: list[object] = []
    worker = threading.Thread(
        target=lambda: outcome.append(
            db.ensure_slot("s_hidden", True, False, beat=lambda: beats.append(time.monotonic()))
        )
    )
    try:
        with caplog.at_level(logging.INFO, logger="cdcd.source"):
            worker.start()

            def line() -> str | None:
                for record in list(caplog.records):
                    text = record.getMessage()
                    if "creating slot s_hidden: waiting" in text and f"pid {holder_pid} (" in text:
                        return text
                return None

            text: str = wait_for(line, timeout_s=60, what="the wait report")
        assert "details hidden: grant pg_read_all_stats" in text, text
        assert "application 'long_txn_app'" in text, text
        assert f"prepared transaction '{gid}'" in text, text
        assert "COMMIT PREPARED or ROLLBACK PREPARED" in text, text
        assert "2 transactions that started before it" in text, text
        assert len(beats) >= 4, beats  # once a second while waiting
    finally:
        # Prepared transactions outlive sessions: never leave one behind.
        pg.execute(f"ROLLBACK PREPARED '{gid}'")
        holder.rollback()
        worker.join(60)
        db.close()
        pg.execute("SELECT pg_drop_replication_slot('s_hidden') "
                   "FROM pg_replication_slots WHERE slot_name = 's_hidden'")
        pg_cluster.execute(f'DROP ROLE "{role}"')
    assert outcome and outcome[0].name == "s_hidden"
