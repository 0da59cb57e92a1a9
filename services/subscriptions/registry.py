"""What the subscription service and its clients share: where a client's records live, its
queue topic, and the interest a registry record holds."""

from __future__ import annotations

import hmac
from typing import Any

from ..client.interest import Registration, RegionInterest
from ..core.config import SiteConfig
from ..core.kafka import KafkaError, KafkaException, NewTopic, make_consumer, partition_for_key, read_to_end, translate


#: The registry record header that carries a client's token: ``Bearer <token>``.
AUTHORIZATION = "authorization"


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
            fut.result(timeout=15)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise translate(exc, f"creating the subscription queue {name}") from exc


def read_latest(cfg: SiteConfig, topic: str, partition: int, key: str) -> bytes | None:
    """The newest value of ``key`` in one partition of a compacted topic (None: none, or a tombstone)."""
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    found: bytes | None = None
    try:
        for msg in read_to_end(consumer, topic, partition, deadline_s=30):
            if msg.key() == key.encode():
                found = msg.value()
    except KafkaException as exc:
        raise translate(exc, f"reading {topic}") from exc
    finally:
        consumer.close()
    return found


__all__ = ["AUTHORIZATION", "authorized", "configured_token", "create_queue", "header_value", "interest_of",
           "last_heard", "read_latest", "registry_partition"]
