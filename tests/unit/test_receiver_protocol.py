"""The gateway receiver's protocol (receiver/protocol.py) replayed without a broker: receiver A holds an
inbound partition, B takes it over in the middle of a batch (revoked, or lost without a revoke), and A's
late outcome comes after.  No event is applied twice, no batch acknowledged by A is applied again by B,
the duplicate-batch tracking and the partition's figures go on from A's, A's late outcome commits
nothing; the invariants the protocol asserts fail loudly when broken; and each retry loop of the
receiver gives up at once on an error that is not retriable."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from sluice.core.errors import BrokerUnavailable, KafkaFatal, SluiceError, Stopping
from sluice.core.events import EventID
from sluice.core.kafka import TopicPartition
from sluice.core.receivertotals import PartitionTotals
from sluice.core.regionclient import BatchAnswer, RegionError
from sluice.receiver import service as receiver_module
from sluice.receiver.protocol import (
    Ack,
    Applied,
    Apply,
    Duplicate,
    FailureAction,
    InboundPartition,
    ReceiverProtocol,
    failure_action,
)
from sluice.receiver.routing import OwnerRouting
from sluice.receiver.service import ReceiverService

TOPIC = "b.gateway.inbound"
DSID = 2
KEY = "1/s/0"  # the sender partition writing to inbound partition 0


@dataclass
class Batch:
    """A GatewayBatch record of the inbound partition: its sender partition, batch id and events."""

    key: str
    batch_id: int
    events: list[EventID]


@dataclass
class Site:
    """What the trace needs of Kafka and the region service: the inbound partition's records, the acks
    topic (each ack with the figures its header carries), the group's committed offset (checked to move
    forward whoever commits) and every event the region applied (checked: once each)."""

    inbound: list[Batch]
    acks: list[Ack] = field(default_factory=list)
    committed: int = 0
    applied: dict[EventID, int] = field(default_factory=dict)

    def commit(self, offsets: list[TopicPartition]) -> None:
        for tp in offsets:
            assert tp.offset >= self.committed, f"committed back from {self.committed} to {tp.offset}"
            self.committed = tp.offset

    def apply(self, events: list[EventID], indexes: list[int]) -> BatchAnswer:
        """The region service: applies each event once by EventID, answers repeats as duplicates."""
        applied = duplicates = 0
        for i in indexes:
            if events[i] in self.applied:
                duplicates += 1
            else:
                applied += 1
            self.applied[events[i]] = self.applied.get(events[i], 0) + 1
        return BatchAnswer(len(indexes), applied, duplicates, 0, [], (len(indexes) - 1, events[indexes[-1]]))


class Member:
    """One receiver: its protocol, and the service's side of it done by hand (read acks, apply, ack)."""

    def __init__(self, name: str, site: Site) -> None:
        self.name, self.site = name, site
        self.protocol = ReceiverProtocol(TOPIC, DSID, name)
        self.part: InboundPartition | None = None

    def assign(self, now_ms: int) -> None:
        """As ``ReceiverService.on_assign``: the acks read first, the newest figures they carry."""
        acked: dict[str, int] = {}
        for ack in self.site.acks:
            acked[ack.key] = max(acked.get(ack.key, -1), ack.batch_id)
        found: list[PartitionTotals | None] = [self.site.acks[-1].figures] if self.site.acks else []
        [self.part] = self.protocol.assign([0], acked, {0: found}, now_ms)

    def handle(self, offset: int, now_ms: int, stop_after: int | None = None) -> Ack | None:
        """One batch read at ``offset``; ``stop_after``: the lane is stopped once that many of its events
        went to the region (mid-batch), so no ack is written.  Answers the ack written, if any."""
        assert self.part is not None
        batch = self.site.inbound[offset]
        verdict = self.protocol.batch(self.part, offset, batch.key, batch.batch_id, len(batch.events), now_ms)
        if isinstance(verdict, Duplicate):
            return self.write(verdict.ack)
        assert isinstance(verdict, Apply)
        applied = Applied(unanswered=set(range(len(batch.events))) if verdict.maybe_half_applied else set())
        indexes = list(range(len(batch.events)))[:stop_after]
        applied.took(indexes, self.site.apply(batch.events, indexes))
        if stop_after is not None:
            return None  # Stopping: neither acked nor done
        return self.write(self.protocol.applied(verdict, applied, now_ms))

    def write(self, ack: Ack) -> Ack:
        self.site.acks.append(ack)
        self.protocol.acked(ack)
        return ack

    def commit(self) -> None:
        self.site.commit(self.protocol.commits())


def events(batch: int) -> list[EventID]:
    return [EventID("sender-member", 1, batch * 10 + i) for i in range(3)]


