"""Region bucket ownership (services/region/ownership.py) replayed without a broker: instance A owns buckets
and is in the middle of a load or a window when B takes them over (revoked then assigned; lost without a
revocation; A assigned again after it lost them, its old epoch's facts dropped), and the actions each
member takes are the ones that keep one answering owner per bucket; and each invariant the protocol
asserts (epochs only grow; loads, ends and checkpoints only move forward) fails loudly when broken."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sluice.core.events import EventID
from sluice.region.ownership import (
    BucketStatus,
    Fence,
    Load,
    OfferStandby,
    Park,
    Parked,
    PublishClaims,
    RegionOwnership,
)
from sluice.region.state import BucketState, Op

FENCE_AFTER_S = 1.0
B0, B1 = ("orders", 0), ("orders", 1)


@dataclass
class Changelog:
    """What the trace needs of Kafka for one bucket: its end, the group's committed checkpoint, and
    whether a transaction is open on it.  Every commit, whoever makes it, is checked to move forward."""

    high: int = 0
    committed: int = -1
    open_from: int | None = None
    commits: list[tuple[str, int]] = field(default_factory=list)

    def commit(self, member: str, checkpoint: int) -> None:
        assert checkpoint >= self.committed, f"committed back from {self.committed} to {checkpoint}"
        self.committed = checkpoint
        self.commits.append((member, checkpoint))


class Member:
    """One region instance: its protocol, and the engine's side done by hand (load, write, revoke)."""

    def __init__(self, name: str, logs: dict[tuple[str, int], Changelog]) -> None:
        self.name, self.logs = name, logs
        self.protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
        self.generation = 0
        self.published: list[list[tuple[str, int, int]]] = []

    def perform(self, actions: list) -> list:
        for action in actions:
            if isinstance(action, PublishClaims):
                self.published.append(action.claims)
        return actions

    def assign(self, keys: list[tuple[str, int]], now_ms: int) -> list:
        self.generation += 1
        return self.perform(self.protocol.assign(keys, now_ms, b"gen%d" % self.generation))

    def epoch(self, key: tuple[str, int]) -> int:
        return self.protocol.owned[key].epoch

    def load(self, key: tuple[str, int], epoch: int, stop_at: int | None = None) -> bool:
        """The load of ``epoch``: the changelog's decided bounds, the kept state or a read to its end
        (stopping at ``stop_at``: mid-load), then READY.  False when the epoch's facts were dropped."""
        log = self.logs[key]
        assert log.open_from is None, "the load waits for the open transaction first"
        resumed = self.protocol.resume_parked(*key, epoch, 0, log.high, log.committed, True)
        if resumed is None:
            return False
        if resumed[0]:
            return True
        self.protocol.load_reading(*key, epoch, 0, log.high, now=0.0)
        state = BucketState(key[0], key[1], 1, self.name)
        for position in range(0, log.high if stop_at is None else stop_at):
            self.protocol.load_progress(*key, epoch, position + 1)
        if stop_at is not None:
            return True
        ob = self.protocol.loaded(*key, epoch, state, log.committed, log.high, 0)
        return ob is not None and self.protocol.answering(*key, epoch, log.high)

    def write(self, key: tuple[str, int], records: int) -> tuple[tuple[str, int, int], int, int]:
        """Records of a READY bucket into an open window: (slot, checkpoint, last offset)."""
        ob = self.protocol.owned[key]
        assert ob.status is BucketStatus.READY and ob.state is not None
        for i in range(records):
            ob.state.prepare(Op.PUT, f"k{i}", b"v", EventID(self.name, key[1], ob.next_sequence), 1_000)
            ob.next_sequence += 1
        log = self.logs[key]
        log.open_from = log.high
        log.high += records
        return (key[0], key[1], ob.epoch), ob.checkpoint, log.high - 1

    def commit_window(self, slot: tuple[str, int, int], checkpoint: int, last: int) -> bool:
        """The committer closes the window: stale slots are not written; the rest commit (offsets,
        then the marker).  True when it was written."""
        if slot in self.protocol.stale([slot]):
            return False
        log = self.logs[slot[:2]]
        log.commit(self.name, checkpoint)
        log.high, log.open_from = log.high + 1, None
        self.protocol.window_committed({slot: checkpoint}, {slot: last})
        return True

    def revoke(self, keys: list[tuple[str, int]], windows_committed: bool) -> list:
        self.generation += 1
        ready = self.protocol.revoking(keys, b"gen%d" % self.generation)
        assert all(self.protocol.owned[k].status is BucketStatus.REVOKING for k in keys if k in self.protocol.owned)
        _, actions = self.protocol.revoked(keys, ready, windows_committed)
        for action in self.perform(actions):
            if isinstance(action, Park):
                ob, log = action.ob, self.logs[(action.ob.region, action.ob.bucket)]
                if log.open_from is None and log.high == ob.end:
                    assert ob.state is not None
                    self.protocol.park((ob.region, ob.bucket),
                                       Parked(ob.state, ob.checkpoint, ob.next_sequence, 0, log.high))
        return actions


