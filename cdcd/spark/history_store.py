"""History tables on disk: where they are, how a batch's versions are committed.

What a batch does to the history (which versions start, end or change in
place) is the pure :mod:`cdcd.spark.history`; here is its store, as the
:class:`HistoryWrites` part of :class:`cdcd.spark.store.MirrorStore`: finding
a table's history table, seeding it from a table mirrored without one,
moving it to a new layout, and one commit per batch (a MERGE closing and
updating versions, inserting the new ones) carrying the batch's Delta
transaction id, so that a batch replayed after a crash is skipped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.spark.deltaio import (
    FORMAT,
    TARGET_FILE_SIZE_BYTES,
    commit_adds,
    older_mask,
    range_condition,
    read_all,
    sql_ident,
)
from cdcd.spark.history import (
    END_AT,
    END_LSN,
    HISTORY_COLUMNS,
    IS_CURRENT,
    OP,
    START_AT,
    START_LSN,
    HistoryDelta,
    history_schema,
)
from cdcd.spark.layout import RowLayout, convert_columns, only_added_plain_columns
from cdcd.spark.rows import META_LSN, META_SEQ, conform
from cdcd.spark.tablestate import TableState

if TYPE_CHECKING:
    from deltalake import DeltaTable

    from cdcd.spark.store import Mirrored

log = logging.getLogger(__name__)

#: The history table of a table (``--history``), inside its directory.
HISTORY_DIR = "_history"
HISTORY_KEY = "cdcd.history"


@dataclass
class HistoryTable:
    """A table's history table (:mod:`cdcd.spark.history`) between batches."""

    uri: str
    #: The layout its rows follow (recorded in its commits); None: not written yet.
    layout: RowLayout | None
    #: The highest Spark batch applied under the current app id (-1: none).
    applied_batch: int


MATCH_LSN = "__cdcd_match_lsn"
MATCH_SEQ = "__cdcd_match_seq"
KIND = "__cdcd_kind"


def with_match(
    table: pa.Table, lsns: list[int] | None, seqs: list[int] | None, kind: str
) -> pa.Table:
    """``table`` plus the MERGE's match columns (the stored version to match) and kind."""
    count = table.num_rows
    return (
        table.append_column(
            MATCH_LSN, pa.array(lsns if lsns is not None else [None] * count, pa.int64())
        )
        .append_column(
            MATCH_SEQ, pa.array(seqs if seqs is not None else [None] * count, pa.int64())
        )
        .append_column(KIND, pa.array([kind] * count, pa.string()))
    )