def site_of(batches: int) -> Site:
    return Site(inbound=[Batch(KEY, 100 + b, events(b)) for b in range(batches)])


@pytest.mark.parametrize("a_finishes", [False, True], ids=["A-gives-up-mid-batch", "A-acks-then-revokes"])
def test_a_takeover_by_revoke_applies_nothing_twice_and_goes_on_with_the_tracking_and_figures(
        a_finishes: bool) -> None:
    """A revoke in the middle of batch 2: B applies it (A's half as recoveries), never batches 0 and 1 again, and
    its acks go on from A's tracking and figures."""
    site = site_of(4)
    a = Member("A", site)
    a.assign(now_ms=1)
    a.handle(0, now_ms=2)
    a.handle(1, now_ms=3)
    a.commit()
    assert site.committed == 2
    # Batch 2: A hands two of its three events to the region when the group revokes the partition.
    if a_finishes:
        a.handle(2, now_ms=4)
    else:
        assert a.handle(2, now_ms=4, stop_after=2) is None
    site.commit(a.protocol.release([0]))
    assert site.committed == (3 if a_finishes else 2) and a.protocol.partitions == {}

    b = Member("B", site)
    b.assign(now_ms=10)
    assert b.protocol.last_batch == {KEY: 102 if a_finishes else 101}  # the tracking goes on from A's acks
    assert b.part is not None and b.part.figures.carried_from == "A"
    for offset in range(site.committed, 4):
        b.handle(offset, now_ms=11 + offset)
    b.commit()
    assert site.committed == 4

    # No event applied twice by the region's count of new applications; A's half batch came back as
    # repeats, counted recovered, so the figures over both owners count each event once.
    assert set(site.applied) == {e for b_ in range(4) for e in events(b_)}
    totals = site.acks[-1].figures.totals
    assert totals["batches"] == 4 and totals["events_applied"] == 12 and totals["events_duplicate"] == 0
    assert totals["events_recovered"] == (0 if a_finishes else 2)
    assert site.acks[-1].figures.carried["batches"] == (3 if a_finishes else 2)
    # Nothing acknowledged twice: each batch id has one ack, none of them a duplicate_batch.
    assert sorted(ack.batch_id for ack in site.acks) == [100, 101, 102, 103]
    assert not any(ack.duplicate for ack in site.acks)
    assert [ack.last_batch_id for ack in site.acks] == [100, 101, 102, 103]  # only up, across A and B


def test_a_takeover_without_revoke_commits_nothing_of_a_and_its_late_ack_moves_nothing() -> None:
    """A loses the partition with batch 1 done but uncommitted and batch 2 in hand: B answers batch 1 as a
    duplicate, applies batch 2, and A's late ack commits nothing."""
    site = site_of(3)
    a = Member("A", site)
    a.assign(now_ms=1)
    a.handle(0, now_ms=2)
    a.commit()
    a.handle(1, now_ms=3)  # acknowledged, its offset due but not committed yet
    a_part = a.part
    assert a_part is not None
    # A's session expires while its lane is in batch 2: B owns the partition before A hears of it.
    a.protocol.lost([0])
    assert a.protocol.commits() == []
    b = Member("B", site)
    b.assign(now_ms=10)
    assert site.committed == 1 and b.protocol.last_batch == {KEY: 101}
    # A's lane ends its batch after the loss: its ack is written (Kafka took it), but A's protocol moves
    # nothing for an ownership it lost: no offset due, no figures, no commit.
    verdict = a.protocol.batch(a_part, 2, KEY, 102, 3, now_ms=11)
    assert isinstance(verdict, Apply)
    applied = Applied()
    applied.took([0, 1, 2], site.apply(events(2), [0, 1, 2]))
    late = a.protocol.applied(verdict, applied, now_ms=12)
    site.acks.append(late)
    assert not a.protocol.acked(late) and a.protocol.stale_outcomes == 1
    a.commit()
    assert site.committed == 1
    # B reads batch 1 again: acknowledged by A, so answered duplicate_batch and counted nothing more.
    again = b.handle(1, now_ms=13)
    assert again is not None and again.duplicate and again.figures.totals["batches"] == 2
    assert again.figures.totals["duplicate_batches"] == 0  # read again after a crash: counted by A already
    # Batch 2: A's late ack came after B read the acks, so B applies it; the region takes nothing twice.
    b.handle(2, now_ms=14)
    b.commit()
    assert site.committed == 3
    assert all(n == 1 for e, n in site.applied.items() if e not in events(2))
    assert b.part is not None and b.part.figures.totals["events_applied"] == 9  # A's repeats: recovered
    assert b.part.figures.totals["events_recovered"] == 3


