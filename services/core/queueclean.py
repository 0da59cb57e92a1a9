"""Clean starts: dropping what a gateway sender's queue holds, exactly, through its removals.

Geode's ``start gateway-sender --clean-queues`` starts a stopped sender and
discards what its queue held.  Here a queue is a Kafka topic whose head is
the compacted removals record of each partition (DESIGN §1), so a clean is a
removal: the head moves to where the queue ended when the clean was asked
for, and nothing at or after that offset is touched.  The story, step by step:

1. ``sluice admin start SENDER --clean-queues`` (or the status page) finds the
   sender STOPPED, reads each queue partition's last stable offset (the end a
   read_committed reader sees: everything below it is decided, and an event
   whose transaction had not committed lies at or above it) and writes one
   ``ControlRecord`` for the sender: state RUNNING and a ``QueueCleanRequest``
   (a request id and those offsets, the *cuts*).  Every later control record
   of the sender carries the request on (``sluice admin`` copies it), so a
   primary that starts after the compacted topic has dropped older records
   still finds it.
2. Every primary follows the control topic.  For each partition it owns (now,
   or when the group assigns it one later) it reads no record below the cut
   from then on and dispatches nothing of the partition until the clean is
   applied.  A batch still out when the request came (one offered before the
   stop) finishes first: its removal is the head's truth too.
3. Applying it to a partition, on the primary's loop thread (the only writer
   of the partition's removal records, so the head never moves back):
   the head is the highest of what the primary knows, the group offset and
   the removals record; the events between head and cut are counted (a
   read_committed read: events, not offsets); a ``QueueCleanAudit`` record
   in state APPLYING (head, cut, that count) is written to the status topic,
   durably; then the partition's removal record (last removed offset
   cut - 1, removed count) and the group offset commit; the primary forgets
   whatever it held below the cut; finally the audit goes APPLIED, with who
   applied it and when.
4. A primary that crashes anywhere in step 3 leaves the request and maybe an
   APPLYING audit: the next primary of the partition finishes from the audit
   (the same count, since nothing of the partition was dispatched meanwhile)
   and never writes a removal below the head it finds.  An audit APPLIED is
   the end; a partition already at or past its cut with no audit had nothing
   left to drop (APPLIED, 0).

``sluice admin status`` and the status page list the audits: how many events
each partition lost, asked by whom and when, applied by whom and when.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from .asyncevent import flag_possible_duplicates
from .codec import Codec, get_codec
from .errors import BrokerUnavailable, CodecError, SluiceError
from .eventwire import removal_record
from .kafka import (
    FLUSH_DEADLINE_S,
    OFFSETS_REQUEST_DEADLINE_S,
    Consumer,
    KafkaError,
    TopicPartition,
    consumed_position,
    kafka_errors,
    make_consumer,
    produce_durably,
    read_to_end,
    until_answered,
)

if TYPE_CHECKING:
    from .config import SiteConfig
    from .queueprotocol import QueuePartition, QueueProtocol

log = logging.getLogger("sluice.queue")

#: The prefix of the audit records' keys in the status topic.
AUDIT_KEY_PREFIX = "clean/"

APPLYING = "APPLYING"
APPLIED = "APPLIED"


@dataclass(frozen=True, slots=True)
class CleanRequest:
    """One clean start of a queue: drop, per partition, every event below ``offsets[partition]``."""

    request_id: str
    offsets: tuple[int, ...]
    issued_by: str
    issued_at: int

    @classmethod
    def new(cls, offsets: list[int] | tuple[int, ...], issued_by: str) -> CleanRequest:
        return cls(uuid.uuid4().hex[:12], tuple(offsets), issued_by, int(time.time() * 1000))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> CleanRequest:
        return cls(record["request_id"], tuple(record["offsets"]), record["issued_by"], record["issued_at"])

    def to_record(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "offsets": list(self.offsets), "issued_by": self.issued_by,
                "issued_at": self.issued_at}

    def cut(self, partition: int) -> int | None:
        """The partition's new head; None for a partition the request does not name."""
        return self.offsets[partition] if 0 <= partition < len(self.offsets) else None


@dataclass(frozen=True, slots=True)
class CleanAudit:
    """What a clean dropped from one partition (``QueueCleanAudit``)."""

    kind: str
    queue_id: str
    request_id: str
    partition: int
    state: str
    head_offset: int
    cut_offset: int
    dropped: int
    issued_by: str
    issued_at: int
    applied_by: str
    applied_at: int

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> CleanAudit:
        return cls(**record)

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def applied(self) -> bool:
        return self.state == APPLIED


