"""End to end: PostgreSQL -> daemon -> broker -> ``cdcd mirror --once`` -> Delta == tables.

A seeded random workload over tables with every SPEC §5 type and arrays
(:mod:`spark.alltypes`), with the daemon killed with SIGKILL mid-stream
(twice), each time at a moment when Kafka holds a transaction beyond the
slot's confirmed position, so the topics certainly hold replayed duplicates
(see :func:`_crash_with_replay`). ``cdcd mirror --once`` runs
twice (in this process, on the shared Spark session): after the first stretch, then after
``ALTER TABLE ... ADD COLUMN``, more changes, ``DROP COLUMN``, a
``TRUNCATE`` and more changes -- so the second run applies to an existing
mirror, evolves its schema and resumes from its checkpoint. After each run
every table's Delta table equals the source table, row for row and value
for value, read with deltalake and compared typed with a psycopg2 SELECT.
``cdcd mirror`` killed with SIGKILL is tests/spark/test_mirror_crash.py.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from support.cdc import DaemonProcess, read_changes, wait_for, wait_streaming
from support.kafka import consume_all
from support.pg import (
    PgDatabase,
    current_wal_lsn,
    int_to_lsn,
    lsn_to_int,
    slot_confirmed_flush_lsn,
)

from spark.alltypes import KEYS, TypesWorkload, differences, mirror_rows

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pa = pytest.importorskip("pyarrow")

TABLES = tuple(KEYS)


#: Crash attempts per stretch. One almost always suffices (the daemon reports
#: progress at most every 0.2 s, so acknowledged transactions usually wait
#: for their status update); each failed attempt lets more be written first.
CRASH_ATTEMPTS = 20
#: Transactions the writer commits before the first attempt, and between attempts.
FIRST_ATTEMPT_AFTER = 10
BETWEEN_ATTEMPTS = 5


class _Writer:
    """Runs transactions in a thread: at least ``minimum``, and on until :meth:`finish`.

    Writing on until the crash has happened means a crash attempt always has
    new transactions to catch, however fast or slow the machine is.
    """

    def __init__(self, pg: PgDatabase, workload: TypesWorkload, minimum: int) -> None:
        self._conn = pg.connect()
        self._conn.autocommit = False
        self._workload = workload
        self._minimum = minimum
        self._finish = threading.Event()
        self._done = threading.Event()
        self.committed = 0
        self.failure: list[psycopg2.Error] = []
        self._thread = threading.Thread(target=self._write, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _write(self) -> None:
        try:
            while self.committed < self._minimum or not self._finish.is_set():
                self._workload.transaction(self._conn)
                self.committed += 1
                time.sleep(0.004)  # pacing only: the daemon streams while the writer writes
        except psycopg2.Error as exc:  # reported by the test thread
            self.failure.append(exc)
        finally:
            self._done.set()

    def wait_committed(self, count: int) -> None:
        wait_for(
            lambda: self.committed >= count or self._done.is_set(),
            timeout_s=120,
            what=f"the writer to commit {count} transactions",
        )
        if self.failure:
            raise self.failure[0]
        assert self.committed >= count, f"the writer stopped after {self.committed} transactions"

    def finish(self) -> int:
        """Stop after the minimum; return how many transactions were committed."""
        self._finish.set()
        self._thread.join(120)
        assert self._done.is_set(), "the workload did not finish"
        if self.failure:
            raise self.failure[0]
        return self.committed


def _positions_in_kafka(bootstrap: str, prefix: str) -> set[tuple[str, int, int]]:
    """(topic, cdcd.lsn, cdcd.seq) of every table-topic message read now.

    The read ends when the topics stay quiet, not at the high watermark (tansu
    reports it wrong, see tests/support/kafka.py). Missing a late message
    only makes the caller's claim more conservative: every position returned
    is really in Kafka.
    """
    positions = set()
    topics = [f"{prefix}.public.{t}" for t in TABLES]
    for message in consume_all(bootstrap, topics, timeout_s=60, idle_s=1.0):
        headers: dict[str, Any] = dict(message.headers() or [])
        lsn = lsn_to_int(headers["cdcd.lsn"].decode())
        positions.add((str(message.topic()), lsn, int(headers["cdcd.seq"])))
    return positions


def _slot_released(conn: Any, slot: str) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        row = cur.fetchone()
    conn.commit()
    return row is not None and row[0] is None


def _crash_with_replay(
    pg: PgDatabase,
    bootstrap: str,
    slot: str,
    daemon: DaemonProcess,
    start_daemon: Callable[[], DaemonProcess],
    writer: _Writer,
) -> tuple[DaemonProcess, set[tuple[str, int, int]]]:
    """SIGKILL the daemon at a moment when the restart must replay something.

    PostgreSQL restarts decoding at the slot's ``confirmed_flush_lsn`` and
    replays every transaction whose commit record starts at or after it; the
    daemon stamps each message with that commit LSN (``cdcd.lsn``). So a
    message in Kafka with ``cdcd.lsn >= confirmed_flush_lsn`` at the moment
    the walsender lets go of the slot is certain to be published again.

    The daemon is frozen (SIGSTOP) first, so it can neither produce nor
    confirm while the slot and Kafka are compared. A status update it wrote
    just before the freeze may still sit in the walsender's socket and move
    the slot on afterwards -- even after the SIGKILL, since the walsender
    reads what was sent before the connection's end. The walsender is gone
    once the slot has no ``active_pid``; only then is the confirmed position
    final, and the condition is checked against that value. If it fails
    (nothing beyond it), the daemon restarts and another attempt follows
    when more has been written.

    Returns the new daemon and the positions the restart must duplicate.
    """
    conn = pg.connect()
    writer.wait_committed(FIRST_ATTEMPT_AFTER)
    for attempt in range(1, CRASH_ATTEMPTS + 1):
        if attempt > 1:  # counted from now: the writer ran on while the daemon was frozen
            writer.wait_committed(writer.committed + BETWEEN_ATTEMPTS)
        daemon.freeze()
        written = writer.committed
        try:
            confirmed = slot_confirmed_flush_lsn(conn, slot)
            held = _positions_in_kafka(bootstrap, pg.dbname)
        except BaseException:
            daemon.thaw()
            raise
        if not any(lsn >= confirmed for _, lsn, _ in held):
            daemon.thaw()  # everything in Kafka is confirmed: no replay to provoke yet
            print(f"crash attempt {attempt}: Kafka held nothing beyond {int_to_lsn(confirmed)}")
            continue
        daemon.kill9()
        wait_for(lambda: _slot_released(conn, slot), timeout_s=60, what="the walsender to exit")
        final = slot_confirmed_flush_lsn(conn, slot)
        replayed = {p for p in held if p[1] >= final}
        daemon = start_daemon()
        transactions = len({lsn for _, lsn, _ in replayed})
        print(
            f"crash attempt {attempt} after {written} transactions: confirmed "
            f"{int_to_lsn(confirmed)} when frozen, {int_to_lsn(final)} final; Kafka held "
            f"{transactions} transactions ({len(replayed)} messages) beyond it"
        )
        if replayed:
            return daemon, replayed
    raise AssertionError(
        f"no crash in {CRASH_ATTEMPTS} attempts found a transaction in Kafka beyond the slot's "
        "confirmed position: the daemon confirmed every acknowledged transaction at once"
    )


def _write_with_a_crash(
    pg: PgDatabase,
    workload: TypesWorkload,
    transactions: int,
    bootstrap: str,
    slot: str,
    daemon: DaemonProcess,
    start_daemon: Callable[[], DaemonProcess],
) -> tuple[DaemonProcess, set[tuple[str, int, int]]]:
    """Run at least ``transactions`` in a thread; crash and restart the daemon meanwhile."""
    writer = _Writer(pg, workload, transactions)
    writer.start()
    try:
        daemon, replayed = _crash_with_replay(pg, bootstrap, slot, daemon, start_daemon, writer)
    finally:
        writer.finish()
    return daemon, replayed


def _wait_confirmed(pg: PgDatabase, slot: str) -> None:
    conn = pg.connect()
    target = current_wal_lsn(conn)
    wait_for(
        lambda: slot_confirmed_flush_lsn(conn, slot) >= target,
        timeout_s=120,
        what="the daemon to confirm the whole workload",
    )


def _assert_mirrored(pg: PgDatabase, output: Path) -> None:
    conn = pg.connect()
    problems = [p for table in TABLES for p in differences(conn, output, table)]
    assert not problems, "\n".join(problems)


def test_mirror_once_equals_every_table(
    pg: PgDatabase,
    broker: Any,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirror_once: Callable[[Path, Path], float],
    tmp_path: Path,
) -> None:
    conn = pg.connect()
    workload = TypesWorkload(seed=20261121)
    workload.create(conn)
    config = cdc_config(tables=[f"public.{t}" for t in TABLES])
    slot = "cdcd_" + pg.dbname[:50]
    output = tmp_path / "mirror"

    def start() -> DaemonProcess:
        return daemons(config)

    daemon = start()
    wait_streaming(pg, slot, daemon)

    # Stretch 1: every type, unchanged TOAST, key changes, a crash.
    bootstrap = broker.bootstrap_servers
    daemon, replayed = _write_with_a_crash(pg, workload, 150, bootstrap, slot, daemon, start)
    _wait_confirmed(pg, slot)
    first_s = mirror_once(config, output)
    _assert_mirrored(pg, output)

    # Stretch 2: the schema changes, a truncate, another crash.
    writer = pg.connect()
    writer.autocommit = False
    workload.add_columns(conn)
    workload.run(writer, 20)
    daemon, replayed_again = _write_with_a_crash(pg, workload, 80, bootstrap, slot, daemon, start)
    workload.drop_columns(conn)
    workload.run(writer, 20)
    workload.truncate_events(conn)
    workload.run(writer, 40)
    workload.touch_all_tables(writer)
    _wait_confirmed(pg, slot)
    assert daemon.terminate() == 0, daemon.log()
    second_s = mirror_once(config, output)
    _assert_mirrored(pg, output)

    # The run really had duplicates to cope with, and every kind of statement.
    prefix = pg.dbname
    positions = Counter(
        (c.topic, c.lsn, c.seq)
        for c in read_changes(
            broker.bootstrap_servers, prefix, [f"{prefix}.public.{t}" for t in TABLES]
        )
    )
    duplicates = sum(n - 1 for n in positions.values() if n > 1)
    for statement in ("kitchen update, doc unchanged", "kitchen primary key change", "logbook update",
                      "logbook delete", "arrays delete", "truncate"):  # fmt: skip
        assert workload.statements.get(statement, 0) > 0, workload.statements

    _, _, schema = mirror_rows(output, "kitchen")
    types = {name: schema.field(name).type for name in schema.names}
    assert types["c_timestamptz"] == pa.timestamp("us", tz="UTC")
    assert types["c_timestamp"] == pa.timestamp("us")
    assert types["c_date"] == pa.date32()
    assert types["c_time"] == pa.int64()
    assert types["c_numeric"] == pa.decimal128(12, 2)
    assert types["c_numeric_wide"] == pa.string()  # more digits than Spark's decimal holds
    assert types["c_float4"] == pa.float32()
    assert types["c_bytea"] == pa.binary()
    assert "c_money" not in types and types["extra_n"] == pa.int64()
    _, _, array_schema = mirror_rows(output, "arrays")
    assert array_schema.field("a_grid").type == pa.list_(pa.list_(pa.int32()))
    assert array_schema.field("a_numeric").type == pa.list_(pa.decimal128(10, 3))
    print(
        f"statements={dict(workload.statements)} duplicates={duplicates} "
        f"mirror runs: {first_s:.1f} s, {second_s:.1f} s"
    )
    # Each crash left messages in Kafka beyond the slot's final confirmed
    # position; the restart published them again, and both mirror runs coped.
    for crash, held in (("first", replayed), ("second", replayed_again)):
        missing = sorted(p for p in held if positions[p] < 2)
        assert not missing, f"not replayed after the {crash} crash: {missing[:3]} of {len(missing)}"
    assert duplicates >= len(replayed) + len(replayed_again) > 0
