"""Decode real PostgreSQL 15 pgoutput payloads (``golden/*.json``) and check what they say.

The files come from ``tests/protocol/capture_golden.py`` (see its docstring);
no database is needed here. LSNs, xids and timestamps differ per capture, so
they are checked through their relations (end LSN after commit LSN, Begin's
final LSN equal to Commit's commit LSN, ...); names, types, values, kinds,
flags and gids are checked exactly. Every captured payload must also
re-encode, with the independent test encoder, to exactly the original bytes.
"""

from __future__ import annotations

import json
import re
import struct
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import cache
from hashlib import md5
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cdcd.errors import ProtocolError
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import INVALID_LSN, Lsn
from cdcd.protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
    pg_timestamp_to_unix_ms,
)

from .pgoutput_encoder import encode

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
SCENARIOS = sorted(p.stem for p in GOLDEN_DIR.glob("*.json"))
ALL_MESSAGE_TYPES: frozenset[type] = frozenset(typing.get_args(Message))

# Built-in type OIDs (pg_type.dat).
BOOL, INT8, INT4, TEXT, TEXT_ARRAY, TIMESTAMPTZ, NUMERIC, JSONB = (
    16, 20, 23, 25, 1009, 1184, 1700, 3802,
)  # fmt: skip
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
#: A capture from before 2020 or more than a day in the future would mean a broken timestamp.
PLAUSIBLE_TS = range(
    (datetime(2020, 1, 1, tzinfo=UTC) - PG_EPOCH) // timedelta(microseconds=1),
    (datetime.now(UTC) + timedelta(days=1) - PG_EPOCH) // timedelta(microseconds=1),
)

M = TypeVar("M")


def numeric_typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | scale) + 4  # VARHDRSZ


@dataclass(frozen=True)
class Golden:
    name: str
    proto_version: int
    options: dict[str, Any]
    dropped: int
    payloads: tuple[bytes, ...]
    messages: tuple[Message, ...]

    def of(self, cls: type[M]) -> list[M]:
        return [m for m in self.messages if isinstance(m, cls)]

    def one(self, cls: type[M]) -> M:
        found = self.of(cls)
        assert len(found) == 1, f"{self.name}: expected one {cls.__name__}, got {len(found)}"
        return found[0]

    def relation(self, name: str) -> Relation:
        found = {r.relation_id: r for r in self.of(Relation) if r.name == name}
        assert len(found) == 1, f"{self.name}: relation {name!r}: {found}"
        return next(iter(found.values()))

    def relation_names(self, ids: Sequence[int]) -> list[str]:
        names = {r.relation_id: r.name for r in self.of(Relation)}
        return [names[i] for i in ids]

    def shape(self) -> list[str]:
        return [type(m).__name__ for m in self.messages]


def load_golden(directory: Path, name: str) -> Golden:
    """Decode one capture file with a fresh decoder of its protocol version."""
    doc = json.loads((directory / f"{name}.json").read_text("utf-8"))
    assert doc["scenario"] == name
    payloads = tuple(bytes.fromhex(m["hex"]) for m in doc["messages"])
    decoder = PgOutputDecoder(doc["proto_version"])
    messages = tuple(decoder.decode(p) for p in payloads)
    assert decoder.in_stream is False, f"{name} ends inside a stream block"
    return Golden(name, doc["proto_version"], doc["options"], doc["dropped"], payloads, messages)


@cache
def golden(name: str) -> Golden:
    return load_golden(GOLDEN_DIR, name)


def transactions(g: Golden) -> Iterator[tuple[Begin, list[Message], Commit]]:
    """The Begin..Commit groups of a non-streamed capture."""
    begin: Begin | None = None
    body: list[Message] = []
    for m in g.messages:
        if isinstance(m, Begin):
            assert begin is None, "nested Begin"
            begin, body = m, []
        elif isinstance(m, Commit):
            assert begin is not None, "Commit without Begin"
            yield begin, body, m
            begin = None
        elif begin is not None:
            body.append(m)
    assert begin is None, "unterminated transaction"


def pg_us(dt: datetime) -> int:
    return (dt - PG_EPOCH) // timedelta(microseconds=1)


# -- every file ---------------------------------------------------------------------


