"""``subscriptions`` settings act in the client (``ClientCache``) and the subscription service.

The client is made with stand-ins for its Kafka producer, consumer and admin client (its registry and
acks reads find nothing: a new client), and its queue reader is driven with a stand-in clock; the
service's loop and its tending of clients run on the stand-ins of ``test_subscription_queue_bound``.
No broker is needed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from sluice.client import subscriber
from sluice.client.subscriber import ClientCache
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, parse_config
from sluice.core.events import EventID
from sluice.core.topics import plan_topics
from sluice.subscriptions import service as service_module
from sluice.core.clientregistry import DURABLE_CLIENT_TIMEOUT, NO_PING, UNREGISTERED, registry_partition
from sluice.subscriptions.service import SubscriptionService
from test_subscription_queue_bound import _primary


def site(**subscriptions: Any) -> SiteConfig:
    return parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                         "regions": [{"name": "orders", "buckets": 1}],
                         "subscriptions": {"registry_partitions": 1, **subscriptions}})


class Done:
    def result(self, timeout: float | None = None) -> None:
        return None


class Producer:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes]] = []
        self.partitions: list[tuple[str, int]] = []

    def produce(self, topic: str, value: bytes, key: bytes | None = None, partition: int = -1, **_: Any) -> None:
        self.records.append((topic, value))
        self.partitions.append((topic, partition))

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0

    def decoded(self, topic: str, schema: str) -> list[dict[str, Any]]:
        return [get_codec().decode_as(schema, value) for t, value in self.records if t == topic]


class Admin:
    def __init__(self) -> None:
        self.created: dict[str, Any] = {}

    def create_topics(self, specs: list[Any], operation_timeout: float = 0) -> dict[str, Done]:
        self.created.update({spec.topic: spec for spec in specs})
        return {spec.topic: Done() for spec in specs}


class Consumer:
    """The client's queue reader: ``script`` holds what each poll returns (None: nothing arrived); every
    poll moves ``clock`` on by 0.25 s; once the script is read the client is stopped."""

    def __init__(self) -> None:
        self.script: list[Any] = []
        self.clock: Clock | None = None
        self.cache: ClientCache | None = None
        self.end = 0

    def assign(self, *_: Any) -> None:
        pass

    def poll(self, timeout: float) -> Any:
        assert self.clock is not None and self.cache is not None
        self.clock.now += 0.25
        answer = self.script.pop(0) if self.script else None
        if not self.script:
            self.cache._stopping.set()
        return answer

    def consume(self, *_: Any) -> list[Any]:
        return []

    def get_watermark_offsets(self, *_: Any, **__: Any) -> tuple[int, int]:
        return 0, self.end

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


#: The client's queue reader itself (the fixture below keeps it from running on its own thread).
READ_QUEUE = ClientCache._run


class Kafka:
    def __init__(self) -> None:
        self.producer, self.admin, self.consumer = Producer(), Admin(), Consumer()


@pytest.fixture
def kafka(monkeypatch: pytest.MonkeyPatch) -> Kafka:
    """The stand-ins every ClientCache of the test gets; its queue reader does not run on its own."""
    made = Kafka()
    monkeypatch.setattr(subscriber, "make_producer", lambda *_, **__: made.producer)
    monkeypatch.setattr(subscriber, "make_admin", lambda *_, **__: made.admin)
    monkeypatch.setattr(subscriber, "make_consumer", lambda *_, **__: made.consumer)
    monkeypatch.setattr(subscriber, "read_latest_record", lambda *_, **__: None)
    monkeypatch.setattr(subscriber, "read_latest", lambda *_, **__: None)
    monkeypatch.setattr(ClientCache, "_run", lambda self: None)
    return made


def test_a_clients_registration_and_queue_carry_the_durable_timeout_and_the_time_to_live(kafka: Kafka) -> None:
    """durable_client_timeout_s is what a durable client registers (unless it gives its own), and its queue
    is kept for ever; a non-durable client's queue keeps its messages message_time_to_live_s, after which
    an unread head is gone and the client starts over (client/subscriber.py ``_queue_lost``)."""
    cfg = site(durable_client_timeout_s=42, message_time_to_live_s=33)
    urls = ["http://127.0.0.1:1"]
    durable = ClientCache(cfg, "d-1", durable=True, region_urls=urls)
    own = ClientCache(cfg, "d-2", durable=True, durable_timeout_s=7, region_urls=urls)
    plain = ClientCache(cfg, "p-1", region_urls=urls)
    registered = {r["client_id"]: r for r in kafka.producer.decoded(cfg.topics.subscription_registry(),
                                                                    "ClientRegistration")}
    assert registered["d-1"]["durable_timeout_s"] == 42 and registered["d-2"]["durable_timeout_s"] == 7
    retention = {name: spec.config["retention.ms"] for name, spec in kafka.admin.created.items()}
    assert retention[durable.queue_topic] == "-1"
    assert retention[plain.queue_topic] == str(33 * 1000)
    assert own.queue_topic in retention


def test_registry_partitions_are_the_partitions_of_the_registry_and_where_each_client_writes(kafka: Kafka) -> None:
    """registry_partitions 5: the registry, acks and fill topics are planned with 5 partitions, the
    service shares those 5 among its instances, and a client writes its records to its own one of them."""
    cfg = site(registry_partitions=5)
    specs = {spec.name: spec.partitions for spec in plan_topics(cfg)}
    names = cfg.topics
    assert [specs[t] for t in (names.subscription_registry(), names.subscription_acks(),
                               names.subscription_fill())] == [5, 5, 5]
    assert SubscriptionService(cfg, member_id="unit").partitions == 5
    ClientCache(cfg, "c-7", region_urls=["http://127.0.0.1:1"])
    [(topic, partition)] = [p for p in kafka.producer.partitions if p[0] == names.subscription_registry()]
    assert partition == registry_partition("c-7", 5)
    assert {registry_partition(f"c-{i}", 5) for i in range(100)} == set(range(5))


def test_subscription_message_tracking_timeout_is_how_long_a_client_remembers_a_writer(kafka: Kafka) -> None:
    """A client forgets a writer thread's EventIDs once it has been silent longer than
    subscription_message_tracking_timeout_ms (a repeat after that is applied again, as in Geode)."""
    cache = ClientCache(site(subscription_message_tracking_timeout_ms=5000), "c-1", region_urls=["http://127.0.0.1:1"])
    tracker = cache._tracker
    assert not tracker.is_repeat(EventID("writer", 1, 5), "k", now_ms=0)
    assert tracker.expire(now_ms=4999) == 0 and tracker.is_repeat(EventID("writer", 1, 5), "k", now_ms=4999)
    assert tracker.expire(now_ms=10_000) == 1
    assert not tracker.is_repeat(EventID("writer", 1, 5), "k", now_ms=10_000)


class Message:
    def __init__(self, offset: int) -> None:
        self._offset = offset

    def error(self) -> None:
        return None

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return get_codec().encode("ClientMessage", {"kind": "MARKER", "session": "another", "version": 0,
                                                    "event": None, "receive_values": True,
                                                    "possible_duplicate": False, "filled_at": 0, "reason": ""})


def read_queue(kafka: Kafka, monkeypatch: pytest.MonkeyPatch, cfg: SiteConfig, script: list[Any]) -> list[float]:
    """Run a client's queue reader over ``script`` (one poll each, 0.25 s apart); when it acknowledged."""
    cache = ClientCache(cfg, "c-1", region_urls=["http://127.0.0.1:1"])
    clock = Clock()
    monkeypatch.setattr(subscriber, "time", clock)
    kafka.consumer.clock, kafka.consumer.cache, kafka.consumer.end = clock, cache, len(script)
    kafka.consumer.script = list(script)
    kafka.producer.records.clear()
    acks: list[float] = []
    real_ack = cache._ack
    cache._ack = lambda: (acks.append(clock.now), real_ack())  # type: ignore[method-assign]
    READ_QUEUE(cache)
    assert cache.error is None
    assert len(kafka.producer.decoded(cfg.topics.subscription_acks(), "ClientAck")) == len(acks)
    return acks


