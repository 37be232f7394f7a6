"""PostgreSQL helpers for tests: publications, slots, LSNs and raw pgoutput reads.

``read_pgoutput`` talks to a real walsender exactly like cdcd does (psycopg2
``LogicalReplicationConnection``) and hands back the raw protocol payloads, so
decoder tests can run against what PostgreSQL really sends.
"""

from __future__ import annotations

import os
import re
import select
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras
import pytest
from psycopg2 import sql

from cdcd.tools.local.postgres import LocalPostgres, installed_versions

__all__ = [
    "PgDatabase",
    "create_publication",
    "create_slot",
    "current_wal_lsn",
    "drop_slot",
    "int_to_lsn",
    "lsn_to_int",
    "read_pgoutput",
    "replication_connection",
    "require_version",
    "slot_confirmed_flush_lsn",
]

Payload = tuple[int, bytes]

_LSN = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


def lsn_to_int(lsn: str) -> int:
    """``'16/B374D848'`` -> integer LSN."""
    match = _LSN.match(lsn.strip())
    if match is None:
        raise ValueError(f"not an LSN: {lsn!r}")
    return (int(match.group(1), 16) << 32) | int(match.group(2), 16)


def int_to_lsn(value: int) -> str:
    """Integer LSN -> ``'16/B374D848'`` (PostgreSQL's text form)."""
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def require_version(version: int) -> None:
    """Skip unless PostgreSQL ``version`` is installed (on CI, where setup installs every
    version, fail instead)."""
    if version not in installed_versions():
        message = f"PostgreSQL {version} is not installed; `bash .ci/setup` installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _qualified(name: str) -> sql.Identifier:
    """``'schema.table'`` or ``'table'`` -> a quoted identifier."""
    return sql.Identifier(*name.split(".", 1))


def create_publication(
    conn: psycopg2.extensions.connection,
    name: str,
    tables: Iterable[str] | None = None,
) -> None:
    """``CREATE PUBLICATION name FOR ALL TABLES`` (``tables=None``) or ``FOR TABLE ...``."""
    with conn.cursor() as cur:
        if tables is None:
            cur.execute(
                sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(name))
            )
        else:
            table_list = sql.SQL(", ").join(_qualified(t) for t in tables)
            cur.execute(
                sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                    sql.Identifier(name), table_list
                )
            )
    _commit_unless_autocommit(conn)


def create_slot(conn: psycopg2.extensions.connection, name: str, two_phase: bool = False) -> int:
    """Create a logical ``pgoutput`` slot; return its consistent point (integer LSN).

    Uses the SQL function because the replication protocol command in
    psycopg2 has no two-phase option. The two-phase argument exists from
    PostgreSQL 14 on, so it is passed only when asked for.
    """
    with conn.cursor() as cur:
        if two_phase:
            cur.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput', false, "
                "true)",
                (name,),
            )
        else:
            cur.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (name,)
            )
        row = cur.fetchone()
    _commit_unless_autocommit(conn)
    return lsn_to_int(row[0])


def drop_slot(conn: psycopg2.extensions.connection, name: str, missing_ok: bool = True) -> None:
    """Drop a slot, terminating the walsender that holds it first."""
    deadline = time.monotonic() + 10
    with conn.cursor() as cur:
        while True:
            cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (name,))
            row = cur.fetchone()
            if row is None:
                if missing_ok:
                    return
                raise LookupError(f"replication slot {name!r} does not exist")
            if row[0] is None:
                try:
                    cur.execute("SELECT pg_drop_replication_slot(%s)", (name,))
                except psycopg2.errors.ObjectInUse:
                    _rollback_unless_autocommit(conn)
                    if time.monotonic() > deadline:
                        raise
                    continue
                _commit_unless_autocommit(conn)
                return
            cur.execute("SELECT pg_terminate_backend(%s, 5000)", (row[0],))
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {name!r} stayed active (pid {row[0]})")


