"""Two different writer schemas never share an identifier on the wire (single-object encoding).

The fingerprint of Avro's Parsing Canonical Form drops logical types,
defaults and aliases: ``decimal(10,2)`` and ``decimal(12,3)`` shared one, and
a reader resolving older records by it got the newer scale (1.23 read as
0.123). cdcd's identifier is the CRC-64-AVRO of the schema text it publishes
(docs/wire-format.md). Checked: the unit rule, and end to end with re-snapshot
off: every record decoded with plain fastavro by the writer schema its
identifier names equals the row as PostgreSQL holds it after the change.
"""

from __future__ import annotations

import io
import json
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from support.cdc import SchemaBook, wait_for, wait_streaming
from support.kafka import consume_all

from cdcd.envelope.wire import SingleObjectFormat, schema_fingerprint
from cdcd.naming import table_topic


def _row_schema(field: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "Value", "namespace": "t",
            "fields": [{"name": "id", "type": "int"}, field]}


SAME_CANONICAL_FORM = {
    "decimal scale": (
        {"name": "price", "type": ["null", {"type": "bytes", "logicalType": "decimal",
                                            "precision": 10, "scale": 2}], "default": None},
        {"name": "price", "type": ["null", {"type": "bytes", "logicalType": "decimal",
                                            "precision": 12, "scale": 3}], "default": None},
    ),
    "carried default": (
        {"name": "n", "type": ["int", "null"], "default": 5},
        {"name": "n", "type": ["int", "null"], "default": 7},
    ),
    "alias": (
        {"name": "b", "type": ["null", "string"], "default": None},
        {"name": "b", "type": ["null", "string"], "default": None, "aliases": ["a"]},
    ),
}


@pytest.mark.parametrize("case", sorted(SAME_CANONICAL_FORM))
def test_schemas_equal_in_canonical_form_get_different_identifiers(case: str) -> None:
    published: list[tuple[bytes, bytes]] = []
    wire = SingleObjectFormat(lambda key, value: published.append((key, value)))
    old, new = (_row_schema(field) for field in SAME_CANONICAL_FORM[case])
    headers = [wire.header("t", "value", old), wire.header("t", "value", new),
               wire.header("t", "value", old)]
    assert headers[0] != headers[1], "two writer schemas share an identifier"
    assert headers[2] == headers[0]
    # Each published once, under its own key; the key is the fingerprint of the value.
    assert [json.loads(value) for _, value in published] == [old, new]
    for key, value in published:
        assert key == schema_fingerprint(json.loads(value)).hex().encode()
    assert {b"\xc3\x01" + bytes.fromhex(key.decode()) for key, _ in published} == set(headers)


def test_a_reader_gets_the_exact_writer_scale() -> None:
    published: dict[str, dict[str, Any]] = {}
    wire = SingleObjectFormat(lambda k, v: published.__setitem__(k.decode(), json.loads(v)))
    old, new = (_row_schema(field) for field in SAME_CANONICAL_FORM["decimal scale"])
    records = []
    for schema, price in ((old, Decimal("1.23")), (new, Decimal("7.891"))):
        body = io.BytesIO()
        fastavro.schemaless_writer(body, fastavro.parse_schema(schema), {"id": 1, "price": price})
        records.append(wire.header("t", "value", schema) + body.getvalue())
    decoded = [
        fastavro.schemaless_reader(io.BytesIO(data[10:]),
                                   fastavro.parse_schema(published[data[2:10].hex()]), None)
        for data in records
    ]
    assert [d["price"] for d in decoded] == [Decimal("1.23"), Decimal("7.891")]


@pytest.mark.integration
def test_records_before_a_scale_change_keep_their_scale(pg, broker, cdc_config, daemons) -> None:
    """ALTER COLUMN ... TYPE numeric(12,3) with re-snapshot off: old records stay exact."""
    pg.execute("CREATE TABLE prices (id int PRIMARY KEY, price numeric(10,2))")
    config = cdc_config(tables=["public.prices"], extra={"schema_changes": {"resnapshot": "never"}})
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(config)
    wait_streaming(pg, slot)
    pg.execute("INSERT INTO prices VALUES (1, 1.23), (2, 4.56)")
    pg.execute("ALTER TABLE prices ALTER COLUMN price TYPE numeric(12,3)")
    pg.execute("INSERT INTO prices VALUES (3, 7.891)")
    pg.execute("UPDATE prices SET price = 2.5 WHERE id = 2")
    topic = table_topic(pg.dbname, "public", "prices")
    bootstrap = broker.bootstrap_servers

    def values() -> list[bytes]:
        """The change records' values in commit order (cdcd.lsn, cdcd.seq)."""
        found = []
        for message in consume_all(bootstrap, topic, timeout_s=15, idle_s=0.5):
            if message.value() is None:
                continue  # a tombstone
            headers = dict(message.headers() or [])
            high, low = headers["cdcd.lsn"].decode().split("/")
            order = ((int(high, 16) << 32) | int(low, 16), int(headers["cdcd.seq"]))
            found.append((order, message.value()))
        return [value for _, value in sorted(found)]

    records = wait_for(lambda: (found := values()) and len(found) >= 4 and found,
                       timeout_s=90, what="four change records")
    assert daemon.alive(), daemon.log()
    book = SchemaBook()
    book.load(bootstrap, pg.dbname)
    # Plain fastavro, each record with the writer schema its identifier names.
    changes = [book.decode(data) for data in records]
    got = {c["after"]["id"]: c["after"]["price"] for c in changes if c and c["after"]}
    assert len({data[:10] for data in records}) == 2, "one writer schema per table version"
    expected = {int(i): Decimal(p) for i, p in pg.fetchall("SELECT id, price FROM prices")}
    per_change = [(c["after"]["id"], c["after"]["price"]) for c in changes if c and c["after"]]
    assert per_change == [(1, Decimal("1.23")), (2, Decimal("4.56")), (3, Decimal("7.891")),
                          (2, Decimal("2.500"))], per_change
    assert got == expected, (got, expected)
