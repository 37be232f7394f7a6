"""Shared pieces of the filter tests: publications, configs, waits, and the comparison.

The comparison reads the topics with ``support.cdc.read_resolved_changes``
(plain fastavro, no cdcd code), replays them in (cdcd.lsn, cdcd.seq) order and
compares with what PostgreSQL itself answers to ``SELECT <columns> FROM t
WHERE <filter>``.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support import cdc
from support.cdc import (
    Change,
    read_resolved_changes,
    replay,
    row_record,
    run_cdcd,
    wait_for,
)
from support.pg import PgDatabase

#: cdcd creates the publication (``create_publication: true``, 16a's work) or
#: finds one made by hand (``create_publication: false``).
OWNED = pytest.param(
    True,
    id="owned",
)
NOT_OWNED = pytest.param(False, id="not-owned")
OWNERSHIP = [OWNED, NOT_OWNED]


def slot_of(pg: PgDatabase) -> str:
    return "cdcd_" + pg.dbname[:50]


def table_entry(
    name: str, where: str | None = None, columns: list[str] | None = None, **more: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name}
    if where is not None:
        entry["where"] = where
    if columns is not None:
        entry["columns"] = columns
    entry.update(more)
    return entry


def publication_sql(entries: list[dict[str, Any]], via_root: bool = True) -> str:
    """The CREATE PUBLICATION an operator would write for ``entries`` (name 'cdcd')."""
    parts = []
    for entry in entries:
        part = entry["name"]
        if entry.get("columns"):
            part += " (" + ", ".join(entry["columns"]) + ")"
        if entry.get("where"):
            part += f" WHERE ({entry['where']})"
        parts.append(part)
    return (
        f"CREATE PUBLICATION cdcd FOR TABLE {', '.join(parts)} "
        f"WITH (publish_via_partition_root = {str(via_root).lower()})"
    )


def postgres_section(
    pg: PgDatabase, owned: bool, entries: list[dict[str, Any]], via_root: bool = True
) -> dict[str, Any]:
    """The ``postgres`` overrides; without ownership the publication is made here, by hand."""
    if not owned:
        pg.execute(publication_sql(entries, via_root))
    return {
        "tables": entries,
        "create_publication": owned,
        "publish_via_partition_root": via_root,
    }


def wait_streaming(pg: PgDatabase, daemon: Any = None, timeout_s: float = 120) -> None:
    """Until the daemon of ``pg``'s slot streams (see ``support.cdc.wait_streaming``)."""
    cdc.wait_streaming(pg, slot_of(pg), daemon, timeout_s)


def wait_caught_up(pg: PgDatabase, daemon: Any = None, timeout_s: float = 120) -> None:
    """Until the daemon of ``pg``'s slot confirmed everything written so far."""
    cdc.wait_wal_confirmed(pg.connect(), slot_of(pg), daemon, timeout_s)


def stream_workload(pg: PgDatabase, daemons: Any, config: Path, workload: list[str]) -> Any:
    """A daemon on ``config`` (the ``daemons`` fixture), once it streams, then ``workload``
    run statement by statement; returns the daemon."""
    daemon = daemons(config)
    wait_streaming(pg, daemon)
    for statement in workload:
        pg.execute(statement)
    return daemon


def normalize(value: Any) -> Any:
    if isinstance(value, Decimal):
        return value.normalize()
    if isinstance(value, memoryview):
        return bytes(value)
    return value


def expected_rows(pg: PgDatabase, query: str, key: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """``query``'s rows by ``key``, as PostgreSQL answers it."""
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute(query)
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, map(normalize, r), strict=True)) for r in cur.fetchall()]
    return {tuple(r[k] for k in key): r for r in rows}


