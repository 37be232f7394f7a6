"""The initial snapshot, end to end: consistent with the slot, then streaming, no gap.

The daemon runs as its own process against the session's PostgreSQL and
broker; the topics are read back with plain fastavro and replayed in
(cdcd.lsn, cdcd.seq) order (``support.cdc.replay``), as a consumer would.
"""

from __future__ import annotations

import re
import time

import pytest

from cdcd.tools.local.process import pid_alive

from .helpers import (
    Writer,
    child_pids,
    create_orders,
    mirrored,
    signal_row,
    table_state,
    topic_changes,
    wait_caught_up,
    wait_streaming,
    when,
)

pytestmark = pytest.mark.integration


def _initial_with_writes(pg, broker, cdc_config, daemons, rows: int, chunk_rows: int) -> None:
    conn = pg.connect()
    create_orders(conn, rows)
    slot = "cdcd_" + pg.dbname[:50]
    writer = Writer(pg, rows, seed=rows).start()
    time.sleep(0.5)  # writes before, during and after the snapshot
    started = time.monotonic()
    daemon = daemons(cdc_config(tables=["public.orders"], snapshot={"chunk_rows": chunk_rows}))
    wait_streaming(pg, slot, timeout_s=600, daemon=daemon)
    elapsed = time.monotonic() - started
    time.sleep(1.0)
    writer.finish()
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()

    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    reads = [c for c in changes if c.value is not None and c.value["op"] == "r"]
    # The writer ran before the slot existed too: the snapshot holds the table
    # at the consistent point, not the rows first inserted.
    assert rows * 0.9 < len(reads) < rows * 1.1, f"{len(reads)} snapshot rows for {rows} rows"
    # All stamped at the slot's consistent point, which is where streaming begins.
    points = {c.lsn for c in reads}
    assert len(points) == 1
    point = points.pop()
    assert all(c.value["source"]["snapshot"] for c in reads)
    assert sorted(c.seq for c in reads) == list(range(len(reads)))
    streamed = [c for c in changes if c.value is not None and c.value["op"] != "r"]
    assert streamed and all(c.lsn > point for c in streamed)
    assert not any(c.value["source"]["snapshot"] for c in streamed)
    assert mirrored(changes) == table_state(conn, "orders")
    log = daemon.log()
    assert "initial snapshot complete" in log
    status = pg.fetchone("SELECT status, progress FROM cdcd_signal WHERE id = %s", (f"initial:{slot}",))
    assert status is not None and status[0] == "done" and status[1]["done"] == ["public.orders"]
    print(f"rows={rows} writes={writer.counts} snapshot+start={elapsed:.1f}s point={point:X}")


def test_initial_snapshot_with_concurrent_writes(pg, broker, cdc_config, daemons) -> None:
    # 25 chunks, as in the slow million-row variant's 100: enough to interleave with the writer.
    _initial_with_writes(pg, broker, cdc_config, daemons, rows=20_000, chunk_rows=800)


@pytest.mark.slow
def test_initial_snapshot_million_rows_with_concurrent_writes(pg, broker, cdc_config, daemons) -> None:
    _initial_with_writes(pg, broker, cdc_config, daemons, rows=1_000_000, chunk_rows=10_000)


def test_initial_only_copies_and_exits_then_run_streams_from_the_consistent_point(
    pg, broker, cdc_config, daemons
) -> None:
    conn = pg.connect()
    create_orders(conn, 5_000)
    slot = "cdcd_" + pg.dbname[:50]
    only = daemons(cdc_config(tables=["public.orders"], snapshot={"mode": "initial_only"}))
    assert only.wait(120) == 0, only.log()
    assert "initial_only and the initial snapshot is complete: exiting" in only.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert {c.value["op"] for c in changes if c.value} == {"r"}
    assert len(changes) == 5_000
    # Written after the copy, before streaming: the slot kept it.
    pg.execute("UPDATE orders SET status = 'later' WHERE id <= 10")
    pg.execute("DELETE FROM orders WHERE id BETWEEN 11 AND 20")
    daemon = daemons(cdc_config(tables=["public.orders"], snapshot={"mode": "initial"}))
    wait_streaming(pg, slot, daemon=daemon)
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    assert "initial snapshot" not in daemon.log()  # the slot existed: no second copy
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert len([c for c in changes if c.value and c.value["op"] == "r"]) == 5_000
    assert mirrored(changes) == table_state(conn, "orders")


