"""``sluice admin start SENDER --clean-queues`` (Geode's start gateway-sender --clean-queues), A→B through Kafka.

A stopped sender with events queued is cleaned and started while a writer goes on writing: the remote site
gets none of what was queued below the clean's offsets and every event written at or after them; the audit
counts exactly what was dropped per partition; the clean is refused unconfirmed, for a running sender and
for an async event queue; a restarted sender agrees on the new head; the status command and the status
page show the audit.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from fastapi.testclient import TestClient

from sluice.admin import serve
from sluice.admin.cli import control_record, queue_status, set_state
from sluice.admin.clean import clean_history
from sluice.client import RegionClient
from sluice.core.config import load_config
from sluice.core.processes import ReceiverProcess, SenderProcess

from regionkit import read_queue, remote, start_two_regions, write_two_sites
from waiting import wait_for

pytestmark = pytest.mark.timeout(400)

BUCKETS = 4
CLEANED = 60  # written while the sender is stopped, before the clean


def _sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any, Any]:
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "regions": [{"name": "orders", "buckets": BUCKETS, "gateway_senders": ["to-b"],
                     "async_event_queues": ["audit"]}],
        "gateway_senders": [{
            "id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 10, "batch_time_interval_ms": 20,
            "socket_read_timeout_ms": 10000, "remote": remote(bootstrap, prefix, "b"),
        }],
        "async_event_queues": [{"id": "audit", "listener": {"type": "python", "class_path": "x.y:Z"}}],
    }, b={
        "regions": [{"name": "orders", "buckets": BUCKETS}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    })
    return two.path_a, two.path_b, two.cfg_a, two.cfg_b


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 90) -> None:
    wait_for(check, timeout_s=timeout_s, what=what, poll_s=0.25)


def _admin(path: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path), *args], input=stdin,
                          capture_output=True, text=True, timeout=180)


def _present(client: RegionClient, keys: list[str]) -> set[str]:
    found: set[str] = set()
    for start in range(0, len(keys), 200):
        part = keys[start:start + 200]
        found |= {k for k, e in client.get_all("orders", part).items() if e is not None}
    return found


def test_a_clean_start_drops_exactly_what_was_queued_and_nothing_written_after(site_a, unique_prefix, tmp_path: Path):
    """Stopped with CLEANED events queued, cleaned and started while a writer writes on: B has none of the
    events below the clean's offsets and all at or after them; the audit says how many each partition
    dropped (CLEANED plus the writer's events that landed below), asked by whom and when; a restarted sender
    sends none of them either; unconfirmed, running or an async event queue: refused, nothing dropped."""
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    procs: list[Any] = []
    writing = threading.Event()
    during: list[str] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        sender = SenderProcess(path_a, "to-b", tmp_path / "sender-a.log")
        procs.append(sender)
        a, b = RegionClient([region_a.url]), RegionClient([region_b.url])

        before = [f"before-{i}" for i in range(20)]
        a.put_all("orders", {k: {"k": k} for k in before})
        _wait("B has every event written before", lambda: _present(b, before) == set(before))
        _wait("A's queue is empty", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)

        # A running sender is not cleaned (Geode refuses it too).
        running = _admin(path_a, "start", "to-b", "--clean-queues", "--yes")
        assert running.returncode == 2 and "stop it first" in running.stderr, running.stderr

        set_state(cfg_a, "to-b", "STOPPED", issued_by="test")
        _wait("every partition reports stopped",
              lambda: {r.state for r in queue_status(cfg_a, "to-b")} == {"stopped"})
        cleaned = [f"cleaned-{i}" for i in range(CLEANED)]
        for start in range(0, CLEANED, 20):
            a.put_all("orders", {k: {"k": k} for k in cleaned[start:start + 20]})
        _wait("the stopped sender's queue holds every event written since",
              lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == CLEANED)

        # Unconfirmed (no terminal, no --yes; or not "yes" typed): nothing happens.
        unconfirmed = _admin(path_a, "start", "to-b", "--clean-queues")
        assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr, unconfirmed.stderr
        aeq = _admin(path_a, "start", "audit", "--clean-queues", "--yes")
        assert aeq.returncode == 2 and "async event queue" in aeq.stderr, aeq.stderr
        assert control_record(cfg_a, "to-b")["state"] == "STOPPED"
        assert control_record(cfg_a, "to-b")["clean"] is None

        # A writer goes on through the clean: what lands at or after the clean's offsets must reach B.
        def writer() -> None:
            n = 0
            while writing.is_set():
                key = f"during-{n}"
                a.put("orders", key, {"k": key})
                during.append(key)
                n += 1

        writing.set()
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        _wait("the writer wrote", lambda: len(during) >= 10)
        done = _admin(path_a, "start", "to-b", "--clean-queues", "--yes")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "events dropped" in done.stdout and "started" in done.stdout, done.stdout
        _wait("the writer wrote after the clean", lambda: len(during) >= 40)
        writing.clear()
        thread.join(30)
        after = [f"after-{i}" for i in range(30)]
        a.put_all("orders", {k: {"k": k} for k in after})

        record = control_record(cfg_a, "to-b")
        assert record["state"] == "RUNNING" and record["clean"] is not None
        cuts = record["clean"]["offsets"]
        assert len(cuts) == BUCKETS
        queued = read_queue(site_a.bootstrap, cfg_a.topics.queue("to-b"), BUCKETS)
        below = {r.event.key for r in queued if r.offset < cuts[r.partition]}
        above = {r.event.key for r in queued if r.offset >= cuts[r.partition]}
        assert set(cleaned) <= below, "an event queued before the clean lies at or after its offsets"
        assert set(after) <= above
        expected_at_b = set(before) | above
        dropped_keys = below - set(before)

        _wait("B has every event written at or after the clean's offsets",
              lambda: _present(b, sorted(above)) == above)
        _wait("A's queue is empty", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)
        every = sorted(set(before) | set(cleaned) | set(during) | set(after))
        assert _present(b, every) == expected_at_b, "B holds events the clean dropped, or lacks some written after"

        # The audit: per partition, exactly the events between the head and the clean's offset.
        [row] = clean_history(cfg_a, "to-b")
        assert row.request_id == record["clean"]["request_id"] and "sluice admin" in row.issued_by
        assert [p.state for p in row.partitions] == ["applied"] * BUCKETS
        per_partition = {p: sum(1 for r in queued if r.partition == p and r.event.key in dropped_keys)
                         for p in range(BUCKETS)}
        assert {p.partition: p.dropped for p in row.partitions} == per_partition
        assert row.dropped == len(dropped_keys) >= CLEANED
        assert all(p.applied_by and p.applied_at and p.applied_at >= row.issued_at for p in row.partitions)

        # A sender started again agrees on the new head: nothing dropped comes back.
        sender.stop()
        procs.remove(sender)
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a2.log"))
        final = [f"final-{i}" for i in range(20)]
        a.put_all("orders", {k: {"k": k} for k in final})
        _wait("B has the events written after the restart", lambda: _present(b, final) == set(final))
        _wait("A's queue is empty again", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)
        assert not _present(b, sorted(dropped_keys)), "a restarted sender sent events the clean dropped"
        assert [r.dropped for r in clean_history(cfg_a, "to-b")] == [row.dropped], "the clean was applied twice"

        # The operator's views: `status` and the status page.
        shown = _admin(path_a, "status", "to-b")
        assert shown.returncode == 0, shown.stderr
        assert "clean starts" in shown.stdout and str(row.dropped) in shown.stdout, shown.stdout
        sampler = serve.StatusSampler(cfg_a, interval_s=1, history_s=10, token_required=False)
        snapshot = sampler._sample(None)
        [page_row] = [c for c in snapshot["cleans"] if c["request_id"] == row.request_id]
        assert page_row["dropped"] == row.dropped and page_row["applied"] == BUCKETS
        with TestClient(serve.create_app(sampler, None), base_url="http://testserver") as page:
            json_headers = {"content-type": "application/json"}
            refused = page.post("/api/queues/to-b/clean-start", content=b"{}", headers=json_headers)
            assert refused.status_code == 409 and "stop it first" in refused.json()["message"], refused.text
            aeq_page = page.post("/api/queues/audit/clean-start", content=b"{}", headers=json_headers)
            assert aeq_page.status_code == 404, aeq_page.text
        print(f"\nclean start: {row.dropped} events dropped ({per_partition}), {len(during)} written during it, "
              f"{len(above)} at or after the clean's offsets all at B\n{shown.stdout}")
    finally:
        writing.clear()
        for proc in reversed(procs):
            proc.stop()


def test_a_clean_asked_while_no_sender_runs_is_applied_by_the_first_primary_before_it_sends(
        site_a, unique_prefix, tmp_path: Path):
    """A sender with manual_start that never ran (stopped by its site file, no control record, no process)
    holds N events; the clean is asked and stays pending; the sender process that starts later applies it
    before it sends anything: B gets none of the N, every event written after, and the audit says N."""
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    data = yaml.safe_load(path_a.read_text())
    data["gateway_senders"][0]["manual_start"] = True
    path_a.write_text(yaml.safe_dump(data))
    cfg_a = load_config(path_a)
    procs: list[Any] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs)
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        a, b = RegionClient([region_a.url]), RegionClient([region_b.url])
        queued = [f"queued-{i}" for i in range(40)]
        a.put_all("orders", {k: {"k": k} for k in queued})
        _wait("the queue holds them", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == len(queued))

        asked = _admin(path_a, "start", "to-b", "--clean-queues", "--yes", "--wait-s", "1")
        assert asked.returncode == 0, asked.stdout + asked.stderr
        assert "not applied yet on partitions [0, 1, 2, 3]" in asked.stdout, asked.stdout
        [pending] = clean_history(cfg_a, "to-b")
        assert [p.state for p in pending.partitions] == ["pending"] * BUCKETS and pending.dropped == 0

        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log"))
        _wait("the first primary applied the clean",
              lambda: [p.state for p in clean_history(cfg_a, "to-b")[0].partitions] == ["applied"] * BUCKETS)
        after = [f"after-{i}" for i in range(20)]
        a.put_all("orders", {k: {"k": k} for k in after})
        _wait("B has every event written after", lambda: _present(b, after) == set(after))
        _wait("A's queue is empty", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)
        assert not _present(b, queued), "the sender sent events queued before the clean"
        [row] = clean_history(cfg_a, "to-b")
        assert row.dropped == len(queued), f"the audit says {row.dropped} dropped, {len(queued)} were queued"
    finally:
        for proc in reversed(procs):
            proc.stop()
