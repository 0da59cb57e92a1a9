"""The chart's monitoring: PodMonitor, ServiceMonitor and PrometheusRule valid against the Prometheus Operator's
own CRD schemas (checked in under crds/, strict: a field the CRD does not know fails), the rest of the release
with monitoring on valid Kubernetes, every alert and dashboard query naming metrics the services export, and the
Grafana dashboard's JSON in its ConfigMap."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helmrender import CHART, EXAMPLES, Helm, HelmFailed, Release
from sluice.core import telemetry

HERE = Path(__file__).resolve().parent
CRDS = HERE / "crds"
DASHBOARD = CHART / "dashboards" / "sluice.json"
MONITORING_ON = ("--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true",
                 "--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.dashboard.enabled=true")
#: Every name the services' /metrics may hold (OpenTelemetry's exporter adds target_info).
EXPORTED = {n for name in telemetry.METRICS for n in telemetry.prometheus_names(name)} | {"target_info"}
#: PromQL words that are not metric names: functions, aggregations, keywords.
PROMQL_WORDS = {"sum", "max", "min", "count", "avg", "by", "without", "on", "ignoring", "group_left", "group_right",
                "rate", "increase", "irate", "histogram_quantile", "or", "and", "unless", "le", "label_values",
                "offset", "bool", "absent", "topk", "bottomk", "humanize", "humanizeDuration"}
CUSTOM_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def strict(schema: Any) -> Any:
    """The CRD's schema as the API server applies it with strict field validation: an object
    with declared properties takes no other field (unless it keeps unknown fields)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → the strict openAPIV3Schema of the checked-in CRDs."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = strict(version["schema"]["openAPIV3Schema"])
    return out


