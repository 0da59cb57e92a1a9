"""Queue records of the previous QueuedEvent version and the current one, read by today's dispatcher
(issue 18: a queue written before an upgrade is still delivered after it)."""

from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Producer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from sluice.admin.cli import queue_status
from sluice.core.codec import MARKER, get_codec, schema_dir
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import FLAG_POSSIBLE_DUPLICATE, entry_event_body, queued_event

from recording_listener import read_offers
from regionkit import DispatcherProcess, queue_size, write_aeq_site
from waiting import read_until

pytestmark = pytest.mark.timeout(300)

#: How long the dispatcher may take to deliver every record written, and its status to show the queue empty.
DELIVERY_S = 90
DRAIN_S = 30

PARTITIONS = 2
PER_VERSION = 30


def _v2_record(event: EntryEvent, partition: int, offset: int) -> bytes:
    """A QueuedEvent as written before ``flags`` existed: fastavro with avro/history/QueuedEvent.v2.avsc."""
    schema = fastavro.parse_schema(json.loads((schema_dir() / "history" / "QueuedEvent.v2.avsc").read_text()),
                                   named_schemas={})
    buf = io.BytesIO()
    buf.write(MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO")))
    fastavro.schemaless_writer(buf, schema, {"queue_id": "q", "changelog_partition": partition,
                                             "changelog_offset": offset, "enqueued_at": event.event_time,
                                             "event": event.to_record()})
    return buf.getvalue()


def _v3_record(event: EntryEvent, partition: int, offset: int) -> bytes:
    """A QueuedEvent as the region service writes it today: ``flags`` first, the event's body after."""
    flags = FLAG_POSSIBLE_DUPLICATE if event.possible_duplicate else 0
    return queued_event(get_codec().header("QueuedEvent"), flags, "q", partition, offset, event.event_time,
                        entry_event_body(event))


def _recording_queue_site(site_a: Any, unique_prefix: str, tmp_path: Path, batch_size: int) -> tuple[Path, Any]:
    """A site with queue "q" of PARTITIONS partitions, its listener recording offers to the returned log."""
    log = tmp_path / "offers.jsonl"
    queue = {"id": "q", "parallel": False, "dispatcher_threads": PARTITIONS, "batch_size": batch_size,
             "listener": {"type": "python", "class_path": "recording_listener:RecordingListener",
                          "settings": {"path": str(log)}}}
    cfg = write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                         prefix=site_a.topic_prefix(unique_prefix), queue=queue)
    return log, cfg


