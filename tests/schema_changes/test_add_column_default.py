"""ADD COLUMN ... DEFAULT <constant> (a "fast default": no rewrite, no row change in the WAL).

PostgreSQL stores the value once (``pg_attribute.attmissingval``) and returns
it for every existing row; the daemon must carry it as the Avro default of the
new field, so an old record resolved with the newest schema reads it. Columns
of many types at once (decimal with a negative value, bytea, date, time,
timestamps, uuid, jsonb, a name that must be sanitized), with and without
NOT NULL. No snapshot may be started. (An array default, which Avro cannot
carry for nullable elements, is in test_rewrite_volatile_default.py.)
"""

from __future__ import annotations

import pytest

from .helpers import heal_jobs, report

pytestmark = pytest.mark.integration

TYPED_DEFAULTS = """ALTER TABLE items
  ADD COLUMN n4 int DEFAULT 7,
  ADD COLUMN n8 bigint NOT NULL DEFAULT -9000000000,
  ADD COLUMN f8 float8 DEFAULT 2.5,
  ADD COLUMN dec numeric(10,2) DEFAULT -0.01,
  ADD COLUMN big_dec numeric(12,3) DEFAULT 123456789.125,
  ADD COLUMN num numeric DEFAULT 1.50,
  ADD COLUMN flag bool NOT NULL DEFAULT true,
  ADD COLUMN day date DEFAULT '2024-02-29',
  ADD COLUMN clock time DEFAULT '13:14:15.161718',
  ADD COLUMN local_ts timestamp DEFAULT '2001-02-03 04:05:06.789',
  ADD COLUMN at timestamptz DEFAULT '2024-01-02 03:04:05.678901+02',
  ADD COLUMN raw bytea DEFAULT '\\x00ff7f80',
  ADD COLUMN ident uuid DEFAULT 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
  ADD COLUMN doc jsonb DEFAULT '{"k": [1, "two"]}',
  ADD COLUMN "Région code" varchar(8) DEFAULT 'ü-1'"""


def test_fast_defaults_fill_every_existing_row(scenario) -> None:
    sc = scenario()
    sc.ddl_under_load(
        ["ALTER TABLE items ADD COLUMN region text DEFAULT 'eu'", TYPED_DEFAULTS], seed=3,
        rewrites=False,
    )
    # Rows that changed after the DDL carry their own values.
    for row_id in (2, 4, 6):
        sc.execute("UPDATE items SET region = 'us', n4 = NULL, dec = 5.55 WHERE id = %s",
                   (row_id,))
    problems, log = sc.outcome(heal=False, kinds=["add_column_default"])
    jobs = heal_jobs(sc.pg)
    if jobs:
        problems.append(f"public.items: a fast default needs no snapshot, but jobs ran: {jobs}")
    assert not problems, report(problems, log)
