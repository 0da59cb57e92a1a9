"""Every component of a release gets its own NetworkPolicy, on by default, selecting exactly
that component's pods and letting in and out only what its service needs: the region
service's HTTP port to the release's region instances and receivers and the configured
clients, the health port to monitoring and the kubelet, and out to Kafka, DNS, the region
service (region instances, receivers) and the remote sites' Kafka (senders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from helmrender import Helm, Release, values_of

#: NetworkPolicy name -> the component label of the pods it selects, per example release.
COMPONENTS = {
    "default": {"region", "subscriptions", "topics"},
    "site-a": {"region", "sender", "dispatcher", "receiver", "subscriptions", "topics"},
    "site-b": {"region", "sender", "receiver", "subscriptions", "topics"},
}
SITES = sorted(COMPONENTS)


def release_of(request: pytest.FixtureRequest, name: str) -> Release:
    return request.getfixturevalue({"default": "default_release", "site-a": "site_a", "site-b": "site_b"}[name])


def pods(release: Release) -> list[tuple[str, dict[str, str]]]:
    """(component, pod labels) of every workload and Job of the release."""
    out = [(w["metadata"]["labels"]["app.kubernetes.io/component"], w["spec"]["template"]["metadata"]["labels"])
           for w in release.workloads().values()]
    out += [(j["metadata"]["labels"]["app.kubernetes.io/component"], j["spec"]["template"]["metadata"]["labels"])
            for j in release.of_kind("Job").values()]
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector["matchLabels"].items() <= labels.items()


def policy_of(release: Release, component: str) -> dict[str, Any]:
    (policy,) = [p for p in release.of_kind("NetworkPolicy").values()
                 if p["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return policy["spec"]


def port(number: int, protocol: str = "TCP") -> dict[str, Any]:
    return {"port": number, "protocol": protocol}


def component_peer(component: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/component": component,
                                            "app.kubernetes.io/instance": "sluice",
                                            "app.kubernetes.io/name": "sluice"}}}


@pytest.mark.parametrize("name", SITES)
def test_one_policy_per_component_selecting_its_pods_only(request: pytest.FixtureRequest, name: str) -> None:
    """Each component the release runs (the topics Job included) has one NetworkPolicy, for
    ingress and egress, whose selector takes every pod of that component and no other."""
    release = release_of(request, name)
    policies = release.of_kind("NetworkPolicy")
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in policies.values()} == COMPONENTS[name]
    assert len(policies) == len(COMPONENTS[name])
    every_pod = pods(release)
    for policy in policies.values():
        component = policy["metadata"]["labels"]["app.kubernetes.io/component"]
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        selected = [c for c, labels in every_pod if selects(policy["spec"]["podSelector"], labels)]
        assert selected and set(selected) == {component}, (component, selected)


@pytest.mark.parametrize("name", SITES)
def test_only_the_release_and_its_clients_reach_the_region_service(request: pytest.FixtureRequest, name: str) -> None:
    """The region service's HTTP port takes the release's region instances (forwarding to a
    bucket's owner), its receivers (apply_remote), its `helm test` pods (/readyz) and
    networkPolicy.regionClients, nobody else; its health port takes monitoring (and kubelet) only."""
    release = release_of(request, name)
    values = values_of(name)
    site = yaml.safe_load(release.site_file("sluice-site"))
    region_port = site.get("region_service", {}).get("port", 7070)
    health = values["health"]["port"]
    ingress = policy_of(release, "region")["ingress"]
    assert ingress == [
        {"from": [component_peer("region"), component_peer("receiver"), component_peer("helm-test"),
                  *values["networkPolicy"]["regionClients"]],
         "ports": [port(region_port)]},
        {"from": values["networkPolicy"]["monitoring"]["peers"], "ports": [port(health)]},
    ]
    # The pods listen where the policy opens: the container ports named http and metrics.
    container = release.workloads()["sluice-region"]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": region_port, "metrics": health}


@pytest.mark.parametrize("name", SITES)
def test_other_components_take_only_health_checks(request: pytest.FixtureRequest, name: str) -> None:
    """Senders, dispatchers, receivers and subscription instances serve nothing but their
    health and metrics port, to monitoring; the topics Job takes nothing at all."""
    release = release_of(request, name)
    values = values_of(name)
    health_rule = {"from": values["networkPolicy"]["monitoring"]["peers"], "ports": [port(values["health"]["port"])]}
    for component in COMPONENTS[name] - {"region", "topics"}:
        assert policy_of(release, component)["ingress"] == [health_rule], component
    assert policy_of(release, "topics")["ingress"] == []


@pytest.mark.parametrize("name", SITES)
def test_egress_is_kafka_dns_and_what_each_component_calls(request: pytest.FixtureRequest, name: str) -> None:
    """Every component reaches its site's Kafka (the bootstrap's port, the configured brokers)
    and DNS; region instances and receivers also the region service's HTTP port; gateway
    senders also the remote site's Kafka; a dispatcher what extraEgress adds for its listener."""
    release = release_of(request, name)
    values = values_of(name)
    network = values["networkPolicy"]
    site = yaml.safe_load(release.site_file("sluice-site"))
    kafka_port = int(site["kafka"]["bootstrap_servers"].rsplit(":", 1)[1])
    kafka = {"ports": [port(kafka_port)], **({"to": network["kafka"]["peers"]} if network["kafka"]["peers"] else {})}
    dns = {"to": network["dns"]["peers"], "ports": network["dns"]["ports"]}
    region_port = site.get("region_service", {}).get("port", 7070)
    to_region = {"to": [component_peer("region")], "ports": [port(region_port)]}
    for component in COMPONENTS[name]:
        expected = [kafka, dns]
        if component in ("region", "receiver"):
            expected.append(to_region)
        if component == "sender":
            remote_ports = sorted({int(s["remote"]["bootstrap_servers"].rsplit(":", 1)[1])
                                   for s in site["gateway_senders"]})
            expected.append({"ports": [port(p) for p in remote_ports], "to": network["remoteKafka"]["peers"]})
        if component == "dispatcher":
            expected += network.get("extraEgress", {}).get("dispatchers", [])
        assert policy_of(release, component)["egress"] == expected, component


