"""``cdcd bench --json`` (SPEC §9) runs end to end and reports every required key.

Small sizes keep it quick; the figures themselves are reported in the README
from full-size runs, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_bench_json_has_the_spec_keys() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cdcd", "bench", "--json", "--rows", "20000", "--big-rows", "20000",
         "--latency-seconds", "1", "--offered-rows-per-s", "2000", "--sync-seconds", "1"],
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
    _assert_ceilings(data)
    _assert_synchronous_section(data["synchronous"], seconds=1.0)


def _assert_ceilings(data: dict[str, Any]) -> None:
    """The server-side ceilings (walsender serving cdcd, decode with no client, COPY) and
    cdcd's ratios against each are present and consistent with one another."""
    rate = data["cdcd_rows_per_s"]
    walsender_us = data["walsender_cpu_us_per_row_cdcd"]
    assert walsender_us > 0
    # One core spent the way the walsender spent it serving cdcd.
    assert data["walsender_limit_rows_per_s"] == pytest.approx(1e6 / walsender_us, rel=0.02)
    assert data["ratio_walsender_limit"] == pytest.approx(
        rate / data["walsender_limit_rows_per_s"], rel=0.02
    )
    assert data["cpu_ratio_walsender_cdcd"] == pytest.approx(
        data["cdcd_cpu_us_per_row"] / walsender_us, rel=0.02
    )
    # The peek decoded the whole load: BEGIN, an INSERT per row, COMMIT, RELATION.
    assert data["decode_messages"] >= data["rows"] + 2 * data["rows"] // 10
    assert data["decode_rows_per_s"] > 0 and data["decode_server_cpu_us_per_row"] > 0
    assert data["decode_rows_per_s"] == pytest.approx(
        data["rows"] / data["decode_seconds"], rel=0.05
    )
    assert data["ratio_decode"] == pytest.approx(rate / data["decode_rows_per_s"], rel=0.02)
    snap = data["snapshot"]
    assert snap["connections"] >= 1
    assert snap["copy_rows_per_s"] > 0 and snap["copy_server_cpu_us_per_row"] > 0
    assert snap["copy_rows_per_s"] == pytest.approx(snap["rows"] / snap["copy_seconds"], rel=0.05)
    assert snap["ratio_copy"] == pytest.approx(snap["rows_per_s"] / snap["copy_rows_per_s"],
                                               rel=0.02)
    assert snap["cpu_ratio_copy_server"] == pytest.approx(
        snap["cdcd_cpu_us_per_row"] / snap["copy_server_cpu_us_per_row"], rel=0.02
    )
    # The bare Kafka client, and cdcd's CPU per row against it (stream and snapshot).
    kafka_us = data["kafka_client_cpu_us_per_msg"]
    assert kafka_us > 0 and data["kafka_client_msgs_per_s"] > 0
    assert data["kafka_client_message_bytes"]["value"] > 0
    assert data["cpu_ratio_kafka_client"] == pytest.approx(data["cdcd_cpu_us_per_row"] / kafka_us,
                                                           rel=0.02)
    assert snap["cpu_ratio_kafka_client"] == pytest.approx(snap["cdcd_cpu_us_per_row"] / kafka_us,
                                                           rel=0.02)
    assert snap["processes"] == 0 and snap["workers_peak_rss_mb"] == []


def _assert_synchronous_section(sync: dict[str, Any], seconds: float) -> None:
    """p50/p99/max of single-row commits: cdcd synchronous (captured, uncaptured), and not."""
    assert sync["commits_per_s"] == 200 and sync["seconds"] == seconds
    for key in ("captured_ms", "uncaptured_ms", "not_synchronous_ms"):
        summary = sync[key]
        assert 0 < summary["p50"] <= summary["p99"] <= summary["max"], (key, summary)
    baseline = sync["not_synchronous_ms"]["p99"]
    assert sync["added_p99_ms"] == {
        "captured": pytest.approx(sync["captured_ms"]["p99"] - baseline, abs=0.002),
        "uncaptured": pytest.approx(sync["uncaptured_ms"]["p99"] - baseline, abs=0.002),
    }


def test_bench_only_synchronous() -> None:
    """``--only synchronous`` runs that section alone, quickly."""
    result = subprocess.run(
        [sys.executable, "-m", "cdcd", "bench", "--json", "--only", "synchronous",
         "--sync-seconds", "0.5"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(data) == {"synchronous", "native"}
    _assert_synchronous_section(data["synchronous"], seconds=0.5)


@pytest.mark.slow
def test_bench_snapshot_with_worker_processes() -> None:
    """``--snapshot-processes 2``: the snapshot read by two worker processes, measured as
    such (their CPU in cdcd's, their memory), against COPY on two connections."""
    result = subprocess.run(
        [sys.executable, "-m", "cdcd", "bench", "--json", "--rows", "20000", "--big-rows", "20000",
         "--latency-seconds", "1", "--offered-rows-per-s", "2000", "--no-synchronous",
         "--snapshot-processes", "2"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    snap = json.loads(result.stdout.strip().splitlines()[-1])["snapshot"]
    assert snap["processes"] == 2 and snap["connections"] == 2
    assert 0 < snap["workers_cpu_us_per_row"] <= snap["cdcd_cpu_us_per_row"]
    assert len(snap["workers_peak_rss_mb"]) == 2 and min(snap["workers_peak_rss_mb"]) > 10


def test_threads_cpu_s_skips_a_thread_that_ends_while_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that ends between the listing of /proc/self/task and the read of its
    name (ESRCH: ProcessLookupError) is left out, not an error that ends the bench run.

    The race is made certain: every thread's name is read from /proc (threading knows
    only the main one), and that read fails as it does for an ended thread.
    """
    import threading

    from cdcd.tools.bench import cpu

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="ends-while-read")
    other.start()
    real_read_text = Path.read_text

    def read_text(path: Path, *args: Any, **kwargs: Any) -> str:
        if path.name == "comm":
            raise ProcessLookupError(3, "No such process")
        return real_read_text(path, *args, **kwargs)

    try:
        monkeypatch.setattr(Path, "read_text", read_text)
        monkeypatch.setattr(cpu.threading, "enumerate", lambda: [threading.main_thread()])
        assert cpu.threads_cpu_s() == {}
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize("mock", [False, True], ids=["stand-in producer", "kafka mock"])
def test_bench_pipeline_cpu_runs_and_confirms_the_last_commit(mock: bool) -> None:
    # The Python-path bench feeds batches as the replication stream reads them
    # (payload bytes); it had been left feeding message objects and crashed.
    from tests.bench.bench_pipeline_cpu import _run, _stream

    relations, payloads = _stream(30)
    _, _, confirmed = _run(relations, payloads, mock)
    last_commit_end = int.from_bytes(payloads[-1][10:18], "big")
    assert int(confirmed) == last_commit_end
