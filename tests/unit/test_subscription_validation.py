"""What a subscription record must be before anything is done with it (issue 17), without a broker:
the queue topic rule both sides share, interest regexes under RE2, the checks of registry, ack and
checkpoint records, and what the service does with a record that fails them (a fake producer and
admin stand in for Kafka)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sluice.core.interest import REGEX_CHARS_MAX, Delivery, RegionInterest, Registration, compile_regex
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, parse_config
from sluice.core.errors import InvalidRequest
from sluice.core.clientregistry import (
    AUTHORIZATION,
    RESTORED,
    bearer,
    check_ack,
    check_authorized,
    check_checkpoint,
    check_registration,
    is_client_queue,
    new_queue_topic,
    queue_topic_problem,
    registry_partition,
)
from sluice.subscriptions.service import SubscriptionService

TOKEN = "unit-token"


@pytest.fixture(scope="module")
def cfg() -> SiteConfig:
    return parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                         "regions": [{"name": "orders", "buckets": 2}],
                         "subscriptions": {"registry_partitions": 2}})


def registration(cfg: SiteConfig, client_id: str, /, **changes: Any) -> dict[str, Any]:
    record = {"client_id": client_id, "member_id": f"{client_id}-m", "durable": False, "durable_timeout_s": 60,
              "redundancy": 0, "queue_topic": cfg.topics.client_queue(client_id, "0123abcd"), "session": "s1",
              "version": 1, "interest": [], "connected": True, "keep_alive": False, "ready": False,
              "changed_at": 1}
    record.update(changes)
    return record


def interest(regex: str) -> list[dict[str, Any]]:
    return [{"region": "orders", "keys": [], "all_keys": False, "regex": regex, "durable": False,
             "receive_values": True}]


def ack(cfg: SiteConfig, client_id: str, /, **changes: Any) -> dict[str, Any]:
    record = {"client_id": client_id, "session": "s1", "queue_topic": cfg.topics.client_queue(client_id, "0123abcd"),
              "next_offset": 5, "received": 5, "repeats": 0, "at": 2}
    record.update(changes)
    return record


# --- interest regexes ---------------------------------------------------------------------------


def test_a_regex_re2_refuses_is_an_invalid_request_naming_the_field_value_and_why() -> None:
    """An unbalanced group, a backreference and a lookahead are refused with field, value and reason."""
    for pattern, why in (("(", "missing )"), (r"(a)\1", "invalid escape"), ("(?=a)a", "invalid perl operator")):
        with pytest.raises(InvalidRequest) as caught:
            Registration.of_regex(pattern)
        assert caught.value.field == "regex" and caught.value.value == pattern
        assert why in caught.value.reason and "RE2" in caught.value.reason and "backreferences" in caught.value.reason


def test_a_regex_longer_than_the_bound_is_refused() -> None:
    """REGEX_CHARS_MAX characters are taken, one more is not."""
    compile_regex("a" * REGEX_CHARS_MAX)
    with pytest.raises(InvalidRequest, match=f"longer than {REGEX_CHARS_MAX} characters"):
        compile_regex("a" * (REGEX_CHARS_MAX + 1))


def test_a_catastrophic_pattern_under_python_re_is_matched_in_linear_time() -> None:
    """(a+)+ against a long run of a's that fails at its end: exponential for Python's re (this
    test would not finish), one pass for RE2; and the whole key must match, as with re.fullmatch."""
    interest = RegionInterest()
    interest.register(Registration.of_regex("(a+)+"))
    assert interest.delivery("a" * 5000 + "!") is None
    assert interest.delivery("a" * 5000) is Delivery.VALUES
    interest.register(Registration.of_regex(r"o-\d+"))
    assert interest.delivery("o-12") is Delivery.VALUES
    assert interest.delivery("xo-12") is None and interest.delivery("o-12x") is None
    interest.register(Registration.of_regex("a|ab"))
    assert interest.delivery("ab") is Delivery.VALUES, "any alternative may match the whole key, as in re.fullmatch"
    interest.unregister(Registration.of_regex(r"o-\d+"))
    assert interest.delivery("o-12") is None and interest.delivery("ab") is Delivery.VALUES


# --- the queue topic rule ---------------------------------------------------------------------------


def test_only_a_queue_of_the_client_itself_is_its_queue(cfg: SiteConfig) -> None:
    """The rule both sides import: <prefix>subscription.<client id>.<8 lowercase hex digits>."""
    made = new_queue_topic(cfg, "c-1")
    assert queue_topic_problem(cfg, "c-1", made) is None and is_client_queue(cfg, made)
    for topic in ("x.region.orders.changelog", "x.subscriptions.registry", cfg.topics.client_queue("c-2", "0123abcd"),
                  cfg.topics.client_queue("c-1", "0123ABCD"), cfg.topics.client_queue("c-1", "0123abc"),
                  cfg.topics.client_queue("c-1", "0123abcd") + ".x", "y.subscription.c-1.0123abcd", 7):
        assert queue_topic_problem(cfg, "c-1", topic) is not None, topic
    assert not is_client_queue(cfg, "x.region.orders.changelog")
    assert not is_client_queue(cfg, "x.subscription.c.1.0123abcd"), "a client id has no '.'"
    assert queue_topic_problem(cfg, "a.b", "x.subscription.a.b.0123abcd") is not None


# --- record checks --------------------------------------------------------------------------------------


def test_a_registration_is_checked_field_by_field(cfg: SiteConfig) -> None:
    """Its key's partition, its own client id, a queue of its own and regexes RE2 takes."""
    p = registry_partition("c-1", 2)
    check_registration(cfg, "c-1", p, registration(cfg, "c-1", interest=interest(r"o-\d+")))
    cases = [
        (dict(queue_topic="x.region.orders.changelog"), "queue_topic"),
        (dict(queue_topic=cfg.topics.client_queue("c-2", "0123abcd")), "queue_topic"),
        (dict(client_id="c-2"), "client_id"),
        (dict(interest=interest("(")), "regex"),
    ]
    for changes, field in cases:
        with pytest.raises(InvalidRequest) as caught:
            check_registration(cfg, "c-1", p, registration(cfg, "c-1", **changes))
        assert caught.value.field == field, changes
    with pytest.raises(InvalidRequest) as caught:
        check_registration(cfg, "c-1", 1 - p, registration(cfg, "c-1"))
    assert caught.value.field == "partition"
    with pytest.raises(InvalidRequest) as caught:
        check_registration(cfg, "c.1", registry_partition("c.1", 2), registration(cfg, "c.1"))
    assert caught.value.field == "key"


