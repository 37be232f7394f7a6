"""Identity by value, fuzzed: every TupleData kind in every column position.

PostgreSQL sends each column of a row image as text (``t``), null (``n``),
unchanged TOAST (``u``: the value was not rewritten and is not sent) or binary
(``b``, which cdcd never asks for). A key column marked ``u`` in the new image
of an UPDATE is unchanged by definition; its value is the old image's (the old
key PostgreSQL logs whenever the key is stored out of line, or the whole old
row with REPLICA IDENTITY FULL). Issue 30: cdcd compared kinds, took
``t`` against ``u`` for a key change, published a delete of a live row, then
failed at the same LSN on every restart, naming the wrong column.

Here the real ``Publisher`` (with its ``TableEncoder``, compiled where built)
gets random inserts, updates and deletes whose images mix all four kinds in
every position, with a default-identity old key, a FULL old row or no old
image. What reaches the sink is checked against a plain model of the rules:

* either the change is published, and every envelope is exactly what the
  model says (values decoded with plain fastavro; unchanged TOAST named; a
  delete and tombstone only when the key values really changed);
* or ``EncodeError`` names ``table.column`` of the first column that cannot be
  encoded, and the LSN — and *nothing* of the change reached the sink (no
  delete of a live row left behind by a create that failed).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fault_sink import FaultSink

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import TableVersion
from cdcd.decode.types import StaticCatalog
from cdcd.decode.values import column_codec
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.errors import EncodeError
from cdcd.pipeline.publisher import Publisher
from cdcd.protocol import Lsn
from cdcd.protocol.messages import Column, Delete, Insert, TupleData, Update

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

T, N, U, B = b"t"[0], b"n"[0], b"u"[0], b"b"[0]
TEXT_OID, INT4_OID = 25, 23
COMMIT_LSN = Lsn(0x16B3748)


@dataclass(frozen=True)
class Case:
    table: TableVersion
    op: str  # insert | update | delete
    old: TupleData | None
    new: TupleData | None


def _value(oid: int) -> st.SearchStrategy[bytes]:
    if oid == INT4_OID:
        return st.integers(-(2**31), 2**31 - 1).map(lambda n: str(n).encode())
    return st.text(alphabet="ab\u00e9 ", max_size=6).map(str.encode)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    count = draw(st.integers(1, 5))
    oids = [draw(st.sampled_from((TEXT_OID, INT4_OID))) for _ in range(count)]
    keys = tuple(sorted(draw(st.sets(st.integers(0, count - 1), max_size=3))))
    full = draw(st.booleans())
    catalog = StaticCatalog()
    columns = tuple(
        Column(1 if (i in keys and not full) else 0, f"c{i}", oid, -1) for i, oid in enumerate(oids)
    )
    table = TableVersion(
        relation_id=16384,
        schema="public",
        table="t",
        version=1,
        replica_identity="f" if full else "d",
        columns=columns,
        codecs=tuple(column_codec(c.type_oid, -1, catalog) for c in columns),
        key_indexes=keys,
    )

    def image(kinds: list[int]) -> TupleData:
        values = [draw(_value(oids[i])) if k == T else (b"\x01\x02" if k == B else None)
                  for i, k in enumerate(kinds)]
        return TupleData(bytes(kinds), tuple(values))

    any_kind = st.sampled_from((T, T, T, N, U, B))
    # Old images are mostly well formed: the interesting failures are in the new one.
    old_kind = st.sampled_from((T,) * 8 + (N, U, B))
    op = draw(st.sampled_from(("update", "update", "update", "insert", "delete")))
    new_kinds = [draw(any_kind) for _ in range(count)]
    shape = draw(st.sampled_from(("none", "key", "row")))
    if op == "delete" and shape == "none":
        shape = "key" if keys and not full else "row"
    old: TupleData | None = None
    if op != "insert" and shape != "none":
        if shape == "key":
            # The old key image: key columns sent (mostly as text), the rest 'n' (not sent).
            old_kinds = [draw(old_kind) if i in keys else N for i in range(count)]
        else:
            old_kinds = [draw(old_kind) for _ in range(count)]
        old = image(old_kinds)
        if op == "update" and draw(st.booleans()):
            # Often the key did not change: the new key columns carry the old
            # values, as text or as unchanged TOAST.
            for i in keys:
                if old.kinds[i] == T:
                    new_kinds[i] = draw(st.sampled_from((T, U)))
    new = image(new_kinds) if op != "delete" else None
    if new is not None and old is not None:
        values = list(new.values)
        kinds = bytearray(new.kinds)
        for i in keys:
            if kinds[i] == T and old.kinds[i] == T and draw(st.booleans()):
                values[i] = old.values[i]
        new = TupleData(bytes(kinds), tuple(values))
    return Case(table, op, old, new)


# -- the model ---------------------------------------------------------------------


def _filled(new: TupleData, old: TupleData | None) -> list[tuple[int, bytes | None]]:
    out = []
    for i, kind in enumerate(new.kinds):
        if kind == U and old is not None and old.kinds[i] == T:
            out.append((T, old.values[i]))
        else:
            out.append((kind, new.values[i]))
    return out


def _bad(table: TableVersion, image: list[tuple[int, bytes | None]]) -> int | None:
    """The first column of an image that cannot be encoded (key columns are plain)."""
    for i, (kind, _) in enumerate(image):
        key = i in table.key_indexes
        if kind == B or (kind in (N, U) and key):
            return i
    return None


def _decoded(oid: int, value: bytes | None) -> Any:
    if value is None:
        return None
    return int(value) if oid == INT4_OID else value.decode()


def _row(table: TableVersion, image: list[tuple[int, bytes | None]]) -> dict[str, Any]:
    return {
        c.name: _decoded(c.type_oid, value if kind == T else None)
        for c, (kind, value) in zip(table.columns, image, strict=True)
    }


def _key(table: TableVersion, image: list[tuple[int, bytes | None]]) -> dict[str, Any] | None:
    if not table.key_indexes:
        return None
    row = _row(table, image)
    return {table.columns[i].name: row[table.columns[i].name] for i in table.key_indexes}


Expected = list[tuple[dict[str, Any] | None, dict[str, Any] | None]]  # (key, value) per message


def expected(case: Case) -> tuple[int | None, Expected]:
    """The column an ``EncodeError`` must name (None: no error), or the messages."""
    table = case.table
    old = [(k, v) for k, v in zip(case.old.kinds, case.old.values, strict=True)] if case.old else None
    new = _filled(case.new, case.old) if case.new is not None else None
    toast = [table.columns[i].name for i, (k, _) in enumerate(new or ()) if k == U]

    def envelope(op: str, before: Any, after: Any, unchanged: list[str]) -> dict[str, Any]:
        return {
            "op": op,
            "before": None if before is None else _row(table, before),
            "after": None if after is None else _row(table, after),
            "unchanged_toast": unchanged,
        }

    if case.op == "insert":
        assert new is not None
        bad = _bad(table, new)
        return bad, [] if bad is not None else [(_key(table, new), envelope("c", None, new, toast))]
    if case.op == "delete":
        assert old is not None
        bad = _bad(table, old)
        if bad is not None:
            return bad, []
        key = _key(table, old)
        return None, [(key, envelope("d", old, None, []))] + ([(key, None)] if key else [])
    assert new is not None and case.new is not None
    changed = old is not None and any(
        case.new.kinds[i] != U and (old[i][0] != case.new.kinds[i] or old[i][1] != case.new.values[i])
        for i in table.key_indexes
    )
    first = _bad(table, old) if old is not None else None
    if first is not None:
        return first, []
    bad = _bad(table, new)
    if bad is not None:
        return bad, []
    if changed:
        assert old is not None
        old_key = _key(table, old)
        return None, [
            (old_key, envelope("d", old, None, [])),
            (old_key, None),
            (_key(table, new), envelope("c", None, new, toast)),
        ]
    return None, [(_key(table, new), envelope("u", old, new, toast))]


# -- the property ------------------------------------------------------------------


def _publish(case: Case) -> tuple[FaultSink, dict[str, Any], EncodeError | None]:
    sink = FaultSink()
    schemas: dict[str, Any] = {}

    def keep(key: bytes, value: bytes) -> None:
        schemas[key.decode()] = fastavro.parse_schema(json.loads(value))

    wire = SingleObjectFormat(keep)
    publisher = Publisher(
        sink,
        AckTracker(Lsn(1), classify=sink.delivery_failure),
        EnvelopeEncoder("pg", "app", wire),
        wire,
        include=lambda schema, table: True,
        ensure_topic=lambda topic: None,
    )
    publisher.begin_transaction(7, COMMIT_LSN, 0)
    relid = case.table.relation_id
    message: Insert | Update | Delete
    if case.op == "insert":
        assert case.new is not None
        message = Insert(None, relid, case.new)
    elif case.op == "update":
        assert case.new is not None
        message = Update(None, relid, None if case.old is None else "K", case.old, case.new)
    else:
        assert case.old is not None
        message = Delete(None, relid, "K", case.old)
    try:
        publisher.row(case.table, message)
    except EncodeError as exc:
        return sink, schemas, exc
    publisher.commit_transaction(Lsn(int(COMMIT_LSN) + 8))
    return sink, schemas, None


def _decode(schemas: dict[str, Any], data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    record = fastavro.schemaless_reader(io.BytesIO(data[10:]), schemas[data[2:10].hex()], None)
    assert isinstance(record, dict)
    return record


def check(case: Case) -> None:
    bad, messages = expected(case)
    sink, schemas, error = _publish(case)
    if bad is not None:
        column = case.table.columns[bad].name
        assert error is not None, f"published although {column} cannot be encoded"
        text = str(error.args[0])
        assert text.startswith(f"public.t.{column}: "), (column, text)
        assert str(COMMIT_LSN) in text, text
        assert error.hint, text
        assert sink.produced == [], "part of a change that failed reached Kafka"
        return
    assert error is None, f"{error.args[0] if error else ''} (expected {messages})"
    got = []
    for m in sink.produced:
        value = _decode(schemas, m.value())
        if value is not None:
            value = {k: value[k] for k in ("op", "before", "after", "unchanged_toast")}
        got.append((_decode(schemas, m.key()), value))
    assert got == messages
    if case.op == "update":
        # Never a delete (or tombstone) under a key whose values did not change.
        deleted = [k for k, v in got if v is None or v["op"] == "d"]
        assert all(k != got[-1][0] for k in deleted), got


@FAST
@given(cases())
def test_every_kind_in_every_column(case: Case) -> None:
    check(case)


@pytest.mark.slow
@SLOW
@given(cases())
def test_every_kind_in_every_column_many(case: Case) -> None:
    check(case)


def _text_table(full: bool) -> TableVersion:
    catalog = StaticCatalog()
    columns = (Column(0 if full else 1, "id", TEXT_OID, -1), Column(0, "body", TEXT_OID, -1),
               Column(0, "n", INT4_OID, -1))
    return TableVersion(16384, "public", "t", 1, "f" if full else "d", columns,
                        tuple(column_codec(c.type_oid, -1, catalog) for c in columns), (0,))


@pytest.mark.parametrize("full", [False, True], ids=["default", "full"])
def test_the_issue_30_update(full: bool) -> None:
    """The UPDATE of the issue: out-of-line key logged as old key, new key 'u'."""
    key = b"k" * 3000
    old = (TupleData(b"ttt", (key, b"body", b"1")) if full
           else TupleData(b"tnn", (key, None, None)))
    case = Case(_text_table(full), "update", old, TupleData(b"uut", (None, None, b"2")))
    check(case)
    sink, schemas, error = _publish(case)
    assert error is None
    [(k, v)] = [(_decode(schemas, m.key()), _decode(schemas, m.value())) for m in sink.produced]
    assert k == {"id": key.decode()} and v is not None and v["op"] == "u"
    assert v["after"]["id"] == key.decode()


def test_a_toasted_key_without_old_image_names_the_key_column() -> None:
    case = Case(_text_table(False), "update", None, TupleData(b"uut", (None, None, b"2")))
    check(case)
    _, _, error = _publish(case)
    assert error is not None and "cdcd resync" in (error.hint or ""), error
