"""``cdcd mirror --once`` after a migration equals PostgreSQL (needs pyspark).

``items`` goes through a fast default, a rename, a dropped column, a
volatile-default rewrite and a ``USING`` type change; ``bins`` is dropped and
re-created with other columns and overlapping keys. All under the writer
(on ``items``). Besides, one table per DDL class of SPEC §5 (issue 24,
``helpers.CASES``) is migrated and never written again: only the catalog
check (``check_interval_s: 1``) can bring those to consumers. Then one
``cdcd mirror --once`` run builds Delta tables from the topics, and each
mirrored table must equal PostgreSQL, row for row and value for value, with
PostgreSQL's column names (the idle tables in Kafka too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import (
    CASES,
    KEY,
    create_items,
    kafka_differences,
    migrate_idle,
    mirror_differences,
    mirror_once,
    report,
    wait_confirmed,
)

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pytest.importorskip("pyspark")
pytest.importorskip("deltalake")

BINS = "CREATE TABLE bins(id int PRIMARY KEY, label text, weight int)"
RECREATE_BINS = """BEGIN;
DROP TABLE bins;
CREATE TABLE bins(id int PRIMARY KEY, label text NOT NULL, volume numeric(8,1));
INSERT INTO bins SELECT g, 'new-' || g, g / 10.0 FROM generate_series(40, 90) g;
COMMIT"""


def test_mirror_once_after_many_ddls(scenario, tmp_path: Path) -> None:
    sc = scenario(schema_changes={"check_interval_s": 1})
    sc.execute(BINS)
    sc.execute("INSERT INTO bins SELECT g, 'old-' || g, g FROM generate_series(1, 60) g")
    idle = {name: f"idle_{name}" for name in CASES}
    for table in idle.values():
        create_items(sc.conn, table, 120)
    wait_confirmed(sc.pg, sc.slot, sc.daemon)
    migrate_idle(sc, idle)
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
    problems += sc.settle_heals(list(idle.values()))
    output = tmp_path / "mirror"
    mirror_once(sc.config, output, tmp_path / "mirror.log")
    for table in ["items", "bins", *idle.values()]:
        problems += mirror_differences(sc.conn, output, table)
    for table in idle.values():
        problems += kafka_differences(sc.pg, sc.bootstrap, sc.prefix, table, KEY)
    assert not problems, report(problems, sc.logs())
