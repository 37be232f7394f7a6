"""Command line (SPEC §2). Filled in by later work; every command exists from the start."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(f"cdcd: {' '.join(args) or '(no command)'}: not yet implemented", file=sys.stderr)
    return 1
