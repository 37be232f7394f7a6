"""The mirror's Spark job: what ``foreachBatch`` does with each micro-batch.

:class:`MirrorJob` decodes the batch on the executors (each task reduces what
it read: :func:`cdcd.spark.decode.decode_payloads`); a table the batch brings
many new rows (a new table, a later batch of its build) is written by the
executors (:mod:`cdcd.spark.bulk`), a large batch that changes many of an
existing table's rows is applied by the executors rewriting the table
(:mod:`cdcd.spark.rewrite`), everything else is collected, already
reduced, and applied table by table on the driver: pick the layout and key
(:func:`cdcd.spark.tablestate.reader_changes`), read the stored rows the changes
touch, fold the changes (the pure :func:`cdcd.spark.tablestate.apply_batch`), and
commit the difference (:class:`cdcd.spark.store.MirrorStore`), the history
table first when the table has one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import CdcdError, DefiniteError
from cdcd.naming import matches_table, parse_table, table_globs
from cdcd.spark import bulk, rewrite
from cdcd.spark.apply_runs import distinct_identities
from cdcd.spark.decode import PAYLOAD_DDL, NativeChanges, decode_payloads, read_payloads
from cdcd.spark.deltaio import TARGET_FILE_SIZE_BYTES, since_version
from cdcd.spark.faults import Fault, kill_self, killed_before_commit
from cdcd.spark.history import history_delta
from cdcd.spark.layout import RowLayout, changes_arrow_schema, only_added_plain_columns
from cdcd.spark.rows import META_LSN, META_SEQ, ApplyStats, Event, empty_rows
from cdcd.spark.store import Mirrored, MirrorStore, Side
from cdcd.spark.tablestate import Stored, TableState, apply_batch, reader_changes

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from cdcd.consumer import SchemaCatalog

log = logging.getLogger(__name__)


def _rekeys(stored: TableState, state: TableState, changes: pa.Table) -> bool:
    """Whether a batch changes the table's key, or holds changes written under another."""
    if stored.key != state.key:
        return True
    return any(k is not None and k != state.key for k in distinct_identities(changes))


@dataclass(frozen=True)
class HistoryOptions:
    """Which tables get a history table (:mod:`cdcd.spark.history`), and for which the
    changes to some columns only update the current version (``track_history_column_list``)."""

    all_tables: bool = False
    #: ``schema.table`` names or patterns (``public.*``) of ``postgres.tables``.
    patterns: tuple[str, ...] = ()
    #: (name or pattern, the columns whose changes start a new version); the first
    #: entry that matches a table applies.
    tracked: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def enabled(self, name: str) -> bool:
        return self.all_tables or any(_matches(p, name) for p in self.patterns)

    def tracked_columns(self, name: str) -> tuple[str, ...] | None:
        return next((columns for p, columns in self.tracked if _matches(p, name)), None)


def _matches(pattern: str, name: str) -> bool:
    """Whether the ``postgres.tables`` entry ``pattern`` names the table ``name``
    (``schema.table``, unquoted)."""
    schema, _, table = name.partition(".")
    globs = table_globs(pattern)
    if globs is not None:
        return matches_table(globs, schema, table)
    return parse_table(pattern, default_schema="public") == (schema, table)


def _positions(table: pa.Table, identity: list[str], marker: str) -> pa.Table:
    """``identity`` and the row versions of ``table``, with each row's position as ``marker``."""
    names = list(dict.fromkeys([*identity, META_LSN, META_SEQ]))
    return table.select(names).append_column(marker, pa.array(range(table.num_rows), pa.int64()))


