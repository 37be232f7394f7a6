"""Python cost per row of the whole in-process path, without the network.

The same objects the session wires (``PgOutputDecoder`` ->
``TransactionAssembler`` -> ``Publisher`` -> ``AckTracker``), fed with
transactions of 10 SPEC §9 ``orders`` Inserts captured from a real
PostgreSQL 15 walsender (``tests/protocol/golden/orders.json``) between
Begin/Commit messages with increasing LSNs. The producer is a stand-in that
queues each message's delivery callback and reports every queued one as
delivered on ``poll()``, once per 256 messages as the session does (with
the per-table metrics), so tickets complete and confirmation advances.

What it leaves out is what is not Python: librdkafka's ``produce()`` and
delivery reports, psycopg2's ``read_message``, and the broker. It is the
figure that tells whether a change to the Python path helped: the
end-to-end ``cdcd bench`` on a shared 2-core machine varies by ±15% from
run to run, this (min of 7 runs) by about 2%.

``--kafka-mock`` produces through the real ``KafkaSink`` instead, to
librdkafka's in-process mock cluster (``test.mock.num.brokers``): the
library's ``produce()``, delivery reports and broker thread are then in the
figure too, still without PostgreSQL or a network peer. It reports the
session thread's CPU (what ``cdcd bench`` calls ``cdcd-session``) apart from
the whole process's.

    .venv/bin/python -m tests.bench.bench_pipeline_cpu
    .venv/bin/python -m tests.bench.bench_pipeline_cpu --kafka-mock
"""

from __future__ import annotations

import argparse
import struct
import time
from collections.abc import Callable
from typing import Any

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.transactions import TransactionAssembler
from cdcd.protocol import Lsn, PgOutputDecoder
from cdcd.sink.producer import KafkaSink, build_producer_config, classify_delivery_report
from tests.bench.orders_golden import orders_payloads

ROWS_PER_TXN = 10
POLL_EVERY = 256


class _Wire:
    def header(self, topic: str, role: str, schema: dict[str, object]) -> bytes:
        return b"\xc3\x01" + b"\x00" * 8


class _Producer:
    """``KafkaSink.produce``/``poll``: every produced message is delivered on poll."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any, Any], None]] = []

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[Any, Any], None],
    ) -> None:
        self.callbacks.append(on_delivery)

    def produce_direct(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        on_delivery: Callable[[Any, Any], None],
        callback: None,
        timestamp: int,
        headers: list[tuple[str, bytes]],
    ) -> None:
        """``KafkaSink.produce_direct``: confluent-kafka's positional ``produce``."""
        self.callbacks.append(on_delivery)

    def poll(self, timeout: float = 0.0) -> int:
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(None, None)
        return len(callbacks)


def _stream(transactions: int) -> tuple[list[bytes], list[bytes]]:
    """(Relation payloads, the payloads of ``transactions`` transactions)."""
    relations, inserts = orders_payloads()
    payloads: list[bytes] = []
    lsn = 0x1_0000_0000
    for t in range(transactions):
        commit_lsn = lsn + 2000
        payloads.append(b"B" + struct.pack("!QqI", commit_lsn, 800_000_000_000_000 + t, 1000 + t))
        for i in range(ROWS_PER_TXN):
            payloads.append(inserts[(t * ROWS_PER_TXN + i) % len(inserts)])
        payloads.append(
            b"C" + struct.pack("!BQQq", 0, commit_lsn, commit_lsn + 48, 800_000_000_000_000 + t)
        )
        lsn = commit_lsn + 48
    return relations, payloads


def _mock_sink() -> KafkaSink:
    """A ``KafkaSink`` on librdkafka's mock cluster, with cdcd's producer configuration."""
    config = build_producer_config("localhost:9092", {}, "cdcd-bench")
    config["test.mock.num.brokers"] = 1
    config["log_level"] = 3  # the mock cluster announces itself at notice level
    return KafkaSink(config)


def _run(relations: list[bytes], payloads: list[bytes], mock: bool) -> tuple[float, float, Lsn]:
    """(process CPU s, this thread's CPU s, confirmed LSN) of one pass."""
    producer: Any = _mock_sink() if mock else _Producer()
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    cache = RelationCache(StaticCatalog(), key_lookup=lambda s, t: ("id",))
    publisher = Publisher(
        producer,  # type: ignore[arg-type]
        tracker,
        EnvelopeEncoder("pg", "app", _Wire()),
        _Wire(),  # type: ignore[arg-type]
        include=lambda s, t: True,
        ensure_topic=lambda topic: None,
        metrics=Metrics(process_collectors=False),
    )
    assembler = TransactionAssembler(cache, publisher, 1 << 30, None, 1)
    decoder = PgOutputDecoder(1)
    for payload in relations:
        assembler.feed(decoder.decode(payload), payload)
    decode = decoder.decode
    feed_batch = assembler.feed_batch
    # What ReplicationStream.read_batch returns: the payloads of up to POLL_EVERY messages.
    batches = [payloads[first : first + POLL_EVERY] for first in range(0, len(payloads), POLL_EVERY)]
    if mock:  # the topic's metadata, before the clock starts
        producer.produce("app.public.orders", None, b"", [], lambda err, msg: None)
        producer.flush(10.0)
    started, thread_started = time.process_time(), time.thread_time()
    for batch in batches:
        feed_batch(batch, decode)
        producer.poll(0)
        publisher.flush_metrics()
    if mock:
        producer.flush(30.0)
    producer.poll(0)
    elapsed = time.process_time() - started, time.thread_time() - thread_started
    if mock:
        producer.close(1.0)
    return elapsed[0], elapsed[1], tracker.confirmed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--kafka-mock", action="store_true", help="real KafkaSink, mock cluster")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    transactions = 10_000
    relations, payloads = _stream(transactions)
    rows = transactions * ROWS_PER_TXN
    best = best_thread = float("inf")
    confirmed = Lsn(0)
    for _ in range(args.runs):
        elapsed, thread, confirmed = _run(relations, payloads, args.kafka_mock)
        best, best_thread = min(best, elapsed), min(best_thread, thread)
    print(f"{rows:,} rows in transactions of {ROWS_PER_TXN}, confirmed to {confirmed}")
    what = "the real produce() and delivery reports, mock cluster" if args.kafka_mock else "produce call"
    print(f"decode + assemble + envelope + {what} + ack: "
          f"{best / rows * 1e6:.2f} µs/row of process CPU ({rows / best:,.0f} rows/s, min of {args.runs})")  # fmt: skip
    if args.kafka_mock:
        print(f"session thread alone: {best_thread / rows * 1e6:.2f} µs/row (min of {args.runs})")


if __name__ == "__main__":
    main()
