"""Initial snapshot of the SPEC §9 ``orders`` table against its ``COPY`` ceiling.

Run: ``.venv/bin/python -m tests.bench.bench_snapshot [--rows 1000000] [--connections 1,2]
[--processes 2]``.

Uses ``cdcd bench``'s own pieces (``cdcd.tools.bench``): a throwaway
PostgreSQL 15 and broker (or ``--dsn`` / ``--bootstrap-servers``), the §9
load, then per connection count:

* the initial snapshot (``snapshot.mode: initial_only``, ``parallelism`` =
  connections, the session in this process): rows/s from the first read to
  the last acknowledgement, cdcd's CPU per row (this process, the bench's
  threads left out) and the server's CPU per row (the backends, from /proc);
  with ``--processes N``, also read by N worker processes (``snapshot.processes``):
  cdcd's CPU is then this process's plus the workers' (their whole lives),
  and the workers' peak RSS and this process's are printed;
* ``COPY … TO STDOUT`` of the same table over the same number of
  connections, each from a client process of its own, to /dev/null: the
  rate and server CPU per row PostgreSQL needs to hand the rows over at all;
* with ``--incremental``, an incremental snapshot of the same table while
  streaming (requested in the signal table, ``--chunk-rows`` per chunk): rows/s
  from the request to the job recorded done, and cdcd's CPU per row.

CPU per row is the figure to compare across runs on a busy machine; rows/s
moves with whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import psycopg2.errors

from cdcd.config.model import parse_config
from cdcd.observability.metrics import Metrics
from cdcd.tools.bench import session as bench_session
from cdcd.tools.bench.ceilings import copy_ceiling
from cdcd.tools.bench.cpu import cdcd_cpu_s
from cdcd.tools.bench.workload import SCHEMA, connect, drop_slot, environment, load, prepare

INCREMENTAL_SLOT = "cdcd_bench_incremental"


def _drop_when_released(conn: Any, slot: str, timeout_s: float = 60.0) -> None:
    """Drop ``slot`` once its walsender let go of it (it ends just after the session)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            drop_slot(conn, slot)
            return
        except psycopg2.errors.ObjectInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def incremental(dsn: str, bootstrap: str, rows: int, chunk_rows: int) -> dict[str, float]:
    """An incremental snapshot of the loaded table while streaming: rows/s, cdcd CPU per row."""
    conn = connect(dsn)
    try:
        drop_slot(conn, INCREMENTAL_SLOT)
        with conn.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (INCREMENTAL_SLOT,))
        config = bench_session.bench_config(dsn, bootstrap, INCREMENTAL_SLOT).model_dump()
        config["kafka"]["topic_prefix"] = "cdcd_bench_incremental"
        config["snapshot"] = {"mode": "never", "chunk_rows": chunk_rows}
        parsed = parse_config(config)
        with bench_session.running_session(parsed, Metrics(process_collectors=False)) as running:
            job = f"bench-{time.time_ns()}"
            started, cpu = time.monotonic(), cdcd_cpu_s()
            with conn.cursor() as cur:
                cur.execute(
                    "INSERT INTO cdcd_signal (id, data) VALUES (%s, %s)",
                    (job, json.dumps({"data-collections": [f"{SCHEMA}.orders"]})),
                )
            while True:
                running.check()
                with conn.cursor() as cur:
                    cur.execute("SELECT status FROM cdcd_signal WHERE id = %s", (job,))
                    if cur.fetchone()[0] == "done":
                        break
                time.sleep(0.05)
            elapsed, cpu = time.monotonic() - started, cdcd_cpu_s() - cpu
        _drop_when_released(conn, INCREMENTAL_SLOT)
    finally:
        conn.close()
    return {
        "incremental_rows_per_s": round(rows / elapsed),
        "incremental_cdcd_cpu_us_per_row": round(cpu / rows * 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--connections", default="1,2", help="comma-separated counts to compare")
    parser.add_argument(
        "--processes", default="", help="comma-separated worker process counts to compare too"
    )
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object per line, no progress")
    parser.add_argument("--incremental", action="store_true", help="also an incremental snapshot")
    parser.add_argument("--chunk-rows", type=int, default=10_000)
    args = parser.parse_args()
    with environment(args) as (dsn, bootstrap, _):
        conn = connect(dsn)
        try:
            prepare(conn)
        finally:
            conn.close()
        load(dsn, args.rows, args.seed, args.json)
        runs = [(int(c), 0) for c in args.connections.split(",") if c]
        runs += [(int(p), int(p)) for p in args.processes.split(",") if p and int(p) > 0]
        for connections, processes in runs:
            # A slot of its own per run (module attribute), since each run
            # creates its slot exporting a snapshot.
            bench_session.SNAPSHOT_SLOT = f"cdcd_bench_snapshot_{connections}_{processes}"
            run = bench_session.initial_snapshot(
                dsn, bootstrap, args.rows, connections=connections, processes=processes
            )
            copy = copy_ceiling(dsn, connections)
            figures = {
                "connections": connections,
                "processes": processes,
                "workers_cpu_us_per_row": round(run.workers_cpu_s / args.rows * 1e6, 2),
                "workers_peak_rss_mb": run.workers_peak_rss_mb or [],
                "parent_peak_rss_mb": round(run.parent_peak_rss_mb, 1),
                "rows": args.rows,
                "rows_per_s": round(args.rows / run.seconds),
                "cdcd_cpu_us_per_row": round(run.cdcd_cpu_s / args.rows * 1e6, 2),
                "server_cpu_us_per_row": round(run.server_cpu_s / args.rows * 1e6, 2),
                "copy_rows_per_s": round(copy.rows / copy.seconds),
                "copy_server_cpu_us_per_row": round(copy.server_cpu_s / max(copy.rows, 1) * 1e6, 2),
            }
            figures["ratio_copy"] = round(figures["rows_per_s"] / figures["copy_rows_per_s"], 3)
            if args.json:
                print(json.dumps(figures), flush=True)
            else:
                print(
                    f"{connections} connection(s), {processes} processes: snapshot "
                    f"{figures['rows_per_s']:,} rows/s, "
                    f"cdcd {figures['cdcd_cpu_us_per_row']} µs/row, server "
                    f"{figures['server_cpu_us_per_row']} µs/row | COPY {figures['copy_rows_per_s']:,} "
                    f"rows/s, server {figures['copy_server_cpu_us_per_row']} µs/row | "
                    f"ratio {figures['ratio_copy']} | peak RSS workers "
                    f"{figures['workers_peak_rss_mb']} MB, this process {figures['parent_peak_rss_mb']} MB",
                    flush=True,
                )
        if args.incremental:
            figures = incremental(dsn, bootstrap, args.rows, args.chunk_rows)
            print(json.dumps(figures) if args.json else f"incremental snapshot: {figures}", flush=True)


if __name__ == "__main__":
    main()
