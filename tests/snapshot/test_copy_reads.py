"""Snapshot rows straight from COPY text: the compiled path equals the pure-Python reference.

``cdcd.snapshot.rows.encode_reads`` turns a chunk of ``COPY … TO STDOUT``
text into the messages of snapshot reads (key, ``op=r`` envelope, headers)
in one call of the C encoder (``RowCodec.copy_reads``); ``encode_reads_python``
parses the text (``parse_copy``) and calls ``TableEncoder.change`` row by
row. Over random tables of every column type the C code parses itself or
hands to a converter, and random rows (nulls, and values holding every
character COPY escapes), these properties require:

* the compiled messages equal the reference's, byte for byte, or both raise
  the same error (type, message, hint);
* the reference equals what the change stream's encoder makes of the same
  row as a TupleData (COPY text round-trips), headers included;
* rows of what PostgreSQL prints, without escapes, never leave the C path.

With ``CDCD_PURE_PYTHON=1`` the compiled comparisons skip; the round trip
still runs.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.decode.relations import TableVersion
from cdcd.decode.types import StaticCatalog
from cdcd.decode.values import column_codec
from cdcd.envelope.encoder import OP_READ, TableEncoder, make_stamp
from cdcd.envelope.rowcode import NATIVE, PackedReads, packed_start_python
from cdcd.errors import DefiniteError
from cdcd.naming import LSN_HEADER, SEQ_HEADER
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Column, TupleData
from cdcd.snapshot.rows import encode_reads, encode_reads_python
from tests.envelope.test_native import REALISTIC, SETTINGS, TYPES, _Wire, compiled, tables

#: What COPY's text format escapes (PostgreSQL's CopyAttributeOutText).
_ESCAPES = {
    ord("\\"): b"\\\\",
    ord("\n"): b"\\n",
    ord("\r"): b"\\r",
    ord("\t"): b"\\t",
    ord("\b"): b"\\b",
    ord("\f"): b"\\f",
    ord("\v"): b"\\v",
}


def copy_line(row: TupleData) -> bytes:
    """``row`` as one line of COPY text output."""
    fields = []
    for kind, value in zip(row.kinds, row.values, strict=True):
        if kind == ord("n"):
            fields.append(b"\\N")
        else:
            assert value is not None
            fields.append(b"".join(_ESCAPES.get(c, bytes((c,))) for c in value))
    return b"\t".join(fields) + b"\n"


#: Text with every character COPY escapes, and text that looks like an escape.
_TRICKY = st.sampled_from(
    [b"\\", b"\\N", b"a\tb", b"line\nbreak", b"\r\n", b"\b\f\v", b"\\x41", b"N", b"", b"\\\\N"]
)


@st.composite
def copy_rows(draw: st.DrawFn, picks: list[int]) -> TupleData:
    """A row COPY can print: every column text or null (never 'u' or 'b')."""
    kinds = []
    values: list[bytes | None] = []
    for p in picks:
        kind = draw(st.sampled_from(b"tttttn"))
        kinds.append(kind)
        if kind == ord("n"):
            values.append(None)
        elif TYPES[p][0] in ("text", "varchar", "jsonb") and draw(st.integers(0, 3)) == 0:
            values.append(draw(_TRICKY))
        else:
            values.append(draw(TYPES[p][3]))
    return TupleData(bytes(kinds), tuple(values))


def _stamp(data: st.DataObject) -> Any:
    return make_stamp(
        0,
        Lsn(data.draw(st.integers(0, 2**63 - 1))),
        data.draw(st.integers(-(2**40), 2**42)),
        snapshot=True,
    )


def _outcome(call: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", call(*args))
    except Exception as exc:  # noqa: BLE001 - compared, type and all
        return ("error", type(exc), str(exc), getattr(exc, "hint", None))


def _reads(data: st.DataObject) -> tuple[TableEncoder, list[TupleData], bytes, Any, int]:
    encoder, picks = data.draw(tables())
    rows = data.draw(st.lists(copy_rows(picks), max_size=6))
    seq = data.draw(st.one_of(st.integers(0, 9000), st.integers(0, 2**40)))
    return encoder, rows, b"".join(copy_line(r) for r in rows), _stamp(data), seq


@compiled
@SETTINGS
@given(st.data())
def test_compiled_copy_reads_equal_the_pure_ones(data: st.DataObject) -> None:
    encoder, _, text, stamp, seq = _reads(data)
    assert encoder.copy_reads is not None  # the compiled one
    header = (LSN_HEADER, stamp.lsn_header)
    compiled = _outcome(encode_reads, encoder, text, stamp, seq, header)
    assert compiled == _outcome(encode_reads_python, encoder, text, stamp, seq, header)
    if compiled[0] == "ok":
        packed = compiled[1]
        assert isinstance(packed, PackedReads)  # no Python object per row
        # Taken one by one (the producer's fallback), as iterated, from either end.
        assert [packed[i] for i in range(len(packed))] == list(packed)
        assert [packed[-i] for i in range(1, len(packed) + 1)] == list(packed)[::-1]
        with pytest.raises(IndexError):
            packed[len(packed)]


@compiled
@SETTINGS
@given(
    st.lists(st.tuples(st.integers(-1, 2**20), st.integers(0, 2**20)), max_size=40),
    st.integers(-3, 43),
)
def test_compiled_packed_start_equals_the_reference(lengths: list[tuple[int, int]], i: int) -> None:
    # Where a read starts, summed in C: keys of -1 (no key) count nothing.
    index = b"".join(struct.pack("=ii", k, v) for k, v in lengths)
    assert NATIVE is not None
    if 0 <= i <= len(lengths):
        assert NATIVE.packed_start(index, i) == packed_start_python(index, i)
        assert packed_start_python(index, i) == sum(max(k, 0) + v for k, v in lengths[:i])
    else:
        with pytest.raises(IndexError):
            NATIVE.packed_start(index, i)
        with pytest.raises(IndexError):
            packed_start_python(index, i)


@SETTINGS
@given(st.data())
def test_copy_reads_equal_the_stream_encoding_of_the_same_rows(data: st.DataObject) -> None:
    """COPY text round-trips: each message is what change() makes of the row itself."""
    encoder, rows, text, stamp, seq = _reads(data)
    header = (LSN_HEADER, stamp.lsn_header)
    expected: list[Any] = []
    try:
        for i, row in enumerate(rows, seq):
            key, value = encoder.change(OP_READ, None, row, stamp, i)
            expected.append((key, value, [header, (SEQ_HEADER, str(i).encode())]))
    except Exception as exc:  # noqa: BLE001 - the same error is expected
        want: tuple[Any, ...] = ("error", type(exc), str(exc), getattr(exc, "hint", None))
    else:
        want = ("ok", expected)
    assert _outcome(encode_reads, encoder, text, stamp, seq, header) == want


_PLAIN = [i for i, t in enumerate(TYPES) if t[0] in REALISTIC]


@compiled
@SETTINGS
@given(st.data())
def test_plain_copy_rows_never_leave_the_compiled_path(data: st.DataObject) -> None:
    encoder, picks = data.draw(tables(_PLAIN))
    assert encoder.copy_reads is not None
    special = set(_ESCAPES)
    lines = []
    for _ in range(data.draw(st.integers(1, 5))):
        values = [
            data.draw(REALISTIC[TYPES[p][0]].filter(lambda v: not special & set(v))) for p in picks
        ]
        lines.append(copy_line(TupleData(b"t" * len(picks), tuple(values))))
    stamp = _stamp(data)
    calls: list[bytes] = []

    def slow(line: bytes, seq: int) -> tuple[bytes | None, bytes]:
        calls.append(line)
        raise AssertionError("left to Python")

    encoder.copy_reads(b"".join(lines), OP_READ, stamp, 0, slow)
    assert calls == []


def _two_column_encoder() -> TableEncoder:
    columns = (Column(1, "id", 23, -1), Column(0, "note", 25, -1))
    table = TableVersion(
        relation_id=1, schema="public", table="t", version=1, replica_identity="d",
        columns=columns, codecs=tuple(column_codec(c.type_oid, -1, StaticCatalog()) for c in columns),
        key_indexes=(0,),
    )  # fmt: skip
    return TableEncoder(table, "pg.public.t", "pg", "app", _Wire())  # type: ignore[arg-type]


@pytest.mark.parametrize("text", [b"1\tx\n2\n", b"1\tx\n2\ty", b"1\tx\ty\n"])
def test_a_row_of_the_wrong_width_or_a_cut_chunk_is_refused_the_same_both_ways(text: bytes) -> None:
    encoder = _two_column_encoder()
    stamp = make_stamp(0, Lsn(1), 0, snapshot=True)
    outcomes = {
        _outcome(fn, encoder, text, stamp, 0, (LSN_HEADER, b""))
        for fn in (encode_reads, encode_reads_python)
    }
    assert len(outcomes) == 1, outcomes
    ((status, kind, message, _),) = outcomes
    assert status == "error" and kind is DefiniteError and "public.t" in message


def test_an_empty_chunk_is_no_messages_and_a_null_key_is_refused_naming_the_column() -> None:
    encoder = _two_column_encoder()
    stamp = make_stamp(0, Lsn(1), 0, snapshot=True)
    assert encode_reads(encoder, b"", stamp, 0, (LSN_HEADER, b"")) == []
    outcome = _outcome(encode_reads, encoder, b"\\N\tx\n", stamp, 0, (LSN_HEADER, b""))
    assert outcome[0] == "error" and "public.t.id" in outcome[2], outcome
