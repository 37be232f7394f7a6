"""Test hooks live in the tests: production reads no test switch from its environment.

The suite shortens a few production waits (the startup retry window, the
slot-creation report interval, the signal-table poll) and arms the mirror's
crash points by setting module attributes in the child process before the
command runs (``tests/support/launch.py``). A stray environment variable on a
production host therefore changes nothing, and a hook that is renamed away
fails the tests that use it instead of being silently ignored.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from support import launch
from support.cdc import PROJECT_ROOT, TEST_HOOKS

import cdcd
from cdcd import daemon
from cdcd.snapshot import incremental
from cdcd.source import slot_wait
from cdcd.spark import faults

PACKAGE = Path(cdcd.__file__).resolve().parent


def test_no_production_module_reads_a_test_variable() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"CDCD_TEST_|CDCD_MIRROR_FAULT", line)
    ]
    assert not offenders, offenders


def test_production_values() -> None:
    assert daemon.STARTUP_RETRY_S == 30.0
    assert slot_wait.SLOT_WAIT_LOG_INTERVAL_S == 5.0
    assert incremental.POLL_INTERVAL_S == 2.0
    assert faults.FAULT == ""


def test_every_suite_hook_names_an_existing_attribute() -> None:
    for name, value in TEST_HOOKS.items():
        module, _, attribute = name.rpartition(".")
        assert hasattr(__import__(module, fromlist=[attribute]), attribute), name
        assert isinstance(value, float)


def test_the_launcher_sets_a_hook_before_the_command_runs(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(PROJECT_ROOT / 'tests')!r})\n"
        "from support import launch\n"
        "import cdcd.cli\n"
        "cdcd.cli.main = lambda argv: print(__import__('cdcd.daemon').daemon.STARTUP_RETRY_S)"
        " or 0\n"
        "sys.exit(launch.main(sys.argv[1:]))\n",
        encoding="utf-8",
    )
    argv = launch.command(["run"], {"cdcd.daemon.STARTUP_RETRY_S": 4.0})
    result = subprocess.run(
        [argv[0], str(probe), *argv[2:]], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4.0"


def test_an_unknown_hook_fails_loudly() -> None:
    result = subprocess.run(
        launch.command(["--version"], {"cdcd.daemon.NO_SUCH_WAIT_S": 1}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "NO_SUCH_WAIT_S: no such attribute" in result.stderr
