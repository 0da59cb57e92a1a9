"""A fill's deliveries leave when the fill ends (issue 18), without a broker: the service's producer
(``linger.ms`` long, so that a fill's messages to one client are one batch) is told to send what it
holds once the records read are routed, never before, and the messages are the spliced records."""

from __future__ import annotations

from typing import Any

from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, parse_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.subscriptions import service as service_module

from test_subscription_queue_bound import Message as _Message
from test_subscription_queue_bound import _primary  # noqa: E402 - the same fakes


class Message(_Message):
    """A changelog record as the changelog reader hands it over."""

    def error(self) -> None:
        return None


def site() -> SiteConfig:
    return parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                         "regions": [{"name": "orders", "buckets": 1}],
                         "subscriptions": {"registry_partitions": 1}})


class Calls:
    """The producer's calls, in order: ("produce", topic) and ("flush", timeout)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.values: list[bytes] = []

    def produce(self, topic: str, value: bytes | None = None, *_: Any, **__: Any) -> None:
        self.calls.append(("produce", topic))
        assert value is not None
        self.values.append(value)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        self.calls.append(("flush", timeout))
        return 0


class Changelog:
    """The changelog reader: one poll hands over ``msgs``, then nothing."""

    def __init__(self, msgs: list[Message]) -> None:
        self.msgs = msgs

    def poll(self, timeout: float) -> Message | None:
        return self.msgs.pop(0) if self.msgs else None

    def consume(self, n: int, timeout: float) -> list[Message]:
        out, self.msgs = self.msgs[:n], self.msgs[n:]
        return out


def test_a_fill_sends_its_deliveries_once_they_are_all_routed() -> None:
    cfg = site()
    service, client, _producer, _admin = _primary(cfg, queue_end=0, acked=0)
    producer = Calls()
    service._producer = producer
    changelog = cfg.topics.region_changelog("orders")
    codec = get_codec()
    events = [EntryEvent("orders", f"k-{i}", Operation.UPDATE, b'{"n":%d}' % i, EventID("writer", 1, i + 1),
                         VersionTag(1, 1, i + 1, "writer"), 1, 0, 1) for i in range(3)]
    service._changelog = Changelog([Message(changelog, i, codec.encode("EntryEvent", e.to_record()))
                                    for i, e in enumerate(events)])
    service._fill()
    queue = client.record["queue_topic"]
    assert producer.calls == [("produce", queue)] * 3 + [("flush", service_module.TURN_SEND_WAIT_S)]
    got = [codec.decode_as("ClientMessage", v) for v in producer.values]
    assert [EntryEvent.from_record(m["event"]) for m in got] == events
    assert service.stats["filled"] == 3



class Err:
    def __init__(self, code: int) -> None:
        self._code = code

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return "Local: Broker handle destroyed for termination"


class Listed:
    """``list_topics`` of an admin client that knows only ``existing``."""

    def __init__(self, existing: set[str]) -> None:
        self.existing = existing
        self.asked: list[str] = []

    def list_topics(self, topic: str, timeout: float = 0) -> Any:
        self.asked.append(topic)
        metadata = type("Metadata", (), {})()
        metadata.topics = {topic: type("Topic", (), {"error": None})()} if topic in self.existing else {}
        return metadata


def test_deliveries_dropped_for_a_deleted_queue_are_its_being_gone_not_a_failed_write() -> None:
    """What the producer drops as a deleted queue's partition leaves its metadata (``_DESTROY``) makes the
    queue noted gone when the broker no longer lists it, with nothing filled again; dropped for a queue
    still listed, it is a failed write, and the partition is filled again from its last checkpoint."""
    from confluent_kafka import KafkaError

    cfg = site()
    service, client, producer, _admin = _primary(cfg, queue_end=0, acked=0)
    queue = client.record["queue_topic"]
    service._changelog = type("Ends", (), {"get_watermark_offsets": lambda *_, **__: (0, 0)})()
    for existing, refilled in ((set(), 0), ({queue}, 1)):
        service._admin = Listed(existing)  # type: ignore[assignment]
        service._delivered(Err(KafkaError._DESTROY), Message(queue, 0, b""))
        service._sync()
        assert service._admin.asked == [queue]
        assert service.stats["refills"] == refilled
        assert service._missing_queues == set() and service._purged_queues == {}
