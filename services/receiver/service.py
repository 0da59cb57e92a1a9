"""The gateway receiver: ``sluice receiver -c FILE``, the only entry point for remote sites.

Remote senders write ``GatewayBatch`` records into this site's inbound topic,
keyed ``<source dsid>/<sender id>/<queue partition>``; receivers share its
partitions through a consumer group (HA, scaled by partition).  The story of
one batch, step by step:

0. Each inbound partition this instance is assigned has a lane: a thread
   that handles its batches one after another, in order, while the lanes of
   other partitions work at the same time (a sender partition always writes
   to the same inbound partition, so per-key order holds).  A lane more than
   a few batches behind pauses its partition's fetching.
1. A record that cannot be decoded goes to the site's region dead-letter
   topic with the reason.  A batch from a dsid not in ``receiver.accepted_dsids``,
   or, when ``receiver.sender_keys`` is set, without a valid signature of
   its site's key (core/signing.py), is rejected: counted, dead-lettered,
   never applied, never acknowledged.
2. A batch id at or below the last one applied for its sender partition is
   acknowledged again (``duplicate_batch``) and not applied again (Geode's
   duplicateBatchesReceived).  That tracking survives restarts and failovers:
   it is rebuilt from the acks this site already wrote.
3. Each event is checked (its region exists here, it is an operation that
   crosses sites, it did not come from this site); one that fails becomes a
   per-event exception in the ack.  The rest go to the local region service
   (``apply_remote``), which discards repeats by EventID, resolves WAN
   conflicts by version tag, and writes changelog and queues.  Transient
   failures are retried here, for as long as it takes.
4. Only when every event is durably applied (or refused) is the ack written
   to the acks topic (same key, same partition), and then the inbound offset
   committed.  A crash before that means the batch is read again; its events
   come back as duplicates.

Region-service instances are found through their consumer group, whose
members' client ids carry their URLs, so the receiver needs no address list.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Callable

from tenacity import Retrying, retry_if_exception_type, wait_exponential

from ..client.region import RegionClient, RegionError
from opentelemetry.trace import SpanKind

from ..core import telemetry
from ..core.codec import get_codec
from ..core.config import SiteConfig
from ..region.directory import live_urls, read_instances
from ..core.errors import CodecError, SluiceError
from ..core.events import EntryEvent, goes_to_gateway
from ..core.lifecycle import ServiceState
from ..core.signing import verify
from ..core.kafka import (
    Consumer,
    Interrupted,
    KafkaException,
    Message,
    TopicPartition,
    consume_available,
    make_consumer,
    make_producer,
    produce_durably,
    read_to_end,
    translate,
)

log = logging.getLogger("sluice.receiver")


#: The pause before reading the acks on assignment again.
READ_RETRY_BACKOFF_S = 1.0


class _NoRegionService(SluiceError):
    retriable = True


class _Stopping(Exception):
    """The receiver is stopping in the middle of a batch: it is neither acked nor committed."""


def region_service_urls(cfg: SiteConfig) -> list[str]:
    """URLs of the live region-service instances, from the records they publish (``sluice.region.directory``)."""
    try:
        return live_urls(read_instances(cfg))
    except KafkaException as exc:
        raise translate(exc, "reading the region-service instances") from exc


class _Lane:
    """The batches of one inbound partition, handled in order by one thread."""

    def __init__(self, partition: int, receiver: "ReceiverService") -> None:
        self.partition = partition
        self.queue: queue.Queue[Message | None] = queue.Queue()
        self.stop = threading.Event()  # set on revoke or shutdown
        self.paused = False
        self.error: BaseException | None = None
        self.handled_yet = False  # a batch of this partition was handled since the lane began
        self.thread = threading.Thread(target=self._run, args=(receiver,), daemon=True,
                                       name=f"receiver-lane-{partition}")
        self.thread.start()

    def _run(self, receiver: "ReceiverService") -> None:
        try:
            while not self.stop.is_set():
                msg = self.queue.get()
                if msg is None or self.stop.is_set():
                    return
                receiver._handle(msg, self.stop)
                if not self.handled_yet:
                    # The end of a failover, as an operator (and `sluice soak`) measures it.
                    self.handled_yet = True
                    log.info("receiver %s: first batch handled on inbound partition %d since taking it",
                             receiver.member_id, self.partition)
        except _Stopping:
            return
        except BaseException as exc:  # top of a thread: the service's loop re-raises it
            self.error = exc

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the batch in hand (its retries cut short); what is queued is dropped, not committed."""
        self.stop.set()
        self.queue.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("receiver lane %d still busy after %.0f s", self.partition, timeout_s)


