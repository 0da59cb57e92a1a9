"""Secrets at work: the region service's bearer token guards its API, and no secret reaches a log.

The token comes from an environment variable (``region_service.token_env``),
the gateway signing key from a file (``gateway_signing_key_file``): a request
without the token or with a wrong one is answered 401 and changes nothing, the
health endpoints need none, and neither secret appears in what the region
service and a gateway sender (which signs every batch with the key) log.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from sluice.client import RegionClient
from sluice.client.region import RegionError
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.processes import RegionProcess, SenderProcess
from sluice.core.topics import apply_topics

from regionkit import read_topic, write_site

pytestmark = pytest.mark.timeout(180)

TOKEN = "tok-9c1d2e3f4a5b6c7d"
SIGNING_KEY = "key-0f1e2d3c4b5a69788796"


def test_the_region_token_guards_the_api_and_no_secret_is_logged(site_a, unique_prefix, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "signing.key").write_text(SIGNING_KEY + "\n")
    monkeypatch.setenv("REGION_TOKEN", TOKEN)  # for load_config here, and inherited by the services
    path = tmp_path / "site.yaml"
    write_site(path, site="a", bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
               extra={"region_service": {"token_env": "REGION_TOKEN", "request_timeout_s": 20, "load_timeout_s": 30},
                      "gateway_signing_key_file": "signing.key",
                      "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "remote": {
                          "bootstrap_servers": site_a.bootstrap,
                          "topic_prefix": site_a.topic_prefix(unique_prefix) + "b."}}]})
    # Site b's topics, so the sender's batches (each signed with the key) are written and read back below.
    site_b = tmp_path / "site-b.yaml"
    site_b.write_text(yaml.safe_dump({
        "site": "b", "dsid": 2, "regions": [{"name": "orders", "buckets": 8}],
        "kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": site_a.topic_prefix(unique_prefix) + "b."},
        "receiver": {"inbound_partitions": 1, "accepted_dsids": [1]}}))
    cfg_b = load_config(site_b)
    assert apply_topics(cfg_b).ok
    region = RegionProcess(path, tmp_path / "region.log")
    sender = None
    try:
        region.wait_ready()  # /readyz needs no token
        assert httpx.get(f"{region.url}/healthz", timeout=5).status_code == 200

        for given in (None, "not-the-token"):
            client = RegionClient([region.url], token=given, retry_for_s=0)
            with pytest.raises(RegionError) as refused:
                client.put("orders", "k1", {"by": "intruder"})
            assert refused.value.status == 401
            with pytest.raises(RegionError) as refused:
                client.get("orders", "k1")
            assert refused.value.status == 401
            client.close()
        raw = httpx.put(f"{region.url}/regions/orders/entries/k1", json=1,
                        headers={"Authorization": "Bearer wrong"}, timeout=5)
        assert raw.status_code == 401 and TOKEN not in raw.text

        member = RegionClient([region.url], token=TOKEN)
        assert member.get_entry("orders", "k1") is None  # nothing the refused requests sent was applied
        member.put("orders", "k1", {"by": "member"})
        assert member.get("orders", "k1") == {"by": "member"}

        sender = SenderProcess(path, "to-b", tmp_path / "sender.log")
        member.put_all("orders", {f"s{i}": i for i in range(20)})
        member.close()
        end = time.monotonic() + 60
        batches: list[dict] = []
        while time.monotonic() < end and sum(len(b["events"]) for b in batches) < 21:
            batches = [get_codec().decode_as("GatewayBatch", value)
                       for _, _, value in read_topic(site_a.bootstrap, cfg_b.topics.gateway_inbound(), 1)]
            time.sleep(0.5)
        assert sum(len(b["events"]) for b in batches) >= 21 and all(b["signature"] for b in batches), batches
    finally:
        if sender is not None:
            sender.stop()
        region.stop()

    for log in ("region.log", "sender.log"):
        text = (tmp_path / log).read_text()
        assert text, f"{log} is empty"
        assert TOKEN not in text and SIGNING_KEY not in text, f"a secret in {log}"
