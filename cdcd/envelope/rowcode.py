"""Generated row and key encoders: TupleData straight to Avro record bytes.

Every row of every change passes through here, so each table version gets
its own straight-line function, generated once (the way ``dataclasses``
generates ``__init__``): one local per column, the column's converter and
union branch bound as constants, no loop, no per-column list indexing. In
CPython this runs about twice as fast as the equivalent loop.

Text (``t``) and null (``n``) columns — nearly all of them — are handled
inline. Unchanged-TOAST (``u``) columns go through one shared function,
``rare``, which fills the value from the old row image (REPLICA IDENTITY
FULL) or names the column in ``unchanged_toast``. A binary (``b``) value is a
protocol violation (cdcd never asks pgoutput for binary values): ValueError.

Compiled path: where the C extension ``cdcd.envelope._native`` is built (and
``CDCD_PURE_PYTHON`` is not set), :func:`compile_change_encoder` gives each
table a C encoder of whole changes (key and envelope) that parses the common
types' text itself (:func:`native_column`) and hands every rare case back to
the pure-Python ``TableEncoder.change``, the reference. The tests prove both
byte-identical (tests/envelope/test_native.py).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast, overload

from cdcd.avro.binary import (
    FALSE,
    NULL_BRANCH,
    TRUE,
    VALUE_BRANCH,
    VALUE_BRANCH_LENGTH,
    VARINT_LAST,
    VARINT_MORE,
    encode_long,
)
from cdcd.decode.numeric import decimal_shape
from cdcd.decode.temporal import DATE_CODEC, TIMESTAMP_CODEC, TIMESTAMPTZ_CODEC
from cdcd.decode.values import bool_from_text, encode_text_value, int_from_text
from cdcd.protocol.messages import KIND_BINARY, KIND_TEXT, KIND_UNCHANGED_TOAST, TupleData
from cdcd.protocol.native import load_native

#: The compiled change encoder, if built and allowed (cdcd.protocol.native).
NATIVE = load_native("cdcd.envelope._native")

# Column kinds of the compiled encoder: how it parses a column's text
# (the enum of cdcd/envelope/_native.c).
K_OTHER, K_STRING, K_INT, K_BOOL, K_DECIMAL, K_TIMESTAMPTZ, K_TIMESTAMP, K_DATE = range(8)


class BinaryValueRefused(ValueError):
    """A TupleData value in binary format ('b'): cdcd never asks pgoutput for one."""

    def __init__(self, column: str) -> None:
        super().__init__(
            f"{column}: value sent in binary format ('b'), which cdcd never asks pgoutput for"
        )


Converter = Callable[[bytes], bytes]
RowEncoder = Callable[
    [TupleData, TupleData | None], tuple[bytes, list[str] | None, bytes | None]
]
KeyEncoder = Callable[[TupleData], bytes]


def _null_key(column: str) -> bytes:
    raise ValueError(f"null in key column {column}")


def compile_row_encoder(
    names: Sequence[str],
    text: Sequence[Converter],
    branches: Sequence[bytes],
    key_header: bytes = b"",
    key_indexes: Sequence[int] = (),
    null_branches: Sequence[bytes] | None = None,
) -> RowEncoder:
    """``encode(data, fill) -> (record bytes, unchanged TOAST names or None, key or None)``.

    ``branches[i]`` is ``b"\\x02"`` for a nullable column (union branch 1 of
    ``["null", T]``) and ``b""`` for a key column (plain ``T``);
    ``null_branches[i]`` the bytes of a null (default ``b"\\x00"``, branch 0).
    A ``[T, "null"]`` column (one with a default) has ``b"\\x00"`` and
    ``b"\\x02"``. With
    ``key_indexes``, the Kafka key (``key_header`` then the key columns) is
    assembled from the very bytes of the row's key columns, so a change's key
    costs one join instead of a second conversion; without, it is None.
    """
    count = len(names)
    nulls = tuple(null_branches) if null_branches is not None else (NULL_BRANCH,) * count

    def rare(
        i: int, kind: int, value: bytes | None, fill: TupleData | None, toast: list[str] | None
    ) -> tuple[bytes, bytes, list[str] | None]:
        if kind != KIND_UNCHANGED_TOAST:
            if kind == KIND_BINARY:
                raise BinaryValueRefused(names[i])
            raise ValueError(f"unexpected TupleData kind {chr(kind)!r}")
        if fill is not None:
            old_kind = fill.kinds[i]
            if old_kind == KIND_TEXT:
                return branches[i], text[i](fill.values[i]), toast  # type: ignore[arg-type]
            if old_kind == KIND_BINARY:
                raise BinaryValueRefused(names[i])
        if not branches[i]:
            # A key column: its value is the key, and PostgreSQL sent neither it
            # nor (in the old image) the value it kept.
            raise ValueError(
                f"key column {names[i]} sent as unchanged TOAST ('u') with no old value to take"
            )
        toast = [] if toast is None else toast
        toast.append(names[i])
        return nulls[i], b"", toast

    if count == 0:
        return lambda data, fill: (b"", None, None)
    namespace: dict[str, object] = {
        "rare": rare,
        "_null_key": _null_key,
        "_join": b"".join,
        "_long": encode_long,
        "VL": VARINT_LAST,
        "VM": VARINT_MORE,
        "BL": VALUE_BRANCH_LENGTH,
        "TRUE": TRUE,
        "FALSE": FALSE,
    }
    kinds = ", ".join(f"k{i}" for i in range(count))
    values = ", ".join(f"v{i}" for i in range(count))
    lines = [
        "def encode(data, fill):",
        f"    {kinds}, = data.kinds",
        f"    {values}, = data.values",
        "    toast = None",
    ]
    for i in range(count):
        namespace[f"T{i}"] = text[i]
        namespace[f"B{i}"] = branches[i]
        namespace[f"C{i}"] = names[i]
        namespace[f"N{i}"] = nulls[i]
        null = f"b{i} = _null_key(C{i})" if not branches[i] else f"b{i} = N{i}"
        lines.append(f"    if k{i} == 116:")
        lines += [f"        {line}" for line in _inline_text(i, text[i], branches[i])]
        lines += [
            f"    elif k{i} == 110:",
            f"        {null}; p{i} = E",
            "    else:",
            f"        b{i}, p{i}, toast = rare({i}, k{i}, v{i}, fill, toast)",
        ]
    parts = ", ".join(f"b{i}, p{i}" for i in range(count))
    if key_indexes:
        # A key column's branch is b"" and a text key column's length prefix
        # is in b{i}: (b{i}, p{i}) is exactly the column's plain Avro value.
        namespace["KH"] = key_header
        key = "_join((KH, " + ", ".join(f"b{i}, p{i}" for i in key_indexes) + "))"
    else:
        key = "None"
    lines.append(f"    return _join(({parts},)), toast, {key}")
    namespace["E"] = b""
    exec(compile("\n".join(lines), f"<row encoder {count}>", "exec"), namespace)
    encoder: RowEncoder = namespace["encode"]  # type: ignore[assignment]
    return encoder


def _inline_text(i: int, convert: Converter, branch: bytes) -> list[str]:
    """Statements setting ``b{i}`` (branch, plus length for strings) and ``p{i}`` from text.

    The converters of the commonest column types are written inline (a call
    less per column, several per row); they produce exactly the bytes the
    converter would, and anything unusual still goes through it:

    * strings (text, varchar, json, ...): the length, then the bytes as sent;
    * integers: ``int()``, then the first two branches of ``encode_long``
      (every value below 2**27), else ``encode_long`` itself;
    * booleans: ``t``/``f``, else the converter (which raises).
    """
    if convert is encode_text_value:
        length = (
            "BL[n]" if branch == VALUE_BRANCH else "VL[n << 1]" if not branch else f"B{i} + VL[n << 1]"
        )
        return [
            f"n = len(v{i})",
            f"b{i} = {length} if n < 8192 else B{i} + _long(n); p{i} = v{i}",
        ]
    if convert is int_from_text:
        return [
            f"x = int(v{i}); z = (x << 1) ^ (x >> 63); b{i} = B{i}",
            f"p{i} = VL[z] if z < 16384 else VM[z & 16383] + VL[z >> 14] if z < 268435456 else _long(x)",
        ]
    if convert is bool_from_text:
        return [f"b{i} = B{i}; p{i} = TRUE if v{i} == b't' else FALSE if v{i} == b'f' else T{i}(v{i})"]
    return [f"b{i} = B{i}; p{i} = T{i}(v{i})"]


def compile_key_encoder(
    header: bytes,
    key_indexes: Sequence[int],
    names: Sequence[str],
    text: Sequence[Converter],
) -> KeyEncoder:
    """``encode(data) -> key bytes`` (wire header included) from the key columns."""

    def bad(i: int, kind: int) -> bytes:
        if kind == KIND_BINARY:
            raise BinaryValueRefused(f"key column {names[i]}")
        if kind == KIND_UNCHANGED_TOAST:
            raise ValueError(
                f"key column {names[i]} sent as unchanged TOAST ('u') with no old value to take"
            )
        raise ValueError(f"key column {names[i]} sent as {chr(kind)!r}")

    namespace: dict[str, object] = {"_bad": bad, "H": header, "_join": b"".join}
    lines = ["def encode(data):", "    kinds = data.kinds", "    values = data.values"]
    for n, i in enumerate(key_indexes):
        namespace[f"T{i}"] = text[i]
        lines += [
            f"    k = kinds[{i}]",
            "    if k == 116:",
            f"        p{n} = T{i}(values[{i}])",
            "    else:",
            f"        p{n} = _bad({i}, k)",
        ]
    parts = "".join(f", p{n}" for n in range(len(key_indexes)))
    lines.append(f"    return _join((H{parts}))")
    exec(compile("\n".join(lines), f"<key encoder {len(key_indexes)}>", "exec"), namespace)
    encoder: KeyEncoder = namespace["encode"]  # type: ignore[assignment]
    return encoder


ChangeEncoder = Callable[..., tuple[bytes | None, bytes]]
"""``change(op, before, after, stamp, seq) -> (key or None, value)``, as ``TableEncoder.change``."""

#: A message as ``produce`` takes it: key (None: no key), value, headers.
Message = tuple[bytes | None, bytes, list[tuple[str, bytes]]]
CopyReads = Callable[..., tuple[bytes, bytes]]
"""``copy_reads(data, op, stamp, seq, slow) -> (blob, index)``: every line of COPY text output
as a snapshot read, packed (:class:`PackedReads`), ``slow(line, seq) -> (key, value)`` for
the lines the C code leaves to Python (``cdcd.snapshot.rows.encode_reads``)."""

_LENGTHS = struct.Struct("=ii")


def packed_start_python(index: bytes, i: int) -> int:
    """Where packed read ``i`` starts in its blob: the lengths before it, a key of -1 (none) counting 0."""
    if not 0 <= i <= len(index) // _LENGTHS.size:
        raise IndexError("packed_start(): read index out of range")
    return sum(max(k, 0) + v for k, v in itertools.islice(_LENGTHS.iter_unpack(index), i))


#: :func:`packed_start_python`, compiled where the encoder is.
_packed_start: Callable[[bytes, int], int] = (
    NATIVE.packed_start if NATIVE is not None else packed_start_python
)


class PackedReads(Sequence[Message]):
    """Snapshot reads as the compiled encoder packs them: no Python object per row.

    ``blob`` holds each read's key (when it has one) and then its value;
    ``index`` two native int32 per read, the key's length (-1: no key) and
    the value's. Read ``i`` carries the headers ``lsn_header`` and
    (``seq_name``, ``seq + i`` in decimal). The compiled producer sends them
    straight from the two buffers (``produce_packed``, through
    :attr:`packed`); anything else sees a sequence of :data:`Message`, made
    on demand.
    """

    __slots__ = ("_blob", "_index", "_seq", "_lsn_header", "_seq_name")

    def __init__(
        self, blob: bytes, index: bytes, seq: int, lsn_header: tuple[str, bytes], seq_name: str
    ) -> None:
        self._blob, self._index, self._seq = blob, index, seq
        self._lsn_header, self._seq_name = lsn_header, seq_name

    @property
    def packed(self) -> tuple[bytes, bytes, int, str, bytes, str]:
        """``produce_packed``'s arguments after the topic."""
        name, value = self._lsn_header
        return self._blob, self._index, self._seq, name, value, self._seq_name

    def __len__(self) -> int:
        return len(self._index) // _LENGTHS.size

    def _message(self, i: int, start: int, key_len: int, value_len: int) -> Message:
        blob = self._blob
        key = None if key_len < 0 else blob[start : start + key_len]
        at = start + max(key_len, 0)
        headers = [self._lsn_header, (self._seq_name, b"%d" % (self._seq + i))]
        return key, blob[at : at + value_len], headers

    def __iter__(self) -> Iterator[Message]:
        start = 0
        for i, (key_len, value_len) in enumerate(_LENGTHS.iter_unpack(self._index)):
            yield self._message(i, start, key_len, value_len)
            start += max(key_len, 0) + value_len

    @overload
    def __getitem__(self, i: int) -> Message: ...

    @overload
    def __getitem__(self, i: slice) -> list[Message]: ...

    def __getitem__(self, i: int | slice) -> Message | list[Message]:
        if isinstance(i, slice):
            return list(self)[i]
        count = len(self)
        if i < 0:
            i += count
        if not 0 <= i < count:
            raise IndexError("read index out of range")
        # The sink takes reads one by one where a full queue stopped a batch: a
        # few per chunk, each summing the lengths before it in C.
        start = _packed_start(self._index, i)
        return self._message(i, start, *_LENGTHS.unpack_from(self._index, i * _LENGTHS.size))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedReads | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedReads({len(self)} reads from seq {self._seq})"


