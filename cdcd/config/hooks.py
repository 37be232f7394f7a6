"""Test hooks: environment variables that shorten a production wait, for the test suite.

Each is read where its wait starts, unset in production, and refused (exit 2)
outside its range, so a stray value can only ever make a wait shorter, never
remove it or lengthen it. README ("Development") lists them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cdcd.errors import ConfigError


def hook_seconds(
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> float:
    """``default``, unless environment variable ``name`` sets a value in range.

    The range is ``(0, default]``, or ``[minimum, default]`` with ``minimum``.
    """
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    low_ok = value > 0 if minimum is None else value >= minimum
    if not (low_ok and value <= default):
        span = f"(0, {default:g}]" if minimum is None else f"[{minimum:g}, {default:g}]"
        raise ConfigError(
            f"{name}={raw!r}: not a number of seconds in {span}",
            hint=f"unset {name} (a test hook)",
        )
    return value
