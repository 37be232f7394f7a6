"""The daemon around replication sessions: signals, retries, health, systemd.

``run`` keeps one ``Session`` going until SIGTERM/SIGINT. A session that
fails with a ``TransientError`` (PostgreSQL restarting, connection lost,
broker unavailable, a delivery that timed out) is replaced by a new one after
a capped exponential backoff; it resumes at the slot's confirmed position, so
nothing is lost and at most the unconfirmed tail is delivered twice. A
``DefiniteError`` ends the daemon with exit code 3 and one line that says what
to change (2 for a ``ConfigError``, e.g. a metrics address that cannot be
bound); transient failures that last the whole startup retry window end it
with exit code 1, since a restart may cure them. On a stop signal the session
drains in-flight messages, confirms what was delivered and the daemon exits 0.

Under systemd (``Type=notify``) the daemon reports READY once streaming,
pings the watchdog from the main loop (so a wedged loop gets restarted) and
reports STOPPING on shutdown; without systemd these are no-ops.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import psycopg2
import psycopg2.errors
from confluent_kafka import KafkaException

from cdcd.config.model import CdcdConfig
from cdcd.errors import ConfigError, DefiniteError, StartupRetriesExhausted, TransientError
from cdcd.observability import systemd
from cdcd.observability.http import Health, MetricsServer, parse_listen
from cdcd.observability.http import start as start_http
from cdcd.observability.metrics import Metrics, ReconnectReason
from cdcd.pipeline.parts import real_parts
from cdcd.pipeline.session import Session, SessionState
from cdcd.pipeline.startup import describe_bind_error, listen_error
from cdcd.sink.producer import ProducerFatalError
from cdcd.source.slot_holder import SlotInUseError

log = logging.getLogger("cdcd.daemon")

BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
#: A session that streamed this long resets the backoff.
BACKOFF_RESET_AFTER_S = 60.0
#: Before the first session ever streamed, transient failures are retried for
#: this long, then the daemon exits 1 (not 3: a server that is down may come
#: back, so systemd/Kubernetes restart policies take over).
STARTUP_RETRY_S = 30.0


#: The exception types behind a transient error, most specific first: the
#: first rule that matches any exception in the chain names the reason.
#: ObjectInUse is what the walsender answers while another connection holds
#: the slot (SQLSTATE 55006).
_TYPE_REASONS: tuple[tuple[tuple[type[BaseException], ...], ReconnectReason], ...] = (
    ((SlotInUseError, psycopg2.errors.ObjectInUse), "slot_in_use"),
    ((psycopg2.errors.QueryCanceled, psycopg2.errors.LockNotAvailable), "postgres_timeout"),
    ((psycopg2.Error,), "postgres"),
    ((ProducerFatalError, KafkaException), "kafka"),
)

#: For errors cdcd detects itself (no PostgreSQL or Kafka exception behind
#: them, e.g. a libpq status update that failed, a delivery report with an
#: error): the module that raised it. The session raises such errors only
#: for messages Kafka did not acknowledge (a failed delivery report, a schema
#: publication that timed out), hence ``delivery``.
_ORIGIN_REASONS: tuple[tuple[str, ReconnectReason], ...] = (
    ("cdcd.source.", "postgres"),
    ("cdcd.snapshot.", "postgres"),
    ("cdcd.envelope.wire", "schema_registry"),
    ("cdcd.sink.", "kafka"),
    ("cdcd.pipeline.session", "delivery"),
    ("cdcd.pipeline.parts", "delivery"),  # a schema publication that timed out
)


#: What to check when startup retries run out, by what failed (reconnect_reason).
_STARTUP_HINTS: dict[str, str] = {
    "postgres": "check postgres.dsn and that PostgreSQL is up and accepts the connection",
    "postgres_timeout": "check postgres.dsn and that PostgreSQL answers (it timed out)",
    "slot_in_use": "stop the other client of the slot, or set another postgres.slot",
    "kafka": "check kafka.bootstrap_servers and that the brokers are up",
    "schema_registry": "check schema_registry.url and that the registry is up",
    "delivery": "check kafka.bootstrap_servers and the brokers' health",
    "other": "check postgres.dsn and kafka.bootstrap_servers",
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions behind it, in the order a traceback shows them."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )


def _raised_in(exc: BaseException) -> str:
    """The module of the frame that raised ``exc`` (the innermost traceback entry)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", ""))


