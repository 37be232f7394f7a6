"""The compiled producer (``cdcd.sink._rdkafka``) behaves as confluent-kafka's ``Producer`` does.

It replaces confluent-kafka's client on the hot path, so each test holds it
to the reference, against the bundled broker: the same messages land in the
same partitions with the same keys, values and headers; every message gets
exactly one report; a run of successes for a ticket arrives as one
``on_delivered(count)``; failed reports, errors, logs and statistics reach
their Python callbacks with confluent-kafka's types; a full queue raises
``BufferError``; no callback reference is leaked. Where tansu differs from
Kafka it does not matter here: nothing below depends on the broker beyond
accepting, partitioning and acknowledging produce requests.

With ``CDCD_PURE_PYTHON=1`` the comparisons skip and
``test_pure_python_is_forced`` checks that the sink builds confluent-kafka's
producer.
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, KafkaError, KafkaException, Message, Producer
from support.kafka import consume_all, create_topic
from support.native import status_when_pure

from cdcd.ack import AckTracker
from cdcd.envelope.rowcode import PackedReads
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.native import native_status
from cdcd.sink import KafkaSink, build_producer_config
from cdcd.sink.native import MODULE, producer_factory
from cdcd.sink.producer import classify_delivery_report
from cdcd.tools.local import LocalBroker
from cdcd.tools.local.postgres import free_port

FACTORY = producer_factory()
compiled = pytest.mark.skipif(
    FACTORY is Producer, reason=f"compiled producer not in use: {native_status()}"
)
integration = pytest.mark.integration


class Recorder:
    """A delivery callback target with ``on_delivered``, as ``TxnTicket`` is."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.reports: list[tuple[KafkaError | None, Message]] = []

    def on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        self.reports.append((err, msg))

    def on_delivered(self, count: int) -> None:
        self.counts.append(count)


def _config(bootstrap: str, **overrides: Any) -> dict[str, Any]:
    return dict(build_producer_config(bootstrap, {}, "cdcd-test-native"), **overrides)


def _until(
    condition: Callable[[], bool], producer: Any, what: str, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        producer.poll(0.1)


LSN_HEADER = ("cdcd.lsn", b"0/16B3748")


def _pack(messages: list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]], seq: int) -> PackedReads:
    """``messages`` (from :func:`_messages`, ``cdcd.seq`` from ``seq`` on) packed as copy_reads packs them."""
    blob = b"".join((key or b"") + value for key, value, _ in messages)
    index = b"".join(
        struct.pack("=ii", -1 if key is None else len(key), len(value)) for key, value, _ in messages
    )
    packed = PackedReads(blob, index, seq, LSN_HEADER, "cdcd.seq")
    assert packed == messages  # the test's own premise
    return packed


def _messages(count: int) -> list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]:
    out = []
    for i in range(count):
        key = None if i % 7 == 0 else b"key-%d" % (i % 300)
        out.append(
            (
                key,
                b"value-%d-" % i + b"x" * (i % 50),
                [LSN_HEADER, ("cdcd.seq", b"%d" % i)],
            )
        )
    return out


