"""Avro schemas of keys and envelopes (SPEC §4, §5).

Names follow Debezium so existing consumers work: for topic
``pg.public.orders`` the key record is ``pg.public.orders.Key``, the row record
``pg.public.orders.Value`` and the envelope ``pg.public.orders.Envelope``.
Full names stay the same across relation versions, which Avro schema
resolution requires; non-key columns are ``["null", T]`` with default null,
so a column added or dropped gives a schema that old and new readers can both
resolve.

Avro names allow only ``[A-Za-z_][A-Za-z0-9_]*``; PostgreSQL identifiers allow
much more. Such names are replaced by a sanitized form (invalid characters
become ``_``, a leading digit gets a ``_`` prefix, collisions get a numeric
suffix) and the original PostgreSQL name is kept in the field attribute
``cdcd.column`` so readers can map back.
"""

from __future__ import annotations

import re
from typing import Any

from cdcd.decode.relations import TableVersion
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


def _field(name: str, original: str, avro_type: Any, nullable: bool) -> dict[str, Any]:
    field: dict[str, Any] = (
        {"name": name, "type": ["null", avro_type], "default": None}
        if nullable
        else {"name": name, "type": avro_type}
    )
    if name != original:
        field[ORIGINAL_NAME_ATTRIBUTE] = original
    return field


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
            _field(names[i], table.columns[i].name, table.codecs[i].avro_type, nullable=False)
            for i in table.key_indexes
        ],
    }


def row_schema(topic: str, table: TableVersion) -> dict[str, Any]:
    """The row record: every column; key columns required, others nullable."""
    names = field_names(table.column_names)
    keys = set(table.key_indexes)
    return {
        "type": "record",
        "name": "Value",
        "namespace": avro_namespace(topic),
        "fields": [
            _field(names[i], column.name, table.codecs[i].avro_type, nullable=i not in keys)
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
