"""KafkaLogReporter: one line per distinct librdkafka error, repeat counts, a fake clock."""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.sink.reporter import KafkaLogReporter, error_key

CONNECT = (
    "[thrd:127.0.0.1:9092/{id}]: 127.0.0.1:9092/{id}: Connect to ipv4#127.0.0.1:9092 failed: "
    "Connection refused (after {ms}ms in state CONNECT{suppressed})"
)
TIMEOUT = "[thrd:10.0.0.7:9093/{id}]: 10.0.0.7:9093/{id}: Timed out {n} in-flight, 0 retry-queued, 0 out-queue, 0 partially-sent requests"
RESOLVE = "[thrd:main]: Failed to resolve 'kafka-{id}.example:9092': Name or service not known (after {ms}ms in state CONNECT)"
FAMILIES = (CONNECT, TIMEOUT, RESOLVE)

SUMMARY = re.compile(
    r"^(?P<text>.*) \(repeated (?:(?P<n>\d+) (?:more )?times|once(?: more)?)"
    r"(?: in the last (?P<s>\d+) s)?\)$"
)


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Lines(logging.Handler):
    """The records a reporter logs, with the fake time they were logged at."""

    clock: FakeClock
    records: list[tuple[float, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        logging.Handler.__init__(self)

    def __hash__(self) -> int:
        return id(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.clock.now, record.levelno, record.getMessage()))

    @property
    def texts(self) -> list[str]:
        return [text for _, _, text in self.records]


_loggers = iter(range(1_000_000))


def make(
    interval_s: float = 30.0, forget_after_s: float = 600.0
) -> tuple[KafkaLogReporter, FakeClock, Lines]:
    clock = FakeClock()
    lines = Lines(clock)
    logger = logging.getLogger(f"test.reporter.{next(_loggers)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(lines)
    reporter = KafkaLogReporter(
        logger, interval_s=interval_s, forget_after_s=forget_after_s, clock=clock
    )
    return reporter, clock, lines


def librdkafka_log(
    reporter: KafkaLogReporter, body: str, level: int = logging.ERROR, client: int = 1
) -> None:
    """What confluent-kafka calls on a client's ``logger``."""
    reporter.log(level, "%s [%s] %s", "FAIL", f"rdkafka#producer-{client}", body)


def connect(ms: int = 0, broker: str = "bootstrap", suppressed: int = 0) -> str:
    extra = f", {suppressed} identical error(s) suppressed" if suppressed else ""
    return CONNECT.format(id=broker, ms=ms, suppressed=extra)


def counted(lines: Lines, text_contains: str) -> int:
    """Occurrences a log reader can add up: first lines count 1, summaries their N."""
    total = 0
    for text in lines.texts:
        if text_contains not in text:
            continue
        match = SUMMARY.match(text)
        total += (int(match["n"]) if match["n"] else 1) if match else 1
    return total


# ------------------------------------------------------------------ examples


def test_first_occurrence_at_once_then_one_summary_per_interval_then_flush() -> None:
    reporter, clock, lines = make()
    librdkafka_log(reporter, connect())
    assert len(lines.records) == 1
    assert lines.records[0][1] == logging.ERROR
    assert lines.texts[0].startswith("FAIL [rdkafka#producer-1] [thrd:127.0.0.1:9092/bootstrap]")
    for step in range(1, 300):  # every 100 ms for 29.9 s
        clock.now = 1000.0 + step * 0.1
        librdkafka_log(reporter, connect(ms=step % 3))
    assert len(lines.records) == 1, lines.texts
    clock.now = 1030.0
    librdkafka_log(reporter, connect(ms=7))
    assert len(lines.records) == 2
    assert lines.texts[1] == lines.texts[0] + " (repeated 300 times in the last 30 s)"
    clock.now = 1041.0
    librdkafka_log(reporter, connect())
    librdkafka_log(reporter, connect())
    assert len(lines.records) == 2
    reporter.flush()
    assert lines.texts[2] == lines.texts[0] + " (repeated 2 times in the last 11 s)"
    reporter.flush()  # nothing new: nothing logged
    assert len(lines.records) == 3


def test_summary_right_after_a_batch_says_more() -> None:
    reporter, clock, lines = make()
    for _ in range(5):
        librdkafka_log(reporter, connect())
    reporter.flush()
    assert lines.texts[1] == lines.texts[0] + " (repeated 4 more times)"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (connect(ms=0), connect(ms=10_003)),
        (connect(broker="1"), connect(broker="2")),
        (connect(), connect(suppressed=17)),
        (TIMEOUT.format(id=1, n=3), TIMEOUT.format(id=2, n=12)),
        ("0/2 brokers are down", "1/1 brokers are down"),
        (
            "Metadata request failed: Local: Timed out (60003ms)",
            "Metadata request failed: Local: Timed out (59998ms)",
        ),
        (
            "Timed out MetadataRequest in flight (after 60001ms, timeout #0)",
            "Timed out MetadataRequest in flight (after 60213ms, timeout #4)",
        ),
        ("broker 1 at 2026-11-23T05:26:14.292Z: down", "broker 3 at 2026-11-23T05:27:01Z: down"),
        ("client rdkafka#producer-1 failed", "client rdkafka#producer-12 failed"),
        ("client cdcd#producer-1 failed", "client cdcd#producer-3 failed"),
    ],
)
def test_repeats_that_differ_only_in_varying_parts_are_one_error(a: str, b: str) -> None:
    assert error_key(a) == error_key(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (connect(), connect().replace("Connection refused", "Connection timed out")),
        (connect(), connect().replace("127.0.0.1:9092", "127.0.0.2:9092")),
        (connect(), connect().replace("9092", "9093")),
        (RESOLVE.format(id=1, ms=1), RESOLVE.format(id=2, ms=1)),
        ("Connect to ipv4#10.0.0.1:9092 failed", "Connect to ipv4#10.0.0.2:9092 failed"),
    ],
)
def test_different_errors_stay_distinct(a: str, b: str) -> None:
    assert error_key(a) != error_key(b)


