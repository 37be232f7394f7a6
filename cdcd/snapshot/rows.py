"""Reading table rows for snapshots: plans, keyset chunks, COPY text parsing.

Why COPY: rows are read with ``COPY (SELECT …) TO STDOUT`` in text format
and split on tabs and newlines in C (``bytes.split``). Every value then is
exactly the text PostgreSQL's type output function prints — the same bytes
pgoutput sends in text mode, under the same session settings (the source
connection sets DateStyle, IntervalStyle, TimeZone, extra_float_digits and
bytea_output, see ``cdcd.source.database``) — so the column codecs that
encode the change stream encode snapshot rows unchanged, and a row read here
produces the same Avro bytes as the same row sent by pgoutput. Measured on
the SPEC §9 ``orders`` shape: about 400k rows/s read and parsed, against
about 50k rows/s for a ``SELECT col::text, …`` through a cursor.

The initial snapshot does not parse rows in Python at all: a chunk's text
goes whole to the compiled encoder (:func:`encode_reads`), which splits,
converts and encodes it in C, 0.6 µs per ``orders`` row against 1.9 µs for
:func:`parse_copy` plus the encoder (``tests/bench/bench_envelope.py``).
Text rather than binary COPY because the text is what the stream's column
codecs already take, byte-identical by construction; the C parsers of the
common types make its conversion cheap.

COPY text quirks handled: a NULL is the field ``\\N``; backslash, newline,
carriage return, tab, backspace, form feed and vertical tab inside values are
escaped as ``\\\\ \\n \\r \\t \\b \\f \\v``, which are exactly Python's
escapes, so a field holding a backslash is unescaped with
``codecs.escape_decode`` (PostgreSQL doubles every literal backslash, so no
other escape can appear). Rows without any backslash (most of them) take the
fast path with no per-field work.

Keyset chunks: ``WHERE (k1, k2) > ($1::t1, $2::t2) ORDER BY k1, k2 LIMIT n``.
The row comparison uses the key's btree index (primary key or replica
identity index) and is stable under concurrent writes, unlike ``OFFSET``.
The last key of a chunk is kept as PostgreSQL text and sent back as a typed
literal (``'…'::type``), which round-trips for every key type under the
session settings above. Output columns are never cast, so ``ORDER BY`` binds
to the columns themselves, not to a text rendering of them.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg2.extensions

from cdcd.decode.relations import RelationCache, TableVersion
from cdcd.envelope.encoder import OP_READ, TableEncoder, TxnStamp
from cdcd.envelope.rowcode import Message, PackedReads
from cdcd.errors import DefiniteError
from cdcd.naming import SEQ_HEADER
from cdcd.protocol.messages import KIND_NULL, KIND_TEXT, Column, Relation, TupleData
from cdcd.snapshot.copyout import copy_text
from cdcd.source.catalog import relation_from_catalog
from cdcd.source.connection import quote_ident
from cdcd.source.database import SourceDatabase

__all__ = [
    "CopyChunk",
    "encode_reads",
    "encode_reads_python",
    "read_copy",
    "TablePlan",
    "estimate_rows",
    "parse_copy",
    "published_leaves",
    "published_units",
    "plan_table",
    "published_relation",
    "split_points",
    "block_split_points",
]

log = logging.getLogger("cdcd.snapshot")

#: A key as PostgreSQL text, one string per key column.
Key = tuple[str, ...]

_escape_decode: Callable[[bytes], tuple[bytes, int]] = codecs.escape_decode


@dataclass(frozen=True, slots=True)
class TablePlan:
    """How to read one table: its snapshot table version, columns and key."""

    version: TableVersion
    columns_sql: str  # quoted column list, in the relation's column order
    key_columns: tuple[str, ...]  # quoted, in key order; empty: no key
    key_types: tuple[str, ...]  # format_type() of each key column, for typed literals
    row_filter: str | None = None  # the publication's row filter (PostgreSQL 15+), SQL
    #: Every column of the table as the catalog had it when planned (name,
    #: type, typmod): a chunk read re-checks it, see :data:`COLUMNS_SQL`.
    catalog_columns: tuple[tuple[str, int, int], ...] = ()

    @property
    def relation_id(self) -> int:
        return self.version.relation_id

    @property
    def name(self) -> str:
        return self.version.qualified_name

    @property
    def keyed(self) -> bool:
        return bool(self.key_columns)

    @property
    def from_sql(self) -> str:
        return f"{quote_ident(self.version.schema)}.{quote_ident(self.version.table)}"

    def _tuple(self, cursor: Any, key: Key) -> str:
        literals = ", ".join(
            cursor.mogrify("%s", (value,)).decode("utf-8") + "::" + type_name
            for value, type_name in zip(key, self.key_types, strict=True)
        )
        return f"({literals})"

    def select_sql(
        self, cursor: Any, after: Key | None, upper: Key | None, limit: int | None
    ) -> str:
        """The SELECT of one chunk: keys in (after, upper], in key order, at most ``limit`` rows.

        A table without a key is read in physical order and its bounds are
        block ranges (:func:`block_split_points`): ``ctid`` in [after, upper),
        each a ``tid`` text; ``limit`` does not apply.
        """
        sql = f"SELECT {self.columns_sql} FROM {self.from_sql}"
        conditions = [self.row_filter] if self.row_filter else []
        if not self.keyed:
            if after is not None:
                conditions.append(f"ctid >= {cursor.mogrify('%s', (after[0],)).decode()}::tid")
            if upper is not None:
                conditions.append(f"ctid < {cursor.mogrify('%s', (upper[0],)).decode()}::tid")
            return sql + (" WHERE " + " AND ".join(conditions) if conditions else "")
        keys = ", ".join(self.key_columns)
        if after is not None:
            conditions.append(f"({keys}) > {self._tuple(cursor, after)}")
        if upper is not None:
            conditions.append(f"({keys}) <= {self._tuple(cursor, upper)}")
        if conditions:
            sql += " WHERE " + " AND ".join(conditions)
        sql += f" ORDER BY {keys}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return sql

    def key_of(self, row: TupleData) -> Key:
        """The text key of a row read by this plan."""
        values = row.values
        return tuple(
            bytes(values[i] or b"").decode("utf-8") for i in self.version.key_indexes
        )


#: The table's columns as :attr:`TablePlan.catalog_columns` records them.
COLUMNS_SQL = (
    "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s "
    "AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
)


def catalog_columns(rows: list[tuple[Any, ...]]) -> tuple[tuple[str, int, int], ...]:
    return tuple((str(name), int(type_oid), int(typmod)) for name, type_oid, typmod in rows)


#: A table's columns in attnum order, generated ones flagged.
_ALL_COLUMNS_SQL = (
    "SELECT attname, atttypid, atttypmod, attgenerated <> '' FROM pg_attribute "
    "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
)


def published_relation(
    db: SourceDatabase,
    schema: str,
    table: str,
    publication: str | None,
    columns: Sequence[str] | None = None,
) -> tuple[Relation, str | None]:
    """The Relation pgoutput sends for ``schema.table`` under ``publication``, and its row filter.

    On PostgreSQL 15+ the publication decides which columns are sent: its
    column list, else every column. On 18 ``pg_publication_tables.attnames``
    is exactly what the walsender sends, stored generated columns included
    where ``publish_generated_columns = stored`` (or the column list) names
    them; before 18 it lists generated columns too, which pgoutput never
    sends. ``columns`` stands in for the column list when the publication
    does not list the table (yet): the configured one, for ``cdcd schemas``
    before cdcd created its publication. A leaf partition published on its
    own has its own filter and list (PostgreSQL allows neither on a
    partitioned table unless published via the root).
    """
    relation = relation_from_catalog(db, schema, table)
    row_filter: str | None = None
    published: list[str] | None = None
    if publication is not None and db.server_version >= 150000:
        found = db.query(
            "SELECT attnames, rowfilter FROM pg_publication_tables "
            "WHERE pubname = %s AND schemaname = %s AND tablename = %s",
            (publication, schema, table),
        )
        if found:
            names, row_filter = found[0]
            published = [str(n) for n in names] if names is not None else None
        elif columns is not None:
            published = list(columns)
    elif columns is not None and db.server_version >= 150000:
        published = list(columns)
    if published is not None:
        keep = set(published)
        # Before 18, attnames lists generated columns that pgoutput never sends.
        generated_sent = db.server_version >= 180000
        key = {c.name for c in relation.columns if c.is_key}
        full = relation.replica_identity == "f"
        relation = replace(
            relation,
            columns=tuple(
                Column(1 if full or str(name) in key else 0, str(name), int(oid), int(typmod))
                for name, oid, typmod, generated in db.query(
                    _ALL_COLUMNS_SQL, (relation.relation_id,)
                )
                if str(name) in keep and (generated_sent or not generated)
            ),
        )
    return relation, str(row_filter) if row_filter else None


#: The leaf partitions of a partitioned table that a publication publishes as
#: themselves (publish_via_partition_root = false): pg_publication_tables then
#: lists the leaves, never the root.
_LEAVES_SQL = """
SELECT n.nspname, c.relname
FROM pg_class r JOIN pg_namespace rn ON rn.oid = r.relnamespace
CROSS JOIN LATERAL pg_partition_tree(r.oid) t
JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE rn.nspname = %(schema)s AND r.relname = %(table)s AND r.relkind = 'p' AND t.isleaf
  AND NOT EXISTS (SELECT 1 FROM pg_publication_tables p WHERE p.pubname = %(pub)s
                  AND p.schemaname = rn.nspname AND p.tablename = r.relname)
  AND EXISTS (SELECT 1 FROM pg_publication_tables p WHERE p.pubname = %(pub)s
              AND p.schemaname = n.nspname AND p.tablename = c.relname)
