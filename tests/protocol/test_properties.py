"""Property tests: random messages round-trip through encoder and decoder; garbage only raises
``ProtocolError``.

The encoder (``tests.protocol.pgoutput_encoder``) is written from the protocol
documentation, independently of the decoder, so ``decode(encode(m)) == m`` for
random ``m`` checks both against the same reading of the spec, at the edges
of every field width (xid/OID uint32, LSN uint64, timestamps int64, typmod
int32, Int16 column counts, arbitrary unicode names).
"""

from __future__ import annotations

import struct
from dataclasses import FrozenInstanceError, replace
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cdcd.errors import ProtocolError
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    Begin,
    BeginPrepare,
    Column,
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
    TupleData,
    Type,
    Update,
)

from .pgoutput_encoder import encode

# -- field strategies -----------------------------------------------------------------

u8 = st.integers(0, 0xFF)
u32 = st.integers(0, 0xFFFF_FFFF)
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
lsns = st.integers(0, 2**64 - 1).map(Lsn)
#: Any unicode text PostgreSQL could send in a UTF-8 database: no NUL, no lone surrogates.
names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=40)
values = st.binary(max_size=64)


@st.composite
def tuple_data(draw: st.DrawFn, max_columns: int = 24) -> TupleData:
    kinds = draw(st.lists(st.sampled_from(b"nutb"), max_size=max_columns))
    vals = tuple(draw(values) if k in b"tb" else None for k in kinds)
    return TupleData(bytes(kinds), vals)


columns = st.builds(Column, flags=u8, name=names, type_oid=u32, type_modifier=i32)


def relations(xid: st.SearchStrategy[int | None]) -> st.SearchStrategy[Relation]:
    return st.builds(
        Relation,
        xid=xid,
        relation_id=u32,
        namespace=names,
        name=names,
        replica_identity=st.sampled_from("dnfi"),
        columns=st.lists(columns, max_size=12).map(tuple),
    )


@st.composite
def updates(draw: st.DrawFn, xid: st.SearchStrategy[int | None]) -> Update:
    old_kind = draw(st.sampled_from([None, "K", "O"]))
    old = None if old_kind is None else draw(tuple_data())
    return Update(draw(xid), draw(u32), old_kind, old, draw(tuple_data()))


def row_messages(xid: st.SearchStrategy[int | None]) -> st.SearchStrategy[Message]:
    """The messages that carry a leading xid inside a stream block."""
    return st.one_of(
        relations(xid),
        st.builds(Type, xid=xid, type_oid=u32, namespace=names, name=names),
        st.builds(Insert, xid=xid, relation_id=u32, new=tuple_data()),
        updates(xid),
        st.builds(
            Delete, xid=xid, relation_id=u32, old_kind=st.sampled_from("KO"), old=tuple_data()
        ),
        st.builds(Truncate, xid=xid, options=u8, relation_ids=st.lists(u32, max_size=8).map(tuple)),
        st.builds(LogicalMessage, xid=xid, flags=u8, lsn=lsns, prefix=names, content=st.binary()),
    )


stream_aborts_v4 = st.one_of(
    st.builds(StreamAbort, xid=u32, subxid=u32),
    st.builds(StreamAbort, xid=u32, subxid=u32, abort_lsn=lsns, abort_ts=i64),
)

