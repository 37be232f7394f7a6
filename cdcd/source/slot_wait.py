"""Waiting for a new replication slot, and saying what it waits for.

One concern: a logical slot becomes usable only once every transaction that
holds an xid when its creation begins has ended, so creating one can take as
long as the longest open transaction on the server. :func:`wait_for_slot_creation`
runs the creation on a worker thread and, while it waits, keeps health and
the systemd watchdog informed, logs which transactions hold it up, and
cancels it on stop. :mod:`cdcd.source.slots` (the daemon's slot) and the
initial snapshot's exported-snapshot slot both create through it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg2

from cdcd.errors import CdcdError, TransientError
from cdcd.observability import systemd
from cdcd.source.connection import MetadataConnection, first_line

log = logging.getLogger("cdcd.source")

#: While a slot is being created, what it waits for is logged this often.
SLOT_WAIT_LOG_INTERVAL_S = 5.0
#: ... and the caller's ``beat`` is called this often (health, systemd watchdog).
_SLOT_WAIT_BEAT_S = 1.0
#: Under systemd, each report extends the start timeout (TimeoutStartSec) by this
#: much: a creation that is known to wait is not a hung start.
_SLOT_WAIT_EXTEND_S = 30.0
#: After ``stop``, how long the cancelled creation may take to return.
_SLOT_CANCEL_WAIT_S = 10.0
#: Waits longer than this are logged as warnings.
_SLOT_WAIT_WARN_AFTER_S = 60.0
#: At most this many transactions are named in one log line.
_SLOT_WAIT_LISTED = 5

_T = TypeVar("_T")

# Transactions holding an xid that the slot creation waits for (the one whose
# lock it waits on now, from pg_locks) or will wait for (open since before it
# began), and prepared transactions likewise: they have no backend.
# pg_stat_activity hides state and xact_start of other roles' sessions from a
# role without pg_read_all_stats; backend_xid and pg_locks stay visible.
_SLOT_WAIT_SQL = """
WITH waits AS (
    SELECT l.transactionid FROM pg_locks l
    WHERE l.pid = %(pid)s AND NOT l.granted AND l.locktype = 'transactionid'
)
SELECT a.pid, a.backend_xid::text, extract(epoch FROM now() - a.xact_start)::float8,
       a.state, a.application_name, host(a.client_addr),
       nullif(a.datname::text, current_database()), NULL::text,
       a.backend_xid IN (SELECT transactionid FROM waits)
FROM pg_stat_activity a
WHERE a.pid <> %(pid)s AND a.backend_xid IS NOT NULL
  AND (a.backend_xid IN (SELECT transactionid FROM waits)
       OR a.xact_start < now() - make_interval(secs => %(waited)s))
UNION ALL
SELECT NULL, p.transaction::text, extract(epoch FROM now() - p.prepared)::float8,
       NULL, NULL, NULL, nullif(p.database::text, current_database()), p.gid,
       p.transaction IN (SELECT transactionid FROM waits)
FROM pg_prepared_xacts p
WHERE p.transaction IN (SELECT transactionid FROM waits)
   OR p.prepared < now() - make_interval(secs => %(waited)s)
