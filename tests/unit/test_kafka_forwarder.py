"""The Kafka forwarder without a broker: settings, headers, topic routing, and the
offer/re-offer bookkeeping over a scripted stand-in producer; the TLS/SASL
settings of another cluster and what the producer is built with (issue 17);
and the downstream example's deduplication over plain dicts."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from sluice.core.asyncevent import Accepted, AsyncEvent
from sluice.core.codec import get_codec
from sluice.core.errors import ClosedError, ConfigError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import KafkaError, KafkaException
from sluice.listeners import kafka_forwarder
from sluice.listeners.kafka_forwarder import (
    ForwarderSettings,
    KafkaForwarderListener,
    build_headers,
    parse_settings,
)

ROOT = Path(__file__).resolve().parents[2]


def make_event(key: str, seq: int, *, region: str = "orders", op: Operation = Operation.UPDATE,
               thread: int = 1, dup: bool = False) -> AsyncEvent:
    entry = EntryEvent(
        region=region, key=key, operation=op,
        value=None if op.removes_value else b'{"qty": %d}' % seq,
        event_id=EventID("member-1", thread, seq), version=VersionTag(1, 1_700_000_000_000 + seq, seq),
        origin_dsid=1, bucket=3, event_time=1_700_000_000_000 + seq,
    )
    return AsyncEvent(entry, "orders-out", 3, seq, dup)


def problems_of(settings: Any, topic_prefix: str = "") -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_settings(settings, topic_prefix)
    return {field: reason for field, _value, reason in info.value.problems}


# --- settings ---------------------------------------------------------------------


def test_defaults() -> None:
    """Only topic is required; the rest take their documented defaults."""
    settings = parse_settings({"topic": "orders-events"})
    assert settings == ForwarderSettings(topic="orders-events", bootstrap_servers=None,
                                         partitions_by="key", flush_timeout_s=30.0)


def test_topic_is_required() -> None:
    """A missing or empty topic is reported under listener.settings.topic."""
    assert "is required" in problems_of({})["listener.settings.topic"]
    assert "is required" in problems_of({"topic": ""})["listener.settings.topic"]
    assert "is required" in problems_of(None)["listener.settings.topic"]


def test_unknown_setting_suggests_the_close_one() -> None:
    """A misspelt setting is an error naming itself, with a did-you-mean."""
    found = problems_of({"topic": "t", "flush_timeout": 5, "topik": "x"})
    assert "did you mean 'flush_timeout_s'?" in found["listener.settings.flush_timeout"]
    assert "did you mean 'topic'?" in found["listener.settings.topik"]


def test_unknown_placeholder_suggests_region() -> None:
    """Only {region} and {topic_prefix} may appear in the topic; a typo gets a did-you-mean."""
    reason = problems_of({"topic": "down.{regoin}"})["listener.settings.topic"]
    assert "unknown placeholder {regoin}" in reason and "did you mean 'region'?" in reason
    assert "format spec" in problems_of({"topic": "down.{region!r}"})["listener.settings.topic"]
    assert "not a valid template" in problems_of({"topic": "down.{region"})["listener.settings.topic"]


@pytest.mark.parametrize("topic", ["down/{region}", "down {region}", "..", "événements"])
def test_topic_characters(topic: str) -> None:
    """A topic must be a legal Kafka topic name once filled in."""
    assert "letters, digits" in problems_of({"topic": topic})["listener.settings.topic"]


def test_topic_length() -> None:
    """A topic that would exceed Kafka's 249 characters for a long region name is refused up front."""
    assert "249" in problems_of({"topic": "x" * 150 + ".{region}"})["listener.settings.topic"]
    assert "249" in problems_of({"topic": "x" * 250})["listener.settings.topic"]
    parse_settings({"topic": "x" * 140 + ".{region}"})


