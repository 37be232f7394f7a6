"""One run of ``cdcd demo``: start the servers and the daemon, stream, stop in order.

Signals (one Ctrl-C: orderly stop; two: skip the waits; three: abort), the
status line from the daemon's metrics, and the final count check.
"""


from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any, TextIO

from cdcd.config.model import CdcdConfig, parse_config
from cdcd.daemon import Daemon
from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.naming import (
    schemas_topic,
    table_topic,
)
from cdcd.observability.metrics import Metrics
from cdcd.protocol.lsn import Lsn
from cdcd.tail import describe_change, format_value, remember_row
from cdcd.tools.demo.console import Console, Stopping, format_bytes
from cdcd.tools.demo.feed import (
    REORDER_HOLD_S,
    ChangeFeed,
    DecodedChange,
    by_op,
    count_mismatches,
    covers,
)
from cdcd.tools.demo.workload import SCHEMA_SQL, Workload
from cdcd.tools.local import BrokerSetupError, LocalBroker, LocalPostgres, PostgresSetupError

#: Names of everything the demo creates; fixed, because the servers are private.
DATABASE = "demo"
PREFIX = "demo"
SLOT = "cdcd_demo"
PUBLICATION = "cdcd_demo"
TABLES = ("public.customers", "public.orders")

#: Seconds between status lines: often enough to watch the figures move,
#: rarely enough not to drown the changes.
STATUS_EVERY_S = 5.0

#: How long the orderly stop waits for the daemon and the consumer to catch up.
CATCH_UP_TIMEOUT_S = 15.0
#: How long to wait for the daemon to stream after it was started.
STREAMING_TIMEOUT_S = 60.0

def demo_config(dsn: str, bootstrap: str) -> CdcdConfig:
    """The configuration the daemon runs with: what a user would write in cdcd.yaml."""
    return parse_config(
        {
            "postgres": {
                "dsn": dsn,
                "slot": SLOT,
                "publication": PUBLICATION,
                "tables": list(TABLES),
            },
            "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": PREFIX, "partitions": 3},
            # The tables are created empty right before the daemon starts.
            "snapshot": {"mode": "never"},
            "metrics": {"listen": "127.0.0.1:0"},
            "heartbeat": {"interval_s": 10},
        },
        "demo configuration",
    )


