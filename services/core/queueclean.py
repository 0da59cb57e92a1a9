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

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .codec import get_codec
from .errors import BrokerUnavailable, CodecError
from .kafka import KafkaError, TopicPartition, consumed_position, read_to_end

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


__all__ = ["APPLIED", "APPLYING", "AUDIT_KEY_PREFIX", "CleanAudit", "CleanRequest", "audit_key", "count_events",
           "encode_audit", "read_audits"]
