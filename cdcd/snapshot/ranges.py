"""Reading one key range of the initial snapshot: lock, check, COPY, under a savepoint.

Shared by both kinds of initial-snapshot readers (``cdcd.snapshot.initial``):
threads of the daemon on pooled connections, and worker processes
(``cdcd.snapshot.workers``) on connections of their own. Either way the
connection holds the slot's exported snapshot; why the table is locked and
compared with the plan first is in ``cdcd.snapshot.initial``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.errors

from cdcd.errors import CdcdError, DefiniteError, TransientError
from cdcd.snapshot.copyout import copy_text
from cdcd.snapshot.rows import Key, TablePlan, read_copy
from cdcd.snapshot.store import query_error

__all__ = [
    "LOCK_TIMEOUT_S",
    "STORAGE_THEN_SQL",
    "HandOver",
    "read_error",
    "read_guarded",
    "prepare_reader",
]

#: How long a reader waits for a table's lock before handing the table over
#: to an incremental snapshot (``cdcd.snapshot.initial``'s docstring).
LOCK_TIMEOUT_S = 2.0

#: The table's files as the snapshot saw them (pg_class is read through the
#: snapshot) and as they are now (pg_relation_filenode reads the current
#: catalog), over the partition tree as the snapshot had it.
_TREE = (
    "WITH RECURSIVE tree(oid) AS (SELECT %s::oid UNION ALL "
    "SELECT i.inhrelid FROM pg_inherits i JOIN tree ON i.inhparent = tree.oid) "
)
STORAGE_THEN_SQL = (
    _TREE + "SELECT array_agg(c.relfilenode::bigint ORDER BY c.oid) FROM tree "
    "JOIN pg_class c ON c.oid = tree.oid"
)
_STORAGE_NOW_SQL = (
    _TREE + "SELECT array_agg(coalesce(pg_relation_filenode(tree.oid), 0)::bigint "
    "ORDER BY tree.oid) FROM tree"
)

#: ``emit(data, rows)``: whole lines of COPY text of the range, in key order.
Emit = Callable[[bytes, int], None]
#: Why a table goes to an incremental snapshot instead, and whether it is gone.
HandOver = tuple[str, bool]


class _Changed(Exception):
    """The table read now is not the one planned inside the snapshot (a DDL since)."""

    def __init__(self, reason: str, dropped: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.dropped = dropped


def prepare_reader(cursor: Any) -> None:
    """Settings of a reader's transaction (``SET LOCAL``: they end with the snapshot).

    It waits at most :data:`LOCK_TIMEOUT_S` for a table's lock. And it reads
    key ranges in index order, never through a sort: for a table never
    analysed (just loaded), the planner's estimate of a bounded range
    ``(k) > a AND (k) <= b`` can fall below the chunk's ``LIMIT``, and it then
    sorts the whole rest of the range for every chunk (measured on 1M
    ``orders`` rows cut into two ranges: 9.5 µs of server CPU per row instead
    of 0.7). ``enable_sort = off`` leaves it the key's index scan, which
    yields the order itself.
    """
    cursor.execute("SET LOCAL lock_timeout = %s", (f"{int(LOCK_TIMEOUT_S * 1000)}ms",))
    cursor.execute("SET LOCAL enable_sort = off")


def read_guarded(
    cursor: Any,
    plan: TablePlan,
    storage: tuple[int, ...],
    after: Key | None,
    upper: Key | None,
    chunk_rows: int,
    emit: Emit,
    aborted: Callable[[], bool],
) -> HandOver | None:
    """Lock, check and read keys (``after``, ``upper``] of ``plan``'s table under a savepoint.

    For a table without a key the bounds are ``ctid`` [``after``, ``upper``)
    (:meth:`~cdcd.snapshot.rows.TablePlan.select_sql`).

    Returns None when the range was read (every chunk handed to ``emit``),
    or why the table must be handed over to an incremental snapshot. A
    failure that is not a DDL since the snapshot is raised.
    """
    cursor.execute("SAVEPOINT cdcd_range")
    try:
        _check(cursor, plan, storage)
        _read_range(cursor, plan, after, upper, chunk_rows, emit, aborted)
    except _Changed as changed:
        cursor.execute("ROLLBACK TO SAVEPOINT cdcd_range")
        return changed.reason, changed.dropped
    except psycopg2.Error as exc:
        cursor.execute("ROLLBACK TO SAVEPOINT cdcd_range")
        reason = _ddl_since(exc)
        if reason is None:
            raise
        return f"{reason}: {query_error(exc)}", False
    cursor.execute("RELEASE SAVEPOINT cdcd_range")
    return None


def _check(cursor: Any, plan: TablePlan, storage: tuple[int, ...]) -> None:
    """Raise _Changed unless the table is still the one the snapshot planned."""
    try:
        cursor.execute(f"LOCK TABLE {plan.from_sql} IN ACCESS SHARE MODE")
    except psycopg2.errors.UndefinedTable as exc:
        raise _Changed(f"dropped since the snapshot ({query_error(exc)})", dropped=True) from exc
    cursor.execute("SELECT to_regclass(%s)::oid", (plan.from_sql,))
    if int(cursor.fetchone()[0]) != plan.relation_id:
        raise _Changed("dropped and created again since the slot's consistent point")
    cursor.execute(_STORAGE_NOW_SQL, (plan.relation_id,))
    if tuple(int(x) for x in cursor.fetchone()[0] or ()) != storage:
        raise _Changed(
            "rewritten since the slot's consistent point (ALTER TABLE, TRUNCATE, VACUUM FULL…): "
            "its rows cannot be read as of the snapshot"
        )
    # Names only: a type change that keeps the files keeps every value.
    cursor.execute(f"SELECT * FROM {plan.from_sql} LIMIT 0")
    if [str(d[0]) for d in cursor.description] != [c[0] for c in plan.catalog_columns]:
        raise _Changed("its columns changed since the slot's consistent point")


def _read_range(
    cursor: Any,
    plan: TablePlan,
    after: Key | None,
    upper: Key | None,
    chunk_rows: int,
    emit: Emit,
    aborted: Callable[[], bool],
) -> None:
    if not plan.keyed:
        # One pass, in batches of chunk_rows (emit may block: a bounded
        # queue, which pauses the COPY and with it the server).
        copy_text(cursor, plan.select_sql(cursor, after, upper, None), chunk_rows, emit)
        return
    while not aborted():
        chunk = read_copy(cursor, plan, after, upper, chunk_rows)
        if chunk.rows:
            emit(chunk.data, chunk.rows)
        if chunk.rows < chunk_rows:
            break
        after = chunk.last_key


def _ddl_since(exc: psycopg2.Error) -> str | None:
    """Why a failed read means the table changed since the snapshot; None: a real failure."""
    if isinstance(exc, psycopg2.errors.UndefinedColumn):
        return "its columns changed since the slot's consistent point"
    if isinstance(exc, psycopg2.errors.LockNotAvailable):
        return (
            f"a migration holds or waits for its lock (more than {LOCK_TIMEOUT_S:g} s), "
            "which would wait for this snapshot to end"
        )
    return None


def read_error(exc: psycopg2.Error, table: str) -> CdcdError:
    """A reader's database failure as the daemon's error, the table named."""
    message = query_error(exc)
    if isinstance(exc, psycopg2.OperationalError):
        return TransientError(f"reading {table} for the snapshot failed: {message}")
    if isinstance(exc, psycopg2.errors.InsufficientPrivilege):
        return DefiniteError(
            f"cannot read {table} for the snapshot: {message}",
            hint=f"GRANT SELECT ON {table} TO the cdcd user",
        )
    return DefiniteError(
        f"reading {table} for the snapshot failed: {message}",
        hint="fix the table or exclude it from postgres.tables",
    )
