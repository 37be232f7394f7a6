"""Large batches of new rows are written by the executors, and the mirror is the same (issue 28).

A batch that brings a table at least ``bulk_rows`` inserts and snapshot reads
of keys it does not hold is not collected: each Spark task writes its share
as data files in the table's directory (and its history table's), the
driver commits their add actions (:mod:`cdcd.spark.bulk`). The same batches,
encoded by the daemon's own encoder, go through a real ``local[2]`` session
into two mirrors, one with the executor path forced (a low threshold) and one
with every batch collected (``bulk_rows=None``), without and with history
tables:

0. a snapshot and inserts of ``big`` (a column added halfway), a few rows of
   ``small``: the new table is written by the executors;
1. a later batch of the build: new keys only, to the existing table: appended
   by the executors;
2. new keys and the re-snapshot of one stored key: a task finds the key
   stored, so the driver applies the batch (nothing of the executors' files
   is committed);
3. updates, deletes and inserts: the driver.

After each batch the tables, their history tables, their Delta schemas and
the mirror's recorded state must be equal, the files must come from where
the batch says, and a replayed batch must be skipped.

``kill -9`` of the driver after the executors wrote the files and before the
commit (fault point ``in-files``), and between the history table's commit and
the table's (``after-history``), in a child process (the executors are
played by :class:`ArrowFrame` there, no JVM): nothing uncommitted is visible
to readers, and the restart applies the batch exactly once -- the orphaned
files are referenced by no version.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pyspark")

from cdcd.consumer import SchemaCatalog, fingerprint_header  # noqa: E402
from cdcd.spark.bulk import STAGE_PREFIX  # noqa: E402
from cdcd.spark.history_store import HISTORY_DIR  # noqa: E402
from cdcd.spark.mirror import HistoryOptions, MirrorJob, MirrorStore, read_mirror  # noqa: E402
from spark.envelopes import Col, EnvelopeFactory, Message, kafka_batch  # noqa: E402
from spark.envelopes import table_version as make_table  # noqa: E402

BIG = make_table("public", "big", [Col("id", 20, key=True), Col("name", 25)])
BIG_WIDER = make_table(
    "public", "big", [Col("id", 20, key=True), Col("name", 25), Col("n", 23)], version=2
)
SMALL = make_table("public", "small", [Col("id", 23, key=True), Col("v", 25)], relation_id=16_385)
ROWS = 1_200
THRESHOLD = 500


def build_batches() -> tuple[EnvelopeFactory, list[list[Message]]]:
    """The batches of the module docstring."""
    factory = EnvelopeFactory()
    batches: list[list[Message]] = []

    def cut() -> None:
        done = sum(len(b) for b in batches)
        batches.append(factory.messages[done:])

    lsn = 1000
    for i in range(ROWS):
        if i < ROWS // 2:
            factory.change(BIG, "r" if i < 300 else "c", after=[i, f"n{i}"], lsn=lsn, seq=i)
        else:
            factory.change(BIG_WIDER, "c", after=[i, f"w{i}", i * 2], lsn=lsn + 16, seq=i)
    for i in range(5):
        factory.change(SMALL, "c", after=[i, f"s{i}"], lsn=lsn + 32, seq=i)
    cut()
    for i in range(ROWS, 2 * ROWS):  # the build goes on: new keys only
        factory.change(BIG_WIDER, "r", after=[i, f"r{i}", i], lsn=1500 + i // 400 * 16, seq=i)
    cut()
    for i in range(2 * ROWS, 2 * ROWS + THRESHOLD):
        factory.change(BIG_WIDER, "c", after=[i, f"c{i}", i], lsn=1900, seq=i)
    factory.change(BIG_WIDER, "r", after=[5, "again", 5], lsn=1916, seq=0)  # a stored key
    cut()
    lsn = 2000
    for i in range(0, ROWS, 97):
        factory.change(BIG_WIDER, "u", after=[i, f"u{i}", -i], lsn=lsn, seq=i)
    for i in range(1, ROWS, 211):
        factory.change(BIG_WIDER, "d", before=[i, None, None], lsn=lsn + 16, seq=i)
    factory.change(BIG_WIDER, "c", after=[3 * ROWS, "late", 1], lsn=lsn + 32, seq=0)
    factory.change(SMALL, "u", after=[2, "s2!"], lsn=lsn + 48, seq=0)
    cut()
    return factory, batches


def catalog_of(published: Mapping[Any, str]) -> SchemaCatalog:
    """A factory's schemas (``published``); no broker to refresh from (every schema is
    known)."""
    catalog = SchemaCatalog("pg")
    for fingerprint, text in published.items():
        catalog.add(fingerprint_header(fingerprint), json.loads(text))
    catalog.refresh = lambda: None  # type: ignore[method-assign]
    return catalog


def raw_frame(spark: Any, messages: list[Message]) -> Any:
    """The messages as the ``cdcd-kafka`` source reads them: one Spark partition per
    Kafka partition."""
    from pyspark.sql.functions import col

    frame = spark.createDataFrame(pa.Table.from_batches([kafka_batch(messages)]))
    return frame.repartition(3, col("partition"))


def contents(root: Path, name: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in read_mirror(str(root / name)).to_pylist())


def versions(root: Path, name: str) -> list[tuple[Any, ...]]:
    """The rows of a table's history table (every column), sorted."""
    from deltalake import DeltaTable

    table = DeltaTable(str(root / name / HISTORY_DIR)).to_pyarrow_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())


