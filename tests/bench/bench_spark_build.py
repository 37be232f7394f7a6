"""The driver's memory for an initial build, with and without the executors writing (issue 28).

Run: ``.venv/bin/python -m tests.bench.bench_spark_build [--rows 1000000] [--dir D]
[--modes driver executors] [--batch-rows 500000] [--code DIR] [--resnapshot]``. Not a
test, and not run by the suite.

One micro-batch holds the snapshot of an ``orders``-like table (bigint key,
int, text, numeric(12,2), timestamptz, a 32-character text): ``--rows``
snapshot reads on 4 Kafka partitions, encoded by the daemon's own encoder
(:mod:`spark.envelopes`) and stored once as the ``cdcd-kafka`` source's raw
rows in Parquet (``D/raw-<rows>``, kept between runs), so that the Kafka
read is not measured and the raw rows never pass through the driver. Each
mode then runs in a fresh process with a ``local[2]`` session:
:meth:`cdcd.spark.mirror.MirrorJob.process` of the whole batch, the way
``foreachBatch`` calls it.

* ``driver``: ``bulk_rows=None``, today's path before issue 28's last step
  -- the executors decode and reduce, the driver collects the reduced rows
  (``toArrow``), applies and writes them;
* ``executors``: the default ``bulk_rows`` -- the executors write the data
  files, the driver commits their add actions (:mod:`cdcd.spark.bulk`).

``--batch-rows N`` splits the build into micro-batches of ``N`` rows (a
multiple of 100 000), the way ``cdcd mirror --once`` reads at most 500 000
offsets per batch: the first batch creates the table, the others add to it.
``--code DIR`` runs the children with another copy of the ``cdcd`` package
first on ``sys.path`` (an older commit's, to compare before and after).

Both modes run with ``spark.driver.memory=4g`` and
``spark.driver.maxResultSize=0``: with Spark's defaults (1 GB each) the
``driver`` mode cannot collect a multi-million-row snapshot at all.

``--resnapshot`` measures instead one micro-batch re-snapshotting a table the
mirror holds (``--rows`` snapshot reads of the same keys, every tenth row
with another status, as after a rewriting migration): the table is built
once (executors mode, kept in ``D/built-<rows>``), copied for each mode, and
the child process applies only the re-snapshot batch to it -- ``driver``
collects it (``bulk_rows=None``), ``rewrite`` lets the executors rewrite the
table (:mod:`cdcd.spark.rewrite`; the default ``bulk_rows``, the executors'
attempt to append finding the keys stored first).

Printed per mode, for the batch: wall seconds; CPU seconds of the whole
process tree (driver, JVM, Python workers, from ``/proc``); the Python driver's peak RSS (``VmHWM``) and the
peak of its Arrow memory pool; the JVM's peak RSS; rows in the table (read
back) and its data files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
import pyarrow.parquet as pq

PARTITIONS = 4
CHUNK = 100_000


def _generate(rows: int, target: Path, lsn: int = 1000, changed_every: int = 0) -> None:
    """The raw Kafka rows of ``rows`` snapshot reads, one Parquet file per partition chunk
    (at ``lsn``; every ``changed_every``-th row with another status)."""
    from spark.envelopes import EnvelopeFactory, kafka_batch, table_version

    from bench.bench_spark_decode import ORDERS

    table = table_version("public", "orders", ORDERS[:6])  # without flags and payload
    target.mkdir(parents=True)
    factory = EnvelopeFactory(partitions=PARTITIONS)
    for start in range(0, rows, CHUNK):
        factory.messages.clear()
        for i in range(start, min(start + CHUNK, rows)):
            factory.change(
                table,
                "r",
                after=[
                    i,
                    i * 7 % 10_000,
                    "migrated"
                    if changed_every and i % changed_every == 0
                    else "shipped"
                    if i % 3
                    else "new",
                    f"{i % 100_000 / 100:.2f}",
                    "2026-01-01 00:00:00+00",
                    f"{i * 2654435761 & 0xFFFFFFFF:08x}" * 4,
                ],
                lsn=lsn,
                seq=i,
                partition=i % PARTITIONS,
            )
        pq.write_table(
            pa.Table.from_batches([kafka_batch(factory.messages)]),
            target / f"chunk-{start // CHUNK:05d}.parquet",
        )
    (target / "schemas.json").write_text(json.dumps(factory.published))


def _status_mb(pid: int | str, field: str) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants (with what they reaped)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(v) for v in fields[11:15]) / tick
    total = 0.0
    for pid, cpu in times.items():
        walk = pid
        while walk > 1 and walk != root:
            walk = parents.get(walk, 0)
        if walk == root:
            total += cpu
    return total


def _build(
    raw_dir: Path, output: Path, mode: str, batch_rows: int, first_batch: int = 0
) -> dict[str, Any]:
    """One build in this process (the mode's child); with ``first_batch`` > 0, the
    batches applied to the table already in ``output``."""
    from cdcd.consumer import SchemaCatalog, fingerprint_header
    from cdcd.spark import bulk
    from cdcd.spark.cli import build_session
    from cdcd.spark.mirror import MirrorJob, MirrorStore, read_mirror

    catalog = SchemaCatalog("pg")
    for fingerprint, text in json.loads((raw_dir / "schemas.json").read_text()).items():
        catalog.add(fingerprint_header(fingerprint), json.loads(text))
    catalog.refresh = lambda: None  # type: ignore[method-assign]  # no broker: all schemas known
    # The same settings for both modes; the driver mode needs both to collect a
    # whole snapshot (its results pass the JVM's heap and the 1 GB result cap).
    spark = build_session(
        "bench-spark-build",
        master="local[2]",
        conf={"spark.driver.memory": "4g", "spark.driver.maxResultSize": "0"},
    )
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jvm_pid = jvm.ProcessHandle.current().pid()
    chunks = sorted(str(p) for p in raw_dir.glob("*.parquet"))
    per_batch = max(1, batch_rows // CHUNK) if batch_rows else len(chunks)
    store = MirrorStore(output)
    store.open()
    job = MirrorJob(store, catalog, bulk_rows=None if mode == "driver" else bulk.BULK_ROWS)
    reports = []
    job.ready.set()
    cpu_before = _tree_cpu_s(os.getpid())
    started = time.monotonic()
    changes = 0
    for batch_id, first in enumerate(range(0, len(chunks), per_batch), start=first_batch):
        raw = spark.read.parquet(*chunks[first : first + per_batch])
        report = job.process(raw, batch_id)
        changes += report.changes
        reports.append(report.executors)
    wall = time.monotonic() - started
    result = {
        "wall_s": wall,
        "cpu_s": _tree_cpu_s(os.getpid()) - cpu_before,
        "driver_peak_rss_mb": _status_mb("self", "VmHWM"),
        "driver_arrow_peak_mb": pa.default_memory_pool().max_memory() / 2**20,
        "jvm_peak_rss_mb": _status_mb(jvm_pid, "VmHWM"),
        "changes": changes,
        "code": bulk.__file__,
        "paths": reports,
    }
    spark.stop()
    table = output / "public.orders"
    result["rows"] = read_mirror(str(table)).num_rows
    from deltalake import DeltaTable

    result["files"] = len(DeltaTable(str(table)).file_uris())
    return result


def _raw(raw_dir: Path, rows: int, lsn: int = 1000, changed_every: int = 0) -> None:
    """Generate the raw rows into ``raw_dir`` unless an earlier run did."""
    if not (raw_dir / "schemas.json").exists():
        shutil.rmtree(raw_dir, ignore_errors=True)
        started = time.monotonic()
        _generate(rows, raw_dir, lsn, changed_every)
        print(f"generated {rows:,} raw rows in {time.monotonic() - started:.0f} s", flush=True)


def _child(
    raw_dir: Path,
    output: Path,
    mode: str,
    batch_rows: int,
    first_batch: int,
    base: Path,
    env: dict[str, str],
) -> dict[str, Any] | None:
    """One mode's run in a fresh process: its result, None (reported) if it failed."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.bench.bench_spark_build",
            "--child",
            str(raw_dir),
            str(output),
            mode,
            str(first_batch),
            "--batch-rows",
            str(batch_rows),
        ],  # fmt: skip
        env=env,
        cwd=base,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(f"{mode}: failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}", flush=True)
        return None
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=None, help="raw rows are kept here")
    parser.add_argument("--modes", nargs="+", default=["driver", "executors"])
    parser.add_argument("--batch-rows", type=int, default=0, help="rows per micro-batch")
    parser.add_argument("--code", type=Path, default=None, help="another cdcd package's parent")
    parser.add_argument("--resnapshot", action="store_true", help="re-snapshot a built table")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        raw_dir, output, mode, first_batch = args.child
        measured = _build(Path(raw_dir), Path(output), mode, args.batch_rows, int(first_batch))
        print(json.dumps(measured), flush=True)
        return
    print(f"cpus={os.cpu_count()} python={sys.version.split()[0]} load={os.getloadavg()}")
    base = (args.dir or Path(tempfile.mkdtemp(prefix="bench-spark-build-"))).resolve()
    raw_dir = base / f"raw-{args.rows}"
    _raw(raw_dir, args.rows)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    # The children run outside the project directory, so that the driver and the
    # Python workers Spark starts import cdcd from --code when it is given.
    project = str(Path(__file__).resolve().parents[2])
    code = [str(args.code.resolve())] if args.code is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*code, project, env.get("PYTHONPATH", "")])
    first_batch = 0
    built: Path | None = None
    if args.resnapshot:
        built = base / f"built-{args.rows}"
        if not (built / "public.orders" / "_delta_log").exists():
            shutil.rmtree(built, ignore_errors=True)
            result = _child(raw_dir, built, "executors", 0, 0, base, env)
            if result is None:
                return
            print(f"built {args.rows:,} rows in {result['wall_s']:.0f} s", flush=True)
        raw_dir = base / f"raw-{args.rows}-resnapshot"
        _raw(raw_dir, args.rows, lsn=2000, changed_every=10)
        first_batch = 1
    for mode in args.modes:
        output = base / f"mirror-{mode}-{os.getpid()}"  # runs may share --dir
        shutil.rmtree(output, ignore_errors=True)
        if built is not None:
            shutil.copytree(built, output)
        result = _child(raw_dir, output, mode, args.batch_rows, first_batch, base, env)
        if result is None:
            continue
        what = "re-snapshot" if args.resnapshot else "batches"
        print(
            f"rows={args.rows:>10,} mode={mode:9} {what} of {args.batch_rows or args.rows:,} "
            f"({result['code']}): {result['wall_s']:7.1f} s wall, "
            f"{result['cpu_s']:7.1f} CPU-s (driver, JVM, workers); "
            f"driver peak RSS {result['driver_peak_rss_mb']:7.0f} MB, "
            f"driver Arrow peak {result['driver_arrow_peak_mb']:7.0f} MB, "
            f"JVM peak RSS {result['jvm_peak_rss_mb']:7.0f} MB; "
            f"{result['rows']:,} rows in {result['files']} files; "
            f"written by the executors: {result['paths']}",
            flush=True,
        )
        shutil.rmtree(output, ignore_errors=True)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
