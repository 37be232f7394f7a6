"""Envelopes exactly as the daemon writes them, without PostgreSQL or Kafka.

``EnvelopeFactory`` drives cdcd's own ``TableEncoder`` (single-object wire
format by default, Confluent with a mock registry client) over table shapes
built from type OIDs, and hands back Kafka rows in the column layout of
:mod:`cdcd.spark.source`, so decode and mirror tests exercise the real
encoder output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cdcd.decode.relations import TableVersion
from cdcd.decode.types import StaticCatalog
from cdcd.decode.values import column_codec
from cdcd.envelope.encoder import (
    OP_CREATE,
    OP_DELETE,
    OP_READ,
    OP_TRUNCATE,
    OP_UPDATE,
    TableEncoder,
    make_stamp,
)
from cdcd.envelope.wire import ConfluentFormat, SingleObjectFormat, WireFormat
from cdcd.naming import table_topic
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    Column,
    TupleData,
)
from cdcd.spark.source import ARROW_SCHEMA

OPS = {"c": OP_CREATE, "r": OP_READ, "u": OP_UPDATE, "d": OP_DELETE, "t": OP_TRUNCATE}
UNCHANGED = object()  # marks an unchanged TOAST value in a row given to the factory


@dataclass(frozen=True)
class Col:
    name: str
    oid: int
    typmod: int = -1
    key: bool = False
    dims: int = 1


def numeric(precision: int, scale: int) -> int:
    """atttypmod of numeric(precision, scale)."""
    return ((precision << 16) | (scale & 0x7FF)) + 4


def table_version(
    schema: str, table: str, cols: Sequence[Col], relation_id: int = 16_384, version: int = 1
) -> TableVersion:
    catalog = StaticCatalog()
    return TableVersion(
        relation_id=relation_id,
        schema=schema,
        table=table,
        version=version,
        replica_identity="d",
        columns=tuple(Column(1 if c.key else 0, c.name, c.oid, c.typmod) for c in cols),
        codecs=tuple(column_codec(c.oid, c.typmod, catalog, c.dims) for c in cols),
        key_indexes=tuple(i for i, c in enumerate(cols) if c.key),
    )


def tuple_data(row: Sequence[Any]) -> TupleData:
    """Text-format values: str/bytes, None for null, UNCHANGED for unchanged TOAST."""
    kinds = bytearray()
    values: list[bytes | None] = []
    for value in row:
        if value is None:
            kinds.append(KIND_NULL)
            values.append(None)
        elif value is UNCHANGED:
            kinds.append(KIND_UNCHANGED_TOAST)
            values.append(None)
        else:
            kinds.append(KIND_TEXT)
            values.append(value if isinstance(value, bytes) else str(value).encode())
    return TupleData(bytes(kinds), tuple(values))


@dataclass
class Message:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    lsn: int
    seq: int


@dataclass
class EnvelopeFactory:
    """Encodes changes with the daemon's encoder; keeps the published schemas."""

    prefix: str = "pg"
    database: str = "db"
    registry: Any | None = None
    partitions: int = 3
    published: dict[str, str] = field(default_factory=dict)  # fingerprint hex -> schema JSON
    messages: list[Message] = field(default_factory=list)
    _encoders: dict[tuple[int, int], TableEncoder] = field(default_factory=dict)
    _offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def wire(self) -> WireFormat:
        if self.registry is not None:
            return ConfluentFormat(self.registry)
        return SingleObjectFormat(
            lambda key, value: self.published.__setitem__(key.decode(), value.decode())
        )

    def encoder(self, table: TableVersion) -> TableEncoder:
        key = (table.relation_id, table.version)
        if key not in self._encoders:
            topic = table_topic(self.prefix, table.schema, table.table)
            self._encoders[key] = TableEncoder(table, topic, self.prefix, self.database, self.wire)
        return self._encoders[key]

    def change(
        self,
        table: TableVersion,
        op: str,
        *,
        before: Sequence[Any] | None = None,
        after: Sequence[Any] | None = None,
        lsn: int,
        seq: int,
        xid: int = 1000,
        commit_ms: int = 1_700_000_000_000,
        partition: int | None = None,
        tombstone: bool = True,
    ) -> list[Message]:
        """Encode one change (plus the tombstone after a delete); appends and returns them."""
        encoder = self.encoder(table)
        stamp = make_stamp(xid, Lsn(lsn), commit_ms)
        old = tuple_data(before) if before is not None else None
        new = tuple_data(after) if after is not None else None
        value = encoder.envelope(OPS[op], old, new, stamp, seq)
        image = new if new is not None else old
        key = encoder.key(image, stamp) if image is not None else None
        if partition is None:
            partition = hash(key) % self.partitions if key is not None else seq % self.partitions
        out = [self._append(encoder.topic, partition, key, value, lsn, seq)]
        if op == "d" and key is not None and tombstone:
            out.append(self._append(encoder.topic, partition, key, None, lsn, seq + 1))
        return out

    def _append(
        self, topic: str, partition: int, key: bytes | None, value: bytes | None, lsn: int, seq: int
    ) -> Message:
        offset = self._offsets.get((topic, partition), 0)
        self._offsets[(topic, partition)] = offset + 1
        message = Message(topic, partition, offset, key, value, lsn, seq)
        self.messages.append(message)
        return message

    def duplicate(self, messages: Iterable[Message]) -> None:
        """Append the messages again (a replay after a crash), at new offsets."""
        for m in list(messages):
            self._append(m.topic, m.partition, m.key, m.value, m.lsn, m.seq)


def lsn_text(lsn: int) -> bytes:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}".encode()


def kafka_batch(messages: Sequence[Message]) -> pa.RecordBatch:
    """The messages as rows of the ``cdcd-kafka`` source."""
    return pa.RecordBatch.from_pylist(
        [
            {
                "key": m.key,
                "value": m.value,
                "topic": m.topic,
                "partition": m.partition,
                "offset": m.offset,
                "timestamp": None,
                "timestampType": -1,
                "headers": [
                    {"key": "cdcd.lsn", "value": lsn_text(m.lsn)},
                    {"key": "cdcd.seq", "value": str(m.seq).encode()},
                ],
            }
            for m in messages
        ],
        schema=ARROW_SCHEMA,
    )
