"""One replication session: connect, stream, publish, confirm — until stopped or failed.

The loop is single-threaded on purpose: reading the walsender, decoding,
producing, serving delivery reports and confirming all happen on one thread,
so the ack tracker needs no locks and ordering is obvious. Between messages
the loop serves delivery reports every few hundred messages and whenever the
socket is drained — then it also flushes the producer, so ``linger.ms``
batches only while there is a backlog and a caught-up stream is sent at
once.

Standby status updates (write = the end of the WAL received, flush = apply =
the tracker's confirmed LSN) go out as soon as the confirmed position moves;
when the socket is drained and more WAL was received than last reported,
while the server counts cdcd as a synchronous standby (what ``remote_write``
waits for); right after psycopg2 answered a keepalive on its own; and every
``status_interval_s`` — also while blocked on a full producer queue, so the
walsender does not time the session out during a broker outage. So a
synchronous commit waits for one walsender wake-up and one Kafka
acknowledgement, never for a status interval (docs/synchronous.md).

When nothing is in flight and no transaction is partly received, the
server's ``wal_end`` (from keepalives) is confirmed, so an idle slot does not
pin WAL; heartbeats (``pg_logical_emit_message``) give the slot a position in
this database when only other databases write (on PostgreSQL 12 and 13,
whose pgoutput sends no messages, they are recognised by transaction id:
``cdcd.source.markers``).

Snapshots (``cdcd.snapshot``, docs/snapshots.md): when the session creates
the slot and ``snapshot.mode`` is ``initial`` or ``initial_only``, it creates
it with an exported snapshot and publishes every captured table from it
before streaming starts at the slot's consistent point (``initial_only``
then stops the daemon with exit code 0). While streaming, the main loop
ticks the incremental snapshot driver, which reads the signal table and
chunks on a worker thread; the publisher hands it the watermarks.

A session starts with the startup plan (``cdcd.pipeline.startup``: the
checks and actions before streaming, the very steps ``cdcd check`` runs dry)
and takes its metadata connection, Kafka sink and replication stream from
the factories of its ``SessionParts`` (``cdcd.pipeline.parts``): the daemon
passes the real ones, tests a fault-injecting sink or a scripted stream.

A session ends by returning (stop requested: drained and confirmed) or by
raising ``TransientError`` (the daemon reconnects after a backoff and resumes
at the slot's confirmed position) or ``DefiniteError`` (the daemon exits 3).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cdcd.ack.tracker import AckTracker, TxnTicket
from cdcd.config.model import CdcdConfig
from cdcd.decode.relations import RelationCache
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.errors import CdcdError
from cdcd.naming import HEARTBEAT_PREFIX, schemas_topic, split_table
from cdcd.observability import systemd
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.parts import SessionParts, Sink, Stream, real_parts, wire_format
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.schema_changes import SchemaChanges
from cdcd.pipeline.startup import Startup, execute
from cdcd.pipeline.transactions import TransactionAssembler
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import Lsn
from cdcd.sink.producer import build_producer_config
from cdcd.sink.topics import topic_spec
from cdcd.snapshot.incremental import IncrementalSnapshots
from cdcd.snapshot.initial import ExportedSnapshot, InitialSnapshot
from cdcd.snapshot.store import DONE, Job, SignalTable
from cdcd.snapshot.workers import WorkerSettings
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import SourceDatabase
from cdcd.source.markers import MarkerTransactions
from cdcd.source.synchronous import COUNTED_STATES, walsender_sync_state

log = logging.getLogger("cdcd.pipeline")

_POLL_EVERY = 256  # messages between delivery-report polls
_DRAIN_TIMEOUT_S = 30.0
_IN_FLIGHT_WAIT_S = 0.001
_IDLE_WAIT_S = 0.5
#: A drained read of at least this many messages: a backlog is being worked
#: off, and the loop only caught up with the walsender for a moment.
_CATCHING_UP = _POLL_EVERY // 4
#: While catching up, the loop lets the socket fill (for the stream's
#: ``fill_wait_s``) instead of flushing the producer, and flushes at most
#: every _CATCH_UP_FLUSH_S.
_CATCH_UP_FLUSH_S = 0.01


class SessionState:
    """What the daemon and health checks observe of the running session."""

    def __init__(self) -> None:
        self.streaming = False
        self.ever_streamed = False
        self.confirmed: Lsn | None = None

    def beat(self) -> None:
        """Called from the main loop and every long wait to say the session is alive.

        A no-op here; the daemon overrides it to feed /healthz and the
        systemd watchdog.
        """


class Session:
    """One connect-stream-confirm cycle; see the module docstring.

    ``parts`` makes its connections (``cdcd.pipeline.parts``; default: the
    real ones for ``config``).
    """

    def __init__(
        self,
        config: CdcdConfig,
        stop: threading.Event,
        metrics: Metrics | None = None,
        state: SessionState | None = None,
        on_streaming: Any = None,
        *,
        parts: SessionParts | None = None,
    ) -> None:
        self.config = config
        self.stop = stop
        self.metrics = metrics
        self.state = state or SessionState()
        self.parts = parts or real_parts(config)
        self._on_streaming = on_streaming
        self._startup: Startup | None = None
        self._stream: Stream | None = None
        self._sink: Sink | None = None
        self._db: SourceDatabase | None = None
        self._tracker: AckTracker | None = None
        self._assembler: TransactionAssembler | None = None
        self._decoder = PgOutputDecoder(config.postgres.protocol_version)
        self._snapshots: IncrementalSnapshots | None = None
        self._publisher: Publisher | None = None
        self._last_status = 0.0
        self._sent_confirmed: Lsn | None = None
        # The end of the WAL received (write position), and what was last sent of it.
        self._received = 0
        self._sent_received = 0
        self._age_confirmed: Lsn | None = None
        self._markers: MarkerTransactions | None = None
        self._sync_state: str | None = None
        # Commit timestamps (ms) of transactions delivered since the last
        # _observe_latency(): observed in one go after each poll.
        self._delivered_ms: list[int] = []
        #: How the loop waits for the socket to fill while catching up (tests replace it).
        self._let_fill: Callable[[float], None] = time.sleep
        # sink.blocked_s already added to the metrics (the sink is this session's).
        self._reported_blocked_s = 0.0

    # -- setup ----------------------------------------------------------------------

    def _include(self, schema: str, table: str) -> bool:
        assert self._startup is not None
        return self._startup.include(schema, table)

    def _ensure_topic(self, name: str) -> None:
        if self.config.kafka.create_topics:
            self.parts.ensure_topic(topic_spec(self.config.kafka, name))

    # -- run ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._close()

    def _run(self) -> None:
        startup = self._startup = Startup(
            self.config,
            dry_run=False,
            connect=self.parts.database,
            check_broker=self.parts.check_broker,
            stop=self.stop,
            beat=self.state.beat,
            metrics=self.metrics,
        )
        try:
            try:
                # The startup plan (cdcd.pipeline.startup): what `cdcd check` runs dry.
                execute(startup)
            finally:
                self._db = startup.db  # closed by _close whatever happened
            self._markers = startup.markers
            if not self._setup(startup):
                return  # stopped during the initial snapshot, or initial_only is done
        finally:
            if startup.exported is not None:
                startup.exported.close()
        stream = self.parts.stream()
        assert self._tracker is not None and self._sink is not None and self._assembler is not None
        self._received = int(self._tracker.confirmed)
        try:
            stream.start(self._tracker.confirmed)
        except CdcdError:
            stream.close()  # never started: no final status update to send on it
            raise
        self._stream = stream
        self._set_streaming(True)
        try:
            self._loop(stream, self._decoder, self._assembler, self._tracker, self._sink)
        finally:
            self._set_streaming(False)
            self._assembler.close()
        self._drain()

    def _setup(self, startup: Startup) -> bool:
        """Kafka, the publishing pipeline, the initial snapshot; False: do not stream."""
        cfg = self.config
        pg = cfg.postgres
        snap = cfg.snapshot
        db, table, signals = startup.database, startup.signal_table, startup.signals
        assert startup.slot is not None and table is not None
        start = startup.slot.confirmed_flush_lsn or Lsn(0)
        log.info("resuming slot %s at %s", pg.slot, start, extra={"slot": pg.slot, "lsn": str(start)})

        sink = self._sink = self.parts.sink(
            should_stop=self._while_blocked,
            on_failed_delivery=self.metrics.delivery_error if self.metrics is not None else None,
        )
        if self.metrics is not None and not cfg.schema_registry.url:
            # At 0 before any failure (see Metrics).
            self.metrics.delivery_errors_for(schemas_topic(cfg.kafka.topic_prefix))
        wire = wire_format(cfg, sink, self.parts, waiting=self._status_if_due)
        tracker = self._tracker = AckTracker(
            start, on_complete=self._on_complete, classify=sink.delivery_failure
        )
        catalog = PgCatalog(db.conn)
        relations = db.relation_cache(catalog)
        # Snapshot reads describe tables from the catalog: a cache of their
        # own, so the stream's cache only ever holds what the walsender sent.
        snapshot_relations = db.relation_cache(catalog, snapshot=True)
        encoder = EnvelopeEncoder(
            cfg.kafka.topic_prefix, db.database, wire, topics=pg.topic_overrides()
        )
        schema = SchemaChanges(
            db,
            catalog,
            signals,
            pg.slot,
            resnapshot=cfg.schema_changes.resnapshot == "auto",
            metrics=self.metrics,
            publication=pg.publication,
            check_interval_s=cfg.schema_changes.check_interval_s,
        )
        publisher = Publisher(
            sink,
            tracker,
            encoder,
            wire,
            include=self._include,
            ensure_topic=self._ensure_topic,
            metrics=self.metrics,
            transaction_records=cfg.kafka.transaction_records,
            schema_tracker=schema,
        )
        publisher.use_markers(self._markers)
        self._publisher = publisher
        self._assembler = TransactionAssembler(
            relations, publisher, pg.stream_spill_bytes, pg.spill_dir, pg.protocol_version
        )

        exported = startup.exported
        if exported is not None and signals is not None:
            if not self._initial_snapshot(exported, signals, publisher, snapshot_relations, schema):
                log.warning(
                    "stopped during the initial snapshot; the next start completes it "
                    "incrementally while streaming"
                )
                self._assembler.close()
                self._drain()
                return False
        if snap.mode == "initial_only" and (
            signals is None or signals.unfinished_initial(pg.slot) is None
        ):
            log.info("snapshot.mode is initial_only and the initial snapshot is complete: exiting")
            self._assembler.close()
            self._drain()
            self.stop.set()
            return False
        # The reference for schema changes of tables no snapshot described (issue 24).
        schema.baseline_missing(startup.captured_tables(), start)
        self._snapshots = IncrementalSnapshots(
            db=db,
            dsn=pg.dsn.get_secret_value(),
            timeout_s=pg.connect_timeout_s,
            signals=table,
            table_ready=signals is not None,
            slot=pg.slot,
            publication=pg.publication,
            publisher=publisher,
            relations=snapshot_relations,
            include=self._include,
            chunk_rows=snap.incremental_rows,
            metrics=self.metrics,
            resume_initial=snap.mode != "never",
            on_job_done=self._snapshot_done,
            markers=self._markers,
            schema=schema,
        )
        return True

    def _initial_snapshot(
        self,
        exported: ExportedSnapshot,
        signals: SignalTable,
        publisher: Publisher,
        relations: RelationCache,
        schema: SchemaChanges,
    ) -> bool:
        """Publish every captured table from the exported snapshot; False if stopped."""
        assert self._db is not None and self._sink is not None and self._tracker is not None
        job = signals.unfinished_initial(exported.slot)
        if job is None:
            job = signals.begin_initial(exported.slot, [])

        def table_done(name: str) -> None:
            job.progress["done"] = [*job.done_tables, name]
            signals.save(job)

        tables = [split_table(t) for t in job.tables]
        # READY before a long copy: the daemon is up; /readyz says it is not streaming yet.
        systemd.notify_ready("initial snapshot")
        snapshot = InitialSnapshot(
            exported,
            tables,
            publisher=publisher,
            tracker=self._tracker,
            poll=self._sink.poll,
            relations=relations,
            publication=self.config.postgres.publication,
            chunk_rows=self.config.snapshot.chunk_rows,
            metrics=self.metrics,
            stop=self.stop,
            beat=self.state.beat,
            on_table_done=table_done,
            schema=schema,
            processes=self.config.snapshot.processes,
            workers=self._snapshot_workers(),
        )
        if not snapshot.run():
            return False
        job.status = DONE
        job.progress["done"] = list(job.tables)
        signals.save(job)
        return True

    def _snapshot_workers(self) -> WorkerSettings:
        """What initial-snapshot worker processes need: the daemon's connection and producer."""
        cfg = self.config
        assert self._db is not None
        return WorkerSettings(
            dsn=cfg.postgres.dsn.get_secret_value(),
            timeout_s=cfg.postgres.connect_timeout_s,
            producer_config=build_producer_config(
                cfg.kafka.bootstrap_servers, dict(cfg.kafka.producer), "cdcd-snapshot"
            ),
            create_topics=cfg.kafka.create_topics,
            server_name=cfg.kafka.topic_prefix,
            database=self._db.database,
        )

    def _snapshot_done(self, job: Job) -> None:
        if job.initial and self.config.snapshot.mode == "initial_only":
            log.info("snapshot.mode is initial_only and the initial snapshot is complete: exiting")
            self.stop.set()

    def _loop(
        self,
        stream: Stream,
        decoder: PgOutputDecoder,
        assembler: TransactionAssembler,
        tracker: AckTracker,
        sink: Sink,
    ) -> None:
        stop = self.stop
        metrics = self.metrics
        heartbeat_s = self.config.heartbeat.interval_s
        lag_sample_s = self.config.metrics.lag_sample_interval_s
        next_heartbeat = time.monotonic() + heartbeat_s if heartbeat_s > 0 else float("inf")
        next_lag = time.monotonic()
        publisher = self._publisher
        assert publisher is not None
        read_batch = stream.read_batch
        decode = decoder.decode
        feed_batch = assembler.feed_batch
        snapshots = self._snapshots
        received = 0
        last_lsn = 0
        last_flush = 0.0
        reply_due = stream.reply_due
        fill_wait_s = stream.fill_wait_s
        while not stop.is_set():
            batch = read_batch(_POLL_EVERY)
            received += feed_batch(batch, decode)
            drained = len(batch) < _POLL_EVERY
            if batch:
                last_lsn = stream.data_start
                if last_lsn > self._received:
                    self._received = last_lsn
            # Keepalives move wal_end without data (pgoutput skipped the
            # transaction, or it was in another database).
            wal_end = stream.wal_end
            if wal_end > self._received:
                self._received = wal_end
            # Every _POLL_EVERY messages, and whenever the socket is drained.
            sink.poll(0)
            if tracker.failure is not None:
                raise tracker.failure
            if self._delivered_ms:
                self._observe_latency()
            if snapshots is not None:
                snapshots.tick()
            if metrics is not None:
                publisher.flush_metrics()
                if received:
                    metrics.mark_received(last_lsn, received)
                    received = 0
                self._report_sink(metrics, sink, tracker)
                metrics.spill_bytes.set(assembler.spilled_bytes)
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + heartbeat_s
            if now >= next_lag:  # also while catching up, when the socket is never idle
                self._sample_lag()
                next_lag = now + lag_sample_s
            if drained and assembler.idle and tracker.pending_transactions == 0:
                # Nothing in flight: what the walsender sent is all confirmed,
                # so transactions that publish nothing never wait on Kafka.
                tracker.advance_idle(wal_end)
            self._status_if_due(force=reply_due(), caught_up=drained)
            self.state.beat()
            if drained:
                catching_up = len(batch) >= _CATCHING_UP and now - last_flush < _CATCH_UP_FLUSH_S
                if tracker.in_flight and catching_up:
                    # Working off a backlog, ahead of the walsender for a
                    # moment: let its next messages gather in the socket. A
                    # flush here would send what is queued as small batches
                    # and wake both sides for every few messages; measured
                    # on the 1M-row drain, that was a quarter of cdcd's CPU
                    # (docs/performance.md). The flush below still comes
                    # every _CATCH_UP_FLUSH_S, and linger.ms sends meanwhile.
                    self._let_fill(fill_wait_s)
                elif tracker.in_flight:
                    # Caught up with the walsender: send what is queued now
                    # (flush() overrides linger.ms while it runs) and serve its
                    # delivery reports. linger.ms only batches while there
                    # is a backlog, where batching is what keeps up.
                    sink.flush(_IN_FLIGHT_WAIT_S)
                    last_flush = now
                    if self._delivered_ms:
                        self._observe_latency()
                else:
                    stream.wait(_IDLE_WAIT_S)

    # -- confirmation ----------------------------------------------------------------

    def _status_if_due(self, force: bool = False, caught_up: bool = False) -> None:
        """Send a status update if one is due (see the module docstring).

        ``caught_up``: the socket is drained, so new received WAL is reported
        too (what ``remote_write`` waits for) while the server counts cdcd as
        a synchronous standby (sampled every ``metrics.lag_sample_interval_s``);
        otherwise only the confirmed position's moves and the interval send,
        so asynchronous users pay for no extra updates.
        """
        if self._delivered_ms:
            # Every wait that serves delivery reports comes here.
            self._observe_latency()
        stream, tracker = self._stream, self._tracker
        if stream is None or tracker is None or stream.closed:
            return
        now = time.monotonic()
        confirmed = tracker.confirmed
        received = self._received
        if (
            not force
            and confirmed == self._sent_confirmed
            and not (
                caught_up
                and received != self._sent_received
                and self._sync_state in COUNTED_STATES
            )
            and now - self._last_status < self.config.postgres.status_interval_s
        ):
            return
        stream.send_status(Lsn(max(received, confirmed)), confirmed)
        self._last_status = now
        self._sent_received = received
        if confirmed != self._sent_confirmed:
            self._sent_confirmed = confirmed
            self.state.confirmed = confirmed
            log.debug("confirmed %s", confirmed, extra={"lsn": str(confirmed)})
        if self.metrics is not None and (
            confirmed != self._age_confirmed or tracker.pending_transactions == 0
        ):
            # The age restarts when confirmation moves, or when nothing waits
            # (an idle slot is healthy): stuck confirmation keeps ageing.
            self._age_confirmed = confirmed
            self.metrics.mark_confirmed(int(confirmed))

    def _while_blocked(self) -> bool:
        """Called by the sink while the producer queue is full: keep the walsender happy."""
        self._status_if_due()
        self.state.beat()
        return self.stop.is_set()

    def _on_complete(self, ticket: TxnTicket) -> None:
        # Called inside poll()/flush() (the tracker's latency hook): the
        # delivery time is when that call returns, observed then.
        if self.metrics is not None and ticket.commit_ts is not None:
            self._delivered_ms.append(ticket.commit_ts)

    def _observe_latency(self) -> None:
        """Observe the commit-to-acknowledgement latency of the transactions delivered since last time."""
        delivered = self._delivered_ms
        if delivered and self.metrics is not None:
            self._delivered_ms = []
            self.metrics.delivered_many(delivered, time.time())

    def _heartbeat(self) -> None:
        if self._db is not None:
            self._db.emit_heartbeat(HEARTBEAT_PREFIX, self._markers)

    def _sample_lag(self) -> None:
        if self._db is None or self._tracker is None:
            return
        self._sample_sync_state()
        if self.metrics is None:
            return
        current = self._db.current_wal_lsn()
        self.metrics.slot_lag.set(max(0, int(current) - int(self._tracker.confirmed)))
        health = self._db.slot_health(self.config.postgres.slot)
        if health is not None:
            self.metrics.slot_health(
                health.retained_wal_bytes,
                health.wal_status,
                health.wal_keep_size_bytes,
                health.inactive_since.timestamp() if health.inactive_since else None,
            )

    def _sample_sync_state(self) -> None:
        """Whether the server counts cdcd as synchronous (``cdcd_synchronous_standby``,
        the write-only status updates), and one log line whenever that changes."""
        assert self._db is not None
        state = walsender_sync_state(self._db, self.config.postgres.slot)
        if self.metrics is not None:
            self.metrics.synchronous_standby.set(1 if state in COUNTED_STATES else 0)
        if state != self._sync_state:
            if state in COUNTED_STATES or self._sync_state in COUNTED_STATES:
                log.info(
                    "PostgreSQL counts cdcd as %s standby (pg_stat_replication.sync_state %s)%s",
                    "a synchronous" if state in COUNTED_STATES else "an asynchronous",
                    state or "none: not streaming",
                    ": commits wait for Kafka" if state in COUNTED_STATES else "",
                )
            self._sync_state = state

    def _report_sink(self, metrics: Metrics, sink: Sink, tracker: AckTracker) -> None:
        """The producer's gauges, and the time it has waited on a full queue since the last report."""
        metrics.in_flight.set(tracker.in_flight)
        metrics.producer_queue.set(len(sink))
        waited = sink.blocked_s - self._reported_blocked_s
        if waited > 0:
            metrics.producer_queue_full.inc(waited)
            self._reported_blocked_s = sink.blocked_s

    def _drain(self) -> None:
        """On stop: wait for in-flight deliveries, then confirm what was delivered."""
        sink, tracker = self._sink, self._tracker
        if sink is None or tracker is None:
            return
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while len(sink) and time.monotonic() < deadline:
            sink.poll(0.1)
            self._status_if_due()
        if self.metrics is not None:
            if self._publisher is not None:
                self._publisher.flush_metrics()
            self._report_sink(self.metrics, sink, tracker)
        if tracker.failure is not None:
            raise tracker.failure
        self._status_if_due(force=True)
        log.info("stopped; confirmed %s", tracker.confirmed, extra={"lsn": str(tracker.confirmed)})

    def _set_streaming(self, streaming: bool) -> None:
        self.state.streaming = streaming
        self.state.ever_streamed |= streaming
        if self.metrics is not None:
            self.metrics.set_streaming(streaming)
            if not streaming:
                self.metrics.synchronous_standby.set(0)
        if self._on_streaming is not None:
            self._on_streaming(streaming)

    def _close(self) -> None:
        if self._snapshots is not None:
            self._snapshots.close()
        if self._stream is not None:
            try:
                if self._tracker is not None and not self._stream.closed:
                    self._status_if_due(force=True)
            except CdcdError as exc:
                log.warning("final status update failed: %s", exc)
            self._stream.close()
        if self._sink is not None:
            self._sink.close(5.0)
        if self._db is not None:
            self._db.close()
