"""Rewrites that keep a table's shape: values changed are healed, rows kept are not re-read.

``ALTER COLUMN qty TYPE int USING qty * 10`` on an int column rewrites every
row with a new value and sends a ``Relation`` identical to the old one (or
none, on a table never written again); ``VACUUM FULL`` and ``CLUSTER`` also
give the table new files, but keep every row, and cost no re-snapshot: cdcd
finds a row older than the recorded state in the new files, which an
``ALTER TABLE`` rewrite (it writes every row anew) never leaves.

Each table starts from an initial snapshot, then is rewritten; the written
ones then get a few row changes, the idle ones nothing. Kafka replayed must
equal ``SELECT``; exactly the value-changing rewrites have a finished
``schema-change:`` job; each kept table has its log line and no job.
"""

from __future__ import annotations

import pytest
from support.cdc import wait_for

from .helpers import (
    KEY,
    heal_jobs,
    kafka_differences,
    missing_kinds,
    report,
    write_some,
)

pytestmark = pytest.mark.integration

KEPT_LINE = "the files of public.{t} changed and it holds rows older than its recorded state"


def rewrite_and_compare(populated, rewrites: dict[str, tuple[str, bool, bool]], rows: int) -> None:
    """``rewrites``: table -> (statement, written afterwards, values changed)."""
    sc = populated(list(rewrites), rows=rows)
    before = {t: sc.relfilenode(t) for t in rewrites}
    for table, (statement, _, _) in rewrites.items():
        sc.execute(statement.format(t=table))
    assert all(sc.relfilenode(t) != before[t] for t in rewrites), "premise: new files"
    for table, (_, written, _) in rewrites.items():
        if written:
            write_some(sc.conn, table)
    changed = [t for t, (_, _, values) in rewrites.items() if values]
    kept = [t for t in rewrites if t not in changed]
    problems = sc.settle_heals(changed)
    try:
        wait_for(lambda: all(KEPT_LINE.format(t=t) in sc.daemon.log() for t in kept),
                 timeout_s=120, interval_s=0.2, what="the kept tables' log lines")
    except AssertionError:
        problems += [f"public.{t}: no line '{KEPT_LINE.format(t=t)}' within 120 s" for t in kept
                     if KEPT_LINE.format(t=t) not in sc.daemon.log()]
    log = sc.daemon.log()
    for table in rewrites:
        problems += kafka_differences(sc.pg, sc.bootstrap, sc.prefix, table, KEY)
    for table in changed:
        problems += missing_kinds(log, ["rewrite"], table=f"public.{table}")
    for table in kept:
        if jobs := heal_jobs(sc.pg, f"public.{table}"):
            problems.append(f"public.{table}: its rows were kept, yet re-snapshotted: {jobs}")
    assert not problems, report(problems, log)


def test_same_shape_rewrite_heals_and_kept_rows_do_not(populated) -> None:
    rewrite_and_compare(populated, {
        "s_using": ("ALTER TABLE {t} ALTER COLUMN qty TYPE int USING qty * 10", True, True),
        "s_using_idle": ("ALTER TABLE {t} ALTER COLUMN qty TYPE int USING qty + 1", False, True),
        "s_vacuum": ("VACUUM FULL {t}", True, False),
        "s_cluster_idle": ("CLUSTER {t} USING {t}_pkey", False, False),
    }, rows=300)


@pytest.mark.slow
def test_vacuum_full_of_a_million_rows_starts_no_snapshot(populated) -> None:
    rewrite_and_compare(populated, {"s_big": ("VACUUM FULL {t}", True, False)}, rows=1_000_000)
