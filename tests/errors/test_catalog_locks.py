"""The metadata connection is bounded: a lock held by a migration delays cdcd loudly.

``SourceDatabase`` sessions start with ``lock_timeout`` and
``statement_timeout`` (``METADATA_LOCK_TIMEOUT``, ``METADATA_STATEMENT_TIMEOUT``),
for cdcd's own sessions only. A catalog query queued behind an ACCESS
EXCLUSIVE lock fails with 55P03 and is retried with a log line, and proceeds
once the lock is gone; slot creation, which rightly waits for every open
transaction, is not cut short.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg2
import pytest
from support.cdc import wait_for

from cdcd.errors import TransientError
from cdcd.source.connection import METADATA_LOCK_TIMEOUT
from cdcd.source.database import SourceDatabase

pytestmark = pytest.mark.integration


def _locked(pg: Any, table: str) -> Any:
    """A session holding ``table`` in ACCESS EXCLUSIVE mode (roll it back to release)."""
    holder = pg.connect()
    holder.autocommit = False
    with holder.cursor() as cur:
        cur.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    return holder


def test_a_catalog_query_behind_a_lock_fails_transiently(pg) -> None:
    with SourceDatabase(pg.dsn) as db:
        assert db.scalar("SHOW lock_timeout") == METADATA_LOCK_TIMEOUT
        assert db.scalar("SHOW statement_timeout") != "0"
        # Do no harm: nobody else's session changes.
        assert pg.fetchone("SHOW lock_timeout") == ("0",)
        holder = _locked(pg, "pg_catalog.pg_publication")
        outcome: list[BaseException | bool] = []

        def ask() -> None:
            try:
                outcome.append(db.publication_exists("cdcd"))
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome.append(exc)

        worker = threading.Thread(target=ask, daemon=True)
        worker.start()
        try:
            wait_for(lambda: outcome, timeout_s=60, what="the catalog query to give up")
        finally:
            holder.rollback()
            holder.close()
        failure = outcome[0]
        assert isinstance(failure, TransientError), failure
        assert "lock_timeout" in str(failure) and "retrying" in str(failure), failure
        assert db.publication_exists("cdcd") is False  # the session is usable afterwards


def test_the_daemon_logs_a_catalog_lock_and_proceeds_after_it(pg, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    config = cdc_config(tables=["public.t"])
    holder = _locked(pg, "pg_catalog.pg_publication")
    daemon = daemons(config)
    try:
        line = wait_for(
            lambda: next((entry for entry in daemon.log().splitlines()
                          if "within lock_timeout" in entry and "reconnecting" in entry), None),
            timeout_s=90, what="the daemon to report the lock it waits for")
        assert "reason=postgres_timeout" in line, line
        assert daemon.alive(), daemon.log()
    finally:
        holder.rollback()
        holder.close()
    wait_for(lambda: "resuming slot" in daemon.log(), timeout_s=90,
             what="startup to go on once the lock is released")
    assert "Traceback" not in daemon.log().split("resuming slot")[0], daemon.log()


def test_slot_creation_may_wait_longer_than_the_lock_timeout(pg) -> None:
    """Creating a slot waits for open transactions: not cut short by the bounds."""
    blocker = pg.connect()
    blocker.autocommit = False
    with blocker.cursor() as cur:
        cur.execute("SELECT txid_current()")
    done: list[BaseException | None] = []
    db = SourceDatabase(pg.dsn)

    def create() -> None:
        try:
            db.create_slot("waits", two_phase=False)
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            done.append(exc)

    worker = threading.Thread(target=create, daemon=True)
    worker.start()
    try:
        seconds = int(METADATA_LOCK_TIMEOUT.rstrip("s")) + 2
        # The creation has waited on the open transaction longer than lock_timeout.
        wait_for(lambda: done or pg.fetchall(
            "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'transactionid' "
            "AND query LIKE '%%pg_create_logical_replication_slot%%' "
            "AND now() - query_start > make_interval(secs => %s)", (seconds,)),
            timeout_s=90, what="slot creation waiting past lock_timeout")
        assert not done, f"slot creation ended while the transaction was open: {done}"
    finally:
        blocker.rollback()
        blocker.close()
    wait_for(lambda: done, timeout_s=60, what="slot creation to finish")
    assert done == [None], done
    assert db.scalar("SHOW lock_timeout") == METADATA_LOCK_TIMEOUT  # bounds back afterwards
    db.drop_slot("waits")
    db.close()


def test_a_lock_error_reads_the_same_in_any_language() -> None:
    # 55P03 decides, not the words (the German server's text here).
    from cdcd.source.connection import query_failure

    exc = psycopg2.errors.LockNotAvailable("FEHLER:  Sperrzeitüberschreitung")
    failure = query_failure(exc, "SELECT 1")
    assert isinstance(failure, TransientError) and "lock_timeout" in str(failure)
