"""The Confluent serializer against a real schema registry (Apicurio Registry, its Confluent-compatible API).

Two sites on two brokers, every service a process: a put on site a crosses
the gateway to site b, whose async event queue forwards it with ``serializer:
confluent``; a plain confluent-kafka ``DeserializingConsumer`` with
``AvroDeserializer``, knowing nothing of Sluice but the registry's URL, reads
it.  Then the start-up check against the same registry: an incompatible
subject stops the forwarder with an error naming it, and each subject name
strategy registers where Confluent's serializers would.

The registry is built once from Maven Central into ``~/.cache/sluice``
(``sluice.broker.registry``) and started once per session; where it cannot be
(no java, no mvn and no cached build, or a build that fails) these tests are
skipped with the reason.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from sluice.broker.registry import EmbeddedRegistry, registry_available
from sluice.client import RegionClient
from sluice.core.config import load_config
from sluice.core.config.models.registry import SchemaRegistryConnection
from sluice.core.errors import BrokerStartError, ConfigError
from sluice.core.kafka import NewTopic, make_admin, wait_futures
from sluice.core.processes import DispatcherProcess, ReceiverProcess, SenderProcess, ServiceProcess
from sluice.core.registry import ConfluentAvroWriter, registry_schema_text
from sluice.core.topics import apply_topics
from sluice.listeners.kafka_forwarder import KafkaForwarderListener

from regionkit import start_two_regions

if TYPE_CHECKING:
    from conftest import Site

# The first test of a session may build the registry (~2-5 minutes with a cold Maven repository).
pytestmark = pytest.mark.timeout(1200)

KEYS = 20


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRegistry]:
    """One Apicurio Registry for the session (in-memory storage), built on first use."""
    missing = registry_available()
    if missing:
        pytest.skip(f"no schema registry can run here: {missing}")
    server = EmbeddedRegistry(tmp_path_factory.mktemp("registry"))
    try:
        server.start()
    except BrokerStartError as exc:
        pytest.skip(f"Apicurio Registry did not start: {exc}")
    try:
        yield server
    finally:
        server.stop()


def forwarder_settings(registry: EmbeddedRegistry, **more: Any) -> dict[str, Any]:
    return {"topic": "{topic_prefix}downstream.{region}", "serializer": "confluent",
            "schema_registry": {"url": registry.url, **more}}


def write_sites(tmp_path: Path, bootstrap_a: str, bootstrap_b: str, prefix: str,
                registry: EmbeddedRegistry) -> tuple[Path, Path]:
    """Site a: region orders, a parallel sender to b.  Site b: its receiver, and an async event queue whose
    Kafka forwarder writes Confluent-framed records to ``<b's prefix>downstream.orders``."""
    kafka = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
    site_a = {
        "site": "a", "dsid": 1, "kafka": {**kafka, "bootstrap_servers": bootstrap_a, "topic_prefix": f"{prefix}a."},
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["orders-to-b"]}],
        "gateway_senders": [{"id": "orders-to-b", "remote_dsid": 2, "parallel": True, "batch_size": 20,
                             "batch_time_interval_ms": 20,
                             "remote": {"bootstrap_servers": bootstrap_b, "topic_prefix": f"{prefix}b."}}],
    }
    site_b = {
        "site": "b", "dsid": 2, "kafka": {**kafka, "bootstrap_servers": bootstrap_b, "topic_prefix": f"{prefix}b."},
        "regions": [{"name": "orders", "buckets": 4, "async_event_queues": ["downstream"]}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
        "async_event_queues": [{"id": "downstream", "batch_size": 20, "listener": {
            "type": "kafka", "settings": forwarder_settings(registry)}}],
    }
    paths = []
    for name, data in (("a", site_a), ("b", site_b)):
        path = tmp_path / f"site-{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        assert apply_topics(load_config(path)).ok
        paths.append(path)
    return paths[0], paths[1]


def test_forwarded_records_are_read_by_a_plain_avro_deserializer(site_a: Site, site_b: Site, unique_prefix: str,
                                                                 registry: EmbeddedRegistry, tmp_path: Path) -> None:
    """Puts on site a reach site b over the gateway; b's forwarder writes each in Confluent's wire format
    (00, the schema id the registry gave under '<topic>-value', the Avro body); a DeserializingConsumer with
    confluent-kafka's AvroDeserializer and nothing else of Sluice reads every one, values and EventIDs intact."""
    path_a, path_b = write_sites(tmp_path, site_a.bootstrap, site_b.bootstrap, unique_prefix, registry)
    downstream = f"{unique_prefix}b.downstream.orders"
    admin = make_admin({"bootstrap.servers": site_b.bootstrap})
    wait_futures(admin.create_topics([NewTopic(downstream, num_partitions=4, replication_factor=1)]),
                 "creating the downstream topic")
    procs: list[ServiceProcess] = []
    try:
        region_a, region_b = start_two_regions(path_a, path_b, tmp_path, procs, ready_s=120)
        procs += [ReceiverProcess(path_b, tmp_path / "receiver-b.log"),
                  SenderProcess(path_a, "orders-to-b", tmp_path / "sender-a.log"),
                  DispatcherProcess(path_b, "downstream", tmp_path / "dispatcher-b.log")]
        # The dispatcher checked and registered the region's subject when it started, before any record.
        procs[-1].wait_started(120)
        subject = f"{downstream}-value"
        assert subject in SchemaRegistryClient({"url": registry.url}).get_subjects()
        RegionClient([region_a.url]).put_all("orders", {f"k{i}": {"n": i} for i in range(KEYS)})

        records = read_confluent(site_b.bootstrap, downstream, registry.url, KEYS, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()

    # The registry holds Sluice's schema under the topic's subject, and every record names its id.
    client = SchemaRegistryClient({"url": registry.url})
    latest = client.get_latest_version(subject)
    assert json.loads(latest.schema.schema_str)["name"] == "io.sluice.EntryEvent"
    assert {schema_id for schema_id, _, _ in records} == {latest.schema_id}
    by_key = {key: value for _, key, value in records}
    assert sorted(by_key) == sorted(f"k{i}" for i in range(KEYS))
    for i in range(KEYS):
        event = by_key[f"k{i}"]
        assert event["region"] == "orders" and event["operation"] == "PUTALL_CREATE"
        assert json.loads(event["value"]) == {"n": i}
        assert event["origin_dsid"] == 1 and event["event_id"]["sequence_id"] >= 0
        assert event["event_time"].year >= 2024  # timestamp-millis: a timestamp to Avro readers


def read_confluent(bootstrap: str, topic: str, registry_url: str, count: int,
                   procs: list[ServiceProcess]) -> list[tuple[int, str, dict[str, Any]]]:
    """(schema id, key, value) of the first ``count`` records, read as any Confluent client reads them: a plain
    consumer, the key as UTF-8 text, the value through confluent-kafka's AvroDeserializer."""
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": registry_url}))
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{topic}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    out: list[tuple[int, str, dict[str, Any]]] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 180
        while len(out) < count:
            exited = [p for p in procs if p.proc.poll() is not None]
            assert not exited, f"{exited[0].announcement or exited[0]} exited:\n{exited[0].log_tail()}"
            assert time.monotonic() < deadline, (f"{len(out)} of {count} records downstream; dispatcher log:\n"
                                                 f"{procs[-1].log_tail()}")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            raw = msg.value()
            assert raw[0] == 0, f"not Confluent's magic byte: {raw[:5].hex()}"
            value = deserialize(raw, SerializationContext(topic, MessageField.VALUE))
            out.append((struct.unpack(">I", raw[1:5])[0], msg.key().decode(), value))
        return out
    finally:
        consumer.close()


def start_forwarder(bootstrap: str, prefix: str, settings: dict[str, Any],
                    regions: list[str]) -> KafkaForwarderListener:
    listener = KafkaForwarderListener()
    listener.init({"settings": settings, "queue_id": "downstream", "site": "b", "dsid": 2,
                   "kafka": {"bootstrap.servers": bootstrap}, "topic_prefix": prefix, "regions": regions})
    return listener


def test_an_incompatible_subject_stops_the_start_naming_it(site_a: Site, unique_prefix: str,
                                                           registry: EmbeddedRegistry) -> None:
    """The subject of one region already holds another record under BACKWARD compatibility; Sluice's schema
    cannot be read as it, so the forwarder refuses to start: a ConfigError naming that subject and the
    registry's reason, and nothing registered there.  The other region's subject was fine."""
    client = SchemaRegistryClient({"url": registry.url})
    taken = f"{unique_prefix}downstream.orders-value"
    other = {"type": "record", "name": "EntryEvent", "namespace": "sluice",
             "fields": [{"name": "sku", "type": "string"}]}
    client.register_schema(taken, Schema(json.dumps(other), "AVRO"))
    client.set_compatibility(taken, "BACKWARD")
    before = client.get_versions(taken)
    with pytest.raises(ConfigError) as info:
        start_forwarder(site_a.bootstrap, unique_prefix, forwarder_settings(registry), ["customers", "orders"])
    [(field, value, reason)] = info.value.problems
    assert field == "listener.settings.schema_registry" and value == taken
    assert "is not BACKWARD-compatible with version 1" in reason and repr(taken) in reason
    assert client.get_versions(taken) == before
    assert client.get_versions(f"{unique_prefix}downstream.customers-value") == [1]


@pytest.mark.parametrize(("strategy", "subject"), [
    ("TopicNameStrategy", "{topic}-value"),
    ("RecordNameStrategy", "io.sluice.EntryEvent"),
    ("TopicRecordNameStrategy", "{topic}-io.sluice.EntryEvent"),
])
def test_subject_strategies_register_where_confluent_would(unique_prefix: str, registry: EmbeddedRegistry,
                                                           strategy: str, subject: str) -> None:
    """Each strategy registers Sluice's schema under the subject Confluent's serializers name, and the
    registry's id for it is the one in the frame."""
    topic = f"{unique_prefix}down"
    connection = SchemaRegistryConnection.model_validate({"url": registry.url, "subject_name_strategy": strategy})
    writer = ConfluentAvroWriter(connection)
    expected = subject.format(topic=topic)
    ids = writer.check_subjects([topic])
    assert list(ids) == [expected]
    client = SchemaRegistryClient({"url": registry.url})
    assert client.get_latest_version(expected).schema_id == ids[expected]


def test_without_auto_register_an_unregistered_schema_stops_the_start(site_a: Site, unique_prefix: str,
                                                                      registry: EmbeddedRegistry) -> None:
    """auto_register false and nothing registered: the start fails saying so; once the schema is registered
    by its owner, the same settings start and use its id."""
    settings = forwarder_settings(registry, auto_register=False)
    with pytest.raises(ConfigError) as info:
        start_forwarder(site_a.bootstrap, unique_prefix, settings, ["orders"])
    [(field, _value, reason)] = info.value.problems
    assert field == "listener.settings.schema_registry.auto_register"
    assert f"subject '{unique_prefix}downstream.orders-value' does not hold" in reason
    subject = f"{unique_prefix}downstream.orders-value"
    client = SchemaRegistryClient({"url": registry.url})
    assert subject not in client.get_subjects()
    schema_id = client.register_schema(subject, Schema(registry_schema_text("EntryEvent"), "AVRO"))
    listener = start_forwarder(site_a.bootstrap, unique_prefix, settings, ["orders"])
    try:
        assert listener._confluent is not None and listener._confluent.ids == {subject: schema_id}
    finally:
        listener.close()
