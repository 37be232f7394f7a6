"""Cost of the column codecs for one SPEC §9 ``orders`` row.

Run: ``.venv/bin/python tests/bench/bench_values.py [--rows N]``.

Converts pre-generated pgoutput values of the 8 ``orders`` columns (int8,
int4, text 'shipped', numeric(12,2), timestamptz, md5 text, bool, jsonb) to
Avro binary with the codecs (also with ``created_at`` shared per 10-row
transaction, as ``DEFAULT now()`` gives), and prints
µs per row (codec calls only, plus the join into one record body as the
envelope does) and the per-column split.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections.abc import Callable

from cdcd.decode.types import StaticCatalog
from cdcd.decode.values import column_codec

# (name, type oid, typmod) of the orders columns, in table order.
NUMERIC_12_2 = ((12 << 16) | 2) + 4
COLUMNS = (
    ("id", 20, -1),
    ("customer_id", 23, -1),
    ("status", 25, -1),
    ("amount", 1700, NUMERIC_12_2),
    ("created_at", 1184, -1),
    ("note", 25, -1),
    ("flags", 16, -1),
    ("payload", 3802, -1),
)


def make_rows(count: int, txn_now: bool = False) -> list[list[bytes]]:
    """The rows in pgoutput's text format.

    ``txn_now``: ``created_at`` is shared by each 10-row transaction, as with the
    workload's ``DEFAULT now()``; otherwise every row has its own timestamp.
    """
    rng = random.Random(7)
    text_rows: list[list[bytes]] = []
    base_us = 1_715_000_000_000_000
    for i in range(count):
        row_id = 1_000_000 + i
        customer = rng.randrange(1, 100_000)
        cents = rng.randrange(1, 10_000_000)
        micros = base_us + (i - i % 10 if txn_now else i) * 1_234
        secs, frac = divmod(micros, 1_000_000)
        # As PostgreSQL prints it with TimeZone=UTC: trailing fraction zeros trimmed.
        fraction = "." + f"{frac:06d}".rstrip("0") if frac else ""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(secs)) + fraction + "+00"
        note = hashlib.md5(str(i).encode()).hexdigest().encode()
        payload = json.dumps({"k": i, "v": "x" * (i % 7)}).encode()
        text_rows.append(
            [
                str(row_id).encode(),
                str(customer).encode(),
                b"shipped",
                f"{cents // 100}.{cents % 100:02d}".encode(),
                stamp.encode(),
                note,
                b"t" if i % 2 else b"f",
                payload,
            ]
        )
    return text_rows


def bench(rows: list[list[bytes]], encoders: list[Callable[[bytes], bytes]]) -> float:
    """µs per row, best of 5 runs."""
    best = float("inf")
    pairs = list(enumerate(encoders))
    for _ in range(5):
        started = time.perf_counter()
        for row in rows:
            b"".join([b"\x02" + encode(row[i]) for i, encode in pairs])
        best = min(best, time.perf_counter() - started)
    return best / len(rows) * 1e6


def per_column(rows: list[list[bytes]], encoders: list[Callable[[bytes], bytes]]) -> list[float]:
    out = []
    for i, encode in enumerate(encoders):
        values = [row[i] for row in rows]
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for value in values:
                encode(value)
            best = min(best, time.perf_counter() - started)
        out.append(best / len(values) * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    catalog = StaticCatalog()
    codecs = [column_codec(oid, typmod, catalog) for _name, oid, typmod in COLUMNS]
    encoders = [c.from_text for c in codecs]
    for label, rows in (
        ("text", make_rows(args.rows)),
        ("text, created_at = now() per 10-row txn", make_rows(args.rows, txn_now=True)),
    ):
        total = bench(rows, encoders)
        split = per_column(rows, encoders)
        detail = ", ".join(
            f"{name} {us:.2f}" for (name, _oid, _typmod), us in zip(COLUMNS, split, strict=True)
        )
        print(
            f"{label:6s}: {total:.2f} µs/row ({1e6 / total:,.0f} rows/s); per column µs: {detail}"
        )


if __name__ == "__main__":
    main()