@compiled
@integration
def test_same_partitions_keys_values_and_headers_as_confluent_kafka(broker: LocalBroker) -> None:
    messages = _messages(3_000)
    landed: dict[str, list[Message]] = {}
    for name, factory in (("native", FACTORY), ("reference", Producer)):
        topic = f"native-eq-{name}-{uuid.uuid4().hex[:8]}"
        create_topic(broker.bootstrap_servers, topic, partitions=6)
        producer = factory(_config(broker.bootstrap_servers))
        failures: list[KafkaError] = []
        before_ms = time.time_ns() // 1_000_000

        def on_delivery(
            err: KafkaError | None, _msg: Message, failures: list[KafkaError] = failures
        ) -> None:
            if err is not None:
                failures.append(err)

        third = len(messages) // 3
        for key, value, headers in messages[: third if name == "native" else None]:
            producer.produce(topic, value, key, -1, on_delivery, None, 0, headers)
        if name == "native":  # the rest in two batch calls: a list, then packed reads
            assert producer.produce_many(topic, messages[: 2 * third], on_delivery, third) == 2 * third
            packed = _pack(messages[2 * third :], 2 * third)
            assert producer.produce_packed(topic, *packed.packed, on_delivery, 0) == len(packed)
        assert producer.flush(30) == 0
        after_ms = time.time_ns() // 1_000_000
        assert failures == []
        producer.close()
        landed[name] = consume_all(broker.bootstrap_servers, topic, expected=len(messages))
        # Stamped by librdkafka at produce time, whichever call produced them.
        stamps = {m.timestamp() for m in landed[name]}
        assert {kind for kind, _ in stamps} == {TIMESTAMP_CREATE_TIME}
        assert before_ms <= min(ms for _, ms in stamps) <= max(ms for _, ms in stamps) <= after_ms

    def keyed_by_partition(records: list[Message]) -> dict[int, list[tuple[Any, ...]]]:
        out: dict[int, list[tuple[Any, ...]]] = {}
        for m in records:
            if m.key() is not None:
                out.setdefault(m.partition(), []).append((m.key(), m.value(), m.headers()))
        return out

    def unkeyed(records: list[Message]) -> Counter[tuple[Any, ...]]:
        return Counter((m.value(), tuple(m.headers() or ())) for m in records if m.key() is None)

    native, reference = landed["native"], landed["reference"]
    assert len(native) == len(reference) == len(messages)
    # murmur2_random: keyed messages in the same partitions, in produce order;
    # null keys go to random partitions, so only their contents compare.
    assert keyed_by_partition(native) == keyed_by_partition(reference)
    assert unkeyed(native) == unkeyed(reference)
    assert len(keyed_by_partition(native)) == 6


@compiled
@integration
def test_a_ticket_gets_its_reports_as_counts_and_confirms(broker: LocalBroker) -> None:
    topic = f"native-ticket-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, topic, partitions=3)
    producer = FACTORY(_config(broker.bootstrap_servers))
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ends = []
    for txn in range(20):
        ticket = tracker.open()
        on_delivery = ticket.on_delivery
        for key, value, headers in _messages(250):
            ticket.add()
            producer.produce(topic, value, key, -1, on_delivery, None, 0, headers)
        ends.append(Lsn(1000 * (txn + 1)))
        ticket.seal(ends[-1])
    recorder = Recorder()
    for key, value, headers in _messages(500):
        producer.produce(topic, value, key, -1, recorder.on_delivery, None, 0, headers)
    plain: list[tuple[KafkaError | None, Message]] = []
    producer.produce(
        topic, b"plain", b"k", -1, lambda err, msg: plain.append((err, msg)), None, 0, None
    )
    _until(
        lambda: tracker.confirmed == ends[-1] and sum(recorder.counts) == 500 and len(plain) == 1,
        producer,
        "every report",
    )
    assert tracker.failure is None and tracker.in_flight == 0
    # Coalesced: far fewer calls than messages, and none per message.
    assert recorder.reports == []
    assert len(recorder.counts) < 500
    # Anything else gets confluent-kafka's (err, Message) per message.
    err, msg = plain[0]
    assert err is None
    assert (msg.topic(), msg.key(), msg.value(), msg.error()) == (topic, b"k", b"plain", None)
    assert 0 <= msg.partition() < 3 and msg.offset() >= 0
    assert len(producer) == 0
    producer.close()


@compiled
@integration
def test_failed_reports_come_one_by_one_with_the_message(broker: LocalBroker) -> None:
    topic = f"native-purge-{uuid.uuid4().hex[:8]}"
    # A linger this long keeps the messages queued until the purge.
    producer = FACTORY(_config(broker.bootstrap_servers, **{"linger.ms": 200_000}))
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    recorder = Recorder()
    for i in range(5):
        ticket.add()
        producer.produce(
            topic,
            b"v%d" % i,
            b"k%d" % i,
            -1,
            ticket.on_delivery,
            None,
            0,
            [("cdcd.seq", b"%d" % i)],
        )
        producer.produce(topic, b"v%d" % i, b"k%d" % i, -1, recorder.on_delivery)
    ticket.seal(Lsn(100))
    producer.purge(in_queue=True, in_flight=False, blocking=True)
    _until(
        lambda: len(recorder.reports) == 5 and tracker.in_flight == 0,
        producer,
        "the purged reports",
    )
    assert recorder.counts == []
    assert [err.code() for err, _ in recorder.reports] == [KafkaError._PURGE_QUEUE] * 5
    assert sorted((m.topic(), m.key(), m.value()) for _, m in recorder.reports) == [
        (topic, b"k%d" % i, b"v%d" % i) for i in range(5)
    ]
    assert all(
        m.error() is not None and m.error().code() == KafkaError._PURGE_QUEUE
        for _, m in recorder.reports
    )
    assert tracker.failure is not None and tracker.confirmed == Lsn(0)
    producer.close()


