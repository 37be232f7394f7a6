"""The initial snapshot's announcement of a small never-analysed table (issue 29, friction 10).

Six rows in a table PostgreSQL never analysed: the planner's guess from the
file size was thousands; the announcement must say six (a small table is
counted) and call the figure an estimate.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from support.cdc import DaemonProcess, wait_for
from support.pg import PgDatabase

pytestmark = pytest.mark.integration


def test_initial_snapshot_announces_the_real_count_of_a_small_table(
    pg: PgDatabase, cdc_config: Callable[..., Path], daemons: Callable[[Path], DaemonProcess]
) -> None:
    pg.execute("CREATE TABLE six (id int PRIMARY KEY, note text)")
    pg.execute("INSERT INTO six SELECT g, repeat('x', 20) FROM generate_series(1, 6) g")
    (reltuples,) = pg.fetchone("SELECT reltuples FROM pg_class WHERE relname = 'six'")  # type: ignore[misc]
    assert reltuples <= 0, "premise: never analysed"
    daemon = daemons(cdc_config(tables=["public.six"], extra={"snapshot": {"mode": "initial"}}))
    line = wait_for(
        lambda: next((x for x in daemon.log().splitlines() if "initial snapshot of" in x), None),
        timeout_s=60, what="the initial snapshot's first line",
    )
    assert re.search(r"initial snapshot of 1 tables \(6 rows estimated\)", line), line
    daemon.terminate()