@pytest.mark.parametrize("value", ["bucket", "round_robin", None, 1])
def test_partitions_by_is_key(value: Any) -> None:
    """partitions_by accepts "key" only: per-key order downstream depends on it."""
    assert "must be 'key'" in problems_of({"topic": "t", "partitions_by": value})["listener.settings.partitions_by"]


@pytest.mark.parametrize("value", [0, 0.5, -1, 3601, True, "30", math.inf, math.nan, None])
def test_flush_timeout_bounds(value: Any) -> None:
    """flush_timeout_s is a number of seconds from 1 to 3600 (no bools, strings or infinities)."""
    assert "from 1 to 3600" in problems_of({"topic": "t", "flush_timeout_s": value})["listener.settings.flush_timeout_s"]


def test_flush_timeout_accepts_numbers() -> None:
    """Integers and fractions within bounds are taken as seconds."""
    assert parse_settings({"topic": "t", "flush_timeout_s": 1}).flush_timeout_s == 1.0
    assert parse_settings({"topic": "t", "flush_timeout_s": 2.5}).flush_timeout_s == 2.5


@pytest.mark.parametrize("value", ["localhost", "", ":9092", "a:1,,b:2", 9092, "host:port"])
def test_bootstrap_servers_shape(value: Any) -> None:
    """bootstrap_servers must be host:port, or several separated by commas."""
    assert "host:port" in problems_of({"topic": "t", "bootstrap_servers": value})["listener.settings.bootstrap_servers"]


def test_bootstrap_servers_normalized() -> None:
    """Spaces around the commas are dropped."""
    assert parse_settings({"topic": "t", "bootstrap_servers": "a:1, b:2"}).bootstrap_servers == "a:1,b:2"


def test_every_problem_at_once() -> None:
    """One ConfigError lists every bad setting, not just the first."""
    found = problems_of({"topic": "a/b", "partitions_by": "x", "flush_timeout_s": 0, "extra": 1})
    assert set(found) == {"listener.settings.topic", "listener.settings.partitions_by",
                          "listener.settings.flush_timeout_s", "listener.settings.extra"}


def test_settings_must_be_a_mapping() -> None:
    """A settings block that is not a mapping is refused as a whole."""
    assert "must be a mapping" in problems_of(["topic"])["listener.settings"]


def test_init_needs_a_cluster() -> None:
    """Without bootstrap_servers the site's connection is required; init fails before any client exists."""
    listener = KafkaForwarderListener()
    with pytest.raises(ConfigError) as info:
        listener.init({"settings": {"topic": "t"}, "queue_id": "q", "site": "s", "dsid": 1, "topic_prefix": ""})
    assert info.value.problems[0][0] == "listener.settings.bootstrap_servers"
    assert listener._producer is None


def test_init_reports_bad_settings() -> None:
    """init raises the settings' ConfigError (the dispatcher shows it and does not start)."""
    with pytest.raises(ConfigError, match="listener.settings.topic"):
        KafkaForwarderListener().init({"settings": {"topic": "{bad}"}, "kafka": {"bootstrap.servers": "127.0.0.1:1"}})


# --- another cluster over TLS and SASL (issue 17) -------------------------------------------