@compiled
def test_an_exception_in_a_callback_is_raised_after_every_report_is_served() -> None:
    # Nothing listens on this port: the messages stay queued until purged.
    producer = FACTORY(_config(f"127.0.0.1:{free_port()}"))
    seen: list[bytes] = []

    def failing(err: KafkaError | None, msg: Message) -> None:
        seen.append(msg.value())
        raise ValueError("boom from a callback")

    def fine(err: KafkaError | None, msg: Message) -> None:
        seen.append(msg.value())

    producer.produce("t", b"first", None, -1, failing)
    producer.produce("t", b"second", None, -1, fine)
    producer.purge(in_queue=True, in_flight=True, blocking=True)
    with pytest.raises(ValueError, match="boom from a callback"):
        _until(lambda: len(seen) == 2, producer, "both reports")
    assert sorted(seen) == [b"first", b"second"]
    producer.close()


@compiled
def test_errors_and_logs_reach_their_callbacks_on_poll() -> None:
    errors: list[KafkaError] = []
    lines: list[tuple[int, str]] = []

    class Logger:
        def log(self, level: int, msg: str, *args: object) -> None:
            lines.append((level, msg % args))

    config = _config(f"127.0.0.1:{free_port()}", error_cb=errors.append, logger=Logger())
    producer = FACTORY(config)
    _until(
        lambda: bool(errors) and any(level >= logging.WARNING for level, _ in lines),
        producer,
        "a connection error and its log line",
    )
    assert {e.code() for e in errors} <= {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._RESOLVE,
    }
    assert all(isinstance(e, KafkaError) and not e.fatal() for e in errors)
    # confluent-kafka's format: "FACILITY [client name] text".
    assert any("[cdcd-test-native#producer-" in text for _, text in lines)
    producer.close()


@compiled
@integration
def test_statistics_reach_stats_cb(broker: LocalBroker) -> None:
    stats: list[dict[str, Any]] = []
    producer = FACTORY(
        _config(
            broker.bootstrap_servers,
            stats_cb=lambda text: stats.append(json.loads(text)),
            **{"statistics.interval.ms": 100},
        )
    )
    _until(lambda: bool(stats), producer, "statistics")
    assert stats[0]["type"] == "producer" and stats[0]["client_id"] == "cdcd-test-native"
    producer.close()


@compiled
def test_a_full_queue_raises_buffer_error_and_close_reports_what_was_queued() -> None:
    producer = FACTORY(_config(f"127.0.0.1:{free_port()}", **{"queue.buffering.max.messages": 2}))
    recorder = Recorder()
    producer.produce("t", b"1", b"a", -1, recorder.on_delivery)
    producer.produce("t", b"2", b"b", -1, recorder.on_delivery)
    with pytest.raises(BufferError):
        producer.produce("t", b"3", b"c", -1, recorder.on_delivery)
    producer.close()
    assert sorted(m.value() for _, m in recorder.reports) == [b"1", b"2"]
    assert {err.code() for err, _ in recorder.reports} == {KafkaError._PURGE_QUEUE}
    with pytest.raises(RuntimeError, match="closed"):
        producer.produce("t", b"4")


@compiled
def test_reports_served_from_inside_a_callback_and_after_it_come_once_each() -> None:
    # The array of recorded reports is kept between serves. A callback that
    # polls records into a new one while the outer serve still walks its own:
    # neither may lose, repeat or overwrite a report. 5,000 messages grow the
    # array past its first size; the third wave reuses what was kept.
    producer = FACTORY(_config(f"127.0.0.1:{free_port()}", **{"linger.ms": 200_000}))
    seen: list[bytes] = []

    def nested(err: KafkaError | None, msg: Message) -> None:
        seen.append(msg.value())
        if msg.value() == b"w1-0":
            for i in range(10):
                producer.produce("t", b"w2-%d" % i, None, -1, nested)
            producer.purge(in_queue=True, in_flight=True, blocking=True)
            producer.poll(0)

    def wave(name: bytes, count: int) -> set[bytes]:
        for i in range(count):
            producer.produce("t", b"%s-%d" % (name, i), None, -1, nested)
        producer.purge(in_queue=True, in_flight=True, blocking=True)
        return {b"%s-%d" % (name, i) for i in range(count)}

    expected = wave(b"w1", 5_000) | {b"w2-%d" % i for i in range(10)}
    _until(lambda: len(seen) >= len(expected), producer, "the first two waves")
    expected |= wave(b"w3", 5_000)
    _until(lambda: len(seen) >= len(expected), producer, "the third wave")
    producer.poll(0)
    producer.close()
    assert len(seen) == len(expected) and set(seen) == expected