def members() -> tuple[Member, Member, dict[tuple[str, int], Changelog]]:
    logs = {B0: Changelog(high=5, committed=5), B1: Changelog(high=8, committed=8)}
    return Member("A", logs), Member("B", logs), logs


def test_revoke_then_assign_mid_window_commits_a_s_window_before_b_loads_past_it() -> None:
    a, b, logs = members()
    actions = a.assign([B0, B1], now_ms=100)
    assert [x for x in actions if isinstance(x, Load)] == [Load("orders", 0, 1), Load("orders", 1, 2)]
    assert a.published == [[("orders", 0, 100), ("orders", 1, 100)]]
    assert a.load(B0, 1) and a.load(B1, 2)
    assert a.protocol.owned[B0].end == 5 and a.protocol.owned[B0].checkpoint == 5
    # Mid-window: A's records for B0 are out when the group starts moving B0 to B.
    slot, checkpoint, last = a.write(B0, records=3)
    ready = a.protocol.revoking([B0], b"gen2")
    assert ready == {B0} and a.protocol.owned[B0].status is BucketStatus.REVOKING
    assert a.protocol.membership == b"gen2"  # the revoked window commits in the new generation
    # on_revoke waits for the window: it is still A's ownership, so it is written, and the end moves past it.
    assert a.commit_window(slot, checkpoint, last)
    assert a.protocol.owned[B0].end == last + 2 == logs[B0].high
    revoked, actions = a.protocol.revoked([B0], ready, windows_committed=True)
    assert [ob.bucket for ob in revoked] == [0]
    assert [type(x) for x in actions] == [PublishClaims, Park] and actions[0].claims == [("orders", 1, 100)]
    assert B0 not in a.protocol.owned and a.protocol.membership == b"gen2"  # B1 still owned
    # B is assigned B0 after the revocation: nothing is open, its load reads what A committed.
    (_, load) = b.assign([B0], now_ms=200)
    assert load == Load("orders", 0, 1)
    assert b.load(B0, load.epoch)
    assert b.protocol.owned[B0].state is not None and b.protocol.owned[B0].end == logs[B0].high
    assert logs[B0].commits == [("A", 5)]


def test_a_bucket_revoked_and_given_back_unmoved_is_kept_and_one_not_given_back_goes_to_standby() -> None:
    a, _, logs = members()
    a.assign([B0, B1], now_ms=100)
    assert a.load(B0, 1) and a.load(B1, 2)
    actions = a.revoke([B0, B1], windows_committed=True)
    assert sorted(x.ob.bucket for x in actions if isinstance(x, Park)) == [0, 1]
    assert set(a.protocol.parked) == {B0, B1} and a.protocol.membership is None
    actions = a.assign([B0], now_ms=300)
    assert [type(x) for x in actions] == [OfferStandby, PublishClaims, Load]
    offered = actions[0]
    assert (offered.region, offered.bucket, offered.high) == ("orders", 1, logs[B1].high)
    # B0's changelog did not move: the kept state answers at once, under the new epoch.
    kept_state = a.protocol.parked[B0].state
    assert a.load(B0, actions[2].epoch)
    assert a.protocol.owned[B0].status is BucketStatus.READY and a.protocol.owned[B0].state is kept_state


def test_a_revocation_whose_window_did_not_commit_keeps_nothing() -> None:
    a, _, _ = members()
    a.assign([B0], now_ms=100)
    assert a.load(B0, 1)
    actions = a.revoke([B0], windows_committed=False)
    assert not any(isinstance(x, Park) for x in actions) and not a.protocol.parked


