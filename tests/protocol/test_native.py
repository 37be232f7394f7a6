"""The compiled pgoutput parser (``cdcd.protocol._native``) equals the pure-Python decoder.

``PgOutputDecoder.decode`` is the C parser where the extension is built, and
``decode_python`` always the pure-Python reference. Both run on the same
payloads: every message kind (the C code takes Begin, Commit, Insert,
Update and Delete outside stream blocks and hands everything else over),
inside and outside stream blocks, truncated, mutated and random bytes. They
must give equal messages of the same classes, or the same ProtocolError
(message and offset).

With ``CDCD_PURE_PYTHON=1`` (the second CI pass) these skip; the other
protocol tests then run the pure decoder alone.
"""

from __future__ import annotations

import tracemalloc
from dataclasses import FrozenInstanceError
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.errors import ProtocolError
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    StreamStart,
    TupleData,
    Update,
)
from cdcd.protocol.native import native_status

from .pgoutput_encoder import encode
from .test_properties import every_message, i64, lsns, tuple_data, u8, u32

compiled = pytest.mark.skipif(
    not PgOutputDecoder(1).compiled, reason=f"compiled parser not in use: {native_status()}"
)
SETTINGS = settings(
    max_examples=500, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow]
)

#: The messages the C parser takes itself (outside stream blocks).
hot_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Begin, final_lsn=lsns, commit_ts=i64, xid=u32),
    st.builds(Commit, flags=u8, commit_lsn=lsns, end_lsn=lsns, commit_ts=i64),
    st.builds(Insert, xid=st.none(), relation_id=u32, new=tuple_data()),
    st.builds(
        Update,
        xid=st.none(),
        relation_id=u32,
        old_kind=st.sampled_from([None, "K", "O"]),
        old=tuple_data(),
        new=tuple_data(),
    ).map(
        lambda u: u if u.old_kind is not None else Update(None, u.relation_id, None, None, u.new)
    ),
    st.builds(
        Delete, xid=st.none(), relation_id=u32, old_kind=st.sampled_from("KO"), old=tuple_data()
    ),
)


def _decoders(in_stream: bool, version: int = 4) -> tuple[PgOutputDecoder, PgOutputDecoder]:
    pair = (PgOutputDecoder(version), PgOutputDecoder(version))
    if in_stream:
        for decoder in pair:
            decoder.decode_python(encode(StreamStart(5, True)))
    return pair


def _outcome(decode: Any, payload: bytes) -> tuple[Any, ...]:
    try:
        message = decode(payload)
    except ProtocolError as exc:
        return ("error", str(exc), exc.offset)
    fields = tuple(
        (name, type(getattr(message, name))) for name in type(message).__dataclass_fields__
    )
    return ("ok", type(message), message, fields)


def _same(payload: bytes, in_stream: bool = False, version: int = 4) -> tuple[Any, ...]:
    native, pure = _decoders(in_stream, version)
    result = _outcome(native.decode, payload)
    assert result == _outcome(pure.decode_python, payload)
    assert native.in_stream is pure.in_stream
    return result


@compiled
@SETTINGS
@given(hot_messages)
def test_hot_messages_equal_and_same_classes(message: Message) -> None:
    result = _same(encode(message))
    assert result[0] == "ok" and result[2] == message and type(result[2]) is type(message)
    decoded = result[2]
    # Built in C, still frozen and hashable like any dataclass instance.
    first = next(iter(type(decoded).__dataclass_fields__))
    with pytest.raises(FrozenInstanceError):
        setattr(decoded, first, getattr(decoded, first))
    assert hash(decoded) == hash(message)
    for name in ("final_lsn", "commit_lsn", "end_lsn"):
        if hasattr(decoded, name):
            assert type(getattr(decoded, name)) is Lsn


@compiled
@SETTINGS
@given(every_message, st.booleans(), st.integers(1, 4))
def test_every_message_kind_in_and_out_of_streams(
    message: Message, in_stream: bool, version: int
) -> None:
    _same(encode(message), in_stream, version)


@compiled
@SETTINGS
@given(hot_messages, st.data())
def test_truncated_and_mutated_payloads(message: Message, data: st.DataObject) -> None:
    payload = encode(message)
    _same(payload[: data.draw(st.integers(0, len(payload)))])
    _same(payload + data.draw(st.binary(min_size=1, max_size=8)))
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        mutated[data.draw(st.integers(0, len(mutated) - 1))] = data.draw(u8)
    _same(bytes(mutated))


@compiled
@SETTINGS
@given(st.sampled_from(b"BCIUD"), st.binary(max_size=80))
def test_random_bodies(tag: int, body: bytes) -> None:
    _same(bytes([tag]) + body)


@compiled
def test_widest_rows_and_column_limit() -> None:
    widest = TupleData(b"t" * 1664, (b"v",) * 1664)
    assert _same(encode(Insert(None, 1, widest)))[0] == "ok"
    too_many = TupleData(b"n" * 1665, (None,) * 1665)
    assert _same(encode(Insert(None, 1, too_many)))[0] == "error"
    big = TupleData(b"t", (b"x" * 1_000_000,))
    assert _same(encode(Insert(None, 1, big)))[2].new.values[0] == b"x" * 1_000_000


@compiled
def test_in_stream_state_is_read_per_message() -> None:
    """Inside a stream block rows carry an xid: the C parser must hand them to Python."""
    decoder = PgOutputDecoder(2)
    decoder.decode(encode(StreamStart(9, True)))
    row = Insert(9, 16400, TupleData(b"t", (b"1",)))
    assert decoder.decode(encode(row)) == row
    decoder.in_stream = False
    plain = Insert(None, 16400, TupleData(b"t", (b"1",)))
    assert decoder.decode(encode(plain)) == plain


@compiled
def test_no_reference_leaks() -> None:
    decoder = PgOutputDecoder(1)
    payloads = [
        encode(Begin(Lsn(1 << 40), 5, 7)),
        encode(Insert(None, 16400, TupleData(b"tnut", (b"1", None, None, b"\x00\x01")))),
        encode(Update(None, 16400, "K", TupleData(b"t", (b"1",)), TupleData(b"tt", (b"2", b"x")))),
        encode(Delete(None, 16400, "O", TupleData(b"tn", (b"1", None)))),
        encode(Commit(0, Lsn(1 << 40), Lsn((1 << 40) + 8), 9)),
        b"I\x00\x00\x00\x01N\x00\x01z",  # an error, raised by the Python decoder
        b"D\x00\x00\x00\x01K\x00\x01t\x00\x00\x00\x09ab",  # truncated
    ]

    def churn() -> None:
        for _ in range(3000):
            for payload in payloads:
                try:
                    decoder.decode(payload)
                except ProtocolError:
                    pass

    churn()
    tracemalloc.start()
    first, _ = tracemalloc.get_traced_memory()
    churn()
    second, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert second - first < 64 * 1024, second - first
