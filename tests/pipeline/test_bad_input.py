"""Bad input gives the documented exit code and one readable line (SPEC §2).

0 ok, 1 runtime failure a restart may cure, 2 usage or configuration error,
3 definite runtime error. No traceback without ``--debug``. A row bigger than
the producer's ``message.max.bytes`` stops the daemon with exit 3, and the slot
is not confirmed past the transaction before it.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cdc import (
    PROJECT_ROOT,
    SHORT_STARTUP_RETRY,
    DaemonProcess,
    cdcd_argv,
    wait_for,
    wait_streaming,
    write_config,
)
from support.pg import current_wal_lsn, lsn_to_int, slot_confirmed_flush_lsn

from cdcd.tools.local.postgres import free_port


def _cdcd(*args: str, timeout: float = 120,
          hooks: Mapping[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cdcd_argv(*args, hooks=hooks), cwd=PROJECT_ROOT, capture_output=True, text=True,
        timeout=timeout,
    )


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"postgres": {"dsn": "host=127.0.0.1 dbname=x"}, "kafka": {"bootstrap_servers": "127.0.0.1:1"}}


def test_unknown_key_is_exit_2_naming_the_field(tmp_path: Path) -> None:
    data = {**BASE, "postgres": {**BASE["postgres"], "slott": "x"}}
    result = _cdcd("run", "-c", str(_config(tmp_path, data)))
    assert result.returncode == 2
    assert "postgres.slott" in _one_line(result)


def test_wrong_type_is_exit_2_naming_the_field(tmp_path: Path) -> None:
    data = {**BASE, "kafka": {**BASE["kafka"], "partitions": "many"}}
    result = _cdcd("check", "-c", str(_config(tmp_path, data)))
    assert result.returncode == 2  # check reports the failed config check, as run exits
    result = _cdcd("run", "-c", str(_config(tmp_path, data)))
    assert result.returncode == 2
    assert "kafka.partitions" in _one_line(result)


def test_missing_file_and_bad_usage_are_exit_2(tmp_path: Path) -> None:
    result = _cdcd("run", "-c", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert "absent.yaml" in _one_line(result)
    result = _cdcd("frobnicate")
    assert result.returncode == 2
    _one_line(result)


@pytest.mark.integration
def test_unreachable_postgres_is_exit_1(tmp_path: Path, broker) -> None:
    data = {**BASE, "postgres": {"dsn": f"host=127.0.0.1 port={free_port()} dbname=x user=x "
                                        "password=hunter2 connect_timeout=2"},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers},
            "metrics": {"listen": "127.0.0.1:0"}}
    started = time.monotonic()
    result = _cdcd("run", "-c", str(_config(tmp_path, data)), hooks=SHORT_STARTUP_RETRY)
    assert result.returncode == 1
    line = _one_line(result)
    assert "PostgreSQL unreachable" in line and "hunter2" not in result.stderr
    assert re.search(r"still failing after \d+ s of retries at startup", line), line
    assert time.monotonic() - started < 90
    check = _cdcd("check", "-c", str(_config(tmp_path, data)))
    assert check.returncode == 1 and "FAIL postgres" in check.stdout and "hunter2" not in check.stdout


# An unreachable broker is exit 1 for run and check: tests/sink/test_log_flood.py
# runs exactly that (30 s of startup retries) and checks the code and the line.


@pytest.mark.integration
def test_wal_level_replica_is_exit_3_with_hint(tmp_path: Path, make_pg_cluster, broker) -> None:
    cluster = make_pg_cluster(settings={"wal_level": "replica"})
    data = {"postgres": {"dsn": cluster.dsn()}, "kafka": {"bootstrap_servers": broker.bootstrap_servers},
            "metrics": {"listen": "127.0.0.1:0"}}
    result = _cdcd("run", "-c", str(_config(tmp_path, data)))
    assert result.returncode == 3
    line = _one_line(result)
    assert "wal_level" in line and "ALTER SYSTEM SET wal_level = logical" in line
    check = _cdcd("check", "-c", str(_config(tmp_path, data)))
    assert check.returncode == 1 and "FAIL wal_level" in check.stdout


@pytest.mark.integration
def test_missing_publication_is_exit_3(tmp_path: Path, pg, broker) -> None:
    data = {"postgres": {"dsn": pg.dsn, "publication": "nope", "create_publication": False},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers},
            "metrics": {"listen": "127.0.0.1:0"}}
    result = _cdcd("run", "-c", str(_config(tmp_path, data)))
    assert result.returncode == 3
    assert "publication nope does not exist" in _one_line(result)


@pytest.mark.integration
def test_row_over_message_max_bytes_stops_before_its_transaction(pg, broker, tmp_path: Path) -> None:
    conn = pg.connect()
    conn.cursor().execute("CREATE TABLE big(id int PRIMARY KEY, body text)")
    slot = "cdcd_big"
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers, prefix=pg.dbname,
                          slot=slot, tables=["public.big"],
                          kafka={"producer": {"message.max.bytes": 100000}})
    daemon = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        wait_streaming(pg, slot)
        conn.cursor().execute("INSERT INTO big VALUES (1, 'small')")
        before_big = current_wal_lsn(conn)
        wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= before_big, what="small row confirmed")
        # Incompressible text, so no codec can bring it under the limit.
        conn.cursor().execute("INSERT INTO big SELECT 2, string_agg(md5(random()::text), '') "
                              "FROM generate_series(1, 8000)")
        assert daemon.wait(60) == 3
        log = daemon.log()
        errors = [line for line in log.splitlines() if line.startswith("cdcd: error")]
        assert len(errors) == 1, log
        assert "public.big" in errors[0] and "message.max.bytes" in errors[0], log
        commit = re.search(r"committed at LSN ([0-9A-F]+/[0-9A-F]+)", errors[0])
        assert commit, log
        time.sleep(1)
        # Nothing of the refused transaction is confirmed. (WAL written after
        # before_big, e.g. heartbeats or cdcd's own bookkeeping, may be.)
        assert slot_confirmed_flush_lsn(conn, slot) < lsn_to_int(commit.group(1))
    finally:
        if daemon.alive():
            daemon.kill9()
