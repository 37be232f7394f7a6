"""Capture real pgoutput payloads from a PostgreSQL 15 walsender into ``golden/*.json``.

Run: ``.venv/bin/python -m tests.protocol.capture_golden [--out DIR]``.

It starts a throwaway cluster (``logical_decoding_work_mem=64kB`` so that
large transactions stream, ``max_prepared_transactions=10``), creates one
database with the tables of every scenario and a ``FOR ALL TABLES``
publication, then per scenario: creates a slot, runs the scenario's workload,
reads the slot through a ``LogicalReplicationConnection`` (the way cdcd reads
it) and writes ``<scenario>.json``::

    {"scenario": ..., "proto_version": N, "options": {...}, "note": ...,
     "server_version": ..., "dropped": K, "messages": [{"lsn": ..., "hex": ...}]}

``lsn`` is the XLogData start position the walsender reported; ``hex`` the
payload. Long streams are trimmed so that the files stay small: inside each
stream block only the first few row messages (Insert/Update/Delete) are kept;
everything else (block boundaries, Relation, Type, Truncate, Message, the
transaction boundaries) is kept, so a decoder still sees a well-formed
stream. ``dropped`` counts what was left out.

The structure is deterministic; LSNs, xids and timestamps differ per run.
Where a field can be pinned it is (the origin scenario sets the origin LSN
and commit timestamp), so tests can assert it exactly.

The trimming only looks at the tag byte of each payload (and tracks Stream
Start/Stop itself), so a broken ``cdcd.protocol`` decoder cannot corrupt the
capture.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2.extensions

from cdcd.tools.local.postgres import LocalPostgres
from cdcd.tools.local.workload import orders_ddl

# ``tests/support`` is imported as ``support.*`` (``tests/conftest.py`` puts
# ``tests/`` on sys.path); do the same when this runs as a script.
_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from support.pg import create_publication, create_slot, drop_slot, read_pgoutput  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
DATABASE = "golden"
PUBLICATION = "golden_pub"
CLUSTER_SETTINGS: dict[str, str | int] = {
    "logical_decoding_work_mem": "64kB",
    "max_prepared_transactions": 10,
}
#: Row messages kept per stream block; the rest of a block's rows are dropped.
ROWS_PER_STREAM_BLOCK = 3
#: Origin LSN and commit timestamp pinned by ``pg_replication_origin_xact_setup``.
ORIGIN_NAME = "cdcd_golden_origin"
ORIGIN_LSN = "0/ABCDEF"
ORIGIN_TS = "2024-01-02 03:04:05.678901+00"

_ROW_TAGS = frozenset(b"IUD")
_STREAM_START = ord("S")
_STREAM_STOP = ord("E")

# ----------------------------------------------------------------------------- schema

SCHEMA: tuple[str, ...] = (
    # basic: Begin/Commit, Insert, Update without and with a key change, Delete.
    """CREATE TABLE items(id int PRIMARY KEY, name text NOT NULL, price numeric(10,2),
        tags text[], added timestamptz)""",
    # replica identities other than the default.
    "CREATE TABLE ident_full(id int, v text)",
    "ALTER TABLE ident_full REPLICA IDENTITY FULL",
    "CREATE TABLE ident_index(id int PRIMARY KEY, code text NOT NULL, v text)",
    "CREATE UNIQUE INDEX ident_index_code ON ident_index(code)",
    "ALTER TABLE ident_index REPLICA IDENTITY USING INDEX ident_index_code",
    "CREATE TABLE ident_nothing(id int, v text)",
    "ALTER TABLE ident_nothing REPLICA IDENTITY NOTHING",
    # Type messages: an enum and a domain column.
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
    "CREATE TABLE typed(id int PRIMARY KEY, feeling mood, qty posint)",
    # Truncate: plain, RESTART IDENTITY + CASCADE on two tables, CASCADE pulling in a child.
    "CREATE TABLE trunc_plain(id serial PRIMARY KEY)",
    "CREATE TABLE trunc_parent(id serial PRIMARY KEY)",
    "CREATE TABLE trunc_child(id serial PRIMARY KEY, parent_id int REFERENCES trunc_parent)",
    # Logical decoding messages and Origin.
    "CREATE TABLE msg_log(id int PRIMARY KEY)",
    "CREATE TABLE origin_rows(id int PRIMARY KEY, v text)",
    f"SELECT pg_replication_origin_create('{ORIGIN_NAME}')",
    # Unchanged TOAST: an out-of-line value (EXTERNAL: no compression) left alone by an UPDATE.
    "CREATE TABLE toasty(id int PRIMARY KEY, body text, n int)",
    "ALTER TABLE toasty ALTER COLUMN body SET STORAGE EXTERNAL",
    "INSERT INTO toasty VALUES (1, repeat('0123456789', 400), 1)",
    # binary = true.
    """CREATE TABLE bin_rows(id int PRIMARY KEY, big bigint, amount numeric(12,2), ok boolean,
        at timestamptz, doc jsonb, note text, missing text)""",
    # Streaming (v2) and two-phase (v3).
    "CREATE TABLE stream_rows(id int PRIMARY KEY, pad text)",
    "CREATE TABLE stream_small(id int PRIMARY KEY)",
    "INSERT INTO stream_small VALUES (1)",
    "CREATE TABLE tp_rows(id int PRIMARY KEY, v text)",
    # The SPEC section 9 benchmark table (also used by tests/bench/bench_decode.py).
    orders_ddl(),
)

#: Enough rows of ~100 bytes to exceed logical_decoding_work_mem=64kB several times.
_BIG_INSERT = (
    "INSERT INTO stream_rows SELECT g, repeat('p', 80) || g FROM generate_series({lo}, {hi}) g"
)


@dataclass(frozen=True)
class Scenario:
    """One golden file: a workload and the pgoutput options it is read with."""

    name: str
    proto_version: int
    note: str
    workload: Sequence[str]
    streaming: bool = False
    two_phase: bool = False
    binary: bool = False
    messages: bool = False
    options: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "options",
            {
                "proto_version": self.proto_version,
                "streaming": self.streaming,
                "two_phase": self.two_phase,
                "binary": self.binary,
                "messages": self.messages,
            },
        )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "basic",
        1,
        "Begin/Relation/Insert x2/Commit; Update without old tuple; Update changing the "
        "primary key (old 'K'); Delete (old 'K'); default replica identity",
        (
            "BEGIN",
            "INSERT INTO items VALUES (1, 'widget', 9.99, '{a,b}', '2024-05-06 07:08:09+00')",
            "INSERT INTO items VALUES (2, 'gadget ☃', NULL, NULL, NULL)",
            "COMMIT",
            "UPDATE items SET price = 10.50 WHERE id = 1",
            "UPDATE items SET id = 3 WHERE id = 2",
            "DELETE FROM items WHERE id = 1",
        ),
    ),
    Scenario(
        "identity",
        1,
        "REPLICA IDENTITY FULL (Update and Delete with old 'O'), USING INDEX (Update changing "
        "the index column: old 'K' with only that column), NOTHING (Insert only)",
        (
            "INSERT INTO ident_full VALUES (1, 'one')",
            "UPDATE ident_full SET v = 'uno' WHERE id = 1",
            "DELETE FROM ident_full WHERE id = 1",
            "INSERT INTO ident_index VALUES (1, 'c1', 'x')",
            "UPDATE ident_index SET code = 'c2' WHERE id = 1",
            "DELETE FROM ident_index WHERE id = 1",
            "INSERT INTO ident_nothing VALUES (1, 'n')",
        ),
    ),
    Scenario(
        "types",
        1,
        "Type messages before the Relation of a table with an enum and a domain column",
        ("INSERT INTO typed VALUES (1, 'happy', 7)",),
    ),
    Scenario(
        "truncate",
        1,
        "TRUNCATE trunc_plain (options 0); TRUNCATE trunc_parent, trunc_child RESTART "
        "IDENTITY CASCADE (options 3); TRUNCATE trunc_parent CASCADE (options 1, child "
        "included by the cascade)",
        (
            "TRUNCATE trunc_plain",
            "TRUNCATE trunc_parent, trunc_child RESTART IDENTITY CASCADE",
            "TRUNCATE trunc_parent CASCADE",
        ),
    ),
    Scenario(
        "messages",
        1,
        "messages=true: a transactional message inside a transaction, then a "
        "non-transactional one (sent on its own, no Begin/Commit)",
        (
            "BEGIN",
            "SELECT pg_logical_emit_message(true, 'cdcd/tx', '\\x00ff0102'::bytea)",
            "INSERT INTO msg_log VALUES (1)",
            "COMMIT",
            "SELECT pg_logical_emit_message(false, 'cdcd/näive', 'plain text')",
        ),
        messages=True,
    ),
    Scenario(
        "origin",
        1,
        f"A transaction replayed under replication origin {ORIGIN_NAME!r}: Begin, Origin, "
        f"Relation, Insert, Commit; origin LSN {ORIGIN_LSN} and commit time {ORIGIN_TS} are "
        "pinned by pg_replication_origin_xact_setup",
        (
            f"SELECT pg_replication_origin_session_setup('{ORIGIN_NAME}')",
            "BEGIN",
            f"SELECT pg_replication_origin_xact_setup('{ORIGIN_LSN}', '{ORIGIN_TS}')",
            "INSERT INTO origin_rows VALUES (1, 'from elsewhere')",
            "COMMIT",
            "SELECT pg_replication_origin_session_reset()",
        ),
    ),
    Scenario(
        "toast",
        1,
        "UPDATE of a row whose out-of-line TOASTed body is unchanged: body is sent as 'u'",
        ("UPDATE toasty SET n = n + 1 WHERE id = 1",),
    ),
    Scenario(
        "binary",
        1,
        "binary=true: every non-null column is sent as 'b' (send/recv format), null as 'n'",
        (
            "INSERT INTO bin_rows VALUES (42, -9000000000, 1234.50, true, "
            "'2000-01-01 00:00:01+00', '{\"k\": 1}', 'hello', NULL)",
        ),
        binary=True,
    ),
    Scenario(
        "stream",
        2,
        "proto 2, streaming on, messages on: (1) a large committed transaction with a "
        "TRUNCATE and a transactional message at its end (Stream Start/Stop blocks, rows "
        "with xid, Stream Commit); (2) a large transaction rolled back (Stream Abort, "
        "subxid == xid); (3) a large subtransaction rolled back to its savepoint, then "
        "commit (Stream Abort of the subxid, Stream Commit). Row messages trimmed to "
        f"{ROWS_PER_STREAM_BLOCK} per block",
        (
            "BEGIN",
            _BIG_INSERT.format(lo=1, hi=3000),
            "TRUNCATE stream_small",
            "SELECT pg_logical_emit_message(true, 'cdcd/stream', 'inside a stream')",
            "COMMIT",
            "BEGIN",
            _BIG_INSERT.format(lo=10001, hi=13000),
            "ROLLBACK",
            "BEGIN",
            _BIG_INSERT.format(lo=20001, hi=20002),
            "SAVEPOINT s1",
            _BIG_INSERT.format(lo=20003, hi=23000),
            "ROLLBACK TO SAVEPOINT s1",
            _BIG_INSERT.format(lo=30001, hi=30002),
            "COMMIT",
        ),
        streaming=True,
        messages=True,
    ),
    Scenario(
        "two_phase",
        3,
        "proto 3, two_phase on, two-phase slot: PREPARE then COMMIT PREPARED (Begin Prepare, "
        "Relation, Insert, Prepare, Commit Prepared); PREPARE then ROLLBACK PREPARED "
        "(Begin Prepare, Insert, Prepare, Rollback Prepared)",
        (
            "BEGIN",
            "INSERT INTO tp_rows VALUES (1, 'kept')",
            "PREPARE TRANSACTION 'cdcd_gid_commit'",
            "COMMIT PREPARED 'cdcd_gid_commit'",
            "BEGIN",
            "INSERT INTO tp_rows VALUES (2, 'dropped')",
            "PREPARE TRANSACTION 'cdcd_gid_rollback'",
            "ROLLBACK PREPARED 'cdcd_gid_rollback'",
        ),
        two_phase=True,
    ),
    Scenario(
        "stream_prepare",
        3,
        "proto 3, streaming on, two_phase on: a large prepared transaction is streamed and "
        "ends with Stream Prepare, then Commit Prepared. Row messages trimmed to "
        f"{ROWS_PER_STREAM_BLOCK} per block",
        (
            "BEGIN",
            _BIG_INSERT.format(lo=40001, hi=43000),
            "PREPARE TRANSACTION 'cdcd_gid_stream'",
            "COMMIT PREPARED 'cdcd_gid_stream'",
        ),
        streaming=True,
        two_phase=True,
    ),
    Scenario(
        "orders",
        1,
        "SPEC section 9 orders rows: one transaction of 10 inserts (status 'shipped', md5 note, "
        "alternating flags, two-key jsonb payload); created_at is now() and varies per run",
        (
            """INSERT INTO orders(customer_id, status, amount, note, flags, payload)
            SELECT 1000 + g, 'shipped', round((g * 137.31)::numeric % 10000, 2),
                   md5('order ' || g), g % 2 = 0,
                   jsonb_build_object('sku', 'SKU-' || g, 'qty', g)
            FROM generate_series(1, 10) g""",
        ),
    ),
)


# ----------------------------------------------------------------------------- capture


def trim(
    payloads: Sequence[tuple[int, bytes]], rows_per_block: int
) -> tuple[list[tuple[int, bytes]], int]:
    """Drop row messages beyond ``rows_per_block`` in each stream block; return (kept, dropped)."""
    kept: list[tuple[int, bytes]] = []
    dropped = 0
    in_block = False
    rows = 0
    for lsn, payload in payloads:
        tag = payload[0] if payload else -1
        if tag == _STREAM_START:
            in_block, rows = True, 0
        elif tag == _STREAM_STOP:
            in_block = False
        elif in_block and tag in _ROW_TAGS:
            rows += 1
            if rows > rows_per_block:
                dropped += 1
                continue
        kept.append((lsn, payload))
    return kept, dropped


def _run_workload(conn: psycopg2.extensions.connection, statements: Sequence[str]) -> None:
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)


def capture_scenario(cluster: LocalPostgres, scenario: Scenario) -> dict[str, Any]:
    """Create a slot, run the workload, read the slot; return the golden document."""
    slot = f"golden_{scenario.name}"
    dsn = cluster.dsn(DATABASE)
    with cluster.connection(DATABASE) as conn:
        create_slot(conn, slot, two_phase=scenario.two_phase)
        try:
            _run_workload(conn, scenario.workload)
            # The walsender only decodes flushed WAL, and read_pgoutput reads up to
            # pg_current_wal_lsn(). PostgreSQL 15 does not flush a non-transactional
            # logical message by itself (nor the commit of a transaction that wrote no
            # WAL), so without this the trailing message of "messages" is missed.
            _run_workload(conn, ["CHECKPOINT"])
            payloads = read_pgoutput(
                dsn,
                slot,
                PUBLICATION,
                proto_version=scenario.proto_version,
                streaming=scenario.streaming,
                two_phase=scenario.two_phase,
                binary=scenario.binary,
                messages=scenario.messages,
                timeout_s=60.0,
            )
        finally:
            drop_slot(conn, slot)
        with conn.cursor() as cur:
            cur.execute("SELECT version()")
            row = cur.fetchone()
            assert row is not None
            server_version = str(row[0])
    kept, dropped = trim(payloads, ROWS_PER_STREAM_BLOCK)
    return {
        "scenario": scenario.name,
        "proto_version": scenario.proto_version,
        "options": scenario.options,
        "note": scenario.note,
        "server_version": server_version,
        "dropped": dropped,
        "messages": [{"lsn": _lsn_text(lsn), "hex": payload.hex()} for lsn, payload in kept],
    }


def _lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:08X}"


def prepare_database(cluster: LocalPostgres) -> None:
    """Create the golden database, every scenario's tables and the publication."""
    cluster.create_database(DATABASE)
    with cluster.connection(DATABASE) as conn:
        _run_workload(conn, SCHEMA)
        create_publication(conn, PUBLICATION)