def test_an_ack_is_checked_before_it_can_trim_anything(cfg: SiteConfig) -> None:
    """An ack names its own client and one of that client's queues, at an offset of 0 or more."""
    p = registry_partition("c-1", 2)
    check_ack(cfg, "c-1", p, ack(cfg, "c-1"))
    for changes, field in ((dict(queue_topic="x.region.orders.changelog"), "queue_topic"),
                           (dict(client_id="c-2"), "client_id"), (dict(next_offset=-1), "next_offset")):
        with pytest.raises(InvalidRequest) as caught:
            check_ack(cfg, "c-1", p, ack(cfg, "c-1", **changes))
        assert caught.value.field == field


def test_a_checkpoint_names_only_changelog_positions_and_client_queues(cfg: SiteConfig) -> None:
    """A fill checkpoint of its own partition, over the site's changelogs and client queues only."""
    good = {"registry_partition": 1, "member": "m", "updated_at": 0,
            "positions": [{"topic": "x.region.orders.changelog", "partition": 1, "offset": 3}],
            "queues": [{"queue_topic": cfg.topics.client_queue("c-1", "0123abcd"), "positions": []}]}
    check_checkpoint(cfg, 1, good)
    with pytest.raises(InvalidRequest, match="registry_partition"):
        check_checkpoint(cfg, 0, good)
    with pytest.raises(InvalidRequest, match="positions"):
        check_checkpoint(cfg, 1, {**good, "positions": [{"topic": "x.region.orders.changelog", "partition": 2,
                                                         "offset": 0}]})
    with pytest.raises(InvalidRequest, match="queues"):
        check_checkpoint(cfg, 1, {**good, "queues": [{"queue_topic": "x.region.orders.changelog", "positions": []}]})


def test_a_record_without_the_token_is_unauthorized_and_the_refusal_never_shows_a_token() -> None:
    """No header, or another token: refused on the field authorization; the value shown is only
    whether there was a token."""
    check_authorized(bearer(TOKEN), TOKEN, "ack")
    check_authorized(None, None, "ack")
    for headers, said in ((None, "carried none"), (bearer("guess"), "is not the subscription service's token")):
        with pytest.raises(InvalidRequest) as caught:
            check_authorized(headers, TOKEN, "ack")
        assert caught.value.field == "authorization" and said in caught.value.reason
        assert "guess" not in str(caught.value) and TOKEN not in str(caught.value)


# --- the service's handling of records that fail --------------------------------------------------------


class FakeMessage:
    def __init__(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                 headers: list[tuple[str, bytes]] | None = None) -> None:
        self._fields = (topic, partition, offset, key, value, headers)

    def topic(self) -> str:
        return self._fields[0]

    def partition(self) -> int:
        return self._fields[1]

    def offset(self) -> int:
        return self._fields[2]

    def key(self) -> bytes | None:
        return self._fields[3]

    def value(self) -> bytes | None:
        return self._fields[4]

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._fields[5]

    def error(self) -> None:
        return None


