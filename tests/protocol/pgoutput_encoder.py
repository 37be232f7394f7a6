"""A test-side pgoutput ENCODER: the inverse of ``cdcd.protocol.decoder``.

Written from PostgreSQL's "Logical Replication Message Formats" page, not from
the decoder: every field is packed big-endian with its documented width
(Int8/Byte1 = 1 byte, Int16 = 2, Int32 = 4, Int64 = 8), strings are UTF-8 and
NUL-terminated. LSNs and xids/OIDs are unsigned, timestamps and the type
modifier / value lengths are signed, as PostgreSQL sends them.

Fields that are only present in some contexts follow the message objects:

* the leading xid of Relation, Type, Insert, Update, Delete, Truncate and
  Message is written iff the message's ``xid`` is not None (inside a
  streamed transaction, protocol v2+);
* Stream Abort's abort LSN and timestamp (protocol v4, ``streaming =
  parallel``) are written iff both are not None.
"""

from __future__ import annotations

import struct

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

__all__ = [
    "encode",
    "encode_tuple_data",
    "int8",
    "int16",
    "int32",
    "int64",
    "lsn",
    "string",
    "uint32",
]


def int8(value: int) -> bytes:
    """Int8 / Byte1: one unsigned byte (flags, tags, kinds)."""
    return struct.pack(">B", value)


def int16(value: int) -> bytes:
    """Int16, unsigned here: column counts."""
    return struct.pack(">H", value)


def int32(value: int) -> bytes:
    """Signed Int32: type modifier, value and content lengths."""
    return struct.pack(">i", value)


def uint32(value: int) -> bytes:
    """Unsigned Int32: TransactionId and OIDs."""
    return struct.pack(">I", value)


def int64(value: int) -> bytes:
    """Signed Int64: TimestampTz (µs since 2000-01-01)."""
    return struct.pack(">q", value)


def lsn(value: int) -> bytes:
    """Unsigned Int64: XLogRecPtr."""
    return struct.pack(">Q", value)


def string(value: str) -> bytes:
    """A NUL-terminated UTF-8 string (must not itself contain NUL)."""
    data = value.encode("utf-8")
    if b"\0" in data:
        raise ValueError(f"pgoutput strings cannot contain NUL: {value!r}")
    return data + b"\0"


def _optional_xid(xid: int | None) -> bytes:
    return b"" if xid is None else uint32(xid)


def encode_tuple_data(data: TupleData) -> bytes:
    """TupleData: Int16 column count, then per column a kind byte and maybe a value."""
    if len(data.kinds) != len(data.values):
        raise ValueError("TupleData kinds and values differ in length")
    out = [int16(len(data.kinds))]
    for kind, value in zip(data.kinds, data.values, strict=True):
        out.append(int8(kind))
        if kind in (ord("t"), ord("b")):
            if value is None:
                raise ValueError(f"kind {chr(kind)!r} needs a value")
            out.append(int32(len(value)))
            out.append(value)
        elif kind in (ord("n"), ord("u")):
            if value is not None:
                raise ValueError(f"kind {chr(kind)!r} carries no value")
        else:
            raise ValueError(f"unknown TupleData kind {kind:#04x}")
    return b"".join(out)


def _column(column: Column) -> bytes:
    return (
        int8(column.flags)
        + string(column.name)
        + uint32(column.type_oid)
        + int32(column.type_modifier)
    )