class HistoryWrites:
    """The history-table half of :class:`cdcd.spark.store.MirrorStore`."""

    storage_options: dict[str, str]
    app_id: str
    #: History tables elsewhere than in their table's ``_history`` (table URI -> URI).
    history_locations: dict[str, str]

    def _delta(self, uri: str, version: int | None = None) -> DeltaTable:
        raise NotImplementedError

    def _applied(self, delta: DeltaTable) -> int:
        raise NotImplementedError

    def all_rows(self, mirrored: Mirrored) -> pa.Table:
        raise NotImplementedError

    def history(self, uri: str) -> HistoryTable:
        """The history table of the mirrored table at ``uri`` (it may not exist yet)."""
        from deltalake import DeltaTable

        target = self.history_locations.get(uri) or f"{uri.rstrip('/')}/{HISTORY_DIR}"
        if not DeltaTable.is_deltatable(target, storage_options=self.storage_options):
            return HistoryTable(target, None, -1)
        delta = self._delta(target)
        layout = None
        for entry in delta.history():  # newest first
            text = entry.get(HISTORY_KEY)
            if text:
                document = json.loads(text)
                layout = RowLayout.from_envelope(document["envelope"])
                break
        if layout is None:
            raise DefiniteError(
                f"{target} is a Delta table that cdcd mirror did not write",
                hint="move it away or choose another --output",
            )
        return HistoryTable(target, layout, self._applied(delta))

    def _history_commit(self, state: TableState, batch_id: int | None, kind: str) -> Any:
        from deltalake import CommitProperties, Transaction

        document = {
            "format": FORMAT,
            "kind": kind,
            "app": self.app_id,
            "batch": batch_id,
            "envelope": state.envelope,
        }
        return CommitProperties(
            custom_metadata={HISTORY_KEY: json.dumps(document, sort_keys=True)},
            app_transactions=[Transaction(self.app_id, batch_id)] if batch_id is not None else None,
        )

    def seed_history(self, history: HistoryTable, mirrored: Mirrored) -> HistoryTable:
        """Start the history of a table mirrored without one: each stored row is the
        current version (its start is the change that wrote it; its time unknown)."""
        from deltalake import write_deltalake

        layout = mirrored.state.layout
        rows = self.all_rows(mirrored)
        count = rows.num_rows
        versions = rows.drop_columns([META_LSN, META_SEQ])
        for name, kind in HISTORY_COLUMNS:
            if name == START_LSN:
                column: pa.Array | pa.ChunkedArray = rows.column(META_LSN)
            elif name == IS_CURRENT:
                column = pa.array([True] * count, pa.bool_())
            elif name in (META_LSN, META_SEQ):
                column = rows.column(name)
            else:
                column = pa.nulls(count, kind)
            versions = versions.append_column(pa.field(name, kind), column)
        write_deltalake(
            history.uri,
            versions.cast(history_schema(layout)),
            mode="overwrite",
            storage_options=self.storage_options,
            target_file_size=TARGET_FILE_SIZE_BYTES,
            commit_properties=self._history_commit(mirrored.state, None, "seed"),
        )
        log.info("%s: history started from the %d stored rows", mirrored.state.name, count)
        return replace(history, layout=layout)

    def _evolve_history(
        self, history: HistoryTable, state: TableState
    ) -> tuple[HistoryTable, bool]:
        """The history table in ``state``'s layout: (table, whether the write must merge
        the schema). Anything but added plain columns rewrites it once."""
        from deltalake import write_deltalake

        old, new = history.layout, state.layout.shape
        assert old is not None
        if old == new:
            return history, False
        if only_added_plain_columns(old, new):
            return replace(history, layout=new), True
        data = read_all(self._delta(history.uri))
        rows = conform(data, history_schema(old), "history rows")
        columns = [rows.column(c.name) for c in old.columns]
        converted = convert_columns(columns, rows.num_rows, old, new, f"history of {state.name}")
        extra = [rows.column(name) for name, _ in HISTORY_COLUMNS]
        table = pa.Table.from_arrays(converted + extra, schema=history_schema(new))
        write_deltalake(
            history.uri,
            table,
            mode="overwrite",
            schema_mode="overwrite",
            storage_options=self.storage_options,
            target_file_size=TARGET_FILE_SIZE_BYTES,
            commit_properties=self._history_commit(state, None, "rewrite"),
        )
        log.info("%s: history rewritten for its new layout", state.name)
        return replace(history, layout=new), False

    def write_history(
        self, history: HistoryTable, state: TableState, batch_id: int, delta: HistoryDelta
    ) -> HistoryTable:
        """One commit of the history table: the versions a batch starts, ends and updates,
        with the batch's transaction id (a replayed batch is skipped)."""
        from deltalake import write_deltalake

        layout = state.layout
        schema = history_schema(layout)
        merge_schema = False
        if history.layout is not None:
            history, merge_schema = self._evolve_history(history, state)
        commit = self._history_commit(state, batch_id, "batch")
        inserts = pa.concat_tables(
            [pa.Table.from_pylist(delta.inserts, schema=schema)]
            + [conform(bulk, schema, "new versions") for bulk in delta.bulk]
        )
        updates = pa.Table.from_pylist(list(delta.updates.values()), schema=schema)
        matched = [
            with_match(updates, [v[0] for v in delta.updates], [v[1] for v in delta.updates], "upd")
        ]
        if delta.truncate is not None and history.layout is not None:
            matched.append(self._truncated(history, delta, schema))
        source = pa.concat_tables(matched + [with_match(inserts, None, None, "ins")])
        done = replace(history, layout=layout.shape, applied_batch=batch_id)
        to_match = sum(t.num_rows for t in matched)
        if history.layout is None or not to_match:
            write_deltalake(
                history.uri,
                inserts,
                mode="append",
                schema_mode="merge" if merge_schema else None,
                storage_options=self.storage_options,
                target_file_size=TARGET_FILE_SIZE_BYTES,
                commit_properties=commit,
            )
            return done
        on = (
            f"t.{sql_ident(META_LSN)} = s.{sql_ident(MATCH_LSN)} AND "
            f"t.{sql_ident(META_SEQ)} = s.{sql_ident(MATCH_SEQ)} AND t.{sql_ident(IS_CURRENT)}"
        )
        bounds = range_condition("t", META_LSN, pa.concat_tables(matched).column(MATCH_LSN))
        if bounds:
            on = f"{bounds} AND {on}"
        extra = [MATCH_LSN, MATCH_SEQ, KIND]
        closing = {n: f"s.{sql_ident(n)}" for n in (END_LSN, END_AT, IS_CURRENT)}
        (
            self._delta(history.uri)
            .merge(
                source,
                on,
                source_alias="s",
                target_alias="t",
                merge_schema=merge_schema,
                commit_properties=commit,
            )
            # A version ended by the transaction that started it never existed.
            .when_matched_delete(
                f"s.{sql_ident(END_LSN)} IS NOT NULL AND t.{sql_ident(START_LSN)} >= s.{sql_ident(END_LSN)}"
            )
            .when_matched_update_all(
                f"s.{sql_ident(KIND)} = 'upd'",
                except_cols=[START_LSN, START_AT, OP, *extra],
            )
            .when_matched_update(closing, f"s.{sql_ident(KIND)} = 'close'")
            .when_not_matched_insert_all(f"s.{sql_ident(KIND)} = 'ins'", except_cols=extra)
            .execute()
        )
        return done

    def commit_history_files(
        self,
        history: HistoryTable,
        state: TableState,
        batch_id: int,
        actions: pa.Table,
    ) -> HistoryTable:
        """Commit version files the executors wrote into the history table (new rows'
        open versions, :func:`cdcd.spark.bulk.write_files`) with the batch's
        transaction id: its first version, or an append."""
        commit_adds(
            history.uri,
            history_schema(state.layout),
            actions,
            create=history.layout is None,
            storage_options=self.storage_options,
            commit_properties=self._history_commit(state, batch_id, "batch"),
        )
        return replace(history, layout=state.layout.shape, applied_batch=batch_id)

    def _truncated(self, history: HistoryTable, delta: HistoryDelta, schema: pa.Schema) -> pa.Table:
        """Source rows ending, at the batch's first truncate, the current versions it
        leaves untouched that are older than it."""
        assert delta.truncate is not None
        version, at = delta.truncate
        data = read_all(self._delta(history.uri), [META_LSN, META_SEQ, IS_CURRENT])
        data = data.filter(pc.equal(data.column(IS_CURRENT), True))
        data = data.filter(older_mask(data.column(META_LSN), data.column(META_SEQ), version))
        touched = set(delta.updates)
        keep = [
            (lsn, seq) not in touched
            for lsn, seq in zip(
                data.column(META_LSN).to_pylist(), data.column(META_SEQ).to_pylist(), strict=True
            )
        ]
        data = data.filter(pa.array(keep, pa.bool_()))
        count = data.num_rows
        closes = schema.empty_table().to_pydict()
        base = pa.Table.from_pydict(
            {
                name: (
                    pa.array([version[0]] * count, pa.int64())
                    if name == END_LSN
                    else pa.array([at] * count, schema.field(name).type)
                    if name == END_AT
                    else pa.array([False] * count, pa.bool_())
                    if name == IS_CURRENT
                    else pa.nulls(count, schema.field(name).type)
                )
                for name in closes
            },
            schema=schema,
        )
        return with_match(
            base,
            data.column(META_LSN).to_pylist(),
            data.column(META_SEQ).to_pylist(),
            "close",
        )
