"""The Confluent serializer without a registry server: the forwarder's serializer and schema_registry
settings (what is refused, and why; secrets from their file or variable, never shown); the client settings
they make; subject names per Confluent's strategies; the frame confluent-kafka writes and its own
AvroDeserializer reads, over confluent-kafka's in-process mock registry; and the start-up check's errors
(an incompatible subject, a schema missing where auto_register is off) naming the subject and why."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka.schema_registry import RegisteredSchema, Schema, SchemaRegistryClient, SchemaRegistryError
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry._sync.mock_schema_registry_client import MockSchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext

from sluice.core.asyncevent import AsyncEvent
from sluice.core.config.models.registry import SchemaRegistryConnection
from sluice.core.errors import ConfigError, RegistryRefused, RegistryUnavailable
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.registry import MAGIC_BYTE, ConfluentAvroWriter, registry_schema
from sluice.listeners import kafka_forwarder
from sluice.listeners.kafka_forwarder import ForwarderSettings, KafkaForwarderListener, parse_settings

REGISTRY = {"url": "http://registry.example:8081"}
PASSWORD = "registry-password-not-to-be-shown"
TOKEN = "registry-token-not-to-be-shown"


def problems_of(settings: Any, site_dir: Path | None = None) -> dict[str, tuple[Any, str]]:
    with pytest.raises(ConfigError) as info:
        parse_settings(settings, "", site_dir)
    assert PASSWORD not in str(info.value) and TOKEN not in str(info.value)
    return {field: (value, reason) for field, value, reason in info.value.problems}


def confluent(**registry: Any) -> dict[str, Any]:
    return {"topic": "down.{region}", "serializer": "confluent", "schema_registry": {**REGISTRY, **registry}}


def entry(seq: int = 1, region: str = "orders") -> EntryEvent:
    return EntryEvent(region=region, key=f"k{seq}", operation=Operation.UPDATE, value=b'{"qty": %d}' % seq,
                      event_id=EventID("member-1", 1, seq), version=VersionTag(1, 1_700_000_000_000 + seq, seq),
                      origin_dsid=1, bucket=3, event_time=1_700_000_000_000 + seq)


# --- settings ---------------------------------------------------------------------


def test_single_object_is_the_default_and_takes_no_registry() -> None:
    """Without serializer the forwarder writes Sluice's own framing; a schema_registry block beside it would do
    nothing, so it is refused."""
    assert parse_settings({"topic": "t"}) == ForwarderSettings(topic="t")
    assert parse_settings({"topic": "t"}).serializer == "single-object"
    problems = problems_of({"topic": "t", "schema_registry": REGISTRY})
    assert "is only for serializer: confluent" in problems["listener.settings.schema_registry"][1]


def test_confluent_needs_a_registry_and_a_known_serializer() -> None:
    """serializer confluent without schema_registry is refused; an unknown serializer gets the near name."""
    assert "is required with serializer: confluent" in problems_of(
        {"topic": "t", "serializer": "confluent"})["listener.settings.schema_registry"][1]
    value, reason = problems_of({"topic": "t", "serializer": "confluen"})["listener.settings.serializer"]
    assert value == "confluen" and "did you mean 'confluent'?" in reason
    assert "must be a mapping" in problems_of(
        {"topic": "t", "serializer": "confluent", "schema_registry": "http://r"})["listener.settings.schema_registry"][1]


def test_registry_defaults() -> None:
    """TopicNameStrategy, auto_register, 10 s: Confluent's serializers' own defaults; no credentials."""
    settings = parse_settings(confluent())
    registry = settings.schema_registry
    assert settings.serializer == "confluent" and registry is not None
    assert (registry.subject_name_strategy, registry.auto_register, registry.timeout_s) == (
        "TopicNameStrategy", True, 10.0)
    assert registry.client_settings() == {"url": "http://registry.example:8081", "timeout": 10.0}


@pytest.mark.parametrize(("registry", "field", "reason"), [
    ({"url": "ftp://r"}, "url", "is not an http:// or https:// URL"),
    ({"url": "http://"}, "url", "is not an http:// or https:// URL"),
    ({"url": "http://user:pw@r:8081"}, "url", "carries credentials"),
    ({"url": "http://r:99999"}, "url", "must be a number from 1 to 65535"),
    ({"subject_name_strategy": "TopicName"}, "subject_name_strategy", "must be one of 'TopicNameStrategy'"),
    ({"auto_register": "yes"}, "auto_register", "must be true or false"),
    ({"timeout_s": 0}, "timeout_s", "must be > 0"),
    ({"basic_auth_username": "u"}, "basic_auth_username", "needs a password"),
    ({"basic_auth_password": PASSWORD}, "basic_auth_username", "is required with a basic-auth password"),
    ({"basic_auth_username": "u", "basic_auth_password": PASSWORD, "bearer_token": TOKEN}, "bearer_token",
     "not both"),
    ({"bearer_token": TOKEN, "bearer_token_env": "HOME"}, "bearer_token_env", "not both"),
    ({"bearer_token_env": "SLUICE_UNSET_REGISTRY_TOKEN"}, "bearer_token_env", "is not set"),
    ({"bearer_token_file": "no-such-file"}, "bearer_token_file", "no-such-file"),
    ({"bearer_tokn": TOKEN}, "bearer_tokn", "did you mean 'bearer_token'?"),
])
def test_registry_settings_refused(registry: dict[str, Any], field: str, reason: str, tmp_path: Path) -> None:
    """Each wrong registry setting is named under listener.settings.schema_registry, with why; a secret is never
    shown, not even a misspelt one."""
    problems = problems_of(confluent(**registry), tmp_path)
    key = f"listener.settings.schema_registry.{field}"
    assert key in problems, problems
    assert reason in problems[key][1], problems[key]


def test_basic_auth_password_from_a_file_relative_to_the_site_file(tmp_path: Path) -> None:
    """A password file (a mounted secret) is found beside the site file and read when the client is made, so a
    rotated one reaches the next client; the model's repr hides it."""
    (tmp_path / "registry.pw").write_text(PASSWORD + "\n")
    registry = parse_settings(confluent(basic_auth_username="sluice", basic_auth_password_file="registry.pw"),
                              "", tmp_path).schema_registry
    assert registry is not None and PASSWORD not in repr(registry)
    assert registry.client_settings()["basic.auth.user.info"] == f"sluice:{PASSWORD}"
    (tmp_path / "registry.pw").write_text("rotated\n")
    assert registry.client_settings()["basic.auth.user.info"] == "sluice:rotated"


