"""The LSN confirmation tracker: unit tests and a model-based (stateful) test.

The stateful test drives random interleavings of open/add/seal/deliver/fail/
idle/hold/release over many transactions and checks, after every step, the
guarantee itself rather than the implementation:

- ``confirmed`` never moves backwards;
- it never exceeds the end LSN of the longest fully-delivered prefix of sealed
  transactions (or an idle LSN accepted while nothing was pending);
- it never passes an active hold (unless it had already passed it when the
  hold was taken: it never moves backwards);
- it is frozen from the first failed delivery on;
- and it is exactly what a straightforward model computes (so it does advance
  whenever it may).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cdcd.ack import AckTracker, Hold, TxnTicket
from cdcd.errors import DefiniteError, TransientError
from cdcd.protocol.lsn import Lsn
from cdcd.sink.producer import ProducerFatalError, classify_delivery_report

OK = None
TIMEOUT = KafkaError(KafkaError._MSG_TIMED_OUT)


class _Msg:
    """Enough of confluent_kafka.Message for the classifier."""

    def __init__(self, topic: str, key: bytes = b"k", value: bytes = b"v") -> None:
        self._topic, self._key, self._value = topic, key, value

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value


# --------------------------------------------------------------------- units


def test_starts_at_slot_position() -> None:
    tracker = AckTracker(Lsn(0x100), classify=classify_delivery_report)
    assert tracker.confirmed == 0x100
    assert tracker.in_flight == 0
    assert tracker.pending_transactions == 0
    assert tracker.failure is None


def test_single_transaction_confirms_after_last_report() -> None:
    tracker = AckTracker(Lsn(0x100), classify=classify_delivery_report)
    ticket = tracker.open()
    ticket.add(3)
    ticket.on_delivery(OK, None)
    ticket.on_delivery(OK, None)
    ticket.seal(Lsn(0x200))
    assert tracker.confirmed == 0x100
    assert tracker.in_flight == 1
    ticket.on_delivery(OK, None)
    assert tracker.confirmed == 0x200
    assert tracker.in_flight == 0
    assert tracker.pending_transactions == 0


def test_unsealed_transaction_is_not_confirmed_even_when_delivered() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    ticket.add()
    ticket.on_delivery(OK, None)
    assert tracker.confirmed == 0
    ticket.seal(Lsn(0x50))
    assert tracker.confirmed == 0x50


def test_empty_transaction_completes_at_seal() -> None:
    tracker = AckTracker(Lsn(0x10), classify=classify_delivery_report)
    tracker.open().seal(Lsn(0x20))
    assert tracker.confirmed == 0x20
    assert tracker.pending_transactions == 0


def test_empty_transaction_waits_for_earlier_ones() -> None:
    tracker = AckTracker(Lsn(0x10), classify=classify_delivery_report)
    first = tracker.open()
    first.add()
    first.seal(Lsn(0x20))
    tracker.open().seal(Lsn(0x30))
    assert tracker.confirmed == 0x10
    assert tracker.pending_transactions == 2
    first.on_delivery(OK, None)
    assert tracker.confirmed == 0x30
    assert tracker.pending_transactions == 0


def test_later_transaction_delivered_first_waits() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    a, b, c = tracker.open(), tracker.open(), tracker.open()
    for ticket, end in ((a, 0x10), (b, 0x20), (c, 0x30)):
        ticket.add(2)
        ticket.seal(Lsn(end))
    for _ in range(2):
        c.on_delivery(OK, None)
        b.on_delivery(OK, None)
    assert tracker.confirmed == 0  # a still in flight
    a.on_delivery(OK, None)
    assert tracker.confirmed == 0  # a has one more message
    a.on_delivery(OK, None)
    assert tracker.confirmed == 0x30  # whole prefix at once


def test_failure_freezes_confirmation() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    a, b = tracker.open(), tracker.open()
    a.add()
    a.seal(Lsn(0x10))
    b.add(2)
    b.seal(Lsn(0x20))
    a.on_delivery(OK, None)
    assert tracker.confirmed == 0x10
    b.on_delivery(TIMEOUT, _Msg("pg.public.t"))
    b.on_delivery(OK, None)
    assert tracker.confirmed == 0x10
    failure = tracker.failure
    assert isinstance(failure, TransientError)
    assert "pg.public.t" in str(failure)
    assert any("0/00000020" in note for note in getattr(failure, "__notes__", []))
    assert tracker.failed_ticket is b
    # nothing moves any more: not later transactions, not idle keepalives
    c = tracker.open()
    c.seal(Lsn(0x30))
    assert tracker.confirmed == 0x10
    assert tracker.advance_idle(Lsn(0x40)) is False
    assert tracker.confirmed == 0x10


def test_first_failure_wins_and_is_classified() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    ticket.add(2)
    ticket.on_delivery(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), _Msg("pg.public.big"))
    ticket.on_delivery(TIMEOUT, None)
    failure = tracker.failure
    assert isinstance(failure, DefiniteError)
    assert "pg.public.big" in str(failure)
    assert "max.message.bytes" in str(failure)


def test_fatal_producer_error_is_transient_producer_fatal() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    ticket.add()
    ticket.on_delivery(KafkaError(KafkaError._FATAL, "fenced", fatal=True), _Msg("t"))
    assert isinstance(tracker.failure, ProducerFatalError)


def test_custom_classifier_and_exception_errors() -> None:
    seen: list[object] = []

    def classify(err: object, msg: object) -> BaseException:
        seen.append(err)
        return DefiniteError("custom")

    tracker = AckTracker(Lsn(0), classify=classify)
    ticket = tracker.open()
    ticket.add()
    ticket.on_delivery("boom", None)
    assert str(tracker.failure) == "custom"
    assert seen == ["boom"]


def test_more_reports_than_messages_is_a_failure() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    ticket.add()
    ticket.seal(Lsn(0x10))
    ticket.on_delivery(OK, None)
    assert tracker.confirmed == 0x10
    ticket.on_delivery(OK, None)
    assert isinstance(tracker.failure, RuntimeError)
    assert "bug" in str(tracker.failure)


def test_ticket_misuse_raises() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    with pytest.raises(ValueError):
        ticket.add(-1)
    ticket.seal(Lsn(1))
    with pytest.raises(RuntimeError):
        ticket.add()
    with pytest.raises(RuntimeError):
        ticket.seal(Lsn(2))


def test_advance_idle_only_when_nothing_pending() -> None:
    tracker = AckTracker(Lsn(0x10), classify=classify_delivery_report)
    assert tracker.advance_idle(Lsn(0x20)) is True
    assert tracker.confirmed == 0x20
    assert tracker.advance_idle(Lsn(0x18)) is False  # never backwards
    assert tracker.confirmed == 0x20
    ticket = tracker.open()  # open, unsealed, no messages
    assert tracker.advance_idle(Lsn(0x30)) is False
    ticket.add()
    ticket.seal(Lsn(0x28))
    assert tracker.advance_idle(Lsn(0x30)) is False  # sealed but in flight
    ticket.on_delivery(OK, None)
    assert tracker.confirmed == 0x28
    assert tracker.advance_idle(Lsn(0x30)) is True
    assert tracker.confirmed == 0x30


def test_hold_bounds_confirmation_until_released() -> None:
    tracker = AckTracker(Lsn(0x10), classify=classify_delivery_report)
    hold = tracker.hold(Lsn(0x25))
    assert isinstance(hold, Hold) and hold.active
    a = tracker.open()
    a.seal(Lsn(0x20))
    assert tracker.confirmed == 0x20  # below the hold: fine
    b = tracker.open()
    b.seal(Lsn(0x40))
    assert tracker.confirmed == 0x25  # stops at the hold
    assert tracker.advance_idle(Lsn(0x50)) is False  # no idle advance while held
    tracker.release(hold)
    assert not hold.active
    assert tracker.confirmed == 0x40  # catches up with what was delivered
    assert tracker.advance_idle(Lsn(0x50)) is True


def test_several_holds_lowest_wins() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    high = tracker.hold(Lsn(0x30))
    low = tracker.hold(Lsn(0x20))
    tracker.open().seal(Lsn(0x40))
    assert tracker.confirmed == 0x20
    tracker.release(low)
    assert tracker.confirmed == 0x30
    tracker.release(high)
    assert tracker.confirmed == 0x40
    assert tracker.holds == 0


def test_hold_below_confirmed_never_moves_backwards() -> None:
    tracker = AckTracker(Lsn(0x50), classify=classify_delivery_report)
    hold = tracker.hold(Lsn(0x20))
    tracker.open().seal(Lsn(0x60))
    assert tracker.confirmed == 0x50
    tracker.release(hold)
    assert tracker.confirmed == 0x60


def test_release_twice_or_foreign_hold_raises() -> None:
    tracker, other = (
        AckTracker(Lsn(0), classify=classify_delivery_report),
        AckTracker(Lsn(0), classify=classify_delivery_report),
    )
    hold = tracker.hold(Lsn(1))
    tracker.release(hold)
    with pytest.raises(ValueError):
        tracker.release(hold)
    with pytest.raises(ValueError):
        tracker.release(other.hold(Lsn(1)))


def test_on_complete_in_commit_order_with_commit_ts() -> None:
    done: list[tuple[int, int | None, Lsn | None]] = []

    def on_complete(ticket: TxnTicket) -> None:
        done.append((ticket.seq, ticket.commit_ts, ticket.end_lsn))

    tracker = AckTracker(Lsn(0), classify=classify_delivery_report, on_complete=on_complete)
    a = tracker.open(commit_ts=111)
    b = tracker.open(commit_ts=222)
    a.add()
    b.add()
    a.seal(Lsn(0x10))
    b.seal(Lsn(0x20))
    b.on_delivery(OK, None)
    assert done == []
    a.on_delivery(OK, None)
    assert done == [(0, 111, Lsn(0x10)), (1, 222, Lsn(0x20))]


def test_decreasing_end_lsn_does_not_move_backwards() -> None:
    tracker = AckTracker(Lsn(0x100), classify=classify_delivery_report)
    tracker.open().seal(Lsn(0x80))  # replayed transaction before the slot position
    assert tracker.confirmed == 0x100


def test_large_transaction_is_linear() -> None:
    """A million-message transaction: O(1) per report, no per-message state."""
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    ticket = tracker.open()
    n = 1_000_000
    ticket.add(n)
    ticket.seal(Lsn(0x10))
    report = ticket.on_delivery
    for _ in range(n):
        report(None, None)
    assert tracker.confirmed == 0x10
    assert tracker.in_flight == 0


def test_many_transactions_pop_in_order() -> None:
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    tickets = [tracker.open() for _ in range(10_000)]
    for i, ticket in enumerate(tickets):
        ticket.add()
        ticket.seal(Lsn(i + 1))
    for ticket in reversed(tickets[1:]):
        ticket.on_delivery(OK, None)
    assert tracker.confirmed == 0
    assert tracker.pending_transactions == 10_000
    tickets[0].on_delivery(OK, None)
    assert tracker.confirmed == 10_000
    assert tracker.pending_transactions == 0


# ------------------------------------------------------------ stateful model


@dataclass
class _Txn:
    ticket: TxnTicket
    end: int
    produced: int = 0
    ok: int = 0
    unreported: int = 0
    sealed: bool = False
    failed: bool = False

    @property
    def complete(self) -> bool:
        return self.sealed and not self.failed and self.ok == self.produced


@dataclass
class _HoldState:
    hold: Hold
    lsn: int
    confirmed_when_taken: int


@dataclass
class _Model:
    start: int
    txns: list[_Txn] = field(default_factory=list)
    idle_reached: int = 0
    holds: list[_HoldState] = field(default_factory=list)
    failed: bool = False


class TrackerMachine(RuleBasedStateMachine):
    """Random interleavings; LSNs follow stream order like a real walsender."""

    def __init__(self) -> None:
        super().__init__()
        self.start = 0x1000
        self.tracker = AckTracker(Lsn(self.start), classify=classify_delivery_report)
        self.model = _Model(start=self.start, idle_reached=self.start)
        self.lsn = self.start  # stream position: every new LSN is beyond it
        self.last_confirmed = self.start
        self.frozen_at: int | None = None
        self.completed: list[int] = []

    # ---- helpers

    def _next_lsn(self, gap: int) -> int:
        self.lsn += gap
        return self.lsn

    def _pick(self, index: int, candidates: list[_Txn]) -> _Txn:
        return candidates[index % len(candidates)]

    def _expected(self) -> int:
        """What a trivially correct model confirms."""
        if self.frozen_at is not None:
            return self.frozen_at
        reached = self.model.idle_reached
        for txn in self.model.txns:
            if not txn.complete:
                break
            reached = max(reached, txn.end)
        if self.model.holds:
            reached = min(reached, min(h.lsn for h in self.model.holds))
        return max(self.last_confirmed, reached)

    # ---- rules

    @rule(gap=st.integers(1, 0x100), empty_seal=st.booleans())
    def open_txn(self, gap: int, empty_seal: bool) -> None:
        ticket = self.tracker.open()
        txn = _Txn(ticket=ticket, end=self._next_lsn(gap))
        self.model.txns.append(txn)
        if empty_seal:  # a transaction whose tables are all filtered out
            ticket.seal(Lsn(txn.end))
            txn.sealed = True

    @precondition(lambda self: any(not t.sealed for t in self.model.txns))
    @rule(index=st.integers(0, 1000), count=st.integers(0, 4))
    def add(self, index: int, count: int) -> None:
        txn = self._pick(index, [t for t in self.model.txns if not t.sealed])
        txn.ticket.add(count)
        txn.produced += count
        txn.unreported += count

    @precondition(lambda self: any(not t.sealed for t in self.model.txns))
    @rule(index=st.integers(0, 1000))
    def seal(self, index: int) -> None:
        txn = self._pick(index, [t for t in self.model.txns if not t.sealed])
        txn.ticket.seal(Lsn(txn.end))
        txn.sealed = True

    @precondition(lambda self: any(t.unreported for t in self.model.txns))
    @rule(index=st.integers(0, 1000), fail=st.integers(0, 40))
    def deliver(self, index: int, fail: int) -> None:
        txn = self._pick(index, [t for t in self.model.txns if t.unreported])
        txn.unreported -= 1
        if fail == 0:  # about one report in 40 fails
            txn.ticket.on_delivery(TIMEOUT, _Msg("pg.public.t"))
            txn.failed = True
            if self.frozen_at is None:
                self.frozen_at = self.tracker.confirmed
        else:
            txn.ticket.on_delivery(OK, None)
            txn.ok += 1

    @precondition(lambda self: any(t.unreported for t in self.model.txns))
    @rule(index=st.integers(0, 1000), count=st.integers(1, 4))
    def deliver_run(self, index: int, count: int) -> None:
        """A run of successes as the compiled producer serves it: one on_delivered(count)."""
        txn = self._pick(index, [t for t in self.model.txns if t.unreported])
        count = min(count, txn.unreported)
        txn.unreported -= count
        txn.ticket.on_delivered(count)
        txn.ok += count

    @rule(gap=st.integers(0, 0x100), stale=st.booleans())
    def idle(self, gap: int, stale: bool) -> None:
        lsn = max(self.lsn - gap, 0) if stale else self._next_lsn(gap)
        before = self.tracker.confirmed
        moved = self.tracker.advance_idle(Lsn(lsn))
        nothing_pending = all(t.complete for t in self.model.txns)
        allowed = nothing_pending and not self.model.holds and self.frozen_at is None
        if allowed and lsn > before:
            assert moved
            self.model.idle_reached = lsn
        else:
            assert not moved

    @rule(gap=st.integers(0, 0x100), stale=st.booleans())
    def take_hold(self, gap: int, stale: bool) -> None:
        lsn = max(self.lsn - gap, 0) if stale else self._next_lsn(gap)
        hold = self.tracker.hold(Lsn(lsn))
        self.model.holds.append(_HoldState(hold, lsn, self.tracker.confirmed))

    @precondition(lambda self: bool(self.model.holds))
    @rule(index=st.integers(0, 1000))
    def release(self, index: int) -> None:
        state = self.model.holds.pop(index % len(self.model.holds))
        self.tracker.release(state.hold)

    # ---- invariants

    @invariant()
    def confirmed_is_monotonic_and_exact(self) -> None:
        confirmed = self.tracker.confirmed
        assert confirmed >= self.last_confirmed, "confirmed moved backwards"
        assert confirmed == self._expected()
        self.last_confirmed = confirmed

    @invariant()
    def never_beyond_delivered_prefix(self) -> None:
        bound = self.model.idle_reached
        for txn in self.model.txns:
            if not txn.complete:
                break
            bound = max(bound, txn.end)
        assert self.tracker.confirmed <= max(bound, self.start)

    @invariant()
    def never_passes_a_hold(self) -> None:
        for state in self.model.holds:
            assert self.tracker.confirmed <= max(state.lsn, state.confirmed_when_taken)

    @invariant()
    def frozen_after_failure(self) -> None:
        if self.frozen_at is not None:
            assert self.tracker.failure is not None
            assert self.tracker.confirmed == self.frozen_at
        else:
            assert self.tracker.failure is None

    @invariant()
    def counters_match(self) -> None:
        assert self.tracker.in_flight == sum(t.unreported for t in self.model.txns)
        # tickets not yet popped: everything from the first incomplete one on
        first_incomplete = next(
            (i for i, t in enumerate(self.model.txns) if not t.complete), len(self.model.txns)
        )
        assert self.tracker.pending_transactions == len(self.model.txns) - first_incomplete


TrackerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tracker_model = TrackerMachine.TestCase
