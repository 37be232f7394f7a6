"""``cdcd tail -c FILE``: print the changes in the table topics, decoded, one line each.

A plain Kafka reader, no Spark: it reads the topics of the configuration's
captured tables (``--table`` narrows them; without a ``postgres.tables``
list, every table topic of ``kafka.topic_prefix``), decodes every envelope
with its own writer schema (``<prefix>._schemas`` in single-object mode, the
schema registry when ``schema_registry.url`` is set: :mod:`cdcd.consumer`),
and prints it as the demo does (``table op key lsn #seq what changed``) or,
with ``--json``, as one JSON object per line for scripts.

Partitions are ``assign()``-ed, never joined as a consumer group (nothing is
committed, and no group join to wait for). ``--from end`` shows only what
arrives after the start. The end of a partition is where the broker
reports end-of-partition after an empty fetch: a broker whose high
watermark lags (tansu reports the last batch's base offset + 1) is read
from one record before it, and what precedes the first end-of-partition is
skipped. A topic that appears later (a table's first change) is new, and
read from its beginning. ``--exit-at-end`` stops once every partition was
read to its end. Kafka orders messages per partition only; each fetched
batch (up to 500 messages) is printed in commit order (``cdcd.lsn``,
``cdcd.seq``).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import re
import signal
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime
from datetime import time as dt_time
from decimal import Decimal
from types import FrameType
from typing import Any, TextIO, TypeVar

from cdcd.config.kafka_client import connection_properties
from cdcd.config.model import CdcdConfig, load_config
from cdcd.consumer import SchemaCatalog, list_topics
from cdcd.errors import ConfigError, DefiniteError
from cdcd.naming import (
    LSN_HEADER,
    SEQ_HEADER,
    format_table,
    message_topic,
    schemas_topic,
    split_table,
    transaction_topic,
)
from cdcd.protocol.lsn import Lsn

__all__ = [
    "Change",
    "TopicReader",
    "cmd_tail",
    "describe_change",
    "format_value",
    "json_line",
]

log = logging.getLogger("cdcd.tail")

#: Longest string value shown whole on a line (the rest is cut with an ellipsis).
MAX_VALUE_CHARS = 40
#: How long a topic lookup or a watermark query may take.
TIMEOUT_S = 10.0


# ------------------------------------------------------------------------ formatting


def format_value(value: Any) -> str:
    """A decoded Avro value in a compact, unambiguous form (SQL-ish literals)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value if len(value) <= MAX_VALUE_CHARS else value[: MAX_VALUE_CHARS - 1] + "…"
        return "'" + text.replace("'", "''") + "'"
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            return value.strftime("%Y-%m-%dT%H:%M:%SZ")
        return value.strftime("%Y-%m-%dT%H:%M:%S")
    if isinstance(value, date | dt_time):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return "\\x" + value[:16].hex() + ("…" if len(value) > 16 else "")
    if isinstance(value, list):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _fields(row: Mapping[str, Any], skip: frozenset[str]) -> str:
    """``col=value`` for the non-key, non-null columns of ``row``."""
    return " ".join(
        f"{name}={format_value(value)}"
        for name, value in row.items()
        if name not in skip and value is not None
    )


def _diff(old: Mapping[str, Any], new: Mapping[str, Any], skip: frozenset[str]) -> str:
    """``col: old -> new`` for the columns whose value differs."""
    changed = [
        f"{name}: {format_value(old.get(name))} -> {format_value(value)}"
        for name, value in new.items()
        if name not in skip and old.get(name) != value
    ]
    return "  ".join(changed) or "(no column changed)"


def describe_change(
    envelope: Mapping[str, Any],
    key_columns: frozenset[str],
    last_seen: Mapping[str, Any] | None = None,
) -> str:
    """The interesting part of an envelope, in one short phrase.

    Inserts show the new row. Updates show what changed: against ``before``
    when it holds the old row (``REPLICA IDENTITY FULL``), else against
    ``last_seen`` (the previous version this consumer saw, what a downstream
    mirror holds), else the new row. Deletes show the old row, or
    say that only the key was sent (the default replica identity).
    """
    op = envelope["op"]
    before: Mapping[str, Any] | None = envelope.get("before")
    after: Mapping[str, Any] | None = envelope.get("after")
    full_before = before is not None and any(
        v is not None for k, v in before.items() if k not in key_columns
    )
    text: str
    if op in ("c", "r") and after is not None:
        text = _fields(after, key_columns)
    elif op == "u" and after is not None:
        if before is not None and full_before:
            text = _diff(before, after, key_columns)
        elif last_seen is not None:
            text = _diff(last_seen, after, key_columns)
        else:
            text = _fields(after, key_columns)
    elif op == "d":
        if before is not None and full_before:
            text = "was " + _fields(before, key_columns)
        else:
            text = "(old row not sent, only its key: replica identity default)"
    elif op == "t":
        text = "table truncated"
    else:
        text = ""
    toast = envelope.get("unchanged_toast") or []
    if toast:
        text += f"  unchanged TOAST: {', '.join(toast)}"
    return text


