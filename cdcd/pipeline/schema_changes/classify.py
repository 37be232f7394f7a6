"""Classification: what changed between a table's recorded state and a version met in the stream.

PostgreSQL decodes DDL as nothing but a new ``Relation`` message before the
next change of the table, and several migrations change *existing* rows
without a single row change in the WAL:

* ``ADD COLUMN c T DEFAULT <constant>`` stores the value once, in the catalog
  (``pg_attribute.atthasmissing`` / ``attmissingval``): every older row reads
  it, no row is rewritten;
* a volatile default (``DEFAULT random()``), ``ALTER COLUMN … TYPE … USING``
  and any type change that is not binary-coercible rewrite the whole table
  into a new file (a new ``pg_class.relfilenode``), and logical decoding skips
  the rewrite's rows on purpose;
* ``RENAME COLUMN`` changes a name, nothing else;
* ``DROP TABLE`` + ``CREATE TABLE`` gives a new relation OID under the old name.

So a new version of a table, met in commit order, is compared with the
table's recorded state (the shape cdcd last published, with each column's
``attnum``, the table's OID and its storage files) and with the catalog now
(:func:`classify`, pure: no I/O here):

========================  =====================================================
what changed               what cdcd does
========================  =====================================================
column with a fast default the field gets that Avro default (carried)
column, no default         nothing (a nullable field defaults to null)
column by a rewrite        re-snapshot the table (heal)
type, binary-coercible     nothing (same values)
type, rewritten            re-snapshot the table (heal)
column dropped             nothing (the field goes)
column renamed             the field lists its earlier names as ``aliases``
table recreated            a truncate (``op=t``) before the new table's first change
replica identity / key     nothing here (a new key schema)
same shape, new files      re-snapshot, unless every row was provably kept
catalog moved on already   placed by attnum order when no column came and went
                           since the state; else re-snapshot (worst case: heal)
table gone since           nothing (a table created again truncates first)
========================  =====================================================

Defaults and earlier names are sticky: every later schema of the table keeps
them as long as the column exists, because older records in the topic still
need them (:func:`carry`, :func:`annotate`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from cdcd.decode.relations import ColumnDefault, TableVersion
from cdcd.envelope.schemas import record_written, type_history
from cdcd.pipeline.schema_changes.state import (
    ADD_DEFAULT,
    ADD_NULL,
    ADD_REWRITE,
    DROP,
    IDENTITY,
    PUBLISH,
    RECREATE,
    RENAME,
    REWRITE,
    TYPE,
    TYPE_REWRITE,
    UNKNOWN,
    UNPUBLISH,
    CatalogColumn,
    CatalogTable,
    ColumnState,
    TableState,
    key_names,
    version_shape,
)


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """The outcome of meeting a new table version in the stream."""

    state: TableState  # what to record (and annotate the version with)
    kinds: tuple[str, ...] = ()  # empty: nothing changed (or a replay)
    heal: bool = False  # re-snapshot the table
    truncate: bool = False  # emit op=t before the table's first change
    details: tuple[str, ...] = ()  # for the log line
    save: bool = False  # the state is new and must be recorded
    replay: bool = False  # an older shape met again after a restart


def _matches(version: TableVersion, catalog: CatalogTable | None) -> bool:
    """Whether the catalog still describes this version (no later DDL on its columns)."""
    if catalog is None or catalog.relid != version.relation_id:
        return False
    by_name = catalog.by_name()
    for column in version.columns:
        known = by_name.get(column.name)
        if known is None or (known.type_oid, known.type_modifier) != (
            column.type_oid,
            column.type_modifier,
        ):
            return False
    return True


def _placed(
    previous: TableState, version: TableVersion, catalog: CatalogTable, lsn: int
) -> tuple[CatalogColumn, ...] | None:
    """The catalog column (``attnum``) of each of the version's columns; None: it cannot be told.

    By name while the catalog names the version's columns and types, unless
    a name may have moved to another column since (:func:`_renamed_since`).
    When the catalog is ahead of the version (a later DDL committed before
    the stream reached it), by position where that is provable
    (:func:`_placed_behind`).
    """
    if any(c.attnum is None for c in previous.columns):
        return None
    if _matches(version, catalog):
        by_name = catalog.by_name()
        placed = tuple(by_name[c.name] for c in version.columns)
        return None if _renamed_since(previous, catalog, placed) else placed
    if lsn < previous.facts_lsn():
        return None  # the version may be older than what the state was read from
    return _placed_behind(previous, version, catalog)


def _renamed_since(
    previous: TableState, catalog: CatalogTable, placed: tuple[CatalogColumn, ...]
) -> bool:
    """Whether a name of the version may belong to another column in the catalog now.

    The catalog is read when the stream meets the version, possibly after
    later DDL: ``ADD x`` (the version), then ``RENAME x TO y`` and ``ADD x``
    again, gives a catalog that names the version's ``x`` but at another
    ``attnum``. The columns the state knew, that were published then and
    are now, are in the version (under whatever name). Besides them, the
    version has columns from ``placed`` (by name); any other column that
    could have been in the version with a lower ``attnum`` than one of those
    (one that came since the state and is dropped again, one the state knew
    that is dropped now, or a published one the version does not name) could
    be the one that had the name then. A catalog that describes the version
    has none of them; a version that drops a known column and adds one in
    the same ``Relation`` is told apart only by a re-snapshot.
    """
    if catalog.dropped is None:
        return False  # not read: names are all there is (unit tests of the plain path)
    known = {c.attnum for c in previous.columns if c.attnum is not None} | set(previous.unpublished)
    top = max(known | set(previous.gone), default=0)
    published = [
        c for c in catalog.columns
        if not c.generated and (catalog.published is None or c.name in catalog.published)
    ]
    was = {c.attnum for c in previous.columns}
    kept = {c.attnum for c in published if c.attnum in was}  # in the version, whatever its name
    mapped = {c.attnum for c in placed}
    if not kept <= mapped:
        return True
    beyond = mapped - kept
    if not beyond:
        return False
    last = max(beyond)
    if any((a in known or a > top) and a < last for a in catalog.dropped):
        return True
    return any(c.attnum not in mapped and c.attnum < last for c in published)


def _placed_behind(
    previous: TableState, version: TableVersion, catalog: CatalogTable
) -> tuple[CatalogColumn, ...] | None:
    """The version's columns by position, when the catalog is ahead of it; None: not provable.

    pgoutput sends columns in ``attnum`` order, and PostgreSQL never reuses
    an ``attnum``. The state knew every column of the table (published or
    not) with its ``attnum``. If none of them is dropped now, and every
    column the catalog has beyond them, alive or dropped, came after them
    (a higher ``attnum``) and is alive, then no column came and went since
    the state: the columns the version could have are those of the catalog
    now. A version that has as many columns has all of them, the i-th by
    ``attnum`` at position i, whatever was renamed or retyped since.

    A column whose type changed since the version and that has a fast
    default is not placed: the catalog's default is in the newer type.
    """
    if catalog.dropped is None or catalog.relid != previous.relid:
        return None
    known = {c.attnum for c in previous.columns if c.attnum is not None} | set(previous.unpublished)
    alive = sorted(catalog.columns, key=lambda c: c.attnum)
    if not known or len(alive) != len(version.columns):
        return None
    top = max(known | set(previous.gone))
    attnums = {c.attnum for c in alive}
    if not known <= attnums or any(a > top for a in catalog.dropped):
        return None
    if any(c.attnum not in known and c.attnum < top for c in alive):
        return None  # a column the state did not know of, older than the ones it did
    for column, now in zip(version.columns, alive, strict=True):
        retyped = (column.type_oid, column.type_modifier) != (now.type_oid, now.type_modifier)
        if retyped and (now.default is not None or now.missing_unexpressible):
            return None
    return tuple(alive)


def _gone(previous: TableState, catalog: CatalogTable, attnums: set[int]) -> tuple[int, ...]:
    """The state's dropped attnums, with those of its columns the version lacks and the catalog dropped."""
    if catalog.dropped is None:
        return previous.gone
    lacking = {c.attnum for c in previous.columns} | set(previous.unpublished)
    now = {a for a in lacking if a is not None and a not in attnums and a in catalog.dropped}
    return tuple(sorted(set(previous.gone) | now))


