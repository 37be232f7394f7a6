"""Unchanged TOAST values (SPEC §5 ``unchanged_toast``).

An UPDATE that does not touch a TOASTed column makes PostgreSQL send ``u``
(unchanged, value not sent) for it. With the default replica identity the
envelope has null there and names the column in ``unchanged_toast``; with
REPLICA IDENTITY FULL the old row carries the value, which fills ``after``.
"""

from __future__ import annotations

import pytest
from support.pg import read_pgoutput

from .helpers import Harness

pytestmark = pytest.mark.integration


def test_unchanged_toast_default_and_full_identity(pg) -> None:
    pg.execute("CREATE TABLE doc(id int PRIMARY KEY, n int, body text)")
    pg.execute("ALTER TABLE doc ALTER COLUMN body SET STORAGE EXTERNAL")  # out of line, uncompressed
    pg.capture(["doc"])
    body = "".join(f"{i:08x}" for i in range(4000))  # 32 kB
    pg.execute("INSERT INTO doc VALUES (1, 0, %s)", (body,))
    pg.execute("UPDATE doc SET n = 1 WHERE id = 1")
    pg.execute("ALTER TABLE doc REPLICA IDENTITY FULL")
    pg.execute("UPDATE doc SET n = 2 WHERE id = 1")
    harness = Harness(pg.dsn)
    try:
        insert, default_update, full_update = harness.run(read_pgoutput(pg.dsn, "slot", "pub"))
    finally:
        harness.close()

    assert insert.value["after"]["body"] == body
    assert default_update.value["after"] == {"id": 1, "n": 1, "body": None}
    assert default_update.value["unchanged_toast"] == ["body"]
    assert full_update.value["before"]["body"] == body
    assert full_update.value["after"] == {"id": 1, "n": 2, "body": body}
    assert full_update.value["unchanged_toast"] == []
