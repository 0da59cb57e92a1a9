"""`helm template` output for the default values and for the two example sites, their
NetworkPolicies included, is valid Kubernetes: every manifest passes kubernetes-validate in strict mode (no field
Kubernetes does not know), offline, for the oldest Kubernetes the chart supports and
the newest whose schemas kubernetes-validate ships."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from helmrender import CHART, Helm, Release

# Chart.yaml's kubeVersion floor (">=1.25.0-0") and the newest schemas on hand.
OLDEST = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"].split(">=")[1].split("-")[0]
NEWEST = kubernetes_validate.latest_version()
VERSIONS = sorted({OLDEST, NEWEST})


def validate_all(release: Release, version: str) -> list[str]:
    """Every manifest's strict validation error, as '<kind>/<name>: <message>'."""
    errors = []
    for manifest in release.manifests:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message}")
    return errors


def kinds(release: Release) -> set[str]:
    return {m["kind"] for m in release.manifests}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["default_release", "site_a", "site_b"])
def test_rendered_manifests_pass_strict_kubernetes_schemas(
        request: pytest.FixtureRequest, name: str, version: str) -> None:
    """No manifest of the release breaks Kubernetes' schema for that version."""
    release: Release = request.getfixturevalue(name)
    assert {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "Job", "ServiceAccount",
            "NetworkPolicy"} <= kinds(release)
    assert validate_all(release, version) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_variants_pass_strict_kubernetes_schemas(helm: Helm, version: str) -> None:
    """The chart's other shapes (site file in a Secret, hard anti-affinity, a
    LoadBalancer Service, probes off, minAvailable budgets, a service's own Kafka
    Secret, NetworkPolicies with address blocks, namespaces and extra rules, a
    region Deployment with its store on an emptyDir) are
    valid Kubernetes too."""
    release = helm.template(
        "--set", "siteFileStorage=Secret",
        "--set", "region.kafkaSecrets[0].name=sluice-region",
        "--set", "networkPolicy.kafka.peers[0].ipBlock.cidr=10.20.0.0/24",
        "--set", "networkPolicy.kafka.ports={9092,9093}",
        "--set", "networkPolicy.kubelet.peers[0].ipBlock.cidr=10.0.0.0/16",
        "--set", "networkPolicy.regionClients[0].namespaceSelector.matchLabels.team=orders",
        "--set", "networkPolicy.extraEgress.region[0].ports[0].port=4317",
        "--set", "networkPolicy.extraIngress.subscriptions[0].ports[0].port=9999",
        "--set", "serviceDefaults.antiAffinity=hard",
        "--set", "region.kind=Deployment",
        "--set", "region.store.volume=emptyDir",
        "--set", "region.service.type=LoadBalancer",
        "--set", "subscriptions.probes.startup.enabled=false",
        "--set", "serviceDefaults.podDisruptionBudget.minAvailable=1",
        "--set", "kafka.secrets[0].name=kafka-cluster-ca-cert",
    )
    assert {"Secret", "NetworkPolicy"} <= kinds(release) and "StatefulSet" not in kinds(release)
    assert validate_all(release, version) == []


def test_strict_validation_does_catch_a_bad_manifest(site_a: Release) -> None:
    """The check above is not vacuous: a field Kubernetes does not know fails it."""
    broken: dict[str, Any] = yaml.safe_load(yaml.safe_dump(site_a.get("StatefulSet", "sluice-region")))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    errors = validate_all(Release([broken]), NEWEST)
    assert len(errors) == 1 and "livenesProbe" in errors[0]