PASSWORD = "sasl-s3cret-pw"
KEY_PASSWORD = "key-s3cret-pw"


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    """A folder holding a CA, a client certificate and key, and a password file (contents do not matter here)."""
    for name in ("ca.pem", "me.pem", "me.key"):
        (tmp_path / name).write_text("-----BEGIN PLACEHOLDER-----\n")
    (tmp_path / "sasl.pw").write_text(PASSWORD + "\n")
    return tmp_path


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every librdkafka configuration the forwarder builds a producer with (no producer is made)."""
    confs: list[dict[str, Any]] = []

    def make_producer(conf: dict[str, Any]) -> ScriptedProducer:
        confs.append(dict(conf))
        return ScriptedProducer([])

    monkeypatch.setattr(kafka_forwarder, "make_producer", make_producer)
    return confs


def init_forwarder(settings: dict[str, Any], site_dir: Path | None = None) -> KafkaForwarderListener:
    listener = KafkaForwarderListener()
    listener.init({"settings": {"topic": "down", **settings}, "queue_id": "q", "site": "a", "dsid": 1,
                   "kafka": {"bootstrap.servers": "127.0.0.1:1", "sasl.password": "the-site-s-own"},
                   "topic_prefix": "", "site_dir": str(site_dir) if site_dir else None})
    return listener


def test_another_cluster_over_sasl_ssl_gets_every_setting(pem: Path, built: list[dict[str, Any]],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """SASL_SSL with mutual TLS: the producer gets librdkafka's names for every setting, relative paths taken from
    the site file's folder, passwords from their file and variable; none of the site's own connection leaks in,
    and no password reaches the log."""
    monkeypatch.setenv("OTHER_KEY_PW", KEY_PASSWORD)
    caplog.set_level(logging.DEBUG)
    init_forwarder({"bootstrap_servers": "other-a:9093, other-b:9093", "security_protocol": "SASL_SSL",
                    "ssl_ca_location": "ca.pem", "ssl_certificate_location": "me.pem", "ssl_key_location": "me.key",
                    "ssl_key_password_env": "OTHER_KEY_PW", "sasl_mechanism": "SCRAM-SHA-512",
                    "sasl_username": "forwarder", "sasl_password_file": "sasl.pw"}, pem)
    assert len(built) == 1
    conf = built[0]
    assert {k: v for k, v in conf.items() if k.startswith(("bootstrap.", "security.", "ssl.", "sasl."))} == {
        "bootstrap.servers": "other-a:9093,other-b:9093", "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(pem / "ca.pem"), "ssl.certificate.location": str(pem / "me.pem"),
        "ssl.key.location": str(pem / "me.key"), "ssl.key.password": KEY_PASSWORD,
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "forwarder", "sasl.password": PASSWORD}
    assert conf["enable.idempotence"] is True and conf["acks"] == "all"
    assert PASSWORD not in caplog.text and KEY_PASSWORD not in caplog.text
    assert "other-a:9093,other-b:9093 over SASL_SSL" in caplog.text


def test_another_cluster_over_ssl_with_an_inline_key_password(pem: Path, built: list[dict[str, Any]]) -> None:
    """SSL alone (no SASL) with the key's password given inline; the settings' repr hides it."""
    listener = init_forwarder({"bootstrap_servers": "other:9093", "security_protocol": "SSL",
                               "ssl_ca_location": str(pem / "ca.pem"), "ssl_certificate_location": str(pem / "me.pem"),
                               "ssl_key_location": str(pem / "me.key"), "ssl_key_password": KEY_PASSWORD})
    assert built[0]["security.protocol"] == "SSL" and built[0]["ssl.key.password"] == KEY_PASSWORD
    assert not any(k.startswith("sasl.") for k in built[0])
    assert KEY_PASSWORD not in repr(listener.settings)


def test_another_cluster_defaults_to_plaintext(built: list[dict[str, Any]]) -> None:
    """bootstrap_servers alone is a plaintext connection, and nothing of the site's own connection is used."""
    init_forwarder({"bootstrap_servers": "other:9092"})
    assert {k: v for k, v in built[0].items() if "." in k and k.split(".")[0] in ("bootstrap", "security", "sasl")} \
        == {"bootstrap.servers": "other:9092", "security.protocol": "PLAINTEXT"}


def test_a_rotated_password_file_reaches_the_next_producer(pem: Path, built: list[dict[str, Any]]) -> None:
    """The password file is read again when the producer is rebuilt (after a fatal error), so rotation works."""
    listener = init_forwarder({"bootstrap_servers": "other:9093", "security_protocol": "SASL_PLAINTEXT",
                               "sasl_mechanism": "PLAIN", "sasl_username": "u",
                               "sasl_password_file": str(pem / "sasl.pw")})
    (pem / "sasl.pw").write_text("rotated\n")
    listener._rebuild_producer()  # what a fatal producer error leads to on the next offer
    assert [conf["sasl.password"] for conf in built] == [PASSWORD, "rotated"]


