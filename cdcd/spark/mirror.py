"""Parquet mirrors of the captured tables: the store and the Spark job (the I/O).

What a batch does to a table, and why every row carries a version, is the
pure code of :mod:`cdcd.spark.apply`; decoding is :mod:`cdcd.spark.decode`.
Here: reading and writing the output directory, and the ``foreachBatch``
job that decodes a micro-batch on the executors and applies it table by
table.

Storage and atomic replacement
------------------------------
``DIR/<schema>.<table>`` is a symbolic link to the current generation's
``data/`` directory (one Parquet file holding exactly the table's columns,
by PostgreSQL name), with the row versions, held-back changes and recent
deletes stored beside it. A batch writes new generations under
``DIR/.cdcd-mirror/tables/`` (to a temporary directory renamed into place),
then commits ``DIR/.cdcd-mirror/state.json`` (written to a temporary file
and renamed: this is the commit point), then swaps each table's link with a
rename, which is atomic: a reader sees the old table or the new one, never a
mix, and the previous generation is kept one more batch for readers that
opened it. A crash anywhere leaves either the old or the new state.json;
restarting repairs the links to match it and removes unused generations.
``state.json`` also records the last Spark batch id applied, so a batch Spark
replays after a crash is recognised and skipped.

Schema, table and column names are PostgreSQL's; ``/`` and ``%`` in them are
written ``%2F`` and ``%25`` in directory names, and a leading ``.`` as
``%2E``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.spark.apply import (
    META_LSN,
    META_SEQ,
    ApplyStats,
    Stored,
    TableState,
    apply_batch,
    empty_rows,
    reader_changes,
)
from cdcd.spark.decode import PAYLOAD_DDL, NativeChanges, decode_payloads, read_payloads
from cdcd.spark.layout import changes_arrow_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from cdcd.consumer import SchemaCatalog

__all__ = ["BatchReport", "MirrorJob", "MirrorStore"]

log = logging.getLogger(__name__)

STATE_DIR = ".cdcd-mirror"
FORMAT = 1


# ----------------------------------------------------------------------------- store


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_parquet(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, compression="zstd")
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


class MirrorStore:
    """The output directory: generations, ``state.json`` and the per-table links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta = root / STATE_DIR
        self.tables_dir = self.meta / "tables"
        self.state_path = self.meta / "state.json"
        self.batch_id = -1
        self.tables: dict[str, TableState] = {}  # by topic

    @property
    def checkpoint(self) -> Path:
        return self.meta / "checkpoint"

    def open(self) -> None:
        """Create or load the store, then repair links and remove leftovers of a crash."""
        try:
            self.tables_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the mirror directory {self.root}: {exc.strerror}"
            ) from exc
        if self.state_path.exists():
            try:
                data = json.loads(self.state_path.read_text("utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise DefiniteError(f"cannot read {self.state_path}: {exc}") from exc
            if data.get("format") != FORMAT:
                raise DefiniteError(
                    f"{self.state_path} has format {data.get('format')!r}, this cdcd writes {FORMAT}",
                    hint="mirror into a new output directory",
                )
            self.batch_id = int(data["batch_id"])
            self.tables = {
                topic: TableState.from_json(entry) for topic, entry in data["tables"].items()
            }
        for state in self.tables.values():
            self._link(state)
        self._collect_garbage()

    def _generation_dir(self, state: TableState, generation: int | None = None) -> Path:
        number = state.generation if generation is None else generation
        return self.tables_dir / state.dir_name / f"{number:010d}"

    def read_rows(self, state: TableState) -> pa.Table:
        """The working table of ``state`` (data plus row versions)."""
        if state.generation == 0:
            return empty_rows(state.layout)
        directory = self._generation_dir(state)
        try:
            data = pq.read_table(directory / "data" / "part-00000.parquet")
            versions = pq.read_table(directory / "versions.parquet")
        except (OSError, pa.ArrowInvalid) as exc:
            raise DefiniteError(
                f"cannot read the mirror of {state.name} in {directory}: {exc}"
            ) from exc
        if data.num_rows != versions.num_rows:
            raise DefiniteError(f"mirror of {state.name} in {directory} is inconsistent")
        for name in (META_LSN, META_SEQ):
            data = data.append_column(name, versions.column(name))
        return data

    def read_extras(self, state: TableState) -> tuple[pa.Table | None, pa.Table | None]:
        """The held-back changes and recent deletes stored with ``state`` (None: none)."""
        if state.generation == 0:
            return None, None
        directory = self._generation_dir(state)
        found = []
        for name in ("pending.parquet", "recent_deletes.parquet"):
            path = directory / name
            try:
                found.append(pq.read_table(path) if path.exists() else None)
            except (OSError, pa.ArrowInvalid) as exc:
                raise DefiniteError(f"cannot read {path}: {exc}") from exc
        return found[0], found[1]

    def read(self, state: TableState) -> Stored:
        """Everything stored with ``state``: rows, held-back changes, recent deletes."""
        pending, recent = self.read_extras(state)
        return Stored(self.read_rows(state), pending, recent)

    def write_generation(
        self,
        state: TableState,
        rows: pa.Table,
        pending: pa.Table | None = None,
        recent_deletes: pa.Table | None = None,
    ) -> TableState:
        """Write ``rows`` (and the extras) as the next generation of ``state``, uncommitted."""
        generation = state.generation + 1
        final = self._generation_dir(state, generation)
        temporary = final.parent / f".tmp-{generation:010d}-{uuid.uuid4().hex}"
        (temporary / "data").mkdir(parents=True)
        data = rows.drop_columns([META_LSN, META_SEQ])
        _write_parquet(data, temporary / "data" / "part-00000.parquet")
        _write_parquet(rows.select([META_LSN, META_SEQ]), temporary / "versions.parquet")
        for name, extra in (
            ("pending.parquet", pending),
            ("recent_deletes.parquet", recent_deletes),
        ):
            if extra is not None and extra.num_rows:
                _write_parquet(extra, temporary / name)
        _fsync_dir(temporary / "data")
        _fsync_dir(temporary)
        if final.exists():  # left by a crash before its commit
            shutil.rmtree(final)
        os.rename(temporary, final)
        _fsync_dir(final.parent)
        return replace(
            state,
            generation=generation,
            rows=rows.num_rows,
            pending=pending.num_rows if pending is not None else 0,
        )

    def commit(self, batch_id: int, tables: Mapping[str, TableState]) -> None:
        """Make ``tables`` (by topic) the current state, then point the links at them."""
        merged = {**self.tables, **tables}
        document = {
            "format": FORMAT,
            "batch_id": batch_id,
            "tables": {topic: state.to_json() for topic, state in sorted(merged.items())},
        }
        temporary = self.meta / f".state-{uuid.uuid4().hex}.json"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.state_path)
        _fsync_dir(self.meta)
        self.batch_id = batch_id
        self.tables = merged
        for state in tables.values():
            self._link(state)
        self._collect_garbage()

    def _link(self, state: TableState) -> None:
        if state.generation == 0:
            return
        link = self.root / state.dir_name
        target = os.path.relpath(self._generation_dir(state) / "data", self.root)
        if link.is_symlink() and os.readlink(link) == target:
            return
        if link.exists() and not link.is_symlink():
            raise ConfigError(
                f"{link} exists and is not a mirror link",
                hint="move it away or choose another --output directory",
            )
        temporary = self.root / f".{state.dir_name}.link-{uuid.uuid4().hex}"
        os.symlink(target, temporary)
        os.replace(temporary, link)

    def _collect_garbage(self) -> None:
        """Remove generations other than the current and the previous one, and temporaries."""
        current = {state.dir_name: state.generation for state in self.tables.values()}
        for table_dir in self.tables_dir.iterdir():
            if not table_dir.is_dir():
                continue
            keep = current.get(table_dir.name)
            for entry in table_dir.iterdir():
                if entry.name.startswith(".tmp-"):
                    shutil.rmtree(entry, ignore_errors=True)
                    continue
                if not entry.name.isdigit():
                    continue
                number = int(entry.name)
                if keep is None or number > keep or number < keep - 1:
                    shutil.rmtree(entry, ignore_errors=True)
        for entry in self.root.iterdir():
            if entry.name.startswith(".") and ".link-" in entry.name and entry.is_symlink():
                entry.unlink()


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


class MirrorJob:
    """Applies each micro-batch of raw Kafka rows to the mirror (``foreachBatch``)."""

    def __init__(self, store: MirrorStore, catalog: SchemaCatalog) -> None:
        self.store = store
        self.catalog = catalog
        self.reports: list[BatchReport] = []
        #: The error that failed a batch, for a one-line report (Spark wraps it).
        self.failure: CdcdError | None = None
        #: Set while no batch is being applied (stop between batches).
        self.idle = threading.Event()
        self.idle.set()

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        self.idle.clear()
        try:
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
        store = self.store
        if batch_id <= store.batch_id:
            return BatchReport(batch_id, 0, {}, skipped=True)
        # Executors get the catalog with every schema published so far.
        self.catalog.refresh()
        schema_of = self.catalog.schema
        payloads = raw.mapInArrow(
            partial(decode_payloads, schema_of=schema_of), PAYLOAD_DDL
        ).toArrow()
        return self.apply(batch_id, read_payloads(payloads, schema_of))

    def apply(self, batch_id: int, decoded: Mapping[str, Sequence[NativeChanges]]) -> BatchReport:
        """Apply a decoded batch (by topic) table by table, then commit it: no Spark here."""
        store = self.store
        schema_of = self.catalog.schema
        updated: dict[str, TableState] = {}
        stats: dict[str, ApplyStats] = {}
        changes_total = 0
        for topic, natives in sorted(decoded.items()):
            if not any(n.changes.num_rows for n in natives):
                continue
            previous = store.tables.get(topic)
            state, changes, dropped = reader_changes(topic, previous, natives, schema_of)
            changes_total += changes.num_rows + dropped
            stored = store.read(previous) if previous is not None else Stored.empty(state.layout)
            state, result = apply_batch(
                state, previous.layout if previous is not None else None, stored, changes, dropped
            )
            updated[topic] = store.write_generation(
                state, result.rows, result.pending, result.recent_deletes
            )
            stats[state.name] = result.stats
        # A table without changes in this batch still ages its held-back changes (rare);
        # its recent deletes age only with its own batches, which bring their partners.
        for topic, state in sorted(store.tables.items()):
            if topic in updated or not state.pending:
                continue
            state, result = apply_batch(
                state, None, store.read(state), changes_arrow_schema(state.layout).empty_table()
            )
            updated[topic] = store.write_generation(
                state, result.rows, result.pending, result.recent_deletes
            )
            stats[state.name] = result.stats
        store.commit(batch_id, updated)
        return BatchReport(batch_id, changes_total, stats)