def audit_key(kind: str, queue_id: str, request_id: str, partition: int) -> bytes:
    return f"{AUDIT_KEY_PREFIX}{kind}/{queue_id}/{request_id}/{partition}".encode()


def encode_audit(audit: CleanAudit) -> bytes:
    return get_codec().encode("QueueCleanAudit", audit.to_record())


def read_audits(consumer: Any, status_topic: str, kind: str | None = None, queue_id: str | None = None,
                request_id: str | None = None) -> list[CleanAudit]:
    """The latest audit of every (request, partition) in the status topic, narrowed to a kind, a queue and
    a request when given; unreadable records are passed over."""
    prefix = AUDIT_KEY_PREFIX
    if kind is not None:
        prefix += f"{kind}/"
        if queue_id is not None:
            prefix += f"{queue_id}/"
            if request_id is not None:
                prefix += f"{request_id}/"
    wanted = prefix.encode()
    codec = get_codec()
    latest: dict[bytes, CleanAudit] = {}
    for msg in read_to_end(consumer, status_topic):
        key = msg.key() or b""
        if not key.startswith(wanted) or msg.value() is None:
            continue
        try:
            audit = CleanAudit.from_record(codec.decode_as("QueueCleanAudit", msg.value()))
        except (CodecError, TypeError):
            continue
        if key == audit_key(audit.kind, audit.queue_id, audit.request_id, audit.partition):
            latest[key] = audit
    return list(latest.values())


def count_events(consumer: Any, topic: str, partition: int, start: int, stop: int, *, limit: int | None = None,
                 stall_s: float = 30.0, progress: Callable[[int], None] | None = None) -> int | None:
    """The records a read_committed reader gets from ``topic[partition]`` at offsets ``start`` to ``stop - 1``:
    a queue's events there (transaction markers and aborted records take offsets too, and are not events).
    None once ``limit`` is passed.  ``consumer`` is assigned for the read and unassigned after.  A read that
    makes no progress for ``stall_s`` raises a retriable ``BrokerUnavailable`` (a broker away) rather than count
    short."""
    if stop <= start:
        return 0
    tp = TopicPartition(topic, partition)
    consumer.assign([TopicPartition(topic, partition, start)])
    try:
        counted, position = 0, start
        moved_at = time.monotonic()
        while position < stop:
            before = position
            for msg in consumer.consume(1000, 0.05):
                if msg.error() is None and msg.partition() == partition:
                    if msg.offset() < stop:
                        counted += 1
                    position = max(position, msg.offset() + 1)
            position = max(position, consumed_position(consumer, tp))
            if limit is not None and counted > limit:
                return None
            if position > before:
                moved_at = time.monotonic()
                if progress is not None:
                    progress(counted)
            elif time.monotonic() - moved_at > stall_s:
                raise BrokerUnavailable(f"counting {topic}[{partition}] from {start} to {stop}: no progress past "
                                        f"offset {position} in {stall_s:g} s", code=KafkaError._TIMED_OUT)
        return counted
    finally:
        consumer.unassign()