#: Messages that are complete outside a stream block (xid None where it is optional).
top_level_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Begin, final_lsn=lsns, commit_ts=i64, xid=u32),
    st.builds(Commit, flags=u8, commit_lsn=lsns, end_lsn=lsns, commit_ts=i64),
    st.builds(Origin, origin_lsn=lsns, name=names),
    row_messages(st.none()),
    st.builds(StreamCommit, xid=u32, flags=u8, commit_lsn=lsns, end_lsn=lsns, commit_ts=i64),
    st.builds(StreamAbort, xid=u32, subxid=u32),
    st.builds(BeginPrepare, prepare_lsn=lsns, end_lsn=lsns, prepare_ts=i64, xid=u32, gid=names),
    st.builds(
        Prepare, flags=u8, prepare_lsn=lsns, end_lsn=lsns, prepare_ts=i64, xid=u32, gid=names
    ),
    st.builds(
        CommitPrepared, flags=u8, commit_lsn=lsns, end_lsn=lsns, commit_ts=i64, xid=u32, gid=names
    ),
    st.builds(
        RollbackPrepared,
        flags=u8,
        prepare_end_lsn=lsns,
        rollback_end_lsn=lsns,
        prepare_ts=i64,
        rollback_ts=i64,
        xid=u32,
        gid=names,
    ),
    st.builds(
        StreamPrepare, flags=u8, prepare_lsn=lsns, end_lsn=lsns, prepare_ts=i64, xid=u32, gid=names
    ),
)


@st.composite
def stream_blocks(draw: st.DrawFn) -> list[Message]:
    """Stream Start, row messages carrying (sub)transaction xids, Stream Stop."""
    top = draw(u32)
    xids = st.sampled_from([top, *draw(st.lists(u32, max_size=3))])
    inner = draw(st.lists(row_messages(xids), max_size=6))
    return [StreamStart(top, draw(st.booleans())), *inner, StreamStop()]


@st.composite
def message_sequences(draw: st.DrawFn) -> list[Message]:
    """A protocol-shaped sequence: top-level messages interleaved with stream blocks."""
    parts = draw(
        st.lists(st.one_of(top_level_messages.map(lambda m: [m]), stream_blocks()), max_size=8)
    )
    return [message for part in parts for message in part]


#: Messages whose leading xid is only present inside a stream block.
RowMessage = Relation | Type | Insert | Update | Delete | Truncate | LogicalMessage


def positioned(message: Message) -> PgOutputDecoder:
    """A v4 decoder in the stream state ``message`` needs (inside a block iff it has an xid)."""
    decoder = PgOutputDecoder(4)
    if (isinstance(message, RowMessage) and message.xid is not None) or isinstance(
        message, StreamStop
    ):
        decoder.decode(encode(StreamStart(1, False)))
    return decoder


every_message: st.SearchStrategy[Message] = st.one_of(
    top_level_messages,
    row_messages(u32),
    st.builds(StreamStart, xid=u32, first_segment=st.booleans()),
    st.just(StreamStop()),
    stream_aborts_v4,
)


# -- round trips --------------------------------------------------------------------


@given(every_message)
def test_single_message_round_trip(message: Message) -> None:
    decoder = positioned(message)
    payload = encode(message)
    decoded = decoder.decode(payload)
    assert decoded == message
    assert type(decoded) is type(message)
    assert encode(decoded) == payload
    # Row and transaction messages are built through slot descriptors
    # (messages.fast_constructor): they must stay frozen and hashable.
    for field in list(type(decoded).__dataclass_fields__)[:1]:
        with pytest.raises(FrozenInstanceError):
            setattr(decoded, field, getattr(decoded, field))
    assert hash(decoded) == hash(message)


@given(message_sequences(), st.sampled_from([2, 3, 4]))
def test_sequence_round_trip_through_stream_blocks(
    messages: list[Message], protocol_version: int
) -> None:
    decoder = PgOutputDecoder(protocol_version)
    expected_in_stream = False
    for message in messages:
        assert decoder.decode(encode(message)) == message
        if isinstance(message, StreamStart | StreamStop):
            expected_in_stream = isinstance(message, StreamStart)
        assert decoder.in_stream is expected_in_stream
    assert decoder.in_stream is False


@given(row_messages(u32))
def test_xid_is_read_only_inside_a_stream_block(message: Message) -> None:
    """After Stream Stop the decoder no longer expects the leading xid."""
    assert isinstance(message, RowMessage) and message.xid is not None
    decoder = PgOutputDecoder(2)
    decoder.decode(encode(StreamStart(message.xid, True)))
    assert decoder.decode(encode(message)) == message
    decoder.decode(encode(StreamStop()))
    top_level = replace(message, xid=None)
    assert decoder.decode(encode(top_level)) == top_level
    assert decoder.in_stream is False


