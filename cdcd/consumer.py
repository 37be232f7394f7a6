"""What every reader of cdcd's topics needs: wire headers and writer schemas (SPEC §6).

One module for ``cdcd demo``, :mod:`cdcd.spark` and the tests, so that the
three cannot read the wire format three ways.

* **Wire headers.** A message value (or key) starts with the name of its
  writer schema: ``C3 01`` + the 8-byte CRC-64-AVRO fingerprint (Avro
  single-object encoding; the schema is in ``<prefix>._schemas``), or ``00``
  + a 4-byte big-endian schema registry id (Confluent wire format). The
  header's bytes are the key under which :class:`SchemaCatalog` files a
  writer schema. Pure.
* **``<prefix>._schemas``.** The daemon publishes every writer schema there,
  acknowledged, before the first message that uses it, keyed by the
  fingerprint in hex with the schema JSON as value (a compacted topic). So a
  header seen in a table topic is always found after reading ``_schemas`` to
  its end. The end is where the broker reports end-of-partition after an
  empty fetch, never its high watermark (tansu's is too low, see
  ``cdcd.spark.source``). The fingerprint is the CRC-64-AVRO of the
  published schema text itself (logical types, defaults and aliases
  included), so two different writer schemas never share one and a
  fingerprint names the same schema forever (docs/wire-format.md). Topics
  written before that rule (fingerprints of Avro's canonical form) may hold
  several schemas under one key; the latest record of a key wins, which is
  why a long-running reader still calls :meth:`SchemaCatalog.refresh` after
  fetching messages and before decoding them.
* **The schema registry** (``schema_registry.url`` set) is asked by id, and
  its failures are classified: not found or refused credentials are definite
  (the message cannot be decoded until someone acts); no answer, a timeout,
  throttling or a server error are transient (it may answer later). Only
  what was found is cached.

:class:`SchemaCatalog` pickles without its registry client or Kafka
consumer, so Spark executors can look up writer schemas that appear after a
query started.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import fastavro

from cdcd.envelope.schemas import avro_namespace
from cdcd.envelope.wire import (
    registry_client,
    registry_outage,
    registry_status,
    registry_unanswered,
)
from cdcd.errors import CdcdError, DefiniteError, TransientError
from cdcd.naming import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC, schemas_topic

if TYPE_CHECKING:
    from confluent_kafka import Consumer

    from cdcd.config.model import CdcdConfig

# The Kafka client and the configuration model are imported where they are used:
# Spark's Python workers import this module to decode, and need neither there.

__all__ = [
    "CONFLUENT_HEADER_LENGTH",
    "SINGLE_OBJECT_HEADER_LENGTH",
    "SchemaCatalog",
    "confluent_header",
    "fingerprint_header",
    "is_envelope_for",
    "registry_error",
    "schema_id",
    "wire_header",
]

log = logging.getLogger(__name__)

SINGLE_OBJECT_HEADER_LENGTH = 10
CONFLUENT_HEADER_LENGTH = 5

# ----------------------------------------------------------------------------- wire headers


def wire_header(value: bytes) -> bytes:
    """The schema-identifying prefix of ``value``: 10 bytes single-object, 5 Confluent.

    ``ValueError`` when ``value`` starts with neither.
    """
    if value[:2] == SINGLE_OBJECT_MAGIC and len(value) >= SINGLE_OBJECT_HEADER_LENGTH:
        return value[:SINGLE_OBJECT_HEADER_LENGTH]
    if value[:1] == CONFLUENT_MAGIC and len(value) >= CONFLUENT_HEADER_LENGTH:
        return value[:CONFLUENT_HEADER_LENGTH]
    raise ValueError(f"not a cdcd message (starts with {value[:10].hex() or 'nothing'})")


def fingerprint_header(fingerprint_hex: str) -> bytes:
    """The single-object header of a ``_schemas`` key (the fingerprint in hex)."""
    header = SINGLE_OBJECT_MAGIC + bytes.fromhex(fingerprint_hex)
    if len(header) != SINGLE_OBJECT_HEADER_LENGTH:
        raise ValueError(f"{fingerprint_hex!r} is not an 8-byte fingerprint in hex")
    return header


def confluent_header(schema_id: int) -> bytes:
    """The Confluent wire header of registry id ``schema_id``."""
    return CONFLUENT_MAGIC + int(schema_id).to_bytes(4, "big")


def schema_id(header: bytes) -> int:
    """The registry id in a Confluent wire header."""
    if header[:1] != CONFLUENT_MAGIC or len(header) != CONFLUENT_HEADER_LENGTH:
        raise ValueError(f"{header.hex()} is not a Confluent wire header")
    return int.from_bytes(header[1:5], "big")


def is_envelope_for(schema: Mapping[str, Any], topic: str) -> bool:
    """Whether ``schema`` is the envelope (value) schema of table topic ``topic``."""
    return schema.get("name") == "Envelope" and schema.get("namespace") == avro_namespace(topic)


# ----------------------------------------------------------------------------- registry errors


def registry_error(exc: Exception, what: str) -> CdcdError | None:
    """Classify a failed registry lookup of ``what`` (e.g. ``schema id 7``).

    Not found (404) is definite: the message cannot be decoded without it.
    No answer, a timeout (408), throttling (429) or a server error (5xx) is
    transient: the registry may answer later, so the lookup is retried (the
    catalog caches only what it found; a Spark task fails and is retried, or
    the mirror exits 1). Refused credentials and other client errors are
    definite. None: ``exc`` is neither an answer nor a failure to get one (a
    bug), for the caller to raise as it is.
    """
    status = registry_status(exc)
    if status is None:
        if registry_unanswered(exc):
            return TransientError(
                f"the schema registry did not answer the lookup of {what}: "
                f"{type(exc).__name__}: {exc}"
            )
        return None
    if status == 404:
        return DefiniteError(
            f"{what} not found in the schema registry: {exc}",
            hint="was the topic written by cdcd with this schema_registry.url?",
        )
    if registry_outage(status):
        return TransientError(f"the schema registry failed the lookup of {what}: {exc}")
    if status in (401, 403):
        return DefiniteError(
            f"the schema registry refused the lookup of {what}: {exc}",
            hint="check the credentials in schema_registry.config",
        )
    return DefiniteError(f"the schema registry rejected the lookup of {what}: {exc}")


# ----------------------------------------------------------------------------- topics


def list_topics(consumer: Consumer, bootstrap_servers: str, timeout_s: float) -> Any:
    """The cluster's topic metadata; a broker that does not answer in time is transient."""
    from confluent_kafka import KafkaException

    try:
        return consumer.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise TransientError(
            f"cannot list topics at {bootstrap_servers} within {timeout_s:g} s: {exc}"
        ) from exc


