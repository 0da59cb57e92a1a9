"""This instance's entry in the region instance directory: its claims, published on the status topic.

The records, the trust a reader puts in them and the readers (``OwnerDirectory``,
``read_instances``, ``live_urls``) are the contract between the region service and
everyone who needs an instance (gateway receivers, the status page, ``sluice admin``),
so they live in ``sluice.core.directory``, whose docstring tells the story.  What only
a region-service instance does is here: publish its own ``RegionInstance`` record,
signed with the member token, whenever its assignment changes and every
``HEARTBEAT_S``, and say ``stopped`` when it leaves cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..core.codec import get_codec
from ..core.directory import HEARTBEAT_S, KEY_PREFIX, MemberTrust
from ..core.errors import SluiceError
from ..core.kafka import Producer, kafka_errors, make_producer

if TYPE_CHECKING:
    from ..core.config import SiteConfig

log = logging.getLogger("sluice.region.directory")


class DirectoryPublisher:
    """This instance's claims, published on change and every ``HEARTBEAT_S``."""

    def __init__(self, cfg: SiteConfig, instance: str, url: str, trust: MemberTrust | None = None) -> None:
        self._codec = get_codec()
        self._trust = trust or MemberTrust.from_config(cfg, url)
        self._topic = cfg.topics.status()
        self._key = KEY_PREFIX + instance.encode()
        self._instance = instance
        self._url = url
        self._producer: Producer = make_producer(cfg.kafka.client_settings(), **{"client.id": f"{instance}-directory"})
        self._claims: list[tuple[str, int, int]] = []
        self._standbys: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._last = 0.0

    def publish(self, claims: list[tuple[str, int, int]] | None = None, state: str = "running") -> None:
        with self._lock:
            if claims is not None:
                self._claims = sorted(claims)
            record = {"instance": self._instance, "url": self._url, "state": state,
                      "buckets": [{"region": r, "bucket": b, "since": since} for r, b, since in self._claims],
                      "updated_at": int(time.time() * 1000),
                      "standbys": [] if state != "running" else self._standbys}
            self._last = time.monotonic()
        value = self._codec.encode("RegionInstance", record)
        try:
            with kafka_errors("publishing this instance's buckets"):
                self._producer.produce(self._topic, value, self._key, headers=self._trust.headers(self._key, value))
                self._producer.poll(0)
        except SluiceError as exc:
            log.warning("%s", exc)

    def set_standbys(self, standbys: list[tuple[str, int, int, int, int]]) -> None:
        """The standby copies the next record names: (region, bucket, lag, entries, value bytes)."""
        with self._lock:
            self._standbys = [{"region": r, "bucket": b, "lag": lag, "entries": n, "value_bytes": size}
                              for r, b, lag, n, size in standbys]

    def heartbeat(self) -> None:
        if time.monotonic() - self._last >= HEARTBEAT_S:
            self.publish()

    def close(self) -> None:
        """Say this instance stopped (it left its group cleanly), and flush."""
        self.publish([], state="stopped")
        self._producer.flush(5)


__all__ = ["DirectoryPublisher"]
