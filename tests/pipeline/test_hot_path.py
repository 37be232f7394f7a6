"""The per-row shortcuts of the streaming hot path (issue 18) change nothing observable.

* Inserts go to the library's own ``produce`` (``KafkaSink.produce_direct``)
  with the same topic, key, value, headers and callback as through
  ``KafkaSink.produce``; whatever that call raises goes to ``produce()``,
  which blocks or raises the classified error, and the message is counted
  once.
* The session observes commit-to-ack latency per batch of delivered
  transactions (``Metrics.delivered_many``): the histogram equals one
  ``delivered()`` per transaction.
* The assembler looks a row's table up in the relation cache's dict; a row
  of an unknown relation is still the protocol error it was.

No database, no broker: the publisher and assembler are driven with the SPEC
§9 ``orders`` messages captured from PostgreSQL 15.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import EnvelopeEncoder, TxnStamp, make_stamp
from cdcd.errors import DefiniteError
from cdcd.observability.metrics import Metrics
from cdcd.pipeline import publisher as publisher_module
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.transactions import TransactionAssembler
from cdcd.protocol import Lsn, PgOutputDecoder
from cdcd.sink.producer import KafkaSink, build_producer_config, classify_delivery_report
from cdcd.sink.reporter import KafkaLogReporter
from tests.bench.orders_golden import orders_payloads
from tests.support.recording_sink import RecordingSink, Sent

TOPIC = "app.public.orders"


class _Wire:
    def header(self, topic: str, role: str, schema: dict[str, object]) -> bytes:
        return b"\xc3\x01" + b"\x00" * 8


def _insert(note: bytes) -> bytes:
    """An ``orders`` Insert whose ``note`` column is ``note``."""
    values = [
        b"1",
        b"1001",
        b"shipped",
        b"137.31",
        b"2026-11-21 19:41:31.914695+00",
        note,
        b"f",
        b"{}",
    ]
    data = b"".join(b"t" + struct.pack("!I", len(v)) + v for v in values)
    return b"I" + struct.pack("!I", 16498) + b"N" + struct.pack("!H", len(values)) + data


def _transaction(rows: int, xid: int = 7, inserts: list[bytes] | None = None) -> list[bytes]:
    inserts = inserts or orders_payloads()[1]
    commit_lsn = 0x1_0000_0000
    return [
        b"B" + struct.pack("!QqI", commit_lsn, 800_000_000_000_000, xid),
        *(inserts[i % len(inserts)] for i in range(rows)),
        b"C" + struct.pack("!BQQq", 0, commit_lsn, commit_lsn + 48, 800_000_000_000_000),
    ]


def _publish(sink: Any, payloads: list[bytes], relations: bool = True) -> AckTracker:
    """``payloads`` through decoder, assembler and publisher into ``sink``; first the
    Relation messages of ``orders`` unless not ``relations``."""
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    publisher = Publisher(
        sink,
        tracker,
        EnvelopeEncoder("app", "app", _Wire()),
        _Wire(),  # type: ignore[arg-type]
        include=lambda s, t: True,
        ensure_topic=lambda topic: None,
    )
    assembler = TransactionAssembler(
        RelationCache(StaticCatalog(), key_lookup=lambda s, t: ("id",)), publisher
    )
    decoder = PgOutputDecoder(1)
    for payload in (orders_payloads()[0] if relations else []) + payloads:
        assembler.feed(decoder.decode(payload), payload)
    return tracker


def _same_callbacks(a: list[Sent], b: list[Sent]) -> bool:
    return all(x[4].__self__.seq == y[4].__self__.seq for x, y in zip(a, b, strict=True))  # type: ignore[attr-defined]


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Envelopes of different runs compare equal: the processing time is fixed."""

    def stamp(xid: int, lsn: Lsn, commit_ts_ms: int, snapshot: bool = False) -> TxnStamp:
        return make_stamp(xid, lsn, commit_ts_ms, snapshot, 1_700_000_000_000)

    monkeypatch.setattr(publisher_module, "make_stamp", stamp)


