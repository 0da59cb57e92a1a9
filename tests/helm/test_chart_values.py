"""`helm lint` passes the chart with its default values and both example sites, and bad
values are refused before anything is installed: by values.schema.json, or by the
chart's own checks, each with a message naming the value and what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from helmrender import CHART, EXAMPLES, Helm, HelmFailed
from sluice.core.config import NAME_PATTERN, SITE_PATTERN

SITE_VALUES = {"default": [], "site-a": ["-f", str(EXAMPLES / "site-a.yaml")],
               "site-b": ["-f", str(EXAMPLES / "site-b.yaml")]}


@pytest.mark.parametrize("name", sorted(SITE_VALUES))
def test_helm_lint_passes(helm: Helm, name: str) -> None:
    """`helm lint --strict` (warnings count as failures) passes for each set of values."""
    out = helm.run("lint", "--strict", str(CHART), *SITE_VALUES[name])
    assert "1 chart(s) linted, 0 chart(s) failed" in out


def schema_error(path: str, reason: str) -> str:
    """A schema finding about ``path``, as helm words it: `- region.kind: ...` up to helm
    3.17 (gojsonschema), `- at '/region/kind': ...` from 3.18 and in helm 4."""
    return rf"(?:- {re.escape(path)}: |- at '/{re.escape(path.replace('.', '/'))}': )[^\n]*(?:{reason})"


# (what, helm arguments, what the message must say)
REFUSED = [
    ("a region kind Kubernetes has no workload for", ["--set", "region.kind=Pod"],
     schema_error("region.kind", r"""["']Deployment["'], ["']StatefulSet["']""")),
    ("a claim per region instance without a StatefulSet", ["--set", "region.kind=Deployment"],
     r"region\.store\.volume is persistentVolumeClaim, which needs region\.kind StatefulSet"),
    ("a store volume Kubernetes has no kind for", ["--set", "region.store.volume=hostPath"],
     schema_error("region.store.volume", r"""["']persistentVolumeClaim["'], ["']emptyDir["']""")),
    ("replicas that are not a number", ["--set-string", "senders.replicas=two"],
     schema_error("senders.replicas", "Expected: integer, given: string|got string, want integer")),
    ("negative replicas", ["--set", "receiver.replicas=-1"],
     schema_error("receiver.replicas", "greater than or equal to 0|minimum: got -1, want 0")),
    ("a misspelt setting", ["--set", "serviceDefaults.replica=3"],
     schema_error("serviceDefaults", "Additional property replica is not allowed|additional properties 'replica' not allowed")),
    ("an unknown anti-affinity", ["--set", "subscriptions.antiAffinity=sometimes"],
     schema_error("subscriptions.antiAffinity", r"""["']soft["'], ["']hard["'], ["']none["']""")),
    ("a dsid out of Geode's range", ["--set", "site.dsid=300"],
     schema_error("site.dsid", "less than or equal to 255|maximum: got 300, want 255")),
    ("a site name the site file refuses", ["--set", "site.site=Site_A"],
     schema_error("site.site", "[Dd]oes not match pattern")),
    ("a health port out of range", ["--set", "health.port=70000"],
     schema_error("health.port", "less than or equal to 65535|maximum: got 70,000, want 65,535")),
    ("a resource quantity Kubernetes cannot read", ["--set", "region.resources.limits.memory=lots"],
     schema_error("region.resources.limits.memory", "[Dd]oes not match pattern")),
    ("settings for a sender the site file does not have",
     ["-f", str(EXAMPLES / "site-a.yaml"), "--set", "senders.byId.orders-to-site-c.replicas=2"],
     r'senders\.byId\.orders-to-site-c: the site file has no gateway sender "orders-to-site-c" '
     r"\(its senders: orders-to-site-b, customers-to-site-b\)"),
    ("settings for a queue the site file does not have", ["--set", "dispatchers.byId.nope.replicas=2"],
     r'dispatchers\.byId\.nope: the site file has no async event queue "nope" \(its queues: none\)'),
    ("a bootstrap without a port", ["--set", "kafka.bootstrapServers=kafka.example"],
     r'kafka\.bootstrapServers: "kafka\.example" is not host:port\[,host:port\]'),
    ("a region service on any free port", ["--set", "site.region_service.port=0"],
     r"region_service\.port is 0 \(any free port\)"),
    ("one advertised URL for several region instances",
     ["--set", "site.region_service.advertised_url=http://region.example:7070"],
     r"region_service\.advertised_url is http://region\.example:7070, but the region service has 2 replicas"),
    ("a site file that is not a mapping", ["--set", "siteFile=just text"],
     r"siteFile: not a YAML mapping of site settings"),
    ("a region service without its tokens", ["--set", "site.region_service=null"],
     r"site: region_service\.token and region_service\.member_token are not set: the region service listens on "
     r"its pod IP .* region_service\.token_env: SLUICE_REGION_TOKEN and member_token_env: "
     r"SLUICE_REGION_MEMBER_TOKEN, with both in secretEnv .* or set region_service\.allow_unauthenticated: true"),
    ("a region service without its member token", ["--set", "site.region_service.member_token_env=null"],
     r"site: region_service\.member_token is not set"),
    ("a variable of the site file that no secretEnv sets", ["--set", "secretEnv=null"],
     r"secretEnv: the site file's region_service\.token_env names the variable SLUICE_REGION_TOKEN, which no "
     r"secretEnv entry sets: add \{name: SLUICE_REGION_TOKEN, secret: <Secret>, key: <key>\} to secretEnv"),
    ("a secret given both in the file and from a variable",
     ["--set", "siteFileStorage=Secret", "--set", "site.region_service.token=a-client-token-0123456789"],
     r"site: region_service\.token is given 2 ways \(token, token_env\): give one of token, token_file, "
     r"token_env \(the chart's default site gives token_env, .* --set site\.region_service\.token_env=null\)"),
    ("the removed HMAC signing key", ["--set", "site.gateway_signing_key_env=SIGNING_KEY"],
     r"site: gateway_signing_key_env was removed: gateway batches are signed with the site's Ed25519 key now; "
     r"set gateway_private_key_env .* gateway_public_keys"),
    ("the removed receiver sender keys", ["--set", "site.receiver.sender_keys.2=a-key-of-site-two-0123"],
     r"site: receiver\.sender_keys was removed: .* gateway_public_keys"),
    ("a Kafka file the pods do not get",
     ["--set", "kafka.settings.ssl_ca_location=/etc/sluice/kafka/ca.crt",
      "--set", "kafka.secrets[0].name=kafka-cluster-ca-cert,kafka.secrets[0].items[0].key=ca.crt,"
               "kafka.secrets[0].items[0].path=cluster-ca.crt"],
     r"the site file's kafka\.ssl_ca_location is /etc/sluice/kafka/ca\.crt, but no Secret of kafka\.secrets or "
     r"(region|subscriptions|topicsJob)\.kafkaSecrets projects ca\.crt there"),
    ("one Kafka file projected twice into a pod",
     ["-f", str(EXAMPLES / "site-a.yaml"),
      "--set", "receiver.kafkaSecrets[1].name=other,receiver.kafkaSecrets[1].items[0].key=k,"
               "receiver.kafkaSecrets[1].items[0].path=ca.crt"],
     r"sluice-receiver \(the receiver workload\): the Secrets kafka-cluster-ca-cert and other both project ca\.crt "
     r"into /etc/sluice/kafka"),
    ("a database password in a listener's URL",
     ["--set", "site.async_event_queues[0].id=orders-jdbc,site.async_event_queues[0].listener.type=sql,"
               "site.async_event_queues[0].listener.settings.url=postgresql://sluice:secret@db:5432/orders"],
     r"siteFileStorage: async_event_queues\[0\]\.listener\.settings\.url holds a password, which a ConfigMap "
     r"would store in the clear: leave it out of the URL .* dispatchers\.byId\.orders-jdbc\.extraEnv .* or set "
     r"siteFileStorage: Secret"),
    ("NetworkPolicy peers that are not peers", ["--set", "networkPolicy.regionClients[0].pods=x"],
     schema_error("networkPolicy.regionClients.0", "Additional property pods is not allowed|additional properties 'pods' not allowed")),
]


