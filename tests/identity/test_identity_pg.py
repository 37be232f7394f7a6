"""Identity by value against a real PostgreSQL, driven by hypothesis (issue 30).

Each example makes a fresh table and drives real statements through a real
server:

* replica identity: the primary key, ``USING INDEX`` (a unique index on a
  column other than the primary key), ``FULL``;
* key storage: short, long and compressed inline, stored out of line
  (``SET STORAGE EXTERNAL`` and a long value);
* updates that keep or change the key, change a second out-of-line column or
  leave it alone, HOT or not (an index on the updated column prevents HOT),
  deletes and inserts;
* pgoutput protocol 1 to 3 on PostgreSQL 15 and 1 to 4 on 16 (both clusters
  with ``logical_decoding_work_mem=64kB``), the changes in small
  transactions or in one large one, which is streamed (protocol 2+) and
  spilled by cdcd's assembler.

The walsender's output is read from a slot and fed through cdcd's own decoder,
``TransactionAssembler``, ``Publisher`` and encoders into an in-memory sink,
per example (so that hypothesis can shrink a failure): the messages are
decoded with plain fastavro and replayed in (``cdcd.lsn``, ``cdcd.seq``)
order. The replay must equal ``SELECT`` after the statements, and no delete
(or tombstone) may be published for a key the table still holds (keys are
never reused). Every example's messages and schemas also go to Kafka, and at
the end every example's topic is read back from the broker with a plain
consumer (``support.cdc.read_changes``) and replayed against its table once
more. The daemon around the same code is covered by
tests/versions/test_toast_key.py.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from dataclasses import dataclass
from typing import Any

import fastavro
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cdc import Change, read_changes, replay
from support.fault_sink import FaultSink
from support.pg import create_slot, read_pgoutput

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import RelationCache
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.transactions import TransactionAssembler
from cdcd.protocol import Lsn, PgOutputDecoder
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import SourceDatabase

pytestmark = pytest.mark.integration

HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
FAST = settings(max_examples=20, deadline=None, suppress_health_check=HEALTH)
SLOW = settings(max_examples=150, deadline=None, suppress_health_check=HEALTH)

IDENTITIES = ("pk", "index", "full")
STORAGES = ("short", "compressed", "external")
OPS = ("same", "same_big", "key", "key_big", "delete", "insert")
_tables = itertools.count(1)
EXAMPLES: dict[str, int] = {}  # per test: examples run (printed at the end)


@dataclass(frozen=True)
class Scenario:
    identity: str
    storage: str
    hot: bool
    protocol: int
    large: bool
    ops: tuple[tuple[str, int], ...]  # (op, row picked)


def scenarios(max_protocol: int) -> st.SearchStrategy[Scenario]:
    return st.builds(
        Scenario,
        identity=st.sampled_from(IDENTITIES),
        storage=st.sampled_from(STORAGES),
        hot=st.booleans(),
        protocol=st.integers(1, max_protocol),
        large=st.booleans(),
        ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000)), min_size=1, max_size=8)
        .map(tuple),
    )


def _key(storage: str, n: int) -> str:
    if storage == "short":
        return f"k{n}"
    # compressed: far over the inline limit, compressible; external: stored out
    # of line uncompressed (SET STORAGE EXTERNAL), short enough for a btree entry.
    return f"k{n}-" + "x" * (6000 if storage == "compressed" else 2400)


def _big(tag: str) -> str:
    """About 8 kB, incompressible: out of line."""
    h = tag.encode()
    out = []
    for _ in range(250):
        h = hashlib.sha256(h).hexdigest().encode()
        out.append(h.decode())
    return "".join(out)


def _create(cur: Any, name: str, s: Scenario) -> None:
    if s.identity == "index":
        cur.execute(f"CREATE TABLE {name}(rid serial PRIMARY KEY, id text NOT NULL, big text, n int)")
        cur.execute(f"CREATE UNIQUE INDEX {name}_id ON {name}(id)")
        cur.execute(f"ALTER TABLE {name} REPLICA IDENTITY USING INDEX {name}_id")
    else:
        cur.execute(f"CREATE TABLE {name}(id text PRIMARY KEY, big text, n int)")
        if s.identity == "full":
            cur.execute(f"ALTER TABLE {name} REPLICA IDENTITY FULL")
    cur.execute(f"ALTER TABLE {name} ALTER COLUMN big SET STORAGE EXTERNAL")
    if s.storage == "external":
        cur.execute(f"ALTER TABLE {name} ALTER COLUMN id SET STORAGE EXTERNAL")
    if not s.hot:
        cur.execute(f"CREATE INDEX ON {name}(n)")  # every update sets n: never HOT


def _run(conn: Any, name: str, s: Scenario) -> None:
    keys = [_key(s.storage, i) for i in range(4)]
    fresh = itertools.count(100)
    with conn.cursor() as cur:
        for i, key in enumerate(keys):
            cur.execute(f"INSERT INTO {name}(id, big, n) VALUES (%s, %s, %s)", (key, _big(key), i))
        cur.execute("BEGIN" if s.large else "SELECT 1")
        if s.large:
            # Over logical_decoding_work_mem: streamed (v2+), spilled by cdcd.
            cur.execute("INSERT INTO filler SELECT g, repeat('f', 100) FROM generate_series(1, 2000) g")
        for op, pick in s.ops:
            if not keys and op != "insert":
                op = "insert"
            key = keys[pick % len(keys)] if keys else ""
            if op == "insert":
                new = _key(s.storage, next(fresh))
                cur.execute(f"INSERT INTO {name}(id, big, n) VALUES (%s, %s, 0)", (new, _big(new)))
                keys.append(new)
            elif op == "delete":
                cur.execute(f"DELETE FROM {name} WHERE id = %s", (key,))
                keys.remove(key)
            else:
                sets = ["n = n + 1"]
                params: list[Any] = []
                if op.endswith("_big"):
                    sets.append("big = %s")
                    params.append(_big(f"{key}-{pick}"))
                if op.startswith("key"):
                    new = _key(s.storage, next(fresh))
                    sets.append("id = %s")
                    params.append(new)
                    keys[keys.index(key)] = new
                cur.execute(f"UPDATE {name} SET {', '.join(sets)} WHERE id = %s", (*params, key))
        if s.large:
            cur.execute("COMMIT")


class Pipeline:
    """cdcd's decoder, assembler, publisher and encoders into a FaultSink, as the session wires them."""

    def __init__(self, dsn: str, protocol: int, spill_dir: str, prefix: str) -> None:
        self.db = SourceDatabase(dsn)
        self.sink = FaultSink()
        self.schemas: dict[str, Any] = {}
        self.published: list[tuple[bytes, bytes]] = []  # for <prefix>._schemas
        wire = SingleObjectFormat(self._schema)
        publisher = Publisher(
            self.sink,
            AckTracker(Lsn(1), classify=self.sink.delivery_failure),
            EnvelopeEncoder(prefix, self.db.database, wire),
            wire,
            include=lambda schema, table: table != "filler",
            ensure_topic=lambda topic: None,
        )
        relations = RelationCache(PgCatalog(self.db.conn), key_lookup=self.db.primary_key)
        # A small spill threshold: large transactions go through cdcd's spill files.
        self.assembler = TransactionAssembler(relations, publisher, 16 * 1024, spill_dir, protocol)
        self.decoder = PgOutputDecoder(protocol)
        self.spilled = 0  # the most bytes the assembler held in spill files at once

    def _schema(self, key: bytes, value: bytes) -> None:
        self.schemas[key.decode()] = fastavro.parse_schema(json.loads(value))
        self.published.append((key, value))

    def outbox(self, prefix: str, topic: str) -> list[tuple[str, Any, Any, Any]]:
        """The example's schemas and messages as produced: (topic, key, value, headers)."""
        out: list[tuple[str, Any, Any, Any]] = [
            (f"{prefix}._schemas", key, value, None) for key, value in self.published
        ]
        out += [(topic, m.key(), m.value(), m.headers()) for m in self.sink.produced
                if m.topic() == topic]
        return out

    def feed(self, payloads: list[tuple[int, bytes]]) -> None:
        for _, payload in payloads:
            self.assembler.feed(self.decoder.decode(payload), payload)
            self.spilled = max(self.spilled, self.assembler.spilled_bytes)
            self.sink.poll()
        self.sink.flush()

    def decode(self, data: bytes | None) -> dict[str, Any] | None:
        if data is None:
            return None
        record = fastavro.schemaless_reader(io.BytesIO(data[10:]), self.schemas[data[2:10].hex()], None)
        assert isinstance(record, dict)
        return record

    def changes(self, topic: str) -> list[Change]:
        out = []
        for m in self.sink.produced:
            if m.topic() != topic:
                continue
            lsn = m.header("cdcd.lsn")
            seq = m.header("cdcd.seq")
            assert lsn is not None and seq is not None
            high, low = lsn.decode().split("/")
            out.append(Change(topic, 0, 0, (int(high, 16) << 32) | int(low, 16), int(seq),
                              self.decode(m.key()), self.decode(m.value())))
        return out

    def close(self) -> None:
        self.db.close()


