"""The Kafka sink: configuration, error classification, topics, and behaviour on a real broker.

Unit tests need nothing; tests marked ``integration`` run against the bundled
tansu broker (``broker`` session fixture, or a private one from
``make_broker`` when the test freezes it).

Where tansu differs from Kafka (noted at each test):

- it enforces no message size limit (neither the topic's ``max.message.bytes``
  nor a broker ``message.max.bytes``): only librdkafka's local check at
  ``produce()`` time can be exercised; the broker-side ``MSG_SIZE_TOO_LARGE``
  delivery report is tested through the classifier;
- it accepts a replication factor larger than its broker count and unknown
  topic configuration keys; cdcd checks the replication factor itself;
- ``describe_configs`` returns only the settings given at creation (Kafka
  returns every setting with its source), and describing a broker returns
  nothing;
- it auto-creates unknown topics on produce.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient
from support.fault_sink import FaultSink, java_murmur2, java_partition
from support.kafka import consume_all

from cdcd.ack import AckTracker
from cdcd.config.model import KafkaConfig
from cdcd.errors import ConfigError, DefiniteError, TransientError
from cdcd.naming import schemas_topic, table_topic
from cdcd.protocol.lsn import Lsn
from cdcd.sink import (
    KafkaSink,
    ProducerFatalError,
    TopicSpec,
    admin_config,
    build_producer_config,
    check_broker,
    classify_delivery_error,
    ensure_topics,
    topic_spec,
)
from cdcd.sink.native import producer_factory
from cdcd.sink.producer import PRODUCER_DEFAULTS, classify_delivery_report
from cdcd.tools.local import LocalBroker
from cdcd.tools.local.postgres import free_port

integration = pytest.mark.integration


def _topic(stem: str) -> str:
    return f"test.{stem}.{uuid.uuid4().hex[:8]}"


def _by_headers(record: tuple[Any, Any, list[tuple[str, bytes]]]) -> list[tuple[str, bytes]]:
    return record[2]


def _headers(lsn: str, seq: int) -> list[tuple[str, bytes]]:
    return [("cdcd.lsn", lsn.encode()), ("cdcd.seq", str(seq).encode())]


# ================================================================ unit tests


def test_producer_config_fixed_defaults_and_overrides() -> None:
    config = build_producer_config(
        "b:9092", {"linger.ms": 50, "compression.type": "zstd", "ssl.ca.location": "/ca"}, "cdcd-x"
    )
    assert config["enable.idempotence"] is True
    assert config["acks"] == "all"
    assert config["partitioner"] == "murmur2_random"
    assert config["max.in.flight.requests.per.connection"] == 5
    assert config["bootstrap.servers"] == "b:9092"
    assert config["client.id"] == "cdcd-x"
    assert config["linger.ms"] == 50  # user wins over defaults
    assert config["compression.type"] == "zstd"
    assert config["ssl.ca.location"] == "/ca"
    assert config["queue.buffering.max.kbytes"] <= 1024 * 1024  # bounded memory
    assert "message.max.bytes" not in config  # left to the user
    for key in PRODUCER_DEFAULTS:
        assert key in config


@pytest.mark.parametrize(
    ("key", "value"),
    [("enable.idempotence", False), ("acks", "1"), ("acks", 1), ("bootstrap.servers", "x:1")],
)
def test_producer_config_rejects_fixed_overrides(key: str, value: str | int | bool) -> None:
    with pytest.raises(ConfigError, match=key):
        build_producer_config("b:9092", {key: value}, "c")


def test_producer_config_accepts_the_fixed_values_themselves() -> None:
    config = build_producer_config("b:9092", {"acks": "-1", "enable.idempotence": "true"}, "c")
    assert config["acks"] == "all" and config["enable.idempotence"] is True


def test_invalid_librdkafka_property_is_a_config_error() -> None:
    config = build_producer_config("127.0.0.1:1", {"no.such.property": 1}, "c")
    with pytest.raises(ConfigError, match="no.such.property"):
        KafkaSink(config)


def test_local_size_rejection_is_definite_and_names_topic() -> None:
    """librdkafka refuses a message above message.max.bytes in produce(), before any broker."""
    config = build_producer_config("127.0.0.1:1", {"message.max.bytes": 10_000}, "c")
    sink = KafkaSink(config)
    try:
        with pytest.raises(DefiniteError) as info:
            sink.produce("pg.public.big", b"k", b"x" * 20_000, [], lambda e, m: None)
        text = str(info.value)
        assert "pg.public.big" in text
        assert "20001 bytes" in text
        assert "message.max.bytes" in text and "max.message.bytes" in text
    finally:
        sink.close(0)


def test_blocked_produce_can_be_stopped() -> None:
    """A full queue with no broker blocks produce(); should_stop ends the wait (shutdown)."""
    config = build_producer_config("127.0.0.1:1", {"queue.buffering.max.messages": 1}, "c")
    checks: list[float] = []

    def should_stop() -> bool:
        checks.append(time.monotonic())
        return len(checks) >= 3

    # One message waits. confluent-kafka's count also takes in the logs and
    # errors of the refused connections not served yet; the compiled producer's is exact.
    exact = producer_factory() is not Producer
    sink = KafkaSink(config, should_stop=should_stop)
    try:
        sink.produce("t", b"k", b"v", [], lambda e, m: None)
        with pytest.raises(TransientError, match="stopped while waiting"):
            sink.produce("t", b"k", b"v", [], lambda e, m: None)
        assert sink.blocked_count == 1 and sink.blocked_s > 0
        assert len(sink) == 1 if exact else len(sink) >= 1
    finally:
        remaining = sink.close(0)
        assert remaining == 1 if exact else remaining >= 1


@pytest.mark.parametrize(
    ("code", "kind", "words"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, DefiniteError, ["message.max.bytes", "max.message.bytes"]),
        (KafkaError.RECORD_LIST_TOO_LARGE, DefiniteError, ["max.message.bytes"]),
        (KafkaError.INVALID_RECORD, DefiniteError, ["compact"]),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, DefiniteError, ["WRITE"]),
        (KafkaError.CLUSTER_AUTHORIZATION_FAILED, DefiniteError, ["IDEMPOTENT_WRITE"]),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, DefiniteError, ["create_topics"]),
        (KafkaError._UNKNOWN_TOPIC, DefiniteError, ["create_topics"]),
        (KafkaError.SASL_AUTHENTICATION_FAILED, DefiniteError, ["sasl"]),
        (KafkaError._AUTHENTICATION, DefiniteError, ["sasl"]),
        (KafkaError._SSL, DefiniteError, ["ssl"]),
        (KafkaError.UNSUPPORTED_COMPRESSION_TYPE, DefiniteError, ["compression.type"]),
        (KafkaError._MSG_TIMED_OUT, TransientError, []),
        (KafkaError._TRANSPORT, TransientError, []),
        (KafkaError._ALL_BROKERS_DOWN, TransientError, []),
        (KafkaError.NOT_ENOUGH_REPLICAS, TransientError, []),
        (KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, TransientError, []),
        (KafkaError.LEADER_NOT_AVAILABLE, TransientError, []),
        (KafkaError.REQUEST_TIMED_OUT, TransientError, []),
        (KafkaError._PURGE_QUEUE, TransientError, []),
        (KafkaError._FATAL, ProducerFatalError, []),
        (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, ProducerFatalError, []),
        (KafkaError.UNKNOWN_PRODUCER_ID, ProducerFatalError, []),
    ],
)
def test_classify_delivery_error(code: int, kind: type[Exception], words: list[str]) -> None:
    error = classify_delivery_error(KafkaError(code), "pg.public.orders")
    assert type(error) is kind
    text = str(error)
    assert "pg.public.orders" in text or code in (
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError._AUTHENTICATION,
    )
    for word in words:
        assert word in text, (word, text)
    if kind is DefiniteError:
        assert isinstance(error, DefiniteError) and error.hint


def test_fatal_flag_makes_any_code_producer_fatal() -> None:
    error = classify_delivery_error(KafkaError(KafkaError._STATE, "x", fatal=True), "t")
    assert isinstance(error, ProducerFatalError)
    assert isinstance(error, TransientError)  # a new producer (restart) may succeed


def test_unknown_topic_is_transient_when_cdcd_creates_topics() -> None:
    error = classify_delivery_error(
        KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART), "t", create_topics=True
    )
    assert type(error) is TransientError


def test_table_topic_names() -> None:
    assert table_topic("pg", "public", "orders") == "pg.public.orders"
    assert table_topic("pg", "Sales", "Order-Items_2") == "pg.Sales.Order-Items_2"
    odd = table_topic("pg", "public", "my table")
    assert odd.startswith("pg.public.my_table_") and len(odd) == len("pg.public.my_table_") + 8
    # '.' inside an identifier cannot make two tables collide
    assert table_topic("pg", "a.b", "c") != table_topic("pg", "a", "b.c")
    assert table_topic("pg", "a b", "c") != table_topic("pg", "a_b", "c")
    assert table_topic("pg", "public", "ünïcode") != table_topic("pg", "public", "_n_code")
    long = table_topic("pg", "s" * 63, "t" * 300)
    assert len(long) <= 249
    assert long != table_topic("pg", "s" * 63, "t" * 299)
    for name in (odd, long, table_topic("pg", "public", "ünïcode")):
        assert all(c.isascii() and (c.isalnum() or c in "._-") for c in name), name


def test_topic_spec_by_what_the_topic_is() -> None:
    kafka = KafkaConfig(
        bootstrap_servers="b:1",
        topic_prefix="app",
        partitions=4,
        replication_factor=3,
        transaction_records=True,
    )
    assert topic_spec(kafka, "app.public.t") == TopicSpec("app.public.t", 4, 3)
    assert topic_spec(kafka, "app._schemas") == TopicSpec(
        "app._schemas", 1, 3, {"cleanup.policy": "compact"}
    )
    # Transaction records and logical messages each carry one global order.
    assert topic_spec(kafka, "app.transaction") == TopicSpec("app.transaction", 1, 3)
    assert topic_spec(kafka, "app.message") == TopicSpec("app.message", 1, 3)
    # Tables named like the auxiliary topics are tables: kafka.partitions.
    for schema, table in [("public", "transaction"), ("public", "message"), ("x", "_schemas")]:
        name = table_topic("app", schema, table)
        assert topic_spec(kafka, name) == TopicSpec(name, 4, 3)


def test_admin_config_keeps_security_drops_producer_tuning() -> None:
    props = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u",
        "sasl.password": "p",
        "ssl.ca.location": "/etc/ssl/certs/ca-certificates.crt",
        "client.id": "me",
        "socket.keepalive.enable": True,
        "linger.ms": 5,
        "compression.type": "lz4",
        "message.max.bytes": 5_000_000,
        "enable.idempotence": True,
    }
    config = admin_config("b:9092", props)
    assert config == {
        "bootstrap.servers": "b:9092",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u",
        "sasl.password": "p",
        "ssl.ca.location": "/etc/ssl/certs/ca-certificates.crt",
        "client.id": "me",
        "socket.keepalive.enable": True,
    }
    AdminClient(config)  # librdkafka accepts every key kept

    with pytest.raises(ConfigError, match="ssl.ca.location"):
        check_broker("127.0.0.1:1", {**props, "ssl.ca.location": "/nonexistent.pem"}, 1)


def test_java_murmur2_matches_kafka_test_vectors() -> None:
    """Vectors from Kafka's UtilsTest.testMurmur2."""
    vectors = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, expected in vectors.items():
        assert java_murmur2(data) == expected, data


