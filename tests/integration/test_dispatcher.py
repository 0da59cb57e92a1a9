"""The async-event-queue dispatcher against a real broker, region service and listener processes."""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from sluice.admin.cli import queue_status, set_state
from sluice.client import RegionClient
from sluice.core.events import EventID

from recording_listener import read_offers
from regionkit import DispatcherProcess, RegionProcess, queue_in_state, queue_size, write_aeq_site
from waiting import holds_for, read_until, wait_for

pytestmark = pytest.mark.timeout(300)

#: How long every event written may take to be delivered, a state change to reach every primary, and the
#: queue to drain (as its status reports say) once the last offer was accepted.
DELIVERY_S = 60
STATE_S = 30
DRAIN_S = 30
#: The window in which a paused dispatcher would have dispatched what was written (many batch intervals).
HELD_S = 1.0


def _queue(queue_id: str, log: Path, **extra: Any) -> dict[str, Any]:
    settings = {"path": str(log)}
    settings.update(extra.pop("settings", {}))
    return {"id": queue_id, "listener": {"type": "python", "class_path": "recording_listener:RecordingListener",
                                         "settings": settings}, **extra}


def _write(urls: list[str], threads: int, per_thread: int, keys: int) -> list[tuple[str, EventID, Any]]:
    """Writer threads, each on its own keys in order; returns (key, EventID, value) acknowledged."""
    acked: list[list[tuple[str, EventID, Any]]] = [[] for _ in range(threads)]
    run = uuid.uuid4().hex[:6]

    def writer(i: int) -> None:
        client = RegionClient(urls, member_id=f"writer-{run}-{i}")
        for n in range(per_thread):
            key = f"t{i}-k{n % keys}"
            eid = client.next_event_id()
            value = {"t": i, "n": n}
            client.put("orders", key, value, event_id=eid)
            acked[i].append((key, eid, value))

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return [a for per in acked for a in per]


def _delivered(offers: list[dict[str, Any]]) -> set[tuple[str, int, int]]:
    return {(e[4], e[5], e[6]) for o in offers if o["accepted"] for e in o["events"]}


def _wait_delivered(log: Path, expected: set[tuple[str, int, int]],
                    timeout_s: float = DELIVERY_S) -> list[dict[str, Any]]:
    offers = read_until(lambda: read_offers(str(log)), lambda offers: expected <= _delivered(offers),
                        timeout_s=timeout_s, poll_s=0.2)
    missing = expected - _delivered(offers)
    assert not missing, f"{len(missing)} of {len(expected)} events never delivered"
    return offers


@pytest.mark.parametrize("order_policy", ["KEY", "THREAD"])
def test_refused_batches_are_redelivered_identically_then_accepted_in_order(
    order_policy: str, site_a, unique_prefix, tmp_path: Path
) -> None:
    """A listener refusing the first 2 offers of every batch gets each batch 3 times, the same events, and all
    in order: the first offer's events not possibleDuplicate, every event of the two offers after it
    possibleDuplicate (Geode's handleUnSuccessfulBatchDispatch)."""
    log = tmp_path / "offers.jsonl"
    queue = _queue("q", log, parallel=False, dispatcher_threads=3, order_policy=order_policy, batch_size=20,
                   settings={"fail_first": 2, "fail_by": "false" if order_policy == "KEY" else "raise"})
    write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                   prefix=site_a.topic_prefix(unique_prefix), queue=queue)
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        region.wait_ready()
        acked = _write([region.url], threads=3, per_thread=100, keys=7)
        expected = {(eid.member_id, eid.thread_id, eid.sequence_id) for _, eid, _ in acked}
        offers = _wait_delivered(log, expected)

        # Every batch: offered 3 times, the same events each time, accepted on the third; flagged
        # possibleDuplicate, every event of it, from the second offer on.
        by_batch: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for o in offers:
            by_batch[tuple(o["batch"])].append(o)
        for batch, attempts in by_batch.items():
            assert [a["attempt"] for a in attempts] == [1, 2, 3], batch
            assert [a["accepted"] for a in attempts] == [False, False, True], batch
            unflagged = [[e[:7] + e[8:] for e in a["events"]] for a in attempts]
            assert all(events == unflagged[0] for events in unflagged), f"batch {batch} changed"
            assert [{e[7] for e in a["events"]} for a in attempts] == [{False}, {True}, {True}], \
                f"batch {batch}: possibleDuplicate per offer is not False, True, True for every event"

        # Total delivered = total written, each once, in order per key and per thread.
        delivered = [e for o in offers if o["accepted"] for e in o["events"]]
        assert len(delivered) == len(acked)
        per_key: dict[str, list[int]] = defaultdict(list)
        per_thread: dict[tuple[str, int], list[int]] = defaultdict(list)
        for e in delivered:
            per_key[e[2]].append(e[6])
            per_thread[(e[4], e[5])].append(e[6])
        for key, seqs in per_key.items():
            assert seqs == sorted(seqs), f"key {key} out of order"
        if order_policy == "THREAD":
            for stream, seqs in per_thread.items():
                assert seqs == sorted(seqs), f"thread {stream} out of order"
        print(f"\n{len(by_batch)} batches, each offered 3 times; {len(delivered)} events delivered once")
    finally:
        dispatcher.stop()
        region.stop()


