"""Fixtures for the Spark tests: one shared SparkSession, daemons and mirror processes.

- ``spark`` (session): ``local[2]``, two shuffle partitions, UTC, no UI --
  built by :func:`cdcd.spark.cli.build_session`, so tests run with the
  settings ``cdcd mirror`` uses. Skips when pyspark is missing.
- ``cdc_config`` / ``daemons``: as in ``tests/pipeline`` (a config per test
  with its own topic prefix and slot; daemons killed after the test).
- ``mirrors``: ``python -m cdcd mirror ...`` child processes, killed after
  the test.
- ``mirror_once``: ``cdcd mirror --once`` run in this process on the shared
  session (what the command does after building its session), saving a
  JVM start per run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import launch
from support.cdc import PROJECT_ROOT

SPARK_ENV = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    for key, value in SPARK_ENV.items():
        os.environ.setdefault(key, value)
    from cdcd.spark.cli import build_session

    session = build_session(
        "cdcd-tests", master="local[2]", conf={"spark.sql.shuffle.partitions": "2"}
    )
    try:
        yield session
    finally:
        session.stop()


class MirrorProcess:
    """``python -m cdcd mirror -c FILE --output DIR [--once]`` as a child process."""

    def __init__(
        self,
        config: Path,
        output: Path,
        log_path: Path,
        once: bool,
        history: bool = False,
        fault: str = "",
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        args = ["mirror", "-c", str(config), "--output", str(output)]
        if once:
            args.append("--once")
        if history:
            args.append("--history")
        self.proc = subprocess.Popen(
            launch.command(args, {"cdcd.spark.faults.FAULT": fault} if fault else None),
            cwd=PROJECT_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SPARK_ENV},
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.flush()

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.alive():
            self.proc.terminate()
        return self.wait(timeout_s)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@pytest.fixture
def mirrors(tmp_path: Path) -> Iterator[Callable[..., MirrorProcess]]:
    started: list[MirrorProcess] = []

    def start(
        config: Path, output: Path, *, once: bool, history: bool = False, fault: str = ""
    ) -> MirrorProcess:
        process = MirrorProcess(
            config, output, tmp_path / f"mirror-{len(started)}.log", once, history, fault
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


@pytest.fixture
def mirror_once(spark: Any) -> Callable[..., float]:
    """Run ``cdcd mirror --once [--history]`` on the shared session; returns its duration
    in seconds."""
    import time

    from cdcd.config.model import load_config
    from cdcd.spark.cli import run_mirror

    def run(config: Path, output: Path, *, history: bool = False) -> float:
        started = time.monotonic()
        try:
            assert (
                run_mirror(load_config(config), output, once=True, spark=spark, history=history)
                == 0
            )
        finally:
            print(f"mirror --once into {output.name}: {time.monotonic() - started:.1f} s")
        return time.monotonic() - started

    return run
