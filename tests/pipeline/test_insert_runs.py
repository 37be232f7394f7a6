"""Runs of Inserts from pgoutput bytes to packed changes in C: the same messages as row by row.

A plain transaction's Inserts of one table are nearly every message of a
bulk load. With the compiled encoder and producer, ``feed_batch`` hands a
run of them to ``Publisher.insert_run``, which encodes them straight from
their pgoutput bytes (``TableEncoder.insert_run``) and produces them from
C buffers; no message object, ``row()`` or ``produce()`` call per row. The
run stops at the first message the C code does not take, which then goes
through the decoder and ``row()`` as before. These tests require:

* every change the C code takes equals, byte for byte, what the decoder and
  ``TableEncoder.change`` make of the same message (key, envelope, headers,
  ``cdcd.seq``), and the bytes it counts are the messages' own;
* it takes every Insert PostgreSQL sends for the table (no silent
  fallback), and stops exactly at anything else: another table, another
  message, a column count that does not match, an unchanged-TOAST or binary
  column, a truncated or overlong message (which the decoder then refuses
  with its offset);
* through ``feed_batch``, a transaction mixing runs, other changes and a row
  the encoder refuses yields the same produced messages, in the same order,
  or the same error, as the path without runs.

With ``CDCD_PURE_PYTHON=1`` (no compiled encoder) the tests skip.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.ack.tracker import AckTracker
from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import OP_CREATE, EnvelopeEncoder, TableEncoder, make_stamp
from cdcd.envelope.rowcode import PackedReads
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.errors import DefiniteError, ProtocolError
from cdcd.naming import LSN_HEADER, SEQ_HEADER
from cdcd.observability.metrics import Metrics
from cdcd.pipeline import publisher as publisher_module
from cdcd.pipeline.publisher import Publisher
from cdcd.pipeline.transactions import TransactionAssembler
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    IDENTITY_DEFAULT,
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Relation,
    TupleData,
    Update,
)
from cdcd.sink.producer import classify_delivery_report
from tests.envelope.test_native import REALISTIC, SETTINGS, TYPES, compiled, images, tables
from tests.protocol.pgoutput_encoder import encode
from tests.support.recording_sink import RecordingSink

pytestmark = compiled

RELID = 16400  # the relation id of tests.envelope.test_native.tables()


def insert(row: TupleData, relid: int = RELID) -> bytes:
    return encode(Insert(None, relid, row))


def _stamp(data: st.DataObject) -> Any:
    return make_stamp(
        data.draw(st.integers(0, 2**32 - 1)),
        Lsn(data.draw(st.integers(0, 2**63 - 1))),
        data.draw(st.integers(-(2**40), 2**42)),
    )


def _reference(encoder: TableEncoder, payload: bytes, stamp: Any, seq: int) -> Any:
    """What the decoder and change() make of one Insert, as the publisher produces it."""
    message = PgOutputDecoder(1).decode_python(payload)
    assert isinstance(message, Insert)
    key, value = encoder.change(OP_CREATE, None, message.new, stamp, seq)
    return key, value, [(LSN_HEADER, stamp.lsn_header), (SEQ_HEADER, b"%d" % seq)]


def _run(encoder: TableEncoder, batch: list[bytes], start: int, stamp: Any, seq: int) -> tuple[list[Any], int, int]:
    assert encoder.insert_run is not None  # the compiled encoder
    blob, index, end, size = encoder.insert_run(batch, start, RELID, OP_CREATE, stamp, seq)
    taken = list(PackedReads(blob, index, seq, (LSN_HEADER, stamp.lsn_header), SEQ_HEADER))
    assert len(taken) == end - start
    return taken, end, size


@SETTINGS
@given(st.data())
def test_taken_inserts_equal_the_decoder_and_change_byte_for_byte(data: st.DataObject) -> None:
    encoder, picks = data.draw(tables())
    rows = data.draw(st.lists(images(picks), max_size=6))
    batch = [insert(row) for row in rows]
    start = data.draw(st.integers(0, len(batch)))
    seq = data.draw(st.one_of(st.integers(0, 9000), st.integers(0, 2**40)))
    stamp = _stamp(data)
    taken, end, size = _run(encoder, batch, start, stamp, seq)
    assert start <= end <= len(batch)
    assert size == sum(len(p) for p in batch[start:end])
    for i, message in enumerate(taken):
        assert message == _reference(encoder, batch[start + i], stamp, seq + i)
    # Where it stopped (an unchanged-TOAST or binary column, a value the C
    # code leaves to a Python converter or one change() refuses), the decoder
    # and row() take over; test_inserts_postgresql_sends_never_leave_the_run
    # says it never stops at what PostgreSQL sends.


_PLAIN = [i for i, t in enumerate(TYPES) if t[0] in REALISTIC]


@SETTINGS
@given(st.data())
def test_inserts_postgresql_sends_never_leave_the_run(data: st.DataObject) -> None:
    """Values as PostgreSQL prints them (any text: pgoutput does not escape) and nulls where
    the table allows them: the run takes every one."""
    encoder, picks = data.draw(tables(_PLAIN))
    keys = set(encoder.table.key_indexes)
    batch = []
    for _ in range(data.draw(st.integers(1, 5))):
        kinds, values = [], []
        for i, p in enumerate(picks):
            null = i not in keys and encoder.table.nullable(i) and data.draw(st.booleans())
            kinds.append(ord("n") if null else ord("t"))
            values.append(None if null else data.draw(REALISTIC[TYPES[p][0]]))
        batch.append(insert(TupleData(bytes(kinds), tuple(values))))
    stamp = _stamp(data)
    taken, end, _ = _run(encoder, batch, 0, stamp, 0)
    assert end == len(batch)
    assert taken == [_reference(encoder, p, stamp, i) for i, p in enumerate(batch)]


def _two_columns() -> TableEncoder:
    columns = (Column(1, "id", 23, -1), Column(0, "note", 25, -1))
    table, _ = RelationCache(StaticCatalog()).on_relation(
        Relation(None, RELID, "public", "t", IDENTITY_DEFAULT, columns)
    )
    return TableEncoder(table, "pg.public.t", "pg", "app", SingleObjectFormat(lambda fingerprint, text: None))


_ROW = TupleData(b"tt", (b"1", b"x"))
_GOOD = insert(_ROW)

#: Messages a run must stop at, each with whether the decoder then refuses it.
_STOPS = {
    "another table": (insert(_ROW, RELID + 1), False),
    "an update": (encode(Update(None, RELID, None, None, _ROW)), False),
    "a delete": (encode(Delete(None, RELID, "K", TupleData(b"tn", (b"1", None)))), False),
    "one column too few": (insert(TupleData(b"t", (b"1",))), False),
    "one column too many": (insert(TupleData(b"ttt", (b"1", b"x", b"y"))), False),
    "an unchanged TOAST column": (insert(TupleData(b"tu", (b"1", None))), False),
    "a binary column": (insert(TupleData(b"tb", (b"1", b"\x00x"))), False),
    "a truncated value": (_GOOD[:-1], True),
    "a truncated length": (_GOOD[:-4], True),
    "a trailing byte": (_GOOD + b"\x00", True),
    "a value length past the end": (_GOOD[:-5] + b"\x7f\xff\xff\xffx", True),
    "an unknown kind": (_GOOD[:-6] + b"?" + _GOOD[-5:], True),
    "no tuple marker": (_GOOD[:5] + b"K" + _GOOD[6:], True),
}


@pytest.mark.parametrize("what", sorted(_STOPS))
def test_a_run_stops_exactly_at_what_it_does_not_take(what: str) -> None:
    encoder = _two_columns()
    stop, refused = _STOPS[what]
    stamp = make_stamp(9, Lsn(0x1000), 0)
    taken, end, size = _run(encoder, [_GOOD, _GOOD, stop, _GOOD], 0, stamp, 5)
    assert (end, size, len(taken)) == (2, 2 * len(_GOOD), 2)
    assert _run(encoder, [_GOOD, _GOOD, stop, _GOOD], 3, stamp, 5)[1] == 4  # and starts after it
    if refused:
        with pytest.raises(ProtocolError):
            PgOutputDecoder(1).decode_python(stop)


# -- through feed_batch: the same messages with runs as without -------------------------


@pytest.fixture(autouse=True)
def _fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Envelopes carry ts_ms, the processing time: fixed, so two runs can be compared."""
    made = publisher_module.make_stamp

    def make_stamp_at(xid: int, lsn: Lsn, commit_ts_ms: int, snapshot: bool = False, now_ms: Any = None) -> Any:
        return made(xid, lsn, commit_ts_ms, snapshot, 1_700_000_000_000)

    monkeypatch.setattr(publisher_module, "make_stamp", make_stamp_at)


