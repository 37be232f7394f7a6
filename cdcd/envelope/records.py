"""Auxiliary records: logical decoding messages and transaction boundaries.

``<prefix>.message`` carries ``pg_logical_emit_message`` output, keyed by the
message prefix so that messages with one prefix stay ordered.
``<prefix>.transaction`` (opt-in, ``kafka.transaction_records``) carries a
BEGIN and an END record per transaction, keyed by the transaction id, with
per-table event counts in END, in the manner of Debezium's transaction
metadata topic. Both use the configured wire format.
"""

from __future__ import annotations

import io
from typing import Any

from fastavro import parse_schema, schemaless_writer

MESSAGE_KEY_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "MessageKey",
    "namespace": "io.cdcd",
    "fields": [{"name": "prefix", "type": "string"}],
}

MESSAGE_VALUE_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Message",
    "namespace": "io.cdcd",
    "fields": [
        {"name": "prefix", "type": "string"},
        {"name": "content", "type": "bytes"},
        {"name": "transactional", "type": "boolean"},
        {"name": "lsn", "type": "long"},
        {"name": "txId", "type": ["null", "long"], "default": None},
        {"name": "commit_lsn", "type": ["null", "long"], "default": None},
        {"name": "ts_ms", "type": "long"},
    ],
}

TRANSACTION_KEY_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "TransactionKey",
    "namespace": "io.cdcd",
    "fields": [{"name": "id", "type": "string"}],
}

TRANSACTION_VALUE_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Transaction",
    "namespace": "io.cdcd",
    "fields": [
        {"name": "status", "type": "string"},
        {"name": "id", "type": "string"},
        {"name": "lsn", "type": "long"},
        {"name": "event_count", "type": ["null", "long"], "default": None},
        {
            "name": "data_collections",
            "type": [
                "null",
                {
                    "type": "array",
                    "items": {
                        "type": "record",
                        "name": "DataCollection",
                        "fields": [
                            {"name": "data_collection", "type": "string"},
                            {"name": "event_count", "type": "long"},
                        ],
                    },
                },
            ],
            "default": None,
        },
        {"name": "ts_ms", "type": "long"},
    ],
}

_PARSED = {
    id(schema): parse_schema(schema)
    for schema in (
        MESSAGE_KEY_SCHEMA,
        MESSAGE_VALUE_SCHEMA,
        TRANSACTION_KEY_SCHEMA,
        TRANSACTION_VALUE_SCHEMA,
    )
}


def encode_record(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    """Avro binary of one auxiliary record (these are rare: fastavro is fine)."""
    out = io.BytesIO()
    schemaless_writer(out, _PARSED[id(schema)], record)
    return out.getvalue()
