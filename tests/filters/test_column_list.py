"""Column lists (PostgreSQL 15+): the Avro schema has exactly the published columns.

``payments`` publishes ``(id, amount, status)`` and never ``card_number``: the
value schema's row record must list exactly those columns (snapshot and
stream alike, one schema), and the replay must equal
``SELECT id, amount, status FROM payments``. The entry also names its own
``topic``: cdcd creates and writes that topic instead of
``<prefix>.public.payments``, and ``cdcd schemas`` says so.
"""

from __future__ import annotations

import pytest
from support.cdc import run_cdcd, table_topics
from support.kafka import topic_names

from .helpers import (
    OWNERSHIP,
    assert_same,
    expected_rows,
    postgres_section,
    read_topics,
    replayed,
    row_fields,
    stream_workload,
    table_entry,
    wait_caught_up,
)

pytestmark = pytest.mark.integration

CREATE = """
CREATE TABLE payments(id int PRIMARY KEY, card_number text, amount numeric(12,2), status text,
                      note text);
INSERT INTO payments SELECT g, '4111-' || g, g, 'old', 'n' || g FROM generate_series(1, 20) g;
"""

WORKLOAD = [
    "INSERT INTO payments SELECT g, '5500-' || g, g * 2, 'new', NULL FROM generate_series(21, 40) g",
    "UPDATE payments SET status = 'paid', card_number = 'x' WHERE id % 3 = 0",
    "UPDATE payments SET card_number = 'only the hidden column' WHERE id = 1",
    "DELETE FROM payments WHERE id IN (2, 22)",
]

COLUMNS = ["id", "amount", "status"]


@pytest.mark.parametrize("owned", OWNERSHIP)
def test_schema_and_replay_follow_the_column_list(pg, broker, cdc_config, daemons, owned: bool) -> None:
    pg.execute(CREATE)
    topic = f"{pg.dbname}-payments"
    entry = table_entry("public.payments", columns=COLUMNS, topic=topic)
    config = cdc_config(
        postgres=postgres_section(pg, owned, [entry]), extra={"snapshot": {"mode": "initial"}}
    )
    daemon = stream_workload(pg, daemons, config, WORKLOAD)
    wait_caught_up(pg, daemon)

    assert table_topics(broker.bootstrap_servers, pg.dbname) == []  # no default-named topic
    assert topic in topic_names(broker.bootstrap_servers)
    read = read_topics(broker, pg.dbname, [topic])
    assert row_fields(read.value_schemas[topic]) == COLUMNS
    ops = {c.value["op"] for c in read.changes if c.value}
    assert ops == {"r", "c", "u", "d"}
    for change in read.changes:
        if change.value is not None:
            for row in (change.value["before"], change.value["after"]):
                assert row is None or set(row) == set(COLUMNS), change
    got = replayed(read.changes, ("id",))
    want = expected_rows(pg, f"SELECT {', '.join(COLUMNS)} FROM payments", ("id",))
    assert_same(got, want)

    # `cdcd schemas` shows what the topic holds: the published columns only.
    shown = run_cdcd("schemas", "-c", str(config), timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    assert '"amount"' in shown.stdout and '"card_number"' not in shown.stdout, shown.stdout
    assert f'"topic": "{topic}"' in shown.stdout, shown.stdout
