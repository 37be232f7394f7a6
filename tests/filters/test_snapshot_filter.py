"""Snapshots of a filtered, projected table agree with its stream.

``orders`` is published as ``(id, region, amount) WHERE (region = 'eu')``
(``note`` left out; the primary key ``(id, region)`` holds the filter column,
as PostgreSQL requires with UPDATE/DELETE published). A writer moves rows in
and out of the filter, inserts and deletes from before cdcd starts, through
the initial snapshot, and through an incremental snapshot (``cdcd snapshot``).
Snapshot reads plus the stream, replayed, must equal
``SELECT id, region, amount FROM orders WHERE region = 'eu'``, and no
snapshot read may carry a row or a column the publication does not publish.
"""

from __future__ import annotations

import pytest

from .helpers import (
    OWNERSHIP,
    RegionWriter,
    assert_same,
    expected_rows,
    job_status,
    postgres_section,
    read_topics,
    replayed,
    request_snapshot,
    row_fields,
    table_entry,
    wait_caught_up,
    wait_for,
    wait_streaming,
)

pytestmark = pytest.mark.integration

ROWS = 3_000
CREATE = f"""
CREATE TABLE orders(id int, region text, amount int, note text, PRIMARY KEY (id, region));
INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'us' ELSE 'eu' END, g, 'note ' || g
FROM generate_series(1, {ROWS}) g;
"""
COLUMNS = ["id", "region", "amount"]
FILTER = "region = 'eu'"


@pytest.mark.parametrize("owned", OWNERSHIP)
def test_initial_and_incremental_snapshots_with_concurrent_moves(
    pg, broker, cdc_config, daemons, owned: bool
) -> None:
    pg.execute(CREATE)
    entry = table_entry("public.orders", where=FILTER, columns=COLUMNS)
    config = cdc_config(
        postgres=postgres_section(pg, owned, [entry]),
        extra={"snapshot": {"mode": "initial", "chunk_rows": 100}},
    )
    writer = RegionWriter(pg, "orders", ROWS, seed=3).start()
    try:
        writer.wait_writes(50)
        daemon = daemons(config)
        wait_streaming(pg, daemon)  # the initial snapshot is done
        writer.wait_writes(50)
        job = request_snapshot(config, "public.orders")
        wait_for(lambda: job_status(pg, job) == "done", timeout_s=120, interval_s=0.1,
                 what="the incremental snapshot to finish")
        writer.wait_writes(50)
    finally:
        writer.finish()
    wait_caught_up(pg, daemon)

    topic = f"{pg.dbname}.public.orders"
    read = read_topics(broker, pg.dbname, [topic])
    assert row_fields(read.value_schemas[topic]) == COLUMNS
    reads = [c for c in read.changes if c.value is not None and c.value["op"] == "r"]
    initial = [c for c in reads if c.lsn == min(r.lsn for r in reads)]
    # Both snapshots ran over the filtered rows only (at least the initial one
    # read about 2/3 of the table; nothing in 'us').
    assert len(initial) > ROWS // 2 and len(reads) > len(initial)
    assert {c.value["after"]["region"] for c in reads} == {"eu"}
    assert all(set(c.value["after"]) == set(COLUMNS) for c in reads)
    got = replayed(read.changes, ("id", "region"))
    want = expected_rows(
        pg, f"SELECT {', '.join(COLUMNS)} FROM orders WHERE {FILTER}", ("id", "region")
    )
    assert_same(got, want)
