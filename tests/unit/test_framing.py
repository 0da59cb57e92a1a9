"""The two framings of a site's data records (``core/framing.py``), over confluent-kafka's in-process mock
registry: a frame's header and schema in either framing; Confluent frames matched to the local schema by
fingerprint (older versions too) so the fast readers read them; truncated headers, unknown ids, foreign
schemas and a Confluent frame with no registry refused with the reason; the region's record builder
writing the site's own header around the same body; the site settings; and the start's check naming the
subject."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryError
from confluent_kafka.schema_registry._sync.mock_schema_registry_client import MockSchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from sluice.core.codec import HEADER_BYTES, MARKER, get_codec, schema_dir
from sluice.core.config.models.registry import SchemaRegistryConnection
from sluice.core.errors import CodecError, ConfigError, MalformedRecord, RegistryUnavailable, UnknownSchema
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import FLAG_ROUTED, entry_event_body, queued_event, queued_flags_body
from sluice.core.framing import CONFLUENT_HEADER_BYTES, Frames, confluent_header, frames_for
from sluice.core.queueloop import _read_older
from sluice.region.fanout import QueueTarget, RecordBuilder
from sluice.region.state import changelog_event

REGISTRY = SchemaRegistryConnection(url="http://registry.example:8081")
CHANGELOG = "sluice.changelog.orders"
QUEUE = "sluice.queue.gw-b"


def entry(seq: int = 1) -> EntryEvent:
    return EntryEvent(region="orders", key=f"k{seq}", operation=Operation.UPDATE, value=b'{"qty": %d}' % seq,
                      event_id=EventID("member-1", 1, seq), version=VersionTag(1, 1_700_000_000_000 + seq, seq),
                      origin_dsid=1, bucket=3, event_time=1_700_000_000_000 + seq)


class MockRegistry(MockSchemaRegistryClient):
    """confluent-kafka's in-process registry, with the compatibility endpoint it lacks: an empty subject is
    Confluent's 404 (40401); a subject in ``refusing`` refuses every new schema, any other accepts."""

    refusing: set[str] = set()

    def test_compatibility(self, subject_name: str, schema: Schema, version: Any = "latest",
                           normalize: bool = False, verbose: bool = False) -> bool:
        if subject_name not in self.get_subjects():
            raise SchemaRegistryError(404, 40401, f"Subject '{subject_name}' not found.")
        return subject_name not in self.refusing


@pytest.fixture
def client() -> MockRegistry:
    return MockRegistry({"url": "mock://framing"})


def writer_and_reader(client: MockRegistry) -> tuple[Frames, Frames]:
    """A confluent site's writer, and a reader of its own (an empty cache: every id asked of the registry)."""
    return (Frames(get_codec(), REGISTRY, serializer="confluent", client=client),
            Frames(get_codec(), REGISTRY, client=client))


def test_single_object_frame_is_ten_bytes_and_its_fingerprint() -> None:
    """A single-object record: its 10-byte header, the schema's fingerprint; read as the codec reads it."""
    codec = get_codec()
    data = codec.encode("EntryEvent", entry().to_record())
    frames = Frames(codec)
    frame = frames.frame(data)
    assert (frame.header_bytes, frame.fingerprint, frame.schema_id) == (HEADER_BYTES, codec.fingerprint("EntryEvent"),
                                                                        None)
    assert frames.current_header(data, "EntryEvent") == codec.header("EntryEvent")
    assert frames.current_header(data, "QueuedEvent") is None
    assert frames.single_object(data) is data
    assert EntryEvent.from_record(frames.decode_as("EntryEvent", data)) == entry()
    assert frames.header("EntryEvent", CHANGELOG) == codec.header("EntryEvent")


def test_confluent_frame_is_five_bytes_and_read_by_fingerprint(client: MockRegistry) -> None:
    """A confluent site's changelog record: 00, the id registered under '<topic>-value', the same body as
    single-object; a reader with only the registry finds the schema by id, matches it to the local one by
    fingerprint, and reads it with the fast reader; confluent-kafka's own AvroDeserializer reads it too."""
    codec = get_codec()
    writer, reader = writer_and_reader(client)
    writer.check_writes({"EntryEvent": [CHANGELOG]})
    schema_id = client.get_latest_version(f"{CHANGELOG}-value").schema_id
    header = writer.header("EntryEvent", CHANGELOG)
    assert header == b"\x00" + schema_id.to_bytes(4, "big") == confluent_header(schema_id)
    body = entry_event_body(entry())
    data = header + body

    frame = reader.frame(data)
    assert frame == (CONFLUENT_HEADER_BYTES, codec.fingerprint("EntryEvent"), schema_id)
    assert reader.current_header(data, "EntryEvent") == header
    assert reader.current_header(data, "QueuedEvent") is None
    assert reader.single_object(data) == codec.header("EntryEvent") + body
    assert changelog_event(data, reader) == entry()
    assert EntryEvent.from_record(reader.decode_as("EntryEvent", data)) == entry()
    foreign = AvroDeserializer(client)(data, SerializationContext(CHANGELOG, MessageField.VALUE))
    assert foreign["key"] == "k1" and foreign["value"] == b'{"qty": 1}'


