"""The topics a site file implies: names, partition counts and cleanup policies, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.config import SiteConfig, load_config, parse_config
from sluice.core.topics import TopicNames, TopicSpec, plan_topics

SITES = Path(__file__).resolve().parents[2] / "deploy" / "sites"
WEEK_MS = str(7 * 24 * 60 * 60 * 1000)


def by_name(specs: list[TopicSpec]) -> dict[str, TopicSpec]:
    return {s.name: s for s in specs}


def test_topic_names() -> None:
    """Every topic name is the prefix plus a fixed pattern."""
    names = TopicNames("p.")
    assert names.region_changelog("orders") == "p.region.orders.changelog"
    assert names.queue("q1") == "p.queue.q1"
    assert names.removals("q1") == "p.queue.q1.removals"
    assert names.dead_letter("q1") == "p.queue.q1.dlq"
    assert names.gateway_inbound() == "p.gateway.inbound"
    assert names.gateway_acks() == "p.gateway.acks"
    assert names.region_dead_letter() == "p.region.dlq"
    assert names.subscription_registry() == "p.subscriptions.registry"
    assert names.subscription_acks() == "p.subscriptions.acks"
    assert names.subscription_fill() == "p.subscriptions.fill"
    assert names.subscription_dead_letter() == "p.subscriptions.dlq"
    assert names.client_queue("c-1", "ab12") == "p.subscription.c-1.ab12"
    assert TopicNames("p.") == TopicNames("p.") != TopicNames("q.")


# (name, partitions, compacted) for site-a.yaml, in plan order.
SITE_A = [
    ("site-a.region.orders.changelog", 8, True),
    ("site-a.region.customers.changelog", 8, True),
    ("site-a.queue.orders-to-site-b", 8, False),
    ("site-a.queue.orders-to-site-b.removals", 1, True),
    ("site-a.queue.orders-to-site-b.dlq", 1, False),
    ("site-a.queue.customers-to-site-b", 5, False),
    ("site-a.queue.customers-to-site-b.removals", 1, True),
    ("site-a.queue.customers-to-site-b.dlq", 1, False),
    ("site-a.queue.orders-jdbc", 8, False),
    ("site-a.queue.orders-jdbc.removals", 1, True),
    ("site-a.queue.orders-jdbc.dlq", 1, False),
    ("site-a.gateway.inbound", 8, False),
    ("site-a.gateway.acks", 8, False),
    ("site-a.region.dlq", 1, False),
    ("site-a.subscriptions.registry", 8, True),
    ("site-a.subscriptions.acks", 8, True),
    ("site-a.subscriptions.fill", 8, True),
    ("site-a.subscriptions.dlq", 1, False),
    ("site-a.control", 1, True),
    ("site-a.status", 1, True),
]

SITE_B = [
    ("site-b.region.orders.changelog", 8, True),
    ("site-b.region.customers.changelog", 8, True),
    ("site-b.queue.orders-to-site-a", 8, False),
    ("site-b.queue.orders-to-site-a.removals", 1, True),
    ("site-b.queue.orders-to-site-a.dlq", 1, False),
    ("site-b.queue.customers-to-site-a", 5, False),
    ("site-b.queue.customers-to-site-a.removals", 1, True),
    ("site-b.queue.customers-to-site-a.dlq", 1, False),
    ("site-b.gateway.inbound", 8, False),
    ("site-b.gateway.acks", 8, False),
    ("site-b.region.dlq", 1, False),
    ("site-b.subscriptions.registry", 8, True),
    ("site-b.subscriptions.acks", 8, True),
    ("site-b.subscriptions.fill", 8, True),
    ("site-b.subscriptions.dlq", 1, False),
    ("site-b.control", 1, True),
    ("site-b.status", 1, True),
]


@pytest.mark.parametrize(("file", "expected"), [("site-a.yaml", SITE_A), ("site-b.yaml", SITE_B)])
def test_plan_of_example_sites(file: str, expected: list[tuple[str, int, bool]]) -> None:
    """The example sites plan exactly the expected topics, partition counts and compaction."""
    specs = plan_topics(load_config(SITES / file))
    assert [(s.name, s.partitions, s.compacted) for s in specs] == expected


def test_cleanup_policies_follow_each_topics_role() -> None:
    """Changelogs and removals are compacted; queues keep everything until removed; dead letters keep a week."""
    specs = by_name(plan_topics(load_config(SITES / "site-a.yaml")))
    for spec in specs.values():
        assert spec.config["cleanup.policy"] == ("compact" if spec.compacted else "delete")
        assert spec.cleanup_policy == spec.config["cleanup.policy"]
        assert spec.purpose
    queue = specs["site-a.queue.orders-to-site-b"]
    assert queue.config["retention.ms"] == "-1" and queue.config["retention.bytes"] == "-1"
    assert specs["site-a.queue.orders-to-site-b.dlq"].config["retention.ms"] == WEEK_MS
    assert specs["site-a.region.dlq"].config["retention.ms"] == WEEK_MS
    assert specs["site-a.subscriptions.dlq"].config["retention.ms"] == WEEK_MS
    assert specs["site-a.gateway.inbound"].config["retention.ms"] == WEEK_MS
    assert specs["site-a.region.orders.changelog"].config["min.compaction.lag.ms"] == "0"
    assert specs["site-a.region.orders.changelog"].purpose == "region changelog of orders"


def small_site(**changes: object) -> SiteConfig:
    data: dict[str, object] = {
        "site": "s",
        "dsid": 1,
        "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
        "regions": [{"name": "r", "buckets": 3, "async_event_queues": ["serial1"]}],
        "async_event_queues": [
            {"id": "serial1", "dispatcher_threads": 2},
            {"id": "unused", "parallel": True},
        ],
    }
    data.update(changes)
    return parse_config(data)


def test_unattached_queue_and_no_receiver_plan_no_topics() -> None:
    """A queue attached to no region gets no topics, and a site without a receiver gets no gateway topics."""
    names = [s.name for s in plan_topics(small_site())]
    assert names == [
        "x.region.r.changelog",
        "x.queue.serial1",
        "x.queue.serial1.removals",
        "x.queue.serial1.dlq",
        "x.region.dlq",
        "x.subscriptions.registry",
        "x.subscriptions.acks",
        "x.subscriptions.fill",
        "x.subscriptions.dlq",
        "x.control",
        "x.status",
    ]


def test_serial_queue_partitions_are_dispatcher_threads() -> None:
    """A serial queue has dispatcher_threads partitions; a receiver's topics have inbound_partitions."""
    specs = by_name(plan_topics(small_site(receiver={"inbound_partitions": 4})))
    assert specs["x.queue.serial1"].partitions == 2
    assert specs["x.gateway.inbound"].partitions == 4
    assert specs["x.gateway.acks"].partitions == 4


def test_specs_are_immutable() -> None:
    """A planned topic cannot be edited in place."""
    spec = plan_topics(small_site())[0]
    with pytest.raises(AttributeError):
        spec.partitions = 9  # type: ignore[misc]