def _changed(touched: pa.Table, result: pa.Table, identity: list[str]) -> tuple[pa.Table, pa.Table]:
    """(rows to upsert, identities to delete) that turn ``touched`` into ``result``.

    Joins only identities and versions (Arrow's hash join takes no list
    columns), then picks rows by position.
    """
    before = _positions(touched, identity, "_cdcd_old")
    after = _positions(result, identity, "_cdcd_new")
    same = after.join(
        before.select([*identity, "_cdcd_old"]) if identity != [META_LSN, META_SEQ] else before,
        keys=identity,
        join_type="full outer",
        right_suffix="_old",
    )
    old_positions = same.column("_cdcd_old")
    new_positions = same.column("_cdcd_new")
    gone = same.filter(pc.is_null(new_positions)).column("_cdcd_old")
    if identity == [META_LSN, META_SEQ]:
        fresh = same.filter(pc.is_null(old_positions)).column("_cdcd_new")
    else:
        # Same key: rewritten only when the version moved.
        joined_versions = before.select(["_cdcd_old", META_LSN, META_SEQ]).rename_columns(
            ["_cdcd_old", "_cdcd_old_lsn", "_cdcd_old_seq"]
        )
        same = same.join(joined_versions, keys="_cdcd_old", join_type="left outer")
        moved = pc.or_kleene(
            pc.is_null(same.column("_cdcd_old_lsn")),
            pc.or_kleene(
                pc.not_equal(same.column("_cdcd_old_lsn"), same.column(META_LSN)),
                pc.not_equal(same.column("_cdcd_old_seq"), same.column(META_SEQ)),
            ),
        )
        fresh = same.filter(pc.and_kleene(pc.is_valid(same.column("_cdcd_new")), moved)).column(
            "_cdcd_new"
        )
    upserts = result.take(pc.take(fresh, pc.sort_indices(fresh)))
    deletes = touched.select(identity).take(gone)
    return upserts, deletes


# ----------------------------------------------------------------------------- the Spark job


@dataclass
class BatchReport:
    batch_id: int
    changes: int
    tables: dict[str, ApplyStats]
    skipped: bool = False
    #: The tables whose batch the executors wrote, by name: ``files`` (new rows
    #: appended, :mod:`cdcd.spark.bulk`) or ``rewrite`` (:mod:`cdcd.spark.rewrite`);
    #: the driver applied the others.
    executors: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        if self.skipped:
            return f"batch {self.batch_id}: already applied, skipped"
        total = ApplyStats()
        for stats in self.tables.values():
            total = total + stats
        return (
            f"batch {self.batch_id}: {self.changes} changes to {len(self.tables)} table(s), "
            f"{total.applied} applied, {total.duplicates} duplicates, {total.stale} stale, "
            f"{total.truncates} truncates, {total.held_back} held back"
        )