class _PackedSink(RecordingSink):
    """Records like RecordingSink; ``produce_list`` takes packed changes, as the compiled
    producer's does (so the publisher uses runs)."""

    produces_packed = True

    def __init__(self) -> None:
        super().__init__(direct=True)
        self.lists: list[int] = []

    def produce_list(self, topic: str, messages: Any, on_delivery: Any) -> None:
        assert isinstance(messages, PackedReads)
        self.lists.append(len(messages))
        for key, value, headers in messages:
            self.direct.append((topic, key, value, headers, on_delivery))


def _feed(sink: RecordingSink, payloads: list[bytes]) -> tuple[list[Any], BaseException | None, Any]:
    """What the publisher produced from ``payloads`` through ``feed_batch`` (topic, key,
    value, headers), the error it raised, and its cdcd_events_total by (table, op)."""
    tracker = AckTracker(Lsn(0), classify=classify_delivery_report)
    wire = SingleObjectFormat(lambda fingerprint, text: None)
    metrics = Metrics(process_collectors=False)
    publisher = Publisher(
        sink, tracker, EnvelopeEncoder("pg", "app", wire), wire,
        include=lambda schema, table: table != "skipped", ensure_topic=lambda topic: None,
        metrics=metrics,
    )  # fmt: skip
    assembler = TransactionAssembler(RelationCache(StaticCatalog()), publisher)
    decode = PgOutputDecoder(1).decode
    error = None
    try:
        assembler.feed_batch(payloads, decode)
    except DefiniteError as exc:
        error = exc
    produced = [(topic, key, value, headers) for topic, key, value, headers, _ in sink.direct + sink.sent]
    publisher.flush_metrics()
    return produced, error, metrics.events_by_table_op()


