"""Schema changes: keep consumers exact through migrations the WAL does not carry as rows.

PostgreSQL decodes DDL as nothing but a new ``Relation`` message before the
next change of the table, and several migrations change *existing* rows
without a single row change in the WAL:

* ``ADD COLUMN c T DEFAULT <constant>`` stores the value once, in the catalog
  (``pg_attribute.atthasmissing`` / ``attmissingval``): every older row reads
  it, no row is rewritten;
* a volatile default (``DEFAULT random()``), ``ALTER COLUMN … TYPE … USING``
  and any type change that is not binary-coercible rewrite the whole table
  into a new file (a new ``pg_class.relfilenode``), and logical decoding skips
  the rewrite's rows on purpose;
* ``RENAME COLUMN`` changes a name, nothing else;
* ``DROP TABLE`` + ``CREATE TABLE`` gives a new relation OID under the old name.

So when the publisher meets a new version of a table in the stream, in
commit order, this module compares it with the table's *recorded state* (the
shape cdcd last published, with each column's ``attnum``, the table's OID and
its storage files) and with the catalog, and classifies the change
(:func:`classify`, pure):

========================  =====================================================
what changed               what cdcd does
========================  =====================================================
column with a fast default the field gets that Avro default (carried)
column, no default         nothing (a nullable field defaults to null)
column by a rewrite        re-snapshot the table (heal)
type, binary-coercible     nothing (same values)
type, rewritten            re-snapshot the table (heal)
column dropped             nothing (the field goes)
column renamed             the field lists its earlier names as ``aliases``
table recreated            a truncate (``op=t``) before the new table's first change
replica identity / key     nothing here (a new key schema)
same shape, new files      re-snapshot, unless every row was provably kept
catalog moved on already   re-snapshot the table (worst case: heal)
table gone since           nothing (a table created again truncates first)
========================  =====================================================

**The baseline.** The reference is the shape consumers were given, never
the catalog at the moment the stream first meets a table (which may already
be past a migration: it would be absorbed, its rewritten values lost). It is
recorded by the initial snapshot, from the catalog *inside* its exported
snapshot (so as of the slot's consistent point, stamped with it); by every
incremental snapshot, from the catalog when it plans the table, stamped with
the WAL position read just before (recorded once the table is read, unless
the stream recorded a later state meanwhile); and at start, from the catalog
and stamped with the slot's confirmed position, for any captured table that
has none (:meth:`SchemaChanges.baseline_missing`). A migration at any moment
after that point is then compared at the table's next ``Relation``. A state
is a row of the signal table, written before anything that depends on it.

**Same-shape rewrites.** A rewrite that keeps columns and types sends the
same ``Relation`` again (or none). Only the table's files tell, so the
catalog is read at every version's first use, known shapes included, and by
the catalog check. New files with nothing else changed come from
``ALTER TABLE`` rewrites (new values possible), ``TRUNCATE`` (the stream
carries it and every row written since), ``VACUUM FULL``, ``CLUSTER`` and
``SET TABLESPACE`` (rows kept). They are told apart by the rows' ``xmin``
(:meth:`SchemaChanges._rows_kept`): the state records, with the files, the
xmin of the snapshot that read them (its *horizon*: every transaction that
commits later has an xid at or after it). An ``ALTER TABLE`` rewrite writes
every row anew with its own xid, later writes add newer ones, and the
row-keeping commands preserve each row's xmin. So a live row whose xmin
precedes the horizon proves that no value-changing rewrite happened since:
no re-snapshot. Finding none (an ``ALTER`` rewrite, a ``TRUNCATE``, a table
whose every row changed since, or a block sample that missed the old rows of
a large table) heals: exact beats cheap. After a ``TRUNCATE`` that costs the
rows written since it, which is what the table holds. The look is a block
sample of at most 1,000 pages (``LIMIT 1``), so it costs milliseconds
whatever the table's size.

**Idle tables.** A table migrated and never written again sends no
``Relation`` at all. Every ``schema_changes.check_interval_s`` the catalog
check compares each captured table's state with the catalog (OID, the shape
pgoutput would send, the files). A table that differs is a *suspect*, noted
with the WAL position ``W`` of the check; it is healed once the slot's
confirmed position has passed ``W`` and it still differs. Every change of the
table committed before ``W`` has then been published; had one come after the
migration, its ``Relation`` would have updated the state (and the stream is
cheaper and more precise than a re-snapshot, so it is given that chance).
The heal records the catalog's shape stamped with the current WAL position
``L >= W`` and requests a re-snapshot of the table (every kind of change
heals here: consumers learn a new shape only from a record; a recreated
table's re-snapshot starts with a truncate). Why the position is right when
the ``Relation`` comes later:

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

A heal is an incremental snapshot request written to the signal table in
the same statement that records the new state, so a crash either loses both
(the replayed stream finds the change again) or keeps both (the restarted
daemon resumes the snapshot). The state carries the commit LSN at which it
was first seen: a replay after a crash that meets an *older* shape uses it
as it was (same schema as first published) instead of mistaking it for a
change; a recreated table's truncate is emitted again when its transaction
is replayed.

Defaults and earlier names are sticky: every later schema of the table keeps
them as long as the column exists, because older records in the topic still
need them. The catalog facts are read on the metadata connection, on the
main loop: once per table version and session, and by the catalog check, a
few small queries per captured table and interval.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import fastavro

from cdcd.decode.relations import ColumnDefault, RelationCache, TableVersion
from cdcd.decode.types import TypeCatalog
from cdcd.decode.values import column_codec
from cdcd.envelope.schemas import Written, record_written, type_history
from cdcd.errors import DefiniteError, TransientError
from cdcd.naming import format_table, split_table
from cdcd.observability.metrics import Metrics
from cdcd.protocol.lsn import Lsn
from cdcd.snapshot.rows import published_relation
from cdcd.snapshot.store import (
    HEAL_ID_PREFIX,
    TRUNCATE_FIRST,
    SignalTable,
    SignalTableGone,
    SignalTableUnavailable,
)
from cdcd.source.catalog import column_dimensions
from cdcd.source.database import SourceDatabase, quote_ident

__all__ = [
    "CatalogColumn",
    "CatalogTable",
    "ColumnState",
    "SchemaChange",
    "SchemaChanges",
    "TableState",
    "avro_default",
    "classify",
]

log = logging.getLogger("cdcd.schema")

# Change kinds: the `kind` label of cdcd_schema_changes_total and the log lines.
ADD_DEFAULT = "add_column_default"
ADD_NULL = "add_column_null"
ADD_REWRITE = "add_column_rewrite"
DROP = "drop_column"
RENAME = "rename_column"
TYPE = "type_change"
TYPE_REWRITE = "type_change_rewrite"
REWRITE = "rewrite"  # same shape, new files, rows not provably kept
RECREATE = "recreate"
IDENTITY = "identity"
PUBLISH = "column_published"  # an existing column joined the publication's column list
UNPUBLISH = "column_unpublished"  # a column left it (still in the table)
ROW_FILTER = "row_filter"  # the publication's row filter of the table changed
UNKNOWN = "unknown"
KINDS = (
    ADD_DEFAULT, ADD_NULL, ADD_REWRITE, DROP, RENAME, TYPE, TYPE_REWRITE, REWRITE, RECREATE,
    IDENTITY, PUBLISH, UNPUBLISH, ROW_FILTER, UNKNOWN,
)

STATE_TYPE = "schema-state"  # signal-table rows that hold a table's state (never a job)


# ----------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class ColumnState:
    """A published column: its ``attnum`` (None: unknown) and what sticks to it."""

    attnum: int | None
    name: str
    type_oid: int
    type_modifier: int
    default: ColumnDefault | None = None
    aliases: tuple[str, ...] = ()
    nullable: bool = True  # published nullable in some schema (so it stays nullable)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "attnum": self.attnum,
            "name": self.name,
            "type": self.type_oid,
            "typmod": self.type_modifier,
            "nullable": self.nullable,
        }
        if self.default is not None:
            value = self.default.value
            if isinstance(value, str) and "\x00" in value:
                # jsonb holds no NUL character; a bytes default (latin-1) may.
                data["default_latin1_b64"] = base64.b64encode(value.encode("latin-1")).decode()
            else:
                data["default"] = value
        if self.aliases:
            data["aliases"] = list(self.aliases)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ColumnState:
        default: ColumnDefault | None = None
        if "default" in data:
            default = ColumnDefault(data["default"])
        elif "default_latin1_b64" in data:
            default = ColumnDefault(base64.b64decode(data["default_latin1_b64"]).decode("latin-1"))
        return cls(
            attnum=data.get("attnum"),
            name=str(data["name"]),
            type_oid=int(data["type"]),
            type_modifier=int(data["typmod"]),
            default=default,
            aliases=tuple(str(a) for a in data.get("aliases", ())),
            nullable=bool(data.get("nullable", True)),
        )


@dataclass(frozen=True, slots=True)
class TableState:
    """What cdcd last published of a table, and from which commit LSN on."""

    relid: int
    lsn: int  # commit LSN of the first transaction published with this shape
    storage: tuple[int, ...] | None  # relfilenodes (leaf partitions'); None: unknown
    replica_identity: str
    key: tuple[str, ...]
    columns: tuple[ColumnState, ...]
    recreated_lsn: int | None = None  # commit LSN of the first change after a recreate
    #: Names of dropped columns: older records carry them, so a new column by
    #: one of these names would resolve old values (it heals instead).
    retired: tuple[str, ...] = ()
    #: attnums of table columns the stream did not carry (a publication column
    #: list, generated columns): one that appears later held values all along,
    #: which no record has, unlike a column added by ALTER TABLE (it heals).
    unpublished: tuple[int, ...] = ()
    #: The publication's row filter when the state was recorded (SQL; None:
    #: none), meaningful only when ``filter_known``.
    row_filter: str | None = None
    filter_known: bool = False
    #: xmin of the snapshot that read ``storage`` (64-bit): every transaction
    #: that commits later has an xid at or after it (see _rows_kept).
    horizon: int | None = None
    #: Every Avro type written under each field name (issue 30: a field's
    #: union keeps them all, see cdcd.envelope.schemas).
    written: Written = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "written": {name: list(types) for name, types in self.written},
            "horizon": self.horizon,
            "retired": list(self.retired),
            "relid": self.relid,
            "lsn": self.lsn,
            "storage": list(self.storage) if self.storage is not None else None,
            "replica_identity": self.replica_identity,
            "key": list(self.key),
            "columns": [c.to_json() for c in self.columns],
            "recreated_lsn": self.recreated_lsn,
            "unpublished": list(self.unpublished),
            **({"row_filter": {"where": self.row_filter}} if self.filter_known else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TableState:
        storage = data.get("storage")
        return cls(
            relid=int(data["relid"]),
            lsn=int(data["lsn"]),
            storage=tuple(int(s) for s in storage) if storage is not None else None,
            replica_identity=str(data["replica_identity"]),
            key=tuple(str(k) for k in data["key"]),
            columns=tuple(ColumnState.from_json(c) for c in data["columns"]),
            recreated_lsn=data.get("recreated_lsn"),
            retired=tuple(str(r) for r in data.get("retired", ())),
            unpublished=tuple(int(a) for a in data.get("unpublished", ())),
            row_filter=(data.get("row_filter") or {}).get("where"),
            filter_known="row_filter" in data,
            written=tuple((str(n), tuple(t)) for n, t in data.get("written", {}).items()),
            horizon=int(data["horizon"]) if data.get("horizon") is not None else None,
        )

    def shape(self) -> tuple[object, ...]:
        return (
            self.relid,
            self.replica_identity,
            self.key,
            tuple((c.name, c.type_oid, c.type_modifier) for c in self.columns),
        )


def _version_shape(version: TableVersion) -> tuple[object, ...]:
    return (
        version.relation_id,
        version.replica_identity,
        _key_names(version),
        tuple((c.name, c.type_oid, c.type_modifier) for c in version.columns),
    )


def _key_names(version: TableVersion) -> tuple[str, ...]:
    return tuple(version.columns[i].name for i in version.key_indexes)


# ----------------------------------------------------------------------------- catalog facts


@dataclass(frozen=True, slots=True)
class CatalogColumn:
    attnum: int
    name: str
    type_oid: int
    type_modifier: int
    default: ColumnDefault | None  # from attmissingval; None: no fast default
    missing_unexpressible: bool = False  # has a fast default Avro cannot carry
    generated: bool = False  # GENERATED ALWAYS AS (...) STORED


@dataclass(frozen=True, slots=True)
class CatalogTable:
    relid: int
    storage: tuple[int, ...]
    columns: tuple[CatalogColumn, ...]
    #: The publication's column names for the table (pg_publication_tables.attnames,
    #: PostgreSQL 15+); None: not known.
    published: frozenset[str] | None = None
    row_filter: str | None = None  # the publication's row filter for the table
    filter_known: bool = False  # PostgreSQL 15+ and the publication lists the table
    horizon: int | None = None  # xmin of the snapshot this was read in (64-bit)
    plain: bool = True  # an ordinary table (relkind r), not a partitioned one

    def by_name(self) -> dict[str, CatalogColumn]:
        return {c.name: c for c in self.columns}

    def unpublished(self, version: TableVersion) -> tuple[int, ...]:
        """attnums of columns the stream leaves out because the publication does.

        A generated column, or one outside the publication's column list; not
        one the catalog has only because it is ahead of the stream (an ADD
        COLUMN the stream has not reached is in the publication already,
        unless a column list leaves it out).
        """
        sent = {c.name for c in version.columns}
        return tuple(
            c.attnum
            for c in self.columns
            if c.name not in sent
            and (c.generated or (self.published is not None and c.name not in self.published))
        )


# ----------------------------------------------------------------------------- classification


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """The outcome of meeting a new table version in the stream."""

    state: TableState  # what to record (and annotate the version with)
    kinds: tuple[str, ...] = ()  # empty: nothing changed (or a replay)
    heal: bool = False  # re-snapshot the table
    truncate: bool = False  # emit op=t before the table's first change
    details: tuple[str, ...] = ()  # for the log line
    save: bool = False  # the state is new and must be recorded
    replay: bool = False  # an older shape met again after a restart


def _matches(version: TableVersion, catalog: CatalogTable | None) -> bool:
    """Whether the catalog still describes this version (no later DDL on its columns)."""
    if catalog is None or catalog.relid != version.relation_id:
        return False
    by_name = catalog.by_name()
    for column in version.columns:
        known = by_name.get(column.name)
        if known is None or (known.type_oid, known.type_modifier) != (
            column.type_oid,
            column.type_modifier,
        ):
            return False
    return True


def _describes(version: TableVersion, catalog: CatalogTable | None) -> bool:
    """Whether the catalog is this very version: no later DDL at all, added columns included.

    New files under an unchanged Relation are this version's rewrite only
    then; a catalog with a column the stream has not reached yet is ahead
    of it, and the later version is compared with the recorded files itself
    (an ``ADD COLUMN … DEFAULT random()`` is ``add_column_rewrite`` there).
    """
    if catalog is None or not _matches(version, catalog):
        return False
    sent = {c.name for c in version.columns}
    left_out = set(catalog.unpublished(version))
    return all(c.name in sent or c.attnum in left_out for c in catalog.columns)


def _baseline(
    version: TableVersion, catalog: CatalogTable | None, lsn: int, recreated_lsn: int | None = None
) -> TableState:
    """The state of a version seen without (usable) history."""
    matched = _matches(version, catalog)
    by_name = catalog.by_name() if catalog is not None and matched else {}
    columns = []
    for i, column in enumerate(version.columns):
        known = by_name.get(column.name)
        columns.append(
            ColumnState(
                attnum=known.attnum if known is not None else None,
                name=column.name,
                type_oid=column.type_oid,
                type_modifier=column.type_modifier,
                # A fast default is what every row older than the column reads,
                # whenever the column was added: true of any record without it.
                default=known.default if known is not None else None,
                nullable=i not in version.key_indexes,
            )
        )
    return TableState(
        relid=version.relation_id,
        lsn=lsn,
        storage=catalog.storage if catalog is not None and matched else None,
        horizon=catalog.horizon if catalog is not None and matched else None,
        replica_identity=version.replica_identity,
        key=_key_names(version),
        columns=tuple(columns),
        recreated_lsn=recreated_lsn,
        unpublished=catalog.unpublished(version) if catalog is not None and matched else (),
        row_filter=catalog.row_filter if catalog is not None else None,
        filter_known=catalog is not None and catalog.filter_known,
    )


def _carry(state: TableState, previous: TableState) -> TableState:
    """``state`` with the defaults and earlier names ``previous`` had for its columns, by name."""
    carried = {c.name: c for c in previous.columns}
    return replace(
        state,
        columns=tuple(
            replace(
                c,
                default=c.default or (carried[c.name].default if c.name in carried else None),
                aliases=carried[c.name].aliases if c.name in carried else (),
            )
            for c in state.columns
        ),
    )


def _by_name(state: TableState, version: TableVersion, lsn: int) -> TableState:
    """A replayed older shape, annotated with what the state knows of its columns by name."""
    known = {c.name: c for c in state.columns}
    columns = []
    for column in version.columns:
        same = known.get(column.name)
        columns.append(
            ColumnState(
                attnum=same.attnum if same is not None else None,
                name=column.name,
                type_oid=column.type_oid,
                type_modifier=column.type_modifier,
                default=same.default
                if same is not None and same.type_oid == column.type_oid
                else None,
                aliases=same.aliases if same is not None else (),
                nullable=same.nullable if same is not None else True,
            )
        )
    return replace(
        state,
        lsn=lsn,
        replica_identity=version.replica_identity,
        key=_key_names(version),
        columns=tuple(columns),
    )


def classify(
    previous: TableState | None,
    version: TableVersion,
    catalog: CatalogTable | None,
    lsn: int,
    kept: bool = False,
) -> SchemaChange:
    """Compare a table version met in the stream at commit ``lsn`` with the recorded state.

    ``catalog`` is what pg_class/pg_attribute say *now* (None: the table is
    gone), which may be ahead of the stream; where it no longer describes
    ``version``, nothing can be ruled out and the change heals. ``kept``:
    the table's files changed since the state, but provably by an operation
    that keeps every row as it was (``VACUUM FULL``, ``CLUSTER``, ``SET
    TABLESPACE``: see ``SchemaChanges._rows_kept``).
    """
    if previous is None:
        return SchemaChange(state=_baseline(version, catalog, lsn), save=True)
    if previous.relid != version.relation_id:
        state = _baseline(version, catalog, lsn, recreated_lsn=lsn)
        return SchemaChange(
            state=state,
            kinds=(RECREATE,),
            truncate=True,
            details=(f"new relation oid {version.relation_id} (was {previous.relid})",),
            save=True,
        )
    same_shape = previous.shape() == _version_shape(version)
    if lsn < previous.lsn:
        # A replay of what was published before the recorded state: as it was.
        replayed = previous if same_shape else _by_name(previous, version, lsn)
        truncate = previous.recreated_lsn is not None and lsn <= previous.recreated_lsn
        return SchemaChange(state=replayed, truncate=truncate, replay=True)
    if same_shape:
        truncate = previous.recreated_lsn is not None and lsn <= previous.recreated_lsn
        if (
            catalog is not None
            and previous.storage is not None
            and catalog.relid == version.relation_id
            and catalog.storage != previous.storage
            and _describes(version, catalog)
        ):
            # The same Relation again, over new files: a rewrite that kept
            # the shape (ALTER COLUMN n TYPE int USING n * 10 on an int
            # column), or one that kept the rows (VACUUM FULL, CLUSTER).
            state = replace(previous, lsn=lsn, storage=catalog.storage, horizon=catalog.horizon)
            if kept:
                details = ("the table's files changed with every row kept",)
                return SchemaChange(state=state, truncate=truncate, details=details, save=True)
            return SchemaChange(
                state=state,
                kinds=(REWRITE,),
                heal=True,
                truncate=truncate,
                details=("the table was rewritten with its shape unchanged",),
                save=True,
            )
        return SchemaChange(state=previous, truncate=truncate)
    return _compare(previous, version, catalog, lsn, kept)


def _compare(
    previous: TableState,
    version: TableVersion,
    catalog: CatalogTable | None,
    lsn: int,
    kept: bool = False,
) -> SchemaChange:
    kinds: list[str] = []
    details: list[str] = []
    heal = False
    if (previous.replica_identity, previous.key) != (version.replica_identity, _key_names(version)):
        kinds.append(IDENTITY)
        details.append(f"key ({', '.join(previous.key)}) -> ({', '.join(_key_names(version))})")
    if catalog is None or catalog.relid != version.relation_id:
        # The table of this version is gone (dropped, perhaps created again):
        # nothing of it can be healed, and nothing needs to be — a table
        # created again under the name truncates its topic at its first change.
        state = _by_name(previous, version, lsn)
        details.append("the table no longer exists")
        return SchemaChange(state=state, kinds=(*kinds, UNKNOWN), details=tuple(details), save=True)
    if not _matches(version, catalog) or any(c.attnum is None for c in previous.columns):
        # Another DDL happened since, or the state never knew the attnums:
        # which column is which cannot be told, so nothing is ruled out.
        state = _carry(_baseline(version, catalog, lsn), previous)
        details.append("the catalog no longer describes this version")
        return SchemaChange(
            state=state, kinds=(*kinds, UNKNOWN), heal=True, details=tuple(details), save=True
        )
    assert catalog is not None
    rewritten = previous.storage is None or (previous.storage != catalog.storage and not kept)
    by_name = catalog.by_name()
    old_by_attnum = {c.attnum: c for c in previous.columns}
    keys = set(_key_names(version))
    attnums = {by_name[v.name].attnum for v in version.columns}
    dropped = [c for c in previous.columns if c.attnum not in attnums]
    retired = tuple(dict.fromkeys((*previous.retired, *(c.name for c in dropped))))
    # Earlier names a new column takes over stop being aliases of the column
    # that had them (two fields answering to one writer name is no schema).
    taken = {c.name for c in version.columns if by_name[c.name].attnum not in old_by_attnum}
    columns: list[ColumnState] = []
    for column in version.columns:
        now = by_name[column.name]
        old = old_by_attnum.get(now.attnum)
        default: ColumnDefault | None = None
        aliases: tuple[str, ...] = ()
        nullable = column.name not in keys
        if old is None and now.attnum in previous.unpublished:
            # In the table all along, now in the publication's column list (or
            # a generated column now published): rows hold values no record has.
            kinds.append(PUBLISH)
            details.append(f"{column.name} now published (it was in the table already)")
            heal = True
            default = None
        elif old is None and (
            column.name in retired or any(column.name in c.aliases for c in previous.columns)
        ):
            # Older records carry a field by this name with another column's
            # values, which Avro would resolve into the new one.
            kinds.append(ADD_NULL if now.default is None else ADD_DEFAULT)
            details.append(f"{column.name} added under the name of an earlier column")
            heal = True
            default = now.default
        elif old is None:
            if now.missing_unexpressible:
                kinds.append(ADD_DEFAULT)
                details.append(f"{column.name} added with a default Avro cannot carry")
                heal = True
            elif now.default is not None:
                kinds.append(ADD_DEFAULT)
                default = now.default
                details.append(f"{column.name} added with default {json.dumps(default.value)}")
            elif rewritten:
                kinds.append(ADD_REWRITE)
                details.append(f"{column.name} added by a table rewrite")
                heal = True
            else:
                kinds.append(ADD_NULL)
                details.append(f"{column.name} added")
        else:
            default = old.default
            aliases = tuple(a for a in old.aliases if a not in taken)
            nullable = nullable or old.nullable
            if old.name != column.name:
                kinds.append(RENAME)
                details.append(f"{old.name} renamed to {column.name}")
                aliases = tuple(
                    a for a in (*aliases, old.name) if a != column.name and a not in taken
                )
            if (old.type_oid, old.type_modifier) != (column.type_oid, column.type_modifier):
                if default is not None:
                    default = now.default  # the old Avro default may not fit the new type
                if rewritten:
                    kinds.append(TYPE_REWRITE)
                    details.append(f"{column.name} changed type with a table rewrite")
                    heal = True
                else:
                    kinds.append(TYPE)
                    details.append(f"{column.name} changed type (binary-coercible)")
        columns.append(
            ColumnState(
                attnum=now.attnum,
                name=column.name,
                type_oid=column.type_oid,
                type_modifier=column.type_modifier,
                default=default,
                aliases=aliases,
                nullable=nullable,
            )
        )
    in_table = {c.attnum for c in catalog.columns}
    for old in dropped:
        if old.attnum in in_table:
            kinds.append(UNPUBLISH)
            details.append(f"{old.name} no longer published")
        else:
            kinds.append(DROP)
            details.append(f"{old.name} dropped")
    if rewritten and not heal:
        # The table's files changed and nothing above explains why: a rewrite
        # cdcd cannot rule out (or a TRUNCATE, which heals harmlessly: the
        # table holds only what the stream carried since).
        heal = True
        details.append("the table was rewritten")
    state = TableState(
        relid=version.relation_id,
        lsn=lsn,
        storage=catalog.storage,
        horizon=catalog.horizon,
        replica_identity=version.replica_identity,
        key=_key_names(version),
        columns=tuple(columns),
        retired=tuple(name for name in retired if name not in {c.name for c in columns}),
        unpublished=catalog.unpublished(version),
        row_filter=catalog.row_filter,
        filter_known=catalog.filter_known,
    )
    unique = tuple(dict.fromkeys(kinds)) or (UNKNOWN,)
    return SchemaChange(state=state, kinds=unique, heal=heal, details=tuple(details), save=True)


def remember_written(
    previous: TableState | None, version: TableVersion, change: SchemaChange
) -> SchemaChange:
    """``change`` with the version's field types added to what the topic was written with."""
    written = record_written(previous.written if previous is not None else (), version)
    if written == change.state.written:
        return change
    state = replace(change.state, written=written)
    return replace(change, state=state, save=change.save or not change.replay)


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
    relid, identity, storage, key, columns = row
    return (
        int(relid),
        str(identity),
        tuple(int(s) for s in storage or ()),
        tuple(str(k) for k in key or ()),
        tuple(str(c) for c in columns or ()),
    )


