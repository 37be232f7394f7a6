"""SchemaChanges: what the publisher and the snapshots ask of schema-change tracking.

The publisher asks, at each table version met in the stream, which version
to encode and whether to emit a truncate first (:meth:`SchemaChanges.stream_version`);
snapshots record the shape they give consumers (the *baseline*,
:meth:`SchemaChanges.read_baseline` / :meth:`SchemaChanges.record_baseline`)
and annotate the versions they read (:meth:`SchemaChanges.snapshot_version`);
the main loop runs the catalog check (:meth:`SchemaChanges.catalog_check`).
This room wires the others: the catalog (``catalog``), the classification
(``classify``), the recorded states (``record``) and the catalog check
(``idle``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace

from cdcd.decode.relations import TableVersion
from cdcd.decode.types import TypeCatalog
from cdcd.errors import DefiniteError
from cdcd.naming import format_table
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.schema_changes.catalog import CatalogReader
from cdcd.pipeline.schema_changes.classify import (
    SchemaChange,
    annotate,
    baseline_state,
    carry,
    classify,
    remember_written,
)
from cdcd.pipeline.schema_changes.idle import IdleCheck
from cdcd.pipeline.schema_changes.record import StateBook
from cdcd.pipeline.schema_changes.state import ROW_FILTER, CatalogTable, TableState
from cdcd.protocol.lsn import Lsn
from cdcd.snapshot.store import SignalTable
from cdcd.source.database import SourceDatabase

log = logging.getLogger("cdcd.schema")


class SchemaChanges:
    """Recorded table states, the catalog and the heal requests: see the package docstring."""

    def __init__(
        self,
        db: SourceDatabase,
        catalog: TypeCatalog,
        signals: SignalTable | None,
        slot: str,
        resnapshot: bool,
        metrics: Metrics | None = None,
        publication: str | None = None,
        check_interval_s: float = 0.0,
    ) -> None:
        self._slot = slot
        self._reader = CatalogReader(db, catalog, publication)
        self._book = StateBook(signals, slot, resnapshot, metrics)
        self._idle = IdleCheck(self._reader, self._book, slot, check_interval_s)
        if signals is not None:
            self._check_filters()

    def state(self, table: str) -> TableState | None:
        return self._book.states.get(table)

    def _check_filters(self) -> None:
        """Row filters changed since their tables' states were recorded: truncate and re-snapshot.

        A filter change sends no new shape (pgoutput sends the same Relation
        again), so it is looked for here, at start: where cdcd applies a
        configured filter to its publication (before this runs), and after an
        operator changed a publication cdcd does not own (which startup
        requires to agree with postgres.tables). What consumers hold was
        published under the old filter: rows it took in that the new one
        leaves out must go, rows the new one takes in must come; so the
        re-snapshot starts with a truncate (op=t) at its first chunk.
        """
        current = self._reader.row_filters()
        for table, state in list(self._book.states.items()):
            if not state.filter_known or table not in current or current[table] == state.row_filter:
                continue
            now = current[table]
            change = SchemaChange(
                state=replace(state, row_filter=now),
                kinds=(ROW_FILTER,),
                heal=True,
                details=(f"row filter {state.row_filter or 'none'} -> {now or 'none'}",),
                save=True,
            )
            self._book.report(table, change)
            self._book.put(table, change, truncate_first=True)

    # -- the publisher's questions --------------------------------------------------

    def stream_version(self, version: TableVersion, commit_lsn: Lsn) -> tuple[TableVersion, bool]:
        """A table version met in the stream: the version to encode, and whether to truncate first."""
        name = format_table(version.schema, version.table)
        previous = self._book.states.get(name)
        lsn = int(commit_lsn)
        catalog = self._catalog_for(version, previous, lsn)
        kept = self._reader.rows_kept(version.schema, version.table, previous, catalog)
        change = classify(previous, version, catalog, lsn, kept)
        change = remember_written(previous, version, change)  # issue 30
        filtered = (
            change.save
            and previous is not None
            and previous.filter_known
            and change.state.filter_known
            and previous.row_filter != change.state.row_filter
        )
        if filtered:
            # ALTER PUBLICATION … SET TABLE t (cols) WHERE (…): the new shape
            # came with a new filter (see _check_filters).
            assert previous is not None
            change = replace(
                change,
                kinds=(*change.kinds, ROW_FILTER),
                heal=True,
                details=(
                    *change.details,
                    f"row filter {previous.row_filter or 'none'} -> {change.state.row_filter or 'none'}",
                ),
            )
        if change.kinds:
            self._book.report(name, change)
        elif kept and change.details:
            self._book.report_kept(name)
        if change.save:
            self._book.save(name, change, truncate_first=filtered)
        if not change.replay:
            self._book.states[name] = change.state
            self._idle.forget(name)  # the stream got there first
        return annotate(version, change.state), change.truncate

    def _catalog_for(self, version: TableVersion, previous: TableState | None, lsn: int) -> CatalogTable | None:
        """The catalog, unless a replay (older than the state) cannot need it.

        Read for a known shape too (once per version and session): a rewrite
        that keeps the shape shows only in the table's files.
        """
        if previous is not None and previous.relid == version.relation_id and lsn < previous.lsn:
            return None
        return self._reader.table(version.schema, version.table)

    def snapshot_version(self, version: TableVersion) -> TableVersion:
        """A version read from the catalog by a snapshot: the recorded annotations, by name."""
        state = self._book.states.get(format_table(version.schema, version.table))
        return annotate(version, state) if state is not None else version

    # -- baselines: the shape consumers were given, before the stream shows one ------

    def read_baseline(self, db: SourceDatabase, version: TableVersion, lsn: Lsn) -> TableState:
        """The state a snapshot gives consumers: ``version``, and the catalog as ``db`` sees it.

        For the initial snapshot ``db`` is inside the exported snapshot, so
        the files, attnums and fast defaults are those of the rows it reads.
        """
        state = baseline_state(version, self._reader.table(version.schema, version.table, db), int(lsn))
        # The catalog was read after lsn: versions committed in between may be older.
        return replace(state, read_lsn=self._reader.wal_position(db))

    def record_baseline(self, table: str, baseline: object) -> None:
        """Record what :meth:`read_baseline` gave, unless the stream recorded a later state."""
        assert isinstance(baseline, TableState)
        previous = self._book.states.get(table)
        if previous is not None and baseline.lsn < previous.lsn:
            return
        state = baseline
        if previous is not None:
            # Older records of the topic still need the earlier names, defaults and types.
            state = replace(
                carry(state, previous) if previous.relid == state.relid else state,
                retired=previous.retired,
                written=previous.written,
            )
        self._book.put(table, SchemaChange(state=state, save=True))
        self._idle.forget(table)

    def baseline_missing(self, tables: Iterable[tuple[str, str]], lsn: Lsn) -> None:
        """At start: a state from the catalog for each captured table that has none.

        Stamped with the slot's confirmed position ``lsn``, where the stream
        resumes: a version the stream meets later that differs from it is a
        change (if a migration committed between ``lsn`` and now, the older
        version met first looks like one and heals; nothing is absorbed).
        The WAL position read after the catalog (``read_lsn``) tells the
        versions that may be older than it from those that are not.
        """
        states = []
        for schema, table in tables:
            name = format_table(schema, table)
            if name in self._book.states:
                continue
            catalog = self._reader.table(schema, table)
            version = self._reader.version(schema, table) if catalog is not None else None
            if version is None:
                continue
            states.append((name, baseline_state(version, catalog, int(lsn))))
        # Read after the catalog: a version committed between lsn and here may be older.
        read = self._reader.wal_position() if states else None
        recorded = []
        for name, state in states:
            self._book.put(name, SchemaChange(state=replace(state, read_lsn=read), save=True))
            recorded.append(name)
        if recorded:
            log.info(
                "recorded the shape of %d captured table(s) at %s, the reference for their "
                "schema changes: %s",
                len(recorded),
                lsn,
                ", ".join(recorded[:10]) + (" …" if len(recorded) > 10 else ""),
            )

    def hand_over(self, table: str, reason: str) -> None:
        """The initial snapshot could not read ``table`` as of its snapshot: snapshot it incrementally."""
        if self._book.signals is None:
            raise DefiniteError(
                f"the initial snapshot of {table} must be completed incrementally ({reason}), "
                "but there is no signal table",
                hint="create the signal table (docs/snapshots.md) and run 'cdcd snapshot --table "
                f"{table}'",
            )
        job = self._book.signals.request([table], slot=self._slot)
        log.warning(
            "initial snapshot of %s: %s; the table is snapshotted again incrementally once "
            "streaming starts (job %s)",
            table,
            reason,
            job,
            extra={"table": table, "job": job},
        )

    # -- idle tables --------------------------------------------------------------------

    def catalog_check(self, include: Callable[[str, str], bool]) -> None:
        """Called from the main loop, often; cheap unless a check or a heal is due (``idle``)."""
        self._idle.run(include)