def test_golden_files_exist() -> None:
    assert set(SCENARIOS) >= {
        "basic",
        "binary",
        "identity",
        "messages",
        "orders",
        "origin",
        "stream",
        "stream_prepare",
        "toast",
        "truncate",
        "two_phase",
        "types",
    }
    total = sum(p.stat().st_size for p in GOLDEN_DIR.glob("*.json"))
    assert total < 300 * 1024


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_payload_re_encodes_to_the_original_bytes(name: str) -> None:
    g = golden(name)
    assert g.payloads
    for payload, message in zip(g.payloads, g.messages, strict=True):
        assert encode(message) == payload, message


def test_every_message_type_is_captured() -> None:
    seen = {type(m) for name in SCENARIOS for m in golden(name).messages}
    assert len(ALL_MESSAGE_TYPES) == 19
    assert seen == ALL_MESSAGE_TYPES, f"missing: {ALL_MESSAGE_TYPES - seen}"


def test_every_variant_is_captured() -> None:
    msgs = [m for name in SCENARIOS for m in golden(name).messages]
    kinds = set().union(
        *(
            set(t.kinds)
            for m in msgs
            for t in (getattr(m, "new", None), getattr(m, "old", None))
            if t is not None
        )
    )
    assert kinds == {KIND_NULL, KIND_UNCHANGED_TOAST, KIND_TEXT, KIND_BINARY}
    assert {m.old_kind for m in msgs if isinstance(m, Update)} == {None, "K", "O"}
    assert {m.old_kind for m in msgs if isinstance(m, Delete)} == {"K", "O"}
    assert {m.replica_identity for m in msgs if isinstance(m, Relation)} == set("dfin")
    assert {m.options for m in msgs if isinstance(m, Truncate)} == {0, 1, 3}
    assert {m.transactional for m in msgs if isinstance(m, LogicalMessage)} == {True, False}
    assert {m.xid == m.subxid for m in msgs if isinstance(m, StreamAbort)} == {True, False}
    assert {m.first_segment for m in msgs if isinstance(m, StreamStart)} == {True, False}
    in_stream = [m for m in msgs if isinstance(m, Relation | Insert | Truncate | LogicalMessage)]
    assert {m.xid is None for m in in_stream} == {True, False}


# -- per scenario -------------------------------------------------------------------


def check_transaction_boundaries(g: Golden) -> None:
    previous_end = INVALID_LSN
    previous_xid = -1
    for begin, _body, commit in transactions(g):
        assert begin.final_lsn == commit.commit_lsn
        assert commit.end_lsn > commit.commit_lsn > previous_end
        assert begin.commit_ts == commit.commit_ts
        assert commit.flags == 0
        assert begin.xid > previous_xid
        previous_end, previous_xid = commit.end_lsn, begin.xid


def check_basic(g: Golden) -> None:
    assert g.proto_version == 1
    assert g.shape() == [
        "Begin", "Relation", "Insert", "Insert", "Commit",
        "Begin", "Update", "Commit",
        "Begin", "Update", "Commit",
        "Begin", "Delete", "Commit",
    ]  # fmt: skip
    check_transaction_boundaries(g)
    assert all(b.commit_ts in PLAUSIBLE_TS for b in g.of(Begin))

    items = g.relation("items")
    assert (items.xid, items.namespace, items.replica_identity) == (None, "public", "d")
    assert [c.name for c in items.columns] == ["id", "name", "price", "tags", "added"]
    assert [c.type_oid for c in items.columns] == [INT4, TEXT, NUMERIC, TEXT_ARRAY, TIMESTAMPTZ]
    assert [c.type_modifier for c in items.columns] == [-1, -1, numeric_typmod(10, 2), -1, -1]
    assert [c.is_key for c in items.columns] == [True, False, False, False, False]

    first, second = g.of(Insert)
    assert first.relation_id == second.relation_id == items.relation_id
    assert first.xid is None
    assert first.new.kinds == b"ttttt"
    assert first.new.values == (b"1", b"widget", b"9.99", b"{a,b}", b"2024-05-06 07:08:09+00")
    assert second.new.kinds == b"ttnnn"
    assert second.new.values == (b"2", "gadget ☃".encode(), None, None, None)

    plain, key_change = g.of(Update)
    assert (plain.old_kind, plain.old) == (None, None)
    assert plain.new.values[:3] == (b"1", b"widget", b"10.50")
    assert key_change.old_kind == "K"
    assert key_change.old is not None
    assert key_change.old.kinds == b"tnnnn"
    assert key_change.old.values == (b"2", None, None, None, None)
    assert key_change.new.values[:2] == (b"3", "gadget ☃".encode())

    delete = g.one(Delete)
    assert delete.old_kind == "K"
    assert (delete.old.kinds, delete.old.values) == (b"tnnnn", (b"1", None, None, None, None))


