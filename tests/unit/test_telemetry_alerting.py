"""core/telemetry.py's readers of the metrics people alert on, and the messaging span names, without Kafka:
events queued counted per written window, the state and primary gauges of a queue, the roles of WAN spans."""

from __future__ import annotations

import collections
import gc
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.core import telemetry
from sluice.core.config import parse_config
from sluice.core.queueloop import DesiredState

SITE = parse_config({
    "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "localhost:9092", "topic_prefix": "a."},
    "regions": [{"name": "orders", "buckets": 6, "gateway_senders": ["to-b"], "async_event_queues": ["audit"]}],
    "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "alert_threshold_ms": 1500}],
    "async_event_queues": [{"id": "audit", "listener": {"type": "python", "class_path": "x:Y"}}],
}, source="<test>")


def test_every_new_metric_is_in_the_catalogue_with_a_unit_and_a_description() -> None:
    for name in (telemetry.EVENTS_QUEUED, telemetry.QUEUE_STATE, telemetry.QUEUE_ALERT_THRESHOLD,
                 telemetry.PARTITION_PRIMARY, telemetry.DUPLICATE_BATCHES):
        unit, description = telemetry.METRICS[name]
        assert unit and len(description) > 20, name


def test_count_topics_counts_a_window_by_topic_leaving_out_skipped_slots() -> None:
    tally: collections.Counter[str] = collections.Counter()
    kept, gone = ("orders", 1, 0), ("orders", 2, 0)
    window = [(("a.changelog.orders", 1, b"k", b"v", None), kept), (("a.queue.to-b", 1, b"k", b"v", None), kept),
              (("a.queue.audit", 0, b"k", b"v", None), kept), (("a.queue.to-b", 2, b"j", b"v", None), gone),
              (("a.queue.to-b", 1, b"m", b"v", None), kept)]
    telemetry.count_topics(tally, window)
    assert tally == {"a.changelog.orders": 1, "a.queue.to-b": 3, "a.queue.audit": 1}
    telemetry.count_topics(tally, window, skip={gone})
    assert tally == {"a.changelog.orders": 2, "a.queue.to-b": 5, "a.queue.audit": 2}
    telemetry.count_topics(tally, [])
    assert sum(tally.values()) == 9


def test_events_queued_reads_every_queue_of_the_site_and_no_changelog() -> None:
    class Engine:
        tally = collections.Counter({"a.changelog.orders": 7, "a.queue.to-b": 4})
    owner = Engine()
    queues = telemetry.queue_attributes(SITE, **{"sluice.component": "region"})
    assert set(queues) == {"a.queue.to-b", "a.queue.audit"}
    read = telemetry.events_queued_reader(owner, lambda o: o.tally, queues)
    readings = {attributes["sluice.queue.id"]: (value, attributes) for value, attributes in read()}
    assert readings["to-b"][0] == 4 and readings["audit"][0] == 0  # 0 before a queue's first event
    assert readings["to-b"][1] == {"messaging.system": "kafka", "sluice.site": "a", "sluice.queue.id": "to-b",
                                   "sluice.queue.kind": "gateway-sender",
                                   "messaging.destination.name": "a.queue.to-b", "sluice.component": "region"}
    assert telemetry.events_queued_reader(owner, lambda o: None, queues)() == []  # no engine yet: nothing


class FakePrimary:
    """What the readers read of a core/queueloop.py QueuePrimary."""

    def __init__(self, queue_id: str, kind: str) -> None:
        self.cfg, self.queue_id, self.kind = SITE, queue_id, kind
        self.desired = DesiredState.RUNNING
        self.owned: set[int] = set()

    def alert_threshold_ms(self) -> int:
        return 1500

    def attributes(self, partition: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"sluice.queue.id": self.queue_id}
        if partition is not None:
            out["messaging.destination.partition.id"] = str(partition)
        return out


