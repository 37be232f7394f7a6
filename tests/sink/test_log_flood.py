"""An unreachable broker: one log line per distinct librdkafka error, then the final error.

Before: ``cdcd check`` printed ~195 identical librdkafka ERROR lines and
``cdcd run`` ~580 (issue 12). The CLI run is a real process against the test's
PostgreSQL and a loopback port where nothing listens. It is also the suite's
check that an unreachable broker is exit 1 for ``run`` (SPEC §2), with one
error line and no traceback. ``cdcd check`` now keeps librdkafka's lines out of
its output altogether: tests/ops/test_check_output.py.

The flood comes sooner than in production, the rules for logging it are the
same: librdkafka reconnects every few milliseconds (``reconnect.backoff.*``
in the test's ``kafka.producer``, which every client cdcd makes connects
with), the Kafka step gives up as soon as every broker is down, and the
startup retries for 4 s (a hook): several sessions, each with new clients,
in about 5 s instead of 33. The summary lines per interval are
tests/sink/test_reporter.py's.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT, SHORT_STARTUP_RETRY, cdcd_argv, write_config

from cdcd.tools.local import LocalBroker

pytestmark = pytest.mark.integration

LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<level>[A-Z]+) (?P<logger>\S+) (?P<message>.*)$"
)
SUMMARY = re.compile(
    r"^(?P<text>.*) \(repeated (?:(?P<n>\d+) (?:more )?times|once(?: more)?)"
    r"(?: in the last \d+ s)?\)$"
)


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def same_error(message: str) -> str:
    """What stays the same between librdkafka's repeats of one error (its own rules, not cdcd's)."""
    message = re.sub(r"after \d+ms", "after Nms", message)
    return re.sub(r"\[[\w.-]+#(producer|consumer)-\d+\] ", "", message)


def kafka_errors(messages: list[str]) -> dict[str, tuple[int, int, int]]:
    """Per distinct error: plain lines, summary lines, occurrences a reader adds up."""
    out: dict[str, tuple[int, int, int]] = {}
    for message in messages:
        match = SUMMARY.match(message)
        key = same_error(match["text"] if match else message)
        plain, summaries, total = out.get(key, (0, 0, 0))
        if match:
            out[key] = (plain, summaries + 1, total + (int(match["n"]) if match["n"] else 1))
        else:
            out[key] = (plain + 1, summaries, total + 1)
    return out


def assert_few_lines(stderr: str, max_lines: int) -> dict[str, tuple[int, int, int]]:
    lines = stderr.splitlines()
    assert len(lines) <= max_lines, f"{len(lines)} lines on stderr, first:\n" + "\n".join(lines[:5])
    # Without the timestamp (and with librdkafka's "after 0ms" made equal), no
    # error comes back more than twice: the first occurrence and its summary.
    bodies = Counter(
        same_error(" ".join(m.group("level", "logger", "message")))
        for line in lines
        if (m := LOG_LINE.match(line)) and (m["level"] == "ERROR" or m["logger"] == "cdcd.kafka")
    )
    repeated = {body: n for body, n in bodies.items() if n > 2}
    assert not repeated, repeated
    kafka = [
        m["message"]
        for line in lines
        if (m := LOG_LINE.match(line)) and m["logger"] == "cdcd.kafka"
    ]
    errors = kafka_errors(kafka)
    for key, (plain, summaries, _) in errors.items():
        # Logged at once, then a summary per 30 s interval and a final one:
        # no run here lasts long enough for more.
        assert plain == 1, (key, kafka)
        assert summaries <= 2, (key, kafka)
    return errors


def refused_count(errors: dict[str, tuple[int, int, int]], port: int) -> int:
    return sum(
        total
        for key, (_, _, total) in errors.items()
        if f"Connect to ipv4#127.0.0.1:{port} failed: Connection refused" in key
    )


#: librdkafka's reconnect backoff (100 ms doubling to 10 s by default) in
#: milliseconds: the same errors, many more of them per second.
FAST_RECONNECT = {"reconnect.backoff.ms": 1, "reconnect.backoff.max.ms": 10}


def test_run_logs_each_librdkafka_error_once_then_the_final_error(pg: Any, tmp_path: Path) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "c.yaml", pg.dsn, f"127.0.0.1:{port}", kafka={"producer": FAST_RECONNECT}
    )
    result = subprocess.run(
        cdcd_argv("run", "-c", str(config), hooks=SHORT_STARTUP_RETRY),
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180, check=False,
    )
    # Exit 1 (SPEC §2: a restart may cure it) after the startup retries, with
    # one readable error line and no traceback.
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1].startswith(f"cdcd: error: cannot reach Kafka at 127.0.0.1:{port}"), lines[-5:]
    assert sum(line.startswith("cdcd: error:") for line in lines) == 1
    assert "Traceback" not in result.stderr, result.stderr
    # The sessions after the first made new clients, whose errors were not new.
    assert sum("reconnecting in" in line for line in lines) >= 1, result.stderr
    errors = assert_few_lines(result.stderr, max_lines=25)
    # A flood all the same: each session reconnects every few milliseconds until
    # every broker is down (about 80 refusals over three sessions here).
    assert refused_count(errors, port) >= 20, result.stderr


# ---------------------------------------------------------------- producer


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _wait(
    condition: Callable[[], bool], poll: Callable[[], object], timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        poll()


def test_producer_logs_an_outage_once_and_when_kafka_is_reachable_again(
    make_broker: Callable[..., LocalBroker],
) -> None:
    from cdcd.sink.producer import KafkaSink, build_producer_config
    from cdcd.sink.reporter import KafkaLogReporter

    broker = make_broker()
    broker.stop()
    handler = _Collect()
    logger = logging.getLogger("test.log_flood.producer")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    reporter = KafkaLogReporter(logger)  # production interval; private to this test
    sink = KafkaSink(
        build_producer_config(broker.bootstrap_servers, {}, "flood"), reporter=reporter
    )
    results: list[Any] = []
    try:
        sink.produce("flood", b"k", b"before", [], lambda err, msg: results.append(err))
        # librdkafka retries the connection (with backoff): wait for repeats.
        _wait(lambda: reporter.pending() >= 5, lambda: sink.poll(0.1), 60, "repeated errors")
        assert reporter.outage
        sink.produce("flood", b"k", b"during", [], lambda err, msg: results.append(err))
        broker.restart()
        _wait(lambda: len(results) == 2, lambda: sink.poll(0.1), 60, "both deliveries")
    finally:
        sink.close(10)
        logger.removeHandler(handler)
    assert results == [None, None]
    messages = [record.getMessage() for record in handler.records]
    errors = kafka_errors([m for m in messages if "reachable again" not in m])
    for key, (plain, _, _) in errors.items():
        assert plain == 1, (key, messages)
    refused = [total for key, (_, _, total) in errors.items() if "Connection refused" in key]
    assert refused and refused[0] >= 6, messages
    reachable = [r for r in handler.records if "reachable again" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in reachable] == [
        (logging.INFO, f"Kafka at {broker.bootstrap_servers} is reachable again")
    ]
    assert handler.records[-1] is reachable[0]  # the repeat counts come before it
    assert not reporter.outage
