"""``cdcd-kafka``: a Spark 4 Python data source reading Kafka through confluent-kafka.

Why it exists
-------------
Spark's own Kafka source (``format("kafka")``) needs the
``spark-sql-kafka-0-10`` jars, which are not part of a pyspark installation
and cannot always be fetched (air-gapped hosts, no Maven access). This source
gives the same rows -- the columns of Spark's Kafka source with
``includeHeaders=true`` -- from a pure-Python client, so the rest of
:mod:`cdcd.spark` works the same on either. :mod:`cdcd.spark.reader` picks
the JVM source when it is present.

Rows: ``key`` binary, ``value`` binary, ``topic`` string, ``partition`` int,
``offset`` long, ``timestamp`` timestamp, ``timestampType`` int (0 create
time, 1 log-append time, -1 none), ``headers`` array<struct<key string,
value binary>>.

Options (named as for Spark's Kafka source where one exists):

``kafka.bootstrap.servers`` (required), any other ``kafka.<property>``
    librdkafka consumer properties (TLS, SASL...). Note these are librdkafka
    names, not the Java client's (``sasl.username``, not ``sasl.jaas.config``).
``subscribe`` / ``subscribePattern``
    comma-separated topic names, or a regular expression every topic name
    must match in full; re-evaluated at every micro-batch, so topics and
    partitions created later are picked up (they are read from the start).
``startingOffsets``
    ``earliest`` (default), ``latest`` (streaming only) or JSON
    ``{"topic": {"0": 23, "1": -2}}`` (-2 earliest, -1 latest).
``endingOffsets`` (batch)
    ``latest`` (default) or JSON as above.
``maxOffsetsPerTrigger`` (streaming)
    upper bound of offsets per micro-batch, split over partitions in
    proportion to their backlog.
``failOnDataLoss``
    ``true`` (default): a start offset that is no longer in the log (retention,
    a recreated topic) fails the query; ``false``: skip to what remains.
``probeTimeoutMs``, ``pollTimeoutMs``
    how long finding a partition's end, and waiting for a record that must
    exist, may take before the read fails (defaults 30 000 and 120 000).

Offsets are the JSON above: per topic, per partition (as a string), the next
offset to read. Spark checkpoints them, so a restarted streaming query
resumes exactly where the last committed micro-batch ended.

Quirks handled
--------------
* **The end of a partition is probed, not taken from the broker.** tansu
  (the test broker) reports as high watermark the base offset of the last
  record batch plus one -- 1 instead of 10 after a batch of ten. Every end
  offset here (``latest``, the streaming ``latestOffset``, the
  ``Trigger.AvailableNow`` target) is found by fetching from
  ``max(watermark - 1, known position)`` until the consumer reports
  end-of-partition, whose offset is where the broker had nothing more. On a
  correct broker this reads one record per partition; on tansu at most the
  last batch. The end-of-partition event only comes after a fetch returned
  nothing, so a stale watermark cannot end a read early.
* Reading a range stops at the end offset, or at end-of-partition at or past
  it (compacted topics and transaction markers leave gaps in offsets). An
  end-of-partition *before* the end offset means records disappeared after
  the end was probed: a data loss, reported (or tolerated with
  ``failOnDataLoss=false``).
* Consumers use ``assign()``, never group subscription: no group
  coordinator, no rebalances, no committed offsets (progress lives in Spark's
  checkpoint), and no multi-second first-assignment delay.
* ``read()`` runs on executors: the stream reader drops its driver-side
  consumer when pickled.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from cdcd.consumer import list_topics
from cdcd.errors import ConfigError, DefiniteError, TransientError

__all__ = [
    "ARROW_SCHEMA",
    "EARLIEST",
    "KAFKA_SCHEMA_DDL",
    "LATEST",
    "SOURCE_NAME",
    "CdcdKafkaDataSource",
    "KafkaClient",
    "KafkaOptions",
    "KafkaRange",
    "Offsets",
    "offsets_from_json",
    "offsets_to_json",
    "read_range",
]

SOURCE_NAME = "cdcd-kafka"
EARLIEST = -2
LATEST = -1

#: The columns of Spark's Kafka source with ``includeHeaders=true``.
KAFKA_SCHEMA_DDL = (
    "key binary, value binary, topic string, partition int, offset long, "
    "timestamp timestamp, timestampType int, headers array<struct<key: string, value: binary>>"
)
_HEADER_TYPE = pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])
ARROW_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("timestampType", pa.int32()),
        pa.field("headers", pa.list_(_HEADER_TYPE)),
    ]
)

#: (topic, partition) -> offset
Offsets = dict[tuple[str, int], int]

_EOF = KafkaError._PARTITION_EOF
_OUT_OF_RANGE = KafkaError.OFFSET_OUT_OF_RANGE
_RETRIABLE = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
}
_ROWS_PER_BATCH = 4096
_TIMESTAMP_TYPES = {1: 0, 2: 1}  # librdkafka CREATE_TIME/LOG_APPEND_TIME -> Spark's codes


class _RepeatFilter(logging.Filter):
    """Lets one of each librdkafka message through per minute.

    A broker that is down makes librdkafka log a connection failure every
    reconnect backoff (100 ms); the read fails with the reason after its
    timeout anyway.
    """

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        now = time.monotonic()
        with self._lock:
            last = self._last.get(text)
            if last is not None and now - last < self._interval_s:
                return False
            if len(self._last) > 1000:
                self._last.clear()
            self._last[text] = now
        return True


kafka_log = logging.getLogger("cdcd.spark.kafka")
kafka_log.addFilter(_RepeatFilter())


# ----------------------------------------------------------------------------- options


def _flag(value: str | None, default: bool, name: str) -> bool:
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {name}: expected true or false, got {value!r}")


def _positive(value: str | None, default: float | None, name: str) -> float | None:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"option {name}: expected a number, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"option {name}: must be positive, got {value!r}")
    return number


@dataclass(frozen=True)
class KafkaOptions:
    """The source's options, validated (see the module docstring)."""

    bootstrap_servers: str
    client_config: Mapping[str, str] = field(default_factory=dict)
    topics: tuple[str, ...] = ()
    pattern: str | None = None
    starting_offsets: str = "earliest"
    ending_offsets: str = "latest"
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    probe_timeout_s: float = 30.0
    poll_timeout_s: float = 120.0

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> KafkaOptions:
        """From Spark's (case-insensitive) option map."""
        lowered = {str(k).lower(): str(v) for k, v in options.items()}
        bootstrap = lowered.get("kafka.bootstrap.servers")
        if not bootstrap:
            raise ConfigError(f"{SOURCE_NAME}: option kafka.bootstrap.servers is required")
        client = {
            k[len("kafka.") :]: v
            for k, v in lowered.items()
            if k.startswith("kafka.") and k != "kafka.bootstrap.servers"
        }
        for fixed in ("group.id", "enable.auto.commit", "enable.partition.eof"):
            if fixed in client:
                raise ConfigError(f"{SOURCE_NAME}: option kafka.{fixed} is managed by the source")
        subscribe = lowered.get("subscribe")
        pattern = lowered.get("subscribepattern")
        if bool(subscribe) == bool(pattern):
            raise ConfigError(f"{SOURCE_NAME}: give exactly one of subscribe or subscribePattern")
        topics = tuple(t.strip() for t in (subscribe or "").split(",") if t.strip())
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"{SOURCE_NAME}: subscribePattern {pattern!r}: {exc}") from exc
        max_offsets = _positive(lowered.get("maxoffsetspertrigger"), None, "maxOffsetsPerTrigger")
        return cls(
            bootstrap_servers=bootstrap,
            client_config=client,
            topics=topics,
            pattern=pattern,
            starting_offsets=lowered.get("startingoffsets", "earliest").strip(),
            ending_offsets=lowered.get("endingoffsets", "latest").strip(),
            max_offsets_per_trigger=int(max_offsets) if max_offsets is not None else None,
            fail_on_data_loss=_flag(lowered.get("failondataloss"), True, "failOnDataLoss"),
            probe_timeout_s=(
                _positive(lowered.get("probetimeoutms"), 30_000.0, "probeTimeoutMs") or 30_000.0
            )
            / 1000,
            poll_timeout_s=(
                _positive(lowered.get("polltimeoutms"), 120_000.0, "pollTimeoutMs") or 120_000.0
            )
            / 1000,
        )

    def consumer_config(self, *, probing: bool = False) -> dict[str, Any]:
        config: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": f"cdcd-spark-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error" if self.fail_on_data_loss else "earliest",
            "allow.auto.create.topics": False,
            "isolation.level": "read_uncommitted",
            # An empty fetch is what tells the end of a partition: answer it quickly.
            "fetch.wait.max.ms": 10 if probing else 100,
            "logger": kafka_log,
        }
        config.update(self.client_config)
        return config


