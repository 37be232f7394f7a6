"""Auxiliary topics: logical decoding messages and transaction boundaries (SPEC §4).

``pg_logical_emit_message`` output lands on ``<prefix>.message`` (transactional
ones only if their transaction commits); with ``kafka.transaction_records``
every transaction gets BEGIN and END records on ``<prefix>.transaction``, END
carrying per-table event counts. cdcd's own heartbeats are never published.
"""

from __future__ import annotations

import pytest
from support.cdc import SchemaBook, wait_streaming, wait_wal_confirmed
from support.kafka import consume_all

pytestmark = pytest.mark.integration


def test_messages_and_transaction_records(pg, broker, cdc_config, daemons) -> None:
    conn = pg.connect()
    conn.cursor().execute("CREATE TABLE a(id int PRIMARY KEY); CREATE TABLE b(id int PRIMARY KEY)")
    daemon = daemons(cdc_config(tables=["public.a", "public.b"],
                                kafka={"transaction_records": True}))
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot)
    cur = conn.cursor()
    cur.execute("BEGIN; INSERT INTO a VALUES (1), (2); INSERT INTO b VALUES (1); "
                "SELECT pg_logical_emit_message(true, 'app.audit', 'in-txn'); COMMIT")
    cur.execute("SELECT pg_logical_emit_message(false, 'app.ping', '\\x00ff'::bytea)")
    cur.execute("BEGIN; SELECT pg_logical_emit_message(true, 'app.audit', 'rolled back'); ROLLBACK")
    cur.execute("INSERT INTO a VALUES (3)")
    wait_wal_confirmed(conn, slot)
    assert daemon.terminate() == 0, daemon.log()

    prefix = pg.dbname
    book = SchemaBook()
    book.load(broker.bootstrap_servers, prefix)
    messages = [book.decode(m.value()) for m in consume_all(broker.bootstrap_servers,
                                                             f"{prefix}.message", idle_s=2)]
    assert [(m["prefix"], m["content"], m["transactional"]) for m in messages] == [
        ("app.audit", b"in-txn", True),
        ("app.ping", b"\x00\xff", False),
    ]
    assert messages[0]["txId"] is not None and messages[1]["txId"] is None

    records = [book.decode(m.value()) for m in consume_all(broker.bootstrap_servers,
                                                            f"{prefix}.transaction", idle_s=2)]
    statuses = [r["status"] for r in records]
    assert statuses == ["BEGIN", "END", "BEGIN", "END"], statuses
    first_end = records[1]
    assert first_end["id"] == records[0]["id"]
    assert first_end["event_count"] == 3
    assert {c["data_collection"]: c["event_count"] for c in first_end["data_collections"]} == {
        "public.a": 2,
        "public.b": 1,
    }
