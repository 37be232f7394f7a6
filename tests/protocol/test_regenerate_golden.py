"""The golden capture stays reproducible: re-run it against a real PostgreSQL 15.

Runs ``capture_golden.capture_all`` into a temporary directory on a private
throwaway cluster and checks that every scenario produces the same message
types as the committed ``golden/`` files (the exact message sequence for the
scenarios that do not stream; stream block counts depend on memory
accounting), and that the fresh capture passes the same content checks as
the committed one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cdcd.tools.local.postgres import LocalPostgres

from .capture_golden import CLUSTER_SETTINGS, SCENARIOS
from .capture_golden import capture_all as run_capture
from .test_golden import CHECKS, GOLDEN_DIR, load_golden

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_capture_reproduces_the_golden_files(
    make_pg_cluster: Callable[..., LocalPostgres], tmp_path: Path
) -> None:
    started = time.monotonic()
    cluster = make_pg_cluster(settings=CLUSTER_SETTINGS)
    lines: list[str] = []
    documents = run_capture(tmp_path, cluster=cluster, log=lines.append)

    committed_names = sorted(p.stem for p in GOLDEN_DIR.glob("*.json"))
    assert sorted(documents) == committed_names == sorted(s.name for s in SCENARIOS)
    for name in committed_names:
        fresh, committed = load_golden(tmp_path, name), load_golden(GOLDEN_DIR, name)
        assert fresh.proto_version == committed.proto_version
        assert fresh.options == committed.options
        assert set(fresh.shape()) == set(committed.shape()), name
        if not fresh.options["streaming"]:
            assert fresh.shape() == committed.shape(), name
        CHECKS[name](fresh)
    # Well inside the budget of the suite (the capture itself takes a few seconds).
    assert time.monotonic() - started < 60, "\n".join(lines)
