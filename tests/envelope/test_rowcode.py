"""The generated row encoder equals calling each column's converter.

``compile_row_encoder`` writes the string, integer and boolean converters
inline (``rowcode._inline_text``) and joins the key from the row's key
columns. These properties compare it with the plain definition, column by
column, around every boundary the inlined code has: the 8192-byte string
length table, the one- and two-lookup varint ranges (2**13, 2**27), int64's
ends, and values only the converter handles.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.avro.binary import NULL_BRANCH, VALUE_BRANCH, encode_long
from cdcd.decode.values import bool_from_text, encode_text_value, int_from_text
from cdcd.envelope.rowcode import BinaryValueRefused, compile_key_encoder, compile_row_encoder
from cdcd.protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    TupleData,
)

KEY_HEADER = b"\xc3\x01" + bytes(8)

ints = st.one_of(
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.sampled_from([0, -1, 8191, 8192, -8192, -8193, (1 << 27) - 1, 1 << 27, -(1 << 27),
                     -(1 << 27) - 1, (1 << 63) - 1, -(1 << 63)]),
)  # fmt: skip
strings = st.one_of(
    st.binary(max_size=64),
    st.integers(min_value=8180, max_value=8200).map(lambda n: b"x" * n),
)


def _reference(converters: list, keyed: list[bool], values: list[bytes | None]) -> tuple[bytes, bytes]:
    row, key = [], [KEY_HEADER]
    for convert, is_key, value in zip(converters, keyed, values, strict=True):
        if value is None:
            row.append(NULL_BRANCH)
            continue
        encoded = convert(value)
        row.append(encoded if is_key else VALUE_BRANCH + encoded)
        if is_key:
            key.append(encoded)
    return b"".join(row), b"".join(key)


def _encoder(converters: list, keyed: list[bool]):  # type: ignore[no-untyped-def]
    names = [f"c{i}" for i in range(len(converters))]
    branches = [b"" if k else VALUE_BRANCH for k in keyed]
    key_indexes = [i for i, k in enumerate(keyed) if k]
    return compile_row_encoder(names, converters, branches, KEY_HEADER, key_indexes)


@given(
    key_int=ints,
    key_text=strings,
    value_int=st.one_of(st.none(), ints),
    value_text=st.one_of(st.none(), strings),
    flag=st.sampled_from([None, b"t", b"f"]),
)
def test_inlined_converters_equal_the_converters(
    key_int: int, key_text: bytes, value_int: int | None, value_text: bytes | None, flag: bytes | None
) -> None:
    converters = [int_from_text, encode_text_value, int_from_text, encode_text_value, bool_from_text]
    keyed = [True, True, False, False, False]
    values = [
        str(key_int).encode(),
        key_text,
        None if value_int is None else str(value_int).encode(),
        value_text,
        flag,
    ]
    kinds = bytes(KIND_NULL if v is None else KIND_TEXT for v in values)
    row, toast, key = _encoder(converters, keyed)(TupleData(kinds, tuple(values)), None)
    assert (row, key) == _reference(converters, keyed, values)
    assert toast is None
    assert encode_long(key_int) in key


@pytest.mark.parametrize(
    ("convert", "value"),
    [(int_from_text, str(1 << 63).encode()), (int_from_text, b"12x"), (bool_from_text, b"yes")],
)
def test_inlined_converters_reject_what_the_converters_reject(convert, value: bytes) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((ValueError, OverflowError)):
        convert(value)
    encode = _encoder([convert], [False])
    with pytest.raises((ValueError, OverflowError)):
        encode(TupleData(bytes([KIND_TEXT]), (value,)), None)


def test_a_table_without_key_columns_has_no_key() -> None:
    encode = compile_row_encoder(["a"], [encode_text_value], [VALUE_BRANCH])
    assert encode(TupleData(bytes([KIND_TEXT]), (b"v",)), None) == (VALUE_BRANCH + b"\x02v", None, None)


def test_binary_values_are_refused() -> None:
    """A 'b' value (cdcd never asks for binary) is an error, not something to convert."""
    converters = [int_from_text, encode_text_value]
    encode = _encoder(converters, [True, False])
    binary = TupleData(bytes([KIND_TEXT, KIND_BINARY]), (b"1", b"\x00\x00\x00\x01"))
    with pytest.raises(BinaryValueRefused, match=r"^c1: value sent in binary format \('b'\)"):
        encode(binary, None)
    # Nor is an unchanged TOAST value filled from a binary old image.
    unchanged = TupleData(bytes([KIND_TEXT, KIND_UNCHANGED_TOAST]), (b"1", None))
    with pytest.raises(BinaryValueRefused, match=r"^c1: "):
        encode(unchanged, binary)
    key = compile_key_encoder(KEY_HEADER, [0], ["id"], converters)
    assert key(TupleData(bytes([KIND_TEXT]), (b"1",))) == KEY_HEADER + encode_long(1)
    with pytest.raises(BinaryValueRefused, match=r"^key column id: value sent in binary"):
        key(TupleData(bytes([KIND_BINARY]), (b"\x00\x00\x00\x01",)))
