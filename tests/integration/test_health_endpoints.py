"""/healthz, /readyz and /metrics of every service process, as the Helm chart probes and scrapes them.

Two sites on the session's broker: a's region service, a parallel gateway
sender a→b and an async event queue's dispatcher; b's region service,
receiver and subscription service.  Each process serves the three paths on
a port of its own (``SLUICE_METRICS_PORT=0``, as ServiceProcess sets it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.client import RegionClient
from sluice.core.processes import ReceiverProcess, SenderProcess, ServiceProcess, SubscriptionsProcess, probe

from regionkit import DispatcherProcess, RegionProcess, remote, start_two_regions, write_two_sites
from waiting import read_until, wait_for

pytestmark = pytest.mark.timeout(300)

#: How long a service may take to be ready, B to hold what A wrote, a metric or an alert to show up, and
#: the queue to be empty once everything is acknowledged.
READY_S = 60
DELIVERY_S = 60
METRIC_S = 30
ALERT_S = 30
DRAIN_S = 30


def write_sites(tmp_path: Path, bootstrap: str, prefix: str, alert_threshold_ms: int = 60000,
                group_transaction_events: bool = False) -> tuple[Path, Path]:
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["orders-to-b"],
                     "async_event_queues": ["audit"]}],
        "gateway_senders": [{"id": "orders-to-b", "remote_dsid": 2, "parallel": True, "batch_size": 20,
                             "batch_time_interval_ms": 20, "alert_threshold_ms": alert_threshold_ms,
                             "group_transaction_events": group_transaction_events,
                             "remote": remote(bootstrap, prefix, "b")}],
        "async_event_queues": [{"id": "audit", "batch_size": 20, "listener": {
            "type": "python", "class_path": "recording_listener:RecordingListener",
            "settings": {"path": str(tmp_path / "offers.jsonl")}}}],
    }, b={
        "regions": [{"name": "orders", "buckets": 4}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
        "subscriptions": {"registry_partitions": 2},
    })
    return two.path_a, two.path_b


def wait_ready(proc: ServiceProcess, timeout_s: float = READY_S) -> dict[str, Any]:
    def ready() -> tuple[int, dict[str, Any]]:
        status, body = probe(f"{proc.metrics_url}/readyz")
        assert status in (200, 503), (status, body)
        if status == 503:
            assert body["ready"] is False and body["not_ready"], body
        return status, body

    status, body = read_until(ready, lambda answer: answer[0] == 200, timeout_s=timeout_s, poll_s=0.2)
    assert status == 200, f"{proc.announcement} not ready: {body}\n{proc.log_tail()}"
    return body


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"no {name} with {labels} in:\n{text[:4000]}"
    return total


def scrape(proc: ServiceProcess) -> str:
    response = httpx.get(f"{proc.metrics_url}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def test_every_service_serves_health_readiness_and_metrics(site_a, unique_prefix, tmp_path: Path) -> None:
    path_a, path_b = write_sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[ServiceProcess] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        sender = SenderProcess(path_a, "orders-to-b", tmp_path / "sender.log")
        dispatcher = DispatcherProcess(path_a, "audit", tmp_path / "dispatcher.log")
        receiver = ReceiverProcess(path_b, tmp_path / "receiver.log")
        subscriptions = SubscriptionsProcess(path_b, tmp_path / "subscriptions.log")
        procs += [sender, dispatcher, receiver, subscriptions]

        for proc in procs:
            assert proc.metrics_url.startswith("http://127.0.0.1:"), proc.announcement
            assert probe(f"{proc.metrics_url}/healthz") == (200, {"state": "running"})
            assert wait_ready(proc) == {"ready": True, "state": "running"}
        assert len({proc.metrics_url for proc in procs}) == len(procs)

        client = RegionClient([region_a.url])
        for n in range(50):
            client.put("orders", f"k{n}", {"n": n})
        client_b = RegionClient([region_b.url])
        read_until(lambda: len(client_b.keys("orders")), lambda count: count >= 50, timeout_s=DELIVERY_S, poll_s=0.2)
        assert len(client_b.keys("orders")) == 50

        # What each scrape shows, with OpenTelemetry's messaging attributes.
        def settled(proc: ServiceProcess, name: str, at_least: float, **labels: str) -> str:
            return read_until(lambda: scrape(proc), lambda text: metric_value(text, name, **labels) >= at_least,
                              timeout_s=METRIC_S, poll_s=0.3)

        text = settled(sender, "sluice_batches_acknowledged_total", 1, sluice_queue_id="orders-to-b")
        assert metric_value(text, "sluice_batches_acknowledged_total", messaging_system="kafka", sluice_site="a",
                            sluice_queue_kind="gateway-sender", sluice_remote_dsid="2") >= 1
        assert metric_value(text, "sluice_batches_sent_total", sluice_queue_id="orders-to-b") >= \
            metric_value(text, "sluice_batches_acknowledged_total", sluice_queue_id="orders-to-b")
        assert metric_value(text, "sluice_events_delivered_total", sluice_queue_id="orders-to-b") >= 1
        assert metric_value(text, "sluice_batch_duration_seconds_count", sluice_queue_id="orders-to-b") >= 1
        assert metric_value(text, "sluice_batches_resent_total", sluice_queue_id="orders-to-b") == 0
        assert metric_value(text, "sluice_alerts_total", sluice_alert_name="alert_threshold") == 0
        assert metric_value(text, "sluice_batches_sent_total",
                            messaging_destination_name=f"{unique_prefix}a.queue.orders-to-b") >= 1
        # Everything acknowledged and removed: the queue is empty again.
        wait_for(lambda: metric_value(scrape(sender), "sluice_queue_size", sluice_queue_id="orders-to-b") == 0,
                 timeout_s=DRAIN_S, what="sluice_queue_size 0 once everything is acknowledged", poll_s=0.5)
        assert metric_value(scrape(sender), "sluice_queue_oldest_event_age_seconds", sluice_queue_id="orders-to-b") == 0

        text = settled(dispatcher, "sluice_events_delivered_total", 50, sluice_queue_id="audit")
        assert metric_value(text, "sluice_events_delivered_total", sluice_queue_id="audit") == 50
        assert metric_value(text, "sluice_listener_duration_seconds_count", sluice_queue_id="audit") >= 1
        assert metric_value(text, "sluice_failovers_total", sluice_queue_id="audit") >= 0

        text = settled(receiver, "sluice_events_applied_total", 50, sluice_component="receiver")
        assert metric_value(text, "sluice_events_applied_total", sluice_site="b") == 50
        assert metric_value(text, "sluice_events_duplicates_discarded_total", sluice_duplicate_of="event") == 0
        assert metric_value(text, "sluice_batches_rejected_total") == 0

        text = settled(region_a, "sluice_events_applied_total", 50, sluice_component="region")
        assert metric_value(text, "sluice_conflicts_resolved_total", sluice_site="a") == 0

        text = scrape(subscriptions)
        assert metric_value(text, "sluice_alerts_total", sluice_alert_name="durable_client_timeout") == 0
        assert "target_info{" in text and 'service_name="sluice-subscriptions"' in text

        assert httpx.get(f"{sender.metrics_url}/nothing", timeout=5).status_code == 404
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_metrics_port_off_and_a_taken_port(site_a, unique_prefix, tmp_path: Path) -> None:
    """SLUICE_METRICS_PORT=off serves nothing; a port already taken stops the service before it starts."""
    path_a, _ = write_sites(tmp_path, site_a.bootstrap, unique_prefix)
    with SenderProcess(path_a, "orders-to-b", tmp_path / "off.log", env={"SLUICE_METRICS_PORT": "off"}) as off:
        assert off.metrics_url == ""
    with SenderProcess(path_a, "orders-to-b", tmp_path / "first.log") as first:
        port = first.metrics_url.rsplit(":", 1)[1]
        with pytest.raises(RuntimeError, match=f"cannot serve /metrics on port {port}: .*Address already in use"):
            SenderProcess(path_a, "orders-to-b", tmp_path / "second.log", env={"SLUICE_METRICS_PORT": port},
                          start_timeout_s=30)


def test_json_logs_and_the_alert_threshold_as_a_log_record_and_a_metric(site_a, unique_prefix,
                                                                         tmp_path: Path) -> None:
    """No receiver at b: a's queue waits past alert_threshold_ms, and the sender's ALERT is a
    JSON log record with its facts as fields, and counted in sluice.alerts."""
    path_a, _ = write_sites(tmp_path, site_a.bootstrap, unique_prefix, alert_threshold_ms=300)
    log = tmp_path / "sender.log"
    with RegionProcess(path_a, tmp_path / "region-a.log") as region, \
            SenderProcess(path_a, "orders-to-b", log, env={"SLUICE_LOG_FORMAT": "json"}) as sender:
        region.wait_ready()
        RegionClient([region.url]).put("orders", "k1", {"n": 1})
        wait_for(lambda: "ALERT" in log.read_text(), timeout_s=ALERT_S, what="an ALERT in the sender's log",
                 poll_s=0.3)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
        alert = next(r for r in records if r["message"].startswith("ALERT"))
        assert alert["level"] == "WARNING" and alert["logger"] == "sluice.queue"
        assert alert["alert"] == "alert_threshold" and alert["queue_id"] == "orders-to-b"
        assert alert["alert_threshold_ms"] == 300 and alert["oldest_age_ms"] > 300 and alert["waiting"] >= 1
        assert metric_value(scrape(sender), "sluice_alerts_total", sluice_alert_name="alert_threshold",
                            sluice_queue_id="orders-to-b") >= 1
        assert metric_value(scrape(sender), "sluice_queue_oldest_event_age_seconds",
                            sluice_queue_id="orders-to-b") > 0.3
