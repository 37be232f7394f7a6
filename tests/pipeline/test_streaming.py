"""Protocol v2 streamed transactions (``logical_decoding_work_mem=64kB``).

PostgreSQL sends large transactions before they commit. cdcd buffers them
(spilling to a file past ``stream_spill_bytes``, set tiny here so spilling
happens) and publishes only at Stream Commit: an aborted streamed
transaction publishes nothing, a rolled-back savepoint inside one publishes
nothing of its rows, and a small transaction committing in the middle of a
stream is published in its own commit order. That the open transactions
really spilled is checked (``cdcd_spill_bytes`` and a spill file held open in
``spill_dir``), and that the files are gone afterwards.
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest
from support.cdc import (
    DaemonProcess,
    read_changes,
    wait_for,
    wait_streaming,
    wait_wal_confirmed,
    write_config,
)

pytestmark = pytest.mark.integration

ROWS = 20_000


def _spilled_bytes(daemon: DaemonProcess) -> float:
    """The daemon's ``cdcd_spill_bytes`` gauge, scraped from its /metrics."""
    found = re.search(r"serving /metrics.* listen=(\S+)", daemon.log())
    if found is None:
        return -1.0  # not serving yet
    with urllib.request.urlopen(f"http://{found.group(1)}/metrics", timeout=10) as response:
        text = response.read().decode()
    value = re.search(r"^cdcd_spill_bytes (\S+)$", text, re.MULTILINE)
    assert value is not None, "no cdcd_spill_bytes gauge"
    return float(value.group(1))


def _spill_files(daemon: DaemonProcess, spill_dir: Path) -> list[str]:
    """Files in ``spill_dir`` the daemon holds open (spill files have no name: O_TMPFILE)."""
    held = []
    for fd in Path(f"/proc/{daemon.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith(str(spill_dir)):
            held.append(target)
    return held


def test_streamed_commit_abort_and_subtransaction_abort(make_pg_cluster, broker, tmp_path: Path) -> None:
    cluster = make_pg_cluster(settings={"logical_decoding_work_mem": "64kB"})
    cluster.create_database("app")
    conn = cluster.connect("app")
    conn.cursor().execute("CREATE TABLE t(id int PRIMARY KEY, kind text, pad text)")
    slot = "cdcd_stream"
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    config = write_config(
        tmp_path / "c.yaml", cluster.dsn("app"), broker.bootstrap_servers, prefix="stream", slot=slot,
        tables=["public.t"],
        postgres={"protocol_version": 2, "stream_spill_bytes": 200_000, "spill_dir": str(spill_dir)},
    )
    daemon = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        wait_streaming(cluster, slot)
        big = cluster.connect("app")
        big.autocommit = False
        cur = big.cursor()
        cur.execute("INSERT INTO t SELECT g, 'committed', repeat('x', 50) FROM generate_series(1, %s) g",
                    (ROWS,))
        cur.execute("SAVEPOINT s")
        cur.execute("INSERT INTO t SELECT g, 'undone', repeat('y', 50) FROM generate_series(%s, %s) g",
                    (ROWS + 1, 2 * ROWS))
        cur.execute("ROLLBACK TO SAVEPOINT s")
        # A small transaction commits while the big one is still open (and streamed).
        conn.cursor().execute("INSERT INTO t VALUES (-1, 'small', '')")
        cur.execute("UPDATE t SET kind = 'updated' WHERE id BETWEEN 1 AND 10")
        # Streamed before its commit, and spilled past stream_spill_bytes.
        wait_for(lambda: _spilled_bytes(daemon) > 200_000, timeout_s=120,
                 what="the open streamed transaction to spill")
        assert _spill_files(daemon, spill_dir), "spilled, but no spill file is open in spill_dir"
        big.commit()
        wait_for(lambda: _spilled_bytes(daemon) == 0, timeout_s=120,
                 what="the committed transaction's spill to be released")

        cur.execute("INSERT INTO t SELECT g, 'aborted', repeat('z', 50) FROM generate_series(%s, %s) g",
                    (3 * ROWS, 4 * ROWS))
        wait_for(lambda: _spilled_bytes(daemon) > 200_000, timeout_s=120,
                 what="the transaction that will abort to spill")
        big.rollback()
        conn.cursor().execute("INSERT INTO t VALUES (-2, 'last', '')")
        wait_wal_confirmed(conn, slot, timeout_s=120)
        wait_for(lambda: _spilled_bytes(daemon) == 0, timeout_s=60, what="the aborted spill released")
        assert _spill_files(daemon, spill_dir) == [], "a spill file is still open"
        assert daemon.terminate() == 0, daemon.log()
    finally:
        if daemon.alive():
            daemon.kill9()

    changes = read_changes(broker.bootstrap_servers, "stream", ["stream.public.t"], idle_s=3)
    kinds: dict[str, int] = {}
    for change in changes:
        kinds[change.value["after"]["kind"]] = kinds.get(change.value["after"]["kind"], 0) + 1
    assert kinds == {"committed": ROWS, "small": 1, "updated": 10, "last": 1}
    ordered = sorted(changes, key=lambda c: (c.lsn, c.seq))
    assert ordered[0].value["after"]["id"] == -1, "the small transaction committed first"
    big_lsns = {c.lsn for c in changes if c.value["after"]["kind"] in ("committed", "updated")}
    assert len(big_lsns) == 1
    assert [c.seq for c in ordered if c.lsn in big_lsns] == list(range(ROWS + 10))
    assert list(spill_dir.iterdir()) == []  # nothing left behind by name either
