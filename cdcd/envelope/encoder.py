"""Change envelopes written as Avro bytes straight from pgoutput's bytes.

For each table version an ``TableEncoder`` is prepared once: per column the
codec's text converter and the union branch byte, the constant part of
the ``source`` record (version, connector, name, db, schema, table), and the
wire-format headers of its key and value schemas. Per transaction a
``TxnStamp`` holds the bytes shared by all of its changes (txId, commit LSN,
commit time, processing time). Per change only the row columns are converted.

Envelope rules (SPEC §4, §5):

* insert ``c``: before null, after = new row.
* update ``u``: before = the old image PostgreSQL sent (key columns with the
  default identity when the key changed, the whole row with FULL), else null.
  When the key changed, the update is published as a delete of the old key
  (plus tombstone) and a create under the new key, as Debezium does, so that
  per-key consumers and log compaction stay correct.
* delete ``d``: before = old image, after null; then a tombstone (same key,
  null value) when the table has a key.
* truncate ``t``: before and after null, null key.
* unchanged TOAST (``u`` in TupleData): null in ``after`` and named in
  ``unchanged_toast`` — unless the old image carries the value (REPLICA
  IDENTITY FULL, or the old key PostgreSQL logs whenever a key column is
  stored out of line), which is then used and not listed.

Identity is decided on values, never on TupleData kinds: a key column marked
``u`` is by definition unchanged, and takes its value from the old image
(:func:`fill_unchanged`); the Kafka key is made from that value. A ``u`` key
column with no old value to take cannot give a key: that is an
``EncodeError`` naming that column, never a guessed key.

A value that cannot be converted is an ``EncodeError`` naming table, column
and LSN; nothing is skipped. So is a binary (``b``) value: cdcd never asks
pgoutput for them, so one is a protocol violation, not data to convert.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from cdcd import __version__
from cdcd.avro.binary import (
    EMPTY_ARRAY,
    FALSE,
    NULL_BRANCH,
    TRUE,
    VALUE_BRANCH,
    VARINT_LAST,
    encode_long,
    encode_string,
)
from cdcd.decode.relations import TableVersion
from cdcd.envelope.rowcode import (
    NATIVE,
    BinaryValueRefused,
    ChangeEncoder,
    CopyReads,
    InsertRun,
    compile_change_encoder,
    compile_key_encoder,
    compile_row_encoder,
    native_copy_reads,
    native_insert_run,
)
from cdcd.envelope.schemas import envelope_schema, key_schema, value_first
from cdcd.envelope.wire import WireFormat
from cdcd.errors import EncodeError
from cdcd.naming import table_topic
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    TupleData,
)

OP_CREATE = encode_string("c")
OP_UPDATE = encode_string("u")
OP_DELETE = encode_string("d")
OP_READ = encode_string("r")
OP_TRUNCATE = encode_string("t")

#: A 'b' value breaks the protocol as cdcd requests it: nothing in the data to fix.
_BINARY_HINT = "this is a bug or an unsupported server version; report it with the server version"


class TxnStamp(NamedTuple):
    """The per-transaction bytes shared by every change of one transaction.

    A NamedTuple rather than a frozen dataclass: one is built per transaction,
    and tuple construction is several times cheaper.
    """

    xid: int
    lsn: Lsn  # commit LSN
    commit_ts_ms: int
    snapshot: bool
    lsn_header: bytes  # ``cdcd.lsn`` header value, X/XXXXXXXX
    ts_ms: bytes  # processing time
    txid_lsn: bytes  # source.txId + source.lsn
    tail: bytes  # source.ts_ms + source.snapshot


# The last millisecond values encoded: consecutive transactions mostly share
# their processing and commit milliseconds.
_last_now: tuple[int, bytes] = (-1, b"")
_last_commit: tuple[int, bytes] = (-1, b"")


def make_stamp_python(
    xid: int, lsn: Lsn, commit_ts_ms: int, snapshot: bool = False, now_ms: int | None = None
) -> TxnStamp:
    """The stamp of a transaction; ``now_ms`` (processing time) defaults to the clock."""
    global _last_now, _last_commit
    if now_ms is None:
        now_ms = time.time_ns() // 1_000_000
    if now_ms != _last_now[0]:
        _last_now = (now_ms, encode_long(now_ms))
    if commit_ts_ms != _last_commit[0]:
        _last_commit = (commit_ts_ms, encode_long(commit_ts_ms))
    value = int(lsn)
    return TxnStamp(
        xid,
        lsn,
        commit_ts_ms,
        snapshot,
        b"%X/%08X" % (value >> 32, value & 0xFFFFFFFF),  # str(Lsn), as bytes
        _last_now[1],
        encode_long(xid) + encode_long(value),
        _last_commit[1] + (TRUE if snapshot else FALSE),
    )


#: ``make_stamp(xid, lsn, commit_ts_ms, snapshot=False, now_ms=None)``: the compiled
#: twin of :func:`make_stamp_python` (one per transaction) where it is built.
make_stamp: Callable[..., TxnStamp] = make_stamp_python
if NATIVE is not None:
    NATIVE.configure_stamp(TxnStamp, make_stamp_python)
    make_stamp = NATIVE.make_stamp


class TableEncoder:
    """Prepared encoder for one table version (see ``cdcd.envelope.rowcode``)."""

    __slots__ = (
        "_branches",
        "_encode_key",
        "_encode_row",
        "_key_indexes",
        "_names",
        "_separate_key",
        "_source_prefix",
        "_text",
        "copy_reads",
        "encode_change",
        "insert_run",
        "key_header",
        "key_schema",
        "table",
        "topic",
        "value_header",
        "value_schema",
    )

    def __init__(
        self, table: TableVersion, topic: str, server_name: str, database: str, wire: WireFormat
    ) -> None:
        self.table = table
        self.topic = topic
        self.key_schema = key_schema(topic, table)
        self.value_schema = envelope_schema(topic, table)
        self.key_header = (
            wire.header(topic, "key", self.key_schema) if self.key_schema is not None else b""
        )
        self.value_header = wire.header(topic, "value", self.value_schema)
        self._key_indexes = table.key_indexes
        self._names = table.column_names
        self._text: tuple[Callable[[bytes], bytes], ...] = tuple(c.from_text for c in table.codecs)
        first = tuple(value_first(table, i) for i in range(len(table.columns)))
        self._branches = tuple(
            b"" if not table.nullable(i) else NULL_BRANCH if first[i] else VALUE_BRANCH
            for i in range(len(table.columns))
        )
        # The key is joined from the row's key-column bytes only when those
        # are plain values; a key column kept nullable in the row record
        # carries a union branch there, so its key is encoded on its own.
        self._separate_key = any(table.nullable(i) for i in table.key_indexes)
        null_branches = tuple(VALUE_BRANCH if f else NULL_BRANCH for f in first)
        self._encode_key = (
            compile_key_encoder(self.key_header, self._key_indexes, self._names, self._text)
            if self._key_indexes
            else None
        )
        self._encode_row = compile_row_encoder(
            self._names,
            self._text,
            self._branches,
            self.key_header,
            self._key_indexes if self._encode_key is not None and not self._separate_key else (),
            null_branches,
        )
        self._source_prefix = b"".join(
            encode_string(s)
            for s in (__version__, "cdcd", server_name, database, table.schema, table.table)
        )
        # The hot path's entry: the compiled twin of change() where the C
        # extension is built (it calls change() for whatever it leaves to Python).
        self.encode_change: ChangeEncoder = (
            compile_change_encoder(
                self._text,
                self._branches,
                null_branches,
                self._key_indexes,
                self.key_header,
                self.value_header,
                self._source_prefix,
                self.change,
            )
            or self.change
        )
        #: COPY text straight to snapshot reads, compiled (None on the pure path,
        #: where ``cdcd.snapshot.rows.encode_reads`` parses and calls change()).
        self.copy_reads: CopyReads | None = native_copy_reads(self.encode_change)
        #: A plain transaction's Inserts of this table straight from pgoutput
        #: to packed changes, compiled (None on the pure path).
        self.insert_run: InsertRun | None = native_insert_run(self.encode_change)

    # -- rows -----------------------------------------------------------------

    def _row(
        self, data: TupleData, fill: TupleData | None, stamp: TxnStamp
    ) -> tuple[bytes, list[str] | None, bytes | None]:
        """The row record's bytes, the names of unchanged TOAST columns (or None), the key."""
        if len(data.kinds) != len(self._names):
            raise EncodeError(
                f"{self.table.qualified_name}: row has {len(data.kinds)} columns, relation has "
                f"{len(self._names)} (LSN {stamp.lsn})",
                hint="this is a bug; report it",
            )
        try:
            if self._separate_key:
                row, toast, _ = self._encode_row(data, fill)
                return row, toast, self.key(data, stamp)
            return self._encode_row(data, fill)
        except (ValueError, OverflowError, TypeError) as exc:
            failed = _failed_column(self, data, fill)
            raise EncodeError(
                f"{self.table.qualified_name}.{self._names[failed]}: cannot encode value at "
                f"LSN {stamp.lsn}: {exc}",
                hint=_BINARY_HINT if isinstance(exc, BinaryValueRefused) else _hint(data, failed),
            ) from exc

    def key(self, data: TupleData, stamp: TxnStamp) -> bytes | None:
        """The Kafka key from a row image, or None for tables without a key.

        An unchanged-TOAST key column must have been filled from the old
        image first (:func:`fill_unchanged`): its value is not in ``data``.
        """
        if self._encode_key is None:
            return None
        try:
            return self._encode_key(data)
        except (ValueError, OverflowError, TypeError, IndexError) as exc:
            failed = _failed_key_column(self, data)
            where = (
                self.table.qualified_name
                if failed is None
                else f"{self.table.qualified_name}.{self._names[failed]}"
            )
            raise EncodeError(
                f"{where}: cannot encode key at LSN {stamp.lsn}: {exc}",
                hint=_BINARY_HINT if isinstance(exc, BinaryValueRefused) else _hint(data, failed),
            ) from exc

    def key_changed(self, old: TupleData, new: TupleData) -> bool:
        """Whether an update moved the row to another key, decided on values.

        A key column the new image marks unchanged (``u``) did not change,
        whatever the old image says of it. A column whose old value is not
        known (not ``t`` in the old image) while the new one is counts as
        changed: the delete of the old key then fails to encode, naming the
        column, rather than publish anything wrong.
        """
        for i in self._key_indexes:
            kind = new.kinds[i]
            if kind == KIND_UNCHANGED_TOAST:
                continue
            if old.kinds[i] != kind or old.values[i] != new.values[i]:
                return True
        return False

    # -- envelopes ------------------------------------------------------------

    def envelope(
        self,
        op: bytes,
        before: TupleData | None,
        after: TupleData | None,
        stamp: TxnStamp,
        seq: int,
    ) -> bytes:
        """The value bytes of one change (wire header included)."""
        return self.change(op, before, after, stamp, seq)[1]

    def change(
        self,
        op: bytes,
        before: TupleData | None,
        after: TupleData | None,
        stamp: TxnStamp,
        seq: int,
    ) -> tuple[bytes | None, bytes]:
        """The Kafka key and value of one change (wire headers included).

        The key is made from ``after``'s key columns, or ``before``'s when
        there is no ``after`` (a delete); it equals :meth:`key` of that
        image. None for a table without a key.
        """
        toast: list[str] | None = None
        key: bytes | None = None
        if before is not None and after is not None:
            # Unchanged TOAST values the old image carries (the key above
            # all): the compiled encoder leaves every 'u' to this method.
            after = fill_unchanged(after, before)
        if before is None:
            before_branch, before_row = NULL_BRANCH, b""
        else:
            before_branch = VALUE_BRANCH
            before_row, _, key = self._row(before, None, stamp)
        if after is None:
            after_branch, after_row = NULL_BRANCH, b""
        else:
            after_branch = VALUE_BRANCH
            after_row, toast, key = self._row(after, before, stamp)
        if toast:
            toast_part = (
                encode_long(len(toast)) + b"".join(encode_string(name) for name in toast) + b"\x00"
            )
        else:
            toast_part = EMPTY_ARRAY
        return key, b"".join(
            (
                self.value_header,
                before_branch,
                before_row,
                after_branch,
                after_row,
                op,
                stamp.ts_ms,
                self._source_prefix,
                stamp.txid_lsn,
                VARINT_LAST[seq << 1] if seq < 8192 else encode_long(seq),
                stamp.tail,
                toast_part,
            )
        )


