"""A paused owner that resumes after losing its buckets leaves nothing in the changelog or the queues.

Two region-service instances share a region's buckets.  Writer threads keep
writing keys of instance A's buckets through both instances, with retrying
clients whose attempts at A time out while it is paused.  A is SIGSTOPped
past its session timeout; B takes its buckets over and serves them; A is
SIGCONTed with requests still queued at it (the attempts that timed out,
retried meanwhile at B with the same EventIDs) and the writers go on.  A
resumes believing it still owns its buckets until its group thread hears
otherwise, so it applies those requests on its stale state: a zombie writer.

Then every changelog and queue partition is read both read_committed and
read_uncommitted, and:

* the committed changelog of each key is one line of versions (1, 2, 3, …):
  every committed record was applied by an owner holding every record before
  it, so nothing the paused owner wrote after B took the bucket over is
  committed (what it wrote is aborted, and visible only read_uncommitted);
* every acknowledged write is in the committed changelog exactly once, and
  no EventID is there twice: 0 lost, 0 applied twice;
* every queue holds every acknowledged event and nothing the changelog does
  not hold (repeats only as possibleDuplicate), and the region holds the last
  acknowledged value of every key.

Two tests take the mechanism apart, on a real broker: a window written with
the group metadata of a generation the owner has lost is refused by the group
coordinator and aborted (KIP-447); and a transaction a dead owner left open
is ended by the new owner fencing that owner's transactional.id, long before
the transaction would time out.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.events import EntryEvent, EventID
from sluice.core.errors import OwnershipUnconfirmed
from sluice.core.kafka import close_producer, make_consumer, make_transactional_producer, partition_for_key
from sluice.region.engine import RegionEngine, transactional_id_of
from sluice.region.fanout import QueueTarget, RecordBuilder, Window, WindowWriter

from regionkit import RegionProcess, read_queue, read_topic, write_site
from waiting import wait_for

pytestmark = pytest.mark.timeout(120)

BUCKETS = 8
WRITERS = 6
KEYS_PER_WRITER = 3
#: A client's attempt at the paused instance gives up after this and is retried at the other one.
ATTEMPT_TIMEOUT_S = 1.5


class Writer(threading.Thread):
    """Puts its own keys in order, through both instances, and logs what was acknowledged."""

    def __init__(self, index: int, urls: list[str], keys: list[str]) -> None:
        super().__init__(name=f"writer-{index}", daemon=True)
        self.client = RegionClient(urls, timeout_s=ATTEMPT_TIMEOUT_S, retry_for_s=60)
        self.keys = keys
        self.index = index
        self.acked: list[tuple[str, EventID, Any]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        n = 0
        try:
            while not self.stop.is_set():
                key = self.keys[n % len(self.keys)]
                eid = self.client.next_event_id()
                value = {"w": self.index, "n": n}
                self.client.put("orders", key, value, event_id=eid)
                self.acked.append((key, eid, value))
                n += 1
        except BaseException as exc:  # recorded for the test thread to raise
            self.error = exc


def _owned_by(url: str) -> dict[int, str]:
    """bucket → status of the buckets the instance at ``url`` owns."""
    return {r["bucket"]: r["status"] for r in httpx.get(f"{url}/buckets", timeout=5).json()["buckets"]
            if r["owner"] == url}


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    wait_for(condition, timeout_s=timeout_s, what=what, poll_s=0.05)


def _acks(writers: list[Writer]) -> int:
    return sum(len(w.acked) for w in writers)


def test_a_paused_owner_that_resumes_leaves_no_record_the_new_owner_did_not_apply(site_a, unique_prefix,
                                                                                  tmp_path: Path):
    """SIGSTOP an owner past its session timeout under writes, SIGCONT it: no zombie record is committed."""
    prefix = site_a.topic_prefix(unique_prefix)
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix, buckets=BUCKETS)
    a, b = (RegionProcess(tmp_path / "site.yaml", tmp_path / f"region-{n}.log") for n in "ab")
    writers: list[Writer] = []
    try:
        a.wait_ready()
        b.wait_ready()
        _wait(lambda: len(_owned_by(a.url)) + len(_owned_by(b.url)) == BUCKETS, 30, "the buckets shared out")
        a_buckets = set(_owned_by(a.url))
        assert a_buckets, "instance a owns no bucket"
        candidates = (f"z{i}" for i in range(100_000))
        keys = [k for k in candidates if partition_for_key(k.encode(), BUCKETS) in a_buckets][:WRITERS * KEYS_PER_WRITER]
        writers = [Writer(i, [a.url, b.url], keys[i * KEYS_PER_WRITER:(i + 1) * KEYS_PER_WRITER])
                   for i in range(WRITERS)]
        for w in writers:
            w.start()
        _wait(lambda: _acks(writers) >= 200, 30, "200 writes acknowledged before the pause")

        a.pause()
        paused_at = time.monotonic()
        # B takes a's buckets once a's session times out, and serves them.
        _wait(lambda: a_buckets <= {bk for bk, s in _owned_by(b.url).items() if s == "ready"}, 40,
              "b serving a's buckets")
        taken_s = time.monotonic() - paused_at
        before = _acks(writers)
        _wait(lambda: _acks(writers) >= before + 50, 20, "50 writes acknowledged by b")
        a.resume()
        resumed_acks = _acks(writers)
        _wait(lambda: _acks(writers) >= resumed_acks + 200, 40, "200 writes acknowledged after the resume")
        for w in writers:
            w.stop.set()
        for w in writers:
            w.join(60)
        errors = [w.error for w in writers if w.error is not None]
        assert not errors, errors
        a_instance = a.stats()["instance"]
        a_stats = a.stats()
        print(f"\nb took a's buckets {sorted(a_buckets)} {taken_s:.1f} s after the pause; {_acks(writers)} writes "
              f"acknowledged; a after the resume: {a_stats['windows_failed']} windows failed, "
              f"{a_stats['producers_rebuilt']} producers rebuilt; b fenced {b.stats()['owners_fenced']} owners")

        codec = get_codec()
        acked = {eid: (key, value) for w in writers for key, eid, value in w.acked}
        last_value = {key: value for w in writers for key, _, value in w.acked}

        # 1. The changelog, committed: one line of versions per key, each acknowledged write once.
        changelog = cfg.topics.region_changelog("orders")
        committed = [(p, o, EntryEvent.from_record(codec.decode_as("EntryEvent", v)))
                     for p, o, v in read_topic(site_a.bootstrap, changelog, BUCKETS)]
        everything = [(p, o, EntryEvent.from_record(codec.decode_as("EntryEvent", v)))
                      for p, o, v in read_topic(site_a.bootstrap, changelog, BUCKETS, "read_uncommitted")]
        committed_at = {(p, o) for p, o, _ in committed}
        aborted = [(p, o, e) for p, o, e in everything if (p, o) not in committed_at]
        aborted_by_a = [e for _, _, e in aborted if e.version.member_id == a_instance]
        print(f"changelog: {len(committed)} committed records, {len(aborted)} aborted "
              f"({len(aborted_by_a)} stamped by the paused owner)")
        versions: dict[str, list[int]] = defaultdict(list)
        for _, _, event in sorted(committed, key=lambda r: (r[0], r[1])):
            versions[event.key].append(event.version.entry_version)
        broken = {k: v for k, v in versions.items() if v != list(range(1, len(v) + 1))}
        assert not broken, f"keys whose committed versions are not one line (a zombie's write): {broken}"
        counts = Counter(e.event_id for _, _, e in committed)
        twice = [eid for eid, n in counts.items() if n > 1]
        assert not twice, f"{len(twice)} EventIDs applied more than once, e.g. {twice[:3]}"
        lost = [eid for eid in acked if eid not in counts]
        assert not lost, f"{len(lost)} acknowledged writes not in the changelog, e.g. {lost[:3]}"

        # 2. Every queue: every acknowledged event, nothing the changelog lacks, repeats only as duplicates.
        for queue in cfg.attached_queues("orders"):
            records = read_queue(site_a.bootstrap, queue.topic, queue.partitions)
            seen: set[EventID] = set()
            for r in records:
                eid = r.event.event_id
                if eid in seen:
                    assert r.event.possible_duplicate, f"repeat of {eid} in {queue.id} not marked possibleDuplicate"
                seen.add(eid)
            assert seen <= set(counts), f"{queue.id} holds events the region never applied: {list(seen - set(counts))[:3]}"
            assert set(acked) <= seen, f"{queue.id} lost events: {[e for e in acked if e not in seen][:3]}"
            everything_queued = read_queue(site_a.bootstrap, queue.topic, queue.partitions, "read_uncommitted")
            print(f"queue {queue.id}: {len(records)} committed records, "
                  f"{len(everything_queued) - len(records)} aborted")

        # 3. The region holds the last acknowledged value of every key.
        entries = RegionClient([b.url, a.url]).get_all("orders", list(last_value))
        wrong = {k: (entries.get(k) or {}).get("value") for k, v in last_value.items()
                 if (entries.get(k) or {}).get("value") != v}
        assert not wrong, f"{len(wrong)} keys hold another value than the last acknowledged, e.g. {list(wrong.items())[:3]}"
    finally:
        for w in writers:
            w.stop.set()
        a.resume()
        a.stop()
        b.stop()


def _event(key: str, bucket: int, n: int) -> EntryEvent:
    from sluice.core.events import Operation, VersionTag

    return EntryEvent(region="orders", key=key, operation=Operation.CREATE, value=b'{"n": %d}' % n,
                      event_id=EventID("zombie", 1, n), version=VersionTag(1, 1_700_000_000_000, 1, "zombie"),
                      origin_dsid=1, bucket=bucket, event_time=1_700_000_000_000)


def test_a_window_with_a_lost_generation_is_refused_and_aborted(site_a, unique_prefix, tmp_path: Path):
    """A member that stopped polling past its session timeout, while another member took its
    partitions, writes a window with its old group metadata: the coordinator refuses the offsets, the
    window is aborted: none of its changelog and queue records is committed (those that reached the
    broker before the abort are there read_uncommitted only)."""
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), buckets=2)
    changelog = cfg.topics.region_changelog("orders")
    group = f"{cfg.kafka.topic_prefix}region"
    # librdkafka heartbeats from a thread of its own: a member that stops polling leaves the group
    # after max.poll.interval.ms, as a paused process's member times out.
    settings = {"session.timeout.ms": 3000, "heartbeat.interval.ms": 500, "max.poll.interval.ms": 3000}
    zombie = make_consumer(cfg.kafka.client_settings(), group, **settings)
    zombie.subscribe([changelog])
    _wait(lambda: zombie.poll(0.05) is None and len(zombie.assignment()) == 2, 30, "the first member assigned")
    stale_metadata = zombie.consumer_group_metadata()
    # The first member stops polling (paused); a second one takes its partitions.
    successor = make_consumer(cfg.kafka.client_settings(), group, **settings)
    successor.subscribe([changelog])
    _wait(lambda: successor.poll(0.05) is None and len(successor.assignment()) == 2, 30,
          "the second member assigned both partitions")

    targets = {"orders": [QueueTarget(id=q.id, topic=q.topic, kind=q.kind, parallel=q.parallel,
                                      partitions=q.partitions, order_policy=q.order_policy)
                          for q in cfg.attached_queues("orders")]}
    builder = RecordBuilder(get_codec(), {"orders": changelog}, targets)
    window = Window()
    for n in range(3):
        changelog_record, queued = builder.records(_event(f"k{n}", 0, n))
        window.add(("orders", 0, 1), 0, changelog_record, queued)
    producer = make_transactional_producer(cfg.kafka.client_settings(), transactional_id_of(group, "zombie"), 10_000)
    try:
        producer.init_transactions(30)
        outcome = WindowWriter(producer, {"orders": changelog}, timeout_s=10).write(window, set(), stale_metadata)
    finally:
        close_producer(producer, 5)
        successor.close()
        zombie.close()
    assert isinstance(outcome.error, OwnershipUnconfirmed), outcome
    assert outcome.committed is None
    assert read_topic(site_a.bootstrap, changelog, 2) == []
    assert len(read_topic(site_a.bootstrap, changelog, 2, "read_uncommitted")) <= 3
    for queue in cfg.attached_queues("orders"):
        assert read_queue(site_a.bootstrap, queue.topic, queue.partitions) == []
        assert len(read_queue(site_a.bootstrap, queue.topic, queue.partitions, "read_uncommitted")) <= 3


def test_a_transaction_a_dead_owner_left_open_is_fenced_by_the_new_owner(site_a, unique_prefix, tmp_path: Path):
    """A dead owner's transaction holds records open in the changelog (its timeout far away); the new
    owner's load waits on it, fences the transactional.id of the owner the directory shows gone, and
    serves the bucket within seconds, without the aborted records; the dead producer is fenced for good."""
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), buckets=1)
    changelog = cfg.topics.region_changelog("orders")
    group = f"{cfg.kafka.topic_prefix}region"
    dead = make_transactional_producer(cfg.kafka.client_settings(), transactional_id_of(group, "dead-1"), 60_000)
    dead.init_transactions(30)
    dead.begin_transaction()
    builder = RecordBuilder(get_codec(), {"orders": changelog}, {})
    dead.produce(changelog, builder.records(_event("left-open", 0, 1))[0][3], b"left-open", partition=0)
    assert dead.flush(10) == 0

    asked: list[tuple[str, int]] = []

    def gone_owners(region: str, bucket: int, since_ms: int) -> list[str]:
        asked.append((region, bucket))
        return ["dead-1"]

    kafka = cfg.kafka
    engine = RegionEngine(
        site=cfg.site, dsid=cfg.dsid, member_id="new-owner", client_id="fence-test", kafka_settings=kafka.client_settings(),
        group_settings=kafka.group_settings(), producer_settings=kafka.producer_settings(), group_id=group,
        regions={"orders": 1}, changelog_topics={"orders": changelog}, targets={}, codec=get_codec(),
        load_timeout_s=30, gone_owners=gone_owners)
    engine.start()
    try:
        assert engine.assigned_once.wait(30)
        started = time.monotonic()
        assert engine.wait_ready("orders", 0, 20), "the bucket never became ready"
        waited_s = time.monotonic() - started
        print(f"\nready {waited_s:.1f} s after the assignment (the dead owner's transaction timeout: 60 s)")
        assert asked == [("orders", 0)] and engine.stats["owners_fenced"] == 1
        state = engine.read("orders", 0)
        with engine.read_lock:
            assert state.get("left-open") is None
        with pytest.raises(Exception) as fenced:
            dead.commit_transaction(10)
        assert fenced.value.args[0].fatal(), fenced.value
    finally:
        engine.stop()
        close_producer(dead, 1)
    assert read_topic(site_a.bootstrap, changelog, 1) == []
