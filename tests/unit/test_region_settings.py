"""``region_service`` settings act where the region service and its engine use them.

The service is started with its Kafka-facing parts (the topic check, the engine, the owner directory)
replaced by stand-ins that keep what they were given; the engine's own loops are driven with a stand-in
clock.  No broker is needed.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, parse_config
from sluice.core.errors import BrokerUnavailable
from sluice.core.events import EventID
from sluice.region import engine as engine_module
from sluice.region import membership as membership_module
from sluice.region import loading as loading_module
from sluice.region import service as service_module
from sluice.region.engine import Operation, OwnedBucket, RegionEngine
from sluice.region.service import RegionService
from sluice.region.state import BucketState, Duplicate, Op
from sluice.region.store import LocalStore


def site(**region_service: Any) -> SiteConfig:
    return parse_config({
        "site": "a", "dsid": 1,
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a.", "session_timeout_ms": 7000,
                  "heartbeat_interval_ms": 1500, "producer_linger_ms": 4, "delivery_timeout_ms": 9000,
                  "request_timeout_ms": 5000},
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"], "async_event_queues": ["q"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "dispatcher_threads": 3, "order_policy": "THREAD"}],
        "async_event_queues": [{"id": "q", "parallel": True, "order_policy": "PARTITION"}],
        "region_service": region_service,
    })


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Engine:
    """Stands in for RegionEngine: keeps the keyword arguments the service made it with."""

    made: dict[str, Any] = {}

    def __init__(self, **kwargs: Any) -> None:
        type(self).made = kwargs
        self.assigned_once = threading.Event()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class Closable:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``started(cfg)``: a RegionService of ``cfg`` started with Kafka's parts replaced; stopped after the test."""
    monkeypatch.setattr(service_module, "RegionEngine", Engine)
    monkeypatch.setattr(service_module, "DirectoryPublisher", Closable)
    monkeypatch.setattr(service_module, "OwnerDirectory", Closable)
    monkeypatch.setattr(RegionService, "_check_topics", lambda self: ("cluster-1", {"orders": "topic-id-1"}))
    monkeypatch.setattr(RegionService, "_directory_loop", lambda self: None)
    services: list[RegionService] = []

    def start(cfg: SiteConfig) -> RegionService:
        service = RegionService(cfg)
        services.append(service)
        service.start()
        return service

    yield start
    for service in services:
        service.stop()


def test_the_region_service_hands_its_settings_to_the_store_the_engine_and_its_socket(
        tmp_path: Path, started: Any) -> None:
    """host, port and advertised_url make the listening socket and the URL members and clients use;
    store_dir, store_max_mb and store_buffer_entries make the local store; load_timeout_s,
    event_tracking_timeout_s, load_threads and store_checkpoint_interval_s, the kafka group and producer
    settings, and each queue's order_policy (and forward_expiration_destroy, false: true is refused) go to the engine."""
    port = free_port("127.0.0.2")
    cfg = site(host="127.0.0.2", port=port, advertised_url="http://orders-0.example:7443",
               store_dir=str(tmp_path / "store"), store_max_mb=48, store_buffer_entries=77, load_timeout_s=12.5,
               event_tracking_timeout_s=120, load_threads=3, store_checkpoint_interval_s=0.75)
    service = started(cfg)

    assert service._sock is not None and service._sock.getsockname() == ("127.0.0.2", port)
    assert service.url == "http://orders-0.example:7443"

    store = service.store
    assert isinstance(store, LocalStore) and store.path == str(tmp_path / "store")
    assert store.env.info()["map_size"] == 48 * 1024 * 1024 and store.buffer_entries == 77

    made = Engine.made
    assert made["store"] is store
    assert (made["load_timeout_s"], made["event_tracking_timeout_s"], made["load_threads"],
            made["checkpoint_interval_s"]) == (12.5, 120, 3, 0.75)
    assert made["group_settings"] == {"session.timeout.ms": 7000, "heartbeat.interval.ms": 1500,
                                      "max.poll.interval.ms": 30000}
    assert made["producer_settings"] == {"linger.ms": 4, "delivery.timeout.ms": 9000, "request.timeout.ms": 5000}
    targets = {t.id: t for t in made["targets"]["orders"]}
    assert (targets["to-b"].order_policy, targets["to-b"].partitions, targets["to-b"].remote_dsid) == ("THREAD", 3, 2)
    assert targets["q"].order_policy == "PARTITION" and targets["q"].forward_expiration_destroy is False


