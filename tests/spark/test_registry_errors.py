"""Schema registry failures are classified, not all "not found" (issue 15).

A 404 from the registry is definite: the message cannot be decoded. No
answer (connection refused, timeout) or a 408/429/5xx is transient: the
registry may answer later. Driven through the real registry client against
a local HTTP server (and its mock client), plus fakes raising each kind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("pyarrow")

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from cdcd.consumer import SchemaCatalog
from cdcd.errors import DefiniteError, TransientError
from cdcd.tools.local.postgres import free_port

HEADER = b"\x00" + (7).to_bytes(4, "big")  # Confluent wire format, schema id 7


class _Registry(ThreadingHTTPServer):
    """Answers every request with ``status`` (and a registry error body), or never."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = 404
        self.hang = False
        self.release = threading.Event()
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Registry

    def do_GET(self) -> None:
        self.server.requests += 1
        if self.server.hang:
            self.server.release.wait()
            return
        status = self.server.status
        body = json.dumps({"error_code": status * 100 + 3, "message": f"status {status}"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def registry() -> Iterator[_Registry]:
    server = _Registry()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


def _catalog(url: str, **config: Any) -> SchemaCatalog:
    # No client-side retries: one request per lookup.
    client = SchemaRegistryClient({"url": url, "max.retries": 0, **config})
    return SchemaCatalog("pg", registry_client=client)


def test_not_found_is_definite(registry: _Registry) -> None:
    registry.status = 404
    with pytest.raises(DefiniteError, match="schema id 7 not found in the schema registry"):
        _catalog(registry.url).schema(HEADER)


def test_not_found_in_the_mock_registry_is_definite() -> None:
    client = SchemaRegistryClient.new_client({"url": "mock://cdcd-registry-errors"})
    with pytest.raises(DefiniteError, match="schema id 7 not found"):
        SchemaCatalog("pg", registry_client=client).schema(HEADER)


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_server_errors_are_transient(registry: _Registry, status: int) -> None:
    registry.status = status
    catalog = _catalog(registry.url)
    with pytest.raises(TransientError, match=f"HTTP status code {status}") as raised:
        catalog.schema(HEADER)
    assert not isinstance(raised.value, DefiniteError)
    # Nothing was cached: the next lookup asks again and succeeds.
    registry.status = 404
    with pytest.raises(DefiniteError):
        catalog.schema(HEADER)
    assert registry.requests == 2


def test_a_timeout_is_transient(registry: _Registry) -> None:
    registry.hang = True  # accepts the connection, never answers
    with pytest.raises(TransientError, match="did not answer the lookup of schema id 7") as raised:
        _catalog(registry.url, timeout=0.5).schema(HEADER)
    assert "Timeout" in str(raised.value)


def test_a_refused_connection_is_transient() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TransientError, match="did not answer the lookup of schema id 7"):
        _catalog(url).schema(HEADER)


def test_refused_credentials_are_definite(registry: _Registry) -> None:
    registry.status = 401
    with pytest.raises(DefiniteError, match="refused the lookup") as raised:
        _catalog(registry.url).schema(HEADER)
    assert "schema_registry.config" in str(raised.value)


class _Raising:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def get_schema(self, schema_id: int) -> Any:
        raise self.exc

    def get_latest_version(self, subject: str) -> Any:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (SchemaRegistryError(404, 40403, "Schema not found"), DefiniteError),
        (SchemaRegistryError(502, -1, "Bad gateway"), TransientError),
        (ConnectionResetError(104, "Connection reset by peer"), TransientError),
        (TimeoutError("timed out"), TransientError),
    ],
)
def test_each_kind_from_a_fake_client(exc: Exception, kind: type[Exception]) -> None:
    catalog = SchemaCatalog("pg", registry_client=_Raising(exc))
    with pytest.raises(kind) as raised:
        catalog.schema(HEADER)
    assert raised.value.__cause__ is exc


def test_a_bug_in_the_client_is_not_disguised() -> None:
    bug = TypeError("unexpected response type")
    with pytest.raises(TypeError) as raised:
        SchemaCatalog("pg", registry_client=_Raising(bug)).schema(HEADER)
    assert raised.value is bug


def test_latest_is_none_only_when_nothing_is_registered(registry: _Registry) -> None:
    registry.status = 404
    assert _catalog(registry.url).latest("pg.public.t") is None
    registry.status = 503
    with pytest.raises(TransientError, match="subject pg.public.t-value"):
        _catalog(registry.url).latest("pg.public.t")
