"""What schema-change tracking compares: the recorded state of a table and the catalog's facts.

A table's *state* (:class:`TableState`) is what cdcd last published of it:
its OID, replica identity and key, each column with its ``attnum`` and what
sticks to it (a fast default, earlier names), its storage files and the
xmin horizon they were read at, the publication's row filter, and every
Avro type written under each field name. It is stored as JSON in a row of
the signal table (``STATE_TYPE``); ``cdcd.pipeline.schema_changes.record``
reads and writes those rows. :class:`CatalogTable` is what
``pg_class``/``pg_attribute`` say of the table now, as
``cdcd.pipeline.schema_changes.catalog`` reads it. Both are plain data: the
classification (``cdcd.pipeline.schema_changes.classify``) compares them.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cdcd.decode.relations import ColumnDefault, TableVersion
from cdcd.envelope.schemas import Written

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
    #: that commits later has an xid at or after it (see CatalogReader.rows_kept).
    horizon: int | None = None
    #: Every Avro type written under each field name (issue 30: a field's
    #: union keeps them all, see cdcd.envelope.schemas).
    written: Written = ()
    #: attnums of the table's columns dropped before this state (never in a
    #: later version; see classify._renamed_since).
    gone: tuple[int, ...] = ()
    #: WAL position read after the catalog facts of a baseline: a version
    #: committed at or after it is no older than they are. None: ``lsn`` (a
    #: state made from a version met in the stream, or at a snapshot's
    #: consistent point).
    read_lsn: int | None = None

    def facts_lsn(self) -> int:
        """From which commit LSN on a version met in the stream is no older than this state."""
        return max(self.lsn, self.read_lsn or 0)

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
            **({"gone": list(self.gone)} if self.gone else {}),
            **({"read_lsn": self.read_lsn} if self.read_lsn is not None else {}),
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
            gone=tuple(int(a) for a in data.get("gone", ())),
            read_lsn=int(data["read_lsn"]) if data.get("read_lsn") is not None else None,
        )

    def shape(self) -> tuple[object, ...]:
        return (
            self.relid,
            self.replica_identity,
            self.key,
            tuple((c.name, c.type_oid, c.type_modifier) for c in self.columns),
        )


def version_shape(version: TableVersion) -> tuple[object, ...]:
    """What :meth:`TableState.shape` compares, of a version met in the stream."""
    return (
        version.relation_id,
        version.replica_identity,
        key_names(version),
        tuple((c.name, c.type_oid, c.type_modifier) for c in version.columns),
    )


def key_names(version: TableVersion) -> tuple[str, ...]:
    """The names of the version's replica identity columns, in key order."""
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
    #: attnums of the table's dropped columns (PostgreSQL never reuses one);
    #: None: not read.
    dropped: tuple[int, ...] | None = None

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
