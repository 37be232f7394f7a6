"""The ``synchronous`` section: commit latency with cdcd as the synchronous standby.

Also ``cdcd bench --only synchronous``, which runs this section alone.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from cdcd.config.model import parse_config
from cdcd.errors import DefiniteError
from cdcd.observability.metrics import Metrics
from cdcd.protocol.native import native_status
from cdcd.tools.bench.session import bench_config, percentile, running_session
from cdcd.tools.bench.workload import (
    SCHEMA,
    SYNC_PUBLICATION,
    SYNC_SLOT,
    TOPIC_PREFIX,
    connect,
    drop_slot,
    environment,
    progress,
)


def _commit_latencies(conn: Any, statement: str, per_s: int, seconds: float) -> list[float]:
    """Seconds each single-row commit took, one every ``1/per_s`` s (the first second left out)."""
    interval = 1.0 / per_s
    warmup = per_s  # one second
    total = warmup + int(per_s * seconds)
    samples: list[float] = []
    with conn.cursor() as cur:
        started = time.perf_counter()
        for i in range(total):
            delay = started + i * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sent = time.perf_counter()
            cur.execute(statement)
            if i >= warmup:
                samples.append(time.perf_counter() - sent)
    return samples


def _latency_summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(samples, 0.50) * 1000, 3),
        "p99": round(percentile(samples, 0.99) * 1000, 3),
        "max": round(max(samples) * 1000, 3),
    }


def _standby_names(conn: Any, names: str) -> None:
    with conn.cursor() as cur:
        if names:
            cur.execute("ALTER SYSTEM SET synchronous_standby_names = %s", (names,))
        else:
            cur.execute("ALTER SYSTEM RESET synchronous_standby_names")
        cur.execute("SELECT pg_reload_conf()")


def _wait_sync_state(conn: Any, slot: str, counted: bool, timeout_s: float = 60.0) -> None:
    """Wait until the walsender of ``slot`` is (or is no longer) counted as synchronous."""
    deadline = time.monotonic() + timeout_s
    while True:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT r.sync_state FROM pg_stat_replication r JOIN pg_replication_slots s "
                "ON s.active_pid = r.pid WHERE s.slot_name = %s",
                (slot,),
            )
            row = cur.fetchone()
        if (row is not None and row[0] in ("sync", "quorum")) == counted:
            return
        if time.monotonic() > deadline:
            raise DefiniteError(
                f"slot {slot}'s walsender did not become {'' if counted else 'a'}synchronous "
                f"in {timeout_s} s (sync_state {row[0] if row else 'not streaming'})"
            )
        time.sleep(0.02)


def measure_synchronous(
    dsn: str, bootstrap: str, per_s: int, seconds: float, quiet: bool
) -> dict[str, Any]:
    """Commit latency with cdcd as the synchronous standby (captured, uncaptured) and without."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            drop_slot(conn, SYNC_SLOT)
            cur.execute(f"DROP PUBLICATION IF EXISTS {SYNC_PUBLICATION}")
            cur.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            for table in ("sync_captured", "sync_uncaptured"):
                cur.execute(f"DROP TABLE IF EXISTS {SCHEMA}.{table}")
                cur.execute(f"CREATE TABLE {SCHEMA}.{table}(id bigserial PRIMARY KEY, note text)")
            cur.execute(f"CREATE PUBLICATION {SYNC_PUBLICATION} FOR TABLE {SCHEMA}.sync_captured")
            cur.execute("SELECT current_setting('synchronous_standby_names')")
            original = str(cur.fetchone()[0])
        config = bench_config(dsn, bootstrap, SYNC_SLOT).model_dump()
        config["postgres"].update(publication=SYNC_PUBLICATION, create_slot=True)
        config["kafka"]["topic_prefix"] = f"{TOPIC_PREFIX}_sync"
        insert = "INSERT INTO " + SCHEMA + ".{} (note) VALUES ('one row')"
        result: dict[str, Any] = {"commits_per_s": per_s, "seconds": seconds}
        with running_session(parse_config(config), Metrics(process_collectors=False)) as running:
            try:
                # The slot's name is the replication connection's application_name.
                _standby_names(conn, SYNC_SLOT)
                _wait_sync_state(conn, SYNC_SLOT, counted=True)
                for key, table in (
                    ("captured_ms", "sync_captured"),
                    ("uncaptured_ms", "sync_uncaptured"),
                ):
                    progress(f"synchronous: {per_s} commits/s into {table} for {seconds:.0f} s", quiet)
                    result[key] = _latency_summary(
                        _commit_latencies(conn, insert.format(table), per_s, seconds)
                    )
                    running.check()
            finally:
                _standby_names(conn, original)
            _wait_sync_state(conn, SYNC_SLOT, counted=False)
            progress(f"synchronous: {per_s} commits/s into sync_captured, not synchronous", quiet)
            result["not_synchronous_ms"] = _latency_summary(
                _commit_latencies(conn, insert.format("sync_captured"), per_s, seconds)
            )
            running.check()
        baseline = result["not_synchronous_ms"]["p99"]
        result["added_p99_ms"] = {
            "captured": round(result["captured_ms"]["p99"] - baseline, 3),
            "uncaptured": round(result["uncaptured_ms"]["p99"] - baseline, 3),
        }
        drop_slot(conn, SYNC_SLOT)
        return result
    finally:
        conn.close()

def synchronous_lines(sync: dict[str, Any]) -> list[tuple[str, str]]:
    def fmt(summary: dict[str, float]) -> str:
        return "p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {max:.2f} ms".format(**summary)

    rate = f"{sync['commits_per_s']} single-row commits/s"
    return [
        (f"commit, cdcd synchronous, captured table ({rate})", fmt(sync["captured_ms"])),
        (f"commit, cdcd synchronous, uncaptured table ({rate})", fmt(sync["uncaptured_ms"])),
        (f"commit, not synchronous ({rate})", fmt(sync["not_synchronous_ms"])),
        (
            "p99 added by synchronous capture",
            "captured {captured:.2f} ms, uncaptured {uncaptured:.2f} ms".format(
                **sync["added_p99_ms"]
            ),
        ),
    ]


def cmd_synchronous_only(args: argparse.Namespace) -> int:
    """``cdcd bench --only synchronous``: the synchronous section alone."""
    with environment(args) as (dsn, bootstrap, _bindir):
        sync = measure_synchronous(dsn, bootstrap, args.sync_commits_per_s, args.sync_seconds, args.json)
    if args.json:
        print(json.dumps({"synchronous": sync, "native": native_status()}))
        return 0
    lines = synchronous_lines(sync)
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0
