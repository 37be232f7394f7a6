"""RENAME COLUMN: old records carry the old name; resolution must map it to the new one.

``note`` is renamed twice (``note -> memo -> remark``) and ``price`` once,
while the writer runs; rows never touched again must still show their
values under the new names.
"""

from __future__ import annotations

import pytest

from .helpers import heal_jobs, report

pytestmark = pytest.mark.integration


def test_renamed_columns_keep_their_values(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(["ALTER TABLE items RENAME COLUMN note TO memo",
                       "ALTER TABLE items RENAME COLUMN memo TO remark",
                       "ALTER TABLE items RENAME COLUMN price TO unit_price"], seed=10)
    sc.execute("UPDATE items SET remark = 'renamed and written' WHERE id = 12")
    problems, log = sc.outcome(heal=False, kinds=["rename_column"])
    if jobs := heal_jobs(sc.pg):
        problems.append(f"public.items: a rename needs no snapshot, but: {jobs}")
    assert not problems, report(problems, log)
