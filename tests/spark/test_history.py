"""History tables (SCD type 2) batch by batch, without Spark (issue 28).

Messages encoded with hand-built writer schemas (:mod:`spark.handbuilt`)
are applied by :class:`cdcd.spark.mirror.MirrorJob` with history on; each
test reads the history table back with deltalake and checks the versions
valid at each commit LSN (:func:`cdcd.spark.history.valid_at`) or the
versions themselves. The randomized comparison with PostgreSQL is
``test_history_e2e.py``; crashes are ``test_history_crash.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.spark.history import valid_at  # noqa: E402
from cdcd.spark.mirror import HistoryOptions  # noqa: E402
from spark.handbuilt import Mirror, Topic, column, envelope, key  # noqa: E402

V1 = envelope([key("id"), column("v", "string"), column("seen", "int")])


def _mirror(root: Path, topic: Topic, **options: Any) -> Mirror:
    mirror = Mirror(root, topic)
    mirror.job.history = HistoryOptions(all_tables=True, **options)
    return mirror


def _history(root: Path) -> Any:
    from deltalake import DeltaTable

    return DeltaTable(str(root / "public.t" / "_history")).to_pyarrow_table()


def _at(root: Path, lsn: int) -> list[tuple[Any, ...]]:
    return sorted((r["id"], r["v"]) for r in valid_at(_history(root), lsn).to_pylist())


def _versions(root: Path, id: int) -> list[tuple[Any, ...]]:
    rows = [r for r in _history(root).to_pylist() if r["id"] == id]
    return sorted((r["__start_lsn"], r["__end_lsn"], r["v"], r["seen"], r["__op"]) for r in rows)


def row(id: int, v: str | None, seen: int | None = None) -> dict[str, Any]:
    return {"id": id, "v": v, "seen": seen}


def test_versions_follow_commits_deletes_truncates_and_key_changes(tmp_path: Path) -> None:
    topic = Topic()
    mirror = _mirror(tmp_path, topic)
    mirror.batch([topic.change(V1, "c", lsn=10, after=row(1, "a")),
                  topic.change(V1, "c", lsn=10, seq=1, after=row(2, "b")),
                  topic.change(V1, "u", lsn=20, after=row(1, "a1")),
                  # twice in one transaction: one version, the state at its commit
                  topic.change(V1, "u", lsn=30, after=row(2, "b1")),
                  topic.change(V1, "u", lsn=30, seq=1, after=row(2, "b2"))])  # fmt: skip
    mirror.batch([topic.change(V1, "d", lsn=40, before=row(1, None)),
                  # a key change: 2 -> 3
                  topic.change(V1, "d", lsn=50, before=row(2, None)),
                  topic.change(V1, "c", lsn=50, seq=2, after=row(3, "b2")),
                  # born and gone in one transaction: no version
                  topic.change(V1, "c", lsn=55, after=row(9, "x")),
                  topic.change(V1, "d", lsn=55, seq=1, before=row(9, None)),
                  topic.change(V1, "t", lsn=60, partition=2),
                  topic.change(V1, "c", lsn=70, after=row(4, "d"))])  # fmt: skip
    assert _at(tmp_path, 10) == [(1, "a"), (2, "b")]
    assert _at(tmp_path, 20) == [(1, "a1"), (2, "b")]
    assert _at(tmp_path, 30) == _at(tmp_path, 35) == [(1, "a1"), (2, "b2")]
    assert _at(tmp_path, 40) == [(2, "b2")]
    assert _at(tmp_path, 50) == _at(tmp_path, 55) == [(3, "b2")]
    assert _at(tmp_path, 60) == []
    assert _at(tmp_path, 70) == [(4, "d")]
    assert _versions(tmp_path, 9) == []
    assert _versions(tmp_path, 2) == [(10, 30, "b", None, "c"), (30, 50, "b2", None, "u")]
    current = [r for r in _history(tmp_path).to_pylist() if r["__is_current"]]
    assert [(r["id"], r["__end_lsn"], r["__end_at"]) for r in current] == [(4, None, None)]


def test_an_unchanged_resnapshot_row_starts_no_version(tmp_path: Path) -> None:
    topic = Topic()
    mirror = _mirror(tmp_path, topic)
    mirror.batch([topic.change(V1, "c", lsn=10, after=row(1, "a", 1))])
    mirror.batch([topic.change(V1, "r", lsn=20, after=row(1, "a", 1)),
                  topic.change(V1, "r", lsn=20, seq=1, after=row(2, "new", 1))])  # fmt: skip
    mirror.batch([topic.change(V1, "r", lsn=30, after=row(1, "changed", 1)),
                  topic.change(V1, "u", lsn=40, after=row(2, "u", 2))])  # fmt: skip
    assert _versions(tmp_path, 1) == [(10, 30, "a", 1, "c"), (30, None, "changed", 1, "r")]
    assert _versions(tmp_path, 2) == [(20, 40, "new", 1, "r"), (40, None, "u", 2, "u")]


def test_changes_to_untracked_columns_update_the_current_version(tmp_path: Path) -> None:
    topic = Topic()
    mirror = _mirror(tmp_path, topic, tracked=(("public.t", ("v",)),))
    mirror.batch([topic.change(V1, "c", lsn=10, after=row(1, "a", 1)),
                  topic.change(V1, "u", lsn=20, after=row(1, "a", 2))])  # fmt: skip
    mirror.batch([topic.change(V1, "u", lsn=30, after=row(1, "a", 3))])
    mirror.batch([topic.change(V1, "u", lsn=40, after=row(1, "b", 4)),
                  topic.change(V1, "u", lsn=50, after=row(1, "b", 5))])  # fmt: skip
    assert _versions(tmp_path, 1) == [(10, 40, "a", 3, "c"), (40, None, "b", 5, "u")]


def test_history_starts_from_a_mirror_built_without_it(tmp_path: Path) -> None:
    topic = Topic()
    Mirror(tmp_path, topic).batch([topic.change(V1, "c", lsn=10, after=row(1, "a")),
                                   topic.change(V1, "c", lsn=11, after=row(2, "b"))])  # fmt: skip
    mirror = _mirror(tmp_path, topic)
    mirror.batch_id = 0
    mirror.batch([topic.change(V1, "u", lsn=20, after=row(1, "a1"))])
    assert _at(tmp_path, 15) == [(1, "a"), (2, "b")]
    assert _at(tmp_path, 20) == [(1, "a1"), (2, "b")]


def test_history_follows_the_tables_columns(tmp_path: Path) -> None:
    # RENAME COLUMN v TO w; ADD COLUMN extra: older versions keep their values under w.
    v2 = envelope([key("id"), column("w", "string", aliases=["v"]), column("seen", "int"),
                   column("extra", "string")])  # fmt: skip
    topic = Topic()
    mirror = _mirror(tmp_path, topic)
    mirror.batch([topic.change(V1, "c", lsn=10, after=row(1, "a"))])
    mirror.batch([topic.change(v2, "u", lsn=20, after={"id": 1, "w": "b", "seen": None,
                                                        "extra": "e"})])  # fmt: skip
    history = _history(tmp_path)
    assert history.column_names[:4] == ["id", "w", "seen", "extra"]
    versions = sorted((r["__start_lsn"], r["w"], r["extra"]) for r in history.to_pylist())
    assert versions == [(10, "a", None), (20, "b", "e")]


def test_optimize_and_vacuum_keep_the_history(tmp_path: Path) -> None:
    from cdcd.spark.mirror import MirrorStore

    topic = Topic()
    mirror = _mirror(tmp_path, topic)
    for lsn in (10, 20, 30):
        mirror.batch([topic.change(V1, "c" if lsn == 10 else "u", lsn=lsn, after=row(1, f"v{lsn}"))])
    store = MirrorStore(tmp_path)
    store.open()
    store.optimize()
    assert store.vacuum(retention_hours=0)["public.t"] > 0
    assert [_at(tmp_path, lsn) for lsn in (10, 20, 30)] == [[(1, "v10")], [(1, "v20")], [(1, "v30")]]
    history_files = list((tmp_path / "public.t" / "_history").glob("*.parquet"))
    assert len(history_files) == 1  # compacted, the rest vacuumed
    mirror = _mirror(tmp_path, topic)  # the history state survives commits not its own
    mirror.batch_id = 2
    mirror.batch([topic.change(V1, "d", lsn=40, before=row(1, None))])
    assert _at(tmp_path, 40) == [] and _at(tmp_path, 30) == [(1, "v30")]
