"""Trust boundaries of the subscription service (issue 17), through two real subscription instances on
the embedded broker: no registration, ack, tombstone or undecodable record written by someone with
access to the subscription topics can destroy, redirect or stall what the service keeps.

One site, two instances (each the primary of one of the two registry partitions) and one
legitimate client are shared by the module; each test adds its forgeries with a plain producer, waits
for the dead letter that shows the service read them, and then checks that nothing changed and that
the legitimate client still receives a new event.  The site has a subscriptions token: forgeries that
must pass the token (a client holding it, or a site without one) carry it; the others do not.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from sluice.client import ClientCache
from sluice.core.interest import ResultPolicy
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.errors import CodecError, InvalidRequest
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import make_admin, partition_for_key, read_to_end
from sluice.core.lifecycle import ServiceState
from sluice.core.topics import apply_topics
from sluice.core.clientregistry import bearer, create_queue, read_latest, registry_partition
from sluice.subscriptions.service import SubscriptionService

from waiting import wait_for as _wait_for

#: One worker of `pytest -n` runs the whole module: its services are started once, in a module-scoped fixture.
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("subscriptions_security")]

TOKEN = "security-token"
PARTITIONS = 2
#: How long an event may take to reach the legitimate client, however busy the machine.
DELIVERY_S = 20.0
#: Keys of the probe events: a long run of a's that makes (a+)+ backtrack exponentially under
#: Python's re; the legitimate client's own interest matches them in one pass.
PROBE_INTEREST = r"a+!\d+"


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return _wait_for(predicate, timeout_s=timeout_s, what=what, poll_s=0.05)


class Reader:
    """Every record of one partition of a topic, read as it comes (one consumer for the module)."""

    def __init__(self, bootstrap: str, topic: str, partition: int = 0) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False,
                                  "fetch.wait.max.ms": 10})
        self.consumer.assign([TopicPartition(topic, partition, 0)])
        self.records: list[Any] = []

    def read(self) -> list[Any]:
        for msg in self.consumer.consume(1000, 0.05):
            if msg.error() is None:
                self.records.append(msg)
        return self.records

    def close(self) -> None:
        self.consumer.close()


class Listener:
    """The legitimate client's listener: when each key arrived."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.lock = threading.Lock()

    def _keep(self, event: Any) -> None:
        with self.lock:
            self.arrived[event.key] = time.monotonic()

    after_create = after_update = _keep


