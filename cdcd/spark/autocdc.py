"""``apply_changes``: AutoCDC's arguments over cdcd's apply step, for pipelines users build.

Spark's declarative pipelines offer ``create_auto_cdc_flow`` (AutoCDC): keep
a target table from a change feed given its ``keys``, a ``sequence_by``
ordering, which rows are deletes (``apply_as_deletes``) and truncates
(``apply_as_truncates``), which columns to keep (``column_list`` /
``except_column_list``), and whether to keep only the current state
(``stored_as_scd_type=1``) or every version (``2``, with
``track_history_column_list`` / ``track_history_except_column_list``).
:func:`apply_changes` takes the same arguments and applies one batch (a
DataFrame, e.g. in ``foreachBatch``) to a Delta table with the same code as
``cdcd mirror`` (:mod:`cdcd.spark.apply`, :mod:`cdcd.spark.history`), so it
writes Delta without Spark's Delta jars.

Defaults come from cdcd's envelope: given a DataFrame of
:func:`cdcd.spark.reader.read_changes`, ``sequence_by`` is (``lsn``,
``seq``), deletes are ``op = 'd'``, truncates ``op = 't'``, the row is
``after`` (``before`` for a delete), ``unchanged_toast`` columns keep their
value, and ``keys`` are the table's key columns, which ``read_changes``
records in the ``after`` column's metadata. Any other DataFrame is a flat
feed: one row per change, ``keys`` and ``sequence_by`` required.

Targets: with type 1, the table's rows (plus the ``_cdcd_lsn`` /
``_cdcd_seq`` version columns) at ``target``; with type 2, the versions at
``target`` (the history columns of :mod:`cdcd.spark.history`) and the
current state, which the next batch needs, in ``target/_cdcd_current``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdcd.errors import ConfigError
from cdcd.spark.bulk import BULK_ROWS
from cdcd.spark.layout import CHANGE_COLUMNS, RowLayout, changes_arrow_schema

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame

    from cdcd.spark.mirror import BatchReport

__all__ = ["KEY_METADATA", "apply_changes"]

#: Metadata of ``read_changes``'s ``after``/``before`` columns: the key columns (JSON list).
KEY_METADATA = "cdcd.key"
CURRENT_DIR = "_cdcd_current"
#: The writer-schema header of the changes (one layout per call).
HEADER = b"apply_changes"
_ENVELOPE_COLUMNS = frozenset({"op", "lsn", "seq", "before", "after"})


class _Envelope:
    """The schema lookup of a batch that has one layout."""

    def __init__(self, envelope: Mapping[str, Any]) -> None:
        self.envelope = dict(envelope)

    def schema(self, header: bytes) -> dict[str, Any]:
        return self.envelope

    def refresh(self) -> None:
        return None


def _names(value: str | Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def _expr(value: str | Column | None) -> Column | None:
    from pyspark.sql import functions as F

    if value is None or not isinstance(value, str):
        return value
    return F.expr(value)


def _kept(columns: Sequence[str], keep: list[str] | None, drop: list[str] | None) -> list[str]:
    if keep is not None and drop is not None:
        raise ConfigError("give column_list or except_column_list, not both")
    unknown = sorted(set(keep or ()) - set(columns)) or sorted(set(drop or ()) - set(columns))
    if unknown:
        raise ConfigError(f"no column {', '.join(unknown)} in the source")
    if keep is not None:
        return [c for c in columns if c in keep]
    return [c for c in columns if c not in (drop or ())]


def _sequence(df: DataFrame, sequence_by: list[str]) -> tuple[Column, Column]:
    """(lsn, seq) as longs from the ``sequence_by`` columns (one or two)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    def as_long(name: str) -> Column:
        kind = df.schema[name].dataType
        if isinstance(kind, T.TimestampType | T.TimestampNTZType):
            return F.unix_micros(F.col(name).cast("timestamp"))
        if isinstance(kind, T.DateType):
            return F.unix_date(F.col(name)).cast("long")
        if isinstance(kind, T.IntegralType | T.DecimalType):
            return F.col(name).cast("long")
        raise ConfigError(f"sequence_by column {name} is {kind.simpleString()}: give an integer, "
                          "timestamp or date column")  # fmt: skip

    if len(sequence_by) == 1:
        return as_long(sequence_by[0]), F.monotonically_increasing_id()
    if len(sequence_by) == 2:
        return as_long(sequence_by[0]), as_long(sequence_by[1])
    raise ConfigError("sequence_by names one column, or two (a major and a minor order)")


