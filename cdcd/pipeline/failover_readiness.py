"""Will the slot survive a promotion? ``cdcd check``'s advice with ``postgres.failover``.

``run`` acts on none of this (the startup plan only refuses a server without
failover slots); these lines say what PostgreSQL 17 needs, on the primary and
on each other server of the DSN, to keep a synchronized copy of the slot
(docs/failover.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from psycopg2.extensions import make_dsn, parse_dsn

from cdcd.config.model import CdcdConfig
from cdcd.errors import CdcdError
from cdcd.pipeline.startup import Finding
from cdcd.source.database import SourceDatabase
from cdcd.source.slots import SlotInfo
from cdcd.source.versions import has_failover_slots

__all__ = ["dsn_servers", "failover_readiness", "server_dsn"]


def dsn_servers(dsn: str) -> list[tuple[str, str]]:
    """The ``(host, port)`` pairs a (multi-host) DSN lists, as libpq pairs them."""
    params = parse_dsn(dsn)
    hosts = (params.get("host") or params.get("hostaddr") or "").split(",")
    ports = (params.get("port") or "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    return [(host, port or "5432") for host, port in zip(hosts, ports, strict=False)]


def server_dsn(dsn: str, index: int) -> str:
    """The DSN narrowed to its ``index``-th server, whatever role that server has."""
    params = parse_dsn(dsn)
    for key in ("host", "hostaddr", "port"):
        values = (params.get(key) or "").split(",")
        if len(values) > 1:
            params[key] = values[index]
    params["target_session_attrs"] = "any"
    return str(make_dsn(**params))


def _identity(db: SourceDatabase) -> tuple[Any, ...]:
    """What tells two connections to one server from connections to two servers."""
    rows = db.query("SELECT pg_postmaster_start_time(), current_setting('port')")
    return tuple(rows[0])


def _names(setting: str) -> list[str]:
    """Slot names of a list setting; slot names are [a-z0-9_], so quotes only wrap them."""
    return [name.strip().replace('"', "") for name in setting.split(",") if name.strip()]


def failover_readiness(config: CdcdConfig, db: SourceDatabase) -> Iterator[Finding]:
    """With ``postgres.failover``: is the slot going to survive a promotion, and if not, why.

    On the primary: ``synchronized_standby_slots`` and the standbys' physical
    slots. On each other server of the DSN (and for each standby
    ``pg_stat_replication`` shows): what PostgreSQL 17 needs to synchronize
    the slot there (docs/failover.md).
    """
    pg = config.postgres
    if not pg.failover or not has_failover_slots(db.server_version):
        return  # the plan's failover step refuses a server without failover slots
    servers = dsn_servers(pg.dsn.get_secret_value())
    attrs = parse_dsn(pg.dsn.get_secret_value()).get("target_session_attrs", "any")
    if len(servers) < 2:
        yield Finding(
            False,
            "failover: postgres.dsn names one server, so after a promotion cdcd cannot reach the "
            "new primary; list the standbys too, with target_session_attrs=read-write "
            "(host=primary,standby port=5432,5432 ... target_session_attrs=read-write)",
        )
    elif attrs not in ("read-write", "primary"):
        yield Finding(
            False,
            f"failover: postgres.dsn lists {len(servers)} servers with target_session_attrs="
            f"{attrs}: libpq may connect to a standby, where cdcd cannot stream; add "
            "target_session_attrs=read-write",
        )
    here = f"{db.conn.info.host}:{db.conn.info.port}"
    if len(servers) >= 2 and attrs in ("read-write", "primary"):
        yield Finding(
            True,
            f"failover: postgres.dsn lists {len(servers)} servers (target_session_attrs={attrs}); "
            f"the primary now: {here}",
        )
    physical = {
        str(name): (bool(active), reason)
        for name, active, reason in db.query(
            "SELECT slot_name, active, coalesce(invalidation_reason, wal_status) "
            "FROM pg_replication_slots WHERE slot_type = 'physical'"
        )
    }
    standby_slots = _names(db.setting("synchronized_standby_slots"))
    if not standby_slots:
        named = ", ".join(sorted(physical)) or "<the standby's slot>"
        yield Finding(
            False,
            f"failover: synchronized_standby_slots is empty on the primary ({here}): cdcd may be "
            "sent changes a standby has not received, and after its promotion the slot would be "
            "ahead of its data; set it to the physical slots of the standbys that may be "
            f"promoted: ALTER SYSTEM SET synchronized_standby_slots = '{named}'; "
            "SELECT pg_reload_conf()",
        )
    for name in standby_slots:
        state = physical.get(name)
        if state is None:
            yield Finding(
                False,
                f"failover: synchronized_standby_slots names {name}, which is no physical slot "
                f"on the primary ({here}): the primary holds back every change for cdcd until "
                "it exists; create it for the standby (its primary_slot_name) or remove the name",
            )
        elif state[1] == "lost" or (state[1] or "").endswith("removed"):
            yield Finding(
                False,
                f"failover: standby slot {name} is invalidated ({state[1]}): the primary holds "
                "back every change for cdcd; rebuild that standby, or remove the name from "
                "synchronized_standby_slots",
            )
        elif not state[0]:
            yield Finding(
                False,
                f"failover: standby slot {name} is not in use (its standby is down or not "
                "streaming): the primary holds back every change for cdcd until that standby "
                "confirms it; start the standby, or remove the name from "
                "synchronized_standby_slots",
            )
        else:
            yield Finding(True, f"failover: standby slot {name} is in use and waited for")
    if not physical:
        yield Finding(
            False,
            f"failover: no physical replication slot on the primary ({here}): a standby "
            "synchronizes failover slots only while it streams through one; "
            "SELECT pg_create_physical_replication_slot('<name>') and set primary_slot_name "
            "on the standby",
        )
    primary_slot = db.slot_info(pg.slot)
    checked: set[str] = set()
    for index, (host, port) in enumerate(servers if len(servers) > 1 else ()):
        where = f"{host}:{port}"
        if where == here:
            continue
        yield from _standby_checks(
            config, server_dsn(pg.dsn.get_secret_value(), index), where, physical, standby_slots, primary_slot,
            checked, _identity(db),
        )
    for app, address, slot in db.query(
        "SELECT r.application_name, host(r.client_addr), s.slot_name FROM pg_stat_replication r "
        "LEFT JOIN pg_replication_slots s ON s.active_pid = r.pid "
        "WHERE s.slot_type IS DISTINCT FROM 'logical'"
    ):
        if slot is not None and slot in checked:
            continue
        who = f"standby {app or '(no application_name)'} at {address or 'a local socket'}"
        if slot is None:
            yield Finding(
                False,
                f"failover: {who} streams from the primary without a physical slot: it cannot "
                "synchronize the slot; create one and set its primary_slot_name",
            )
        else:
            yield Finding(
                False,
                f"failover: {who} (slot {slot}) is not in postgres.dsn's host list: its settings "
                "are unchecked and cdcd cannot follow a promotion to it; add it to host= "
                "(and port=)",
            )


def _standby_checks(
    config: CdcdConfig,
    dsn: str,
    where: str,
    physical: dict[str, tuple[bool, str | None]],
    standby_slots: list[str],
    primary_slot: SlotInfo | None,
    checked: set[str],
    primary: tuple[Any, ...],
) -> Iterator[Finding]:
    """What one other server of the DSN lacks to keep a synchronized copy of the slot."""
    pg = config.postgres
    label = f"failover: standby {where}"
    try:
        sdb = SourceDatabase(dsn, timeout_s=pg.connect_timeout_s)
    except CdcdError as exc:
        yield Finding(False, f"{label}: cannot connect ({exc}), so its settings are unchecked")
        return
    with sdb:
        if not sdb.scalar("SELECT pg_is_in_recovery()"):
            if _identity(sdb) == primary:
                return  # the primary under another name (a socket, an alias)
            yield Finding(
                False,
                f"{label}: is not a standby but a primary too (a split brain?); cdcd connects to "
                "whichever libpq finds first",
            )
            return
        problems: list[str] = []
        settings = dict(
            sdb.query(
                "SELECT name, setting FROM pg_settings WHERE name IN ('sync_replication_slots', "
                "'hot_standby_feedback', 'primary_slot_name', 'wal_level', "
                "'synchronized_standby_slots')"
            )
        )
        if settings.get("sync_replication_slots") != "on":
            problems.append(
                "sync_replication_slots is off, so the slot is not synchronized to it: "
                "ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf()"
            )
        if settings.get("hot_standby_feedback") != "on":
            problems.append(
                "hot_standby_feedback is off, so the primary may remove catalog rows the "
                "synchronized slot needs (and slot synchronization does not run): "
                "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf()"
            )
        if settings.get("wal_level") != "logical":
            problems.append(
                f"wal_level is {settings.get('wal_level')}: a standby keeps logical slots only "
                "with wal_level = logical (restart needed)"
            )
        own = settings.get("primary_slot_name") or ""
        if not own:
            problems.append(
                "primary_slot_name is not set, so it streams without a physical slot and cannot "
                "synchronize the slot: create a physical slot on the primary and set "
                "primary_slot_name to it"
            )
        else:
            checked.add(own)
            if own not in physical:
                problems.append(
                    f"its primary_slot_name {own} is no physical slot on the primary: "
                    f"SELECT pg_create_physical_replication_slot('{own}') on the primary"
                )
            elif own not in standby_slots:
                problems.append(
                    f"its slot {own} is not in the primary's synchronized_standby_slots, so "
                    "cdcd may be sent changes it has not received: add it there"
                )
        try:
            conninfo = str(sdb.scalar("SELECT current_setting('primary_conninfo')") or "")
            if not parse_dsn(conninfo).get("dbname"):
                problems.append(
                    "primary_conninfo names no dbname, which the slot sync worker needs: add "
                    "dbname=<a database> to primary_conninfo"
                )
        except CdcdError as exc:
            problems.append(
                f"cannot read primary_conninfo ({exc}); grant pg_read_all_settings to cdcd's "
                "user to have it checked"
            )
        stale = _names(settings.get("synchronized_standby_slots") or "")
        present = {
            str(r[0]) for r in sdb.query("SELECT slot_name FROM pg_replication_slots")
        }
        missing = [name for name in stale if name not in present]
        if missing:
            problems.append(
                f"its own synchronized_standby_slots names {', '.join(missing)}, which do not "
                "exist on it (copied with the primary's configuration?): once promoted it would "
                "hold back every change for cdcd; ALTER SYSTEM RESET synchronized_standby_slots "
                "on it (set it again for its own standbys after a promotion)"
            )
        for problem in problems:
            yield Finding(False, f"{label}: {problem}")
        synced = sdb.slot_info(pg.slot)
        if synced is None:
            if primary_slot is not None and primary_slot.failover:
                yield Finding(
                    False,
                    f"{label}: slot {pg.slot} is not synchronized to it (yet); a promotion now "
                    "would lose it",
                )
            elif not problems:
                yield Finding(
                    True, f"{label}: ready to synchronize slot {pg.slot} once it is a failover slot"
                )
        elif synced.invalidated:
            yield Finding(
                False,
                f"{label}: its synchronized copy of slot {pg.slot} is invalidated; a promotion "
                "would need 'cdcd resync'",
            )
        elif synced.temporary:
            yield Finding(
                False,
                f"{label}: its copy of slot {pg.slot} is still temporary (the standby has not "
                "caught up with the slot's position yet): a promotion now would drop it",
            )
        elif not problems:
            yield Finding(
                True,
                f"{label}: slot {pg.slot} synchronized (confirmed {synced.confirmed_flush_lsn})",
            )
