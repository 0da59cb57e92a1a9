"""The Kafka forwarder against real brokers, and the faust-streaming example reading what it wrote.

Each test drives the listener as the dispatcher does: ``init(config)``, then
``process_events(batch)`` — the same batch again after ``False`` — then
``close()``.  Records are read back with a plain assign() consumer (no group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sluice.broker import BrokerProcess
from sluice.core.asyncevent import AsyncEvent
from sluice.core.codec import get_codec
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import (
    OFFSET_BEGINNING,
    Message,
    NewTopic,
    TopicPartition,
    make_admin,
    make_consumer,
    make_producer,
    partition_for_key,
    wait_futures,
)
from sluice.listeners.kafka_forwarder import KafkaForwarderListener

from waiting import read_until

if TYPE_CHECKING:
    from conftest import Site

ROOT = Path(__file__).resolve().parents[2]
FAUST_APP = ROOT / "deploy" / "downstream" / "faust_app.py"
PARTITIONS = 4
#: Offers of one batch before a test gives up (the dispatcher itself retries forever).
OFFERS_MAX = 20


def make_event(key: str, seq: int, *, region: str = "orders", op: Operation = Operation.UPDATE,
               dup: bool = False) -> AsyncEvent:
    now_ms = int(time.time() * 1000)
    entry = EntryEvent(
        region=region, key=key, operation=op,
        value=None if op.removes_value else json.dumps({"n": seq}).encode(),
        event_id=EventID("member-1", 7, seq), version=VersionTag(1, now_ms, seq),
        origin_dsid=1, bucket=partition_for_key(key.encode(), 8), event_time=now_ms,
    )
    return AsyncEvent(entry, "orders-out", entry.bucket, seq, dup)


def a_batch(first_seq: int = 1) -> list[AsyncEvent]:
    """Creates, updates and a destroy over two regions and three keys (one writer thread)."""
    plan = [("o-1", "orders", Operation.CREATE), ("o-2", "orders", Operation.CREATE),
            ("c-1", "customers", Operation.CREATE), ("o-1", "orders", Operation.UPDATE),
            ("c-1", "customers", Operation.UPDATE), ("o-2", "orders", Operation.DESTROY)]
    return [make_event(key, first_seq + i, region=region, op=op) for i, (key, region, op) in enumerate(plan)]


def create_topics(bootstrap: str, *topics: str, partitions: int = PARTITIONS) -> None:
    admin = make_admin({"bootstrap.servers": bootstrap})
    wait_futures(admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics]),
                 "creating topics")


def start_listener(bootstrap: str, topic_prefix: str, **settings: Any) -> KafkaForwarderListener:
    listener = KafkaForwarderListener()
    listener.init({"settings": settings, "queue_id": "orders-out", "site": "a", "dsid": 1,
                   "kafka": {"bootstrap.servers": bootstrap}, "topic_prefix": topic_prefix})
    return listener


def offer_until_accepted(listener: KafkaForwarderListener, batch: list[AsyncEvent]) -> int:
    """Offer the batch as the dispatcher does until accepted; the number of offers it took."""
    for offer in range(1, OFFERS_MAX + 1):
        if listener.process_events(batch):
            return offer
    raise AssertionError(f"batch not accepted after {OFFERS_MAX} offers")


def read_records(bootstrap: str, topic: str, partitions: int = PARTITIONS, idle_s: float = 1.0,
                 timeout_s: float = 15.0) -> list[Message]:
    """Every record of the topic: read from the start until nothing more comes for ``idle_s`` after
    the first record (every caller's topic holds some; a broker just restarted may take longer than
    ``idle_s`` to answer the first fetch), or until ``timeout_s``.

    Not up to the high watermark: Tansu 0.6.0 reports it as the last batch's
    base offset + 1, short of the records of a multi-record batch.
    """
    consumer = make_consumer({"bootstrap.servers": bootstrap}, None, isolation_level="read_uncommitted")
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        out: list[Message] = []
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while (not out or time.monotonic() - quiet_since < idle_s) and time.monotonic() < deadline:
            msg = consumer.poll(0.1)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append(msg)
            quiet_since = time.monotonic()
        return out
    finally:
        consumer.close()


def headers_of(msg: Message) -> dict[str, str]:
    return {k: v.decode() for k, v in (msg.headers() or [])}


@pytest.mark.tansu
def test_batch_lands_keyed_avro_with_headers(any_site: Site, unique_prefix: str) -> None:
    """A forwarded batch lands per region topic, keyed by entry key on the murmur2 partition, Avro-decodable, with every header."""
    prefix = any_site.topic_prefix(unique_prefix)
    create_topics(any_site.bootstrap, f"{prefix}down.orders", f"{prefix}down.customers")
    listener = start_listener(any_site.bootstrap, prefix, topic="{topic_prefix}down.{region}", flush_timeout_s=10)
    batch = a_batch()
    try:
        assert listener.process_events(batch) is True
    finally:
        listener.close()

    codec = get_codec()
    by_id = {str(e.event_id): e for e in batch}
    seen: list[str] = []
    for region in ("orders", "customers"):
        for msg in read_records(any_site.bootstrap, f"{prefix}down.{region}"):
            headers = headers_of(msg)
            event = by_id[headers["sluice.event_id"]]
            assert EntryEvent.from_record(codec.decode_as("EntryEvent", msg.value())) == event.event
            assert msg.key() == event.key.encode()
            assert msg.partition() == partition_for_key(event.key.encode(), PARTITIONS)
            assert headers == {"sluice.queue": "orders-out", "sluice.operation": event.operation.value,
                               "sluice.region": region, "sluice.event_id": str(event.event_id),
                               "sluice.possible_duplicate": "false", "sluice.origin_dsid": "1"}
            assert msg.timestamp()[1] == event.event.event_time
            seen.append(headers["sluice.event_id"])
    assert sorted(seen) == sorted(by_id), "each event exactly once"
    # Per key, the queue's order holds.
    for key in ("o-1", "o-2", "c-1"):
        ids = [i for i in seen if by_id[i].key == key]
        assert ids == sorted(ids, key=lambda i: by_id[i].sequence_id)


@pytest.mark.serial  # a bound in seconds: runs alone (make test)
def test_missing_topic_fails_then_succeeds(site_a: Site, unique_prefix: str) -> None:
    """A topic that does not exist (no auto-create) fails the offer within flush_timeout_s; once created, the re-offer is accepted and every event lands once."""
    topic = site_a.topic_prefix(unique_prefix) + "down"
    listener = start_listener(site_a.bootstrap, "", topic=topic, flush_timeout_s=2)
    batch = a_batch()
    try:
        started = time.monotonic()
        assert listener.process_events(batch) is False
        took_s = time.monotonic() - started
        assert took_s < 2 + 1.5, f"the failed offer took {took_s:.1f} s"
        assert listener.process_events(batch) is False, "still no topic, still refused"
        create_topics(site_a.bootstrap, topic)
        offers = offer_until_accepted(listener, batch)
    finally:
        listener.close()
    records = read_records(site_a.bootstrap, topic)
    ids = Counter(headers_of(m)["sluice.event_id"] for m in records)
    assert ids == Counter(str(e.event_id) for e in batch), "nothing dropped, nothing twice"
    # Nothing was ever written before, so nothing is flagged.
    assert {headers_of(m)["sluice.possible_duplicate"] for m in records} == {"false"}
    print(f"\nfailed offer returned after {took_s:.2f} s; accepted on offer {offers} after the topic was created")


def test_stopped_broker_fails_then_succeeds(broker_factory: Callable[..., BrokerProcess], unique_prefix: str) -> None:
    """With the broker stopped the offer returns False; after a restart the same batch is accepted, nothing is lost, and every repeat is flagged possibleDuplicate."""
    broker = broker_factory(site="fwd")
    topic = unique_prefix + "down"
    create_topics(broker.bootstrap, topic)
    listener = start_listener(broker.bootstrap, "", topic=topic, flush_timeout_s=3)
    first, second = a_batch(1), a_batch(100)
    try:
        assert listener.process_events(first) is True
        broker.stop()
        started = time.monotonic()
        assert listener.process_events(second) is False
        assert time.monotonic() - started < 3 + 1.5
        broker.start()
        offers = offer_until_accepted(listener, second)
    finally:
        listener.close()
    records = read_records(broker.bootstrap, topic)
    assert_all_landed_repeats_flagged(records, first + second)
    print(f"\naccepted after the restart on offer {offers}; {len(records)} records for "
          f"{len(first) + len(second)} events")


def test_paused_broker_repeats_are_flagged(broker_factory: Callable[..., BrokerProcess], unique_prefix: str) -> None:
    """A broker frozen mid-offer fails it; records it takes in after resuming are written again by the re-offer, and those repeats are flagged possibleDuplicate."""
    broker = broker_factory(site="fwp")
    topic = unique_prefix + "down"
    create_topics(broker.bootstrap, topic)
    listener = start_listener(broker.bootstrap, "", topic=topic, flush_timeout_s=2)
    warmup, batch = a_batch(1), a_batch(100)
    try:
        assert listener.process_events(warmup) is True  # connected, producer id acquired
        broker.pause()
        try:
            assert listener.process_events(batch) is False
        finally:
            broker.resume()
        offers = offer_until_accepted(listener, batch)
    finally:
        listener.close()
    records = read_records(broker.bootstrap, topic)
    repeats = assert_all_landed_repeats_flagged(records, warmup + batch)
    print(f"\naccepted after resuming on offer {offers}; {len(records)} records for "
          f"{len(warmup) + len(batch)} events, {repeats} flagged repeats")


def assert_all_landed_repeats_flagged(records: list[Message], events: list[AsyncEvent]) -> int:
    """Every event is on the topic; every copy after an event's first is flagged.  The number of repeats."""
    ids = Counter(headers_of(m)["sluice.event_id"] for m in records)
    assert set(ids) == {str(e.event_id) for e in events}, "every event landed"
    seen: set[str] = set()
    repeats = 0
    for msg in records:  # offset order within each partition, and one key is in one partition
        headers = headers_of(msg)
        if headers["sluice.event_id"] in seen:
            repeats += 1
            assert headers["sluice.possible_duplicate"] == "true", f"unflagged repeat {headers}"
        seen.add(headers["sluice.event_id"])
    return repeats


