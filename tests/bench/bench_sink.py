"""Throughput of the Kafka sink against the bundled broker (tansu).

Run: ``.venv/bin/python tests/bench/bench_sink.py [--messages N] [--compression lz4,none]``.

Measures what the pipeline pays per change message on the Kafka side: about
300-byte values with a key and the two cdcd headers, delivery reports counted
by a per-transaction bound method (``TxnTicket.on_delivery``, 10 messages per
transaction, as in the SPEC §9 workload), confirmation by the ack tracker.
Prints produce+delivery throughput (messages/s), the cost of one
``KafkaSink.produce()`` call in µs (time inside produce calls only), and a
bare-Producer baseline without delivery callbacks for comparison. Other
processes on the machine (tests of other engineers, tansu itself on the same
two cores) make single runs noisy: compare lines of one run.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from confluent_kafka import Producer

from cdcd.ack import AckTracker
from cdcd.protocol.lsn import Lsn
from cdcd.sink import KafkaSink, TopicSpec, build_producer_config, ensure_topics
from cdcd.sink.producer import classify_delivery_report
from cdcd.tools.local.broker import LocalBroker

TXN_SIZE = 10


def run(bootstrap: str, messages: int, overrides: dict[str, str | int], topic: str) -> None:
    """Produce ``messages`` through KafkaSink + AckTracker and print the figures."""
    config = build_producer_config(bootstrap, overrides, "cdcd-bench")
    sink = KafkaSink(config)
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    rng = random.Random(7)
    values = [os.urandom(150).hex().encode() for _ in range(64)]  # 300 bytes each
    keys = [str(rng.randrange(1_000_000)).encode() for _ in range(4096)]
    seqs = [str(i).encode() for i in range(TXN_SIZE)]
    lsn = 0x1000000
    produce_s = 0.0
    started = time.perf_counter()
    for txn in range(messages // TXN_SIZE):
        lsn += 0x100
        lsn_header = str(Lsn(lsn)).encode()  # once per transaction, like the pipeline
        ticket = tracker.open()
        report = ticket.on_delivery
        for seq in range(TXN_SIZE):
            i = txn * TXN_SIZE + seq
            headers = [("cdcd.lsn", lsn_header), ("cdcd.seq", seqs[seq])]
            ticket.add()
            t0 = time.perf_counter()
            sink.produce(topic, keys[i & 4095], values[i & 63], headers, report)
            produce_s += time.perf_counter() - t0
        ticket.seal(Lsn(lsn + 0x80))
        if txn % 10 == 0:
            sink.poll(0)
    produced_at = time.perf_counter()
    remaining = sink.flush(60)
    elapsed = time.perf_counter() - started
    sink.close(5)
    total = messages // TXN_SIZE * TXN_SIZE
    assert remaining == 0, f"{remaining} messages not delivered"
    assert tracker.failure is None, tracker.failure
    assert tracker.confirmed == lsn + 0x80, (tracker.confirmed, lsn)
    label = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "defaults"
    print(
        f"KafkaSink {label:28s} {total / elapsed:>9,.0f} msgs/s produced+acked+confirmed "
        f"(produce loop {total / (produced_at - started):>9,.0f} msgs/s); "
        f"produce() {(produce_s - sink.blocked_s) / total * 1e6:5.2f} µs/call "
        f"+ {sink.blocked_s:4.1f} s blocked on a full queue"
    )


def run_raw(bootstrap: str, messages: int, topic: str) -> None:
    """Baseline: bare confluent_kafka.Producer, same config, no delivery callbacks."""
    producer = Producer(build_producer_config(bootstrap, {}, "cdcd-bench-raw"))
    value = os.urandom(150).hex().encode()
    headers = [("cdcd.lsn", b"0/01000000"), ("cdcd.seq", b"0")]
    started = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                producer.produce(topic, value, str(i).encode(), headers=headers)
                break
            except BufferError:
                producer.poll(0.01)
        if i % 100 == 0:
            producer.poll(0)
    producer.flush(60)
    elapsed = time.perf_counter() - started
    print(f"raw Producer, no callbacks {'':21s} {messages / elapsed:>9,.0f} msgs/s")


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
        topic = f"bench.sink.raw.{os.getpid()}"
        ensure_topics(bootstrap, [TopicSpec(topic, 6, 1)], 10)
        run_raw(bootstrap, args.messages, topic)

    if args.bootstrap:
        bench(args.bootstrap)
    else:
        with LocalBroker.start() as broker:
            bench(broker.bootstrap_servers)


if __name__ == "__main__":
    main()
