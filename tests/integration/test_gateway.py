"""Two sites through Kafka only: A's gateway senders, B's receiver; crashes included."""

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
from sluice.core.eventwire import read_gateway_batch
from sluice.core.processes import ReceiverProcess, SenderProcess
from sluice.core.topics import apply_topics

from regionkit import RegionProcess, read_topic, remote, start_two_regions, write_two_sites, write_two_way_sites
from waiting import holds_for, read_until, wait_for

pytestmark = pytest.mark.timeout(400)

REGIONS = ("orders", "customers")
#: How long the writers may take for the first third of their writes (the sender is killed then), and the
#: sites to converge afterwards, however busy the machine.
WRITES_S = 120
#: Writes of each of the sender-kill test's three writers: 900 in all, each key written about 5 times, the kill
#: after a third (1,800 until issue 21: the checks are per key, and the kill lands mid-stream either way).
WRITES_PER_WRITER = 300
CONVERGE_S = 120
#: How long a dead letter may take to be written after its event was sent.
DEAD_LETTER_S = 60
#: How long a three-site topology may take to spread every write, and the window in which an event still
#: circulating (sent back to a site that had it) would be applied again: longer than a batch round trip.
SPREAD_S = 90
CIRCULATION_S = 2.0
#: The outage of B's broker in the pause test (30 s, the figure the issue asks for), the ack timeout and
#: alert threshold of that test's sender (5 s and 3 s: the alert must come within the outage), and how long
#: the queue may take to drain after B comes back.
OUTAGE_S = 30.0
ALERT_S = 20.0
DRAIN_S = 120


def _sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any, Any]:
    sender = {"remote_dsid": 2, "batch_size": 50, "batch_time_interval_ms": 20, "socket_read_timeout_ms": 10000,
              "remote": remote(bootstrap, prefix, "b")}
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "regions": [{"name": "orders", "buckets": 8, "gateway_senders": ["orders-to-b"]},
                    {"name": "customers", "buckets": 4, "gateway_senders": ["customers-to-b"]}],
        "gateway_senders": [{"id": "orders-to-b", "parallel": True, **sender},
                            {"id": "customers-to-b", "parallel": False, "dispatcher_threads": 3, **sender}],
    }, b={
        "regions": [{"name": "orders", "buckets": 8}, {"name": "customers", "buckets": 4}],
        "receiver": {"inbound_partitions": 4, "accepted_dsids": [1]},
    })
    return two.path_a, two.path_b, two.cfg_a, two.cfg_b


def _changelog_ids(bootstrap: str, cfg: Any, region: str, buckets: int) -> dict[str, list[EventID]]:
    codec = get_codec()
    per_key: dict[str, list[EventID]] = defaultdict(list)
    for _, _, value in sorted(read_topic(bootstrap, cfg.topics.region_changelog(region), buckets)):
        record = codec.decode_as("EntryEvent", value)
        eid = EventID.from_record(record["event_id"])
        if eid not in per_key[record["key"]]:
            per_key[record["key"]].append(eid)
    return per_key