def annotate(version: TableVersion, state: TableState) -> TableVersion:
    """The version with the state's defaults and earlier names, by column name."""
    known = {c.name: c for c in state.columns}
    defaults: list[ColumnDefault | None] = []
    aliases: list[tuple[str, ...]] = []
    optional: list[bool] = []
    history: list[tuple[Any, ...]] = []
    for i, column in enumerate(version.columns):
        same = known.get(column.name)
        fits = same is not None and (same.type_oid, same.type_modifier) == (
            column.type_oid,
            column.type_modifier,
        )
        defaults.append(same.default if fits and same is not None else None)
        aliases.append(same.aliases if same is not None else ())
        history.append(type_history(state.written, version, i, aliases[-1]))
        optional.append(
            (same is not None and same.nullable or bool(history[-1])) and i in version.key_indexes
        )
    if not any(defaults) and not any(aliases) and not any(optional) and not any(history):
        return version
    return replace(
        version,
        defaults=tuple(defaults),
        aliases=tuple(aliases),
        optional=tuple(optional),
        history=tuple(history),
    )


# ----------------------------------------------------------------------------- defaults


def _strip_logical(schema: Any) -> Any:
    if isinstance(schema, dict):
        if schema.get("type") == "array":
            return {"type": "array", "items": _strip_logical(schema["items"])}
        return schema["type"] if "logicalType" in schema else schema
    if isinstance(schema, list):
        return [_strip_logical(s) for s in schema]
    return schema


