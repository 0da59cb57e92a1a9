"""A bucket loads a changelog holding records of this release and of an earlier EntryEvent schema.

The loader reads records of the current schema with the codec module's
EntryEvent reader and hands any other version to the codec, which resolves
it (avro/history); both must give the same entries.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import fastavro
import pytest
from confluent_kafka import Producer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from sluice.client import RegionClient
from sluice.core.codec import MARKER, get_codec, schema_dir
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import entry_event_body
from sluice.core.kafka import partition_for_key

from regionkit import RegionProcess, write_site

pytestmark = pytest.mark.timeout(120)


def event(key: str, value: dict[str, object], sequence: int) -> EntryEvent:
    return EntryEvent("orders", key, Operation.CREATE, json.dumps(value).encode(), EventID("earlier", 1, sequence),
                      VersionTag(1, 1_700_000_000_000 + sequence, 1, "earlier"), 1, partition_for_key(key.encode(), 8),
                      1_700_000_000_000 + sequence)


def v1_record(ev: EntryEvent) -> bytes:
    """``ev`` as a release writing avro/history/EntryEvent.v1.avsc (no ``transaction``) wrote it."""
    schema = fastavro.parse_schema(json.loads((schema_dir() / "history" / "EntryEvent.v1.avsc").read_text()),
                                   named_schemas={})
    record = {k: v for k, v in ev.to_record().items() if k != "transaction"}
    buf = io.BytesIO()
    buf.write(MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO")))
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def test_records_of_an_earlier_schema_and_of_this_one_load_the_same(site_a, unique_prefix, tmp_path: Path):
    prefix = site_a.topic_prefix(unique_prefix)
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix)
    topic = cfg.topics.region_changelog("orders")
    old = {f"old-{i}": {"i": i, "v": 1} for i in range(20)}
    new = {f"new-{i}": {"i": i, "v": 2} for i in range(20)}
    producer = Producer({"bootstrap.servers": site_a.bootstrap})
    header = get_codec().header("EntryEvent")
    for n, (key, value) in enumerate(old.items()):
        ev = event(key, value, n)
        producer.produce(topic, v1_record(ev), key.encode(), partition=ev.bucket)
    for n, (key, value) in enumerate(new.items(), start=len(old)):
        ev = event(key, value, n)
        producer.produce(topic, header + entry_event_body(ev), key.encode(), partition=ev.bucket)
    assert producer.flush(30) == 0

    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    try:
        region.wait_ready()
        entries = RegionClient([region.url], retry_for_s=30).get_all("orders", [*old, *new])
        assert {k: (e or {}).get("value") for k, e in entries.items()} == {**old, **new}
        assert region.stats()["dead_lettered"] == 0
    finally:
        region.stop()
