"""The subscription primary's protocol (subscriptions/protocol.py) replayed without a broker: instance A is
primary for both registry partitions, B takes one over in the middle of a fill (revoked, or lost without
a revoke), and A's late checkpoint comes after.  Every event reaches the clients of the partition, what
may have been filled before is flagged possibleDuplicate, a late checkpoint of A moves nothing of B's,
checkpoints never go back across the two; the clients' rules (pings, durable timeout, markers) are
decisions on records and a clock passed in; and each retry loop of the service gives up at once on an
error that is not retriable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from sluice.core.clientregistry import CLOSED, DURABLE_CLIENT_TIMEOUT, NO_PING, registry_partition
from sluice.core.config import SiteConfig, parse_config
from sluice.core.errors import BrokerUnavailable, KafkaCallFailed, KafkaFatal
from sluice.core.kafka import KafkaError, TopicPartition
from sluice.subscriptions import service as service_module
from sluice.subscriptions import tables as tables_module
from sluice.subscriptions.protocol import Client, SubscriptionProtocol, Unregister
from sluice.subscriptions.service import SubscriptionService

PARTITIONS = 2
CHANGELOG = ("x.region.orders.changelog", 0)
NOW_MS = 1_700_000_000_000
PINGS_MS = 10_000


def client_in(partition: int, n: int = 0) -> str:
    """A client id whose registry partition is ``partition``."""
    ids = (f"c-{i}" for i in range(1000))
    return [c for c in ids if registry_partition(c, PARTITIONS) == partition][n]


def registration(client_id: str, *, durable: bool = False, connected: bool = True, keep_alive: bool = False,
                 changed_at: int = NOW_MS, session: str = "s1", version: int = 1, ready: bool = True,
                 durable_timeout_s: int = 60) -> dict[str, Any]:
    return {"client_id": client_id, "member_id": f"{client_id}-m", "durable": durable,
            "durable_timeout_s": durable_timeout_s, "redundancy": 0,
            "queue_topic": f"x.subscription.{client_id}.0123abcd", "session": session, "version": version,
            "connected": connected, "keep_alive": keep_alive, "ready": ready, "changed_at": changed_at,
            "interest": [{"region": "orders", "keys": [], "all_keys": True, "regex": None, "durable": True,
                          "receive_values": True}]}


@dataclass
class Site:
    """What the trace needs of Kafka: the changelog's records (writers), the fill topic's checkpoints in
    the order written, each client queue's messages (offset, possibleDuplicate), the registry."""

    writers: list[str]
    registry: dict[str, dict[str, Any]]
    fill: list[dict[str, Any]] = field(default_factory=list)
    queues: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)
    #: Offsets whose writes to the queues fail (the producer's callback reports them).
    failing: set[int] = field(default_factory=set)

    @property
    def end(self) -> int:
        return len(self.writers)


class Member:
    """One subscription instance: its protocol, and the service's side of it done by hand."""

    def __init__(self, name: str, site: Site) -> None:
        self.name, self.site = name, site
        self.protocol = SubscriptionProtocol(name, PARTITIONS, 100, PINGS_MS, {})
        self.fill_read = 0  # how much of the fill topic this instance read
        self.write_failed = False

    def read_tables(self) -> None:
        for record in self.site.fill[self.fill_read:]:
            self.protocol.take_checkpoint(record)
        self.fill_read = len(self.site.fill)

    def assign(self, partitions: set[int]) -> None:
        self.read_tables()  # to its end: the previous primary's last checkpoint included
        self.protocol.assign(partitions, {CHANGELOG: self.site.end}, self.site.registry)

    def tend(self, now_ms: int) -> None:
        for client in list(self.protocol.clients.values()):
            assert self.protocol.rule(client, None, now_ms) is None
            if self.protocol.answer_due(client):
                if not self.protocol.queue_started(client):
                    self.sync({self.protocol.start_queue(client)})
                self.protocol.answered(client)

    def fill(self, upto: int) -> None:
        """The changelog records below ``upto``, from the lowest position of the owned partitions."""
        start = min(p.get(CHANGELOG, 0) for p in self.protocol.positions.values())
        for offset in range(start, upto):
            takers = self.protocol.takers(CHANGELOG, offset)
            if not takers:
                continue
            reached = self.protocol.index.clients_of("orders", f"k{offset}")
            for client, _values, duplicate in self.protocol.deliveries(reached, takers, CHANGELOG, offset,
                                                                       self.site.writers[offset], None, NOW_MS):
                if offset in self.site.failing:
                    self.write_failed = True  # not written: the producer's callback says so
                else:
                    self.site.queues.setdefault(client.id, []).append((offset, duplicate))
            self.protocol.advance(takers, CHANGELOG, offset)

    def sync(self, partitions: set[int] | None = None) -> bool:
        """As ``SubscriptionService._sync``: a failed write refills, else the checkpoints are written."""
        partitions = self.protocol.owned if partitions is None else partitions
        if self.write_failed:
            self.write_failed = False
            self.protocol.refill(partitions, {CHANGELOG: self.site.end})
            return False
        self.site.fill += self.protocol.checkpoint(partitions, NOW_MS)
        return True

    def revoke(self, partitions: set[int]) -> None:
        self.sync(self.protocol.revoking(partitions))
        self.protocol.release(partitions)


