"""``cdcd resync`` refuses what ``cdcd run`` refuses, in the same words, before it changes anything.

resync runs the steps of the startup plan it depends on (``cdcd.pipeline.startup``:
connection, server, privileges, protocol, failover, publication; Kafka when
there are tables), not checks of its own. For a refusal of each kind that
the two share, both are started as processes on the same database: resync's
error line equals run's, and neither left a slot, a publication or the
signal table behind.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT, SHORT_STARTUP_RETRY, cdcd_argv, write_config
from support.pg import PgDatabase, create_publication

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Refusal:
    """A configuration both refuse; ``what`` is a fragment of the error."""

    what: str
    tables: list[str] = field(default_factory=lambda: ["public.keyed"])
    postgres: dict[str, Any] = field(default_factory=dict)
    role: str | None = None  # connect as this role (LOGIN, no REPLICATION)


REFUSALS = {
    "privileges: no REPLICATION": Refusal(
        "REPLICATION", postgres={"create_publication": False, "publication": "existing"},
        role="resync_norepl"),
    "publication: missing table": Refusal("public.nope", tables=["public.keyed", "public.nope"]),
    "publication: absent": Refusal(
        "does not exist", postgres={"create_publication": False, "publication": "absent"}),
    "publication: lacks a table": Refusal(
        "lacks public.other", tables=["public.keyed", "public.other"],
        postgres={"create_publication": False, "publication": "existing"}),
}


def _error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error: ")]
    assert len(lines) == 1, f"exit {result.returncode}:\n{result.stderr}"
    return lines[0].removeprefix("cdcd: error: ")


def _objects(pg: PgDatabase) -> tuple[set[str], set[str], set[str]]:
    slots = {r[0] for r in pg.fetchall("SELECT slot_name FROM pg_replication_slots "
                                       "WHERE database = current_database()")}
    publications = {r[0] for r in pg.fetchall("SELECT pubname FROM pg_publication")}
    tables = {r[0] for r in pg.fetchall("SELECT relname FROM pg_class WHERE relkind = 'r' "
                                        "AND relnamespace = 'public'::regnamespace")}
    return slots, publications, tables


@pytest.mark.parametrize("name", list(REFUSALS))
def test_resync_refuses_as_run_does(pg: PgDatabase, broker: Any, tmp_path: Path, name: str) -> None:
    refusal = REFUSALS[name]
    pg.execute("CREATE TABLE keyed(id int PRIMARY KEY)")
    pg.execute("CREATE TABLE other(id int PRIMARY KEY)")
    create_publication(pg.connect(), "existing", ["public.keyed"])
    dsn = pg.dsn
    if refusal.role:
        pg.execute(f"DROP ROLE IF EXISTS {refusal.role}")
        pg.execute(f"CREATE ROLE {refusal.role} LOGIN")
        pg.execute(f"GRANT SELECT ON keyed, other TO {refusal.role}")
        dsn = dsn.replace("user=postgres", f"user={refusal.role}")
        assert dsn != pg.dsn
    before = _objects(pg)
    try:
        config = write_config(tmp_path / "c.yaml", dsn, broker.bootstrap_servers, slot="resync_eq",
                              tables=refusal.tables, postgres=refusal.postgres)
        argvs = [cdcd_argv(command, "-c", str(config), hooks=SHORT_STARTUP_RETRY)
                 for command in ("run", "resync")]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            run, resync = pool.map(
                lambda argv: subprocess.run(argv, cwd=PROJECT_ROOT, capture_output=True,
                                            text=True, timeout=180),
                argvs,
            )
        error = _error(run)
        assert refusal.what in error, (refusal.what, error)
        assert _error(resync) == error
        assert resync.returncode == run.returncode, (resync.returncode, run.returncode)
        assert _objects(pg) == before, "a refused run or resync changed the database"
    finally:
        if refusal.role:
            pg.execute(f"DROP OWNED BY {refusal.role}")
            pg.execute(f"DROP ROLE IF EXISTS {refusal.role}")
