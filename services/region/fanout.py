"""The write path of a bucket owner: records, group-commit windows, Kafka transactions.

The story of one write, step by step:

1. The owner of the bucket prepares the event (``state.py``) under the
   engine's lock, in the order it accepts operations, and builds its records
   at once (``RecordBuilder``): the changelog record (partition = bucket)
   and a ``QueuedEvent`` for every attached queue that takes the operation
   and lets the event in.  A gateway sender's loop check (the event came from
   that sender's remote site, or has visited it) and its before_enqueue
   filters run here; the records of a gateway queue carry the "routed" flag,
   so the sender need not look inside the event.  The records join the open
   ``Window`` in that order, and the request's ``Pending`` waits on it.
2. The engine's committer thread closes the window as soon as the one before
   it is committed (group commit: whatever arrived while a transaction was
   being committed goes into the next one) and writes it as one Kafka
   transaction (``WindowWriter``): begin; produce every record, without
   delivery callbacks; flush, taking into the transaction the window
   accepted while its records are acknowledged (the first records of a
   transaction wait until the coordinator has written the markers of the
   previous one, so concurrent requests share a transaction rather than
   queueing one behind the other); send each bucket's checkpoint as the region
   consumer group's offset of its changelog partition, with the group
   metadata of the generation that assigned the buckets
   (``send_offsets_to_transaction``, KIP-447); commit.
3. Committed: the window's changelog records, their queue records and the
   offsets become visible to read_committed readers together.  Each
   request's ``Pending`` counts its window done; the caller is answered when
   all of it is committed.
4. Failed: nothing of the window becomes visible (aborted, or never
   written).  Its requests are answered with a retriable error and its
   buckets are reloaded from the changelog (their memory is ahead of it).  A
   retry keeps its EventIDs, so whichever attempt committed, the bucket's
   duplicate tracking answers the others.

Fencing.  The group coordinator refuses a transaction's offsets from a
member that is no longer in the generation that assigned it the bucket, and
the transaction is then aborted: a paused owner that resumes after losing
its buckets commits nothing.  A transaction whose offsets were accepted
before the session expired may still commit; a new owner's load waits for it
(engine.py: committed offsets stable, then no transaction open on the
partition), so whatever it commits is read before the new owner writes.

The checkpoint.  A changelog written this way needs no fan-out checkpoint:
its queue records commit with it.  One written before (by an owner that
wrote the changelog first and the queues after it) may hold records past its
checkpoint (the group's committed offset) whose queue records are missing.
So the offset a window commits for a bucket is the point from which its
changelog is transactional (where the owner's load ended), marked
``TRANSACTIONAL_CHECKPOINT`` in the offset's metadata.  A load re-enqueues
(possibleDuplicate) the records from an unmarked checkpoint on, in one
transaction that commits the marked one; from a marked checkpoint, nothing.

A queue record's ``changelog_offset`` is -1 when it is written in the same
transaction as its changelog record: that offset is known only from the
changelog record's delivery report, and waiting for it would cost a
per-record callback and a round trip more per window.  The event's EventID
identifies the write; a re-enqueued record carries its changelog offset.  A
wan-copy's records (``RecordBuilder.copied``, wancopy.py) are queue records
alone, for one gateway sender, with -1 too: they copy an entry's last write,
which its EventID and version tag identify.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..core.codec import Codec
from ..core.framing import Frames
from ..core.errors import (
    BrokerUnavailable,
    KafkaCallFailed,
    KafkaFatal,
    OwnershipUnconfirmed,
    SluiceError,
    TransactionAbortable,
)
from ..core.events import EntryEvent, Operation, goes_to_async_queue, goes_to_gateway
from ..core.eventwire import (
    FLAG_NO_CALLBACKS,
    FLAG_POSSIBLE_DUPLICATE,
    FLAG_ROUTED,
    entry_event_body,
    queued_event,
    string,
    varint,
)
from ..core.kafka import (
    GROUP_FENCING,
    KafkaError,
    Producer,
    TopicPartition,
    consumer_group_generation,
    kafka_errors,
    murmur2,
    partition_for_key,
)

# Avro primitives, shared with the hand-written EntryEvent encoder.
_varint = varint
_avro_string = string

#: A bucket: (region, bucket).
Where = tuple[str, int]
#: A bucket and the epoch of this instance's ownership of it: (region, bucket, epoch).
Slot = tuple[str, int, int]
#: The metadata of a changelog partition's committed offset from which its records and their queue
#: records were written in transactions (the module docstring's "checkpoint").
TRANSACTIONAL_CHECKPOINT = "sluice:transactional"
#: How long past its own timeout a coordinator call of the producer may take before it is taken for
#: wedged (``WindowWriter``).
CALL_GRACE_S = 5.0
#: One record to produce: topic, partition, key, value, headers.
Record = tuple[str, int, bytes, bytes, "list[tuple[str, bytes]] | None"]
#: While a window's records are being acknowledged, how often the writer looks for records accepted
#: since it was closed, to write them in the same transaction (``WindowWriter.write``).
ABSORB_POLL_S = 0.002
#: How long after its start a transaction still takes in records accepted since its window was closed.
ABSORB_FOR_S = 0.2


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
    #: A gateway sender's remote site: events from it, or that visited it, are not queued.
    remote_dsid: int | None = None

    def accepts(self, op: Operation) -> bool:
        if self.kind == "gateway-sender":
            return goes_to_gateway(op)
        return goes_to_async_queue(op, self.forward_expiration_destroy)

    def loops_back(self, event: EntryEvent) -> bool:
        """A gateway sender never sends an event to the site it came from or already visited (Geode)."""
        return self.remote_dsid is not None and (
            event.origin_dsid == self.remote_dsid or self.remote_dsid in event.visited_dsids)

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
    """Completion of one request: outstanding windows, first error, callback.

    A request counts one for each window its records joined, and one for
    each earlier attempt of the same EventID it waits for (``then``).
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
        """Everything is counted; fire when it is all done."""
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


