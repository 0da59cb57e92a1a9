"""The KafkaUsers of helm/README.md (step 2 of the Strimzi walk-through) give each of site A's
services what its code does on Kafka and nothing more: every topic the example site implies
(services/core/topics.py), every consumer group the services join (the group ids in their
code), exactly the named writers of the topics that steer the site, Delete only on the
clients' queues, and a remote site's senders only the inbound and acks topics."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import yaml

from helmrender import ROOT, Release, values_of
from sitefiles import as_pod_sees_it
from sluice.core.config import SiteConfig, load_config
from sluice.core.topics import plan_topics

README = ROOT / "helm" / "README.md"
SERVICES = ROOT / "services"
#: Kafka's implied operations: Read, Write, Delete and Alter imply Describe, AlterConfigs DescribeConfigs.
IMPLIES = {"Describe": {"Read", "Write", "Delete", "Alter"}, "DescribeConfigs": {"AlterConfigs"}}
CLIENT = "orders-ui"


@dataclass(frozen=True)
class Acl:
    type: str
    name: str
    pattern: str
    operations: frozenset[str]

    def matches(self, type_: str, name: str) -> bool:
        if self.type != type_:
            return False
        return name == self.name if self.pattern == "literal" else name.startswith(self.name)


def kafka_users() -> dict[str, list[Acl]]:
    """Every KafkaUser in the README's YAML blocks: name -> its ACLs."""
    users: dict[str, list[Acl]] = {}
    for block in re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S):
        for doc in yaml.safe_load_all(block):
            if isinstance(doc, dict) and doc.get("kind") == "KafkaUser":
                assert doc["spec"]["authorization"]["type"] == "simple"
                users[doc["metadata"]["name"]] = [
                    Acl(a["resource"]["type"], a["resource"]["name"], a["resource"].get("patternType", "literal"),
                        frozenset(a["operations"]))
                    for a in doc["spec"]["authorization"]["acls"]]
    return users


USERS = kafka_users()


def allowed(user: str, type_: str, name: str, operation: str) -> bool:
    wanted = {operation, "All"} | IMPLIES.get(operation, set())
    return any(acl.matches(type_, name) and acl.operations & wanted for acl in USERS[user])


def group_ids_in_code() -> dict[str, str]:
    """The consumer group each service joins, as its code spells it after the topic prefix."""
    found = {}
    for path in ("region/service.py", "receiver/service.py", "core/queueloop.py", "subscriptions/service.py"):
        (suffix,) = re.findall(r'self\.group_id = f"\{cfg\.kafka\.topic_prefix\}([^"]+)"',
                               (SERVICES / path).read_text())
        found[path.split("/")[0]] = suffix
    (reader,) = re.findall(r'"group\.id": group_id or "([^"]+)"', (SERVICES / "core" / "kafka.py").read_text())
    found["reader"] = reader
    return found


@pytest.fixture(scope="module")
def cfg(site_a: Release, tmp_path_factory: pytest.TempPathFactory) -> SiteConfig:
    """Site A's configuration, loaded from the release's rendered site file."""
    tmp = tmp_path_factory.mktemp("site-a")
    with pytest.MonkeyPatch.context() as monkeypatch:
        path = tmp / "site.yaml"
        path.write_text(as_pod_sees_it(site_a, site_a.site_file("sluice-site"), tmp / "pod", monkeypatch))
        return load_config(path)


