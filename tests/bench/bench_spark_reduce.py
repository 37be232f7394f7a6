"""What the executors' reduction sends to the driver, and what it costs them (issue 28).

Run: ``.venv/bin/python -m tests.bench.bench_spark_reduce [--changes 200000] [--keys 1000 100000]``.
Not a test, and not run by the suite.

A Spark task of ``cdcd mirror`` decodes its Kafka partition and reduces it
(:func:`cdcd.spark.decode.reduce_native`) before the driver collects it.
Here: ``--changes`` updates (a third leaving a TOASTed column unchanged)
spread over ``--keys`` keys of an ``orders``-like table, encoded by the
daemon's encoder, decoded, then reduced; printed per key count: rows and
Arrow bytes before and after, the reduction's time, and the same with
``per_commit`` (history tables: one change per key and transaction, here one
change per transaction, so nothing collapses).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spark.envelopes import UNCHANGED, Col, EnvelopeFactory, kafka_batch, table_version

from cdcd.consumer import SchemaCatalog, fingerprint_header
from cdcd.spark.decode import decode_native, reduce_native

TABLE = table_version(
    "public", "orders", [Col("id", 20, key=True), Col("status", 25), Col("amount", 1700),
                         Col("note", 25)]
)  # fmt: skip


def run(changes: int, keys: int) -> None:
    rng = random.Random(keys)
    factory = EnvelopeFactory()
    for i in range(changes):
        note = UNCHANGED if i % 3 == 0 else f"note {i}"
        key = rng.randrange(keys)
        factory.change(TABLE, "u", after=[key, "shipped", f"{i}.50", note], lsn=100 + i, seq=0)
    catalog = SchemaCatalog("pg")
    for fingerprint, text in factory.published.items():
        catalog.add(fingerprint_header(fingerprint), json.loads(text))
    (native,) = decode_native(kafka_batch(factory.messages), catalog.schema)
    for per_commit in (False, True):
        started = time.perf_counter()
        reduced = reduce_native(native, per_commit=per_commit)
        took = time.perf_counter() - started
        print(
            f"changes={changes:>8,} keys={keys:>7,} per_commit={per_commit!s:5}  "
            f"rows {native.changes.num_rows:>8,} -> {reduced.changes.num_rows:>8,}  "
            f"bytes {native.changes.nbytes / 1e6:7.1f} MB -> {reduced.changes.nbytes / 1e6:7.1f} MB  "
            f"reduce {took:5.2f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000, 100_000])
    args = parser.parse_args()
    for keys in args.keys:
        run(args.changes, keys)


if __name__ == "__main__":
    main()
