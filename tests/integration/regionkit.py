"""Site files, service processes and queue readers for integration tests.

``RegionProcess`` and ``DispatcherProcess`` (sluice.core.processes) run the
services in processes of their own, so a test can kill -9 or SIGSTOP them.
``read_queue`` reads a queue topic from the beginning with a plain consumer
and decodes every record.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from confluent_kafka import Consumer, TopicPartition

from sluice.core import processes
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent
from sluice.core.kafka import consumed_position, make_consumer, read_to_end, until_answered
from sluice.core.processes import RegionProcess
from sluice.core.topics import apply_topics

from waiting import wait_for

__all__ = ["DSIDS", "SITE_KAFKA", "DispatcherProcess", "RegionProcess", "TwoSites", "apply_site_file", "start_two_regions", "end_offsets",
           "queue_in_state", "queue_size", "read_queue", "read_topic", "remote", "site_data", "wait_standbys",
           "write_aeq_site", "write_site", "write_two_sites", "write_two_way_sites"]


def write_site(
    path: Path,
    *,
    site: str,
    bootstrap: str,
    prefix: str,
    buckets: int = 8,
    serial_threads: int = 3,
    extra: dict[str, Any] | None = None,
    redundant_copies: int = 0,
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
                "redundant_copies": redundant_copies,
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


#: The Kafka client timing of every simulated site: short sessions, so that a killed member's work moves
#: within seconds.
SITE_KAFKA = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
#: The distributed-system id of each simulated site.
DSIDS = {"a": 1, "b": 2, "c": 3}


def remote(bootstrap: str, prefix: str, site: str) -> dict[str, Any]:
    """The ``remote`` block of a gateway sender to ``site``: its cluster and its topic prefix within the test."""
    return {"bootstrap_servers": bootstrap, "topic_prefix": f"{prefix}{site}."}


def site_data(site: str, bootstrap: str, prefix: str, *, kafka: dict[str, Any] | None = None,
              **sections: Any) -> dict[str, Any]:
    """The site file of ``site`` (its dsid from DSIDS): Kafka at ``bootstrap`` with SITE_KAFKA's timing (or
    ``kafka``'s settings over it), topics under ``<prefix><site>.``, and ``sections`` (regions,
    gateway_senders, receiver, ...) as given."""
    return {"site": site, "dsid": DSIDS[site],
            "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": f"{prefix}{site}.", **SITE_KAFKA,
                      **(kafka or {})},
            **sections}


def apply_site_file(path: Path, data: dict[str, Any]) -> SiteConfig:
    """Write ``data`` as a site file at ``path``, load it and create its topics; the loaded configuration."""
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    report = apply_topics(cfg)
    assert report.ok, report
    return cfg


@dataclass(frozen=True)
class TwoSites:
    """Site a (dsid 1) and site b (dsid 2): their files and loaded configurations, topics created."""

    path_a: Path
    path_b: Path
    cfg_a: SiteConfig
    cfg_b: SiteConfig


def write_two_sites(tmp_path: Path, bootstrap: str, prefix: str, *, a: dict[str, Any], b: dict[str, Any],
                    bootstrap_b: str | None = None, kafka: dict[str, Any] | None = None) -> TwoSites:
    """The two-site setup of the gateway tests: ``tmp_path/site-a.yaml`` with the sections ``a`` and
    ``tmp_path/site-b.yaml`` with ``b`` (see site_data; ``kafka`` for other client timing), both on
    ``bootstrap`` unless b has its own cluster (``bootstrap_b``), every topic created."""
    path_a, path_b = tmp_path / "site-a.yaml", tmp_path / "site-b.yaml"
    cfg_a = apply_site_file(path_a, site_data("a", bootstrap, prefix, kafka=kafka, **a))
    cfg_b = apply_site_file(path_b, site_data("b", bootstrap_b or bootstrap, prefix, kafka=kafka, **b))
    return TwoSites(path_a, path_b, cfg_a, cfg_b)


def start_two_regions(path_a: Path, path_b: Path, tmp_path: Path, procs: list[Any], *,
                      ready_s: float = 60.0) -> tuple[RegionProcess, RegionProcess]:
    """Site a's and site b's region instance (logs ``region-a.log``, ``region-b.log`` in ``tmp_path``),
    each answering /readyz; both are in ``procs`` before either is waited on, so the caller's
    ``finally`` stops them whatever happens."""
    region_a = RegionProcess(path_a, tmp_path / "region-a.log")
    region_b = RegionProcess(path_b, tmp_path / "region-b.log")
    procs += [region_a, region_b]
    region_a.wait_ready(ready_s)
    region_b.wait_ready(ready_s)
    return region_a, region_b


def write_two_way_sites(tmp_path: Path, bootstrap: str, prefix: str, *, buckets: int, sender: dict[str, Any],
                        region: dict[str, dict[str, Any]] | None = None, a: dict[str, Any] | None = None,
                        b: dict[str, Any] | None = None) -> TwoSites:
    """A→B and B→A (write_two_sites): each site has region ``orders`` feeding a parallel gateway sender
    ``to-<other>`` (settings ``sender``) and a receiver (2 inbound partitions) accepting the other;
    ``region[site]`` adds settings to that site's region, ``a``/``b`` sections to its file."""
    def sections(site: str, other: str, extra: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "regions": [{"name": "orders", "buckets": buckets, "gateway_senders": [f"to-{other}"],
                         **(region or {}).get(site, {})}],
            "gateway_senders": [{"id": f"to-{other}", "remote_dsid": DSIDS[other], "parallel": True,
                                 "remote": remote(bootstrap, prefix, other), **sender}],
            "receiver": {"inbound_partitions": 2, "accepted_dsids": [DSIDS[other]]},
            **(extra or {}),
        }

    return write_two_sites(tmp_path, bootstrap, prefix, a=sections("a", "b", a), b=sections("b", "a", b))


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


