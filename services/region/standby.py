"""Redundant copies: standby state of buckets this instance does not own.

Geode keeps ``redundant-copies`` copies of each bucket in other members, and
one of them becomes primary when the primary's member fails, without reading
the bucket again.  Here a region with ``redundant_copies: k`` has, for each
bucket, up to *k* instances besides its owner tailing the bucket's changelog
partition (read_committed, from its start) into a ``BucketState`` of their
own.  When the group assigns such an instance the bucket, its load
(``engine.RegionEngine._load``) takes the copy and reads only what the copy
has not read yet: from the copy's position to the partition's end, once no
transaction is open on it.  A standby that is behind when promoted therefore
catches up before the bucket answers, and one that is current reads nothing.

Placement (``standby_buckets``): the live instances of the owner directory,
in name order, form a ring; the standbys of a bucket are the *k* instances
that follow its owner on the ring.  Standbys are thus never on the owner.
The group's assignor (cooperative-sticky) decides who is promoted, and a
Python client cannot steer it: with more instances
than ``redundant_copies + 1`` a bucket may go to an instance without its
copy, which then loads it from the changelog as before.
``redundant_copies`` at least the number of instances minus one makes every
instance a standby of every bucket it does not own.

With a local store (store.py) a copy's entries live there, a copy is marked
clean at its position every second (it holds only committed records), and
an instance that starts again resumes its copies from their stores.

A copy costs what an owned bucket costs: its entries in memory, and the CPU
of decoding and applying each changelog record once more per copy.  A
record a standby cannot read is kept with the copy and dead-lettered by the
load that promotes it (the owner's dead-lettering path, loading.py).

Threads: the keeper's own (its consumer and every copy), and callers of
``want``, ``take``, ``offer`` and ``status``, under the keeper's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..core.codec import Codec
from ..core.framing import Frames
from ..core.errors import CodecError, SluiceError
from ..core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    TopicPartition,
    close_consumer,
    kafka_errors,
    make_consumer,
)
from .state import BucketState, changelog_event
from .store import StoredEntries

log = logging.getLogger("sluice.region.standby")

Bucket = tuple[str, int]

#: How long the state of a bucket this instance gave up is offered as the start of a standby copy.
OFFER_KEPT_S = 60.0
#: How often the keeper refreshes the lag of each copy.
STATUS_EVERY_S = 1.0


def standby_buckets(me: str, members: Iterable[str], owners: Mapping[Bucket, str],
                    buckets: Mapping[str, int], copies: Mapping[str, int]) -> set[Bucket]:
    """The buckets ``me`` keeps a standby copy of (see the module docstring).

    ``members``: the live instances; ``owners``: (region, bucket) → the
    instance owning it; ``buckets``: region → bucket count; ``copies``:
    region → its redundant_copies.  A bucket without a known live owner has
    its ring start at ``bucket mod len(members)``, and that member is skipped
    as if it were the owner, so every instance computes the same placement.
    """
    ring = sorted(set(members) | {me})
    n = len(ring)
    if n < 2:
        return set()
    position = {name: i for i, name in enumerate(ring)}
    mine: set[Bucket] = set()
    for region, count in buckets.items():
        k = min(copies.get(region, 0), n - 1)
        if k <= 0:
            continue
        for bucket in range(count):
            owner = owners.get((region, bucket))
            start = position[owner] if owner in position else bucket % n
            if ring[start] == me:
                continue
            if 0 < (position[me] - start) % n <= k:
                mine.add((region, bucket))
    return mine


@dataclass(slots=True)
class StandbyCopy:
    """One bucket's standby state: every committed changelog record below ``position`` applied."""

    state: BucketState
    position: int = 0
    #: Records it could not read: (offset, key, value, error), dead-lettered when it is promoted.
    unreadable: list[tuple[int, bytes | None, bytes | None, CodecError]] = field(default_factory=list)
    #: Bytes of the values it holds (the copy's memory, besides its keys and per-entry overhead).
    value_bytes: int = 0
    #: The partition's end as last seen, and the consumer's position past markers (for the lag).
    high: int = -1
    seen: int = 0
    #: Where its local store was last made clean (-1: not yet).
    stored_at: int = -1

    @property
    def lag(self) -> int:
        return max(0, self.high - max(self.position, self.seen)) if self.high >= 0 else -1


@dataclass(frozen=True, slots=True)
class StandbyStatus:
    region: str
    bucket: int
    position: int
    lag: int  # records and markers behind the partition's end; -1: not known yet
    entries: int
    value_bytes: int


