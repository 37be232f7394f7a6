"""Large batches that change stored rows are applied by the executors rewriting the table
(issue 28, :mod:`cdcd.spark.rewrite`).

The same batches, encoded by the daemon's own encoder, go through a real
``local[2]`` session into two mirrors: one with a low ``bulk_rows`` (the
executor paths taken wherever they apply) and one with every batch collected
(``bulk_rows=None``). After each batch the mirror must equal the changes
replayed independently (a plain dict per key, in commit order), and the two
mirrors' recorded state, Delta schema and reported statistics must be equal;
the report says which path the executors took.

* a re-snapshot: a table already mirrored, then one batch with updates,
  deletes and new rows streamed before a snapshot of every row (``op=r``) and
  changes after it: rewritten by the executors; then two large batches of
  updates (and deletes), rewritten too (the rows the batches before deleted,
  kept for late key-change creates, age and expire there as on the driver);
  then a key change split
  by a batch boundary, its create first: held back, so the next large batch
  falls back to the driver;
* a large batch of updates (unchanged TOAST values taken from the stored
  rows), deletes, a replayed old change and an update of a key never seen,
  and of a table with a text key (bucketed by a hash): rewritten; with a
  history table (opt-in, slow) that table's batch goes to the driver;
* a batch of at least ``bulk_rows`` changes but under a quarter of the table
  stays on the driver; a re-snapshot alone (``op=r`` only) is first tried as
  an append, the executors find its keys stored, and it is rewritten.

Every file a rewrite leaves holds one stretch of the integer key (so later
batches still read only the files their keys fall in), and the buckets of a
key are the same in every worker process.

``kill -9`` after the executors wrote the rewritten files and before the
commit (fault point ``in-rewrite``), in a child process whose executors are
played by :class:`RewriteFrame` (no JVM): nothing of the batch is visible,
and the restart applies it once -- the orphaned files belong to no version.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pyspark")

from cdcd.spark.bulk import STAGE_PREFIX  # noqa: E402
from cdcd.spark.store import RECENT_DIR  # noqa: E402
from spark.envelopes import UNCHANGED, Col, EnvelopeFactory, Message  # noqa: E402
from spark.envelopes import table_version as make_table  # noqa: E402
from spark.test_mirror_bulk import (  # noqa: E402
    ArrowFrame,
    contents,
    data_files,
    mirror_job,
    raw_frame,
    recorded_state,
    versions,
)

T = make_table("public", "big", [Col("id", 20, key=True), Col("name", 25), Col("n", 23)])
W = make_table("public", "words", [Col("word", 25, key=True), Col("n", 23)], relation_id=16_385)
ROWS = 1_200
THRESHOLD = 500

Batches = list[list[Message]]


@pytest.fixture(autouse=True)
def _buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several buckets per table (about 300 stored rows and changes each), as a large
    table has."""
    from cdcd.spark import rewrite

    monkeypatch.setattr(rewrite, "BUCKET_ROWS", 300)


class Model:
    """The changes of one table replayed independently: per key the newest change in
    commit order. ``types`` convert each column's text to the value the mirror holds."""

    def __init__(self, types: tuple[Callable[[Any], Any], ...]) -> None:
        self.types = types
        self.rows: dict[Any, tuple[Any, ...]] = {}
        self.versions: dict[Any, tuple[int, int]] = {}

    def apply(self, op: str, row: list[Any], lsn: int, seq: int) -> None:
        key = self.types[0](row[0])
        if self.versions.get(key, (-1, -1)) >= (lsn, seq):
            return  # a repeat, or older than what the key holds
        self.versions[key] = (lsn, seq)
        if op == "d":
            self.rows.pop(key, None)
            return
        old = self.rows.get(key, (None,) * len(row))
        self.rows[key] = tuple(
            old[i] if v is UNCHANGED else self.types[i](v) for i, v in enumerate(row)
        )

    def table(self) -> list[tuple[Any, ...]]:
        return sorted(self.rows.values())