def offsets_of(site: Site, client_id: str) -> list[int]:
    return [offset for offset, _ in site.queues.get(client_id, [])]


def two_clients() -> tuple[Site, str, str]:
    c0, c1 = client_in(0), client_in(1)
    site = Site(writers=["someone"] * 10, registry={c0: registration(c0), c1: registration(c1)})
    return site, c0, c1


def test_a_takeover_by_revoke_fills_each_event_once_flagging_what_may_have_been_filled() -> None:
    """A revoke in the middle of a fill: the last checkpoint lets B go on where A stopped, each event once, B's
    flagged possibleDuplicate."""
    site, c0, c1 = two_clients()
    a = Member("A", site)
    a.assign({0, 1})
    a.tend(NOW_MS)  # the queues start where the fill is now: at the changelog's end as it was (10)
    site.writers += ["someone"] * 8  # offsets 10..17 come after the registrations
    a.fill(13)
    a.sync()
    a.fill(15)  # mid-fill: 13 and 14 are in the queues, not checkpointed yet
    a.revoke({1})  # the last checkpoint of partition 1 says 15
    assert a.protocol.owned == {0} and c1 not in a.protocol.clients and c1 not in a.protocol.index
    b = Member("B", site)
    b.assign({1})
    assert b.protocol.positions[1] == {CHANGELOG: 15} and b.protocol.stats["takeovers"] == 1
    b.tend(NOW_MS)
    b.fill(18)
    a.fill(18)
    assert offsets_of(site, c1) == list(range(10, 18)) == offsets_of(site, c0)  # none lost, none twice
    # B flags all below the end as it took over (it cannot know what A filled): possibleDuplicate.
    assert [dup for offset, dup in site.queues[c1] if offset >= 15] == [True] * 3
    assert not any(dup for _, dup in site.queues[c0])
    b.sync()
    assert [c["positions"] for c in site.fill if c["registry_partition"] == 1][-1] == [
        {"topic": CHANGELOG[0], "partition": 0, "offset": 18}]


def test_a_takeover_without_revoke_refills_from_the_last_checkpoint_and_a_late_checkpoint_moves_nothing() -> None:
    """A lost partition gets no last checkpoint; B refills from the last one (repeats flagged), and A's late
    checkpoint changes nothing of B's."""
    site, c0, c1 = two_clients()
    a = Member("A", site)
    a.assign({0, 1})
    a.tend(NOW_MS)
    site.writers += ["someone"] * 10  # offsets 10..19
    a.fill(13)
    a.sync()
    a.fill(16)  # 13..15 in the queues, not checkpointed
    # A's session expires: B is primary before A hears of it.  A writes no last checkpoint.
    assert a.protocol.lost({1}) == {1}
    assert a.protocol.checkpoint({1}, NOW_MS) == []  # nothing of a lost partition is ever checkpointed
    b = Member("B", site)
    b.assign({1})
    assert b.protocol.positions[1] == {CHANGELOG: 13}
    b.tend(NOW_MS)
    b.fill(17)
    b.sync()  # B's checkpoint: 17
    # A's late checkpoint (a primary that lost the partition, still writing): ahead of B, and without B's view.
    site.fill.append({"registry_partition": 1, "member": "A", "updated_at": NOW_MS,
                      "positions": [{"topic": CHANGELOG[0], "partition": 0, "offset": 19}], "queues": []})
    b.read_tables()
    assert b.protocol.stats["stale_checkpoints"] == 1 and b.protocol.checkpoints[1] == {CHANGELOG: 17}
    # B's writes of 17 and 18 fail: it fills again from ITS last checkpoint, not from A's late one.
    site.failing = {17, 18}
    b.fill(19)
    assert not b.sync()
    site.failing = set()
    assert b.protocol.positions[1] == {CHANGELOG: 17}
    b.fill(20)
    b.sync()
    assert sorted(set(offsets_of(site, c1))) == list(range(10, 20))  # nothing lost
    # What A filled and B filled again (13..15) comes twice, B's copies flagged: the client drops them.
    repeats = [(o, dup) for o, dup in site.queues[c1] if 13 <= o < 16]
    assert repeats == [(13, False), (14, False), (15, False), (13, True), (14, True), (15, True)]
    assert [o for o in offsets_of(site, c1) if o not in range(13, 16)] == [10, 11, 12, 16, 17, 18, 19]


