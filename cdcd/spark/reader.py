"""Public entry points: the topics cdcd writes, as Spark DataFrames.

* :func:`read_raw` -- Kafka rows (``key``, ``value``, ``topic``,
  ``partition``, ``offset``, ``timestamp``, ``timestampType``, ``headers``),
  batch or streaming, from Spark's own Kafka source when its jars are on the
  classpath (``spark.jars.packages
  org.apache.spark:spark-sql-kafka-0-10_2.13:<spark version>``), else from
  the bundled ``cdcd-kafka`` Python data source (:mod:`cdcd.spark.source`).
  The choice is made by asking Spark for the ``kafka`` format once per
  session; ``source=`` forces one.
* :func:`read_changes` -- one table's decoded change stream
  (:mod:`cdcd.spark.decode`), batch or streaming.

The two Kafka sources take the same option names (``kafka.bootstrap.servers``,
``subscribe``/``subscribePattern``, ``startingOffsets``, ``endingOffsets``,
``maxOffsetsPerTrigger``, ``failOnDataLoss``), and their offsets JSON has the
same shape, so code written against one runs on the other. ``kafka.*``
client properties differ, though: librdkafka's names for the bundled source,
the Java client's for Spark's. The bundled source always probes the real end
of each partition; Spark's trusts the broker's high watermark, which is
right on Kafka (and wrong on tansu, the test broker).

Reader schema: a batch read looks at the data first and decodes with the
writer schema of the newest change (by ``cdcd.lsn``/``cdcd.seq``). A
streaming query's schema is fixed when it starts: the most recently
published schema of the table; messages written later with a newer schema
are still decoded (their writer schema is fetched by the executors), but
columns added after the start are left out until the query is restarted.
``cdcd mirror`` does not have this limit: it picks the schema per batch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cdcd.config.kafka_client import admin_config
from cdcd.config.model import CdcdConfig, load_config
from cdcd.consumer import SchemaCatalog
from cdcd.errors import ConfigError, DefiniteError
from cdcd.naming import split_table, table_topic_pattern

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

__all__ = [
    "KAFKA_COLUMNS",
    "Source",
    "kafka_options",
    "kafka_source_available",
    "read_changes",
    "read_raw",
    "register_source",
    "schema_catalog",
    "table_topic_pattern",
]

Source = Literal["auto", "kafka", "cdcd-kafka"]
KAFKA_COLUMNS = (
    "key",
    "value",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "timestampType",
    "headers",
)
#: Options of the bundled source only; Spark's Kafka source is not given them.
_BUNDLED_ONLY = {"probetimeoutms", "polltimeoutms"}

_registered: set[int] = set()
_kafka_available: dict[int, bool] = {}
_lock = threading.Lock()


def _session_key(spark: SparkSession) -> int:
    return id(spark)


def register_source(spark: SparkSession) -> None:
    """Register the ``cdcd-kafka`` data source with ``spark`` (idempotent)."""
    from cdcd.spark.source import CdcdKafkaDataSource

    with _lock:
        key = _session_key(spark)
        if key not in _registered:
            _check_workers(spark)
            spark.dataSource.register(CdcdKafkaDataSource)
            _registered.add(key)


def _check_workers(spark: SparkSession) -> None:
    """Warn when the session's Python workers run an interpreter other than this one
    (a session started before ``cdcd.spark`` was imported, from a virtualenv that is
    not activated): they may not find cdcd (``No module named 'cdcd'``)."""
    worker = getattr(spark.sparkContext, "pythonExec", None)
    if worker and os.path.realpath(str(worker)) != os.path.realpath(sys.executable):
        log.warning(
            "Spark's Python workers run %s, not %s: if they fail with "
            "\"No module named 'cdcd'\", set PYSPARK_PYTHON=%s before starting the session "
            "(or import cdcd.spark first)",
            worker,
            sys.executable,
            sys.executable,
        )


def kafka_source_available(spark: SparkSession) -> bool:
    """Whether Spark's own Kafka source (the spark-sql-kafka jars) is on the classpath.

    Asks Spark to load the ``kafka`` format without options: a missing source
    fails with ``KAFKA_DATA_SOURCE_NOT_ENABLED`` (or ``DATA_SOURCE_NOT_FOUND``),
    a present one complains about the missing options. Nothing connects.
    """
    from pyspark.errors import PySparkException

    with _lock:
        key = _session_key(spark)
        if key in _kafka_available:
            return _kafka_available[key]
    try:
        spark.read.format("kafka").load()
        available = True
    except PySparkException as exc:
        condition = exc.getCondition() or ""
        text = str(exc)
        available = not (
            condition in ("KAFKA_DATA_SOURCE_NOT_ENABLED", "DATA_SOURCE_NOT_FOUND")
            or "KAFKA_DATA_SOURCE_NOT_ENABLED" in text
            or "Failed to find data source: kafka" in text
        )
    with _lock:
        _kafka_available[key] = available
    return available


def _choose(spark: SparkSession, source: Source) -> str:
    if source == "auto":
        return "kafka" if kafka_source_available(spark) else "cdcd-kafka"
    if source not in ("kafka", "cdcd-kafka"):
        raise ConfigError(f"source must be auto, kafka or cdcd-kafka, not {source!r}")
    return source


def read_raw(
    spark: SparkSession,
    options: Mapping[str, str],
    *,
    streaming: bool = False,
    source: Source = "auto",
) -> DataFrame:
    """Kafka rows from the chosen source (see the module docstring)."""
    chosen = _choose(spark, source)
    opts = {str(k): str(v) for k, v in options.items()}
    lowered = {k.lower() for k in opts}
    if "startingoffsets" not in lowered:
        opts["startingOffsets"] = "earliest"  # Spark's streaming default is latest
    if chosen == "kafka":
        opts = {k: v for k, v in opts.items() if k.lower() not in _BUNDLED_ONLY}
        opts["includeHeaders"] = "true"
    else:
        register_source(spark)
    reader = spark.readStream if streaming else spark.read
    frame = reader.format(chosen).options(**opts).load()
    return frame.select(*KAFKA_COLUMNS)


def _librdkafka_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def kafka_options(
    config: CdcdConfig,
    *,
    topics: Sequence[str] | None = None,
    pattern: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Source options for ``config``'s broker: bootstrap servers, the producer's
    connection and security properties (as ``kafka.*``), and the subscription."""
    client = admin_config(config.kafka.bootstrap_servers, config.kafka.producer)
    options = {f"kafka.{k}": _librdkafka_value(v) for k, v in client.items()}
    if topics is not None:
        options["subscribe"] = ",".join(topics)
    if pattern is not None:
        options["subscribePattern"] = pattern
    options.update(extra or {})
    return options


