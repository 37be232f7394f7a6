"""kill -9 of the daemon between a rewriting DDL and its heal, and while the heal runs.

1. The daemon is frozen (SIGSTOP), a ``USING`` type change and one row change
   are committed, and the daemon is killed: it never saw the change. The
   restarted daemon meets the new relation with an empty cache and must still
   recognise the rewrite and heal it. Then a second rewrite plus one row
   change, and a kill with no freeze, wherever the daemon happens to be
   (detected, heal requested, heal running...).
2. A volatile-default rewrite of a few thousand rows re-snapshotted in small
   chunks; the daemon is killed once the signal table shows delivered chunks.
   After the restart the job completes.

Either way nothing may be lost: the topic replays to the table.
"""

from __future__ import annotations

import pytest
from support.cdc import wait_for

from .helpers import chunks_done, heal_jobs, report

pytestmark = pytest.mark.integration


def test_kill9_between_ddl_and_heal(scenario) -> None:
    sc = scenario()
    workload = sc.writer(seed=14)
    workload.wait_more(20)
    sc.daemon.freeze()
    sc.execute("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty * 10")
    sc.execute("UPDATE items SET name = 'right after the DDL' WHERE id = 1")
    sc.crash()
    workload.wait_more(20)
    sc.execute("ALTER TABLE items ALTER COLUMN price TYPE numeric(12,3) USING price * 2")
    sc.execute("UPDATE items SET name = 'right after the second DDL' WHERE id = 2")
    sc.crash()
    workload.wait_more(20)
    workload.finish()
    problems, _ = sc.outcome(heal=True, kinds=[])
    # No kind is asserted: a restarted daemon may only know "something changed" (unknown).
    assert not problems, report(problems, sc.logs())


def test_kill9_while_the_resnapshot_runs(scenario) -> None:
    sc = scenario(rows=4_000, snapshot={"chunk_rows": 50})
    workload = sc.writer(seed=15)
    workload.wait_more(20)
    sc.execute("ALTER TABLE items ADD COLUMN r float8 DEFAULT random()")
    workload.wait_more(5)
    try:
        running = wait_for(
            lambda: [j for j in heal_jobs(sc.pg) if j.status == "running" and chunks_done(j) >= 2],
            timeout_s=60, interval_s=0.02, what="a schema-change job with 2 delivered chunks")
    except AssertionError:
        workload.finish()
        problems = [f"public.items: no 'schema-change:' job with delivered chunks within 60 s "
                    f"of a DEFAULT random() rewrite (jobs: {heal_jobs(sc.pg) or 'none'})"]
        problems += sc.compare()
        raise AssertionError(report(problems, sc.logs())) from None
    sc.daemon.freeze()  # the job's state cannot move between this check and the kill
    job = next(j for j in heal_jobs(sc.pg) if j.id == running[0].id)
    assert job.status == "running", f"the re-snapshot ended before the kill: {job}"
    sc.crash()
    workload.wait_more(20)
    workload.finish()
    problems, _ = sc.outcome(heal=True, kinds=[])
    assert not problems, report(problems, sc.logs())