@dataclass(frozen=True)
class _Arguments:
    """AutoCDC's arguments, normalised."""

    keys: list[str] | None
    sequence_by: list[str] | None
    deletes: Column | None
    truncates: Column | None
    keep: list[str] | None
    drop: list[str] | None

    def columns(self, available: Sequence[str], keys: Sequence[str]) -> list[str]:
        """The target's columns (``column_list`` / ``except_column_list``), keys kept."""
        columns = _kept(available, self.keep, self.drop)
        if not set(keys) <= set(columns):
            raise ConfigError("the key columns must stay in the target's columns")
        return columns


def _from_changes(df: DataFrame, args: _Arguments) -> tuple[DataFrame, list[str], list[str]]:
    """A ``read_changes`` DataFrame with the arguments applied; its keys and columns."""
    import json

    from pyspark.sql import functions as F

    keys, sequence_by, deletes, truncates = (
        args.keys,
        args.sequence_by,
        args.deletes,
        args.truncates,
    )

    after = df.schema["after"]
    if keys is None:
        recorded = after.metadata.get(KEY_METADATA)
        if not recorded:
            raise ConfigError(
                "the source does not say which columns are the key",
                hint="pass keys=[...] (the table's primary key or identity index columns)",
            )
        keys = list(json.loads(recorded) if isinstance(recorded, str) else recorded)
    columns = args.columns([f.name for f in after.dataType.fields], keys)  # type: ignore[attr-defined]

    def image(name: str) -> Column:
        fields = [F.col(f"{name}.`{c.replace('`', '``')}`").alias(c) for c in columns]
        return F.when(F.col(name).isNull(), F.lit(None)).otherwise(F.struct(*fields))

    op = F.col("op")
    if truncates is not None:
        op = F.when(truncates, F.lit("t")).otherwise(op)
    if deletes is not None:
        op = F.when(deletes, F.lit("d")).otherwise(op)
    lsn, seq = (F.col("lsn"), F.col("seq")) if sequence_by is None else _sequence(df, sequence_by)
    selected = [
        (
            lsn if name == "lsn" else seq if name == "seq" else op if name == "op" else F.col(name)
        ).alias(name)
        for name, _ in CHANGE_COLUMNS
    ]
    return (
        df.select(*selected, image("before").alias("before"), image("after").alias("after")),
        keys,
        columns,
    )


def _from_flat(
    df: DataFrame, target: str, args: _Arguments
) -> tuple[DataFrame, list[str], list[str]]:
    """A flat change feed (one row per change) as cdcd's change columns."""
    from pyspark.sql import functions as F

    keys, sequence_by, deletes, truncates = (
        args.keys,
        args.sequence_by,
        args.deletes,
        args.truncates,
    )
    if not keys or not sequence_by:
        raise ConfigError("a change feed other than read_changes needs keys= and sequence_by=")
    columns = args.columns(df.columns, keys)
    op = F.lit("u")
    if deletes is not None:
        op = F.when(deletes, F.lit("d")).otherwise(op)
    if truncates is not None:
        op = F.when(truncates, F.lit("t")).otherwise(op)
    lsn, seq = _sequence(df, sequence_by)
    row = F.struct(*[F.col(f"`{c.replace('`', '``')}`").alias(c) for c in columns])
    literal = {
        "topic": F.lit(target),
        "partition": F.lit(0),
        "offset": F.lit(0).cast("long"),
        "lsn": lsn,
        "seq": seq,
        "op": op,
        "ts_ms": F.lit(None).cast("long"),
        "commit_ts": F.lit(None).cast("timestamp"),
        "tx_id": F.lit(None).cast("long"),
        "snapshot": F.lit(False),
        "source_db": F.lit(""),
        "source_schema": F.lit(""),
        "source_table": F.lit(target),
        "unchanged_toast": F.array().cast("array<string>"),
    }
    staged = df.select(
        *[literal[name].alias(name) for name, _ in CHANGE_COLUMNS], row.alias("_row")
    )
    return (
        staged.select(
            *[F.col(name) for name, _ in CHANGE_COLUMNS],
            F.when(F.col("op") == "d", F.col("_row")).alias("before"),
            F.when(F.col("op").isin("d", "t"), F.lit(None)).otherwise(F.col("_row")).alias("after"),
        ),
        keys,
        columns,
    )