class Builder:
    """Encodes changes of ``T`` and ``W`` (and the models' view of them) batch by batch."""

    def __init__(self) -> None:
        self.factory = EnvelopeFactory()
        self.tables = {
            "public.big": (T, Model((int, str, int))),
            "public.words": (W, Model((str, int))),
        }
        self.batches: Batches = []
        self.models: list[dict[str, list[tuple[Any, ...]]]] = []

    @property
    def model(self) -> Model:
        return self.tables["public.big"][1]

    def change(
        self, op: str, row: list[Any], lsn: int, seq: int, table: str = "public.big"
    ) -> None:
        version, model = self.tables[table]
        if op == "d":
            before = [row[0]] + [None] * (len(version.columns) - 1)
            self.factory.change(version, "d", before=before, lsn=lsn, seq=seq)
        else:
            self.factory.change(version, op, after=row, lsn=lsn, seq=seq)
        model.apply(op, row, lsn, seq)

    def cut(self) -> None:
        done = sum(len(b) for b in self.batches)
        self.batches.append(self.factory.messages[done:])
        self.models.append({name: m.table() for name, (_, m) in self.tables.items() if m.rows})

    def expected(self, batch_id: int, name: str = "public.big") -> list[tuple[Any, ...]]:
        return self.models[batch_id][name]

    def build(self) -> None:
        for i in range(ROWS):
            self.change("r", [i, f"n{i}", i], 1000, i)
        self.cut()


def resnapshot_batches() -> Builder:
    """0: the build; 1: changes, a snapshot of every row, changes after it; 2: updates
    and deletes; 3: updates; 4: a key change's create without its delete (held back);
    5: updates and the delete."""
    b = Builder()
    b.build()
    for i in range(0, ROWS, 7):
        b.change("u", [i, f"u{i}", -i], 2000, i)
    for i in range(1, ROWS, 11):
        b.change("d", [i], 2016, i)
    for i in range(ROWS, ROWS + 100):
        b.change("c", [i, f"c{i}", i], 2032, i)
    for key, row in sorted(b.model.rows.items()):  # the snapshot reads the table as it is
        b.change("r", list(row), 2048, key)
    for i in range(3, ROWS, 13):  # changes after the snapshot read
        if i in b.model.rows:
            b.change("u", [i, UNCHANGED, 10 * i], 2064, i)
    b.cut()
    for i in range(0, ROWS, 2):
        if i in b.model.rows:
            b.change("u", [i, f"v{i}", i + 1], 3000, i)
    for i in range(5, ROWS, 17):
        if i in b.model.rows:
            b.change("d", [i], 3016, i)
    b.cut()
    for i in range(ROWS + 100):
        if i % 2 and i in b.model.rows:
            b.change("u", [i, f"x{i}", i], 3500, i)
    b.cut()
    # UPDATE big SET id = 9999 WHERE id = 4: delete and create, one batch apart (the
    # create first); the create's unchanged name comes from the deleted row.
    old, new = 4, 9999
    # On another partition than the old key's (whose order puts the delete first).
    home = next(m.partition for m in b.batches[0] if m.seq == old)
    b.factory.change(T, "c", after=[new, UNCHANGED, 7], lsn=4000, seq=2, partition=(home + 1) % 3)
    b.cut()
    b.factory.change(T, "d", before=[old, None, None], lsn=4000, seq=0)
    name = b.model.rows[old][1]
    b.model.apply("d", [old], 4000, 0)
    b.model.apply("c", [new, name, 7], 4000, 2)
    for i in range(10, ROWS, 2):
        if i in b.model.rows:
            b.change("u", [i, f"w{i}", i + 2], 4016, i)
    b.cut()
    return b


