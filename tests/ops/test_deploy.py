"""Deployment artefacts: systemd unit, Kubernetes manifests, Grafana, alert rules, Dockerfile.

External validators are used where they exist on the machine (``systemd-analyze``
from Debian's ``systemd`` package, ``promtool`` from ``prometheus``); the
structural checks below run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from prometheus_client import CollectorRegistry

from cdcd.config.model import expand_env, parse_config
from cdcd.observability.http import Health, parse_listen
from cdcd.observability.http import start as start_http
from cdcd.observability.metrics import Metrics, exposed_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "cdcd.service"
RULES = DEPLOY / "prometheus" / "cdcd-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "cdcd-dashboard.json"

# Series names a PromQL expression may reference: ours, plus the process
# collector's and Prometheus' own `up`.
KNOWN = exposed_names(Metrics(CollectorRegistry()).registry) | {"up"}
METRIC_TOKEN = re.compile(r"\b((?:cdcd|process)_[a-z0-9_]+)\b")


def metric_tokens(expr: str) -> set[str]:
    return set(METRIC_TOKEN.findall(expr))


# -- systemd ------------------------------------------------------------------

#: The documented production install: a virtualenv at /opt/cdcd (README.md,
#: docs/operations.md), its docs copied to share/doc/cdcd inside it.
VENV = "/opt/cdcd"
INSTALLED_CDCD = f"{VENV}/bin/cdcd"
INSTALLED_DOCS = f"{VENV}/share/doc/cdcd"


def _unit_with_existing_binary(tmp_path: Path) -> Path:
    """A copy of the unit whose ExecStart binary exists on this machine.

    ``systemd-analyze verify`` fails when the ExecStart executable is missing,
    and /opt/cdcd/bin/cdcd is only there on a real install; the test swaps in
    this interpreter (the arguments stay as they are).
    """
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_CDCD} run -c /etc/cdcd/cdcd.yaml\n" in text
    copy = tmp_path / "cdcd.service"
    copy.write_text(text.replace(f"ExecStart={INSTALLED_CDCD} ", f"ExecStart={sys.executable} "))
    return copy


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze not found: install Debian's 'systemd' package (.ci/setup)")
    return path


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    unit = _unit_with_existing_binary(tmp_path)
    result = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, timeout=120, check=False
    )
    output = result.stdout + result.stderr
    # verify exits 0 on unknown keys and unparsable values (it only warns), so
    # any message about our unit fails the test too.
    ours = [line for line in output.splitlines() if "cdcd.service" in line]
    assert result.returncode == 0, output
    assert not ours, output


def test_systemd_unit_exposure_is_low(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    unit = _unit_with_existing_binary(tmp_path)
    result = subprocess.run(
        [tool, "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    match = re.search(r"Overall exposure level for cdcd\.service: ([0-9.]+)", result.stdout)
    if match is None:
        pytest.skip(f"systemd-analyze security --offline unsupported here: {result.stderr.strip()}")
    assert float(match.group(1)) <= 2.0, result.stdout


def _unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_systemd_unit_settings() -> None:
    s = _unit_settings()
    expected = {
        "Type": "notify",
        "WatchdogSec": "60",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "User": "cdcd",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "StateDirectory": "cdcd",
        "ProtectKernelTunables": "yes",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
        "CapabilityBoundingSet": "",
        "EnvironmentFile": "-/etc/cdcd/cdcd.env",
        # SPEC section 2: no restart on 2 (configuration) or 3 (definite error).
        "RestartPreventExitStatus": "2 3",
    }
    for key, value in expected.items():
        assert s.get(key, [None])[0] == value, key
    assert "@system-service" in s["SystemCallFilter"]
    assert int(s["TimeoutStopSec"][0]) >= 60
    assert int(s["RestartSec"][0]) > 0
    assert s["ExecStart"] == [f"{INSTALLED_CDCD} run -c /etc/cdcd/cdcd.yaml"]
    assert s["Documentation"] == [f"file://{INSTALLED_DOCS}/operations.md"]


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
def test_install_path_matches_the_unit(doc: str) -> None:
    """The documented install puts cdcd and its docs where the unit looks for them."""
    text = (ROOT / doc).read_text()
    assert f"python3 -m venv {VENV}" in text
    assert f"{VENV}/bin/pip install /path/to/cdcd-checkout" in text  # from a checkout
    assert "pip wheel --no-deps" in text and f"{VENV}/bin/pip install cdcd-" in text  # a wheel
    assert INSTALLED_DOCS in text
    assert (ROOT / "docs" / "operations.md").is_file()
    # cdcd is not published on a package index: never tell anyone to fetch it from one.
    assert not re.search(r"pip install (-\S+ )*cdcd\b(?![-./])", text), doc
    assert "RestartPreventExitStatus=2 3" in (ROOT / "docs" / "operations.md").read_text()


# -- Kubernetes ---------------------------------------------------------------


def load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert len(docs) == 1, name
    doc: dict[str, Any] = docs[0]
    return doc


def container() -> dict[str, Any]:
    (c,) = load("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = c
    return result


def test_deployment_runs_exactly_one_daemon() -> None:
    spec = load("deployment.yaml")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_deployment_probes_and_ports() -> None:
    c = container()
    (port,) = c["ports"]
    assert port["name"] == "metrics" and port["containerPort"] == 9187
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    pod = load("deployment.yaml")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 60
    # The last log line (the one-line error) shows up in the pod's status.
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_startup_probe_is_served_from_the_start_and_generous() -> None:
    """The startupProbe must pass on a daemon that is up but not streaming yet.

    A fresh ``Health`` is what the daemon has while it creates its slot or
    takes the initial snapshot: never ready, alive while it beats. A probe on
    ``/readyz`` would fail through the whole initial snapshot and get the pod
    killed; an unserved path would never pass.
    """
    c = container()
    probe = c["startupProbe"]
    assert probe["httpGet"]["port"] == "metrics"
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300
    assert "initialDelaySeconds" not in c["livenessProbe"]  # the startupProbe gates it
    server = start_http("127.0.0.1:0", CollectorRegistry(), Health())
    try:
        assert _get(server.url + probe["httpGet"]["path"]) == 200
        assert _get(server.url + c["livenessProbe"]["httpGet"]["path"]) == 200
        assert _get(server.url + c["readinessProbe"]["httpGet"]["path"]) == 503  # not streaming
    finally:
        server.stop()


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes memory quantity (``512Mi``, ``1G``, ``1048576``) in bytes."""
    match = _QUANTITY.match(str(text))
    assert match is not None, f"cannot parse quantity {text!r}"
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def test_quantity_bytes() -> None:
    assert quantity_bytes("512Mi") == 512 * 2**20
    assert quantity_bytes("1Gi") == 2**30
    assert quantity_bytes("1G") == 10**9
    assert quantity_bytes("128974848") == 128974848
    assert quantity_bytes("1.5Gi") == 3 * 2**29


