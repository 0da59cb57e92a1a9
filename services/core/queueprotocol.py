"""The primary side of a queue as a pure protocol: assignments and results in, actions out.

``QueueProtocol`` holds what a queue primary knows of its partitions (one
``QueuePartition`` each: its batcher, its head, what went out) and decides
what to do next; it never touches Kafka, a thread or a clock (``now_ms`` is
passed in).  The loop (core/queueloop.py, over core/loop.py) performs the
actions and feeds their outcomes back, in the manner of etcd raft's
``Ready``/``Advance``:

1. ``assign(partitions, ends, dispatched_before, batch_ids)``: the group gave
   this member partitions.  What lies below each one's end offset may have been
   offered by the previous primary when some primary ever reported on it (or
   when that is unknown): ``duplicate_below`` flags it possibleDuplicate.  Batch
   ids go on from ``batch_ids`` and never go back below what this member used
   before on the partition.
2. The loop reads records into ``partitions[p].batcher`` (per poll batch; the
   protocol adds nothing per record).
3. ``ready(now_ms, running)``: per partition with nothing out, the batches to
   offer (``Offer``): what was refused before first, then new ones.  Batches
   without events (only dead letters, filtered or conflated records) need no
   offer: they are done at once, and their removals come out with the offers.
4. ``offer_done(done)``: the oldest ``accepted`` batches were delivered: a
   ``Removal`` each, in order.  The rest stay out and go again.
5. ``removed(partition, commit, ok)``: a removal is durable; the partition's
   head moves to ``commit`` and the offset is due.  ``commits()`` hands out the
   due offsets, one per partition, once per turn.
6. ``revoking(partitions)`` marks partitions revoked (offers in flight end;
   their outcomes still come in), ``release(partitions)`` forgets them and
   answers the offsets to commit synchronously before the next primary starts;
   ``lost(partitions)`` forgets them with nothing committed (someone else
   owns them already).

Invariants, asserted where they can break (our own bugs, not bad input): a
partition's head (its checkpoint, the last removed offset + 1) only moves
forward; the offsets committed for a partition never go backward, and those of
``commits()`` strictly increase; batch ids of a partition only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .asyncevent import AsyncEvent
from .batching import Batch, BatchPolicy, PartitionBatcher
from .kafka import TopicPartition


@dataclass(slots=True)
class QueuePartition:
    """A partition this member is primary for."""

    tp: TopicPartition
    batcher: PartitionBatcher[AsyncEvent]
    duplicate_below: int  # offsets below this may have been offered before
    revoked: bool = False
    in_flight: bool = False
    events_dispatched: int = 0
    dead_lettered: int = 0
    last_removed_offset: int = -1
    last_accepted_at: int = 0  # epoch ms of the last delivered batch (a sender: its last ack)
    alerting_since: float = 0.0  # monotonic time of the last ALERT logged; 0 when none is due
    dispatched_yet: bool = False  # a batch of events has gone out since this member took the partition
    head: int = -1  # the first offset not yet removed, once known (a removal, or the first record read)
    #: A clean start names this partition and is not applied yet: nothing of it is dispatched.
    clean_due: bool = False
    #: Records below this offset are not read: a clean start dropped them (-1: none).
    skip_below: int = -1


@dataclass(frozen=True, slots=True)
class OfferDone:
    """A worker's outcome: how many of ``batches``, from the oldest, were delivered."""

    partition: int
    batches: list[Batch[AsyncEvent]]
    accepted: int
    attempts: int
    at_ms: int = 0


@dataclass(frozen=True, slots=True)
class Offer:
    """Action: offer ``batches`` of ``partition`` (on a worker); its outcome comes back as ``OfferDone``.
    ``first`` when it is the first offer of events since this member took the partition."""

    part: QueuePartition
    batches: list[Batch[AsyncEvent]]
    first: bool = False


@dataclass(frozen=True, slots=True)
class Removal:
    """Action: write the removal record of ``batch`` (every record below ``commit`` is removed); its
    delivery comes back as ``removed(partition, commit, ok)``."""

    part: QueuePartition
    batch: Batch[AsyncEvent]
    commit: int


