"""Incremental snapshots end to end: watermark windows under concurrent writes, kill -9, resume.

The daemon streams with ``snapshot.mode: never`` (the table's existing rows
reach Kafka only through the incremental snapshot), a writer updates,
deletes and inserts rows of the table the whole time, and the snapshot is
requested with ``cdcd snapshot --table``. Replaying the topic in
(cdcd.lsn, cdcd.seq) order must give the table exactly: a chunk row published
after a newer change of the same key (the window de-duplication skipped)
would leave a stale or deleted row behind.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import pytest
from support.cdc import PROJECT_ROOT

from cdcd.snapshot.store import DDL

from .helpers import (
    Writer,
    create_orders,
    mirrored,
    table_state,
    topic_changes,
    wait_caught_up,
    wait_streaming,
    when,
)

pytestmark = pytest.mark.integration


def request(config, *tables: str) -> str:
    args = [sys.executable, "-m", "cdcd", "snapshot", "-c", str(config)]
    for table in tables:
        args += ["--table", table]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.stderr
    match = re.search(r"requested incremental snapshot (\S+) of", result.stdout)
    assert match, result.stdout
    return match.group(1)


def scrape(log: str) -> dict[str, float]:
    """The daemon's /metrics (its port is in its first log line), snapshot series only."""
    port = re.search(r"serving /metrics.* listen=[\d.]+:(\d+)", log)
    assert port, log
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("cdcd_snapshot")
    }


def job(pg, job_id: str) -> tuple[str, dict]:
    row = pg.fetchone("SELECT status, progress FROM cdcd_signal WHERE id = %s", (job_id,))
    assert row is not None
    return row[0], row[1]


def test_incremental_snapshot_survives_kill9_and_resumes(pg, broker, cdc_config, daemons) -> None:
    rows = 20_000
    conn = pg.connect()
    create_orders(conn, rows)
    slot = "cdcd_" + pg.dbname[:50]
    # 100 chunks: killed after 20, so most of the job is left for the restart.
    config = cdc_config(tables=["public.orders"], snapshot={"mode": "never", "chunk_rows": 200})
    first = daemons(config)
    wait_streaming(pg, slot, daemon=first)
    writer = Writer(pg, rows, seed=5, pause_s=0.0005).start()
    job_id = request(config, "public.orders")

    def saved_chunks() -> int:
        status, progress = job(pg, job_id)
        assert status in ("pending", "running"), (status, progress)
        current = progress.get("current") or {}
        return int(current.get("chunks") or 0)

    before_kill = when(lambda: (n := saved_chunks()) >= 20 and n, what="20 delivered chunks")
    first.kill9()
    status, progress = job(pg, job_id)
    assert status == "running"
    at_kill = progress["current"]["chunks"]
    assert at_kill >= before_kill

    second = daemons(config)
    when(lambda: job(pg, job_id)[0] == "done", timeout_s=300, what="the snapshot job to finish")
    time.sleep(1.0)
    writer.finish()
    wait_caught_up(pg, slot)
    metrics = scrape(second.log())
    assert second.terminate() == 0, second.log()

    log = second.log()
    resumed = re.search(r"resuming the snapshot of public\.orders after chunk (\d+)", log)
    assert resumed, log
    assert int(resumed.group(1)) == at_kill  # the last chunk saved before the kill
    summary = re.search(r"snapshot of public\.orders read: ([\d,]+) rows in (\d+) chunks "
                        r"\(this run: ([\d,]+) rows, (\d+) chunks\)", log)
    assert summary, log
    total_chunks, run_chunks = int(summary.group(2)), int(summary.group(4))
    assert run_chunks == total_chunks - at_kill and 0 < run_chunks < total_chunks
    status, progress = job(pg, job_id)
    assert status == "done" and progress["done"] == ["public.orders"]
    # The restarted process's metrics count only the chunks it read itself.
    assert metrics['cdcd_snapshot_chunks_total{table="public.orders"}'] == run_chunks
    assert rows * 0.8 < metrics['cdcd_snapshot_rows_estimated{table="public.orders"}'] < rows * 1.2
    assert metrics['cdcd_snapshot_rows_total{table="public.orders"}'] > 0

    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    reads = [c for c in changes if c.value is not None and c.value["op"] == "r"]
    assert reads and all(c.value["source"]["snapshot"] for c in reads)
    assert mirrored(changes) == table_state(conn, "orders")
    print(f"writes={writer.counts} chunks: saved before kill={at_kill}, total={total_chunks}, "
          f"after restart={run_chunks}; r messages={len(reads)}")


def test_signal_row_debezium_style_and_rejected_requests(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    create_orders(conn, 3_000)
    slot = "cdcd_" + pg.dbname[:50]
    # No postgres.tables: a FOR ALL TABLES publication, which includes the signal table.
    daemon = daemons(cdc_config(snapshot={"mode": "never"}))
    wait_streaming(pg, slot, daemon=daemon)
    # Streaming alone creates no signal table: the operator creates it, as
    # with Debezium, and the running daemon finds it.
    pg.execute(DDL.format(table="cdcd_signal"))
    pg.execute(
        "INSERT INTO cdcd_signal (id, type, data) VALUES ('adhoc-1', 'execute-snapshot', "
        "'{\"data-collections\": [\"public.orders\"], \"type\": \"incremental\"}')"
    )
    pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('bad-1', "
               "'{\"data-collections\": [\"public.nope\"]}')")
    pg.execute("INSERT INTO cdcd_signal (id, data) VALUES ('bad-2', '{\"data-collections\": []}')")
    when(lambda: job(pg, "adhoc-1")[0] == "done", what="the requested snapshot")
    when(lambda: job(pg, "bad-1")[0] == "failed", what="the bad request to be rejected")
    when(lambda: job(pg, "bad-2")[0] == "failed", what="the empty request to be rejected")
    assert "does not exist" in job(pg, "bad-1")[1]["error"]
    wait_caught_up(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    changes = topic_changes(broker.bootstrap_servers, pg.dbname)
    assert len([c for c in changes if c.value and c.value["op"] == "r"]) == 3_000
    assert mirrored(changes) == table_state(conn, "orders")
    # The signal table is cdcd's own: never captured, even by FOR ALL TABLES.
    assert not [t for t in broker_topics(broker, pg.dbname) if t.endswith("cdcd_signal")]


def broker_topics(broker, prefix: str) -> list[str]:
    from support.kafka import topic_names

    return sorted(t for t in topic_names(broker.bootstrap_servers) if t.startswith(prefix))


def test_snapshot_command_refuses_tables_it_cannot_snapshot(pg, cdc_config) -> None:
    pg.execute("CREATE TABLE orders(id int PRIMARY KEY); CREATE TABLE other(id int PRIMARY KEY)")
    config = cdc_config(tables=["public.orders"])
    for table, message in (("public.nope", "table public.nope does not exist"),
                           ("public.other", "table public.other is not captured"),
                           ("nodot", "is not schema.table")):
        result = subprocess.run(
            [sys.executable, "-m", "cdcd", "snapshot", "-c", str(config), "--table", table],
            capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT,
        )
        assert result.returncode in (2, 3) and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
