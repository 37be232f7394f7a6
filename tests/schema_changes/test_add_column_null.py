"""ADD COLUMN without a default (or DEFAULT NULL): existing rows read NULL, nothing to heal.

The old records resolve to the newest schema with the new field null (its
default); rows written after the DDL carry their own values. No snapshot.
"""

from __future__ import annotations

import pytest

from .helpers import heal_jobs, report

pytestmark = pytest.mark.integration


def test_added_nullable_columns_are_null_for_old_rows(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(
        ["ALTER TABLE items ADD COLUMN region text",
         "ALTER TABLE items ADD COLUMN score int DEFAULT NULL, ADD COLUMN seen timestamptz"],
        seed=4,
    )
    for row_id in (3, 5, 7):
        sc.execute("UPDATE items SET region = 'us', score = %s, seen = now() WHERE id = %s",
                   (row_id * 10, row_id))
    problems, log = sc.outcome(heal=False, kinds=["add_column_null"])
    if jobs := heal_jobs(sc.pg):
        problems.append(f"public.items: a nullable new column needs no snapshot, but: {jobs}")
    assert not problems, report(problems, log)
