"""The subscription service's interest index and routing (issue 18) against the per-client loop it replaced,
as the oracle: over random registrations, changes of them and events, each event reaches exactly the clients,
with exactly the messages, the loop over every client would have sent."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_subscription_validation import FakeMessage, FakeProducer

from sluice.core.interest import Delivery, RegionInterest
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, parse_config
from sluice.core.events import REGION_OPERATIONS, EntryEvent, EventID, Operation, VersionTag
from sluice.subscriptions.index import InterestIndex
from sluice.core.clientregistry import interest_of, registry_partition
from sluice.subscriptions.service import FORWARDED, SubscriptionService, _Client

REGIONS = ("orders", "prices", "audit")
KEYS = ("k1", "k2", "k3", "order-1", "order-22", "x")
PATTERNS = (r"k\d", r"order-\d+", r"order-2.*", r".*", r"x|k1")
PARTITIONS = 2
#: Client ids of both registry partitions, in turn.
CLIENT_IDS = ("c0", "c1", "c4", "c2")

registrations = st.fixed_dictionaries({
    "region": st.sampled_from(REGIONS),
    "keys": st.lists(st.sampled_from(KEYS), max_size=3),
    "all_keys": st.booleans(),
    "regex": st.none() | st.sampled_from(PATTERNS),
    "durable": st.booleans(),
    "receive_values": st.booleans(),
})
#: A client's interest records: mostly one kind each (keys, ALL_KEYS or a regex), now and then an empty
#: or mixed one, which the wire allows.
interests = st.lists(registrations, max_size=4)


def interest_records(records: list[dict[str, Any]]) -> dict[str, RegionInterest]:
    return interest_of({"interest": records})


def oracle_clients_of(interest: dict[str, dict[str, RegionInterest]], region: str, key: str) -> dict[str, bool]:
    """The loop over every client: who an update of ``key`` reaches, and whether with values."""
    found = {}
    for client_id, regions in interest.items():
        delivery = regions[region].delivery(key) if region in regions else None
        if delivery is not None:
            found[client_id] = delivery is Delivery.VALUES
    return found


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(["c0", "c1", "c2", "c3"]), st.none() | interests, st.booleans()),
                min_size=1, max_size=12))
def test_the_index_answers_what_asking_every_client_answers(changes: list[tuple[str, Any, bool]]) -> None:
    """Clients registering, changing, going durable-only and leaving in any order: after each change, for
    every region and key (registered or not), the index names the clients the per-client loop names, each
    with values or invalidates as it decides, and a region operation reaches every client with interest."""
    index = InterestIndex()
    interest: dict[str, dict[str, RegionInterest]] = {}
    for client_id, records, durable_only in changes:
        if records is None:
            index.remove(client_id)
            interest.pop(client_id, None)
        else:
            held = interest_of({"interest": records}, durable_only=durable_only)
            index.put(client_id, held)
            interest[client_id] = held
        for region in REGIONS:
            for key in (*KEYS, "order-2x", "never-registered"):
                assert dict(index.clients_of(region, key)) == oracle_clients_of(interest, region, key), (region, key)
            assert set(index.clients_in(region)) == {c for c, regions in interest.items()
                                                     if region in regions and not regions[region].empty()}
    assert len(index) == len(interest)


# --- the service's routing ---------------------------------------------------------------------------------


def site() -> SiteConfig:
    return parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                         "regions": [{"name": r, "buckets": 2} for r in REGIONS],
                         "subscriptions": {"registry_partitions": PARTITIONS}})


class FakeChangelog:
    """The changelog consumer: hands out the records it is given, all at once."""

    def __init__(self) -> None:
        self.messages: list[FakeMessage] = []

    def poll(self, timeout: float = 0) -> FakeMessage | None:
        return self.messages.pop(0) if self.messages else None

    def consume(self, n: int, timeout: float = 0) -> list[FakeMessage]:
        out, self.messages = self.messages[:n], self.messages[n:]
        return out


clients = st.fixed_dictionaries({
    "interest": st.lists(registrations, min_size=1, max_size=4),
    "start": st.one_of(st.just(0), st.integers(min_value=0, max_value=6), st.none()),  # None: not answered
    "away": st.booleans(),         # durable and away: only its durable interest
})
events = st.tuples(
    st.sampled_from(REGIONS), st.sampled_from((*KEYS, "other")),
    st.sampled_from([Operation.UPDATE, Operation.CREATE, Operation.DESTROY, Operation.INVALIDATE,
                     Operation.PUTALL_UPDATE, Operation.LOCAL_DESTROY]) | st.sampled_from(sorted(REGION_OPERATIONS)),
    st.sampled_from(["writer-0", "writer-1", "m-c0", "m-c1"]),  # member: another writer, or a client
    st.integers(min_value=1, max_value=3),  # sequence: region clear parts repeat one EventID
    st.integers(min_value=0, max_value=1),  # changelog partition
    st.booleans(),  # with a value
    st.integers(min_value=1, max_value=3),  # parts: events of one EventID (a region clear's, per bucket)
)


def _event(region: str, key: str, operation: Operation, member: str, sequence: int, bucket: int,
           valued: bool) -> EntryEvent:
    return EntryEvent(region, key, operation, b'{"v": 1}' if valued else None, EventID(member, 1, sequence),
                      VersionTag(1, 1000, 1, "region-1"), 1, bucket, 2000)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(clients, min_size=1, max_size=4), st.lists(events, min_size=1, max_size=20),
       st.integers(min_value=0, max_value=8), st.integers(min_value=0, max_value=6), st.sampled_from([0, 1]),
       st.lists(st.tuples(st.integers(min_value=0, max_value=19), st.integers(min_value=0, max_value=3),
                          interests), max_size=3))
def test_the_service_sends_each_event_to_exactly_the_clients_the_loop_over_every_client_sent_it_to(
        specs: list[dict[str, Any]], stream: list[tuple[Any, ...]], duplicates_below: int, taken_from: int,
        behind: int, changes: list[tuple[int, int, list[dict[str, Any]]]]) -> None:
    """Queue starts, a client's own writes, durable clients away, registry partitions behind the others
    (a takeover), refilled events (possibleDuplicate), region clears once per bucket, values or invalidates,
    and registrations changing between events: the messages each queue receives, in order, are those
    today's loop would have written, byte for byte but for the fill time."""
    cfg = site()
    svc = SubscriptionService(cfg, member_id="unit")
    producer = FakeProducer()
    changelog = FakeChangelog()
    svc._producer, svc._changelog = producer, changelog
    svc.owned = set(range(PARTITIONS))
    topics = [cfg.topics.region_changelog(r) for r in REGIONS]
    for r in svc.owned:
        # Partition ``behind`` was taken over: its position is behind, and it refills what it had filled.
        svc._positions[r] = {(t, p): (0 if r == behind else taken_from) for t in topics for p in range(2)}
        svc._starts[r] = {}
        svc._duplicates_below[r] = {(t, p): (duplicates_below if r == behind else 0) for t in topics
                                    for p in range(2)}
    for i, spec in enumerate(specs):
        client_id = CLIENT_IDS[i]
        record = {"client_id": client_id, "member_id": f"m-{client_id}",
                  "queue_topic": cfg.topics.client_queue(client_id, "0123abcd"), "interest": spec["interest"],
                  "durable_timeout_s": 60}
        client = _Client(record, partition=registry_partition(client_id, PARTITIONS))
        svc._add_client(client)
        if spec["away"]:
            svc._away(client, 1)
        if spec["start"] is not None:
            svc._starts[client.partition][record["queue_topic"]] = {(t, p): spec["start"] for t in topics
                                                                    for p in range(2)}

    codec = get_codec()
    expected: dict[str, list[dict[str, Any]]] = {}
    clears: dict[str, Any] = {}
    offsets = {(t, p): 0 for t in topics for p in range(2)}
    parts = [(n, (region, part_key if i else key, operation, member, sequence, bucket, valued))
             for n, (region, key, operation, member, sequence, bucket, valued, count) in enumerate(stream)
             for i, part_key in enumerate(KEYS[:count])]
    for n, (region, key, operation, member, sequence, bucket, valued) in parts:
        for at, which, records in changes:
            if at == n and which < len(specs) and key == stream[n][1]:
                client = svc._clients[CLIENT_IDS[which]]
                client.record = {**client.record, "interest": records}
                svc._set_interest(client, interest_of(client.record))
        event = _event(region, key, operation, member, sequence, bucket, valued)
        tp = (cfg.topics.region_changelog(region), bucket)
        offset = offsets[tp]
        offsets[tp] += 1
        changelog.messages.append(FakeMessage(tp[0], bucket, offset, key.encode(),
                                              codec.encode("EntryEvent", event.to_record())))
        # The oracle: today's loop over every client, on the service's state before the record.
        takers = [r for r in svc.owned if svc._positions[r][tp] <= offset]
        if event.operation in FORWARDED:
            for client in svc._clients.values():
                delivery = _loop_delivery(svc, client, event, takers, tp, offset, clears)
                if delivery is None:
                    continue
                values, duplicate = delivery
                record = event.to_record()
                if not values:
                    record["value"] = None
                expected.setdefault(client.record["queue_topic"], []).append({
                    "kind": "EVENT", "session": "", "version": 0, "event": record, "receive_values": values,
                    "possible_duplicate": duplicate, "reason": ""})
        svc._fill()

    sent: dict[str, list[dict[str, Any]]] = {}
    for topic, _partition, _key, value, _headers in producer.records:
        message = codec.decode_as("ClientMessage", value)
        del message["filled_at"]
        sent.setdefault(topic, []).append(message)
    assert sent == expected
    assert svc.stats["filled"] == sum(len(m) for m in expected.values())


