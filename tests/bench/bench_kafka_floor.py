"""What one Kafka message costs the producing process: confluent-kafka against librdkafka alone.

Run: ``.venv/bin/python -m tests.bench.bench_kafka_floor [--messages 600000] [--runs 3]
[--partitions 6] [--producers confluent,compiled,c] [--set linger.ms=100 ...]``
(``--set``: a producer property over cdcd's configuration, repeatable).

Three producers send the same messages: SPEC §9 ``orders`` rows as cdcd
encodes them (the captured ``orders`` relation, rows varied as the §9 load's,
through the real ``TableEncoder``), cycled, with cdcd's producer
configuration (``build_producer_config``: idempotent, ``acks=all``, lz4, cdcd's
batching), to a topic of 6 partitions of the bundled broker, every message
with a delivery report:

* ``confluent``: ``confluent_kafka.Producer.produce`` with the two headers,
  called as cdcd's hot path calls it (positionally, one ticket-like callback
  per 10 messages, fetched once per "transaction");
* ``compiled``: the same Python loop on cdcd's compiled producer
  (``cdcd.sink._rdkafka``), which serves each run of a ticket's successful
  reports as one ``on_delivered(count)``;
* ``c``: ``tests/bench/kafka_floor.c``, compiled here with ``gcc`` against the
  librdkafka that confluent-kafka ships (so the same library version), the
  same headers built in C, delivery reports counted in C: no Python at all.

Each variant also runs without the headers, and with ``compression.type=none``.
The figure is the CPU of the producing process (all its threads, librdkafka's
included) from its first produce to the end of its flush, per message: what
any process that produces each row as a Kafka message pays at least. The
broker's CPU is not counted. The C build needs ``rdkafka.h``
(``apt-get install librdkafka-dev``); without it only the Python rows print.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import OP_CREATE, EnvelopeEncoder, make_stamp
from cdcd.protocol import Lsn, PgOutputDecoder
from cdcd.protocol.messages import Relation, TupleData
from cdcd.protocol.native import native_status
from cdcd.sink import TopicSpec, ensure_topics
from cdcd.sink.native import producer_factory
from cdcd.sink.producer import build_producer_config
from cdcd.tools.bench.ceilings import produce_timed
from cdcd.tools.local.broker import LocalBroker
from tests.bench.orders_golden import orders_payloads

SOURCE = Path(__file__).with_name("kafka_floor.c")
PARTITIONS = 6
LSN = b"0/1A2B3C4D"


class _Wire:
    """The Confluent wire header with schema id 0: the same bytes per message as cdcd's."""

    def header(self, topic: str, role: str, schema: dict[str, object]) -> bytes:
        return b"\x00" + b"\x00" * 4


def orders_messages(count: int = 2_000) -> list[tuple[bytes | None, bytes]]:
    """``count`` SPEC §9 ``orders`` rows as cdcd's (key, value) pairs.

    The relation is the one captured from PostgreSQL; the rows vary as the
    §9 load's do (random customer and amount, an md5 note, alternating flag,
    a two-key payload), so that lz4 compresses them as it would cdcd's.
    """
    relation_payloads, _ = orders_payloads()
    decoder = PgOutputDecoder(1)
    relations = RelationCache(StaticCatalog(), key_lookup=lambda s, t: ("id",))
    relation = decoder.decode(relation_payloads[0])
    assert isinstance(relation, Relation)
    relations.on_relation(relation)
    encoder = EnvelopeEncoder("pg", "app", _Wire()).for_table(relations.get(relation.relation_id))
    stamp = make_stamp(1234, Lsn(0x1A2B3C4D), 1_795_000_000_000)
    rng = random.Random(42)
    messages: list[tuple[bytes | None, bytes]] = []
    for i in range(count):
        row_id = 1_000_000 + i
        values = (
            b"%d" % row_id,
            b"%d" % rng.randint(1, 100_000),
            b"shipped",
            b"%d.%02d" % (rng.randint(1, 9_999), rng.randint(0, 99)),
            b"2026-11-21 19:41:%02d.%06d+00" % (i % 60, rng.randint(0, 999_999)),
            hashlib.md5(b"%d" % row_id).hexdigest().encode(),
            b"t" if i % 2 else b"f",
            b'{"qty": %d, "sku": "SKU-%d"}' % (rng.randint(1, 9), rng.randint(1, 999)),
        )
        messages.append(
            encoder.change(OP_CREATE, None, TupleData(b"t" * len(values), values), stamp, i)
        )
    return messages


