"""``schema_changes.resnapshot: never``: no snapshot job, one warning line per skipped heal.

Two rewrites (a volatile default, a ``USING`` type change) under the writer:
the signal table gets no job, and the daemon log has exactly one WARNING per
change naming ``public.items``, the kind, and ``schema_changes.resnapshot is
never``.
"""

from __future__ import annotations

import pytest

from .helpers import missing_kinds, report, signal_jobs

pytestmark = pytest.mark.integration


def test_never_skips_the_heal_and_warns_once_per_change(scenario) -> None:
    sc = scenario(schema_changes={"resnapshot": "never"})
    sc.ddl_under_load(
        ["ALTER TABLE items ADD COLUMN r float8 DEFAULT random()",
         "ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty * 10"],
        seed=16,
    )
    problems = sc.settle(heal=False)
    if jobs := signal_jobs(sc.pg):
        problems.append(f"public.items: resnapshot is never, but the signal table has {jobs}")
    log = sc.daemon.log()
    problems += missing_kinds(log, ["add_column_rewrite", "type_change_rewrite"])
    warnings = [line for line in log.splitlines() if "schema_changes.resnapshot is never" in line]
    for kind in ("add_column_rewrite", "type_change_rewrite"):
        lines = [w for w in warnings if kind in w]
        if len(lines) != 1 or not all("WARNING" in w and "public.items" in w for w in lines):
            problems.append(f"public.items: expected one WARNING line naming public.items, {kind} "
                            f"and 'schema_changes.resnapshot is never'; got {lines}")
    if len(warnings) != 2:
        problems.append(f"expected 2 'resnapshot is never' warnings (one per change), got "
                        f"{len(warnings)}: {warnings}")
    assert not problems, report(problems, log)
