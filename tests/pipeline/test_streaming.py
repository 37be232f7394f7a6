"""Protocol v2 streamed transactions (``logical_decoding_work_mem=64kB``).

PostgreSQL sends large transactions before they commit. cdcd buffers them
(spilling to a file past ``stream_spill_bytes``, set tiny here so spilling
happens) and publishes only at Stream Commit: an aborted streamed
transaction publishes nothing, a rolled-back savepoint inside one publishes
nothing of its rows, and a small transaction committing in the middle of a
stream is published in its own commit order.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.cdc import DaemonProcess, read_changes, wait_for, write_config
from support.pg import current_wal_lsn, slot_confirmed_flush_lsn

pytestmark = pytest.mark.integration

ROWS = 20_000


def test_streamed_commit_abort_and_subtransaction_abort(make_pg_cluster, broker, tmp_path: Path) -> None:
    cluster = make_pg_cluster(settings={"logical_decoding_work_mem": "64kB"})
    cluster.create_database("app")
    conn = cluster.connect("app")
    conn.cursor().execute("CREATE TABLE t(id int PRIMARY KEY, kind text, pad text)")
    slot = "cdcd_stream"
    config = write_config(
        tmp_path / "c.yaml", cluster.dsn("app"), broker.bootstrap_servers, prefix="stream", slot=slot,
        tables=["public.t"],
        postgres={"protocol_version": 2, "stream_spill_bytes": 200_000, "spill_dir": str(tmp_path)},
    )
    daemon = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        wait_for(lambda: cluster.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s "
                                         "AND active", (slot,), dbname="app"), what="streaming")
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
        time.sleep(1)
        big.commit()

        cur.execute("INSERT INTO t SELECT g, 'aborted', repeat('z', 50) FROM generate_series(%s, %s) g",
                    (3 * ROWS, 4 * ROWS))
        time.sleep(1)
        big.rollback()
        conn.cursor().execute("INSERT INTO t VALUES (-2, 'last', '')")
        target = current_wal_lsn(conn)
        wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, timeout_s=120, what="catch-up")
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
    assert list(tmp_path.glob("cdcd-spill-*")) == []