class RecordBuilder:
    """The records of an applied event: its changelog record and its queue records (step 1)."""

    def __init__(self, codec: Codec, changelog_topics: dict[str, str], targets: dict[str, list[QueueTarget]],
                 frames: Frames | None = None) -> None:
        self._changelog_topics = changelog_topics
        frames = frames or Frames(codec)
        # The site's own header per topic (core/framing.py): another site's event body is written
        # under it as it came, whichever framing that site uses.  Confluent ids are registered here, on start.
        queue_topics = sorted({t.topic for ts in targets.values() for t in ts})
        frames.check_writes({"EntryEvent": changelog_topics.values(), "QueuedEvent": queue_topics})
        self._entry_headers = {topic: frames.header("EntryEvent", topic) for topic in changelog_topics.values()}
        self._queued_headers = {topic: frames.header("QueuedEvent", topic) for topic in queue_topics}
        #: Region → each attached queue with the operations it takes (``QueueTarget.accepts``, asked once
        #: per operation here rather than once per event) and whether it is a gateway sender's.
        self._routes = {region: [(t, frozenset(op for op in Operation if t.accepts(op)), t.kind == "gateway-sender")
                                 for t in ts] for region, ts in targets.items()}

    def records(self, event: EntryEvent, headers: list[tuple[str, bytes]] | None = None,
                body: bytes | None = None, generate_callbacks: bool = True) -> tuple[Record, list[Record]]:
        """The changelog record and the queue records of a new event.  ``headers`` (its trace
        context) go on every record; ``body``, when given, is the event's EntryEvent body (another
        site's event as it came: spliced, not encoded again).  ``generate_callbacks`` False (another
        site's wan-copy): the changelog record alone, queued nowhere."""
        key = event.key.encode("utf-8")
        if body is None:
            body = entry_event_body(event)
        topic = self._changelog_topics[event.region]
        changelog = (topic, event.bucket, key, self._entry_headers[topic] + body, headers)
        if not generate_callbacks:
            return changelog, []
        return changelog, self._queued(event, key, body, -1, headers)

    def requeued(self, event: EntryEvent, offset: int) -> list[Record]:
        """The queue records of a changelog record at ``offset`` queued again after a change of
        owner, marked possibleDuplicate."""
        event = event.as_possible_duplicate()
        key = event.key.encode("utf-8")
        return self._queued(event, key, entry_event_body(event), offset, None)

    def copied(self, event: EntryEvent, target: QueueTarget) -> Record | None:
        """The record of an entry copied into one gateway sender's queue (wan-copy: ``wancopy.py``), or
        None when one of the sender's before_enqueue filters keeps it out.  ``event`` is the entry as a
        possibleDuplicate event of this site; the caller has left out what the loop check would (an
        entry the sender's remote site wrote), and nothing of it goes to the changelog or other queues."""
        key = event.key.encode("utf-8")
        # Flagged no callbacks: the remote site applies it and fires none (Geode's generateCallbacks false).
        return self._record(target, event, key, entry_event_body(event),
                            FLAG_POSSIBLE_DUPLICATE | FLAG_NO_CALLBACKS, -1, int(time.time() * 1000), None)

    def _queued(self, event: EntryEvent, key: bytes, body: bytes, offset: int,
                headers: list[tuple[str, bytes]] | None) -> list[Record]:
        out: list[Record] = []
        routes = self._routes.get(event.region)
        if not routes:
            return out
        now_ms = int(time.time() * 1000)
        flags = FLAG_POSSIBLE_DUPLICATE if event.possible_duplicate else 0
        operation = event.operation
        for target, takes, gateway in routes:
            if operation not in takes:
                continue
            if gateway and target.loops_back(event):
                continue
            record = self._record(target, event, key, body, flags, offset, now_ms, headers)
            if record is not None:
                out.append(record)
        return out

    def _record(self, target: QueueTarget, event: EntryEvent, key: bytes, body: bytes, flags: int, offset: int,
                now_ms: int, headers: list[tuple[str, bytes]] | None) -> Record | None:
        """The event's record in ``target``'s queue (None: a before_enqueue filter kept it out)."""
        if target.kind == "gateway-sender":
            flags |= FLAG_ROUTED
        partition = target.partition_for(event, key)
        if target.enqueue is not None:
            queued = target.enqueue(event, partition)
            if queued is None:  # a before_enqueue filter kept it out of this queue
                return None
            if queued is not event:
                body = entry_event_body(queued)
        return (target.topic, partition, key,
                queued_event(self._queued_headers[target.topic], flags, target.id, event.bucket, offset, now_ms, body), headers)


