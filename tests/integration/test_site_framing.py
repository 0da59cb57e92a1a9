"""A site with ``serializer: confluent``: its changelog and queue records in Confluent's wire format, against a
real schema registry (Apicurio Registry, its Confluent-compatible API), every service a process.

Site a (confluent) takes puts; a plain confluent-kafka consumer with ``AvroDeserializer``, knowing nothing of
Sluice but the registry's URL, reads a's changelog; a's queue records carry the id of the queue topic's
subject; a's gateway sender reads them and site b (single-object) applies every event once, under its own
header.  Then a's region restarts from its Confluent-framed changelog and answers the same values, a record
of an id the registry does not know dead-lettered with the reason and nothing after it lost.

The registry is the session one of ``test_schema_registry.py`` (built once from Maven Central into
``~/.cache/sluice``); where it cannot run these tests are skipped with the reason.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import SchemaRegistryClient

from sluice.client import RegionClient
from sluice.core.codec import HEADER_BYTES, get_codec
from sluice.core.config.models.registry import SchemaRegistryConnection
from sluice.core.events import EntryEvent
from sluice.core.framing import Frames
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess, ServiceProcess

from regionkit import read_topic, remote, start_two_regions, write_two_sites
from test_schema_registry import read_confluent, registry  # noqa: F401 - the session's registry fixture
from waiting import wait_for

if TYPE_CHECKING:
    from conftest import Site
    from sluice.broker.registry import EmbeddedRegistry

# The first test of a session may build the registry (~2-5 minutes with a cold Maven repository).
pytestmark = pytest.mark.timeout(1200)

KEYS = 20
BUCKETS = 4
#: A schema id no registry of this test holds.
UNKNOWN_ID = 987_654


def test_confluent_site_is_read_by_plain_avro_by_itself_and_by_a_single_object_site(
        site_a: Site, unique_prefix: str, registry: EmbeddedRegistry, tmp_path: Path) -> None:  # noqa: F811
    sites = write_two_sites(tmp_path, site_a.bootstrap, unique_prefix, a={
        "serializer": "confluent", "schema_registry": {"url": registry.url},
        "regions": [{"name": "orders", "buckets": BUCKETS, "gateway_senders": ["orders-to-b"]}],
        "gateway_senders": [{"id": "orders-to-b", "remote_dsid": 2, "parallel": True, "batch_size": 20,
                             "batch_time_interval_ms": 20, "remote": remote(site_a.bootstrap, unique_prefix, "b")}],
    }, b={
        "regions": [{"name": "orders", "buckets": BUCKETS}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    })
    changelog_a = sites.cfg_a.topics.region_changelog("orders")
    queue_a = sites.cfg_a.topics.queue("orders-to-b")
    changelog_b = sites.cfg_b.topics.region_changelog("orders")
    expected = {f"k{i}": {"n": i} for i in range(KEYS)}
    expected["k0"] = {"n": 100}
    procs: list[ServiceProcess] = []
    try:
        region_a, region_b = start_two_regions(sites.path_a, sites.path_b, tmp_path, procs, ready_s=120)
        procs += [ReceiverProcess(sites.path_b, tmp_path / "receiver-b.log"),
                  SenderProcess(sites.path_a, "orders-to-b", tmp_path / "sender-a.log")]
        client_a, client_b = RegionClient([region_a.url]), RegionClient([region_b.url])
        client_a.put_all("orders", {f"k{i}": {"n": i} for i in range(KEYS)})
        client_a.put("orders", "k0", {"n": 100})

        # 1. Site a's changelog, read as any Confluent client reads a topic.
        records = read_confluent(site_a.bootstrap, changelog_a, registry.url, KEYS + 1, procs)
        client = SchemaRegistryClient({"url": registry.url})
        entry_schema = client.get_latest_version(f"{changelog_a}-value")
        assert entry_schema.schema.schema_str and '"io.sluice.EntryEvent"' in entry_schema.schema.schema_str
        assert {schema_id for schema_id, _, _ in records} == {entry_schema.schema_id}
        assert sorted((key, json.loads(event["value"])["n"]) for _, key, event in records) == sorted(
            [(f"k{i}", i) for i in range(KEYS)] + [("k0", 100)])

        # 2. Its queue records carry the id of the queue topic's subject, the QueuedEvent schema.
        queued_schema = client.get_latest_version(f"{queue_a}-value")
        assert '"io.sluice.QueuedEvent"' in str(queued_schema.schema.schema_str)
        queued = [value for _, _, value in read_topic(site_a.bootstrap, queue_a, BUCKETS)]
        assert len(queued) == KEYS + 1
        assert {struct.unpack(">bI", value[:5]) for value in queued if value} == {(0, queued_schema.schema_id)}

        # 3. Site b (single-object) applies every event once: its own header around the same body.
        def b_has_all() -> bool:
            got = client_b.get_all("orders", sorted(expected))
            return {k: (e or {}).get("value") for k, e in got.items()} == expected

        wait_for(b_has_all, timeout_s=120, what="every event of a applied on b")
        codec = get_codec()
        applied = [value for _, _, value in read_topic(site_a.bootstrap, changelog_b, BUCKETS)]
        assert all(value[:HEADER_BYTES] == codec.header("EntryEvent") for value in applied if value)
        events = [EntryEvent.from_record(codec.decode_as("EntryEvent", value)) for value in applied if value]
        assert len(events) == KEYS + 1 == len({e.event_id for e in events})

        # 4. A record whose schema id the registry does not know, among a's changelog records.
        producer = Producer({"bootstrap.servers": site_a.bootstrap, "enable.idempotence": True})
        producer.produce(changelog_a, value=b"\x00" + UNKNOWN_ID.to_bytes(4, "big") + b"\x02", key=b"bogus",
                         partition=0)
        assert producer.flush(30) == 0

        # 5. Site a's region, restarted, loads its Confluent-framed changelog and answers the same values.
        region_a.stop()
        restarted = RegionProcess(sites.path_a, tmp_path / "region-a-2.log")
        procs.append(restarted)
        restarted.wait_ready(120)
        got = RegionClient([restarted.url]).get_all("orders", [*sorted(expected), "bogus"])
        assert {k: (e or {}).get("value") for k, e in got.items()} == {**expected, "bogus": None}
        dead = wait_for(lambda: dead_letters(site_a.bootstrap, sites.cfg_a.topics.region_dead_letter()),
                        timeout_s=60, what="the unreadable changelog record dead-lettered")
        [letter] = [d for d in dead if d["source_topic"] == changelog_a]
        assert letter["key"] == b"bogus" and letter["error_class"] == "UnknownSchema"
        assert f"schema id {UNKNOWN_ID}" in letter["reason"], letter["reason"]
    finally:
        for proc in reversed(procs):
            proc.stop()


def dead_letters(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Every dead letter of ``topic``, all its partitions."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "sluice-test-dead-letters"})
    try:
        partitions = len(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
    finally:
        consumer.close()
    codec = get_codec()
    return [codec.decode_as("DeadLetter", value) for _, _, value in read_topic(bootstrap, topic, partitions) if value]


def test_an_unreachable_registry_stops_the_region_start_naming_the_subject(site_a: Site, unique_prefix: str,
                                                                        tmp_path: Path) -> None:
    """serializer: confluent with no registry at the URL: the region service does not start; its error names the
    registry and the changelog topic's subject it could not register (no registry process needed)."""
    sites = write_two_sites(tmp_path, site_a.bootstrap, unique_prefix, a={
        "serializer": "confluent", "schema_registry": {"url": "http://127.0.0.1:9", "timeout_s": 2},
        "regions": [{"name": "orders", "buckets": BUCKETS}],
    }, b={"regions": [{"name": "orders", "buckets": BUCKETS}]})
    subject = f"{sites.cfg_a.topics.region_changelog('orders')}-value"
    region = RegionProcess(sites.path_a, tmp_path / "region-a.log", wait=False)
    try:
        wait_for(lambda: region.proc.poll() is not None, timeout_s=120, what="the region service to refuse to start")
        assert region.proc.returncode != 0
        log = region.log_path.read_text()
        assert subject in log and "http://127.0.0.1:9" in log, log[-3000:]
    finally:
        region.stop()


