"""The metrics the chart's alerts and dashboard read, on real service processes' /metrics after a known workload.

Two sites on the session's broker (test_health_endpoints.write_sites): a's
region service, its parallel gateway sender a→b (4 partitions) and its async
event queue's dispatcher; b's region service and receiver.  A put_all of 50
entries on a must show as 50 events queued for each of a's two queues; the
sender's state gauge follows pause, stop and start through the control topic;
its one instance is the primary of every partition; and a batch of several
events written again into b's inbound topic is counted as one duplicate batch,
its events as discarded events.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.admin.cli import set_state
from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.eventwire import read_gateway_batch
from sluice.core.kafka import TopicPartition, make_consumer, make_producer
from sluice.core.processes import ReceiverProcess, SenderProcess, ServiceProcess

from regionkit import DispatcherProcess, start_two_regions
from waiting import wait_for
from test_health_endpoints import write_sites

pytestmark = pytest.mark.timeout(300)

EVENTS = 50
#: How long a put takes to reach site b, and a scrape to show what a service counted.
DELIVERY_S = 60
METRIC_S = 60


def samples(proc: ServiceProcess, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` (as Prometheus names it) on ``proc``'s /metrics whose labels include ``labels``."""
    response = httpx.get(f"{proc.metrics_url}/metrics", timeout=5)
    assert response.status_code == 200
    return [(s.labels, s.value) for family in text_string_to_metric_families(response.text) for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()]


def value(proc: ServiceProcess, name: str, **labels: str) -> float:
    found = samples(proc, name, **labels)
    assert found, f"no {name} with {labels} on {proc.metrics_url}"
    return sum(v for _, v in found)


def replay_a_batch(bootstrap: str, inbound: str, partitions: int) -> int:
    """Write a batch of more than one event found in ``inbound`` again, bytes and headers (its signature)
    unchanged; how many events it holds."""
    codec = get_codec()
    consumer = make_consumer({"bootstrap.servers": bootstrap})
    try:
        consumer.assign([TopicPartition(inbound, p, 0) for p in range(partitions)])
        end = time.monotonic() + DELIVERY_S
        while True:
            assert time.monotonic() < end, f"no batch of several events in {inbound}"
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None and msg.value():
                events = len(read_gateway_batch(codec, msg.value()).bodies)
                if events > 1:
                    break
    finally:
        consumer.close()
    producer = make_producer({"bootstrap.servers": bootstrap})
    producer.produce(inbound, msg.value(), msg.key(), partition=msg.partition(), headers=msg.headers())
    assert producer.flush(30) == 0
    return events


def test_events_queued_state_primaries_and_duplicate_batches(site_a, unique_prefix, tmp_path: Path) -> None:
    path_a, path_b = write_sites(tmp_path, site_a.bootstrap, unique_prefix, alert_threshold_ms=45000)
    cfg_a, cfg_b = load_config(path_a), load_config(path_b)
    procs: list[ServiceProcess] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        sender = SenderProcess(path_a, "orders-to-b", tmp_path / "sender.log")
        dispatcher = DispatcherProcess(path_a, "audit", tmp_path / "dispatcher.log")
        receiver = ReceiverProcess(path_b, tmp_path / "receiver.log")
        procs += [sender, dispatcher, receiver]

        # Before any write: every queue is there, at 0.
        for queue_id in ("orders-to-b", "audit"):
            assert value(region_a, "sluice_queue_events_queued_total", sluice_queue_id=queue_id) == 0

        client = RegionClient([region_a.url])
        # One request: its events are queued together, so the sender's batches hold several.
        client.put_all("orders", {f"k{n}": {"n": n} for n in range(EVENTS)})
        client_b = RegionClient([region_b.url])
        wait_for(lambda: len(client_b.keys("orders")) == EVENTS, timeout_s=DELIVERY_S, what="b has every put")

        # Each put is one event queued for the sender and one for the async event queue.
        assert value(region_a, "sluice_queue_events_queued_total", sluice_queue_id="orders-to-b",
                     sluice_queue_kind="gateway-sender", sluice_site="a",
                     messaging_destination_name=cfg_a.topics.queue("orders-to-b")) == EVENTS
        assert value(region_a, "sluice_queue_events_queued_total", sluice_queue_id="audit",
                     sluice_queue_kind="async-event-queue") == EVENTS

        # The sender's one instance is the primary of each of its 4 partitions; its threshold is 45 s.
        wait_for(lambda: value(sender, "sluice_queue_partition_primary", sluice_queue_id="orders-to-b") == 4,
                 timeout_s=METRIC_S, what="the sender holds every partition")
        primaries = samples(sender, "sluice_queue_partition_primary", sluice_queue_id="orders-to-b")
        assert sorted(labels["messaging_destination_partition_id"] for labels, _ in primaries) == ["0", "1", "2", "3"]
        assert value(sender, "sluice_queue_alert_threshold_seconds", sluice_queue_id="orders-to-b") == 45.0
        assert value(dispatcher, "sluice_queue_alert_threshold_seconds", sluice_queue_id="audit") == 0.0

        def state_of(proc: ServiceProcess, queue_id: str) -> dict[str, float]:
            return {labels["sluice_state"]: v for labels, v in samples(proc, "sluice_queue_state",
                                                                         sluice_queue_id=queue_id)}

        assert state_of(sender, "orders-to-b") == {"running": 1, "paused": 0, "stopped": 0}
        assert state_of(dispatcher, "audit") == {"running": 1, "paused": 0, "stopped": 0}
        set_state(cfg_a, "orders-to-b", "PAUSED", issued_by="test")
        wait_for(lambda: state_of(sender, "orders-to-b")["paused"] == 1, timeout_s=METRIC_S,
                 what="the sender reports paused")
        assert state_of(sender, "orders-to-b") == {"running": 0, "paused": 1, "stopped": 0}
        set_state(cfg_a, "orders-to-b", "STOPPED", issued_by="test")
        wait_for(lambda: state_of(sender, "orders-to-b")["stopped"] == 1, timeout_s=METRIC_S,
                 what="the sender reports stopped")
        set_state(cfg_a, "orders-to-b", "RUNNING", issued_by="test")
        wait_for(lambda: state_of(sender, "orders-to-b")["running"] == 1, timeout_s=METRIC_S,
                 what="the sender reports running")

        # No duplicate yet; then a batch b applied is written into its inbound topic again.
        assert value(receiver, "sluice_batches_duplicates_received_total") == 0
        assert value(receiver, "sluice_events_duplicates_discarded_total", sluice_duplicate_of="batch") == 0
        applied = value(receiver, "sluice_batches_acknowledged_total")
        events = replay_a_batch(site_a.bootstrap, cfg_b.topics.gateway_inbound(), cfg_b.receiver.inbound_partitions)
        wait_for(lambda: value(receiver, "sluice_batches_duplicates_received_total") == 1, timeout_s=METRIC_S,
                 what="the receiver counts the duplicate batch")
        # One batch, and its events (not the count of batches) as discarded events.
        assert value(receiver, "sluice_events_duplicates_discarded_total", sluice_duplicate_of="batch") == events
        assert value(receiver, "sluice_batches_duplicates_received_total", sluice_component="receiver",
                     messaging_destination_name=cfg_b.topics.gateway_inbound()) == 1
        assert value(receiver, "sluice_batches_acknowledged_total") == applied + 1  # acknowledged again
        assert value(receiver, "sluice_events_applied_total") == EVENTS  # applied not again
    finally:
        for proc in reversed(procs):
            proc.stop()
