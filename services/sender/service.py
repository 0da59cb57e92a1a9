"""Gateway senders: ``sluice parallel-sender`` / ``sluice serial-sender -c FILE --sender ID``.

A gateway sender is a queue primary (``core/queueloop.py``) whose delivery
is a round trip to the remote site, through Kafka only:

1. ``accepts`` leaves out what must not cross: operations that never cross
   sites, and events that came from the remote site or were already sent to
   it (``origin_dsid`` / ``visited_dsids``), so nothing loops in a mesh or a
   ring.
2. ``deliver_group`` writes up to ``max_batches_in_flight`` batches of a
   queue partition, each as one ``GatewayBatch`` (what the before_transmit
   filters let through), into the remote site's inbound topic, each durable
   before the next is written, keyed ``<dsid>/<sender>/<queue partition>``.
   The events go as the EntryEvent bodies they were queued as, not decoded
   (GatewayBatch version 3, ``eventwire.gateway_batch``), with what this
   sender changes beside them: which are possibleDuplicate, and per region
   the sites to add to their ``visited_dsids`` (this site and every site the
   region's senders send to), so that the receiving site forwards them
   nowhere those already get them from here, and (version 4) which fire no
   callbacks there (entries wan-copy region queued).  A receiver says in its acks
   which versions it reads (``batch_versions``), and acks come on the
   inbound partition of their batch: until the latest ack on an inbound
   partition (another sender's too: the ack thread starts at each
   partition's last record, so a sender knows before it sends) has said its
   receiver reads version 3 (version 4 once it says so), and again after an ack timeout (a receiver
   rolled back to a release that does not read it dead-letters such a batch
   and never acknowledges it), batches go to that partition as version 2,
   the events as records with those changes spliced in
   (``eventwire.gateway_batch_v2``); while no ack has said anything yet,
   one at a time.  Only then,
   or for the before_transmit filters when configured, are the events
   decoded (on first touch); one that turns out not to decode is
   dead-lettered with its reason and left out of the batch.
   A signing site (``gateway_private_key``) signs each batch's record bytes
   as written (Ed25519, record headers; core/signing.py), at every send,
   with ``created_at`` stamped anew each time: the receiver refuses a batch
   older than its ``receiver.batch_max_age_ms``.
3. It then takes the receiver's ``GatewayAck``s on the remote acks topic
   (read by one thread for the whole sender) in batch order; with the remote
   site's public key, only acks signed by it (an unsigned or forged one is
   logged, counted and ignored: the batch goes again after the ack timeout).
   The batches acknowledged, oldest first, are removed, and the filters'
   ``after_acknowledgement`` sees their events.  No ack within
   ``socket_read_timeout_ms`` (or the remote site unreachable): the batch is
   not delivered and the loop sends it again, with every batch after it, until
   it is acknowledged, each batch sent before flagged possibleDuplicate, batch
   and every event of it (``redelivering``); the queue grows meanwhile and
   the loop's status pass logs an alert while its oldest event is older than
   ``alert_threshold_ms``.
4. An ack with exceptions still removes the batch: each failed event goes to
   the queue's dead-letter topic with its exception, durably, first (decoded
   for it; one that does not decode goes as its body).

Batch ids must grow across primaries, because the receiver acknowledges a
batch id it has seen without applying it again.  A new primary of a queue
partition therefore starts a new epoch: it writes the partition's removal
record with batch id ``epoch << 32`` (durably) before sending anything, and
numbers its batches from there.

Should the receiver nevertheless answer ``duplicate_batch`` to a batch this
primary never sent before (or name a higher batch id applied than any it
sent: ``last_batch_id``), its tracking is ahead of this epoch (the removals
topic was lost, a previous run's acks remain): trusting it would remove
events never applied.  The sender raises an alert
(``unexpected_duplicate_ack``), removes nothing, opens an epoch above the
receiver's ``last_batch_id`` (durably, as the partition's ``epoch/<p>``
record of the removals topic, so later primaries open above it too) and
sends the batches again under ids of that epoch: the receiver applies them,
and the region's EventID tracking makes a repeat harmless.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from ..core import telemetry
from ..core.asyncevent import AsyncEvent, flag_possible_duplicates
from ..core.batching import Batch
from ..core.config import SiteConfig
from ..core.errors import (
    BadSignature,
    BrokerUnavailable,
    CodecError,
    ConfigError,
    KafkaCallFailed,
    MalformedRecord,
    SluiceError,
)
from ..core.events import EntryEvent, goes_to_gateway
from ..core.eventwire import (
    BATCH_VERSION_BODIES,
    BATCH_VERSION_CALLBACKS,
    GATEWAY_BATCH_V3_HEADER,
    decode_entry,
    gateway_batch,
    gateway_batch_v2,
    splice_entry,
    visited_after,
)
from ..core.kafka import (
    OFFSET_END,
    TOPIC_MISSING,
    TopicPartition,
    consume_available,
    kafka_errors,
    make_consumer,
    make_producer,
    partition_for_key,
    produce_durably,
    read_to_end,
    until_answered,
)
from ..core.gatewayfilters import SenderFilters
from ..core.signing import Signer, Verifier, site_signer, site_verifier
from ..core.lifecycle import ServiceState
from ..core.queueloop import (
    DesiredState,
    QueuePartition,
    QueuePrimary,
    event_traceparent,
)
from ..core.topics import TopicNames

log = logging.getLogger("sluice.sender")

__all__ = ["DesiredState", "GatewaySenderService", "ServiceState"]

EPOCH_SHIFT = 32
#: Batch ids are Avro longs: the highest epoch whose ids still fit.
EPOCH_MAX = (1 << (63 - EPOCH_SHIFT)) - 1
#: An alert that goes on is logged again this often.
ALERT_REPEAT_S = 30.0
#: The GatewayBatch version every receiver reads: events as records.
BATCH_VERSION_RECORDS = 2
#: How long one metadata or watermark request to the remote site may take (asked again after).
REMOTE_REQUEST_DEADLINE_S = 5.0
#: How long a wait for an ack sleeps before it looks again whether dispatch must stop.
ACK_WAIT_SLICE_S = 0.2
#: Shutdown deadlines: the ack thread's end, the remote producer's flush.
ACK_THREAD_JOIN_DEADLINE_S = 5.0
REMOTE_FLUSH_DEADLINE_S = 10.0


def _decodes(event: AsyncEvent) -> bool:
    """Whether an event's body decodes (decoding it, once: it is kept, and so is why it does not)."""
    try:
        event.event  # noqa: B018 - decoded on first touch
    except MalformedRecord:
        return False
    return True


