"""Throughput of the Spark side's decode step for the SPEC §9 ``orders`` rows.

Run: ``.venv/bin/python -m tests.bench.bench_spark_decode [--rows N] [--no-spark]``.

Envelopes are made by cdcd's own encoder (``TableEncoder``, single-object
wire format) for the ``orders`` shape of SPEC §9 -- bigserial id, int
customer_id, 'shipped', numeric(12,2) amount, timestamptz created_at, md5 hex
note, alternating boolean flags, a two-key jsonb payload -- as inserts in
transactions of 10 rows, and laid out as the rows of the ``cdcd-kafka``
source (value, headers, topic, partition, offset). Printed:

* ``decode_batch`` on one core, in-process: Avro bodies to the typed Arrow
  columns (decimal128, timestamp[us, UTC], ...), 8 192 rows per batch --
  the work each Spark task does;
* the same through Spark (``local[2]``, ``mapInArrow``, written to the
  ``noop`` sink), which adds Arrow transfer to and from the Python workers
  and spreads over two cores. The Kafka read is not included.

Other processes on the machine make single runs noisy: compare lines of one
run.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
from spark.envelopes import Col, EnvelopeFactory, kafka_batch, numeric, table_version

from cdcd.consumer import SchemaCatalog
from cdcd.spark.decode import DecodePlan, decode_batch, decode_native

ORDERS = [
    Col("id", 20, key=True),
    Col("customer_id", 23),
    Col("status", 25),
    Col("amount", 1700, numeric(12, 2)),
    Col("created_at", 1184),
    Col("note", 25),
    Col("flags", 16),
    Col("payload", 3802),
]
BATCH = 8192


def make_batches(rows: int) -> tuple[list[pa.RecordBatch], DecodePlan, SchemaCatalog]:
    rng = random.Random(9)
    factory = EnvelopeFactory(prefix="bench")
    table = table_version("public", "orders", ORDERS)
    lsn = 0x1_0000_0000
    for i in range(rows):
        if i % 10 == 0:
            lsn += 0x200
        factory.change(
            table,
            "c",
            after=[
                str(i + 1),
                str(rng.randrange(1, 100_000)),
                "shipped",
                f"{rng.randrange(1, 10**8) / 100:.2f}",
                f"2026-11-21 12:{i // 60 % 60:02d}:{i % 60:02d}.{rng.randrange(10**6):06d}+00",
                f"{rng.getrandbits(128):032x}",
                "t" if i % 2 else "f",
                f'{{"qty": {rng.randrange(1, 9)}, "sku": "SKU-{i}"}}',
            ],
            lsn=lsn,
            seq=i % 10,
        )
    messages = factory.messages
    batches = [kafka_batch(messages[i : i + BATCH]) for i in range(0, len(messages), BATCH)]
    catalog = SchemaCatalog("bench")
    import json

    envelopes = {}
    for key, text in factory.published.items():
        schema = json.loads(text)
        catalog.add(b"\xc3\x01" + bytes.fromhex(key), schema)
        if schema["name"] == "Envelope":
            envelopes[b"\xc3\x01" + bytes.fromhex(key)] = schema
    reader = next(iter(envelopes.values()))
    return batches, DecodePlan.build("bench.public.orders", reader, envelopes), catalog


def bench_local(
    batches: list[pa.RecordBatch], plan: DecodePlan, catalog: SchemaCatalog, repeats: int
) -> None:
    rows = sum(b.num_rows for b in batches)
    for label, fn in (
        ("decode_native (writer layout)", lambda b: decode_native(b, catalog.schema)),
        ("decode_batch (reader layout)", lambda b: decode_batch(b, plan)),
    ):
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for batch in batches:
                fn(batch)
            best = min(best, time.perf_counter() - started)
        print(
            f"{label:34s} 1 core        {rows / best:>10,.0f} rows/s  ({best / rows * 1e6:.2f} µs/row)"
        )


def bench_spark(batches: list[pa.RecordBatch], plan: DecodePlan, repeats: int) -> None:
    from cdcd.spark.cli import build_session
    from cdcd.spark.dataframes import decode_changes

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = build_session(
        "cdcd-bench", master="local[2]", conf={"spark.sql.shuffle.partitions": "2"}
    )
    try:
        table = pa.Table.from_batches(batches)
        raw = spark.createDataFrame(table).repartition(2).cache()
        rows = raw.count()
        decoded = decode_changes(raw, plan)
        decoded.write.format("noop").mode("overwrite").save()  # warm the Python workers
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            decoded.write.format("noop").mode("overwrite").save()
            best = min(best, time.perf_counter() - started)
        print(f"{'Spark mapInArrow decode_changes':34s} local[2]      {rows / best:>10,.0f} rows/s")
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-spark", action="store_true", help="only the in-process figure")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    batches, plan, catalog = make_batches(args.rows)
    print(
        f"{args.rows:,} orders envelopes (cdcd encoder, single-object) made in "
        f"{time.perf_counter() - started:.1f} s; Python {platform.python_version()}, "
        f"pyarrow {pa.__version__}, {os.cpu_count()} CPUs"
    )
    bench_local(batches, plan, catalog, args.repeats)
    if not args.no_spark:
        bench_spark(batches, plan, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
