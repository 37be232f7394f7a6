"""Drive pgoutput payloads through cdcd's decode and envelope stages, then read
them back with plain fastavro (a reader that knows nothing of cdcd)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import fastavro

from cdcd.decode.relations import RelationCache, TableVersion
from cdcd.envelope.encoder import (
    OP_CREATE,
    OP_DELETE,
    OP_UPDATE,
    EnvelopeEncoder,
    make_stamp,
)
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.protocol import Lsn, PgOutputDecoder
from cdcd.protocol.messages import Begin, Commit, Delete, Insert, Relation, Type, Update
from cdcd.source.catalog import PgCatalog, column_dimensions
from cdcd.source.database import SourceDatabase


@dataclass
class Published:
    """What one change turned into: decoded key and envelope, and the writer schemas."""

    table: TableVersion
    key: dict[str, Any] | None
    value: dict[str, Any]  # empty for Confluent framing
    key_schema: Any
    value_schema: Any
    raw_value: bytes


@dataclass
class Harness:
    """decoder -> relation cache -> envelope encoder, with schemas captured as published."""

    dsn: str
    protocol_version: int = 1
    published_schemas: dict[str, str] = field(default_factory=dict)
    wire: Any = None

    def __post_init__(self) -> None:
        self.db = SourceDatabase(self.dsn)
        self.relations = RelationCache(
            PgCatalog(self.db.conn),
            key_lookup=self.db.primary_key,
            dimensions_lookup=lambda relid: column_dimensions(self.db.conn, relid),
        )
        if self.wire is None:
            self.wire = SingleObjectFormat(self._publish)
        self.encoder = EnvelopeEncoder("pg", self.db.database, self.wire)
        self.decoder = PgOutputDecoder(self.protocol_version)

    def _publish(self, key: bytes, value: bytes) -> None:
        self.published_schemas[key.decode()] = value.decode()

    def schema_for(self, data: bytes) -> Any:
        """The writer schema of single-object encoded bytes, as cdcd published it."""
        assert data[:2] == b"\xc3\x01"
        return json.loads(self.published_schemas[data[2:10].hex()])

    def read(self, data: bytes | None) -> dict[str, Any] | None:
        if data is None or data[:1] == b"\x00":
            return None  # null, or Confluent framing (read by the registry test itself)
        schema = fastavro.parse_schema(self.schema_for(data))
        record: dict[str, Any] = fastavro.schemaless_reader(io.BytesIO(data[10:]), schema, None)
        return record

    def run(self, payloads: list[tuple[int, bytes]]) -> list[Published]:
        out: list[Published] = []
        stamp = make_stamp(0, Lsn(0), 0)
        seq = 0
        for _lsn, payload in payloads:
            message = self.decoder.decode(payload)
            if isinstance(message, Relation):
                self.relations.on_relation(message)
            elif isinstance(message, Type):
                self.relations.on_type(message)
            elif isinstance(message, Begin):
                stamp = make_stamp(message.xid, message.final_lsn, 0)
                seq = 0
            elif isinstance(message, Commit):
                continue
            elif isinstance(message, Insert | Update | Delete):
                table = self.relations.get(message.relation_id)
                encoder = self.encoder.for_table(table)
                if isinstance(message, Insert):
                    key = encoder.key(message.new, stamp)
                    value = encoder.envelope(OP_CREATE, None, message.new, stamp, seq)
                    change = encoder.change(OP_CREATE, None, message.new, stamp, seq)
                elif isinstance(message, Update):
                    key = encoder.key(message.new, stamp)
                    value = encoder.envelope(OP_UPDATE, message.old, message.new, stamp, seq)
                    change = encoder.change(OP_UPDATE, message.old, message.new, stamp, seq)
                    self.last_key_changed = message.old is not None and encoder.key_changed(
                        message.old, message.new
                    )
                else:
                    key = encoder.key(message.old, stamp)
                    value = encoder.envelope(OP_DELETE, message.old, None, stamp, seq)
                    change = encoder.change(OP_DELETE, message.old, None, stamp, seq)
                # What the publisher sends: the key joined from the row's own
                # key columns must equal the key encoder's.
                assert change == (key, value), (change, key, value)
                # And the compiled encoder (where built) sends the same bytes.
                before = None if isinstance(message, Insert) else message.old
                after = None if isinstance(message, Delete) else message.new
                op = OP_CREATE if isinstance(message, Insert) else OP_UPDATE if isinstance(
                    message, Update
                ) else OP_DELETE
                assert encoder.encode_change(op, before, after, stamp, seq) == change
                seq += 1
                decoded = self.read(value) or {}
                out.append(
                    Published(
                        table=table,
                        key=self.read(key),
                        value=decoded,
                        key_schema=self.schema_for(key) if key and key[:1] != b"\x00" else None,
                        value_schema=self.schema_for(value) if value[:1] != b"\x00" else None,
                        raw_value=value,
                    )
                )
        return out

    def close(self) -> None:
        self.db.close()
