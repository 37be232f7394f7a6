"""Cost of ``cdcd mirror``'s apply step on Delta tables of 1M and 10M rows (issue 17).

Run: ``.venv/bin/python -m tests.bench.bench_mirror [--rows 1000000 10000000] [--dir D]
[--history] [--changes 10000]``.
Not a test, and not run by the suite.

What is measured: :meth:`cdcd.spark.mirror.MirrorJob.apply` -- everything
the Spark driver does with a micro-batch once the executors decoded it:
pick the layout, read the stored rows of the touched keys from the Delta
table (filter pushdown, file skipping by min/max statistics), fold the
changes, write the side tables and commit one MERGE. Spark's decoding and
the Kafka read are left out (they run on the executors and scale with the
batch, not the table): the changes are built in memory as the decoded
Arrow tables, for an ``orders``-like table (bigint key, int, text,
numeric(12,2), timestamptz, a 32-character text).

For each table size, printed:

* the first build: ``--rows`` inserts in batches of 500 000 (the mirror's
  ``maxOffsetsPerTrigger``), total time and the driver's peak RSS (VmHWM);
* a batch of 10 000 updates to recent keys (the newest 20 000 ids) and one
  of 10 000 updates to uniformly random keys: apply time, data files
  rewritten, and peak RSS during that batch (VmHWM reset before it via
  ``/proc/self/clear_refs``).

Wall and CPU seconds are both printed: on a shared machine the wall time
also counts other processes' turns.

Targets (issue 17): the recent-key batch at 10M rows within 2x of 1M;
peak RSS below 2 GB at 10M rows, first build included.

``--history`` (issue 28) keeps the history table too (``cdcd mirror
--history``): the same figures then include writing every version.
``--changes`` sets the size of the two update batches.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from spark.handbuilt import DECIMAL_12_2, TIMESTAMPTZ, column, envelope, key

from cdcd.spark.decode import NativeChanges
from cdcd.spark.layout import RowLayout, changes_arrow_schema
from cdcd.spark.mirror import HistoryOptions, MirrorJob, MirrorStore

TOPIC = "pg.public.t"
ENVELOPE = envelope(
    [
        key("id", "long"),
        column("customer_id", "int"),
        column("status", "string"),
        column("amount", DECIMAL_12_2),
        column("created_at", TIMESTAMPTZ),
        column("note", "string"),
    ]
)
BUILD_BATCH = 500_000
CHANGES = 10_000
EPOCH_US = 1_767_225_600_000_000  # 2026-01-01 UTC


class _Catalog:
    def schema(self, header: bytes) -> dict[str, Any]:
        return ENVELOPE


def _peak_rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s() -> float:
    """CPU seconds of this process so far (the machine may be shared: wall is not enough)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        pass  # older kernels: the peak then covers the whole run so far