@pytest.mark.parametrize("what,args,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_values_are_refused_with_a_clear_message(helm: Helm, what: str, args: list[str], message: str) -> None:
    """`helm template` fails and says which value is wrong and why."""
    with pytest.raises(HelmFailed) as failed:
        helm.run("template", "sluice", str(CHART), *args)
    assert re.search(message, str(failed.value)), str(failed.value)


def test_helm_lint_refuses_bad_values_too(helm: Helm) -> None:
    """`helm lint` reports a schema violation (as CI would see it) rather than passing."""
    with pytest.raises(HelmFailed) as failed:
        helm.run("lint", str(CHART), "--set", "region.kind=Pod")
    assert re.search(schema_error("region.kind", "must be one of"), str(failed.value)), str(failed.value)
    assert "1 chart(s) failed" in str(failed.value)


def test_schema_patterns_match_the_site_model() -> None:
    """The schema checks site names and queue ids with the site model's own patterns, so
    it never refuses what `sluice config check` accepts, nor the reverse."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    site = schema["properties"]["site"]["properties"]
    assert site["site"]["pattern"] == SITE_PATTERN
    assert site["regions"]["items"]["properties"]["name"]["pattern"] == NAME_PATTERN
    assert site["gateway_senders"]["items"]["properties"]["id"]["pattern"] == NAME_PATTERN
    assert site["async_event_queues"]["items"]["properties"]["id"]["pattern"] == NAME_PATTERN
    for service in ("senders", "dispatchers"):
        assert schema["properties"][service]["properties"]["byId"]["propertyNames"]["pattern"] == NAME_PATTERN


#: Every secret a site file may hold, with a site (over the default one) that holds it inline.
INLINE_SECRETS = {
    "region_service.token": {"region_service": {"token_env": None, "token": "a-client-token-0123456789"}},
    "region_service.member_token": {"region_service": {"member_token_env": None,
                                                       "member_token": "a-member-token-0123456789"}},
    "subscriptions.token": {"subscriptions": {"token": "a-subscriptions-token-0123"}},
    "gateway_private_key": {"gateway_private_key": "MC4CAQAwBQYDK2VwBCIEIA=="},
    "kafka.sasl_password": {"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                                      "sasl_username": "sluice", "sasl_password": "a-kafka-password"}},
    "kafka.ssl_key_password": {"kafka": {"ssl_key_password": "a-key-password"}},
    "gateway_senders[0].remote.sasl_password": {
        "regions": [{"name": "example", "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "remote": {
            "bootstrap_servers": "kafka.site-b:9093", "topic_prefix": "site-b.", "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "site-a-senders", "sasl_password": "a-password"}}]},
    "async_event_queues[0].listener.settings.sasl_password": {
        "async_event_queues": [{"id": "downstream", "listener": {"type": "kafka", "settings": {
            "topic": "downstream", "bootstrap_servers": "other:9093", "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "forwarder", "sasl_password": "a-password"}}}]},
    "gateway_senders[0].remote.ssl_key_password": {
        "regions": [{"name": "example", "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "remote": {
            "bootstrap_servers": "kafka.site-b:9093", "ssl_key_password": "a-password"}}]},
}


@pytest.mark.parametrize("field", sorted(INLINE_SECRETS))
def test_a_secret_in_a_configmap_site_file_is_refused(helm: Helm, tmp_path: Path, field: str) -> None:
    """A site file holding a secret itself does not render into a ConfigMap: the message names
    the field and says to give it from a Secret (its *_env form with secretEnv) or to set
    siteFileStorage: Secret, which renders it."""
    values = tmp_path / "inline.yaml"
    values.write_text(yaml.safe_dump({"site": INLINE_SECRETS[field]}))
    with pytest.raises(HelmFailed) as failed:
        helm.run("template", "sluice", str(CHART), "-f", str(values))
    message = str(failed.value)
    assert re.search(rf"siteFileStorage: the site file holds {re.escape(field)}, which a ConfigMap would store in "
                     rf"the clear: give each from a Secret with its \*_env form and secretEnv "
                     rf"\({re.escape(field)}_env, .*\), or set siteFileStorage: Secret", message), message
    rendered = helm.template("-f", str(values), "--set", "siteFileStorage=Secret")
    assert rendered.of_kind("ConfigMap") == {}


def test_an_open_region_service_is_allowed_only_when_asked_for(helm: Helm) -> None:
    """Without tokens the chart renders only with region_service.allow_unauthenticated: true set
    explicitly (and without a region service there is nothing to protect)."""
    no_tokens = ["--set", "site.region_service.token_env=null,site.region_service.member_token_env=null",
                 "--set", "secretEnv=null"]
    with pytest.raises(HelmFailed, match="region_service.token and region_service.member_token are not set"):
        helm.run("template", "sluice", str(CHART), *no_tokens)
    helm.template(*no_tokens, "--set", "site.region_service.allow_unauthenticated=true")
    helm.template(*no_tokens, "--set", "region.enabled=false")
