"""Registry mode (SPEC §6): Confluent wire format through the registry client.

Uses confluent-kafka's bundled mock registry (``mock://``), the only registry
available here. Subjects follow TopicNameStrategy; the bytes are decoded with
Confluent's own ``AvroDeserializer``. Outages use a tiny registry on loopback
(:class:`FakeRegistry`) that refuses, hangs or answers 503.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from support.cdc import wait_for, wait_streaming
from support.kafka import consume_all
from support.pg import read_pgoutput

from cdcd.envelope.wire import REGISTRY_TIMEOUT_S, ConfluentFormat, registry_client
from cdcd.errors import TransientError
from cdcd.naming import table_topic

from .helpers import Harness


@pytest.mark.integration
def test_confluent_wire_format_with_mock_registry(pg) -> None:
    pg.execute("CREATE TABLE r(id int PRIMARY KEY, amount numeric(8,2), at timestamptz)")
    pg.capture(["r"])
    pg.execute("INSERT INTO r VALUES (1, 12.5, '2026-11-21 10:00:00+00'), (2, -3.25, NULL)")
    pg.execute("ALTER TABLE r ADD COLUMN note text")
    pg.execute("INSERT INTO r VALUES (3, 1, NULL, 'after alter')")
    client = SchemaRegistryClient.new_client({"url": "mock://cdcd-test"})
    harness = Harness(pg.dsn, wire=ConfluentFormat(client))
    encoder_calls = []
    try:
        payloads = read_pgoutput(pg.dsn, "slot", "pub")
        published = harness.run(payloads)
        for item in published:
            encoder = harness.encoder.for_table(item.table)
            encoder_calls.append(encoder)
    finally:
        harness.close()

    assert set(client.get_subjects()) == {"pg.public.r-key", "pg.public.r-value"}
    assert len(client.get_versions("pg.public.r-value")) == 2  # one per relation version
    deserializer = AvroDeserializer(client)
    values = []
    for item in published:
        raw = item.raw_value
        assert raw[0] == 0
        schema_id = int.from_bytes(raw[1:5], "big")
        assert client.get_schema(schema_id).schema_type == "AVRO"
        record = deserializer(raw, SerializationContext("pg.public.r", MessageField.VALUE))
        values.append(record)
    assert [v["after"]["id"] for v in values] == [1, 2, 3]
    assert str(values[0]["after"]["amount"]) == "12.50"
    assert values[2]["after"]["note"] == "after alter"
    key_bytes = encoder_calls[0].key_header
    assert key_bytes[0] == 0
    latest_key = client.get_latest_version("pg.public.r-key")
    assert int.from_bytes(key_bytes[1:5], "big") == latest_key.schema_id


# ----------------------------------------------------------------------------- outages
#
# A schema registry that refuses connections, hangs or answers 5xx is an outage:
# the registration raises TransientError (the daemon retries with backoff from the
# last confirmed position), never the HTTP library's own error (a traceback, exit 1).


class FakeRegistry:
    """A tiny registry on loopback: registers schemas, or fails as ``mode`` says.

    ``ok``: ``POST /subjects/<s>/versions`` answers ``{"id": n}`` (one id per
    distinct schema text), ``GET /schemas/ids/<n>`` the schema. ``503``:
    every request answers 503. ``hang``: requests are read and never answered
    (until :meth:`close`).
    """

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests = 0
        self.ids: dict[str, int] = {}
        self._release = threading.Event()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _answer(self, status: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self) -> None:
                registry.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                if registry.mode == "hang":
                    registry._release.wait(60)
                    return
                if registry.mode == "503":
                    self._answer(503, {"error_code": 50302, "message": "unavailable"})
                    return
                path = self.path.split("?")[0]
                if self.command == "POST" and path.endswith("/versions"):
                    text = request["schema"]
                    number = registry.ids.setdefault(text, len(registry.ids) + 1)
                    self._answer(200, {"id": number})
                elif self.command == "GET" and path.startswith("/schemas/ids/"):
                    number = int(path.rsplit("/", 1)[1])
                    text = next(t for t, n in registry.ids.items() if n == number)
                    self._answer(200, {"schema": text})
                else:
                    self._answer(404, {"error_code": 40401, "message": "not found"})

            do_GET = do_POST = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fake_registry() -> Iterator[FakeRegistry]:
    registry = FakeRegistry()
    try:
        yield registry
    finally:
        registry.close()


SCHEMA = {"type": "record", "name": "Value", "namespace": "t",
          "fields": [{"name": "id", "type": "int"}]}
# No client-side retries, and a short request timeout: each case fails at once.
QUICK = {"max.retries": "0", "timeout": "2"}


def _refused_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


@pytest.mark.parametrize("mode", ["refused", "503", "hang"])
def test_a_registry_outage_is_transient(fake_registry: FakeRegistry, mode: str) -> None:
    url = _refused_url() if mode == "refused" else fake_registry.url
    fake_registry.mode = mode
    wire = ConfluentFormat(registry_client(url, QUICK))
    with pytest.raises(TransientError) as raised:
        wire.header("pg.public.t", "value", SCHEMA)
    assert "schema registry" in str(raised.value)
    # Nothing is cached from a failure: once the registry answers, it works.
    if mode != "refused":
        fake_registry.mode = "ok"
        header = wire.header("pg.public.t", "value", SCHEMA)
        assert header == b"\x00" + (1).to_bytes(4, "big")


def test_a_registry_without_timeout_setting_still_times_out() -> None:
    client = registry_client("http://127.0.0.1:1")
    assert client._rest_client.timeout == REGISTRY_TIMEOUT_S


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["503", "hang"])
def test_the_daemon_waits_out_a_registry_outage(pg, broker, cdc_config, daemons,
                                                fake_registry: FakeRegistry, mode: str) -> None:
    """503 or no answer: retried with one log line each, nothing confirmed; then delivered."""
    pg.execute("CREATE TABLE r (id int PRIMARY KEY, v text)")
    fake_registry.mode = mode
    config = cdc_config(tables=["public.r"],
                        extra={"schema_registry": {"url": fake_registry.url, "config": QUICK}})
    slot = "cdcd_" + pg.dbname[:50]
    daemon = daemons(config)
    wait_streaming(pg, slot)
    before = pg.fetchone("SELECT confirmed_flush_lsn FROM pg_replication_slots "
                         "WHERE slot_name = %s", (slot,))
    pg.execute("INSERT INTO r VALUES (1, 'a'), (2, 'b')")
    commit = pg.fetchone("SELECT pg_current_wal_lsn()")[0]

    def outage_lines() -> list[str]:
        return [line for line in daemon.log().splitlines()
                if "schema registry" in line and "reconnecting" in line]

    wait_for(lambda: len(outage_lines()) >= 2, timeout_s=90, what="two retries logged")
    assert daemon.alive(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()
    assert "reason=schema_registry" in outage_lines()[0], outage_lines()[0]
    confirmed = pg.fetchone(
        "SELECT confirmed_flush_lsn < %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
        (commit, slot))
    assert confirmed == (True,), f"confirmed past an undelivered change (was {before})"
    topic = table_topic(pg.dbname, "public", "r")
    assert not consume_all(broker.bootstrap_servers, topic, timeout_s=5, idle_s=0.5)

    fake_registry.mode = "ok"
    wait_for(lambda: len(consume_all(broker.bootstrap_servers, topic, timeout_s=5, idle_s=0.5)) >= 2,
             timeout_s=120, what="the changes after the outage")
    wait_for(lambda: pg.fetchone(
        "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
        (commit, slot)) == (True,), timeout_s=60, what="confirmation after delivery")
    ids = sorted(int.from_bytes(m.value()[1:5], "big")
                 for m in consume_all(broker.bootstrap_servers, topic, timeout_s=5, idle_s=0.5))
    assert ids and all(i in fake_registry.ids.values() for i in ids)
    assert daemon.alive(), daemon.log()
