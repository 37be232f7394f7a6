"""``TransactionAssembler`` + ``Publisher`` on real walsender output, without PostgreSQL.

Each golden capture (``tests/protocol/golden``, PostgreSQL 15 pgoutput) is
decoded with ``PgOutputDecoder`` and fed message by message into the
assembler, whose sink is the real ``Publisher`` producing into the
fault-injecting ``FaultSink`` with a real ``AckTracker``, wired as the session
wires them. What reaches the sink is compared with a reference reading of the
same capture (``expected_transactions``): a deliberately plain model of
pgoutput's rules, with no buffering, spilling or re-decoding.

Checked per capture: each committed transaction's envelopes in change order,
transactions in commit order, nothing of aborted (sub)transactions, buffered
(streamed, prepared) transactions produced only at the message that commits
them, the (``cdcd.lsn``, ``cdcd.seq``) headers unique and increasing, and the
confirmed LSN after every message. Then one delivery failure at each produced
message in turn: confirmation never passes the transaction it belongs to.
Finally ``Publisher.watch``, which incremental snapshots use to drop chunk rows
the stream changed: the keys it reports, and the swap back to the plain
``row`` when unwatched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.cdc import SchemaBook

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import RelationCache, TableVersion
from cdcd.decode.types import BUILTIN_TYPES, PgType, StaticCatalog
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.errors import EncodeError
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.transactions import TransactionAssembler
from cdcd.protocol import Lsn, PgOutputDecoder
from cdcd.protocol.messages import (
    IDENTITY_FULL,
    IDENTITY_NOTHING,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)
from tests.protocol.test_golden import SCENARIOS, Golden, golden
from tests.snapshot.test_copy_reads import copy_line
from tests.support.fault_sink import FakeMessage, FaultSink

START = Lsn(0)
#: The captures cdcd publishes: all but ``binary``, whose values cdcd never asks for.
PUBLISHED = [name for name in SCENARIOS if name != "binary"]
#: Captures whose transactions are buffered (streamed or prepared) before publication.
BUFFERED = ("stream", "stream_prepare", "two_phase")

# -- the reference reading of a capture -------------------------------------------------


@dataclass
class Txn:
    """A transaction the publisher must produce: its changes, where it starts and commits."""

    xid: int
    commit_lsn: Lsn
    end_lsn: Lsn
    first_step: int  # index of the message from which its envelopes may be produced
    commit_step: int  # index of the message that commits it
    changes: list[Message] = field(default_factory=list)
    standalone: bool = False  # a non-transactional logical message, a ticket of its own


def expected_transactions(messages: tuple[Message, ...]) -> list[Txn]:
    """Committed transactions and standalone messages, in commit order.

    Plain transactions may be produced from their Begin on; streamed and
    prepared ones only at their Stream Commit / Commit Prepared, without the
    changes of subtransactions aborted before it.
    """
    out: list[Txn] = []
    plain: Txn | None = None
    current: int | None = None  # xid of the open stream block
    streams: dict[int, list[Message]] = {}
    preparing: list[Message] | None = None
    prepared: dict[str, list[Message]] = {}
    for step, m in enumerate(messages):
        if isinstance(m, Begin):
            plain = Txn(m.xid, m.final_lsn, START, step, step)
        elif isinstance(m, Commit):
            assert plain is not None
            plain.end_lsn, plain.commit_step = m.end_lsn, step
            out.append(plain)
            plain = None
        elif isinstance(m, StreamStart):
            current = m.xid
            streams.setdefault(m.xid, [])
        elif isinstance(m, StreamStop):
            current = None
        elif isinstance(m, LogicalMessage) and not m.transactional:
            out.append(Txn(0, m.lsn, m.lsn, step, step, [m], standalone=True))
        elif isinstance(m, Insert | Update | Delete | Truncate | LogicalMessage):
            if current is not None:
                streams[current].append(m)
            elif preparing is not None:
                preparing.append(m)
            else:
                assert plain is not None, m
                plain.changes.append(m)
        elif isinstance(m, StreamAbort):
            if m.subxid == m.xid:
                streams.pop(m.xid, None)
            else:
                streams[m.xid] = [
                    c for c in streams.get(m.xid, []) if getattr(c, "xid", None) != m.subxid
                ]
        elif isinstance(m, StreamCommit):
            out.append(Txn(m.xid, m.commit_lsn, m.end_lsn, step, step, streams.pop(m.xid, [])))
        elif isinstance(m, BeginPrepare):
            preparing = []
        elif isinstance(m, Prepare):
            assert preparing is not None
            prepared[m.gid] = preparing
            preparing = None
        elif isinstance(m, StreamPrepare):
            prepared[m.gid] = streams.pop(m.xid, [])
        elif isinstance(m, CommitPrepared):
            out.append(Txn(m.xid, m.commit_lsn, m.end_lsn, step, step, prepared.pop(m.gid)))
        elif isinstance(m, RollbackPrepared):
            del prepared[m.gid]
    assert plain is None and not streams and not prepared
    return out


#: (topic, op, first non-null value of the image as text): what a produced message says.
#: op "message" for the message topic (third item: the prefix), None for a tombstone.
Signature = tuple[str, str | None, str | None]


def _first_value(image: TupleData) -> str | None:
    return next((value.decode("utf-8") for value in image.values if value is not None), None)


def expected_signatures(txn: Txn, relations: dict[int, Relation]) -> list[Signature]:
    """What the publisher produces for ``txn`` (SPEC §4: key changes, tombstones)."""
    out: list[Signature] = []
    for m in txn.changes:
        if isinstance(m, LogicalMessage):
            out.append(("pg.message", "message", m.prefix))
            continue
        if isinstance(m, Truncate):
            for relid in m.relation_ids:
                out.append((_topic(relations[relid]), "t", None))
            continue
        assert isinstance(m, Insert | Update | Delete)
        relation = relations[m.relation_id]
        topic = _topic(relation)
        keyed = relation.replica_identity not in (IDENTITY_FULL, IDENTITY_NOTHING) and any(
            c.is_key for c in relation.columns
        )
        if isinstance(m, Insert):
            out.append((topic, "c", _first_value(m.new)))
        elif isinstance(m, Update):
            keys = [i for i, c in enumerate(relation.columns) if c.is_key]
            if (
                keyed
                and m.old is not None
                and any(m.old.values[i] != m.new.values[i] for i in keys)
            ):
                out.append((topic, "d", _first_value(m.old)))
                out.append((topic, None, None))
                out.append((topic, "c", _first_value(m.new)))
            else:
                out.append((topic, "u", _first_value(m.new)))
        else:
            assert m.old is not None
            out.append((topic, "d", _first_value(m.old)))
            if keyed:
                out.append((topic, None, None))
    return out


def _topic(relation: Relation) -> str:
    return f"pg.{relation.namespace}.{relation.name}"


# -- the pipeline under test --------------------------------------------------------------


def golden_catalog(g: Golden) -> StaticCatalog:
    """Built-in types plus the capture's enum and domain (what pg_type would say).

    pgoutput names a domain by its base type, with an empty namespace; the
    ``types`` capture has the enum ``mood`` and the domain ``posint`` over int4.
    """
    by_name = {t.name: t.oid for t in BUILTIN_TYPES.values()}
    catalog = StaticCatalog()
    for t in g.of(Type):
        if t.namespace == "":
            catalog.add(
                PgType(t.type_oid, "public", "domain", "d", "N", 0, by_name[t.name], -1, ",")
            )
        else:
            catalog.add(PgType(t.type_oid, t.namespace, t.name, "e", "E", 0, 0, -1, ","))
    return catalog


class Rig:
    """Decoder -> TransactionAssembler -> Publisher -> FaultSink, with an AckTracker."""

    def __init__(
        self,
        name: str,
        *,
        sink: FaultSink | None = None,
        spill_bytes: int = 1 << 30,
        spill_dir: Path | None = None,
    ) -> None:
        self.g = golden(name)
        self.sink = sink if sink is not None else FaultSink()
        self.book = SchemaBook()
        wire = SingleObjectFormat(self.book.add)
        self.tracker = AckTracker(START, classify=self.sink.delivery_failure)
        self.publisher = Publisher(
            self.sink,
            self.tracker,
            EnvelopeEncoder("pg", "app", wire),
            wire,
            include=lambda schema, table: True,
            ensure_topic=lambda topic: None,
        )
        self.relations = RelationCache(golden_catalog(self.g))
        self.assembler = TransactionAssembler(
            self.relations,
            self.publisher,
            spill_bytes,
            str(spill_dir) if spill_dir is not None else None,
            self.g.proto_version,
        )
        self.decoder = PgOutputDecoder(self.g.proto_version)
        self.step = 0
        self.produced_at: list[int] = []  # per produced message: the step that produced it
        self.confirmed: list[Lsn] = []  # after each step and its poll
        self.spilled: list[int] = []  # assembler.spilled_bytes after each step

    def feed(self, until: Callable[[Message], bool] | None = None) -> None:
        """Feed the capture's next messages (through the first that ``until`` accepts)."""
        payloads = self.g.payloads
        while self.step < len(payloads):
            payload = payloads[self.step]
            message = self.decoder.decode(payload)
            self.assembler.feed(message, payload)
            self.produced_at += [self.step] * (len(self.sink.produced) - len(self.produced_at))
            self.sink.poll()  # as the session does between reads
            self.confirmed.append(self.tracker.confirmed)
            self.spilled.append(self.assembler.spilled_bytes)
            self.step += 1
            if until is not None and until(message):
                return
        self.sink.flush()

    def decode(self, data: bytes) -> dict[str, Any]:
        return self.book.record(data)

    def signature(self, m: FakeMessage) -> Signature:
        value = m.value()
        if value is None:
            return (m.topic(), None, None)
        record = self.decode(value)
        if m.topic() == "pg.message":
            return (m.topic(), "message", record["prefix"])
        image = record["after"] if record["op"] in ("c", "u") else record["before"]
        first = next((v for v in (image or {}).values() if v is not None), None)
        return (m.topic(), record["op"], None if first is None else str(first))

    def expected(self) -> list[Txn]:
        return expected_transactions(self.g.messages)

    def relation_messages(self) -> dict[int, Relation]:
        return {r.relation_id: r for r in self.g.of(Relation)}

    def table(self, name: str) -> TableVersion:
        return self.relations.get(self.g.relation(name).relation_id)


