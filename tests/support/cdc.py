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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import yaml
from confluent_kafka.admin import AdminClient

from support.kafka import consume_all

PROJECT_ROOT = Path(__file__).resolve().parents[2]


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
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class DaemonProcess:
    """``python -m cdcd run -c FILE`` as a child process, killable at will."""

    def __init__(self, config: Path, log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "-c", str(config)],
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

    def load(self, bootstrap: str, prefix: str) -> None:
        for message in consume_all(bootstrap, f"{prefix}._schemas", timeout_s=15, idle_s=1.0):
            self.schemas[message.key().decode()] = fastavro.parse_schema(
                json.loads(message.value())
            )

    def decode(self, data: bytes | None) -> dict[str, Any] | None:
        if data is None:
            return None
        assert data[:2] == b"\xc3\x01", f"not single-object encoded: {data[:10]!r}"
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
    book = SchemaBook()
    book.load(bootstrap, prefix)
    out = []
    messages = consume_all(bootstrap, topic_list, timeout_s=timeout_s, expected=expected, idle_s=idle_s)
    for message in messages:
        headers = _headers(message)
        out.append(
            Change(
                topic=message.topic(),
                partition=message.partition(),
                offset=message.offset(),
                lsn=_lsn(headers["cdcd.lsn"].decode()),
                seq=int(headers["cdcd.seq"]),
                key=book.decode(message.key()),
                value=book.decode(message.value()),
            )
        )
    return out


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