class FakeProducer:
    def __init__(self) -> None:
        self.records: list[tuple[str, int, bytes | None, bytes | None, list[tuple[str, bytes]] | None]] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                headers: list[tuple[str, bytes]] | None = None, on_delivery: Any = None) -> None:
        self.records.append((topic, partition, key, value, headers))

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0

    def to(self, topic: str) -> list[dict[str, Any]]:
        codec = get_codec()
        return [codec.decode(value)[1] | {"headers": dict(headers or [])}
                for t, _p, _k, value, headers in self.records if t == topic and value is not None]


class FakeAdmin:
    def __init__(self, topics: set[str]) -> None:
        self.topics = topics

    def list_topics(self, topic: str | None = None, timeout: float = 0) -> Any:
        return SimpleNamespace(topics={t: SimpleNamespace(error=None) for t in self.topics if topic in (None, t)})


@pytest.fixture
def service(cfg: SiteConfig) -> tuple[SubscriptionService, FakeProducer]:
    """A service primary for both registry partitions, with a token, over a fake producer and admin."""
    service = SubscriptionService(cfg, member_id="unit", token=TOKEN)
    producer = FakeProducer()
    service._producer = producer
    service._admin = FakeAdmin({cfg.topics.client_queue("c-1", "0123abcd"), "x.region.orders.changelog"})
    service.owned = {0, 1}
    for r in (0, 1):
        service._starts[r] = {}
        service._positions[r] = {}
    return service, producer


def feed(service: SubscriptionService, topic: str, key: str, value: bytes | None, headers: Any = None,
         partition: int | None = None, offset: int = 7) -> None:
    p = registry_partition(key, 2) if partition is None else partition
    service.tables.take(FakeMessage(topic, p, offset, key.encode(), value, headers))