def recorded_state(root: Path, name: str) -> dict[str, Any]:
    from deltalake import DeltaTable

    entry = next(h for h in DeltaTable(str(root / name)).history() if h.get("cdcd.mirror"))
    document = json.loads(entry["cdcd.mirror"])
    return {k: document[k] for k in ("state", "pending", "recent_deletes", "batch")}


def data_files(root: Path, name: str) -> list[str]:
    from deltalake import DeltaTable

    return sorted(DeltaTable(str(root / name)).file_uris())


def mirror_job(root: Path, published: Mapping[Any, str], threshold: int | None,
               history: bool = False) -> MirrorJob:  # fmt: skip
    store = MirrorStore(root)
    store.open()
    job = MirrorJob(
        store,
        catalog_of(published),
        bulk_rows=threshold,
        history=HistoryOptions(patterns=("public.big",) if history else ()),
    )
    job.ready.set()
    return job


#: Per batch: whether the executors write ``big`` (see the module docstring).
BY_EXECUTORS = [True, True, False, False]


@pytest.mark.parametrize(
    "history",
    # The history variant is opt-in (slow); the crash cases below cover the
    # history table on the executor path in the default suite.
    [pytest.param(False, id="plain"), pytest.param(True, id="history", marks=pytest.mark.slow)],
)
def test_executors_write_large_batches_of_new_rows_and_the_mirror_is_the_same(
    spark: Any, tmp_path: Path, history: bool
) -> None:
    from deltalake import DeltaTable

    factory, batches = build_batches()
    jobs = {
        label: mirror_job(tmp_path / label, factory.published, threshold, history)
        for label, threshold in (("bulk", THRESHOLD), ("driver", None))
    }
    for batch_id, messages in enumerate(batches):
        frame = raw_frame(spark, messages)
        reports = {label: job.process(frame, batch_id) for label, job in jobs.items()}
        assert reports["bulk"].tables == reports["driver"].tables
        assert reports["bulk"].changes == reports["driver"].changes
        for name in ("public.big", "public.small"):
            assert contents(tmp_path / "bulk", name) == contents(tmp_path / "driver", name)
            assert recorded_state(tmp_path / "bulk", name) == recorded_state(
                tmp_path / "driver", name
            )
            assert (
                DeltaTable(str(tmp_path / "bulk" / name)).schema()
                == DeltaTable(str(tmp_path / "driver" / name)).schema()
            )
        if history:
            assert versions(tmp_path / "bulk", "public.big") == versions(
                tmp_path / "driver", "public.big"
            )
            assert DeltaTable(str(tmp_path / "bulk/public.big" / HISTORY_DIR)).schema() == (
                DeltaTable(str(tmp_path / "driver/public.big" / HISTORY_DIR)).schema()
            )
        staged = f"/{STAGE_PREFIX}{batch_id}-"
        files = data_files(tmp_path / "bulk", "public.big")
        assert any(staged in f for f in files) == BY_EXECUTORS[batch_id], files
        if history:
            history_files = data_files(tmp_path / "bulk", f"public.big/{HISTORY_DIR}")
            assert any(staged in f for f in history_files) == BY_EXECUTORS[batch_id]
        assert not any(STAGE_PREFIX in f for f in data_files(tmp_path / "driver", "public.big"))
        assert not any(STAGE_PREFIX in f for f in data_files(tmp_path / "bulk", "public.small"))
    # The staging tables' logs are gone once their actions are committed (vacuum skips them).
    assert not list((tmp_path / "bulk").rglob(f"{STAGE_PREFIX}*/_delta_log/*.json"))
    rows = contents(tmp_path / "bulk", "public.big")
    assert len(rows) == 2 * ROWS + THRESHOLD + 1 - len(range(1, ROWS, 211))
    # A batch Spark replays after a crash is recognised and skipped.
    for batch_id in (0, 1):
        replay = jobs["bulk"].process(raw_frame(spark, batches[batch_id]), batch_id)
        assert replay.skipped
    assert contents(tmp_path / "bulk", "public.big") == rows


