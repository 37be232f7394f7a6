"""Kafka helpers for tests against the local tansu broker.

Consumers here use ``assign()`` rather than group subscription (a group's
first assignment takes seconds on tansu) and never take the broker's high
watermark as the end: tansu reports the last batch's base offset + 1, so "read
up to the high watermark" would stop after the first record of the last batch.
They read until that record *and the rest of its batch* (see ``_last_offset``),
until the expected count, or, where no end can be told, until no message has
arrived for a while.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

__all__ = ["consume_all", "create_topic", "produce", "topic_names"]

_RETRIABLE_CODES = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
}


def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    exist_ok: bool = False,
    timeout_s: float = 10.0,
) -> None:
    """Create a topic (replication factor 1) and wait until the broker confirms."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [
            NewTopic(
                name, num_partitions=partitions, replication_factor=1, config=dict(config or {})
            )
        ],
        operation_timeout=timeout_s,
        request_timeout=timeout_s,
    )
    for future in futures.values():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if exist_ok and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            raise


def topic_names(bootstrap: str, timeout_s: float = 10.0) -> set[str]:
    """Names of the broker's topics."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return set(admin.list_topics(timeout=timeout_s).topics)


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None]],
    headers: list[tuple[str, str | bytes | None]] | None = None,
    **config: Any,
) -> None:
    """Produce ``(key, value)`` records and wait for every delivery (raises on failure)."""
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", **config})
    for key, value in records:
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=on_delivery)
        producer.poll(0)
    remaining = producer.flush(30)
    if remaining:
        raise TimeoutError(f"{remaining} messages to {topic!r} not delivered within 30 s")
    if errors:
        raise KafkaException(errors[0])


def consume_all(
    bootstrap: str,
    topics: str | Iterable[str],
    timeout_s: float = 30.0,
    expected: int | None = None,
    idle_s: float = 1.0,
    **config: Any,
) -> list[Message]:
    """Read every partition of ``topics`` from the beginning with a fresh consumer.

    Without ``expected``: returns once every partition has been read to its
    end (see :func:`_last_offset`; the ends are asked again when reached, so a
    producer still writing is followed), or, when no end can be told (a topic
    that does not exist yet, a last record that is never delivered such as a
    transaction marker), once no message arrived for ``idle_s`` seconds; and
    at ``timeout_s`` at the latest. So a caller that reads what was
    acknowledged before the call gets all of it without waiting; one that
    reads while a pipeline still works toward its topics gets what is there.
    With ``expected``: returns as soon as that many messages arrived, or at
    ``timeout_s`` with what there is, so a slow pipeline does not look idle;
    the caller's assertion says what was missing.

    Topics that do not exist yet are looked up again until they appear.
    Messages come in arrival order (ordered per partition). ``config`` adds
    or overrides consumer properties; the default isolation level is
    ``read_uncommitted``.
    """
    wanted = [topics] if isinstance(topics, str) else list(topics)
    settings = {
        "bootstrap.servers": bootstrap,
        "group.id": f"cdcd-test-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_uncommitted",
        "allow.auto.create.topics": False,
        # tansu holds a fetch for the whole wait even when some of its
        # partitions have data: keep that short.
        "fetch.wait.max.ms": 50,
        **config,
    }
    consumer = Consumer(settings)
    # Asks for the ends on its own connection: on the reading consumer's, the
    # request would queue behind a fetch waiting for data (fetch.wait.max.ms).
    probe = Consumer(settings)
    messages: list[Message] = []
    assigned: set[str] = set()
    # Per assigned partition: the offset whose arrival means "read to the end"
    # (None: unknown), and the highest offset read so far.
    ends: dict[tuple[str, int], int | None] = {}
    read: dict[tuple[str, int], int] = {}

    def at_end() -> bool:
        return len(assigned) == len(set(wanted)) and all(
            end is not None and read.get(tp, -1) >= end for tp, end in ends.items()
        )

    def take(msg: Message) -> bool:
        """Keep a message; False for a retriable error event."""
        err = msg.error()
        if err is not None:
            if err.code() in _RETRIABLE_CODES or err.retriable():
                return False
            raise KafkaException(err)
        messages.append(msg)
        tp = (msg.topic(), msg.partition())
        read[tp] = max(read.get(tp, -1), msg.offset())
        return True

    try:
        start = time.monotonic()
        deadline = start + timeout_s
        last_activity = start
        next_lookup = start
        while True:
            now = time.monotonic()
            if len(assigned) < len(set(wanted)) and now >= next_lookup:
                added = _assign_new(consumer, wanted, assigned)
                for tp in added:
                    ends[tp] = _last_offset(probe, *tp)
                if added:
                    last_activity = now
                next_lookup = now + 0.25
            if expected is not None and len(messages) >= expected:
                break
            if expected is None and at_end():
                # The last batch read is queued whole (librdkafka enqueues a
                # fetched batch at once): take it, then see whether the ends
                # moved while we read.
                while (msg := consumer.poll(0)) is not None:
                    take(msg)
                for tp in ends:
                    ends[tp] = _last_offset(probe, *tp)
                if at_end():
                    break
            if now >= deadline:
                break
            if expected is None and now - last_activity >= idle_s:
                break
            msg = consumer.poll(0.1)
            if msg is not None and take(msg):
                last_activity = time.monotonic()
    finally:
        consumer.close()
        probe.close()
    return messages


def _last_offset(consumer: Consumer, topic: str, partition: int) -> int | None:
    """The offset that, once read, means ``partition`` was read to its end.

    Kafka's high watermark is the last offset + 1. tansu reports the last
    *batch's* base offset + 1 instead (INFRA.md), so ``high - 1`` is the first
    record of the last batch there; the rest of that batch comes in the same
    fetch response, which librdkafka queues at once. -1 for an empty
    partition; None when the broker did not say.
    """
    try:
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=5, cached=False
        )
    except KafkaException:
        return None
    return int(high) - 1 if high > low else -1


def _assign_new(
    consumer: Consumer, wanted: list[str], assigned: set[str]
) -> list[tuple[str, int]]:
    """Assign, from the beginning, every partition of topics that now exist; return them."""
    new: list[TopicPartition] = []
    for topic in wanted:
        if topic in assigned:
            continue
        metadata = consumer.list_topics(topic, timeout=5)
        info = metadata.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            continue
        assigned.add(topic)
        new.extend(TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(info.partitions))
    if new:
        consumer.incremental_assign(new)
    return [(tp.topic, tp.partition) for tp in new]
