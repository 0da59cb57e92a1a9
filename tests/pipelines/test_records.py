"""Spark's Kafka source and Avro functions read Sluice records as the Python codec does, refusals included."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import fastavro
import pytest

from sluice.client import RegionClient
from sluice.core.codec import get_codec, schema_dir
from sluice.core.errors import CodecError
from sluice.core.events import EntryEvent
from sluice.core.kafka import make_consumer, read_to_end
from sluice.core.processes import RegionProcess
from sluice.pipelines.records import decode, writer_versions
from sluice.pipelines.session import read_topics

from pipelinekit import encode, entry_event, produce, write_site

pytestmark = pytest.mark.timeout(180)


def _spark_rows(spark: Any, cfg: Any, topic: str) -> dict[tuple[int, int], Any]:
    records = read_topics(spark, cfg.kafka, [topic], stream=False)
    return {(r["partition"], r["offset"]): r
            for r in decode(records, "value", "EntryEvent", record="event").collect()}


def _python_records(cfg: Any, topic: str, partitions: int) -> dict[tuple[int, int], bytes]:
    consumer = make_consumer(cfg.kafka.client_settings(), None)
    try:
        return {(m.partition(), m.offset()): m.value()
                for p in range(partitions) for m in read_to_end(consumer, topic, p)}
    finally:
        consumer.close()


def test_a_region_services_changelog_decodes_into_the_codecs_values(spark: Any, site_a: Any, unique_prefix: str,
                                                                   tmp_path: Path) -> None:
    """Every record a real region service wrote (put, put_all, invalidate, destroy, remove_all: its
    hand-written Avro encoder) decodes in Spark into typed columns holding what the codec reads."""
    cfg = write_site(tmp_path / "site.yaml", site="a", dsid=1, bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), regions={"orders": 2})
    with RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log") as region:
        region.wait_ready()
        with RegionClient(region.url) as client:
            client.put("orders", "a", {"n": 1})
            client.put("orders", "a", {"n": 2}, callback_argument="why")
            client.put_all("orders", {f"k{i}": {"i": i} for i in range(5)})
            client.invalidate("orders", "k1")
            client.destroy("orders", "k2")
            client.remove_all("orders", ["k3", "k4"])
    topic = cfg.topics.region_changelog("orders")
    python = _python_records(cfg, topic, 2)
    rows = _spark_rows(spark, cfg, topic)
    assert set(rows) == set(python) and len(rows) == 11
    codec = get_codec()
    for position, raw in python.items():
        event = EntryEvent.from_record(codec.decode_as("EntryEvent", raw))
        row = rows[position]
        assert row["corrupt"] is None
        got = row["event"]
        assert (got["region"], got["key"], got["operation"], got["value"], got["value_encoding"],
                got["callback_argument"], got["possible_duplicate"], got["origin_dsid"], tuple(got["visited_dsids"]),
                got["bucket"]) == (event.region, event.key, event.operation.value, event.value, event.value_encoding,
                                   event.callback_argument, event.possible_duplicate, event.origin_dsid,
                                   event.visited_dsids, event.bucket)
        assert (got["event_id"]["member_id"], got["event_id"]["thread_id"], got["event_id"]["sequence_id"]) == (
            event.event_id.member_id, event.event_id.thread_id, event.event_id.sequence_id)
        version = got["version"]
        assert (version["dsid"], int(version["timestamp"].timestamp() * 1000), version["entry_version"],
                version["member_id"]) == (event.version.dsid, event.version.timestamp, event.version.entry_version,
                                          event.version.member_id)
        assert int(got["event_time"].timestamp() * 1000) == event.event_time
        transaction = None if got["transaction"] is None else (got["transaction"]["id"], got["transaction"]["last"])
        assert transaction == event.transaction
    operations = sorted(r["event"]["operation"] for r in rows.values())
    assert operations == sorted(["CREATE", "UPDATE", *["PUTALL_CREATE"] * 5, "INVALIDATE", "DESTROY",
                                 *["REMOVEALL_DESTROY"] * 2])


def _older_entry_event(event: EntryEvent) -> bytes:
    """``event`` as a release with EntryEvent v1 (no ``transaction`` field) wrote it."""
    old = json.loads((schema_dir() / "history" / "EntryEvent.v1.avsc").read_text())
    older = [v for v in writer_versions("EntryEvent") if not v.current and v.schema == old]
    assert older, "avro/history/EntryEvent.v1.avsc is a version Spark reads"
    body = io.BytesIO()
    record = {k: v for k, v in event.to_record().items() if k in {f["name"] for f in old["fields"]}}
    fastavro.schemaless_writer(body, fastavro.parse_schema(copy.deepcopy(old)), record)
    return b"\xc3\x01" + older[0].fingerprint + body.getvalue()


def test_refused_records_get_the_codecs_reason_and_older_versions_read(spark: Any, site_a: Any, unique_prefix: str,
                                                                       tmp_path: Path) -> None:
    """A record of an older EntryEvent version reads into the current columns (new fields at their
    defaults); each kind of corrupt record gets a null event and, word for word, the reason the
    Python codec gives; none of them fails the query."""
    cfg = write_site(tmp_path / "site.yaml", site="a", dsid=1, bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), regions={"orders": 1})
    topic = cfg.topics.region_changelog("orders")
    event = entry_event("orders", "k", 1, buckets=1, value=b'{"v": 1}')
    good = encode("EntryEvent", event.to_record())
    removal = encode("RemovalRecord", {"queue_id": "q", "queue_partition": 0, "batch_id": 1, "last_removed_offset": 0,
                                       "last_event_id": None, "removed_count": 1, "removed_at": 1})
    samples = {
        "good": good,
        "older": _older_entry_event(event),
        "no value": None,
        "short": b"\xc3\x01\x00",
        "marker": b"{}" + good[2:],
        "other schema": removal,
        "unknown fingerprint": b"\xc3\x01" + bytes(8) + good[10:],
        "truncated": good[:-12],
    }
    positions = produce(site_a.bootstrap, [(topic, name.encode(), value, 0) for name, value in samples.items()])
    rows = _spark_rows(spark, cfg, topic)
    codec = get_codec()
    for (name, value), position in zip(samples.items(), positions):
        row = rows[(position.partition, position.offset)]
        try:
            codec.decode_as("EntryEvent", value)
            reason = None
        except CodecError as exc:
            reason = str(exc).split(":")[0] if name == "truncated" else str(exc)
        assert row["corrupt"] == reason, name
        assert (row["event"] is None) == (reason is not None), name
    older = rows[(positions[1].partition, positions[1].offset)]["event"]
    assert (older["key"], older["value"], older["transaction"]) == ("k", b'{"v": 1}', None)
