"""``cdcd_events_total`` on ``/metrics`` equals what Kafka holds, per table and op.

The metric counts "row changes turned into envelopes" (docs/operations.md):
every ``c``/``u``/``d``/``r``/``t`` envelope on a table topic, and nothing
else -- a delete's tombstone is not an event. A real ``cdcd run`` streams a
mixed workload on three captured tables (and one that is not): an initial
snapshot, inserts, updates, deletes, primary key changes, truncates of one and
of several tables, several tables in one transaction and tables alternating
across transactions. Between phases the test waits until everything written
so far is confirmed, so that the daemon flushed its counts while one table
was the last one used, and the next transaction goes on with that table and
then switches: the shape that lost counts (issue 12). Then it compares the
scrape with every envelope read back from Kafka and with what the workload
itself counted.
"""

from __future__ import annotations

import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cdc import SchemaBook, table_topics, wait_for
from support.kafka import consume_all
from support.pg import current_wal_lsn

from cdcd.tools.local import free_port

pytestmark = pytest.mark.integration

TABLES = ("public.a", "public.b", "public.c")
OPS = ("c", "u", "d", "r", "t")
SNAPSHOT_ROWS = {"public.a": 20, "public.b": 7}

Counts = Counter[tuple[str, str]]


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        body = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def _events(url: str) -> Counts:
    found: Counts = Counter()
    for (name, labels), value in _scrape(url).items():
        if name == "cdcd_events_total" and value:
            label = dict(labels)
            found[label["table"], label["op"]] += int(value)
    return found


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