@given(st.builds(StreamAbort, xid=u32, subxid=u32, abort_lsn=lsns, abort_ts=i64))
def test_v4_abort_fields_only_with_protocol_4(message: StreamAbort) -> None:
    payload = encode(message)
    assert len(payload) == 25
    assert PgOutputDecoder(4).decode(payload) == message
    for version in (1, 2, 3):
        with pytest.raises(ProtocolError):
            PgOutputDecoder(version).decode(payload)
        assert PgOutputDecoder(version).decode(payload[:9]) == StreamAbort(
            message.xid, message.subxid
        )


def test_column_count_width_is_uint16() -> None:
    """The Int16 count is read unsigned; beyond PostgreSQL's 1664 columns it is an error."""
    widest = TupleData(b"n" * 1664, (None,) * 1664)
    assert PgOutputDecoder(1).decode(encode(Insert(None, 1, widest))) == Insert(None, 1, widest)
    many = TupleData(b"n" * 40000, (None,) * 40000)
    with pytest.raises(ProtocolError, match="claims 40000 columns"):
        PgOutputDecoder(1).decode(encode(Insert(None, 1, many)))


# -- fuzzing: nothing but ProtocolError ------------------------------------------------

FUZZ = settings(
    max_examples=300,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow],
)


def decode_or_protocol_error(decoder: PgOutputDecoder, payload: bytes) -> Message | None:
    """Decode; ``ProtocolError`` is the only acceptable failure (anything else propagates)."""
    try:
        return decoder.decode(payload)
    except ProtocolError as exc:
        assert 0 <= exc.offset <= len(payload), exc
        return None


def fresh(in_stream: bool, version: int) -> PgOutputDecoder:
    decoder = PgOutputDecoder(version)
    if in_stream:
        decoder.decode(encode(StreamStart(5, True)))
    return decoder


tags = st.sampled_from(b"BCORYIUDTMSEcAbPKrp")


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200),
        st.tuples(tags, st.binary(max_size=200)).map(lambda t: bytes([t[0]]) + t[1]),
    ),
    st.booleans(),
    st.integers(1, 4),
)
@pytest.mark.timeout(120)
def test_random_bytes_only_raise_protocol_error(
    payload: bytes, in_stream: bool, version: int
) -> None:
    decode_or_protocol_error(fresh(in_stream, version), payload)


def _is_v4_abort_boundary(message: Message, size: int) -> bool:
    """A v4 Stream Abort cut after its xids is a valid v2/v3-style Stream Abort."""
    return isinstance(message, StreamAbort) and message.abort_lsn is not None and size == 9


@FUZZ
@given(every_message)
@pytest.mark.timeout(120)
def test_every_truncation_raises_protocol_error(message: Message) -> None:
    payload = encode(message)
    for size in range(len(payload)):
        decoder = positioned(message)
        if _is_v4_abort_boundary(message, size):
            assert isinstance(message, StreamAbort)
            cut = decoder.decode(payload[:size])
            assert cut == StreamAbort(message.xid, message.subxid)
            continue
        with pytest.raises(ProtocolError):
            decoder.decode(payload[:size])


@FUZZ
@given(every_message, st.binary(min_size=1, max_size=40))
@pytest.mark.timeout(120)
def test_trailing_garbage_raises_protocol_error(message: Message, garbage: bytes) -> None:
    # A 9-byte Stream Abort followed by exactly 16 bytes is a valid v4 Stream Abort.
    assume(
        not (isinstance(message, StreamAbort) and message.abort_lsn is None and len(garbage) == 16)
    )
    decoder = positioned(message)
    with pytest.raises(ProtocolError):
        decoder.decode(encode(message) + garbage)


