"""Fan-out of applied events: the changelog record first, then the queues.

The story of one write, step by step:

1. The owner of the bucket prepares the event (``state.py``) and produces it
   to the region changelog, partition = bucket.  The changelog is the
   write-ahead truth: an operation is applied when its record is durable.
2. When the broker acknowledges the changelog record (delivery report, in
   partition order because the producer is idempotent), its offset is known
   and the event is produced to every attached queue that takes it.  So no
   queue ever holds an event whose changelog record is not durable.
3. When every queue record of the event is acknowledged, the request's
   ``Pending`` counts it done; the caller is answered when all its events are.
4. Per bucket, ``BucketProgress`` keeps the fan-out checkpoint: the changelog
   offset below which every record reached every queue.  It is committed as
   the consumer-group offset of the changelog partition.  A new owner re-enqueues
   everything from that offset on, marked possibleDuplicate; consumers drop
   the repeats by EventID.

A queue record is a ``QueuedEvent``.  Its Avro body is the queue fields
followed by the ``EntryEvent`` body, so it is built by prefixing the
changelog record's body instead of encoding the event a second time.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..core.eventwire import FLAG_POSSIBLE_DUPLICATE, entry_event_body, string, varint
from ..core.codec import HEADER_BYTES, MARKER, Codec
from ..core.errors import SluiceError
from ..core.events import EntryEvent, Operation, goes_to_async_queue, goes_to_gateway
from ..core.kafka import KafkaError, Message, Producer, error_from_kafka_error, murmur2, partition_for_key


# Avro primitives, shared with the hand-written EntryEvent encoder.
_varint = varint
_avro_string = string


@dataclass(frozen=True, slots=True)
class QueueTarget:
    """One attached queue: where and whether an event of a region goes."""

    id: str
    topic: str
    kind: str  # "gateway-sender" | "async-event-queue"
    parallel: bool
    partitions: int
    order_policy: str
    forward_expiration_destroy: bool = False
    #: A gateway sender's before_enqueue filters and substitution filter:
    #: (event, queue partition) -> the event to queue, or None to keep it out.
    enqueue: Callable[[EntryEvent, int], EntryEvent | None] | None = None

    def accepts(self, op: Operation) -> bool:
        if self.kind == "gateway-sender":
            return goes_to_gateway(op)
        return goes_to_async_queue(op, self.forward_expiration_destroy)

    def partition_for(self, event: EntryEvent, key_bytes: bytes) -> int:
        """Parallel: the bucket.  Serial: by the order policy."""
        if self.parallel:
            return event.bucket
        if self.order_policy == "THREAD":
            stream = f"{event.event_id.member_id}:{event.event_id.thread_id}".encode()
            return partition_for_key(stream, self.partitions)
        if self.order_policy == "PARTITION":
            return event.bucket % self.partitions
        return partition_for_key(key_bytes, self.partitions)


class Pending:
    """Completion of one request: outstanding records, first error, callback.

    Records are added by the caller's thread while delivery reports of the
    same request already arrive in the poll thread, so the counter is locked.
    ``on_done(error_or_None)`` is called exactly once, after ``arm()`` and
    when nothing is outstanding; then every chained dependent counts one done.
    """

    __slots__ = ("remaining", "error", "on_done", "armed", "fired", "dependents", "_lock")

    def __init__(self, on_done: Callable[[SluiceError | None], None]) -> None:
        self.remaining = 0
        self.error: SluiceError | None = None
        self.on_done = on_done
        self.armed = False
        self.fired = False
        self.dependents: list[Pending] = []
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.remaining += n

    def arm(self) -> None:
        """All records are produced; fire when they are all acknowledged."""
        with self._lock:
            self.armed = True
        self._maybe_fire()

    def done(self, n: int = 1) -> None:
        with self._lock:
            self.remaining -= n
        self._maybe_fire()

    def fail(self, error: SluiceError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self.remaining -= 1
        self._maybe_fire()

    def then(self, dependent: "Pending") -> None:
        """Count one done on ``dependent`` once this fires (now, if it has)."""
        dependent.add(1)
        with self._lock:
            if not self.fired:
                self.dependents.append(dependent)
                return
        if self.error is not None:
            dependent.fail(self.error)
        else:
            dependent.done()

    def _maybe_fire(self) -> None:
        with self._lock:
            if not self.armed or self.remaining > 0 or self.fired:
                return
            self.fired = True
            dependents = self.dependents
        self.on_done(self.error)
        for d in dependents:
            # A retry answered through this attempt learns its failure too.
            if self.error is not None:
                d.fail(self.error)
            else:
                d.done()


class BucketProgress:
    """The fan-out checkpoint of one owned bucket.

    ``inflight`` holds ``[changelog offset, queue records outstanding]`` in
    offset order (delivery reports of one partition arrive in order).  The
    checkpoint is the offset of the oldest record still outstanding, or one
    past the newest when none is.
    """

    __slots__ = ("checkpoint", "inflight", "failed")

    def __init__(self, checkpoint: int) -> None:
        self.checkpoint = checkpoint
        self.inflight: collections.deque[list[int]] = collections.deque()
        self.failed = False

    def opened(self, offset: int, outstanding: int) -> list[int]:
        slot = [offset, outstanding]
        self.inflight.append(slot)
        if outstanding == 0:
            self._advance()
        return slot

    def closed_one(self, slot: list[int]) -> None:
        slot[1] -= 1
        if slot[1] == 0:
            self._advance()

    def _advance(self) -> None:
        inflight = self.inflight
        while inflight and inflight[0][1] <= 0:
            self.checkpoint = inflight.popleft()[0] + 1


class FanoutWriter:
    """Produces changelog records and, once each is durable, its queue records."""

    def __init__(
        self,
        producer: Producer,
        codec: Codec,
        changelog_topics: dict[str, str],
        targets: dict[str, list[QueueTarget]],
        on_bucket_failure: Callable[[str, int, SluiceError], None],
    ) -> None:
        self._producer = producer
        self._codec = codec
        self._changelog_topics = changelog_topics
        self._targets = targets
        self._on_bucket_failure = on_bucket_failure
        self._queued_fp = MARKER + codec.fingerprint("QueuedEvent")
        self._entry_fp = MARKER + codec.fingerprint("EntryEvent")
        self._queue_id_bytes = {
            t.id: _avro_string(t.id) for ts in targets.values() for t in ts
        }
        # Changelog records produced and not yet reported, per bucket: a reload
        # must not read a changelog that records of ours may still land in.
        self._unreported: collections.Counter[tuple[str, int]] = collections.Counter()
        self._reported = threading.Condition()

    def unreported(self, region: str, bucket: int) -> int:
        """Changelog records of the bucket produced and not yet reported."""
        with self._reported:
            return self._unreported[(region, bucket)]

    def wait_reported(self, region: str, bucket: int, timeout_s: float) -> bool:
        """Wait until every changelog record of the bucket produced so far was
        reported (delivered or failed for good); False if ``timeout_s`` passed first."""
        with self._reported:
            return self._reported.wait_for(lambda: self._unreported[(region, bucket)] <= 0, timeout_s)

    def _changelog_reported(self, where: tuple[str, int]) -> None:
        with self._reported:
            self._unreported[where] -= 1
            if self._unreported[where] <= 0:
                del self._unreported[where]
                self._reported.notify_all()

    def write(self, event: EntryEvent, pending: Pending, progress: BucketProgress,
              headers: list[tuple[str, bytes]] | None = None) -> None:
        """Step 1: the changelog record.  Called in bucket order by the owner.
        ``headers`` (the event's trace context) go on the changelog and queue records."""
        key_bytes = event.key.encode("utf-8")
        value = self._entry_fp + entry_event_body(event)
        targets = [t for t in self._targets.get(event.region, ()) if t.accepts(event.operation)]
        pending.add(1 + len(targets))
        where = (event.region, event.bucket)

        def on_changelog(err: KafkaError | None, msg: Message) -> None:
            self._changelog_reported(where)
            if err is not None:
                failure = error_from_kafka_error(err, f"writing the changelog of {event.region}[{event.bucket}]")
                progress.failed = True
                pending.fail(failure)
                pending.done(len(targets))
                self._on_bucket_failure(event.region, event.bucket, failure)
                return
            pending.done()
            self._fan_out(event, key_bytes, value, msg.offset(), targets, pending, progress, headers)

        with self._reported:
            self._unreported[where] += 1
        try:
            self._produce(self._changelog_topics[event.region], key_bytes, value, event.bucket, on_changelog,
                          headers)
        except BaseException:
            self._changelog_reported(where)
            raise

    def refanout(self, event: EntryEvent, offset: int, pending: Pending, progress: BucketProgress) -> None:
        """Re-enqueue a changelog record after a change of owner (possibleDuplicate)."""
        event = event.as_possible_duplicate()
        key_bytes = event.key.encode("utf-8")
        value = self._entry_fp + entry_event_body(event)
        targets = [t for t in self._targets.get(event.region, ()) if t.accepts(event.operation)]
        pending.add(len(targets))
        self._fan_out(event, key_bytes, value, offset, targets, pending, progress)

    def _fan_out(
        self,
        event: EntryEvent,
        key_bytes: bytes,
        changelog_value: bytes,
        offset: int,
        targets: list[QueueTarget],
        pending: Pending,
        progress: BucketProgress,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Step 2: the queue records of one durable changelog record."""
        slot = progress.opened(offset, len(targets))
        if not targets:
            return
        body = changelog_value[HEADER_BYTES:]
        now_ms = int(time.time() * 1000)
        tail = _varint(event.bucket) + _varint(offset) + _varint(now_ms) + body
        # QueuedEvent's leading flags, read by the queue's readers without decoding the event.
        flags = _varint(FLAG_POSSIBLE_DUPLICATE if event.possible_duplicate else 0)

        def on_queue(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failure = error_from_kafka_error(err, f"writing queue {msg.topic()}")
                progress.failed = True
                pending.fail(failure)
                self._on_bucket_failure(event.region, event.bucket, failure)
                return
            progress.closed_one(slot)
            pending.done()

        for target in targets:
            partition = target.partition_for(event, key_bytes)
            if target.enqueue is None:
                value = self._queued_fp + flags + self._queue_id_bytes[target.id] + tail
            else:
                queued = target.enqueue(event, partition)
                if queued is None:  # a before_enqueue filter kept it out of this queue
                    progress.closed_one(slot)
                    pending.done()
                    continue
                own_tail = tail if queued is event else (
                    _varint(event.bucket) + _varint(offset) + _varint(now_ms) + entry_event_body(queued))
                value = self._queued_fp + flags + self._queue_id_bytes[target.id] + own_tail
            self._produce(target.topic, key_bytes, value, partition, on_queue, headers)

    def _produce(self, topic: str, key: bytes, value: bytes, partition: int, cb: Any,
                 headers: list[tuple[str, bytes]] | None = None) -> None:
        while True:
            try:
                if headers is None:
                    self._producer.produce(topic, value, key, partition=partition, on_delivery=cb)
                else:
                    self._producer.produce(topic, value, key, partition=partition, on_delivery=cb, headers=headers)
                return
            except BufferError:
                # Back-pressure: the local queue is full.  Serve delivery
                # reports (which may produce more) until there is room.
                self._producer.poll(0.05)


__all__ = ["BucketProgress", "FanoutWriter", "Pending", "QueueTarget", "murmur2"]
