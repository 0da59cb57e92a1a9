"""The region engine's group thread on the partition loop (core/loop.py), without a broker: the group's
callbacks reach ownership.py and its actions are performed (loads queued under fresh epochs, claims
published, a revoked bucket kept, a lost one dropped with the generation), and a dying engine thread
crashes the engine once, telling its owner, with the group loop ending on it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sluice.core.codec import get_codec
from sluice.core.errors import InvalidRequest
from sluice.core.kafka import TopicPartition
from sluice.core.lifecycle import ServiceState
from sluice.region import engine as engine_module
from sluice.region import membership as membership_module
from sluice.region.engine import BucketStatus, RegionEngine
from sluice.region.state import BucketState

TOPIC = "a.region.orders"


class GroupConsumer:
    """What the group thread asks of its consumer; records the assignment it is given."""

    def __init__(self) -> None:
        self.assigned: set[int] = set()
        self.paused: set[int] = set()
        self.generation = 0
        self.closed = threading.Event()

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.topics, self.callbacks = topics, callbacks

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned |= {tp.partition for tp in partitions}

    def incremental_unassign(self, partitions: list[TopicPartition]) -> None:
        self.assigned -= {tp.partition for tp in partitions}

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {tp.partition for tp in partitions}

    def consumer_group_metadata(self) -> bytes:
        self.generation += 1
        return b"generation-%d" % self.generation

    def poll(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        self.closed.set()


def make_engine(claims: list[list[tuple[str, int, int]]], **kwargs: Any) -> RegionEngine:
    return RegionEngine(site="a", dsid=1, member_id="m1", client_id="c1", kafka_settings={}, group_settings={},
                        producer_settings={}, group_id="a.region", regions={"orders": 4},
                        changelog_topics={"orders": TOPIC}, targets={"orders": []}, codec=get_codec(),
                        on_ownership=claims.append, **kwargs)


def tps(*partitions: int) -> list[TopicPartition]:
    return [TopicPartition(TOPIC, p) for p in partitions]


def test_assign_revoke_and_lose_reach_the_protocol_and_its_actions_are_performed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    claims: list[list[tuple[str, int, int]]] = []
    engine = make_engine(claims)
    engine._high_reader = object()  # type: ignore[assignment]
    group = GroupConsumer()
    engine.on_assign(group, tps(0, 1))  # type: ignore[arg-type]
    assert group.assigned == group.paused == {0, 1} and engine.assigned_once.is_set()
    assert [engine._loads.get_nowait() for _ in range(2)] == [("orders", 0, 1), ("orders", 1, 2)]
    assert [(r, b) for r, b, _ in claims[-1]] == [("orders", 0), ("orders", 1)]
    assert engine._ownership.membership == b"generation-1"
    # Bucket 0 loaded (READY, its changelog ending at 7 where its last window left it), bucket 1 still loading.
    with engine._lock:
        ob = engine._ownership.loaded("orders", 0, 1, BucketState("orders", 0, 1, "m1"), 5, 7, 0)
        assert ob is not None and engine._ownership.answering("orders", 0, 1, 7)
    monkeypatch.setattr(membership_module, "partition_end", lambda *_, **__: (0, 7, 7))
    engine.on_revoke(group, tps(0, 1))  # type: ignore[arg-type]
    assert group.assigned == set() and claims[-1] == [] and engine.stats["buckets_revoked"] == 2
    assert set(engine._parked) == {("orders", 0)}  # the READY one is kept; the loading one is not
    assert engine._ownership.membership is None  # nothing owned: nothing to commit under
    # Assigned 2 alone: the kept bucket 0 is given up (no standby keeper here), 2 loads under epoch 3.
    engine.on_assign(group, tps(2))  # type: ignore[arg-type]
    assert engine._loads.get_nowait() == ("orders", 2, 3) and not engine._parked
    assert engine.owned_buckets() == {"orders": [(2, BucketStatus.LOADING.value)]}
    engine.on_lost(group, tps(2))  # type: ignore[arg-type]
    assert engine.owned_buckets() == {} and claims[-1] == [] and engine._ownership.membership is None


class Reader:
    def close(self) -> None:
        pass


class Producer:
    def close(self, *_: Any) -> None:
        pass


def test_a_dying_loader_crashes_the_engine_once_and_ends_the_group_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    claims: list[list[tuple[str, int, int]]] = []
    crashes: list[BaseException] = []
    engine = make_engine(claims, on_crash=crashes.append)
    group = GroupConsumer()
    consumers = iter([Reader(), Reader(), group])  # the offsets reader, the watermark reader, the group
    monkeypatch.setattr(RegionEngine, "_new_producer", lambda self: Producer())
    monkeypatch.setattr(RegionEngine, "_new_readers", lambda self: (Reader(), Reader()))
    monkeypatch.setattr(engine_module, "make_consumer", lambda *_, **__: next(consumers))
    broken = InvalidRequest("bucket", 0, "a load that cannot succeed (test)")

    def load(*_: Any) -> None:
        raise broken

    monkeypatch.setattr(engine, "_load", load)
    engine.start()
    try:
        assert engine.state is ServiceState.RUNNING
        engine._loads.put(("orders", 0, 1))
        assert group.closed.wait(60), "the group loop did not end on the loader's crash"
        assert engine.state is ServiceState.CRASHED and engine.crash is broken
        assert crashes == [broken]
        assert group.topics == [TOPIC] and set(group.callbacks) == {"on_assign", "on_revoke", "on_lost"}
    finally:
        engine.stop(deadline_s=10)
    assert engine.state is ServiceState.CRASHED and crashes == [broken]
