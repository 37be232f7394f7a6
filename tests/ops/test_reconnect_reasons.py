"""The ``reason`` label of ``cdcd_reconnects_total`` is what docs/operations.md says (issue 15).

The daemon labels a reconnect with the class name of the exception behind the
transient error. A real daemon's walsender is terminated; the reason it
reports must be among the documented values, and every documented value must
be an exception class name, never an invented word.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import confluent_kafka
import psycopg2
import psycopg2.errors
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cdc import wait_for

import cdcd.errors
import cdcd.sink.producer
import cdcd.source.slot_holder
from cdcd.local import free_port

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _documented_reasons() -> set[str]:
    row = next(
        line
        for line in OPERATIONS.read_text().splitlines()
        if line.startswith("| `cdcd_reconnects_total`")
    )
    description = row.split("|")[4]
    return set(re.findall(r"`([^`]+)`", description)) - {"reason"}


def _exception_class(name: str) -> type[BaseException] | None:
    for module in (psycopg2, psycopg2.errors, confluent_kafka, cdcd.errors, cdcd.sink.producer,
                   cdcd.source.slot_holder):
        found = getattr(module, name, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    return None


def test_documented_reasons_are_exception_class_names() -> None:
    reasons = _documented_reasons()
    assert reasons, "no reason values documented for cdcd_reconnects_total"
    assert not {r for r in reasons if _exception_class(r) is None}, reasons


@pytest.mark.integration
def test_a_real_reconnect_reason_is_documented(pg, cdc_config, daemons) -> None:
    pg.execute("CREATE TABLE t(id int PRIMARY KEY)")
    port = free_port()
    daemon = daemons(
        cdc_config(tables=["public.t"], extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    )
    slot = "cdcd_" + pg.dbname[:50]

    def walsender() -> int | None:
        row = pg.fetchone(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)
        )
        return None if row is None else int(row[0])

    pid = wait_for(walsender, what="streaming")
    pg.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def reasons() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
        return {
            sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(body)
            if family.name == "cdcd_reconnects"
            for sample in family.samples
            if sample.name == "cdcd_reconnects_total" and sample.value > 0
        }

    seen = wait_for(reasons, what="a reconnect in /metrics")
    assert daemon.alive(), daemon.log()
    assert set(seen) <= _documented_reasons(), (seen, daemon.log())
    assert daemon.terminate() == 0, daemon.log()
