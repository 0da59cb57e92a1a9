"""Secrets at work: the region service's bearer token guards its API, and no secret reaches a log.

The token comes from an environment variable (``region_service.token_env``),
the site's Ed25519 private key from a file (``gateway_private_key_file``): a
request without the token or with a wrong one is answered 401 and changes
nothing, the health endpoints need none, and neither secret appears in what
the region service and a gateway sender (which signs every batch with the
key, in the record headers) log.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from confluent_kafka import Consumer, TopicPartition

from sluice.client import RegionClient, RegionError
from sluice.core import sitekeys
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.processes import RegionProcess, SenderProcess
from sluice.core.signing import Verifier
from sluice.core.topics import apply_topics

from regionkit import write_site
from waiting import read_until

pytestmark = pytest.mark.timeout(180)

TOKEN = "tok-9c1d2e3f4a5b6c7d"
MEMBER_TOKEN = "member-tok-5e6f7a8b9c0d1e2f"
PRIVATE_KEY, PUBLIC_KEY = sitekeys.generate()
_, REMOTE_PUBLIC_KEY = sitekeys.generate()


def _records_with_headers(bootstrap: str, topic: str) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    """(value, headers) of every record of a one-partition topic."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "sluice-test-reader",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 10})
    out: list[tuple[bytes, list[tuple[str, bytes]]]] = []
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        consumer.assign([TopicPartition(topic, 0, low)])
        end = time.monotonic() + 30
        while len(out) < high - low and time.monotonic() < end:
            for msg in consumer.consume(1000, 0.05):
                if msg.error() is None:
                    out.append((msg.value(), msg.headers() or []))
    finally:
        consumer.close()
    return out


def test_the_region_token_guards_the_api_and_no_secret_is_logged(site_a, unique_prefix, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    """The region token guards the API (401 without it or with a wrong one, nothing applied; health endpoints
    open), a signing sender's batches carry a signature of the private key read from a file, and neither the
    token nor the private key reaches the region service's or the sender's log."""
    (tmp_path / "site-a.key").write_text(PRIVATE_KEY + "\n")
    monkeypatch.setenv("REGION_TOKEN", TOKEN)  # for load_config here, and inherited by the services
    monkeypatch.setenv("REGION_MEMBER_TOKEN", MEMBER_TOKEN)
    path = tmp_path / "site.yaml"
    write_site(path, site="a", bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
               extra={"region_service": {"token_env": "REGION_TOKEN", "member_token_env": "REGION_MEMBER_TOKEN",
                                         "request_timeout_s": 20, "load_timeout_s": 30},
                      "gateway_private_key_file": "site-a.key", "gateway_public_keys": {2: REMOTE_PUBLIC_KEY},
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
        records = read_until(lambda: _records_with_headers(site_a.bootstrap, cfg_b.topics.gateway_inbound()),
                             lambda records: sum(len(get_codec().decode_as("GatewayBatch", v)["events"])
                                                 for v, _ in records) >= 21, timeout_s=60, poll_s=0.5)
        batches = [get_codec().decode_as("GatewayBatch", value) for value, _ in records]
        assert sum(len(b["events"]) for b in batches) >= 21, batches
        verifier = Verifier({1: sitekeys.load_public_keys(PUBLIC_KEY)})
        assert all(verifier.signer(value, headers) == 1 for value, headers in records)
        assert all(b["signature"] is None for b in batches), "the signature field is no longer written"
    finally:
        if sender is not None:
            sender.stop()
        region.stop()

    for log in ("region.log", "sender.log"):
        text = (tmp_path / log).read_text()
        assert text, f"{log} is empty"
        assert TOKEN not in text and MEMBER_TOKEN not in text and PRIVATE_KEY not in text, f"a secret in {log}"