def write_messages(messages: list[tuple[bytes | None, bytes]], path: Path) -> None:
    with path.open("wb") as out:
        for key, value in messages:
            out.write(
                struct.pack(">I", 0xFFFFFFFF) if key is None else struct.pack(">I", len(key)) + key
            )
            out.write(struct.pack(">I", len(value)) + value)


def bundled_librdkafka() -> Path:
    """The librdkafka confluent-kafka's wheel ships (auditwheel names it ``librdkafka-<hash>.so.1``)."""
    import confluent_kafka

    libs = Path(confluent_kafka.__file__).resolve().parent.parent / "confluent_kafka.libs"
    found = sorted(glob.glob(str(libs / "librdkafka*.so*")))
    if not found:
        raise SystemExit(f"no librdkafka in {libs}: is confluent-kafka installed from its wheel?")
    return Path(found[0])


def build_c(workdir: Path) -> Path | None:
    """``kafka_floor.c`` linked against the bundled librdkafka; None (and why) when it cannot be built."""
    if shutil.which("gcc") is None:
        print("no gcc: the C producer is skipped", file=sys.stderr)
        return None
    library = bundled_librdkafka()
    binary = workdir / "kafka_floor"
    command = [
        "gcc",
        "-O2",
        "-o",
        str(binary),
        str(SOURCE),
        f"-L{library.parent}",
        f"-l:{library.name}",
        f"-Wl,-rpath,{library.parent}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(
            "the C producer did not build (rdkafka.h comes with `apt-get install librdkafka-dev`):\n"
            + result.stderr.strip()[-800:],
            file=sys.stderr,
        )
        return None
    return binary


