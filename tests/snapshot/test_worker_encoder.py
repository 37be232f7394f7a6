"""A snapshot worker process encodes a table exactly as the daemon would.

The daemon plans each table and builds its encoder (schemas published,
annotated by schema-change tracking); a worker process is handed the plan
without its column codecs (closures do not pickle) and the wire headers, and
rebuilds the codecs from the same type facts on its own connection
(``cdcd.snapshot.workers``). Over a table of many column types, rows with
nulls and every character COPY escapes, the worker's messages for the same
COPY text must equal the daemon's byte for byte, and so must the schemas.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import replace
from typing import Any

import pytest

from cdcd.envelope.encoder import TableEncoder, make_stamp
from cdcd.naming import LSN_HEADER
from cdcd.protocol.lsn import Lsn
from cdcd.snapshot.rows import encode_reads, plan_table
from cdcd.snapshot.workers import WorkerTable, _codecs, _Headers
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import SourceDatabase

pytestmark = pytest.mark.integration


class _Wire:
    def header(self, topic: str, role: str, schema: dict[str, Any]) -> bytes:
        return b"\xc3\x01" + (b"K" if role == "key" else b"V") * 8


def test_a_worker_rebuilds_the_daemons_encoder_byte_for_byte(pg) -> None:  # type: ignore[no-untyped-def]
    pg.execute("CREATE TYPE mood AS ENUM ('sad', 'ok')")
    pg.execute("CREATE DOMAIN price AS numeric(10, 3)")
    pg.execute(
        "CREATE TABLE wide(id bigint, k text, n numeric(12,2), free numeric, p price, "
        "t timestamptz, d date, tm time, j jsonb, a int[][], ta text[], u uuid, b bytea, "
        "f float8, m mood, i interval, ok bool, PRIMARY KEY (id, k))"
    )
    pg.execute(
        "INSERT INTO wide SELECT g, 'k' || g || E'\\t\\\\x\\n', g * 1.25, "
        "CASE WHEN g % 3 = 0 THEN 'NaN' ELSE (g / 7.0)::text END::numeric, g / 3.0, "
        "'2024-01-01'::timestamptz + g * interval '1 hour', "
        "CASE WHEN g % 5 = 0 THEN 'infinity'::date ELSE '2024-01-01'::date + g END, "
        "'12:00'::time, jsonb_build_object('g', g, 's', E'a\"b'), ARRAY[[g, NULL], [1, 2]], "
        "ARRAY['x', NULL, E'y\\\\z'], gen_random_uuid(), decode(md5(g::text), 'hex'), g / 9.0, "
        "CASE WHEN g % 2 = 0 THEN 'sad' ELSE 'ok' END::mood, g * interval '1 minute', "
        "CASE WHEN g % 4 = 0 THEN NULL ELSE g % 2 = 0 END FROM generate_series(1, 300) g"
    )
    daemon = SourceDatabase(pg.dsn, timeout_s=10)
    worker = SourceDatabase(pg.dsn, timeout_s=10)
    try:
        plan = plan_table(daemon, daemon.relation_cache(PgCatalog(daemon.conn), snapshot=True),
                          "public", "wide")
        ours = TableEncoder(plan.version, "pg.public.wide", "pg", "db", _Wire())
        shipped: WorkerTable = pickle.loads(pickle.dumps(WorkerTable.of(plan, (1,), ours)))
        version = shipped.plan.version
        assert version.codecs == ()  # closures stay in the daemon
        theirs = TableEncoder(
            replace(version, codecs=_codecs(worker, version)), shipped.topic, "pg", "db",
            _Headers(shipped.key_header, shipped.value_header),
        )
        assert theirs.key_schema == ours.key_schema and theirs.value_schema == ours.value_schema
        cursor = daemon.conn.cursor()
        buffer = io.BytesIO()
        cursor.copy_expert(f"COPY ({plan.select_sql(cursor, None, None, None)}) TO STDOUT", buffer)
        data = buffer.getvalue()
    finally:
        daemon.close()
        worker.close()
    stamp = make_stamp(0, Lsn(0x16B374D848), 1_700_000_000_000, snapshot=True, now_ms=1)
    header = (LSN_HEADER, stamp.lsn_header)
    expected = encode_reads(ours, data, stamp, 7, header)
    assert len(expected) == 300
    assert encode_reads(theirs, data, stamp, 7, header) == expected

