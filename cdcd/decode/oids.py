"""Built-in PostgreSQL type OIDs the codecs dispatch on (stable across PostgreSQL versions)."""

from __future__ import annotations

BOOL, BYTEA, INT8, INT2, INT4, TEXT, OID = 16, 17, 20, 21, 23, 25, 26
FLOAT4, FLOAT8, VARCHAR, DATE, TIME, TIMESTAMP, TIMESTAMPTZ = 700, 701, 1043, 1082, 1083, 1114, 1184
NUMERIC, UUID = 1700, 2950
