"""The metadata connection: server checks, publication, slot, keys, heartbeats.

Everything cdcd asks PostgreSQL outside the replication stream goes through
``SourceDatabase``. Connection failures are sorted into transient (server
down, restarting, network) and definite (bad credentials, unknown database or
role, pg_hba rejection): retrying a wrong password only locks accounts.
Every definite error names the object and what to change.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from cdcd.config.dsn import redact_dsn_message
from cdcd.config.model import PostgresConfig, redact_dsn
from cdcd.decode.relations import RelationCache
from cdcd.errors import CdcdError, ConfigError, DefiniteError, TransientError
from cdcd.naming import HEARTBEAT_PREFIX, format_table
from cdcd.observability import systemd
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Column, Relation
from cdcd.source.catalog import PgCatalog, column_dimensions
from cdcd.source.markers import MarkerTransactions
from cdcd.source.publication import (
    Drift,
    RelState,
    TableSpec,
    describe_columns,
    describe_filter,
    expression_problem,
    probe_filters,
    publication_options,
    read_rel_states,
    require_publication_features,
    resolve_tables,
    spec_of,
    table_columns,
    target_sql,
)
from cdcd.source.sqlstate import connect_sqlstates, error_code, is_refused_at_connect
from cdcd.source.versions import (
    CONFLICTING_SINCE,
    GENERATED_COLUMNS_SINCE,
    ROW_FILTER_SINCE,
    VIA_ROOT_SINCE,
    has_failover_slots,
    has_two_phase_slots,
    has_wal_status,
)

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
            f"{redact_dsn_message(_first_line(exc), dsn)}",
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
    message = redact_dsn_message(_first_line(exc), dsn)
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


def _first_line(exc: BaseException) -> str:
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
    """cdcd's error for a failed statement (see :meth:`SourceDatabase.query`).

    Connection lost, cancelled, lock timeout, serialization failure:
    TransientError. Missing privilege: DefiniteError naming the privilege and
    what the statement was for. Anything else (syntax, data, internal
    errors): DefiniteError with the server's first line -- a bug in cdcd or a
    server it does not support.
    """
    code = error_code(exc)
    message = _first_line(exc)
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


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """A row of ``pg_replication_slots``; columns the server lacks are None/False."""

    name: str
    plugin: str
    database: str
    confirmed_flush_lsn: Lsn | None
    restart_lsn: Lsn | None
    wal_status: str | None  # 13+: reserved, extended, unreserved, lost
    two_phase: bool
    active_pid: int | None
    failover: bool = False  # 17+
    synced: bool = False  # 17+: synchronized from a primary (on a standby, or once promoted)
    temporary: bool = False
    invalidation_reason: str | None = None  # 17+: wal_removed, rows_removed, idle_timeout, ...
    conflicting: bool = False  # 16+: invalidated by a recovery conflict
    inactive_since: datetime | None = None  # 17+
    safe_wal_size: int | None = None  # 13+: bytes until the slot is at risk; None: unlimited

    @property
    def invalidated(self) -> bool:
        """Whether the server gave the slot up: it can never stream again."""
        return (
            self.invalidation_reason is not None
            or self.conflicting
            or self.wal_status == "lost"
            or self.confirmed_flush_lsn is None
        )


@dataclass(frozen=True, slots=True)
class SlotHealth:
    """What the metrics sample of the slot: retained WAL, its status, the server's limit."""

    retained_wal_bytes: int | None  # current WAL position minus restart_lsn
    wal_status: str | None
    wal_keep_size_bytes: int  # max_slot_wal_keep_size; -1 unlimited (or no such setting)
    inactive_since: datetime | None


#: What each ``pg_replication_slots.invalidation_reason`` means, for the one line of a lost slot.
_INVALIDATION_CAUSES = {
    "wal_removed": "the WAL it still needed was removed: it fell more than "
    "max_slot_wal_keep_size ({max_slot_wal_keep_size}) behind",
    "idle_timeout": "it stayed inactive longer than idle_replication_slot_timeout "
    "({idle_replication_slot_timeout})",
    "rows_removed": "catalog rows it needed were removed (a recovery conflict)",
    "wal_level_insufficient": "wal_level was lowered below logical",
}


class SlotLostError(DefiniteError):
    """The slot is invalidated, or missing where cdcd had used it: a gap nobody can replay.

    Never answered by creating a slot silently: changes made while it was
    lost would be skipped without a trace. ``cdcd resync`` is the way out.
    """


#: How ``cdcd run`` and ``cdcd check`` tell the operator out of a lost slot.
RESYNC_HINT = (
    "run 'cdcd resync -c <this config file>': it creates a new slot and re-snapshots every "
    "captured table, so consumers end equal to the tables (docs/failover.md)"
)


#: The comment that marks a publication as cdcd's own. Only such a publication
#: follows ``postgres.tables`` when tables are removed: one an operator made may
#: serve other subscribers.
OWNED_PUBLICATION_COMMENT = "managed by cdcd: membership follows postgres.tables"

#: How long cdcd's publication and replica identity DDL may wait for a table
#: lock. Queued behind a long transaction, it would block every application
#: query on the table queued behind it; a timeout is retried as transient.
DDL_LOCK_TIMEOUT = "5s"

#: Tables named in one message before "and N more".
_LISTED = 5

# What cdcd does with one captured table (TableVerdict.action).
KEEP = "keep"  # it has a usable replica identity
MISSING = "missing"  # it does not exist: a configuration error
SET_FULL = "set_full"  # no identity, replica_identity: full: cdcd sets REPLICA IDENTITY FULL
HARMLESS = "harmless"  # no identity, but the publication publishes neither updates nor deletes
REFUSE = "refuse"  # no identity and cdcd would publish it: the application's writes would fail
BROKEN = "broken"  # no identity and already published: the application's writes fail now

#: The three ways out for a table without a replica identity.
WAYS_OUT = (
    "add a primary key; or ALTER TABLE {table} REPLICA IDENTITY FULL (or USING INDEX), or set "
    "replica_identity: full on its postgres.tables entry to let cdcd do it; or publish only "
    "inserts for it (a publication WITH (publish = 'insert, truncate') and "
    "create_publication: false)"
)


