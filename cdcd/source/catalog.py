"""What the source database's catalog says about tables and types.

One concern: reading ``pg_type``, ``pg_class``, ``pg_index`` and
``pg_attribute`` -- never changing anything. :class:`TableCatalog` answers
for tables (existence, primary key, replica identity, the Relation message
pgoutput would send); :class:`PgCatalog` and :func:`column_dimensions`
answer for column types, over a raw connection the decoder can share.
Publication planning (:mod:`cdcd.source.publication_planner`) builds on the
replica identities read here.

pgoutput names every column's type by OID only. Built-in types (OID below
16384) are fixed and come from :data:`cdcd.decode.types.BUILTIN_TYPES`
without a query; everything else -- extension types such as citext, enums,
domains, composites, user ranges and their arrays -- is read from ``pg_type``
once and cached for the life of the catalog object. An ``ALTER TYPE`` that
changes such a type (adding an enum label does not matter: enums map to
strings) sends a new Relation message; call :meth:`PgCatalog.forget` if a
type is dropped and re-created under a new definition with the same OID
(PostgreSQL never reuses an OID while the old type exists).

pgoutput does not send array dimensions either: ``int[][]`` and ``int[]``
are the same type. :func:`column_dimensions` reads the declared
``pg_attribute.attndims`` so that ``int[][]`` columns become nested Avro
arrays. PostgreSQL does not enforce attndims, and columns made by
``CREATE TABLE AS`` or over a domain report 0, which means one dimension.

Give :class:`PgCatalog` and :func:`column_dimensions` an ordinary
(non-replication) connection, preferably in autocommit mode: they never commit
or roll back, so with autocommit off the queries run inside the caller's
transaction and the caller ends it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from cdcd.decode.relations import RelationCache
from cdcd.decode.types import BUILTIN_TYPES, PgType
from cdcd.errors import DefiniteError
from cdcd.protocol.messages import Column, Relation
from cdcd.source.connection import MetadataConnection

__all__ = [
    "PgCatalog",
    "RelIdentity",
    "TableCatalog",
    "column_dimensions",
    "relation_from_catalog",
]

_TYPE_QUERY = """
SELECT t.oid, n.nspname, t.typname, t.typtype, t.typcategory, t.typelem,
       t.typbasetype, t.typtypmod, t.typdelim
FROM pg_catalog.pg_type t
JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
WHERE t.oid = ANY(%s::oid[])
"""

_DIMENSIONS_QUERY = """
SELECT attname, attndims
FROM pg_catalog.pg_attribute
WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
"""


def _row_to_type(row: tuple[Any, ...]) -> PgType:
    oid, namespace, name, kind, category, element, base, base_modifier, delimiter = row
    return PgType(
        oid=int(oid),
        namespace=str(namespace),
        name=str(name),
        kind=str(kind),
        category=str(category),
        element_oid=int(element),
        base_oid=int(base),
        base_modifier=int(base_modifier),
        delimiter=str(delimiter),
    )


class PgCatalog:
    """A :class:`~cdcd.decode.types.TypeCatalog` backed by a psycopg2 connection."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._cache: dict[int, PgType] = {}

    def lookup(self, oid: int) -> PgType:
        """The facts for ``oid``; built-ins without a query. KeyError if no such type."""
        builtin = BUILTIN_TYPES.get(oid)
        if builtin is not None:
            return builtin
        cached = self._cache.get(oid)
        if cached is not None:
            return cached
        self.preload((oid,))
        try:
            return self._cache[oid]
        except KeyError:
            raise KeyError(f"type oid {oid} does not exist in pg_type") from None

    def preload(self, oids: Iterable[int]) -> None:
        """Fetch several non-builtin types in one query (e.g. all columns of a relation)."""
        wanted = sorted({o for o in oids if o not in BUILTIN_TYPES and o not in self._cache})
        if not wanted:
            return
        with self._conn.cursor() as cur:
            cur.execute(_TYPE_QUERY, (wanted,))
            rows = cur.fetchall()
        for row in rows:
            pg_type = _row_to_type(tuple(row))
            self._cache[pg_type.oid] = pg_type

    def forget(self, oid: int) -> None:
        """Drop a cached non-builtin type so that the next lookup reads it again."""
        self._cache.pop(oid, None)


