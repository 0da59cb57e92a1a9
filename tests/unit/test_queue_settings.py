"""Queue settings of the site file act in the queue loop (core/queueloop.py), its dispatcher and its sender.

Each test loads a site file whose async event queue or gateway sender sets one setting away from its
default, builds the service from it, and drives the loop's own steps (``_read``, ``_dispatch_ready``,
``_apply_memory_bound``, ``_await_ack``) with stand-ins for Kafka, so no broker is needed.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.admin.clean import desired_state
from sluice.core.batching import PartitionBatcher
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import TopicPartition
from sluice.core.queueloop import DesiredState, QueuePartition, QueuePrimary
from sluice.dispatcher.service import DispatcherService
from sluice.sender.service import GatewaySenderService, _InFlight
from test_queueloop import FakeMessage, FakeProducer, entry, record

BUCKETS = 2


def site(tmp_path: Path, queue: dict[str, Any] | None = None, sender: dict[str, Any] | None = None) -> SiteConfig:
    """A site with the parallel async event queue "q" and the parallel gateway sender "to-b" on orders."""
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a."},
        "regions": [{"name": "orders", "buckets": BUCKETS, "gateway_senders": ["to-b"], "async_event_queues": ["q"]}],
        "async_event_queues": [{"id": "q", "parallel": True,
                                "listener": {"type": "python", "class_path": "x:Y"}, **(queue or {})}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True,
                             "remote": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "b."}, **(sender or {})}],
    }))
    return load_config(path)


class Consumer:
    """What the loop asks of its group consumer here: pausing and resuming its partitions."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("pause", sorted(tp.partition for tp in partitions)))

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("resume", sorted(tp.partition for tp in partitions)))

    def commit(self, *_: Any, **__: Any) -> None:
        pass


def primed(loop: QueuePrimary) -> QueuePrimary:
    """``loop`` as its group's assignment leaves it: every partition its, Kafka replaced by stand-ins."""
    loop._producer = FakeProducer()
    loop._consumer = Consumer()  # type: ignore[assignment]
    for p in range(BUCKETS):
        loop._partitions[p] = QueuePartition(tp=TopicPartition(loop.topic, p),
                                             batcher=PartitionBatcher(p, loop.policy), duplicate_below=0)
    return loop


class Loop(QueuePrimary):
    kind = "async-event-queue"


class Listener:
    """Hands every batch it is offered to the test."""

    offered: "queue.Queue[list[str]]" = queue.Queue()

    def process_events(self, events: list[Any]) -> bool:
        self.offered.put([e.key for e in events])
        return True


@pytest.fixture
def listener() -> type[Listener]:
    """A listener class of the test's own, with an empty queue of the batches offered."""
    return type("TestListener", (Listener,), {"offered": queue.Queue()})


def test_pause_event_processing_starts_a_queue_paused_until_it_is_resumed(tmp_path: Path,
                                                                          listener: type[Listener]) -> None:
    """pause_event_processing: true: the dispatcher starts PAUSED and offers its listener nothing, the
    events waiting; resumed (`sluice admin resume`, a control record), it offers them. Left out, it starts
    RUNNING; `sluice admin clean` reads the same start state from the file."""
    cfg = site(tmp_path, queue={"pause_event_processing": True})
    dispatcher = primed(DispatcherService(cfg, "q", listener_factory=listener))
    try:
        assert dispatcher.desired is DesiredState.PAUSED and desired_state(cfg, "q", None) == "PAUSED"
        dispatcher._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(3)], now_ms=0)
        dispatcher._dispatch_ready()
        assert listener.offered.empty() and not dispatcher._partitions[0].in_flight
        assert dispatcher._partitions[0].batcher.waiting == 3

        dispatcher._apply_control({"state": "RUNNING", "issued_by": "ops"})
        dispatcher._dispatch_ready()
        assert listener.offered.get(timeout=30) == ["k0", "k1", "k2"]
    finally:
        dispatcher._pool.shutdown(wait=True)

    unpaused = site(tmp_path)
    running = DispatcherService(unpaused, "q", listener_factory=listener)
    running._pool.shutdown(wait=True)
    assert running.desired is DesiredState.RUNNING and desired_state(unpaused, "q", None) == "RUNNING"


def test_a_manual_start_sender_starts_stopped_and_sends_nothing(tmp_path: Path) -> None:
    """A gateway sender's manual_start: true: it starts STOPPED (until `sluice admin start`) and hands
    out no batch while events wait; `sluice admin clean` takes it as stopped. Left out, it starts RUNNING."""
    cfg = site(tmp_path, sender={"manual_start": True})
    sender = primed(GatewaySenderService(cfg, "to-b"))
    try:
        assert sender.desired is DesiredState.STOPPED and desired_state(cfg, "to-b", None) == "STOPPED"
        sender._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(3)], now_ms=0)
        sender._dispatch_ready()
        part = sender._partitions[0]
        assert not part.in_flight and part.batcher.out == [] and part.batcher.waiting == 3
    finally:
        sender._pool.shutdown(wait=True)

    automatic = site(tmp_path)
    running = GatewaySenderService(automatic, "to-b")
    running._pool.shutdown(wait=True)
    assert running.desired is DesiredState.RUNNING and desired_state(automatic, "to-b", None) == "RUNNING"


