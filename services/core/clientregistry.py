"""What the subscription service and its clients share: where a client's records live, its
queue topic, the interest a registry record holds, and what a record must be to be taken.
The client library (``sluice.client``), the subscription service and ``sluice admin status``
all read and write these records, so their rules are here, in the core, held once.

Issue 17 (trust boundaries): whoever can write the registry or the acks topic must not be able
to make the service create, fill, trim or delete a topic that is not a client queue, nor move or
unregister another client.  So both sides hold one rule for a client's queue topic
(``queue_topic_problem``: ``<prefix>subscription.<client_id>.<8 lowercase hex digits>``, the
client id being the record's key), and the service checks every registry, ack and checkpoint
record against it (``check_registration``, ``check_ack``, ``check_checkpoint``) before anything
is done with it; the client checks what it reads back for its own id the same way.
"""

from __future__ import annotations

import hmac
import re
import uuid
from typing import Any

from .config import SiteConfig
from .errors import BrokerUnavailable, InvalidRequest
from .interest import Registration, RegionInterest
from .kafka import KafkaError, NewTopic, kafka_errors, make_consumer, partition_for_key, read_to_end, wait_future


#: The registry record header that carries a client's token: ``Bearer <token>``.
AUTHORIZATION = "authorization"
#: The header of a record the service wrote again after refusing a forged one for the same key,
#: so that compaction keeps the client's record rather than the forgery (``SubscriptionService``).
RESTORED = "sluice-restored"
#: The header of the registry tombstone that unregisters a client: why (``UNREGISTERED_REASONS``).
UNREGISTERED = "sluice-unregistered"
#: Why the service unregistered a client, as its tombstone says.
CLOSED, NO_PING, DURABLE_CLIENT_TIMEOUT, MAXIMUM_MESSAGE_COUNT = (
    "closed", "no-ping", "durable-client-timeout", "maximum-message-count")
UNREGISTERED_REASONS = frozenset({CLOSED, NO_PING, DURABLE_CLIENT_TIMEOUT, MAXIMUM_MESSAGE_COUNT})
#: The reasons that drop a queue its client still counts on: a durable client that reconnects after one of
#: them finds no queue (``pending_event_count()`` -1, Geode's PRIMARY_QUEUE_TIMED_OUT) and resynchronises.
QUEUE_DROPPED = frozenset({DURABLE_CLIENT_TIMEOUT, MAXIMUM_MESSAGE_COUNT})
#: A client id: 1–100 letters, digits, '_' or '-', starting with a letter or digit (never a '.',
#: so one client's queue names can never be another's).
CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
#: A queue incarnation: 8 lowercase hex digits, new each time a client starts as a new one.
INCARNATION = re.compile(r"[0-9a-f]{8}")


def new_incarnation() -> str:
    """A fresh queue incarnation (``INCARNATION``)."""
    return uuid.uuid4().hex[:8]


def new_queue_topic(cfg: SiteConfig, client_id: str) -> str:
    """A new queue topic for ``client_id``: the only shape the service takes."""
    return cfg.topics.client_queue(client_id, new_incarnation())


def queue_topic_problem(cfg: SiteConfig, client_id: str, topic: object) -> str | None:
    """Why ``topic`` is not a queue of ``client_id`` (None: it is one)."""
    if not isinstance(client_id, str) or not CLIENT_ID.fullmatch(client_id):
        return f"the client id {client_id!r} is not one (1–100 letters, digits, '_' or '-')"
    prefix = cfg.topics.client_queue(client_id, "")
    if not isinstance(topic, str) or not topic.startswith(prefix) or not INCARNATION.fullmatch(topic[len(prefix):]):
        return f"not a queue of client {client_id}: a client's queue is {prefix}<8 lowercase hex digits>"
    return None


def is_client_queue(cfg: SiteConfig, topic: object) -> bool:
    """``topic`` is some client's queue (any client id)."""
    base = cfg.topics.client_queue("", "")  # "<prefix>subscription.."
    head = base[:-2]  # "<prefix>subscription"
    if not isinstance(topic, str) or not topic.startswith(head + "."):
        return False
    client_id, dot, _incarnation = topic[len(head) + 1:].rpartition(".")
    return bool(dot) and queue_topic_problem(cfg, client_id, topic) is None


