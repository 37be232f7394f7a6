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
catalog moved on already   re-snapshot the table (worst case: heal)
table gone since           nothing (a table created again truncates first)
========================  =====================================================

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
main loop, once per new table version — a handful of times per migration.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import fastavro

from cdcd.decode.relations import ColumnDefault, TableVersion
from cdcd.decode.types import TypeCatalog
from cdcd.decode.values import column_codec
from cdcd.naming import format_table
from cdcd.observability.metrics import Metrics
from cdcd.protocol.lsn import Lsn
from cdcd.snapshot.store import (
    TRUNCATE_FIRST,
    SignalTable,
    SignalTableGone,
    SignalTableUnavailable,
)
from cdcd.source.database import SourceDatabase

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
RECREATE = "recreate"
IDENTITY = "identity"
PUBLISH = "column_published"  # an existing column joined the publication's column list
UNPUBLISH = "column_unpublished"  # a column left it (still in the table)
ROW_FILTER = "row_filter"  # the publication's row filter of the table changed
UNKNOWN = "unknown"
KINDS = (
    ADD_DEFAULT, ADD_NULL, ADD_REWRITE, DROP, RENAME, TYPE, TYPE_REWRITE, RECREATE, IDENTITY,
    PUBLISH, UNPUBLISH, ROW_FILTER, UNKNOWN,
)

STATE_TYPE = "schema-state"  # signal-table rows that hold a table's state (never a job)
HEAL_ID_PREFIX = "schema-change:"


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

    def to_json(self) -> dict[str, Any]:
        return {
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
        replica_identity=version.replica_identity,
        key=_key_names(version),
        columns=tuple(columns),
        recreated_lsn=recreated_lsn,
        unpublished=catalog.unpublished(version) if catalog is not None and matched else (),
        row_filter=catalog.row_filter if catalog is not None else None,
        filter_known=catalog is not None and catalog.filter_known,
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
    previous: TableState | None, version: TableVersion, catalog: CatalogTable | None, lsn: int
) -> SchemaChange:
    """Compare a table version met in the stream at commit ``lsn`` with the recorded state.

    ``catalog`` is what pg_class/pg_attribute say *now* (None: the table is
    gone), which may be ahead of the stream; where it no longer describes
    ``version``, nothing can be ruled out and the change heals.
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
        return SchemaChange(state=previous, truncate=truncate)
    return _compare(previous, version, catalog, lsn)


def _compare(
    previous: TableState, version: TableVersion, catalog: CatalogTable | None, lsn: int
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
        state = _baseline(version, catalog, lsn)
        carried = {c.name: c for c in previous.columns}
        state = replace(
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
        details.append("the catalog no longer describes this version")
        return SchemaChange(
            state=state, kinds=(*kinds, UNKNOWN), heal=True, details=tuple(details), save=True
        )
    assert catalog is not None
    rewritten = previous.storage is None or previous.storage != catalog.storage
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
        # cdcd cannot rule out (or a TRUNCATE/VACUUM FULL, which heals harmlessly).
        heal = True
        details.append("the table was rewritten")
    state = TableState(
        relid=version.relation_id,
        lsn=lsn,
        storage=catalog.storage,
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


def annotate(version: TableVersion, state: TableState) -> TableVersion:
    """The version with the state's defaults and earlier names, by column name."""
    known = {c.name: c for c in state.columns}
    defaults: list[ColumnDefault | None] = []
    aliases: list[tuple[str, ...]] = []
    optional: list[bool] = []
    for i, column in enumerate(version.columns):
        same = known.get(column.name)
        fits = same is not None and (same.type_oid, same.type_modifier) == (
            column.type_oid,
            column.type_modifier,
        )
        defaults.append(same.default if fits and same is not None else None)
        aliases.append(same.aliases if same is not None else ())
        optional.append(same is not None and same.nullable and i in version.key_indexes)
    if not any(defaults) and not any(aliases) and not any(optional):
        return version
    return replace(
        version, defaults=tuple(defaults), aliases=tuple(aliases), optional=tuple(optional)
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

_TABLE_SQL = """
SELECT c.oid, c.relkind, c.relfilenode,
  CASE WHEN c.relkind = 'p' THEN ARRAY(
    SELECT p.relfilenode FROM pg_partition_tree(c.oid) t JOIN pg_class p ON p.oid = t.relid
    WHERE t.isleaf ORDER BY p.relfilenode) END
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""

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
    ) -> None:
        self._db = db
        self._publication = publication
        self._catalog = catalog
        self._signals = signals
        self._slot = slot
        self._resnapshot = resnapshot
        self._metrics = metrics
        self._states: dict[str, TableState] = {}
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

    def _catalog_table(self, schema: str, table: str) -> CatalogTable | None:
        rows = self._db.query(_TABLE_SQL, (schema, table))
        if not rows:
            return None
        relid, _kind, filenode, leaves = rows[0]
        storage = tuple(int(x) for x in leaves) if leaves is not None else (int(filenode),)
        columns = []
        for attnum, name, type_oid, typmod, has_missing, missing, generated in self._db.query(
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
        if self._publication is not None and self._db.server_version >= 150000:
            found = self._db.query(
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
        )

    # -- the publisher's questions --------------------------------------------------

    def stream_version(self, version: TableVersion, commit_lsn: Lsn) -> tuple[TableVersion, bool]:
        """A table version met in the stream: the version to encode, and whether to truncate first."""
        name = format_table(version.schema, version.table)
        previous = self._states.get(name)
        lsn = int(commit_lsn)
        change = classify(previous, version, self._catalog_for(version, previous, lsn), lsn)
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
        if change.save:
            self._save(name, change, truncate_first=filtered)
        if not change.replay:
            self._states[name] = change.state
        return annotate(version, change.state), change.truncate

    def _catalog_for(self, version: TableVersion, previous: TableState | None, lsn: int) -> CatalogTable | None:
        """The catalog, read only when the answer may need it (not for a known shape)."""
        if previous is not None and previous.relid == version.relation_id:
            if lsn < previous.lsn or previous.shape() == _version_shape(version):
                return None
        return self._catalog_table(version.schema, version.table)

    def snapshot_version(self, version: TableVersion) -> TableVersion:
        """A version read from the catalog by a snapshot: the recorded annotations, by name."""
        state = self._states.get(format_table(version.schema, version.table))
        return annotate(version, state) if state is not None else version

    # -- effects ----------------------------------------------------------------------

    def _report(self, table: str, change: SchemaChange) -> None:
        if change.truncate:
            action = "truncate emitted before the new table's first change"
        elif ROW_FILTER in change.kinds and self._resnapshot and self._signals is not None:
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

