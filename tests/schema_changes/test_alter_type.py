"""ALTER COLUMN ... TYPE: a rewrite with USING (values change, no row change in the WAL),
and a binary-coercible change (no rewrite, values unchanged).

* ``qty int -> bigint USING qty * 10`` and ``price numeric(10,2) ->
  numeric(12,3) USING price * 1.5``: every existing row changes; only a
  re-snapshot can tell the consumer (Avro resolution promotes int to long,
  but the values are the old ones).
* ``code varchar(10) -> varchar(50)``, then ``-> text``: binary-coercible,
  no rewrite (the test checks that the relfilenode stays); longer values are
  written afterwards. No snapshot is needed. (``text -> varchar(n)`` would
  not do: PostgreSQL rewrites the table to check the lengths.)
"""

from __future__ import annotations

import pytest

from .helpers import heal_jobs, report

pytestmark = pytest.mark.integration


def test_type_change_with_using_is_healed(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(
        ["ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty * 10",
         "ALTER TABLE items ALTER COLUMN price TYPE numeric(12,3) USING price * 1.5"],
        seed=6,
        rewrites=True,
    )
    problems, log = sc.outcome(heal=True, kinds=["type_change_rewrite"])
    assert not problems, report(problems, log)


def test_binary_coercible_type_change_needs_no_snapshot(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(
        ["ALTER TABLE items ALTER COLUMN code TYPE varchar(50)",
         "ALTER TABLE items ALTER COLUMN code TYPE text"],
        seed=7,
        rewrites=False,
    )
    for row_id in (8, 9):
        sc.execute("UPDATE items SET code = %s WHERE id = %s", ("a-code-longer-than-ten", row_id))
    problems, log = sc.outcome(heal=False, kinds=["type_change"])
    if jobs := heal_jobs(sc.pg):
        problems.append(f"public.items: a binary-coercible type change needs no snapshot: {jobs}")
    assert not problems, report(problems, log)