def test_a_partition_taken_again_by_the_same_member_starts_a_new_ownership() -> None:
    """A lane of the old ownership that outlived it (its close timed out) moves nothing of the new one."""
    protocol = ReceiverProtocol(TOPIC, DSID, "A")
    [old] = protocol.assign([0], {}, {}, now_ms=1)
    assert protocol.done(old, 10)
    protocol.release([0])
    [new] = protocol.assign([0], {}, {}, now_ms=2)
    assert not protocol.done(old, 11) and protocol.commits() == []
    assert protocol.done(new, 5)  # the group's committed offset may be lower: a new ownership starts clean
    assert [(tp.partition, tp.offset) for tp in protocol.commits()] == [(0, 5)]


def test_done_offsets_keep_the_newest_of_each_partition_and_are_handed_out_once() -> None:
    """The offsets due are one per partition (bounded by the partitions, not the batches), each handed out once."""
    protocol = ReceiverProtocol(TOPIC, DSID, "A")
    first, second = protocol.assign([0, 1], {}, {}, now_ms=1)
    for offset in range(1, 1001):
        protocol.done(first, offset)
    protocol.done(second, 7)
    assert sorted((tp.partition, tp.offset) for tp in protocol.commits()) == [(0, 1000), (1, 7)]
    assert protocol.commits() == []


def test_done_offsets_only_grow_within_an_ownership() -> None:
    """A done offset below the last one of the same ownership is our bug, and fails loudly."""
    protocol = ReceiverProtocol(TOPIC, DSID, "A")
    [part] = protocol.assign([0], {}, {}, now_ms=1)
    protocol.done(part, 10)
    with pytest.raises(AssertionError, match="done offset 5 after 10"):
        protocol.done(part, 5)


def test_the_last_batch_id_of_a_sender_partition_never_goes_down() -> None:
    """An older ack read later changes nothing, a batch below the last is a duplicate, and an ack moving the id back
    fails loudly."""
    protocol = ReceiverProtocol(TOPIC, DSID, "A")
    [part] = protocol.assign([0], {KEY: 50}, {}, now_ms=1)
    protocol.learn({KEY: 7})  # an older ack read later changes nothing
    assert protocol.last_batch == {KEY: 50}
    verdict = protocol.batch(part, 0, KEY, 40, 1, now_ms=2)
    assert isinstance(verdict, Duplicate) and verdict.ack.last_batch_id == 50
    broken = Ack(part, 0, KEY, 51, part.figures, 49, False, 0, None, [])
    with pytest.raises(AssertionError, match="moves back from 50 to 49"):
        protocol.acked(broken)


def test_the_first_batch_after_a_takeover_may_be_half_applied_and_only_that_one() -> None:
    """Only the first batch past the figures' offset may have been half applied by the owner before."""
    protocol = ReceiverProtocol(TOPIC, DSID, "B")
    carried = PartitionTotals(0, DSID, offset=4, member="A")
    [part] = protocol.assign([0], {}, {0: [carried, None]}, now_ms=1)
    old = protocol.batch(part, 3, KEY, 1, 1, now_ms=2)  # read again: counted by A, applied by A
    assert isinstance(old, Apply) and not old.new and not old.maybe_half_applied
    first = protocol.batch(part, 5, KEY, 2, 1, now_ms=3)
    assert isinstance(first, Apply) and first.new and first.maybe_half_applied
    second = protocol.batch(part, 6, KEY, 3, 1, now_ms=4)
    assert isinstance(second, Apply) and second.new and not second.maybe_half_applied


def test_a_batch_refused_whole_is_counted_once() -> None:
    """A refused batch already counted by the figures is not counted again; a new one is, and clears the half-
    applied mark."""
    protocol = ReceiverProtocol(TOPIC, DSID, "A")
    [part] = protocol.assign([0], {}, {0: [PartitionTotals(0, DSID, offset=2, member="Z")]}, now_ms=1)
    assert protocol.refused(part, 2, now_ms=2, rejected_batches=1) is None  # counted by whoever refused it first
    figures = protocol.refused(part, 3, now_ms=3, rejected_batches=1, dead_lettered=1)
    assert figures is not None and figures.totals["rejected_batches"] == 1 and not part.maybe_half_applied
    protocol.done(part, 4, figures)
    assert part.figures is figures


# --- retry loops: an error that is not retriable is not tried again ------------------------------------


def test_failure_actions_read_the_retriable_flag() -> None:
    """Retry, alert or refuse is read from the error's retriable flag (and 401/403), never from its name."""
    assert failure_action(BrokerUnavailable("away")) is FailureAction.RETRY
    assert failure_action(RegionError(503, {"retriable": True})) is FailureAction.RETRY
    assert failure_action(RegionError(401, {"error": "Unauthorized"})) is FailureAction.ALERT
    assert failure_action(RegionError(400, {"error": "InvalidEvent"})) is FailureAction.REFUSE
    assert failure_action(KafkaFatal("fatal")) is FailureAction.REFUSE


