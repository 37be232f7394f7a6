"""``cdcd mirror -c FILE --output DIR|URI [--once]``: keep Delta Lake mirrors of the captured tables.

A Structured Streaming query reads every table topic of the configuration
(``postgres.tables``, or every ``<prefix>.<schema>.<table>`` topic when the
list is omitted -- topics created later are picked up) and hands each
micro-batch to :class:`cdcd.spark.mirror.MirrorJob` (``foreachBatch``), which
decodes it per table and MERGEs it into each table's Delta table.

* ``--bulk-rows N``: a batch bringing a table at least ``N`` new rows (100 000
  by default; 0: never) is written by the executors, the driver committing
  their files (:mod:`cdcd.spark.bulk`); one bringing an existing table at
  least ``N`` changes and a quarter of its rows is applied by the executors
  rewriting the table (:mod:`cdcd.spark.rewrite`).
* ``--storage-option KEY=VALUE`` (repeatable) is passed to delta-rs for
  object-store outputs (``s3://``, ``gs://``, ``abfss://``...).
* ``--optimize`` (compaction, Z-order by key) and ``--vacuum`` (with
  ``--retention-hours``) maintain the tables and exit; no Spark involved.

* ``--once`` runs the query with ``Trigger.AvailableNow``: the end of every
  partition is probed when it starts (never trusting the broker's high
  watermark, see :mod:`cdcd.spark.source`), everything up to there is
  applied, possibly in several batches of at most 500 000 offsets, and the
  command exits 0.
* Without it, a micro-batch runs every 2 seconds until SIGTERM or SIGINT,
  which stop the query between batches (exit 0). ``--once`` stopped that way
  exits 1: it did not catch up.

Progress lives in Spark's checkpoint (``DIR/.cdcd-mirror/checkpoint`` for a
local output, ``--checkpoint`` otherwise) and in each Delta table's commits
(transaction identifiers per Spark query and batch): both modes continue
from where any earlier run stopped, and a batch replayed after a crash is
applied once.

The Spark session: when ``cdcd mirror`` is started directly (not through
``spark-submit``, and without ``--master`` in ``PYSPARK_SUBMIT_ARGS``), it
runs ``local[*]`` with Python workers on this
interpreter (``PYSPARK_PYTHON``) and the driver bound to 127.0.0.1 unless
``SPARK_LOCAL_IP`` says otherwise. Under ``spark-submit`` the session
settings are left to it. Errors come out as one line, including those raised
on executors (the Python traceback Spark wraps them in is reduced to its
last error line); Spark's own log is silenced unless ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from cdcd.config.model import CdcdConfig, load_config
from cdcd.errors import CdcdError, ConfigError, DefiniteError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from cdcd.spark.mirror import HistoryOptions, MirrorJob

__all__ = ["build_session", "cmd_mirror", "run_mirror"]

log = logging.getLogger("cdcd.mirror")

TRIGGER_INTERVAL_S = 2.0
STOP_WAIT_S = 120.0
MAX_OFFSETS_PER_TRIGGER = 500_000


def storage_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option {pair!r} is not KEY=VALUE")
        options[key] = value
    return options


_SESSION_DEFAULTS = {
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


def build_session(
    app_name: str = "cdcd-mirror",
    *,
    master: str = "local[*]",
    conf: Mapping[str, str] | None = None,
    log_level: str = "ERROR",
) -> SparkSession:
    """A SparkSession for ``cdcd mirror`` (see the module docstring).

    ``master`` applies only outside ``spark-submit``; ``conf`` entries are set
    on the builder (they win over the defaults here).
    """
    try:
        import pandas  # noqa: F401  -- pyspark's Arrow functions need it
        import pyarrow  # noqa: F401
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ConfigError(
            "cdcd mirror needs pyspark, pyarrow and pandas",
            hint="install them with: pip install 'cdcd[spark]'",
        ) from exc

    # Started by spark-submit, or told where to run: the master is not ours to pick.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ or "--master" in os.environ.get(
        "PYSPARK_SUBMIT_ARGS", ""
    )
    builder = SparkSession.builder.appName(app_name)
    if not submitted:
        # Inherited by the JVM and the Python workers it starts.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (
            builder.master(master)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
        )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    configured = spark.sparkContext.getConf()
    for key, value in _SESSION_DEFAULTS.items():
        if not configured.contains(key):
            spark.conf.set(key, value)
    spark.sparkContext.setLogLevel(log_level)
    return spark


def _subscription(config: CdcdConfig) -> dict[str, str]:
    from cdcd.spark.reader import kafka_options

    extra = {"maxOffsetsPerTrigger": str(MAX_OFFSETS_PER_TRIGGER)}
    topics, pattern = config.subscription()
    if pattern is not None:
        return kafka_options(config, pattern=pattern, extra=extra)
    return kafka_options(config, topics=topics, extra=extra)


_PYTHON_ERROR = re.compile(r"^(?:cdcd\.errors\.)?(\w*Error): (.+)$")


def error_line(exc: BaseException) -> str:
    """One line for a Spark failure: the last Python error line in its text, if any."""
    text = str(exc)
    found = None
    for line in text.splitlines():
        match = _PYTHON_ERROR.match(line.strip())
        if match:
            found = f"{match.group(1)}: {match.group(2)}"
    if found:
        return found
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first


class _Stop:
    """SIGTERM/SIGINT set a flag; the main loop stops the query between batches."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s, stopping after the current batch", signal.Signals(signum).name)
        self.event.set()


