"""Replica identity and primary key changes: new key schema, and still exact.

Under the writer: ``REPLICA IDENTITY FULL`` (delete and update images become
whole rows), then the primary key grows from ``(id)`` to ``(id, code)``, then
``REPLICA IDENTITY DEFAULT`` again (now the new key). Records from every
stage (delete images with only ``id``, whole rows, ``(id, code)`` keys) must
resolve to the newest schema and replay to the table (rows are matched by
``id``, unique throughout). The newest change's Kafka key is ``(id, code)``.
"""

from __future__ import annotations

import pytest
from support.cdc import read_changes

from .helpers import report

pytestmark = pytest.mark.integration


def test_identity_and_key_changes(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(
        ["ALTER TABLE items REPLICA IDENTITY FULL",
         "ALTER TABLE items DROP CONSTRAINT items_pkey, ADD PRIMARY KEY (id, code)",
         "ALTER TABLE items REPLICA IDENTITY DEFAULT"],
        seed=13,
    )
    problems, log = sc.outcome(heal=False, kinds=["identity"])
    changes = read_changes(sc.bootstrap, sc.prefix, [sc.topic()])
    newest = max((c for c in changes if c.key is not None), key=lambda c: (c.lsn, c.seq))
    if sorted(newest.key) != ["code", "id"]:
        problems.append(f"public.items: the newest change's key is {newest.key}, expected the "
                        "fields of the new primary key (id, code)")
    assert not problems, report(problems, log)
