"""The mirror through schema changes, truncates and re-snapshots, batch after batch (issue 13).

Drives :meth:`cdcd.spark.mirror.MirrorJob.apply` -- everything ``cdcd
mirror`` does with a decoded micro-batch: pick the newest schema, resolve
older records to it, evolve the stored rows, apply, write a generation and
commit a MERGE -- on a real output directory, with messages encoded by hand-built
writer schemas (:mod:`spark.handbuilt`). Only Spark's decoding job is left
out (it runs the same pure decoder, :func:`cdcd.spark.decode.decode_native`).
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.spark.mirror import read_mirror  # noqa: E402
from spark.handbuilt import (  # noqa: E402
    DECIMAL_12_2,
    Mirror,
    Topic,
    column,
    decimal_json,
    envelope,
    key,
    with_default,
)

V1 = envelope([key("id"), column("a", "string"), column("n", "int")])


def test_a_rename_and_a_fast_default_reach_rows_mirrored_before_them(tmp_path: Path) -> None:
    topic = Topic()
    mirror = Mirror(tmp_path, topic)
    mirror.batch([topic.change(V1, "c", lsn=10, after={"id": 1, "a": "one", "n": 1}),
                  topic.change(V1, "c", lsn=11, after={"id": 2, "a": "two", "n": 2})])  # fmt: skip
    # RENAME COLUMN a TO b; ADD COLUMN region text DEFAULT 'eu', amount numeric(12,2) DEFAULT 9.99
    v2 = envelope(
        [
            key("id"),
            column("b", "string", aliases=["a"]),
            column("n", "int"),
            with_default("region", "string", "eu"),
            with_default("amount", DECIMAL_12_2, decimal_json(999)),
        ]
    )
    report = mirror.batch(
        [
            topic.change(v2, "u", lsn=20, after={"id": 1, "b": "uno", "n": 1, "region": "us",
                                                 "amount": Decimal("1.00")}),
            # A record of the old schema still in flight (written before the ALTER).
            topic.change(V1, "c", lsn=15, after={"id": 3, "a": "three", "n": 3}, partition=1),
        ]
    )  # fmt: skip
    assert report.tables["public.t"].applied == 2
    rows = mirror.rows()
    assert list(rows[2]) == ["id", "b", "n", "region", "amount"]
    assert rows == {
        1: {"id": 1, "b": "uno", "n": 1, "region": "us", "amount": Decimal("1.00")},
        2: {"id": 2, "b": "two", "n": 2, "region": "eu", "amount": Decimal("9.99")},
        3: {"id": 3, "b": "three", "n": 3, "region": "eu", "amount": Decimal("9.99")},
    }
    # A third batch of the old layout alone (a replay) changes nothing of the layout.
    mirror.batch([topic.change(V1, "u", lsn=12, after={"id": 2, "a": "late", "n": 2})])
    assert mirror.rows()[2] == {"id": 2, "b": "two", "n": 2, "region": "eu",
                                "amount": Decimal("9.99")}  # fmt: skip


def test_truncate_then_new_rows_in_the_same_batch_and_across_batches(tmp_path: Path) -> None:
    topic = Topic()
    mirror = Mirror(tmp_path, topic)
    mirror.batch([topic.change(V1, "c", lsn=10, seq=i, after={"id": i, "a": "old", "n": i})
                  for i in (1, 2, 3)])  # fmt: skip
    # Same batch: a truncate, then an insert and a re-snapshot row.
    mirror.batch(
        [
            topic.change(V1, "t", lsn=20, partition=2),
            topic.change(V1, "c", lsn=21, after={"id": 4, "a": "new", "n": 4}),
            topic.change(V1, "r", lsn=22, after={"id": 1, "a": "again", "n": 1}, partition=1),
        ]
    )
    assert sorted(mirror.rows()) == [1, 4]
    assert mirror.rows()[1]["a"] == "again"
    # Next batch: a change committed before that truncate arrives late (another partition):
    # ignored. Re-snapshot rows overwrite what the stream held, and add what it lacked.
    report = mirror.batch(
        [
            topic.change(V1, "u", lsn=15, after={"id": 2, "a": "stale", "n": 2}, partition=3),
            topic.change(V1, "r", lsn=30, after={"id": 4, "a": "snapshot", "n": 40}),
            topic.change(V1, "r", lsn=30, seq=1, after={"id": 5, "a": "snapshot", "n": 5}),
        ]
    )
    assert report.tables["public.t"].stale == 1
    assert mirror.rows() == {
        1: {"id": 1, "a": "again", "n": 1},
        4: {"id": 4, "a": "snapshot", "n": 40},
        5: {"id": 5, "a": "snapshot", "n": 5},
    }
    # A truncate alone in a batch, then rows in the next one.
    mirror.batch([topic.change(V1, "t", lsn=40)])
    assert mirror.rows() == {}
    mirror.batch([topic.change(V1, "c", lsn=41, after={"id": 6, "a": "after", "n": 6})])
    assert mirror.rows() == {6: {"id": 6, "a": "after", "n": 6}}


def test_a_recreated_table_with_other_types_replaces_the_old_rows(tmp_path: Path) -> None:
    # DROP TABLE t; CREATE TABLE t (id text PRIMARY KEY, a date): the old rows and
    # the old table's changes cannot be converted to the new types, and need not be.
    topic = Topic()
    mirror = Mirror(tmp_path, topic)
    mirror.batch([topic.change(V1, "c", lsn=10, after={"id": 1, "a": "x", "n": 1})])
    v2 = envelope([key("id", "string"), column("a", {"type": "int", "logicalType": "date"})])
    mirror.batch(
        [
            topic.change(V1, "u", lsn=11, after={"id": 1, "a": "y", "n": 2}),
            topic.change(v2, "t", lsn=20),
            topic.change(v2, "c", lsn=21, after={"id": "k", "a": None}),
        ]
    )
    table = read_mirror(str(tmp_path / "public.t"))
    assert table.schema.field("id").type == pa.string()
    assert table.to_pylist() == [{"id": "k", "a": None}]
