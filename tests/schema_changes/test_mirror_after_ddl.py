"""``cdcd mirror --once`` after a migration equals PostgreSQL (needs pyspark).

``items`` goes through a fast default, a rename, a dropped column, a
volatile-default rewrite and a ``USING`` type change; ``bins`` is dropped and
re-created with other columns and overlapping keys. All under the writer
(on ``items``). Then one ``cdcd mirror --once`` run builds Delta tables from the
topics, and each mirrored table must equal PostgreSQL, row for row and value
for value, with PostgreSQL's column names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cdc import PROJECT_ROOT

from .helpers import KEY, differences, normalize, report, source_rows

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pytest.importorskip("pyspark")
pytest.importorskip("deltalake")

SPARK_ENV = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}

BINS = "CREATE TABLE bins(id int PRIMARY KEY, label text, weight int)"
RECREATE_BINS = """BEGIN;
DROP TABLE bins;
CREATE TABLE bins(id int PRIMARY KEY, label text NOT NULL, volume numeric(8,1));
INSERT INTO bins SELECT g, 'new-' || g, g / 10.0 FROM generate_series(40, 90) g;
COMMIT"""


def mirror_once(config: Path, output: Path, log: Path) -> None:
    with open(log, "wb") as out:
        result = subprocess.run(
            [sys.executable, "-m", "cdcd", "mirror", "-c", str(config), "--output", str(output),
             "--once"],
            cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=300,
            env={**os.environ, **SPARK_ENV},
        )
    assert result.returncode == 0, log.read_text(encoding="utf-8", errors="replace")[-5000:]


def mirror_differences(conn: Any, output: Path, table: str) -> list[str]:
    types, expected = source_rows(conn, table, KEY)
    path = output / f"public.{table}"
    if not path.exists():
        return [f"public.{table}: no mirror at {path}"]
    from cdcd.spark.mirror import read_mirror

    data = read_mirror(str(path))
    actual = {}
    for row in data.to_pylist():
        normalized = {c: normalize(v, types.get(c, "")) for c, v in row.items()}
        actual[tuple(normalized[k] for k in KEY)] = normalized
    return differences(table, types, expected, data.column_names, actual, "the mirror")


def test_mirror_once_after_many_ddls(scenario, tmp_path: Path) -> None:
    sc = scenario()
    sc.execute(BINS)
    sc.execute("INSERT INTO bins SELECT g, 'old-' || g, g FROM generate_series(1, 60) g")
    sc.ddl_under_load(
        ["ALTER TABLE items ADD COLUMN region text DEFAULT 'eu'",
         "ALTER TABLE items RENAME COLUMN note TO memo",
         "ALTER TABLE items DROP COLUMN price",
         "ALTER TABLE items ADD COLUMN r float8 DEFAULT random()",
         "ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty * 10",
         RECREATE_BINS],
        seed=17,
    )
    problems = sc.settle(heal=True)
    output = tmp_path / "mirror"
    mirror_once(sc.config, output, tmp_path / "mirror.log")
    problems += mirror_differences(sc.conn, output, "items")
    problems += mirror_differences(sc.conn, output, "bins")
    assert not problems, report(problems, sc.logs())
