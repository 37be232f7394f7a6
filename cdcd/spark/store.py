"""The mirror's store: one Delta table per captured table, and its commits.

:class:`MirrorStore` finds and loads the tables under the output directory or
URI, reads the stored rows a batch touches (file pruning by the log's min/max
statistics), keeps the side tables (held-back key-change creates, recent
deletes), and writes: one MERGE commit per table and batch (or a plain
append, an overwrite for a re-keyed table, a rewrite for a new layout, a
commit of data files the executors wrote: :meth:`MirrorStore.commit_files`, and
of a table they rewrote: :meth:`MirrorStore.commit_rewrite`),
each carrying the batch's Delta transaction id and the table's state in its
commit metadata. History tables are its :class:`~cdcd.spark.history_store.HistoryWrites`
half; maintenance (OPTIMIZE, VACUUM) is here too.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import ConfigError, DefiniteError
from cdcd.spark.deltaio import (
    FORMAT,
    TARGET_FILE_SIZE_BYTES,
    commit_adds,
    is_local,
    local_path,
    older_mask,
    older_sql,
    pruned_dataset,
    range_condition,
    read_all,
    since_version,
    sql_ident,
    table_uri,
)
from cdcd.spark.faults import Fault, kill_self, killed_before_commit
from cdcd.spark.history_store import HISTORY_DIR, HistoryWrites
from cdcd.spark.layout import to_reader
from cdcd.spark.rows import (
    AGE,
    DEFERRALS,
    META_LSN,
    META_SEQ,
    Version,
    conform,
    evolve,
    recent_schema,
    state_schema,
)
from cdcd.spark.tablestate import TableState

if TYPE_CHECKING:
    from deltalake import DeltaTable

log = logging.getLogger(__name__)

#: Local output directories keep Spark's checkpoint here.
STATE_DIR = ".cdcd-mirror"
METADATA_KEY = "cdcd.mirror"
PENDING_DIR = "_cdcd_pending"
RECENT_DIR = "_cdcd_recent_deletes"


@dataclass
class Mirrored:
    """What the mirror knows of one Delta table between batches."""

    state: TableState
    uri: str
    pending_version: int | None = None
    recent_version: int | None = None
    #: The highest Spark batch applied under the current app id (-1: none).
    applied_batch: int = -1


@dataclass
class Side:
    """The side tables of a table, as of its last commit."""

    pending: pa.Table | None
    recent: pa.Table | None


def identity_rows(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` (identity columns only) in ``schema``, the other columns null."""
    arrays = [
        rows.column(f.name) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


class MirrorStore(HistoryWrites):
    """The output directory or URI: one Delta table per captured table."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: Mapping[str, str] | None = None,
        *,
        app_id: str = "cdcd-mirror",
    ) -> None:
        self.root = os.fspath(root)
        self.storage_options = dict(storage_options or {})
        self.app_id = app_id
        self.tables: dict[str, Mirrored] = {}  # by topic
        #: Tables kept elsewhere than under ``root`` (topic -> URI), and history
        #: tables elsewhere than in their table's ``_history`` (table URI -> URI).
        self.locations: dict[str, str] = {}
        self.history_locations: dict[str, str] = {}

    @property
    def checkpoint(self) -> str:
        """Spark's checkpoint for a local output directory."""
        return os.path.join(local_path(self.root), STATE_DIR, "checkpoint")

    def open(self) -> None:
        """Create a local output directory, and load the tables it already holds."""
        if not is_local(self.root):
            return
        path = local_path(self.root)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the mirror directory {path}: {exc.strerror}") from exc
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_dir() and os.path.isdir(os.path.join(entry.path, "_delta_log")):
                self.load_uri(entry.path if self.root == path else f"{self.root}/{entry.name}")

    def set_app_id(self, app_id: str) -> None:
        """Progress is counted per app id (a new Spark checkpoint starts a new one)."""
        self.app_id = app_id
        for mirrored in self.tables.values():
            mirrored.applied_batch = self._applied(self._delta(mirrored.uri))

    def _delta(self, uri: str, version: int | None = None) -> DeltaTable:
        from deltalake import DeltaTable

        return DeltaTable(uri, version=version, storage_options=self.storage_options)

    def _applied(self, delta: DeltaTable) -> int:
        version = delta.transaction_version(self.app_id)
        return -1 if version is None else int(version)

    def load_uri(self, uri: str) -> Mirrored | None:
        """The table at ``uri`` (None: no Delta table there)."""
        from deltalake import DeltaTable

        if not DeltaTable.is_deltatable(uri, storage_options=self.storage_options):
            return None
        delta = self._delta(uri)
        document = None
        for entry in delta.history():  # newest first; other writers' commits lack it
            text = entry.get(METADATA_KEY)
            if text:
                document = json.loads(text)
                break
        if document is None:
            raise DefiniteError(
                f"{uri} is a Delta table that cdcd mirror did not write",
                hint="move it away or choose another --output",
            )
        if document.get("format") != FORMAT:
            raise DefiniteError(
                f"{uri} has mirror format {document.get('format')!r}, this cdcd writes {FORMAT}",
                hint="mirror into a new output directory",
            )
        state = TableState.from_json(document["state"])
        mirrored = Mirrored(
            state,
            uri,
            document.get("pending"),
            document.get("recent_deletes"),
            self._applied(delta),
        )
        self.tables[state.topic] = mirrored
        return mirrored

    def load(self, topic: str, schema: str, table: str) -> Mirrored | None:
        if topic in self.tables:
            return self.tables[topic]
        return self.load_uri(self.locations.get(topic) or table_uri(self.root, schema, table))

    def uri_for(self, state: TableState) -> str:
        """Where the table of ``state`` is (or will be) kept."""
        return self.uri_of(state.topic, state.schema, state.table)

    def uri_of(self, topic: str, schema: str, table: str) -> str:
        """Where the table of ``topic`` (``schema.table``) is (or will be) kept."""
        return self.locations.get(topic) or table_uri(self.root, schema, table)

    # ------------------------------------------------------------------ side tables

    def _read_side(self, mirrored: Mirrored) -> Side:
        found: list[pa.Table | None] = []
        for name, version in (
            (PENDING_DIR, mirrored.pending_version),
            (RECENT_DIR, mirrored.recent_version),
        ):
            if version is None:
                found.append(None)
                continue
            try:
                found.append(self._delta(f"{mirrored.uri}/{name}", version).to_pyarrow_table())
            except Exception as exc:  # deltalake raises several types; all mean unreadable
                raise DefiniteError(f"cannot read {mirrored.uri}/{name}: {exc}") from exc
        return Side(found[0], found[1])

    def _write_side(self, uri: str, name: str, table: pa.Table | None) -> int | None:
        """Write ``table`` as the next version of a side table; its version (None: empty)."""
        if table is None or not table.num_rows:
            return None
        from deltalake import write_deltalake

        target = f"{uri}/{name}"
        write_deltalake(
            target,
            table,
            mode="overwrite",
            schema_mode="overwrite",
            storage_options=self.storage_options,
        )
        return int(self._delta(target).version())

    def _metadata(self, mirrored: Mirrored, batch_id: int, kind: str = "batch") -> dict[str, str]:
        """The commit metadata: the state after the commit; ``kind`` is ``batch`` for the
        commit that applies (and records) a batch, ``rewrite`` or ``optimize`` otherwise."""
        document = {
            "format": FORMAT,
            "kind": kind,
            "app": self.app_id,
            "batch": batch_id,
            "state": mirrored.state.to_json(),
            "pending": mirrored.pending_version,
            "recent_deletes": mirrored.recent_version,
        }
        return {METADATA_KEY: json.dumps(document, sort_keys=True)}

    # ------------------------------------------------------------------ reads

    def read_touched(
        self, mirrored: Mirrored, changes: pa.Table, pending: pa.Table | None
    ) -> pa.Table:
        """The stored rows a batch's changes can touch (by key; keyless: see the module doc).

        Files are skipped by the min/max statistics of the Delta log; the
        rest are read a record batch at a time and filtered in memory.
        (pyarrow's own filter pushdown trips over the ``string_view``
        columns delta-rs's MERGE writes.)
        """
        layout = mirrored.state.layout
        schema = state_schema(layout)
        parts = [changes] + ([pending] if pending is not None and pending.num_rows else [])
        rows = [p for p in parts if p.num_rows]
        if not rows:
            return schema.empty_table()
        delta = self._delta(mirrored.uri)
        wanted: dict[str, pa.Array] | None = {}
        assert wanted is not None
        if layout.key_names:
            images = [
                pc.if_else(pc.equal(p.column("op"), "d"), p.column("before"), p.column("after"))
                for p in rows
            ]
            for name in layout.key_names:
                values = pa.chunked_array([pc.struct_field(i, name) for i in images])
                if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
                    wanted = None  # arrays as keys: no filter, read all
                    break
                wanted[name] = pc.unique(values.drop_null()).cast(schema.field(name).type)
        else:
            ops = pa.chunked_array([p.column("op") for p in rows])
            if pc.any(pc.is_in(ops, pa.array(["u", "d"]))).as_py():
                wanted = None
            else:
                lsns = pa.chunked_array([p.column("lsn") for p in rows])
                wanted = {META_LSN: pc.unique(lsns).cast(pa.int64())}
        plain = pruned_dataset(delta, wanted)
        if plain is None:
            return schema.empty_table()
        found = []
        for batch in plain.to_batches():
            table = conform(pa.Table.from_batches([batch]), schema, "stored rows")
            if wanted:
                mask = None
                for name, values in wanted.items():
                    hit = pc.is_in(table.column(name), value_set=values)
                    mask = hit if mask is None else pc.and_(mask, hit)
                table = table.filter(mask)
            if table.num_rows:
                found.append(table)
        return pa.concat_tables(found) if found else schema.empty_table()

    def all_rows(self, mirrored: Mirrored) -> pa.Table:
        """Every stored row, in the layout the table was written with."""
        schema = state_schema(mirrored.state.layout)
        try:
            data = read_all(self._delta(mirrored.uri))
        except (OSError, pa.ArrowException) as exc:
            raise DefiniteError(f"cannot read the mirror in {mirrored.uri}: {exc}") from exc
        return conform(data, schema, "stored rows")

    def stored_rows(self, mirrored: Mirrored) -> Iterator[pa.RecordBatch]:
        """The stored rows in record batches, read by a thread of their own.

        The consumer is delta-rs's writer, running this generator on its async
        runtime, where delta-rs's reader may not block: reading happens
        elsewhere, two batches ahead at most.
        """
        batches: queue.Queue[pa.RecordBatch | Exception | None] = queue.Queue(maxsize=2)
        dataset = self._delta(mirrored.uri).to_pyarrow_dataset()

        def produce() -> None:
            try:
                for batch in dataset.to_batches():
                    batches.put(batch)
                batches.put(None)
            except (OSError, pa.ArrowException) as exc:  # the consumer raises it
                batches.put(exc)

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()

        def consume() -> Iterator[pa.RecordBatch]:
            while True:
                item = batches.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise DefiniteError(
                        f"cannot read the mirror in {mirrored.uri}: {item}"
                    ) from item
                yield item
            thread.join()

        return consume()

    # ------------------------------------------------------------------ writes

    def rewrite(
        self,
        mirrored: Mirrored,
        new_state: TableState,
        truncate: Version | None,
        batch_id: int,
    ) -> Mirrored:
        """Move the stored rows and side tables to ``new_state``'s layout, in one commit.

        Streamed: rows older than ``truncate`` are dropped first, the rest are
        evolved batch by batch (:func:`cdcd.spark.rows.evolve`).
        """
        from deltalake import CommitProperties, write_deltalake

        old = mirrored.state.layout
        new = new_state.layout
        schema = state_schema(new)
        old_schema = state_schema(old)
        name = new_state.name

        stored = self.stored_rows(mirrored)  # opened here, outside delta-rs's runtime

        def converted() -> Iterator[pa.RecordBatch]:
            for batch in stored:
                table = conform(pa.Table.from_batches([batch]), old_schema, "stored rows")
                if truncate is not None:
                    table = table.filter(
                        pc.invert(
                            older_mask(table.column(META_LSN), table.column(META_SEQ), truncate)
                        )
                    )
                if table.num_rows:
                    yield from evolve(table, new, name, old).to_batches()

        side = self._read_side(mirrored)
        pending = since_version(side.pending, truncate, "lsn", "seq")
        recent = since_version(side.recent, truncate, META_LSN, META_SEQ)
        if pending is not None and pending.num_rows:
            pending = to_reader(
                pending.drop_columns([DEFERRALS]), old, new, new_state.topic
            ).append_column(DEFERRALS, pending.column(DEFERRALS))
        if recent is not None and recent.num_rows:
            recent = evolve(recent.drop_columns([AGE]), new, name, old).append_column(
                AGE, recent.column(AGE)
            )
        updated = replace(
            mirrored,
            state=replace(new_state, truncated_at=truncate, high_water=mirrored.state.high_water),
            pending_version=self._write_side(mirrored.uri, PENDING_DIR, pending),
            recent_version=self._write_side(mirrored.uri, RECENT_DIR, recent),
        )
        write_deltalake(
            mirrored.uri,
            pa.RecordBatchReader.from_batches(schema, converted()),
            mode="overwrite",
            schema_mode="overwrite",
            storage_options=self.storage_options,
            target_file_size=TARGET_FILE_SIZE_BYTES,
            commit_properties=CommitProperties(
                custom_metadata=self._metadata(updated, batch_id, "rewrite")
            ),
        )
        self.tables[new_state.topic] = updated
        log.info("%s: stored rows rewritten for its new layout", name)
        return updated

    def merge(
        self,
        mirrored: Mirrored | None,
        state: TableState,
        batch_id: int,
        *,
        upserts: pa.Table,
        deletes: pa.Table,
        truncate: Version | None,
        pending: pa.Table | None,
        recent: pa.Table | None,
        evolve_schema: bool,
        fault: Fault | None = None,
        fresh: bool = False,
        overwrite: bool = False,
    ) -> Mirrored:
        """One commit: ``upserts`` and ``deletes`` by identity, a truncate, and the progress.

        ``fresh``: the table holds no row with the identity of any upsert (the
        caller read the touched rows and found none). ``overwrite``: ``upserts``
        are all the table's rows (a re-keyed table), written in place of the old ones.
        """
        from deltalake import CommitProperties, Transaction, write_deltalake

        uri = mirrored.uri if mirrored is not None else self.uri_for(state)
        updated = Mirrored(
            state,
            uri,
            self._write_side(uri, PENDING_DIR, pending),
            self._write_side(uri, RECENT_DIR, recent),
            batch_id,
        )
        commit = CommitProperties(
            custom_metadata=self._metadata(updated, batch_id),
            app_transactions=[Transaction(self.app_id, batch_id)],
        )
        append_only = (
            fresh
            and upserts.num_rows > 0
            and deletes.num_rows == 0
            and truncate is None
            and not evolve_schema
        )
        if fault is not None and fault.armed("before-merge", batch_id):
            kill_self("before the MERGE")
        with killed_before_commit(
            uri, fault is not None and fault.armed("in-merge", batch_id), self.storage_options
        ):
            if overwrite:
                write_deltalake(
                    uri,
                    upserts,
                    mode="overwrite",
                    schema_mode="overwrite",
                    storage_options=self.storage_options,
                    target_file_size=TARGET_FILE_SIZE_BYTES,
                    commit_properties=commit,
                )
            elif mirrored is None or append_only:
                # A new table, or rows none of whose keys are stored: a plain
                # write of what the batch left (a MERGE would join the table).
                write_deltalake(
                    uri,
                    upserts,
                    mode="append",
                    storage_options=self.storage_options,
                    target_file_size=TARGET_FILE_SIZE_BYTES,
                    commit_properties=commit,
                )
            else:
                self._merge(updated, upserts, deletes, truncate, evolve_schema, commit)
        if fault is not None and fault.armed("after-merge", batch_id):
            kill_self("after the MERGE commit")
        self.tables[state.topic] = updated
        return updated

    def commit_files(
        self, state: TableState, uri: str, batch_id: int, actions: pa.Table, *, create: bool
    ) -> Mirrored:
        """Commit data files the executors wrote into the table at ``uri``
        (:func:`cdcd.spark.bulk.write_files`: one row per file): the table's first
        version (``create``) or an append, in one commit with the batch's transaction
        id and ``state`` (no held-back changes nor recent deletes: the bulk path
        takes only tables without them). Files written but not committed here
        belong to no version."""
        from deltalake import CommitProperties, Transaction

        updated = Mirrored(state, uri, None, None, batch_id)
        commit = CommitProperties(
            custom_metadata=self._metadata(updated, batch_id),
            app_transactions=[Transaction(self.app_id, batch_id)],
        )
        commit_adds(
            uri,
            state_schema(state.layout),
            actions,
            create=create,
            storage_options=self.storage_options,
            commit_properties=commit,
        )
        self.tables[state.topic] = updated
        return updated

    def add_actions(self, uri: str) -> tuple[int, pa.Table]:
        """The current version of the table at ``uri`` and its data files' add actions
        (path, size, row count, statistics: ``get_add_actions(flatten=True)``)."""
        delta = self._delta(uri)
        return int(delta.version()), pa.table(delta.get_add_actions(flatten=True))

    def commit_rewrite(
        self,
        state: TableState,
        mirrored: Mirrored,
        batch_id: int,
        *,
        version: int,
        removes: Sequence[tuple[str, int]],
        files: pa.Table,
        recent: pa.Table,
    ) -> Mirrored:
        """Commit a table the executors rewrote (:mod:`cdcd.spark.rewrite`): one
        transaction on the table ``version`` they read that removes its data files
        ``removes`` ((path, size)) and adds ``files``, with the batch's transaction id
        and ``state``; the rows the batch deleted (``recent``: data files in the
        recent-deletes side table's directory) become that side table's next version
        first (with the rows the batches before deleted, aged). The table had no
        held-back change (the rewrite takes only those), so it has none after it.
        Files written but not committed here belong to no version."""
        from deltalake import CommitProperties, DeltaTable, Transaction

        recent_version = None
        if recent.num_rows:
            side = f"{mirrored.uri}/{RECENT_DIR}"
            exists = DeltaTable.is_deltatable(side, storage_options=self.storage_options)
            commit_adds(
                side,
                recent_schema(state.layout),
                recent,
                create=not exists,
                overwrite=exists,
                storage_options=self.storage_options,
                commit_properties=None,
            )
            recent_version = int(self._delta(side).version())
        updated = Mirrored(state, mirrored.uri, None, recent_version, batch_id)
        commit = CommitProperties(
            custom_metadata=self._metadata(updated, batch_id),
            app_transactions=[Transaction(self.app_id, batch_id)],
        )
        commit_adds(
            mirrored.uri,
            state_schema(state.layout),
            files,
            create=False,
            storage_options=self.storage_options,
            commit_properties=commit,
            removes=removes,
            version=version,
        )
        self.tables[state.topic] = updated
        return updated

    def _merge(
        self,
        mirrored: Mirrored,
        upserts: pa.Table,
        deletes: pa.Table,
        truncate: Version | None,
        evolve_schema: bool,
        commit: Any,
    ) -> None:
        layout = mirrored.state.layout
        identity = list(layout.key_names) or [META_LSN, META_SEQ]
        flag = "_cdcd_delete"
        schema = state_schema(layout)
        source = pa.concat_tables(
            [
                upserts.append_column(flag, pa.array([False] * upserts.num_rows, pa.bool_())),
                identity_rows(deletes, schema).append_column(
                    flag, pa.array([True] * deletes.num_rows, pa.bool_())
                ),
            ]
        )
        on = " AND ".join(f"t.{sql_ident(n)} = s.{sql_ident(n)}" for n in identity)
        # delta-rs prunes target files only by a condition on the target
        # itself: the range of the batch's first identity column, so that a
        # batch of recent keys reads the files that hold them, not the table.
        # Not with a truncate: its delete of the rows no source row matches
        # must see every file.
        bounds = (
            range_condition("t", identity[0], source.column(identity[0]))
            if truncate is None and source.num_rows
            else None
        )
        if bounds:
            on = f"{bounds} AND {on}"
        delta = self._delta(mirrored.uri)
        before = delta.version()
        if source.num_rows == 0 and truncate is None:
            self._commit_progress(mirrored, schema, evolve_schema, commit)
            return
        merger = delta.merge(
            source,
            on,
            source_alias="s",
            target_alias="t",
            merge_schema=evolve_schema,
            commit_properties=commit,
        )
        merger = (
            merger.when_matched_delete(f"s.{flag}")
            .when_matched_update_all(f"NOT s.{flag}", except_cols=[flag])
            .when_not_matched_insert_all(f"NOT s.{flag}", except_cols=[flag])
        )
        if truncate is not None:
            merger = merger.when_not_matched_by_source_delete(older_sql("t", truncate))
        metrics = merger.execute()
        log.debug("%s: MERGE %s", mirrored.state.name, metrics)
        if self._delta(mirrored.uri).version() == before:
            # delta-rs commits nothing for a MERGE that changes no row.
            self._commit_progress(mirrored, schema, evolve_schema, commit)

    def _commit_progress(
        self, mirrored: Mirrored, schema: pa.Schema, evolve_schema: bool, commit: Any
    ) -> None:
        """Commit a batch that changed no row: its progress and state still count."""
        from deltalake import write_deltalake

        write_deltalake(
            mirrored.uri,
            schema.empty_table(),
            mode="append",
            schema_mode="merge" if evolve_schema else None,
            storage_options=self.storage_options,
            commit_properties=commit,
        )

    # ------------------------------------------------------------------ maintenance

    def optimize(self, *, z_order: bool = True) -> dict[str, dict[str, Any]]:
        """Compact every table's small files; Z-order keyed tables by their key."""
        from deltalake import CommitProperties

        out = {}
        for mirrored in sorted(self.tables.values(), key=lambda m: m.uri):
            delta = self._delta(mirrored.uri)
            commit = CommitProperties(
                custom_metadata=self._metadata(mirrored, mirrored.applied_batch, "optimize")
            )
            keys = list(mirrored.state.layout.key_names)
            if z_order and keys:
                metrics = delta.optimize.z_order(
                    keys, target_size=TARGET_FILE_SIZE_BYTES, commit_properties=commit
                )
            else:
                metrics = delta.optimize.compact(
                    target_size=TARGET_FILE_SIZE_BYTES, commit_properties=commit
                )
            out[mirrored.state.name] = metrics
            history = self.history(mirrored.uri)
            if history.layout is not None:
                self._delta(history.uri).optimize.compact(
                    target_size=TARGET_FILE_SIZE_BYTES,
                    commit_properties=self._history_commit(mirrored.state, None, "optimize"),
                )
        return out

    def vacuum(self, retention_hours: int) -> dict[str, int]:
        """Delete files no version within ``retention_hours`` needs (side tables too)."""
        out = {}
        for mirrored in sorted(self.tables.values(), key=lambda m: m.uri):
            removed = 0
            for uri in (
                mirrored.uri,
                f"{mirrored.uri}/{PENDING_DIR}",
                f"{mirrored.uri}/{RECENT_DIR}",
                f"{mirrored.uri}/{HISTORY_DIR}",
            ):
                from deltalake import DeltaTable

                if not DeltaTable.is_deltatable(uri, storage_options=self.storage_options):
                    continue
                removed += len(
                    self._delta(uri).vacuum(
                        retention_hours=retention_hours,
                        dry_run=False,
                        enforce_retention_duration=False,
                    )
                )
            out[mirrored.state.name] = removed
        return out
