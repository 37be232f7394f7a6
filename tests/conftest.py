"""Shared fixtures: a throwaway PostgreSQL cluster and tansu broker per session.

- ``pg_cluster`` (session): :class:`cdcd.tools.local.LocalPostgres` with default
  settings (wal_level=logical, 20 slots/walsenders, prepared transactions).
- ``pg`` (function): a fresh database on ``pg_cluster``
  (:class:`support.pg.PgDatabase`); afterwards its walsenders are
  terminated, its slots dropped, then the database itself.
- ``make_pg_cluster`` (function): factory ``make_pg_cluster(settings=...,
  version=...)`` for tests that need their own cluster (custom settings,
  restarts, crashes, another PostgreSQL major: ``version=12``).
- ``pg_versions`` (session): the PostgreSQL majors installed here
  (``cdcd.tools.local.postgres.installed_versions``; ``.ci/setup`` installs 12-18).
- ``broker`` (session): :class:`cdcd.tools.local.LocalBroker`, in-memory storage.
  Tests that freeze or restart a broker should use ``make_broker()`` instead;
  a session broker left frozen by a failed test is thawed afterwards.
- ``make_broker`` (function): factory for a private broker.
- ``cdc_config`` (function): ``cdc_config(**overrides)`` writes a daemon config
  for this test's database, with its own topic prefix and slot.
- ``daemons`` (function): ``daemons(config, env=None, hooks=None)`` starts ``cdcd run`` as
  a child process (``env`` added to the environment); every one still alive is
  killed after the test.

Nothing here starts unless a test asks for it, so unit tests stay fast.
Daemons poll the snapshot signal table every 0.2 s (see below).
"""

from __future__ import annotations

import gc
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.cdc import DaemonProcess, write_config
from support.pg import PgDatabase

from cdcd.tools.local import LocalBroker, LocalPostgres
from cdcd.tools.local.postgres import SettingValue, installed_versions

_db_counter = itertools.count(1)



@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[LocalPostgres]:
    """One PostgreSQL 15 cluster for the whole session."""
    cluster = LocalPostgres.start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def pg(pg_cluster: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[PgDatabase]:
    """A fresh database for one test, dropped (with its slots) afterwards."""
    with PgDatabase.fresh(pg_cluster, f"t{next(_db_counter)}", request.node.name) as db:
        yield db


@pytest.fixture
def make_pg_cluster() -> Iterator[Callable[..., LocalPostgres]]:
    """Factory for private clusters: ``make_pg_cluster(settings={...}, version=12)``."""
    clusters: list[LocalPostgres] = []

    def make(
        settings: Mapping[str, SettingValue] | None = None, version: int | None = None
    ) -> LocalPostgres:
        cluster = LocalPostgres.start(settings=settings, version=version)
        clusters.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.cleanup()


@pytest.fixture(scope="session")
def pg_versions() -> dict[int, Path]:
    """Installed PostgreSQL majors -> bin directory (Debian's 15 and what setup installed)."""
    return installed_versions()


@pytest.fixture(scope="session")
def broker() -> Iterator[LocalBroker]:
    """One tansu broker for the whole session (memory storage)."""
    instance = LocalBroker.start()
    try:
        yield instance
    finally:
        instance.cleanup()


@pytest.fixture(autouse=True)
def _thaw_session_broker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Never leave the shared broker frozen (or dead) for the next test."""
    yield
    if "broker" not in request.fixturenames:
        return
    instance: LocalBroker = request.getfixturevalue("broker")
    if instance.frozen and instance.running:
        instance.thaw()
    if not instance.running:
        instance.restart()


@pytest.fixture
def make_broker() -> Iterator[Callable[..., LocalBroker]]:
    """Factory for private brokers: ``make_broker()``; all stopped afterwards."""
    brokers: list[LocalBroker] = []

    def make(**kwargs: Any) -> LocalBroker:
        instance = LocalBroker.start(**kwargs)
        brokers.append(instance)
        return instance

    try:
        yield make
    finally:
        # Clients the test left in reference cycles (a sink and its tracker)
        # would keep connections open, and tansu waits for them on SIGTERM
        # until LocalBroker kills it 5 s later.
        gc.collect()
        for instance in brokers:
            instance.cleanup()


@pytest.fixture
def cdc_config(pg: PgDatabase, broker: LocalBroker, tmp_path: Path) -> Callable[..., Path]:
    """``cdc_config(**overrides)`` writes a config for this test's database."""

    def make(**overrides: Any) -> Path:
        overrides.setdefault("prefix", pg.dbname)
        overrides.setdefault("slot", "cdcd_" + pg.dbname[:50])
        return write_config(tmp_path / "cdcd.yaml", pg.dsn, broker.bootstrap_servers, **overrides)

    return make


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons as child processes; every one is killed after the test."""
    started: list[DaemonProcess] = []

    def start(
        config: Path,
        env: Mapping[str, str] | None = None,
        hooks: Mapping[str, Any] | None = None,
    ) -> DaemonProcess:
        daemon = DaemonProcess(
            config, tmp_path / f"daemon-{len(started)}.log", env=env, hooks=hooks
        )
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.alive():
            daemon.kill9()
