"""kill -9 between a migration and its detection, and while the heal runs.

Two tables from an initial snapshot, the catalog check off in the first
daemon. The daemon is frozen; ``k_written`` is rewritten and written to (the
stream would find it at its next ``Relation``), ``k_idle`` is rewritten and
renamed and never written again (only the catalog check can find it); the
daemon is killed before it saw anything. The restarted daemon (check on)
must find both from the recorded states, and is killed again once
``k_idle``'s heal has delivered chunks; the third daemon completes it.
Kafka replayed equals ``SELECT`` for both.
"""

from __future__ import annotations

import pytest
from support.cdc import wait_for

from .helpers import (
    KEY,
    chunks_done,
    heal_jobs,
    kafka_differences,
    report,
    write_some,
)

pytestmark = pytest.mark.integration


def test_kill9_before_detection_and_during_the_heal(populated, cdc_config) -> None:
    sc = populated(["k_written", "k_idle"], rows=3_000, check_interval_s=0,
                   snapshot={"chunk_rows": 50})
    sc.daemon.freeze()
    sc.execute("ALTER TABLE k_written ALTER COLUMN qty TYPE bigint USING qty * 10")
    write_some(sc.conn, "k_written")
    sc.execute("ALTER TABLE k_idle ADD COLUMN r float8 DEFAULT random()")
    sc.execute("ALTER TABLE k_idle RENAME COLUMN note TO memo")
    sc.kill9()
    # The same file, now with the catalog check on.
    assert cdc_config(extra={"snapshot": {"mode": "initial", "chunk_rows": 50},
                             "schema_changes": {"check_interval_s": 1}}) == sc.config
    sc.restart()

    def healing() -> bool:
        return any(j.status == "running" and chunks_done(j) >= 2
                   for j in heal_jobs(sc.pg, "public.k_idle"))

    wait_for(healing, timeout_s=120, interval_s=0.02,
             what="k_idle's heal to have delivered 2 chunks")
    sc.daemon.freeze()  # nothing moves between the check and the kill
    assert healing(), f"the heal ended before the kill: {heal_jobs(sc.pg, 'public.k_idle')}"
    sc.crash()
    problems = sc.settle_heals(["k_written", "k_idle"])
    for table in ("k_written", "k_idle"):
        problems += kafka_differences(sc.pg, sc.bootstrap, sc.prefix, table, KEY)
    assert not problems, report(problems, sc.logs())
