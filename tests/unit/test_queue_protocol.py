"""The queue primary's protocol (core/queueprotocol.py) replayed without a broker: primary A holds two
partitions, B takes one over in the middle of a batch, and nothing is lost, what may have been offered is
flagged, commits never go back across the two members, batch ids only grow; and the invariants the
protocol asserts (heads and commits only move forward) fail loudly when broken."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sluice.core.asyncevent import AsyncEvent
from sluice.core.batching import BatchPolicy
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import entry_event_body
from sluice.core.queueprotocol import Offer, OfferDone, QueueProtocol, Removal

TOPIC = "a.queue.q"
POLICY = BatchPolicy(batch_size=3, batch_time_interval_ms=5)


def event(partition: int, offset: int, duplicate_below: int = 0) -> AsyncEvent:
    entry = EntryEvent(region="orders", key=f"k{partition}-{offset}", operation=Operation.CREATE,
                       value=b'{"n": %d}' % offset, event_id=EventID("m", partition, offset),
                       version=VersionTag(1, 1_700_000_000_000, offset, "m"), origin_dsid=1, bucket=partition,
                       event_time=1_700_000_000_000)
    # As the loop reads a record (queueloop._read): below the assignment's end offset, flagged.
    return AsyncEvent.of_body(entry_event_body(entry), "q", partition, offset, offset < duplicate_below)


@dataclass
class Broker:
    """What the trace needs of Kafka: each partition's records and its group's committed offset.  Every
    commit, whoever makes it, is checked to move forward."""

    ends: dict[int, int]
    committed: dict[int, int] = field(default_factory=dict)
    removals: list[tuple[str, int, int, int]] = field(default_factory=list)  # (member, partition, batch, commit)

    def commit(self, offsets: list[tuple[int, int]]) -> None:
        for partition, offset in offsets:
            assert offset >= self.committed.get(partition, 0), f"[{partition}] committed back to {offset}"
            self.committed[partition] = offset


class Member:
    """One primary: its protocol, and the loop's side of it done by hand (read, offer, remove, commit)."""

    def __init__(self, name: str, broker: Broker) -> None:
        self.name, self.broker = name, broker
        self.protocol = QueueProtocol(TOPIC, POLICY)
        self.offered: dict[int, Offer] = {}  # partition -> the offer a worker holds
        self.delivered: list[tuple[int, int, bool]] = []  # (partition, offset, possible_duplicate)

    def assign(self, partitions: list[int], dispatched_before: set[int] | None, first_batch_id: int) -> None:
        self.protocol.assign(partitions, {p: self.broker.ends[p] for p in partitions}, dispatched_before,
                             {p: first_batch_id for p in partitions})

    def read(self, partition: int) -> None:
        """Every record of the partition from its committed offset, as one poll batch."""
        part = self.protocol.partitions[partition]
        for offset in range(self.broker.committed.get(partition, 0), self.broker.ends[partition]):
            part.batcher.add(event(partition, offset, part.duplicate_below), 0)

    def turn(self, now_ms: int) -> None:
        for action in self.protocol.ready(now_ms, running=True):
            if isinstance(action, Offer):
                assert action.part.tp.partition not in self.offered
                self.offered[action.part.tp.partition] = action
            else:
                self.remove(action)

    def finish(self, partition: int, accepted: int, attempts: int = 1) -> None:
        """The worker's outcome for the partition's offer: the oldest ``accepted`` batches delivered."""
        offer = self.offered.pop(partition)
        for batch in offer.batches[:accepted]:
            self.delivered += [(e.partition, e.offset, e.possible_duplicate) for e in batch.events]
        for removal in self.protocol.offer_done(OfferDone(partition, offer.batches, accepted, attempts, 0)):
            self.remove(removal)

    def remove(self, removal: Removal) -> None:
        """The removal record is written and acknowledged at once; the turn's commit follows."""
        p = removal.part.tp.partition
        self.broker.removals.append((self.name, p, removal.batch.batch_id, removal.commit))
        self.protocol.removed(p, removal.commit, ok=True)
        self.broker.commit([(tp.partition, tp.offset) for tp in self.protocol.commits()])

    def revoke(self, partitions: list[int], worker: tuple[int, int] | None) -> None:
        """The group takes ``partitions``; the worker holding one of them ends with (accepted, attempts)."""
        revoked = self.protocol.revoking(partitions)
        for part in revoked:
            assert self.protocol.must_stop_offering(part, running=True)
        if worker is not None:
            for p in partitions:
                if p in self.offered:
                    self.finish(p, *worker)
        self.broker.commit([(tp.partition, tp.offset) for tp in self.protocol.release(revoked)])


def batch_ids(broker: Broker, partition: int) -> list[int]:
    return [b for _, p, b, _ in broker.removals if p == partition]


