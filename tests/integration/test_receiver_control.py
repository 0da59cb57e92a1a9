"""Geode's receiver settings with their effect, on a real broker, region service and receiver process:
``receiver.manual_start`` (the receiver applies nothing until ``sluice admin start --receiver``) and
``receiver.max_time_between_pings_ms`` (a remote sender heard from no longer is shown not connected)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
import yaml

from sluice.admin.cli import receiver_status
from sluice.client import RegionClient
from sluice.core.config import load_config
from sluice.core.events import Operation
from sluice.core.kafka import describe_group_members, make_admin
from sluice.core.processes import REPO, ReceiverProcess
from sluice.core.topics import apply_topics

from regionkit import RegionProcess, read_topic
from test_health_endpoints import metric_value
from test_receiver import _acks, _event, _send
from waiting import wait_for

pytestmark = pytest.mark.timeout(240)


def _site_b(path: Path, bootstrap: str, prefix: str, **receiver: Any) -> Any:
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1], **receiver},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


def _admin(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def _wait(condition: Callable[[], Any], what: str, timeout_s: float = 30) -> Any:
    return wait_for(condition, timeout_s=timeout_s, what=what, poll_s=0.2)


def _report(cfg: Any, member: str) -> dict[str, Any]:
    return next((r for r in receiver_status(cfg) if r["member"] == member), {})


def _reported_after(cfg: Any, member: str, after_ms: int) -> dict[str, Any]:
    """The receiver's report once one written after ``after_ms`` came: its loop went on turning since."""
    return _wait(lambda: (r := _report(cfg, member)) and r["updated_at"] > after_ms and r, f"a report of {member} "
                 f"after {after_ms}")


def test_a_manually_started_receiver_applies_nothing_until_started(site_a, unique_prefix, tmp_path: Path):
    """manual_start: the receiver runs (healthy, ready, reporting) but stays out of the inbound topic's consumer
    group and applies nothing, however long a batch waits, until `sluice admin start --receiver`; `stop
    --receiver` takes it out again and what comes meanwhile waits for the next start."""
    path = tmp_path / "site-b.yaml"
    cfg = _site_b(path, site_a.bootstrap, site_a.topic_prefix(unique_prefix), manual_start=True)
    region = RegionProcess(path, tmp_path / "region.log")
    procs: list[Any] = [region]
    try:
        region.wait_ready()
        client = RegionClient([region.url])
        receiver = ReceiverProcess(path, tmp_path / "receiver.log")
        procs.append(receiver)
        assert _wait(lambda: _report(cfg, receiver.member_id).get("state") == "stopped", "a stopped report")
        assert httpx.get(f"{receiver.metrics_url}/readyz", timeout=5).status_code == 200, "stopped on purpose: ready"

        sent_ms = int(time.time() * 1000)
        _send(cfg, site_a.bootstrap, 1, [_event("k1", Operation.CREATE, b"1", 1)])
        # Two reports after the batch was written: the receiver kept running, and took nothing.
        _reported_after(cfg, receiver.member_id, sent_ms + 2 * 2000)
        assert read_topic(site_a.bootstrap, cfg.topics.gateway_acks(), 2) == []
        assert client.get_entry("orders", "k1") is None
        assert describe_group_members(make_admin(cfg.kafka.client_settings()),
                                      f"{cfg.kafka.topic_prefix}gateway.receiver") == []

        refused = _admin(path, "pause", "--receiver")
        assert refused.returncode == 2 and "started or stopped" in refused.stderr, refused.stderr
        started = _admin(path, "start", "--receiver")
        assert started.returncode == 0, started.stderr
        assert _acks(cfg, site_a.bootstrap, 1)[0]["batch_id"] == 1
        assert client.get("orders", "k1") == 1
        assert _wait(lambda: (r := _report(cfg, receiver.member_id)).get("state") == "running" and r["partitions"],
                     "a running report with partitions")
        assert "started: joining consumer group" in receiver.log_tail(100_000)

        stopped = _admin(path, "stop", "--receiver")
        assert stopped.returncode == 0, stopped.stderr
        report = _wait(lambda: (r := _report(cfg, receiver.member_id)).get("state") == "stopped"
                       and not r["partitions"] and r, "a stopped report without partitions")
        sent_ms = int(time.time() * 1000)
        _send(cfg, site_a.bootstrap, 2, [_event("k2", Operation.CREATE, b"2", 2)])
        _reported_after(cfg, receiver.member_id, max(sent_ms, report["updated_at"]) + 2 * 2000)
        assert len(read_topic(site_a.bootstrap, cfg.topics.gateway_acks(), 2)) == 1
        assert client.get_entry("orders", "k2") is None

        assert _admin(path, "start", "--receiver").returncode == 0
        assert _acks(cfg, site_a.bootstrap, 2)[1]["batch_id"] == 2
        assert client.get("orders", "k2") == 2
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_sender_not_heard_from_within_max_time_between_pings_is_not_connected(site_a, unique_prefix,
                                                                                tmp_path: Path):
    """max_time_between_pings_ms: a sender whose batch came within it is connected (status and gauge); once
    no batch came for that long it is not connected (logged); its next batch connects it again."""
    path = tmp_path / "site-b.yaml"
    cfg = _site_b(path, site_a.bootstrap, site_a.topic_prefix(unique_prefix), max_time_between_pings_ms=3000)
    region = RegionProcess(path, tmp_path / "region.log")
    procs: list[Any] = [region]
    try:
        region.wait_ready()
        receiver = ReceiverProcess(path, tmp_path / "receiver.log")
        procs.append(receiver)

        def sender_state() -> dict[str, Any] | None:
            senders = _report(cfg, receiver.member_id).get("senders", [])
            return next((s for s in senders if (s["source_dsid"], s["sender_id"]) == (1, "orders-to-b")), None)

        def gauge() -> float:
            text = httpx.get(f"{receiver.metrics_url}/metrics", timeout=5).text
            return metric_value(text, "sluice_gateway_sender_connected", sluice_sender_id="orders-to-b")

        _send(cfg, site_a.bootstrap, 1, [_event("k1", Operation.CREATE, b"1", 1)])
        _acks(cfg, site_a.bootstrap, 1)
        first = _wait(lambda: (s := sender_state()) and s["connected"] and s, "the sender connected")
        assert first["batches"] == 1 and gauge() == 1
        quiet = _wait(lambda: (s := sender_state()) and not s["connected"] and s, "the sender not connected")
        assert quiet["last_heard_at"] == first["last_heard_at"] and gauge() == 0
        assert "sender orders-to-b of dsid 1 not connected: no batch for" in receiver.log_tail(100_000)
        shown = _admin(path, "status")
        assert shown.returncode == 0 and "not connected" in shown.stdout, shown.stdout + shown.stderr

        _send(cfg, site_a.bootstrap, 2, [_event("k2", Operation.CREATE, b"2", 2)])
        _acks(cfg, site_a.bootstrap, 2)
        again = _wait(lambda: (s := sender_state()) and s["connected"] and s["batches"] == 2 and s,
                      "the sender connected again")
        assert again["last_heard_at"] > first["last_heard_at"] and gauge() == 1
        assert "sender orders-to-b of dsid 1 connected again" in receiver.log_tail(100_000)
    finally:
        for proc in reversed(procs):
            proc.stop()
