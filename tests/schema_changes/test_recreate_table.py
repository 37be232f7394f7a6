"""DROP TABLE + CREATE TABLE under the same name: the consumer must end with the new
table's rows only.

The publication is cdcd's own FOR ALL TABLES (no ``postgres.tables``), so the
new table is captured as soon as it exists. Twice on one topic:

1. under the writer, in one transaction (``DROP``, ``CREATE`` with other
   columns, rows whose keys overlap the old ones); the writer's statements
   wait for the lock and then run against the new table;
2. with the writer stopped, ``DROP`` and ``CREATE`` as separate
   transactions (no row change between them), then rows, then the writer.

Each time a truncate envelope (``op=t``) must precede the new table's first
change on the topic, so that old rows do not live on downstream.
"""

from __future__ import annotations

import pytest
from support.cdc import read_changes

from .helpers import Workload, populate, report, wait_confirmed

pytestmark = pytest.mark.integration

RECREATE_1 = """BEGIN;
DROP TABLE items;
CREATE TABLE items(id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL,
                   code varchar(10) NOT NULL, colour text);
INSERT INTO items(id, name, qty, code, colour)
  SELECT g, 'new-' || g, g, 'n' || g, 'blue' FROM generate_series(150, 249) g;
COMMIT"""

CREATE_2 = """CREATE TABLE items(id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL,
                   price numeric(10,2), code varchar(10) NOT NULL, note text, colour text)"""


def test_recreated_table_replaces_the_old_rows(scenario) -> None:
    sc = scenario()
    workload = sc.writer(seed=11)
    workload.wait_more(20)
    sc.execute(RECREATE_1)
    workload.wait_more(20)
    workload.finish()
    wait_confirmed(sc.pg, sc.slot, sc.daemon)

    sc.execute("DROP TABLE items")
    sc.execute(CREATE_2)
    populate(sc.conn, 201, 120)
    second = Workload(sc.pg, 320, seed=12).start()
    sc.workloads.append(second)
    second.wait_more(20)
    second.finish()

    problems, log = sc.outcome(heal=False, kinds=["recreate"])
    truncates = [c for c in read_changes(sc.bootstrap, sc.prefix, [sc.topic()])
                 if c.value is not None and c.value["op"] == "t"]
    if len(truncates) < 2:
        problems.append(f"public.items: {len(truncates)} truncate envelopes on {sc.topic()}, "
                        "expected one per re-creation (2)")
    assert not problems, report(problems, log)