def _describes(version: TableVersion, catalog: CatalogTable | None) -> bool:
    """Whether the catalog is this very version: no later DDL at all, added columns included.

    New files under an unchanged Relation are this version's rewrite only
    then; a catalog with a column the stream has not reached yet is ahead
    of it, and the later version is compared with the recorded files itself
    (an ``ADD COLUMN … DEFAULT random()`` is ``add_column_rewrite`` there).
    """
    if catalog is None or not _matches(version, catalog):
        return False
    sent = {c.name for c in version.columns}
    left_out = set(catalog.unpublished(version))
    return all(c.name in sent or c.attnum in left_out for c in catalog.columns)


def baseline_state(
    version: TableVersion, catalog: CatalogTable | None, lsn: int, recreated_lsn: int | None = None
) -> TableState:
    """The state of a version seen without (usable) history."""
    # The catalog's facts (attnums, defaults, files) only where it still
    # describes this version; _matches is False without a catalog.
    described = catalog if _matches(version, catalog) else None
    by_name = described.by_name() if described is not None else {}
    columns = []
    for i, column in enumerate(version.columns):
        known = by_name.get(column.name)
        columns.append(
            ColumnState(
                attnum=known.attnum if known is not None else None,
                name=column.name,
                type_oid=column.type_oid,
                type_modifier=column.type_modifier,
                # A fast default is what every row older than the column reads,
                # whenever the column was added: true of any record without it.
                default=known.default if known is not None else None,
                nullable=i not in version.key_indexes,
            )
        )
    return TableState(
        relid=version.relation_id,
        lsn=lsn,
        storage=described.storage if described is not None else None,
        horizon=described.horizon if described is not None else None,
        replica_identity=version.replica_identity,
        key=key_names(version),
        columns=tuple(columns),
        recreated_lsn=recreated_lsn,
        unpublished=described.unpublished(version) if described is not None else (),
        gone=(described.dropped or ()) if described is not None else (),
        row_filter=catalog.row_filter if catalog is not None else None,
        filter_known=catalog is not None and catalog.filter_known,
    )


