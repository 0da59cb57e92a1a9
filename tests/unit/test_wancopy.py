"""wan-copy without a broker: what an owner queues for a batch, and how a coordinator paces, cancels and retries.

1. ``RegionEngine.copy_entries`` on a bucket held in memory: each entry as it
   is, with its own EventID and version tag, possibleDuplicate, this site as
   origin, in the named sender's queue only (no changelog record, no other
   queue); tombstones, invalid entries, entries the remote site wrote,
   absent keys and filtered ones left out and counted; a bucket not owned or
   loading, an unknown sender or a full window refused before anything is
   queued; the request answered when the window is.
2. ``WanCopies`` over owners simulated in memory: every bucket copied once,
   in order; ``max_rate`` never exceeded over the copy; a cancel stops it
   between batches; a retriable refusal is asked again, another fails it.
3. ``Snapshots`` drops the least recently used and the idle.
4. ``sluice admin wan-copy`` refuses bad options, naming them, before any
   request.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from sluice.cli import main as sluice_main
from sluice.core.codec import get_codec
from sluice.core.errors import BucketUnavailable, InvalidRequest, NotOwner, SluiceError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import FLAG_NO_CALLBACKS, FLAG_POSSIBLE_DUPLICATE, FLAG_ROUTED
from sluice.core.kafka import partition_for_key
from sluice.region import wancopy
from sluice.region.engine import BucketStatus, OwnedBucket, RegionEngine
from sluice.region.fanout import QueueTarget
from sluice.region.state import BucketState
from sluice.region.wancopy import BatchAnswer, CopyState, Snapshots, WanCopies

BUCKET = 3


def make_engine(enqueue: Any = None, window_records_max: int = 200_000) -> RegionEngine:
    targets = {"orders": [
        QueueTarget(id="to-b", topic="q.to-b", kind="gateway-sender", parallel=True, partitions=8,
                    order_policy="KEY", remote_dsid=2, enqueue=enqueue),
        QueueTarget(id="to-c", topic="q.to-c", kind="gateway-sender", parallel=False, partitions=3,
                    order_policy="KEY", remote_dsid=3),
        QueueTarget(id="writer", topic="q.writer", kind="async-event-queue", parallel=True, partitions=8,
                    order_policy="KEY"),
    ]}
    return RegionEngine(site="a", dsid=1, member_id="a-1", client_id="test", kafka_settings={}, group_settings={},
                        producer_settings={}, group_id="g", regions={"orders": 8},
                        changelog_topics={"orders": "changelog.orders"}, targets=targets, codec=get_codec(),
                        window_records_max=window_records_max)


def write(state: BucketState, key: str, seq: int, *, dsid: int = 1, operation: Operation = Operation.UPDATE,
          value: bytes | None = b'{"v": 1}', version: int = 1) -> EntryEvent:
    event = EntryEvent(region="orders", key=key, operation=operation, value=value,
                       event_id=EventID(f"writer-{dsid}", 4, seq), version=VersionTag(dsid, 1_700_000_000_000 + seq,
                                                                                      version, f"m{dsid}"),
                       origin_dsid=dsid, bucket=BUCKET, event_time=1_700_000_000_000 + seq)
    state.replay(event)
    return event


def owned(engine: RegionEngine, status: BucketStatus = BucketStatus.READY) -> BucketState:
    state = BucketState("orders", BUCKET, 1, "a-1")
    engine._owned[("orders", BUCKET)] = OwnedBucket("orders", BUCKET, epoch=1, status=status, state=state,
                                                     checkpoint=40)
    return state


def queued(record: tuple[Any, ...]) -> tuple[str, int, int, EntryEvent]:
    topic, partition, _key, value, _headers = record
    r = get_codec().decode_as("QueuedEvent", value)
    return topic, partition, r["flags"], EntryEvent.from_record(r["event"])


# --- 1. what an owner queues ------------------------------------------------------------------------


def test_an_owner_queues_each_entry_as_it_is_for_the_named_sender_only() -> None:
    """Live entries go as UPDATEs with their own EventID and version, possibleDuplicate and routed, origin this
    site, partition = bucket (parallel); tombstones, invalid entries, the remote site's entries and absent keys
    are counted apart; no changelog record, nothing for the other sender or the async event queue."""
    engine = make_engine()
    state = owned(engine)
    live = write(state, "live", 1, version=3)
    from_c = write(state, "from-c", 2, dsid=3)
    write(state, "gone", 3, operation=Operation.DESTROY, value=None, version=2)
    write(state, "invalid", 4, operation=Operation.INVALIDATE, value=None)
    write(state, "from-b", 5, dsid=2)
    answered: list[Any] = []
    counts = engine.copy_entries("orders", BUCKET, ["live", "from-c", "gone", "invalid", "from-b", "never"], "to-b",
                                 destroyed=False, on_done=answered.append)
    assert counts == {"copied": 2, "absent": 1, "destroyed": 1, "invalid": 1, "remote_site": 1, "filtered": 0}
    window = engine._window
    assert window.last_changelog == {} and window.checkpoints == {("orders", BUCKET, 1): 40}
    records = [queued(r) for r, _ in window.records]
    flags = FLAG_POSSIBLE_DUPLICATE | FLAG_ROUTED | FLAG_NO_CALLBACKS
    assert [(t, p, f) for t, p, f, _ in records] == [("q.to-b", BUCKET, flags)] * 2
    for (_, _, _, event), source in zip(records, (live, from_c)):
        assert (event.key, event.operation, event.value) == (source.key, Operation.UPDATE, source.value)
        assert (event.event_id, event.version) == (source.event_id, source.version)
        assert event.possible_duplicate and event.origin_dsid == 1 and event.visited_dsids == ()
    assert engine.stats["wan_copied"] == 2
    # Answered when the window is committed, not before.
    assert answered == []
    pending, slots = window.waiting[0]
    assert slots == frozenset({("orders", BUCKET, 1)})
    pending.done()
    assert answered == [None]


def test_a_copy_of_given_keys_sends_a_tombstone_as_a_destroy_and_a_serial_sender_partitions_by_key() -> None:
    engine = make_engine()
    state = owned(engine)
    gone = write(state, "gone", 3, operation=Operation.DESTROY, value=None, version=2)
    counts = engine.copy_entries("orders", BUCKET, ["gone"], "to-c", destroyed=True, on_done=lambda _e: None)
    assert counts["copied"] == 1
    ((record, _),) = engine._window.records
    topic, partition, _, event = queued(record)
    assert (topic, partition) == ("q.to-c", partition_for_key(b"gone", 3))
    assert (event.operation, event.value, event.version, event.event_id) == (Operation.DESTROY, None, gone.version,
                                                                             gone.event_id)


def test_a_before_enqueue_filter_keeps_an_entry_out_of_the_copy_too() -> None:
    engine = make_engine(enqueue=lambda event, _p: None if event.key.startswith("secret") else event)
    state = owned(engine)
    write(state, "secret-1", 1)
    write(state, "open-1", 2)
    done: list[Any] = []
    counts = engine.copy_entries("orders", BUCKET, ["secret-1", "open-1"], "to-b", destroyed=False,
                                 on_done=done.append)
    assert (counts["copied"], counts["filtered"]) == (1, 1)
    assert [queued(r)[3].key for r, _ in engine._window.records] == ["open-1"]


def test_nothing_to_copy_answers_at_once_and_writes_no_window() -> None:
    engine = make_engine()
    owned(engine)
    done: list[Any] = []
    assert engine.copy_entries("orders", BUCKET, ["never"], "to-b", destroyed=True, on_done=done.append)["copied"] == 0
    assert done == [None] and engine._window.empty()


def test_refusals_come_before_anything_is_queued() -> None:
    engine = make_engine()
    with pytest.raises(NotOwner):
        engine.copy_entries("orders", BUCKET, ["k"], "to-b", destroyed=False, on_done=lambda _e: None)
    owned(engine, BucketStatus.LOADING)
    with pytest.raises(BucketUnavailable):
        engine.copy_entries("orders", BUCKET, ["k"], "to-b", destroyed=False, on_done=lambda _e: None)
    owned(engine)
    for sender in ("nobody", "writer"):  # an unknown id, and an async event queue
        with pytest.raises(InvalidRequest, match="not attached to a gateway sender"):
            engine.copy_entries("orders", BUCKET, ["k"], sender, destroyed=False, on_done=lambda _e: None)
    full = make_engine(window_records_max=2)
    write(owned(full), "k", 1)
    with pytest.raises(BucketUnavailable, match="wait for Kafka"):
        full.copy_entries("orders", BUCKET, ["k", "k2", "k3"], "to-b", destroyed=False, on_done=lambda _e: None)
    assert engine._window.empty() and full._window.empty()


def test_an_owner_goes_on_after_the_last_key_copied_even_from_a_new_snapshot() -> None:
    """``copy_owned`` takes the bucket's live keys, sorted, on the first batch and copies ``count`` of them after
    ``after``; answered once the window is committed.  A new owner (no snapshot) takes its own and goes on after
    the same key: a key created meanwhile below it is the live stream's, not the copy's."""
    import threading

    engine = make_engine()
    state = owned(engine)
    for n in range(25):
        write(state, f"k{n:02d}", n)
    service = SimpleNamespace(engine=engine, request_timeout_s=10.0)
    owner = WanCopies(service)  # type: ignore[arg-type]
    stop = threading.Event()

    def committer() -> None:  # what the engine's committer thread does for each window, minus Kafka
        while not stop.is_set():
            with engine._lock:
                window, engine._window = engine._window, type(engine._window)()
            for pending, _ in window.waiting:
                pending.done()
            time.sleep(0.001)

    thread = threading.Thread(target=committer, daemon=True)
    thread.start()
    try:
        async def go() -> list[BatchAnswer]:
            size = await owner.copy_owned("c1", "orders", "to-b", BUCKET, None, 0, None)
            first = await owner.copy_owned("c1", "orders", "to-b", BUCKET, None, 10, None)
            owner.snapshots.drop("c1", "orders", BUCKET)  # the bucket moved: its new owner has no snapshot
            write(state, "k05x", 99)
            second = await owner.copy_owned("c1", "orders", "to-b", BUCKET, first.next, 10, None)
            last = await owner.copy_owned("c1", "orders", "to-b", BUCKET, second.next, 10, None)
            return [size, first, second, last]

        size, first, second, last = asyncio.run(go())
    finally:
        stop.set()
        thread.join(5)
    assert (size.total, size.copied, size.done) == (25, 0, False)
    assert (first.copied, first.next, first.done) == (10, "k09", False)
    assert (second.total, second.copied, second.next) == (26, 10, "k19")
    assert (last.copied, last.next, last.done) == (5, None, True)
    assert owner.snapshots.get("c1", "orders", BUCKET) is None
    assert engine.stats["wan_copied"] == 25


# --- 2. the coordinator ---------------------------------------------------------------------------------


class SimulatedOwners(WanCopies):
    """A coordinator whose buckets are owned here and held in memory (``keys`` per bucket); records every batch."""

    def __init__(self, keys: dict[int, list[str]], refusals: list[SluiceError] | None = None) -> None:
        config = SimpleNamespace(buckets=len(keys), gateway_senders=["to-b"])
        engine = SimpleNamespace(owns=lambda _r, _b: True, bucket_of=lambda _r, key: int(key.split("-")[0]))
        service = SimpleNamespace(url="http://me", engine=engine, directory=SimpleNamespace(),
                                  region_config=lambda _r: config,
                                  cfg=SimpleNamespace(sender=lambda _s: SimpleNamespace(remote_dsid=2)))
        super().__init__(service)  # type: ignore[arg-type]
        self.keys = {b: sorted(ks) for b, ks in keys.items()}
        self.batches: list[tuple[int, list[str], float]] = []
        self.refusals = refusals or []

    async def copy_owned(self, copy_id: str, region: str, sender_id: str, bucket: int, after: str | None,
                         count: int, keys: list[str] | None) -> BatchAnswer:
        await asyncio.sleep(0)
        if self.refusals:
            raise self.refusals.pop(0)
        every = self.keys[bucket]
        if count == 0:
            return BatchAnswer(len(every), 0, {}, None, False)
        if keys is None:
            start = 0 if after is None else every.index(after) + 1
            keys = every[start:start + count]
            done = start + count >= len(every)
        else:
            done = True
        self.batches.append((bucket, keys, time.monotonic()))
        return BatchAnswer(len(every), len(keys), {}, None if done else keys[-1], done)


def run_copy(owners: SimulatedOwners, *, max_rate: int = 0, batch_size: int = 10, keys: list[str] | None = None,
             cancel_after: int | None = None) -> Any:
    async def go() -> Any:
        copy = owners.start("orders", "to-b", max_rate=max_rate, batch_size=batch_size, keys=keys)
        if cancel_after is not None:
            while len(owners.batches) < cancel_after:
                await asyncio.sleep(0.001)
            stopped = await owners.cancel("orders", "to-b", wait_s=10)
            assert stopped is copy
            batches = len(owners.batches)
            await asyncio.sleep(0.05)
            assert len(owners.batches) == batches, "a batch started after the cancel answered"
        await copy.stopped.wait()
        return copy
    return asyncio.run(go())


def bucket_keys(buckets: int, per_bucket: int) -> dict[int, list[str]]:
    return {b: [f"{b}-{n:03d}" for n in range(per_bucket)] for b in range(buckets)}


def test_every_bucket_is_copied_once_in_key_order() -> None:
    owners = SimulatedOwners(bucket_keys(6, 35))
    copy = run_copy(owners)
    assert copy.state is CopyState.DONE and (copy.copied, copy.total) == (210, 210)
    for bucket, keys in owners.keys.items():
        sent = [k for b, ks, _ in owners.batches if b == bucket for k in ks]
        assert sent == keys
        assert copy.buckets[bucket].done and copy.buckets[bucket].copied == 35


def test_a_copy_of_given_keys_sends_those_only() -> None:
    owners = SimulatedOwners(bucket_keys(4, 20))
    copy = run_copy(owners, keys=["2-005", "0-001", "2-003", "0-001"], batch_size=1)
    assert copy.state is CopyState.DONE and copy.restricted
    assert sorted(k for _, ks, _ in owners.batches for k in ks) == ["0-001", "2-003", "2-005"]
    assert set(copy.buckets) == {0, 2}


def test_the_rate_is_never_exceeded_over_the_copy() -> None:
    """200 entries at 2,000/s in batches of 10: the copy lasts at least 0.1 s, and no batch starts before
    the entries before it are due."""
    owners = SimulatedOwners(bucket_keys(4, 50))
    copy = run_copy(owners, max_rate=2000, batch_size=10)
    assert copy.state is CopyState.DONE and copy.copied == 200
    assert copy.elapsed_s() >= 200 / 2000
    sent = 0
    for _, keys, at in sorted(owners.batches, key=lambda b: b[2]):
        assert at - copy.started >= sent / 2000 - 0.002
        sent += len(keys)
    assert copy.to_dict()["rate"] <= 2000


def test_a_cancel_stops_the_copy_between_batches() -> None:
    owners = SimulatedOwners(bucket_keys(4, 100))
    copy = run_copy(owners, max_rate=1000, batch_size=10, cancel_after=3)
    assert copy.state is CopyState.CANCELLED and 30 <= copy.copied < 400
    assert copy.copied == sum(len(ks) for _, ks, _ in owners.batches)
    assert copy.to_dict()["state"] == "cancelled"


def test_a_retriable_refusal_is_asked_again_and_another_fails_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    owners = SimulatedOwners(bucket_keys(1, 5), refusals=[NotOwner("orders", 0), BucketUnavailable("orders", 0, "x")])
    assert run_copy(owners).state is CopyState.DONE
    failing = SimulatedOwners(bucket_keys(1, 5), refusals=[InvalidRequest("sender_id", "x", "gone")])
    copy = run_copy(failing)
    assert copy.state is CopyState.FAILED and "gone" in (copy.error or "")
    monkeypatch.setattr(wancopy, "RETRY_FOR_S", 0.2)
    stuck = SimulatedOwners(bucket_keys(1, 5), refusals=[NotOwner("orders", 0)] * 100)
    assert run_copy(stuck).state is CopyState.FAILED


def test_one_copy_per_region_and_sender_and_bad_numbers_refused() -> None:
    owners = SimulatedOwners(bucket_keys(2, 1000))

    async def go() -> None:
        owners.start("orders", "to-b", max_rate=10, batch_size=10)
        with pytest.raises(wancopy.WanCopyRunning):
            owners.start("orders", "to-b", max_rate=0, batch_size=10)
        for kwargs in ({"max_rate": -1, "batch_size": 10}, {"max_rate": 0, "batch_size": 0},
                       {"max_rate": 0, "batch_size": wancopy.BATCH_SIZE_MAX + 1}):
            with pytest.raises(InvalidRequest):
                owners.start("orders", "to-b", **kwargs)
        with pytest.raises(InvalidRequest, match="its senders: to-b"):
            owners.start("orders", "to-z", max_rate=0, batch_size=10)
        stopped = await owners.cancel("orders", "to-b", wait_s=10)
        assert stopped is not None and stopped.state is CopyState.CANCELLED
        assert await owners.cancel("orders", "to-b", wait_s=10) is None
    asyncio.run(go())


# --- 3. Snapshots -----------------------------------------------------------------------------------------


def test_snapshots_keep_the_recent_and_drop_the_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wancopy, "SNAPSHOTS_MAX", 2)
    snapshots = Snapshots()
    for bucket in range(3):
        snapshots.put("c1", "orders", bucket, [str(bucket)])
    assert snapshots.get("c1", "orders", 0) is None
    assert snapshots.get("c1", "orders", 2) == ["2"]
    snapshots.drop("c1", "orders", 2)
    assert snapshots.get("c1", "orders", 2) is None
    now = time.monotonic()
    monkeypatch.setattr(wancopy.time, "monotonic", lambda: now + wancopy.SNAPSHOT_IDLE_S + 1)
    assert snapshots.get("c1", "orders", 1) is None


# --- 4. the command's input -------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--sender-id", "to-b"], "--region: wan-copy needs --region"),
    (["--region", "orders"], "--sender-id: wan-copy needs --sender-id"),
    (["--region", "nope", "--sender-id", "to-b"], "--region: no such region in site a's file (it has orders)"),
    (["--region", "orders", "--sender-id", "to-c"], "--sender-id: region orders does not feed that gateway sender "
                                                    "(its senders: to-b)"),
    (["--region", "orders", "--sender-id", "to-b", "--batch-size", "0"], "--batch-size: from 1 to 10000"),
    (["--region", "orders", "--sender-id", "to-b", "--max-rate", "-5"], "--max-rate: entries per second"),
    (["to-b", "--region", "orders", "--sender-id", "to-b"], "queue: wan-copy names its sender with --sender-id"),
])
def test_the_command_refuses_bad_options_before_any_request(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                            args: list[str], message: str) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump({
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a."},
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True},
                            {"id": "to-c", "remote_dsid": 3, "parallel": True}],
    }))
    assert sluice_main(["admin", "-c", str(path), "wan-copy", *args]) == 2
    assert message in capsys.readouterr().err
