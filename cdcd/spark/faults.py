"""Fault points for the crash tests: where ``cdcd mirror`` can SIGKILL itself.

Empty in production. The tests set :data:`FAULT` in the child process through
their launcher (never the environment); the mirror's writers ask
:meth:`Fault.armed` at each point and die there, leaving exactly the state a
crash at that moment leaves.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from cdcd.errors import ConfigError
from cdcd.spark.deltaio import is_local, local_path

log = logging.getLogger(__name__)

#: Fault point, empty in production: ``before-merge``,
#: ``in-merge`` (SIGKILL once a data file of the MERGE exists but is not
#: committed) or ``after-merge``, and the same for the history table's commit
#: (``before-history``, ``in-history``, ``after-history``), or
#: ``in-files`` (SIGKILL once the executors wrote a bulk write's data files,
#: before the driver commits them; :mod:`cdcd.spark.bulk`), ``in-rewrite``
#: (the same for a table the executors rewrote; :mod:`cdcd.spark.rewrite`),
#: optionally ``:<batch id>``.
FAULT = ""


@dataclass
class Fault:
    point: str
    batch_id: int | None

    @classmethod
    def configured(cls) -> Fault | None:
        text = FAULT
        if not text:
            return None
        point, _, batch = text.partition(":")
        return cls(point, int(batch) if batch else None)

    def armed(self, point: str, batch_id: int) -> bool:
        return self.point == point and self.batch_id in (None, batch_id)


def kill_self(reason: str) -> None:
    log.warning("fault injection: SIGKILL %s", reason)
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def killed_before_commit(
    uri: str, armed: bool, storage_options: Mapping[str, str]
) -> Iterator[None]:
    """While armed, SIGKILL this process after the write inside has its data files but no commit.

    The next version's log entry is taken by a directory first, so delta-rs
    writes the data files and then fails to commit, every time (a thread
    watching for new files raced the commit and sometimes lost). The blocker
    goes before the kill: what is left is exactly a crash between the data
    files and the commit. Only for an existing local table.
    """
    if not armed or not is_local(uri):
        yield
        return
    from deltalake import DeltaTable

    path = local_path(uri)
    if not DeltaTable.is_deltatable(path):
        raise ConfigError(f"fault {FAULT!r}: in-* faults need an existing table at {path}")
    version = DeltaTable(path, storage_options=dict(storage_options)).version()
    blocker = os.path.join(path, "_delta_log", f"{version + 1:020d}.json")
    os.mkdir(blocker)
    try:
        yield
    except Exception:  # noqa: BLE001 - the blocked commit's failure is the point: die here
        os.rmdir(blocker)
        kill_self("with the data files written but not committed")
    os.rmdir(blocker)
    raise RuntimeError(f"fault {FAULT!r}: the commit of {path} was not blocked")