def test_the_site_cluster_keeps_the_sites_connection(built: list[dict[str, Any]]) -> None:
    """Without bootstrap_servers the producer uses the connection the dispatcher hands over, unchanged."""
    init_forwarder({})
    assert built[0]["bootstrap.servers"] == "127.0.0.1:1" and built[0]["sasl.password"] == "the-site-s-own"


@pytest.mark.parametrize(
    ("settings", "field", "reason"),
    [
        ({"security_protocol": "SASL_SSL"}, "sasl_mechanism", "is required when security_protocol is SASL_SSL"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}, "sasl_username",
         "is required when security_protocol is SASL_SSL"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_username": "u"}, "sasl_password",
         "is required when security_protocol is SASL_PLAINTEXT"),
        ({"security_protocol": "TLS"}, "security_protocol", "PLAINTEXT"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "AWS_MSK_IAM", "sasl_username": "u", "sasl_password": "p"},
         "sasl_mechanism", "OAUTHBEARER"),
        ({"ssl_ca_location": "ca.pem"}, "ssl_ca_location", "is only used with SSL or SASL_SSL"),
        ({"sasl_username": "u"}, "sasl_username", "is only used with SASL_PLAINTEXT or SASL_SSL"),
        ({"security_protocol": "SSL", "ssl_ca_location": "missing.pem"}, "ssl_ca_location", "no such file"),
        ({"security_protocol": "SSL", "ssl_certificate_location": "me.pem"}, "ssl_key_location",
         "mutual TLS needs both"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p",
          "sasl_password_file": "sasl.pw"}, "sasl_password_file", "not both"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u",
          "sasl_password_env": "SLUICE_TEST_UNSET_VARIABLE"}, "sasl_password_env", "is not set"),
        ({"bootstrap_servers": "other"}, "bootstrap_servers", "has no port"),
    ],
)
def test_another_clusters_settings_are_checked(pem: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any],
                                               field: str, reason: str) -> None:
    """A wrong connection setting is a ConfigError naming listener.settings.<field>, its value and why."""
    monkeypatch.chdir(pem)
    monkeypatch.delenv("SLUICE_TEST_UNSET_VARIABLE", raising=False)
    found = problems_of({"topic": "t", "bootstrap_servers": "other:9093", **settings})
    assert reason in found.get(f"listener.settings.{field}", ""), found


@pytest.mark.parametrize("name", ["security_protocol", "ssl_ca_location", "sasl_username", "sasl_password"])
def test_connection_settings_need_another_cluster(name: str) -> None:
    """Connection settings without bootstrap_servers are refused: the site's own cluster uses its kafka: section."""
    reason = problems_of({"topic": "t", name: "x"})[f"listener.settings.{name}"]
    assert "only for another cluster" in reason and "bootstrap_servers" in reason


def test_passwords_never_appear_in_errors() -> None:
    """A ConfigError about the connection shows no password: given where it is not used, or under a misspelt name."""
    for settings in ({"topic": "t", "sasl_password": PASSWORD, "ssl_key_password": KEY_PASSWORD},
                     {"topic": "t", "bootstrap_servers": "o:1", "security_protocol": "PLAINTEXT",
                      "sasl_password": PASSWORD, "ssl_key_password": KEY_PASSWORD},
                     {"topic": "t", "bootstrap_servers": "o:1", "sasl_pasword": PASSWORD, "ssl_keypass": KEY_PASSWORD}):
        with pytest.raises(ConfigError) as info:
            parse_settings(settings)
        text = str(info.value) + repr(info.value.problems)
        assert PASSWORD not in text and KEY_PASSWORD not in text
        assert len(info.value.problems) == 2, info.value.problems


