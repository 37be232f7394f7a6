"""Wire formats (SPEC §6): what precedes the Avro body of every key and value.

* **Single-object encoding** (no registry): ``C3 01``, the 8-byte
  little-endian CRC-64-AVRO fingerprint of the schema text cdcd publishes
  (:func:`schema_json`), then the Avro binary body. Readers need the writer
  schema, so every schema is published, before its first use, to the
  compacted topic ``<prefix>._schemas`` keyed by the fingerprint in hex (the
  same eight bytes as in the header, hex-encoded) with exactly that text as
  value. Publishing is synchronous: the message is acknowledged before any
  record using it is produced, so a reader never meets an unknown
  fingerprint.

  Why not the fingerprint of Avro's Parsing Canonical Form, as the Avro
  specification suggests: that form drops logical-type attributes, defaults
  and aliases, so ``decimal(10,2)`` and ``decimal(12,3)`` (an ``ALTER COLUMN
  … TYPE``), or a field with and without the default of a fast ``ADD
  COLUMN``, shared one identifier, and a reader resolving older records by it
  got the newer schema (wrong numbers). Hashing the published text gives two
  different writer schemas two identifiers, and a reader can check a
  ``_schemas`` record: its key is the fingerprint of its value.
* **Confluent** (registry): byte 0, the 4-byte big-endian schema id, then the
  body; subjects ``<topic>-key`` and ``<topic>-value`` (TopicNameStrategy).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from fastavro.schema import fingerprint
from pydantic import SecretStr

from cdcd.config.secrets import reveal
from cdcd.errors import DefiniteError, TransientError
from cdcd.naming import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC

Role = Literal["key", "value"]



def schema_fingerprint(schema: dict[str, Any]) -> bytes:
    """The eight fingerprint bytes of ``schema`` as they appear in a single-object header.

    CRC-64-AVRO of :func:`schema_json`'s text (see the module docstring),
    little-endian as the single-object encoding has it.
    """
    return text_fingerprint(schema_json(schema))


def text_fingerprint(text: str) -> bytes:
    """The single-object fingerprint of a schema published as ``text``."""
    return bytes.fromhex(fingerprint(text, "CRC-64-AVRO"))


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
        self._published: dict[bytes, str] = {}  # fingerprint -> the JSON published under it
        self._headers: dict[str, bytes] = {}  # JSON -> its header

    def header(self, topic: str, role: Role, schema: dict[str, Any]) -> bytes:
        """The header of ``schema``; publishes it first, once, under its own fingerprint.

        Every distinct schema text has its own fingerprint, so a fingerprint
        once published never names another schema: a second text under a
        known fingerprint (a CRC-64 collision) is refused rather than
        published over the first.
        """
        text = schema_json(schema)
        header = self._headers.get(text)
        if header is not None:
            return header
        fingerprint = text_fingerprint(text)
        known = self._published.get(fingerprint)
        if known is not None and known != text:
            raise DefiniteError(
                f"two writer schemas of {topic} have the same fingerprint {fingerprint.hex()}",
                hint="use a schema registry (schema_registry.url) for this topic prefix",
            )
        if known is None:
            self._publish(fingerprint.hex().encode("ascii"), text.encode("utf-8"))
            self._published[fingerprint] = text
        header = SINGLE_OBJECT_MAGIC + fingerprint
        self._headers[text] = header
        return header


#: Seconds a registry request may take unless ``schema_registry.config`` sets
#: ``timeout``: the client's own default waits forever on a registry that
#: accepts the connection and never answers.
REGISTRY_TIMEOUT_S = 30
#: SchemaRegistryClient settings that must be numbers (the YAML's
#: ``schema_registry.config`` holds strings).
_REGISTRY_NUMBERS = frozenset(
    {"timeout", "cache.capacity", "cache.latest.ttl.sec", "max.retries", "retries.wait.ms",
     "retries.max.wait.ms"}
)


def registry_client(url: str, config: Mapping[str, str | SecretStr] | None = None) -> Any:
    """A ``SchemaRegistryClient`` for ``url`` with ``config``, every request bounded in time."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    settings: dict[str, Any] = {"url": url, "timeout": REGISTRY_TIMEOUT_S}
    for name, value in reveal(config).items():  # credentials are SecretStr
        if name in _REGISTRY_NUMBERS and isinstance(value, str):
            try:
                settings[name] = float(value) if "." in value else int(value)
            except ValueError:
                raise DefiniteError(
                    f"schema_registry.config {name} is {value!r}, not a number",
                    hint=f"set schema_registry.config {name} to a number",
                ) from None
        else:
            settings[name] = value
    return SchemaRegistryClient.new_client(settings)


