"""``cdcd check`` reports what ``cdcd run`` would hit (issue 12).

A slot another walsender streams from, a metrics address that cannot be
bound, and the snapshot signal table (there, created by ``run`` and why, or
out of reach) — each with the exit code ``run`` gives it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2.extras
import pytest
from support.cdc import SHORT_STARTUP_RETRY, run_cdcd, wait_for, write_config
from support.pg import create_publication, create_slot

pytestmark = pytest.mark.integration


def _line(stdout: str, start: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(start)]
    assert len(lines) == 1, (start, stdout)
    return lines[0]


@contextlib.contextmanager
def _streaming_holder(dsn: str, slot: str, publication: str) -> Iterator[int]:
    """Another consumer: a walsender streaming from ``slot``; yields its backend PID."""
    conn: Any = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        cursor = conn.cursor()
        cursor.start_replication(slot_name=slot, decode=False,
                                 options={"proto_version": "1", "publication_names": publication})
        yield int(conn.get_backend_pid())
    finally:
        conn.close()


def test_check_and_run_name_the_other_consumer_of_the_slot(pg, broker, daemons, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    conn = pg.connect()
    create_publication(conn, "cdcd", ["public.t"])
    create_slot(conn, "held")
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers, slot="held",
                          tables=["public.t"], postgres={"create_publication": False})
    with _streaming_holder(pg.dsn_with(application_name="other-consumer"), "held", "cdcd") as pid:
        wait_for(lambda: pg.fetchone("SELECT active_pid FROM pg_replication_slots "
                                     "WHERE slot_name = 'held'")[0] == pid,  # type: ignore[index]
                 timeout_s=30, what="the other consumer to hold the slot")
        result = run_cdcd("check", "-c", str(config))
        assert result.returncode == 1, result.stdout + result.stderr
        line = _line(result.stdout, "FAIL slot held")
        for expected in (f"active for PID {pid}", "application_name 'other-consumer'",
                         "client 127.0.0.1:", "stop the other consumer", "postgres.slot",
                         "then exits 1"):
            assert expected in line, (expected, line)

        # `run` says the same, once per retry, and exits 1 after the startup window.
        daemon = daemons(config, hooks=SHORT_STARTUP_RETRY)
        assert daemon.wait(120) == 1, daemon.log()
        log = daemon.log()
        final = log.strip().splitlines()[-1]
        assert final.startswith(f"cdcd: error: slot held is active for PID {pid}"), log
        assert "application_name 'other-consumer'" in final and "stop the other consumer" in final
        assert "check postgres.dsn" not in final  # not the generic startup hint
        assert "no COPY in progress" not in log  # no status update on a stream that never started


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_check_fails_with_exit_2_on_a_metrics_address_it_cannot_bind(pg, broker, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    with _listening_socket() as busy:
        port = busy.getsockname()[1]
        config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers,
                              tables=["public.t"], extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
        result = run_cdcd("check", "-c", str(config))
        assert result.returncode == 2, result.stdout + result.stderr
        line = _line(result.stdout, f"FAIL metrics.listen 127.0.0.1:{port}")
        assert "in use" in line and "choose a free local address for metrics.listen" in line, line

    # 192.0.2.1 (TEST-NET-1) is no address of this host.
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers,
                          tables=["public.t"], extra={"metrics": {"listen": "192.0.2.1:9187"}})
    result = run_cdcd("check", "-c", str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    line = _line(result.stdout, "FAIL metrics.listen 192.0.2.1:9187")
    assert "not an address of this host" in line, line

    # A free address passes, and the check lets go of it at once.
    with _listening_socket() as probe:
        port = probe.getsockname()[1]
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers,
                          tables=["public.t"], extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    result = run_cdcd("check", "-c", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert _line(result.stdout, f"ok   metrics.listen 127.0.0.1:{port}: free")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        again.bind(("127.0.0.1", port))


def test_check_says_what_becomes_of_the_signal_table(pg, broker, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    pg.execute("CREATE PUBLICATION cdcd FOR TABLE t")

    def check(
        mode: str, dsn: str | None = None, resnapshot: str = "never"
    ) -> subprocess.CompletedProcess[str]:
        config = write_config(tmp_path / "c.yaml", dsn or pg.dsn, broker.bootstrap_servers,
                              tables=["public.t"], extra={"snapshot": {"mode": mode},
                                                          "schema_changes": {"resnapshot": resnapshot}})
        return run_cdcd("check", "-c", str(config))

    # Streaming only: nothing will be created.
    result = check("never")
    assert result.returncode == 0, result.stdout + result.stderr
    line = _line(result.stdout, "ok   signal table public.cdcd_signal:")
    assert "absent, not needed to stream" in line and "`cdcd snapshot` creates it" in line, line

    # Healing schema changes (the default) needs it: run creates it at startup.
    result = check("never", resnapshot="auto")
    assert result.returncode == 0, result.stdout + result.stderr
    line = _line(result.stdout, "ok   signal table public.cdcd_signal:")
    assert "`cdcd run` creates it at startup" in line and "schema_changes" in line, line

    # A slot cdcd creates with an initial snapshot: run creates the table first.
    result = check("initial")
    assert result.returncode == 0, result.stdout + result.stderr
    line = _line(result.stdout, "ok   signal table public.cdcd_signal:")
    assert "`cdcd run` creates it before it creates slot cdcd" in line, line
    assert "snapshot.mode initial" in line, line

    # A user who may not create it: the initial snapshot is refused, streaming is not.
    role = "r_" + pg.dbname[:40]
    pg.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
    try:
        pg.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        pg.execute(f"GRANT SELECT ON t TO {role}")
        dsn = pg.dsn.replace("user=postgres", f"user={role}")
        assert dsn != pg.dsn
        result = check("initial", dsn)
        assert result.returncode == 1, result.stdout + result.stderr
        line = _line(result.stdout, "FAIL signal table public.cdcd_signal:")
        assert f"user {role} has no CREATE privilege on schema public" in line, line
        assert "exits 3 before creating the slot" in line and "snapshot.mode never" in line, line
        result = check("never", dsn)
        line = _line(result.stdout, "ok   signal table public.cdcd_signal:")
        assert "this user cannot create it" in line, line
        result = check("never", dsn, resnapshot="auto")
        assert result.returncode == 1, result.stdout + result.stderr
        line = _line(result.stdout, "FAIL signal table public.cdcd_signal:")
        assert "tracks schema changes in memory only" in line, line
        assert "schema_changes.resnapshot never" in line, line

        # Once it exists: its pending requests, or what the user lacks on it.
        pg.execute(_ddl())
        pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('r1', '{}')")
        result = check("never")
        assert _line(result.stdout, "ok   signal table public.cdcd_signal:").endswith(
            "exists, pending requests: 1"), result.stdout
        result = check("never", dsn)
        line = _line(result.stdout, "FAIL signal table public.cdcd_signal:")
        assert "lacks SELECT, INSERT, UPDATE" in line and f"TO {role}" in line, line
    finally:
        pg.execute(f"DROP OWNED BY {role}")
        pg.execute(f"DROP ROLE {role}")


def _ddl() -> str:
    from cdcd.snapshot.store import DDL

    return DDL.format(table="public.cdcd_signal")


def test_check_passes_while_nothing_holds_the_slot(pg, broker, tmp_path: Path) -> None:
    """The slot line is ok for a slot nobody streams from (the holder's check must not misfire)."""
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    conn = pg.connect()
    create_publication(conn, "cdcd", ["public.t"])
    create_slot(conn, "idle")
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers, slot="idle",
                          tables=["public.t"])
    result = run_cdcd("check", "-c", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "inactive" in _line(result.stdout, "ok   slot idle:")