def needs(cfg: SiteConfig) -> dict[str, set[tuple[str, str, str]]]:
    """user -> (resource type, name, operation) its service performs, from the site and the code."""
    t, prefix, groups = cfg.topics, cfg.kafka.topic_prefix, group_ids_in_code()
    changelogs = [t.region_changelog(r.name) for r in cfg.regions]
    attached = cfg.all_attached_queues()

    def topic(name: str, *operations: str) -> set[tuple[str, str, str]]:
        return {("topic", name, op) for op in operations}

    def queue_group(queue_id: str) -> tuple[str, str, str]:
        return ("group", prefix + groups["core"].replace("{queue_id}", queue_id), "Read")

    def queue_service(kind: str, removals: tuple[str, ...]) -> set[tuple[str, str, str]]:
        out = topic(t.control(), "Read") | topic(t.status(), "Read", "Write")
        for q in (q for q in attached if q.kind == kind):
            out |= topic(q.topic, "Read") | topic(t.removals(q.id), *removals) | topic(t.dead_letter(q.id), "Write")
            out.add(queue_group(q.id))
        return out

    client_queue = t.client_queue(CLIENT, "1a2b3c4d")
    out = {
        "sluice-region": {x for c in changelogs for x in topic(c, "Read", "Write")}
        | {x for q in attached for x in topic(q.topic, "Write")}
        | topic(t.status(), "Read", "Write") | topic(t.region_dead_letter(), "Read", "Write")
        | {("group", prefix + groups["region"], "Read")},
        "sluice-sender": queue_service("gateway-sender", ("Read", "Write")),
        "sluice-dispatcher": queue_service("async-event-queue", ("Write",)),
        "sluice-receiver": topic(t.gateway_inbound(), "Read") | topic(t.gateway_acks(), "Read", "Write")
        | topic(t.region_dead_letter(), "Write") | topic(t.status(), "Read", "Write")
        | {("group", prefix + groups["receiver"], "Read")},
        "sluice-subscriptions": {x for name in (t.subscription_registry(), t.subscription_acks(), t.subscription_fill())
                                 for x in topic(name, "Read", "Write")}
        | {x for c in changelogs for x in topic(c, "Read")} | topic(t.subscription_dead_letter(), "Write")
        | topic(t.client_queue("any-client", "1a2b3c4d"), "Create", "Write", "Delete")
        | {("group", prefix + groups["subscriptions"], "Read")},
        "sluice-topics": {x for spec in plan_topics(cfg) for x in topic(spec.name, "Create", "DescribeConfigs")},
        "sluice-admin": topic(t.control(), "Write") | topic(t.status(), "Read")
        | {x for q in attached for x in topic(q.topic, "Read") | topic(t.removals(q.id), "Read")}
        | topic(t.subscription_registry(), "Read") | topic(t.subscription_acks(), "Read")
        | topic(client_queue, "Read") | {("group", prefix + groups["subscriptions"], "Describe")},
        CLIENT: topic(t.subscription_registry(), "Read", "Write") | topic(t.subscription_acks(), "Read", "Write")
        | topic(client_queue, "Create", "Read", "Delete"),
        "site-b-senders": topic(t.gateway_inbound(), "Write") | topic(t.gateway_acks(), "Read"),
    }
    for user in out:
        if user != "sluice-topics":
            out[user].add(("group", groups["reader"], "Read"))
    return out


def test_the_readme_has_one_user_per_service(site_a: Release) -> None:
    """Each service, the topics Job, the operators, a client and the remote site's senders have
    a KafkaUser, authenticated by certificate; each service's pods in helm/examples/site-a.yaml
    carry the certificate of its own user."""
    assert set(USERS) == {"sluice-region", "sluice-sender", "sluice-dispatcher", "sluice-receiver",
                          "sluice-subscriptions", "sluice-topics", "sluice-admin", CLIENT, "site-b-senders"}
    values = values_of("site-a")
    for block in ("region", "senders", "dispatchers", "receiver", "subscriptions", "topicsJob"):
        (secret,) = values[block]["kafkaSecrets"]
        assert secret["name"] in USERS, block


def test_every_user_may_do_what_its_service_does(cfg: SiteConfig) -> None:
    """Every read, write, create and delete of a topic and every consumer group the service
    uses is allowed to its user."""
    missing = [(user, need) for user, wanted in needs(cfg).items() for need in sorted(wanted)
               if not allowed(user, *need)]
    assert missing == []


def test_no_user_has_a_grant_its_service_does_not_use(cfg: SiteConfig) -> None:
    """Each ACL line of a user serves something its service does (no All, no spare grants);
    Describe and DescribeConfigs ride along where the service asks for metadata."""
    spare = []
    for user, wanted in needs(cfg).items():
        for acl in USERS[user]:
            assert "All" not in acl.operations and acl.name not in ("*", ""), (user, acl)
            for operation in acl.operations - {"Describe", "DescribeConfigs"}:
                if not any(acl.matches(type_, name) and op == operation for type_, name, op in wanted):
                    spare.append((user, acl.name, operation))
    assert spare == []


