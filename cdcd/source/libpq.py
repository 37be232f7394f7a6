"""libpq functions psycopg2 does not expose, from the very library psycopg2 uses.

cdcd calls libpq itself on connections psycopg2 made: it sets the error
verbosity of a failing connection attempt to read the server's SQLSTATE
(:mod:`cdcd.source.sqlstate`), and it writes standby status updates on the
replication connection (:mod:`cdcd.source.feedback`), through ctypes; its
compiled modules read the replication stream (``cdcd.source._walread``) and
``COPY`` output (``cdcd.snapshot._copyout``). All pass psycopg2's own
``PGconn`` (``connection.pgconn_ptr``), which only the library that made it
may be given: a second copy of libpq could not use it. So the functions are
looked up through psycopg2's extension module: ``dlsym`` on its handle
searches the libraries it depends on, which is where its libpq is (bundled by
psycopg2-binary, the system's for a source build).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from types import ModuleType
from typing import Any

from cdcd.errors import DefiniteError
from cdcd.protocol.native import STATUS, load_native

__all__ = ["function", "native_module", "required"]

log = logging.getLogger(__name__)


@functools.cache
def _library() -> ctypes.CDLL | None:
    from psycopg2 import _psycopg

    try:
        return ctypes.CDLL(_psycopg.__file__)
    except OSError:
        return None


@functools.cache
def function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any | None:
    """libpq's ``name`` with its C signature; None where psycopg2's libpq cannot be reached."""
    library = _library()
    if library is None:
        return None
    try:
        found = getattr(library, name)
    except AttributeError:  # e.g. libpq linked statically into the extension, unexported
        return None
    found.argtypes = list(argtypes)
    found.restype = restype
    return found


def required(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """:func:`function`, for a caller that cannot work without it: a definite error if absent."""
    found = function(name, argtypes, restype)
    if found is None:
        raise DefiniteError(
            f"cannot find {name} in the libpq library used by psycopg2 in this process",
            hint="install psycopg2-binary, or psycopg2 built against a shared libpq",
        )
    return found


@functools.cache
def native_module(name: str, fallback: str) -> ModuleType | None:
    """The compiled module ``name``, given psycopg2's libpq (its ``load(path)``).

    None where it is not built, is stale, ``CDCD_PURE_PYTHON`` is set, or
    libpq cannot be reached that way; the last is logged as ``fallback``
    (what cdcd does instead).
    """
    module = load_native(name)
    if module is None:
        return None
    from psycopg2 import _psycopg

    try:
        module.load(_psycopg.__file__)
    except OSError as exc:
        STATUS[name] = f"pure ({exc})"
        log.warning("%s: %s", fallback, exc)
        return None
    return module
