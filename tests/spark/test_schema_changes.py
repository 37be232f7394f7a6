"""Consumers resolve old records the way plain Avro would (issue 13, SPEC §5 "Schema changes").

The writer schemas are spelled by hand as the contract says cdcd publishes
them: a column added with a fast default is ``[T, "null"]`` with its Avro
default, a renamed column lists its earlier names in ``aliases``. Decoding a
record written before such a change with the newest schema must give
PostgreSQL's values -- the default, the renamed column's value -- in
``cdcd.spark`` (:func:`decode_batch`, :func:`to_reader`) and in the mirror's
stored rows (:func:`evolve`). Pure pyarrow/fastavro: no JVM, no broker.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from cdcd.errors import DefiniteError  # noqa: E402
from cdcd.spark.apply import META_LSN, META_SEQ, evolve  # noqa: E402
from cdcd.spark.decode import DecodePlan, decode_arrow, decode_batch  # noqa: E402
from cdcd.spark.layout import RowLayout  # noqa: E402
from spark.envelopes import kafka_batch  # noqa: E402
from spark.handbuilt import (  # noqa: E402
    DECIMAL_12_2,
    INT_ARRAY,
    TIMESTAMPTZ,
    TOPIC,
    Topic,
    column,
    decimal_json,
    envelope,
    key,
    with_default,
)

V1 = envelope([key("id"), column("a", "string"), column("n", "int")])
# ALTER TABLE t ADD COLUMN region text DEFAULT 'eu', ADD COLUMN amount numeric(12,2)
# DEFAULT -12.50, ADD COLUMN since timestamptz DEFAULT '2023-11-14 22:13:20+00',
# ADD COLUMN tags int[] DEFAULT '{1,NULL,3}'
V2 = envelope(
    [
        key("id"),
        column("a", "string"),
        column("n", "int"),
        with_default("region", "string", "eu"),
        with_default("amount", DECIMAL_12_2, decimal_json(-1250)),
        with_default("since", TIMESTAMPTZ, 1_700_000_000_000_000),
        with_default("tags", INT_ARRAY, [1, None, 3]),
    ]
)
SINCE = datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)


def decode(topic: Topic, reader: dict[str, Any]) -> list[dict[str, Any]]:
    """Every change of ``topic`` decoded to ``reader``'s layout, in offset order."""
    plan = DecodePlan.build(TOPIC, reader, topic.schemas)
    rows: list[dict[str, Any]] = decode_batch(kafka_batch(topic.messages), plan).to_pylist()
    return rows


def test_a_union_with_null_last_is_a_nullable_column() -> None:
    layout = RowLayout.from_row(V2["fields"][0]["type"][1])
    region = layout.columns[3]
    assert (region.name, region.key, region.type.kind) == ("region", False, "string")
    assert layout.columns[4].type.describe() == "decimal(12,2)"
    assert layout.columns[6].type.describe() == "array<int>"
    assert layout.key_names == ()  # the key comes from the message key, not nullability
    assert layout.with_key(("id",)).key_names == ("id",)
    topic = Topic()
    topic.change(V2, "c", lsn=10, after={"id": 1, "a": "x", "n": 1, "region": "us",
                                         "amount": Decimal("3.25"), "since": SINCE,
                                         "tags": [7]})  # fmt: skip
    topic.change(V2, "c", lsn=11, after={"id": 2, "a": None, "n": None, "region": None,
                                         "amount": None, "since": None, "tags": None})  # fmt: skip
    first, second = (r["after"] for r in decode(topic, V2))
    assert first["region"] == "us" and first["amount"] == Decimal("3.25")
    assert first["since"] == SINCE and first["tags"] == [7]
    # An explicit null written with the new schema stays null: defaults only fill absent columns.
    assert second == {"id": 2, "a": None, "n": None, "region": None, "amount": None,
                      "since": None, "tags": None}  # fmt: skip


def test_fast_defaults_fill_records_written_before_the_column_existed() -> None:
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "x", "n": 5})
    topic.change(V1, "d", lsn=11, before={"id": 1, "a": "x", "n": 5})
    topic.change(V2, "c", lsn=20, after={"id": 2, "a": "y", "n": 6, "region": "us",
                                         "amount": Decimal("1.00"), "since": None,
                                         "tags": []})  # fmt: skip
    insert, delete, newer = decode(topic, V2)
    defaults = {"region": "eu", "amount": Decimal("-12.50"), "since": SINCE, "tags": [1, None, 3]}
    assert insert["after"] == {"id": 1, "a": "x", "n": 5, **defaults}
    assert insert["before"] is None  # a missing image stays missing
    assert delete["before"] == {"id": 1, "a": "x", "n": 5, **defaults}
    assert delete["after"] is None
    assert newer["after"]["region"] == "us" and newer["after"]["since"] is None


def test_a_default_that_does_not_fit_its_type_names_the_column() -> None:
    bad = envelope([key("id"), column("a", "string"), with_default("extra", "int", "many")])
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "x", "n": 5})
    with pytest.raises(DefiniteError, match=r"default \"many\" of column 'extra'"):
        decode(topic, bad)


def test_a_renamed_column_keeps_the_values_of_old_records() -> None:
    # ALTER TABLE t RENAME COLUMN a TO b
    v2 = envelope([key("id"), column("b", "string", aliases=["a"]), column("n", "int")])
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "old", "n": 5})
    topic.change(v2, "u", lsn=20, after={"id": 2, "b": "new", "n": 6})
    assert [r["after"] for r in decode(topic, v2)] == [
        {"id": 1, "b": "old", "n": 5},
        {"id": 2, "b": "new", "n": 6},
    ]


