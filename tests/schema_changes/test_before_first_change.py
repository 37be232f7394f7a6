"""Migrations before a table's first streamed change, and on tables never written again.

Every DDL class of SPEC §5 runs on its own table (shaped like ``items``, rows
written before the daemon starts, so consumers get them as the initial
snapshot's reads), in two ways:

* **first change**: the migration right after the initial snapshot, before
  the table's first streamed change; then a few row changes bring the new
  ``Relation``. The catalog check is off (``check_interval_s: 0``): the
  stream alone must compare that ``Relation`` with the shape the initial
  snapshot recorded, not absorb the migration into a state made from the
  catalog when it first meets the table;
* **idle**: the migration, then nothing: the table is never written again,
  so no ``Relation`` ever comes. The catalog check (``check_interval_s: 1``)
  must find it and heal it (a recreated table with a truncate first).

Then Kafka replayed with plain fastavro (each record resolved to the topic's
newest schema) must equal ``SELECT`` from PostgreSQL. The default suite runs
each way once with all six tables in one daemon; ``slow`` runs each class
alone. ``cdcd mirror --once`` is checked on the same six migrations of idle
tables in ``test_mirror_after_ddl`` (one Spark run for both).
"""

from __future__ import annotations

import pytest

from .helpers import (
    CASES,
    KEY,
    kafka_differences,
    migrate_idle,
    missing_kinds,
    report,
    write_some,
)

pytestmark = pytest.mark.integration


def migrate_and_compare(populated, cases: list[str], written: bool) -> None:
    tables = {name: f"m_{name}" for name in cases}
    sc = populated(list(tables.values()), check_interval_s=0 if written else 1)
    migrate_idle(sc, tables)
    if written:
        for table in tables.values():
            write_some(sc.conn, table)
    problems = sc.settle_heals(
        [t for n, t in tables.items() if not written or CASES[n].heals_when_written])
    log = sc.daemon.log()
    for name, table in tables.items():
        problems += kafka_differences(sc.pg, sc.bootstrap, sc.prefix, table, KEY)
        problems += missing_kinds(log, list(CASES[name].kinds), table=f"public.{table}")
    assert not problems, report(problems, log)


def test_migrations_before_the_first_streamed_change(populated) -> None:
    migrate_and_compare(populated, list(CASES), written=True)


def test_migrations_of_tables_never_written_again(populated) -> None:
    migrate_and_compare(populated, list(CASES), written=False)


@pytest.mark.slow
@pytest.mark.parametrize("written", [True, False], ids=["first-change", "idle"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_migration_alone(populated, case: str, written: bool) -> None:
    migrate_and_compare(populated, [case], written=written)
