"""End-to-end helpers: run the daemon, read what it published, replay it into tables.

The reader here knows nothing of cdcd's code: it reads the ``<prefix>._schemas``
topic, strips the single-object header (``C3 01`` + 8-byte fingerprint) and
decodes keys and values with plain fastavro, as any consumer would.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import yaml
from confluent_kafka.admin import AdminClient

from support import launch
from support.kafka import consume_all
from support.pg import current_wal_lsn, int_to_lsn, slot_confirmed_flush_lsn

PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: Hooks every ``cdcd`` the suite starts gets (tests/support/launch.py sets
#: them in the child before its command runs): the signal table is read every
#: 0.2 s, not every 2 s, so requested snapshots and schema-change heals start
#: sooner and chained ones do not wait 2 s each; nothing else changes.
TEST_HOOKS: dict[str, Any] = {"cdcd.snapshot.incremental.POLL_INTERVAL_S": 0.2}

#: For a daemon (or ``cdcd run``) a test expects to exit 1 once its startup
#: retries are used up: a 4 s window still retries twice (backoff 1 s, 2 s)
#: but spares the test the production 30 s window (about 15 s of waiting each).
SHORT_STARTUP_RETRY = {"cdcd.daemon.STARTUP_RETRY_S": 4.0}


def cdcd_argv(*args: str, hooks: Mapping[str, Any] | None = None) -> list[str]:
    """The argv of ``cdcd ARGS`` as the suite runs it: with :data:`TEST_HOOKS` and ``hooks``."""
    return launch.command(args, {**TEST_HOOKS, **(hooks or {})})


def run_cdcd(
    *args: str, timeout_s: float = 120, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m cdcd ARGS`` from the project root, to its end: its exit code and output
    (text). ``env`` is added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "cdcd", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
        timeout=timeout_s, env={**os.environ, **env} if env is not None else None, check=False,
    )


def write_config(
    path: Path,
    dsn: str,
    bootstrap: str,
    *,
    prefix: str = "pg",
    slot: str = "cdcd",
    publication: str = "cdcd",
    tables: list[str] | None = None,
    postgres: Mapping[str, Any] | None = None,
    kafka: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """A configuration file for the daemon under test (metrics on a free port)."""
    config: dict[str, Any] = {
        "postgres": {
            "dsn": dsn,
            "slot": slot,
            "publication": publication,
            "status_interval_s": 1,
            **({"tables": tables} if tables else {}),
            **(postgres or {}),
        },
        "kafka": {
            "bootstrap_servers": bootstrap,
            "topic_prefix": prefix,
            "partitions": 3,
            **(kafka or {}),
        },
        "snapshot": {"mode": "never"},
        "metrics": {"listen": "127.0.0.1:0"},
        "heartbeat": {"interval_s": 2},
    }
    for section, values in (extra or {}).items():
        config.setdefault(section, {}).update(values)
    snapshot = config["snapshot"]
    if "chunk_rows" in snapshot:
        # A test that sets small chunks means them for incremental snapshots too
        # (whose default is three times chunk_rows): keep its chunk count.
        snapshot.setdefault("incremental_chunk_rows", snapshot["chunk_rows"])
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class DaemonProcess:
    """``cdcd run -c FILE`` as a child process (with test hooks), killable at will."""

    def __init__(
        self,
        config: Path,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        hooks: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            cdcd_argv("run", "-c", str(config), hooks=hooks),
            cwd=PROJECT_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.wait(10)

    def freeze(self) -> None:
        """SIGSTOP the daemon and wait until every thread of it is stopped.

        Its sockets stay open, so PostgreSQL and the broker see a live but
        silent client: nothing more is produced or confirmed until
        :meth:`thaw` (or :meth:`kill9`, which also works on a frozen process).
        """
        self.proc.send_signal(signal.SIGSTOP)
        wait_for(self._stopped, timeout_s=10, interval_s=0.01, what=f"pid {self.pid} to stop")

    def thaw(self) -> None:
        """SIGCONT: undo :meth:`freeze`."""
        self.proc.send_signal(signal.SIGCONT)

    def _stopped(self) -> bool:
        """Every thread in state T (stopped); delivery of SIGSTOP is asynchronous."""
        states = []
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text(encoding="ascii", errors="replace")
            except FileNotFoundError:  # a thread that just exited
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        return bool(states) and all(state in ("T", "t") for state in states)

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            self._log.flush()
        self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@dataclass(frozen=True)
class Change:
    topic: str
    partition: int
    offset: int
    lsn: int
    seq: int
    key: dict[str, Any] | None
    value: dict[str, Any] | None  # None: tombstone


def _headers(message: Any) -> dict[str, bytes]:
    return {k: v for k, v in (message.headers() or [])}


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


class SchemaBook:
    """Writer schemas by fingerprint hex, read from ``<prefix>._schemas``."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.raw: dict[str, Any] = {}  # the same schemas as JSON, field attributes and all

    def load(self, bootstrap: str, prefix: str) -> None:
        for message in consume_all(bootstrap, f"{prefix}._schemas", timeout_s=15, idle_s=1.0):
            self.add(message.key(), message.value())

    def add(self, key: bytes, value: bytes) -> None:
        """One ``_schemas`` message (fingerprint hex, schema JSON); also what a
        ``SingleObjectFormat`` in a unit test publishes its schemas to."""
        fingerprint = key.decode()
        self.raw[fingerprint] = json.loads(value)
        self.schemas[fingerprint] = fastavro.parse_schema(self.raw[fingerprint])

    def decode(self, data: bytes | None) -> dict[str, Any] | None:
        return None if data is None else self.record(data)

    def record(self, data: bytes) -> dict[str, Any]:
        """A single-object encoded value, read with plain fastavro."""
        _check_framing(data)
        schema = self.schemas[data[2:10].hex()]
        record: dict[str, Any] = fastavro.schemaless_reader(io.BytesIO(data[10:]), schema, None)
        return record


