"""The primary loop of a queue: what async event queues and gateway senders share.

Every instance serving a queue joins the queue's consumer group; the members
assigned partitions are the primaries of those partitions, the others wait
as secondaries and take over when a primary crashes or leaves.

Three parts, each in its module: the partition loop (core/loop.py: the
consumer, its group callbacks, the bounded inbox from the workers, the status
timer, crash propagation), the protocol (core/queueprotocol.py: assignments
and outcomes in, offers, removals and commits out, no I/O, replayed in
tests/unit/test_queue_protocol.py), and this module, which performs the
protocol's actions: reading records, offering batches on worker threads,
writing removals and dead letters, committing, clean starts and status.

The story of a partition on its primary, step by step:

1. Records are read from the queue topic into ``AsyncEvent``s of their
   queued event bodies, undecoded (issue 18): only the QueuedEvent's leading
   ``flags`` are read (core/eventwire.py), and the event is decoded when
   something first touches a field that needs it.  A record that is not a
   QueuedEvent goes to the queue's dead-letter topic with the reason (flushed
   before anything after it can be committed) and delivery goes on.  An event
   is ``possible_duplicate`` when its flags say so (a new region owner queued
   it again) or when it lies below the partition's end offset at the moment
   of assignment (the previous primary may have delivered it).  ``accepts``
   may leave an event out (a sender does not send an event back to a site it
   came from); it is asked only about records the region did not mark
   ``routed``.
2. ``PartitionBatcher`` (core/batching.py) assembles batches by size or time
   and conflates updates when the queue says so.
3. ``deliver_group`` is called with the batches that are out (up to
   ``max_in_flight``, oldest first) on one of ``dispatcher_threads`` worker
   threads: an async event queue offers its one batch to its listener
   (``deliver``), a gateway sender writes several batches to the remote site
   and waits for their acks in order.  It answers how many batches, from the
   oldest, were delivered.  None: the very same batches are delivered again
   with exponential backoff (tenacity), forever, unless the queue is paused,
   stopped or the partition revoked; nothing after them goes first; and from
   the first failure on, every event of a batch that went out is flagged
   possibleDuplicate (``redelivering``), as Geode flags the events of a batch
   whose dispatch failed, so the listener or the remote site knows that part
   of it may have been applied.  An offer that raised is made again when
   its error is ``retriable`` (a listener's own exception is, as Geode
   offers a batch again whose ``processEvents`` threw: ``offered_again``);
   one that is not (a dead-letter topic that refuses writes, a fatal
   producer) stops the queue as crashed, the batch kept.  Events
   a listener can never take go to the dead-letter topic during the offer
   (``dead_letter_event``), durably, before the batch counts as delivered.
   So do events whose bodies turn out undecodable when first touched (by
   conflation at step 2, a listener, a sender's filters): the batch goes on
   without them (``dead_letter_undecodable``).
4. Delivered, oldest first: each batch's removal record (queue head) is
   written to the queue's compacted removals topic, and once it is durable
   the group offset is committed (the partitions whose heads moved in one
   turn of the loop, in one commit).  A crash anywhere before that only means
   the batch is delivered again, flagged possibleDuplicate.

``sluice admin`` steers the queue through the site's control topic (latest
record per queue wins: RUNNING, PAUSED, STOPPED); pause takes effect at a
batch boundary and loses nothing, the queue just grows.  A control record may
carry a clean start (``start --clean-queues``): each primary drops what its
partitions hold below the request's offsets through their removal records,
before it dispatches them again (core/queueclean.py tells that story).  The
primaries report per-partition status to the site's status topic every few
seconds.

Lifecycle (core/lifecycle.py)::

    NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                        └── a thread died ──► CRASHED (exit non-zero)
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import time
import uuid
from typing import Any, Callable

from tenacity import RetryCallState, Retrying, retry_if_exception
from tenacity.stop import stop_base

from . import telemetry
from .asyncevent import AsyncEvent, event_id_of, flag_possible_duplicates, undecodable
from .batching import Batch, BatchPolicy
from .codec import get_codec
from .framing import Frames, frames_for
from .config import SiteConfig
from .control import ControlFollower
from .errors import CodecError, DeliveryRefused, MalformedRecord, RegistryUnavailable, SluiceError, Stopping
from .events import EntryEvent, EventID
from .eventwire import (
    FLAG_NO_CALLBACKS,
    FLAG_POSSIBLE_DUPLICATE,
    FLAG_ROUTED,
    decode_entry,
    queued_flags_body,
    queued_flags_body_lean,
    queued_flags_body_py,
    read_queued,
    removal_record,
)
from .lifecycle import Service
from .loop import Inbox, PartitionLoop
from .queueprotocol import OfferDone, QueuePartition, QueueProtocol, Removal
from .queueclean import CleanRequest, QueueCleaning
from .kafka import (
    FLUSH_DEADLINE_S,
    OFFSETS_REQUEST_DEADLINE_S,
    Consumer,
    KafkaError,
    Message,
    TopicPartition,
    close_consumer,
    kafka_errors,
    make_consumer,
    make_producer,
    produce_durably,
    read_to_end,
    until_answered,
)

log = logging.getLogger("sluice.queue")

#: The longest an idle turn waits for records, and the wait while a batch or a removal is out (its
#: outcome comes through the inbox or the producer, neither of which wakes the consumer).
POLL_WAIT_IDLE_S = 0.05
POLL_WAIT_BUSY_S = 0.005
#: The wait after the first failed offer; it doubles up to ``QueuePrimary.backoff_max_s``.
BACKOFF_FIRST_S = 0.05
#: How long a revoke waits for the offers in flight on the revoked partitions to end, and each wait
#: for one of their outcomes.
REVOKE_DRAIN_DEADLINE_S = 30.0
REVOKE_INBOX_WAIT_S = 0.05

class DesiredState(str, enum.Enum):
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    STOPPED = "STOPPED"


class TracedEvent(AsyncEvent):
    """An ``AsyncEvent`` read while tracing: with the W3C ``traceparent`` its queue record carried."""

    __slots__ = ("_traceparent",)

    def __init__(self, event: EntryEvent, queue_id: str, partition: int, offset: int, possible_duplicate: bool,
                 traceparent: bytes | None = None) -> None:
        super().__init__(event, queue_id, partition, offset, possible_duplicate)
        self._traceparent = traceparent

    @classmethod
    def of_body(cls, body: bytes, queue_id: str, partition: int, offset: int, possible_duplicate: bool,
                traceparent: bytes | None = None) -> TracedEvent:
        self = super().of_body(body, queue_id, partition, offset, possible_duplicate)
        self._traceparent = traceparent
        return self  # type: ignore[return-value]

    @property
    def traceparent(self) -> bytes | None:
        return self._traceparent

    def _identity(self) -> tuple[Any, ...]:
        return (*super()._identity(), self._traceparent)


class CopiedEvent(AsyncEvent):
    """An entry wan-copy region queued for a gateway sender (QueuedEvent flag ``FLAG_NO_CALLBACKS``):
    the remote site applies it and fires no callbacks for it, as Geode's copied events carry
    generateCallbacks false.  It carries no trace context (the copy is no client's operation)."""

    __slots__ = ()
    generate_callbacks = False


def event_traceparent(event: AsyncEvent) -> bytes | None:
    return event.traceparent if isinstance(event, TracedEvent) else None


class QueuePrimary(QueueCleaning, Service):
    """The primary side of one queue (an async event queue or a gateway sender)."""

    status_interval_s = 2.0
    #: Records read per turn of the loop at most: each turn also dispatches, drains results and
    #: commits, once for all it read (a turn of 1000 takes ~2 ms of reading).
    read_max_records = 1000
    #: How often an idle loop asks where its consumer stands (``_cover_skipped_offsets``).
    gap_check_interval_s = 0.2
    backoff_max_s = 5.0
    #: "async-event-queue" or "gateway-sender": the key space in the control and status topics.
    kind = ""

    def __init__(self, cfg: SiteConfig, queue_id: str, settings: Any, *, member_id: str | None = None,
                 start_state: DesiredState = DesiredState.RUNNING) -> None:
        super().__init__()
        self.cfg = cfg
        self.queue = settings
        self.queue_id = queue_id
        self.member_id = member_id or f"{cfg.site}-{self.kind}-{uuid.uuid4().hex[:8]}"
        names = cfg.topics
        self.topic = names.queue(queue_id)
        self.removals_topic = names.removals(queue_id)
        self.dlq_topic = names.dead_letter(queue_id)
        self.control_topic = names.control()
        self.status_topic = names.status()
        self.group_id = f"{cfg.kafka.topic_prefix}queue.{queue_id}.dispatch"
        self.policy = BatchPolicy(settings.batch_size, settings.batch_time_interval_ms, settings.batch_conflation,
                                  max_in_flight=self.max_in_flight(),
                                  group_transactions=getattr(settings, "group_transaction_events", False))
        self.max_buffered_bytes = max(1, settings.maximum_queue_memory_mb) * 1024 * 1024
        self.desired = start_state

        self._codec = get_codec()
        #: Reads queue records of either framing (core/framing.py): the site's serializer may be confluent.
        self._frames = frames_for(cfg)
        self._removal_header = self._codec.header("RemovalRecord")
        #: The decisions over this member's partitions (core/queueprotocol.py); the loop performs them.
        self.protocol = QueueProtocol(self.topic, self.policy)
        self._partitions: dict[int, QueuePartition] = self.protocol.partitions
        #: The workers' results to the loop: at most what every worker's offers can bring at once
        #: (an outcome, a failure and a dead letter per event of each batch out).
        self._inbox: Inbox[tuple[str, Any]] = Inbox(
            self.worker_threads() * (settings.batch_size * self.max_in_flight() + 2), self._stopping,
            f"{self.kind} {queue_id}")
        #: An offer's failure that no retry can mend (``offered_again``): the loop raises it.
        self._offer_failed: BaseException | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.worker_threads(), thread_name_prefix=f"{self.kind}-{queue_id}"
        )
        self._consumer: Consumer | None = None
        self._producer: Any = None
        self._control: ControlFollower | None = None
        self._paused_for_memory = False
        #: When an idle turn next asks where the consumer stands (``_cover_skipped_offsets``).
        self._next_gap_check = 0.0
        #: Removal records produced whose delivery the loop has not taken yet.
        self._removals_unacked = 0
        #: The latest clean start the control topic carries for this queue, and the partitions this member
        #: knows it is applied to (core/queueclean.py).
        self._clean: CleanRequest | None = None
        self._clean_applied: set[int] = set()
        self.stats = self.protocol.stats
        #: The group has given this member its assignment (possibly none) and it was not lost since.
        self.assigned = False
        # partition -> (queue size, oldest waiting event's age in s), replaced whole by the loop's status pass.
        self._gauges: dict[int, tuple[int, float]] = {}
        self._batch_duration = telemetry.histogram(telemetry.BATCH_DURATION)
        #: Spans are exported: events keep their records' trace context (``TracedEvent``).
        self._tracing = telemetry.tracing()
        self._attributes: dict[str, Any] | None = None
        #: ``accepts`` is overridden: records without the ``routed`` flag are decoded for it.
        self._filtering = type(self).accepts is not QueuePrimary.accepts
        self._instrument()

    # --- what a kind of queue adds ----------------------------------------------------

    def prepare(self) -> None:
        """Before the loop starts: check and build what ``deliver`` needs."""

    def deliver(self, part: QueuePartition, batch: Batch[AsyncEvent]) -> bool:
        """Deliver one batch (worker thread); True when it may leave the queue."""
        raise NotImplementedError

    def deliver_group(self, part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> int:
        """Deliver the batches out, in order (worker thread): how many, from the
        oldest, may leave the queue.  Batches without events need no delivery."""
        for i, batch in enumerate(batches):
            if batch.events and not self.deliver(part, batch):
                return i
        return len(batches)

    def max_in_flight(self) -> int:
        """How many batches of a partition may be out at once."""
        return 1

    def redelivering(self, part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> None:
        """Worker thread: delivering ``batches`` failed (refused, raised, no ack) and they will be
        delivered again: every event of those that went out is flagged possibleDuplicate from now
        on, as Geode's ``handleUnSuccessfulBatchDispatch`` does.  A listener that applied half a
        batch before it failed sees the whole of it again as possible duplicates.  Here: every
        batch (an async event queue offers its one batch to its listener)."""
        for batch in batches:
            flag_possible_duplicates(batch)

    def worker_threads(self) -> int:
        """The threads that deliver batches (one partition at a time each)."""
        return int(self.queue.dispatcher_threads)

    def accepts(self, event: EntryEvent) -> bool:
        """False leaves the event out of the batches (it is still removed with them): a gateway
        sender's loop check (origin and visited sites).

        Consulted only for records without the ``routed`` flag (QueuedEvent ``flags``): those
        queued before the region service did that check itself at enqueue.  A routed record's
        event is never decoded for it.  A kind of queue that leaves this as it is has no check,
        and its events are never decoded for one.  An event whose body does not decode here is
        dead-lettered with its reason."""
        return True

    def assignment_starting(self) -> None:
        """A new assignment is about to call ``first_batch_id`` for each of its partitions."""

    def first_batch_id(self, partition: int) -> int:
        """Batch ids increase per partition, across primaries too."""
        return int(time.time() * 1000)

    def on_stopped(self) -> None:
        """The queue was set to STOPPED (``sluice admin stop``)."""

    def release(self) -> None:
        """At shutdown, after the last delivery."""

    def partitions_released(self, partitions: list[int]) -> None:
        """These partitions were revoked or lost: forget what was kept for them."""

    def alert_threshold_ms(self) -> int:
        """Alert when the oldest event waiting in a partition is older than this (0: never)."""
        return 0

    def batch_counts(self) -> tuple[int, int, int]:
        """Batches sent (offered), acknowledged (accepted) and sent again, for the metrics."""
        return (self.stats["batches"] + self.stats["redeliveries"], self.stats["batches"],
                self.stats["redeliveries"])

    def dead_lettered_count(self) -> int:
        """Records this member wrote to the dead-letter topic, for the metrics."""
        return self.stats["dead_lettered"]

    # --- health and metrics --------------------------------------------------------

    def readiness(self) -> dict[str, str]:
        """What is not ready (empty when ready), for /readyz: the group's assignment."""
        if not self.assigned:
            return {"kafka": f"no assignment from consumer group {self.group_id} yet (joining, or lost)"}
        return {}

    def attributes(self, partition: int | None = None) -> dict[str, Any]:
        attributes: dict[str, Any] = {**telemetry.base_attributes(self.cfg.site), "sluice.queue.id": self.queue_id,
                                      "sluice.queue.kind": self.kind, "messaging.destination.name": self.topic,
                                      "messaging.consumer.group.name": self.group_id}
        if partition is not None:
            attributes["messaging.destination.partition.id"] = str(partition)
        return attributes

    def _instrument(self) -> None:
        telemetry.observe(telemetry.QUEUE_SIZE, self._read_queue_sizes, gauge=True)
        telemetry.observe(telemetry.QUEUE_OLDEST_AGE, self._read_oldest_ages, gauge=True)
        for i, name in enumerate((telemetry.BATCHES_SENT, telemetry.BATCHES_ACKNOWLEDGED, telemetry.BATCHES_RESENT)):
            telemetry.observe(name, self._reader(lambda primary, i=i: primary.batch_counts()[i]))
        for name, stat in ((telemetry.EVENTS_DELIVERED, "events"), (telemetry.FAILOVERS, "takeovers")):
            telemetry.observe(name, self._reader(lambda primary, stat=stat: primary.stats.get(stat, 0)))
        telemetry.observe(telemetry.DEAD_LETTERED, self._reader(lambda primary: primary.dead_lettered_count()))
        telemetry.observe(telemetry.ALERTS, self._read_alerts)
        telemetry.observe_queue(self, lambda primary: primary._partitions)

    def _reader(self, value: Callable[["QueuePrimary"], int]) -> Callable[[], telemetry.Reading]:
        return telemetry.reader(self, value, lambda primary: primary.attributes())

    def _read_queue_sizes(self) -> telemetry.Reading:
        return [(size, self.attributes(p)) for p, (size, _) in self._gauges.items()]

    def _read_oldest_ages(self) -> telemetry.Reading:
        return [(age, self.attributes(p)) for p, (_, age) in self._gauges.items()]

    def _read_alerts(self) -> telemetry.Reading:
        return [(self.stats["alerts"], {**self.attributes(), "sluice.alert.name": "alert_threshold"})]

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._check_startable()
        base = self.cfg.kafka.client_settings()
        self._producer = make_producer(base, **{"client.id": self.member_id}, **self.cfg.kafka.producer_settings())
        self._consumer = make_consumer(base, self.group_id, **{"client.id": self.member_id},
                                       **self.cfg.kafka.group_settings())
        self._control = ControlFollower(self.cfg, self.kind, self.queue_id, client_id=f"{self.member_id}-control")
        for record in self._control.read_to_end():
            self._apply_control(record)
        self.prepare()
        self._set_running()
        log.info("%s %s of queue %s starting (%s)", self.kind, self.member_id, self.queue_id, self.desired.value)

    def run(self) -> None:
        """The partition loop (core/loop.py), in the calling thread, until ``stop()``.  A stop while a
        record waited for an absent broker (``Stopping``) committed nothing past it; anything else that
        leaves the loop is the queue's crash."""
        consumer = self._consumer
        assert consumer is not None
        loop = PartitionLoop(self, consumer, [self.topic], self, read_max_records=self.read_max_records,
                             status_interval_s=self.status_interval_s)
        try:
            loop.subscribe()
            loop.run()
        finally:
            self._shutdown()

    def turn(self, msgs: list[Message]) -> None:
        """One turn of the loop: the records read, control, the workers' results, cleans, offers,
        the removals' deliveries, the memory bound."""
        if msgs:
            self._read(msgs, int(time.time() * 1000))
        elif time.monotonic() >= self._next_gap_check:
            self._cover_skipped_offsets(int(time.time() * 1000))
            self._next_gap_check = time.monotonic() + self.gap_check_interval_s
        self._poll_control()
        self._drain_inbox()
        self._raise_failed_offer()
        self.raise_crash()
        self._apply_due_cleans()
        self._dispatch_ready()
        if self._removals_unacked:
            self._producer.poll(0)  # the removals' deliveries (``_removed``, on this thread)
            self._commit_removed()
        self._apply_memory_bound()

    def _shutdown(self) -> None:
        consumer = self._consumer
        if consumer is not None:
            # Closing revokes: in-flight offers finish, removals are committed.
            close_consumer(consumer, "closing the consumer", log)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._producer is not None:
            self._producer.flush(FLUSH_DEADLINE_S)
        if self._control is not None:
            self._control.close()
        self.release()
        self._set_stopped()

    # --- control ------------------------------------------------------------------

    def _poll_control(self) -> None:
        if self._control is not None:
            for record in self._control.poll_nowait():
                self._apply_control(record)

    def _apply_control(self, record: dict[str, Any]) -> None:
        if record.get("clean") is not None:
            self._take_clean(CleanRequest.from_record(record["clean"]))
        desired = DesiredState(record["state"])
        if desired is not self.desired:
            log.info("queue %s: %s → %s (by %s)", self.queue_id, self.desired.value, desired.value,
                     record["issued_by"] or "?")
            self.desired = desired
            if desired is DesiredState.STOPPED:
                self._pool.submit(self.on_stopped)

    # --- reading --------------------------------------------------------------------

    def _read(self, msgs: list[Message], now_ms: int) -> None:
        """The records of one poll, into their partitions' batchers, as ``AsyncEvent``s of the
        queued event bodies.  Nothing is decoded here but a QueuedEvent's flags: a record of the
        current version is read by ``eventwire.queued_flags_body`` (equal to ``read_queued``, at
        a third of its cost; compiled where it is built), any other by ``read_queued`` (older
        versions; what is not a QueuedEvent goes to the dead-letter topic with its reason).
        Nothing is called per record but that, the event's making and, where the batcher reads
        nothing of an event but its offset and size (``BatchPolicy.appends_only``), a list
        append: the events of one partition read in a row join its batcher together
        (``PartitionBatcher.extend``), before anything else (a record skipped, the next
        partition's) reaches it (issue 18)."""
        partitions = self._partitions
        codec = self._codec
        header = codec.header("QueuedEvent")
        queue_id = self.queue_id
        filtering = self._filtering
        tracing = self._tracing
        appends_only = self.policy.appends_only
        lean = queued_flags_body_lean
        of_body = AsyncEvent.of_body
        part: QueuePartition | None = None
        partition = -1
        skip_below = duplicate_below = -1
        #: Events of ``part`` read in a row, not yet in its batcher.
        run: list[AsyncEvent] = []
        for msg in msgs:
            if msg.error() is not None:
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("queue %s: %s", self.topic, msg.error())
                continue
            if msg.partition() != partition:
                if run:
                    part.batcher.extend(run, now_ms)  # type: ignore[union-attr]
                    run = []
                partition = msg.partition()
                part = partitions.get(partition)
                if part is not None:
                    skip_below, duplicate_below = part.skip_below, part.duplicate_below
            if part is None:
                continue  # revoked meanwhile
            offset = msg.offset()
            if offset < skip_below:
                continue  # dropped by a clean start: neither an event nor an offset to cover again
            if part.head < 0:
                part.head = offset
            value = msg.value()
            read = lean(header, value)  # the compiled reader: None for what it leaves to the next
            if read is None:
                try:
                    # What the compiled reader left: the Python reference answers it, or says why not.
                    read = queued_flags_body_py(header, value)
                    if read is None:
                        try:
                            read = _read_older(self._frames, value)
                        except RegistryUnavailable:
                            # A Confluent frame's schema id the registry cannot be asked about now: not a
                            # reason to dead-letter the record; the loop waits for the registry (or a stop).
                            read = until_answered(lambda: _read_older(self._frames, value),
                                                  f"queue {self.topic}: the schema of {partition}@{offset}",
                                                  stopping=self._stopping)
                except (CodecError, KeyError, ValueError) as exc:
                    # Not a QueuedEvent (or an older one whose event cannot be an EntryEvent).
                    if run:
                        part.batcher.extend(run, now_ms)
                        run = []
                    self._skip_unreadable(part, msg, exc, now_ms)
                    continue
            flags, body = read
            duplicate = bool(flags & FLAG_POSSIBLE_DUPLICATE) or offset < duplicate_below
            if flags & FLAG_NO_CALLBACKS:
                event: AsyncEvent = CopiedEvent.of_body(body, queue_id, partition, offset, duplicate)
            elif tracing:
                event = TracedEvent.of_body(body, queue_id, partition, offset, duplicate,
                                            telemetry.header(msg.headers(), telemetry.TRACEPARENT))
            else:
                event = of_body(body, queue_id, partition, offset, duplicate)
            if appends_only and (not filtering or flags & FLAG_ROUTED):
                run.append(event)
                continue
            if run:
                part.batcher.extend(run, now_ms)
                run = []
            try:
                if filtering and not flags & FLAG_ROUTED and not self.accepts(event.event):
                    self.stats["filtered"] += 1
                    part.batcher.skip(offset, now_ms)
                    continue
                # Refuses an event it cannot read (conflation reads its key and operation) whole.
                part.batcher.add(event, now_ms)
            except MalformedRecord as exc:
                # Its QueuedEvent fields read, its event body does not: the first touch found it.
                self._skip_unreadable(part, msg, exc, now_ms)
        if run:
            part.batcher.extend(run, now_ms)  # type: ignore[union-attr]

    def _cover_skipped_offsets(self, now_ms: int) -> None:
        """Offsets the consumer moved past without handing over a record are covered as read.

        A queue written in Kafka transactions holds a commit marker after each
        transaction's records (and, read_committed, an aborted transaction's
        records are never handed over): their offsets carry no event, but the
        consumer's position moves past them.  Covered like a dead letter
        (``skip``), they go out as an empty batch whose removal moves the queue
        head to the end, so the queue's size reaches 0 (``sluice admin
        status``).  Asked when a turn read nothing, at most every
        ``gap_check_interval_s``."""
        consumer = self._consumer
        parts = [p for p in self._partitions.values() if p.head >= 0 and not p.revoked]
        if consumer is None or not parts:
            return
        try:
            with kafka_errors("reading the consumer's positions"):
                positions = consumer.position([p.tp for p in parts])
        except SluiceError as exc:
            log.debug("queue %s: positions not known now: %s", self.queue_id, exc)
            return
        for part, tp in zip(parts, positions):
            if tp.error is None and tp.offset > max(part.head, part.batcher.covered_end):
                part.batcher.skip(tp.offset - 1, now_ms)

    def _skip_unreadable(self, part: QueuePartition, msg: Message, exc: Exception, now_ms: int) -> None:
        self._dead_letter(msg, exc)
        part.dead_lettered += 1
        part.batcher.skip(msg.offset(), now_ms)

    def _dead_letter(self, msg: Message, exc: BaseException) -> None:
        record = {
            "source_topic": msg.topic(),
            "source_partition": msg.partition(),
            "source_offset": msg.offset(),
            "key": msg.key(),
            "value": msg.value(),
            "reason": str(exc),
            "error_class": type(exc).__name__,
            "event": None,
            "service": f"{self.kind} {self.member_id}",
            "failed_at": int(time.time() * 1000),
        }
        # Durable before anything after it can be committed past it, however
        # long the broker is away.
        produce_durably(self._producer, self.dlq_topic, self._codec.encode("DeadLetter", record), msg.key(),
                        what=f"dead letter of {msg.topic()}[{msg.partition()}]@{msg.offset()}",
                        stopping=self._stopping)
        self.stats["dead_lettered"] += 1
        log.warning("queue %s[%d]@%d dead-lettered: %s", msg.topic(), msg.partition(), msg.offset(), exc)

    def dead_letter_event(self, event: AsyncEvent, reason: str, error_class: str, service: str) -> None:
        """Worker thread: write an event the listener can never take to the
        dead-letter topic and return once the broker has it (issue 17), so the
        batch is removed only after its dead letters are durable.  Stopping
        raises ``Stopping``: the batch stays, and is offered again.

        An event whose body does not decode is kept as that body (``value``,
        ``event`` null) under its key when the key reads, else no key."""
        try:
            entry: EntryEvent | None = event.event
        except MalformedRecord:
            entry = None
        if entry is not None:
            key: bytes | None = entry.key.encode()
            value, record_event = entry.value, entry.to_record()
        else:
            try:
                key = event.key.encode()
            except MalformedRecord:
                key = None
            value, record_event = event.body, None
        record = {
            "source_topic": self.topic,
            "source_partition": event.partition,
            "source_offset": event.offset,
            "key": key,
            "value": value,
            "reason": reason,
            "error_class": error_class,
            "event": record_event,
            "service": service,
            "failed_at": int(time.time() * 1000),
        }
        produce_durably(self._producer, self.dlq_topic, self._codec.encode("DeadLetter", record), key,
                        what=f"dead letter of {self.topic}[{event.partition}]@{event.offset}",
                        stopping=self._stopping)
        # Counted by the loop thread, which owns the partition's counters.
        self._inbox.put(("dead_lettered", event.partition))
        log.warning("queue %s[%d]@%d (%s) dead-lettered: %s: %s", self.topic, event.partition, event.offset,
                    entry.event_id if entry is not None else "undecodable", error_class, reason)

    def dead_letter_undecodable(self, batch: Batch[AsyncEvent], service: str,
                                already: list[AsyncEvent] | tuple[AsyncEvent, ...] = ()) -> bool:
        """Worker thread, after an offer: the events of ``batch`` a touch found undecodable
        (their bodies damaged; ``AsyncEvent.decode_error``) go to the dead-letter topic with
        their reasons, durably, and leave the batch, which goes on without them.  Those
        ``already`` dead-lettered (the listener's ``Accepted``) are not written twice, and stay:
        the batch is accepted with them.  True when there were any: a refused offer may then
        go again at once without them."""
        bad = undecodable(batch.events)
        if already:
            written = {id(e) for e in already}
            bad = [e for e in bad if id(e) not in written]
        if not bad:
            return False
        for event in bad:
            error = event.decode_error
            assert error is not None
            self.dead_letter_event(event, error.reason, type(error).__name__, service)
        batch.drop(bad)
        return True

    def _count_dead_letter(self, partition: int) -> None:
        self.stats["dead_lettered"] += 1
        part = self._partitions.get(partition)
        if part is not None:
            part.dead_lettered += 1

    # --- dispatching ------------------------------------------------------------------

    def poll_timeout_s(self) -> float:
        """How long the loop may wait for records: until a batch is due, and
        briefly while a batch is out (its result comes through the inbox,
        which does not wake the consumer)."""
        if not self._inbox.empty():
            return 0.0
        now_ms = int(time.time() * 1000)
        # A partition with batches out takes nothing new before they are done.
        due = [p.batcher.due_in_ms(now_ms) for p in self._partitions.values() if not p.in_flight]
        due_ms = [d for d in due if d is not None]
        wait = POLL_WAIT_IDLE_S
        if due_ms and self.desired is DesiredState.RUNNING:
            wait = min(wait, min(due_ms) / 1000)
        if self._removals_unacked or any(p.in_flight for p in self._partitions.values()):
            wait = min(wait, POLL_WAIT_BUSY_S)
        return wait

    def _dispatch_ready(self) -> None:
        """The protocol's offers go to the workers; the removals of batches that needed none are written."""
        for action in self.protocol.ready(int(time.time() * 1000), self.desired is DesiredState.RUNNING):
            if isinstance(action, Removal):
                self._write_removal(action.part, action.batch, action.commit)
                continue
            if action.first:
                # The end of a failover, as an operator (and `sluice soak`) measures it.
                log.info("queue %s[%d]: first batch dispatched since taking the partition (batch %d)",
                         self.queue_id, action.part.tp.partition, action.batches[0].batch_id)
            self._pool.submit(self._offer, action.part, action.batches)

    def _offer(self, part: QueuePartition, group: list[Batch[AsyncEvent]]) -> None:
        """Worker thread: the same batches until some are accepted, or until dispatch must stop.
        The first offer is made directly; only one that fails builds the retry machinery
        (tenacity costs ~12 µs a batch even when nothing is retried)."""
        attempts = 1
        accepted = 0
        first = group[0]
        began = time.monotonic()
        try:
            try:
                accepted = self._deliver_decodable(part, group)
                failure: Exception | None = None if accepted > 0 else DeliveryRefused(
                    f"batch {first.batch_id} not delivered")
            except Exception as exc:
                failure = exc
            if failure is not None:
                # Offered again now or later (a stop, a pause): possibleDuplicate from here on.
                self.redelivering(part, group)
                if not offered_again(failure):
                    raise failure
            if failure is not None and not self._must_stop_offering(part):
                log.warning("queue %s[%d]: batch %d offered again (attempt 2): %s", self.queue_id,
                            part.tp.partition, first.batch_id, failure)
                if not self._stopping.wait(self._backoff_s(1)):
                    accepted, attempts = self._offer_again(part, group)
        except Stopping:
            pass  # a stop cut a wait short (a dead letter waiting for the broker): the batch stays queued
        except Exception as exc:  # top of a worker: never lose the batch, report it
            if offered_again(exc):
                log.exception("offering batch %d of partition %d failed: %s", first.batch_id, part.tp.partition, exc)
            else:
                # No retry can mend it: the loop raises it, and the queue stops as crashed (the batch stays).
                self._inbox.put(("failed", exc))
        finally:
            if accepted > 0:
                self._batch_duration.record(time.monotonic() - began, self._queue_attributes())
            self._inbox.put(("done", OfferDone(part.tp.partition, group, max(0, accepted), attempts,
                                                int(time.time() * 1000))))

    def _backoff_s(self, attempts: int) -> float:
        """The wait after ``attempts`` failed offers: 50 ms, doubling, at most ``backoff_max_s``."""
        return min(self.backoff_max_s, BACKOFF_FIRST_S * 2 ** (attempts - 1))

    def _offer_again(self, part: QueuePartition, group: list[Batch[AsyncEvent]]) -> tuple[int, int]:
        """Worker thread, after a failed first offer: offer the same batches again with backoff
        until some are accepted or dispatch must stop; (accepted, attempts in all)."""
        attempts = 1
        accepted = 0
        first = group[0]
        for attempt in Retrying(
            retry=retry_if_exception(offered_again),
            # Attempt n here is the offer's attempt n + 1.
            wait=lambda state: self._backoff_s(state.attempt_number + 1),
            stop=_StopWhen(lambda: self._must_stop_offering(part)),
            # A stop, pause or revoke cuts the backoff short.
            sleep=lambda seconds: self._stopping.wait(seconds) and None,
            before_sleep=lambda state: log.warning(
                "queue %s[%d]: batch %d offered again (attempt %d): %s", self.queue_id, part.tp.partition,
                first.batch_id, state.attempt_number + 2,
                state.outcome.exception() if state.outcome is not None else "?"),
            reraise=False,
            retry_error_callback=lambda state: None,
        ):
            with attempt:
                attempts += 1
                try:
                    accepted = self._deliver_decodable(part, group)
                except Exception:
                    self.redelivering(part, group)
                    raise
                if accepted <= 0:
                    self.redelivering(part, group)
                    raise DeliveryRefused(f"batch {first.batch_id} not delivered")
        return accepted, attempts

    def _queue_attributes(self) -> dict[str, Any]:
        """``attributes()`` of the whole queue, built once (recorded with every batch's durations)."""
        if self._attributes is None:
            self._attributes = self.attributes()
        return self._attributes

    def _deliver_decodable(self, part: QueuePartition, group: list[Batch[AsyncEvent]]) -> int:
        """``deliver_group``; when it raised or delivered nothing over events a touch found
        undecodable (a kind of queue that does not catch that itself, or turns it into a
        refusal), they are dead-lettered and the batches go again at once without them.  Each
        round leaves out at least one event, or ends."""
        service = f"{self.kind} {self.member_id}"
        while True:
            try:
                accepted = self.deliver_group(part, group)
            except Exception:
                if not [b for b in group if self.dead_letter_undecodable(b, service)]:
                    raise
                self.redelivering(part, group)
                continue
            if accepted > 0 or not [b for b in group if self.dead_letter_undecodable(b, service)]:
                return accepted
            self.redelivering(part, group)

    def _must_stop_offering(self, part: QueuePartition) -> bool:
        return self._stopping.is_set() or self.protocol.must_stop_offering(
            part, self.desired is DesiredState.RUNNING)

    # --- results ----------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        """Take the workers' results; then commit, in one request, every partition whose queue head
        moved (one commit per turn, not per batch)."""
        for kind, item in self._inbox.drain():
            self._take(kind, item)
        self._commit_removed()

    def _take(self, kind: str, item: Any) -> None:
        """One worker result: an offer's outcome, a dead letter written, an offer failed for good."""
        if kind == "done":
            self._offer_done(item)
        elif kind == "dead_lettered":
            self._count_dead_letter(item)
        elif kind == "failed":
            self._offer_failed = self._offer_failed or item

    def _raise_failed_offer(self) -> None:
        """Loop thread: a worker's offer failed for good (``offered_again``): the queue stops as crashed
        with that error (its batch stays queued, for the next primary)."""
        if self._offer_failed is not None:
            raise self._offer_failed

    def _offer_done(self, done: OfferDone) -> None:
        for removal in self.protocol.offer_done(done):
            self._write_removal(removal.part, removal.batch, removal.commit)

    def _write_removal(self, part: QueuePartition, batch: Batch[AsyncEvent], commit: int) -> None:
        partition = part.tp.partition
        # Written by hand (eventwire.removal_record, equal to fastavro's encoding): once, without
        # fastavro's validation pass, which cost ~100 µs a batch (PERF-NOTES), or its dictionaries.
        value = removal_record(self._removal_header, self.queue_id, partition, batch.batch_id, commit - 1,
                               _last_event_id(batch.events), len(batch.events), int(time.time() * 1000))

        def removed(err: KafkaError | None, _msg: Message) -> None:
            # On the loop thread: its producer's poll or flush calls it.
            self._removed(partition, commit, err)

        # Its delivery is served by the loop's one producer poll per turn.
        self._producer.produce(self.removals_topic, value, str(partition).encode(), on_delivery=removed)
        self._removals_unacked += 1

    def _removed(self, partition: int, commit: int, err: KafkaError | None) -> None:
        self._removals_unacked -= 1
        if err is not None:
            # The batch was accepted; without its removal it is offered again
            # after a restart (possibleDuplicate).  Commit nothing now.
            log.warning("removal record for partition %d not written (%s)", partition, err)
        self.protocol.removed(partition, commit, err is None)

    def _commit_removed(self) -> None:
        """Commit the group offsets of the partitions whose removals are durable (asynchronously)."""
        if not self.protocol.commits_due:
            return
        offsets = self.protocol.commits()
        if not offsets:
            return
        assert self._consumer is not None
        try:
            with kafka_errors(f"committing {', '.join(f'[{tp.partition}]@{tp.offset}' for tp in offsets)}"):
                self._consumer.commit(offsets=offsets, asynchronous=True)
        except SluiceError as exc:
            log.warning("%s", exc)

    # --- group callbacks -----------------------------------------------------------------

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The protocol takes the partitions, with what it must know of them: their end offsets now,
        whether some primary ever reported on them, where their batch ids go on."""
        consumer.assign(partitions)
        self.assignment_starting()
        dispatched_before = self._partitions_dispatched_before()
        numbers = [tp.partition for tp in partitions]
        ends = {p: self._end_offset(consumer, p) for p in numbers}
        batch_ids = {p: self.first_batch_id(p) for p in numbers}
        for part in self.protocol.assign(numbers, ends, dispatched_before, batch_ids):
            self._mark_clean_due(part)
        log.info("queue %s: primary for partitions %s", self.queue_id, sorted(numbers))
        self.assigned = True
        self.publish_status()

    def _end_offset(self, consumer: Consumer, partition: int) -> int:
        """The partition's end offset (asked again while the broker does not answer)."""
        tp = TopicPartition(self.topic, partition)
        return int(until_answered(lambda: consumer.get_watermark_offsets(tp, timeout=OFFSETS_REQUEST_DEADLINE_S),
                                  f"queue {self.queue_id}: reading the end of {self.topic}[{partition}]",
                                  stopping=self._stopping)[1])

    def _partitions_dispatched_before(self) -> set[int] | None:
        """Partitions some primary has reported on (every primary reports as it
        takes one over); None when that cannot be known."""
        reader = make_consumer(self.cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
        prefix = f"{self.kind}/{self.queue_id}/".encode()
        found: set[int] = set()
        try:
            with kafka_errors(f"reading {self.status_topic}"):
                for msg in read_to_end(reader, self.status_topic):
                    key = msg.key() or b""
                    if key.startswith(prefix):
                        found.add(int(key[len(prefix):]))
        except (SluiceError, ValueError) as exc:
            # When in doubt, flag: possibleDuplicate is the safe side.
            why = exc if isinstance(exc, SluiceError) else f"reading {self.status_topic}: {exc}"
            log.warning("%s; flagging every queued event as possibleDuplicate", why)
            return None
        finally:
            reader.close()
        return found

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = self.protocol.revoking([tp.partition for tp in partitions])
        # Let in-flight offers end (the retry loop sees `revoked`), then write
        # the removals of what was accepted, so the next primary starts after it.
        end = time.monotonic() + REVOKE_DRAIN_DEADLINE_S
        while any(p.in_flight for p in revoked) and time.monotonic() < end:
            item = self._inbox.get(REVOKE_INBOX_WAIT_S)
            if item is not None:
                self._take(*item)
        if self._producer is not None:
            self._producer.flush(FLUSH_DEADLINE_S)
        self._drain_inbox()
        offsets = self.protocol.release(revoked)
        if offsets:
            try:
                with kafka_errors("committing on revoke"):
                    consumer.commit(offsets=offsets, asynchronous=False)
            except SluiceError as exc:
                log.warning("%s", exc)
        self._gauges = {p: g for p, g in self._gauges.items() if p in self._partitions}
        self.partitions_released([p.tp.partition for p in revoked])
        log.info("queue %s: revoked partitions %s", self.queue_id, sorted(p.tp.partition for p in revoked))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.protocol.lost([tp.partition for tp in partitions])
        self.partitions_released([tp.partition for tp in partitions])
        self.assigned = False
        self._gauges = {p: g for p, g in self._gauges.items() if p in self._partitions}
        log.warning("queue %s: lost partitions %s", self.queue_id, sorted(tp.partition for tp in partitions))

    # --- memory bound and status -----------------------------------------------------------

    def _apply_memory_bound(self) -> None:
        consumer = self._consumer
        if consumer is None or not self._partitions:
            return
        held = sum(p.batcher.buffered_bytes for p in self._partitions.values())
        tps = [p.tp for p in self._partitions.values()]
        if not self._paused_for_memory and held > self.max_buffered_bytes:
            consumer.pause(tps)
            self._paused_for_memory = True
            log.info("queue %s: %d bytes held, reading paused (maximum_queue_memory_mb)", self.queue_id, held)
        elif self._paused_for_memory and held < self.max_buffered_bytes * 0.8:
            consumer.resume(tps)
            self._paused_for_memory = False

    def publish_status(self) -> None:
        if self._producer is None:
            return
        state = self.desired.value.lower()
        now_ms = int(time.time() * 1000)
        threshold = self.alert_threshold_ms()
        gauges: dict[int, tuple[int, float]] = {}
        for part in self._partitions.values():
            b = part.batcher
            self._check_alert(part, now_ms, threshold)
            gauges[part.tp.partition] = self._gauge_values(part, now_ms)
            record = {
                "kind": self.kind,
                "queue_id": self.queue_id,
                "partition": part.tp.partition,
                "primary": self.member_id,
                "state": state,
                "batches_dispatched": b.batches_accepted,
                "events_dispatched": part.events_dispatched,
                "redeliveries": b.redeliveries,
                "events_conflated": b.events_conflated,
                "dead_lettered": part.dead_lettered,
                "last_removed_offset": part.last_removed_offset,
                "in_flight": len(b.out) if part.in_flight else 0,
                "last_accepted_at": part.last_accepted_at,
                "waiting": b.unaccepted,
                "updated_at": now_ms,
            }
            key = f"{self.kind}/{self.queue_id}/{part.tp.partition}".encode()
            self._producer.produce(self.status_topic, self._codec.encode("QueueStatus", record), key)
        self._gauges = gauges
        self._producer.poll(0)

    def _gauge_values(self, part: QueuePartition, now_ms: int) -> tuple[int, float]:
        """(queue size, oldest waiting event's age in s) of a partition: the size is the
        end offset the consumer last fetched minus the queue head, which counts
        what is still in Kafka and not read yet."""
        oldest = _event_time(part.batcher.oldest())
        age_s = max(0, now_ms - oldest) / 1000 if oldest is not None else 0.0
        waiting = part.batcher.unaccepted
        consumer = self._consumer
        if consumer is None or part.head < 0:
            return waiting, age_s
        try:
            with kafka_errors("the cached end offset"):
                high = int(consumer.get_watermark_offsets(part.tp, cached=True)[1])
        except (SluiceError, RuntimeError):
            return waiting, age_s
        return (max(waiting, high - part.head) if high >= 0 else waiting), age_s


    alert_repeat_s = 30.0

    def _check_alert(self, part: QueuePartition, now_ms: int, threshold: int) -> None:
        """Geode's alert-threshold: log while the oldest waiting event is older
        than the threshold (when it starts, then every ``alert_repeat_s``), and
        once when it is over."""
        oldest = _event_time(part.batcher.oldest()) if threshold > 0 else None
        age = now_ms - oldest if oldest is not None else 0
        if oldest is not None and age > threshold:
            now = time.monotonic()
            if part.alerting_since == 0.0 or now - part.alerting_since >= self.alert_repeat_s:
                part.alerting_since = now
                self.stats["alerts"] += 1
                waiting = part.batcher.unaccepted
                log.warning("ALERT %s %s[%d]: the oldest event waiting is %d ms old (alert_threshold_ms %d); "
                            "%d events wait", self.kind, self.queue_id, part.tp.partition, age, threshold, waiting,
                            extra={"alert": "alert_threshold", "queue_kind": self.kind, "queue_id": self.queue_id,
                                   "partition": part.tp.partition, "oldest_age_ms": age,
                                   "alert_threshold_ms": threshold, "waiting": waiting})
        elif part.alerting_since:
            part.alerting_since = 0.0
            log.warning("alert over: %s %s[%d]: no waiting event is older than %d ms", self.kind, self.queue_id,
                        part.tp.partition, threshold,
                        extra={"alert": "alert_threshold", "alert_over": True, "queue_kind": self.kind,
                               "queue_id": self.queue_id, "partition": part.tp.partition,
                               "alert_threshold_ms": threshold})


def _read_older(frames: Frames, data: bytes | None) -> tuple[int, bytes]:
    """(flags, event body) of a record ``queued_flags_body`` left: one in Confluent's wire format
    (``core/framing.py``; of the current QueuedEvent version it is read as fast), or one of an
    older QueuedEvent version, through ``read_queued``; ``CodecError`` for one that is no
    QueuedEvent at all.  A QueuedEvent before flags (v2) said possibleDuplicate in its event
    alone, so that is read here too: its event is decoded, which only a queue written before an
    upgrade costs."""
    header = frames.current_header(data, "QueuedEvent")
    if header is not None:
        read = queued_flags_body(header, data)
        assert read is not None, "a record that starts with the header was refused by it"
        return read
    view = read_queued(frames.codec, frames.single_object(data))
    flags = view.flags
    if not flags & FLAG_POSSIBLE_DUPLICATE and decode_entry(view.event_body)[0].possible_duplicate:
        flags |= FLAG_POSSIBLE_DUPLICATE
    return flags, view.event_body


def _last_event_id(events: list[AsyncEvent]) -> EventID | None:
    """The EventID of the newest event of a batch whose EventID reads (the removal record names it),
    read without decoding the event."""
    for event in reversed(events):
        try:
            return event_id_of(event)
        except MalformedRecord:
            continue  # damaged, and its listener never looked at it
    return None


def _event_time(event: AsyncEvent | None) -> int | None:
    """An event's time, None for no event or one whose body does not decode."""
    if event is None:
        return None
    try:
        return event.event.event_time
    except MalformedRecord:
        return None


def offered_again(failure: BaseException) -> bool:
    """Whether a failed offer is made again: as ``retriable`` says for a ``SluiceError`` (a refusal,
    no ack, a remote site away: yes; a dead-letter topic that refuses every write: no), yes for any
    other ``Exception`` (the listener's own: Geode offers a batch again whose ``processEvents``
    threw), never for a ``BaseException`` that is not one (``Stopping``)."""
    if isinstance(failure, SluiceError):
        return failure.retriable
    return isinstance(failure, Exception)


class _StopWhen(stop_base):
    """tenacity stop condition: stop retrying when ``predicate()`` holds."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate()