@pytest.mark.usefixtures("fixed_clock")
def test_inserts_take_the_direct_produce_with_the_same_message() -> None:
    plain, direct = RecordingSink(direct=False), RecordingSink(direct=True)
    _publish(plain, _transaction(5))
    _publish(direct, _transaction(5))
    assert direct.sent == [] and len(direct.direct) == 5
    assert [m[:4] for m in direct.direct] == [m[:4] for m in plain.sent]
    assert [m[3][1] for m in direct.direct] == [("cdcd.seq", b"%d" % i) for i in range(5)]
    assert {m[0] for m in direct.direct} == {TOPIC}
    assert _same_callbacks(direct.direct, plain.sent)


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize("error", [BufferError("queue full"), KafkaException(KafkaError(-184))])
def test_what_the_direct_produce_raises_goes_to_produce_once(error: BaseException) -> None:
    plain, failing = RecordingSink(direct=False), RecordingSink(direct=True, raises=error)
    _publish(plain, _transaction(3))
    tracker = _publish(failing, _transaction(3))
    assert failing.direct == []
    assert [m[:4] for m in failing.sent] == [m[:4] for m in plain.sent]
    # Each message counted once on its ticket, whichever call took it.
    assert tracker.in_flight == 3
    for message in failing.sent:
        message[4](None, None)
    assert tracker.confirmed == Lsn(0x1_0000_0000 + 48)


def test_a_message_kafka_refuses_still_stops_the_transaction_with_its_lsn() -> None:
    """librdkafka refuses an oversized message in ``produce()`` itself, no broker needed."""
    config = build_producer_config("127.0.0.1:1", {"message.max.bytes": 1_000}, "c")
    sink = KafkaSink(config, reporter=KafkaLogReporter())
    assert sink.produce_direct is not None
    try:
        with pytest.raises(DefiniteError) as info:
            _publish(sink, _transaction(1, inserts=[_insert(b"x" * 2_000)]))
        text = str(info.value)
        assert TOPIC in text and "too large" in text
        assert "transaction committed at LSN 1/00000000, xid 7" in text
    finally:
        sink.close(0)


def test_no_direct_produce_while_an_outage_is_known() -> None:
    reporter = KafkaLogReporter()
    sink = KafkaSink(build_producer_config("127.0.0.1:1", {}, "c"), reporter=reporter)
    try:
        assert sink.produce_direct is not None
        reporter.report(40, "all brokers down", outage=True)
        assert sink.produce_direct is None
    finally:
        sink.close(0)


def test_latency_observed_in_batches_equals_one_observation_each() -> None:
    one, batched = Metrics(process_collectors=False), Metrics(process_collectors=False)
    now = 1_700_000_000.0
    # Negative (clock skew), on a bucket bound, between bounds, beyond the last.
    commits = [now * 1000 + 5, now * 1000, now * 1000 - 5, now * 1000 - 10, now * 1000 - 7_000]
    commits += [now * 1000 - 1e9]
    commits_ms = [int(c) for c in commits]
    for ms in commits_ms:
        one.delivered(ms / 1000.0, now)
    batched.delivered_many(commits_ms[:2], now)
    batched.delivered_many(commits_ms[2:], now)

    def samples(metrics: Metrics) -> dict[str, float]:
        return {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for family in metrics.registry.collect()
            if family.name == "cdcd_delivery_latency_seconds"
            for s in family.samples
        }

    expected = samples(one)
    assert expected and samples(batched) == pytest.approx(expected)


def test_a_row_of_an_unknown_relation_is_still_refused() -> None:
    sink = RecordingSink(direct=True)
    with pytest.raises(DefiniteError, match="arrived before its Relation message"):
        _publish(sink, _transaction(1), relations=False)
