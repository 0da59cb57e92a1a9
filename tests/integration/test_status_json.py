"""``sluice admin status --json`` on a real site: one JSON document, the one the status page serves.

The site: region ``orders`` (4 buckets, one redundant copy) feeding the gateway
sender ``to-b``, whose sender is not running (its queue only grows, so its size
is exact); a gateway receiver process; a subscription client with interest in
``orders``; the status page as a real ``sluice admin serve`` process.  Once the
site is quiet, the command's document and the page's ``/api/status`` are the
same but for what depends on the moment they were read at or exists only on
the page (docs/status-json.md says which fields those are).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sluice.client import ClientCache, RegionClient
from sluice.core.config import load_config
from sluice.core.processes import REPO, ReceiverProcess, ServiceProcess, SubscriptionsProcess
from sluice.core.topics import apply_topics

from regionkit import RegionProcess
from waiting import read_until

pytestmark = pytest.mark.timeout(240)

#: How long every service of the site may take to show in `status --json`, and the page to sample again.
SITE_S = 90
PAGE_S = 30

WRITTEN = 40
#: Fields whose value is the moment they were read at (docs/status-json.md, "Moment and page fields").
MOMENT_FIELDS = {"sampled_at_ms", "sample_s", "age_s", "updated_at", "updated_age_s", "oldest_age_s",
                 "last_delivered_age_s", "last_ack_age_s", "in_per_s", "out_per_s", "last_heard_at", "since_ms",
                 "running"}
#: Fields only the page has a value for (the command prints their defaults).
PAGE_FIELDS = {"interval_s", "token_required", "history", "error", "stale_since_ms"}


class AdminPageProcess(ServiceProcess):
    """``sluice admin -c FILE serve --port 0 --interval-s 0.5``; ``url`` is where the page is."""

    banner = "admin page on "

    def __init__(self, config_path: Path, log_path: Path) -> None:
        super().__init__(["admin", "-c", str(config_path), "serve", "--port", "0", "--interval-s", "0.5"], log_path)
        self.url = self.announcement.split(" on ", 1)[1].split(" ", 1)[0].rstrip("/")


def _site(path: Path, bootstrap: str, prefix: str) -> Any:
    data = {
        "site": "a", "dsid": 1,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["to-b"], "redundant_copies": 1}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [2]},
        "subscriptions": {"registry_partitions": 2, "ping_interval_ms": 500, "maximum_time_between_pings_ms": 10000},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


def status_json(path: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path), "status", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, f"status --json exited {done.returncode}: {done.stderr[-2000:]}"
    return dict(json.loads(done.stdout))


def without(value: Any, names: set[str]) -> Any:
    """``value`` with every field named in ``names`` left out, at any depth."""
    if isinstance(value, dict):
        return {k: without(v, names) for k, v in value.items() if k not in names}
    if isinstance(value, list):
        return [without(v, names) for v in value]
    return value


def test_status_json_is_the_pages_document_with_queues_receivers_clients_and_buckets(site_a, unique_prefix,
                                                                                     tmp_path: Path) -> None:
    """``status --json`` prints JSON that parses, with a version and the sections a script reads (queues with
    exact sizes, the receiver that reported, the subscription client, the buckets); on a quiet site it equals
    ``/api/status`` read just after it, but for the moment and page fields."""
    path = tmp_path / "site-a.yaml"
    cfg = _site(path, site_a.bootstrap, site_a.topic_prefix(unique_prefix))
    region = RegionProcess(path, tmp_path / "region.log")
    procs: list[Any] = [region]
    cache = None
    try:
        region.wait_ready()
        procs.append(ReceiverProcess(path, tmp_path / "receiver.log"))
        procs.append(SubscriptionsProcess(path, tmp_path / "subscriptions.log"))
        page = AdminPageProcess(path, tmp_path / "admin.log")
        procs.append(page)
        with RegionClient(region.url) as writer:
            for n in range(WRITTEN):
                writer.put("orders", f"k{n}", n)
        cache = ClientCache(cfg, "c1", region_urls=[region.url])
        assert cache.region("orders").register_interest(["k1", "k2"]) == 2
        cache.ready_for_events()

        def complete(doc: dict[str, Any]) -> bool:
            queue = next((q for q in doc["queues"] if q["id"] == "to-b"), None)
            return (queue is not None and queue["size"] == WRITTEN and queue["size_counted"]
                    and any(r["running"] for r in doc["receivers"])
                    and any(c["client_id"] == "c1" and c["connected"] for c in doc["clients"])
                    and len(doc["receiver_partitions"]) == 2
                    and all(p["member"] for p in doc["receiver_partitions"]))

        doc = read_until(lambda: status_json(path), complete, timeout_s=SITE_S, poll_s=0.5)
        assert complete(doc), f"status --json never showed the whole site: {json.dumps(doc)[:3000]}"
        # The page's document sampled after the command's.
        page_doc = read_until(lambda: httpx.get(f"{page.url}/api/status", timeout=10).json(),
                              lambda page_doc: (page_doc["sampled_at_ms"] or 0) > doc["sampled_at_ms"],
                              timeout_s=PAGE_S, poll_s=0.2)

        assert doc["version"] == page_doc["version"] == 1
        assert doc["site"] == {"name": "a", "dsid": 1, "bootstrap": site_a.bootstrap}
        for section in ("queues", "receivers", "receiver_partitions", "receiver_totals", "senders", "clients",
                        "buckets", "regions", "sites", "section_errors"):
            assert section in doc, f"no {section} in the document"
        assert doc["section_errors"] == {}, doc["section_errors"]
        queue = next(q for q in doc["queues"] if q["id"] == "to-b")
        assert [p["partition"] for p in queue["partitions"]] == [0, 1, 2, 3]
        assert queue["in_per_s"] is None, "a single command has no sample before it: no rates"
        assert [(b["region"], b["bucket"]) for b in doc["buckets"]] == [("orders", b) for b in range(4)]
        assert all(b["primary"] and b["redundant_copies"] == 1 for b in doc["buckets"])
        assert doc["receiver_totals"]["partitions"] == 2 and doc["receiver_totals"]["events_applied"] == 0
        assert doc["history"] == {"window_s": 0, "points": []} and doc["interval_s"] is None
        assert page_doc["interval_s"] == 0.5 and page_doc["history"]["points"]

        assert without(doc, MOMENT_FIELDS | PAGE_FIELDS) == without(page_doc, MOMENT_FIELDS | PAGE_FIELDS)
        assert set(doc) == set(page_doc)
    finally:
        if cache is not None:
            cache.close()
        for proc in reversed(procs):
            proc.stop()
