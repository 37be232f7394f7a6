"""``cdcd check`` prints one line per check and nothing else (issue 29, friction 8 and 9).

* Kafka down: librdkafka's own lines (one per reconnect attempt, then a
  "(repeated N more times)" summary) no longer interleave with the checks;
  what it said first is added to the kafka line.
* A table without replica identity that cdcd would add to its publication:
  one FAIL line for it, not also an ``ok … will be added``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from support.cdc import run_cdcd
from support.pg import PgDatabase


def check(config: Path) -> subprocess.CompletedProcess[str]:
    return run_cdcd("check", "-c", str(config))


def test_kafka_down_gives_one_line_per_check(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "postgres": {"dsn": "host=127.0.0.1 port=1 connect_timeout=2"},
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "metrics": {"listen": "127.0.0.1:0"},
    }), encoding="utf-8")
    result = check(path)
    assert result.returncode == 1, result.stdout + result.stderr
    output = (result.stdout + result.stderr).splitlines()
    stray = [line for line in output if not line.startswith(("ok   ", "FAIL "))]
    assert not stray, "\n".join(output)
    kafka = [line for line in output if line.startswith("FAIL kafka:")]
    assert len(kafka) == 1 and "Connection refused" in kafka[0], output


@pytest.mark.integration
def test_a_keyless_table_gets_one_consistent_line(
    pg: PgDatabase, cdc_config: Callable[..., Path]
) -> None:
    pg.execute("CREATE TABLE keyed (id int PRIMARY KEY)")
    pg.execute("CREATE TABLE keyless (v text)")
    pg.execute("CREATE PUBLICATION cdcd FOR TABLE keyed")
    result = check(cdc_config(tables=["public.keyed", "public.keyless"]))
    lines = [line for line in result.stdout.splitlines() if "public.keyless" in line]
    assert lines and all(line.startswith("FAIL") for line in lines), result.stdout
    assert not [line for line in result.stdout.splitlines() if "will be added" in line], (
        result.stdout
    )