def reconnect_reason(exc: BaseException) -> ReconnectReason:
    """The ``reason`` label of ``cdcd_reconnects_total`` for a transient ``exc``.

    A closed vocabulary (``RECONNECT_REASONS``, explained in
    docs/operations.md): exception class names would make the label set
    unbounded and change whenever a library renames a class.
    """
    chain = list(_chain(exc))
    for types, reason in _TYPE_REASONS:
        if any(isinstance(link, types) for link in chain):
            return reason
    origin = _raised_in(exc)
    for prefix, reason in _ORIGIN_REASONS:
        if origin.startswith(prefix):
            return reason
    return "other"


def startup_hint(exc: BaseException) -> str:
    """What to do when ``exc`` still fails at the end of the startup retry window."""
    remedy = getattr(exc, "hint", None)  # e.g. SlotInUseError knows what to do
    return remedy or _STARTUP_HINTS.get(reconnect_reason(exc), _STARTUP_HINTS["other"])


class _DaemonState(SessionState):
    """Session state whose heartbeat also feeds /healthz and the systemd watchdog."""

    def __init__(self, health: Health, watchdog: systemd.Watchdog) -> None:
        super().__init__()
        self._health = health
        self._watchdog = watchdog

    def beat(self) -> None:
        super().beat()
        self._health.beat()
        self._watchdog.kick()


class Daemon:
    def __init__(self, config: CdcdConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.health = Health()
        self.stop = threading.Event()
        self.state = _DaemonState(self.health, systemd.Watchdog())
        self._ready_notified = False
        self.server: MetricsServer | None = None
        self.parts = real_parts(config)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.stop.is_set():
            log.info("received %s: draining and stopping", signal.Signals(signum).name)
            systemd.notify_stopping("draining in-flight messages")
        self.stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_streaming(self, streaming: bool) -> None:
        self.health.set_ready(streaming, None if streaming else "not streaming")
        if streaming and not self._ready_notified:
            systemd.notify_ready("streaming")
            self._ready_notified = True

    def run(self) -> int:
        """Run sessions until stopped; returns the exit code."""
        retry_window_s = STARTUP_RETRY_S
        listen = self.config.metrics.listen
        try:
            self.server = start_http(listen, self.metrics, self.health)
        except ConfigError:
            raise
        except DefiniteError as exc:
            # start_http could not bind: the configured address is the mistake
            # (in use, not local, not permitted), so exit 2, not 3.
            # `cdcd check` says the same (the startup plan's metrics step).
            cause = exc.__cause__
            host = parse_listen(listen)[0]
            reason = describe_bind_error(host, cause) if isinstance(cause, OSError) else str(exc)
            raise listen_error(listen, reason) from exc
        backoff = BACKOFF_INITIAL_S
        daemon_started = time.monotonic()
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                # Each session starts with the startup plan (cdcd.pipeline.startup)
                # and makes its connections anew from the parts.
                session = Session(
                    self.config,
                    self.stop,
                    self.metrics,
                    self.state,
                    self._on_streaming,
                    parts=self.parts,
                )
                try:
                    session.run()
                except TransientError as exc:
                    if self.stop.is_set():
                        break
                    reason = reconnect_reason(exc)
                    elapsed = time.monotonic() - daemon_started
                    if not self.state.ever_streamed and elapsed >= retry_window_s:
                        raise StartupRetriesExhausted(
                            f"{getattr(exc, 'message', exc)} "
                            f"(still failing after {elapsed:.0f} s of retries at startup)",
                            hint=startup_hint(exc),
                        ) from exc
                    if time.monotonic() - started > BACKOFF_RESET_AFTER_S:
                        backoff = BACKOFF_INITIAL_S
                    if not self.state.ever_streamed:
                        # The last retry comes at the end of the window, not before it.
                        backoff = max(0.0, min(backoff, retry_window_s - elapsed))
                    self.metrics.reconnect(reason)
                    log.warning(
                        "%s; reconnecting in %.0f s", exc, backoff, extra={"reason": reason}
                    )
                    self.health.set_ready(False, f"reconnecting: {exc}")
                    # Waiting on the event keeps the stop signal responsive.
                    deadline = time.monotonic() + backoff
                    while not self.stop.is_set() and time.monotonic() < deadline:
                        self.state.beat()
                        self.stop.wait(min(1.0, deadline - time.monotonic()))
                    backoff = min(max(backoff, BACKOFF_INITIAL_S) * 2, BACKOFF_MAX_S)
                    continue
                break
        finally:
            self.health.set_ready(False, "stopped")
            if self.server is not None:
                self.server.stop()
        return 0