def replayed(changes: list[Change], key: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {
        k: {name: normalize(v) for name, v in row.items()}
        for k, row in replay(changes, key).items()
    }


def read_topics(broker: Any, prefix: str, topics: list[str]) -> Any:
    return read_resolved_changes(broker.bootstrap_servers, prefix, topics, timeout_s=60, idle_s=2.0)


def row_fields(value_schema: Any) -> list[str]:
    """Field names of the row record of an envelope schema (JSON)."""
    return [f["name"] for f in row_record(value_schema)["fields"]]


def assert_same(got: dict[Any, Any], want: dict[Any, Any]) -> None:
    missing = sorted(set(want) - set(got), key=repr)
    extra = sorted(set(got) - set(want), key=repr)
    wrong = sorted((k for k in set(want) & set(got) if want[k] != got[k]), key=repr)
    assert not (missing or extra or wrong), (
        f"{len(missing)} missing (e.g. {missing[:5]}), {len(extra)} extra (e.g. {extra[:5]}), "
        f"{len(wrong)} differ (e.g. {[(k, got[k], want[k]) for k in wrong[:3]]})"
    )


def config_path(tmp_path: Path) -> Path:
    return tmp_path / "cdcd.yaml"


@dataclass
class RegionWriter:
    """Single-row transactions on ``table``(id, region, amount, ...) until stopped.

    Inserts on both sides of ``region = 'eu'``, moves rows between regions
    (in and out of the filter), updates amounts and deletes.
    """

    pg: PgDatabase
    table: str
    max_id: int
    seed: int = 1
    stop: threading.Event = field(default_factory=threading.Event)
    writes: int = 0
    failure: list[BaseException] = field(default_factory=list)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        rng = random.Random(self.seed)
        conn = self.pg.connect()
        conn.autocommit = True
        next_id = self.max_id + 1_000_000 * self.seed
        try:
            with conn.cursor() as cur:
                while not self.stop.is_set():
                    choice = rng.random()
                    key = rng.randrange(1, self.max_id + 1)
                    if choice < 0.2:
                        next_id += 1
                        cur.execute(
                            f"INSERT INTO {self.table}(id, region, amount) VALUES (%s, %s, %s)",
                            (next_id, rng.choice(("eu", "us")), rng.randrange(10_000)),
                        )
                    elif choice < 0.5:
                        cur.execute(
                            f"UPDATE {self.table} SET region = CASE region WHEN 'eu' THEN 'us' "
                            "ELSE 'eu' END WHERE id = %s",
                            (key,),
                        )
                    elif choice < 0.85:
                        cur.execute(
                            f"UPDATE {self.table} SET amount = amount + 1 WHERE id = %s", (key,)
                        )
                    else:
                        cur.execute(f"DELETE FROM {self.table} WHERE id = %s", (key,))
                    self.writes += 1
        except Exception as exc:  # noqa: BLE001 - raised again by finish() in the test thread
            self.failure.append(exc)
        finally:
            conn.close()

    def start(self) -> RegionWriter:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def wait_writes(self, more: int) -> None:
        """Until ``more`` further writes are committed (progress, not time)."""
        target = self.writes + more
        wait_for(lambda: self.writes >= target or self.failure, timeout_s=60, interval_s=0.05,
                 what=f"{more} more writes")

    def finish(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.failure:
            raise self.failure[0]


def request_snapshot(config: Path, table: str) -> str:
    """``cdcd snapshot --table``: the job id it printed."""
    result = run_cdcd("snapshot", "-c", str(config), "--table", table, timeout_s=60)
    assert result.returncode == 0, result.stderr
    match = re.search(r"requested incremental snapshot (\S+) of", result.stdout)
    assert match, result.stdout
    return match.group(1)


def job_status(pg: PgDatabase, job_id: str) -> str | None:
    if pg.fetchone("SELECT to_regclass('public.cdcd_signal')")[0] is None:  # type: ignore[index]
        return None
    row = pg.fetchone("SELECT status FROM cdcd_signal WHERE id = %s", (job_id,))
    return str(row[0]) if row else None