@pytest.mark.parametrize("kind", ["async-event-queue", "gateway-sender"])
def test_batch_size_interval_and_conflation_from_the_file_cut_the_batches(tmp_path: Path, kind: str) -> None:
    """batch_size 3: a batch holds at most 3 events; batch_time_interval_ms 1000: fewer wait until 1000 ms
    after the first; batch_conflation: a later update of a key waiting replaces the earlier one; for an
    async event queue and a gateway sender alike."""
    batching = {"batch_size": 3, "batch_time_interval_ms": 1000, "batch_conflation": True}
    if kind == "async-event-queue":
        cfg = site(tmp_path, queue=batching)
        loop = primed(Loop(cfg, "q", cfg.queue("q")))
    else:
        loop = primed(GatewaySenderService(site(tmp_path, sender=batching), "to-b"))
    loop._pool.shutdown(wait=True)
    keys = ["a", "b", "a", "c", "d", "e"]  # the second "a" replaces the first
    loop._read([FakeMessage(record(entry(k, i)), 0, i) for i, k in enumerate(keys)], now_ms=0)
    batcher = loop._partitions[0].batcher
    first = batcher.take(0)
    assert first is not None and [e.key for e in first.events] == ["a", "b", "c"]
    assert [e.offset for e in first.events] == [2, 1, 3]
    batcher.accepted()
    assert batcher.take(999) is None, "two events wait: not a batch before the interval"
    second = batcher.take(1000)
    assert second is not None and [e.key for e in second.events] == ["d", "e"]
    assert batcher.events_conflated == 1


def test_max_batches_in_flight_is_how_many_batches_of_a_partition_are_out_at_once(tmp_path: Path) -> None:
    """A sender with max_batches_in_flight 3 hands out three batches of a partition before any is
    acknowledged, and a fourth only once the oldest is."""
    cfg = site(tmp_path, sender={"max_batches_in_flight": 3, "batch_size": 2})
    sender = primed(GatewaySenderService(cfg, "to-b"))
    sender._pool.shutdown(wait=True)
    sender._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(10)], now_ms=0)
    batcher = sender._partitions[0].batcher
    out = [batcher.take(0) for _ in range(4)]
    assert [len(b.events) if b else None for b in out] == [2, 2, 2, None]
    batcher.accepted()
    assert batcher.take(0) is not None


def test_socket_read_timeout_bounds_the_wait_for_an_ack_and_retry_interval_the_backoff(tmp_path: Path) -> None:
    """socket_read_timeout_ms: a batch written 60 s ago without an ack is given up (to be sent again) with
    a 10 s timeout, but still awaited with a 120 s one; retry_interval_ms caps the wait between attempts."""
    given_up = primed(GatewaySenderService(site(tmp_path, sender={"socket_read_timeout_ms": 10_000,
                                                                  "retry_interval_ms": 700}), "to-b"))
    waiting = primed(GatewaySenderService(site(tmp_path, sender={"socket_read_timeout_ms": 120_000}), "to-b"))
    for sender in (given_up, waiting):
        sender._pool.shutdown(wait=True)
        sender._inbound_partitions = 4
        sender._batch_versions[sender._inbound_partition(0)] = 3
    entry_sent = _InFlight(7, first_send=True)
    entry_sent.written_at = time.monotonic() - 60

    part = given_up._partitions[0]
    assert given_up._await_ack(part, None, entry_sent) is False  # type: ignore[arg-type]
    assert given_up._inbound_partition(0) not in given_up._batch_versions, "given up: the ack timed out"

    # Still within its timeout: it waits for the ack, so only a pause ends the wait here.
    waiting.desired = DesiredState.PAUSED
    assert waiting._await_ack(waiting._partitions[0], None, entry_sent) is False  # type: ignore[arg-type]
    assert waiting._batch_versions[waiting._inbound_partition(0)] == 3, "not given up: no timeout yet"

    assert given_up._backoff_s(20) == 0.7 and waiting._backoff_s(20) == 5.0


def big_entry(key: str, seq: int, size: int) -> EntryEvent:
    value = b'"' + b"x" * size + b'"'
    return EntryEvent(region="orders", key=key, operation=Operation.UPDATE, value=value,
                      event_id=EventID("m", 1, seq), version=VersionTag(1, 1_700_000_000_000, seq, "m"),
                      origin_dsid=1, bucket=0, event_time=1_700_000_000_000)


@pytest.mark.parametrize("kind", ["async-event-queue", "gateway-sender"])
def test_maximum_queue_memory_mb_pauses_reading_beyond_it_and_resumes_below(tmp_path: Path, kind: str) -> None:
    """maximum_queue_memory_mb 1: once the events held pass 1 MiB the loop pauses its partitions (the rest
    waits in Kafka); once batches leave and less than 80 % of it is held, it resumes them."""
    bounded = {"maximum_queue_memory_mb": 1, "batch_size": 1}
    if kind == "async-event-queue":
        cfg = site(tmp_path, queue=bounded)
        loop = primed(Loop(cfg, "q", cfg.queue("q")))
    else:
        loop = primed(GatewaySenderService(site(tmp_path, sender=bounded), "to-b"))
    loop._pool.shutdown(wait=True)
    consumer = loop._consumer
    loop._read([FakeMessage(record(big_entry("a", 0, 300_000)), 0, 0),
                FakeMessage(record(big_entry("b", 1, 300_000)), 0, 1)], now_ms=0)
    loop._apply_memory_bound()
    assert consumer.calls == [], "600 kB held: under 1 MiB"  # type: ignore[union-attr]
    loop._read([FakeMessage(record(big_entry("c", 2, 300_000)), 1, 0),
                FakeMessage(record(big_entry("d", 3, 300_000)), 1, 1)], now_ms=0)
    loop._apply_memory_bound()
    assert consumer.calls == [("pause", [0, 1])]  # type: ignore[union-attr]
    for p in (0, 1):
        batcher = loop._partitions[p].batcher
        assert batcher.take(0) is not None
        batcher.accepted()
    loop._apply_memory_bound()
    assert consumer.calls == [("pause", [0, 1]), ("resume", [0, 1])]  # type: ignore[union-attr]