def check(
    db: Any, conn: Any, slot: str, s: Scenario, spill_dir: str, outbox: list[Any]
) -> int:
    """Run one scenario (its Kafka messages added to ``outbox``); returns the bytes
    cdcd's assembler spilled for it."""
    name = f"t{next(_tables)}"
    prefix = db.dbname
    topic = f"{prefix}.public.{name}"
    with conn.cursor() as cur:
        _create(cur, name, s)
    try:
        _run(conn, name, s)
    except BaseException:
        conn.cursor().execute("ROLLBACK")  # the example's own error is the one to report
        raise
    payloads = read_pgoutput(db.dsn, slot, "idpub", proto_version=s.protocol,
                             streaming=s.protocol >= 2, confirm=True, timeout_s=60)
    pipeline = Pipeline(db.dsn, s.protocol, spill_dir, prefix)
    try:
        pipeline.feed(payloads)
        changes = pipeline.changes(topic)
        spilled = pipeline.spilled
        outbox += pipeline.outbox(prefix, topic)
    finally:
        pipeline.close()
    compare(db, name, changes, str(s))
    return spilled


def compare(db: Any, name: str, changes: list[Change], what: str) -> None:
    """The replay of ``changes`` equals ``name``'s rows; no delete of a live key."""
    rows = {(r[0],): {"id": r[0], "big": r[1], "n": r[2]}
            for r in db.fetchall(f"SELECT id, big, n FROM {name}")}
    replayed = {k: {c: v[c] for c in ("id", "big", "n")} for k, v in replay(changes, ("id",)).items()}
    live = {key for (key,) in rows}
    deleted = {c.key["id"] for c in changes if c.key and (c.value is None or c.value["op"] == "d")}
    assert not deleted & live, f"{what}: a delete was published for a live row of {name}"
    assert replayed == rows, f"{what}: the replay of {name} differs from the table"


