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

Type changes: a column whose type changed keeps, in its field's union, every
Avro type the topic's earlier schemas wrote under its name or under one of
its aliases (``TableVersion.history``, recorded by schema-change tracking):
``["null", <current>, <earlier>...]``. Branches are only ever appended after
the current type, so a value's branch index is the same as without history
and the encoders need not know; an older record resolves to its own branch
and reads the value it carried, whatever ALTER COLUMN TYPE came since. One
union holds one branch per Avro type (logical types share their primitive's
branch: the newest annotation is kept) and one array, whose items merge the
same way. A key column with a history is nullable in the row record, like a
column that joined the key (``TableVersion.optional``).

Avro names allow only ``[A-Za-z_][A-Za-z0-9_]*``; PostgreSQL identifiers allow
much more. Such names are replaced by a sanitized form (invalid characters
become ``_``, a leading digit gets a ``_`` prefix, collisions get a numeric
suffix) and the original PostgreSQL name is kept in the field attribute
``cdcd.column`` so readers can map back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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


def _branch(avro_type: Any) -> str:
    """Which union branch a type takes: one per primitive (logical types
    included), one array, one map, one per named type."""
    if isinstance(avro_type, dict):
        kind = avro_type["type"]
        if kind in ("record", "enum", "fixed"):
            return f"named:{avro_type.get('namespace', '')}.{avro_type['name']}"
        return str(kind)
    return str(avro_type)


#: Avro promotes int to long, float and double, long to float and double, float
#: to double, string to bytes and bytes to string: narrower types first, and
#: string before bytes (a decimal keeps its logical type either way; text
#: read as bytes would change type).
_PROMOTION = {"int": 0, "long": 1, "float": 2, "double": 3, "string": 4, "bytes": 5}


def _promotion_rank(avro_type: Any) -> int:
    return _PROMOTION.get(_branch(avro_type), len(_PROMOTION))


def merge_types(branches: list[Any], earlier: Any) -> list[Any]:
    """``branches`` (a union's types, in order) with ``earlier`` (a type or a
    union) merged in: a branch is added only for a type none of them takes;
    two arrays merge their items. Earlier types only ever go after, so the
    existing branches keep their indexes."""
    for avro_type in earlier if isinstance(earlier, list) else [earlier]:
        kind = _branch(avro_type)
        for j, branch in enumerate(branches):
            if _branch(branch) != kind:
                continue
            if kind in ("array", "map") and isinstance(branch, dict) and isinstance(avro_type, dict):
                part = "items" if kind == "array" else "values"
                merged = _merge_one(branch[part], avro_type[part])
                if merged != branch[part]:
                    branches[j] = {**branch, part: merged}
            break
        else:
            branches.append(avro_type)
    return branches


def _merge_one(current: Any, earlier: Any) -> Any:
    """One type (or union) with an earlier one merged in; a single type stays plain."""
    merged = merge_types(list(current) if isinstance(current, list) else [current], earlier)
    if len(merged) == 1 and not isinstance(current, list):
        return merged[0]
    return merged