def _relation(relid: int, name: str) -> bytes:
    columns = (Column(1, "id", 23, -1), Column(0, "note", 25, -1), Column(0, "n", 1700, -1))
    return encode(Relation(None, relid, "public", name, IDENTITY_DEFAULT, columns))


def _row(i: int, note: bytes | None = b"a\\b\tc\nd") -> TupleData:
    return TupleData(b"ttt" if note is not None else b"tnt", (b"%d" % i, note, b"%d.5" % i))


def _transaction(xid: int, body: list[bytes]) -> list[bytes]:
    lsn = 0x2000 * xid
    return [
        encode(Begin(Lsn(lsn + 0x100), 800_000_000_000_000, xid)),
        *body,
        encode(Commit(0, Lsn(lsn + 0x100), Lsn(lsn + 0x180), 800_000_000_000_000)),
    ]


def test_a_mixed_transaction_produces_the_same_messages_with_and_without_runs() -> None:
    a, b, skipped = 16_500, 16_501, 16_502
    body = [
        *(insert(_row(i), a) for i in range(5)),
        insert(_row(5, None), a),
        encode(Update(None, a, None, None, _row(1, b"new"))),
        *(insert(_row(i), b) for i in range(3)),
        *(insert(_row(i), skipped) for i in range(2)),
        *(insert(_row(i), a) for i in range(6, 9)),
        encode(Delete(None, b, "K", TupleData(b"tnn", (b"1", None, None)))),
        insert(_row(9), a),
    ]
    payloads = [_relation(a, "a"), _relation(b, "b"), _relation(skipped, "skipped")]
    payloads += _transaction(7, body) + _transaction(8, [insert(_row(i), b) for i in range(4)])
    packed = _PackedSink()
    with_runs = _feed(packed, payloads)
    without_runs = _feed(RecordingSink(direct=True), payloads)
    assert with_runs == without_runs
    produced, error, events = with_runs
    assert error is None
    assert len(produced) == 5 + 1 + 1 + 3 + 3 + 2 + 1 + 4  # the delete with its tombstone
    assert events == {("public.a", "c"): 10, ("public.a", "u"): 1, ("public.b", "c"): 7, ("public.b", "d"): 1}
    assert packed.lists == [6, 3, 3, 1, 4]  # the runs, each in one call: a null is no stop


def test_a_row_the_encoder_refuses_fails_the_same_with_and_without_runs() -> None:
    a = 16_500
    refused = TupleData(b"nnt", (None, None, b"1"))  # a null key: change() refuses it, naming it
    payloads = [_relation(a, "a"), *_transaction(7, [insert(_row(1), a), insert(refused, a)])]
    with_runs, error, _ = _feed(_PackedSink(), payloads)
    without_runs, reference, _ = _feed(RecordingSink(direct=True), payloads)
    assert error is not None and reference is not None
    assert (type(error), str(error), error.hint) == (type(reference), str(reference), reference.hint)
    assert with_runs == without_runs and len(with_runs) == 1


def test_a_truncated_insert_in_a_run_is_refused_with_its_offset() -> None:
    a = 16_500
    cut = insert(_row(2), a)[:-3]
    payloads = [_relation(a, "a"), *_transaction(7, [insert(_row(1), a), cut])]
    sink = _PackedSink()
    _, refused, _ = _feed(sink, payloads)
    assert isinstance(refused, ProtocolError) and refused.offset > 0
    assert sink.lists == [1]  # the good one went, the cut one was never skipped silently
