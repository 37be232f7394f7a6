"""``cdcd_events_total`` counts exactly what the publisher produced, per table and op.

The publisher counts rows in plain lists and adds the growth to the
Prometheus counters only on ``flush_metrics()`` (between batches), with a
cache of the previous row's table. These tests drive a ``Publisher`` alone
(a recording producer, no database, no broker) through batches that switch
tables in every pattern and use every op, and check after every flush that
the counters equal what was produced, decoded from the produced bytes as a
consumer would (tombstones are not events).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
from support.cdc import SchemaBook

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import RelationCache, TableVersion
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import EnvelopeEncoder, make_stamp
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.naming import LSN_HEADER
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.publisher import Publisher
from cdcd.protocol import Lsn
from cdcd.protocol.messages import (
    IDENTITY_DEFAULT,
    Column,
    Delete,
    Insert,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from cdcd.sink.producer import classify_delivery_report
from cdcd.snapshot.progress import TableProgress
from cdcd.snapshot.rows import encode_reads
from tests.snapshot.test_copy_reads import copy_line
from tests.support.recording_sink import RecordingSink

INT4, TEXT = 23, 25
OPS = ("c", "u", "d", "r", "t")


class _Rig:
    """A publisher over tables a, b, c (captured) and x (not captured)."""

    def __init__(self, transaction_records: bool = False) -> None:
        self.book = SchemaBook()
        self.producer = RecordingSink()
        self.metrics = Metrics(process_collectors=False)
        self.tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
        wire = SingleObjectFormat(self.book.add)
        self.publisher = Publisher(
            self.producer,
            self.tracker,
            EnvelopeEncoder("pg", "app", wire),
            wire,
            include=lambda schema, table: table != "x",
            ensure_topic=lambda topic: None,
            metrics=self.metrics,
            transaction_records=transaction_records,
        )
        cache = RelationCache(StaticCatalog())
        self.tables: dict[str, TableVersion] = {}
        for relid, name in enumerate(("a", "b", "c", "x"), start=16_400):
            columns = (Column(1, "id", INT4, -1), Column(0, "v", TEXT, -1))
            table, _ = cache.on_relation(
                Relation(None, relid, "public", name, IDENTITY_DEFAULT, columns)
            )
            self.tables[name] = table
            self.publisher.relation_changed(table)
        self.progress = {
            name: TableProgress(f"public.{name}", 0, self.metrics) for name in ("a", "b", "c")
        }
        self.lsn = 0x100_0000
        self._xid = 700

    # -- driving ---------------------------------------------------------------------

    def begin(self) -> None:
        self._xid += 1
        self.lsn += 0x100
        self.publisher.begin_transaction(self._xid, Lsn(self.lsn), 800_000_000_000_000)

    def commit(self) -> None:
        self.publisher.commit_transaction(Lsn(self.lsn + 0x10))

    @staticmethod
    def _row(id_: int) -> TupleData:
        return TupleData(b"tt", (b"%d" % id_, b"v"))

    def insert(self, name: str) -> None:
        table = self.tables[name]
        self.publisher.row(table, Insert(self._xid, table.relation_id, self._row(0)))

    def update(self, name: str) -> None:
        table = self.tables[name]
        self.publisher.row(table, Update(self._xid, table.relation_id, None, None, self._row(1)))

    def update_key(self, name: str) -> None:
        """An update that changes the key: a delete, its tombstone and a create."""
        table = self.tables[name]
        old = TupleData(b"tn", (b"1", None))
        self.publisher.row(table, Update(self._xid, table.relation_id, "K", old, self._row(2)))

    def delete(self, name: str) -> None:
        table = self.tables[name]
        old = TupleData(b"tn", (b"3", None))
        self.publisher.row(table, Delete(self._xid, table.relation_id, "K", old))

    def truncate(self, *names: str) -> None:
        tables = tuple(self.tables[n] for n in names)
        self.publisher.truncate(
            tables, Truncate(self._xid, 0, tuple(t.relation_id for t in tables))
        )

    def snapshot(self, name: str, rows: int) -> None:
        """Initial-snapshot rows in a ticket of their own, counted as the snapshot does."""
        encoder = self.publisher.snapshot_encoder(self.tables[name])
        assert encoder is not None
        stamp = make_stamp(0, Lsn(self.lsn), 0, snapshot=True)
        data = b"".join(copy_line(self._row(i)) for i in range(rows))
        messages = encode_reads(encoder, data, stamp, 0, (LSN_HEADER, stamp.lsn_header))
        self.publisher.snapshot_messages(encoder.topic, messages, Lsn(self.lsn))
        self.progress[name].chunk(rows, rows)

    def snapshot_in_transaction(self, name: str, rows: int) -> None:
        """An incremental snapshot chunk inside the current transaction."""
        encoder = self.publisher.snapshot_encoder(self.tables[name])
        assert encoder is not None
        data = b"".join(copy_line(self._row(i)) for i in range(rows))
        _, sent = self.publisher.snapshot_copy_in_transaction(encoder, data, None)
        self.progress[name].chunk(rows, sent)

    # -- checking --------------------------------------------------------------------

    def produced(self) -> Counter[tuple[str, str]]:
        """Envelopes produced so far by (table, op), decoded as a consumer would."""
        found: Counter[tuple[str, str]] = Counter()
        for topic, _key, value, _headers, _ack in self.producer.sent:
            if not topic.startswith("pg.public.") or value is None:
                continue  # a transaction record, or a tombstone: not an event
            envelope = self.book.record(value)
            source = envelope["source"]
            found[f"{source['schema']}.{source['table']}", envelope["op"]] += 1
        return found

    def check_transaction_records(self) -> int:
        """Each END record counts its transaction's changes per table; returns how many ENDs."""
        ends = 0
        changes: Counter[str] = Counter()
        for topic, _key, value, _headers, _ack in self.producer.sent:
            assert value is not None or topic.startswith("pg.public.")
            if topic == "pg.transaction" and value is not None:
                record = self.book.record(value)
                if record["status"] == "BEGIN":
                    changes = Counter()
                else:
                    collections = {
                        c["data_collection"]: c["event_count"] for c in record["data_collections"]
                    }
                    assert collections == dict(changes), record
                    assert record["event_count"] == changes.total()
                    ends += 1
            elif value is not None:
                envelope = self.book.record(value)
                if envelope["op"] != "r":  # incremental snapshot rows are not the transaction's
                    source = envelope["source"]
                    changes[f"{source['schema']}.{source['table']}"] += 1
        return ends

    def counted(self) -> Counter[tuple[str, str]]:
        """``cdcd_events_total`` by (table, op), as ``/metrics`` would serve it."""
        return Counter(self.metrics.events_by_table_op())

    def flush_and_check(self) -> None:
        self.publisher.flush_metrics()
        produced = self.produced()
        assert self.counted() == produced, (
            f"metrics {sorted(self.counted().items())} != produced {sorted(produced.items())}"
        )


