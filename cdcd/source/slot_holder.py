"""Who holds a replication slot that another connection is streaming from.

A logical slot serves one consumer at a time: ``START_REPLICATION`` on a slot
that is active for another backend fails. ``cdcd run`` and ``cdcd check``
both name that backend from ``pg_stat_activity`` (PID, application_name,
client address, since when), so that the operator can tell a second cdcd on
the same slot from a leftover walsender or another tool.

Why transient and not definite: the holder may go away by itself (the
walsender of an earlier cdcd session that lost its connection lingers until
``wal_sender_timeout``; a restarted pod replaces the old one). So ``run``
retries with backoff, and at start gives up after the daemon's startup retry
window with this message and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cdcd.errors import TransientError
from cdcd.source.connection import MetadataConnection

__all__ = ["REMEDY", "SlotHolder", "SlotInUseError", "slot_holder", "slot_in_use"]

#: What the operator does about it; shared by ``run`` and ``check``.
REMEDY = "stop the other consumer (another cdcd on this slot?), or set postgres.slot to another slot"


@dataclass(frozen=True, slots=True)
class SlotHolder:
    """The backend a slot is active for, as ``pg_stat_activity`` shows it."""

    pid: int
    backend_type: str | None = None
    user: str | None = None
    application_name: str | None = None
    client_addr: str | None = None
    client_port: int | None = None
    backend_start: datetime | None = None
    visible: bool = False  # the backend's row was found

    def describe(self) -> str:
        """``PID 123 (walsender of user cdcd, application_name 'x', client 10.0.0.5:41234, since …)``."""
        if not self.visible:
            return f"PID {self.pid}"
        parts = [f"{self.backend_type or 'backend'}" + (f" of user {self.user}" if self.user else "")]
        parts.append(f"application_name {self.application_name!r}" if self.application_name
                     else "no application_name")
        if self.client_addr:
            parts.append(f"client {self.client_addr}:{self.client_port}")
        elif self.client_port == -1:
            parts.append("client on a local socket")
        else:
            # pg_stat_activity hides the address of other users' sessions.
            parts.append("client address hidden (needs pg_read_all_stats)")
        if self.backend_start is not None:
            parts.append(f"since {self.backend_start:%Y-%m-%d %H:%M:%S %Z}".rstrip())
        return f"PID {self.pid} ({', '.join(parts)})"


class SlotInUseError(TransientError):
    """The slot is active for another backend; ``hint`` says what to do if it stays so."""

    def __init__(self, message: str, hint: str = REMEDY) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}"


def slot_holder(db: MetadataConnection, pid: int) -> SlotHolder:
    """The backend ``pid`` from ``pg_stat_activity`` (only its PID if it is gone or hidden)."""
    rows = db.query(
        "SELECT backend_type, usename, application_name, host(client_addr), client_port, "
        "backend_start FROM pg_stat_activity WHERE pid = %s",
        (pid,),
    )
    if not rows:
        return SlotHolder(pid)
    backend_type, user, application, addr, port, started = rows[0]
    return SlotHolder(
        pid,
        backend_type=backend_type,
        user=user,
        application_name=application or None,
        client_addr=addr,
        client_port=port,
        backend_start=started,
        visible=True,
    )


def slot_in_use(slot: str, holder: SlotHolder) -> SlotInUseError:
    """The error ``run`` raises (and ``check`` reports) for a slot another backend streams from."""
    return SlotInUseError(
        f"slot {slot} is active for {holder.describe()}: another connection streams from it "
        "(another consumer, or an earlier connection of this cdcd the server has not closed yet) "
        "and a slot serves one at a time; cdcd retries until it is released"
    )
