"""Row filters, column lists and options of the publication, from postgres.tables (PostgreSQL 15).

cdcd's own publication is created with them and follows the configuration
at every start (ALTER PUBLICATION, one log line per change); one it does not
own that differs is refused with the difference named. What the publication
holds is read back from PostgreSQL (pg_publication_tables, pg_publication).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import cdcd_argv, run_cdcd
from support.pg import PgDatabase

from cdcd.config.model import PostgresConfig
from cdcd.source.database import SourceDatabase
from cdcd.source.publication_plan import OWNED_PUBLICATION_COMMENT

pytestmark = pytest.mark.integration

ORDERS = (
    "CREATE TABLE public.orders (id int PRIMARY KEY, region text, amount numeric, card text);"
    "CREATE TABLE public.items (id int PRIMARY KEY, order_id int, note text)"
)


def _published(pg: PgDatabase, publication: str = "cdcd") -> dict[str, tuple[Any, Any]]:
    rows = pg.fetchall(
        "SELECT schemaname || '.' || tablename, attnames, rowfilter FROM pg_publication_tables "
        "WHERE pubname = %s",
        (publication,),
    )
    return {name: (list(cols), rowfilter) for name, cols, rowfilter in rows}


def _via_root(pg: PgDatabase) -> bool:
    row = pg.fetchone("SELECT pubviaroot FROM pg_publication WHERE pubname = 'cdcd'")
    assert row is not None
    return bool(row[0])


def _config(pg: PgDatabase, tables: list[Any], **settings: Any) -> PostgresConfig:
    return PostgresConfig(dsn=pg.dsn, slot="s", publication="cdcd", tables=tables, **settings)


def _changes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cdcd.source"]


def test_own_publication_is_created_with_filters_and_follows_the_config(
    pg: PgDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    pg.execute(ORDERS)
    caplog.set_level(logging.INFO, logger="cdcd.source")
    orders = {"name": "public.orders", "where": "id > 3", "columns": ["region", "id"]}
    with SourceDatabase(pg.dsn) as db:
        db.ensure_publication(_config(pg, [orders]))
        assert _published(pg) == {"public.orders": (["id", "region"], "(id > 3)")}
        assert _via_root(pg)
        assert pg.fetchone(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication"
        ) == (OWNED_PUBLICATION_COMMENT,)

        # The same filter spelt otherwise, the columns in another order: no drift.
        caplog.clear()
        same = {"name": "public.orders", "where": "(ID>3)", "columns": ["id", "region"]}
        plan = db.ensure_publication(_config(pg, [same]))
        assert plan.drift == ()
        assert not any("was" in line for line in _changes(caplog))

        # Changed in the YAML: filter, columns, the partition root option; a
        # new table with its own filter.
        caplog.clear()
        changed = {"name": "public.orders", "where": "id > 10", "columns": ["id", "amount"]}
        items = {"name": "public.items", "where": "id IS NOT NULL AND id < 100"}
        pg_config = _config(pg, [changed, items], publish_via_partition_root=False)
        db.ensure_publication(pg_config)
        assert _published(pg) == {
            "public.orders": (["id", "amount"], "(id > 10)"),
            "public.items": (
                ["id", "order_id", "note"],
                "((id IS NOT NULL) AND (id < 100))",
            ),
        }
        assert not _via_root(pg)
        assert _changes(caplog) == [
            "publication cdcd: public.orders row filter was (id > 3), now (id > 10) "
            "(as postgres.tables says)",
            "publication cdcd: public.orders column list was (id, region), now (id, amount) "
            "(as postgres.tables says)",
            "publication cdcd: option publish_via_partition_root was true, now false "
            "(as postgres.publish_via_partition_root says)",
            "added table public.items to publication cdcd",
        ]
        # Filter and column list dropped again: every row, every column.
        caplog.clear()
        db.ensure_publication(_config(pg, ["public.orders", "public.items"]))
        assert _published(pg) == {
            "public.orders": (["id", "region", "amount", "card"], None),
            "public.items": (["id", "order_id", "note"], None),
        }
        assert "publication cdcd: public.orders row filter was (id > 10), now no row filter " \
            "(as postgres.tables says)" in _changes(caplog)
    # The application's writes still work on every table (identity rules kept).
    pg.execute("INSERT INTO public.orders VALUES (1, 'eu', 1, 'x'); "
               "UPDATE public.orders SET amount = 2; DELETE FROM public.orders")


def test_a_publication_cdcd_does_not_own_is_refused_when_it_differs(
    pg: PgDatabase, cdc_config: Callable[..., Path]
) -> None:
    pg.execute(ORDERS)
    pg.execute("CREATE PUBLICATION cdcd FOR TABLE public.orders WHERE (region = 'us')")
    tables = [{"name": "public.orders", "where": "region = 'eu'"}]
    # The filter names a non-key column: allowed only without UPDATE/DELETE.
    pg.execute("ALTER PUBLICATION cdcd SET (publish = 'insert, truncate')")
    config = cdc_config(tables=tables, postgres={"create_publication": True})
    line = (
        "publication cdcd: public.orders has row filter (region = 'us'::text), "
        "postgres.tables says (region = 'eu'); make them agree (ALTER PUBLICATION \"cdcd\" "
        "DROP TABLE public.orders; ALTER PUBLICATION \"cdcd\" ADD TABLE public.orders WHERE "
        "(region = 'eu')) or change postgres to match; cdcd changes only a publication it "
        "created (create_publication: true)"
    )
    run = subprocess.run(
        cdcd_argv("run", "-c", str(config)),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 3, run.stderr
    assert f"cdcd: error: {line}" in run.stderr.splitlines()
    check = run_cdcd("check", "-c", str(config))
    assert f"FAIL {line}" in check.stdout.splitlines(), check.stdout
    assert check.returncode == 1
    # Nothing was changed, and no slot made.
    assert _published(pg) == {
        "public.orders": (["id", "region", "amount", "card"], "(region = 'us'::text)")
    }
    assert pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE database = current_database()") == []
    with SourceDatabase(pg.dsn) as db:
        # The same filter, spelt otherwise, is no drift ...
        same = _config(pg, [{"name": "public.orders", "where": "REGION='us'"}])
        assert db.plan_publication(same).error() is None
        # ... but compared as PostgreSQL deparses it: operands swapped differ.
        swapped = _config(pg, [{"name": "public.orders", "where": "'us' = region"}])
        assert [d.what for d in db.plan_publication(swapped).drift] == ["row filter"]
        # postgres.tables omitted: the publication is taken as it is.
        as_found = PostgresConfig(dsn=pg.dsn, slot="s", publication="cdcd")
        assert db.plan_publication(as_found).error() is None