def test_a_batch_refused_once_comes_back_with_every_event_possible_duplicate(site_a, unique_prefix,
                                                                            tmp_path: Path) -> None:
    """A listener that refuses each batch once (returns False) gets it again with every event
    possible_duplicate True, having seen the first offer's events all False: a write-behind listener that
    applied part of the first offer knows to check (Geode's handleUnSuccessfulBatchDispatch)."""
    log = tmp_path / "offers.jsonl"
    queue = _queue("q", log, parallel=True, batch_size=25, settings={"fail_first": 1, "fail_by": "false"})
    write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                   prefix=site_a.topic_prefix(unique_prefix), queue=queue)
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        region.wait_ready()
        acked = _write([region.url], threads=2, per_thread=60, keys=30)
        offers = _wait_delivered(log, {(eid.member_id, eid.thread_id, eid.sequence_id) for _, eid, _ in acked})
        by_batch: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for o in offers:
            by_batch[tuple(o["batch"])].append(o)
        for batch, attempts in by_batch.items():
            assert [a["accepted"] for a in attempts] == [False, True], batch
            first, again = attempts
            assert [e[7] for e in first["events"]] == [False] * len(first["events"]), f"{batch}: first offer flagged"
            assert [e[7] for e in again["events"]] == [True] * len(again["events"]), f"{batch}: re-offer not flagged"
            assert [e[:7] for e in again["events"]] == [e[:7] for e in first["events"]], f"{batch} changed"
        print(f"\n{len(by_batch)} batches refused once: the first offer all False, the second all True")
    finally:
        dispatcher.stop()
        region.stop()


def test_pause_under_writes_then_resume_loses_nothing(site_a, unique_prefix, tmp_path: Path) -> None:
    """Paused, the queue grows while writes go on; resumed, it drains and every event is delivered once."""
    log = tmp_path / "offers.jsonl"
    queue = _queue("q", log, parallel=True, batch_size=50)
    cfg = write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                         prefix=site_a.topic_prefix(unique_prefix), queue=queue)
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        region.wait_ready()
        first = _write([region.url], threads=2, per_thread=50, keys=10)
        _wait_delivered(log, {(e.member_id, e.thread_id, e.sequence_id) for _, e, _ in first})

        set_state(cfg, "q", "PAUSED", issued_by="test")
        wait_for(lambda: queue_in_state(cfg, "q", "paused"), timeout_s=STATE_S, what="every primary of q paused")
        delivered_before = len(read_offers(str(log)))
        second = _write([region.url], threads=2, per_thread=100, keys=10)
        wait_for(lambda: queue_size(cfg, "q") >= len(second), timeout_s=STATE_S,
                 what=f"the paused queue to report the {len(second)} events written")
        holds_for(lambda: len(read_offers(str(log))) == delivered_before, window_s=HELD_S,
                  what="a paused dispatcher offers nothing")
        sizes_paused = sum(r.size for r in queue_status(cfg, "q"))
        assert sizes_paused >= len(second), f"queue size {sizes_paused} while paused, {len(second)} written"
        assert len(read_offers(str(log))) == delivered_before, "dispatched while paused"

        set_state(cfg, "q", "RUNNING", issued_by="test")
        offers = _wait_delivered(log, {(e.member_id, e.thread_id, e.sequence_id) for _, e, _ in first + second})
        delivered = [e for o in offers if o["accepted"] for e in o["events"]]
        assert len(delivered) == len(first) + len(second)
        read_until(lambda: queue_size(cfg, "q"), lambda size: size == 0, timeout_s=DRAIN_S, poll_s=0.5)
        sizes_after = sum(r.size for r in queue_status(cfg, "q"))
        assert sizes_after == 0
        print(f"\nqueue size paused {sizes_paused} → drained to {sizes_after}")

        # The operator's view: a table per partition with the primary and the counters.
        import subprocess
        import sys

        shown = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(tmp_path / "site.yaml"),
                                "status", "q"], capture_output=True, text=True, timeout=60,
                               env={**__import__("os").environ, "COLUMNS": "160"})
        assert shown.returncode == 0, shown.stderr
        assert "queue size" in shown.stdout and dispatcher.member_id in shown.stdout
        assert len([line for line in shown.stdout.splitlines() if line.startswith("│ q ")]) == 8
    finally:
        dispatcher.stop()
        region.stop()