def test_a_to_b_parallel_and_serial_with_a_sender_killed_mid_run(site_a, unique_prefix, tmp_path: Path):
    """B's regions end equal to A's, with A's per-key order, although a parallel sender primary was SIGKILLed."""
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[Any] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        senders = [SenderProcess(path_a, "orders-to-b", tmp_path / f"orders-sender-{i}.log") for i in range(2)]
        procs += senders
        procs.append(SenderProcess(path_a, "customers-to-b", tmp_path / "customers-sender.log", parallel=False))

        done = [0]
        lock = threading.Lock()

        def writer(i: int) -> None:
            client = RegionClient([region_a.url], member_id=f"w{i}-{uuid.uuid4().hex[:6]}")
            rng = random.Random(i)
            live: set[tuple[str, str]] = set()
            for n in range(WRITES_PER_WRITER):
                region = REGIONS[n % 2]
                key = f"w{i}-k{rng.randrange(30)}"
                if rng.random() < 0.1 and (region, key) in live:
                    client.destroy(region, key)
                    live.discard((region, key))
                else:
                    client.put(region, key, {"w": i, "n": n})
                    live.add((region, key))
                with lock:
                    done[0] += 1

        writers = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
        for w in writers:
            w.start()
        total = 3 * WRITES_PER_WRITER
        wait_for(lambda: done[0] >= total // 3, timeout_s=WRITES_S, what=f"{total // 3} writes acknowledged on A")
        killed_at = done[0]
        senders[0].kill()
        for w in writers:
            w.join(120)
        # The kill landed mid-stream: A went on acknowledging writes after it.
        assert killed_at < done[0] == total, (killed_at, done[0])

        client_a, client_b = RegionClient([region_a.url]), RegionClient([region_b.url])

        def both_sites() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
            state = {}
            for region in REGIONS:
                keys = sorted(set(client_a.keys(region)) | set(client_b.keys(region)))
                a = {k: (e or {}).get("value") for k, e in client_a.get_all(region, keys).items()}
                b = {k: (e or {}).get("value") for k, e in client_b.get_all(region, keys).items()}
                state[region] = (a, b)
            return state

        state = read_until(both_sites, lambda state: all(a == b for a, b in state.values()), timeout_s=CONVERGE_S,
                           poll_s=1.0)
        for region, (a, b) in state.items():
            differ = {k for k in a if a[k] != b.get(k)}
            assert not differ, f"{region}: {len(differ)} keys differ on B, e.g. {[(k, a[k], b.get(k)) for k in sorted(differ)[:4]]}"
        for region, buckets in (("orders", 8), ("customers", 4)):
            ids_a = _changelog_ids(site_a.bootstrap, cfg_a, region, buckets)
            ids_b = _changelog_ids(site_a.bootstrap, cfg_b, region, buckets)
            assert ids_a == ids_b, f"{region}: per-key order of applied events differs on B"
        print(f"\n{total} writes on A; B equals A in both regions with A's per-key order; one parallel sender "
              f"killed after {killed_at}")
    finally:
        for proc in reversed(procs):
            proc.stop()


def _two_way_sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any, Any]:
    two = write_two_way_sites(tmp_path, bootstrap, prefix, buckets=4,
                              sender={"batch_size": 20, "batch_time_interval_ms": 20, "socket_read_timeout_ms": 10000},
                              region={"a": {"key_max_bytes": 256}, "b": {"key_max_bytes": 64}})
    return two.path_a, two.path_b, two.cfg_a, two.cfg_b