# ----------------------------------------------------------------------------- catalog


def _retriable_codes() -> frozenset[int]:
    from confluent_kafka import KafkaError

    return frozenset(
        {
            KafkaError._TRANSPORT,
            KafkaError._ALL_BROKERS_DOWN,
            KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.NOT_LEADER_FOR_PARTITION,
            KafkaError.UNKNOWN_TOPIC_OR_PART,
        }
    )


class SchemaCatalog:
    """Writer schemas by wire header, from ``<prefix>._schemas`` or the schema registry.

    Single-object mode reads ``_schemas`` incrementally, each :meth:`refresh`
    from where the last one stopped to the current end. Registry mode asks
    the registry by id. :meth:`schema` refreshes (or asks) once when a header
    is unknown; :meth:`decode` decodes a whole message with its writer schema.
    """

    def __init__(
        self,
        prefix: str,
        *,
        bootstrap_servers: str | None = None,
        client_config: Mapping[str, Any] | None = None,
        timeout_s: float = 30.0,
        registry_url: str | None = None,
        registry_config: Mapping[str, Any] | None = None,  # credentials may be SecretStr
        registry_client: Any | None = None,
    ) -> None:
        self.prefix = prefix
        self._bootstrap_servers = bootstrap_servers
        self._client_config = dict(client_config or {})
        self._timeout_s = timeout_s
        self._registry_url = registry_url
        self._registry_config = dict(registry_config or {})
        self._registry_client = registry_client
        self._schemas: dict[bytes, dict[str, Any]] = {}
        self._published: dict[bytes, int] = {}  # header -> offset of its last publication
        self._positions: dict[int, int] = {}  # _schemas partition -> next offset to read
        self._parsed: dict[bytes, Any] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_registry_client"] = None
        state["_parsed"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls, config: CdcdConfig, *, client_config: Mapping[str, Any] | None = None
    ) -> SchemaCatalog:
        """The catalog of ``config``'s topics; ``client_config`` replaces the
        connection properties taken from ``kafka.producer``."""
        from cdcd.config.kafka_client import connection_properties

        return cls(
            config.kafka.topic_prefix,
            bootstrap_servers=config.kafka.bootstrap_servers,
            client_config=(
                client_config
                if client_config is not None
                else connection_properties(config.kafka.producer)
            ),
            registry_url=config.schema_registry.url,
            registry_config=config.schema_registry.config,
        )

    @property
    def uses_registry(self) -> bool:
        return self._registry_client is not None or bool(self._registry_url)

    @property
    def schemas_topic(self) -> str:
        return schemas_topic(self.prefix)

    def add(self, header: bytes, schema: Mapping[str, Any]) -> None:
        """File ``schema`` under ``header`` (schemas known by other means, e.g. in tests)."""
        self._schemas[header] = dict(schema)

    # ------------------------------------------------------------------ registry

    def _registry(self) -> Any:
        if self._registry_client is None:
            self._registry_client = registry_client(
                str(self._registry_url), self._registry_config
            )
        return self._registry_client

    def _ask_registry(self, header: bytes) -> dict[str, Any]:
        if header[:1] != CONFLUENT_MAGIC:
            raise DefiniteError(
                f"message header {header.hex()} is not the Confluent wire format, "
                "but schema_registry.url is set"
            )
        number = schema_id(header)
        try:
            registered = self._registry().get_schema(number)
        except Exception as exc:  # the client raises its HTTP library's errors too
            error = registry_error(exc, f"schema id {number}")
            if error is None:
                raise
            raise error from exc
        schema: dict[str, Any] = json.loads(registered.schema_str)
        self._schemas[header] = schema
        return schema

    # ------------------------------------------------------------------ _schemas

    def _consumer_config(self) -> dict[str, Any]:
        if not self._bootstrap_servers:
            raise DefiniteError(
                f"cannot read {self.schemas_topic}: no Kafka bootstrap servers given"
            )
        config: dict[str, Any] = {
            "bootstrap.servers": self._bootstrap_servers,
            # assign() only: the group is never joined, nothing is committed.
            "group.id": f"cdcd-schemas-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "allow.auto.create.topics": False,
            # An empty fetch is what tells the end of a partition: answer it quickly.
            "fetch.wait.max.ms": 10,
            "logger": log,
        }
        config.update(self._client_config)
        return config

    def refresh(self) -> None:
        """Read what was published to ``<prefix>._schemas`` since the last refresh.

        Nothing to do in registry mode. A missing ``_schemas`` topic means
        nothing was published yet.
        """
        if self.uses_registry:
            return
        from confluent_kafka import Consumer

        with self._lock:
            consumer = Consumer(self._consumer_config())
            try:
                self._read_to_end(consumer)
            finally:
                consumer.close()

    def _read_to_end(self, consumer: Consumer) -> None:
        from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

        eof, retriable = KafkaError._PARTITION_EOF, _retriable_codes()
        topic = self.schemas_topic
        timeout = self._timeout_s
        try:
            metadata = consumer.list_topics(topic, timeout=timeout)
        except KafkaException as exc:
            raise TransientError(
                f"cannot list {topic} at {self._bootstrap_servers} within {timeout:g} s: {exc}"
            ) from exc
        info = metadata.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            return
        partitions = sorted(info.partitions)
        consumer.assign(
            [TopicPartition(topic, p, self._positions.get(p, OFFSET_BEGINNING)) for p in partitions]
        )
        reading = set(partitions)
        last_progress = time.monotonic()
        while reading:
            if time.monotonic() - last_progress > timeout:
                raise TransientError(
                    f"Kafka did not report the end of {topic} "
                    f"(partitions {sorted(reading)}) within {timeout:g} s"
                )
            for message in consumer.consume(500, 0.02):
                partition = message.partition()
                offset = message.offset()
                error = message.error()
                if error is not None:
                    if error.code() != eof:
                        if not error.retriable() and error.code() not in retriable:
                            raise TransientError(f"Kafka error reading {topic}: {error.str()}")
                    elif partition is not None and offset is not None:
                        self._positions[partition] = max(self._positions.get(partition, 0), offset)
                        reading.discard(partition)
                        last_progress = time.monotonic()
                    continue
                if partition is None or offset is None:
                    continue
                last_progress = time.monotonic()
                self._positions[partition] = offset + 1
                reading.add(partition)  # a record after end-of-partition: read on
                self._file(topic, offset, message.key(), message.value())

    def _file(self, topic: str, offset: int, key: Any, value: Any) -> None:
        if key is None or value is None:
            return
        try:
            header = fingerprint_header(bytes(key).decode("ascii"))
            schema = json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DefiniteError(
                f"{topic} offset {offset} is not a cdcd schema record: {exc}"
            ) from exc
        # A later record for a known fingerprint wins (only topics written before
        # fingerprints covered the whole schema have any): see the module docstring.
        self._schemas[header] = schema
        self._published[header] = offset
        self._parsed.pop(header, None)

    # ------------------------------------------------------------------ lookups

    def schema(self, header: bytes) -> dict[str, Any]:
        """The writer schema of ``header``; refreshes (or asks the registry) once when unknown."""
        found = self._schemas.get(header)
        if found is not None:
            return found
        if self.uses_registry:
            return self._ask_registry(header)
        self.refresh()
        found = self._schemas.get(header)
        if found is None:
            raise DefiniteError(
                f"writer schema {header.hex()} is not in {self.schemas_topic}",
                hint="was the topic written by cdcd with this topic_prefix and wire format?",
            )
        return found

    def decode(self, data: bytes) -> dict[str, Any]:
        """A whole message (value or key) decoded with its own writer schema (logical types applied)."""
        try:
            header = wire_header(data)
        except ValueError as exc:
            raise DefiniteError(str(exc)) from None
        parsed = self._parsed.get(header)
        if parsed is None:
            parsed = fastavro.parse_schema(self.schema(header))
            self._parsed[header] = parsed
        record = fastavro.schemaless_reader(io.BytesIO(data[len(header) :]), parsed, None)
        if not isinstance(record, dict):
            raise DefiniteError(f"expected an Avro record, decoded {type(record).__name__}")
        return record

    def latest(self, topic: str) -> tuple[bytes, dict[str, Any]] | None:
        """The most recently published envelope schema of ``topic``, or None.

        Only a default for readers that cannot look at the data first (a
        streaming query's schema is fixed when it starts); the newest schema
        of a topic is the one of its change with the highest
        (``cdcd.lsn``, ``cdcd.seq``).
        """
        if self.uses_registry:
            subject = f"{topic}-value"
            try:
                registered = self._registry().get_latest_version(subject)
            except Exception as exc:  # the client raises its HTTP library's errors too
                if registry_status(exc) == 404:
                    return None  # nothing registered for the topic yet
                error = registry_error(exc, f"subject {subject}")
                if error is None:
                    raise
                raise error from exc
            header = confluent_header(registered.schema_id)
            schema: dict[str, Any] = json.loads(registered.schema.schema_str)
            self._schemas[header] = schema
            return header, schema
        self.refresh()
        candidates = [
            (offset, header)
            for header, offset in self._published.items()
            if is_envelope_for(self._schemas[header], topic)
        ]
        if not candidates:
            return None
        _, header = max(candidates)
        return header, self._schemas[header]

    def known(self, topic: str) -> dict[bytes, dict[str, Any]]:
        """Every envelope schema of ``topic`` seen so far."""
        return {h: s for h, s in self._schemas.items() if is_envelope_for(s, topic)}