def encode(message: Message) -> bytes:
    """Encode one message to the bytes PostgreSQL's pgoutput would send for it."""
    match message:
        case Begin(final_lsn=final_lsn, commit_ts=ts, xid=xid):
            return b"B" + lsn(final_lsn) + int64(ts) + uint32(xid)
        case Commit(flags=flags, commit_lsn=commit_lsn, end_lsn=end_lsn, commit_ts=ts):
            return b"C" + int8(flags) + lsn(commit_lsn) + lsn(end_lsn) + int64(ts)
        case Origin(origin_lsn=origin_lsn, name=name):
            return b"O" + lsn(origin_lsn) + string(name)
        case Relation():
            if message.replica_identity not in ("d", "n", "f", "i"):
                raise ValueError(f"bad replica identity {message.replica_identity!r}")
            return (
                b"R"
                + _optional_xid(message.xid)
                + uint32(message.relation_id)
                + string(message.namespace)
                + string(message.name)
                + message.replica_identity.encode("ascii")
                + int16(len(message.columns))
                + b"".join(_column(c) for c in message.columns)
            )
        case Type():
            return (
                b"Y"
                + _optional_xid(message.xid)
                + uint32(message.type_oid)
                + string(message.namespace)
                + string(message.name)
            )
        case Insert():
            return (
                b"I"
                + _optional_xid(message.xid)
                + uint32(message.relation_id)
                + b"N"
                + encode_tuple_data(message.new)
            )
        case Update():
            old = b""
            if message.old_kind is not None or message.old is not None:
                if message.old_kind not in ("K", "O") or message.old is None:
                    raise ValueError("Update old image needs kind 'K' or 'O' and a tuple")
                old = message.old_kind.encode("ascii") + encode_tuple_data(message.old)
            return (
                b"U"
                + _optional_xid(message.xid)
                + uint32(message.relation_id)
                + old
                + b"N"
                + encode_tuple_data(message.new)
            )
        case Delete():
            if message.old_kind not in ("K", "O"):
                raise ValueError(f"Delete old kind must be 'K' or 'O': {message.old_kind!r}")
            return (
                b"D"
                + _optional_xid(message.xid)
                + uint32(message.relation_id)
                + message.old_kind.encode("ascii")
                + encode_tuple_data(message.old)
            )
        case Truncate():
            return (
                b"T"
                + _optional_xid(message.xid)
                + uint32(len(message.relation_ids))
                + int8(message.options)
                + b"".join(uint32(r) for r in message.relation_ids)
            )
        case LogicalMessage():
            return (
                b"M"
                + _optional_xid(message.xid)
                + int8(message.flags)
                + lsn(message.lsn)
                + string(message.prefix)
                + int32(len(message.content))
                + message.content
            )
        case StreamStart(xid=xid, first_segment=first):
            return b"S" + uint32(xid) + int8(1 if first else 0)
        case StreamStop():
            return b"E"
        case StreamCommit():
            return (
                b"c"
                + uint32(message.xid)
                + int8(message.flags)
                + lsn(message.commit_lsn)
                + lsn(message.end_lsn)
                + int64(message.commit_ts)
            )
        case StreamAbort():
            out = b"A" + uint32(message.xid) + uint32(message.subxid)
            if (message.abort_lsn is None) != (message.abort_ts is None):
                raise ValueError("Stream Abort: abort_lsn and abort_ts go together")
            if message.abort_lsn is not None and message.abort_ts is not None:
                out += lsn(message.abort_lsn) + int64(message.abort_ts)
            return out
        case BeginPrepare():
            return (
                b"b"
                + lsn(message.prepare_lsn)
                + lsn(message.end_lsn)
                + int64(message.prepare_ts)
                + uint32(message.xid)
                + string(message.gid)
            )
        case Prepare() | StreamPrepare():
            tag = b"P" if isinstance(message, Prepare) else b"p"
            return (
                tag
                + int8(message.flags)
                + lsn(message.prepare_lsn)
                + lsn(message.end_lsn)
                + int64(message.prepare_ts)
                + uint32(message.xid)
                + string(message.gid)
            )
        case CommitPrepared():
            return (
                b"K"
                + int8(message.flags)
                + lsn(message.commit_lsn)
                + lsn(message.end_lsn)
                + int64(message.commit_ts)
                + uint32(message.xid)
                + string(message.gid)
            )
        case RollbackPrepared():
            return (
                b"r"
                + int8(message.flags)
                + lsn(message.prepare_end_lsn)
                + lsn(message.rollback_end_lsn)
                + int64(message.prepare_ts)
                + int64(message.rollback_ts)
                + uint32(message.xid)
                + string(message.gid)
            )
    raise TypeError(f"not a pgoutput message: {message!r}")
