"""The publisher: committed transactions in, Kafka messages out, tickets for the tracker.

It implements ``cdcd.pipeline.transactions.ChangeSink``. For each transaction it
opens a ticket with the ack tracker, produces every message with that
ticket's delivery callback and the ``cdcd.lsn``/``cdcd.seq`` headers, and
seals the ticket with the commit's end LSN, so the slot is confirmed only once
Kafka acknowledged the transaction and everything before it.

``cdcd.seq`` numbers every message of a transaction from 0 in production
order (a delete's tombstone has its own number), so the pair
(``cdcd.lsn``, ``cdcd.seq``) is unique and increases in commit order; a replay
after a crash repeats the same pairs.

Snapshots (``cdcd.snapshot``) publish through the same tickets:

* the initial snapshot's rows go out in tickets of their own
  (:meth:`Publisher.snapshot_messages`, encoded by the readers from COPY
  text), all stamped with the slot's consistent point, before streaming starts;
* an incremental snapshot's chunk is published inside the transaction of its
  high watermark (:meth:`Publisher.snapshot_copy_in_transaction`), stamped with
  that transaction's commit LSN, so replay order by (``cdcd.lsn``,
  ``cdcd.seq``) puts it after every change the chunk may not reflect and
  before every later one. Watermark messages (prefix ``cdcd.watermark``) go to
  the snapshot driver, never to the message topic. While a chunk window is
  open, :meth:`Publisher.watch` reports the keys changed in the table being
  snapshotted; it shadows ``row`` with a watching variant for that time only,
  so ordinary streaming pays nothing for the feature.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from cdcd.ack.tracker import AckTracker, Hold, TxnTicket
from cdcd.decode.relations import TableVersion
from cdcd.envelope.encoder import (
    OP_CREATE,
    OP_DELETE,
    OP_TRUNCATE,
    OP_UPDATE,
    EnvelopeEncoder,
    TableEncoder,
    TxnStamp,
    fill_unchanged,
    make_stamp,
)
from cdcd.envelope.records import (
    MESSAGE_KEY_SCHEMA,
    MESSAGE_VALUE_SCHEMA,
    TRANSACTION_KEY_SCHEMA,
    TRANSACTION_VALUE_SCHEMA,
    encode_record,
)
from cdcd.envelope.rowcode import NATIVE, Message, PackedReads
from cdcd.envelope.wire import WireFormat
from cdcd.errors import DefiniteError
from cdcd.naming import (
    HEARTBEAT_PREFIX,
    LSN_HEADER,
    SEQ_HEADER,
    WATERMARK_PREFIX,
    message_topic,
    transaction_topic,
)
from cdcd.observability.metrics import Metrics, TableMetrics
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    Delete,
    Insert,
    LogicalMessage,
    Truncate,
    TupleData,
    Update,
    pg_timestamp_to_unix_ms,
)
from cdcd.sink.producer import DIRECT_PRODUCE_ERRORS, DirectProduce
from cdcd.snapshot.publisher import KeyRecorder
from cdcd.snapshot.rows import encode_reads
from cdcd.source.markers import MarkerTransactions


def _seq_header(seq: int) -> tuple[str, bytes]:
    """The ``cdcd.seq`` header of the change with ordinal ``seq``."""
    return (SEQ_HEADER, b"%d" % seq)


def _in_transaction(exc: DefiniteError, stamp: TxnStamp) -> DefiniteError:
    """``exc`` naming the transaction, so that the operator can find the row."""
    return DefiniteError(
        f"{exc.args[0]} (transaction committed at LSN {stamp.lsn}, xid {stamp.xid})", hint=exc.hint
    )


#: ``cdcd.seq`` headers of the first message ordinals, built once.
_SEQ_CACHED = 4096
_SEQ_HEADERS = [_seq_header(n) for n in range(_SEQ_CACHED)]
Headers = list[tuple[str, bytes]]
#: Envelope ops counted per table, in the order of the count lists.
_OPS = ("c", "u", "d", "t")
_C, _U, _D, _T = range(4)


class Producer(Protocol):
    """What the publisher needs of a Kafka sink (``cdcd.sink.producer.KafkaSink``).

    A sink may also have ``produce_direct`` (``KafkaSink.produce_direct``):
    the library's own produce call, which inserts take when it is there.
    """

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        on_delivery: Callable[[Any, Any], None],
    ) -> None: ...


class SchemaTracker(Protocol):
    """What the publisher asks schema-change tracking (``cdcd.pipeline.schema_changes``)."""

    def stream_version(self, version: TableVersion, commit_lsn: Lsn) -> tuple[TableVersion, bool]:
        """The version to encode, and whether a truncate goes before its first change."""
        ...

    def snapshot_version(self, version: TableVersion) -> TableVersion: ...


#: How many of the latest transactions' xids the publisher remembers
#: (:meth:`Publisher.published_before`).
RECENT_XIDS = 16_384


class Publisher:
    """Encodes and produces committed transactions; see the module docstring."""

    def __init__(
        self,
        producer: Producer,
        tracker: AckTracker,
        encoder: EnvelopeEncoder,
        wire: WireFormat,
        *,
        include: Callable[[str, str], bool],
        ensure_topic: Callable[[str], None],
        metrics: Metrics | None = None,
        transaction_records: bool = False,
        schema_tracker: SchemaTracker | None = None,
    ) -> None:
        self._producer = producer
        self._schema_tracker = schema_tracker
        self._tracker = tracker
        self._encoder = encoder
        self._wire = wire
        self._include = include
        self._ensure_topic = ensure_topic
        self._metrics = metrics
        self._transaction_records = transaction_records
        self._prefix = encoder.topic_prefix
        self._message_topic = message_topic(self._prefix)
        self._transaction_topic = transaction_topic(self._prefix)
        self._ticket: TxnTicket | None = None
        self._stamp: TxnStamp | None = None
        self._seq = 0
        # Per transaction, for row(): attribute reads instead of a bound
        # method and a tuple built per row.
        self._on_delivery: Callable[[Any, Any], None] | None = None
        self._lsn_header: tuple[str, bytes] = (LSN_HEADER, b"")
        self._direct: DirectProduce | None = None
        #: Whether runs of Inserts go from pgoutput to Kafka in C
        #: (:meth:`insert_run`): the compiled encoder, and a sink that sends
        #: packed changes from C too.
        self.takes_insert_runs = NATIVE is not None and bool(getattr(producer, "produces_packed", False))
        self._holds: dict[str, Hold] = {}
        self._included: dict[tuple[int, int, bool], TableEncoder | None] = {}
        # The table of the previous row, its encoder and its counts:
        # consecutive rows are mostly of one table, and an identity check is
        # cheaper than a key. Its key is always in _dirty (see flush_metrics).
        self._last_table: TableVersion | None = None
        self._last_encoder: TableEncoder | None = None
        self._last_counts: list[int] = [0, 0, 0, 0]
        self._table_metrics: dict[str, TableMetrics] = {}
        # Changes published per table, by op (_OPS), since the start; metrics
        # receive the growth on flush_metrics(), not per row or transaction.
        self._counts: dict[tuple[str, str], list[int]] = {}
        self._reported: dict[tuple[str, str], list[int]] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._unreported_transactions = 0
        self._txn_base: dict[tuple[str, str], int] = {}
        self._topics_ready: set[str] = set()
        self._watermarks: Callable[[LogicalMessage], None] | None = None
        self._markers: MarkerTransactions | None = None
        self._watch_relid: int | None = None
        self._watch_record: KeyRecorder | None = None
        self.transactions = 0
        # xids of the latest transactions begun, oldest first, and how many
        # began in all: what an incremental snapshot's chunk checks its read
        # against (published_before).
        self._recent_xids: deque[int] = deque(maxlen=RECENT_XIDS)
        self.begun = 0

    # -- helpers ------------------------------------------------------------------

    def _table(self, table: TableVersion) -> TableEncoder | None:
        if table is self._last_table:
            return self._last_encoder
        key = table.cache_key
        if key in self._included:
            encoder = self._included[key]
            self._remember(table, encoder)
            return encoder
        encoder = None
        truncate_first = False
        if self._include(table.schema, table.table):
            topic = self._encoder.topic_for(table.schema, table.table)
            self._topic(topic)
            annotated = table
            tracker = self._schema_tracker
            if tracker is not None:
                if table.snapshot:
                    annotated = tracker.snapshot_version(table)
                else:
                    # In commit order, inside the transaction of the version's
                    # first change: its commit LSN places the change.
                    stamp = self._stamp
                    assert stamp is not None, "a stream version is first used inside a transaction"
                    annotated, truncate_first = tracker.stream_version(table, stamp.lsn)
            encoder = self._encoder.for_table(annotated)
            if self._metrics is not None:
                self._table_metrics[table.qualified_name] = self._metrics.table(table.qualified_name)
        self._included[key] = encoder
        self._remember(table, encoder)
        if truncate_first and encoder is not None:
            # The table was dropped and created again: what consumers hold of
            # the old one goes, before the new table's first change.
            stamp = self._stamp
            assert stamp is not None
            self._send(encoder.topic, None, encoder.envelope(OP_TRUNCATE, None, None, stamp, self._seq))
            self._counts_of(table)[_T] += 1
        return encoder

    def _remember(self, table: TableVersion, encoder: TableEncoder | None) -> None:
        self._last_table, self._last_encoder = table, encoder
        self._last_counts = self._counts_of(table)

    def _counts_of(self, table: TableVersion) -> list[int]:
        key = (table.schema, table.table)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0, 0, 0, 0]
            self._reported[key] = [0, 0, 0, 0]
        self._dirty.add(key)
        return counts

    def _topic(self, topic: str) -> None:
        """Once per topic, before its first message: create it, and its error series at 0."""
        if topic not in self._topics_ready:
            self._ensure_topic(topic)
            if self._metrics is not None:
                # The failures themselves are counted by the sink.
                self._metrics.delivery_errors_for(topic)
            self._topics_ready.add(topic)

    def _send(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        ticket = self._ticket
        stamp = self._stamp
        if ticket is None or stamp is None:
            raise DefiniteError("change outside a transaction", hint="this is a bug; report it")
        seq = self._seq
        headers = [
            (LSN_HEADER, stamp.lsn_header),
            _SEQ_HEADERS[seq] if seq < _SEQ_CACHED else _seq_header(seq),
        ]
        self._seq = seq + 1
        ticket.add()
        try:
            self._producer.produce(topic, key, value, headers, ticket.on_delivery)
        except DefiniteError as exc:
            raise _in_transaction(exc, stamp) from exc

    def _produce(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, stamp: TxnStamp
    ) -> None:
        on_delivery = self._on_delivery
        assert on_delivery is not None
        try:
            self._producer.produce(topic, key, value, headers, on_delivery)
        except DefiniteError as exc:
            raise _in_transaction(exc, stamp) from exc

    def flush_metrics(self) -> None:
        """Add the changes and transactions published since the last call to the metrics.

        The session calls it between batches: a Prometheus counter
        increment takes a lock, too dear for every row.
        """
        metrics = self._metrics
        if metrics is None:
            return
        if self._unreported_transactions:
            metrics.transactions.inc(self._unreported_transactions)
            self._unreported_transactions = 0
        dirty, self._dirty = self._dirty, set()
        last = self._last_table
        if last is not None:
            # row() counts the current table without marking it (the hot path
            # pays nothing), and _remember() marks only the table switched to:
            # the current one stays dirty, so what it counts from now on is
            # reported even after a later switch away from it.
            key = (last.schema, last.table)
            dirty.add(key)
            self._dirty.add(key)
        for key in dirty:
            counts, reported = self._counts[key], self._reported[key]
            if counts == reported:
                continue
            tm = self._table_metrics.get(f"{key[0]}.{key[1]}")
            for i, op in enumerate(_OPS):
                if counts[i] != reported[i]:
                    if tm is not None:
                        tm.events[op].inc(counts[i] - reported[i])
                    reported[i] = counts[i]

    # -- ChangeSink -----------------------------------------------------------------

    def begin_transaction(self, xid: int, commit_lsn: Lsn, commit_ts: int) -> None:
        self._recent_xids.append(xid)
        self.begun += 1
        commit_ms = pg_timestamp_to_unix_ms(commit_ts)
        ticket = self._ticket = self._tracker.open(commit_ts=commit_ms)
        stamp = self._stamp = make_stamp(xid, commit_lsn, commit_ms)
        self._seq = 0
        self._on_delivery = ticket.on_delivery
        self._lsn_header = (LSN_HEADER, stamp.lsn_header)
        self._direct = getattr(self._producer, "produce_direct", None)
        if self._transaction_records:
            # The END record counts this transaction's changes: growth from here.
            self._txn_base = {key: sum(counts) for key, counts in self._counts.items()}
            self._transaction_record("BEGIN", None)
        if self._markers is not None:
            marker = self._markers.take(xid, commit_lsn)
            if marker is not None:
                self._marker(marker)

    def _marker(self, message: LogicalMessage) -> None:
        """A transaction that stands for cdcd's own message (PostgreSQL 12, 13): see ``use_markers``."""
        if message.prefix == HEARTBEAT_PREFIX:
            if self._metrics is not None:
                self._metrics.heartbeats.inc()
        elif message.prefix == WATERMARK_PREFIX and self._watermarks is not None:
            self._watermarks(message)

    def row(self, table: TableVersion, message: Insert | Update | Delete) -> None:
        encoder = self._last_encoder if table is self._last_table else self._table(table)
        if encoder is None:
            return
        kind = type(message)
        if kind is Insert:
            # Nearly every row: _send inlined (a Python call less per row),
            # and the library's produce called directly when the sink has it.
            ticket, stamp, seq = self._ticket, self._stamp, self._seq
            if ticket is None or stamp is None:
                raise DefiniteError("change outside a transaction", hint="this is a bug; report it")
            key, value = encoder.encode_change(OP_CREATE, None, message.new, stamp, seq)  # type: ignore[union-attr]
            self._seq = seq + 1
            ticket.add()
            headers = [self._lsn_header, _SEQ_HEADERS[seq] if seq < _SEQ_CACHED else _seq_header(seq)]
            direct = self._direct
            if direct is not None:
                try:
                    direct(encoder.topic, value, key, -1, self._on_delivery, None, 0, headers)
                except DIRECT_PRODUCE_ERRORS:
                    # A full queue or a refused message: the sink's produce
                    # waits for space or raises the classified error.
                    self._produce(encoder.topic, key, value, headers, stamp)
            else:
                self._produce(encoder.topic, key, value, headers, stamp)
            self._last_counts[_C] += 1  # table is now self._last_table
            return
        counts = self._last_counts
        stamp = self._stamp
        assert stamp is not None
        topic = encoder.topic
        if kind is Update:
            old, new = message.old, message.new  # type: ignore[union-attr]
            if old is not None and encoder.key_schema is not None and encoder.key_changed(old, new):
                # The key changed (on values: a 'u' key column never did): a
                # delete (plus tombstone) under the old key and a create under
                # the new one, as Debezium publishes it. Both are encoded before
                # either is sent: a create that cannot be encoded must not
                # leave a delete of a live row in Kafka. The create takes the
                # unchanged TOAST values the old image carries (FULL).
                seq = self._seq
                old_key, deleted = encoder.encode_change(OP_DELETE, old, None, stamp, seq)
                key, created = encoder.encode_change(
                    OP_CREATE, None, fill_unchanged(new, old), stamp, seq + 2
                )
                self._send(topic, old_key, deleted)
                self._send(topic, old_key, None)
                self._send(topic, key, created)
                counts[_D] += 1
                counts[_C] += 1
            else:
                key, value = encoder.encode_change(OP_UPDATE, old, new, stamp, self._seq)
                self._send(topic, key, value)
                counts[_U] += 1
        else:
            old = message.old  # type: ignore[union-attr]
            assert old is not None
            key, value = encoder.encode_change(OP_DELETE, old, None, stamp, self._seq)
            self._send(topic, key, value)
            if key is not None:
                self._send(topic, key, None)
            counts[_D] += 1

    def insert_run(self, table: TableVersion, batch: list[bytes], start: int) -> tuple[int, int]:
        """Publish the Inserts of ``table`` that start ``batch[start:]``, as :meth:`row` would, in one call.

        ``batch`` is pgoutput messages of a plain transaction. The compiled
        encoder takes the Inserts straight from their bytes
        (``TableEncoder.insert_run``) and the compiled producer sends them
        from its buffers, with the same keys, envelopes, headers and
        ``cdcd.seq`` as :meth:`row` gives them one by one. Returns the index
        of the first message not taken and the bytes taken; ``(start, 0)``
        when the run is not for this path (the pure path, confluent-kafka's
        producer, a watched table, a table not captured), and it stops
        wherever a message needs the decoder or ``TableEncoder.change``
        (anything but an Insert of this table, a value the C code leaves to
        Python), so errors come from there, with their context.
        """
        if not self.takes_insert_runs or self._watch_relid is not None:
            return start, 0
        encoder = self._last_encoder if table is self._last_table else self._table(table)
        ticket, stamp = self._ticket, self._stamp
        if encoder is None or encoder.insert_run is None or ticket is None or stamp is None:
            return start, 0
        seq = self._seq
        blob, index, end, size = encoder.insert_run(batch, start, table.relation_id, OP_CREATE, stamp, seq)
        count = end - start
        if count:
            self._seq = seq + count
            # Counted up front, as row() does: should produce fail half-way,
            # the ticket stays incomplete and confirms nothing.
            ticket.add(count)
            changes = PackedReads(blob, index, seq, self._lsn_header, SEQ_HEADER)
            try:
                self._producer.produce_list(encoder.topic, changes, ticket.on_delivery)  # type: ignore[attr-defined]
            except DefiniteError as exc:
                raise _in_transaction(exc, stamp) from exc
            self._last_counts[_C] += count  # table is now self._last_table
        return end, size

    def truncate(self, tables: tuple[TableVersion, ...], message: Truncate) -> None:
        stamp = self._stamp
        assert stamp is not None
        for table in tables:
            if table.relation_id == self._watch_relid and self._watch_record is not None:
                self._watch_record(stamp.xid, None)
            encoder = self._table(table)
            if encoder is None:
                continue
            self._send(encoder.topic, None, encoder.envelope(OP_TRUNCATE, None, None, stamp, self._seq))
            self._counts_of(table)[_T] += 1

    def logical_message(self, message: LogicalMessage) -> None:
        if message.prefix == HEARTBEAT_PREFIX:
            return
        if message.prefix == WATERMARK_PREFIX:
            if self._watermarks is not None:
                self._watermarks(message)
            return
        stamp = self._stamp
        assert stamp is not None
        self._message(message, stamp.xid, stamp.lsn)

    def _message(self, message: LogicalMessage, xid: int | None, commit_lsn: Lsn | None) -> None:
        self._topic(self._message_topic)
        key = self._wire.header(self._message_topic, "key", MESSAGE_KEY_SCHEMA) + encode_record(
            MESSAGE_KEY_SCHEMA, {"prefix": message.prefix}
        )
        value = self._wire.header(self._message_topic, "value", MESSAGE_VALUE_SCHEMA) + encode_record(
            MESSAGE_VALUE_SCHEMA,
            {
                "prefix": message.prefix,
                "content": message.content,
                "transactional": message.transactional,
                "lsn": int(message.lsn),
                "txId": xid,
                "commit_lsn": int(commit_lsn) if commit_lsn is not None else None,
                "ts_ms": time.time_ns() // 1_000_000,
            },
        )
        self._send(self._message_topic, key, value)

    def _transaction_record(self, status: str, collections: dict[str, int] | None) -> None:
        stamp = self._stamp
        assert stamp is not None
        topic = self._transaction_topic
        self._topic(topic)
        key = self._wire.header(topic, "key", TRANSACTION_KEY_SCHEMA) + encode_record(
            TRANSACTION_KEY_SCHEMA, {"id": str(stamp.xid)}
        )
        value = self._wire.header(topic, "value", TRANSACTION_VALUE_SCHEMA) + encode_record(
            TRANSACTION_VALUE_SCHEMA,
            {
                "status": status,
                "id": str(stamp.xid),
                "lsn": int(stamp.lsn),
                "event_count": None if collections is None else sum(collections.values()),
                "data_collections": None
                if collections is None
                else [{"data_collection": k, "event_count": v} for k, v in sorted(collections.items())],
                "ts_ms": time.time_ns() // 1_000_000,
            },
        )
        self._send(topic, key, value)

    def commit_transaction(self, end_lsn: Lsn) -> None:
        ticket = self._ticket
        if ticket is None:
            raise DefiniteError("commit outside a transaction", hint="this is a bug; report it")
        if self._transaction_records:
            per_table: dict[str, int] = {}
            for (schema, table), counts in self._counts.items():
                count = sum(counts) - self._txn_base.get((schema, table), 0)
                if count:
                    per_table[f"{schema}.{table}"] = count
            self._transaction_record("END", per_table)
        ticket.seal(end_lsn)
        self._ticket = None
        self._stamp = None
        self._on_delivery = None
        self.transactions += 1
        self._unreported_transactions += 1

    def standalone_message(self, message: LogicalMessage) -> None:
        """A non-transactional message: its own one-message ticket, sealed at its LSN."""
        self._ticket = self._tracker.open(commit_ts=None)
        self._stamp = make_stamp(0, message.lsn, int(time.time() * 1000))
        self._seq = 0
        if message.prefix == HEARTBEAT_PREFIX:
            if self._metrics is not None:
                self._metrics.heartbeats.inc()
        elif message.prefix == WATERMARK_PREFIX:
            pass  # cdcd writes watermarks transactionally; a stray one carries nothing
        else:
            self._message(message, None, None)
        self._ticket.seal(message.lsn)
        self._ticket = None
        self._stamp = None

    def hold_prepared(self, gid: str, prepare_lsn: Lsn) -> None:
        self._holds[gid] = self._tracker.hold(prepare_lsn)

    def release_prepared(self, gid: str) -> None:
        hold = self._holds.pop(gid, None)
        if hold is not None:
            self._tracker.release(hold)

    def relation_changed(self, table: TableVersion) -> None:
        """A new table version: its topic now; its encoder at its first change.

        A Relation message may arrive outside a transaction (in a streamed
        chunk) or in one that is later aborted; schema-change tracking must
        see the version in commit order, which its first published change gives.
        """
        if self._include(table.schema, table.table):
            self._topic(self._encoder.topic_for(table.schema, table.table))

    # -- snapshots ------------------------------------------------------------------

    def on_watermark(self, handler: Callable[[LogicalMessage], None] | None) -> None:
        """Route transactional ``cdcd.watermark`` messages to ``handler`` (None: drop them)."""
        self._watermarks = handler

    def use_markers(self, markers: MarkerTransactions | None) -> None:
        """Recognise cdcd's heartbeats and watermarks by transaction id (``cdcd.source.markers``).

        For servers whose pgoutput sends no logical messages (12, 13): a
        registered transaction is handled at its Begin as its message would
        be, with nothing of it published (it holds no published change).
        """
        self._markers = markers

    def watch(self, relation_id: int, record: KeyRecorder) -> None:
        """Report ``(xid, key)`` of every change to ``relation_id`` until :meth:`unwatch`.

        The key is the Avro encoding of the key columns without the wire
        header (the same bytes the snapshot's rows give for that key); an
        update reports its new key and, when the key changed, its old one.
        """
        self._watch_relid = relation_id
        self._watch_record = record
        # Shadow the class's row() with the watching variant on this instance.
        self.__dict__["row"] = self._row_watched

    def unwatch(self) -> None:
        self.__dict__.pop("row", None)
        self._watch_relid = None
        self._watch_record = None

    def _row_watched(self, table: TableVersion, message: Insert | Update | Delete) -> None:
        record = self._watch_record
        if table.relation_id == self._watch_relid and record is not None:
            encoder = self._table(table)
            stamp = self._stamp
            if encoder is not None and encoder.key_schema is not None and stamp is not None:
                skip = len(encoder.key_header)
                images: list[TupleData] = []
                if isinstance(message, Insert):
                    images.append(message.new)
                elif isinstance(message, Update):
                    # A 'u' key column's value is the old image's.
                    images.append(fill_unchanged(message.new, message.old))
                    if message.old is not None:
                        images.append(message.old)
                else:
                    images.append(message.old)
                for image in images:
                    key = encoder.key(image, stamp)
                    if key is not None:
                        record(stamp.xid, key[skip:])
        Publisher.row(self, table, message)

    def snapshot_encoder(self, table: TableVersion) -> TableEncoder | None:
        """The encoder of a snapshot table version (creates its topic); None if not captured."""
        return self._table(table)

    def published_before(self, begun: int) -> list[int]:
        """xids of the transactions published before the ``begun``-th one (of :attr:`begun`).

        Only the latest :data:`RECENT_XIDS` are remembered: a transaction is
        asked about while PostgreSQL has yet to make it visible, moments
        after its commit was streamed.
        """
        since = self.begun - begun
        return list(itertools.islice(self._recent_xids, 0, max(0, len(self._recent_xids) - since)))

    def snapshot_messages(self, topic: str, messages: Sequence[Message], lsn: Lsn) -> TxnTicket:
        """Produce encoded initial-snapshot reads in a ticket of their own, sealed at ``lsn``.

        ``messages`` come from ``cdcd.snapshot.rows.encode_reads`` (key,
        envelope, headers); all that is left per row here is the produce call.
        """
        if self._ticket is not None:
            raise DefiniteError("snapshot rows inside a transaction", hint="this is a bug; report it")
        ticket = self._tracker.open(commit_ts=None)
        # Counted up front: should produce() fail half-way, the ticket stays incomplete.
        ticket.add(len(messages))
        self._produce_messages(topic, messages, ticket, lsn)
        ticket.seal(lsn)
        return ticket

    def _produce_messages(
        self, topic: str, messages: Sequence[Message], ticket: TxnTicket, lsn: Lsn
    ) -> None:
        """Produce encoded snapshot reads, counted in ``ticket`` already."""
        on_delivery = ticket.on_delivery
        produce_list = getattr(self._producer, "produce_list", None)
        try:
            if produce_list is not None:
                produce_list(topic, messages, on_delivery)
            else:
                produce = self._producer.produce
                for key, value, headers in messages:
                    produce(topic, key, value, headers, on_delivery)
        except DefiniteError as exc:
            raise DefiniteError(f"{exc.args[0]} (snapshot at LSN {lsn})", hint=exc.hint) from exc

    def snapshot_copy_in_transaction(
        self, encoder: TableEncoder, data: bytes, skip: set[bytes] | None
    ) -> tuple[TxnTicket, int]:
        """Publish a chunk of COPY text inside the current (high watermark) transaction.

        Rows whose key (without header) is in ``skip`` are left out: the
        stream changed them while the chunk was read.

        The rows are encoded with consecutive ``cdcd.seq`` from the
        transaction's next one; a row left out (its key in ``skip``) leaves
        its ordinal unused, which keeps (``cdcd.lsn``, ``cdcd.seq``) unique
        and increasing. Returns the ticket and how many rows were published.
        """
        ticket, stamp = self._ticket, self._stamp
        if ticket is None or stamp is None:
            raise DefiniteError("snapshot chunk outside a transaction", hint="this is a bug; report it")
        read_stamp = make_stamp(stamp.xid, stamp.lsn, stamp.commit_ts_ms, snapshot=True)
        messages = encode_reads(
            encoder, data, read_stamp, self._seq, (LSN_HEADER, stamp.lsn_header)
        )
        self._seq += len(messages)
        if skip:
            start = len(encoder.key_header)
            messages = [m for m in messages if m[0] is None or m[0][start:] not in skip]
        # Counted up front: should produce() fail half-way, the ticket stays incomplete.
        ticket.add(len(messages))
        self._produce_messages(encoder.topic, messages, ticket, stamp.lsn)
        return ticket, len(messages)

    def snapshot_truncate(self, encoder: TableEncoder) -> None:
        """A truncate envelope (op=t) for ``encoder``'s table inside the current transaction.

        A re-snapshot after a row filter change starts with it: consumers drop
        rows the new filter leaves out, then the snapshot brings those it takes in.
        """
        stamp = self._stamp
        if self._ticket is None or stamp is None:
            raise DefiniteError("snapshot truncate outside a transaction", hint="this is a bug; report it")
        self._send(encoder.topic, None, encoder.envelope(OP_TRUNCATE, None, None, stamp, self._seq))