@FUZZ
@given(every_message, st.data())
@pytest.mark.timeout(120)
def test_mutated_encodings_only_raise_protocol_error(message: Message, data: st.DataObject) -> None:
    payload = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(payload) - 1))
        payload[index] = data.draw(u8)
    decoder = positioned(message)
    decode_or_protocol_error(decoder, bytes(payload))


@pytest.mark.parametrize(
    "payload",
    [
        # A column count of 65535 with no columns behind it.
        b"I" + struct.pack(">I", 1) + b"N" + b"\xff\xff",
        # A value length of 2**31-1 with three bytes behind it.
        b"I" + struct.pack(">I", 1) + b"N\x00\x01t" + struct.pack(">i", 2**31 - 1) + b"abc",
        # A negative value length.
        b"I" + struct.pack(">I", 1) + b"N\x00\x01t" + struct.pack(">i", -1),
        # 2**32-1 truncated relations, none present.
        b"T" + struct.pack(">IB", 0xFFFF_FFFF, 0),
        # 65535 relation columns, none present.
        b"R" + struct.pack(">I", 1) + b"s\0t\0d\xff\xff",
        # Message content longer than the payload, and negative.
        b"M\x01" + struct.pack(">Q", 1) + b"p\0" + struct.pack(">i", 2**31 - 1),
        b"M\x01" + struct.pack(">Q", 1) + b"p\0" + struct.pack(">i", -5) + b"x",
        # Invalid UTF-8 in names.
        b"O" + struct.pack(">Q", 1) + b"\xff\xfe\0",
        b"Y" + struct.pack(">I", 1) + b"\xc3\0name\0",
        # Unknown replica identity, TupleData kind, tuple tags.
        b"R" + struct.pack(">I", 1) + b"s\0t\0x\x00\x00",
        b"I" + struct.pack(">I", 1) + b"N\x00\x01z",
        b"I" + struct.pack(">I", 1) + b"X\x00\x00",
        b"U" + struct.pack(">I", 1) + b"X\x00\x00",
        b"U" + struct.pack(">I", 1) + b"K\x00\x00X\x00\x00",
        b"D" + struct.pack(">I", 1) + b"N\x00\x00",
        # Unknown tag, empty payload, Stream Stop outside a stream block.
        b"Z",
        b"",
        b"E",
    ],
)
def test_hostile_payloads_raise_protocol_error(payload: bytes) -> None:
    for version in (1, 4):
        with pytest.raises(ProtocolError):
            PgOutputDecoder(version).decode(payload)


def test_stream_start_inside_a_stream_block_is_an_error() -> None:
    decoder = PgOutputDecoder(2)
    decoder.decode(encode(StreamStart(7, True)))
    with pytest.raises(ProtocolError):
        decoder.decode(encode(StreamStart(8, True)))


def test_unknown_tag_reports_offset_zero() -> None:
    with pytest.raises(ProtocolError) as info:
        PgOutputDecoder(1).decode(b"Zxyz")
    assert info.value.offset == 0


@pytest.mark.parametrize("length", [10, -1, -5, -(2**31)])
def test_bad_value_length_reports_the_length_field_offset(length: int) -> None:
    payload = b"I" + struct.pack(">I", 1) + b"N\x00\x01t" + struct.pack(">i", length) + b"abc"
    with pytest.raises(ProtocolError) as info:
        PgOutputDecoder(1).decode(payload)
    assert info.value.offset == 9  # where the Int32 length starts


def test_a_rejected_stream_start_leaves_the_stream_state_alone() -> None:
    decoder = PgOutputDecoder(2)
    with pytest.raises(ProtocolError):
        decoder.decode(encode(StreamStart(7, True)) + b"junk")
    assert decoder.in_stream is False


def test_a_rejected_stream_stop_leaves_the_stream_state_alone() -> None:
    decoder = PgOutputDecoder(2)
    decoder.decode(encode(StreamStart(7, True)))
    with pytest.raises(ProtocolError):
        decoder.decode(b"E\x00")
    assert decoder.in_stream is True
