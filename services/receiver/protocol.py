"""The gateway receiver's decisions as a pure protocol: assignments and batch outcomes in, actions out.

``ReceiverProtocol`` holds what a receiver knows of the inbound partitions it
owns (one ``InboundPartition`` each: the figures carried with it, whether the
next batch may have been half applied, the last offset done) and of the
sender partitions it heard from (the highest batch id acknowledged for each,
its duplicate-batch tracking).  It never touches Kafka, a thread or a clock
(``now_ms`` is passed in); the service (service.py) performs the actions and
feeds the outcomes back, in the manner of etcd raft's ``Ready``/``Advance``.
The service calls it under one lock, from the loop thread and the lanes.

1. ``assign(partitions, acked, figures, now_ms)``: the group gave this member
   inbound partitions.  ``acked`` is the highest batch id per sender partition
   read from this site's own acks, merged into the tracking (it only grows);
   each partition's figures go on from the newest found (the last ack's header
   or the status topic), taken over by this member (receivertotals.py, step
   1).  A new ownership starts clean: nothing done, nothing due.
2. ``batch(part, offset, key, batch_id, count, now_ms)`` for a verified batch
   read at ``offset`` of the partition: a ``Duplicate`` (its batch id is at or
   below the last acknowledged for its sender partition: acked again, never
   applied again) or an ``Apply`` (``maybe_half_applied`` for the first batch
   past the figures' offset after a takeover: receivertotals.py, step 4).
3. ``applied(verdict, outcome, now_ms)``: what the owners answered, as an
   ``Ack`` to write (the ack's fields and the figures it carries).
   ``Duplicate`` verdicts carry their ``Ack`` already.
4. ``acked(ack)``: the ack is durable.  The figures move on, the sender
   partition's last batch id moves up, and the offset after the batch is due.
5. ``refused(part, offset, now_ms, **counts)``: a batch refused whole (its dead
   letter durable): the figures to write durably to the status topic first,
   or None when they counted it already; then ``done(part, offset + 1,
   figures)``.
6. ``commits()`` hands out the offsets due, one per partition, once; at a
   revoke ``release(partitions)`` forgets the partitions (their lanes ended)
   and answers their offsets due, to commit synchronously before the next
   owner starts; ``lost(partitions)`` forgets them with nothing committed.
   An outcome of a partition no longer owned, or of an ownership before the
   current one (a lane that outlived its partition), changes nothing.

Invariants, asserted where they can break (our own bugs, not bad input): the
offsets done, and so committed, within one ownership of a partition strictly
increase; the last batch id acknowledged per sender partition never goes
down; an outcome's last applied event only moves forward within a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Protocol

from ..core import receivertotals as figures_of
from ..core.errors import BadSignature, InvalidRequest, RejectedBatch, SluiceError, StaleBatch
from ..core.events import EventID
from ..core.kafka import TopicPartition
from ..core.receivertotals import PartitionTotals
from ..core.regionclient import BatchAnswer, RegionError

#: Answers of the region service that say the receiver's credential is wrong, not the events.
UNAUTHORIZED = (401, 403)


@dataclass(slots=True, eq=False)
class InboundPartition:
    """An inbound partition this member owns, for one ownership (a new assignment: a new object)."""

    partition: int
    #: The partition's figures over all its owners, with what is durable counted.
    figures: PartitionTotals
    #: The next batch past ``figures.offset`` may have been half applied by the owner before.
    maybe_half_applied: bool = True
    #: The offset after the last batch done in this ownership (-1: none yet).
    done: int = -1


@dataclass(slots=True)
class Applied:
    """What became of a batch's events so far, as the owners answered (one lane's, not shared)."""

    exceptions: dict[int, dict[str, Any]] = field(default_factory=dict)  # batch index -> BatchException
    last_index: int = -1
    last_event_id: EventID | None = None
    applied: int = 0
    duplicates: int = 0
    conflicts: int = 0
    recovered: int = 0
    #: Events an attempt may have applied without its answer reaching us (a lost answer, or the
    #: previous owner's attempt at the first batch after a takeover): repeats of them are recoveries.
    unanswered: set[int] = field(default_factory=set)

    def refuse(self, index: int, event_id: EventID, exception_class: str, message: str) -> None:
        self.exceptions[index] = {"index": index, "event_id": event_id.to_record(),
                                  "exception_class": exception_class, "message": message}

    def took(self, part: list[int], answer: BatchAnswer) -> None:
        """An owner's answer to the record of the batch's events ``part`` (record index -> batch index).
        Its repeats are recoveries when every event it answered (those it did not refuse) was unanswered
        before (receivertotals.py, step 4); a request never mixes the two kinds (``ReceiverService._settle``)."""
        self.applied += answer.applied
        self.conflicts += answer.conflicts
        refused = {part[r["index"]] for r in answer.refused}
        answered = [i for i in part if i not in refused]
        if answered and self.unanswered.issuperset(answered):
            self.recovered += answer.duplicates
        else:
            self.duplicates += answer.duplicates
        self.unanswered.difference_update(answered)
        if answer.last_applied is not None:
            index, event_id = answer.last_applied
            if part[index] > self.last_index:
                self.last_index, self.last_event_id = part[index], event_id


class FailureAction(Enum):
    """What a request to an owner that got no usable answer leads to (``failure_action``)."""

    RETRY = "retry"  # the failure is retriable: the same events go again
    ALERT = "alert"  # the receiver's credential was refused: alerted, and the same events go again
    REFUSE = "refuse"  # for good: halved until the refused events stand alone, each an exception


def failure_action(exc: SluiceError) -> FailureAction:
    """The ``retriable`` flag decides; a 401 or 403 is an operator's error, not the batch's."""
    if exc.retriable:
        return FailureAction.RETRY
    if isinstance(exc, RegionError) and exc.status in UNAUTHORIZED:
        return FailureAction.ALERT
    return FailureAction.REFUSE


class BatchFacts(Protocol):
    """What ``batch_problem`` reads of a batch (a ``BatchView``)."""

    source_dsid: int
    target_dsid: int
    batch_id: int
    created_at: int


def batch_problem(batch: BatchFacts, signer: int | None, now_ms: int, *, dsid: int, accepted: Iterable[int],
                  batch_max_age_ms: int, clock_skew_ms: int) -> InvalidRequest | None:
    """Why the batch must not be applied at site ``dsid``, or None (service.py, step 1)."""
    source = batch.source_dsid
    accepted = set(accepted)
    if signer is not None and source != signer:
        return BadSignature("source_dsid", source, f"batch {batch.batch_id} was signed by dsid {signer}: a "
                            "site signs only batches it sends")
    if source not in accepted:
        return RejectedBatch("source_dsid", source, f"batch {batch.batch_id} from dsid {source} rejected: "
                             f"accepted dsids are {sorted(accepted)}")
    if batch.target_dsid != dsid:
        return RejectedBatch("target_dsid", batch.target_dsid, f"batch {batch.batch_id} for dsid "
                             f"{batch.target_dsid} reached dsid {dsid}")
    created = batch.created_at
    if created < now_ms - batch_max_age_ms:
        return StaleBatch("created_at", created, f"batch {batch.batch_id} from dsid {source} was sent "
                          f"{now_ms - created} ms ago, longer than receiver.batch_max_age_ms="
                          f"{batch_max_age_ms}: a replay")
    if created > now_ms + clock_skew_ms:
        return StaleBatch("created_at", created, f"batch {batch.batch_id} from dsid {source} is stamped "
                          f"{created - now_ms} ms in the future, beyond region_service.max_clock_skew_ms="
                          f"{clock_skew_ms}")
    return None


@dataclass(frozen=True, slots=True)
class Ack:
    """Action: write the signed ack of the batch at ``offset`` carrying ``figures``; once durable, hand it
    back to ``acked``."""

    part: InboundPartition
    offset: int
    key: str
    batch_id: int
    figures: PartitionTotals
    last_batch_id: int
    duplicate: bool
    last_applied: int
    last_event_id: EventID | None
    exceptions: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Verdict: a batch at or below the last acknowledged of its sender partition: ``ack`` it again."""

    ack: Ack


