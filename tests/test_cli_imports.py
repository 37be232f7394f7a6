"""ImportErrors in ``cdcd demo | bench | mirror`` (issue 15).

Only a missing optional dependency (the ``spark`` extra of ``cdcd mirror``)
is reported as what it is, one line with exit code 2 naming the module and
the extra to install; any other ImportError inside a command is a broken
installation or a bug and propagates with its own message -- never "not
implemented in this version".
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cdcd import cli

_real_import = builtins.__import__


def _failing_import(
    monkeypatch: pytest.MonkeyPatch, fails: Callable[[str, tuple[str, ...]], ImportError | None]
) -> None:
    """Make ``import`` raise what ``fails(module, fromlist)`` returns (None: import normally)."""

    def fake(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        error = fails(name, tuple(fromlist or ()))
        if error is not None:
            raise error
        return _real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake)


def _unload(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Forget ``module`` and its submodules so the command imports them again (patched import)."""
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            monkeypatch.delattr(sys.modules[parent], child)


@pytest.mark.parametrize(
    ("command", "module", "inner"),
    [
        ("demo", "cdcd.tools.demo", "cdcd.tools.local.workload"),
        ("bench", "cdcd.tools.bench", "cdcd.tools.local.workload"),
        ("mirror", "cdcd.spark.cli", "cdcd.errors"),
    ],
)
def test_an_import_error_inside_a_command_propagates(
    monkeypatch: pytest.MonkeyPatch, command: str, module: str, inner: str
) -> None:
    """A name missing from one of cdcd's own modules is a bug: it must not be hidden."""
    _unload(monkeypatch, module)

    def fails(name: str, fromlist: tuple[str, ...]) -> ImportError | None:
        if name == inner and fromlist:
            return ImportError(f"cannot import name {fromlist[0]!r} from {inner!r}", name=inner)
        return None

    _failing_import(monkeypatch, fails)
    with pytest.raises(ImportError, match=f"cannot import name .* from '{inner}'"):
        cli._command(command)(_args())


def test_mirror_without_pyspark_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _unload(monkeypatch, "cdcd.spark.cli")

    def fails(name: str, fromlist: tuple[str, ...]) -> ImportError | None:
        if name == "pyspark" or name.startswith("pyspark."):
            return ModuleNotFoundError(f"No module named {name!r}", name="pyspark")
        if name == "cdcd.naming":
            # cdcd.spark.cli importing something that needs pyspark at module level
            return ModuleNotFoundError("No module named 'pyspark'", name="pyspark")
        return None

    _failing_import(monkeypatch, fails)
    config = tmp_path / "cdcd.yaml"
    config.write_text("postgres: {dsn: 'host=x'}\nkafka: {bootstrap_servers: 'b:1'}\n")
    code = cli.main(["mirror", "-c", str(config), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cdcd mirror needs pyspark" in err
    assert "pip install 'cdcd[spark]'" in err
    assert "not implemented" not in err


def test_mirror_with_an_unusable_pyarrow_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _unload(monkeypatch, "cdcd.spark.cli")

    def fails(name: str, fromlist: tuple[str, ...]) -> ImportError | None:
        if name == "cdcd.errors":
            return ImportError("cannot import name 'compute' from 'pyarrow'", name="pyarrow")
        return None

    _failing_import(monkeypatch, fails)
    with pytest.raises(cli.ConfigError, match="cannot use the installed pyarrow") as raised:
        cli._command("mirror")(_args())
    assert raised.value.exit_code == 2
    assert "cdcd[spark]" in str(raised.value)


def _args() -> Any:
    import argparse

    return argparse.Namespace(config="unused.yaml", debug=False, output="unused", once=True)