# ----------------------------------------------------------- fault sink


def test_fault_sink_with_tracker_reorders_within_partition_order() -> None:
    sink = FaultSink(partitions=4, reorder=True, seed=3)
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    for txn in range(20):
        ticket = tracker.open()
        for seq in range(5):
            ticket.add()
            key = f"k{(txn * 5 + seq) % 13}".encode()
            sink.produce(
                "t", key, f"{txn}:{seq}".encode(), _headers("0/1", seq), ticket.on_delivery
            )
        ticket.seal(Lsn(txn + 1))
    order = [m.seq for m in sink.produced]
    sink.poll()
    assert tracker.confirmed == 20
    reported = [m.seq for m in sink.delivered]
    assert sorted(reported) == order and reported != order  # reordered across partitions
    for partition in range(4):
        lane = [m.seq for m in sink.delivered if m.partition() == partition]
        assert lane == sorted(lane)  # but never within a partition
        for m in sink.delivered_to("t", partition):
            assert m.partition() == java_partition(m.key() or b"", 4)


def test_fault_sink_nth_failure_stops_confirmation_at_previous_transaction() -> None:
    sink = FaultSink()
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    for txn in range(4):
        ticket = tracker.open()
        for _ in range(3):
            ticket.add()
            sink.produce("pg.public.t", b"k", b"v", [], ticket.on_delivery)
        ticket.seal(Lsn(0x10 * (txn + 1)))
    sink.fail_nth(8)  # transaction 3 (messages 7..9)
    sink.poll()
    assert tracker.confirmed == 0x20
    assert isinstance(tracker.failure, TransientError)
    assert "pg.public.t" in str(tracker.failure)
    assert [m.seq for m in sink.failed] == [8]