def test_a_bucket_revoked_before_its_load_finished_is_not_kept() -> None:
    """Read to its end, but its re-enqueued records not yet committed (not READY): loaded again."""
    a, _, logs = members()
    a.assign([B0], now_ms=100)
    assert a.protocol.loaded("orders", 0, 1, BucketState("orders", 0, 1, "A"), 5, logs[B0].high, 0) is not None
    actions = a.revoke([B0], windows_committed=True)
    assert not any(isinstance(x, Park) for x in actions) and not a.protocol.parked


def test_a_bucket_lost_mid_load_drops_the_old_epoch_and_b_fences_a_s_open_transaction() -> None:
    a, b, logs = members()
    a.assign([B0, B1], now_ms=100)
    assert a.load(B0, 1)
    a.load(B1, 2, stop_at=3)  # mid-load of B1
    assert a.protocol.owned[B1].status is BucketStatus.LOADING and a.protocol.owned[B1].load_position == 3
    slot, checkpoint, last = a.write(B0, records=2)  # mid-window of B0: a transaction open on its changelog
    a.perform(a.protocol.lost([B0, B1]))  # session expired: no revocation
    assert a.published[-1] == [] and a.protocol.membership is None and not a.protocol.parked
    # A's loader goes on reading B1 and finishes: every fact of the ended epoch is dropped.
    a.protocol.load_progress("orders", 1, 2, 8)
    assert a.protocol.loaded("orders", 1, 2, BucketState("orders", 1, 1, "A"), 8, 8, 0) is None
    assert not a.protocol.answering("orders", 1, 2, 8)
    assert a.protocol.resume_parked("orders", 1, 2, 0, 8, 8, True) is None
    # A's window for B0 is not written under the lost ownership: its requests fail.
    assert a.protocol.stale([slot]) == {slot}
    assert not a.commit_window(slot, checkpoint, last)
    # B is assigned both; B0's load finds A's transaction open and, past fence_after_s, fences once.
    actions = b.assign([B0, B1], now_ms=500)
    e0 = b.epoch(B0)
    assert b.protocol.load_blocked("orders", 0, e0, waited_s=0.5, fenced=False) is None
    fence = b.protocol.load_blocked("orders", 0, e0, waited_s=FENCE_AFTER_S, fenced=False)
    assert fence == Fence("orders", 0, since_ms=500)
    assert b.protocol.load_blocked("orders", 0, e0, waited_s=5.0, fenced=True) is None
    logs[B0].open_from = None  # the fence aborted A's transaction (its marker: one offset)
    logs[B0].high += 1
    assert b.load(B0, e0) and b.load(B1, b.epoch(B1))
    assert b.protocol.owned[B0].checkpoint == 5 and b.protocol.owned[B0].end == logs[B0].high
    assert [type(x) for x in actions] == [PublishClaims, Load, Load]


def test_a_assigned_again_after_losing_its_buckets_answers_only_under_its_new_epoch() -> None:
    a, b, logs = members()
    a.assign([B0], now_ms=100)
    old = a.epoch(B0)
    assert a.load(B0, old)
    slot, checkpoint, last = a.write(B0, records=1)
    a.protocol.lost([B0])
    # B owned it meanwhile and committed a window; then A is assigned B0 again.
    b.assign([B0], now_ms=200)
    logs[B0].open_from, logs[B0].high = None, logs[B0].high + 1  # A's transaction aborted
    assert b.load(B0, b.epoch(B0))
    b_slot, b_checkpoint, b_last = b.write(B0, records=2)
    assert b.commit_window(b_slot, b_checkpoint, b_last)
    b.revoke([B0], windows_committed=True)
    a.assign([B0], now_ms=900)
    new = a.epoch(B0)
    assert new > old
    # A's old epoch comes back (a late loader, a late window): fenced off; nothing of it answers.
    assert a.protocol.current("orders", 0, old) is None
    assert a.protocol.bucket_failed("orders", 0, old) is None
    assert a.protocol.loaded("orders", 0, old, BucketState("orders", 0, 1, "A"), 0, 0, 0) is None
    assert not a.commit_window(slot, checkpoint, last)
    # Its new epoch loads what B committed.
    assert a.load(B0, new)
    assert a.protocol.owned[B0].end == logs[B0].high and [m for m, _ in logs[B0].commits] == ["B"]