@dataclass(frozen=True, slots=True)
class RelIdentity:
    """How PostgreSQL finds the old row of one table for UPDATE and DELETE."""

    schema: str
    table: str
    sql_name: str  # quoted for SQL
    oid: int
    kind: str  # pg_class.relkind: r, or p (partitioned)
    identity: str  # pg_class.relreplident: d, n, f, i
    index: str | None  # the usable identity index (primary key or USING INDEX)
    columns: tuple[str, ...]  # its columns
    has_primary_key: bool  # any primary key, usable or not
    owner: str
    partitions: tuple[RelIdentity, ...] = ()  # leaf partitions of a partitioned table

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    def gap(self) -> str | None:
        """Why UPDATE/DELETE would fail in a publication publishing them; None: they will not.

        PostgreSQL checks the leaf partition a row is in, never a partitioned
        table itself; a deferrable, invalid or partial index is no identity.
        """
        if self.kind == "p":
            gaps = [(p, p.gap()) for p in self.partitions]
            found = [f"partition {p.name}: {gap}" for p, gap in gaps if gap]
            return ", ".join(found) or None
        if self.identity == "f":
            return None
        if self.identity == "n":
            return "replica identity NOTHING"
        if self.index is not None:
            return None
        if self.identity == "i":
            return "its replica identity index is gone"
        if self.has_primary_key:
            return "its primary key is deferrable or not valid, so it is no replica identity"
        return "no primary key"

    def describe(self) -> str:
        """The identity of a table that has one, as ``cdcd check`` prints it."""
        if self.kind == "p":
            count = len(self.partitions)
            return f"partitioned, each of its {count} partitions has a replica identity"
        if self.identity == "f":
            return "replica identity FULL"
        if self.identity == "i":
            return f"replica identity USING INDEX {self.index} ({', '.join(self.columns)})"
        return f"primary key ({', '.join(self.columns)})"

    def lacking(self) -> tuple[RelIdentity, ...]:
        """The relations that need REPLICA IDENTITY FULL for UPDATE/DELETE to work."""
        if self.kind == "p":
            return tuple(p for p in self.partitions if p.gap())
        return (self,) if self.gap() else ()


@dataclass(frozen=True, slots=True)
class TableVerdict:
    """What cdcd does with one captured table; run and check both read it."""

    schema: str
    table: str
    action: str  # KEEP, MISSING, SET_FULL, HARMLESS, REFUSE or BROKEN
    relation: RelIdentity | None  # None: the table does not exist
    spec: TableSpec = TableSpec()  # its row filter and column list in postgres.tables

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def detail(self) -> str:
        """The identity, or why there is none."""
        if self.relation is None:
            return "does not exist"
        return self.relation.gap() or self.relation.describe()


@dataclass(frozen=True, slots=True)
class PublicationPlan:
    """The publication as it is, and what ``ensure_publication`` will do to it.

    Computed without changing anything, so ``cdcd check`` reports exactly what
    ``cdcd run`` will do or refuse.
    """

    name: str
    exists: bool
    create_allowed: bool  # postgres.create_publication
    owned: bool  # carries OWNED_PUBLICATION_COMMENT
    all_tables: bool
    publishes: str  # "updates and deletes", "updates", "deletes" or "" (neither)
    configured: bool  # postgres.tables is set
    tables: tuple[TableVerdict, ...]  # configured tables, or the publication's
    add: tuple[TableVerdict, ...]  # not yet in the publication
    stale: tuple[tuple[str, str], ...]  # in the publication, no longer configured
    all_tables_gaps: tuple[RelIdentity, ...]  # FOR ALL TABLES would publish these without identity
    member_count: int
    #: Where the publication differs from the configuration (filters, column
    #: lists, options): reconciled if cdcd owns it, a definite error if not.
    drift: tuple[Drift, ...] = ()
    #: postgres.tables asks what PostgreSQL cannot or must not do (exit 2).
    problems: tuple[ConfigError, ...] = ()
    #: WITH options CREATE PUBLICATION gets (only those the server has).
    options: tuple[str, ...] = ()

    @property
    def reconcile(self) -> bool:
        """Whether ``ensure_publication`` makes a drift good: only on a publication cdcd owns."""
        return self.owned and self.create_allowed

    @property
    def table_drift(self) -> tuple[Drift, ...]:
        return tuple(d for d in self.drift if d.table is not None)

    @property
    def option_drift(self) -> tuple[Drift, ...]:
        return tuple(d for d in self.drift if d.table is None)

    @property
    def create(self) -> bool:
        return not self.exists and self.create_allowed

    @property
    def drop(self) -> tuple[tuple[str, str], ...]:
        """Only a publication cdcd owns follows postgres.tables when tables are removed."""
        return self.stale if self.owned and not self.all_tables and self.configured else ()

    def verdict(self, schema: str, table: str) -> TableVerdict | None:
        for verdict in self.tables:
            if (verdict.schema, verdict.table) == (schema, table):
                return verdict
        return None

    def of(self, action: str) -> list[TableVerdict]:
        return [v for v in self.tables if v.action == action]

    def error(self) -> CdcdError | None:
        """What stops ``cdcd run`` before it changes anything; None: nothing."""
        missing = self.of(MISSING)
        if missing:
            return missing_tables_error([v.name for v in missing])
        if self.problems:
            return self.problems[0]
        refused = self.of(REFUSE)
        if refused:
            return refusal_error(self.name, self.publishes, refused)
        if self.all_tables_gaps:
            return all_tables_refusal_error(self.name, self.all_tables_gaps)
        return self.absent_error() or self.lacking_error() or self.drift_error()

    def drift_error(self) -> DefiniteError | None:
        """A publication cdcd does not own that differs from postgres.tables: run refuses it."""
        if not self.drift or self.reconcile:
            return None
        name = quote_ident(self.name)
        fixes = []
        for drift in self.table_drift:
            verdict = next(v for v in self.tables if v.name == drift.table)
            sql = verdict.relation.sql_name if verdict.relation else str(drift.table)
            target = target_sql(sql, verdict.spec).replace("\n", "")
            fix = f"ALTER PUBLICATION {name} DROP TABLE {sql}; ALTER PUBLICATION {name} ADD TABLE {target}"
            if fix not in fixes:
                fixes.append(fix)
        for drift in self.option_drift:
            fixes.append(f"ALTER PUBLICATION {name} SET ({drift.what} = {drift.becomes})")
        return DefiniteError(
            "; ".join(d.describe(None if i else self.name) for i, d in enumerate(self.drift)),
            hint=f"make them agree ({'; '.join(fixes)}) or change postgres to match; cdcd "
            "changes only a publication it created (create_publication: true)",
        )

    def absent_error(self) -> DefiniteError | None:
        if self.exists or self.create_allowed:
            return None
        return DefiniteError(
            f"publication {self.name} does not exist",
            hint=f"CREATE PUBLICATION {quote_ident(self.name)} FOR ALL TABLES (or FOR TABLE …), "
            "or set postgres.create_publication: true",
        )

    def lacking_error(self) -> DefiniteError | None:
        if not self.add or self.create_allowed:
            return None
        return DefiniteError(
            f"publication {self.name} lacks {', '.join(v.name for v in self.add)}",
            hint=f"ALTER PUBLICATION {quote_ident(self.name)} ADD TABLE …, "
            "or set postgres.create_publication: true",
        )


def missing_tables_error(names: list[str]) -> ConfigError:
    one = len(names) == 1
    return ConfigError(
        f"{'table' if one else 'tables'} {', '.join(names)} {'does' if one else 'do'} not exist",
        hint=f"create {'it' if one else 'them'} or remove {'it' if one else 'them'} "
        "from postgres.tables",
    )