#: Measured steady RSS of ``cdcd run`` (docs/performance.md: 62-64 MB).
BASELINE_BYTES = 64 * 2**20
#: librdkafka's memory per queued message besides its payload (measured 483 B).
PER_MESSAGE_BYTES = 500
#: Produce requests in flight per broker connection (idempotence caps it at 5).
IN_FLIGHT_REQUESTS = 5
BROKERS = 3
#: Decoded size of one snapshot row held in memory, for the arithmetic.
SNAPSHOT_ROW_BYTES = 1024


def test_memory_limit_covers_the_producer_queue_and_buffers() -> None:
    """The limit is at least what the ConfigMap's settings let cdcd hold (see deployment.yaml)."""
    configmap = load("configmap.yaml")
    config = parse_config(
        yaml.safe_load(expand_env_with(configmap["data"]["cdcd.yaml"], PGPASSWORD="x"))
    )
    producer = config.kafka.producer
    # Stated explicitly, so the arithmetic does not hang on code defaults.
    for key in ("queue.buffering.max.kbytes", "queue.buffering.max.messages",
                "message.max.bytes", "batch.size"):
        assert key in producer, key
    assert int(producer["batch.size"]) <= int(producer["message.max.bytes"])
    raw = yaml.safe_load(configmap["data"]["cdcd.yaml"])
    assert "stream_spill_bytes" in raw["postgres"]

    queue = int(producer["queue.buffering.max.kbytes"]) * 1024
    messages = int(producer["queue.buffering.max.messages"]) * PER_MESSAGE_BYTES
    requests = IN_FLIGHT_REQUESTS * int(producer["message.max.bytes"]) * BROKERS
    streamed = 2 * config.postgres.stream_spill_bytes  # the buffer and its copy when spilling
    snapshot = (
        (3 * config.snapshot.parallelism + 1) * config.snapshot.chunk_rows * SNAPSHOT_ROW_BYTES
    )
    pod = load("deployment.yaml")["spec"]["template"]["spec"]
    tmpfs = sum(
        quantity_bytes(v["emptyDir"].get("sizeLimit", 0))
        for v in pod["volumes"]
        if v.get("emptyDir", {}).get("medium") == "Memory"  # tmpfs counts against the limit
    )
    bound = BASELINE_BYTES + queue + messages + requests + streamed + snapshot + tmpfs
    resources = container()["resources"]
    limit = quantity_bytes(resources["limits"]["memory"])
    assert limit >= bound, f"memory limit {limit / 2**20:.0f} MiB < bound {bound / 2**20:.0f} MiB"
    assert limit >= 1.25 * (BASELINE_BYTES + queue + messages), "no margin over the queue bound"
    assert quantity_bytes(resources["requests"]["memory"]) <= limit