def fill_unchanged(new: TupleData, old: TupleData | None) -> TupleData:
    """``new`` with each unchanged-TOAST (``u``) column taken from ``old`` where it has the value.

    ``u`` means PostgreSQL did not rewrite the value, so the old image's value
    (REPLICA IDENTITY FULL, or the old key it logs when a key column is
    stored out of line) is the new one. Only text values are taken: ``n`` in
    an old key image means "not sent", not null.
    """
    if old is None or KIND_UNCHANGED_TOAST not in new.kinds or len(old.kinds) != len(new.kinds):
        return new
    kinds = bytearray(new.kinds)
    values = list(new.values)
    filled = False
    for i, kind in enumerate(new.kinds):
        if kind == KIND_UNCHANGED_TOAST and old.kinds[i] == KIND_TEXT:
            kinds[i] = KIND_TEXT
            values[i] = old.values[i]
            filled = True
    return TupleData(bytes(kinds), tuple(values)) if filled else new


#: The way past a change no restart can publish (docs/operations.md, "A change cdcd cannot publish").
_WAY_PAST = (
    "to go past it: stop cdcd, drop the slot (pg_drop_replication_slot) and run 'cdcd resync', "
    "which starts a new slot and re-snapshots the tables"
)
#: What to do about an unchanged-TOAST key value PostgreSQL sent without the old key.
_TOAST_KEY_HINT = (
    "PostgreSQL sent an unchanged out-of-line key value without the old key (older minor "
    "releases do): upgrade PostgreSQL or set REPLICA IDENTITY FULL on the table; "
    f"{_WAY_PAST}"
)
_NULL_KEY_HINT = f"a key column is null: check the table's replica identity; {_WAY_PAST}"
_VALUE_HINT = (
    "fix or remove the value, or exclude the table; cdcd stops rather than skip it; "
    f"{_WAY_PAST}"
)