@pytest.mark.parametrize("desired, expected", [(DesiredState.RUNNING, "running"), (DesiredState.PAUSED, "paused"),
                                               (DesiredState.STOPPED, "stopped")])
def test_the_state_gauge_is_one_for_the_current_state_and_zero_for_the_others(desired: DesiredState,
                                                                              expected: str) -> None:
    primary = FakePrimary("to-b", "gateway-sender")
    primary.desired = desired
    readings = {attributes["sluice.state"]: value for value, attributes in telemetry.queue_state_reader(primary)()}
    assert readings == {state: int(state == expected) for state in telemetry.QUEUE_STATES}


def test_the_primary_gauge_covers_every_partition_of_the_queue() -> None:
    primary = FakePrimary("to-b", "gateway-sender")  # parallel: one partition per bucket, 6
    read = telemetry.partition_primary_reader(primary, lambda p: p.owned)
    assert [value for value, _ in read()] == [0] * 6
    primary.owned = {1, 4}
    readings = {attributes["messaging.destination.partition.id"]: value for value, attributes in read()}
    assert readings == {"0": 0, "1": 1, "2": 0, "3": 0, "4": 1, "5": 0}
    del primary
    gc.collect()
    assert read() == []  # the primary is gone: it reports nothing


def test_messaging_spans_are_named_operation_destination() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    original = telemetry.tracer
    telemetry.tracer = lambda: tracer  # type: ignore[assignment]
    try:
        telemetry.messaging_span("send", "b.gateway.inbound",
                                 attributes={"messaging.destination.name": "a.queue.to-b",
                                             "sluice.queue.kind": "gateway-sender"}).end()
        telemetry.messaging_span("process", "b.gateway.inbound", attributes={"sluice.component": "receiver"}).end()
        telemetry.messaging_span("process", "a.queue.audit", attributes={"sluice.queue.kind": "async-event-queue"}).end()
        with pytest.raises(ValueError, match="send, receive or process"):
            telemetry.messaging_span("publish", "x")
    finally:
        telemetry.tracer = original  # type: ignore[assignment]
    send, receive, process = exporter.get_finished_spans()
    assert send.name == "send b.gateway.inbound"
    assert send.attributes["messaging.destination.name"] == "b.gateway.inbound"  # the remote topic, not the queue
    assert send.attributes["messaging.operation.name"] == send.attributes["messaging.operation.type"] == "send"
    assert receive.name == "process b.gateway.inbound" and process.name == "process a.queue.audit"

    def as_file(span: Any) -> dict[str, Any]:
        return {"name": span.name, "attributes": dict(span.attributes)}
    assert [telemetry.span_role(as_file(s)) for s in (send, receive, process)] == list(telemetry.WAN_TRACE[1:3]) + [
        "listener.process_events"]
    assert telemetry.span_role({"name": "region.put", "attributes": {}}) == "region.put"


def test_prometheus_names_are_those_the_exporter_writes() -> None:
    """What the chart's alerts and dashboard select by (telemetry.prometheus_names) is what
    OpenTelemetry's Prometheus exporter writes for every metric of the catalogue."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry(auto_describe=True)
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    meter = provider.get_meter("test")
    for name, (unit, description) in telemetry.METRICS.items():
        if name in telemetry.HISTOGRAMS:
            meter.create_histogram(name, unit=unit, description=description).record(0.5, {"sluice.site": "a"})
        elif name in telemetry.GAUGES:
            meter.create_observable_gauge(name, [lambda _o: [telemetry.Observation(1, {"sluice.site": "a"})]],
                                          unit=unit, description=description)
        else:
            meter.create_counter(name, unit=unit, description=description).add(1, {"sluice.site": "a"})
    written = {sample.name for family in text_string_to_metric_families(generate_latest(registry).decode())
               for sample in family.samples} - {"target_info"}
    expected = {n for name in telemetry.METRICS for n in telemetry.prometheus_names(name)}
    provider.shutdown()
    assert written == expected