def check_identity(g: Golden) -> None:
    check_transaction_boundaries(g)

    full = g.relation("ident_full")
    assert full.replica_identity == "f"
    assert [c.flags for c in full.columns] == [1, 1]  # FULL: every column is "key"
    index = g.relation("ident_index")
    assert index.replica_identity == "i"
    assert [(c.name, c.is_key) for c in index.columns] == [
        ("id", False),
        ("code", True),
        ("v", False),
    ]
    nothing = g.relation("ident_nothing")
    assert nothing.replica_identity == "n"
    assert [c.flags for c in nothing.columns] == [0, 0]

    updates = {g.relation_names([u.relation_id])[0]: u for u in g.of(Update)}
    deletes = {g.relation_names([d.relation_id])[0]: d for d in g.of(Delete)}
    assert set(updates) == set(deletes) == {"ident_full", "ident_index"}

    u = updates["ident_full"]
    assert u.old_kind == "O" and u.old is not None
    assert u.old.values == (b"1", b"one")
    assert u.new.values == (b"1", b"uno")
    d = deletes["ident_full"]
    assert (d.old_kind, d.old.kinds, d.old.values) == ("O", b"tt", (b"1", b"uno"))

    u = updates["ident_index"]
    assert u.old_kind == "K" and u.old is not None
    assert (u.old.kinds, u.old.values) == (b"ntn", (None, b"c1", None))
    assert u.new.values == (b"1", b"c2", b"x")
    d = deletes["ident_index"]
    assert (d.old_kind, d.old.kinds, d.old.values) == ("K", b"ntn", (None, b"c2", None))

    inserted = [g.relation_names([i.relation_id])[0] for i in g.of(Insert)]
    assert inserted == ["ident_full", "ident_index", "ident_nothing"]


def check_types(g: Golden) -> None:
    assert g.shape() == ["Begin", "Type", "Type", "Relation", "Insert", "Commit"]
    typed = g.relation("typed")
    columns = {c.name: c for c in typed.columns}
    by_oid = {t.type_oid: t for t in g.of(Type)}
    assert set(by_oid) == {columns["feeling"].type_oid, columns["qty"].type_oid}
    assert columns["id"].type_oid == INT4

    mood = by_oid[columns["feeling"].type_oid]
    assert (mood.xid, mood.namespace, mood.name) == (None, "public", "mood")
    # For a domain pgoutput sends the domain's OID with the *base* type's name, and
    # pg_catalog as the empty string.
    domain = by_oid[columns["qty"].type_oid]
    assert (domain.namespace, domain.name) == ("", "int4")
    assert domain.type_oid >= 16384  # a user OID, not int4's 23

    insert = g.one(Insert)
    assert insert.new.values == (b"1", b"happy", b"7")


def check_truncate(g: Golden) -> None:
    check_transaction_boundaries(g)
    plain, restart_cascade, cascade = g.of(Truncate)
    assert plain.options == 0 and not plain.cascade and not plain.restart_identity
    assert g.relation_names(plain.relation_ids) == ["trunc_plain"]
    assert restart_cascade.options == 3
    assert restart_cascade.cascade and restart_cascade.restart_identity
    assert g.relation_names(restart_cascade.relation_ids) == ["trunc_parent", "trunc_child"]
    assert cascade.options == 1 and cascade.cascade and not cascade.restart_identity
    # The child is truncated by the cascade and listed although it was not named.
    assert g.relation_names(cascade.relation_ids) == ["trunc_parent", "trunc_child"]
    assert all(t.xid is None for t in g.of(Truncate))


