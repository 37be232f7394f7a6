"""The metadata connection: server checks, publication, slot, keys, heartbeats.

Everything cdcd asks PostgreSQL outside the replication stream goes through
``SourceDatabase``. Connection failures are sorted into transient (server
down, restarting, network) and definite (bad credentials, unknown database or
role, pg_hba rejection): retrying a wrong password only locks accounts.
Every definite error names the object and what to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from cdcd.config.model import redact_dsn
from cdcd.errors import DefiniteError, TransientError
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Column, Relation

#: Session settings that fix the text form of values pgoutput sends (the
#: walsender formats values with its own session's settings).
SESSION_OPTIONS = (
    "-c datestyle=ISO -c intervalstyle=postgres -c timezone=UTC "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8"
)

_DEFINITE_CONNECT = re.compile(
    r"password authentication failed|no pg_hba\.conf entry|role \S+ does not exist|"
    r"database \S+ does not exist|authentication failed|no password supplied|"
    r"permission denied|must be superuser or replication role|"
    r"invalid (connection option|dsn)|certificate",
    re.IGNORECASE,
)


def connect(dsn: str, replication: bool = False, timeout_s: float = 10.0) -> Any:
    """Open a connection; raises TransientError or DefiniteError with the server named."""
    kwargs: dict[str, Any] = {"options": SESSION_OPTIONS, "connect_timeout": max(1, int(timeout_s))}
    if replication:
        kwargs["connection_factory"] = psycopg2.extras.LogicalReplicationConnection
    try:
        conn = psycopg2.connect(dsn, **kwargs)
    except psycopg2.ProgrammingError as exc:  # malformed DSN
        raise DefiniteError(
            f"invalid postgres.dsn ({redact_dsn(dsn)}): {_first_line(exc)}",
            hint="fix postgres.dsn",
        ) from exc
    except psycopg2.OperationalError as exc:
        message = _first_line(exc)
        where = redact_dsn(dsn)
        if _DEFINITE_CONNECT.search(message):
            raise DefiniteError(
                f"PostgreSQL refused the connection ({where}): {message}",
                hint="check the user, password and database in postgres.dsn and pg_hba.conf "
                "(the user needs the REPLICATION attribute)",
            ) from exc
        raise TransientError(f"PostgreSQL unreachable ({where}): {message}") from exc
    if not replication:
        conn.autocommit = True
    return conn


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def split_table(qualified: str) -> tuple[str, str]:
    """``schema.table`` (each part optionally double-quoted) into its two names."""
    match = re.match(r'^("(?:[^"]|"")+"|[^".]+)\.("(?:[^"]|"")+"|[^".]+)$', qualified)
    if match is None:
        raise DefiniteError(f"{qualified!r} is not schema.table", hint="fix postgres.tables")

    def unquote(part: str) -> str:
        if part.startswith('"'):
            return part[1:-1].replace('""', '"')
        return part

    return unquote(match.group(1)), unquote(match.group(2))


@dataclass(frozen=True, slots=True)
class SlotInfo:
    name: str
    plugin: str
    database: str
    confirmed_flush_lsn: Lsn | None
    restart_lsn: Lsn | None
    wal_status: str | None
    two_phase: bool
    active_pid: int | None


@dataclass(frozen=True, slots=True)
class TableIdentity:
    schema: str
    table: str
    replica_identity: str  # d, n, f, i
    primary_key: tuple[str, ...]


class SourceDatabase:
    """A plain (non-replication) connection to the source database."""

    def __init__(self, dsn: str, timeout_s: float = 10.0) -> None:
        self.dsn = dsn
        self.conn = connect(dsn, timeout_s=timeout_s)

    def close(self) -> None:
        if not self.conn.closed:
            self.conn.close()

    def __enter__(self) -> SourceDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        try:
            with self.conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall()) if cur.description else []
        except psycopg2.OperationalError as exc:
            raise TransientError(f"PostgreSQL connection lost: {_first_line(exc)}") from exc

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

    def ensure_publication(self, name: str, tables: list[str] | None, create: bool) -> None:
        """Create the publication if allowed; add configured tables it lacks."""
        wanted = [split_table(t) for t in tables] if tables else None
        if wanted:
            missing = [f"{s}.{t}" for s, t in wanted if not self.table_exists(s, t)]
            if missing:
                raise DefiniteError(
                    f"table {', '.join(missing)} does not exist",
                    hint="create it or remove it from postgres.tables",
                )
        if not self.publication_exists(name):
            if not create:
                raise DefiniteError(
                    f"publication {name} does not exist",
                    hint=f"CREATE PUBLICATION {quote_ident(name)} FOR ALL TABLES (or FOR TABLE …), "
                    "or set postgres.create_publication: true",
                )
            if wanted:
                targets = ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in wanted)
                self._ddl(f"CREATE PUBLICATION {quote_ident(name)} FOR TABLE {targets}", name)
            else:
                self._ddl(f"CREATE PUBLICATION {quote_ident(name)} FOR ALL TABLES", name)
            return
        if wanted:
            present = set(self.publication_tables(name))
            absent = [(s, t) for s, t in wanted if (s, t) not in present]
            if absent:
                if not create:
                    raise DefiniteError(
                        f"publication {name} lacks {', '.join(f'{s}.{t}' for s, t in absent)}",
                        hint=f"ALTER PUBLICATION {quote_ident(name)} ADD TABLE …",
                    )
                all_tables = self.scalar(
                    "SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,)
                )
                if not all_tables:
                    targets = ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in absent)
                    self._ddl(f"ALTER PUBLICATION {quote_ident(name)} ADD TABLE {targets}", name)

    def _ddl(self, sql: str, what: str) -> None:
        try:
            with self.conn.cursor() as cur:
                cur.execute(sql)
        except psycopg2.errors.InsufficientPrivilege as exc:
            raise DefiniteError(
                f"not allowed to create or alter publication {what}: {_first_line(exc)}",
                hint="create the publication as the table owner or a superuser",
            ) from exc

    # -- slot -----------------------------------------------------------------------

    def slot_info(self, slot: str) -> SlotInfo | None:
        two_phase = "two_phase" if self.server_version >= 140000 else "false"
        rows = self.query(
            "SELECT slot_name, plugin, database, confirmed_flush_lsn::text, restart_lsn::text, "
            f"wal_status, {two_phase}, active_pid FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        if not rows:
            return None
        name, plugin, database, confirmed, restart, wal_status, tp, pid = rows[0]
        return SlotInfo(
            name=name,
            plugin=plugin or "",
            database=database or "",
            confirmed_flush_lsn=Lsn.parse(confirmed) if confirmed else None,
            restart_lsn=Lsn.parse(restart) if restart else None,
            wal_status=wal_status,
            two_phase=bool(tp),
            active_pid=pid,
        )

    def ensure_slot(self, slot: str, create: bool, two_phase: bool) -> SlotInfo:
        info = self.slot_info(slot)
        if info is None:
            if not create:
                raise DefiniteError(
                    f"replication slot {slot} does not exist",
                    hint="set postgres.create_slot: true or create it with "
                    f"pg_create_logical_replication_slot('{slot}', 'pgoutput')",
                )
            try:
                if two_phase:
                    self.query(
                        "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)",
                        (slot,),
                    )
                else:
                    self.query(
                        "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,)
                    )
            except psycopg2.errors.DuplicateObject:
                pass  # created concurrently; verified below
            except psycopg2.errors.ObjectNotInPrerequisiteState as exc:
                raise DefiniteError(
                    f"cannot create slot {slot}: {_first_line(exc)}",
                    hint="set wal_level = logical and max_replication_slots > 0, then restart",
                ) from exc
            info = self.slot_info(slot)
            assert info is not None
        self.verify_slot(info, two_phase)
        return info

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
        if info.wal_status == "lost" or info.confirmed_flush_lsn is None:
            raise DefiniteError(
                f"slot {info.name} is invalidated (required WAL was removed)",
                hint="drop the slot and start again with a new snapshot; raise "
                "max_slot_wal_keep_size to avoid it",
            )
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

    def table_identity(self, schema: str, table: str) -> TableIdentity:
        rows = self.query(
            "SELECT c.relreplident, c.oid FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        )
        if not rows:
            raise DefiniteError(f"table {schema}.{table} does not exist", hint="fix postgres.tables")
        identity, oid = rows[0]
        return TableIdentity(schema, table, str(identity), self._primary_key(int(oid)))

    def primary_key(self, schema: str, table: str) -> tuple[str, ...] | None:
        rows = self.query(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        )
        if not rows:
            return None
        return self._primary_key(int(rows[0][0])) or None

    def _primary_key(self, oid: int) -> tuple[str, ...]:
        rows = self.query(
            "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey) WITH ORDINALITY "
            "AS k(attnum, n) ON true JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = k.attnum WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.n",
            (oid,),
        )
        return tuple(str(r[0]) for r in rows)

    # -- heartbeat ------------------------------------------------------------------

    def emit_heartbeat(self, prefix: str = "cdcd.heartbeat") -> Lsn:
        """A non-transactional logical message: WAL in this database, so the slot moves."""
        return Lsn.parse(
            self.scalar("SELECT pg_logical_emit_message(false, %s, '')::text", (prefix,))
        )


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
