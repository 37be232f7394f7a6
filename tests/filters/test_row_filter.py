"""Row filters (PostgreSQL 15+): what reaches the topic is the filtered table, moves and all.

PostgreSQL evaluates a publication's row filter on the old and the new row of
an UPDATE: old matched and new does not → the walsender sends a DELETE; old
did not and new does → an INSERT. The filter may use only replica identity
columns while UPDATE/DELETE are published, so ``orders`` has REPLICA
IDENTITY FULL (its key stays the primary key ``id``, so a move out of the
filter is not a key change). Downstream, a move out must be a delete plus a
tombstone, a move in a create, and the replay must equal
``SELECT id, region, amount, status FROM orders WHERE region = 'eu'``.
"""

from __future__ import annotations

import pytest

from .helpers import (
    OWNERSHIP,
    assert_same,
    expected_rows,
    postgres_section,
    read_topics,
    replayed,
    stream_workload,
    table_entry,
    wait_caught_up,
)

pytestmark = pytest.mark.integration

CREATE = """
CREATE TABLE orders(id int PRIMARY KEY, region text NOT NULL, amount numeric(12,2), status text);
ALTER TABLE orders REPLICA IDENTITY FULL;
INSERT INTO orders SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g * 1.5, 'old'
FROM generate_series(1, 40) g;
"""

WORKLOAD = [
    # inserts on both sides of the filter
    "INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'us' ELSE 'eu' END, g, 'new' "
    "FROM generate_series(101, 130) g",
    # moving out (eu -> us) and in (us -> eu), then back for some
    "UPDATE orders SET region = 'us', status = 'moved out' WHERE id IN (2, 4, 6, 102)",
    "UPDATE orders SET region = 'eu', status = 'moved in' WHERE id IN (1, 3, 5, 103)",
    "UPDATE orders SET region = 'eu', status = 'back in' WHERE id = 4",
    "UPDATE orders SET region = 'us', status = 'back out' WHERE id = 3",
    # updates inside and outside the filter
    "UPDATE orders SET amount = amount + 100 WHERE id % 5 = 0",
    # deletes on both sides
    "DELETE FROM orders WHERE id IN (8, 9, 104, 105)",
    # a move and a change of the same row in one transaction
    "BEGIN; UPDATE orders SET region = 'us' WHERE id = 10; "
    "UPDATE orders SET region = 'eu', amount = 7 WHERE id = 10; COMMIT",
]

FILTER = "region = 'eu'"


@pytest.mark.parametrize("owned", OWNERSHIP)
def test_replay_equals_filtered_table(pg, broker, cdc_config, daemons, owned: bool) -> None:
    pg.execute(CREATE)
    entry = table_entry("public.orders", where=FILTER)
    config = cdc_config(
        postgres=postgres_section(pg, owned, [entry]), extra={"snapshot": {"mode": "initial"}}
    )
    daemon = stream_workload(pg, daemons, config, WORKLOAD)
    wait_caught_up(pg, daemon)

    topic = f"{pg.dbname}.public.orders"
    read = read_topics(broker, pg.dbname, [topic])
    got = replayed(read.changes, ("id",))
    want = expected_rows(pg, f"SELECT id, region, amount, status FROM orders WHERE {FILTER}", ("id",))
    assert_same(got, want)
    # Nothing outside the filter was ever published, not even by the snapshot.
    published = {c.value["after"]["region"] for c in read.changes if c.value and c.value["after"]}
    assert published == {"eu"}

    by_id: dict[int, list[tuple[str | None, object]]] = {}
    for change in sorted(read.changes, key=lambda c: (c.lsn, c.seq, c.value is None)):
        ident = change.key["id"] if change.key else None
        by_id.setdefault(ident, []).append(
            (change.value["op"] if change.value else None, change.value and change.value["before"])
        )
    # id 2 moved out: its last messages are a delete then a tombstone.
    assert [op for op, _ in by_id[2][-2:]] == ["d", None], by_id[2]
    # id 1 moved in: created (it was never published before).
    assert [op for op, _ in by_id[1]] == ["c"], by_id[1]
    # id 4: out then in again -> r, d, tombstone, c.
    assert [op for op, _ in by_id[4]] == ["r", "d", None, "c"], by_id[4]
    # id 3: in then out again -> c, d, tombstone.
    assert [op for op, _ in by_id[3]] == ["c", "d", None], by_id[3]