def test_a_registration_with_an_unbalanced_regex_is_refused_answered_and_dead_lettered(
        service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """'(' used to raise out of the table loop and crash every instance; now it is one refused record."""
    svc, producer = service
    codec = get_codec()
    feed(svc, svc.registry_topic, "c-1", codec.encode("ClientRegistration",
                                                      registration(cfg, "c-1", interest=interest("("))),
         bearer(TOKEN))
    assert "c-1" not in svc.registry and svc.stats["refused"] == 1
    [dead] = producer.to(svc.dead_letter_topic)
    assert dead["reason"].startswith("registration refused: regex: not a regular expression RE2 accepts")
    assert dead["source_offset"] == 7 and dead["error_class"] == "InvalidRequest"
    [answer] = producer.to(cfg.topics.client_queue("c-1", "0123abcd"))
    assert answer["kind"] == "REFUSED" and "missing )" in answer["reason"]


def test_a_registration_naming_another_topic_is_refused_and_nothing_is_written_to_it(
        service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """Neither the changelog nor another client's queue receives anything, not even the refusal."""
    svc, producer = service
    codec = get_codec()
    for queue in ("x.region.orders.changelog", cfg.topics.client_queue("c-1", "0123abcd")):
        feed(svc, svc.registry_topic, "c-2", codec.encode("ClientRegistration", registration(
            cfg, "c-2", queue_topic=queue, connected=False)), bearer(TOKEN))
    assert "c-2" not in svc.registry and svc.stats["refused"] == 2
    assert {r[0] for r in producer.records} == {svc.dead_letter_topic}
    assert all("queue_topic: not a queue of client c-2" in d["reason"] for d in producer.to(svc.dead_letter_topic))


def test_undecodable_records_are_dead_lettered_and_the_next_one_is_taken(
        service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """Garbage on the registry, acks and fill topics: each dead-lettered with why; a good one after is taken."""
    svc, producer = service
    for topic in (svc.registry_topic, svc.acks_topic):
        feed(svc, topic, "c-1", b"not avro", bearer(TOKEN))
    feed(svc, svc.fill_topic, "0", b"not avro", partition=0)
    assert svc.stats["undecodable"] == 3
    reasons = [d["reason"] for d in producer.to(svc.dead_letter_topic)]
    assert [r.split(":")[0] for r in reasons] == ["registration cannot be read", "ack cannot be read",
                                                  "fill checkpoint cannot be read"]
    feed(svc, svc.registry_topic, "c-1", get_codec().encode("ClientRegistration", registration(cfg, "c-1")),
         bearer(TOKEN))
    assert svc.registry["c-1"]["session"] == "s1" and "c-1" in svc._clients


def test_an_ack_or_tombstone_without_the_token_changes_nothing_and_the_record_in_force_is_written_again(
        service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """A forged ack does not move the queue head, a forged tombstone unregisters no one; both are
    refused, and the client's records are written again (marked restored) so compaction keeps them."""
    svc, producer = service
    codec = get_codec()
    feed(svc, svc.registry_topic, "c-1", codec.encode("ClientRegistration", registration(cfg, "c-1")), bearer(TOKEN))
    feed(svc, svc.acks_topic, "c-1", codec.encode("ClientAck", ack(cfg, "c-1")), bearer(TOKEN))
    feed(svc, svc.acks_topic, "c-1", codec.encode("ClientAck", ack(cfg, "c-1", next_offset=10**9)))
    feed(svc, svc.registry_topic, "c-1", None, [(AUTHORIZATION, b"Bearer guess")])
    feed(svc, svc.acks_topic, "c-1", None)
    assert svc.acks["c-1"]["next_offset"] == 5 and "c-1" in svc.registry and "c-1" in svc._clients
    assert svc.stats["refused"] == 3
    reasons = [d["reason"] for d in producer.to(svc.dead_letter_topic)]
    assert reasons == ["ack refused: the subscription service requires a token and the ack carried none",
                       "registry tombstone refused: the registry tombstone's token is not the subscription "
                       "service's token",
                       "ack tombstone refused: the subscription service requires a token and the ack tombstone "
                       "carried none"]
    restored = producer.to(svc.acks_topic) + producer.to(svc.registry_topic)
    assert len(restored) == 3 and all(r["headers"][RESTORED] == b"1" and
                                      r["headers"][AUTHORIZATION] == f"Bearer {TOKEN}".encode() for r in restored)


def test_a_restored_record_older_than_the_one_in_force_is_not_taken_and_the_newer_is_written_again(
        service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """Restorations race with the client's own writes; the newest record in force always ends the partition."""
    svc, producer = service
    codec = get_codec()
    restored = bearer(TOKEN) + [(RESTORED, b"1")]  # type: ignore[operator]
    feed(svc, svc.registry_topic, "c-1", codec.encode("ClientRegistration", registration(cfg, "c-1", version=5)),
         bearer(TOKEN))
    feed(svc, svc.registry_topic, "c-1", codec.encode("ClientRegistration", registration(cfg, "c-1", version=4)),
         restored)
    assert svc.registry["c-1"]["version"] == 5
    [again] = producer.to(svc.registry_topic)
    assert again["version"] == 5
    feed(svc, svc.registry_topic, "c-1", codec.encode("ClientRegistration", registration(cfg, "c-1", version=5)),
         restored)
    assert len(producer.to(svc.registry_topic)) == 1, "the record in force, restored: nothing more to do"
    feed(svc, svc.registry_topic, "c-3", codec.encode("ClientRegistration", registration(cfg, "c-3", version=2)),
         restored)
    assert svc.registry["c-3"]["version"] == 2, "after compaction a restored record is all there is: taken"


def test_a_standby_refuses_silently(service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """Only the primary of a record's partition counts, logs, answers and dead-letters it (once per site)."""
    svc, producer = service
    svc.owned = set()
    feed(svc, svc.registry_topic, "c-1", b"not avro", bearer(TOKEN))
    feed(svc, svc.acks_topic, "c-1", None)
    assert producer.records == [] and svc.stats["refused"] == svc.stats["undecodable"] == 0


def test_a_failed_write_to_a_deleted_client_queue_is_a_queue_gone_and_any_other_a_refill(
        service: tuple[SubscriptionService, FakeProducer], cfg: SiteConfig) -> None:
    """The producer's callback hears only of failed writes: one to a client queue whose topic or partition
    is unknown means the queue was deleted (its client starts over); the same error on another topic (the
    fill topic), or another error on a queue, is a failed write, and the primary fills again."""
    from confluent_kafka import KafkaError

    svc, _producer = service
    queue = cfg.topics.client_queue("c-1", "0123abcd")
    for code in (KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART):
        svc._delivered(KafkaError(code), SimpleNamespace(topic=lambda: queue))
    assert svc._missing_queues == {queue} and svc._delivery_failed is None
    svc._delivered(KafkaError(KafkaError._UNKNOWN_PARTITION), SimpleNamespace(topic=lambda: svc.fill_topic))
    assert svc._delivery_failed is not None and svc.fill_topic in svc._delivery_failed
    svc._delivery_failed = None
    svc._delivered(KafkaError(KafkaError._MSG_TIMED_OUT), SimpleNamespace(topic=lambda: queue))
    assert svc._delivery_failed is not None and svc._missing_queues == {queue}