def test_a_column_renamed_twice_resolves_from_both_earlier_names() -> None:
    # RENAME COLUMN a TO b, then RENAME COLUMN b TO c
    v2 = envelope([key("id"), column("b", "string", aliases=["a"]), column("n", "int")])
    v3 = envelope([key("id"), column("c", "string", aliases=["a", "b"]), column("n", "int")])
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "first", "n": 1})
    topic.change(v2, "c", lsn=20, after={"id": 2, "b": "second", "n": 2})
    topic.change(v3, "c", lsn=30, after={"id": 3, "c": "third", "n": 3})
    assert [r["after"]["c"] for r in decode(topic, v3)] == ["first", "second", "third"]


def test_rename_and_fast_default_together() -> None:
    # RENAME COLUMN a TO b; ADD COLUMN region text DEFAULT 'eu'
    v2 = envelope(
        [
            key("id"),
            column("b", "string", aliases=["a"]),
            column("n", "int"),
            with_default("region", "string", "eu"),
        ]
    )
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "old", "n": 5})
    topic.change(v2, "c", lsn=20, after={"id": 2, "b": "new", "n": 6, "region": "us"})
    assert [r["after"] for r in decode(topic, v2)] == [
        {"id": 1, "b": "old", "n": 5, "region": "eu"},
        {"id": 2, "b": "new", "n": 6, "region": "us"},
    ]


def test_a_name_freed_by_a_rename_and_added_again_is_a_new_column() -> None:
    # RENAME COLUMN a TO b; ADD COLUMN a text DEFAULT 'fresh': old records' a is now b.
    v2 = envelope(
        [
            key("id"),
            column("b", "string", aliases=["a"]),
            column("n", "int"),
            with_default("a", "string", "fresh"),
        ]
    )
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "old", "n": 5})
    topic.change(v2, "c", lsn=20, after={"id": 2, "b": "was a", "n": 6, "a": "new a"})
    assert [r["after"] for r in decode(topic, v2)] == [
        {"id": 1, "b": "old", "n": 5, "a": "fresh"},
        {"id": 2, "b": "was a", "n": 6, "a": "new a"},
    ]
    # And a reader older than the rename reads the renamed column under its old name.
    assert [r["after"] for r in decode(topic, V1)] == [
        {"id": 1, "a": "old", "n": 5},
        {"id": 2, "a": "was a", "n": 6},
    ]


def test_a_dropped_column_whose_name_a_rename_reuses_does_not_come_back() -> None:
    # ALTER TABLE t DROP COLUMN a; RENAME COLUMN n TO a (a is now an int column, once n)
    v2 = envelope([key("id"), column("a", "int", aliases=["n"])])
    topic = Topic()
    topic.change(V1, "c", lsn=10, after={"id": 1, "a": "dropped text", "n": 5})
    assert decode(topic, v2)[0]["after"] == {"id": 1, "a": 5}


def _stored(layout: RowLayout, rows: list[dict[str, Any]]) -> Any:
    schema = layout.arrow_schema().append(pa.field(META_LSN, pa.int64()))
    schema = schema.append(pa.field(META_SEQ, pa.int64()))
    return pa.Table.from_pylist(
        [{**row, META_LSN: 10 + i, META_SEQ: 0} for i, row in enumerate(rows)], schema=schema
    )


def test_mirror_rows_get_defaults_and_keep_renamed_values_when_the_layout_evolves() -> None:
    old = RowLayout.from_envelope(V1)
    # RENAME COLUMN a TO b; ADD COLUMN region ... DEFAULT 'eu'; ADD COLUMN amount ... DEFAULT -12.50
    new = RowLayout.from_envelope(
        envelope(
            [
                key("id"),
                column("b", "string", aliases=["a"]),
                column("n", "long"),
                with_default("region", "string", "eu"),
                with_default("amount", DECIMAL_12_2, decimal_json(-1250)),
                with_default("tags", INT_ARRAY, [1, None, 3]),
            ]
        )
    )
    rows = _stored(old, [{"id": 1, "a": "x", "n": 5}, {"id": 2, "a": None, "n": None}])
    evolved = evolve(rows, new, "public.t", old)
    assert evolved.column_names == ["id", "b", "n", "region", "amount", "tags", META_LSN, META_SEQ]
    assert evolved.drop_columns([META_LSN, META_SEQ]).to_pylist() == [
        {"id": 1, "b": "x", "n": 5, "region": "eu", "amount": Decimal("-12.50"),
         "tags": [1, None, 3]},
        {"id": 2, "b": None, "n": None, "region": "eu", "amount": Decimal("-12.50"),
         "tags": [1, None, 3]},
    ]  # fmt: skip
    assert evolved.column(META_LSN).to_pylist() == [10, 11]


def test_a_long_running_plan_refreshes_and_decodes_with_a_republished_schema() -> None:
    # numeric(12,2) -> numeric(12,3): Avro's canonical form drops the logical type, so the
    # fingerprint (the header) stays and the daemon publishes the new schema under it again.
    scale_2 = envelope([key("id"), column("price", DECIMAL_12_2)])
    scale_3 = envelope([key("id"), column("price", {**DECIMAL_12_2, "scale": 3})])
    topic = Topic()
    topic.change(scale_3, "u", lsn=20, after={"id": 1, "price": Decimal("1.250")})
    header = next(iter(topic.schemas))
    published = {header: scale_2}  # what the catalog held when the query started
    refreshed: list[bool] = []

    def refresh() -> None:
        refreshed.append(True)
        published[header] = scale_3  # the republication, read from _schemas

    plan = DecodePlan.build(TOPIC, scale_3, {header: scale_2}, published.__getitem__, refresh)
    (batch,) = decode_arrow([kafka_batch(topic.messages)], plan)
    assert refreshed == [True]
    assert batch.to_pylist()[0]["after"] == {"id": 1, "price": Decimal("1.250")}
