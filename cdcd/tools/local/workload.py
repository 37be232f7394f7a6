"""The SPEC §9 ``orders`` table, shared by the demo, the benchmark and the tests.

One definition, so that every figure and every test measures the same shape.
"""

from __future__ import annotations


def orders_ddl(table: str = "orders") -> str:
    """``CREATE TABLE`` for the SPEC §9 workload table (``table`` may be schema-qualified)."""
    return f"""CREATE TABLE {table}(
  id bigserial PRIMARY KEY,
  customer_id int NOT NULL,
  status text NOT NULL,
  amount numeric(12,2) NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  note text,
  flags boolean,
  payload jsonb)"""