def validate(manifest: dict[str, Any], version: str) -> list[str]:
    where = f"{manifest['kind']}/{manifest['metadata']['name']}"
    if manifest["kind"] in CUSTOM_KINDS:
        schema = crd_schemas()[(manifest["apiVersion"], manifest["kind"])]
        validator = jsonschema.Draft7Validator(schema)
        return [f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {exc.message}"]
    return []


@pytest.fixture(scope="module")
def monitored(helm: Helm) -> Release:
    return helm.template(*MONITORING_ON, "-f", str(EXAMPLES / "site-a.yaml"), namespace="site-a")


@pytest.fixture(scope="module")
def monitored_default(helm: Helm) -> Release:
    return helm.template(*MONITORING_ON, "--set", "admin.enabled=true", "--set", "admin.ingress.enabled=true")


def test_the_checked_in_crds_are_the_prometheus_operators() -> None:
    assert set(crd_schemas()) == {("monitoring.coreos.com/v1", k) for k in CUSTOM_KINDS}


@pytest.mark.parametrize("version", sorted({"1.25.0", kubernetes_validate.latest_version()}))
@pytest.mark.parametrize("name", ["monitored", "monitored_default"])
def test_a_release_with_monitoring_on_is_valid(request: pytest.FixtureRequest, name: str, version: str) -> None:
    """Every manifest, the Prometheus Operator's objects included, passes its schema strictly."""
    release: Release = request.getfixturevalue(name)
    assert CUSTOM_KINDS <= {m["kind"] for m in release.manifests}
    errors = [e for m in release.manifests for e in validate(m, version)]
    assert errors == []


def test_the_crd_check_catches_a_field_the_operator_does_not_know(monitored: Release) -> None:
    for kind, path in (("PodMonitor", ("spec", "podMetricsEndpoints", 0)), ("ServiceMonitor", ("spec", "endpoints", 0)),
                       ("PrometheusRule", ("spec", "groups", 0, "rules", 0))):
        broken = copy.deepcopy(monitored.get(kind, "sluice"))
        at: Any = broken
        for step in path:
            at = at[step]
        at["intervall"] = "30s"
        assert any("intervall" in e for e in validate(broken, kubernetes_validate.latest_version())), kind


def test_monitoring_is_off_by_default(default_release: Release) -> None:
    assert not CUSTOM_KINDS & {m["kind"] for m in default_release.manifests}
    assert not any(m["kind"] == "ConfigMap" and "sluice.json" in m.get("data", {}) for m in default_release.manifests)


def test_the_monitors_scrape_every_service_pod_on_its_metrics_port(monitored: Release) -> None:
    """The PodMonitor selects the service pods (not the topics Job) on the `metrics` port; the
    metrics Service behind the ServiceMonitor selects the same pods by their sluice/metrics label."""
    pod_monitor = monitored.get("PodMonitor", "sluice")["spec"]
    (endpoint,) = pod_monitor["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    components = set(pod_monitor["selector"]["matchExpressions"][0]["values"])
    assert pod_monitor["namespaceSelector"] == {"matchNames": ["site-a"]}
    service = monitored.get("Service", "sluice-metrics")["spec"]
    assert service["clusterIP"] == "None" and service["ports"][0]["targetPort"] == "metrics"
    for name, workload in monitored.workloads().items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] in components, name
        assert service["selector"].items() <= labels.items(), name
        ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert "metrics" in ports, name
    job = next(m for m in monitored.manifests if m["kind"] == "Job")
    assert not service["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    monitor = monitored.get("ServiceMonitor", "sluice")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= monitored.get("Service", "sluice-metrics")["metadata"][
        "labels"].items()


# --- alerts ----------------------------------------------------------------------------------

def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (identifiers outside braces, strings and ranges)."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if w not in PROMQL_WORDS and not w.isdigit()}


GEODE_ALERTS = {"SluiceQueueOldestEventOverThreshold", "SluiceQueuePaused", "SluiceQueueStopped",
                "SluicePartitionWithoutPrimary", "SluiceDeadLettersGrowing", "SluiceReceiverRejectingBatches",
                "SluiceDurableClientTimedOut", "SluiceRemoteSenderNotConnected"}


def rules_of(release: Release) -> list[dict[str, Any]]:
    return [r for g in release.get("PrometheusRule", "sluice")["spec"]["groups"] for r in g["rules"]]


def test_every_alert_selects_its_site_and_metrics_that_exist(monitored: Release) -> None:
    rules = rules_of(monitored)
    assert {r["alert"] for r in rules} == GEODE_ALERTS
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names and names <= EXPORTED, (rule["alert"], names - EXPORTED)
        for name in names:  # every selector names the release's site
            assert re.search(rf'{name}\{{sluice_site="site-a"', rule["expr"]), (rule["alert"], name)
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert "{{ $labels." in rule["annotations"]["summary"]


def test_metric_names_sees_every_name() -> None:
    assert metric_names('max by (a, b) (x_total{s="a"}) > on (a) group_left () y_seconds{b="c"} > 0') == \
        {"x_total", "y_seconds"}
    assert metric_names("sum (increase(x_total[10m])) > 0") == {"x_total"}


def test_alerts_can_be_tuned_and_left_out(helm: Helm) -> None:
    release = helm.template("--set", "monitoring.prometheusRule.enabled=true",
                            "--set", "monitoring.prometheusRule.alerts.queuePaused.enabled=false",
                            "--set", "monitoring.prometheusRule.alerts.queueStopped.for=1h",
                            "--set", "monitoring.prometheusRule.alerts.queueStopped.severity=critical",
                            "--set", "monitoring.prometheusRule.additionalLabels.team=payments",
                            "--set", "monitoring.prometheusRule.window=30m")
    rules = {r["alert"]: r for r in rules_of(release)}
    assert "SluiceQueuePaused" not in rules
    stopped = rules["SluiceQueueStopped"]
    assert stopped["for"] == "1h" and stopped["labels"] == {"severity": "critical", "team": "payments"}
    assert "[30m]" in rules["SluiceDeadLettersGrowing"]["expr"]


def test_a_bad_duration_is_refused_by_the_values_schema(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match="monitoring.prometheusRule.alerts.queuePaused.for"):
        helm.template("--set", "monitoring.prometheusRule.enabled=true",
                      "--set", "monitoring.prometheusRule.alerts.queuePaused.for=ten minutes")


# --- the dashboard ------------------------------------------------------------------------------

def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_the_dashboard_configmap_holds_the_checked_in_json(monitored: Release) -> None:
    configmap = next(m for m in monitored.manifests if m["kind"] == "ConfigMap" and "sluice.json" in m.get("data", {}))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["sluice.json"]) == dashboard()


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    """The fields Grafana's dashboard model requires, panels on its 24-column grid without overlap,
    unique ids, and every query against the dashboard's data source variable."""
    board = dashboard()
    assert {"title", "uid", "panels", "schemaVersion", "templating", "time"} <= board.keys()
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "site", "queue"} <= variables
    for panel in panels():
        assert panel["type"] in ("timeseries", "stat", "table"), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert panel.get("description"), panel["title"]


def test_every_dashboard_query_names_exported_metrics_of_the_chosen_site() -> None:
    seen: set[str] = set()
    for panel in panels():
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names and names <= EXPORTED, (panel["title"], names - EXPORTED)
            assert 'sluice_site=~"$site"' in target["expr"], panel["title"]
            seen |= names
    # Queues, senders, receivers and clients: the metrics the issue asked for are on it.
    for name in (telemetry.EVENTS_QUEUED, telemetry.QUEUE_STATE, telemetry.PARTITION_PRIMARY,
                 telemetry.DUPLICATE_BATCHES, telemetry.QUEUE_OLDEST_AGE, telemetry.SENDER_CONNECTED,
                 telemetry.CLIENTS, telemetry.BATCH_DURATION, telemetry.LISTENER_DURATION):
        assert set(telemetry.prometheus_names(name)) & seen, name
