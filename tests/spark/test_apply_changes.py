"""``cdcd.spark.apply_changes``: AutoCDC's arguments, SCD type 1 and 2, on the shared Spark session (issue 28).

Two sources: a flat change feed (one row per change, ``keys`` and
``sequence_by`` given, deletes flagged by a column) and a DataFrame of
decoded cdcd changes (the columns of ``read_changes``; its defaults). The
targets are read back with deltalake.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark]

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.errors import ConfigError  # noqa: E402
from cdcd.spark import apply_changes, read_mirror  # noqa: E402
from cdcd.spark.autocdc import KEY_METADATA  # noqa: E402
from cdcd.spark.decode import DecodePlan, decode_batch  # noqa: E402
from cdcd.spark.history import valid_at  # noqa: E402
from spark.envelopes import kafka_batch  # noqa: E402
from spark.handbuilt import TOPIC, Topic, column, envelope, key  # noqa: E402

FLAT = "id int, name string, ts long, deleted boolean"


def _rows(table: Any) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in table.to_pylist())


def _history(target: Path | str) -> Any:
    from deltalake import DeltaTable

    return DeltaTable(str(target)).to_pyarrow_table()


def test_a_flat_feed_as_scd_type_1_and_2(spark: Any, tmp_path: Path) -> None:
    one, two = str(tmp_path / "scd1"), str(tmp_path / "scd2")
    batches = [
        [(1, "a", 1, False), (2, "b", 1, False), (1, "a2", 2, False)],
        # a delete, an insert, and a late change older than what is stored: ignored
        [(2, None, 3, True), (3, "c", 3, False), (1, "stale", 0, False)],
        [(3, "c2", 5, False), (4, "d", 5, False)],
    ]
    for rows in batches:
        df = spark.createDataFrame(rows, FLAT)
        for target, scd in ((one, 1), (two, 2)):
            apply_changes(df, target, keys=["id"], sequence_by="ts", stored_as_scd_type=scd,
                          apply_as_deletes="deleted", except_column_list=["deleted"])  # fmt: skip
    assert _rows(read_mirror(one)) == [(1, "a2", 2), (3, "c2", 5), (4, "d", 5)]
    history = _history(two)
    at = {ts: sorted((r["id"], r["name"]) for r in valid_at(history, ts).to_pylist())
          for ts in (1, 2, 3, 4, 5)}  # fmt: skip
    assert at[1] == [(1, "a"), (2, "b")]
    assert at[2] == [(1, "a2"), (2, "b")]
    assert at[3] == at[4] == [(1, "a2"), (3, "c")]
    assert at[5] == [(1, "a2"), (3, "c2"), (4, "d")]
    assert set(history.column_names) >= {"id", "name", "ts", "__start_lsn", "__end_lsn",
                                         "__is_current"}  # fmt: skip
    assert "deleted" not in history.column_names


def test_track_history_columns(spark: Any, tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    for rows in ([(1, "a", 1, False)], [(1, "a", 2, False)], [(1, "b", 3, False)]):
        apply_changes(spark.createDataFrame(rows, FLAT), target, keys=["id"], sequence_by="ts",
                      stored_as_scd_type=2, column_list=["id", "name", "ts"],
                      track_history_column_list=["name"])  # fmt: skip
    versions = sorted((r["__start_lsn"], r["__end_lsn"], r["name"], r["ts"])
                      for r in _history(target).to_pylist())  # fmt: skip
    assert versions == [(1, 3, "a", 2), (3, None, "b", 3)]


def test_a_batch_id_is_applied_once(spark: Any, tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    df = spark.createDataFrame([(1, "a", 1, False)], FLAT)
    apply_changes(df, target, keys=["id"], sequence_by="ts", batch_id=7, app_id="q")
    later = spark.createDataFrame([(1, "b", 2, False)], FLAT)
    report = apply_changes(later, target, keys=["id"], sequence_by="ts", batch_id=7, app_id="q")
    assert report.skipped and _rows(read_mirror(target)) == [(1, "a", 1, False)]


def _decoded(spark: Any) -> Any:
    """A DataFrame of decoded cdcd changes, as read_changes returns it."""
    schema = envelope([key("id"), column("v", "string"), column("big", "string")])
    topic = Topic()
    topic.change(schema, "c", lsn=10, after={"id": 1, "v": "a", "big": "toasted"})
    topic.change(schema, "c", lsn=10, seq=1, after={"id": 2, "v": "b", "big": "x"})
    topic.change(schema, "u", lsn=20, after={"id": 1, "v": "a2", "big": None})
    topic.change(schema, "d", lsn=30, before={"id": 2, "v": None, "big": None})
    batch = decode_batch(
        kafka_batch(topic.messages), DecodePlan.build(TOPIC, schema, topic.schemas)
    )
    table = pa.Table.from_batches([batch])
    # The update left "big" out (unchanged TOAST).
    toast = pa.array([[], [], ["big"], []], pa.list_(pa.string()))
    table = table.set_column(
        table.schema.get_field_index("unchanged_toast"), "unchanged_toast", toast
    )
    return spark.createDataFrame(table)


def test_read_changes_defaults(spark: Any, tmp_path: Path) -> None:
    changes = _decoded(spark)
    with pytest.raises(ConfigError, match="keys"):
        apply_changes(changes, str(tmp_path / "nokey"))
    marked = changes.withMetadata("after", {KEY_METADATA: json.dumps(["id"])})
    target = str(tmp_path / "t")
    apply_changes(marked, target)
    assert _rows(read_mirror(target)) == [(1, "a2", "toasted")]
    history = str(tmp_path / "h")
    apply_changes(changes, history, keys=["id"], stored_as_scd_type=2, except_column_list=["big"])
    at = {lsn: sorted((r["id"], r["v"]) for r in valid_at(_history(Path(history)), lsn).to_pylist())
          for lsn in (10, 20, 30)}  # fmt: skip
    assert at == {10: [(1, "a"), (2, "b")], 20: [(1, "a2"), (2, "b")], 30: [(1, "a2")]}


def test_the_batch_is_reduced_on_the_executors_by_key(spark: Any, tmp_path: Path) -> None:
    """Changes of one key spread over several partitions reach the driver as one change
    per key (type 1; per key and sequence for type 2), and the targets are exact."""
    from cdcd.spark.autocdc import _Arguments, _from_flat, _reduced
    from cdcd.spark.decode import read_payloads
    from cdcd.spark.layout import RowLayout

    rows = [(k, f"v{k}.{ts}", ts, ts == 9 and k % 3 == 0) for ts in range(1, 10) for k in range(6)]
    df = spark.createDataFrame(rows, FLAT).repartition(4)  # a key's changes on any partition
    changes, keys, _ = _from_flat(
        df, "t", _Arguments(["id"], ["ts"], _deleted(), None, None, ["deleted"])
    )
    layout = RowLayout.from_arrow(changes.limit(0).toArrow().schema.field("after").type, keys)

    def reduced(per_commit: bool) -> int:
        payloads = _reduced(changes, "t", layout, per_commit=per_commit).toArrow()
        natives = read_payloads(payloads, lambda header: layout.envelope())
        return sum(n.changes.num_rows for n in natives.get("t", []))

    # 54 changes of 6 keys: a run per key, and the deletes of keys 0 and 3 after theirs.
    assert reduced(per_commit=False) == 6 + 2
    assert reduced(per_commit=True) == 54  # one per key and sequence
    one, two = str(tmp_path / "scd1"), str(tmp_path / "scd2")
    for target, scd in ((one, 1), (two, 2)):
        apply_changes(df, target, keys=["id"], sequence_by="ts", stored_as_scd_type=scd,
                      apply_as_deletes="deleted", except_column_list=["deleted"])  # fmt: skip
    assert _rows(read_mirror(one)) == [(k, f"v{k}.9", 9) for k in range(6) if k % 3]
    history = _history(two)
    for ts in range(1, 10):
        live = [(k, f"v{k}.{ts}") for k in range(6) if ts < 9 or k % 3]
        assert sorted((r["id"], r["name"]) for r in valid_at(history, ts).to_pylist()) == live


def _deleted() -> Any:
    from pyspark.sql import functions as F

    return F.col("deleted")


def _inserted(spark: Any, ids: range, lsn: int, op: str = "r") -> Any:
    """Decoded changes inserting (or snapshot-reading) the rows ``ids``, with the key
    recorded as ``read_changes`` records it."""
    schema = envelope([key("id"), column("v", "string")])
    topic = Topic()
    for seq, i in enumerate(ids):
        topic.change(schema, op, lsn=lsn + seq // 50, seq=seq, after={"id": i, "v": f"v{i}"})
    batch = decode_batch(
        kafka_batch(topic.messages), DecodePlan.build(TOPIC, schema, topic.schemas)
    )
    frame = spark.createDataFrame(pa.Table.from_batches([batch])).repartition(3)
    return frame.withMetadata("after", {KEY_METADATA: json.dumps(["id"])})


@pytest.mark.slow
@pytest.mark.parametrize("scd", [1, 2])
def test_large_batches_of_new_keys_are_written_by_the_executors(
    spark: Any, tmp_path: Path, scd: int
) -> None:
    """A new target, then more new keys, then an update: with the executors writing the
    first two batches (a low ``bulk_rows``) the target (and its history) is the one the
    driver writes."""
    from deltalake import DeltaTable

    from cdcd.spark.bulk import STAGE_PREFIX

    batches = [
        _inserted(spark, range(0, 300), 100),
        _inserted(spark, range(300, 600), 200, op="c"),
        _inserted(spark, range(0, 600, 7), 300, op="u"),
    ]
    targets = {"bulk": str(tmp_path / "bulk"), "driver": str(tmp_path / "driver")}
    for batch_id, frame in enumerate(batches):
        for label, target in targets.items():
            apply_changes(frame, target, stored_as_scd_type=scd,
                          bulk_rows=100 if label == "bulk" else None)  # fmt: skip
        assert _rows(read_mirror(targets["bulk"])) == _rows(read_mirror(targets["driver"]))
        if scd == 2:
            assert _rows(_history(targets["bulk"])) == _rows(_history(targets["driver"]))
        current = targets["bulk"] + ("/_cdcd_current" if scd == 2 else "")
        files = DeltaTable(current).file_uris()
        assert any(f"/{STAGE_PREFIX}{batch_id}-" in f for f in files) == (batch_id < 2)
    assert len(read_mirror(current)) == 600
