"""A gateway sender's filters, substitution, pause/resume, stop/start and status, A→B through Kafka."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from sluice.admin.cli import queue_status, set_state
from sluice.client import RegionClient
from sluice.core import sitekeys
from sluice.core.config import load_config
from sluice.core.eventwire import read_gateway_batch
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess

from regionkit import remote, start_two_regions, write_two_sites
from waiting import holds_for, wait_for

pytestmark = pytest.mark.timeout(300)

#: How long a delivery, a state change reaching every primary, or a status report may take.
DELIVERY_S = 60
STATE_S = 30
STATUS_S = 30
#: The window in which a paused or stopped sender would have sent what was written (many batch intervals).
HELD_S = 2.0

HERE = str(Path(__file__).resolve().parent)
# Each site signs what it sends (batches, acks) with its own key and verifies the other's.
A_PRIVATE, A_PUBLIC = sitekeys.generate()
B_PRIVATE, B_PUBLIC = sitekeys.generate()
FILTERS = ["gateway_filters:KeepLocalOut", "gateway_filters:HoldSecrets", "gateway_filters:RecordAcks"]


def _sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any]:
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "gateway_private_key": A_PRIVATE, "gateway_public_keys": {2: B_PUBLIC},  # B verifies every batch
        "regions": [{"name": "orders", "buckets": 8, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{
            "id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 10, "batch_time_interval_ms": 20,
            "max_batches_in_flight": 4, "socket_read_timeout_ms": 10000,
            "event_filters": FILTERS, "event_substitution_filter": "gateway_filters:Redact",
            "remote": remote(bootstrap, prefix, "b"),
        }],
    }, b={
        "regions": [{"name": "orders", "buckets": 8}],
        "gateway_private_key": B_PRIVATE, "gateway_public_keys": {1: A_PUBLIC},  # A verifies every ack
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    })
    return two.path_a, two.path_b, two.cfg_a


def _wait(what: str, check: Callable[[], bool], timeout_s: float = DELIVERY_S) -> None:
    wait_for(check, timeout_s=timeout_s, what=what, poll_s=0.2)


def _in_state(cfg: Any, state: str) -> bool:
    """Every partition of to-b has a primary, and each reports ``state``."""
    rows = queue_status(cfg, "to-b")
    return bool(rows) and all(r.primary != "—" and r.state == state for r in rows)


def _values(client: RegionClient, keys: list[str]) -> dict[str, Any]:
    return {k: e["value"] for k, e in client.get_all("orders", keys).items() if e is not None}


def test_filters_substitution_pause_stop_and_status(site_a, unique_prefix, tmp_path: Path):
    """before_enqueue and before_transmit keep events from B, after_acknowledgement sees exactly what B
    acknowledged, B gets the substituted value and A keeps the original; writes during pause and stop
    wait in the queue and all reach B after resume and start; status shows them per partition."""
    path_a, path_b, cfg_a = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    acks_file = tmp_path / "acks.jsonl"
    procs: list[Any] = []
    try:
        region_a = RegionProcess(path_a, tmp_path / "region-a.log", extra_path=[HERE])
        region_b = RegionProcess(path_b, tmp_path / "region-b.log")
        procs += [region_a, region_b]
        region_a.wait_ready()
        region_b.wait_ready()
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log", extra_path=[HERE],
                                   env={"SLUICE_TEST_ACKS": str(acks_file)}))
        a, b = RegionClient([region_a.url]), RegionClient([region_b.url])

        # 1. Filters and substitution.
        sent = {f"k{i}": {"n": i, "card": "1234-5678"} for i in range(300)}
        kept_out = {f"local-{i}": {"n": i} for i in range(20)} | {f"secret-{i}": {"n": i} for i in range(20)}
        for start in range(0, 300, 50):
            a.put_all("orders", dict(list(sent.items())[start:start + 50]))
        a.put_all("orders", kept_out)
        _wait("B has every k*", lambda: len(_values(b, list(sent))) == len(sent))
        _wait("A's queue is empty", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)
        assert _values(b, list(sent)) == {k: {**v, "card": "****"} for k, v in sent.items()}
        assert _values(a, list(sent)) == sent, "the substitution changed A's own entries"
        assert _values(b, list(kept_out)) == {}, "a filtered event reached B"
        acked = [json.loads(line) for line in acks_file.read_text().splitlines()]
        assert sorted(k for k, _ in acked) == sorted(sent), "after_acknowledgement saw other than what B applied"
        assert len({eid for _, eid in acked}) == len(acked)

        # 2. Pause: writes wait in the queue; resume delivers them.
        set_state(cfg_a, "to-b", "PAUSED", issued_by="test")
        _wait("every primary of to-b paused", lambda: _in_state(cfg_a, "paused"), STATE_S)
        paused = {f"p{i}": {"n": i} for i in range(200)}
        a.put_all("orders", paused)
        _wait("the paused queue holds every write",
              lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == len(paused), STATUS_S)
        holds_for(lambda: _values(b, list(paused)) == {}, window_s=HELD_S, what="a paused sender sends nothing")
        rows = queue_status(cfg_a, "to-b")
        assert sum(r.size for r in rows) == len(paused), "the paused queue does not hold every write"
        assert {r.state for r in rows if r.primary != "—"} == {"paused"}
        assert _values(b, list(paused)) == {}, "a paused sender sent"
        set_state(cfg_a, "to-b", "RUNNING", issued_by="test")
        _wait("B has every write made while paused", lambda: _values(b, list(paused)) == paused)

        # 3. Stop: the same, and nothing is dropped (Geode would drop a stopped parallel sender's events).
        set_state(cfg_a, "to-b", "STOPPED", issued_by="test")
        _wait("every primary of to-b stopped", lambda: _in_state(cfg_a, "stopped"), STATE_S)
        stopped = {f"s{i}": {"n": i} for i in range(200)}
        a.put_all("orders", stopped)
        _wait("the stopped queue holds every write",
              lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == len(stopped), STATUS_S)
        holds_for(lambda: _values(b, list(stopped)) == {}, window_s=HELD_S, what="a stopped sender sends nothing")
        assert sum(r.size for r in queue_status(cfg_a, "to-b")) == len(stopped)
        assert _values(b, list(stopped)) == {}, "a stopped sender sent"
        set_state(cfg_a, "to-b", "RUNNING", issued_by="test")
        _wait("B has every write made while stopped", lambda: _values(b, list(stopped)) == stopped)
        _wait("A's queue is empty again", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)

        # 4. Status as a user sees it.
        events = len(sent) + 20 + len(paused) + len(stopped)
        _wait("a status report after the last ack", lambda: _in_state(cfg_a, "running") and all(
            r.last_delivered_age_s is not None for r in queue_status(cfg_a, "to-b")) and sum(
            r.events for r in queue_status(cfg_a, "to-b")) == events, STATUS_S)
        rows = queue_status(cfg_a, "to-b")
        assert len(rows) == 8 and all(r.primary != "—" and r.state == "running" for r in rows)
        assert all(r.last_delivered_age_s is not None and r.last_delivered_age_s < 60 for r in rows)
        # The secret-* events were dispatched (before_transmit left them out of what was sent).
        assert sum(r.events for r in rows) == len(sent) + 20 + len(paused) + len(stopped)
        out = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path_a), "status", "to-b"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        for column in ("queue size", "oldest event", "in flight", "last ack (ago)", "resends"):
            assert column in out.stdout, f"status lacks {column!r}:\n{out.stdout}"
        print(f"\n{len(sent)} sent and substituted, {len(kept_out)} filtered, {len(paused)} held by pause, "
              f"{len(stopped)} held by stop: all delivered, none lost\n{out.stdout}")
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_group_transaction_events_keeps_a_put_all_of_one_bucket_in_one_batch(site_a, unique_prefix, tmp_path: Path):
    """batch_size 5, a put_all of 40 keys of one bucket: B receives the 40 events in one batch, applied together;
    single puts around it still go in batches of at most 5."""
    from sluice.core.codec import get_codec
    from sluice.core.kafka import partition_for_key

    from regionkit import read_topic

    path_a, path_b, cfg_a = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    data = yaml.safe_load(path_a.read_text())
    sender = data["gateway_senders"][0]
    sender.update(batch_size=5, batch_time_interval_ms=50, group_transaction_events=True)
    for key in ("event_filters", "event_substitution_filter"):
        sender.pop(key)
    path_a.write_text(yaml.safe_dump(data))
    load_config(path_a)  # the edited file still loads
    cfg_b = load_config(path_b)
    same_bucket = [k for k in (f"tx-{i}" for i in range(2000)) if partition_for_key(k.encode(), 8) == 3][:40]
    procs: list[Any] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log"))
        a, b = RegionClient([region_a.url]), RegionClient([region_b.url])
        singles = [k for k in (f"one-{i}" for i in range(2000)) if partition_for_key(k.encode(), 8) == 3][:12]
        for k in singles[:6]:
            a.put("orders", k, {"single": k})
        a.put_all("orders", {k: {"tx": k} for k in same_bucket})
        for k in singles[6:]:
            a.put("orders", k, {"single": k})
        everything = same_bucket + singles
        _wait("B has every key", lambda: len(_values(b, everything)) == len(everything))

        codec = get_codec()
        batches = [read_gateway_batch(codec, v) for _, _, v in
                   read_topic(site_a.bootstrap, cfg_b.topics.gateway_inbound(), 2)]
        keys_per_batch = [[e.key for e in batch.events()] for batch in batches if batch.queue_partition == 3]
        holding = [ks for ks in keys_per_batch if set(ks) & set(same_bucket)]
        assert len(holding) == 1 and set(same_bucket) <= set(holding[0]), \
            f"the put_all was split over {len(holding)} batches: {[len(ks) for ks in holding]}"
        marks = [e.transaction for batch in batches for e in batch.events() if e.key in same_bucket]
        assert len({m[0] for m in marks}) == 1 and [m[1] for m in marks].count(True) == 1
        others = [ks for ks in keys_per_batch if ks is not holding[0]]
        assert all(len(ks) <= 5 for ks in others), f"batches beyond batch_size: {others}"
        print(f"\nput_all of {len(same_bucket)} keys in one batch; {len(others)} other batches of ≤ 5")
    finally:
        for proc in reversed(procs):
            proc.stop()
