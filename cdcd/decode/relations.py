"""Relation cache: pgoutput Relation and Type messages to versioned table descriptions.

PostgreSQL sends a Relation message before the first change of a table in a
session and again whenever the table's definition changed (ALTER TABLE,
REPLICA IDENTITY) or the walsender's relcache entry was invalidated — so the
same definition can arrive many times. A *new version* is made only when
something that shapes the envelope changed: column names, types, type
modifiers, key flags or the replica identity setting. Each version carries
the column codecs prepared once, so the hot path never looks anything up.

The Kafka key (SPEC §4) is the replica identity columns: the primary key, or
the ``REPLICA IDENTITY USING INDEX`` index. With ``REPLICA IDENTITY FULL``
PostgreSQL flags *every* column as part of the identity, and with ``NOTHING``
none, so for those two the key is the primary key looked up in the catalog
(``key_lookup``), or no key when the table has none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cdcd.decode.types import TypeCatalog
from cdcd.decode.values import ColumnCodec, column_codec
from cdcd.errors import DefiniteError
from cdcd.protocol.messages import (
    IDENTITY_FULL,
    IDENTITY_NOTHING,
    Column,
    Relation,
    Type,
)

#: Returns the primary key column names of (schema, table), or None without one.
KeyLookup = Callable[[str, str], tuple[str, ...] | None]
#: Returns declared array dimensions (pg_attribute.attndims) by column name.
DimensionsLookup = Callable[[int], dict[str, int]]


@dataclass(frozen=True, slots=True)
class ColumnDefault:
    """The value a row written before the column existed has (a fast default).

    ``value`` is Avro's JSON encoding of it for the column's Avro type, as a
    schema's field ``default`` holds it.
    """

    value: Any


@dataclass(frozen=True, slots=True)
class TableVersion:
    """One version of a captured table's shape, with everything the hot path needs."""

    relation_id: int
    schema: str
    table: str
    version: int
    replica_identity: str
    columns: tuple[Column, ...]
    codecs: tuple[ColumnCodec, ...]
    key_indexes: tuple[int, ...]  # positions of the Kafka key columns, empty: null key
    #: What schema-change tracking learnt (``cdcd.pipeline.schema_changes``),
    #: per column; empty tuples: nothing. The Relation message alone never
    #: says this: a default and a column's earlier names come from the catalog.
    defaults: tuple[ColumnDefault | None, ...] = ()
    aliases: tuple[tuple[str, ...], ...] = ()
    #: Key columns that stay nullable in the row record because an earlier
    #: schema had them nullable, or had them of another type (so older
    #: records still resolve).
    optional: tuple[bool, ...] = ()
    #: Per column, the Avro types earlier schemas of the topic wrote under
    #: its name or its aliases, other than its own (JSON; empty: none): the
    #: row record's field is the union of them all (``cdcd.envelope.schemas``).
    history: tuple[tuple[Any, ...], ...] = ()
    #: Made by a snapshot from the catalog, not by the stream: version numbers
    #: of the two caches are independent, so caches keyed by version tell them apart.
    snapshot: bool = False

    @property
    def cache_key(self) -> tuple[int, int, bool]:
        """Identifies the version among both caches' (stream and snapshot)."""
        return (self.relation_id, self.version, self.snapshot)

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(column.name for column in self.columns)

    def default_of(self, index: int) -> ColumnDefault | None:
        return self.defaults[index] if self.defaults else None

    def aliases_of(self, index: int) -> tuple[str, ...]:
        return self.aliases[index] if self.aliases else ()

    def history_of(self, index: int) -> tuple[Any, ...]:
        return self.history[index] if self.history else ()

    def nullable(self, index: int) -> bool:
        """Whether column ``index`` is a union with null in the row record (a key
        column with a type history is one: it is a union anyway)."""
        return (
            index not in self.key_indexes
            or (bool(self.optional) and self.optional[index])
            or bool(self.history and self.history[index])
        )