def updates_batches() -> Builder:
    """0: the build (and ``W``'s); 1: updates with unchanged TOAST, deletes, a repeat, an
    unknown key (and updates and deletes of ``W``)."""
    b = Builder()
    for i in range(700):  # a text key: buckets by a CRC of the key
        b.change("r", [f"w{i:04d}", i], 900, i, "public.words")
    b.build()
    first = b.batches[0]
    for i in range(0, 700, 2):
        b.change("u", [f"w{i:04d}", -i], 2000, i, "public.words")
    for i in range(1, 700, 3):
        b.change("d", [f"w{i:04d}"], 2016, i, "public.words")
    for i in range(0, ROWS, 2):
        b.change("u", [i, UNCHANGED, -i], 2000, i)
    for i in range(1, ROWS, 5):
        b.change("d", [i], 2016, i)
    b.factory.duplicate(m for m in first if m.seq in (3, 5))  # replayed after a daemon crash
    b.change("u", [5 * ROWS, "never seen", 1], 2032, 0)
    b.cut()
    return b


def run(
    spark: Any,
    tmp_path: Path,
    builder: Builder,
    paths: list[dict[str, str]],
    history: bool = False,
) -> None:
    """The batches through both mirrors; the checks of the module docstring. ``history``:
    ``public.big`` has a history table (compared too)."""

    published = builder.factory.published
    jobs = {
        label: mirror_job(tmp_path / label, published, threshold, history)
        for label, threshold in (("executors", THRESHOLD), ("driver", None))
    }
    for batch_id, messages in enumerate(builder.batches):
        frame = raw_frame(spark, messages)
        reports = {label: job.process(frame, batch_id) for label, job in jobs.items()}
        assert reports["executors"].executors == paths[batch_id]
        assert reports["driver"].executors == {}
        assert reports["executors"].tables == reports["driver"].tables
        assert reports["executors"].changes == reports["driver"].changes
        for name in builder.models[batch_id]:
            check_table(tmp_path, builder, name, batch_id, paths[batch_id].get(name))
        if history:
            assert versions(tmp_path / "executors", "public.big") == versions(
                tmp_path / "driver", "public.big"
            )
    # A batch Spark replays after a crash is recognised and skipped.
    replay = jobs["executors"].process(raw_frame(spark, builder.batches[1]), 1)
    assert replay.skipped
    assert contents(tmp_path / "executors", "public.big") == builder.expected(-1)


def check_table(
    tmp_path: Path, builder: Builder, name: str, batch_id: int, path: str | None
) -> None:
    """The table ``name`` after the batch in both mirrors (see :func:`run`)."""
    from deltalake import DeltaTable

    assert contents(tmp_path / "executors", name) == builder.expected(batch_id, name)
    assert contents(tmp_path / "driver", name) == builder.expected(batch_id, name)
    assert recorded_state(tmp_path / "executors", name) == recorded_state(tmp_path / "driver", name)
    assert (
        DeltaTable(str(tmp_path / "executors" / name)).schema()
        == DeltaTable(str(tmp_path / "driver" / name)).schema()
    )
    files = data_files(tmp_path / "executors", name)
    staged = [f for f in files if f"/{STAGE_PREFIX}{batch_id}-" in f]
    if path == "rewrite":
        assert staged == files  # every row written anew, the files read removed
        assert len({f.rsplit("/", 2)[-2] for f in staged}) > 1  # by several buckets
    if path == "rewrite" and name == "public.big":
        # Each file holds one stretch of keys: later batches read only their files.
        log = pa.table(DeltaTable(str(tmp_path / "executors" / name)).get_add_actions(True))
        spans = sorted(zip(log["min.id"].to_pylist(), log["max.id"].to_pylist(), strict=True))
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    recent = recorded_state(tmp_path / "executors", name)["recent_deletes"]
    if recent is not None:
        side = {"executors": tmp_path / "executors", "driver": tmp_path / "driver"}
        held = [
            sorted(map(str, DeltaTable(str(root / name / RECENT_DIR), version=recent)
                       .to_pyarrow_table().to_pylist()))
            for root in side.values()
        ]  # fmt: skip
        assert held[0] == held[1]  # rows kept for a late key-change create


