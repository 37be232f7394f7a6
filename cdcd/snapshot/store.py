"""The signal table: snapshot requests in, snapshot progress out, in the source database.

One table (``snapshot.signal_table``, default ``cdcd_signal`` in the schema
first on the search path, normally ``public``) holds every snapshot job:

* operators request an incremental snapshot by inserting a row — the same
  statement Debezium users know::

      INSERT INTO cdcd_signal (id, type, data)
      VALUES ('ad-hoc-1', 'execute-snapshot', '{"data-collections": ["public.orders"]}');

  or run ``cdcd snapshot -c FILE --table public.orders``, which inserts it;
* cdcd records its own initial snapshot as the row ``initial:<slot>``;
* cdcd keeps each job's state in ``status`` (pending, running, done,
  failed, cancelled) and ``progress`` (JSON: tables, tables done, the last
  key of the last *delivered* chunk, chunk and row counts).

Why the source database and not Kafka: progress must be read back at start
before anything else happens, exactly and quickly — a compacted Kafka topic
would have to be consumed to its end, which needs a trustworthy high
watermark (the local broker's is not, see INFRA.md) and a consumer on the
start-up path. The database is already the store of the other half of the
position, the slot's confirmed LSN; the row is one UPDATE per chunk; an
operator can read progress with ``SELECT`` and cancel a job with
``UPDATE … SET status = 'cancelled'``. Progress is written only after every
message of the chunk was acknowledged by Kafka, so a restart may re-send
chunks after it (at-least-once) but never skips one.

cdcd polls the table (a few rows, every couple of seconds) rather than
watching it in the change stream, so the table need not be in the
publication; cdcd never publishes its changes (it is excluded from capture,
even with ``FOR ALL TABLES``).

cdcd creates the table (``CREATE`` privilege on the schema needed) only when
a feature needs it, so that a daemon that only streams adds nothing to the
application's database: the daemon before it creates a slot with an initial
snapshot (whose crash safety depends on the job row), the daemon at startup
when ``schema_changes.resnapshot`` is ``auto`` (healing rewrites is an
incremental snapshot, and the tables' recorded shapes live here too, see
``cdcd.pipeline.schema_changes``), and ``cdcd snapshot`` before it inserts a
request. Otherwise the operator may create it with
:data:`DDL`. A running daemon that found no table looks for it again at
every poll (a catalog lookup, no DDL), so a table created later by ``cdcd
snapshot`` serves requests without a restart. When it can be neither created
nor used (:class:`SignalTableUnavailable`), the session streams without
incremental snapshots, and refuses only to create a slot with an initial
snapshot. Daemons that share a database may share the table: a job is
addressed to one slot (``data.slot``; a heal's id ``schema-change:<slot>:…``
names it too) and only that slot's daemon claims it; a request addressed to
none (an operator's ``INSERT``) goes to a daemon that captures its tables.
Each daemon keeps a record ``daemon:<slot>`` (what it captures) here, which
``cdcd check`` reports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors

from cdcd.errors import DefiniteError
from cdcd.naming import parse_table, split_table
from cdcd.source.connection import quote_ident
from cdcd.source.database import SourceDatabase

__all__ = [
    "DDL",
    "TRUNCATE_FIRST",
    "Job",
    "SignalTable",
    "SignalTableGone",
    "SignalTableUnavailable",
]

log = logging.getLogger("cdcd.snapshot")

DDL = """CREATE TABLE IF NOT EXISTS {table} (
  id text PRIMARY KEY DEFAULT md5(random()::text || clock_timestamp()::text),
  type text NOT NULL DEFAULT 'execute-snapshot',
  data jsonb NOT NULL DEFAULT '{{}}'::jsonb,
  status text NOT NULL DEFAULT 'pending',
  progress jsonb NOT NULL DEFAULT '{{}}'::jsonb,
  created_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now())"""

#: Request data (and progress) key: tables whose consumers drop what they hold
#: (a truncate, op=t) before their snapshot's first chunk.
TRUNCATE_FIRST = "truncate-first"

_COLUMNS = ("id", "type", "data", "status", "progress", "created_at", "updated_at")

INITIAL = "initial"
EXECUTE = "execute-snapshot"
DAEMON = "daemon"  # the type of the rows ``daemon:<slot>`` (never a job)

#: Request data key: the slot whose daemon is to run the job.
SLOT_KEY = "slot"
#: A heal's id names its slot: ``schema-change:<slot>:<table>:<lsn>`` (slot
#: names have no colon), so heals requested before jobs carried ``data.slot``
#: stay addressed after an upgrade.
HEAL_ID_PREFIX = "schema-change:"
#: The snapshot of every table that ``cdcd resync`` requests: ``resync:<slot>:<id>``.
RESYNC_JOB_PREFIX = "resync:"
#: The slot a row is addressed to, or NULL (any daemon that captures its tables).
_ADDRESS_SQL = (
    "coalesce(CASE WHEN jsonb_typeof(data) = 'object' THEN data->>'slot' END, "
    f"CASE WHEN starts_with(id, '{HEAL_ID_PREFIX}') THEN split_part(id, ':', 2) END)"
)

PENDING = "pending"
RUNNING = "running"
DONE = "done"
FAILED = "failed"
CANCELLED = "cancelled"


class SignalTableUnavailable(DefiniteError):
    """The signal table cannot be created, or exists with another layout."""


class SignalTableGone(DefiniteError):
    """The signal table was dropped while cdcd used it."""


@dataclass
class Job:
    """One snapshot job (a row of the signal table)."""

    id: str
    type: str
    status: str
    tables: list[str]
    progress: dict[str, Any] = field(default_factory=dict)
    #: The slot whose daemon is to run it; None: any daemon that captures its tables.
    address: str | None = None

    @property
    def initial(self) -> bool:
        return self.type == INITIAL

    @property
    def done_tables(self) -> list[str]:
        return list(self.progress.get("done") or [])

    @property
    def remaining(self) -> list[str]:
        done = set(self.done_tables)
        return [t for t in self.tables if t not in done]


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tables_of(data: Any) -> list[str]:
    data = _json(data)
    if not isinstance(data, dict):
        return []
    tables = data.get("data-collections") or data.get("tables") or []
    if isinstance(tables, str):
        tables = [tables]
    return [str(t) for t in tables] if isinstance(tables, list) else []


class SignalTable:
    """Requests and progress in the source database; see the module docstring."""

    def __init__(self, db: SourceDatabase, name: str) -> None:
        self.db = db
        parsed = parse_table(name)
        if parsed is None:
            # A lone name is a table in the connection's current schema.
            parsed = split_table(name, default_schema=str(db.scalar("SELECT current_schema()")))
        self.schema, self.table = parsed
        self.sql = f"{quote_ident(self.schema)}.{quote_ident(self.table)}"

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    def _query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """``db.query`` with errors that name the signal table and what to do."""
        try:
            return self.db.query(sql, params, passthrough=(psycopg2.Error,))
        except psycopg2.errors.UndefinedTable as exc:
            raise SignalTableGone(
                f"the snapshot signal table {self.name} is gone: {query_error(exc)}",
                hint="'cdcd snapshot' creates it again (snapshot progress kept there is lost: "
                "request interrupted snapshots again)",
            ) from exc
        except psycopg2.Error as exc:
            raise DefiniteError(
                f"snapshot signal table {self.name}: {query_error(exc)}",
                hint="check its layout and the cdcd user's privileges on it (docs/snapshots.md)",
            ) from exc

    # -- the table ------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the table is there: one catalog lookup, no DDL (cheap enough to poll)."""
        return self.db.table_exists(self.schema, self.table)

    def cannot_create(self) -> str | None:
        """Why this user could not create the table now, or None if it could."""
        if not self.db.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (self.schema,)):
            return f"schema {self.schema} does not exist"
        if not self.db.scalar("SELECT has_schema_privilege(%s, 'CREATE')", (self.schema,)):
            user = self.db.scalar("SELECT current_user")
            return f"user {user} has no CREATE privilege on schema {self.schema}"
        return None

    def ensure(self) -> bool:
        """Create the table if it is missing (True: created); check that it has cdcd's columns.

        Only what needs the table calls this: the initial snapshot of a slot
        cdcd creates, and ``cdcd snapshot``. Otherwise the daemon waits for
        the table to appear (:meth:`exists`) and creates nothing.
        """
        created = False
        if not self.exists():
            try:
                refused = (psycopg2.errors.InsufficientPrivilege, psycopg2.errors.InvalidSchemaName)
                self.db.query(DDL.format(table=self.sql), passthrough=refused)
            except (psycopg2.errors.InsufficientPrivilege, psycopg2.errors.InvalidSchemaName) as exc:
                raise SignalTableUnavailable(
                    f"cannot create the signal table {self.name}: {str(exc).strip().splitlines()[0]}",
                    hint="create it as a user allowed to (statement in docs/snapshots.md), "
                    "or set snapshot.signal_table to a schema.table cdcd may create",
                ) from exc
            log.info("created the snapshot signal table %s", self.name)
            created = True
        self.check_layout()
        return created

    def check_layout(self) -> None:
        """Raise :class:`SignalTableUnavailable` unless the table has cdcd's columns."""
        present = {
            str(r[0])
            for r in self._query(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                "AND attnum > 0 AND NOT attisdropped",
                (self.sql,),
            )
        }
        missing = [c for c in _COLUMNS if c not in present]
        if missing:
            raise SignalTableUnavailable(
                f"signal table {self.name} lacks the column(s) {', '.join(missing)}",
                hint="drop it so that cdcd re-creates it, or set snapshot.signal_table to "
                "another table (layout in docs/snapshots.md)",
            )

    def missing_privileges(self) -> list[str]:
        """Which of SELECT, INSERT, UPDATE (what cdcd does with the table) this user lacks."""
        return [
            privilege
            for privilege in ("SELECT", "INSERT", "UPDATE")
            if not self.db.scalar("SELECT has_table_privilege(%s, %s)", (self.sql, privilege))
        ]

    def pending(self) -> int:
        """Requests waiting for a daemon."""
        return int(self._query(f"SELECT count(*) FROM {self.sql} WHERE status = %s", (PENDING,))[0][0])

    # -- requests -------------------------------------------------------------------

    def request(self, tables: list[str], slot: str | None = None) -> str:
        """Insert an incremental snapshot request (for ``slot``'s daemon if given); returns its id."""
        data: dict[str, Any] = {"data-collections": tables, "type": "incremental"}
        if slot is not None:
            data[SLOT_KEY] = slot
        rows = self._query(
            f"INSERT INTO {self.sql} (type, data) VALUES (%s, %s::jsonb) RETURNING id",
            (EXECUTE, json.dumps(data)),
        )
        return str(rows[0][0])

    def _job(self, row: tuple[Any, ...]) -> Job:
        job_id, kind, data, status, progress = row
        progress = _json(progress)
        if not isinstance(progress, dict):
            progress = {}
        tables = progress.get("tables")
        if not isinstance(tables, list):
            tables = _tables_of(data)
        return Job(
            str(job_id), str(kind), str(status), [str(t) for t in tables], progress,
            addressed_to(str(job_id), data),
        )

    def get(self, job_id: str) -> Job | None:
        rows = self._query(
            f"SELECT id, type, data, status, progress FROM {self.sql} WHERE id = %s", (job_id,)
        )
        return self._job(rows[0]) if rows else None

    def next_job(self, slot: str, skip: Collection[str] = ()) -> Job | None:
        """The job to work on: one this slot left running (resume), else the oldest pending one
        addressed to this slot or to none (:func:`addressed_to`), except the ids in ``skip``.

        A pending job is claimed atomically (``FOR UPDATE SKIP LOCKED``), so
        two daemons never take the same request.
        """
        rows = self._query(
            f"SELECT id, type, data, status, progress FROM {self.sql} WHERE status = %s "
            "AND progress->>'slot' = %s ORDER BY created_at, id LIMIT 1",
            (RUNNING, slot),
        )
        if rows:
            return self._job(rows[0])
        rows = self._query(
            f"UPDATE {self.sql} SET status = %s, updated_at = now(), "
            "progress = jsonb_build_object('slot', %s::text) "
            f"WHERE id = (SELECT id FROM {self.sql} WHERE status = %s AND type <> %s "
            f"AND coalesce({_ADDRESS_SQL}, %s) = %s AND NOT (id = ANY(%s)) "
            "ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) "
            "RETURNING id, type, data, status, progress",
            (RUNNING, slot, PENDING, INITIAL, slot, slot, list(skip)),
        )
        if not rows:
            return None
        job = self._job(rows[0])
        job.tables = _tables_of(rows[0][2])
        job.progress["tables"] = job.tables
        data = _json(rows[0][2])
        if isinstance(data, dict) and isinstance(data.get(TRUNCATE_FIRST), list):
            # A re-snapshot after a row filter change (cdcd.pipeline.schema_changes).
            job.progress[TRUNCATE_FIRST] = [str(t) for t in data[TRUNCATE_FIRST]]
        return job

    def save(self, job: Job) -> None:
        """Write the job's status and progress (one UPDATE)."""
        self._query(
            f"UPDATE {self.sql} SET status = %s, progress = %s::jsonb, updated_at = now() "
            "WHERE id = %s",
            (job.status, json.dumps(job.progress), job.id),
        )

    def fail(self, job: Job, reason: str) -> None:
        job.status = FAILED
        job.progress["error"] = reason
        self.save(job)

    # -- other records ----------------------------------------------------------------

    def records(self, kind: str, id_prefix: str) -> list[tuple[str, Any]]:
        """``(id, data)`` of the rows of type ``kind`` whose id starts with ``id_prefix``.

        Besides jobs, the table keeps records of cdcd's own (status ``done``,
        so never taken for a job): schema-change tracking keeps each table's
        last published shape here (``cdcd.pipeline.schema_changes``).
        """
        rows = self._query(
            f"SELECT id, data FROM {self.sql} WHERE type = %s AND starts_with(id, %s) ORDER BY id",
            (kind, id_prefix),
        )
        return [(str(r[0]), _json(r[1])) for r in rows]

    def record(
        self, record_id: str, kind: str, data: Any, job: tuple[str, Any] | None = None
    ) -> None:
        """Write a record and, in the same statement, request a job ``(id, data)`` if given.

        One statement, so both happen or neither: a job requested because of
        what the record says is never lost, nor requested twice (its id is
        fixed by the caller; an existing one is left as it is).
        """
        params: dict[str, Any] = {
            "id": record_id,
            "kind": kind,
            "data": json.dumps(data),
            "done": DONE,
            "job_id": job[0] if job is not None else None,
            "job_type": EXECUTE,
            "job_data": json.dumps(job[1]) if job is not None else None,
        }
        self._query(
            f"WITH saved AS (INSERT INTO {self.sql} (id, type, data, status) "
            "VALUES (%(id)s, %(kind)s, %(data)s::jsonb, %(done)s) ON CONFLICT (id) DO UPDATE SET "
            "type = EXCLUDED.type, data = EXCLUDED.data, status = EXCLUDED.status, "
            "updated_at = now() RETURNING 1) "
            f"INSERT INTO {self.sql} (id, type, data) "
            "SELECT %(job_id)s, %(job_type)s, %(job_data)s::jsonb FROM saved "
            "WHERE %(job_id)s IS NOT NULL ON CONFLICT (id) DO NOTHING",
            params,
        )

    # -- the initial snapshot -------------------------------------------------------

    @staticmethod
    def initial_id(slot: str) -> str:
        return f"{INITIAL}:{slot}"

    def begin_initial(self, slot: str, tables: list[str]) -> Job:
        """Record, *before* the slot is created, that its initial snapshot is under way.

        Written first so that no crash can leave a slot whose snapshot was
        never recorded: a restart that finds the slot and this row unfinished
        completes the snapshot (see ``cdcd.snapshot.incremental``).
        """
        job = Job(
            self.initial_id(slot),
            INITIAL,
            RUNNING,
            list(tables),
            {"slot": slot, "tables": list(tables), "done": []},
        )
        self._query(
            f"INSERT INTO {self.sql} (id, type, data, status, progress) "
            "VALUES (%s, %s, %s::jsonb, %s, %s::jsonb) ON CONFLICT (id) DO UPDATE SET "
            "type = EXCLUDED.type, data = EXCLUDED.data, status = EXCLUDED.status, "
            "progress = EXCLUDED.progress, created_at = now(), updated_at = now()",
            (
                job.id,
                INITIAL,
                json.dumps({"data-collections": tables, "slot": slot}),
                RUNNING,
                json.dumps(job.progress),
            ),
        )
        return job

    def unfinished_initial(self, slot: str) -> Job | None:
        job = self.get(self.initial_id(slot))
        return job if job is not None and job.status in (PENDING, RUNNING) else None

    def cancel_initial(self, slot: str, reason: str) -> None:
        """A new slot made without a snapshot: an older unfinished initial job is moot."""
        job = self.unfinished_initial(slot)
        if job is not None:
            job.status = CANCELLED
            job.progress["error"] = reason
            self.save(job)


def addressed_to(job_id: str, data: Any) -> str | None:
    """The slot a job row is addressed to (as ``_ADDRESS_SQL`` reads it), or None."""
    data = _json(data)
    if isinstance(data, dict) and data.get(SLOT_KEY) is not None:
        return str(data[SLOT_KEY])
    if job_id.startswith(HEAL_ID_PREFIX):
        return job_id.split(":")[1]
    return None


def query_error(exc: psycopg2.Error) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
