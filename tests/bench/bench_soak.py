"""Soak: ``cdcd run`` under a steady 10,000 rows/s for a fixed time; RSS over time.

Checks the "no growth" part of issue 8: pgbench offers the SPEC §9 row shape
at a fixed rate (1,000 transactions of 10 rows per second) against a
throwaway PostgreSQL and the bundled broker while the daemon runs as its own
process; its RSS is sampled every ``--every`` seconds and printed with the
slot lag, then the first and last minutes are compared.

    .venv/bin/python -m tests.bench.bench_soak --seconds 600
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from cdcd.tools.local import LocalBroker, LocalPostgres
from cdcd.tools.local.workload import orders_ddl

SCRIPT = """\\set first random(1, 1000000000)
BEGIN;
INSERT INTO orders(customer_id, status, amount, note, flags, payload)
SELECT (random() * 1000000)::int, 'shipped', round((random() * 10000)::numeric, 2), md5(g::text),
       g % 2 = 0, jsonb_build_object('sku', 'SKU-' || g, 'qty', g % 7)
FROM generate_series(:first, :first + 9) g;
COMMIT;
"""


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--rows-per-s", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=30)
    args = parser.parse_args()
    with LocalPostgres.start() as pg, LocalBroker.start() as broker, tempfile.TemporaryDirectory() as tmp:
        pg.create_database("soak")
        pg.execute(orders_ddl(), dbname="soak")
        config = Path(tmp) / "cdcd.yaml"
        config.write_text(yaml.safe_dump({
            "postgres": {"dsn": pg.dsn("soak"), "tables": ["public.orders"]},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers, "topic_prefix": "soak"},
            "snapshot": {"mode": "never"},
            "metrics": {"listen": "127.0.0.1:0"},
        }))
        script = Path(tmp) / "ten_rows.sql"
        script.write_text(SCRIPT)
        log = open(Path(tmp) / "daemon.log", "wb")
        daemon = subprocess.Popen([sys.executable, "-m", "cdcd", "run", "-c", str(config)],
                                  stdout=log, stderr=log)
        time.sleep(3)
        load = subprocess.Popen(
            [str(pg.bindir / "pgbench"), "-n", "-f", str(script), "-R", str(args.rows_per_s // 10),
             "-T", str(args.seconds), "-c", "4", "-j", "2", pg.dsn("soak")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        samples = []
        started = time.monotonic()
        try:
            while load.poll() is None:
                time.sleep(args.every)
                lag = pg.execute("SELECT pg_current_wal_lsn() - confirmed_flush_lsn FROM "
                                 "pg_replication_slots WHERE slot_name = 'cdcd'", dbname="soak")
                elapsed = time.monotonic() - started
                rss = _rss_mb(daemon.pid)
                samples.append((elapsed, rss))
                print(f"t={elapsed:5.0f}s rss={rss:6.1f} MB slot_lag={int(lag[0][0]) if lag else -1} B",
                      flush=True)
        finally:
            daemon.terminate()
            daemon.wait(60)
            log.close()
        rows = pg.execute("SELECT count(*) FROM orders", dbname="soak")[0][0]
        first = [rss for t, rss in samples if t <= 90]
        last = [rss for t, rss in samples if t >= samples[-1][0] - 90]
        print(f"rows written {rows:,}; RSS first 90 s avg {sum(first) / len(first):.1f} MB, "
              f"last 90 s avg {sum(last) / len(last):.1f} MB, max {max(r for _, r in samples):.1f} MB")


if __name__ == "__main__":
    main()
