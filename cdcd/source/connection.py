"""Connecting to the source database, and sorting its errors into retry or stop.

One concern: a plain (non-replication) session with PostgreSQL and what its
failures mean. :func:`connect` opens any connection cdcd makes (the
replication stream's too) and sorts a refused one into transient (server
down, restarting, network) and definite (bad credentials, unknown database or
role, pg_hba rejection): retrying a wrong password only locks accounts.
:func:`query_failure` does the same for a failed statement, and names the
privilege a refused one lacks. :class:`MetadataConnection` is the bounded
session every other room of ``cdcd.source`` builds on (catalog, publication,
slots; :class:`cdcd.source.database.SourceDatabase` composes them). Every
definite error names the object and what to change.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import psycopg2
import psycopg2.errors
import psycopg2.extras

from cdcd.config.dsn import redact_dsn_message
from cdcd.config.model import redact_dsn
from cdcd.errors import CdcdError, ConfigError, DefiniteError, TransientError
from cdcd.protocol.lsn import Lsn
from cdcd.source.sqlstate import connect_sqlstates, error_code, is_refused_at_connect

log = logging.getLogger("cdcd.source")

#: Session settings that fix the text form of values pgoutput sends (the
#: walsender formats values with its own session's settings).
SESSION_OPTIONS = (
    "-c datestyle=ISO -c intervalstyle=postgres -c timezone=UTC "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8"
)

# What libpq itself reports when it gives up without the server's answer
# (no SQLSTATE): its own English text, see cdcd.source.sqlstate. Also the last
# resort where libpq's error verbosity cannot be set (English servers only).
_DEFINITE_CONNECT = re.compile(
    r"password authentication failed|no pg_hba\.conf entry|role \S+ does not exist|"
    r"database \S+ does not exist|authentication failed|no password supplied|"
    r"permission denied|must be superuser or replication role|"
    r"invalid (connection option|dsn)|certificate",
    re.IGNORECASE,
)

#: The operator's way out of a refused connection, by SQLSTATE (class 28 by default).
_REFUSED_HINTS = {
    "3D000": "create the database or fix dbname in postgres.dsn",
    "42501": "the user needs the REPLICATION attribute (ALTER ROLE ... REPLICATION) and "
    "CONNECT on the database",
    "55000": "the database does not allow connections (ALTER DATABASE ... ALLOW_CONNECTIONS true)",
}
_REFUSED_HINT = (
    "check the user, password and database in postgres.dsn and pg_hba.conf "
    "(the user needs the REPLICATION attribute)"
)


#: cdcd's own SQL sessions (heartbeats, bookkeeping) never wait for synchronous
#: standbys: cdcd may be one (docs/synchronous.md) and would wait for itself.
#: Not on replication connections: a walsender sends the keepalives that let a
#: synchronous standby confirm skipped transactions only when its own session
#: asks for synchronous commit.
LOCAL_COMMIT_OPTION = "-c synchronous_commit=local"


def connect(
    dsn: str,
    replication: bool = False,
    timeout_s: float = 10.0,
    application_name: str | None = None,
    *,
    session_options: str = "",
) -> Any:
    """Open a connection; raises TransientError or DefiniteError with the server named.

    Sorted by the SQLSTATE the server answered with, whatever its language
    (:func:`cdcd.source.sqlstate.connect_sqlstates`): refused credentials,
    role, database or ``pg_hba.conf`` entry are definite; starting up,
    shutting down, too many connections and no answer are transient.
    ``session_options``: more ``-c name=value`` settings for this session only.
    """
    options = SESSION_OPTIONS if replication else f"{SESSION_OPTIONS} {LOCAL_COMMIT_OPTION}"
    if session_options:
        options = f"{options} {session_options}"
    kwargs: dict[str, Any] = {"options": options, "connect_timeout": max(1, int(timeout_s))}
    if application_name is not None:  # overrides the DSN's: synchronous_standby_names matches it
        kwargs["application_name"] = application_name
    if replication:
        kwargs["connection_factory"] = psycopg2.extras.LogicalReplicationConnection
    try:
        conn = psycopg2.connect(dsn, **kwargs)
    except psycopg2.ProgrammingError as exc:  # malformed DSN: a configuration error (exit 2)
        raise ConfigError(
            f"invalid postgres.dsn ({redact_dsn(dsn)}): "
            f"{redact_dsn_message(first_line(exc), dsn)}",
            hint="fix postgres.dsn",
        ) from exc
    except psycopg2.OperationalError as exc:
        raise connect_failure(exc, dsn, kwargs, timeout_s) from exc
    if not replication:
        conn.autocommit = True
    return conn


def connect_failure(
    exc: psycopg2.OperationalError, dsn: str, attempt: dict[str, Any], timeout_s: float
) -> CdcdError:
    """cdcd's error for a failed connection attempt (see :func:`connect`).

    ``attempt``: the keyword arguments of the failed ``psycopg2.connect``,
    repeated once to learn the server's SQLSTATE.
    """
    # libpq quotes DSN pieces it cannot use, which may be part of a password.
    message = redact_dsn_message(first_line(exc), dsn)
    where = redact_dsn(dsn)
    probe = {k: v for k, v in attempt.items() if k != "connection_factory"}
    if "connection_factory" in attempt:  # LogicalReplicationConnection adds this to the DSN
        probe["replication"] = "database"
    codes = connect_sqlstates(dsn, probe, timeout_s)
    refused = [code for code in codes or () if is_refused_at_connect(code)]
    if refused or (not codes and _DEFINITE_CONNECT.search(message)):
        code = refused[0] if refused else ""
        return DefiniteError(
            f"PostgreSQL refused the connection ({where}): {message}"
            + (f" (SQLSTATE {code})" if code else ""),
            hint=_REFUSED_HINTS.get(code, _REFUSED_HINT),
        )
    sqlstate = f" (SQLSTATE {codes[0]})" if codes else ""
    return TransientError(f"PostgreSQL unreachable ({where}): {message}{sqlstate}")


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (psycopg2's carry DETAIL and HINT lines after it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

# SQLSTATEs of a connection that is gone (besides class 08 and errors without
# one): shutdown, crash, the server not accepting connections yet, timeouts
# that end the session.
_CONNECTION_GONE = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03"})
# Retrying the statement may succeed: cancelled (statement_timeout, a
# cancel), lock_timeout, serialization failure and deadlock (class 40), and
# the server short of a resource (class 53) other than a configured limit.
_RETRYABLE = frozenset({"57014", "55P03"})
_TABLE_PRIVILEGES = frozenset({"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE"})
_DENIED = re.compile(
    r"permission denied for (table|view|materialized view|foreign table|relation|sequence|"
    r"schema|function|procedure|database|large object) (\S+)"
)


def query_failure(
    exc: psycopg2.Error, sql: str, purpose: str | None = None, user: str = "the cdcd role"
) -> CdcdError:
    """cdcd's error for a failed statement (see :meth:`MetadataConnection.query`).

    Connection lost, cancelled, lock timeout, serialization failure:
    TransientError. Missing privilege: DefiniteError naming the privilege and
    what the statement was for. Anything else (syntax, data, internal
    errors): DefiniteError with the server's first line -- a bug in cdcd or a
    server it does not support.
    """
    code = error_code(exc)
    message = first_line(exc)
    doing = purpose or "run " + " ".join(sql.split())[:80]
    if (
        isinstance(exc, psycopg2.InterfaceError)
        or (isinstance(exc, psycopg2.OperationalError) and not code)
        or code.startswith("08")
        or code in _CONNECTION_GONE
    ):
        return TransientError(f"PostgreSQL connection lost: {message}")
    if code == "55P03":  # lock_not_available: lock_timeout
        return TransientError(
            f"PostgreSQL could not {doing} within lock_timeout: another session holds a lock "
            f"it needs (a migration?); retrying: {message}"
        )
    if code in _RETRYABLE or code.startswith("40") or (code.startswith("53") and code != "53400"):
        return TransientError(f"PostgreSQL could not {doing} now, retrying: {message}")
    if isinstance(exc, psycopg2.errors.InsufficientPrivilege):
        return DefiniteError(
            f"PostgreSQL role {user} may not {doing}: {message}",
            hint=_privilege_hint(sql, message, user),
        )
    if code == "53400":  # configuration_limit_exceeded, e.g. all replication slots in use
        return DefiniteError(
            f"cannot {doing}: {message}",
            hint="raise the server setting the message names, or free what uses it up",
        )
    sqlstate = f" (SQLSTATE {code})" if code else ""
    return DefiniteError(
        f"PostgreSQL rejected the statement to {doing}: {message}{sqlstate}",
        hint="this is a bug in cdcd or a server version it does not support; "
        "report it with the server version",
    )


def _privilege_hint(sql: str, message: str, user: str) -> str:
    if "replication role" in message or "REPLICATION attribute" in message:
        return f"ALTER ROLE {user} REPLICATION (as a superuser)"
    denied = _DENIED.search(message)
    if denied is None:
        return f"grant {user} what the server names, or run cdcd as a role that has it"
    kind, name = denied.groups()
    verb = sql.split(None, 1)[0].upper() if sql.strip() else ""
    if kind in ("function", "procedure"):
        return f"GRANT EXECUTE ON {kind.upper()} {name} TO {user}"
    if kind in ("schema", "database"):
        privilege = "CREATE" if verb == "CREATE" else ("USAGE" if kind == "schema" else "CONNECT")
        return f"GRANT {privilege} ON {kind.upper()} {name} TO {user}"
    if kind == "large object":
        return f"GRANT SELECT ON LARGE OBJECT {name} TO {user}"
    privilege = verb if verb in _TABLE_PRIVILEGES else "SELECT"
    on = "SEQUENCE" if kind == "sequence" else "TABLE"
    return f"GRANT {privilege} ON {on} {name} TO {user}"


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


#: The metadata connection's bounds (its own session only, nobody else's). A
#: catalog query queued behind a migration's lock, or stuck for any other
#: reason, fails with 55P03 or 57014 and is retried with a log line instead of
#: holding the daemon silently. Statements that may rightly wait longer (slot
#: creation waits for every open transaction) run in
#: :meth:`MetadataConnection.unbounded`.
METADATA_LOCK_TIMEOUT = "5s"
METADATA_STATEMENT_TIMEOUT = "60s"
_BOUNDED_OPTIONS = (
    f"-c lock_timeout={METADATA_LOCK_TIMEOUT} -c statement_timeout={METADATA_STATEMENT_TIMEOUT}"
)


class MetadataConnection:
    """A plain (non-replication) connection to the source database: the base of every room.

    ``bounded`` (the default): the session's ``lock_timeout`` and
    ``statement_timeout`` are :data:`METADATA_LOCK_TIMEOUT` and
    :data:`METADATA_STATEMENT_TIMEOUT`. A connection that reads whole tables
    (the initial snapshot's) passes ``bounded=False``.
    """

    def __init__(self, dsn: str, timeout_s: float = 10.0, *, bounded: bool = True) -> None:
        self.dsn = dsn
        self.bounded = bounded
        self.conn = connect(
            dsn, timeout_s=timeout_s, session_options=_BOUNDED_OPTIONS if bounded else ""
        )

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        """Lift the session's bounds for the statements inside; back to them afterwards."""
        if not self.bounded:
            yield
            return
        self.query("SET lock_timeout = 0")
        self.query("SET statement_timeout = 0")
        try:
            yield
        finally:
            if not self.conn.closed:
                # RESET returns to the values the session started with: the bounds.
                self.query("RESET lock_timeout")
                self.query("RESET statement_timeout")

    def close(self) -> None:
        if not self.conn.closed:
            self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query(
        self,
        sql: str,
        params: Any = None,
        *,
        purpose: str | None = None,
        passthrough: tuple[type[psycopg2.Error], ...] = (),
    ) -> list[tuple[Any, ...]]:
        """Run one statement; its rows (none if it returns none).

        A psycopg2 error comes out as cdcd's (the original as ``__cause__``),
        see :func:`query_failure`; ``purpose`` (``"read table x"``) names what
        the statement is for in the message. ``passthrough``: errors of these
        classes that would be definite are raised unchanged, for callers that
        explain them better; connection loss and retryable errors are mapped
        regardless.
        """
        try:
            with self.conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall()) if cur.description else []
        except psycopg2.Error as exc:
            failure = query_failure(exc, sql, purpose, self._user)
            if isinstance(failure, DefiniteError) and isinstance(exc, passthrough):
                raise
            raise failure from exc

    @property
    def _user(self) -> str:
        """The role this connection runs as, from libpq (no round trip)."""
        try:
            return str(self.conn.info.user)
        except psycopg2.Error:
            return "the cdcd role"

    def scalar(self, sql: str, params: Any = None) -> Any:
        rows = self.query(sql, params)
        return rows[0][0] if rows else None

    # -- server ---------------------------------------------------------------------

    @property
    def server_version(self) -> int:
        return int(self.conn.server_version)

    @property
    def database(self) -> str:
        return str(self.scalar("SELECT current_database()"))

    def setting(self, name: str) -> str:
        return str(self.scalar("SELECT current_setting(%s)", (name,)))

    def current_wal_lsn(self) -> Lsn:
        return Lsn.parse(self.scalar("SELECT pg_current_wal_lsn()::text"))

    def wal_sender_timeout_s(self) -> float:
        rows = self.query(
            "SELECT setting::float * CASE unit WHEN 'ms' THEN 0.001 WHEN 's' THEN 1 "
            "WHEN 'min' THEN 60 ELSE 0.001 END FROM pg_settings WHERE name = 'wal_sender_timeout'"
        )
        return float(rows[0][0]) if rows else 60.0

    def require_logical(self) -> None:
        level = self.setting("wal_level")
        if level != "logical":
            raise DefiniteError(
                f"wal_level is '{level}' on the server, logical decoding needs 'logical'",
                hint="ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL",
            )
        encoding = self.scalar("SELECT pg_encoding_to_char(encoding) FROM pg_database "
                               "WHERE datname = current_database()")
        if encoding != "UTF8":
            raise DefiniteError(
                f"database {self.database} uses encoding {encoding}; cdcd requires UTF8",
                hint="capture a UTF8 database",
            )