def headers(m: FakeMessage) -> tuple[Lsn, int]:
    lsn, seq = m.header("cdcd.lsn"), m.header("cdcd.seq")
    assert lsn is not None and seq is not None
    return Lsn.parse(lsn.decode()), int(seq)


def split_by_transaction(rig: Rig, txns: list[Txn]) -> list[list[FakeMessage]]:
    """The produced messages of each expected transaction, by their ``cdcd.lsn`` header."""
    out: list[list[FakeMessage]] = [[] for _ in txns]
    index = {t.commit_lsn: i for i, t in enumerate(txns)}
    for m in rig.sink.produced:
        lsn, _ = headers(m)
        assert lsn in index, f"{m.topic()} message at {lsn}: no such transaction committed"
        out[index[lsn]].append(m)
    return out


# -- every capture ------------------------------------------------------------------------


@pytest.mark.parametrize("spill", [False, True], ids=["memory", "spilled"])
@pytest.mark.parametrize("name", PUBLISHED)
def test_capture_publishes_committed_transactions_in_order(
    name: str, spill: bool, tmp_path: Path
) -> None:
    rig = Rig(name, spill_bytes=0 if spill else 1 << 30, spill_dir=tmp_path)
    rig.feed()
    txns = rig.expected()
    relations = rig.relation_messages()
    assert rig.sink.failed == [] and rig.tracker.failure is None
    assert len(rig.sink.delivered) == len(rig.sink.produced) > 0
    assert rig.assembler.idle and rig.assembler.buffered_changes == 0

    # Per transaction: its envelopes, in change order, from its own Begin..commit span.
    by_txn = split_by_transaction(rig, txns)
    position = {id(m): i for i, m in enumerate(rig.sink.produced)}
    for txn, produced in zip(txns, by_txn, strict=True):
        assert [rig.signature(m) for m in produced] == expected_signatures(txn, relations), txn
        steps = {rig.produced_at[position[id(m)]] for m in produced}
        assert all(txn.first_step <= s <= txn.commit_step for s in steps), (txn, steps)
        for m in produced:
            value = m.value()
            if value is None:
                continue
            record = rig.decode(value)
            if m.topic() == "pg.message":
                if not txn.standalone:
                    assert (record["txId"], record["commit_lsn"]) == (txn.xid, txn.commit_lsn)
            else:
                assert (record["source"]["txId"], record["source"]["lsn"]) == (
                    txn.xid,
                    txn.commit_lsn,
                )

    # Commit order, and (cdcd.lsn, cdcd.seq) unique and increasing, seq 0.. per transaction.
    pairs = [headers(m) for m in rig.sink.produced]
    assert pairs == sorted(set(pairs))
    for produced in by_txn:
        assert [headers(m)[1] for m in produced] == list(range(len(produced)))

    # Every delivery reported at once: confirmed reaches each transaction as it commits.
    for step, confirmed in enumerate(rig.confirmed):
        done = [t.end_lsn for t in txns if t.commit_step <= step]
        assert confirmed == max(done, default=START), f"after message {step}"

    if spill and name in BUFFERED:
        assert max(rig.spilled) > 0, "stream_spill_bytes=0 must spill every buffered change"
    if not spill:
        assert max(rig.spilled) == 0


