"""Two source trees of cdcd, alternating on the same PostgreSQL, broker and load: an A/B of CPU per row.

Run: ``.venv/bin/python -m tests.bench.bench_ab --trees OLD,NEW [--phase drain|snapshot]
[--runs 6] [--rows 1000000]``.

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

Prints one JSON line per run, then the medians per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from cdcd.tools.bench.workload import connect, current_lsn, drop_slot, environment, load, prepare

#: What a run does in its own process, with the tree's cdcd on its path.
RUN = """
import json, sys
from cdcd.tools.bench import session
task = json.loads(sys.argv[1])
rows = task["rows"]
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
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))
"""


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
            for run, index, slot in turns:
                task = {"phase": args.phase, "dsn": dsn, "bootstrap": bootstrap,
                        "slot": slot, "end": end, "rows": args.rows}  # fmt: skip
                figures = run_once(trees[index], task)
                drop_slot(conn, slot)
                results[index].append(figures)
                print(json.dumps({"tree": str(trees[index]), "run": run + 1, **figures}), flush=True)
        finally:
            conn.close()
    for tree, runs in zip(trees, results, strict=True):
        keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
        medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
        print(json.dumps({"tree": str(tree), "median_of": len(runs), **medians}), flush=True)


if __name__ == "__main__":
    main()
