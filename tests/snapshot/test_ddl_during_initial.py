"""DDL during the initial snapshot: the daemon keeps running, and consumers end equal.

Deterministic placement (default suite): the test holds a transaction with an
xid open, so ``CREATE_REPLICATION_SLOT`` waits for it; it freezes the daemon
there, commits, waits until the slot is consistent (its snapshot is exported
server-side), and only then migrates: every DDL commits after the snapshot's
consistent point and before the frozen daemon has read (or locked) anything.
Then the daemon is thawed. PostgreSQL reads a table through its current
files and columns even under the old snapshot, so without the lock-and-compare
step the rewritten table reads empty, the renamed column fails the read (the
daemon exited 3), and the dropped table failed planning.

The slow variant migrates a million-row table while the snapshot reads it
with two connections: the ALTER waits for the reader's lock, a second reader
would queue behind the ALTER, and nothing would end without the lock timeout
that hands the table over.
"""

from __future__ import annotations

import threading

import psycopg2
import pytest
from support.cdc import wait_for

from .helpers import create_orders, mirrored, table_state, topic_changes, wait_caught_up

pytestmark = pytest.mark.integration

READ_AS_IS = "orders_a"  # not migrated
REWRITTEN = "orders_b"  # ALTER COLUMN ... TYPE ... USING: new files
RENAMED = "orders_c"  # a planned column is gone
ADDED = "orders_d"  # a fast default: no rewrite, another column list
DROPPED = "orders_e"


def _wait_jobs_done(pg, daemon) -> None:
    def done() -> bool:
        assert daemon.alive(), f"the daemon exited ({daemon.proc.returncode}):\n{daemon.log()[-5000:]}"
        return not pg.fetchall(
            "SELECT 1 FROM cdcd_signal WHERE status IN ('pending', 'running') "
            "AND type IN ('execute-snapshot', 'initial')")

    wait_for(done, timeout_s=300, interval_s=0.2, what="every snapshot job to finish")


def _equal(pg, broker, conn, tables: list[str]) -> list[str]:
    wrong = []
    for name in tables:
        replayed = mirrored(topic_changes(broker.bootstrap_servers, pg.dbname, table=name))
        expected = table_state(conn, name)
        if replayed != expected:
            missing = len(set(expected) - set(replayed))
            differ = sum(1 for k in expected if k in replayed and replayed[k] != expected[k])
            wrong.append(f"public.{name}: {missing} rows missing from Kafka, {differ} differ, "
                         f"{len(set(replayed) - set(expected))} extra")
    return wrong


def test_ddl_after_the_consistent_point_before_the_read(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    tables = [READ_AS_IS, REWRITTEN, RENAMED, ADDED, DROPPED]
    for name in tables:
        create_orders(conn, 2_000, table=name)
    pg.execute("CREATE TABLE holdup(x int)")
    slot = "cdcd_" + pg.dbname[:50]
    blocker = pg.connect()
    blocker.autocommit = False
    with blocker.cursor() as cur:
        cur.execute("INSERT INTO holdup VALUES (1)")  # an xid: slot creation waits for it
    daemon = daemons(cdc_config(tables=[f"public.{t}" for t in tables],
                                snapshot={"chunk_rows": 500},
                                extra={"schema_changes": {"check_interval_s": 1}}))
    wait_for(lambda: pg.fetchall(
        "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'walsender' "
        "AND query LIKE 'CREATE_REPLICATION_SLOT%%' AND wait_event_type = 'Lock'"),
        timeout_s=120, what="the slot's creation to wait for the open transaction")
    daemon.freeze()
    blocker.commit()
    wait_for(lambda: pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s "
                                 "AND confirmed_flush_lsn IS NOT NULL", (slot,)),
             timeout_s=60, what="the slot to reach its consistent point")
    pg.execute(f"ALTER TABLE {REWRITTEN} ALTER COLUMN customer_id TYPE bigint "
               "USING customer_id * 10")
    pg.execute(f"ALTER TABLE {RENAMED} RENAME COLUMN note TO remark")
    pg.execute(f"ALTER TABLE {ADDED} ADD COLUMN region text DEFAULT 'eu'")
    pg.execute(f"DROP TABLE {DROPPED}")
    daemon.thaw()

    _wait_jobs_done(pg, daemon)
    pg.execute(f"UPDATE {READ_AS_IS} SET status = 'after' WHERE id <= 5")
    wait_caught_up(pg, slot)
    _wait_jobs_done(pg, daemon)
    wait_caught_up(pg, slot)
    log = daemon.log()
    assert daemon.alive(), log[-5000:]
    wrong = _equal(pg, broker, conn, tables[:-1])
    assert not wrong, "\n".join(wrong) + "\n" + log[-5000:]
    for name in (REWRITTEN, RENAMED, ADDED):
        assert f"initial snapshot of public.{name}: " in log and "snapshotted again" in log, log
    assert f"initial snapshot of public.{DROPPED}: dropped since the snapshot" in log, log
    assert f"initial snapshot of public.{READ_AS_IS}: " not in log, "read as it was: no hand-over"
    assert daemon.terminate() == 0, log[-5000:]