def test_stream_publishes_at_stream_commit_without_aborted_subtransactions(tmp_path: Path) -> None:
    """Facts of the ``stream`` capture, independent of the reference reading."""
    rig = Rig("stream", spill_bytes=0, spill_dir=tmp_path)
    starts = [m for m in rig.g.messages if isinstance(m, StreamStart)]
    committed, aborted, with_savepoint = sorted({s.xid for s in starts})
    abort = next(m for m in rig.g.messages if isinstance(m, StreamAbort) and m.subxid != m.xid)
    sub = abort.subxid

    rig.feed(until=lambda m: isinstance(m, StreamCommit))
    first = len(rig.sink.produced)
    assert first > 0 and rig.produced_at == [rig.step - 1] * first  # all at Stream Commit
    rig.feed()
    assert rig.produced_at[first:] == [rig.step - 1] * (len(rig.sink.produced) - first)

    envelopes = [(m, rig.decode(v)) for m in rig.sink.produced if (v := m.value()) is not None]
    xids = [r["txId"] if m.topic() == "pg.message" else r["source"]["txId"] for m, r in envelopes]
    assert xids == sorted(xids) and set(xids) == {committed, with_savepoint}
    assert aborted not in xids
    ids: dict[int, list[int]] = {}
    for m, r in envelopes:
        if m.topic() == "pg.public.stream_rows":
            ids.setdefault(r["source"]["txId"], []).append(r["after"]["id"])
    # capture_golden.py: rows 1..3000 committed; 10001..13000 rolled back; 20001..20002,
    # SAVEPOINT, 20003..23000, ROLLBACK TO SAVEPOINT, 30001..30002, COMMIT. The capture
    # keeps some rows of each stream block (``dropped``), in order.
    captured = [int(m.new.values[0] or b"0") for m in rig.g.of(Insert) if m.xid == sub]
    assert captured and all(20003 <= i <= 23000 for i in captured)
    assert ids[with_savepoint] == [20001, 20002, 30001, 30002]
    assert ids[committed] == sorted(ids[committed]) and all(1 <= i <= 3000 for i in ids[committed])
    assert len(ids[committed]) == sum(1 for m in rig.g.of(Insert) if m.xid == committed)


