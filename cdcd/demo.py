"""``cdcd demo``: the whole pipeline on one machine, for a newcomer's first five minutes.

Why it exists: the quickest way to understand cdcd is to watch a row change in
PostgreSQL come out of Kafka as a decoded envelope. The demo needs nothing but
this package and PostgreSQL 15 installed: it starts a throwaway cluster
(:class:`cdcd.local.LocalPostgres`) and the bundled Kafka-compatible broker
(:class:`cdcd.local.LocalBroker`), creates two sample tables, writes a steady
trickle of changes from a background thread and runs the *real* daemon
(:class:`cdcd.daemon.Daemon`) in-process, with nothing mocked.

What it prints comes from Kafka, not from the daemon: a plain confluent-kafka
consumer reads the topics and decodes every envelope with plain fastavro and
the writer schemas of ``<prefix>._schemas`` (read by :mod:`cdcd.consumer`,
as ``cdcd.spark`` reads them), exactly as any consumer would.
So what scrolls by is proof that the messages are readable by third parties.
Messages are shown in (``cdcd.lsn``, ``cdcd.seq``) order, the order consumers
de-duplicate and apply on; a short hold time reorders what arrives from
different partitions.

Every few seconds a status line shows the daemon's own figures (events/s,
confirmed LSN, slot lag, commit-to-Kafka latency) read from its ``Metrics``
object, the same numbers ``/metrics`` serves.

Ctrl-C or SIGTERM stops the writer, lets the consumer catch up, stops the
daemon (which drains and confirms, as ``cdcd run`` does), then stops the
broker and PostgreSQL and removes their directories. A second Ctrl-C skips
the waiting; a third one aborts (the at-exit handlers of ``cdcd.local`` still
remove the throwaway servers). ``--duration S`` stops by itself after S
seconds of streaming, for scripts and CI.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from cdcd.config.model import CdcdConfig, parse_config
from cdcd.daemon import Daemon
from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.local import BrokerSetupError, LocalBroker, LocalPostgres, PostgresSetupError
from cdcd.local.workload import orders_ddl
from cdcd.naming import (
    schemas_topic,
    table_topic,
)
from cdcd.observability.metrics import Metrics
from cdcd.protocol.lsn import Lsn
from cdcd.tail import TopicReader, describe_change, format_value

__all__ = ["cmd_demo"]

log = logging.getLogger("cdcd.demo")

#: Names of everything the demo creates; fixed, because the servers are private.
DATABASE = "demo"
PREFIX = "demo"
SLOT = "cdcd_demo"
PUBLICATION = "cdcd_demo"
TABLES = ("public.customers", "public.orders")

#: Seconds between status lines: often enough to watch the figures move,
#: rarely enough not to drown the changes.
STATUS_EVERY_S = 5.0
#: Messages wait this long before being printed, so that messages fetched from
#: different partitions can be put back in commit order.
REORDER_HOLD_S = 0.4
#: How long the orderly stop waits for the daemon and the consumer to catch up.
CATCH_UP_TIMEOUT_S = 15.0
#: How long to wait for the daemon to stream after it was started.
STREAMING_TIMEOUT_S = 60.0
#: Pause between two workload steps (seconds, uniform): a few changes per
#: second, readable as they scroll.
STEP_PAUSE_S = (0.25, 0.6)
#: Width of the output when stdout is not a terminal (logs, CI).
PIPE_WIDTH = 160

#: The sample schema (SPEC §9's ``orders``, plus customers). ``orders`` has
#: ``REPLICA IDENTITY FULL`` so that updates and deletes carry the whole old
#: row (``before``); ``customers`` keeps the default, where ``before`` only
#: holds the key -- the demo shows both.
SCHEMA_SQL = """
CREATE TABLE customers(
  id serial PRIMARY KEY,
  name text NOT NULL,
  email text NOT NULL,
  tags text[] NOT NULL DEFAULT '{}',
  created_at timestamptz NOT NULL DEFAULT now());