def test_a_failed_window_reloads_its_bucket_under_a_new_epoch_and_the_old_load_is_dropped() -> None:
    a, _, logs = members()
    a.assign([B0], now_ms=100)
    assert a.load(B0, 1)
    slot, _, _ = a.write(B0, records=2)
    a.protocol.window_failed([slot])
    logs[B0].open_from, logs[B0].high = None, logs[B0].high + 1  # aborted
    assert a.protocol.owned[B0].dirty
    load = a.protocol.bucket_failed("orders", 0, slot[2])
    assert load == Load("orders", 0, 2) and a.protocol.owned[B0].status is BucketStatus.LOADING
    assert a.protocol.bucket_failed("orders", 0) is None  # not READY: one reload at a time
    assert a.protocol.stale([slot]) == {slot}
    assert a.load(B0, load.epoch) and a.protocol.owned[B0].end == logs[B0].high
    # A dirty bucket is not kept when it is revoked, even with its windows committed.
    assert not any(isinstance(x, Park) for x in a.revoke([B0], windows_committed=True))


# --- invariants: each one trips when broken ---------------------------------------------------------


def test_an_epoch_that_goes_back_trips() -> None:
    protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
    protocol.assign([B0], 0, b"g1")
    protocol.lost([B0])
    protocol.epoch = 0  # a bug resetting the counter
    with pytest.raises(AssertionError, match=r"orders\[0\]: the epoch goes back from 1 to 1"):
        protocol.assign([B0], 0, b"g2")


def test_a_load_that_moves_back_trips() -> None:
    protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
    protocol.assign([B0], 0, b"g1")
    protocol.load_reading("orders", 0, 1, 0, 10, 0.0)
    protocol.load_progress("orders", 0, 1, 6)
    with pytest.raises(AssertionError, match="the load moves back from 6 to 4"):
        protocol.load_progress("orders", 0, 1, 4)


def test_an_end_that_moves_back_trips() -> None:
    protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
    protocol.assign([B0], 0, b"g1")
    protocol.loaded("orders", 0, 1, BucketState("orders", 0, 1, "A"), 5, 10, 0)
    protocol.window_committed({("orders", 0, 1): 5}, {("orders", 0, 1): 12})
    with pytest.raises(AssertionError, match="the end moves back from 14 to 11"):
        protocol.window_committed({("orders", 0, 1): 5}, {("orders", 0, 1): 9})


def test_a_checkpoint_that_moves_back_while_owned_trips() -> None:
    protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
    protocol.assign([B0], 0, b"g1")
    protocol.loaded("orders", 0, 1, BucketState("orders", 0, 1, "A"), 20, 30, 0)
    protocol.answering("orders", 0, 1, 30)
    protocol.window_committed({("orders", 0, 1): 20}, {("orders", 0, 1): 31})
    with pytest.raises(AssertionError, match="a window commits 15, below 20 committed before"):
        protocol.window_committed({("orders", 0, 1): 15}, {})
    # A reload within the same tenure that reads an older checkpoint trips too.
    load = protocol.bucket_failed("orders", 0, 1)
    assert load is not None
    with pytest.raises(AssertionError, match="the checkpoint moves back from 20 to 10 while owned here"):
        protocol.loaded("orders", 0, load.epoch, BucketState("orders", 0, 1, "A"), 10, 40, 0)


def test_a_new_tenure_starts_its_checkpoints_afresh() -> None:
    """Another owner in between may have committed anything the group accepted: the floor is per tenure."""
    protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
    protocol.assign([B0], 0, b"g1")
    protocol.loaded("orders", 0, 1, BucketState("orders", 0, 1, "A"), 20, 30, 0)
    protocol.window_committed({("orders", 0, 1): 20}, {})
    protocol.lost([B0])
    protocol.assign([B0], 0, b"g2")
    assert protocol.loaded("orders", 0, 2, BucketState("orders", 0, 1, "A"), 10, 40, 0) is not None


def test_a_bucket_answers_only_once_loaded() -> None:
    protocol = RegionOwnership(fence_after_s=FENCE_AFTER_S)
    protocol.assign([B0], 0, b"g1")
    with pytest.raises(AssertionError, match=r"orders\[0\] answers before it is loaded"):
        protocol.answering("orders", 0, 1, 0)
