"""The oracle itself: plain Avro resolution of an old record to a newer schema.

No cluster: an envelope written with an old row schema is read back with a
newer one carrying a renamed field (``aliases``) and constant defaults of
several types, through :func:`support.cdc._decode_resolved`; the defaults
must come back as the values a decoder gives for those types.
"""

from __future__ import annotations

import io
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any
from uuid import UUID

import fastavro
from support.cdc import SchemaBook, _decode_resolved, avro_default


def envelope(fields: list[dict[str, Any]]) -> dict[str, Any]:
    row = {"type": "record", "name": "Value", "namespace": "p.public.t", "fields": fields}
    return {
        "type": "record", "name": "Envelope", "namespace": "p.public.t",
        "fields": [
            {"name": "before", "type": ["null", row], "default": None},
            {"name": "after", "type": ["null", "Value"], "default": None},
            {"name": "op", "type": "string"},
        ],
    }


OLD = envelope([{"name": "id", "type": "int"},
                {"name": "note", "type": ["null", "string"], "default": None}])
NEW = envelope([
    {"name": "id", "type": "long"},
    {"name": "remark", "type": ["null", "string"], "default": None, "aliases": ["note"]},
    {"name": "dec", "type": [{"type": "bytes", "logicalType": "decimal", "precision": 10,
                              "scale": 2}, "null"], "default": "\u00ff"},
    {"name": "raw", "type": ["bytes", "null"], "default": "\u0000\u00ff\u007f\u0080"},
    {"name": "day", "type": [{"type": "int", "logicalType": "date"}, "null"], "default": 19782},
    {"name": "at", "type": [{"type": "long", "logicalType": "timestamp-micros"}, "null"],
     "default": 1704157445678901},
    {"name": "clock", "type": [{"type": "long", "logicalType": "time-micros"}, "null"],
     "default": 47655161718},
    {"name": "ident", "type": [{"type": "string", "logicalType": "uuid"}, "null"],
     "default": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"},
    {"name": "region", "type": ["string", "null"], "default": "eu"},
])


def test_old_record_resolves_to_the_new_schema_with_pg_values() -> None:
    book = SchemaBook()
    for fingerprint, schema in (("00" * 8, OLD), ("11" * 8, NEW)):
        book.raw[fingerprint] = schema
        book.schemas[fingerprint] = fastavro.parse_schema(schema)
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, book.schemas["00" * 8],
                               {"before": None, "after": {"id": 5, "note": "kept"}, "op": "c"})
    data = b"\xc3\x01" + bytes(8) + buffer.getvalue()
    readers = {"11" * 8: book.schemas["11" * 8]}
    value = _decode_resolved(book, data, ((0, 0), "11" * 8), readers)
    assert value is not None and value["after"] == {
        "id": 5,
        "remark": "kept",
        "dec": Decimal("-0.01"),
        "raw": b"\x00\xff\x7f\x80",
        "day": date(2024, 2, 29),
        "at": datetime(2024, 1, 2, 1, 4, 5, 678901, tzinfo=UTC),
        "clock": time(13, 14, 15, 161718),
        "ident": UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        "region": "eu",
    }


def test_avro_default_of_nested_types() -> None:
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 3}
    assert avro_default([decimal, "null"], "\u001c\u00be\u0099\u001a\u0085") == Decimal(
        "123456789.125")
    assert avro_default({"type": "array", "items": ["int", "null"]}, [1, 2]) == [1, 2]
    assert avro_default(["double", "null"], 2) == 2.0
    assert avro_default(["null", "string"], None) is None
