"""Every Prometheus metric cdcd exports, in one place.

Why one module: the metric names are a public interface (dashboards, alerting
rules and docs/operations.md depend on them), so they are declared once here and
tests check the deploy files and the docs against this module.

Why a class: each ``Metrics`` instance owns its metrics and registers them on
the ``CollectorRegistry`` it is given, so tests build a fresh ``Metrics`` on a
fresh registry instead of fighting prometheus_client's process-global default.
The daemon uses the module-level ``METRICS`` on ``REGISTRY``.

Why the helpers: ``Counter.labels(...)`` hashes and locks on every call. The
pipeline counts every row change, so per-table label children are resolved once
(``Metrics.table``) and cached; the hot path is then one ``inc()``.

Names follow ``cdcd_<thing>_<unit>``; counters are declared without the
``_total`` suffix because prometheus_client appends it on exposition.
"""

from __future__ import annotations

import platform
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

import cdcd

__all__ = [
    "DELIVERY_LATENCY_BUCKETS",
    "METRICS",
    "OPS",
    "RECONNECT_REASONS",
    "REGISTRY",
    "SLOT_WAL_STATUSES",
    "Metrics",
    "ReconnectReason",
    "TableMetrics",
    "exposed_names",
    "librdkafka_version",
]

# prometheus_client exposes a ``<name>_created`` timestamp series beside every
# counter and histogram child, which doubles the per-table series for no use
# (Prometheus handles counter resets without it). This process is the daemon,
# so the process-wide switch is the right scope.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Envelope ``op`` codes (SPEC §5); children for each are created up front so
#: ``rate()`` sees a zero rather than a missing series before the first event.
OPS: tuple[str, ...] = ("c", "u", "d", "r", "t")

#: The ``reason`` values of ``cdcd_reconnects_total`` (docs/operations.md says
#: what each means; ``cdcd.daemon.reconnect_reason`` picks one). A closed set
#: keeps the series count bounded; anything else is counted as ``other``.
ReconnectReason = Literal[
    "postgres", "postgres_timeout", "slot_in_use", "kafka", "delivery", "schema_registry", "other"
]
RECONNECT_REASONS: tuple[ReconnectReason, ...] = get_args(ReconnectReason)

#: ``pg_replication_slots.wal_status`` values, the ``status`` label of
#: ``cdcd_slot_wal_status`` (all exported, one at 1).
SLOT_WAL_STATUSES: tuple[str, ...] = ("reserved", "extended", "unreserved", "lost")

#: Commit time → delivery report. 1 ms is below what a local broker achieves;
#: 60 s is far beyond a healthy pipeline, anything slower lands in +Inf.
DELIVERY_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


def librdkafka_version() -> str:
    """The librdkafka version confluent-kafka was built against, or ``unknown``.

    Imported lazily so that merely importing the metrics module (the HTTP
    server, tests, ``cdcd check``) does not load the Kafka client.
    """
    try:
        import confluent_kafka
    except ImportError:
        return "unknown"
    version, _ = confluent_kafka.libversion()
    return str(version)


@dataclass(frozen=True, slots=True)
class TableMetrics:
    """Label children of one table, resolved once and kept by the caller.

    ``events`` is keyed by envelope op code (``c u d r t``):
    ``tm.events["c"].inc()`` counts an insert without any label lookup.
    """

    table: str
    events: dict[str, Counter]
    snapshot_rows: Counter
    snapshot_rows_estimated: Gauge
    snapshot_chunks: Counter
    snapshot_failures: Counter


