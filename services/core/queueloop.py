"""The primary loop of a queue: what async event queues and gateway senders share.

Every instance serving a queue joins the queue's consumer group; the members
assigned partitions are the primaries of those partitions, the others wait
as secondaries and take over when a primary crashes or leaves.

The story of a partition on its primary, step by step:

1. Records are read from the queue topic and decoded into ``AsyncEvent``s.
   A record that cannot be decoded goes to the queue's dead-letter topic with
   the reason (flushed before anything after it can be committed) and
   delivery goes on.  Events below the partition's end offset at the moment
   of assignment may have been delivered by the previous primary: they carry
   ``possible_duplicate``.  ``accepts`` may leave an event out (a sender does
   not send an event back to a site it came from).
2. ``PartitionBatcher`` (core/batching.py) assembles batches by size or time
   and conflates updates when the queue says so.
3. ``deliver_group`` is called with the batches that are out (up to
   ``max_in_flight``, oldest first) on one of ``dispatcher_threads`` worker
   threads: an async event queue offers its one batch to its listener
   (``deliver``), a gateway sender writes several batches to the remote site
   and waits for their acks in order.  It answers how many batches, from the
   oldest, were delivered.  None: the very same batches are delivered again
   with exponential backoff (tenacity), forever, unless the queue is paused,
   stopped or the partition revoked; nothing after them goes first.  Events
   a listener can never take go to the dead-letter topic during the offer
   (``dead_letter_event``), durably, before the batch counts as delivered.
4. Delivered, oldest first: each batch's removal record (queue head) is
   written to the queue's compacted removals topic, and once it is durable
   the group offset is committed.  A crash anywhere before that only means
   the batch is delivered again, flagged possibleDuplicate.

``sluice admin`` steers the queue through the site's control topic (latest
record per queue wins: RUNNING, PAUSED, STOPPED); pause takes effect at a
batch boundary and loses nothing, the queue just grows.  The primaries
report per-partition status to the site's status topic every few seconds.

Lifecycle::

    NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                        └── a thread died ──► CRASHED (exit non-zero)
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential
from tenacity.stop import stop_base

from . import telemetry
from .asyncevent import AsyncEvent
from .batching import Batch, BatchPolicy, PartitionBatcher
from .codec import get_codec
from .config import SiteConfig
from .errors import CodecError
from .lifecycle import ServiceState
from .events import EntryEvent
from .kafka import (
    OFFSET_BEGINNING,
    Consumer,
    Interrupted,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
    consume_available,
    make_consumer,
    make_producer,
    produce_durably,
    read_to_end,
    translate,
    until_answered,
)

log = logging.getLogger("sluice.queue")

class DesiredState(str, enum.Enum):
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    STOPPED = "STOPPED"


@dataclass(frozen=True, slots=True)
class TracedEvent(AsyncEvent):
    """An ``AsyncEvent`` read while tracing: with the W3C ``traceparent`` its queue record carried."""

    traceparent: bytes | None = None


def event_traceparent(event: AsyncEvent) -> bytes | None:
    return event.traceparent if isinstance(event, TracedEvent) else None


class Refused(Exception):
    """``deliver`` did not deliver the batch (a listener returned False, no ack came)."""


@dataclass(slots=True)
class QueuePartition:
    """A partition this dispatcher is primary for."""

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


@dataclass(frozen=True, slots=True)
class _OfferDone:
    partition: int
    batches: list[Batch[AsyncEvent]]
    accepted: int  # how many of ``batches``, from the oldest, were delivered
    attempts: int
    at_ms: int = 0


class QueuePrimary:
    """The primary side of one queue (an async event queue or a gateway sender)."""

    status_interval_s = 2.0
    backoff_max_s = 5.0
    #: "async-event-queue" or "gateway-sender": the key space in the control and status topics.
    kind = ""

    def __init__(self, cfg: SiteConfig, queue_id: str, settings: Any, *, member_id: str | None = None,
                 start_state: DesiredState = DesiredState.RUNNING) -> None:
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
        self.state = ServiceState.NEW
        self.crash: BaseException | None = None
        self.desired = start_state

        self._codec = get_codec()
        self._partitions: dict[int, QueuePartition] = {}
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stopping = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.worker_threads(), thread_name_prefix=f"{self.kind}-{queue_id}"
        )
        self._consumer: Consumer | None = None
        self._producer: Any = None
        self._control: Consumer | None = None
        self._paused_for_memory = False
        self.stats = {"batches": 0, "events": 0, "redeliveries": 0, "dead_lettered": 0, "conflated": 0,
                      "filtered": 0, "takeovers": 0, "alerts": 0}
        #: The group has given this member its assignment (possibly none) and it was not lost since.
        self.assigned = False
        # partition -> (queue size, oldest waiting event's age in s), replaced whole by the loop's status pass.
        self._gauges: dict[int, tuple[int, float]] = {}
        self._batch_duration = telemetry.histogram(telemetry.BATCH_DURATION)
        #: Spans are exported: events keep their records' trace context (``TracedEvent``).
        self._tracing = telemetry.tracing()
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

    def worker_threads(self) -> int:
        """The threads that deliver batches (one partition at a time each)."""
        return int(self.queue.dispatcher_threads)

    def accepts(self, event: EntryEvent) -> bool:
        """False leaves the event out of the batches (it is still removed with them)."""
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
        assert self.state is ServiceState.NEW
        base = self.cfg.kafka.client_settings()
        self._producer = make_producer(base, **{"client.id": self.member_id}, **self.cfg.kafka.producer_settings())
        self._consumer = make_consumer(base, self.group_id, **{"client.id": self.member_id},
                                       **self.cfg.kafka.group_settings())
        self._control = make_consumer(base, None, **{"client.id": f"{self.member_id}-control",
                                                     "fetch.wait.max.ms": 100})
        self._read_control_to_end()
        self.prepare()
        self.state = ServiceState.RUNNING
        log.info("%s %s of queue %s starting (%s)", self.kind, self.member_id, self.queue_id, self.desired.value)

    def run(self) -> None:
        """The consumer loop, in the calling thread, until ``stop()``."""
        consumer = self._consumer
        assert consumer is not None
        consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
        next_status = time.monotonic() + self.status_interval_s
        try:
            while not self._stopping.is_set():
                timeout = self._poll_timeout_s()
                try:
                    msgs = consume_available(consumer, 500, timeout)
                except KafkaException as exc:
                    raise translate(exc, f"consuming {self.topic}") from exc
                now_ms = int(time.time() * 1000)
                for msg in msgs:
                    self._read(msg, now_ms)
                self._poll_control()
                self._drain_inbox()
                self._dispatch_ready()
                self._apply_memory_bound()
                if time.monotonic() >= next_status:
                    self._publish_status()
                    next_status = time.monotonic() + self.status_interval_s
        except Interrupted:
            pass  # stopping while a record waited for an absent broker: nothing was committed past it
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                self.crash = exc
                self.state = ServiceState.CRASHED
            raise
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Idempotent: the loop leaves the group cleanly and returns."""
        if self.state in (ServiceState.RUNNING, ServiceState.NEW):
            self.state = ServiceState.STOPPING
        self._stopping.set()

    def _shutdown(self) -> None:
        consumer = self._consumer
        try:
            if consumer is not None:
                consumer.close()  # revokes: in-flight offers finish, removals committed
        except (KafkaException, RuntimeError) as exc:
            log.warning("closing the consumer: %s", exc)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._producer is not None:
            self._producer.flush(10)
        if self._control is not None:
            self._control.close()
        self.release()
        if self.state is not ServiceState.CRASHED:
            self.state = ServiceState.STOPPED

    # --- control ------------------------------------------------------------------

    def _read_control_to_end(self) -> None:
        control = self._control
        assert control is not None
        tp = TopicPartition(self.control_topic, 0)
        try:
            low, high = control.get_watermark_offsets(tp, timeout=10)
        except KafkaException as exc:
            raise translate(exc, f"reading {self.control_topic}") from exc
        control.assign([TopicPartition(self.control_topic, 0, OFFSET_BEGINNING)])
        last = low - 1
        end = time.monotonic() + 15
        while last < high - 1 and time.monotonic() < end:
            for msg in control.consume(500, 0.05):
                if msg.error() is None:
                    last = msg.offset()
                    self._apply_control(msg)

    def _poll_control(self) -> None:
        control = self._control
        if control is None:
            return
        for msg in control.consume(100, 0):
            if msg.error() is None:
                self._apply_control(msg)

    def _apply_control(self, msg: Message) -> None:
        if msg.key() != f"{self.kind}/{self.queue_id}".encode():
            return
        try:
            record = self._codec.decode_as("ControlRecord", msg.value())
        except CodecError as exc:
            log.error("unreadable control record at %d: %s", msg.offset(), exc)
            return
        desired = DesiredState(record["state"])
        if desired is not self.desired:
            log.info("queue %s: %s → %s (by %s)", self.queue_id, self.desired.value, desired.value,
                     record["issued_by"] or "?")
            self.desired = desired
            if desired is DesiredState.STOPPED:
                self._pool.submit(self.on_stopped)

    # --- reading --------------------------------------------------------------------

    def _read(self, msg: Message, now_ms: int) -> None:
        if msg.error() is not None:
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("queue %s: %s", self.topic, msg.error())
            return
        part = self._partitions.get(msg.partition())
        if part is None:
            return  # revoked meanwhile
        if part.head < 0:
            part.head = msg.offset()
        try:
            record = self._codec.decode_as("QueuedEvent", msg.value())
            event = EntryEvent.from_record(record["event"])
        except (CodecError, KeyError, ValueError) as exc:
            self._dead_letter(msg, exc)
            part.dead_lettered += 1
            part.batcher.skip(msg.offset(), now_ms)
            return
        if not self.accepts(event):
            self.stats["filtered"] += 1
            part.batcher.skip(msg.offset(), now_ms)
            return
        duplicate = event.possible_duplicate or msg.offset() < part.duplicate_below
        if self._tracing:
            traced = TracedEvent(event, self.queue_id, msg.partition(), msg.offset(), duplicate,
                                 telemetry.header(msg.headers(), telemetry.TRACEPARENT))
            part.batcher.add(traced, now_ms)
        else:
            part.batcher.add(AsyncEvent(event, self.queue_id, msg.partition(), msg.offset(), duplicate), now_ms)

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
        raises ``Interrupted``: the batch stays, and is offered again."""
        record = {
            "source_topic": self.topic,
            "source_partition": event.partition,
            "source_offset": event.offset,
            "key": event.key.encode(),
            "value": event.raw_value,
            "reason": reason,
            "error_class": error_class,
            "event": event.event.to_record(),
            "service": service,
            "failed_at": int(time.time() * 1000),
        }
        produce_durably(self._producer, self.dlq_topic, self._codec.encode("DeadLetter", record), event.key.encode(),
                        what=f"dead letter of {self.topic}[{event.partition}]@{event.offset}",
                        stopping=self._stopping)
        # Counted by the loop thread, which owns the partition's counters.
        self._inbox.put(("dead_lettered", event.partition))
        log.warning("queue %s[%d]@%d (%s) dead-lettered by the listener: %s: %s", self.topic, event.partition,
                    event.offset, event.event_id, error_class, reason)

    def _count_dead_letter(self, partition: int) -> None:
        self.stats["dead_lettered"] += 1
        part = self._partitions.get(partition)
        if part is not None:
            part.dead_lettered += 1

    # --- dispatching ------------------------------------------------------------------

    def _poll_timeout_s(self) -> float:
        """How long the loop may wait for records: until a batch is due, and
        briefly while a batch is out (its result comes through the inbox,
        which does not wake the consumer)."""
        if not self._inbox.empty():
            return 0.0
        now_ms = int(time.time() * 1000)
        # A partition with batches out takes nothing new before they are done.
        due = [p.batcher.due_in_ms(now_ms) for p in self._partitions.values() if not p.in_flight]
        due_ms = [d for d in due if d is not None]
        wait = 0.05
        if due_ms and self.desired is DesiredState.RUNNING:
            wait = min(wait, min(due_ms) / 1000)
        if any(p.in_flight for p in self._partitions.values()):
            wait = min(wait, 0.005)
        return wait

    def _dispatch_ready(self) -> None:
        if self.desired is not DesiredState.RUNNING:
            return
        now_ms = int(time.time() * 1000)
        for part in self._partitions.values():
            if part.in_flight or part.revoked:
                continue
            # What is still out (refused before) goes again first, then new batches.
            while part.batcher.take(now_ms) is not None:
                pass
            group = list(part.batcher.out)
            if not group:
                continue
            part.in_flight = True
            if not any(b.events for b in group):
                # Only dead letters, filtered or conflated-away records: nothing to offer.
                self._inbox.put(("done", _OfferDone(part.tp.partition, group, len(group), 0, now_ms)))
                continue
            if not part.dispatched_yet:
                # The end of a failover, as an operator (and `sluice soak`) measures it.
                part.dispatched_yet = True
                log.info("queue %s[%d]: first batch dispatched since taking the partition (batch %d)",
                         self.queue_id, part.tp.partition, group[0].batch_id)
            self._pool.submit(self._offer, part, group)

    def _offer(self, part: QueuePartition, group: list[Batch[AsyncEvent]]) -> None:
        """Worker thread: the same batches until some are accepted, or until dispatch must stop."""
        attempts = 0
        accepted = 0
        first = group[0]
        began = time.monotonic()
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_exponential(multiplier=0.05, max=self.backoff_max_s),
                stop=_StopWhen(lambda: self._must_stop_offering(part)),
                # A stop, pause or revoke cuts the backoff short.
                sleep=lambda seconds: self._stopping.wait(seconds) and None,
                before_sleep=lambda state: log.warning(
                    "queue %s[%d]: batch %d offered again (attempt %d): %s", self.queue_id, part.tp.partition,
                    first.batch_id, state.attempt_number + 1,
                    state.outcome.exception() if state.outcome is not None else "?"),
                reraise=False,
                retry_error_callback=lambda state: None,
            ):
                with attempt:
                    attempts += 1
                    accepted = self.deliver_group(part, group)
                    if accepted <= 0:
                        raise Refused(f"batch {first.batch_id} not delivered")
        except Exception as exc:  # top of a worker: never lose the batch, report it
            log.exception("offering batch %d of partition %d failed: %s", first.batch_id, part.tp.partition, exc)
        finally:
            if accepted > 0:
                self._batch_duration.record(time.monotonic() - began, self.attributes())
            self._inbox.put(("done", _OfferDone(part.tp.partition, group, max(0, accepted), attempts,
                                                int(time.time() * 1000))))

    def _must_stop_offering(self, part: QueuePartition) -> bool:
        return self._stopping.is_set() or part.revoked or self.desired is not DesiredState.RUNNING

    # --- results ----------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "done":
                self._offer_done(item)
            elif kind == "removed":
                self._removed(*item)
            elif kind == "dead_lettered":
                self._count_dead_letter(item)

    def _offer_done(self, done: _OfferDone) -> None:
        part = self._partitions.get(done.partition)
        redeliveries = max(0, done.attempts - 1)
        self.stats["redeliveries"] += redeliveries
        if part is None:
            return
        part.in_flight = False
        for _ in range(redeliveries):
            part.batcher.rejected()
        for batch in done.batches[:done.accepted]:
            assert part.batcher.offered is batch, "batches are accepted in order"
            commit = part.batcher.accepted()
            part.events_dispatched += len(batch.events)
            part.last_accepted_at = done.at_ms
            self.stats["batches"] += 1 if batch.events else 0
            self.stats["events"] += len(batch.events)
            self.stats["conflated"] += batch.conflated
            self._write_removal(part, batch, commit)
        # The rest stay out and are offered again, after the accepted ones'
        # removals (a sender still awaits their acks); none accepted: parked,
        # offered again when dispatch may go on.

    def _write_removal(self, part: QueuePartition, batch: Batch[AsyncEvent], commit: int) -> None:
        last = batch.events[-1].event_id.to_record() if batch.events else None
        record = {
            "queue_id": self.queue_id,
            "queue_partition": part.tp.partition,
            "batch_id": batch.batch_id,
            "last_removed_offset": commit - 1,
            "last_event_id": last,
            "removed_count": len(batch.events),
            "removed_at": int(time.time() * 1000),
        }
        partition = part.tp.partition

        def removed(err: KafkaError | None, _msg: Message) -> None:
            self._inbox.put(("removed", (partition, commit, err)))

        self._producer.produce(self.removals_topic, self._codec.encode("RemovalRecord", record),
                               str(partition).encode(), on_delivery=removed)
        self._producer.poll(0)

    def _removed(self, partition: int, commit: int, err: KafkaError | None) -> None:
        if err is not None:
            # The batch was accepted; without its removal it is offered again
            # after a restart (possibleDuplicate).  Commit nothing now.
            log.warning("removal record for partition %d not written (%s)", partition, err)
            return
        part = self._partitions.get(partition)
        if part is None:
            return
        part.last_removed_offset = commit - 1
        part.head = commit
        assert self._consumer is not None
        try:
            self._consumer.commit(offsets=[TopicPartition(self.topic, partition, commit)], asynchronous=True)
        except KafkaException as exc:
            log.warning("committing partition %d at %d: %s", partition, commit, exc)

    # --- group callbacks -----------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.assign(partitions)
        self.assignment_starting()
        dispatched_before = self._partitions_dispatched_before()
        for tp in partitions:
            high = self._end_offset(consumer, tp.partition)
            if dispatched_before is None or tp.partition in dispatched_before:
                self.stats["takeovers"] += 1  # another primary (or this one before a restart) had it
            # What a previous primary may have offered (everything up to the
            # end as it is now) comes again flagged possibleDuplicate; a
            # partition nobody ever dispatched has nothing to flag.
            self._partitions[tp.partition] = QueuePartition(
                tp=TopicPartition(self.topic, tp.partition),
                batcher=PartitionBatcher(tp.partition, self.policy, next_batch_id=self.first_batch_id(tp.partition)),
                duplicate_below=high if dispatched_before is None or tp.partition in dispatched_before else 0,
            )
        log.info("queue %s: primary for partitions %s", self.queue_id, sorted(tp.partition for tp in partitions))
        self.assigned = True
        self._publish_status()

    def _end_offset(self, consumer: Consumer, partition: int) -> int:
        """The partition's end offset (asked again while the broker does not answer)."""
        tp = TopicPartition(self.topic, partition)
        return int(until_answered(lambda: consumer.get_watermark_offsets(tp, timeout=10),
                                  f"queue {self.queue_id}: reading the end of {self.topic}[{partition}]",
                                  stopping=self._stopping)[1])

    def _partitions_dispatched_before(self) -> set[int] | None:
        """Partitions some primary has reported on (every primary reports as it
        takes one over); None when that cannot be known."""
        reader = make_consumer(self.cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
        prefix = f"{self.kind}/{self.queue_id}/".encode()
        found: set[int] = set()
        try:
            for msg in read_to_end(reader, self.status_topic):
                key = msg.key() or b""
                if key.startswith(prefix):
                    found.add(int(key[len(prefix):]))
        except (KafkaException, ValueError) as exc:
            # When in doubt, flag: possibleDuplicate is the safe side.
            log.warning("reading %s: %s; flagging every queued event as possibleDuplicate", self.status_topic, exc)
            return None
        finally:
            reader.close()
        return found

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = [self._partitions[tp.partition] for tp in partitions if tp.partition in self._partitions]
        for part in revoked:
            part.revoked = True
        # Let in-flight offers end (the retry loop sees `revoked`), then write
        # the removals of what was accepted, so the next primary starts after it.
        end = time.monotonic() + 30
        while any(p.in_flight for p in revoked) and time.monotonic() < end:
            try:
                kind, item = self._inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "done":
                self._offer_done(item)
            elif kind == "removed":
                self._removed(*item)
            elif kind == "dead_lettered":
                self._count_dead_letter(item)
        if self._producer is not None:
            self._producer.flush(10)
        self._drain_inbox()
        offsets = [TopicPartition(self.topic, p.tp.partition, p.last_removed_offset + 1)
                   for p in revoked if p.last_removed_offset >= 0]
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                log.warning("committing on revoke: %s", exc)
        for part in revoked:
            self._partitions.pop(part.tp.partition, None)
        self._gauges = {p: g for p, g in self._gauges.items() if p in self._partitions}
        self.partitions_released([p.tp.partition for p in revoked])
        log.info("queue %s: revoked partitions %s", self.queue_id, sorted(p.tp.partition for p in revoked))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            part = self._partitions.pop(tp.partition, None)
            if part is not None:
                part.revoked = True
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

    def _publish_status(self) -> None:
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
        oldest = part.batcher.oldest()
        age_s = max(0, now_ms - oldest.event.event_time) / 1000 if oldest is not None else 0.0
        waiting = part.batcher.unaccepted
        consumer = self._consumer
        if consumer is None or part.head < 0:
            return waiting, age_s
        try:
            high = int(consumer.get_watermark_offsets(part.tp, cached=True)[1])
        except (KafkaException, RuntimeError):
            return waiting, age_s
        return (max(waiting, high - part.head) if high >= 0 else waiting), age_s


    alert_repeat_s = 30.0

    def _check_alert(self, part: QueuePartition, now_ms: int, threshold: int) -> None:
        """Geode's alert-threshold: log while the oldest waiting event is older
        than the threshold (when it starts, then every ``alert_repeat_s``), and
        once when it is over."""
        oldest = part.batcher.oldest() if threshold > 0 else None
        age = now_ms - oldest.event.event_time if oldest is not None else 0
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


class _StopWhen(stop_base):
    """tenacity stop condition: stop retrying when ``predicate()`` holds."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate()
