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
from pathlib import Path
from typing import Any

import fastavro

from cdcd.envelope.schemas import SOURCE_SCHEMA
from spark.envelopes import Message, kafka_batch

TOPIC = "pg.public.t"
NAMESPACE = "pg.public.t"

DECIMAL_12_2 = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
TIMESTAMPTZ = {"type": "long", "logicalType": "timestamp-micros"}
INT_ARRAY = {"type": "array", "items": ["null", "int"]}


def key(name: str, avro_type: Any = "int") -> dict[str, Any]:
    """A replica identity column: plain ``T`` (and in the message key, see ``Topic``)."""
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
        key_columns: tuple[str, ...] | None = None,
    ) -> Message:
        """Encode one change; its message key holds ``key_columns`` (default: the row's
        required columns, made by :func:`key`), null when there are none."""
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
        image = after if after is not None else before
        message_key = (
            self._key(schema, image, key_columns) if op != "t" and image is not None else None
        )
        offset = self._offsets.get(partition, 0)
        self._offsets[partition] = offset + 1
        message = Message(
            TOPIC, partition, offset, message_key, header + body.getvalue(), lsn, seq
        )
        self.messages.append(message)
        return message

    def _key(
        self, schema: dict[str, Any], image: dict[str, Any], names: tuple[str, ...] | None
    ) -> bytes | None:
        """The message key: a record of the key columns, as cdcd keys a change by its
        replica identity; None (a null key) without any."""
        row = schema["fields"][0]["type"][1]
        if names is None:
            names = tuple(f["name"] for f in row["fields"] if not isinstance(f["type"], list))
        by_name = {f["name"]: f for f in row["fields"]}
        fields = [
            {"name": name, "type": [b for b in t if b != "null"][0] if isinstance(t, list) else t}
            for name in names
            for t in [by_name[name]["type"]]
        ]
        if not fields:
            return None
        key_schema = {"type": "record", "name": "Key", "namespace": NAMESPACE, "fields": fields}
        header = header_of(key_schema)
        self.schemas[header] = key_schema
        body = io.BytesIO()
        fastavro.schemaless_writer(
            body, fastavro.parse_schema(key_schema), {f["name"]: image[f["name"]] for f in fields}
        )
        return header + body.getvalue()


class Mirror:
    """A mirror directory and the job applying batches of ``topic``'s messages to it:
    everything ``cdcd mirror`` does with a micro-batch but Spark's decoding job (which
    runs the same pure decoder, :func:`cdcd.spark.decode.decode_native`)."""

    def __init__(self, root: Path, topic: Topic) -> None:
        from cdcd.consumer import SchemaCatalog
        from cdcd.spark.mirror import MirrorJob, MirrorStore

        self.root = root
        self.topic = topic
        self.catalog = SchemaCatalog("pg")
        self.store = MirrorStore(root)
        self.store.open()
        self.job = MirrorJob(self.store, self.catalog)
        self.batch_id = -1

    def batch(self, messages: list[Message]) -> Any:
        """Apply ``messages`` as one micro-batch; returns its report."""
        from cdcd.spark.decode import decode_native

        for header, schema in self.topic.schemas.items():
            self.catalog.add(header, schema)
        self.batch_id += 1
        decoded: dict[str, list[Any]] = {}
        for native in decode_native(kafka_batch(messages), self.catalog.schema):
            decoded.setdefault(native.topic, []).append(native)
        return self.job.apply(self.batch_id, decoded)

    def rows(self) -> dict[Any, dict[str, Any]]:
        """The mirrored table as a reader sees it, by id (re-opened from disk)."""
        from cdcd.spark.mirror import MirrorStore, read_mirror

        reopened = MirrorStore(self.root)
        reopened.open()
        table = read_mirror(str(self.root / "public.t"))
        return {row["id"]: row for row in table.to_pylist()}