def slot_confirmed_flush_lsn(conn: psycopg2.extensions.connection, slot: str) -> int:
    """The slot's ``confirmed_flush_lsn`` as an integer (0 if it has none)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        row = cur.fetchone()
    _commit_unless_autocommit(conn)
    if row is None:
        raise LookupError(f"replication slot {slot!r} does not exist")
    return 0 if row[0] is None else lsn_to_int(row[0])


def current_wal_lsn(conn: psycopg2.extensions.connection) -> int:
    """``pg_current_wal_lsn()`` as an integer."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn()::text")
        row = cur.fetchone()
    _commit_unless_autocommit(conn)
    return lsn_to_int(row[0])


def _commit_unless_autocommit(conn: psycopg2.extensions.connection) -> None:
    if not conn.autocommit:
        conn.commit()


def _rollback_unless_autocommit(conn: psycopg2.extensions.connection) -> None:
    if not conn.autocommit:
        conn.rollback()


@contextmanager
def replication_connection(dsn: str) -> Iterator[psycopg2.extensions.connection]:
    """A psycopg2 ``LogicalReplicationConnection`` to ``dsn``, closed on exit."""
    conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        yield conn
    finally:
        conn.close()


def read_pgoutput(
    dsn: str,
    slot: str,
    publication: str | Sequence[str],
    proto_version: int = 1,
    streaming: bool = False,
    two_phase: bool = False,
    binary: bool = False,
    messages: bool = False,
    stop_when: Callable[[list[Payload]], bool] | None = None,
    timeout_s: float = 30.0,
    confirm: bool = False,
    start_lsn: int = 0,
    until_end: bool | None = None,
) -> list[Payload]:
    """Stream raw pgoutput payloads from ``slot``: ``[(data_start, payload), ...]``.

    Reads from the slot's confirmed position (or ``start_lsn``) until the
    walsender reports it has passed the WAL position current *at call time*
    (so changes committed before the call are all included), until
    ``stop_when(payloads)`` is true, or until ``timeout_s`` has passed; on
    timeout it returns what it has (the caller's assertions say what was
    missing). ``until_end`` (default: only when no ``stop_when`` is given)
    controls the end-of-WAL condition, so that ``stop_when`` can wait for
    changes made after the call. Nothing is confirmed unless ``confirm=True``,
    so the same changes can be read again.

    The end is judged by the walsender's keepalives (``cursor.wal_end``).
    When the last WAL record ends exactly where ``pg_current_wal_lsn()``
    points past it (a full WAL page), ``wal_end`` never reaches the target;
    then a position that stays put over several reply requests while no data
    arrives is taken as "caught up".
    """
    publications = [publication] if isinstance(publication, str) else list(publication)
    options: dict[str, str] = {
        "proto_version": str(proto_version),
        "publication_names": ",".join(publications),
    }
    if streaming:
        options["streaming"] = "on"
    if two_phase:
        options["two_phase"] = "on"
    if binary:
        options["binary"] = "true"
    if messages:
        options["messages"] = "true"

    if until_end is None:
        until_end = stop_when is None
    control = psycopg2.connect(dsn)
    control.autocommit = True
    try:
        end_lsn = current_wal_lsn(control)
        payloads: list[Payload] = []
        with replication_connection(dsn) as repl, repl.cursor() as cur:
            cur.start_replication(
                slot_name=slot, decode=False, start_lsn=start_lsn, options=options
            )
            deadline = time.monotonic() + timeout_s
            last_data = time.monotonic()
            probe_positions: list[int] = []
            last_probe = 0.0
            while True:
                msg = cur.read_message()
                if msg is not None:
                    payloads.append((msg.data_start, bytes(msg.payload)))
                    last_data = time.monotonic()
                    probe_positions.clear()
                    if stop_when is not None and stop_when(payloads):
                        break
                    continue
                if until_end and cur.wal_end >= end_lsn:
                    break
                now = time.monotonic()
                if now > deadline:
                    break
                if until_end and now - last_data > 0.2 and now - last_probe >= 0.1:
                    # Ask for a keepalive (the walsender's current position);
                    # five equal answers over 0.4 s with no data: caught up.
                    last_probe = now
                    probe_positions.append(cur.wal_end)
                    if len(probe_positions) >= 5 and len(set(probe_positions[-5:])) == 1:
                        break
                    cur.send_feedback(reply=True, force=True)
                select.select([cur], [], [], 0.1)
            if confirm:
                target = max([cur.wal_end, *(lsn for lsn, _ in payloads)])
                cur.send_feedback(flush_lsn=target, force=True)
                _wait_confirmed(control, slot, target, time.monotonic() + 10)
        return payloads
    finally:
        control.close()


