"""A subscription service with a token refuses registrations without it: the client is told why,
the refusal is counted, and nothing changes (no client, no queue filled, nothing registered).

The service's site file gives ``subscriptions.token`` through an environment variable
(``token_env``); clients built from a site file without it send none, or the one they are given.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.client import ClientCache, RegionClient, RegistrationRefused
from sluice.core.config import load_config
from sluice.core.lifecycle import ServiceState
from sluice.core.topics import apply_topics
from sluice.subscriptions.service import SubscriptionService

from regionkit import RegionProcess
from waiting import read_until

pytestmark = pytest.mark.timeout(240)

TOKEN = "s3cret-subscriptions"


@pytest.fixture
def site(tmp_path: Path, site_a: Any, unique_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(the service's site file, a client's site file without the token, the region process, the service)"""
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": unique_prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4}],
        "subscriptions": {"registry_partitions": 2, "ping_interval_ms": 500, "maximum_time_between_pings_ms": 4000},
    }
    path = tmp_path / "site-b.yaml"
    path.write_text(yaml.safe_dump(data))
    client_cfg = load_config(path)
    assert apply_topics(client_cfg).ok
    monkeypatch.setenv("SUBSCRIPTIONS_TOKEN", TOKEN)
    data["subscriptions"]["token_env"] = "SUBSCRIPTIONS_TOKEN"
    service_path = tmp_path / "site-b-service.yaml"
    service_path.write_text(yaml.safe_dump(data))
    cfg = load_config(service_path)
    assert TOKEN not in repr(cfg)
    with RegionProcess(path, tmp_path / "region.log") as region:
        region.wait_ready()
        service = SubscriptionService(cfg)
        service.start()
        runner = threading.Thread(target=service.run, name="subscriptions", daemon=True)
        runner.start()
        read_until(service.readiness, lambda not_ready: not not_ready, timeout_s=30)
        assert service.readiness() == {}
        try:
            yield cfg, client_cfg, region, service
        finally:
            service.stop()
            runner.join(30)
            assert service.state is ServiceState.STOPPED


@pytest.mark.parametrize("given, why", [("wrong-token", "is not the subscription service's token"),
                                        (None, "carried none")])
def test_a_registration_without_the_right_token_is_refused_and_changes_nothing(
        site: Any, given: str | None, why: str) -> None:
    _, client_cfg, region, service = site
    RegionClient(region.url).put("orders", "k1", 1)
    cache = ClientCache(client_cfg, "intruder", region_urls=[region.url], subscription_token=given,
                        registration_timeout_s=20)
    try:
        with pytest.raises(RegistrationRefused, match=f"client intruder: registration refused: .*{why}"):
            cache.region("orders").register_interest(["k1"])
        assert cache.refused is not None
        assert cache.region("orders").get_local("k1") is None  # nothing loaded
    finally:
        cache.close()
    assert service.stats["refused"] >= 1
    assert "intruder" not in service.registry
    assert service.describe()["clients"] == []
    assert service.stats["registered"] == 0 and service.stats["filled"] == 0


def test_the_right_token_registers(site: Any) -> None:
    """A client built from the service's site file sends its token by itself."""
    cfg, _, region, service = site
    RegionClient(region.url).put("orders", "k1", 1)
    cache = ClientCache(cfg, "member", region_urls=[region.url])
    try:
        assert cache.region("orders").register_interest(["k1"]) == 1
        assert cache.region("orders").get_local("k1") == 1
        assert cache.refused is None
    finally:
        cache.close()
    assert service.stats["registered"] >= 1
    assert service.stats["refused"] == 0
