"""Client subscriptions against a real broker, region service and subscription-service processes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.client import ALL_KEYS, ClientCache, RegionClient, ResultPolicy
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent
from sluice.core.processes import SubscriptionsProcess
from sluice.core.topics import apply_topics

from regionkit import RegionProcess, read_topic

pytestmark = pytest.mark.timeout(240)


def _site(path: Path, bootstrap: str, prefix: str, **subscriptions: Any) -> SiteConfig:
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4}, {"name": "prices", "buckets": 2}],
        "subscriptions": {"registry_partitions": 4, "ping_interval_ms": 500,
                          "maximum_time_between_pings_ms": 4000, **subscriptions},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


class Recorder:
    """A listener that keeps every event it is given, in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.live_at: int | None = None
        self.lock = threading.Lock()

    def _keep(self, event: Any) -> None:
        with self.lock:
            self.events.append(event)

    after_create = after_update = after_destroy = after_invalidate = _keep

    def after_region_live(self, region: str) -> None:
        with self.lock:
            self.live_at = len(self.events)

    def keys(self, *, replayed: bool | None = None) -> Counter[str]:
        with self.lock:
            return Counter(e.key for e in self.events if replayed is None or e.replayed == replayed)


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def site(tmp_path: Path, site_a: Any, unique_prefix: str) -> Any:
    path = tmp_path / "site-b.yaml"
    cfg = _site(path, site_a.bootstrap, unique_prefix)
    with RegionProcess(path, tmp_path / "region.log") as region:
        region.wait_ready()
        yield cfg, path, region


def test_smoke_register_write_receive(site: Any, tmp_path: Path) -> None:
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"):
        with RegionClient(region.url) as writer:
            writer.put("orders", "k1", 1)
            cache = ClientCache(cfg, "c1", region_urls=[region.url])
            try:
                orders = cache.region("orders")
                rec = Recorder()
                orders.add_listener(rec)
                assert orders.register_interest(["k1", "k2"]) == 1
                assert orders.get_local("k1") == 1
                cache.ready_for_events()
                wait_for(lambda: cache.live, 20, "the marker")
                writer.put("orders", "k2", 2)
                writer.put("orders", "k3", 3)
                writer.put("orders", "k1", 11)
                wait_for(lambda: orders.get_local("k1") == 11, 20, "k1 = 11")
                assert orders.get_local("k2") == 2
                assert orders.get_local("k3") is None
                assert [(e.key, e.new_value) for e in rec.events] == [("k2", 2), ("k1", 11)]
            finally:
                cache.close()