def start_query(
    spark: SparkSession,
    config: CdcdConfig,
    output: str | Path,
    *,
    once: bool,
    interval_s: float,
    options: Mapping[str, str] | None = None,
    checkpoint: str | None = None,
    history: bool = False,
    bulk_rows: int | None = None,
) -> tuple[StreamingQuery, MirrorJob]:
    from cdcd.spark.mirror import MirrorJob, MirrorStore, is_local
    from cdcd.spark.reader import read_raw, schema_catalog

    store = MirrorStore(output, options)
    store.open()
    if checkpoint is None:
        if not is_local(store.root):
            raise ConfigError(
                f"--output {output} is not a local directory",
                hint="give Spark a --checkpoint directory it can write",
            )
        checkpoint = store.checkpoint
    subscription = _subscription(config)
    catalog = schema_catalog(config, subscription)
    raw: DataFrame = read_raw(spark, subscription, streaming=True)
    job = MirrorJob(store, catalog, history=history_options(config, history))
    if bulk_rows is not None:
        job.bulk_rows = bulk_rows or None  # 0: every batch collected to the driver
    writer = (
        raw.writeStream.foreachBatch(job)
        .option("checkpointLocation", checkpoint)
        .queryName("cdcd-mirror")
    )
    writer = (
        writer.trigger(availableNow=True)
        if once
        else writer.trigger(processingTime=f"{interval_s} seconds")
    )
    query = writer.start()
    # The query's id lives in its checkpoint: batch ids count per id, so a new
    # (or deleted) checkpoint, which numbers batches from 0 again, gets a new
    # app id and skips nothing.
    store.set_app_id(f"cdcd-mirror-{query.id}")
    job.ready.set()
    return query, job


def history_options(config: CdcdConfig, all_tables: bool) -> HistoryOptions:
    """Which tables get a history table: every one with ``--history``, else those whose
    ``postgres.tables`` entry says ``history: true``; and their ``history_columns``."""
    from cdcd.config.model import TableConfig
    from cdcd.spark.mirror import HistoryOptions

    entries = [e for e in config.postgres.tables or () if isinstance(e, TableConfig)]
    return HistoryOptions(
        all_tables=all_tables,
        patterns=tuple(e.name for e in entries if e.history),
        tracked=tuple((e.name, tuple(e.history_columns)) for e in entries if e.history_columns),
    )


