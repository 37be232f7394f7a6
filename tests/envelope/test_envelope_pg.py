"""Every SPEC §5 type (and arrays of each) through the whole envelope stage.

Rows are inserted, updated and deleted in a real PostgreSQL 15; the pgoutput
stream goes through cdcd's decoder, relation cache and envelope encoder; keys and envelopes are decoded back with plain
fastavro using the schemas cdcd published, and compared with values computed
independently by PostgreSQL (see ``tests/decode/test_values_pg.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from decode.helpers import same
from decode.test_values_pg import SESSION, _columns, _create_table, _expected, _short
from support.pg import read_pgoutput

from cdcd.envelope.schemas import field_names
from cdcd.errors import EncodeError

from .helpers import Harness

pytestmark = pytest.mark.integration


def _check_row(record: dict[str, Any], expected: dict[str, Any], names: dict[str, str]) -> None:
    for column in _columns():
        got = record[names[column.name]]
        want = expected[column.name]
        assert same(got, want), f"{column.name}: {_short(got)} != {_short(want)}"


def test_insert_update_delete_every_type(pg) -> None:
    _create_table(pg)  # table t (REPLICA IDENTITY FULL, primary key id), slot "slot", pub "pub"
    pg.execute("UPDATE t SET id = id")  # same values: after == before == expected
    expected = _expected(pg, "UTC")
    pg.execute("DELETE FROM t")
    dsn = pg.dsn_with(options=f"{SESSION} -c timezone=UTC")
    harness = Harness(dsn)
    try:
        published = harness.run(read_pgoutput(dsn, "slot", "pub"))
    finally:
        harness.close()
    table = published[0].table
    names = dict(zip(table.column_names, field_names(table.column_names), strict=True))
    ops: dict[str, int] = {}
    for item in published:
        envelope = item.value
        ops[envelope["op"]] = ops.get(envelope["op"], 0) + 1
        assert item.key is not None and set(item.key) == {"id"}
        row = envelope["after"] or envelope["before"]
        assert item.key["id"] == row["id"]
        if envelope["op"] == "c":
            assert envelope["before"] is None
            _check_row(envelope["after"], expected[row["id"]], names)
        elif envelope["op"] == "u":
            _check_row(envelope["before"], expected[row["id"]], names)
            _check_row(envelope["after"], expected[row["id"]], names)
        else:
            assert envelope["after"] is None
            _check_row(envelope["before"], expected[row["id"]], names)
        source = envelope["source"]
        assert source["connector"] == "cdcd" and source["table"] == "t" and not source["snapshot"]
        assert envelope["unchanged_toast"] == []
    rows = len(expected)
    assert ops == {"c": rows, "u": rows, "d": rows}


def test_binary_values_from_the_server_are_refused(pg) -> None:
    """cdcd never asks pgoutput for ``binary``; should 'b' values come, it stops."""
    pg.execute("CREATE TABLE q(id int PRIMARY KEY, note text)")
    pg.capture(["q"])
    pg.execute("INSERT INTO q VALUES (1, 'one')")
    harness = Harness(pg.dsn)
    try:
        with pytest.raises(EncodeError, match=r"public\.q\b.*\bid: value sent in binary format") as caught:
            harness.run(read_pgoutput(pg.dsn, "slot", "pub", binary=True))
    finally:
        harness.close()
    assert "report it" in str(caught.value) and caught.value.exit_code == 3