def check_messages(g: Golden) -> None:
    assert g.shape() == [
        "Begin",
        "LogicalMessage",
        "Relation",
        "Insert",
        "Commit",
        "LogicalMessage",
    ]
    begin, commit = g.one(Begin), g.one(Commit)
    transactional, standalone = g.of(LogicalMessage)
    assert transactional.transactional and transactional.flags == 1
    assert transactional.xid is None
    assert transactional.prefix == "cdcd/tx"
    assert transactional.content == b"\x00\xff\x01\x02"
    assert transactional.lsn < begin.final_lsn
    assert not standalone.transactional and standalone.flags == 0
    assert standalone.prefix == "cdcd/näive"
    assert standalone.content == b"plain text"
    assert standalone.lsn >= commit.end_lsn


def check_origin(g: Golden) -> None:
    assert g.shape() == ["Begin", "Origin", "Relation", "Insert", "Commit"]
    origin = g.one(Origin)
    assert origin.name == "cdcd_golden_origin"
    assert origin.origin_lsn == Lsn.parse("0/ABCDEF")
    # pg_replication_origin_xact_setup pins the commit timestamp that Begin/Commit carry.
    pinned = pg_us(datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC))
    assert g.one(Begin).commit_ts == g.one(Commit).commit_ts == pinned
    assert pg_timestamp_to_unix_ms(pinned) == 1704164645678
    check_transaction_boundaries(g)
    assert g.one(Insert).new.values == (b"1", b"from elsewhere")


def check_toast(g: Golden) -> None:
    assert g.shape() == ["Begin", "Relation", "Update", "Commit"]
    toasty = g.relation("toasty")
    assert [c.name for c in toasty.columns] == ["id", "body", "n"]
    update = g.one(Update)
    assert (update.old_kind, update.old) == (None, None)
    assert update.new.kinds == bytes([KIND_TEXT, KIND_UNCHANGED_TOAST, KIND_TEXT])
    assert update.new.values == (b"1", None, b"2")


def check_binary(g: Golden) -> None:
    assert g.options["binary"] is True
    relation = g.relation("bin_rows")
    assert [c.name for c in relation.columns] == [
        "id", "big", "amount", "ok", "at", "doc", "note", "missing",
    ]  # fmt: skip
    insert = g.one(Insert)
    assert insert.new.kinds == b"bbbbbbbn"
    # numeric send format: ndigits, weight, sign, dscale, then base-10000 digits.
    numeric_1234_50 = struct.pack(">hhHh", 2, 0, 0, 2) + struct.pack(">hh", 1234, 5000)
    assert insert.new.values == (
        struct.pack(">i", 42),
        struct.pack(">q", -9_000_000_000),
        numeric_1234_50,
        b"\x01",
        struct.pack(">q", 1_000_000),  # 2000-01-01 00:00:01 UTC in µs since the PG epoch
        b'\x01{"k": 1}',  # jsonb send format: version 1, then the text
        b"hello",
        None,
    )


def _stream_groups(g: Golden) -> dict[int, list[Message]]:
    """Messages of each streamed top-level transaction, keyed by its xid, in order."""
    groups: dict[int, list[Message]] = {}
    current: int | None = None
    for m in g.messages:
        if isinstance(m, StreamStart):
            assert current is None
            current = m.xid
            groups.setdefault(m.xid, []).append(m)
        elif isinstance(m, StreamStop):
            assert current is not None
            groups[current].append(m)
            current = None
        elif current is not None:
            assert isinstance(
                m, Relation | Type | Insert | Update | Delete | Truncate | LogicalMessage
            )
            assert m.xid is not None, f"{m} inside a stream block without xid"
            groups[current].append(m)
        else:
            xid = getattr(m, "xid", None)
            assert isinstance(xid, int)
            assert isinstance(m, StreamCommit | StreamAbort | StreamPrepare | CommitPrepared), m
            groups[xid].append(m)
    return groups


def _check_segments(blocks: list[StreamStart]) -> None:
    assert len(blocks) >= 2, "expected the transaction to stream in several blocks"
    assert [b.first_segment for b in blocks] == [True] + [False] * (len(blocks) - 1)