# ----------------------------------------------------------------------------- offsets


def offsets_to_json(offsets: Mapping[tuple[str, int], int]) -> dict[str, dict[str, int]]:
    """``{(topic, partition): offset}`` -> ``{"topic": {"partition": offset}}``."""
    out: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[str(partition)] = int(offset)
    return out


def offsets_from_json(data: Mapping[str, Any] | str) -> Offsets:
    """The inverse of :func:`offsets_to_json`; accepts the JSON text too."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{SOURCE_NAME}: invalid offsets JSON {data!r}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{SOURCE_NAME}: offsets must be a JSON object, got {data!r}")
    out: Offsets = {}
    for topic, partitions in data.items():
        if not isinstance(partitions, Mapping):
            raise ConfigError(f"{SOURCE_NAME}: offsets of topic {topic!r} must be an object")
        for partition, offset in partitions.items():
            out[(str(topic), int(partition))] = int(offset)
    return out


# ----------------------------------------------------------------------------- client


class KafkaClient:
    """A driver-side consumer for metadata, watermarks and end probes."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options
        self._consumer = Consumer(options.consumer_config(probing=True))
        self._pattern = re.compile(options.pattern) if options.pattern is not None else None

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> KafkaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def discover(self) -> list[tuple[str, int]]:
        """Every partition of the subscribed topics that exist now."""
        timeout = self.options.probe_timeout_s
        metadata = list_topics(self._consumer, self.options.bootstrap_servers, timeout)
        wanted = set(self.options.topics)
        found: list[tuple[str, int]] = []
        for name, topic in metadata.topics.items():
            if self._pattern is not None:
                if name.startswith("__") or not self._pattern.fullmatch(name):
                    continue
            elif name not in wanted:
                continue
            if topic.error is not None and topic.error.code() != KafkaError.NO_ERROR:
                continue
            found.extend((name, p) for p in topic.partitions)
        return sorted(found)

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        """(low, high) as the broker reports them; high may be too low (tansu)."""
        timeout = self.options.probe_timeout_s
        try:
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=timeout, cached=False
            )
        except KafkaException as exc:
            raise TransientError(
                f"cannot query the offsets of {topic} [{partition}] within {timeout:g} s: {exc}"
            ) from exc
        return int(low), int(high)

    def earliest(self, partitions: Iterable[tuple[str, int]]) -> Offsets:
        return {tp: self.watermarks(*tp)[0] for tp in partitions}

    def probe_ends(
        self,
        partitions: Iterable[tuple[str, int]],
        floors: Mapping[tuple[str, int], int] | None = None,
    ) -> Offsets:
        """The real end (next offset to be written) of each partition.

        Fetches from ``max(low, high - 1, floor)`` until end-of-partition; see
        the module docstring for why the high watermark alone is not enough.
        """
        floors = floors or {}
        wanted = list(partitions)
        if not wanted:
            return {}
        assignment = []
        seen: Offsets = {}
        for tp in wanted:
            low, high = self.watermarks(*tp)
            start = max(low, high - 1, floors.get(tp, low))
            seen[tp] = start
            assignment.append(TopicPartition(tp[0], tp[1], start))
        consumer = self._consumer
        consumer.assign(assignment)
        ends: Offsets = {}
        deadline = time.monotonic() + self.options.probe_timeout_s
        try:
            while len(ends) < len(wanted):
                if time.monotonic() > deadline:
                    missing = ", ".join(f"{t} [{p}]" for t, p in wanted if (t, p) not in ends)
                    raise TransientError(
                        f"Kafka did not report the end of {missing} within "
                        f"{self.options.probe_timeout_s:g} s"
                    )
                for message in consumer.consume(1000, 0.05):
                    tp = _where(message)
                    error = message.error()
                    if error is None:
                        seen[tp] = max(seen[tp], _offset(message) + 1)
                    elif error.code() == _EOF:
                        ends[tp] = max(seen[tp], _offset(message))
                    else:
                        _raise_consumer_error(error, tp, seen.get(tp))
        finally:
            consumer.unassign()
        return ends