def test_a_queue_of_previous_version_records_then_current_ones_is_delivered_once_in_order(
    site_a, unique_prefix, tmp_path: Path
) -> None:
    """Each partition holds QueuedEvent v2 records (no flags), then v3 ones; a dispatcher started on it
    delivers every event once, in offset order, with possibleDuplicate as each record says it (v2: its
    event's own flag; v3: the flags field), and the queue drains."""
    log, cfg = _recording_queue_site(site_a, unique_prefix, tmp_path, batch_size=7)
    member = f"w-{uuid.uuid4().hex[:6]}"
    now_ms = int(time.time() * 1000)
    expected: dict[int, list[tuple[str, int, bool]]] = {p: [] for p in range(PARTITIONS)}
    # Idempotent: a produce retried (the topic's leader not known yet) keeps its place in the partition.
    producer = Producer({"bootstrap.servers": site_a.bootstrap, "enable.idempotence": True})
    seq = 0
    for version, write in (("v2", _v2_record), ("v3", _v3_record)):
        for p in range(PARTITIONS):
            for i in range(PER_VERSION):
                duplicate = i % 4 == 1
                event = EntryEvent("orders", f"{version}-p{p}-k{i}", Operation.UPDATE, b'{"i": %d}' % i,
                                   EventID(member, p, seq), VersionTag(1, now_ms, i + 1, member), 1, p, now_ms,
                                   possible_duplicate=duplicate)
                producer.produce(cfg.topics.queue("q"), write(event, p, len(expected[p])), event.key.encode(),
                                 partition=p)
                expected[p].append((event.key, seq, duplicate))
                seq += 1
    assert producer.flush(30) == 0

    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        total = sum(len(v) for v in expected.values())
        read_until(lambda: [e for o in read_offers(str(log)) if o["accepted"] for e in o["events"]],
                   lambda delivered: len(delivered) >= total, timeout_s=DELIVERY_S, poll_s=0.2)
        delivered = [e for o in read_offers(str(log)) if o["accepted"] for e in o["events"]]
        for p in range(PARTITIONS):
            got = [(e[2], e[6], e[7]) for e in delivered if e[0] == p]
            assert [e[1] for e in delivered if e[0] == p] == list(range(len(expected[p]))), f"partition {p} offsets"
            assert got == expected[p], f"partition {p}: events or their possibleDuplicate differ"
        read_until(lambda: queue_size(cfg, "q"), lambda size: size == 0, timeout_s=DRAIN_S, poll_s=0.2)
        assert sum(r.size for r in queue_status(cfg, "q")) == 0
        print(f"\n{total} events over {PARTITIONS} partitions ({PER_VERSION} v2 then {PER_VERSION} v3 records each), "
              "each delivered once, in order")
    finally:
        dispatcher.stop()


def test_a_queue_written_in_transactions_is_delivered_once_and_drains_past_its_commit_markers(
    site_a, unique_prefix, tmp_path: Path
) -> None:
    """Queue records written in Kafka transactions, a commit marker after each and one transaction aborted:
    the dispatcher delivers every committed event once, in order, never an aborted one, and the queue's size
    reaches 0 although the last offset of each partition is a marker, not an event."""
    log, cfg = _recording_queue_site(site_a, unique_prefix, tmp_path, batch_size=4)
    member = f"w-{uuid.uuid4().hex[:6]}"
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": site_a.bootstrap, "transactional.id": f"test-{member}"})
    producer.init_transactions(30)
    committed: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    seq = 0
    for tx in range(4):
        producer.begin_transaction()
        keys: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
        for p in range(PARTITIONS):
            for i in range(3):
                key = f"tx{tx}-p{p}-k{i}"
                event = EntryEvent("orders", key, Operation.UPDATE, b'{"tx": %d}' % tx, EventID(member, p, seq),
                                   VersionTag(1, now_ms, tx + 1, member), 1, p, now_ms)
                producer.produce(cfg.topics.queue("q"), _v3_record(event, p, seq), key.encode(), partition=p)
                keys[p].append(key)
                seq += 1
        if tx == 2:
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
            for p in range(PARTITIONS):
                committed[p] += keys[p]

    dispatcher = DispatcherProcess(tmp_path / "site.yaml", "q", tmp_path / "dispatcher.log")
    try:
        total = sum(len(v) for v in committed.values())
        read_until(lambda: sum(len(o["events"]) for o in read_offers(str(log)) if o["accepted"]),
                   lambda count: count >= total, timeout_s=DELIVERY_S, poll_s=0.2)
        delivered = [e for o in read_offers(str(log)) if o["accepted"] for e in o["events"]]
        for p in range(PARTITIONS):
            assert [e[2] for e in delivered if e[0] == p] == committed[p], f"partition {p}"
        read_until(lambda: queue_size(cfg, "q"), lambda size: size == 0, timeout_s=DRAIN_S, poll_s=0.2)
        rows = queue_status(cfg, "q")
        assert sum(r.size for r in rows) == 0, [(r.partition, r.size, r.end) for r in rows]
        print(f"\n{total} committed events delivered once over {PARTITIONS} partitions, the aborted ones never; "
              f"queue ends {[r.end for r in rows]}, size 0")
    finally:
        dispatcher.stop()
