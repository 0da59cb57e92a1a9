"""The status page in the chart (admin.*), the `helm test` pods and their check script
(helm/sluice/files/release_check.py), and `helm package`."""

from __future__ import annotations

import http.server
import importlib.util
import json
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from helmrender import CHART, EXAMPLES, Helm, HelmFailed, Release

ROOT = CHART.parents[1]
CHECK_SCRIPT = CHART / "files" / "release_check.py"


def load_check() -> Any:
    spec = importlib.util.spec_from_file_location("release_check", CHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def with_admin(helm: Helm) -> Release:
    return helm.template("-f", str(EXAMPLES / "site-a.yaml"), "--set", "admin.enabled=true",
                         "--set", "admin.ingress.enabled=true", "--set", "admin.ingress.className=nginx",
                         "--set", "admin.networkPolicyFrom[0].namespaceSelector.matchLabels.team=ops",
                         namespace="site-a")


# --- the status page --------------------------------------------------------------------------

def test_the_status_page_is_off_by_default(default_release: Release) -> None:
    assert "sluice-admin" not in default_release.of_kind("Deployment")
    assert not default_release.of_kind("Ingress")


def test_the_status_page_serves_sluice_admin_with_its_token_from_a_secret(with_admin: Release) -> None:
    spec = with_admin.get("Deployment", "sluice-admin")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"][:7] == ["admin", "-c", "/etc/sluice/site/site.yaml", "serve", "--host", "0.0.0.0",
                                     "--port"]
    assert "--allow-unauthenticated" not in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SLUICE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "sluice-admin-token", "key": "token"}
    assert "SLUICE_GATEWAY_PRIVATE_KEY" in env  # the site file's *_env secrets: loading it reads them
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # Its own Kafka principal, beside the cluster's CA, where the site file looks for them.
    sources = {s["secret"]["name"] for v in spec["volumes"] if v["name"] == "kafka-secrets"
               for s in v["projected"]["sources"]}
    assert {"sluice-admin", "kafka-cluster-ca-cert"} <= sources
    service = with_admin.get("Service", "sluice-admin")["spec"]
    assert service["ports"] == [{"name": "http", "port": 7090, "targetPort": "http", "protocol": "TCP"}]
    ingress = with_admin.get("Ingress", "sluice-admin")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    backend = ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "sluice-admin", "port": {"name": "http"}}
    policy = with_admin.get("NetworkPolicy", "sluice-admin")["spec"]
    (ingress_rule,) = policy["ingress"]
    assert ingress_rule["ports"] == [{"port": 7090, "protocol": "TCP"}]
    peers = ingress_rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"team": "ops"}}} in peers
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "helm-test"
               for p in peers)


def test_the_status_page_without_a_token_is_refused_unless_asked_for(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match="admin.token: the status page .* needs a bearer token"):
        helm.template("--set", "admin.enabled=true", "--set", "admin.token.secret=")
    release = helm.template("--set", "admin.enabled=true", "--set", "admin.allowUnauthenticated=true")
    (container,) = release.get("Deployment", "sluice-admin")["spec"]["template"]["spec"]["containers"]
    assert "--allow-unauthenticated" in container["args"]
    assert "SLUICE_ADMIN_TOKEN" not in {e["name"] for e in container["env"]}


# --- helm test ---------------------------------------------------------------------------------

def test_helm_test_pods_check_readiness_and_queues(site_a: Release, with_admin: Release) -> None:
    pods = site_a.of_kind("Pod")
    assert set(pods) == {"sluice-test-ready", "sluice-test-queues"}
    for pod in pods.values():
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["python", "-c", CHECK_SCRIPT.read_text()]
    (ready,) = pods["sluice-test-ready"]["spec"]["containers"]
    assert ready["args"] == ["--ready", "http://sluice-region.site-a:7071/readyz"]
    (queues,) = pods["sluice-test-queues"]["spec"]["containers"]
    assert queues["args"] == ["--status-site", "/etc/sluice/site/site.yaml", "--expect-receiver"]
    (with_page,) = with_admin.get("Pod", "sluice-test-ready")["spec"]["containers"]
    assert with_page["args"][-1] == "http://sluice-admin.site-a:7090/readyz"
    # The region's NetworkPolicy lets the test pods reach its HTTP port.
    region_policy = site_a.get("NetworkPolicy", "sluice-region")["spec"]
    peers = [p for rule in region_policy["ingress"] for p in rule.get("from", [])]
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "helm-test"
               for p in peers)


def test_helm_test_pods_can_be_left_out(helm: Helm) -> None:
    assert not helm.template("--set", "tests.enabled=false").of_kind("Pod")


