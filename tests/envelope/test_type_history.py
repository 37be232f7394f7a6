"""A field keeps every Avro type it has had (issue 30; docs/schema-changes.md).

Units of ``cdcd.envelope.schemas``' type history: the unions it builds, their
branch order, array merging, what schema-change tracking records, and the
encoder's bytes -- a value of the current type is the same bytes with or
without a history, and a record written before the type change resolves to
the newest schema with plain fastavro, to the value it carried.
"""

from __future__ import annotations

import io
from dataclasses import replace
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from cdcd.decode.relations import ColumnDefault, TableVersion
from cdcd.decode.types import StaticCatalog
from cdcd.decode.values import column_codec
from cdcd.envelope.encoder import OP_CREATE, TableEncoder, make_stamp
from cdcd.envelope.schemas import (
    envelope_schema,
    key_schema,
    merge_types,
    record_written,
    row_schema,
    type_history,
)
from cdcd.protocol import Lsn
from cdcd.protocol.messages import Column, TupleData

INT4, INT8, TEXT, NUMERIC, FLOAT8, INT4_ARRAY, TEXT_ARRAY = 23, 20, 25, 1700, 701, 1007, 1009
NUM_10_2 = ((10 << 16) | 2) + 4
CATALOG = StaticCatalog()
TOPIC = "pg.public.t"


class _Wire:
    def header(self, topic: str, role: str, schema: dict[str, Any]) -> bytes:
        return b""


def table(*columns: tuple[str, int, int], keys: tuple[int, ...] = (0,)) -> TableVersion:
    cols = tuple(Column(1 if i in keys else 0, n, oid, mod) for i, (n, oid, mod) in enumerate(columns))
    return TableVersion(
        relation_id=1, schema="public", table="t", version=1, replica_identity="d", columns=cols,
        codecs=tuple(column_codec(c.type_oid, c.type_modifier, CATALOG) for c in cols),
        key_indexes=keys,
    )


def with_history(version: TableVersion, written: tuple[Any, ...], **extra: Any) -> TableVersion:
    """``version`` annotated as schema-change tracking does (``annotate``)."""
    history = tuple(type_history(written, version, i, ()) for i in range(len(version.columns)))
    optional = tuple(bool(h) and i in version.key_indexes for i, h in enumerate(history))
    return replace(version, history=history, optional=optional, **extra)


def field_type(version: TableVersion, name: str) -> Any:
    return next(f for f in row_schema(TOPIC, version)["fields"] if f["name"] == name)["type"]


def encode(version: TableVersion, values: tuple[bytes | None, ...]) -> tuple[bytes, Any]:
    encoder = TableEncoder(version, TOPIC, "pg", "app", _Wire())  # type: ignore[arg-type]
    data = TupleData(bytes(ord("t") if v is not None else ord("n") for v in values), values)
    _, value = encoder.change(OP_CREATE, None, data, make_stamp(1, Lsn(16), 0, now_ms=0), 0)
    return value, fastavro.parse_schema(envelope_schema(TOPIC, version))


def read(data: bytes, writer: Any, reader: Any = None) -> dict[str, Any]:
    record = fastavro.schemaless_reader(io.BytesIO(data), writer, reader)
    assert isinstance(record, dict)
    return record


def test_text_to_int_keeps_the_text_branch_and_old_records_read_their_text() -> None:
    before = table(("id", INT4, -1), ("code", TEXT, -1))
    after = table(("id", INT4, -1), ("code", INT4, -1))
    written = record_written(record_written((), before), after)
    evolved = with_history(after, written)
    assert field_type(evolved, "code") == ["null", "int", "string"]
    old_bytes, old_schema = encode(before, (b"1", b"A-7"))
    new_bytes, new_schema = encode(evolved, (b"2", b"42"))
    # The current type's branch index did not move: the same bytes as without history.
    assert new_bytes == encode(after, (b"2", b"42"))[0]
    assert read(old_bytes, old_schema, new_schema)["after"]["code"] == "A-7"
    assert read(new_bytes, new_schema)["after"]["code"] == 42


def test_earlier_types_are_ordered_for_first_match_readers() -> None:
    # Current double with an int and a text history: int before string, so a
    # first-match reader finds an int value's own branch... after the current one.
    assert merge_types(["null", "double"], ["string", "int", "long", "bytes"]) == [
        "null", "double", "string", "int", "long", "bytes",
    ]
    version = table(("id", INT4, -1), ("x", FLOAT8, -1))
    written = (("id", ("int",)), ("x", ("bytes", "string", "long", "int", "double")))
    assert field_type(with_history(version, written), "x") == [
        "null", "double", "int", "long", "string", "bytes",
    ]


def test_a_fast_default_keeps_the_current_type_first() -> None:
    version = table(("id", INT4, -1), ("n", INT8, -1))
    written = (("n", ("string",)),)
    evolved = with_history(version, written, defaults=(None, ColumnDefault(5)))
    assert field_type(evolved, "n") == ["long", "null", "string"]
    value, schema = encode(evolved, (b"1", b"7"))
    assert value == encode(replace(version, defaults=(None, ColumnDefault(5))), (b"1", b"7"))[0]
    assert read(value, schema)["after"]["n"] == 7


