"""What both throwaway servers share: their lifetime in this process, and ``/proc`` reads.

A server object is cleaned up by ``with`` or at interpreter exit, but only in
the process that created it: a forked child inherits the atexit registration
and must not stop its parent's servers.
"""

from __future__ import annotations

import atexit
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self


def proc_stat_fields(pid: int, path: Path | None = None) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); None once gone.

    The command name may hold spaces and parentheses, so the split is at the
    last ``)``: ``fields[0]`` is the state, ``[1]`` the parent, ``[11]``/``[12]``
    utime/stime in clock ticks (proc(5)).
    """
    try:
        text = (path or Path(f"/proc/{pid}/stat")).read_text(encoding="utf-8")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def pid_alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped yet)."""
    try:
        fields = proc_stat_fields(pid)
    except OSError:
        return False
    return fields is not None and fields[0] not in ("Z", "X")


class Throwaway(ABC):
    """A server this process started: stopped and removed by ``with``, :meth:`cleanup` or exit.

    It lives in ``base_dir`` and listens on one loopback TCP port (0 until started).
    """

    def __init__(self, base_dir: Path) -> None:
        self._base = base_dir
        self._port = 0
        self._cleaned = False
        self._creator_pid = os.getpid()

    @property
    def port(self) -> int:
        """The loopback TCP port the server listens on."""
        return self._port

    @property
    def base_dir(self) -> Path:
        """The server's own directory (its data, log and, for PostgreSQL, socket)."""
        return self._base

    @abstractmethod
    def cleanup(self) -> None:
        """Stop the server and remove what it wrote (idempotent)."""

    def _bring_up(self, *steps: Callable[[], None]) -> None:
        """Run the start-up ``steps``; on any failure (Ctrl-C too) stop and remove what they made.

        The at-exit cleanup is registered first: an interpreter that exits
        half-way through still removes the server.
        """
        atexit.register(self._atexit_cleanup)
        try:
            for step in steps:
                step()
        except BaseException:
            self.cleanup()
            raise

    def _atexit_cleanup(self) -> None:
        """Last-resort cleanup at interpreter exit, only in the creating process."""
        if os.getpid() == self._creator_pid:
            self.cleanup()

    def __enter__(self) -> Self:
        """Use the server for the length of a ``with`` block."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server and remove its directories."""
        self.cleanup()
