"""Topics are created by what they are, not by how their name ends (issue 15).

A captured table named ``transaction`` or ``message`` has the topic
``<prefix>.public.transaction``: a table topic, with ``kafka.partitions``
partitions like any other. Only the prefix's own ``<prefix>.transaction``,
``<prefix>.message`` and ``<prefix>._schemas`` get one partition.
"""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient
from support.cdc import wait_streaming, wait_wal_confirmed

from cdcd.config.model import KafkaConfig
from cdcd.naming import message_topic, schemas_topic, transaction_topic

PARTITIONS = 3


def test_partitions_is_documented_as_topic_spec_applies_it() -> None:
    """docs/configuration.md is generated from this description."""
    description = KafkaConfig.model_fields["partitions"].description or ""
    assert "table topic" in description
    assert "always get 1" in description
    from cdcd.sink.topics import topic_spec

    kafka = KafkaConfig(bootstrap_servers="b:1", topic_prefix="p", partitions=5)
    for auxiliary in (transaction_topic, message_topic, schemas_topic):
        assert auxiliary("<prefix>") in description
        assert topic_spec(kafka, auxiliary("p")).partitions == 1


@pytest.mark.integration
def test_tables_named_like_auxiliary_topics_get_kafka_partitions(
    pg, broker, cdc_config, daemons
) -> None:
    conn = pg.connect()
    conn.cursor().execute(
        'CREATE TABLE "transaction"(id int PRIMARY KEY); CREATE TABLE message(id int PRIMARY KEY)'
    )
    daemon = daemons(
        cdc_config(
            tables=["public.transaction", "public.message"],
            kafka={"partitions": PARTITIONS, "transaction_records": True},
        )
    )
    slot = "cdcd_" + pg.dbname[:50]
    wait_streaming(pg, slot, daemon)
    cur = conn.cursor()
    cur.execute('INSERT INTO "transaction" VALUES (1); INSERT INTO message VALUES (1)')
    cur.execute("SELECT pg_logical_emit_message(false, 'app', 'x')")
    wait_wal_confirmed(conn, slot)
    assert daemon.terminate() == 0, daemon.log()

    prefix = pg.dbname
    metadata = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(
        timeout=10
    )
    partitions = {
        name: len(topic.partitions)
        for name, topic in metadata.topics.items()
        if name.startswith(f"{prefix}.")
    }
    assert partitions == {
        f"{prefix}.public.transaction": PARTITIONS,
        f"{prefix}.public.message": PARTITIONS,
        f"{prefix}.transaction": 1,
        f"{prefix}.message": 1,
        f"{prefix}._schemas": 1,
    }