def test_topics_that_steer_the_site_have_exactly_their_writers(cfg: SiteConfig) -> None:
    """Status, control, the subscription registry, acks and fill, the gateway acks and each
    queue's removals are written only by the principals named in the README."""
    t = cfg.topics
    queue_writers = {q.id: {"sluice-sender" if q.kind == "gateway-sender" else "sluice-dispatcher"}
                     for q in cfg.all_attached_queues()}
    expected = {
        t.status(): {"sluice-region", "sluice-sender", "sluice-dispatcher", "sluice-receiver"},
        t.control(): {"sluice-admin"},
        t.subscription_registry(): {"sluice-subscriptions", CLIENT},
        t.subscription_acks(): {"sluice-subscriptions", CLIENT},
        t.subscription_fill(): {"sluice-subscriptions"},
        t.gateway_acks(): {"sluice-receiver"},
        **{t.removals(queue_id): writers for queue_id, writers in queue_writers.items()},
    }
    for name, writers in expected.items():
        assert {user for user in USERS if allowed(user, "topic", name, "Write")} == writers, name
    # The changelogs and queues only the region service writes; the inbound topic only the remote senders.
    for name in [t.region_changelog(r.name) for r in cfg.regions] + [q.topic for q in cfg.all_attached_queues()]:
        assert {user for user in USERS if allowed(user, "topic", name, "Write")} == {"sluice-region"}, name
    assert {user for user in USERS if allowed(user, "topic", t.gateway_inbound(), "Write")} == {"site-b-senders"}


def test_deletes_reach_only_the_clients_queues(cfg: SiteConfig) -> None:
    """No user may delete any topic of the site's plan; the subscription service deletes under
    `<prefix>subscription.` only, and a client creates and deletes only its own queues."""
    for spec in plan_topics(cfg):
        assert [u for u in USERS if allowed(u, "topic", spec.name, "Delete")] == [], spec.name
    prefix = cfg.topics.client_queue("", "")[:-1]
    assert prefix == "site-a.subscription."
    assert [(a.name, a.pattern) for a in USERS["sluice-subscriptions"] if "Delete" in a.operations] == [
        (prefix, "prefix")]
    own = cfg.topics.client_queue(CLIENT, "")[:-1] + "."
    assert [(a.name, a.pattern) for a in USERS[CLIENT] if a.operations & {"Create", "Delete"}] == [(own, "prefix")]
    assert not allowed(CLIENT, "topic", cfg.topics.client_queue("another-client", "1a2b3c4d"), "Delete")
    assert not allowed(CLIENT, "topic", cfg.topics.client_queue(CLIENT + "-2", "1a2b3c4d"), "Create")


def test_a_remote_sites_senders_only_write_inbound_and_read_acks(cfg: SiteConfig) -> None:
    """Site B's senders write site A's inbound topic and read its acks, and do nothing else."""
    t = cfg.topics
    grants: dict[tuple[str, str], set[str]] = {}
    for acl in USERS["site-b-senders"]:
        grants.setdefault((acl.type, acl.name), set()).update(acl.operations)
    assert all(acl.pattern == "literal" for acl in USERS["site-b-senders"])
    assert grants == {("topic", t.gateway_inbound()): {"Write", "Describe"},
                      ("topic", t.gateway_acks()): {"Read", "Describe"},
                      ("group", group_ids_in_code()["reader"]): {"Read", "Describe"}}


def test_the_readme_table_lists_the_same_grants() -> None:
    """The README's table of principals names the same users as its KafkaUsers."""
    text = README.read_text()
    table = text[text.index("| principal | topic (literal, or prefix) |"):text.index("Every principal also has")]
    named = set(re.findall(r"^\| `([^`]+)`", table, re.M))
    assert named == set(USERS)
