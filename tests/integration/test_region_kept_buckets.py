"""Buckets that stay with their owner through a rebalance are neither revoked nor read again.

The region group rebalances incrementally (cooperative-sticky): a member
joining takes buckets from the others, which give up only those and go on
serving the rest; a member dying leaves its buckets to the others, which
load only those.  Counted, not timed: /stats ``buckets_revoked`` and ``loads``.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.events import EventID

from regionkit import RegionProcess, read_topic, write_site
from waiting import wait_for

#: How many writes go on once the buckets are split (the original owner and the new one both take some),
#: how long they may take, and how long the survivor may take to own every bucket of a killed instance.
WRITES_AFTER_SPLIT = 20
WRITES_S = 60
TAKEOVER_S = 60

pytestmark = pytest.mark.timeout(300)

KEYS = 400


def owned(instance: RegionProcess) -> set[int]:
    rows = httpx.get(f"{instance.url}/buckets", timeout=10).json()["buckets"]
    return {r["bucket"] for r in rows if r["owner"] == instance.url and r["status"] == "ready"}


def wait_split(a: RegionProcess, b: RegionProcess, timeout_s: float = 60.0) -> tuple[set[int], set[int]]:
    """Until a and b together serve the 8 buckets, each some."""
    def split() -> tuple[set[int], set[int]] | None:
        mine, theirs = owned(a), owned(b)
        return (mine, theirs) if mine and theirs and mine | theirs == set(range(8)) and not mine & theirs else None

    return wait_for(split, timeout_s=timeout_s, what="a and b together serve the 8 buckets, each some", poll_s=0.2)


def test_a_member_joining_and_one_killed_reload_only_the_buckets_that_moved(site_a, unique_prefix, tmp_path: Path):
    prefix = site_a.topic_prefix(unique_prefix)
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix)
    a = RegionProcess(tmp_path / "site.yaml", tmp_path / "region-a.log")
    b: RegionProcess | None = None
    try:
        a.wait_ready()
        client = RegionClient([a.url], retry_for_s=60)
        expected = {f"k{i:04d}": {"n": i, "round": 1} for i in range(KEYS)}
        for start in range(0, KEYS, 100):
            client.put_all("orders", dict(list(expected.items())[start:start + 100]))
        assert a.stats()["loads"] == 8

        # b joins while a is written to: a gives up only the buckets b takes.  Windows in flight as
        # the group's generation changes are refused and written again (windows_rewritten).
        stop = threading.Event()
        written: list[str] = []

        def write_on() -> None:
            writer = RegionClient([a.url], retry_for_s=60)
            i = 0
            while not stop.is_set():
                key = f"k{i % KEYS:04d}"
                writer.put("orders", key, {"n": i % KEYS, "round": 1, "during": i})
                expected[key] = {"n": i % KEYS, "round": 1, "during": i}
                written.append(key)
                i += 1

        writing = threading.Thread(target=write_on, daemon=True)
        writing.start()
        b = RegionProcess(tmp_path / "site.yaml", tmp_path / "region-b.log")
        b.wait_ready()
        kept, moved = wait_split(a, b)
        # Writes go on after the split for a while, to both owners.
        written_at_split = len(written)
        wait_for(lambda: len(written) >= written_at_split + WRITES_AFTER_SPLIT, timeout_s=WRITES_S,
                 what=f"{WRITES_AFTER_SPLIT} writes after the split")
        stop.set()
        writing.join(90)
        assert not writing.is_alive() and len(written) > 10, len(written)
        stats = a.stats()
        assert stats["loads"] == 8, f"a read buckets it kept again: {stats}"
        assert stats["buckets_revoked"] == len(moved), f"a gave up buckets it kept: {stats}"
        both = RegionClient([a.url, b.url], retry_for_s=60)
        entries = both.get_all("orders", list(expected))
        assert {k: (e or {}).get("value") for k, e in entries.items()} == expected

        # Writes through both, then b is killed: a keeps its buckets and loads only b's.
        for i in range(0, KEYS, 3):
            key = f"k{i:04d}"
            expected[key] = {"n": i, "round": 2}
            both.put("orders", key, expected[key])
        b.kill()
        wait_for(lambda: owned(a) == set(range(8)), timeout_s=TAKEOVER_S, what="a takes every bucket", poll_s=0.2)
        stats = a.stats()
        assert stats["loads"] == 8 + len(moved), f"a read more than b's buckets: {stats}"
        assert stats["buckets_revoked"] == len(moved), f"a gave up buckets when b died: {stats}"

        # Nothing acknowledged is lost, and the kept buckets go on writing their EventID streams.
        survivor = RegionClient([a.url], retry_for_s=60)
        for i in range(1, KEYS, 5):
            key = f"k{i:04d}"
            expected[key] = {"n": i, "round": 3}
            survivor.put("orders", key, expected[key])
        entries = survivor.get_all("orders", list(expected))
        wrong = {k: ((entries.get(k) or {}).get("value"), v) for k, v in expected.items()
                 if (entries.get(k) or {}).get("value") != v}
        assert not wrong, f"{len(wrong)} keys differ, e.g. {list(wrong.items())[:3]}"
        codec = get_codec()
        ids = Counter(EventID.from_record(codec.decode_as("EntryEvent", value)["event_id"])
                      for _, _, value in read_topic(site_a.bootstrap, cfg.topics.region_changelog("orders"), 8))
        assert [eid for eid, n in ids.items() if n > 1] == [], "an EventID was written twice to the changelog"
    finally:
        a.stop()
        if b is not None:
            b.stop()
