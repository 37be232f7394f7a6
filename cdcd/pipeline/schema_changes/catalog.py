"""What the catalog says of a captured table now, and whether a rewrite kept its rows.

Read on the metadata connection, on the main loop: once per table version
and session (:meth:`CatalogReader.table`, :meth:`CatalogReader.version`) and
by the catalog check (``cdcd.pipeline.schema_changes.idle``), a few small
queries per captured table and interval. A column's fast default comes from
``attmissingval``, turned into the Avro default of its field
(:func:`avro_default`).

**Same-shape rewrites.** A rewrite that keeps columns and types sends the
same ``Relation`` again (or none). Only the table's files tell, so the
catalog is read at every version's first use, known shapes included, and by
the catalog check. New files with nothing else changed come from
``ALTER TABLE`` rewrites (new values possible), ``TRUNCATE`` (the stream
carries it and every row written since), ``VACUUM FULL``, ``CLUSTER`` and
``SET TABLESPACE`` (rows kept). They are told apart by the rows' ``xmin``
(:meth:`CatalogReader.rows_kept`): the state records, with the files, the
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
"""

from __future__ import annotations

import io
import logging
import math
from typing import Any

import fastavro

from cdcd.decode.relations import ColumnDefault, RelationCache, TableVersion
from cdcd.decode.types import TypeCatalog
from cdcd.decode.values import column_codec
from cdcd.errors import DefiniteError
from cdcd.naming import format_table
from cdcd.pipeline.schema_changes.state import CatalogColumn, CatalogTable, TableState
from cdcd.protocol.lsn import Lsn
from cdcd.snapshot.rows import published_relation
from cdcd.source.catalog import column_dimensions
from cdcd.source.connection import quote_ident
from cdcd.source.database import SourceDatabase

log = logging.getLogger("cdcd.schema")

# The snapshot's xmin, read in the same statement as the files: see CatalogReader.rows_kept.
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

# Generated columns are not in pgoutput's Relation message (before PG18's
# publish_generated_columns); a column list leaves out others: both are
# matched by name, so extra catalog columns never disturb the comparison.
# Dropped columns keep their attnum: they tell which columns came and went
# since a state (see classify._placed_behind).
_COLUMNS_SQL = """
SELECT a.attnum, a.attname, a.atttypid, a.atttypmod, a.atthasmissing,
  CASE WHEN a.atthasmissing AND NOT a.attisdropped THEN a.attmissingval::text END,
  a.attgenerated <> '', a.attisdropped
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0
ORDER BY a.attnum
"""


def _strip_logical(schema: Any) -> Any:
    """The Avro type without its logical types: the type a default is written in."""
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


class CatalogReader:
    """The catalog as the metadata connection sees it, for the tables of one publication."""

    def __init__(self, db: SourceDatabase, catalog: TypeCatalog, publication: str | None) -> None:
        self.db = db
        self._catalog = catalog
        self._publication = publication
        self._relations: RelationCache | None = None

    def table(self, schema: str, table: str, db: SourceDatabase | None = None) -> CatalogTable | None:
        """The table as ``db`` (default: the metadata connection, so: now) sees the catalog."""
        db = db or self.db
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
        dropped = []
        for attnum, name, type_oid, typmod, has_missing, missing, generated, gone in db.query(
            _COLUMNS_SQL, (relid,)
        ):
            if gone:
                dropped.append(int(attnum))
                continue
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
            int(horizon), str(kind) == "r", tuple(dropped),
        )

    def wal_position(self, db: SourceDatabase | None = None) -> int:
        """The server's WAL position now (a standby's: replayed so far)."""
        value = (db or self.db).scalar(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() "
            "ELSE pg_current_wal_lsn() END)::text"
        )
        return int(Lsn.parse(str(value)))

    def version(self, schema: str, table: str) -> TableVersion | None:
        """The version pgoutput would send for the table now (None: it is gone)."""
        if self._relations is None:
            db = self.db
            self._relations = RelationCache(
                self._catalog,
                key_lookup=db.primary_key,
                dimensions_lookup=lambda relid: column_dimensions(db.conn, relid),
                snapshot=True,
            )
        try:
            relation, _ = published_relation(self.db, schema, table, self._publication)
        except DefiniteError as exc:
            if self.db.table_exists(schema, table):
                raise
            log.debug("%s.%s is gone: %s", schema, table, exc)
            return None
        return self._relations.on_relation(relation)[0]

    def row_filters(self) -> dict[str, str | None]:
        """Each table of the publication with its row filter now (PostgreSQL 15+; else none)."""
        if self._publication is None or self.db.server_version < 150000:
            return {}
        return {
            format_table(str(s), str(t)): (str(f) if f is not None else None)
            for s, t, f in self.db.query(
                "SELECT schemaname, tablename, rowfilter FROM pg_publication_tables "
                "WHERE pubname = %s",
                (self._publication,),
            )
        }

    def rows_kept(
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
            pages = int(self.db.scalar("SELECT pg_relation_size(%s) / 8192", (catalog.relid,)) or 0)
            rows = self.db.query(
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
