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

Identity: each change is matched by the key of its Kafka message (or the
whole row for a null key); a batch that changes a table's key reads the
stored rows once and writes the table back in the commit that records the
new key. History tables (``--history``, :mod:`cdcd.spark.history`) are
committed before their table, each commit with the batch's ``txn``.

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
import gc
import json
import logging
import os
import queue
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.naming import matches_table, parse_table, table_globs
from cdcd.spark.apply import (
    AGE,
    DEFERRALS,
    META_LSN,
    META_SEQ,
    ApplyStats,
    Event,
    Stored,
    TableState,
    Version,
    apply_batch,
    conform,
    distinct_identities,
    empty_rows,
    evolve,
    reader_changes,
    state_schema,
    table_dir_name,
)
from cdcd.spark.decode import PAYLOAD_DDL, NativeChanges, decode_payloads, read_payloads
from cdcd.spark.history import (
    END_AT,
    END_LSN,
    HISTORY_COLUMNS,
    IS_CURRENT,
    OP,
    START_AT,
    START_LSN,
    HistoryDelta,
    history_delta,
    history_schema,
    valid_at,
)
from cdcd.spark.layout import RowLayout, changes_arrow_schema, convert_columns, to_reader

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
#: The history table of a table (``--history``), inside its directory.
HISTORY_DIR = "_history"
HISTORY_KEY = "cdcd.history"
#: delta-rs splits written data into files of about this size: small enough
#: that a MERGE of a few keys rewrites little, large enough for scans.
TARGET_FILE_SIZE_BYTES = 32 * 1024 * 1024
#: Text statistics this long may be truncated prefixes (writers cut them).
STATS_PREFIX = 32
#: Fault point for the crash tests, empty in production (the tests set it
#: through their launcher, never the environment): ``before-merge``,
#: ``in-merge`` (SIGKILL once a data file of the MERGE exists but is not
#: committed) or ``after-merge``, and the same for the history table's commit
#: (``before-history``, ``in-history``, ``after-history``), optionally
#: ``:<batch id>``.
FAULT = ""

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
    uri: str,
    *,
    storage_options: Mapping[str, str] | None = None,
    version: int | None = None,
    timestamp: str | datetime | None = None,
    as_of_lsn: int | str | None = None,
) -> pa.Table:
    """A mirrored table as PostgreSQL shows it: its columns, without the row versions.

    ``version`` / ``timestamp`` (a datetime or RFC 3339 text): the table as
    that Delta version, or the newest one at that time, held it (time travel,
    back to what ``--vacuum`` kept). ``as_of_lsn`` (a commit LSN, as a number
    or ``X/XXXXXXXX``): the table as PostgreSQL held it when the transaction
    with that commit LSN committed, from the table's history table (``cdcd
    mirror --history``); with ``version``/``timestamp``, from that version of
    the history.
    """
    from deltalake import DeltaTable

    options = dict(storage_options or {})
    target = f"{uri.rstrip('/')}/{HISTORY_DIR}" if as_of_lsn is not None else uri
    if as_of_lsn is not None and not DeltaTable.is_deltatable(target, storage_options=options):
        raise DefiniteError(
            f"{uri} has no history table", hint="run cdcd mirror with --history for it"
        )
    table = DeltaTable(target, version=version, storage_options=options)
    if timestamp is not None:
        table.load_as_version(timestamp)
    data = _read_all(table)
    del table  # see _read_all
    gc.collect()
    if as_of_lsn is not None:
        lsn = lsn_value(as_of_lsn)
        data = valid_at(data, lsn)
        hidden = [name for name, _ in HISTORY_COLUMNS]
    else:
        hidden = [META_LSN, META_SEQ]
    return data.drop_columns([c for c in hidden if c in data.column_names])


def lsn_value(lsn: int | str) -> int:
    """A commit LSN as the bigint the history tables hold (``X/XXXXXXXX`` text too)."""
    if isinstance(lsn, int):
        return lsn
    high, sep, low = lsn.partition("/")
    try:
        return (int(high, 16) << 32) | int(low, 16) if sep else int(lsn)
    except ValueError:
        raise ConfigError(f"{lsn!r} is not an LSN (X/XXXXXXXX or a number)") from None