def test_the_queues_check_needs_a_kafka_principal(helm: Helm) -> None:
    """Where every service logs in with its own certificate (site-a) and neither tests.kafkaSecrets nor
    admin.kafkaSecrets gives one, the queues check could not log in: it is left out, and the release
    still renders; tests.kafkaSecrets brings it back."""
    alone = helm.template("-f", str(EXAMPLES / "site-a.yaml"), "--set", "admin.kafkaSecrets=null")
    assert set(alone.of_kind("Pod")) == {"sluice-test-ready"}
    own = helm.template("-f", str(EXAMPLES / "site-a.yaml"), "--set", "admin.kafkaSecrets=null",
                        "--set", "tests.kafkaSecrets[0].name=sluice-check",
                        "--set", "tests.kafkaSecrets[0].items[0].key=user.crt",
                        "--set", "tests.kafkaSecrets[0].items[0].path=user.crt",
                        "--set", "tests.kafkaSecrets[0].items[1].key=user.key",
                        "--set", "tests.kafkaSecrets[0].items[1].path=user.key")
    spec = own.get("Pod", "sluice-test-queues")["spec"]
    sources = {s["secret"]["name"] for v in spec["volumes"] if v["name"] == "kafka-secrets"
               for s in v["projected"]["sources"]}
    assert "sluice-check" in sources


def status(queues: list[dict[str, Any]], receivers: list[dict[str, Any]] | None = None,
           errors: dict[str, str] | None = None) -> dict[str, Any]:
    return {"queues": queues, "receivers": receivers or [], "section_errors": errors or {}}


def queue(queue_id: str, *states: str) -> dict[str, Any]:
    return {"id": queue_id, "kind": "gateway-sender",
            "partitions": [{"partition": i, "state": s} for i, s in enumerate(states)]}


def test_the_status_check_names_partitions_without_a_reporting_primary() -> None:
    check = load_check()
    healthy = status([queue("to-b", "running", "paused", "stopped")], [{"running": True, "state": "running"}])
    assert check.status_problems(healthy, expect_receiver=True) == []
    sick = status([queue("to-b", "running", "no primary", "stale report")], [{"running": False, "state": "running"}],
                  {"clients": "timed out"})
    assert check.status_problems(sick, expect_receiver=True) == [
        "section clients unreadable: timed out", "gateway-sender to-b partition 1: no primary",
        "gateway-sender to-b partition 2: stale report", "no gateway receiver process reports itself running"]
    assert check.status_problems(status([]), expect_receiver=False) == []


@pytest.fixture
def readyz() -> Iterator[str]:
    """A local server whose /ok answers ready, /not 503, /half 200 without ready."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, body = {"/ok": (200, {"ready": True}), "/half": (200, {"ready": False})}.get(
                self.path, (503, {"ready": False, "not_ready": {"kafka": "no assignment"}}))
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_ready_check_passes_only_a_ready_service(readyz: str) -> None:
    run = [sys.executable, str(CHECK_SCRIPT)]
    ok = subprocess.run([*run, "--ready", f"{readyz}/ok"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    for path, said in (("/not", "answered 503"), ("/half", "not ready")):
        bad = subprocess.run([*run, "--ready", f"{readyz}/ok", "--ready", f"{readyz}{path}"], capture_output=True,
                             text=True, timeout=30)
        assert bad.returncode == 1 and said in bad.stdout, bad.stdout
    nothing = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert nothing.returncode == 2 and "nothing to check" in nothing.stderr


# --- helm package ------------------------------------------------------------------------------

def test_helm_package_makes_a_chart_archive_with_everything_the_templates_read(helm: Helm, tmp_path: Path) -> None:
    out = helm.run("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("sluice-*.tgz")
    assert str(archive) in out
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"sluice/Chart.yaml", "sluice/values.yaml", "sluice/values.schema.json", "sluice/dashboards/sluice.json",
            "sluice/files/release_check.py", "sluice/templates/tests/release-check.yaml",
            "sluice/templates/prometheusrule.yaml"} <= names
    # The archive renders as the folder does, monitoring and all.
    from_archive = helm.run("template", "sluice", str(archive), "--set", "monitoring.dashboard.enabled=true",
                            "--set", "monitoring.prometheusRule.enabled=true")
    from_folder = helm.run("template", "sluice", str(CHART), "--set", "monitoring.dashboard.enabled=true",
                           "--set", "monitoring.prometheusRule.enabled=true")
    assert from_archive == from_folder


def test_make_helm_package_puts_the_archive_in_dist(helm: Helm, tmp_path: Path) -> None:
    done = subprocess.run(["make", "-s", "helm-package", f"CHART_DIST={tmp_path}", f"HELM={helm.path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(tmp_path.glob("sluice-*.tgz"))