def test_site_a_narrows_kafka_to_its_brokers(site_a: Release) -> None:
    """The example narrows Kafka to the Strimzi brokers of its own namespace, the senders'
    remote Kafka to site B's, and lets its SQL listener reach the database port."""
    egress = policy_of(site_a, "sender")["egress"]
    namespaces = [rule["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for rule in egress if rule["ports"] == [port(9093)]]
    assert namespaces == ["site-a", "site-b"]
    assert {"ports": [port(5432)]} in policy_of(site_a, "dispatcher")["egress"]


def test_policies_follow_the_values(helm: Helm, tmp_path: Path) -> None:
    """Kafka ports and peers, the kubelet's addresses, client namespaces and extra rules are
    the values'; with neither monitoring nor kubelet peers the health port takes nobody (an
    empty `from` would mean everybody); networkPolicy.enabled=false renders no policy."""
    values = tmp_path / "np.yaml"
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "orders-app"}}}]
    values.write_text(yaml.safe_dump({"networkPolicy": {
        "kafka": {"peers": [{"ipBlock": {"cidr": "10.20.0.0/24"}}], "ports": [9092, 9094]},
        "kubelet": {"peers": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]},
        "regionClients": clients,
        "extraEgress": {"subscriptions": [{"to": [{"ipBlock": {"cidr": "10.30.0.5/32"}}], "ports": [port(4317)]}]},
    }}))
    release = helm.template("-f", str(values))
    subscriptions = policy_of(release, "subscriptions")
    assert subscriptions["egress"][0] == {"to": [{"ipBlock": {"cidr": "10.20.0.0/24"}}],
                                          "ports": [port(9092), port(9094)]}
    assert subscriptions["egress"][-1]["ports"] == [port(4317)]
    assert subscriptions["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"ipBlock": {"cidr": "10.0.0.0/16"}}]
    assert policy_of(release, "region")["ingress"][0]["from"][3:] == clients
    # Without `helm test` pods, nothing of theirs is let in.
    no_tests = helm.template("--set", "tests.enabled=false")
    assert policy_of(no_tests, "region")["ingress"][0]["from"] == [component_peer("region"), component_peer("receiver")]

    closed = helm.template("--set", "networkPolicy.monitoring.peers=null")
    assert policy_of(closed, "subscriptions")["ingress"] == []
    assert [r["ports"] for r in policy_of(closed, "region")["ingress"]] == [[port(7070)]]

    assert helm.template("--set", "networkPolicy.enabled=false").of_kind("NetworkPolicy") == {}
