"""What a compiled module's status is in a fresh interpreter with ``CDCD_PURE_PYTHON=1``."""

from __future__ import annotations

import os
import subprocess
import sys


def status_when_pure(load: str, module: str) -> str:
    """Run ``load`` (Python statements that decide whether ``module`` is used) with the pure path forced.

    Returns ``native_status()[module]`` as that interpreter printed it.
    """
    code = f"{load}\nfrom cdcd.protocol.native import native_status\nprint(native_status()[{module!r}])"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, CDCD_PURE_PYTHON="1"),
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()
