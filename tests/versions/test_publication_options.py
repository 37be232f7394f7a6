"""Publication settings that depend on the server version, on the servers that have them.

* PostgreSQL 14 refuses ``where``/``columns`` (row filters are 15+): one
  line, exit 2, from ``check`` and ``run``, nothing created;
* PostgreSQL 16 with ``origin: none``: a change made under a replication
  origin (as a subscription applies it) is not captured, the others are;
* PostgreSQL 18 with ``publish_generated_columns: true``: a stored
  generated column is published, in the Avro schema and in every row.

Each builds its own cluster of that major (skipped where not installed,
except in CI) and compares the topic with ``SELECT``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cdc import (
    Change,
    DaemonProcess,
    SchemaBook,
    cdcd_argv,
    read_changes,
    read_records,
    replay,
    wait_for,
    write_config,
)
from support.pg import PgDatabase, require_version

from cdcd.cli import main
from cdcd.naming import table_topic
from cdcd.tools.local import LocalBroker, LocalPostgres

pytestmark = pytest.mark.integration


@pytest.fixture
def on_version(
    make_pg_cluster: Callable[..., LocalPostgres], request: pytest.FixtureRequest
) -> Iterator[Callable[[int], PgDatabase]]:
    """``on_version(16)``: a database on a fresh cluster of that major."""
    made: list[PgDatabase] = []

    def make(version: int) -> PgDatabase:
        require_version(version)
        cluster = make_pg_cluster(version=version)
        name = f"v{version}_{request.node.originalname[5:35]}"
        cluster.create_database(name)
        db = PgDatabase(cluster=cluster, dbname=name)
        made.append(db)
        return db

    yield make
    for db in made:
        db.close_connections()


def _config(db: PgDatabase, broker: LocalBroker, path: Path, **postgres: Any) -> Path:
    return write_config(
        path, db.dsn, broker.bootstrap_servers, prefix=db.dbname, slot="cdcd_" + db.dbname,
        postgres=postgres,
    )


def _streaming(db: PgDatabase) -> None:
    wait_for(
        lambda: db.fetchall("SELECT 1 FROM pg_replication_slots WHERE active"),
        what="the daemon to stream",
    )


def _changes(db: PgDatabase, broker: LocalBroker, table: str, at_least: int) -> list[Change]:
    """Every change of ``public.<table>`` once ``at_least`` arrived (schemas read after them)."""
    topic = table_topic(db.dbname, "public", table)
    read_records(broker.bootstrap_servers, [topic], expected=at_least)
    return read_changes(broker.bootstrap_servers, db.dbname, [topic], idle_s=1.0)


def test_row_filters_are_refused_below_15(
    on_version: Callable[[int], PgDatabase],
    broker: LocalBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = on_version(14)
    db.execute("CREATE TABLE public.orders (id int PRIMARY KEY, region text)")
    version = str(db.fetchone("SHOW server_version")[0]).split()[0]  # type: ignore[index]
    config = _config(
        db, broker, tmp_path / "c.yaml", tables=[{"name": "public.orders", "where": "id > 1"}]
    )
    line = (
        "postgres.tables: public.orders sets where, which needs PostgreSQL 15 or newer (row "
        f"filters), but the server is PostgreSQL {version}; remove where from its entry, or "
        "upgrade the server"
    )
    assert main(["check", "-c", str(config)]) == 2
    assert f"FAIL {line}" in capsys.readouterr().out.splitlines()
    run = subprocess.run(
        cdcd_argv("run", "-c", str(config)),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert (run.returncode, run.stderr.splitlines()[-1]) == (2, f"cdcd: error: {line}")
    assert db.fetchall("SELECT 1 FROM pg_publication UNION ALL SELECT 1 FROM pg_replication_slots") == []


def test_origin_none_skips_replicated_changes_on_16(
    on_version: Callable[[int], PgDatabase],
    broker: LocalBroker,
    daemons: Callable[[Path], DaemonProcess],
    tmp_path: Path,
) -> None:
    db = on_version(16)
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY, source text)")
    daemons(_config(db, broker, tmp_path / "c.yaml", tables=["public.t"], origin="none"))
    _streaming(db)
    db.execute("SELECT pg_replication_origin_create('upstream')")
    local = db.connect()
    replicated = db.connect()
    with replicated.cursor() as cur:
        # What a subscription's apply worker does: its changes carry the origin.
        cur.execute("SELECT pg_replication_origin_session_setup('upstream')")
    with local.cursor() as cur, replicated.cursor() as rcur:
        cur.execute("INSERT INTO public.t VALUES (1, 'local'), (2, 'local')")
        rcur.execute("INSERT INTO public.t VALUES (3, 'replicated'), (4, 'replicated')")
        rcur.execute("UPDATE public.t SET source = 'replicated' WHERE id = 1")
        cur.execute("INSERT INTO public.t VALUES (5, 'local')")  # the last: all before it is in
    changes = _changes(db, broker, "t", 3)
    captured = replay(changes, ("id",))
    assert len(changes) == 3
    local_rows = db.fetchall("SELECT id FROM public.t WHERE id IN (1, 2, 5) ORDER BY id")
    assert sorted(captured) == [tuple(r) for r in local_rows]
    # The replicated ones are in the table all the same: the test can tell.
    assert db.fetchall("SELECT count(*) FROM public.t WHERE source = 'replicated'") == [(3,)]
    assert captured[(1,)]["source"] == "local"


def test_generated_columns_are_published_on_18(
    on_version: Callable[[int], PgDatabase],
    broker: LocalBroker,
    daemons: Callable[[Path], DaemonProcess],
    tmp_path: Path,
) -> None:
    db = on_version(18)
    db.execute(
        "CREATE TABLE public.g (id int PRIMARY KEY, v int, "
        "doubled int GENERATED ALWAYS AS (v * 2) STORED)"
    )
    config = _config(
        db, broker, tmp_path / "c.yaml", tables=["public.g"], publish_generated_columns=True
    )
    daemons(config)
    _streaming(db)
    assert db.fetchall("SELECT pubgencols::text FROM pg_publication") == [("s",)]
    db.execute("INSERT INTO public.g (id, v) VALUES (1, 10), (2, 20)")
    db.execute("UPDATE public.g SET v = 21 WHERE id = 2")
    changes = _changes(db, broker, "g", 3)
    captured = replay(changes, ("id",))
    rows = db.fetchall("SELECT id, v, doubled FROM public.g ORDER BY id")
    assert [(r["id"], r["v"], r["doubled"]) for _, r in sorted(captured.items())] == [
        tuple(r) for r in rows
    ]
    book = SchemaBook()
    book.load(broker.bootstrap_servers, db.dbname)
    assert any("doubled" in str(schema) for schema in book.raw.values())