# Not on Tansu: the region service feeding the queue writes in transactions Tansu does not honour.
def test_a_record_that_cannot_be_decoded_is_dead_lettered_and_dispatch_goes_on(
    any_site, unique_prefix, tmp_path: Path
) -> None:
    """A corrupt record in the queue lands in the dead-letter topic with its reason; later events still arrive."""
    from confluent_kafka import Producer

    from regionkit import read_topic
    from sluice.core.codec import get_codec

    log = tmp_path / "offers.jsonl"
    queue = _queue("q", log, parallel=False, dispatcher_threads=1, batch_size=10)
    cfg = write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=any_site.bootstrap,
                         prefix=any_site.topic_prefix(unique_prefix), queue=queue)
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        region.wait_ready()
        before = _write([region.url], threads=1, per_thread=10, keys=5)
        producer = Producer({"bootstrap.servers": any_site.bootstrap})
        producer.produce(cfg.topics.queue("q"), b"\x00not avro at all", b"bad", partition=0)
        producer.flush(10)
        after = _write([region.url], threads=1, per_thread=10, keys=5)
        _wait_delivered(log, {(e.member_id, e.thread_id, e.sequence_id) for _, e, _ in before + after})
        dead = read_topic(any_site.bootstrap, cfg.topics.dead_letter("q"), 1)
        assert len(dead) == 1
        letter = get_codec().decode_as("DeadLetter", dead[0][2])
        assert letter["value"] == b"\x00not avro at all" and letter["key"] == b"bad"
        # A first byte 00 is Confluent's framing (core/framing.py), which this site has no registry to read.
        assert "names no schema_registry" in letter["reason"] and letter["source_topic"] == cfg.topics.queue("q")
        assert dispatcher.proc.poll() is None, "the dispatcher died on a corrupt record"
    finally:
        dispatcher.stop()
        region.stop()


@pytest.mark.parametrize("listener", ["recording", "sql"])
def test_an_event_body_that_does_not_decode_is_dead_lettered_at_first_touch_and_the_rest_delivered_once(
    listener: str, site_a, unique_prefix, tmp_path: Path
) -> None:
    """A queue record whose QueuedEvent header and fields are valid but whose event body is damaged, between
    good ones: the listener's first touch of it finds it; it lands in the dead-letter topic with its reason,
    and every good event is delivered exactly once, in order (the SQL listener's table holds them all)."""
    import sqlite3

    from confluent_kafka import Producer

    from regionkit import read_topic
    from sluice.core.codec import get_codec
    from sluice.core.events import EntryEvent, Operation, VersionTag
    from sluice.core.eventwire import entry_event_body, queued_event

    log = tmp_path / "offers.jsonl"
    if listener == "sql":
        queue = {"id": "q", "parallel": False, "dispatcher_threads": 1, "batch_size": 10,
                 "listener": {"type": "python", "class_path": "recording_listener:RecordingSqlListener",
                              "settings": {"path": str(log), "url": f"sqlite:///{tmp_path}/q.db", "table": "orders"}}}
    else:
        queue = _queue("q", log, parallel=False, dispatcher_threads=1, batch_size=10)
    cfg = write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                         prefix=site_a.topic_prefix(unique_prefix), queue=queue)
    codec = get_codec()
    now_ms = int(time.time() * 1000)
    member = f"w-{uuid.uuid4().hex[:6]}"
    bodies = [entry_event_body(EntryEvent("orders", f"k{i}", Operation.CREATE, b'{"n": %d}' % i,
                                          EventID(member, 1, i), VersionTag(1, now_ms, 1, member), 1, 0, now_ms))
              for i in range(25)]
    damaged_at = 12
    bodies[damaged_at] = bodies[damaged_at][:-3]  # its last fields cut off: region and key still read
    producer = Producer({"bootstrap.servers": site_a.bootstrap})
    for i, body in enumerate(bodies):
        producer.produce(cfg.topics.queue("q"), queued_event(codec.header("QueuedEvent"), 0, "q", 0, i, now_ms, body),
                         f"k{i}".encode(), partition=0)
    assert producer.flush(30) == 0
    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        good = {(member, 1, i) for i in range(25) if i != damaged_at}
        offers = _wait_delivered(log, good)
        delivered = [e for o in offers if o["accepted"] for e in o["events"]]
        assert [e[1] for e in delivered] == [i for i in range(25) if i != damaged_at], "each once, in order"
        dead = read_topic(site_a.bootstrap, cfg.topics.dead_letter("q"), 1)
        assert len(dead) == 1
        letter = codec.decode_as("DeadLetter", dead[0][2])
        assert (letter["source_offset"], letter["key"], letter["value"], letter["event"]) == \
            (damaged_at, f"k{damaged_at}".encode(), bodies[damaged_at], None)
        assert letter["error_class"] == "MalformedRecord"
        assert f"the event at q[0]@{damaged_at} does not decode" in letter["reason"] and "truncated" in letter["reason"]
        if listener == "sql":
            with sqlite3.connect(tmp_path / "q.db") as conn:
                keys = {k for (k,) in conn.execute("SELECT key FROM orders_live")}
            assert keys == {f"k{i}" for i in range(25) if i != damaged_at}
        read_until(lambda: queue_size(cfg, "q"), lambda size: size == 0, timeout_s=DRAIN_S, poll_s=0.2)
        assert sum(r.size for r in queue_status(cfg, "q")) == 0, "the queue drained past the dead letter"
        assert dispatcher.proc.poll() is None
    finally:
        dispatcher.stop()