class World:
    """The shared site: its config, two instances, the legitimate client and helpers to forge records."""

    def __init__(self, cfg: SiteConfig, bootstrap: str, services: list[SubscriptionService]) -> None:
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.services = services
        self.codec = get_codec()
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        self.dead_letters = Reader(bootstrap, cfg.topics.subscription_dead_letter())
        self.changelog = cfg.topics.region_changelog("orders")
        self.client: ClientCache | None = None
        self.listener = Listener()
        self.partition = -1
        self.probes = 0
        self.latencies: list[float] = []

    def name_on_partition(self, stem: str) -> str:
        """A client id of the legitimate client's registry partition."""
        return next(f"{stem}-{i}" for i in range(1000)
                    if registry_partition(f"{stem}-{i}", PARTITIONS) == self.partition)

    def produce(self, topic: str, key: str | bytes | None, value: bytes | None, *, partition: int,
                headers: list[tuple[str, bytes]] | None = None) -> int:
        """Write one record as anyone with write access could; its offset."""
        done: list[Any] = []
        self.producer.produce(topic, value, key.encode() if isinstance(key, str) else key, partition=partition,
                              headers=headers, on_delivery=lambda err, msg: done.append((err, msg)))
        assert self.producer.flush(30) == 0
        [(err, msg)] = done
        assert err is None, err
        return int(msg.offset())

    def register(self, client_id: str, *, token: bool = True, **changes: Any) -> int:
        """A forged registration record for ``client_id`` (with the site's token unless told otherwise)."""
        record = {"client_id": client_id, "member_id": f"{client_id}-m", "durable": False, "durable_timeout_s": 60,
                  "redundancy": 0, "queue_topic": self.cfg.topics.client_queue(client_id, "0badc0de"),
                  "session": "forged", "version": 1, "interest": [], "connected": True, "keep_alive": False,
                  "ready": False, "changed_at": int(time.time() * 1000)}
        record.update(changes)
        return self.produce(self.cfg.topics.subscription_registry(), client_id,
                            self.codec.encode("ClientRegistration", record),
                            partition=registry_partition(client_id, PARTITIONS), headers=bearer(TOKEN) if token else None)

    def letters_of(self, topic: str, partition: int, offset: int) -> list[dict[str, Any]]:
        """The dead letters written so far for one record."""
        letters = (self.codec.decode_as("DeadLetter", m.value()) for m in self.dead_letters.read())
        return [d for d in letters if (d["source_topic"], d["source_partition"], d["source_offset"]) ==
                (topic, partition, offset)]

    def dead_letter(self, topic: str, offset: int, partition: int | None = None) -> dict[str, Any]:
        """The dead letter of one record (waits for it)."""
        p = self.partition if partition is None else partition
        letters = wait_for(lambda: self.letters_of(topic, p, offset), DELIVERY_S,
                           f"the dead letter of {topic}[{p}]@{offset}")
        return dict(letters[0])

    def event(self, key: str, value: Any) -> int:
        """An update of ``key`` in the changelog, as the region service writes it; its offset."""
        self.probes += 1
        bucket = partition_for_key(key.encode(), self.cfg.region("orders").buckets)
        now = int(time.time() * 1000)
        event = EntryEvent(region="orders", key=key, operation=Operation.UPDATE, value=str(value).encode(),
                           event_id=EventID("writer-m", 1, self.probes), version=VersionTag(2, now, self.probes),
                           origin_dsid=2, bucket=bucket, event_time=now)
        return self.produce(self.changelog, key, self.codec.encode("EntryEvent", event.to_record()), partition=bucket)

    def probe(self) -> float:
        """A new event the legitimate client is interested in; how long it took to reach its listener."""
        key = "a" * 30 + f"!{self.probes}"
        sent = time.monotonic()
        self.event(key, self.probes)
        arrived = wait_for(lambda: self.listener.arrived.get(key), DELIVERY_S, f"{key} at the legitimate client")
        self.latencies.append(arrived - sent)
        return arrived - sent

    def owner(self) -> SubscriptionService:
        [owner] = [s for s in self.services if self.partition in s.owned]
        return owner

    def running(self) -> None:
        for service in self.services:
            assert service.state is ServiceState.RUNNING, (service.member_id, service.state, service.crash)

    def topic_exists(self, topic: str) -> bool:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "unused"})
        try:
            meta = consumer.list_topics(timeout=10).topics.get(topic)
        finally:
            consumer.close()
        return meta is not None and meta.error is None


@pytest.fixture(scope="module")
def world(site_a: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    prefix = f"t{uuid.uuid4().hex[:8]}."
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 2}],
        "subscriptions": {"registry_partitions": PARTITIONS, "ping_interval_ms": 500,
                          "maximum_time_between_pings_ms": 4000, "token": TOKEN},
    }
    path = tmp_path_factory.mktemp("security") / "site-b.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    services = [SubscriptionService(cfg, member_id=f"b-subscriptions-{i}") for i in range(2)]
    runners = []
    for service in services:
        service.start()
        runner = threading.Thread(target=service.run, name=service.member_id, daemon=True)
        runner.start()
        runners.append(runner)
    world = World(cfg, site_a.bootstrap, services)
    try:
        wait_for(lambda: all(s.readiness() == {} and len(s.owned) == 1 for s in services), 60,
                 "each instance the primary of one registry partition")
        client_id = next(f"good-{i}" for i in range(100) if registry_partition(f"good-{i}", PARTITIONS) == 0)
        world.partition = 0
        world.client = ClientCache(cfg, client_id, region_urls=["http://127.0.0.1:9"])
        orders = world.client.region("orders")
        orders.add_listener(world.listener)
        orders.register_interest_regex(PROBE_INTEREST, policy=ResultPolicy.NONE)
        world.client.ready_for_events()
        wait_for(lambda: world.client is not None and world.client.live, DELIVERY_S, "the marker")
        world.probe()
        yield world
    finally:
        if world.client is not None:
            world.client.close()
        world.dead_letters.close()
        for service in services:
            service.stop()
        for runner in runners:
            runner.join(30)
        print(f"probe latencies (s): {[round(x, 3) for x in world.latencies]}")
        for service in services:
            assert service.state is ServiceState.STOPPED, (service.member_id, service.state, service.crash)


