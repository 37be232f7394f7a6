"""Key migrations on populated, streaming tables: ``cdcd mirror --once`` equals each table (issue 30).

The mirror takes a table's identity from the message key (the replica
identity cdcd keyed the change with), not from a column's nullability: a
column that joins a key stays nullable in the row schema, so older records
still resolve. Four migrations, each preceded and followed by updates
(with and without a key change) and deletes:

- ``gains_pk``: keyless (``REPLICA IDENTITY FULL``, with a duplicate row
  removed before the key exists) -> ``ADD PRIMARY KEY``;
- ``uses_index``: keyless -> ``REPLICA IDENTITY USING INDEX`` on a unique
  ``NOT NULL`` column (updates then carry no old image);
- ``grows``: primary key ``(a)`` -> ``(a, b)`` (updates of ``b`` under the
  old key carry no old image: matched by ``a`` alone);
- ``drops``: primary key -> dropped, back to ``REPLICA IDENTITY FULL``
  (then a duplicate row, matched on whole rows).

Rows exist before the daemon starts (initial snapshot). Two mirrors: one
built before the migrations and caught up after them (its stored rows are
re-keyed in the commit that applies the batch), one built from scratch
afterwards (one batch holds changes written under both identities). With
``schema_changes.resnapshot: never`` nothing but the stream reaches them.
Each must equal ``SELECT`` from PostgreSQL, and no batch may report an
update or delete that matched no row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cdc import DaemonProcess
from support.pg import PgDatabase

from spark.capture import start_capture

pytestmark = [pytest.mark.spark, pytest.mark.integration]

pytest.importorskip("deltalake")

TABLES = ("gains_pk", "uses_index", "grows", "drops")

SETUP = """
CREATE TABLE gains_pk(id int NOT NULL, v text);
ALTER TABLE gains_pk REPLICA IDENTITY FULL;
INSERT INTO gains_pk SELECT g, 'g' || g FROM generate_series(1, 20) g;
CREATE TABLE uses_index(id int, code text NOT NULL, v text);
ALTER TABLE uses_index REPLICA IDENTITY FULL;
INSERT INTO uses_index SELECT g, 'c' || g, 'u' || g FROM generate_series(1, 20) g;
CREATE TABLE grows(a int, b int NOT NULL, v text, PRIMARY KEY (a));
INSERT INTO grows SELECT g, g % 3, 'w' || g FROM generate_series(1, 20) g;
CREATE TABLE drops(id int PRIMARY KEY, v text);
INSERT INTO drops SELECT g, 'd' || g FROM generate_series(1, 20) g;
"""

BEFORE = [
    # keyless: whole-row matches, a duplicate row and its removal
    "UPDATE gains_pk SET v = v || '+' WHERE id % 4 = 0",
    "INSERT INTO gains_pk VALUES (5, 'g5')",
    "UPDATE gains_pk SET id = 105 WHERE id = 5 AND v = 'g5'",
    "DELETE FROM gains_pk WHERE id = 105",
    "UPDATE uses_index SET v = 'moved', code = 'c' || (id + 100) WHERE id IN (1, 2)",
    "DELETE FROM uses_index WHERE id = 3",
    # keyed by (a): updates of b carry no old image
    "UPDATE grows SET b = b + 10 WHERE a IN (4, 5)",
    "DELETE FROM grows WHERE a = 6",
    "UPDATE drops SET v = 'x' || v WHERE id < 5",
    "DELETE FROM drops WHERE id = 7",
]

MIGRATIONS = [
    "ALTER TABLE gains_pk ADD PRIMARY KEY (id)",
    "ALTER TABLE gains_pk REPLICA IDENTITY DEFAULT",
    "CREATE UNIQUE INDEX uses_index_code ON uses_index(code)",
    "ALTER TABLE uses_index REPLICA IDENTITY USING INDEX uses_index_code",
    "ALTER TABLE grows DROP CONSTRAINT grows_pkey, ADD PRIMARY KEY (a, b)",
    "ALTER TABLE drops REPLICA IDENTITY FULL",
    "ALTER TABLE drops DROP CONSTRAINT drops_pkey",
]

AFTER = [
    "UPDATE gains_pk SET v = 'after' WHERE id IN (1, 2, 3)",
    "UPDATE gains_pk SET id = id + 1000 WHERE id = 8",  # a key change
    "DELETE FROM gains_pk WHERE id IN (9, 10)",
    "INSERT INTO gains_pk VALUES (500, 'new')",
    "UPDATE uses_index SET v = 'after' WHERE id IN (4, 5)",  # no old image
    "UPDATE uses_index SET code = 'k' || id WHERE id = 6",  # a key change
    "DELETE FROM uses_index WHERE code IN ('c7', 'c101')",
    "UPDATE grows SET v = 'after' WHERE a IN (1, 4)",
    "UPDATE grows SET b = b + 20 WHERE a = 2",  # a key change: (a, b)
    "DELETE FROM grows WHERE a = 3",
    "INSERT INTO grows VALUES (1, 99, 'same a, other b')",
    "UPDATE drops SET v = 'after' WHERE id IN (1, 11)",
    "UPDATE drops SET id = 111 WHERE id = 12",
    "DELETE FROM drops WHERE id = 13",
    "INSERT INTO drops VALUES (14, 'd14')",  # a duplicate row now
    "UPDATE drops SET v = 'twins' WHERE id = 14",
    "DELETE FROM drops WHERE id = 15",
]


def _rows(pg: PgDatabase, table: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in pg.fetchall(f"SELECT * FROM {table}"))


def _mirrored(output: Path, table: str) -> list[tuple[Any, ...]]:
    from cdcd.spark.mirror import read_mirror

    return sorted(tuple(r.values()) for r in read_mirror(str(output / f"public.{table}")).to_pylist())


def _recorded_key(output: Path, table: str) -> list[str]:
    from deltalake import DeltaTable

    newest = DeltaTable(str(output / f"public.{table}")).history(1)[0]
    key: list[str] = json.loads(newest["cdcd.mirror"])["state"]["key"]
    return key


def test_mirror_follows_key_migrations(
    pg: PgDatabase,
    cdc_config: Callable[..., Path],
    daemons: Callable[[Path], DaemonProcess],
    mirror_once: Callable[[Path, Path], float],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    pg.execute(SETUP)
    config = cdc_config(
        tables=[f"public.{t}" for t in TABLES],
        extra={"snapshot": {"mode": "initial"}, "schema_changes": {"resnapshot": "never"}},
    )
    capture = start_capture(pg, config, daemons)
    daemon = capture.daemon

    for statement in BEFORE:
        pg.execute(statement)
    capture.confirmed()
    warm = tmp_path / "warm"
    mirror_once(config, warm)
    for table in TABLES:
        assert _mirrored(warm, table) == _rows(pg, table), f"{table} before the migrations"

    for statement in MIGRATIONS + AFTER:
        pg.execute(statement)
    capture.confirmed()
    assert daemon.terminate() == 0, daemon.log()

    caplog.set_level(logging.WARNING, logger="cdcd.spark")
    fresh = tmp_path / "fresh"
    mirror_once(config, warm)
    mirror_once(config, fresh)
    for output in (warm, fresh):
        for table in TABLES:
            assert _mirrored(output, table) == _rows(pg, table), f"{table} in {output.name}"
        assert _recorded_key(output, "gains_pk") == ["id"]
        assert _recorded_key(output, "uses_index") == ["code"]
        assert sorted(_recorded_key(output, "grows")) == ["a", "b"]
        assert _recorded_key(output, "drops") == []
    assert not [r.getMessage() for r in caplog.records if "matched no row" in r.getMessage()]
