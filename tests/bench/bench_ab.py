"""Two source trees of cdcd, alternating on the same PostgreSQL, broker and load: an A/B of CPU per row.

Run: ``.venv/bin/python -m tests.bench.bench_ab --trees OLD,NEW [--phase drain|snapshot]
[--runs 6] [--rows 1000000] [--perf DIR]``.

On this shared two-core machine one run differs from the next by more than
most changes save, and a batch of runs drifts with whatever else runs; so
both trees run in turns, run 1 of each, then run 2 of each, against one
PostgreSQL and broker (throwaway ones, as ``cdcd bench`` starts them, or
``--dsn`` / ``--bootstrap-servers``) and one load. The drain takes a slot
per run: the throwaway cluster allows 20, so at most 10 runs of two trees. Each run is a fresh process
importing the tree's ``cdcd`` (``PYTHONPATH``; build a tree's C extensions
in place first: ``python setup.py build_ext --inplace``).

* ``drain``: slots are created before the §9 load (transactions of 10), one
  per run; each run is ``cdcd bench``'s streaming phase on its own slot
  (``cdcd.tools.bench.session.cdcd_rate``): rows/s to a confirmed LSN, cdcd's
  CPU per row and by thread, the walsender's serving it;
* ``snapshot``: the table is loaded once; each run is the bench's initial
  snapshot (``initial_snapshot``, one reader) on a slot of its own.

Prints one JSON line per run, then the medians per tree. With ``--perf DIR``
each run is also profiled (``perf record -p``, attached to the run's process
before it starts, all its threads), and each tree's top functions are printed
as µs of cdcd CPU per row: their mean share of the samples times the tree's
median ``cdcd_us``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from cdcd.tools.bench.workload import connect, current_lsn, drop_slot, environment, load, prepare

#: What a run does in its own process, with the tree's cdcd on its path.
RUN = """
import json, os, resource, signal, subprocess, sys, time
from cdcd.tools.bench import session
task = json.loads(sys.argv[1])
rows = task["rows"]
perf = None
if task["perf"]:
    perf = subprocess.Popen(["perf", "record", "-q", "-F", "999", "-p", str(os.getpid()), "-o", task["perf"]],
                            stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # attached to every thread before the run starts
usage = resource.getrusage(resource.RUSAGE_SELF)
if task["phase"] == "drain":
    session.CDCD_SLOT = task["slot"]
    run = session.cdcd_rate(task["dsn"], task["bootstrap"], task["end"])
    out = {"rows_per_s": round(rows / run.seconds), "cdcd_us": run.cdcd_cpu_s / rows * 1e6,
           "walsender_us": run.walsender_cpu_s / rows * 1e6,
           "session_us": run.threads_cpu_s.get("cdcd-session", 0.0) / rows * 1e6,
           "threads_us": {k: round(v / rows * 1e6, 2) for k, v in run.threads_cpu_s.items() if v > 0.01}}
else:
    session.SNAPSHOT_SLOT = task["slot"]
    run = session.initial_snapshot(task["dsn"], task["bootstrap"], rows, connections=1)
    out = {"rows_per_s": round(rows / run.seconds), "cdcd_us": run.cdcd_cpu_s / rows * 1e6,
           "server_us": run.server_cpu_s / rows * 1e6}
after = resource.getrusage(resource.RUSAGE_SELF)
# Per 1,000 rows, over the whole run (setup included): page faults and context switches.
out["minflt_k"] = (after.ru_minflt - usage.ru_minflt) / rows * 1e3
out["ctxsw_k"] = (after.ru_nvcsw + after.ru_nivcsw - usage.ru_nvcsw - usage.ru_nivcsw) / rows * 1e3
if perf is not None:
    perf.send_signal(signal.SIGINT)
    perf.wait()
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))
"""


def perf_shares(data: Path) -> dict[str, float]:
    """Share of a ``perf record`` file's samples per function (own time), in percent."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "sym", "--stdio", "-q"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    shares: dict[str, float] = {}
    for line in report.stdout.splitlines():
        match = re.match(r"\s*([0-9.]+)%\s+\[[.k]\]\s+(.+?)\s*$", line)
        if match:
            shares[match[2]] = shares.get(match[2], 0.0) + float(match[1])
    return shares


def print_profile(tree: Path, shares: list[dict[str, float]], cdcd_us: float, top: int = 15) -> None:
    """The functions taking most of the tree's samples, as µs of cdcd CPU per row (share x cdcd_us)."""
    names = {name for run in shares for name in run}
    mean = {name: sum(run.get(name, 0.0) for run in shares) / len(shares) for name in names}
    print(f"# {tree}: own time per row, mean share of {len(shares)} profiles x median cdcd_us")
    for name, share in sorted(mean.items(), key=lambda item: -item[1])[:top]:
        print(f"#   {share / 100 * cdcd_us:6.3f} µs  {share:5.1f}%  {name}")


def run_once(tree: Path, task: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(task)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{tree}: {result.stderr.strip()[-2000:]}")
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trees", required=True, help="comma-separated source trees, run in turns")
    parser.add_argument("--phase", choices=("drain", "snapshot"), default="drain")
    parser.add_argument("--runs", type=int, default=6, help="runs per tree")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dsn", default=None, help="a database to use (default: a throwaway cluster)")
    parser.add_argument("--bootstrap-servers", default=None, help="Kafka (default: the bundled broker)")
    parser.add_argument(
        "--perf", type=Path, default=None, metavar="DIR",
        help="also profile each run with perf record (files in DIR) and print each tree's top functions",
    )  # fmt: skip
    parser.set_defaults(json=True)  # environment(): no progress lines between the JSON ones
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    # In turns: run 1 of each tree, then run 2 of each...; a slot per run.
    turns = [(run, index, f"ab_{run}_{index}") for run in range(args.runs) for index in range(len(trees))]
    with environment(args) as (dsn, bootstrap, _):
        conn = connect(dsn)
        try:
            prepare(conn)
            if args.phase == "drain":  # the slots exist before the load, so each drains all of it
                with conn.cursor() as cur:
                    for _, _, slot in turns:
                        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            load(dsn, args.rows, args.seed, quiet=True)
            end = current_lsn(conn)
            results: list[list[dict[str, Any]]] = [[] for _ in trees]
            profiles: list[list[dict[str, float]]] = [[] for _ in trees]
            if args.perf:
                args.perf.mkdir(parents=True, exist_ok=True)
            for run, index, slot in turns:
                data = args.perf / f"{slot}.perf.data" if args.perf else None
                task = {"phase": args.phase, "dsn": dsn, "bootstrap": bootstrap,
                        "slot": slot, "end": end, "rows": args.rows,
                        "perf": str(data) if data else None}  # fmt: skip
                figures = run_once(trees[index], task)
                drop_slot(conn, slot)
                results[index].append(figures)
                if data is not None:
                    profiles[index].append(perf_shares(data))
                print(json.dumps({"tree": str(trees[index]), "run": run + 1, **figures}), flush=True)
        finally:
            conn.close()
    for tree, runs in zip(trees, results, strict=True):
        keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
        medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
        print(json.dumps({"tree": str(tree), "median_of": len(runs), **medians}), flush=True)
    for tree, runs, shares in zip(trees, results, profiles, strict=True):
        if shares:
            print_profile(tree, shares, statistics.median(r["cdcd_us"] for r in runs))


if __name__ == "__main__":
    main()
