"""CPU figures from ``/proc``: cdcd's threads in this process and the server's backends.

Every CPU figure of the bench is a difference of two readings taken here; the
bench's own threads (main thread, samplers) are left out of cdcd's.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Self

from cdcd.errors import DefiniteError
from cdcd.tools.bench.workload import connect
from cdcd.tools.local.process import proc_stat_fields

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_s(pid: int, path: Path | None = None) -> float | None:
    """utime + stime of process ``pid`` in seconds, None once it is gone."""
    fields = proc_stat_fields(pid, path)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS




class BenchSampler:
    """A thread of the bench (its CPU is not cdcd's: in ``_BENCH_THREADS`` while it
    runs) that runs :meth:`_sample` for the length of a ``with`` block."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="bench-proc-cpu", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        while self._thread.ident not in _BENCH_THREADS and self._thread.is_alive():
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _main(self) -> None:
        ident = threading.get_ident()
        _BENCH_THREADS.add(ident)
        try:
            self._sample()
        finally:
            _BENCH_THREADS.discard(ident)

    def _sample(self) -> None:
        raise NotImplementedError


class BackendCpu(BenchSampler):
    """CPU seconds of the server processes serving a phase, sampled from ``/proc``.

    The server's processes are not this process's children: their CPU can
    only be read while they live, so a sampler thread reads each one every
    ``interval_s`` and keeps the last value, from the process's start. What a
    process spends after its last sample (at most one interval) is missed:
    the figure errs low, in the server's favour. ``sql`` (with ``params``)
    lists the pids to follow; it runs on a connection of its own every 0.1 s.
    The sampler thread is in ``_BENCH_THREADS`` while it runs.
    """

    def __init__(self, dsn: str, sql: str, params: tuple[Any, ...], interval_s: float = 0.01) -> None:
        super().__init__()
        self._dsn = dsn
        self._sql = sql
        self._params = params
        self._interval_s = interval_s
        self._seen: dict[int, float] = {}
        self.error: BaseException | None = None

    def _sample(self) -> None:
        pids: set[int] = set()
        next_find = 0.0
        try:
            conn = connect(self._dsn)
            try:
                while not self._stop.is_set():
                    now = time.monotonic()
                    if now >= next_find:
                        with conn.cursor() as cur:
                            cur.execute(self._sql, self._params)
                            pids.update(int(row[0]) for row in cur.fetchall())
                        # Until one is found, look every interval: a small
                        # load's walsender may live less than 0.1 s.
                        next_find = now + (0.1 if pids else self._interval_s)
                    for pid in pids:
                        cpu = proc_cpu_s(pid)
                        if cpu is not None:
                            self._seen[pid] = cpu
                    self._stop.wait(self._interval_s)
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by cpu_s
            self.error = exc

    def cpu_s(self) -> float:
        if self.error is not None:
            raise DefiniteError(f"could not sample the server's CPU: {self.error}")
        return sum(self._seen.values())

    @property
    def pids(self) -> list[int]:
        return sorted(self._seen)


#: Threads of this process that are the benchmark's, not cdcd's: the main
#: thread (it waits for the slot) and live ``BackendCpu`` samplers.
_BENCH_THREADS: set[int] = set()


def cdcd_cpu_s() -> float:
    """CPU seconds of this process so far, every thread but the benchmark's own.

    The pipeline runs in this process (the session thread, librdkafka's
    threads, the metrics server); what the bench's threads spend waiting and
    sampling is left out. Only differences of two readings mean anything,
    and both must fall while the same bench threads live.
    """
    total = time.process_time()
    for ident in _BENCH_THREADS | {threading.main_thread().ident or 0}:
        total -= time.clock_gettime(time.pthread_getcpuclockid(ident))
    return total


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name, the bench's left out.

    Python threads by their Python name, librdkafka's by theirs
    (``rdk:main``, ``rdk:broker1``, ...); threads of one name are summed.
    """
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    bench = {threading.main_thread().native_id}
    bench |= {t.native_id for t in threading.enumerate() if t.name == "bench-proc-cpu"}
    result: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        if tid in bench:
            continue
        cpu = proc_cpu_s(tid, task / "stat")
        if cpu is None:
            continue
        try:
            name = names.get(tid) or (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended since the listing
            continue
        result[name] = result.get(name, 0.0) + cpu
    return result

PROC_HINT = "run cdcd bench on the PostgreSQL host, as a user that may read its /proc"


def backend_cpu_s(pid: int) -> float:
    """CPU seconds of server process ``pid`` so far, to the nanosecond where the kernel says.

    ``/proc/<pid>/sched`` (``se.sum_exec_runtime``, ms) is exact; ``stat``'s
    10 ms ticks would round a small run's COPY to zero. Only differences of
    two readings of a live process mean anything.
    """
    try:
        for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
            if line.startswith("se.sum_exec_runtime"):
                return float(line.split(":", 1)[1]) / 1000.0
    except (FileNotFoundError, PermissionError, ValueError):
        pass
    cpu = proc_cpu_s(pid)
    if cpu is None:
        raise DefiniteError(f"server process {pid} is not visible in /proc", hint=PROC_HINT)
    return cpu



def backend_pid(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return int(cur.fetchone()[0])
