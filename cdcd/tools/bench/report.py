"""One whole ``cdcd bench`` run in order, and what it reports (JSON or a table).

The phases and what each figure means are in :mod:`cdcd.tools.bench`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from cdcd.errors import DefiniteError
from cdcd.naming import table_topic
from cdcd.protocol.native import native_status
from cdcd.tools.bench.ceilings import (
    Copy,
    Decode,
    KafkaClient,
    copy_ceiling,
    decode_ceiling,
    kafka_client_ceiling,
    recvlogical_ceiling,
)
from cdcd.tools.bench.session import (
    Drain,
    SnapshotRun,
    cdcd_rate,
    commit_to_ack_latency,
    initial_snapshot,
    peak_rss_big_transaction,
)
from cdcd.tools.bench.synchronous import (
    cmd_synchronous_only,
    measure_synchronous,
    synchronous_lines,
)
from cdcd.tools.bench.workload import (
    CDCD_SLOT,
    CEILING_SLOT,
    SCHEMA,
    SNAPSHOT_SLOT,
    TOPIC_PREFIX,
    connect,
    current_lsn,
    drop_slot,
    environment,
    load,
    prepare,
    progress,
)


@dataclass
class BenchResult:
    rows: int
    ceiling_rows_per_s: float
    cdcd_rows_per_s: float
    ratio: float
    offered_rows_per_s: int
    latency_ms: dict[str, float]
    peak_rss_mb: float
    big_transaction_rows: int
    seed: int
    cdcd_cpu_us_per_row: float
    walsender_cpu_us_per_row: float
    cpu_count: int
    snapshot: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "ceiling_rows_per_s": round(self.ceiling_rows_per_s),
            "cdcd_rows_per_s": round(self.cdcd_rows_per_s),
            "ratio": round(self.ratio, 3),
            "offered_rows_per_s": self.offered_rows_per_s,
            "latency_ms": {k: round(v, 2) for k, v in self.latency_ms.items()},
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "big_transaction_rows": self.big_transaction_rows,
            "seed": self.seed,
            "cdcd_cpu_us_per_row": round(self.cdcd_cpu_us_per_row, 2),
            "walsender_cpu_us_per_row": round(self.walsender_cpu_us_per_row, 2),
            "cpu_ratio": round(self.cdcd_cpu_us_per_row / self.walsender_cpu_us_per_row, 3),
            "cpu_count": self.cpu_count,
            **({"snapshot": self.snapshot} if self.snapshot is not None else {}),
            **self.details,
        }

def run_bench(args: argparse.Namespace) -> BenchResult:
    quiet = bool(args.json)
    rows = args.rows
    snapshot: dict[str, Any] | None = None
    synchronous: dict[str, Any] | None = None
    with environment(args) as (dsn, bootstrap, bindir):
        conn = connect(dsn)
        try:
            prepare(conn)
            progress(f"loading {rows:,} rows in transactions of 10 (seed {args.seed})", quiet)
            load_s = load(dsn, rows, args.seed, quiet)
            end_lsn = current_lsn(conn)
            progress(f"loaded in {load_s:.1f} s; measuring pg_recvlogical", quiet)
            ceiling_s, walsender_cpu_s = recvlogical_ceiling(dsn, bindir, end_lsn)
            progress(
                f"pg_recvlogical: {rows / ceiling_s:,.0f} rows/s, walsender "
                f"{walsender_cpu_s / rows * 1e6:.2f} µs CPU/row; peeking at the slot's copy",
                quiet,
            )
            decode = decode_ceiling(dsn, end_lsn, rows)
            progress(
                f"server decode, no client: {rows / decode.seconds:,.0f} rows/s, "
                f"{decode.server_cpu_s / rows * 1e6:.2f} µs CPU/row; measuring cdcd",
                quiet,
            )
            drain = cdcd_rate(dsn, bootstrap, end_lsn)
            progress(
                f"cdcd: {rows / drain.seconds:,.0f} rows/s, "
                f"{drain.cdcd_cpu_s / rows * 1e6:.2f} µs CPU/row",
                quiet,
            )
            kafka = kafka_client_ceiling(
                bootstrap, table_topic(TOPIC_PREFIX, SCHEMA, "orders"), rows
            )
            progress(
                f"bare Kafka client: {kafka.cpu_s / rows * 1e6:.2f} µs CPU/message "
                f"({kafka.key_bytes:.0f} + {kafka.value_bytes:.0f} bytes, 2 headers)",
                quiet,
            )
            if not args.no_snapshot:
                progress(f"initial snapshot of the {rows:,}-row table", quiet)
                run = initial_snapshot(
                    dsn, bootstrap, rows, args.snapshot_connections, args.snapshot_processes
                )
                drop_slot(conn, SNAPSHOT_SLOT)
                progress(
                    f"snapshot: {rows / run.seconds:,.0f} rows/s, "
                    f"{run.cdcd_cpu_s / rows * 1e6:.2f} µs CPU/row; COPY ceiling "
                    f"on {run.connections} connection(s)",
                    quiet,
                )
                copy = copy_ceiling(dsn, run.connections)
                if copy.rows != rows:
                    raise DefiniteError(f"the COPY ceiling copied {copy.rows} rows, not {rows}")
                snapshot = _snapshot_figures(rows, run, copy, kafka)
                progress(
                    f"COPY: {snapshot['copy_rows_per_s']:,} rows/s, server "
                    f"{snapshot['copy_server_cpu_us_per_row']:.2f} µs CPU/row",
                    quiet,
                )
            progress("measuring latency", quiet)
            latency = commit_to_ack_latency(
                dsn, bootstrap, bindir, args.offered_rows_per_s, args.latency_seconds, quiet
            )
            progress(f"latency p50 {latency['p50']:.1f} ms, p99 {latency['p99']:.1f} ms", quiet)
            peak = peak_rss_big_transaction(dsn, bootstrap, args.big_rows, quiet)
            for slot in (CEILING_SLOT, CDCD_SLOT):
                drop_slot(conn, slot)
            if not args.no_synchronous:
                synchronous = measure_synchronous(
                    dsn, bootstrap, args.sync_commits_per_s, args.sync_seconds, quiet
                )
        finally:
            conn.close()
    ceiling = rows / ceiling_s
    rate = rows / drain.seconds
    return BenchResult(
        rows=rows,
        ceiling_rows_per_s=ceiling,
        cdcd_rows_per_s=rate,
        ratio=rate / ceiling,
        offered_rows_per_s=args.offered_rows_per_s,
        latency_ms={k: latency[k] for k in ("p50", "p99", "max")},
        peak_rss_mb=peak,
        big_transaction_rows=args.big_rows,
        seed=args.seed,
        cdcd_cpu_us_per_row=drain.cdcd_cpu_s / rows * 1e6,
        walsender_cpu_us_per_row=walsender_cpu_s / rows * 1e6,
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        snapshot=snapshot,
        details={
            "load_seconds": round(load_s, 1),
            "ceiling_seconds": round(ceiling_s, 2),
            "cdcd_seconds": round(drain.seconds, 2),
            "cdcd_setup_seconds": round(drain.setup_seconds, 2),
            # The walsender serving cdcd: the same decoding, plus what
            # cdcd's status updates cost it.
            "walsender_cpu_us_per_row_cdcd": round(drain.walsender_cpu_s / rows * 1e6, 2),
            **_stream_ceilings(rows, rate, drain, decode),
            **_kafka_client_figures(rows, drain, kafka),
            # Where cdcd's CPU went (/proc/self/task; 10 ms ticks per thread).
            "cdcd_cpu_us_per_row_by_thread": {
                name: round(cpu / rows * 1e6, 2)
                for name, cpu in sorted(drain.threads_cpu_s.items(), key=lambda kv: -kv[1])
                if cpu > 0
            },
            "latency_transactions": int(latency["transactions"]),
            # Which hot path ran: the C extensions, or the pure-Python code.
            "native": native_status(),
            **({"synchronous": synchronous} if synchronous is not None else {}),
        },
    )


def _stream_ceilings(rows: int, rate: float, drain: Drain, decode: Decode) -> dict[str, Any]:
    """The stream's server-side ceilings and cdcd's ratios against them (docs/bench.md).

    ``walsender_limit_rows_per_s``: the rate a walsender could serve if it
    spent all of one core the way it did serving cdcd. ``decode_*``: the
    server decoding the same WAL with no client (the peek).
    """
    walsender_us = drain.walsender_cpu_s / rows * 1e6
    limit = 1e6 / walsender_us if walsender_us > 0 else None
    decode_rate = rows / decode.seconds
    decode_us = decode.server_cpu_s / rows * 1e6
    cdcd_us = drain.cdcd_cpu_s / rows * 1e6
    return {
        "walsender_limit_rows_per_s": round(limit) if limit else None,
        "ratio_walsender_limit": round(rate / limit, 3) if limit else None,
        "cpu_ratio_walsender_cdcd": round(cdcd_us / walsender_us, 3) if walsender_us else None,
        "decode_rows_per_s": round(decode_rate),
        "decode_seconds": round(decode.seconds, 4),
        "decode_messages": decode.messages,
        "decode_server_cpu_us_per_row": round(decode_us, 2),
        "ratio_decode": round(rate / decode_rate, 3),
    }


def _kafka_client_figures(rows: int, drain: Drain, kafka: KafkaClient) -> dict[str, Any]:
    """The bare Kafka client's CPU per message, and cdcd's streaming CPU per row against it."""
    kafka_us = kafka.cpu_s / kafka.messages * 1e6
    return {
        "kafka_client_cpu_us_per_msg": round(kafka_us, 2),
        "kafka_client_msgs_per_s": round(kafka.messages / kafka.seconds),
        "kafka_client_message_bytes": {
            "key": round(kafka.key_bytes, 1),
            "value": round(kafka.value_bytes, 1),
        },
        "cpu_ratio_kafka_client": round(drain.cdcd_cpu_s / rows * 1e6 / kafka_us, 3)
        if kafka_us
        else None,
    }


def _snapshot_figures(
    rows: int, run: SnapshotRun, copy: Copy, kafka: KafkaClient
) -> dict[str, Any]:
    """The snapshot section: cdcd's snapshot and the ``COPY`` ceiling on as many connections."""
    rate = rows / run.seconds
    copy_rate = rows / copy.seconds
    cdcd_us = run.cdcd_cpu_s / rows * 1e6
    copy_server_us = copy.server_cpu_s / rows * 1e6
    return {
        "rows": rows,
        "rows_per_s": round(rate),
        "seconds": round(run.seconds, 2),
        "connections": run.connections,
        "processes": run.processes,
        "cdcd_cpu_us_per_row": round(cdcd_us, 2),
        "server_cpu_us_per_row": round(run.server_cpu_s / rows * 1e6, 2),
        "copy_rows_per_s": round(copy_rate),
        "copy_seconds": round(copy.seconds, 4),
        "copy_server_cpu_us_per_row": round(copy_server_us, 3),
        "ratio_copy": round(rate / copy_rate, 3),
        "cpu_ratio_copy_server": round(cdcd_us / copy_server_us, 3) if copy_server_us else None,
        "cpu_ratio_kafka_client": round(cdcd_us / (kafka.cpu_s / kafka.messages * 1e6), 3)
        if kafka.cpu_s
        else None,
        # With processes: the workers' share of cdcd_cpu_us_per_row, and peak memory.
        "workers_cpu_us_per_row": round(run.workers_cpu_s / rows * 1e6, 2),
        "workers_peak_rss_mb": run.workers_peak_rss_mb or [],
        "parent_peak_rss_mb": round(run.parent_peak_rss_mb, 1),
    }


