"""SQLSTATEs of PostgreSQL's errors, including the ones libpq reports only as text.

cdcd decides between retry and stop by the SQLSTATE the server sent, never by
the message: a server's messages follow its ``lc_messages`` (Debian ships
translations), so ``password authentication failed`` may arrive as
``Passwort-Authentifizierung für Benutzer »cdc« fehlgeschlagen``, and a
pattern over English text then retries a wrong password forever.

A failed statement carries its SQLSTATE (psycopg2's ``pgcode``). A failed
*connection attempt* does not: psycopg2 raises ``OperationalError`` with
libpq's error text only, although the server's ErrorResponse holds the code
(``28P01`` for a wrong password). What was measured on PostgreSQL 15 with
``lc_messages = 'de_DE.UTF-8'`` decided how cdcd gets it:

* ``options='-c lc_messages=C'`` (or ``PGOPTIONS``) does not help: the server
  applies startup options only after authentication and after looking the
  database up, so every refusal that matters comes in the server's language;
  and ``lc_messages`` is superuser-only besides.
* libpq puts the SQLSTATE into the text when the connection's error
  verbosity is ``PQERRORS_VERBOSE`` (``FATAL:  28P01: Passwort-...``), and the
  verbosity of a connection that is still being made can be set: psycopg2
  starts an asynchronous connection with ``PQconnectStart`` and exposes the
  ``PGconn`` (``pgconn_ptr``) before the first poll. :func:`connect_sqlstates`
  therefore repeats a failed attempt once that way, with
  ``PQsetErrorVerbosity`` called through ``ctypes`` on the very libpq psycopg2
  is linked with (:mod:`cdcd.source.libpq`: looked up through psycopg2's own
  extension module, so the ``PGconn`` and the function always come from the
  same library), and reads the codes from the text. The repeat costs one
  more attempt, only after a failure; it never changes what the first
  attempt did.

Messages libpq makes up itself (connection refused, timeouts, ``no password
supplied``, TLS) have no SQLSTATE. They are libpq's own English text: cdcd
never sets ``LC_MESSAGES`` (Python sets only ``LC_CTYPE``), and psycopg2's
bundled libpq has no message catalogs. Those alone are still recognised by
their words.
"""

from __future__ import annotations

import ctypes
import re
import select
import time
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from cdcd.source import libpq

__all__ = [
    "CONNECT_REFUSED",
    "connect_sqlstates",
    "error_code",
    "is_refused_at_connect",
    "sqlstates_in",
]

#: SQLSTATEs with which a server refuses a connection for good: invalid
#: authorization (class 28: wrong password, unknown role, no or a rejecting
#: ``pg_hba.conf`` entry), unknown database (3D000), no CONNECT privilege or no
#: REPLICATION attribute (42501), a database that allows no connections
#: (55000), an option the server rejects (42704, 22023, 0A000). Everything
#: else the server says at connect time (57P03 starting up or shutting down,
#: 53300 too many connections, class 08, 53, 57, 58) is transient.
CONNECT_REFUSED = frozenset({"3D000", "42501", "55000", "42704", "22023", "0A000"})

_PQERRORS_VERBOSE = 2
# libpq's verbose form: "<severity>:  <SQLSTATE>: <message>" (severity is
# translated, the code is not; two spaces after the severity's colon).
_VERBOSE_CODE = re.compile(r"(?:^|\s)\S+:  ([0-9A-Z]{5}): ")


def _class_codes() -> dict[type[BaseException], str]:
    from psycopg2._psycopg import sqlstate_errors

    return {cls: code for code, cls in sqlstate_errors.items()}


_CODE_OF_CLASS = _class_codes()


def error_code(exc: BaseException) -> str:
    """The SQLSTATE of a psycopg2 error: its ``pgcode``, else its class's code; ``""`` if none."""
    code = getattr(exc, "pgcode", None)
    if code:
        return str(code)
    return _CODE_OF_CLASS.get(type(exc), "")


def psycopg2_error(sqlstate: str, message: str) -> psycopg2.Error:
    """The exception psycopg2 raises for a server error of ``sqlstate`` (none: the connection
    failed), for what cdcd reads from libpq itself."""
    if not sqlstate:
        return psycopg2.OperationalError(message)
    try:
        kind = psycopg2.errors.lookup(sqlstate)
    except KeyError:
        kind = psycopg2.DatabaseError
    error: psycopg2.Error = kind(message)
    return error


def is_refused_at_connect(code: str) -> bool:
    """Whether a server that answered a connection attempt with ``code`` will refuse it again."""
    return code.startswith("28") or code in CONNECT_REFUSED


def sqlstates_in(text: str) -> tuple[str, ...]:
    """The SQLSTATEs in libpq error text of verbosity ``PQERRORS_VERBOSE`` (one per host tried)."""
    return tuple(_VERBOSE_CODE.findall(text))


def _set_error_verbosity() -> Any:
    """libpq's ``PQsetErrorVerbosity`` from the library psycopg2 uses; None if unavailable."""
    return libpq.function("PQsetErrorVerbosity", (ctypes.c_void_p, ctypes.c_int), ctypes.c_int)


def connect_sqlstates(dsn: str, kwargs: dict[str, Any], timeout_s: float) -> tuple[str, ...] | None:
    """Repeat a failed connection attempt to learn the SQLSTATEs the server(s) answered with.

    ``dsn`` and ``kwargs`` as given to ``psycopg2.connect`` (without a
    connection factory: a replication connection passes ``replication``).
    Empty: no server sent an error (refused, unreachable, timed out, a libpq
    failure) or the attempt now succeeds. None: libpq's verbosity cannot be
    set here, so the caller has only the text. See the module docstring.
    """
    set_verbosity = _set_error_verbosity()
    if set_verbosity is None:
        return None
    try:
        conn = psycopg2.connect(dsn, async_=True, **kwargs)
    except psycopg2.Error:
        return ()  # refused before any exchange with a server (e.g. a DNS failure)
    try:
        set_verbosity(conn.pgconn_ptr, _PQERRORS_VERBOSE)
        # libpq applies connect_timeout only to blocking connections.
        deadline = time.monotonic() + timeout_s
        while True:
            state = conn.poll()
            if state == psycopg2.extensions.POLL_OK:
                return ()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ()
            if state == psycopg2.extensions.POLL_READ:
                select.select([conn], [], [], remaining)
            else:
                select.select([], [conn], [], remaining)
    except psycopg2.Error as exc:
        return sqlstates_in(str(exc))
    finally:
        conn.close()
