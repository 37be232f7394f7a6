"""The LSN confirmation tracker: what may be confirmed to the replication slot, and when.

This module is the one place that implements the guarantee users buy cdcd for
(SPEC §1.5, §7):

    The LSN confirmed to PostgreSQL's slot (the ``flush`` position of the
    standby status update) is the end LSN of the newest transaction whose
    messages, and the messages of every earlier transaction, all have
    successful Kafka delivery reports. It never moves backwards and never
    passes a failed delivery.

Why it matters: PostgreSQL discards WAL, and on reconnect skips every
transaction whose commit record lies before the slot's ``confirmed_flush_lsn``.
Confirming one byte too far loses a transaction for good; confirming too
little only costs duplicates after a restart (at-least-once, de-duplicated by
consumers on ``cdcd.lsn``/``cdcd.seq``). Kafka acknowledges messages out of
order across partitions and topics, so "the last delivery report received"
says nothing about what is safe: only a prefix of transactions in commit order
can be confirmed.

The contract between the pipeline and the tracker (compare supabase/etl's
destination contract, where a batch is acknowledged only once the destination
has durably written it and every batch before it):

1. For every transaction, in commit order, the pipeline calls :meth:`AckTracker.open`
   and gets a :class:`TxnTicket`. For ordinary (non-streamed) pgoutput
   transactions, ``Begin`` order is commit order, so opening at ``Begin`` is
   fine; streamed (v2) transactions are opened at ``StreamCommit``, when their
   spooled changes are produced.
2. For every message it produces for the transaction it calls
   ``ticket.add()`` and passes ``ticket.on_delivery`` (the same bound method
   for every message of the transaction; fetch it once per transaction, as
   each attribute access builds a new bound-method object) as
   confluent-kafka's ``on_delivery``.
   Call ``add()`` *before* ``produce()``: a report can only arrive from a later
   ``poll()``, but an exception from ``produce()`` must leave the ticket
   incomplete, which it does when the message was counted.
3. When every message has been produced (at ``Commit``) it calls
   ``ticket.seal(commit.end_lsn)``. A transaction with no messages (all its
   tables filtered out) is complete as soon as it is sealed.
4. It sends :attr:`AckTracker.confirmed` as the ``flush`` LSN in standby
   status updates, and checks :attr:`AckTracker.failure` after every
   ``poll()``/``flush()``: once a delivery has failed, ``confirmed`` is frozen
   forever and the pipeline must stop; a restart replays from the slot.
5. On a keepalive or heartbeat with nothing in flight it calls
   :meth:`AckTracker.advance_idle` so that an idle slot does not pin WAL,
   and so that a synchronous commit that publishes nothing to cdcd (another
   table, another database) is confirmed at once.
6. For a prepared-but-uncommitted transaction (two-phase, protocol v3) whose
   changes are held back until ``COMMIT PREPARED``, it takes
   ``hold(prepare.prepare_lsn)``: PostgreSQL skips a prepared transaction on
   reconnect when its prepare LSN is before the confirmed position, so
   confirmation must not pass it until the transaction's outcome has been
   delivered. It calls :meth:`AckTracker.release` when the ticket of the
   ``COMMIT PREPARED`` transaction is sealed, or at ``ROLLBACK PREPARED``.

Completion is O(1) amortised per message: tickets sit in a deque in commit
order; a delivery report bumps a counter on its ticket, and only when the
*head* ticket completes does the tracker pop complete tickets off the head.

Latency hook: an optional ``on_complete(ticket)`` callback is called once per
ticket, in commit order, when the ticket and every ticket before it are fully
delivered. The ticket carries the ``commit_ts`` the caller gave to
:meth:`AckTracker.open` (opaque to the tracker; the pipeline passes
PostgreSQL's commit timestamp) so the caller can record commit-to-ack latency.
The callback runs inside ``poll()``/``flush()`` (or inside ``seal()`` for an
empty transaction); an exception from it propagates to that caller.

Threading: none, by design. confluent-kafka runs delivery callbacks inside
``poll()``/``flush()`` on the thread that calls them, which is the pipeline's
thread, so the tracker has no locks. Do not share a tracker between threads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from cdcd.protocol.lsn import Lsn

__all__ = ["AckTracker", "DeliveryClassifier", "Hold", "TxnTicket"]

DeliveryClassifier = Callable[[Any, Any], BaseException]
"""Turns a delivery report's ``(err, msg)`` into the exception stored as :attr:`AckTracker.failure`.

Kafka's error codes are the sink's business, not the tracker's: the pipeline
passes ``KafkaSink.delivery_failure``; without a sink at hand,
``cdcd.sink.producer.classify_delivery_report`` is the plain one."""


class Hold:
    """A bound on confirmation: while active, the tracker confirms nothing past ``lsn``."""

    __slots__ = ("_active", "lsn")

    def __init__(self, lsn: Lsn) -> None:
        self.lsn = lsn
        self._active = True

    @property
    def active(self) -> bool:
        """Whether the hold still bounds confirmation (not yet released)."""
        return self._active

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return f"Hold({self.lsn}, {state})"


class TxnTicket:
    """The delivery state of one transaction's messages.

    Counts messages produced (:meth:`add`) and successfully reported
    (:meth:`on_delivery`); complete once sealed and every produced message is
    reported delivered. Create through :meth:`AckTracker.open` only.
    """

    __slots__ = ("_delivered", "_produced", "_sealed", "_tracker", "commit_ts", "end_lsn", "seq")

    def __init__(self, tracker: AckTracker, seq: int, commit_ts: int | None) -> None:
        self._tracker = tracker
        self._produced = 0
        self._delivered = 0
        self._sealed = False
        self.seq = seq
        """Ordinal of the ticket in this tracker (0, 1, 2... in commit order)."""
        self.commit_ts = commit_ts
        """What the caller passed to :meth:`AckTracker.open`; opaque to the tracker."""
        self.end_lsn: Lsn | None = None
        """The transaction's end LSN, known once sealed."""

    # ------------------------------------------------------------- hot path

    def on_delivery(self, err: Any, msg: Any) -> None:
        """confluent-kafka delivery callback: ``err`` is None on success.

        A failure is recorded on the tracker (the first one wins) and freezes
        confirmation; the message is never counted as delivered, so this
        ticket never completes.
        """
        tracker = self._tracker
        tracker._in_flight -= 1
        if err is not None:
            tracker._fail(tracker._classify(err, msg), self)
            return
        delivered = self._delivered + 1
        self._delivered = delivered
        if delivered >= self._produced:
            self._all_reported(delivered)

    def on_delivered(self, count: int) -> None:
        """``count`` successful reports at once: the same as ``count`` calls of ``on_delivery(None, msg)``.

        The compiled producer (``cdcd.sink._rdkafka``) serves a run of
        successful reports for one ticket through this method, one call
        instead of one per message.
        """
        tracker = self._tracker
        tracker._in_flight -= count
        delivered = self._delivered + count
        self._delivered = delivered
        if delivered >= self._produced:
            self._all_reported(delivered)

    def _all_reported(self, delivered: int) -> None:
        """Every produced message has a report (or more: a bug); complete if sealed."""
        if delivered > self._produced:
            self._tracker._fail(
                RuntimeError(
                    f"delivery report without a produced message on transaction #{self.seq} "
                    f"({delivered} reports for {self._produced} messages): this is a bug"
                ),
                self,
            )
        elif self._sealed:
            self._tracker._ticket_complete(self)

    def add(self, count: int = 1) -> None:
        """Count ``count`` more messages produced (or about to be) for this transaction."""
        if self._sealed:
            raise RuntimeError(f"transaction #{self.seq} is sealed; no more messages may be added")
        if count < 0:
            raise ValueError(f"message count must not be negative: {count}")
        self._produced += count
        self._tracker._in_flight += count

    def seal(self, end_lsn: Lsn) -> None:
        """Every message has been produced; ``end_lsn`` is ``Commit.end_lsn``."""
        if self._sealed:
            raise RuntimeError(f"transaction #{self.seq} is already sealed (at {self.end_lsn})")
        self.end_lsn = end_lsn
        self._sealed = True
        if self._delivered == self._produced:
            self._tracker._ticket_complete(self)

    # ------------------------------------------------------------ inspection

    @property
    def produced(self) -> int:
        """Messages counted with :meth:`add`."""
        return self._produced

    @property
    def delivered(self) -> int:
        """Messages with a successful delivery report."""
        return self._delivered

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal` was called."""
        return self._sealed

    @property
    def complete(self) -> bool:
        """Sealed, and every produced message reported delivered."""
        return self._sealed and self._delivered == self._produced

    def __repr__(self) -> str:
        return (
            f"TxnTicket(#{self.seq}, end_lsn={self.end_lsn}, "
            f"delivered={self._delivered}/{self._produced}, sealed={self._sealed})"
        )


class AckTracker:
    """Computes the LSN that may be confirmed to the slot; see the module docstring.

    ``start`` is the slot's ``confirmed_flush_lsn``. ``on_complete`` is the
    latency hook. ``classify`` turns a failed delivery report ``(err, msg)``
    into the exception kept as :attr:`failure` (required, so that ack does not
    depend on the sink; the pipeline passes its sink's classifier, which knows
    whether topics are managed by cdcd). It is called
    once for every failed report, not only the first: the sink counts
    failures there (``cdcd_delivery_errors_total``).
    """

    __slots__ = (
        "_classify",
        "_confirmed",
        "_failure",
        "_failed_ticket",
        "_hold_limit",
        "_holds",
        "_in_flight",
        "_next_seq",
        "_on_complete",
        "_reached",
        "_tickets",
    )

    def __init__(
        self,
        start: Lsn,
        *,
        classify: DeliveryClassifier,
        on_complete: Callable[[TxnTicket], None] | None = None,
    ) -> None:
        self._confirmed = Lsn(start)
        self._reached = Lsn(start)  # frontier of delivered work, ignoring holds
        self._tickets: deque[TxnTicket] = deque()
        self._holds: list[Hold] = []
        self._hold_limit: Lsn | None = None  # min lsn over active holds
        self._in_flight = 0
        self._next_seq = 0
        self._failure: BaseException | None = None
        self._failed_ticket: TxnTicket | None = None
        self._on_complete = on_complete
        self._classify: DeliveryClassifier = classify

    # ------------------------------------------------------------ public API

    @property
    def confirmed(self) -> Lsn:
        """The LSN that may be sent as the ``flush`` position now."""
        return self._confirmed

    @property
    def in_flight(self) -> int:
        """Messages counted by ``add()`` and not yet reported (successfully or not)."""
        return self._in_flight

    @property
    def pending_transactions(self) -> int:
        """Tickets opened and not yet complete-in-order (unsealed, in flight, or behind one)."""
        return len(self._tickets)

    @property
    def failure(self) -> BaseException | None:
        """The first delivery failure; once set, :attr:`confirmed` never changes again."""
        return self._failure

    @property
    def failed_ticket(self) -> TxnTicket | None:
        """The ticket whose message failed first, for error reports."""
        return self._failed_ticket

    @property
    def holds(self) -> int:
        """Active holds."""
        return len(self._holds)

    def open(self, commit_ts: int | None = None) -> TxnTicket:
        """Start tracking the next transaction in commit order."""
        ticket = TxnTicket(self, self._next_seq, commit_ts)
        self._next_seq += 1
        self._tickets.append(ticket)
        return ticket

    def advance_idle(self, lsn: Lsn) -> bool:
        """Confirm ``lsn`` from a keepalive or heartbeat when nothing is pending.

        Moves only when no ticket is open (unsealed or undelivered), no hold
        exists and no delivery has failed; never backwards. Returns whether
        :attr:`confirmed` moved.
        """
        if self._tickets or self._holds or self._failure is not None:
            return False
        if lsn <= self._confirmed:
            return False
        self._reached = Lsn(lsn)
        self._confirmed = self._reached
        return True

    def hold(self, lsn: Lsn) -> Hold:
        """Keep confirmation at or below ``lsn`` until the hold is released.

        If confirmation already passed ``lsn`` it stays where it is (it never
        moves backwards) and does not advance while the hold is active.
        """
        hold = Hold(Lsn(lsn))
        self._holds.append(hold)
        if self._hold_limit is None or hold.lsn < self._hold_limit:
            self._hold_limit = hold.lsn
        return hold

    def release(self, hold: Hold) -> None:
        """Release a hold; confirmation may catch up with delivered work at once."""
        if not hold._active:
            raise ValueError(f"{hold!r} was already released")
        try:
            self._holds.remove(hold)
        except ValueError:
            raise ValueError(f"{hold!r} does not belong to this tracker") from None
        hold._active = False
        self._hold_limit = min((h.lsn for h in self._holds), default=None)
        self._update_confirmed()

    # -------------------------------------------------------------- internals

    def _ticket_complete(self, ticket: TxnTicket) -> None:
        """A ticket just completed; pop every complete ticket off the head."""
        tickets = self._tickets
        if not tickets or tickets[0] is not ticket:
            return  # an earlier transaction is still in flight: wait for it
        on_complete = self._on_complete
        reached = self._reached
        # What TxnTicket.complete says, without a property call per ticket.
        while tickets and tickets[0]._sealed and tickets[0]._delivered == tickets[0]._produced:
            head = tickets.popleft()
            end = head.end_lsn
            if end is not None and end > reached:
                reached = end
            if on_complete is not None:
                on_complete(head)
        self._reached = reached
        self._update_confirmed()

    def _update_confirmed(self) -> None:
        if self._failure is not None:
            return
        target = self._reached
        limit = self._hold_limit
        if limit is not None and target > limit:
            target = limit
        if target > self._confirmed:
            self._confirmed = target

    def _fail(self, error: BaseException, ticket: TxnTicket) -> None:
        if self._failure is None:
            if ticket.end_lsn is not None:
                error.add_note(f"transaction ending at {ticket.end_lsn} (ticket #{ticket.seq})")
            else:
                error.add_note(f"ticket #{ticket.seq}, not yet sealed")
            error.add_note(f"confirmation stays at {self._confirmed}")
            self._failure = error
            self._failed_ticket = ticket

    def __repr__(self) -> str:
        return (
            f"AckTracker(confirmed={self._confirmed}, pending={len(self._tickets)}, "
            f"in_flight={self._in_flight}, holds={len(self._holds)}, failed={self._failure is not None})"
        )