ORDER BY 1, 2
"""


def published_leaves(
    db: SourceDatabase, publication: str, schema: str, table: str
) -> list[tuple[str, str]]:
    """The leaves the publication publishes instead of partitioned ``schema.table``; [] otherwise.

    With ``publish_via_partition_root = false`` the walsender sends each
    leaf's changes as the leaf's own relation, so the leaves are what is
    captured (each its own topic) and what a snapshot reads, one by one.
    """
    rows = db.query(_LEAVES_SQL, {"schema": schema, "table": table, "pub": publication})
    return [(str(s), str(t)) for s, t in rows]


def published_units(
    db: SourceDatabase, publication: str, tables: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """``tables`` as the stream carries them: partitioned ones published per leaf become their leaves."""
    out: list[tuple[str, str]] = []
    for schema, table in tables:
        for unit in published_leaves(db, publication, schema, table) or [(schema, table)]:
            if unit not in out:
                out.append(unit)
    return out


def plan_table(
    db: SourceDatabase,
    relations: RelationCache,
    schema: str,
    table: str,
    publication: str | None = None,
) -> TablePlan:
    """Describe ``schema.table`` as pgoutput would, from the catalog seen by ``db``.

    ``relations`` is a cache private to snapshots: the stream's cache must
    only ever hold what the walsender sent, or a table altered since the
    stream's position would decode stream rows with the wrong columns. Its
    versions are negated so that they never collide with the stream's
    ``(relation_id, version)`` in the publisher's encoder cache.

    With ``publication`` on PostgreSQL 15+, the publication's column list
    (pgoutput sends only those columns) and row filter (pgoutput sends only
    matching rows) apply to the snapshot as well, so that snapshot rows have
    the stream's shape and scope.
    """
    relation, row_filter = published_relation(db, schema, table, publication)
    version, _ = relations.on_relation(relation)
    version = replace(version, version=-version.version)
    names = version.column_names
    if not names:
        raise DefiniteError(
            f"table {schema}.{table} has no columns to snapshot", hint="exclude it from postgres.tables"
        )
    key_names = [names[i] for i in version.key_indexes]
    types: dict[str, str] = {}
    if key_names:
        types = {
            str(name): str(type_name)
            for name, type_name in db.query(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s AND attname = ANY(%s) AND NOT attisdropped",
                (version.relation_id, key_names),
            )
        }
    return TablePlan(
        version=version,
        columns_sql=", ".join(quote_ident(n) for n in names),
        key_columns=tuple(quote_ident(n) for n in key_names),
        key_types=tuple(types[n] for n in key_names),
        row_filter=f"({row_filter})" if row_filter else None,
        catalog_columns=catalog_columns(db.query(COLUMNS_SQL, (version.relation_id,))),
    )


#: A never-analysed table up to this size is counted instead of estimated.
COUNT_BELOW_BYTES = 8 * 1024 * 1024


def estimate_rows(db: SourceDatabase, relation_id: int) -> int:
    """The planner's row estimate: ``pg_class.reltuples``, or EXPLAIN's when never analyzed.

    ``reltuples`` is -1 (PostgreSQL 14+) or 0 for a table that was never
    vacuumed or analyzed; the planner then estimates from the file size,
    which EXPLAIN reports.
    """
    reltuples = db.scalar("SELECT reltuples FROM pg_class WHERE oid = %s", (relation_id,))
    if reltuples is not None and float(reltuples) > 0:
        return int(float(reltuples))
    # The name as the caller's snapshot has it (regclass output reads the
    # current catalog, where a table dropped since has only a number).
    name = db.scalar(
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
        (relation_id,),
    )
    if not name:
        return 0
    small = db.scalar(
        "SELECT relkind = 'r' AND pg_relation_size(oid) <= %s FROM pg_class WHERE oid = %s",
        (COUNT_BELOW_BYTES, relation_id),
    )
    if small:
        # The file-size guess of a small never-analysed table is far off (thousands
        # of rows for six); counting it is exact and costs a few pages.
        counted = _probe(db, f"SELECT count(*) FROM {name}")
        return int(counted[0][0] or 0) if counted else 0
    found = _probe(db, f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {name}")
    plan: Any = found[0][0] if found else None
    if isinstance(plan, str):
        plan = json.loads(plan)
    try:
        return int(plan[0]["Plan"]["Plan Rows"])
    except (TypeError, KeyError, IndexError):
        return 0


def split_points(db: SourceDatabase, plan: TablePlan, parts: int, estimated: int) -> list[Key]:
    """Up to ``parts - 1`` keys that cut the table into ranges of similar size.

    From a block sample (``TABLESAMPLE SYSTEM``: a few pages, cheap on any
    table size) sorted by key. The boundaries need not be exact: ranges
    (-inf, b1], (b1, b2] … (bn, +inf) cover every key whatever they are.
    """
    if parts < 2 or not plan.keyed or estimated <= 0:
        return []
    wanted = 200 * parts
    percent = min(100.0, 100.0 * wanted / estimated)
    aliases = ", ".join(f"{k}::text AS _k{i}" for i, k in enumerate(plan.key_columns))
    rows = _probe(
        db,
        f"SELECT {aliases} FROM {plan.from_sql} TABLESAMPLE SYSTEM (%s) "
        f"ORDER BY {', '.join(plan.key_columns)}",
        (percent,),
    )
    if rows is None or len(rows) < parts * 4:
        return []
    points: list[Key] = []
    for i in range(1, parts):
        key = tuple(str(v) for v in rows[i * len(rows) // parts])
        if not points or key != points[-1]:
            points.append(key)
    return points


#: PostgreSQL 14 brought TID range scans: before it, a ``ctid`` range reads the whole table.
_TID_RANGE_SCAN_VERSION = 140000

#: A plain table's size in blocks now; a partitioned root has none of its own.
_BLOCKS_SQL = (
    "SELECT c.relkind::text, pg_relation_size(c.oid) / current_setting('block_size')::bigint "
    "FROM pg_class c WHERE c.oid = %s"
)


def block_split_points(db: SourceDatabase, plan: TablePlan, parts: int) -> list[Key]:
    """Up to ``parts - 1`` block numbers that cut a table without a key into ranges.

    Each is a ``tid`` text ``(block,0)``; ranges [start, b1), [b1, b2) …
    [bn, end) read by ``ctid`` cover every row version the snapshot sees
    exactly once, wherever an update put it since: visibility, not position,
    decides what a reader returns, and the last range is open so blocks
    added after the size was read are covered too. Only a plain table on
    PostgreSQL 14 or later is cut (a TID range scan reads just its blocks;
    before 14 every reader would scan the whole table).
    """
    if parts < 2 or plan.keyed or db.server_version < _TID_RANGE_SCAN_VERSION:
        return []
    rows = _probe(db, _BLOCKS_SQL, (plan.relation_id,))
    if not rows or rows[0][0] != "r":
        return []
    blocks = int(rows[0][1] or 0)
    if blocks < 2 * parts:
        return []
    return [(f"({i * blocks // parts},0)",) for i in range(1, parts)]


def _probe(db: SourceDatabase, sql: str, params: Any = None) -> list[tuple[Any, ...]] | None:
    """A planning statement's rows; None if it failed (the table changed since the snapshot).

    Inside a transaction (the initial snapshot's) it runs under a savepoint
    that is rolled back after it either way: a failure leaves the snapshot
    usable, and the table lock it took is released (the readers lock the
    table themselves, and check it then: ``cdcd.snapshot.initial``).
    """
    in_transaction = db.conn.info.transaction_status != psycopg2.extensions.TRANSACTION_STATUS_IDLE
    if in_transaction:
        db.query("SAVEPOINT cdcd_plan")
    try:
        return db.query(sql, params)
    except DefiniteError as exc:
        log.info("planning a snapshot read went without an estimate: %s", exc)
        return None
    finally:
        if in_transaction:
            db.query("ROLLBACK TO SAVEPOINT cdcd_plan")


def parse_copy(data: bytes, columns: int, table: str) -> list[TupleData]:
    """Rows of ``COPY … TO STDOUT`` text output as TupleData (text values, NULLs)."""
    if not data:
        return []
    _whole_lines(data, table)
    lines = data.split(b"\n")
    lines.pop()
    all_text = bytes((KIND_TEXT,)) * columns
    out: list[TupleData] = []
    append = out.append
    for line in lines:
        fields = line.split(b"\t")
        if len(fields) != columns:
            raise DefiniteError(
                f"{table}: COPY row has {len(fields)} fields, expected {columns}",
                hint="the table changed during the snapshot; restart cdcd to re-plan it",
            )
        if b"\\" in line:
            append(_unescape(fields, all_text))
        else:
            append(TupleData(all_text, tuple(fields)))
    return out


def _whole_lines(data: bytes, table: str) -> None:
    if data and data[-1] != 10:  # b"\n"
        raise DefiniteError(f"{table}: COPY output ended in the middle of a row", hint="report it")


def encode_reads(
    encoder: TableEncoder, data: bytes, stamp: TxnStamp, seq: int, lsn_header: tuple[str, bytes]
) -> Sequence[Message]:
    """Every row of ``data`` (COPY text output) as a snapshot read (``op=r``), ready to produce.

    Message ``i`` is the row's key, its envelope and the headers ``lsn_header``
    and ``cdcd.seq`` = ``seq + i``. The compiled encoder reads the COPY text
    itself, one call per chunk, with no Python object per field or per row
    (:class:`~cdcd.envelope.rowcode.PackedReads`, which the compiled producer
    sends as it is); a row it does not take on (escaped values, a value its
    parsers leave to a Python converter that refuses it, a null where none
    may be) goes to the reference below, row by row, so the bytes and errors
    are the same.
    """
    native = encoder.copy_reads
    if native is None:
        return encode_reads_python(encoder, data, stamp, seq, lsn_header)
    table = encoder.table.qualified_name
    _whole_lines(data, table)
    columns = len(encoder.table.columns)
    change = encoder.change

    def slow(line: bytes, seq: int) -> tuple[bytes | None, bytes]:
        (row,) = parse_copy(line + b"\n", columns, table)
        return change(OP_READ, None, row, stamp, seq)

    blob, index = native(data, OP_READ, stamp, seq, slow)
    return PackedReads(blob, index, seq, lsn_header, SEQ_HEADER)


def encode_reads_python(
    encoder: TableEncoder, data: bytes, stamp: TxnStamp, seq: int, lsn_header: tuple[str, bytes]
) -> list[Message]:
    """The pure-Python reference of :func:`encode_reads`: parse, then ``TableEncoder.change``."""
    rows = parse_copy(data, len(encoder.table.columns), encoder.table.qualified_name)
    change = encoder.change
    out: list[Message] = []
    for i, row in enumerate(rows, seq):
        key, value = change(OP_READ, None, row, stamp, i)
        out.append((key, value, [lsn_header, (SEQ_HEADER, b"%d" % i)]))
    return out


def _unescape(fields: list[bytes], all_text: bytes) -> TupleData:
    kinds = bytearray(all_text)
    values: list[bytes | None] = []
    for i, field in enumerate(fields):
        if field == b"\\N":
            kinds[i] = KIND_NULL
            values.append(None)
        elif b"\\" in field:
            values.append(_escape_decode(field)[0])
        else:
            values.append(field)
    return TupleData(bytes(kinds), tuple(values))


@dataclass(frozen=True, slots=True)
class CopyChunk:
    """One chunk as COPY text: whole lines, how many, and the key of the last (None: no rows)."""

    data: bytes
    rows: int
    last_key: Key | None


#: ``batch_rows`` for one batch whatever the row count.
ALL_ROWS = 1 << 62


def read_copy(
    cursor: Any,
    plan: TablePlan,
    after: Key | None,
    upper: Key | None,
    limit: int | None,
) -> CopyChunk:
    """One keyset chunk (or, without a key, the whole table) as COPY text, unparsed.

    Only the last row is parsed here (its key is the next chunk's lower
    bound); the rows themselves go to :func:`encode_reads` as they are.
    """
    parts: list[bytes] = []
    rows = copy_text(
        cursor, plan.select_sql(cursor, after, upper, limit), ALL_ROWS, lambda data, _: parts.append(data)
    )
    data = b"".join(parts)  # one part, in fact: join returns it as it is
    _whole_lines(data, plan.name)
    last: Key | None = None
    if rows and plan.keyed:
        tail = data[data.rfind(b"\n", 0, len(data) - 1) + 1 :]
        last = plan.key_of(parse_copy(tail, len(plan.version.columns), plan.name)[0])
    return CopyChunk(data, rows, last)


def key_text(key: Sequence[str] | None) -> str:
    """A key for log lines: ``(42)`` or ``(a, 7)``; ``start`` before the first chunk."""
    if key is None:
        return "start"
    return "(" + ", ".join(key) + ")"
