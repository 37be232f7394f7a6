"""Registry mode (SPEC §6): Confluent wire format through the registry client.

Uses confluent-kafka's bundled mock registry (``mock://``), the only registry
available here. Subjects follow TopicNameStrategy; the bytes are decoded with
Confluent's own ``AvroDeserializer``.
"""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from support.pg import create_publication, create_slot, read_pgoutput

from cdcd.envelope.wire import ConfluentFormat

from .helpers import Harness

pytestmark = pytest.mark.integration


def test_confluent_wire_format_with_mock_registry(pg) -> None:
    pg.execute("CREATE TABLE r(id int PRIMARY KEY, amount numeric(8,2), at timestamptz)")
    conn = pg.connect()
    create_publication(conn, "pub", ["r"])
    create_slot(conn, "slot")
    pg.execute("INSERT INTO r VALUES (1, 12.5, '2026-11-21 10:00:00+00'), (2, -3.25, NULL)")
    pg.execute("ALTER TABLE r ADD COLUMN note text")
    pg.execute("INSERT INTO r VALUES (3, 1, NULL, 'after alter')")
    client = SchemaRegistryClient.new_client({"url": "mock://cdcd-test"})
    harness = Harness(pg.dsn, wire=ConfluentFormat(client))
    encoder_calls = []
    try:
        payloads = read_pgoutput(pg.dsn, "slot", "pub")
        published = harness.run(payloads)
        for item in published:
            encoder = harness.encoder.for_table(item.table)
            encoder_calls.append(encoder)
    finally:
        harness.close()

    assert set(client.get_subjects()) == {"pg.public.r-key", "pg.public.r-value"}
    assert len(client.get_versions("pg.public.r-value")) == 2  # one per relation version
    deserializer = AvroDeserializer(client)
    values = []
    for item in published:
        raw = item.raw_value
        assert raw[0] == 0
        schema_id = int.from_bytes(raw[1:5], "big")
        assert client.get_schema(schema_id).schema_type == "AVRO"
        record = deserializer(raw, SerializationContext("pg.public.r", MessageField.VALUE))
        values.append(record)
    assert [v["after"]["id"] for v in values] == [1, 2, 3]
    assert str(values[0]["after"]["amount"]) == "12.50"
    assert values[2]["after"]["note"] == "after alter"
    key_bytes = encoder_calls[0].key_header
    assert key_bytes[0] == 0
    latest_key = client.get_latest_version("pg.public.r-key")
    assert int.from_bytes(key_bytes[1:5], "big") == latest_key.schema_id