def _where(message: Message) -> tuple[str, int]:
    partition = message.partition()
    return str(message.topic()), -1 if partition is None else int(partition)


def _offset(message: Message) -> int:
    offset = message.offset()
    return -1 if offset is None else int(offset)


def _bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


def _raise_consumer_error(
    error: KafkaError, tp: tuple[str, int] | None, offset: int | None
) -> None:
    where = f"{tp[0]} [{tp[1]}]" if tp is not None else "Kafka"
    if error.code() == _OUT_OF_RANGE:
        raise DefiniteError(
            f"offset {offset} of {where} is no longer (or not yet) in the log: {error.str()}",
            hint="records were deleted by retention or the topic was recreated; "
            "set failOnDataLoss=false to skip ahead, or start from a new checkpoint",
        )
    if error.code() in _RETRIABLE or error.retriable():
        return
    raise TransientError(f"Kafka error reading {where}: {error.str()}")


# ----------------------------------------------------------------------------- reading


class KafkaRange(InputPartition):  # type: ignore[misc,unused-ignore]  # pyspark is Any when not installed
    """One Spark input partition: offsets [start, end) of one topic partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end


def _batch(
    topic: str,
    partition: int,
    keys: list[bytes | None],
    values: list[bytes | None],
    offsets: list[int],
    timestamps: list[int | None],
    timestamp_types: list[int],
    headers: list[list[dict[str, Any]]],
) -> pa.RecordBatch:
    n = len(offsets)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([topic] * n, pa.string()),
            pa.array([partition] * n, pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(timestamps, pa.timestamp("us", tz="UTC")),
            pa.array(timestamp_types, pa.int32()),
            pa.array(headers, pa.list_(_HEADER_TYPE)),
        ],
        schema=ARROW_SCHEMA,
    )


def read_range(options: KafkaOptions, part: KafkaRange) -> Iterator[pa.RecordBatch]:
    """The records of ``part`` as Arrow record batches in offset order."""
    topic, partition, start, end = part.topic, part.partition, part.start, part.end
    if start >= 0 and start >= end:
        return
    consumer = Consumer(options.consumer_config())
    try:
        consumer.assign(
            [TopicPartition(topic, partition, OFFSET_BEGINNING if start < 0 else start)]
        )
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        offsets: list[int] = []
        timestamps: list[int | None] = []
        timestamp_types: list[int] = []
        headers: list[list[dict[str, Any]]] = []
        position = start
        last_progress = time.monotonic()
        done = False
        while not done:
            messages: list[Message] = consumer.consume(_ROWS_PER_BATCH, 0.05)
            if not messages:
                if time.monotonic() - last_progress > options.poll_timeout_s:
                    raise TransientError(
                        f"no record of {topic} [{partition}] arrived within {options.poll_timeout_s:g} s "
                        f"at offset {position} (reading up to {end})"
                    )
                continue
            last_progress = time.monotonic()
            for message in messages:
                error = message.error()
                if error is not None:
                    if error.code() == _EOF:
                        if _offset(message) < end and options.fail_on_data_loss:
                            raise DefiniteError(
                                f"{topic} [{partition}] ends at offset {_offset(message)}, "
                                f"but offsets up to {end} were there when the batch was planned",
                                hint="records were deleted or the topic was recreated; set "
                                "failOnDataLoss=false to accept the loss",
                            )
                        done = True
                        break
                    _raise_consumer_error(error, (topic, partition), position)
                    continue
                offset = _offset(message)
                if offset >= end:
                    done = True
                    break
                kind, stamp = message.timestamp()
                keys.append(_bytes(message.key()))
                values.append(_bytes(message.value()))
                offsets.append(offset)
                timestamps.append(stamp * 1000 if kind in _TIMESTAMP_TYPES else None)
                timestamp_types.append(_TIMESTAMP_TYPES.get(kind, -1))
                pairs: Any = message.headers() or ()
                headers.append([{"key": k, "value": v} for k, v in pairs])
                position = offset + 1
                if position >= end:
                    done = True
                    break
            if len(offsets) >= _ROWS_PER_BATCH or (done and offsets):
                yield _batch(
                    topic, partition, keys, values, offsets, timestamps, timestamp_types, headers
                )
                keys, values, offsets, timestamps, timestamp_types, headers = [], [], [], [], [], []
    finally:
        consumer.close()


# ----------------------------------------------------------------------------- offsets resolution


def _resolve(
    client: KafkaClient, spec: str, partitions: list[tuple[str, int]], floors: Offsets | None = None
) -> Offsets:
    """``earliest`` / ``latest`` / JSON to concrete offsets for ``partitions``."""
    if spec == "earliest":
        return client.earliest(partitions)
    if spec == "latest":
        return client.probe_ends(partitions, floors)
    given = offsets_from_json(spec)
    out: Offsets = {}
    latest = [tp for tp in partitions if given.get(tp) == LATEST]
    ends = client.probe_ends(latest, floors) if latest else {}
    for tp in partitions:
        offset = given.get(tp, EARLIEST)
        if offset == EARLIEST:
            offset = client.watermarks(*tp)[0]
        elif offset == LATEST:
            offset = ends[tp]
        out[tp] = offset
    return out


def _limit(starts: Offsets, ends: Offsets, limit: ReadLimit) -> Offsets:
    """Cap the micro-batch at ``limit`` rows, split in proportion to each backlog."""
    if not isinstance(limit, ReadMaxRows):
        return ends
    backlog = {tp: max(0, end - starts.get(tp, end)) for tp, end in ends.items()}
    total = sum(backlog.values())
    if total <= limit.max_rows:
        return ends
    capped: Offsets = {}
    for tp, end in ends.items():
        start = starts.get(tp, end)
        share = backlog[tp] * limit.max_rows // total
        if backlog[tp] and not share:
            share = 1  # always progress
        capped[tp] = min(end, start + share)
    return capped


class CdcdKafkaBatchReader(DataSourceReader):  # type: ignore[misc,unused-ignore]  # pyspark is Any when not installed
    """Batch read: from ``startingOffsets`` to ``endingOffsets`` (probed when ``latest``)."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options

    def partitions(self) -> list[KafkaRange]:
        options = self.options
        if options.starting_offsets == "latest":
            raise ConfigError(
                f"{SOURCE_NAME}: startingOffsets=latest is not allowed in batch reads"
            )
        if options.ending_offsets == "earliest":
            raise ConfigError(f"{SOURCE_NAME}: endingOffsets=earliest is not allowed")
        with KafkaClient(options) as client:
            partitions = client.discover()
            starts = _resolve(client, options.starting_offsets, partitions)
            ends = _resolve(client, options.ending_offsets, partitions, starts)
        return [
            KafkaRange(topic, partition, starts[(topic, partition)], ends[(topic, partition)])
            for topic, partition in partitions
            if ends[(topic, partition)] > starts[(topic, partition)]
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaRange)
        yield from read_range(self.options, partition)


class CdcdKafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc,unused-ignore]  # pyspark is Any when not installed
    """Micro-batch streaming with probed ends, ``maxOffsetsPerTrigger`` and AvailableNow."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options
        self._client: KafkaClient | None = None
        self._target: Offsets | None = None

    def __getstate__(self) -> dict[str, Any]:
        # read() runs on executors: never ship the driver's consumer.
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def _kafka(self) -> KafkaClient:
        if self._client is None:
            self._client = KafkaClient(self.options)
        return self._client

    def initialOffset(self) -> dict[str, dict[str, int]]:
        client = self._kafka()
        return offsets_to_json(_resolve(client, self.options.starting_offsets, client.discover()))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets_per_trigger is not None:
            return ReadMaxRows(self.options.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        client = self._kafka()
        self._target = client.probe_ends(client.discover())

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, dict[str, int]]:
        client = self._kafka()
        starts = offsets_from_json(start)
        # Partitions of topics deleted meanwhile keep their last offsets and are not read.
        partitions = client.discover()
        floors = {tp: starts[tp] for tp in partitions if tp in starts}
        new = [tp for tp in partitions if tp not in starts]
        resolved_starts = {**floors, **client.earliest(new)}
        if self._target is not None:
            # AvailableNow: never past the target recorded at the query's start.
            ends = {
                tp: max(resolved_starts[tp], target)
                for tp, target in self._target.items()
                if tp in resolved_starts
            }
        else:
            ends = client.probe_ends(partitions, resolved_starts)
        ends = _limit(resolved_starts, ends, limit)
        return offsets_to_json({**starts, **ends})

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[KafkaRange]:
        starts = offsets_from_json(start)
        ends = offsets_from_json(end)
        ranges = []
        for (topic, partition), stop in sorted(ends.items()):
            begin = starts.get((topic, partition), EARLIEST)
            if (begin == EARLIEST and stop > 0) or 0 <= begin < stop:
                ranges.append(KafkaRange(topic, partition, begin, stop))
        return ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaRange)
        yield from read_range(self.options, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: progress is Spark's checkpoint, not Kafka's committed offsets."""

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class CdcdKafkaDataSource(DataSource):  # type: ignore[misc,unused-ignore]  # pyspark is Any when not installed
    """``spark.read.format("cdcd-kafka")`` / ``spark.readStream.format("cdcd-kafka")``."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return KAFKA_SCHEMA_DDL

    def reader(self, schema: Any) -> CdcdKafkaBatchReader:
        return CdcdKafkaBatchReader(KafkaOptions.from_options(self.options))

    def streamReader(self, schema: Any) -> CdcdKafkaStreamReader:
        return CdcdKafkaStreamReader(KafkaOptions.from_options(self.options))