def test_protocol_records_stay_single_object(client: MockRegistry) -> None:
    """Only EntryEvent and QueuedEvent take the site's serializer: Sluice's own protocol records keep theirs."""
    writer, _ = writer_and_reader(client)
    for name in ("RemovalRecord", "GatewayBatch", "GatewayAck", "QueueStatus", "ControlRecord"):
        assert writer.header(name, "any-topic") == get_codec().header(name)
    assert client.get_subjects() == []


@pytest.mark.parametrize("data, reason", [
    (b"", "0 bytes"),
    (b"\xc3", "shorter than its 10-byte header"),
    (b"\xc3\x01\x00\x01\x02", "shorter than its 10-byte header"),
    (b"\xc3\x02" + bytes(8) + b"\x00", "missing single-object marker"),
    (b"\x00\x00\x01", "shorter than its 5-byte header"),
    (b"\x7bnot a frame", r"neither a single-object \(C3 01\) nor a Confluent \(00\) frame"),
])
def test_truncated_and_foreign_headers_are_refused_with_the_reason(client: MockRegistry, data: bytes,
                                                                   reason: str) -> None:
    _, reader = writer_and_reader(client)
    with pytest.raises(MalformedRecord, match=reason):
        reader.frame(data)
    with pytest.raises(CodecError):
        reader.decode_as("EntryEvent", data)


def test_unknown_schema_id_is_an_unknown_schema(client: MockRegistry) -> None:
    """An id the registry does not hold: ``UnknownSchema`` (a ``CodecError``: the reader dead-letters it)."""
    _, reader = writer_and_reader(client)
    data = confluent_header(4242) + entry_event_body(entry())
    with pytest.raises(UnknownSchema, match="schema id 4242: the registry at http://registry.example:8081 does not"):
        reader.current_header(data, "EntryEvent")
    with pytest.raises(UnknownSchema):
        changelog_event(data, reader)


def test_foreign_schema_id_is_an_unknown_schema(client: MockRegistry) -> None:
    """An id of a schema that is none of Sluice's (another producer's on the same registry) is refused."""
    other = client.register_schema("other-value", Schema(json.dumps(
        {"type": "record", "name": "Other", "fields": [{"name": "x", "type": "long"}]}), "AVRO"))
    _, reader = writer_and_reader(client)
    with pytest.raises(UnknownSchema, match=f"schema id {other} is no Sluice schema"):
        reader.frame(confluent_header(other) + b"\x02")


def test_confluent_frame_without_a_registry_says_so() -> None:
    """Magic byte 00 where the site names no registry: a clear error, not a crash or a guess."""
    data = confluent_header(1) + entry_event_body(entry())
    with pytest.raises(MalformedRecord, match="names no schema_registry to look the id up"):
        Frames(get_codec()).decode_as("EntryEvent", data)
    with pytest.raises(MalformedRecord, match="names no schema_registry"):
        changelog_event(data, Frames(get_codec()))


def test_older_version_in_confluent_framing_is_resolved(client: MockRegistry) -> None:
    """A queue record written with QueuedEvent v2 (no flags) and registered under its own id is read by
    schema resolution, as its single-object twin is: the queue loop's reader gives the same flags and body."""
    old_schema = json.loads((schema_dir() / "history" / "QueuedEvent.v2.avsc").read_text())
    schema_id = client.register_schema(f"{QUEUE}-value", Schema(json.dumps(old_schema), "AVRO"))
    ev = entry()
    record = {"queue_id": "gw-b", "changelog_partition": 3, "changelog_offset": 7, "enqueued_at": 1,
              "event": ev.to_record()}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(old_schema), record)
    data = confluent_header(schema_id) + buf.getvalue()
    _, reader = writer_and_reader(client)
    assert reader.current_header(data, "QueuedEvent") is None
    flags, body = _read_older(reader, data)
    assert flags == 0 and body == entry_event_body(ev)


