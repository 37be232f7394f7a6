"""End to end: a fast default and a rename reach ``cdcd mirror`` without any re-snapshot (issue 13).

PostgreSQL sends no row change for the rows that exist when ``ADD COLUMN ...
DEFAULT <constant>`` or ``RENAME COLUMN`` runs; the daemon carries the
default and the old name in the new writer schema (with
``schema_changes.resnapshot: never``, nothing else can bring them). Two
mirrors must equal the table afterwards: one built before the migration and
caught up after it (its stored rows evolve), and one built from scratch after
it (old records resolve to the new schema while decoding).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, wait_for
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pq = pytest.importorskip("pyarrow.parquet")

COLUMNS = ("id", "b", "n", "region", "amount", "since")


def _mirror_once(mirrors: Callable[..., Any], config: Path, output: Path) -> None:
    process = mirrors(config, output, once=True)
    assert process.wait(300) == 0, process.log()


def _mirrored(output: Path) -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in pq.read_table(output / "public.orders").to_pylist()}


def test_mirror_follows_a_fast_default_and_a_rename(
    pg: PgDatabase,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirrors: Callable[..., Any],
    tmp_path: Path,
) -> None:
    conn = pg.connect()
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("CREATE TABLE orders(id int PRIMARY KEY, a text, n int)")
    config = cdc_config(
        tables=["public.orders"], extra={"schema_changes": {"resnapshot": "never"}}
    )
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(config)
    wait_for(
        lambda: pg.fetchall(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
        ),
        what="the daemon to start streaming",
    )

    def confirmed() -> None:
        target = current_wal_lsn(conn)
        wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, what="confirmation")

    cur.execute("INSERT INTO orders SELECT g, 'row ' || g, g FROM generate_series(1, 30) g")
    cur.execute("UPDATE orders SET n = -n WHERE id % 7 = 0")
    confirmed()
    before = tmp_path / "before"
    _mirror_once(mirrors, config, before)
    assert _mirrored(before)[7] == {"id": 7, "a": "row 7", "n": -7}

    cur.execute(
        "ALTER TABLE orders ADD COLUMN region text DEFAULT 'eu', "
        "ADD COLUMN amount numeric(12,2) DEFAULT -12.50, "
        "ADD COLUMN since timestamptz DEFAULT '2023-11-14 22:13:20+00'"
    )
    cur.execute("ALTER TABLE orders RENAME COLUMN a TO b")
    # The new schema reaches Kafka with the table's next changes.
    cur.execute("UPDATE orders SET n = n + 100 WHERE id = 1")
    cur.execute("INSERT INTO orders(id, b, n, region) VALUES (100, 'new', 1, 'us')")
    confirmed()
    assert daemon.terminate() == 0, daemon.log()
    assert "schema_changes.resnapshot is never" not in daemon.log()  # nothing needed a heal

    cur.execute(f"SELECT {', '.join(COLUMNS)} FROM orders")
    expected = {row[0]: dict(zip(COLUMNS, row, strict=True)) for row in cur.fetchall()}
    assert expected[2] == {"id": 2, "b": "row 2", "n": 2, "region": "eu",
                           "amount": Decimal("-12.50"),
                           "since": datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)}  # fmt: skip
    after = tmp_path / "after"
    _mirror_once(mirrors, config, before)  # stored rows evolve to the new layout
    _mirror_once(mirrors, config, after)  # old records resolve while decoding
    for output in (before, after):
        rows = _mirrored(output)
        assert list(rows[2]) == list(COLUMNS)
        assert rows == expected, output.name
