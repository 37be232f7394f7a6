"""Helpers for cdcd as a synchronous standby: the setting, blocked commits, what Kafka holds.

PostgreSQL makes a commit wait (``wait_event = 'SyncRep'`` in
``pg_stat_activity``) until the standbys named in
``synchronous_standby_names`` report its LSN. A test commits on a connection
of its own in a thread (:class:`Commit`) so it can tell a commit that waits
from one that returned, by the server's own account rather than by a
duration, and abandon it if something goes wrong. Every test restores
``synchronous_standby_names = ''`` (which releases every waiting commit).

``statement_timeout`` is no bound here: PostgreSQL disables it before the
commit (or ``PREPARE TRANSACTION``) waits for the standbys (measured: a
PREPARE with a 3 s timeout still waited after 600 s). Only a cancel
(``pg_cancel_backend``) or the setting's change ends such a wait.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from support.cdc import DaemonProcess, read_changes, replay, wait_for

from cdcd.tools.local import LocalBroker, LocalPostgres


def set_standby_names(cluster: LocalPostgres, names: str) -> None:
    """``ALTER SYSTEM SET synchronous_standby_names`` and reload (no restart needed)."""
    cluster.set_setting("synchronous_standby_names", names)


@contextmanager
def synchronous(cluster: LocalPostgres, names: str) -> Iterator[None]:
    """``synchronous_standby_names = names`` for the block, then ``''`` again."""
    set_standby_names(cluster, names)
    try:
        yield
    finally:
        set_standby_names(cluster, "")


def sync_state(cluster: LocalPostgres, application_name: str) -> str | None:
    """``pg_stat_replication.sync_state`` of the walsender named ``application_name``."""
    rows = cluster.execute(
        "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s",
        (application_name,),
    )
    return str(rows[0][0]) if rows else None


def wait_sync_state(cluster: LocalPostgres, application_name: str, *states: str) -> None:
    wait_for(
        lambda: sync_state(cluster, application_name) in states,
        timeout_s=60,
        interval_s=0.05,
        what=f"{application_name} to be a {'/'.join(states)} standby",
    )


class Commit:
    """One autocommit statement on a connection of its own, run in a thread.

    ``mode`` is the session's ``synchronous_commit``. :meth:`waits` asks the
    server whether the backend is waiting for synchronous replication.
    """

    def __init__(self, dsn: str, statement: str, mode: str = "on") -> None:
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute("SET synchronous_commit = %s", (mode,))
        self.pid = self.conn.get_backend_pid()
        self.statement = statement
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self.conn.cursor() as cur:
                cur.execute(self.statement)
                self.result = cur.fetchall() if cur.description else None
        except BaseException as exc:  # noqa: BLE001 - reported by returned()
            self.error = exc
        finally:
            self.done.set()

    @property
    def cancelled(self) -> bool:
        """Whether the wait ended by a cancel (a warning; committed locally), not by the standby."""
        return any("canceling wait for synchronous replication" in n for n in self.conn.notices)

    def returned(self, timeout_s: float = 60.0) -> Any:
        """Wait for the statement to return (by the standby's confirmation); its rows."""
        assert self.done.wait(timeout_s), f"commit of {self.statement!r} did not return"
        if self.error is not None:
            raise self.error
        assert not self.cancelled, f"the wait of {self.statement!r} was cancelled"
        return self.result

    def waits(self, cluster: LocalPostgres) -> bool:
        """The server's view: the backend waits for synchronous replication."""
        rows = cluster.execute(
            "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (self.pid,)
        )
        return bool(rows) and rows[0][0] == "SyncRep" and not self.done.is_set()

    def wait_blocked(self, cluster: LocalPostgres) -> None:
        """Wait until the server shows the commit waiting for the standby."""
        wait_for(
            lambda: self.waits(cluster),
            timeout_s=60,
            interval_s=0.02,
            what=f"{self.statement!r} to wait for synchronous replication",
        )

    def close(self) -> None:
        if not self.conn.closed:
            self.conn.close()


class TopicReader:
    """A consumer assigned to partition 0 of ``topic`` from the beginning; counts messages."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"cdcd-sync-{topic}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
            }
        )
        self.consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self.count = 0

    def wait_count(self, count: int, timeout_s: float = 30.0) -> int:
        """Read until ``count`` messages in all were read (or the timeout); the count read."""
        deadline = threading.Event()
        timer = threading.Timer(timeout_s, deadline.set)
        timer.start()
        try:
            while self.count < count and not deadline.is_set():
                message = self.consumer.poll(0.05)
                if message is not None and message.error() is None:
                    self.count += 1
        finally:
            timer.cancel()
        return self.count

    def close(self) -> None:
        self.consumer.close()


@dataclass
class Scene:
    """A running daemon capturing ``cap`` (not ``unc``) of ``dbname``, a reader of its
    topic, and the test's commits; see :func:`scene`."""

    cluster: LocalPostgres
    broker: LocalBroker
    dbname: str
    daemon: DaemonProcess
    reader: TopicReader
    mode: str = "on"
    commits: list[Commit] = field(default_factory=list)

    @property
    def topic(self) -> str:
        return f"{self.dbname}.public.cap"

    def commit(self, statement: str) -> Commit:
        """Start ``statement`` on a connection of its own (``synchronous_commit = mode``)."""
        self.commits.append(Commit(self.cluster.dsn(self.dbname), statement, self.mode))
        return self.commits[-1]

    def returns_in_kafka(self, statement: str, count: int) -> None:
        """The commit returns, and then Kafka holds ``count`` messages of the topic.

        The daemon is frozen before the topic is read, so it can produce
        nothing more: what is there was there when the commit returned.
        """
        self.commit(statement).returned()
        self.daemon.freeze()
        try:
            read = self.reader.wait_count(count)
            assert read == count, f"{statement!r} returned before Kafka had it ({read}/{count})"
        finally:
            self.daemon.thaw()

    def assert_replay_equals_table(self) -> None:
        changes = read_changes(self.broker.bootstrap_servers, self.dbname, [self.topic])
        rows = self.cluster.execute("SELECT id, note FROM cap", dbname=self.dbname)
        assert replay(changes, ("id",)) == {(i,): {"id": i, "note": n} for i, n in rows}


@contextmanager
def scene(
    cluster: LocalPostgres,
    broker: LocalBroker,
    dbname: str,
    config: Path,
    log_path: Path,
    mode: str = "on",
) -> Iterator[Scene]:
    """Start the daemon on ``config``; afterwards close every commit's connection and kill it."""
    daemon = DaemonProcess(config, log_path)
    running = Scene(cluster, broker, dbname, daemon, TopicReader(broker.bootstrap_servers,
                                                                  f"{dbname}.public.cap"), mode)
    try:
        yield running
    finally:
        running.reader.close()
        for commit in running.commits:
            commit.close()
        running.daemon.kill9()