@dataclass(slots=True)
class Window:
    """One group-commit window: the records of the operations accepted since the last window was
    closed, in the order they were accepted, and the requests waiting for them.

    Records are tagged with their ``Slot``: the bucket and the epoch of its
    ownership they were prepared under, so that records of an ownership that
    ended before the window is written (lost, revoked, reloaded) are told
    from those of the current one and left out."""

    #: (record, slot) in acceptance order: per-partition order is bucket order, and a client
    #: thread's operations keep their order in every queue partition.
    records: list[tuple[Record, Slot]] = field(default_factory=list)
    #: Every slot written, in first-write order, with the checkpoint its offsets commit.
    checkpoints: dict[Slot, int] = field(default_factory=dict)
    #: Each waiting request and the slots it wrote.
    waiting: list[tuple[Pending, frozenset[Slot]]] = field(default_factory=list)
    #: Slot → the index in ``records`` of its last changelog record (``WindowOutcome.last_offsets``).
    last_changelog: dict[Slot, int] = field(default_factory=dict)
    opened_at: float = 0.0
    #: Windows taken into this one while it was being written (``absorb``).
    absorbed: int = 0

    def empty(self) -> bool:
        return not self.checkpoints and not self.waiting

    def add(self, slot: Slot, checkpoint: int, changelog: Record | None, queued: list[Record]) -> None:
        """The records of one event of ``slot``'s bucket, whose offset commits ``checkpoint``."""
        if not self.checkpoints:
            self.opened_at = time.monotonic()
        self.checkpoints[slot] = checkpoint
        records = self.records
        if changelog is not None:
            self.last_changelog[slot] = len(records)
            records.append((changelog, slot))
        for record in queued:
            records.append((record, slot))

    def absorb(self, later: "Window") -> None:
        """Take ``later``'s records (after this window's, in their order), checkpoints and waiting
        requests: one window, written as one transaction."""
        base = len(self.records)
        self.records.extend(later.records)
        self.checkpoints.update(later.checkpoints)
        for slot, i in later.last_changelog.items():
            self.last_changelog[slot] = base + i
        self.waiting.extend(later.waiting)
        self.absorbed += 1 + later.absorbed


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """What writing a window did: the checkpoints committed, or why nothing was."""

    #: Slot → the checkpoint committed with the window (every slot written), when it committed.
    committed: dict[Slot, int] | None = None
    #: Slot → the offset of the window's last changelog record of the slot's bucket, when it committed.
    last_offsets: dict[Slot, int] = field(default_factory=dict)
    error: SluiceError | None = None
    #: The producer is unusable (fenced, or its transaction timed out): build a new one.
    producer_broken: bool = False
    #: ... and one of its calls never returned: it cannot even be closed (``WindowWriter``).
    producer_wedged: bool = False
    #: The group refused the window's offsets: the generation it was written under had ended (a
    #: rebalance), and the window was aborted.
    stale_generation: bool = False


