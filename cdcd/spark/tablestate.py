"""A mirrored table's state between batches, and one batch of one table (pure).

:class:`TableState` is what each mirror commit records of its table (reader
schema, key, last truncate, per-partition high-water marks);
:func:`reader_changes` picks the batch's newest schema and key and converts
its changes to that layout; :func:`apply_batch` applies them to the stored
rows the batch touches (:func:`cdcd.spark.apply.apply_changes`), moving
rows written with an older layout first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import DefiniteError
from cdcd.naming import ORIGINAL_NAME_ATTRIBUTE
from cdcd.spark.apply import apply_changes
from cdcd.spark.decode import NativeChanges, SchemaLookup, newest_version
from cdcd.spark.layout import RowLayout, row_schema_of, to_reader
from cdcd.spark.rows import (
    AGE,
    DEFERRALS,
    IDENTITY,
    META_LSN,
    META_SEQ,
    ApplyResult,
    Version,
    empty_rows,
    evolve,
    older,
)

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- table state


def table_dir_name(schema: str, table: str) -> str:
    """``<schema>.<table>`` made safe as one directory name (see the module docstring)."""

    def escape(part: str) -> str:
        part = part.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")
        return "%2E" + part[1:] if part.startswith(".") else part

    return f"{escape(schema)}.{escape(table)}"


@dataclass
class TableState:
    """What each mirror commit records of its table (commit metadata ``cdcd.mirror``)."""

    topic: str
    schema: str
    table: str
    envelope: dict[str, Any]  # the reader schema the rows follow
    schema_version: Version
    truncated_at: Version | None = None
    high_water: dict[int, Version] = field(default_factory=dict)
    #: The key columns (PostgreSQL names) of the newest change's message key; () for none.
    key: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def dir_name(self) -> str:
        return table_dir_name(self.schema, self.table)

    @property
    def layout(self) -> RowLayout:
        return RowLayout.from_envelope(self.envelope, self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "schema": self.schema,
            "table": self.table,
            "envelope": self.envelope,
            "schema_version": list(self.schema_version),
            "truncated_at": list(self.truncated_at) if self.truncated_at is not None else None,
            "high_water": {str(p): list(v) for p, v in sorted(self.high_water.items())},
            "key": list(self.key),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TableState:
        truncated = data.get("truncated_at")
        return cls(
            topic=data["topic"],
            schema=data["schema"],
            table=data["table"],
            envelope=data["envelope"],
            schema_version=(int(data["schema_version"][0]), int(data["schema_version"][1])),
            truncated_at=(int(truncated[0]), int(truncated[1])) if truncated else None,
            high_water={
                int(p): (int(v[0]), int(v[1])) for p, v in data.get("high_water", {}).items()
            },
            key=tuple(data["key"]) if "key" in data else _required_columns(data["envelope"]),
        )


def _required_columns(envelope: Mapping[str, Any]) -> tuple[str, ...]:
    """The key of a state recorded before keys were recorded: its non-union columns
    (what older mirrors took for the key; the next keyed change records the real one)."""
    return tuple(
        str(f.get(ORIGINAL_NAME_ATTRIBUTE, f["name"]))
        for f in row_schema_of(envelope)["fields"]
        if not isinstance(f["type"], list)
    )


# ----------------------------------------------------------------------------- one batch of one table


@dataclass
class Stored:
    """What the mirror holds of a table between batches, in the layout it was written with."""

    rows: pa.Table  # state_schema
    pending: pa.Table | None = None  # pending_schema: held-back changes
    recent_deletes: pa.Table | None = None  # recent_schema

    @classmethod
    def empty(cls, layout: RowLayout) -> Stored:
        return cls(empty_rows(layout))


def _version_mask(
    lsn: pa.ChunkedArray | pa.Array, seq: pa.ChunkedArray | pa.Array, version: Version
) -> pa.ChunkedArray:
    """Mask of rows whose (lsn, seq) is at or above ``version``."""
    return pc.invert(older(lsn, seq, version))


def _newest_truncate(natives: Sequence[NativeChanges], since: Version | None) -> Version | None:
    """The highest (lsn, seq) of a truncate in ``natives``, or ``since`` if higher."""
    newest = since
    for native in natives:
        changes = native.changes
        truncates = changes.filter(pc.equal(changes.column("op"), "t"))
        if truncates.num_rows:
            version = newest_version(truncates)
            if newest is None or version > newest:
                newest = version
    return newest


def reader_changes(
    topic: str,
    existing: TableState | None,
    natives: Sequence[NativeChanges],
    schema_of: SchemaLookup,
    keep_truncated: bool = False,
) -> tuple[TableState, pa.Table, int]:
    """The table's state with its newest schema and key, the batch's changes in that
    layout (plus the column ``IDENTITY``: each change's key columns), and how many
    changes were dropped as older than a truncate.

    Newest: the writer schema of the change with the highest (lsn, seq), in
    this batch or applied before (a replay may bring older schemas). Changes
    older than the table's newest truncate (in this batch or before) are
    dropped before they are converted: after ``DROP TABLE`` and ``CREATE
    TABLE`` the old table's changes need not fit the new table's columns.
    """
    candidates = [(newest_version(n.changes), n.header) for n in natives if n.changes.num_rows]
    version, header = max(candidates)
    envelope: Mapping[str, Any] = schema_of(header)
    # The key likewise: the message key of the newest change that has one
    # (truncates say nothing about it).
    keys = [
        (newest_version(n.changes), n.identity)
        for n in natives
        if n.changes.num_rows and n.identity is not None
    ]
    key_version, key = max(keys) if keys else ((-1, -1), None)
    if existing is not None and existing.schema_version > version:
        envelope, version = existing.envelope, existing.schema_version
    if existing is not None and (key is None or existing.schema_version > key_version):
        key = existing.key
    if existing is None:
        first = next(n for n in natives if n.changes.num_rows).changes.slice(0, 1).to_pylist()[0]
        existing = TableState(
            topic=topic,
            schema=first["source_schema"],
            table=first["source_table"],
            envelope=dict(envelope),
            schema_version=version,
        )
    shape = RowLayout.from_envelope(envelope)
    if key is None or not set(key) <= set(shape.names):
        key = ()
    state = replace(existing, envelope=dict(envelope), schema_version=version, key=tuple(key))
    reader = state.layout
    # With history (``keep_truncated``), changes before a truncate of this
    # batch are kept: they made versions too.
    truncate = (
        existing.truncated_at
        if keep_truncated
        else _newest_truncate(natives, existing.truncated_at)
    )
    parts = []
    dropped = 0
    for native in natives:
        changes = native.changes
        if truncate is not None and changes.num_rows:
            kept = changes.filter(
                _version_mask(changes.column("lsn"), changes.column("seq"), truncate)
            )
            dropped += changes.num_rows - kept.num_rows
            changes = kept
        converted = to_reader(changes, native.layout, reader, topic)
        identity = pa.array(
            [None if native.identity is None else list(native.identity)] * converted.num_rows,
            pa.list_(pa.string()),
        )
        parts.append(converted.append_column(IDENTITY, identity))
    return state, pa.concat_tables(parts), dropped


def _since(table: pa.Table | None, version: Version | None, lsn: str, seq: str) -> pa.Table | None:
    if table is None or version is None or not table.num_rows:
        return table
    return table.filter(_version_mask(table.column(lsn), table.column(seq), version))


def apply_batch(
    state: TableState,
    previous: RowLayout | None,
    stored: Stored,
    changes: pa.Table,
    dropped: int = 0,
    history: bool = False,
) -> tuple[TableState, ApplyResult]:
    """Apply one batch of a table: ``changes`` (from :func:`reader_changes`) to ``stored``.

    ``previous`` is the layout ``stored`` was written with (None: the
    table is new, or its layout is ``state``'s). Rows older than the batch's
    newest truncate are dropped before the rest moves to the new layout
    (:func:`evolve`); ``dropped`` changes (older than a truncate) count as
    stale. Returns the new state (not yet stored) and what was applied.
    ``history``: report what each change did (``ApplyResult.events``); the
    rows a truncate of the batch removes are then kept until it comes.
    """
    if history:
        try:
            return _apply_batch(
                state, previous, stored, changes, dropped, history=True, keep_truncated=True
            )
        except DefiniteError as exc:
            # Rows before a DROP TABLE + CREATE TABLE need not fit the new
            # table: its history then starts at the truncate.
            log.warning("%s: history of the rows before a truncate left out: %s", state.name, exc)
    return _apply_batch(state, previous, stored, changes, dropped, history=history)


def _apply_batch(
    state: TableState,
    previous: RowLayout | None,
    stored: Stored,
    changes: pa.Table,
    dropped: int,
    *,
    history: bool,
    keep_truncated: bool = False,
) -> tuple[TableState, ApplyResult]:
    layout = state.layout
    truncate = state.truncated_at
    ops = changes.column("op")
    truncates = changes.filter(pc.equal(ops, "t"))
    if truncates.num_rows:
        version = newest_version(truncates)
        if truncate is None or version > truncate:
            truncate = version
    kept_since = state.truncated_at if keep_truncated else truncate
    rows = _since(stored.rows, kept_since, META_LSN, META_SEQ)
    assert rows is not None
    pending = _since(stored.pending, truncate, "lsn", "seq")
    recent = _since(stored.recent_deletes, truncate, META_LSN, META_SEQ)
    source = previous if previous is not None else layout
    rows = evolve(rows, layout, state.name, source)
    if source != layout:
        if pending is not None and pending.num_rows:
            deferrals = pending.column(DEFERRALS)
            pending = to_reader(
                pending.drop_columns([DEFERRALS]), source, layout, state.topic
            ).append_column(DEFERRALS, deferrals)
        if recent is not None and recent.num_rows:
            ages = recent.column(AGE)
            recent = evolve(recent.drop_columns([AGE]), layout, state.name, source).append_column(
                AGE, ages
            )
    result = apply_changes(
        rows,
        changes,
        layout,
        truncated_at=state.truncated_at,
        high_water=state.high_water,
        pending=pending,
        recent_deletes=recent,
        history=history,
    )
    result.stats.stale += dropped
    return replace(state, truncated_at=result.truncated_at, high_water=result.high_water), result