def test_an_unreadable_password_file_stops_init(pem: Path, built: list[dict[str, Any]]) -> None:
    """A password file that exists at parse time but is empty stops init, naming the setting and the file."""
    (pem / "sasl.pw").write_text("")
    with pytest.raises(ConfigError) as info:
        init_forwarder({"bootstrap_servers": "o:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
                        "sasl_username": "u", "sasl_password_file": "sasl.pw"}, pem)
    assert info.value.problems[0][0] == "listener.settings.sasl_password_file" and built == []


# --- headers and routing ------------------------------------------------------------


def test_headers() -> None:
    """Every record carries queue, operation, region, EventID, possibleDuplicate and origin dsid, in UTF-8."""
    event = make_event("order-7", 42)
    assert build_headers(event, possible_duplicate=False) == [
        ("sluice.queue", b"orders-out"),
        ("sluice.operation", b"UPDATE"),
        ("sluice.region", b"orders"),
        ("sluice.event_id", b"member-1/1/42"),
        ("sluice.possible_duplicate", b"false"),
        ("sluice.origin_dsid", b"1"),
    ]
    assert dict(build_headers(event, possible_duplicate=True))["sluice.possible_duplicate"] == b"true"


def test_topic_routing() -> None:
    """{region} routes each region to its own topic; {topic_prefix} is the site's prefix; no placeholder is one topic."""
    per_region = parse_settings({"topic": "{topic_prefix}down.{region}"}, "site-a.")
    assert per_region.topic_for("orders", "site-a.") == "site-a.down.orders"
    assert per_region.topic_for("customers", "site-a.") == "site-a.down.customers"
    single = parse_settings({"topic": "all-events"})
    assert single.topic_for("orders") == single.topic_for("customers") == "all-events"


# --- offers over a scripted producer ---------------------------------------------------


class ScriptedProducer:
    """Stands in for confluent_kafka.Producer: each flush reports the outcomes scripted for that offer."""

    def __init__(self, script: list[list[int | None]]) -> None:
        #: Per offer, per record: None = acknowledged, an error code = failed, -1 = no report (in flight).
        self.script = script
        self.produced: list[dict[str, Any]] = []
        self.pending: list[Any] = []
        self.offer = 0
        self.purged = 0

    def produce(self, topic: str, *, value: bytes, key: bytes, headers: list[tuple[str, bytes]],
                timestamp: int, on_delivery: Any) -> None:
        self.produced.append({"topic": topic, "value": value, "key": key, "headers": dict(headers),
                              "timestamp": timestamp})
        self.pending.append(on_delivery)

    def poll(self, _timeout: float = 0) -> int:
        return 0

    def flush(self, _timeout: float = 0) -> int:
        outcomes = self.script[self.offer] if self.offer < len(self.script) else [None] * len(self.pending)
        self.offer += 1
        unreported = 0
        for callback, outcome in zip(self.pending, outcomes):
            if outcome == -1:
                unreported += 1
            else:
                callback(None if outcome is None else KafkaError(outcome), None)
        self.pending = []
        return unreported

    def purge(self, **_kwargs: Any) -> None:
        self.purged += 1


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(script: list[list[int | None]], *, producer: ScriptedProducer | None = None,
             dead_letter_topic: str | None = None) -> tuple[KafkaForwarderListener, ScriptedProducer]:
        producer = producer or ScriptedProducer(script)
        monkeypatch.setattr(KafkaForwarderListener, "_new_producer", lambda self: producer)
        listener = KafkaForwarderListener()
        listener.init({"settings": {"topic": "{topic_prefix}down.{region}", "flush_timeout_s": 1},
                       "queue_id": "orders-out", "site": "a", "dsid": 1,
                       "kafka": {"bootstrap.servers": "127.0.0.1:1"}, "topic_prefix": "site-a.",
                       "dead_letter_topic": dead_letter_topic})
        return listener, producer
    return make