""" + orders_ddl() + """;
ALTER TABLE orders REPLICA IDENTITY FULL;
"""

_NAMES = (
    "Ada Lovelace",
    "Alan Turing",
    "Grace Hopper",
    "Edsger Dijkstra",
    "Barbara Liskov",
    "Donald Knuth",
    "Frances Allen",
    "Ken Thompson",
    "Margaret Hamilton",
    "John Backus",
    "Radia Perlman",
    "Leslie Lamport",
    "Jim Gray",
    "Michael Stonebraker",
)
_TAGS = ("vip", "newsletter", "eu", "us", "wholesale", "returning")
_CHANNELS = ("web", "app", "store")
_NOTES = (None, None, None, "gift wrap", "leave at the door", "call before delivery")
_NEXT_STATUS = {"new": "paid", "paid": "shipped", "shipped": "delivered"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# --------------------------------------------------------------------------- output


class _Stopping(Exception):
    """Raised inside the startup sequence when Ctrl-C/SIGTERM arrived meanwhile."""


class Console:
    """Everything the demo prints goes through here: colors, widths, flushing.

    Colors only on a terminal (and not with ``NO_COLOR`` or ``TERM=dumb``), so
    logs and CI output stay plain. Every line is flushed, because a pipe is
    block-buffered and a reader (or test) must see progress as it happens.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.color = (
            self.tty and "NO_COLOR" not in os.environ and os.environ.get("TERM", "") != "dumb"
        )

    @property
    def width(self) -> int:
        """Columns available for one line (the terminal's, or a fixed width on a pipe)."""
        if not self.tty:
            return PIPE_WIDTH
        return max(60, shutil.get_terminal_size((100, 24)).columns - 1)

    def paint(self, text: str, *codes: str) -> str:
        """Wrap ``text`` in SGR codes (``"1"`` bold, ``"2"`` dim, ``"32"`` green...)."""
        if not self.color or not codes:
            return text
        return f"\x1b[{';'.join(codes)}m{text}\x1b[0m"

    def line(self, text: str = "") -> None:
        """Print one line and flush it."""
        self.stream.write(text + "\n")
        self.stream.flush()

    def fit(self, text: str) -> str:
        """Cut ``text`` (which may contain SGR codes) to the line width, marking the cut."""
        width = self.width
        if len(_ANSI.sub("", text)) <= width:
            return text
        out: list[str] = []
        visible = 0
        pos = 0
        while pos < len(text) and visible < width - 1:
            match = _ANSI.match(text, pos)
            if match is not None:
                out.append(match.group(0))
                pos = match.end()
                continue
            out.append(text[pos])
            visible += 1
            pos += 1
        out.append("…")
        if self.color:
            out.append("\x1b[0m")
        return "".join(out)

    @contextmanager
    def step(self, what: str) -> Iterator[list[str]]:
        """Show ``what ...`` before slow work and ``ok (1.2 s) <details>`` after it.

        The caller appends details to the yielded list. On a terminal the
        result completes the same line; on a pipe too, since the line is
        flushed before the work starts and finished after it.
        """
        started = time.monotonic()
        self.stream.write(f"  {what:<38} ")
        self.stream.flush()
        details: list[str] = []
        try:
            yield details
        except _Stopping:
            self.line(self.paint("interrupted", "1", "33"))
            raise
        except BaseException:
            self.line(self.paint("failed", "1", "31"))
            raise
        elapsed = time.monotonic() - started
        extra = "  ".join(details)
        self.line(f"{self.paint('ok', '1', '32')} {self.paint(f'({elapsed:.1f} s)', '2')}  {extra}")


# ------------------------------------------------------------------------ formatting


def format_bytes(value: float) -> str:
    """``1234`` -> ``1.2 kB``; small values stay exact so that "0 B" reads as zero."""
    if value < 1000:
        return f"{value:.0f} B"
    for unit in ("kB", "MB", "GB"):
        value /= 1000
        if value < 1000:
            return f"{value:.1f} {unit}"
    return f"{value:.1f} TB"


# -------------------------------------------------------------------------- workload


@dataclass
class WorkloadCounts:
    """What the writer committed, by (table, op): the yardstick for "nothing lost"."""

    changes: Counter[tuple[str, str]] = field(default_factory=Counter)
    transactions: int = 0

    @property
    def total(self) -> int:
        """All row changes committed."""
        return sum(self.changes.values())


