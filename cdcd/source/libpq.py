"""libpq functions psycopg2 does not expose, from the very library psycopg2 uses.

cdcd calls libpq itself on connections psycopg2 made: it sets the error
verbosity of a failing connection attempt to read the server's SQLSTATE
(:mod:`cdcd.source.sqlstate`), and it writes standby status updates on the
replication connection (:mod:`cdcd.source.feedback`), through ctypes; its
compiled module ``cdcd.source._libpq`` reads the replication stream and
``COPY`` output. All pass psycopg2's own
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

__all__ = ["NATIVE_MODULE", "function", "native_module", "required"]

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


#: The compiled module of these calls (the replication stream and COPY, ``_libpq.c``).
NATIVE_MODULE = "cdcd.source._libpq"


@functools.cache
def native_module() -> ModuleType | None:
    """``cdcd.source._libpq``, given psycopg2's libpq (its ``load(path)``).

    None where it is not built, is stale, ``CDCD_PURE_PYTHON`` is set, or
    libpq cannot be reached that way (logged): psycopg2 then reads the
    replication stream and COPY.
    """
    module = load_native(NATIVE_MODULE)
    if module is None:
        return None
    from psycopg2 import _psycopg

    try:
        module.load(_psycopg.__file__)
    except OSError as exc:
        STATUS[NATIVE_MODULE] = f"pure ({exc})"
        log.warning("the replication stream and COPY are read through psycopg2: %s", exc)
        return None
    return module
