"""cdcd's packages import each other only downwards along the data flow (issue 15).

The check itself is ``python -m tests.support.import_layers`` (also run by
``.ci/test``); these tests run it and show that it catches what it claims to.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.import_layers import (
    ROOT,
    Site,
    _allowed,
    _targets,
    import_graph,
    violations,
)


def test_cdcd_has_no_import_cycle_or_upward_import() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.import_layers"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pipeline -> snapshot" in result.stdout  # the graph is printed


def test_a_loop_and_an_upward_import_are_reported() -> None:
    site = Site("cdcd/x.py", 1, "cdcd.x", False)
    problems = violations({("decode", "envelope"): [site], ("envelope", "decode"): [site]})
    assert "import cycle between packages: decode <-> envelope" in problems
    assert any(p.startswith("upward or sideways import: decode (layer") for p in problems)
    # The tracker and the sink share a layer: neither may import the other.
    assert violations({("ack", "sink"): [site]})[0].startswith("upward or sideways import: ack")


def test_restricted_packages_and_unknown_packages_are_reported() -> None:
    producer = Site("cdcd/spark/reader.py", 1, "cdcd.sink.producer", False)
    topics = Site("cdcd/spark/reader.py", 2, "cdcd.sink.topics", False)
    local = Site("cdcd/daemon.py", 3, "cdcd.tools.local", False)
    problems = violations(
        {
            ("spark", "sink"): [producer, topics],
            ("daemon", "tools"): [local],
            ("nova", "errors"): [local],
        }
    )
    spark = problems.index("    cdcd/spark/reader.py:1 cdcd.sink.producer")
    assert problems[spark - 1].startswith("spark may only use")
    # admin_config moved to cdcd.config: spark may use no module of sink at all.
    assert "    cdcd/spark/reader.py:2 cdcd.sink.topics" in problems
    # An entry ``package.module`` allows that module only.
    assert _allowed("cdcd.sink.topics", frozenset({"sink.topics"}))
    assert not _allowed("cdcd.sink.producer", frozenset({"sink.topics"}))
    assert any(p.startswith("tools may only be used by cli, not daemon") for p in problems)
    assert any("'nova' has no layer" in p for p in problems)


def test_function_level_relative_and_lazy_imports_count() -> None:
    tree = ast.parse(
        "def f():\n"
        "    from cdcd.pipeline import session\n"
        "    from ..sink.producer import KafkaSink\n"
        "    importlib.import_module('cdcd.daemon')\n"
        "    logging.getLogger('cdcd.snapshot')\n"
    )
    found = {(module, dynamic) for _, module, dynamic in _targets(tree, "cdcd.ack.tracker", False)}
    assert found == {
        ("cdcd.pipeline.session", False),
        ("cdcd.sink.producer", False),
        ("cdcd.daemon", True),
    }


def test_the_graph_sees_the_real_edges() -> None:
    edges = import_graph()
    assert ("pipeline", "ack") in edges
    assert ("decode", "avro") in edges and ("envelope", "avro") in edges
    assert all(site.path.startswith("cdcd/") for sites in edges.values() for site in sites)


def test_the_daemon_importing_an_operator_tool_is_refused(tmp_path: Path) -> None:
    """A copy of cdcd whose session imports the demo fails the check, naming the line."""
    copy = tmp_path / "cdcd"
    shutil.copytree(ROOT / "cdcd", copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert violations(import_graph(copy)) == []
    session = copy / "pipeline" / "session.py"
    text = session.read_text(encoding="utf-8")
    line = text.count("\n") + 1
    session.write_text(text + "from cdcd.tools.demo import cmd_demo  # noqa\n", encoding="utf-8")
    problems = violations(import_graph(copy))
    assert any(p.startswith("tools may only be used by cli, not pipeline") for p in problems)
    assert f"    cdcd/pipeline/session.py:{line} cdcd.tools.demo" in problems
    # tools sits above the daemon too: the same import is an upward one.
    assert any(p.startswith("upward or sideways import: pipeline (layer") for p in problems)
    # The command line is the one package that may use the tools.
    assert ("cli", "tools") in import_graph()
