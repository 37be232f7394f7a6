"""Crash safety: kill -9 the daemon at random moments under a continuous workload.

After ten or more SIGKILLs and restarts:

* every committed change is in Kafka at least once (the replayed topics equal
  the tables — a lost transaction would leave a difference);
* nothing from an aborted transaction or a rolled-back savepoint is;
* every duplicate repeats an earlier (cdcd.lsn, cdcd.seq) exactly: same key,
  same envelope except the processing time ``ts_ms``;
* the slot's ``confirmed_flush_lsn``, sampled throughout, never went
  backwards, and every transaction that ended at or before a sampled value
  is in Kafka (confirmation never ran ahead of delivery).
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from decimal import Decimal
from typing import Any

import pytest
from support.cdc import read_changes, replay, wait_for
from support.pg import current_wal_lsn, slot_confirmed_flush_lsn
from support.workload import ABORTED, KEYS, UNDONE, Workload, table_rows

pytestmark = pytest.mark.integration

KILLS = 10


def _normalize(row: dict[str, Any]) -> dict[str, Any]:
    return {k: Decimal(v) if k == "amount" and isinstance(v, str) else v for k, v in row.items()}


def _without_ts(value: dict[str, Any] | None) -> Any:
    if value is None:
        return None
    return {k: v for k, v in value.items() if k != "ts_ms"}


def test_kill9_loop_loses_nothing_and_duplicates_exactly(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    workload = Workload(seed=7)
    workload.create(conn)
    config = cdc_config(tables=["public.accounts", "public.items", "public.ledger"])
    slot = "cdcd_" + pg.dbname[:50]

    stop = threading.Event()
    writer_conn = pg.connect()

    def write() -> None:
        writer_conn.autocommit = False
        while not stop.is_set():
            workload.transaction(writer_conn)
            time.sleep(0.005)
        writer_conn.autocommit = True

    samples: list[tuple[float, int]] = []
    sampler_conn = pg.connect()

    def sample() -> None:
        while not stop.is_set():
            rows = sampler_conn.cursor()
            rows.execute(
                "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots "
                "WHERE slot_name = %s", (slot,)
            )
            found = rows.fetchone()
            if found and found[0] is not None:
                samples.append((time.monotonic(), int(found[0])))
            time.sleep(0.05)

    rng = random.Random(11)
    daemon = daemons(config)
    wait_for(lambda: pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                 (slot,)), what="first daemon streaming")
    writer = threading.Thread(target=write, daemon=True)
    sampler = threading.Thread(target=sample, daemon=True)
    writer.start()
    sampler.start()
    for _ in range(KILLS):
        # Some kills land while the new process still starts (under a second),
        # most while it streams.
        time.sleep(rng.uniform(0.75, 2.5))
        daemon.kill9()
        daemon = daemons(config)
    time.sleep(2)
    stop.set()
    writer.join(30)
    sampler.join(30)
    assert workload.committed > 100 and workload.aborted > 0
    target = current_wal_lsn(conn)
    wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, timeout_s=120,
             what="the last daemon to catch up")
    assert daemon.terminate() == 0, daemon.log()

    confirmed_values = [value for _, value in samples]
    assert confirmed_values == sorted(confirmed_values), "confirmed_flush_lsn went backwards"
    assert len(set(confirmed_values)) > KILLS, "confirmation hardly moved during the run"

    prefix = pg.dbname
    duplicates = 0
    for table in ("accounts", "items", "ledger"):
        changes = read_changes(broker.bootstrap_servers, prefix, [f"{prefix}.public.{table}"])
        first: dict[tuple[int, int], Any] = {}
        for change in changes:
            marker_rows = [change.value["before"], change.value["after"]] if change.value else []
            for row in marker_rows:
                assert not (row and (row.get("note") in (ABORTED, UNDONE)
                                     or row.get("memo") in (ABORTED, UNDONE)))
            position = (change.lsn, change.seq)
            seen = (change.key, _without_ts(change.value))
            if position in first:
                duplicates += 1
                assert first[position] == seen, f"duplicate {position} differs"
            else:
                first[position] = seen
        mirrored = {k: _normalize(v) for k, v in replay(changes, KEYS[table]).items()}
        assert mirrored == {k: _normalize(v) for k, v in table_rows(conn, table).items()}, table

        by_key: dict[Any, list[tuple[int, int]]] = defaultdict(list)
        for change in changes:
            by_key[(change.partition, repr(change.key))].append((change.lsn, change.seq))
        for positions in by_key.values():
            # Restarts replay the unconfirmed tail, so a key's history may repeat
            # an earlier stretch; within each run it is in commit order.
            restarts = sum(1 for a, b in zip(positions, positions[1:], strict=False) if b < a)
            assert restarts <= KILLS
    print(f"kills={KILLS} committed={workload.committed} aborted={workload.aborted} "
          f"duplicates={duplicates} samples={len(samples)} "
          f"confirmed values={len(set(confirmed_values))}")
