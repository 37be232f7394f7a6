"""Two-phase commit (protocol v3): published at COMMIT PREPARED, never at PREPARE.

While a transaction is prepared, the slot's confirmed position must stay at
or before its PREPARE: PostgreSQL skips a PREPARE that lies before the
confirmed position on reconnect, and a later COMMIT PREPARED would then
arrive without its data.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from support.cdc import read_changes, wait_for, wait_streaming, wait_wal_confirmed
from support.kafka import consume_all
from support.pg import current_wal_lsn, slot_confirmed_flush_lsn

pytestmark = pytest.mark.integration


def _status_after(pg: Any, slot: str, since: datetime) -> bool:
    """Whether the walsender of ``slot`` got a standby status update after ``since``."""
    rows = pg.fetchall(
        "SELECT r.reply_time > %s FROM pg_stat_replication r JOIN pg_replication_slots s "
        "ON s.active_pid = r.pid WHERE s.slot_name = %s", (since, slot))
    return bool(rows and rows[0][0])


def test_prepared_transactions_publish_once_at_commit_prepared(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    conn.cursor().execute("CREATE TABLE t(id int PRIMARY KEY, v text)")
    daemon = daemons(cdc_config(tables=["public.t"], postgres={"protocol_version": 3}))
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot, daemon)
    assert pg.fetchall("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND two_phase",
                       (slot,)), "the slot is not a two-phase slot"
    topic = f"{pg.dbname}.public.t"

    cur = pg.connect().cursor()  # autocommit: BEGIN/PREPARE are sent as plain statements
    cur.execute("BEGIN; INSERT INTO t VALUES (1, 'prepared-then-committed'); PREPARE TRANSACTION 'g1'")
    prepared_at = current_wal_lsn(conn)
    conn.cursor().execute("INSERT INTO t VALUES (100, 'later plain transaction')")
    later_end = current_wal_lsn(conn)
    consume_all(broker.bootstrap_servers, topic, expected=1)  # the later transaction is in Kafka
    # ... and the daemon has since sent two status updates (the second one
    # after the first), so it has had every chance to confirm the later
    # transaction: confirmation must still be held before g1's PREPARE.
    for _ in range(2):
        since = pg.fetchone("SELECT clock_timestamp()")[0]
        wait_for(lambda since=since: _status_after(pg, slot, since),
                 what="a status update from the daemon")
    assert prepared_at < later_end
    assert slot_confirmed_flush_lsn(conn, slot) <= prepared_at
    published = read_changes(broker.bootstrap_servers, pg.dbname, [topic])
    assert [c.value["after"]["id"] for c in published if c.value] == [100]

    cur.execute("COMMIT PREPARED 'g1'")
    cur.execute("BEGIN; INSERT INTO t VALUES (2, 'prepared-then-rolled-back'); PREPARE TRANSACTION 'g2'")
    cur.execute("ROLLBACK PREPARED 'g2'")
    conn.cursor().execute("INSERT INTO t VALUES (3, 'after')")
    wait_wal_confirmed(conn, slot)
    assert daemon.terminate() == 0, daemon.log()

    changes = read_changes(broker.bootstrap_servers, pg.dbname, [topic])
    ids = [c.value["after"]["id"] for c in sorted(changes, key=lambda c: (c.lsn, c.seq)) if c.value]
    assert ids == [100, 1, 3]  # once each, in commit order; g2 never
