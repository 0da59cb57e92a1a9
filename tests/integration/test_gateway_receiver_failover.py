"""kill -9 one of B's two receivers while A's senders stream into B: the other takes its partitions over,
nothing is lost, repeats are discarded, per-key order holds, and the receivers' figures of site B in
`sluice admin status` still add up to what B's changelog holds."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.events import EventID, Operation
from sluice.core.processes import REPO, ReceiverProcess, RegionProcess, SenderProcess
from sluice.core.topics import apply_topics

from regionkit import read_topic, remote, start_two_regions, write_two_sites
from waiting import read_until, wait_for

pytestmark = pytest.mark.timeout(400)

#: How long the writers may take to reach the point of the kill, B to catch up with A afterwards, the
#: status records to follow the last ack, and a receiver or region instance to take its share.
WRITES_S = 120
CONVERGE_S = 120
STATUS_S = 60
ASSIGN_S = 60
#: How long the killed receiver's batch may take to be applied again and acknowledged by its successor.
REDELIVERY_S = 90


def _sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any, Any]:
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "regions": [{"name": "orders", "buckets": 8, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 50,
                             "batch_time_interval_ms": 20, "socket_read_timeout_ms": 5000,
                             "remote": remote(bootstrap, prefix, "b")}],
    }, b={
        "regions": [{"name": "orders", "buckets": 8}],
        "receiver": {"inbound_partitions": 4, "accepted_dsids": [1]},
    })
    return two.path_a, two.path_b, two.cfg_a, two.cfg_b


def _applied(bootstrap: str, cfg: Any) -> dict[str, list[EventID]]:
    codec = get_codec()
    per_key: dict[str, list[EventID]] = defaultdict(list)
    buckets = next(r.buckets for r in cfg.regions if r.name == "orders")
    for _, _, value in read_topic(bootstrap, cfg.topics.region_changelog("orders"), buckets):
        record = codec.decode_as("EntryEvent", value)
        per_key[record["key"]].append(EventID.from_record(record["event_id"]))
    return per_key


def test_a_receiver_killed_mid_stream_loses_nothing_and_applies_nothing_twice(site_a, unique_prefix,
                                                                               tmp_path: Path):
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[Any] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
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
        wait_for(lambda: written[0] >= 3000, timeout_s=WRITES_S, what="3000 entries written on A")
        # Both receivers own inbound partitions by now; kill the one whose log shows an assignment.
        victim = next(r for r in receivers if "inbound partitions [" in r.log_tail(100_000))
        victim.kill()
        killed_at = written[0]
        for t in threads:
            t.join(120)

        client_a, client_b = RegionClient([region_a.url]), RegionClient([region_b.url])
        a, b = read_until(lambda: _both_sites(client_a, client_b), lambda seen: seen[0] == seen[1],
                          timeout_s=CONVERGE_S, poll_s=1.0)
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


def _both_sites(client_a: RegionClient, client_b: RegionClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every key of A's ``orders`` with its value on A and on B."""
    keys = sorted(client_a.keys("orders"))
    a = {k: (e or {}).get("value") for k, e in client_a.get_all("orders", keys).items()}
    b = {k: (e or {}).get("value") for k, e in client_b.get_all("orders", keys).items()}
    return a, b


def admin_status_json(path: Path) -> dict[str, Any]:
    """``sluice admin -c FILE status --json``, run as an operator runs it."""
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path), "status", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, f"status --json exited {done.returncode}: {done.stderr[-2000:]}"
    return dict(json.loads(done.stdout))


