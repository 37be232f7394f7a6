"""Large new tables are written by the executors, and the mirror is the same (issue 28).

A batch that fills a table new to the mirror with at least ``bulk_rows``
inserts and snapshot reads is not collected: each Spark task writes its
share as data files in the table's directory, the driver commits their add
actions (:mod:`cdcd.spark.bulk`). The same batches, encoded by the daemon's
own encoder (a column added mid-batch, a small second table beside, then
updates, deletes and inserts), go through a real ``local[2]`` session into
two mirrors, one with the executor path forced (a low threshold) and one
with every batch collected (``bulk_rows=None``): the tables, their Delta
schemas and the mirror's recorded state must be equal after each batch, the
big table's files must come from the executors, and a replayed batch must be
skipped.

``kill -9`` of the driver after the executors wrote the files and before the
commit (fault point ``in-files``, set in a child process; the executors are
played by :class:`ArrowFrame` there, no JVM): the table does not exist for
readers, and the restart builds it exactly once -- the orphaned files are
referenced by no version.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pyspark")

from cdcd.consumer import SchemaCatalog, fingerprint_header  # noqa: E402
from cdcd.spark.bulk import STAGE_PREFIX  # noqa: E402
from cdcd.spark.mirror import MirrorJob, MirrorStore, read_mirror  # noqa: E402
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
    """Batch 0: a snapshot and inserts of ``big`` (a column added halfway), a few rows
    of ``small``; batch 1: updates, deletes and inserts to both."""
    factory = EnvelopeFactory()
    lsn = 1000
    for i in range(ROWS):
        if i < ROWS // 2:
            factory.change(BIG, "r" if i < 300 else "c", after=[i, f"n{i}"], lsn=lsn, seq=i)
        else:
            factory.change(BIG_WIDER, "c", after=[i, f"w{i}", i * 2], lsn=lsn + 16, seq=i)
    for i in range(5):
        factory.change(SMALL, "c", after=[i, f"s{i}"], lsn=lsn + 32, seq=i)
    first = list(factory.messages)
    lsn = 2000
    for i in range(0, ROWS, 97):
        factory.change(BIG_WIDER, "u", after=[i, f"u{i}", -i], lsn=lsn, seq=i)
    for i in range(1, ROWS, 211):
        factory.change(BIG_WIDER, "d", before=[i, None, None], lsn=lsn + 16, seq=i)
    factory.change(BIG_WIDER, "c", after=[ROWS + 1, "late", 1], lsn=lsn + 32, seq=0)
    factory.change(SMALL, "u", after=[2, "s2!"], lsn=lsn + 48, seq=0)
    return factory, [first, factory.messages[len(first) :]]


def catalog_of(factory: EnvelopeFactory) -> SchemaCatalog:
    """The factory's schemas; no broker to refresh from (every schema is known)."""
    catalog = SchemaCatalog("pg")
    for fingerprint, text in factory.published.items():
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


def recorded_state(root: Path, name: str) -> dict[str, Any]:
    from deltalake import DeltaTable

    entry = next(h for h in DeltaTable(str(root / name)).history() if h.get("cdcd.mirror"))
    document = json.loads(entry["cdcd.mirror"])
    return {k: document[k] for k in ("state", "pending", "recent_deletes", "batch")}


def data_files(root: Path, name: str) -> list[str]:
    from deltalake import DeltaTable

    return sorted(DeltaTable(str(root / name)).file_uris())


def test_executors_write_large_new_tables_and_the_mirror_is_the_same(
    spark: Any, tmp_path: Path
) -> None:
    from deltalake import DeltaTable

    factory, batches = build_batches()
    jobs = {}
    for label, threshold in (("bulk", THRESHOLD), ("driver", None)):
        store = MirrorStore(tmp_path / label)
        store.open()
        jobs[label] = MirrorJob(store, catalog_of(factory), bulk_rows=threshold)
        jobs[label].ready.set()
    for batch_id, messages in enumerate(batches):
        frame = raw_frame(spark, messages)
        reports = {label: job.process(frame, batch_id) for label, job in jobs.items()}
        assert reports["bulk"].tables.keys() == reports["driver"].tables.keys()
        for name in ("public.big", "public.small"):
            assert contents(tmp_path / "bulk", name) == contents(tmp_path / "driver", name)
            assert recorded_state(tmp_path / "bulk", name) == recorded_state(
                tmp_path / "driver", name
            )
            assert (
                DeltaTable(str(tmp_path / "bulk" / name)).schema()
                == DeltaTable(str(tmp_path / "driver" / name)).schema()
            )
        if batch_id == 0:
            files = data_files(tmp_path / "bulk", "public.big")
            assert files and all(f"/{STAGE_PREFIX}0-" in f for f in files)
            assert not any(STAGE_PREFIX in f for f in data_files(tmp_path / "driver", "public.big"))
            assert not any(STAGE_PREFIX in f for f in data_files(tmp_path / "bulk", "public.small"))
            stats = reports["bulk"].tables["public.big"]
            assert stats.applied == reports["driver"].tables["public.big"].applied == ROWS
    rows = contents(tmp_path / "bulk", "public.big")
    assert len(rows) == ROWS + 1 - len(range(1, ROWS, 211))
    # A batch Spark replays after a crash is recognised and skipped.
    replay = jobs["bulk"].process(raw_frame(spark, batches[0]), 0)
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


_CHILD = """
import sys
sys.path.insert(0, "tests")
import cdcd.spark.faults
from cdcd.spark.mirror import MirrorJob, MirrorStore
from spark.test_mirror_bulk import THRESHOLD, ArrowFrame, build_batches, catalog_of
cdcd.spark.faults.FAULT = sys.argv[2]
factory, batches = build_batches()
store = MirrorStore(sys.argv[1])
store.open()
job = MirrorJob(store, catalog_of(factory), bulk_rows=THRESHOLD)
job.process(ArrowFrame.of(batches[0]), 0)
raise SystemExit("the fault point was not reached")
"""


def test_kill_between_the_executors_files_and_the_commit(tmp_path: Path) -> None:
    from deltalake import DeltaTable

    root = tmp_path / "out"
    crashed = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), "in-files:0"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    table = root / "public.big"
    orphans = sorted(p for p in table.rglob("*.parquet"))
    assert orphans, "the executors wrote no data file before the kill"
    assert not DeltaTable.is_deltatable(str(table))  # nothing committed: no table for readers

    # The restart replays the batch.
    factory, batches = build_batches()
    store = MirrorStore(root)
    store.open()
    job = MirrorJob(store, catalog_of(factory), bulk_rows=THRESHOLD)
    assert not job.process(ArrowFrame.of(batches[0]), 0).skipped  # type: ignore[arg-type]
    expected = {(i, f"n{i}" if i < ROWS // 2 else f"w{i}") for i in range(ROWS)}
    got = {(r["id"], r["name"]) for r in read_mirror(str(table)).to_pylist()}
    assert got == expected
    delta = DeltaTable(str(table))
    assert delta.version() == 0
    committed = {Path(uri.removeprefix("file://")) for uri in delta.file_uris()}
    assert committed and committed.isdisjoint(orphans)  # the crash's files belong to no version
    assert all(STAGE_PREFIX in str(path) for path in committed)
    assert contents(root, "public.small") == [(i, f"s{i}") for i in range(5)]
