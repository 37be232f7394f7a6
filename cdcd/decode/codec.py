"""What every column codec module shares: the codec record, its error, domains.

A :class:`ColumnCodec` is built once per column (:func:`cdcd.decode.values.column_codec`)
and called per row. The modules that build them:

* :mod:`cdcd.decode.values` -- the registry (type OID -> codec) and the small
  scalar codecs (bool, bytea, uuid, text-like types);
* :mod:`cdcd.decode.numeric` -- integers, floats, numeric;
* :mod:`cdcd.decode.temporal` -- date, time, timestamp, timestamptz;
* :mod:`cdcd.decode.arrays` -- arrays of any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cdcd.decode.types import PgType, TypeCatalog

__all__ = ["ColumnCodec", "resolve_domain"]


@dataclass(frozen=True, slots=True)
class ColumnCodec:
    """Everything needed to encode one column; built once per column, called per row."""

    avro_type: Any  # JSON-able non-null Avro type
    from_text: Callable[[bytes], bytes]  # pgoutput text value -> Avro binary of the value
    to_python: Callable[[bytes], Any]  # text value -> what fastavro returns after decoding


def resolve_domain(pg_type: PgType, catalog: TypeCatalog, typmod: int) -> tuple[PgType, int]:
    """Follow domains to their base type; the innermost domain typmod applies if the column has none."""
    seen = 0
    while pg_type.kind == "d":
        if typmod == -1:
            typmod = pg_type.base_modifier
        pg_type = catalog.lookup(pg_type.base_oid)
        seen += 1
        if seen > 100:
            raise ValueError(f"domain chain of {pg_type.name} does not end")
    return pg_type, typmod
