"""cdcd never makes the application's writes fail (issue 12).

PostgreSQL refuses the *application's* UPDATE and DELETE on a table without a
replica identity as soon as the table is in a publication that publishes them
("cannot update table ... because it does not have a replica identity and
publishes updates"). So cdcd refuses such a table before it touches the
publication (exit 2, one line with the three ways out), unless the table's
entry opts in to ``replica_identity: full``, which cdcd then sets; and a
publication cdcd created follows ``postgres.tables`` when tables are removed.

For every table state the application's UPDATE and DELETE are run for real
while the daemon runs (or right after it refused), and what happened is read
back from PostgreSQL's own catalogs (pg_publication_tables, pg_class), not
from what cdcd meant to do.
"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
from support.cdc import read_changes, run_cdcd, wait_for, wait_streaming, write_config
from support.pg import current_wal_lsn, slot_confirmed_flush_lsn

from cdcd.errors import DefiniteError

pytestmark = pytest.mark.integration

PUBLICATION = "cdcd"  # write_config's default

#: The states PostgreSQL accepts UPDATE/DELETE for, and those it refuses.
ACCEPTED = {
    "with_pk": "CREATE TABLE with_pk(id int PRIMARY KEY, v text)",
    "with_index": "CREATE TABLE with_index(id int NOT NULL, v text); "
    "CREATE UNIQUE INDEX with_index_id ON with_index(id); "
    "ALTER TABLE with_index REPLICA IDENTITY USING INDEX with_index_id",
    "with_full": "CREATE TABLE with_full(id int, v text); "
    "ALTER TABLE with_full REPLICA IDENTITY FULL",
}
REFUSED = {
    "no_key": ("CREATE TABLE no_key(id int, v text)", "no primary key"),
    "nothing": (
        "CREATE TABLE nothing(id int PRIMARY KEY, v text); "
        "ALTER TABLE nothing REPLICA IDENTITY NOTHING",
        "replica identity NOTHING",
    ),
    "index_gone": (
        "CREATE TABLE index_gone(id int NOT NULL, v text); "
        "CREATE UNIQUE INDEX index_gone_id ON index_gone(id); "
        "ALTER TABLE index_gone REPLICA IDENTITY USING INDEX index_gone_id; "
        "DROP INDEX index_gone_id",
        "its replica identity index is gone",
    ),
}

_ids = itertools.count(1)


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``cdcd: error`` line of a failed run, without its prefix."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0].removeprefix("cdcd: error: ")


def _published(pg, publication: str = PUBLICATION) -> set[str]:
    rows = pg.fetchall(
        "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
        (publication,),
    )
    return {r[0] for r in rows}


def _publication_exists(pg, publication: str = PUBLICATION) -> bool:
    return bool(pg.fetchall("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)))


def _comment(pg, publication: str = PUBLICATION) -> str | None:
    row = pg.fetchone(
        "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = %s",
        (publication,),
    )
    return row[0] if row else None


def _identity(pg, table: str) -> str:
    row = pg.fetchone("SELECT relreplident FROM pg_class WHERE oid = %s::regclass", (table,))
    assert row is not None
    return str(row[0])


def _application_writes(pg, table: str) -> tuple[int, int]:
    """The application's INSERT, UPDATE and DELETE on ``table``; fails if PostgreSQL refuses.

    Returns the ids of the updated and the deleted row.
    """
    kept, gone = next(_ids), next(_ids)
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table}(id, v) VALUES (%s, 'app'), (%s, 'app')", (kept, gone))
        cur.execute(f"UPDATE {table} SET v = 'app-updated' WHERE id = %s", (kept,))
        assert cur.rowcount == 1
        cur.execute(f"DELETE FROM {table} WHERE id = %s", (gone,))
        assert cur.rowcount == 1
    assert pg.fetchall(f"SELECT v FROM {table} WHERE id IN (%s, %s)", (kept, gone)) == [
        ("app-updated",)
    ]
    return kept, gone


def _wait_streaming(pg, daemon) -> None:
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot, daemon)


def _wait_delivered(pg, daemon) -> None:
    """Until the slot confirms everything written so far: it is all in Kafka then."""
    slot = "cdcd_" + pg.dbname[:50]
    conn = pg.connect()
    target = current_wal_lsn(conn)
    wait_for(
        lambda: not daemon.alive() or slot_confirmed_flush_lsn(conn, slot) >= target,
        what="the daemon to confirm every write",
    )
    assert daemon.alive(), daemon.log()


def test_accepted_states_and_the_opt_in_keep_the_applications_writes_working(
    pg, broker, cdc_config, daemons
) -> None:
    for ddl in ACCEPTED.values():
        pg.execute(ddl)
    pg.execute("CREATE TABLE opted(id int, v text)")
    tables = [f"public.{name}" for name in ACCEPTED]
    config = cdc_config(tables=[*tables, {"name": "public.opted", "replica_identity": "full"}])

    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    assert (
        "ok   table public.opted: no primary key; will be set to REPLICA IDENTITY FULL "
        "(replica_identity: full)" in check.stdout.splitlines()
    ), check.stdout
    assert _identity(pg, "opted") == "d" and not _publication_exists(pg)  # check changed nothing

    daemon = daemons(config)
    _wait_streaming(pg, daemon)
    assert _identity(pg, "opted") == "f"
    assert _published(pg) == {*tables, "public.opted"}
    assert _comment(pg) == "managed by cdcd: membership follows postgres.tables"
    assert "set REPLICA IDENTITY FULL on table public.opted (replica_identity: full)" in daemon.log()
    for table in [*ACCEPTED, "opted"]:
        _application_writes(pg, table)
        assert daemon.alive(), daemon.log()

    # The opted-in table's changes arrive, with whole old rows (FULL).
    kept, gone = _application_writes(pg, "opted")
    topic = f"{pg.dbname}.public.opted"

    _wait_delivered(pg, daemon)
    found = read_changes(broker.bootstrap_servers, pg.dbname, [topic])
    ordered = sorted((c for c in found if c.value), key=lambda c: (c.lsn, c.seq))
    ops = [(c.value["op"], (c.value["after"] or c.value["before"])["id"]) for c in ordered]
    assert ops[-4:] == [("c", kept), ("c", gone), ("u", kept), ("d", gone)], ops
    assert daemon.terminate() == 0, daemon.log()


@pytest.mark.parametrize("state", sorted(REFUSED))
def test_table_without_identity_is_refused_before_the_publication_is_touched(
    pg, broker, cdc_config, state: str
) -> None:
    ddl, reason = REFUSED[state]
    pg.execute(ACCEPTED["with_pk"])
    pg.execute(ddl)
    config = cdc_config(tables=["public.with_pk", f"public.{state}"])

    # No publication yet: cdcd would create it -- refused, nothing created.
    run = run_cdcd("run", "-c", str(config))
    assert run.returncode == 2, run.stderr
    line = _error_line(run)
    assert line.startswith(f"table public.{state} ({reason}) has no replica identity"), line
    for way_out in (
        "add a primary key",
        f"ALTER TABLE public.{state} REPLICA IDENTITY FULL (or USING INDEX)",
        "replica_identity: full",
        "WITH (publish = 'insert, truncate') and create_publication: false",
    ):
        assert way_out in line, (way_out, line)
    assert not _publication_exists(pg)
    _application_writes(pg, state)

    # A publication exists: cdcd would ALTER ... ADD TABLE -- refused, unchanged.
    pg.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE with_pk")
    run = run_cdcd("run", "-c", str(config))
    assert run.returncode == 2, run.stderr
    assert _error_line(run) == line
    assert _published(pg) == {"public.with_pk"}
    _application_writes(pg, state)

    # check says the same, and exits 2 as run does.
    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"FAIL {line}" in check.stdout.splitlines(), check.stdout
    assert "ok   table public.with_pk: primary key (id)" in check.stdout.splitlines()
    assert _published(pg) == {"public.with_pk"}


def test_table_removed_from_the_config_leaves_the_owned_publication(
    pg, broker, cdc_config, daemons
) -> None:
    pg.execute(ACCEPTED["with_pk"])
    pg.execute("CREATE TABLE removed(id int PRIMARY KEY, v text)")
    daemon = daemons(cdc_config(tables=["public.with_pk", "public.removed"]))
    _wait_streaming(pg, daemon)
    assert daemon.terminate() == 0, daemon.log()
    assert _published(pg) == {"public.with_pk", "public.removed"}

    config = cdc_config(tables=["public.with_pk"])
    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    assert (
        f"ok   publication {PUBLICATION}: public.removed no longer in postgres.tables, "
        "will be dropped from it" in check.stdout.splitlines()
    ), check.stdout
    assert _published(pg) == {"public.with_pk", "public.removed"}

    daemon = daemons(config)
    _wait_streaming(pg, daemon)
    assert _published(pg) == {"public.with_pk"}
    assert (
        f"dropped table public.removed from publication {PUBLICATION}: no longer in "
        "postgres.tables" in daemon.log()
    )
    # Out of the publication, the table may lose its key without breaking the application.
    pg.execute("ALTER TABLE removed DROP CONSTRAINT removed_pkey")
    _application_writes(pg, "removed")
    _application_writes(pg, "with_pk")
    assert daemon.alive(), daemon.log()
    assert daemon.terminate() == 0, daemon.log()


def test_insert_only_publication_of_the_operator_accepts_a_keyless_table(
    pg, broker, cdc_config, daemons
) -> None:
    pg.execute("CREATE TABLE events(id int, v text); CREATE TABLE other(id int, v text)")
    pg.execute(
        f"CREATE PUBLICATION {PUBLICATION} FOR TABLE events, other "
        "WITH (publish = 'insert, truncate')"
    )
    config = cdc_config(tables=["public.events"])
    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    assert any(
        line.startswith("ok   table public.events: no primary key; harmless")
        for line in check.stdout.splitlines()
    ), check.stdout

    daemon = daemons(config)
    _wait_streaming(pg, daemon)
    kept, gone = _application_writes(pg, "events")
    _application_writes(pg, "other")
    assert daemon.alive(), daemon.log()
    # Not cdcd's publication: never shrunk to postgres.tables.
    assert _published(pg) == {"public.events", "public.other"}
    assert _identity(pg, "events") == "d"

    _wait_delivered(pg, daemon)
    found = read_changes(broker.bootstrap_servers, pg.dbname, [f"{pg.dbname}.public.events"])
    inserts = sorted(c.value["after"]["id"] for c in found if c.value)
    assert inserts == [kept, gone], inserts
    assert daemon.terminate() == 0, daemon.log()


def test_for_all_tables_is_refused_when_a_table_has_no_identity(
    pg, broker, cdc_config
) -> None:
    pg.execute(ACCEPTED["with_pk"])
    pg.execute(REFUSED["no_key"][0])
    config = cdc_config()  # no tables: cdcd would create the publication FOR ALL TABLES
    run = run_cdcd("run", "-c", str(config))
    assert run.returncode == 2, run.stderr
    line = _error_line(run)
    assert line.startswith(
        f"publication {PUBLICATION} would be created FOR ALL TABLES (postgres.tables is "
        "omitted) and 1 table in the database has no replica identity: public.no_key "
        "(no primary key)"
    ), line
    assert "list the tables to capture in postgres.tables" in line
    assert not _publication_exists(pg)
    _application_writes(pg, "no_key")

    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"FAIL {line}" in check.stdout.splitlines(), check.stdout


def test_table_that_does_not_exist_is_a_configuration_error(pg, broker, cdc_config) -> None:
    pg.execute(ACCEPTED["with_pk"])
    config = cdc_config(tables=["public.with_pk", "public.nope"])
    run = run_cdcd("run", "-c", str(config))
    assert run.returncode == 2, run.stderr
    line = _error_line(run)
    assert line == "table public.nope does not exist; create it or remove it from postgres.tables"
    assert not _publication_exists(pg)
    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"FAIL {line}" in check.stdout.splitlines(), check.stdout


def test_opt_in_without_the_right_to_alter_the_table_names_the_grant(
    pg, broker, tmp_path: Path
) -> None:
    role = f"cdc_{pg.dbname}"[:63]
    pg.execute("CREATE TABLE opted(id int, v text)")
    pg.execute(f'CREATE ROLE "{role}" LOGIN REPLICATION')
    try:
        pg.execute(f'GRANT CREATE ON DATABASE "{pg.dbname}" TO "{role}"')
        config = write_config(
            tmp_path / "c.yaml",
            pg.dsn_with(user=role),
            broker.bootstrap_servers,
            prefix=pg.dbname,
            slot="cdcd_" + pg.dbname[:50],
            tables=[{"name": "public.opted", "replica_identity": "full"}],
        )
        run = run_cdcd("run", "-c", str(config))
        assert run.returncode == DefiniteError.exit_code, run.stderr
        line = _error_line(run)
        assert line.startswith(
            "not allowed to set REPLICA IDENTITY FULL on table public.opted "
            "(replica_identity: full): must be owner of table opted"
        ), line
        assert "GRANT postgres TO <cdcd role>" in line, line
        assert _identity(pg, "opted") == "d" and not _publication_exists(pg)
    finally:
        pg.execute(f'REVOKE ALL ON DATABASE "{pg.dbname}" FROM "{role}"')
        pg.execute(f'DROP ROLE "{role}"')
