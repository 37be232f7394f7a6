"""The catalog check: tables migrated and never written again, found and healed.

A table migrated and never written again sends no ``Relation`` at all.
Every ``schema_changes.check_interval_s`` the catalog check compares each
captured table's state with the catalog (OID, the shape pgoutput would send,
the files): first all tables in one statement (:data:`_SIGNATURES_SQL`),
then, for a table whose signature differs, the version pgoutput would send.
A table that differs is a *suspect*, noted with the WAL position ``W`` of
the check; it is healed once the slot's confirmed position has passed ``W``
and it still differs. Every change of the table committed before ``W`` has
then been published; had one come after the migration, its ``Relation``
would have updated the state (and the stream is cheaper and more precise
than a re-snapshot, so it is given that chance). The heal records the
catalog's shape stamped with the current WAL position ``L >= W`` and
requests a re-snapshot of the table (every kind of change heals here:
consumers learn a new shape only from a record; a recreated table's
re-snapshot starts with a truncate). Why the position is right when the
``Relation`` comes later:

* the re-snapshot's chunks are read after the migration committed (the
  catalog showed it) and are published at their high watermarks, which
  commit after ``L``; every change the stream publishes before a chunk is
  older than the chunk's read or superseded by it, and every later change
  follows it (the watermark rules of ``cdcd.snapshot.incremental``). So each
  row's last record carries the migrated value;
* the stream has passed ``W``, which is after the migration, and the slot's
  confirmed position never goes back (not even by a crash): no shape older
  than the migration can still come. A ``Relation`` of the migrated shape
  met later, in a transaction that committed before ``L``, is older than the
  state: it is used as it is (annotated from the state by name), with no
  second heal; one after ``L`` has the state's shape: nothing to do;
* a later migration differs from the recorded state and is found as any
  other.

A crash after the heal is recorded resumes the job; one before it finds the
difference again (states and heals are written in one statement).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cdcd.decode.relations import TableVersion
from cdcd.errors import TransientError
from cdcd.naming import format_table, split_table
from cdcd.pipeline.schema_changes.catalog import CatalogReader
from cdcd.pipeline.schema_changes.classify import classify, remember_written
from cdcd.pipeline.schema_changes.record import StateBook
from cdcd.pipeline.schema_changes.state import RECREATE, CatalogTable, TableState, version_shape
from cdcd.protocol.lsn import Lsn

log = logging.getLogger("cdcd.schema")

#: The catalog check's first pass, one statement for every table: OID, files,
#: identity and columns, enough to skip every table whose state it matches.
_SIGNATURES_SQL = """
SELECT n.nspname, c.relname, c.oid, c.relreplident,
  CASE WHEN c.relkind = 'p' THEN ARRAY(
    SELECT p.relfilenode FROM pg_partition_tree(c.oid) t JOIN pg_class p ON p.oid = t.relid
    WHERE t.isleaf ORDER BY p.relfilenode) ELSE ARRAY[c.relfilenode] END,
  ARRAY(SELECT a.attname::text FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
    AND a.attnum = ANY(i.indkey) WHERE i.indrelid = c.oid
    AND CASE c.relreplident WHEN 'i' THEN i.indisreplident ELSE i.indisprimary END
    ORDER BY a.attname),
  ARRAY(SELECT a.attname::text || ':' || a.atttypid || ':' || a.atttypmod FROM pg_attribute a
    WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
    ORDER BY a.attnum)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p')
  AND (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
"""

#: Between the catalog check finding a difference and the heal, how often the
#: slot's confirmed position is read (see IdleCheck.run).
_CONFIRM_INTERVAL_S = 0.5


def _signature(state: TableState) -> tuple[object, ...]:
    """What the catalog check's first pass compares of a state (see _SIGNATURES_SQL)."""
    return (
        state.relid,
        state.replica_identity,
        tuple(state.storage or ()),
        tuple(sorted(state.key)),
        tuple(f"{c.name}:{c.type_oid}:{c.type_modifier}" for c in state.columns),
    )


def _catalog_signature(row: tuple[Any, ...]) -> tuple[object, ...]:
    """A row of the first pass (from its OID on), comparable with :func:`_signature`."""
    relid, identity, storage, key, columns = row
    return (
        int(relid),
        str(identity),
        tuple(int(s) for s in storage or ()),
        tuple(str(k) for k in key or ()),
        tuple(str(c) for c in columns or ()),
    )


class IdleCheck:
    """The suspects of the catalog check and when the next check and heal are due."""

    def __init__(self, reader: CatalogReader, book: StateBook, slot: str, interval_s: float) -> None:
        self._reader = reader
        self._book = book
        self._slot = slot
        self._interval_s = interval_s
        self._next_check = time.monotonic() + interval_s
        self._next_confirm = 0.0
        #: Tables the catalog check found different from their state, with
        #: the WAL position then: healed once the slot confirmed past it.
        self._suspects: dict[str, int] = {}

    def forget(self, table: str) -> None:
        """The stream (or a snapshot) recorded a newer state of ``table``: no longer a suspect."""
        self._suspects.pop(table, None)

    def run(self, include: Callable[[str, str], bool]) -> None:
        """Called from the main loop, often; cheap unless a check or a heal is due.

        Every ``check_interval_s`` each captured table's state is compared
        with the catalog; a table that differs is healed once the slot's
        confirmed position has passed the WAL position of the check and it
        still differs (the module docstring says why that is correct).
        """
        if self._interval_s <= 0:
            return
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self._interval_s
            self._find_suspects(include)
        if self._suspects and now >= self._next_confirm:
            self._next_confirm = now + min(self._interval_s, _CONFIRM_INTERVAL_S)
            self._heal_suspects()

    def _differs(
        self, schema: str, table: str, state: TableState
    ) -> tuple[TableVersion, CatalogTable] | None:
        """The table's version and catalog now, if they differ from ``state``; else None."""
        catalog = self._reader.table(schema, table)
        if catalog is None:
            return None  # dropped: nothing to heal (a table created again is compared then)
        version = self._reader.version(schema, table)
        if version is None:
            return None
        if state.relid != catalog.relid or state.shape() != version_shape(version):
            return version, catalog
        if state.storage is not None and state.storage != catalog.storage:
            return version, catalog
        return None

    def _find_suspects(self, include: Callable[[str, str], bool]) -> None:
        names = {
            name: split_table(name)
            for name in self._book.states
            if name not in self._suspects and include(*split_table(name))
        }
        if not names:
            return
        signatures = {
            format_table(str(row[0]), str(row[1])): row[2:]
            for row in self._reader.db.query(
                _SIGNATURES_SQL,
                ([s for s, _ in names.values()], [t for _, t in names.values()]),
            )
        }
        wal: int | None = None
        for name, (schema, table) in sorted(names.items()):
            state = self._book.states[name]
            if name not in signatures or _signature(state) == _catalog_signature(signatures[name]):
                continue  # gone, or nothing that makes a difference changed
            if self._differs(schema, table, state) is None:
                continue
            if wal is None:
                wal = int(self._reader.db.current_wal_lsn())
            self._suspects[name] = wal
            self._next_confirm = 0.0

    def _heal_suspects(self) -> None:
        confirmed = self._reader.db.scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self._slot,),
        )
        if confirmed is None:
            return
        position = int(Lsn.parse(str(confirmed)))
        for name, seen in sorted(self._suspects.items()):
            if position < seen:
                continue  # the stream may still bring the table's new Relation
            del self._suspects[name]
            state = self._book.states.get(name)
            schema, table = split_table(name)
            found = self._differs(schema, table, state) if state is not None else None
            if state is None or found is None:
                continue  # the stream met the change meanwhile
            try:
                self._heal_idle(name, state, *found)
            except TransientError as exc:  # e.g. the migration still holds the table's lock
                log.info("schema check of %s postponed: %s", name, exc, extra={"table": name})
                self._suspects[name] = seen

    def _heal_idle(
        self, name: str, state: TableState, version: TableVersion, catalog: CatalogTable
    ) -> None:
        """A migration the stream has not shown: record the catalog's shape and re-snapshot."""
        schema, table = split_table(name)
        lsn = max(int(self._reader.db.current_wal_lsn()), state.lsn)
        kept = self._reader.rows_kept(schema, table, state, catalog)
        change = remember_written(state, version, classify(state, version, catalog, lsn, kept))
        if not change.save:
            return
        if change.kinds:
            # Consumers learn a shape only from a record, and the table sends
            # none: every kind heals here, a recreated table with a truncate.
            change = replace(
                change,
                heal=True,
                truncate=False,
                details=(*change.details, "found by the catalog check, no change of it streamed"),
            )
            self._book.report(name, change)
        elif kept:
            self._book.report_kept(name)
        self._book.put(name, change, truncate_first=RECREATE in change.kinds)
