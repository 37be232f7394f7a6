"""The metrics registry and the /metrics, /healthz, /readyz server on a real socket."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import cdcd
from cdcd.errors import ConfigError, DefiniteError
from cdcd.observability import http
from cdcd.observability.metrics import (
    METRICS,
    OPS,
    REGISTRY,
    Metrics,
    exposed_names,
)

REQUIRED = {
    "cdcd_events_total",
    "cdcd_transactions_total",
    "cdcd_received_bytes_total",
    "cdcd_delivery_errors_total",
    "cdcd_delivery_latency_seconds_bucket",
    "cdcd_delivery_latency_seconds_sum",
    "cdcd_delivery_latency_seconds_count",
    "cdcd_messages_in_flight",
    "cdcd_producer_queue_messages",
    "cdcd_received_lsn_bytes",
    "cdcd_confirmed_lsn_bytes",
    "cdcd_slot_lag_bytes",
    "cdcd_last_confirmed_age_seconds",
    "cdcd_snapshot_rows_total",
    "cdcd_snapshot_rows_estimated",
    "cdcd_snapshot_chunks_total",
    "cdcd_reconnects_total",
    "cdcd_build_info",
    "cdcd_streaming",
    "cdcd_heartbeats_total",
    "cdcd_spill_bytes",
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(
    url: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(status, content type, body) without raising on 4xx/5xx."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


@pytest.fixture
def server(metrics: Metrics) -> Iterator[tuple[http.MetricsServer, http.Health]]:
    health = http.Health(stall_after_s=60)
    running = http.start("127.0.0.1:0", metrics, health)
    try:
        yield running, health
    finally:
        running.stop()


# -- metrics ------------------------------------------------------------------


def test_every_required_metric_is_exposed(metrics: Metrics) -> None:
    missing = REQUIRED - exposed_names(metrics.registry)
    assert not missing


def test_metric_names_follow_the_convention(metrics: Metrics) -> None:
    for family in metrics.registry.collect():
        if family.name.startswith("cdcd_"):
            assert family.documentation.strip(), family.name
            assert family.name == family.name.lower()


def test_fresh_registries_are_independent() -> None:
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.transactions.inc(3)
    assert b.registry.get_sample_value("cdcd_transactions_total") == 0
    assert a.registry.get_sample_value("cdcd_transactions_total") == 3


def test_default_instance_lives_on_the_module_registry() -> None:
    assert METRICS.registry is REGISTRY
    assert REGISTRY.get_sample_value("cdcd_streaming") is not None


def test_table_children_are_cached_and_precreated(metrics: Metrics) -> None:
    tm = metrics.table("public.orders")
    assert metrics.table("public.orders") is tm
    assert set(tm.events) == set(OPS)
    # All op series exist at 0 before the first event, so rate() has a baseline.
    for op in OPS:
        assert (
            metrics.registry.get_sample_value(
                "cdcd_events_total", {"table": "public.orders", "op": op}
            )
            == 0
        )
    tm.events["c"].inc()
    metrics.event("public.orders", "u", 2)
    tm.snapshot_rows.inc(10)
    tm.snapshot_rows_estimated.set(100)
    tm.snapshot_chunks.inc()
    value = metrics.registry.get_sample_value
    assert value("cdcd_events_total", {"table": "public.orders", "op": "c"}) == 1
    assert value("cdcd_events_total", {"table": "public.orders", "op": "u"}) == 2
    assert value("cdcd_snapshot_rows_total", {"table": "public.orders"}) == 10
    assert value("cdcd_snapshot_rows_estimated", {"table": "public.orders"}) == 100
    assert value("cdcd_snapshot_chunks_total", {"table": "public.orders"}) == 1


def test_table_cache_is_thread_safe(metrics: Metrics) -> None:
    seen: list[object] = []
    threads = [
        threading.Thread(target=lambda: seen.append(metrics.table("public.t"))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(tm is seen[0] for tm in seen)


def test_delivery_errors_and_reconnects(metrics: Metrics) -> None:
    child = metrics.delivery_errors_for("pg.public.orders")
    assert (
        metrics.registry.get_sample_value(
            "cdcd_delivery_errors_total", {"topic": "pg.public.orders"}
        )
        == 0
    )
    metrics.delivery_error("pg.public.orders")
    assert metrics.delivery_errors_for("pg.public.orders") is child
    metrics.reconnect("postgres")
    metrics.reconnect("postgres")
    value = metrics.registry.get_sample_value
    assert value("cdcd_delivery_errors_total", {"topic": "pg.public.orders"}) == 1
    assert value("cdcd_reconnects_total", {"reason": "postgres"}) == 2


def test_delivery_latency_histogram(metrics: Metrics) -> None:
    metrics.delivered(commit_time=100.0, now=100.004)
    metrics.delivered(commit_time=100.0, now=99.0)  # clock skew: clamped to 0
    metrics.delivered(commit_time=100.0, now=200.0)  # beyond the last bucket
    value = metrics.registry.get_sample_value
    assert value("cdcd_delivery_latency_seconds_bucket", {"le": "0.001"}) == 1
    assert value("cdcd_delivery_latency_seconds_bucket", {"le": "0.005"}) == 2
    assert value("cdcd_delivery_latency_seconds_bucket", {"le": "60.0"}) == 2
    assert value("cdcd_delivery_latency_seconds_bucket", {"le": "+Inf"}) == 3
    assert value("cdcd_delivery_latency_seconds_count") == 3


def test_positions_and_streaming(metrics: Metrics) -> None:
    metrics.mark_received(0x16_B374D848, nbytes=512)
    metrics.mark_confirmed(0x16_B374D000)
    metrics.slot_lag.set(2048)
    metrics.set_streaming(True)
    value = metrics.registry.get_sample_value
    assert value("cdcd_received_lsn_bytes") == 0x16_B374D848
    assert value("cdcd_received_bytes_total") == 512
    assert value("cdcd_confirmed_lsn_bytes") == 0x16_B374D000
    assert value("cdcd_slot_lag_bytes") == 2048
    assert value("cdcd_streaming") == 1
    metrics.set_streaming(False)
    assert value("cdcd_streaming") == 0


def test_last_confirmed_age_grows_between_scrapes() -> None:
    clock = FakeClock()
    metrics = Metrics(CollectorRegistry(), clock=clock, process_collectors=False)
    value = metrics.registry.get_sample_value
    clock.now += 5
    assert value("cdcd_last_confirmed_age_seconds") == 5  # since start: never confirmed
    metrics.mark_confirmed(42)
    assert value("cdcd_last_confirmed_age_seconds") == 0
    clock.now += 7.5
    assert value("cdcd_last_confirmed_age_seconds") == 7.5
    clock.now += 1
    assert value("cdcd_last_confirmed_age_seconds") == 8.5


def test_build_info(metrics: Metrics) -> None:
    families = {f.name: f for f in metrics.registry.collect()}
    (sample,) = families["cdcd_build_info"].samples
    assert sample.value == 1
    assert sample.labels["version"] == cdcd.__version__
    assert sample.labels["python"].count(".") == 2
    assert sample.labels["librdkafka"]


def test_process_collectors_optional() -> None:
    with_process = exposed_names(Metrics(CollectorRegistry()).registry)
    without = exposed_names(Metrics(CollectorRegistry(), process_collectors=False).registry)
    assert "process_start_time_seconds" in with_process
    assert not any(name.startswith("process_") for name in without)


# -- HTTP ---------------------------------------------------------------------


def test_metrics_endpoint(server: tuple[http.MetricsServer, http.Health], metrics: Metrics) -> None:
    running, _ = server
    assert running.port > 0
    metrics.table("public.orders").events["c"].inc(3)
    status, content_type, body = get(running.url + "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    parsed = samples(body)
    assert parsed[("cdcd_events_total", (("op", "c"), ("table", "public.orders")))] == 3
    assert ("cdcd_streaming", ()) in parsed
    assert "# HELP cdcd_slot_lag_bytes" in body
    assert "_created" not in body


def test_metrics_endpoint_openmetrics(server: tuple[http.MetricsServer, http.Health]) -> None:
    running, _ = server
    status, content_type, body = get(
        running.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert status == 200
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")


def test_healthz_flips_to_503_on_stall(metrics: Metrics) -> None:
    health = http.Health(stall_after_s=0.3)
    running = http.start("127.0.0.1:0", metrics, health)
    try:
        health.beat()
        status, _, body = get(running.url + "/healthz")
        assert status == 200
        assert body.startswith("ok")
        time.sleep(0.5)
        status, _, body = get(running.url + "/healthz")
        assert status == 503
        assert body.startswith("stalled:")
        assert body.count("\n") == 1
        health.beat()
        status, _, _ = get(running.url + "/healthz")
        assert status == 200
    finally:
        running.stop()


def test_health_counts_from_construction() -> None:
    clock = FakeClock()
    health = http.Health(stall_after_s=60, clock=clock)
    assert health.live()[0]
    clock.now += 61
    ok, reason = health.live()
    assert not ok
    assert "61.0 s" in reason and "threshold 60 s" in reason
    with pytest.raises(ValueError):
        http.Health(stall_after_s=0)


def test_readyz_follows_set_ready(server: tuple[http.MetricsServer, http.Health]) -> None:
    running, health = server
    status, _, body = get(running.url + "/readyz")
    assert (status, body) == (503, "not ready: starting\n")
    health.set_ready(True)
    assert get(running.url + "/readyz")[:1] == (200,)
    health.set_ready(False, "snapshot")
    status, _, body = get(running.url + "/readyz")
    assert (status, body) == (503, "not ready: snapshot\n")
    health.set_ready(False)
    assert get(running.url + "/readyz")[2] == "not ready: not streaming\n"


def test_head_and_unknown_paths(server: tuple[http.MetricsServer, http.Health]) -> None:
    running, _ = server
    status, _, body = get(running.url + "/healthz", method="HEAD")
    assert (status, body) == (200, "")
    assert get(running.url + "/nope")[0] == 404
    assert get(running.url + "/metrics?debug=1")[0] == 200


def test_stop_releases_the_port(metrics: Metrics) -> None:
    running = http.start("127.0.0.1:0", metrics, http.Health())
    port = running.port
    running.stop()
    running.stop()  # idempotent
    again = http.start(f"127.0.0.1:{port}", metrics, http.Health())
    again.stop()


def test_port_in_use_is_a_definite_error(
    server: tuple[http.MetricsServer, http.Health], metrics: Metrics
) -> None:
    running, _ = server
    with pytest.raises(DefiniteError, match="cannot listen on 127.0.0.1:"):
        http.start(f"127.0.0.1:{running.port}", metrics, http.Health())


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
@pytest.mark.parametrize("listen", ["[::1]:0", "[::]:0"])
def test_ipv6_listen(listen: str, metrics: Metrics) -> None:
    running = http.start(listen, metrics, http.Health())
    try:
        assert running.address.startswith("[")
        assert get(running.url + "/healthz")[0] == 200
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("0.0.0.0:9187", ("0.0.0.0", 9187)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::]:9187", ("::", 9187)),
        ("[::1]:9187", ("::1", 9187)),
        ("localhost:9187", ("localhost", 9187)),
        (":9187", ("0.0.0.0", 9187)),
        ("*:9187", ("0.0.0.0", 9187)),
    ],
)
def test_parse_listen(listen: str, expected: tuple[str, int]) -> None:
    assert http.parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["9187", "host:", "host:port", "::1:9187", "host:70000"])
def test_parse_listen_rejects(listen: str) -> None:
    with pytest.raises(ConfigError, match="metrics.listen"):
        http.parse_listen(listen)