def test_both_ways_with_conflicting_writes_converge_and_a_refused_event_is_dead_lettered(
    site_a, unique_prefix, tmp_path: Path
):
    """A↔B writing the same keys concurrently end with the same value per key on both sites, no event
    returns to its origin, and an event B refuses (its key is too long there) lands in A's dead letters."""
    path_a, path_b, cfg_a, cfg_b = _two_way_sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[Any] = []
    try:
        regions = {}
        for name, path in (("a", path_a), ("b", path_b)):
            regions[name] = RegionProcess(path, tmp_path / f"region-{name}.log")
            procs.append(regions[name])
        for r in regions.values():
            r.wait_ready()
        for name, path, other in (("a", path_a, "b"), ("b", path_b, "a")):
            procs.append(ReceiverProcess(path, tmp_path / f"receiver-{name}.log"))
            procs.append(SenderProcess(path, f"to-{other}", tmp_path / f"sender-{name}.log"))

        def writer(site: str) -> None:
            client = RegionClient([regions[site].url], member_id=f"{site}-{uuid.uuid4().hex[:6]}")
            rng = random.Random(site)
            for n in range(300):
                client.put("orders", f"k{rng.randrange(20)}", {"site": site, "n": n})

        threads = [threading.Thread(target=writer, args=(s,)) for s in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        long_key = "x" * 100  # fine on A (256 bytes), too long for B (64)
        RegionClient([regions["a"].url]).put("orders", long_key, {"site": "a"})

        client_a, client_b = RegionClient([regions["a"].url]), RegionClient([regions["b"].url])
        keys = [f"k{i}" for i in range(20)]
        read_until(lambda: ({k: (e or {}).get("version") for k, e in client_a.get_all("orders", keys).items()},
                            {k: (e or {}).get("version") for k, e in client_b.get_all("orders", keys).items()}),
                   lambda versions: versions[0] == versions[1], timeout_s=CONVERGE_S, poll_s=1.0)
        va = client_a.get_all("orders", keys)
        vb = client_b.get_all("orders", keys)
        assert {k: e["value"] for k, e in va.items()} == {k: e["value"] for k, e in vb.items()}
        assert {k: e["version"] for k, e in va.items()} == {k: e["version"] for k, e in vb.items()}

        dead = wait_for(lambda: read_topic(site_a.bootstrap, cfg_a.topics.dead_letter("to-b"), 1),
                        timeout_s=DEAD_LETTER_S, what="the too-long key dead-lettered on A", poll_s=0.5)
        letter = get_codec().decode_as("DeadLetter", dead[0][2])
        assert letter["error_class"] == "EntryTooLarge" and letter["event"]["key"] == long_key
        assert long_key not in client_b.keys("orders")

        # No event came back to its origin: every event in A's changelog written by B's
        # clients has origin 2, and none of A's own events was applied again at A.
        codec = get_codec()
        for cfg, own in ((cfg_a, 1), (cfg_b, 2)):
            records = [codec.decode_as("EntryEvent", v) for _, _, v in
                       read_topic(site_a.bootstrap, cfg.topics.region_changelog("orders"), 4)]
            ids = [(r["event_id"]["member_id"], r["event_id"]["thread_id"], r["event_id"]["sequence_id"])
                   for r in records]
            assert len(ids) == len(set(ids)), "an event was applied twice at one site"
        print(f"\nA↔B converged on {len(keys)} contested keys; refused event dead-lettered on A")
    finally:
        for proc in reversed(procs):
            proc.stop()


TOPOLOGIES = {
    # site -> sites it sends to
    "mesh": {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]},
    "ring": {"a": ["b"], "b": ["c"], "c": ["a"]},
    "hub-and-spoke": {"a": ["b", "c"], "b": ["a"], "c": ["a"]},  # a is the hub
}
DSIDS = {"a": 1, "b": 2, "c": 3}


@pytest.mark.parametrize("topology", [pytest.param(t, marks=pytest.mark.slow) if t == "ring" else t
                                      for t in sorted(TOPOLOGIES)])  # ring: the long tier (tests/README.md)
