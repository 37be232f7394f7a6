"""``cdcd schemas`` names each table in the ``schema.table`` grammar (issue 15).

The ``table`` field of its output was built by hand as ``schema + "." +
table``, so a table named ``order.lines`` printed as ``public.order.lines``,
which reads back as a different table (or none); it must be spelled the way
``postgres.tables`` is written: ``public."order.lines"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.cdc import run_cdcd, write_config

from cdcd.naming import parse_table

pytestmark = pytest.mark.integration


def _documents(text: str) -> list[dict[str, Any]]:
    """The JSON objects ``cdcd schemas`` prints one after another."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    position = 0
    text = text.strip()
    while position < len(text):
        document, position = decoder.raw_decode(text, position)
        out.append(document)
        while position < len(text) and text[position].isspace():
            position += 1
    return out


def test_schemas_quotes_table_names_that_need_it(pg, tmp_path: Path) -> None:
    pg.execute(
        'CREATE TABLE "order.lines"(id int PRIMARY KEY);'
        'CREATE TABLE "we""ird"(id int PRIMARY KEY);'
        "CREATE TABLE plain(id int PRIMARY KEY)"
    )
    spellings = {
        'public."order.lines"': "order.lines",
        'public."we""ird"': 'we"ird',
        "public.plain": "plain",
    }
    # Only PostgreSQL is asked; the broker address is never dialled.
    config = write_config(
        tmp_path / "c.yaml", pg.dsn, "127.0.0.1:9", tables=list(spellings), prefix="shop"
    )
    result = run_cdcd("schemas", "-c", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    printed = {entry["table"] for entry in _documents(result.stdout)}
    assert printed == set(spellings), result.stdout
    for spelling, name in spellings.items():
        # What is printed is what postgres.tables accepts for the same table.
        assert parse_table(spelling) == ("public", name)