def _read_all(table: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """Every row of a Delta table version.

    The pyarrow dataset is dropped (and collected) before returning: left for
    the interpreter's exit, its threads can outlive Arrow's and abort the
    process (``terminate called without an active exception``).
    """
    dataset = table.to_pyarrow_dataset(filesystem=_arrow_filesystem(table.table_uri))
    data = dataset.to_table(columns=columns)
    del dataset
    gc.collect()
    return data


def _arrow_filesystem(uri: str) -> pafs.FileSystem | None:
    """Arrow's own filesystem for a local table; None (deltalake's) for an object store.

    An Arrow I/O thread still finishing a scan after ``to_table`` returned may
    drop the last reference to the dataset's filesystem. deltalake's is a
    Python object: released while the interpreter exits, it needs the GIL, the
    thread is killed holding C++ frames and the process aborts (``terminate
    called without an active exception``, about one ``read_mirror`` script in
    forty). Arrow's local filesystem needs no GIL.
    """
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return None
    return pafs.SubTreeFileSystem(unquote(parsed.path), pafs.LocalFileSystem())


# ----------------------------------------------------------------------------- helpers


def _ident(name: str) -> str:
    """``name`` as a SQL identifier for delta-rs predicates (DataFusion's quoting)."""
    return '"' + name.replace('"', '""') + '"'


def _older_sql(alias: str, version: Version) -> str:
    lsn, seq = f"{alias}.{_ident(META_LSN)}", f"{alias}.{_ident(META_SEQ)}"
    return f"({lsn} < {version[0]} OR ({lsn} = {version[0]} AND {seq} < {version[1]}))"


def _rekeys(stored: TableState, state: TableState, changes: pa.Table) -> bool:
    """Whether a batch changes the table's key, or holds changes written under another."""
    if stored.key != state.key:
        return True
    return any(k is not None and k != state.key for k in distinct_identities(changes))


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
    def configured(cls) -> _Fault | None:
        text = FAULT
        if not text:
            return None
        point, _, batch = text.partition(":")
        return cls(point, int(batch) if batch else None)

    def armed(self, point: str, batch_id: int) -> bool:
        return self.point == point and self.batch_id in (None, batch_id)


def _kill_self(reason: str) -> None:
    log.warning("fault injection: SIGKILL %s", reason)
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def _killed_before_commit(
    uri: str, armed: bool, storage_options: Mapping[str, str]
) -> Iterator[None]:
    """While armed, SIGKILL this process after the write inside has its data files but no commit.

    The next version's log entry is taken by a directory first, so delta-rs
    writes the data files and then fails to commit, every time (a thread
    watching for new files raced the commit and sometimes lost). The blocker
    goes before the kill: what is left is exactly a crash between the data
    files and the commit. Only for an existing local table.
    """
    if not armed or not is_local(uri):
        yield
        return
    from deltalake import DeltaTable

    path = _local_path(uri)
    if not DeltaTable.is_deltatable(path):
        raise ConfigError(f"fault {FAULT!r}: in-* faults need an existing table at {path}")
    version = DeltaTable(path, storage_options=dict(storage_options)).version()
    blocker = os.path.join(path, "_delta_log", f"{version + 1:020d}.json")
    os.mkdir(blocker)
    try:
        yield
    except Exception:  # noqa: BLE001 - the blocked commit's failure is the point: die here
        os.rmdir(blocker)
        _kill_self("with the data files written but not committed")
    os.rmdir(blocker)
    raise RuntimeError(f"fault {FAULT!r}: the commit of {path} was not blocked")


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


def _with_match(
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
        #: Tables kept elsewhere than under ``root`` (topic -> URI), and history
        #: tables elsewhere than in their table's ``_history`` (table URI -> URI).
        self.locations: dict[str, str] = {}
        self.history_locations: dict[str, str] = {}

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
        return self.load_uri(self.locations.get(topic) or table_uri(self.root, schema, table))

    def uri_for(self, state: TableState) -> str:
        """Where the table of ``state`` is (or will be) kept."""
        return self.locations.get(state.topic) or table_uri(self.root, state.schema, state.table)

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

    def all_rows(self, mirrored: Mirrored) -> pa.Table:
        """Every stored row, in the layout the table was written with."""
        schema = state_schema(mirrored.state.layout)
        try:
            data = _read_all(self._delta(mirrored.uri))
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
            _kill_self("before the MERGE")
        with _killed_before_commit(
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

    # ------------------------------------------------------------------ history tables

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
        if _only_added_plain_columns(old, new):
            return replace(history, layout=new), True
        data = _read_all(self._delta(history.uri))
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
            _with_match(
                updates, [v[0] for v in delta.updates], [v[1] for v in delta.updates], "upd"
            )
        ]
        if delta.truncate is not None and history.layout is not None:
            matched.append(self._truncated(history, delta, schema))
        source = pa.concat_tables(matched + [_with_match(inserts, None, None, "ins")])
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
            f"t.{_ident(META_LSN)} = s.{_ident(MATCH_LSN)} AND "
            f"t.{_ident(META_SEQ)} = s.{_ident(MATCH_SEQ)} AND t.{_ident(IS_CURRENT)}"
        )
        bounds = _range_condition("t", META_LSN, pa.concat_tables(matched).column(MATCH_LSN))
        if bounds:
            on = f"{bounds} AND {on}"
        extra = [MATCH_LSN, MATCH_SEQ, KIND]
        closing = {n: f"s.{_ident(n)}" for n in (END_LSN, END_AT, IS_CURRENT)}
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
                f"s.{_ident(END_LSN)} IS NOT NULL AND t.{_ident(START_LSN)} >= s.{_ident(END_LSN)}"
            )
            .when_matched_update_all(
                f"s.{_ident(KIND)} = 'upd'",
                except_cols=[START_LSN, START_AT, OP, *extra],
            )
            .when_matched_update(closing, f"s.{_ident(KIND)} = 'close'")
            .when_not_matched_insert_all(f"s.{_ident(KIND)} = 'ins'", except_cols=extra)
            .execute()
        )
        return done

    def _truncated(self, history: HistoryTable, delta: HistoryDelta, schema: pa.Schema) -> pa.Table:
        """Source rows ending, at the batch's first truncate, the current versions it
        leaves untouched that are older than it."""
        assert delta.truncate is not None
        version, at = delta.truncate
        data = _read_all(self._delta(history.uri), [META_LSN, META_SEQ, IS_CURRENT])
        data = data.filter(pc.equal(data.column(IS_CURRENT), True))
        data = data.filter(_older_mask(data.column(META_LSN), data.column(META_SEQ), version))
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
        return _with_match(
            base,
            data.column(META_LSN).to_pylist(),
            data.column(META_SEQ).to_pylist(),
            "close",
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
    if not (
        pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
    ):
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
    fault: _Fault | None = field(default_factory=_Fault.configured)
    #: Which tables also get a history table (``--history``, per-table settings).
    history: HistoryOptions = field(default_factory=lambda: HistoryOptions())
    #: Per-partition high-water marks reject repeats (Kafka); off for sources whose
    #: changes carry no partition order (:func:`cdcd.spark.autocdc.apply_changes`).
    track_partitions: bool = True

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
        # Executors reduce what they decode (runs of upserts per key); with
        # history tables, to one change per key and transaction.
        per_commit = self.history.all_tables or bool(self.history.patterns)
        payloads = raw.mapInArrow(
            partial(decode_payloads, schema_of=schema_of, per_commit=per_commit), PAYLOAD_DDL
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
            touched = (
                store.all_rows(mirrored)
                if rekey
                else store.read_touched(mirrored, changes, pending)
            )
        fresh = touched.num_rows == 0
        base_state = mirrored.state if mirrored is not None else state
        # With history, the rows a truncate of this batch removes are kept
        # until it comes (their versions end there).
        touched = _since(
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
        if result.stats.unmatched:
            log.warning(
                "%s: %d update(s) or delete(s) in batch %d matched no row of the mirror "
                "(a delete removed nothing, an update was kept as an insert)",
                state.name,
                result.stats.unmatched,
                batch_id,
            )
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
            _kill_self("before the history commit")
        with _killed_before_commit(
            table.uri,
            fault is not None and fault.armed("in-history", batch_id),
            store.storage_options,
        ):
            store.write_history(table, state, batch_id, delta)
        if fault is not None and fault.armed("after-history", batch_id):
            _kill_self("after the history commit")
