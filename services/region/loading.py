"""How a region instance loads a bucket it gained: the loader threads of ``RegionEngine`` (engine.py).

A load (``BucketStatus.LOADING``, engine.py) reads the committed offset of the
bucket's changelog partition, waits until no transaction is open on it, reads
it at read_committed from its start (or from a standby copy's or the local
store's position) to that end, replays every record into the bucket's state,
and hands the bucket to the engine's ownership as loaded.

Why the load waits for every transaction to be decided: a read_committed
reader stops at the first open transaction.  Reading only to there and then
serving the bucket would miss that transaction's records if it commits later
(a previous owner whose offsets the group accepted just before its session
expired).  So the load first reads the committed offset, which librdkafka
holds back while such a transaction is undecided, and then waits until the
partition's last stable offset equals its high watermark.  A transaction of
ours still open (a window written before the bucket was reloaded) is waited
for the same way.

Fencing, and what a dead owner costs.  An owner killed (kill -9) or frozen
(SIGSTOP, a long GC pause) in the middle of a window leaves its transaction
open, and the new owner's load waits for it.  It ends when the transaction
coordinator aborts it after ``transaction.timeout.ms`` (checked every
``transaction.abort.timed.out.transaction.cleanup.interval.ms`` at the broker,
10 s by default), or as soon as another producer initializes the same
``transactional.id``.  Each instance writes under one transactional.id,
``<group>.<instance id>``, for its whole life.  The choice, measured on Apache
Kafka 4.4.0 (2 cores shared with a broker and other work; figures in the
region tests and the report of issue 18):

* one transactional.id per bucket (a producer per owned bucket) would fence a
  dead owner at once (the new owner initializes the bucket's id), but costs
  4 threads and ~0.45 MB per producer (57 producers: +228 threads, +27 MB),
  a connection per producer and broker, and a transaction per bucket per
  window: a window touching 8 buckets took p50 10-18 ms as 8 concurrent
  transactions against 4.7 ms as one, and a put_all touches every bucket;
* one transactional.id per instance, one transaction per window, as here.
  The new owner of a bucket whose load stays blocked ``FENCE_AFTER_S`` fences
  the earlier owners that the owner directory shows gone (a claim on the
  bucket not renewed since before this instance was assigned it: a live
  member republishes its claims at every rebalance); a live owner that
  merely handed the bucket over has committed its windows in on_revoke and
  is never fenced.  ``transaction.timeout.ms`` is the backstop when the
  directory cannot tell (an instance killed before it ever published).

A changelog record the load cannot read (not an EntryEvent: a stray writer,
a damaged record) is skipped and goes to the site's region dead-letter topic
with the reason, keyed by its place (``topic/partition/offset``).  Before
writing one, the loader reads that topic for the key, so a bucket loaded
again (a failover, a rebalance) does not dead-letter the same record twice;
only a loader that loses the bucket between writing a dead letter and the
broker acknowledging it can leave a second one behind.

``BucketLoading`` is the part of ``RegionEngine`` that its loader threads
run: it is mixed into the engine and works on the engine's state (its lock,
ownership, readers' settings, store, stats), the attributes declared below.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from ..core.codec import Codec
from ..core.events import EntryEvent
from ..core.errors import BrokerUnavailable, CodecError, SluiceError
from ..core.framing import Frames
from ..core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    Producer,
    TopicPartition,
    consumed_position,
    fence_transactional_id,
    kafka_errors,
    make_consumer,
    make_producer,
    partition_end,
    read_to_end,
)
from .fanout import TRANSACTIONAL_CHECKPOINT, Pending
from .ownership import Fence, OwnedBucket, RegionOwnership
from .state import BucketState, changelog_event
from .store import LocalStore, StoredEntries

log = logging.getLogger("sluice.region")

#: How long fencing one earlier owner's transactional.id may take (``_fence_gone_owners``).
FENCE_TIMEOUT_S = 10.0
#: How long a load blocked by an open transaction waits before it looks again (``_wait_decided``).
DECIDED_POLL_S = 0.05
#: How long one read of a changelog partition's committed offset may wait for it to be stable.
COMMITTED_READ_S = 1.0


class HangingWatch:
    """Transactions that hold a changelog partition's loads past any producer's transaction timeout.

    A transaction is open on a partition from its first record until the
    transaction coordinator writes its marker there.  Any open transaction
    ends within the transaction timeout plus the broker's abort check, unless
    the coordinator dropped its marker: Apache Kafka 4.4.0 does, when it
    completes a transaction while the partition has no live leader (it takes
    the partition for deleted: docs/regions.md, "Hanging transactions").  Such a
    transaction stays open for ever, and only a marker written for it ends it.
    The loader reports each one (log, ``/readyz``, ``/stats``) rather than
    waiting in silence.  Thread-safe.
    """

    def __init__(self, hanging_after_s: float) -> None:
        self.hanging_after_s = hanging_after_s
        self._lock = threading.Lock()
        #: (region, bucket) → (the offset the open transaction starts at, when it was first seen open there)
        self._open: dict[tuple[str, int], tuple[int, float]] = {}
        self._reported: set[tuple[str, int, int]] = set()

    def seen_open(self, region: str, bucket: int, offset: int, now: float) -> float | None:
        """Note a transaction open from ``offset``; how long it has been open, the first time that
        passes ``hanging_after_s`` for this partition and offset (None otherwise)."""
        with self._lock:
            first = self._open.get((region, bucket))
            if first is None or first[0] != offset:
                self._open[(region, bucket)] = (offset, now)
                return None
            open_s = now - first[1]
            if open_s < self.hanging_after_s or (region, bucket, offset) in self._reported:
                return None
            self._reported.add((region, bucket, offset))
            return open_s

    def clear(self, region: str, bucket: int) -> None:
        """The partition's transactions are decided, or the bucket is no longer loaded here."""
        with self._lock:
            self._open.pop((region, bucket), None)

    def hanging(self, now: float) -> list[tuple[str, int, int, float]]:
        """(region, bucket, offset, seconds open) of each transaction open past ``hanging_after_s``."""
        with self._lock:
            return sorted((region, bucket, offset, now - since)
                          for (region, bucket), (offset, since) in self._open.items()
                          if now - since >= self.hanging_after_s)


