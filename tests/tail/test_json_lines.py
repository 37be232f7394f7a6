"""``cdcd tail --json``: every decoded Avro value becomes plain JSON, losslessly where it matters."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, date, datetime, time
from decimal import Decimal

from cdcd.tail import Change, json_line


def test_values_become_plain_json() -> None:
    after = {
        "id": 1,
        "amount": Decimal("12.50"),
        "raw": b"\x00\xff",
        "at": datetime(2026, 11, 26, 10, 0, tzinfo=UTC),
        "day": date(2026, 11, 26),
        "clock": time(10, 0, 1),
        "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "tags": ["a", None],
    }
    envelope = {"op": "c", "before": None, "after": after, "unchanged_toast": [],
                "source": {"schema": "public", "table": "t", "lsn": 26400392}}
    line = json.loads(json_line(Change("pg.public.t", 0, 7, 26400392, 3, {"id": 1}, envelope)))
    assert line["lsn"] == "0/0192D688" and line["seq"] == 3 and line["table"] == "public.t"
    assert line["after"] == {
        "id": 1, "amount": "12.50", "raw": base64.b64encode(b"\x00\xff").decode(),
        "at": "2026-11-26T10:00:00+00:00", "day": "2026-11-26", "clock": "10:00:01",
        "ref": "12345678-1234-5678-1234-567812345678", "tags": ["a", None],
    }


def test_a_tombstone_is_a_line_without_op() -> None:
    line = json.loads(json_line(Change("pg.public.t", 1, 8, 1, 1, {"id": 3}, None)))
    assert line["op"] is None and line["key"] == {"id": 3} and "after" not in line
