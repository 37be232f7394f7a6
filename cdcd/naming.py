"""The names cdcd writes and reads: topics, ``schema.table``, headers, wire magic.

Pure (no I/O, no configuration objects): every other module asks this one
instead of spelling a name itself, so that producer, consumers (``cdcd.spark``,
``cdcd demo``), topic creation and configuration cannot drift apart.

Topics (SPEC §4, §6): ``<prefix>.<schema>.<table>`` per table,
``<prefix>._schemas`` (writer schemas, compacted), ``<prefix>.transaction``
(BEGIN/END records) and ``<prefix>.message`` (logical decoding messages).
PostgreSQL identifiers may contain characters Kafka topic names cannot (Kafka
allows ``[A-Za-z0-9._-]``, at most 249 characters). Such a schema or table name
is rewritten with ``_`` for each invalid character (and for ``.``, which would
make ``"a.b".c`` and ``a."b.c"`` collide) and gets a suffix of eight hex digits
of a hash of the original name, so two different tables never share a topic;
valid names are used unchanged. A table topic therefore always has exactly two
components after the prefix, and never equals one of the three others.

``schema.table`` (``postgres.tables``, ``--table``, ``read_changes``): each part
is either a plain name (no ``"`` and no ``.``; taken literally, not case-folded)
or a double-quoted name in which ``""`` stands for one ``"`` (so quoted names
may contain dots). :func:`parse_table` is the one parser, :func:`format_table`
its inverse.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from cdcd.errors import DefiniteError

__all__ = [
    "CONFLUENT_MAGIC",
    "HEARTBEAT_PREFIX",
    "LSN_HEADER",
    "ORIGINAL_NAME_ATTRIBUTE",
    "SEQ_HEADER",
    "SINGLE_OBJECT_MAGIC",
    "WATERMARK_PREFIX",
    "TopicSpec",
    "format_table",
    "message_topic",
    "parse_table",
    "schemas_topic",
    "split_table",
    "table_topic",
    "table_topic_pattern",
    "topic_spec",
    "transaction_topic",
]

# ------------------------------------------------------------------ headers

#: Kafka header with the commit LSN of the message's transaction (``X/Y`` text).
LSN_HEADER = "cdcd.lsn"
#: Kafka header numbering the messages of one transaction from 0 (decimal text).
SEQ_HEADER = "cdcd.seq"
#: Prefix of the logical decoding messages cdcd emits as heartbeats.
HEARTBEAT_PREFIX = "cdcd.heartbeat"
#: Prefix of the low/high watermark messages of incremental snapshots.
WATERMARK_PREFIX = "cdcd.watermark"
#: Avro field attribute holding a column's PostgreSQL name when it had to be rewritten.
ORIGINAL_NAME_ATTRIBUTE = "cdcd.column"

# --------------------------------------------------------------- wire magic

#: Avro single-object encoding: ``C3 01`` + 8-byte CRC-64-AVRO fingerprint.
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
#: Confluent wire format: ``0`` + 4-byte big-endian schema id.
CONFLUENT_MAGIC = b"\x00"

# ------------------------------------------------------------------- topics

_MAX_TOPIC = 249
_VALID_COMPONENT = re.compile(r"[A-Za-z0-9_-]+")
_INVALID_CHAR = re.compile(r"[^A-Za-z0-9_-]")
_SCHEMAS = "_schemas"
_TRANSACTION = "transaction"
_MESSAGE = "message"


def _component(name: str) -> str:
    if _VALID_COMPONENT.fullmatch(name):
        return name
    digest = hashlib.sha1(name.encode("utf-8"), usedforsecurity=False).hexdigest()[:8]
    return f"{_INVALID_CHAR.sub('_', name)}_{digest}"


def table_topic(prefix: str, schema: str, table: str) -> str:
    """``<prefix>.<schema>.<table>``, made valid for Kafka (see the module docstring)."""
    name = f"{prefix}.{_component(schema)}.{_component(table)}"
    if len(name) > _MAX_TOPIC:
        digest = hashlib.sha1(f"{schema}.{table}".encode(), usedforsecurity=False).hexdigest()[:8]
        name = f"{name[: _MAX_TOPIC - 9]}_{digest}"
    return name


def table_topic_pattern(prefix: str) -> str:
    """A regular expression matching every table topic ``<prefix>.<schema>.<table>``.

    The schemas, transaction and message topics have one component after the
    prefix and do not match. The same text is a valid Java regular
    expression, for Spark's Kafka source.
    """
    return re.escape(prefix) + r"\.[^.]+\.[^.]+"


def schemas_topic(prefix: str) -> str:
    """Writer schemas keyed by fingerprint (no registry); compacted."""
    return f"{prefix}.{_SCHEMAS}"


def transaction_topic(prefix: str) -> str:
    """BEGIN/END records when ``kafka.transaction_records``."""
    return f"{prefix}.{_TRANSACTION}"


def message_topic(prefix: str) -> str:
    """Logical decoding messages (``pg_logical_emit_message``)."""
    return f"{prefix}.{_MESSAGE}"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic cdcd writes to, as it would create it."""

    name: str
    partitions: int
    replication_factor: int
    config: Mapping[str, str] = field(default_factory=dict)