def test_a_confluent_site_writes_another_sites_events_under_its_own_header(
        site_a: Site, unique_prefix: str, registry: EmbeddedRegistry, tmp_path: Path) -> None:  # noqa: F811
    """The other way round: site a single-object, site b confluent.  Each of a's events reaches b's changelog
    once, its body as a wrote it under b's own header (the id of b's changelog subject), which a plain
    AvroDeserializer consumer reads."""
    sites = write_two_sites(tmp_path, site_a.bootstrap, unique_prefix, a={
        "regions": [{"name": "orders", "buckets": BUCKETS, "gateway_senders": ["orders-to-b"]}],
        "gateway_senders": [{"id": "orders-to-b", "remote_dsid": 2, "parallel": True, "batch_size": 20,
                             "batch_time_interval_ms": 20, "remote": remote(site_a.bootstrap, unique_prefix, "b")}],
    }, b={
        "serializer": "confluent", "schema_registry": {"url": registry.url},
        "regions": [{"name": "orders", "buckets": BUCKETS}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    })
    changelog_a = sites.cfg_a.topics.region_changelog("orders")
    changelog_b = sites.cfg_b.topics.region_changelog("orders")
    procs: list[ServiceProcess] = []
    try:
        region_a, _region_b = start_two_regions(sites.path_a, sites.path_b, tmp_path, procs, ready_s=120)
        procs += [ReceiverProcess(sites.path_b, tmp_path / "receiver-b.log"),
                  SenderProcess(sites.path_a, "orders-to-b", tmp_path / "sender-a.log")]
        RegionClient([region_a.url]).put_all("orders", {f"k{i}": {"n": i} for i in range(KEYS)})
        records = read_confluent(site_a.bootstrap, changelog_b, registry.url, KEYS, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()
    entry_id = SchemaRegistryClient({"url": registry.url}).get_latest_version(f"{changelog_b}-value").schema_id
    assert {schema_id for schema_id, _, _ in records} == {entry_id}
    assert sorted(key for _, key, _ in records) == sorted(f"k{i}" for i in range(KEYS))
    assert {json.loads(event["value"])["n"] for _, _, event in records} == set(range(KEYS))
    assert all(event["origin_dsid"] == 1 for _, _, event in records)
    # Every record of b's changelog is one of a's events, once; a's own changelog stayed single-object.
    applied = [value for _, _, value in read_topic(site_a.bootstrap, changelog_b, BUCKETS) if value]
    assert len(applied) == KEYS and all(value[0] == 0 for value in applied)
    codec = get_codec()
    mine = [value for _, _, value in read_topic(site_a.bootstrap, changelog_a, BUCKETS) if value]
    assert len(mine) == KEYS and all(value[:HEADER_BYTES] == codec.header("EntryEvent") for value in mine)
    # Read back through Sluice's own reader of either framing: b holds exactly a's events, each once.
    frames = Frames(codec, SchemaRegistryConnection(url=registry.url))
    b_events = [EntryEvent.from_record(frames.decode_as("EntryEvent", value)) for value in applied]
    a_events = [EntryEvent.from_record(codec.decode_as("EntryEvent", value)) for value in mine]
    assert sorted(e.event_id for e in b_events) == sorted(e.event_id for e in a_events)
    assert {e.key: e.value for e in b_events} == {e.key: e.value for e in a_events}
