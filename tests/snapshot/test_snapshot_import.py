"""Every reader connection of the initial snapshot holds the one exported snapshot.

``create_slot_with_snapshot`` creates the slot exporting a snapshot and
imports it into each connection of the pool (``SET TRANSACTION SNAPSHOT``).
A transaction committed after that must be invisible to all of them, and
each must report the very same snapshot (``pg_current_snapshot()``: xmin,
xmax and the in-progress list): a connection that took a snapshot of its own
would see the later commit, and read rows from a different point than the
slot's consistent point (a row twice, or none, between snapshot and stream).
"""

from __future__ import annotations

import pytest

from cdcd.snapshot.initial import create_slot_with_snapshot

pytestmark = pytest.mark.integration


def test_every_reader_imports_the_same_snapshot_and_misses_later_commits(pg) -> None:  # type: ignore[no-untyped-def]
    pg.execute("CREATE TABLE moves(id int PRIMARY KEY, bucket int NOT NULL)")
    pg.execute("INSERT INTO moves SELECT g, g % 3 FROM generate_series(1, 30) g")
    exported = create_slot_with_snapshot(pg.dsn, "import_test", False, 3, timeout_s=30)
    try:
        # Committed after the consistent point: the stream carries it, no reader may see it.
        pg.execute("UPDATE moves SET bucket = bucket + 10 WHERE id <= 10")
        pg.execute("INSERT INTO moves VALUES (31, 0)")
        seen = [
            (
                str(db.scalar("SELECT pg_current_snapshot()")),
                db.query("SELECT count(*), sum(bucket) FROM moves")[0],
            )
            for db in exported.pool
        ]
    finally:
        exported.close()
        pg.execute("SELECT pg_drop_replication_slot('import_test')")
    assert len(seen) == 3
    assert len(set(seen)) == 1, f"the readers do not share one snapshot: {seen}"
    assert seen[0][1] == (30, sum(g % 3 for g in range(1, 31))), seen
