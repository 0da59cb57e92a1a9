"""How a region instance stays in its group and follows its assignment: the group thread of
``RegionEngine`` (engine.py).

The engine owns the buckets its member of the region's consumer group is
assigned (engine.py's docstring tells the whole story).  This thread runs
the partition loop of core/loop.py over that group consumer, with the engine
as its handler: its partitions stay paused, so a poll brings only the
group's callbacks and errors.

* ``on_assign`` takes the buckets a rebalance adds: ownership.py decides
  (a load, a standby copy taken over, claims to publish) and ``_perform``
  carries that out.
* ``on_revoke`` gives up the buckets that move: it waits (``REVOKE_WAIT_S``)
  for the windows holding their records to commit under the generation that
  is still valid, then keeps the state of each bucket whose changelog ends
  where this member's writes left it (``_park``, ``Parked``), so that taking
  it back costs no load.
* ``on_lost`` drops them at once: a window still holding their records is
  refused by the group coordinator and aborted.
* Each turn also makes the local store's checkpoint when due
  (``_checkpoint_quiet``), forgets idle EventID streams on the status timer,
  and checks that the committer is not wedged in a Kafka call
  (``_check_committer``): an engine that cannot write stops as crashed rather
  than answering nothing.

``GroupMembership`` is mixed into the engine and works on the engine's state,
the attributes declared below.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from ..core.errors import BrokerUnavailable, SluiceError
from ..core.kafka import Consumer, Message, TopicPartition, close_consumer, kafka_errors, partition_end
from ..core.loop import PartitionLoop
from .loading import _checkpoint
from .ownership import Action, BucketStatus, Load, OfferStandby, OwnedBucket, Park, Parked, PublishClaims, RegionOwnership
from .standby import StandbyKeeper
from .store import LocalStore

log = logging.getLogger("sluice.region.engine")

#: How long one poll of the group consumer waits.  It reads no records (its partitions are paused), so this
#: bounds how soon the group thread notices a stop, a wedged committer (``_check_committer``) or a due
#: checkpoint of the local store.
GROUP_POLL_S = 0.05
#: How often idle EventID streams are forgotten (``_expire_streams``: the group loop's status interval).
STREAM_EXPIRY_INTERVAL_S = 30.0
#: A committer writing one window longer than this many transaction timeouts is wedged (``_check_committer``).
WEDGED_AFTER_FACTOR = 4
#: How long on_revoke waits for the windows holding a revoked bucket's records.
REVOKE_WAIT_S = 10.0
#: How long on_revoke waits, in all, for the markers of the last windows to land on the revoked
#: partitions before it keeps their buckets' state (``Parked``).
PARK_SETTLE_S = 1.0
#: How long on_revoke waits before it reads a revoked partition's end again, while its last markers land.
PARK_POLL_S = 0.005


class GroupMembership:
    """The group thread's part of ``RegionEngine`` (module docstring)."""

    # The engine's state the group thread uses (set by RegionEngine.__init__ and start()).
    changelog_topics: dict[str, str]
    stats: dict[str, int]
    assigned_once: threading.Event
    _lock: threading.Lock
    _ownership: RegionOwnership
    _group: Consumer | None
    _high_reader: Consumer | None
    _topic_region: dict[str, str]
    _loads: queue.Queue[tuple[str, int, int] | None]
    _standby: StandbyKeeper | None
    _store: LocalStore | None
    _next_checkpoint: float
    _checkpoint_interval_s: float
    _tracking_timeout_ms: int
    _transaction_timeout_ms: int
    _writing_since: float | None

    # What the rest of the engine provides.
    _owned: dict[tuple[str, int], OwnedBucket]
    _wait_windows: Callable[[float], bool]
    _ownership_changed: Callable[[list[tuple[str, int, int]]], None]

    def _group_loop(self) -> None:
        """The group thread: the partition loop of core/loop.py over the group consumer, this engine
        its handler.  Leaving the group (closing the consumer) revokes every bucket through
        ``on_revoke``, which waits for the windows holding their records."""
        consumer = self._group
        assert consumer is not None
        loop = PartitionLoop(self, consumer, list(self.changelog_topics.values()), self,
                             read_max_records=1, status_interval_s=STREAM_EXPIRY_INTERVAL_S,
                             clock=lambda: time.monotonic())
        self._next_checkpoint = time.monotonic() + self._checkpoint_interval_s
        loop.subscribe()
        try:
            loop.run()
        finally:
            close_consumer(consumer, "closing the group consumer", log)
            with self._lock:
                self._ownership.left()

    # The LoopHandler of the group loop (core/loop.py).

    def poll_timeout_s(self) -> float:
        return GROUP_POLL_S

    def turn(self, msgs: list[Message]) -> None:
        """One turn of the group loop.  Its partitions are paused, so a poll brings only the group's
        callbacks (run inside it) and errors; then the local store's checkpoint when due, and the
        committer's watchdog."""
        for msg in msgs:
            if msg.error() is not None:
                log.debug("group consumer: %s", msg.error())
        if self._store is not None and time.monotonic() >= self._next_checkpoint:
            self._checkpoint_quiet()
            self._next_checkpoint = time.monotonic() + self._checkpoint_interval_s
        self._check_committer()

    def publish_status(self) -> None:
        """The loop's status timer (every STREAM_EXPIRY_INTERVAL_S): idle EventID streams are forgotten."""
        self._expire_streams()

    def _check_committer(self) -> None:
        """Every Kafka call of a window is bounded by the transaction timeout; a committer still in
        one long past it (a client library call that never returns) holds every bucket's writes for
        ever.  The engine then stops as crashed, so the process exits and is started again, rather
        than answering nothing while it looks alive."""
        since = self._writing_since
        if since is None:
            return
        waited_s = time.monotonic() - since
        if waited_s > WEDGED_AFTER_FACTOR * self._transaction_timeout_ms / 1000:
            raise BrokerUnavailable(f"the committer has been writing one window for {waited_s:.0f} s, "
                                    f"{WEDGED_AFTER_FACTOR}× the transaction timeout: a Kafka call never returned")

    def _checkpoint_quiet(self) -> None:
        """Make the local store clean for each owned bucket every write of which is committed (nothing
        in flight: the state is exactly the changelog below ``OwnedBucket.end``) and that moved since.
        A bucket never quiet stays dirty, and a restart after a crash rebuilds it from the changelog."""
        with self._lock:
            for ob in self._owned.values():
                if (ob.status is BucketStatus.READY and not ob.dirty and not ob.inflight and ob.state is not None
                        and ob.end >= 0 and ob.end != ob.stored_at):
                    _checkpoint(ob.state, ob.end)
                    ob.stored_at = ob.end

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

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Cooperative: only the buckets added by this rebalance (the others stay as they are), and
        # called at the end of every rebalance, even when nothing is added.
        consumer.incremental_assign(partitions)
        if partitions:
            consumer.pause(partitions)
        # The generation of this assignment: the offsets of every transaction from now on carry it.
        # Asked here, in the thread that polls the consumer (librdkafka's call blocks while another
        # thread polls).
        membership = consumer.consumer_group_metadata()
        keys = [(self._topic_region[tp.topic], tp.partition) for tp in partitions]
        now_ms = int(time.time() * 1000)
        with self._lock:
            standbys = None if self._standby is None else {key: self._standby.take(*key) for key in keys}
            actions = self._ownership.assign(keys, now_ms, membership, standbys)
        loads = [a for a in actions if isinstance(a, Load)]
        if loads:
            log.info("assigned %s", ", ".join(f"{a.region}[{a.bucket}]" for a in loads))
        self._perform(consumer, actions)
        self.assigned_once.set()

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Cooperative: only the buckets that move, once the group is in its new generation (the others
        # are this member's in it too): windows from now on carry that generation, and a window the
        # group refused for the one that ended is written again under it (_commit_loop).
        membership = consumer.consumer_group_metadata()
        keys = [(self._topic_region[tp.topic], tp.partition) for tp in partitions]
        with self._lock:
            ready = self._ownership.revoking(keys, membership)
        # The generation is still ours: commit what was accepted for these
        # buckets before the group moves them (the next owner's load would
        # otherwise wait for our transactions, or re-enqueue their records).
        committed = self._wait_windows(REVOKE_WAIT_S)
        if not committed:
            log.warning("revoking %d buckets before their last window was committed", len(keys))
        with self._lock:
            revoked, actions = self._ownership.revoked(keys, ready, committed)
        self.stats["buckets_revoked"] += len(revoked)
        log.info("revoked %s", ", ".join(f"{ob.region}[{ob.bucket}]" for ob in revoked) or "nothing")
        self._perform(consumer, actions)
        consumer.incremental_unassign(partitions)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [(self._topic_region[tp.topic], tp.partition) for tp in partitions]
        with self._lock:
            actions = self._ownership.lost(keys)
        log.warning("lost %d buckets (session expired)", len(partitions))
        self._perform(consumer, actions)

    def _perform(self, consumer: Consumer, actions: list[Action]) -> None:
        """Group thread: what ownership.py answered to an assignment, a revocation or a loss."""
        parks = []
        for action in actions:
            if isinstance(action, Load):
                self._loads.put((action.region, action.bucket, action.epoch))
            elif isinstance(action, OfferStandby):
                if self._standby is not None:
                    # Given up: the start of a standby copy, if this instance is to keep one.
                    self._standby.offer(action.region, action.bucket, action.state, action.high)
            elif isinstance(action, PublishClaims):
                self._ownership_changed(action.claims)
            elif isinstance(action, Park):
                parks.append(action.ob)
            else:
                raise AssertionError(f"the group thread cannot perform {action!r}")
        if parks:
            self._park(consumer, parks)

    def _park(self, consumer: Consumer, revoked: list[OwnedBucket]) -> None:
        """Keep the state of revoked buckets whose every window is committed, with their changelog
        partition's bounds once its last markers landed (``Parked``)."""
        assert self._high_reader is not None
        deadline = time.monotonic() + PARK_SETTLE_S
        parked: dict[tuple[str, int], Parked] = {}
        for ob in revoked:
            assert ob.state is not None
            tp = TopicPartition(self.changelog_topics[ob.region], ob.bucket)
            while True:
                try:
                    with kafka_errors("reading the end of its changelog"):
                        low, stable, high = partition_end(consumer, self._high_reader, tp,
                                                          timeout_s=max(0.1, deadline - time.monotonic()))
                except SluiceError as exc:
                    log.info("%s[%d] not kept after its revocation: %s", ob.region, ob.bucket, exc)
                    break
                if stable >= high:
                    if high == ob.end:
                        parked[(ob.region, ob.bucket)] = Parked(ob.state, ob.checkpoint, ob.next_sequence, low,
                                                                high)
                        _checkpoint(ob.state, high)  # every window committed: the state is the changelog
                    else:
                        log.info("%s[%d] not kept after its revocation: its changelog ends at %d, not at %d "
                                 "where this member's writes left it", ob.region, ob.bucket, high, ob.end)
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(PARK_POLL_S)
        with self._lock:
            for key, kept in parked.items():
                self._ownership.park(key, kept)