class BucketLoading:
    """The loader threads' part of ``RegionEngine`` (module docstring)."""

    # The engine's state the loaders use (set by RegionEngine.__init__ and start()).
    member_id: str
    client_id: str
    group_id: str
    changelog_topics: dict[str, str]
    stats: dict[str, int]
    _lock: threading.Lock
    _stopping: threading.Event
    _ownership: RegionOwnership
    _loads: queue.Queue[tuple[str, int, int] | None]
    _load_timeout_s: float
    _kafka_settings: dict[str, Any]
    _offsets: Consumer | None
    _hanging: HangingWatch
    _gone_owners: Any
    _store: LocalStore | None
    _codec: Codec
    _frames: Frames
    _dead_letter_topic: str
    _dead_letter_lock: threading.Lock
    _dead_letter_producer: Producer | None
    _dead_lettered: set[bytes]
    _transaction_timeout_ms: int

    def _load_loop(self) -> None:
        # A short fetch wait: the reader moves from partition to partition, and
        # each new assignment otherwise waits out a fetch held at the broker.
        readers = self._new_readers()
        try:
            while not self._stopping.is_set():
                item = self._loads.get()
                if item is None:
                    return
                region, bucket, epoch = item
                try:
                    self._load(readers[0], readers[1], region, bucket, epoch)
                except SluiceError as exc:
                    if not exc.retriable:
                        raise  # the thread's crash: a retry cannot load the bucket
                    log.warning("loading %s[%d] failed (%s); retrying", region, bucket, exc)
                    # Fresh readers: the old ones' metadata may be stuck on what the broker said as it
                    # came back (partitions unknown until the next metadata refresh).
                    for reader in readers:
                        reader.close()
                    readers = self._new_readers()
                    self._stopping.wait(0.5)
                    self._loads.put(item)
        finally:
            for reader in readers:
                reader.close()

    def _new_readers(self) -> tuple[Consumer, Consumer]:
        """The loader's read_committed reader, and a read_uncommitted one asked only for high watermarks."""
        settings = {"client.id": f"{self.client_id}-loader", "fetch.wait.max.ms": 10}
        return (make_consumer(self._kafka_settings, None, **settings, **{"isolation.level": "read_committed"}),
                make_consumer(self._kafka_settings, None, **settings, **{"isolation.level": "read_uncommitted"}))

    def _committed(self, topic: str, bucket: int, timeout_s: float) -> tuple[int, bool]:
        """The offset committed for a changelog partition (-1: none), and whether it is marked
        transactional (fanout.py).  Read at read_committed, so librdkafka asks for stable offsets: a
        transaction whose offsets are pending holds the answer back (KIP-447), past ``timeout_s``
        as a retriable error."""
        assert self._offsets is not None
        with kafka_errors(f"committed offset of {topic}[{bucket}]"):
            found = self._offsets.committed([TopicPartition(topic, bucket)], timeout=timeout_s)
        for tp in found:
            if tp.topic == topic and tp.partition == bucket:
                if tp.error is not None:
                    raise BrokerUnavailable(f"committed offset of {topic}[{bucket}]: {tp.error}")
                if tp.offset < 0:
                    return -1, False
                return tp.offset, tp.metadata == TRANSACTIONAL_CHECKPOINT
        return -1, False

    def _current(self, region: str, bucket: int, epoch: int) -> OwnedBucket | None:
        """The bucket when still owned under ``epoch`` (under ``_lock``)."""
        return self._ownership.current(region, bucket, epoch)

    def _wait_decided(self, reader: Consumer, high_reader: Consumer, region: str, bucket: int,
                      epoch: int) -> tuple[int, int, int, bool] | None:
        """(low, end, committed offset, whether it is marked transactional) of the bucket's changelog
        partition once every transaction that wrote to it is decided; None when the bucket is no
        longer ours to load.

        First the committed offset, stable: a transaction whose offsets the
        group accepted (before this instance was assigned the bucket) holds it
        back until it is decided, and it wrote its records before it could
        commit.  Then the end: the last stable offset must equal the high
        watermark, so no transaction is open on the partition (one whose
        offsets come later is refused by the group, and aborted).  A
        transaction left open by an earlier owner that is gone is ended by
        fencing it (module docstring)."""
        topic = self.changelog_topics[region]
        tp = TopicPartition(topic, bucket)
        started = time.monotonic()
        fenced = False
        while True:
            try:
                committed, transactional = self._committed(topic, bucket, timeout_s=COMMITTED_READ_S)
            except SluiceError as exc:
                if not exc.retriable:
                    raise
                blocked = f"its committed offset is held back ({exc})"
            else:
                with kafka_errors(f"reading the changelog bounds of {region}[{bucket}]"):
                    low, stable, high = partition_end(reader, high_reader, tp)
                if stable >= high:
                    self._hanging.clear(region, bucket)
                    return low, high, committed, transactional
                blocked = f"a transaction is open from offset {stable} (end {high})"
                open_s = self._hanging.seen_open(region, bucket, stable, time.monotonic())
                if open_s is not None:
                    self._report_hanging(topic, bucket, stable, open_s)
            waited_s = time.monotonic() - started
            with self._lock:
                current = self._current(region, bucket, epoch) is not None
                fence = self._ownership.load_blocked(region, bucket, epoch, waited_s, fenced)
            if not current or self._stopping.is_set():
                self._hanging.clear(region, bucket)
                return None
            if fence is not None:
                fenced = True
                self._fence_gone_owners(fence)
            if waited_s > self._load_timeout_s:
                raise BrokerUnavailable(f"changelog {topic}[{bucket}]: {blocked} for {self._load_timeout_s:g} s")
            self._stopping.wait(DECIDED_POLL_S)

    def _report_hanging(self, topic: str, bucket: int, offset: int, open_s: float) -> None:
        self.stats["hanging_transactions"] += 1
        log.error("changelog %s[%d]: a transaction has been open from offset %d for %.0f s, longer than any "
                  "producer's transaction may last (%g s and the broker's abort check): the broker never wrote "
                  "its marker, a hanging transaction, and the bucket cannot load until one is.  "
                  "`kafka-transactions.sh --bootstrap-server <site> find-hanging --broker-id <leader>` lists it "
                  "(with any consumer-offsets partition it holds too); `kafka-transactions.sh abort --topic %s "
                  "--partition %d --start-offset %d` ends it, discarding its records (docs/regions.md, \"Hanging "
                  "transactions\")", topic, bucket, offset, open_s, self._transaction_timeout_ms / 1000,
                  topic, bucket, offset)

    def hanging_transactions(self) -> list[tuple[str, int, int, float]]:
        """(region, bucket, offset, seconds open) of each bucket whose load a hanging transaction holds."""
        return self._hanging.hanging(time.monotonic())

    def _fence_gone_owners(self, fence: Fence) -> None:
        if self._gone_owners is None:
            return
        region, bucket, since_ms = fence.region, fence.bucket, fence.since_ms
        try:
            gone = [i for i in self._gone_owners(region, bucket, since_ms) if i != self.member_id]
        except SluiceError as exc:
            log.warning("%s[%d]: asking the directory for earlier owners failed: %s", region, bucket, exc)
            return
        for instance in gone:
            transactional_id = transactional_id_of(self.group_id, instance)
            log.warning("%s[%d]: a transaction stays open; fencing %s, an earlier owner the directory shows "
                        "gone", region, bucket, transactional_id)
            try:
                fence_transactional_id(self._kafka_settings, transactional_id, timeout_s=FENCE_TIMEOUT_S)
                self.stats["owners_fenced"] += 1
            except SluiceError as exc:
                log.warning("fencing %s failed: %s", transactional_id, exc)

    def _load(self, reader: Consumer, high_reader: Consumer, region: str, bucket: int, epoch: int) -> None:
        with self._lock:
            if self._current(region, bucket, epoch) is None:
                return
        started = time.monotonic()
        topic = self.changelog_topics[region]
        tp = TopicPartition(topic, bucket)
        bounds = self._wait_decided(reader, high_reader, region, bucket, epoch)
        if bounds is None:
            return
        low, high, committed, transactional = bounds
        with self._lock:
            resumed = self._ownership.resume_parked(region, bucket, epoch, low, high, committed, transactional)
            if resumed is None:
                return
            kept, standby = resumed
            if kept:
                kept_state = self._owned[(region, bucket)].state
                assert kept_state is not None
                self.stats["loads_skipped"] += 1
                log.info("kept %s[%d]: its changelog did not move while it was revoked (offsets %d..%d), "
                         "%d entries, %.3fs", region, bucket, low, high, len(kept_state.entries),
                         time.monotonic() - started)
                return
        # Records past an unmarked checkpoint may lack their queue records (fanout.py): re-enqueued,
        # and the marked checkpoint (where this load ends) committed with them.
        replay_from = high if transactional else (committed if committed >= 0 else low)
        checkpoint = committed if transactional else high
        unreadable: list[tuple[int, bytes | None, bytes | None, CodecError]] = []
        start = low
        stored: tuple[BucketState, int] | None = None
        if standby is not None and transactional and low <= standby.position <= high:
            # Promoted: the standby copy holds every record below its position; read only the rest.
            state, start = standby.state, standby.position
            unreadable += standby.unreadable
        else:
            if standby is not None:
                log.info("%s[%d]: the standby copy (at %d) is not used: the changelog spans %d..%d%s", region,
                         bucket, standby.position, low, high, "" if transactional else " and its checkpoint is "
                         "not transactional")
            standby = None
            # The local store, when it is clean within the partition's bounds (store.py): read only the rest.
            stored = self._stored_state(region, bucket, low, high) if transactional and self._store else None
            if stored is not None:
                state, start = stored
            else:
                state = self._new_state(region, bucket)
        refanout: list[tuple[EntryEvent, int]] = []
        replayed = 0
        with self._lock:
            self._ownership.load_reading(region, bucket, epoch, start, high, time.monotonic())
        if high > start:
            reader.assign([TopicPartition(topic, bucket, OFFSET_BEGINNING if start == 0 else start)])
            position = start
            idle_since = time.monotonic()
            reading = kafka_errors(f"reading the changelog of {region}[{bucket}]")
            # Positions, not the last record's offset: markers and aborted
            # records occupy offsets up to the end (core/kafka.py).
            while position < high:
                # consume() waits its whole timeout for a partial batch, so keep
                # the timeout short: the records are usually prefetched already.
                with reading:
                    msgs = reader.consume(1000, 0.02)
                moved = consumed_position(reader, tp)
                if not msgs and moved <= position:
                    if time.monotonic() - idle_since > self._load_timeout_s / 3:
                        raise BrokerUnavailable(f"changelog {topic}[{bucket}] stopped at {position} before {high}")
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    if msg.error() is not None:
                        continue
                    offset = msg.offset()
                    position = max(position, offset + 1)
                    value = msg.value()
                    try:
                        event = changelog_event(value, self._frames)
                    except CodecError as exc:
                        log.error("changelog %s[%d]@%d unreadable, skipped: %s", topic, bucket, offset, exc)
                        unreadable.append((offset, msg.key(), msg.value(), exc))
                        continue
                    state.replay(event)
                    replayed += 1
                    if offset >= replay_from:
                        refanout.append((event, offset))
                position = max(position, moved)
                # Without the lock: the progress is only a hint, and only this loader moves it.
                self._ownership.load_progress(region, bucket, epoch, position)
            reader.unassign()
        if unreadable:
            self._dead_letter(reader, topic, bucket, unreadable)
        read_s = time.monotonic() - started

        done = threading.Event()
        failure: list[SluiceError | None] = [None]

        def refanned(error: SluiceError | None) -> None:
            failure[0] = error
            done.set()

        with self._lock:
            # Continue this instance's own EventID stream for the bucket, or a
            # reload would reuse sequences the changelog already holds.
            ob = self._ownership.loaded(region, bucket, epoch, state, checkpoint, high,
                                        state.streams.get((self.member_id, bucket), -1) + 1)
            if ob is None:
                return
            if refanout:
                # Records written before the checkpoint moved with them (by an owner
                # that did not write in transactions) may lack their queue records:
                # queue them again, and move the checkpoint past them, in one transaction.
                pending = Pending(refanned)
                pending.add(1)
                window = self._window
                was_empty = window.empty()
                slot = (region, bucket, epoch)
                for event, offset in refanout:
                    window.add(slot, checkpoint, None, self._builder.requeued(event, offset))
                window.waiting.append((pending, frozenset({slot})))
                if was_empty:
                    self._window_changed.notify_all()
                pending.arm()
            else:
                done.set()
        if not done.wait(self._load_timeout_s):
            raise BrokerUnavailable(f"re-enqueueing {len(refanout)} events of {region}[{bucket}] timed out")
        if failure[0] is not None:
            raise failure[0]
        # Not READY yet, so nothing else writes the state: it is the changelog below ``high``.
        _checkpoint(state, high)
        with self._lock:
            if not self._ownership.answering(region, bucket, epoch, high):
                return
            # Counted under the lock: several loader threads count at once.
            self.stats["loads"] += 1
            self.stats["refanned_out"] += len(refanout)
            self.stats["records_replayed"] += replayed
            if standby is not None:
                self.stats["loads_from_standby"] += 1
            if stored is not None:
                self.stats["loads_from_store"] += 1
        source = " from its standby copy" if standby is not None else " from the local store" if stored else ""
        log.info(
            "loaded %s[%d]%s: %d entries, %d records replayed from offsets %d..%d (read in %.2fs), %d re-enqueued, "
            "%.2fs in all", region, bucket, source, len(state.entries),
            replayed, start, high, read_s, len(refanout), time.monotonic() - started,
        )

    def _dead_letter(self, reader: Consumer, topic: str, bucket: int,
                     unreadable: list[tuple[int, bytes | None, bytes | None, CodecError]]) -> None:
        """Each unreadable record of a changelog partition to the dead-letter topic, once (see the
        module docstring); returns when the new dead letters are durable.  Loader threads, one at a
        time."""
        if self._dead_letter_topic is None:
            return
        with self._dead_letter_lock:
            self._dead_letter_once(reader, self._dead_letter_topic, topic, bucket, unreadable)

    def _dead_letter_once(self, reader: Consumer, dead_letters: str, topic: str, bucket: int,
                          unreadable: list[tuple[int, bytes | None, bytes | None, CodecError]]) -> None:
        todo = {f"{topic}/{bucket}/{offset}".encode(): (offset, key, value, exc)
                for offset, key, value, exc in unreadable}
        if all(k in self._dead_lettered for k in todo):
            return
        # Another instance may have dead-lettered them when it loaded the bucket before.
        with kafka_errors(f"reading the dead letters in {dead_letters}"):
            for msg in read_to_end(reader, dead_letters, 0, deadline_s=self._load_timeout_s / 3):
                if msg.key() in todo:
                    self._dead_lettered.add(msg.key())
        fresh = [k for k in todo if k not in self._dead_lettered]
        if not fresh:
            return
        # The transactional producer belongs to the committer; dead letters are
        # rare and need no transaction: a plain idempotent producer of the loader's.
        if self._dead_letter_producer is None:
            self._dead_letter_producer = make_producer(self._kafka_settings,
                                                       **{"client.id": f"{self.client_id}-dead-letters"})
        producer = self._dead_letter_producer
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
            with kafka_errors(f"dead-lettering {k.decode()}"):
                producer.produce(dead_letters, self._codec.encode("DeadLetter", record), k, on_delivery=on_delivery)
        end = time.monotonic() + self._load_timeout_s
        while not delivered.is_set() and time.monotonic() < end:
            producer.poll(0.05)
        if not delivered.is_set():
            raise BrokerUnavailable(f"dead letters of {topic}[{bucket}] not acknowledged in {self._load_timeout_s} s")
        if errors:
            raise BrokerUnavailable(f"dead letters of {topic}[{bucket}] not written: {errors[0]}")
        self._dead_lettered.update(fresh)
        with self._lock:
            self.stats["dead_lettered"] += len(fresh)
        log.warning("%s[%d]: %d unreadable changelog records dead-lettered to %s", topic, bucket, len(fresh),
                    dead_letters)


def transactional_id_of(group_id: str, instance: str) -> str:
    """The transactional.id an instance writes its windows under: one per instance, for its life."""
    return f"{group_id}.{instance}"


def _checkpoint(state: BucketState, position: int) -> None:
    """The state's local store clean at ``position`` (a state on the heap has none)."""
    if isinstance(state.entries, StoredEntries):
        state.entries.checkpoint(position, state.streams, state.stream_seen_ms)
