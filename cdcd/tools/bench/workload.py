"""The bench's side of the database: names, the seeded ``orders`` load, slots and LSN waits.

Also where PostgreSQL and the broker come from (:func:`environment`): the
ones given on the command line, or throwaway ones cleaned up after.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg2

from cdcd.errors import DefiniteError
from cdcd.tools.bench.arguments import SNAPSHOT_CONNECTIONS as SNAPSHOT_CONNECTIONS
from cdcd.tools.local.workload import orders_ddl

SCHEMA = "cdcd_bench"
PUBLICATION = "cdcd_bench"
CEILING_SLOT = "cdcd_bench_ceiling"
CDCD_SLOT = "cdcd_bench_cdcd"
SYNC_SLOT = "cdcd_bench_sync"
SYNC_PUBLICATION = "cdcd_bench_sync"
BIG_SLOT = "cdcd_bench_big"
SNAPSHOT_SLOT = "cdcd_bench_snapshot"
#: A copy of the ceiling slot, made before the load, that only the decode
#: ceiling peeks at (never consumed).
PEEK_SLOT = "cdcd_bench_peek"
#: pgoutput options of both server-side ceilings (``pg_recvlogical`` and the
#: peek): the same text decoding for the same publication.
PGOUTPUT_OPTIONS = (("proto_version", "1"), ("publication_names", PUBLICATION))
TOPIC_PREFIX = "cdcd_bench"
#: application_name of the bench's own connections.
BENCH_APPLICATION = "cdcd_bench"
#: The walsender serving a slot.
SLOT_PID_SQL = "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND active_pid IS NOT NULL"
#: Every server process of this database but the bench's own connections.
DATABASE_PIDS_SQL = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND application_name <> %s"
)


#: Ten rows of the SPEC §9 shape; ``g`` numbers the rows of the whole load.
TEN_ROWS = f"""
INSERT INTO {SCHEMA}.orders(customer_id, status, amount, note, flags, payload)
SELECT (random() * 1000000)::int, 'shipped', round((random() * 10000)::numeric, 2),
       md5(g::text), g % 2 = 0, jsonb_build_object('sku', 'SKU-' || g, 'qty', g % 7)
FROM generate_series(__FROM__, __FROM__ + 9) g
"""

def progress(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


@contextmanager
def environment(args: argparse.Namespace) -> Iterator[tuple[str, str, Path]]:
    """(dsn, bootstrap servers, bindir): given ones, or throwaway ones cleaned up after."""
    from cdcd.tools.local import LocalBroker, LocalPostgres, find_bindir

    cluster = broker = None
    try:
        if args.dsn:
            dsn = args.dsn
            bindir = find_bindir()
        else:
            progress("starting a throwaway PostgreSQL 15 (fsync on)", args.json)
            cluster = LocalPostgres.start(
                settings={"fsync": "on", "max_wal_size": "4GB", "shared_buffers": "256MB"}
            )
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            bindir = cluster.bindir
        if args.bootstrap_servers:
            bootstrap = args.bootstrap_servers
        else:
            progress("starting the bundled broker", args.json)
            broker = LocalBroker.start()
            bootstrap = broker.bootstrap_servers
        yield dsn, bootstrap, bindir
    finally:
        if broker is not None:
            broker.cleanup()
        if cluster is not None:
            cluster.cleanup()


def connect(dsn: str) -> Any:
    # Named, so that the server CPU of a phase leaves the bench's own connections out.
    conn = psycopg2.connect(dsn, application_name=BENCH_APPLICATION)
    conn.autocommit = True
    return conn


def _lsn(conn: Any, sql: str, params: Any = None) -> int:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        row = cur.fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _confirmed(conn: Any, slot: str) -> int:
    return _lsn(
        conn,
        "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )


def current_lsn(conn: Any) -> int:
    """The end of the WAL written so far, once it is flushed.

    The load commits with ``synchronous_commit=off``: right after it, the
    write position may still lie before its last commit records, and a
    consumer could be confirmed past that position (idle keepalives) before
    it even decoded them. The insert position includes every commit
    returned so far; waiting for the flush to reach it makes that WAL
    visible to the walsenders.
    """
    insert = _lsn(conn, "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
    while _lsn(conn, "SELECT pg_current_wal_flush_lsn() - '0/0'::pg_lsn") < insert:
        time.sleep(0.01)
    return insert


def drop_slot(conn: Any, slot: str, timeout_s: float = 60.0) -> None:
    """Drop ``slot`` if it exists, once no walsender holds it.

    A session that just stopped closed its replication connection, but the
    walsender exits on its own time: dropping before would fail (in use).
    """
    deadline = time.monotonic() + timeout_s
    with conn.cursor() as cur:
        while True:
            cur.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            )
            row = cur.fetchone()
            if row is None:
                return
            if row[0] is None:
                break
            if time.monotonic() > deadline:
                raise DefiniteError(f"slot {slot} is still in use by process {row[0]}")
            time.sleep(0.02)
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )


def prepare(conn: Any) -> None:
    with conn.cursor() as cur:
        for slot in (CEILING_SLOT, CDCD_SLOT, PEEK_SLOT, BIG_SLOT, SNAPSHOT_SLOT, SYNC_SLOT):
            drop_slot(conn, slot)
        cur.execute(f"DROP PUBLICATION IF EXISTS {SYNC_PUBLICATION}")
        cur.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
        cur.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        cur.execute(f"CREATE SCHEMA {SCHEMA}")
        cur.execute(orders_ddl(f"{SCHEMA}.orders"))
        cur.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {SCHEMA}.orders")
        for slot in (CEILING_SLOT, CDCD_SLOT):
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        # Before the load, like the others: the peek decodes the same WAL.
        cur.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (CEILING_SLOT, PEEK_SLOT))


def load(dsn: str, rows: int, seed: int, quiet: bool) -> float:
    """``rows`` rows in transactions of 10, seeded; returns seconds."""
    conn = connect(dsn)
    started = time.monotonic()
    try:
        with conn.cursor() as cur:
            cur.execute("SET synchronous_commit = off")
            cur.execute("SELECT setseed(%s)", (((seed % 1000) / 1000.0),))
            batch = 10_000  # rows per DO block, committed every 10 rows inside it
            for first in range(1, rows + 1, batch):
                count = min(batch, rows - first + 1) // 10
                body = TEN_ROWS.replace("__FROM__", f"({first} + i * 10)")
                cur.execute(
                    f"DO $$ BEGIN FOR i IN 0..{count - 1} LOOP {body}; COMMIT; END LOOP; END $$"
                )
                if first % 200_000 == 1:
                    progress(f"loaded {first - 1:,} / {rows:,} rows", quiet)
    finally:
        conn.close()
    return time.monotonic() - started

def wait_confirmed(
    conn: Any, slot: str, target: int, timeout_s: float, check: Any = None
) -> float:
    """Wait for the slot to confirm ``target``; ``check()`` raises if the consumer died."""
    started = time.monotonic()
    while _confirmed(conn, slot) < target:
        if time.monotonic() - started > timeout_s:
            raise DefiniteError(f"slot {slot} did not reach the end of the load in {timeout_s} s")
        if check is not None:
            check()
        time.sleep(0.02)
    return time.monotonic()