def test_a_registration_naming_the_changelog_or_another_clients_queue_destroys_nothing(world: World) -> None:
    """Registrations that name the region changelog (connected or closing) or the legitimate client's
    queue are refused: the changelog keeps its records and receives none, the client's queue stays,
    and a client reading such a record back as its own neither resumes nor deletes what it names."""
    client = world.client
    assert client is not None
    registry = world.cfg.topics.subscription_registry()
    forged = [
        world.register(world.name_on_partition("forger-a"), queue_topic=world.changelog, connected=False),
        world.register(world.name_on_partition("forger-b"), queue_topic=world.changelog,
                       interest=[{"region": "orders", "keys": [], "all_keys": True, "regex": None, "durable": False,
                                  "receive_values": True}]),
        world.register(world.name_on_partition("forger-c"), queue_topic=client.queue_topic, connected=False),
    ]
    for offset in forged:
        letter = world.dead_letter(registry, offset)
        assert "registration refused: queue_topic: not a queue of client forger-" in letter["reason"], letter
    world.probe()
    # A client whose registry record (with the token: its holder may be any client) names the changelog.
    victim = world.name_on_partition("victim")
    world.dead_letter(registry, world.register(victim, queue_topic=world.changelog, connected=False))
    cache = ClientCache(world.cfg, victim, region_urls=["http://127.0.0.1:9"])
    try:
        assert cache.queue_topic.startswith(world.cfg.topics.client_queue(victim, "")), cache.queue_topic
    finally:
        cache.close()
    assert world.topic_exists(world.changelog) and world.topic_exists(client.queue_topic)
    assert client.stats["reinitialized"] == 0
    changelog = [m for p in range(2) for m in _read_all(world.bootstrap, world.changelog, p)]
    assert len(changelog) >= world.probes
    assert "ClientMessage" not in {_schema(m.value()) for m in changelog}, "nothing but region events in it"
    world.running()


def test_a_bad_or_catastrophic_regex_neither_stops_nor_stalls_the_service(world: World) -> None:
    """'(' is refused with the reason (REFUSED on the registering client's own queue; InvalidRequest from
    the client API before anything is written); (a+)+ is taken and matched in linear time, so the
    legitimate client on the same registry partition keeps receiving events."""
    client = world.client
    assert client is not None
    registry = world.cfg.topics.subscription_registry()
    bad = world.name_on_partition("regex")
    queue = world.cfg.topics.client_queue(bad, "0badc0de")
    create_queue(make_admin(world.cfg.kafka.client_settings()), world.cfg, queue, False)
    regex = {"region": "orders", "keys": [], "all_keys": False, "durable": False, "receive_values": True}
    letter = world.dead_letter(registry, world.register(bad, queue_topic=queue, interest=[{**regex, "regex": "("}]))
    assert letter["reason"].startswith("registration refused: regex: not a regular expression RE2 accepts: "
                                       "missing ): ("), letter["reason"]
    [answer] = wait_for(lambda: [world.codec.decode_as("ClientMessage", m.value())
                                 for m in _read_all(world.bootstrap, queue, 0)], DELIVERY_S, "the refusal")
    assert answer["kind"] == "REFUSED" and "missing ): (" in answer["reason"] and answer["session"] == "forged"
    slow = world.name_on_partition("slow")
    world.register(slow, queue_topic=world.cfg.topics.client_queue(slow, "0badc0de"),
                   interest=[{**regex, "regex": "(a+)+"}])
    wait_for(lambda: slow in world.owner().registry, DELIVERY_S, "the (a+)+ registration taken")
    orders = client.region("orders")
    end = _end(world.bootstrap, registry, world.partition)
    with pytest.raises(InvalidRequest) as caught:
        orders.register_interest_regex("(")
    assert caught.value.field == "regex" and caught.value.value == "(" and "missing )" in caught.value.reason
    assert _end(world.bootstrap, registry, world.partition) == end, "nothing written for a refused regex"
    orders.register_interest_regex("(a+)+", policy=ResultPolicy.NONE)  # answered by the service
    latency = world.probe()
    print(f"an event matched against (a+)+ reached the client in {latency:.3f} s")
    world.running()


