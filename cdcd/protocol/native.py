"""Loading the compiled twins of the hot path: C extensions built from this package.

``cdcd.protocol._native`` (the pgoutput parser) and ``cdcd.envelope._native``
(the change encoder) are optional. ``pip install`` compiles them where a C
compiler and the Python headers are present (``setup.py``); without them the
install still succeeds and cdcd runs its pure-Python code, which is the
reference the compiled code is tested against, byte for byte.

``CDCD_PURE_PYTHON=1`` forces the pure-Python path (CI runs the protocol and
envelope tests both ways). A compiled module built from an older source than
the ``.c`` file next to it (an editable install whose C source changed since)
is not used: the pure path is, with a warning to rebuild.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

PURE_ENV = "CDCD_PURE_PYTHON"

#: How each compiled module was found: "compiled", or why the pure path runs.
STATUS: dict[str, str] = {}


def pure_forced() -> bool:
    """Whether ``CDCD_PURE_PYTHON`` asks for the pure-Python path."""
    return os.environ.get(PURE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def load_native(name: str) -> ModuleType | None:
    """The compiled module ``name`` if it is built, current and allowed; else None."""
    if pure_forced():
        STATUS[name] = f"pure ({PURE_ENV} set)"
        return None
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        STATUS[name] = "pure (not built)"
        log.debug("%s is not available (%s): pure-Python path", name, exc)
        return None
    built_from = getattr(module, "SOURCE_SHA256", "")
    source = Path(module.__file__ or "").with_name(name.rsplit(".", 1)[1] + ".c")
    if source.is_file() and hashlib.sha256(source.read_bytes()).hexdigest() != built_from:
        STATUS[name] = "pure (stale build)"
        log.warning(
            "%s was built from an older %s: using the pure-Python path; "
            "rebuild it with `pip install -e .`",
            name,
            source.name,
        )
        return None
    STATUS[name] = "compiled"
    return module


def native_status() -> dict[str, str]:
    """Which compiled modules run (for ``cdcd bench`` and the tests)."""
    return dict(STATUS)