def registry_status(exc: BaseException) -> int | None:
    """The HTTP status of the registry's answer, or None if ``exc`` is not an answer."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    return exc.http_status_code if isinstance(exc, SchemaRegistryError) else None


def registry_unanswered(exc: BaseException) -> bool:
    """Whether a registry request failed before any answer: connection, timeout, TLS.

    The registry client raises SchemaRegistryError for every answer; without
    one it raises its HTTP library's errors: httpx's or httpx2's
    ``TransportError`` (which cdcd does not import: the client picks the
    library) or, with older clients, requests' errors, which are OSErrors.
    """
    if isinstance(exc, OSError):
        return True
    return any(
        cls.__name__ == "TransportError" and cls.__module__.partition(".")[0] in ("httpx", "httpx2")
        for cls in type(exc).__mro__
    )


def registry_outage(status: int | None) -> bool:
    """Whether an answer with HTTP ``status`` (None: no answer) may succeed when asked again.

    No answer (refused, unreachable, timed out), a timeout (408), throttling
    (429) or a server error (5xx).
    """
    return status is None or status in (408, 429) or status >= 500


class ConfluentFormat:
    """Confluent wire format through a ``confluent_kafka.schema_registry`` client.

    A registry outage (no answer, 5xx, 408, 429) is transient: the daemon
    retries with backoff from the last confirmed position, and nothing that
    needed the schema is produced or confirmed meanwhile. Refused credentials,
    an incompatible schema and other client errors are definite.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._ids: dict[tuple[str, str], bytes] = {}

    def header(self, topic: str, role: Role, schema: dict[str, Any]) -> bytes:
        from confluent_kafka.schema_registry import Schema

        subject = f"{topic}-{role}"
        text = schema_json(schema)
        header = self._ids.get((subject, text))
        if header is None:
            try:
                schema_id = self._client.register_schema(subject, Schema(text, "AVRO"))
            except Exception as exc:  # the client raises its HTTP library's errors too
                raise _registration_error(exc, subject) from exc
            header = CONFLUENT_MAGIC + int(schema_id).to_bytes(4, "big")
            self._ids[(subject, text)] = header
        return header


def _registration_error(exc: Exception, subject: str) -> Exception:
    """cdcd's error for a failed registration under ``subject``; ``exc`` itself if it is a bug."""
    status = registry_status(exc)
    if status is None and not registry_unanswered(exc):
        return exc
    if registry_outage(status):
        answer = f"answered {status}" if status is not None else "did not answer"
        return TransientError(
            f"schema registry {answer} registering subject {subject}: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        )
    if status == 409:
        return DefiniteError(
            f"schema registry rejected a new schema for subject {subject}: "
            f"{getattr(exc, 'error_message', exc)}",
            hint=(
                "set the subject's compatibility to BACKWARD_TRANSITIVE (or NONE): cdcd's "
                "schemas evolve backward-compatibly; FORWARD and FULL refuse type changes"
            ),
        )
    if status in (401, 403):
        return DefiniteError(
            f"schema registry refused subject {subject} ({status})",
            hint="check schema_registry.config credentials",
        )
    return DefiniteError(
        f"schema registry rejected subject {subject} ({status}): {_first_line(exc)}",
        hint="check schema_registry.url and the registry's settings for the subject",
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
