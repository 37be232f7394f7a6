"""Where the pipeline's time goes: py-spy on the real session draining the §9 load.

Starts a throwaway PostgreSQL 15 and the bundled broker, loads ``--rows``
rows of the ``orders`` workload exactly as ``cdcd bench`` does (transactions
of 10), then runs the real ``Session`` in this process while ``py-spy``
samples it, until the slot's ``confirmed_flush_lsn`` reaches the end of the
load. Prints the session thread's top functions by own time and by
inclusive time, as a share of its samples and as µs per row.

    .venv/bin/python -m tests.bench.profile_pipeline --rows 300000
    .venv/bin/python -m tests.bench.profile_pipeline --rows 300000 --idle   # also time spent waiting

This is the profile that guided the optimisations in README "Performance".
Sampling slows the process down a little (``--nonblocking`` keeps that
small), so the µs/row here are above the un-profiled ``cdcd bench`` rate.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cdcd.observability.metrics import Metrics
from cdcd.tools.bench import session as bench_session
from cdcd.tools.bench import workload as bench_workload
from cdcd.tools.local import LocalBroker, LocalPostgres

#: Frames that mark the session thread's stacks (the loop and its callees).
SESSION_FRAME = "Session._loop ("


def _frame_name(frame: str) -> str:
    """``fn (path:line)`` -> ``fn (path)``: aggregate per function, not per line."""
    head, _, rest = frame.partition(" (")
    return f"{head} ({rest.rstrip(')').rsplit(':', 1)[0]})"


def summarize(raw: Path, rows: int, rate: int, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if SESSION_FRAME not in stack:
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";")]
        frames = frames[next(i for i, f in enumerate(frames) if f.startswith(SESSION_FRAME)) :]
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    if not total:
        return "no samples of the session thread (is py-spy allowed to ptrace?)"
    us_per_sample = 1e6 / rate / rows
    out = [f"session thread: {total} samples at {rate}/s over {rows:,} rows "
           f"= {total * us_per_sample:.1f} µs/row sampled"]  # fmt: skip
    for title, counter in (("own time", own), ("inclusive time", inclusive)):
        out.append(f"\ntop {top} by {title}:")
        out.append(f"{'share':>7} {'µs/row':>7}  function")
        for name, count in counter.most_common(top):
            out.append(f"{count / total:>7.1%} {count * us_per_sample:>7.2f}  {name}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--idle", action="store_true", help="include samples of waiting")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw stacks here")
    parser.add_argument("--blocking", action="store_true", help="pause the process per sample (exact stacks, slower run)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")

    cluster = LocalPostgres.start(
        settings={"fsync": "on", "max_wal_size": "4GB", "shared_buffers": "256MB"}
    )
    broker = LocalBroker.start()
    workdir = Path(tempfile.mkdtemp(prefix="cdcd-profile-"))
    raw = args.raw or workdir / "stacks.txt"
    try:
        cluster.create_database("bench")
        dsn = cluster.dsn("bench")
        conn = bench_workload.connect(dsn)
        bench_workload.prepare(conn)
        print(f"loading {args.rows:,} rows", file=sys.stderr)
        bench_workload.load(dsn, args.rows, args.seed, quiet=True)
        end_lsn = bench_workload.current_lsn(conn)
        config = bench_session.bench_config(dsn, broker.bootstrap_servers, bench_workload.CDCD_SLOT)
        argv = [py_spy, "record", "--pid", str(os.getpid()), "--rate", str(args.rate),
                "--format", "raw", "--output", str(raw)]  # fmt: skip
        if not args.blocking:
            argv.append("--nonblocking")
        if args.idle:
            argv.append("--idle")
        with bench_session.running_session(config, Metrics(process_collectors=False)) as running:
            spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            started = time.monotonic()
            bench_workload.wait_confirmed(
                conn, bench_workload.CDCD_SLOT, end_lsn, timeout_s=1800, check=running.check
            )
            elapsed = time.monotonic() - started
            spy.send_signal(signal.SIGINT)
            _, err = spy.communicate(timeout=60)
        conn.close()
        print(f"drained {args.rows:,} rows in {elapsed:.2f} s under the profiler "
              f"({args.rows / elapsed:,.0f} rows/s)")  # fmt: skip
        if not raw.exists():
            raise SystemExit(f"py-spy wrote nothing: {err.decode(errors='replace').strip()}")
        print(summarize(raw, args.rows, args.rate, args.top))
    finally:
        broker.cleanup()
        cluster.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