def test_fault_sink_delay_release_and_blocking_queue() -> None:
    sink = FaultSink(queue_limit=3)
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    sink.delay_deliveries()
    released: list[int] = []

    def on_block(s: FaultSink) -> None:
        released.append(s.pending)
        s.release()

    sink.on_block = on_block
    ticket = tracker.open()
    for _ in range(5):
        ticket.add()
        sink.produce("t", None, b"v", [], ticket.on_delivery)
    ticket.seal(Lsn(9))
    assert released == [3]
    assert sink.flush() == 0
    assert tracker.confirmed == 9


def test_fault_sink_refuses_when_blocked_forever() -> None:
    sink = FaultSink(queue_limit=1)
    sink.delay_deliveries()
    sink.produce("t", None, b"v", [], lambda e, m: None)
    with pytest.raises(RuntimeError, match="block"):
        sink.produce("t", None, b"v", [], lambda e, m: None)


def test_fault_sink_size_fatal_and_close() -> None:
    sink = FaultSink(message_max_bytes=10)
    with pytest.raises(DefiniteError, match="pg.public.big"):
        sink.produce("pg.public.big", b"k", b"x" * 20, [], lambda e, m: None)
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    ticket = tracker.open()
    ticket.add()
    sink.produce("t", b"k", b"v", [], ticket.on_delivery)
    sink.make_fatal()
    with pytest.raises(ProducerFatalError):
        sink.poll()
    assert isinstance(tracker.failure, ProducerFatalError)
    with pytest.raises(ProducerFatalError):
        sink.produce("t", b"k", b"v", [], ticket.on_delivery)

    other = FaultSink()
    purged = AckTracker(Lsn(0), classify=other.delivery_failure)
    t2 = purged.open()
    t2.add()
    other.produce("t", b"k", b"v", [], t2.on_delivery)
    other.delay_deliveries()
    assert other.close() == 1
    assert isinstance(purged.failure, TransientError)


