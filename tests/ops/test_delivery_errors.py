"""``cdcd_delivery_errors_total`` counts every message Kafka did not take.

The critical alert ``CdcdDeliveryErrors`` (deploy/prometheus/cdcd-rules.yaml)
fires on any increase, so the counter must move on each kind of failure:

- a failed delivery report, seen through the running daemon: the broker is
  frozen so a message times out (``message.timeout.ms``), the session fails
  with a transient error and the daemon reconnects, keeping /metrics up, so
  the test reads the counter from the live process (and the reconnect's
  ``reason``, ``delivery``), then lets it recover;
- a ``produce()`` that librdkafka refuses at once (larger than the producer's
  ``message.max.bytes``; tansu enforces no broker-side limit, INFRA.md), with
  a real producer. Such an error is definite: the daemon exits 3 right after,
  so that path is checked on the sink the daemon uses, not through /metrics;
- every failed report counts, not only the first the tracker keeps, and
  messages cdcd itself purged on close do not count.
"""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from support.cdc import DaemonProcess, wait_for, write_config
from support.kafka import consume_all
from support.pg import PgDatabase, current_wal_lsn

from cdcd.ack.tracker import AckTracker
from cdcd.errors import DefiniteError
from cdcd.observability.metrics import Metrics
from cdcd.protocol.lsn import Lsn
from cdcd.sink.producer import KafkaSink, build_producer_config
from cdcd.sink.topics import TopicSpec, ensure_topics
from cdcd.tools.local import LocalBroker, free_port

_names = itertools.count(1)


def _metrics() -> Metrics:
    return Metrics(CollectorRegistry(), process_collectors=False)


def _errors(metrics: Metrics, topic: str) -> float | None:
    return metrics.registry.get_sample_value("cdcd_delivery_errors_total", {"topic": topic})


@dataclass
class _Scrape:
    errors: dict[str, float]  # cdcd_delivery_errors_total by topic
    confirmed: float  # cdcd_confirmed_lsn_bytes
    reconnects: dict[str, float]  # cdcd_reconnects_total by reason