def _changes(layout: RowLayout, ids: np.ndarray, op: str, lsn: int, salt: int) -> pa.Table:
    """Decoded changes as Spark's executors hand them to the driver (built column-wise)."""
    count = len(ids)
    note = pa.array(np.char.mod("%08x", (ids * 2654435761 + salt) & 0xFFFFFFFF)).cast(pa.string())
    after = pa.StructArray.from_arrays(
        [
            pa.array(ids, pa.int64()),
            pa.array((ids * 7 + salt) % 10_000, pa.int32()),
            pa.array(np.where((ids + salt) % 3 == 0, "new", "shipped")).cast(pa.string()),
            pa.array(
                [Decimal(int(v)).scaleb(-2) for v in (ids * 13 + salt) % 100_000],
                pa.decimal128(12, 2),
            ),
            pa.array(EPOCH_US + ids * 1_000_000, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pc.binary_join_element_wise(note, note, note, note, ""),
        ],
        fields=list(layout.arrow_type()),
    )
    return pa.table(
        {
            "topic": pa.array([TOPIC] * count),
            "partition": pa.array(ids % 4, pa.int32()),
            "offset": pa.array(np.arange(count), pa.int64()),
            "lsn": pa.array(np.full(count, lsn), pa.int64()),
            "seq": pa.array(np.arange(count), pa.int64()),
            "op": pa.array([op] * count),
            "ts_ms": pa.array(np.zeros(count, np.int64)),
            "commit_ts": pa.nulls(count, pa.timestamp("us", tz="UTC")),
            "tx_id": pa.array(np.full(count, lsn), pa.int64()),
            "snapshot": pa.array(np.zeros(count, np.bool_)),
            "source_db": pa.array(["db"] * count),
            "source_schema": pa.array(["public"] * count),
            "source_table": pa.array(["t"] * count),
            "unchanged_toast": pa.nulls(count, pa.list_(pa.string())),
            "before": pa.nulls(count, layout.arrow_type()),
            "after": after,
        }
    ).cast(changes_arrow_schema(layout))


def _apply(job: MirrorJob, batch_id: int, changes: pa.Table, layout: RowLayout) -> None:
    native = NativeChanges(
        TOPIC, b"bench", layout.shape, changes, tuple(range(changes.num_rows)), layout.key_names
    )
    job.apply(batch_id, {TOPIC: [native]})


def _files(root: Path) -> set[str]:
    return {p.name for p in (root / "public.t").glob("*.parquet")}


def run(rows: int, directory: Path, history: bool = False, changes_count: int = CHANGES) -> None:
    layout = RowLayout.from_envelope(ENVELOPE, ("id",))
    if directory.exists():
        shutil.rmtree(directory)
    store = MirrorStore(directory)
    store.open()
    job = MirrorJob(store, _Catalog(), history=HistoryOptions(all_tables=history))  # type: ignore[arg-type]
    batch_id = 0
    lsn = 1_000
    _reset_peak()
    started = time.monotonic()
    cpu = _cpu_s()
    for first in range(1, rows + 1, BUILD_BATCH):
        ids = np.arange(first, min(first + BUILD_BATCH, rows + 1), dtype=np.int64)
        _apply(job, batch_id, _changes(layout, ids, "c", lsn, 0), layout)
        batch_id += 1
        lsn += 1
    build_s = time.monotonic() - started
    print(
        f"rows={rows:>10,}  first build: {build_s:7.1f} s ({_cpu_s() - cpu:7.1f} CPU-s)  "
        f"peak RSS {_peak_rss_mb():7.0f} MB  "
        f"files {len(_files(directory))}",
        flush=True,
    )
    rng = random.Random(17)
    for name, ids in (
        (
            "recent keys",
            rng.sample(range(max(1, rows - 2 * changes_count), rows + 1), changes_count),
        ),
        ("random keys", rng.sample(range(1, rows + 1), changes_count)),
    ):
        changes = _changes(layout, np.array(sorted(ids), np.int64), "u", lsn, batch_id)
        before = _files(directory)
        _reset_peak()
        started = time.monotonic()
        cpu = _cpu_s()
        _apply(job, batch_id, changes, layout)
        apply_s = time.monotonic() - started
        cpu = _cpu_s() - cpu
        written = len(_files(directory) - before)
        print(
            f"rows={rows:>10,}  {changes_count:,} updates, {name}: {apply_s:6.2f} s "
            f"({cpu:5.2f} CPU-s)  "
            f"peak RSS {_peak_rss_mb():7.0f} MB  files written {written}",
            flush=True,
        )
        batch_id += 1
        lsn += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--dir", type=Path, default=None, help="where the tables go (removed)")
    parser.add_argument("--history", action="store_true", help="keep history tables too")
    parser.add_argument("--changes", type=int, default=CHANGES, help="updates per update batch")
    args = parser.parse_args()
    print(
        f"cpus={os.cpu_count()} python={sys.version.split()[0]} pyarrow={pa.__version__} "
        f"load={os.getloadavg()}"
    )
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-mirror-"))
    try:
        for rows in args.rows:
            run(rows, base / f"rows-{rows}", args.history, args.changes)
            shutil.rmtree(base / f"rows-{rows}", ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
