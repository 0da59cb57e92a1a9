"""One trace from a put on site a to the apply on site b and a listener call, across real processes.

Every service writes its spans to one file (``SLUICE_TRACES_FILE``); the W3C
trace context travels in the changelog and queue records' ``traceparent``
header, in the gateway batch's ``sluice-traceparents`` header (one per
event), and in the receiver's apply_remote request.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from sluice.client import RegionClient
from sluice.core import telemetry
from sluice.core.config import load_config
from sluice.core.kafka import TopicPartition, make_consumer
from sluice.core.processes import DispatcherProcess, ReceiverProcess, RegionProcess, SenderProcess, ServiceProcess

from recording_listener import read_offers
from test_health_endpoints import write_sites
from waiting import wait_for

pytestmark = pytest.mark.timeout(300)

#: How long a put may take to reach the other site and the listener.
DELIVERY_S = 60


def test_one_trace_from_the_put_on_a_to_the_apply_on_b_and_the_listener(site_a, unique_prefix,
                                                                        tmp_path: Path) -> None:
    path_a, path_b = write_sites(tmp_path, site_a.bootstrap, unique_prefix)
    spans_file = tmp_path / "spans.jsonl"
    env = {telemetry.TRACES_FILE_ENV: str(spans_file)}
    procs: list[ServiceProcess] = []
    try:
        region_a = RegionProcess(path_a, tmp_path / "region-a.log", env=env)
        region_b = RegionProcess(path_b, tmp_path / "region-b.log", env=env)
        procs += [region_a, region_b]
        region_a.wait_ready()
        region_b.wait_ready()
        procs += [SenderProcess(path_a, "orders-to-b", tmp_path / "sender.log", env=env),
                  DispatcherProcess(path_a, "audit", tmp_path / "dispatcher.log", env=env,
                                    extra_path=[str(Path(__file__).resolve().parent)]),
                  ReceiverProcess(path_b, tmp_path / "receiver.log", env=env)]

        RegionClient([region_a.url]).put("orders", "o-1", {"qty": 3})
        client_b = RegionClient([region_b.url])
        wait_for(lambda: client_b.get("orders", "o-1") is not None and read_offers(str(tmp_path / "offers.jsonl")),
                 timeout_s=DELIVERY_S, what="the put reaches b and the listener", poll_s=0.2)

        # The changelog record at a carries the put's trace context as a header.
        cfg_a = load_config(path_a)
        headers = _record_headers(site_a.bootstrap, cfg_a.topics.region_changelog("orders"), 4)
        assert len(headers) == 1 and headers[0] is not None and headers[0].startswith(b"00-")
    finally:
        for proc in reversed(procs):
            proc.stop()  # SIGTERM: each flushes its spans

    spans = telemetry.read_spans(spans_file)
    traces = telemetry.wan_traces(spans, "a", "b")
    assert len(traces) == 1, _summary(spans)
    trace_id = traces[0]
    mine = [s for s in spans if s["context"]["trace_id"] == trace_id]
    by_name = {telemetry.span_role(s): s for s in mine}
    assert set(telemetry.WAN_TRACE) <= set(by_name), _summary(spans)
    assert telemetry.span_site(by_name["region.put"]) == "a"
    assert telemetry.span_site(by_name["region.apply_remote"]) == "b"
    assert headers[0].decode().split("-")[1] == trace_id.removeprefix("0x")

    # The messaging spans are named `{operation} {destination}` (OpenTelemetry's messaging
    # conventions): a send's destination is the remote site's inbound topic.
    inbound_b = load_config(path_b).topics.gateway_inbound()
    for role, name, operation, destination in (
            ("gateway.send", f"send {inbound_b}", "send", inbound_b),
            ("gateway.receive", f"process {inbound_b}", "process", inbound_b),
            ("listener.process_events", f"process {cfg_a.topics.queue('audit')}", "process", cfg_a.topics.queue("audit"))):
        attributes = by_name[role]["attributes"]
        assert by_name[role]["name"] == name
        assert attributes["messaging.operation.name"] == attributes["messaging.operation.type"] == operation
        assert attributes["messaging.destination.name"] == destination

    # Parent links: put → send → receive → apply on b; the listener call is a child of the put.
    ids = {s["context"]["span_id"]: telemetry.span_role(s) for s in mine}
    # The root: FastAPI's server span of the HTTP request on a.
    assert ids[by_name["region.put"]["parent_id"]] == "POST /regions/{region}/put"
    assert by_name["POST /regions/{region}/put"]["parent_id"] is None
    assert ids[by_name["gateway.send"]["parent_id"]] == "region.put"
    assert ids[by_name["gateway.receive"]["parent_id"]] == "gateway.send"
    assert ids[by_name["region.apply_remote"]["parent_id"]] == "gateway.receive"
    assert ids[by_name["listener.process_events"]["parent_id"]] == "region.put"
    assert by_name["gateway.send"]["kind"] == "SpanKind.PRODUCER"
    assert by_name["listener.process_events"]["attributes"]["messaging.system"] == "kafka"
    assert by_name["listener.process_events"]["attributes"]["sluice.queue.id"] == "audit"


def test_a_put_all_grouped_for_its_sender_carries_its_trace_on_every_record(site_a, unique_prefix,
                                                                            tmp_path: Path) -> None:
    """group_transaction_events: a put_all's events are written together, each changelog and
    queue record with the request's traceparent."""
    path_a, _ = write_sites(tmp_path, site_a.bootstrap, unique_prefix, group_transaction_events=True)
    env = {telemetry.TRACES_FILE_ENV: str(tmp_path / "spans.jsonl")}
    with RegionProcess(path_a, tmp_path / "region-a.log", env=env) as region:
        region.wait_ready()
        RegionClient([region.url]).put_all("orders", {f"k{i}": i for i in range(6)})
        cfg = load_config(path_a)
        changelog = _record_headers(site_a.bootstrap, cfg.topics.region_changelog("orders"), 4, count=6)
        queued = _record_headers(site_a.bootstrap, cfg.topics.queue("orders-to-b"), 4, count=6)
    assert len(changelog) == len(queued) == 6
    traces = {h.decode().split("-")[1] for h in changelog + queued if h is not None}
    assert None not in changelog + queued and len(traces) == 1


def _record_headers(bootstrap: str, topic: str, partitions: int, count: int = 1) -> list[bytes | None]:
    consumer = make_consumer({"bootstrap.servers": bootstrap}, None)
    found: list[bytes | None] = []
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        end = time.monotonic() + 10
        while time.monotonic() < end and len(found) < count:
            for msg in consumer.consume(100, 0.5):
                if msg.error() is None:
                    found.append(telemetry.header(msg.headers(), telemetry.TRACEPARENT))
    finally:
        consumer.close()
    return found


def _summary(spans: list[dict[str, Any]]) -> str:
    per_trace: dict[str, list[str]] = defaultdict(list)
    for s in spans:
        per_trace[s["context"]["trace_id"]].append(f"{s['name']}@{telemetry.span_site(s)}")
    return "\n".join(f"{t}: {names}" for t, names in per_trace.items())