class DispatcherProcess(processes.DispatcherProcess):
    """A dispatcher that can load the test listeners of this folder."""

    def __init__(self, config_path: Path, queue_id: str, log_path: Path) -> None:
        super().__init__(config_path, queue_id, log_path, extra_path=[str(Path(__file__).resolve().parent)])


@dataclass(frozen=True)
class QueueRecord:
    partition: int
    offset: int
    queue_id: str
    changelog_partition: int
    changelog_offset: int
    event: EntryEvent


def wait_standbys(keeper: RegionProcess, owner: RegionProcess, timeout_s: float = 60.0) -> set[int]:
    """Until ``keeper`` holds a standby copy, caught up, of every bucket ``owner`` owns; those buckets."""
    def kept_copies() -> set[int] | None:
        rows = httpx.get(f"{keeper.url}/buckets", timeout=10).json()["buckets"]
        theirs = {r["bucket"] for r in rows if r["owner"] == owner.url}
        kept = {r["bucket"] for r in rows
                if any(s["url"] == keeper.url and 0 <= s["lag"] <= 1 for s in r["standbys"])}
        return theirs if theirs and theirs <= kept else None

    return wait_for(kept_copies, timeout_s=timeout_s, poll_s=0.2,
                    what=f"{keeper.url} keeps a caught-up copy of every bucket of {owner.url}")


def read_topic(bootstrap: str, topic: str, partitions: int,
               isolation_level: str = "read_committed") -> list[tuple[int, int, bytes | None]]:
    """Every record of a topic: (partition, offset, value), partition by partition; committed records
    only unless ``isolation_level`` is read_uncommitted."""
    return [(p, offset, value) for p, offset, value, _ in read_records(bootstrap, topic, partitions, isolation_level)]


def read_records(bootstrap: str, topic: str, partitions: int, isolation_level: str = "read_committed",
                 ) -> list[tuple[int, int, bytes | None, list[tuple[str, bytes]]]]:
    """``read_topic`` with each record's headers: (partition, offset, value, headers)."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": "sluice-test-reader",
        "fetch.wait.max.ms": 10,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": isolation_level,
    })
    out: list[tuple[int, int, bytes | None, list[tuple[str, bytes]]]] = []
    try:
        for p in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            position = low
            end = time.monotonic() + 60
            # Positions, not the last record's offset: transaction markers and
            # aborted records occupy offsets up to the end (sluice.core.kafka).
            while position < high and time.monotonic() < end:
                # consume() waits its whole timeout for a partial batch: keep it short.
                for msg in consumer.consume(1000, 0.05):
                    if msg.error() is None:
                        out.append((p, msg.offset(), msg.value(), msg.headers() or []))
                        position = max(position, msg.offset() + 1)
                position = max(position, consumed_position(consumer, TopicPartition(topic, p)))
            assert position >= high, f"{topic}[{p}]: read to {position} of {high} in 60 s"
            consumer.unassign()
    finally:
        consumer.close()
    return out


def read_queue(bootstrap: str, topic: str, partitions: int,
               isolation_level: str = "read_committed") -> list[QueueRecord]:
    codec = get_codec()
    records = []
    for p, offset, value in read_topic(bootstrap, topic, partitions, isolation_level):
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


def control_records(cfg: SiteConfig) -> list[tuple[str, str]]:
    """(queue, state) of every control record, oldest first (asked again while a new topic has no leader yet)."""
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        messages = until_answered(lambda: list(read_to_end(consumer, cfg.topics.control())),
                                  "reading the control topic", stopping=threading.Event())
    finally:
        consumer.close()
    records = [get_codec().decode_as("ControlRecord", m.value()) for m in messages if m.value() is not None]
    return [(r["target_id"], r["state"]) for r in records]


def queue_size(cfg: SiteConfig, queue_id: str) -> int:
    """Events waiting in every partition of a queue, as its primaries last reported (``sluice admin status``)."""
    from sluice.admin.cli import queue_status

    return sum(row.size for row in queue_status(cfg, queue_id))


def queue_in_state(cfg: SiteConfig, queue_id: str, state: str) -> bool:
    """Every partition of the queue has a primary, and each reports ``state`` ("running", "paused", "stopped")."""
    from sluice.admin.cli import queue_status

    rows = queue_status(cfg, queue_id)
    return bool(rows) and all(row.primary != "—" and row.state == state for row in rows)