class StandbyKeeper:
    """Tails the changelog partitions of the buckets ``want`` names (see the module docstring)."""

    def __init__(self, *, kafka_settings: dict[str, Any], client_id: str, changelog_topics: dict[str, str],
                 dsid: int, member_id: str, codec: Codec, frames: Frames | None = None,
                 new_copy: Callable[[str, int, int, int], tuple[BucketState, int]] | None = None) -> None:
        self._kafka_settings = kafka_settings
        self._client_id = client_id
        self._topics = changelog_topics
        self._region_of = {t: r for r, t in changelog_topics.items()}
        self._dsid = dsid
        self._member_id = member_id
        self._codec = codec
        #: (region, bucket, low, high) → the state a new copy starts from and its position (the local
        #: store's); None: copies start empty, on the heap.
        self._new_copy = new_copy
        self._frames = frames or Frames(codec)
        self._lock = threading.Lock()
        self._wanted: set[Bucket] = set()
        self._copies: dict[Bucket, StandbyCopy] = {}
        #: States of buckets this instance gave up (a revocation): (copy, when offered).
        self._offered: dict[Bucket, tuple[StandbyCopy, float]] = {}
        #: The partitions the keeper's consumer is assigned, with the copy each is read into (keeper thread only).
        self._assigned: dict[Bucket, StandbyCopy] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"standby_records": 0, "standby_promoted": 0, "standby_unreadable": 0}

    # --- what the engine and the service call ------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="region-standby", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            self._copies.clear()
            self._offered.clear()

    def want(self, buckets: set[Bucket]) -> None:
        """Keep copies of exactly these buckets from now on (copies of others are dropped)."""
        with self._lock:
            self._wanted = set(buckets)
            for key in [k for k in self._copies if k not in self._wanted]:
                del self._copies[key]
            now = time.monotonic()
            for key in list(self._offered):
                offered, at = self._offered[key]
                if key in self._wanted and key not in self._copies:
                    self._copies[key] = offered
                    del self._offered[key]
                elif now - at > OFFER_KEPT_S:
                    del self._offered[key]

    def take(self, region: str, bucket: int) -> StandbyCopy | None:
        """The bucket's copy, no longer tailed: this instance now owns the bucket."""
        with self._lock:
            self._wanted.discard((region, bucket))
            self._offered.pop((region, bucket), None)
            copy = self._copies.pop((region, bucket), None)
            if copy is not None:
                self.stats["standby_promoted"] += 1
            return copy

    def offer(self, region: str, bucket: int, state: BucketState, position: int) -> None:
        """The state of a bucket this instance gave up, every record below ``position`` applied: the
        start of its standby copy, if the placement makes this instance one within ``OFFER_KEPT_S``."""
        copy = StandbyCopy(state, position, value_bytes=sum(len(e.value) for e in state.entries.values()
                                                              if e.value is not None))
        with self._lock:
            if (region, bucket) in self._wanted and (region, bucket) not in self._copies:
                self._copies[(region, bucket)] = copy
            else:
                self._offered[(region, bucket)] = (copy, time.monotonic())

    def status(self) -> list[StandbyStatus]:
        with self._lock:
            return [StandbyStatus(r, b, c.position, c.lag, len(c.state.entries), c.value_bytes)
                    for (r, b), c in sorted(self._copies.items())]

    # --- the keeper's thread -------------------------------------------------------

    def _run(self) -> None:
        consumer: Consumer | None = None
        next_status = 0.0
        reading = kafka_errors("standby reader")
        while not self._stopping.is_set():
            try:
                with reading:
                    if consumer is None:
                        consumer = make_consumer(self._kafka_settings, None, **{
                            "client.id": f"{self._client_id}-standby", "isolation.level": "read_committed",
                            "fetch.wait.max.ms": 100})
                        self._assigned = {}
                    self._reconcile(consumer)
                    if not self._assigned:
                        self._stopping.wait(0.1)
                        continue
                    msgs = consumer.consume(2000, 0.1)
                    if msgs:
                        self._apply(msgs)
                    if time.monotonic() >= next_status:
                        next_status = time.monotonic() + STATUS_EVERY_S
                        self._refresh_lag(consumer)
                        self._checkpoint()
            except SluiceError as exc:
                if not exc.retriable:
                    log.error("%s: %s; no standby copies are kept from now on", reading.what, exc)
                    raise
                # A broker away: a fresh consumer, positions from the copies (nothing is lost, only re-read).
                log.warning("%s; starting it again", exc)
                if consumer is not None:
                    _close(consumer)
                consumer = None
                self._stopping.wait(1.0)
        if consumer is not None:
            _close(consumer)

    def _reconcile(self, consumer: Consumer) -> None:
        """Assign the partitions of new copies (from their positions) and drop those of gone ones."""
        with self._lock:
            missing = [key for key in self._wanted if key not in self._copies]
        started = {key: self._start(consumer, *key) for key in missing}
        with self._lock:
            for key, copy in started.items():
                if key in self._wanted and key not in self._copies:
                    self._copies[key] = copy
            current = dict(self._copies)
            positions = {k: c.position for k, c in current.items()}
        # A copy dropped and started again is a new object: its partition is read again from its position.
        gone = [k for k, c in self._assigned.items() if current.get(k) is not c]
        if gone:
            consumer.incremental_unassign([TopicPartition(self._topics[r], b) for r, b in gone])
            for key in gone:
                del self._assigned[key]
        new = [k for k in current if k not in self._assigned]
        if new:
            consumer.incremental_assign([
                TopicPartition(self._topics[r], b, positions[(r, b)] if positions[(r, b)] > 0 else OFFSET_BEGINNING)
                for r, b in new])
            self._assigned.update((k, current[k]) for k in new)
            log.info("standby for %s", ", ".join(f"{r}[{b}]" for r, b in sorted(new)))

    def _start(self, consumer: Consumer, region: str, bucket: int) -> StandbyCopy:
        """A new copy: empty, or the local store's where it is clean within the partition's offsets."""
        if self._new_copy is None:
            return StandbyCopy(BucketState(region, bucket, self._dsid, self._member_id))
        low, high = consumer.get_watermark_offsets(TopicPartition(self._topics[region], bucket), timeout=10.0)
        state, position = self._new_copy(region, bucket, low, high)
        return StandbyCopy(state, position, value_bytes=sum(len(e.value) for e in state.entries.values()
                                                            if e.value is not None))

    def _checkpoint(self) -> None:
        """Each copy's local store clean at its position (a copy holds only committed records)."""
        with self._lock:
            for copy in self._copies.values():
                if isinstance(copy.state.entries, StoredEntries) and copy.position != copy.stored_at:
                    copy.state.entries.checkpoint(copy.position, copy.state.streams, copy.state.stream_seen_ms)
                    copy.stored_at = copy.position

    def _apply(self, msgs: list[Any]) -> None:
        applied = 0
        with self._lock:
            for msg in msgs:
                if msg.error() is not None:
                    continue
                key = (self._region_of.get(msg.topic(), ""), msg.partition())
                copy = self._copies.get(key)
                offset = msg.offset()
                if copy is None or copy is not self._assigned.get(key) or offset < copy.position:
                    continue  # a copy taken or started again since the fetch
                value = msg.value()
                # The position moves only once the record is read or refused: a registry that cannot be
                # asked (RegistryUnavailable, retriable: a fresh reader from the positions) skips nothing.
                try:
                    event = changelog_event(value, self._frames)
                except CodecError as exc:
                    copy.position = offset + 1
                    log.error("changelog %s[%d]@%d unreadable, skipped by the standby: %s", msg.topic(),
                              msg.partition(), offset, exc)
                    copy.unreadable.append((offset, msg.key(), value, exc))
                    self.stats["standby_unreadable"] += 1
                    continue
                copy.position = offset + 1
                entries = copy.state.entries
                before = entries.get(event.key)
                if before is not None and before.value is not None:
                    copy.value_bytes -= len(before.value)
                copy.state.replay(event)
                after = entries[event.key].value
                if after is not None:
                    copy.value_bytes += len(after)
                applied += 1
        self.stats["standby_records"] += applied

    def _refresh_lag(self, consumer: Consumer) -> None:
        with self._lock:
            keys = [k for k in self._copies if k in self._assigned]
        if not keys:
            return
        tps = [TopicPartition(self._topics[r], b) for r, b in keys]
        seen = {(self._region_of[tp.topic], tp.partition): tp.offset for tp in consumer.position(tps)}
        highs = {}
        reading_end = kafka_errors("reading the end of a changelog")
        for key, tp in zip(keys, tps):
            try:
                with reading_end:
                    highs[key] = consumer.get_watermark_offsets(tp, cached=True)[1]
            except SluiceError:
                continue
        with self._lock:
            for key in keys:
                copy = self._copies.get(key)
                if copy is None:
                    continue
                if seen.get(key, -1) >= 0:
                    copy.seen = seen[key]
                if highs.get(key, -1) >= 0:
                    copy.high = highs[key]


def _close(consumer: Consumer) -> None:
    close_consumer(consumer, "closing the standby reader", log, logging.DEBUG)
