"""The real session loop with injected parts: a scripted stream and a faulty sink (issue 25).

``Session`` takes its connections from ``SessionParts`` factories. Here the
metadata connection is a real PostgreSQL database (the startup plan runs
against it, as in production); the replication stream is a script that
replays real pgoutput bytes, read beforehand from that database's own slot;
the sink is ``support.fault_sink.FaultSink``, reporting deliveries reordered
across partitions a few at a time, failing one, blocking on a full queue, or
withholding every report (a stalled flush).

The stream answers "psycopg2 replied to a keepalive" at every turn of the
loop, so the session sends a standby status update at every turn; each one
is recorded with the transactions whose messages Kafka had not all
acknowledged at that instant. The contract (SPEC §1.5): the confirmed
position (``flush``) never reaches the end of such a transaction, never moves
back, and reaches the end of the last commit once everything is acknowledged.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.fault_sink import FaultSink
from support.pg import PgDatabase, create_publication, create_slot, lsn_to_int, read_pgoutput

from cdcd.config.model import CdcdConfig
from cdcd.errors import TransientError
from cdcd.observability.metrics import Metrics
from cdcd.pipeline import session as session_module
from cdcd.pipeline.parts import SessionParts, real_parts
from cdcd.pipeline.session import Session
from cdcd.protocol.lsn import Lsn
from cdcd.sink.topics import TopicSpec

pytestmark = pytest.mark.integration

_names = itertools.count(1)

#: Reads of an exhausted script before the stream gives up and stops the session
#: (the test then fails: confirmation did not reach the last commit).
IDLE_LIMIT = 5000


@dataclass(frozen=True)
class Txn:
    commit_lsn: int
    end_lsn: int
    messages: int  # what the publisher produces for it: a row each, and a tombstone per delete


@dataclass(frozen=True)
class Capture:
    dsn: str
    payloads: list[tuple[int, bytes]]
    txns: list[Txn]


@dataclass
class Msg:
    """A message of the script: its payload (what ``read_batch`` returns) and WAL positions."""

    payload: bytes
    data_start: int
    wal_end: int


def _transactions(payloads: list[tuple[int, bytes]]) -> list[Txn]:
    txns, count = [], 0
    for _, payload in payloads:
        tag = payload[:1]
        if tag == b"B":
            count = 0
        elif tag in (b"I", b"U"):
            count += 1
        elif tag == b"D":
            count += 2
        elif tag == b"C":
            commit = int.from_bytes(payload[2:10], "big")
            end = int.from_bytes(payload[10:18], "big")
            txns.append(Txn(commit, end, count))
    return txns


@pytest.fixture(scope="module")
def capture(pg_cluster: Any) -> Iterator[Capture]:
    """One database, its publication and slot, and the pgoutput its workload gave on that slot."""
    db = PgDatabase(cluster=pg_cluster, dbname=f"session_faults_{next(_names)}")
    pg_cluster.create_database(db.dbname)
    try:
        db.execute("CREATE TABLE a(id int PRIMARY KEY, v text)")
        db.execute("CREATE TABLE b(id int PRIMARY KEY, v text)")
        conn = db.connect()
        create_publication(conn, "cdcd", ["public.a", "public.b"])
        create_slot(conn, "cdcd")
        for n in range(12):
            rows = ", ".join(f"({n * 10 + i}, 'v{n}_{i}')" for i in range(1 + n % 4))
            db.execute(f"INSERT INTO {'ab'[n % 2]} VALUES {rows}")
            if n % 3 == 2:
                db.execute(f"UPDATE a SET v = v || 'u' WHERE id % 3 = {n % 3}")
            if n % 5 == 4:
                db.execute(f"DELETE FROM b WHERE id = {(n - 3) * 10}")
        payloads = read_pgoutput(db.dsn, "cdcd", "cdcd")
        txns = _transactions(payloads)
        assert len(txns) >= 12 and all(t.messages for t in txns), txns
        yield Capture(db.dsn, payloads, txns)
    finally:
        db.drop()


def _config(dsn: str) -> CdcdConfig:
    return CdcdConfig.model_validate({
        "postgres": {
            "dsn": dsn, "slot": "cdcd", "publication": "cdcd", "create_publication": False,
            "tables": ["public.a", "public.b"], "status_interval_s": 1,
        },
        "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic_prefix": "pg", "create_topics": False},
        "snapshot": {"mode": "never"},
        "schema_changes": {"resnapshot": "never", "check_interval_s": 0},
        "metrics": {"listen": "127.0.0.1:0"},
        "heartbeat": {"interval_s": 0},
    })


class TrickleSink(FaultSink):
    """``FaultSink`` that reports at most ``per_poll`` messages per poll (across partitions
    at random, each partition in order, with ``reorder``), so that later transactions are
    acknowledged before earlier ones while the session watches; and that can fail the first
    message of the transaction committed at ``fail_commit``."""

    def __init__(self, *, per_poll: int | None = None, fail_commit: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.per_poll = per_poll
        self.fail_commit = fail_commit
        self.should_stop: Callable[[], bool] | None = None

    def produce(self, topic: str, key: bytes | None, value: bytes | None, headers: Any,
                on_delivery: Callable[[Any, Any], None]) -> None:
        lsn = dict(headers).get("cdcd.lsn")
        if self.fail_commit is not None and lsn and lsn_to_int(lsn.decode()) == self.fail_commit:
            self.fail_nth(len(self.produced) + 1)
            self.fail_commit = None
        super().produce(topic, key, value, headers, on_delivery)

    def poll(self, timeout: float = 0.0) -> int:
        if self.per_poll is None or self._delayed or not self._pending:
            return super().poll(timeout)
        batch = self._reordered(list(self._pending)) if self.reorder else list(self._pending)
        chosen = batch[: self.per_poll]
        taken = {id(message) for message in chosen}
        self._pending = deque(m for m in self._pending if id(m) not in taken)
        for message in chosen:
            self._report(message)
        self.raise_if_fatal()
        return len(chosen)


Step = list[Msg] | Callable[[], None]


@dataclass
class ScriptedStream:
    """A replication stream that plays ``script``: batches of messages (an empty one is a read
    that finds the socket drained) and actions run before the next read."""

    script: deque[Step]
    on_status: Callable[[int, int], None]
    stop: threading.Event
    started_at: int | None = None
    idle_reads: int = 0
    _data_start: int = 0
    _wal_end: int = 0
    _closed: bool = False
    fill_wait_s: float = 0.0005
    statuses: list[tuple[int, int]] = field(default_factory=list)

    def start(self, start_lsn: Lsn) -> None:
        self.started_at = int(start_lsn)

    def read_batch(self, limit: int) -> list[bytes]:
        while self.script and callable(self.script[0]):
            action = self.script.popleft()
            assert callable(action)
            action()
        if not self.script:
            self.idle_reads += 1
            if self.idle_reads > IDLE_LIMIT:
                self.stop.set()
            return []
        batch = self.script.popleft()
        assert isinstance(batch, list) and len(batch) <= limit
        if batch:
            self._data_start = batch[-1].data_start
            self._wal_end = max(self._wal_end, batch[-1].data_start)
        return [message.payload for message in batch]

    @property
    def data_start(self) -> Lsn:
        return Lsn(self._data_start)

    @property
    def wal_end(self) -> Lsn:
        return Lsn(self._wal_end)

    def wait(self, timeout_s: float) -> None:
        pass  # nothing arrives but what the script says

    def reply_due(self) -> bool:
        return True  # a status update at every turn of the loop: every turn is observed

    def send_status(self, written: Lsn, flushed: Lsn, reply: bool = False) -> None:
        self.statuses.append((int(written), int(flushed)))
        self.on_status(int(written), int(flushed))

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass
class Run:
    """One session over the capture; what it confirmed, and what was unacknowledged then."""

    capture: Capture
    sink: TrickleSink
    stop: threading.Event = field(default_factory=threading.Event)
    #: (flushed, ends of the transactions not all acknowledged at that instant)
    observed: list[tuple[int, list[int]]] = field(default_factory=list)
    #: the flushed positions sent while the sink withheld every report
    stalled: list[int] = field(default_factory=list)

    def unacknowledged(self) -> list[Txn]:
        delivered = Counter(
            lsn_to_int(m.header("cdcd.lsn").decode())  # type: ignore[union-attr]
            for m in self.sink.delivered
            if m.header("cdcd.lsn") is not None
        )
        return [t for t in self.capture.txns if delivered[t.commit_lsn] < t.messages]

    def on_status(self, written: int, flushed: int) -> None:
        pending = self.unacknowledged()
        self.observed.append((flushed, [t.end_lsn for t in pending]))
        if self.sink._delayed:
            self.stalled.append(flushed)
        if not pending and flushed >= self.capture.txns[-1].end_lsn:
            self.stop.set()  # all there: the session drains and returns

    def session(self, script: list[Step], metrics: Metrics | None = None) -> tuple[Session, ScriptedStream]:
        stream = ScriptedStream(deque(script), self.on_status, self.stop)
        real = real_parts(_config(self.capture.dsn))
        sink = self.sink

        def make_sink(*, should_stop: Callable[[], bool] | None = None,
                      on_failed_delivery: Callable[[str], None] | None = None) -> TrickleSink:
            sink.should_stop = should_stop
            return sink

        def no_topic(spec: TopicSpec) -> None:
            raise AssertionError(f"kafka.create_topics is off, yet {spec} was to be created")

        parts = SessionParts(
            database=real.database,
            stream=lambda: stream,
            sink=make_sink,
            check_broker=lambda: "a FaultSink",
            ensure_topic=no_topic,
        )
        return Session(_config(self.capture.dsn), self.stop, metrics, parts=parts), stream

    def assert_never_passed_unacknowledged(self) -> None:
        assert self.observed, "no status update was sent"
        previous = 0
        for flushed, pending in self.observed:
            passed = [end for end in pending if flushed >= end]
            assert not passed, (
                f"confirmed {Lsn(flushed)} while the transactions ending at "
                f"{[str(Lsn(e)) for e in passed]} were not all acknowledged"
            )
            assert flushed >= previous, f"confirmation moved back: {Lsn(previous)} -> {Lsn(flushed)}"
            previous = flushed

    def assert_reached_last_commit(self) -> None:
        last = self.capture.txns[-1].end_lsn
        assert self.observed[-1][0] == last, (
            f"confirmed {Lsn(self.observed[-1][0])}, not the last commit's end {Lsn(last)}"
        )
        assert not self.unacknowledged()


def _messages(capture: Capture) -> list[list[Msg]]:
    """The capture as one batch per transaction (Relation messages go with their transaction)."""
    batches: list[list[Msg]] = [[]]
    for data_start, payload in capture.payloads:
        batches[-1].append(Msg(payload, data_start, data_start))
        if payload[:1] == b"C":
            batches.append([])
    return [batch for batch in batches if batch]


def test_reordered_acknowledgements_confirm_only_a_delivered_prefix(capture: Capture) -> None:
    """Reports come three at a time, partitions interleaved at random: later transactions are
    acknowledged before earlier ones, and confirmation waits for the earlier ones."""
    run = Run(capture, TrickleSink(partitions=3, reorder=True, seed=7, per_poll=3))
    batches = _messages(capture)
    # Everything at once (one read), so many transactions are in flight together.
    session, stream = run.session([[m for batch in batches for m in batch]])
    session.run()
    assert stream.started_at is not None and stream.started_at < capture.txns[0].end_lsn
    run.assert_never_passed_unacknowledged()
    run.assert_reached_last_commit()
    # The reordering did happen: some status saw a later transaction done before an earlier one.
    ends = [t.end_lsn for t in capture.txns]
    assert any(pending and pending != ends[len(ends) - len(pending):] for _, pending in run.observed)


def test_a_failed_delivery_freezes_confirmation_before_its_transaction(capture: Capture) -> None:
    failing = capture.txns[5]
    run = Run(capture, TrickleSink(partitions=3, reorder=True, seed=3, per_poll=2,
                                   fail_commit=failing.commit_lsn))
    session, _ = run.session(_messages(capture))  # one transaction per read
    with pytest.raises(TransientError):
        session.run()
    run.assert_never_passed_unacknowledged()
    assert max(flushed for flushed, _ in run.observed) < failing.end_lsn
    assert run.sink.failed, "the injected failure was not reported"


def test_a_full_queue_blocks_produce_and_confirms_nothing_unacknowledged(capture: Capture) -> None:
    """A queue of 4 with reports withheld: produce blocks (the session's should_stop keeps the
    walsender informed meanwhile), then reports come back and confirmation catches up.
    The time blocked (here a fake half second per wait) reaches the queue-full counter."""
    sink = TrickleSink(partitions=3, queue_limit=4, per_poll=1)
    run = Run(capture, sink)
    blocked = Counter[str]()
    metrics = Metrics(process_collectors=False)

    def on_block(s: FaultSink) -> None:
        blocked["calls"] += 1
        s.blocked_s += 0.5
        assert sink.should_stop is not None
        assert not sink.should_stop()  # the session's status update while blocked
        if blocked["calls"] % 7 == 0:
            s.release()

    sink.on_block = on_block
    batches = _messages(capture)
    # Reports withheld from the third transaction on: both tables' schemas are published
    # (and acknowledged) by then, as a schema waits for its acknowledgement.
    script: list[Step] = [batches[0], batches[1]]
    for batch in batches[2:]:
        script += [sink.delay_deliveries, batch]
    script.append(sink.release)
    session, _ = run.session(script, metrics)
    session.run()
    assert sink.blocked_count > 0 and blocked["calls"] > 0
    waited = metrics.registry.get_sample_value("cdcd_producer_queue_full_seconds_total")
    assert waited == 0.5 * blocked["calls"]
    run.assert_never_passed_unacknowledged()
    run.assert_reached_last_commit()


def test_a_stalled_flush_holds_confirmation_until_reports_come(capture: Capture) -> None:
    """Every report withheld while the stream is idle: the loop's flush returns with nothing
    delivered, over and over; confirmation stays before the first undelivered transaction,
    then reaches the last commit once the reports come."""
    sink = TrickleSink(partitions=3, reorder=True, seed=11, per_poll=4)
    run = Run(capture, sink)
    batches = _messages(capture)
    def idle(reads: int) -> list[Step]:
        return [[] for _ in range(reads)]

    script: list[Step] = [batches[0], batches[1], *idle(20), sink.delay_deliveries,
                          *batches[2:], *idle(50), sink.release]
    session, _ = run.session(script)
    session.run()
    run.assert_never_passed_unacknowledged()
    assert len(run.stalled) >= 50, "the session did not keep reporting while the flush stalled"
    assert max(run.stalled) == capture.txns[1].end_lsn  # delivered before the stall, no further
    run.assert_reached_last_commit()


def _catch_up_run(capture: Capture, monkeypatch: pytest.MonkeyPatch, flush_every_s: float) -> list[str]:
    """The capture in drained reads of 6 messages while reports trickle back one per poll
    (so messages stay in flight): what the loop did after each read, in order."""
    monkeypatch.setattr(session_module, "_CATCHING_UP", 4)
    monkeypatch.setattr(session_module, "_CATCH_UP_FLUSH_S", flush_every_s)
    sink = TrickleSink(partitions=3, per_poll=1)
    run = Run(capture, sink)
    messages = [m for batch in _messages(capture) for m in batch]
    script: list[Step] = [messages[i : i + 6] for i in range(0, len(messages), 6)]
    session, stream = run.session(script)
    events: list[str] = []
    read_batch, flush = stream.read_batch, sink.flush

    def recorded_read(limit: int) -> list[bytes]:
        batch = read_batch(limit)
        events.append(f"read {len(batch)}")
        return batch

    def recorded_flush(timeout_s: float = 0.0) -> int:
        events.append(f"flush {timeout_s}")
        return flush(timeout_s)

    stream.read_batch = recorded_read  # type: ignore[method-assign]
    sink.flush = recorded_flush  # type: ignore[method-assign]
    session._let_fill = lambda seconds: events.append(f"fill {seconds}")
    session.run()
    run.assert_never_passed_unacknowledged()
    run.assert_reached_last_commit()
    return events


def test_a_backlog_lets_the_socket_fill_instead_of_flushing_each_read(
    capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads of a backlog that leave the socket drained for a moment: the loop waits for more
    to arrive instead of flushing the producer, until the reads are small again (caught up);
    confirmation is as exact as ever."""
    events = _catch_up_run(capture, monkeypatch, flush_every_s=1e9)
    loop_flush = f"flush {session_module._IN_FLIGHT_WAIT_S}"  # schemas flush on their own
    first_idle = events.index("read 0")
    backlog = events[:first_idle]
    assert backlog.count("fill 0.0005") >= 3  # the stream's fill_wait_s
    assert loop_flush not in backlog
    assert loop_flush in events[first_idle:]  # caught up: what lingers is sent at once


def test_a_backlog_still_flushes_at_the_set_interval(
    capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the flush interval at 0 every drained read with messages in flight flushes."""
    events = _catch_up_run(capture, monkeypatch, flush_every_s=0.0)
    assert not [e for e in events if e.startswith("fill")]
    assert events.count(f"flush {session_module._IN_FLIGHT_WAIT_S}") >= 3