def test_checkpoints_never_go_back() -> None:
    """A primary starts from the last checkpoint, and a checkpoint behind it is our bug, failing loudly."""
    protocol = SubscriptionProtocol("A", PARTITIONS, 100, PINGS_MS)
    protocol.take_checkpoint({"registry_partition": 0, "member": "Z", "updated_at": 0,
                              "positions": [{"topic": CHANGELOG[0], "partition": 0, "offset": 7}], "queues": []})
    protocol.assign({0}, {CHANGELOG: 9}, {})
    assert protocol.positions[0] == {CHANGELOG: 7}  # from the last checkpoint, not the end
    protocol.positions[0][CHANGELOG] = 5  # a bug that moved a position back
    with pytest.raises(AssertionError, match="checkpoint moves back"):
        protocol.checkpoint({0}, NOW_MS)


def test_a_queue_starts_where_the_fill_is_and_takes_nothing_older() -> None:
    """A queue takes nothing before its registration is answered, and never its client's own writes."""
    site, c0, _c1 = two_clients()
    a = Member("A", site)
    a.assign({0, 1})
    site.writers += ["someone"] * 2
    a.fill(12)  # before any registration is answered: no queue takes anything
    assert site.queues == {}
    a.tend(NOW_MS)
    site.writers += [f"{c0}-m", "someone"]  # offset 12: c0's own write, never sent back to it
    a.fill(14)
    assert offsets_of(site, c0) == [13]


def test_a_full_queue_takes_no_more_and_its_client_is_dropped_next_turn() -> None:
    """Past maximum-message-count an event is not queued but counted, and the client is marked for removal; an ack
    makes room."""
    protocol = SubscriptionProtocol("A", PARTITIONS, 2, PINGS_MS, {})
    c0 = client_in(0)
    protocol.assign({0}, {CHANGELOG: 0}, {c0: registration(c0)})
    client = protocol.clients[c0]
    protocol.start_queue(client)
    protocol.queue_end_read(client, 0, None)
    protocol.dirty = False
    got = [len(protocol.deliveries({c0: True}, [0], CHANGELOG, offset, "w", None, NOW_MS)) for offset in range(4)]
    assert got == [1, 1, 0, 0] and client.not_queued == 2 and protocol.stats["events_not_queued"] == 2
    assert client.full_since_ms == NOW_MS and protocol.dirty
    protocol.acked(c0, {"queue_topic": client.record["queue_topic"], "next_offset": 2})
    assert client.room == 2


@pytest.mark.parametrize(("record", "silent_ms", "reason"), [
    (registration("c", connected=False), 0, CLOSED),
    (registration("c", durable=True, connected=False), 0, CLOSED),  # durable, closed without keep-alive
    (registration("c"), PINGS_MS + 1, NO_PING),
    (registration("c"), PINGS_MS, None),
    (registration("c", durable=True), PINGS_MS + 1, None),  # away, not gone
    (registration("c", durable=True, connected=False, keep_alive=True), 0, None),
])
def test_the_unregistration_rules_are_decisions_on_the_record_and_the_time(
        record: dict[str, Any], silent_ms: int, reason: str | None) -> None:
    """Closed, silent past the ping bound, or neither: the rule decides from the record and the time passed in."""
    protocol = SubscriptionProtocol("A", PARTITIONS, 100, PINGS_MS)
    client = Client(record, partition=0)
    protocol.add_client(client)
    verdict = protocol.rule(client, None, NOW_MS + silent_ms)
    assert (verdict.reason if isinstance(verdict, Unregister) else None) == reason


