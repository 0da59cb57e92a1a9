"""docs/security.md's kafka-acls.sh commands grant exactly what the Strimzi KafkaUsers of helm/README.md
grant (which tests/helm/test_kafka_acls.py checks against the code), principal by principal, so the two
copyable examples cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

Grant = tuple[str, str, str, str, frozenset[str]]  # principal, resource type, name, pattern type, operations


def kafka_user_grants() -> set[Grant]:
    grants: set[Grant] = set()
    text = (ROOT / "helm" / "README.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        for doc in yaml.safe_load_all(block):
            if isinstance(doc, dict) and doc.get("kind") == "KafkaUser":
                for acl in doc["spec"]["authorization"]["acls"]:
                    r = acl["resource"]
                    pattern = "prefixed" if r.get("patternType") == "prefix" else "literal"
                    grants.add((doc["metadata"]["name"], r["type"], r["name"], pattern, frozenset(acl["operations"])))
    return grants


def kafka_acls_grants() -> set[Grant]:
    grants: set[Grant] = set()
    text = (ROOT / "docs" / "security.md").read_text()
    for line in text.splitlines():
        if not line.startswith("$ACL "):
            continue
        principal = re.search(r"--allow-principal User:(\S+)", line).group(1)  # type: ignore[union-attr]
        kind, name = re.search(r"--(topic|group) (\S+)", line).groups()  # type: ignore[union-attr]
        pattern = "prefixed" if "--resource-pattern-type prefixed" in line else "literal"
        grants.add((principal, kind, name, pattern, frozenset(re.findall(r"--operation (\S+)", line))))
    return grants


def test_security_doc_acls_are_the_chart_walkthrough_acls() -> None:
    """Every command of docs/security.md is a KafkaUser ACL of helm/README.md and the other way round."""
    users = kafka_user_grants()
    commands = kafka_acls_grants()
    assert len(users) > 40
    assert commands - users == set(), "in docs/security.md only"
    assert users - commands == set(), "in helm/README.md only"