@pytest.mark.slow
def test_ddl_while_a_million_row_table_is_read(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    create_orders(conn, 1_000_000, table="orders")
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(cdc_config(tables=["public.orders"],
                                snapshot={"chunk_rows": 10_000, "parallelism": 2},
                                extra={"schema_changes": {"check_interval_s": 5}}))
    wait_for(lambda: pg.fetchall(
        "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'COPY (SELECT%%FROM \"public\".\"orders\"%%'"),
        timeout_s=300, interval_s=0.05, what="the snapshot to read orders")
    migrated: list[BaseException | None] = []

    def migrate() -> None:
        ddl = pg.connect()
        try:
            with ddl.cursor() as cur:  # waits for the snapshot's lock on orders
                cur.execute("ALTER TABLE orders ALTER COLUMN customer_id TYPE bigint "
                            "USING customer_id * 10")
            migrated.append(None)
        except psycopg2.Error as exc:
            migrated.append(exc)

    thread = threading.Thread(target=migrate, daemon=True)
    thread.start()
    thread.join(600)
    assert migrated == [None], f"the ALTER did not complete: {migrated}\n{daemon.log()[-5000:]}"
    _wait_jobs_done(pg, daemon)
    pg.execute("UPDATE orders SET status = 'after' WHERE id <= 5")
    wait_caught_up(pg, slot, timeout_s=600)
    _wait_jobs_done(pg, daemon)
    wait_caught_up(pg, slot, timeout_s=600)
    assert daemon.alive(), daemon.log()[-5000:]
    wrong = _equal(pg, broker, conn, ["orders"])
    assert not wrong, "\n".join(wrong) + "\n" + daemon.log()[-5000:]
    assert daemon.terminate() == 0, daemon.log()[-5000:]


@pytest.mark.slow
def test_a_second_reader_does_not_queue_behind_a_waiting_migration(
    pg, broker, cdc_config, daemons
) -> None:
    """Reader 1 holds the table's lock, a migration waits for it, reader 2 comes next.

    ``orders_a`` (one range) keeps reader 2 busy while reader 1 starts the
    first of ``orders_t``'s two ranges; the daemon is frozen there, the ALTER
    is queued, and the daemon thawed: reader 2 then wants ``orders_t`` behind
    the ALTER, which waits for reader 1's transaction, which ends only when
    the snapshot does. Without a bounded lock wait nothing ever ends.
    """
    conn = pg.connect()
    create_orders(conn, 50_000, table="orders_a")
    create_orders(conn, 400_000, table="orders_t")
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(cdc_config(tables=["public.orders_a", "public.orders_t"],
                                snapshot={"chunk_rows": 20_000, "parallelism": 2},
                                extra={"schema_changes": {"check_interval_s": 5}}))
    holders = ("SELECT count(DISTINCT pid) FROM pg_locks WHERE relation = 'orders_t'::regclass "
               "AND granted AND pid <> pg_backend_pid()")
    wait_for(lambda: pg.fetchone(holders)[0] >= 1, timeout_s=300, interval_s=0.01,
             what="a reader to lock orders_t")
    daemon.freeze()
    assert pg.fetchone(holders)[0] == 1, "premise: exactly one reader holds orders_t"
    migrated: list[BaseException | None] = []

    def migrate() -> None:
        ddl = pg.connect()
        try:
            with ddl.cursor() as cur:
                cur.execute("ALTER TABLE orders_t ALTER COLUMN customer_id TYPE bigint "
                            "USING customer_id * 10")
            migrated.append(None)
        except psycopg2.Error as exc:
            migrated.append(exc)

    thread = threading.Thread(target=migrate, daemon=True)
    thread.start()
    wait_for(lambda: pg.fetchall("SELECT 1 FROM pg_locks WHERE relation = 'orders_t'::regclass "
                                 "AND NOT granted AND mode = 'AccessExclusiveLock'"),
             timeout_s=60, what="the ALTER to wait for the reader's lock")
    daemon.thaw()
    thread.join(600)
    assert migrated == [None], f"the ALTER did not complete: {migrated}\n{daemon.log()[-5000:]}"
    _wait_jobs_done(pg, daemon)
    wait_caught_up(pg, slot, timeout_s=600)
    _wait_jobs_done(pg, daemon)
    wait_caught_up(pg, slot, timeout_s=600)
    log = daemon.log()
    assert "initial snapshot of public.orders_t: a migration holds or waits for its lock" in log, \
        log[-5000:]
    wrong = _equal(pg, broker, conn, ["orders_a", "orders_t"])
    assert not wrong, "\n".join(wrong) + "\n" + log[-5000:]
    assert daemon.terminate() == 0, log[-5000:]
