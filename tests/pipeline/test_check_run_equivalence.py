"""Every refusal ``cdcd run`` makes before streaming, ``cdcd check`` reports in the same words
(issue 25).

Both run the one startup plan (``cdcd.pipeline.startup``): ``run`` for real,
``check`` dry. For each step that can refuse, a configuration that makes it
refuse; ``run`` and ``check`` are started as processes (as an operator would)
on the same PostgreSQL database and broker, and ``check`` must print a FAIL
line carrying ``run``'s error line: the same message and the same hint
(``run``'s "still failing after N s of retries" aside, which ``check`` says as
"at start for N s, then exits 1"), and exit 2 where ``run`` exits 2. Every
scenario but Kafka's also shows that ``run`` changed nothing: no slot, no
publication was created (Kafka is checked after the slot exists, so that
capture starts when cdcd starts, even while the broker is out of reach).

All scenarios share one database, prepared once; their processes run side by
side. The wal_level refusal needs a cluster of its own: opt-in (``slow``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT, SHORT_STARTUP_RETRY, cdcd_argv, write_config
from support.pg import PgDatabase, create_publication, create_slot

from cdcd.pipeline.slot_record import remember_slot
from cdcd.snapshot.daemons import register
from cdcd.snapshot.store import SignalTable
from cdcd.source.database import SourceDatabase
from cdcd.source.slots import SlotInfo

pytestmark = pytest.mark.integration

_names = itertools.count(1)
_RETRY = re.compile(r" \(still failing after \d+ s of retries at startup\)")


@dataclass(frozen=True)
class Scenario:
    """A configuration ``run`` refuses; ``what`` is a fragment its error must contain."""

    what: str
    slot: str = "eq"
    publication: str = "eq_pub"
    tables: list[str] | None = field(default_factory=lambda: ["public.keyed"])
    postgres: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    dsn: Callable[[PgDatabase], str] = lambda pg: pg.dsn
    kafka: str | None = None  # bootstrap servers; None: the session broker


#: The one refusal that comes after the slot is created: Kafka is checked last,
#: so capture starts when cdcd starts even while the broker is out of reach.
KAFKA_SLOT = "eq_kafka"

#: One per refusal of the plan's steps (the step's name first).
SCENARIOS: dict[str, Scenario] = {
    "connect: wrong password": Scenario(
        "password authentication failed",
        dsn=lambda pg: pg.dsn.replace("user=postgres", "user=eq_pw password=wrong")),
    "connect: missing database": Scenario(
        "does not exist", dsn=lambda pg: pg.dsn.replace(f"dbname={pg.dbname}", "dbname=eq_nope")),
    "connect: unknown role": Scenario(
        "eq_nobody", dsn=lambda pg: pg.dsn.replace("user=postgres", "user=eq_nobody")),
    "privileges: no REPLICATION": Scenario(
        "REPLICATION", postgres={"create_publication": False}, publication="eq_existing",
        dsn=lambda pg: pg.dsn.replace("user=postgres", "user=eq_norepl")),
    "protocol: newer than the server": Scenario("protocol", postgres={"protocol_version": 4}),
    "failover: server without failover slots": Scenario(
        "failover", postgres={"failover": True}),
    "signal table: a bad name": Scenario(
        "eq.bad.name", extra={"snapshot": {"signal_table": "eq.bad.name"}}),
    "shared publication": Scenario(
        "used by the daemon of slot eq_other", publication="eq_shared"),
    "publication: missing table": Scenario("public.nope", tables=["public.nope"]),
    "publication: no replica identity": Scenario(
        "public.keyless", tables=["public.keyed", "public.keyless"], publication="eq_new"),
    "publication: absent": Scenario(
        "does not exist", publication="eq_absent", postgres={"create_publication": False}),
    "publication: lacks a table": Scenario(
        "lacks public.other", publication="eq_existing", tables=["public.keyed", "public.other"],
        postgres={"create_publication": False}),
    "slot state: lost": Scenario("eq_lost", slot="eq_lost", publication="eq_existing"),
    "initial snapshot: signal table out of reach": Scenario(
        "eq_signal_initial", publication="eq_existing", postgres={"create_publication": False},
        extra={"snapshot": {"mode": "initial", "signal_table": "public.eq_signal_initial"}},
        dsn=lambda pg: pg.dsn.replace("user=postgres", "user=eq_repl")),
    "slot: missing, create_slot false": Scenario(
        "does not exist", slot="eq_absent_slot", publication="eq_existing",
        postgres={"create_slot": False}),
    "slot: another plugin": Scenario("test_decoding", slot="eq_td", publication="eq_existing"),
    "kafka: unreachable": Scenario(
        "127.0.0.1:1", slot=KAFKA_SLOT, publication="eq_existing", kafka="127.0.0.1:1"),
    "metrics: address in use": Scenario("metrics.listen", publication="eq_existing"),
}


@dataclass
class Outcome:
    run: subprocess.CompletedProcess[str]
    check: subprocess.CompletedProcess[str]
    slots_after: set[str]
    publications_after: set[str]


#: Only this role must give a password, over TCP (the rest of the cluster is trust).
_HBA_RULE = "host all eq_pw 127.0.0.1/32 scram-sha-256\n"


def _prepare(pg: PgDatabase) -> None:
    pg.execute("DROP ROLE IF EXISTS eq_pw")
    pg.execute("CREATE ROLE eq_pw LOGIN REPLICATION PASSWORD 'right'")
    hba = pg.cluster.datadir / "pg_hba.conf"
    hba.write_text(_HBA_RULE + hba.read_text(encoding="utf-8"), encoding="utf-8")
    pg.cluster.reload()
    pg.execute("CREATE TABLE keyed(id int PRIMARY KEY)")
    pg.execute("CREATE TABLE other(id int PRIMARY KEY)")
    pg.execute("CREATE TABLE keyless(v text)")
    conn = pg.connect()
    create_publication(conn, "eq_existing", ["public.keyed"])
    create_publication(conn, "eq_shared", ["public.other"])
    for role, attributes in (("eq_norepl", "LOGIN"), ("eq_repl", "LOGIN REPLICATION")):
        pg.execute(f"DROP ROLE IF EXISTS {role}")
        pg.execute(f"CREATE ROLE {role} {attributes}")
        pg.execute(f"GRANT SELECT ON keyed, other TO {role}")
    pg.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    with conn.cursor() as cur:
        cur.execute("SELECT pg_create_logical_replication_slot('eq_td', 'test_decoding')")
    create_slot(conn, "eq_other")
    with SourceDatabase(pg.dsn) as db:
        signals = SignalTable(db, "public.cdcd_signal")
        signals.ensure()
        # Another daemon that captures public.other through eq_shared.
        register(signals, "eq_other", "eq_shared", ["public.other"])
        # A slot cdcd streamed from, since dropped: lost.
        create_slot(conn, "eq_lost")
        info = db.slot_info("eq_lost")
        assert isinstance(info, SlotInfo)
        remember_slot(signals, info)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot('eq_lost')")


def _objects(pg: PgDatabase) -> tuple[set[str], set[str]]:
    slots = {r[0] for r in pg.fetchall("SELECT slot_name FROM pg_replication_slots "
                                       "WHERE database = current_database()")}
    publications = {r[0] for r in pg.fetchall("SELECT pubname FROM pg_publication")}
    return slots, publications


@pytest.fixture(scope="module")
def outcomes(pg_cluster: Any, broker: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, Outcome]]:
    """Every scenario's ``run`` and ``check``, all started together on one prepared database."""
    pg = PgDatabase(cluster=pg_cluster, dbname=f"equivalence_{next(_names)}")
    pg_cluster.create_database(pg.dbname)
    tmp = tmp_path_factory.mktemp("equivalence")
    busy = socket.socket()
    try:
        _prepare(pg)
        before = _objects(pg)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        jobs: dict[tuple[str, str], list[str]] = {}
        # The scenarios that wait for an unreachable broker (run retries it for
        # its whole startup window) start first: the others run meanwhile.
        waiting = sorted(SCENARIOS.items(), key=lambda item: item[1].kafka is None)
        for index, (name, scenario) in enumerate(waiting):
            listen = (f"127.0.0.1:{busy.getsockname()[1]}" if name.startswith("metrics")
                      else "127.0.0.1:0")
            config = write_config(
                tmp / f"{index}.yaml", scenario.dsn(pg), scenario.kafka or broker.bootstrap_servers,
                slot=scenario.slot, publication=scenario.publication, tables=scenario.tables,
                postgres=scenario.postgres,
                extra={"metrics": {"listen": listen}, **scenario.extra},
            )
            for command in ("run", "check"):
                jobs[(name, command)] = cdcd_argv(command, "-c", str(config),
                                                  hooks=SHORT_STARTUP_RETRY)

        def start(argv: list[str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(argv, cwd=PROJECT_ROOT, capture_output=True, text=True,
                                  timeout=180)

        with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
            futures = {key: pool.submit(start, argv) for key, argv in jobs.items()}
            done = {key: future.result() for key, future in futures.items()}
        slots, publications = _objects(pg)
        assert (slots - {KAFKA_SLOT}, publications) == before, "a refused run changed the database"
        yield {name: Outcome(done[(name, "run")], done[(name, "check")], slots, publications)
               for name in SCENARIOS}
    finally:
        busy.close()
        hba = pg_cluster.datadir / "pg_hba.conf"
        hba.write_text(hba.read_text(encoding="utf-8").replace(_HBA_RULE, ""), encoding="utf-8")
        pg_cluster.reload()
        pg.drop()
        for role in ("eq_norepl", "eq_repl", "eq_pw"):
            pg_cluster.execute(f"DROP ROLE IF EXISTS {role}")


def _run_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error: ")]
    assert len(lines) == 1, f"exit {result.returncode}:\n{result.stderr}"
    return lines[0].removeprefix("cdcd: error: ")


def assert_check_says_what_run_said(outcome: Outcome, what: str) -> None:
    run, check = outcome.run, outcome.check
    assert run.returncode in (1, 2, 3), f"run was not refused (exit {run.returncode}): {run.stderr}"
    error = _run_error(run)
    assert what in error, (what, error)
    fails = [line for line in check.stdout.splitlines() if line.startswith("FAIL ")]
    if _RETRY.search(error):
        # Transient: run retried it at start, then gave up (exit 1).
        message, hint = _RETRY.split(error, maxsplit=1)
        said = [line for line in fails if message in line and hint in line
                and "then exits 1" in line]
    else:
        said = [line for line in fails if line.endswith(error)]
    assert len(said) == 1, f"run said:\n  {error}\ncheck's FAIL lines:\n  " + "\n  ".join(fails)
    # A configuration mistake is exit 2 from both; anything else fails check with 1.
    assert check.returncode == (2 if run.returncode == 2 else 1), (run.returncode, check.stdout)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_check_reports_the_refusal_of_run(outcomes: dict[str, Outcome], name: str) -> None:
    assert_check_says_what_run_said(outcomes[name], SCENARIOS[name].what)


@pytest.mark.slow
def test_check_reports_the_wal_level_refusal_of_run(
    make_pg_cluster: Callable[..., Any], broker: Any, tmp_path: Path
) -> None:
    cluster = make_pg_cluster(settings={"wal_level": "replica"})
    cluster.create_database("eq_wal")
    config = write_config(tmp_path / "c.yaml", cluster.dsn("eq_wal"), broker.bootstrap_servers)
    run, check = (
        subprocess.run(cdcd_argv(command, "-c", str(config), hooks=SHORT_STARTUP_RETRY),
                       cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180)
        for command in ("run", "check")
    )
    assert_check_says_what_run_said(Outcome(run, check, set(), set()), "wal_level")


def test_with_kafka_out_of_reach_run_still_starts_capture(outcomes: dict[str, Outcome]) -> None:
    """The slot exists (changes from now on are kept) though run exits for Kafka."""
    outcome = outcomes["kafka: unreachable"]
    assert outcome.run.returncode != 0
    assert KAFKA_SLOT in outcome.slots_after
