"""Type and column facts read from the source database's catalog.

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

Use an ordinary (non-replication) connection, preferably in autocommit mode:
these functions never commit or roll back, so with autocommit off the queries
run inside the caller's transaction and the caller ends it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cdcd.decode.types import BUILTIN_TYPES, PgType

__all__ = ["PgCatalog", "column_dimensions"]

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