class Demo:
    """One run of ``cdcd demo``; :meth:`run` returns the exit code."""

    def __init__(self, duration: float | None, debug: bool, stream: TextIO) -> None:
        self.duration = duration
        self.debug = debug
        self.out = Console(stream)
        self.stop = threading.Event()
        self.hurry = threading.Event()
        self._signals = 0
        self.metrics = Metrics()
        self.pg: LocalPostgres | None = None
        self.broker: LocalBroker | None = None
        self.daemon: Daemon | None = None
        self._daemon_thread: threading.Thread | None = None
        self._daemon_error: BaseException | None = None
        self.workload: Workload | None = None
        self.feed: ChangeFeed | None = None
        self.shown = 0
        self._last_lsn: int | None = None
        #: Last version of each row seen, by (table, key): what a downstream
        #: mirror holds; updates without a full ``before`` are diffed against it.
        self._mirror: dict[tuple[str, str], Mapping[str, Any]] = {}
        self._stopping_shown = False
        self._last_status = (0.0, 0.0, 0.0, 0.0)  # time, events, latency sum, latency count

    # -- signals ----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """First signal: orderly stop. Second: skip the waits. Third Ctrl-C: abort.

        The abort is a ``KeyboardInterrupt`` in the main thread, so the
        cleanup still runs (and ``cdcd.tools.local``'s at-exit handlers behind it).
        SIGTERM never gets its default action: that would leave the servers,
        which run in their own sessions, behind. Nothing is printed here: the
        main thread may be in the middle of writing a line.
        """
        self._signals += 1
        if self._signals == 1:
            self.stop.set()
            return
        if not self.hurry.is_set():
            self.hurry.set()
            if signal.getsignal(signal.SIGINT) == self._on_signal:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.daemon is not None:
            self.daemon.stop.set()

    @contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """Route SIGINT/SIGTERM to an orderly stop while the demo runs (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # A SIGINT ignored at startup (a job started with `&` by a script) stays
        # ignored, as for any program; SIGTERM always stops the demo.
        signals = [signal.SIGTERM]
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signals.append(signal.SIGINT)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise Stopping

    # -- run --------------------------------------------------------------------------

    def run(self) -> int:
        """Start everything, stream until stopped, clean up; returns the exit code."""
        cdcd_log = logging.getLogger("cdcd")
        level = cdcd_log.level
        if not self.debug:
            # The daemon's INFO lines (slot resumed, HTTP listening...) would
            # interleave with the changes; warnings and errors still show.
            cdcd_log.setLevel(logging.WARNING)
        try:
            return self._run()
        finally:
            cdcd_log.setLevel(level)

    def _run(self) -> int:
        out = self.out
        out.line(
            out.paint("cdcd demo", "1") + ": PostgreSQL -> cdcd -> Kafka, all on this machine."
        )
        out.line(
            "  A throwaway PostgreSQL and broker; everything is removed when it stops (Ctrl-C)."
        )
        out.line()
        with self._signal_handlers():
            # Callbacks are registered as things start and unwind in reverse:
            # consumer, daemon, broker, PostgreSQL -- also when startup fails.
            with ExitStack() as cleanup:
                try:
                    self._start(cleanup)
                    result = self._stream()
                except Stopping:
                    out.line()
                    out.line("  interrupted during startup")
                    result = 0
                finally:
                    self._announce_stopping()
                    self._stop_workload()
            if self._daemon_error is not None:
                # The daemon failed while stopping (e.g. it could not drain).
                self._raise_daemon_error()
        if self.workload is None:
            return result  # stopped before anything ran: no advice needed
        out.line()
        out.line(
            out.paint("Next:", "1") + " describe your own database in a cdcd.yaml "
            "(docs/configuration.md), then"
        )
        out.line("  cdcd check -c cdcd.yaml && cdcd run -c cdcd.yaml")
        out.line(
            "or try your own tables on a local PostgreSQL and broker that keep running: "
            "cdcd local up"
        )
        return result

    def _start(self, cleanup: ExitStack) -> None:
        out = self.out
        try:
            with out.step("starting PostgreSQL 15 ...") as info:
                pg = self.pg = LocalPostgres.start()
                cleanup.callback(self._remove, "PostgreSQL", pg.cleanup, pg.base_dir)
                info.append(f"{pg.host}:{pg.port}  files in {pg.base_dir}")
            self._check_stop()
            with out.step("starting the Kafka broker (tansu) ...") as info:
                broker = self.broker = LocalBroker.start()
                cleanup.callback(self._remove, "broker", broker.cleanup, broker.base_dir)
                info.append(f"{broker.bootstrap_servers}  files in {broker.base_dir}")
        except (PostgresSetupError, BrokerSetupError) as exc:
            if self.stop.is_set():
                raise Stopping from exc
            first = str(exc).strip().splitlines()[0]
            raise DefiniteError(
                f"demo: {first}", hint="run `cdcd --debug demo` for the full output"
            ) from exc
        self._check_stop()
        with out.step("creating the sample tables ...") as info:
            pg.create_database(DATABASE)
            pg.execute(SCHEMA_SQL, dbname=DATABASE)
            info.append(f"database {DATABASE}: {', '.join(TABLES)}")
        self._check_stop()
        with out.step("starting cdcd ...") as info:
            config = demo_config(pg.dsn(DATABASE), broker.bootstrap_servers)
            daemon = self._start_daemon(cleanup, config)
            info.append(f"streaming from slot {SLOT}, publication {PUBLICATION}")
        self.feed = ChangeFeed(config)
        # Registered after the daemon: closed before it and the broker stop.
        cleanup.callback(self._close_feed)
        self._check_stop()

        server = daemon.server
        assert server is not None  # _start_daemon waited for it
        out.line()
        out.line(f"  {'metrics':<9}{server.url}/metrics   (and /healthz, /readyz)")
        out.line(
            f"  {'topics':<9}{table_topic(PREFIX, 'public', 'customers')}, "
            f"{table_topic(PREFIX, 'public', 'orders')}; writer schemas in {schemas_topic(PREFIX)}"
        )
        if shutil.which("psql"):
            out.line(f'  {"psql":<9}psql "{pg.dsn(DATABASE)}"   (your own changes show up too)')
        out.line(
            f"  {'stop':<9}"
            + (f"after {self.duration:g} s, or Ctrl-C" if self.duration is not None else "Ctrl-C")
        )
        out.line()
        for note in (
            "op: c insert, u update, d delete.  lsn #n: the commit LSN and the change's position",
            "in its transaction; lines sharing an LSN are one transaction. Each delete is followed",
            "by a tombstone (null value, for compaction): counted, not shown. orders has REPLICA",
            "IDENTITY FULL: its updates and deletes carry the old row. customers sends only its",
            "key, so the demo compares its updates with the last version it saw.",
        ):
            out.line(out.paint("  " + note, "2"))
        out.line()

    def _start_daemon(self, cleanup: ExitStack, config: CdcdConfig) -> Daemon:
        """Run the real daemon in a thread and wait until it streams."""
        daemon = self.daemon = Daemon(config, self.metrics)

        def run() -> None:
            try:
                daemon.run()
            except BaseException as exc:  # noqa: BLE001 - the main thread raises it
                self._daemon_error = exc

        thread = self._daemon_thread = threading.Thread(target=run, name="cdcd-daemon", daemon=True)
        thread.start()
        cleanup.callback(self._stop_daemon)
        deadline = time.monotonic() + STREAMING_TIMEOUT_S
        while not (daemon.state.streaming and daemon.server is not None):
            self._raise_daemon_error()
            if self.stop.is_set():
                raise Stopping
            if time.monotonic() > deadline:
                raise DefiniteError(
                    f"demo: cdcd did not start streaming within {STREAMING_TIMEOUT_S:.0f} s",
                    hint="run `cdcd --debug demo` to see its log",
                )
            time.sleep(0.05)
        return daemon

    def _raise_daemon_error(self) -> None:
        """Raise what ended the daemon thread, if it ended without being asked to."""
        thread = self._daemon_thread
        if thread is None or thread.is_alive():
            return
        error = self._daemon_error
        if isinstance(error, CdcdError):
            raise error
        if error is not None:
            raise DefiniteError(f"demo: the cdcd daemon failed: {error!r}") from error
        if self.daemon is not None and not self.daemon.stop.is_set():
            raise DefiniteError("demo: the cdcd daemon stopped unexpectedly")

    def _stream(self) -> int:
        """Write, consume and print until stopped; then let everything catch up."""
        assert self.pg is not None and self.feed is not None
        pg = self.pg
        workload = self.workload = Workload(lambda: pg.connect(DATABASE), self.stop)
        workload.start()
        started = time.monotonic()
        self._last_status = (started, 0.0, 0.0, 0.0)
        next_status = started + STATUS_EVERY_S
        while not self.stop.is_set():
            self.feed.poll(0.1)
            self._print_ready()
            self._raise_daemon_error()
            if workload.error is not None:
                raise DefiniteError(
                    f"demo: the sample workload failed: {workload.error}"
                ) from workload.error
            now = time.monotonic()
            if now >= next_status:
                self._status(now)
                next_status = now + STATUS_EVERY_S
            if self.duration is not None and now - started >= self.duration:
                self.stop.set()
        self._announce_stopping()
        workload.join(10.0)
        if workload.error is not None:
            raise DefiniteError(
                f"demo: the sample workload failed: {workload.error}"
            ) from workload.error
        return 0 if self._catch_up() else 1

    def _published(self) -> Counter[tuple[str, str]]:
        """Envelopes the daemon produced so far (``cdcd_events_total``), by (table, op)."""
        return Counter(self.metrics.events_by_table_op())

    def _events(self) -> tuple[int, Counter[str]]:
        """Total envelopes the daemon produced so far, and the totals per op."""
        by_op: Counter[str] = Counter()
        for (_, op), count in self._published().items():
            by_op[op] += count
        return sum(by_op.values()), by_op

    def _sample(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(name)
        return 0.0 if value is None else value

    def _status(self, now: float) -> None:
        """One line of live figures from the daemon's metrics."""
        total, by_op = self._events()
        lat_sum = self._sample("cdcd_delivery_latency_seconds_sum")
        lat_count = self._sample("cdcd_delivery_latency_seconds_count")
        then, events_then, sum_then, count_then = self._last_status
        self._last_status = (now, float(total), lat_sum, lat_count)
        rate = (total - events_then) / max(now - then, 1e-9)
        ops = " ".join(f"{op} {by_op[op]}" for op in ("c", "u", "d", "t") if by_op[op] or op != "t")
        latency = (
            f"{(lat_sum - sum_then) / (lat_count - count_then) * 1000:.0f} ms avg"
            if lat_count > count_then
            else "-"
        )
        confirmed = Lsn(int(self._sample("cdcd_confirmed_lsn_bytes")))
        lag = format_bytes(self._sample("cdcd_slot_lag_bytes"))
        transactions = int(self._sample("cdcd_transactions_total"))
        segments = [
            f"-- {time.strftime('%H:%M:%S')} {rate:.1f} events/s",
            f"{total} events ({ops}) in {transactions} txns",
            f"confirmed LSN {confirmed}",
            f"slot lag {lag}",
            f"commit->Kafka {latency}",
            f"shown {self.shown}",
        ]
        # Wrapped by segment rather than cut: every figure stays readable on
        # a narrow terminal.
        lines = [segments[0]]
        for segment in segments[1:]:
            if len(lines[-1]) + 3 + len(segment) > self.out.width:
                lines.append("   " + segment)
            else:
                lines[-1] += " | " + segment
        for text in lines:
            self.out.line(self.out.paint(text, "36"))

    def _print_ready(self, hold_s: float = REORDER_HOLD_S) -> None:
        assert self.feed is not None
        for change in self.feed.ready(hold_s):
            self._print_change(change)

    def _print_change(self, change: DecodedChange) -> None:
        out = self.out
        key_columns = frozenset(change.key or ())
        key = (
            " ".join(f"{k}={format_value(v)}" for k, v in (change.key or {}).items()) or "(no key)"
        )
        op_color = {"c": "32", "u": "33", "d": "31", "t": "35"}.get(change.op, "0")
        lsn = str(Lsn(change.lsn))
        same_txn = change.lsn == self._last_lsn
        self._last_lsn = change.lsn
        table = change.table.removeprefix("public.")
        row_id = (change.table, repr(change.key))
        description = describe_change(change.envelope, key_columns, self._mirror.get(row_id))
        text = (
            f"  {out.paint(f'{table:<10}', '1')} {out.paint(change.op, '1', op_color)} "
            f"{key:<8} {out.paint(f'{lsn:>11} #{change.seq:<2}', '2' if same_txn else '34')}  "
            f"{description}"
        )
        out.line(out.fit(text))
        self.shown += 1
        remember_row(self._mirror, row_id, change.op, change.envelope.get("after"))

    def _catch_up(self) -> bool:
        """After the writer stopped: wait until every change is published and shown.

        Everything the writer committed lies before the server's WAL position
        taken now. Once the daemon confirmed that position, Kafka acknowledged
        every change and the daemon counted it: its figures are final, so the
        wait is only for the consumer, never for counts that cannot come.
        Then, per table and op, everything written must be published (more is
        fine: your own psql changes) and the consumer must have decoded
        exactly what was published. Returns ``False`` on a mismatch (the demo
        then exits 1: a lost or miscounted change). A second Ctrl-C skips the
        wait.
        """
        assert self.workload is not None and self.feed is not None and self.pg is not None
        feed = self.feed
        written = self.workload.counts()
        rows = self.pg.execute("SELECT pg_current_wal_lsn()::text", dbname=DATABASE)
        target = Lsn.parse(rows[0][0])
        confirmed = False
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        while not self.hurry.is_set() and time.monotonic() < deadline:
            self._raise_daemon_error()
            # Read before the counts: a confirmed position implies its counts.
            confirmed = confirmed or self._sample("cdcd_confirmed_lsn_bytes") >= target
            published = self._published()
            if covers(published, written.changes) and feed.counts == published:
                break
            if confirmed and covers(feed.counts, published):
                break  # final figures, all of them consumed: compare now
            feed.poll(0.1)
            # No need to hold back for reordering once all published arrived.
            self._print_ready(hold_s=0.0 if covers(feed.counts, published) else REORDER_HOLD_S)
        if self.hurry.is_set():
            self.out.line(
                self.out.paint("  not waiting for catch-up (press Ctrl-C again to abort)", "33")
            )
        self._print_ready(hold_s=0.0)
        published = self._published()
        out = self.out
        out.line()
        out.line(
            f"  {'writer':<10} committed {written.total} changes in {written.transactions} "
            f"transactions ({by_op(written.changes)})"
        )
        out.line(
            f"  {'cdcd':<10} turned {published.total()} changes into envelopes "
            f"({by_op(published)})"
        )
        out.line(
            f"  {'consumer':<10} decoded {self.shown} envelopes and {feed.tombstones} "
            f"tombstones from Kafka ({by_op(feed.counts)})"
        )
        if self.hurry.is_set():
            return True
        problems = count_mismatches(written.changes, published, feed.counts)
        if problems:
            waited = "" if confirmed else f" within {CATCH_UP_TIMEOUT_S:.0f} s"
            out.line(out.paint(f"  the counts disagree{waited}:", "1", "31"))
            for problem in problems:
                out.line(out.paint(f"    {problem}", "31"))
            return False
        return True

    # -- shutdown ---------------------------------------------------------------------

    def _announce_stopping(self) -> None:
        """The "stopping" header, once, before the first line about the shutdown."""
        if not self._stopping_shown and self.pg is not None:
            self._stopping_shown = True
            self.out.line()
            self.out.line(self.out.paint("stopping", "1"))

    def _stop_workload(self) -> None:
        """Stop the writer first: nothing new should happen while the rest stops."""
        self.stop.set()
        if self.workload is not None and self.workload.alive:
            self.workload.join(10.0)

    def _close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()

    def _stop_daemon(self) -> None:
        """Stop the daemon the way SIGTERM does: it drains, confirms and returns."""
        thread = self._daemon_thread
        if thread is None or self.daemon is None:
            return
        self.daemon.stop.set()
        thread.join(40.0)
        if thread.is_alive():
            self.out.line(
                self.out.paint(
                    "  cdcd       did not stop within 40 s; stopping the servers under it", "31"
                )
            )
            return
        if self._daemon_error is not None:
            self.out.line(f"  {'cdcd':<10} failed: {self._daemon_error}")
            return
        confirmed = Lsn(int(self._sample("cdcd_confirmed_lsn_bytes")))
        self.out.line(
            f"  {'cdcd':<10} drained and stopped; slot {SLOT} confirmed up to {confirmed}"
        )

    def _remove(self, name: str, stop: Callable[[], None], base_dir: os.PathLike[str]) -> None:
        stop()
        self.out.line(f"  {name:<10} stopped, removed {base_dir}")


def cmd_demo(args: argparse.Namespace) -> int:
    """``cdcd demo [--duration S]``: see the module docstring."""
    duration: float | None = getattr(args, "duration", None)
    if duration is not None and duration <= 0:
        raise ConfigError("demo: --duration must be positive", hint="e.g. --duration 30")
    return Demo(duration, bool(getattr(args, "debug", False)), sys.stdout).run()
