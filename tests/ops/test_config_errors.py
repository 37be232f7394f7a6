"""Every configuration error is shown (issue 29, friction 7), with and without ``--debug``.

Two independent mistakes (a slot name PostgreSQL would refuse, zero
partitions) must both be named in the one error line of ``run`` and in the
``FAIL config`` line of ``check``; a typo'd key is named once with its
suggestion, not again as the missing key it stands for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.cdc import run_cdcd

TWO_ERRORS = {
    "postgres": {"dsn": "host=127.0.0.1 port=1", "slot": "Bad-Slot"},
    "kafka": {"bootstrap_servers": "127.0.0.1:1", "partitions": 0},
}


@pytest.mark.parametrize("debug", [[], ["--debug"]])
def test_two_config_errors_are_both_shown(tmp_path: Path, debug: list[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(TWO_ERRORS), encoding="utf-8")
    run = run_cdcd("run", "-c", str(path), *debug, timeout_s=60)
    assert run.returncode == 2, run.stderr
    line = next(x for x in run.stderr.splitlines() if x.startswith("cdcd: error:"))
    assert "'postgres.slot'" in line and "'kafka.partitions'" in line, run.stderr
    assert "more error" not in line, line
    check = run_cdcd("check", "-c", str(path), *debug, timeout_s=60)
    assert check.returncode == 2, check.stdout
    first = check.stdout.splitlines()[0]
    assert first.startswith("FAIL config") and "'postgres.slot'" in first, check.stdout
    assert "'kafka.partitions'" in first, check.stdout


def test_a_typo_is_not_reported_again_as_missing(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"postgres": {"dsn": "host=127.0.0.1 port=1"},
                                    "kafka": {"bootstrap_server": "127.0.0.1:1"}}),
                    encoding="utf-8")
    run = run_cdcd("run", "-c", str(path), timeout_s=60)
    line = run.stderr.splitlines()[0]
    assert "unknown key 'kafka.bootstrap_server' (did you mean 'bootstrap_servers'?)" in line
    assert "required" not in line, line
