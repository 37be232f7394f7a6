"""What the server can do with no cdcd at all: the ceilings cdcd is compared with.

``pg_recvlogical`` draining the slot, the server decoding with no client (a
peek on a copy of the slot) and ``COPY … TO STDOUT`` of the loaded table.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdcd.errors import DefiniteError
from cdcd.naming import LSN_HEADER, SEQ_HEADER
from cdcd.tools.bench.cpu import BackendCpu, backend_cpu_s, backend_pid
from cdcd.tools.bench.workload import (
    CEILING_SLOT,
    PEEK_SLOT,
    PGOUTPUT_OPTIONS,
    SCHEMA,
    SLOT_PID_SQL,
    connect,
    drop_slot,
)


def recvlogical_ceiling(dsn: str, bindir: Path, end_lsn: int) -> tuple[float, float]:
    """pg_recvlogical to /dev/null up to ``end_lsn``: (seconds, walsender CPU seconds)."""
    binary = bindir / "pg_recvlogical"
    if not binary.exists():
        found = shutil.which("pg_recvlogical")
        if found is None:
            raise DefiniteError("pg_recvlogical not found", hint="install postgresql-15")
        binary = Path(found)
    end = f"{end_lsn >> 32:X}/{end_lsn & 0xFFFFFFFF:X}"
    options = [arg for name, value in PGOUTPUT_OPTIONS for arg in ("-o", f"{name}={value}")]
    argv = [
        str(binary), "--dbname", dsn, "--slot", CEILING_SLOT, "--start", "--no-loop",
        *options, "--endpos", end, "-f", "/dev/null",
    ]  # fmt: skip
    with BackendCpu(dsn, SLOT_PID_SQL, (CEILING_SLOT,)) as walsender:
        started = time.monotonic()
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        _, stderr = process.communicate()
        elapsed = time.monotonic() - started
    if process.returncode != 0:
        raise DefiniteError(f"pg_recvlogical failed: {stderr.strip()}")
    if not walsender.pids:
        raise DefiniteError("the walsender serving pg_recvlogical was not found")
    return elapsed, walsender.cpu_s()

@dataclass
class Decode:
    seconds: float
    server_cpu_s: float
    messages: int


def decode_ceiling(dsn: str, end_lsn: int, rows: int) -> Decode:
    """The server decoding the load with no client: a peek on the copy of the slot.

    ``pg_logical_slot_peek_binary_changes`` decodes in the backend that calls
    it (same pgoutput options as ``pg_recvlogical``) into a tuplestore, and
    ``count(*)`` reads that back: no network, no client, nothing confirmed.
    """
    conn = connect(dsn)
    try:
        pid = backend_pid(conn)
        end = f"{end_lsn >> 32:X}/{end_lsn & 0xFFFFFFFF:X}"
        options = [item for pair in PGOUTPUT_OPTIONS for item in pair]
        placeholders = ", ".join(["%s"] * len(options))
        sql = (
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes("
            f"%s, %s::pg_lsn, NULL, {placeholders})"
        )
        with conn.cursor() as cur:
            cpu_start = backend_cpu_s(pid)
            started = time.monotonic()
            cur.execute(sql, (PEEK_SLOT, end, *options))
            messages = int(cur.fetchone()[0])
            elapsed = time.monotonic() - started
            cpu = backend_cpu_s(pid) - cpu_start
    finally:
        # The copy holds WAL back for as long as it exists: never leave it.
        drop_slot(conn, PEEK_SLOT)
        conn.close()
    # BEGIN, one INSERT per row, COMMIT, and the RELATION: fewer means the
    # peek stopped short of the load and its rate would flatter the server.
    if messages < rows:
        raise DefiniteError(f"the peek decoded {messages} messages for {rows} rows")
    return Decode(elapsed, cpu, messages)


@dataclass
class Copy:
    seconds: float
    server_cpu_s: float
    rows: int


def copy_ceiling(dsn: str, connections: int) -> Copy:
    """``COPY … TO STDOUT`` of the whole table over ``connections`` connections, to /dev/null.

    Each connection copies one contiguous range of ``id`` (the whole table
    when there is one) from a client process of its own (``copy_worker``),
    so that no client shares an interpreter lock with another; all start
    together, and the time is until the last one ends. The server CPU is that
    of the backends that copied, read from /proc before and after (exact).
    """
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT min(id), max(id) FROM {SCHEMA}.orders")
            low, high = (int(v or 0) for v in cur.fetchone())
    finally:
        conn.close()
    step = (high - low + connections) // connections
    columns = "id, customer_id, status, amount, created_at, note, flags, payload"
    statements = [
        f"COPY {SCHEMA}.orders TO STDOUT"
        if connections == 1
        else f"COPY (SELECT {columns} FROM {SCHEMA}.orders "
        f"WHERE id >= {low + i * step} AND id < {low + (i + 1) * step}) TO STDOUT"
        for i in range(connections)
    ]
    argv = [sys.executable, "-c", "from cdcd.tools.bench.ceilings import copy_worker; copy_worker()"]
    workers = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in statements
    ]
    try:
        for worker, statement in zip(workers, statements, strict=True):
            _tell(worker, json.dumps({"dsn": dsn, "statement": statement}))
        pids = [int(_hear(worker)) for worker in workers]
        cpu_start = sum(backend_cpu_s(pid) for pid in pids)
        started = time.monotonic()
        for worker in workers:
            _tell(worker, "go")
        copied = sum(int(_hear(worker)) for worker in workers)
        elapsed = time.monotonic() - started
        cpu = sum(backend_cpu_s(pid) for pid in pids) - cpu_start
    finally:
        for worker in workers:
            if worker.stdin is not None:
                worker.stdin.close()  # the worker closes its connection and exits
        for worker in workers:
            worker.wait(60)
    failed = [w.returncode for w in workers if w.returncode != 0]
    if failed:
        raise DefiniteError(f"a COPY client exited with {failed[0]}")
    return Copy(elapsed, cpu, copied)


def _tell(worker: subprocess.Popen[str], line: str) -> None:
    assert worker.stdin is not None
    worker.stdin.write(line + "\n")
    worker.stdin.flush()


def _hear(worker: subprocess.Popen[str]) -> str:
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line:
        worker.wait(60)
        raise DefiniteError(f"a COPY client exited with {worker.returncode} before it answered")
    return line.strip()


def copy_worker() -> None:
    """One client of the ``COPY`` ceiling, driven over stdin/stdout by ``copy_ceiling``.

    Reads ``{"dsn", "statement"}``, connects and prints its backend's pid;
    on ``go`` copies into a buffered /dev/null (about as little as a client
    can do with a row) and prints the rows copied; closes at end of input.
    """
    request = json.loads(sys.stdin.readline())
    conn = connect(request["dsn"])
    try:
        print(backend_pid(conn), flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        with open(os.devnull, "wb") as sink, conn.cursor() as cur:
            cur.copy_expert(request["statement"], sink, size=1 << 20)
            print(cur.rowcount, flush=True)
        sys.stdin.read()
    finally:
        conn.close()


@dataclass
class KafkaClient:
    seconds: float
    cpu_s: float
    messages: int
    key_bytes: float  # mean sizes of the messages sent
    value_bytes: float


#: Messages per transaction of the SPEC §9 load, so per callback object of the ceiling.
TRANSACTION_MESSAGES = 10


class CountingTicket:
    """Counts delivery reports as ``cdcd.ack.TxnTicket`` does, without the tracker.

    ``on_delivery`` per report (confluent-kafka's producer), ``on_delivered``
    per run of successes (the compiled one).
    """

    __slots__ = ("delivered", "failed")

    def __init__(self) -> None:
        self.delivered = 0
        self.failed: list[Any] = []

    def on_delivery(self, err: Any, _msg: Any) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed.append(err)

    def on_delivered(self, count: int) -> None:
        self.delivered += count


def produce_timed(
    producer: Any,
    topic: str,
    sample: list[tuple[bytes | None, bytes | None]],
    total: int,
    lsn: tuple[str, bytes] | None,
) -> tuple[float, float]:
    """Send ``total`` messages of ``sample``, cycled, and wait for every report: (seconds, CPU seconds).

    As cdcd's publisher calls the producer: positionally, one ticket-like
    callback per :data:`TRANSACTION_MESSAGES` messages fetched once, the
    ``lsn`` header and a ``cdcd.seq`` header on each (no headers without
    ``lsn``). Raises when a message was not delivered.
    """
    from cdcd.sink.producer import FULL_QUEUE_FLUSH_S

    tickets: list[CountingTicket] = []
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_start, started = usage.ru_utime + usage.ru_stime, time.monotonic()
    produce, size = producer.produce, len(sample)
    on_delivery: Any = None
    for i in range(total):
        if i % TRANSACTION_MESSAGES == 0:
            # cdcd needs every report, counted per transaction: so does the ceiling.
            tickets.append(CountingTicket())
            on_delivery = tickets[-1].on_delivery
        key, value = sample[i % size]
        headers = None if lsn is None else [lsn, (SEQ_HEADER, b"%d" % i)]
        while True:
            try:
                produce(topic, value, key, -1, on_delivery, None, 0, headers)
                break
            except BufferError:
                # Sent at once, as the sink's first wait on a full queue does (it then
                # polls in turns, which only matters while Kafka is down).
                producer.flush(FULL_QUEUE_FLUSH_S)
    while producer.flush(1.0):
        pass
    elapsed = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    failed = [err for ticket in tickets for err in ticket.failed]
    lost = total - sum(ticket.delivered for ticket in tickets)
    if failed or lost:
        raise DefiniteError(f"the Kafka client ceiling lost {lost} of {total} messages: {failed[:1]}")
    return elapsed, usage.ru_utime + usage.ru_stime - cpu_start


#: Messages of cdcd's own topic the Kafka-client ceiling sends again, cycled.
KAFKA_SAMPLE = 2_000


def kafka_client_ceiling(bootstrap: str, sample_topic: str, messages: int) -> KafkaClient:
    """A bare idempotent producer sending ``messages`` of cdcd's own messages, in a process alone.

    The client (``kafka_client_worker``) reads up to :data:`KAFKA_SAMPLE`
    messages of ``sample_topic``, as many from each partition (cdcd's, so the
    same keys, spread over the partitions, values and
    compression ratio), then sends ``messages`` of them, cycled, with the two
    headers cdcd sets (``cdcd.lsn``, ``cdcd.seq``), through a producer with
    cdcd's configuration (``build_producer_config``: idempotent, ``acks=all``,
    lz4, the same batching) to a new topic with as many partitions, and
    flushes. The producer is the one cdcd's sink builds (the compiled one where
    it is in use, else confluent-kafka's), with one ticket-like callback per
    10 messages as cdcd's publisher passes them. Its CPU from the first
    produce to the end of the flush (every
    message acknowledged), over the messages, is what the Kafka client alone
    costs per row: no envelope, no PostgreSQL, no bookkeeping.
    """
    argv = [sys.executable, "-c", "from cdcd.tools.bench.ceilings import kafka_client_worker; kafka_client_worker()"]
    request = {"bootstrap": bootstrap, "sample_topic": sample_topic, "messages": messages}
    result = subprocess.run(
        argv, input=json.dumps(request), capture_output=True, text=True, timeout=1800, check=False
    )
    if result.returncode != 0:
        raise DefiniteError(f"the Kafka client ceiling failed: {result.stderr.strip()[-1000:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return KafkaClient(
        data["seconds"], data["cpu_s"], data["messages"], data["key_bytes"], data["value_bytes"]
    )


def kafka_client_worker() -> None:
    """The client of :func:`kafka_client_ceiling`: request on stdin, one JSON line out."""
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import (  # type: ignore[attr-defined]  # stubs omit the re-exports
        AdminClient,
        NewTopic,
    )

    from cdcd.sink.native import producer_factory
    from cdcd.sink.producer import build_producer_config

    request = json.loads(sys.stdin.read())
    bootstrap, source = request["bootstrap"], request["sample_topic"]
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "cdcd-bench-sample", "enable.auto.commit": False}
    )
    partitions = consumer.list_topics(source, timeout=30).topics[source].partitions
    consumer.assign([TopicPartition(source, p, 0) for p in partitions])
    # As many from every partition, interleaved: the messages keep their keys,
    # so they spread over the partitions as cdcd's do. (Taken as they come,
    # they came from one partition, and one partition's batches are bigger
    # and cheaper per message: the ceiling was half what cdcd pays.)
    wanted = max(1, KAFKA_SAMPLE // len(partitions))
    by_partition: dict[int, list[tuple[bytes | None, bytes | None]]] = {p: [] for p in partitions}
    deadline = time.monotonic() + 60
    while any(len(got) < wanted for got in by_partition.values()) and time.monotonic() < deadline:
        for message in consumer.consume(500, timeout=1.0):
            got = by_partition.get(message.partition() or 0, [])
            if message.error() is None and message.value() is not None and len(got) < wanted:
                got.append((message.key(), message.value()))
    consumer.close()
    sample = [
        message
        for round_ in itertools.zip_longest(*by_partition.values())
        for message in round_
        if message is not None
    ]
    if not sample:
        raise DefiniteError(f"no messages to sample in {source}")
    topic = f"{source}.kafka_ceiling"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, len(partitions), 1)]).values():
        future.result(30)
    # The producer cdcd's sink builds: the compiled one where it is in use.
    producer = producer_factory()(build_producer_config(bootstrap, {}, "cdcd-bench-kafka-ceiling"))
    lsn = (LSN_HEADER, b"0/1A2B3C4D")
    producer.produce(topic, sample[0][1], sample[0][0], headers=[lsn, (SEQ_HEADER, b"0")])
    producer.flush(30)  # connected, producer id acquired: the measurement is the sending
    total = int(request["messages"])
    elapsed, cpu = produce_timed(producer, topic, sample, total, lsn)
    keys = sum(len(k or b"") for k, _ in sample) / len(sample)
    values = sum(len(v or b"") for _, v in sample) / len(sample)
    print(json.dumps({"seconds": elapsed, "cpu_s": cpu, "messages": total,
                      "key_bytes": keys, "value_bytes": values}), flush=True)
