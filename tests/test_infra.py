"""The throwaway infrastructure works: PostgreSQL cluster, pgoutput reads, tansu broker."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import psycopg2
import psycopg2.errors
import psycopg2.extras
import pytest
from support.cdc import STREAMING_SQL, wait_for
from support.kafka import consume_all, create_topic, produce, topic_names
from support.pg import (
    PgDatabase,
    create_publication,
    create_slot,
    current_wal_lsn,
    drop_slot,
    int_to_lsn,
    lsn_to_int,
    read_pgoutput,
    slot_confirmed_flush_lsn,
)

from cdcd.tools.local import LocalBroker, LocalPostgres, PostgresSetupError

pytestmark = pytest.mark.integration


def test_lsn_round_trip() -> None:
    assert lsn_to_int("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert int_to_lsn(lsn_to_int("0/1A")) == "0/1A"


# ---------------------------------------------------------------- PostgreSQL


def test_cluster_is_configured_for_logical_replication(pg_cluster: LocalPostgres) -> None:
    assert pg_cluster.show("wal_level") == "logical"
    assert pg_cluster.show("max_replication_slots") == "20"
    assert pg_cluster.show("max_wal_senders") == "20"
    assert pg_cluster.show("max_prepared_transactions") == "10"
    assert pg_cluster.show("fsync") == "off"
    assert pg_cluster.show("server_version_num").startswith("15")
    assert pg_cluster.host == "127.0.0.1"
    assert pg_cluster.pid is not None
    assert (pg_cluster.bindir / "pg_recvlogical").exists()


def test_pg_fixture_gives_a_fresh_database(pg: PgDatabase) -> None:
    assert pg.fetchall("SELECT current_database()") == [(pg.dbname,)]
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    pg.execute("INSERT INTO t VALUES (%s)", (1,))
    assert pg.fetchone("SELECT count(*) FROM t") == (1,)
    conn = pg.connect()
    assert conn.autocommit
    with psycopg2.connect(pg.dsn) as other, other.cursor() as cur:
        cur.execute("SELECT id FROM t")
        assert cur.fetchall() == [(1,)]
    other.close()


def test_pg_fixture_drops_database_with_active_slot(pg_cluster: LocalPostgres) -> None:
    """What the ``pg`` teardown does, with a walsender still holding a slot."""
    name = "infra_drop_with_slot"
    pg_cluster.create_database(name)
    conn = pg_cluster.connect(name)
    create_slot(conn, "held")
    repl = psycopg2.connect(
        pg_cluster.dsn(name),
        connection_factory=psycopg2.extras.LogicalReplicationConnection,
    )
    cur = repl.cursor()
    create_publication(conn, "p")
    cur.start_replication(
        slot_name="held", decode=False, options={"proto_version": "1", "publication_names": "p"}
    )
    deadline = time.monotonic() + 10
    while pg_cluster.execute("SELECT active FROM pg_replication_slots WHERE slot_name='held'") != [
        (True,)
    ]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.close()
    pg_cluster.drop_database(name)
    assert pg_cluster.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)) == []
    assert pg_cluster.execute("SELECT 1 FROM pg_replication_slots") == []
    repl.close()


def test_pgoutput_payloads(pg: PgDatabase) -> None:
    conn = pg.connect()
    pg.execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    create_publication(conn, "pub", ["public.t"])
    create_slot(conn, "s1")
    pg.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    payloads = read_pgoutput(pg.dsn, "s1", "pub")
    kinds = [p[:1] for _, p in payloads]
    assert kinds == [b"B", b"R", b"I", b"I", b"C"]
    # Nothing confirmed: a second read sees the same changes.
    assert read_pgoutput(pg.dsn, "s1", "pub") == payloads
    # Confirming moves the slot to (at least) the end of what was read.
    before = slot_confirmed_flush_lsn(conn, "s1")
    read_pgoutput(pg.dsn, "s1", "pub", confirm=True)
    after = slot_confirmed_flush_lsn(conn, "s1")
    assert after > before
    assert after >= max(lsn for lsn, _ in payloads)
    assert read_pgoutput(pg.dsn, "s1", "pub") == []
    assert current_wal_lsn(conn) >= after
    drop_slot(conn, "s1")
    assert pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name='s1'") == []


def test_pgoutput_stop_when_and_messages(pg: PgDatabase) -> None:
    conn = pg.connect()
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    create_publication(conn, "pub")
    create_slot(conn, "s")
    pg.execute("SELECT pg_logical_emit_message(true, 'pfx', 'hello')")
    for i in range(3):
        pg.execute("INSERT INTO t VALUES (%s)", (i,))
    payloads = read_pgoutput(pg.dsn, "s", "pub", messages=True)
    assert b"M" in [p[:1] for _, p in payloads]
    first_commit = read_pgoutput(
        pg.dsn, "s", "pub", stop_when=lambda got: got[-1][1][:1] == b"C", timeout_s=10
    )
    assert first_commit[-1][1][:1] == b"C"
    assert len(first_commit) < len(payloads)


def test_pgoutput_two_phase_and_streaming(
    make_pg_cluster: Callable[..., LocalPostgres],
) -> None:
    cluster = make_pg_cluster(settings={"logical_decoding_work_mem": "64kB"})
    assert cluster.show("logical_decoding_work_mem") == "64kB"
    conn = cluster.connect()
    cluster.execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    create_publication(conn, "pub")
    create_slot(conn, "tp", two_phase=True)
    create_slot(conn, "st")
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("INSERT INTO t VALUES (1, 'x')")
        cur.execute("PREPARE TRANSACTION 'gid1'")
        cur.execute("COMMIT PREPARED 'gid1'")
    cluster.execute("INSERT INTO t SELECT g, repeat('y', 200) FROM generate_series(2, 3000) g")
    two_phase = read_pgoutput(cluster.dsn(), "tp", "pub", proto_version=3, two_phase=True)
    kinds = [p[:1] for _, p in two_phase]
    assert kinds[:2] == [b"b", b"R"]  # BEGIN PREPARE, then the relation
    assert b"P" in kinds and b"K" in kinds  # PREPARE, COMMIT PREPARED
    streamed = read_pgoutput(cluster.dsn(), "st", "pub", proto_version=2, streaming=True)
    streamed_kinds = {p[:1] for _, p in streamed}
    assert {b"S", b"E", b"c"} <= streamed_kinds  # stream start/stop/commit: 64kB forced streaming
    with pytest.raises(psycopg2.errors.FeatureNotSupported):
        read_pgoutput(cluster.dsn(), "st", "pub", proto_version=4)


def test_a_slot_being_created_is_active_but_not_streaming(pg: PgDatabase) -> None:
    """``wait_streaming``'s premise: creating a slot holds it (``active``) while the
    creation waits for open transactions, with no walsender streaming from it."""
    blocker = pg.connect()
    blocker.autocommit = False
    with blocker.cursor() as cur:
        cur.execute("CREATE TEMP TABLE held(x int)")  # an xid the creation must wait for
    failures: list[psycopg2.Error] = []

    def create() -> None:
        try:
            pg.execute("SELECT pg_create_logical_replication_slot('being_created', 'pgoutput')")
        except psycopg2.Error as exc:  # reported by the test thread
            failures.append(exc)

    creator = threading.Thread(target=create)
    creator.start()
    try:
        wait_for(lambda: pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = "
                                     "'being_created' AND active"), what="the slot held")
        assert not pg.fetchall(STREAMING_SQL, ("being_created",))
    finally:
        blocker.rollback()
        creator.join(60)
    assert not failures, failures
    drop_slot(pg.connect(), "being_created")


def test_make_pg_cluster_replica_and_set_setting(
    make_pg_cluster: Callable[..., LocalPostgres],
) -> None:
    cluster = make_pg_cluster(settings={"wal_level": "replica"})
    assert cluster.show("wal_level") == "replica"
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
        cluster.execute("SELECT pg_create_logical_replication_slot('x', 'pgoutput')")
    assert cluster.set_setting("work_mem", "7MB") is False
    assert cluster.show("work_mem") == "7MB"
    assert cluster.set_setting("wal_level", "logical") is True
    assert cluster.show("wal_level") == "logical"


def test_restart_keeps_port_and_data(make_pg_cluster: Callable[..., LocalPostgres]) -> None:
    cluster = make_pg_cluster()
    port, pid = cluster.port, cluster.pid
    cluster.execute("CREATE TABLE kept(v int)")
    cluster.execute("INSERT INTO kept VALUES (1)")
    cluster.restart("immediate")
    assert cluster.port == port
    assert cluster.pid not in (None, pid)
    assert cluster.execute("SELECT v FROM kept") == [(1,)]
    cluster.stop()
    cluster.stop()  # idempotent
    assert not cluster.running
    assert cluster.pid is None
    with pytest.raises(psycopg2.OperationalError):
        cluster.connect()
    cluster.start_again()
    assert cluster.execute("SELECT v FROM kept") == [(1,)]
    base = cluster.base_dir
    cluster.cleanup()
    cluster.cleanup()  # idempotent
    assert not base.exists()


def test_crash_and_start_again(make_pg_cluster: Callable[..., LocalPostgres]) -> None:
    cluster = make_pg_cluster()
    cluster.execute("CREATE TABLE kept(v int)")
    cluster.execute("INSERT INTO kept VALUES (1)")
    pid = cluster.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while cluster.running:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cluster.stop()  # reaps; nothing left to signal
    cluster.start_again()
    assert cluster.execute("SELECT v FROM kept") == [(1,)]


def test_drop_database_rolls_back_prepared_transactions(pg_cluster: LocalPostgres) -> None:
    name = "infra_drop_prepared"
    pg_cluster.create_database(name)
    with pg_cluster.connection(name) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t(id int)")
        cur.execute("BEGIN")
        cur.execute("INSERT INTO t VALUES (1)")
        cur.execute("PREPARE TRANSACTION 'left_behind'")
    pg_cluster.drop_database(name)
    assert pg_cluster.execute("SELECT 1 FROM pg_prepared_xacts") == []
    assert pg_cluster.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)) == []


def test_port_in_use_is_retried_and_bad_settings_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cdcd.tools.local.postgres as local_pg

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    ports = iter([taken])
    real_free_port = local_pg.free_port
    monkeypatch.setattr(local_pg, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        with LocalPostgres.start() as cluster:
            assert cluster.port != taken
            assert cluster.execute("SELECT 1") == [(1,)]
    finally:
        blocker.close()
    with pytest.raises(ValueError):
        LocalPostgres.start(settings={"port": "5432"})
    with pytest.raises(ValueError):
        LocalPostgres.start(settings={"bad name\nx": "1"})
    with pytest.raises(PostgresSetupError, match="does not start|exited"):
        LocalPostgres.start(settings={"no_such_setting": "1"})


def test_missing_binaries_error_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDCD_PG_BINDIR", "/nonexistent")
    with pytest.raises(PostgresSetupError, match="apt-get install -y postgresql-15"):
        LocalPostgres.start()


# --------------------------------------------------------------------- broker


def test_broker_round_trip_with_keys_and_headers(broker: LocalBroker) -> None:
    topic = "infra.round_trip"
    create_topic(broker.bootstrap_servers, topic, partitions=3)
    assert topic in topic_names(broker.bootstrap_servers)
    records = [(f"k{i % 4}".encode(), f"v{i}".encode()) for i in range(50)]
    produce(
        broker.bootstrap_servers,
        topic,
        records,
        headers=[("cdcd.lsn", b"0/1")],
        **{"enable.idempotence": True, "linger.ms": 20},
    )
    got = consume_all(broker.bootstrap_servers, topic, expected=50, timeout_s=20)
    assert len(got) == 50
    assert sorted((m.key(), m.value()) for m in got) == sorted(records)
    assert all(m.headers() == [("cdcd.lsn", b"0/1")] for m in got)
    by_key: dict[bytes | None, set[int | None]] = {}
    for m in got:
        by_key.setdefault(m.key(), set()).add(m.partition())
    assert all(len(parts) == 1 for parts in by_key.values())
    # Read-to-the-end gets everything too, despite tansu's high-watermark bug.
    assert len(consume_all(broker.bootstrap_servers, [topic], idle_s=0.5)) == 50


def test_consume_all_stops_at_the_end_of_every_partition(broker: LocalBroker) -> None:
    """Without ``expected`` the read ends where the data ends, not after an idle wait.

    Several batches per partition (tansu's high watermark points at the first
    record of the last one) and a topic with empty partitions: all is read,
    and far sooner than the idle window that would end it otherwise.
    """
    bootstrap = broker.bootstrap_servers
    create_topic(bootstrap, "infra.ends", partitions=3)
    create_topic(bootstrap, "infra.ends_empty", partitions=2)
    for batch in range(4):
        records = [(f"k{batch}-{i}".encode(), b"v" * i) for i in range(60)]
        produce(bootstrap, "infra.ends", records, **{"linger.ms": 20})
    started = time.monotonic()
    got = consume_all(bootstrap, ["infra.ends", "infra.ends_empty"], idle_s=90, timeout_s=90)
    elapsed = time.monotonic() - started
    assert len(got) == 240
    assert len({m.partition() for m in got}) == 3
    assert elapsed < 45, f"{elapsed:.0f} s: the read waited to be idle instead of stopping at the end"


def test_consume_all_of_absent_topic_is_empty_and_creates_nothing(broker: LocalBroker) -> None:
    assert consume_all(broker.bootstrap_servers, "infra.absent", idle_s=0.3) == []
    assert "infra.absent" not in topic_names(broker.bootstrap_servers)


def test_freeze_and_thaw(make_broker: Callable[..., LocalBroker]) -> None:
    own = make_broker()
    bootstrap = own.bootstrap_servers
    create_topic(bootstrap, "infra.freeze")
    own.freeze()
    assert own.frozen and own.running
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    with pytest.raises(Exception, match="(?i)timed out|transport"):
        admin.list_topics(timeout=1)
    own.thaw()
    produce(bootstrap, "infra.freeze", [(b"k", b"after-thaw")])
    assert [m.value() for m in consume_all(bootstrap, "infra.freeze", expected=1)] == [
        b"after-thaw"
    ]
    pid = own.pid
    assert pid is not None
    own.freeze()
    del admin  # an open client connection would make tansu's shutdown wait for it
    log = own.log_path
    base = own.base_dir
    assert log.exists()
    own.cleanup()  # stopping a frozen broker works
    own.cleanup()  # idempotent
    assert not own.running
    assert not base.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
