"""The ``reason`` label of ``cdcd_reconnects_total`` is a closed set (issue 15).

Exception class names made the label set unbounded (any library's class could
appear) and renamed themselves with the libraries. The daemon now maps each
transient error to one of a few documented values, and the metric counts
anything else as ``other``. Checked here: the metric exposes exactly the
documented values from the start and never another; cdcd's real error
classifiers land on the right value; a real daemon whose walsender is
terminated reports ``postgres`` (a Kafka delivery timeout reporting
``delivery`` is checked in test_delivery_errors.py).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import psycopg2
import psycopg2.errors
import pytest
from confluent_kafka import KafkaError, KafkaException
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from support.cdc import wait_for

from cdcd.errors import TransientError
from cdcd.observability.metrics import Metrics
from cdcd.sink.producer import ProducerFatalError, classify_delivery_report
from cdcd.source.connection import query_failure
from cdcd.source.replication import classify_stream_error
from cdcd.source.slot_holder import SlotInUseError
from cdcd.tools.local import free_port

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _documented_reasons() -> set[str]:
    """The first column of the table under "### Reconnect reasons"."""
    lines = OPERATIONS.read_text().splitlines()
    start = lines.index("### Reconnect reasons")
    reasons: set[str] = set()
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        match = re.match(r"\| `([a-z_]+)` \|", line)
        if match:
            reasons.add(match.group(1))
    assert reasons, "no reason values documented for cdcd_reconnects_total"
    return reasons


def _exposed_reasons(metrics: Metrics) -> dict[str, float]:
    return {
        sample.labels["reason"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "cdcd_reconnects"
        for sample in family.samples
        if sample.name == "cdcd_reconnects_total"
    }


def _metrics() -> Metrics:
    return Metrics(CollectorRegistry(), process_collectors=False)


def test_every_documented_reason_exists_at_zero_and_no_other() -> None:
    # At 0 from the start: increase() in CdcdReconnectStorm needs a sample
    # before the first reconnect, and the docs list exactly these values.
    exposed = _exposed_reasons(_metrics())
    assert set(exposed) == _documented_reasons()
    assert "other" in exposed
    assert set(exposed.values()) == {0.0}


def test_an_unknown_reason_is_counted_as_other() -> None:
    metrics = _metrics()
    metrics.reconnect("postgres")
    metrics.reconnect("OperationalError")  # what the daemon used to pass
    metrics.reconnect("OperationalError")
    exposed = _exposed_reasons(metrics)
    assert "OperationalError" not in exposed
    assert exposed["postgres"] == 1
    assert exposed["other"] == 2
    assert set(exposed) == _documented_reasons()


def _raised(
    exc: BaseException, *, by: str = __name__, cause: BaseException | None = None
) -> BaseException:
    """``exc`` as the daemon catches it after code of module ``by`` raised it.

    The daemon names errors that carry no library exception by the module that
    raised them; compiling the ``raise`` under that module's name reproduces
    exactly what the traceback then holds.
    """
    code = compile("raise exc from cause" if cause else "raise exc", f"<{by}>", "exec")
    try:
        exec(code, {"__name__": by, "exc": exc, "cause": cause})
    except BaseException as caught:  # noqa: BLE001 - the point is to catch what was raised
        return caught
    raise AssertionError("not raised")


def _stream_failure(exc: psycopg2.Error) -> BaseException:
    """What ``ReplicationStream`` raises for ``exc`` (``raise classify... from exc``)."""
    return _raised(classify_stream_error(exc, "s"), by="cdcd.source.replication", cause=exc)


def _query_failure(exc: psycopg2.Error) -> BaseException:
    """What ``SourceDatabase.query`` raises for ``exc``."""
    return _raised(query_failure(exc, "SELECT 1"), by="cdcd.source.connection", cause=exc)


REAL_ERRORS: list[tuple[str, BaseException, str]] = [
    (
        "walsender terminated",
        _stream_failure(
            psycopg2.errors.AdminShutdown("terminating connection due to administrator command")
        ),
        "postgres",
    ),
    (
        "connection lost",
        _query_failure(psycopg2.OperationalError("server closed the connection unexpectedly")),
        "postgres",
    ),
    (
        "connection already closed",
        _query_failure(psycopg2.InterfaceError("connection already closed")),
        "postgres",
    ),
    (
        "statement timeout",
        _query_failure(psycopg2.errors.QueryCanceled("canceling statement due to timeout")),
        "postgres_timeout",
    ),
    (
        "lock timeout",
        _query_failure(psycopg2.errors.LockNotAvailable("could not obtain lock")),
        "postgres_timeout",
    ),
    (
        "slot active for another walsender",
        _stream_failure(
            psycopg2.errors.ObjectInUse('replication slot "s" is active for PID 4242')
        ),
        "slot_in_use",
    ),
    (
        "slot held at start",
        _raised(SlotInUseError("slot s is active for PID 4242"), by="cdcd.pipeline.session"),
        "slot_in_use",
    ),
    (
        "status update failed (libpq, no Python exception behind it)",
        _raised(TransientError("sending standby status failed: EOF"), by="cdcd.source.feedback"),
        "postgres",
    ),
    (
        "broker request failed",
        _raised(
            TransientError("creating topic 'x' failed"),
            by="cdcd.sink.topics",
            cause=KafkaException(KafkaError(KafkaError._TRANSPORT)),
        ),
        "kafka",
    ),
    (
        "broker unreachable, detected by cdcd",
        _raised(TransientError("cannot reach 127.0.0.1:9092 within 10 s"), by="cdcd.sink.topics"),
        "kafka",
    ),
    (
        "idempotent producer failed",
        _raised(ProducerFatalError("the idempotent Kafka producer failed"), by="cdcd.sink.producer"),
        "kafka",
    ),
    (
        "delivery report timed out (raised by the session from the ack tracker)",
        _raised(
            classify_delivery_report(KafkaError(KafkaError._MSG_TIMED_OUT), None),
            by="cdcd.pipeline.session",
        ),
        "delivery",
    ),
    (
        "schema registry unreachable",
        _raised(
            TransientError("schema registry unreachable"),
            by="cdcd.envelope.wire",
            cause=ConnectionRefusedError(111, "Connection refused"),
        ),
        "schema_registry",
    ),
    ("raised anywhere else", _raised(TransientError("something new")), "other"),
    ("never raised", TransientError("no traceback"), "other"),
]


@pytest.mark.parametrize(
    ("exc", "reason"), [(exc, reason) for _, exc, reason in REAL_ERRORS],
    ids=[what for what, _, _ in REAL_ERRORS],
)
def test_reason_of_each_transient_error(exc: BaseException, reason: str) -> None:
    from cdcd.daemon import reconnect_reason

    assert isinstance(exc, TransientError), exc  # what the daemon retries
    assert reconnect_reason(exc) == reason
    assert reason in _documented_reasons()


def test_every_reason_is_reachable() -> None:
    """No documented value is dead: each is what some real error maps to."""
    assert {reason for _, _, reason in REAL_ERRORS} == _documented_reasons()


@pytest.mark.integration
def test_a_terminated_walsender_is_counted_as_postgres(pg, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    port = free_port()
    daemon = daemons(
        cdc_config(tables=["public.t"], extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    )
    slot = "cdcd_" + pg.dbname[:50]

    def walsender() -> int | None:
        row = pg.fetchone(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
        )
        return None if row is None else int(row[0])

    pid = wait_for(walsender, what="streaming")
    pg.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def reasons() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
        return {
            sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(body)
            if family.name == "cdcd_reconnects"
            for sample in family.samples
            if sample.name == "cdcd_reconnects_total"
        }

    seen = wait_for(
        lambda: (r := reasons()).get("postgres", 0) >= 1 and r,
        what='cdcd_reconnects_total{reason="postgres"} >= 1',
    )
    assert daemon.alive(), daemon.log()
    assert set(seen) == _documented_reasons(), (seen, daemon.log())
    assert seen["other"] == 0, daemon.log()
    assert daemon.terminate() == 0, daemon.log()