def test_alternating_tables_every_op_counted_exactly() -> None:
    rig = _Rig()
    rig.snapshot("a", 5)
    rig.snapshot("c", 2)
    rig.flush_and_check()

    rig.begin()
    rig.insert("a")
    rig.insert("a")
    rig.flush_and_check()  # a is the cached table at this flush
    rig.insert("a")  # counted through the cache, then the batch switches away
    rig.insert("b")
    rig.flush_and_check()
    rig.update("a")
    rig.delete("c")
    rig.update_key("b")
    rig.commit()
    rig.flush_and_check()

    rig.begin()
    rig.update("b")
    rig.flush_and_check()
    rig.update("b")
    rig.insert("x")  # not captured: produces and counts nothing
    rig.truncate("c", "a")
    rig.delete("a")
    rig.insert("c")
    rig.snapshot_in_transaction("b", 3)
    rig.update("b")
    rig.commit()
    rig.flush_and_check()

    rig.begin()
    rig.delete("b")
    rig.flush_and_check()
    rig.delete("b")
    rig.truncate("b")
    rig.insert("a")
    rig.commit()
    rig.flush_and_check()

    expected = Counter(
        {
            ("public.a", "r"): 5,
            ("public.a", "c"): 4,
            ("public.a", "u"): 1,
            ("public.a", "d"): 1,
            ("public.a", "t"): 1,
            ("public.b", "c"): 2,
            ("public.b", "u"): 3,
            ("public.b", "d"): 3,
            ("public.b", "r"): 3,
            ("public.b", "t"): 1,
            ("public.c", "r"): 2,
            ("public.c", "c"): 1,
            ("public.c", "d"): 1,
            ("public.c", "t"): 1,
        }
    )
    assert rig.counted() == expected
    assert rig.produced() == expected
    rig.producer.deliver()
    assert rig.tracker.confirmed == Lsn(rig.lsn + 0x10)


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_every_table_and_op(seed: int) -> None:
    """Seeded random workloads, flushed at random points (as read batches end)."""
    rng = random.Random(seed)
    rig = _Rig(transaction_records=seed % 2 == 1)
    steps: list[Callable[[str], None]] = [
        rig.insert,
        rig.insert,
        rig.update,
        rig.update_key,
        rig.delete,
        lambda name: rig.truncate(name),
        lambda name: rig.truncate(name, rng.choice("abcx")),
    ]
    in_txn = False
    for _ in range(300):
        if not in_txn:
            if rng.random() < 0.1:
                rig.snapshot(rng.choice("abc"), rng.randint(1, 4))
            rig.begin()
            in_txn = True
        name = rng.choice("aaabbcx")
        if rng.random() < 0.05 and name != "x":
            rig.snapshot_in_transaction(name, rng.randint(1, 3))
        else:
            rng.choice(steps)(name)
        if rng.random() < 0.25:
            rig.commit()
            in_txn = False
        if rng.random() < 0.2:
            rig.flush_and_check()
    if in_txn:
        rig.commit()
    rig.flush_and_check()
    counted = rig.counted()
    assert {op for _, op in counted} == set(OPS), sorted(counted)
    assert not any(table == "public.x" for table, _ in counted)
    if seed % 2:
        # END records count the same changes, per transaction and table.
        assert rig.check_transaction_records() == rig.publisher.transactions


def test_the_publisher_remembers_which_transactions_it_published_before_a_point() -> None:
    rig = _Rig()
    for _ in range(3):
        rig.begin()
        rig.commit()
    point = rig.publisher.begun
    for _ in range(2):
        rig.begin()
        rig.commit()
    assert rig.publisher.published_before(point) == [701, 702, 703]
    assert rig.publisher.published_before(rig.publisher.begun) == [701, 702, 703, 704, 705]
    assert rig.publisher.published_before(0) == []
