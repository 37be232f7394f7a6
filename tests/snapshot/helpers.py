"""Shared pieces of the snapshot tests: the SPEC §9 ``orders`` table, a writer, comparisons."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2.extensions
from support.cdc import Change, read_changes, replay, wait_for
from support.cdc import wait_streaming as support_wait_streaming
from support.pg import PgDatabase, current_wal_lsn, slot_confirmed_flush_lsn

from cdcd.tools.local.process import pid_alive, proc_stat_fields
from cdcd.tools.local.workload import orders_ddl


class BackgroundWrites:
    """A thread that runs :meth:`write` on a connection of its own until :meth:`finish`.

    :meth:`write` loops until ``self.stop`` is set; whatever it raises is
    raised again by :meth:`finish`, in the test's thread.
    """

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.stop = threading.Event()
        self.failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def write(self, conn: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        conn = self.pg.connect()
        try:
            self.write(conn)
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            self.failure.append(exc)
        finally:
            conn.close()

    def start(self) -> BackgroundWrites:
        self._thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        self._thread.join(30)
        if self.failure:
            raise self.failure[0]


def create_orders(conn: psycopg2.extensions.connection, rows: int, table: str = "orders") -> None:
    """The SPEC §9 table with ``rows`` rows (ids 1..rows), some notes with COPY escapes."""
    with conn.cursor() as cur:
        cur.execute(orders_ddl(table))
        cur.execute(
            f"INSERT INTO {table}(customer_id, status, amount, note, flags, payload) "
            "SELECT (g::int8 * 7919) %% 100000, 'shipped', ((g * 31) %% 100000) / 100.0, "
            "CASE WHEN g %% 97 = 0 THEN E'tab\\there\\nnew line \\\\ back' "
            "WHEN g %% 89 = 0 THEN NULL ELSE md5(g::text) END, "
            "CASE WHEN g %% 5 = 0 THEN NULL ELSE g %% 2 = 0 END, "
            "jsonb_build_object('a', g, 'b', 'x\\y') FROM generate_series(1, %s) g",
            (rows,),
        )
        cur.execute(f"ANALYZE {table}")


def normalize(row: dict[str, Any]) -> dict[str, Any]:
    """Values from psycopg2 and from fastavro in one comparable form."""
    out: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, dict | list) and name == "payload":
            value = json.dumps(value, sort_keys=True)
        elif name == "payload" and isinstance(value, str):
            value = json.dumps(json.loads(value), sort_keys=True)
        elif isinstance(value, memoryview):
            value = bytes(value)
        elif isinstance(value, Decimal):
            value = value.normalize()
        out[name] = value
    return out


def table_state(conn: psycopg2.extensions.connection, table: str, key: str = "id") -> dict[Any, dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table}")
        names = [d[0] for d in cur.description]
        return {r[names.index(key)]: normalize(dict(zip(names, r, strict=True))) for r in cur.fetchall()}


def mirrored(changes: list[Change], key: str = "id") -> dict[Any, dict[str, Any]]:
    return {k[0]: normalize(v) for k, v in replay(changes, (key,)).items()}


def wait_caught_up(pg: PgDatabase, slot: str, timeout_s: float = 120) -> None:
    conn = pg.connect()
    target = current_wal_lsn(conn)
    wait_for(lambda: slot_confirmed_flush_lsn(conn, slot) >= target, timeout_s=timeout_s,
             what="the daemon to confirm everything written")


def wait_streaming(pg: PgDatabase, slot: str, timeout_s: float = 120, daemon: Any = None) -> None:
    """Until a walsender streams from ``slot``; with ``daemon``, an AssertionError with the
    end of its log as soon as it exits instead (not after ``timeout_s``)."""
    support_wait_streaming(pg, slot, daemon, timeout_s)


def topic_changes(broker_servers: str, prefix: str, table: str = "orders",
                  expected: int | None = None) -> list[Change]:
    return read_changes(broker_servers, prefix, [f"{prefix}.public.{table}"], expected=expected,
                        timeout_s=180, idle_s=3.0)


class Writer(BackgroundWrites):
    """Concurrent single-row transactions against ``orders``: inserts, updates, deletes."""

    def __init__(
        self, pg: PgDatabase, max_id: int, seed: int = 1, pause_s: float = 0.0, table: str = "orders"
    ) -> None:
        super().__init__(pg)
        self.max_id = max_id
        self.seed = seed
        self.pause_s = pause_s
        self.table = table
        self.counts = {"c": 0, "u": 0, "d": 0}

    def write(self, conn: Any) -> None:
        conn.autocommit = True
        rng = random.Random(self.seed)
        with conn.cursor() as cur:
            while not self.stop.is_set():
                choice = rng.random()
                key = rng.randrange(1, self.max_id + 1)
                if choice < 0.2:
                    cur.execute(
                        f"INSERT INTO {self.table}(customer_id, status, amount, note, flags, "
                        "payload) VALUES (%s, 'new', %s, 'inserted', true, '{\"w\": 1}')",
                        (rng.randrange(1000), rng.randrange(100000) / 100),
                    )
                    self.counts["c"] += 1
                elif choice < 0.75:
                    cur.execute(
                        f"UPDATE {self.table} SET status = 'updated', amount = amount + 1, "
                        "note = %s WHERE id = %s",
                        (f"u{rng.randrange(10**6)}", key),
                    )
                    self.counts["u"] += 1
                else:
                    cur.execute(f"DELETE FROM {self.table} WHERE id = %s", (key,))
                    self.counts["d"] += 1
                if self.pause_s:
                    time.sleep(self.pause_s)


def when(predicate: Callable[[], Any], timeout_s: float = 120, what: str = "") -> Any:
    return wait_for(predicate, timeout_s=timeout_s, interval_s=0.1, what=what)


def signal_row(pg: PgDatabase, job_id: str) -> tuple[str, dict[str, Any]] | None:
    """(status, progress) of a signal table row, None while the table or the row is missing."""
    if pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None:  # type: ignore[index]
        return None
    row = pg.fetchone("SELECT status, progress FROM cdcd_signal WHERE id = %s", (job_id,))
    return (row[0], row[1]) if row else None


def child_pids(pid: int) -> list[int]:
    """The live children of process ``pid`` (from ``/proc``): a daemon's snapshot workers."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid and pid_alive(int(entry.name)):
                children.append(int(entry.name))
    return children