def column_dimensions(conn: Any, relation_id: int) -> dict[str, int]:
    """Declared array dimensions (``attndims``) by column name; 0 for non-array columns."""
    with conn.cursor() as cur:
        cur.execute(_DIMENSIONS_QUERY, (relation_id,))
        rows = cur.fetchall()
    return {str(name): int(ndims) for name, ndims in rows}


@dataclass(frozen=True, slots=True)
class RelIdentity:
    """How PostgreSQL finds the old row of one table for UPDATE and DELETE."""

    schema: str
    table: str
    sql_name: str  # quoted for SQL
    oid: int
    kind: str  # pg_class.relkind: r, or p (partitioned)
    identity: str  # pg_class.relreplident: d, n, f, i
    index: str | None  # the usable identity index (primary key or USING INDEX)
    columns: tuple[str, ...]  # its columns
    has_primary_key: bool  # any primary key, usable or not
    owner: str
    partitions: tuple[RelIdentity, ...] = ()  # leaf partitions of a partitioned table

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    def gap(self) -> str | None:
        """Why UPDATE/DELETE would fail in a publication publishing them; None: they will not.

        PostgreSQL checks the leaf partition a row is in, never a partitioned
        table itself; a deferrable, invalid or partial index is no identity.
        """
        if self.kind == "p":
            gaps = [(p, p.gap()) for p in self.partitions]
            found = [f"partition {p.name}: {gap}" for p, gap in gaps if gap]
            return ", ".join(found) or None
        if self.identity == "f":
            return None
        if self.identity == "n":
            return "replica identity NOTHING"
        if self.index is not None:
            return None
        if self.identity == "i":
            return "its replica identity index is gone"
        if self.has_primary_key:
            return "its primary key is deferrable or not valid, so it is no replica identity"
        return "no primary key"

    def describe(self) -> str:
        """The identity of a table that has one, as ``cdcd check`` prints it."""
        if self.kind == "p":
            count = len(self.partitions)
            return f"partitioned, each of its {count} partitions has a replica identity"
        if self.identity == "f":
            return "replica identity FULL"
        if self.identity == "i":
            return f"replica identity USING INDEX {self.index} ({', '.join(self.columns)})"
        return f"primary key ({', '.join(self.columns)})"

    def lacking(self) -> tuple[RelIdentity, ...]:
        """The relations that need REPLICA IDENTITY FULL for UPDATE/DELETE to work."""
        if self.kind == "p":
            return tuple(p for p in self.partitions if p.gap())
        return (self,) if self.gap() else ()


# The replica identity of ``c`` (pg_class) in ``n`` (pg_namespace), as _rel_identity reads it.
_IDENTITY_COLUMNS = (
    "n.nspname, c.relname, quote_ident(n.nspname) || '.' || quote_ident(c.relname), c.oid, "
    "c.relkind, c.relreplident, x.indexname, x.columns, "
    "EXISTS (SELECT 1 FROM pg_index p WHERE p.indrelid = c.oid AND p.indisprimary), "
    "pg_get_userbyid(c.relowner)"
)
# The index PostgreSQL uses as the identity (relcache's rd_replidindex): the
# primary key, or the USING INDEX one, if live, valid, unique, immediate and
# not partial; otherwise UPDATE/DELETE have no identity.
_IDENTITY_INDEX = (
    "LEFT JOIN LATERAL (SELECT ic.relname AS indexname, "
    "(SELECT array_agg(a.attname::text ORDER BY k.n) FROM unnest(i.indkey) WITH ORDINALITY "
    "AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum) "
    "AS columns FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
    "WHERE i.indrelid = c.oid AND i.indislive AND i.indisvalid AND i.indisunique "
    "AND i.indimmediate AND i.indpred IS NULL "
    "AND CASE c.relreplident WHEN 'i' THEN i.indisreplident ELSE i.indisprimary END "
    "LIMIT 1) AS x ON true"
)


def _rel_identity(row: tuple[Any, ...]) -> RelIdentity:
    # psycopg2 already gives names as str and OIDs as int; the index columns come as a list.
    schema, table, sql_name, oid, kind, identity, index, columns, has_pk, owner = row
    return RelIdentity(
        schema, table, sql_name, oid, kind, identity, index, tuple(columns or ()), has_pk, owner
    )