@compiled
def test_no_reference_to_a_callback_outlives_its_report() -> None:
    producer = FACTORY(_config(f"127.0.0.1:{free_port()}", **{"linger.ms": 200_000}))
    recorder = Recorder()
    bound, function = recorder.on_delivery, lambda err, msg: None
    before = sys.getrefcount(bound), sys.getrefcount(function)
    for i in range(1_000):
        producer.produce("t", b"v", None, -1, bound if i % 2 else function, None, 0, [("h", b"x")])
    assert sys.getrefcount(bound) > before[0]
    producer.purge(in_queue=True, in_flight=True, blocking=True)
    _until(lambda: len(recorder.reports) == 500, producer, "the purged reports")
    producer.close()
    assert (sys.getrefcount(bound), sys.getrefcount(function)) == before


@compiled
def test_a_producer_dropped_without_close_calls_no_callback_and_does_not_crash() -> None:
    # Deallocated (or collected by the cyclic GC, its callbacks' objects half
    # torn down) with messages queued: their purge reports reach no Python
    # code. Serving them there once let a raising callback resurrect the
    # dying producer: a segmentation fault. A process of its own, so a crash
    # fails this test and not the suite.
    code = (
        "from cdcd.sink.native import producer_factory\n"
        "from cdcd.sink.producer import build_producer_config\n"
        "from cdcd.tools.local.postgres import free_port\n"
        "called = []\n"
        "def raising(err, msg):\n"
        "    called.append(err)\n"
        "    raise RuntimeError('a callback that raises')\n"
        "producer = producer_factory()(build_producer_config(f'127.0.0.1:{free_port()}', {}, 'd'))\n"
        "for i in range(10):\n"
        "    producer.produce('t', b'v', b'k', -1, raising)\n"
        "del producer\n"
        "print('called', len(called))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "called 0"


@compiled
def test_configuration_errors_are_confluent_kafkas() -> None:
    with pytest.raises(KafkaException) as caught:
        FACTORY({"bootstrap.servers": "x:1", "no.such.property": "1"})
    assert caught.value.args[0].code() == KafkaError._INVALID_ARG
    assert "no.such.property" in caught.value.args[0].str()
    with pytest.raises(ValueError, match="oauth_cb"):
        FACTORY({"bootstrap.servers": "x:1", "oauth_cb": lambda config: None})
    with pytest.raises(TypeError):
        FACTORY({"bootstrap.servers": "x:1", "linger.ms": [1]})


def test_pure_python_is_forced() -> None:
    load = "from confluent_kafka import Producer\nfrom cdcd.sink.native import producer_factory\nassert producer_factory() is Producer"
    assert "CDCD_PURE_PYTHON" in status_when_pure(load, MODULE)


@compiled
def test_produce_many_stops_where_the_queue_is_full_and_keeps_no_reference() -> None:
    producer = FACTORY(_config(f"127.0.0.1:{free_port()}", **{"queue.buffering.max.messages": 5}))
    recorder = Recorder()
    messages = [(b"k%d" % i, b"v%d" % i, [("cdcd.seq", b"%d" % i)]) for i in range(8)]
    bound = recorder.on_delivery
    before = sys.getrefcount(bound)
    assert producer.produce_many("t", messages, bound, 0) == 5
    assert producer.produce_many("t", messages, bound, 5) == 5  # still full
    assert sys.getrefcount(bound) == before + 5
    with pytest.raises(TypeError):
        producer.produce_many("t", [(b"k", b"v", [("cdcd.seq", 7)])], bound, 0)
    with pytest.raises(ValueError):
        producer.produce_many("t", messages, bound, 9)
    producer.close()
    assert sorted(m.value() for _, m in recorder.reports) == [b"v%d" % i for i in range(5)]
    assert sys.getrefcount(bound) == before


@compiled
def test_produce_packed_stops_where_the_queue_is_full_and_refuses_a_bad_index() -> None:
    producer = FACTORY(_config(f"127.0.0.1:{free_port()}", **{"queue.buffering.max.messages": 5}))
    recorder = Recorder()
    messages = _messages(8)
    blob, index, seq, lsn_name, lsn_value, seq_name = _pack(messages, 0).packed
    bound = recorder.on_delivery
    before = sys.getrefcount(bound)
    assert producer.produce_packed("t", blob, index, seq, lsn_name, lsn_value, seq_name, bound, 0) == 5
    assert producer.produce_packed("t", blob, index, seq, lsn_name, lsn_value, seq_name, bound, 5) == 5
    assert sys.getrefcount(bound) == before + 5
    with pytest.raises(ValueError, match="does not fit"):
        producer.produce_packed("t", blob[:-1], index, seq, lsn_name, lsn_value, seq_name, bound, 5)
    with pytest.raises(ValueError, match="whole"):
        producer.produce_packed("t", blob, index[:-1], seq, lsn_name, lsn_value, seq_name, bound, 5)
    with pytest.raises(ValueError, match="out of range"):
        producer.produce_packed("t", blob, index, seq, lsn_name, lsn_value, seq_name, bound, 9)
    producer.close()
    # The first five, purged by close(): their reports carry key and value.
    reports = sorted(((m.key(), m.value()) for _, m in recorder.reports), key=repr)
    assert reports == sorted(((k, v) for k, v, _ in messages[:5]), key=repr)
    assert sys.getrefcount(bound) == before


@compiled
def test_len_counts_unreported_messages_not_waiting_logs_and_errors() -> None:
    """confluent-kafka's len() is librdkafka's outq_len: messages, and also logs and
    errors not served yet. The compiled producer's counts the messages only."""
    port = free_port()  # nothing listens: every connection attempt logs and errors
    made = []
    for factory in (Producer, FACTORY):
        config = _config(f"127.0.0.1:{port}", error_cb=lambda err: None,
                         logger=logging.getLogger("test-native-len"))
        producer = factory(config)
        producer.produce("t", b"v", b"k")
        made.append(producer)
    reference, native = made
    # The premise: events are waiting (reference counts them), for both producers.
    deadline = time.monotonic() + 30
    while len(reference) <= 1:
        assert time.monotonic() < deadline, "no log or error event came"
        time.sleep(0.05)
    assert len(native) == 1
    assert native.flush(0) == 1
    native.purge()
    assert native.flush(5) == 0 and len(native) == 0  # the purge's report, served
    for producer in made:
        producer.purge()
        producer.flush(5)
    native.close()


@integration
@pytest.mark.parametrize("packed", [False, True], ids=["list", "packed"])
@pytest.mark.parametrize("native", [True, False], ids=["compiled", "confluent"])
def test_produce_list_delivers_every_message_in_order_through_a_full_queue(
    broker: LocalBroker, native: bool, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native and FACTORY is Producer:
        pytest.skip(f"compiled producer not in use: {native_status()}")
    monkeypatch.setattr("cdcd.sink.native._factory", FACTORY if native else Producer)
    topic = f"native-list-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, topic, partitions=3)
    # A queue of 50 for 2,000 messages: produce_list has to wait for space again and again.
    sink = KafkaSink(_config(broker.bootstrap_servers, **{"queue.buffering.max.messages": 50}))
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    ticket = tracker.open()
    messages = _messages(2_000)
    ticket.add(len(messages))
    sink.produce_list(topic, _pack(messages, 0) if packed else messages, ticket.on_delivery)
    ticket.seal(Lsn(10))
    assert sink.flush(30) == 0
    assert tracker.confirmed == Lsn(10) and tracker.failure is None
    sink.close(5)
    landed = consume_all(broker.bootstrap_servers, topic, expected=len(messages))
    assert sorted(m.value() for m in landed) == sorted(value for _, value, _ in messages)
    sent = {value: (key, headers) for key, value, headers in messages}
    assert all((m.key(), m.headers()) == sent[m.value()] for m in landed)
    by_partition: dict[int, list[int]] = {}
    for m in landed:
        by_partition.setdefault(m.partition(), []).append(int(dict(m.headers())["cdcd.seq"]))
    assert all(seqs == sorted(seqs) for seqs in by_partition.values())