@dataclass(frozen=True, slots=True)
class Apply:
    """Verdict: hand the batch's events to their owners; their outcome goes to ``applied``."""

    part: InboundPartition
    offset: int
    key: str
    batch_id: int
    #: The batch lies past the offset the figures cover: it is counted once acknowledged.
    new: bool
    #: Its events may have been applied by the owner before, unanswered (receivertotals.py, step 4).
    maybe_half_applied: bool


@dataclass
class ReceiverProtocol:
    """The decisions of one receiver over its inbound partitions (module docstring)."""

    topic: str
    dsid: int
    member: str
    partitions: dict[int, InboundPartition] = field(default_factory=dict)
    #: Sender partition ("<source dsid>/<sender id>/<queue partition>") -> the highest batch id acknowledged.
    last_batch: dict[str, int] = field(default_factory=dict)
    #: Partition -> the offset to commit, handed out once by ``commits()``.
    commits_due: dict[int, int] = field(default_factory=dict)
    #: Outcomes dropped because their partition (or that ownership of it) is gone.
    stale_outcomes: int = 0

    # --- ownership (step 1, step 6) ------------------------------------------------------------

    def assign(self, partitions: Iterable[int], acked: dict[str, int],
               figures: dict[int, list[PartitionTotals | None]], now_ms: int) -> list[InboundPartition]:
        """The group gave this member ``partitions``: merge ``acked`` into the tracking; each partition's
        figures go on from the newest of ``figures[p]``.  Answers the new ownerships, each starting clean."""
        self.learn(acked)
        new = []
        for p in partitions:
            before = figures_of.newest(figures.get(p, []))
            start = before or PartitionTotals(p, self.dsid)
            part = self.partitions[p] = InboundPartition(p, start.taken_over_by(self.member, now_ms))
            self.commits_due.pop(p, None)
            new.append(part)
        return new

    def learn(self, acked: dict[str, int]) -> None:
        """Batch ids acknowledged (this site's own acks): the tracking takes the higher of each."""
        for key, batch_id in acked.items():
            if batch_id > self.last_batch.get(key, -1):
                self.last_batch[key] = batch_id

    def owns(self, part: InboundPartition) -> bool:
        """``part`` is the current ownership of its partition."""
        return self.partitions.get(part.partition) is part

    def release(self, partitions: Iterable[int]) -> list[TopicPartition]:
        """A revoke, once the partitions' lanes ended: forget them and answer their offsets due."""
        offsets = []
        for p in partitions:
            self.partitions.pop(p, None)
            offset = self.commits_due.pop(p, None)
            if offset is not None:
                offsets.append(TopicPartition(self.topic, p, offset))
        return offsets

    def lost(self, partitions: Iterable[int]) -> None:
        """Someone else owns the partitions already: forget them, commit nothing of them."""
        for p in partitions:
            self.partitions.pop(p, None)
            self.commits_due.pop(p, None)

    # --- one batch (steps 2 to 5) ----------------------------------------------------------------

    def batch(self, part: InboundPartition, offset: int, key: str, batch_id: int, count: int,
              now_ms: int) -> Duplicate | Apply:
        """Step 2, for a batch that passed verification (a duplicate's ack says its last event applied:
        the service reads that event's EventID from the batch)."""
        new = offset > part.figures.offset
        maybe_half_applied = new and part.maybe_half_applied
        if new:
            part.maybe_half_applied = False
        last = self.last_batch.get(key, -1)
        if batch_id <= last:
            figures = part.figures.counting(offset, now_ms, duplicate_batches=1) if new else part.figures
            return Duplicate(Ack(part, offset, key, batch_id, figures, last, True, count - 1, None, []))
        return Apply(part, offset, key, batch_id, new, maybe_half_applied)

    def applied(self, verdict: Apply, outcome: Applied, now_ms: int) -> Ack:
        """Step 3: the ack of an applied batch (tracked once acknowledged: a batch whose ack was not
        written is applied again when it comes again, its events repeats by EventID, rather than
        answered duplicate_batch to a sender that never had an ack of it)."""
        part = verdict.part
        figures = part.figures
        if verdict.new:
            figures = figures.counting(
                verdict.offset, now_ms, batches=1, events_applied=outcome.applied + outcome.recovered,
                events_recovered=outcome.recovered, events_duplicate=outcome.duplicates,
                conflicts=outcome.conflicts, exceptions=len(outcome.exceptions))
        last_batch_id = max(self.last_batch.get(verdict.key, -1), verdict.batch_id)
        exceptions = [outcome.exceptions[i] for i in sorted(outcome.exceptions)]
        return Ack(part, verdict.offset, verdict.key, verdict.batch_id, figures, last_batch_id, False,
                   outcome.last_index, outcome.last_event_id, exceptions)

    def acked(self, ack: Ack) -> bool:
        """Step 4: the ack is durable.  False when its ownership is gone (nothing moves)."""
        if not self.owns(ack.part):
            self.stale_outcomes += 1
            return False
        last = self.last_batch.get(ack.key, -1)
        assert ack.last_batch_id >= last, (
            f"{ack.key}: the last batch id acknowledged moves back from {last} to {ack.last_batch_id}")
        self.last_batch[ack.key] = ack.last_batch_id
        self.done(ack.part, ack.offset + 1, ack.figures)
        return True

    def refused(self, part: InboundPartition, offset: int, now_ms: int, **counts: int) -> PartitionTotals | None:
        """Step 5: the figures counting a batch refused whole, to write durably before ``done``; None when
        they counted it already (read again after a crash)."""
        if offset <= part.figures.offset:
            return None
        part.maybe_half_applied = False  # this batch was the first past the figures: nothing of it applied
        return part.figures.counting(offset, now_ms, **counts)

    def done(self, part: InboundPartition, offset: int, figures: PartitionTotals | None = None) -> bool:
        """The batch before ``offset`` is done (its ack or its figures durable): the offset is due.  False,
        and nothing moves, when its ownership is gone."""
        if not self.owns(part):
            self.stale_outcomes += 1
            return False
        assert offset > part.done, f"{self.topic}[{part.partition}]: done offset {offset} after {part.done}"
        part.done = offset
        if figures is not None:
            part.figures = figures
        self.commits_due[part.partition] = offset
        return True

    def commits(self) -> list[TopicPartition]:
        """Step 6: the offsets due, one per owned partition, each handed out once."""
        due, self.commits_due = self.commits_due, {}
        return [TopicPartition(self.topic, p, offset) for p, offset in due.items() if p in self.partitions]


__all__ = ["Ack", "Applied", "Apply", "Duplicate", "FailureAction", "InboundPartition", "ReceiverProtocol",
           "UNAUTHORIZED", "batch_problem", "failure_action"]
