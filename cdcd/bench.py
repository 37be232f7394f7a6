"""``cdcd bench``: the benchmark of SPEC §9, in one run.

Phases, all on the same fixed, seeded workload (``orders``, SPEC §9):

1. **Load.** Two slots are created *before* the load (one for
   ``pg_recvlogical``, one for cdcd), then ``rows`` rows are inserted in
   transactions of 10, so both consumers later drain exactly the same WAL.
   The load session uses ``synchronous_commit=off`` (it does not change the
   WAL, only how fast the load finishes).
2. **Ceiling.** ``pg_recvlogical`` drains its slot with pgoutput (protocol 1)
   to /dev/null up to the end of the load: the raw rate one walsender
   decodes at, which no pgoutput consumer can beat.
3. **cdcd end to end.** The real pipeline drains its slot: decode, envelope,
   produce with ``acks=all``, delivery reports, LSN confirmed. The rate is
   rows divided by the time from the session's start until the slot's
   ``confirmed_flush_lsn`` reaches the end of the load.
4. **Latency.** ``pgbench`` offers a fixed load (default 10,000 rows/s as
   1,000 transactions/s of 10 rows, ``synchronous_commit=on``) while the
   pipeline runs; for every transaction cdcd records commit time (from the
   server) to the moment Kafka acknowledged its last message and everything
   before it. p50/p99/max over the run, after a warm-up.
5. **Memory.** ``cdcd run`` as its own process through one transaction of
   ``big_rows`` rows; its peak RSS (VmHWM) is reported.

PostgreSQL and the broker are throwaway ones unless ``--dsn`` /
``--bootstrap-servers`` are given (the workload then lives in schema
``cdcd_bench`` of that database, which is dropped and recreated, as are the
benchmark's slots and publication).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import yaml

from cdcd.config.model import parse_config
from cdcd.errors import DefiniteError
from cdcd.local.workload import orders_ddl
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.session import Session

SCHEMA = "cdcd_bench"
PUBLICATION = "cdcd_bench"
CEILING_SLOT = "cdcd_bench_ceiling"
CDCD_SLOT = "cdcd_bench_cdcd"
BIG_SLOT = "cdcd_bench_big"
TOPIC_PREFIX = "cdcd_bench"


#: Ten rows of the SPEC §9 shape; ``g`` numbers the rows of the whole load.
TEN_ROWS = f"""
INSERT INTO {SCHEMA}.orders(customer_id, status, amount, note, flags, payload)
SELECT (random() * 1000000)::int, 'shipped', round((random() * 10000)::numeric, 2),
       md5(g::text), g % 2 = 0, jsonb_build_object('sku', 'SKU-' || g, 'qty', g % 7)
