"""Every supported PostgreSQL (12 to 18) at its highest protocol: replay equals the tables.

One test per version does everything once, so the matrix costs one cluster
and two daemon starts per version:

* an incremental snapshot of three tables whose rows existed before the slot
  (so the replay can only equal the tables if every chunk arrived), while a
  mixed workload writes to the same tables -- its watermarks are logical
  messages on 14+ and rows of cdcd's signal table on 12 and 13, whose
  pgoutput has no messages;
* a mixed workload (tests/support/workload.py: inserts, updates, key
  changes, deletes, rollbacks, rolled-back savepoints) all along;
* a large committed and a large aborted transaction (streamed before their
  end from protocol v2 on, ``logical_decoding_work_mem=64kB`` where it
  exists);
* prepared transactions, one committed, one rolled back (two-phase decoding
  from protocol v3 on);
* ``kill -9`` of the daemon while it works, and a restart;
* heartbeats counted by ``cdcd_heartbeats_total`` (they travel through the
  stream on every version).

Then every topic is read, replayed in (``cdcd.lsn``, ``cdcd.seq``) order and
compared with ``SELECT``; nothing of an aborted transaction may be in it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from decimal import Decimal
from typing import Any

import pytest
from support.cdc import read_changes, replay, run_cdcd, wait_for, wait_streaming, wait_wal_confirmed
from support.workload import ABORTED, KEYS, UNDONE, Workload, table_rows

from cdcd.tools.local.postgres import free_port

from .conftest import MATRIX, VersionCluster

pytestmark = pytest.mark.integration

TABLES = ("accounts", "items", "ledger")
SEED_ROWS = 600
CHUNK_ROWS = 25
BIG_ROWS = 2000


def _normalize(row: dict[str, Any]) -> dict[str, Any]:
    return {k: Decimal(v) if k == "amount" and isinstance(v, str) else v for k, v in row.items()}


def _seed(conn: Any) -> None:
    """Rows older than the slot: only the incremental snapshot can publish them."""
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO accounts SELECT g, 'seed', g / 100.0, 'seed' "
            "FROM generate_series(100000, 100000 + %s) g",
            (SEED_ROWS,),
        )
        cur.execute(
            "INSERT INTO items SELECT 'seed-' || g, g %% 3, g, ARRAY['seed'] "
            "FROM generate_series(1, %s) g",
            (SEED_ROWS,),
        )
        cur.execute(
            "INSERT INTO ledger(account, amount, memo) SELECT g, g * 1.5, 'seed' "
            "FROM generate_series(1, %s) g",
            (SEED_ROWS,),
        )


def _big_transactions(conn: Any) -> None:
    """A large committed and a large aborted transaction (streamed on v2+).

    Inserts only: the workload updates random rows, and a wide UPDATE here
    could deadlock with it.
    """
    conn.autocommit = False
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO ledger(account, amount, memo) SELECT g, g, 'big-' || repeat('x', 200) "
            "FROM generate_series(1, %s) g",
            (BIG_ROWS,),
        )
    conn.commit()
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO ledger(account, amount, memo) SELECT g, g, %s "
            "FROM generate_series(1, %s) g",
            (ABORTED, BIG_ROWS),
        )
    conn.rollback()
    conn.autocommit = True


def _prepared(conn: Any, gid: str, commit: bool) -> None:
    with conn.cursor() as cur:
        marker = gid if commit else ABORTED
        cur.execute("BEGIN")
        cur.execute("INSERT INTO accounts VALUES (%s, 'prepared', 1, %s)", (9_000_000 + len(gid), marker))
        cur.execute("UPDATE items SET qty = qty + 1000 WHERE sku = 'seed-1'")
        cur.execute("PREPARE TRANSACTION %s", (gid,))
        cur.execute(f"{'COMMIT' if commit else 'ROLLBACK'} PREPARED %s", (gid,))


def _job(pg: Any) -> dict[str, Any] | None:
    row = pg.fetchone("SELECT status, progress FROM cdcd_signal WHERE id = 'matrix'")
    if row is None:
        return None
    progress = row[1] if isinstance(row[1], dict) else json.loads(row[1])
    return {"status": row[0], **progress}


def _heartbeats(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("cdcd_heartbeats_total "):
            return float(line.split()[1])
    return 0.0


def test_every_version_streams_snapshots_and_survives_kill9(
    version_pg: VersionCluster, vdb, vconfig, broker, daemons
) -> None:
    started = time.monotonic()
    conn = vdb.connect()
    workload = Workload(seed=version_pg.version)
    workload.create(conn)
    _seed(conn)
    slot = "cdcd_" + vdb.dbname[:50]
    port = free_port()
    config = vconfig(
        tables=[f"public.{t}" for t in TABLES],
        extra={
            "snapshot": {"mode": "never", "chunk_rows": CHUNK_ROWS},
            "heartbeat": {"interval_s": 0.5},
            "metrics": {"listen": f"127.0.0.1:{port}"},
        },
    )
    daemon = daemons(config)
    wait_streaming(vdb, slot, daemon)
    # The signal table is created at startup (schema_changes.resnapshot auto).
    wait_for(lambda: vdb.fetchall("SELECT 1 FROM pg_tables WHERE tablename = 'cdcd_signal'"),
             what="the signal table")
    vdb.execute(
        "INSERT INTO cdcd_signal (id, type, data) VALUES ('matrix', 'execute-snapshot', %s)",
        (json.dumps({"data-collections": [f"public.{t}" for t in TABLES]}),),
    )

    with workload.writing(vdb.connect(), pause_s=0.01):
        _big_transactions(vdb.connect())
        # Decoded at PREPARE from protocol v3 on (held until COMMIT PREPARED),
        # at COMMIT PREPARED before.
        _prepared(vdb.connect(), "matrix-commit", commit=True)
        _prepared(vdb.connect(), "matrix-rollback", commit=False)
        # Killed once a chunk is delivered (progress is saved only then), so
        # the restart resumes the snapshot from the signal table -- or after
        # it finished, which is just as valid a moment for a crash.
        wait_for(
            lambda: (job := _job(vdb)) is not None
            and (job["status"] == "done" or int(job.get("chunks") or 0) >= 1),
            what="the first snapshot chunk to be delivered",
        )
        wait_for(lambda: _heartbeats(port) > 0, what="a heartbeat")
        daemon.kill9()
        # Written while no daemon runs: the slot keeps it.
        _big_transactions(vdb.connect())
        daemon = daemons(config)
        wait_for(lambda: (job := _job(vdb)) is not None and job["status"] == "done",
                 timeout_s=120, what="the snapshot job to finish")
        wait_for(lambda: workload.committed >= 30, what="30 workload transactions")
    wait_wal_confirmed(conn, slot, timeout_s=120)
    wait_for(lambda: _heartbeats(port) > 0, what="a heartbeat after the restart")
    if version_pg.protocol >= 2:
        # The large transactions really were streamed before their end.
        wait_for(lambda: (vdb.fetchone("SELECT stream_txns FROM pg_stat_replication_slots "
                                       "WHERE slot_name = %s", (slot,)) or (0,))[0] >= 2,
                 what="streamed transactions in pg_stat_replication_slots")
    assert daemon.terminate() == 0, daemon.log()
    assert workload.aborted > 0 or workload.committed < 50

    prefix = vdb.dbname
    for table in TABLES:
        changes = read_changes(broker.bootstrap_servers, prefix, [f"{prefix}.public.{table}"])
        for change in changes:
            for row in (change.value["before"], change.value["after"]) if change.value else ():
                assert not (row and (row.get("note") in (ABORTED, UNDONE)
                                     or row.get("memo") in (ABORTED, UNDONE))), (table, row)
        assert any(c.value and c.value["op"] == "r" for c in changes), f"{table}: no snapshot rows"
        mirrored = {k: _normalize(v) for k, v in replay(changes, KEYS[table]).items()}
        expected = {k: _normalize(v) for k, v in table_rows(conn, table).items()}
        assert mirrored == expected, f"{table}: replay differs from the table"
    print(f"PostgreSQL {version_pg.version} protocol v{version_pg.protocol}: "
          f"{workload.committed} transactions, {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize(
    "version_pg", [v for v, protocol in MATRIX.items() if protocol < 4], indirect=True,
    ids=lambda v: f"pg{v}",
)
def test_a_protocol_the_server_lacks_is_refused_in_one_line(
    version_pg: VersionCluster, vdb, vconfig, daemons
) -> None:
    vdb.execute("CREATE TABLE t(id int PRIMARY KEY)")
    too_high = version_pg.protocol + 1
    config = vconfig(tables=["public.t"], postgres={"protocol_version": too_high})
    daemon = daemons(config)
    assert daemon.wait(60) == 3, daemon.log()
    errors = [line for line in daemon.log().splitlines() if line.startswith("cdcd: error")]
    assert len(errors) == 1, daemon.log()
    assert f"postgres.protocol_version {too_high} needs PostgreSQL" in errors[0], errors[0]
    assert f"the server is PostgreSQL {version_pg.version}." in errors[0], errors[0]
    assert f"set postgres.protocol_version to {version_pg.protocol}" in errors[0], errors[0]
    # Refused before anything was made in the source database.
    assert not vdb.fetchall("SELECT 1 FROM pg_replication_slots")
    assert not vdb.fetchall("SELECT 1 FROM pg_publication")

    check = run_cdcd("check", "-c", str(config))
    failed = [line for line in check.stdout.splitlines() if line.startswith("FAIL protocol_version")]
    assert len(failed) == 1 and f"PostgreSQL {version_pg.version}." in failed[0], check.stdout
