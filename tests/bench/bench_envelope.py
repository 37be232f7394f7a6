"""Cost per row of decode + convert + encode for the SPEC §9 ``orders`` row.

Uses the Insert payloads captured from a real PostgreSQL 15 walsender
(``tests/protocol/golden/orders.json``): pgoutput bytes -> ``PgOutputDecoder``
-> key and envelope bytes from the prepared ``TableEncoder``. No I/O.

    .venv/bin/python -m tests.bench.bench_envelope
"""

from __future__ import annotations

import time

from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import OP_CREATE, EnvelopeEncoder, make_stamp
from cdcd.protocol import Lsn, PgOutputDecoder
from tests.bench.orders_golden import orders_payloads


class _Wire:
    def header(self, topic: str, role: str, schema: dict[str, object]) -> bytes:
        return b"\xc3\x01" + b"\x00" * 8


def main() -> None:
    relation_payloads, inserts = orders_payloads()
    decoder = PgOutputDecoder(1)
    relations = RelationCache(StaticCatalog(), key_lookup=lambda s, t: ("id",))
    for payload in relation_payloads:
        relations.on_relation(decoder.decode(payload))  # type: ignore[arg-type]
    relation_id = decoder.decode(inserts[0]).relation_id  # type: ignore[union-attr]
    encoder = EnvelopeEncoder("pg", "app", _Wire()).for_table(relations.get(relation_id))
    stamp = make_stamp(1234, Lsn(0x1_0000_0000), 1_795_000_000_000)
    decode = decoder.decode

    def decode_only(n: int) -> None:
        for i in range(n):
            decode(inserts[i % len(inserts)])

    def full(n: int) -> None:
        for i in range(n):
            new = decode(inserts[i % len(inserts)]).new  # type: ignore[union-attr]
            encoder.change(OP_CREATE, None, new, stamp, i)

    rows = 100_000
    print(f"{'step':<34}{'µs/row (min of 5)':>20}{'rows/s':>12}")
    for name, fn in (("decode (pgoutput -> Insert)", decode_only), ("decode + convert + encode", full)):
        best = min(_time(fn, rows) for _ in range(5))
        print(f"{name:<34}{best / rows * 1e6:>20.2f}{rows / best:>12,.0f}")


def _time(fn: object, rows: int) -> float:
    started = time.perf_counter()
    fn(rows)  # type: ignore[operator]
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
