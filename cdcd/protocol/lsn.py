"""``Lsn``: a PostgreSQL WAL position as a value type.

An LSN is an unsigned 64-bit byte position in the write-ahead log, printed as
two hex halves (high 32 bits / low 32 bits). PostgreSQL's ``pg_lsn`` prints
``%X/%X``; cdcd prints the low half zero-padded to eight digits (``X/XXXXXXXX``,
the form of the ``cdcd.lsn`` header in the SPEC) so that header strings with
the same high half sort like the numbers. ``parse`` accepts both forms.
Ordering is integer ordering, so ``Lsn`` subclasses ``int``: free to compare,
hash and put in heaps on the hot path.
"""

from __future__ import annotations

import re

_MAX = (1 << 64) - 1
_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


class Lsn(int):
    """A WAL position; ``Lsn.parse("16/B374D848")`` and ``str(lsn)`` round-trip."""

    __slots__ = ()

    def __new__(cls, value: int = 0) -> Lsn:
        if not 0 <= value <= _MAX:
            raise ValueError(f"LSN out of range: {value}")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> Lsn:
        match = _TEXT.match(text.strip())
        if match is None:
            raise ValueError(f"not an LSN (expected X/XXXXXXXX): {text!r}")
        return cls((int(match.group(1), 16) << 32) | int(match.group(2), 16))

    def __str__(self) -> str:
        value = int(self)
        return f"{value >> 32:X}/{value & 0xFFFFFFFF:08X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"


INVALID_LSN = Lsn(0)
