"""Worker processes for the initial snapshot (``snapshot.processes`` > 0).

One process does not get past about 4 µs of CPU per snapshot row (COPY
text, the compiled encoder, and a Kafka client that alone costs ~2.7 µs per
message with its headers), so more rows per second need more cores, and in
Python that means processes. Each worker:

* is started with ``multiprocessing``'s *spawn* context (the daemon runs
  librdkafka threads: it is never forked), and asks the kernel to kill it
  when the daemon dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a
  ``kill -9`` of the daemon leaves no worker behind;
* opens its own connection and imports the snapshot the daemon exported
  from its planning transaction (``BEGIN ISOLATION LEVEL REPEATABLE READ;
  SET TRANSACTION SNAPSHOT '…'``), which is the slot's exported snapshot
  itself; it reports ``txid_current_snapshot()`` and the daemon refuses to
  let it read anything unless that equals its own;
* builds its own idempotent producer with the daemon's producer
  configuration, and its own encoders from the table versions the daemon
  planned (schemas were published by the daemon before: the worker is given
  the wire headers);
* reads the key ranges the daemon hands it one at a time, exactly as a
  reader thread does (``cdcd.snapshot.ranges``), taking each chunk's
  ``cdcd.seq`` block from the daemon's one counter, and reports a range done
  only after ``flush()`` returned with every message acknowledged.

The daemon records a table as read once every range of it is reported done.
A worker's failure, or a worker that dies, fails the snapshot naming the
table it was reading. The protocol is one pipe per worker, strictly
request/answer: the daemon sends a range (or ``stop``) only to a worker that
waits for one, and a worker asks for a ``cdcd.seq`` block and waits for it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import psycopg2

from cdcd.decode.codec import ColumnCodec
from cdcd.decode.relations import TableVersion
from cdcd.envelope.encoder import TableEncoder, make_stamp
from cdcd.errors import CdcdError, DefiniteError, TransientError
from cdcd.naming import LSN_HEADER
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Relation
from cdcd.sink.producer import KafkaSink
from cdcd.snapshot.ranges import prepare_reader, read_error, read_guarded
from cdcd.snapshot.rows import Key, TablePlan, encode_reads
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import SourceDatabase

__all__ = ["WorkerPool", "WorkerSettings", "WorkerTable", "remote_error", "usage_line", "worker_main"]

log = logging.getLogger("cdcd.snapshot")

#: Fault point for tests only: the worker with this index skips ``SET
#: TRANSACTION SNAPSHOT`` (and so reads from a snapshot of its own), to prove
#: that the daemon's check refuses it. The daemon passes it to the worker.
FAULT_NO_IMPORT_WORKER: int | None = None

_PR_SET_PDEATHSIG = 1
_FLUSH_WAIT_S = 1.0


@dataclass(frozen=True)
class WorkerSettings:
    """What the daemon gives every worker process besides its ranges."""

    dsn: str
    timeout_s: float
    producer_config: Mapping[str, Any]
    create_topics: bool
    #: The ``source.name`` and ``source.db`` of the envelopes (the topic
    #: prefix and the database), as the daemon's encoders have them.
    server_name: str
    database: str


@dataclass(frozen=True)
class WorkerTable:
    """One table as a worker needs it: the plan (codecs left out: they are
    closures, rebuilt in the worker) and the headers of its published schemas."""

    plan: TablePlan
    storage: tuple[int, ...]
    topic: str
    key_header: bytes
    value_header: bytes

    @classmethod
    def of(cls, plan: TablePlan, storage: tuple[int, ...], encoder: TableEncoder) -> WorkerTable:
        # The encoder's version: annotated by schema-change tracking (defaults,
        # aliases, type history), which is what its schemas were made from.
        bare = replace(encoder.table, codecs=())
        return cls(
            replace(plan, version=bare),
            storage,
            encoder.topic,
            encoder.key_header,
            encoder.value_header,
        )


@dataclass(frozen=True)
class _Setup:
    index: int
    parent_pid: int
    settings: WorkerSettings
    snapshot: str
    import_snapshot: bool
    consistent_point: int
    ts_ms: int
    chunk_rows: int


class _Headers:
    """A wire format that knows the headers already: the daemon published the schemas."""

    def __init__(self, key: bytes, value: bytes) -> None:
        self._headers = {"key": key, "value": value}

    def header(self, topic: str, role: str, schema: dict[str, Any]) -> bytes:
        return self._headers[role]


class WorkerPool:
    """The daemon's side: the worker processes and one pipe to each."""

    def __init__(
        self,
        count: int,
        settings: WorkerSettings,
        snapshot: str,
        consistent_point: Lsn,
        ts_ms: int,
        chunk_rows: int,
    ) -> None:
        context = spawn_context()
        self._processes: list[Any] = []
        self._conns: list[Connection] = []
        try:
            for index in range(count):
                process, conn = start_worker(
                    context, index, settings, snapshot, consistent_point, ts_ms, chunk_rows
                )
                self._processes.append(process)
                self._conns.append(conn)
        except BaseException:
            self.close()
            raise
        #: Workers still to hear from (not exited).
        self.live = set(range(count))

    def receive(self, timeout_s: float) -> list[tuple[int, tuple[Any, ...] | None]]:
        """One message of each worker that has one within ``timeout_s``; None: it died."""
        conns = {id(self._conns[i]): i for i in self.live}
        ready = wait([self._conns[i] for i in self.live], timeout_s)
        out: list[tuple[int, tuple[Any, ...] | None]] = []
        for ready_conn in ready:
            index = conns[id(ready_conn)]
            try:
                message: tuple[Any, ...] = self._conns[index].recv()
                out.append((index, message))
            except (EOFError, OSError):
                self.live.discard(index)
                self._processes[index].join(5)
                out.append((index, None))
        return out

    def send(self, index: int, message: tuple[Any, ...]) -> None:
        self._conns[index].send(message)

    def finished(self, index: int) -> None:
        """Worker ``index`` said it exits."""
        self.live.discard(index)
        self._processes[index].join(30)

    def pid(self, index: int) -> int:
        return int(self._processes[index].pid or 0)

    def exitcode(self, index: int) -> int | None:
        code: int | None = self._processes[index].exitcode
        return code

    def close(self) -> None:
        """Every worker gone (terminated if it still runs), every pipe closed."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
        for conn in self._conns:
            conn.close()
        self.live = set()


def start_worker(
    context: Any,
    index: int,
    settings: WorkerSettings,
    snapshot: str,
    consistent_point: Lsn,
    ts_ms: int,
    chunk_rows: int,
) -> tuple[Any, Connection]:
    """Spawn worker ``index``; returns the process and the daemon's end of its pipe."""
    ours, theirs = context.Pipe(duplex=True)
    setup = _Setup(
        index,
        os.getpid(),
        settings,
        snapshot,
        FAULT_NO_IMPORT_WORKER != index,
        int(consistent_point),
        ts_ms,
        chunk_rows,
    )
    process = context.Process(
        target=worker_main, args=(theirs, setup), name=f"cdcd-snapshot-{index}", daemon=True
    )
    process.start()
    theirs.close()  # the worker's end lives in the worker: its death is our EOF
    return process, ours