def test_never_publishes_no_snapshot_rows(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    create_orders(conn, 1_000)
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(
        cdc_config(
            tables=["public.orders"],
            snapshot={"mode": "never"},
            extra={"schema_changes": {"resnapshot": "never"}},
        )
    )
    wait_streaming(pg, slot, daemon=daemon)
    pg.execute("UPDATE orders SET status = 'x' WHERE id <= 5")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert [c.value["op"] for c in changes if c.value] == ["u"] * 5
    # Nothing needed the signal table: it was not created (issue 12). With
    # schema_changes.resnapshot: auto (the default) healing rewrites needs it.
    assert pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None


def test_table_without_primary_key_is_snapshotted_with_a_warning(pg, broker, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE events(at timestamptz NOT NULL, kind text, n int)")
    # Keyless: only an insert-only publication keeps the application's updates working.
    pg.execute("CREATE PUBLICATION cdcd FOR TABLE events WITH (publish = 'insert, truncate')")
    pg.execute("INSERT INTO events SELECT now() - g * interval '1 s', 'k' || (g % 7), g "
               "FROM generate_series(1, 25000) g")
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(cdc_config(tables=["public.events"], snapshot={"chunk_rows": 4_000}))
    wait_streaming(pg, slot, daemon=daemon)
    pg.execute("INSERT INTO events VALUES (now(), 'after', -1)")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    assert re.search(r"WARNING .*table public\.events has no primary key", daemon.log()), daemon.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname, table="events")
    reads = [c for c in changes if c.value and c.value["op"] == "r"]
    assert all(c.key is None for c in changes)
    assert sorted(c.value["after"]["n"] for c in reads) == list(range(1, 25001))
    assert [c.value["after"]["n"] for c in changes if c.value["op"] == "c"] == [-1]


def test_slot_that_exists_gets_no_initial_snapshot(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    create_orders(conn, 100)
    slot = "cdcd_" + pg.dbname[:50]
    pg.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    daemon = daemons(cdc_config(tables=["public.orders"]))
    wait_streaming(pg, slot, daemon=daemon)
    pg.execute("UPDATE orders SET status = 'x' WHERE id = 1")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert [c.value["op"] for c in changes if c.value] == ["u"]


@pytest.mark.parametrize(
    ("parallelism", "processes"),
    [
        pytest.param(1, 0, id="one"),
        pytest.param(3, 0, id="threads"),
        # Slow (opt-in): the default suite covers worker processes with
        # test_parallel_consistency's processes variant.
        pytest.param(2, 2, id="processes", marks=pytest.mark.slow),
    ],
)
def test_kill9_during_initial_snapshot_completes_it_incrementally(
    pg, broker, cdc_config, daemons, parallelism: int, processes: int
) -> None:
    """With 3 connections each table is cut into 3 key ranges read side by side.

    Each table has 12,000 rows per connection, so that a table takes about as
    long to read either way and the kill lands before the last one is done.
    With worker processes (``snapshot.processes``) the kill must take them
    too: none of the daemon's children outlives it.
    """
    conn = pg.connect()
    names = ["orders", "orders_b", "orders_c"]
    rows = 12_000 * parallelism
    for name in names:
        create_orders(conn, rows, table=name)
    slot = "cdcd_" + pg.dbname[:50]
    # 40 chunks per table and connection: the kill lands while the second table is read.
    config = cdc_config(tables=[f"public.{n}" for n in names],
                        snapshot={"chunk_rows": 300, "parallelism": parallelism,
                                  "processes": processes})
    writers = [Writer(pg, rows, seed=i, table=n, pause_s=0.002).start() for i, n in enumerate(names)]
    first = daemons(config)

    def one_table_done() -> bool:
        row = signal_row(pg, f"initial:{slot}")
        return row is not None and row[0] == "running" and len(row[1].get("done", [])) >= 1

    when(one_table_done, what="the first table of the initial snapshot to be delivered")
    workers = child_pids(first.pid)
    assert len(workers) >= processes, workers  # the workers (and multiprocessing's tracker)
    first.kill9()
    when(lambda: not any(pid_alive(pid) for pid in workers), timeout_s=30,
         what=f"the killed daemon's worker processes {workers} to end")
    done_at_kill = signal_row(pg, f"initial:{slot}")[1]["done"]
    assert 1 <= len(done_at_kill) < 3
    second = daemons(config)
    when(lambda: signal_row(pg, f"initial:{slot}")[0] == "done", timeout_s=300,
         what="the interrupted initial snapshot to be completed")
    for writer in writers:
        writer.finish()
    wait_caught_up(pg, slot)
    assert second.terminate() == 0, second.log()
    log = second.log()
    assert "initial snapshot of slot" in log and "was interrupted" in log, log
    for name in done_at_kill:
        assert f"snapshot of {name} read" not in log  # delivered before the kill: not read again
    for name in names:
        changes = topic_changes(broker.bootstrap_servers, pg.dbname, table=name)
        assert mirrored(changes) == table_state(conn, name), name


def test_initial_snapshot_on_a_two_phase_slot(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    create_orders(conn, 2_000)
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(cdc_config(tables=["public.orders"], postgres={"protocol_version": 3}))
    wait_streaming(pg, slot, daemon=daemon)
    assert pg.fetchone("SELECT two_phase FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,))[0] is True
    pg.execute("BEGIN; UPDATE orders SET status = 'prepared' WHERE id = 1; "
               "PREPARE TRANSACTION 'snap-2pc'")
    pg.execute("COMMIT PREPARED 'snap-2pc'")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert len([c for c in changes if c.value and c.value["op"] == "r"]) == 2_000
    assert mirrored(changes) == table_state(conn, "orders")


def test_publication_column_list_and_row_filter_apply_to_the_snapshot(
    pg, broker, cdc_config, daemons
) -> None:
    conn = pg.connect()
    create_orders(conn, 1_000)
    pg.execute("CREATE PUBLICATION cdcd FOR TABLE orders (id, status, amount) WHERE (id % 10 = 0)")
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(cdc_config(tables=["public.orders"], snapshot={"chunk_rows": 30}))
    wait_streaming(pg, slot, daemon=daemon)
    pg.execute("UPDATE orders SET status = 'later' WHERE id IN (10, 11)")
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    reads = [c for c in changes if c.value["op"] == "r"]
    assert sorted(c.key["id"] for c in reads) == list(range(10, 1001, 10))
    assert all(set(c.value["after"]) == {"id", "status", "amount"} for c in reads)
    (update,) = [c for c in changes if c.value["op"] == "u"]
    assert update.key["id"] == 10 and set(update.value["after"]) == {"id", "status", "amount"}


def test_a_user_who_cannot_create_the_signal_table(pg, broker, cdc_config, daemons) -> None:
    """Streaming does not need the signal table; a crash-safe initial snapshot does."""
    conn = pg.connect()
    create_orders(conn, 100)
    role = "r_" + pg.dbname[:40]
    pg.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
    try:
        pg.execute(f"GRANT SELECT ON orders TO {role}")
        pg.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        pg.execute("CREATE PUBLICATION cdcd FOR TABLE orders")
        dsn = pg.dsn.replace("user=postgres", f"user={role}")
        assert dsn != pg.dsn
        slot = "cdcd_" + pg.dbname[:50]

        refused = daemons(cdc_config(tables=["public.orders"], postgres={"dsn": dsn}))
        assert refused.wait(60) == 3  # definite: an operator must grant CREATE (SPEC §2)
        assert "cannot create the signal table public.cdcd_signal" in refused.log()
        assert not pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))

        daemon = daemons(cdc_config(tables=["public.orders"], postgres={"dsn": dsn},
                                    snapshot={"mode": "never"}))
        wait_streaming(pg, slot, daemon=daemon)
        pg.execute("UPDATE orders SET status = 'x' WHERE id = 1")
        wait_caught_up(pg, slot)
        assert daemon.terminate() == 0, daemon.log()
        assert "incremental snapshots are unavailable" in daemon.log()
        changes = topic_changes(broker.bootstrap_servers, pg.dbname)
        assert [c.value["op"] for c in changes if c.value] == ["u"]
    finally:
        pg.execute(f"DROP OWNED BY {role}")
        pg.execute(f"DROP ROLE {role}")
