"""cdcd.consumer: wire headers, the ``<prefix>._schemas`` reader, whole-message decoding (issue 15).

The registry lookup and its error classification are tested in
``tests/spark/test_registry_errors.py``. The ``_schemas`` reader runs
against the session's tansu broker, whose high watermark is too low after a
batch of records (INFRA.md): the reader must read to the real end anyway.
"""

from __future__ import annotations

import io
import json
import pickle
import uuid
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from support.kafka import create_topic, produce

from cdcd.consumer import (
    SchemaCatalog,
    confluent_header,
    fingerprint_header,
    schema_id,
    wire_header,
)
from cdcd.errors import DefiniteError, TransientError
from cdcd.tools.local import LocalBroker
from cdcd.tools.local.postgres import free_port


def test_wire_headers_of_both_formats() -> None:
    single = b"\xc3\x01" + bytes(range(8))
    assert wire_header(single + b"body") == single
    assert fingerprint_header(bytes(range(8)).hex()) == single
    confluent = confluent_header(7)
    assert confluent == b"\x00\x00\x00\x00\x07"
    assert wire_header(confluent + b"body") == confluent and schema_id(confluent) == 7
    for foreign in (b'{"json": 1}', b"\xc3\x01short", b"", b"\x00\x01"):
        with pytest.raises(ValueError, match="not a cdcd message"):
            wire_header(foreign)
    with pytest.raises(ValueError):
        fingerprint_header("abcd")
    with pytest.raises(ValueError):
        schema_id(single)


def _schema(n: int) -> dict[str, Any]:
    return {
        "type": "record",
        "name": "Value",
        "namespace": f"pg.public.t{n}",
        "fields": [
            {"name": "id", "type": "int"},
            {
                "name": "amount",
                "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 9,
                                  "scale": 2}],
                "default": None,
            },
        ],
    }  # fmt: skip


def _fingerprint(n: int) -> str:
    return f"{n:016x}"


def _publish(bootstrap: str, topic: str, numbers: range) -> None:
    records = [
        (_fingerprint(n).encode(), json.dumps(_schema(n)).encode()) for n in numbers
    ]  # fmt: skip
    # One producer batch: tansu then reports a high watermark of 1 more than its base offset.
    produce(bootstrap, topic, records, **{"linger.ms": 100})


@pytest.mark.integration
def test_schemas_topic_is_read_to_its_real_end_incrementally(broker: LocalBroker) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    bootstrap = broker.bootstrap_servers
    catalog = SchemaCatalog(prefix, bootstrap_servers=bootstrap, timeout_s=15)
    catalog.refresh()  # no _schemas topic yet: nothing published, no error
    with pytest.raises(DefiniteError, match=f"is not in {prefix}._schemas"):
        catalog.schema(fingerprint_header(_fingerprint(1)))

    create_topic(bootstrap, f"{prefix}._schemas", config={"cleanup.policy": "compact"})
    _publish(bootstrap, f"{prefix}._schemas", range(10))
    catalog.refresh()
    assert all(catalog.schema(fingerprint_header(_fingerprint(n))) == _schema(n) for n in range(10))

    # Published later: an unknown header makes the catalog read on from where it stopped.
    _publish(bootstrap, f"{prefix}._schemas", range(10, 15))
    assert catalog.schema(fingerprint_header(_fingerprint(14))) == _schema(14)
    assert catalog._positions == {0: 15}

    # A message decodes whole with its writer schema, logical types applied.
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(_schema(3)), {"id": 1,
                                                                        "amount": Decimal("2.50")})  # fmt: skip
    message = fingerprint_header(_fingerprint(3)) + body.getvalue()
    assert catalog.decode(message) == {"id": 1, "amount": Decimal("2.50")}
    with pytest.raises(DefiniteError, match="not a cdcd message"):
        catalog.decode(b"plain text")

    # The same fingerprint published again with another schema (the canonical form leaves
    # out logical types, defaults and aliases): the latest record wins after a refresh,
    # and decoding uses it.
    wider = _schema(3)
    wider["fields"][1]["type"][1]["scale"] = 3
    produce(
        bootstrap, f"{prefix}._schemas", [(_fingerprint(3).encode(), json.dumps(wider).encode())]
    )
    catalog.refresh()
    assert catalog.schema(fingerprint_header(_fingerprint(3))) == wider
    assert catalog.decode(message) == {"id": 1, "amount": Decimal("0.250")}

    # Executors get a pickled catalog: it keeps what it read and reads on by itself.
    copy = pickle.loads(pickle.dumps(catalog))
    assert copy.schema(fingerprint_header(_fingerprint(0))) == _schema(0)
    _publish(bootstrap, f"{prefix}._schemas", range(16, 17))
    assert copy.schema(fingerprint_header(_fingerprint(16))) == _schema(16)


def test_a_record_in_schemas_that_cdcd_did_not_write_is_reported() -> None:
    catalog = SchemaCatalog("pg")
    with pytest.raises(DefiniteError, match=r"pg\._schemas offset 3 is not a cdcd schema record"):
        catalog._file("pg._schemas", 3, b"not hex", b"{}")


def test_an_unreachable_broker_is_transient() -> None:
    catalog = SchemaCatalog("pg", bootstrap_servers=f"127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(TransientError, match=r"cannot list pg\._schemas"):
        catalog.refresh()
