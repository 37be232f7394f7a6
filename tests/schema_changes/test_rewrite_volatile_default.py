"""ADD COLUMN ... DEFAULT <volatile> rewrites the table: every row gets its own value,
and the WAL carries no row change for any of them.

``random()`` and ``clock_timestamp()`` defaults: only an automatic
re-snapshot (``op=r``, a ``schema-change:`` job in the signal table) can
bring those values to Kafka. Also a constant ``int[]`` default with a NULL
element, which an Avro default cannot express for an array of
``["null", "int"]`` (a union's default must match its first branch): the
daemon may heal it rather than carry it, but the consumer must see it.
"""

from __future__ import annotations

import pytest

from .helpers import report

pytestmark = pytest.mark.integration


def test_volatile_default_is_healed_by_a_resnapshot(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(
        ["ALTER TABLE items ADD COLUMN r float8 DEFAULT random()",
         "ALTER TABLE items ADD COLUMN stamped timestamptz NOT NULL DEFAULT clock_timestamp()",
         "ALTER TABLE items ADD COLUMN tags int[] DEFAULT '{1,NULL,3}'"],
        seed=5,
        rewrites=True,
    )
    problems, log = sc.outcome(heal=True, kinds=["add_column_rewrite"])
    assert not problems, report(problems, log)