@contextmanager
def _cluster(cluster: LocalPostgres | None) -> Iterator[LocalPostgres]:
    if cluster is not None:
        yield cluster
        return
    with LocalPostgres.start(settings=CLUSTER_SETTINGS) as own:
        yield own


def capture_all(
    out_dir: Path,
    cluster: LocalPostgres | None = None,
    scenarios: Sequence[Scenario] = SCENARIOS,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Capture every scenario into ``out_dir/<name>.json``; return the documents by name.

    ``cluster`` must have been started with :data:`CLUSTER_SETTINGS` and not
    have a ``golden`` database yet; by default a throwaway one is started and
    removed afterwards.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    documents: dict[str, dict[str, Any]] = {}
    with _cluster(cluster) as pg:
        prepare_database(pg)
        for scenario in scenarios:
            started = time.monotonic()
            document = capture_scenario(pg, scenario)
            path = out_dir / f"{scenario.name}.json"
            path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", "utf-8")
            documents[scenario.name] = document
            tags = Counter(chr(int(m["hex"][:2], 16)) for m in document["messages"])
            log(
                f"{scenario.name:15s} {len(document['messages']):4d} kept "
                f"{document['dropped']:5d} dropped  {time.monotonic() - started:5.2f}s  "
                + " ".join(f"{tag}:{count}" for tag, count in sorted(tags.items()))
            )
    return documents


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR, help="output directory")
    args = parser.parse_args(argv)
    started = time.monotonic()
    capture_all(args.out)
    total = sum(p.stat().st_size for p in args.out.glob("*.json"))
    print(f"wrote {args.out} ({total / 1024:.1f} KiB) in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
