"""Avro schemas of keys and envelopes (SPEC §4, §5).

Names follow Debezium so existing consumers work: for topic
``pg.public.orders`` the key record is ``pg.public.orders.Key``, the row record
``pg.public.orders.Value`` and the envelope ``pg.public.orders.Envelope``.
Full names stay the same across relation versions, which Avro schema
resolution requires; non-key columns are ``["null", T]`` with default null,
so a column added or dropped gives a schema that old and new readers can both
resolve. Schema-change tracking adds what plain Avro resolution needs to give
PostgreSQL's values for older records: a column added with a constant
default gets that default (its union then lists the type first, as Avro
requires), and a renamed column lists its earlier names as ``aliases``.

Avro names allow only ``[A-Za-z_][A-Za-z0-9_]*``; PostgreSQL identifiers allow
much more. Such names are replaced by a sanitized form (invalid characters
become ``_``, a leading digit gets a ``_`` prefix, collisions get a numeric
suffix) and the original PostgreSQL name is kept in the field attribute
``cdcd.column`` so readers can map back.
"""

from __future__ import annotations

import re
from typing import Any

from cdcd.decode.relations import ColumnDefault, TableVersion
from cdcd.naming import ORIGINAL_NAME_ATTRIBUTE

_INVALID = re.compile(r"[^A-Za-z0-9_]")
CONNECTOR = "cdcd"

SOURCE_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Source",
    "namespace": "io.cdcd",
    "fields": [
        {"name": "version", "type": "string"},
        {"name": "connector", "type": "string"},
        {"name": "name", "type": "string"},
        {"name": "db", "type": "string"},
        {"name": "schema", "type": "string"},
        {"name": "table", "type": "string"},
        {"name": "txId", "type": "long"},
        {"name": "lsn", "type": "long"},
        {"name": "seq", "type": "long"},
        {"name": "ts_ms", "type": "long"},
        {"name": "snapshot", "type": "boolean"},
    ],
}


def avro_name(name: str) -> str:
    """A valid Avro name for any PostgreSQL identifier."""
    sanitized = _INVALID.sub("_", name)
    if not sanitized or sanitized[0].isdigit():
        sanitized = "_" + sanitized
    return sanitized


def avro_namespace(topic: str) -> str:
    return ".".join(avro_name(part) for part in topic.split("."))


def field_names(columns: tuple[str, ...]) -> tuple[str, ...]:
    """Sanitized, unique Avro field names in column order."""
    used: set[str] = set()
    names = []
    for column in columns:
        candidate = avro_name(column)
        base, suffix = candidate, 2
        while candidate in used:
            candidate = f"{base}_{suffix}"
            suffix += 1
        used.add(candidate)
        names.append(candidate)
    return tuple(names)


def _field(
    name: str,
    original: str,
    avro_type: Any,
    nullable: bool,
    default: ColumnDefault | None = None,
    aliases: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One field. A column with a fast default lists its type first in the
    union, because Avro requires a union's default to match its first branch;
    readers resolving an older record without the field then get that value."""
    field: dict[str, Any] = {"name": name}
    if default is not None:
        field["type"] = [avro_type, "null"] if nullable else avro_type
        field["default"] = default.value
    elif nullable:
        field["type"] = ["null", avro_type]
        field["default"] = None
    else:
        field["type"] = avro_type
    if aliases:
        field["aliases"] = [avro_name(alias) for alias in aliases]
    if name != original:
        field[ORIGINAL_NAME_ATTRIBUTE] = original
    return field


def value_first(table: TableVersion, index: int) -> bool:
    """Whether column ``index`` is a ``[T, "null"]`` union (see :func:`_field`)."""
    return table.default_of(index) is not None and table.nullable(index)


def key_schema(topic: str, table: TableVersion) -> dict[str, Any] | None:
    """The key record of the replica identity columns, or None (null key)."""
    if not table.key_indexes:
        return None
    names = field_names(table.column_names)
    return {
        "type": "record",
        "name": "Key",
        "namespace": avro_namespace(topic),
        "fields": [
            _field(
                names[i],
                table.columns[i].name,
                table.codecs[i].avro_type,
                nullable=False,
                default=table.default_of(i),
                aliases=table.aliases_of(i),
            )
            for i in table.key_indexes
        ],
    }


def row_schema(topic: str, table: TableVersion) -> dict[str, Any]:
    """The row record: every column; key columns required (unless an earlier
    schema had them nullable: a column that joined the key), others nullable."""
    names = field_names(table.column_names)
    return {
        "type": "record",
        "name": "Value",
        "namespace": avro_namespace(topic),
        "fields": [
            _field(
                names[i],
                column.name,
                table.codecs[i].avro_type,
                nullable=table.nullable(i),
                default=table.default_of(i),
                aliases=table.aliases_of(i),
            )
            for i, column in enumerate(table.columns)
        ],
    }


def envelope_schema(topic: str, table: TableVersion) -> dict[str, Any]:
    """The change envelope (SPEC §5); field order is the binary layout."""
    return {
        "type": "record",
        "name": "Envelope",
        "namespace": avro_namespace(topic),
        "fields": [
            {"name": "before", "type": ["null", row_schema(topic, table)], "default": None},
            {"name": "after", "type": ["null", "Value"], "default": None},
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": "long"},
            {"name": "source", "type": SOURCE_SCHEMA},
            {
                "name": "unchanged_toast",
                "type": {"type": "array", "items": "string"},
                "default": [],
            },
        ],
    }