# ========================================================= integration tests


@integration
def test_produce_keys_headers_several_topics_and_consume_back(broker: LocalBroker) -> None:
    topics = [_topic("multi"), _topic("multi"), _topic("multi")]
    ensure_topics(broker.bootstrap_servers, [TopicSpec(t, 3, 1) for t in topics], 10)
    sink = KafkaSink(build_producer_config(broker.bootstrap_servers, {}, "cdcd-test"))
    tracker = AckTracker(Lsn(0x100), classify=sink.delivery_failure)
    expected: dict[str, list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]] = {
        t: [] for t in topics
    }
    end = 0x100
    for txn in range(10):
        ticket = tracker.open()
        lsn = str(Lsn(end + 1))
        for seq in range(7):
            topic = topics[(txn + seq) % 3]
            key = f"id-{txn}-{seq}".encode() if seq != 6 else None
            value = None if seq == 5 else f"value {txn}/{seq}".encode()  # a tombstone
            headers = _headers(lsn, seq)
            ticket.add()
            sink.produce(topic, key, value, headers, ticket.on_delivery)
            expected[topic].append((key, value, headers))
        end += 0x100
        ticket.seal(Lsn(end))
        sink.poll(0)
    assert sink.flush(30) == 0
    assert tracker.failure is None
    assert tracker.confirmed == end
    sink.close(5)

    for topic in topics:
        messages = consume_all(broker.bootstrap_servers, topic, expected=len(expected[topic]))
        got = [(m.key(), m.value(), cast(list[tuple[str, bytes]], m.headers())) for m in messages]
        assert sorted(got, key=_by_headers) == sorted(expected[topic], key=_by_headers)


