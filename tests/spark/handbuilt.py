"""Envelope schemas written by hand, and messages encoded with them by plain fastavro.

For schema-change tests that must not depend on what today's encoder emits:
each test spells the writer schemas (defaults, union order, aliases) as
SPEC §5 "Schema changes" says cdcd publishes them, and encodes changes with
fastavro, wire header included. Kafka rows come from
:func:`spark.envelopes.kafka_batch`.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import fastavro

from cdcd.envelope.schemas import SOURCE_SCHEMA
from spark.envelopes import Message

TOPIC = "pg.public.t"
NAMESPACE = "pg.public.t"

DECIMAL_12_2 = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
TIMESTAMPTZ = {"type": "long", "logicalType": "timestamp-micros"}
INT_ARRAY = {"type": "array", "items": ["null", "int"]}


def key(name: str, avro_type: Any = "int") -> dict[str, Any]:
    """A replica identity column: plain ``T``."""
    return {"name": name, "type": avro_type}


def column(name: str, avro_type: Any, **extra: Any) -> dict[str, Any]:
    """A nullable column ``["null", T]`` with default null, as cdcd writes most columns."""
    return {"name": name, "type": ["null", avro_type], "default": None, **extra}


def with_default(name: str, avro_type: Any, default: Any, **extra: Any) -> dict[str, Any]:
    """A column added with a fast default: ``[T, "null"]`` whose default is Avro JSON."""
    return {"name": name, "type": [avro_type, "null"], "default": default, **extra}


def decimal_json(unscaled: int) -> str:
    """Avro's JSON encoding of a decimal default: the two's-complement bytes as code points."""
    length = max(1, (unscaled.bit_length() + 8) // 8)
    return unscaled.to_bytes(length, "big", signed=True).decode("latin-1")


def envelope(fields: list[dict[str, Any]]) -> dict[str, Any]:
    """The envelope schema (SPEC §5) of table ``public.t`` with row ``fields``."""
    row = {"type": "record", "name": "Value", "namespace": NAMESPACE, "fields": fields}
    return {
        "type": "record",
        "name": "Envelope",
        "namespace": NAMESPACE,
        "fields": [
            {"name": "before", "type": ["null", row], "default": None},
            {"name": "after", "type": ["null", "Value"], "default": None},
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": "long"},
            {"name": "source", "type": SOURCE_SCHEMA},
            {"name": "unchanged_toast", "type": {"type": "array", "items": "string"}, "default": []},
        ],
    }


def header_of(schema: dict[str, Any]) -> bytes:
    """A single-object header for ``schema`` (any stable 8 bytes do for a lookup key)."""
    digest = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).digest()
    return b"\xc3\x01" + digest[:8]


@dataclass
class Topic:
    """Messages of ``pg.public.t`` encoded with hand-built writer schemas."""

    messages: list[Message] = field(default_factory=list)
    schemas: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=dict)

    def change(
        self,
        schema: dict[str, Any],
        op: str,
        *,
        lsn: int,
        seq: int = 0,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
        partition: int = 0,
    ) -> Message:
        header = header_of(schema)
        self.schemas[header] = schema
        record = {
            "before": before,
            "after": after,
            "op": op,
            "ts_ms": 1_700_000_000_000,
            "source": {
                "version": "test",
                "connector": "cdcd",
                "name": "pg",
                "db": "db",
                "schema": "public",
                "table": "t",
                "txId": 1000 + lsn,
                "lsn": lsn,
                "seq": seq,
                "ts_ms": 1_700_000_000_000,
                "snapshot": op == "r",
            },
            "unchanged_toast": [],
        }
        body = io.BytesIO()
        fastavro.schemaless_writer(body, fastavro.parse_schema(schema), record)
        offset = self._offsets.get(partition, 0)
        self._offsets[partition] = offset + 1
        message = Message(TOPIC, partition, offset, None, header + body.getvalue(), lsn, seq)
        self.messages.append(message)
        return message