def avro_default(avro_type: Any, encoded: bytes) -> ColumnDefault | None:
    """Avro's JSON form of one encoded value, as a field default; None if it has none.

    Only scalars: an array's items are ``["null", T]`` unions, whose default
    Avro readers would resolve by the first branch — so an array default, like
    a non-finite float (no JSON form), heals by a re-snapshot instead.
    """
    raw = _strip_logical(avro_type)
    if not isinstance(raw, str):
        return None
    value = fastavro.schemaless_reader(io.BytesIO(encoded), raw, None)
    if isinstance(value, bytes):
        return ColumnDefault(value.decode("latin-1"))
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bool | int | float | str):
        return ColumnDefault(value)
    return None


# ----------------------------------------------------------------------------- I/O

# The snapshot's xmin, read in the same statement as the files: see _rows_kept.
_TABLE_SQL = """
SELECT c.oid, c.relkind, c.relfilenode,
  CASE WHEN c.relkind = 'p' THEN ARRAY(
    SELECT p.relfilenode FROM pg_partition_tree(c.oid) t JOIN pg_class p ON p.oid = t.relid
    WHERE t.isleaf ORDER BY p.relfilenode) END,
  {xmin}::text::bigint
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""

#: Whether a table holds a row written before the horizon ``%(h)s`` (its low
#: 32 bits): xids compare modulo 2^32, as PostgreSQL compares them; 1 and 2
#: (bootstrap, frozen) prove nothing. A block sample of at most
#: _PROOF_PAGES pages bounds the cost: any row found is a proof, none found
#: only means a re-snapshot.
_KEPT_SQL = (
    "SELECT 1 FROM {table} TABLESAMPLE SYSTEM (%(percent)s) WHERE xmin::text::bigint >= 3 "
    "AND ((xmin::text::bigint - %(h)s) & 4294967295) >= 2147483648 LIMIT 1"
)
_PROOF_PAGES = 1000

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
#: slot's confirmed position is read (see SchemaChanges.catalog_check).
_CONFIRM_INTERVAL_S = 0.5

# Generated columns are not in pgoutput's Relation message (before PG18's
# publish_generated_columns); a column list leaves out others: both are
# matched by name, so extra catalog columns never disturb the comparison.
_COLUMNS_SQL = """
SELECT a.attnum, a.attname, a.atttypid, a.atttypmod, a.atthasmissing,
  CASE WHEN a.atthasmissing THEN a.attmissingval::text END, a.attgenerated <> ''
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


