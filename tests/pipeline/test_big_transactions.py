"""One 1,000,000-row transaction, plain (v1) and streamed (v2, 64kB work mem).

Both must pass through completely with the daemon's peak RSS printed (target
under 300 MB); a streamed transaction that aborts publishes nothing. Slow
(about a minute each): ``pytest -m slow tests/pipeline/test_big_transactions.py -s``.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from support.cdc import DaemonProcess, wait_for, wait_streaming, write_config
from support.pg import current_wal_lsn, slot_confirmed_flush_lsn

from cdcd.tools.local.workload import orders_ddl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS = 1_000_000
INSERT = """INSERT INTO orders(customer_id, status, amount, note, flags, payload)
  SELECT (random()*1e6)::int, 'shipped', round((random()*1e4)::numeric, 2), md5(g::text), g %% 2 = 0,
         jsonb_build_object('k', g, 'v', 'x') FROM generate_series(1, %s) g"""


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _count(bootstrap: str, topic: str, idle_s: float = 10.0) -> int:
    """Count messages in batches without keeping them (a million Message objects cost GBs)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        count, last = 0, time.monotonic()
        while time.monotonic() - last < idle_s:
            batch = consumer.consume(num_messages=10_000, timeout=0.5)
            for message in batch:
                assert message.error() is None, message.error()
            if batch:
                count += len(batch)
                last = time.monotonic()
        return count
    finally:
        consumer.close()


@pytest.mark.parametrize("protocol_version", [1, 2])
def test_million_row_transaction(protocol_version: int, make_pg_cluster, broker, tmp_path: Path) -> None:
    cluster = make_pg_cluster(settings={"logical_decoding_work_mem": "64kB"})
    cluster.create_database("app")
    conn = cluster.connect("app")
    conn.cursor().execute(orders_ddl())
    slot, prefix = f"cdcd_big{protocol_version}", f"big{protocol_version}"
    config = write_config(tmp_path / "c.yaml", cluster.dsn("app"), broker.bootstrap_servers,
                          prefix=prefix, slot=slot, tables=["public.orders"],
                          postgres={"protocol_version": protocol_version, "spill_dir": str(tmp_path)})
    daemon = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        wait_streaming(cluster, slot)
        started = time.monotonic()
        conn.cursor().execute(INSERT, (ROWS,))
        if protocol_version == 2:
            aborted = cluster.connect("app")
            aborted.autocommit = False
            aborted.cursor().execute(INSERT, (200_000,))
            aborted.rollback()
        target = current_wal_lsn(conn)
        wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, timeout_s=900,
                 interval_s=1, what="the million rows to be confirmed")
        elapsed = time.monotonic() - started
        peak = _peak_rss_mb(daemon.pid)
        assert daemon.terminate() == 0, daemon.log()
    finally:
        if daemon.alive():
            daemon.kill9()
    published = _count(broker.bootstrap_servers, f"{prefix}.public.orders")
    assert published == ROWS, "aborted rows were published" if published > ROWS else "rows missing"
    print(f"\nproto v{protocol_version}: {ROWS} rows in one transaction confirmed in {elapsed:.1f} s "
          f"({ROWS / elapsed:,.0f} rows/s incl. insert), daemon peak RSS {peak:.0f} MB")
    assert peak < 300, f"peak RSS {peak:.0f} MB"
