"""The region service under a crash: nothing acknowledged is lost, nothing is applied twice.

Two region-service instances share a region's buckets through the consumer
group.  Writer threads send thousands of entry operations (many updates per
key, some destroys, some put_alls) through both instances with retrying
clients, and one instance is killed with SIGKILL mid-stream: the writers are
still writing when it dies, and (with local stores) when it is back.
Afterwards:

* the region holds exactly the last acknowledged value of every key;
* with ``redundant_copies: 1`` the survivor, which kept a standby copy of
  each of the killed owner's buckets, promotes those copies rather than
  reading the buckets again;
* with local stores as well, the killed instance starts again on its store
  (left dirty by the kill) while the writers go on, and takes buckets back;
* each attached queue (a parallel gateway sender queue and a serial async
  event queue), after discarding repeats of an EventID, holds every applied
  event exactly once, in per-key order, and nothing else.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.events import EventID

from regionkit import RegionProcess, read_queue, read_topic, wait_standbys, write_site
from waiting import wait_for

pytestmark = pytest.mark.timeout(600)

#: How long the writers may take to a point of the test (a kill, a restart), and a survivor to take a
#: paused owner's bucket over (its session timeout and a rebalance).
WRITES_S = 300
TAKEOVER_S = 60

WRITERS = 4
#: Operations per writer at least: 1,000 in `make test` (each key written ~16 times, a third before the kill);
#: the long tier's variants keep 2,500.
OPS_PER_WRITER = 1000
OPS_PER_WRITER_LONG = 2500
KEYS_PER_WRITER = 60
#: Operations acknowledged after the killed instance is back on its store before the writers may stop: it
#: takes writes under load, whatever the machine's speed.
OPS_AFTER_RESTART = 200


class Writer(threading.Thread):
    """Writes its own keys in order and logs every acknowledged operation."""

    def __init__(self, index: int, urls: list[str], seed: int, ops: int, hold_open: threading.Event) -> None:
        super().__init__(name=f"writer-{index}", daemon=True)
        self.index = index
        self.ops = ops  # at least; more while ``hold_open`` is set
        self.hold_open = hold_open
        self.client = RegionClient(urls, retry_for_s=90)
        self.rng = random.Random(seed)
        self.keys = [f"w{index}-k{i:03d}" for i in range(KEYS_PER_WRITER)]
        self.state: dict[str, Any] = {}  # last acknowledged value; absent = destroyed / never written
        self.acked: list[tuple[str, EventID]] = []  # (key, EventID) in acknowledgement order
        self.done = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.done < self.ops or self.hold_open.is_set():
                roll = self.rng.random()
                if roll < 0.08:
                    batch = {k: {"w": self.index, "n": self.done, "k": k} for k in self.rng.sample(self.keys, 10)}
                    eid = self.client.next_event_id(len(batch))
                    self.client.put_all("orders", batch, event_id=eid)
                    for i, (k, v) in enumerate(batch.items()):
                        self.acked.append((k, EventID(eid.member_id, eid.thread_id, eid.sequence_id + i)))
                        self.state[k] = v
                    self.done += len(batch)
                    continue
                key = self.rng.choice(self.keys)
                eid = self.client.next_event_id()
                if roll < 0.15 and key in self.state:
                    self.client.destroy("orders", key, event_id=eid)
                    del self.state[key]
                else:
                    value = {"w": self.index, "n": self.done, "k": key}
                    self.client.put("orders", key, value, event_id=eid)
                    self.state[key] = value
                self.acked.append((key, eid))
                self.done += 1
        except BaseException as exc:  # recorded for the test thread to raise
            self.error = exc


#: The variant with copies and local stores runs in `make test`: it kills an owner that has a standby, the
#: survivor promotes its copies, and the killed instance comes back on its dirty store, all under writes.
#: It writes 4,000 operations at least (issue 21: the checks are per key and per EventID, and a third of the
#: work before the kill still puts it mid-stream).  The two others are the long tier (`make test-long`, CI):
#: each is 10,000 operations through two processes, minutes of CPU on two cores, and what they add is covered
#: in `make test` too: reading a killed owner's buckets from the changelog (test_region_kept_buckets) and
#: promoting standby copies (the variant kept).
LONG = pytest.mark.slow


@pytest.mark.parametrize(("copies", "stores", "ops_per_writer"),
                         [pytest.param(0, False, OPS_PER_WRITER_LONG, marks=LONG, id="no-copies"),
                          pytest.param(1, False, OPS_PER_WRITER_LONG, marks=LONG, id="redundant-copies-1"),
                          pytest.param(1, True, OPS_PER_WRITER, id="copies-and-local-stores")])
def test_kill_9_one_of_two_instances_mid_stream_loses_and_duplicates_nothing(site_a, unique_prefix, tmp_path: Path,
                                                                            copies: int, stores: bool,
                                                                            ops_per_writer: int):
    """A SIGKILLed owner's buckets move to the survivor; the region and both queues stay exact."""
    prefix = site_a.topic_prefix(unique_prefix)
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix,
                     redundant_copies=copies)
    store_dirs = [tmp_path / f"store-{i}" if stores else None for i in range(2)]
    instances = [RegionProcess(tmp_path / "site.yaml", tmp_path / f"region-{i}.log", store_dir=store_dirs[i])
                 for i in range(2)]
    # With local stores the writers go on until the restarted instance has taken writes.
    hold_open = threading.Event()
    if stores:
        hold_open.set()
    try:
        for inst in instances:
            inst.wait_ready()
        if copies:
            victims = wait_standbys(instances[1], instances[0])
        urls = [inst.url for inst in instances]
        writers = [Writer(i, urls, seed=1000 + i, ops=ops_per_writer, hold_open=hold_open) for i in range(WRITERS)]
        started = time.monotonic()
        for w in writers:
            w.start()
        # Kill one instance once about a third of the work is acknowledged.
        total = WRITERS * ops_per_writer

        def acknowledged(count: int) -> bool:
            assert all(w.error is None for w in writers), [w.error for w in writers]
            return sum(w.done for w in writers) >= count

        wait_for(lambda: acknowledged(total // 3), timeout_s=WRITES_S, what=f"{total // 3} operations acknowledged",
                 poll_s=0.05)
        killed_at = sum(w.done for w in writers)
        instances[0].kill()
        if stores:
            # The killed instance starts again on its store while the writers go on.
            wait_for(lambda: acknowledged(2 * total // 3), timeout_s=WRITES_S,
                     what=f"{2 * total // 3} operations acknowledged", poll_s=0.05)
            instances.append(RegionProcess(tmp_path / "site.yaml", tmp_path / "region-0-again.log",
                                           store_dir=store_dirs[0]))
            instances[-1].wait_ready()
            restarted_at = sum(w.done for w in writers)
            wait_for(lambda: acknowledged(restarted_at + OPS_AFTER_RESTART), timeout_s=WRITES_S,
                     what=f"{OPS_AFTER_RESTART} operations acknowledged after the restart", poll_s=0.05)
            hold_open.clear()
        for w in writers:
            w.join(300)
        assert not any(w.is_alive() for w in writers), "a writer is still writing"
        elapsed = time.monotonic() - started
        errors = [w.error for w in writers if w.error is not None]
        assert not errors, errors
        retries = sum(w.client.retries for w in writers)
        done = sum(w.done for w in writers)
        print(f"\n{done} ops in {elapsed:.1f}s, instance 0 killed after {killed_at}; client retries {retries}")
        # The kill landed mid-stream: the writers were still writing, and went on through the survivor.
        assert total // 3 <= killed_at < done, (killed_at, done)
        if stores:
            assert restarted_at + OPS_AFTER_RESTART <= done, (restarted_at, done)

        if stores:
            again = instances[-1].stats()
            assert again["loads"] >= 1 and again["store_write_errors"] == 0, again
            print(f"restarted on its store: {again['loads']} buckets loaded, {again['loads_from_store']} from the "
                  f"store, {again['store_rebuilt']} stores rebuilt, {again['records_replayed']} records replayed")
        if copies:
            stats = instances[1].stats()
            assert stats["loads_from_standby"] == len(victims), stats
            print(f"standby copies promoted: {stats['loads_from_standby']}, records replayed at promotion and "
                  f"in the survivor's own loads: {stats['records_replayed']}")
        survivor = RegionClient([instances[1].url])
        # 1. The region holds exactly the last acknowledged value of every key.
        expected: dict[str, Any] = {}
        all_keys: list[str] = []
        for w in writers:
            expected.update(w.state)
            all_keys.extend(w.keys)
        entries = survivor.get_all("orders", all_keys)
        wrong = {k: (entries.get(k), expected.get(k)) for k in all_keys
                 if (entries.get(k) or {}).get("value") != expected.get(k)}
        assert not wrong, f"{len(wrong)} keys differ, e.g. {list(wrong.items())[:3]}"
        assert sorted(survivor.keys("orders")) == sorted(expected)

        # 2. Each queue holds every applied event exactly once, in per-key order, nothing else.
        acked_by_key: dict[str, list[EventID]] = defaultdict(list)
        for w in writers:
            for key, eid in w.acked:
                acked_by_key[key].append(eid)
        acked_ids = {eid for ids in acked_by_key.values() for eid in ids}
        assert len(acked_ids) == sum(len(w.acked) for w in writers) >= total

        for queue in cfg.attached_queues("orders"):
            records = read_queue(site_a.bootstrap, queue.topic, queue.partitions)
            seen: set[EventID] = set()
            repeats = 0
            by_key: dict[str, list[EventID]] = defaultdict(list)
            for r in records:
                eid = r.event.event_id
                if eid in seen:
                    repeats += 1
                    assert r.event.possible_duplicate, f"repeat of {eid} in {queue.id} not marked possibleDuplicate"
                    continue
                seen.add(eid)
                by_key[r.event.key].append(eid)
            print(f"queue {queue.id}: {len(records)} records, {repeats} repeats discarded")
            assert seen - acked_ids == set(), f"{queue.id} holds events nobody applied: {list(seen - acked_ids)[:3]}"
            assert acked_ids - seen == set(), f"{queue.id} lost events: {list(acked_ids - seen)[:3]}"
            for key, ids in acked_by_key.items():
                assert by_key[key] == ids, f"{queue.id}: key {key} out of order"

        # 3. The changelog agrees: every acknowledged EventID is in it.
        codec = get_codec()
        changelog_ids = {
            EventID.from_record(codec.decode_as("EntryEvent", value)["event_id"])
            for _, _, value in read_topic(site_a.bootstrap, cfg.topics.region_changelog("orders"), 8)
        }
        assert acked_ids <= changelog_ids
    finally:
        hold_open.clear()  # a failed wait must not leave the writers writing
        for inst in instances:
            inst.stop()


def test_a_paused_owner_that_wakes_up_never_acknowledges_a_lost_write(site_a, unique_prefix, tmp_path: Path):
    """An owner SIGSTOPped past its session timeout may not answer a stale write with success unless it stuck."""
    import httpx

    from sluice.core.kafka import partition_for_key

    prefix = site_a.topic_prefix(unique_prefix)
    write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix)
    a, b = (RegionProcess(tmp_path / "site.yaml", tmp_path / f"region-{i}.log") for i in range(2))
    try:
        a.wait_ready()
        b.wait_ready()
        owned_by_a = {row["bucket"] for row in httpx.get(f"{a.url}/buckets").json()["buckets"]
                      if row["owner"] == a.url}
        assert owned_by_a, "instance a owns no bucket"
        key = next(f"z{i}" for i in range(1000) if partition_for_key(f"z{i}".encode(), 8) in owned_by_a)
        bucket = partition_for_key(key.encode(), 8)

        a.pause()
        stale: dict[str, object] = {}

        def send_stale() -> None:
            r = httpx.post(f"{a.url}/regions/orders/put", timeout=90,
                           json={"key": key, "value": "stale",
                                 "event_id": {"member_id": "zombie-test", "thread_id": 1, "sequence_id": 0}})
            stale["status"], stale["body"] = r.status_code, r.json()

        sender = threading.Thread(target=send_stale, daemon=True)
        sender.start()
        # b takes the bucket over once a's session times out.
        paused_at = time.monotonic()
        wait_for(lambda: any(r["bucket"] == bucket and r["owner"] == b.url and r["status"] == "ready"
                             for r in httpx.get(f"{b.url}/buckets").json()["buckets"]),
                 timeout_s=TAKEOVER_S, what=f"b takes bucket {bucket} over from the paused a", poll_s=0.2)
        taken_over = time.monotonic()
        fresh = RegionClient([b.url]).put("orders", key, "fresh")
        assert fresh["status"] == "ok"

        a.resume()
        sender.join(90)
        assert "status" in stale, "the stale request never completed"
        value = RegionClient([b.url]).get("orders", key)
        print(f"\nstale write answered {stale['status']} {stale['body']}; value now {value!r}; "
              f"takeover {taken_over - paused_at:.1f}s after the pause")
        if stale["status"] == 200:
            # Acknowledged: it must have been applied after the fresh write, by the real owner.
            assert value == "stale"
        else:
            assert stale["status"] in (421, 503) and stale["body"]["retriable"] is True
            assert value == "fresh"
    finally:
        a.stop()
        b.stop()
