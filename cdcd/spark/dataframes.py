"""The Spark side of decoding: Spark types, the ``mapInArrow`` job, the header summary.

Everything here needs a Spark session or builds Spark objects; the decoding
itself is the pure code of :mod:`cdcd.spark.decode` and
:mod:`cdcd.spark.layout`, run on the executors.

Types (SPEC §5 to Spark): boolean, int, long, float, double, string,
bytes -> BinaryType; decimal(p,s) -> DecimalType(p,s) when p <= 38, else
StringType holding the exact decimal text; date -> DateType;
timestamp-micros -> TimestampType (UTC instants); local-timestamp-micros ->
TimestampNTZType; time-micros -> LongType, microseconds since midnight
(Spark's Arrow bridge has no TIME type; this is also what ``from_avro``
gives); arrays -> ArrayType with nullable elements, nested for more
dimensions.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from cdcd.spark.decode import DecodePlan, HeaderUse, decode_arrow
from cdcd.spark.layout import ColumnType, RowLayout

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType, StructType

__all__ = [
    "changes_spark_schema",
    "decode_changes",
    "header_summary",
    "row_spark_type",
    "spark_type",
]


def spark_type(ctype: ColumnType) -> DataType:
    """The Spark type of a column type (see the module docstring)."""
    from pyspark.sql import types as T

    kind = ctype.kind
    if kind == "array":
        assert ctype.item is not None
        return T.ArrayType(spark_type(ctype.item), containsNull=True)
    if kind == "decimal":
        return T.StringType() if ctype.wide_decimal else T.DecimalType(ctype.precision, ctype.scale)
    simple: dict[str, DataType] = {
        "boolean": T.BooleanType(),
        "int": T.IntegerType(),
        "long": T.LongType(),
        "float": T.FloatType(),
        "double": T.DoubleType(),
        "string": T.StringType(),
        "bytes": T.BinaryType(),
        "date": T.DateType(),
        "time": T.LongType(),
        "timestamp": T.TimestampType(),
        "local_timestamp": T.TimestampNTZType(),
    }
    return simple[kind]


def row_spark_type(layout: RowLayout) -> StructType:
    from pyspark.sql import types as T

    return T.StructType([T.StructField(c.name, spark_type(c.type), True) for c in layout.columns])


def changes_spark_schema(layout: RowLayout) -> StructType:
    """The Spark schema of decoded changes (:func:`cdcd.spark.layout.changes_arrow_schema`)."""
    from pyspark.sql import types as T

    row = row_spark_type(layout)
    return T.StructType(
        [
            T.StructField("topic", T.StringType()),
            T.StructField("partition", T.IntegerType()),
            T.StructField("offset", T.LongType()),
            T.StructField("lsn", T.LongType()),
            T.StructField("seq", T.LongType()),
            T.StructField("op", T.StringType()),
            T.StructField("ts_ms", T.LongType()),
            T.StructField("commit_ts", T.TimestampType()),
            T.StructField("tx_id", T.LongType()),
            T.StructField("snapshot", T.BooleanType()),
            T.StructField("source_db", T.StringType()),
            T.StructField("source_schema", T.StringType()),
            T.StructField("source_table", T.StringType()),
            T.StructField("unchanged_toast", T.ArrayType(T.StringType(), True)),
            T.StructField("before", row),
            T.StructField("after", row),
        ]
    )


def decode_changes(raw: DataFrame, plan: DecodePlan) -> DataFrame:
    """The decoded changes of ``plan.topic`` in ``raw`` (Kafka rows), computed on executors."""
    from pyspark.sql import functions as F

    return raw.where(F.col("topic") == plan.topic).mapInArrow(
        partial(decode_arrow, plan=plan), changes_spark_schema(plan.layout)
    )


# ----------------------------------------------------------------------------- header summary

_HEADER_SQL = (
    "CASE WHEN value IS NULL THEN NULL "
    "WHEN substring(value, 1, 2) = X'C301' THEN substring(value, 1, 10) "
    "WHEN substring(value, 1, 1) = X'00' THEN substring(value, 1, 5) "
    "ELSE substring(value, 1, 2) END"
)
_LSN_TEXT = "CAST(try_element_at(filter(headers, h -> h.key = 'cdcd.lsn'), 1).value AS STRING)"
_SEQ_TEXT = "CAST(try_element_at(filter(headers, h -> h.key = 'cdcd.seq'), 1).value AS STRING)"
_LSN_SQL = (
    f"shiftleft(try_cast(conv(substring_index({_LSN_TEXT}, '/', 1), 16, 10) AS BIGINT), 32) "
    f"+ try_cast(conv(substring_index({_LSN_TEXT}, '/', -1), 16, 10) AS BIGINT)"
)
_SEQ_SQL = f"try_cast({_SEQ_TEXT} AS BIGINT)"


def header_summary(raw: DataFrame) -> list[HeaderUse]:
    """Per topic and writer schema: the newest (lsn, seq) and the number of messages.

    A small aggregation over the message headers and the first bytes of the
    values; no Avro decoding.
    """
    from pyspark.sql import functions as F

    rows = (
        raw.where(F.col("value").isNotNull())
        .select(
            F.col("topic"),
            F.expr(_HEADER_SQL).alias("header"),
            F.struct(F.expr(_LSN_SQL).alias("lsn"), F.expr(_SEQ_SQL).alias("seq")).alias("v"),
        )
        .groupBy("topic", "header")
        .agg(F.max("v").alias("v"), F.count(F.lit(1)).alias("n"))
        .collect()
    )
    return [
        HeaderUse(
            row["topic"], bytes(row["header"]), row["v"]["lsn"], row["v"]["seq"], int(row["n"])
        )
        for row in rows
    ]


_KEY_HEADER_SQL = _HEADER_SQL.replace("value", "key")


def newest_key_header(raw: DataFrame, topic: str) -> bytes | None:
    """The wire header of the key of ``topic``'s newest message (by lsn, seq) that has a
    key: the key schema of the table's newest identity; None when no message has one."""
    from pyspark.sql import functions as F

    rows = (
        raw.where((F.col("topic") == topic) & F.col("value").isNotNull() & F.col("key").isNotNull())
        .select(
            F.expr(_KEY_HEADER_SQL).alias("header"),
            F.struct(F.expr(_LSN_SQL).alias("lsn"), F.expr(_SEQ_SQL).alias("seq")).alias("v"),
        )
        .orderBy(F.col("v").desc())
        .limit(1)
        .collect()
    )
    return bytes(rows[0]["header"]) if rows else None
