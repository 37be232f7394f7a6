"""Schema changes on a big table: what a fast default and a rewrite cost the daemon.

Run: ``.venv/bin/python tests/bench/bench_schema_changes.py [--rows 1000000] [--backlog 300000]``.

Starts a throwaway PostgreSQL 15 and tansu broker, loads the SPEC §9
``orders`` table with ``--rows`` rows and runs ``cdcd run`` as a child process
(``snapshot.mode: never``, ``schema_changes.resnapshot: auto``), then:

1. **Before**: with the daemon stopped, updates ``--backlog`` rows in
   1,000-row transactions, starts the daemon and times it until the slot's
   confirmed position reaches the end of that WAL (rows/s).
2. ``ALTER TABLE orders ADD COLUMN region text DEFAULT 'eu'`` (a fast default:
   no rewrite), then the same backlog and the same timing (**after**). It
   checks that no re-snapshot was requested and that the change was logged
   as ``add_column_default``.
3. ``ALTER TABLE orders ADD COLUMN r float8 DEFAULT random()`` (a table
   rewrite) and one row change, with the daemon running: the re-snapshot's
   duration (from the request to the job recorded done) and the daemon's
   peak RSS while it runs (sampled every 0.1 s from /proc, and VmHWM).

PostgreSQL, the broker and the daemon share the machine's cores: the
figures compare runs on one machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from cdcd.tools.local.broker import LocalBroker
from cdcd.tools.local.postgres import LocalPostgres
from cdcd.tools.local.workload import orders_ddl

ORDERS = orders_ddl() + """;
INSERT INTO orders(customer_id, status, amount, note, flags, payload)
SELECT (random() * 100000)::int, 'shipped', round((random() * 10000)::numeric, 2),
       md5(g::text), g %% 2 = 0, jsonb_build_object('sku', g %% 1000, 'qty', g %% 7)
FROM generate_series(1, %s) g;
"""
SLOT = "bench_schema"


def _lsn(pg: LocalPostgres, sql: str) -> int:
    text = str(pg.execute(sql, dbname="bench")[0][0])
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _confirmed(pg: LocalPostgres) -> int:
    rows = pg.execute(
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", (SLOT,), dbname="bench"
    )
    if not rows or rows[0][0] is None:
        return 0
    high, low = str(rows[0][0]).split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Daemon:
    def __init__(self, config: Path, log: Path) -> None:
        self.log_path = log
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "-c", str(config)], stdout=self._log, stderr=self._log
        )

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(120)
        self._log.close()


def _backlog(pg: LocalPostgres, rows: int) -> int:
    for start in range(1, rows + 1, 1_000):
        pg.execute(
            "UPDATE orders SET amount = amount + 1 WHERE id BETWEEN %s AND %s",
            (start, min(start + 999, rows)),
            dbname="bench",
        )
    return _lsn(pg, "SELECT pg_current_wal_lsn()")


def _drain_rate(pg: LocalPostgres, config: Path, log: Path, rows: int) -> float:
    target = _backlog(pg, rows)
    started = time.monotonic()
    daemon = Daemon(config, log)
    try:
        while _confirmed(pg) < target:
            if daemon.process.poll() is not None:
                raise RuntimeError(f"the daemon exited: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        return rows / (time.monotonic() - started)
    finally:
        daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--backlog", type=int, default=300_000)
    args = parser.parse_args()
    pg = LocalPostgres.start()
    broker = LocalBroker.start()
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-schema-"))
    try:
        pg.create_database("bench")
        started = time.monotonic()
        pg.execute(ORDERS, (args.rows,), dbname="bench")
        pg.execute("VACUUM ANALYZE orders", dbname="bench")
        print(f"loaded {args.rows:,} rows into orders in {time.monotonic() - started:.1f} s")
        config = work / "cdcd.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "postgres": {"dsn": pg.dsn("bench"), "slot": SLOT, "tables": ["public.orders"],
                                 "status_interval_s": 1},
                    "kafka": {"bootstrap_servers": broker.bootstrap_servers, "topic_prefix": "bs",
                              "partitions": 6},
                    "snapshot": {"mode": "never"},
                    "schema_changes": {"resnapshot": "auto"},
                    "metrics": {"listen": "127.0.0.1:0"},
                    "heartbeat": {"interval_s": 0},
                }
            )
        )
        log = work / "daemon.log"
        first = Daemon(config, log)  # creates the slot
        while not _confirmed(pg):
            time.sleep(0.1)
        first.stop()

        before = _drain_rate(pg, config, log, args.backlog)
        print(f"before: {args.backlog:,} updated rows drained at {before:,.0f} rows/s")
        pg.execute("ALTER TABLE orders ADD COLUMN region text DEFAULT 'eu'", dbname="bench")
        after = _drain_rate(pg, config, log, args.backlog)
        jobs = pg.execute("SELECT count(*) FROM cdcd_signal WHERE id LIKE 'schema-change:%%'", dbname="bench")
        logged = "add_column_default (region added" in log.read_text()
        print(f"after ADD COLUMN region text DEFAULT 'eu': {after:,.0f} rows/s "
              f"({after / before:.2f} of before); re-snapshots requested: {jobs[0][0]}; logged: {logged}")

        daemon = Daemon(config, log)
        try:
            while _confirmed(pg) < _lsn(pg, "SELECT pg_current_wal_lsn()"):
                time.sleep(0.1)
            base_rss = _rss_kb(daemon.process.pid)
            ddl_at = time.monotonic()
            pg.execute("ALTER TABLE orders ADD COLUMN r float8 DEFAULT random()", dbname="bench")
            rewrite_s = time.monotonic() - ddl_at
            pg.execute("UPDATE orders SET status = 'touched' WHERE id = 1", dbname="bench")
            peak = base_rss
            requested = done = None
            while done is None:
                if daemon.process.poll() is not None:
                    raise RuntimeError(f"the daemon exited: {log.read_text()[-2000:]}")
                peak = max(peak, _rss_kb(daemon.process.pid))
                rows = pg.execute(
                    "SELECT status, created_at, updated_at FROM cdcd_signal "
                    "WHERE id LIKE 'schema-change:%%' ORDER BY created_at DESC LIMIT 1",
                    dbname="bench",
                )
                if rows and requested is None:
                    requested = time.monotonic()
                if rows and rows[0][0] == "done":
                    done = (rows[0][2] - rows[0][1]).total_seconds()
                time.sleep(0.1)
            hwm = _rss_kb(daemon.process.pid, "VmHWM")
        finally:
            daemon.stop()
        print(f"ALTER TABLE … ADD COLUMN r float8 DEFAULT random(): rewrite took {rewrite_s:.1f} s in "
              f"PostgreSQL; re-snapshot of {args.rows:,} rows took {done:.1f} s "
              f"({args.rows / done:,.0f} rows/s); daemon RSS {base_rss / 1024:.0f} MB before, "
              f"peak {peak / 1024:.0f} MB during (VmHWM {hwm / 1024:.0f} MB)")
    finally:
        broker.cleanup()
        pg.cleanup()


if __name__ == "__main__":
    main()
