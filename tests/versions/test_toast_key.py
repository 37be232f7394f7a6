"""A key stored out of line (TOAST), on every PostgreSQL from 12 to 18 (issue 30).

When a replica identity column is stored out of line, PostgreSQL logs the old
key in full with every UPDATE and sends the new tuple's key column as
"unchanged TOAST" (``u``) when the UPDATE left it alone. cdcd once compared
the TupleData kinds (``t`` against ``u``), concluded that the key changed,
published a delete of the live row and then stopped at that LSN for good.

Here two tables -- default identity (the primary key) and ``REPLICA IDENTITY
FULL`` -- have a long text key and a large second column, both
``STORAGE EXTERNAL``; updates leave the key alone (with the other column
unchanged or changed), change the key, delete, and a last insert proves the
daemon kept streaming. The replay of each topic equals ``SELECT``, and no
delete was ever published for a key the table still holds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from schema_changes.helpers import wait_confirmed, wait_streaming
from support.cdc import read_changes, replay

pytestmark = pytest.mark.integration

TABLES = ("tk", "tf")  # default identity, REPLICA IDENTITY FULL


def _key(n: int) -> str:
    # Long enough that the row stays over the TOAST threshold (2 kB) once the
    # other column is out of line, so the key goes out of line too; short
    # enough for a btree entry (EXTERNAL storage compresses it nowhere).
    return f"key-{n:04d}-" + "k" * 2400


def _big(tag: str) -> str:
    # Incompressible (a hash chain): EXTERNAL storage keeps it out of line anyway.
    out, h = [], tag.encode()
    for _ in range(200):
        h = hashlib.sha256(h).hexdigest().encode()
        out.append(h.decode())
    return "".join(out)


def _setup(conn: Any) -> None:
    with conn.cursor() as cur:
        for table in TABLES:
            cur.execute(f"CREATE TABLE {table}(id text PRIMARY KEY, other text, n int)")
            cur.execute(
                f"ALTER TABLE {table} ALTER COLUMN id SET STORAGE EXTERNAL, "
                "ALTER COLUMN other SET STORAGE EXTERNAL"
            )
        cur.execute("ALTER TABLE tf REPLICA IDENTITY FULL")


def _workload(conn: Any) -> None:
    with conn.cursor() as cur:
        for table in TABLES:
            for n in range(1, 7):
                cur.execute(f"INSERT INTO {table} VALUES (%s, %s, %s)", (_key(n), _big(f"{n}"), n))
            # The UPDATE: key and other column untouched ('u' for both).
            cur.execute(f"UPDATE {table} SET n = n + 100")
            # Key untouched, the other TOASTed column changed.
            cur.execute(f"UPDATE {table} SET other = %s WHERE id = %s", (_big("new"), _key(2)))
            # In one transaction: key unchanged twice, then the key changed.
            cur.execute("BEGIN")
            cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id = %s", (_key(3),))
            cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id = %s", (_key(3),))
            cur.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (_key(30), _key(3)))
            cur.execute("COMMIT")
            # A key change that leaves the other TOASTed column alone.
            cur.execute(f"UPDATE {table} SET id = %s, n = -n WHERE id = %s", (_key(40), _key(4)))
            cur.execute(f"DELETE FROM {table} WHERE id = %s", (_key(5),))
            cur.execute(f"UPDATE {table} SET n = 0 WHERE id = %s", (_key(6),))
            # Streaming goes on after all of it.
            cur.execute(f"INSERT INTO {table} VALUES ('last', 'last', 0)")


def test_toasted_key_update_publishes_no_delete_and_keeps_streaming(
    version_pg, vdb, vconfig, broker, daemons
) -> None:
    conn = vdb.connect()
    _setup(conn)
    config = vconfig(tables=[f"public.{t}" for t in TABLES])
    daemon = daemons(config)
    slot = "cdcd_" + vdb.dbname[:50]
    wait_streaming(vdb, slot, daemon)
    _workload(conn)
    wait_confirmed(vdb, slot, daemon)
    assert daemon.terminate() == 0, daemon.log()[-3000:]

    prefix = vdb.dbname
    for table in TABLES:
        changes = read_changes(broker.bootstrap_servers, prefix, [f"{prefix}.public.{table}"])
        rows = {(r[0],): {"id": r[0], "other": r[1], "n": r[2]}
                for r in vdb.fetchall(f"SELECT id, other, n FROM {table}")}
        live = {key for (key,) in rows}
        deleted = [c.key["id"] for c in changes if c.value is None or c.value["op"] == "d"]
        # Only the keys the workload moved away from or deleted (each written once).
        assert set(deleted) == {_key(3), _key(4), _key(5)}, f"{table}: deletes of {len(deleted)}"
        assert not live & set(deleted), f"{table}: a delete was published for a live row"
        assert replay(changes, ("id",)) == rows, f"{table}: replay differs from the table"
        assert any(c.value and c.value["after"] and c.value["after"]["id"] == "last"
                   for c in changes), f"{table}: nothing after the toasted-key updates"