def test_bearer_token_from_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A static bearer token from an environment variable, as confluent-kafka's client takes it."""
    monkeypatch.setenv("REGISTRY_TOKEN", TOKEN)
    registry = parse_settings(confluent(bearer_token_env="REGISTRY_TOKEN")).schema_registry
    assert registry is not None
    settings = registry.client_settings()
    assert settings["bearer.auth.credentials.source"] == "STATIC_TOKEN" and settings["bearer.auth.token"] == TOKEN
    assert "basic.auth.user.info" not in settings
    SchemaRegistryClient(settings)  # confluent-kafka's own client takes every setting made


def test_ssl_ca_location_relative_to_the_site_file(tmp_path: Path) -> None:
    """An https registry's CA bundle is taken from the site file's folder, stored absolute."""
    (tmp_path / "ca.pem").write_text("not read here")
    registry = parse_settings(confluent(url="https://r:8081", ssl_ca_location="ca.pem"), "", tmp_path).schema_registry
    assert registry is not None and registry.client_settings()["ssl.ca.location"] == str(tmp_path / "ca.pem")


# --- the writer over confluent-kafka's in-process mock registry ----------------------------


class MockRegistry(MockSchemaRegistryClient):
    """confluent-kafka's in-process registry, with the compatibility endpoint it lacks: an empty subject is
    Confluent's 404 (40401), any other accepts."""

    def test_compatibility(self, subject_name: str, schema: Schema, version: Any = "latest",
                           normalize: bool = False, verbose: bool = False) -> bool:
        if subject_name not in self.get_subjects():
            raise SchemaRegistryError(404, 40401, f"Subject '{subject_name}' not found.")
        return True


def mock_client() -> SchemaRegistryClient:
    return MockRegistry({"url": "mock://sluice-unit"})


def writer(strategy: str = "TopicNameStrategy", client: SchemaRegistryClient | None = None,
           **registry: Any) -> ConfluentAvroWriter:
    connection = SchemaRegistryConnection.model_validate(
        {**REGISTRY, "subject_name_strategy": strategy, **registry})
    return ConfluentAvroWriter(connection, "EntryEvent", field="listener.settings.schema_registry",
                               client=client or mock_client())


