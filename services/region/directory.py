"""Who owns which bucket: each region-service instance's claims, on the site's compacted status topic.

Every instance publishes a ``RegionInstance`` record under ``region/<instance>``:
its URL and the buckets it owns, each with the time it was assigned it
(``since``), whenever its assignment changes and every few seconds.  Readers
(the other instances, which forward a write to its bucket's owner; gateway
receivers, which need any instance; the status page) tail the topic and take,
for each bucket, the claim with the latest ``since``: a new owner is assigned
a bucket after its old owner lost it, so a dead instance's claim is
superseded as soon as its successor is assigned, and an instance that left
cleanly says so (``state: stopped``).

This replaces describing the region's consumer group with the admin API:
librdkafka's coordinator-bound admin requests abort the process when the
broker connection drops under them (confluentinc/librdkafka#4605), and a
broker restart is exactly when every instance would be asking.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..core.codec import get_codec
from ..core.config import SiteConfig
from ..core.errors import CodecError
from ..core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaException,
    Producer,
    TopicPartition,
    make_consumer,
    make_producer,
    read_to_end,
)

log = logging.getLogger("sluice.region.directory")

KEY_PREFIX = b"region/"
#: How often a running instance publishes its claims again, and how old a record may be before its
#: instance counts as gone for ``live_urls`` (a killed instance publishes nothing more).
HEARTBEAT_S = 5.0
LIVE_WITHIN_S = 4 * HEARTBEAT_S


@dataclass(frozen=True, slots=True)
class Instance:
    """One ``RegionInstance`` record."""

    instance: str
    url: str
    state: str
    claims: tuple[tuple[str, int, int], ...]  # (region, bucket, since_ms)
    updated_at: int

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "Instance":
        return cls(r["instance"], r["url"], r["state"],
                   tuple((c["region"], c["bucket"], c["since"]) for c in r["buckets"]), r["updated_at"])


def owners_of(instances: dict[str, Instance]) -> dict[tuple[str, int], str]:
    """(region, bucket) → URL of the latest claim among running instances."""
    best: dict[tuple[str, int], tuple[int, str]] = {}
    for inst in instances.values():
        if inst.state != "running":
            continue
        for region, bucket, since in inst.claims:
            if (region, bucket) not in best or since > best[(region, bucket)][0]:
                best[(region, bucket)] = (since, inst.url)
    return {rb: url for rb, (_, url) in best.items()}


def live_urls(instances: dict[str, Instance], now_ms: int | None = None) -> list[str]:
    """URLs of the running instances heard from lately (all running ones when none is that fresh)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    running = [i for i in instances.values() if i.state == "running"]
    fresh = [i for i in running if now_ms - i.updated_at <= LIVE_WITHIN_S * 1000]
    return sorted({i.url for i in (fresh or running)})


def _decode(codec: Any, key: bytes | None, value: bytes | None) -> tuple[str, Instance | None] | None:
    if not key or not key.startswith(KEY_PREFIX):
        return None
    name = key[len(KEY_PREFIX):].decode("utf-8", "replace")
    if value is None:
        return name, None
    try:
        return name, Instance.from_record(codec.decode_as("RegionInstance", value))
    except (CodecError, KeyError, ValueError):
        return None


def read_instances(cfg: SiteConfig, deadline_s: float = 10.0) -> dict[str, Instance]:
    """Every instance record, read once from the start of the status topic to its end."""
    codec = get_codec()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    found: dict[str, Instance] = {}
    try:
        for msg in read_to_end(consumer, cfg.topics.status(), 0, deadline_s=deadline_s):
            item = _decode(codec, msg.key(), msg.value())
            if item is not None:
                if item[1] is None:
                    found.pop(item[0], None)
                else:
                    found[item[0]] = item[1]
    finally:
        consumer.close()
    return found


class DirectoryPublisher:
    """This instance's claims, published on change and every ``HEARTBEAT_S``."""

    def __init__(self, cfg: SiteConfig, instance: str, url: str) -> None:
        self._codec = get_codec()
        self._topic = cfg.topics.status()
        self._key = KEY_PREFIX + instance.encode()
        self._instance = instance
        self._url = url
        self._producer: Producer = make_producer(cfg.kafka.client_settings(), **{"client.id": f"{instance}-directory"})
        self._claims: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._last = 0.0

    def publish(self, claims: list[tuple[str, int, int]] | None = None, state: str = "running") -> None:
        with self._lock:
            if claims is not None:
                self._claims = sorted(claims)
            record = {"instance": self._instance, "url": self._url, "state": state,
                      "buckets": [{"region": r, "bucket": b, "since": since} for r, b, since in self._claims],
                      "updated_at": int(time.time() * 1000)}
            self._last = time.monotonic()
        try:
            self._producer.produce(self._topic, self._codec.encode("RegionInstance", record), self._key)
            self._producer.poll(0)
        except (BufferError, KafkaException) as exc:
            log.warning("publishing this instance's buckets: %s", exc)

    def heartbeat(self) -> None:
        if time.monotonic() - self._last >= HEARTBEAT_S:
            self.publish()

    def close(self) -> None:
        """Say this instance stopped (it left its group cleanly), and flush."""
        self.publish([], state="stopped")
        self._producer.flush(5)


class OwnerDirectory:
    """Who owns which bucket, from the instances' records (see the module docstring).

    ``refresh()`` reads what arrived since the last call; the first call reads the topic from its start.
    """

    def __init__(self, cfg: SiteConfig) -> None:
        self._codec = get_codec()
        self._topic = cfg.topics.status()
        self._consumer: Consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
        self._consumer.assign([TopicPartition(self._topic, 0, OFFSET_BEGINNING)])
        self._instances: dict[str, Instance] = {}
        self._owners: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()
        self._reading = threading.Lock()

    def refresh(self) -> None:
        with self._reading:
            self._read()

    def _read(self) -> None:
        changed = False
        while True:
            try:
                msgs = self._consumer.consume(1000, 0.05)
            except KafkaException as exc:
                log.debug("reading %s: %s", self._topic, exc)
                break
            if not msgs:
                break
            for msg in msgs:
                if msg.error() is not None:
                    continue
                item = _decode(self._codec, msg.key(), msg.value())
                if item is None:
                    continue
                changed = True
                if item[1] is None:
                    self._instances.pop(item[0], None)
                else:
                    self._instances[item[0]] = item[1]
        if changed:
            with self._lock:
                self._owners = owners_of(self._instances)

    def owner(self, region: str, bucket: int) -> str | None:
        with self._lock:
            return self._owners.get((region, bucket))

    def table(self) -> dict[tuple[str, int], str]:
        with self._lock:
            return dict(self._owners)

    def close(self) -> None:
        self._consumer.close()
