"""cdcd as a synchronous standby: what ``synchronous_standby_names`` and the server say.

PostgreSQL matches ``synchronous_standby_names`` against the
``application_name`` of each streaming walsender, logical ones included,
case-insensitively, with ``*`` matching every walsender (docs/synchronous.md).
This module reads the setting (``FIRST n (…)``, ``ANY n (…)``, ``n (…)`` or a
plain list), finds the entry that names cdcd's replication connection, and
asks ``pg_stat_replication`` how the server counts the walsender serving the
slot. Used by ``cdcd check`` and by the session for
``cdcd_synchronous_standby``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cdcd.source.connection import MetadataConnection

#: ``pg_stat_replication.sync_state`` values that make commits wait for cdcd.
COUNTED_STATES = frozenset({"sync", "quorum"})

_PRIORITY = re.compile(r"^\s*(?:(FIRST|ANY)\s+)?(\d+)\s*\((.*)\)\s*$", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class StandbyNames:
    """A parsed ``synchronous_standby_names``."""

    method: str  # "FIRST" or "ANY"
    count: int
    names: tuple[str, ...]

    def entry_for(self, application_name: str) -> str | None:
        """The entry that names ``application_name``: its name, ``*``, or None."""
        for name in self.names:
            if name.lower() == application_name.lower():
                return name
        return "*" if "*" in self.names else None


def _split_names(text: str) -> tuple[str, ...]:
    """Comma-separated names; a double-quoted one keeps commas and ``""`` is a quote."""
    names: list[str] = []
    current: list[str] = []
    quoted = False
    i = 0
    while i < len(text):
        char = text[i]
        if quoted:
            if char == '"' and text[i + 1 : i + 2] == '"':
                current.append('"')
                i += 1
            elif char == '"':
                quoted = False
            else:
                current.append(char)
        elif char == '"':
            quoted = True
        elif char == ",":
            names.append("".join(current).strip())
            current = []
        else:
            current.append(char)
        i += 1
    names.append("".join(current).strip())
    return tuple(name for name in names if name)


def parse_standby_names(setting: str) -> StandbyNames | None:
    """``synchronous_standby_names`` parsed; None when it is empty (no synchronous standby)."""
    if not setting.strip():
        return None
    match = _PRIORITY.match(setting)
    if match is None:  # "a, b": the first one listed and connected is the synchronous standby
        return StandbyNames("FIRST", 1, _split_names(setting))
    method = (match.group(1) or "FIRST").upper()
    return StandbyNames(method, int(match.group(2)), _split_names(match.group(3)))


@dataclass(frozen=True)
class SyncStatus:
    """How the server treats cdcd's walsender as a standby."""

    setting: str
    names: StandbyNames | None
    entry: str | None  # the entry that names cdcd ("*" included), None: not named
    sync_state: str | None  # of the walsender serving the slot; None: nobody streams from it

    @property
    def counted(self) -> bool:
        """PostgreSQL counts cdcd as synchronous now: commits wait for its confirmation."""
        return self.sync_state in COUNTED_STATES


def walsender_sync_state(db: MetadataConnection, slot: str) -> str | None:
    """``pg_stat_replication.sync_state`` of the walsender streaming from ``slot``."""
    rows = db.query(
        "SELECT r.sync_state FROM pg_stat_replication r "
        "JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = %s",
        (slot,),
    )
    return str(rows[0][0]) if rows and rows[0][0] is not None else None


def sync_status(db: MetadataConnection, slot: str, application_name: str) -> SyncStatus:
    setting = db.setting("synchronous_standby_names") or ""
    names = parse_standby_names(setting)
    entry = names.entry_for(application_name) if names is not None else None
    return SyncStatus(setting, names, entry, walsender_sync_state(db, slot))
