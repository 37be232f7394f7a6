"""When the session sends a standby status update, and what it reports (no server needed).

A synchronous commit waits for the update that covers it, so an update must
go out as soon as the confirmed position moves -- not on a timer -- and,
once the session has caught up and the server counts it as a synchronous
standby, as soon as more WAL was received (what ``remote_write`` waits for).
Write is the end of the WAL received, never below flush; flush = apply = the
confirmed position.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from cdcd.ack.tracker import AckTracker
from cdcd.config.model import parse_config
from cdcd.pipeline.session import Session
from cdcd.protocol.lsn import Lsn
from cdcd.sink.producer import classify_delivery_report


class FakeStream:
    closed = False

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def send_status(self, written: Lsn, flushed: Lsn, reply: bool = False) -> None:
        self.sent.append((int(written), int(flushed)))


def _session(confirmed: int = 100) -> tuple[Session, FakeStream, AckTracker]:
    config = parse_config(
        {
            "postgres": {"dsn": "host=nowhere", "status_interval_s": 10},
            "kafka": {"bootstrap_servers": "nowhere:9092"},
        }
    )
    session = Session(config, threading.Event())
    stream, tracker = FakeStream(), AckTracker(Lsn(confirmed), classify=classify_delivery_report)
    session._stream = stream  # type: ignore[assignment]
    session._tracker = tracker
    session._received = confirmed
    # An update just went out: only a change may send the next one before the interval.
    session._status_if_due(force=True)
    stream.sent.clear()
    return session, stream, tracker


def test_confirmed_moving_sends_at_once() -> None:
    session, stream, tracker = _session()
    session._status_if_due()
    assert stream.sent == []  # nothing new, the interval has not passed
    ticket = tracker.open()
    ticket.add()
    ticket.seal(Lsn(150))
    session._received = 160
    session._status_if_due()
    assert stream.sent == []  # in flight: flush has not moved, and the socket is not drained
    ticket.on_delivery(None, None)  # Kafka acknowledged
    session._status_if_due()
    assert stream.sent == [(160, 150)]  # right away, a millisecond after the last one
    tracker.advance_idle(Lsn(200))  # a keepalive's WAL end with nothing in flight
    session._received = 200
    session._status_if_due()
    assert stream.sent[-1] == (200, 200)


def test_received_wal_is_reported_once_caught_up_while_synchronous() -> None:
    session, stream, _tracker = _session()
    session._received = 300
    session._status_if_due(caught_up=True)
    assert stream.sent == []  # not a synchronous standby: nobody waits for write
    session._sync_state = "sync"
    session._status_if_due(caught_up=False)
    assert stream.sent == []  # behind: the interval and confirmations carry it
    session._status_if_due(caught_up=True)
    assert stream.sent == [(300, 100)]
    session._status_if_due(caught_up=True)
    assert stream.sent == [(300, 100)]  # nothing new since


def test_write_is_never_below_flush_and_force_sends() -> None:
    session, stream, tracker = _session()
    tracker.advance_idle(Lsn(500))
    session._status_if_due()
    assert stream.sent == [(500, 500)]  # received (100) lags a confirmation from a keepalive
    session._status_if_due(force=True)  # psycopg2 answered a keepalive on its own
    assert stream.sent[-1] == (500, 500) and len(stream.sent) == 2


def test_the_interval_still_sends_when_nothing_moves(monkeypatch: Any) -> None:
    session, stream, _tracker = _session()
    later = time.monotonic() + 11
    monkeypatch.setattr(time, "monotonic", lambda: later)
    session._status_if_due()
    assert stream.sent == [(100, 100)]
