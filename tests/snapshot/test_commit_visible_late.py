"""A commit the stream publishes before PostgreSQL makes it visible, then a chunk's read.

PostgreSQL writes and flushes a transaction's commit record, then (with a
synchronous standby) waits for the standby's reply, and only then makes the
transaction visible to other snapshots. The walsender decodes flushed WAL, so
cdcd can publish the transaction while every new snapshot still sees it in
progress. An incremental snapshot that starts then reads the rows as they
were before it: a chunk published after the stream's delete would bring the
deleted row back for consumers.

The test holds such a commit deterministically: ``synchronous_standby_names``
names a standby that never connects, and only the deleting session commits
with ``synchronous_commit = on`` (cdcd's own sessions commit locally). The
delete is streamed and acknowledged, the snapshot is requested, its chunk is
read (and must be read again while the commit is invisible), then the standby
setting is cleared, which lets the commit return; afterwards what consumers
hold must equal the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from support.cdc import (
    DaemonProcess,
    read_changes,
    replay,
    run_cdcd,
    wait_for,
    wait_streaming,
    write_config,
)
from synchronous.sync import Commit, synchronous

from cdcd.tools.local import LocalBroker, LocalPostgres

pytestmark = pytest.mark.integration

DB = "limbo"
SLOT = f"cdcd_{DB}"


REREAD = "did not yet see transaction"


def _status(cluster: LocalPostgres, job: str) -> str | None:
    rows = cluster.execute("SELECT status FROM cdcd_signal WHERE id = %s", (job,), dbname=DB)
    return str(rows[0][0]) if rows else None


def _confirmed_past(cluster: LocalPostgres, lsn: str) -> bool:
    rows = cluster.execute(
        "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
        (lsn, SLOT),
    )
    return bool(rows and rows[0][0])


def test_a_chunk_read_before_a_streamed_commit_is_visible_is_read_again(
    make_pg_cluster: Callable[..., LocalPostgres], broker: LocalBroker, tmp_path: Path
) -> None:
    cluster = make_pg_cluster()  # of its own: synchronous_standby_names is server-wide
    cluster.create_database(DB)
    cluster.execute("CREATE TABLE items(id int PRIMARY KEY, note text)", dbname=DB)
    cluster.execute("INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 300) g", dbname=DB)
    config = write_config(
        tmp_path / "cdcd.yaml", cluster.dsn(DB), broker.bootstrap_servers,
        prefix=DB, slot=SLOT, tables=["public.items"],
    )  # fmt: skip
    daemon = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        wait_streaming(cluster, SLOT, daemon)
        with synchronous(cluster, "nobody_connects"):
            commit = Commit(cluster.dsn(DB), "DELETE FROM items WHERE id = 134", mode="on")
            commit.wait_blocked(cluster)  # its commit record is flushed; it is not visible
            flushed = str(cluster.execute("SELECT pg_current_wal_flush_lsn()::text")[0][0])
            # The stream published the delete and Kafka acknowledged it.
            wait_for(lambda: _confirmed_past(cluster, flushed), timeout_s=60,
                     what="the delete to be confirmed")  # fmt: skip
            requested = run_cdcd("snapshot", "-c", str(config), "--table", "public.items")
            assert requested.returncode == 0, requested.stderr
            job = re.search(r"requested incremental snapshot (\S+) of", requested.stdout)
            assert job, requested.stdout
            # The chunk's read cannot see the delete yet: it must be read again
            # until it can (a chunk published now would bring row 134 back).
            wait_for(lambda: REREAD in daemon.log() or _status(cluster, job.group(1)) == "done",
                     timeout_s=120, what="the chunk to be read, then read again")  # fmt: skip
            assert cluster.execute("SELECT count(*) FROM items WHERE id = 134", dbname=DB)[0][0] == 1
        commit.returned()  # the setting's change released it
        commit.close()
        wait_for(lambda: _status(cluster, job.group(1)) == "done", timeout_s=120,
                 what="the snapshot job to finish")  # fmt: skip
        assert daemon.alive(), daemon.log()
        log = daemon.log()
    finally:
        daemon.kill9()
    rows = cluster.execute("SELECT id, note FROM items ORDER BY id", dbname=DB)
    changes = read_changes(broker.bootstrap_servers, DB, [f"{DB}.public.items"], timeout_s=120)
    held = replay(changes, ("id",))
    assert 134 not in {row["id"] for row in held.values()}, "the chunk brought a deleted row back"
    assert sorted((row["id"], row["note"]) for row in held.values()) == [tuple(r) for r in rows]
    assert REREAD in log, log