def test_two_phase_published_at_commit_prepared_never_after_rollback(tmp_path: Path) -> None:
    rig = Rig("two_phase", spill_dir=tmp_path)
    commit = rig.g.one(CommitPrepared)

    rig.feed(until=lambda m: isinstance(m, Prepare))
    assert rig.sink.produced == [] and rig.tracker.holds == 1
    assert rig.tracker.confirmed == START
    rig.feed(until=lambda m: isinstance(m, CommitPrepared))
    assert [rig.signature(m) for m in rig.sink.produced] == [("pg.public.tp_rows", "c", "1")]
    assert rig.tracker.holds == 0 and rig.tracker.confirmed == commit.end_lsn

    rig.feed(until=lambda m: isinstance(m, Prepare))
    assert len(rig.sink.produced) == 1 and rig.tracker.holds == 1
    rig.feed()
    assert len(rig.sink.produced) == 1 and rig.tracker.holds == 0
    values = [rig.decode(v)["after"]["v"] for m in rig.sink.produced if (v := m.value())]
    assert values == ["kept"]
    assert rig.tracker.confirmed == commit.end_lsn and rig.assembler.idle


def test_stream_prepare_published_at_commit_prepared(tmp_path: Path) -> None:
    rig = Rig("stream_prepare", spill_bytes=0, spill_dir=tmp_path)
    rig.feed(until=lambda m: isinstance(m, StreamPrepare))
    assert rig.sink.produced == [] and rig.tracker.holds == 1
    assert rig.assembler.buffered_changes == 30 and rig.assembler.spilled_bytes > 0
    rig.feed()
    commit = rig.g.one(CommitPrepared)
    assert len(rig.sink.produced) == 30 and set(rig.produced_at) == {rig.step - 1}
    assert [headers(m) for m in rig.sink.produced] == [(commit.commit_lsn, i) for i in range(30)]
    assert rig.tracker.holds == 0 and rig.tracker.confirmed == commit.end_lsn