@integration
def test_a_full_queue_is_sent_at_once_not_after_the_linger(broker: LocalBroker) -> None:
    """With a 15-minute linger and a queue of 10, 200 messages still go through: a full
    queue is flushed (sent whatever linger.ms says), not waited on.

    Polling alone, as before, would wait out the linger once per 10 messages: the wait
    is cut at 120 s here (should_stop), well past the milliseconds the test takes.
    """
    topic = _topic("full-queue")
    ensure_topics(broker.bootstrap_servers, [TopicSpec(topic, 3, 1)], 10)
    props = {"queue.buffering.max.messages": 10, "linger.ms": 900_000, "message.timeout.ms": 1_000_000}
    deadline = time.monotonic() + 120
    sink = KafkaSink(
        build_producer_config(broker.bootstrap_servers, props, "cdcd-test"),
        should_stop=lambda: time.monotonic() > deadline,
    )
    tracker = AckTracker(Lsn(0x100), classify=sink.delivery_failure)
    try:
        for txn in range(20):
            ticket = tracker.open()
            for seq in range(10):
                ticket.add()
                sink.produce(topic, b"k%d" % seq, b"v", _headers(str(Lsn(0x200 + txn)), seq),
                             ticket.on_delivery)  # fmt: skip
            ticket.seal(Lsn(0x200 + txn + 1))
        assert sink.blocked_count >= 1  # the queue was full, and went out
        assert sink.flush(30) == 0
    finally:
        sink.close(5)
    assert tracker.failure is None and tracker.confirmed == 0x200 + 20
    assert len(consume_all(broker.bootstrap_servers, topic, expected=200)) == 200


def test_default_queue_holds_few_enough_messages_to_stay_in_cache() -> None:
    """10,000 unacknowledged messages at most by default: 100,000 cost librdkafka about
    0.7 µs more per message (docs/operations.md, The Kafka producer), in batches small
    enough that one partition still has five requests in flight."""
    config = build_producer_config("b:9092", {}, "c")
    assert config["queue.buffering.max.messages"] == 10_000
    # A partition's queue fills the five requests idempotence allows in flight.
    in_flight = config["max.in.flight.requests.per.connection"] * config["batch.num.messages"]
    assert in_flight <= config["queue.buffering.max.messages"]
    assert build_producer_config(
        "b:9092", {"queue.buffering.max.messages": 200_000}, "c"
    )["queue.buffering.max.messages"] == 200_000


@integration
def test_idempotent_producer_gets_a_producer_id(broker: LocalBroker) -> None:
    topic = _topic("idem")
    ensure_topics(broker.bootstrap_servers, [TopicSpec(topic, 1, 1)], 10)
    stats: list[dict[str, Any]] = []
    config = build_producer_config(broker.bootstrap_servers, {"statistics.interval.ms": 100}, "c")
    assert config["enable.idempotence"] is True and config["acks"] == "all"
    sink = KafkaSink(config, on_stats=stats.append)
    ticket = AckTracker(Lsn(0), classify=classify_delivery_report).open()
    ticket.add()
    sink.produce(topic, b"k", b"v", [], ticket.on_delivery)
    assert sink.flush(10) == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(
        s.get("eos", {}).get("idemp_state") == "Assigned" for s in stats
    ):
        sink.poll(0.1)
    sink.close(5)
    eos = [s["eos"] for s in stats if "eos" in s]
    assert eos and eos[-1]["idemp_state"] == "Assigned"
    assert eos[-1]["producer_id"] >= 0
    json.dumps(stats[-1])  # plain JSON data


@integration
def test_murmur2_random_partitions_agree_with_java(broker: LocalBroker) -> None:
    topic = _topic("murmur")
    partitions = 7
    ensure_topics(broker.bootstrap_servers, [TopicSpec(topic, partitions, 1)], 10)
    sink = KafkaSink(build_producer_config(broker.bootstrap_servers, {}, "c"))
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    keys = [f"{i}".encode() for i in range(150)] + [os.urandom(n) for n in range(1, 51)]
    for key in keys:
        ticket.add()
        sink.produce(topic, key, b"v", [], ticket.on_delivery)
    ticket.seal(Lsn(1))
    assert sink.flush(30) == 0 and tracker.confirmed == 1
    sink.close(5)
    messages = consume_all(broker.bootstrap_servers, topic, expected=len(keys))
    assert len(messages) == len(keys)
    landed = {m.key(): m.partition() for m in messages}
    mismatched = {
        k: (p, java_partition(k, partitions))
        for k, p in landed.items()
        if k is not None and p != java_partition(k, partitions)
    }
    assert not mismatched
    assert len(set(landed.values())) == partitions  # all partitions used


