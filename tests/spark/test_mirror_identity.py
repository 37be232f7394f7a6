"""The mirror's identity comes from the message key, and columns whose type changed decode (issue 30).

No Spark, no broker: messages are encoded with hand-built writer schemas
(:mod:`spark.handbuilt`) and applied by :class:`cdcd.spark.mirror.MirrorJob`
to a real output directory. The row schemas here keep a column nullable
after it joined the key, as cdcd publishes them (older records must still
resolve): only the message key says which columns identify a row.

``tests/spark/test_mirror_rekey_e2e.py`` runs the same migrations through
PostgreSQL, the daemon and ``cdcd mirror --once``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.spark.decode import DecodePlan, decode_batch  # noqa: E402
from cdcd.spark.mirror import read_mirror  # noqa: E402
from spark.envelopes import Message, kafka_batch  # noqa: E402
from spark.handbuilt import TOPIC, Mirror, Topic, column, envelope  # noqa: E402

#: ``id`` nullable in every version, as after a key was added to a keyless table.
ROW = envelope([column("id", "int"), column("code", "string"), column("v", "string")])


def _table(root: Path) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in read_mirror(str(root / "public.t")).to_pylist())


def _history(topic: Topic) -> list[list[Message]]:
    """Keyless (FULL) -> primary key (id) -> key grows to (id, code) -> dropped again."""
    full: dict[str, Any] = {"key_columns": ()}
    by_id: dict[str, Any] = {"key_columns": ("id",)}
    grown: dict[str, Any] = {"key_columns": ("id", "code")}

    def row(id: int, code: str, v: str) -> dict[str, Any]:
        return {"id": id, "code": code, "v": v}

    keyless = [
        topic.change(ROW, "c", lsn=10, after=row(1, "a", "one"), **full),
        topic.change(ROW, "c", lsn=11, after=row(2, "b", "two"), **full),
        topic.change(ROW, "c", lsn=12, after=row(3, "c", "three"), **full),
        topic.change(ROW, "c", lsn=13, after=row(3, "c", "three"), partition=1, **full),
        topic.change(ROW, "u", lsn=14, before=row(2, "b", "two"), after=row(2, "b", "2"), **full),
        topic.change(ROW, "d", lsn=15, before=row(3, "c", "three"), partition=2, **full),
        topic.change(ROW, "d", lsn=16, before=row(3, "c", "three"), **full),
    ]
    # ALTER TABLE t ADD PRIMARY KEY (id): updates carry no old image, deletes only the key.
    keyed = [
        topic.change(ROW, "u", lsn=20, after=row(2, "b", "2 again"), **by_id),
        topic.change(ROW, "c", lsn=21, after=row(4, "d", "four"), **by_id),
        topic.change(ROW, "d", lsn=22, before={"id": 1, "code": None, "v": None}, **by_id),
        topic.change(ROW, "u", lsn=23, after=row(4, "e", "code changed"), **by_id),
    ]
    # DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (id, code)
    grown_changes = [
        topic.change(ROW, "c", lsn=30, after=row(4, "f", "same id"), **grown),
        topic.change(ROW, "u", lsn=31, after=row(4, "e", "by both"), **grown),
        topic.change(ROW, "d", lsn=32, before={"id": 2, "code": "b", "v": None}, **grown),
    ]
    # REPLICA IDENTITY FULL; DROP CONSTRAINT t_pkey
    dropped = [
        topic.change(ROW, "c", lsn=40, after=row(4, "e", "by both"), **full),
        topic.change(
            ROW, "u", lsn=41, before=row(4, "f", "same id"), after=row(5, "f", "moved"), **full
        ),
        topic.change(ROW, "d", lsn=42, before=row(4, "e", "by both"), **full),
    ]
    return [keyless, keyed, grown_changes, dropped]


EXPECTED = [
    [(1, "a", "one"), (2, "b", "2")],
    [(2, "b", "2 again"), (4, "e", "code changed")],
    [(4, "e", "by both"), (4, "f", "same id")],
    [(4, "e", "by both"), (5, "f", "moved")],
]


def test_a_table_is_rekeyed_batch_by_batch(tmp_path: Path) -> None:
    topic = Topic()
    mirror = Mirror(tmp_path, topic)
    for step, (messages, expected) in enumerate(zip(_history(topic), EXPECTED, strict=True)):
        report = mirror.batch(messages)
        assert _table(tmp_path) == expected, f"step {step}"
        assert report.tables["public.t"].unmatched == 0, f"step {step}"
    keys = [m.state.key for m in mirror.store.tables.values()]
    assert keys == [()]


def test_one_batch_holds_changes_written_under_every_key(tmp_path: Path) -> None:
    topic = Topic()
    messages = [m for batch in _history(topic) for m in batch]
    mirror = Mirror(tmp_path, topic)
    report = mirror.batch(messages)
    assert _table(tmp_path) == EXPECTED[-1]
    assert report.tables["public.t"].unmatched == 0


def test_changes_that_match_no_row_are_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topic = Topic()
    mirror = Mirror(tmp_path, topic)
    mirror.batch([topic.change(ROW, "c", lsn=10, after={"id": 1, "code": "a", "v": "x"},
                               key_columns=("id",))])  # fmt: skip
    caplog.set_level(logging.WARNING, logger="cdcd.spark")
    report = mirror.batch(
        [
            topic.change(ROW, "u", lsn=11, after={"id": 7, "code": "g", "v": "y"}, key_columns=("id",)),
            topic.change(ROW, "d", lsn=12, before={"id": 8, "code": None, "v": None}, key_columns=("id",)),
        ]
    )  # fmt: skip
    assert report.tables["public.t"].unmatched == 2
    (warning,) = [r.getMessage() for r in caplog.records if "matched no row" in r.getMessage()]
    assert "public.t" in warning and "2 update(s) or delete(s)" in warning


# ----------------------------------------------------------------------------- several types


def test_a_column_whose_type_changed_decodes_to_its_current_type() -> None:
    # ALTER COLUMN n TYPE bigint USING ..., then TYPE numeric-as-text: the field
    # lists the current type first and every earlier one after it.
    v1 = envelope([column("id", "int"), column("n", "int"), column("tags", {"type": "array", "items": ["null", "int"]})])  # fmt: skip
    v2 = envelope(
        [
            column("id", "int"),
            {"name": "n", "type": ["null", "long", "int"], "default": None},
            {"name": "tags", "type": ["null", {"type": "array", "items": ["null", "long", "int"]}],
             "default": None},
        ]
    )  # fmt: skip
    topic = Topic()
    topic.change(v1, "c", lsn=10, after={"id": 1, "n": 5, "tags": [1, None]})
    topic.change(v2, "c", lsn=11, after={"id": 2, "n": 2**40, "tags": [2**40, None, 3]})
    topic.change(v2, "c", lsn=12, after={"id": 3, "n": None, "tags": None})
    plan = DecodePlan.build(TOPIC, v2, topic.schemas)
    rows = [r["after"] for r in decode_batch(kafka_batch(topic.messages), plan).to_pylist()]
    assert rows == [
        {"id": 1, "n": 5, "tags": [1, None]},
        {"id": 2, "n": 2**40, "tags": [2**40, None, 3]},
        {"id": 3, "n": None, "tags": None},
    ]


def test_values_written_in_an_older_branch_are_converted() -> None:
    # A writer may put a value in any branch of the union (a replay, another
    # producer): each branch is decoded in its own type, then converted exactly.
    schema = envelope(
        [
            column("id", "int"),
            {"name": "n", "type": ["null", "long", "string"], "default": None},
            {"name": "xs", "type": ["null", {"type": "array", "items": ["null", "long", "string"]}],
             "default": None},
        ]
    )  # fmt: skip
    topic = Topic()
    topic.change(schema, "c", lsn=10, after={"id": 1, "n": "12", "xs": ["7", 8, None]})
    topic.change(schema, "c", lsn=11, after={"id": 2, "n": 13, "xs": []})
    topic.change(schema, "c", lsn=12, after={"id": 3, "n": None, "xs": None})
    plan = DecodePlan.build(TOPIC, schema, topic.schemas)
    batch = decode_batch(kafka_batch(topic.messages), plan)
    assert batch.schema.field("after").type.field("n").type == pa.int64()
    assert [r["after"] for r in batch.to_pylist()] == [
        {"id": 1, "n": 12, "xs": [7, 8, None]},
        {"id": 2, "n": 13, "xs": []},
        {"id": 3, "n": None, "xs": None},
    ]


def test_an_older_value_that_does_not_convert_exactly_is_an_error_naming_the_column() -> None:
    from cdcd.errors import DefiniteError

    schema = envelope(
        [column("id", "int"), {"name": "n", "type": ["null", "long", "string"], "default": None}]
    )
    topic = Topic()
    topic.change(schema, "c", lsn=10, after={"id": 1, "n": "twelve"})
    plan = DecodePlan.build(TOPIC, schema, topic.schemas)
    with pytest.raises(DefiniteError, match="column 'n'.*string.*long"):
        decode_batch(kafka_batch(topic.messages), plan)