def test_logical_types_share_their_primitive_branch() -> None:
    version = table(("id", INT4, -1), ("p", NUMERIC, ((12 << 16) | 3) + 4))
    old = table(("id", INT4, -1), ("p", NUMERIC, NUM_10_2))
    written = record_written(record_written((), old), version)
    evolved = with_history(version, written)
    assert field_type(evolved, "p") == ["null", version.codecs[1].avro_type]
    old_bytes, old_schema = encode(old, (b"1", b"1.23"))
    _, new_schema = encode(evolved, (b"1", b"1"))
    # fastavro applies the writer's logical type: the value the record carried.
    assert read(old_bytes, old_schema, new_schema)["after"]["p"] == Decimal("1.23")


def test_arrays_merge_their_items() -> None:
    old = table(("id", INT4, -1), ("a", INT4_ARRAY, -1))
    new = table(("id", INT4, -1), ("a", TEXT_ARRAY, -1))
    evolved = with_history(new, record_written(record_written((), old), new))
    assert field_type(evolved, "a") == [
        "null", {"type": "array", "items": ["null", "string", "int"]},
    ]
    old_bytes, old_schema = encode(old, (b"1", b"{1,NULL,3}"))
    new_bytes, new_schema = encode(evolved, (b"2", b'{x,"y z"}'))
    assert new_bytes == encode(new, (b"2", b'{x,"y z"}'))[0]
    assert read(old_bytes, old_schema, new_schema)["after"]["a"] == [1, None, 3]


def test_a_key_column_with_history_is_nullable_in_the_row_only() -> None:
    old = table(("id", INT4, -1), ("v", TEXT, -1))
    new = table(("id", INT8, -1), ("v", TEXT, -1))
    evolved = with_history(new, record_written(record_written((), old), new))
    assert field_type(evolved, "id") == ["null", "long", "int"]
    key = key_schema(TOPIC, evolved)
    assert key is not None and key["fields"][0]["type"] == "long"
    encoder = TableEncoder(evolved, TOPIC, "pg", "app", _Wire())  # type: ignore[arg-type]
    data = TupleData(b"tt", (b"9000000000", b"v"))
    key_bytes, value = encoder.change(OP_CREATE, None, data, make_stamp(1, Lsn(16), 0, now_ms=0), 0)
    assert key_bytes is not None
    assert read(key_bytes, fastavro.parse_schema(key)) == {"id": 9000000000}
    schema = fastavro.parse_schema(envelope_schema(TOPIC, evolved))
    assert read(value, schema)["after"] == {"id": 9000000000, "v": "v"}
    old_bytes, old_schema = encode(old, (b"3", b"w"))
    assert read(old_bytes, old_schema, schema)["after"] == {"id": 3, "v": "w"}


def test_history_follows_names_and_aliases() -> None:
    written = (("a", ("int",)), ("b", ("string",)), ("c", ("bytes",)))
    version = table(("id", INT4, -1), ("b", INT8, -1))
    assert type_history(written, version, 1, ("a",)) == ("string", "int")
    assert type_history(written, version, 1, ()) == ("string",)
    assert type_history(written, version, 0, ()) == ()
    again = record_written(written, version)
    assert dict(again)["b"] == ("string", "long")
    assert record_written(again, version) == again  # sticky, no duplicates


@pytest.mark.parametrize("types", [["int"], ["int", "long"], ["string", "bytes", "double"]])
def test_merging_is_idempotent(types: list[str]) -> None:
    once = merge_types(["null", "long"], types)
    assert merge_types(list(once), types) == once


def test_a_reused_name_never_makes_a_schema_readers_refuse() -> None:
    """``RENAME b TO n2`` then ``RENAME c TO b``: one writer name, two columns.

    Avro aliases carry no time; the newest schema must still let every
    older record resolve (no field answering to two writer fields, no two
    fields answering to one), even though a value under the reused name
    cannot reach the right field (docs/schema-changes.md, "Known limits").
    """
    first = table(("id", INT4, -1), ("b", TEXT, -1), ("c", TEXT, -1))
    now = replace(
        table(("id", INT4, -1), ("n2", TEXT, -1), ("b", TEXT, -1)), aliases=((), ("b",), ("c",))
    )
    fields = {f["name"]: f for f in row_schema(TOPIC, now)["fields"]}
    assert "aliases" not in fields["n2"] and "aliases" not in fields["b"]
    old_bytes, old_schema = encode(first, (b"1", b"was b", b"was c"))
    _, new_schema = encode(now, (b"1", b"x", b"y"))
    after = read(old_bytes, old_schema, new_schema)["after"]
    assert after == {"id": 1, "n2": None, "b": "was b"}


def test_an_earlier_name_claimed_twice_goes_from_both() -> None:
    now = replace(
        table(("id", INT4, -1), ("x", TEXT, -1), ("y", TEXT, -1)), aliases=((), ("n1",), ("n1",))
    )
    assert all("aliases" not in f for f in row_schema(TOPIC, now)["fields"])