def test_accepted_batch(scripted: Any) -> None:
    """A batch whose every record is acknowledged returns True; records are keyed, Avro, routed and time-stamped."""
    listener, producer = scripted([[None, None, None]])
    batch = [make_event("k1", 1), make_event("k2", 2, region="customers"), make_event("k1", 3, op=Operation.DESTROY)]
    assert listener.process_events(batch) is True
    assert [(r["topic"], r["key"]) for r in producer.produced] == [
        ("site-a.down.orders", b"k1"), ("site-a.down.customers", b"k2"), ("site-a.down.orders", b"k1")]
    codec = get_codec()
    for record, event in zip(producer.produced, batch):
        assert EntryEvent.from_record(codec.decode_as("EntryEvent", record["value"])) == event.event
        assert record["timestamp"] == event.event.event_time
        assert record["headers"]["sluice.possible_duplicate"] == b"false"
    assert (listener.batches_forwarded, listener.records_forwarded, listener.offers_failed) == (1, 3, 0)


def test_reoffer_marks_only_what_may_be_downstream(scripted: Any) -> None:
    """After a failed offer, the re-offer flags possibleDuplicate exactly on the events that may have landed."""
    listener, producer = scripted([
        # acked, timed out (may be written), purged from the queue (not written), refused by the broker, in flight
        [None, KafkaError._MSG_TIMED_OUT, KafkaError._PURGE_QUEUE, KafkaError.UNKNOWN_TOPIC_OR_PART, -1],
        [None] * 5,
    ])
    batch = [make_event(f"k{i}", i) for i in range(1, 6)]
    assert listener.process_events(batch) is False
    assert producer.purged == 1  # the unreported record left the queue before the re-offer
    assert listener.process_events(batch) is True
    second = producer.produced[5:]
    flags = [r["headers"]["sluice.possible_duplicate"] for r in second]
    assert flags == [b"true", b"true", b"false", b"false", b"true"]
    codec = get_codec()
    assert [codec.decode_as("EntryEvent", r["value"])["possible_duplicate"] for r in second] == [
        True, True, False, False, True]
    # A success forgets: the same events offered once more are not flagged by the forwarder.
    assert listener.process_events(batch) is True
    assert all(r["headers"]["sluice.possible_duplicate"] == b"false" for r in producer.produced[10:])


def test_dispatcher_flag_is_kept(scripted: Any) -> None:
    """An event the dispatcher marks possibleDuplicate (failover) is forwarded marked."""
    listener, producer = scripted([[None]])
    assert listener.process_events([make_event("k", 1, dup=True)]) is True
    assert producer.produced[0]["headers"]["sluice.possible_duplicate"] == b"true"


def test_failures_accumulate_over_reoffers(scripted: Any) -> None:
    """An event that may have landed in any earlier failed offer stays flagged until the batch is accepted."""
    listener, producer = scripted([
        [None, KafkaError._PURGE_QUEUE],
        [KafkaError._PURGE_QUEUE, KafkaError._PURGE_QUEUE],
        [None, None],
    ])
    batch = [make_event("a", 1), make_event("b", 2)]
    assert listener.process_events(batch) is False
    assert listener.process_events(batch) is False
    assert listener.process_events(batch) is True
    assert [r["headers"]["sluice.possible_duplicate"] for r in producer.produced[4:]] == [b"true", b"false"]


class TooLargeForProducer(ScriptedProducer):
    """Refuses the record keyed ``huge`` at produce(), as librdkafka does past message.max.bytes."""

    def produce(self, topic: str, *, key: bytes, **kwargs: Any) -> None:
        if key == b"huge":
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Message size too large"))
        super().produce(topic, key=key, **kwargs)


