"""Site files, entry events and a producer for the pipeline tests (records as the services write them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import KafkaError, Message, Producer

from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import partition_for_key
from sluice.core.topics import apply_topics

__all__ = ["DRIVER_JAVA_OPTIONS", "Produced", "encode", "entry_event", "produce", "write_site"]

#: The JVM options of every Spark driver the pipeline tests start (issue 21): serial GC and the C1 compiler
#: only, as the embedded brokers have.  The jobs here run seconds on a few hundred rows, where C2's compilations
#: cost more than they return: a session start and one small job took 13 CPU-seconds instead of 26.
DRIVER_JAVA_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"


def write_site(path: Path, *, site: str, dsid: int, bootstrap: str, prefix: str,
               regions: dict[str, int], sender: str | None = None, remote_prefix: str | None = None,
               accepted_dsids: list[int] | None = None) -> SiteConfig:
    """A site file with ``regions`` (name → buckets), each feeding parallel gateway sender ``sender``
    when given (to the site of topic prefix ``remote_prefix`` on the same cluster, when given), and a
    gateway receiver when ``accepted_dsids`` is; its topics are created."""
    data: dict[str, Any] = {
        "site": site,
        "dsid": dsid,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix},
        "regions": [{"name": name, "buckets": buckets, **({"gateway_senders": [sender]} if sender else {})}
                    for name, buckets in regions.items()],
    }
    if sender:
        data["gateway_senders"] = [{"id": sender, "remote_dsid": 3 - dsid if dsid in (1, 2) else 1,
                                    "parallel": True}]
        if remote_prefix:
            data["gateway_senders"][0].update(batch_size=50, batch_time_interval_ms=20,
                                              remote={"bootstrap_servers": bootstrap, "topic_prefix": remote_prefix})
    if accepted_dsids:
        data["receiver"] = {"inbound_partitions": 2, "accepted_dsids": accepted_dsids}
    if remote_prefix or accepted_dsids:
        # Its services run: a dead member's work moves within seconds.
        data["kafka"].update(session_timeout_ms=3000, heartbeat_interval_ms=500)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    report = apply_topics(cfg)
    assert report.ok, report
    return cfg


def entry_event(region: str, key: str, seq: int, *, buckets: int, op: Operation = Operation.UPDATE,
                value: bytes | None = b"{}", dsid: int = 1, timestamp: int = 1_700_000_000_000,
                entry_version: int = 1, member: str = "writer") -> EntryEvent:
    """An applied event as the region service of site ``dsid`` writes it to the changelog."""
    return EntryEvent(
        region=region, key=key, operation=op, value=None if op.removes_value else value,
        event_id=EventID(member, 1, seq), version=VersionTag(dsid, timestamp, entry_version, f"{member}-0"),
        origin_dsid=dsid, bucket=partition_for_key(key.encode(), buckets), event_time=timestamp,
    )


@dataclass(frozen=True)
class Produced:
    """Where one produced record went."""

    topic: str
    partition: int
    offset: int


def produce(bootstrap: str, records: list[tuple[str, bytes | None, bytes | None, int]]) -> list[Produced]:
    """Produce (topic, key, value, partition) records in order and wait; their positions, in the same order."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                         "linger.ms": 5})
    positions: dict[int, Produced] = {}
    errors: list[KafkaError] = []

    def delivered(n: int) -> Any:
        def report(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                errors.append(err)
            else:
                positions[n] = Produced(msg.topic(), msg.partition(), msg.offset())
        return report

    for n, (topic, key, value, partition) in enumerate(records):
        producer.produce(topic, value, key, partition=partition, on_delivery=delivered(n))
        producer.poll(0)
    assert producer.flush(30) == 0 and not errors, errors
    return [positions[n] for n in range(len(records))]


def encode(name: str, record: dict[str, Any]) -> bytes:
    return get_codec().encode(name, record)