# -- delivery failures --------------------------------------------------------------------


def _transaction_of_each_message(name: str) -> tuple[list[Txn], list[int]]:
    """A clean run's transactions and, per produced message, its transaction's index."""
    rig = Rig(name)
    rig.feed()
    txns = rig.expected()
    index = {t.commit_lsn: i for i, t in enumerate(txns)}
    return txns, [index[headers(m)[0]] for m in rig.sink.produced]


@pytest.mark.parametrize("name", PUBLISHED)
def test_confirmation_stops_before_a_failed_delivery(name: str) -> None:
    """Fail each produced message in turn: confirmed stays at the transaction before it."""
    txns, owner = _transaction_of_each_message(name)
    assert owner
    for n, failed in enumerate(owner, start=1):
        rig = Rig(name)
        rig.sink.fail_nth(n)
        rig.feed()
        before = max((t.end_lsn for t in txns[:failed]), default=START)
        assert rig.tracker.failure is not None and len(rig.sink.failed) == 1
        assert rig.tracker.confirmed == before, f"message {n} of transaction {failed}"
        assert max(rig.confirmed) == before
        ticket = rig.tracker.failed_ticket
        assert ticket is not None and ticket.end_lsn == txns[failed].end_lsn


@pytest.mark.parametrize("seed", range(5))
def test_confirmation_never_passes_a_failure_reported_out_of_order(seed: int) -> None:
    """Reports withheld, then released across partitions in random order."""
    txns, owner = _transaction_of_each_message("stream")
    n = seed * 7 % len(owner) + 1
    failed = owner[n - 1]
    before = max((t.end_lsn for t in txns[:failed]), default=START)
    rig = Rig("stream", sink=FaultSink(partitions=3, reorder=True, seed=seed))
    rig.sink.fail_nth(n)
    rig.sink.delay_deliveries()
    rig.feed()
    assert rig.tracker.confirmed == START and rig.sink.pending == len(owner)
    rig.sink.release()
    rig.sink.flush()
    assert rig.tracker.failure is not None
    assert rig.tracker.confirmed <= before