def _scrape(base_url: str) -> _Scrape:
    """What the daemon's /metrics says now."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as response:
        body = response.read().decode()
    scrape = _Scrape({}, 0.0, {})
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "cdcd_delivery_errors_total":
                scrape.errors[sample.labels["topic"]] = sample.value
            elif sample.name == "cdcd_confirmed_lsn_bytes":
                scrape.confirmed = sample.value
            elif sample.name == "cdcd_reconnects_total":
                scrape.reconnects[sample.labels["reason"]] = sample.value
    return scrape


@pytest.mark.integration
def test_failed_delivery_report_is_counted_on_the_running_daemon(
    pg: PgDatabase, make_broker: Callable[..., LocalBroker], tmp_path: Path
) -> None:
    broker = make_broker()  # frozen below: not the session's broker
    pg.execute("CREATE TABLE orders(id bigserial PRIMARY KEY, note text NOT NULL)")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    topic = f"{pg.dbname}.public.orders"
    config = write_config(
        tmp_path / "cdcd.yaml",
        pg.dsn,
        broker.bootstrap_servers,
        prefix=pg.dbname,
        slot="cdcd_" + pg.dbname[:50],
        tables=["public.orders"],
        # A message waiting on a frozen broker fails after 1.5 s instead of 5 min.
        kafka={"producer": {"message.timeout.ms": 1500}},
        extra={"metrics": {"listen": f"127.0.0.1:{port}"}, "heartbeat": {"interval_s": 0}},
    )
    conn = pg.connect()
    daemon = DaemonProcess(config, tmp_path / "daemon.log")

    def scrape() -> _Scrape:
        assert daemon.alive(), daemon.log()[-3000:]
        try:
            return _scrape(base_url)
        except OSError:
            return _Scrape({}, 0.0, {})  # not listening yet

    def confirmed_past(lsn: int) -> bool:
        return scrape().confirmed >= lsn

    def streaming() -> bool:
        assert daemon.alive(), daemon.log()[-3000:]
        try:
            with urllib.request.urlopen(base_url + "/readyz", timeout=5) as response:
                return bool(response.status == 200)
        except OSError:  # not listening yet, or 503
            return False

    try:
        wait_for(streaming, timeout_s=60, what="/readyz 200")
        # Streaming and delivering: the topic's series exists, at 0.
        pg.execute("INSERT INTO orders(note) VALUES ('before')")
        target = current_wal_lsn(conn)
        wait_for(lambda: confirmed_past(target), timeout_s=60, what="the first row confirmed")
        assert scrape().errors[topic] == 0

        broker.freeze()
        try:
            pg.execute("INSERT INTO orders(note) VALUES ('during the outage')")
            # The daemon stays up (a timeout is transient: it reconnects), so
            # /metrics can be read for as long as it takes.
            wait_for(
                lambda: scrape().errors.get(topic, 0.0) >= 1,
                timeout_s=60,
                what=f"cdcd_delivery_errors_total{{topic={topic!r}}} >= 1",
            )
        finally:
            broker.thaw()
        counted = scrape().errors
        assert counted[topic] >= 1
        assert counted[f"{pg.dbname}._schemas"] == 0  # other topics' series stay at 0
        assert "_MSG_TIMED_OUT" in daemon.log()
        # The session that failed on it is restarted as a delivery failure.
        wait_for(
            lambda: scrape().reconnects.get("delivery", 0.0) >= 1,
            timeout_s=60,
            what='cdcd_reconnects_total{reason="delivery"} >= 1',
        )
        assert scrape().reconnects["other"] == 0, daemon.log()[-3000:]

        # It recovers: the row is delivered after the reconnect.
        target = current_wal_lsn(conn)
        wait_for(lambda: confirmed_past(target), timeout_s=120, what="recovery")
        assert daemon.terminate() == 0, daemon.log()[-3000:]
        values = [m.value() for m in consume_all(broker.bootstrap_servers, topic, expected=2)]
        assert any(v is not None and b"during the outage" in v for v in values), values
    finally:
        if daemon.alive():
            daemon.kill9()


def _sink(broker: LocalBroker, metrics: Metrics, **props: Any) -> KafkaSink:
    return KafkaSink(
        build_producer_config(broker.bootstrap_servers, props, "cdcd-test"),
        on_failed_delivery=metrics.delivery_error,
    )


@pytest.mark.integration
def test_refused_produce_is_counted(broker: LocalBroker) -> None:
    topic = f"delivery_errors_{next(_names)}"
    ensure_topics(broker.bootstrap_servers, [TopicSpec(topic, 1, 1)], 10)
    metrics = _metrics()
    metrics.delivery_errors_for(topic)
    sink = _sink(broker, metrics, **{"message.max.bytes": 10_000})
    tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
    ticket = tracker.open()
    try:
        ticket.add()
        sink.produce(topic, b"k", b"small", [], ticket.on_delivery)
        ticket.add()
        with pytest.raises(DefiniteError, match="MSG_SIZE_TOO_LARGE"):
            sink.produce(topic, b"k", b"x" * 20_000, [], ticket.on_delivery)
        assert _errors(metrics, topic) == 1
        assert sink.flush(10) == 0  # the small one is delivered, and not counted
        assert _errors(metrics, topic) == 1
    finally:
        sink.close(5)


class _Message:
    """What a delivery report's ``msg`` offers the classifier."""

    def __init__(self, topic: str) -> None:
        self._topic = topic

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b"v"


@pytest.mark.integration
def test_every_failed_report_is_counted_but_not_purges(broker: LocalBroker) -> None:
    metrics = _metrics()
    sink = _sink(broker, metrics)
    try:
        tracker = AckTracker(Lsn(0), classify=sink.delivery_failure)
        ticket = tracker.open()
        ticket.add(4)
        ticket.on_delivery(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), _Message("a"))
        ticket.on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT), _Message("a"))
        ticket.on_delivery(KafkaError(KafkaError._PURGE_QUEUE), _Message("b"))
        ticket.on_delivery(KafkaError(KafkaError._PURGE_INFLIGHT), _Message("b"))
        assert isinstance(tracker.failure, DefiniteError)  # the first one is kept
        assert _errors(metrics, "a") == 2  # ... and each one is counted
        assert _errors(metrics, "b") is None
    finally:
        sink.close(5)
