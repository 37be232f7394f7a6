"""Fixtures of the schema-change tests: ``scenario(...)`` starts table, daemon and rows.

``populated(tables, ...)`` (issue 24) creates tables with rows before the
daemon starts with an initial snapshot, so that a migration can come before
any streamed change. ``scenario(rows=..., create=..., schema_changes=..., snapshot=...)`` creates
``public.items`` (or the ``create`` statement), writes a config with
``snapshot.mode: never`` and no ``tables`` (cdcd creates its publication
FOR ALL TABLES), starts the daemon, waits until it streams, then inserts
``rows`` rows so that they reach Kafka as inserts. Writers it handed out are
stopped after the test, whatever happened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess
from support.pg import PgDatabase

from .helpers import (
    CREATE,
    ROWS,
    Scenario,
    create_items,
    populate,
    wait_initial_snapshot,
    wait_streaming,
)


@pytest.fixture
def scenario(
    pg: PgDatabase,
    broker: Any,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
) -> Iterator[Callable[..., Scenario]]:
    made: list[Scenario] = []

    def make(
        rows: int = ROWS,
        create: str = CREATE,
        schema_changes: dict[str, Any] | None = None,
        snapshot: dict[str, Any] | None = None,
    ) -> Scenario:
        conn = pg.connect()
        with conn.cursor() as cur:
            cur.execute(create)
        extra: dict[str, Any] = {"snapshot": {"mode": "never", **(snapshot or {})}}
        if schema_changes is not None:
            extra["schema_changes"] = schema_changes
        config = cdc_config(extra=extra)
        daemon = daemons(config)
        made.append(
            sc := Scenario(pg, broker.bootstrap_servers, config, daemons, daemon, conn, rows)
        )
        wait_streaming(pg, sc.slot, daemon)
        populate(conn, 1, rows)
        return sc

    yield make
    for sc in made:
        for workload in sc.workloads:
            workload.finish_quietly()


@pytest.fixture
def populated(
    pg: PgDatabase,
    broker: Any,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
) -> Callable[..., Scenario]:
    """``populated(tables, rows=..., check_interval_s=..., snapshot=...)``: issue 24's start.

    Each table (shaped like ``items``) is created with ``rows`` rows *before*
    the daemon starts with ``snapshot.mode: initial``, so consumers get them
    as snapshot reads and the table has had no streamed change yet; returns
    once the daemon streams (its initial snapshot delivered).
    """

    def make(tables: list[str], rows: int = ROWS, check_interval_s: float = 1.0,
             snapshot: dict[str, Any] | None = None, start: bool = True) -> Scenario:
        conn = pg.connect()
        for table in tables:
            create_items(conn, table, rows)
        config = cdc_config(extra={
            "snapshot": {"mode": "initial", **(snapshot or {})},
            "schema_changes": {"check_interval_s": check_interval_s},
        })
        daemon = daemons(config)
        sc = Scenario(pg, broker.bootstrap_servers, config, daemons, daemon, conn, rows)
        if start:
            wait_initial_snapshot(pg, sc.slot, daemon)
        return sc

    return make
