"""Slot state by server version, and ``postgres.failover`` where the server lacks it.

``SourceDatabase.slot_info``/``slot_health`` read only the columns each
version has (wal_status 13+, conflicting 16+, failover and the invalidation
reason 17+); the multi-host DSN helpers of ``cdcd check``; and the one line
that refuses ``postgres.failover: true`` before PostgreSQL 17.
"""

from __future__ import annotations

import pytest
from support.cdc import run_cdcd
from support.pg import create_slot, require_version

from cdcd.errors import DefiniteError
from cdcd.pipeline.failover_readiness import dsn_servers, server_dsn
from cdcd.protocol.lsn import Lsn
from cdcd.source.database import SourceDatabase
from cdcd.source.slots import SlotInfo
from cdcd.source.versions import require_failover


def test_dsn_servers_pairs_hosts_and_ports() -> None:
    assert dsn_servers("host=a,b port=5432,5433 dbname=x") == [("a", "5432"), ("b", "5433")]
    assert dsn_servers("host=a,b port=6000 dbname=x") == [("a", "6000"), ("b", "6000")]
    assert dsn_servers("postgresql://u:p@h1:1,h2:2/db?target_session_attrs=read-write") == [
        ("h1", "1"),
        ("h2", "2"),
    ]
    narrowed = server_dsn("host=a,b port=1,2 dbname=x password='s p' "
                           "target_session_attrs=read-write", 1)
    assert "host=b" in narrowed and "port=2" in narrowed and "password='s p'" in narrowed
    assert "target_session_attrs=any" in narrowed


def test_invalidated_and_failover_refusal() -> None:
    healthy = SlotInfo("s", "pgoutput", "d", Lsn(10), Lsn(5), "reserved", False, None)
    assert not healthy.invalidated
    for lost in (
        SlotInfo("s", "pgoutput", "d", Lsn(10), None, "lost", False, None),
        SlotInfo("s", "pgoutput", "d", Lsn(10), None, None, False, None,
                 invalidation_reason="idle_timeout"),
        SlotInfo("s", "pgoutput", "d", Lsn(10), Lsn(5), "reserved", False, None, conflicting=True),
    ):
        assert lost.invalidated, lost
    require_failover(170000, True)
    require_failover(160004, False)
    with pytest.raises(DefiniteError) as refused:
        require_failover(160004, True)
    assert str(refused.value).startswith(
        "postgres.failover needs PostgreSQL 17 or newer (failover slots), but the server is "
        "PostgreSQL 16.4; set postgres.failover: false"
    )


@pytest.mark.integration
@pytest.mark.parametrize("version", [12, 13, 16])
def test_slot_state_on_older_servers(make_pg_cluster, version: int) -> None:
    require_version(version)
    cluster = make_pg_cluster(version=version)
    with cluster.connection() as conn:
        create_slot(conn, "s")  # the SQL function without the 14+ two-phase argument
    with SourceDatabase(cluster.dsn()) as db:
        info = db.slot_info("s")
        assert info is not None and not info.invalidated and not info.failover, info
        assert (info.wal_status is None) == (version < 13), info
        health = db.slot_health("s")
        assert health is not None and health.retained_wal_bytes is not None, health
        assert health.wal_keep_size_bytes == -1, health  # unlimited (12: no such setting)


@pytest.mark.integration
def test_failover_is_refused_in_one_line_before_17(pg, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    config = cdc_config(tables=["public.t"], postgres={"failover": True})
    daemon = daemons(config)
    assert daemon.wait(60) == 3, daemon.log()
    errors = [line for line in daemon.log().splitlines() if line.startswith("cdcd: error")]
    assert len(errors) == 1, daemon.log()
    assert "postgres.failover needs PostgreSQL 17 or newer" in errors[0], errors[0]
    assert not pg.fetchall("SELECT 1 FROM pg_replication_slots")
    check = run_cdcd("check", "-c", str(config))
    failed = [line for line in check.stdout.splitlines() if line.startswith("FAIL failover")]
    assert len(failed) == 1 and "needs PostgreSQL 17" in failed[0], check.stdout