def test_a_resnapshot_of_a_mirrored_table_is_rewritten_by_the_executors(
    spark: Any, tmp_path: Path
) -> None:
    builder = resnapshot_batches()
    # Batches 2 and 3 age the rows the batches before deleted (kept for late key-change
    # creates); batch 5 falls back to the driver: it finds a create held back.
    rewritten = {"public.big": "rewrite"}
    paths = [{"public.big": "files"}, rewritten, rewritten, rewritten, {}, {}]
    run(spark, tmp_path, builder, paths)


@pytest.mark.parametrize(
    "history",
    # With a history table the driver applies the batch: opt-in (slow), the
    # routing is one condition and the history path has its own tests.
    [pytest.param(False, id="plain"), pytest.param(True, id="history", marks=pytest.mark.slow)],
)
def test_a_large_batch_of_updates_and_deletes_is_rewritten_by_the_executors(
    spark: Any, tmp_path: Path, history: bool
) -> None:
    builder = updates_batches()
    both = ("public.big", "public.words")
    rewritten = dict.fromkeys(both, "rewrite")
    if history:
        del rewritten["public.big"]  # its history table's versions: the driver's
    run(spark, tmp_path, builder, [dict.fromkeys(both, "files"), rewritten], history)


def test_a_small_batch_next_to_the_table_stays_on_the_driver_and_a_plain_resnapshot_is_rewritten(
    spark: Any, tmp_path: Path
) -> None:
    """Batch 1: at least ``bulk_rows`` changes, but under a quarter of the stored rows:
    the rewrite would read and write the whole table for them, the driver applies
    them. Batch 2: a re-snapshot alone (``op=r`` only, every tenth row changed): the
    executors try to append it, find its keys stored, and rewrite the table."""
    b = Builder()
    b.build()
    for i in range(0, 250):
        b.change("u", [i, f"x{i}", i], 2000, i)
    b.cut()
    for i in range(ROWS):
        b.change("r", [i, b.model.rows[i][1], i if i % 10 else -i], 3000, i)
    b.cut()
    job = mirror_job(tmp_path / "out", b.factory.published, 200)
    paths = [{"public.big": "files"}, {}, {"public.big": "rewrite"}]
    for batch_id, messages in enumerate(b.batches):
        report = job.process(raw_frame(spark, messages), batch_id)
        assert contents(tmp_path / "out", "public.big") == b.expected(batch_id)
        assert report.executors == paths[batch_id]


class _Session:
    def createDataFrame(self, rows: list[tuple[Any, ...]], ddl: str) -> RewriteFrame:
        names = [part.split()[0] for part in ddl.split(",")]
        columns = {n: [r[i] for r in rows] for i, n in enumerate(names)}
        table = pa.table({n: pa.array(v, pa.string()) for n, v in columns.items()})
        return RewriteFrame([table.to_batches()])


class RewriteFrame(ArrowFrame):
    """:class:`ArrowFrame` with what the rewrite asks of a DataFrame: a session that
    makes small frames, ``repartition`` and ``groupBy(...).cogroup(...).applyInArrow``."""

    sparkSession = _Session()

    def mapInArrow(self, function: Any, schema: str) -> RewriteFrame:
        return RewriteFrame([list(function(iter(part))) for part in self.partitions])

    def repartition(self, count: int) -> RewriteFrame:
        batches = [b for part in self.partitions for b in part]
        return RewriteFrame([batches[i::count] for i in range(count)])

    def groupBy(self, *columns: str) -> _Grouped:
        return _Grouped(self, columns)


class _Grouped:
    def __init__(self, frame: RewriteFrame, columns: tuple[str, ...]) -> None:
        self.frame, self.columns = frame, columns

    def groups(self) -> Iterator[tuple[tuple[Any, ...], Any]]:
        batches = [b for part in self.frame.partitions for b in part]
        if not batches:
            return
        table = pa.Table.from_batches(batches)
        keys = list(zip(*(table.column(c).to_pylist() for c in self.columns), strict=True))
        for key in sorted(set(keys)):
            yield key, table.filter(pa.array([k == key for k in keys]))

    def cogroup(self, other: _Grouped) -> _CoGrouped:
        return _CoGrouped(self, other)


