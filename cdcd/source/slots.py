"""The replication slot's lifecycle: read, check, create, make failover, drop.

One concern: the logical slot cdcd streams from. :class:`SlotLifecycle` reads
its row of ``pg_replication_slots`` (:class:`SlotInfo`, and the few columns the
metrics sample, :class:`SlotHealth`), refuses a slot that cannot serve
(another plugin or database, invalidated: :class:`SlotLostError`), and creates
a missing one when allowed. Creating waits for every open transaction; what
it waits for is reported by :mod:`cdcd.source.slot_wait`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import psycopg2
import psycopg2.errors

from cdcd.errors import DefiniteError
from cdcd.protocol.lsn import Lsn
from cdcd.source.connection import (
    MetadataConnection,
    connect,
    first_line,
    query_failure,
    quote_ident,
)
from cdcd.source.slot_wait import wait_for_slot_creation
from cdcd.source.versions import (
    CONFLICTING_SINCE,
    has_failover_slots,
    has_two_phase_slots,
    has_wal_status,
)

log = logging.getLogger("cdcd.source")


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """A row of ``pg_replication_slots``; columns the server lacks are None/False."""

    name: str
    plugin: str
    database: str
    confirmed_flush_lsn: Lsn | None
    restart_lsn: Lsn | None
    wal_status: str | None  # 13+: reserved, extended, unreserved, lost
    two_phase: bool
    active_pid: int | None
    failover: bool = False  # 17+
    synced: bool = False  # 17+: synchronized from a primary (on a standby, or once promoted)
    temporary: bool = False
    invalidation_reason: str | None = None  # 17+: wal_removed, rows_removed, idle_timeout, ...
    conflicting: bool = False  # 16+: invalidated by a recovery conflict
    inactive_since: datetime | None = None  # 17+
    safe_wal_size: int | None = None  # 13+: bytes until the slot is at risk; None: unlimited

    @property
    def invalidated(self) -> bool:
        """Whether the server gave the slot up: it can never stream again."""
        return (
            self.invalidation_reason is not None
            or self.conflicting
            or self.wal_status == "lost"
            or self.confirmed_flush_lsn is None
        )


@dataclass(frozen=True, slots=True)
class SlotHealth:
    """What the metrics sample of the slot: retained WAL, its status, the server's limit."""

    retained_wal_bytes: int | None  # current WAL position minus restart_lsn
    wal_status: str | None
    wal_keep_size_bytes: int  # max_slot_wal_keep_size; -1 unlimited (or no such setting)
    inactive_since: datetime | None


#: What each ``pg_replication_slots.invalidation_reason`` means, for the one line of a lost slot.
_INVALIDATION_CAUSES = {
    "wal_removed": "the WAL it still needed was removed: it fell more than "
    "max_slot_wal_keep_size ({max_slot_wal_keep_size}) behind",
    "idle_timeout": "it stayed inactive longer than idle_replication_slot_timeout "
    "({idle_replication_slot_timeout})",
    "rows_removed": "catalog rows it needed were removed (a recovery conflict)",
    "wal_level_insufficient": "wal_level was lowered below logical",
}


class SlotLostError(DefiniteError):
    """The slot is invalidated, or missing where cdcd had used it: a gap nobody can replay.

    Never answered by creating a slot silently: changes made while it was
    lost would be skipped without a trace. ``cdcd resync`` is the way out.
    """


#: How ``cdcd run`` and ``cdcd check`` tell the operator out of a lost slot.
RESYNC_HINT = (
    "run 'cdcd resync -c <this config file>': it creates a new slot and re-snapshots every "
    "captured table, so consumers end equal to the tables (docs/failover.md)"
)