def _shape(message: Relation) -> tuple[object, ...]:
    return (
        message.namespace,
        message.name,
        message.replica_identity,
        tuple((c.flags, c.name, c.type_oid, c.type_modifier) for c in message.columns),
    )


class RelationCache:
    """Relation id to the current ``TableVersion``; versions only grow."""

    def __init__(
        self,
        catalog: TypeCatalog,
        key_lookup: KeyLookup | None = None,
        dimensions_lookup: DimensionsLookup | None = None,
        *,
        snapshot: bool = False,
    ) -> None:
        self._catalog = catalog
        self._snapshot = snapshot
        self._key_lookup = key_lookup
        self._dimensions_lookup = dimensions_lookup
        self._current: dict[int, TableVersion] = {}
        self._shapes: dict[int, tuple[object, ...]] = {}

    def on_type(self, message: Type) -> None:
        """A Type message names a non-builtin type only (for a domain, even the
        base type's name), so it is not used: the catalog, queried by OID when a
        Relation needs the type, gives its kind, base and element types."""

    def on_relation(self, message: Relation) -> tuple[TableVersion, bool]:
        """Register a Relation message; returns the current version and whether it is new."""
        shape = _shape(message)
        current = self._current.get(message.relation_id)
        if current is not None and self._shapes[message.relation_id] == shape:
            return current, False
        version = TableVersion(
            relation_id=message.relation_id,
            schema=message.namespace,
            table=message.name,
            version=1 if current is None else current.version + 1,
            replica_identity=message.replica_identity,
            columns=message.columns,
            codecs=self._codecs(message),
            key_indexes=self._key_indexes(message),
            snapshot=self._snapshot,
        )
        self._current[message.relation_id] = version
        self._shapes[message.relation_id] = shape
        return version, True

    @property
    def current(self) -> Mapping[int, TableVersion]:
        """The live mapping of relation id to current version (for a lookup per row, not a call)."""
        return self._current

    def get(self, relation_id: int) -> TableVersion:
        try:
            return self._current[relation_id]
        except KeyError:
            raise DefiniteError(
                f"row change for relation id {relation_id} arrived before its Relation message",
                hint="this is a protocol violation; report it with the PostgreSQL version",
            ) from None

    def __contains__(self, relation_id: int) -> bool:
        return relation_id in self._current

    def _codecs(self, message: Relation) -> tuple[ColumnCodec, ...]:
        dimensions: dict[str, int] = {}
        if self._dimensions_lookup is not None and any(
            self._is_array(c.type_oid) for c in message.columns
        ):
            dimensions = self._dimensions_lookup(message.relation_id)
        codecs = []
        for column in message.columns:
            try:
                codecs.append(
                    column_codec(
                        column.type_oid,
                        column.type_modifier,
                        self._catalog,
                        max(1, dimensions.get(column.name, 1)),
                    )
                )
            except KeyError:
                raise DefiniteError(
                    f"{message.namespace}.{message.name}.{column.name}: unknown type oid "
                    f"{column.type_oid}",
                    hint="the type was not found in pg_type; check the metadata connection",
                ) from None
        return tuple(codecs)

    def _is_array(self, type_oid: int) -> bool:
        try:
            return self._catalog.lookup(type_oid).category == "A"
        except KeyError:
            return False

    def _key_indexes(self, message: Relation) -> tuple[int, ...]:
        identity = message.replica_identity
        if identity not in (IDENTITY_FULL, IDENTITY_NOTHING):
            return tuple(i for i, c in enumerate(message.columns) if c.is_key)
        if self._key_lookup is None:
            return ()
        names = self._key_lookup(message.namespace, message.name)
        if not names:
            return ()
        positions = {c.name: i for i, c in enumerate(message.columns)}
        if not all(name in positions for name in names):
            return ()
        return tuple(positions[name] for name in names)
