"""``subscriptions.maximum_message_count`` without a broker: a primary writes at most that many messages
past its client's acknowledged position, counts every event it could not queue, and then drops the client
with an alert and a registry tombstone that says why (a fake producer and admin stand in for Kafka)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, parse_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.clientregistry import (
    AUTHORIZATION,
    MAXIMUM_MESSAGE_COUNT,
    QUEUE_DROPPED,
    UNREGISTERED,
    bearer,
    registry_partition,
    unregistered_reason,
)
from sluice.subscriptions.service import SubscriptionService, _Client

BOUND = 5
TOKEN = "unit-token"


@pytest.fixture(scope="module")
def cfg() -> SiteConfig:
    return parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                         "regions": [{"name": "orders", "buckets": 1}],
                         "subscriptions": {"registry_partitions": 1, "maximum_message_count": BOUND}})


class Message:
    def __init__(self, topic: str, offset: int, value: bytes) -> None:
        self._topic, self._offset, self._value = topic, offset, value

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return None

    def value(self) -> bytes:
        return self._value


class Producer:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None, list[tuple[str, bytes]] | None]] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                headers: list[tuple[str, bytes]] | None = None, on_delivery: Any = None) -> None:
        self.records.append((topic, value, headers))

    def to(self, topic: str) -> list[tuple[bytes | None, list[tuple[str, bytes]] | None]]:
        return [(value, headers) for t, value, headers in self.records if t == topic]

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0


class Admin:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete_topics(self, topics: list[str], operation_timeout: float = 0) -> dict[str, Any]:
        self.deleted.extend(topics)
        return {}


def _primary(cfg: SiteConfig, queue_end: int, acked: int) -> tuple[SubscriptionService, _Client, Producer, Admin]:
    """A primary with one connected client of ALL_KEYS in orders, whose queue ends at ``queue_end`` and
    is acknowledged up to ``acked``."""
    service = SubscriptionService(cfg, member_id="unit", token=TOKEN)
    producer, admin = Producer(), Admin()
    service._producer, service._admin = producer, admin
    queue = cfg.topics.client_queue("c-1", "0123abcd")
    record = {"client_id": "c-1", "member_id": "c-1-m", "durable": True, "durable_timeout_s": 60, "redundancy": 0,
              "queue_topic": queue, "session": "s1", "version": 1, "connected": True, "keep_alive": False,
              "ready": True, "changed_at": int(time.time() * 1000),
              "interest": [{"region": "orders", "keys": [], "all_keys": True, "regex": None, "durable": True,
                            "receive_values": True}]}
    r = registry_partition("c-1", 1)
    service.owned = {r}
    service._positions[r] = {}
    service._starts[r] = {queue: {}}
    service.registry["c-1"] = record
    client = _Client(record, partition=r, queue_ready=True, answered=("s1", 1), marked="s1")
    service._add_client(client)
    client.queue_end, client.end_known, client.acked = queue_end, True, acked
    service._reckon_room(client)
    return service, client, producer, admin


def _fill(service: SubscriptionService, first: int, count: int) -> None:
    """``count`` updates of orders, written by someone else, routed as changelog records at ``first``…"""
    codec = get_codec()
    changelog = service.cfg.topics.region_changelog("orders")
    for offset in range(first, first + count):
        event = EntryEvent("orders", f"k-{offset}", Operation.UPDATE, b"1", EventID("writer", 1, offset + 1),
                           VersionTag(1, 1, offset + 1, "writer"), 1, 0, 1)
        value = codec.encode("EntryEvent", event.to_record())
        service._route(Message(changelog, offset, value), value, [0], (changelog, 0), offset, 1)


def test_a_queue_takes_events_up_to_the_bound_past_the_ack_and_counts_the_rest(cfg: SiteConfig) -> None:
    """A queue holding 2 messages past the ack (bound 5) takes 3 more events; the next 4 are not written,
    each counted, and the client is marked full.  An answer or a marker is still written when full."""
    service, client, producer, _admin = _primary(cfg, queue_end=12, acked=10)
    queue = client.record["queue_topic"]
    _fill(service, 0, 7)
    assert len(producer.to(queue)) == 3, "the queue took what fits under the bound"
    assert client.queue_end - client.acked == BOUND
    assert service.stats["events_not_queued"] == 4 and client.not_queued == 4
    assert client.full_since_ms is not None and service._dirty
    service._send(client, {"kind": "MARKER", "session": "s1"})
    assert len(producer.to(queue)) == 4, "control messages are never held back"


def test_an_acknowledgement_makes_room_again(cfg: SiteConfig) -> None:
    """Acked messages leave the count: after the client acknowledges 3, the queue takes 3 more events."""
    service, client, producer, _admin = _primary(cfg, queue_end=5, acked=0)
    queue = client.record["queue_topic"]
    _fill(service, 0, 1)
    assert producer.to(queue) == [] and service.stats["events_not_queued"] == 1
    client.full_since_ms, client.not_queued = None, 0  # as if not yet dropped
    service.acks["c-1"] = {"client_id": "c-1", "session": "s1", "queue_topic": queue, "next_offset": 3,
                           "received": 3, "repeats": 0, "at": 1}
    service.tables._take_ack(0, "c-1", service.acks["c-1"], restored=False)
    _fill(service, 1, 4)
    assert len(producer.to(queue)) == 3 and service.stats["events_not_queued"] == 2


def test_a_full_queue_is_dropped_with_an_alert_and_a_tombstone_that_says_why(
        cfg: SiteConfig, caplog: pytest.LogCaptureFixture) -> None:
    """On the next turn the full client is unregistered: ALERT logged and counted, queue deleted, and the
    registry tombstone carries the token and ``sluice-unregistered: maximum-message-count``."""
    service, client, producer, admin = _primary(cfg, queue_end=5, acked=0)
    queue = client.record["queue_topic"]
    _fill(service, 0, 2)
    service._read_queue_ends = lambda: None  # type: ignore[method-assign]  # the end is known already
    with caplog.at_level(logging.WARNING, logger="sluice.subscriptions"):
        service._tend_clients()
    [alert] = [r for r in caplog.records if r.getMessage().startswith("ALERT client c-1")]
    assert "(5 messages not acknowledged, the bound 5); 2 events could not be queued" in alert.getMessage()
    assert alert.alert == "client_queue_full" and alert.events_not_queued == 2  # type: ignore[attr-defined]
    assert service.stats["queues_full"] == 1 and "c-1" not in service._clients and "c-1" not in service.registry
    assert admin.deleted == [queue]
    [(value, headers)] = producer.to(service.registry_topic)
    assert value is None and (AUTHORIZATION, f"Bearer {TOKEN}".encode()) in headers
    assert unregistered_reason(headers) == MAXIMUM_MESSAGE_COUNT


def test_a_new_queue_of_the_client_is_bounded_from_its_own_end(cfg: SiteConfig) -> None:
    """A client that started over names a new queue: the old count goes, the new queue's end is read
    before it is bounded (unbounded, and not counted full, until then)."""
    service, client, _producer, _admin = _primary(cfg, queue_end=5, acked=0)
    _fill(service, 0, 1)
    assert client.full_since_ms is not None
    renamed = dict(client.record, queue_topic=cfg.topics.client_queue("c-1", "89abcdef"), session="s2", version=2)
    service.tables._take_registration(0, "c-1", renamed, restored=False)
    assert not client.end_known and client.full_since_ms is None and client.not_queued == 0 and client.acked == 0


def test_the_reason_on_a_tombstone_is_read_only_when_it_is_one_of_ours() -> None:
    """Unknown or missing reasons read as None; the queue-dropping ones are the timeout and the bound."""
    assert unregistered_reason([(UNREGISTERED, b"durable-client-timeout")]) == "durable-client-timeout"
    assert unregistered_reason([(UNREGISTERED, b"something-else")]) is None
    assert unregistered_reason(bearer(TOKEN)) is None and unregistered_reason(None) is None
    assert QUEUE_DROPPED == {"durable-client-timeout", "maximum-message-count"}