def carry(state: TableState, previous: TableState) -> TableState:
    """``state`` with the defaults and earlier names ``previous`` had for its columns, by name."""
    carried = {c.name: c for c in previous.columns}
    return replace(
        state,
        columns=tuple(
            replace(
                c,
                default=c.default or (carried[c.name].default if c.name in carried else None),
                aliases=carried[c.name].aliases if c.name in carried else (),
            )
            for c in state.columns
        ),
    )


def _by_name(state: TableState, version: TableVersion, lsn: int) -> TableState:
    """A replayed older shape, annotated with what the state knows of its columns by name."""
    known = {c.name: c for c in state.columns}
    columns = []
    for column in version.columns:
        same = known.get(column.name)
        columns.append(
            ColumnState(
                attnum=same.attnum if same is not None else None,
                name=column.name,
                type_oid=column.type_oid,
                type_modifier=column.type_modifier,
                default=same.default
                if same is not None and same.type_oid == column.type_oid
                else None,
                aliases=same.aliases if same is not None else (),
                nullable=same.nullable if same is not None else True,
            )
        )
    return replace(
        state,
        lsn=lsn,
        replica_identity=version.replica_identity,
        key=key_names(version),
        columns=tuple(columns),
    )


def classify(
    previous: TableState | None,
    version: TableVersion,
    catalog: CatalogTable | None,
    lsn: int,
    kept: bool = False,
) -> SchemaChange:
    """Compare a table version met in the stream at commit ``lsn`` with the recorded state.

    ``catalog`` is what pg_class/pg_attribute say *now* (None: the table is
    gone), which may be ahead of the stream; where it no longer describes
    ``version``, nothing can be ruled out and the change heals. ``kept``:
    the table's files changed since the state, but provably by an operation
    that keeps every row as it was (``VACUUM FULL``, ``CLUSTER``, ``SET
    TABLESPACE``: see ``CatalogReader.rows_kept`` in ``catalog``).
    """
    if previous is None:
        return SchemaChange(state=baseline_state(version, catalog, lsn), save=True)
    if previous.relid != version.relation_id:
        state = baseline_state(version, catalog, lsn, recreated_lsn=lsn)
        return SchemaChange(
            state=state,
            kinds=(RECREATE,),
            truncate=True,
            details=(f"new relation oid {version.relation_id} (was {previous.relid})",),
            save=True,
        )
    same_shape = previous.shape() == version_shape(version)
    if lsn < previous.lsn:
        # A replay of what was published before the recorded state: as it was.
        replayed = previous if same_shape else _by_name(previous, version, lsn)
        truncate = previous.recreated_lsn is not None and lsn <= previous.recreated_lsn
        return SchemaChange(state=replayed, truncate=truncate, replay=True)
    if same_shape:
        truncate = previous.recreated_lsn is not None and lsn <= previous.recreated_lsn
        if (
            catalog is not None
            and previous.storage is not None
            and catalog.relid == version.relation_id
            and catalog.storage != previous.storage
            and _describes(version, catalog)
        ):
            # The same Relation again, over new files: a rewrite that kept
            # the shape (ALTER COLUMN n TYPE int USING n * 10 on an int
            # column), or one that kept the rows (VACUUM FULL, CLUSTER).
            state = replace(previous, lsn=lsn, storage=catalog.storage, horizon=catalog.horizon)
            if kept:
                details = ("the table's files changed with every row kept",)
                return SchemaChange(state=state, truncate=truncate, details=details, save=True)
            return SchemaChange(
                state=state,
                kinds=(REWRITE,),
                heal=True,
                truncate=truncate,
                details=("the table was rewritten with its shape unchanged",),
                save=True,
            )
        return SchemaChange(state=previous, truncate=truncate)
    return _compare(previous, version, catalog, lsn, kept)


