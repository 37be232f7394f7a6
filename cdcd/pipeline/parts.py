"""What a session is built from: its connections as factories, and the wire format.

A :class:`~cdcd.pipeline.session.Session` does not construct its Kafka
sink, its metadata connection or its replication stream: it calls the
factories of a :class:`SessionParts`, once per session, so each reconnect
(a new session) gets fresh ones. The daemon passes :func:`real_parts`; tests
pass an in-memory sink that injects faults, or a scripted stream, and so
drive the real loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cdcd.config.model import CdcdConfig
from cdcd.envelope.wire import ConfluentFormat, SingleObjectFormat, WireFormat, registry_client
from cdcd.errors import TransientError
from cdcd.naming import schemas_topic
from cdcd.pipeline.publisher import Producer
from cdcd.protocol.lsn import Lsn
from cdcd.sink.producer import KafkaSink, build_producer_config
from cdcd.sink.topics import TopicSpec, check_broker, ensure_topics, topic_spec
from cdcd.source.database import SourceDatabase
from cdcd.source.replication import ReplicationStream

__all__ = [
    "SessionParts",
    "Sink",
    "SinkFactory",
    "Stream",
    "real_parts",
    "wire_format",
]


class Sink(Producer, Protocol):
    """What a session needs of a Kafka sink (``cdcd.sink.producer.KafkaSink``): the
    publisher's ``produce``, and serving delivery reports."""

    blocked_s: float
    """Seconds ``produce`` has waited for room in the local queue, in all."""

    def poll(self, timeout: float = 0.0) -> int: ...

    def flush(self, timeout_s: float) -> int: ...

    def close(self, timeout_s: float) -> int: ...

    def __len__(self) -> int: ...

    def delivery_failure(self, err: Any, msg: Any) -> BaseException: ...


class Stream(Protocol):
    """What a session needs of its replication stream (``cdcd.source.replication``)."""

    #: How long the session pauses while catching up once a read drained the socket.
    fill_wait_s: float

    def start(self, start_lsn: Lsn) -> None: ...

    def read_batch(self, limit: int) -> list[bytes]: ...

    @property
    def data_start(self) -> Lsn: ...

    @property
    def wal_end(self) -> Lsn: ...

    def wait(self, timeout_s: float) -> None: ...

    def reply_due(self) -> bool: ...

    def send_status(self, written: Lsn, flushed: Lsn, reply: bool = False) -> None: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


class SinkFactory(Protocol):
    """Makes a session's sink; ``should_stop`` is asked while the producer queue is full."""

    def __call__(
        self,
        *,
        should_stop: Callable[[], bool] | None = None,
        on_failed_delivery: Callable[[str], None] | None = None,
    ) -> Sink: ...


@dataclass(frozen=True, slots=True)
class SessionParts:
    """Factories for what a session connects to; each call makes a new one."""

    database: Callable[[], SourceDatabase]
    stream: Callable[[], Stream]
    sink: SinkFactory
    #: One round trip to the brokers: their description, or TransientError/DefiniteError.
    check_broker: Callable[[], str]
    #: Create a topic if it is missing (called only with ``kafka.create_topics``).
    ensure_topic: Callable[[TopicSpec], None]


def real_parts(config: CdcdConfig, client_id: str = "cdcd") -> SessionParts:
    """The parts the daemon runs with: PostgreSQL, its walsender and Kafka as configured."""
    pg, kafka = config.postgres, config.kafka

    def database() -> SourceDatabase:
        return SourceDatabase(pg.dsn.get_secret_value(), timeout_s=pg.connect_timeout_s)

    def stream() -> Stream:
        return ReplicationStream(
            pg.dsn.get_secret_value(),
            pg.slot,
            pg.publication,
            pg.protocol_version,
            pg.connect_timeout_s,
            pg.origin,
            application_name=pg.replication_application_name,
        )

    def sink(
        *,
        should_stop: Callable[[], bool] | None = None,
        on_failed_delivery: Callable[[str], None] | None = None,
    ) -> Sink:
        return KafkaSink(
            build_producer_config(kafka.bootstrap_servers, dict(kafka.producer), client_id),
            create_topics=kafka.create_topics,
            should_stop=should_stop,
            on_failed_delivery=on_failed_delivery,
        )

    def broker() -> str:
        return check_broker(kafka.bootstrap_servers, dict(kafka.producer), timeout_s=10.0)

    def ensure(spec: TopicSpec) -> None:
        ensure_topics(
            kafka.bootstrap_servers, [spec], timeout_s=30.0, producer_props=dict(kafka.producer)
        )

    return SessionParts(database, stream, sink, broker, ensure)


#: How long publishing one schema to ``<prefix>._schemas`` may wait for Kafka.
SCHEMA_TIMEOUT_S = 60.0


def wire_format(
    config: CdcdConfig,
    sink: Sink,
    parts: SessionParts,
    waiting: Callable[[], None] = lambda: None,
) -> WireFormat:
    """The wire format of ``config``: the registry's, or single-object encoding whose schemas
    go to ``<prefix>._schemas`` through ``sink`` (acknowledged before first use).

    ``waiting`` is called while a schema waits for its acknowledgement (the
    session keeps the walsender's status updates going there).
    """
    registry = config.schema_registry
    if registry.url:
        return ConfluentFormat(registry_client(registry.url, registry.config))
    schemas = schemas_topic(config.kafka.topic_prefix)
    if config.kafka.create_topics:
        parts.ensure_topic(topic_spec(config.kafka, schemas))

    def publish(key: bytes, value: bytes) -> None:
        results: list[tuple[Any, Any]] = []
        sink.produce(schemas, key, value, [], lambda err, msg: results.append((err, msg)))
        deadline = time.monotonic() + SCHEMA_TIMEOUT_S
        while not results:
            if time.monotonic() > deadline:
                raise TransientError(f"publishing a schema to {schemas} timed out")
            sink.flush(0.05)  # sends at once, not after linger.ms
            waiting()
        if results[0][0] is not None:
            raise sink.delivery_failure(*results[0])

    return SingleObjectFormat(publish)
