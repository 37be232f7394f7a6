"""``cdcd bench --json`` (SPEC §9) runs end to end and reports every required key.

Small sizes keep it quick; the figures themselves are reported in the README
from full-size runs, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_bench_json_has_the_spec_keys() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cdcd", "bench", "--json", "--rows", "20000", "--big-rows", "20000",
         "--latency-seconds", "1", "--offered-rows-per-s", "2000"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("ceiling_rows_per_s", "cdcd_rows_per_s", "ratio", "latency_ms",
                "offered_rows_per_s", "peak_rss_mb", "rows"):
        assert key in data, key
    assert data["rows"] == 20000 and data["offered_rows_per_s"] == 2000
    assert set(data["latency_ms"]) >= {"p50", "p99", "max"}
    assert data["ceiling_rows_per_s"] > 0 and data["cdcd_rows_per_s"] > 0
    assert 0 < data["ratio"] == pytest.approx(data["cdcd_rows_per_s"] / data["ceiling_rows_per_s"],
                                              rel=0.01)
    assert 0 < data["latency_ms"]["p50"] <= data["latency_ms"]["p99"] <= data["latency_ms"]["max"]
    assert data["peak_rss_mb"] > 10
    # CPU per row of cdcd (all threads) and of the walsender serving pg_recvlogical.
    assert data["cdcd_cpu_us_per_row"] > 0 and data["walsender_cpu_us_per_row"] > 0
    assert data["cpu_ratio"] == pytest.approx(
        data["cdcd_cpu_us_per_row"] / data["walsender_cpu_us_per_row"], rel=0.02
    )
    assert data["cpu_count"] >= 1
    assert data["snapshot"]["rows"] == 20000 and data["snapshot"]["rows_per_s"] > 0
    assert data["snapshot"]["cdcd_cpu_us_per_row"] > 0