# -- Publisher.watch (incremental snapshot de-duplication) ------------------------------


def _key_fields(rig: Rig, table: TableVersion, key: bytes) -> dict[str, Any]:
    """A recorded key (Avro body, no wire header) decoded as a consumer would."""
    encoder = rig.publisher.snapshot_encoder(table)
    assert encoder is not None
    return rig.decode(encoder.key_header + key)


def _produced_keys(rig: Rig, table: str) -> set[tuple[int, bytes]]:
    """(xid, key without wire header) of every envelope produced for ``table``."""
    found: set[tuple[int, bytes]] = set()
    for m in rig.sink.produced:
        key, value = m.key(), m.value()
        if m.topic() == f"pg.public.{table}" and key is not None and value is not None:
            # Single-object header: C3 01 and the 8-byte schema fingerprint.
            found.add((rig.decode(value)["source"]["txId"], key[10:]))
    return found


def _watched_keys(rig: Rig, name: str) -> list[tuple[int, bytes | None]]:
    """Feed the capture, watching table ``name`` from its first Relation on: what was reported."""
    recorded: list[tuple[int, bytes | None]] = []
    rig.feed(until=lambda m: isinstance(m, Relation) and m.name == name)
    rig.publisher.watch(rig.g.relation(name).relation_id, lambda x, k: recorded.append((x, k)))
    rig.feed()
    return recorded


def test_watch_reports_keys_of_the_watched_table_only() -> None:
    rig = Rig("identity")
    recorded = _watched_keys(rig, "ident_index")
    table = rig.table("ident_index")
    assert None not in {k for _, k in recorded}
    keys = [_key_fields(rig, table, k) for _, k in recorded if k is not None]
    # insert c1; update c1 -> c2 (new key, then old); delete c2: REPLICA IDENTITY USING INDEX.
    assert keys == [{"code": "c1"}, {"code": "c2"}, {"code": "c1"}, {"code": "c2"}]
    assert set(recorded) == _produced_keys(rig, "ident_index")
    xids = [x for x, _ in recorded]
    assert len(set(xids)) == 3 and xids == sorted(xids)


def test_watch_sees_replayed_streamed_changes_but_not_aborted_ones(tmp_path: Path) -> None:
    rig = Rig("stream", spill_bytes=0, spill_dir=tmp_path)
    recorded = _watched_keys(rig, "stream_rows")
    assert recorded and set(recorded) == _produced_keys(rig, "stream_rows")
    sub = next(m.subxid for m in rig.g.messages if isinstance(m, StreamAbort) and m.subxid != m.xid)
    table = rig.table("stream_rows")
    aborted_ids = {int(m.new.values[0] or b"0") for m in rig.g.of(Insert) if m.xid == sub}
    seen_ids = {_key_fields(rig, table, k)["id"] for _, k in recorded if k is not None}
    assert not aborted_ids & seen_ids


def test_watch_reports_truncate_as_none() -> None:
    rig = Rig("truncate")
    recorded = _watched_keys(rig, "trunc_child")
    assert [k for _, k in recorded] == [None, None]  # both truncates list trunc_child
    truncating = [t.xid for t in rig.expected() if any(isinstance(c, Truncate) for c in t.changes)]
    assert [x for x, _ in recorded] == truncating[1:]


