"""The subscription tables as every instance reads them: the registry and the acks (written by clients,
keyed by client id) and the fill checkpoints (the primaries'), and the trust rules a record of them must
pass before anything is taken from it.

Trust (issue 17).  The registry and the acks are written by clients, so no
record of them is acted on before it passes the checks of
``sluice.core.clientregistry`` (the rules its clients hold too): its key is a
client id in that client's partition; a registration or ack names its own
client and a queue of that client
(``<prefix>subscription.<client_id>.<8 lowercase hex digits>``), never
another topic; its interest regexes compile with RE2; and, with
``subscriptions.token`` set, it carries ``authorization: Bearer <token>``
(tombstones and acks too).  Fill checkpoints must name the site's
changelogs and client queues.  A record that cannot be read or fails a check
changes nothing: the primary of its partition counts it, logs it, writes it
to the dead-letter topic with the reason, tells the client why (REFUSED, on
a queue that passes the check and exists) and, for a registry or ack record,
writes the client's record in force again (header ``sluice-restored``), so
that compaction keeps it rather than the forgery; the loop goes on.  An
undecodable changelog record is dead-lettered by the primary of registry
partition ``changelog partition mod registry partitions``, the one instance
that fills it for that partition, not by every instance reading it.

Which principal may write what (Kafka ACLs enforce it; the checks above are
what holds when they are wider): clients write the registry and the acks,
and create and delete topics under their own ``subscription.<client_id>.``
prefix; the subscription service writes the fill, dead-letter and client
queue topics, creates and deletes client queues, and deletes records from
them; no one else writes any of these.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..core.clientregistry import (
    RESTORED,
    bearer,
    check_ack,
    check_authorized,
    check_checkpoint,
    check_key,
    check_registration,
    header_value,
    queue_topic_problem,
    registry_partition,
)
from ..core.codec import get_codec
from ..core.config import SiteConfig
from ..core.errors import CodecError, InvalidRequest, SluiceError, TablesBehind
from ..core.kafka import Consumer, TopicPartition, kafka_errors
from .protocol import SubscriptionProtocol

log = logging.getLogger("sluice.subscriptions")

#: How many refusals an instance remembers having answered (so each is answered once).
REFUSALS_REMEMBERED = 4096
#: How long a refusal waits to be answered: for the client's queue topic to be seen (the client
#: creates it just before it registers), or for this instance to become its partition's primary.
REFUSAL_ANSWER_WAIT_S = 60.0
#: How long reading the registry, acks and fill tables may take (at start: their partitions' leaders
#: may still be moving, a retriable failure tried again within it), and the pause between tries.
READ_TABLES_S = 30.0
READ_TABLES_RETRY_S = 0.2
#: How long one read of the subscription tables waits for records while it reads them to their end.
READ_TABLES_WAIT_S = 0.05
#: How long asking the broker for one table partition's end offset may take.
END_OFFSET_DEADLINE_S = 10.0

_READING_TABLES = kafka_errors("reading the subscription tables")

#: ``produce(topic, value, key, partition, headers)``: a write of the service's producer.
Produce = Callable[[str, "bytes | None", "bytes | None", int, "list[tuple[str, bytes]] | None"], None]


class SubscriptionTables:
    """The tables one subscription-service instance has read, and what it does with each record.

    ``consumer()`` is the instance's table consumer (assigned every partition of the three tables);
    ``produce`` writes through its producer; ``drop_client(id)`` forgets a client whose registration
    was deleted; ``topic_exists(topic)`` asks the broker; ``message(fields)`` encodes a ClientMessage."""

    def __init__(self, cfg: SiteConfig, protocol: SubscriptionProtocol, stats: dict[str, int], *, member_id: str,
                 token: str | None, stopping: Any, consumer: Callable[[], Consumer | None], produce: Produce,
                 drop_client: Callable[[str], None], topic_exists: Callable[[str], bool],
                 message: Callable[[dict[str, Any]], bytes]) -> None:
        self.cfg = cfg
        self.protocol = protocol
        self.stats = stats
        self.member_id = member_id
        self.token = token
        names = cfg.topics
        self.registry_topic = names.subscription_registry()
        self.acks_topic = names.subscription_acks()
        self.fill_topic = names.subscription_fill()
        self.dead_letter_topic = names.subscription_dead_letter()
        self.partitions = cfg.subscriptions.registry_partitions
        self._codec = get_codec()
        self._stopping = stopping
        self._consumer = consumer
        self._produce = produce
        self._drop_client = drop_client
        self._topic_exists = topic_exists
        self._message = message
        #: Client id → its registration, and its ack, in force.
        self.registry: dict[str, dict[str, Any]] = {}
        self.acks: dict[str, dict[str, Any]] = {}
        self._refusals_answered: dict[tuple[str, str, int], None] = {}  # (client, session, version), oldest first
        #: Refusals not answered yet, by (client, session, version): (registry partition, record, reason,
        #: give-up time), oldest first; answered by ``answer_refusals``.
        self._refusals_waiting: dict[tuple[str, str, int], tuple[int, dict[str, Any], str, float]] = {}

    @property
    def refusals_waiting(self) -> bool:
        return bool(self._refusals_waiting)

    def end(self, tp: TopicPartition, deadline: float) -> int:
        """The end offset of a table partition; a retriable failure (a leader moving) is tried again
        until ``deadline``, any other raised at once."""
        consumer = self._consumer()
        assert consumer is not None
        while True:
            try:
                with kafka_errors(f"reading the end of {tp.topic}"):
                    return consumer.get_watermark_offsets(tp, timeout=END_OFFSET_DEADLINE_S)[1]
            except SluiceError as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    raise
                log.info("subscriptions %s: %s; trying again", self.member_id, exc)
                if self._stopping.wait(READ_TABLES_RETRY_S):
                    raise

    def read(self, to_end: bool = False) -> None:
        consumer = self._consumer()
        assert consumer is not None
        deadline = time.monotonic() + READ_TABLES_S
        ends: dict[tuple[str, int], int] = {}
        if to_end:
            for topic in (self.registry_topic, self.acks_topic, self.fill_topic):
                for p in range(self.partitions):
                    high = self.end(TopicPartition(topic, p), deadline)
                    if high > 0:
                        ends[(topic, p)] = high
        while True:
            with _READING_TABLES:
                msgs = consumer.consume(1000, READ_TABLES_WAIT_S if ends else 0)
                for msg in msgs:
                    if msg.error() is None:
                        self.take(msg)
                if ends:
                    for tp in consumer.position([TopicPartition(t, p) for t, p in ends]):
                        if tp.offset >= ends[(tp.topic, tp.partition)]:
                            del ends[(tp.topic, tp.partition)]
            if ends and time.monotonic() > deadline:
                raise TablesBehind(f"the subscription tables were not read to their end in {READ_TABLES_S:.0f} s "
                                   f"({len(ends)} partitions behind)")
            if not ends and len(msgs) < 1000:
                return

    def take(self, msg: Any) -> None:
        """One record of the registry, acks or fill topic, taken only once it passes its checks
        (module docstring, "Trust"); else refused, and nothing changes."""
        topic, partition, value = msg.topic(), msg.partition(), msg.value()
        name = (msg.key() or b"").decode("utf-8", "replace")
        headers = msg.headers()
        if topic == self.registry_topic:
            what, schema = ("registration" if value is not None else "registry tombstone"), "ClientRegistration"
        elif topic == self.acks_topic:
            what, schema = ("ack" if value is not None else "ack tombstone"), "ClientAck"
        else:
            what, schema = "fill checkpoint", "FillCheckpoint"
        record: dict[str, Any] | None = None
        try:
            if value is not None:
                record = self._codec.decode_as(schema, value)
            if topic == self.fill_topic:
                if record is not None:
                    check_checkpoint(self.cfg, partition, record)
                    self.protocol.take_checkpoint(record)
                return
            check_key(self.cfg, name, partition)
            check_authorized(headers, self.token, what)
            restored = header_value(headers, RESTORED) is not None
            if topic == self.registry_topic:
                if record is not None:
                    check_registration(self.cfg, name, partition, record)
                self._take_registration(partition, name, record, restored)
            else:
                if record is not None:
                    check_ack(self.cfg, name, partition, record)
                self._take_ack(partition, name, record, restored)
        except (CodecError, InvalidRequest) as exc:
            self._refuse(msg, name, what, record, exc)

    def _take_registration(self, partition: int, name: str, record: dict[str, Any] | None, restored: bool) -> None:
        current = self.registry.get(name)
        if restored and current is not None:
            if record != current:
                # Written again after a forgery, but this client has written since: its newer record
                # is written again in turn, so that compaction keeps the newest.
                self._restore(self.registry_topic, partition, name)
            return
        if record is None:
            self.registry.pop(name, None)
            self._drop_client(name)
            return
        self.registry[name] = record
        if partition in self.protocol.owned:
            self.protocol.registration(partition, record)

    def _take_ack(self, partition: int, name: str, record: dict[str, Any] | None, restored: bool) -> None:
        current = self.acks.get(name)
        if restored and current is not None:
            if record != current:
                self._restore(self.acks_topic, partition, name)
            return
        if record is None:
            self.acks.pop(name, None)
        else:
            self.acks[name] = record
            self.protocol.acked(name, record)

    def _refuse(self, msg: Any, name: str, what: str, record: dict[str, Any] | None, exc: SluiceError) -> None:
        """A table record that cannot be read or fails a check changes nothing.  The primary of its
        partition (one instance, not every reader) counts it, logs it, dead-letters it with the
        reason, tells the client why where that is safe, and writes the client's record in force
        again so that compaction keeps it rather than the refused one."""
        topic, partition = msg.topic(), msg.partition()
        if partition not in self.protocol.owned:
            if topic == self.registry_topic and record is not None:
                # Its client waits for an answer: the instance that becomes the primary gives it.
                self._wait_refusal(partition, name, record, f"registration refused: {_refusal_reason(exc)}")
            return
        why = _refusal_reason(exc)
        reason = f"{what} refused: {why}" if not isinstance(exc, CodecError) else f"{what} cannot be read: {why}"
        self.stats["undecodable" if isinstance(exc, CodecError) else "refused"] += 1
        log.warning("subscriptions %s: client %r: %s (%s[%d]@%d)", self.member_id, name, reason, topic, partition,
                    msg.offset(), extra={"refused": what, "client_id": name, "reason": reason})
        self.dead_letter(msg, reason, type(exc).__name__)
        if topic == self.registry_topic and record is not None:
            self._wait_refusal(partition, name, record, reason)
            self.answer_refusals()
        if topic in (self.registry_topic, self.acks_topic):
            self._restore(topic, partition, name)

    def _wait_refusal(self, partition: int, name: str, record: dict[str, Any], reason: str) -> None:
        answer = (name, record["session"], record["version"])
        if answer in self._refusals_answered or answer in self._refusals_waiting:
            return
        self._refusals_waiting[answer] = (partition, record, reason, time.monotonic() + REFUSAL_ANSWER_WAIT_S)
        while len(self._refusals_waiting) > REFUSALS_REMEMBERED:
            del self._refusals_waiting[next(iter(self._refusals_waiting))]

    def answer_refusals(self) -> None:
        """REFUSED, on the client's queue, once per (session, version), by its partition's primary, and
        only where that is safe: the queue is this client's by the queue rule and exists, and the record
        is of the session in force (or of a client not registered yet), so a forgery cannot fill another
        topic or client.  A queue not seen yet (the client created it a moment ago) is looked for again
        on the next turns, for ``REFUSAL_ANSWER_WAIT_S``."""
        now = time.monotonic()
        for answer, (partition, record, reason, give_up) in list(self._refusals_waiting.items()):
            name = answer[0]
            current = self.registry.get(name)
            topic = record["queue_topic"]
            if (now > give_up or (current is not None and current["session"] != record["session"])
                    or queue_topic_problem(self.cfg, name, topic) is not None):
                del self._refusals_waiting[answer]
                continue
            if partition not in self.protocol.owned or not self._topic_exists(topic):
                continue
            del self._refusals_waiting[answer]
            self._refusals_answered[answer] = None
            while len(self._refusals_answered) > REFUSALS_REMEMBERED:
                del self._refusals_answered[next(iter(self._refusals_answered))]
            self._produce(topic, self._message({"kind": "REFUSED", "session": record["session"],
                                                "version": record["version"], "reason": reason}), None, 0, None)

    def _restore(self, topic: str, partition: int, name: str) -> None:
        """Write a client's registry (or ack) record in force again after a refused one for its key, in
        its partition, so that compaction, which keeps a key's newest record, keeps the client's."""
        if partition != registry_partition(name, self.partitions) or partition not in self.protocol.owned:
            return
        current = (self.registry if topic == self.registry_topic else self.acks).get(name)
        if current is None:
            return
        schema = "ClientRegistration" if topic == self.registry_topic else "ClientAck"
        self._produce(topic, self._codec.encode(schema, current), name.encode(), partition,
                      (bearer(self.token) or []) + [(RESTORED, b"1")])
        self.stats["restored"] += 1

    def dead_letter(self, msg: Any, reason: str, error_class: str) -> None:
        """The record as it was, with why, on the subscriptions dead-letter topic."""
        record = {"source_topic": msg.topic(), "source_partition": msg.partition(), "source_offset": msg.offset(),
                  "key": msg.key(), "value": msg.value(), "reason": reason, "error_class": error_class,
                  "event": None, "service": f"subscriptions {self.member_id}", "failed_at": int(time.time() * 1000)}
        self._produce(self.dead_letter_topic, self._codec.encode("DeadLetter", record), msg.key(), 0, None)
        self.stats["dead_lettered"] += 1


def _refusal_reason(exc: SluiceError) -> str:
    """Why a record was refused, as the log, the dead letter and the client are told: for a token,
    only whether there was one, never the token given."""
    if isinstance(exc, InvalidRequest) and exc.field == "authorization":
        return exc.reason
    return str(exc)
