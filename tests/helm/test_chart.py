"""The Helm chart renders one workload per Sluice service of the site, each
running the right `sluice` command, with the site file that `sluice config
check` accepts, the Kafka secrets mounted where the site file expects them,
probes, disruption budgets and anti-affinity as the values say."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from helmrender import CHART, EXAMPLES, ROOT, Helm, HelmFailed, Release, load_values, merged, values_of
from sitefiles import as_pod_sees_it, config_check, key_pair
from sluice.core.config import RegionServiceConfig

SITE_MOUNT = "/etc/sluice/site"
SITE_PATH = f"{SITE_MOUNT}/site.yaml"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


# --- what the values say a release should hold ----------------------------------


def settings(values: dict[str, Any], service: str, queue_id: str = "") -> dict[str, Any]:
    """A service's settings as the chart documents them: defaults, service block, byId entry."""
    block = {k: v for k, v in values[service].items() if k != "byId"}
    out = merged(values["serviceDefaults"], block)
    if queue_id:
        out = merged(out, values[service].get("byId", {}).get(queue_id, {}))
    return out


def expected_workloads(name: str, fullname: str = "sluice") -> dict[str, tuple[str, list[str], dict[str, Any]]]:
    """workload name -> (kind, the `sluice` arguments, settings), from the values and the site."""
    values = values_of(name)
    site = values["site"]
    out: dict[str, tuple[str, list[str], dict[str, Any]]] = {}
    region = settings(values, "region")
    port = str(site.get("region_service", {}).get("port", RegionServiceConfig.model_fields["port"].default))
    out[f"{fullname}-region"] = (
        values["region"]["kind"],
        ["region", "-c", SITE_PATH, "--host", "$(POD_IP)", "--port", port, "--log-level", region["logLevel"]]
        + (["--store-dir", values["region"]["store"]["mountPath"]] if values["region"]["store"]["enabled"] else []),
        region,
    )
    for sender in site.get("gateway_senders", []):
        s = settings(values, "senders", sender["id"])
        command = "parallel-sender" if sender.get("parallel") else "serial-sender"
        out[f"{fullname}-sender-{sender['id']}"] = (
            "Deployment", [command, "-c", SITE_PATH, "--sender", sender["id"], "--log-level", s["logLevel"]], s)
    for queue in site.get("async_event_queues", []):
        s = settings(values, "dispatchers", queue["id"])
        out[f"{fullname}-dispatcher-{queue['id']}"] = (
            "Deployment", ["dispatcher", "-c", SITE_PATH, "--queue", queue["id"], "--log-level", s["logLevel"]], s)
    if "receiver" in site:
        s = settings(values, "receiver")
        out[f"{fullname}-receiver"] = ("Deployment", ["receiver", "-c", SITE_PATH, "--log-level", s["logLevel"]], s)
    s = settings(values, "subscriptions")
    out[f"{fullname}-subscriptions"] = ("Deployment", ["subscriptions", "-c", SITE_PATH, "--log-level", s["logLevel"]], s)
    return out


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(workload)["containers"]
    return container


def releases(request: pytest.FixtureRequest, name: str) -> Release:
    return request.getfixturevalue({"default": "default_release", "site-a": "site_a", "site-b": "site_b"}[name])


SITES = ["default", "site-a", "site-b"]


# --- workloads -------------------------------------------------------------------


@pytest.mark.parametrize("name", SITES)
def test_one_workload_per_service_with_its_command_and_replicas(request: pytest.FixtureRequest, name: str) -> None:
    """Every service of the site gets its Deployment (StatefulSet for a region service so
    configured), running `sluice <service>` for its sender or queue id, with the replicas
    the values give it; no workload is rendered that the site does not need."""
    release = releases(request, name)
    expected = expected_workloads(name)
    workloads = release.workloads()
    assert sorted(workloads) == sorted(expected)
    for workload_name, (kind, args, s) in expected.items():
        workload = workloads[workload_name]
        assert workload["kind"] == kind, workload_name
        assert workload["spec"]["replicas"] == s["replicas"], workload_name
        container = main_container(workload)
        assert container["args"] == args, workload_name
        image = values_of(name)["image"]
        assert container["image"] == f"{image['repository']}:{image['tag'] or APP_VERSION}"


