"""cdcd as a synchronous standby by its default name (the slot): commits wait for Kafka.

With ``synchronous_standby_names = '<slot>'`` PostgreSQL makes every commit
wait until cdcd reports it flushed, and cdcd reports flush only for what
Kafka acknowledged (write: what it received). So, on PostgreSQL 15:

* a commit on a captured table returns only once its message is in Kafka:
  right after each of 20 commits, with the daemon frozen so that it can
  produce nothing more, the message is there;
* with the broker frozen, a captured commit waits (the server shows it in
  ``SyncRep``) while a commit on a table cdcd does not capture returns (it
  publishes nothing: cdcd confirms the keepalive's WAL end at once); after the
  thaw the waiting commit returns and its message is in Kafka;
* with cdcd killed, commits wait until a new cdcd streams, then return;
* a replay of the topic equals the table;
* ``cdcd check`` names the entry and prints the caveats, and the gauge
  ``cdcd_synchronous_standby`` is 1 while the server counts cdcd, 0 after.

``remote_apply`` behaves as ``on`` (cdcd reports apply = flush);
``remote_write`` waits only for cdcd to have received the transaction, so
with the broker frozen a captured commit returns too, and with cdcd gone it
waits. Those two run with ``-m slow``.
"""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cdc import DaemonProcess, run_cdcd, wait_for, write_config
from support.kafka import create_topic
from support.pg import require_version

from cdcd.snapshot.store import SignalTable
from cdcd.source.database import SourceDatabase
from cdcd.tools.local import LocalBroker, LocalPostgres, free_port

from .sync import scene, synchronous, wait_sync_state

pytestmark = pytest.mark.integration
_names = itertools.count(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPostgres]:
    """A cluster of this module's own: synchronous_standby_names is server-wide."""
    instance = LocalPostgres.start()
    try:
        yield instance
    finally:
        instance.cleanup()


@pytest.fixture
def private_broker() -> Iterator[LocalBroker]:
    """A broker the test may freeze."""
    instance = LocalBroker.start()
    try:
        yield instance
    finally:
        instance.cleanup()


def _setup(
    cluster: LocalPostgres, broker: LocalBroker, tmp_path: Path, metrics_port: int = 0
) -> tuple[str, str, Path]:
    """A database with ``cap`` (captured) and ``unc`` (not captured); (dbname, slot, config)."""
    dbname = f"sync{next(_names)}"
    cluster.create_database(dbname)
    cluster.execute("CREATE TABLE cap(id int PRIMARY KEY, note text)", dbname=dbname)
    cluster.execute("CREATE TABLE unc(id int PRIMARY KEY, note text)", dbname=dbname)
    slot = f"cdcd_{dbname}"
    create_topic(broker.bootstrap_servers, f"{dbname}.public.cap", partitions=1)
    # No heartbeats: they would move the confirmed position on their own
    # within their interval, hiding an uncaptured commit that waits.
    config = write_config(
        tmp_path / f"{dbname}.yaml", cluster.dsn(dbname), broker.bootstrap_servers,
        prefix=dbname, slot=slot, tables=["public.cap"], kafka={"partitions": 1},
        extra={"heartbeat": {"interval_s": 0},
               "metrics": {"listen": f"127.0.0.1:{metrics_port}", "lag_sample_interval_s": 0.2}},
    )  # fmt: skip
    return dbname, slot, config


