"""The subscription service: Geode's client/server event messaging on Kafka.

What it keeps, all in Kafka so any instance can take over:

* the **registry** (compacted, keyed by client id): each client's identity,
  durability, interest and connection, written by the client library;
* the **acks** (compacted, keyed by client id): each client's acknowledged
  queue position, which doubles as its ping;
* one **queue** topic per client, filled with the region events that match
  its interest (values or invalidates), never with its own writes;
* the **fill** checkpoints (compacted, keyed by registry partition): how far
  the changelogs have been filled into the queues of that partition's clients,
  and where each queue's events start.

Who feeds a client: the registry's partitions are shared by the instances
through a consumer group, and the member a partition is assigned to is the
primary for every client in it (consumer-group leadership is the primary
lock, as for gateway senders).  The others are standbys: they read the whole
registry, the acks and the checkpoints, so a takeover starts at once from
the last checkpoint; what was filled after it is filled again, marked
possibleDuplicate, and the client discards the repeats by EventID.

A primary's loop, one thread:

1. read what changed in the registry, acks and checkpoints;
2. for each of its clients: create the queue; answer a new registration
   version with a REGISTERED message (its interest applies to everything
   filled after it, so the client loads its cache after seeing it); a new
   queue's first answer comes after a checkpoint that records where the
   queue's events start, so that no primary, this one or a successor behind
   it, ever fills the queue with an event older than its registration; place
   the marker once the client called ``ready_for_events``; note
   disconnects (a close, or no ping for ``maximum-time-between-pings``);
   unregister a non-durable client that left, a durable one away
   longer than its ``durable-client-timeout``, and any client whose queue
   overflowed (below) (queue deleted, alert; the registry tombstone says
   why, header ``sluice-unregistered``, so that a durable client coming
   back learns its queue was dropped);
3. fill: each changelog record goes to every client of its partitions
   whose interest matches (a durable client away keeps only its durable
   interest), found by the record's region, key, operation and writer (its
   body read by the compiled reader) in an index of the clients' interest
   (``index.py``), the message being the record's bytes spliced into a
   ClientMessage, and each fill's messages sent as it ends, one batch per
   queue (issue 18).  A queue holding ``maximum-message-count`` messages
   its client has not acknowledged takes no more events: the event is
   counted as not queued, and the client is unregistered on the next turn
   (Geode's slow-receiver removal), so that it resynchronises rather than
   miss events unawares;
4. every ``message-sync-interval``: wait until the queues hold what was
   filled, then write the checkpoints, and delete from each queue what its
   client acknowledged.

The primary's decisions (whose clients, where each partition fills from,
which client gets which event, when a client is answered, marked or
unregistered, what a checkpoint says) are ``protocol.py``'s, a pure protocol
with no Kafka, thread or clock; this module (with tables.py, which reads
the tables) writes and deletes as it says.

Trust (issue 17): no record of the registry, acks or fill tables is acted on
before it passes its checks, and which principal may write what: tables.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Callable

from ..core import telemetry
from ..core.clientregistry import (
    MAXIMUM_MESSAGE_COUNT,
    UNREGISTERED,
    bearer,
    configured_token,
    create_queue,
    is_client_queue,
    queue_topic_problem,
    registry_partition,
)
from ..core.codec import HEADER_BYTES, get_codec
from ..core.framing import frames_for
from ..core.config import SiteConfig
from ..core.errors import (
    CodecError,
    KafkaCallFailed,
    RegistryUnavailable,
    SluiceError,
    TopicMissing,
)
from ..core.events import REGION_OPERATIONS, EntryEvent, Operation
from ..core.eventwire import (
    client_event_message,
    decode_entry,
    entry_event_body,
)
from ..core.interest import RegionInterest
from ..core.kafka import (
    FLUSH_DEADLINE_S,
    Consumer,
    TOPIC_MISSING,
    KafkaError,
    Message,
    TopicPartition,
    close_consumer,
    consume_available,
    kafka_errors,
    make_admin,
    make_consumer,
    make_producer,
    until_answered,
)
from ..core.lifecycle import Service, ServiceState
from ..core.loop import PartitionLoop
from .protocol import Client, SubscriptionProtocol, Unregister
from .tables import SubscriptionTables

log = logging.getLogger("sluice.subscriptions")

#: Region operations a client hears of: entry creates, updates, destroys and
#: invalidates, expirations included; never local destroys.
FORWARDED = frozenset(Operation) - {Operation.LOCAL_DESTROY, Operation.UNKNOWN}
#: How often the unregistration rules (disconnects, timeouts) are checked.
RULES_INTERVAL_S = 0.5
#: How long the broker holds the service's idle fetches: short, since a longer wait here was seen
#: to delay registrations' answers by as much (0.13 s at 20 ms, 0.77 s at 200 ms).
FETCH_WAIT_MS = 20
#: How soon a write to a queue topic that no longer exists fails.
QUEUE_GONE_MS = 5000
#: How long the producer of the client queues waits to fill a batch (``linger.ms``).  At 0 every
#: delivery was a request of its own, ~35 µs of the broker's CPU each over 100 client queues (issue
#: 18).  Each fill sends what it routed when it ends (``_send_filled``), one batch per queue, so this
#: is only the bound on how long a delivery waits when that send is not taken up at once.  On the
#: fan-out benchmark 50 ms added ~45 ms to every delivery's median latency on a busy machine, and
#: 5 ms delivered as many events per second.
QUEUE_LINGER_MS = 5
#: How long the end of a fill waits for the broker to take what it filled (``_send_filled``):
#: the send starts at once; the wait only gives the producer's thread the moment it needs to start it.
TURN_SEND_WAIT_S = 0.005
#: What a write to a deleted queue fails with: the topic is gone, or (librdkafka 2.x, once it has
#: seen the deletion) its partition.
QUEUE_MISSING = TOPIC_MISSING
#: The longest a registration's answer waits for the fill to reach the changelogs' ends.
CATCH_UP_S = 10.0
#: How long asking the broker for one changelog partition's end offset may take.
END_OFFSET_DEADLINE_S = 10.0
#: The same for a client queue's end (its bound, its size in an alert): best effort, so shorter.
QUEUE_END_DEADLINE_S = 5.0
#: How long looking up one topic (a client queue about to be answered REFUSED) may take.
TOPIC_LOOKUP_DEADLINE_S = 5.0
#: How long the producer may take to deliver what it holds before a queue's end is read or a client
#: is unregistered (its tombstones durable before its queue is deleted).
PRODUCER_DRAIN_DEADLINE_S = 10.0
#: Deleting an unregistered client's queue: how long the broker may take (``operation_timeout``), and
#: how long the service waits for its answer.
QUEUE_DELETE_DEADLINE_S = 10.0
QUEUE_DELETE_WAIT_S = 15.0
#: How long the fill waits while this instance is primary for nothing (so the loop does not spin).
IDLE_WAIT_S = 0.05
#: How long one read of the changelogs waits for records, and how many it takes at most.
FILL_WAIT_S = 0.05
FILL_MAX_RECORDS = 2000
#: How long a full producer queue is served before a write to a client queue is tried again.
PRODUCER_FULL_WAIT_S = 0.1
#: How long one wait for the producer's deliveries lasts before the service looks whether it stops, and
#: how long, once stopping, it still waits for them before the checkpoint is given up.
DELIVERY_WAIT_S = 1.0
STOPPING_DELIVERY_DEADLINE_S = 10.0
#: How long deleting acknowledged messages from the client queues may take (best effort).
TRIM_DEADLINE_S = 5.0


#: The hot path's boundary: a write to a client's queue that fails goes on through ``_produce_to``.
_WRITING_QUEUE = kafka_errors("writing to a client queue")
_READING_CHANGELOGS = kafka_errors("reading the region changelogs")


#: The protocol's client, under the name the service's tests know.
_Client = Client


class SubscriptionService(Service):
    """One subscription-service instance of a site (its lifecycle: core/lifecycle.py)."""

    kind = "subscriptions"

    def __init__(self, cfg: SiteConfig, *, member_id: str | None = None, token: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        #: When set, a registration is taken only with ``authorization: Bearer <token>`` (a record header).
        self.token = token if token is not None else configured_token(cfg)
        self.sub = cfg.subscriptions
        self.member_id = member_id or f"{cfg.site}-subscriptions-{uuid.uuid4().hex[:8]}"
        names = cfg.topics
        self.registry_topic = names.subscription_registry()
        self.acks_topic = names.subscription_acks()
        self.fill_topic = names.subscription_fill()
        self.dead_letter_topic = names.subscription_dead_letter()
        self.changelogs = {names.region_changelog(r.name): r for r in cfg.regions}
        self.partitions = self.sub.registry_partitions
        self.group_id = f"{cfg.kafka.topic_prefix}subscriptions"
        self._codec = get_codec()
        self._entry_header = self._codec.header("EntryEvent")
        #: Reads changelog records of either framing (core/framing.py): the site's serializer may be confluent.
        self._frames = frames_for(cfg)
        self._message_header = self._codec.header("ClientMessage")
        self._reposition = False
        self._delivery_failed: str | None = None
        self._missing_queues: set[str] = set()
        #: Client queues whose deliveries the producer dropped as their partition left its metadata →
        #: the first such failure, until ``_sync`` asks the broker whether each queue is gone.
        self._purged_queues: dict[str, str] = {}
        self._trimmed: dict[str, int] = {}
        self.stats = {"filled": 0, "registered": 0, "markers": 0, "unregistered": 0, "timed_out": 0,
                      "undecodable": 0, "refills": 0, "takeovers": 0, "refused": 0, "dead_lettered": 0,
                      "restored": 0, "queues_full": 0, "events_not_queued": 0, "stale_checkpoints": 0}
        #: The primary's decisions (protocol.py): clients, interest, positions, checkpoints.
        self.protocol = SubscriptionProtocol(self.member_id, self.partitions, self.sub.maximum_message_count,
                                             self.sub.maximum_time_between_pings_ms, self.stats)
        #: The registry, acks and fill tables (every instance reads them whole), and the trust rules their
        #: records pass (tables.py); the fill checkpoints are the protocol's.
        #: (Its callbacks look the service's methods up when called: the service's own tests replace some.)
        self.tables = SubscriptionTables(
            cfg, self.protocol, self.stats, member_id=self.member_id, token=self.token, stopping=self._stopping,
            consumer=lambda: self._tables, produce=lambda *write: self._produce_to(*write),
            drop_client=lambda client_id: self._drop_client(client_id),
            topic_exists=lambda topic: self._topic_exists(topic), message=lambda fields: self._encode(fields))
        self._group: Consumer | None = None
        self._tables: Consumer | None = None
        self._changelog: Consumer | None = None
        self._producer: Any = None
        self._admin: Any = None
        #: The group has given this member its assignment (possibly none) and it was not lost since.
        self.assigned = False
        self._instrument()

    # The protocol's state, under the names the rest of the service (and its tests) use.

    @property
    def registry(self) -> dict[str, dict[str, Any]]:
        return self.tables.registry

    @property
    def acks(self) -> dict[str, dict[str, Any]]:
        return self.tables.acks

    @property
    def owned(self) -> set[int]:
        return self.protocol.owned

    @owned.setter
    def owned(self, partitions: set[int]) -> None:
        self.protocol.owned = partitions

    @property
    def _clients(self) -> dict[str, Client]:
        return self.protocol.clients

    @property
    def _index(self) -> Any:
        return self.protocol.index

    @property
    def _positions(self) -> dict[int, dict[tuple[str, int], int]]:
        return self.protocol.positions

    @property
    def _starts(self) -> dict[int, dict[str, dict[tuple[str, int], int]]]:
        return self.protocol.starts

    @property
    def _duplicates_below(self) -> dict[int, dict[tuple[str, int], int]]:
        return self.protocol.duplicates_below

    @property
    def _dirty(self) -> bool:
        return self.protocol.dirty

    @_dirty.setter
    def _dirty(self, dirty: bool) -> None:
        self.protocol.dirty = dirty

    # --- health and metrics ----------------------------------------------------------------

    def readiness(self) -> dict[str, str]:
        """What is not ready (empty when ready), for /readyz: the group's assignment, and
        the changelog positions of the clients taken over."""
        if not self.assigned:
            return {"kafka": f"no assignment from consumer group {self.group_id} yet (joining, or lost)"}
        if self._reposition:
            return {"clients": "positioning the changelogs for the clients taken over"}
        return {}

    def _instrument(self) -> None:
        telemetry.observe(telemetry.CLIENTS, self._read(lambda service: len(service._clients)), gauge=True)
        telemetry.observe(telemetry.EVENTS_DELIVERED, self._read(lambda service: service.stats["filled"]))
        telemetry.observe(telemetry.FAILOVERS, self._read(lambda service: service.stats["takeovers"]))
        telemetry.observe(telemetry.REGISTRATIONS_REFUSED, self._read(lambda service: service.stats["refused"]))
        telemetry.observe(telemetry.ALERTS, self._read(lambda service: service.stats["timed_out"],
                                                       **{"sluice.alert.name": "durable_client_timeout"}))
        telemetry.observe(telemetry.ALERTS, self._read(lambda service: service.stats["queues_full"],
                                                       **{"sluice.alert.name": "client_queue_full"}))
        telemetry.observe(telemetry.EVENTS_NOT_QUEUED, self._read(lambda service: service.stats["events_not_queued"]))

    def _read(self, value: Callable[["SubscriptionService"], int], **more: Any) -> Callable[[], telemetry.Reading]:
        return telemetry.reader(self, value, lambda service: {
            **telemetry.base_attributes(service.cfg.site), "sluice.component": "subscriptions",
            "messaging.consumer.group.name": service.group_id, **more})

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._check_startable()
        base = self.cfg.kafka.client_settings()
        client_id = {"client.id": self.member_id}
        # A queue deleted under the service (its client timed out, or an operator removed it) fails its
        # writes within seconds rather than holding every other queue's checkpoint back.  Deliveries
        # are batched (QUEUE_LINGER_MS) and their outcome is the batch's: ``_written`` waits for all of
        # them, and only a failed one reaches Python (``_delivered``), not one callback per delivery.
        self._producer = make_producer({**base, "on_delivery": self._delivered}, **client_id, **{
            **self.cfg.kafka.producer_settings(), "topic.metadata.propagation.max.ms": QUEUE_GONE_MS,
            "linger.ms": QUEUE_LINGER_MS, "delivery.report.only.error": True})
        self._admin = make_admin(base)
        self._group = make_consumer(base, self.group_id, **client_id, **self.cfg.kafka.group_settings())
        self._tables = make_consumer(base, None, **client_id, **{"fetch.wait.max.ms": FETCH_WAIT_MS})
        self._changelog = make_consumer(base, None, **client_id, **{"fetch.wait.max.ms": FETCH_WAIT_MS})
        self._check_topics()
        with kafka_errors("assigning the subscription tables"):
            self._tables.assign([TopicPartition(t, p, 0) for t in (self.registry_topic, self.acks_topic,
                                                                   self.fill_topic)
                                 for p in range(self.partitions)])
        self._read_tables(to_end=True)
        self._set_running()

    def _check_topics(self) -> None:
        """Refuse to start without the subscription topics (a site made before the dead-letter topic
        existed needs ``sluice topics apply`` again)."""
        assert self._admin is not None
        with kafka_errors(f"connecting to {self.cfg.kafka.bootstrap_servers}"):
            metadata = self._admin.list_topics(timeout=self.cfg.kafka.request_timeout_ms / 1000)
        for topic in (self.registry_topic, self.acks_topic, self.fill_topic, self.dead_letter_topic):
            found = metadata.topics.get(topic)
            if found is None or found.error is not None:
                raise TopicMissing(topic)

    def run(self) -> None:
        """The partition loop (core/loop.py) over the registry's consumer group, in the calling thread,
        until ``stop()``.  The group consumer only holds membership (its partitions stay paused: the
        tables consumer reads the registry), so each poll hands over no record and runs the group
        callbacks; a turn reads the tables and fills the queues, and the status timer writes the
        checkpoints (``message_sync_interval_s``)."""
        group = self._group
        assert group is not None
        loop = PartitionLoop(self, group, [self.registry_topic], self, read_max_records=1,
                             status_interval_s=self.sub.message_sync_interval_s,
                             clock=lambda: time.monotonic())  # this module's clock: a test drives it
        self._next_rules = time.monotonic()
        try:
            loop.subscribe()
            loop.run()
        finally:
            self._close()

    def poll_timeout_s(self) -> float:
        return 0.0  # membership only: the callbacks run, no record waits to be read

    def turn(self, msgs: list[Message]) -> None:
        """The tables, the changelog positions, the clients' rules when due, the fill."""
        self._read_tables()
        if self._reposition:
            self._position_changelogs()
        now = time.monotonic()
        if now >= self._next_rules or self._dirty:
            if self._dirty and self._answers_due():
                self._catch_up()
            self._dirty = False
            self._tend_clients()
            self._next_rules = now + RULES_INTERVAL_S
        self._fill()

    def publish_status(self) -> None:
        """The status timer: the checkpoints and the messages' sync."""
        self._sync()

    def _close(self) -> None:
        if self.state is not ServiceState.CRASHED and self.owned:
            try:
                with kafka_errors("writing the last checkpoint"):
                    self._sync()
            except SluiceError as exc:
                log.warning("subscriptions %s: last checkpoint not written: %s", self.member_id, exc)
        for consumer in (self._group, self._tables, self._changelog):
            if consumer is not None:
                close_consumer(consumer, "closing a consumer", log)
        if self._producer is not None:
            self._producer.flush(FLUSH_DEADLINE_S)
        self._set_stopped()

    # --- primaries: the consumer group over the registry -------------------------------------

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.assign(partitions)
        consumer.pause(partitions)  # membership only: the tables consumer reads the registry
        self.assigned = True
        gained = {tp.partition for tp in partitions} - self.owned
        if not gained:
            return
        self._read_tables(to_end=True)  # the previous primary's last checkpoint included
        self.protocol.assign(gained, self._changelog_ends(), self.registry)
        self._reposition = True
        log.info("subscriptions %s: primary for registry partitions %s (%d clients)", self.member_id,
                 sorted(self.owned), len(self._clients))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The session expired: another instance may be primary already, so no last checkpoint is written
        (a late one could move its successor back: protocol.py, step 6)."""
        self.assigned = False
        lost = self.protocol.lost(tp.partition for tp in partitions)
        if lost:
            self._reposition = True
            log.warning("subscriptions %s: lost registry partitions %s (session expired)", self.member_id,
                        sorted(lost))

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        lost = self.protocol.revoking(tp.partition for tp in partitions)
        if not lost:
            return
        try:
            with kafka_errors("writing the last checkpoint"):
                self._sync(only=lost)
        except SluiceError as exc:
            log.warning("subscriptions %s: handing over without a last checkpoint: %s", self.member_id, exc)
        self.protocol.release(lost)
        self._reposition = True
        log.info("subscriptions %s: no longer primary for registry partitions %s", self.member_id, sorted(lost))

    def _changelog_ends(self) -> dict[tuple[str, int], int]:
        assert self._changelog is not None
        ends = {}
        for topic, region in self.changelogs.items():
            for p in range(region.buckets):
                with kafka_errors(f"reading the end of {topic}[{p}]"):
                    _low, high = self._changelog.get_watermark_offsets(TopicPartition(topic, p),
                                                                       timeout=END_OFFSET_DEADLINE_S)
                ends[(topic, p)] = high
        return ends

    def _position_changelogs(self) -> None:
        """Read each changelog partition from the earliest position any owned registry partition needs."""
        assert self._changelog is not None
        self._reposition = False
        # A fresh consumer: nothing fetched for the previous positions can come back after the seek
        # and move a partition's position past records not filled yet.
        old, self._changelog = self._changelog, make_consumer(
            self.cfg.kafka.client_settings(), None,
            **{"client.id": self.member_id, "fetch.wait.max.ms": FETCH_WAIT_MS})
        close_consumer(old, "closing the changelog reader", log)
        if not self.owned:
            return
        lowest: dict[tuple[str, int], int] = {}
        for positions in self._positions.values():
            for tp, offset in positions.items():
                lowest[tp] = min(offset, lowest.get(tp, offset))
        self._changelog.assign([TopicPartition(t, p, o) for (t, p), o in sorted(lowest.items())])

    def _answers_due(self) -> bool:
        return any(c.record["connected"] and c.answered != (c.record["session"], c.record["version"])
                   for c in self._clients.values())

    def _catch_up(self) -> None:
        """Fill up to the changelogs' ends as they are now, before a registration is answered: the
        client wrote it after every operation it has seen, and those are filled under its old
        interest (none, for a new queue), not sent after the answer (the initial load has them)."""
        assert self._changelog is not None
        ends = {tp: end for tp, end in self._changelog_ends().items() if end > 0}
        deadline = time.monotonic() + CATCH_UP_S
        while not self._stopping.is_set() and self.owned:
            if self._reposition:
                self._position_changelogs()
            with kafka_errors("reading the changelog readers' positions"):
                at = {(tp.topic, tp.partition): tp.offset
                      for tp in self._changelog.position([TopicPartition(t, p) for t, p in ends])}
            behind = [tp for tp, end in ends.items()
                      if at.get(tp, -1) < end and min(pos.get(tp, 0) for pos in self._positions.values()) < end]
            if not behind:
                return
            if time.monotonic() > deadline:
                log.warning("subscriptions %s: not caught up with %d changelog partitions in %.0f s; answering "
                            "registrations anyway", self.member_id, len(behind), CATCH_UP_S)
                return
            self._fill()

    def _read_tables(self, to_end: bool = False) -> None:
        """What the tables gained since the last read (to their ends: ``to_end``), each record taken or
        refused (tables.py)."""
        self.tables.read(to_end)

    def _topic_exists(self, topic: str) -> bool:
        assert self._admin is not None
        try:
            with kafka_errors(f"listing {topic}"):
                found = self._admin.list_topics(topic, timeout=TOPIC_LOOKUP_DEADLINE_S).topics.get(topic)
        except SluiceError:
            return False
        return found is not None and found.error is None

    # --- clients -------------------------------------------------------------------------------

    def _tend_clients(self) -> None:
        if self.tables.refusals_waiting:
            self.tables.answer_refusals()
        now_ms = int(time.time() * 1000)
        self._read_queue_ends()
        for client in list(self._clients.values()):
            record = client.record
            if not client.queue_ready:
                assert self._admin is not None
                create_queue(self._admin, self.cfg, record["queue_topic"], record["durable"])
                client.queue_ready = True
                # Nothing is written to it before this turn ends (its queue start or its takeover is tended
                # first), so its end is the broker's.
                self._read_queue_end(client)
            if client.full_since_ms is not None:
                self._drop_full(client)
                continue
            away = client.away_since_ms
            verdict = self.protocol.rule(client, self.acks.get(client.id), now_ms)
            if away is None and client.away_since_ms is not None:
                log.info("durable client %s is away since %s; its queue keeps filling for its durable interest "
                         "for up to %d s", client.id,
                         time.strftime("%H:%M:%S", time.localtime(client.away_since_ms / 1000)),
                         record["durable_timeout_s"])
            if verdict is not None:
                self._unregister_for(verdict)
                continue
            if self.protocol.answer_due(client):
                if not self.protocol.queue_started(client) and not self._start_queue(client):
                    continue  # answered once the queue's start is checkpointed
                self._send(client, {"kind": "REGISTERED", "session": record["session"],
                                    "version": record["version"]})
                self.protocol.answered(client)
                self.stats["registered"] += 1
            if self.protocol.marker_due(client):
                self._send(client, {"kind": "MARKER", "session": record["session"]})
                client.marked = record["session"]
                self.stats["markers"] += 1

    def _unregister_for(self, verdict: Unregister) -> None:
        client = verdict.client
        if verdict.timed_out_after_s is not None:
            self.stats["timed_out"] += 1
            size = self._queue_size(client)
            timeout_s = client.record["durable_timeout_s"]
            log.warning("ALERT durable client %s timed out: away %.1f s, more than its durable-client-timeout of "
                        "%d s; its queue (%s messages) is deleted and it is unregistered", client.id,
                        verdict.timed_out_after_s, timeout_s, "?" if size is None else size,
                        extra={"alert": "durable_client_timeout", "client_id": client.id,
                               "away_s": round(verdict.timed_out_after_s, 1), "durable_client_timeout_s": timeout_s,
                               "queue_size": size})
        self._unregister(client, verdict.why, verdict.reason)

    def _read_queue_ends(self) -> None:
        """Read the end of each queue whose end this primary does not know (a client taken on, a new queue
        of a client that started over, a refill), once what this instance wrote to it is written."""
        unknown = [c for c in self._clients.values() if c.queue_ready and not c.end_known]
        if not unknown:
            return
        assert self._producer is not None
        self._producer.flush(PRODUCER_DRAIN_DEADLINE_S)
        for client in unknown:
            self._read_queue_end(client)

    def _read_queue_end(self, client: Client) -> None:
        assert self._changelog is not None
        topic = client.record["queue_topic"]
        try:
            with kafka_errors(f"reading the end of queue {topic}"):
                _low, high = self._changelog.get_watermark_offsets(TopicPartition(topic, 0),
                                                                   timeout=QUEUE_END_DEADLINE_S)
        except SluiceError as exc:
            log.warning("subscriptions %s: %s; its bound applies once it can be read", self.member_id, exc)
            return
        self.protocol.queue_end_read(client, high, self.acks.get(client.id))

    def _reckon_room(self, client: Client) -> None:
        self.protocol.reckon_room(client)

    def _drop_full(self, client: Client) -> None:
        """A client whose queue overflowed is unregistered and its queue deleted, as Geode removes a slow
        receiver: it resynchronises (a connected client finds its queue gone and fetches its interest again;
        a durable one away finds it dropped when it comes back), rather than go on with events missing."""
        record = client.record
        self.stats["queues_full"] += 1
        held = client.queue_end - min(client.acked, client.queue_end)
        log.warning("ALERT client %s: its queue %s reached maximum-message-count (%d messages not acknowledged, "
                    "the bound %d); %d events could not be queued; the queue is deleted and the client unregistered, "
                    "so that it resynchronises (%s)", client.id, record["queue_topic"], held,
                    self.sub.maximum_message_count, client.not_queued,
                    "away: it finds its queue dropped when it reconnects" if client.away_since_ms is not None
                    or not record["connected"] else "connected: it starts over and fetches its interest again",
                    extra={"alert": "client_queue_full", "client_id": client.id, "queue_size": held,
                           "maximum_message_count": self.sub.maximum_message_count,
                           "events_not_queued": client.not_queued})
        self._unregister(client, "maximum-message-count", MAXIMUM_MESSAGE_COUNT)

    def _add_client(self, client: Client) -> None:
        self.protocol.add_client(client)

    def _set_interest(self, client: Client, interest: dict[str, RegionInterest]) -> None:
        self.protocol.set_interest(client, interest)

    def _drop_client(self, client_id: str) -> None:
        self.protocol.drop_client(client_id)

    def _start_queue(self, client: Client) -> bool:
        """Before a queue's first registration is answered: its events start where the fill is now
        (caught up with the registration), and a checkpoint says so before the answer is written."""
        if self._sync(only={self.protocol.start_queue(client)}):
            return True
        self.protocol.start_failed(client)
        return False

    def _away(self, client: Client, since_ms: int) -> None:
        self.protocol.away(client, since_ms)

    def _unregister(self, client: Client, why: str, reason: str) -> None:
        """Forget a client: tombstones in the registry and the acks, its queue deleted.  The registry
        tombstone says why (``reason``, one of ``clientregistry.UNREGISTERED_REASONS``)."""
        assert self._producer is not None and self._admin is not None
        key = client.id.encode()
        r = registry_partition(client.id, self.partitions)
        # With a token, every instance takes a tombstone only with it (a forged one unregisters no one).
        self._produce_to(self.registry_topic, None, key, r,
                         (bearer(self.token) or []) + [(UNREGISTERED, reason.encode())])
        self._produce_to(self.acks_topic, None, key, r, bearer(self.token))
        self._producer.flush(PRODUCER_DRAIN_DEADLINE_S)
        self._drop_client(client.id)
        self.registry.pop(client.id, None)
        self.acks.pop(client.id, None)
        topic = client.record["queue_topic"]
        # Checked when the registration was read; kept as the last guard before a topic is deleted.
        assert queue_topic_problem(self.cfg, client.id, topic) is None, topic
        futures = self._admin.delete_topics([topic], operation_timeout=QUEUE_DELETE_DEADLINE_S)
        for topic, fut in futures.items():
            try:
                with kafka_errors(f"deleting {topic}"):
                    fut.result(timeout=QUEUE_DELETE_WAIT_S)
            except KafkaCallFailed as exc:
                if exc.code != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    log.warning("%s", exc)
        self.stats["unregistered"] += 1
        log.info("client %s unregistered (%s); queue %s deleted", client.id, why, client.record["queue_topic"])

    def _queue_size(self, client: Client) -> int | None:
        assert self._changelog is not None
        try:
            with kafka_errors("reading the end of a client queue"):
                _low, high = self._changelog.get_watermark_offsets(
                    TopicPartition(client.record["queue_topic"], 0), timeout=QUEUE_END_DEADLINE_S)
        except SluiceError:
            return None
        ack = self.acks.get(client.id)
        return high - (ack["next_offset"] if ack else 0)

    # --- filling -------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Route what the changelogs hold next to the queues of the clients it reaches (``_route``).

        A record is taken by each owned registry partition whose position it is at or past (after a
        takeover or a refill they differ until the lowest catches up), and every taker's position
        moves past it, whoever it reached."""
        assert self._changelog is not None
        if not self.owned:
            self._stopping.wait(IDLE_WAIT_S)
            return
        with _READING_CHANGELOGS:
            msgs = consume_available(self._changelog, FILL_MAX_RECORDS, FILL_WAIT_S)
        takers_of, advance = self.protocol.takers, self.protocol.advance
        # One fill time for the messages of one read: a few milliseconds apart at most.
        filled_at = int(time.time() * 1000)
        delivered = 0
        for msg in msgs:
            if msg.error() is not None:
                continue
            tp, offset = (msg.topic(), msg.partition()), msg.offset()
            takers = takers_of(tp, offset)
            if not takers:
                continue
            value = msg.value()
            if value is not None:
                delivered += self._route(msg, value, takers, tp, offset, filled_at)
            advance(takers, tp, offset)
        self.stats["filled"] += delivered
        self._send_filled()

    def _send_filled(self) -> None:
        """What the turn wrote (its fill, and the answers and markers before it) leaves now rather than
        after ``linger.ms``: the producer's ``flush`` sends every waiting batch at once.  It waits
        ``TURN_SEND_WAIT_S`` at most, not for the broker's answer: ``_sync`` is where the loop waits
        for that."""
        assert self._producer is not None
        self._producer.flush(TURN_SEND_WAIT_S)  # with nothing waiting, it returns at once

    def _route(self, msg: Any, value: bytes, takers: list[int], tp: tuple[str, int], offset: int,
               filled_at: int) -> int:
        """One changelog record to the queues of the clients it reaches; how many it reached.

        The record's body is read whole by ``decode_entry`` (the compiled reader where it is built,
        as strict as fastavro, at a third of the cost of reading its routing fields in Python), before
        it is delivered anywhere: an unreadable record reaches no client, and is dead-lettered by the
        one instance that dead-letters the changelog partition's undecodable records (``changelog
        partition mod registry partitions``, when it fills that registry partition), so once.  A
        client's message is the record's body spliced into a ClientMessage
        (``client_event_message``), written again without its value for a client of invalidates:
        one message per (values, possibleDuplicate) of the event, whatever the clients (issue 18)."""
        try:
            body = self._entry_body(value)
            event, _layout = decode_entry(body)
        except CodecError as exc:
            if msg.partition() % self.partitions in takers:
                self.stats["undecodable"] += 1
                log.error("subscriptions %s: %s[%d]@%d cannot be read and is dead-lettered: %s",
                          self.member_id, msg.topic(), msg.partition(), offset, exc)
                self.tables.dead_letter(msg, f"changelog record cannot be read: {exc}", type(exc).__name__)
            return 0
        operation = event.operation
        if operation not in FORWARDED:
            return 0
        region_operation = operation in REGION_OPERATIONS
        if region_operation:
            # Every client with interest in the region hears of a clear: once per bucket (the bucket's
            # entries arrive together, one REGION_CLEAR event each).
            reached: Any = dict.fromkeys(self._index.clients_in(event.region), True)
        else:
            reached = self._index.clients_of(event.region, event.key)
        if not reached:
            return 0
        writer = event.event_id
        clear = ((writer.member_id, writer.thread_id, writer.sequence_id, event.bucket) if region_operation
                 else None)
        deliveries = self.protocol.deliveries(reached, takers, tp, offset, writer.member_id, clear, filled_at)
        produce = self._producer.produce
        writing = _WRITING_QUEUE
        messages: dict[tuple[bool, bool], bytes] = {}
        # One boundary around the whole loop, not one per delivery (this is the hot path): a write that
        # fails leaves it, goes through ``_produce_to`` (a full producer queue waited out, a queue known
        # to be gone noted, not written), and the loop goes on with the next client.
        todo = iter(deliveries)
        while True:
            try:
                with writing:
                    for client, values, duplicate in todo:
                        topic = client.record["queue_topic"]
                        message = messages.get((values, duplicate))
                        if message is None:
                            sent = body if values or event.value is None else entry_event_body(
                                replace(event, value=None))
                            message = messages[(values, duplicate)] = client_event_message(
                                self._message_header, sent, receive_values=values, possible_duplicate=duplicate,
                                filled_at=filled_at)
                        produce(topic, message, partition=0)
                        client.filled += 1
                return len(deliveries)
            except KafkaCallFailed:
                self._produce_to(topic, message, None, 0)
                client.filled += 1

    def _entry_body(self, value: bytes) -> bytes:
        """The current EntryEvent body of a changelog record: its bytes after the header, or, for a
        record of an older EntryEvent version, the event read through schema resolution and written
        again.  Either framing (``core/framing.py``).  ``CodecError`` when it is no EntryEvent."""
        if value[:HEADER_BYTES] == self._entry_header:
            return value[HEADER_BYTES:]
        try:
            return self._framed_body(value)
        except RegistryUnavailable:
            # A Confluent frame's schema id the registry cannot be asked about now: not a reason to
            # dead-letter the record; wait for the registry (or a stop).
            return until_answered(lambda: self._framed_body(value), "subscriptions: a changelog record's schema",
                                  stopping=self._stopping)

    def _framed_body(self, value: bytes) -> bytes:
        header = self._frames.current_header(value, "EntryEvent")
        if header is not None:
            return value[len(header):]
        return entry_event_body(EntryEvent.from_record(self._frames.decode_as("EntryEvent", value)))

    def _encode(self, message: dict[str, Any]) -> bytes:
        message.setdefault("session", "")
        message.setdefault("version", 0)
        message.setdefault("event", None)
        message.setdefault("receive_values", True)
        message.setdefault("possible_duplicate", False)
        message.setdefault("reason", "")
        message["filled_at"] = int(time.time() * 1000)
        return self._codec.encode("ClientMessage", message, validate=False)

    def _send(self, client: Client, message: dict[str, Any]) -> None:
        self._produce(client, self._encode(message))

    def _produce(self, client: Client, value: bytes) -> None:
        """A registration's answer or a marker: always written, a full queue included (they are few, and
        the client waits for them); they count in what the queue holds."""
        self.protocol.wrote_control(client)
        self._produce_to(client.record["queue_topic"], value, None, 0)

    def _produce_to(self, topic: str, value: bytes | None, key: bytes | None, partition: int,
                    headers: list[tuple[str, bytes]] | None = None) -> None:
        """One record; a full producer queue is waited out (back-pressure).  A failed delivery fills
        again from the last checkpoint (``_delivered``, the producer's callback for failures only)."""
        assert self._producer is not None
        writing = kafka_errors(f"writing to {topic}")
        while True:
            try:
                with writing:
                    self._producer.produce(topic, value, key, partition=partition, headers=headers)
                return
            except KafkaCallFailed as exc:
                if exc.code != KafkaError._QUEUE_FULL:
                    if exc.code not in QUEUE_MISSING or not is_client_queue(self.cfg, topic):
                        raise
                    # The producer already knows the queue was deleted (a write to it failed): as in
                    # ``_delivered``, its client starts over with a new queue.
                    self._missing_queues.add(topic)
                    return
                # A full producer queue: back-pressure, waited out.
                self._producer.poll(PRODUCER_FULL_WAIT_S)
                if self._stopping.is_set():
                    # Not written: no checkpoint may pass it (the next primary fills it again).
                    self._delivery_failed = self._delivery_failed or f"{topic}: stopping with the producer queue full"
                    return

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        """A record the broker did not take (``delivery.report.only.error``: only those come here)."""
        if err is None:
            return
        if err.code() in QUEUE_MISSING and is_client_queue(self.cfg, msg.topic()):
            # The client's queue was deleted under it: the client starts over with a new queue,
            # and nothing is filled again for a queue that is gone.
            self._missing_queues.add(msg.topic())
        elif err.code() == KafkaError._DESTROY and is_client_queue(self.cfg, msg.topic()):
            # What the producer held for a partition that left its metadata (a queue deleted while
            # batches for it waited) is dropped with this code: gone, or failed if the queue is
            # still there (``_sync`` asks the broker which).
            self._purged_queues.setdefault(msg.topic(), f"{msg.topic()}: {err.str()}")
        elif self._delivery_failed is None:
            self._delivery_failed = f"{msg.topic()}: {err.str()}"

    # --- checkpoints and removal -----------------------------------------------------------------

    def _sync(self, only: set[int] | None = None) -> bool:
        """Checkpoint what the queues durably hold; delete what clients acknowledged.  True once the
        broker has the checkpoints (False: stopping with writes pending, or a queue write failed)."""
        assert self._producer is not None
        if not self._written():
            return False
        self._sort_purged()
        failed, self._delivery_failed = self._delivery_failed, None
        if self._missing_queues:
            for topic in sorted(self._missing_queues):
                log.warning("subscriptions %s: queue %s is gone; its client starts over with a new one",
                            self.member_id, topic)
            self._missing_queues.clear()
        partitions = sorted(self.owned if only is None else only & self.owned)
        if failed is not None:
            # Something filled was not written: fill again from the last checkpoints (repeats are
            # discarded by the clients), rather than checkpoint past a hole.
            self.stats["refills"] += 1
            log.warning("subscriptions %s: a queue write failed (%s); filling again from the last checkpoint",
                        self.member_id, failed)
            self.protocol.refill(partitions, self._changelog_ends())
            self._reposition = True
            return False
        for record in self.protocol.checkpoint(partitions, int(time.time() * 1000)):
            # Built from this instance's own offsets and checked queue names: no validation pass (its
            # failed union branch formatted the whole record into a message, at every checkpoint).
            r = record["registry_partition"]
            self._producer.produce(self.fill_topic, self._codec.encode("FillCheckpoint", record, validate=False),
                                   str(r).encode(), partition=r)
        if not self._written():
            return False
        self._trim()
        return True

    def _sort_purged(self) -> None:
        """Each queue whose deliveries the producer dropped (``_delivered``) is gone when the broker no
        longer lists it; otherwise, or when the broker cannot say, the deliveries failed and are filled
        again from the last checkpoint (repeats are discarded by the client)."""
        assert self._admin is not None
        purged, self._purged_queues = self._purged_queues, {}
        for topic, why in purged.items():
            try:
                with kafka_errors(f"listing {topic}"):
                    found = self._admin.list_topics(topic, timeout=TOPIC_LOOKUP_DEADLINE_S).topics.get(topic)
                gone = found is None or (found.error is not None and found.error.code() in QUEUE_MISSING)
            except SluiceError:
                gone = False  # the broker cannot say: filled again, to be safe
            if gone:
                self._missing_queues.add(topic)
            elif self._delivery_failed is None:
                self._delivery_failed = why

    def _written(self) -> bool:
        """Wait until the broker has everything produced; when stopping, for
        ``STOPPING_DELIVERY_DEADLINE_S`` at most."""
        assert self._producer is not None
        give_up = None
        while self._producer.flush(DELIVERY_WAIT_S) > 0:
            if self._stopping.is_set():
                give_up = give_up or time.monotonic() + STOPPING_DELIVERY_DEADLINE_S
                if time.monotonic() > give_up:
                    return False
        return True

    def _trim(self) -> None:
        """Acknowledged messages leave the queue (best effort: a broker without DeleteRecords keeps them).
        Only ever a client's own queue: the ack and the registration both passed the queue rule when
        they were read, and must name the same queue."""
        assert self._admin is not None
        wanted = []
        for client in self._clients.values():
            ack = self.acks.get(client.id)
            if ack is None or ack["queue_topic"] != client.record["queue_topic"]:
                continue
            if queue_topic_problem(self.cfg, client.id, ack["queue_topic"]) is not None:
                continue  # cannot happen (checked when read); kept as the last guard before delete_records
            if ack["next_offset"] > self._trimmed.get(client.id, 0):
                wanted.append((client.id, TopicPartition(ack["queue_topic"], 0, ack["next_offset"])))
        if not wanted or not hasattr(self._admin, "delete_records"):
            return
        try:
            with kafka_errors("delete_records"):
                futures = self._admin.delete_records([tp for _, tp in wanted], request_timeout=TRIM_DEADLINE_S)
        except (SluiceError, ValueError) as exc:
            log.debug("delete_records: %s", exc)
            return
        for client_id, tp in wanted:
            self._trimmed[client_id] = tp.offset
        for fut in futures.values():
            fut.add_done_callback(lambda f: f.exception())  # outcome noted, never raised

    # --- what admin status shows -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"member": self.member_id, "owned": sorted(self.owned), "clients": sorted(self._clients),
                **self.stats}


__all__ = ["FORWARDED", "SubscriptionService"]
