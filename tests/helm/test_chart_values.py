"""`helm lint` passes the chart with its default values and both example sites, and bad
values are refused before anything is installed: by values.schema.json, or by the
chart's own checks, each with a message naming the value and what is wrong."""

from __future__ import annotations

import json
import re

import pytest

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