def _hint(data: TupleData, failed: int | None) -> str:
    kind = data.kinds[failed] if failed is not None else None
    if kind == KIND_UNCHANGED_TOAST:
        return _TOAST_KEY_HINT
    return _NULL_KEY_HINT if kind == KIND_NULL else _VALUE_HINT


def _refused(encoder: TableEncoder, i: int, kind: int, value: bytes | None, plain: bool) -> bool:
    """Whether column ``i`` of kind/value cannot be encoded (``plain``: no null branch)."""
    try:
        if kind == KIND_TEXT:
            encoder._text[i](value)  # type: ignore[arg-type]
            return False
    except (ValueError, OverflowError, TypeError):
        return True
    if kind == KIND_NULL:
        return plain
    # 'u' that nothing filled: a nullable column is named in unchanged_toast,
    # a plain (key) column has no value to give. 'b' and unknown kinds: refused.
    return kind != KIND_UNCHANGED_TOAST or plain


#: Old-image kinds the row encoder takes for a 'u' (rowcode's ``rare``): a value, or a refusal.
_FILLS = (KIND_TEXT, KIND_BINARY)


def _failed_column(encoder: TableEncoder, data: TupleData, fill: TupleData | None) -> int:
    """Find which column fails to convert (slow path, only after an error)."""
    for i, kind in enumerate(data.kinds):
        value = data.values[i]
        if kind == KIND_UNCHANGED_TOAST and fill is not None and fill.kinds[i] in _FILLS:
            kind, value = fill.kinds[i], fill.values[i]
        if _refused(encoder, i, kind, value, not encoder._branches[i]):
            return i
    return 0