def run_c(
    binary: Path, config: dict[str, Any], topic: str, messages: int, headers: bool, file: Path
) -> dict[str, Any]:
    argv = [str(binary), str(messages), "1" if headers else "0", topic, str(file)]
    for name, value in config.items():
        argv += [name, str(value)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    if result.returncode != 0:
        raise SystemExit(f"kafka_floor failed: {result.stderr.strip()}")
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def run_python(
    producer: str, config: dict[str, Any], topic: str, messages: int, headers: bool, file: Path
) -> dict[str, Any]:
    """The same from Python, in a process of its own (so no run inherits another's heap)."""
    request = json.dumps(
        {
            "producer": producer,
            "config": config,
            "topic": topic,
            "messages": messages,
            "headers": headers,
            "file": str(file),
        }
    )
    argv = [sys.executable, "-m", "tests.bench.bench_kafka_floor", "--python-worker"]
    result = subprocess.run(
        argv, input=request, capture_output=True, text=True, timeout=1800, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"the Python producer failed: {result.stderr.strip()[-1500:]}")
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def read_messages(path: Path) -> list[tuple[bytes | None, bytes]]:
    data, at, out = path.read_bytes(), 0, []
    while at < len(data):
        (key_len,) = struct.unpack_from(">I", data, at)
        at += 4
        key = None if key_len == 0xFFFFFFFF else data[at : at + key_len]
        at += 0 if key is None else key_len
        (value_len,) = struct.unpack_from(">I", data, at)
        at += 4
        out.append((key, data[at : at + value_len]))
        at += value_len
    return out


def python_worker() -> None:
    request = json.loads(sys.stdin.read())
    samples = read_messages(Path(request["file"]))
    topic, total, with_headers = (
        request["topic"],
        int(request["messages"]),
        bool(request["headers"]),
    )
    factory = producer_factory() if request["producer"] == "compiled" else Producer
    if request["producer"] == "compiled" and factory is Producer:
        raise SystemExit(f"the compiled producer is not in use: {native_status()}")
    producer = factory(request["config"])
    producer.produce(topic, b"warm-up")
    producer.flush(30)
    lsn = ("cdcd.lsn", LSN) if with_headers else None
    seconds, cpu = produce_timed(producer, topic, samples, total, lsn)
    print(json.dumps({"messages": total, "cpu_s": round(cpu, 4), "seconds": round(seconds, 4)}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=600_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=PARTITIONS, help="of each topic (cdcd bench's: 6)")
    parser.add_argument(
        "--bootstrap-servers", default=None, help="default: a throwaway bundled broker"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="a producer property over cdcd's (repeatable), e.g. linger.ms=100",
    )
    parser.add_argument(
        "--producers", default="confluent,compiled,c", help="which to run (comma-separated)"
    )
    parser.add_argument("--python-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_worker:
        python_worker()
        return
    with tempfile.TemporaryDirectory(prefix="cdcd-kafka-floor-") as tmp:
        workdir = Path(tmp)
        file = workdir / "messages.bin"
        messages = orders_messages()
        write_messages(messages, file)
        binary = build_c(workdir)
        broker = None if args.bootstrap_servers else LocalBroker.start()
        try:
            bootstrap = args.bootstrap_servers or broker.bootstrap_servers  # type: ignore[union-attr]
            overrides = dict(item.split("=", 1) for item in args.set)
            base = build_producer_config(bootstrap, overrides, "cdcd-kafka-floor")
            print(
                f"# {os.uname().nodename}: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
            )
            print(
                f"# {len(messages)} distinct orders messages, mean key {sum(len(k or b'') for k, _ in messages) / len(messages):.1f} B,"
                f" value {sum(len(v) for _, v in messages) / len(messages):.1f} B; {args.messages:,} per run; {args.partitions} partitions"
                + "".join(f"; {item}" for item in args.set)
            )
            print(
                f"{'producer':<10}{'headers':>8}{'compression':>13}   µs CPU per message (runs)        msgs/s (best)"
            )
            variants = [(True, "lz4"), (False, "lz4"), (True, "none")]
            kinds = [k for k in ("confluent", "compiled", "c") if k in args.producers.split(",")]
            if producer_factory() is Producer and "compiled" in kinds:
                print(f"# the compiled producer is not in use: {native_status()}")
                kinds.remove("compiled")
            if binary is None and "c" in kinds:
                kinds.remove("c")
            for kind in kinds:
                for with_headers, compression in variants:
                    config = dict(base, **{"compression.type": compression})
                    figures, best_rate = [], 0.0
                    for run in range(args.runs):
                        topic = f"kafka_floor_{kind}_{int(with_headers)}_{compression}_{run}_{time.time_ns()}"
                        ensure_topics(bootstrap, [TopicSpec(topic, args.partitions, 1)], 30)
                        if kind == "c":
                            data = run_c(binary, config, topic, args.messages, with_headers, file)  # type: ignore[arg-type]
                        else:
                            data = run_python(
                                kind, config, topic, args.messages, with_headers, file
                            )
                        figures.append(data["cpu_s"] / data["messages"] * 1e6)
                        best_rate = max(best_rate, data["messages"] / data["seconds"])
                    shown = ", ".join(f"{f:.2f}" for f in figures)
                    print(
                        f"{kind:<10}{'two' if with_headers else 'none':>8}{compression:>13}   {shown:<32}{best_rate:>12,.0f}"
                    )
        finally:
            if broker is not None:
                broker.cleanup()


if __name__ == "__main__":
    main()