def bearer(token: str | None) -> list[tuple[str, bytes]] | None:
    """The headers that carry ``token`` (None: no token, no headers)."""
    return None if token is None else [(AUTHORIZATION, f"Bearer {token}".encode())]


def configured_token(cfg: SiteConfig) -> str | None:
    """``subscriptions.token`` of the site file, or None when registrations need none."""
    token = cfg.subscriptions.token
    return None if token is None else token.get_secret_value()


def header_value(headers: list[tuple[str, bytes]] | None, name: str) -> bytes | None:
    for key, value in headers or ():
        if key == name:
            return value
    return None


def authorized(headers: list[tuple[str, bytes]] | None, token: str) -> bool:
    """The record carries ``authorization: Bearer <token>`` (compared in constant time)."""
    given = header_value(headers, AUTHORIZATION)
    return given is not None and hmac.compare_digest(given, f"Bearer {token}".encode())


def check_authorized(headers: list[tuple[str, bytes]] | None, token: str | None, what: str) -> None:
    """``InvalidRequest`` on the field ``authorization`` unless the record (``what``) carries ``token``
    (nothing to check without one).  The value shown is only whether there was a token, never one."""
    if token is None or authorized(headers, token):
        return
    if header_value(headers, AUTHORIZATION) is None:
        raise InvalidRequest("authorization", "none",
                             f"the subscription service requires a token and the {what} carried none")
    raise InvalidRequest("authorization", "another token", f"the {what}'s token is not the subscription service's token")


def check_key(cfg: SiteConfig, key: str, partition: int) -> None:
    """A registry or ack record's key is a client id, in that client's partition."""
    if not CLIENT_ID.fullmatch(key):
        raise InvalidRequest("key", key, "not a client id (1–100 letters, digits, '_' or '-')")
    wanted = registry_partition(key, cfg.subscriptions.registry_partitions)
    if partition != wanted:
        raise InvalidRequest("partition", partition, f"client {key}'s records belong in partition {wanted}")


def _check_own_record(cfg: SiteConfig, key: str, partition: int, record: dict[str, Any]) -> None:
    """A registry or ack record of the client its key names, in its partition, naming a queue of its own."""
    check_key(cfg, key, partition)
    if record["client_id"] != key:
        raise InvalidRequest("client_id", record["client_id"], f"not the record's key {key!r}")
    problem = queue_topic_problem(cfg, key, record["queue_topic"])
    if problem is not None:
        raise InvalidRequest("queue_topic", record["queue_topic"], problem)


def check_registration(cfg: SiteConfig, key: str, partition: int, record: dict[str, Any]) -> None:
    """A registration the service may act on: its key's, with a queue of that client and interest
    it can match (``compile_regex``); else ``InvalidRequest`` naming the field, value and reason."""
    _check_own_record(cfg, key, partition, record)
    interest_of(record)  # InvalidRequest("regex", ...) for a pattern RE2 refuses or one too long


def check_ack(cfg: SiteConfig, key: str, partition: int, record: dict[str, Any]) -> None:
    """An ack the service may act on (trim the queue it names up to ``next_offset``)."""
    _check_own_record(cfg, key, partition, record)
    if record["next_offset"] < 0:
        raise InvalidRequest("next_offset", record["next_offset"], "a queue offset is 0 or more")


def check_checkpoint(cfg: SiteConfig, partition: int, record: dict[str, Any]) -> None:
    """A fill checkpoint of its own registry partition, over the site's changelogs and client queues."""
    if record["registry_partition"] != partition:
        raise InvalidRequest("registry_partition", record["registry_partition"],
                             f"a checkpoint of partition {partition} must name it")
    buckets = {cfg.topics.region_changelog(r.name): r.buckets for r in cfg.regions}
    positions = list(record["positions"]) + [p for q in record["queues"] or () for p in q["positions"]]
    for p in positions:
        if p["topic"] not in buckets or not 0 <= p["partition"] < buckets[p["topic"]] or p["offset"] < 0:
            raise InvalidRequest("positions", f"{p['topic']}[{p['partition']}]@{p['offset']}",
                                 "not a position in one of the site's region changelogs")
    for q in record["queues"] or ():
        if not is_client_queue(cfg, q["queue_topic"]):
            raise InvalidRequest("queues", q["queue_topic"], "not a client's queue topic")


