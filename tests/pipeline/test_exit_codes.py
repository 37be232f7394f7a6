"""Exit codes as SPEC §2 says, for ``run`` and ``check`` as processes.

0 ok, 1 runtime failure a restart may cure, 2 usage or configuration error,
3 definite runtime error that needs an operator. A supervisor restarts on 1
only, so a mistake in the file must never be 1 (restart loop) and a definite
runtime error must never be 1 either.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cdc import run_cdcd, write_config


def _config(tmp_path: Path, **sections: Any) -> Path:
    data = {"postgres": {"dsn": "host=127.0.0.1 port=1 dbname=x"},
            "kafka": {"bootstrap_servers": "127.0.0.1:1"}, **sections}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("listen", ["0.0.0.0:99999", "127.0.0.1:65536", "::1:9187", "9187"])
def test_an_invalid_metrics_address_is_exit_2_from_run_and_check(tmp_path: Path, listen: str) -> None:
    config = _config(tmp_path, metrics={"listen": listen})
    run = run_cdcd("run", "-c", str(config))
    assert run.returncode == 2, run.stderr
    assert "metrics.listen" in _error_line(run)
    check = run_cdcd("check", "-c", str(config))
    assert check.returncode == 2, check.stdout + check.stderr
    first = check.stdout.splitlines()[0]
    assert first.startswith("FAIL config") and "metrics.listen" in first, check.stdout


def test_a_metrics_address_in_use_is_exit_2_from_run(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        listen = f"127.0.0.1:{holder.getsockname()[1]}"
        run = run_cdcd("run", "-c", str(_config(tmp_path, metrics={"listen": listen})))
    assert run.returncode == 2, run.stderr
    line = _error_line(run)
    assert f"metrics.listen {listen}" in line and "Address already in use" in line, line


PG = {"dsn": "host=127.0.0.1 port=1"}
KAFKA = {"bootstrap_servers": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"postgres": PG, "kafka": {"bootstrap_server": "127.0.0.1:1"}},
         "unknown key 'kafka.bootstrap_server' (did you mean 'bootstrap_servers'?)"),
        ({"postgres": PG, "kafak": KAFKA},
         "unknown key 'kafak' (did you mean 'kafka'?)"),
        ({"postgres": PG, "kafka": KAFKA, "snapshot": {"chunk_row": 5}},
         "unknown key 'snapshot.chunk_row' (did you mean 'chunk_rows'?)"),
        ({"postgres": {**PG, "tables": [{"nmae": "public.t"}]}, "kafka": KAFKA},
         "unknown key 'postgres.tables.0.nmae' (did you mean 'name'?)"),
    ],
)
def test_a_typo_reports_the_unknown_key_first_with_a_suggestion(
    tmp_path: Path, data: dict[str, Any], expected: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    run = run_cdcd("run", "-c", str(path))
    assert run.returncode == 2, run.stderr
    first = run.stderr.splitlines()[0]
    assert first.startswith("cdcd: error:") and expected in first, run.stderr
    check = run_cdcd("check", "-c", str(path))
    assert check.returncode == 2, check.stdout
    first = check.stdout.splitlines()[0]
    assert first.startswith("FAIL config") and expected in first, check.stdout


@pytest.mark.integration
def test_a_slot_with_another_plugin_is_exit_3(pg: Any, broker: Any, tmp_path: Path) -> None:
    """A definite runtime error: retrying cannot help, an operator must drop or rename the slot."""
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    slot = "cdcd_" + pg.dbname[:50]
    pg.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')")
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers, slot=slot,
                          prefix=pg.dbname, tables=["public.t"])
    run = run_cdcd("run", "-c", str(config))
    assert run.returncode == 3, run.stderr
    assert f"slot {slot} uses plugin test_decoding" in _error_line(run)