def test_store_buffer_entries_writes_held_in_memory_go_to_the_store_together(tmp_path: Path) -> None:
    """With store_buffer_entries 5 a bucket's writes stay in memory until the fifth, which writes all
    five to the store at once (a flush); the next four wait in memory again."""
    store = LocalStore(str(tmp_path), max_mb=16, buffer_entries=5, buckets=1, cluster_id="c", site="a", dsid=1)
    try:
        state = BucketState("orders", 0, 1, "m1", store.fresh("orders", 0, "topic-1"))
        for i in range(4):
            state.prepare(Op.PUT, f"k{i}", b"1", EventID("writer", 1, i), 1_000)
        assert state.entries.buffered() == 4 and store.stats["store_flushes"] == 0
        state.prepare(Op.PUT, "k4", b"1", EventID("writer", 1, 4), 1_000)
        assert state.entries.buffered() == 0 and store.stats["store_flushes"] == 1
        with store.env.begin(db=store._db(b"orders/0")) as txn:
            assert txn.stat(store._db(b"orders/0"))["entries"] == 5
        for i in range(5, 9):
            state.prepare(Op.PUT, f"k{i}", b"1", EventID("writer", 1, i), 1_000)
        assert state.entries.buffered() == 4 and store.stats["store_flushes"] == 1
    finally:
        store.close()


def engine(**kwargs: Any) -> RegionEngine:
    return RegionEngine(site="a", dsid=1, member_id="m1", client_id="c1", kafka_settings={}, group_settings={},
                        producer_settings={}, group_id="a.region", regions={"orders": 2},
                        changelog_topics={"orders": "a.region.orders"}, targets={"orders": []}, codec=get_codec(),
                        **kwargs)


@pytest.mark.parametrize(("timeout_s", "forgotten"), [(60, True), (900, False)])
def test_event_tracking_timeout_is_how_long_an_idle_eventid_stream_is_remembered(timeout_s: int,
                                                                                  forgotten: bool) -> None:
    """A writer thread silent for 61 s is forgotten with event_tracking_timeout_s 60 (its retry then
    applies again, as in Geode) and remembered with 900 (its retry is a duplicate); one silent 10 s
    is remembered either way."""
    now_ms = int(time.time() * 1000)
    region = engine(event_tracking_timeout_s=timeout_s)
    state = BucketState("orders", 0, 1, "m1")
    state.prepare(Op.PUT, "old", b"1", EventID("idle-writer", 1, 5), now_ms - 61_000)
    state.prepare(Op.PUT, "new", b"1", EventID("busy-writer", 1, 5), now_ms - 10_000)
    region._owned[("orders", 0)] = OwnedBucket("orders", 0, epoch=1, state=state)
    region._expire_streams()
    assert (("idle-writer", 1) not in state.streams) is forgotten
    assert ("busy-writer", 1) in state.streams
    retry = state.prepare(Op.PUT, "old", b"1", EventID("idle-writer", 1, 5), now_ms)
    assert isinstance(retry, Duplicate) is not forgotten


class Clock:
    """A monotonic clock that moves only when the code under test waits; steps are exact binary fractions."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


@pytest.mark.parametrize(("interval_s", "checkpoints"), [(0.5, 20), (2.0, 5)])
def test_store_checkpoint_interval_is_how_often_quiet_buckets_are_made_clean(
        monkeypatch: pytest.MonkeyPatch, interval_s: float, checkpoints: int) -> None:
    """Over 10 s of the group thread, owned buckets are checkpointed every store_checkpoint_interval_s."""
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(membership_module, "time", clock)
    region = engine(checkpoint_interval_s=interval_s)
    region._store = SimpleNamespace()  # type: ignore[assignment]
    done: list[float] = []
    region._checkpoint_quiet = lambda: done.append(clock.now)  # type: ignore[method-assign]

    class Group:
        polls = 0

        def subscribe(self, *_: Any, **__: Any) -> None:
            pass

        def poll(self, timeout: float) -> None:
            clock.now += 0.25
            Group.polls += 1
            if Group.polls == 40:
                region._stopping.set()

        def close(self) -> None:
            pass

    region._group = Group()  # type: ignore[assignment]
    region._group_loop()
    assert len(done) == checkpoints
    assert [b - a for a, b in zip(done, done[1:])] == [interval_s] * (checkpoints - 1)


class Reader:
    def close(self) -> None:
        pass


class Producer:
    def close(self, *_: Any) -> None:
        pass


@pytest.mark.parametrize("load_threads", [1, 3])
def test_load_threads_is_how_many_buckets_load_at_once(monkeypatch: pytest.MonkeyPatch, load_threads: int) -> None:
    """load_threads 3: three bucket loads run side by side (each waits for the other two to begin);
    load_threads 1: one at a time."""
    region = engine(load_threads=load_threads)
    monkeypatch.setattr(RegionEngine, "_new_producer", lambda self: Producer())
    monkeypatch.setattr(RegionEngine, "_new_readers", lambda self: (Reader(), Reader()))
    monkeypatch.setattr(engine_module, "make_consumer", lambda *_, **__: Reader())
    monkeypatch.setattr(RegionEngine, "_commit_loop", lambda self: self._stopping.wait())
    monkeypatch.setattr(RegionEngine, "_group_loop", lambda self: self._stopping.wait())
    together = threading.Barrier(load_threads, timeout=60)
    changed = threading.Condition()
    running: list[int] = []
    most: list[int] = [0]
    loaded: list[int] = []

    def load(reader: Any, high_reader: Any, region_name: str, bucket: int, epoch: int) -> None:
        with changed:
            running.append(bucket)
            most[0] = max(most[0], len(running))
        together.wait()  # returns once load_threads loads are in progress together
        with changed:
            running.remove(bucket)
            loaded.append(bucket)
            changed.notify_all()

    monkeypatch.setattr(region, "_load", load)
    region.start()
    try:
        loaders = [t for t in region._threads if t.name.startswith("region-loader-")]
        assert len(loaders) == load_threads
        for bucket in range(3):
            region._loads.put(("orders", bucket, 1))
        with changed:
            assert changed.wait_for(lambda: len(loaded) == 3, timeout=60), f"loaded {loaded}"
        assert sorted(loaded) == [0, 1, 2]
        assert most[0] == load_threads
    finally:
        region.stop(deadline_s=10)


def test_load_timeout_is_how_long_a_load_waits_for_an_open_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket whose changelog keeps a transaction open is given up after load_timeout_s (2 s here),
    with an error naming it, to be tried again."""
    clock = Clock()
    monkeypatch.setattr(loading_module, "time", clock)
    monkeypatch.setattr(loading_module, "partition_end", lambda *_, **__: (0, 3, 5))  # open from offset 3
    region = engine(load_timeout_s=2.0)
    region._committed = lambda topic, bucket, timeout_s: (3, True)  # type: ignore[method-assign]
    region._owned[("orders", 0)] = OwnedBucket("orders", 0, epoch=1)
    began = clock.now

    class Waits:
        def is_set(self) -> bool:
            return False

        def wait(self, seconds: float) -> bool:
            clock.now += seconds
            return False

    region._stopping = Waits()  # type: ignore[assignment]
    with pytest.raises(BrokerUnavailable, match=r"a transaction is open from offset 3 \(end 5\) for 2 s"):
        region._wait_decided(Reader(), Reader(), "orders", 0, 1)  # type: ignore[arg-type]
    assert 2.0 < clock.now - began <= 2.1


