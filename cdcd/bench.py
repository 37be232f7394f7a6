"""``cdcd bench``: the benchmark of SPEC §9, in one run.

Phases, all on the same fixed, seeded workload (``orders``, SPEC §9):

1. **Load.** Two slots are created *before* the load (one for
   ``pg_recvlogical``, one for cdcd), then ``rows`` rows are inserted in
   transactions of 10, so both consumers later drain exactly the same WAL.
   The load session uses ``synchronous_commit=off`` (it does not change the
   WAL, only how fast the load finishes).
2. **Ceiling.** ``pg_recvlogical`` drains its slot with pgoutput (protocol 1)
   to /dev/null up to the end of the load: the raw rate one walsender
   decodes at, which no pgoutput consumer can beat. The walsender's CPU
   (utime + stime from ``/proc/<pid>/stat``, pid from the slot's
   ``active_pid``) over the rows is ``walsender_cpu_us_per_row``.
2b. **Decode ceiling.** ``pg_logical_slot_peek_binary_changes`` on
   ``cdcd_bench_peek``, a copy of the ceiling slot made before the load, with
   the same pgoutput options: the server decoding the same WAL with no client
   at all (wall time, and the backend's CPU from ``/proc/<pid>/sched``).
3. **cdcd end to end.** The real pipeline drains its slot: decode, envelope,
   produce with ``acks=all``, delivery reports, LSN confirmed. The rate is
   rows divided by the time from the session's start until the slot's
   ``confirmed_flush_lsn`` reaches the end of the load. The CPU of this
   process over exactly that drain, all threads (the session, librdkafka's,
   the metrics server) but the bench's own main thread, over the rows is
   ``cdcd_cpu_us_per_row``; the host-independent figure (see
   docs/performance.md).
3b. **Initial snapshot** (skip with ``--no-snapshot``). A session with
   ``snapshot.mode: initial_only`` copies the loaded table (``rows`` rows)
   on a new slot: rows/s and CPU per row from the snapshot's first read to
   its last acknowledgement, for cdcd and for the server backends that read.
   Then the ``COPY … TO STDOUT`` ceiling: the same table copied to /dev/null
   on as many connections as the snapshot reads with, and the server's CPU
   per row during it. The walsender's CPU per row while serving cdcd gives
   ``walsender_limit_rows_per_s``; ``ratio_*`` keys compare cdcd with each
   ceiling (docs/bench.md).
4. **Latency.** ``pgbench`` offers a fixed load (default 10,000 rows/s as
   1,000 transactions/s of 10 rows, ``synchronous_commit=on``) while the
   pipeline runs; for every transaction cdcd records commit time (from the
   server) to the moment Kafka acknowledged its last message and everything
   before it. p50/p99/max over the run, after a warm-up.
5. **Memory.** ``cdcd run`` as its own process through one transaction of
   ``big_rows`` rows; its peak RSS (VmHWM) is reported.
6. **Synchronous capture** (``synchronous``; skip with ``--no-synchronous``,
   or run alone with ``--only synchronous``). cdcd streams a table of its own
   (slot ``cdcd_bench_sync``, named in ``synchronous_standby_names`` by its
   default ``application_name``) while one connection commits single-row
   INSERTs at a fixed rate (``--sync-commits-per-s``, default 200/s, for
   ``--sync-seconds`` each): into the captured table, into a table cdcd does
   not capture, then into the captured table with
   ``synchronous_standby_names`` empty again. The latency is the client's,
   from sending the INSERT to its return (each commit is its own
   transaction); p50/p99/max after a warm-up, and the p99 added over the
   asynchronous run. The setting is restored to what it was.

PostgreSQL and the broker are throwaway ones unless ``--dsn`` /
``--bootstrap-servers`` are given (the workload then lives in schema
``cdcd_bench`` of that database, which is dropped and recreated, as are the
benchmark's slots and publication).
"""

from __future__ import annotations

import argparse
import json
import logging
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
from cdcd.protocol.native import native_status

