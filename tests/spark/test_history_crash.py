"""``kill -9`` of the mirror between and during the commits of a history table (issue 28).

A batch with history makes two commits, the history table's first and then
the table's; each carries the batch's Delta transaction id, so a batch
replayed after a crash skips the commits it finds done. A child process
applies a seeded history (inserts, updates, deletes, key changes and a
truncate over five batches, without Spark: :class:`spark.handbuilt.Mirror`)
and SIGKILLs itself at a fault point of batch 2 (``cdcd.spark.faults.FAULT``, set in the child):
before the history commit, with a history data file written but not
committed, after the history commit (before the table's), and after the
table's commit (before the batch counts as done). A second run replays
every batch. The history table must then hold exactly the versions of a
run without a crash: none missing, none twice -- and the table the same
rows.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.spark.mirror import HistoryOptions, read_mirror  # noqa: E402
from spark.envelopes import Message  # noqa: E402
from spark.handbuilt import Mirror, Topic, column, envelope, key  # noqa: E402

SCHEMA = envelope([key("id"), column("doc", "string"), column("n", "int")])
ROWS = 3000
WIDE = "y" * 400  # wide rows: a MERGE's data file takes a while to write


def history_batches(seed: int = 28) -> tuple[Topic, list[list[Message]]]:
    """Five batches of changes to ``public.t``; the same for a given seed."""
    rng = random.Random(seed)
    topic = Topic()
    batches = [
        [topic.change(SCHEMA, "c", lsn=100, seq=i, after={"id": i, "doc": WIDE, "n": i},
                      partition=i % 3) for i in range(ROWS)]
    ]  # fmt: skip
    live = set(range(ROWS))
    next_id = ROWS
    lsn = 100
    for number in range(1, 5):
        batch: list[Message] = []
        for _ in range(40):
            lsn += 10
            roll = rng.random()
            if number == 3 and roll < 0.03:
                batch.append(topic.change(SCHEMA, "t", lsn=lsn, partition=rng.randrange(3)))
                live.clear()
                continue
            target = rng.choice(sorted(live)) if live else None
            if target is None or roll < 0.3:
                after = {"id": next_id, "doc": f"new {lsn}", "n": lsn}
                batch.append(topic.change(SCHEMA, "c", lsn=lsn, after=after, partition=next_id % 3))
                live.add(next_id)
                next_id += 1
            elif roll < 0.7:
                after = {"id": target, "doc": f"u {lsn}", "n": -lsn}
                batch.append(topic.change(SCHEMA, "u", lsn=lsn, after=after, partition=target % 3))
            elif roll < 0.85:
                before = {"id": target, "doc": None, "n": None}
                batch.append(topic.change(SCHEMA, "d", lsn=lsn, before=before, partition=target % 3))
                live.discard(target)
            else:  # a key change: delete of the old key, create of the new one
                before = {"id": target, "doc": None, "n": None}
                after = {"id": next_id, "doc": f"k {lsn}", "n": 0}
                batch.append(topic.change(SCHEMA, "d", lsn=lsn, before=before, partition=target % 3))
                batch.append(topic.change(SCHEMA, "c", lsn=lsn, seq=2, after=after,
                                          partition=next_id % 3))  # fmt: skip
                live.discard(target)
                live.add(next_id)
                next_id += 1
        batches.append(batch)
    return topic, batches


def apply_all(root: Path) -> None:
    """Apply every batch (those already committed are skipped by their transaction ids)."""
    topic, batches = history_batches()
    mirror = Mirror(root, topic)
    mirror.job.history = HistoryOptions(all_tables=True)
    for batch in batches:
        mirror.batch(batch)


_CHILD = """
import sys
sys.path.insert(0, "tests")
from pathlib import Path
import cdcd.spark.faults
from spark.test_history_crash import apply_all
cdcd.spark.faults.FAULT = sys.argv[2]
apply_all(Path(sys.argv[1]))
"""


def _run_child(root: Path, fault: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), fault or ""],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _versions(root: Path) -> list[tuple[Any, ...]]:
    from deltalake import DeltaTable

    table = DeltaTable(str(root / "public.t" / "_history")).to_pyarrow_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    root = tmp_path_factory.mktemp("reference")
    apply_all(root)
    rows = sorted(tuple(r.values()) for r in read_mirror(str(root / "public.t")).to_pylist())
    return _versions(root), rows


@pytest.mark.parametrize(
    "fault",
    ["before-history:2", "in-history:2", "after-history:2", "after-merge:2"],
)
def test_kill_9_leaves_no_duplicate_and_no_missing_version(
    fault: str, reference: tuple[list[Any], list[Any]], tmp_path: Path
) -> None:
    killed = _run_child(tmp_path, fault)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert f"SIGKILL {'with' if fault.startswith('in-') else ''}" in killed.stderr
    again = _run_child(tmp_path, None)
    assert again.returncode == 0, again.stderr[-3000:]
    versions, rows = reference
    assert _versions(tmp_path) == versions
    current = sorted(tuple(r.values()) for r in read_mirror(str(tmp_path / "public.t")).to_pylist())
    assert current == rows