class ReceiverService:
    """One gateway-receiver instance of a site."""

    status_interval_s = 2.0
    #: A lane this many batches behind pauses its partition; it resumes below LANE_RESUME.
    LANE_DEPTH = 8
    LANE_RESUME = 2

    def __init__(self, cfg: SiteConfig, *, member_id: str | None = None) -> None:
        if cfg.receiver is None:
            raise SluiceError(f"site {cfg.site!r} has no receiver section in its site file")
        self.cfg = cfg
        self.accepted = set(cfg.receiver.accepted_dsids)
        self.member_id = member_id or f"{cfg.site}-receiver-{uuid.uuid4().hex[:8]}"
        names = cfg.topics
        self.inbound = names.gateway_inbound()
        self.acks = names.gateway_acks()
        self.dead_letter = names.region_dead_letter()
        self.group_id = f"{cfg.kafka.topic_prefix}gateway.receiver"
        self.region_group = f"{cfg.kafka.topic_prefix}region"
        self.regions = {r.name: r for r in cfg.regions}
        self.state = ServiceState.NEW
        self.crash: BaseException | None = None
        self._stopping = threading.Event()
        self._codec = get_codec()
        self._last_batch: dict[str, int] = {}
        self._consumer: Consumer | None = None
        self._producer: Any = None
        self._client: RegionClient | None = None
        self._client_lock = threading.Lock()
        self._lanes: dict[int, _Lane] = {}
        self._done: queue.Queue[TopicPartition] = queue.Queue()  # offsets to commit, from the lanes
        self._sender_keys = {dsid: key.get_secret_value().encode()
                             for dsid, key in cfg.receiver.sender_keys.items()}
        if not self._sender_keys:
            log.warning("receiver of dsid %d: no sender_keys, batches are not verified (accepted dsids %s)",
                        cfg.dsid, sorted(self.accepted))
        self._stats_lock = threading.Lock()
        self.stats = {"batches": 0, "duplicate_batches": 0, "rejected_batches": 0, "bad_signatures": 0,
                      "events_applied": 0, "events_duplicate": 0, "conflicts": 0, "exceptions": 0,
                      "dead_lettered": 0}
        #: The group has given this member its assignment (possibly none) and it was not lost since.
        self.assigned = False
        self._instrument()
        #: Spans are exported: a span per received event that came with a trace context.
        self._tracing = telemetry.tracing()

    # --- health and metrics ------------------------------------------------------

    def readiness(self) -> dict[str, str]:
        """What is not ready (empty when ready), for /readyz: the group's assignment, with
        the batch tracking rebuilt from this site's acks."""
        if not self.assigned:
            return {"kafka": f"no assignment from consumer group {self.group_id} yet (joining, or lost)"}
        return {}

    def _instrument(self) -> None:
        telemetry.observe(telemetry.EVENTS_APPLIED, self._read_stats("events_applied"))
        telemetry.observe(telemetry.DUPLICATES_DISCARDED, self._read_duplicates)
        telemetry.observe(telemetry.CONFLICTS_RESOLVED, self._read_stats("conflicts"))
        telemetry.observe(telemetry.DEAD_LETTERED, self._read_stats("dead_lettered"))
        telemetry.observe(telemetry.BATCHES_REJECTED, self._read_stats("rejected_batches", "bad_signatures"))
        telemetry.observe(telemetry.BATCHES_ACKNOWLEDGED, self._read_stats("batches", "duplicate_batches"))

    def _attributes(self, **more: Any) -> dict[str, Any]:
        return {**telemetry.base_attributes(self.cfg.site), "sluice.component": "receiver",
                "messaging.destination.name": self.inbound, "messaging.consumer.group.name": self.group_id, **more}

    def _read_stats(self, *names: str) -> Callable[[], telemetry.Reading]:
        """A metric reader of the sum of the counters ``names``."""
        return telemetry.reader(self, lambda receiver: sum(receiver.stats[n] for n in names),
                                lambda receiver: receiver._attributes())

    def _read_duplicates(self) -> telemetry.Reading:
        return [(self.stats["events_duplicate"], self._attributes(**{"sluice.duplicate.of": "event"})),
                (self.stats["duplicate_batches"], self._attributes(**{"sluice.duplicate.of": "batch"}))]

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        base = self.cfg.kafka.client_settings()
        self._producer = make_producer(base, **{"client.id": self.member_id}, **self.cfg.kafka.producer_settings())
        self._consumer = make_consumer(base, self.group_id, **{"client.id": self.member_id},
                                       **self.cfg.kafka.group_settings())
        self.state = ServiceState.RUNNING

    def stop(self) -> None:
        if self.state in (ServiceState.NEW, ServiceState.RUNNING):
            self.state = ServiceState.STOPPING
        self._stopping.set()
        for lane in list(self._lanes.values()):
            lane.stop.set()

    def run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        consumer.subscribe([self.inbound], on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_lost)
        next_status = time.monotonic()
        try:
            while not self._stopping.is_set():
                try:
                    msgs = consume_available(consumer, 100, 0.1)
                except KafkaException as exc:
                    raise translate(exc, f"consuming {self.inbound}") from exc
                for msg in msgs:
                    if msg.error() is None:
                        lane = self._lanes.get(msg.partition())
                        if lane is not None:
                            lane.queue.put(msg)
                self._commit_done(consumer)
                self._tend_lanes(consumer)
                if time.monotonic() >= next_status:
                    self._publish_status()
                    next_status = time.monotonic() + self.status_interval_s
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                self.crash = exc
                self.state = ServiceState.CRASHED
            raise
        finally:
            for lane in list(self._lanes.values()):
                lane.close()
            self._lanes.clear()
            self._commit_done(consumer, asynchronous=False)
            try:
                consumer.close()
            except (KafkaException, RuntimeError) as exc:
                log.warning("closing the consumer: %s", exc)
            if self._producer is not None:
                self._producer.flush(10)
            if self._client is not None:
                self._client.close()
            if self.state is not ServiceState.CRASHED:
                self.state = ServiceState.STOPPED

    # --- assignment: rebuild the duplicate-batch tracking from our own acks ----------

    def _tend_lanes(self, consumer: Consumer) -> None:
        """Re-raise a lane's crash; pause a partition whose lane is behind, resume it when caught up."""
        for lane in list(self._lanes.values()):
            if lane.error is not None:
                raise lane.error
            depth = lane.queue.qsize()
            tp = [TopicPartition(self.inbound, lane.partition)]
            if not lane.paused and depth >= self.LANE_DEPTH:
                consumer.pause(tp)
                lane.paused = True
                log.info("receiver %s: inbound partition %d paused, %d batches waiting", self.member_id,
                         lane.partition, depth)
            elif lane.paused and depth <= self.LANE_RESUME:
                consumer.resume(tp)
                lane.paused = False
                log.info("receiver %s: inbound partition %d resumed", self.member_id, lane.partition)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Lanes of revoked partitions finish the batch in hand (or give it up) before the next owner starts."""
        for tp in partitions:
            lane = self._lanes.pop(tp.partition, None)
            if lane is not None:
                lane.close()
        self._commit_done(consumer, asynchronous=False)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The session expired (a broker paused or unreachable): stop the lanes, commit nothing.

        A member that lost its partitions cannot commit their offsets, and a
        synchronous commit here waits on a coordinator that may not be back
        for a long time, with the whole receiver stopped inside consume().  The
        batches done but not committed are read again by the next owner, which
        answers them as duplicates from the acks it reads first."""
        self.assigned = False
        lost = {tp.partition for tp in partitions}
        for partition in lost:
            lane = self._lanes.pop(partition, None)
            if lane is not None:
                lane.close()
        kept = []
        while True:
            try:
                tp = self._done.get_nowait()
            except queue.Empty:
                break
            if tp.partition not in lost:
                kept.append(tp)
        for tp in kept:
            self._done.put(tp)
        log.warning("receiver %s: lost inbound partitions %s (session expired)", self.member_id, sorted(lost))

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.assign(partitions)
        # librdkafka keeps a partition's pause across a rebalance: one paused
        # here before (its lane was behind) would never be fetched again.
        consumer.resume(partitions)
        # The broker that just handed out this assignment can become
        # unreachable again at once (a flapping network, a broker paused
        # again): an exception raised here leaves consume() and would crash
        # the receiver over a transient fault, so the read is retried.
        while True:
            try:
                self._read_acks(partitions)
                break
            except SluiceError as exc:
                if not exc.retriable:
                    raise
                log.warning("receiver %s: %s; reading them again", self.member_id, exc)
                if self._stopping.wait(READ_RETRY_BACKOFF_S):
                    return
        for tp in partitions:
            old = self._lanes.pop(tp.partition, None)
            if old is not None:
                old.close()
            self._lanes[tp.partition] = _Lane(tp.partition, self)
        log.info("receiver %s: inbound partitions %s, %d sender partitions tracked", self.member_id,
                 sorted(tp.partition for tp in partitions), len(self._last_batch))
        self.assigned = True

    def _read_acks(self, partitions: list[TopicPartition]) -> None:
        reader = make_consumer(self.cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
        try:
            for tp in partitions:
                for msg in read_to_end(reader, self.acks, tp.partition, deadline_s=30):
                    try:
                        ack = self._codec.decode_as("GatewayAck", msg.value())
                    except CodecError:
                        continue
                    key = (msg.key() or b"").decode("utf-8", "replace")
                    self._last_batch[key] = max(self._last_batch.get(key, -1), ack["batch_id"])
        except KafkaException as exc:
            raise translate(exc, f"reading {self.acks}") from exc
        finally:
            reader.close()

    # --- one batch -----------------------------------------------------------------------

    def _publish_status(self) -> None:
        """What ``sluice admin status`` shows of this receiver, to the site's compacted status topic."""
        with self._stats_lock:
            record = {"member": self.member_id, "dsid": self.cfg.dsid, "partitions": sorted(self._lanes),
                      **self.stats, "updated_at": int(time.time() * 1000)}
        self._producer.produce(self.cfg.topics.status(), self._codec.encode("ReceiverStatus", record),
                               f"receiver/{self.member_id}".encode())
        self._producer.poll(0)

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    def _handle(self, msg: Message, stop: threading.Event) -> None:
        """One batch, on its partition's lane; ``stop`` cuts retries short (revoke, shutdown)."""
        try:
            batch = self._codec.decode_as("GatewayBatch", msg.value())
        except CodecError as exc:
            self._dead_letter(msg, f"undecodable gateway batch: {exc}", type(exc).__name__, stop)
            self._commit(msg)
            return
        source = batch["source_dsid"]
        key = f"{source}/{batch['sender_id']}/{batch['queue_partition']}"
        rejection = self._rejection(batch)
        if rejection is not None:
            self._count("rejected_batches")
            log.warning("%s (sender %s)", rejection[1], batch["sender_id"])
            self._dead_letter(msg, rejection[1], rejection[0], stop)
            self._commit(msg)
            return
        if batch["batch_id"] <= self._last_batch.get(key, -1):
            self._count("duplicate_batches")
            self._ack(msg, key, batch, last_applied=len(batch["events"]) - 1, exceptions=[], duplicate=True,
                      stop=stop)
            self._commit(msg)
            return
        events = [EntryEvent.from_record(e) for e in batch["events"]]
        traces, spans = self._receive_spans(msg, batch, len(events))
        try:
            exceptions, last_applied = self._apply(events, stop, traces)
        finally:
            for span in spans:
                span.end()
        self._ack(msg, key, batch, last_applied=last_applied, exceptions=exceptions, duplicate=False, stop=stop)
        self._last_batch[key] = batch["batch_id"]
        self._count("batches")
        self._commit(msg)

    def _receive_spans(self, msg: Message, batch: dict[str, Any], count: int) -> tuple[list[str | None], list[Any]]:
        """Each event's trace context from the batch's header (None for one without),
        and, with tracing on, a ``gateway.receive`` span for each, whose context
        then goes with its event to the region service."""
        raw = telemetry.header(msg.headers(), telemetry.BATCH_TRACEPARENTS)
        if raw is None:
            return [None] * count, []
        lines = raw.decode("ascii", "replace").split("\n")
        traces: list[str | None] = [(lines[i] or None) if i < len(lines) else None for i in range(count)]
        if not self._tracing:
            return traces, []  # passed on as they came
        attributes = {**self._attributes(), "messaging.operation.name": "process",
                      "messaging.destination.partition.id": str(msg.partition()),
                      "sluice.batch.id": batch["batch_id"], "sluice.source.dsid": batch["source_dsid"]}
        spans = []
        for i, parent in enumerate(traces):
            if parent is not None:
                span = telemetry.start_span("gateway.receive", parent=parent, kind=SpanKind.CONSUMER,
                                            attributes=attributes)
                spans.append(span)
                traces[i] = telemetry.traceparent_of(span)
        return traces, spans

    def _rejection(self, batch: dict[str, Any]) -> tuple[str, str] | None:
        """(error class, reason) when the batch must not be applied here."""
        source = batch["source_dsid"]
        if source not in self.accepted:
            return "RejectedBatch", (f"batch {batch['batch_id']} from dsid {source} rejected: accepted dsids are "
                                     f"{sorted(self.accepted)}")
        if batch["target_dsid"] != self.cfg.dsid:
            return "RejectedBatch", f"batch for dsid {batch['target_dsid']} reached dsid {self.cfg.dsid}"
        if self._sender_keys and not verify(self._codec, self._sender_keys[source], batch):
            self._count("bad_signatures")
            return "BadSignature", (f"batch {batch['batch_id']} from dsid {source} rejected: "
                                    + ("it is not signed" if not batch.get("signature") else
                                       "its signature does not match dsid's key in receiver.sender_keys"))
        return None

    def _refusal(self, event: EntryEvent) -> tuple[str, str] | None:
        region = self.regions.get(event.region)
        if region is None:
            return "UnknownRegion", f"region {event.region!r} is not configured at dsid {self.cfg.dsid}"
        if not goes_to_gateway(event.operation):
            return "InvalidRequest", f"{event.operation.value} does not cross sites"
        if event.origin_dsid == self.cfg.dsid:
            return "InvalidRequest", f"event of dsid {self.cfg.dsid} came back to it"
        if len(event.key.encode("utf-8")) > region.key_max_bytes:
            return "EntryTooLarge", f"key of {len(event.key.encode())} bytes > key_max_bytes {region.key_max_bytes}"
        if event.value is not None and len(event.value) > region.value_max_bytes:
            return "EntryTooLarge", f"value of {len(event.value)} bytes > value_max_bytes {region.value_max_bytes}"
        return None

    def _apply(self, events: list[EntryEvent], stop: threading.Event,
               traces: list[str | None]) -> tuple[list[dict[str, Any]], int]:
        """Apply what can be applied; (per-event exceptions, index of the last applied event).
        ``traces``: each event's trace context, passed on to the region service."""
        exceptions: list[dict[str, Any]] = []
        by_region: dict[str, list[tuple[int, EntryEvent]]] = defaultdict(list)
        for i, event in enumerate(events):
            refusal = self._refusal(event)
            if refusal is not None:
                exceptions.append({"index": i, "event_id": event.event_id.to_record(),
                                   "exception_class": refusal[0], "message": refusal[1]})
                continue
            by_region[event.region].append((i, event))
        applied: set[int] = set()
        for region, items in by_region.items():
            contexts = [traces[i] for i, _ in items]
            answer = self._apply_region(region, [e for _, e in items], stop,
                                        contexts if any(contexts) else None)
            for (i, event), outcome in zip(items, answer["outcomes"]):
                status = outcome["status"]
                if status == "error":
                    err = outcome.get("error", {})
                    exceptions.append({"index": i, "event_id": event.event_id.to_record(),
                                       "exception_class": err.get("error", "Error"),
                                       "message": err.get("message", "")})
                    continue
                applied.add(i)
                self._count("events_applied" if status == "ok" else "events_duplicate" if status == "duplicate"
                            else "conflicts")
        self._count("exceptions", len(exceptions))
        for e in exceptions:
            log.warning("event %d refused: %s: %s", e["index"], e["exception_class"], e["message"])
        return sorted(exceptions, key=lambda e: e["index"]), max(applied, default=-1)

    def _apply_region(self, region: str, events: list[EntryEvent], stop: threading.Event,
                      traces: list[str | None] | None = None) -> dict[str, Any]:
        """Retried here until the region service answers: nothing is acknowledged before that.

        ``RegionClient`` retries transient failures for its own ``retry_for_s``
        and then raises a retriable ``SluiceError``: while this site's broker
        is unreachable for longer than that (the region service answers 503
        "not acknowledged by Kafka in time" to every write), it is retried
        here, for as long as it takes.
        """
        for attempt in Retrying(
            retry=retry_if_exception_type((SluiceError,)),
            wait=wait_exponential(multiplier=0.1, max=5),
            sleep=lambda s: stop.wait(s) and None,
            before_sleep=lambda state: self._forget_region_client(
                f"applying {len(events)} events to {region}, attempt {state.attempt_number}: "
                f"{state.outcome.exception() if state.outcome else None}; trying again"),
            reraise=True,
        ):
            with attempt:
                if stop.is_set():
                    raise _Stopping
                answer = self._region_client().apply_remote(region, events, outcomes="all", traces=traces)
                return answer
        raise AssertionError("unreachable")  # pragma: no cover

    def _configured_region_url(self) -> list[str]:
        """When the group lists no members (a broker that describes groups
        without them, such as Tansu 0.6), the site file's region-service
        address: ``advertised_url`` (e.g. a Kubernetes Service in front of
        every instance), else ``host:port`` when the port is fixed."""
        rs = self.cfg.region_service
        if rs.advertised_url:
            return [rs.advertised_url]
        return [f"http://{rs.host}:{rs.port}"] if rs.port else []

    def _forget_region_client(self, why: str) -> None:
        """After a failure the region-service instances are looked up again (one may have moved)."""
        log.warning("%s", why)
        with self._client_lock:
            # Not closed: another lane may be using it; it goes with its last user.
            self._client = None

    def _region_client(self) -> RegionClient:
        with self._client_lock:
            if self._client is None:
                urls = region_service_urls(self.cfg) or self._configured_region_url()
                if not urls:
                    raise _NoRegionService("no region-service instance is running at this site")
                # Short: _apply_region retries for as long as it takes, and checks between
                # attempts whether the lane must stop (a rebalance waits for that).
                self._client = RegionClient(urls, retry_for_s=3)
            return self._client

    # --- acks, dead letters, commits ---------------------------------------------------------

    def _ack(self, msg: Message, key: str, batch: dict[str, Any], *, last_applied: int,
             exceptions: list[dict[str, Any]], duplicate: bool, stop: threading.Event) -> None:
        events = batch["events"]
        record = {
            "sender_id": batch["sender_id"],
            "source_dsid": batch["source_dsid"],
            "receiver_dsid": self.cfg.dsid,
            "queue_partition": batch["queue_partition"],
            "batch_id": batch["batch_id"],
            "last_applied_index": last_applied,
            "last_applied_event_id": events[last_applied]["event_id"] if 0 <= last_applied < len(events) else None,
            "duplicate_batch": duplicate,
            "exceptions": exceptions,
            "acked_at": int(time.time() * 1000),
        }
        self._write(f"ack of batch {batch['batch_id']} ({key})", self.acks, self._codec.encode("GatewayAck", record),
                    key.encode(), stop, partition=msg.partition())

    def _dead_letter(self, msg: Message, reason: str, error_class: str, stop: threading.Event) -> None:
        record = {"source_topic": msg.topic(), "source_partition": msg.partition(), "source_offset": msg.offset(),
                  "key": msg.key(), "value": msg.value(), "reason": reason, "error_class": error_class,
                  "event": None, "service": f"receiver {self.member_id}", "failed_at": int(time.time() * 1000)}
        self._write(f"dead letter for {msg.topic()}[{msg.partition()}]@{msg.offset()}", self.dead_letter,
                    self._codec.encode("DeadLetter", record), msg.key(), stop)
        self._count("dead_lettered")

    def _write(self, what: str, topic: str, value: bytes, key: bytes | None, stop: threading.Event, *,
               partition: int | None = None) -> None:
        """One ack or dead letter, durable however long this site's broker is away
        (``produce_durably``).  Stopping raises ``_Stopping``: the batch is then
        not committed, so it is read again and acknowledged as a duplicate."""
        try:
            produce_durably(self._producer, topic, value, key, what=what, stopping=stop, partition=partition)
        except Interrupted:
            raise _Stopping from None

    def _commit(self, msg: Message) -> None:
        """Lane side: the batch is done.  The consumer is the main loop's: a
        commit from a lane while the loop sits in consume() blocks, so the
        loop commits (``_commit_done``)."""
        self._done.put(TopicPartition(msg.topic(), msg.partition(), msg.offset() + 1))

    def _commit_done(self, consumer: Consumer, asynchronous: bool = True) -> None:
        """Commit the newest done offset of each partition."""
        newest: dict[int, TopicPartition] = {}
        while True:
            try:
                tp = self._done.get_nowait()
            except queue.Empty:
                break
            newest[tp.partition] = tp
        if not newest:
            return
        try:
            consumer.commit(offsets=list(newest.values()), asynchronous=asynchronous)
        except KafkaException as exc:
            log.warning("committing %s: %s", sorted(newest), exc)


__all__ = ["ReceiverService", "RegionError", "region_service_urls"]