def test_undecodable_changelog_and_registry_records_are_dead_lettered_once(world: World) -> None:
    """Bytes that are no record, in a changelog partition and in the registry: each gets one dead letter
    with the reason (both instances read the changelog, one writes it), and the next event still
    reaches the client."""
    registry = world.cfg.topics.subscription_registry()
    junk = world.produce(world.changelog, b"junk", b"not an event", partition=0)
    letter = world.dead_letter(world.changelog, junk, partition=0)
    assert letter["reason"].startswith("changelog record cannot be read: ") and letter["value"] == b"not an event"
    garbage = world.produce(registry, world.name_on_partition("garbage"), b"not a registration",
                            partition=world.partition, headers=bearer(TOKEN))
    assert world.dead_letter(registry, garbage)["reason"].startswith("registration cannot be read: ")
    world.probe()
    wait_for(lambda: all(pos.get((world.changelog, 0), 0) > junk
                         for s in world.services for pos in s._positions.values()), DELIVERY_S,
             "both instances past the undecodable changelog record")
    assert len(world.letters_of(world.changelog, 0, junk)) == 1
    assert len(world.letters_of(registry, world.partition, garbage)) == 1
    world.running()


def test_a_forged_ack_or_tombstone_without_the_token_changes_nothing(world: World) -> None:
    """Without the token, an ack does not move the client's queue head, and a tombstone in the registry
    or the acks unregisters no one; and the client's records are written again, so that compaction
    keeps them rather than the forgeries."""
    client = world.client
    assert client is not None
    cid, owner = client.client_id, world.owner()
    acks, registry = world.cfg.topics.subscription_acks(), world.cfg.topics.subscription_registry()
    forged_ack = {"client_id": cid, "session": "forged", "queue_topic": client.queue_topic, "next_offset": 10**6,
                  "received": 0, "repeats": 0, "at": int(time.time() * 1000)}
    offsets = [
        (acks, world.produce(acks, cid, world.codec.encode("ClientAck", forged_ack), partition=world.partition)),
        (registry, world.produce(registry, cid, None, partition=world.partition)),
        (acks, world.produce(acks, cid, None, partition=world.partition,
                             headers=[("authorization", b"Bearer guess")])),
    ]
    for topic, offset in offsets:
        reason = world.dead_letter(topic, offset)["reason"]
        assert "refused: " in reason and "token" in reason and "guess" not in reason, reason
    for service in world.services:
        assert cid in service.registry and service.acks[cid]["session"] != "forged", service.member_id
    assert cid in owner.describe()["clients"]
    world.probe()
    assert read_latest(world.cfg, registry, world.partition, cid) is not None, "the registration written again"
    latest_ack = read_latest(world.cfg, acks, world.partition, cid)
    assert latest_ack is not None and world.codec.decode_as("ClientAck", latest_ack)["session"] != "forged"
    world.running()


def _read_all(bootstrap: str, topic: str, partition: int) -> list[Any]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "fetch.wait.max.ms": 10})
    try:
        return list(read_to_end(consumer, topic, partition, deadline_s=30))
    finally:
        consumer.close()


def _schema(value: bytes | None) -> str | None:
    try:
        return None if value is None else get_codec().schema_of(value)
    except CodecError:
        return None


def _end(bootstrap: str, topic: str, partition: int) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused"})
    try:
        return int(consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1])
    finally:
        consumer.close()
