"""Every psycopg2 error of ``SourceDatabase.query`` lands in cdcd's error model (issue 15).

Connection lost, cancelled, lock timeout: TransientError (the daemon
reconnects). A missing privilege: DefiniteError (exit 3) naming the
privilege and what the statement was for. Anything else: DefiniteError with
the server's first line, flagged as a bug or an unsupported server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg2
import psycopg2.errors
import pytest
from psycopg2 import sql

from cdcd.errors import DefiniteError, TransientError
from cdcd.source.database import SourceDatabase

pytestmark = pytest.mark.integration


@pytest.fixture
def db(pg) -> Iterator[SourceDatabase]:
    with SourceDatabase(pg.dsn) as database:
        yield database


@pytest.fixture
def role(pg) -> Iterator[str]:
    """A login role with no privileges on this database's tables."""
    name = f"reader_{uuid.uuid4().hex[:8]}"
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        pg.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_a_table_the_role_may_not_read_is_definite(pg, role: str) -> None:
    pg.execute("CREATE TABLE secret(id int PRIMARY KEY)")
    with SourceDatabase(pg.dsn_with(user=role)) as db:
        with pytest.raises(DefiniteError) as raised:
            db.query("SELECT id FROM public.secret")
        with pytest.raises(DefiniteError) as described:
            db.query("SELECT id FROM public.secret", purpose="read table public.secret")
    error = raised.value
    assert error.exit_code == 3
    assert f"role {role} may not run SELECT id FROM public.secret" in str(error)
    assert "permission denied for table secret" in str(error)
    assert error.hint == f"GRANT SELECT ON TABLE secret TO {role}"
    assert isinstance(error.__cause__, psycopg2.errors.InsufficientPrivilege)
    assert f"role {role} may not read table public.secret" in str(described.value)


def test_a_syntax_error_is_definite_and_says_it_is_a_bug(db: SourceDatabase) -> None:
    with pytest.raises(DefiniteError) as raised:
        db.query("SELEC 1")
    error = raised.value
    assert not isinstance(error, TransientError)
    assert 'syntax error at or near "SELEC"' in str(error)
    assert "SQLSTATE 42601" in str(error)
    assert "bug in cdcd" in str(error)
    assert isinstance(error.__cause__, psycopg2.errors.SyntaxError)


def test_other_server_errors_are_definite(db: SourceDatabase) -> None:
    with pytest.raises(DefiniteError, match="invalid input syntax for type integer"):
        db.query("SELECT 'x'::int")


def test_a_terminated_connection_is_transient(pg, db: SourceDatabase) -> None:
    pid = db.scalar("SELECT pg_backend_pid()")
    assert pg.fetchone("SELECT pg_terminate_backend(%s, 10000)", (pid,)) == (True,)
    with pytest.raises(TransientError, match="connection lost") as raised:
        db.query("SELECT 1")
    assert not isinstance(raised.value, DefiniteError)
    # The connection is closed now: later statements are connection loss too.
    with pytest.raises(TransientError, match="connection lost") as again:
        db.query("SELECT 1")
    assert isinstance(again.value.__cause__, psycopg2.InterfaceError)


def test_a_cancelled_statement_is_transient(db: SourceDatabase) -> None:
    db.query("SET statement_timeout = '50ms'")
    with pytest.raises(TransientError, match="could not run SELECT pg_sleep.*, retrying"):
        db.query("SELECT pg_sleep(60)")
    db.query("RESET statement_timeout")
    assert db.scalar("SELECT 1") == 1  # still connected: not a connection loss


def test_a_lock_timeout_is_transient(pg, db: SourceDatabase) -> None:
    pg.execute("CREATE TABLE busy(id int)")
    holder = pg.connect()
    holder.autocommit = False
    holder.cursor().execute("LOCK TABLE busy IN ACCESS EXCLUSIVE MODE")  # held until rollback
    try:
        db.query("SET lock_timeout = '50ms'")
        with pytest.raises(TransientError, match="lock timeout") as raised:
            db.query("SELECT * FROM busy", purpose="read table busy")
        assert isinstance(raised.value.__cause__, psycopg2.errors.LockNotAvailable)
    finally:
        holder.rollback()


def test_passthrough_keeps_definite_errors_raw_but_never_connection_loss(
    pg, db: SourceDatabase
) -> None:
    with pytest.raises(psycopg2.errors.UndefinedTable):
        db.query("SELECT * FROM missing", passthrough=(psycopg2.errors.UndefinedTable,))
    with pytest.raises(DefiniteError, match='relation "missing" does not exist'):
        db.query("SELECT * FROM missing", passthrough=(psycopg2.errors.SyntaxError,))
    pid = db.scalar("SELECT pg_backend_pid()")
    pg.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
    with pytest.raises(TransientError, match="connection lost"):
        db.query("SELECT 1", passthrough=(psycopg2.Error,))