def _compare(
    previous: TableState,
    version: TableVersion,
    catalog: CatalogTable | None,
    lsn: int,
    kept: bool = False,
) -> SchemaChange:
    kinds: list[str] = []
    details: list[str] = []
    heal = False
    if (previous.replica_identity, previous.key) != (version.replica_identity, key_names(version)):
        kinds.append(IDENTITY)
        details.append(f"key ({', '.join(previous.key)}) -> ({', '.join(key_names(version))})")
    if catalog is None or catalog.relid != version.relation_id:
        # The table of this version is gone (dropped, perhaps created again):
        # nothing of it can be healed, and nothing needs to be — a table
        # created again under the name truncates its topic at its first change.
        state = _by_name(previous, version, lsn)
        details.append("the table no longer exists")
        return SchemaChange(state=state, kinds=(*kinds, UNKNOWN), details=tuple(details), save=True)
    placed = _placed(previous, version, catalog, lsn)
    if placed is None:
        # Another DDL happened since, or the state never knew the attnums:
        # which column is which cannot be told, so nothing is ruled out.
        state = carry(baseline_state(version, catalog, lsn), previous)
        details.append("the catalog no longer describes this version")
        return SchemaChange(
            state=state, kinds=(*kinds, UNKNOWN), heal=True, details=tuple(details), save=True
        )
    rewritten = previous.storage is None or (previous.storage != catalog.storage and not kept)
    old_by_attnum = {c.attnum: c for c in previous.columns}
    keys = set(key_names(version))
    attnums = {now.attnum for now in placed}
    dropped = [c for c in previous.columns if c.attnum not in attnums]
    retired = tuple(dict.fromkeys((*previous.retired, *(c.name for c in dropped))))
    # Earlier names a new column takes over stop being aliases of the column
    # that had them (two fields answering to one writer name is no schema).
    taken = {
        c.name for c, now in zip(version.columns, placed, strict=True)
        if now.attnum not in old_by_attnum
    }
    columns: list[ColumnState] = []
    for column, now in zip(version.columns, placed, strict=True):
        old = old_by_attnum.get(now.attnum)
        default: ColumnDefault | None = None
        aliases: tuple[str, ...] = ()
        nullable = column.name not in keys
        if old is None and now.attnum in previous.unpublished:
            # In the table all along, now in the publication's column list (or
            # a generated column now published): rows hold values no record has.
            kinds.append(PUBLISH)
            details.append(f"{column.name} now published (it was in the table already)")
            heal = True
            default = None
        elif old is None and (
            column.name in retired or any(column.name in c.aliases for c in previous.columns)
        ):
            # Older records carry a field by this name with another column's
            # values, which Avro would resolve into the new one.
            kinds.append(ADD_NULL if now.default is None else ADD_DEFAULT)
            details.append(f"{column.name} added under the name of an earlier column")
            heal = True
            default = now.default
        elif old is None:
            if now.missing_unexpressible:
                kinds.append(ADD_DEFAULT)
                details.append(f"{column.name} added with a default Avro cannot carry")
                heal = True
            elif now.default is not None:
                kinds.append(ADD_DEFAULT)
                default = now.default
                details.append(f"{column.name} added with default {json.dumps(default.value)}")
            elif rewritten:
                kinds.append(ADD_REWRITE)
                details.append(f"{column.name} added by a table rewrite")
                heal = True
            else:
                kinds.append(ADD_NULL)
                details.append(f"{column.name} added")
        else:
            default = old.default
            aliases = tuple(a for a in old.aliases if a not in taken)
            nullable = nullable or old.nullable
            if old.name != column.name:
                kinds.append(RENAME)
                details.append(f"{old.name} renamed to {column.name}")
                aliases = tuple(
                    a for a in (*aliases, old.name) if a != column.name and a not in taken
                )
            if (old.type_oid, old.type_modifier) != (column.type_oid, column.type_modifier):
                if default is not None:
                    default = now.default  # the old Avro default may not fit the new type
                if rewritten:
                    kinds.append(TYPE_REWRITE)
                    details.append(f"{column.name} changed type with a table rewrite")
                    heal = True
                else:
                    kinds.append(TYPE)
                    details.append(f"{column.name} changed type (binary-coercible)")
        columns.append(
            ColumnState(
                attnum=now.attnum,
                name=column.name,
                type_oid=column.type_oid,
                type_modifier=column.type_modifier,
                default=default,
                aliases=aliases,
                nullable=nullable,
            )
        )
    in_table = {c.attnum for c in catalog.columns}
    for old in dropped:
        if old.attnum in in_table:
            kinds.append(UNPUBLISH)
            details.append(f"{old.name} no longer published")
        else:
            kinds.append(DROP)
            details.append(f"{old.name} dropped")
    if rewritten and not heal:
        # The table's files changed and nothing above explains why: a rewrite
        # cdcd cannot rule out (or a TRUNCATE, which heals harmlessly: the
        # table holds only what the stream carried since).
        heal = True
        details.append("the table was rewritten")
    state = TableState(
        relid=version.relation_id,
        lsn=lsn,
        storage=catalog.storage,
        horizon=catalog.horizon,
        replica_identity=version.replica_identity,
        key=key_names(version),
        columns=tuple(columns),
        retired=tuple(name for name in retired if name not in {c.name for c in columns}),
        # Placed behind the catalog, every column of the table was sent.
        unpublished=catalog.unpublished(version) if _matches(version, catalog) else (),
        gone=_gone(previous, catalog, attnums),
        row_filter=catalog.row_filter,
        filter_known=catalog.filter_known,
    )
    unique = tuple(dict.fromkeys(kinds)) or (UNKNOWN,)
    return SchemaChange(state=state, kinds=unique, heal=heal, details=tuple(details), save=True)


