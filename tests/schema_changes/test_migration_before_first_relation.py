"""A migration that commits after the recorded baseline but before the daemon meets the table.

The daemon starts fresh and records each table's shape (``snapshot.mode:
never``: from the catalog at start, stamped with the slot's position;
``initial``: from the initial snapshot). It is then frozen, so it meets
nothing of what follows until it is thawed: rows are written with the
recorded shape, the migration commits, rows are written with the new
shape. When the daemon meets the table's first ``Relation``, the catalog is
already past the migration, but that ``Relation`` is the recorded shape
itself; the next one is the migration, which the catalog describes. So
each migration is classified as such and none of them heals:

* ``ALTER COLUMN code TYPE varchar(50)``, then ``TYPE text`` (binary-coercible,
  rows written between the two, so one ``Relation`` of each type reaches the
  stream, the middle one when the catalog already names the later type);
* ``ADD COLUMN region text DEFAULT 'eu'`` (a fast default);
* ``RENAME COLUMN note TO memo``.

Kafka replayed with plain fastavro must equal ``SELECT`` from PostgreSQL,
no ``schema-change:`` job may exist for them, and no change may be logged
as ``unknown``. Two control tables whose migration cannot be told from
the catalog (a column added, dropped and added again with another type and
default; a column added, renamed away and its name added again) must still
heal, and equal ``SELECT`` after it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2.extensions
import pytest
from support.cdc import DaemonProcess, wait_for, wait_streaming
from support.pg import PgDatabase

from .helpers import (
    KEY,
    Scenario,
    create_items,
    heal_jobs,
    kafka_differences,
    missing_kinds,
    report,
    schema_change_lines,
    wait_initial_snapshot,
)

pytestmark = pytest.mark.integration

#: table -> (the migration's statements, the kinds the log must name).
MIGRATIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # The control: region comes, goes and comes again with another type and
    # default before the daemon meets the first; which column a version's
    # region is cannot be told from the catalog, and rows read 'us' where
    # the stream carried 7: it must still heal.
    "f_readd": (
        ("ALTER TABLE {t} ADD COLUMN region int DEFAULT 7",
         "ALTER TABLE {t} DROP COLUMN region",
         "ALTER TABLE {t} ADD COLUMN region text DEFAULT 'us'"),
        ("unknown",),
    ),
    # The other control: the name region moves to another column (renamed
    # to area, region added again) before the daemon meets the version that
    # added it; the catalog names that version's columns, but its region is
    # area now: the rows it carried read 'us' in PostgreSQL. It must heal.
    "f_rebind": (
        ("ALTER TABLE {t} ADD COLUMN region text DEFAULT 'eu'",
         # One step: no version of the table between the two.
         "ALTER TABLE {t} RENAME COLUMN region TO area; "
         "ALTER TABLE {t} ADD COLUMN region text DEFAULT 'us'"),
        ("unknown",),
    ),
    "f_type": (
        ("ALTER TABLE {t} ALTER COLUMN code TYPE varchar(50)",
         "ALTER TABLE {t} ALTER COLUMN code TYPE text"),
        ("type_change",),
    ),
    "f_default": (("ALTER TABLE {t} ADD COLUMN region text DEFAULT 'eu'",), ("add_column_default",)),
    "f_rename": (("ALTER TABLE {t} RENAME COLUMN note TO memo",), ("rename_column",)),
}

HEALS = ("f_readd", "f_rebind")
ROWS = 200  # rows of each table before the daemon starts (initial snapshot only)


def write(conn: psycopg2.extensions.connection, table: str, first: int) -> None:
    """A transaction of inserts, updates and deletes of ``table`` (whatever its columns now)."""
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table}(id, name, qty, code) SELECT g, 'w-' || g, g %% 9, "
                    "'k' || g FROM generate_series(%s::int, %s::int) g", (first, first + 9))
        cur.execute(f"UPDATE {table} SET name = 'u{first}-' || id, code = 'c-' || id "
                    "WHERE id %% 3 = 0 AND (id <= 60 OR id BETWEEN %s AND %s)",
                    (first - 100, first))
        cur.execute(f"DELETE FROM {table} WHERE id IN (%s, %s)", (first - 95, first // 10))


def start(pg: PgDatabase, broker: Any, cdc_config: Callable[..., Path],
          daemons: Callable[[Path], DaemonProcess], mode: str) -> Scenario:
    """The tables, then a fresh daemon; returns once it recorded their shapes and streams."""
    conn = pg.connect()
    for table in MIGRATIONS:
        create_items(conn, table, ROWS if mode == "initial" else 0)
    config = cdc_config(extra={"snapshot": {"mode": mode},
                               "schema_changes": {"check_interval_s": 0}})
    daemon = daemons(config)
    sc = Scenario(pg, broker.bootstrap_servers, config, daemons, daemon, conn, ROWS)
    if mode == "initial":
        wait_initial_snapshot(pg, sc.slot, daemon)
    else:
        wait_streaming(pg, sc.slot, daemon)
        wait_for(lambda: "recorded the shape of" in daemon.log(), timeout_s=60,
                 what="the daemon to record the tables' shapes")
    return sc


@pytest.mark.parametrize("mode", ["never", "initial"])
def test_migration_between_the_baseline_and_the_first_relation(
    pg: PgDatabase, broker: Any, cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess], mode: str,
) -> None:
    sc = start(pg, broker, cdc_config, daemons, mode)
    # Frozen: whatever follows commits before the daemon meets any of it.
    sc.daemon.freeze()
    try:
        for table, (statements, _) in MIGRATIONS.items():
            first = 1_000
            write(sc.conn, table, first)
            for statement in statements:
                sc.execute(statement.format(t=table))
                first += 100
                write(sc.conn, table, first)
        # Values the old type (varchar(10)) could not hold.
        sc.execute("UPDATE f_type SET code = 'a-code-longer-than-ten-' || id WHERE id % 4 = 0")
    finally:
        sc.daemon.thaw()
    problems = sc.settle_heals(list(HEALS))
    log = sc.daemon.log()
    for table, (_, kinds) in MIGRATIONS.items():
        qualified = f"public.{table}"
        problems += kafka_differences(sc.pg, sc.bootstrap, sc.prefix, table, KEY)
        problems += missing_kinds(log, list(kinds), table=qualified)
        if table in HEALS:
            continue
        if jobs := heal_jobs(sc.pg, qualified):
            problems.append(f"{qualified}: re-snapshot where none is needed: "
                            f"{[(j.id, j.status) for j in jobs]}")
        problems += [f"{qualified}: logged as unknown: {line}"
                     for line in schema_change_lines(log, qualified) if "unknown" in line]
    assert not problems, report(problems, log)
