"""cdcd's side of the measurements: the real pipeline in this process, and ``cdcd run``.

Throughput to a confirmed LSN, the initial snapshot, commit-to-ack latency
under a fixed offered load, and peak memory through one big transaction.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cdcd.config.model import parse_config
from cdcd.errors import DefiniteError
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.session import Session
from cdcd.tools.bench.cpu import BackendCpu, BenchSampler, cdcd_cpu_s, threads_cpu_s
from cdcd.tools.bench.workload import (
    BENCH_APPLICATION,
    BIG_SLOT,
    CDCD_SLOT,
    DATABASE_PIDS_SQL,
    PUBLICATION,
    SLOT_PID_SQL,
    SNAPSHOT_CONNECTIONS,
    SNAPSHOT_SLOT,
    TEN_ROWS,
    TOPIC_PREFIX,
    connect,
    current_lsn,
    drop_slot,
    progress,
    wait_confirmed,
)


class _LatencyMetrics(Metrics):
    """Metrics that also keep every commit-to-ack latency, for exact percentiles."""

    def __init__(self) -> None:
        super().__init__(process_collectors=False)
        self.samples: list[float] = []
        self.recording = False

    def delivered(self, commit_time: float, now: float | None = None) -> None:
        latency = (time.time() if now is None else now) - commit_time
        if self.recording:
            self.samples.append(latency)
        super().delivered(commit_time, now)

    def delivered_many(self, commit_times_ms: list[int], now: float) -> None:
        if self.recording:
            self.samples.extend(now - ms / 1000.0 for ms in commit_times_ms)
        super().delivered_many(commit_times_ms, now)


def bench_config(dsn: str, bootstrap: str, slot: str) -> Any:
    return parse_config(
        {
            "postgres": {
                "dsn": dsn,
                "slot": slot,
                "publication": PUBLICATION,
                "create_slot": False,
                "create_publication": False,
                "status_interval_s": 5,
            },
            "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": TOPIC_PREFIX, "partitions": 6},
            "snapshot": {"mode": "never"},
            "metrics": {"listen": "127.0.0.1:0"},
            "heartbeat": {"interval_s": 0},
        }
    )


@dataclass
class Running:
    session: Session
    thread: threading.Thread
    failure: list[BaseException]

    def check(self) -> None:
        """Raise what ended the session early, if it did."""
        if not self.thread.is_alive():
            if self.failure:
                raise self.failure[0]
            raise DefiniteError("the cdcd session stopped before the measurement ended")


@contextmanager
def running_session(config: Any, metrics: Metrics) -> Iterator[Running]:
    stop = threading.Event()
    session = Session(config, stop, metrics)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            session.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="cdcd-session", daemon=True)
    thread.start()
    running = Running(session, thread, failure)
    try:
        while not session.state.streaming:
            running.check()
            time.sleep(0.005)
        yield running
    finally:
        stop.set()
        thread.join(120)
        if failure:
            raise failure[0]


def run_session(config: Any, timeout_s: float) -> None:
    """Run a session that ends by itself, in a thread of its own (not the bench's)."""
    stop = threading.Event()
    session = Session(config, stop, Metrics(process_collectors=False))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            session.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    thread = threading.Thread(target=run, name="cdcd-session", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        stop.set()
        thread.join(120)
        raise DefiniteError(f"the session did not finish in {timeout_s} s")
    if failure:
        raise failure[0]

@dataclass
class Drain:
    seconds: float
    setup_seconds: float
    cdcd_cpu_s: float
    walsender_cpu_s: float
    threads_cpu_s: dict[str, float]


def cdcd_rate(dsn: str, bootstrap: str, end_lsn: int) -> Drain:
    """The pipeline confirming the whole load: its time, setup time and CPU."""
    conn = connect(dsn)
    try:
        metrics = Metrics(process_collectors=False)
        started = time.monotonic()
        with running_session(bench_config(dsn, bootstrap, CDCD_SLOT), metrics) as running:
            with BackendCpu(dsn, SLOT_PID_SQL, (CDCD_SLOT,)) as walsender:
                streaming = time.monotonic()
                cpu_start, threads_start = cdcd_cpu_s(), threads_cpu_s()
                finished = wait_confirmed(
                    conn, CDCD_SLOT, end_lsn, timeout_s=1800, check=running.check
                )
                cpu_end, threads_end = cdcd_cpu_s(), threads_cpu_s()
        threads = {
            name: cpu - threads_start.get(name, 0.0)
            for name, cpu in threads_end.items()
        }
        # The walsender started with the session: its CPU before the drain
        # (slot start-up) is included, a few milliseconds.
        return Drain(
            finished - streaming,
            streaming - started,
            cpu_end - cpu_start,
            walsender.cpu_s(),
            threads,
        )
    finally:
        conn.close()


class _SnapshotMarks(logging.Handler):
    """Time and CPU (``cdcd_cpu_s``) at the log lines that bracket the initial snapshot,
    and what worker processes report of themselves (``snapshot.processes``)."""

    MARKS = ("initial snapshot of", "initial snapshot complete")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: dict[str, tuple[float, float]] = {}
        self.workers_cpu_s = 0.0
        self.workers_peak_rss_mb: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for mark in self.MARKS:
            if message.startswith(mark) and mark not in self.marks:
                self.marks[mark] = (time.monotonic(), cdcd_cpu_s())
        cpu = getattr(record, "snapshot_workers_cpu_s", None)
        if cpu is not None:
            self.workers_cpu_s = float(cpu)
            self.workers_peak_rss_mb = list(getattr(record, "snapshot_workers_peak_rss_mb", []))


class _RssPeak(BenchSampler):
    """The largest resident size of this process while it runs (``VmRSS`` every 20 ms).

    Of the whole bench process: what the session reading the snapshot holds,
    plus what the bench held before it (an upper bound for the daemon's side).
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak_mb = 0.0

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak_mb = max(self.peak_mb, int(line.split()[1]) / 1024)


@dataclass
class SnapshotRun:
    seconds: float
    cdcd_cpu_s: float  # the daemon's side and its worker processes together
    server_cpu_s: float
    connections: int
    processes: int = 0
    workers_cpu_s: float = 0.0
    workers_peak_rss_mb: list[float] | None = None
    parent_peak_rss_mb: float = 0.0


def initial_snapshot(
    dsn: str,
    bootstrap: str,
    rows: int,
    connections: int = SNAPSHOT_CONNECTIONS,
    processes: int = 0,
) -> SnapshotRun:
    """An initial snapshot of the loaded table (``snapshot.mode: initial_only``) read by
    ``connections`` threads, or by ``processes`` worker processes when not 0.

    With processes, cdcd's CPU is this process's between the marks plus each
    worker's whole life (as each reports it when it exits: interpreter start
    included)."""
    marks = _SnapshotMarks()
    snapshot_log = logging.getLogger("cdcd.snapshot")
    level = snapshot_log.level
    snapshot_log.addHandler(marks)
    snapshot_log.setLevel(logging.INFO)
    config = bench_config(dsn, bootstrap, SNAPSHOT_SLOT).model_dump()
    config["postgres"]["create_slot"] = True
    config["kafka"]["topic_prefix"] = f"{TOPIC_PREFIX}_snapshot"
    config["postgres"]["dsn"] = dsn  # dumped as a SecretStr: the session needs the text
    config["snapshot"] = {
        "mode": "initial_only",
        "parallelism": connections,
        "processes": processes,
        "chunk_rows": 10_000,
    }
    try:
        with BackendCpu(dsn, DATABASE_PIDS_SQL, (BENCH_APPLICATION,)) as server, _RssPeak() as rss:
            # initial_only: the session returns once the snapshot is delivered.
            run_session(parse_config(config), timeout_s=1800)
    finally:
        snapshot_log.removeHandler(marks)
        snapshot_log.setLevel(level)
    if len(marks.marks) != len(marks.MARKS):
        raise DefiniteError(f"the initial snapshot did not log its start and end: {marks.marks}")
    (start_t, start_cpu), (end_t, end_cpu) = (marks.marks[m] for m in marks.MARKS)
    return SnapshotRun(
        end_t - start_t,
        end_cpu - start_cpu + marks.workers_cpu_s,
        server.cpu_s(),
        processes or connections,
        processes,
        marks.workers_cpu_s,
        marks.workers_peak_rss_mb,
        rss.peak_mb,
    )


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def commit_to_ack_latency(
    dsn: str, bootstrap: str, bindir: Path, rows_per_s: int, seconds: float, quiet: bool
) -> dict[str, float]:
    """Commit-to-ack latency at a fixed offered load driven by pgbench."""
    conn = connect(dsn)
    metrics = _LatencyMetrics()
    with tempfile.TemporaryDirectory(prefix="cdcd-bench-") as tmp:
        script = Path(tmp) / "ten_rows.sql"
        script.write_text(
            "\\set first random(1, 1000000000)\nBEGIN;\n"
            + TEN_ROWS.replace("__FROM__", ":first").strip().replace("\n", " ")
            + ";\nCOMMIT;\n"
        )
        tps = max(1, rows_per_s // 10)
        with running_session(bench_config(dsn, bootstrap, CDCD_SLOT), metrics) as running:
            wait_confirmed(conn, CDCD_SLOT, current_lsn(conn), timeout_s=600, check=running.check)
            progress(f"offering {rows_per_s:,} rows/s for {seconds:.0f} s (pgbench -R {tps})", quiet)
            warmup = 2.0
            timer = threading.Timer(warmup, lambda: setattr(metrics, "recording", True))
            timer.start()
            argv = [
                str(bindir / "pgbench"), "-n", "-f", str(script), "-R", str(tps),
                "-T", str(int(seconds + warmup)), "-c", "4", "-j", "2", dsn,
            ]  # fmt: skip
            env = {**os.environ, "PGOPTIONS": "-c synchronous_commit=on"}
            result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            timer.cancel()
            if result.returncode != 0:
                raise DefiniteError(f"pgbench failed: {result.stderr.strip()[-500:]}")
            wait_confirmed(conn, CDCD_SLOT, current_lsn(conn), timeout_s=600, check=running.check)
            metrics.recording = False
    conn.close()
    samples = metrics.samples
    if not samples:
        raise DefiniteError("no latency samples were recorded")
    return {
        "p50": percentile(samples, 0.50) * 1000,
        "p99": percentile(samples, 0.99) * 1000,
        "max": max(samples) * 1000,
        "transactions": float(len(samples)),
    }

def peak_rss_big_transaction(dsn: str, bootstrap: str, rows: int, quiet: bool) -> float:
    """Peak RSS (MB) of a ``cdcd run`` process through one ``rows``-row transaction."""
    conn = connect(dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (BIG_SLOT,))
    with tempfile.TemporaryDirectory(prefix="cdcd-bench-") as tmp:
        config = bench_config(dsn, bootstrap, BIG_SLOT).model_dump()
        config["postgres"]["dsn"] = dsn  # dumped as a SecretStr: the file needs the text
        config["metrics"]["listen"] = "127.0.0.1:0"
        path = Path(tmp) / "cdcd.yaml"
        path.write_text(yaml.safe_dump(config))
        log = open(Path(tmp) / "daemon.log", "wb")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "-c", str(path)], stdout=log, stderr=log
        )
        try:
            with conn.cursor() as cur:
                cur.execute("SET synchronous_commit = off")
                body = TEN_ROWS.replace("__FROM__ + 9", f"__FROM__ + {rows - 1}")
                cur.execute(body.replace("__FROM__", "1"))
            progress(f"one {rows:,}-row transaction committed; waiting for cdcd run", quiet)

            def alive() -> None:
                if daemon.poll() is not None:
                    log.flush()
                    tail = (Path(tmp) / "daemon.log").read_text(errors="replace")[-3000:]
                    raise DefiniteError(f"cdcd run exited with {daemon.returncode}:\n{tail}")

            wait_confirmed(conn, BIG_SLOT, current_lsn(conn), timeout_s=1800, check=alive)
            status = Path(f"/proc/{daemon.pid}/status").read_text()
            peak_kb = next(
                int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            log.close()
            drop_slot(conn, BIG_SLOT)
            conn.close()
    return peak_kb / 1024
