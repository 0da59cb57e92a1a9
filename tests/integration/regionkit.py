"""Real region-service processes and queue readers for integration tests.

A ``RegionProcess`` is ``python -m sluice.cli region -c FILE --port 0`` in a
process of its own, so a test can kill -9 it.  ``read_queue`` reads a queue
topic from the beginning with a plain consumer and decodes every record.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from confluent_kafka import Consumer, TopicPartition

from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent
from sluice.core.topics import apply_topics

REPO = Path(__file__).resolve().parents[2]


def write_site(
    path: Path,
    *,
    site: str,
    bootstrap: str,
    prefix: str,
    buckets: int = 8,
    serial_threads: int = 3,
    extra: dict[str, Any] | None = None,
) -> SiteConfig:
    """A site file with region ``orders``: a parallel sender and a serial async event queue."""
    data: dict[str, Any] = {
        "site": site,
        "dsid": 1,
        "kafka": {
            "bootstrap_servers": bootstrap,
            "topic_prefix": prefix,
            "session_timeout_ms": 3000,
            "heartbeat_interval_ms": 500,
            "max_poll_interval_ms": 30000,
        },
        "regions": [
            {
                "name": "orders",
                "buckets": buckets,
                "gateway_senders": ["to-b"],
                "async_event_queues": ["writer"],
                "key_max_bytes": 128,
                "value_max_bytes": 4096,
            }
        ],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True}],
        "async_event_queues": [{"id": "writer", "parallel": False, "dispatcher_threads": serial_threads}],
        "region_service": {"request_timeout_s": 20, "load_timeout_s": 30},
    }
    if extra:
        data.update(extra)
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    report = apply_topics(cfg)
    assert report.ok, report
    return cfg


class RegionProcess:
    """One region-service instance in its own process."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "region", "-c", str(config_path), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=REPO,
        )
        self.url = self._read_url(timeout_s=30)

    def _read_url(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            line = self.proc.stdout.readline().decode()
            if not line:
                break
            if line.startswith("region service "):
                return line.split(" on ", 1)[1].split(" ", 1)[0]
        raise RuntimeError(f"region service did not start; log:\n{self.log_path.read_text()[-3000:]}")

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready in {timeout_s}s; log:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """kill -9: no revoke, no flush, no commit."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing, heartbeats included."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def write_aeq_site(path: Path, *, site: str, bootstrap: str, prefix: str, queue: dict[str, Any],
                   buckets: int = 8) -> SiteConfig:
    """A site file with region ``orders`` feeding one async event queue ``queue``."""
    data: dict[str, Any] = {
        "site": site,
        "dsid": 1,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500, "max_poll_interval_ms": 30000},
        "regions": [{"name": "orders", "buckets": buckets, "async_event_queues": [queue["id"]]}],
        "async_event_queues": [queue],
        "region_service": {"request_timeout_s": 20, "load_timeout_s": 30},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    report = apply_topics(cfg)
    assert report.ok, report
    return cfg


class DispatcherProcess:
    """One dispatcher of an async event queue in its own process."""

    def __init__(self, config_path: Path, queue_id: str, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        here = str(Path(__file__).resolve().parent)
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "dispatcher", "-c", str(config_path), "--queue", queue_id],
            stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=REPO,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("dispatcher "):
            raise RuntimeError(f"dispatcher did not start; log:\n{log_path.read_text()[-3000:]}")
        self.member_id = line.split()[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


@dataclass(frozen=True)
class QueueRecord:
    partition: int
    offset: int
    queue_id: str
    changelog_partition: int
    changelog_offset: int
    event: EntryEvent


def read_topic(bootstrap: str, topic: str, partitions: int) -> list[tuple[int, int, bytes | None]]:
    """Every record of a topic: (partition, offset, value), partition by partition."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": "sluice-test-reader",
        "fetch.wait.max.ms": 10,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    })
    out: list[tuple[int, int, bytes | None]] = []
    try:
        for p in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            last = low - 1
            end = time.monotonic() + 60
            while last < high - 1 and time.monotonic() < end:
                # consume() waits its whole timeout for a partial batch: keep it short.
                for msg in consumer.consume(1000, 0.05):
                    if msg.error() is None:
                        out.append((p, msg.offset(), msg.value()))
                        last = msg.offset()
            consumer.unassign()
    finally:
        consumer.close()
    return out


def read_queue(bootstrap: str, topic: str, partitions: int) -> list[QueueRecord]:
    codec = get_codec()
    records = []
    for p, offset, value in read_topic(bootstrap, topic, partitions):
        r = codec.decode_as("QueuedEvent", value)
        records.append(QueueRecord(p, offset, r["queue_id"], r["changelog_partition"], r["changelog_offset"],
                                   EntryEvent.from_record(r["event"])))
    return records


def end_offsets(bootstrap: str, topic: str, partitions: int) -> list[int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "sluice-test-offsets"})
    try:
        return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
    finally:
        consumer.close()