_Row = TypeVar("_Row", bound=Mapping[str, Any])


def remember_row(
    last: dict[tuple[str, str], _Row], row_id: tuple[str, str], op: str, after: _Row | None
) -> None:
    """Keep ``last`` (``(table, key)`` -> newest after-image) as a mirror holds the
    table: a truncate empties the table, a delete drops the row (the
    ``last_seen`` of :func:`describe_change`)."""
    if op == "t":
        for stale in [r for r in last if r[0] == row_id[0]]:
            del last[stale]
    elif after is None:
        last.pop(row_id, None)
    else:
        last[row_id] = after


def _plain(value: Any) -> Any:
    """A decoded Avro value as JSON can hold it (decimals as exact text, bytes in base64)."""
    if isinstance(value, datetime | date | dt_time):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# ------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Change:
    """One message of a table topic, decoded (``envelope`` None: a delete's tombstone)."""

    topic: str
    partition: int
    offset: int
    lsn: int
    seq: int
    key: dict[str, Any] | None
    envelope: dict[str, Any] | None

    @property
    def table(self) -> str:
        if self.envelope is None:
            return self.topic
        source = self.envelope["source"]
        return format_table(source["schema"], source["table"])


def json_line(change: Change) -> str:
    """``--json``: one object per change, values as JSON holds them."""
    body: dict[str, Any] = {
        "topic": change.topic,
        "partition": change.partition,
        "offset": change.offset,
        "lsn": str(Lsn(change.lsn)),
        "seq": change.seq,
        "table": change.table,
        "key": _plain(change.key),
    }
    if change.envelope is None:
        body["op"] = None  # a tombstone: the key's value is gone (log compaction)
    else:
        envelope = change.envelope
        body.update(
            op=envelope["op"],
            before=_plain(envelope.get("before")),
            after=_plain(envelope.get("after")),
            unchanged_toast=list(envelope.get("unchanged_toast") or []),
            source=_plain(envelope.get("source")),
        )
    return json.dumps(body, ensure_ascii=False, sort_keys=False)


class _OnceLogger:
    """librdkafka's ``logger``: each distinct warning or error once (it repeats them per retry)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def log(self, level: int, msg: str, *args: object) -> None:
        text = msg % args if args else msg
        if level >= logging.WARNING:
            # Without the client and thread names, and the durations and counts that vary.
            what = re.sub(r"\d+", "N", text.rpartition("]: ")[2])
            if what in self._seen:
                return
            self._seen.add(what)
        log.log(level, "%s", text)


class TopicReader:
    """Reads the chosen table topics with ``assign()`` and decodes each message."""

    def __init__(
        self,
        config: CdcdConfig,
        topics: list[str] | None,
        from_end: bool,
        catalog: SchemaCatalog | None = None,
    ) -> None:
        from confluent_kafka import Consumer

        self._config = config
        self._prefix = config.kafka.topic_prefix
        self._wanted = set(topics) if topics is not None else None
        self._from_end = from_end
        self.catalog = catalog if catalog is not None else SchemaCatalog.from_config(config)
        settings: dict[str, Any] = {
            "bootstrap.servers": config.kafka.bootstrap_servers,
            "group.id": f"cdcd-tail-{uuid.uuid4().hex}",  # assign() only: never joined
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "allow.auto.create.topics": False,
            "fetch.wait.max.ms": 100,
            # librdkafka's own lines through logging (stderr), never onto the changes.
            "logger": _OnceLogger(),
        }
        settings.update(connection_properties(config.kafka.producer))
        self._consumer = Consumer(settings)
        self._assigned: set[str] = set()
        #: Partitions not yet read to their end.
        self._before_end: set[tuple[str, int]] = set()
        #: With --from end: partitions whose records before their end are not shown.
        self._skipping: set[tuple[str, int]] = set()
        self._next_lookup = 0.0
        self._looked = False

    def close(self) -> None:
        self._consumer.close()

    @property
    def topics(self) -> list[str]:
        """Table topics read so far."""
        return sorted(self._assigned)

    def describe(self) -> str:
        """``3 topics`` / ``no topic yet``: what is read."""
        count = len(self._assigned)
        return f"{count} topic{'s' if count != 1 else ''}" if count else "no topic yet"

    @property
    def at_end(self) -> bool:
        """Every assigned partition was read to its end (at least once); no topic: at once."""
        return self._looked and not self._before_end

    def _table_topic(self, name: str) -> bool:
        prefix = self._prefix
        special = {schemas_topic(prefix), transaction_topic(prefix), message_topic(prefix)}
        if name in special:
            return False
        if self._wanted is not None:
            return name in self._wanted
        return name.startswith(prefix + ".")

    def discover(self) -> None:
        """Assign the partitions of table topics not assigned yet (topics appear as cdcd writes)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        metadata = list_topics(self._consumer, self._config.kafka.bootstrap_servers, TIMEOUT_S)
        new = []
        # A topic that appears later (a table's first change) is new from its beginning.
        from_end = self._from_end and not self._looked
        for name, info in sorted(metadata.topics.items()):
            if name in self._assigned or not self._table_topic(name):
                continue
            if info.error is not None or not info.partitions:
                continue
            self._assigned.add(name)
            for partition in sorted(info.partitions):
                start = OFFSET_BEGINNING
                if from_end:
                    low, high = self._consumer.get_watermark_offsets(
                        TopicPartition(name, partition), timeout=TIMEOUT_S
                    )
                    # One before the reported end: see the module docstring.
                    start = max(low, high - 1)
                    self._skipping.add((name, partition))
                self._before_end.add((name, partition))
                new.append(TopicPartition(name, partition, start))
        if new:
            self._consumer.incremental_assign(new)
        self._looked = True

    def poll(self, timeout_s: float) -> list[Change]:
        """Changes that arrived within ``timeout_s``, in partition order."""
        from confluent_kafka import KafkaError

        now = time.monotonic()
        if now >= self._next_lookup:
            self.discover()
            self._next_lookup = now + 1.0
        if not self._assigned:
            time.sleep(timeout_s)
            return []
        messages = self._consumer.consume(num_messages=500, timeout=timeout_s)
        if any(m.error() is None for m in messages):
            # Writer schemas are published before the records that use them; one
            # may replace an earlier schema under the same fingerprint (cdcd.consumer).
            self.catalog.refresh()
        out = []
        for message in messages:
            error = message.error()
            where = (message.topic(), message.partition())
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self._before_end.discard(where)
                    self._skipping.discard(where)
                elif not error.retriable() and error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise DefiniteError(f"reading {where[0]}: {error.str()}")
                continue
            if where in self._skipping:
                continue
            out.append(self._decode(message))
        return out

    def _decode(self, message: Any) -> Change:
        headers = dict(message.headers() or [])
        lsn_text, seq_text = headers.get(LSN_HEADER), headers.get(SEQ_HEADER)
        if lsn_text is None or seq_text is None:
            raise DefiniteError(
                f"{message.topic()} offset {message.offset()} has no {LSN_HEADER}/{SEQ_HEADER} "
                "headers: not written by cdcd"
            )
        value, key = message.value(), message.key()
        return Change(
            topic=message.topic(),
            partition=message.partition(),
            offset=message.offset(),
            lsn=int(Lsn.parse(lsn_text.decode("ascii"))),
            seq=int(seq_text),
            key=self.catalog.decode(key) if key is not None else None,
            envelope=self.catalog.decode(value) if value is not None else None,
        )