ORDER BY 9 DESC, 3 DESC NULLS LAST
"""


def wait_for_slot_creation(
    create: Callable[[], _T],
    *,
    conn: Any,
    dsn: str,
    slot: str,
    beat: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    timeout_s: float = 10.0,
) -> _T:
    """Run ``create``, a blocking slot creation on ``conn``, and say what it waits for.

    A new logical slot becomes usable only once every transaction that holds
    an xid when creation begins has ended, so it takes as long as the
    longest open transaction on the server (an idle-in-transaction session, a
    forgotten prepared transaction). ``create`` runs on a worker thread; this
    thread calls ``beat`` every second (health and watchdog see a daemon that
    knowingly waits, not a wedged one), logs every few seconds which
    transactions hold it up (read over a second, ordinary connection opened
    only if the wait lasts), and on ``stop`` cancels the creation (PostgreSQL
    drops the half-made slot) and raises ``TransientError``. Under systemd
    each report also extends the start timeout (``EXTEND_TIMEOUT_USEC``), since
    ``READY=1`` comes only after the slot exists. What ``create`` raises is
    raised here.
    """
    interval_s = max(SLOT_WAIT_LOG_INTERVAL_S, _SLOT_WAIT_BEAT_S)
    pid = int(conn.get_backend_pid())
    done = threading.Event()
    result: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(create())
        except BaseException as exc:  # noqa: BLE001 -- raised again on the calling thread
            failure.append(exc)
        finally:
            done.set()

    started = time.monotonic()
    worker = threading.Thread(target=run, name="cdcd-create-slot", daemon=True)
    worker.start()
    monitor = _SlotWaitMonitor(dsn, slot, pid, timeout_s)
    next_log = started + interval_s
    try:
        while not done.wait(_SLOT_WAIT_BEAT_S):
            if beat is not None:
                beat()
            if stop is not None and stop.is_set():
                log.info("stop requested: cancelling the creation of slot %s", slot)
                try:
                    conn.cancel()
                except psycopg2.Error as exc:
                    log.warning("cancelling the creation of slot %s: %s", slot, first_line(exc))
                if not done.wait(_SLOT_CANCEL_WAIT_S):
                    log.warning("creating slot %s: the server did not answer the cancel", slot)
                raise TransientError(f"stopped while creating slot {slot}")
            now = time.monotonic()
            if now >= next_log:
                next_log = now + interval_s
                monitor.report(now - started)
                systemd.notify(
                    f"EXTEND_TIMEOUT_USEC={int(_SLOT_WAIT_EXTEND_S * 1_000_000)}\n"
                    f"STATUS=creating slot {slot}: waiting {now - started:.0f} s for open "
                    "transactions to end (the log names them)"
                )
    finally:
        monitor.close()
    if failure:
        raise failure[0]
    return result[0]


class _SlotWaitMonitor:
    """Logs what a slot creation (server process ``pid``) waits for."""

    def __init__(self, dsn: str, slot: str, pid: int, timeout_s: float) -> None:
        self.dsn = dsn
        self.slot = slot
        self.pid = pid
        self.timeout_s = timeout_s
        self._db: MetadataConnection | None = None
        self._broken = False

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def report(self, waited_s: float) -> None:
        extra = {"slot": self.slot, "waited_s": round(waited_s, 1), "backend_pid": self.pid}
        what = f"creating slot {self.slot}: waiting {waited_s:.0f} s"
        if self._broken:
            log.info("%s so far", what, extra=extra)
            return
        try:
            if self._db is None:
                self._db = MetadataConnection(self.dsn, timeout_s=self.timeout_s)
                # Never let the diagnosis itself wait on the server for long.
                self._db.query("SET statement_timeout = '5s'")
            rows = self._db.query(_SLOT_WAIT_SQL, {"pid": self.pid, "waited": waited_s})
            own = self._db.query(
                "SELECT coalesce(wait_event_type || '/' || wait_event, 'none') "
                "FROM pg_stat_activity WHERE pid = %s",
                (self.pid,),
            )
        except (CdcdError, psycopg2.Error) as exc:
            # The diagnosis is a courtesy: the creation itself goes on.
            self._broken = True
            self.close()
            log.warning(
                "%s so far; cannot tell for what (%s)",
                what,
                first_line(exc),
                extra=extra,
            )
            return
        if not rows:
            event = own[0][0] if own else "unknown"
            log.info(
                "%s so far (server process %d, wait event %s)", what, self.pid, event, extra=extra
            )
            return
        listed = "; ".join(_describe_transaction(row) for row in rows[:_SLOT_WAIT_LISTED])
        if len(rows) > _SLOT_WAIT_LISTED:
            listed += f"; and {len(rows) - _SLOT_WAIT_LISTED} more"
        count = f"{len(rows)} transaction{'s' if len(rows) > 1 else ''}"
        # Past a minute it is worth an operator's look: the application holds it up.
        log.log(
            logging.WARNING if waited_s >= _SLOT_WAIT_WARN_AFTER_S else logging.INFO,
            "%s for %s that started before it to end: %s (a new slot starts only once every "
            "transaction open when it was requested has ended)",
            what,
            count,
            listed,
            extra={**extra, "blocking_pids": [row[0] for row in rows if row[0] is not None]},
        )


def _describe_transaction(row: tuple[Any, ...]) -> str:
    pid, xid, age_s, state, application, client, database, gid, _waited_on = row
    details: list[str] = []
    if gid is not None:
        if age_s is not None:
            details.append(f"prepared {age_s:.0f} s ago")
        details.append(f"xid {xid}")
        if database:
            details.append(f"database '{database}'")
        details.append("end it with COMMIT PREPARED or ROLLBACK PREPARED")
        return f"prepared transaction '{gid}' ({', '.join(details)})"
    if age_s is not None:
        details.append(f"open {age_s:.0f} s")
    details.append(f"xid {xid}")
    if application:
        details.append(f"application '{application}'")
    if client:
        details.append(f"client {client}")
    if database:
        details.append(f"database '{database}'")
    if state:
        details.append(str(state))
    else:
        details.append("details hidden: grant pg_read_all_stats to cdcd's user to see them")
    return f"pid {pid} ({', '.join(details)})"