def registry_partition(client_id: str, partitions: int) -> int:
    """The registry partition of a client: its records' partition, and so its primary."""
    return partition_for_key(client_id.encode(), partitions)


def last_heard(record: dict[str, Any], ack: dict[str, Any] | None) -> int:
    """When the client last spoke in its current session: its registry record, or a later ack (ping)."""
    if ack is not None and ack["session"] == record["session"]:
        return max(record["changed_at"], ack["at"])
    return int(record["changed_at"])


def interest_of(record: dict[str, Any], *, durable_only: bool = False) -> dict[str, RegionInterest]:
    """A registry record's interest, per region (only the durable part for a durable client away)."""
    out: dict[str, RegionInterest] = {}
    for r in record["interest"]:
        if durable_only and not r["durable"]:
            continue
        reg = Registration(keys=tuple(r["keys"]), all_keys=r["all_keys"], regex=r["regex"],
                           durable=r["durable"], receive_values=r["receive_values"])
        out.setdefault(r["region"], RegionInterest()).register(reg)
    return out


def create_queue(admin: Any, cfg: SiteConfig, topic: str, durable: bool) -> None:
    """A client's queue topic, if it is not there: one partition.  A durable client's keeps what
    it has not acknowledged for as long as the queue is kept; a non-durable one's messages live at
    most ``message-time-to-live``."""
    retention = -1 if durable else cfg.subscriptions.message_time_to_live_s * 1000
    spec = NewTopic(topic, num_partitions=1, replication_factor=cfg.kafka.replication_factor,
                    config={"retention.ms": str(retention), "cleanup.policy": "delete"})
    for name, fut in admin.create_topics([spec], operation_timeout=10).items():
        try:
            wait_future(fut, f"creating the subscription queue {name}", 15)
        except BrokerUnavailable as exc:
            if exc.code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def read_latest(cfg: SiteConfig, topic: str, partition: int, key: str, *,
                token: str | None = None) -> bytes | None:
    """The newest value of ``key`` in one partition of a compacted topic (None: none, or a tombstone).
    With ``token``, only records that carry it count: a forged one, tombstones included, is passed over."""
    latest = read_latest_record(cfg, topic, partition, key, token=token)
    return None if latest is None else latest[0]


def read_latest_record(cfg: SiteConfig, topic: str, partition: int, key: str, *,
                       token: str | None = None) -> tuple[bytes | None, list[tuple[str, bytes]]] | None:
    """The newest record of ``key`` in one partition of a compacted topic, as (value, headers): a value of
    None is a tombstone; None when there is no record of it.  With ``token``, as ``read_latest``."""
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    found: tuple[bytes | None, list[tuple[str, bytes]]] | None = None
    try:
        with kafka_errors(f"reading {topic}"):
            for msg in read_to_end(consumer, topic, partition, deadline_s=30):
                if msg.key() == key.encode() and (token is None or authorized(msg.headers(), token)):
                    found = (msg.value(), list(msg.headers() or ()))
    finally:
        consumer.close()
    return found


def unregistered_reason(headers: list[tuple[str, bytes]] | None) -> str | None:
    """Why the service unregistered a client, from its registry tombstone's headers (None: not said, or
    not one of ``UNREGISTERED_REASONS``)."""
    raw = header_value(headers, UNREGISTERED)
    reason = None if raw is None else raw.decode("ascii", "replace")
    return reason if reason in UNREGISTERED_REASONS else None


__all__ = ["AUTHORIZATION", "CLIENT_ID", "CLOSED", "DURABLE_CLIENT_TIMEOUT", "INCARNATION", "MAXIMUM_MESSAGE_COUNT",
           "NO_PING", "QUEUE_DROPPED", "RESTORED", "UNREGISTERED", "UNREGISTERED_REASONS", "authorized", "bearer",
           "check_ack", "check_authorized", "check_checkpoint", "check_key", "check_registration",
           "configured_token", "create_queue", "header_value", "interest_of", "is_client_queue", "last_heard",
           "new_incarnation", "new_queue_topic", "queue_topic_problem", "read_latest", "read_latest_record",
           "registry_partition", "unregistered_reason"]