def test_queue_loop_reads_a_confluent_queue_record_as_its_single_object_twin(client: MockRegistry) -> None:
    writer, reader = writer_and_reader(client)
    body = entry_event_body(entry())
    twin = queued_event(get_codec().header("QueuedEvent"), FLAG_ROUTED, "gw-b", 3, 9, 1_700_000_000_000, body)
    data = queued_event(writer.header("QueuedEvent", QUEUE), FLAG_ROUTED, "gw-b", 3, 9, 1_700_000_000_000, body)
    assert data[CONFLUENT_HEADER_BYTES:] == twin[HEADER_BYTES:]
    assert _read_older(reader, data) == queued_flags_body(get_codec().header("QueuedEvent"), twin) == (FLAG_ROUTED,
                                                                                                       body)


def test_record_builder_writes_the_sites_own_header_around_the_same_body(client: MockRegistry) -> None:
    """A confluent site's region: the changelog record under '<changelog>-value', the queue record under
    '<queue>-value', each body byte for byte the single-object one's (a header swap, no re-encoding)."""
    targets = {"orders": [QueueTarget(id="gw-b", topic=QUEUE, kind="gateway-sender", parallel=True, partitions=8,
                                      order_policy="KEY", remote_dsid=2)]}
    confluent = RecordBuilder(get_codec(), {"orders": CHANGELOG}, targets,
                              Frames(get_codec(), REGISTRY, serializer="confluent", client=client))
    assert set(client.get_subjects()) == {f"{CHANGELOG}-value", f"{QUEUE}-value"}
    single = RecordBuilder(get_codec(), {"orders": CHANGELOG}, targets)
    ev = entry()
    body = entry_event_body(ev)
    (c_changelog, c_queued), (s_changelog, s_queued) = (b.records(ev, body=body) for b in (confluent, single))
    entry_id = client.get_latest_version(f"{CHANGELOG}-value").schema_id
    queued_id = client.get_latest_version(f"{QUEUE}-value").schema_id
    assert c_changelog[3] == confluent_header(entry_id) + s_changelog[3][HEADER_BYTES:]
    assert s_changelog[3][:HEADER_BYTES] == MARKER + get_codec().fingerprint("EntryEvent")
    assert len(c_queued) == len(s_queued) == 1
    assert c_queued[0][3][:CONFLUENT_HEADER_BYTES] == confluent_header(queued_id)
    # The enqueue time differs between the two calls; every byte before it is the same.
    assert c_queued[0][3][CONFLUENT_HEADER_BYTES:CONFLUENT_HEADER_BYTES + 8] == s_queued[0][3][HEADER_BYTES:
                                                                                              HEADER_BYTES + 8]
    assert c_queued[0][3].endswith(body) and s_queued[0][3].endswith(body)


def test_incompatible_subject_stops_the_start_naming_it(client: MockRegistry) -> None:
    """A subject that already holds another record under BACKWARD compatibility refuses Sluice's schema: the
    start's check is a ConfigError naming the subject."""
    client.register_schema(f"{CHANGELOG}-value", Schema(json.dumps(
        {"type": "record", "name": "Other", "fields": [{"name": "x", "type": "long"}]}), "AVRO"))
    client.refusing = {f"{CHANGELOG}-value"}
    writer = Frames(get_codec(), REGISTRY, serializer="confluent", client=client)
    with pytest.raises(ConfigError) as info:
        writer.check_writes({"EntryEvent": [CHANGELOG]})
    assert f"{CHANGELOG}-value" in str(info.value)


def test_unreachable_registry_stops_the_start_naming_the_subject() -> None:
    """No registry at the URL: a ConfigError naming the URL and the subject, not a retry loop or a crash."""
    unreachable = SchemaRegistryConnection(url="http://127.0.0.1:9", timeout_s=2)
    writer = Frames(get_codec(), unreachable, serializer="confluent")
    with pytest.raises(ConfigError) as info:
        writer.check_writes({"EntryEvent": [CHANGELOG]})
    assert f"{CHANGELOG}-value" in str(info.value) and "http://127.0.0.1:9" in str(info.value)


def site(tmp_path: Any, **more: Any) -> Any:
    from sluice.core.config.loading import parse_config

    return parse_config({"site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "localhost:9092"},
                         "regions": [{"name": "orders"}], **more}, source="<test>")