@integration
def test_backpressure_blocks_while_broker_frozen_then_completes(
    make_broker: Callable[..., LocalBroker],
) -> None:
    private = make_broker()
    topic = _topic("backpressure")
    ensure_topics(private.bootstrap_servers, [TopicSpec(topic, 2, 1)], 10)
    config = build_producer_config(
        private.bootstrap_servers,
        {"queue.buffering.max.messages": 5, "linger.ms": 0, "message.timeout.ms": 60_000},
        "c",
    )
    sink = KafkaSink(config)
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    warm = tracker.open()
    warm.add()
    sink.produce(topic, b"warm", b"v", [], warm.on_delivery)  # connection + metadata
    warm.seal(Lsn(1))
    assert sink.flush(10) == 0 and tracker.confirmed == 1

    freeze_s = 3.0
    private.freeze()
    thawer = threading.Timer(freeze_s, private.thaw)
    thawer.start()
    try:
        started = time.monotonic()
        ticket = tracker.open()
        for i in range(40):
            ticket.add()
            sink.produce(topic, f"k{i}".encode(), b"v" * 300, [], ticket.on_delivery)
        produced_after = time.monotonic() - started
        ticket.seal(Lsn(2))
        assert sink.flush(30) == 0
    finally:
        thawer.cancel()
        if private.frozen:
            private.thaw()
    sink.close(5)
    assert produced_after >= freeze_s * 0.8  # produce() waited instead of raising
    assert sink.blocked_count >= 1 and sink.blocked_s >= freeze_s * 0.8
    assert tracker.failure is None
    assert tracker.confirmed == 2
    assert len(consume_all(private.bootstrap_servers, topic, expected=41)) == 41


@integration
def test_timeout_during_outage_is_a_transient_delivery_failure(
    make_broker: Callable[..., LocalBroker],
) -> None:
    private = make_broker()
    topic = _topic("timeout")
    ensure_topics(private.bootstrap_servers, [TopicSpec(topic, 1, 1)], 10)
    sink = KafkaSink(
        build_producer_config(private.bootstrap_servers, {"message.timeout.ms": 1500}, "c")
    )
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    ok = tracker.open()
    ok.add()
    sink.produce(topic, b"a", b"v", [], ok.on_delivery)
    ok.seal(Lsn(0x10))
    assert sink.flush(10) == 0
    private.freeze()
    try:
        late = tracker.open()
        late.add()
        sink.produce(topic, b"b", b"v", [], late.on_delivery)
        late.seal(Lsn(0x20))
        deadline = time.monotonic() + 15
        while tracker.failure is None and time.monotonic() < deadline:
            sink.poll(0.1)
    finally:
        private.thaw()
    sink.close(5)
    assert isinstance(tracker.failure, TransientError)
    assert "_MSG_TIMED_OUT" in str(tracker.failure) and topic in str(tracker.failure)
    assert tracker.confirmed == 0x10


@integration
def test_close_purges_what_cannot_be_delivered(make_broker: Callable[..., LocalBroker]) -> None:
    private = make_broker()
    topic = _topic("purge")
    ensure_topics(private.bootstrap_servers, [TopicSpec(topic, 1, 1)], 10)
    sink = KafkaSink(build_producer_config(private.bootstrap_servers, {}, "c"))
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    ticket = tracker.open()
    ticket.add()
    sink.produce(topic, b"a", b"v", [], ticket.on_delivery)
    assert sink.flush(10) == 0
    private.freeze()
    try:
        ticket.add()
        sink.produce(topic, b"b", b"v", [], ticket.on_delivery)
        ticket.seal(Lsn(0x10))
        assert sink.close(1.0) == 1
    finally:
        private.thaw()
    assert isinstance(tracker.failure, TransientError)
    assert "PURGE" in str(tracker.failure)
    assert tracker.confirmed == 0
    assert sink.close(1.0) == 0  # idempotent


@integration
def test_too_large_message_is_definite_and_names_topic(broker: LocalBroker) -> None:
    """tansu enforces no size limit: only the producer-side check can fire here."""
    topic = _topic("large")
    ensure_topics(broker.bootstrap_servers, [TopicSpec(topic, 1, 1)], 10)
    sink = KafkaSink(build_producer_config(broker.bootstrap_servers, {}, "c"))
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    ticket = tracker.open()
    ticket.add()
    with pytest.raises(DefiniteError) as info:
        sink.produce(topic, b"k", b"x" * 2_000_000, [], ticket.on_delivery)
    assert topic in str(info.value) and "message.max.bytes" in str(info.value)
    ticket.seal(Lsn(0x10))
    assert tracker.confirmed == 0  # the refused message keeps its transaction unconfirmed
    sink.close(5)


