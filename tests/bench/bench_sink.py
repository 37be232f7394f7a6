"""Throughput of the Kafka sink against the bundled broker (tansu).

Run: ``.venv/bin/python tests/bench/bench_sink.py [--messages N] [--compression lz4,none]``.

Measures what the pipeline pays per change message on the Kafka side: about
300-byte values with a key and the two cdcd headers, delivery reports counted
by a per-transaction bound method (``TxnTicket.on_delivery``, 10 messages per
transaction, as in the SPEC §9 workload), confirmation by the ack tracker.
Prints produce+delivery throughput (messages/s) and the cost of one
``KafkaSink.produce()`` call in µs (time inside produce calls only).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from cdcd.ack import AckTracker
from cdcd.local.broker import LocalBroker
from cdcd.protocol.lsn import Lsn
from cdcd.sink import KafkaSink, TopicSpec, build_producer_config, ensure_topics

TXN_SIZE = 10


def run(bootstrap: str, messages: int, overrides: dict[str, str | int], topic: str) -> None:
    config = build_producer_config(bootstrap, overrides, "cdcd-bench")
    sink = KafkaSink(config)
    tracker = AckTracker(Lsn(0))
    rng = random.Random(7)
    values = [os.urandom(150).hex().encode()[:300] for _ in range(64)]
    lsn = 0x1000000
    produce_s = 0.0
    started = time.perf_counter()
    ticket = tracker.open()
    for i in range(messages):
        if i % TXN_SIZE == 0 and i:
            lsn += 0x100
            ticket.seal(Lsn(lsn))
            ticket = tracker.open()
        key = str(rng.randrange(1_000_000)).encode()
        headers = [("cdcd.lsn", str(Lsn(lsn)).encode()), ("cdcd.seq", str(i % TXN_SIZE).encode())]
        ticket.add()
        t0 = time.perf_counter()
        sink.produce(topic, key, values[i & 63], headers, ticket.on_delivery)
        produce_s += time.perf_counter() - t0
        if i & 1023 == 0:
            sink.poll(0)
    ticket.seal(Lsn(lsn + 0x100))
    produced_at = time.perf_counter()
    remaining = sink.flush(60)
    elapsed = time.perf_counter() - started
    sink.close(5)
    assert remaining == 0, f"{remaining} messages not delivered"
    assert tracker.failure is None, tracker.failure
    assert tracker.confirmed == lsn + 0x100, (tracker.confirmed, lsn)
    label = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "defaults"
    print(
        f"{label:40s} {messages / elapsed:>10,.0f} msgs/s end-to-end "
        f"(produce loop {messages / (produced_at - started):>9,.0f} msgs/s), "
        f"produce() {produce_s / messages * 1e6:5.2f} µs/call, "
        f"blocked {sink.blocked_s:4.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--compression", default="lz4,none")
    parser.add_argument("--bootstrap", help="use this broker instead of starting tansu")
    args = parser.parse_args()

    def bench(bootstrap: str) -> None:
        for n, codec in enumerate(args.compression.split(",")):
            topic = f"bench.sink.{codec}.{n}.{os.getpid()}"
            ensure_topics(bootstrap, [TopicSpec(topic, 6, 1)], 10)
            run(bootstrap, args.messages, {"compression.type": codec}, topic)

    if args.bootstrap:
        bench(args.bootstrap)
    else:
        with LocalBroker.start() as broker:
            bench(broker.bootstrap_servers)


if __name__ == "__main__":
    main()