FROM generate_series(__FROM__, __FROM__ + 9) g
"""


@dataclass
class BenchResult:
    rows: int
    ceiling_rows_per_s: float
    cdcd_rows_per_s: float
    ratio: float
    offered_rows_per_s: int
    latency_ms: dict[str, float]
    peak_rss_mb: float
    big_transaction_rows: int
    seed: int
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "ceiling_rows_per_s": round(self.ceiling_rows_per_s),
            "cdcd_rows_per_s": round(self.cdcd_rows_per_s),
            "ratio": round(self.ratio, 3),
            "offered_rows_per_s": self.offered_rows_per_s,
            "latency_ms": {k: round(v, 2) for k, v in self.latency_ms.items()},
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "big_transaction_rows": self.big_transaction_rows,
            "seed": self.seed,
            **self.details,
        }


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


@contextmanager
def _environment(args: argparse.Namespace) -> Iterator[tuple[str, str, Path]]:
    """(dsn, bootstrap servers, bindir): given ones, or throwaway ones cleaned up after."""
    from cdcd.local import LocalBroker, LocalPostgres, find_bindir

    cluster = broker = None
    try:
        if args.dsn:
            dsn = args.dsn
            bindir = find_bindir()
        else:
            _log("starting a throwaway PostgreSQL 15 (fsync on)", args.json)
            cluster = LocalPostgres.start(
                settings={"fsync": "on", "max_wal_size": "4GB", "shared_buffers": "256MB"}
            )
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            bindir = cluster.bindir
        if args.bootstrap_servers:
            bootstrap = args.bootstrap_servers
        else:
            _log("starting the bundled broker", args.json)
            broker = LocalBroker.start()
            bootstrap = broker.bootstrap_servers
        yield dsn, bootstrap, bindir
    finally:
        if broker is not None:
            broker.cleanup()
        if cluster is not None:
            cluster.cleanup()


def _connect(dsn: str) -> Any:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    return conn


def _lsn(conn: Any, sql: str, params: Any = None) -> int:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        row = cur.fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _confirmed(conn: Any, slot: str) -> int:
    return _lsn(
        conn,
        "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )


def _current(conn: Any) -> int:
    return _lsn(conn, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")


def _drop_slot(conn: Any, slot: str) -> None:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )


def _prepare(conn: Any) -> None:
    with conn.cursor() as cur:
        for slot in (CEILING_SLOT, CDCD_SLOT, BIG_SLOT):
            _drop_slot(conn, slot)
        cur.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
        cur.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        cur.execute(f"CREATE SCHEMA {SCHEMA}")
        cur.execute(orders_ddl(f"{SCHEMA}.orders"))
        cur.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {SCHEMA}.orders")
        for slot in (CEILING_SLOT, CDCD_SLOT):
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))


def _load(dsn: str, rows: int, seed: int, quiet: bool) -> float:
    """``rows`` rows in transactions of 10, seeded; returns seconds."""
    conn = _connect(dsn)
    started = time.monotonic()
    try:
        with conn.cursor() as cur:
            cur.execute("SET synchronous_commit = off")
            cur.execute("SELECT setseed(%s)", (((seed % 1000) / 1000.0),))
            batch = 10_000  # rows per DO block, committed every 10 rows inside it
            for first in range(1, rows + 1, batch):
                count = min(batch, rows - first + 1) // 10
                body = TEN_ROWS.replace("__FROM__", f"({first} + i * 10)")
                cur.execute(
                    f"DO $$ BEGIN FOR i IN 0..{count - 1} LOOP {body}; COMMIT; END LOOP; END $$"
                )
                if first % 200_000 == 1:
                    _log(f"loaded {first - 1:,} / {rows:,} rows", quiet)
    finally:
        conn.close()
    return time.monotonic() - started


def _ceiling(dsn: str, bindir: Path, end_lsn: int) -> float:
    """pg_recvlogical to /dev/null up to ``end_lsn``; returns seconds."""
    binary = bindir / "pg_recvlogical"
    if not binary.exists():
        found = shutil.which("pg_recvlogical")
        if found is None:
            raise DefiniteError("pg_recvlogical not found", hint="install postgresql-15")
        binary = Path(found)
    end = f"{end_lsn >> 32:X}/{end_lsn & 0xFFFFFFFF:X}"
    argv = [
        str(binary), "--dbname", dsn, "--slot", CEILING_SLOT, "--start", "--no-loop",
        "-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}",
        "--endpos", end, "-f", "/dev/null",
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise DefiniteError(f"pg_recvlogical failed: {result.stderr.strip()}")
    return elapsed


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


def _config(dsn: str, bootstrap: str, slot: str) -> Any:
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


@contextmanager
def _session(config: Any, metrics: Metrics) -> Iterator[Session]:
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
    try:
        yield session
    finally:
        stop.set()
        thread.join(120)
        if failure:
            raise failure[0]


def _wait_confirmed(conn: Any, slot: str, target: int, timeout_s: float) -> float:
    started = time.monotonic()
    while _confirmed(conn, slot) < target:
        if time.monotonic() - started > timeout_s:
            raise DefiniteError(f"slot {slot} did not reach the end of the load in {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic()


def _cdcd_rate(dsn: str, bootstrap: str, end_lsn: int) -> tuple[float, float]:
    """Seconds for the pipeline to confirm the whole load; and its setup time."""
    conn = _connect(dsn)
    try:
        metrics = Metrics(process_collectors=False)
        started = time.monotonic()
        with _session(_config(dsn, bootstrap, CDCD_SLOT), metrics) as session:
            while not session.state.streaming:
                time.sleep(0.005)
            streaming = time.monotonic()
            finished = _wait_confirmed(conn, CDCD_SLOT, end_lsn, timeout_s=1800)
        return finished - streaming, streaming - started
    finally:
        conn.close()


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def _latency(
    dsn: str, bootstrap: str, bindir: Path, rows_per_s: int, seconds: float, quiet: bool
) -> dict[str, float]:
    """Commit-to-ack latency at a fixed offered load driven by pgbench."""
    conn = _connect(dsn)
    metrics = _LatencyMetrics()
    with tempfile.TemporaryDirectory(prefix="cdcd-bench-") as tmp:
        script = Path(tmp) / "ten_rows.sql"
        script.write_text(
            "\\set first random(1, 1000000000)\nBEGIN;\n"
            + TEN_ROWS.replace("__FROM__", ":first").strip().replace("\n", " ")
            + ";\nCOMMIT;\n"
        )
        tps = max(1, rows_per_s // 10)
        with _session(_config(dsn, bootstrap, CDCD_SLOT), metrics) as session:
            while not session.state.streaming:
                time.sleep(0.005)
            _wait_confirmed(conn, CDCD_SLOT, _current(conn), timeout_s=600)
            _log(f"offering {rows_per_s:,} rows/s for {seconds:.0f} s (pgbench -R {tps})", quiet)
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
            _wait_confirmed(conn, CDCD_SLOT, _current(conn), timeout_s=600)
            metrics.recording = False
    conn.close()
    samples = metrics.samples
    if not samples:
        raise DefiniteError("no latency samples were recorded")
    return {
        "p50": _percentile(samples, 0.50) * 1000,
        "p99": _percentile(samples, 0.99) * 1000,
        "max": max(samples) * 1000,
        "transactions": float(len(samples)),
    }


def _peak_rss_big_transaction(dsn: str, bootstrap: str, rows: int, quiet: bool) -> float:
    """Peak RSS (MB) of a ``cdcd run`` process through one ``rows``-row transaction."""
    conn = _connect(dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (BIG_SLOT,))
    with tempfile.TemporaryDirectory(prefix="cdcd-bench-") as tmp:
        config = _config(dsn, bootstrap, BIG_SLOT).model_dump()
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
            _log(f"one {rows:,}-row transaction committed; waiting for cdcd run", quiet)
            _wait_confirmed(conn, BIG_SLOT, _current(conn), timeout_s=1800)
            status = Path(f"/proc/{daemon.pid}/status").read_text()
            peak_kb = next(
                int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            log.close()
            _drop_slot(conn, BIG_SLOT)
            conn.close()
    return peak_kb / 1024


def run_bench(args: argparse.Namespace) -> BenchResult:
    quiet = bool(args.json)
    with _environment(args) as (dsn, bootstrap, bindir):
        conn = _connect(dsn)
        try:
            _prepare(conn)
            _log(f"loading {args.rows:,} rows in transactions of 10 (seed {args.seed})", quiet)
            load_s = _load(dsn, args.rows, args.seed, quiet)
            end_lsn = _current(conn)
            _log(f"loaded in {load_s:.1f} s; measuring pg_recvlogical", quiet)
            ceiling_s = _ceiling(dsn, bindir, end_lsn)
            _log(f"pg_recvlogical: {args.rows / ceiling_s:,.0f} rows/s; measuring cdcd", quiet)
            cdcd_s, setup_s = _cdcd_rate(dsn, bootstrap, end_lsn)
            _log(f"cdcd: {args.rows / cdcd_s:,.0f} rows/s; measuring latency", quiet)
            latency = _latency(
                dsn, bootstrap, bindir, args.offered_rows_per_s, args.latency_seconds, quiet
            )
            _log(f"latency p50 {latency['p50']:.1f} ms, p99 {latency['p99']:.1f} ms", quiet)
            peak = _peak_rss_big_transaction(dsn, bootstrap, args.big_rows, quiet)
            for slot in (CEILING_SLOT, CDCD_SLOT):
                _drop_slot(conn, slot)
        finally:
            conn.close()
    ceiling = args.rows / ceiling_s
    rate = args.rows / cdcd_s
    return BenchResult(
        rows=args.rows,
        ceiling_rows_per_s=ceiling,
        cdcd_rows_per_s=rate,
        ratio=rate / ceiling,
        offered_rows_per_s=args.offered_rows_per_s,
        latency_ms={k: latency[k] for k in ("p50", "p99", "max")},
        peak_rss_mb=peak,
        big_transaction_rows=args.big_rows,
        seed=args.seed,
        details={
            "load_seconds": round(load_s, 1),
            "ceiling_seconds": round(ceiling_s, 2),
            "cdcd_seconds": round(cdcd_s, 2),
            "cdcd_setup_seconds": round(setup_s, 2),
            "latency_transactions": int(latency["transactions"]),
            "cpus": os.cpu_count(),
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dsn", help="PostgreSQL to use (default: a throwaway cluster)")
    parser.add_argument("--bootstrap-servers", help="Kafka to use (default: the bundled broker)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the throughput load")
    parser.add_argument("--seed", type=int, default=42, help="seed of the workload")
    parser.add_argument("--offered-rows-per-s", type=int, default=10_000, help="latency load")
    parser.add_argument("--latency-seconds", type=float, default=20.0, help="latency run length")
    parser.add_argument("--big-rows", type=int, default=1_000_000, help="rows of the big transaction")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.rows < 10 or args.rows % 10:
        raise DefiniteError("--rows must be a positive multiple of 10")
    result = run_bench(args)
    data = result.as_json()
    if args.json:
        print(json.dumps(data))
        return 0
    lines = [
        ("rows (transactions of 10)", f"{result.rows:,}"),
        ("pg_recvlogical ceiling", f"{result.ceiling_rows_per_s:,.0f} rows/s"),
        ("cdcd end to end (acks=all, confirmed)", f"{result.cdcd_rows_per_s:,.0f} rows/s"),
        ("ratio", f"{result.ratio:.2f}"),
        (
            f"commit-to-ack latency at {result.offered_rows_per_s:,} rows/s",
            "p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max:.1f} ms".format(**result.latency_ms),
        ),
        (f"peak RSS, one {result.big_transaction_rows:,}-row transaction", f"{result.peak_rss_mb:.0f} MB"),
    ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0