def check_stream(g: Golden) -> None:
    assert (g.proto_version, g.options["streaming"]) == (2, True)
    assert g.dropped > 0  # trimmed
    groups = _stream_groups(g)
    assert len(groups) == 3
    committed, aborted, with_savepoint = sorted(groups)

    # 1: committed; a Truncate and a transactional message inside the stream carry the xid.
    msgs = groups[committed]
    _check_segments([m for m in msgs if isinstance(m, StreamStart)])
    first_insert = next(m for m in msgs if isinstance(m, Insert))
    assert first_insert.xid == committed
    assert first_insert.new.values == (b"1", b"p" * 80 + b"1")
    truncate = next(m for m in msgs if isinstance(m, Truncate))
    assert truncate.xid == committed and truncate.options == 0
    assert g.relation_names(truncate.relation_ids) == ["stream_small"]
    message = next(m for m in msgs if isinstance(m, LogicalMessage))
    assert (message.xid, message.flags, message.prefix, message.content) == (
        committed, 1, "cdcd/stream", b"inside a stream",
    )  # fmt: skip
    end = msgs[-1]
    assert isinstance(end, StreamCommit)
    assert end.xid == committed and end.flags == 0
    assert end.end_lsn > end.commit_lsn >= message.lsn
    assert end.commit_ts in PLAUSIBLE_TS

    # 2: rolled back as a whole: Stream Abort with subxid == xid, nothing committed.
    msgs = groups[aborted]
    _check_segments([m for m in msgs if isinstance(m, StreamStart)])
    assert msgs[-1] == StreamAbort(aborted, aborted)
    assert not any(isinstance(m, StreamCommit) for m in msgs)

    # 3: a subtransaction rolled back to its savepoint, then the top level commits.
    msgs = groups[with_savepoint]
    _check_segments([m for m in msgs if isinstance(m, StreamStart)])
    aborts = [m for m in msgs if isinstance(m, StreamAbort)]
    assert len(aborts) == 1
    sub = aborts[0].subxid
    assert aborts[0].xid == with_savepoint and sub != with_savepoint and sub > with_savepoint
    assert (aborts[0].abort_lsn, aborts[0].abort_ts) == (None, None)  # proto 2
    before_abort = msgs[: msgs.index(aborts[0])]
    rows_xids = {m.xid for m in before_abort if isinstance(m, Insert)}
    assert rows_xids == {with_savepoint, sub}
    after_abort = msgs[msgs.index(aborts[0]) + 1 :]
    assert sub not in {m.xid for m in after_abort if isinstance(m, Insert)}
    assert isinstance(msgs[-1], StreamCommit) and msgs[-1].xid == with_savepoint
    assert committed < aborted < with_savepoint
    assert end.end_lsn < msgs[-1].commit_lsn


def check_two_phase(g: Golden) -> None:
    assert (g.proto_version, g.options["two_phase"]) == (3, True)
    assert g.shape() == [
        "BeginPrepare", "Relation", "Insert", "Prepare", "CommitPrepared",
        "BeginPrepare", "Insert", "Prepare", "RollbackPrepared",
    ]  # fmt: skip
    (b1, b2), (p1, p2) = g.of(BeginPrepare), g.of(Prepare)
    for begin, prepare, gid in ((b1, p1, "cdcd_gid_commit"), (b2, p2, "cdcd_gid_rollback")):
        assert begin.gid == prepare.gid == gid
        assert (begin.prepare_lsn, begin.end_lsn) == (prepare.prepare_lsn, prepare.end_lsn)
        assert begin.prepare_ts == prepare.prepare_ts
        assert begin.xid == prepare.xid
        assert prepare.end_lsn > prepare.prepare_lsn
        assert prepare.flags == 0
        assert prepare.prepare_ts in PLAUSIBLE_TS
    commit = g.one(CommitPrepared)
    assert (commit.gid, commit.xid, commit.flags) == ("cdcd_gid_commit", p1.xid, 0)
    assert commit.end_lsn > commit.commit_lsn >= p1.end_lsn
    assert commit.commit_ts >= p1.prepare_ts
    rollback = g.one(RollbackPrepared)
    assert (rollback.gid, rollback.xid, rollback.flags) == ("cdcd_gid_rollback", p2.xid, 0)
    assert rollback.prepare_end_lsn == p2.end_lsn
    assert rollback.rollback_end_lsn > rollback.prepare_end_lsn
    assert rollback.prepare_ts == p2.prepare_ts
    assert rollback.rollback_ts >= rollback.prepare_ts
    assert p1.xid < p2.xid
    first, second = g.of(Insert)
    assert (first.new.values, second.new.values) == ((b"1", b"kept"), (b"2", b"dropped"))