def test_watched_keys_are_the_keys_snapshot_rows_are_skipped_by() -> None:
    """Keys of streamed changes are the key bytes of the rows a chunk read returns."""
    rig = Rig("basic")
    recorded: list[tuple[int, bytes | None]] = []
    relid = rig.g.relation("items").relation_id
    rig.feed(until=lambda m: isinstance(m, Relation))
    rig.publisher.watch(relid, lambda x, k: recorded.append((x, k)))
    rig.feed()
    # Inserts 1 and 2, update of 1, key change 2 -> 3 (both keys), delete of 1.
    assert len(recorded) == 6 and all(key is not None for _, key in recorded)
    xid = recorded[-1][0]

    table = rig.table("items")
    encoder = rig.publisher.snapshot_encoder(table)
    assert encoder is not None
    columns = len(table.columns)
    rows = b"".join(
        copy_line(TupleData(b"t" + b"n" * (columns - 1), (b"%d" % i, *[None] * (columns - 1))))
        for i in (1, 2, 3, 4, 5)
    )
    rig.publisher.begin_transaction(xid + 1, Lsn(0x7000_0000), 0)
    skip = {k for _, k in recorded if k}
    _, sent = rig.publisher.snapshot_copy_in_transaction(encoder, rows, skip)
    rig.publisher.commit_transaction(Lsn(0x7000_0100))
    assert sent == 2
    reads = [
        rig.decode(v) for m in rig.sink.produced if (v := m.value()) and m.topic() == encoder.topic
    ]
    assert [r["after"]["id"] for r in reads if r["op"] == "r"] == [4, 5]


def test_unwatch_restores_the_plain_row_path() -> None:
    rig = Rig("basic")
    publisher = rig.publisher
    assert "row" not in vars(publisher) and publisher.row.__func__ is Publisher.row  # type: ignore[attr-defined]
    recorded: list[tuple[int, bytes | None]] = []
    rig.feed(until=lambda m: isinstance(m, Relation))
    publisher.watch(rig.g.relation("items").relation_id, lambda x, k: recorded.append((x, k)))
    assert publisher.row.__func__ is Publisher._row_watched  # type: ignore[attr-defined]
    rig.feed(until=lambda m: isinstance(m, Commit))  # the two inserts
    assert len(recorded) == 2
    watched = [rig.signature(m) for m in rig.sink.produced]

    publisher.unwatch()
    assert "row" not in vars(publisher) and publisher.row.__func__ is Publisher.row  # type: ignore[attr-defined]
    rig.feed()
    assert len(recorded) == 2, "an unwatched publisher must not report keys"
    publisher.unwatch()  # idempotent: the snapshot driver unwatches whenever it moves on
    assert "row" not in vars(publisher)

    # Watching changed nothing of what was published.
    plain = Rig("basic")
    plain.feed()
    assert [plain.signature(m) for m in plain.sink.produced] == [
        rig.signature(m) for m in rig.sink.produced
    ]
    assert watched == [rig.signature(m) for m in rig.sink.produced[: len(watched)]]
    assert [(m.key(), m.headers()) for m in plain.sink.produced] == [
        (m.key(), m.headers()) for m in rig.sink.produced
    ]


def test_binary_values_are_refused_not_published() -> None:
    """cdcd never asks for ``binary``: the ``binary`` capture's 'b' values stop the pipeline."""
    rig = Rig("binary")
    with pytest.raises(EncodeError) as caught:
        rig.feed()
    message = str(caught.value)
    assert "public.bin_rows.id" in message and "binary format ('b')" in message
    assert "report it" in message  # a protocol violation, not a value to fix
    assert caught.value.exit_code == 3
    assert [m for m in rig.sink.produced if m.topic() == "pg.public.bin_rows"] == []
    assert rig.tracker.confirmed == START