class _Client:
    """A region client whose every call fails with ``error``."""

    def __init__(self, error: SluiceError) -> None:
        self.error = error
        self.calls: list[int] = []

    def apply_batch(self, url: str, record: bytes) -> Any:
        self.calls.append(len(record))
        raise self.error


def _routing(tmp_path: Any, client: _Client) -> OwnerRouting:
    """A receiver's routing (routing.py) of a site file's receiver section, its requests ``client``'s."""
    from test_lifecycle import _site

    from sluice.core.config import load_config

    cfg = load_config(_site(tmp_path))
    receiver = ReceiverService(cfg)
    routing = OwnerRouting(cfg, client, None, None,  # type: ignore[arg-type]
                           refresh=lambda: None, count=receiver._count, alert_unauthorized=receiver._alert_unauthorized)
    routing._record = lambda batch, value, part, traces: bytes(len(part))  # type: ignore[method-assign]
    return routing


def test_applying_a_batch_does_not_retry_an_error_that_is_not_retriable(tmp_path: Any) -> None:
    """``_settle``: the request is halved until each event stands alone, each refused; none sent twice."""
    client = _Client(KafkaFatal("the record cannot be written"))
    routing = _routing(tmp_path, client)
    batch = SimpleNamespace(batch_id=1, source_dsid=1, bodies=[b"?", b"?"])
    applied = Applied()
    buckets: list[tuple[str, int] | None] = [("orders", 0)] * 2
    routing._settle(batch, b"", "http://owner", [0, 1], buckets, [None, None], applied,  # type: ignore[arg-type]
                     threading.Event())
    assert client.calls == [2, 1, 1] and sorted(applied.exceptions) == [0, 1]
    assert {e["exception_class"] for e in applied.exceptions.values()} == {"KafkaFatal"}


def test_applying_a_batch_retries_a_retriable_error(tmp_path: Any) -> None:
    """The same events go again (until stopped), noted as possibly applied unanswered."""
    client = _Client(BrokerUnavailable("the owner is away"))
    routing = _routing(tmp_path, client)
    batch = SimpleNamespace(batch_id=1, source_dsid=1, bodies=[b"?", b"?"])
    applied = Applied()
    stop = threading.Event()

    def owners(batch: Any, indexes: list[int], buckets: Any, stop_: threading.Event) -> dict[str, list[int]]:
        stop.set()  # routed again for the next attempt (a retry decided): then stopped
        return {"http://owner": indexes}

    routing._owners = owners  # type: ignore[method-assign]
    with pytest.raises(Stopping):
        buckets: list[tuple[str, int] | None] = [("orders", 0)] * 2
        routing._settle(batch, b"", "http://owner", [0, 1], buckets, [None, None], applied,  # type: ignore[arg-type]
                         stop)
    assert client.calls == [2] and applied.unanswered == {0, 1} and applied.exceptions == {}


class _Consumer:
    def assign(self, _tps: Any) -> None: ...

    def resume(self, _tps: Any) -> None: ...

    def commit(self, offsets: Any, asynchronous: bool = True) -> None: ...


@pytest.mark.parametrize("retriable", [False, True])
def test_reading_the_acks_on_assignment_retries_only_a_retriable_error(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, retriable: bool) -> None:
    from test_lifecycle import _site

    from sluice.core.config import load_config

    monkeypatch.setattr(receiver_module, "READ_RETRY_BACKOFF_S", 0.0)
    receiver = ReceiverService(load_config(_site(tmp_path)))
    reads: list[int] = []

    def read_acks(partitions: list[TopicPartition]) -> tuple[dict[str, int], dict[int, PartitionTotals]]:
        reads.append(len(partitions))
        if len(reads) == 1:
            raise BrokerUnavailable("the leader moved") if retriable else KafkaFatal("fatal")
        return {KEY: 3}, {}

    receiver._read_acks = read_acks  # type: ignore[method-assign]
    receiver._read_published_figures = dict  # type: ignore[method-assign,assignment]
    consumer = _Consumer()
    partitions = [TopicPartition(receiver.inbound, 0)]
    if not retriable:
        with pytest.raises(KafkaFatal):
            receiver.on_assign(consumer, partitions)  # type: ignore[arg-type]
        assert reads == [1] and not receiver.assigned
        return
    receiver.on_assign(consumer, partitions)  # type: ignore[arg-type]
    try:
        assert reads == [1, 1] and receiver.assigned and receiver._protocol.last_batch == {KEY: 3}
    finally:
        receiver.on_revoke(consumer, partitions)  # type: ignore[arg-type]