class _Wedged(Exception):
    """A transactional call of the producer did not return within its timeout and a grace."""


class _Caller:
    """One daemon thread making the calls it is handed, in order (a thread pool's workers are joined
    when the interpreter exits, and one blocked for ever would keep the process from exiting)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None] \
            = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((future, call, args))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, call, args = item
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # handed to the caller, which raises it
                future.set_exception(exc)


class WindowWriter:
    """Writes one window as one Kafka transaction (step 2 of the module docstring).

    Owned by the committer thread: the producer's transactional calls
    block, and only one transaction of a producer may be open at a time.

    The calls that wait on a coordinator (``send_offsets_to_transaction``,
    ``commit_transaction``, ``abort_transaction``) are made from a thread of
    the writer's and waited for with their timeout and ``CALL_GRACE_S``:
    librdkafka 2.x may not return from them at all when the group
    coordinator it cached is gone (a broker restarted: librdkafka issues
    5456 and 5511).  Such a window fails, and its outcome says the producer
    is wedged: the engine leaves it as it is (closing it would wait on the
    same call) and builds a new one under the same transactional.id, whose
    ``init_transactions`` fences the wedged one and aborts its transaction.
    """

    def __init__(self, producer: Producer, changelog_topics: dict[str, str], timeout_s: float) -> None:
        self.producer = producer
        self._changelog_topics = changelog_topics
        self._timeout_s = timeout_s
        self._calls = self._new_caller()
        self._writing = kafka_errors("writing a window of the region's records")

    @staticmethod
    def _new_caller() -> _Caller:
        return _Caller("region-txn-call")

    def replace_producer(self, producer: Producer | None, wedged: bool) -> None:
        """Write with ``producer`` from now on; after a wedged call, from a new calling thread too (the
        old one stays blocked in the wedged producer)."""
        if wedged:
            self._calls.stop()
            self._calls = self._new_caller()
        self.producer = producer  # type: ignore[assignment]

    def close(self) -> None:
        self._calls.stop()

    def _bounded(self, call: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``call(*args, timeout_s)`` from the calling thread, its exceptions raised here; ``_Wedged``
        when it has not returned ``CALL_GRACE_S`` after its timeout."""
        future = self._calls.submit(call, *args, timeout_s)
        try:
            return future.result(timeout=timeout_s + CALL_GRACE_S)
        except concurrent.futures.TimeoutError:
            raise _Wedged(f"{getattr(call, '__name__', 'a transactional call')} did not return "
                          f"{CALL_GRACE_S:g} s after its timeout of {timeout_s:.1f} s") from None

    def write(self, window: Window, skip: set[Slot], group_metadata: bytes | None,
              absorb: Callable[[Window], Window | None] | None = None) -> WindowOutcome:
        """Write the window's records of every slot but those in ``skip`` (ownerships that ended
        since they were prepared), their checkpoints as the offsets of ``group_metadata``'s group.

        While the records are being acknowledged (the first of a transaction
        wait for the coordinator to register their partitions, which it does
        only once the markers of the previous transaction are written), the
        writer asks ``absorb(window)`` for the window accepted since this one
        was closed, for ``ABSORB_FOR_S`` at most: what it answers joins this
        window (``Window.absorb``) and this transaction, rather than waiting
        for a transaction of its own.  ``absorb`` answers only records
        prepared under the same generation, of ownerships that are current.

        Never raises for Kafka's reasons: a failed window is aborted here and
        its outcome says why (``error``) and whether the producer must be
        rebuilt.
        """
        if not any(slot not in skip for slot in window.checkpoints):
            return WindowOutcome(committed={})
        generation, member = consumer_group_generation(group_metadata) if group_metadata is not None else (-1, "")
        if generation < 0 or not member:
            # Offsets without a generation are not checked against the group
            # (KIP-447 keeps that for old clients): never write without one.
            return WindowOutcome(error=OwnershipUnconfirmed("this instance holds no generation of the group"))
        began = time.monotonic()
        deadline = began + self._timeout_s
        producer = self.producer
        started = False
        # The last changelog record of each slot is produced with a delivery callback: its offset says
        # where the bucket's changelog ends once the window's marker follows it (engine.Parked).
        last_offsets: dict[Slot, int] = {}

        def delivered(slot: Slot) -> Callable[[KafkaError | None, Any], None]:
            def report(error: KafkaError | None, msg: Any) -> None:
                # An absorbed window's last record of a slot comes after the one reported before it.
                if error is None and msg.offset() > last_offsets.get(slot, -1):
                    last_offsets[slot] = msg.offset()
            return report

        try:
            with self._writing:
                producer.begin_transaction()
                started = True
                self._produce_from(window, 0, skip, deadline, delivered)
                # Every record acknowledged before the offsets go: send_offsets_to_transaction with records
                # still in flight after a broker restart was seen to wait far past its timeout.
                remaining = self._flush(window, skip, deadline, delivered, absorb, began)
                if remaining:
                    return self._abort(BrokerUnavailable(
                        f"{remaining} records of the window not acknowledged in {self._timeout_s:g} s"))
                committed = {slot: checkpoint for slot, checkpoint in window.checkpoints.items() if slot not in skip}
                offsets = [TopicPartition(self._changelog_topics[region], bucket, checkpoint,
                                          metadata=TRANSACTIONAL_CHECKPOINT)
                           for (region, bucket, _), checkpoint in committed.items()]
                self._bounded(producer.send_offsets_to_transaction, offsets, group_metadata,
                              timeout_s=max(0.1, deadline - time.monotonic()))
                self._commit(deadline)
            return WindowOutcome(committed=committed, last_offsets=last_offsets)
        except _Wedged as exc:
            return WindowOutcome(error=BrokerUnavailable(f"writing a window of the region's records: {exc}"),
                                 producer_broken=True, producer_wedged=True)
        except KafkaCallFailed as exc:
            group_fenced = exc.code in GROUP_FENCING
            if group_fenced:
                error: SluiceError = OwnershipUnconfirmed(
                    f"the group refused the window's offsets ({exc}): the buckets moved")
                error.__cause__ = exc
            else:
                error = exc
                error.retriable = True  # a failed window changed nothing: the callers may retry
            if isinstance(exc, KafkaFatal):
                return WindowOutcome(error=error, producer_broken=True)
            if not started and not isinstance(exc, TransactionAbortable):
                return WindowOutcome(error=error, producer_broken=True)
            outcome = self._abort(error)
            return replace(outcome, stale_generation=group_fenced)

    def _produce_from(self, window: Window, start: int, skip: set[Slot], deadline: float,
                      delivered: Callable[[Slot], Callable[[KafkaError | None, Any], None]]) -> None:
        """Produce the window's records from index ``start`` on, but those of a slot in ``skip``."""
        last_of = {i: slot for slot, i in window.last_changelog.items() if i >= start and slot not in skip}
        produce = self._produce
        records = window.records
        for i in range(start, len(records)):
            record, slot = records[i]
            if slot not in skip:
                at = last_of.get(i)
                produce(record, deadline, None if at is None else delivered(at))

    def _flush(self, window: Window, skip: set[Slot], deadline: float,
               delivered: Callable[[Slot], Callable[[KafkaError | None, Any], None]],
               absorb: Callable[[Window], Window | None] | None, began: float) -> int:
        """Wait until every record produced is acknowledged (or the deadline); the records it leaves.

        Meanwhile, for ``ABSORB_FOR_S`` from ``began``, the window accepted since is taken in: the
        flush runs in the writer's calling thread, one call for the whole wait (a flush keeps the
        producer sending at once, without its linger), while this thread looks for later windows every
        ``ABSORB_POLL_S`` and produces their records, which that flush waits for too.  A last flush here
        covers records produced just as it returned."""
        producer = self.producer
        if absorb is not None:
            flushing = self._calls.submit(producer.flush, max(0.0, deadline - time.monotonic()))
            absorb_until = min(began + ABSORB_FOR_S, deadline)
            while time.monotonic() < absorb_until:
                concurrent.futures.wait([flushing], timeout=ABSORB_POLL_S)
                if flushing.done():
                    break
                later = absorb(window)
                if later is not None:
                    start = len(window.records)
                    window.absorb(later)
                    self._produce_from(window, start, skip, deadline, delivered)
            concurrent.futures.wait([flushing], timeout=max(0.0, deadline - time.monotonic()) + CALL_GRACE_S)
            if not flushing.done():
                raise _Wedged(f"flush did not return {CALL_GRACE_S:g} s after its timeout of {self._timeout_s:.1f} s")
            flushing.result()  # raises what the flush raised
        return producer.flush(max(0.0, deadline - time.monotonic()))

    def _produce(self, record: Record, deadline: float,
                 on_delivery: Callable[[KafkaError | None, Any], None] | None = None) -> None:
        topic, partition, key, value, headers = record
        producer = self.producer
        while True:
            try:
                if on_delivery is not None:
                    producer.produce(topic, value, key, partition=partition, headers=headers,
                                     on_delivery=on_delivery)
                elif headers is None:
                    producer.produce(topic, value, key, partition=partition)
                else:
                    producer.produce(topic, value, key, partition=partition, headers=headers)
                return
            except BufferError:
                # Back-pressure: the local queue is full; let the broker catch up, within the window's time.
                if time.monotonic() >= deadline:
                    raise BrokerUnavailable(f"{self._writing.what}: producer queue full",
                                            code=KafkaError._TIMED_OUT) from None
                producer.poll(0.05)

    def _commit(self, deadline: float) -> None:
        """commit_transaction, made again while its error is ``retriable`` and time is left (one that
        needs the transaction aborted, or is fatal, is not)."""
        while True:
            try:
                with self._writing:
                    self._bounded(self.producer.commit_transaction, timeout_s=max(0.1, deadline - time.monotonic()))
                return
            except KafkaCallFailed as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    raise

    def _abort(self, error: SluiceError) -> WindowOutcome:
        try:
            with self._writing:
                self._bounded(self.producer.abort_transaction, timeout_s=self._timeout_s)
        except KafkaCallFailed as exc:
            # An abort that fails leaves the transaction to the new producer's
            # init_transactions, which aborts it.
            error.__context__ = exc
            return WindowOutcome(error=error, producer_broken=True)
        except _Wedged:
            return WindowOutcome(error=error, producer_broken=True, producer_wedged=True)
        return WindowOutcome(error=error)


__all__ = ["TRANSACTIONAL_CHECKPOINT", "Pending", "QueueTarget", "Record", "RecordBuilder", "Slot", "Where", "Window", "WindowOutcome",
           "WindowWriter", "murmur2"]