def spawn_context() -> Any:
    return multiprocessing.get_context("spawn")


# -- in the worker process ------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the daemon dies, whatever kills it; gone already: exit now.

    Strictly, the signal comes when the daemon's thread that started us ends:
    that thread runs the snapshot, and ends only after every worker exited.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)  # the daemon died before prctl took effect


class _PipeLog(logging.Handler):
    """The worker's log records, sent to the daemon, which logs them as its own."""

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        super().__init__(logging.INFO)
        self._conn = conn
        self._lock = lock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with self._lock:
                self._conn.send(("log", record.levelno, record.name, record.getMessage()))
        except (OSError, ValueError):
            self.handleError(record)


def _codecs(db: SourceDatabase, version: TableVersion) -> tuple[ColumnCodec, ...]:
    """The column codecs of ``version``, built here from the same type facts as the daemon's."""
    cache = db.relation_cache(PgCatalog(db.conn), snapshot=True)
    built, _ = cache.on_relation(
        Relation(
            None,
            version.relation_id,
            version.schema,
            version.table,
            version.replica_identity,
            version.columns,
        )
    )
    return built.codecs


class _Worker:
    def __init__(self, conn: Connection, setup: _Setup) -> None:
        self.conn = conn
        self.setup = setup
        self.lock = threading.Lock()
        self.db: SourceDatabase | None = None
        self.sink: KafkaSink | None = None
        self.encoders: dict[int, TableEncoder] = {}
        self.failures: list[BaseException] = []
        self.stamp = make_stamp(
            0, Lsn(setup.consistent_point), setup.ts_ms, snapshot=True
        )

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)

    def open(self) -> None:
        settings = self.setup.settings
        db = self.db = SourceDatabase(settings.dsn, timeout_s=settings.timeout_s, bounded=False)
        db.query("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        if self.setup.import_snapshot:
            db.query("SET TRANSACTION SNAPSHOT %s", (self.setup.snapshot,))
        seen = str(db.scalar("SELECT txid_current_snapshot()::text"))
        self.sink = KafkaSink(settings.producer_config, create_topics=settings.create_topics)
        self.send(("ready", os.getpid(), seen))

    def serve(self) -> None:
        assert self.db is not None
        cursor = self.db.conn.cursor()
        prepare_reader(cursor)
        while True:
            command = self.conn.recv()
            if command[0] == "stop":
                return
            _, table, after, upper = command
            name = table.plan.name
            try:
                handed = self.read(cursor, table, after, upper)
            except psycopg2.Error as exc:
                raise read_error(exc, name) from exc
            except CdcdError as exc:
                raise _named(exc, name) from exc
            self.send(("done", handed))

    def read(self, cursor: Any, table: WorkerTable, after: Key | None, upper: Key | None) -> Any:
        assert self.db is not None and self.sink is not None
        encoder = self.encoders.get(table.plan.relation_id)
        if encoder is None:
            version = replace(table.plan.version, codecs=_codecs(self.db, table.plan.version))
            encoder = self.encoders[table.plan.relation_id] = TableEncoder(
                version,
                table.topic,
                self.setup.settings.server_name,
                self.setup.settings.database,
                _Headers(table.key_header, table.value_header),
            )
        sink, stamp, failures = self.sink, self.stamp, self.failures
        lsn_header = (LSN_HEADER, stamp.lsn_header)
        topic = encoder.topic

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None and not failures:
                failures.append(sink.delivery_failure(err, msg))

        def emit(data: bytes, rows: int) -> None:
            self.send(("seq", rows))
            answer = self.conn.recv()
            messages = encode_reads(encoder, data, stamp, int(answer[1]), lsn_header)
            sink.produce_list(topic, messages, on_delivery)
            sink.poll(0)
            if failures:
                raise failures[0]
            self.send(("rows", len(messages)))

        handed = read_guarded(
            cursor,
            table.plan,
            table.storage,
            after,
            upper,
            self.setup.chunk_rows,
            emit,
            lambda: bool(failures),
        )
        # Done means acknowledged: the daemon records the table on our word.
        while sink.flush(_FLUSH_WAIT_S):
            if failures:
                break
        if failures:
            raise failures[0]
        return handed

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close(5.0)
        if self.db is not None:
            self.db.close()


def _named(exc: CdcdError, table: str) -> CdcdError:
    """``exc`` with the table named, of the same kind (transient or definite)."""
    text = f"snapshot of {table}: {exc.args[0] if exc.args else exc}"
    if isinstance(exc, DefiniteError):
        return DefiniteError(text, hint=exc.hint)
    return TransientError(text)


def _usage() -> tuple[float, float]:
    """CPU seconds of this process and its peak RSS in MB.

    The peak is ``VmHWM`` of this process's own memory: ``getrusage``'s
    ``ru_maxrss`` keeps the daemon's high-water mark across the fork and exec
    that started the worker.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak_kb = 0
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                peak_kb = int(line.split()[1])
    return usage.ru_utime + usage.ru_stime, peak_kb / 1024.0


def worker_main(conn: Connection, setup: _Setup) -> None:
    """The worker process: import the snapshot, then read ranges until told to stop."""
    _die_with_parent(setup.parent_pid)
    # Ctrl-C reaches the whole process group: the daemon decides, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _Worker(conn, setup)
    root = logging.getLogger()
    root.handlers[:] = [_PipeLog(conn, worker.lock)]
    root.setLevel(logging.INFO)
    try:
        worker.open()
        worker.serve()
        worker.close()
        cpu_s, rss_mb = _usage()
        worker.send(("exit", cpu_s, rss_mb))
    except BaseException as exc:  # noqa: BLE001 - any failure fails the snapshot: reported to the daemon
        kind = "transient" if isinstance(exc, TransientError) else "definite"
        known = isinstance(exc, CdcdError)
        message = str(exc.args[0]) if known and exc.args else f"{type(exc).__name__}: {exc}"
        hint = getattr(exc, "hint", None) if known else "this is a bug; report it with the log of a run with --debug"
        try:
            worker.send(("failed", kind, message, hint))
        except (OSError, ValueError):
            pass  # the daemon is gone: nobody to tell
        os._exit(1)
    finally:
        conn.close()


def remote_error(kind: str, message: str, hint: str | None) -> CdcdError:
    """A worker's reported failure as the daemon's error."""
    if kind == "transient":
        return TransientError(message)
    return DefiniteError(message, hint=hint)


def usage_line(stats: list[tuple[int, float, float]]) -> tuple[str, dict[str, Any]]:
    """The log line (and its fields) of the workers' CPU and peak memory."""
    cpu = sum(s[1] for s in stats)
    peaks = [round(s[2], 1) for s in stats]
    return (
        f"snapshot workers: {len(stats)} processes, {cpu:.1f} s CPU, peak RSS "
        + ", ".join(f"{p:.0f}" for p in peaks)
        + " MB",
        {"snapshot_workers_cpu_s": cpu, "snapshot_workers_peak_rss_mb": peaks},
    )

