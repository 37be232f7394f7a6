"""Wire formats (SPEC §6): what precedes the Avro body of every key and value.

* **Single-object encoding** (no registry): ``C3 01``, the 8-byte
  little-endian CRC-64-AVRO fingerprint of the schema's Parsing Canonical
  Form, then the Avro binary body. Readers need the writer schema, so every
  schema is published, before its first use, to the compacted topic
  ``<prefix>._schemas`` keyed by the fingerprint in hex (the same eight bytes
  as in the header, hex-encoded) with the schema JSON as value. Publishing is
  synchronous: the message is acknowledged before any record using it is
  produced, so a reader never meets an unknown fingerprint.
* **Confluent** (registry): byte 0, the 4-byte big-endian schema id, then the
  body; subjects ``<topic>-key`` and ``<topic>-value`` (TopicNameStrategy).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, Protocol

from fastavro.schema import parse_schema, to_parsing_canonical_form

from cdcd.errors import DefiniteError, TransientError
from cdcd.naming import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC

Role = Literal["key", "value"]

_EMPTY64 = 0xC15D213AA4D7A795


def _crc64_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY64 & -(fp & 1))
        table.append(fp)
    return tuple(table)


_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The CRC-64-AVRO (Rabin) fingerprint of the Avro specification."""
    fp = _EMPTY64
    for byte in data:
        fp = (fp >> 8) ^ _TABLE[(fp ^ byte) & 0xFF]
    return fp


def canonical_form(schema: dict[str, Any]) -> str:
    return str(to_parsing_canonical_form(parse_schema(schema)))


def schema_fingerprint(schema: dict[str, Any]) -> bytes:
    """The eight fingerprint bytes as they appear in a single-object header."""
    return crc64_avro(canonical_form(schema).encode("utf-8")).to_bytes(8, "little")


def schema_json(schema: dict[str, Any]) -> str:
    """The schema text published and registered (compact, stable key order)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class WireFormat(Protocol):
    """Gives the header bytes for a writer schema, registering/publishing it first."""

    def header(self, topic: str, role: Role, schema: dict[str, Any]) -> bytes: ...


class SingleObjectFormat:
    """Avro single-object encoding with schemas published to ``<prefix>._schemas``.

    ``publish(key, value)`` must return only once the broker acknowledged the
    schema record.
    """

    def __init__(self, publish: Callable[[bytes, bytes], None]) -> None:
        self._publish = publish
        self._published: dict[bytes, str] = {}  # fingerprint -> JSON last published under it

    def header(self, topic: str, role: Role, schema: dict[str, Any]) -> bytes:
        """The header of ``schema``; publishes it first unless it was the last one under its fingerprint.

        Parsing Canonical Form, which the fingerprint hashes, keeps neither
        logical-type attributes nor defaults nor aliases: ``decimal(10,2)``
        and ``decimal(12,3)`` (``ALTER COLUMN … TYPE``), or a field with and
        without the default a fast ``ADD COLUMN`` gave it, share a
        fingerprint. The schema in use is published again whenever it differs
        from the last one published under that fingerprint, so the compacted
        topic's latest value per key is the schema of the newest records
        (consumers take the latest; older records of a rewritten column are
        superseded by the re-snapshot that follows the rewrite).
        """
        fingerprint = schema_fingerprint(schema)
        text = schema_json(schema)
        if self._published.get(fingerprint) != text:
            self._publish(fingerprint.hex().encode("ascii"), text.encode("utf-8"))
            self._published[fingerprint] = text
        return SINGLE_OBJECT_MAGIC + fingerprint


class ConfluentFormat:
    """Confluent wire format through a ``confluent_kafka.schema_registry`` client."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._ids: dict[tuple[str, str], bytes] = {}

    def header(self, topic: str, role: Role, schema: dict[str, Any]) -> bytes:
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        subject = f"{topic}-{role}"
        text = schema_json(schema)
        header = self._ids.get((subject, text))
        if header is None:
            try:
                schema_id = self._client.register_schema(subject, Schema(text, "AVRO"))
            except SchemaRegistryError as exc:
                if exc.http_status_code == 409:
                    raise DefiniteError(
                        f"schema registry rejected a new schema for subject {subject}: "
                        f"{exc.error_message}",
                        hint="set the subject's compatibility to BACKWARD, FORWARD, FULL or NONE",
                    ) from exc
                if exc.http_status_code in (401, 403):
                    raise DefiniteError(
                        f"schema registry refused subject {subject} ({exc.http_status_code})",
                        hint="check schema_registry.config credentials",
                    ) from exc
                raise TransientError(f"schema registry error for {subject}: {exc}") from exc
            except OSError as exc:
                raise TransientError(f"schema registry unreachable: {exc}") from exc
            header = CONFLUENT_MAGIC + int(schema_id).to_bytes(4, "big")
            self._ids[(subject, text)] = header
        return header