def test_site_serializer_settings(tmp_path: Any) -> None:
    """confluent needs a schema_registry; an unknown serializer is refused naming the choices; single-object
    takes a registry (to read Confluent frames the topics still hold after a switch)."""
    assert site(tmp_path).serializer == "single-object"
    with pytest.raises(ConfigError) as info:
        site(tmp_path, serializer="confluent")
    assert "schema_registry" in str(info.value) and "is required with serializer: confluent" in str(info.value)
    with pytest.raises(ConfigError) as info:
        site(tmp_path, serializer="avro")
    assert "serializer" in str(info.value) and "single-object" in str(info.value)
    cfg = site(tmp_path, serializer="confluent", schema_registry={"url": "http://registry:8081"})
    assert cfg.schema_registry.url == "http://registry:8081"
    assert site(tmp_path, schema_registry={"url": "http://registry:8081"}).schema_registry is not None
    frames = frames_for(cfg)
    assert frames is frames_for(cfg) and frames.serializer == "confluent" and frames.registry == cfg.schema_registry
    with pytest.raises(ConfigError):
        site(tmp_path, serializer="confluent", schema_registry={"url": "ftp://registry"})


def test_subscription_service_cuts_the_body_out_of_either_framing(client: MockRegistry) -> None:
    """The subscription service's reader of changelog records gives the same EntryEvent body for a record of a
    confluent site as for its single-object twin, and refuses an unknown id with ``CodecError``."""
    from types import SimpleNamespace

    from sluice.subscriptions.service import SubscriptionService

    writer, reader = writer_and_reader(client)
    body = entry_event_body(entry())
    service = SimpleNamespace(_entry_header=get_codec().header("EntryEvent"), _frames=reader, _codec=get_codec())
    service._framed_body = lambda value: SubscriptionService._framed_body(service, value)  # type: ignore[arg-type]
    entry_body = SubscriptionService._entry_body
    assert entry_body(service, get_codec().header("EntryEvent") + body) == body  # type: ignore[arg-type]
    assert entry_body(service, writer.header("EntryEvent", CHANGELOG) + body) == body  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        entry_body(service, confluent_header(4242) + body)  # type: ignore[arg-type]


class FlakyRegistry(MockRegistry):
    """Gives no answer (a connection refused) to the first ``failures`` questions about a schema id."""

    failures = 0

    def get_schema(self, schema_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionRefusedError("connection refused")
        return super().get_schema(schema_id, *args, **kwargs)


def test_queue_loop_waits_for_an_unreachable_registry_and_dead_letters_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Confluent queue record met while the registry cannot answer is read once it answers: not
    dead-lettered, not skipped (the queue loop asks again, as it does a broker that is away)."""
    from test_queueloop import QUEUE, FakeMessage, dead_letters, make_loop, waiting
    from test_queueloop import entry as queue_entry

    from sluice.core import kafka as kafka_module

    monkeypatch.setattr(kafka_module, "ASK_AGAIN_AFTER_S", 0.0)
    client = FlakyRegistry({"url": "mock://flaky"})
    loop = make_loop(tmp_path)
    header = Frames(get_codec(), REGISTRY, serializer="confluent", client=client).header("QueuedEvent", loop.topic)
    loop._frames = Frames(get_codec(), REGISTRY, client=client)
    client.failures = 2
    data = queued_event(header, 0, QUEUE, 0, 5, 1_700_000_000_000, entry_event_body(queue_entry("a", 0)))
    loop._read([FakeMessage(data, 0, 0)], now_ms=0)
    assert client.failures == 0 and dead_letters(loop) == []
    assert [e.key for e in waiting(loop).events] == ["a"]


def test_standby_copy_keeps_its_position_while_the_registry_cannot_answer(client: MockRegistry) -> None:
    """The standby reader's position moves past a Confluent changelog record only once it is read: a registry
    that cannot answer raises (retriable: a fresh reader from the positions), and the record is read again."""
    from types import SimpleNamespace

    from sluice.region.standby import StandbyCopy, StandbyKeeper
    from sluice.region.state import BucketState

    flaky = FlakyRegistry({"url": "mock://flaky-standby"})
    data = Frames(get_codec(), REGISTRY, serializer="confluent", client=flaky).header("EntryEvent", CHANGELOG) \
        + entry_event_body(entry())
    keeper = StandbyKeeper(kafka_settings={}, client_id="c", changelog_topics={"orders": CHANGELOG}, dsid=1,
                           member_id="m", codec=get_codec(), frames=Frames(get_codec(), REGISTRY, client=flaky))
    copy = StandbyCopy(state=BucketState("orders", 3, 1, "m"))
    keeper._copies[("orders", 3)] = keeper._assigned[("orders", 3)] = copy
    msg = SimpleNamespace(error=lambda: None, topic=lambda: CHANGELOG, partition=lambda: 3, offset=lambda: 0,
                          value=lambda: data, key=lambda: b"k1")
    flaky.failures = 1
    with pytest.raises(RegistryUnavailable):
        keeper._apply([msg])
    assert copy.position == 0 and not copy.state.entries
    keeper._apply([msg])
    assert copy.position == 1 and copy.state.entries["k1"].value == entry().value
