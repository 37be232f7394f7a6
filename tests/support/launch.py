"""Run the ``cdcd`` command with test hooks injected: ``launch.py [--set NAME=VALUE ...] -- ARGS``.

Production modules keep their waits and fault points as plain module
attributes (``cdcd.daemon.STARTUP_RETRY_S``) and read nothing of the kind
from the environment. A test that needs a shorter wait, or a fault at a
given point, runs the real command line through this script, which sets
those attributes first and then calls ``cdcd.cli.main`` in the same process.

``NAME`` is ``package.module.ATTRIBUTE`` (or ``package.module.Class.ATTRIBUTE``);
``VALUE`` is read as JSON where it parses (numbers, strings in quotes, lists),
else taken as a plain string. An unknown name is an error: a hook that no
longer exists must fail the test that relies on it, not be ignored.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: This file, for ``[sys.executable, str(LAUNCHER), ...]``: a path works from
#: any working directory, unlike ``-m tests.support.launch``.
LAUNCHER = Path(__file__).resolve()


def command(args: Sequence[str], hooks: Mapping[str, Any] | None = None) -> list[str]:
    """The argv that runs ``cdcd ARGS`` with ``hooks`` set."""
    argv = [sys.executable, str(LAUNCHER)]
    for name, value in (hooks or {}).items():
        argv += ["--set", f"{name}={json.dumps(value)}"]
    return [*argv, "--", *args]


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def apply(name: str, value: Any) -> None:
    """Set attribute ``name`` (dotted, module first) to ``value``; it must exist."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:-1]:
            target = getattr(target, attribute)
        if not hasattr(target, parts[-1]):
            raise SystemExit(f"launch.py: {name}: no such attribute (a hook that was removed?)")
        setattr(target, parts[-1], value)
        return
    raise SystemExit(f"launch.py: {name}: no module to set it on")


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if "--" not in args:
        raise SystemExit("usage: launch.py [--set NAME=VALUE ...] -- CDCD-ARGS")
    split = args.index("--")
    options, rest = args[:split], args[split + 1 :]
    while options:
        flag = options.pop(0)
        if flag != "--set" or not options:
            raise SystemExit(f"launch.py: expected --set NAME=VALUE, got {flag!r}")
        name, _, text = options.pop(0).partition("=")
        apply(name, _parse(text))
    from cdcd.cli import main as cdcd_main

    return cdcd_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