class _CoGrouped:
    def __init__(self, left: _Grouped, right: _Grouped) -> None:
        self.left, self.right = left, right

    def applyInArrow(self, function: Callable[..., Any], schema: str) -> RewriteFrame:
        left, right = dict(self.left.groups()), dict(self.right.groups())
        shape = next(iter({**left, **right}.values())).schema
        out = [
            function(left.get(k, shape.empty_table()), right.get(k, shape.empty_table()))
            for k in sorted(set(left) | set(right))
        ]
        return RewriteFrame([[b for t in out for b in t.to_batches()]])


# The parent's batches, pickled: the factory spreads keys over partitions by
# their hash, which differs from one process to the next.
_CHILD = """
import pickle
import sys
sys.path.insert(0, "tests")
from pathlib import Path
import cdcd.spark.faults
import cdcd.spark.rewrite
cdcd.spark.rewrite.BUCKET_ROWS = 300
from spark.test_mirror_rewrite import THRESHOLD, RewriteFrame, mirror_job
cdcd.spark.faults.FAULT = sys.argv[2]
last = int(sys.argv[3])
published, batches = pickle.loads(Path(sys.argv[4]).read_bytes())
job = mirror_job(Path(sys.argv[1]), published, THRESHOLD)
for batch_id in range(last + 1):
    job.process(RewriteFrame.of(batches[batch_id]), batch_id)
raise SystemExit("the fault point was not reached")
"""


@pytest.mark.parametrize("scenario", [pytest.param(updates_batches, id="updates")])
def test_kill_between_the_rewritten_files_and_the_commit(
    tmp_path: Path, scenario: Callable[[], Builder]
) -> None:
    from deltalake import DeltaTable

    last = 1
    root = tmp_path / "out"
    table = root / "public.big"
    builder = scenario()
    pickled = tmp_path / "batches.pickle"
    pickled.write_bytes(pickle.dumps((builder.factory.published, builder.batches)))
    crashed = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), f"in-rewrite:{last}", str(last), str(pickled)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    orphans = {p for p in table.rglob("*.parquet") if f"{STAGE_PREFIX}{last}-" in str(p)}
    assert orphans, "the executors wrote no data file before the kill"
    assert DeltaTable(str(table)).version() == last - 1  # nothing of the batch committed
    assert contents(root, "public.big") == builder.expected(last - 1)

    # The restart replays the batch: applied once, by the executors again.
    job = mirror_job(root, builder.factory.published, THRESHOLD)
    for batch_id in range(last + 1):
        report = job.process(RewriteFrame.of(builder.batches[batch_id]), batch_id)  # type: ignore[arg-type]
        assert report.skipped == (batch_id < last)
    assert report.executors == {"public.big": "rewrite", "public.words": "rewrite"}
    assert contents(root, "public.big") == builder.expected(last)
    assert contents(root, "public.words") == builder.expected(last, "public.words")
    delta = DeltaTable(str(table))
    assert delta.version() == last  # one commit per batch
    committed = {Path(uri.removeprefix("file://")) for uri in delta.file_uris()}
    assert committed.isdisjoint(orphans)  # the crash's files belong to no version


_BUCKETS_CHILD = """
import json, sys
import pyarrow as pa
from cdcd.spark.rewrite import bucket_of
keys = pa.table({"k": [f"key-{i}" for i in range(200)], "n": list(range(200))})
print(json.dumps(bucket_of(keys, 7).to_pylist()))
"""


def test_buckets_are_the_same_in_every_worker_process() -> None:
    """A key's stored row and its changes are bucketed by different Python workers:
    the bucket of a key must not depend on the process (Python's string hash does)."""
    import json
    import os

    seen = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _BUCKETS_CHILD],
                cwd=PROJECT_ROOT,
                env={**os.environ, "PYTHONHASHSEED": seed},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for seed in ("1", "2")
    ]
    assert seen[0] == seen[1]
    assert set(seen[0]) == set(range(7))
