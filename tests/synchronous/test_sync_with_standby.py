"""cdcd beside a real physical standby in ``synchronous_standby_names`` (``-m slow``).

* ``FIRST 1 (cdcd, standby)`` on PostgreSQL 15: cdcd is the synchronous
  standby (``sync``), the physical one ``potential``. With the broker
  frozen a captured commit waits; killing cdcd hands the role to the
  physical standby, which releases the commit: the documented way to bound
  the wait. A new cdcd takes the role back and delivers what it missed.
* ``ANY 1 (cdcd, standby)`` on PostgreSQL 15: both ``quorum``; with the
  broker frozen a captured commit returns on the physical standby's word;
  with the physical standby stopped, it waits for Kafka again.
* PostgreSQL 17 with a failover slot and ``synchronized_standby_slots``:
  cdcd is sent nothing the physical standby has not confirmed, so with that
  standby stopped a captured commit waits even though Kafka is up, and
  returns once the standby is back.

Each ends with a replay of the topic equal to the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from failover.standby import build_standby, standby_settings
from support.cdc import DaemonProcess, wait_for, write_config
from support.kafka import create_topic
from support.pg import require_version

from cdcd.tools.local import LocalBroker, LocalPostgres

from .sync import Scene, scene, sync_state, synchronous, wait_sync_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SLOT = "cdcd_sync"
STANDBY = "sb1"


@contextmanager
def _beside_standby(
    make_pg_cluster: Callable[..., LocalPostgres],
    make_broker: Callable[..., LocalBroker],
    tmp_path: Path,
    version: int,
    failover: bool = False,
) -> Iterator[tuple[Scene, LocalPostgres, Path]]:
    """A primary with a streaming physical standby (``application_name`` sb1) and cdcd
    capturing ``app.cap``: (the scene, the standby, cdcd's configuration)."""
    require_version(version)
    primary = make_pg_cluster(version=version)
    primary.create_database("app")
    if failover:
        settings = standby_settings(primary, STANDBY, "app")
    else:
        settings = {
            "primary_conninfo": f"host={primary.host} port={primary.port} user=postgres "
            f"application_name={STANDBY}",
            "primary_slot_name": STANDBY,
        }
    standby = build_standby(make_pg_cluster, primary, STANDBY, settings)
    if failover:
        primary.set_setting("synchronized_standby_slots", STANDBY)
    primary.execute("CREATE TABLE cap(id int PRIMARY KEY, note text)", dbname="app")
    primary.execute("CREATE TABLE unc(id int PRIMARY KEY, note text)", dbname="app")
    broker = make_broker()
    create_topic(broker.bootstrap_servers, "app.public.cap", partitions=1)
    config = write_config(
        tmp_path / "cdcd.yaml", primary.dsn("app"), broker.bootstrap_servers, prefix="app",
        slot=SLOT, tables=["public.cap"], kafka={"partitions": 1},
        postgres={"failover": True} if failover else None, extra={"heartbeat": {"interval_s": 0}},
    )  # fmt: skip
    with scene(primary, broker, "app", config, tmp_path / "daemon-1.log") as run:
        yield run, standby, config


def test_first_1_cdcd_then_standby(
    make_pg_cluster: Callable[..., LocalPostgres],
    make_broker: Callable[..., LocalBroker],
    tmp_path: Path,
) -> None:
    with _beside_standby(make_pg_cluster, make_broker, tmp_path, 15) as (run, _standby, config):
        primary, broker = run.cluster, run.broker
        with synchronous(primary, f"FIRST 1 ({SLOT}, {STANDBY})"):
            wait_sync_state(primary, SLOT, "sync")
            assert sync_state(primary, STANDBY) == "potential"
            run.returns_in_kafka("INSERT INTO cap VALUES (1, 'one')", 1)
            broker.freeze()
            try:
                frozen = run.commit("INSERT INTO cap VALUES (2, 'Kafka frozen')")
                frozen.wait_blocked(primary)
                # Bounding the wait: without cdcd, the physical standby is the one.
                run.daemon.kill9()
                frozen.returned()
                wait_sync_state(primary, STANDBY, "sync")
            finally:
                broker.thaw()
            run.daemon = DaemonProcess(config, tmp_path / "daemon-2.log")
            wait_sync_state(primary, SLOT, "sync")
            run.commit("INSERT INTO cap VALUES (3, 'three')").returned()
            assert run.reader.wait_count(3) >= 3
        run.assert_replay_equals_table()


def test_any_1_cdcd_or_standby(
    make_pg_cluster: Callable[..., LocalPostgres],
    make_broker: Callable[..., LocalBroker],
    tmp_path: Path,
) -> None:
    with _beside_standby(make_pg_cluster, make_broker, tmp_path, 15) as (run, standby, _config):
        primary, broker = run.cluster, run.broker
        with synchronous(primary, f"ANY 1 ({SLOT}, {STANDBY})"):
            wait_sync_state(primary, SLOT, "quorum")
            assert sync_state(primary, STANDBY) == "quorum"
            broker.freeze()
            try:
                # The physical standby's confirmation is enough.
                run.commit("INSERT INTO cap VALUES (1, 'Kafka frozen')").returned()
                standby.stop()
                wait_for(lambda: sync_state(primary, STANDBY) is None, what="standby gone")
                frozen = run.commit("INSERT INTO cap VALUES (2, 'Kafka frozen, no standby')")
                frozen.wait_blocked(primary)
            finally:
                broker.thaw()
            frozen.returned()
            run.commit("INSERT INTO unc VALUES (1, 'not captured')").returned()
        run.assert_replay_equals_table()


def test_failover_slot_waits_for_the_synchronized_standby(
    make_pg_cluster: Callable[..., LocalPostgres],
    make_broker: Callable[..., LocalBroker],
    tmp_path: Path,
) -> None:
    with _beside_standby(
        make_pg_cluster, make_broker, tmp_path, 17, failover=True
    ) as (run, standby, _config):
        primary = run.cluster
        with synchronous(primary, f"FIRST 1 ({SLOT}, {STANDBY})"):
            wait_sync_state(primary, SLOT, "sync")
            assert primary.execute(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
            ) == [(True,)]
            for i in range(1, 6):
                run.returns_in_kafka(f"INSERT INTO cap VALUES ({i}, 'row {i}')", i)
            standby.stop()
            # cdcd is sent nothing the standby has not confirmed: Kafka is up, yet it waits.
            held = run.commit("INSERT INTO cap VALUES (6, 'standby down')")
            held.wait_blocked(primary)
            standby.start_again()
            held.returned(timeout_s=120)
            assert run.reader.wait_count(6) == 6
        run.assert_replay_equals_table()
