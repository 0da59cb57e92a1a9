"""Events applied by another site reach the region through apply_remote: conflicts resolved, repeats answered."""

from __future__ import annotations

from pathlib import Path

import httpx

from sluice.client import RegionClient
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.remotewire import encode_remote

from regionkit import RegionProcess, read_queue, write_site


def _remote(key: str, op: Operation, value: bytes | None, dsid: int, ts: int, version: int, seq: int) -> EntryEvent:
    return EntryEvent(region="orders", key=key, operation=op, value=value, event_id=EventID(f"site-{dsid}", 1, seq),
                      version=VersionTag(dsid, ts, version, f"m{dsid}"), origin_dsid=dsid, bucket=0,
                      event_time=ts, visited_dsids=(1,))


def test_remote_events_apply_by_geodes_conflict_rule_and_reach_the_queues(site_a, unique_prefix, tmp_path: Path):
    """A later remote write wins over a local one, an earlier one loses, a repeat is a duplicate; the applied
    events reach the async event queue with their origin's version and visited sites, and not the gateway
    queue towards the site they came from."""
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix))
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    try:
        region.wait_ready()
        client = RegionClient([region.url])
        local = client.put("orders", "k1", {"from": "local"})
        local_ts = local["version"]["timestamp"]
        client.put("orders", "k2", {"from": "local"})

        newer = _remote("k1", Operation.UPDATE, b'{"from":"site-2"}', 2, local_ts + 1000, 5, seq=0)
        older = _remote("k2", Operation.UPDATE, b'{"from":"site-3"}', 3, 1_000, 1, seq=0)
        fresh = _remote("k3", Operation.CREATE, b'{"from":"site-2"}', 2, local_ts, 1, seq=1)
        answer = client.apply_remote("orders", [newer, older, fresh], outcomes="all")
        assert (answer["applied"], answer["conflicts"], answer["failed"]) == (2, 1, 0)
        assert [o["status"] for o in answer["outcomes"]] == ["ok", "conflict", "ok"]
        assert client.get("orders", "k1") == {"from": "site-2"}
        assert client.get("orders", "k2") == {"from": "local"}
        assert client.get_entry("orders", "k1")["version"]["dsid"] == 2

        again = client.apply_remote("orders", [newer], outcomes="all")
        assert again["duplicates"] == 1 and again["applied"] == 0

        for queue in cfg.attached_queues("orders"):
            events = [r.event for r in read_queue(site_a.bootstrap, queue.topic, queue.partitions)]
            remote = [e for e in events if e.origin_dsid != 1]
            if queue.kind == "gateway-sender":
                # The sender's remote site is dsid 2, where these came from: the loop check at enqueue
                # keeps them out of its queue (Geode sends nothing back where it came from).
                assert cfg.sender(queue.id).remote_dsid == 2 and remote == []
                continue
            assert sorted(e.key for e in remote) == ["k1", "k3"]
            assert all(e.visited_dsids == (1,) and e.version.dsid == 2 for e in remote)
    finally:
        region.stop()


def test_the_same_event_twice_in_one_request_is_applied_once_and_answered(site_a, unique_prefix, tmp_path: Path):
    """A gateway batch may hold an event twice (a new region owner re-enqueues what its predecessor may not
    have enqueued, flagged possibleDuplicate): the first is applied, the second answered as a duplicate, and
    the request is answered at once rather than waiting on itself until it times out."""
    write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix))
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    try:
        region.wait_ready()
        client = RegionClient([region.url], timeout_s=10, retry_for_s=0)
        event = _remote("twice", Operation.CREATE, b'{"n":1}', 2, 1_000, 1, seq=7)
        repeat = event.as_possible_duplicate()
        answer = client.apply_remote("orders", [event, repeat], outcomes="all")
        assert [o["status"] for o in answer["outcomes"]] == ["ok", "duplicate"]
        assert client.get("orders", "twice") == {"n": 1}
    finally:
        region.stop()


def test_apply_remote_refuses_what_cannot_cross_sites(site_a, unique_prefix, tmp_path: Path):
    """Invalidates, this site's own events and bytes that are not events are refused one by one, each an
    error outcome naming the event; the good event of the same request is applied (207)."""
    write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
               prefix=site_a.topic_prefix(unique_prefix))
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    try:
        region.wait_ready()
        url = f"{region.url}/regions/orders/apply_remote?outcomes=all"
        bad = [
            (encode_remote(_remote("k", Operation.INVALIDATE, None, 2, 5, 1, 0)), "events[0].operation"),
            (encode_remote(_remote("k", Operation.UPDATE, b"1", 1, 5, 1, 0)), "events[1].origin_dsid"),
            ("bm90IGF2cm8=", "events[2]"),
            ("%%%", "events[3]"),
        ]
        good = encode_remote(_remote("fine", Operation.CREATE, b"1", 2, 5, 1, 0))
        r = httpx.post(url, json={"events": [e for e, _ in bad] + [good]}, timeout=30)
        assert r.status_code == 207, r.text
        outcomes = r.json()["outcomes"]
        assert [o["error"]["field"] for o in outcomes[:4]] == [field for _, field in bad], outcomes
        assert all(o["status"] == "error" and o["error"]["error"] == "InvalidRequest" for o in outcomes[:4])
        assert outcomes[4]["status"] == "ok"
        r = httpx.post(url, json={"events": [bad[0][0]]}, timeout=30)
        assert r.status_code == 400 and r.json()["failed"] == 1, r.text
        assert RegionClient([region.url]).keys("orders") == ["fine"]
    finally:
        region.stop()