def test_a_durable_client_away_keeps_its_durable_interest_until_its_timeout() -> None:
    """A durable client away is kept for its durable-client-timeout and no longer; a ping brings it back."""
    protocol = SubscriptionProtocol("A", PARTITIONS, 100, PINGS_MS)
    record = registration("c", durable=True, durable_timeout_s=30)
    record["interest"].append({"region": "orders", "keys": ["k"], "all_keys": False, "regex": None,
                               "durable": False, "receive_values": False})
    client = Client(record, partition=0)
    protocol.add_client(client)
    assert protocol.rule(client, None, NOW_MS + PINGS_MS + 1) is None
    assert client.away_since_ms == NOW_MS and "orders" in client.interest
    assert protocol.rule(client, None, NOW_MS + 30_000) is None  # away exactly its timeout: kept
    verdict = protocol.rule(client, None, NOW_MS + 30_001)
    assert isinstance(verdict, Unregister) and verdict.reason == DURABLE_CLIENT_TIMEOUT
    assert verdict.timed_out_after_s == pytest.approx(30.001)
    # A ping in time brings it back with all its interest.
    back = Client(dict(record), partition=0)
    protocol.add_client(back)
    protocol.rule(back, None, NOW_MS + PINGS_MS + 1)
    assert protocol.rule(back, {"session": "s1", "at": NOW_MS + PINGS_MS + 2}, NOW_MS + PINGS_MS + 3) is None
    assert back.away_since_ms is None


def test_answers_and_markers_are_due_once_per_registration_and_session() -> None:
    """REGISTERED is due once per (session, version), the marker once per session."""
    protocol = SubscriptionProtocol("A", PARTITIONS, 100, PINGS_MS)
    c0 = client_in(0)
    protocol.assign({0}, {CHANGELOG: 0}, {c0: registration(c0)})
    client = protocol.clients[c0]
    assert protocol.answer_due(client) and not protocol.queue_started(client)
    protocol.start_queue(client)
    protocol.answered(client)
    assert not protocol.answer_due(client) and protocol.marker_due(client)
    client.marked = "s1"
    assert not protocol.marker_due(client)
    protocol.registration(0, registration(c0, version=2))
    assert protocol.answer_due(client) and not protocol.marker_due(client)


# --- retry loops: an error that is not retriable is not tried again ------------------------------------


def site_cfg() -> SiteConfig:
    return parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                         "regions": [{"name": "orders", "buckets": 1}]})


class _Tables:
    """A tables consumer whose end-offset calls fail with ``errors`` first, then answer 5."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return 0, 5


def test_reading_a_table_end_does_not_retry_an_error_that_is_not_retriable() -> None:
    """A fatal error reading a table's end is raised at once, not tried again."""
    service = SubscriptionService(site_cfg(), member_id="unit")
    service._tables = _Tables(KafkaFatal("fatal"))  # type: ignore[assignment]
    with pytest.raises(KafkaFatal):
        service.tables.end(TopicPartition(service.registry_topic, 0), deadline=float("inf"))
    assert service._tables.calls == 1  # type: ignore[attr-defined]


def test_reading_a_table_end_retries_a_retriable_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retriable error reading a table's end is tried again."""
    monkeypatch.setattr(tables_module, "READ_TABLES_RETRY_S", 0.0)
    service = SubscriptionService(site_cfg(), member_id="unit")
    service._tables = _Tables(BrokerUnavailable("the leader moved"))  # type: ignore[assignment]
    assert service.tables.end(TopicPartition(service.registry_topic, 0), deadline=float("inf")) == 5
    assert service._tables.calls == 2  # type: ignore[attr-defined]


class _Producer:
    """A producer whose ``produce`` fails with ``errors`` first, then takes the record."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.produced = 0

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.produced += 1
        if self.errors:
            raise self.errors.pop(0)

    def poll(self, timeout: float) -> int:
        return 0


def test_a_write_does_not_retry_an_error_that_is_not_retriable() -> None:
    """A fatal write error is raised at once, not tried again."""
    service = SubscriptionService(site_cfg(), member_id="unit")
    service._producer = _Producer(KafkaFatal("fatal", code=KafkaError._FATAL))
    with pytest.raises(KafkaFatal):
        service._produce_to(service.fill_topic, b"v", b"k", 0)
    assert service._producer.produced == 1


def test_a_write_waits_out_a_full_producer_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full producer queue is back-pressure: the write goes again."""
    monkeypatch.setattr(service_module, "PRODUCER_FULL_WAIT_S", 0.0)
    service = SubscriptionService(site_cfg(), member_id="unit")
    service._producer = _Producer(KafkaCallFailed("full", code=KafkaError._QUEUE_FULL, retriable=True))
    service._produce_to(service.fill_topic, b"v", b"k", 0)
    assert service._producer.produced == 2