def check_stream_prepare(g: Golden) -> None:
    assert g.options["streaming"] is True and g.options["two_phase"] is True
    groups = _stream_groups(g)
    assert len(groups) == 1
    ((xid, msgs),) = groups.items()
    _check_segments([m for m in msgs if isinstance(m, StreamStart)])
    prepare, commit = msgs[-2], msgs[-1]
    assert isinstance(prepare, StreamPrepare) and isinstance(commit, CommitPrepared)
    assert (prepare.xid, prepare.gid, prepare.flags) == (xid, "cdcd_gid_stream", 0)
    assert prepare.end_lsn > prepare.prepare_lsn
    assert (commit.xid, commit.gid) == (xid, "cdcd_gid_stream")
    assert commit.end_lsn > commit.commit_lsn >= prepare.end_lsn
    assert commit.commit_ts >= prepare.prepare_ts
    first_insert = next(m for m in msgs if isinstance(m, Insert))
    assert first_insert.xid == xid and first_insert.new.values[0] == b"40001"


def check_orders(g: Golden) -> None:
    assert g.shape() == ["Begin", "Relation", *["Insert"] * 10, "Commit"]
    check_transaction_boundaries(g)
    orders = g.relation("orders")
    assert [(c.name, c.type_oid, c.type_modifier, c.is_key) for c in orders.columns] == [
        ("id", INT8, -1, True),
        ("customer_id", INT4, -1, False),
        ("status", TEXT, -1, False),
        ("amount", NUMERIC, numeric_typmod(12, 2), False),
        ("created_at", TIMESTAMPTZ, -1, False),
        ("note", TEXT, -1, False),
        ("flags", BOOL, -1, False),
        ("payload", JSONB, -1, False),
    ]
    for i, insert in enumerate(g.of(Insert), start=1):
        assert insert.relation_id == orders.relation_id
        assert insert.new.kinds == b"t" * 8
        id_, customer, status, amount, created, note, flags, payload = insert.new.values
        assert (id_, customer, status) == (str(i).encode(), str(1000 + i).encode(), b"shipped")
        assert amount is not None and Decimal(amount.decode()) == round(
            Decimal(i) * Decimal("137.31") % 10000, 2
        )
        assert created is not None
        assert re.fullmatch(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?[+-]\d\d(:\d\d)?", created)
        assert note == md5(f"order {i}".encode()).hexdigest().encode()
        assert flags == (b"t" if i % 2 == 0 else b"f")
        assert payload is not None and json.loads(payload) == {"sku": f"SKU-{i}", "qty": i}


#: What each scenario's capture must say; also run on fresh captures by
#: ``test_regenerate_golden.py``.
CHECKS: dict[str, Callable[[Golden], None]] = {
    "basic": check_basic,
    "identity": check_identity,
    "types": check_types,
    "truncate": check_truncate,
    "messages": check_messages,
    "origin": check_origin,
    "toast": check_toast,
    "binary": check_binary,
    "stream": check_stream,
    "two_phase": check_two_phase,
    "stream_prepare": check_stream_prepare,
    "orders": check_orders,
}


def test_every_scenario_has_a_check() -> None:
    assert set(CHECKS) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(name: str) -> None:
    CHECKS[name](golden(name))


# -- byte literals: Stream Abort v2/3 vs v4 -------------------------------------------

# 'A', xid 0x01020304, subxid 0x0A0B0C0D
ABORT_V2 = b"A" + bytes.fromhex("01020304") + bytes.fromhex("0a0b0c0d")
# ... plus abort LSN 0x00000016_B374D848 and abort timestamp 2024-01-02 03:04:05.678901 UTC
ABORT_V4 = ABORT_V2 + bytes.fromhex("00000016b374d848") + bytes.fromhex("0002b0ec85204f35")


def test_v4_abort_literal_has_the_documented_layout() -> None:
    assert len(ABORT_V2) == 9
    assert len(ABORT_V4) == 25
    assert int.from_bytes(ABORT_V4[17:], "big", signed=True) == pg_us(
        datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    )


def test_stream_abort_v4_with_abort_lsn_and_timestamp() -> None:
    message = PgOutputDecoder(4).decode(ABORT_V4)
    assert message == StreamAbort(
        xid=0x01020304,
        subxid=0x0A0B0C0D,
        abort_lsn=Lsn.parse("16/B374D848"),
        abort_ts=pg_us(datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)),
    )
    assert isinstance(message, StreamAbort) and isinstance(message.abort_lsn, Lsn)
    assert encode(message) == ABORT_V4


