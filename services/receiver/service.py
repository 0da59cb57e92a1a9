"""The gateway receiver: ``sluice receiver -c FILE``, the only entry point for remote sites.

Remote senders write ``GatewayBatch`` records into this site's inbound topic,
keyed ``<source dsid>/<sender id>/<queue partition>``; receivers share its
partitions through a consumer group (HA, scaled by partition).  The story of
one batch, step by step:

0. Each inbound partition this instance is assigned has a lane (lanes.py): a thread
   that handles its batches one after another, in order, while the lanes of
   other partitions work at the same time (a sender partition always writes
   to the same inbound partition, so per-key order holds).  A lane more than
   a few batches behind pauses its partition's fetching.
1. A signing site (``gateway_private_key``; core/signing.py) first verifies
   the record's Ed25519 signature over the value bytes as received, with the
   public key of the dsid its ``sluice-signer`` header names, before reading
   anything else; a record that cannot be decoded goes to the site's region
   dead-letter topic with the reason.  A batch is rejected (counted,
   dead-lettered, never applied, never acknowledged) when its signature is
   missing or wrong, when its ``source_dsid`` is not the signer (a batch
   cannot be re-labelled), when it comes from a dsid not in
   ``receiver.accepted_dsids`` or is meant for another dsid, and when its
   ``created_at`` is older than ``receiver.batch_max_age_ms`` or later than
   now + ``region_service.max_clock_skew_ms`` (a signed batch recorded from
   the wire is not replayed once the acks that mark it a duplicate have
   expired; a sender stamps every send anew).
2. A batch id at or below the last one applied for its sender partition is
   acknowledged again (``duplicate_batch``) and not applied again (Geode's
   duplicateBatchesReceived).  That tracking survives restarts and failovers:
   it is rebuilt from the acks this site already wrote, each verified with
   this site's own key, so no other writer of the acks topic can pin a
   sender partition.  Every ack carries ``last_batch_id``, the highest id
   applied for the sender partition: a sender whose batch ids started over
   (its removals topic lost) opens an epoch above it (sender/service.py).
3. The receiver routes; the owner checks and applies (routing.py): each
   event goes, as its body, to the region-service instance that owns its
   bucket, in requests of at most ``receiver.apply_events_max`` events, and is
   applied or refused for good there.  What may succeed later is retried here,
   in order, for as long as it takes.
4. Only when every event is durably applied (or refused) is the ack written
   to the acks topic (same key, same partition), signed, and then the
   inbound offset committed.  A crash before that means the batch is read
   again; its events come back as duplicates.  The ack carries the inbound
   partition's figures over all its owners, this batch counted, in a header
   of its own (core/receivertotals.py): the next owner of the partition
   continues from them, whatever became of this process.

The decisions of these steps (which inbound partition is this member's,
which batch is a duplicate, what its ack and figures say, which offset is
committed when, which failure is retried) are ``protocol.py``'s, a pure
protocol with no Kafka, thread or clock; this module reads, routes, writes
and commits as it says.

Region-service instances are found through the records they publish on the
status topic (``sluice.core.directory``: believed only when signed with the
member token and naming a host ``member_hosts`` allows), read by a thread of
the receiver's own, so the receiver needs no address list; it calls them with
``region_service.member_token``.  Every ack says which GatewayBatch versions
this receiver reads (``batch_versions``): a sender writes version 3 (events
as bodies) only to a receiver that said so, and version 2 before.

The receiver follows the site's control topic (core/control.py, key
``gateway-receiver/receiver``): with ``receiver.manual_start`` it starts
stopped, out of the inbound topic's consumer group, until ``sluice admin -c
FILE start --receiver``; ``stop --receiver`` takes it out again.  A remote
sender whose batches stop coming for ``receiver.max_time_between_pings_ms``
is reported not connected (``ReceiverService``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

from opentelemetry.trace import SpanKind

from ..core import receivertotals as figures_of
from ..core import telemetry
from ..core.codec import get_codec
from ..core.config import SiteConfig
from ..core.control import RECEIVER_ID, RECEIVER_KIND, ControlFollower
from ..core.directory import OwnerDirectory, live_urls, read_instances
from ..core.errors import (
    BadSignature,
    CodecError,
    InvalidRequest,
    RejectedBatch,
    SluiceError,
    StaleBatch,
)
from ..core.eventwire import (
    BATCH_VERSIONS_READ,
    BatchView,
    read_gateway_batch,
)
from ..core.lifecycle import Service
from ..core.loop import PartitionLoop
from ..core.queueloop import DesiredState
from ..core.receivertotals import PartitionTotals
from ..core.regionclient import BatchClient, RegionError
from ..core.signing import Headers, Signer, Verifier, site_signer, site_verifier
from ..core.kafka import (
    FLUSH_DEADLINE_S,
    Consumer,
    Message,
    TopicPartition,
    close_consumer,
    kafka_errors,
    make_consumer,
    make_producer,
    produce_durably,
)
from .protocol import (
    Ack,
    Duplicate,
    ReceiverProtocol,
    batch_problem,
)
from .acks import read_own_acks, read_published_figures
from .lanes import LANE_DEPTH, LANE_RESUME, RECEIVE_MAX_RECORDS, Lane
from .routing import OwnerRouting, event_id_of

log = logging.getLogger("sluice.receiver")


#: The pause before reading the acks on assignment again.
READ_RETRY_BACKOFF_S = 1.0
#: An alert that goes on is logged again this often (and counted each time).
ALERT_REPEAT_S = 30.0
#: How often the receiver's directory thread reads the claims published since its last read.
DIRECTORY_REFRESH_S = 0.5
#: How long a turn of the loop waits for the first inbound record (``lanes.RECEIVE_MAX_RECORDS`` at most).
RECEIVE_WAIT_S = 0.1
#: Shutdown deadline: a helper thread's join.
THREAD_JOIN_DEADLINE_S = 5.0


def region_service_urls(cfg: SiteConfig) -> list[str]:
    """URLs of the live region-service instances, from the records they publish (``sluice.core.directory``)."""
    with kafka_errors("reading the region-service instances"):
        return live_urls(read_instances(cfg))


@dataclass
class _Sender:
    """A remote gateway sender as this process hears it (main thread and lanes, under the stats lock)."""

    source_dsid: int
    sender_id: str
    last_heard_at_ms: int
    last_heard_s: float  # time.monotonic()
    batches: int = 0
    connected: bool = True


class ReceiverService(Service):
    """One gateway-receiver instance of a site.

    Lifecycle, and the receiver's desired state (Geode's start and stop of a
    gateway receiver, steered through the control topic, core/control.py)::

        NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                            └── a lane or the loop died ──► CRASHED (exit non-zero)

        desired RUNNING ◄── sluice admin start --receiver ──  desired STOPPED
        (in the consumer group,  ── sluice admin stop --receiver ──►  (out of the group: its partitions
         applying batches)                                             go to the running receivers)

    The desired state starts STOPPED with ``receiver.manual_start``, RUNNING
    otherwise, and then is whatever the control topic last said.

    A remote sender counts as connected while a batch of it (one that passed
    verification) came within ``receiver.max_time_between_pings_ms``: senders
    reach the receiver through Kafka and send no pings of their own, so a
    batch is the ping (Geode's receiver likewise takes any message on a
    connection as a sign of life).  It shows in ``sluice admin status`` and in
    the gauge ``sluice.gateway.sender.connected``; a sender going quiet or
    coming back is logged.
    """

    status_interval_s = 2.0
    LANE_DEPTH = LANE_DEPTH
    LANE_RESUME = LANE_RESUME

    kind = "receiver"

    def __init__(self, cfg: SiteConfig, *, member_id: str | None = None) -> None:
        if cfg.receiver is None:
            raise SluiceError(f"site {cfg.site!r} has no receiver section in its site file")
        super().__init__()
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
        self._codec = get_codec()
        self._consumer: Consumer | None = None
        self._producer: Any = None
        self._client: BatchClient | None = None
        self._directory: OwnerDirectory | None = None
        self._directory_thread: threading.Thread | None = None
        #: Step 3, from start(): routing each batch's events to their owners (routing.py).
        self._routing: OwnerRouting | None = None
        self._lanes: dict[int, Lane] = {}
        #: The receiver's decisions (protocol.py): lanes and the loop call it under ``_protocol_lock``.
        self._protocol = ReceiverProtocol(self.inbound, cfg.dsid, self.member_id)
        self._protocol_lock = threading.Lock()
        rs = cfg.region_service
        self._member_token = rs.member_token.get_secret_value() if rs.member_token is not None else None
        self._batch_max_age_ms = cfg.receiver.batch_max_age_ms
        self._clock_skew_ms = rs.max_clock_skew_ms
        self._ping_max_s = cfg.receiver.max_time_between_pings_ms / 1000
        self.desired = DesiredState.STOPPED if cfg.receiver.manual_start else DesiredState.RUNNING
        self._control: ControlFollower | None = None
        #: Subscribed to the inbound topic (the desired state is RUNNING and the loop followed it).
        self._subscribed = False
        self._loop: PartitionLoop | None = None
        #: (source dsid, sender id) -> what this process heard of that sender.
        self._senders: dict[tuple[int, str], _Sender] = {}
        #: Per inbound partition, the figures last written to the status topic (none: publish them).
        self._published: dict[int, PartitionTotals] = {}
        # Signing is all or nothing per site (the site file is refused otherwise): with a private
        # key, every accepted dsid has a public key, batches are verified and acks signed.
        self._signer: Signer | None = site_signer(cfg)
        self._verifier: Verifier | None = site_verifier(cfg, self.accepted)
        #: This site's own acks, verified when the duplicate tracking is rebuilt from them.
        self._own_acks = Verifier({cfg.dsid: [self._signer.public_key]}) if self._signer is not None else None
        if self._verifier is None:
            log.warning("receiver of dsid %d: no gateway keys, batches are not verified (accepted dsids %s); "
                        "set gateway_private_key and gateway_public_keys", cfg.dsid, sorted(self.accepted))
        self._stats_lock = threading.Lock()
        self.stats = {"batches": 0, "duplicate_batches": 0, "duplicate_batch_events": 0, "rejected_batches": 0,
                      "bad_signatures": 0,
                      "stale_batches": 0, "events_applied": 0, "events_recovered": 0, "events_duplicate": 0,
                      "conflicts": 0, "exceptions": 0, "dead_lettered": 0, "acks_unverified": 0,
                      "unauthorized_alerts": 0}
        self._unauthorized_logged_at = 0.0
        #: The group has given this member its assignment (possibly none) and it was not lost since.
        self.assigned = False
        self._instrument()
        #: Spans are exported: a span per received event that came with a trace context.
        self._tracing = telemetry.tracing()

    # --- health and metrics ------------------------------------------------------

    def readiness(self) -> dict[str, str]:
        """What is not ready (empty when ready), for /readyz: the group's assignment, with
        the batch tracking rebuilt from this site's acks.  A receiver stopped on purpose
        (manual_start, or ``sluice admin stop --receiver``) is ready: it does what it was told."""
        if self.desired is DesiredState.STOPPED:
            return {}
        if not self.assigned:
            return {"kafka": f"no assignment from consumer group {self.group_id} yet (joining, or lost)"}
        return {}

    def _instrument(self) -> None:
        telemetry.observe(telemetry.EVENTS_APPLIED, self._read_stats("events_applied"))
        telemetry.observe(telemetry.DUPLICATES_DISCARDED, self._read_duplicates)
        telemetry.observe(telemetry.CONFLICTS_RESOLVED, self._read_stats("conflicts"))
        telemetry.observe(telemetry.DEAD_LETTERED, self._read_stats("dead_lettered"))
        # rejected_batches counts the bad signatures too (bad_signatures says how many of them).
        telemetry.observe(telemetry.BATCHES_REJECTED, self._read_stats("rejected_batches"))
        telemetry.observe(telemetry.BATCHES_ACKNOWLEDGED, self._read_stats("batches", "duplicate_batches"))
        telemetry.observe(telemetry.ALERTS, telemetry.reader(
            self, lambda receiver: receiver.stats["unauthorized_alerts"],
            lambda receiver: receiver._attributes(**{"sluice.alert.name": "region_unauthorized"})))
        telemetry.observe(telemetry.SENDER_CONNECTED, self._read_senders, gauge=True)
        telemetry.observe(telemetry.DUPLICATE_BATCHES, self._read_stats("duplicate_batches"))

    def _attributes(self, **more: Any) -> dict[str, Any]:
        return {**telemetry.base_attributes(self.cfg.site), "sluice.component": "receiver",
                "messaging.destination.name": self.inbound, "messaging.consumer.group.name": self.group_id, **more}

    def _read_stats(self, *names: str) -> Callable[[], telemetry.Reading]:
        """A metric reader of the sum of the counters ``names``."""
        return telemetry.reader(self, lambda receiver: sum(receiver.stats[n] for n in names),
                                lambda receiver: receiver._attributes())

    def _read_senders(self) -> telemetry.Reading:
        with self._stats_lock:
            senders = list(self._senders.values())
        return [(1 if s.connected else 0, self._attributes(**{"sluice.source.dsid": s.source_dsid,
                                                               "sluice.sender.id": s.sender_id}))
                for s in senders]

    def _read_duplicates(self) -> telemetry.Reading:
        return [(self.stats["events_duplicate"], self._attributes(**{"sluice.duplicate.of": "event"})),
                (self.stats["duplicate_batch_events"], self._attributes(**{"sluice.duplicate.of": "batch"}))]

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._check_startable()
        base = self.cfg.kafka.client_settings()
        self._producer = make_producer(base, **{"client.id": self.member_id}, **self.cfg.kafka.producer_settings())
        self._consumer = make_consumer(base, self.group_id, **{"client.id": self.member_id},
                                       **self.cfg.kafka.group_settings())
        self._client = BatchClient(token=self._member_token)
        self._directory = OwnerDirectory(self.cfg)
        self._routing = OwnerRouting(self.cfg, self._client, self._directory, self._codec.header("GatewayBatch"),
                                     refresh=self._refresh_directory, count=self._count,
                                     alert_unauthorized=self._alert_unauthorized)
        self._directory_thread = self.spawn(self._read_directory, name="receiver-directory")
        self._control = ControlFollower(self.cfg, RECEIVER_KIND, RECEIVER_ID, client_id=f"{self.member_id}-control")
        for record in self._control.read_to_end():
            self._apply_control(record)
        self._set_running()
        if self.desired is DesiredState.STOPPED:
            log.info("receiver %s starts stopped (%s): it applies nothing until `sluice admin -c FILE start "
                     "--receiver`", self.member_id,
                     "receiver.manual_start" if self.cfg.receiver and self.cfg.receiver.manual_start else
                     "the control topic says STOPPED")

    def _apply_control(self, record: dict[str, Any]) -> None:
        """A control record for the site's receiver: RUNNING or STOPPED (PAUSED is not a receiver's state:
        ``sluice admin`` never writes it; one written by another tool is taken as STOPPED)."""
        desired = DesiredState.RUNNING if record["state"] == DesiredState.RUNNING.value else DesiredState.STOPPED
        if desired is not self.desired:
            log.info("receiver %s: %s → %s (by %s)", self.member_id, self.desired.value, desired.value,
                     record["issued_by"] or "?")
            self.desired = desired

    def _read_directory(self) -> None:
        """Directory thread: the owners' claims as they are published (the lanes only look them up)."""
        directory = self._directory
        assert directory is not None
        while not self._stopping.is_set():
            self._refresh_directory()
            self._stopping.wait(DIRECTORY_REFRESH_S)

    def _refresh_directory(self) -> None:
        try:
            if self._directory is not None:
                with kafka_errors("reading the region directory"):
                    self._directory.refresh()
        except (SluiceError, RuntimeError) as exc:  # RuntimeError: closed while stopping
            log.debug("reading the region directory: %s", exc)

    def on_stop(self) -> None:
        """Each lane gives up the batch in hand (its retries cut short): neither acked nor committed."""
        for lane in list(self._lanes.values()):
            lane.stop.set()

    def run(self) -> None:
        """The partition loop (core/loop.py), in the calling thread, until ``stop()``; a lane's crash
        is the receiver's."""
        consumer = self._consumer
        assert consumer is not None
        self._loop = PartitionLoop(self, consumer, [self.inbound], self, read_max_records=RECEIVE_MAX_RECORDS,
                                   status_interval_s=self.status_interval_s)
        try:
            self._loop.run()
        finally:
            self._shutdown(consumer)

    def poll_timeout_s(self) -> float:
        return RECEIVE_WAIT_S

    def turn(self, msgs: list[Message]) -> None:
        """The inbound records into their lanes; commits, lanes, senders; then control and membership
        for the next poll (the first turn, before any membership, reads nothing)."""
        consumer = self._consumer
        assert consumer is not None
        lanes = self._lanes
        for msg in msgs:
            if msg.error() is None:
                lane = lanes.get(msg.partition())
                if lane is not None:
                    lane.put(msg)
        self._commit_done(consumer)
        self._tend_lanes(consumer)
        self.raise_crash()
        self._check_senders()
        if self._control is not None:
            for record in self._control.poll_nowait():
                self._apply_control(record)
        self._follow_desired(consumer)

    def _shutdown(self, consumer: Consumer) -> None:
        """Lanes, then commits, the consumer, the producer, the region client and the followers, each
        whatever happened before."""
        for lane in list(self._lanes.values()):
            lane.close()
        self._lanes.clear()
        self._commit_done(consumer, asynchronous=False)
        close_consumer(consumer, "closing the consumer", log)
        if self._producer is not None:
            self._producer.flush(FLUSH_DEADLINE_S)
        if self._client is not None:
            self._client.close()
        if self._directory_thread is not None:
            self._directory_thread.join(THREAD_JOIN_DEADLINE_S)
        if self._directory is not None:
            self._directory.close()
        if self._control is not None:
            self._control.close()
        self._set_stopped()

    def _follow_desired(self, consumer: Consumer) -> None:
        """Join the inbound topic's consumer group when the receiver is to run, leave it when it is to
        stop: the lanes finish or give up the batch in hand (a batch given up is not acknowledged and
        goes to whoever takes the partition), done offsets are committed, and the running receivers
        of the site get the partitions."""
        if self.desired is DesiredState.RUNNING and not self._subscribed:
            assert self._loop is not None
            self._loop.subscribe()
            self._subscribed = True
            log.info("receiver %s started: joining consumer group %s", self.member_id, self.group_id)
        elif self.desired is DesiredState.STOPPED and self._subscribed:
            for lane in list(self._lanes.values()):
                lane.close()
            self._lanes.clear()
            self._commit_done(consumer, asynchronous=False)
            with kafka_errors(f"leaving consumer group {self.group_id}"):
                consumer.unsubscribe()
            self._subscribed = False
            self.assigned = False
            self._published.clear()
            log.info("receiver %s stopped: out of consumer group %s, applying nothing until started",
                     self.member_id, self.group_id)

    def _heard(self, batch: BatchView) -> None:
        """A batch of a sender passed verification: the sender is connected (lane side)."""
        key = (batch.source_dsid, batch.sender_id)
        now_s, now_ms = time.monotonic(), int(time.time() * 1000)
        with self._stats_lock:
            sender = self._senders.get(key)
            if sender is None:
                sender = self._senders[key] = _Sender(batch.source_dsid, batch.sender_id, now_ms, now_s)
            elif not sender.connected:
                log.info("receiver %s: sender %s of dsid %d connected again (a batch after %.1f s of silence)",
                         self.member_id, batch.sender_id, batch.source_dsid, now_s - sender.last_heard_s)
            sender.last_heard_at_ms, sender.last_heard_s = now_ms, now_s
            sender.batches += 1
            sender.connected = True

    def _check_senders(self) -> None:
        """Senders not heard from within max_time_between_pings_ms are not connected (main thread)."""
        now_s = time.monotonic()
        with self._stats_lock:
            quiet = [s for s in self._senders.values() if s.connected and now_s - s.last_heard_s > self._ping_max_s]
            for sender in quiet:
                sender.connected = False
        for sender in quiet:
            log.warning("receiver %s: sender %s of dsid %d not connected: no batch for %.1f s "
                        "(receiver.max_time_between_pings_ms=%d)", self.member_id, sender.sender_id,
                        sender.source_dsid, now_s - sender.last_heard_s, int(self._ping_max_s * 1000),
                        extra={"source_dsid": sender.source_dsid, "sender_id": sender.sender_id})

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

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Lanes of revoked partitions finish the batch in hand (or give it up) before the next owner starts."""
        for tp in partitions:
            lane = self._lanes.pop(tp.partition, None)
            if lane is not None:
                lane.close()
        with self._protocol_lock:
            offsets = self._protocol.release(tp.partition for tp in partitions) + self._protocol.commits()
        self._commit_offsets(consumer, offsets, asynchronous=False)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
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
        with self._protocol_lock:
            self._protocol.lost(lost)
        log.warning("receiver %s: lost inbound partitions %s (session expired)", self.member_id, sorted(lost))

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
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
                acked, found = self._read_acks(partitions)
                published = self._read_published_figures()
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
        # A new ownership: its lanes start at the group's committed offsets, whatever was done before.
        figures = {tp.partition: [found.get(tp.partition), published.get(tp.partition)] for tp in partitions}
        with self._protocol_lock:
            parts = self._protocol.assign(list(figures), acked, figures, int(time.time() * 1000))
            tracked = len(self._protocol.last_batch)
        for part in parts:
            self._published.pop(part.partition, None)
            self._lanes[part.partition] = Lane(part.partition, self, part)
            if part.figures.carried_from or part.figures.offset >= 0:
                log.info("receiver %s: inbound partition %d continues from the figures of %s (up to offset %d: "
                         "%d batches, %d events applied)", self.member_id, part.partition,
                         part.figures.carried_from or "?", part.figures.offset, part.figures.totals["batches"],
                         part.figures.totals["events_applied"])
        log.info("receiver %s: inbound partitions %s, %d sender partitions tracked", self.member_id,
                 sorted(tp.partition for tp in partitions), tracked)
        self.assigned = True

    def _read_acks(self, partitions: list[TopicPartition]) -> tuple[dict[str, int], dict[int, PartitionTotals]]:
        """What the acks this site wrote say of ``partitions`` (acks.py), the unsigned ones counted and left out."""
        acked, carried, unverified = read_own_acks(self.cfg, self.acks, partitions, self._own_acks)
        if unverified:
            self._count("acks_unverified", unverified)
            log.warning("receiver %s: %d records of %s not signed with this site's key were left out of the "
                        "duplicate-batch tracking", self.member_id, unverified, self.acks)
        return acked, carried

    def _read_published_figures(self) -> dict[int, PartitionTotals]:
        return read_published_figures(self.cfg, self._own_acks)

    # --- one batch -----------------------------------------------------------------------

    def publish_status(self) -> None:
        """What ``sluice admin status`` shows of this receiver, to the site's compacted status topic: the
        process's own figures and the senders it heard from, and the figures of each inbound partition
        it owns that changed since they were last published (receivertotals.py, step 5)."""
        now_ms = int(time.time() * 1000)
        with self._stats_lock:
            senders = [{"source_dsid": s.source_dsid, "sender_id": s.sender_id, "last_heard_at": s.last_heard_at_ms,
                        "connected": s.connected, "batches": s.batches}
                       for s in sorted(self._senders.values(), key=lambda s: (s.source_dsid, s.sender_id))]
            record = {"member": self.member_id, "dsid": self.cfg.dsid, "partitions": sorted(self._lanes),
                      **self.stats, "updated_at": now_ms,
                      "state": "running" if self.desired is DesiredState.RUNNING else "stopped",
                      "senders": senders}
        status = self.cfg.topics.status()
        self._producer.produce(status, self._codec.encode("ReceiverStatus", record),
                               f"receiver/{self.member_id}".encode())
        for partition, lane in list(self._lanes.items()):
            figures = lane.part.figures
            if self._published.get(partition) != figures:
                value = figures.encode()
                self._producer.produce(status, value, figures_of.status_key(partition),
                                       headers=self._signer.headers(value) if self._signer else None)
                self._published[partition] = figures
        self._producer.poll(0)

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    def _handle(self, msg: Message, lane: Lane) -> None:
        """One batch, on its partition's lane; ``lane.stop`` cuts retries short (revoke, shutdown).

        The lane's figures count the batch only when it lies past the offset they cover (a batch read
        again after a crash was counted by whoever handled it first), and only once what it did is
        durable: in the header of its ack, or for a batch refused whole, in the status topic."""
        stop = lane.stop
        value = msg.value()
        signer = None
        if self._verifier is not None:
            try:
                # Once per batch, over the bytes as received: nothing is decoded before.
                signer = self._verifier.signer(value, msg.headers())
            except BadSignature as exc:
                self._reject(msg, exc, lane)
                return
        try:
            # Down to the events' bodies: the events themselves are decoded by their owners only.
            batch = read_gateway_batch(self._codec, value)
        except CodecError as exc:
            self._count("rejected_batches")
            self._dead_letter(msg, f"undecodable gateway batch: {exc}", type(exc).__name__, stop)
            self._refused_whole(msg, lane, rejected_batches=1, dead_lettered=1)
            return
        now_ms = int(time.time() * 1000)
        problem = self._batch_problem(batch, signer, now_ms)
        if problem is not None:
            self._reject(msg, problem, lane, batch)
            return
        self._heard(batch)
        key = f"{batch.source_dsid}/{batch.sender_id}/{batch.queue_partition}"
        count = len(batch.bodies)
        with self._protocol_lock:
            verdict = self._protocol.batch(lane.part, msg.offset(), key, batch.batch_id, count, now_ms)
        if isinstance(verdict, Duplicate):
            self._count("duplicate_batches")
            self._count("duplicate_batch_events", count)
            self._ack(msg, batch, replace(verdict.ack, last_event_id=event_id_of(batch.bodies[-1]) if count else None),
                      stop)
            return
        traces, spans = self._receive_spans(msg, batch, count)
        try:
            applied = self._routing_of().apply(batch, value, stop, traces, verdict.maybe_half_applied)
        finally:
            for span in spans:
                span.end()
        with self._protocol_lock:
            ack = self._protocol.applied(verdict, applied, int(time.time() * 1000))
        self._ack(msg, batch, ack, stop)
        self._count("batches")

    def _refused_whole(self, msg: Message, lane: Lane, **more: int) -> None:
        """A batch refused without an ack (its dead letter durable): the figures counting it are written
        to the status topic, durably, before its offset is done (receivertotals.py, step 2)."""
        with self._protocol_lock:
            figures = self._protocol.refused(lane.part, msg.offset(), int(time.time() * 1000), **more)
        if figures is not None:  # else counted by whoever refused it first
            value = figures.encode()
            self._write(f"figures of inbound partition {lane.partition}", self.cfg.topics.status(), value,
                        figures_of.status_key(lane.partition), lane.stop,
                        headers=self._signer.headers(value) if self._signer else None)
        with self._protocol_lock:
            self._protocol.done(lane.part, msg.offset() + 1, figures)

    def _receive_spans(self, msg: Message, batch: BatchView, count: int) -> tuple[list[str | None], list[Any]]:
        """Each event's trace context from the batch's header (None for one without),
        and, with tracing on, a ``process {inbound topic}`` span for each, whose context
        then goes with its event to the region service."""
        raw = telemetry.header(msg.headers(), telemetry.BATCH_TRACEPARENTS)
        if raw is not None:
            lines = raw.decode("ascii", "replace").split("\n")
        elif batch.traceparents:
            lines = list(batch.traceparents)
        else:
            return [None] * count, []
        traces: list[str | None] = [(lines[i] or None) if i < len(lines) else None for i in range(count)]
        if not self._tracing:
            return traces, []  # passed on as they came
        attributes = {**self._attributes(), "messaging.operation.name": "process",
                      "messaging.destination.partition.id": str(msg.partition()),
                      "sluice.batch.id": batch.batch_id, "sluice.source.dsid": batch.source_dsid}
        spans = []
        for i, parent in enumerate(traces):
            if parent is not None:
                span = telemetry.messaging_span("process", self.inbound, parent=parent, kind=SpanKind.CONSUMER,
                                                attributes=attributes)
                spans.append(span)
                traces[i] = telemetry.traceparent_of(span)
        return traces, spans

    def _batch_problem(self, batch: BatchView, signer: int | None, now_ms: int) -> InvalidRequest | None:
        """Why the batch must not be applied here, or None (``protocol.batch_problem``)."""
        return batch_problem(batch, signer, now_ms, dsid=self.cfg.dsid, accepted=self.accepted,
                             batch_max_age_ms=self._batch_max_age_ms, clock_skew_ms=self._clock_skew_ms)

    def _reject(self, msg: Message, problem: InvalidRequest, lane: Lane, batch: BatchView | None = None) -> None:
        """Counted, logged, dead-lettered, never applied nor acknowledged."""
        kind = {"bad_signatures": 1} if isinstance(problem, BadSignature) else \
            {"stale_batches": 1} if isinstance(problem, StaleBatch) else {}
        self._count("rejected_batches")
        for name in kind:
            self._count(name)
        sender = f" (sender {batch.sender_id})" if batch is not None else ""
        log.warning("batch at %s[%d]@%d rejected%s: %s", msg.topic(), msg.partition(), msg.offset(), sender, problem)
        self._dead_letter(msg, str(problem), type(problem).__name__, lane.stop)
        self._refused_whole(msg, lane, rejected_batches=1, dead_lettered=1, **kind)

    def _routing_of(self) -> OwnerRouting:
        routing = self._routing
        assert routing is not None, "start() first"
        return routing

    def _alert_unauthorized(self, exc: RegionError) -> None:
        """The region service refused the receiver's credential: an alert (logged when it starts, then
        every ``ALERT_REPEAT_S``, counted each time) until an operator mends member_token."""
        now = time.monotonic()
        with self._stats_lock:
            if self._unauthorized_logged_at and now - self._unauthorized_logged_at < ALERT_REPEAT_S:
                return
            self._unauthorized_logged_at = now
            self.stats["unauthorized_alerts"] += 1
        log.error("ALERT receiver %s: the region service refused its credential (%s): no batch is applied until "
                  "region_service.member_token is the one the region service takes; retrying", self.member_id, exc,
                  extra={"alert": "region_unauthorized", "status": exc.status, "member": self.member_id})

    # --- acks, dead letters, commits ---------------------------------------------------------

    def _ack(self, msg: Message, batch: BatchView, ack: Ack, stop: threading.Event) -> None:
        """The signed ack of a batch, and once it is durable, ``ReceiverProtocol.acked``.  ``last_batch_id``:
        the highest batch id applied for its sender partition, what a sender whose batch ids started over
        needs to open an epoch above.  It says which GatewayBatch versions this receiver reads
        (``batch_versions``), and carries the inbound partition's figures with the batch counted, in a
        header of their own (receivertotals.py): what a sender reads of the ack is unchanged."""
        last_applied, last_event_id = ack.last_applied, ack.last_event_id
        record = {
            "sender_id": batch.sender_id,
            "source_dsid": batch.source_dsid,
            "receiver_dsid": self.cfg.dsid,
            "queue_partition": batch.queue_partition,
            "batch_id": batch.batch_id,
            "last_applied_index": last_applied,
            "last_applied_event_id": None if last_applied < 0 or last_event_id is None else last_event_id.to_record(),
            "duplicate_batch": ack.duplicate,
            "exceptions": ack.exceptions,
            "acked_at": int(time.time() * 1000),
            "last_batch_id": ack.last_batch_id,
            "batch_versions": list(BATCH_VERSIONS_READ),
        }
        # Built from typed values (the owners' answers are read into them): no validation pass, which for
        # an ack's unions costs as much as the rest of its batch's routing.
        value = self._codec.encode("GatewayAck", record, validate=False)
        headers = figures_of.ack_headers(self._signer.headers(value) if self._signer else None,
                                         ack.figures.encode(), self._signer)
        self._write(f"ack of batch {batch.batch_id} ({ack.key})", self.acks, value, ack.key.encode(), stop,
                    partition=msg.partition(), headers=headers)
        with self._protocol_lock:
            self._protocol.acked(ack)

    def _dead_letter(self, msg: Message, reason: str, error_class: str, stop: threading.Event) -> None:
        record = {"source_topic": msg.topic(), "source_partition": msg.partition(), "source_offset": msg.offset(),
                  "key": msg.key(), "value": msg.value(), "reason": reason, "error_class": error_class,
                  "event": None, "service": f"receiver {self.member_id}", "failed_at": int(time.time() * 1000)}
        self._write(f"dead letter for {msg.topic()}[{msg.partition()}]@{msg.offset()}", self.dead_letter,
                    self._codec.encode("DeadLetter", record), msg.key(), stop)
        self._count("dead_lettered")

    def _write(self, what: str, topic: str, value: bytes, key: bytes | None, stop: threading.Event, *,
               partition: int | None = None, headers: Headers = None) -> None:
        """One ack or dead letter, durable however long this site's broker is away
        (``produce_durably``).  Stopping raises ``Stopping``: the batch is then
        not committed, so it is read again and acknowledged as a duplicate."""
        produce_durably(self._producer, topic, value, key, what=what, stopping=stop, partition=partition,
                        headers=None if headers is None else list(headers))

    def _commit_done(self, consumer: Consumer, asynchronous: bool = True) -> None:
        """Commit the newest done offset of each partition (the lanes' outcomes, through the protocol:
        the consumer is the loop's, and a commit from a lane while the loop sits in consume() blocks)."""
        with self._protocol_lock:
            offsets = self._protocol.commits()
        self._commit_offsets(consumer, offsets, asynchronous)

    def _commit_offsets(self, consumer: Consumer, offsets: list[TopicPartition], asynchronous: bool) -> None:
        if not offsets:
            return
        try:
            with kafka_errors(f"committing {sorted(tp.partition for tp in offsets)}"):
                consumer.commit(offsets=offsets, asynchronous=asynchronous)
        except SluiceError as exc:
            log.warning("%s", exc)


__all__ = ["ReceiverService", "RegionError", "RejectedBatch", "StaleBatch", "region_service_urls"]