def remember_written(
    previous: TableState | None, version: TableVersion, change: SchemaChange
) -> SchemaChange:
    """``change`` with the version's field types added to what the topic was written with."""
    written = record_written(previous.written if previous is not None else (), version)
    if written == change.state.written:
        return change
    state = replace(change.state, written=written)
    return replace(change, state=state, save=change.save or not change.replay)


def annotate(version: TableVersion, state: TableState) -> TableVersion:
    """The version with the state's defaults and earlier names, by column name."""
    known = {c.name: c for c in state.columns}
    defaults: list[ColumnDefault | None] = []
    aliases: list[tuple[str, ...]] = []
    optional: list[bool] = []
    history: list[tuple[Any, ...]] = []
    for i, column in enumerate(version.columns):
        same = known.get(column.name)
        fits = same is not None and (same.type_oid, same.type_modifier) == (
            column.type_oid,
            column.type_modifier,
        )
        defaults.append(same.default if fits and same is not None else None)
        aliases.append(same.aliases if same is not None else ())
        history.append(type_history(state.written, version, i, aliases[-1]))
        optional.append(
            (same is not None and same.nullable or bool(history[-1])) and i in version.key_indexes
        )
    if not any(defaults) and not any(aliases) and not any(optional) and not any(history):
        return version
    return replace(
        version,
        defaults=tuple(defaults),
        aliases=tuple(aliases),
        optional=tuple(optional),
        history=tuple(history),
    )
