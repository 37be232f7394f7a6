"""An in-memory stand-in for :class:`cdcd.sink.KafkaSink` that injects faults.

Pipeline tests need delivery behaviour a real broker produces only by accident:
the Nth delivery failing, reports withheld until the test says so, reports
arriving out of order across partitions (Kafka orders them only within a
partition), a full local queue, a message refused at ``produce()`` time, a
producer gone fatal. ``FaultSink`` has KafkaSink's interface (``produce``,
``poll``, ``flush``, ``close``, ``len()``, ``delivery_failure``,
``raise_if_fatal``) and calls delivery callbacks only from ``poll``/``flush``/a
blocked ``produce``, on the caller's thread, like confluent-kafka.

Partitions follow the Java client's murmur2 partitioner (``java_partition``),
so tests can assert per-key order exactly as on Kafka. Errors are real
``KafkaError`` instances, so the classification under test is the real one.

Typical use::

    sink = FaultSink(partitions=3)
    sink.fail_nth(5)                     # 5th produced message: _MSG_TIMED_OUT
    sink.delay_deliveries()              # nothing is reported ...
    ...
    sink.release()                       # ... until now
    sink.poll()
    assert [m.value() for m in sink.delivered_to("pg.public.t")] == [...]
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError

from cdcd.errors import CdcdError
from cdcd.sink.producer import ProducerFatalError, classify_delivery_error

__all__ = ["FakeMessage", "FaultSink", "java_murmur2", "java_partition"]

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def java_murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` (Java, signed 32-bit result)."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    end = length & ~3
    for i in range(0, end, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    rest = length & 3
    if rest == 3:
        h ^= data[end + 2] << 16
    if rest >= 2:
        h ^= data[end + 1] << 8
    if rest >= 1:
        h ^= data[end]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: bytes, partitions: int) -> int:
    """The Java default partitioner for a non-null key: ``toPositive(murmur2(key)) % n``."""
    return (java_murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass
class FakeMessage:
    """Looks like ``confluent_kafka.Message`` to delivery callbacks and assertions."""

    _topic: str
    _partition: int
    _key: bytes | None
    _value: bytes | None
    _headers: list[tuple[str, bytes]]
    _callback: Callable[[Any, Any], None] = field(repr=False)
    _offset: int = -1
    _error: KafkaError | None = None
    seq: int = 0
    """1-based produce ordinal in this sink."""

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def error(self) -> KafkaError | None:
        return self._error

    def header(self, name: str) -> bytes | None:
        """The first header called ``name`` (test convenience)."""
        return next((value for key, value in self._headers if key == name), None)


class FaultSink:
    """In-memory sink with KafkaSink's interface and injectable faults (see module docstring).

    ``partitions`` is the partition count of every topic unless ``topic_partitions``
    names it. ``queue_limit`` bounds messages awaiting a report (like
    ``queue.buffering.max.messages``). ``message_max_bytes`` makes ``produce()``
    refuse bigger key+value at once, like librdkafka. ``reorder`` reports
    pending messages partition by partition in a random order (seeded by
    ``seed``), keeping the order within each partition.
    """

    def __init__(
        self,
        *,
        partitions: int = 1,
        topic_partitions: dict[str, int] | None = None,
        queue_limit: int | None = None,
        message_max_bytes: int | None = None,
        reorder: bool = False,
        seed: int = 0,
        create_topics: bool = True,
    ) -> None:
        self.partitions = partitions
        self.topic_partitions = dict(topic_partitions or {})
        self.queue_limit = queue_limit
        self.message_max_bytes = message_max_bytes
        self.reorder = reorder
        self.create_topics = create_topics
        self._rng = random.Random(seed)
        self.produced: list[FakeMessage] = []
        """Every message accepted by ``produce()``, in produce order."""
        self.delivered: list[FakeMessage] = []
        """Messages reported delivered, in report order (with offsets)."""
        self.failed: list[FakeMessage] = []
        """Messages reported failed, in report order."""
        self._pending: deque[FakeMessage] = deque()
        self._offsets: dict[tuple[str, int], int] = {}
        self._fail_at: dict[int, KafkaError] = {}
        self._fail_topics: dict[str, KafkaError] = {}
        self._delayed = False
        self._fatal: KafkaError | None = None
        self._closed = False
        self.on_block: Callable[[FaultSink], None] | None = None
        """Called when ``produce()`` finds the queue full while deliveries are delayed;
        it may call :meth:`release`. Without it, that situation raises (a real
        pipeline would block forever)."""
        self.blocked_s = 0.0
        self.blocked_count = 0
        self.last_error: KafkaError | None = None  # what the fault made the broker say

    # ------------------------------------------------------------ faults

    def fail_nth(self, n: int, code: int = KafkaError._MSG_TIMED_OUT, reason: str = "") -> None:
        """The ``n``-th produced message (1-based, counting from the sink's start) fails."""
        self._fail_at[n] = KafkaError(code, reason) if reason else KafkaError(code)

    def fail_topic(self, topic: str, code: int = KafkaError.TOPIC_AUTHORIZATION_FAILED) -> None:
        """Every report for ``topic`` from now on (including pending ones) fails with ``code``."""
        self._fail_topics[topic] = KafkaError(code)

    def delay_deliveries(self) -> None:
        """Withhold every report until :meth:`release`."""
        self._delayed = True

    def release(self) -> None:
        """Let withheld reports go out on the next ``poll``/``flush``."""
        self._delayed = False

    def make_fatal(self, code: int = KafkaError._FATAL) -> None:
        """The producer becomes fatal: pending messages fail with ``_FATAL``, produce raises."""
        self._fatal = KafkaError(code, "injected fatal error", fatal=True)
        self.last_error = self._fatal
        for message in self._pending:
            self._fail_at[message.seq] = KafkaError(KafkaError._FATAL, fatal=True)

    # ---------------------------------------------------- KafkaSink interface

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[Any, Any], None],
    ) -> None:
        """Accept a message; blocks (serving reports) while the queue is full."""
        if self._closed:
            raise RuntimeError("FaultSink is closed")
        self.raise_if_fatal()
        size = len(key or b"") + len(value or b"")
        if self.message_max_bytes is not None and size > self.message_max_bytes:
            raise classify_delivery_error(
                KafkaError(KafkaError.MSG_SIZE_TOO_LARGE),
                topic,
                create_topics=self.create_topics,
                size=size,
            )
        if self.queue_limit is not None and len(self._pending) >= self.queue_limit:
            self.blocked_count += 1
            self.poll()
            while len(self._pending) >= self.queue_limit:
                if not self._delayed:
                    self.poll()
                    continue
                if self.on_block is None:
                    raise RuntimeError(
                        "FaultSink queue is full while deliveries are delayed: "
                        "a real pipeline would block here forever (set on_block)"
                    )
                self.on_block(self)
                self.poll()
        count = self.topic_partitions.get(topic, self.partitions)
        partition = java_partition(key, count) if key is not None else self._rng.randrange(count)
        message = FakeMessage(
            topic, partition, key, value, list(headers), on_delivery, seq=len(self.produced) + 1
        )
        self.produced.append(message)
        self._pending.append(message)

    def poll(self, timeout: float = 0.0) -> int:
        """Report every pending message unless delayed; returns reports served."""
        if self._delayed or not self._pending:
            self.raise_if_fatal()
            return 0
        batch = list(self._pending)
        self._pending.clear()
        if self.reorder:
            batch = self._reordered(batch)
        for message in batch:
            self._report(message)
        self.raise_if_fatal()
        return len(batch)

    def flush(self, timeout_s: float = 0.0) -> int:
        """Report everything unless delayed; returns messages still unreported (no real waiting)."""
        self.poll()
        return len(self._pending)

    def close(self, timeout_s: float = 0.0) -> int:
        """Flush; withheld reports become ``_PURGE_QUEUE`` failures. Returns those not delivered."""
        if self._closed:
            return 0
        remaining = self.flush(timeout_s)
        if remaining:
            batch = list(self._pending)
            self._pending.clear()
            for message in batch:
                self._fail_at[message.seq] = KafkaError(KafkaError._PURGE_QUEUE)
                self._report(message)
        self._closed = True
        return remaining

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def fatal_error(self) -> KafkaError | None:
        return self._fatal

    def raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise ProducerFatalError(f"injected fatal producer error: {self._fatal.str()}")

    def delivery_failure(self, err: Any, msg: Any) -> BaseException:
        """Same classification as ``KafkaSink.delivery_failure``."""
        if isinstance(err, BaseException):
            return err
        topic = msg.topic() if msg is not None else None
        error: CdcdError = classify_delivery_error(err, topic, create_topics=self.create_topics)
        return error

    # ------------------------------------------------------------ helpers

    def delivered_to(self, topic: str, partition: int | None = None) -> list[FakeMessage]:
        """Delivered messages of one topic (and partition), in offset order per partition."""
        found = [
            m
            for m in self.delivered
            if m.topic() == topic and (partition is None or m.partition() == partition)
        ]
        return sorted(found, key=lambda m: (m.partition(), m.offset()))

    @property
    def pending(self) -> int:
        """Messages produced and not yet reported."""
        return len(self._pending)

    def _reordered(self, batch: list[FakeMessage]) -> list[FakeMessage]:
        """Shuffle across partitions, keeping each partition's order (what Kafka guarantees)."""
        lanes: dict[tuple[str, int], deque[FakeMessage]] = {}
        for message in batch:
            lanes.setdefault((message.topic(), message.partition()), deque()).append(message)
        out: list[FakeMessage] = []
        keys = list(lanes)
        while keys:
            lane_key = self._rng.choice(keys)
            lane = lanes[lane_key]
            out.append(lane.popleft())
            if not lane:
                keys.remove(lane_key)
        return out

    def _report(self, message: FakeMessage) -> None:
        error = self._fail_at.pop(message.seq, None) or self._fail_topics.get(message.topic())
        if error is None:
            lane = (message.topic(), message.partition())
            message._offset = self._offsets.get(lane, 0)
            self._offsets[lane] = message._offset + 1
            self.delivered.append(message)
        else:
            message._error = error
            self.failed.append(message)
        message._callback(error, message)
