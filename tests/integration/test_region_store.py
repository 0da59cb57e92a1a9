"""The local store (``region_service.store_dir``): a restarted instance reads only the tail of its buckets'
changelogs, and a store it cannot trust is rebuilt from them.

Counted, not timed: ``records_replayed`` in /stats is the number of changelog records the loads applied,
and ``loads_from_store`` the buckets that started from the store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.client import RegionClient

from regionkit import RegionProcess, write_site
from waiting import settles, wait_for

pytestmark = pytest.mark.timeout(300)

#: How long the checkpoints may take, and how long their count must stay put (over three intervals of the
#: quiet-bucket test's 0.3 s) to say no bucket has one pending.
CHECKPOINTS_S = 20
CHECKPOINTS_QUIET_S = 1.0

BUCKETS = 4
KEYS = 400
TAIL = 150


def site(tmp_path: Path, site_a, unique_prefix: str, interval_s: float = 5.0) -> Path:
    path = tmp_path / "site.yaml"
    write_site(path, site="a", bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
               buckets=BUCKETS, extra={"region_service": {"request_timeout_s": 20, "load_timeout_s": 30,
                                                          "store_checkpoint_interval_s": interval_s}})
    return path


def values(url: str, keys: list[str]) -> dict[str, object]:
    client = RegionClient([url], retry_for_s=30)
    return {k: client.get("orders", k) for k in keys}


def test_a_restart_replays_only_what_the_changelog_gained(site_a, unique_prefix, tmp_path: Path):
    path = site(tmp_path, site_a, unique_prefix)
    keys = [f"k{i:04d}" for i in range(KEYS)]
    a = RegionProcess(path, tmp_path / "a-1.log", store_dir=tmp_path / "store-a")
    a.wait_ready()
    RegionClient([a.url], retry_for_s=30).put_all("orders", {k: {"round": 1} for k in keys})
    assert a.stop() == 0  # handing its buckets over leaves the store clean at each changelog's end

    # While a is away, another instance (no store) writes TAIL more records.
    b = RegionProcess(path, tmp_path / "b.log")
    b.wait_ready()
    client = RegionClient([b.url], retry_for_s=30)
    for k in keys[:TAIL]:
        client.put("orders", k, {"round": 2})
    assert b.stop() == 0

    a = RegionProcess(path, tmp_path / "a-2.log", store_dir=tmp_path / "store-a")
    try:
        a.wait_ready()
        stats = a.stats()
        assert stats["loads_from_store"] == BUCKETS, stats
        assert stats["records_replayed"] == TAIL, stats
        assert stats["store_rebuilt"] == 0, stats
        expected = {k: {"round": 2 if i < TAIL else 1} for i, k in enumerate(keys)}
        assert values(a.url, keys) == expected
        # And it goes on writing (its writes continue the store).
        RegionClient([a.url], retry_for_s=30).put("orders", keys[-1], {"round": 3})
        assert values(a.url, [keys[-1]]) == {keys[-1]: {"round": 3}}
    finally:
        a.stop()


def test_after_a_kill_a_quiet_bucket_resumes_from_its_last_checkpoint(site_a, unique_prefix, tmp_path: Path):
    path = site(tmp_path, site_a, unique_prefix, interval_s=0.3)
    keys = [f"k{i:04d}" for i in range(KEYS)]
    a = RegionProcess(path, tmp_path / "a-1.log", store_dir=tmp_path / "store-a")
    a.wait_ready()
    RegionClient([a.url], retry_for_s=30).put_all("orders", {k: {"round": 1} for k in keys})
    wait_for(lambda: a.stats()["store_checkpoints"] >= 2 * BUCKETS, timeout_s=CHECKPOINTS_S, poll_s=0.2,
             what="a checkpoint of every bucket after its load and after the writes")
    # A quiet bucket checkpoints no more: once the count stays put for several intervals, every bucket's
    # store holds its last write.
    settles(lambda: a.stats()["store_checkpoints"], quiet_s=CHECKPOINTS_QUIET_S, timeout_s=CHECKPOINTS_S,
            what="the store checkpoints", poll_s=0.2)
    a.kill()

    a = RegionProcess(path, tmp_path / "a-2.log", store_dir=tmp_path / "store-a")
    try:
        a.wait_ready()
        stats = a.stats()
        assert stats["loads_from_store"] == BUCKETS, stats
        assert stats["records_replayed"] == 0, stats
        assert values(a.url, keys) == {k: {"round": 1} for k in keys}
    finally:
        a.stop()


def test_a_damaged_store_is_rebuilt_from_the_changelog(site_a, unique_prefix, tmp_path: Path):
    path = site(tmp_path, site_a, unique_prefix)
    keys = [f"k{i:04d}" for i in range(KEYS)]
    a = RegionProcess(path, tmp_path / "a-1.log", store_dir=tmp_path / "store-a")
    a.wait_ready()
    RegionClient([a.url], retry_for_s=30).put_all("orders", {k: {"round": 1, "key": k} for k in keys})
    assert a.stop() == 0

    # One value's bytes changed on disk (in every copy of its page LMDB left behind).
    data = tmp_path / "store-a" / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    needle = b'"key":"k0042"'
    at = raw.find(needle)
    assert at >= 0
    while at >= 0:
        raw[at + 8] ^= 0x01
        at = raw.find(needle, at + 1)
    data.write_bytes(bytes(raw))

    a = RegionProcess(path, tmp_path / "a-2.log", store_dir=tmp_path / "store-a")
    try:
        a.wait_ready()
        stats = a.stats()
        assert stats["store_rebuilt"] == 1, stats
        assert stats["loads_from_store"] == BUCKETS - 1, stats
        assert 0 < stats["records_replayed"] < KEYS, stats  # the damaged bucket's records, read again
        assert values(a.url, keys) == {k: {"round": 1, "key": k} for k in keys}
    finally:
        a.stop()


def test_a_store_from_another_kafka_cluster_is_never_trusted(site_a, site_b, unique_prefix, tmp_path: Path):
    """The same site name, topics and store directory on another Kafka cluster (site_b's broker):
    the store is wiped whole, and every bucket is read from that cluster's changelog."""
    keys = [f"k{i:04d}" for i in range(KEYS)]
    (tmp_path / "on-a").mkdir()
    path_a = site(tmp_path / "on-a", site_a, unique_prefix)
    a = RegionProcess(path_a, tmp_path / "a.log", store_dir=tmp_path / "store")
    a.wait_ready()
    RegionClient([a.url], retry_for_s=30).put_all("orders", {k: {"cluster": "a"} for k in keys})
    assert a.stop() == 0

    (tmp_path / "on-b").mkdir()
    path_b = site(tmp_path / "on-b", site_b, unique_prefix)
    other = RegionProcess(path_b, tmp_path / "b.log", store_dir=tmp_path / "store")
    try:
        other.wait_ready()
        stats = other.stats()
        assert stats["store_rebuilt"] == 1 and stats["loads_from_store"] == 0, stats
        assert stats["records_replayed"] == 0, stats  # that cluster's changelog is empty
        assert values(other.url, keys[:20]) == {k: None for k in keys[:20]}
        RegionClient([other.url], retry_for_s=30).put("orders", keys[0], {"cluster": "b"})
        assert values(other.url, keys[:2]) == {keys[0]: {"cluster": "b"}, keys[1]: None}
    finally:
        other.stop()
