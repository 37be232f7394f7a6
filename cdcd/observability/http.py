"""The daemon's HTTP endpoints: ``/metrics``, ``/healthz``, ``/readyz``.

Why stdlib ``http.server`` in a daemon thread: three tiny endpoints do not
justify a web framework, and a separate thread keeps scrapes answering while the
main loop blocks on the walsender socket. ``/healthz`` must *not* be answered
by that thread alone, though: a server thread that happily says "ok" while the
main loop is wedged would hide exactly the failure a liveness probe exists to
catch. So the main loop calls ``Health.beat()`` every iteration and ``/healthz``
turns 503 when the last beat is older than the stall threshold.

``/readyz`` is 200 only while the daemon streams (``Health.set_ready(True)``),
so Kubernetes and load-balancer checks see snapshotting, reconnecting and
draining as "not ready" without treating them as dead.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from cdcd.errors import ConfigError, DefiniteError
from cdcd.observability.metrics import Metrics

__all__ = ["DEFAULT_STALL_AFTER_S", "Health", "MetricsServer", "parse_listen", "start"]

log = logging.getLogger(__name__)

#: A main loop that has not beaten for this long is considered stalled. Long
#: enough to cover a slow standby status round trip or a long GC pause, short
#: enough that a wedged daemon is restarted within a couple of minutes.
DEFAULT_STALL_AFTER_S = 60.0


class Health:
    """Liveness and readiness as the main loop reports them; thread-safe.

    Liveness starts counting at construction, so a daemon that never reaches its
    main loop also turns unhealthy after ``stall_after_s``.
    """

    def __init__(
        self,
        stall_after_s: float = DEFAULT_STALL_AFTER_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stall_after_s <= 0:
            raise ValueError("stall_after_s must be positive")
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat = clock()
        self._ready = False
        self._not_ready_reason = "starting"

    def beat(self) -> None:
        """Record that the main loop is alive; call it once per loop iteration."""
        now = self._clock()
        with self._lock:
            self._last_beat = now

    def set_ready(self, ready: bool, reason: str | None = None) -> None:
        """Ready = streaming. ``reason`` (e.g. ``snapshot``, ``reconnecting``) is shown on 503."""
        with self._lock:
            self._ready = ready
            if not ready:
                self._not_ready_reason = reason or "not streaming"

    def live(self) -> tuple[bool, str]:
        """``(alive, one-line reason)`` for ``/healthz``."""
        with self._lock:
            age = self._clock() - self._last_beat
        if age > self.stall_after_s:
            return False, (
                f"stalled: main loop has not reported for {age:.1f} s "
                f"(threshold {self.stall_after_s:g} s)"
            )
        return True, f"ok: main loop reported {age:.1f} s ago"

    def ready(self) -> tuple[bool, str]:
        """``(ready, one-line reason)`` for ``/readyz``."""
        with self._lock:
            if self._ready:
                return True, "ok: streaming"
            return False, f"not ready: {self._not_ready_reason}"


def parse_listen(listen: str) -> tuple[str, int]:
    """Split ``host:port``; IPv6 hosts are bracketed (``[::]:9187``).

    An empty host or ``*`` means every IPv4 interface. Port 0 asks the kernel
    for a free port (tests read it back from ``MetricsServer.port``).
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError(f"metrics.listen: {listen!r} is not host:port", hint="e.g. 0.0.0.0:9187")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(
            f"metrics.listen: {listen!r}: IPv6 addresses must be bracketed",
            hint="write [::]:9187 or [::1]:9187",
        )
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"metrics.listen: port {port} is out of range 0..65535")
    if host in ("", "*"):
        host = "0.0.0.0"
    return host, port


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        registry: CollectorRegistry,
        health: Health,
    ) -> None:
        self.address_family = family
        self.registry = registry
        self.health = health
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host name with getfqdn(), which can
        # block for seconds on reverse DNS; the name is never used here.
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            # Accept IPv4 too on [::], whatever net.ipv6.bindv6only says.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: object, client_address: object) -> None:
        log.exception("metrics HTTP server: error while serving %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # A client that connects and says nothing must not hold a thread forever.
    timeout = 10
    server_version = "cdcd"
    sys_version = ""

    def do_GET(self) -> None:
        self._respond(body=True)

    def do_HEAD(self) -> None:
        self._respond(body=False)

    def _respond(self, body: bool) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            try:
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                payload = encoder(self.server.registry)
            except Exception:
                log.exception("metrics collection failed")
                self._send(500, b"metrics collection failed\n", "text/plain; charset=utf-8", body)
                return
            self._send(200, payload, content_type, body)
        elif path == "/healthz":
            ok, reason = self.server.health.live()
            self._send(
                200 if ok else 503, (reason + "\n").encode(), "text/plain; charset=utf-8", body
            )
        elif path == "/readyz":
            ok, reason = self.server.health.ready()
            self._send(
                200 if ok else 503, (reason + "\n").encode(), "text/plain; charset=utf-8", body
            )
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain", body)

    def _send(self, status: int, payload: bytes, content_type: str, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        # Scrapes and probes arrive every few seconds; keep them out of INFO logs.
        log.debug("http %s " + format, self.address_string(), *args)


class MetricsServer:
    """A running endpoint server; ``stop()`` shuts it down and joins its thread."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._stopped = False

    @property
    def host(self) -> str:
        """The bound address (without brackets for IPv6)."""
        return self._server.server_name

    @property
    def port(self) -> int:
        """The bound port; the kernel's choice when listening on port 0."""
        return self._server.server_port

    @property
    def address(self) -> str:
        """The bound ``host:port``, IPv6 bracketed, as ``metrics.listen`` spells it."""
        return _join(self.host, self.port)

    @property
    def url(self) -> str:
        """Base URL reachable from this host (wildcard addresses mapped to loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{_join(host, self.port)}"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def start(listen: str, metrics: Metrics | CollectorRegistry, health: Health) -> MetricsServer:
    """Serve ``/metrics`` from ``metrics`` and health from ``health`` on ``listen``.

    Returns once the socket is bound, so a port conflict is reported at start
    rather than on the first scrape.
    """
    host, port = parse_listen(listen)
    registry = metrics.registry if isinstance(metrics, Metrics) else metrics
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        server = _Server((str(sockaddr[0]), port), family, registry, health)
    except OSError as exc:
        raise DefiniteError(
            f"cannot listen on {listen} for /metrics: {exc.strerror or exc}",
            hint="another process may hold the port; change metrics.listen",
        ) from exc
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="cdcd-http", daemon=True
    )
    thread.start()
    running = MetricsServer(server, thread)
    log.info("serving /metrics, /healthz and /readyz", extra={"listen": running.address})
    return running
