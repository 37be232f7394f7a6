"""Stored generated columns: the snapshot carries one exactly when the stream does.

pgoutput never sends generated columns before PostgreSQL 18; on 18 a
publication with ``publish_generated_columns = stored`` sends the stored
ones (``postgres.publish_generated_columns: true``). cdcd's snapshot must
read the same columns the walsender sends, or snapshot rows and streamed
rows of one table would have different shapes and values. Replay of the
topic (initial snapshot plus stream) must equal ``SELECT id, a[, b] FROM g``.
"""

from __future__ import annotations

import pytest
from filters.helpers import assert_same, expected_rows, read_topics, replayed, row_fields
from support.cdc import wait_for, wait_streaming
from support.pg import current_wal_lsn, slot_confirmed_flush_lsn

pytestmark = pytest.mark.integration

CREATE = """
CREATE TABLE g(id int PRIMARY KEY, a int, b int GENERATED ALWAYS AS (a * 2) STORED, c text);
INSERT INTO g(id, a, c) SELECT i, i, 'c' || i FROM generate_series(1, 30) i;
"""
WORKLOAD = [
    "INSERT INTO g(id, a, c) SELECT i, i, 'new' FROM generate_series(31, 40) i",
    "UPDATE g SET a = a + 100 WHERE id % 3 = 0",
    "DELETE FROM g WHERE id % 7 = 0",
]


def _run(vdb, vconfig, daemons, publish: bool, owned: bool, prefix: str) -> None:
    vdb.execute(CREATE)
    postgres: dict = {"tables": ["public.g"], "create_publication": owned}
    if publish:
        postgres["publish_generated_columns"] = True
    if not owned:
        option = " WITH (publish_generated_columns = stored)" if publish else ""
        vdb.execute(f"CREATE PUBLICATION cdcd FOR TABLE g{option}")
    config = vconfig(postgres=postgres, prefix=prefix, extra={"snapshot": {"mode": "initial"}})
    daemon = daemons(config)
    slot = "cdcd_" + vdb.dbname[:50]
    conn = vdb.connect()

    wait_streaming(vdb, slot, daemon, timeout_s=120)
    for statement in WORKLOAD:
        vdb.execute(statement)
    target = current_wal_lsn(conn)
    wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, timeout_s=120,
             interval_s=0.1, what="the daemon to confirm everything")


# (major, publish_generated_columns, cdcd creates the publication)
CASES = [
    pytest.param(17, False, False, id="pg17-never-published"),
    pytest.param(18, True, True, id="pg18-published-owned"),
    pytest.param(18, True, False, id="pg18-published-by-hand"),
    pytest.param(18, False, False, id="pg18-not-published"),
]


@pytest.mark.parametrize(("version_pg", "publish", "owned"), CASES, indirect=["version_pg"])
def test_snapshot_and_stream_agree_on_generated_columns(
    version_pg, vdb, vconfig, broker, daemons, publish: bool, owned: bool
) -> None:
    # vdb's name (the default prefix) is the same for every case on one major.
    prefix = f"{vdb.dbname}_{'pub' if publish else 'nopub'}_{'own' if owned else 'hand'}"
    _run(vdb, vconfig, daemons, publish, owned, prefix)
    columns = ["id", "a", "b", "c"] if publish else ["id", "a", "c"]
    topic = f"{prefix}.public.g"
    read = read_topics(broker, prefix, [topic])
    assert row_fields(read.value_schemas[topic]) == columns
    rows = [c.value["after"] for c in read.changes if c.value and c.value["after"]]
    assert {c.value["op"] for c in read.changes if c.value} == {"r", "c", "u", "d"}
    assert all(list(row) == columns for row in rows)
    assert_same(replayed(read.changes, ("id",)),
                expected_rows(vdb, f"SELECT {', '.join(columns)} FROM g", ("id",)))
