"""Dropping a database of a throwaway cluster with everything that would block it.

Tests drop the databases they made while slots, walsenders, prepared
transactions and sessions may still hold them, on every server version from 12.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from cdcd.tools.local.binaries import PostgresSetupError

#: A superuser connection to a database of the cluster, closed on exit.
Connect = Callable[[str], AbstractContextManager[psycopg2.extensions.connection]]


def drop_database(connection: Connect, name: str) -> None:
    """Drop ``name`` with everything that would block it; ``connection(dbname)`` is a superuser's.

    Logical slots on the database block ``DROP DATABASE``; active ones are
    held by a walsender, which is terminated first. Prepared transactions
    block it too and can only be rolled back from inside the database.
    ``WITH (FORCE)`` terminates the remaining sessions (on 13+; before,
    they are terminated one by one).
    """
    with connection("postgres") as conn, conn.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,))
        gids = [row[0] for row in cur.fetchall()]
        if gids:
            with connection(name) as db_conn, db_conn.cursor() as db_cur:
                for gid in gids:
                    db_cur.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        for _ in range(50):
            cur.execute(
                "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                (name,),
            )
            slots = cur.fetchall()
            if not slots:
                break
            for slot_name, active_pid in slots:
                if active_pid is not None:
                    _terminate(cur, "SELECT %s", (active_pid,))
                    continue
                try:
                    cur.execute("SELECT pg_drop_replication_slot(%s)", (slot_name,))
                except (psycopg2.errors.ObjectInUse, psycopg2.errors.UndefinedObject):
                    # Re-acquired or dropped concurrently: the next round sees it.
                    continue
        else:
            raise PostgresSetupError(f"could not drop the replication slots of {name!r}")
        if conn.server_version >= 130000:
            cur.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            return
        # PostgreSQL 12 has no FORCE: end the sessions, then drop (a
        # session that connects in between makes the DROP fail; retried).
        for _ in range(50):
            _terminate(
                cur,
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            try:
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
                return
            except psycopg2.errors.ObjectInUse:
                continue
        raise PostgresSetupError(f"could not drop database {name!r}: sessions keep connecting")


def _terminate(cur: Any, pids_sql: str, params: Any) -> None:
    """Terminate the backends ``pids_sql`` selects and wait (at most 5 s) until they are gone.

    ``pg_terminate_backend(pid, timeout)`` waits by itself from 14 on;
    before, the wait is a poll of ``pg_stat_activity``.
    """
    if cur.connection.server_version >= 140000:
        cur.execute(f"SELECT pg_terminate_backend(pid, 5000) FROM ({pids_sql}) AS t(pid)", params)
        return
    cur.execute(f"SELECT array_agg(pid) FROM ({pids_sql}) AS t(pid)", params)
    pids = cur.fetchone()[0] or []
    if not pids:
        return
    cur.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS t(pid)", (pids,))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s::int[])", (pids,))
        if cur.fetchone()[0] == 0:
            return
        time.sleep(0.02)
