"""Fixtures for snapshot tests: a config per test (snapshot mode initial by default), daemons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, write_config
from support.pg import PgDatabase

from cdcd.local import LocalBroker


@pytest.fixture
def cdc_config(pg: PgDatabase, broker: LocalBroker, tmp_path: Path) -> Callable[..., Path]:
    """``cdc_config(snapshot={...}, **overrides)`` writes a config for this test's database."""

    def make(snapshot: dict[str, Any] | None = None, **overrides: Any) -> Path:
        overrides.setdefault("prefix", pg.dbname)
        overrides.setdefault("slot", "cdcd_" + pg.dbname[:50])
        extra = dict(overrides.pop("extra", {}) or {})
        extra["snapshot"] = {"mode": "initial", **(snapshot or {})}
        return write_config(
            tmp_path / "cdcd.yaml", pg.dsn, broker.bootstrap_servers, extra=extra, **overrides
        )

    return make


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[[Path], DaemonProcess]]:
    """Start daemons as child processes; every one is killed after the test."""
    started: list[DaemonProcess] = []

    def start(config: Path) -> DaemonProcess:
        daemon = DaemonProcess(config, tmp_path / f"daemon-{len(started)}.log")
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.alive():
            daemon.kill9()