@dataclass
class MirrorJob:
    """Applies each micro-batch of raw Kafka rows to the mirror (``foreachBatch``)."""

    store: MirrorStore
    catalog: SchemaCatalog
    reports: list[BatchReport] = field(default_factory=list)
    #: The error that failed a batch, for a one-line report (Spark wraps it).
    failure: CdcdError | None = None
    #: Set while no batch is being applied (stop between batches).
    idle: threading.Event = field(default_factory=threading.Event)
    #: Set once the store's app id is known (the streaming query's id).
    ready: threading.Event = field(default_factory=threading.Event)
    fault: Fault | None = field(default_factory=Fault.configured)
    #: Which tables also get a history table (``--history``, per-table settings).
    history: HistoryOptions = field(default_factory=lambda: HistoryOptions())
    #: Per-partition high-water marks reject repeats (Kafka); off for sources whose
    #: changes carry no partition order (:func:`cdcd.spark.autocdc.apply_changes`).
    track_partitions: bool = True
    #: A batch bringing a table at least this many new rows is written by the
    #: executors (:mod:`cdcd.spark.bulk`); None: always collected.
    bulk_rows: int | None = field(default_factory=lambda: bulk.BULK_ROWS)
    #: A batch of at least ``bulk_rows`` changes to an existing table that also
    #: brings it at least this fraction of its stored rows is applied by
    #: rewriting the table on the executors (:mod:`cdcd.spark.rewrite`); None: never.
    rewrite_fraction: float | None = field(default_factory=lambda: rewrite.REWRITE_FRACTION)

    def __post_init__(self) -> None:
        self.idle.set()

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        self.idle.clear()
        try:
            self.ready.wait()
            report = self.process(raw, batch_id)
        except CdcdError as exc:
            self.failure = exc
            raise
        finally:
            self.idle.set()
        self.reports.append(report)
        log.info("%s", report.line())

    def process(self, raw: DataFrame, batch_id: int) -> BatchReport:
        """Decode the batch on the executors, write its large new tables there, and apply
        the rest table by table on the driver."""
        # Executors get the catalog with every schema published so far.
        self.catalog.refresh()
        schema_of = self.catalog.schema
        # Executors reduce what they decode (runs of upserts per key); with
        # history tables, to one change per key and transaction.
        per_commit = self.history.all_tables or bool(self.history.patterns)
        decoded = raw.mapInArrow(
            partial(decode_payloads, schema_of=schema_of, per_commit=per_commit), PAYLOAD_DDL
        )
        return self.apply_payloads(decoded, batch_id)

    def apply_payloads(self, decoded: DataFrame, batch_id: int) -> BatchReport:
        """Apply a batch of decoded payloads (:data:`cdcd.spark.decode.PAYLOAD_DDL`, one
        key's changes in one task): the large batches of new rows written by the
        executors, the rest collected and applied here."""
        schema_of = self.catalog.schema
        threshold = self.bulk_rows
        if threshold is None:
            return self.apply(batch_id, read_payloads(decoded.toArrow(), schema_of))
        from pyspark import StorageLevel

        # Decoded once: the summary, the bulk writes and any collect read the cache.
        decoded = decoded.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            summary = decoded.mapInArrow(
                partial(bulk.summarize_payloads, keep_below=threshold), bulk.SUMMARY_DDL
            ).toArrow()
            return self._process_summarized(decoded, summary, batch_id, threshold)
        finally:
            decoded.unpersist()

    def _process_summarized(
        self, decoded: DataFrame, summary: pa.Table, batch_id: int, threshold: int
    ) -> BatchReport:
        schema_of = self.catalog.schema
        topics = summary.column("topic")
        counts: dict[str, int] = {}
        withheld: set[str] = set()
        for topic, rows, payload in zip(
            topics.to_pylist(),
            summary.column("rows").to_pylist(),
            pc.is_null(summary.column("payload")).to_pylist(),
            strict=True,
        ):
            counts[topic] = counts.get(topic, 0) + rows
            if payload:
                withheld.add(topic)
        large = sorted(t for t, n in counts.items() if n >= threshold or t in withheld)
        large_mask = pc.is_in(topics, pa.array(large, pa.string()))
        tables = bulk.bulk_tables(
            summary.filter(large_mask),
            threshold,
            schema_of,
            partial(self._bulk_target, batch_id=batch_id),
            self.track_partitions,
        )
        written = self._write_bulk(decoded, tables, batch_id) if tables else {}
        executors = {name: "files" for name, _, _ in written.values()}
        if self.rewrite_fraction is not None:
            # Large batches that change stored rows (and batches of new keys some of
            # which the executors found stored): rewritten by the executors.
            rest = sorted(set(large) - set(written))
            rewrites = rewrite.rewrite_tables(
                summary.filter(pc.is_in(topics, pa.array(rest, pa.string()))),
                threshold,
                self.rewrite_fraction,
                schema_of,
                partial(self._rewrite_target, batch_id=batch_id),
                self.track_partitions,
            )
            rewritten = self._write_rewrite(decoded, rewrites, batch_id) if rewrites else {}
            executors.update({name: "rewrite" for name, _, _ in rewritten.values()})
            written.update(rewritten)
        # The payloads that came with the summary, but for the tables written above
        # and the topics some payloads of which stayed on the executors (a table
        # the executors found keys of already stored is applied here after all).
        taken = pc.is_in(topics, pa.array(sorted(withheld | set(written)), pa.string()))
        payloads = summary.filter(pc.invert(taken)).select(
            ["topic", "header", "identity", "payload"]
        )
        skipped = 0
        collect = []
        for topic in sorted(withheld - set(written)):
            if self._applied(summary, topic, batch_id):
                skipped += 1  # a replayed batch: not collected to be skipped
            else:
                collect.append(topic)
        if collect:
            from pyspark.sql.functions import col

            rest = decoded.filter(col("topic").isin(collect)).toArrow()
            payloads = pa.concat_tables([payloads, rest.cast(payloads.schema)])
        report = self.apply(batch_id, read_payloads(payloads, schema_of))
        if not written and not report.tables and (report.skipped or skipped):
            return BatchReport(batch_id, 0, {}, skipped=True)
        tables_stats = {**report.tables, **{n: s for n, _, s in written.values()}}
        changes = report.changes + sum(c for _, c, _ in written.values())
        return BatchReport(batch_id, changes, tables_stats, executors=executors)

    def _bulk_target(
        self, topic: str, schema: str, table: str, *, batch_id: int
    ) -> bulk.BulkTarget | None:
        """Where the executors may write a table's batch (None: the driver applies it).

        A table new to the mirror, or one that holds no held-back change nor
        recent delete (the side tables) and has not seen this batch; with a
        history table, one the batch is not in yet that exists unless the table
        is new too (starting the history of a mirrored table reads its rows).
        """
        store = self.store
        mirrored = store.load(topic, schema, table)
        if mirrored is not None and (
            mirrored.applied_batch >= batch_id
            or mirrored.pending_version is not None
            or mirrored.recent_version is not None
        ):
            return None
        uri = mirrored.uri if mirrored is not None else store.uri_of(topic, schema, table)
        existing = mirrored.state if mirrored is not None else None
        if not self.history.enabled(f"{schema}.{table}"):
            return bulk.BulkTarget(uri, existing)
        history = store.history(uri)
        if history.applied_batch >= batch_id:
            # Committed before a crash that came before the table's commit.
            return bulk.BulkTarget(uri, existing)
        if (history.layout is None) != (mirrored is None):
            return None  # a history to start from stored rows, or left by an old query
        return bulk.BulkTarget(uri, existing, history.uri, history.layout)

    def _rewrite_target(
        self, topic: str, schema: str, table: str, *, batch_id: int
    ) -> rewrite.RewriteTarget | None:
        """Whether the executors may rewrite a table for this batch (None: the driver
        applies it): a table the mirror holds, that has not seen this batch, holds no
        held-back key-change create (a side table) and has no history table."""
        store = self.store
        mirrored = store.load(topic, schema, table)
        if (
            mirrored is None
            or mirrored.applied_batch >= batch_id
            or mirrored.pending_version is not None
            or self.history.enabled(f"{schema}.{table}")
        ):
            return None
        version, actions = store.add_actions(mirrored.uri)
        files = rewrite.stored_files(actions, version, mirrored.state.layout.key_names)
        return rewrite.RewriteTarget(mirrored.uri, mirrored.state, files)

    def _write_rewrite(
        self, decoded: DataFrame, tables: Mapping[str, rewrite.RewriteTable], batch_id: int
    ) -> dict[str, tuple[str, int, ApplyStats]]:
        """The executors rewrite the ``tables`` (their stored rows and the batch's
        changes co-grouped by key); one commit per table here. By topic: (table name,
        changes, statistics) of the tables committed; a table a bucket of which held
        a change back is not (the driver applies its batch)."""
        documents = {t: r.document() for t, r in tables.items()}
        storage_options = self.store.storage_options
        changes = decoded.mapInArrow(
            partial(rewrite.bucket_changes, tables=documents, schema_of=self.catalog.schema),
            rewrite.BUCKETED_DDL,
        )
        listing = rewrite.listing(tables)
        files = decoded.sparkSession.createDataFrame(listing, rewrite.FILES_DDL)
        if listing:
            files = files.repartition(min(len(listing), 64))
        stored = files.mapInArrow(
            partial(rewrite.bucket_stored, tables=documents, storage_options=storage_options),
            rewrite.BUCKETED_DDL,
        )
        actions = (
            changes.groupBy("topic", "bucket")
            .cogroup(stored.groupBy("topic", "bucket"))
            .applyInArrow(
                partial(
                    rewrite.apply_bucket,
                    tables=documents,
                    batch_id=batch_id,
                    storage_options=storage_options,
                    target_file_size=TARGET_FILE_SIZE_BYTES,
                ),
                bulk.ACTIONS_DDL,
            )
            .toArrow()
        )
        if self.fault is not None and self.fault.armed("in-rewrite", batch_id):
            kill_self("with the executors' rewritten data files written but not committed")
        out = {}
        for topic, table in sorted(tables.items()):
            name = table.state.name
            if bulk.actions_of(actions, topic, "held").num_rows:
                log.info("%s: the batch holds a change back, applied by the driver", name)
                continue
            mirrored = self.store.tables[topic]
            files_written = bulk.actions_of(actions, topic, "table")
            stored_files = table.target.files
            recent = bulk.actions_of(actions, topic, "recent")
            if mirrored.recent_version is not None:
                # The rows deleted by the batches before, one batch older.
                aged = rewrite.aged_recent(
                    mirrored.uri,
                    mirrored.recent_version,
                    table.state.layout,
                    batch_id,
                    storage_options,
                    TARGET_FILE_SIZE_BYTES,
                )
                recent = pa.concat_tables([recent, aged])
            self.store.commit_rewrite(
                table.state,
                mirrored,
                batch_id,
                version=stored_files.version,
                removes=list(zip(stored_files.paths, stored_files.sizes, strict=True)),
                files=files_written,
                recent=recent,
            )
            stats = bulk.applied_stats(actions, topic)
            self._warn_unmatched(name, stats, batch_id)
            out[topic] = (name, table.changes, stats)
            log.info(
                "%s: %d changes applied by the executors, %d data files rewritten as %d",
                name,
                table.changes,
                len(stored_files.paths),
                files_written.num_rows,
            )
        return out

    def _warn_unmatched(self, name: str, stats: ApplyStats, batch_id: int) -> None:
        if stats.unmatched:
            log.warning(
                "%s: %d update(s) or delete(s) in batch %d matched no row of the mirror "
                "(a delete removed nothing, an update was kept as an insert)",
                name,
                stats.unmatched,
                batch_id,
            )

    def _applied(self, summary: pa.Table, topic: str, batch_id: int) -> bool:
        rows = summary.filter(pc.equal(summary.column("topic"), topic))
        first = pa.ipc.open_stream(rows.column("newest")[0].as_buffer()).read_all().to_pylist()[0]
        mirrored = self.store.load(topic, first["source_schema"], first["source_table"])
        return mirrored is not None and mirrored.applied_batch >= batch_id

    def _write_bulk(
        self, decoded: DataFrame, tables: Mapping[str, bulk.BulkTable], batch_id: int
    ) -> dict[str, tuple[str, int, ApplyStats]]:
        """The executors write the ``tables``' data files; one commit per table here
        (its history table's first). By topic: (table name, changes, statistics) of
        the tables committed; a table a task found stored keys of is not."""
        actions = decoded.mapInArrow(
            partial(
                bulk.write_files,
                tables={t: b.document() for t, b in tables.items()},
                batch_id=batch_id,
                schema_of=self.catalog.schema,
                storage_options=self.store.storage_options,
                target_file_size=TARGET_FILE_SIZE_BYTES,
            ),
            bulk.ACTIONS_DDL,
        ).toArrow()
        if self.fault is not None and self.fault.armed("in-files", batch_id):
            kill_self("with the executors' data files written but not committed")
        out = {}
        for topic, table in sorted(tables.items()):
            name = table.state.name
            if bulk.actions_of(actions, topic, "clash").num_rows:
                log.info("%s: the batch inserts keys the table holds, applied by the driver", name)
                continue
            files = bulk.actions_of(actions, topic, "table")
            history_uri = table.target.history_uri
            if history_uri is not None:
                self._commit_bulk_history(
                    table, batch_id, bulk.actions_of(actions, topic, "history")
                )
            self.store.commit_files(
                table.state, table.uri, batch_id, files, create=table.target.existing is None
            )
            out[topic] = (name, table.changes, bulk.applied_stats(actions, topic))
            log.info(
                "%s: %d rows written by the executors in %d data files",
                name,
                table.changes,
                files.num_rows,
            )
        return out

    def _commit_bulk_history(self, table: bulk.BulkTable, batch_id: int, files: pa.Table) -> None:
        """Commit the versions the executors wrote to the table's history table, before
        the table itself (a replay after a crash between the two skips the history)."""
        history = self.store.history(table.uri)
        fault = self.fault
        if fault is not None and fault.armed("before-history", batch_id):
            kill_self("before the history commit")
        self.store.commit_history_files(history, table.state, batch_id, files)
        if fault is not None and fault.armed("after-history", batch_id):
            kill_self("after the history commit")

    def apply(self, batch_id: int, decoded: Mapping[str, Sequence[NativeChanges]]) -> BatchReport:
        """Apply a decoded batch (by topic) table by table, one commit each: no Spark here."""
        stats: dict[str, ApplyStats] = {}
        changes_total = 0
        skipped = 0
        done: set[str] = set()
        for topic, natives in sorted(decoded.items()):
            present = [n for n in natives if n.changes.num_rows]
            if not present:
                continue
            first = present[0].changes.slice(0, 1).to_pylist()[0]
            mirrored = self.store.load(topic, first["source_schema"], first["source_table"])
            done.add(topic)
            if mirrored is not None and mirrored.applied_batch >= batch_id:
                skipped += 1
                continue
            count, name, result = self._apply_table(topic, mirrored, present, batch_id)
            changes_total += count
            stats[name] = result
        # A table without changes in this batch still ages its held-back changes (rare).
        for topic, mirrored in sorted(self.store.tables.items()):
            if topic in done or mirrored.pending_version is None:
                continue
            if mirrored.applied_batch >= batch_id:
                continue
            _, name, result = self._apply_table(topic, mirrored, [], batch_id)
            stats[name] = result
        if skipped and not stats:
            return BatchReport(batch_id, 0, {}, skipped=True)
        return BatchReport(batch_id, changes_total, stats)

    def _apply_table(
        self,
        topic: str,
        mirrored: Mirrored | None,
        natives: Sequence[NativeChanges],
        batch_id: int,
    ) -> tuple[int, str, ApplyStats]:
        store = self.store
        first = natives[0].changes.slice(0, 1).to_pylist()[0] if natives else None
        name = (
            f"{first['source_schema']}.{first['source_table']}"
            if first is not None
            else mirrored.state.name
            if mirrored is not None
            else ""
        )
        history = self.history.enabled(name)
        if natives:
            existing = mirrored.state if mirrored is not None else None
            try:
                state, changes, dropped = reader_changes(
                    topic, existing, natives, self.catalog.schema, keep_truncated=history
                )
            except DefiniteError:
                if not history:
                    raise
                # Changes before a DROP TABLE + CREATE TABLE need not fit the new table.
                state, changes, dropped = reader_changes(
                    topic, existing, natives, self.catalog.schema
                )
        else:
            assert mirrored is not None
            state, dropped = mirrored.state, 0
            changes = changes_arrow_schema(state.layout).empty_table()
        truncate = state.truncated_at
        truncates = changes.filter(pc.equal(changes.column("op"), "t"))
        if truncates.num_rows:
            newest = max(
                zip(
                    truncates.column("lsn").to_pylist(),
                    truncates.column("seq").to_pylist(),
                    strict=True,
                )
            )
            if truncate is None or newest > truncate:
                truncate = (int(newest[0]), int(newest[1]))
        evolve_schema = False
        previous: RowLayout | None = None
        rekey = mirrored is not None and _rekeys(mirrored.state, state, changes)
        if rekey:
            # The key appeared, changed or went: every stored row is read, the
            # batch applied with each change's own key, and the table written
            # back in the commit that records the batch (and the new key).
            assert mirrored is not None
            previous = mirrored.state.layout
            log.info(
                "%s: key (%s) -> (%s), re-keying the mirror",
                state.name,
                ", ".join(mirrored.state.key) or "none",
                ", ".join(state.key) or "none",
            )
        elif mirrored is not None and mirrored.state.layout != state.layout:
            if only_added_plain_columns(mirrored.state.layout, state.layout):
                # Delta adds the columns (null in stored rows) within the MERGE.
                evolve_schema = True
                previous = mirrored.state.layout
            else:
                mirrored = store.rewrite(mirrored, state, truncate, batch_id)
        layout = state.layout
        if mirrored is None:
            side = Side(None, None)
            touched = empty_rows(layout)
        else:
            side = store._read_side(mirrored)
            pending = since_version(side.pending, truncate, "lsn", "seq")
            touched = (
                store.all_rows(mirrored)
                if rekey
                else store.read_touched(mirrored, changes, pending)
            )
        fresh = touched.num_rows == 0
        base_state = mirrored.state if mirrored is not None else state
        # With history, the rows a truncate of this batch removes are kept
        # until it comes (their versions end there).
        touched = since_version(
            touched, base_state.truncated_at if history else truncate, META_LSN, META_SEQ
        )
        assert touched is not None
        state, result = apply_batch(
            replace(state, truncated_at=base_state.truncated_at, high_water=base_state.high_water),
            previous,
            Stored(touched, side.pending, side.recent),
            changes,
            dropped,
            history=history,
        )
        if not self.track_partitions:
            state = replace(state, high_water={})
        if history:
            self._write_history(mirrored, state, batch_id, result.events or [])
        self._warn_unmatched(state.name, result.stats, batch_id)
        identity = list(layout.key_names) or [META_LSN, META_SEQ]
        if rekey:
            upserts, deletes = result.rows, empty_rows(layout)
        else:
            upserts, deletes = _changed(touched, result.rows, identity)
        merge_truncate = (
            result.truncated_at
            if mirrored is not None and result.truncated_at != mirrored.state.truncated_at
            else None
        )
        store.merge(
            mirrored,
            state,
            batch_id,
            upserts=upserts,
            deletes=deletes,
            truncate=merge_truncate,
            pending=result.pending,
            recent=result.recent_deletes,
            evolve_schema=evolve_schema,
            fault=self.fault,
            fresh=fresh,
            overwrite=rekey,
        )
        return changes.num_rows + dropped, state.name, result.stats

    def _write_history(
        self, mirrored: Mirrored | None, state: TableState, batch_id: int, events: list[Event]
    ) -> None:
        """Commit the batch's versions to the table's history table, before the table
        itself: a batch replayed after a crash between the two skips what it finds done."""
        store = self.store
        uri = mirrored.uri if mirrored is not None else store.uri_for(state)
        table = store.history(uri)
        if table.applied_batch >= batch_id:
            return
        if table.layout is None and mirrored is not None:
            table = store.seed_history(table, mirrored)
        delta = history_delta(events, self.history.tracked_columns(state.name))
        fault = self.fault
        if fault is not None and fault.armed("before-history", batch_id):
            kill_self("before the history commit")
        with killed_before_commit(
            table.uri,
            fault is not None and fault.armed("in-history", batch_id),
            store.storage_options,
        ):
            store.write_history(table, state, batch_id, delta)
        if fault is not None and fault.armed("after-history", batch_id):
            kill_self("after the history commit")
