"""The ``cdcd-kafka`` data source and the reader API in a real SparkSession, against tansu.

tansu reports the base offset of a partition's last record batch plus one as
its high watermark; records here are produced in batches (``linger.ms``) so
that this is wrong, and every read must still see every record.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from support.kafka import create_topic

from cdcd.config.model import parse_config
from cdcd.tools.local import LocalBroker

pytest.importorskip("pyspark")

from spark.envelopes import (
    Col,
    EnvelopeFactory,
    Message,
    lsn_text,
    numeric,
    table_version,
)

pytestmark = [pytest.mark.spark, pytest.mark.integration]

INT4, INT8, TEXT, NUMERIC, DATE, TIME, TS, TSTZ = 23, 20, 25, 1700, 1082, 1083, 1114, 1184


def _produce(
    bootstrap: str, records: Iterable[tuple[str, int, bytes | None, bytes | None, list[Any]]]
) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 30, "acks": "all"})
    for topic, partition, key, value, headers in records:
        producer.produce(topic, key=key, value=value, partition=partition, headers=headers)
    assert producer.flush(30) == 0


def _publish(bootstrap: str, factory: EnvelopeFactory, messages: list[Message]) -> None:
    create_topic(
        bootstrap, f"{factory.prefix}._schemas", 1, {"cleanup.policy": "compact"}, exist_ok=True
    )
    for topic in {m.topic for m in messages}:
        create_topic(bootstrap, topic, factory.partitions, exist_ok=True)
    _produce(
        bootstrap,
        [
            (f"{factory.prefix}._schemas", 0, k.encode(), v.encode(), [])
            for k, v in factory.published.items()
        ],
    )
    _produce(
        bootstrap,
        [
            (
                m.topic,
                m.partition,
                m.key,
                m.value,
                [("cdcd.lsn", lsn_text(m.lsn)), ("cdcd.seq", str(m.seq).encode())],
            )
            for m in messages
        ],
    )


def _topic_with_records(broker: LocalBroker, count: int) -> str:
    topic = f"src-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, topic, 3)
    _produce(
        broker.bootstrap_servers,
        [
            (topic, i % 3, f"k{i}".encode(), f"v{i}".encode(), [("n", str(i).encode())])
            for i in range(count)
        ],
    )
    return topic


def test_batch_read_sees_every_record_despite_the_watermark(
    spark: Any, broker: LocalBroker
) -> None:
    from cdcd.spark.reader import kafka_source_available, read_raw
    from cdcd.spark.source import KafkaClient, KafkaOptions

    topic = _topic_with_records(broker, 90)
    options = {"kafka.bootstrap.servers": broker.bootstrap_servers, "subscribe": topic}
    with KafkaClient(KafkaOptions.from_options(options)) as client:
        reported = {p: client.watermarks(topic, p)[1] for p in range(3)}
        probed = client.probe_ends([(topic, p) for p in range(3)])
    assert probed == {(topic, p): 30 for p in range(3)}
    print(f"broker-reported high watermarks {reported}, probed ends 30 each")

    assert not kafka_source_available(spark)  # no spark-sql-kafka jars here: the bundled source
    rows = read_raw(spark, options).collect()
    assert len(rows) == 90
    by_key = {bytes(r["key"]): r for r in rows}
    for i in range(90):
        row = by_key[f"k{i}".encode()]
        assert bytes(row["value"]) == f"v{i}".encode()
        assert row["partition"] == i % 3 and row["offset"] == i // 3
        assert [(h["key"], bytes(h["value"])) for h in row["headers"]] == [("n", str(i).encode())]
        assert row["timestampType"] == 0 and row["timestamp"] is not None

    ranged = read_raw(
        spark,
        {
            **options,
            "startingOffsets": f'{{"{topic}": {{"0": 10, "1": -2}}}}',
            "endingOffsets": f'{{"{topic}": {{"0": 20, "1": 5, "2": -1}}}}',
        },  # fmt: skip
    ).collect()
    counts = {p: sum(1 for r in ranged if r["partition"] == p) for p in range(3)}
    assert counts == {0: 10, 1: 5, 2: 30}


def test_streaming_available_now_batches_and_resumes(
    spark: Any, broker: LocalBroker, tmp_path: Path
) -> None:
    from cdcd.spark.reader import read_raw

    topic = _topic_with_records(broker, 60)
    options = {
        "kafka.bootstrap.servers": broker.bootstrap_servers,
        "subscribe": topic,
        "maxOffsetsPerTrigger": "25",
    }
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def collect(frame: Any, batch_id: int) -> None:
        with lock:
            seen.extend(
                (r["partition"], r["offset"]) for r in frame.select("partition", "offset").collect()
            )

    def run() -> int:
        query = (
            read_raw(spark, options, streaming=True)
            .writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None
        return len([p for p in query.recentProgress if p["numInputRows"]])

    batches = run()
    assert sorted(seen) == sorted((p, o) for p in range(3) for o in range(20))
    assert batches >= 3  # 60 offsets at most 25 per trigger

    seen.clear()
    _produce(broker.bootstrap_servers, [(topic, i % 3, b"k", b"more", []) for i in range(9)])
    run()  # resumes from the checkpoint: only the new records
    assert sorted(seen) == sorted((p, o) for p in range(3) for o in range(20, 23))


def test_pattern_subscription_picks_up_new_topics(
    spark: Any, broker: LocalBroker, tmp_path: Path
) -> None:
    from cdcd.spark.reader import read_raw

    stem = f"pat{uuid.uuid4().hex[:6]}"
    _produce_first = f"{stem}.a"
    create_topic(broker.bootstrap_servers, _produce_first, 1)
    _produce(broker.bootstrap_servers, [(_produce_first, 0, None, b"1", [])])
    name = f"q_{stem}"
    query = (
        read_raw(
            spark,
            {
                "kafka.bootstrap.servers": broker.bootstrap_servers,
                "subscribePattern": rf"{stem}\..*",
            },
            streaming=True,
        )  # fmt: skip
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="1 second")
        .start()
    )
    try:
        later = f"{stem}.b"
        create_topic(broker.bootstrap_servers, later, 2)
        _produce(broker.bootstrap_servers, [(later, p, None, b"2", []) for p in (0, 1)])
        deadline = time.monotonic() + 60
        while spark.table(name).count() < 3:
            assert time.monotonic() < deadline, spark.table(name).collect()
            assert query.exception() is None, query.exception()
            time.sleep(1)
        topics = sorted(r["topic"] for r in spark.table(name).collect())
        assert topics == [f"{stem}.a", f"{stem}.b", f"{stem}.b"]
    finally:
        query.stop()


def _evolving_table(prefix: str) -> tuple[EnvelopeFactory, list[Message]]:
    factory = EnvelopeFactory(prefix=prefix)
    v1 = table_version("public", "orders", [
        Col("id", INT4, key=True), Col("amount", NUMERIC, numeric(12, 2)), Col("placed", TSTZ),
        Col("local", TS), Col("day", DATE), Col("at", TIME), Col("grid", 1007, dims=2)])  # fmt: skip
    v2 = table_version("public", "orders", [
        Col("id", INT4, key=True), Col("amount", NUMERIC, numeric(12, 2)), Col("placed", TSTZ),
        Col("local", TS), Col("day", DATE), Col("at", TIME), Col("grid", 1007, dims=2),
        Col("note", TEXT)], version=2)  # fmt: skip
    row = [
        "12.50",
        "2024-01-02 03:04:05+00",
        "2024-01-02 03:04:05",
        "2024-02-29",
        "01:00:00",
        "{{1,2}}",
    ]
    for i in range(5):
        factory.change(v1, "c", after=[str(i), *row], lsn=100 + i, seq=0)
    for i in range(5, 8):
        factory.change(v2, "c", after=[str(i), *row, f"n{i}"], lsn=200 + i, seq=0)
    factory.change(v2, "d", before=["0", *[None] * 7], lsn=300, seq=0)
    return factory, factory.messages


def test_read_changes_decodes_with_the_newest_schema(
    spark: Any, broker: LocalBroker, tmp_path: Path
) -> None:
    from pyspark.sql import types as T

    from cdcd.spark.reader import read_changes

    prefix = f"rc{uuid.uuid4().hex[:6]}"
    factory, messages = _evolving_table(prefix)
    _publish(broker.bootstrap_servers, factory, messages)
    config = parse_config(
        {
            "postgres": {"dsn": "host=x"},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers, "topic_prefix": prefix},
        }
    )

    changes = read_changes(spark, config, "public.orders")
    after = changes.schema["after"].dataType
    assert after["amount"].dataType == T.DecimalType(12, 2)
    assert after["placed"].dataType == T.TimestampType()
    assert after["local"].dataType == T.TimestampNTZType()
    assert after["day"].dataType == T.DateType()
    assert after["at"].dataType == T.LongType()
    assert after["grid"].dataType == T.ArrayType(T.ArrayType(T.IntegerType()))
    assert after["note"].dataType == T.StringType()  # the newest schema's column
    rows = sorted(changes.collect(), key=lambda r: (r["lsn"], r["seq"]))
    assert [r["op"] for r in rows] == ["c"] * 8 + ["d"]
    first = rows[0]["after"]
    assert first["amount"] == Decimal("12.50") and first["note"] is None
    assert first["placed"].astimezone(UTC) == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert first["local"] == datetime(2024, 1, 2, 3, 4, 5) and first["day"] == date(2024, 2, 29)
    assert first["at"] == 3_600_000_000 and first["grid"] == [[1, 2]]
    assert rows[5]["after"]["note"] == "n5"
    assert rows[-1]["before"]["id"] == 0

    name = f"changes_{prefix}"
    query = (
        read_changes(spark, config, "public.orders", streaming=True)
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    assert spark.table(name).count() == 9
    assert spark.table(name).where("after.note = 'n7'").count() == 1