def test_three_sites_apply_every_event_once_and_nothing_circulates(topology, site_a, unique_prefix, tmp_path: Path):
    """Mesh A↔B↔C↔A, ring A→B→C→A, hub A with spokes B and C: every site ends with every write, each
    applied exactly once, and no event is ever sent back to a site that already had it."""
    links = TOPOLOGIES[topology]
    kafka = {"bootstrap_servers": site_a.bootstrap, "session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
    paths, cfgs = {}, {}
    for site, targets in links.items():
        senders = [{"id": f"to-{t}", "remote_dsid": DSIDS[t], "parallel": True, "batch_size": 20,
                    "batch_time_interval_ms": 20, "socket_read_timeout_ms": 10000,
                    "remote": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": f"{unique_prefix}{t}."}}
                   for t in targets]
        sources = [DSIDS[s] for s, ts in links.items() if site in ts]
        data = {"site": site, "dsid": DSIDS[site], "kafka": {**kafka, "topic_prefix": f"{unique_prefix}{site}."},
                "regions": [{"name": "orders", "buckets": 2, "gateway_senders": [s["id"] for s in senders]}],
                "gateway_senders": senders,
                "receiver": {"inbound_partitions": 2, "accepted_dsids": sources}}
        paths[site] = tmp_path / f"site-{site}.yaml"
        paths[site].write_text(yaml.safe_dump(data))
        cfgs[site] = load_config(paths[site])
        assert apply_topics(cfgs[site]).ok
    procs: list[Any] = []
    try:
        regions = {s: RegionProcess(paths[s], tmp_path / f"region-{s}.log") for s in links}
        procs += regions.values()
        for r in regions.values():
            r.wait_ready()
        for site, targets in links.items():
            procs.append(ReceiverProcess(paths[site], tmp_path / f"receiver-{site}.log"))
            for t in targets:
                procs.append(SenderProcess(paths[site], f"to-{t}", tmp_path / f"sender-{site}-{t}.log"))
        written: dict[str, Any] = {}
        for site in links:
            client = RegionClient([regions[site].url])
            for n in range(40):
                key = f"{site}-k{n}"
                client.put("orders", key, {"by": site, "n": n})
                written[key] = {"by": site, "n": n}
        views = read_until(lambda: {s: {k: (e or {}).get("value") for k, e in RegionClient([regions[s].url]).get_all(
            "orders", sorted(written)).items()} for s in links},
            lambda views: all(v == written for v in views.values()), timeout_s=SPREAD_S, poll_s=0.5)
        for site, view in views.items():
            assert view == written, f"site {site} misses {sum(1 for k in written if view.get(k) != written[k])} keys"
        codec = get_codec()

        def applications() -> dict[str, list[tuple[Any, ...]]]:
            ids = {}
            for site in links:
                records = [codec.decode_as("EntryEvent", v) for _, _, v in
                           read_topic(site_a.bootstrap, cfgs[site].topics.region_changelog("orders"), 2)]
                ids[site] = [(r["event_id"]["member_id"], r["event_id"]["thread_id"], r["event_id"]["sequence_id"])
                             for r in records]
            return ids

        # Each event applied exactly once at each site, and still so once anything circulating would be back.
        holds_for(lambda: all(len(ids) == len(written) == len(set(ids)) for ids in applications().values()),
                  window_s=CIRCULATION_S, what=f"each of {len(written)} writes applied exactly once at each site")
        for site, ids in applications().items():
            assert len(ids) == len(written) == len(set(ids)), f"site {site}: {len(ids)} applications"
            batches = [read_gateway_batch(codec, v) for _, _, v in
                       read_topic(site_a.bootstrap, cfgs[site].topics.gateway_inbound(), 2)]
            for batch in batches:
                for event in batch.events():
                    assert event.origin_dsid != DSIDS[site], f"an event of {site} came back to it"
        print(f"\n{topology}: {len(written)} writes, each applied exactly once at each of 3 sites")
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_paused_remote_broker_grows_the_queue_alerts_then_drains_losing_nothing(
    site_a, broker_factory, unique_prefix, tmp_path: Path
):
    """B's broker SIGSTOPped for 30 s under load: A's queue grows and an alert is logged; after SIGCONT it
    drains, B equals A, and the repeats B received are acknowledged, not applied twice.

    B's broker is the test's own, its controller in a JVM of its own that waits longer than the pause
    for a heartbeat: a single node paused past its session timeout fences itself once it runs again,
    and Kafka 4.4.0 may then leave a transaction of B's region open for ever (docs/regions.md,
    "Hanging transactions"), which is not what this test is about."""
    from sluice.admin.cli import queue_status

    broker_b = broker_factory("b", "kafka", separate_controller=True,
                              broker_session_timeout_ms=int((OUTAGE_S + 30) * 1000))

    two = write_two_sites(tmp_path, site_a.bootstrap, unique_prefix, bootstrap_b=broker_b.bootstrap, a={
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 50,
                             "batch_time_interval_ms": 20, "socket_read_timeout_ms": 5000, "alert_threshold_ms": 3000,
                             "remote": remote(broker_b.bootstrap, unique_prefix, "b")}],
    }, b={
        "regions": [{"name": "orders", "buckets": 4}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    })
    cfgs = {"a": two.cfg_a, "b": two.cfg_b}
    procs: list[Any] = []
    paused = False
    try:
        region_a = RegionProcess(tmp_path / "site-a.yaml", tmp_path / "region-a.log")
        region_b = RegionProcess(tmp_path / "site-b.yaml", tmp_path / "region-b.log")
        procs += [region_a, region_b]
        region_a.wait_ready()
        region_b.wait_ready()
        procs.append(ReceiverProcess(tmp_path / "site-b.yaml", tmp_path / "receiver-b.log"))
        sender = SenderProcess(tmp_path / "site-a.yaml", "to-b", tmp_path / "sender-a.log")
        procs.append(sender)
        client_a = RegionClient([region_a.url])
        written: dict[str, Any] = {}

        def write(n0: int, count: int) -> None:
            for n in range(n0, n0 + count):
                key = f"k{n % 50}"
                client_a.put("orders", key, {"n": n})
                written[key] = {"n": n}

        write(0, 100)
        broker_b.pause()
        paused = True
        paused_at = time.monotonic()
        write(100, 300)
        size_paused = wait_for(lambda: sum(r.size for r in queue_status(cfgs["a"], "to-b")), timeout_s=OUTAGE_S,
                               what="A's queue to grow while B is unreachable", poll_s=0.5)
        wait_for(lambda: "ALERT gateway-sender to-b" in sender.log_tail(2_000_000), timeout_s=ALERT_S,
                 what="the sender's alert while B is unreachable", poll_s=0.5)
        # The outage lasts OUTAGE_S in all; meanwhile no service falls over.
        holds_for(lambda: all(proc.proc.poll() is None for proc in procs),
                  window_s=max(0.0, OUTAGE_S - (time.monotonic() - paused_at)), what="every service up", poll_s=1.0)
        broker_b.resume()
        paused = False
        write(400, 100)

        client_b = RegionClient([region_b.url], retry_for_s=120)

        def b_after_drain() -> tuple[dict[str, Any], int]:
            for proc in procs:
                assert proc.proc.poll() is None, f"{proc.log_path.name} exited:\n{proc.log_tail()}"
            b = {k: (e or {}).get("value") for k, e in client_b.get_all("orders", sorted(written)).items()}
            return b, sum(r.size for r in queue_status(cfgs["a"], "to-b"))

        b, _ = read_until(b_after_drain, lambda seen: seen[0] == written and seen[1] == 0, timeout_s=DRAIN_S,
                          poll_s=1.0)
        assert b == written, f"{sum(1 for k in written if b.get(k) != written[k])} keys differ on B"
        assert "ALERT gateway-sender to-b" in sender.log_tail(2_000_000)
        codec = get_codec()
        acks = [codec.decode_as("GatewayAck", v) for _, _, v in
                read_topic(broker_b.bootstrap, cfgs["b"].topics.gateway_acks(), 2)]
        repeats = sum(1 for a in acks if a["duplicate_batch"])
        records = [codec.decode_as("EntryEvent", v) for _, _, v in
                   read_topic(broker_b.bootstrap, cfgs["b"].topics.region_changelog("orders"), 4)]
        ids = [tuple(r["event_id"].values()) for r in records]
        assert len(ids) == len(set(ids)) == 500, f"{len(ids)} applications on B for 500 writes"
        print(f"\nqueue grew to {size_paused} while B was paused; drained; {repeats} repeated batches acked, "
              f"{region_b.stats()['duplicates']} repeated events discarded by B's region, none applied twice")
    finally:
        if paused:
            broker_b.resume()
        for proc in reversed(procs):
            proc.stop()