# --- the faust-streaming downstream example ------------------------------------------------


def wait_for_line(log_path: Path, proc: subprocess.Popen[bytes], predicate: Callable[[str], bool],
                  timeout_s: float) -> str:
    def last_match() -> str | None:
        return next((line for line in reversed(log_path.read_text(errors="replace").splitlines()) if predicate(line)),
                    None)

    line = read_until(last_match, lambda line: line is not None or proc.poll() is not None, timeout_s=timeout_s,
                      poll_s=0.2)
    if line is not None:
        return line
    raise AssertionError(f"no such line within {timeout_s:.0f} s (worker exit code {proc.poll()}); "
                         f"log tail:\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-40:]))


def test_faust_worker_dedups_and_counts(site_a: Site, unique_prefix: str, tmp_path: Path) -> None:
    """The faust example, run as a real worker, applies each event once, drops the failover repeats, reports the undecodable record, and keeps per-region counts and the latest values."""
    prefix = site_a.topic_prefix(unique_prefix)
    topic = prefix + "down"
    create_topics(site_a.bootstrap, topic)
    listener = start_listener(site_a.bootstrap, "", topic=topic, flush_timeout_s=10)
    batch = a_batch()
    try:
        assert listener.process_events(batch) is True
        # A dispatcher failover re-offers the tail of the batch, flagged.
        replay = [AsyncEvent(e.event, e.queue_id, e.partition, e.offset, True) for e in batch[3:]]
        assert listener.process_events(replay) is True
    finally:
        listener.close()
    garbage = make_producer({"bootstrap.servers": site_a.bootstrap})
    garbage.produce(topic, key=b"o-1", value=b"not avro")
    assert garbage.flush(10) == 0

    log_path = tmp_path / "faust.log"
    env = dict(os.environ, SLUICE_DOWNSTREAM_BROKER=site_a.bootstrap, SLUICE_DOWNSTREAM_TOPIC=topic,
               SLUICE_DOWNSTREAM_APP_ID=f"{prefix}downstream", SLUICE_DOWNSTREAM_DATA_DIR=str(tmp_path / "faust"),
               SLUICE_DOWNSTREAM_REPORT_S="0.5", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(FAUST_APP), "worker", "-l", "info", "--without-web"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        ready = wait_for_line(log_path, proc, lambda line: "[^Worker]: Ready" in line, 60)
        ready_s = time.monotonic() - started
        expected = {"applied": 6, "repeats": 3, "undecodable": 1, "regions": {"customers": 2, "orders": 4},
                    "keys": 2}
        line = wait_for_line(log_path, proc, lambda line: "downstream stats" in line
                             and json.loads(line.split("downstream stats", 1)[1]) == expected, 30)
        done_s = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    assert text.count(" applied ") == 6 and text.count(" repeat ") == 3
    assert "NOT flagged possibleDuplicate" not in text
    assert "undecodable record " + topic in text
    assert ready and line
    print(f"\nfaust worker ready after {ready_s:.1f} s, all records processed after {done_s:.1f} s; "
          f"exit code {proc.returncode}")
