"""The SPEC §9 ``orders`` messages captured from a real PostgreSQL 15 walsender.

``tests/protocol/golden/orders.json`` (written by
``python -m tests.protocol.capture_golden``), split for the benchmarks that
feed them to the decoder.
"""

from __future__ import annotations

import json
from pathlib import Path

from cdcd.protocol import PgOutputDecoder
from cdcd.protocol.messages import Insert, Relation

GOLDEN = Path(__file__).resolve().parents[1] / "protocol" / "golden" / "orders.json"


def orders_payloads() -> tuple[list[bytes], list[bytes]]:
    """(the Relation payloads, the Insert payloads), in capture order."""
    decoder = PgOutputDecoder(1)
    relations: list[bytes] = []
    inserts: list[bytes] = []
    for entry in json.loads(GOLDEN.read_text("utf-8"))["messages"]:
        payload = bytes.fromhex(entry["hex"])
        message = decoder.decode(payload)
        if isinstance(message, Relation):
            relations.append(payload)
        elif isinstance(message, Insert):
            inserts.append(payload)
    return relations, inserts