@dataclass(slots=True)
class QueueProtocol:
    """The decisions of one queue's primary over its partitions (module docstring)."""

    topic: str
    policy: BatchPolicy
    partitions: dict[int, QueuePartition] = field(default_factory=dict)
    #: partition -> offset to commit, once its removal is durable; handed out by ``commits()``.
    commits_due: dict[int, int] = field(default_factory=dict)
    #: partition -> the last offset committed for it by this member (never goes backward).
    committed: dict[int, int] = field(default_factory=dict)
    #: partition -> the lowest batch id this member may use next on it (ids only grow).
    batch_floor: dict[int, int] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {
        "batches": 0, "events": 0, "redeliveries": 0, "dead_lettered": 0, "conflated": 0, "filtered": 0,
        "takeovers": 0, "alerts": 0})

    # --- assignment ------------------------------------------------------------------------

    def assign(self, partitions: list[int], ends: dict[int, int], dispatched_before: set[int] | None,
               batch_ids: dict[int, int]) -> list[QueuePartition]:
        """The group gave this member ``partitions`` (step 1); ``ends`` their end offsets now,
        ``dispatched_before`` those some primary reported on (None: unknown), ``batch_ids`` where each
        one's batch ids go on.  Answers the new partitions."""
        new = []
        for p in partitions:
            taken_over = dispatched_before is None or p in dispatched_before
            if taken_over:
                self.stats["takeovers"] += 1  # another primary (or this one before a restart) had it
            next_batch_id = max(batch_ids[p], self.batch_floor.get(p, 0))
            part = self.partitions[p] = QueuePartition(
                tp=TopicPartition(self.topic, p),
                batcher=PartitionBatcher(p, self.policy, next_batch_id=next_batch_id),
                # What a previous primary may have offered (everything up to the end as it is now) comes
                # again flagged possibleDuplicate; a partition nobody ever dispatched has nothing to flag.
                duplicate_below=ends[p] if taken_over else 0,
            )
            new.append(part)
        return new

    def revoking(self, partitions: list[int]) -> list[QueuePartition]:
        """Step 6: these partitions go: offers in flight end (``must_stop_offering``)."""
        revoked = [self.partitions[p] for p in partitions if p in self.partitions]
        for part in revoked:
            part.revoked = True
        return revoked

    def release(self, parts: list[QueuePartition]) -> list[TopicPartition]:
        """Step 6, once the offers in flight ended and the removals are durable: forget ``parts`` and
        answer the offsets to commit before the next primary starts."""
        offsets = []
        for part in parts:
            p = part.tp.partition
            self._floor(part)
            if part.last_removed_offset >= 0:
                offset = part.last_removed_offset + 1
                self._note_commit(p, offset)
                offsets.append(TopicPartition(self.topic, p, offset))
            self.partitions.pop(p, None)
            self.commits_due.pop(p, None)
        return offsets

    def lost(self, partitions: list[int]) -> list[QueuePartition]:
        """Step 6: the partitions are someone else's already: forget them, commit nothing."""
        gone = []
        for p in partitions:
            part = self.partitions.pop(p, None)
            self.commits_due.pop(p, None)
            if part is not None:
                part.revoked = True
                self._floor(part)
                gone.append(part)
        return gone

    def _floor(self, part: QueuePartition) -> None:
        p = part.tp.partition
        self.batch_floor[p] = max(self.batch_floor.get(p, 0), part.batcher.next_batch_id)

    # --- dispatching --------------------------------------------------------------------------

    def ready(self, now_ms: int, running: bool) -> list[Offer | Removal]:
        """Step 3: what to offer now (nothing while the queue is not running), and the removals of
        batches that needed no offer."""
        if not running:
            return []
        actions: list[Offer | Removal] = []
        for part in self.partitions.values():
            if part.in_flight or part.revoked or part.clean_due:
                continue
            # What is still out (refused before) goes again first, then new batches.
            while part.batcher.take(now_ms) is not None:
                pass
            group = list(part.batcher.out)
            if not group:
                continue
            part.in_flight = True
            if not any(b.events for b in group):
                actions += self.offer_done(OfferDone(part.tp.partition, group, len(group), 0, now_ms))
                continue
            first = not part.dispatched_yet
            part.dispatched_yet = True
            actions.append(Offer(part, group, first))
        return actions

    def must_stop_offering(self, part: QueuePartition, running: bool) -> bool:
        """An offer in flight ends (its batches stay out): the partition went, or waits for a clean start,
        or the queue is not running."""
        return part.revoked or part.clean_due or not running

    def offer_done(self, done: OfferDone) -> list[Removal]:
        """Step 4: the removals of the batches delivered, oldest first."""
        redeliveries = max(0, done.attempts - 1)
        self.stats["redeliveries"] += redeliveries
        part = self.partitions.get(done.partition)
        if part is None:
            return []
        part.in_flight = False
        for _ in range(redeliveries):
            part.batcher.rejected()
        removals = []
        for batch in done.batches[:done.accepted]:
            assert part.batcher.offered is batch, "batches are accepted in order"
            commit = part.batcher.accepted()
            part.events_dispatched += len(batch.events)
            part.last_accepted_at = done.at_ms
            self.stats["batches"] += 1 if batch.events else 0
            self.stats["events"] += len(batch.events)
            self.stats["conflated"] += batch.conflated
            removals.append(Removal(part, batch, commit))
        # The rest stay out and are offered again, after the accepted ones' removals (a sender still
        # awaits their acks); none accepted: parked, offered again when dispatch may go on.
        return removals

    # --- removals and commits ----------------------------------------------------------------

    def removed(self, partition: int, commit: int, ok: bool) -> bool:
        """Step 5: the removal up to ``commit`` is durable (``ok``), or failed (the batch was delivered;
        without its removal it is offered again after a restart, flagged).  True when the head moved."""
        if not ok:
            return False
        part = self.partitions.get(partition)
        if part is None or commit <= part.skip_below:
            return False  # revoked; or a clean start moved the head past this removal since it was written
        assert commit - 1 >= part.last_removed_offset, (
            f"{self.topic}[{partition}]: the head moves back from {part.last_removed_offset + 1} to {commit}")
        part.last_removed_offset = commit - 1
        part.head = commit
        self.commits_due[partition] = commit
        return True

    def commits(self) -> list[TopicPartition]:
        """The offsets due (step 5), one per partition still owned; each above the last committed."""
        due, self.commits_due = self.commits_due, {}
        offsets = []
        for p, offset in due.items():
            if p not in self.partitions or offset <= self.committed.get(p, -1):
                continue
            self._note_commit(p, offset)
            offsets.append(TopicPartition(self.topic, p, offset))
        return offsets

    def committed_at(self, partition: int, offset: int) -> None:
        """A commit the loop made itself (a clean start's, synchronously)."""
        self._note_commit(partition, offset)
        self.commits_due.pop(partition, None)

    def _note_commit(self, partition: int, offset: int) -> None:
        last = self.committed.get(partition, -1)
        assert offset >= last, f"{self.topic}[{partition}]: a commit moves back from {last} to {offset}"
        self.committed[partition] = offset


__all__ = ["Offer", "OfferDone", "QueuePartition", "QueueProtocol", "Removal"]
