"""Changing a table's row filter: consumers end with the rows of the new filter.

A filter change sends no new shape: pgoutput sends the same Relation again,
and from then on only rows of the new filter. What consumers hold came under
the old one: rows it took in that the new one leaves out must go, rows the
new one takes in (which the stream never sent) must come. cdcd compares the
filter recorded with the table's schema state when it starts (after applying
the configured filter to a publication it owns; an operator changes one it
does not own along with postgres.tables), and re-snapshots the table starting
with a truncate (op=t). The replay then equals ``SELECT … WHERE <new filter>``.
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
    table_entry,
    wait_caught_up,
    wait_for,
    wait_streaming,
)

pytestmark = pytest.mark.integration

CREATE = """
CREATE TABLE orders(id int, region text, amount int, PRIMARY KEY (id, region));
INSERT INTO orders SELECT g, (ARRAY['eu', 'us', 'asia'])[g % 3 + 1], g FROM generate_series(1, 60) g;
"""
OLD, NEW = "region = 'eu'", "region IN ('us', 'asia') AND id > 10"
KEY = ("id", "region")


def heals(pg) -> list[tuple[str, str]]:
    return [(str(i), str(s)) for i, s in pg.fetchall(
        "SELECT id, status FROM cdcd_signal WHERE id LIKE 'schema-change:%%'")]


@pytest.mark.parametrize("owned", OWNERSHIP)
def test_new_filter_truncates_and_resnapshots(pg, broker, cdc_config, daemons, owned: bool) -> None:
    pg.execute(CREATE)
    postgres = postgres_section(pg, owned, [table_entry("public.orders", where=OLD)])
    config = cdc_config(postgres=postgres, extra={"snapshot": {"mode": "initial"}})
    first = daemons(config)
    wait_streaming(pg, first)
    pg.execute("UPDATE orders SET amount = amount + 1 WHERE id % 4 = 0")
    wait_caught_up(pg, first)
    assert first.terminate() == 0, first.log()

    if not owned:
        pg.execute(f"ALTER PUBLICATION cdcd SET TABLE orders WHERE ({NEW})")
    postgres = {**postgres, "tables": [table_entry("public.orders", where=NEW)]}
    config = cdc_config(postgres=postgres, extra={"snapshot": {"mode": "initial"}})
    second = daemons(config)
    wait_streaming(pg, second)
    pg.execute("UPDATE orders SET amount = amount + 1 WHERE id % 5 = 0")
    pg.execute("UPDATE orders SET region = 'us' WHERE id IN (3, 6)")  # eu -> us: moves in
    wait_for(lambda: heals(pg) and all(s == "done" for _, s in heals(pg)), timeout_s=60,
             interval_s=0.1, what="the re-snapshot after the filter change")
    wait_caught_up(pg, second)

    topic = f"{pg.dbname}.public.orders"
    read = read_topics(broker, pg.dbname, [topic])
    truncates = [c for c in read.changes if c.value and c.value["op"] == "t"]
    assert len(truncates) == 1, truncates
    want = expected_rows(pg, f"SELECT id, region, amount FROM orders WHERE {NEW}", KEY)
    assert_same(replayed(read.changes, KEY), want)
    assert "row_filter" in second.log()