class TableCatalog(MetadataConnection):
    """The metadata connection's questions about tables: keys and replica identities."""

    def table_exists(self, schema: str, table: str) -> bool:
        return bool(
            self.query(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
                (schema, table),
            )
        )

    def identities(self, tables: list[tuple[str, str]]) -> dict[tuple[str, str], RelIdentity]:
        """The replica identity of each existing table (with its partitions); absent ones omitted."""
        if not tables:
            return {}
        rows = self.query(
            f"SELECT {_IDENTITY_COLUMNS} FROM unnest(%s::text[], %s::text[]) AS w(nsp, rel) "
            "JOIN pg_namespace n ON n.nspname = w.nsp "
            "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.rel "
            f"AND c.relkind IN ('r', 'p') {_IDENTITY_INDEX}",
            ([s for s, _ in tables], [t for _, t in tables]),
        )
        out = {}
        for row in rows:
            relation = _rel_identity(row)
            if relation.kind == "p":
                leaves = self.query(
                    f"SELECT {_IDENTITY_COLUMNS} FROM pg_partition_tree(%s::oid) AS w "
                    "JOIN pg_class c ON c.oid = w.relid AND w.isleaf AND c.relkind = 'r' "
                    f"JOIN pg_namespace n ON n.oid = c.relnamespace {_IDENTITY_INDEX} "
                    "ORDER BY 1, 2",
                    (relation.oid,),
                )
                relation = replace(relation, partitions=tuple(_rel_identity(r) for r in leaves))
            out[(relation.schema, relation.table)] = relation
        return out

    def tables_without_identity(self) -> list[RelIdentity]:
        """Every table a FOR ALL TABLES publication would publish that has no replica identity."""
        rows = self.query(
            f"SELECT {_IDENTITY_COLUMNS} FROM pg_class c "
            f"JOIN pg_namespace n ON n.oid = c.relnamespace {_IDENTITY_INDEX} "
            # What PostgreSQL publishes: permanent user tables, never catalogs.
            "WHERE c.relkind = 'r' AND c.relpersistence = 'p' AND c.oid >= 16384 "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
            "AND n.nspname !~ '^pg_toast' ORDER BY 1, 2"
        )
        return [r for r in map(_rel_identity, rows) if r.gap()]

    def primary_key(self, schema: str, table: str) -> tuple[str, ...] | None:
        rows = self.query(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        )
        if not rows:
            return None
        return self._primary_key(int(rows[0][0])) or None

    def relation_cache(self, catalog: PgCatalog, *, snapshot: bool = False) -> RelationCache:
        """A relation cache that asks this database for keys and array dimensions.

        ``snapshot``: a cache of tables described from the catalog, never
        from the stream (see :class:`~cdcd.decode.relations.RelationCache`).
        """
        return RelationCache(
            catalog,
            key_lookup=self.primary_key,
            dimensions_lookup=lambda relid: column_dimensions(self.conn, relid),
            snapshot=snapshot,
        )

    def _primary_key(self, oid: int) -> tuple[str, ...]:
        rows = self.query(
            "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey) WITH ORDINALITY "
            "AS k(attnum, n) ON true JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = k.attnum WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.n",
            (oid,),
        )
        return tuple(str(r[0]) for r in rows)


def relation_from_catalog(db: MetadataConnection, schema: str, table: str) -> Relation:
    """The Relation message pgoutput would send for ``schema.table``, built from the catalog.

    Key flags follow pgoutput: the replica identity index columns, or every
    column with REPLICA IDENTITY FULL.
    """
    rows = db.query(
        "SELECT c.oid, c.relreplident FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (schema, table),
    )
    if not rows:
        raise DefiniteError(f"table {schema}.{table} does not exist", hint="fix postgres.tables")
    oid, identity = int(rows[0][0]), str(rows[0][1])
    if identity == "i":
        key_sql = "i.indisreplident"
    else:
        key_sql = "i.indisprimary"
    keyed = {
        str(r[0])
        for r in db.query(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            f"AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND {key_sql}",
            (oid,),
        )
    }
    columns = db.query(
        "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s "
        "AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum",
        (oid,),
    )
    return Relation(
        xid=None,
        relation_id=oid,
        namespace=schema,
        name=table,
        replica_identity=identity,
        columns=tuple(
            Column(
                1 if identity == "f" or (identity in "di" and str(name) in keyed) else 0,
                str(name),
                int(type_oid),
                int(typmod),
            )
            for name, type_oid, typmod in columns
        ),
    )