def test_a_record_too_large_for_the_producer_is_a_dead_letter(scripted: Any) -> None:
    """A record the producer refuses at produce() for its size can never be forwarded: with a host that keeps dead
    letters the batch is accepted once the others are acknowledged, naming that event and why (issue 17)."""
    listener, producer = scripted([], producer=TooLargeForProducer([]), dead_letter_topic="dlq")
    batch = [make_event("a", 1), make_event("huge", 2), make_event("c", 3)]
    result = listener.process_events(batch)
    assert isinstance(result, Accepted), result
    [letter] = result.dead_letters
    assert letter.event is batch[1] and letter.error_class == "MSG_SIZE_TOO_LARGE"
    assert "message.max.bytes" in letter.reason and "site-a.down.orders" in letter.reason
    assert [r["key"] for r in producer.produced] == [b"a", b"c"]
    assert (listener.batches_forwarded, listener.records_forwarded, listener.offers_failed) == (1, 2, 0)


def test_a_record_too_large_without_a_dead_letter_topic_refuses_the_batch(scripted: Any) -> None:
    """A host that keeps no dead letters gets False: nothing is dropped unseen."""
    listener, producer = scripted([], producer=TooLargeForProducer([]))
    assert listener.process_events([make_event("a", 1), make_event("huge", 2)]) is False
    assert listener.offers_failed == 1


def test_the_brokers_size_refusal_is_offered_again(scripted: Any) -> None:
    """The broker refuses a whole request of records for the size of one, so its MSG_SIZE_TOO_LARGE names no
    single event: the batch is offered again, never dead-lettered; those records are certainly not downstream,
    so the re-offer does not flag them."""
    listener, producer = scripted([[None, KafkaError.MSG_SIZE_TOO_LARGE], [None, None]], dead_letter_topic="dlq")
    batch = [make_event("a", 1), make_event("b", 2)]
    assert listener.process_events(batch) is False
    assert listener.process_events(batch) is True
    assert [r["headers"]["sluice.possible_duplicate"] for r in producer.produced[2:]] == [b"true", b"false"]


def test_empty_batch_and_close(scripted: Any) -> None:
    """An empty batch is accepted; close() is idempotent; an offer after close raises ClosedError."""
    listener, _producer = scripted([])
    assert listener.process_events([]) is True
    listener.close()
    listener.close()
    with pytest.raises(ClosedError):
        listener.process_events([make_event("k", 1)])


def test_close_before_init() -> None:
    """close() on a listener that never started does nothing."""
    KafkaForwarderListener().close()


def test_builtin_path_resolves() -> None:
    """The dispatcher's name for type "kafka" points at this class."""
    from sluice.core.asyncevent import BUILTIN_LISTENERS

    module, _, name = BUILTIN_LISTENERS["kafka"].partition(":")
    assert module == kafka_forwarder.__name__ and getattr(kafka_forwarder, name) is KafkaForwarderListener


# --- the downstream example's deduplication ----------------------------------------------


def load_faust_app() -> Any:
    spec = importlib.util.spec_from_file_location("faust_app", ROOT / "deploy" / "downstream" / "faust_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)  # faust itself is imported only by create_app()
    return module


def test_downstream_dedup_is_per_key() -> None:
    """One writer thread's events arriving out of order across keys are all applied; repeats of a key are dropped."""
    app = load_faust_app()
    seen: dict[str, Any] = {}
    latest: dict[str, Any] = {}
    stats = app.Stats()
    # Thread 1 wrote a@1, b@2, a@3; partition of b is consumed first, then a's.
    order = [make_event("b", 2), make_event("a", 1), make_event("a", 3),
             make_event("a", 1, dup=True), make_event("b", 2, dup=True), make_event("a", 3, dup=True)]
    applied = [app.apply_event(e.event, seen, latest, stats) for e in order]
    assert applied == [True, True, True, False, False, False]
    assert latest["orders/a"]["value"] == {"qty": 3} and latest["orders/b"]["event_id"] == "member-1/1/2"
    # Another thread on the same key is its own stream; a destroy removes the latest value.
    assert app.apply_event(make_event("a", 1, thread=2, op=Operation.DESTROY).event, seen, latest, stats)
    assert "orders/a" not in latest
    assert (stats.applied, stats.repeats, dict(stats.regions)) == (4, 3, {"orders": 4})