def epoch_marker_key(partition: int) -> bytes:
    """The removals-topic key of a queue partition's epoch marker, beside its removal record (keyed
    by the partition alone): the highest epoch opened outside ``first_batch_id``."""
    return f"epoch/{partition}".encode()


class _InFlight:
    """A batch written to the remote inbound topic and waiting for its ack."""

    __slots__ = ("sent", "written_at", "ack", "wire_id", "first_send")

    def __init__(self, wire_id: int, first_send: bool) -> None:
        self.sent: list[AsyncEvent] | None = None  # what it carried (after before_transmit); None until written
        self.written_at = 0.0
        self.ack: dict[str, Any] | None = None
        self.wire_id = wire_id  # its batch id on the wire (``_wire_id``)
        self.first_send = first_send  # this primary had never written the batch before


class GatewaySenderService(QueuePrimary):
    """One instance of one gateway sender (serial or parallel)."""

    kind = "gateway-sender"
    #: How long to wait for an ack when socket_read_timeout_ms is 0 (Geode: forever).
    default_ack_timeout_s = 60.0

    def __init__(self, cfg: SiteConfig, sender_id: str, *, member_id: str | None = None) -> None:
        sender = cfg.sender(sender_id)
        if sender.remote is None:
            raise ConfigError([(f"gateway_senders[{sender_id}].remote", None,
                                "a sender needs the remote site's Kafka (bootstrap_servers, topic_prefix)")])
        super().__init__(cfg, sender_id, sender,
                         member_id=member_id or f"{cfg.site}-sender-{uuid.uuid4().hex[:8]}",
                         start_state=DesiredState.STOPPED if sender.manual_start else DesiredState.RUNNING)
        self.sender = sender
        self.remote_dsid = sender.remote_dsid
        remote_names = TopicNames(sender.remote.topic_prefix)
        self.remote_inbound = remote_names.gateway_inbound()
        self.remote_acks = remote_names.gateway_acks()
        self.ack_timeout_s = sender.socket_read_timeout_ms / 1000 if sender.socket_read_timeout_ms else \
            self.default_ack_timeout_s
        # What every event of a region gets in visited_dsids, its origin aside (GatewayBatch.visited_added):
        # this site and every site this site's senders of the region send to, so that none of them gets
        # the event from the receiving site again.
        self._visited_added = {r.name: sorted({cfg.dsid} | {cfg.sender(s).remote_dsid for s in r.gateway_senders})
                               for r in cfg.regions}
        self._batch_header = self._codec.header("GatewayBatch")
        # Per inbound partition (acks come on the partition of their batch): the GatewayBatch version its
        # receiver reads, as its latest ack said (version 2 until one says more); guarded by _acked.
        self._batch_versions: dict[int, int] = {}
        # Per acks partition: the end it had when the ack thread started (what lies below is another run's).
        self._acks_known_below: dict[int, int] = {}
        self._remote_producer: Any = None
        self._ack_reader: Any = None
        self._ack_thread: threading.Thread | None = None
        #: Why the ack thread stopped, when no retry could mend it: the next offer raises it (the sender crashes).
        self._acks_failed: SluiceError | None = None
        self._writing = kafka_errors(f"writing to {self.remote_inbound} at dsid {self.remote_dsid}")
        # (queue partition, batch id on the wire, which the acks carry) -> the batch written and waiting
        # for its ack.
        self._in_flight: dict[tuple[int, int], _InFlight] = {}
        self._acked = threading.Condition()
        self._inbound_partitions = 0
        self._removals: dict[int, dict[str, Any]] = {}
        self._removals_read_at: float | None = None
        # Batches written at least once (or tried: a write that timed out may have landed) and not yet
        # acknowledged, by (partition, batch id); guarded by _acked.
        self._sent: set[tuple[int, int]] = set()
        # Per queue partition: what is added to a batch id on the wire (0 until the receiver's tracking
        # is found ahead of this epoch), and the highest batch id on the wire written in this epoch.
        # Set by first_batch_id (loop thread, at assignment) and by the partition's one worker.
        self._id_shift: dict[int, int] = {}
        self._max_sent: dict[int, int] = {}
        self._epoch_markers: dict[int, dict[str, Any]] = {}
        self.stats.update({"batches_sent": 0, "resends": 0, "acks": 0, "event_exceptions": 0,
                           "filtered_at_transmit": 0, "acks_unverified": 0, "duplicate_ack_alerts": 0,
                           "unverified_ack_alerts": 0})
        self._unverified_logged_at = 0.0
        self._filters = SenderFilters(sender)
        # A batch that could not be sent or was not acknowledged goes again
        # with backoff up to retry_interval_ms (Geode: every 5 s while no
        # receiver answers).
        self.backoff_max_s = sender.retry_interval_ms / 1000
        # Signing is all or nothing per site (the site file is refused otherwise): with a private key the
        # remote site has a public key here, and only acks signed with it are taken.
        self._signer: Signer | None = site_signer(cfg)
        self._ack_verifier: Verifier | None = site_verifier(cfg, [self.remote_dsid])
        self._ack_key_prefix = f"{cfg.dsid}/{sender_id}/".encode()
        #: Who wrote a dead letter, as its record says.
        self._service = f"sender {self.member_id}"
        telemetry.observe(telemetry.ALERTS, self._read_gateway_alerts)

    def _read_gateway_alerts(self) -> telemetry.Reading:
        """The sender's own alerts, beside the queue's alert_threshold."""
        return [(self.stats["duplicate_ack_alerts"], {**self.attributes(),
                                                      "sluice.alert.name": "unexpected_duplicate_ack"}),
                (self.stats["unverified_ack_alerts"], {**self.attributes(), "sluice.alert.name": "unverified_ack"})]

    # --- the remote site ---------------------------------------------------------------

    def prepare(self) -> None:
        remote = self.sender.remote
        assert remote is not None
        base = remote.client_settings()
        self._remote_producer = make_producer(base, **{"client.id": f"{self.member_id}-remote"},
                                              **self.cfg.kafka.producer_settings())
        self._ack_reader = make_consumer(base, None, **{"client.id": f"{self.member_id}-acks",
                                                        "fetch.wait.max.ms": 20})
        # A bug that kills the ack thread is the sender's crash (``Service.spawn``), not a silent wait for acks.
        self._ack_thread = self.spawn(self._read_acks, name=f"acks-{self.queue_id}")

    def _inbound_partition(self, partition: int) -> int:
        """Where the batches of a queue partition go in the remote inbound topic:
        always the same one (the receiver applies a partition's batches in
        order), and this sender's partitions side by side from a place of
        their own, so that up to ``inbound_partitions`` of them are applied at
        once rather than sharing partitions where their keys hash alike."""
        n = self._remote_partitions()
        return (partition_for_key(f"{self.cfg.dsid}/{self.queue_id}".encode(), n) + partition) % n

    def _remote_partitions(self) -> int:
        """The remote inbound topic's partition count (asked again until the remote answers)."""
        if self._inbound_partitions == 0:
            with kafka_errors(f"remote site {self.remote_dsid} unreachable"):
                md = self._remote_producer.list_topics(self.remote_inbound, timeout=REMOTE_REQUEST_DEADLINE_S)
            topic = md.topics.get(self.remote_inbound)
            if topic is None or topic.error is not None or not topic.partitions:
                # The remote site's to make (or its broker's to know again): asked again, as Geode's
                # sender keeps connecting to a receiver that is not there.
                raise BrokerUnavailable(f"remote topic {self.remote_inbound} is missing at dsid {self.remote_dsid}")
            self._inbound_partitions = len(topic.partitions)
        return self._inbound_partitions

    def _read_acks(self) -> None:
        """One thread reads every ack of the remote acks topic from now on."""
        reader = self._ack_reader
        assigned = False
        assigning = kafka_errors(f"reading {self.remote_acks}")
        reading = kafka_errors("reading acks")
        while not self._stopping.is_set():
            if not assigned:
                try:
                    with assigning:
                        md = reader.list_topics(self.remote_acks, timeout=REMOTE_REQUEST_DEADLINE_S)
                        topic = md.topics.get(self.remote_acks)
                        if topic is None or topic.error is not None or not topic.partitions:
                            raise BrokerUnavailable(f"{self.remote_acks} missing")
                        reader.assign([TopicPartition(self.remote_acks, p, self._last_ack_offset(reader, p))
                                       for p in topic.partitions])
                    assigned = True
                except SluiceError as exc:
                    if not exc.retriable:
                        self._acks_failed = exc
                        log.error("acks of dsid %d cannot be read: %s", self.remote_dsid, exc)
                        break
                    log.warning("acks of dsid %d not readable yet: %s", self.remote_dsid, exc)
                    self._stopping.wait(self.sender.retry_interval_ms / 1000)
                    continue
            try:
                with reading:
                    msgs = consume_available(reader, 500, 0.1)
            except SluiceError as exc:
                if not exc.retriable:
                    self._acks_failed = exc
                    log.error("acks of dsid %d cannot be read: %s", self.remote_dsid, exc)
                    break
                log.warning("%s", exc)
                continue
            for msg in msgs:
                if msg.error() is not None:
                    continue
                self._take_ack_record(msg)
        reader.close()

    def _last_ack_offset(self, reader: Any, partition: int) -> int:
        """Where the ack thread starts reading an acks partition: at its last record, whoever's ack it
        is, to learn which batch versions that partition's receiver reads before anything is sent
        (``_learn_versions``); at its end when it is empty."""
        low, high = reader.get_watermark_offsets(TopicPartition(self.remote_acks, partition),
                                                timeout=REMOTE_REQUEST_DEADLINE_S)
        if high <= low:
            return OFFSET_END
        self._acks_known_below[partition] = high
        return high - 1

    def _take_ack_record(self, msg: Any) -> None:
        """One record of the remote acks topic (ack thread): an ack of a batch in flight is handed to the
        worker waiting for it, once its signature is verified."""
        key = msg.key() or b""
        if msg.offset() < self._acks_known_below.get(msg.partition(), -1):
            self._learn_versions(msg)  # the partition's last ack before this sender started
            return
        if not key.startswith(self._ack_key_prefix):
            return  # another sender's (unsigned, the key only saves verifying what is not ours)
        if self._ack_verifier is not None:
            try:
                self._ack_verifier.signer(msg.value(), msg.headers())
            except BadSignature as exc:
                self._unverified_ack(msg, exc)
                return
        try:
            ack = self._codec.decode_as("GatewayAck", msg.value())
        except CodecError as exc:
            log.error("unreadable ack at %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), exc)
            return
        if ack["sender_id"] != self.queue_id or ack["source_dsid"] != self.cfg.dsid:
            return
        if ack["receiver_dsid"] != self.remote_dsid:
            self._unverified_ack(msg, BadSignature("receiver_dsid", ack["receiver_dsid"], f"an ack in dsid "
                                                   f"{self.remote_dsid}'s acks topic names another site"))
            return
        with self._acked:
            self._take_versions(msg.partition(), ack)
            entry = self._in_flight.get((ack["queue_partition"], ack["batch_id"]))
            # A batch read twice by the receiver (a crash before its commit) is acknowledged twice: the
            # ack that applied it, then duplicate_batch.  The first one tells what happened.
            if entry is not None and (entry.ack is None or entry.ack["duplicate_batch"]):
                entry.ack = ack
                self._acked.notify_all()

    def _learn_versions(self, msg: Any) -> None:
        """The batch versions an ack of another sender says its receiver reads, when the remote site
        signed it; nothing else is taken from it."""
        try:
            if self._ack_verifier is not None:
                self._ack_verifier.signer(msg.value(), msg.headers())
            ack = self._codec.decode_as("GatewayAck", msg.value())
        except (BadSignature, CodecError):
            return
        if ack["receiver_dsid"] == self.remote_dsid:
            with self._acked:
                self._take_versions(msg.partition(), ack)

    def _take_versions(self, inbound_partition: int, ack: dict[str, Any]) -> None:
        """The batch version to write to an inbound partition, from its receiver's ack (under _acked)."""
        versions = ack["batch_versions"]
        version = (BATCH_VERSION_CALLBACKS if BATCH_VERSION_CALLBACKS in versions
                   else BATCH_VERSION_BODIES if BATCH_VERSION_BODIES in versions else BATCH_VERSION_RECORDS)
        if self._batch_versions.get(inbound_partition, BATCH_VERSION_RECORDS) != version:
            log.info("sender %s: the receiver of dsid %d's inbound partition %d reads GatewayBatch version %d; "
                     "batches go to it as version %d", self.queue_id, self.remote_dsid, inbound_partition, version,
                     version)
            self._batch_versions[inbound_partition] = version

    def _unverified_ack(self, msg: Any, problem: BadSignature) -> None:
        """Counted and ignored (the batch goes again after the ack timeout); an alert, logged when it
        starts and then every ``ALERT_REPEAT_S`` at most: whoever writes it is not the remote site."""
        self.stats["acks_unverified"] += 1
        now = time.monotonic()
        if self._unverified_logged_at and now - self._unverified_logged_at < ALERT_REPEAT_S:
            return
        self._unverified_logged_at = now
        self.stats["unverified_ack_alerts"] += 1
        log.error("ALERT sender %s: ack at %s[%d]@%d ignored: %s (%d ignored so far)", self.queue_id, msg.topic(),
                  msg.partition(), msg.offset(), problem, self.stats["acks_unverified"],
                  extra={"alert": "unverified_ack", "queue_id": self.queue_id, "remote_dsid": self.remote_dsid,
                         "ignored": self.stats["acks_unverified"]})

    # --- what crosses ---------------------------------------------------------------------

    def accepts(self, event: EntryEvent) -> bool:
        if not goes_to_gateway(event.operation):
            return False
        return event.origin_dsid != self.remote_dsid and self.remote_dsid not in event.visited_dsids

    def first_batch_id(self, partition: int) -> int:
        """Open a new epoch for the partition, durably, before anything is sent: above the last
        removal's, and above an epoch a primary opened when the receiver's tracking was ahead."""
        last = self._last_removal(partition)
        marker = self._epoch_markers.get(partition)
        epoch = max((r["batch_id"] >> EPOCH_SHIFT) + 1 for r in (last, marker) if r is not None) \
            if last or marker else 1
        first = epoch << EPOCH_SHIFT
        record = {
            "queue_id": self.queue_id,
            "queue_partition": partition,
            "batch_id": first,
            "last_removed_offset": last["last_removed_offset"] if last else -1,
            "last_event_id": last["last_event_id"] if last else None,
            "removed_count": 0,
            "removed_at": int(time.time() * 1000),
        }
        produce_durably(self._producer, self.removals_topic, self._codec.encode("RemovalRecord", record),
                        str(partition).encode(), what=f"epoch {epoch} of {self.queue_id}[{partition}]",
                        stopping=self._stopping)
        self._removals[partition] = record
        self._id_shift[partition] = 0
        self._max_sent[partition] = first
        log.info("sender %s[%d]: epoch %d", self.queue_id, partition, epoch)
        return first + 1

    def assignment_starting(self) -> None:
        # Read the removals afresh for every assignment: an epoch this or another member opened since the
        # last read must be seen, or a new epoch would repeat its batch ids, and the receiver would take
        # the new batches for repeats of acknowledged ones and drop them.
        self._removals_read_at = None

    def _last_removal(self, partition: int) -> dict[str, Any] | None:
        """The partition's latest removal record.  An assignment opens the
        epochs of all its partitions one after another: one read of the
        removals topic (per assignment) serves them all."""
        if self._removals_read_at is None:
            self._removals, self._epoch_markers = self._read_removals()
            self._removals_read_at = time.monotonic()
        return self._removals.get(partition)

    def _read_removals(self) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        """The removals topic, read whole (again while its broker does not answer): a new epoch must be
        above every one opened before."""
        return until_answered(self._read_removals_once, f"sender {self.queue_id}: reading {self.removals_topic}",
                              stopping=self._stopping)

    def _read_removals_once(self) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        """(latest removal, latest epoch marker) per queue partition."""
        reader = make_consumer(self.cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
        latest: dict[int, dict[str, Any]] = {}
        markers: dict[int, dict[str, Any]] = {}
        try:
            for msg in read_to_end(reader, self.removals_topic):
                key = msg.key() or b""
                found, key = (markers, key[len(b"epoch/"):]) if key.startswith(b"epoch/") else (latest, key)
                try:
                    found[int(key)] = self._codec.decode_as("RemovalRecord", msg.value())
                except (CodecError, ValueError):
                    continue
        finally:
            reader.close()
        return latest, markers

    def _wire_id(self, partition: int, batch_id: int) -> int:
        """A batch's id in the GatewayBatch and its ack: its id in the queue's batcher, moved into a new
        epoch when the receiver's tracking was found ahead (``_open_epoch_above``)."""
        return batch_id + self._id_shift.get(partition, 0)

    def _receiver_ahead(self, partition: int, entry: _InFlight, ack: dict[str, Any]) -> bool:
        """The ack says duplicate_batch of a batch the receiver cannot have applied: this primary had
        not written it before, or the receiver names a batch id applied that this primary never sent."""
        return bool(ack["duplicate_batch"]) and (
            entry.first_send or ack["last_batch_id"] > self._max_sent.get(partition, -1))

    def _open_epoch_above(self, partition: int, batch: Batch[AsyncEvent], entry: _InFlight,
                          ack: dict[str, Any]) -> None:
        """The receiver's tracking is ahead of this epoch: alert, remove nothing, and number ``batch``
        and those after it in a new epoch above what the receiver applied, durably recorded first.
        When no epoch above fits a batch id (an ack claiming an absurd id), the batch just waits."""
        highest = max(ack["last_batch_id"], entry.wire_id, self._max_sent.get(partition, -1))
        epoch = (highest >> EPOCH_SHIFT) + 1
        self.stats["duplicate_ack_alerts"] += 1
        alert = {"alert": "unexpected_duplicate_ack", "queue_id": self.queue_id, "partition": partition,
                 "remote_dsid": self.remote_dsid, "batch_id": entry.wire_id,
                 "receiver_last_batch_id": ack["last_batch_id"]}
        why = "this primary had not sent it before" if entry.first_send else \
            f"dsid {self.remote_dsid} has applied batch {ack['last_batch_id']}, which this primary never sent"
        if epoch > EPOCH_MAX:
            log.error("ALERT sender %s[%d]: dsid %d answered batch %d as a duplicate, but %s; no epoch is above "
                      "%d: the batch is not removed and waits", self.queue_id, partition, self.remote_dsid,
                      entry.wire_id, why, ack["last_batch_id"], extra=alert)
            return
        first = epoch << EPOCH_SHIFT
        last = self._removals.get(partition)
        marker = {
            "queue_id": self.queue_id,
            "queue_partition": partition,
            "batch_id": first,
            "last_removed_offset": last["last_removed_offset"] if last else -1,
            "last_event_id": None,
            "removed_count": 0,
            "removed_at": int(time.time() * 1000),
        }
        produce_durably(self._producer, self.removals_topic, self._codec.encode("RemovalRecord", marker),
                        epoch_marker_key(partition), what=f"epoch {epoch} of {self.queue_id}[{partition}]",
                        stopping=self._stopping)
        self._epoch_markers[partition] = marker
        self._id_shift[partition] = first + 1 - batch.batch_id
        self._max_sent[partition] = first
        log.error("ALERT sender %s[%d]: dsid %d answered batch %d as a duplicate, but %s: its tracking is ahead "
                  "of this epoch (batch ids started over?). Nothing is removed; epoch %d opened above it, the "
                  "batches go again from batch %d", self.queue_id, partition, self.remote_dsid, entry.wire_id, why,
                  epoch, first + 1, extra={**alert, "epoch": epoch})

    # --- one batch --------------------------------------------------------------------------

    def max_in_flight(self) -> int:
        return self.queue.max_batches_in_flight

    def redelivering(self, part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> None:
        """The batches this primary wrote (or tried to) go again with every event possibleDuplicate
        (GatewayBatch ``duplicate_events``, and the before_transmit filters see it); those not
        written yet, having waited behind them, go out the first time as they are."""
        partition = part.tp.partition
        with self._acked:
            sent = [b for b in batches if (partition, b.batch_id) in self._sent]
        for batch in sent:
            flag_possible_duplicates(batch)

    def worker_threads(self) -> int:
        """Waiting for acks is not dispatching (Geode reads acks on a thread of
        its own): every queue partition may wait at once, besides the
        dispatcher_threads that write."""
        partitions = next(q.partitions for q in self.cfg.all_attached_queues() if q.id == self.queue_id)
        return max(self.queue.dispatcher_threads, partitions)

    def deliver_group(self, part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> int:
        """Write the batches not yet written to the remote inbound topic, each
        durable before the next (so the receiver sees them in order and an ack
        of one means every earlier one was handled); wait for the oldest one's
        ack, and take the acks already there of those after it.  Returns how
        many, from the oldest, were acknowledged: the others stay written and
        awaited, and the next call adds new batches behind them (a sliding
        window of ``max_batches_in_flight``).

        A failure is a refusal (0: the batches are offered again) when it is ``retriable`` (the
        remote site unreachable, its topic missing, a write not acknowledged); any other is raised,
        and the sender stops as crashed (``QueuePrimary``)."""
        partition = part.tp.partition
        if self._acks_failed is not None:
            raise self._acks_failed
        try:
            for batch in batches:
                if batch.events and (partition, self._wire_id(partition, batch.batch_id)) not in self._in_flight:
                    if not self._write(part, batch):
                        break
                    if self._versions_unknown(partition):
                        break  # one batch out until its receiver says which versions it reads
            acknowledged = 0
            waited = False
            for i, batch in enumerate(batches):
                if not batch.events:
                    acknowledged += 1
                    continue
                entry = self._in_flight.get((partition, self._wire_id(partition, batch.batch_id)))
                if entry is None:
                    break  # not written
                if not waited:
                    waited = True
                    if not self._await_ack(part, batch, entry):
                        self._forget(partition, batches)
                        return 0
                elif entry.ack is None:
                    break
                assert entry.ack is not None
                if self._receiver_ahead(partition, entry, entry.ack):
                    self._forget(partition, batches[i:])
                    self._open_epoch_above(partition, batch, entry, entry.ack)
                    return acknowledged
                self._take_ack(partition, batch, entry)
                acknowledged += 1
            return acknowledged
        except SluiceError as exc:
            self._forget(partition, batches)
            if not exc.retriable:
                raise
            log.warning("sender %s[%d]: %s; retrying", self.queue_id, partition, exc)
            return 0

    def _versions_unknown(self, partition: int) -> bool:
        """No ack has said yet which batch versions the receiver of the partition's batches reads: its
        batches go as version 2, one at a time, so that few go so before the first ack says more."""
        with self._acked:
            return self._inbound_partition(partition) not in self._batch_versions

    def partitions_released(self, partitions: list[int]) -> None:
        """A new primary sends their batches again (with new ids): nothing of theirs is awaited here."""
        released = set(partitions)
        with self._acked:
            for key in [k for k in self._in_flight if k[0] in released]:
                del self._in_flight[key]
            self._sent.difference_update([k for k in self._sent if k[0] in released])

    def _forget(self, partition: int, batches: list[Batch[AsyncEvent]]) -> None:
        """The batches will be written again (possibleDuplicate), not awaited as they are."""
        with self._acked:
            for batch in batches:
                self._in_flight.pop((partition, self._wire_id(partition, batch.batch_id)), None)

    def _write(self, part: QueuePartition, batch: Batch[AsyncEvent]) -> bool:
        """One GatewayBatch into the remote inbound topic, durably, registered
        as in flight (before it is written, so its ack cannot be missed)."""
        partition = part.tp.partition
        with self._acked:
            # Written (or tried: a write that timed out may have landed) by this primary before.  Its
            # events are flagged possibleDuplicate by then (``redelivering``); a batch that only waited
            # behind a failed one goes out unflagged the first time.
            resend = (partition, batch.batch_id) in self._sent
            # Before the write: one that times out may still land, and the next is then a resend.
            self._sent.add((partition, batch.batch_id))
        inbound_partition = self._inbound_partition(partition)
        with self._acked:
            version = self._batch_versions.get(inbound_partition, BATCH_VERSION_RECORDS)
        wire_id = self._wire_id(partition, batch.batch_id)
        key = f"{self.cfg.dsid}/{self.queue_id}/{partition}"
        if self._filters.at_transmit or version < BATCH_VERSION_BODIES:
            # The filters touch the events, and version 2 carries them as records: each is decoded, and
            # one that does not decode is dead-lettered and leaves the batch for good.
            for e in batch.events:
                _decodes(e)
            self.dead_letter_undecodable(batch, self._service)
        events: list[AsyncEvent] = batch.events
        if self._filters.at_transmit:
            events = [e for e in events if self._filters.transmits(e)]
            self.stats["filtered_at_transmit"] += len(batch.events) - len(events)
        fields = {
            "sender_id": self.queue_id, "source_dsid": self.cfg.dsid, "target_dsid": self.remote_dsid,
            "queue_partition": partition, "batch_id": wire_id, "first_offset": batch.first_offset,
            "last_offset": batch.last_offset, "possible_duplicate": resend,
            # Stamped at every send: the receiver refuses a batch older than receiver.batch_max_age_ms.
            "created_at": int(time.time() * 1000),
        }
        if version >= BATCH_VERSION_BODIES:
            # A receiver of version 3 applies wan-copy's entries as any other (it cannot be told otherwise).
            quiet = ([i for i, e in enumerate(events) if not e.generate_callbacks]
                     if version >= BATCH_VERSION_CALLBACKS else None)
            value = gateway_batch(self._batch_header if quiet is not None else GATEWAY_BATCH_V3_HEADER, **fields,
                                  bodies=[e.body for e in events],
                                  duplicate_events=[i for i, e in enumerate(events) if e.possible_duplicate],
                                  visited_added=self._visited_added, no_callback_events=quiet)
        else:
            value = gateway_batch_v2(**fields, bodies=[self._outgoing(e, resend) for e in events])
        spans, headers = self._send_spans(part, batch, events) if self._tracing else ([], None)
        if self._signer is not None:
            # Over the bytes exactly as written, once per send.
            headers = (headers or []) + self._signer.headers(value)
        entry = _InFlight(wire_id, first_send=not resend)
        with self._acked:
            self._in_flight[(partition, wire_id)] = entry
        errors: list[Any] = []
        try:
            with self._writing:
                self._remote_producer.produce(self.remote_inbound, value, key.encode(), partition=inbound_partition,
                                              headers=headers, on_delivery=lambda err, _m: errors.append(err))
        except KafkaCallFailed as exc:
            with self._acked:
                self._in_flight.pop((partition, wire_id), None)
            for span in spans:
                span.end()
            if exc.code in TOPIC_MISSING:
                # As in ``_remote_partitions``: the remote site's topic to make (or its broker's to know
                # again), asked again.
                raise BrokerUnavailable(f"remote topic {self.remote_inbound} is missing at dsid {self.remote_dsid} "
                                        f"({exc})", code=exc.code) from exc
            raise
        unwritten = self._remote_producer.flush(self.cfg.kafka.delivery_timeout_ms / 1000) or errors != [None]
        for span in spans:
            if unwritten:
                span.set_status(StatusCode.ERROR, f"not written: {errors}")
            span.end()
        if unwritten:
            log.warning("sender %s[%d]: batch %d not written to dsid %d (%s)", self.queue_id, partition,
                        wire_id, self.remote_dsid, errors)
            with self._acked:
                self._in_flight.pop((partition, wire_id), None)
            return False
        entry.sent = events
        entry.written_at = time.monotonic()
        self._max_sent[partition] = max(self._max_sent.get(partition, -1), wire_id)
        self.stats["batches_sent"] += 1
        if resend:
            self.stats["resends"] += 1
        return True

    def _send_spans(self, part: QueuePartition, batch: Batch[AsyncEvent],
                    events: list[AsyncEvent]) -> tuple[list[Any], list[tuple[str, bytes]] | None]:
        """A ``send {remote inbound topic}`` span per event that came with a trace context, and the
        batch record's header carrying each event's context to the receiver (one
        line per event, empty for an event without)."""
        attributes = {**self.attributes(part.tp.partition), "messaging.operation.name": "send",
                      "sluice.batch.id": self._wire_id(part.tp.partition, batch.batch_id),
                      "sluice.remote.destination": self.remote_inbound}
        spans: list[Any] = []
        lines: list[str] = []
        for e in events:
            parent = event_traceparent(e)
            if parent is None:
                lines.append("")
                continue
            try:
                key = e.key
            except MalformedRecord:
                key = ""  # its receiver finds out, and its ack says so
            span = telemetry.messaging_span("send", self.remote_inbound, parent=parent, kind=SpanKind.PRODUCER,
                                            attributes={**attributes, "sluice.key": key})
            spans.append(span)
            lines.append(telemetry.traceparent_of(span) or "")
        if not spans:
            return [], None
        return spans, [(telemetry.BATCH_TRACEPARENTS, "\n".join(lines).encode())]

    def _await_ack(self, part: QueuePartition, batch: Batch[AsyncEvent], entry: _InFlight) -> bool:
        """Wait for the batch's ack, up to socket_read_timeout_ms after it was written."""
        partition = part.tp.partition
        end = entry.written_at + self.ack_timeout_s
        with self._acked:
            while entry.ack is None:
                if time.monotonic() > end:
                    log.warning("sender %s[%d]: no ack for batch %d in %.1fs; it will be sent again",
                                self.queue_id, partition, entry.wire_id, self.ack_timeout_s)
                    # A receiver that does not read the version sent dead-letters it and never answers: the
                    # partition goes back to the version every receiver reads until an ack says more.
                    self._batch_versions.pop(self._inbound_partition(partition), None)
                    return False
                if (self._stopping.is_set() or part.revoked or part.clean_due
                        or self.desired is not DesiredState.RUNNING):
                    why = "stopping" if self._stopping.is_set() else "partition revoked" if part.revoked \
                        else "a clean start is due" if part.clean_due else self.desired.value.lower()
                    log.info("sender %s[%d]: %s while batch %d waits for its ack; it stays queued", self.queue_id,
                             partition, why, entry.wire_id)
                    return False
                self._acked.wait(ACK_WAIT_SLICE_S)
        return True

    def _take_ack(self, partition: int, batch: Batch[AsyncEvent], entry: _InFlight) -> None:
        """The batch is acknowledged: dead-letter what the remote refused, tell the filters."""
        ack, sent = entry.ack, entry.sent
        assert ack is not None and sent is not None
        self.stats["acks"] += 1
        for exc in ack["exceptions"]:
            # Each refused event, with its exception, durably in the dead-letter topic before the batch is removed.
            if 0 <= exc["index"] < len(sent):
                self.dead_letter_event(sent[exc["index"]], f"dsid {self.remote_dsid} refused it: "
                                       f"{exc['exception_class']}: {exc['message']}", exc["exception_class"],
                                       self._service)
                self.stats["event_exceptions"] += 1
        with self._acked:
            self._in_flight.pop((partition, entry.wire_id), None)
            self._sent.discard((partition, batch.batch_id))
        if self._filters.after_ack:
            # They touch the events: one the remote site could not read either is left out.
            self._filters.acknowledged([e for e in sent if _decodes(e)])

    def _outgoing(self, e: AsyncEvent, resend: bool) -> bytes:
        """An event (one that decodes) as a version-2 batch carries it: its body with this sender's
        changes spliced in (visited sites, possibleDuplicate)."""
        body = e.body
        event, layout = decode_entry(body)
        added = self._visited_added.get(event.region, (self.cfg.dsid,))
        return splice_entry(body, layout, possible_duplicate=e.possible_duplicate or resend,
                            visited_dsids=visited_after(event.visited_dsids, added, event.origin_dsid))

    def alert_threshold_ms(self) -> int:
        return self.sender.alert_threshold_ms

    # --- metrics -------------------------------------------------------------------------

    def batch_counts(self) -> tuple[int, int, int]:
        return self.stats["batches_sent"], self.stats["acks"], self.stats["resends"]

    def attributes(self, partition: int | None = None) -> dict[str, Any]:
        return {**super().attributes(partition), "sluice.remote.dsid": self.remote_dsid}

    def release(self) -> None:
        if self._ack_thread is not None:
            self._ack_thread.join(ACK_THREAD_JOIN_DEADLINE_S)
        if self._remote_producer is not None:
            self._remote_producer.flush(REMOTE_FLUSH_DEADLINE_S)