def test_registry_schema_is_self_contained_with_its_full_name() -> None:
    """The registered schema spells out EventID and VersionTag, so a reader needs nothing but the registry, and
    keeps timestamp-millis so Connect and ksqlDB see timestamps."""
    schema = registry_schema("EntryEvent")
    text = json.dumps(schema)
    fastavro.parse_schema(schema, named_schemas={})
    assert schema["name"] == "io.sluice.EntryEvent"
    assert '"name": "io.sluice.EventID"' in text and '"name": "io.sluice.VersionTag"' in text
    assert '"logicalType": "timestamp-millis"' in text


@pytest.mark.parametrize(("strategy", "subject"), [
    ("TopicNameStrategy", "down.orders-value"),
    ("RecordNameStrategy", "io.sluice.EntryEvent"),
    ("TopicRecordNameStrategy", "down.orders-io.sluice.EntryEvent"),
])
def test_subject_names_follow_confluent_strategies(strategy: str, subject: str) -> None:
    """Each strategy names the subject as Confluent's serializers do, and that subject is registered on start."""
    w = writer(strategy)
    assert w.subject_for("down.orders") == subject
    ids = w.check_subjects(["down.orders"])
    assert list(ids) == [subject]
    assert w.client.get_latest_version(subject).schema_id == ids[subject]


def test_frame_is_magic_byte_schema_id_body_and_confluent_reads_it() -> None:
    """encode writes 00, the 4-byte big-endian id of the registered schema, then the Avro body; confluent-kafka's
    AvroDeserializer over the same registry reads the record back."""
    w = writer()
    ids = w.check_subjects(["down.orders"])
    record = entry(7).to_record()
    data = w.encode("down.orders", record)
    assert data[0] == MAGIC_BYTE
    assert struct.unpack(">I", data[1:5])[0] == ids["down.orders-value"]
    read = AvroDeserializer(w.client)(data, SerializationContext("down.orders", MessageField.VALUE))
    assert read is not None
    assert read["key"] == "k7" and read["value"] == b'{"qty": 7}' and read["event_id"]["sequence_id"] == 7
    assert read["event_time"].timestamp() * 1000 == record["event_time"]


class ScriptedRegistry:
    """The few registry calls the start-up check makes, answered from a script (no server)."""

    def __init__(self, compatible: bool = True, registered: bool = True, down: bool = False) -> None:
        self.compatible, self.registered, self.down = compatible, registered, down
        self.registrations: list[str] = []

    def test_compatibility(self, subject: str, schema: Schema, verbose: bool = False) -> bool:
        if self.down:
            raise SchemaRegistryError(503, 50301, "registry is starting")
        return self.compatible

    def get_compatibility(self, subject: str | None = None) -> str:
        if subject is not None:
            raise SchemaRegistryError(404, 40408, "no subject-level compatibility")
        return "BACKWARD"

    def get_latest_version(self, subject: str) -> RegisteredSchema:
        return RegisteredSchema(schema_id=4, guid=None, schema=Schema("{}", "AVRO"), subject=subject, version=3)

    def register_schema(self, subject: str, schema: Schema) -> int:
        self.registrations.append(subject)
        return 5

    def lookup_schema(self, subject: str, schema: Schema) -> RegisteredSchema:
        if not self.registered:
            raise SchemaRegistryError(404, 40403, "Schema not found")
        return RegisteredSchema(schema_id=6, guid=None, schema=schema, subject=subject, version=1)


def test_incompatible_subject_is_a_configuration_error_naming_it() -> None:
    """A subject whose latest version the schema is not compatible with stops the start: the error names the
    subject, the level and the version, and nothing is registered."""
    registry = ScriptedRegistry(compatible=False)
    with pytest.raises(ConfigError) as info:
        writer(client=registry).check_subjects(["down.orders"])  # type: ignore[arg-type]
    [(field, value, reason)] = info.value.problems
    assert field == "listener.settings.schema_registry" and value == "down.orders-value"
    assert "not BACKWARD-compatible with version 3 (schema id 4) of subject 'down.orders-value'" in reason
    assert registry.registrations == []


def test_compatible_subject_is_registered() -> None:
    """A compatible (or empty) subject gets the schema registered on start, and its id kept."""
    registry = ScriptedRegistry()
    assert writer(client=registry).check_subjects(["a", "b", "a"]) == {"a-value": 5, "b-value": 5}  # type: ignore[arg-type]
    assert registry.registrations == ["a-value", "b-value"]