@pytest.mark.parametrize("a_finishes", [False, True], ids=["A-gives-up-mid-batch", "A-delivers-then-revokes"])
def test_a_takeover_mid_batch_loses_nothing_and_flags_what_may_have_been_offered(a_finishes: bool) -> None:
    broker = Broker(ends={0: 6, 1: 6})
    a = Member("A", broker)
    a.assign([0, 1], dispatched_before=set(), first_batch_id=100)
    assert [a.protocol.partitions[p].duplicate_below for p in (0, 1)] == [0, 0]  # nobody dispatched them
    a.read(0)
    a.read(1)
    a.turn(now_ms=10)
    assert sorted(a.offered) == [0, 1]
    # Partition 0: both batches delivered; the head and the commit follow each removal.
    a.finish(0, accepted=1)
    a.turn(now_ms=20)
    a.finish(0, accepted=1)
    assert broker.committed[0] == 6 and a.protocol.partitions[0].head == 6
    # Partition 1: its first batch is out when B takes the partition over.
    in_hand = a.offered[1].batches[0]
    assert [e.offset for e in in_hand.events] == [0, 1, 2]
    a.revoke([1], worker=(1, 1) if a_finishes else (0, 3))
    assert 1 not in a.protocol.partitions and 0 in a.protocol.partitions
    assert broker.committed.get(1, 0) == (3 if a_finishes else 0)

    b = Member("B", broker)
    b.assign([1], dispatched_before={0, 1}, first_batch_id=200)
    assert b.protocol.partitions[1].duplicate_below == 6  # all A may have offered comes again flagged
    assert b.protocol.stats["takeovers"] == 1
    b.read(1)
    b.turn(now_ms=30)
    b.finish(1, accepted=1)
    if not a_finishes:
        b.turn(now_ms=40)
        b.finish(1, accepted=1)
    assert broker.committed == {0: 6, 1: 6}

    # Every record of partition 1 was delivered; B's copies all flagged possibleDuplicate.
    delivered_1 = [(offset, dup) for member in (a, b) for p, offset, dup in member.delivered if p == 1]
    assert sorted({offset for offset, _ in delivered_1}) == list(range(6))
    assert all(dup for offset, dup in [(o, d) for p, o, d in b.delivered])
    # Batch ids of a partition only grow, across the two primaries.
    ids = batch_ids(broker, 1)
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and ids[-1] >= 200


def test_a_lost_partition_commits_nothing_and_its_late_outcome_is_dropped() -> None:
    broker = Broker(ends={0: 3})
    a = Member("A", broker)
    a.assign([0], dispatched_before=set(), first_batch_id=1)
    a.read(0)
    a.turn(now_ms=10)
    a.protocol.lost([0])
    a.finish(0, accepted=1)  # the worker ends after the loss: nothing to remove, nothing to commit
    assert broker.removals == [] and broker.committed == {}


def test_batch_ids_never_go_back_on_a_partition_taken_again() -> None:
    broker = Broker(ends={0: 3})
    a = Member("A", broker)
    a.assign([0], dispatched_before=set(), first_batch_id=50)
    a.read(0)
    a.turn(now_ms=10)
    a.finish(0, accepted=1)
    a.revoke([0], worker=None)
    a.assign([0], dispatched_before={0}, first_batch_id=7)  # a clock that went back
    assert a.protocol.partitions[0].batcher.next_batch_id == 51


def test_the_head_only_moves_forward() -> None:
    protocol = QueueProtocol(TOPIC, POLICY)
    protocol.assign([0], {0: 0}, set(), {0: 1})
    assert protocol.removed(0, 5, ok=True)
    with pytest.raises(AssertionError, match="head moves back"):
        protocol.removed(0, 3, ok=True)


def test_commits_only_move_forward() -> None:
    protocol = QueueProtocol(TOPIC, POLICY)
    protocol.assign([0], {0: 0}, set(), {0: 1})
    protocol.removed(0, 5, ok=True)
    assert [(tp.partition, tp.offset) for tp in protocol.commits()] == [(0, 5)]
    assert protocol.commits() == []  # nothing new is due: nothing committed twice
    with pytest.raises(AssertionError, match="commit moves back"):
        protocol.committed_at(0, 4)


def test_a_failed_removal_moves_nothing() -> None:
    protocol = QueueProtocol(TOPIC, POLICY)
    protocol.assign([0], {0: 0}, set(), {0: 1})
    assert not protocol.removed(0, 5, ok=False)
    assert protocol.partitions[0].head == -1 and protocol.commits() == []


def test_nothing_is_offered_while_the_queue_is_not_running() -> None:
    broker = Broker(ends={0: 3})
    a = Member("A", broker)
    a.assign([0], dispatched_before=set(), first_batch_id=1)
    a.read(0)
    assert a.protocol.ready(10, running=False) == []
    assert not a.protocol.partitions[0].in_flight