SCHEMA = "cdcd_bench"
PUBLICATION = "cdcd_bench"
CEILING_SLOT = "cdcd_bench_ceiling"
CDCD_SLOT = "cdcd_bench_cdcd"
SYNC_SLOT = "cdcd_bench_sync"
SYNC_PUBLICATION = "cdcd_bench_sync"
BIG_SLOT = "cdcd_bench_big"
SNAPSHOT_SLOT = "cdcd_bench_snapshot"
#: A copy of the ceiling slot, made before the load, that only the decode
#: ceiling peeks at (never consumed).
PEEK_SLOT = "cdcd_bench_peek"
#: Connections reading cdcd's initial snapshot (``snapshot.parallelism``),
#: and so the connections of the ``COPY`` ceiling it is compared with.
SNAPSHOT_CONNECTIONS = 1
#: pgoutput options of both server-side ceilings (``pg_recvlogical`` and the
#: peek): the same text decoding for the same publication.
PGOUTPUT_OPTIONS = (("proto_version", "1"), ("publication_names", PUBLICATION))
TOPIC_PREFIX = "cdcd_bench"
#: application_name of the bench's own connections.
BENCH_APPLICATION = "cdcd_bench"
#: The walsender serving a slot.
SLOT_PID_SQL = "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND active_pid IS NOT NULL"
#: Every server process of this database but the bench's own connections.
DATABASE_PIDS_SQL = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND application_name <> %s"
)


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
    cdcd_cpu_us_per_row: float
    walsender_cpu_us_per_row: float
    cpu_count: int
    snapshot: dict[str, Any] | None = None
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
            "cdcd_cpu_us_per_row": round(self.cdcd_cpu_us_per_row, 2),
            "walsender_cpu_us_per_row": round(self.walsender_cpu_us_per_row, 2),
            "cpu_ratio": round(self.cdcd_cpu_us_per_row / self.walsender_cpu_us_per_row, 3),
            "cpu_count": self.cpu_count,
            **({"snapshot": self.snapshot} if self.snapshot is not None else {}),
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
    # Named, so that the server CPU of a phase leaves the bench's own connections out.
    conn = psycopg2.connect(dsn, application_name=BENCH_APPLICATION)
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
    """The end of the WAL written so far, once it is flushed.

    The load commits with ``synchronous_commit=off``: right after it, the
    write position may still lie before its last commit records, and a
    consumer could be confirmed past that position (idle keepalives) before
    it even decoded them. The insert position includes every commit
    returned so far; waiting for the flush to reach it makes that WAL
    visible to the walsenders.
    """
    insert = _lsn(conn, "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
    while _lsn(conn, "SELECT pg_current_wal_flush_lsn() - '0/0'::pg_lsn") < insert:
        time.sleep(0.01)
    return insert


def _drop_slot(conn: Any, slot: str) -> None:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )


def _prepare(conn: Any) -> None:
    with conn.cursor() as cur:
        for slot in (CEILING_SLOT, CDCD_SLOT, PEEK_SLOT, BIG_SLOT, SNAPSHOT_SLOT, SYNC_SLOT):
            _drop_slot(conn, slot)
        cur.execute(f"DROP PUBLICATION IF EXISTS {SYNC_PUBLICATION}")
        cur.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
        cur.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        cur.execute(f"CREATE SCHEMA {SCHEMA}")
        cur.execute(orders_ddl(f"{SCHEMA}.orders"))
        cur.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {SCHEMA}.orders")
        for slot in (CEILING_SLOT, CDCD_SLOT):
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        # Before the load, like the others: the peek decodes the same WAL.
        cur.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (CEILING_SLOT, PEEK_SLOT))


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


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_s(pid: int, path: Path | None = None) -> float | None:
    """utime + stime of process ``pid`` in seconds, None once it is gone."""
    try:
        stat = (path or Path(f"/proc/{pid}/stat")).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the command name (which may hold spaces): state is field 3,
    # utime 14 and stime 15 (proc(5)).
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS




class _BackendCpu:
    """CPU seconds of the server processes serving a phase, sampled from ``/proc``.

    The server's processes are not this process's children: their CPU can
    only be read while they live, so a sampler thread reads each one every
    ``interval_s`` and keeps the last value, from the process's start. What a
    process spends after its last sample (at most one interval) is missed:
    the figure errs low, in the server's favour. ``sql`` (with ``params``)
    lists the pids to follow; it runs on a connection of its own every 0.1 s.
    The sampler thread is in ``_BENCH_THREADS`` while it runs.
    """

    def __init__(self, dsn: str, sql: str, params: tuple[Any, ...], interval_s: float = 0.01) -> None:
        self._dsn = dsn
        self._sql = sql
        self._params = params
        self._interval_s = interval_s
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-proc-cpu", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> _BackendCpu:
        self._thread.start()
        while self._thread.ident not in _BENCH_THREADS and self._thread.is_alive():
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        ident = threading.get_ident()
        _BENCH_THREADS.add(ident)
        pids: set[int] = set()
        next_find = 0.0
        try:
            conn = _connect(self._dsn)
            try:
                while not self._stop.is_set():
                    now = time.monotonic()
                    if now >= next_find:
                        with conn.cursor() as cur:
                            cur.execute(self._sql, self._params)
                            pids.update(int(row[0]) for row in cur.fetchall())
                        # Until one is found, look every interval: a small
                        # load's walsender may live less than 0.1 s.
                        next_find = now + (0.1 if pids else self._interval_s)
                    for pid in pids:
                        cpu = _proc_cpu_s(pid)
                        if cpu is not None:
                            self._seen[pid] = cpu
                    self._stop.wait(self._interval_s)
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by cpu_s
            self.error = exc
        finally:
            _BENCH_THREADS.discard(ident)

    def cpu_s(self) -> float:
        if self.error is not None:
            raise DefiniteError(f"could not sample the server's CPU: {self.error}")
        return sum(self._seen.values())

    @property
    def pids(self) -> list[int]:
        return sorted(self._seen)


#: Threads of this process that are the benchmark's, not cdcd's: the main
#: thread (it waits for the slot) and live ``_BackendCpu`` samplers.
_BENCH_THREADS: set[int] = set()