def table_topics(bootstrap: str, prefix: str) -> list[str]:
    names = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    special = {f"{prefix}._schemas", f"{prefix}.transaction", f"{prefix}.message"}
    return sorted(t for t in names if t.startswith(prefix + ".") and t not in special)


def read_changes(
    bootstrap: str,
    prefix: str,
    topics: Iterable[str] | None = None,
    expected: int | None = None,
    timeout_s: float = 60.0,
    idle_s: float = 2.0,
) -> list[Change]:
    """Every change message of the table topics, decoded, in arrival order per partition."""
    topic_list = list(topics) if topics is not None else table_topics(bootstrap, prefix)
    records = read_records(bootstrap, topic_list, expected=expected, timeout_s=timeout_s,
                           idle_s=idle_s)
    # Schemas after the records: cdcd publishes a schema (acknowledged) before
    # the first record that uses it, so every record read has its schema
    # there now -- read first, a record still on its way would not.
    book = SchemaBook()
    book.load(bootstrap, prefix)
    return [
        Change(r.topic, r.partition, r.offset, r.lsn, r.seq, book.decode(r.key), book.decode(r.value))
        for r in records
    ]


def replay(changes: Iterable[Change], key_columns: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Apply envelopes in (lsn, seq) order, de-duplicated, into {key: row}."""
    ordered = sorted({(c.lsn, c.seq, c.topic): c for c in changes}.values(), key=lambda c: (c.lsn, c.seq))
    table: dict[tuple[Any, ...], dict[str, Any]] = {}
    # A key-changing update arrives as a delete of the old key then a create
    # of the new one; unchanged TOAST values of the create live in the old row.
    deleted: tuple[int, dict[str, Any]] | None = None
    for change in ordered:
        envelope = change.value
        if envelope is None:
            continue  # tombstone
        op = envelope["op"]
        if op == "t":
            table.clear()
        elif op in ("c", "r", "u"):
            row = dict(envelope["after"])
            for column in envelope["unchanged_toast"]:
                previous = table.get(tuple(row[k] for k in key_columns))
                if previous is None and deleted is not None and deleted[0] == change.lsn:
                    previous = deleted[1]
                row[column] = previous[column] if previous else None
            table[tuple(row[k] for k in key_columns)] = row
        elif op == "d":
            before = envelope["before"]
            removed = table.pop(tuple(before[k] for k in key_columns), None)
            if removed is not None:
                deleted = (change.lsn, removed)
    return table


def wait_for(predicate: Any, timeout_s: float = 60.0, interval_s: float = 0.2, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(interval_s)


#: A walsender streams from the slot (START_REPLICATION ran). ``active`` alone
#: is not that: the backend that creates a slot holds it while it waits for a
#: consistent point, and a test that took that for streaming wrote rows and
#: DDL while the daemon was still starting (the schema-change baseline then
#: read a catalog already past them, and a rename healed).
STREAMING_SQL = (
    "SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid "
    "WHERE s.slot_name = %s AND r.state IN ('catchup', 'streaming')"
)


def wait_streaming(
    db: Any, slot: str, daemon: DaemonProcess | None = None, timeout_s: float = 60.0
) -> None:
    """Until a walsender streams from ``slot``; an AssertionError with the end of its log if
    ``daemon`` exits first. ``db``: anything with ``execute(query, params)`` (a
    ``PgDatabase``, a ``LocalPostgres``) on the slot's server, as a superuser."""

    def streaming() -> bool:
        if daemon is not None and not daemon.alive():
            raise AssertionError(f"the daemon exited ({daemon.proc.returncode}) before "
                                 f"streaming:\n{daemon.log()[-3000:]}")
        return bool(db.execute(STREAMING_SQL, (slot,)))

    wait_for(streaming, timeout_s=timeout_s, interval_s=0.1, what=f"the daemon to stream from {slot}")


def wait_wal_confirmed(
    conn: Any, slot: str, daemon: DaemonProcess | None = None, timeout_s: float = 60.0
) -> None:
    """Until ``slot`` confirmed the server's WAL position as of now (read on ``conn``, a
    psycopg2 connection): everything committed so far is in Kafka. An AssertionError with
    the end of its log if ``daemon`` exits first."""
    target = current_wal_lsn(conn)

    def confirmed() -> bool:
        if daemon is not None and not daemon.alive():
            raise AssertionError(f"the daemon exited ({daemon.proc.returncode}):\n"
                                 f"{daemon.log()[-3000:]}")
        return slot_confirmed_flush_lsn(conn, slot) >= target

    wait_for(confirmed, timeout_s=timeout_s, interval_s=0.1,
             what=f"{slot} to confirm {int_to_lsn(target)}")


# ----------------------------------------------------------------------------- schema resolution
#
# A consumer that follows schema changes decodes every record with its own
# writer schema *resolved to the topic's newest schema* (the writer schema of
# the change with the highest (cdcd.lsn, cdcd.seq)), as Avro's schema
# resolution rules define it: a field the writer lacks takes the reader
# field's default, a reader field's ``aliases`` match earlier writer names,
# int/long/float promote. fastavro (1.13) implements all of it except one
# thing: a default is handed back in its JSON form (bytes as a string of code
# points, a date as an int, a decimal as a string of bytes...), not converted
# through the field's type as the Avro specification says ("Default values for
# bytes and fixed fields are JSON strings, where Unicode code points 0-255 are
# mapped to unsigned 8-bit byte values"; logical types apply to the value).
# :func:`avro_default` does that conversion, from the specification alone.


@dataclass(frozen=True)
class RawRecord:
    """One table-topic message as it is in Kafka, before decoding."""

    topic: str
    partition: int
    offset: int
    lsn: int
    seq: int
    key: bytes | None
    value: bytes | None


@dataclass
class ResolvedRead:
    """Every change of some topics, each resolved to its topic's newest schemas."""

    changes: list[Change]
    #: topic -> newest envelope (value) writer schema, as JSON
    value_schemas: dict[str, Any]
    #: topic -> newest key writer schema, as JSON (None: the topic has no keyed record)
    key_schemas: dict[str, Any]

    def row_columns(self, topic: str) -> dict[str, str]:
        """Avro field name -> PostgreSQL column name of the newest row record."""
        return {
            f["name"]: f.get("cdcd.column", f["name"])
            for f in row_record(self.value_schemas[topic])["fields"]
        }


def read_records(
    bootstrap: str,
    topics: Iterable[str],
    expected: int | None = None,
    timeout_s: float = 60.0,
    idle_s: float = 2.0,
) -> list[RawRecord]:
    """Every message of ``topics``, undecoded, with its (cdcd.lsn, cdcd.seq) headers."""
    out = []
    for message in consume_all(bootstrap, list(topics), timeout_s=timeout_s, expected=expected,
                               idle_s=idle_s):
        headers = _headers(message)
        out.append(
            RawRecord(
                topic=message.topic(),
                partition=message.partition(),
                offset=message.offset(),
                lsn=_lsn(headers["cdcd.lsn"].decode()),
                seq=int(headers["cdcd.seq"]),
                key=message.key(),
                value=message.value(),
            )
        )
    return out


def read_resolved_changes(
    bootstrap: str,
    prefix: str,
    topics: Iterable[str] | None = None,
    expected: int | None = None,
    timeout_s: float = 60.0,
    idle_s: float = 2.0,
) -> ResolvedRead:
    """Like :func:`read_changes`, but every value (envelope) is decoded with its writer
    schema and resolved to the newest value schema of its topic.

    Keys are decoded with their own writer schema only: a key names the row
    under the replica identity in force when it was written, and a key that
    gained a column cannot be resolved to the new key schema by any reader
    (replay works from the envelopes' rows anyway). ``key_schemas`` still
    tells the newest key schema of each topic.

    Raises AssertionError naming the records (topic, partition, offset,
    lsn/seq, op) that plain Avro resolution cannot read with the newest schema.
    """
    topic_list = list(topics) if topics is not None else table_topics(bootstrap, prefix)
    records = read_records(bootstrap, topic_list, expected=expected, timeout_s=timeout_s,
                           idle_s=idle_s)
    book = SchemaBook()  # after the records, as in read_changes
    book.load(bootstrap, prefix)
    newest_value: dict[str, tuple[tuple[int, int], str]] = {}
    newest_key: dict[str, tuple[tuple[int, int], str]] = {}
    for record in records:
        position = (record.lsn, record.seq)
        for data, newest in ((record.value, newest_value), (record.key, newest_key)):
            if data is None:
                continue
            _check_framing(data)
            fingerprint = data[2:10].hex()
            if record.topic not in newest or newest[record.topic][0] < position:
                newest[record.topic] = (position, fingerprint)
    raw = book.raw
    value_schemas = {t: raw[fp] for t, (_, fp) in newest_value.items()}
    key_schemas = {t: raw[fp] for t, (_, fp) in newest_key.items()}
    readers = {fp: fastavro.parse_schema(raw[fp]) for _, fp in newest_value.values()}

    changes: list[Change] = []
    failures: list[str] = []
    for record in records:
        try:
            key = book.decode(record.key)
            value = _decode_resolved(book, record.value, newest_value.get(record.topic), readers)
        except Exception as exc:  # noqa: BLE001 - collected, reported below with the record
            op = "?"
            if record.value is not None:
                plain = book.decode(record.value)
                op = plain["op"] if plain else "?"
            failures.append(
                f"{record.topic}[{record.partition}]@{record.offset} lsn={record.lsn:X} "
                f"seq={record.seq} op={op}: {type(exc).__name__}: {exc}"
            )
            continue
        changes.append(
            Change(
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                lsn=record.lsn,
                seq=record.seq,
                key=key,
                value=value,
            )
        )
    if failures:
        raise AssertionError(
            f"{len(failures)} of {len(records)} records cannot be read with their topic's newest "
            "schema by plain Avro resolution, e.g.:\n  " + "\n  ".join(failures[:5])
        )
    return ResolvedRead(changes, value_schemas, key_schemas)


def _check_framing(data: bytes) -> None:
    assert data[:2] == b"\xc3\x01", f"not single-object encoded: {data[:10]!r}"


def _decode_resolved(
    book: SchemaBook,
    data: bytes | None,
    newest: tuple[tuple[int, int], str] | None,
    readers: dict[str, Any],
) -> dict[str, Any] | None:
    if data is None:
        return None
    assert newest is not None
    fingerprint = data[2:10].hex()
    writer = book.schemas[fingerprint]
    reader_fp = newest[1]
    record: dict[str, Any] = fastavro.schemaless_reader(
        io.BytesIO(data[10:]), writer, readers[reader_fp]
    )
    _convert_defaults(book.raw[reader_fp], book.raw[fingerprint], record)
    return record


def row_record(envelope_schema: Any) -> Any:
    """The row record (``Value``) of an envelope schema, as JSON."""
    for field_ in envelope_schema["fields"]:
        if field_["name"] in ("before", "after"):
            for branch in field_["type"]:
                if isinstance(branch, dict) and branch.get("type") == "record":
                    return branch
    raise AssertionError(f"no row record in {envelope_schema.get('name')}")


def _named_types(schema: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Named types of a JSON schema by short and full name (enough for our schemas)."""
    if isinstance(schema, list):
        for branch in schema:
            _named_types(branch, out)
    elif isinstance(schema, dict):
        kind = schema.get("type")
        if kind in ("record", "enum", "fixed"):
            out[schema["name"]] = schema
            if schema.get("namespace"):
                out[f"{schema['namespace']}.{schema['name']}"] = schema
            for field_ in schema.get("fields", []):
                _named_types(field_["type"], out)
        elif kind == "array":
            _named_types(schema["items"], out)
        elif kind == "map":
            _named_types(schema["values"], out)
        elif isinstance(kind, dict | list):
            _named_types(kind, out)
    return out


def _deref(schema: Any, named: dict[str, Any]) -> Any:
    while True:
        if isinstance(schema, str) and schema in named:
            schema = named[schema]
        elif isinstance(schema, dict) and isinstance(schema.get("type"), dict | list):
            schema = schema["type"]
        elif isinstance(schema, dict) and schema.get("type") in named:
            schema = named[schema["type"]]
        else:
            return schema


def _record_branch(schema: Any, named: dict[str, Any]) -> Any:
    schema = _deref(schema, named)
    if isinstance(schema, list):
        for branch in schema:
            candidate = _deref(branch, named)
            if isinstance(candidate, dict) and candidate.get("type") == "record":
                return candidate
        return None
    return schema if isinstance(schema, dict) and schema.get("type") == "record" else None


def _convert_defaults(reader: Any, writer: Any, datum: Any) -> None:
    """Turn the JSON defaults fastavro filled in into Python values (in place)."""
    _convert_record(reader, writer, datum, _named_types(reader, {}), _named_types(writer, {}))


def _convert_record(
    reader: Any, writer: Any, datum: Any, rnamed: dict[str, Any], wnamed: dict[str, Any]
) -> None:
    rrec, wrec = _record_branch(reader, rnamed), _record_branch(writer, wnamed)
    if rrec is None or wrec is None or not isinstance(datum, dict):
        return
    writer_fields = {f["name"]: f for f in wrec["fields"]}
    for field_ in rrec["fields"]:
        name = field_["name"]
        matched = next(
            (writer_fields[n] for n in [name, *field_.get("aliases", [])] if n in writer_fields),
            None,
        )
        if matched is None:
            if "default" in field_:
                datum[name] = avro_default(field_["type"], datum.get(name), rnamed)
        elif datum.get(name) is not None:
            _convert_record(field_["type"], matched["type"], datum[name], rnamed, wnamed)


def avro_default(schema: Any, value: Any, named: dict[str, Any] | None = None) -> Any:
    """A field default in its JSON encoding -> the value a decoder returns for that type.

    Per the Avro specification: a union's default belongs to its first
    branch; bytes and fixed are strings whose code points 0-255 are the
    bytes; logical types (decimal, date, time-*, timestamp-*,
    local-timestamp-*, uuid) apply to the underlying value. A value that is
    already converted is returned unchanged.
    """
    named = named or {}
    if value is None:
        return None
    if isinstance(schema, list):
        return avro_default(schema[0], value, named)
    if isinstance(schema, str):
        if schema in named:
            return avro_default(named[schema], value, named)
        if schema == "bytes":
            return value.encode("latin-1") if isinstance(value, str) else value
        if schema in ("float", "double") and isinstance(value, int | float):
            return float(value)
        return value
    kind = schema.get("type")
    logical = schema.get("logicalType")
    if logical == "decimal" and kind in ("bytes", "fixed") and isinstance(value, str):
        unscaled = int.from_bytes(value.encode("latin-1"), "big", signed=True)
        return Decimal(unscaled).scaleb(-int(schema.get("scale", 0)))
    if logical == "date" and isinstance(value, int):
        return date(1970, 1, 1) + timedelta(days=value)
    if logical in ("time-micros", "time-millis") and isinstance(value, int):
        micros = value if logical == "time-micros" else value * 1000
        return (datetime(1970, 1, 1) + timedelta(microseconds=micros)).time()
    if logical in ("timestamp-micros", "timestamp-millis", "local-timestamp-micros",
                   "local-timestamp-millis") and isinstance(value, int):
        micros = value if logical.endswith("micros") else value * 1000
        instant = datetime(1970, 1, 1) + timedelta(microseconds=micros)
        return instant if logical.startswith("local") else instant.replace(tzinfo=UTC)
    if logical == "uuid" and isinstance(value, str):
        return uuid.UUID(value)
    if kind == "array" and isinstance(value, list):
        return [avro_default(schema["items"], item, named) for item in value]
    if kind == "map" and isinstance(value, dict):
        return {k: avro_default(schema["values"], v, named) for k, v in value.items()}
    if kind == "fixed" and isinstance(value, str):
        return value.encode("latin-1")
    if kind == "record" and isinstance(value, dict):
        return {
            f["name"]: avro_default(f["type"], value.get(f["name"], f.get("default")), named)
            for f in schema["fields"]
        }
    if isinstance(kind, str | list | dict) and kind not in ("record", "enum", "array", "map",
                                                            "fixed"):
        return avro_default(kind, value, named)
    return value