# ------------------------------------------------------------------------ printing


class Printer:
    """One line per change, as ``cdcd demo`` prints them; tombstones are not shown."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self._out = out
        self._json = as_json
        self._last: dict[tuple[str, str], dict[str, Any]] = {}  # what a mirror would hold

    def show(self, change: Change) -> None:
        if self._json:
            self._out.write(json_line(change) + "\n")
            return
        envelope = change.envelope
        if envelope is None:
            return  # the tombstone after a delete, for log compaction
        key = change.key or {}
        key_text = " ".join(f"{k}={format_value(v)}" for k, v in key.items()) or "(no key)"
        row_id = (change.table, repr(change.key))
        text = describe_change(envelope, frozenset(key), self._last.get(row_id))
        op = envelope["op"]
        self._out.write(
            f"{change.table} {op} {key_text} {Lsn(change.lsn)} #{change.seq}  {text}".rstrip() + "\n"
        )
        remember_row(self._last, row_id, op, envelope.get("after"))


# ------------------------------------------------------------------------ command


def _topics(config: CdcdConfig, tables: list[str]) -> list[str] | None:
    """The topics to read: of ``tables``, else of the configured tables; None: every one."""
    names = tables or list(config.postgres.table_names or [])
    if not names or any("*" in name for name in names):
        return None  # patterns and "every table of the publication": by topic prefix
    topics = []
    for name in names:
        try:
            schema, table = split_table(name)
        except DefiniteError as exc:
            raise ConfigError(f"--table {name!r} is not schema.table") from exc
        topics.append(config.table_topic(schema, table))
    return topics


def cmd_tail(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    reader = TopicReader(config, _topics(config, list(args.table)), args.start == "end")
    printer = Printer(sys.stdout, args.json)
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    told = False
    try:
        while not stopping:
            try:
                # Kafka orders per partition only: a fetched batch is shown in commit
                # order, so a transaction's changes come together (the sort is stable:
                # a delete stays before its tombstone).
                for change in sorted(reader.poll(0.5), key=lambda c: (c.lsn, c.seq)):
                    printer.show(change)
            except KeyboardInterrupt:
                break
            sys.stdout.flush()
            if reader.at_end:
                if args.exit_at_end:
                    break
                if not told:
                    told = True
                    print(
                        f"cdcd tail: at the end of {reader.describe()}; waiting for new "
                        "changes (Ctrl-C stops)",
                        file=sys.stderr,
                        flush=True,
                    )
    except BrokenPipeError:  # `cdcd tail … | head`: the reader went away
        return 0
    finally:
        reader.close()
    return 0