class QueueCleaning:
    """The clean starts' part of ``QueuePrimary`` (core/queueloop.py): steps 2 to 4 of the module
    docstring, on the primary's loop thread."""

    # The primary's state the cleans use (set by QueuePrimary.__init__ and start()).
    cfg: SiteConfig
    kind: str
    queue_id: str
    member_id: str
    topic: str
    removals_topic: str
    status_topic: str
    protocol: QueueProtocol
    _partitions: dict[int, QueuePartition]
    _codec: Codec
    _removal_header: bytes
    _consumer: Consumer | None
    _producer: Any
    _removals_unacked: int
    _stopping: threading.Event
    _clean: CleanRequest | None
    _clean_applied: set[int]
    _drain_inbox: Callable[[], None]
    partitions_released: Callable[[list[int]], None]

    def _take_clean(self, request: CleanRequest) -> None:
        """A control record carries a clean start: new to this member, it is due on every partition it owns."""
        if self._clean is not None and self._clean.request_id == request.request_id:
            return  # carried on by a later record of the queue: taken already
        self._clean = request
        self._clean_applied = set()
        log.info("queue %s: clean start %s asked by %s: dropping what the queue holds below %s", self.queue_id,
                 request.request_id, request.issued_by or "?", list(request.offsets))
        for part in self._partitions.values():
            self._mark_clean_due(part)

    def _mark_clean_due(self, part: QueuePartition) -> None:
        """Nothing below the clean's cut is read from now on, and the partition waits for the clean."""
        request = self._clean
        cut = request.cut(part.tp.partition) if request is not None else None
        if cut is None:
            return
        part.skip_below = max(part.skip_below, cut)
        part.clean_due = part.tp.partition not in self._clean_applied

    def _apply_due_cleans(self) -> None:
        """Apply the due clean to each partition that has no batch out now (one offered before the stop
        finishes first, and its removal with it)."""
        for part in list(self._partitions.values()):
            if not part.clean_due or part.in_flight or part.revoked:
                continue
            if self._removals_unacked:
                # A removal written before must be durable, and taken, before the clean's: the head only
                # moves forward.
                self._producer.flush(FLUSH_DEADLINE_S)
                self._drain_inbox()
                if self._removals_unacked:
                    return
            self._apply_clean(part)

    def _apply_clean(self, part: QueuePartition) -> None:
        """Loop thread: the clean's steps 3 and 4 for one partition (see core/queueclean.py)."""
        request = self._clean
        assert request is not None
        partition = part.tp.partition
        cut = request.cut(partition)
        assert cut is not None
        audits = {a.partition: a for a in until_answered(
            lambda: self._read_clean_audits(request.request_id),
            f"queue {self.queue_id}: reading the audits of clean {request.request_id}", stopping=self._stopping)}
        self._clean_applied.update(p for p, a in audits.items() if a.applied)
        audit = audits.get(partition)
        now_ms = int(time.time() * 1000)
        if audit is None or not audit.applied:
            head = self._head_for_clean(part)
            if audit is None:
                dropped = 0 if head >= cut else until_answered(
                    lambda: self._count_dropped(partition, head, cut),
                    f"queue {self.queue_id}: counting {self.topic}[{partition}] from {head} to {cut}",
                    stopping=self._stopping)
                audit = CleanAudit(self.kind, self.queue_id, request.request_id, partition, APPLYING, head, cut,
                                   dropped or 0, request.issued_by, request.issued_at, self.member_id, now_ms)
                self._write_audit(audit)
            if head < cut:
                self._remove_below(part, cut, audit.dropped)
            audit = CleanAudit(**{**audit.to_record(), "state": APPLIED, "applied_by": self.member_id,
                                  "applied_at": int(time.time() * 1000)})
            self._write_audit(audit)
            log.warning("queue %s[%d]: clean start %s applied: %d events dropped (offsets %d to %d), asked by %s",
                        self.queue_id, partition, request.request_id, audit.dropped, audit.head_offset, cut - 1,
                        request.issued_by or "?",
                        extra={"queue_kind": self.kind, "queue_id": self.queue_id, "partition": partition,
                               "clean_request": request.request_id, "dropped": audit.dropped})
        # Whatever this member read below the cut before the request came is forgotten, never dispatched.
        # An event at or after the cut in a batch that went out (a start raced the request) stays, flagged.
        for batch in part.batcher.out:
            flag_possible_duplicates(batch)
        forgotten = part.batcher.drop_below(cut, int(time.time() * 1000))
        if forgotten:
            self.partitions_released([partition])  # a sender forgets the batches it had sent of them
        part.head = max(part.head, cut)
        part.last_removed_offset = max(part.last_removed_offset, cut - 1)
        self._clean_applied.add(partition)
        part.clean_due = False
        self._skip_to(part, cut)

    def _head_for_clean(self, part: QueuePartition) -> int:
        """The first offset of the partition not removed: the highest of what this member knows, the group's
        committed offset and the removals record (a removal written before a crash ahead of its commit)."""
        consumer = self._consumer
        assert consumer is not None
        tp = part.tp
        heads = [part.head]
        committed = until_answered(lambda: consumer.committed([TopicPartition(tp.topic, tp.partition)],
                                                                    timeout=OFFSETS_REQUEST_DEADLINE_S),
                                   f"queue {self.queue_id}: reading the committed offset of {tp.topic}[{tp.partition}]",
                                   stopping=self._stopping)
        heads += [c.offset for c in committed if c.error is None]
        removal = until_answered(lambda: self._read_removal(tp.partition),
                                 f"queue {self.queue_id}: reading {self.removals_topic}", stopping=self._stopping)
        if removal is not None:
            heads.append(removal["last_removed_offset"] + 1)
        head = max(heads)
        if head < 0:  # nothing removed, nothing committed, nothing read: the partition's start
            head = int(until_answered(lambda: consumer.get_watermark_offsets(tp, timeout=OFFSETS_REQUEST_DEADLINE_S),
                                      f"queue {self.queue_id}: reading the start of {tp.topic}[{tp.partition}]",
                                      stopping=self._stopping)[0])
        return head

    def _clean_reader(self) -> Consumer:
        return make_consumer(self.cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10,
                                                                        "client.id": f"{self.member_id}-clean"})

    def _read_removal(self, partition: int) -> dict[str, Any] | None:
        reader = self._clean_reader()
        found = None
        try:
            for msg in read_to_end(reader, self.removals_topic):
                if msg.key() == str(partition).encode() and msg.value() is not None:
                    try:
                        found = self._codec.decode_as("RemovalRecord", msg.value())
                    except CodecError:
                        continue
        finally:
            reader.close()
        return found

    def _read_clean_audits(self, request_id: str) -> list[CleanAudit]:
        reader = self._clean_reader()
        try:
            return read_audits(reader, self.status_topic, self.kind, self.queue_id, request_id)
        finally:
            reader.close()

    def _count_dropped(self, partition: int, head: int, cut: int) -> int:
        """The events between head and cut (progress logged every 5 s of a long count)."""
        reader = self._clean_reader()
        logged = [time.monotonic()]

        def progress(counted: int) -> None:
            if time.monotonic() - logged[0] >= 5:
                logged[0] = time.monotonic()
                log.info("queue %s[%d]: counting the events a clean start drops: %d so far", self.queue_id,
                         partition, counted)
        try:
            counted = count_events(reader, self.topic, partition, head, cut, progress=progress)
        finally:
            reader.close()
        assert counted is not None
        return counted

    def _write_audit(self, audit: CleanAudit) -> None:
        produce_durably(self._producer, self.status_topic, encode_audit(audit),
                        audit_key(audit.kind, audit.queue_id, audit.request_id, audit.partition),
                        what=f"clean audit of {self.queue_id}[{audit.partition}]", stopping=self._stopping)

    def _remove_below(self, part: QueuePartition, cut: int, dropped: int) -> None:
        """The clean's removal: the partition's removal record at cut - 1, durable, then the group offset."""
        partition = part.tp.partition
        # The clean takes a batch id of its own, in the partition's sequence (a sender's epoch goes on).
        batch_id = part.batcher.next_batch_id
        part.batcher.next_batch_id += 1
        value = removal_record(self._removal_header, self.queue_id, partition, batch_id, cut - 1, None, dropped,
                               int(time.time() * 1000))
        produce_durably(self._producer, self.removals_topic, value, str(partition).encode(),
                        what=f"clean removal of {self.queue_id}[{partition}]", stopping=self._stopping)
        consumer = self._consumer
        assert consumer is not None
        until_answered(lambda: consumer.commit(offsets=[TopicPartition(self.topic, partition, cut)],
                                               asynchronous=False),
                       f"queue {self.queue_id}: committing {self.topic}[{partition}]@{cut}", stopping=self._stopping)
        self.protocol.committed_at(partition, cut)

    def _skip_to(self, part: QueuePartition, cut: int) -> None:
        """Read on from the cut rather than through what the clean dropped (records below it are passed
        over either way: ``skip_below``)."""
        consumer = self._consumer
        if consumer is None:
            return
        try:
            with kafka_errors(f"moving the reader of {self.topic}[{part.tp.partition}]"):
                [position] = consumer.position([part.tp])
                if 0 <= position.offset < cut:
                    consumer.seek(TopicPartition(self.topic, part.tp.partition, cut))
        except SluiceError as exc:
            log.debug("queue %s[%d]: not moved to %d (%s); the records below are passed over as read",
                      self.queue_id, part.tp.partition, cut, exc)


__all__ = ["APPLIED", "APPLYING", "AUDIT_KEY_PREFIX", "CleanAudit", "CleanRequest", "QueueCleaning", "audit_key",
           "count_events", "encode_audit", "read_audits"]