def cmd_bench(args: argparse.Namespace) -> int:
    if args.only == "synchronous":
        return cmd_synchronous_only(args)
    if args.rows < 10 or args.rows % 10:
        raise DefiniteError("--rows must be a positive multiple of 10")
    result = run_bench(args)
    data = result.as_json()
    if args.json:
        print(json.dumps(data))
        return 0
    lines = [
        ("rows (transactions of 10)", f"{result.rows:,}"),
        ("pg_recvlogical ceiling", f"{result.ceiling_rows_per_s:,.0f} rows/s"),
        ("cdcd end to end (acks=all, confirmed)", f"{result.cdcd_rows_per_s:,.0f} rows/s"),
        ("ratio", f"{result.ratio:.2f}"),
        (
            "CPU per row: cdcd (all threads) / walsender",
            f"{result.cdcd_cpu_us_per_row:.2f} µs / {result.walsender_cpu_us_per_row:.2f} µs "
            f"(ratio {data['cpu_ratio']:.2f}, {result.cpu_count} cores)",
        ),
        (
            "walsender serving cdcd: CPU/row, the rate it implies",
            f"{data['walsender_cpu_us_per_row_cdcd']:.2f} µs, "
            f"{data['walsender_limit_rows_per_s'] or 0:,.0f} rows/s "
            f"(cdcd at {data['ratio_walsender_limit'] or 0:.2f} of it)",
        ),
        (
            "server decode, no client (peek on a copy of the slot)",
            f"{data['decode_rows_per_s']:,.0f} rows/s, "
            f"{data['decode_server_cpu_us_per_row']:.2f} µs CPU/row "
            f"(cdcd at {data['ratio_decode']:.2f} of it)",
        ),
        (
            "bare Kafka client (cdcd's messages and producer settings)",
            f"{data['kafka_client_cpu_us_per_msg']:.2f} µs CPU/message "
            f"(cdcd streaming at {data['cpu_ratio_kafka_client'] or 0:.2f}× it)",
        ),
        (
            f"commit-to-ack latency at {result.offered_rows_per_s:,} rows/s",
            "p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max:.1f} ms".format(**result.latency_ms),
        ),
        (f"peak RSS, one {result.big_transaction_rows:,}-row transaction", f"{result.peak_rss_mb:.0f} MB"),
    ]
    if "synchronous" in data:
        lines.extend(synchronous_lines(data["synchronous"]))
    if result.snapshot is not None:
        snap = result.snapshot
        lines.append(
            (
                f"initial snapshot, {snap['rows']:,.0f} rows",
                f"{snap['rows_per_s']:,.0f} rows/s; CPU per row cdcd "
                f"{snap['cdcd_cpu_us_per_row']:.2f} µs, server {snap['server_cpu_us_per_row']:.2f} µs",
            )
        )
        lines.append(
            (
                "snapshot CPU per row against the bare Kafka client",
                f"{snap['cpu_ratio_kafka_client'] or 0:.2f}× its {data['kafka_client_cpu_us_per_msg']:.2f} µs"
                + (f"; {snap['processes']} worker processes" if snap["processes"] else ""),
            )
        )
        lines.append(
            (
                f"COPY … TO STDOUT ceiling, {snap['connections']} connection(s)",
                f"{snap['copy_rows_per_s']:,.0f} rows/s, server "
                f"{snap['copy_server_cpu_us_per_row']:.2f} µs CPU/row "
                f"(snapshot at {snap['ratio_copy']:.2f} of it)",
            )
        )
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0