def _field(
    name: str,
    original: str,
    avro_type: Any,
    nullable: bool,
    default: ColumnDefault | None = None,
    aliases: tuple[str, ...] = (),
    history: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """One field. A column with a fast default lists its type first in the
    union, because Avro requires a union's default to match its first branch;
    readers resolving an older record without the field then get that value.
    ``history``: earlier types, appended as further branches (see the module
    docstring)."""
    field: dict[str, Any] = {"name": name}
    if default is not None:
        field["type"] = [avro_type, "null"] if nullable else avro_type
        field["default"] = default.value
    elif nullable:
        field["type"] = ["null", avro_type]
        field["default"] = None
    else:
        field["type"] = avro_type
    if history:
        head = field["type"] if isinstance(field["type"], list) else [field["type"]]
        union = merge_types(list(head), list(history))
        # Earlier types after the current one, ordered so that a reader
        # taking the first branch a value matches (Avro's rule, fastavro's)
        # finds a value's own type before one it could be promoted to.
        field["type"] = union[: len(head)] + sorted(union[len(head) :], key=_promotion_rank)
    if aliases:
        field["aliases"] = [avro_name(alias) for alias in aliases]
    if name != original:
        field[ORIGINAL_NAME_ATTRIBUTE] = original
    return field


def value_first(table: TableVersion, index: int) -> bool:
    """Whether column ``index`` is a ``[T, "null"]`` union (see :func:`_field`)."""
    return table.default_of(index) is not None and table.nullable(index)


def unambiguous_aliases(table: TableVersion) -> list[tuple[str, ...]]:
    """Each column's earlier names, as Avro names, without those another field answers to.

    Avro aliases carry no time: when a name was two columns' at different
    times (``RENAME b TO x`` then ``RENAME a TO b``), one reader field must
    answer to a writer field of that name, and no reader field may answer to
    two fields of one writer (an older record has both ``a`` and ``b``).
    Either is no schema a reader accepts (fastavro fails with a KeyError).
    So a field's own name wins over another field's earlier name; a name
    several fields list as an earlier one goes from all of them; and a field
    whose name was another column's keeps no earlier names. Older records
    then resolve, but a value under a reused name may land in the wrong
    field or none: docs/schema-changes.md ("Known limits").
    """
    names = field_names(table.column_names)
    earlier = [tuple(dict.fromkeys(avro_name(a) for a in table.aliases_of(i)))
               for i in range(len(table.columns))]
    claims: dict[str, int] = {}
    for aliases in earlier:
        for alias in aliases:
            claims[alias] = claims.get(alias, 0) + 1
    return [
        ()
        if names[i] in claims
        else tuple(a for a in aliases if a not in names and claims[a] == 1)
        for i, aliases in enumerate(earlier)
    ]


def key_schema(topic: str, table: TableVersion) -> dict[str, Any] | None:
    """The key record of the replica identity columns, or None (null key)."""
    if not table.key_indexes:
        return None
    return _columns_record(topic, "Key", table, table.key_indexes, key=True)


def row_schema(topic: str, table: TableVersion) -> dict[str, Any]:
    """The row record: every column; key columns required (unless an earlier
    schema had them nullable: a column that joined the key), others nullable."""
    return _columns_record(topic, "Value", table, range(len(table.columns)), key=False)


def _columns_record(
    topic: str, name: str, table: TableVersion, indexes: Iterable[int], key: bool
) -> dict[str, Any]:
    """The record ``name`` of the columns ``indexes``: a key's fields are required and
    list no earlier types; a row's are nullable and typed as the table says."""
    names = field_names(table.column_names)
    aliases = unambiguous_aliases(table)
    return {
        "type": "record",
        "name": name,
        "namespace": avro_namespace(topic),
        "fields": [
            _field(
                names[i],
                table.columns[i].name,
                table.codecs[i].avro_type,
                nullable=not key and table.nullable(i),
                default=table.default_of(i),
                aliases=aliases[i],
                history=() if key else table.history_of(i),
            )
            for i in indexes
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


# ----------------------------------------------------------------------------- type history
#
# Schema-change tracking records, per table, every Avro type written under
# each field name (``TableState.written``), and annotates each new version
# with the earlier types its columns must keep (``TableVersion.history``).
# Both are pure functions of schemas, so they live here.

Written = tuple[tuple[str, tuple[Any, ...]], ...]
"""Field name -> every Avro type written under it, in order (sticky, JSON values)."""


def record_written(written: Written, table: TableVersion) -> Written:
    """``written`` with the field types of ``table``'s row record added."""
    out = {name: list(types) for name, types in written}
    names = field_names(table.column_names)
    for i, name in enumerate(names):
        avro_type = table.codecs[i].avro_type
        types = out.setdefault(name, [])
        if avro_type not in types:
            types.append(avro_type)
    return tuple((name, tuple(types)) for name, types in out.items())


def type_history(
    written: Written, table: TableVersion, index: int, aliases: tuple[str, ...]
) -> tuple[Any, ...]:
    """The earlier types column ``index`` of ``table`` must keep: every type
    written under its field name or one of ``aliases``, other than its own."""
    by_name = dict(written)
    own = field_names(table.column_names)[index]
    current = table.codecs[index].avro_type
    out: list[Any] = []
    for name in (own, *(avro_name(a) for a in aliases)):
        for avro_type in by_name.get(name, ()):
            if avro_type != current and avro_type not in out:
                out.append(avro_type)
    return tuple(out)