@pytest.mark.parametrize("version", [2, 3, 4])
def test_stream_abort_without_v4_fields(version: int) -> None:
    """v2/v3 always, and v4 without ``streaming = parallel``: 9 bytes, no abort fields."""
    message = PgOutputDecoder(version).decode(ABORT_V2)
    assert message == StreamAbort(0x01020304, 0x0A0B0C0D, None, None)
    assert encode(message) == ABORT_V2


@pytest.mark.parametrize("version", [2, 3])
def test_v4_abort_fields_are_rejected_before_v4(version: int) -> None:
    with pytest.raises(ProtocolError) as info:
        PgOutputDecoder(version).decode(ABORT_V4)
    assert info.value.offset == 9


@pytest.mark.parametrize(
    "payload",
    [ABORT_V4[:10], ABORT_V4[:17], ABORT_V4[:24], ABORT_V4 + b"\0"],
    ids=["tail-1", "tail-8", "tail-15", "tail-17"],
)
def test_v4_abort_with_a_partial_or_long_tail_is_rejected(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        PgOutputDecoder(4).decode(payload)


# -- Lsn ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value", "formatted"),
    [
        ("16/B374D848", 0x16_B374D848, "16/B374D848"),
        ("0/0", 0, "0/00000000"),
        ("0/ABCDEF", 0xABCDEF, "0/00ABCDEF"),
        ("0/00ABCDEF", 0xABCDEF, "0/00ABCDEF"),
        ("a/1", (10 << 32) | 1, "A/00000001"),
        ("FFFFFFFF/FFFFFFFF", 2**64 - 1, "FFFFFFFF/FFFFFFFF"),
        (" 1/0 ", 1 << 32, "1/00000000"),
    ],
)
def test_lsn_parse_and_format(text: str, value: int, formatted: str) -> None:
    lsn = Lsn.parse(text)
    assert lsn == value and isinstance(lsn, Lsn)
    assert str(lsn) == formatted
    assert Lsn.parse(str(lsn)) == lsn
    assert repr(lsn) == f"Lsn('{formatted}')"


@pytest.mark.parametrize(
    "text", ["", "1", "1/", "/1", "1/2/3", "G/0", "0/G", "123456789/0", "0/123456789", "-1/0"]
)
def test_lsn_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError):
        Lsn.parse(text)


@pytest.mark.parametrize("value", [-1, 2**64])
def test_lsn_range(value: int) -> None:
    with pytest.raises(ValueError):
        Lsn(value)


def test_lsn_order_is_numeric() -> None:
    texts = ["1/0", "0/FFFFFFFF", "0/10", "0/9", "A/0", "2/1", "0/0"]
    ordered = sorted(Lsn.parse(t) for t in texts)
    assert [str(x) for x in ordered] == [
        "0/00000000", "0/00000009", "0/00000010", "0/FFFFFFFF",
        "1/00000000", "2/00000001", "A/00000000",
    ]  # fmt: skip
    # With equal high halves the zero-padded text sorts like the number.
    same_high = [Lsn((5 << 32) | low) for low in (0x9, 0x10, 0xA0, 0xFFFF_FFFF)]
    assert sorted(same_high, key=str) == same_high
    assert Lsn.parse("0/FFFFFFFF") + 1 == Lsn.parse("1/0")
    assert hash(Lsn(7)) == hash(7) and 7 in {Lsn(7)}  # hashes like the int
    assert INVALID_LSN == 0 and str(INVALID_LSN) == "0/00000000"
