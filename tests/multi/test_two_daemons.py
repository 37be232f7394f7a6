"""Two daemons on one database (issue 29): each heals its own tables, none claims the other's jobs.

Daemon A (slot ``…_a``, table ``items_a``) and daemon B (slot ``…_b``, table
``items_b``) share the database, the broker, the topic prefix and the default
signal table ``public.cdcd_signal``; each has its own publication (a
publication cdcd manages follows one daemon's ``postgres.tables``, see
docs/operations.md). A runs as a non-superuser role that owns ``items_a``, so
that a heal can be made to fail for real: its SELECT privilege on the table
is revoked before the rewrite.

What must hold, read from what consumers get (Kafka, plain fastavro) and
compared with ``SELECT *`` after the fact:

* a rewrite of ``items_b`` heals on B; A never claims nor fails that job;
* a request addressed to B's slot, and an operator's request addressed to no
  slot (a Debezium-style ``INSERT``) for ``items_b``, both seen by A alone
  (B frozen), are left pending by A and run on B once it thaws;
* the heal of ``items_a`` that cannot read the table is loud: an ERROR line
  naming the table and the reason, ``cdcd_snapshot_failures_total`` for the
  table, and the job is retried (it stays ``running``, never ``failed``;
  ``cdcd check`` fails on it); once the privilege is back, the retry heals
  the table;
* both topics, and ``cdcd mirror --once`` of both daemons' topics, equal
  both tables;
* ``cdcd check`` names the other daemon, and fails (as ``cdcd run`` refuses,
  exit 2) a configuration that would share A's publication for other tables.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.cdc import (
    PROJECT_ROOT,
    DaemonProcess,
    cdcd_argv,
    run_cdcd,
    wait_for,
    wait_streaming,
    write_config,
)
from support.pg import PgDatabase

from tests.schema_changes.helpers import (
    CREATE,
    KEY,
    heal_jobs,
    kafka_differences,
    mirror_differences,
    mirror_once,
    populate,
    wait_confirmed,
)

pytestmark = [pytest.mark.spark, pytest.mark.integration]

ROWS = 200
TIMEOUT_S = 120.0


def scrape(log: str, metric: str) -> dict[str, float]:
    """Series of ``metric`` on the daemon's /metrics (its port is in its log)."""
    port = re.search(r"serving /metrics.* listen=[\d.]+:(\d+)", log)
    assert port, log
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(metric)
    }


def job_row(pg: PgDatabase, job_id: str) -> tuple[str, dict[str, object]] | None:
    row = pg.fetchone("SELECT status, progress FROM cdcd_signal WHERE id = %s", (job_id,))
    if row is None:
        return None
    progress = row[1] if isinstance(row[1], dict) else json.loads(row[1])
    return str(row[0]), progress


def check(config: Path) -> str:
    result = run_cdcd("check", "-c", str(config))
    return result.stdout + result.stderr


@pytest.fixture
def role(pg: PgDatabase) -> Iterator[str]:
    """A login role with REPLICATION that may create the publication and the signal table."""
    name = f"r_{pg.dbname[:40]}"
    pg.execute(f"CREATE ROLE {name} LOGIN REPLICATION")
    pg.execute(f"GRANT CREATE ON DATABASE {pg.dbname} TO {name}")
    pg.execute(f"GRANT CREATE ON SCHEMA public TO {name}")
    yield name
    pg.close_connections()
    pg.execute(f"REASSIGN OWNED BY {name} TO CURRENT_USER")
    pg.execute(f"DROP OWNED BY {name}")
    pg.execute(f"DROP ROLE {name}")


