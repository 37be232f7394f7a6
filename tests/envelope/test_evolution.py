"""Schema evolution mid-stream: ADD COLUMN, DROP COLUMN, ALTER TYPE, REPLICA IDENTITY.

Each Relation change gives a new writer schema (never a crash). Every pair of
(writer, reader) versions is resolved with plain fastavro: new readers read
old data, and old readers read new data — except where Avro itself has no
rule (a reader cannot narrow ``long`` back to ``int`` after ``ALTER … TYPE
bigint``; that direction is asserted to fail, and is documented).
"""

from __future__ import annotations

import io
from typing import Any

import fastavro
import pytest
from support.pg import read_pgoutput

from .helpers import Harness

pytestmark = pytest.mark.integration


def _resolve(data: bytes, writer: Any, reader: Any) -> dict[str, Any]:
    record: dict[str, Any] = fastavro.schemaless_reader(
        io.BytesIO(data[10:]), fastavro.parse_schema(writer), fastavro.parse_schema(reader)
    )
    return record


def test_relation_changes_make_resolvable_schemas(pg) -> None:
    pg.execute("CREATE TABLE e(id int PRIMARY KEY, a text, b int, s varchar(20))")
    pg.capture(["e"])
    pg.execute("INSERT INTO e VALUES (1, 'one', 1, 's1')")
    pg.execute("ALTER TABLE e ADD COLUMN c numeric(10,2)")
    pg.execute("INSERT INTO e VALUES (2, 'two', 2, 's2', 2.5)")
    pg.execute("ALTER TABLE e DROP COLUMN a")
    pg.execute("INSERT INTO e VALUES (3, 3, 's3', 3.5)")
    pg.execute("ALTER TABLE e ALTER COLUMN s TYPE text")
    pg.execute("INSERT INTO e VALUES (4, 4, 's4', 4.5)")
    pg.execute("ALTER TABLE e REPLICA IDENTITY FULL")
    pg.execute("UPDATE e SET s = 'updated' WHERE id = 4")
    pg.execute("ALTER TABLE e ALTER COLUMN b TYPE bigint")
    pg.execute("INSERT INTO e VALUES (5, 5000000000, 's5', 5.5)")
    harness = Harness(pg.dsn)
    try:
        published = harness.run(read_pgoutput(pg.dsn, "slot", "pub"))
    finally:
        harness.close()

    assert [p.value["op"] for p in published] == ["c", "c", "c", "c", "u", "c"]
    versions = [p.table.version for p in published]
    assert versions == sorted(versions) and len(set(versions)) == 6, versions
    assert published[4].value["before"]["s"] == "s4"  # FULL identity: old row
    schemas = [p.value_schema for p in published]
    assert all(s["name"] == "Envelope" and s["namespace"] == "pg.public.e" for s in schemas)

    for i, written in enumerate(published):
        for j, reader in enumerate(schemas):
            narrowing = i == 5 and j < 5  # bigint data, int reader
            if narrowing:
                with pytest.raises(fastavro.read.SchemaResolutionError):
                    _resolve(written.raw_value, written.value_schema, reader)
                continue
            record = _resolve(written.raw_value, written.value_schema, reader)
            after = record["after"]
            reader_fields = {f["name"] for f in reader["fields"][0]["type"][1]["fields"]}
            assert set(after) == reader_fields
            assert after["id"] == written.value["after"]["id"]
            # Columns the writer did not have read as the reader's default (null).
            for name in reader_fields - set(written.value["after"]):
                assert after[name] is None
            for name in reader_fields & set(written.value["after"]):
                assert after[name] == written.value["after"][name]