def test_error_callback_twin_of_a_log_line_is_counted_once() -> None:
    reporter, clock, lines = make()
    body = connect()
    twin = KafkaError(KafkaError._TRANSPORT, body.split("]: ", 1)[1])
    for _ in range(10):  # librdkafka reports each failed attempt through both callbacks
        librdkafka_log(reporter, body)
        reporter.kafka_error(twin)
    for _ in range(5):  # and the other order
        reporter.kafka_error(twin)
        librdkafka_log(reporter, body)
    reporter.flush()
    assert len(lines.records) == 2, lines.texts
    assert lines.texts[1].endswith("(repeated 14 more times)")


def test_error_callback_alone_is_counted() -> None:
    reporter, clock, lines = make()
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")
    for _ in range(4):
        reporter.kafka_error(down)
    reporter.flush()
    assert lines.texts == [
        "Kafka error: _ALL_BROKERS_DOWN (1/1 brokers are down)",
        "Kafka error: _ALL_BROKERS_DOWN (1/1 brokers are down) (repeated 3 more times)",
    ]
    assert lines.records[0][1] == logging.WARNING
    assert reporter.outage


def test_fatal_error_is_never_merged_with_an_earlier_one() -> None:
    reporter, clock, lines = make()
    reporter.kafka_error(KafkaError(KafkaError._TRANSPORT, "broker: gone"))
    reporter.kafka_error(
        KafkaError(KafkaError._TRANSPORT, "broker: gone", fatal=True), fatal_what="Kafka producer"
    )
    assert lines.texts[1] == "Kafka producer fatal error: _TRANSPORT (broker: gone)"
    assert lines.records[1][1] == logging.ERROR


def test_reachable_logs_uncounted_repeats_and_one_info_line_then_forgets() -> None:
    reporter, clock, lines = make()
    librdkafka_log(reporter, connect())
    reporter.log(
        logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "[thrd:app]: odd property"
    )
    clock.now += 5
    librdkafka_log(reporter, connect())
    reporter.log(
        logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "[thrd:app]: odd property"
    )
    assert reporter.outage
    reporter.reachable("k1:9092")
    assert lines.texts[2:] == [
        lines.texts[0] + " (repeated once in the last 5 s)",
        "Kafka at k1:9092 is reachable again",
    ]
    assert lines.records[-1][1] == logging.INFO
    assert not reporter.outage
    reporter.reachable("k1:9092")  # nothing was unreachable since: silent
    assert len(lines.records) == 4
    librdkafka_log(reporter, connect())  # the outage is new again: logged at once
    assert lines.texts[4] == lines.texts[0]
    # The warning is no outage: still known, still only counted.
    reporter.log(
        logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-2", "[thrd:app]: odd property"
    )
    reporter.flush()
    assert lines.texts[5:] == [
        "CONFWARN [rdkafka#producer-1] [thrd:app]: odd property (repeated 2 times in the last 5 s)"
    ]


