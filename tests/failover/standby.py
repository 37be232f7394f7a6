"""A physical standby of a throwaway cluster, built the low-level way.

Debian's ``pg_basebackup`` (15) refuses newer servers and the npm builds ship
none, so the copy is the documented low-level base backup:
``pg_backup_start``, a file copy of the data directory, ``pg_backup_stop``
(whose label file becomes ``backup_label``), ``standby.signal``. The
standby is a ``LocalPostgres`` of its own (from ``make_pg_cluster``), so the
fixture stops and removes it like any other cluster: its own data directory
is replaced by the copy, keeping its ``cdcd_local.conf`` (port, socket and the
standby settings given here) and its ``postgresql.auto.conf``, so nothing set
with ALTER SYSTEM on the primary travels (INFRA.md: a promoted standby that
inherited ``synchronized_standby_slots`` would hold back every change).
"""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Callable, Mapping

from cdcd.tools.local.postgres import LocalPostgres, SettingValue

#: The primary's files a standby must not get (its own are kept or rebuilt).
_NOT_COPIED = {"postmaster.pid", "postmaster.opts", "cdcd_local.conf", "postgresql.auto.conf"}
#: Directories copied empty: the standby streams WAL from the primary's slot.
_EMPTY_DIRS = {"pg_wal", "pg_replslot"}


def standby_settings(primary: LocalPostgres, slot: str, dbname: str) -> dict[str, SettingValue]:
    """What PostgreSQL 17 needs on a standby to synchronize failover slots."""
    return {
        "primary_conninfo": f"host={primary.host} port={primary.port} user=postgres "
        f"dbname={dbname} application_name={slot}",
        "primary_slot_name": slot,
        "hot_standby_feedback": "on",
        "sync_replication_slots": "on",
    }


def build_standby(
    make_pg_cluster: Callable[..., LocalPostgres],
    primary: LocalPostgres,
    slot: str,
    settings: Mapping[str, SettingValue],
) -> LocalPostgres:
    """Start a streaming standby of ``primary`` through physical slot ``slot`` (created here)."""
    standby = make_pg_cluster(settings=dict(settings), version=primary.version)
    standby.stop()
    primary.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
    target = standby.datadir
    for entry in target.iterdir():
        if entry.name in _NOT_COPIED:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    with primary.connection() as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_backup_start('cdcd-test-standby', true)")
        for entry in primary.datadir.iterdir():
            if entry.name in _NOT_COPIED:
                continue
            if entry.name in _EMPTY_DIRS:
                (target / entry.name).mkdir()
            elif entry.is_dir():
                shutil.copytree(entry, target / entry.name)
            else:
                shutil.copy2(entry, target / entry.name)
        cur.execute("SELECT labelfile FROM pg_backup_stop(true)")
        (target / "backup_label").write_text(cur.fetchone()[0])
    (target / "pg_wal" / "archive_status").mkdir()
    (target / "standby.signal").write_text("")
    if os.geteuid() == 0:  # the server runs as postgres (LocalPostgres)
        owner = pwd.getpwnam("postgres")
        for root, dirs, files in os.walk(target):
            for name in dirs + files:
                os.chown(os.path.join(root, name), owner.pw_uid, owner.pw_gid)
    standby.start_again()
    return standby
