"""Transaction assembly: which changes are published, when, and in what order.

pgoutput delivers three shapes of transaction, and the rule for each follows
from when PostgreSQL knows the outcome:

* **Plain (v1, and small transactions in v2+).** Begin … Commit is sent only
  after the transaction committed, so its changes pass straight through: no
  buffering, memory bounded by the producer's queue even for a million rows.
* **Streamed (v2 ``streaming on``).** A transaction larger than
  ``logical_decoding_work_mem`` is sent in Stream Start/Stop blocks *before*
  it commits, interleaved with other transactions. Its changes are buffered
  per top-level xid, spilled to a local file beyond ``spill_bytes``, and
  published only at Stream Commit. Stream Abort drops the whole transaction
  (``subxid == xid``) or one subtransaction: every change in a stream carries
  the xid of the subtransaction that made it, so a rolled-back savepoint's
  changes are filtered out.
* **Prepared (v3 ``two_phase on``).** Begin Prepare … Prepare (or a streamed
  transaction ended by Stream Prepare) is buffered under its GID and
  published at Commit Prepared; Rollback Prepared drops it. While a prepared
  transaction waits, confirmation is held at its prepare LSN, otherwise a
  restart would skip the PREPARE and the later COMMIT PREPARED would arrive
  without its data.

Relation and Type messages update the relation cache as they arrive, even
inside streams; each buffered change keeps the table version that was
current when it was made.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from struct import Struct
from typing import IO, Any, Protocol

from cdcd.decode.relations import RelationCache, TableVersion
from cdcd.errors import DefiniteError, ProtocolError
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    Begin,
    BeginPrepare,
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
    Type,
    Update,
)

RowMessage = Insert | Update | Delete
#: What a buffered change needs besides its message: its table version(s).
Context = TableVersion | tuple[TableVersion, ...] | None


class ChangeSink(Protocol):
    """Receives committed transactions, each whole and in commit order."""

    def begin_transaction(self, xid: int, commit_lsn: Lsn, commit_ts: int) -> None: ...

    def row(self, table: TableVersion, message: RowMessage) -> None: ...

    def truncate(self, tables: tuple[TableVersion, ...], message: Truncate) -> None: ...

    def logical_message(self, message: LogicalMessage) -> None: ...

    def commit_transaction(self, end_lsn: Lsn) -> None: ...

    def standalone_message(self, message: LogicalMessage) -> None: ...

    def hold_prepared(self, gid: str, prepare_lsn: Lsn) -> None: ...

    def release_prepared(self, gid: str) -> None: ...

    def relation_changed(self, table: TableVersion) -> None: ...


class ChangeBuffer:
    """Changes of one not-yet-committed transaction, as the raw pgoutput payloads.

    Raw payloads are several times smaller than decoded message objects, and
    spilling them is a plain append of length-prefixed records; they are
    decoded again when the transaction is published. Table versions stay in
    memory by key, since they hold prepared codecs. ``streamed`` says whether
    the payloads came inside stream blocks (and so carry an xid).
    """

    _RECORD = Struct("!II")  # context key, payload length
    _OVERHEAD = 120  # Python object overhead per buffered change, for accounting

    def __init__(
        self, spill_bytes: int, spill_dir: str | None, protocol_version: int, streamed: bool
    ) -> None:
        self._spill_bytes = spill_bytes
        self._spill_dir = spill_dir
        self._protocol_version = protocol_version
        self._streamed = streamed
        self._items: list[tuple[int, bytes]] = []
        self._contexts: dict[int, Context] = {}
        self._context_ids: dict[int, int] = {}
        self._memory_bytes = 0
        self._file: IO[bytes] | None = None
        self.spilled_bytes = 0
        self.count = 0
        self.aborted_subxids: set[int] = set()

    def _context_key(self, context: Context) -> int:
        key = self._context_ids.get(id(context))
        if key is None:
            key = len(self._contexts)
            self._contexts[key] = context
            self._context_ids[id(context)] = key
        return key

    def add(self, context: Context, payload: bytes) -> None:
        self._items.append((self._context_key(context), payload))
        self._memory_bytes += len(payload) + self._OVERHEAD
        self.count += 1
        if self._memory_bytes > self._spill_bytes:
            self._spill()

    def _spill(self) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(
                prefix="cdcd-spill-", dir=self._spill_dir, buffering=1 << 20
            )
        pack = self._RECORD.pack
        chunk = b"".join(pack(key, len(payload)) + payload for key, payload in self._items)
        self._file.write(chunk)
        self.spilled_bytes += len(chunk)
        self._items = []
        self._memory_bytes = 0

    def _payloads(self) -> Iterator[tuple[int, bytes]]:
        if self._file is not None:
            self._file.flush()
            end = self._file.tell()
            self._file.seek(0)
            reader = self._file  # buffered by TemporaryFile
            header = self._RECORD.size
            position = 0
            while position < end:
                key, length = self._RECORD.unpack(reader.read(header))
                yield key, reader.read(length)
                position += header + length
        yield from self._items

    def replay(self) -> Iterator[tuple[Context, Message]]:
        """Every change in order, decoded, without those of aborted subtransactions."""
        decoder = PgOutputDecoder(self._protocol_version)
        decoder.in_stream = self._streamed
        aborted = self.aborted_subxids
        for key, payload in self._payloads():
            message = decoder.decode(payload)
            if aborted and getattr(message, "xid", None) in aborted:
                continue
            yield self._contexts[key], message

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._items = []
        self._contexts.clear()
        self._context_ids.clear()


@dataclass
class _Prepared:
    buffer: ChangeBuffer
    xid: int
    prepare_lsn: Lsn


class TransactionAssembler:
    """Feeds decoded messages in; hands committed transactions to a ``ChangeSink``."""

    def __init__(
        self,
        relations: RelationCache,
        sink: ChangeSink,
        spill_bytes: int = 64 * 1024 * 1024,
        spill_dir: str | None = None,
        protocol_version: int = 1,
    ) -> None:
        self.relations = relations
        self._protocol_version = protocol_version
        self._sink = sink
        self._spill_bytes = spill_bytes
        self._spill_dir = spill_dir
        self._in_plain: Begin | None = None
        # The relation cache's own dict (updated in place by on_relation):
        # a lookup per row instead of a call.
        self._tables = relations.current
        self._preparing: tuple[BeginPrepare, ChangeBuffer] | None = None
        self._stream_xid: int | None = None
        self._streams: dict[int, ChangeBuffer] = {}
        #: Stream and two-phase boundaries, by message class (rare: rows,
        #: Begin and Commit are tested first in feed()).
        self._boundaries: dict[type, Callable[[Any], None]] = {
            StreamStart: self._stream_start,
            StreamStop: self._stream_stop,
            StreamCommit: self._stream_commit,
            StreamAbort: self._stream_abort,
            BeginPrepare: self._begin_prepare,
            Prepare: self._prepare,
            StreamPrepare: self._stream_prepare,
            CommitPrepared: self._commit_prepared,
            RollbackPrepared: self._rollback_prepared,
            # The replication origin of the transaction: not part of the envelope.
            Origin: lambda message: None,
        }
        self._prepared: dict[str, _Prepared] = {}

    # -- state seen by the pipeline ------------------------------------------------

    @property
    def idle(self) -> bool:
        """True when no transaction is partly received: keepalives may advance the slot."""
        return (
            self._in_plain is None
            and self._preparing is None
            and not self._streams
            and not self._prepared
        )

    @property
    def buffered_changes(self) -> int:
        return sum(b.count for b in self._streams.values()) + sum(
            p.buffer.count for p in self._prepared.values()
        )

    @property
    def spilled_bytes(self) -> int:
        return sum(b.spilled_bytes for b in self._streams.values()) + sum(
            p.buffer.spilled_bytes for p in self._prepared.values()
        )

    def close(self) -> None:
        for buffer in self._streams.values():
            buffer.close()
        for prepared in self._prepared.values():
            prepared.buffer.close()
        if self._preparing is not None:
            self._preparing[1].close()
        self._streams.clear()
        self._prepared.clear()

    # -- the state machine ----------------------------------------------------------

    def _buffer(self, streamed: bool) -> ChangeBuffer:
        return ChangeBuffer(self._spill_bytes, self._spill_dir, self._protocol_version, streamed)

    def feed_batch(self, batch: list[bytes], decode: Callable[[bytes], Message]) -> int:
        """:meth:`feed` every message of a ``read_batch``, decoded with ``decode``; returns their bytes.

        The session's loop: an Insert of a plain transaction goes to the sink
        from here, without feed()'s frame (the most frequent message by far),
        and so do Begin and Commit to their handlers.
        """
        received = 0
        tables = self._tables
        feed = self.feed
        sink = self._sink
        # A run of Inserts of one table goes to the sink in one call where it
        # takes them from the bytes (Publisher.insert_run); it stops at the
        # first message it leaves to the decoder.
        insert_run = getattr(sink, "insert_run", None) if getattr(sink, "takes_insert_runs", False) else None
        i, count = 0, len(batch)
        while i < count:
            payload = batch[i]
            i += 1
            if insert_run is not None and payload[:1] == b"I" and self._in_plain is not None:
                table = tables.get(int.from_bytes(payload[1:5], "big"))
                if table is not None:
                    end, size = insert_run(table, batch, i - 1)
                    if end >= i:
                        received += size
                        i = end
                        continue
            received += len(payload)
            message = decode(payload)
            kind = type(message)
            if kind is Insert and self._in_plain is not None:
                table = tables.get(message.relation_id)  # type: ignore[union-attr]
                if table is None:
                    table = self.relations.get(message.relation_id)  # type: ignore[union-attr]  # raises
                # Looked up per row: Publisher.watch() shadows row on the instance.
                sink.row(table, message)  # type: ignore[arg-type]
            elif kind is Begin:
                self._begin(message)  # type: ignore[arg-type]
            elif kind is Commit:
                self._commit(message)  # type: ignore[arg-type]
            else:
                feed(message, payload)
        return received

    def feed(self, message: Message, payload: bytes = b"") -> None:
        """Process one decoded message; ``payload`` is the bytes it was decoded from."""
        kind = type(message)
        if kind is Insert or kind is Update or kind is Delete:
            table = self._tables.get(message.relation_id)  # type: ignore[union-attr]
            if table is None:
                table = self.relations.get(message.relation_id)  # type: ignore[union-attr]  # raises
            if self._in_plain is not None:
                # A row of a plain transaction, nearly every message: what
                # _change and _deliver would do, two calls fewer. (_begin
                # refuses a plain transaction inside a stream block or a
                # prepare, and Stream Start and Begin Prepare refuse one
                # inside it: no other state needs checking.)
                self._sink.row(table, message)  # type: ignore[arg-type]
            else:
                self._change(table, message, payload)
        elif kind is Begin:
            self._begin(message)  # type: ignore[arg-type]
        elif kind is Commit:
            self._commit(message)  # type: ignore[arg-type]
        elif kind is Relation:
            table, changed = self.relations.on_relation(message)  # type: ignore[arg-type]
            if changed:
                self._sink.relation_changed(table)
        elif kind is Type:
            self.relations.on_type(message)  # type: ignore[arg-type]
        elif kind is Truncate:
            tables = tuple(self.relations.get(r) for r in message.relation_ids)  # type: ignore[union-attr]
            self._change(tables, message, payload)
        elif kind is LogicalMessage:
            self._logical_message(message, payload)  # type: ignore[arg-type]
        else:
            handler = self._boundaries.get(kind)
            if handler is None:
                raise ProtocolError(f"unexpected message {kind.__name__}", 0)
            handler(message)

    def _change(self, context: Context, message: Message, payload: bytes) -> None:
        if self._stream_xid is not None:
            self._streams[self._stream_xid].add(context, payload)
        elif self._preparing is not None:
            self._preparing[1].add(context, payload)
        elif self._in_plain is not None:
            self._deliver(context, message)
        else:
            raise _outside("change", message)

    def _deliver(self, context: Context, message: Message) -> None:
        if type(message) is Truncate:
            self._sink.truncate(context, message)  # type: ignore[arg-type]
        elif type(message) is LogicalMessage:
            self._sink.logical_message(message)
        else:
            self._sink.row(context, message)  # type: ignore[arg-type]

    def _logical_message(self, message: LogicalMessage, payload: bytes) -> None:
        if not message.transactional:
            self._sink.standalone_message(message)
        else:
            self._change(None, message, payload)

    def _begin(self, message: Begin) -> None:
        if (
            self._in_plain is not None
            or self._preparing is not None
            or self._stream_xid is not None
        ):
            raise _outside("Begin", message)
        self._in_plain = message
        self._sink.begin_transaction(message.xid, message.final_lsn, message.commit_ts)

    def _commit(self, message: Commit) -> None:
        begin = self._in_plain
        if begin is None:
            raise _outside("Commit", message)
        if message.commit_lsn != begin.final_lsn:
            raise DefiniteError(
                f"Commit LSN {message.commit_lsn} does not match Begin's {begin.final_lsn}",
                hint="protocol violation; report it with the PostgreSQL version",
            )
        self._in_plain = None
        self._sink.commit_transaction(message.end_lsn)

    def _replay(
        self, buffer: ChangeBuffer, xid: int, commit_lsn: Lsn, commit_ts: int, end_lsn: Lsn
    ) -> None:
        try:
            self._sink.begin_transaction(xid, commit_lsn, commit_ts)
            for context, message in buffer.replay():
                self._deliver(context, message)
            self._sink.commit_transaction(end_lsn)
        finally:
            buffer.close()

    # -- streaming (v2) -------------------------------------------------------------

    def _stream_start(self, message: StreamStart) -> None:
        if self._in_plain is not None or self._preparing is not None:
            raise _outside("Stream Start", message)
        self._stream_xid = message.xid
        if message.xid not in self._streams:
            self._streams[message.xid] = self._buffer(streamed=True)

    def _stream_stop(self, message: StreamStop) -> None:
        self._stream_xid = None

    def _stream_commit(self, message: StreamCommit) -> None:
        buffer = self._streams.pop(message.xid, None)
        if buffer is None:
            # A streamed transaction whose every change was in tables outside
            # the publication can commit without any stream block.
            buffer = self._buffer(streamed=True)
        self._replay(buffer, message.xid, message.commit_lsn, message.commit_ts, message.end_lsn)

    def _stream_abort(self, message: StreamAbort) -> None:
        buffer = self._streams.get(message.xid)
        if buffer is None:
            return  # nothing of it was streamed to us
        if message.subxid == message.xid:
            del self._streams[message.xid]
            buffer.close()
        else:
            buffer.aborted_subxids.add(message.subxid)

    # -- two-phase (v3) -------------------------------------------------------------

    def _begin_prepare(self, message: BeginPrepare) -> None:
        if (
            self._in_plain is not None
            or self._preparing is not None
            or self._stream_xid is not None
        ):
            raise _outside("Begin Prepare", message)
        self._preparing = (message, self._buffer(streamed=False))

    def _prepare(self, message: Prepare) -> None:
        if self._preparing is None:
            raise _outside("Prepare", message)
        begin, buffer = self._preparing
        self._preparing = None
        self._add_prepared(message.gid, buffer, message.xid, begin.prepare_lsn)

    def _stream_prepare(self, message: StreamPrepare) -> None:
        buffer = self._streams.pop(message.xid, None) or self._buffer(streamed=True)
        self._add_prepared(message.gid, buffer, message.xid, message.prepare_lsn)

    def _add_prepared(self, gid: str, buffer: ChangeBuffer, xid: int, prepare_lsn: Lsn) -> None:
        if gid in self._prepared:
            # Re-sent after a reconnect: the first copy is identical.
            buffer.close()
            return
        self._prepared[gid] = _Prepared(buffer, xid, prepare_lsn)
        self._sink.hold_prepared(gid, prepare_lsn)

    def _commit_prepared(self, message: CommitPrepared) -> None:
        prepared = self._prepared.pop(message.gid, None)
        if prepared is None:
            raise DefiniteError(
                f"COMMIT PREPARED '{message.gid}' arrived but its PREPARE was never received",
                hint="the slot was confirmed past the PREPARE by another consumer; "
                "recreate the slot and take a new snapshot",
            )
        try:
            self._replay(
                prepared.buffer, message.xid, message.commit_lsn, message.commit_ts, message.end_lsn
            )
        finally:
            self._sink.release_prepared(message.gid)

    def _rollback_prepared(self, message: RollbackPrepared) -> None:
        prepared = self._prepared.pop(message.gid, None)
        if prepared is not None:
            prepared.buffer.close()
            self._sink.release_prepared(message.gid)


def _outside(what: str, message: Message) -> DefiniteError:
    return DefiniteError(
        f"unexpected {what} ({type(message).__name__}) in the current transaction state",
        hint="protocol violation; report it with the PostgreSQL version",
    )

