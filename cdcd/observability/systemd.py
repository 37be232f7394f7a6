"""sd_notify(3) without libsystemd: readiness, watchdog and status for ``Type=notify``.

Why not the ``systemd`` Python bindings: the protocol is one datagram of
``KEY=value`` lines to the unix socket named by ``$NOTIFY_SOCKET``, and a C
binding would be a hard dependency for a feature that is off everywhere except
under systemd. Every function is a no-op (returning ``False``) when
``$NOTIFY_SOCKET`` is unset, so the daemon calls them unconditionally.

A failed send is logged, not raised: systemd then acts on its own (start
timeout, watchdog kill), which is the right outcome for a daemon that cannot
talk to its supervisor, and the log line says why.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

__all__ = [
    "Watchdog",
    "notify",
    "notify_ready",
    "notify_status",
    "notify_stopping",
    "notify_watchdog",
    "watchdog_interval_s",
]

log = logging.getLogger(__name__)


def _socket_address(environ: Mapping[str, str]) -> str | bytes | None:
    path = environ.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):
        # Linux abstract namespace: a leading NUL instead of a file system path.
        return b"\0" + path[1:].encode()
    if path.startswith("/"):
        return path
    log.warning("ignoring NOTIFY_SOCKET=%r: neither an absolute path nor @abstract", path)
    return None


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (``KEY=value`` lines) to systemd; ``True`` if it was sent."""
    address = _socket_address(os.environ if environ is None else environ)
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc, extra={"notify_state": state.split("=", 1)[0]})
        return False
    return True


def notify_ready(status: str | None = None) -> bool:
    """Tell systemd start-up is complete (``READY=1``), optionally with a status line."""
    state = "READY=1"
    if status:
        state += "\nSTATUS=" + _one_line(status)
    return notify(state)


def notify_watchdog() -> bool:
    """Reset systemd's watchdog timer (``WATCHDOG=1``); see ``Watchdog`` for pacing."""
    return notify("WATCHDOG=1")


def notify_stopping(status: str | None = None) -> bool:
    """Tell systemd the daemon is draining (``STOPPING=1``), so it waits for the stop timeout."""
    state = "STOPPING=1"
    if status:
        state += "\nSTATUS=" + _one_line(status)
    return notify(state)


def notify_status(text: str) -> bool:
    """Set the free-form status shown by ``systemctl status`` (one line)."""
    return notify("STATUS=" + _one_line(text))


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``$WATCHDOG_USEC``, or ``None`` if off.

    Half, as sd_watchdog_enabled(3) recommends, so one late ping does not get
    the daemon killed. ``$WATCHDOG_PID``, when set, must be this process:
    the variables are inherited by children that must not ping for us.
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2_000_000


class Watchdog:
    """Paces ``WATCHDOG=1`` from the main loop: ``kick()`` every iteration, cheap when early.

    Call it from the same loop that calls ``Health.beat()``: a loop that stops
    iterating stops pinging, and systemd restarts the daemon after
    ``WatchdogSec``.
    """

    def __init__(
        self,
        interval_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[], bool] = notify_watchdog,
    ) -> None:
        self.interval_s = watchdog_interval_s() if interval_s is None else interval_s
        self._clock = clock
        self._send = send
        self._next = clock()

    @property
    def enabled(self) -> bool:
        """Whether systemd asked for watchdog pings."""
        return self.interval_s is not None

    def kick(self) -> bool:
        """Ping if the interval has elapsed; ``True`` when a ping was sent."""
        if self.interval_s is None:
            return False
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return self._send()


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value assignment in the datagram.
    return " ".join(text.split())
