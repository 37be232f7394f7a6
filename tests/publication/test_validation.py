"""Each refused row filter, column list and publication setting: one line, exit 2, nothing made.

Through the real CLI: ``cdcd check -c`` prints the line as a FAIL and exits
2; ``cdcd run -c`` exits 2 with the same line, before it creates the
publication or the slot (read back from pg_publication and
pg_replication_slots afterwards). The ``run`` processes go in parallel:
each only connects, validates and exits.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.cdc import cdcd_argv, write_config
from support.pg import PgDatabase

from cdcd.cli import main
from cdcd.tools.local import LocalBroker

pytestmark = pytest.mark.integration

TABLES = (
    "CREATE TABLE public.orders (id int PRIMARY KEY, region text, amount numeric, card text);"
    "CREATE TABLE public.keyless (a int, b text);"
    "CREATE TABLE public.m (id int, k int, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);"
    "CREATE TABLE public.m1 PARTITION OF public.m FOR VALUES FROM (0) TO (10)"
)

RULE = (
    "PostgreSQL's rule: a row filter of a publication that publishes updates or deletes "
    "(cdcd publishes updates and deletes) may use only replica identity columns, else the "
    "application's UPDATE and DELETE on the table fail; filter on replica identity columns "
    "only; or set replica_identity: full on the entry (ALTER TABLE … REPLICA IDENTITY FULL); "
    "or publish only inserts (a publication WITH (publish = 'insert, truncate') and "
    "create_publication: false)"
)

#: name -> (postgres settings, the one line)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "filter_outside_identity": (
        {"tables": [{"name": "public.orders", "where": "region = 'eu'"}]},
        "postgres.tables: the where of public.orders uses column region, which is not part of "
        f"its replica identity (primary key (id)); {RULE}",
    ),
    "columns_omit_identity": (
        {"tables": [{"name": "public.orders", "columns": ["region", "amount"]}]},
        "postgres.tables: the column list of public.orders omits id, a replica identity column "
        "(primary key (id)); PostgreSQL's rule: the column list must include the replica "
        "identity (cdcd keys its messages by it); add id to its columns",
    ),
    "unknown_column": (
        {"tables": [{"name": "public.orders", "columns": ["id", "card_numbr"]}]},
        "postgres.tables: public.orders has no column card_numbr (its columns: id, region, "
        "amount, card); fix the columns of its entry",
    ),
    "unknown_filter_column": (
        {"tables": [{"name": "public.orders", "where": "idd > 3"}]},
        "postgres.tables: the where of public.orders is not valid for it: column \"idd\" does "
        "not exist; write one SQL boolean expression over the table's columns (immutable "
        "built-in functions and operators only)",
    ),
    "two_statements": (
        {"tables": [{"name": "public.orders", "where": "id > 3; DROP TABLE public.orders"}]},
        "postgres.tables: the where of public.orders is not valid: it holds a ; (one SQL "
        "boolean expression, not statements); write one SQL boolean expression over the "
        "table's columns",
    ),
    "partitioned_filter_without_root": (
        {"tables": [{"name": "public.m", "where": "k > 1"}], "publish_via_partition_root": False},
        "postgres.tables: public.m is a partitioned table and postgres.publish_via_partition_root "
        "is false: PostgreSQL takes no row filter or column list for it then (each partition is "
        "published as itself); set publish_via_partition_root: true, or move where/columns to "
        "entries for its partitions",
    ),
    "pattern_matches_nothing": (
        {"tables": ["public.orders", "sales.*"]},
        "postgres.tables: pattern sales.* matches no table; fix the pattern, or create the "
        "tables first",
    ),
    "origin_none_on_15": (
        {"tables": ["public.orders"], "origin": "none"},
        "postgres.origin none needs PostgreSQL 16 or newer (pgoutput's origin option), but the "
        "server is PostgreSQL {version}; set postgres.origin: any",
    ),
    "generated_columns_on_15": (
        {"tables": ["public.orders"], "publish_generated_columns": True},
        "postgres.publish_generated_columns needs PostgreSQL 18 or newer, but the server is "
        "PostgreSQL {version}; set postgres.publish_generated_columns: false",
    ),
    "pattern_takes_a_keyless_table": (
        {"tables": ["public.*"]},
        "table public.keyless (no primary key) has no replica identity: in publication cdcd, "
        "which publishes updates and deletes, the application's UPDATE and DELETE on it would "
        "fail, so cdcd refuses to publish it; add a primary key; or ALTER TABLE public.keyless "
        "REPLICA IDENTITY FULL (or USING INDEX), or set replica_identity: full on its "
        "postgres.tables entry to let cdcd do it; or publish only inserts for it (a "
        "publication WITH (publish = 'insert, truncate') and create_publication: false)",
    ),
}


def test_each_refusal_is_one_line_and_nothing_is_created(
    pg: PgDatabase,
    broker: LocalBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pg.execute(TABLES)
    row = pg.fetchone("SHOW server_version")
    assert row is not None
    version = str(row[0]).split()[0]
    configs = {
        name: write_config(
            tmp_path / f"{name}.yaml",
            pg.dsn,
            broker.bootstrap_servers,
            prefix=pg.dbname,
            slot="cdcd_" + pg.dbname[:40],
            postgres=settings,
        )
        for name, (settings, _) in CASES.items()
    }
    runs = {
        name: subprocess.Popen(
            cdcd_argv("run", "-c", str(path)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, path in configs.items()
    }
    wrong: list[str] = []
    try:
        for name, (_, line) in CASES.items():
            expected = line.format(version=version)
            capsys.readouterr()
            code = main(["check", "-c", str(configs[name])])
            printed = capsys.readouterr().out.splitlines()
            if code != 2 or f"FAIL {expected}" not in printed:
                wrong.append(f"check {name}: exit {code}, printed {printed}")
        for name, process in runs.items():
            _, stderr = process.communicate(timeout=60)
            expected = "cdcd: error: " + CASES[name][1].format(version=version)
            if process.returncode != 2 or expected not in stderr.splitlines():
                wrong.append(f"run {name}: exit {process.returncode}, stderr {stderr[-2000:]}")
    finally:
        for process in runs.values():  # a daemon that did not refuse runs on: stop it
            if process.poll() is None:
                process.kill()
                process.wait()
    assert wrong == []
    # Refused before anything was created.
    assert pg.fetchall("SELECT pubname FROM pg_publication") == []
    assert pg.fetchall(
        "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
    ) == []
    # The application's writes were never in danger.
    pg.execute("INSERT INTO public.keyless VALUES (1, 'x'); UPDATE public.keyless SET b = 'y'")