def test_two_daemons_heal_their_own_tables(
    pg: PgDatabase,
    broker: object,
    role: str,
    tmp_path: Path,
    daemons: Callable[[Path], DaemonProcess],
) -> None:
    bootstrap = broker.bootstrap_servers  # type: ignore[attr-defined]
    conn = pg.connect()
    with conn.cursor() as cur:
        for table in ("items_a", "items_b"):
            cur.execute(CREATE.replace("items(", f"{table}(", 1))
        cur.execute(f"ALTER TABLE items_a OWNER TO {role}")
    slots = {side: f"cdcd_{pg.dbname[:45]}_{side}" for side in ("a", "b")}

    def config(side: str, dsn: str) -> Path:
        # Defaults otherwise: snapshot.mode never (the suite's), schema_changes.resnapshot
        # auto, signal table public.cdcd_signal for both.
        return write_config(tmp_path / f"{side}.yaml", dsn, bootstrap, prefix=pg.dbname,
                            slot=slots[side], publication=f"cdcd_{side}",
                            tables=[f"public.items_{side}"])

    # A first: it creates the shared signal table (as its own role).
    daemon_a = daemons(config("a", pg.dsn_with(user=role)))
    wait_streaming(pg, slots["a"], daemon_a)
    daemon_b = daemons(config("b", pg.dsn))
    wait_streaming(pg, slots["b"], daemon_b)
    for table in ("items_a", "items_b"):
        populate(conn, 1, ROWS, table=table)
        with conn.cursor() as cur:
            cur.execute(f"UPDATE {table} SET qty = qty + 1 WHERE id <= 20")

    # 1. B's rewrite heals on B.
    with conn.cursor() as cur:
        cur.execute("ALTER TABLE items_b ALTER COLUMN qty TYPE bigint USING qty * 10")
        cur.execute("UPDATE items_b SET name = 'after rewrite' WHERE id <= 5")
    wait_for(lambda: (jobs := heal_jobs(pg, "public.items_b")) and all(
        j.status == "done" for j in jobs), timeout_s=TIMEOUT_S, what="B's heal of items_b")
    (heal_b,) = heal_jobs(pg, "public.items_b")
    assert heal_b.progress.get("slot") == slots["b"], heal_b

    # 2. While B is frozen, A sees B's jobs alone: one addressed to B's slot, and an
    # operator's request addressed to none for B's table. A job for A's own table,
    # requested after them, tells when A has been through both (oldest first).
    daemon_b.freeze()
    pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('for-b', %s)",
               (json.dumps({"data-collections": ["public.items_b"], "slot": slots["b"]}),))
    pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('adhoc-b', "
               "'{\"data-collections\": [\"public.items_b\"]}')")
    pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('probe-a', "
               "'{\"data-collections\": [\"public.items_a\"]}')")
    wait_for(lambda: (row := job_row(pg, "probe-a")) and row[0] == "done",
             timeout_s=TIMEOUT_S, what="A to run the request for its own table")
    for job_id in ("for-b", "adhoc-b"):
        row = job_row(pg, job_id)
        assert row is not None and row[0] == "pending", f"A took B's job {job_id}: {row}"
    daemon_b.thaw()
    for job_id in ("for-b", "adhoc-b"):
        wait_for(lambda job_id=job_id: (row := job_row(pg, job_id)) and row[0] == "done",
                 timeout_s=TIMEOUT_S, what=f"B to run {job_id}")
        assert job_row(pg, job_id)[1].get("slot") == slots["b"]  # type: ignore[index]

    # 3. A's heal cannot read its table: loud, counted, retried.
    pg.execute(f"REVOKE SELECT ON items_a FROM {role}")
    with conn.cursor() as cur:
        cur.execute("ALTER TABLE items_a ALTER COLUMN qty TYPE bigint USING qty * 10")
        cur.execute("UPDATE items_a SET name = 'after rewrite' WHERE id <= 5")

    def failed_loudly() -> bool:
        return any(
            "ERROR" in line and "public.items_a" in line and "permission denied" in line
            for line in daemon_a.log().splitlines()
        )

    wait_for(failed_loudly, timeout_s=TIMEOUT_S, what="A's ERROR line for the failed heal")
    failures = scrape(daemon_a.log(), "cdcd_snapshot_failures_total")
    assert failures.get('cdcd_snapshot_failures_total{table="public.items_a"}', 0) >= 1, failures
    (heal_a,) = heal_jobs(pg, "public.items_a")
    assert heal_a.status == "running", f"a failed heal must be retried, not given up: {heal_a}"
    assert "permission denied" in str(heal_a.progress.get("error")), heal_a
    out = check(config("a", pg.dsn))
    assert re.search(rf"^FAIL snapshot: job {re.escape(heal_a.id)} of public.items_a keeps failing "
                     r"\(.*permission denied.*\); the daemon retries it", out, re.M), out
    pg.execute(f"GRANT SELECT ON items_a TO {role}")
    wait_for(lambda: (jobs := heal_jobs(pg, "public.items_a")) and all(
        j.status == "done" for j in jobs), timeout_s=TIMEOUT_S, what="A's retried heal")

    # Neither daemon claimed, rejected or failed the other's jobs.
    for daemon, other in ((daemon_a, "items_b"), (daemon_b, "items_a")):
        wrong = [line for line in daemon.log().splitlines()
                 if f"public.{other}" in line and ("snapshot" in line or "rejected" in line)
                 and "left to the daemon" not in line]
        assert not wrong, "\n".join(wrong)
    assert not [j for j in heal_jobs(pg, "public.items_a") + heal_jobs(pg, "public.items_b")
                if j.status == "failed"]

    # 4. Consumers hold both tables exactly.
    for side in ("a", "b"):
        wait_confirmed(pg, slots[side], daemon_a if side == "a" else daemon_b)
    problems = kafka_differences(pg, bootstrap, pg.dbname, "items_a", KEY)
    problems += kafka_differences(pg, bootstrap, pg.dbname, "items_b", KEY)
    # ... and so does `cdcd mirror --once` of both daemons' topics. One run for both:
    # the mirror reads only the broker (kafka.*, postgres.tables), and each run costs
    # a JVM and its Python workers (~20 s here), the bulk of this test.
    both = write_config(tmp_path / "mirror.yaml", pg.dsn, bootstrap, prefix=pg.dbname,
                        tables=["public.items_a", "public.items_b"])
    output = tmp_path / "mirror"
    mirror_once(both, output, tmp_path / "mirror.log")
    mirrored = sorted(p.name for p in output.iterdir() if not p.name.startswith("."))
    if mirrored != ["public.items_a", "public.items_b"]:
        problems.append(f"the mirror holds {mirrored}, not the two captured tables")
    for table in ("items_a", "items_b"):
        problems += mirror_differences(conn, output, table)
    assert not problems, "\n".join(problems)

    # 5. `cdcd check` names the other daemon, and the conflict of a shared publication.
    out = check(config("a", pg.dsn))
    assert re.search(rf"^ok +daemons: slot {slots['b']} \(streaming.*\) is another cdcd daemon: "
                     r"publication cdcd_b, 1 tables", out, re.M), out
    shared = write_config(tmp_path / "shared.yaml", pg.dsn, bootstrap, prefix=pg.dbname,
                          slot=slots["b"], publication="cdcd_a", tables=["public.items_b"])
    out = check(shared)
    # (the same line as run's refusal below: check runs run's startup plan dry)
    assert re.search(rf"^FAIL publication cdcd_a is used by the daemon of slot "
                     rf"{slots['a']}, which captures other tables \(public.items_a\).*"
                     r"give this daemon its own postgres.publication", out, re.M), out
    # ... and `cdcd run` refuses it before it could drop A's table from the publication.
    run = subprocess.run(cdcd_argv("run", "-c", str(shared)),
                         capture_output=True, text=True, timeout=120, cwd=PROJECT_ROOT)
    assert run.returncode == 2, run.stderr
    assert f"publication cdcd_a is used by the daemon of slot {slots['a']}" in run.stderr, run.stderr
    assert pg.fetchall("SELECT 1 FROM pg_publication_tables WHERE pubname = 'cdcd_a' "
                       "AND tablename = 'items_a'"), "A's table left its publication"

    assert daemon_a.terminate() == 0, daemon_a.log()
    assert daemon_b.terminate() == 0, daemon_b.log()
