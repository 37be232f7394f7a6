"""One log line per distinct Kafka client error, with repeat counts.

Why: librdkafka reports a broker it cannot reach on every reconnect attempt,
through its log callback and again through its error callback; with an
unreachable broker ``cdcd run`` printed ~580 identical ERROR lines before its
one-line error. Every Kafka client cdcd creates (the producer and the admin
clients of ``check_broker``/``ensure_topics``) routes both callbacks to one
reporter per process (:data:`KAFKA_REPORTER`), so that a client created again
by the next session does not log the same error again.

What is logged, per distinct error:

- its first occurrence, at once, as librdkafka wrote it. Occurrences are the
  same error when their text is after :func:`error_key`, which blanks what
  varies between repeats (durations, timestamps, broker ids, counters, the
  client and thread names);
- then at most one line per ``interval_s``: the first text plus
  "(repeated N times in the last S s)";
- the repeats not yet counted in a line when :meth:`KafkaLogReporter.flush`
  runs (the CLI calls :func:`flush_kafka_reports` before its last line) or
  when Kafka is reachable again (:meth:`KafkaLogReporter.reachable`, after a
  metadata request or a delivery succeeded), which also logs one INFO line;
  an error that comes back after that is logged as new.

Debug and info messages (``debug``/``log_level`` in ``kafka.producer``) pass
through unchanged: the operator asked for them. Only librdkafka's messages
are logged; never the client configuration, which may hold SASL passwords.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import KafkaError

__all__ = [
    "AUTH_CODES", "KAFKA_REPORTER", "SASL_CODES", "KafkaLogReporter", "error_key", "flush_kafka_reports",
]

INTERVAL_S = 30.0
"""A repeated error gets at most one summary line per this many seconds."""

FORGET_AFTER_S = 600.0
"""An error that has not recurred for this long is logged as new when it does."""

_MAX_ENTRIES = 256  # distinct errors remembered; bounds memory when texts never repeat

# Parts of librdkafka messages that differ between repeats of one error.
_NORMALISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^\s*\[thrd:[^\]]*\]:\s*"), ""),  # the thread that logged it
    (re.compile(r",?\s*\d+ identical error\(s\) suppressed"), ""),
    (
        re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?"),
        "<time>",
    ),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(ms|us|µs|s)\b"), r"N\1"),  # durations
    (re.compile(r"(:\d+)/\d+\b"), r"\1/N"),  # host:port/<broker id>
    (re.compile(r"\bbroker \d+\b"), "broker N"),
    (re.compile(r"\b\d+/\d+ brokers\b"), "N/N brokers"),
    (re.compile(r"\b\d+ (in-flight|retry-queued|out-queue|partially-sent)\b"), r"N \1"),
    (re.compile(r"#\d+\b(?!\.)"), "#N"),  # "timeout #3", not "ipv4#127.0.0.1"
    (re.compile(r"#(producer|consumer)-\d+\b"), r"#\1-N"),  # client instance names
)

# error_cb codes that mean "no broker answers".
_OUTAGE_CODES = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._RESOLVE,
        KafkaError._TIMED_OUT,
    }
)
#: Codes that mean the broker refused cdcd's SASL credentials or mechanism.
SASL_CODES = frozenset(
    {
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError._AUTHENTICATION,
        KafkaError.ILLEGAL_SASL_STATE,
        KafkaError.UNSUPPORTED_SASL_MECHANISM,
    }
)
#: error_cb codes that mean the broker refused cdcd's credentials or TLS.
AUTH_CODES = SASL_CODES | {KafkaError._SSL}


def error_key(text: str) -> str:
    """What identifies an error across repeats: ``text`` with the varying parts blanked."""
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    return text.strip()


@dataclass(slots=True)
class _Entry:
    text: str
    """The first occurrence, as logged."""
    level: int
    outage: bool
    """Whether it means Kafka is unreachable (cleared by :meth:`KafkaLogReporter.reachable`)."""
    since: float
    """When the last line for this error was logged."""
    last_seen: float
    via_log: bool
    """Seen through the log callback: then its error callback twins are not counted."""
    pending: int = 0
    """Occurrences not yet counted in a line."""


class KafkaLogReporter:
    """Rate-limits librdkafka's log and error callbacks (see the module docstring).

    Usable as a client's ``logger`` (confluent-kafka calls
    ``log(level, "%s [%s] %s", facility, client, message)``, possibly from
    librdkafka's threads: the state is locked, lines are logged outside the
    lock). ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        interval_s: float = INTERVAL_S,
        forget_after_s: float = FORGET_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger if logger is not None else logging.getLogger("cdcd.kafka")
        self.interval_s = interval_s
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.outage = False
        """Some error since the last :meth:`reachable` said Kafka is unreachable.

        A plain attribute: the producer reads it for every message.
        """

    # ------------------------------------------------------------ callbacks

    def log(self, level: int, msg: str, *args: object) -> None:
        """librdkafka's ``logger`` callback."""
        if level < logging.WARNING:
            self.logger.log(level, msg, *args)
            return
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):
            # An exception here would surface from the client's poll().
            text = " ".join([msg, *map(str, args)])
        # The key leaves out the facility and the client's name: the error
        # callback reports the same message without them.
        self.report(level, text, key=str(args[-1]) if args else text)

    def kafka_error(self, err: KafkaError, *, fatal_what: str = "Kafka client") -> None:
        """librdkafka's ``error_cb``: reported like the log line it usually duplicates."""
        code = err.code()
        if err.fatal():
            # Never merged with an earlier non-fatal error of the same text.
            self.report(
                logging.ERROR,
                f"{fatal_what} fatal error: {err.name()} ({err.str()})",
                key=f"fatal {err.name()} {err.str()}",
                error_cb=True,
            )
        elif code in AUTH_CODES:
            self.report(
                logging.ERROR,
                f"Kafka authentication/TLS error: {err.str()}",
                key=err.str(),
                error_cb=True,
            )
        else:
            self.report(
                logging.WARNING,
                f"Kafka error: {err.name()} ({err.str()})",
                key=err.str(),
                outage=code in _OUTAGE_CODES,
                error_cb=True,
            )

    # ---------------------------------------------------------------- core

    def report(
        self,
        level: int,
        text: str,
        *,
        key: str | None = None,
        outage: bool | None = None,
        error_cb: bool = False,
    ) -> None:
        """One occurrence of an error: logged if new, counted otherwise.

        ``key`` (default ``text``) identifies the error after :func:`error_key`;
        ``outage`` (default: level ERROR or above) says it means Kafka is
        unreachable. ``error_cb``: it comes from the error callback, which
        librdkafka calls for the same event as a log line; an error seen
        through both is counted once per event, from the log callback.
        """
        ident = error_key(text if key is None else key)
        is_outage = level >= logging.ERROR if outage is None else outage
        now = self._clock()
        lines: list[tuple[int, str]] = []
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None and now - entry.last_seen > self.forget_after_s:
                self._take_summary(entry, entry.last_seen, lines)
                del self._entries[ident]
                entry = None
            if entry is None:
                if len(self._entries) >= _MAX_ENTRIES:
                    oldest = min(self._entries, key=lambda k: self._entries[k].last_seen)
                    self._take_summary(self._entries.pop(oldest), now, lines)
                self._entries[ident] = _Entry(text, level, is_outage, now, now, not error_cb)
                lines.append((level, text))
            else:
                entry.last_seen = now
                entry.outage = entry.outage or is_outage
                if error_cb and entry.via_log:
                    pass  # the twin of a log line, which is counted
                elif not error_cb and not entry.via_log:
                    entry.via_log = True  # the log twin of the error callback counted
                else:
                    entry.pending += 1
                    if now - entry.since >= self.interval_s:
                        self._take_summary(entry, now, lines)
            self.outage = self.outage or is_outage
        self._emit(lines)

    def flush(self) -> None:
        """Log the repeats not counted yet (at shutdown); the errors stay known."""
        lines: list[tuple[int, str]] = []
        now = self._clock()
        with self._lock:
            for entry in self._entries.values():
                self._take_summary(entry, now, lines)
        self._emit(lines)

    def reachable(self, bootstrap_servers: str) -> None:
        """Kafka answered: close the errors that said it is unreachable, with one INFO line.

        Does nothing unless such an error was reported since the last call.
        """
        if not self.outage:
            return
        lines: list[tuple[int, str]] = []
        now = self._clock()
        with self._lock:
            if not self.outage:
                return
            for ident, entry in list(self._entries.items()):
                if entry.outage:
                    self._take_summary(entry, now, lines)
                    del self._entries[ident]
            self.outage = False
        lines.append((logging.INFO, f"Kafka at {bootstrap_servers} is reachable again"))
        self._emit(lines)

    def pending(self) -> int:
        """Occurrences not yet counted in a line (for tests and diagnostics)."""
        with self._lock:
            return sum(entry.pending for entry in self._entries.values())

    # ------------------------------------------------------------- helpers

    @staticmethod
    def _take_summary(entry: _Entry, now: float, lines: list[tuple[int, str]]) -> None:
        if entry.pending:
            window = now - entry.since
            if window >= 1.0:
                times = "once" if entry.pending == 1 else f"{entry.pending} times"
                what = f"repeated {times} in the last {window:.0f} s"
            else:
                # Admin clients deliver their queued messages all at once: a
                # summary right after an interval's line covers no time.
                what = (
                    "repeated once more"
                    if entry.pending == 1
                    else f"repeated {entry.pending} more times"
                )
            lines.append((entry.level, f"{entry.text} ({what})"))
        entry.pending = 0
        entry.since = now

    def _emit(self, lines: list[tuple[int, str]]) -> None:
        for level, line in lines:
            self.logger.log(level, "%s", line)


KAFKA_REPORTER = KafkaLogReporter()
"""The process's reporter: every Kafka client cdcd creates logs through it."""


def flush_kafka_reports() -> None:
    """Log the uncounted repeats of the process's reporter (before the CLI's last line)."""
    KAFKA_REPORTER.flush()
