"""kill -9 one of B's two receivers while A's senders stream into B: the other takes its partitions over,
nothing is lost, repeats are discarded, per-key order holds."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.events import EventID
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess
from sluice.core.topics import apply_topics

from regionkit import read_topic

pytestmark = pytest.mark.timeout(400)


def _sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any, Any]:
    kafka = {"bootstrap_servers": bootstrap, "session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
    site_a = {
        "site": "a", "dsid": 1, "kafka": {**kafka, "topic_prefix": f"{prefix}a."},
        "regions": [{"name": "orders", "buckets": 8, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 50,
                             "batch_time_interval_ms": 20, "socket_read_timeout_ms": 5000,
                             "remote": {"bootstrap_servers": bootstrap, "topic_prefix": f"{prefix}b."}}],
    }
    site_b = {
        "site": "b", "dsid": 2, "kafka": {**kafka, "topic_prefix": f"{prefix}b."},
        "regions": [{"name": "orders", "buckets": 8}],
        "receiver": {"inbound_partitions": 4, "accepted_dsids": [1]},
    }
    out = []
    for name, data in (("a", site_a), ("b", site_b)):
        path = tmp_path / f"site-{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        cfg = load_config(path)
        assert apply_topics(cfg).ok
        out += [path, cfg]
    return out[0], out[2], out[1], out[3]


def _applied(bootstrap: str, cfg: Any) -> dict[str, list[EventID]]:
    codec = get_codec()
    per_key: dict[str, list[EventID]] = defaultdict(list)
    for _, _, value in read_topic(bootstrap, cfg.topics.region_changelog("orders"), 8):
        record = codec.decode_as("EntryEvent", value)
        per_key[record["key"]].append(EventID.from_record(record["event_id"]))
    return per_key


def test_a_receiver_killed_mid_stream_loses_nothing_and_applies_nothing_twice(site_a, unique_prefix,
                                                                               tmp_path: Path):
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[Any] = []
    try:
        region_a = RegionProcess(path_a, tmp_path / "region-a.log")
        region_b = RegionProcess(path_b, tmp_path / "region-b.log")
        procs += [region_a, region_b]
        region_a.wait_ready()
        region_b.wait_ready()
        receivers = [ReceiverProcess(path_b, tmp_path / f"receiver-b{i}.log") for i in range(2)]
        procs += receivers
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log"))

        written = [0]

        def writer(i: int) -> None:
            client = RegionClient([region_a.url], member_id=f"w{i}-{uuid.uuid4().hex[:6]}")
            rng = random.Random(i)
            for n in range(150):
                chunk = {f"w{i}-k{rng.randrange(200)}": {"w": i, "n": n} for _ in range(20)}
                client.put_all("orders", chunk)
                written[0] += len(chunk)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        while written[0] < 3000:
            time.sleep(0.05)
        # Both receivers own inbound partitions by now; kill the one whose log shows an assignment.
        victim = next(r for r in receivers if "inbound partitions [" in r.log_tail(100_000))
        victim.kill()
        killed_at = written[0]
        for t in threads:
            t.join(120)

        client_a, client_b = RegionClient([region_a.url]), RegionClient([region_b.url])
        deadline = time.monotonic() + 120
        while True:
            keys = sorted(client_a.keys("orders"))
            a = {k: (e or {}).get("value") for k, e in client_a.get_all("orders", keys).items()}
            b = {k: (e or {}).get("value") for k, e in client_b.get_all("orders", keys).items()}
            if a == b or time.monotonic() > deadline:
                break
            time.sleep(1)
        differ = [k for k in a if a[k] != b.get(k)]
        assert not differ, f"{len(differ)} keys differ on B, e.g. {[(k, a[k], b.get(k)) for k in differ[:3]]}"
        ids_a, ids_b = _applied(site_a.bootstrap, cfg_a), _applied(site_a.bootstrap, cfg_b)
        repeats = sum(len(v) - len(set(v)) for v in ids_b.values())
        assert repeats == 0, f"{repeats} events applied twice on B"
        assert ids_a == ids_b, "per-key order of applied events differs on B, or events are missing"
        survivor = next(r for r in receivers if r is not victim)
        assert "inbound partitions [0, 1, 2, 3]" in survivor.log_tail(100_000), "the survivor did not take over"
        print(f"\nreceiver kill -9'd after {killed_at} of {written[0]} entries; B equals A, "
              f"{sum(len(v) for v in ids_b.values())} events applied once each, in A's per-key order; "
              f"repeats discarded by B's region: {region_b.stats()['duplicates']}")
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_each_assignment_opens_a_new_epoch_even_seconds_apart(site_a, unique_prefix, tmp_path: Path):
    """A sender member assigned a partition twice within a second or two (a rebalance right after a
    restart) opens two epochs: the second's batch ids must not repeat the first's, or the receiver would
    take the new batches for repeats of acknowledged ones and drop their events."""
    from sluice.sender.service import GatewaySenderService

    path_a, _, cfg_a, _ = _sites(tmp_path, site_a.bootstrap, site_a.topic_prefix(unique_prefix))
    sender = GatewaySenderService(cfg_a, "to-b")
    sender.start()
    try:
        firsts = []
        for _ in range(3):
            sender.assignment_starting()
            firsts.append(sender.first_batch_id(0))
        epochs = [first >> 32 for first in firsts]
        assert epochs == [epochs[0], epochs[0] + 1, epochs[0] + 2], firsts
    finally:
        sender.stop()
        sender.run()  # returns at once (stopping): leaves the group and closes its clients