class Workload:
    """Writes a steady, varied stream of changes in a background thread.

    A fixed cycle of steps guarantees that inserts, updates, deletes and
    multi-row transactions show up within the first few seconds; the data in
    each step is random. Each step is one transaction; the rows it changed are
    counted (``rowcount``) only after it committed, so the counts can be
    compared with what arrives from Kafka.
    """

    def __init__(self, connect: Callable[[], Any], stop: threading.Event) -> None:
        self._connect = connect
        self._stop = stop
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._counts = WorkloadCounts()
        self._thread = threading.Thread(target=self._run, name="cdcd-demo-writer", daemon=True)
        self.error: BaseException | None = None
        self._cycle = itertools.cycle(
            (
                self._new_order,
                self._advance_order,
                self._new_customer,
                self._new_order,
                self._advance_order,
                self._checkout,
                self._update_customer,
                self._cancel_order,
                self._new_order,
                self._advance_order,
                self._ship_paid_orders,
                self._new_order,
                self._advance_order,
                self._close_account,
            )
        )

    def start(self) -> None:
        """Start writing."""
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (after ``stop`` was set)."""
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the writer thread still runs."""
        return self._thread.is_alive()

    def counts(self) -> WorkloadCounts:
        """A copy of the counts so far (thread-safe)."""
        with self._lock:
            return WorkloadCounts(Counter(self._counts.changes), self._counts.transactions)

    def _run(self) -> None:
        """Thread body: seed, then one step per pause until stopped.

        An exception ends the thread and is kept in ``error``; the demo's main
        loop sees it and stops with that error.
        """
        try:
            conn = self._connect()
            try:
                conn.autocommit = False
                self._transaction(conn, self._seed)
                while not self._stop.wait(self._rng.uniform(*STEP_PAUSE_S)):
                    self._transaction(conn, next(self._cycle))
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = exc

    def _transaction(
        self, conn: Any, step: Callable[[Any, Counter[tuple[str, str]]], None]
    ) -> None:
        """Run ``step`` in one transaction and count its changes once committed."""
        changes: Counter[tuple[str, str]] = Counter()
        with conn.cursor() as cur:
            try:
                step(cur, changes)
            except BaseException:
                conn.rollback()
                raise
        conn.commit()
        changes = +changes  # drop zero counts (an UPDATE that matched nothing)
        if changes:
            with self._lock:
                self._counts.changes.update(changes)
                self._counts.transactions += 1

    # -- steps (each runs inside one transaction) -------------------------------------

    def _seed(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Three customers in one transaction, so orders have someone to belong to."""
        for _ in range(3):
            self._insert_customer(cur, changes)

    def _insert_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> int:
        rng = self._rng
        name = rng.choice(_NAMES)
        email = name.lower().replace(" ", ".") + f"{rng.randint(1, 99)}@example.com"
        tags = rng.sample(_TAGS[:4], rng.randint(0, 2))
        cur.execute(
            "INSERT INTO customers(name, email, tags) VALUES (%s, %s, %s) RETURNING id",
            (name, email, tags),
        )
        changes["public.customers", "c"] += cur.rowcount
        customer_id: int = cur.fetchone()[0]
        return customer_id

    def _random_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> int:
        cur.execute("SELECT id FROM customers ORDER BY random() LIMIT 1")
        row = cur.fetchone()
        if row is None:
            return self._insert_customer(cur, changes)
        customer_id: int = row[0]
        return customer_id

    def _insert_order(self, cur: Any, changes: Counter[tuple[str, str]], customer_id: int) -> None:
        rng = self._rng
        payload = {"items": rng.randint(1, 5), "channel": rng.choice(_CHANNELS)}
        cur.execute(
            "INSERT INTO orders(customer_id, status, amount, note, flags, payload) "
            "VALUES (%s, 'new', %s, %s, %s, %s::jsonb)",
            (
                customer_id,
                Decimal(rng.randint(500, 50_000)) / 100,
                rng.choice(_NOTES),
                rng.random() < 0.3,
                json.dumps(payload),
            ),
        )
        changes["public.orders", "c"] += cur.rowcount

    def _new_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        self._insert_customer(cur, changes)

    def _new_order(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        self._insert_order(cur, changes, self._random_customer(cur, changes))

    def _advance_order(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """One order moves on: new -> paid -> shipped -> delivered."""
        cur.execute(
            "UPDATE orders SET status = CASE status WHEN 'new' THEN 'paid' "
            "WHEN 'paid' THEN 'shipped' ELSE 'delivered' END "
            "WHERE id = (SELECT id FROM orders WHERE status <> 'delivered' "
            "ORDER BY random() LIMIT 1)"
        )
        changes["public.orders", "u"] += cur.rowcount
        if not cur.rowcount:
            self._new_order(cur, changes)

    def _update_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """A customer gets a new tag (an array update), or else a new email address."""
        tag = self._rng.choice(_TAGS)
        cur.execute(
            "UPDATE customers SET tags = tags || %s::text WHERE id = (SELECT id FROM customers "
            "WHERE NOT %s = ANY(tags) ORDER BY random() LIMIT 1)",
            (tag, tag),
        )
        if not cur.rowcount:
            cur.execute(
                "UPDATE customers SET email = replace(email, '@example.com', '@example.org') "
                "WHERE id = (SELECT id FROM customers ORDER BY random() LIMIT 1)"
            )
        changes["public.customers", "u"] += cur.rowcount

    def _cancel_order(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """An unshipped order is cancelled: a delete (and a tombstone in Kafka)."""
        cur.execute(
            "DELETE FROM orders WHERE id = (SELECT id FROM orders "
            "WHERE status IN ('new', 'paid') ORDER BY random() LIMIT 1)"
        )
        changes["public.orders", "d"] += cur.rowcount

    def _checkout(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Multi-row transaction: one customer places several orders at once."""
        customer_id = self._random_customer(cur, changes)
        for _ in range(self._rng.randint(2, 4)):
            self._insert_order(cur, changes, customer_id)
        cur.execute(
            "UPDATE customers SET tags = tags || 'returning'::text "
            "WHERE id = %s AND NOT 'returning' = ANY(tags)",
            (customer_id,),
        )
        changes["public.customers", "u"] += cur.rowcount

    def _ship_paid_orders(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Multi-row transaction: the warehouse ships every paid order in one UPDATE."""
        cur.execute("UPDATE orders SET status = 'shipped' WHERE status = 'paid'")
        changes["public.orders", "u"] += cur.rowcount
        if not cur.rowcount:
            self._checkout(cur, changes)

    def _close_account(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Multi-row transaction: a customer leaves; their orders go with them."""
        cur.execute("SELECT count(*) FROM customers")
        if cur.fetchone()[0] <= 3:
            self._new_customer(cur, changes)
            return
        customer_id = self._random_customer(cur, changes)
        cur.execute("DELETE FROM orders WHERE customer_id = %s", (customer_id,))
        changes["public.orders", "d"] += cur.rowcount
        cur.execute("DELETE FROM customers WHERE id = %s", (customer_id,))
        changes["public.customers", "d"] += cur.rowcount


# -------------------------------------------------------------------------- consumer


@dataclass(frozen=True)
class DecodedChange:
    """One change message as a consumer sees it, decoded."""

    table: str
    op: str
    key: Mapping[str, Any] | None
    envelope: Mapping[str, Any]
    lsn: int
    seq: int


class ChangeFeed:
    """Reads the table topics (:class:`cdcd.tail.TopicReader`) and hands out changes in commit order.

    Topics appear when cdcd first publishes to them; the reader looks them up
    every second and reads each new one from the beginning. Decoded changes
    wait ``REORDER_HOLD_S`` in a heap ordered by (``cdcd.lsn``, ``cdcd.seq``):
    Kafka orders per partition only, and a reader should see a transaction's
    changes together, in order.
    """

    def __init__(self, config: CdcdConfig) -> None:
        # Writer schemas: read from <prefix>._schemas as any consumer would.
        self._reader = TopicReader(config, None, from_end=False)
        self._heap: list[tuple[int, int, int, float, DecodedChange]] = []
        self._arrivals = itertools.count()
        self.received = 0
        self.tombstones = 0
        #: Envelopes decoded so far, by (schema.table, op).
        self.counts: Counter[tuple[str, str]] = Counter()

    @property
    def topics(self) -> list[str]:
        """Table topics read so far."""
        return self._reader.topics

    @property
    def pending(self) -> int:
        """Decoded changes waiting in the reorder buffer."""
        return len(self._heap)

    def poll(self, timeout_s: float) -> None:
        """Fetch what arrived within ``timeout_s`` (batch-wise) into the reorder buffer."""
        for change in self._reader.poll(timeout_s):
            if change.envelope is None:
                self.tombstones += 1  # a delete's tombstone, for log compaction
                continue
            decoded = DecodedChange(
                table=change.table,
                op=change.envelope["op"],
                key=change.key,
                envelope=change.envelope,
                lsn=change.lsn,
                seq=change.seq,
            )
            self.received += 1
            self.counts[decoded.table, decoded.op] += 1
            heapq.heappush(
                self._heap, (change.lsn, change.seq, next(self._arrivals), time.monotonic(), decoded)
            )

    def ready(self, hold_s: float = REORDER_HOLD_S) -> list[DecodedChange]:
        """Changes that waited at least ``hold_s``, in (lsn, seq) order."""
        out: list[DecodedChange] = []
        cutoff = time.monotonic() - hold_s
        while self._heap and self._heap[0][3] <= cutoff:
            out.append(heapq.heappop(self._heap)[4])
        return out

    def close(self) -> None:
        """Leave the broker (before it is stopped, so librdkafka does not complain)."""
        self._reader.close()


# ---------------------------------------------------------------------------- demo


def _covers(have: Counter[tuple[str, str]], want: Counter[tuple[str, str]]) -> bool:
    """Whether ``have`` holds at least ``want`` of every (table, op)."""
    return all(have[key] >= count for key, count in want.items())


def _by_op(counts: Counter[tuple[str, str]]) -> str:
    """``c 3, d 1, u 2``: totals per op, zeros left out."""
    by_op: Counter[str] = Counter()
    for (_, op), count in counts.items():
        by_op[op] += count
    return ", ".join(f"{op} {n}" for op, n in sorted(by_op.items()) if n)


def count_mismatches(
    written: Mapping[tuple[str, str], int],
    published: Mapping[tuple[str, str], int],
    decoded: Mapping[tuple[str, str], int],
) -> list[str]:
    """What disagrees, one line per (table, op); empty when all is well.

    Per (table, op), cdcd must publish at least what the writer committed
    (more when someone else writes too, e.g. from psql), and the consumer
    must decode exactly what cdcd published. Totals alone would let a
    missing insert hide behind a surplus update.
    """
    problems = []
    for table, op in sorted({*written, *published, *decoded}):
        w = written.get((table, op), 0)
        p = published.get((table, op), 0)
        d = decoded.get((table, op), 0)
        if p < w or d != p:
            problems.append(f"{table} {op}: written {w}, published {p}, decoded {d}")
    return problems


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
        cleanup still runs (and ``cdcd.local``'s at-exit handlers behind it).
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
            raise _Stopping

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
                except _Stopping:
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
                raise _Stopping from exc
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
                raise _Stopping
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
        after = change.envelope.get("after")
        if change.op == "t":
            for stale in [r for r in self._mirror if r[0] == change.table]:
                del self._mirror[stale]
        elif after is None:
            self._mirror.pop(row_id, None)
        else:
            self._mirror[row_id] = after

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
            if _covers(published, written.changes) and feed.counts == published:
                break
            if confirmed and _covers(feed.counts, published):
                break  # final figures, all of them consumed: compare now
            feed.poll(0.1)
            # No need to hold back for reordering once all published arrived.
            self._print_ready(hold_s=0.0 if _covers(feed.counts, published) else REORDER_HOLD_S)
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
            f"transactions ({_by_op(written.changes)})"
        )
        out.line(
            f"  {'cdcd':<10} turned {published.total()} changes into envelopes "
            f"({_by_op(published)})"
        )
        out.line(
            f"  {'consumer':<10} decoded {self.shown} envelopes and {feed.tombstones} "
            f"tombstones from Kafka ({_by_op(feed.counts)})"
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


def cmd_local(args: argparse.Namespace) -> int:
    """``cdcd local up|down [--dir DIR]``: see :mod:`cdcd.local.keep`."""
    from cdcd.local.keep import AlreadyUp, down, up

    directory = Path(args.dir)
    if args.action == "down":
        if not down(directory):
            raise ConfigError(
                f"nothing to stop: {directory} holds no servers started by 'cdcd local up'",
                hint="pass the --dir given to 'cdcd local up'",
            )
        print(f"stopped the local PostgreSQL and broker of {directory}, removed their data")
        return 0
    try:
        kept = up(directory)
    except AlreadyUp as exc:
        raise ConfigError(str(exc), hint=f"'cdcd local down --dir {directory}' first") from exc
    except (PostgresSetupError, BrokerSetupError) as exc:
        raise CdcdError(f"cdcd local: {exc}") from exc
    print(f"PostgreSQL {kept.version}: {kept.dsn}")
    print(f"Kafka-compatible broker (in memory): {kept.bootstrap_servers}")
    print(f"Both keep running. Configuration for them, written to {kept.config_path}:")
    print()
    print(kept.config_text)
    print("Next: create your tables (psql \"" + kept.dsn + "\"), then")
    print(f"  cdcd check -c {kept.config_path} && cdcd run -c {kept.config_path}")
    print(f"  cdcd tail -c {kept.config_path} --from beginning    # in another terminal")
    print(f"Stop both and remove their data: cdcd local down --dir {directory}")
    return 0

