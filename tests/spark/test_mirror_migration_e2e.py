"""End to end: a fast default and a rename reach ``cdcd mirror`` without any re-snapshot (issue 13).

PostgreSQL sends no row change for the rows that exist when ``ADD COLUMN ...
DEFAULT <constant>`` or ``RENAME COLUMN`` runs; the daemon carries the
default and the old name in the new writer schema (with
``schema_changes.resnapshot: never``, nothing else can bring them). Two
mirrors must equal the table afterwards: one built before the migration and
caught up after it (its stored rows evolve), and one built from scratch after
it (old records resolve to the new schema while decoding). The first one's
catch-up fails right after its MERGE commit and is replayed (applied once).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess, wait_for, wait_streaming
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pytest.importorskip("deltalake")

from cdcd.spark.mirror import MirrorStore  # noqa: E402

COLUMNS = ("id", "b", "n", "region", "amount", "since")


def _commits(output: Path) -> list[tuple[str, int]]:
    """(app id, batch) of every commit that applied a batch to the table."""
    from deltalake import DeltaTable

    history = DeltaTable(str(output / "public.orders")).history()
    documents = [json.loads(e["cdcd.mirror"]) for e in history if "cdcd.mirror" in e]
    return [(d["app"], d["batch"]) for d in documents if d["kind"] == "batch"]


def _mirrored(output: Path) -> dict[int, dict[str, Any]]:
    from cdcd.spark.mirror import read_mirror

    return {row["id"]: row for row in read_mirror(str(output / "public.orders")).to_pylist()}


def test_mirror_follows_a_fast_default_and_a_rename(
    pg: PgDatabase,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirror_once: Callable[[Path, Path], float],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    conn = pg.connect()
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("CREATE TABLE orders(id int PRIMARY KEY, a text, n int)")
    config = cdc_config(tables=["public.orders"], extra={"schema_changes": {"resnapshot": "never"}})
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(config)
    wait_streaming(pg, slot, daemon)

    def confirmed() -> None:
        target = current_wal_lsn(conn)
        wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, what="confirmation")

    cur.execute("INSERT INTO orders SELECT g, 'row ' || g, g FROM generate_series(1, 30) g")
    cur.execute("UPDATE orders SET n = -n WHERE id % 7 = 0")
    confirmed()
    before = tmp_path / "before"
    mirror_once(config, before)
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
    # Stored rows evolve to the new layout -- in a run that fails right after
    # its MERGE commit, before Spark marks the batch done (issue 17): the next
    # run replays the batch, and the table's transaction version skips it.
    merge = MirrorStore.merge

    def merge_then_fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        merge(self, *args, **kwargs)
        raise OSError("injected failure after the MERGE commit")

    monkeypatch.setattr(MirrorStore, "merge", merge_then_fail)
    with pytest.raises(Exception, match="injected failure"):
        mirror_once(config, before)
    monkeypatch.setattr(MirrorStore, "merge", merge)
    committed = _commits(before)
    mirror_once(config, before)
    assert _commits(before) == committed  # replayed, skipped: no new commit
    assert max(Counter(committed).values()) == 1, committed
    mirror_once(config, after)  # old records resolve while decoding
    for output in (before, after):
        rows = _mirrored(output)
        assert list(rows[2]) == list(COLUMNS)
        assert rows == expected, output.name