def _missing_default(catalog: TypeCatalog, type_oid: int, typmod: int, text: str) -> ColumnDefault | None:
    """The fast default of a column from ``attmissingval`` (a one-element array's text)."""
    element = _element_text(text)
    if element is None:
        return None
    try:
        codec = column_codec(type_oid, typmod, catalog)
        return avro_default(codec.avro_type, codec.from_text(element))
    except (KeyError, ValueError, TypeError, OverflowError, EOFError):
        return None


def _element_text(array_text: str) -> bytes | None:
    """The one element of a PostgreSQL array literal ``{x}`` / ``{"x y"}``, unescaped."""
    if not (array_text.startswith("{") and array_text.endswith("}")):
        return None
    inner = array_text[1:-1]
    if inner.startswith('"') and inner.endswith('"') and len(inner) >= 2:
        out = []
        escaped = False
        for ch in inner[1:-1]:
            if escaped:
                out.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            else:
                out.append(ch)
        return "".join(out).encode()
    if inner.startswith("{") or inner == "NULL":
        return None  # a multi-dimensional value: an array column (no Avro default)
    return inner.encode()


class SchemaChanges:
    """Recorded table states, the catalog and the heal requests: see the module docstring."""

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
        self._db = db
        self._publication = publication
        self._catalog = catalog
        self._signals = signals
        self._slot = slot
        self._resnapshot = resnapshot
        self._metrics = metrics
        self._states: dict[str, TableState] = {}
        self._check_interval_s = check_interval_s
        self._next_check = time.monotonic() + check_interval_s
        self._next_confirm = 0.0
        #: Tables the catalog check found different from their state, with
        #: the WAL position then: healed once the slot confirmed past it.
        self._suspects: dict[str, int] = {}
        self._relations: RelationCache | None = None
        if signals is not None:
            self._load()
            self._check_filters()

    # -- recorded states -------------------------------------------------------------

    def _state_id(self, table: str) -> str:
        return f"schema:{self._slot}:{table}"

    def _load(self) -> None:
        assert self._signals is not None
        prefix = f"schema:{self._slot}:"
        rows = self._signals.records(STATE_TYPE, prefix)
        for record_id, data in rows:
            try:
                self._states[record_id[len(prefix) :]] = TableState.from_json(data)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring unreadable schema state %s: %s", record_id, exc)

    def state(self, table: str) -> TableState | None:
        return self._states.get(table)

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
        if self._publication is None or self._db.server_version < 150000:
            return
        current = {
            format_table(str(s), str(t)): (str(f) if f is not None else None)
            for s, t, f in self._db.query(
                "SELECT schemaname, tablename, rowfilter FROM pg_publication_tables "
                "WHERE pubname = %s",
                (self._publication,),
            )
        }
        for table, state in list(self._states.items()):
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
            self._report(table, change)
            self._save(table, change, truncate_first=True)
            self._states[table] = change.state

    # -- the catalog ------------------------------------------------------------------

    def _catalog_table(
        self, schema: str, table: str, db: SourceDatabase | None = None
    ) -> CatalogTable | None:
        """The table as ``db`` (default: the metadata connection, so: now) sees the catalog."""
        db = db or self._db
        xmin = (
            "pg_snapshot_xmin(pg_current_snapshot())"
            if db.server_version >= 130000
            else "txid_snapshot_xmin(txid_current_snapshot())"
        )
        rows = db.query(_TABLE_SQL.format(xmin=xmin), (schema, table))
        if not rows:
            return None
        relid, kind, filenode, leaves, horizon = rows[0]
        storage = tuple(int(x) for x in leaves) if leaves is not None else (int(filenode),)
        columns = []
        for attnum, name, type_oid, typmod, has_missing, missing, generated in db.query(
            _COLUMNS_SQL, (relid,)
        ):
            default: ColumnDefault | None = None
            unexpressible = False
            if has_missing and missing is not None:
                default = _missing_default(self._catalog, int(type_oid), int(typmod), str(missing))
                unexpressible = default is None
            columns.append(
                CatalogColumn(
                    int(attnum), str(name), int(type_oid), int(typmod), default, unexpressible,
                    bool(generated),
                )
            )
        published: frozenset[str] | None = None
        row_filter: str | None = None
        known = False
        if self._publication is not None and db.server_version >= 150000:
            found = db.query(
                "SELECT attnames, rowfilter FROM pg_publication_tables "
                "WHERE pubname = %s AND schemaname = %s AND tablename = %s",
                (self._publication, schema, table),
            )
            if found:
                names, row_filter = found[0]
                known = True
                if names is not None:
                    published = frozenset(str(n) for n in names)
        return CatalogTable(
            int(relid), storage, tuple(columns), published,
            str(row_filter) if row_filter is not None else None, known,
            int(horizon), str(kind) == "r",
        )

    # -- the publisher's questions --------------------------------------------------

    def stream_version(self, version: TableVersion, commit_lsn: Lsn) -> tuple[TableVersion, bool]:
        """A table version met in the stream: the version to encode, and whether to truncate first."""
        name = format_table(version.schema, version.table)
        previous = self._states.get(name)
        lsn = int(commit_lsn)
        catalog = self._catalog_for(version, previous, lsn)
        kept = self._rows_kept(version.schema, version.table, previous, catalog)
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
            self._report(name, change)
        elif kept and change.details:
            self._report_kept(name)
        if change.save:
            self._save(name, change, truncate_first=filtered)
        if not change.replay:
            self._states[name] = change.state
            self._suspects.pop(name, None)  # the stream got there first
        return annotate(version, change.state), change.truncate

    def _catalog_for(self, version: TableVersion, previous: TableState | None, lsn: int) -> CatalogTable | None:
        """The catalog, unless a replay (older than the state) cannot need it.

        Read for a known shape too (once per version and session): a rewrite
        that keeps the shape shows only in the table's files.
        """
        if previous is not None and previous.relid == version.relation_id and lsn < previous.lsn:
            return None
        return self._catalog_table(version.schema, version.table)

    def _rows_kept(
        self, schema: str, table: str, previous: TableState | None, catalog: CatalogTable | None
    ) -> bool:
        """Whether the table's new files provably hold every row as it was (module docstring)."""
        if (
            previous is None
            or catalog is None
            or previous.horizon is None
            or previous.storage is None
            or not catalog.plain
            or catalog.relid != previous.relid
            or catalog.storage == previous.storage
        ):
            return False
        try:
            pages = int(self._db.scalar("SELECT pg_relation_size(%s) / 8192", (catalog.relid,)) or 0)
            rows = self._db.query(
                _KEPT_SQL.format(table=f"{quote_ident(schema)}.{quote_ident(table)}"),
                {
                    "percent": min(100.0, 100.0 * _PROOF_PAGES / max(1, pages)),
                    "h": previous.horizon & 0xFFFFFFFF,
                },
            )
        except DefiniteError as exc:
            # Not knowing is no proof: the table re-snapshots (exact beats cheap).
            log.warning("could not tell whether %s.%s kept its rows: %s", schema, table, exc)
            return False
        return bool(rows)

    def _report_kept(self, table: str) -> None:
        log.info(
            "the files of %s changed and it holds rows older than its recorded state "
            "(VACUUM FULL, CLUSTER or SET TABLESPACE): no re-snapshot",
            table,
            extra={"table": table},
        )

    def snapshot_version(self, version: TableVersion) -> TableVersion:
        """A version read from the catalog by a snapshot: the recorded annotations, by name."""
        state = self._states.get(format_table(version.schema, version.table))
        return annotate(version, state) if state is not None else version

    # -- baselines: the shape consumers were given, before the stream shows one ------

    def read_baseline(self, db: SourceDatabase, version: TableVersion, lsn: Lsn) -> TableState:
        """The state a snapshot gives consumers: ``version``, and the catalog as ``db`` sees it.

        For the initial snapshot ``db`` is inside the exported snapshot, so
        the files, attnums and fast defaults are those of the rows it reads.
        """
        return _baseline(version, self._catalog_table(version.schema, version.table, db), int(lsn))

    def record_baseline(self, table: str, baseline: object) -> None:
        """Record what :meth:`read_baseline` gave, unless the stream recorded a later state."""
        assert isinstance(baseline, TableState)
        previous = self._states.get(table)
        if previous is not None and baseline.lsn < previous.lsn:
            return
        state = baseline
        if previous is not None:
            # Older records of the topic still need the earlier names, defaults and types.
            state = replace(
                _carry(state, previous) if previous.relid == state.relid else state,
                retired=previous.retired,
                written=previous.written,
            )
        self._save(table, SchemaChange(state=state, save=True))
        self._states[table] = state
        self._suspects.pop(table, None)

    def baseline_missing(self, tables: Iterable[tuple[str, str]], lsn: Lsn) -> None:
        """At start: a state from the catalog for each captured table that has none.

        Stamped with the slot's confirmed position ``lsn``, where the stream
        resumes: a version the stream meets later that differs from it is a
        change (if a migration committed between ``lsn`` and now, the older
        version met first looks like one and heals; nothing is absorbed).
        """
        recorded = []
        for schema, table in tables:
            name = format_table(schema, table)
            if name in self._states:
                continue
            catalog = self._catalog_table(schema, table)
            version = self._catalog_version(schema, table) if catalog is not None else None
            if version is None:
                continue
            state = _baseline(version, catalog, int(lsn))
            self._save(name, SchemaChange(state=state, save=True))
            self._states[name] = state
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
        if self._signals is None:
            raise DefiniteError(
                f"the initial snapshot of {table} must be completed incrementally ({reason}), "
                "but there is no signal table",
                hint="create the signal table (docs/snapshots.md) and run 'cdcd snapshot --table "
                f"{table}'",
            )
        job = self._signals.request([table], slot=self._slot)
        log.warning(
            "initial snapshot of %s: %s; the table is snapshotted again incrementally once "
            "streaming starts (job %s)",
            table,
            reason,
            job,
            extra={"table": table, "job": job},
        )

    def _catalog_version(self, schema: str, table: str) -> TableVersion | None:
        """The version pgoutput would send for the table now (None: it is gone)."""
        if self._relations is None:
            db = self._db
            self._relations = RelationCache(
                self._catalog,
                key_lookup=db.primary_key,
                dimensions_lookup=lambda relid: column_dimensions(db.conn, relid),
                snapshot=True,
            )
        try:
            relation, _ = published_relation(self._db, schema, table, self._publication)
        except DefiniteError as exc:
            if self._db.table_exists(schema, table):
                raise
            log.debug("%s.%s is gone: %s", schema, table, exc)
            return None
        return self._relations.on_relation(relation)[0]

    # -- idle tables --------------------------------------------------------------------

    def catalog_check(self, include: Callable[[str, str], bool]) -> None:
        """Called from the main loop, often; cheap unless a check or a heal is due.

        Every ``check_interval_s`` each captured table's state is compared
        with the catalog; a table that differs is healed once the slot's
        confirmed position has passed the WAL position of the check and it
        still differs (the module docstring says why that is correct).
        """
        if self._check_interval_s <= 0:
            return
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self._check_interval_s
            self._find_suspects(include)
        if self._suspects and now >= self._next_confirm:
            self._next_confirm = now + min(self._check_interval_s, _CONFIRM_INTERVAL_S)
            self._heal_suspects()

    def _differs(
        self, schema: str, table: str, state: TableState
    ) -> tuple[TableVersion, CatalogTable] | None:
        """The table's version and catalog now, if they differ from ``state``; else None."""
        catalog = self._catalog_table(schema, table)
        if catalog is None:
            return None  # dropped: nothing to heal (a table created again is compared then)
        version = self._catalog_version(schema, table)
        if version is None:
            return None
        if state.relid != catalog.relid or state.shape() != _version_shape(version):
            return version, catalog
        if state.storage is not None and state.storage != catalog.storage:
            return version, catalog
        return None

    def _find_suspects(self, include: Callable[[str, str], bool]) -> None:
        names = {
            name: split_table(name)
            for name in self._states
            if name not in self._suspects and include(*split_table(name))
        }
        if not names:
            return
        signatures = {
            format_table(str(row[0]), str(row[1])): row[2:]
            for row in self._db.query(
                _SIGNATURES_SQL,
                ([s for s, _ in names.values()], [t for _, t in names.values()]),
            )
        }
        wal: int | None = None
        for name, (schema, table) in sorted(names.items()):
            state = self._states[name]
            if name not in signatures or _signature(state) == _catalog_signature(signatures[name]):
                continue  # gone, or nothing that makes a difference changed
            if self._differs(schema, table, state) is None:
                continue
            if wal is None:
                wal = int(self._db.current_wal_lsn())
            self._suspects[name] = wal
            self._next_confirm = 0.0

    def _heal_suspects(self) -> None:
        confirmed = self._db.scalar(
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
            state = self._states.get(name)
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
        lsn = max(int(self._db.current_wal_lsn()), state.lsn)
        kept = self._rows_kept(schema, table, state, catalog)
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
            self._report(name, change)
        elif kept:
            self._report_kept(name)
        self._save(name, change, truncate_first=RECREATE in change.kinds)
        self._states[name] = change.state

    # -- effects ----------------------------------------------------------------------

    def _report(self, table: str, change: SchemaChange) -> None:
        if change.truncate:
            action = "truncate emitted before the new table's first change"
        elif (
            (ROW_FILTER in change.kinds or RECREATE in change.kinds)
            and change.heal
            and self._resnapshot
            and self._signals is not None
        ):
            action = "truncate and re-snapshot started"
        elif change.heal and self._resnapshot and self._signals is not None:
            action = "re-snapshot started"
        elif change.heal:
            action = "re-snapshot skipped"
        elif any(c.default is not None for c in change.state.columns) and ADD_DEFAULT in change.kinds:
            action = "default carried in the schema"
        elif RENAME in change.kinds:
            action = "earlier name kept as an Avro alias"
        else:
            action = "new schema"
        kinds = ",".join(change.kinds)
        log.info(
            "schema change on %s: %s (%s); %s",
            table,
            kinds,
            "; ".join(change.details) or "-",
            action,
            extra={"table": table, "kind": kinds, "action": action},
        )
        if change.heal and not self._resnapshot:
            log.warning(
                "schema change on %s: %s rewrote rows the WAL does not carry; not re-snapshotting "
                "because schema_changes.resnapshot is never: consumers keep old values until "
                "each row changes ('cdcd snapshot --table %s' heals it)",
                table,
                kinds,
                table,
            )
        elif change.heal and self._signals is None:
            log.error(
                "schema change on %s: %s needs a re-snapshot, but there is no usable signal table: "
                "consumers keep old values until each row changes; create the table "
                "(docs/snapshots.md) and run 'cdcd snapshot --table %s'",
                table,
                kinds,
                table,
            )
        if self._metrics is not None:
            for kind in change.kinds:
                self._metrics.schema_change(table, kind)

    def _save(self, table: str, change: SchemaChange, truncate_first: bool = False) -> None:
        if self._signals is None:
            return
        heal = None
        if change.heal and self._resnapshot:
            data: dict[str, Any] = {
                "data-collections": [table],
                "type": "incremental",
                "reason": f"schema change: {','.join(change.kinds)}",
            }
            heal_id = f"{HEAL_ID_PREFIX}{self._slot}:{table}:{change.state.lsn}"
            if truncate_first:
                data[TRUNCATE_FIRST] = [table]
            if ROW_FILTER in change.kinds:
                # Found at start, not at a stream position: several may share one lsn.
                heal_id += f":filter:{time.time_ns()}"
            heal = (heal_id, data)
        try:
            self._signals.record(self._state_id(table), STATE_TYPE, change.state.to_json(), heal)
        except SignalTableGone as exc:
            # Dropped while cdcd runs: the recorded states went with it.
            # Create it again when healing is on (the snapshot driver finds
            # it again by itself), else go on in memory.
            if self._resnapshot:
                try:
                    self._signals.ensure()
                    self._signals.record(self._state_id(table), STATE_TYPE, change.state.to_json(), heal)
                    log.warning("%s; created it again, schema states are recorded from now on", exc)
                    return
                except (SignalTableGone, SignalTableUnavailable) as again:
                    exc = again  # type: ignore[assignment]
            log.warning("schema changes are tracked in memory only from now on: %s", exc)
            self._signals = None

