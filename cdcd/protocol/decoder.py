"""pgoutput binary protocol decoder, versions 1 to 4. Bytes in, messages out; no I/O.

Each walsender XLogData payload holds exactly one pgoutput message whose first
byte is its tag. Quirks handled here:

* **Streamed transactions (v2+).** Between Stream Start and Stream Stop the
  row messages, Relation, Type, Truncate and Message carry a leading xid. The
  message layout alone does not say whether that xid is present, so the
  decoder is stateful: it tracks whether a stream block is open.
* **Stream Abort (v4).** With ``streaming = parallel`` PostgreSQL 16+ appends
  the abort LSN and timestamp; without it (or before v4) it does not. Every
  payload is a whole message, so the remaining length tells which.
* **Update.** The optional old image is tagged 'K' (replica identity key
  columns) or 'O' (whole old row, REPLICA IDENTITY FULL); the new image is
  always tagged 'N'. Delete carries 'K' or 'O'.
* **Strings** are NUL-terminated in the database encoding; cdcd requires
  UTF-8 databases (``cdcd check`` verifies it), so invalid UTF-8 is an error.

Unknown tags, truncated messages and trailing bytes raise ``ProtocolError``
with the byte offset; nothing is ever skipped silently.

Compiled path: where the C extension ``cdcd.protocol._native`` is built (and
``CDCD_PURE_PYTHON`` is not set), Begin, Commit, Insert, Update and Delete
outside stream blocks are parsed in C into the same message objects; every
other message, and anything irregular, comes here. This module is the
reference; the tests prove both paths equal (tests/protocol/test_native.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from struct import Struct
from struct import error as StructError
from typing import NoReturn

from cdcd.errors import ProtocolError
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
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
    fast_constructor,
)
from cdcd.protocol.native import load_native

_U8 = Struct("!B")
_U16 = Struct("!H")
_U32 = Struct("!I")
_I32 = Struct("!i")
_BEGIN = Struct("!QqI")  # final LSN, commit ts, xid
_COMMIT = Struct("!BQQq")  # flags, commit LSN, end LSN, commit ts
_ORIGIN = Struct("!Q")
_RELATION_HEAD = Struct("!I")  # relation id
_COLUMN_TYPE = Struct("!Ii")  # type oid, type modifier
_TRUNCATE_HEAD = Struct("!IB")  # relation count, options
_MESSAGE_HEAD = Struct("!BQ")  # flags, LSN
_STREAM_START = Struct("!IB")  # xid, first segment
_STREAM_COMMIT = Struct("!IBQQq")  # xid, flags, commit LSN, end LSN, commit ts
_STREAM_ABORT = Struct("!II")  # xid, subxid
_STREAM_ABORT_V4 = Struct("!Qq")  # abort LSN, abort ts
_BEGIN_PREPARE = Struct("!QQqI")  # prepare LSN, end LSN, prepare ts, xid
_PREPARE = Struct("!BQQqI")  # flags, prepare/commit LSN, end LSN, ts, xid
_ROLLBACK_PREPARED = Struct("!BQQqqI")  # flags, prepare end, rollback end, 2 ts, xid

# The messages of every row and transaction, built without dataclass __init__.
_NEW_TUPLE_DATA = fast_constructor(TupleData)
_NEW_INSERT = fast_constructor(Insert)
_NEW_UPDATE = fast_constructor(Update)
_NEW_DELETE = fast_constructor(Delete)
_NEW_BEGIN = fast_constructor(Begin)
_NEW_COMMIT = fast_constructor(Commit)
# Lsn from a uint64 the struct already bounded: int's constructor, without
# Lsn.__new__'s range check (a Python call) for the LSNs of every transaction.
_INT_NEW = int.__new__


def _need(buf: bytes, pos: int, size: int, what: str) -> None:
    if pos + size > len(buf):
        raise ProtocolError(
            f"truncated {what}: needs {size} bytes, {len(buf) - pos} left", pos, buf
        )


def _string(buf: bytes, pos: int, what: str) -> tuple[str, int]:
    end = buf.find(b"\0", pos)
    if end < 0:
        raise ProtocolError(f"unterminated string in {what}", pos, buf)
    try:
        return buf[pos:end].decode("utf-8"), end + 1
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"invalid UTF-8 in {what}", pos + exc.start, buf) from exc


#: MaxTupleAttributeNumber: the most columns a PostgreSQL row can have.
MAX_COLUMNS = 1664
TupleParser = Callable[[bytes, int, int], tuple[TupleData, int]]
_TUPLE_PARSERS: dict[int, TupleParser] = {}


def _tuple_parser(count: int) -> TupleParser:
    """An unrolled TupleData parser for ``count`` columns, generated once per count.

    TupleData is the hot path of the whole daemon: every row of every change
    goes through it. A loop over the columns costs about twice as much in
    CPython as straight-line code with one local per column, so the parser is
    generated (like ``dataclasses`` generates ``__init__``) and cached by
    column count.

    The generated code checks only what Python would not: that a value's
    end lies within the message. Reading past the end (a kind byte or a
    length that is not there) raises IndexError or struct.error, which costs
    nothing until it happens; then :func:`_tuple_error` walks the columns
    again with every check and raises the ``ProtocolError`` with the offset.
    """
    lines = ["def parse(buf, start, size):", "    pos = start", "    try:"]
    for i in range(count):
        lines += [
            f"        k{i} = buf[pos]",
            f"        if k{i} == 116 or k{i} == 98:",
            "            end = pos + 5 + _U32(buf, pos + 1)[0]",
            "            if end > size:",
            f"                _tuple_error(buf, start, {count})",
            f"            v{i} = buf[pos + 5:end]",
            "            pos = end",
            f"        elif k{i} == 110 or k{i} == 117:",
            f"            v{i} = None",
            "            pos += 1",
            "        else:",
            f"            _tuple_error(buf, start, {count})",
        ]
    if count == 0:
        lines.append("        pass")
    kinds = "".join(f"k{i}, " for i in range(count))
    values = "".join(f"v{i}, " for i in range(count))
    lines += [
        "    except (IndexError, _StructError):",
        f"        _tuple_error(buf, start, {count})",
        f"    return _TupleData(bytes(({kinds})), ({values})), pos",
    ]
    namespace: dict[str, object] = {
        "_U32": _U32.unpack_from,
        "_TupleData": _NEW_TUPLE_DATA,
        "_tuple_error": _tuple_error,
        "_StructError": StructError,
    }
    exec(compile("\n".join(lines), f"<tuple parser {count}>", "exec"), namespace)
    generated: TupleParser = namespace["parse"]  # type: ignore[assignment]
    _TUPLE_PARSERS[count] = generated
    return generated


def _tuple_error(buf: bytes, pos: int, count: int) -> NoReturn:
    """Raise the ``ProtocolError`` for TupleData at ``pos`` that a generated parser rejected."""
    size = len(buf)
    for i in range(count):
        if pos >= size:
            raise ProtocolError(f"truncated TupleData at column {i}", pos, buf)
        kind = buf[pos]
        if kind == KIND_TEXT or kind == KIND_BINARY:
            if pos + 5 > size:
                raise ProtocolError(f"truncated value length of column {i}", pos + 1, buf)
            (length,) = _I32.unpack_from(buf, pos + 1)
            if length < 0 or pos + 5 + length > size:
                left = size - pos - 5
                raise ProtocolError(
                    f"value of column {i} claims {length} bytes, {left} left", pos + 1, buf
                )
            pos += 5 + length
        elif kind == KIND_NULL or kind == KIND_UNCHANGED_TOAST:
            pos += 1
        else:
            raise ProtocolError(f"unknown TupleData kind {kind:#04x} in column {i}", pos, buf)
    raise AssertionError("_tuple_error called for valid TupleData")  # a bug in the parser


def _tuple_data(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """Decode TupleData at ``pos``: the column count, then each column."""
    size = len(buf)
    if pos + 2 > size:
        raise ProtocolError("truncated TupleData column count", pos, buf)
    count = (buf[pos] << 8) | buf[pos + 1]
    parser = _TUPLE_PARSERS.get(count)
    if parser is None:
        # Checked before generating a parser: every column takes at least one
        # byte, and no PostgreSQL row has more than 1664 columns.
        if count > MAX_COLUMNS or count > size - pos - 2:
            raise ProtocolError(f"TupleData claims {count} columns", pos, buf)
        parser = _tuple_parser(count)
    return parser(buf, pos + 2, size)


# The compiled parser, if built and allowed; it builds these classes.
_NATIVE = load_native("cdcd.protocol._native")
if _NATIVE is not None:
    _NATIVE.configure(
        Lsn,
        *(
            (cls, tuple(f.name for f in fields(cls)))
            for cls in (Begin, Commit, Insert, Update, Delete, TupleData)
        ),
    )


class PgOutputDecoder:
    """Decodes one pgoutput payload at a time, tracking stream blocks.

    ``protocol_version`` is the ``proto_version`` requested from the server; it
    decides which optional fields may appear (the v4 Stream Abort fields).

    ``decode(payload)`` is the compiled parser where it is available (it
    hands everything it does not take to :meth:`decode_python`), else
    :meth:`decode_python` itself: an attribute, so that the hot path calls C
    without a Python frame in between.
    """

    __slots__ = ("_dispatch", "decode", "in_stream", "protocol_version")

    decode: Callable[[bytes], Message]

    def __init__(self, protocol_version: int = 1) -> None:
        if not 1 <= protocol_version <= 4:
            raise ValueError(f"pgoutput protocol_version must be 1..4, got {protocol_version}")
        self.protocol_version = protocol_version
        self.in_stream = False
        self._dispatch: dict[int, Callable[[bytes], tuple[Message, int]]] = {
            0x42: self._begin,  # B
            0x43: self._commit,  # C
            0x4F: self._origin,  # O
            0x52: self._relation,  # R
            0x59: self._type,  # Y
            0x49: self._insert,  # I
            0x55: self._update,  # U
            0x44: self._delete,  # D
            0x54: self._truncate,  # T
            0x4D: self._message,  # M
            0x53: self._stream_start,  # S
            0x45: self._stream_stop,  # E
            0x63: self._stream_commit,  # c
            0x41: self._stream_abort,  # A
            0x62: self._begin_prepare,  # b
            0x50: self._prepare,  # P
            0x4B: self._commit_prepared,  # K
            0x72: self._rollback_prepared,  # r
            0x70: self._stream_prepare,  # p
        }
        self.decode = (
            _NATIVE.Decoder(self, self.decode_python) if _NATIVE is not None else self.decode_python
        )

    @property
    def compiled(self) -> bool:
        """Whether ``decode`` is the compiled parser."""
        return self.decode != self.decode_python

    def decode_python(self, payload: bytes) -> Message:
        """Decode one whole message; raises ``ProtocolError`` on anything unexpected."""
        if not payload:
            raise ProtocolError("empty pgoutput message", 0, payload)
        handler = self._dispatch.get(payload[0])
        if handler is None:
            raise ProtocolError(f"unknown pgoutput message tag {payload[0]:#04x}", 0, payload)
        message, end = handler(payload)
        if end != len(payload):
            raise ProtocolError(
                f"{len(payload) - end} trailing bytes after {type(message).__name__}", end, payload
            )
        return message

    # -- transaction boundaries -------------------------------------------------

    def _begin(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _BEGIN.size, "Begin")
        final_lsn, ts, xid = _BEGIN.unpack_from(buf, 1)
        return _NEW_BEGIN(_INT_NEW(Lsn, final_lsn), ts, xid), 1 + _BEGIN.size

    def _commit(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _COMMIT.size, "Commit")
        flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(buf, 1)
        commit, end = _INT_NEW(Lsn, commit_lsn), _INT_NEW(Lsn, end_lsn)
        return _NEW_COMMIT(flags, commit, end, ts), 1 + _COMMIT.size

    def _origin(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _ORIGIN.size, "Origin")
        (origin_lsn,) = _ORIGIN.unpack_from(buf, 1)
        name, pos = _string(buf, 1 + _ORIGIN.size, "Origin name")
        return Origin(Lsn(origin_lsn), name), pos

    # -- messages that carry an xid inside a stream block -------------------------

    def _xid(self, buf: bytes, what: str) -> tuple[int | None, int]:
        if not self.in_stream:
            return None, 1
        _need(buf, 1, 4, f"{what} xid")
        return _U32.unpack_from(buf, 1)[0], 5

    def _relation(self, buf: bytes) -> tuple[Message, int]:
        xid, pos = self._xid(buf, "Relation")
        _need(buf, pos, 4, "Relation id")
        (relation_id,) = _RELATION_HEAD.unpack_from(buf, pos)
        namespace, pos = _string(buf, pos + 4, "Relation namespace")
        name, pos = _string(buf, pos, "Relation name")
        _need(buf, pos, 3, "Relation identity and column count")
        identity = chr(buf[pos])
        if identity not in "dnfi":
            raise ProtocolError(f"unknown replica identity {identity!r}", pos, buf)
        (count,) = _U16.unpack_from(buf, pos + 1)
        pos += 3
        columns = []
        for i in range(count):
            _need(buf, pos, 1, f"Relation column {i} flags")
            flags = buf[pos]
            column_name, pos = _string(buf, pos + 1, f"Relation column {i} name")
            _need(buf, pos, _COLUMN_TYPE.size, f"Relation column {i} type")
            type_oid, type_modifier = _COLUMN_TYPE.unpack_from(buf, pos)
            pos += _COLUMN_TYPE.size
            columns.append(Column(flags, column_name, type_oid, type_modifier))
        return Relation(xid, relation_id, namespace, name, identity, tuple(columns)), pos

    def _type(self, buf: bytes) -> tuple[Message, int]:
        xid, pos = self._xid(buf, "Type")
        _need(buf, pos, 4, "Type oid")
        (type_oid,) = _U32.unpack_from(buf, pos)
        namespace, pos = _string(buf, pos + 4, "Type namespace")
        name, pos = _string(buf, pos, "Type name")
        return Type(xid, type_oid, namespace, name), pos

    def _insert(self, buf: bytes) -> tuple[Message, int]:
        # The most frequent message: the common case (no stream) avoids the
        # helper calls of the other handlers.
        if self.in_stream:
            xid, pos = self._xid(buf, "Insert")
        else:
            xid, pos = None, 1
        size = len(buf)
        if size < pos + 5:
            _need(buf, pos, 5, "Insert header")
        (relation_id,) = _U32.unpack_from(buf, pos)
        if buf[pos + 4] != 0x4E:  # N
            raise ProtocolError(f"Insert expects 'N', got {buf[pos + 4]:#04x}", pos + 4, buf)
        # _tuple_data inlined for a known column count: one call less per row.
        parser = _TUPLE_PARSERS.get((buf[pos + 5] << 8) | buf[pos + 6]) if size >= pos + 7 else None
        if parser is None:
            new, pos = _tuple_data(buf, pos + 5)
        else:
            new, pos = parser(buf, pos + 7, size)
        return _NEW_INSERT(xid, relation_id, new), pos

    def _update(self, buf: bytes) -> tuple[Message, int]:
        xid, pos = self._xid(buf, "Update")
        _need(buf, pos, 5, "Update header")
        (relation_id,) = _U32.unpack_from(buf, pos)
        pos += 4
        part = buf[pos]
        old_kind: str | None = None
        old: TupleData | None = None
        if part == 0x4B or part == 0x4F:  # K, O
            old_kind = chr(part)
            old, pos = _tuple_data(buf, pos + 1)
            _need(buf, pos, 1, "Update new tuple tag")
            part = buf[pos]
        if part != 0x4E:
            raise ProtocolError(f"Update expects 'K', 'O' or 'N', got {part:#04x}", pos, buf)
        new, pos = _tuple_data(buf, pos + 1)
        return _NEW_UPDATE(xid, relation_id, old_kind, old, new), pos

    def _delete(self, buf: bytes) -> tuple[Message, int]:
        xid, pos = self._xid(buf, "Delete")
        _need(buf, pos, 5, "Delete header")
        (relation_id,) = _U32.unpack_from(buf, pos)
        part = buf[pos + 4]
        if part != 0x4B and part != 0x4F:
            raise ProtocolError(f"Delete expects 'K' or 'O', got {part:#04x}", pos + 4, buf)
        old, pos = _tuple_data(buf, pos + 5)
        return _NEW_DELETE(xid, relation_id, chr(part), old), pos

    def _truncate(self, buf: bytes) -> tuple[Message, int]:
        xid, pos = self._xid(buf, "Truncate")
        _need(buf, pos, _TRUNCATE_HEAD.size, "Truncate header")
        count, options = _TRUNCATE_HEAD.unpack_from(buf, pos)
        pos += _TRUNCATE_HEAD.size
        _need(buf, pos, 4 * count, "Truncate relation ids")
        relation_ids = Struct(f"!{count}I").unpack_from(buf, pos)
        return Truncate(xid, options, tuple(relation_ids)), pos + 4 * count

    def _message(self, buf: bytes) -> tuple[Message, int]:
        xid, pos = self._xid(buf, "Message")
        _need(buf, pos, _MESSAGE_HEAD.size, "Message header")
        flags, lsn = _MESSAGE_HEAD.unpack_from(buf, pos)
        prefix, pos = _string(buf, pos + _MESSAGE_HEAD.size, "Message prefix")
        _need(buf, pos, 4, "Message content length")
        (length,) = _I32.unpack_from(buf, pos)
        pos += 4
        if length < 0 or pos + length > len(buf):
            raise ProtocolError(
                f"Message content claims {length} bytes, {len(buf) - pos} left", pos - 4, buf
            )
        return LogicalMessage(xid, flags, Lsn(lsn), prefix, buf[pos : pos + length]), pos + length

    # -- streaming (v2) -----------------------------------------------------------

    def _stream_start(self, buf: bytes) -> tuple[Message, int]:
        if self.in_stream:
            raise ProtocolError("Stream Start inside an open stream block", 0, buf)
        _need(buf, 1, _STREAM_START.size, "Stream Start")
        end = 1 + _STREAM_START.size
        if len(buf) != end:  # checked here: a rejected message must not open a stream
            raise ProtocolError(f"{len(buf) - end} trailing bytes after StreamStart", end, buf)
        xid, first = _STREAM_START.unpack_from(buf, 1)
        if first > 1:
            raise ProtocolError(f"Stream Start first-segment flag {first} is not 0 or 1", 5, buf)
        self.in_stream = True
        return StreamStart(xid, first == 1), end

    def _stream_stop(self, buf: bytes) -> tuple[Message, int]:
        if not self.in_stream:
            raise ProtocolError("Stream Stop without Stream Start", 0, buf)
        if len(buf) != 1:
            raise ProtocolError(f"{len(buf) - 1} trailing bytes after StreamStop", 1, buf)
        self.in_stream = False
        return StreamStop(), 1

    def _stream_commit(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _STREAM_COMMIT.size, "Stream Commit")
        xid, flags, commit_lsn, end_lsn, ts = _STREAM_COMMIT.unpack_from(buf, 1)
        return StreamCommit(xid, flags, Lsn(commit_lsn), Lsn(end_lsn), ts), 1 + _STREAM_COMMIT.size

    def _stream_abort(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _STREAM_ABORT.size, "Stream Abort")
        xid, subxid = _STREAM_ABORT.unpack_from(buf, 1)
        pos = 1 + _STREAM_ABORT.size
        if self.protocol_version >= 4 and len(buf) - pos == _STREAM_ABORT_V4.size:
            abort_lsn, abort_ts = _STREAM_ABORT_V4.unpack_from(buf, pos)
            return StreamAbort(xid, subxid, Lsn(abort_lsn), abort_ts), len(buf)
        return StreamAbort(xid, subxid), pos

    # -- two-phase (v3) -----------------------------------------------------------

    def _begin_prepare(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _BEGIN_PREPARE.size, "Begin Prepare")
        prepare_lsn, end_lsn, ts, xid = _BEGIN_PREPARE.unpack_from(buf, 1)
        gid, pos = _string(buf, 1 + _BEGIN_PREPARE.size, "Begin Prepare gid")
        return BeginPrepare(Lsn(prepare_lsn), Lsn(end_lsn), ts, xid, gid), pos

    def _prepare_like(self, buf: bytes, what: str) -> tuple[int, Lsn, Lsn, int, int, str, int]:
        _need(buf, 1, _PREPARE.size, what)
        flags, lsn, end_lsn, ts, xid = _PREPARE.unpack_from(buf, 1)
        gid, pos = _string(buf, 1 + _PREPARE.size, f"{what} gid")
        return flags, Lsn(lsn), Lsn(end_lsn), ts, xid, gid, pos

    def _prepare(self, buf: bytes) -> tuple[Message, int]:
        flags, lsn, end_lsn, ts, xid, gid, pos = self._prepare_like(buf, "Prepare")
        return Prepare(flags, lsn, end_lsn, ts, xid, gid), pos

    def _commit_prepared(self, buf: bytes) -> tuple[Message, int]:
        flags, lsn, end_lsn, ts, xid, gid, pos = self._prepare_like(buf, "Commit Prepared")
        return CommitPrepared(flags, lsn, end_lsn, ts, xid, gid), pos

    def _stream_prepare(self, buf: bytes) -> tuple[Message, int]:
        flags, lsn, end_lsn, ts, xid, gid, pos = self._prepare_like(buf, "Stream Prepare")
        return StreamPrepare(flags, lsn, end_lsn, ts, xid, gid), pos

    def _rollback_prepared(self, buf: bytes) -> tuple[Message, int]:
        _need(buf, 1, _ROLLBACK_PREPARED.size, "Rollback Prepared")
        flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid = (
            _ROLLBACK_PREPARED.unpack_from(buf, 1)
        )
        gid, pos = _string(buf, 1 + _ROLLBACK_PREPARED.size, "Rollback Prepared gid")
        message = RollbackPrepared(
            flags, Lsn(prepare_end), Lsn(rollback_end), prepare_ts, rollback_ts, xid, gid
        )
        return message, pos