def test_request_timeout_is_how_long_a_write_waits_for_its_acknowledgement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write the engine never acknowledges is answered, after region_service.request_timeout_s, as not
    acknowledged in time (retriable with the same EventID); one it acknowledges is answered with it."""
    cfg = site(request_timeout_s=0.2)
    service = RegionService(cfg)
    assert service.request_timeout_s == 0.2
    waits: list[float] = []
    real_wait_for = asyncio.wait_for

    async def wait_for(future: Any, timeout: float) -> Any:
        waits.append(timeout)
        return await real_wait_for(future, timeout)

    class Silent:
        answer: Any = None

        def is_ready(self, region: str, bucket: int) -> bool:
            return True

        def submit(self, ops: list[Operation], done: Any) -> None:
            if self.answer is not None:
                done([self.answer for _ in ops])

    silent = Silent()
    service.engine = silent  # type: ignore[assignment]
    op = Operation(Op.PUT, "orders", "k", b"1", EventID("w", 1, 1), bucket=0)
    monkeypatch.setattr(service_module.asyncio, "wait_for", wait_for)
    [unanswered] = asyncio.run(service.apply_owned([op]))
    silent.answer = engine_module.OpResult()
    [answered] = asyncio.run(service.apply_owned([op]))
    assert waits == [0.2, 0.2]
    assert isinstance(unanswered.error, BrokerUnavailable) and unanswered.error.retriable
    assert "not acknowledged by Kafka in time" in str(unanswered.error)
    assert answered.error is None


def test_request_timeout_bounds_a_keys_request_over_every_bucket_not_each_bucket() -> None:
    """Keys of a whole region whose 8 buckets are owned by another instance that answers each forward in
    0.3 s are refused as BucketUnavailable once region_service.request_timeout_s (0.4 s) is spent, not
    answered after 8 × 0.3 s: one deadline for the request, forwards included."""
    import httpx

    from sluice.core.errors import BucketUnavailable

    cfg = parse_config({"site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9"},
                        "regions": [{"name": "orders", "buckets": 8}], "region_service": {"request_timeout_s": 0.4}})
    service = RegionService(cfg)
    forwards: list[int] = []

    class Ownerless:
        def owns(self, region: str, bucket: int) -> bool:
            return False

    async def slow_owner(url: str, path: str, body: dict[str, Any], *, deadline: float | None = None) -> Any:
        forwards.append(body["bucket"])
        wait = 0.3 if deadline is None else min(0.3, deadline - time.monotonic())
        await asyncio.sleep(max(wait, 0))
        if wait < 0.3:
            raise httpx.ReadTimeout("no answer by the deadline")
        return httpx.Response(200, json={"keys": [f"k{body['bucket']}"]})

    service.engine = Ownerless()  # type: ignore[assignment]
    service.directory = SimpleNamespace(owner=lambda region, bucket: "http://127.0.0.1:2")  # type: ignore[assignment]
    service._to_member = slow_owner  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(BucketUnavailable, match="no ready owner in time"):
        asyncio.run(service.keys("orders", None, False))
    assert time.monotonic() - started < 0.8
    assert forwards[:2] == [0, 1]