class SlotLifecycle(MetadataConnection):
    """The metadata connection's dealings with the slot; see the module docstring."""

    def slot_info(self, slot: str) -> SlotInfo | None:
        """The slot's row of ``pg_replication_slots`` (on the server connected to), or None."""
        version = self.server_version
        # Columns by version: 12 has no wal_status (nor max_slot_wal_keep_size:
        # it never loses a slot); conflicting is 16+, failover and the
        # invalidation reason 17+.
        newest = has_failover_slots(version)
        columns = [
            "slot_name",
            "plugin",
            "database",
            "confirmed_flush_lsn::text",
            "restart_lsn::text",
            "wal_status" if has_wal_status(version) else "NULL::text",
            "two_phase" if has_two_phase_slots(version) else "false",
            "active_pid",
            "failover" if newest else "false",
            "synced" if newest else "false",
            "temporary",
            "invalidation_reason" if newest else "NULL::text",
            "coalesce(conflicting, false)" if version >= CONFLICTING_SINCE else "false",
            "inactive_since" if newest else "NULL::timestamptz",
            "safe_wal_size" if has_wal_status(version) else "NULL::bigint",
        ]
        rows = self.query(
            f"SELECT {', '.join(columns)} FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        if not rows:
            return None
        (name, plugin, database, confirmed, restart, wal_status, tp, pid, failover, synced,
         temporary, reason, conflicting, inactive_since, safe_wal_size) = rows[0]
        return SlotInfo(
            name=name,
            plugin=plugin or "",
            database=database or "",
            confirmed_flush_lsn=Lsn.parse(confirmed) if confirmed else None,
            restart_lsn=Lsn.parse(restart) if restart else None,
            wal_status=wal_status,
            two_phase=bool(tp),
            active_pid=pid,
            failover=bool(failover),
            synced=bool(synced),
            temporary=bool(temporary),
            invalidation_reason=reason,
            conflicting=bool(conflicting),
            inactive_since=inactive_since,
            safe_wal_size=None if safe_wal_size is None else int(safe_wal_size),
        )

    def slot_health(self, slot: str) -> SlotHealth | None:
        """Retained WAL, wal_status and the server's limit, for the slot metrics (one query)."""
        version = self.server_version
        if not has_wal_status(version):
            # 12: no wal_status, no max_slot_wal_keep_size.
            sql = (
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, NULL::text, "
                "-1::bigint, NULL::timestamptz FROM pg_replication_slots WHERE slot_name = %s"
            )
        else:
            # In MB, -1 unlimited; a standby reports the position it replayed.
            inactive = "inactive_since" if has_failover_slots(version) else "NULL::timestamptz"
            sql = (
                "SELECT pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN "
                "pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, restart_lsn)::bigint, "
                "wal_status, (SELECT CASE WHEN setting::bigint < 0 THEN -1 "
                "ELSE setting::bigint * 1024 * 1024 END FROM pg_settings "
                f"WHERE name = 'max_slot_wal_keep_size'), {inactive} "
                "FROM pg_replication_slots WHERE slot_name = %s"
            )
        rows = self.query(sql, (slot,))
        if not rows:
            return None
        retained, wal_status, keep, inactive_since = rows[0]
        return SlotHealth(
            retained_wal_bytes=None if retained is None else int(retained),
            wal_status=wal_status,
            wal_keep_size_bytes=-1 if keep is None else int(keep),
            inactive_since=inactive_since,
        )

    def lost_slot_error(self, info: SlotInfo) -> SlotLostError:
        """The one line for an invalidated slot: why the server gave it up, and the way out."""
        if info.invalidation_reason is not None:
            reason = info.invalidation_reason
        elif info.conflicting:
            reason = "rows_removed"
        else:
            reason = "wal_removed"
        cause = _INVALIDATION_CAUSES.get(reason, "the server invalidated it")
        if "{" in cause:
            names = ("max_slot_wal_keep_size", "idle_replication_slot_timeout")
            values = {name: self._setting_or(name, "unset") for name in names if name in cause}
            cause = cause.format(**values)
        since = (
            f"the changes after {info.confirmed_flush_lsn} "
            if info.confirmed_flush_lsn is not None
            else "changes "
        )
        return SlotLostError(
            f"replication slot {info.name} was invalidated by PostgreSQL ({reason}: {cause}); "
            f"{since}can no longer be streamed from it",
            hint=RESYNC_HINT,
        )

    def _setting_or(self, name: str, default: str) -> str:
        rows = self.query("SELECT current_setting(%s, true)", (name,))
        value = rows[0][0] if rows else None
        return str(value) if value not in (None, "") else default

    def ensure_slot(
        self,
        slot: str,
        create: bool,
        two_phase: bool,
        *,
        failover: bool = False,
        beat: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> SlotInfo:
        """The slot, created if missing and allowed; verified to be usable.

        Creating it waits for every transaction open at that moment to end:
        ``wait_for_slot_creation`` logs what it waits for, keeps ``beat``
        going and gives up when ``stop`` is set. With ``failover`` (PostgreSQL
        17+) it is created as a failover slot, and an existing slot that is
        not one (made before, or by the initial snapshot's replication
        command) is turned into one.
        """
        info = self.slot_info(slot)
        if info is None:
            if not create:
                raise DefiniteError(
                    f"replication slot {slot} does not exist",
                    hint="set postgres.create_slot: true or create it with "
                    f"pg_create_logical_replication_slot('{slot}', 'pgoutput')",
                )
            self.create_slot(slot, two_phase, failover=failover, beat=beat, stop=stop)
            info = self.slot_info(slot)
            assert info is not None
        self.verify_slot(info, two_phase)
        if failover and not info.failover:
            self.set_failover(slot)
            info = replace(info, failover=True)
        return info

    def create_slot(
        self,
        slot: str,
        two_phase: bool,
        *,
        failover: bool = False,
        beat: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Create the logical slot (pgoutput), waiting as :meth:`ensure_slot` says.

        A slot created concurrently by another client is left for the caller to verify.
        """
        # Explained below: created concurrently, or the server cannot have slots.
        explained = (
            psycopg2.errors.DuplicateObject,
            psycopg2.errors.ObjectNotInPrerequisiteState,
        )
        # Only the arguments the server has: two_phase is 14+, failover 17+.
        if failover:
            sql = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s, true)"
            params: tuple[Any, ...] = (slot, two_phase)
        elif two_phase:
            sql = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)"
            params = (slot,)
        else:
            sql = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')"
            params = (slot,)

        def create() -> None:
            # Waits for every transaction open when it began: as long as they take.
            with self.unbounded():
                self.query(
                    sql, params, purpose=f"create replication slot {slot}", passthrough=explained
                )

        try:
            wait_for_slot_creation(
                create, conn=self.conn, dsn=self.dsn, slot=slot, beat=beat, stop=stop
            )
        except psycopg2.errors.DuplicateObject:
            pass  # created concurrently; the caller verifies it
        except psycopg2.errors.ObjectNotInPrerequisiteState as exc:
            raise DefiniteError(
                f"cannot create slot {slot}: {first_line(exc)}",
                hint="set wal_level = logical and max_replication_slots > 0, then restart",
            ) from exc
        log.info(
            "created replication slot %s%s", slot, " (failover)" if failover else "",
            extra={"slot": slot},
        )

    def set_failover(self, slot: str) -> None:
        """Make an existing slot a failover slot (PostgreSQL 17's ALTER_REPLICATION_SLOT).

        Only a walsender connection takes the command; the slot must not be in use.
        """
        conn = connect(self.dsn, replication=True)
        try:
            with conn.cursor() as cur:
                cur.execute(f"ALTER_REPLICATION_SLOT {quote_ident(slot)} (FAILOVER true)")
        except psycopg2.Error as exc:
            raise query_failure(
                exc, "ALTER_REPLICATION_SLOT", f"make slot {slot} a failover slot", self._user
            ) from exc
        finally:
            conn.close()
        log.info(
            "slot %s is now a failover slot (postgres.failover: true)", slot, extra={"slot": slot}
        )

    def verify_slot(self, info: SlotInfo, two_phase: bool) -> None:
        if info.plugin != "pgoutput":
            raise DefiniteError(
                f"slot {info.name} uses plugin {info.plugin or '(physical)'}, not pgoutput",
                hint="drop it or choose another postgres.slot",
            )
        if info.database != self.database:
            raise DefiniteError(
                f"slot {info.name} belongs to database {info.database}, not {self.database}",
                hint="choose another postgres.slot or connect to that database",
            )
        if info.invalidated:
            raise self.lost_slot_error(info)
        if two_phase and not info.two_phase:
            raise DefiniteError(
                f"slot {info.name} was created without two-phase support",
                hint="use postgres.protocol_version 1 or 2, or recreate the slot",
            )

    def drop_slot(self, slot: str) -> None:
        self.query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )
