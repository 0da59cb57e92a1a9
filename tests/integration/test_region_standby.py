"""Standby copies (``redundant_copies``): a promoted copy reads only what it had not read, and answers
only once it has.

A region instance keeps a standby copy of each bucket the other owns by
tailing the bucket's changelog at read_committed, so a transaction left open
on the partition holds the copy back: here a stray transactional writer's.
The primary writes past it, the copy falls behind, the primary is killed,
and the survivor is assigned the bucket while its copy is still behind.  The
bucket must answer only after the copy caught up (every acknowledged write
readable), having replayed exactly the records it lacked.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer

from sluice.admin.cli import bucket_status
from sluice.client import RegionClient
from sluice.core.kafka import partition_for_key

from regionkit import RegionProcess, wait_standbys, write_site
from waiting import read_until, wait_for

#: How long admin status may take to show a standby copy, the copy to show the lag of the writes it has not
#: read, and a survivor to be assigned a killed primary's bucket.
STATUS_S = 30
LAG_S = 10
TAKEOVER_S = 60

pytestmark = pytest.mark.timeout(300)

KEYS = 150


def bucket_row(instance: RegionProcess, bucket: int) -> dict:
    rows = httpx.get(f"{instance.url}/buckets", timeout=10).json()["buckets"]
    return next(r for r in rows if r["bucket"] == bucket)


@pytest.mark.serial  # a bound in seconds on the answer: runs alone (make test)
def test_a_standby_behind_when_promoted_catches_up_before_answering(site_a, unique_prefix, tmp_path: Path):
    prefix = site_a.topic_prefix(unique_prefix)
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix, redundant_copies=1)
    changelog = cfg.topics.region_changelog("orders")
    a = RegionProcess(tmp_path / "site.yaml", tmp_path / "region-a.log")
    a.wait_ready()
    b = RegionProcess(tmp_path / "site.yaml", tmp_path / "region-b.log")
    stray = Producer({"bootstrap.servers": site_a.bootstrap, "transactional.id": f"{prefix}stray-writer",
                      "transaction.timeout.ms": 120_000})
    try:
        b.wait_ready()
        bucket = min(wait_standbys(b, a))
        # `sluice admin status` shows the bucket's primary and its standby, from the directory records.
        ids = {a.stats()["instance"]: "a", b.stats()["instance"]: "b"}
        row = read_until(lambda: next(r for r in bucket_status(cfg) if r.bucket == bucket),
                         lambda row: ids.get(row.primary) == "a" and [ids.get(c[0]) for c in row.standbys] == ["b"],
                         timeout_s=STATUS_S, poll_s=0.5)
        assert ids.get(row.primary) == "a" and [ids.get(c[0]) for c in row.standbys] == ["b"], \
            f"admin status never showed b's copy of bucket {bucket}: {row}"
        keys = [k for k in (f"k{i:05d}" for i in range(KEYS * 20)) if partition_for_key(k.encode(), 8) == bucket][:KEYS]
        client = RegionClient([a.url], retry_for_s=60)
        client.put_all("orders", {k: {"round": 1} for k in keys})
        wait_standbys(b, a)

        # A transaction left open on the bucket's changelog: b's copy cannot read past its first record.
        stray.init_transactions(30)
        stray.begin_transaction()
        stray.produce(changelog, b"a record of a transaction left open", b"stray", partition=bucket)
        stray.flush(30)
        for k in keys:
            client.put("orders", k, {"round": 2, "key": k})
        lag = read_until(lambda: next(s["lag"] for s in bucket_row(b, bucket)["standbys"] if s["url"] == b.url),
                         lambda lag: lag >= KEYS, timeout_s=LAG_S, poll_s=0.3)
        assert lag >= KEYS, f"b's copy of bucket {bucket} should be at least {KEYS} behind, is {lag}"
        replayed_before = b.stats()["records_replayed"]

        # The primary dies; b is assigned the bucket with its copy behind, and must not answer until the
        # transaction ends and the copy has read what it lacked.
        a.kill()
        wait_for(lambda: bucket_row(b, bucket)["owner"] == b.url, timeout_s=TAKEOVER_S,
                 what=f"b assigned bucket {bucket}")
        asked = time.monotonic()
        probe = httpx.get(f"{b.url}/regions/orders/entries/{keys[0]}", timeout=10)
        answered_s = time.monotonic() - asked
        assert probe.status_code == 503, f"a bucket still catching up answered: {probe.status_code} {probe.text}"
        # Promptly, retriable, with a hint of when to ask again.
        assert answered_s < 5, f"the loading bucket's answer took {answered_s:.1f} s"
        assert probe.json()["retriable"] and probe.json()["error"] == "BucketUnavailable", probe.text
        assert int(probe.headers["Retry-After"]) >= 1, probe.headers
        stray.abort_transaction(30)

        survivor = RegionClient([b.url], retry_for_s=60)
        entries = survivor.get_all("orders", keys)
        wrong = [k for k in keys if (entries.get(k) or {}).get("value") != {"round": 2, "key": k}]
        assert not wrong, f"{len(wrong)} acknowledged writes missing after the promotion, e.g. {wrong[:3]}"
        stats = b.stats()
        assert stats["loads_from_standby"] >= 1, stats
        # Exactly the records the copy lacked: the second round of the bucket's keys.
        assert stats["records_replayed"] - replayed_before == KEYS, stats
    finally:
        a.stop()
        b.stop()
