"""Changing a publication's column list under a running cdcd (ALTER PUBLICATION … SET TABLE).

PostgreSQL sends a new Relation message with the new columns and nothing else.
A column that joins the list was in the table all along: every existing row
holds a value no record carries, so cdcd re-snapshots the table (a
``schema-change:`` job, kind ``column_published``), unlike a column added by
ALTER TABLE (null or a default for older rows). A column that leaves the list
goes from the schema (``column_unpublished``). After each step the replay
equals ``SELECT <published columns> FROM orders``.
"""

from __future__ import annotations

import pytest

from .helpers import (
    assert_same,
    expected_rows,
    read_topics,
    replayed,
    row_fields,
    wait_caught_up,
    wait_for,
    wait_streaming,
)

pytestmark = pytest.mark.integration

CREATE = """
CREATE TABLE orders(id int PRIMARY KEY, amount int, card text, note text);
INSERT INTO orders SELECT g, g, 'card ' || g, 'note ' || g FROM generate_series(1, 50) g;
CREATE PUBLICATION cdcd FOR TABLE orders (id, amount);
"""


def heal_jobs(pg) -> list[tuple[str, str]]:
    if pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None:
        return []
    return [(str(i), str(s)) for i, s in pg.fetchall(
        "SELECT id, status FROM cdcd_signal WHERE id LIKE 'schema-change:%%'")]


def check(pg, broker, columns: list[str]) -> None:
    topic = f"{pg.dbname}.public.orders"
    read = read_topics(broker, pg.dbname, [topic])
    assert row_fields(read.value_schemas[topic]) == columns
    assert_same(
        replayed(read.changes, ("id",)),
        expected_rows(pg, f"SELECT {', '.join(columns)} FROM orders", ("id",)),
    )


def test_a_column_joining_the_list_heals_and_one_leaving_goes(pg, broker, cdc_config, daemons) -> None:
    pg.execute(CREATE)
    config = cdc_config(
        # Agrees with the publication at start; ALTER PUBLICATION then changes it
        # under the running daemon (a restart would report that drift).
        postgres={"tables": [{"name": "public.orders", "columns": ["id", "amount"]}],
                  "create_publication": False},
        extra={"snapshot": {"mode": "initial"}},
    )
    daemon = daemons(config)
    wait_streaming(pg, daemon)
    pg.execute("UPDATE orders SET amount = amount + 1 WHERE id % 5 = 0")
    wait_caught_up(pg, daemon)
    check(pg, broker, ["id", "amount"])

    pg.execute("ALTER PUBLICATION cdcd SET TABLE orders (id, amount, card)")
    pg.execute("UPDATE orders SET amount = amount + 1 WHERE id = 1")  # carries the new Relation
    wait_caught_up(pg, daemon)
    wait_for(lambda: heal_jobs(pg) and all(s == "done" for _, s in heal_jobs(pg)),
             timeout_s=60, interval_s=0.1, what="the re-snapshot of orders")
    wait_caught_up(pg, daemon)
    check(pg, broker, ["id", "amount", "card"])
    assert "column_published" in daemon.log()

    jobs = len(heal_jobs(pg))
    pg.execute("ALTER PUBLICATION cdcd SET TABLE orders (id, card)")
    pg.execute("UPDATE orders SET card = 'changed' WHERE id = 2")
    wait_caught_up(pg, daemon)
    check(pg, broker, ["id", "card"])
    assert "column_unpublished" in daemon.log()
    assert len(heal_jobs(pg)) == jobs  # nothing to heal: the column just goes