def test_without_auto_register_the_schema_must_be_there() -> None:
    """auto_register false: the schema is only looked up; a subject without it is a configuration error that
    says how to fix it, and nothing is registered."""
    registry = ScriptedRegistry(registered=False)
    with pytest.raises(ConfigError) as info:
        writer(client=registry, auto_register=False).check_subjects(["down.orders"])  # type: ignore[arg-type]
    [(field, _value, reason)] = info.value.problems
    assert field == "listener.settings.schema_registry.auto_register"
    assert "subject 'down.orders-value' does not hold Sluice's io.sluice.EntryEvent schema" in reason
    assert registry.registrations == []
    assert writer(client=ScriptedRegistry(), auto_register=False).check_subjects(["x"]) == {"x-value": 6}  # type: ignore[arg-type]


def test_registry_that_cannot_answer_is_retriable() -> None:
    """A 5xx is RegistryUnavailable (retriable), a 4xx refusal RegistryRefused (not)."""
    with pytest.raises(RegistryUnavailable) as info:
        writer(client=ScriptedRegistry(down=True)).check_subjects(["t"])  # type: ignore[arg-type]
    assert info.value.retriable and "registry is starting" in str(info.value)
    refused = writer()._registry_error(SchemaRegistryError(409, 409, "incompatible"), "t-value", "registering")
    assert isinstance(refused, RegistryRefused) and not refused.retriable and refused.subject == "t-value"


def test_unreachable_registry_is_retriable() -> None:
    """No server at the URL: RegistryUnavailable naming the URL, not a crash with the HTTP client's error."""
    connection = SchemaRegistryConnection.model_validate({"url": "http://127.0.0.1:9", "timeout_s": 2})
    w = ConfluentAvroWriter(connection, "EntryEvent")
    w.client._rest_client.max_retries = 0  # one try is enough to see the refusal
    with pytest.raises(RegistryUnavailable) as info:
        w.check_subjects(["t"])
    assert "http://127.0.0.1:9" in str(info.value)


# --- the forwarder ------------------------------------------------------------------------


def test_forwarder_checks_a_subject_per_region_on_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a {region} topic, every region the dispatcher names gets its subject checked and registered when the
    forwarder starts, before any record."""
    client = mock_client()
    real = kafka_forwarder.ConfluentAvroWriter
    monkeypatch.setattr(kafka_forwarder, "ConfluentAvroWriter",
                        lambda connection, name, field: real(connection, name, field=field, client=client))
    monkeypatch.setattr(kafka_forwarder, "make_producer", lambda conf: object())
    listener = KafkaForwarderListener()
    listener.init({"settings": confluent(), "queue_id": "q", "site": "a", "dsid": 1,
                   "kafka": {"bootstrap.servers": "127.0.0.1:1"}, "topic_prefix": "p.",
                   "regions": ["orders", "items"]})
    assert sorted(client.get_subjects()) == ["down.items-value", "down.orders-value"]


def test_an_unreachable_registry_fails_the_offer_before_anything_is_written(monkeypatch: pytest.MonkeyPatch,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A subject first met at a record (no regions named on start) whose registry cannot be reached: the offer
    returns False, so the dispatcher offers the same batch again, and no record reached the producer."""
    real = kafka_forwarder.ConfluentAvroWriter
    client = SchemaRegistryClient({"url": "http://127.0.0.1:9", "max.retries": 0, "timeout": 2})
    monkeypatch.setattr(kafka_forwarder, "ConfluentAvroWriter",
                        lambda connection, name, field: real(connection, name, field=field, client=client))

    class NoWrites:
        def produce(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("nothing may be produced when a record cannot be encoded")

    monkeypatch.setattr(kafka_forwarder, "make_producer", lambda conf: NoWrites())
    listener = KafkaForwarderListener()
    listener.init({"settings": confluent(url="http://127.0.0.1:9"), "queue_id": "q", "site": "a", "dsid": 1,
                   "kafka": {"bootstrap.servers": "127.0.0.1:1"}, "topic_prefix": ""})
    batch = [AsyncEvent(entry(i), "q", 3, i, False) for i in range(3)]
    assert listener.process_events(batch) is False
    assert listener.offers_failed == 1 and "schema registry http://127.0.0.1:9" in caplog.text