def _loop_delivery(svc: SubscriptionService, client: _Client, event: EntryEvent, takers: list[int],
                   tp: tuple[str, int], offset: int, clears: dict[str, Any]) -> tuple[bool, bool] | None:
    """(values, possibleDuplicate) of the message the per-client loop of the previous release sent
    ``client`` for ``event``, or None: its checks in its order."""
    r = client.partition
    if r not in takers:
        return None
    start = svc._starts[r].get(client.record["queue_topic"])
    if start is None or offset < start.get(tp, 0):
        return None
    if event.event_id.member_id == client.record["member_id"]:
        return None
    interest = client.interest.get(event.region)
    if event.operation in REGION_OPERATIONS:
        if interest is None or interest.empty() or clears.get(client.id) == (event.event_id, event.bucket):
            return None
        clears[client.id] = (event.event_id, event.bucket)
        delivery: Delivery | None = Delivery.VALUES
    else:
        delivery = interest.delivery(event.key) if interest is not None else None
    if delivery is None:
        return None
    return delivery is Delivery.VALUES, offset < svc._duplicates_below.get(r, {}).get(tp, 0)


def test_an_undecodable_record_reaches_no_client_and_is_dead_lettered_by_one_instance() -> None:
    """A record whose head routes it but whose tail is damaged: the instance that fills its dead-letter
    partition dead-letters it, and no client's queue receives it."""
    cfg = site()
    svc = SubscriptionService(cfg, member_id="unit")
    producer, changelog = FakeProducer(), FakeChangelog()
    svc._producer, svc._changelog = producer, changelog
    svc.owned = {0, 1}
    topic = cfg.topics.region_changelog("orders")
    for r in svc.owned:
        svc._positions[r], svc._starts[r] = {}, {}
    client = _Client({"client_id": "c0", "member_id": "m-c0", "queue_topic": cfg.topics.client_queue("c0", "0123abcd"),
                      "interest": [{"region": "orders", "keys": [], "all_keys": True, "regex": None, "durable": False,
                                    "receive_values": True}]}, partition=registry_partition("c0", PARTITIONS))
    svc._add_client(client)
    svc._starts[client.partition][client.record["queue_topic"]] = {}
    good = get_codec().encode("EntryEvent", _event("orders", "k1", Operation.UPDATE, "w", 1, 0, True).to_record())
    changelog.messages = [FakeMessage(topic, 0, 0, b"k1", good[:-3]), FakeMessage(topic, 0, 1, b"k1", good)]
    svc._fill()
    letters = producer.to(svc.dead_letter_topic)
    assert [d["source_offset"] for d in letters] == [0] and letters[0]["reason"].startswith(
        "changelog record cannot be read: ")
    assert [m["event"]["key"] for m in producer.to(client.record["queue_topic"])] == ["k1"]
    assert svc.stats["undecodable"] == 1 and svc.stats["filled"] == 1
