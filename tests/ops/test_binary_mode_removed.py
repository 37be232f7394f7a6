"""``postgres.binary`` is kept so older files load, but binary mode is gone (docs/performance.md).

``binary: false`` loads as before; ``binary: true`` is a configuration error
(exit code 2) saying the mode was removed and why, and cdcd never asks
pgoutput for binary values whatever the file says.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from support.cdc import cdcd_argv

from cdcd.config import load_config
from cdcd.errors import ConfigError
from cdcd.source.replication import ReplicationStream

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "postgres": {"dsn": "host=127.0.0.1 dbname=x"},
    "kafka": {"bootstrap_servers": "127.0.0.1:1"},
}


def _config(tmp_path: Path, binary: bool) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "postgres": {**BASE["postgres"], "binary": binary}}))
    return path


def test_binary_false_is_accepted(tmp_path: Path) -> None:
    assert load_config(_config(tmp_path, False)).postgres.binary is False


def test_binary_true_is_a_config_error_naming_the_reason(tmp_path: Path) -> None:
    path = _config(tmp_path, True)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.exit_code == 2
    message = str(caught.value)
    assert "'postgres.binary': binary mode was removed" in message
    assert "as fast on the server and faster in cdcd (docs/performance.md)" in message

    result = subprocess.run(
        cdcd_argv("run", "-c", str(path)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error")]
    assert len(errors) == 1 and "binary mode was removed" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_replication_options_never_ask_for_binary() -> None:
    for version in (1, 2, 3, 4):
        stream = ReplicationStream.__new__(ReplicationStream)  # options() needs no connection
        stream.protocol_version = version
        stream.publication = "cdcd"
        assert "binary" not in stream.options()
