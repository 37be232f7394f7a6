"""Avro binary encoding primitives (Avro 1.11 spec, "Binary Encoding").

cdcd writes Avro bytes directly from the bytes PostgreSQL sent instead of
building Python dicts for a generic writer: a text column becomes a length
prefix plus the very UTF-8 bytes PostgreSQL sent. These are the shared
primitives (the float codecs in ``cdcd.decode.numeric`` pack IEEE 754 with
``struct`` themselves); plain fastavro decodes everything they produce (the
tests check that).

* int and long: zig-zag, then little-endian base-128 varint.
* bytes and string: a long length, then the bytes.
* float/double: little-endian IEEE 754.
* union: the long index of the branch, then the value.
* array: blocks of (long count, items), ended by a zero count.
"""

from __future__ import annotations

_LONG_MIN = -(1 << 63)
_LONG_MAX = (1 << 63) - 1

NULL_BRANCH = b"\x00"  # union index 0: the "null" branch of ["null", T]
VALUE_BRANCH = b"\x02"  # union index 1: the T branch of ["null", T]
EMPTY_ARRAY = b"\x00"
TRUE = b"\x01"
FALSE = b"\x00"


def encode_bytes(value: bytes) -> bytes:
    """Avro bytes (or string, given its UTF-8 bytes): length then content."""
    return encode_long(len(value)) + value


def encode_string(value: str) -> bytes:
    return encode_bytes(value.encode("utf-8"))


def encode_array(items: list[bytes]) -> bytes:
    """One block holding every already-encoded item, then the end marker."""
    if not items:
        return EMPTY_ARRAY
    return encode_long(len(items)) + b"".join(items) + EMPTY_ARRAY


# Lookup tables for encode_long: the varint of every 14-bit group, as the last
# group (minimal, 1 or 2 bytes) and as a non-final group (2 bytes, continuation bits
# set). About 1 MB; they turn the per-7-bit Python loop into at most 5 lookups.
VARINT_LAST: list[bytes] = [
    bytes([n]) if n < 0x80 else bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(1 << 14)
]
VARINT_MORE: list[bytes] = [bytes([(n & 0x7F) | 0x80, (n >> 7) | 0x80]) for n in range(1 << 14)]

#: The union branch of ``["null", T]``'s T, then the string length ``n``, for
#: ``n`` < 8192: what precedes a nullable string column's bytes.
VALUE_BRANCH_LENGTH: list[bytes] = [VALUE_BRANCH + VARINT_LAST[n << 1] for n in range(8192)]


def encode_long(value: int) -> bytes:
    """Zig-zag varint of an int or long; raises OverflowError outside int64.

    Table-driven (at most five lookups instead of a loop per 7 bits): it runs
    several times per row. Zig-zag maps every int64 to [0, 2**64); a value
    outside int64 maps to 2**63 or more, so the range check is only needed in
    the last branch.
    """
    n = (value << 1) ^ (value >> 63)
    if n < 0x4000:
        return VARINT_LAST[n]
    if n < 0x10000000:
        return VARINT_MORE[n & 0x3FFF] + VARINT_LAST[n >> 14]
    if n < 0x40000000000:
        return VARINT_MORE[n & 0x3FFF] + VARINT_MORE[(n >> 14) & 0x3FFF] + VARINT_LAST[n >> 28]
    if n < 0x100000000000000:
        return (
            VARINT_MORE[n & 0x3FFF]
            + VARINT_MORE[(n >> 14) & 0x3FFF]
            + VARINT_MORE[(n >> 28) & 0x3FFF]
            + VARINT_LAST[n >> 42]
        )
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise OverflowError(f"{value} does not fit an Avro long")
    return (
        VARINT_MORE[n & 0x3FFF]
        + VARINT_MORE[(n >> 14) & 0x3FFF]
        + VARINT_MORE[(n >> 28) & 0x3FFF]
        + VARINT_MORE[(n >> 42) & 0x3FFF]
        + VARINT_LAST[n >> 56]
    )
