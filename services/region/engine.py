"""Bucket ownership and the ordered application of operations.

Ownership is Kafka's: every region instance is a member of one consumer group
subscribed to every region changelog, and the member assigned partition *b*
of a changelog owns bucket *b* of that region (consumer-group leadership is
the primary lock, DESIGN §1).  The engine does not read its assigned
partitions through the group; it pauses them and keeps polling only to stay
in the group and to hear about rebalances.

Gaining a bucket (``on_assign``)::

    LOADING ── load: read the changelog partition from its start, replay every
       │       record into a fresh BucketState, re-enqueue every record at or
       │       after the committed fan-out checkpoint (possibleDuplicate), wait
       │       until those queue records are durable, commit the checkpoint
       ▼
    READY ──── requests are applied in arrival order (one lock, so bucket order
       │       is the order of the changelog) and fanned out (fanout.py);
       │       the checkpoint is committed every ``commit_interval_s``
       ▼
    gone ───── on_revoke: stop accepting, wait for in-flight records, commit
               the checkpoint synchronously, drop the state.  on_lost: drop.

A delivery failure in a READY bucket sends it back to LOADING: its in-memory
state may be ahead of the changelog, so it is rebuilt from the changelog.

A changelog record the load cannot read (not an EntryEvent: a stray writer,
a damaged record) is skipped and goes to the site's region dead-letter topic
with the reason, keyed by its place (``topic/partition/offset``).  Before
writing one, the loader reads that topic for the key, so a bucket loaded
again (a failover, a rebalance) does not dead-letter the same record twice;
only a loader that loses the bucket between writing a dead letter and the
broker acknowledging it can leave a second one behind.

Threads: the caller's (``submit``), the producer poll thread (delivery
reports, fan-out), the group thread (membership, commits) and the loader.
They share ``self._lock``-guarded bucket tables; everything else is owned by
one thread.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..core.codec import Codec
from ..core.errors import (
    BrokerUnavailable,
    BucketUnavailable,
    CodecError,
    InvalidRequest,
    NotOwner,
    OwnershipUnconfirmed,
    SluiceError,
)
from ..core.events import EntryEvent, EventID
from ..core.events import Operation as EventOperation
from ..core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaException,
    Producer,
    TopicPartition,
    make_consumer,
    make_producer,
    partition_for_key,
    read_to_end,
    translate,
)
from .fanout import BucketProgress, FanoutWriter, Pending, QueueTarget
from .conflicts import ConflictResolver
from .state import BucketState, ConflictLost, Duplicate, Op, Skipped

log = logging.getLogger("sluice.region.engine")


class BucketStatus(enum.Enum):
    LOADING = "loading"
    READY = "ready"


@dataclass(slots=True)
class OwnedBucket:
    region: str
    bucket: int
    epoch: int
    status: BucketStatus = BucketStatus.LOADING
    state: BucketState | None = None
    progress: BucketProgress | None = None
    committed: int = -1
    inflight: dict[EventID, Pending] = field(default_factory=dict)
    # A server-assigned EventID stream (member = this instance, thread = bucket).
    next_sequence: int = 0
    since_ms: int = 0  # when this instance was assigned the bucket (its claim in the directory)


@dataclass(slots=True)
class Operation:
    """One requested operation on one key (value already serialized).

    ``bucket`` is computed once, by whoever routes the operation first.
    """

    op: Op
    region: str
    key: str
    value: bytes | None = None
    event_id: EventID | None = None
    callback_argument: str | None = None
    bucket: int = -1
    #: For ``Op.REMOTE``: the event another site applied (its own EventID and version).
    remote: EntryEvent | None = None
    #: put_all / remove_all for a region whose gateway senders group
    #: transaction events: the id its events carry (see ``submit``).
    transaction: str | None = None
    #: Kafka headers for the event's changelog and queue records (its W3C
    #: ``traceparent``); None when tracing is off.
    trace: list[tuple[str, bytes]] | None = None


@dataclass(slots=True)
class OpResult:
    """What happened to one operation: an event, a duplicate, a skip or an error."""

    event: EntryEvent | None = None
    duplicate: bool = False
    skipped: bool = False
    error: SluiceError | None = None
    #: A remote event that lost the WAN conflict: not applied, not an error.
    conflict_lost: bool = False
    #: Entries a region clear removed from the bucket.
    cleared: int = 0


class RegionEngine:
    """The bucket owner of one region-service instance."""

    def __init__(
        self,
        *,
        site: str,
        dsid: int,
        member_id: str,
        client_id: str,
        kafka_settings: dict[str, Any],
        group_settings: dict[str, Any],
        producer_settings: dict[str, Any],
        group_id: str,
        regions: dict[str, int],
        changelog_topics: dict[str, str],
        targets: dict[str, list[QueueTarget]],
        codec: Codec,
        commit_interval_s: float = 0.2,
        load_timeout_s: float = 60.0,
        event_tracking_timeout_s: float = 900.0,
        conflict_resolver: ConflictResolver | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        on_ownership: Callable[[list[tuple[str, int, int]]], None] | None = None,
        dead_letter_topic: str | None = None,
    ) -> None:
        self.site = site
        self.dsid = dsid
        self.member_id = member_id
        self.client_id = client_id
        self.group_id = group_id
        self.regions = regions
        self.conflict_resolver = conflict_resolver
        self.changelog_topics = changelog_topics
        self._topic_region = {t: r for r, t in changelog_topics.items()}
        self._kafka_settings = kafka_settings
        self._group_settings = group_settings
        self._producer_settings = producer_settings
        self._codec = codec
        self._targets = targets
        self._commit_interval_s = commit_interval_s
        self._load_timeout_s = load_timeout_s
        self._tracking_timeout_ms = int(event_tracking_timeout_s * 1000)
        self._on_crash = on_crash
        #: Called (in the group thread) with [(region, bucket, since_ms)] whenever the owned buckets change.
        self._on_ownership = on_ownership
        #: Where unreadable changelog records go (None: they are only logged).
        self._dead_letter_topic = dead_letter_topic
        #: Keys of the dead letters this instance knows are written (loader thread only).
        self._dead_lettered: set[bytes] = set()

        self._lock = threading.Lock()
        self._owned: dict[tuple[str, int], OwnedBucket] = {}
        self._epoch = 0
        self._loads: queue.Queue[tuple[str, int, int] | None] = queue.Queue(maxsize=100_000)
        self._stopping = threading.Event()
        self._poll_stopping = threading.Event()
        self._fence_lock = threading.Lock()
        self._fence_wanted = threading.Event()
        self._awaiting_fence: list[tuple[list[OpResult], Callable[[list[OpResult]], None]]] = []
        self._threads: list[threading.Thread] = []
        self._producer: Producer | None = None
        self._group: Consumer | None = None
        self._offsets: Consumer | None = None
        self._writer: FanoutWriter | None = None
        self.assigned_once = threading.Event()
        self.stats = {"applied": 0, "duplicates": 0, "conflicts_lost": 0, "loads": 0, "refanned_out": 0,
                      "bucket_failures": 0, "dead_lettered": 0}

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self._producer = make_producer(self._kafka_settings, **{"client.id": self.client_id}, **self._producer_settings)
        # Committed checkpoints are read through a consumer of the group that never subscribes (the group
        # member belongs to the group thread): not through the admin API, whose coordinator requests can
        # abort the process when the broker connection drops (confluentinc/librdkafka#4605).
        self._offsets = make_consumer(self._kafka_settings, self.group_id,
                                      **{"client.id": f"{self.client_id}-offsets", "enable.auto.commit": False})
        self._writer = FanoutWriter(self._producer, self._codec, self.changelog_topics, self._targets, self._bucket_failed)
        self._group = make_consumer(
            self._kafka_settings,
            self.group_id,
            **{"client.id": self.client_id},
            **self._group_settings,
        )
        for name, target in (("poll", self._poll_loop), ("group", self._group_loop), ("loader", self._load_loop)):
            t = threading.Thread(target=self._guard(target), name=f"region-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, deadline_s: float = 10.0) -> None:
        """Stop loading, leave the group (revoking cleanly), then flush and stop polling.

        The poll thread keeps serving delivery reports while the group
        thread's revoke waits for in-flight records, so it stops last.
        """
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._loads.put_nowait(None)
        end = time.monotonic() + deadline_s
        for t in self._threads:
            if t.name != "region-poll":
                t.join(max(0.1, end - time.monotonic()))
        if self._producer is not None:
            self._producer.flush(max(0.1, end - time.monotonic()))
        self._poll_stopping.set()
        for t in self._threads:
            if t.name == "region-poll":
                t.join(max(0.1, end - time.monotonic()))
        if self._offsets is not None:
            self._offsets.close()

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # top of a thread: record the crash, hand it to the owner
                log.exception("region engine thread %s crashed", threading.current_thread().name)
                self._stopping.set()
                self._poll_stopping.set()
                if self._on_crash is not None:
                    self._on_crash(exc)

        return run

    # --- reads of ownership --------------------------------------------------

    def bucket_of(self, region: str, key: str) -> int:
        return partition_for_key(key.encode("utf-8"), self.regions[region])

    def owned_buckets(self) -> dict[str, list[tuple[int, str]]]:
        with self._lock:
            out: dict[str, list[tuple[int, str]]] = {}
            for (region, bucket), ob in sorted(self._owned.items()):
                out.setdefault(region, []).append((bucket, ob.status.value))
            return out

    def claims(self) -> list[tuple[str, int, int]]:
        """(region, bucket, since_ms) of every bucket this instance owns, loaded or loading."""
        with self._lock:
            return [(ob.region, ob.bucket, ob.since_ms) for ob in self._owned.values()]

    def _ownership_changed(self) -> None:
        if self._on_ownership is not None:
            try:
                self._on_ownership(self.claims())
            except Exception:  # noqa: BLE001 - the directory is advisory: never fail a rebalance over it
                log.exception("publishing the owned buckets failed")

    def owns(self, region: str, bucket: int) -> bool:
        with self._lock:
            return (region, bucket) in self._owned

    def is_ready(self, region: str, bucket: int) -> bool:
        with self._lock:
            ob = self._owned.get((region, bucket))
            return ob is not None and ob.status is BucketStatus.READY

    # --- writes --------------------------------------------------------------

    def submit(self, ops: list[Operation], on_done: Callable[[list[OpResult]], None]) -> None:
        """Apply ``ops`` in order; ``on_done(results)`` runs (in the poll thread,
        or here) once every applied event is durable in the changelog and in
        every queue it goes to.

        Every op must be for a bucket this instance owns; others get a
        ``NotOwner`` or ``BucketUnavailable`` result and are not applied.
        """
        assert self._writer is not None
        results = [OpResult() for _ in ops]

        def finished(error: SluiceError | None) -> None:
            with self._lock:
                for r in results:
                    if r.event is not None:
                        ob = self._owned.get((r.event.region, r.event.bucket))
                        if ob is not None:
                            ob.inflight.pop(r.event.event_id, None)
            if error is not None:
                _fail_results(results, error)
                on_done(results)
            elif any(r.event is not None for r in results):
                # New writes are answered only after a commit proves this
                # member still holds its generation (see _fence).
                self._await_fence(results, on_done)
            else:
                on_done(results)

        pending = Pending(finished)
        pending.add(1)  # held until every op is produced, so it cannot fire early
        now_ms = int(time.time() * 1000)
        grouped: list[tuple[OpResult, OwnedBucket, str]] = []
        group_trace: list[tuple[str, bytes]] | None = None
        with self._lock:
            for op, result in zip(ops, results):
                bucket = op.bucket if op.bucket >= 0 else self.bucket_of(op.region, op.key)
                ob = self._owned.get((op.region, bucket))
                if ob is None:
                    result.error = NotOwner(op.region, bucket)
                    continue
                if ob.status is not BucketStatus.READY or ob.state is None or ob.progress is None:
                    result.error = BucketUnavailable(op.region, bucket, "the owner is loading the bucket")
                    continue
                event_id = op.event_id
                if event_id is None:
                    # A caller may have written with this instance's member id (it is in every entry
                    # the instance stamped): continue past whatever the bucket has seen of the stream.
                    sequence = max(ob.next_sequence, ob.state.streams.get((self.member_id, bucket), -1) + 1)
                    event_id = EventID(self.member_id, bucket, sequence)
                    ob.next_sequence = sequence + 1
                try:
                    if op.op is Op.REMOTE:
                        assert op.remote is not None
                        event_id = op.remote.event_id
                        outcome = ob.state.prepare_remote(op.remote, self.conflict_resolver)
                    elif op.op is Op.CLEAR:
                        outcome = ob.state.prepare_clear(event_id, now_ms)
                    elif op.op is Op.DESTROY_REGION:
                        outcome = ob.state.prepare_clear(event_id, now_ms, EventOperation.REGION_DESTROY)
                    else:
                        outcome = ob.state.prepare(op.op, op.key, op.value, event_id, now_ms, op.callback_argument)
                except InvalidRequest as exc:
                    result.error = exc
                    continue
                if isinstance(outcome, ConflictLost):
                    result.conflict_lost = True
                    self.stats["conflicts_lost"] += 1
                    continue
                if isinstance(outcome, Duplicate):
                    result.duplicate = True
                    self.stats["duplicates"] += 1
                    original = ob.inflight.get(event_id)
                    if original is not None and original is not pending:
                        # The first attempt is still being written: answer
                        # this retry when that one is durable.  (The same
                        # event twice in one request, as a batch may hold it
                        # after a queue re-enqueued it, is already waited for:
                        # chaining the request to itself would never answer.)
                        original.then(pending)
                    continue
                if isinstance(outcome, Skipped):
                    result.skipped = True
                    continue
                if isinstance(outcome, list):  # a region clear: one event per entry of the bucket
                    result.cleared = len(outcome)
                    if not outcome:
                        result.skipped = True
                        continue
                    result.event = outcome[-1]
                    ob.inflight[event_id] = pending
                    self.stats["applied"] += len(outcome)
                    for event in outcome:
                        self._writer.write(event, pending, ob.progress)
                    continue
                result.event = outcome
                ob.inflight[event_id] = pending
                self.stats["applied"] += 1
                if op.transaction is None:
                    self._writer.write(outcome, pending, ob.progress, op.trace)
                else:
                    grouped.append((result, ob, op.transaction))
                    group_trace = op.trace  # one put_all / remove_all request: one trace
            if grouped:
                self._write_grouped(grouped, pending, group_trace)
        pending.arm()
        pending.done()

    def _write_grouped(self, grouped: list[tuple[OpResult, OwnedBucket, str]], pending: Pending,
                       trace: list[tuple[str, bytes]] | None = None) -> None:
        """The events of one put_all / remove_all, marked with its transaction
        id, the last of each bucket flagged: contiguous in each changelog and
        queue partition (written under the lock), so a sender can keep them in
        one batch.  Called with the lock held.  ``trace``: the request's trace headers."""
        last_of_bucket = {(r.event.region, r.event.bucket): i for i, (r, _, _) in enumerate(grouped)
                          if r.event is not None}
        for i, (result, ob, tx) in enumerate(grouped):
            event = result.event
            assert event is not None
            event = replace(event, transaction=(tx, last_of_bucket[(event.region, event.bucket)] == i))
            result.event = event
            self._writer.write(event, pending, ob.progress, trace)

    def read(self, region: str, bucket: int) -> BucketState:
        """The state of a READY bucket (callers read under ``read_lock``)."""
        with self._lock:
            ob = self._owned.get((region, bucket))
            if ob is None:
                raise NotOwner(region, bucket)
            if ob.status is not BucketStatus.READY or ob.state is None:
                raise BucketUnavailable(region, bucket, "the owner is loading the bucket")
            return ob.state

    @property
    def read_lock(self) -> threading.Lock:
        return self._lock

    def wait_ready(self, region: str, bucket: int, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                ob = self._owned.get((region, bucket))
                if ob is None:
                    return False
                if ob.status is BucketStatus.READY:
                    return True
            time.sleep(0.01)
        return False

    # --- producer poll thread -----------------------------------------------

    def _poll_loop(self) -> None:
        assert self._producer is not None
        while not self._poll_stopping.is_set():
            self._producer.poll(0.05)

    def _bucket_failed(self, region: str, bucket: int, error: SluiceError) -> None:
        """A write of the bucket failed: its memory may be ahead of the changelog."""
        log.warning("bucket %s[%d] failed (%s); reloading it from the changelog", region, bucket, error)
        self.stats["bucket_failures"] += 1
        with self._lock:
            ob = self._owned.get((region, bucket))
            if ob is None or ob.status is BucketStatus.LOADING:
                return
            self._epoch += 1
            ob.epoch = self._epoch
            ob.status = BucketStatus.LOADING
            ob.state = None
            epoch = ob.epoch
        self._loads.put((region, bucket, epoch))

    # --- group thread ---------------------------------------------------------

    def _group_loop(self) -> None:
        consumer = self._group
        assert consumer is not None
        consumer.subscribe(
            list(self.changelog_topics.values()),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        next_commit = time.monotonic() + self._commit_interval_s
        next_expiry = time.monotonic() + 30.0
        try:
            while not self._stopping.is_set():
                self._fence_wanted.wait(0.05)
                msg = consumer.poll(0)
                if msg is not None and msg.error() is not None:
                    log.debug("group consumer: %s", msg.error())
                if self._fence_wanted.is_set():
                    self._fence(consumer)
                    next_commit = time.monotonic() + self._commit_interval_s
                elif time.monotonic() >= next_commit:
                    self._commit_checkpoints(asynchronous=True)
                    next_commit = time.monotonic() + self._commit_interval_s
                if time.monotonic() >= next_expiry:
                    self._expire_streams()
                    next_expiry = time.monotonic() + 30.0
        finally:
            # Leaving the group revokes every bucket through _on_revoke,
            # which waits for in-flight records and commits synchronously.
            try:
                consumer.close()
            except (KafkaException, RuntimeError) as exc:
                log.warning("closing the group consumer: %s", exc)
            self._release_fenced(OwnershipUnconfirmed("the instance is stopping"))

    # --- fencing -----------------------------------------------------------------
    #
    # A member that was paused (SIGSTOP, a long GC, a frozen VM) past its
    # session timeout has lost its buckets without knowing it; a new owner may
    # already serve them.  It must not acknowledge what it writes then.  So a
    # write is answered only after a synchronous offset commit, issued after
    # the write was durable, succeeds: the group coordinator rejects commits of
    # a stale generation, so a success proves this member still held its
    # buckets after the write.  One commit answers every write waiting for it.

    def _await_fence(self, results: list[OpResult], on_done: Callable[[list[OpResult]], None]) -> None:
        with self._fence_lock:
            self._awaiting_fence.append((results, on_done))
        self._fence_wanted.set()

    def _release_fenced(self, error: SluiceError | None) -> None:
        with self._fence_lock:
            batch, self._awaiting_fence = self._awaiting_fence, []
            self._fence_wanted.clear()
        for results, on_done in batch:
            if error is not None:
                _fail_results(results, error)
            on_done(results)

    def _fence(self, consumer: Consumer) -> None:
        with self._fence_lock:
            batch, self._awaiting_fence = self._awaiting_fence, []
            self._fence_wanted.clear()
        if not batch:
            return
        offsets = self._checkpoint_offsets(force=True)
        error: SluiceError | None = None
        if not offsets:
            error = OwnershipUnconfirmed("this instance no longer owns the bucket")
        else:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                log.warning("fencing commit failed (%s); answering %d requests with a retriable error",
                            exc, len(batch))
                error = OwnershipUnconfirmed(f"the group refused the fencing commit ({exc.args[0]})")
        for results, on_done in batch:
            if error is not None:
                _fail_results(results, error)
            on_done(results)

    def _expire_streams(self) -> None:
        now_ms = int(time.time() * 1000)
        with self._lock:
            expired = sum(
                ob.state.expire_streams(now_ms, self._tracking_timeout_ms)
                for ob in self._owned.values()
                if ob.state is not None
            )
        if expired:
            log.info("forgot %d idle EventID streams", expired)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.assign(partitions)
        if partitions:
            consumer.pause(partitions)
        loads = []
        now_ms = int(time.time() * 1000)
        with self._lock:
            for tp in partitions:
                region = self._topic_region[tp.topic]
                self._epoch += 1
                self._owned[(region, tp.partition)] = OwnedBucket(region, tp.partition, self._epoch, since_ms=now_ms)
                loads.append((region, tp.partition, self._epoch))
        log.info("assigned %s", ", ".join(f"{r}[{b}]" for r, b, _ in loads) or "nothing")
        self._ownership_changed()
        for item in loads:
            self._loads.put(item)
        self.assigned_once.set()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            revoked = [self._owned.pop((self._topic_region[tp.topic], tp.partition), None) for tp in partitions]
        # Wait for the records already produced (of any bucket) to be acknowledged,
        # so the checkpoint committed below covers every write we answered.
        end = time.monotonic() + 10.0
        while self._producer is not None and len(self._producer) > 0 and time.monotonic() < end:
            time.sleep(0.01)
        offsets = [
            TopicPartition(self.changelog_topics[ob.region], ob.bucket, ob.progress.checkpoint)
            for ob in revoked
            if ob is not None and ob.progress is not None and ob.status is BucketStatus.READY
        ]
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
                # Every write answered below was durable before this commit.
                self._release_fenced(None)
            except KafkaException as exc:
                log.warning("committing checkpoints on revoke: %s", exc)
                self._release_fenced(OwnershipUnconfirmed("ownership moved"))
        log.info("revoked %s", ", ".join(f"{ob.region}[{ob.bucket}]" for ob in revoked if ob) or "nothing")
        self._ownership_changed()

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            for tp in partitions:
                self._owned.pop((self._topic_region[tp.topic], tp.partition), None)
        # A lost member may be a zombie: nothing it wrote since is acknowledged.
        self._release_fenced(OwnershipUnconfirmed("this instance lost its buckets (session expired)"))
        log.warning("lost %d buckets (session expired)", len(partitions))
        self._ownership_changed()

    def _checkpoint_offsets(self, force: bool) -> list[TopicPartition]:
        """Fan-out checkpoints of READY buckets: those that advanced, or all (``force``).

        ``force`` (a fencing commit) also takes the buckets being reloaded, at
        the checkpoint last committed: any commit of this member's generation
        proves it still holds its buckets, and a write that became durable
        while its bucket reloads is then answered, not refused.
        """
        offsets = []
        with self._lock:
            for ob in self._owned.values():
                topic = self.changelog_topics[ob.region]
                if ob.status is not BucketStatus.READY or ob.progress is None:
                    if force and ob.committed >= 0:
                        offsets.append(TopicPartition(topic, ob.bucket, ob.committed))
                    continue
                if force or ob.progress.checkpoint > ob.committed:
                    offsets.append(TopicPartition(topic, ob.bucket, ob.progress.checkpoint))
                    ob.committed = max(ob.committed, ob.progress.checkpoint)
        return offsets

    def _commit_checkpoints(self, asynchronous: bool) -> None:
        consumer = self._group
        assert consumer is not None
        offsets = self._checkpoint_offsets(force=False)
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=asynchronous)
            except KafkaException as exc:
                # A failed commit only widens what a next owner re-enqueues.
                log.warning("committing fan-out checkpoints: %s", exc)

    # --- loader thread -----------------------------------------------------------

    def _load_loop(self) -> None:
        # A short fetch wait: the reader moves from partition to partition, and
        # each new assignment otherwise waits out a fetch held at the broker.
        reader = make_consumer(self._kafka_settings, None,
                               **{"client.id": f"{self.client_id}-loader", "fetch.wait.max.ms": 10})
        try:
            while not self._stopping.is_set():
                item = self._loads.get()
                if item is None:
                    return
                region, bucket, epoch = item
                try:
                    self._load(reader, region, bucket, epoch)
                except SluiceError as exc:
                    log.warning("loading %s[%d] failed (%s); retrying", region, bucket, exc)
                    # A fresh reader: the old one's metadata may be stuck on what the broker said as it
                    # came back (partitions unknown until the next metadata refresh).
                    reader.close()
                    reader = make_consumer(self._kafka_settings, None,
                                           **{"client.id": f"{self.client_id}-loader", "fetch.wait.max.ms": 10})
                    time.sleep(0.5)
                    self._loads.put(item)
        finally:
            reader.close()

    def _committed(self, topic: str, bucket: int) -> int:
        """The fan-out checkpoint committed for a changelog partition (-1: none)."""
        assert self._offsets is not None
        try:
            found = self._offsets.committed([TopicPartition(topic, bucket)], timeout=15)
        except KafkaException as exc:
            raise translate(exc, f"committed offset of {topic}[{bucket}]") from exc
        for tp in found:
            if tp.topic == topic and tp.partition == bucket:
                if tp.error is not None:
                    raise BrokerUnavailable(f"committed offset of {topic}[{bucket}]: {tp.error}")
                return tp.offset if tp.offset >= 0 else -1
        return -1

    def _current(self, region: str, bucket: int, epoch: int) -> OwnedBucket | None:
        ob = self._owned.get((region, bucket))
        return ob if ob is not None and ob.epoch == epoch else None

    def _load(self, reader: Consumer, region: str, bucket: int, epoch: int) -> None:
        with self._lock:
            if self._current(region, bucket, epoch) is None:
                return
        started = time.monotonic()
        topic = self.changelog_topics[region]
        tp = TopicPartition(topic, bucket)
        group = self._group
        assert group is not None and self._writer is not None
        # Records this instance wrote to the bucket before (a reload after a
        # failed write, or the bucket back after a lost session) may still be
        # on their way: the producer retries them until delivery.timeout.ms.
        # Read the changelog before they land, and the state would not know
        # their EventIDs, so a client's retry of one would be applied again.
        unreported = self._writer.unreported(region, bucket)
        if unreported:
            log.info("%s[%d]: waiting for %d changelog records of ours still in flight before loading",
                     region, bucket, unreported)
            if not self._writer.wait_reported(region, bucket, self._load_timeout_s):
                raise BrokerUnavailable(f"{self._writer.unreported(region, bucket)} changelog records of "
                                        f"{region}[{bucket}] still unacknowledged")
        try:
            low, high = reader.get_watermark_offsets(tp, timeout=10.0)
            # The group consumer belongs to the group thread; ask the
            # coordinator through the admin client instead.
            committed = self._committed(topic, bucket)
        except KafkaException as exc:
            raise translate(exc, f"reading the changelog bounds of {region}[{bucket}]") from exc
        replay_from = committed if committed >= 0 else low
        state = BucketState(region, bucket, self.dsid, self.member_id)
        refanout: list[tuple[EntryEvent, int]] = []
        unreadable: list[tuple[int, bytes | None, bytes | None, CodecError]] = []
        read_s = 0.0
        if high > low:
            reader.assign([TopicPartition(topic, bucket, OFFSET_BEGINNING if low == 0 else low)])
            last = low - 1
            idle_since = time.monotonic()
            while last < high - 1:
                # consume() waits its whole timeout for a partial batch, so keep
                # the timeout short: the records are usually prefetched already.
                msgs = reader.consume(1000, 0.02)
                if not msgs:
                    if time.monotonic() - idle_since > self._load_timeout_s / 3:
                        raise BrokerUnavailable(f"changelog {topic}[{bucket}] stopped at {last} before {high - 1}")
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    if msg.error() is not None:
                        continue
                    last = msg.offset()
                    try:
                        event = EntryEvent.from_record(self._codec.decode_as("EntryEvent", msg.value()))
                    except CodecError as exc:
                        log.error("changelog %s[%d]@%d unreadable, skipped: %s", topic, bucket, last, exc)
                        unreadable.append((last, msg.key(), msg.value(), exc))
                        continue
                    state.replay(event)
                    if last >= replay_from:
                        refanout.append((event, last))
                if last >= high - 1:
                    # Some brokers report a high watermark below the last
                    # record under load: ask again before calling it the end.
                    try:
                        high = max(high, reader.get_watermark_offsets(tp, timeout=10.0)[1])
                    except KafkaException as exc:
                        raise translate(exc, f"reading the changelog bounds of {region}[{bucket}]") from exc
            reader.unassign()
            high = max(high, last + 1)
        if unreadable:
            self._dead_letter(reader, topic, bucket, unreadable)
        read_s = time.monotonic() - started

        done = threading.Event()
        failure: list[SluiceError | None] = [None]

        def refanned(error: SluiceError | None) -> None:
            failure[0] = error
            done.set()

        with self._lock:
            ob = self._current(region, bucket, epoch)
            if ob is None:
                return
            ob.state = state
            ob.progress = BucketProgress(replay_from)
            ob.committed = committed
            # Continue this instance's own EventID stream for the bucket, or a
            # reload would reuse sequences the changelog already holds.
            ob.next_sequence = state.streams.get((self.member_id, bucket), -1) + 1
            pending = Pending(refanned)
            for event, offset in refanout:
                self._writer.refanout(event, offset, pending, ob.progress)
            pending.arm()
        if not done.wait(self._load_timeout_s):
            raise BrokerUnavailable(f"re-enqueueing {len(refanout)} events of {region}[{bucket}] timed out")
        if failure[0] is not None:
            raise failure[0]
        with self._lock:
            ob = self._current(region, bucket, epoch)
            if ob is None:
                return
            ob.status = BucketStatus.READY
        self.stats["loads"] += 1
        self.stats["refanned_out"] += len(refanout)
        log.info(
            "loaded %s[%d]: %d keys from offsets %d..%d (read in %.2fs), %d re-enqueued, %.2fs in all",
            region, bucket, state.size(), low, high, read_s, len(refanout), time.monotonic() - started,
        )


    def _dead_letter(self, reader: Consumer, topic: str, bucket: int,
                     unreadable: list[tuple[int, bytes | None, bytes | None, CodecError]]) -> None:
        """Each unreadable record of a changelog partition to the dead-letter topic, once (see the
        module docstring); returns when the new dead letters are durable.  Loader thread."""
        dead_letters = self._dead_letter_topic
        if dead_letters is None:
            return
        todo = {f"{topic}/{bucket}/{offset}".encode(): (offset, key, value, exc)
                for offset, key, value, exc in unreadable}
        if all(k in self._dead_lettered for k in todo):
            return
        # Another instance may have dead-lettered them when it loaded the bucket before.
        try:
            for msg in read_to_end(reader, dead_letters, 0, deadline_s=self._load_timeout_s / 3):
                if msg.key() in todo:
                    self._dead_lettered.add(msg.key())
        except KafkaException as exc:
            raise translate(exc, f"reading the dead letters in {dead_letters}") from exc
        fresh = [k for k in todo if k not in self._dead_lettered]
        if not fresh:
            return
        assert self._producer is not None
        delivered = threading.Event()
        errors: list[str] = []
        waiting = [len(fresh)]
        lock = threading.Lock()

        def on_delivery(err: Any, _msg: Any) -> None:
            with lock:
                if err is not None:
                    errors.append(str(err))
                waiting[0] -= 1
                if waiting[0] == 0:
                    delivered.set()

        now_ms = int(time.time() * 1000)
        for k in fresh:
            offset, key, value, exc = todo[k]
            record = {"source_topic": topic, "source_partition": bucket, "source_offset": offset, "key": key,
                      "value": value, "reason": f"changelog record unreadable, skipped by the load: {exc}",
                      "error_class": type(exc).__name__, "event": None, "service": f"region {self.member_id}",
                      "failed_at": now_ms}
            try:
                self._producer.produce(dead_letters, self._codec.encode("DeadLetter", record), k,
                                       on_delivery=on_delivery)
            except (BufferError, KafkaException) as exc2:
                raise BrokerUnavailable(f"dead-lettering {k.decode()}: {exc2}") from exc2
        if not delivered.wait(self._load_timeout_s):
            raise BrokerUnavailable(f"dead letters of {topic}[{bucket}] not acknowledged in {self._load_timeout_s} s")
        if errors:
            raise BrokerUnavailable(f"dead letters of {topic}[{bucket}] not written: {errors[0]}")
        self._dead_lettered.update(fresh)
        self.stats["dead_lettered"] += len(fresh)
        log.warning("%s[%d]: %d unreadable changelog records dead-lettered to %s", topic, bucket, len(fresh),
                    dead_letters)


def _fail_results(results: list[OpResult], error: SluiceError) -> None:
    """Nothing a failed request did is reported as done; the caller retries
    with the same EventIDs and the owner's duplicate tracking keeps that safe."""
    for r in results:
        if r.error is None and not r.skipped:
            r.error = error
            r.event = None
            r.duplicate = False