def _cdcd_cpu_s() -> float:
    """CPU seconds of this process so far, every thread but the benchmark's own.

    The pipeline runs in this process (the session thread, librdkafka's
    threads, the metrics server); what the bench's threads spend waiting and
    sampling is left out. Only differences of two readings mean anything,
    and both must fall while the same bench threads live.
    """
    total = time.process_time()
    for ident in _BENCH_THREADS | {threading.main_thread().ident or 0}:
        total -= time.clock_gettime(time.pthread_getcpuclockid(ident))
    return total


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name, the bench's left out.

    Python threads by their Python name, librdkafka's by theirs
    (``rdk:main``, ``rdk:broker1``, ...); threads of one name are summed.
    """
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    bench = {threading.main_thread().native_id}
    bench |= {t.native_id for t in threading.enumerate() if t.name == "bench-proc-cpu"}
    result: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        if tid in bench:
            continue
        cpu = _proc_cpu_s(tid, task / "stat")
        if cpu is None:
            continue
        try:
            name = names.get(tid) or (task / "comm").read_text().strip()
        except FileNotFoundError:
            continue
        result[name] = result.get(name, 0.0) + cpu
    return result


def _ceiling(dsn: str, bindir: Path, end_lsn: int) -> tuple[float, float]:
    """pg_recvlogical to /dev/null up to ``end_lsn``: (seconds, walsender CPU seconds)."""
    binary = bindir / "pg_recvlogical"
    if not binary.exists():
        found = shutil.which("pg_recvlogical")
        if found is None:
            raise DefiniteError("pg_recvlogical not found", hint="install postgresql-15")
        binary = Path(found)
    end = f"{end_lsn >> 32:X}/{end_lsn & 0xFFFFFFFF:X}"
    options = [arg for name, value in PGOUTPUT_OPTIONS for arg in ("-o", f"{name}={value}")]
    argv = [
        str(binary), "--dbname", dsn, "--slot", CEILING_SLOT, "--start", "--no-loop",
        *options, "--endpos", end, "-f", "/dev/null",
    ]  # fmt: skip
    with _BackendCpu(dsn, SLOT_PID_SQL, (CEILING_SLOT,)) as walsender:
        started = time.monotonic()
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        _, stderr = process.communicate()
        elapsed = time.monotonic() - started
    if process.returncode != 0:
        raise DefiniteError(f"pg_recvlogical failed: {stderr.strip()}")
    if not walsender.pids:
        raise DefiniteError("the walsender serving pg_recvlogical was not found")
    return elapsed, walsender.cpu_s()


#: Every CPU figure of the server is read from /proc on this host.
PROC_HINT = "run cdcd bench on the PostgreSQL host, as a user that may read its /proc"


def _backend_cpu_s(pid: int) -> float:
    """CPU seconds of server process ``pid`` so far, to the nanosecond where the kernel says.

    ``/proc/<pid>/sched`` (``se.sum_exec_runtime``, ms) is exact; ``stat``'s
    10 ms ticks would round a small run's COPY to zero. Only differences of
    two readings of a live process mean anything.
    """
    try:
        for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
            if line.startswith("se.sum_exec_runtime"):
                return float(line.split(":", 1)[1]) / 1000.0
    except (FileNotFoundError, PermissionError, ValueError):
        pass
    cpu = _proc_cpu_s(pid)
    if cpu is None:
        raise DefiniteError(f"server process {pid} is not visible in /proc", hint=PROC_HINT)
    return cpu



def _backend_pid(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return int(cur.fetchone()[0])


@dataclass
class _Decode:
    seconds: float
    server_cpu_s: float
    messages: int


def _decode_ceiling(dsn: str, end_lsn: int, rows: int) -> _Decode:
    """The server decoding the load with no client: a peek on the copy of the slot.

    ``pg_logical_slot_peek_binary_changes`` decodes in the backend that calls
    it (same pgoutput options as ``pg_recvlogical``) into a tuplestore, and
    ``count(*)`` reads that back: no network, no client, nothing confirmed.
    """
    conn = _connect(dsn)
    try:
        pid = _backend_pid(conn)
        end = f"{end_lsn >> 32:X}/{end_lsn & 0xFFFFFFFF:X}"
        options = [item for pair in PGOUTPUT_OPTIONS for item in pair]
        placeholders = ", ".join(["%s"] * len(options))
        sql = (
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes("
            f"%s, %s::pg_lsn, NULL, {placeholders})"
        )
        with conn.cursor() as cur:
            cpu_start = _backend_cpu_s(pid)
            started = time.monotonic()
            cur.execute(sql, (PEEK_SLOT, end, *options))
            messages = int(cur.fetchone()[0])
            elapsed = time.monotonic() - started
            cpu = _backend_cpu_s(pid) - cpu_start
    finally:
        # The copy holds WAL back for as long as it exists: never leave it.
        _drop_slot(conn, PEEK_SLOT)
        conn.close()
    # BEGIN, one INSERT per row, COMMIT, and the RELATION: fewer means the
    # peek stopped short of the load and its rate would flatter the server.
    if messages < rows:
        raise DefiniteError(f"the peek decoded {messages} messages for {rows} rows")
    return _Decode(elapsed, cpu, messages)


@dataclass
class _Copy:
    seconds: float
    server_cpu_s: float
    rows: int


def _copy_ceiling(dsn: str, connections: int) -> _Copy:
    """``COPY … TO STDOUT`` of the whole table over ``connections`` connections, to /dev/null.

    Each connection copies one contiguous range of ``id`` (the whole table
    when there is one) from a client process of its own (``_copy_worker``),
    so that no client shares an interpreter lock with another; all start
    together, and the time is until the last one ends. The server CPU is that
    of the backends that copied, read from /proc before and after (exact).
    """
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT min(id), max(id) FROM {SCHEMA}.orders")
            low, high = (int(v or 0) for v in cur.fetchone())
    finally:
        conn.close()
    step = (high - low + connections) // connections
    columns = "id, customer_id, status, amount, created_at, note, flags, payload"
    statements = [
        f"COPY {SCHEMA}.orders TO STDOUT"
        if connections == 1
        else f"COPY (SELECT {columns} FROM {SCHEMA}.orders "
        f"WHERE id >= {low + i * step} AND id < {low + (i + 1) * step}) TO STDOUT"
        for i in range(connections)
    ]
    argv = [sys.executable, "-c", "from cdcd.bench import _copy_worker; _copy_worker()"]
    workers = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in statements
    ]
    try:
        for worker, statement in zip(workers, statements, strict=True):
            _tell(worker, json.dumps({"dsn": dsn, "statement": statement}))
        pids = [int(_hear(worker)) for worker in workers]
        cpu_start = sum(_backend_cpu_s(pid) for pid in pids)
        started = time.monotonic()
        for worker in workers:
            _tell(worker, "go")
        copied = sum(int(_hear(worker)) for worker in workers)
        elapsed = time.monotonic() - started
        cpu = sum(_backend_cpu_s(pid) for pid in pids) - cpu_start
    finally:
        for worker in workers:
            if worker.stdin is not None:
                worker.stdin.close()  # the worker closes its connection and exits
        for worker in workers:
            worker.wait(60)
    failed = [w.returncode for w in workers if w.returncode != 0]
    if failed:
        raise DefiniteError(f"a COPY client exited with {failed[0]}")
    return _Copy(elapsed, cpu, copied)


def _tell(worker: subprocess.Popen[str], line: str) -> None:
    assert worker.stdin is not None
    worker.stdin.write(line + "\n")
    worker.stdin.flush()


def _hear(worker: subprocess.Popen[str]) -> str:
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line:
        worker.wait(60)
        raise DefiniteError(f"a COPY client exited with {worker.returncode} before it answered")
    return line.strip()


def _copy_worker() -> None:
    """One client of the ``COPY`` ceiling, driven over stdin/stdout by ``_copy_ceiling``.

    Reads ``{"dsn", "statement"}``, connects and prints its backend's pid;
    on ``go`` copies into a buffered /dev/null (about as little as a client
    can do with a row) and prints the rows copied; closes at end of input.
    """
    request = json.loads(sys.stdin.readline())
    conn = _connect(request["dsn"])
    try:
        print(_backend_pid(conn), flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        with open(os.devnull, "wb") as sink, conn.cursor() as cur:
            cur.copy_expert(request["statement"], sink, size=1 << 20)
            print(cur.rowcount, flush=True)
        sys.stdin.read()
    finally:
        conn.close()


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


@dataclass
class _Running:
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
def _session(config: Any, metrics: Metrics) -> Iterator[_Running]:
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
    running = _Running(session, thread, failure)
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


def _run_session(config: Any, timeout_s: float) -> None:
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


def _wait_confirmed(
    conn: Any, slot: str, target: int, timeout_s: float, check: Any = None
) -> float:
    """Wait for the slot to confirm ``target``; ``check()`` raises if the consumer died."""
    started = time.monotonic()
    while _confirmed(conn, slot) < target:
        if time.monotonic() - started > timeout_s:
            raise DefiniteError(f"slot {slot} did not reach the end of the load in {timeout_s} s")
        if check is not None:
            check()
        time.sleep(0.02)
    return time.monotonic()


@dataclass
class _Drain:
    seconds: float
    setup_seconds: float
    cdcd_cpu_s: float
    walsender_cpu_s: float
    threads_cpu_s: dict[str, float]


def _cdcd_rate(dsn: str, bootstrap: str, end_lsn: int) -> _Drain:
    """The pipeline confirming the whole load: its time, setup time and CPU."""
    conn = _connect(dsn)
    try:
        metrics = Metrics(process_collectors=False)
        started = time.monotonic()
        with _session(_config(dsn, bootstrap, CDCD_SLOT), metrics) as running:
            with _BackendCpu(dsn, SLOT_PID_SQL, (CDCD_SLOT,)) as walsender:
                streaming = time.monotonic()
                cpu_start, threads_start = _cdcd_cpu_s(), _threads_cpu_s()
                finished = _wait_confirmed(
                    conn, CDCD_SLOT, end_lsn, timeout_s=1800, check=running.check
                )
                cpu_end, threads_end = _cdcd_cpu_s(), _threads_cpu_s()
        threads = {
            name: cpu - threads_start.get(name, 0.0)
            for name, cpu in threads_end.items()
        }
        # The walsender started with the session: its CPU before the drain
        # (slot start-up) is included, a few milliseconds.
        return _Drain(
            finished - streaming,
            streaming - started,
            cpu_end - cpu_start,
            walsender.cpu_s(),
            threads,
        )
    finally:
        conn.close()


class _SnapshotMarks(logging.Handler):
    """Time and CPU (``_cdcd_cpu_s``) at the log lines that bracket the initial snapshot."""

    MARKS = ("initial snapshot of", "initial snapshot complete")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: dict[str, tuple[float, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for mark in self.MARKS:
            if message.startswith(mark) and mark not in self.marks:
                self.marks[mark] = (time.monotonic(), _cdcd_cpu_s())


@dataclass
class _SnapshotRun:
    seconds: float
    cdcd_cpu_s: float
    server_cpu_s: float


def _snapshot(dsn: str, bootstrap: str, rows: int) -> _SnapshotRun:
    """An initial snapshot of the loaded table (``snapshot.mode: initial_only``,
    ``SNAPSHOT_CONNECTIONS`` readers)."""
    marks = _SnapshotMarks()
    snapshot_log = logging.getLogger("cdcd.snapshot")
    level = snapshot_log.level
    snapshot_log.addHandler(marks)
    snapshot_log.setLevel(logging.INFO)
    config = _config(dsn, bootstrap, SNAPSHOT_SLOT).model_dump()
    config["postgres"]["create_slot"] = True
    config["kafka"]["topic_prefix"] = f"{TOPIC_PREFIX}_snapshot"
    config["snapshot"] = {
        "mode": "initial_only",
        "parallelism": SNAPSHOT_CONNECTIONS,
        "chunk_rows": 10_000,
    }
    try:
        with _BackendCpu(dsn, DATABASE_PIDS_SQL, (BENCH_APPLICATION,)) as server:
            # initial_only: the session returns once the snapshot is delivered.
            _run_session(parse_config(config), timeout_s=1800)
    finally:
        snapshot_log.removeHandler(marks)
        snapshot_log.setLevel(level)
    if len(marks.marks) != len(marks.MARKS):
        raise DefiniteError(f"the initial snapshot did not log its start and end: {marks.marks}")
    (start_t, start_cpu), (end_t, end_cpu) = (marks.marks[m] for m in marks.MARKS)
    return _SnapshotRun(end_t - start_t, end_cpu - start_cpu, server.cpu_s())


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
        with _session(_config(dsn, bootstrap, CDCD_SLOT), metrics) as running:
            _wait_confirmed(conn, CDCD_SLOT, _current(conn), timeout_s=600, check=running.check)
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
            _wait_confirmed(conn, CDCD_SLOT, _current(conn), timeout_s=600, check=running.check)
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


def _commit_latencies(conn: Any, statement: str, per_s: int, seconds: float) -> list[float]:
    """Seconds each single-row commit took, one every ``1/per_s`` s (the first second left out)."""
    interval = 1.0 / per_s
    warmup = per_s  # one second
    total = warmup + int(per_s * seconds)
    samples: list[float] = []
    with conn.cursor() as cur:
        started = time.perf_counter()
        for i in range(total):
            delay = started + i * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sent = time.perf_counter()
            cur.execute(statement)
            if i >= warmup:
                samples.append(time.perf_counter() - sent)
    return samples


def _latency_summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50": round(_percentile(samples, 0.50) * 1000, 3),
        "p99": round(_percentile(samples, 0.99) * 1000, 3),
        "max": round(max(samples) * 1000, 3),
    }


def _standby_names(conn: Any, names: str) -> None:
    with conn.cursor() as cur:
        if names:
            cur.execute("ALTER SYSTEM SET synchronous_standby_names = %s", (names,))
        else:
            cur.execute("ALTER SYSTEM RESET synchronous_standby_names")
        cur.execute("SELECT pg_reload_conf()")


def _wait_sync_state(conn: Any, slot: str, counted: bool, timeout_s: float = 60.0) -> None:
    """Wait until the walsender of ``slot`` is (or is no longer) counted as synchronous."""
    deadline = time.monotonic() + timeout_s
    while True:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT r.sync_state FROM pg_stat_replication r JOIN pg_replication_slots s "
                "ON s.active_pid = r.pid WHERE s.slot_name = %s",
                (slot,),
            )
            row = cur.fetchone()
        if (row is not None and row[0] in ("sync", "quorum")) == counted:
            return
        if time.monotonic() > deadline:
            raise DefiniteError(
                f"slot {slot}'s walsender did not become {'' if counted else 'a'}synchronous "
                f"in {timeout_s} s (sync_state {row[0] if row else 'not streaming'})"
            )
        time.sleep(0.02)


def _synchronous(
    dsn: str, bootstrap: str, per_s: int, seconds: float, quiet: bool
) -> dict[str, Any]:
    """Commit latency with cdcd as the synchronous standby (captured, uncaptured) and without."""
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            _drop_slot(conn, SYNC_SLOT)
            cur.execute(f"DROP PUBLICATION IF EXISTS {SYNC_PUBLICATION}")
            cur.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            for table in ("sync_captured", "sync_uncaptured"):
                cur.execute(f"DROP TABLE IF EXISTS {SCHEMA}.{table}")
                cur.execute(f"CREATE TABLE {SCHEMA}.{table}(id bigserial PRIMARY KEY, note text)")
            cur.execute(f"CREATE PUBLICATION {SYNC_PUBLICATION} FOR TABLE {SCHEMA}.sync_captured")
            cur.execute("SELECT current_setting('synchronous_standby_names')")
            original = str(cur.fetchone()[0])
        config = _config(dsn, bootstrap, SYNC_SLOT).model_dump()
        config["postgres"].update(publication=SYNC_PUBLICATION, create_slot=True)
        config["kafka"]["topic_prefix"] = f"{TOPIC_PREFIX}_sync"
        insert = "INSERT INTO " + SCHEMA + ".{} (note) VALUES ('one row')"
        result: dict[str, Any] = {"commits_per_s": per_s, "seconds": seconds}
        with _session(parse_config(config), Metrics(process_collectors=False)) as running:
            try:
                # The slot's name is the replication connection's application_name.
                _standby_names(conn, SYNC_SLOT)
                _wait_sync_state(conn, SYNC_SLOT, counted=True)
                for key, table in (
                    ("captured_ms", "sync_captured"),
                    ("uncaptured_ms", "sync_uncaptured"),
                ):
                    _log(f"synchronous: {per_s} commits/s into {table} for {seconds:.0f} s", quiet)
                    result[key] = _latency_summary(
                        _commit_latencies(conn, insert.format(table), per_s, seconds)
                    )
                    running.check()
            finally:
                _standby_names(conn, original)
            _wait_sync_state(conn, SYNC_SLOT, counted=False)
            _log(f"synchronous: {per_s} commits/s into sync_captured, not synchronous", quiet)
            result["not_synchronous_ms"] = _latency_summary(
                _commit_latencies(conn, insert.format("sync_captured"), per_s, seconds)
            )
            running.check()
        baseline = result["not_synchronous_ms"]["p99"]
        result["added_p99_ms"] = {
            "captured": round(result["captured_ms"]["p99"] - baseline, 3),
            "uncaptured": round(result["uncaptured_ms"]["p99"] - baseline, 3),
        }
        _drop_slot(conn, SYNC_SLOT)
        return result
    finally:
        conn.close()


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

            def alive() -> None:
                if daemon.poll() is not None:
                    log.flush()
                    tail = (Path(tmp) / "daemon.log").read_text(errors="replace")[-3000:]
                    raise DefiniteError(f"cdcd run exited with {daemon.returncode}:\n{tail}")

            _wait_confirmed(conn, BIG_SLOT, _current(conn), timeout_s=1800, check=alive)
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
    rows = args.rows
    snapshot: dict[str, Any] | None = None
    synchronous: dict[str, Any] | None = None
    with _environment(args) as (dsn, bootstrap, bindir):
        conn = _connect(dsn)
        try:
            _prepare(conn)
            _log(f"loading {rows:,} rows in transactions of 10 (seed {args.seed})", quiet)
            load_s = _load(dsn, rows, args.seed, quiet)
            end_lsn = _current(conn)
            _log(f"loaded in {load_s:.1f} s; measuring pg_recvlogical", quiet)
            ceiling_s, walsender_cpu_s = _ceiling(dsn, bindir, end_lsn)
            _log(
                f"pg_recvlogical: {rows / ceiling_s:,.0f} rows/s, walsender "
                f"{walsender_cpu_s / rows * 1e6:.2f} µs CPU/row; peeking at the slot's copy",
                quiet,
            )
            decode = _decode_ceiling(dsn, end_lsn, rows)
            _log(
                f"server decode, no client: {rows / decode.seconds:,.0f} rows/s, "
                f"{decode.server_cpu_s / rows * 1e6:.2f} µs CPU/row; measuring cdcd",
                quiet,
            )
            drain = _cdcd_rate(dsn, bootstrap, end_lsn)
            _log(
                f"cdcd: {rows / drain.seconds:,.0f} rows/s, "
                f"{drain.cdcd_cpu_s / rows * 1e6:.2f} µs CPU/row",
                quiet,
            )
            if not args.no_snapshot:
                _log(f"initial snapshot of the {rows:,}-row table", quiet)
                run = _snapshot(dsn, bootstrap, rows)
                _drop_slot(conn, SNAPSHOT_SLOT)
                _log(
                    f"snapshot: {rows / run.seconds:,.0f} rows/s, "
                    f"{run.cdcd_cpu_s / rows * 1e6:.2f} µs CPU/row; COPY ceiling "
                    f"on {SNAPSHOT_CONNECTIONS} connection(s)",
                    quiet,
                )
                copy = _copy_ceiling(dsn, SNAPSHOT_CONNECTIONS)
                if copy.rows != rows:
                    raise DefiniteError(f"the COPY ceiling copied {copy.rows} rows, not {rows}")
                snapshot = _snapshot_figures(rows, run, copy)
                _log(
                    f"COPY: {snapshot['copy_rows_per_s']:,} rows/s, server "
                    f"{snapshot['copy_server_cpu_us_per_row']:.2f} µs CPU/row",
                    quiet,
                )
            _log("measuring latency", quiet)
            latency = _latency(
                dsn, bootstrap, bindir, args.offered_rows_per_s, args.latency_seconds, quiet
            )
            _log(f"latency p50 {latency['p50']:.1f} ms, p99 {latency['p99']:.1f} ms", quiet)
            peak = _peak_rss_big_transaction(dsn, bootstrap, args.big_rows, quiet)
            for slot in (CEILING_SLOT, CDCD_SLOT):
                _drop_slot(conn, slot)
            if not args.no_synchronous:
                synchronous = _synchronous(
                    dsn, bootstrap, args.sync_commits_per_s, args.sync_seconds, quiet
                )
        finally:
            conn.close()
    ceiling = rows / ceiling_s
    rate = rows / drain.seconds
    return BenchResult(
        rows=rows,
        ceiling_rows_per_s=ceiling,
        cdcd_rows_per_s=rate,
        ratio=rate / ceiling,
        offered_rows_per_s=args.offered_rows_per_s,
        latency_ms={k: latency[k] for k in ("p50", "p99", "max")},
        peak_rss_mb=peak,
        big_transaction_rows=args.big_rows,
        seed=args.seed,
        cdcd_cpu_us_per_row=drain.cdcd_cpu_s / rows * 1e6,
        walsender_cpu_us_per_row=walsender_cpu_s / rows * 1e6,
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        snapshot=snapshot,
        details={
            "load_seconds": round(load_s, 1),
            "ceiling_seconds": round(ceiling_s, 2),
            "cdcd_seconds": round(drain.seconds, 2),
            "cdcd_setup_seconds": round(drain.setup_seconds, 2),
            # The walsender serving cdcd: the same decoding, plus what
            # cdcd's status updates cost it.
            "walsender_cpu_us_per_row_cdcd": round(drain.walsender_cpu_s / rows * 1e6, 2),
            **_stream_ceilings(rows, rate, drain, decode),
            # Where cdcd's CPU went (/proc/self/task; 10 ms ticks per thread).
            "cdcd_cpu_us_per_row_by_thread": {
                name: round(cpu / rows * 1e6, 2)
                for name, cpu in sorted(drain.threads_cpu_s.items(), key=lambda kv: -kv[1])
                if cpu > 0
            },
            "latency_transactions": int(latency["transactions"]),
            # Which hot path ran: the C extensions, or the pure-Python code.
            "native": native_status(),
            **({"synchronous": synchronous} if synchronous is not None else {}),
        },
    )


def _stream_ceilings(rows: int, rate: float, drain: _Drain, decode: _Decode) -> dict[str, Any]:
    """The stream's server-side ceilings and cdcd's ratios against them (docs/bench.md).

    ``walsender_limit_rows_per_s``: the rate a walsender could serve if it
    spent all of one core the way it did serving cdcd. ``decode_*``: the
    server decoding the same WAL with no client (the peek).
    """
    walsender_us = drain.walsender_cpu_s / rows * 1e6
    limit = 1e6 / walsender_us if walsender_us > 0 else None
    decode_rate = rows / decode.seconds
    decode_us = decode.server_cpu_s / rows * 1e6
    cdcd_us = drain.cdcd_cpu_s / rows * 1e6
    return {
        "walsender_limit_rows_per_s": round(limit) if limit else None,
        "ratio_walsender_limit": round(rate / limit, 3) if limit else None,
        "cpu_ratio_walsender_cdcd": round(cdcd_us / walsender_us, 3) if walsender_us else None,
        "decode_rows_per_s": round(decode_rate),
        "decode_seconds": round(decode.seconds, 4),
        "decode_messages": decode.messages,
        "decode_server_cpu_us_per_row": round(decode_us, 2),
        "ratio_decode": round(rate / decode_rate, 3),
    }


def _snapshot_figures(rows: int, run: _SnapshotRun, copy: _Copy) -> dict[str, Any]:
    """The snapshot section: cdcd's snapshot and the ``COPY`` ceiling on as many connections."""
    rate = rows / run.seconds
    copy_rate = rows / copy.seconds
    cdcd_us = run.cdcd_cpu_s / rows * 1e6
    copy_server_us = copy.server_cpu_s / rows * 1e6
    return {
        "rows": rows,
        "rows_per_s": round(rate),
        "seconds": round(run.seconds, 2),
        "connections": SNAPSHOT_CONNECTIONS,
        "cdcd_cpu_us_per_row": round(cdcd_us, 2),
        "server_cpu_us_per_row": round(run.server_cpu_s / rows * 1e6, 2),
        "copy_rows_per_s": round(copy_rate),
        "copy_seconds": round(copy.seconds, 4),
        "copy_server_cpu_us_per_row": round(copy_server_us, 3),
        "ratio_copy": round(rate / copy_rate, 3),
        "cpu_ratio_copy_server": round(cdcd_us / copy_server_us, 3) if copy_server_us else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dsn", help="PostgreSQL to use (default: a throwaway cluster)")
    parser.add_argument("--bootstrap-servers", help="Kafka to use (default: the bundled broker)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the throughput load")
    parser.add_argument("--seed", type=int, default=42, help="seed of the workload")
    parser.add_argument("--offered-rows-per-s", type=int, default=10_000, help="latency load")
    parser.add_argument("--latency-seconds", type=float, default=20.0, help="latency run length")
    parser.add_argument("--big-rows", type=int, default=1_000_000, help="rows of the big transaction")
    parser.add_argument(
        "--no-snapshot", action="store_true", help="skip the initial snapshot measurement"
    )
    parser.add_argument(
        "--no-synchronous", action="store_true", help="skip the synchronous capture measurement"
    )
    parser.add_argument(
        "--only",
        choices=["synchronous"],
        help="run one section alone: synchronous (commit latency with cdcd as the "
        "synchronous standby; a minute instead of the whole benchmark)",
    )
    parser.add_argument(
        "--sync-commits-per-s", type=int, default=200, help="synchronous: commit rate"
    )
    parser.add_argument(
        "--sync-seconds", type=float, default=10.0, help="synchronous: seconds of each run"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.only == "synchronous":
        return _cmd_synchronous_only(args)
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
            "CPU per row: cdcd (all threads) / walsender",
            f"{result.cdcd_cpu_us_per_row:.2f} µs / {result.walsender_cpu_us_per_row:.2f} µs "
            f"(ratio {data['cpu_ratio']:.2f}, {result.cpu_count} cores)",
        ),
        (
            "walsender serving cdcd: CPU/row, the rate it implies",
            f"{data['walsender_cpu_us_per_row_cdcd']:.2f} µs, "
            f"{data['walsender_limit_rows_per_s'] or 0:,.0f} rows/s "
            f"(cdcd at {data['ratio_walsender_limit'] or 0:.2f} of it)",
        ),
        (
            "server decode, no client (peek on a copy of the slot)",
            f"{data['decode_rows_per_s']:,.0f} rows/s, "
            f"{data['decode_server_cpu_us_per_row']:.2f} µs CPU/row "
            f"(cdcd at {data['ratio_decode']:.2f} of it)",
        ),
        (
            f"commit-to-ack latency at {result.offered_rows_per_s:,} rows/s",
            "p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max:.1f} ms".format(**result.latency_ms),
        ),
        (f"peak RSS, one {result.big_transaction_rows:,}-row transaction", f"{result.peak_rss_mb:.0f} MB"),
    ]
    if "synchronous" in data:
        lines.extend(_synchronous_lines(data["synchronous"]))
    if result.snapshot is not None:
        snap = result.snapshot
        lines.append(
            (
                f"initial snapshot, {snap['rows']:,.0f} rows",
                f"{snap['rows_per_s']:,.0f} rows/s; CPU per row cdcd "
                f"{snap['cdcd_cpu_us_per_row']:.2f} µs, server {snap['server_cpu_us_per_row']:.2f} µs",
            )
        )
        lines.append(
            (
                f"COPY … TO STDOUT ceiling, {snap['connections']} connection(s)",
                f"{snap['copy_rows_per_s']:,.0f} rows/s, server "
                f"{snap['copy_server_cpu_us_per_row']:.2f} µs CPU/row "
                f"(snapshot at {snap['ratio_copy']:.2f} of it)",
            )
        )
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0


def _synchronous_lines(sync: dict[str, Any]) -> list[tuple[str, str]]:
    def fmt(summary: dict[str, float]) -> str:
        return "p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {max:.2f} ms".format(**summary)

    rate = f"{sync['commits_per_s']} single-row commits/s"
    return [
        (f"commit, cdcd synchronous, captured table ({rate})", fmt(sync["captured_ms"])),
        (f"commit, cdcd synchronous, uncaptured table ({rate})", fmt(sync["uncaptured_ms"])),
        (f"commit, not synchronous ({rate})", fmt(sync["not_synchronous_ms"])),
        (
            "p99 added by synchronous capture",
            "captured {captured:.2f} ms, uncaptured {uncaptured:.2f} ms".format(
                **sync["added_p99_ms"]
            ),
        ),
    ]


def _cmd_synchronous_only(args: argparse.Namespace) -> int:
    """``cdcd bench --only synchronous``: the synchronous section alone."""
    with _environment(args) as (dsn, bootstrap, _bindir):
        sync = _synchronous(dsn, bootstrap, args.sync_commits_per_s, args.sync_seconds, args.json)
    if args.json:
        print(json.dumps({"synchronous": sync, "native": native_status()}))
        return 0
    lines = _synchronous_lines(sync)
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0
