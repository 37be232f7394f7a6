"""Decode cost of one pgoutput message for the SPEC section 9 ``orders`` row.

Run: ``.venv/bin/python -m tests.bench.bench_decode [--iterations N] [--repeats R]``.

The payloads are the ones PostgreSQL 15 really sent for ``orders`` rows
(``tests/protocol/golden/orders.json``, written by
``python -m tests.protocol.capture_golden``): a text-format Insert of 8
columns (bigserial id, int customer_id, 'shipped', numeric(12,2) amount,
timestamptz created_at, md5 note, boolean flags, two-key jsonb payload), and
the Begin and Commit around them. Without that file an equivalent Insert is
built with the test encoder.

Each row of the table is ``iterations`` back-to-back ``decode`` calls on one
decoder, timed with ``time.perf_counter_ns`` and repeated ``repeats`` times;
min and median are per message.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Begin, Commit, Insert, Message, Relation, TupleData
from tests.protocol.pgoutput_encoder import encode

ORDERS_GOLDEN = Path(__file__).resolve().parents[1] / "protocol" / "golden" / "orders.json"


@dataclass(frozen=True)
class Payloads:
    source: str
    begin: bytes
    relation: bytes
    insert: bytes
    commit: bytes
    #: Begin, the Inserts, Commit: the steady state (a Relation is sent once per table and
    #: session, so it is timed on its own).
    transaction: tuple[bytes, ...]


def _synthetic() -> Payloads:
    row = TupleData(
        b"tttttttt",
        (
            b"123457",
            b"4711",
            b"shipped",
            b"1234.56",
            b"2024-05-06 07:08:09.123456+00",
            b"5d41402abc4b2a76b9719d911017c592",
            b"t",
            b'{"qty": 3, "sku": "SKU-123457"}',
        ),
    )
    begin = encode(Begin(Lsn(0x1_2345_6789), 768_000_000_000_000, 123_456))
    insert = encode(Insert(None, 16_498, row))
    commit = encode(Commit(0, Lsn(0x1_2345_6789), Lsn(0x1_2345_67B9), 768_000_000_000_000))
    relation = encode(Relation(None, 16_498, "public", "orders", "d", ()))
    return Payloads("synthetic (encoder)", begin, relation, insert, commit,
                    (begin, *[insert] * 10, commit))  # fmt: skip


def load_payloads() -> Payloads:
    if not ORDERS_GOLDEN.exists():
        return _synthetic()
    doc = json.loads(ORDERS_GOLDEN.read_text("utf-8"))
    payloads = tuple(bytes.fromhex(m["hex"]) for m in doc["messages"])
    by_tag: dict[bytes, list[bytes]] = {}
    for payload in payloads:
        by_tag.setdefault(payload[:1], []).append(payload)
    inserts = by_tag[b"I"]
    return Payloads(
        f"captured from {doc['server_version'].split(' on ')[0]} ({ORDERS_GOLDEN.name})",
        by_tag[b"B"][0],
        by_tag[b"R"][0],
        inserts[len(inserts) // 2],  # a middle row: typical id/amount widths
        by_tag[b"C"][0],
        tuple(x for x in payloads if x[:1] != b"R"),
    )


def time_per_call(
    fn: Callable[[bytes], Message], payload: bytes, iterations: int, repeats: int
) -> list[float]:
    """Per-call cost in µs for each repeat."""
    results = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            fn(payload)
        results.append((time.perf_counter_ns() - start) / iterations / 1000)
    return results


def time_transaction(payloads: Sequence[bytes], iterations: int, repeats: int) -> list[float]:
    """Per-transaction cost in µs of decoding the whole Begin..Commit sequence."""
    decode = PgOutputDecoder(1).decode
    results = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            for payload in payloads:
                decode(payload)
        results.append((time.perf_counter_ns() - start) / iterations / 1000)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pgoutput decode cost per message")
    parser.add_argument("--iterations", type=int, default=20_000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    p = load_payloads()
    decoder = PgOutputDecoder(1)
    insert = decoder.decode(p.insert)
    assert isinstance(insert, Insert) and len(insert.new.values) == 8, insert
    print(f"payloads: {p.source}")
    print(f"python {platform.python_version()} ({sys.implementation.name}), "
          f"{args.iterations} calls x {args.repeats} repeats")  # fmt: skip
    print(f"orders Insert: {len(p.insert)} bytes, values {insert.new.values}")
    print()

    rows: list[tuple[str, int, list[float]]] = []
    for label, payload, iterations in (
        ("Insert (orders, 8 text cols)", p.insert, args.iterations),
        ("Begin", p.begin, args.iterations),
        ("Commit", p.commit, args.iterations),
        # Relation is rare (once per table per session) and slow: fewer calls.
        ("Relation (orders)", p.relation, max(1, args.iterations // 10)),
    ):
        results = time_per_call(decoder.decode, payload, iterations, args.repeats)
        rows.append((label, len(payload), results))
    tx_iterations = max(1, args.iterations // len(p.transaction))
    tx = time_transaction(p.transaction, tx_iterations, args.repeats)

    print(f"{'message':32s} {'bytes':>6s} {'min µs':>8s} {'median µs':>10s} {'msgs/s (min)':>13s}")
    for label, size, results in rows:
        best = min(results)
        print(
            f"{label:32s} {size:6d} {best:8.3f} {statistics.median(results):10.3f} "
            f"{1e6 / best:13,.0f}"
        )
    n_rows = sum(1 for x in p.transaction if x[:1] == b"I")
    best = min(tx)
    print(
        f"{f'transaction ({len(p.transaction)} msgs, {n_rows} rows)':32s} "
        f"{sum(map(len, p.transaction)):6d} {best:8.3f} {statistics.median(tx):10.3f} "
        f"{1e6 / best * n_rows:13,.0f} rows/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