@pytest.mark.parametrize(("interval_ms", "acks"), [(1000, 5), (250, 20)])
def test_subscription_ack_interval_is_how_often_a_reading_client_acknowledges(
        kafka: Kafka, monkeypatch: pytest.MonkeyPatch, interval_ms: int, acks: int) -> None:
    """A message every 0.25 s for 5 s is acknowledged every subscription_ack_interval_ms: 5 acks at
    1000 ms, one per message at 250 ms."""
    cfg = site(subscription_ack_interval_ms=interval_ms, ping_interval_ms=60_000)
    times = read_queue(kafka, monkeypatch, cfg, [Message(i) for i in range(20)])
    assert len(times) == acks
    assert {round(b - a, 2) for a, b in zip(times, times[1:])} == {interval_ms / 1000}


@pytest.mark.parametrize(("interval_ms", "pings"), [(2000, 5), (5000, 2)])
def test_ping_interval_is_how_often_an_idle_client_pings(
        kafka: Kafka, monkeypatch: pytest.MonkeyPatch, interval_ms: int, pings: int) -> None:
    """A client that receives nothing for 10 s acknowledges (pings) every ping_interval_ms."""
    cfg = site(subscription_ack_interval_ms=100, ping_interval_ms=interval_ms)
    times = read_queue(kafka, monkeypatch, cfg, [None] * 40)
    assert len(times) == pings
    assert {round(b - a, 2) for a, b in zip(times, times[1:])} == {interval_ms / 1000}