class Workload:
    """Runs statements and counts the events each must produce, by (table, op)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.expected: Counts = Counter()
        self.transactions = 0

    def txn(self, *steps: Callable[[Any], None]) -> None:
        """One transaction of ``steps`` (each runs statements on the cursor)."""
        with self.conn.cursor() as cur:
            for step in steps:
                step(cur)
        self.conn.commit()
        self.transactions += 1

    def dml(self, table: str, op: str, statement: str) -> Callable[[Any], None]:
        """A step counting one ``op`` event per row the statement touched."""

        def step(cur: Any) -> None:
            cur.execute(statement)
            if table in TABLES:
                self.expected[table, op] += cur.rowcount

        return step

    def key_change(self, table: str, statement: str) -> Callable[[Any], None]:
        """A primary key update: a delete of the old key and a create of the new one."""

        def step(cur: Any) -> None:
            cur.execute(statement)
            assert cur.rowcount > 0
            self.expected[table, "d"] += cur.rowcount
            self.expected[table, "c"] += cur.rowcount

        return step

    def truncate(self, *tables: str) -> Callable[[Any], None]:
        def step(cur: Any) -> None:
            cur.execute(f"TRUNCATE {', '.join(tables)}")
            for table in tables:
                if table in TABLES:
                    self.expected[table, "t"] += 1

        return step


def test_events_total_equals_kafka_per_table_and_op(pg, broker, cdc_config, daemons) -> None:
    pg.execute(
        "CREATE TABLE a(id int PRIMARY KEY, v text);"
        "CREATE TABLE b(id bigserial PRIMARY KEY, n int NOT NULL);"
        "CREATE TABLE c(k text PRIMARY KEY, n int);"
        "CREATE TABLE z(id int PRIMARY KEY);"  # not captured
        "INSERT INTO a SELECT g, 'snap' FROM generate_series(1, 20) g;"
        "INSERT INTO b(n) SELECT g FROM generate_series(1, 7) g;"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    daemon = daemons(
        cdc_config(
            tables=list(TABLES),
            extra={
                "snapshot": {"mode": "initial", "chunk_rows": 6},
                "metrics": {"listen": f"127.0.0.1:{port}"},
                # No heartbeats: they are transactions of their own.
                "heartbeat": {"interval_s": 0},
            },
        )
    )
    wait_for(lambda: _ready(url) or not daemon.alive(), timeout_s=90, what="streaming")
    assert daemon.alive(), daemon.log()
    conn = pg.connect()
    conn.autocommit = False
    work = Workload(conn)
    work.expected.update({(t, "r"): n for t, n in SNAPSHOT_ROWS.items()})
    base_transactions = _scrape(url)[("cdcd_transactions_total", ())]
    probe = pg.connect()

    def fence() -> None:
        """Wait until all written so far is confirmed (and so counted, and flushed)."""
        target = current_wal_lsn(probe)
        wait_for(
            lambda: (
                _scrape(url)[("cdcd_confirmed_lsn_bytes", ())] >= target
                and _scrape(url)[("cdcd_transactions_total", ())]
                >= base_transactions + work.transactions
            ),
            timeout_s=60,
            what=f"confirmation of {work.transactions} transactions",
        )

    d, w = work.dml, work
    # Several tables in one transaction, alternating: A, B, A, C, B.
    w.txn(
        d("public.a", "c", "INSERT INTO a SELECT g, 'x' FROM generate_series(101, 103) g"),
        d("public.b", "c", "INSERT INTO b(n) VALUES (1), (2)"),
        d("public.a", "u", "UPDATE a SET v = 'y' WHERE id IN (1, 2)"),
        d("public.c", "c", "INSERT INTO c VALUES ('k1', 1), ('k2', 2), ('k3', 3)"),
        d("public.b", "d", "DELETE FROM b WHERE id = 1"),
    )
    w.txn(d("public.b", "u", "UPDATE b SET n = n + 1 WHERE id <= 4"))
    fence()  # b was the last table of the last flush
    w.txn(
        d("public.b", "c", "INSERT INTO b(n) VALUES (9)"),
        d("public.z", "c", "INSERT INTO z VALUES (1)"),
        d("public.a", "d", "DELETE FROM a WHERE id = 3"),
    )
    fence()
    # Tables alternating across transactions, one table each.
    for round_ in range(6):
        w.txn(d("public.a", "u", f"UPDATE a SET v = 'r{round_}' WHERE id = {4 + round_}"))
        w.txn(d("public.c", "u", f"UPDATE c SET n = n + {round_} WHERE k = 'k1'"))
        w.txn(d("public.b", "c", f"INSERT INTO b(n) VALUES ({round_})"))
    fence()
    w.txn(
        d("public.b", "d", "DELETE FROM b WHERE id = 2"),
        work.key_change("public.a", "UPDATE a SET id = id + 1000 WHERE id IN (10, 11)"),
        d("public.c", "d", "DELETE FROM c WHERE k = 'k2'"),
    )
    fence()
    # A truncate of one table amid changes of others, then of two at once.
    w.txn(
        d("public.c", "c", "INSERT INTO c VALUES ('k4', 4)"),
        d("public.a", "c", "INSERT INTO a VALUES (200, 'before truncate')"),
        work.truncate("public.b"),
        d("public.b", "c", "INSERT INTO b(n) VALUES (100)"),
        d("public.c", "u", "UPDATE c SET n = 0"),
    )
    fence()
    w.txn(
        d("public.c", "d", "DELETE FROM c WHERE k = 'k4'"),
        work.truncate("public.a", "public.c", "public.z"),
        d("public.a", "c", "INSERT INTO a VALUES (1, 'after truncate')"),
    )
    fence()
    w.txn(
        d("public.a", "u", "UPDATE a SET v = 'last' WHERE id = 1"),
        d("public.b", "u", "UPDATE b SET n = -1"),
    )
    fence()
    assert set(op for _, op in work.expected) == set(OPS)

    # Everything is acknowledged: read every envelope back.
    book = SchemaBook()
    book.load(broker.bootstrap_servers, pg.dbname)
    topics = table_topics(broker.bootstrap_servers, pg.dbname)
    assert sorted(topics) == sorted(f"{pg.dbname}.{t}" for t in TABLES)
    in_kafka: Counts = Counter()
    tombstones: Counter[str] = Counter()
    for message in consume_all(broker.bootstrap_servers, topics, timeout_s=60, idle_s=3):
        envelope = book.decode(message.value())
        table = message.topic().removeprefix(pg.dbname + ".")
        if envelope is None:
            tombstones[table] += 1  # compaction marker, not an event
            continue
        source = envelope["source"]
        assert f"{source['schema']}.{source['table']}" == table
        in_kafka[table, envelope["op"]] += 1

    metrics = _events(url)
    assert in_kafka == work.expected, (sorted(in_kafka.items()), sorted(work.expected.items()))
    assert metrics == in_kafka, (
        f"/metrics {sorted(metrics.items())} != Kafka {sorted(in_kafka.items())}"
    )
    # Each delete (all tables have a key) is followed by one tombstone.
    assert tombstones == Counter({t: n for (t, op), n in in_kafka.items() if op == "d"})
    # Every series of a seen table exists, at 0 if nothing happened.
    scrape = _scrape(url)
    for table in TABLES:
        for op in OPS:
            labels = tuple(sorted({"table": table, "op": op}.items()))
            assert ("cdcd_events_total", labels) in scrape, (table, op)
    assert daemon.terminate() == 0, daemon.log()