def topic_spec(
    prefix: str, name: str, *, table_partitions: int, replication_factor: int
) -> TopicSpec:
    """How cdcd creates topic ``name``: decided by which of its topics it is.

    The transaction and message topics get one partition: each carries one
    global order (commit order, emission order) that more partitions would
    lose. The schemas topic gets one partition and is compacted (SPEC §6).
    Any other name cdcd writes to is a table topic and gets
    ``table_partitions``, whatever the table is called (``public.transaction``
    included: see the module docstring).
    """
    if name == schemas_topic(prefix):
        return TopicSpec(name, 1, replication_factor, {"cleanup.policy": "compact"})
    if name in (transaction_topic(prefix), message_topic(prefix)):
        return TopicSpec(name, 1, replication_factor)
    return TopicSpec(name, table_partitions, replication_factor)


# ------------------------------------------------------------- schema.table

_PART = r'"(?:[^"]|"")+"|[^".]+'
_QUALIFIED = re.compile(rf"({_PART})\.({_PART})")
_SINGLE = re.compile(rf"({_PART})")


def _unquote(part: str) -> str:
    if part.startswith('"'):
        return part[1:-1].replace('""', '"')
    return part


def parse_table(text: str, *, default_schema: str | None = None) -> tuple[str, str] | None:
    """``schema.table`` into its two names; None when ``text`` is not in the grammar.

    With ``default_schema``, a lone (optionally quoted) name is a table in
    that schema.
    """
    match = _QUALIFIED.fullmatch(text)
    if match is not None:
        return _unquote(match.group(1)), _unquote(match.group(2))
    if default_schema is not None:
        single = _SINGLE.fullmatch(text)
        if single is not None:
            return default_schema, _unquote(single.group(1))
    return None


def table_globs(text: str) -> tuple[str, str] | None:
    """A ``postgres.tables`` pattern (``public.*``, ``sales.order_?``) as two fnmatch globs.

    None when ``text`` is no pattern: neither unquoted part holds ``*`` or
    ``?``. A quoted part is matched literally, wildcards and all.
    """
    match = _QUALIFIED.fullmatch(text)
    if match is None:
        return None
    parts = match.group(1), match.group(2)
    if not any(not p.startswith('"') and ("*" in p or "?" in p) for p in parts):
        return None
    return tuple(  # type: ignore[return-value]
        re.sub(r"([\[\]*?])", r"[\1]", _unquote(p)) if p.startswith('"') else p for p in parts
    )


def matches_table(globs: tuple[str, str], schema: str, table: str) -> bool:
    """Whether ``schema.table`` is one of the tables the pattern's globs name (case-sensitive)."""
    return fnmatch.fnmatchcase(schema, globs[0]) and fnmatch.fnmatchcase(table, globs[1])


def topic_glob_regex(glob: str) -> str:
    """A :func:`table_globs` glob as a regex over one topic name component (no ``.`` inside)."""
    out = []
    i = 0
    while i < len(glob):
        char = glob[i]
        end = glob.find("]", i + 2) if char == "[" else -1
        if char == "*":
            out.append("[^.]*")
        elif char == "?":
            out.append("[^.]")
        elif end != -1:
            out.append(re.escape(glob[i + 1 : end]) if end == i + 2 else glob[i : end + 1])
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def split_table(text: str, *, default_schema: str | None = None) -> tuple[str, str]:
    """:func:`parse_table` that raises :class:`DefiniteError` for a name outside the grammar."""
    parsed = parse_table(text, default_schema=default_schema)
    if parsed is None:
        raise DefiniteError(
            f"{text!r} is not schema.table",
            hint='write schema.table; double-quote a name containing "." or \'"\' '
            '(a " inside quotes is written "")',
        )
    return parsed


def _format_part(name: str) -> str:
    if not name:
        raise ValueError("an empty name has no schema.table spelling")
    if '"' in name or "." in name:
        return '"' + name.replace('"', '""') + '"'
    return name


def format_table(schema: str, table: str) -> str:
    """The ``schema.table`` spelling :func:`parse_table` reads back as ``(schema, table)``.

    Plain names stay unquoted (``public.orders``); a name containing ``.`` or
    ``"`` is double-quoted.
    """
    return f"{_format_part(schema)}.{_format_part(table)}"