class Metrics:
    """All cdcd metrics, registered on ``registry``.

    Attributes are the prometheus_client objects themselves (labelled ones are
    parents; use the helper methods or ``.labels()`` to get children). The
    helper methods are the intended API for the daemon.

    ``clock`` is the monotonic clock behind ``cdcd_last_confirmed_age_seconds``;
    tests inject a fake one.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        process_collectors: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self._clock = clock
        self._lock = threading.Lock()
        self._tables: dict[str, TableMetrics] = {}
        self._error_children: dict[str, Counter] = {}

        if process_collectors:
            # RSS, CPU, open fds and GC pauses: the first things to look at when
            # a large streamed transaction misbehaves. Linux-only data is simply
            # absent elsewhere.
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
            GCCollector(registry=reg)

        # -- change stream -------------------------------------------------
        self.events = Counter(
            "cdcd_events",
            "Row changes turned into envelopes, by table (schema.table) and op "
            "(c insert, u update, d delete, r snapshot read, t truncate).",
            ("table", "op"),
            registry=reg,
        )
        self.transactions = Counter(
            "cdcd_transactions",
            "Committed transactions received from the walsender (streamed ones "
            "counted once, at their commit).",
            registry=reg,
        )
        self.received_bytes = Counter(
            "cdcd_received_bytes",
            "Bytes of replication messages (XLogData payloads) received from the walsender.",
            registry=reg,
        )
        self.heartbeats = Counter(
            "cdcd_heartbeats",
            "Heartbeat messages emitted with pg_logical_emit_message to keep the slot moving.",
            registry=reg,
        )

        # -- delivery --------------------------------------------------------
        self.delivery_errors = Counter(
            "cdcd_delivery_errors",
            "Messages Kafka did not take, by topic: a delivery report with an error "
            "(after librdkafka's own retries) or a produce() refused at once (e.g. "
            "too large). Any increase stops confirmation.",
            ("topic",),
            registry=reg,
        )
        self.delivery_latency = Histogram(
            "cdcd_delivery_latency_seconds",
            "Time from a transaction's commit timestamp on the primary until Kafka "
            "acknowledged its last message and every message before it (observed "
            "once per transaction).",
            buckets=DELIVERY_LATENCY_BUCKETS,
            registry=reg,
        )
        self.in_flight = Gauge(
            "cdcd_messages_in_flight",
            "Messages handed to the producer and not yet acknowledged by Kafka.",
            registry=reg,
        )
        self.producer_queue = Gauge(
            "cdcd_producer_queue_messages",
            "Messages and requests waiting in librdkafka's local queue (len(producer)).",
            registry=reg,
        )
        self.producer_queue_full = Counter(
            "cdcd_producer_queue_full_seconds",
            "Seconds cdcd waited for room in librdkafka's local queue (full at "
            "queue.buffering.max.messages or .kbytes): Kafka slower than the "
            "source, or a queue too small for the produce round trip.",
            registry=reg,
        )

        # -- positions -------------------------------------------------------
        self.received_lsn = Gauge(
            "cdcd_received_lsn_bytes",
            "Highest WAL position received from the walsender, as a byte offset.",
            registry=reg,
        )
        self.confirmed_lsn = Gauge(
            "cdcd_confirmed_lsn_bytes",
            "WAL position last confirmed (flushed) to the slot, as a byte offset; "
            "everything before it is acknowledged by Kafka.",
            registry=reg,
        )
        self.slot_lag = Gauge(
            "cdcd_slot_lag_bytes",
            "Server's current WAL position minus the slot's confirmed_flush_lsn, "
            "sampled periodically: WAL the slot keeps on the primary's disk.",
            registry=reg,
        )
        # -- the slot on the server (sampled with slot_lag) ------------------
        self.slot_retained_wal = Gauge(
            "cdcd_slot_retained_wal_bytes",
            "WAL the server keeps for the slot: its current position minus the slot's "
            "restart_lsn, sampled periodically (what max_slot_wal_keep_size limits).",
            registry=reg,
        )
        self.slot_wal_status = Gauge(
            "cdcd_slot_wal_status",
            "1 for the slot's pg_replication_slots.wal_status (PostgreSQL 13+), 0 for the "
            f"others: {', '.join(SLOT_WAL_STATUSES)}. unreserved: past max_slot_wal_keep_size, "
            "lost at the next checkpoint unless it catches up.",
            ("status",),
            registry=reg,
        )
        self._wal_status_children = {
            status: self.slot_wal_status.labels(status) for status in SLOT_WAL_STATUSES
        }
        self.slot_wal_keep_size = Gauge(
            "cdcd_slot_wal_keep_size_bytes",
            "The server's max_slot_wal_keep_size in bytes; -1: unlimited (the default, or "
            "PostgreSQL 12).",
            registry=reg,
        )
        self.slot_wal_keep_size.set(-1)
        self.slot_inactive_since = Gauge(
            "cdcd_slot_inactive_since_timestamp_seconds",
            "pg_replication_slots.inactive_since of the slot as a Unix time (PostgreSQL 17+), "
            "read when the session starts and while it runs; 0 while the slot is active.",
            registry=reg,
        )
        self.last_confirmed_age = Gauge(
            "cdcd_last_confirmed_age_seconds",
            "Seconds since the daemon last confirmed a position to the slot "
            "(a delivered commit, or a keepalive with nothing in flight); since "
            "start if it never has. Computed at scrape time.",
            registry=reg,
        )
        self._started_at = clock()
        self._last_confirmed_at: float | None = None
        self.last_confirmed_age.set_function(self._confirmed_age)

        # -- snapshot --------------------------------------------------------
        self.snapshot_rows = Counter(
            "cdcd_snapshot_rows",
            "Rows read by the initial or incremental snapshot, by table.",
            ("table",),
            registry=reg,
        )
        self.snapshot_rows_estimated = Gauge(
            "cdcd_snapshot_rows_estimated",
            "Planner estimate (pg_class.reltuples) of the table's rows when its "
            "snapshot started, by table; progress = rows_total / rows_estimated.",
            ("table",),
            registry=reg,
        )
        self.snapshot_chunks = Counter(
            "cdcd_snapshot_chunks",
            "Snapshot chunks completed, by table.",
            ("table",),
            registry=reg,
        )

        self.snapshot_failures = Counter(
            "cdcd_snapshot_failures",
            "Snapshot jobs that failed or were rejected, by table (a failed heal is retried; "
            "the log line says why).",
            ("table",),
            registry=reg,
        )

        self.schema_changes = Counter(
            "cdcd_schema_changes",
            "Schema changes detected in the stream, by table and kind (docs/schema-changes.md).",
            ("table", "kind"),
            registry=reg,
        )

        # -- process state ---------------------------------------------------
        self.reconnects = Counter(
            "cdcd_reconnects",
            "Restarts of the replication session after a transient error, by reason "
            f"({', '.join(RECONNECT_REASONS)}).",
            ("reason",),
            registry=reg,
        )
        # Every reason exists at 0 from the start, so increase() in the alert
        # sees a session's first reconnect; the set is fixed, so no lock later.
        self._reconnect_children: dict[str, Counter] = {
            reason: self.reconnects.labels(reason) for reason in RECONNECT_REASONS
        }
        self.build_info = Gauge(
            "cdcd_build_info",
            "Always 1; labels carry the cdcd, Python and librdkafka versions.",
            ("version", "python", "librdkafka"),
            registry=reg,
        )
        self.build_info.labels(
            cdcd.__version__, platform.python_version(), librdkafka_version()
        ).set(1)
        self.streaming = Gauge(
            "cdcd_streaming",
            "1 while the daemon streams changes from the slot, 0 while starting, "
            "snapshotting, reconnecting or draining.",
            registry=reg,
        )
        self.synchronous_standby = Gauge(
            "cdcd_synchronous_standby",
            "1 while PostgreSQL counts cdcd's replication connection as a synchronous standby "
            "(pg_stat_replication.sync_state sync or quorum: commits wait for Kafka), 0 "
            "otherwise; sampled with the slot metrics.",
            registry=reg,
        )
        self.spill_bytes = Gauge(
            "cdcd_spill_bytes",
            "Bytes of in-progress streamed transactions currently spilled to local files.",
            registry=reg,
        )

    # -- hot-path helpers ----------------------------------------------------

    def table(self, table: str) -> TableMetrics:
        """The cached label children of ``table`` (``schema.table``).

        Call once per table (e.g. when its Relation message arrives) and keep
        the result; repeated calls return the same object.
        """
        found = self._tables.get(table)
        if found is not None:
            return found
        with self._lock:
            found = self._tables.get(table)
            if found is None:
                found = TableMetrics(
                    table=table,
                    events={op: self.events.labels(table, op) for op in OPS},
                    snapshot_rows=self.snapshot_rows.labels(table),
                    snapshot_rows_estimated=self.snapshot_rows_estimated.labels(table),
                    snapshot_chunks=self.snapshot_chunks.labels(table),
                    # At 0 from the first sight of the table, so that increase() sees the first failure.
                    snapshot_failures=self.snapshot_failures.labels(table),
                )
                self._tables[table] = found
            return found

    def event(self, table: str, op: str, count: int = 1) -> None:
        """Count ``count`` changes of ``op`` on ``table``; cached, but prefer ``table()``."""
        self.table(table).events[op].inc(count)

    def events_by_table_op(self) -> dict[tuple[str, str], int]:
        """``cdcd_events_total`` as ``/metrics`` serves it, by (table, op); zero series left out."""
        found: dict[tuple[str, str], int] = {}
        for family in self.events.collect():
            for sample in family.samples:
                if sample.name == "cdcd_events_total" and sample.value:
                    key = (sample.labels["table"], sample.labels["op"])
                    found[key] = found.get(key, 0) + int(sample.value)
        return found

    def delivery_errors_for(self, topic: str) -> Counter:
        """The cached ``cdcd_delivery_errors_total{topic}`` child, created at 0.

        Call it when a topic is first produced to: a series that appears at 1
        has no earlier sample, so ``increase()`` in the alerting rule would see
        no increase; one that exists at 0 beforehand does.
        """
        child = self._error_children.get(topic)
        if child is None:
            with self._lock:
                child = self._error_children.setdefault(topic, self.delivery_errors.labels(topic))
        return child

    def delivery_error(self, topic: str) -> None:
        """Count one message for ``topic`` that failed delivery (``KafkaSink(on_failed_delivery=)``).

        Labelled by topic only: the alert's ``increase()`` needs each series
        at 0 before its first failure, which a label per error code could not
        give (the log names the error).
        """
        self.delivery_errors_for(topic).inc()

    def delivered(self, commit_time: float, now: float | None = None) -> None:
        """Observe the latency of one delivery; ``commit_time`` is a Unix timestamp.

        Negative values (clock skew between the primary and this host) are
        clamped to 0 so they land in the first bucket instead of corrupting
        the histogram's sum.
        """
        latency = (time.time() if now is None else now) - commit_time
        self.delivery_latency.observe(latency if latency > 0 else 0.0)

    def delivered_many(self, commit_times_ms: list[int], now: float) -> None:
        """:meth:`delivered` for many transactions at once; ``commit_times_ms`` in Unix ms.

        One locked increment per bucket touched and one for the sum, instead
        of two per transaction (the session observes every transaction).
        """
        histogram = self.delivery_latency
        bounds = histogram._upper_bounds
        counts = [0] * len(bounds)
        total = 0.0
        for commit_ms in commit_times_ms:
            latency = now - commit_ms / 1000.0
            if latency < 0:
                latency = 0.0
            total += latency
            counts[bisect_left(bounds, latency)] += 1  # observe(): the first bound >= latency
        histogram._sum.inc(total)
        for i, count in enumerate(counts):
            if count:
                histogram._buckets[i].inc(count)

    def schema_change(self, table: str, kind: str) -> None:
        """Count one detected schema change (rare: a lock per call is fine)."""
        self.schema_changes.labels(table, kind).inc()

    def snapshot_failure(self, table: str) -> None:
        """Count one failed or rejected snapshot job of ``table`` (rare; ``-``: a request naming none)."""
        if table == "-":
            self.snapshot_failures.labels(table).inc()
        else:
            self.table(table).snapshot_failures.inc()

    def reconnect(self, reason: str) -> None:
        """Count one restart of the replication session for ``reason``.

        A value outside :data:`RECONNECT_REASONS` counts as ``other`` rather
        than adding a series.
        """
        self._reconnect_children.get(reason, self._reconnect_children["other"]).inc()

    def mark_received(self, lsn: int, nbytes: int = 0) -> None:
        """Record a received WAL position and the payload size that carried it."""
        self.received_lsn.set(lsn)
        if nbytes:
            self.received_bytes.inc(nbytes)

    def mark_confirmed(self, lsn: int) -> None:
        """Record a position confirmed to the slot; resets the confirmation age.

        Call it on every standby status update that confirms, including
        keepalive confirmations with nothing in flight, so an idle but healthy
        daemon does not look stalled.
        """
        self.confirmed_lsn.set(lsn)
        self._last_confirmed_at = self._clock()

    def slot_health(
        self,
        retained_wal_bytes: int | None,
        wal_status: str | None,
        wal_keep_size_bytes: int,
        inactive_since: float | None,
    ) -> None:
        """Record one sample of the slot's state on the server (rare: locks are fine)."""
        if retained_wal_bytes is not None:
            self.slot_retained_wal.set(retained_wal_bytes)
        for status, child in self._wal_status_children.items():
            child.set(1 if status == wal_status else 0)
        self.slot_wal_keep_size.set(wal_keep_size_bytes)
        self.slot_inactive_since.set(inactive_since or 0)

    def set_streaming(self, streaming: bool) -> None:
        """Set ``cdcd_streaming``; the daemon also calls ``Health.set_ready``."""
        self.streaming.set(1 if streaming else 0)

    def _confirmed_age(self) -> float:
        since = self._last_confirmed_at if self._last_confirmed_at is not None else self._started_at
        return max(0.0, self._clock() - since)


def exposed_names(registry: CollectorRegistry) -> frozenset[str]:
    """Every series name ``registry`` can expose, including ``_total``/``_bucket``/… suffixes.

    Labelled metrics without children expose no samples yet, so the names are
    derived from each family's type rather than from current samples. Tests use
    this to check that dashboards and alerting rules only reference real series.
    """
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
        names.update(sample.name for sample in family.samples)
    return frozenset(names)


#: The daemon's registry, served on /metrics.
REGISTRY = CollectorRegistry()
#: The daemon's metrics; tests build their own ``Metrics(CollectorRegistry())``.
METRICS = Metrics(REGISTRY)