def schema_catalog(config: CdcdConfig, options: Mapping[str, str]) -> SchemaCatalog:
    """The writer schemas of ``config``'s topics, read with the connection of source ``options``."""
    from cdcd.spark.source import KafkaOptions

    kafka = KafkaOptions.from_options(options)
    return SchemaCatalog(
        config.kafka.topic_prefix,
        bootstrap_servers=kafka.bootstrap_servers,
        client_config=kafka.client_config,
        timeout_s=kafka.probe_timeout_s,
        registry_url=config.schema_registry.url,
        registry_config=config.schema_registry.config,
    )


def read_changes(
    spark: SparkSession,
    config: CdcdConfig | str | os.PathLike[str],
    table: str,
    *,
    streaming: bool = False,
    source: Source = "auto",
    options: Mapping[str, str] | None = None,
) -> DataFrame:
    """The decoded change stream of one captured table (``schema.table``).

    Columns: see :mod:`cdcd.spark.decode`; records written with older
    schemas are resolved to the reader schema as :mod:`cdcd.spark.layout`
    says (defaults fill added columns, aliases follow renames). Batch reads
    cover the topic from ``startingOffsets`` (default earliest) to
    ``endingOffsets`` (default: the probed end); streaming reads start at
    ``startingOffsets`` (default earliest) and follow the topic. ``options``
    adds or overrides source options.
    """
    from cdcd.spark.autocdc import KEY_METADATA
    from cdcd.spark.dataframes import decode_changes, header_summary, newest_key_header
    from cdcd.spark.decode import DecodePlan
    from cdcd.spark.layout import key_columns

    if not isinstance(config, CdcdConfig):
        config = load_config(Path(config))
    schema, name = split_table(table, default_schema="public")
    topic = config.table_topic(schema, name)
    opts = kafka_options(config, topics=[topic], extra=options)
    catalog = schema_catalog(config, opts)
    raw = read_raw(spark, opts, streaming=streaming, source=source)
    if streaming:
        latest = catalog.latest(topic)
        if latest is None:
            raise DefiniteError(
                f"no schema of {schema}.{name} (topic {topic}) has been published yet",
                hint="start the query after the table's first change, or read in batch",
            )
        # Executors re-read _schemas per task: the query outlives this plan.
        plan = DecodePlan.build(
            topic, latest[1], catalog.known(topic), catalog.schema, catalog.refresh
        )
    else:
        uses = [use for use in header_summary(raw) if use.topic == topic]
        if not uses:
            latest = catalog.latest(topic)
            if latest is None:
                raise DefiniteError(f"topic {topic} holds no changes of {schema}.{name}")
            writers = {latest[0]: latest[1]}
            reader = latest[1]
        else:
            writers = {use.header: catalog.schema(use.header) for use in uses}
            reader = writers[max(uses, key=lambda use: use.version).header]
        plan = DecodePlan.build(topic, reader, writers, catalog.schema)
        decoded = decode_changes(raw, plan)
        # The key columns, for apply_changes' default keys (a batch read only:
        # a streaming query cannot look at its data first).
        header = newest_key_header(raw, topic)
        key = key_columns(catalog.schema(header)) if header is not None else ()
        metadata = {KEY_METADATA: json.dumps(list(key))}
        return decoded.withMetadata("after", metadata).withMetadata("before", metadata)
    return decode_changes(raw, plan)
