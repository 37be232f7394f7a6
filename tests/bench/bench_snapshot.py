"""Snapshot throughput (rows/s) for the SPEC §9 ``orders`` table.

Run: ``.venv/bin/python tests/bench/bench_snapshot.py [--rows 1000000] [--parallelism 1,2]``.

Starts a throwaway PostgreSQL 15 and tansu broker, fills ``orders`` with
``--rows`` rows shaped like the SPEC §9 workload (random customer_id and
amount, status 'shipped', an md5 note, alternating flags, a two-key JSON
payload), then measures, in this process, a ``cdcd.pipeline.session.Session``:

* the initial snapshot (``snapshot.mode: initial_only``: create the slot with
  an exported snapshot, read, encode, produce, wait for every acknowledgement)
  once per ``--parallelism`` value; the figure is the rows divided by the time
  from the first read to the last acknowledgement (slot creation and topic
  setup excluded);
* an incremental snapshot of the same table while streaming (requested in
  the signal table, ``--chunk-rows`` per chunk): rows divided by the time from
  the request being picked up to the job being recorded done.

PostgreSQL, the broker and this process share the machine's cores, so the
figures are for comparing runs on one machine, not absolute.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

from cdcd.config.model import parse_config
from cdcd.local.broker import LocalBroker
from cdcd.local.postgres import LocalPostgres
from cdcd.local.workload import orders_ddl
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.session import Session

ORDERS = orders_ddl() + """;
INSERT INTO orders(customer_id, status, amount, note, flags, payload)
SELECT (random() * 100000)::int, 'shipped', round((random() * 10000)::numeric, 2),
       md5(g::text), g %% 2 = 0, jsonb_build_object('sku', g %% 1000, 'qty', g %% 7)
FROM generate_series(1, %s) g;
"""


class _Marks(logging.Handler):
    """Timestamps of the snapshot log lines that bracket the measured work."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for mark in ("initial snapshot of", "initial snapshot complete", "incremental snapshot",
                     "snapshot job"):
            if message.startswith(mark) and mark not in self.marks:
                self.marks[mark] = record.created


def _config(dsn: str, bootstrap: str, prefix: str, slot: str, snapshot: dict[str, Any]) -> Any:
    return parse_config(
        {
            "postgres": {"dsn": dsn, "slot": slot, "tables": ["public.orders"], "status_interval_s": 1},
            "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "partitions": 6},
            "snapshot": snapshot,
            "metrics": {"listen": "127.0.0.1:0"},
            "heartbeat": {"interval_s": 0},
        }
    )


def bench_initial(dsn: str, bootstrap: str, rows: int, parallelism: int, chunk_rows: int) -> float:
    marks = _Marks()
    logging.getLogger("cdcd.snapshot").addHandler(marks)
    slot = f"bench_initial_{parallelism}"
    config = _config(
        dsn, bootstrap, f"bi{parallelism}", slot,
        {"mode": "initial_only", "parallelism": parallelism, "chunk_rows": chunk_rows},
    )
    try:
        Session(config, threading.Event(), Metrics(process_collectors=False)).run()
    finally:
        logging.getLogger("cdcd.snapshot").removeHandler(marks)
    elapsed = marks.marks["initial snapshot complete"] - marks.marks["initial snapshot of"]
    return rows / elapsed


def bench_incremental(pg: LocalPostgres, dsn: str, bootstrap: str, rows: int, chunk_rows: int) -> float:
    marks = _Marks()
    logging.getLogger("cdcd.snapshot").addHandler(marks)
    config = _config(dsn, bootstrap, "bincr", "bench_incremental",
                     {"mode": "never", "chunk_rows": chunk_rows})
    stop = threading.Event()
    session = Session(config, stop, Metrics(process_collectors=False))
    thread = threading.Thread(target=session.run, daemon=True)
    thread.start()
    try:
        while not pg.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = "
                             "'bench_incremental' AND active", dbname="bench"):
            time.sleep(0.1)
        pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('bench', "
                   "'{\"data-collections\": [\"public.orders\"]}')", dbname="bench")
        while pg.execute("SELECT status FROM cdcd_signal WHERE id = 'bench'",
                         dbname="bench")[0][0] != "done":
            if not thread.is_alive():
                raise RuntimeError("the session stopped")
            time.sleep(0.05)
        done = time.time()
    finally:
        stop.set()
        thread.join(60)
        logging.getLogger("cdcd.snapshot").removeHandler(marks)
    return rows / (done - marks.marks["incremental snapshot"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--parallelism", default="1,2", help="comma-separated values to compare")
    parser.add_argument("--chunk-rows", type=int, default=10_000)
    parser.add_argument("--no-incremental", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("cdcd.snapshot").setLevel(logging.INFO)
    pg = LocalPostgres.start()
    broker = LocalBroker.start()
    try:
        pg.create_database("bench")
        started = time.monotonic()
        pg.execute(ORDERS, (args.rows,), dbname="bench")
        pg.execute("VACUUM ANALYZE orders", dbname="bench")
        print(f"loaded {args.rows:,} rows into orders in {time.monotonic() - started:.1f} s")
        dsn = pg.dsn("bench")
        for parallelism in (int(p) for p in args.parallelism.split(",")):
            rate = bench_initial(dsn, broker.bootstrap_servers, args.rows, parallelism, args.chunk_rows)
            print(f"initial snapshot, parallelism {parallelism}, chunk_rows {args.chunk_rows}: "
                  f"{rate:,.0f} rows/s")
        if not args.no_incremental:
            rate = bench_incremental(pg, dsn, broker.bootstrap_servers, args.rows, args.chunk_rows)
            print(f"incremental snapshot while streaming, chunk_rows {args.chunk_rows}: "
                  f"{rate:,.0f} rows/s")
    finally:
        broker.cleanup()
        pg.cleanup()


if __name__ == "__main__":
    main()