@pytest.mark.parametrize("name", SITES)
def test_every_pod_checks_the_site_file_first(request: pytest.FixtureRequest, name: str) -> None:
    """Each pod's init step is `sluice config check` on the mounted site file, which is the
    release's ConfigMap; the pod template carries the file's checksum so a change rolls it."""
    release = releases(request, name)
    site_text = release.site_file("sluice-site")
    for workload_name, workload in release.workloads().items():
        spec = pod_spec(workload)
        (init,) = spec["initContainers"]
        assert init["args"] == ["config", "check", SITE_PATH], workload_name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["site"]["configMap"]["name"] == "sluice-site"
        for container in (init, main_container(workload)):
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["site"]["mountPath"] == SITE_MOUNT and mounts["site"]["readOnly"] is True
        checksum = workload["spec"]["template"]["metadata"]["annotations"]["checksum/site"]
        assert checksum == hashlib.sha256(site_text.rstrip("\n").encode()).hexdigest()


@pytest.mark.parametrize("name", SITES)
def test_sluice_config_check_accepts_the_rendered_site_file(
        request: pytest.FixtureRequest, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConfigMap's site file passes the real `sluice config check` as a pod sees it (TLS
    files and public keys in place as the chart mounts them, the secretEnv variables set), and
    is the site the values describe, with kafka.bootstrapServers and kafka.settings merged into
    its kafka: section."""
    release = releases(request, name)
    values = values_of(name)
    text = release.site_file("sluice-site")
    site = yaml.safe_load(text)
    proc = config_check(as_pod_sees_it(release, text, tmp_path / "pod", monkeypatch), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert site["site"] == values["site"]["site"] and site["dsid"] == values["site"]["dsid"]
    assert site["kafka"]["bootstrap_servers"] == (
        values["kafka"]["bootstrapServers"] or values["site"]["kafka"]["bootstrap_servers"])
    for key, value in values["kafka"]["settings"].items():
        assert site["kafka"][key] == value
    # The topics Job's own copy (a hook, made before the release's objects) is the same file.
    assert release.site_file("sluice-topics-site") == text


def test_a_site_file_given_as_text_is_used_as_is(helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set-file siteFile=deploy/sites/site-a.yaml` (YAML anchors and all) becomes the
    ConfigMap's site file with only the bootstrap and the region's member hosts replaced, and
    drives the workloads; a file whose region service has no tokens is refused, saying so."""
    source = ROOT / "deploy" / "sites" / "site-a.yaml"
    with pytest.raises(HelmFailed, match=r"region_service\.token and region_service\.member_token are not set"):
        helm.template("--set-file", f"siteFile={source}", "--set", "secretEnv=null")
    text = re.sub(r"(?m)^region_service:\n", "region_service:\n  token_env: SLUICE_REGION_TOKEN\n"
                  "  member_token_env: SLUICE_REGION_MEMBER_TOKEN\n", source.read_text())
    given = tmp_path / "site-a.yaml"
    given.write_text(text)
    release = helm.template("--set-file", f"siteFile={given}", "--set", "kafka.bootstrapServers=kafka.example:9092")
    site = yaml.safe_load(release.site_file("sluice-site"))
    original = yaml.safe_load(text)
    original["kafka"]["bootstrap_servers"] = "kafka.example:9092"
    original["region_service"]["member_hosts"] = load_values("default")["region"]["memberHosts"]
    assert site == original
    proc = config_check(as_pod_sees_it(release, release.site_file("sluice-site"), tmp_path / "pod", monkeypatch),
                        tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    senders = {s["id"]: s["parallel"] for s in original["gateway_senders"]}
    for sender_id, parallel in senders.items():
        args = main_container(release.get("Deployment", f"sluice-sender-{sender_id}"))["args"]
        assert args[0] == ("parallel-sender" if parallel else "serial-sender")
    region = main_container(release.get("StatefulSet", "sluice-region"))
    assert {"name": "http", "containerPort": original["region_service"]["port"], "protocol": "TCP"} in region["ports"]


def test_dsid_keys_of_gateway_public_keys_stay_numbers(helm: Helm, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """gateway_public_keys is keyed by dsid; Helm's values make every key a string, and the
    chart writes whole-number keys bare again so the strict site model accepts them.  Public
    keys are not secret: the site file holding them stays a ConfigMap."""
    public_2, public_3 = key_pair()[1], key_pair()[1]
    release = helm.template("--set", "site.receiver.accepted_dsids={2,3}",
                            "--set-string", f"site.gateway_public_keys.2={public_2}",
                            "--set-string", f"site.gateway_public_keys.3={public_3}",
                            "--set", "site.gateway_private_key_env=SLUICE_GATEWAY_PRIVATE_KEY",
                            "--set", "secretEnv[0].name=SLUICE_REGION_TOKEN,secretEnv[0].secret=t,secretEnv[0].key=a",
                            "--set", "secretEnv[1].name=SLUICE_REGION_MEMBER_TOKEN,secretEnv[1].secret=t,secretEnv[1].key=b",
                            "--set", "secretEnv[2].name=SLUICE_GATEWAY_PRIVATE_KEY,secretEnv[2].secret=k,secretEnv[2].key=c")
    text = release.site_file("sluice-site")
    assert yaml.safe_load(text)["gateway_public_keys"] == {2: public_2, 3: public_3}
    assert "sluice-site" in release.of_kind("ConfigMap")
    proc = config_check(as_pod_sees_it(release, text, tmp_path / "pod", monkeypatch), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_site_file_secrets_may_stay_in_the_file_with_secret_storage(helm: Helm, tmp_path: Path) -> None:
    """With siteFileStorage=Secret the site file may hold its secrets itself: it is rendered
    into Secrets only (the release's and the topics Job's), mounted from there, and passes
    `sluice config check`."""
    values = tmp_path / "inline.yaml"
    private, _ = key_pair()
    values.write_text(yaml.safe_dump({
        "siteFileStorage": "Secret",
        "secretEnv": [],
        "site": {"region_service": {"token_env": None, "member_token_env": None,
                                    "token": "a-client-token-0123456789", "member_token": "a-member-token-0123456789"},
                 "gateway_private_key": private},
    }))
    release = helm.template("-f", str(values))
    assert release.of_kind("ConfigMap") == {}
    text = release.site_file("sluice-site")
    assert yaml.safe_load(text)["region_service"]["member_token"] == "a-member-token-0123456789"
    assert release.site_file("sluice-topics-site") == text
    volumes = {v["name"]: v for v in pod_spec(release.get("StatefulSet", "sluice-region"))["volumes"]}
    assert volumes["site"]["secret"]["secretName"] == "sluice-site"
    proc = config_check(text, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert private not in proc.stdout + proc.stderr


def test_region_member_hosts_cover_the_pod_network(helm: Helm, default_release: Release) -> None:
    """The region instances announce http://<pod IP>:<port>, so the chart sets the site file's
    region_service.member_hosts from region.memberHosts: by default every private IPv4 range
    and fd00::/8, or the cluster's pod CIDR given; [] keeps the site file's own."""
    member_hosts = yaml.safe_load(default_release.site_file("sluice-site"))["region_service"]["member_hosts"]
    assert member_hosts == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fd00::/8"]
    narrowed = helm.template("--set", "region.memberHosts={10.244.0.0/16}")
    assert yaml.safe_load(narrowed.site_file("sluice-site"))["region_service"]["member_hosts"] == ["10.244.0.0/16"]
    own = helm.template("--set", "region.memberHosts=null", "--set", "site.region_service.member_hosts={*.pods.example}")
    assert yaml.safe_load(own.site_file("sluice-site"))["region_service"]["member_hosts"] == ["*.pods.example"]


def test_kafka_secrets_are_projected_into_every_pod(site_a: Release) -> None:
    """The Secrets named in kafka.secrets are mounted read-only at kafka.secretMountPath in
    every pod, init step included, and in the topics Job, followed by that service's own
    kafkaSecrets (its Kafka principal), which no other service's pods get."""
    values = values_of("site-a")
    shared = [{"secret": {"name": s["name"], "items": s["items"]}} for s in values["kafka"]["secrets"]]
    own = {"region": "sluice-region", "sender": "sluice-sender", "dispatcher": "sluice-dispatcher",
           "receiver": "sluice-receiver", "subscriptions": "sluice-subscriptions", "topics": "sluice-topics"}
    pods = [(w["metadata"]["labels"]["app.kubernetes.io/component"], pod_spec(w)) for w in site_a.workloads().values()]
    pods.append(("topics", site_a.get("Job", "sluice-topics")["spec"]["template"]["spec"]))
    assert {component for component, _ in pods} == set(own)
    for component, spec in pods:
        volumes = {v["name"]: v for v in spec["volumes"]}
        user = [{"secret": {"name": own[component], "items": [{"key": "user.crt", "path": "user.crt"},
                                                             {"key": "user.key", "path": "user.key"}]}}]
        assert volumes["kafka-secrets"]["projected"]["sources"] == shared + user, component
        for container in spec.get("initContainers", []) + spec["containers"]:
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["kafka-secrets"] == {
                "name": "kafka-secrets", "mountPath": values["kafka"]["secretMountPath"], "readOnly": True}


def test_sasl_settings_pass_through_to_the_site_file(helm: Helm, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """kafka.settings reach the site file's kafka: section unchanged, whatever their keys
    (here SCRAM over TLS with a password file), so the chart follows the site model."""
    values = tmp_path / "scram.yaml"
    values.write_text(yaml.safe_dump({
        "kafka": {
            "bootstrapServers": "kafka-kafka-bootstrap.kafka.svc:9093",
            "settings": {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_username": "sluice",
                "sasl_password_file": "/etc/sluice/kafka/password",
                "ssl_ca_location": "/etc/sluice/kafka/ca.crt",
            },
            "secrets": [
                {"name": "sluice", "items": [{"key": "password", "path": "password"}]},
                {"name": "kafka-cluster-ca-cert", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
            ],
        },
    }))
    release = helm.template("-f", str(values))
    text = release.site_file("sluice-site")
    kafka = yaml.safe_load(text)["kafka"]
    assert kafka == {"bootstrap_servers": "kafka-kafka-bootstrap.kafka.svc:9093",
                     **yaml.safe_load(values.read_text())["kafka"]["settings"]}
    from sluice.core.config import KafkaConnection
    if "sasl_password_file" not in KafkaConnection.model_fields:
        pytest.skip("the site model has no kafka.sasl_password_file yet, so `sluice config check` cannot "
                    "accept this file; the rendering above is checked")
    proc = config_check(as_pod_sees_it(release, text, tmp_path / "pod", monkeypatch), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_secrets_from_the_environment_reach_every_container(helm: Helm, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """secretEnv sets each variable from its Secret in every container, the config-check init step
    and the topics Job included, so a site file naming `*_env` secrets holds none itself, stays a
    ConfigMap, and passes `sluice config check` where those variables are set."""
    values = tmp_path / "env.yaml"
    values.write_text(yaml.safe_dump({
        "kafka": {"settings": {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                               "sasl_username": "sluice", "sasl_password_env": "KAFKA_PASSWORD"}},
        "secretEnv": [{"name": "KAFKA_PASSWORD", "secret": "sluice-kafka-user", "key": "password"},
                      *load_values("default")["secretEnv"]],
    }))
    release = helm.template("-f", str(values))
    expected = {"name": "KAFKA_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": "sluice-kafka-user", "key": "password"}}}
    specs = [pod_spec(w) for w in release.workloads().values()]
    specs.append(release.get("Job", "sluice-topics")["spec"]["template"]["spec"])
    for spec in specs:
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert expected in container.get("env", []), (container["name"], container.get("env"))
    text = release.site_file("sluice-site")
    assert "sluice-site" in release.of_kind("ConfigMap")
    assert yaml.safe_load(text)["kafka"]["sasl_password_env"] == "KAFKA_PASSWORD"

    monkeypatch.setenv("SLUICE_REGION_TOKEN", "the-region-token-0123456789")
    monkeypatch.setenv("SLUICE_REGION_MEMBER_TOKEN", "the-member-token-0123456789")
    monkeypatch.delenv("KAFKA_PASSWORD", raising=False)
    refused = config_check(text, tmp_path)
    assert refused.returncode != 0 and "KAFKA_PASSWORD is not set" in refused.stdout + refused.stderr
    monkeypatch.setenv("KAFKA_PASSWORD", "a-password-never-shown")
    accepted = config_check(text, tmp_path)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "a-password-never-shown" not in accepted.stdout + accepted.stderr


# --- region service ------------------------------------------------------------------


@pytest.mark.parametrize("name", SITES)
def test_region_service_exposes_the_site_files_port(request: pytest.FixtureRequest, name: str) -> None:
    """The region Service's port is region_service.port of the site file (the model's
    default when left out), targets the container port the instance listens on, and
    selects exactly the region pods."""
    release = releases(request, name)
    site = yaml.safe_load(release.site_file("sluice-site"))
    port = site.get("region_service", {}).get("port", RegionServiceConfig.model_fields["port"].default)
    workload = release.workloads()["sluice-region"]
    container = main_container(workload)
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]
    service = release.get("Service", "sluice-region")
    assert service["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    others = [w for n, w in release.workloads().items() if n != "sluice-region"]
    for other in others:
        assert not service["spec"]["selector"].items() <= other["spec"]["template"]["metadata"]["labels"].items()


def test_region_statefulset_has_its_headless_service(site_b: Release) -> None:
    """With region.kind StatefulSet the region service gets the headless Service its
    serviceName names, publishing instances before they are ready."""
    statefulset = site_b.get("StatefulSet", "sluice-region")
    headless = site_b.get("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == site_b.get("Service", "sluice-region")["spec"]["selector"]


@pytest.mark.parametrize("name", SITES)
def test_each_region_instance_keeps_its_store_on_a_volume_of_its_own(request: pytest.FixtureRequest, name: str) -> None:
    """The region StatefulSet mounts a claim per instance (volumeClaimTemplates) where --store-dir points."""
    release = releases(request, name)
    store = values_of(name)["region"]["store"]
    statefulset = release.get("StatefulSet", "sluice-region")
    container = main_container(statefulset)
    assert {"name": "store", "mountPath": store["mountPath"]} in container["volumeMounts"]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "store"
    assert claim["spec"]["resources"]["requests"]["storage"] == store["size"]
    assert "store" not in {v["name"] for v in pod_spec(statefulset)["volumes"]}


def test_the_default_region_port_is_the_models(default_release: Release) -> None:
    """Without region_service.port in the site file the chart uses 7070, the model's default."""
    site = yaml.safe_load(default_release.site_file("sluice-site"))
    assert "port" not in site.get("region_service", {})
    service = default_release.get("Service", "sluice-region")
    assert service["spec"]["ports"][0]["port"] == RegionServiceConfig.model_fields["port"].default


# --- health, disruption budgets, spreading ----------------------------------------------


@pytest.mark.parametrize("name", SITES)
def test_probes_and_scrape_annotations_point_at_the_health_port(request: pytest.FixtureRequest, name: str) -> None:
    """Startup and liveness probe /healthz, readiness /readyz, on the container port named
    `metrics` (health.port); Prometheus is told to scrape /metrics there."""
    release = releases(request, name)
    health = values_of(name)["health"]
    for workload_name, workload in release.workloads().items():
        container = main_container(workload)
        assert {"name": "metrics", "containerPort": health["port"], "protocol": "TCP"} in container["ports"]
        for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, (workload_name, probe)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(health["port"])
        assert annotations["prometheus.io/path"] == "/metrics"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[health["portEnv"]] == str(health["port"])


@pytest.mark.parametrize("name", SITES)
def test_disruption_budget_and_anti_affinity_per_workload(request: pytest.FixtureRequest, name: str) -> None:
    """A workload with two or more replicas has a PodDisruptionBudget selecting exactly its
    pods; its pods repel each other across nodes, preferred or required as the values say."""
    release = releases(request, name)
    budgets = release.of_kind("PodDisruptionBudget")
    expected = expected_workloads(name)
    assert sorted(budgets) == sorted(n for n, (_, _, s) in expected.items() if s["replicas"] >= 2)
    for workload_name, (_, _, s) in expected.items():
        workload = release.workloads()[workload_name]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if workload_name in budgets:
            budget = budgets[workload_name]["spec"]
            assert budget["maxUnavailable"] == s["podDisruptionBudget"]["maxUnavailable"]
            assert budget["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
            assert budget["selector"]["matchLabels"].items() <= labels.items()
        anti = pod_spec(workload)["affinity"]["podAntiAffinity"]
        if s["antiAffinity"] == "hard":
            (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        else:
            (preferred,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
            term = preferred["podAffinityTerm"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]


def test_pods_run_as_non_root_on_a_read_only_root(site_a: Release) -> None:
    """Every container runs as uid 10001 (the image's user), without privilege escalation or
    capabilities, on a read-only root filesystem with writable /tmp and work folder."""
    for spec in [pod_spec(w) for w in site_a.workloads().values()]:
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
        assert spec["automountServiceAccountToken"] is False
        for container in spec["initContainers"] + spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/var/lib/sluice"} <= mounts


# --- by-id settings, names, the topics Job -------------------------------------------------


def test_by_id_settings_apply_to_their_queue_only(helm: Helm) -> None:
    """senders.byId / dispatchers.byId change one sender's or queue's workload (here:
    disabled, and more replicas with its own resources) and leave the others alone."""
    release = helm.template(
        "-f", str(EXAMPLES / "site-a.yaml"),
        "--set", "senders.byId.customers-to-site-b.enabled=false",
        "--set", "dispatchers.byId.orders-jdbc.replicas=4",
        "--set", "dispatchers.byId.orders-jdbc.resources.limits.memory=2Gi",
    )
    workloads = release.workloads()
    assert "sluice-sender-customers-to-site-b" not in workloads
    assert "sluice-sender-customers-to-site-b" not in release.of_kind("PodDisruptionBudget")
    assert workloads["sluice-sender-orders-to-site-b"]["spec"]["replicas"] == 3
    dispatcher = workloads["sluice-dispatcher-orders-jdbc"]
    assert dispatcher["spec"]["replicas"] == 4
    assert main_container(dispatcher)["resources"]["limits"]["memory"] == "2Gi"
    assert main_container(workloads["sluice-receiver"])["resources"]["limits"]["memory"] == "512Mi"
    env = {e["name"]: e for e in main_container(dispatcher)["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "orders-db", "key": "password"}


def test_queue_ids_become_valid_distinct_kubernetes_names(helm: Helm, tmp_path: Path) -> None:
    """Sender and queue ids may hold capitals and '_' and run to 101 characters; their
    workloads still get distinct DNS-1123 names of at most 63 characters."""
    long_id = "q" + "x" * 100
    site = {
        "site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092"},
        "regions": [{"name": "r", "async_event_queues": ["Orders_Q", "orders-q", "q_-", long_id]}],
        "async_event_queues": [{"id": "Orders_Q"}, {"id": "orders-q"}, {"id": "q_-"}, {"id": long_id}],
    }
    values = tmp_path / "ids.yaml"
    values.write_text(yaml.safe_dump({"site": site}))
    release = helm.template("-f", str(values), release="r")
    dispatchers = {w["metadata"]["annotations"]["sluice/queue-id"]: n for n, w in release.workloads().items()
                   if w["metadata"]["labels"]["app.kubernetes.io/component"] == "dispatcher"}
    assert sorted(dispatchers) == sorted(["Orders_Q", "orders-q", "q_-", long_id])
    assert len(set(dispatchers.values())) == 4
    assert dispatchers["orders-q"] == "r-sluice-dispatcher-orders-q"
    for queue_id, name in dispatchers.items():
        assert DNS_LABEL.match(name) and len(name) <= 63, name
        assert main_container(release.get("Deployment", name))["args"][3:5] == ["--queue", queue_id]


def test_topics_job_applies_the_site_files_topics_before_install(site_a: Release) -> None:
    """The optional topics Job runs `sluice topics apply` on its own copy of the site file,
    as pre-install/pre-upgrade hooks with the ConfigMap made first; disabled, neither exists."""
    job = site_a.get("Job", "sluice-topics")
    values = values_of("site-a")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["topics", "apply", "-c", SITE_PATH, "--timeout",
                                 str(values["topicsJob"]["timeoutSeconds"])]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["site"]["configMap"]["name"] == "sluice-topics-site"
    hook_cm = site_a.get("ConfigMap", "sluice-topics-site")["metadata"]["annotations"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == hook_cm["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(hook_cm["helm.sh/hook-weight"]) < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])


def test_topics_job_can_be_left_out(helm: Helm) -> None:
    """topicsJob.enabled=false renders no Job and no hook ConfigMap."""
    release = helm.template("--set", "topicsJob.enabled=false")
    assert release.of_kind("Job") == {}
    assert "sluice-topics-site" not in release.of_kind("ConfigMap")


def test_receiver_only_where_the_site_has_one(default_release: Release, site_a: Release) -> None:
    """The default site has no receiver: section and gets no receiver workload; site A has one."""
    assert "receiver" not in yaml.safe_load(default_release.site_file("sluice-site"))
    assert "sluice-receiver" not in default_release.workloads()
    assert "sluice-receiver" in site_a.workloads()


def test_a_long_release_name_still_gives_valid_names(helm: Helm) -> None:
    """With the longest release name Helm takes (53 characters), every workload, Service,
    budget and Job name is still a distinct DNS-1123 label of at most 63 characters, and
    each workload's label selector picks its pods only."""
    release = helm.template("-f", str(EXAMPLES / "site-b.yaml"), release="site-b-" + "x" * 46)
    for kind in ("Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "Job"):
        for name in release.of_kind(kind):
            assert DNS_LABEL.match(name) and len(name) <= 63, (kind, name)
    workloads = release.workloads()
    assert len(workloads) == len(expected_workloads("site-b"))
    selectors = [tuple(sorted(w["spec"]["selector"]["matchLabels"].items())) for w in workloads.values()]
    assert len(set(selectors)) == len(selectors)


@pytest.mark.parametrize("name,other_dsid", [("site-a", 2), ("site-b", 1)])
def test_examples_take_tokens_and_keys_from_secrets(request: pytest.FixtureRequest, name: str,
                                                     other_dsid: int) -> None:
    """Each example site names its region tokens, subscription token and gateway private key as
    variables that secretEnv sets from the Secrets helm/README.md creates (the keys from `sluice
    keys generate`), holds no secret itself, and verifies the other site with its public key
    from the ConfigMap the README creates."""
    release = releases(request, name)
    site = yaml.safe_load(release.site_file("sluice-site"))
    variables = {
        site["region_service"]["token_env"]: ("sluice-tokens", "region-token"),
        site["region_service"]["member_token_env"]: ("sluice-member-token", "member-token"),
        site["subscriptions"]["token_env"]: ("sluice-tokens", "subscriptions-token"),
        site["gateway_private_key_env"]: ("sluice-gateway-key", "private.key"),
    }
    secret_env = {e["name"]: (e["secret"], e["key"]) for e in values_of(name)["secretEnv"]}
    assert secret_env == variables
    for field in ("token", "member_token"):
        assert field not in site["region_service"]
    assert "gateway_private_key" not in site and "token" not in site["subscriptions"]
    other = {1: "site-a", 2: "site-b"}[other_dsid]
    assert site["gateway_public_keys_file"] == {other_dsid: f"/etc/sluice/gateway-keys/{other}.pub"}
    assert site["receiver"]["accepted_dsids"] == [other_dsid]
    assert {s["remote_dsid"] for s in site["gateway_senders"]} == {other_dsid}
    spec = pod_spec(release.get("Deployment", f"sluice-sender-{site['gateway_senders'][0]['id']}"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in main_container(spec_holder(spec))["volumeMounts"]}
    assert volumes[mounts["/etc/sluice/gateway-keys"]]["configMap"]["name"] == "sluice-gateway-public-keys"

    readme = (ROOT / "helm" / "README.md").read_text()
    for command in ("keys generate --site \"$site\" --out-dir /keys",
                    "create secret generic sluice-tokens",
                    "--from-literal=region-token=", "--from-literal=subscriptions-token=",
                    "create secret generic sluice-member-token", "--from-literal=member-token=",
                    "create secret generic sluice-gateway-key --from-file=private.key=\"keys/$site.key\"",
                    f"-n {name} create configmap sluice-gateway-public-keys --from-file={other}.pub=keys/{other}.pub"):
        assert command in readme, command


def spec_holder(spec: dict[str, Any]) -> dict[str, Any]:
    """A pod spec in the shape main_container reads."""
    return {"spec": {"template": {"spec": spec}}}