def test_only_warnings_make_no_reachable_line() -> None:
    reporter, clock, lines = make()
    reporter.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "[thrd:app]: odd")
    reporter.reachable("k1:9092")
    assert len(lines.records) == 1


def test_debug_and_info_pass_through_unchanged() -> None:
    reporter, clock, lines = make()
    for _ in range(3):
        reporter.log(
            logging.DEBUG, "%s [%s] %s", "BROKER", "rdkafka#producer-1", "[thrd:main]: state UP"
        )
        reporter.log(
            logging.INFO, "%s [%s] %s", "INIT", "rdkafka#producer-1", "[thrd:main]: started"
        )
    assert len(lines.records) == 6
    assert reporter.pending() == 0


def test_an_error_quiet_for_long_is_logged_as_new() -> None:
    reporter, clock, lines = make(forget_after_s=600.0)
    librdkafka_log(reporter, connect())
    librdkafka_log(reporter, connect())
    clock.now += 601
    librdkafka_log(reporter, connect())
    assert lines.texts == [lines.texts[0], lines.texts[0] + " (repeated once more)", lines.texts[0]]


def test_concurrent_callbacks_lose_no_occurrence() -> None:
    reporter, clock, lines = make()

    def hammer(client: int) -> None:
        for i in range(500):
            librdkafka_log(reporter, connect(ms=i % 7), client=client)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reporter.flush()
    assert len(lines.records) == 2
    assert counted(lines, "Connection refused") == 2000


# ------------------------------------------------------------------ properties

events = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=20.0, allow_nan=False),  # seconds since the previous
        st.integers(min_value=0, max_value=len(FAMILIES) - 1),  # which error
        st.integers(min_value=0, max_value=99_999),  # the varying number
        st.booleans(),  # whether a flush follows
    ),
    max_size=150,
)


def _key_of_line(text: str) -> str:
    """The error a logged line is about: its librdkafka message, without a summary suffix."""
    match = SUMMARY.match(text)
    body = (match["text"] if match else text).split("] ", 1)[1]  # after "FAIL [client]"
    return error_key(body)


@settings(max_examples=200, deadline=None)
@given(events=events, interval_s=st.sampled_from([1.0, 30.0, 45.0]))
def test_every_occurrence_is_counted_once_and_lines_stay_few(
    events: list[tuple[float, int, int, bool]], interval_s: float
) -> None:
    reporter, clock, lines = make(interval_s=interval_s, forget_after_s=10_000.0)
    seen: dict[str, int] = {}
    first_at: dict[str, float] = {}
    flushes = 0
    for dt, family, number, flush in events:
        clock.now += dt
        before = len(lines.records)
        body = FAMILIES[family].format(id=number % 3, ms=number, n=number, suppressed="")
        key = error_key(body)
        librdkafka_log(reporter, body)
        seen[key] = seen.get(key, 0) + 1
        if key not in first_at:
            first_at[key] = clock.now
            # The first occurrence of a distinct error is never held back.
            assert len(lines.records) == before + 1
            assert lines.texts[-1].endswith(body)
        if flush:
            reporter.flush()
            flushes += 1
    reporter.flush()
    flushes += 1
    assert {_key_of_line(text) for text in lines.texts} == set(seen)
    for key, occurrences in seen.items():
        mine = [text for text in lines.texts if _key_of_line(text) == key]
        # No error swallowed: a reader adding up the lines gets every occurrence.
        total = sum(
            (int(m["n"]) if m["n"] else 1) if (m := SUMMARY.match(text)) else 1 for text in mine
        )
        assert total == occurrences
        # One plain line per distinct error, the rest are summaries ...
        assert sum(1 for text in mine if not SUMMARY.match(text)) == 1
        # ... at most one per interval, besides those a flush asked for.
        span = clock.now - first_at[key]
        assert len(mine) <= 1 + span // interval_s + flushes


def test_a_malformed_log_call_does_not_raise() -> None:
    reporter, clock, lines = make()
    reporter.log(logging.ERROR, "%s %s", "only one")  # would raise in msg % args
    assert lines.texts == ["%s %s only one"]
