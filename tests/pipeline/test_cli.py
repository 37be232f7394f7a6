"""``cdcd check`` and ``cdcd schemas`` on a healthy setup (SPEC §2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cdc import run_cdcd, write_config

pytestmark = pytest.mark.integration


def test_check_passes_and_hides_the_password(pg, broker, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE a(id int PRIMARY KEY, v text); CREATE TABLE b(v text)")
    pg.execute("ALTER TABLE b REPLICA IDENTITY FULL")
    config = write_config(tmp_path / "c.yaml", pg.dsn + " password=s3cret", broker.bootstrap_servers,
                          tables=["public.a", "public.b"])
    result = run_cdcd("check", "-c", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("ok") for line in lines), result.stdout
    for expected in ("wal_level: logical", "table public.a: primary key (id)",
                     "table public.b: replica identity FULL", "kafka:", "slot cdcd"):
        assert any(expected in line for line in lines), (expected, result.stdout)
    assert "s3cret" not in result.stdout + result.stderr


def test_check_fails_for_a_table_without_identity(pg, broker, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE nokey(v text)")
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers,
                          tables=["public.nokey"])
    result = run_cdcd("check", "-c", str(config))
    assert result.returncode == 2  # a configuration mistake: run refuses the table (exit 2)
    assert any(line.startswith("FAIL table public.nokey") and "REPLICA IDENTITY FULL" in line
               for line in result.stdout.splitlines()), result.stdout


def test_schemas_prints_key_and_value_per_table(pg, broker, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE orders(id bigserial PRIMARY KEY, amount numeric(12,2) NOT NULL, "
               "created_at timestamptz, tags text[])")
    config = write_config(tmp_path / "c.yaml", pg.dsn, broker.bootstrap_servers,
                          tables=["public.orders"], prefix="shop")
    result = run_cdcd("schemas", "-c", str(config))
    assert result.returncode == 0, result.stderr
    entry = json.loads(result.stdout)
    assert entry["topic"] == "shop.public.orders"
    assert entry["key"]["fields"] == [{"name": "id", "type": "long"}]
    row = entry["value"]["fields"][0]["type"][1]
    types = {f["name"]: f["type"] for f in row["fields"]}
    assert types["amount"] == ["null", {"type": "bytes", "logicalType": "decimal", "precision": 12,
                                        "scale": 2}]
    assert types["created_at"] == ["null", {"type": "long", "logicalType": "timestamp-micros"}]
    assert types["tags"] == ["null", {"type": "array", "items": ["null", "string"]}]