def _gauge(port: int) -> float | None:
    """``cdcd_synchronous_standby`` as the daemon serves it (None while nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cdcd_synchronous_standby":
                return float(sample.value)
    return None


def _check_lines(config: Path) -> list[str]:
    result = run_cdcd("check", "-c", str(config))
    print(result.stdout)  # what docs/synchronous.md quotes
    return [line for line in result.stdout.splitlines() if " synchronous" in line]


@pytest.mark.parametrize(
    "mode",
    [
        "on",
        pytest.param("remote_apply", marks=pytest.mark.slow),
        pytest.param("remote_write", marks=pytest.mark.slow),
    ],
)
def test_commit_returns_only_once_in_kafka(
    cluster: LocalPostgres, private_broker: LocalBroker, tmp_path: Path, mode: str
) -> None:
    broker = private_broker
    port = free_port()
    dbname, slot, config = _setup(cluster, broker, tmp_path, port)
    waits_for_kafka = mode != "remote_write"
    with scene(cluster, broker, dbname, config, tmp_path / "daemon-1.log", mode) as run:
        with synchronous(cluster, slot):  # the default application_name is the slot name
            wait_sync_state(cluster, slot, "sync")
            wait_for(lambda: _gauge(port) == 1, what="cdcd_synchronous_standby 1")
            if mode == "on":
                lines = _check_lines(config)
                assert lines[0] == (
                    f"ok   synchronous: yes, synchronous_standby_names = '{slot}' names "
                    f"application_name '{slot}' (FIRST 1 of 1); pg_stat_replication.sync_state: "
                    "sync"
                ), lines
                assert [line.split(":")[0] for line in lines[1:]] == [
                    "ok   synchronous caveat"
                ] * 2, lines

            # 1. Each captured commit is in Kafka when it returns (20 of 20).
            for i in range(1, 21):
                statement = f"INSERT INTO cap VALUES ({i}, 'row {i}')"
                if waits_for_kafka:
                    run.returns_in_kafka(statement, i)
                else:
                    run.commit(statement).returned()
            assert run.reader.wait_count(20) == 20

            # 2. Broker frozen: an uncaptured commit returns, a captured one waits.
            broker.freeze()
            try:
                run.commit("INSERT INTO unc VALUES (1, 'not captured')").returned()
                frozen = run.commit("INSERT INTO cap VALUES (21, 'while Kafka is frozen')")
                if waits_for_kafka:
                    frozen.wait_blocked(cluster)
                else:
                    frozen.returned()  # remote_write: cdcd received it
            finally:
                broker.thaw()
            frozen.returned()
            assert run.reader.wait_count(21) == 21

            # 3. cdcd killed: commits wait until a new cdcd streams.
            run.daemon.kill9()
            wait_for(lambda: not cluster.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
            ), what="the walsender to notice")  # fmt: skip
            while_down = run.commit("INSERT INTO cap VALUES (22, 'while cdcd is down')")
            while_down.wait_blocked(cluster)
            down_unc = run.commit("INSERT INTO unc VALUES (2, 'while cdcd is down')")
            down_unc.wait_blocked(cluster)  # no standby at all: every commit waits
            run.daemon = DaemonProcess(config, tmp_path / "daemon-2.log")
            while_down.returned(timeout_s=120)
            down_unc.returned(timeout_s=120)
            run.commit("UPDATE cap SET note = 'updated' WHERE id = 1").returned()
            run.commit("DELETE FROM cap WHERE id = 2").returned()
            # A delete is followed by its tombstone: 22 + update + delete + tombstone.
            assert run.reader.wait_count(25) == 25
            wait_for(lambda: _gauge(port) == 1, what="cdcd_synchronous_standby 1 again")
        wait_for(lambda: _gauge(port) == 0, what="cdcd_synchronous_standby 0")
        run.assert_replay_equals_table()


def test_check_names_the_entry_and_the_caveats(
    cluster: LocalPostgres, private_broker: LocalBroker, tmp_path: Path
) -> None:
    """'*' makes every walsender a candidate, cdcd included (a failure: commits would wait
    for Kafka by accident); a name matches case-insensitively; the initial-snapshot caveat."""
    dbname, slot, config = _setup(cluster, private_broker, tmp_path)
    assert _check_lines(config)[0].startswith(
        "ok   synchronous: no (synchronous_standby_names is empty, which does not name "
        f"application_name '{slot}')"
    )
    with synchronous(cluster, "ANY 1 (standby1, *)"):
        lines = _check_lines(config)
    assert lines[0].startswith(
        "FAIL synchronous: synchronous_standby_names = 'ANY 1 (standby1, *)' matches cdcd only "
        "through '*' (ANY 1 of 2)"
    ), lines
    # An unfinished initial snapshot: cdcd does not stream (nor count) until it is done.
    with SourceDatabase(cluster.dsn(dbname)) as db:
        signals = SignalTable(db, "cdcd_signal")
        signals.ensure()
        signals.begin_initial(slot, ["public.cap"])
    with synchronous(cluster, f"FIRST 1 (standby1, {slot.upper()})"):
        lines = _check_lines(config)
    assert lines[0].startswith(
        f"ok   synchronous: yes, synchronous_standby_names = 'FIRST 1 (standby1, {slot.upper()})' "
        f"names application_name '{slot}' (as '{slot.upper()}') (FIRST 1 of 2)"
    ), lines
    assert lines[-1].startswith(
        f"ok   synchronous caveat: the initial snapshot of slot {slot} has not finished"
    ), lines


@pytest.mark.slow
@pytest.mark.parametrize("version", [12, 13, 14, 16, 17, 18])
def test_other_versions(
    make_pg_cluster: Callable[..., LocalPostgres],
    private_broker: LocalBroker,
    tmp_path: Path,
    version: int,
) -> None:
    """The same waits on every supported major: before 15, pgoutput sends an
    uncaptured transaction as an empty BEGIN/COMMIT instead of skipping it."""
    require_version(version)
    cluster = make_pg_cluster(version=version)
    broker = private_broker
    dbname, slot, config = _setup(cluster, broker, tmp_path)
    with scene(cluster, broker, dbname, config, tmp_path / "daemon.log") as run:
        with synchronous(cluster, slot):
            wait_sync_state(cluster, slot, "sync")
            for i in range(1, 4):
                run.returns_in_kafka(f"INSERT INTO cap VALUES ({i}, 'row {i}')", i)
            broker.freeze()
            try:
                run.commit("INSERT INTO unc VALUES (1, 'not captured')").returned()
                frozen = run.commit("INSERT INTO cap VALUES (4, 'while Kafka is frozen')")
                frozen.wait_blocked(cluster)
            finally:
                broker.thaw()
            frozen.returned()
            assert run.reader.wait_count(4) == 4
        run.assert_replay_equals_table()