@integration
def test_ensure_topics_is_idempotent_and_concurrent_safe(
    broker: LocalBroker, caplog: pytest.LogCaptureFixture
) -> None:
    names = [_topic("create") for _ in range(3)]
    specs = [TopicSpec(n, 2, 1) for n in names]
    results: list[list[str] | BaseException] = []

    def create() -> None:
        try:
            results.append(ensure_topics(broker.bootstrap_servers, specs, 10))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=create) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert len(results) == 3
    created = [n for r in results if isinstance(r, list) for n in r]
    assert sorted(set(created)) == sorted(names) and len(created) == len(names)
    assert ensure_topics(broker.bootstrap_servers, specs, 10) == []

    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    metadata = admin.list_topics(timeout=10)
    assert all(len(metadata.topics[n].partitions) == 2 for n in names)

    with caplog.at_level(logging.WARNING, logger="cdcd.sink.topics"):
        assert ensure_topics(admin, [TopicSpec(names[0], 5, 1)], 10) == []
    assert "has 2 partitions" in caplog.text


@integration
def test_schemas_topic_is_compacted(broker: LocalBroker, caplog: pytest.LogCaptureFixture) -> None:
    """tansu describes only the settings given at creation; Kafka describes every setting."""
    from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]

    prefix = f"t{uuid.uuid4().hex[:8]}"
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers, topic_prefix=prefix)
    specs = [topic_spec(kafka, schemas_topic(prefix)), topic_spec(kafka, f"{prefix}.public.orders")]
    created = ensure_topics(broker.bootstrap_servers, specs, 10)
    assert schemas_topic(prefix) in created
    assert f"{prefix}.public.orders" in created
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    resource = ConfigResource("topic", schemas_topic(prefix))
    entries = admin.describe_configs([resource], request_timeout=10)[resource].result()
    assert entries["cleanup.policy"].value == "compact"

    # An existing topic with a different policy is reported, not changed.
    other = _topic("notcompact")
    ensure_topics(admin, [TopicSpec(other, 1, 1, {"cleanup.policy": "delete"})], 10)
    with caplog.at_level(logging.WARNING, logger="cdcd.sink.topics"):
        ensure_topics(admin, [TopicSpec(other, 1, 1, {"cleanup.policy": "compact"})], 10)
    assert "cleanup.policy=delete" in caplog.text


@integration
def test_replication_factor_above_broker_count_is_definite(broker: LocalBroker) -> None:
    """tansu would accept it; cdcd checks against the brokers in the metadata."""
    with pytest.raises(DefiniteError) as info:
        ensure_topics(broker.bootstrap_servers, [TopicSpec(_topic("rf"), 1, 3)], 10)
    assert "replication factor 3" in str(info.value)
    assert "kafka.replication_factor" in str(info.value)


@integration
def test_check_broker(broker: LocalBroker) -> None:
    description = check_broker(broker.bootstrap_servers, {"linger.ms": 5}, 10)
    assert description.startswith("1 broker (id ")

    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(TransientError) as unreachable:
        check_broker(nobody, {}, 2)
    assert nobody in str(unreachable.value)
    with pytest.raises(TransientError) as topics_unreachable:
        ensure_topics(nobody, [TopicSpec("x", 1, 1)], 2)
    assert nobody in str(topics_unreachable.value)

    # Every broker refusing the connection is reported at once, not after the
    # whole timeout: a wait here would have said "within 600 s", ten minutes on.
    with pytest.raises(TransientError) as refused:
        check_broker(nobody, {}, 600)
    assert "every broker is down" in str(refused.value), refused.value
    assert "Connection refused" in str(refused.value), refused.value

    # tansu refuses SASL, so the admin client sees an authentication failure.
    sasl = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "cdcd",
        "sasl.password": "secret",
    }
    with pytest.raises(DefiniteError) as auth:
        check_broker(broker.bootstrap_servers, sasl, 3)
    assert "authenticate" in str(auth.value)
    assert "secret" not in str(auth.value)