def test_deployment_resources() -> None:
    resources = container()["resources"]
    assert resources["requests"] == {"cpu": "250m", "memory": "256Mi"}
    assert resources["limits"] == {"cpu": "1", "memory": "512Mi"}


def test_deployment_security_context() -> None:
    pod = load("deployment.yaml")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container()["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]


def test_deployment_volumes_secret_and_config() -> None:
    pod = load("deployment.yaml")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    configmap = load("configmap.yaml")
    secret = load("secret.example.yaml")

    assert volumes[mounts["/etc/cdcd"]]["configMap"]["name"] == configmap["metadata"]["name"]
    assert container()["args"] == ["run", "-c", "/etc/cdcd/cdcd.yaml"]
    assert "cdcd.yaml" in configmap["data"]

    env = {e["name"]: e for e in container()["env"]}
    ref = env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert "value" not in env["PGPASSWORD"]

    # The spill directory of the config is a writable emptyDir.
    config = parse_config(
        yaml.safe_load(expand_env_with(configmap["data"]["cdcd.yaml"], PGPASSWORD="x"))
    )
    assert config.postgres.spill_dir in mounts
    assert "emptyDir" in volumes[mounts[config.postgres.spill_dir]]
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert parse_listen(config.metrics.listen)[1] == 9187


def expand_env_with(text: str, **env: str) -> str:
    with mock.patch.dict(os.environ, env):
        return expand_env(text)


def test_configmap_uses_the_password_variable() -> None:
    text = load("configmap.yaml")["data"]["cdcd.yaml"]
    assert "${PGPASSWORD}" in text


def test_secret_example_is_a_placeholder() -> None:
    secret = load("secret.example.yaml")
    assert secret["kind"] == "Secret"
    assert secret["stringData"]["PGPASSWORD"] == "REPLACE_ME"


def test_service_and_servicemonitor() -> None:
    service = load("service.yaml")
    pod_labels = load("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == "metrics"
    assert service["spec"]["publishNotReadyAddresses"] is True

    monitor = load("servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"


def test_kustomization_lists_the_manifests() -> None:
    kustomization = load("kustomization.yaml")
    resources = kustomization["resources"]
    for name in resources:
        assert (K8S / name).is_file(), name
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # The example Secret is left out on purpose: applying it would overwrite
    # the real password with the placeholder.
    assert set(resources) == on_disk - {"secret.example.yaml"}
    for name in on_disk:
        doc = load(name)
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), name


# -- Grafana ------------------------------------------------------------------


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def test_dashboard_parses_and_references_real_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        used |= metric_tokens(expr)
    assert used - KNOWN == set()
    for needed in (
        "cdcd_events_total",
        "cdcd_slot_lag_bytes",
        "cdcd_last_confirmed_age_seconds",
        "cdcd_delivery_latency_seconds_bucket",
        "cdcd_messages_in_flight",
        "cdcd_delivery_errors_total",
        "cdcd_reconnects_total",
    ):
        assert needed in used, needed
    joined = "\n".join(exprs)
    assert "histogram_quantile(0.5," in joined and "histogram_quantile(0.99," in joined
    assert "sum by (table) (rate(cdcd_events_total" in joined
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))