def _wait_confirmed(
    conn: psycopg2.extensions.connection, slot: str, target: int, deadline: float
) -> None:
    """Wait until the server has applied a flush confirmation of ``target``."""
    while slot_confirmed_flush_lsn(conn, slot) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"slot {slot!r} did not confirm {int_to_lsn(target)}")
        time.sleep(0.02)


@dataclass
class PgDatabase:
    """A fresh database on a shared cluster, for one test (the ``pg`` fixture)."""

    cluster: LocalPostgres
    dbname: str
    _connections: list[psycopg2.extensions.connection] = field(default_factory=list)

    @property
    def dsn(self) -> str:
        """libpq keyword DSN of this database."""
        return self.cluster.dsn(self.dbname)

    def dsn_with(self, **extra: object) -> str:
        """DSN with extra keywords, e.g. ``application_name='x'``."""
        return self.cluster.dsn(self.dbname, **extra)

    def connect(self) -> psycopg2.extensions.connection:
        """A new autocommit connection, closed automatically after the test."""
        conn = self.cluster.connect(self.dbname)
        self._connections.append(conn)
        return conn

    def execute(self, query: str | sql.Composable, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement in autocommit; return its rows (empty without a result set)."""
        return self.cluster.execute(query, params, dbname=self.dbname)

    def fetchall(self, query: str | sql.Composable, params: Any = None) -> list[tuple[Any, ...]]:
        """Run a query and return all rows."""
        return self.cluster.execute(query, params, dbname=self.dbname)

    def fetchone(self, query: str | sql.Composable, params: Any = None) -> tuple[Any, ...] | None:
        """Run a query and return its first row (or ``None``)."""
        rows = self.cluster.execute(query, params, dbname=self.dbname)
        return rows[0] if rows else None

    def capture(self, tables: Iterable[str], publication: str = "pub", slot: str = "slot") -> int:
        """A publication of ``tables`` and a pgoutput slot, for :func:`read_pgoutput`;
        returns the slot's consistent point."""
        conn = self.connect()
        create_publication(conn, publication, tables)
        return create_slot(conn, slot)

    def close_connections(self) -> None:
        """Close every connection handed out by :meth:`connect`."""
        for conn in self._connections:
            if not conn.closed:
                conn.close()
        self._connections.clear()

    def drop(self) -> None:
        """Close our connections, drop the database's slots, then the database."""
        self.close_connections()
        self.cluster.drop_database(self.dbname)

    @classmethod
    @contextmanager
    def fresh(cls, cluster: LocalPostgres, prefix: str, test_name: str) -> Iterator[PgDatabase]:
        """A database ``<prefix>_<test name>`` on ``cluster`` for one test, dropped (with
        its slots) afterwards; a cluster the test stopped is started again for the others."""
        stem = re.sub(r"[^a-z0-9]+", "_", test_name.lower()).strip("_")[:40]
        dbname = f"{prefix}_{stem}"
        cluster.create_database(dbname)
        db = cls(cluster=cluster, dbname=dbname)
        try:
            yield db
        finally:
            db.close_connections()
            if not cluster.running:
                cluster.start_again()
            db.drop()
