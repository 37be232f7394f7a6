"""Snapshot progress for operators: metrics per table and periodic log lines.

Per table, ``cdcd_snapshot_rows_total`` (rows read), ``cdcd_snapshot_chunks_total``
and ``cdcd_snapshot_rows_estimated`` (the planner's estimate when the table's
snapshot started: ``pg_class.reltuples``, or EXPLAIN's for a table never
analyzed). Published ``r`` envelopes count in ``cdcd_events_total{op="r"}``.
A log line every ``interval_s`` gives rows done / estimated, chunks and the
rate; systemd's status line shows the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from cdcd.observability import systemd
from cdcd.observability.metrics import Metrics, TableMetrics

__all__ = ["ProgressLog", "TableProgress"]

log = logging.getLogger("cdcd.snapshot")


class TableProgress:
    """Rows and chunks of one table's snapshot, mirrored into its metrics."""

    def __init__(
        self, name: str, estimated: int, metrics: Metrics | None, rows: int = 0, chunks: int = 0
    ) -> None:
        self.name = name
        self.estimated = max(0, estimated)
        self.rows = rows
        self.chunks = chunks
        self.resumed_rows = rows  # done by an earlier run, when resuming
        self.resumed_chunks = chunks
        self.published = 0
        self.started = time.monotonic()
        self.finished: float | None = None
        self._metrics: TableMetrics | None = metrics.table(name) if metrics is not None else None
        if self._metrics is not None:
            self._metrics.snapshot_rows_estimated.set(self.estimated)

    def chunk(self, read: int, published: int) -> None:
        """One chunk: ``read`` rows read, ``published`` of them sent as ``r`` envelopes."""
        self.rows += read
        self.chunks += 1
        self.published += published
        if self._metrics is not None:
            self._metrics.snapshot_rows.inc(read)
            self._metrics.snapshot_chunks.inc()
            self._metrics.events["r"].inc(published)

    def finish(self) -> None:
        self.finished = time.monotonic()

    @property
    def percent(self) -> float | None:
        return 100.0 * self.rows / self.estimated if self.estimated else None

    def describe(self) -> str:
        estimate = f"{self.estimated:,}" if self.estimated else "?"
        percent = self.percent
        share = f" ({percent:.0f}%)" if percent is not None else ""
        return f"{self.name} {self.rows:,}/{estimate} rows{share}, {self.chunks} chunks"


class ProgressLog:
    """Logs progress of a set of tables at most every ``interval_s``, with the rate."""

    def __init__(self, what: str, interval_s: float = 10.0) -> None:
        self.what = what
        self.interval_s = interval_s
        self._started = time.monotonic()
        self._last = self._started
        self._last_rows = 0

    def maybe(self, tables: Iterable[TableProgress], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        tables = list(tables)
        rows = sum(t.rows for t in tables)
        rate = (rows - self._last_rows) / max(now - self._last, 1e-6)
        self._last, self._last_rows = now, rows
        active = [t for t in tables if t.finished is None] or tables[-1:]
        detail = "; ".join(t.describe() for t in active[:3])
        log.info(
            "%s: %s rows in %.0f s, %s rows/s; %s",
            self.what,
            f"{rows:,}",
            now - self._started,
            f"{rate:,.0f}",
            detail,
            extra={"snapshot_rows": rows, "snapshot_rate": round(rate)},
        )
        systemd.notify_status(f"{self.what}: {detail}")

    def rate(self, tables: Iterable[TableProgress]) -> float:
        rows = sum(t.rows for t in tables)
        return rows / max(time.monotonic() - self._started, 1e-6)