def _reduce_partition(
    batches: Iterator[pa.RecordBatch],
    topic: str,
    layout: RowLayout,
    per_commit: bool,
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: a task's changes with each key's runs of upserts collapsed
    (:func:`cdcd.spark.decode.reduce_native`), as the mirror's decoded payloads."""
    import pyarrow as pa

    from cdcd.spark.decode import NativeChanges, payload_rows, reduce_native

    parts = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not parts:
        return
    table = pa.concat_tables(parts).cast(changes_arrow_schema(layout))
    native = NativeChanges(topic, HEADER, layout.shape, table, (), layout.key_names)
    yield from payload_rows([reduce_native(native, per_commit=per_commit)])


def _reduced(df: DataFrame, topic: str, layout: RowLayout, per_commit: bool) -> DataFrame:
    """``df`` reduced on the executors, after a shuffle that puts each key's changes
    in one task (a DataFrame, unlike Kafka, does not keep a key on one partition),
    as the mirror's decoded payloads (:data:`cdcd.spark.decode.PAYLOAD_DDL`)."""
    from functools import partial

    from pyspark.sql import functions as F

    from cdcd.spark.decode import PAYLOAD_DDL

    keys = layout.key_names
    if keys:
        image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
        df = df.repartition(*[image.getField(k) for k in keys])
    # Keyless changes are matched on whole rows: nothing collapses, any task will do.
    return df.mapInArrow(
        partial(_reduce_partition, topic=topic, layout=layout, per_commit=per_commit),
        PAYLOAD_DDL,
    )


def apply_changes(
    source_df: DataFrame,
    target: str,
    *,
    keys: Sequence[str] | None = None,
    sequence_by: str | Sequence[str] | None = None,
    stored_as_scd_type: int = 1,
    apply_as_deletes: str | Column | None = None,
    apply_as_truncates: str | Column | None = None,
    column_list: Sequence[str] | None = None,
    except_column_list: Sequence[str] | None = None,
    track_history_column_list: Sequence[str] | None = None,
    track_history_except_column_list: Sequence[str] | None = None,
    batch_id: int | None = None,
    app_id: str = "cdcd-apply-changes",
    storage_options: Mapping[str, str] | None = None,
    bulk_rows: int | None = BULK_ROWS,
) -> BatchReport:
    """Apply one batch of changes to the Delta table at ``target`` (see the module doc).

    ``batch_id`` (``foreachBatch``'s) with ``app_id`` makes the batch
    idempotent: a batch already applied under that app id is skipped; without
    it, each call is a new batch. ``bulk_rows``: a batch bringing the target at least
    that many new keys is written by the executors, as ``cdcd mirror`` does (None:
    always collected to the driver). Returns the batch's report.
    """
    from cdcd.spark.mirror import HistoryOptions, MirrorJob, MirrorStore

    if stored_as_scd_type not in (1, 2):
        raise ConfigError("stored_as_scd_type is 1 or 2")
    if track_history_column_list is not None and track_history_except_column_list is not None:
        raise ConfigError(
            "give track_history_column_list or track_history_except_column_list, not both"
        )
    arguments = _Arguments(
        _names(keys),
        _names(sequence_by),
        _expr(apply_as_deletes),
        _expr(apply_as_truncates),
        _names(column_list),
        _names(except_column_list),
    )
    if _ENVELOPE_COLUMNS <= set(source_df.columns):
        changes_df, key, columns = _from_changes(source_df, arguments)
    else:
        changes_df, key, columns = _from_flat(source_df, target, arguments)
    # The row's Arrow type, without running the batch (Spark plans LIMIT 0 as empty).
    row_type = changes_df.limit(0).toArrow().schema.field("after").type
    layout = RowLayout.from_arrow(row_type, key)
    base = target.rstrip("/")
    current = f"{base}/{CURRENT_DIR}" if stored_as_scd_type == 2 else base
    topic = f"apply_changes:{base}"
    store = MirrorStore(base, storage_options, app_id=app_id)
    store.locations[topic] = current
    store.history_locations[current] = base
    tracked = _names(track_history_column_list)
    if track_history_except_column_list is not None:
        tracked = [c for c in columns if c not in track_history_except_column_list]
    history = HistoryOptions(
        all_tables=stored_as_scd_type == 2,
        tracked=(("*.*", tuple(tracked)),) if tracked is not None else (),
    )
    envelope = layout.envelope()
    job = MirrorJob(
        store,
        _Envelope(envelope),  # type: ignore[arg-type]
        history=history,
        track_partitions=False,
        bulk_rows=bulk_rows,
    )
    mirrored = store.load(topic, "", "")
    if batch_id is None:
        batch_id = mirrored.applied_batch + 1 if mirrored is not None else 0
    # Each key's changes to one task, reduced there: the driver receives at most one
    # change per key (per key and transaction for type 2), and a large batch of new
    # keys is written by the executors (:mod:`cdcd.spark.bulk`), not collected.
    payloads = _reduced(changes_df, topic, layout, per_commit=stored_as_scd_type == 2)
    return job.apply_payloads(payloads, batch_id)