def _setup(db: Any) -> str:
    db.execute("CREATE TABLE filler(id int, pad text)")
    db.execute("CREATE PUBLICATION idpub FOR ALL TABLES")
    create_slot(db.connect(), "idslot")
    return "idslot"


def _property(
    version_pg: Any, vdb: Any, broker: Any, tmp_path: Any, profile: settings, label: str
) -> None:
    slot = _setup(vdb)
    conn = vdb.connect()
    seen = {"examples": 0, "large_streamed": 0, "spilled": 0}
    outbox: list[tuple[str, Any, Any, Any]] = []

    @profile
    @given(scenarios(version_pg.protocol))
    def run(s: Scenario) -> None:
        seen["examples"] += 1
        seen["large_streamed"] += s.large and s.protocol >= 2
        spilled = check(vdb, conn, slot, s, str(tmp_path), outbox)
        seen["spilled"] += spilled > 0

    run()
    # Every example's topic, through Kafka and read back by a plain consumer.
    bootstrap = broker.bootstrap_servers
    admin = AdminClient({"bootstrap.servers": bootstrap})
    created = admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1)
                                   for t in dict.fromkeys(t for t, _, _, _ in outbox)])
    for future in created.values():
        future.result(timeout=30)
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for topic, key, value, headers in outbox:
        producer.produce(topic, key=key, value=value, headers=headers)
        producer.poll(0)
    assert producer.flush(60) == 0, "not delivered to the broker"
    prefix = vdb.dbname
    names = [r[0] for r in vdb.fetchall(
        "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname ~ '^t[0-9]+$' "
        "AND relnamespace = 'public'::regnamespace"
    )]
    topics = [f"{prefix}.public.{name}" for name in names]
    from_kafka = read_changes(bootstrap, prefix, topics)
    for name, topic in zip(names, topics, strict=True):
        compare(vdb, name, [c for c in from_kafka if c.topic == topic], f"Kafka, {topic}")
    streamed = vdb.fetchone(
        "SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (slot,)
    )
    if seen["large_streamed"]:
        # Large transactions at protocol 2+ really were streamed by the walsender.
        assert streamed is not None and streamed[0] > 0, seen
    EXAMPLES[f"{label} pg{version_pg.version}"] = seen["examples"]
    print(f"identity property, PostgreSQL {version_pg.version}: {seen['examples']} examples "
          f"({len(topics)} topics read back from Kafka), "
          f"{seen['large_streamed']} large at protocol 2+ (server streamed "
          f"{streamed[0] if streamed else 0} transactions), {seen['spilled']} spilled by cdcd")


VERSIONS = pytest.mark.parametrize("version_pg", [15, 16], indirect=True, ids=lambda v: f"pg{v}")


@VERSIONS
def test_replay_equals_the_table_and_no_live_row_is_deleted(
    version_pg, vdb, broker, tmp_path
) -> None:
    _property(version_pg, vdb, broker, tmp_path, FAST, "fast")


@pytest.mark.slow
@VERSIONS
def test_replay_equals_the_table_many(version_pg, vdb, broker, tmp_path) -> None:
    _property(version_pg, vdb, broker, tmp_path, SLOW, "slow")