@pytest.mark.parametrize(("interval_s", "syncs"), [(1, 10), (4, 3)])
def test_message_sync_interval_is_how_often_the_primary_checkpoints(
        monkeypatch: pytest.MonkeyPatch, interval_s: int, syncs: int) -> None:
    """Over 10 s of the service's loop, what it filled is checkpointed (and acknowledged messages
    trimmed) every message_sync_interval_s."""
    service = SubscriptionService(site(message_sync_interval_s=interval_s), member_id="unit")
    clock = Clock()
    monkeypatch.setattr(service_module, "time", clock)
    synced: list[float] = []

    class Group:
        polls = 0

        def subscribe(self, *_: Any, **__: Any) -> None:
            pass

        def poll(self, timeout: float) -> None:
            clock.now += 0.25
            Group.polls += 1
            if Group.polls == 40:
                service._stopping.set()

    service._group = Group()  # type: ignore[assignment]
    for step in ("_read_tables", "_tend_clients", "_fill", "_close"):
        monkeypatch.setattr(service, step, lambda *_, **__: None)
    monkeypatch.setattr(service, "_sync", lambda: synced.append(clock.now))
    service.run()
    assert len(synced) == syncs
    assert {b - a for a, b in zip(synced, synced[1:])} == {float(interval_s)}


class Changelog:
    def get_watermark_offsets(self, *_: Any, **__: Any) -> tuple[int, int]:
        return 0, 0


def silent_client(cfg: SiteConfig, durable: bool, silent_ms: int, durable_timeout_s: int = 60) -> Any:
    """A primary with one connected client whose last word (registration or ping) is ``silent_ms`` old."""
    service, client, producer, admin = _primary(cfg, queue_end=0, acked=0)
    service._changelog = Changelog()  # type: ignore[assignment]
    client.record.update(durable=durable, durable_timeout_s=durable_timeout_s,
                         changed_at=int(time.time() * 1000) - silent_ms)
    return service, client, producer, admin


def tombstone_reason(producer: Any, cfg: SiteConfig) -> bytes | None:
    for value, headers in producer.to(cfg.topics.subscription_registry()):
        if value is None:
            return dict(headers or [])[UNREGISTERED]
    return None


@pytest.mark.parametrize(("bound_ms", "dropped"), [(4000, True), (60_000, False)])
def test_maximum_time_between_pings_is_how_long_a_silent_client_is_taken_as_connected(
        bound_ms: int, dropped: bool) -> None:
    """A non-durable client silent for 10 s is unregistered (its queue deleted, the tombstone says
    no-ping) with maximum_time_between_pings_ms 4000, and kept with 60000."""
    cfg = site(maximum_time_between_pings_ms=bound_ms, maximum_message_count=10)
    service, client, producer, admin = silent_client(cfg, durable=False, silent_ms=10_000)
    service._tend_clients()
    assert ("c-1" not in service._clients) is dropped
    assert (admin.deleted == [client.record["queue_topic"]]) is dropped
    assert tombstone_reason(producer, cfg) == (NO_PING.encode() if dropped else None)


@pytest.mark.parametrize(("timeout_s", "dropped"), [(5, True), (60, False)])
def test_the_service_drops_a_durable_client_away_longer_than_its_registered_timeout(
        timeout_s: int, dropped: bool) -> None:
    """A durable client silent for 10 s (past maximum_time_between_pings_ms 4000, so away since then)
    is dropped with its queue when it registered a durable timeout of 5 s, and kept with 60 s."""
    cfg = site(maximum_time_between_pings_ms=4000, maximum_message_count=10)
    service, client, producer, admin = silent_client(cfg, durable=True, silent_ms=10_000,
                                                     durable_timeout_s=timeout_s)
    service._tend_clients()
    assert ("c-1" not in service._clients) is dropped
    assert tombstone_reason(producer, cfg) == (DURABLE_CLIENT_TIMEOUT.encode() if dropped else None)
    assert service.stats["timed_out"] == (1 if dropped else 0)
