"""Equivalence: a seeded random workload, replayed from Kafka, reproduces every table.

Inserts, updates (including primary key changes), deletes, multi-row
transactions, savepoint rollbacks, aborted transactions and a TRUNCATE over
three tables. The daemon runs as its own process and is stopped with SIGTERM
(drain, confirm, exit 0). Then every topic is read with plain fastavro and
replayed in (cdcd.lsn, cdcd.seq) order.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import Any

import pytest
from support.cdc import read_changes, replay, wait_streaming, wait_wal_confirmed
from support.workload import ABORTED, KEYS, UNDONE, Workload, table_rows

pytestmark = pytest.mark.integration


def _normalize(row: dict[str, Any]) -> dict[str, Any]:
    # numeric without typmod travels as its exact text (SPEC §5).
    return {k: Decimal(v) if k == "amount" and isinstance(v, str) else v for k, v in row.items()}


def test_random_workload_replays_to_identical_tables(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    workload = Workload(seed=20261121)
    workload.create(conn)
    config = cdc_config(tables=["public.accounts", "public.items", "public.ledger"])
    daemon = daemons(config)
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot)

    workload.run(conn, transactions=400, truncate_at=150)
    wait_wal_confirmed(conn, slot, timeout_s=90)
    assert daemon.terminate() == 0, daemon.log()

    prefix = pg.dbname
    for table in ("accounts", "items", "ledger"):
        changes = read_changes(broker.bootstrap_servers, prefix, [f"{prefix}.public.{table}"])
        assert changes, f"nothing published for {table}"
        for change in changes:
            if change.value is not None:
                rows = [change.value["before"], change.value["after"]]
                assert not any(r and r.get("note") in (ABORTED, UNDONE) for r in rows)
                assert not any(r and r.get("memo") in (ABORTED, UNDONE) for r in rows)
                assert change.value["source"]["lsn"] == change.lsn
                assert change.value["source"]["seq"] == change.seq
        mirrored = {k: _normalize(v) for k, v in replay(changes, KEYS[table]).items()}
        assert mirrored == {k: _normalize(v) for k, v in table_rows(conn, table).items()}

        # Per key, the topic holds the changes in commit order, once each.
        by_key: dict[Any, list[tuple[int, int]]] = defaultdict(list)
        for change in changes:
            by_key[(change.partition, repr(change.key))].append((change.lsn, change.seq))
        for positions in by_key.values():
            assert positions == sorted(positions)
            assert len(set(positions)) == len(positions)
    assert workload.aborted > 0 and workload.committed > 300
