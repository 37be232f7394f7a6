"""``read_mirror``: point-in-time reads, and a clean interpreter exit (issues 28, 29).

* ``as_of_lsn`` answers from the history table, ``version`` / ``timestamp``
  by Delta time travel;
* the documented snippet ``from cdcd.spark.mirror import read_mirror`` run
  as its own process (4 times; 20 with ``-m slow``) exits 0 every time (a pyarrow dataset left for
  the interpreter's exit used to abort it with ``terminate called without an
  active exception`` about one run in four).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.errors import ConfigError, DefiniteError  # noqa: E402
from cdcd.spark.mirror import HistoryOptions, lsn_value, read_mirror  # noqa: E402
from spark.handbuilt import Mirror, Topic, column, envelope, key  # noqa: E402

V1 = envelope([key("id"), column("v", "string")])
AT_ONCE = 4


def _ids(table: Any) -> list[tuple[int, str]]:
    return sorted((r["id"], r["v"]) for r in table.to_pylist())


def _build(root: Path, history: bool = True) -> None:
    topic = Topic()
    mirror = Mirror(root, topic)
    mirror.job.history = HistoryOptions(all_tables=history)
    mirror.batch([topic.change(V1, "c", lsn=0x1_0000_0010, after={"id": 1, "v": "a"}),
                  topic.change(V1, "c", lsn=0x1_0000_0010, seq=1, after={"id": 2, "v": "b"})])  # fmt: skip
    mirror.batch([topic.change(V1, "u", lsn=0x1_0000_0020, after={"id": 1, "v": "a2"}),
                  topic.change(V1, "d", lsn=0x1_0000_0030, before={"id": 2, "v": None})])  # fmt: skip


def test_point_in_time_reads(tmp_path: Path) -> None:
    _build(tmp_path)
    uri = str(tmp_path / "public.t")
    assert read_mirror(uri).column_names == ["id", "v"]
    assert _ids(read_mirror(uri)) == [(1, "a2")]
    assert _ids(read_mirror(uri, version=0)) == [(1, "a"), (2, "b")]
    assert _ids(read_mirror(uri, as_of_lsn="1/10")) == [(1, "a"), (2, "b")]
    assert _ids(read_mirror(uri, as_of_lsn=0x1_0000_0025)) == [(1, "a2"), (2, "b")]
    assert _ids(read_mirror(uri, as_of_lsn="1/30")) == [(1, "a2")]
    assert read_mirror(uri, as_of_lsn="1/0").num_rows == 0
    assert read_mirror(uri, as_of_lsn="1/30").column_names == ["id", "v"]
    from deltalake import DeltaTable

    first = DeltaTable(uri).history()[-1]["timestamp"]  # milliseconds since the epoch
    from datetime import UTC, datetime

    at = datetime.fromtimestamp(first / 1000, tz=UTC)
    assert _ids(read_mirror(uri, timestamp=at)) == [(1, "a"), (2, "b")]


def test_as_of_lsn_needs_a_history_and_an_lsn(tmp_path: Path) -> None:
    _build(tmp_path, history=False)
    with pytest.raises(DefiniteError, match="no history table"):
        read_mirror(str(tmp_path / "public.t"), as_of_lsn=1)
    assert lsn_value("0/16B3748") == 0x16B3748 and lsn_value(7) == 7
    with pytest.raises(ConfigError, match="not an LSN"):
        lsn_value("zz/1")


SNIPPET = """
import sys
from cdcd.spark.mirror import read_mirror
print(read_mirror(sys.argv[1]).num_rows)
"""


@pytest.mark.parametrize("runs", [AT_ONCE, pytest.param(20, marks=pytest.mark.slow)])
def test_the_snippet_exits_cleanly_every_time(runs: int, tmp_path: Path) -> None:
    _build(tmp_path, history=False)
    uri = str(tmp_path / "public.t")
    results: list[tuple[int, str, str]] = []
    for start in range(0, runs, AT_ONCE):
        running = [
            subprocess.Popen(
                [sys.executable, "-c", SNIPPET, uri],
                cwd=PROJECT_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(start, min(start + AT_ONCE, runs))
        ]
        for process in running:
            out, err = process.communicate(timeout=300)
            results.append((process.returncode, out.strip(), err[-500:]))
    assert [r for r in results if r[:2] != (0, "1")] == []