def run_mirror(
    config: CdcdConfig,
    output: str | Path,
    *,
    once: bool,
    spark: SparkSession | None = None,
    interval_s: float = TRIGGER_INTERVAL_S,
    spark_log_level: str = "FATAL",
    options: Mapping[str, str] | None = None,
    checkpoint: str | None = None,
    history: bool = False,
    bulk_rows: int | None = None,
) -> int:
    """Run the mirror query; returns the exit code (errors raise :class:`CdcdError`).

    ``history``: every table also gets its history table (``--history``).
    ``bulk_rows`` (``--bulk-rows``): a batch bringing a table at least that many new
    rows is written by the executors (:mod:`cdcd.spark.bulk`), one bringing that many
    changes and a quarter of the table's rows rewritten by them
    (:mod:`cdcd.spark.rewrite`); 0: never; None: the default."""
    own_session = spark is None
    session = spark if spark is not None else build_session(log_level=spark_log_level)
    from pyspark.errors import PySparkException

    stop = _Stop()
    stop.install()
    started = time.monotonic()
    try:
        query, job = start_query(
            session,
            config,
            output,
            once=once,
            interval_s=interval_s,
            options=options,
            checkpoint=checkpoint,
            history=history,
            bulk_rows=bulk_rows,
        )
        failure: BaseException | None
        try:
            while query.isActive:
                if stop.event.is_set():
                    # Between batches: a batch cut short is safe, but wasted work.
                    job.idle.wait(STOP_WAIT_S)
                    query.stop()
                    break
                query.awaitTermination(1)
            failure = query.exception()
        except PySparkException as exc:
            failure = exc
        if job.failure is not None:
            raise job.failure
        if failure is not None:
            raise DefiniteError(f"mirror query failed: {error_line(failure)}")
        if once and stop.event.is_set():
            raise DefiniteError(
                "mirror interrupted before it caught up", hint="run it again to continue"
            )
        applied = [r for r in job.reports if not r.skipped]
        log.info(
            "mirror %s: %d batch(es), %d change(s), %d table(s) in %s (%.1f s)",
            "caught up" if once else "stopped",
            len(applied),
            sum(r.changes for r in applied),
            len(job.store.tables),
            output,
            time.monotonic() - started,
        )
        return 0
    finally:
        stop.restore()
        if own_session:
            session.stop()


def maintain(
    output: str, options: Mapping[str, str], *, optimize: bool, vacuum: bool, retention_hours: int
) -> int:
    """``--optimize`` and/or ``--vacuum`` every mirrored table under ``output``."""
    from cdcd.spark.mirror import MirrorStore

    store = MirrorStore(output, options)
    store.open()
    if optimize:
        for name, metrics in store.optimize().items():
            log.info(
                "optimized %s: %s files removed, %s added",
                name,
                metrics.get("numFilesRemoved"),
                metrics.get("numFilesAdded"),
            )
    if vacuum:
        for name, removed in store.vacuum(retention_hours).items():
            log.info("vacuumed %s: %d files deleted", name, removed)
    return 0


def _bulk_rows(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise ConfigError(f"--bulk-rows {value}: give a number of rows, or 0 for never")
    return value


def cmd_mirror(args: argparse.Namespace) -> int:
    """``cdcd mirror`` (dispatched from :mod:`cdcd.cli`)."""
    from cdcd.observability.logging import setup_logging

    config = load_config(args.config)
    setup_logging(config.metrics.log_format, "DEBUG" if args.debug else config.metrics.log_level)
    if not args.debug:
        logging.getLogger("py4j").setLevel(logging.WARNING)  # its callback server chatter
    from cdcd.spark.mirror import is_local

    output = str(args.output)
    if is_local(output) and Path(output).exists() and not Path(output).is_dir():
        raise ConfigError(f"--output {output} exists and is not a directory")
    options = storage_options(list(args.storage_option))
    try:
        if args.optimize or args.vacuum:
            return maintain(
                output, options, optimize=args.optimize, vacuum=args.vacuum,
                retention_hours=int(args.retention_hours),
            )  # fmt: skip
        # The failure is reported as one line; Spark's own logs only with --debug.
        return run_mirror(
            config,
            output,
            once=bool(args.once),
            spark_log_level="WARN" if args.debug else "FATAL",
            options=options,
            checkpoint=args.checkpoint,
            history=bool(getattr(args, "history", False)),
            bulk_rows=_bulk_rows(getattr(args, "bulk_rows", None)),
        )
    except CdcdError:
        raise
    except OSError as exc:
        raise DefiniteError(f"mirror failed: {exc}") from exc