# -- Prometheus rules ---------------------------------------------------------


def test_rules_schema_and_metric_names() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    alerts: dict[str, dict[str, Any]] = {}
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["for"]
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            tokens = metric_tokens(rule["expr"])
            assert tokens - KNOWN == set(), rule["alert"]
            alerts[rule["alert"]] = rule
    assert {
        "CdcdSlotLagHigh",
        "CdcdConfirmationStalled",
        "CdcdDeliveryErrors",
        "CdcdDown",
        "CdcdNotStreaming",
        "CdcdReconnectStorm",
        "CdcdUnitFailed",
        "CdcdCrashLooping",
        "CdcdSlotAtRisk",
    } <= alerts.keys()
    assert "1073741824" in alerts["CdcdSlotLagHigh"]["expr"]
    assert alerts["CdcdSlotLagHigh"]["for"] == "10m"
    stalled = alerts["CdcdConfirmationStalled"]["expr"]
    assert "cdcd_last_confirmed_age_seconds" in stalled and "> 300" in stalled
    assert "cdcd_streaming" in stalled


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not found (Debian package 'prometheus'); schema check above still ran"
        )
    return path


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


PROMTOOL_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'cdcd_slot_lag_bytes{{job="cdcd", instance="a"}}'
        values: '2147483648x30'
      - series: 'cdcd_streaming{{job="cdcd", instance="a"}}'
        values: '1x30'
      - series: 'cdcd_last_confirmed_age_seconds{{job="cdcd", instance="a"}}'
        values: '0+60x30'
      - series: 'up{{job="cdcd", instance="a"}}'
        values: '1x30'
      - series: 'cdcd_delivery_errors_total{{job="cdcd", instance="a", topic="pg.public.t"}}'
        values: '0 0 0 1 1 1'
      - series: 'cdcd_reconnects_total{{job="cdcd", instance="a", reason="postgres"}}'
        values: '0+1x30'
      - series: 'cdcd_snapshot_failures_total{{job="cdcd", instance="a", table="public.t"}}'
        values: '0 0 0 1 1 1'
    alert_rule_test:
      - eval_time: 2m
        alertname: CdcdSnapshotFailing
        exp_alerts: []
      - eval_time: 10m
        alertname: CdcdSnapshotFailing
        exp_alerts:
          - exp_labels: {{severity: warning, job: cdcd, instance: a, table: public.t}}
            exp_annotations:
              summary: "cdcd snapshot of public.t failed"
              description: "1 snapshot job failures for public.t in the last 15 minutes; the ERROR line of the log names the job and the reason, and `cdcd check` lists a re-snapshot that keeps failing."
      - eval_time: 5m
        alertname: CdcdSlotLagHigh
        exp_alerts: []
      - eval_time: 12m
        alertname: CdcdSlotLagHigh
        exp_alerts:
          - exp_labels: {{severity: warning, job: cdcd, instance: a}}
            exp_annotations:
              summary: "Replication slot retains 2GiB of WAL"
              description: "The slot's confirmed_flush_lsn is more than 1 GiB behind the server's WAL position for 10 minutes on a. The primary's disk fills if this keeps growing."
      - eval_time: 4m
        alertname: CdcdConfirmationStalled
        exp_alerts: []
      - eval_time: 8m
        alertname: CdcdConfirmationStalled
        exp_alerts:
          - exp_labels: {{severity: critical, job: cdcd, instance: a}}
            exp_annotations:
              summary: "cdcd on a has not confirmed for 8m 0s"
              description: "cdcd is streaming but has confirmed no position to the slot for more than 5 minutes; check cdcd_messages_in_flight and the broker."
      - eval_time: 10m
        alertname: CdcdDeliveryErrors
        exp_alerts:
          - exp_labels: {{severity: warning, job: cdcd, instance: a, topic: pg.public.t}}
            exp_annotations:
              summary: "Kafka delivery errors on topic pg.public.t"
              description: "About 1 messages for pg.public.t failed delivery in the last 10 minutes; cdcd reconnected and replays them from the last confirmed LSN (nothing is lost). The log names the error."
      - eval_time: 25m
        alertname: CdcdReconnectStorm
        exp_alerts:
          - exp_labels: {{severity: warning, job: cdcd, instance: a}}
            exp_annotations:
              summary: "cdcd on a reconnects repeatedly"
              description: "About 15 replication session restarts in 15 minutes (by reason: cdcd_reconnects_total). Each restart replays from the last confirmed LSN."
      - eval_time: 10m
        alertname: CdcdDown
        exp_alerts: []
  - interval: 1m
    input_series:
      - series: 'up{{job="cdcd", instance="a"}}'
        values: '0x20'
      - series: 'cdcd_streaming{{job="cdcd", instance="a"}}'
        values: '0x20'
      - series: 'cdcd_snapshot_rows_total{{job="cdcd", instance="a", table="public.t"}}'
        values: '0x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: CdcdDown
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: "cdcd is down or not scraped"
              description: "No cdcd target of job cdcd has been up for 5 minutes. The slot keeps WAL on the primary while nobody consumes it."
      - eval_time: 20m
        alertname: CdcdNotStreaming
        exp_alerts:
          - exp_labels: {{severity: warning, job: cdcd, instance: a}}
            exp_annotations:
              summary: "cdcd on a is not streaming"
              description: "cdcd has not been streaming (/readyz 503) for 15 minutes and no snapshot is progressing; check its log for the reconnect reason."
  - interval: 1m
    input_series:
      - series: 'cdcd_streaming{{job="cdcd", instance="a"}}'
        values: '0x30'
      - series: 'cdcd_snapshot_rows_total{{job="cdcd", instance="a", table="public.t"}}'
        values: '0+1000x30'
    alert_rule_test:
      - eval_time: 25m
        alertname: CdcdNotStreaming
        exp_alerts: []
  # Slot at risk: a retains 90 % of a 1 GiB max_slot_wal_keep_size; b 10 %;
  # c much more but without a limit (-1); d is unreserved (the server's word).
  - interval: 1m
    input_series:
      - series: 'cdcd_slot_retained_wal_bytes{{job="cdcd", instance="a"}}'
        values: '966367641x10'
      - series: 'cdcd_slot_wal_keep_size_bytes{{job="cdcd", instance="a"}}'
        values: '1073741824x10'
      - series: 'cdcd_slot_retained_wal_bytes{{job="cdcd", instance="b"}}'
        values: '107374182x10'
      - series: 'cdcd_slot_wal_keep_size_bytes{{job="cdcd", instance="b"}}'
        values: '1073741824x10'
      - series: 'cdcd_slot_retained_wal_bytes{{job="cdcd", instance="c"}}'
        values: '53687091200x10'
      - series: 'cdcd_slot_wal_keep_size_bytes{{job="cdcd", instance="c"}}'
        values: '-1x10'
      - series: 'cdcd_slot_wal_status{{job="cdcd", instance="d", status="reserved"}}'
        values: '1 1 1 0 0 0 0 0 0 0'
      - series: 'cdcd_slot_wal_status{{job="cdcd", instance="d", status="unreserved"}}'
        values: '0 0 0 1 1 1 1 1 1 1'
    alert_rule_test:
      - eval_time: 1m
        alertname: CdcdSlotAtRisk
        exp_alerts: []
      - eval_time: 3m
        alertname: CdcdSlotAtRisk
        exp_alerts:
          - exp_labels: {{severity: critical, job: cdcd, instance: a}}
            exp_annotations: &at_risk_a
              summary: "cdcd's replication slot on a is about to be invalidated"
              description: "The slot retains more than 80 % of max_slot_wal_keep_size on the primary, or the server already reports it unreserved. Past the limit PostgreSQL invalidates it at the next checkpoint; cdcd then stops (exit 3) and needs `cdcd resync`, a re-snapshot of every table. Find why cdcd lags (slot lag, delivery latency, the broker) or raise max_slot_wal_keep_size now."
      - eval_time: 6m
        alertname: CdcdSlotAtRisk
        exp_alerts:
          - exp_labels: {{severity: critical, job: cdcd, instance: a}}
            exp_annotations: *at_risk_a
          - exp_labels: {{severity: critical, job: cdcd, instance: d}}
            exp_annotations:
              summary: "cdcd's replication slot on d is about to be invalidated"
              description: "The slot retains more than 80 % of max_slot_wal_keep_size on the primary, or the server already reports it unreserved. Past the limit PostgreSQL invalidates it at the next checkpoint; cdcd then stops (exit 3) and needs `cdcd resync`, a re-snapshot of every table. Find why cdcd lags (slot lag, delivery latency, the broker) or raise max_slot_wal_keep_size now."
  # A definite error under systemd: exit 3, RestartPreventExitStatus keeps the
  # unit failed; cdcd itself is no longer there to be scraped.
  - interval: 1m
    input_series:
      - series: 'node_systemd_unit_state{{job="node", instance="host1", name="cdcd.service", state="failed", type="notify"}}'
        values: '0 0 0 1 1 1 1 1'
      - series: 'node_systemd_unit_state{{job="node", instance="host1", name="other.service", state="failed", type="simple"}}'
        values: '1x8'
    alert_rule_test:
      - eval_time: 2m
        alertname: CdcdUnitFailed
        exp_alerts: []
      - eval_time: 4m
        alertname: CdcdUnitFailed
        exp_alerts:
          - exp_labels: {{severity: critical, instance: host1, name: cdcd.service}}
            exp_annotations:
              summary: "cdcd.service on host1 has failed and will not restart"
              description: "systemd stopped restarting cdcd: exit code 2 (configuration) or 3 (definite error: a message Kafka refuses, slot lost, credentials refused), or too many failed starts. `systemctl status cdcd` shows the code, its last journal line the cause and what to change."
  # A definite error under Kubernetes: the container exits 3 at every restart
  # and is waiting in CrashLoopBackOff between them (kube-state-metrics only
  # exports the waiting reason while it is the current one); at 20m the
  # operator fixes the cause and it runs, keeping 3 as its last exit code.
  - interval: 1m
    input_series:
      - series: 'kube_pod_container_status_last_terminated_exitcode{{job="ksm", namespace="cdc", pod="cdcd-1", container="cdcd", uid="u1"}}'
        values: '3x40'
      - series: 'kube_pod_container_status_waiting_reason{{job="ksm", namespace="cdc", pod="cdcd-1", container="cdcd", uid="u1", reason="CrashLoopBackOff"}}'
        values: '_ 1 1 _ 1 1 _ 1 1 1 _ 1 1 1 _ 1 1 1 1 _'
      - series: 'kube_pod_container_status_last_terminated_exitcode{{job="ksm", namespace="cdc", pod="web-1", container="web", uid="u2"}}'
        values: '3x40'
      - series: 'kube_pod_container_status_waiting_reason{{job="ksm", namespace="cdc", pod="web-1", container="web", uid="u2", reason="CrashLoopBackOff"}}'
        values: '1x40'
    alert_rule_test:
      - eval_time: 3m
        alertname: CdcdCrashLooping
        exp_alerts: []
      - eval_time: 12m
        alertname: CdcdCrashLooping
        exp_alerts:
          - exp_labels: {{severity: critical, namespace: cdc, pod: cdcd-1, container: cdcd}}
            exp_annotations:
              summary: "cdcd pod cdc/cdcd-1 keeps exiting with code 3"
              description: "Exit code 3: 3 is a definite error (a message Kafka refuses, slot lost, credentials refused), 2 a configuration error; neither goes away by restarting. 1 is a server unreachable at startup, 137 a kill (out of memory?). `kubectl describe pod` shows the last log line, which names the cause."
      - eval_time: 35m
        alertname: CdcdCrashLooping
        exp_alerts: []
  # Waiting on Kafka: a's producer queue is full 45 s of every minute, b's 15 s.
  - interval: 1m
    input_series:
      - series: 'cdcd_producer_queue_full_seconds_total{{job="cdcd", instance="a"}}'
        values: '0+45x30'
      - series: 'cdcd_producer_queue_full_seconds_total{{job="cdcd", instance="b"}}'
        values: '0+15x30'
    alert_rule_test:
      - eval_time: 10m
        alertname: CdcdWaitingOnKafka
        exp_alerts: []
      - eval_time: 25m
        alertname: CdcdWaitingOnKafka
        exp_alerts:
          - exp_labels: {{severity: warning, job: cdcd, instance: a}}
            exp_annotations:
              summary: "cdcd on a waits on Kafka 75% of the time"
              description: "The Kafka producer's local queue has been full more than half the time for 15 minutes, so cdcd reads from the slot only as fast as Kafka acknowledges and slot lag grows. If Kafka is healthy, raise queue.buffering.max.messages in kafka.producer (at most that many messages are unacknowledged at once)."