def native_column(convert: Converter) -> tuple[int, int, int]:
    """``(kind, precision, scale)``: how the compiled encoder reads a column's text.

    Each kind is the C twin of one converter; any other converter is
    ``K_OTHER`` (the compiled encoder calls it).
    """
    if convert is encode_text_value:
        return K_STRING, 0, 0
    if convert is int_from_text:
        return K_INT, 0, 0
    if convert is bool_from_text:
        return K_BOOL, 0, 0
    shape = decimal_shape(convert)
    if shape is not None:
        return K_DECIMAL, shape[0], shape[1]
    if convert is TIMESTAMPTZ_CODEC.from_text:
        return K_TIMESTAMPTZ, 0, 0
    if convert is TIMESTAMP_CODEC.from_text:
        return K_TIMESTAMP, 0, 0
    if convert is DATE_CODEC.from_text:
        return K_DATE, 0, 0
    return K_OTHER, 0, 0


def compile_change_encoder(
    text: Sequence[Converter],
    branches: Sequence[bytes],
    null_branches: Sequence[bytes],
    key_indexes: Sequence[int],
    key_header: bytes,
    value_header: bytes,
    source_prefix: bytes,
    fallback: ChangeEncoder,
) -> ChangeEncoder | None:
    """The compiled ``change`` of one table version, or None without the extension.

    ``fallback`` is the pure-Python ``TableEncoder.change``: the compiled one
    calls it for every change it does not encode itself (unchanged TOAST,
    binary or null-key values, values a converter refuses), so errors and
    rare cases behave exactly as in Python.
    """
    if NATIVE is None:
        return None
    columns = []
    for convert, branch, null in zip(text, branches, null_branches, strict=True):
        kind, precision, scale = native_column(convert)
        columns.append((kind, branch, null, convert, precision, scale))
    codec: Any = NATIVE.RowCodec(
        columns, tuple(key_indexes), key_header, value_header, source_prefix, fallback, TupleData
    )
    return cast(ChangeEncoder, codec.change)


InsertRun = Callable[[list[bytes], int, int, bytes, Any, int], tuple[bytes, bytes, int, int]]
"""``insert_run(batch, start, relation_id, op, stamp, seq) -> (blob, index, end, size)``: the
pgoutput Inserts of one table that start ``batch[start:]``, packed as :class:`PackedReads`
(``seq`` on), up to ``end``, the first message the C code leaves to the decoder; ``size``
is the bytes of the messages taken."""


def _codec_method(change: ChangeEncoder, name: str) -> Any:
    """Method ``name`` of the compiled encoder behind ``change``; None on the pure path."""
    if NATIVE is None:
        return None
    codec = getattr(change, "__self__", None)
    if not isinstance(codec, NATIVE.RowCodec):
        return None
    return getattr(codec, name)


def native_insert_run(change: ChangeEncoder) -> InsertRun | None:
    """The compiled encoder's ``insert_run`` behind ``change``; None on the pure path."""
    return cast(InsertRun | None, _codec_method(change, "insert_run"))


def native_copy_reads(change: ChangeEncoder) -> CopyReads | None:
    """The compiled encoder's ``copy_reads`` behind ``change``; None on the pure path."""
    return cast(CopyReads | None, _codec_method(change, "copy_reads"))
