"""Delta Lake mirrors of the captured tables: the store and the Spark job (the I/O).

What a batch does to a table, and why every row carries a version, is the
pure code of :mod:`cdcd.spark.apply`; decoding is :mod:`cdcd.spark.decode`.
Here: the Delta tables (through ``deltalake``, delta-rs: no JVM jars), and
the ``foreachBatch`` job that decodes a micro-batch on the executors and
applies it table by table.

One Delta table per captured table
----------------------------------
``DIR/<schema>.<table>/`` (``DIR`` a local path or an object-store URI) is a
Delta table holding the table's columns, by PostgreSQL name, and two
metadata columns, ``_cdcd_lsn`` and ``_cdcd_seq``: the version of the
change that wrote the row (:func:`read_mirror` leaves them out).

A batch costs what it changes
-----------------------------
For each table the batch touches, only the stored rows of the touched keys
are read (a filter on the key, which skips the files whose min/max
statistics exclude them), the pure apply step computes their new state, and
one MERGE by key writes the difference: delete, update, insert. delta-rs
prunes the target files by the source's key range, so a batch of recent keys
rewrites the few files holding them. A truncate adds a "not matched by
source" delete of the rows older than it to the same MERGE. Keyless tables
(matched on whole rows) are read whole when a batch updates or deletes in
them, and merged on the row version, which identifies a row.

Atomic progress
---------------
The MERGE commit carries everything the next batch needs: a Delta
transaction identifier (``txn``: app id ``cdcd-mirror-<Spark query id>``,
version = the Spark batch id), so a batch Spark replays after a crash is
recognised table by table and skipped; and, in the commit's metadata
(``cdcd.mirror``), the table's state (reader schema, last truncate,
per-partition high-water marks) with the versions of two side tables,
``_cdcd_pending`` (held-back key-change creates) and ``_cdcd_recent_deletes``
(rows deleted by the last two batches), written before the commit and read
at exactly those versions. Directories starting with ``_`` are not part of
the table for Delta readers, nor removed by VACUUM. A crash before the
commit leaves unreferenced files only.

Schema changes: a new column without a default is added by Delta schema
evolution within the MERGE; anything else (a default for existing rows, a
rename, a drop, a type change, a table recreated with other columns)
rewrites the table once, streamed in record batches, in its own commit.

Schema, table and column names are PostgreSQL's; ``/`` and ``%`` in them are
written ``%2F`` and ``%25`` in directory names, and a leading ``.`` as
``%2E``.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.spark.apply import (
    AGE,
    DEFERRALS,
    META_LSN,
    META_SEQ,
    ApplyStats,
    Stored,
    TableState,
    Version,
    apply_batch,
    conform,
    empty_rows,
    evolve,
    reader_changes,
    state_schema,
    table_dir_name,
)
from cdcd.spark.decode import PAYLOAD_DDL, NativeChanges, decode_payloads, read_payloads
from cdcd.spark.layout import RowLayout, changes_arrow_schema, to_reader

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import DataFrame

    from cdcd.consumer import SchemaCatalog

__all__ = [
    "BatchReport",
    "MirrorJob",
    "MirrorStore",
    "is_local",
    "read_mirror",
    "table_uri",
]

log = logging.getLogger(__name__)

#: Local output directories keep Spark's checkpoint here.
STATE_DIR = ".cdcd-mirror"
FORMAT = 2
METADATA_KEY = "cdcd.mirror"
PENDING_DIR = "_cdcd_pending"
RECENT_DIR = "_cdcd_recent_deletes"
#: delta-rs splits written data into files of about this size: small enough
#: that a MERGE of a few keys rewrites little, large enough for scans.
TARGET_FILE_SIZE_BYTES = 32 * 1024 * 1024
#: Text statistics this long may be truncated prefixes (writers cut them).
STATS_PREFIX = 32
#: Fault injection for the crash tests: ``before-merge``, ``in-merge`` (SIGKILL
#: once a data file of the MERGE exists but is not committed) or ``after-merge``,
#: optionally ``:<batch id>``.
FAULT_ENV = "CDCD_MIRROR_FAULT"

# The row versions' column names (SPEC §8; :func:`read_mirror` drops them).
assert (META_LSN, META_SEQ) == ("_cdcd_lsn", "_cdcd_seq")


def is_local(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def _local_path(root: str) -> str:
    return root[len("file://") :] if root.startswith("file://") else root


def table_uri(root: str, schema: str, table: str) -> str:
    """Where the Delta table of ``schema.table`` lives under the output ``root``."""
    return f"{root.rstrip('/')}/{table_dir_name(schema, table)}"


def read_mirror(
    uri: str, *, storage_options: Mapping[str, str] | None = None, version: int | None = None
) -> pa.Table:
    """A mirrored table as PostgreSQL shows it: its columns, without the row versions."""
    from deltalake import DeltaTable

    table = DeltaTable(uri, version=version, storage_options=dict(storage_options or {}))
    data = table.to_pyarrow_dataset().to_table()
    return data.drop_columns([c for c in (META_LSN, META_SEQ) if c in data.column_names])


# ----------------------------------------------------------------------------- helpers


def _ident(name: str) -> str:
    """``name`` as a SQL identifier for delta-rs predicates (DataFusion's quoting)."""
    return '"' + name.replace('"', '""') + '"'


def _older_sql(alias: str, version: Version) -> str:
    lsn, seq = f"{alias}.{_ident(META_LSN)}", f"{alias}.{_ident(META_SEQ)}"
    return f"({lsn} < {version[0]} OR ({lsn} = {version[0]} AND {seq} < {version[1]}))"


def _only_added_plain_columns(old: RowLayout, new: RowLayout) -> bool:
    """``new`` is ``old`` plus columns without a default nor history: Delta evolves that."""
    count = len(old.columns)
    if new.columns[:count] != old.columns:
        return False
    known = {name for c in old.columns for name in (c.name, *c.aliases)}
    return all(
        c.default is None and not c.key and not ({c.name, *c.aliases} & known)
        for c in new.columns[count:]
    )


@dataclass
class _Fault:
    point: str
    batch_id: int | None

    @classmethod
    def from_env(cls) -> _Fault | None:
        text = os.environ.get(FAULT_ENV, "")
        if not text:
            return None
        point, _, batch = text.partition(":")
        return cls(point, int(batch) if batch else None)

    def armed(self, point: str, batch_id: int) -> bool:
        return self.point == point and self.batch_id in (None, batch_id)


def _kill_self(reason: str) -> None:
    log.warning("fault injection: SIGKILL %s", reason)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_on_uncommitted_file(path: str, known: set[str], done: threading.Event) -> None:
    """SIGKILL this process as soon as a data file not in ``known`` appears in ``path``."""
    while not done.is_set():
        for entry in os.scandir(path):
            if entry.name.endswith(".parquet") and entry.name not in known:
                _kill_self(f"with {entry.name} written but not committed")
        time.sleep(0.0002)


# ----------------------------------------------------------------------------- store


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
class _Side:
    pending: pa.Table | None
    recent: pa.Table | None


class MirrorStore:
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

    @property
    def checkpoint(self) -> str:
        """Spark's checkpoint for a local output directory."""
        return os.path.join(_local_path(self.root), STATE_DIR, "checkpoint")

    def open(self) -> None:
        """Create a local output directory, and load the tables it already holds."""
        if not is_local(self.root):
            return
        path = _local_path(self.root)
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
        return self.load_uri(table_uri(self.root, schema, table))

    # ------------------------------------------------------------------ side tables

    def _read_side(self, mirrored: Mirrored) -> _Side:
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
        return _Side(found[0], found[1])

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
        dataset = delta.to_pyarrow_dataset()
        fragments = list(dataset.get_fragments())
        if wanted:
            candidates = _candidate_files(delta, wanted)
            if candidates is not None:
                fragments = [f for f in fragments if os.path.basename(f.path) in candidates]
        if not fragments:
            return schema.empty_table()
        file_format = fragments[0].format
        plain = ds.FileSystemDataset(
            [file_format.make_fragment(f.path, f.filesystem) for f in fragments],
            schema=dataset.schema,
            format=file_format,
            filesystem=fragments[0].filesystem,
        )
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
        evolved batch by batch (:func:`cdcd.spark.apply.evolve`).
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
                            _older_mask(table.column(META_LSN), table.column(META_SEQ), truncate)
                        )
                    )
                if table.num_rows:
                    yield from evolve(table, new, name, old).to_batches()

        side = self._read_side(mirrored)
        pending = _since(side.pending, truncate, "lsn", "seq")
        recent = _since(side.recent, truncate, META_LSN, META_SEQ)
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
        fault: _Fault | None = None,
        fresh: bool = False,
    ) -> Mirrored:
        """One commit: ``upserts`` and ``deletes`` by identity, a truncate, and the progress.

        ``fresh``: the table holds no row with the identity of any upsert (the
        caller read the touched rows and found none).
        """
        from deltalake import CommitProperties, Transaction, write_deltalake

        uri = (
            mirrored.uri
            if mirrored is not None
            else table_uri(self.root, state.schema, state.table)
        )
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
            _kill_self("before the MERGE")
        watcher = None
        if fault is not None and fault.armed("in-merge", batch_id) and is_local(uri):
            path = _local_path(uri)
            known = set(os.listdir(path)) if os.path.isdir(path) else set()
            os.makedirs(path, exist_ok=True)
            done = threading.Event()
            watcher = (
                threading.Thread(
                    target=_kill_on_uncommitted_file, args=(path, known, done), daemon=True
                ),
                done,
            )
            watcher[0].start()
        try:
            if mirrored is None or append_only:
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
        finally:
            if watcher is not None:
                watcher[1].set()
                watcher[0].join()
        if fault is not None and fault.armed("after-merge", batch_id):
            _kill_self("after the MERGE commit")
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
                _identity_rows(deletes, schema).append_column(
                    flag, pa.array([True] * deletes.num_rows, pa.bool_())
                ),
            ]
        )
        on = " AND ".join(f"t.{_ident(n)} = s.{_ident(n)}" for n in identity)
        # delta-rs prunes target files only by a condition on the target
        # itself: the range of the batch's first identity column, so that a
        # batch of recent keys reads the files that hold them, not the table.
        # Not with a truncate: its delete of the rows no source row matches
        # must see every file.
        bounds = (
            _range_condition("t", identity[0], source.column(identity[0]))
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
            merger = merger.when_not_matched_by_source_delete(_older_sql("t", truncate))
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


def _sql_literal(value: Any) -> str | None:
    """``value`` as a SQL literal of its own type; None for types not spelled here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return None


def _range_condition(alias: str, name: str, values: pa.ChunkedArray | pa.Array) -> str | None:
    """``alias.name BETWEEN min AND max`` of ``values`` (integers and text only); None otherwise."""
    kind = values.type
    if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return None
    bounds = pc.min_max(values)
    low, high = _sql_literal(bounds["min"].as_py()), _sql_literal(bounds["max"].as_py())
    if low is None or high is None:
        return None
    column = f"{alias}.{_ident(name)}"
    return f"{column} >= {low} AND {column} <= {high}"


def _candidate_files(delta: DeltaTable, wanted: Mapping[str, pa.Array]) -> set[str] | None:
    """Data files whose min/max statistics admit some wanted value of every column.

    None: the log has no usable statistics (read every file).
    """
    actions = pa.table(delta.get_add_actions(flatten=True))
    columns = set(actions.column_names)
    if not all(f"min.{n}" in columns and f"max.{n}" in columns for n in wanted):
        return None
    keep = [True] * actions.num_rows
    for name, values in wanted.items():
        ordered = sorted(v for v in values.to_pylist() if v is not None)
        lows = actions.column(f"min.{name}").to_pylist()
        highs = actions.column(f"max.{name}").to_pylist()
        for i, (low, high) in enumerate(zip(lows, highs, strict=True)):
            if not keep[i] or low is None or high is None:
                continue  # no statistics: the file stays a candidate
            try:
                at = bisect.bisect_left(ordered, low)
                if isinstance(high, str | bytes) and len(high) >= STATS_PREFIX:
                    keep[i] = at < len(ordered)  # maybe a truncated maximum: no upper bound
                else:
                    keep[i] = at < len(ordered) and ordered[at] <= high
            except TypeError:  # values not comparable with the statistics' type
                return None
    paths = actions.column("path").to_pylist()
    return {os.path.basename(p) for p, k in zip(paths, keep, strict=True) if k}


def _older_mask(lsn: Any, seq: Any, version: Version) -> Any:
    return pc.or_(
        pc.less(lsn, version[0]), pc.and_(pc.equal(lsn, version[0]), pc.less(seq, version[1]))
    )


def _since(table: pa.Table | None, version: Version | None, lsn: str, seq: str) -> pa.Table | None:
    if table is None or version is None or not table.num_rows:
        return table
    return table.filter(pc.invert(_older_mask(table.column(lsn), table.column(seq), version)))


def _identity_rows(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` (identity columns only) in ``schema``, the other columns null."""
    arrays = [
        rows.column(f.name) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


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
    fault: _Fault | None = field(default_factory=_Fault.from_env)

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
        """Decode the batch in one Spark job, then apply it table by table."""
        # Executors get the catalog with every schema published so far.
        self.catalog.refresh()
        schema_of = self.catalog.schema
        payloads = raw.mapInArrow(
            partial(decode_payloads, schema_of=schema_of), PAYLOAD_DDL
        ).toArrow()
        return self.apply(batch_id, read_payloads(payloads, schema_of))

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
        if natives:
            state, changes, dropped = reader_changes(
                topic,
                mirrored.state if mirrored is not None else None,
                natives,
                self.catalog.schema,
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
        if mirrored is not None and mirrored.state.layout != state.layout:
            if _only_added_plain_columns(mirrored.state.layout, state.layout):
                # Delta adds the columns (null in stored rows) within the MERGE.
                evolve_schema = True
                previous = mirrored.state.layout
            else:
                mirrored = store.rewrite(mirrored, state, truncate, batch_id)
        layout = state.layout
        if mirrored is None:
            side = _Side(None, None)
            touched = empty_rows(layout)
        else:
            side = store._read_side(mirrored)
            pending = _since(side.pending, truncate, "lsn", "seq")
            touched = store.read_touched(mirrored, changes, pending)
        fresh = touched.num_rows == 0
        touched = _since(touched, truncate, META_LSN, META_SEQ)
        assert touched is not None
        base_state = mirrored.state if mirrored is not None else state
        state, result = apply_batch(
            replace(state, truncated_at=base_state.truncated_at, high_water=base_state.high_water),
            previous,
            Stored(touched, side.pending, side.recent),
            changes,
            dropped,
        )
        identity = list(layout.key_names) or [META_LSN, META_SEQ]
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
        )
        return changes.num_rows + dropped, state.name, result.stats
