"""The mirror's apply logic and store, on Arrow tables: no Spark, no JVM, no broker.

These run in the default suite (no ``spark`` marker); they need only pyarrow.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.errors import DefiniteError  # noqa: E402
from cdcd.spark.apply import META_LSN, META_SEQ, apply_changes, empty_rows, evolve  # noqa: E402
from cdcd.spark.layout import RowLayout, changes_arrow_schema  # noqa: E402
from cdcd.spark.mirror import MirrorStore, read_mirror  # noqa: E402
from cdcd.spark.tablestate import TableState, table_dir_name  # noqa: E402

ROW = {
    "type": "record",
    "name": "Value",
    "namespace": "pg.public.t",
    "fields": [
        {"name": "id", "type": "int"},
        {
            "name": "amount",
            "type": [
                "null",
                {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
            ],
            "default": None,
        },
        {"name": "doc", "type": ["null", "string"], "default": None},
        {"name": "Odd_name", "cdcd.column": "Odd name", "type": ["null", "long"], "default": None},
    ],
}
LAYOUT = RowLayout.from_row(ROW, ("id",))  # the message key's columns
KEYLESS = RowLayout.from_row(
    {
        "type": "record",
        "name": "Value",
        "fields": [
            {"name": "who", "type": ["null", "string"], "default": None},
            {"name": "n", "type": ["null", "int"], "default": None},
        ],
    }
)


def envelope(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "record",
        "name": "Envelope",
        "namespace": row.get("namespace", "pg.public.t"),
        "fields": [
            {"name": "before", "type": ["null", row], "default": None},
            {"name": "after", "type": ["null", "Value"], "default": None},
        ],
    }


def change(
    op: str,
    lsn: int,
    seq: int = 0,
    *,
    after: dict[str, Any] | None = None,
    before: dict[str, Any] | None = None,
    toast: tuple[str, ...] = (),
    partition: int = 0,
    offset: int = 0,
) -> dict[str, Any]:
    return {
        "topic": "pg.public.t",
        "partition": partition,
        "offset": offset,
        "lsn": lsn,
        "seq": seq,
        "op": op,
        "ts_ms": 0,
        "commit_ts": None,
        "tx_id": 1,
        "snapshot": False,
        "source_db": "db",
        "source_schema": "public",
        "source_table": "t",
        "unchanged_toast": list(toast),
        "before": before,
        "after": after,
    }


def row(
    id: int, amount: str | None = None, doc: str | None = None, odd: int | None = None
) -> dict[str, Any]:
    return {"id": id, "amount": Decimal(amount) if amount else None, "doc": doc, "Odd name": odd}


def changes(records: list[dict[str, Any]], layout: RowLayout = LAYOUT) -> Any:
    return pa.Table.from_pylist(records, schema=changes_arrow_schema(layout))


def contents(result_rows: Any) -> dict[int, dict[str, Any]]:
    return {
        r["id"]: {k: v for k, v in r.items() if not k.startswith("_cdcd")}
        for r in result_rows.to_pylist()
    }


def test_upserts_and_deletes_follow_lsn_order_not_arrival_order() -> None:
    batch = changes(
        [
            change("u", 30, after=row(1, "3.00", "c")),
            change("c", 10, after=row(1, "1.00", "a")),
            change("c", 11, after=row(2, "2.00", "b")),
            change("d", 20, before=row(2)),
            change("u", 25, after=row(1, "2.50", "b")),
        ]
    )
    result = apply_changes(empty_rows(LAYOUT), batch, LAYOUT)
    assert contents(result.rows) == {1: row(1, "3.00", "c")}
    assert result.stats.applied == 5 and result.stats.deleted == 1
    versions = result.rows.select([META_LSN, META_SEQ]).to_pylist()
    assert versions == [{META_LSN: 30, META_SEQ: 0}]


def test_duplicates_in_one_batch_collapse() -> None:
    insert = change("c", 10, after=row(1, "1.00", "a"))
    update = change("u", 11, after=row(1, "2.00", "b"))
    batch = changes([insert, update, {**insert, "offset": 7}, {**update, "offset": 8}])
    result = apply_changes(empty_rows(LAYOUT), batch, LAYOUT)
    assert contents(result.rows) == {1: row(1, "2.00", "b")}
    assert result.stats.duplicates == 2


def test_replayed_changes_in_a_later_batch_change_nothing() -> None:
    """After a daemon crash a partition repeats a stretch; the high-water mark skips it.

    The repeated insert of a deleted row would resurrect it without that rule:
    the row (and so its version) is gone.
    """
    first = changes(
        [
            change("c", 10, after=row(1, "1.00", "a"), partition=1),
            change("d", 12, before=row(1), partition=1),
            change("c", 11, after=row(2, "2.00", "b"), partition=2),
        ]
    )
    one = apply_changes(empty_rows(LAYOUT), first, LAYOUT)
    assert contents(one.rows) == {2: row(2, "2.00", "b")}
    assert one.high_water == {1: (12, 0), 2: (11, 0)}
    replay = changes(
        [
            change("c", 10, after=row(1, "1.00", "a"), partition=1),  # ...and the crash hits here
            change("c", 11, after=row(2, "2.00", "b"), partition=2),
            change("u", 13, after=row(2, "9.00", "z"), partition=2),  # new
        ]
    )
    two = apply_changes(
        one.rows, replay, LAYOUT, truncated_at=one.truncated_at, high_water=one.high_water
    )
    assert contents(two.rows) == {2: row(2, "9.00", "z")}
    assert two.stats.duplicates == 2
    assert two.high_water == {1: (12, 0), 2: (13, 0)}


def test_stale_change_for_a_newer_row_is_ignored() -> None:
    state = apply_changes(
        empty_rows(LAYOUT), changes([change("c", 50, after=row(1, "5.00"))]), LAYOUT
    )
    late = changes([change("u", 40, after=row(1, "4.00"), partition=3)])
    result = apply_changes(state.rows, late, LAYOUT, high_water=state.high_water)
    assert contents(result.rows) == {1: row(1, "5.00")}
    assert result.stats.stale == 1


def test_unchanged_toast_keeps_the_previous_value() -> None:
    state = apply_changes(
        empty_rows(LAYOUT), changes([change("c", 10, after=row(1, "1.00", "x" * 5000))]), LAYOUT
    )
    # In a later batch, and in the same batch as the insert.
    batch = changes(
        [
            change("u", 20, after=row(1, "2.00", None), toast=("doc",)),
            change("c", 21, after=row(2, "1.00", "y" * 3000)),
            change("u", 22, after=row(2, "3.00", None, 7), toast=("doc",)),
            change("u", 23, after=row(3, "3.00", None), toast=("doc",)),  # nothing to keep
        ]
    )
    result = apply_changes(state.rows, batch, LAYOUT, high_water=state.high_water)
    assert contents(result.rows) == {
        1: row(1, "2.00", "x" * 5000),
        2: row(2, "3.00", "y" * 3000, 7),
        3: row(3, "3.00", None),
    }
    assert result.stats.toast_kept == 2 and result.stats.toast_missing == 1


def test_primary_key_change_carries_unchanged_toast_from_the_old_row() -> None:
    """A key change is delete(old) + tombstone + create(new) at seq, seq+1, seq+2."""
    state = apply_changes(
        empty_rows(LAYOUT), changes([change("c", 10, after=row(1, "1.00", "big"))]), LAYOUT
    )
    batch = changes(
        [
            change("d", 20, 4, before=row(1), partition=0),
            change("c", 20, 6, after=row(1001, "1.00", None), toast=("doc",), partition=2),
        ]
    )
    result = apply_changes(state.rows, batch, LAYOUT, high_water=state.high_water)
    assert contents(result.rows) == {1001: row(1001, "1.00", "big")}


def _next(previous: Any, batch: list[dict[str, Any]]) -> Any:
    return apply_changes(
        previous.rows,
        changes(batch),
        LAYOUT,
        truncated_at=previous.truncated_at,
        high_water=previous.high_water,
        pending=previous.pending,
        recent_deletes=previous.recent_deletes,
    )


def test_key_change_split_create_first_is_held_back_until_its_delete() -> None:
    start = apply_changes(
        empty_rows(LAYOUT), changes([change("c", 10, after=row(1, "1.00", "big"))]), LAYOUT
    )
    # The create (new key's partition) arrives one batch before the delete, and
    # a later update of the new key arrives with it.
    one = _next(
        start,
        [
            change("c", 20, 6, after=row(1001, "1.00", None), toast=("doc",), partition=2),
            change("u", 21, 0, after=row(1001, "7.00", None), toast=("doc",), partition=2),
        ],
    )
    assert contents(one.rows) == {1: row(1, "1.00", "big")}  # nothing half-applied
    assert one.pending is not None and one.pending.num_rows == 2
    two = _next(one, [change("d", 20, 4, before=row(1), partition=0)])
    assert contents(two.rows) == {1001: row(1001, "7.00", "big")}
    assert two.pending is None


def test_key_change_split_delete_first_uses_recent_deletes() -> None:
    start = apply_changes(
        empty_rows(LAYOUT), changes([change("c", 10, after=row(1, "1.00", "big"))]), LAYOUT
    )
    one = _next(start, [change("d", 20, 4, before=row(1), partition=0)])
    assert contents(one.rows) == {}
    two = _next(
        one, [change("c", 20, 6, after=row(1001, "1.00", None), toast=("doc",), partition=2)]
    )
    assert contents(two.rows) == {1001: row(1001, "1.00", "big")}
    # A deleted row stays available to the next two batches, then it is dropped.
    assert two.recent_deletes is not None
    three = _next(two, [change("c", 30, after=row(5))])
    assert three.recent_deletes is None


def test_held_back_create_is_applied_without_its_partner_eventually() -> None:
    result = apply_changes(
        empty_rows(LAYOUT),
        changes([change("c", 20, 6, after=row(1001, "1.00", None), toast=("doc",))]),
        LAYOUT,
    )
    for _ in range(3):
        assert contents(result.rows) == {}
        result = _next(result, [])
    assert contents(result.rows) == {1001: row(1001, "1.00", None)}
    assert result.stats.toast_missing == 1 and result.pending is None


def test_truncate_removes_older_rows_only() -> None:
    state = apply_changes(
        empty_rows(LAYOUT),
        changes([change("c", 10, after=row(1)), change("c", 11, after=row(2))]),
        LAYOUT,
    )
    batch = changes(
        [
            change("c", 30, after=row(3, "3.00")),  # committed after the truncate
            change("t", 20, 0, partition=1),
            change("c", 20, 1, after=row(4, "4.00")),  # same transaction, after it
            change("u", 15, after=row(2, "2.50"), partition=2),  # before it: gone too
        ]
    )
    result = apply_changes(state.rows, batch, LAYOUT, high_water=state.high_water)
    assert contents(result.rows) == {3: row(3, "3.00"), 4: row(4, "4.00")}
    assert result.truncated_at == (20, 0)

    # A truncate older than the rows (it arrives late from another partition)
    # and changes older than the last truncate change nothing.
    late = changes([change("t", 5, 0, partition=2), change("c", 19, after=row(9), partition=2)])
    again = apply_changes(
        result.rows, late, LAYOUT, truncated_at=result.truncated_at, high_water=result.high_water
    )
    assert contents(again.rows) == contents(result.rows)
    assert again.truncated_at == (20, 0)


def test_truncate_applied_twice_is_harmless() -> None:
    batch = changes([change("c", 10, after=row(1)), change("t", 11), change("c", 12, after=row(2))])
    once = apply_changes(empty_rows(LAYOUT), batch, LAYOUT)
    twice = apply_changes(
        once.rows,
        changes([change("t", 11)]),
        LAYOUT,
        truncated_at=once.truncated_at,
        high_water=once.high_water,
    )
    assert contents(once.rows) == contents(twice.rows) == {2: row(2)}


def test_evolve_adds_drops_and_converts_columns() -> None:
    old = RowLayout.from_row(
        {
            "type": "record",
            "name": "Value",
            "fields": [
                {"name": "id", "type": "int"},
                {"name": "gone", "type": ["null", "string"], "default": None},
                {
                    "name": "Odd_name",
                    "cdcd.column": "Odd name",
                    "type": ["null", "int"],
                    "default": None,
                },
            ],
        }
    )
    rows = apply_changes(
        empty_rows(old),
        changes([change("c", 1, after={"id": 1, "gone": "x", "Odd name": 5})], old),
        old,
    ).rows
    evolved = evolve(rows, LAYOUT)
    assert evolved.column_names == ["id", "amount", "doc", "Odd name", META_LSN, META_SEQ]
    assert evolved.schema.field("Odd name").type == pa.int64()
    assert contents(evolved) == {1: row(1, None, None, 5)}


def test_evolve_refuses_an_inexact_conversion() -> None:
    text = pa.table({"id": pa.array([1], pa.int32()), "amount": ["not a number"], "doc": [None],
                     "Odd name": pa.array([None], pa.int64()), META_LSN: [1], META_SEQ: [0]})  # fmt: skip
    with pytest.raises(DefiniteError, match="amount"):
        evolve(text, LAYOUT, "public.t")


def test_keyless_table_matches_whole_rows() -> None:
    batch = changes(
        [
            change("c", 1, after={"who": "a", "n": 1}, partition=0),
            change("c", 2, after={"who": "a", "n": 1}, partition=1),  # an identical row
            change("c", 3, after={"who": "b", "n": 2}, partition=2),
            change("u", 4, before={"who": "a", "n": 1}, after={"who": "a", "n": 5}, partition=0),
            change("d", 5, before={"who": "b", "n": 2}, partition=1),
        ],
        KEYLESS,
    )
    result = apply_changes(empty_rows(KEYLESS), batch, KEYLESS)
    got = sorted((r["who"], r["n"]) for r in result.rows.to_pylist())
    assert got == [("a", 1), ("a", 5)]
    # An exact repeat of an insert is recognised by its version.
    again = apply_changes(
        result.rows, changes([change("c", 2, after={"who": "a", "n": 1})], KEYLESS), KEYLESS
    )
    assert again.rows.num_rows == 2 and again.stats.duplicates == 1


def test_unknown_operation_is_an_error() -> None:
    with pytest.raises(DefiniteError, match="unknown change operation"):
        apply_changes(empty_rows(LAYOUT), changes([change("x", 1, after=row(1))]), LAYOUT)


# ----------------------------------------------------------------------------- the store


def state_for(layout_row: dict[str, Any] = ROW) -> TableState:
    return TableState(
        topic="pg.public.t",
        schema="public",
        table="t",
        envelope=envelope(layout_row),
        schema_version=(1, 0),
        key=("id",),
    )


def _store_batch(store: MirrorStore, batch_id: int, records: list[dict[str, Any]]) -> Any:
    from cdcd.spark.decode import NativeChanges
    from cdcd.spark.mirror import MirrorJob

    catalog: Any = None
    native = NativeChanges(
        "pg.public.t", b"h", LAYOUT.shape, changes(records), tuple(range(len(records))), ("id",)
    )
    job = MirrorJob(store, catalog)
    job.catalog = type("Catalog", (), {"schema": staticmethod(lambda header: envelope(ROW))})()
    return job.apply(batch_id, {"pg.public.t": [native]})


def test_store_merges_batches_into_a_delta_table(tmp_path: Path) -> None:
    from deltalake import DeltaTable

    store = MirrorStore(tmp_path)
    store.open()
    _store_batch(store, 0, [change("c", 1, after=row(1, "1.00", "a")),
                            change("c", 1, 1, after=row(2, "1.00", "x"))])  # fmt: skip
    _store_batch(store, 1, [change("u", 2, after=row(1, "2.00", "b")), change("d", 3,
                            before=row(2))])  # fmt: skip
    table = read_mirror(str(tmp_path / "public.t"))
    assert table.column_names == ["id", "amount", "doc", "Odd name"]  # versions left out
    assert table.to_pylist() == [row(1, "2.00", "b")]
    delta = DeltaTable(str(tmp_path / "public.t"))
    assert delta.to_pyarrow_table().column_names[-2:] == ["_cdcd_lsn", "_cdcd_seq"]
    assert [h["operation"] for h in delta.history()] == ["MERGE", "WRITE"]
    assert delta.transaction_version("cdcd-mirror") == 1

    # A batch replayed under the same app id is recognised and skipped.
    reopened = MirrorStore(tmp_path)
    reopened.open()
    report = _store_batch(reopened, 1, [change("c", 9, after=row(9))])
    assert report.skipped and read_mirror(str(tmp_path / "public.t")).num_rows == 1
    assert reopened.tables["pg.public.t"].state.truncated_at is None


def test_state_travels_in_the_commit_metadata(tmp_path: Path) -> None:
    from deltalake import DeltaTable

    store = MirrorStore(tmp_path)
    store.open()
    _store_batch(store, 4, [change("c", 9, 3, after=row(1), partition=2), change("t", 8)])
    newest = DeltaTable(str(tmp_path / "public.t")).history(1)[0]
    document = json.loads(newest["cdcd.mirror"])
    assert document["batch"] == 4
    entry = document["state"]
    assert entry["truncated_at"] == [8, 0] and entry["high_water"] == {"2": [9, 3]}
    assert read_mirror(str(tmp_path / "public.t")).to_pylist() == [row(1)]


def test_store_refuses_a_delta_table_it_did_not_write(tmp_path: Path) -> None:
    from deltalake import write_deltalake

    write_deltalake(str(tmp_path / "public.t"), pa.table({"id": [1]}))
    store = MirrorStore(tmp_path)
    with pytest.raises(DefiniteError, match="did not write"):
        store.open()


@pytest.mark.parametrize(
    ("schema", "table", "expected"),
    [
        ("public", "orders", "public.orders"),
        ("we/ird", "100%", "we%2Fird.100%25"),
        (".hidden", "t.x", "%2Ehidden.t.x"),
    ],
)
def test_table_dir_names(schema: str, table: str, expected: str) -> None:
    assert table_dir_name(schema, table) == expected


def test_optimize_and_vacuum_keep_the_rows_and_the_state(tmp_path: Path) -> None:
    from deltalake import DeltaTable

    uri = f"file://{tmp_path}"  # the URI path of the store, as for object storage
    store = MirrorStore(uri)
    store.open()
    for batch in range(4):
        _store_batch(store, batch, [change("c", 10 + batch, after=row(batch, doc=f"d{batch}"))])
    table = DeltaTable(str(tmp_path / "public.t"))
    files = len(table.file_uris())
    assert files == 4
    metrics = store.optimize()
    assert metrics["public.t"]["numFilesRemoved"] == 4
    removed = store.vacuum(retention_hours=0)
    assert removed["public.t"] == 4
    table = DeltaTable(str(tmp_path / "public.t"))
    assert len(table.file_uris()) == 1
    assert sorted(r["id"] for r in read_mirror(str(tmp_path / "public.t")).to_pylist()) == [
        0,
        1,
        2,
        3,
    ]
    # The mirror state survives commits that are not its own MERGEs.
    reopened = MirrorStore(uri)
    reopened.open()
    assert reopened.tables["pg.public.t"].applied_batch == 3
    _store_batch(reopened, 4, [change("d", 20, before=row(0))])
    assert sorted(r["id"] for r in read_mirror(str(tmp_path / "public.t")).to_pylist()) == [1, 2, 3]


def test_a_held_back_create_alone_in_its_batch_is_kept_in_the_table_state(tmp_path: Path) -> None:
    # The create of a key change arrives a batch before its delete, and alone:
    # the batch changes no row, yet its held-back create must be committed.
    from deltalake import DeltaTable

    store = MirrorStore(tmp_path)
    store.open()
    _store_batch(store, 0, [change("c", 1, after=row(1, "1.00", "big doc"))])
    report = _store_batch(
        store, 1, [change("c", 5, 2, after=row(2, "1.00", None), toast=("doc",), partition=1)]
    )
    assert report.tables["public.t"].held_back == 1
    assert DeltaTable(str(tmp_path / "public.t")).transaction_version("cdcd-mirror") == 1
    reopened = MirrorStore(tmp_path)  # the pending create comes from the table, not memory
    reopened.open()
    _store_batch(reopened, 2, [change("d", 5, 0, before=row(1))])
    assert read_mirror(str(tmp_path / "public.t")).to_pylist() == [row(2, "1.00", "big doc")]


def test_merge_bounds_the_target_by_the_batchs_key_range() -> None:
    """delta-rs prunes files only by a target condition: integer and text keys get one, quoted."""
    import pyarrow as pa

    from cdcd.spark.deltaio import range_condition as _range_condition

    assert _range_condition("t", "id", pa.array([7, 3, 12])) == 't."id" >= 3 AND t."id" <= 12'
    assert (
        _range_condition("t", "code", pa.chunked_array([["b'x", "a"]]))
        == "t.\"code\" >= 'a' AND t.\"code\" <= 'b''x'"
    )
    assert _range_condition("t", "flag", pa.array([True, False])) is None
    assert _range_condition("t", "at", pa.array([1.5])) is None
