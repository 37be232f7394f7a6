"""DROP COLUMN: the newest schema has no such field and the consumer sees no such column.

And the trap behind it: ``DROP COLUMN note`` then ``ADD COLUMN note text``.
PostgreSQL's rows all have ``note`` NULL now, but Avro resolves fields by
name, so an old record still carrying the old ``note`` would hand the old
value back for every row not changed since. The consumer must see NULLs.
"""

from __future__ import annotations

import pytest

from .helpers import report

pytestmark = pytest.mark.integration


def test_dropped_column_is_gone(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(["ALTER TABLE items DROP COLUMN note",
                       "ALTER TABLE items DROP COLUMN price"], seed=8)
    problems, log = sc.outcome(heal=False, kinds=["drop_column"])
    assert not problems, report(problems, log)


def test_dropped_then_re_added_column_does_not_resurrect_old_values(scenario) -> None:
    sc = scenario()
    workload = sc.writer(seed=9)
    workload.wait_more(20)
    sc.execute("ALTER TABLE items DROP COLUMN note")
    workload.wait_more(10)  # a Relation without `note` reaches the stream first
    sc.execute("ALTER TABLE items ADD COLUMN note text")
    workload.wait_more(20)
    workload.finish()
    sc.execute("UPDATE items SET note = 'fresh' WHERE id = 10")
    problems, log = sc.outcome(heal=False, kinds=["drop_column", "add_column_null"])
    assert not problems, report(problems, log)
