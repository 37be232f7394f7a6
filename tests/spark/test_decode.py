"""Decoding envelopes written by cdcd's own encoder: types, schema changes, both wire formats.

Pure functions on Arrow batches -- no JVM, no broker -- so these run in the
default suite (they import pyspark's data source classes, nothing more).
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from confluent_kafka.schema_registry import SchemaRegistryClient  # noqa: E402

from cdcd.consumer import SchemaCatalog  # noqa: E402
from cdcd.errors import DefiniteError  # noqa: E402
from cdcd.spark.decode import (  # noqa: E402
    DecodePlan,
    decode_batch,
    decode_native,
    decode_payloads,
    newest_version,
    read_payloads,
)
from cdcd.spark.layout import RowLayout, to_reader  # noqa: E402
from spark.envelopes import (  # noqa: E402
    UNCHANGED,
    Col,
    EnvelopeFactory,
    kafka_batch,
    numeric,
    table_version,
)

INT4, INT8, TEXT, NUMERIC, DATE, TIME, TS, TSTZ, UUID, BYTEA, FLOAT4, JSONB, INTERVAL = (
    23, 20, 25, 1700, 1082, 1083, 1114, 1184, 2950, 17, 700, 3802, 1186,
)  # fmt: skip
INT4_ARRAY, NUMERIC_ARRAY, TSTZ_ARRAY, TEXT_ARRAY = 1007, 1231, 1185, 1009

KITCHEN = [
    Col("id", INT4, key=True),
    Col("amount", NUMERIC, numeric(12, 2)),
    Col("free", NUMERIC),
    Col("wide", NUMERIC, numeric(45, 5)),
    Col("when_utc", TSTZ),
    Col("when_local", TS),
    Col("day", DATE),
    Col("clock", TIME),
    Col("uid", UUID),
    Col("blob", BYTEA),
    Col("ratio", FLOAT4),
    Col("doc", JSONB),
    Col("span", INTERVAL),
    Col("grid", INT4_ARRAY, dims=2),
    Col("prices", NUMERIC_ARRAY, numeric(10, 3)),
    Col("stamps", TSTZ_ARRAY),
    Col("Odd name!", TEXT),
]
ROW = [
    "7", "12.50", "NaN", "-1234567890123456789012345678901234567890.00001",
    "2024-01-02 03:04:05.123456+02", "infinity", "0044-03-15 BC", "24:00:00",
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "\\x00ff10", "1.5", '{"a": [1, 2]}',
    "1 day 02:00:00", "{{1,NULL},{3,4}}", "{1.5,NULL,-2.125}", '{"2024-01-01 00:00:00+00",NULL}',
    "weird",
]  # fmt: skip


def _schemas(factory: EnvelopeFactory) -> dict[bytes, dict[str, Any]]:
    return {b"\xc3\x01" + bytes.fromhex(k): json.loads(v) for k, v in factory.published.items()}


def _catalog(factory: EnvelopeFactory) -> SchemaCatalog:
    catalog = SchemaCatalog("pg")
    for header, schema in _schemas(factory).items():
        catalog.add(header, schema)
    return catalog


def _envelope_headers(factory: EnvelopeFactory) -> list[bytes]:
    """Headers of the published envelope schemas, in publication order."""
    return [h for h, s in _schemas(factory).items() if s["name"] == "Envelope"]


def _plan(factory: EnvelopeFactory, topic: str, reader_header: bytes | None = None) -> DecodePlan:
    envelopes = {h: s for h, s in _schemas(factory).items() if s["name"] == "Envelope"}
    reader = envelopes[reader_header] if reader_header else list(envelopes.values())[-1]
    return DecodePlan.build(topic, reader, envelopes)


def test_every_type_decodes_to_typed_arrow_columns() -> None:
    factory = EnvelopeFactory()
    table = table_version("public", "kitchen", KITCHEN)
    factory.change(table, "c", after=ROW, lsn=0x1_0000_0010, seq=0)
    factory.change(
        table, "u", after=["7", *[None] * 10, UNCHANGED, *[None] * 5], lsn=0x1_0000_0020, seq=0
    )
    factory.change(table, "d", before=["7", *[None] * 16], lsn=0x1_0000_0030, seq=0)
    decoded = decode_batch(kafka_batch(factory.messages), _plan(factory, "pg.public.kitchen"))

    assert decoded.num_rows == 3  # the tombstone after the delete is dropped
    row_type = decoded.schema.field("after").type
    types = {row_type.field(i).name: row_type.field(i).type for i in range(row_type.num_fields)}
    assert types["amount"] == pa.decimal128(12, 2)
    assert types["free"] == pa.string() and types["wide"] == pa.string()
    assert types["when_utc"] == pa.timestamp("us", tz="UTC")
    assert types["when_local"] == pa.timestamp("us")
    assert types["day"] == pa.date32() and types["clock"] == pa.int64()
    assert types["grid"].value_type.value_type == pa.int32()
    assert types["prices"].value_type == pa.decimal128(10, 3)
    assert "Odd name!" in types  # the PostgreSQL name, not the sanitized Avro one

    insert, update, delete = decoded.to_pylist()
    after = insert["after"]
    assert after["amount"] == Decimal("12.50")
    assert after["free"] == "NaN"
    assert after["wide"] == "-1234567890123456789012345678901234567890.00001"
    assert after["when_utc"] == datetime(2024, 1, 2, 1, 4, 5, 123456, tzinfo=UTC)
    assert after["when_local"] == datetime(9999, 12, 31, 23, 59, 59, 999999)
    assert after["day"] == date(1, 1, 1)
    assert after["clock"] == 86_399_999_999
    assert after["uid"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert after["blob"] == b"\x00\xff\x10"
    assert after["grid"] == [[1, None], [3, 4]]
    assert after["prices"] == [Decimal("1.500"), None, Decimal("-2.125")]
    assert after["stamps"] == [datetime(2024, 1, 1, tzinfo=UTC), None]
    assert after["Odd name!"] == "weird"
    assert (insert["op"], insert["lsn"], insert["seq"], insert["before"]) == (
        "c",
        0x1_0000_0010,
        0,
        None,
    )
    assert insert["source_schema"] == "public" and insert["source_table"] == "kitchen"
    assert update["unchanged_toast"] == ["doc"] and update["after"]["doc"] is None
    assert delete["op"] == "d" and delete["after"] is None and delete["before"]["id"] == 7


def test_old_and_new_writer_schemas_decode_to_the_newest_layout() -> None:
    factory = EnvelopeFactory()
    v1 = table_version("public", "t", [Col("id", INT4, key=True), Col("n", INT4), Col("gone", TEXT),
                                        Col("price", NUMERIC, numeric(10, 2))])  # fmt: skip
    v2 = table_version("public", "t", [Col("id", INT4, key=True), Col("n", INT8), Col("added", TEXT),
                                        Col("price", NUMERIC, numeric(12, 4))], version=2)  # fmt: skip
    factory.change(v1, "c", after=["1", "5", "x", "1.25"], lsn=10, seq=0)
    factory.change(v2, "c", after=["2", "6", "y", "2.5"], lsn=20, seq=0)
    old_header, new_header = _envelope_headers(factory)
    decoded = decode_batch(kafka_batch(factory.messages), _plan(factory, "pg.public.t", new_header))
    assert [r["after"] for r in decoded.to_pylist()] == [
        {"id": 1, "n": 5, "added": None, "price": Decimal("1.2500")},
        {"id": 2, "n": 6, "added": "y", "price": Decimal("2.5000")},
    ]
    # And an old reader ignores the new column.
    old = decode_batch(kafka_batch(factory.messages), _plan(factory, "pg.public.t", old_header))
    assert old.to_pylist()[1]["after"] == {"id": 2, "n": 6, "gone": None, "price": Decimal("2.50")}


def test_a_type_change_without_exact_conversion_names_the_column() -> None:
    factory = EnvelopeFactory()
    v1 = table_version("public", "t", [Col("id", INT4, key=True), Col("v", TEXT)])
    v2 = table_version("public", "t", [Col("id", INT4, key=True), Col("v", DATE)], version=2)
    factory.change(v1, "c", after=["1", "not a date"], lsn=10, seq=0)
    factory.change(v2, "c", after=["2", "2024-01-01"], lsn=20, seq=0)
    newest = _envelope_headers(factory)[-1]
    with pytest.raises(DefiniteError, match="column 'v' changed type from string to date"):
        decode_batch(kafka_batch(factory.messages), _plan(factory, "pg.public.t", newest))


def test_confluent_wire_format_with_a_registry() -> None:
    registry = SchemaRegistryClient.new_client({"url": "mock://cdcd-spark-tests"})
    factory = EnvelopeFactory(registry=registry)
    table = table_version(
        "public", "reg", [Col("id", INT4, key=True), Col("amount", NUMERIC, numeric(8, 3))]
    )
    factory.change(table, "c", after=["1", "3.125"], lsn=10, seq=0)
    catalog = SchemaCatalog("pg", registry_client=registry)
    header, schema = catalog.latest("pg.public.reg") or (b"", {})
    assert header[:1] == b"\x00"
    plan = DecodePlan.build("pg.public.reg", schema, {}, catalog.schema)
    decoded = decode_batch(kafka_batch(factory.messages), plan)
    assert decoded.to_pylist()[0]["after"] == {"id": 1, "amount": Decimal("3.125")}


def test_foreign_message_is_reported_with_its_position() -> None:
    factory = EnvelopeFactory()
    table = table_version("public", "t", [Col("id", INT4, key=True)])
    factory.change(table, "c", after=["1"], lsn=10, seq=0)
    factory.messages[0].value = b'{"json": "not avro"}'
    with pytest.raises(DefiniteError, match=r"cannot decode pg\.public\.t \[\d\] offset 0"):
        decode_batch(kafka_batch(factory.messages), _plan(factory, "pg.public.t"))


def test_all_topics_decode_in_one_pass_through_payloads() -> None:
    factory = EnvelopeFactory()
    a = table_version("public", "a", [Col("id", INT4, key=True), Col("x", TEXT)], relation_id=1)
    b = table_version("public", "b", [Col("k", TEXT, key=True), Col("when", TSTZ)], relation_id=2)
    factory.change(a, "c", after=["1", "one"], lsn=10, seq=0)
    factory.change(b, "c", after=["k1", "2024-05-06 07:08:09+00"], lsn=10, seq=1)
    factory.change(a, "u", after=["1", "uno"], lsn=11, seq=0)
    catalog = _catalog(factory)
    # per_commit: one change per key and transaction (what history tables need)
    batches = list(
        decode_payloads([kafka_batch(factory.messages)], catalog.schema, per_commit=True)
    )
    by_topic = read_payloads(pa.Table.from_batches(batches), catalog.schema)
    assert sorted(by_topic) == ["pg.public.a", "pg.public.b"]
    a_changes = by_topic["pg.public.a"][0].changes
    assert sorted(r["after"]["x"] for r in a_changes.to_pylist()) == ["one", "uno"]
    assert newest_version(a_changes) == (11, 0)
    assert by_topic["pg.public.a"][0].identity == ("id",)
    # Otherwise the executors send only the last of a key's run of upserts.
    batches = list(decode_payloads([kafka_batch(factory.messages)], catalog.schema))
    (reduced,) = read_payloads(pa.Table.from_batches(batches), catalog.schema)["pg.public.a"]
    assert [(r["op"], r["lsn"], r["after"]["x"]) for r in reduced.changes.to_pylist()] == [
        ("c", 11, "uno")
    ]
    assert by_topic["pg.public.b"][0].changes.to_pylist()[0]["after"]["when"] == datetime(
        2024, 5, 6, 7, 8, 9, tzinfo=UTC
    )


def test_conversion_to_an_older_reader_keeps_nulls_of_whole_rows() -> None:
    factory = EnvelopeFactory()
    v1 = table_version("public", "t", [Col("id", INT4, key=True), Col("n", INT4)])
    factory.change(v1, "c", after=["1", "5"], lsn=10, seq=0)
    factory.change(v1, "d", before=["1", None], lsn=11, seq=0)
    (native,) = decode_native(kafka_batch(factory.messages), _catalog(factory).schema)
    wider = RowLayout.from_row(
        {
            "type": "record",
            "name": "Value",
            "fields": [
                {"name": "id", "type": "long"},
                {"name": "n", "type": ["null", "double"]},
                {"name": "extra", "type": ["null", "string"]},
            ],
        }  # fmt: skip
    )
    converted = to_reader(native.changes, native.layout, wider).to_pylist()
    assert converted[0]["after"] == {"id": 1, "n": 5.0, "extra": None}
    assert converted[1]["after"] is None and converted[1]["before"] == {
        "id": 1,
        "n": None,
        "extra": None,
    }