def refusal_error(publication: str, publishes: str, refused: list[TableVerdict]) -> ConfigError:
    """The one line that refuses tables whose UPDATE/DELETE publishing them would break."""
    one = len(refused) == 1
    listed = ", ".join(f"{v.name} ({v.detail})" for v in refused)
    it = "it" if one else "them"
    table = alter_target(refused[0]) if one else "<table>"
    return ConfigError(
        f"{'table' if one else 'tables'} {listed} {'has' if one else 'have'} no replica "
        f"identity: in publication {publication}, which publishes {publishes}, the application's "
        f"UPDATE and DELETE on {it} would fail, so cdcd refuses to publish {it}",
        hint=WAYS_OUT.format(table=table),
    )


def alter_target(verdict: TableVerdict) -> str:
    """The table to name in ``ALTER TABLE … REPLICA IDENTITY FULL``: a partition, not its parent."""
    lacking = verdict.relation.lacking() if verdict.relation else ()
    return lacking[0].sql_name if len(lacking) == 1 else "<table>"


def all_tables_refusal_error(publication: str, gaps: tuple[RelIdentity, ...]) -> ConfigError:
    listed = ", ".join(f"{r.name} ({r.gap()})" for r in gaps[:_LISTED])
    more = f" and {len(gaps) - _LISTED} more" if len(gaps) > _LISTED else ""
    return ConfigError(
        f"publication {publication} would be created FOR ALL TABLES (postgres.tables is "
        f"omitted) and {len(gaps)} table{'s' if len(gaps) != 1 else ''} in the database "
        f"{'have' if len(gaps) != 1 else 'has'} no replica identity: {listed}{more}; the "
        "application's UPDATE and DELETE on them would fail, so cdcd refuses to create it",
        hint="list the tables to capture in postgres.tables; or give each a primary key or "
        "ALTER TABLE <table> REPLICA IDENTITY FULL (or USING INDEX); or create the publication "
        "yourself WITH (publish = 'insert, truncate') and set create_publication: false",
    )


def _publishes(update: bool, delete: bool) -> str:
    return " and ".join(w for w, on in (("updates", update), ("deletes", delete)) if on)


@dataclass(frozen=True, slots=True)
class _Step:
    """One statement of ``ensure_publication``'s transaction."""

    sql: str
    params: Any = None
    table: RelIdentity | None = None  # the table an ALTER TABLE changes


def _privilege_error(
    publication: str, table: RelIdentity | None, exc: psycopg2.Error
) -> DefiniteError:
    if table is None:
        return DefiniteError(
            f"not allowed to create or alter publication {publication}: {_first_line(exc)}",
            hint="create the publication as the table owner or a superuser",
        )
    return DefiniteError(
        f"not allowed to set REPLICA IDENTITY FULL on table {table.name} "
        f"(replica_identity: full): {_first_line(exc)}",
        hint=f"run ALTER TABLE {table.sql_name} REPLICA IDENTITY FULL as its owner "
        f"{table.owner}, or let cdcd's role act as the owner (GRANT {table.owner} TO <cdcd role>)",
    )


# The replica identity of ``c`` (pg_class) in ``n`` (pg_namespace), as _rel_identity reads it.
_IDENTITY_COLUMNS = (
    "n.nspname, c.relname, quote_ident(n.nspname) || '.' || quote_ident(c.relname), c.oid, "
    "c.relkind, c.relreplident, x.indexname, x.columns, "
    "EXISTS (SELECT 1 FROM pg_index p WHERE p.indrelid = c.oid AND p.indisprimary), "
    "pg_get_userbyid(c.relowner)"
)
# The index PostgreSQL uses as the identity (relcache's rd_replidindex): the
# primary key, or the USING INDEX one, if live, valid, unique, immediate and
# not partial; otherwise UPDATE/DELETE have no identity.
_IDENTITY_INDEX = (
    "LEFT JOIN LATERAL (SELECT ic.relname AS indexname, "
    "(SELECT array_agg(a.attname::text ORDER BY k.n) FROM unnest(i.indkey) WITH ORDINALITY "
    "AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum) "
    "AS columns FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
    "WHERE i.indrelid = c.oid AND i.indislive AND i.indisvalid AND i.indisunique "
    "AND i.indimmediate AND i.indpred IS NULL "
    "AND CASE c.relreplident WHEN 'i' THEN i.indisreplident ELSE i.indisprimary END "
    "LIMIT 1) AS x ON true"
)


def _rel_identity(row: tuple[Any, ...]) -> RelIdentity:
    schema, table, sql_name, oid, kind, identity, index, columns, has_pk, owner = row
    return RelIdentity(
        schema=str(schema),
        table=str(table),
        sql_name=str(sql_name),
        oid=int(oid),
        kind=str(kind),
        identity=str(identity),
        index=None if index is None else str(index),
        columns=tuple(columns or ()),
        has_primary_key=bool(has_pk),
        owner=str(owner),
    )


#: The metadata connection's bounds (its own session only, nobody else's). A
#: catalog query queued behind a migration's lock, or stuck for any other
#: reason, fails with 55P03 or 57014 and is retried with a log line instead of
#: holding the daemon silently. Statements that may rightly wait longer (slot
#: creation waits for every open transaction) run in
#: :meth:`SourceDatabase.unbounded`.
METADATA_LOCK_TIMEOUT = "5s"
METADATA_STATEMENT_TIMEOUT = "60s"
_BOUNDED_OPTIONS = (
    f"-c lock_timeout={METADATA_LOCK_TIMEOUT} -c statement_timeout={METADATA_STATEMENT_TIMEOUT}"
)