class ArrowFrame:
    """Just enough of a Spark DataFrame for :meth:`MirrorJob.process`, over Arrow record
    batches in partitions, run in this process: the crash test needs no JVM."""

    def __init__(self, partitions: list[list[Any]]) -> None:
        self.partitions = partitions

    @classmethod
    def of(cls, messages: list[Message]) -> ArrowFrame:
        batch = kafka_batch(messages)
        column = batch.column(batch.schema.get_field_index("partition")).to_pylist()
        return cls(
            [[batch.filter(pa.array([p == k for p in column]))] for k in sorted(set(column))]
        )

    def mapInArrow(self, function: Any, schema: str) -> ArrowFrame:
        return ArrowFrame([list(function(iter(part))) for part in self.partitions])

    def persist(self, *args: Any) -> ArrowFrame:
        return self

    def unpersist(self) -> ArrowFrame:
        return self

    def toArrow(self) -> Any:
        return pa.Table.from_batches([b for part in self.partitions for b in part])


# The parent's batches, pickled: the factory spreads keys over partitions by
# their hash, which differs from one process to the next.
_CHILD = """
import pickle
import sys
sys.path.insert(0, "tests")
from pathlib import Path
import cdcd.spark.faults
from spark.test_mirror_bulk import THRESHOLD, ArrowFrame, mirror_job
cdcd.spark.faults.FAULT = sys.argv[2]
last, history = int(sys.argv[3]), sys.argv[4] == "history"
published, batches = pickle.loads(Path(sys.argv[5]).read_bytes())
job = mirror_job(Path(sys.argv[1]), published, THRESHOLD, history)
for batch_id in range(last + 1):
    job.process(ArrowFrame.of(batches[batch_id]), batch_id)
raise SystemExit("the fault point was not reached")
"""


def _crash_cases() -> list[Any]:
    slow = pytest.mark.slow
    return [
        pytest.param("in-files:0", False, id="new-table-files"),
        pytest.param("in-files:1", False, id="appended-files"),
        pytest.param("after-history:1", True, id="appended-history-committed"),
        pytest.param("after-history:0", True, id="new-history-committed", marks=slow),
        pytest.param("in-files:1", True, id="appended-files-history", marks=slow),
    ]


@pytest.mark.parametrize(("fault", "history"), _crash_cases())
def test_kill_between_the_executors_files_and_the_commit(
    tmp_path: Path, fault: str, history: bool
) -> None:
    from deltalake import DeltaTable

    last = int(fault.rpartition(":")[2])
    root = tmp_path / "out"
    table = root / "public.big"
    factory, batches = build_batches()
    pickled = tmp_path / "batches.pickle"
    pickled.write_bytes(pickle.dumps((factory.published, batches)))
    crashed = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), fault, str(last),
         "history" if history else "plain", str(pickled)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    orphans = {p for p in table.rglob("*.parquet") if f"{STAGE_PREFIX}{last}-" in str(p)}
    assert orphans, "the executors wrote no data file before the kill"
    # Nothing of the batch is visible in the table (nothing there at all for a new one).
    if last == 0:
        assert not DeltaTable.is_deltatable(str(table))
    else:
        assert DeltaTable(str(table)).version() == last - 1

    # The restart replays the batch; the result is the driver path's, applied once.
    job = mirror_job(root, factory.published, THRESHOLD, history)
    expected = mirror_job(tmp_path / "driver", factory.published, None, history)
    for batch_id in range(last + 1):
        frame = ArrowFrame.of(batches[batch_id])
        expected.process(frame, batch_id)  # type: ignore[arg-type]
        report = job.process(frame, batch_id)  # type: ignore[arg-type]
        assert report.skipped == (batch_id < last)
    for name in ("public.big", "public.small"):
        assert contents(root, name) == contents(tmp_path / "driver", name)
        assert recorded_state(root, name) == recorded_state(tmp_path / "driver", name)
    delta = DeltaTable(str(table))
    assert delta.version() == last  # one commit per batch
    committed = {Path(uri.removeprefix("file://")) for uri in delta.file_uris()}
    assert committed.isdisjoint(orphans)  # the crash's files belong to no version
    assert all(STAGE_PREFIX in str(path) for path in committed)
    if history:
        assert versions(root, "public.big") == versions(tmp_path / "driver", "public.big")
        assert DeltaTable(str(table / HISTORY_DIR)).version() == last


def test_bulk_rows_is_a_setting_of_cdcd_mirror() -> None:
    from cdcd import cli
    from cdcd.errors import ConfigError
    from cdcd.spark.cli import _bulk_rows

    base = ["mirror", "-c", "cdcd.yaml", "--output", "out"]
    assert cli.build_parser().parse_args(base).bulk_rows is None  # the default threshold
    assert cli.build_parser().parse_args([*base, "--bulk-rows", "0"]).bulk_rows == 0
    assert _bulk_rows(250_000) == 250_000
    with pytest.raises(ConfigError, match="--bulk-rows -1"):
        _bulk_rows(-1)