"""


def test_promtool_rule_unit_tests(tmp_path: Path) -> None:
    tool = _promtool()
    spec = tmp_path / "cdcd-rules.test.yaml"
    spec.write_text(PROMTOOL_TESTS.format(rules=json.dumps(str(RULES))))
    result = subprocess.run(
        [tool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- container image ----------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    instructions = _dockerfile()
    first = dict(reversed(instructions))  # first occurrence of each instruction
    last = dict(instructions)
    assert first["FROM"] == "python:3.11-slim"
    assert last["USER"].split(":")[0] not in {"root", "0"}
    assert json.loads(last["ENTRYPOINT"]) == ["cdcd"]
    assert json.loads(last["CMD"]) == ["run", "-c", "/etc/cdcd/cdcd.yaml"]
    assert last["EXPOSE"] == "9187"
    assert last["STOPSIGNAL"] == "SIGTERM"
    assert "/healthz" in last["HEALTHCHECK"] and "urllib" in last["HEALTHCHECK"]
    assert "pip install --no-cache-dir ." in last["RUN"]
    copied = [shlex.split(rest)[:-1] for instr, rest in instructions if instr == "COPY"]
    sources = {src for group in copied for src in group}
    for src in sources:
        assert (ROOT / src).exists(), src
    assert "LABEL" in first
    # The image's uid is the one the Kubernetes manifest runs as.
    pod = load("deployment.yaml")["spec"]["template"]["spec"]
    assert last["USER"].split(":")[0] == str(pod["securityContext"]["runAsUser"])


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = (ROOT / ".dockerignore").read_text().split()
    for needed in (".git", ".venv", "**/__pycache__"):
        assert needed in patterns
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    for kept in ("cdcd", "cdcd/", "pyproject.toml", "README.md"):
        assert kept not in lines


# -- docs ---------------------------------------------------------------------

OPERATIONS = ROOT / "docs" / "operations.md"


def test_operations_doc_documents_every_metric() -> None:
    text = OPERATIONS.read_text()
    rows = {
        line.split("|")[1].strip().strip("`"): [cell.strip() for cell in line.split("|")[2:4]]
        for line in text.splitlines()
        if line.startswith("| `cdcd_")
    }
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collectors=False)
    # Create one child of every labelled metric so its labels show in samples.
    metrics.table("public.t")
    metrics.delivery_errors_for("pg.public.t")
    metrics.reconnects.labels("postgres")
    metrics.schema_change("public.t", "recreate")
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name in rows, f"{name} is not in the metrics table of docs/operations.md"
        kind, labels = rows.pop(name)
        assert kind == family.type, name
        declared = {label for sample in family.samples for label in sample.labels} - {"le"}
        documented = {label.strip(" `") for label in labels.split(",") if label.strip()}
        assert declared == documented, name
    assert not rows, f"documented but not defined: {sorted(rows)}"


def test_operations_doc_explains_every_alert() -> None:
    text = OPERATIONS.read_text()
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert f"| `{rule['alert']}` |" in text, rule["alert"]