class SourceDatabase:
    """A plain (non-replication) connection to the source database.

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

    def __enter__(self) -> SourceDatabase:
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

    # -- publication ----------------------------------------------------------------

    def publication_exists(self, name: str) -> bool:
        return bool(self.query("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)))

    def publication_tables(self, name: str) -> list[tuple[str, str]]:
        rows = self.query(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s "
            "ORDER BY 1, 2",
            (name,),
        )
        return [(str(s), str(t)) for s, t in rows]

    def table_exists(self, schema: str, table: str) -> bool:
        return bool(
            self.query(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
                (schema, table),
            )
        )

    def identities(self, tables: list[tuple[str, str]]) -> dict[tuple[str, str], RelIdentity]:
        """The replica identity of each existing table (with its partitions); absent ones omitted."""
        if not tables:
            return {}
        rows = self.query(
            f"SELECT {_IDENTITY_COLUMNS} FROM unnest(%s::text[], %s::text[]) AS w(nsp, rel) "
            "JOIN pg_namespace n ON n.nspname = w.nsp "
            "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.rel "
            f"AND c.relkind IN ('r', 'p') {_IDENTITY_INDEX}",
            ([s for s, _ in tables], [t for _, t in tables]),
        )
        out = {}
        for row in rows:
            relation = _rel_identity(row)
            if relation.kind == "p":
                leaves = self.query(
                    f"SELECT {_IDENTITY_COLUMNS} FROM pg_partition_tree(%s::oid) AS w "
                    "JOIN pg_class c ON c.oid = w.relid AND w.isleaf AND c.relkind = 'r' "
                    f"JOIN pg_namespace n ON n.oid = c.relnamespace {_IDENTITY_INDEX} "
                    "ORDER BY 1, 2",
                    (relation.oid,),
                )
                relation = replace(relation, partitions=tuple(_rel_identity(r) for r in leaves))
            out[(relation.schema, relation.table)] = relation
        return out

    def tables_without_identity(self) -> list[RelIdentity]:
        """Every table a FOR ALL TABLES publication would publish that has no replica identity."""
        rows = self.query(
            f"SELECT {_IDENTITY_COLUMNS} FROM pg_class c "
            f"JOIN pg_namespace n ON n.oid = c.relnamespace {_IDENTITY_INDEX} "
            # What PostgreSQL publishes: permanent user tables, never catalogs.
            "WHERE c.relkind = 'r' AND c.relpersistence = 'p' AND c.oid >= 16384 "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
            "AND n.nspname !~ '^pg_toast' ORDER BY 1, 2"
        )
        return [r for r in map(_rel_identity, rows) if r.gap()]

    def resolve_tables(
        self, pg: PostgresConfig, exclude: Iterable[tuple[str, str]] = ()
    ) -> list[tuple[str, str]]:
        """``postgres.tables`` with its patterns expanded (:func:`cdcd.source.publication.resolve_tables`)."""
        return resolve_tables(self.query, pg, exclude)

    def plan_publication(
        self, pg: PostgresConfig, *, exclude: Iterable[tuple[str, str]] = ()
    ) -> PublicationPlan:
        """What ``ensure_publication`` will do, or refuse, for ``pg``; changes nothing.

        A table without a usable replica identity in a publication that
        publishes updates or deletes makes the *application's* UPDATE and
        DELETE on it fail, so cdcd never puts one there: it refuses (a
        configuration error) unless the table's entry opts in to
        ``replica_identity: full``, which cdcd then sets. Row filters and
        column lists are checked against PostgreSQL's rules the same way
        (docs/publication.md), and compared with the publication's.
        ``exclude``: tables a pattern never matches (cdcd's signal table).
        """
        version = self.server_version
        require_publication_features(version, pg)
        name = pg.publication
        via_root = "pubviaroot" if version >= VIA_ROOT_SINCE else "NULL"
        gencols = "pubgencols::text" if version >= GENERATED_COLUMNS_SINCE else "NULL"
        rows = self.query(
            f"SELECT oid, puballtables, pubupdate, pubdelete, "
            f"obj_description(oid, 'pg_publication'), {via_root}, {gencols} "
            "FROM pg_publication WHERE pubname = %s",
            (name,),
        )
        exists = bool(rows)
        if rows:
            oid, all_tables, update, delete, comment, viaroot, pubgencols = rows[0]
            publishes = _publishes(bool(update), bool(delete))
        else:
            # CREATE PUBLICATION publishes every kind of change by default.
            oid, all_tables, comment, publishes = None, False, None, _publishes(True, True)
            viaroot = pubgencols = None
        owned = comment == OWNED_PUBLICATION_COMMENT
        # An empty list captures every table of the publication, as omitting it does.
        configured = bool(pg.table_names)
        wanted = self.resolve_tables(pg, exclude) if configured else []
        if not configured:
            wanted = self.publication_tables(name) if exists else []
        identity = self.identities(wanted)
        present = [identity[t] for t in wanted if t in identity]
        if not exists:
            members: set[tuple[str, str]] = set()
        elif all_tables or not configured:
            members = {(r.schema, r.table) for r in present}
        else:
            members = self._members(int(oid), present)
        verdicts = []
        for schema, table in wanted:
            relation = identity.get((schema, table))
            spec = spec_of(pg, schema, table) if configured else TableSpec()
            if relation is None:
                action = MISSING
            elif not relation.gap():
                action = KEEP
            elif configured and pg.table_config(format_table(schema, table)).replica_identity == "full":
                action = SET_FULL
            elif not publishes:
                action = HARMLESS
            elif (schema, table) in members:
                action = BROKEN
            else:
                action = REFUSE
            verdicts.append(TableVerdict(schema, table, action, relation, spec))
        add: tuple[TableVerdict, ...] = ()
        stale: tuple[tuple[str, str], ...] = ()
        if exists and configured and not all_tables:
            add = tuple(v for v in verdicts if v.relation and (v.schema, v.table) not in members)
            explicit = self.query(
                "SELECT n.nspname, c.relname FROM pg_publication_rel r "
                "JOIN pg_class c ON c.oid = r.prrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE r.prpubid = %s ORDER BY 1, 2",
                (oid,),
            )
            keep = set(wanted)
            stale = tuple((str(s), str(t)) for s, t in explicit if (s, t) not in keep)
        gaps: tuple[RelIdentity, ...] = ()
        if not exists and pg.create_publication and not configured:
            gaps = tuple(self.tables_without_identity())
        states: dict[tuple[str, str], RelState] = {}
        if exists and not all_tables and version >= ROW_FILTER_SINCE:
            states = read_rel_states(self.query, int(oid))
        problems, drift = self._check_specs(
            pg, name, verdicts, members, states, publishes, bool(all_tables), exists, owned
        )
        if exists:
            drift += self._option_drift(pg, present, viaroot, pubgencols, owned)
        return PublicationPlan(
            name=name,
            exists=exists,
            create_allowed=pg.create_publication,
            owned=owned,
            all_tables=bool(all_tables),
            publishes=publishes,
            configured=configured,
            tables=tuple(verdicts),
            add=add,
            stale=stale,
            all_tables_gaps=gaps,
            member_count=len(self.publication_tables(name)) if exists else 0,
            drift=tuple(drift),
            problems=tuple(problems),
            options=tuple(publication_options(version, pg)),
        )

    def _option_drift(
        self,
        pg: PostgresConfig,
        present: list[RelIdentity],
        viaroot: bool | None,
        pubgencols: str | None,
        owned: bool,
    ) -> list[Drift]:
        """Options the publication has otherwise than configured.

        On a publication cdcd does not own, only those that change what cdcd
        captures count: the partition root setting with a partitioned table
        captured, generated columns with a table that has one.
        """
        out = []
        if viaroot is not None and bool(viaroot) != pg.publish_via_partition_root and (
            owned or any(r.kind == "p" for r in present)
        ):
            out.append(
                Drift(
                    None,
                    "publish_via_partition_root",
                    str(bool(viaroot)).lower(),
                    str(pg.publish_via_partition_root).lower(),
                )
            )
        if pubgencols is not None:
            was = "stored" if pubgencols == "s" else "none"
            becomes = "stored" if pg.publish_generated_columns else "none"
            generated = owned or bool(
                self.scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = ANY(%s::oid[]) "
                    "AND attgenerated = 's' AND NOT attisdropped)",
                    ([r.oid for r in present],),
                )
            )
            if was != becomes and generated:
                out.append(Drift(None, "publish_generated_columns", was, becomes))
        return out

    def _check_specs(
        self,
        pg: PostgresConfig,
        publication: str,
        verdicts: list[TableVerdict],
        members: set[tuple[str, str]],
        states: dict[tuple[str, str], RelState],
        publishes: str,
        all_tables: bool,
        exists: bool,
        owned: bool,
    ) -> tuple[list[ConfigError], list[Drift]]:
        """Each table's filter and column list against PostgreSQL's rules, and the publication's.

        On a publication cdcd owns, ``postgres.tables`` is the whole truth: an
        entry without ``where`` means no filter. On one an operator made, only
        what an entry sets is compared, so a hand-made filter or column list
        is taken as it is (snapshots and schemas read them from the catalog).
        """
        problems: list[ConfigError] = []
        drift: list[Drift] = []
        specified = [v for v in verdicts if v.relation and (v.spec.where or v.spec.columns)]
        if all_tables and specified:
            listed = ", ".join(v.name for v in specified)
            problems.append(
                ConfigError(
                    f"publication {publication} is FOR ALL TABLES, which cannot carry the row "
                    f"filters and column lists postgres.tables sets for {listed}",
                    hint="remove where/columns, or use a publication FOR TABLE "
                    "(create_publication: true creates one)",
                )
            )
            return problems, drift
        for verdict in specified:
            relation = verdict.relation
            if relation and relation.kind == "p" and not pg.publish_via_partition_root:
                # PostgreSQL would refuse it at CREATE PUBLICATION: each
                # partition is then published as itself, with its own settings.
                problems.append(
                    ConfigError(
                        f"postgres.tables: {verdict.name} is a partitioned table and "
                        "postgres.publish_via_partition_root is false: PostgreSQL takes no row "
                        "filter or column list for it then (each partition is published as "
                        "itself)",
                        hint="set publish_via_partition_root: true, or move where/columns to "
                        "entries for its partitions",
                    )
                )
                continue
            problem = self._columns_problem(verdict, publishes)
            if problem is not None:
                problems.append(problem)
            if verdict.spec.where is not None:
                syntax = expression_problem(verdict.spec.where)
                if syntax is not None:
                    problems.append(
                        ConfigError(
                            f"postgres.tables: the where of {verdict.name} is not valid: {syntax}",
                            hint="write one SQL boolean expression over the table's columns",
                        )
                    )
        if problems:
            return problems, drift
        # Filters as PostgreSQL reads them: configured ones, and the publication's.
        # With postgres.tables omitted the publication is taken as it is.
        compared = (
            [v for v in verdicts if v.relation and (v.schema, v.table) in members]
            if exists and pg.table_names
            else []
        )
        items: list[tuple[str, str]] = []
        slots: dict[tuple[str, str, str], int] = {}
        for verdict in verdicts:
            relation = verdict.relation
            if relation is None:
                continue
            texts = [("configured", verdict.spec.where)]
            state = states.get((verdict.schema, verdict.table))
            if verdict in compared and state is not None:
                texts.append(("current", state.where))
            for which, text in texts:
                if text is not None:
                    slots[(verdict.schema, verdict.table, which)] = len(items)
                    items.append((relation.sql_name, text))
        probes = self._probe(items) if items else []
        for verdict in verdicts:
            relation = verdict.relation
            key = (verdict.schema, verdict.table)
            if relation is None or verdict.spec.where is None:
                continue
            probe = probes[slots[(*key, "configured")]]
            if probe.error is not None:
                problems.append(
                    ConfigError(
                        f"postgres.tables: the where of {verdict.name} is not valid for it: "
                        f"{probe.error}",
                        hint="write one SQL boolean expression over the table's columns "
                        "(immutable built-in functions and operators only)",
                    )
                )
                continue
            outside = self._outside_identity(verdict, probe.columns, publishes)
            if outside:
                one = len(outside) == 1
                problems.append(
                    ConfigError(
                        f"postgres.tables: the where of {verdict.name} uses "
                        f"{'column' if one else 'columns'} {', '.join(outside)}, which "
                        f"{'is' if one else 'are'} not part of its replica identity "
                        f"({relation.describe()}); PostgreSQL's rule: a row filter of a "
                        f"publication that publishes updates or deletes ({publication} "
                        f"publishes {publishes}) may use only replica identity columns, else "
                        "the application's UPDATE and DELETE on the table fail",
                        hint="filter on replica identity columns only; or set "
                        "replica_identity: full on the entry (ALTER TABLE … REPLICA IDENTITY "
                        "FULL); or publish only inserts (a publication WITH (publish = "
                        "'insert, truncate') and create_publication: false)",
                    )
                )
        if problems:
            return problems, drift
        for verdict in compared:
            key = (verdict.schema, verdict.table)
            state = states.get(key, RelState(None, None))
            spec = verdict.spec
            configured = probes[slots[(*key, "configured")]] if spec.where is not None else None
            current = probes[slots[(*key, "current")]] if state.where is not None else None
            if (owned or spec.where is not None) and (
                (configured is None) != (current is None)
                or configured is not None
                and current is not None
                and configured.definition != current.definition
            ):
                drift.append(
                    Drift(
                        verdict.name,
                        "row filter",
                        describe_filter(state.where),
                        describe_filter(spec.where),
                    )
                )
            if (owned or spec.columns is not None) and (
                (spec.columns is None) != (state.columns is None)
                or spec.columns is not None
                and state.columns is not None
                and set(spec.columns) != set(state.columns)
            ):
                drift.append(
                    Drift(
                        verdict.name,
                        "column list",
                        describe_columns(state.columns),
                        describe_columns(spec.columns),
                    )
                )
        return problems, drift

    def _columns_problem(self, verdict: TableVerdict, publishes: str) -> ConfigError | None:
        """A column list naming a column the table lacks, or leaving out its replica identity."""
        relation, columns = verdict.relation, verdict.spec.columns
        if relation is None or columns is None:
            return None
        have = table_columns(self.query, relation.oid)
        names = [n for n, _ in have]
        unknown = [c for c in columns if c not in names]
        if unknown:
            one = len(unknown) == 1
            return ConfigError(
                f"postgres.tables: {verdict.name} has no {'column' if one else 'columns'} "
                f"{', '.join(unknown)} (its columns: {', '.join(names)})",
                hint="fix the columns of its entry",
            )
        identity = self._identity_columns(verdict, publishes, [n for n, g in have if not g])
        omitted = [c for c in identity if c not in columns]
        if omitted:
            one = len(omitted) == 1
            return ConfigError(
                f"postgres.tables: the column list of {verdict.name} omits "
                f"{', '.join(omitted)}, {'a' if one else ''} replica identity "
                f"column{'' if one else 's'} ({relation.describe()}); PostgreSQL's rule: the "
                "column list must include the replica identity (cdcd keys its messages by it)",
                hint=f"add {', '.join(omitted)} to its columns",
            )
        return None

    @staticmethod
    def _identity_columns(
        verdict: TableVerdict, publishes: str, all_columns: list[str]
    ) -> tuple[str, ...]:
        """The columns a filter may read and a column list must keep.

        REPLICA IDENTITY FULL (set, or opted in to): every column, but
        PostgreSQL holds a column list to that only when updates or deletes
        are published.
        """
        relation = verdict.relation
        if relation is None:
            return ()
        if relation.identity == "f" or verdict.action == SET_FULL:
            return tuple(all_columns) if publishes else ()
        return relation.columns

    def _outside_identity(
        self, verdict: TableVerdict, used: tuple[str, ...], publishes: str
    ) -> list[str]:
        relation = verdict.relation
        if not publishes or relation is None:
            return []
        if relation.identity == "f" or verdict.action == SET_FULL:
            return []
        if relation.kind == "p" and not relation.columns:
            return []  # each partition's identity decides; PostgreSQL checks the leaves
        return [c for c in used if c not in relation.columns]

    def _probe(self, items: list[tuple[str, str]]) -> list[Any]:
        """:func:`cdcd.source.publication.probe_filters` in a transaction rolled back."""
        with self.conn.cursor() as cur:
            try:
                cur.execute("BEGIN")
                cur.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                return probe_filters(cur, items)
            except psycopg2.Error as exc:
                raise query_failure(exc, "CREATE TEMP VIEW", "read a row filter", self._user) from exc
            finally:
                if self.conn.info.transaction_status in (
                    psycopg2.extensions.TRANSACTION_STATUS_INTRANS,
                    psycopg2.extensions.TRANSACTION_STATUS_INERROR,
                ):
                    cur.execute("ROLLBACK")

    def _members(self, publication: int, relations: list[RelIdentity]) -> set[tuple[str, str]]:
        """Which of ``relations`` the publication includes: listed, by schema, or by an ancestor."""
        by_schema = (
            " OR a.relnamespace IN (SELECT pnnspid FROM pg_publication_namespace "
            "WHERE pnpubid = %(pub)s)"
            if self.server_version >= 150000
            else ""
        )
        rows = self.query(
            "SELECT w.relid FROM unnest(%(oids)s::oid[]) AS w(relid) WHERE EXISTS ("
            # pg_partition_ancestors has no rows for a table that is not a partition.
            "SELECT 1 FROM (SELECT w.relid UNION SELECT relid FROM pg_partition_ancestors(w.relid)) "
            "AS p(relid) JOIN pg_class a ON a.oid = p.relid WHERE p.relid IN (SELECT prrelid FROM pg_publication_rel WHERE prpubid = %(pub)s)"
            f"{by_schema})",
            {"pub": publication, "oids": [r.oid for r in relations]},
        )
        found = {int(r[0]) for r in rows}
        return {(r.schema, r.table) for r in relations if r.oid in found}

    def ensure_publication(
        self, pg: PostgresConfig, *, exclude: Iterable[tuple[str, str]] = ()
    ) -> PublicationPlan:
        """Make the publication what ``plan_publication`` decided, or raise what it refuses.

        Creates it (marked as cdcd's own) if allowed, with the configured row
        filters, column lists and options; sets the replica identities opted
        in to; adds configured tables it lacks; on a publication cdcd owns,
        drops the tables no longer configured and makes a drifted filter,
        column list or option what the configuration says -- all in one
        transaction, so a failure leaves the database as it was.
        """
        plan = self.plan_publication(pg, exclude=exclude)
        error = plan.error()
        if error is not None:
            raise error
        name = quote_ident(plan.name)
        steps: list[_Step] = []
        set_full = [r for v in plan.of(SET_FULL) if v.relation for r in v.relation.lacking()]
        for relation in set_full:
            steps.append(_Step(f"ALTER TABLE {relation.sql_name} REPLICA IDENTITY FULL", table=relation))
        if plan.create:
            targets = ", ".join(
                target_sql(v.relation.sql_name, v.spec) for v in plan.tables if v.relation
            )
            options = f" WITH ({', '.join(plan.options)})" if plan.options else ""
            steps.append(
                _Step(
                    f"CREATE PUBLICATION {name} "
                    + (f"FOR TABLE {targets}" if plan.configured else "FOR ALL TABLES")
                    + options
                )
            )
            comment = (OWNED_PUBLICATION_COMMENT,)
            steps.append(_Step(f"COMMENT ON PUBLICATION {name} IS %s", comment))
        # A drifted filter or column list: the whole table list set anew
        # (PostgreSQL 15+'s SET TABLE), which also adds and drops.
        reset = plan.reconcile and bool(plan.table_drift)
        if reset:
            targets = ", ".join(
                target_sql(v.relation.sql_name, v.spec) for v in plan.tables if v.relation
            )
            steps.append(_Step(f"ALTER PUBLICATION {name} SET TABLE {targets}"))
        if plan.reconcile and plan.option_drift:
            options = ", ".join(f"{d.what} = {d.becomes}" for d in plan.option_drift)
            steps.append(_Step(f"ALTER PUBLICATION {name} SET ({options})"))
        if plan.add and not reset:
            targets = ", ".join(
                target_sql(v.relation.sql_name, v.spec) for v in plan.add if v.relation
            )
            steps.append(_Step(f"ALTER PUBLICATION {name} ADD TABLE {targets}"))
        if plan.drop and not reset:
            targets = ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in plan.drop)
            steps.append(_Step(f"ALTER PUBLICATION {name} DROP TABLE {targets}"))
        if plan.stale and not plan.drop:
            log.debug(
                "publication %s is not cdcd's own: keeping %s in it although not configured",
                plan.name,
                ", ".join(f"{s}.{t}" for s, t in plan.stale),
            )
        broken = plan.of(BROKEN)
        if broken:
            listed = ", ".join(f"{v.name} ({v.detail})" for v in broken[:_LISTED])
            more = f" and {len(broken) - _LISTED} more" if len(broken) > _LISTED else ""
            log.warning(
                "publication %s publishes %s and already includes tables without replica "
                "identity: %s%s; the application's UPDATE and DELETE on them fail until each "
                "gets a primary key or REPLICA IDENTITY FULL, or leaves the publication",
                plan.name,
                plan.publishes,
                listed,
                more,
            )
        if steps:
            self._transaction(plan.name, steps)
        for relation in set_full:
            log.info(
                "set REPLICA IDENTITY FULL on table %s (replica_identity: full)",
                relation.name,
                extra={"table": relation.name},
            )
        if plan.create:
            what = ", ".join(v.name for v in plan.tables) if plan.configured else "ALL TABLES"
            log.info(
                "created publication %s FOR %s%s",
                plan.name,
                what,
                f" WITH ({', '.join(plan.options)})" if plan.options else "",
            )
            for verdict in plan.tables:
                if verdict.spec.where is not None or verdict.spec.columns is not None:
                    log.info(
                        "publication %s: %s with row filter %s, columns %s",
                        plan.name,
                        verdict.name,
                        describe_filter(verdict.spec.where),
                        describe_columns(verdict.spec.columns),
                        extra={"table": verdict.name},
                    )
        if plan.reconcile:
            for drift in plan.drift:
                log.info(
                    "publication %s: %s %s was %s, now %s (as postgres%s says)",
                    plan.name,
                    drift.table or "option",
                    drift.what,
                    drift.was,
                    drift.becomes,
                    ".tables" if drift.table else f".{drift.what}",
                    extra={"table": drift.table} if drift.table else {},
                )
        for verdict in plan.add:
            log.info(
                "added table %s to publication %s",
                verdict.name,
                plan.name,
                extra={"table": verdict.name},
            )
        for schema, table in plan.drop:
            log.info(
                "dropped table %s.%s from publication %s: no longer in postgres.tables",
                schema,
                table,
                plan.name,
                extra={"table": f"{schema}.{table}"},
            )
        return plan

    def _transaction(self, publication: str, steps: list[_Step]) -> None:
        """Run ``steps`` in one transaction: all of them happen, or none."""
        with self.conn.cursor() as cur:
            try:
                cur.execute("BEGIN")
                cur.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                for step in steps:
                    try:
                        cur.execute(step.sql, step.params)
                    except psycopg2.errors.InsufficientPrivilege as exc:
                        raise _privilege_error(publication, step.table, exc) from exc
                    except psycopg2.errors.LockNotAvailable as exc:
                        raise TransientError(
                            f"no lock within {DDL_LOCK_TIMEOUT} for {step.sql.split(' %s')[0]!r}: "
                            "a long transaction holds the table; retrying"
                        ) from exc
                    except psycopg2.OperationalError:
                        raise
                    except psycopg2.Error as exc:
                        raise DefiniteError(
                            f"cannot run {step.sql.split(' %s')[0]!r}: {_first_line(exc)}",
                            hint=f"fix it by hand, then restart cdcd (publication {publication})",
                        ) from exc
                cur.execute("COMMIT")
            except psycopg2.OperationalError as exc:
                raise TransientError(f"PostgreSQL connection lost: {_first_line(exc)}") from exc
            finally:
                if self.conn.info.transaction_status in (
                    psycopg2.extensions.TRANSACTION_STATUS_INTRANS,
                    psycopg2.extensions.TRANSACTION_STATUS_INERROR,
                ):
                    cur.execute("ROLLBACK")

    # -- slot -----------------------------------------------------------------------

    def slot_info(self, slot: str) -> SlotInfo | None:
        """The slot's row of ``pg_replication_slots`` (on the server connected to), or None."""
        version = self.server_version
        # Columns by version: 12 has no wal_status (nor max_slot_wal_keep_size:
        # it never loses a slot); conflicting is 16+, failover and the
        # invalidation reason 17+.
        newest = has_failover_slots(version)
        columns = [
            "slot_name",
            "plugin",
            "database",
            "confirmed_flush_lsn::text",
            "restart_lsn::text",
            "wal_status" if has_wal_status(version) else "NULL::text",
            "two_phase" if has_two_phase_slots(version) else "false",
            "active_pid",
            "failover" if newest else "false",
            "synced" if newest else "false",
            "temporary",
            "invalidation_reason" if newest else "NULL::text",
            "coalesce(conflicting, false)" if version >= CONFLICTING_SINCE else "false",
            "inactive_since" if newest else "NULL::timestamptz",
            "safe_wal_size" if has_wal_status(version) else "NULL::bigint",
        ]
        rows = self.query(
            f"SELECT {', '.join(columns)} FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        if not rows:
            return None
        (name, plugin, database, confirmed, restart, wal_status, tp, pid, failover, synced,
         temporary, reason, conflicting, inactive_since, safe_wal_size) = rows[0]
        return SlotInfo(
            name=name,
            plugin=plugin or "",
            database=database or "",
            confirmed_flush_lsn=Lsn.parse(confirmed) if confirmed else None,
            restart_lsn=Lsn.parse(restart) if restart else None,
            wal_status=wal_status,
            two_phase=bool(tp),
            active_pid=pid,
            failover=bool(failover),
            synced=bool(synced),
            temporary=bool(temporary),
            invalidation_reason=reason,
            conflicting=bool(conflicting),
            inactive_since=inactive_since,
            safe_wal_size=None if safe_wal_size is None else int(safe_wal_size),
        )

    def slot_health(self, slot: str) -> SlotHealth | None:
        """Retained WAL, wal_status and the server's limit, for the slot metrics (one query)."""
        version = self.server_version
        if not has_wal_status(version):
            # 12: no wal_status, no max_slot_wal_keep_size.
            sql = (
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, NULL::text, "
                "-1::bigint, NULL::timestamptz FROM pg_replication_slots WHERE slot_name = %s"
            )
        else:
            # In MB, -1 unlimited; a standby reports the position it replayed.
            inactive = "inactive_since" if has_failover_slots(version) else "NULL::timestamptz"
            sql = (
                "SELECT pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN "
                "pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, restart_lsn)::bigint, "
                "wal_status, (SELECT CASE WHEN setting::bigint < 0 THEN -1 "
                "ELSE setting::bigint * 1024 * 1024 END FROM pg_settings "
                f"WHERE name = 'max_slot_wal_keep_size'), {inactive} "
                "FROM pg_replication_slots WHERE slot_name = %s"
            )
        rows = self.query(sql, (slot,))
        if not rows:
            return None
        retained, wal_status, keep, inactive_since = rows[0]
        return SlotHealth(
            retained_wal_bytes=None if retained is None else int(retained),
            wal_status=wal_status,
            wal_keep_size_bytes=-1 if keep is None else int(keep),
            inactive_since=inactive_since,
        )

    def lost_slot_error(self, info: SlotInfo) -> SlotLostError:
        """The one line for an invalidated slot: why the server gave it up, and the way out."""
        if info.invalidation_reason is not None:
            reason = info.invalidation_reason
        elif info.conflicting:
            reason = "rows_removed"
        else:
            reason = "wal_removed"
        cause = _INVALIDATION_CAUSES.get(reason, "the server invalidated it")
        if "{" in cause:
            names = ("max_slot_wal_keep_size", "idle_replication_slot_timeout")
            values = {name: self._setting_or(name, "unset") for name in names if name in cause}
            cause = cause.format(**values)
        since = (
            f"the changes after {info.confirmed_flush_lsn} "
            if info.confirmed_flush_lsn is not None
            else "changes "
        )
        return SlotLostError(
            f"replication slot {info.name} was invalidated by PostgreSQL ({reason}: {cause}); "
            f"{since}can no longer be streamed from it",
            hint=RESYNC_HINT,
        )

    def _setting_or(self, name: str, default: str) -> str:
        rows = self.query("SELECT current_setting(%s, true)", (name,))
        value = rows[0][0] if rows else None
        return str(value) if value not in (None, "") else default

    def ensure_slot(
        self,
        slot: str,
        create: bool,
        two_phase: bool,
        *,
        failover: bool = False,
        beat: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> SlotInfo:
        """The slot, created if missing and allowed; verified to be usable.

        Creating it waits for every transaction open at that moment to end:
        ``wait_for_slot_creation`` logs what it waits for, keeps ``beat``
        going and gives up when ``stop`` is set. With ``failover`` (PostgreSQL
        17+) it is created as a failover slot, and an existing slot that is
        not one (made before, or by the initial snapshot's replication
        command) is turned into one.
        """
        info = self.slot_info(slot)
        if info is None:
            if not create:
                raise DefiniteError(
                    f"replication slot {slot} does not exist",
                    hint="set postgres.create_slot: true or create it with "
                    f"pg_create_logical_replication_slot('{slot}', 'pgoutput')",
                )
            self.create_slot(slot, two_phase, failover=failover, beat=beat, stop=stop)
            info = self.slot_info(slot)
            assert info is not None
        self.verify_slot(info, two_phase)
        if failover and not info.failover:
            self.set_failover(slot)
            info = replace(info, failover=True)
        return info

    def create_slot(
        self,
        slot: str,
        two_phase: bool,
        *,
        failover: bool = False,
        beat: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Create the logical slot (pgoutput), waiting as :meth:`ensure_slot` says.

        A slot created concurrently by another client is left for the caller to verify.
        """
        # Explained below: created concurrently, or the server cannot have slots.
        explained = (
            psycopg2.errors.DuplicateObject,
            psycopg2.errors.ObjectNotInPrerequisiteState,
        )
        # Only the arguments the server has: two_phase is 14+, failover 17+.
        if failover:
            sql = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s, true)"
            params: tuple[Any, ...] = (slot, two_phase)
        elif two_phase:
            sql = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)"
            params = (slot,)
        else:
            sql = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')"
            params = (slot,)

        def create() -> None:
            # Waits for every transaction open when it began: as long as they take.
            with self.unbounded():
                self.query(
                    sql, params, purpose=f"create replication slot {slot}", passthrough=explained
                )

        try:
            wait_for_slot_creation(
                create, conn=self.conn, dsn=self.dsn, slot=slot, beat=beat, stop=stop
            )
        except psycopg2.errors.DuplicateObject:
            pass  # created concurrently; the caller verifies it
        except psycopg2.errors.ObjectNotInPrerequisiteState as exc:
            raise DefiniteError(
                f"cannot create slot {slot}: {_first_line(exc)}",
                hint="set wal_level = logical and max_replication_slots > 0, then restart",
            ) from exc
        log.info(
            "created replication slot %s%s", slot, " (failover)" if failover else "",
            extra={"slot": slot},
        )

    def set_failover(self, slot: str) -> None:
        """Make an existing slot a failover slot (PostgreSQL 17's ALTER_REPLICATION_SLOT).

        Only a walsender connection takes the command; the slot must not be in use.
        """
        conn = connect(self.dsn, replication=True)
        try:
            with conn.cursor() as cur:
                cur.execute(f"ALTER_REPLICATION_SLOT {quote_ident(slot)} (FAILOVER true)")
        except psycopg2.Error as exc:
            raise query_failure(
                exc, "ALTER_REPLICATION_SLOT", f"make slot {slot} a failover slot", self._user
            ) from exc
        finally:
            conn.close()
        log.info(
            "slot %s is now a failover slot (postgres.failover: true)", slot, extra={"slot": slot}
        )

    def verify_slot(self, info: SlotInfo, two_phase: bool) -> None:
        if info.plugin != "pgoutput":
            raise DefiniteError(
                f"slot {info.name} uses plugin {info.plugin or '(physical)'}, not pgoutput",
                hint="drop it or choose another postgres.slot",
            )
        if info.database != self.database:
            raise DefiniteError(
                f"slot {info.name} belongs to database {info.database}, not {self.database}",
                hint="choose another postgres.slot or connect to that database",
            )
        if info.invalidated:
            raise self.lost_slot_error(info)
        if two_phase and not info.two_phase:
            raise DefiniteError(
                f"slot {info.name} was created without two-phase support",
                hint="use postgres.protocol_version 1 or 2, or recreate the slot",
            )

    def drop_slot(self, slot: str) -> None:
        self.query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )

    # -- tables ---------------------------------------------------------------------

    def primary_key(self, schema: str, table: str) -> tuple[str, ...] | None:
        rows = self.query(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        )
        if not rows:
            return None
        return self._primary_key(int(rows[0][0])) or None

    def relation_cache(self, catalog: PgCatalog, *, snapshot: bool = False) -> RelationCache:
        """A relation cache that asks this database for keys and array dimensions.

        ``snapshot``: a cache of tables described from the catalog, never
        from the stream (see :class:`~cdcd.decode.relations.RelationCache`).
        """
        return RelationCache(
            catalog,
            key_lookup=self.primary_key,
            dimensions_lookup=lambda relid: column_dimensions(self.conn, relid),
            snapshot=snapshot,
        )

    def _primary_key(self, oid: int) -> tuple[str, ...]:
        rows = self.query(
            "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey) WITH ORDINALITY "
            "AS k(attnum, n) ON true JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = k.attnum WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.n",
            (oid,),
        )
        return tuple(str(r[0]) for r in rows)

    # -- heartbeat ------------------------------------------------------------------

    def emit_heartbeat(
        self, prefix: str = HEARTBEAT_PREFIX, markers: MarkerTransactions | None = None
    ) -> Lsn:
        """A logical message: WAL in this database, so the slot moves.

        Non-transactional where pgoutput sends messages. With ``markers``
        (PostgreSQL 12 and 13, :mod:`cdcd.source.markers`) a transactional one,
        its transaction registered as the heartbeat: after the commit, which
        is safe only because the caller is the thread that reads the stream.
        """
        if markers is None:
            return Lsn.parse(
                self.scalar("SELECT pg_logical_emit_message(false, %s, '')::text", (prefix,))
            )
        rows = self.query(
            "SELECT pg_logical_emit_message(true, %s, '')::text, txid_current()", (prefix,)
        )
        markers.expect(int(rows[0][1]), prefix, b"")
        return Lsn.parse(rows[0][0])


def relation_from_catalog(db: SourceDatabase, schema: str, table: str) -> Relation:
    """The Relation message pgoutput would send for ``schema.table``, built from the catalog.

    Key flags follow pgoutput: the replica identity index columns, or every
    column with REPLICA IDENTITY FULL.
    """
    rows = db.query(
        "SELECT c.oid, c.relreplident FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (schema, table),
    )
    if not rows:
        raise DefiniteError(f"table {schema}.{table} does not exist", hint="fix postgres.tables")
    oid, identity = int(rows[0][0]), str(rows[0][1])
    if identity == "i":
        key_sql = "i.indisreplident"
    else:
        key_sql = "i.indisprimary"
    keyed = {
        str(r[0])
        for r in db.query(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            f"AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND {key_sql}",
            (oid,),
        )
    }
    columns = db.query(
        "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s "
        "AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum",
        (oid,),
    )
    return Relation(
        xid=None,
        relation_id=oid,
        namespace=schema,
        name=table,
        replica_identity=identity,
        columns=tuple(
            Column(
                1 if identity == "f" or (identity in "di" and str(name) in keyed) else 0,
                str(name),
                int(type_oid),
                int(typmod),
            )
            for name, type_oid, typmod in columns
        ),
    )


# -- waiting for a slot to be created -------------------------------------------------

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
                    log.warning("cancelling the creation of slot %s: %s", slot, _first_line(exc))
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
        self._db: SourceDatabase | None = None
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
                self._db = SourceDatabase(self.dsn, timeout_s=self.timeout_s)
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
                _first_line(exc),
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
