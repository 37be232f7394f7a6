"""``cdcd bench``'s command-line options, apart from the benchmark itself.

The CLI builds every subcommand's parser at start; this module imports
nothing but the workload's defaults, so ``cdcd --help`` or a command that
fails early does not load the benchmark (psycopg2, confluent-kafka, ...).
"""

from __future__ import annotations

import argparse

#: Connections reading cdcd's initial snapshot (``snapshot.parallelism``),
#: and so the connections of the ``COPY`` ceiling it is compared with.
SNAPSHOT_CONNECTIONS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dsn", help="PostgreSQL to use (default: a throwaway cluster)")
    parser.add_argument("--bootstrap-servers", help="Kafka to use (default: the bundled broker)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the throughput load")
    parser.add_argument("--seed", type=int, default=42, help="seed of the workload")
    parser.add_argument("--offered-rows-per-s", type=int, default=10_000, help="latency load")
    parser.add_argument("--latency-seconds", type=float, default=20.0, help="latency run length")
    parser.add_argument("--big-rows", type=int, default=1_000_000, help="rows of the big transaction")
    parser.add_argument(
        "--no-snapshot", action="store_true", help="skip the initial snapshot measurement"
    )
    parser.add_argument(
        "--snapshot-connections",
        type=int,
        default=SNAPSHOT_CONNECTIONS,
        help="initial snapshot: reader threads (snapshot.parallelism); the COPY ceiling "
        "uses as many connections",
    )
    parser.add_argument(
        "--snapshot-processes",
        type=int,
        default=0,
        help="initial snapshot: worker processes (snapshot.processes; 0: threads); the COPY "
        "ceiling then uses as many connections",
    )
    parser.add_argument(
        "--no-synchronous", action="store_true", help="skip the synchronous capture measurement"
    )
    parser.add_argument(
        "--only",
        choices=["synchronous"],
        help="run one section alone: synchronous (commit latency with cdcd as the "
        "synchronous standby; a minute instead of the whole benchmark)",
    )
    parser.add_argument(
        "--sync-commits-per-s", type=int, default=200, help="synchronous: commit rate"
    )
    parser.add_argument(
        "--sync-seconds", type=float, default=10.0, help="synchronous: seconds of each run"
    )