def test_receiver_figures_survive_a_kill_and_add_up_to_what_the_site_applied(site_a, unique_prefix, tmp_path: Path):
    """After one of B's receivers is kill -9'd mid-stream and the other takes its partitions over, the per-site
    figures in `sluice admin status` (events applied, batches) equal what B applied: the events its changelog
    holds, each once.  Every partition's figures name the process that wrote them, and the one it took them
    over from: the process killed, for a partition it owned."""
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[Any] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        receivers = [ReceiverProcess(path_b, tmp_path / f"receiver-b{i}.log") for i in range(2)]
        procs += receivers
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log"))

        written = [0]

        def writer(i: int) -> None:
            client = RegionClient([region_a.url], member_id=f"w{i}-{uuid.uuid4().hex[:6]}")
            rng = random.Random(100 + i)
            for n in range(120):
                chunk = {f"w{i}-k{rng.randrange(300)}": {"w": i, "n": n} for _ in range(20)}
                client.put_all("orders", chunk)
                written[0] += len(chunk)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        # Kill a receiver that is applying: one whose log shows an assignment, once batches flow.
        wait_for(lambda: written[0] >= 2500, timeout_s=WRITES_S, what="2500 entries written on A")
        victim = next(r for r in receivers if "inbound partitions [" in r.log_tail(100_000))
        victim.kill()
        survivor = next(r for r in receivers if r is not victim)
        for t in threads:
            t.join(120)

        client_a, client_b = RegionClient([region_a.url]), RegionClient([region_b.url])
        a, b = read_until(lambda: _both_sites(client_a, client_b), lambda seen: seen[0] == seen[1],
                          timeout_s=CONVERGE_S, poll_s=1.0)
        assert a == b, "B never caught up with A"
        ids_b = _applied(site_a.bootstrap, cfg_b)
        applied = sum(len(v) for v in ids_b.values())
        assert sum(len(v) - len(set(v)) for v in ids_b.values()) == 0, "events applied twice on B"

        # The figures travel with the partitions: the survivor's acks carry them, so what `status` shows
        # is complete as soon as the last batch is acknowledged; the status records follow within seconds.
        status = read_until(lambda: admin_status_json(path_b),
                            lambda status: status["receiver_totals"]["events_applied"] == applied and all(
                                p["member"] == survivor.member_id for p in status["receiver_partitions"]),
                            timeout_s=STATUS_S, poll_s=0.5)
        totals, partitions = status["receiver_totals"], status["receiver_partitions"]
        settled = all(p["member"] == survivor.member_id for p in partitions)
        rows = sum(r["events_applied"] for r in status["receivers"])
        assert totals["events_applied"] == applied, (
            f"site B's receivers say {totals['events_applied']} events applied ({totals['events_recovered']} of them "
            f"recovered), its changelog holds {applied} (the receivers' own rows add up to {rows})")
        assert totals["partitions"] == 4 and len(partitions) == 4
        assert sum(p["totals"]["events_applied"] for p in partitions) == applied
        assert settled, f"not every partition's figures are the survivor's: {[p['member'] for p in partitions]}"
        for p in partitions:
            assert {k: p["carried"][k] + p["own"][k] for k in p["own"]} == p["totals"], p
        taken_over = [p["partition"] for p in partitions if p["carried_from"] == victim.member_id]
        assert taken_over, f"no partition's figures were taken over from the killed {victim.member_id}: {partitions}"
        assert sum(p["carried"]["events_applied"] for p in partitions if p["partition"] in taken_over) > 0
        # The table says the same, with a row for the site.
        done = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path_b), "status"],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        site_row = next(line for line in done.stdout.splitlines() if line.strip("│ ").startswith("site "))
        assert f" {applied} " in site_row, site_row
        print(f"\nreceiver {victim.member_id} kill -9'd after {written[0]} puts were issued; B's changelog holds "
              f"{applied} events; `sluice admin status` says {totals['events_applied']} applied over "
              f"{totals['batches']} batches ({totals['events_recovered']} recovered from the killed receiver's "
              f"unacknowledged batch, {totals['events_duplicate']} repeats); the receivers' own rows add up to "
              f"{rows}; partitions {taken_over} carried over from the killed receiver")
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_batch_half_applied_by_a_killed_receiver_is_counted_once(site_a, unique_prefix, tmp_path: Path):
    """A receiver kill -9'd in the middle of a batch (one owner applied its events, the other has not answered)
    leaves no ack and no figures of it: the next owner applies the batch again, finds the first owner's events
    already there, and counts them applied (recovered), so the site's figures equal what its changelog holds."""
    from sluice.core.kafka import partition_for_key

    from test_receiver import _event, _send

    path_b = tmp_path / "site-b.yaml"
    path_b.write_text(yaml.safe_dump({
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": f"{unique_prefix}b.",
                  "session_timeout_ms": 3000, "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    }))
    cfg_b = load_config(path_b)
    assert apply_topics(cfg_b).ok
    procs: list[Any] = []
    try:
        first = RegionProcess(path_b, tmp_path / "region-b1.log")
        second = RegionProcess(path_b, tmp_path / "region-b2.log")
        procs += [first, second]
        owners = read_until(lambda: {r["bucket"]: r["owner"] for r in
                                     httpx.get(f"{first.url}/buckets", timeout=10).json()["buckets"]},
                            lambda owners: set(owners.values()) == {first.url, second.url}, timeout_s=ASSIGN_S,
                            poll_s=0.3)
        assert set(owners.values()) == {first.url, second.url}, owners
        first.wait_ready()
        second.wait_ready()
        keys = [f"k{n}" for n in range(400)]
        keys_of = {url: [k for k in keys if owners[partition_for_key(k.encode(), 4)] == url][:5]
                   for url in (first.url, second.url)}
        victim = ReceiverProcess(path_b, tmp_path / "receiver-b1.log")
        procs.append(victim)
        read_until(lambda: victim.log_tail(100_000), lambda log: "inbound partitions [0, 1]" in log,
                   timeout_s=ASSIGN_S, poll_s=0.2)
        # The first owner's events come first in the batch; the second owner is paused, so the receiver
        # waits on it with the first owner's events applied.
        batch = [_event(k, Operation.CREATE, b"1", n) for n, k in enumerate(keys_of[first.url] + keys_of[second.url])]
        second.pause()
        _send(cfg_b, site_a.bootstrap, 1, batch)
        read_until(lambda: _applied(site_a.bootstrap, cfg_b), lambda ids: len(ids) >= len(keys_of[first.url]),
                   timeout_s=ASSIGN_S, poll_s=0.2)
        assert set(_applied(site_a.bootstrap, cfg_b)) == set(keys_of[first.url])
        victim.kill()
        second.resume()
        assert read_topic(site_a.bootstrap, cfg_b.topics.gateway_acks(), 2) == [], "the batch was acknowledged"

        successor = ReceiverProcess(path_b, tmp_path / "receiver-b2.log")
        procs.append(successor)
        read_until(lambda: read_topic(site_a.bootstrap, cfg_b.topics.gateway_acks(), 2), bool,
                   timeout_s=REDELIVERY_S, poll_s=0.2)
        ids_b = _applied(site_a.bootstrap, cfg_b)
        assert sorted(ids_b) == sorted(keys_of[first.url] + keys_of[second.url])
        assert all(len(v) == 1 for v in ids_b.values()), "an event applied twice"
        totals = admin_status_json(path_b)["receiver_totals"]
        assert (totals["batches"], totals["events_applied"]) == (1, len(batch)), totals
        assert totals["events_recovered"] >= len(keys_of[first.url]), totals
        print(f"\nbatch of {len(batch)} events: {len(keys_of[first.url])} applied by the killed receiver; the "
              f"successor counted {totals['events_applied']} applied, {totals['events_recovered']} recovered")
    finally:
        for proc in reversed(procs):
            proc.stop()  # SIGCONT first: a paused one stops too


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