def _failed_key_column(encoder: TableEncoder, data: TupleData) -> int | None:
    """The key column that fails to encode in a key (slow path), None if none does."""
    for i in encoder._key_indexes:
        if _refused(encoder, i, data.kinds[i], data.values[i], True):
            return i
    return None


class EnvelopeEncoder:
    """Table encoders by relation version; builds each once, on first use."""

    def __init__(
        self,
        topic_prefix: str,
        database: str,
        wire: WireFormat,
        topics: Mapping[tuple[str, str], str] | None = None,
    ) -> None:
        self.topic_prefix = topic_prefix
        self.database = database
        self.wire = wire
        self._topics = dict(topics or {})  # (schema, table) -> a configured topic
        self._encoders: dict[tuple[int, int, bool], TableEncoder] = {}

    def topic_for(self, schema: str, table: str) -> str:
        return self._topics.get((schema, table)) or table_topic(self.topic_prefix, schema, table)

    def for_table(self, table: TableVersion) -> TableEncoder:
        key = table.cache_key
        encoder = self._encoders.get(key)
        if encoder is None:
            encoder = TableEncoder(
                table,
                self.topic_for(table.schema, table.table),
                self.topic_prefix,
                self.database,
                self.wire,
            )
            # Older versions of the same relation (from the same cache) are never used again.
            for old in [k for k in self._encoders if k[0] == key[0] and k[2] == key[2]]:
                del self._encoders[old]
            self._encoders[key] = encoder
        return encoder
