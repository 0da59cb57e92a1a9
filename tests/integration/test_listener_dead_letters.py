"""Dead letters of a listener (issue 17): an event that can never be written does not wedge its queue.

First the SQL write-behind on a real PostgreSQL, in process: which refusals
are an event's own fault (a dead letter) and which may pass (the batch is
offered again); and the Kafka forwarder on a real broker, whose topic refuses
a record too large for it.  Then the whole path with real processes: the region
service, the dispatcher running the shipped ``type: sql`` listener, a real
broker and PostgreSQL; one poisoned event among good ones ends in the
queue's dead-letter topic with the database's reason, the good ones in the
table, and the queue drains.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.admin.cli import queue_status
from sluice.client import RegionClient
from sluice.core.asyncevent import Accepted, AsyncEvent
from sluice.core.codec import get_codec
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import NewTopic, make_admin, wait_futures
from sluice.listeners.kafka_forwarder import KafkaForwarderListener
from sluice.listeners.sql import SqlWriteBehindListener, live_view_name

from pg import PostgresServer
from regionkit import DispatcherProcess, RegionProcess, read_topic, write_aeq_site
from waiting import read_until

pytestmark = pytest.mark.timeout(180)

#: How long the queue may take to drain past the dead letter, the table catching up.
DRAIN_S = 60

Op = Operation
DLQ = "sluice.queue.q.dlq"


def event(key: str, value: Any, version: int = 1, *, raw: bytes | None = None) -> AsyncEvent:
    data = raw if raw is not None else json.dumps(value).encode()
    entry = EntryEvent("orders", key, Op.CREATE if version == 1 else Op.UPDATE, data, EventID("m", 1, version),
                       VersionTag(1, 1_000 + version, version), 1, 0, 1_000 + version)
    return AsyncEvent(entry, "q", 0, version, False)


@pytest.fixture
def listener(postgres: PostgresServer) -> Iterator[Callable[..., SqlWriteBehindListener]]:
    """``listener(**settings)``: an initialised listener on a table of its own, in a host that keeps dead letters."""
    made: list[SqlWriteBehindListener] = []

    def make(**settings: Any) -> SqlWriteBehindListener:
        settings.setdefault("url", postgres.url)
        settings.setdefault("table", postgres.unique_name("dl"))
        instance = SqlWriteBehindListener()
        instance.init({"settings": settings, "queue_id": postgres.unique_name("q"), "dead_letter_topic": DLQ})
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()


def live(postgres: PostgresServer, table: str) -> dict[str, Any]:
    with postgres.connect() as conn:
        return dict(conn.execute(f'SELECT "key", "value" FROM "{live_view_name(table)}"').fetchall())


def test_postgresql_refusals_of_an_events_data_are_dead_letters(
        postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener]) -> None:
    """On PostgreSQL, a value its column's type refuses, a number out of its column's range, a NUL character in a
    JSON value and a key too long for the primary key's index are each a dead letter naming the SQLSTATE; the other
    rows of the batch are written in the same offer."""
    sql = listener(columns={"qty": {"path": "qty", "type": "integer"}})
    assert sql.settings is not None
    long_key = os.urandom(6000).hex()  # incompressible: beyond a btree index row's 2704 bytes
    batch = [event("a", {"qty": 1}), event("lots", {"qty": "lots"}), event("big", {"qty": 10**20}),
             event("b", {"qty": 2}), event("nul", None, raw=b'{"qty": 3, "note": "\\u0000"}'),
             event(long_key, {"qty": 4}), event("c", {"qty": 5})]
    result = sql.process_events(batch)
    assert isinstance(result, Accepted), result
    letters = {d.event.key: d for d in result.dead_letters}
    assert set(letters) == {"lots", "big", "nul", long_key}
    assert "SQLSTATE 22P02" in letters["lots"].reason and letters["lots"].error_class == "InvalidTextRepresentation"
    assert "SQLSTATE 22003" in letters["big"].reason
    assert "SQLSTATE 22P05" in letters["nul"].reason
    assert "SQLSTATE 54000" in letters[long_key].reason
    assert {k: v["qty"] for k, v in live(postgres, sql.settings.table).items()} == {"a": 1, "b": 2, "c": 5}


def test_a_lock_timeout_on_postgresql_is_offered_again_not_dead_lettered(
        postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener]) -> None:
    """A row locked by another transaction past timeout_s may pass: the batch is refused and no event is a dead
    letter; once the lock is gone the same batch is written."""
    sql = listener(timeout_s=0.5)
    assert sql.settings is not None
    assert sql.process_events([event("k", {"n": 1})]) is True
    batch = [event("k", {"n": 2}, 2)]
    with postgres.connect() as holder:
        with holder.transaction():
            holder.execute(f'SELECT 1 FROM "{sql.settings.table}" WHERE "key" = %s FOR UPDATE', ("k",))
            assert sql.process_events(batch) is False
    assert sql.process_events(batch) is True
    assert live(postgres, sql.settings.table) == {"k": {"n": 2}}
    assert sql.stats.events_dead_lettered == 0


def test_a_record_too_large_to_forward_is_a_dead_letter(site_a: Any, unique_prefix: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """On a real broker, the forwarder accepts a batch holding one record over the producer's message.max.bytes
    (1 MB) naming that event as a dead letter, and the other records are on the topic.  A topic whose own
    max.message.bytes refuses a smaller record refuses the whole request, so that batch is offered again."""
    topic, strict = f"{unique_prefix}down", f"{unique_prefix}down-strict"
    admin = make_admin({"bootstrap.servers": site_a.bootstrap})
    wait_futures(admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1),
                                      NewTopic(strict, num_partitions=1, replication_factor=1,
                                               config={"max.message.bytes": "2000"})]), "creating the topics")
    forwarders = []
    for name in (topic, strict):
        forwarder = KafkaForwarderListener()
        forwarder.init({"settings": {"topic": name, "flush_timeout_s": 20}, "queue_id": "q", "site": "a",
                        "dsid": 1, "kafka": {"bootstrap.servers": site_a.bootstrap}, "topic_prefix": "",
                        "dead_letter_topic": DLQ})
        forwarders.append(forwarder)
    try:
        batch = [event("a", {"n": 1}), event("huge", {"pad": "x" * 1_200_000}), event("b", {"n": 2})]
        deadline = time.monotonic() + 60
        result: Any = False
        while result is False and time.monotonic() < deadline:  # the new topic's leader may take a moment
            result = forwarders[0].process_events(batch)
        assert isinstance(result, Accepted), result
        assert [(d.event.key, d.error_class) for d in result.dead_letters] == [("huge", "MSG_SIZE_TOO_LARGE")]
        keys = [key for _, _, key in read_keys(site_a.bootstrap, topic)]
        assert keys.count(b"a") >= 1 and keys.count(b"b") >= 1 and b"huge" not in keys
        small_batch = [event("a", {"n": 1}), event("big", {"pad": "x" * 8000})]
        caplog.clear()
        assert forwarders[1].process_events(small_batch) is False
        assert "Message size too large" in caplog.text and forwarders[1].offers_failed == 1
    finally:
        for forwarder in forwarders:
            forwarder.close()


def read_keys(bootstrap: str, topic: str) -> list[tuple[int, int, bytes | None]]:
    """(partition, offset, key) of every record of a one-partition topic."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "sluice-test-keys", "enable.auto.commit": False})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        consumer.assign([TopicPartition(topic, 0, low)])
        found: list[tuple[int, int, bytes | None]] = []
        deadline = time.monotonic() + 30
        while len(found) < high - low and time.monotonic() < deadline:
            found += [(m.partition(), m.offset(), m.key()) for m in consumer.consume(100, 0.2) if m.error() is None]
        return found
    finally:
        consumer.close()


def test_a_poisoned_event_goes_to_the_queues_dead_letter_topic_and_the_queue_drains(
        site_a: Any, unique_prefix: str, postgres: PostgresServer, tmp_path: Path) -> None:
    """With the real dispatcher process, a real broker and PostgreSQL: a batch holding one event its column refuses,
    then more good events.  The good events land in the table, the poisoned one is in the queue's .dlq with the
    database's reason, and the queue drains: every event delivered once (no batch offered again), none lost."""
    table = postgres.unique_name("orders")
    queue = {"id": "wb", "parallel": False, "dispatcher_threads": 1, "batch_size": 100,
             "batch_time_interval_ms": 200,
             "listener": {"type": "sql", "settings": {"url": postgres.url, "table": table,
                                                      "columns": {"qty": {"path": "qty", "type": "integer"}}}}}
    cfg = write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                         prefix=site_a.topic_prefix(unique_prefix), queue=queue, buckets=2)
    with RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log") as region, \
            DispatcherProcess(tmp_path / "site.yaml", "wb", tmp_path / "dispatcher.log") as dispatcher:
        region.wait_ready()
        client = RegionClient([region.url], member_id=f"dl-{uuid.uuid4().hex[:6]}")
        # One putAll: its events reach the queue together, so they share a batch with the poisoned one.
        first = {f"g{i:02d}": {"qty": i} for i in range(10)}
        first["poisoned"] = {"qty": "lots"}
        client.put_all("orders", first)
        for i in range(10, 20):
            client.put("orders", f"g{i:02d}", {"qty": i})
        expected = {f"g{i:02d}": {"qty": i} for i in range(20)}

        rows = read_until(lambda: queue_status(cfg, "wb"),
                          lambda rows: sum(r.size for r in rows) == 0 and sum(r.events for r in rows) == 21
                          and live(postgres, table) == expected, timeout_s=DRAIN_S, poll_s=0.3)
        if not (sum(r.size for r in rows) == 0 and sum(r.events for r in rows) == 21
                and live(postgres, table) == expected):
            pytest.fail(f"the queue did not drain: sizes {[r.size for r in rows]}, events "
                        f"{[r.events for r in rows]}, redeliveries {[r.redeliveries for r in rows]}, table has "
                        f"{len(live(postgres, table))} rows; dispatcher log:\n{dispatcher.log_tail()}")
        assert len(read_topic(site_a.bootstrap, cfg.topics.queue("wb"), sum(1 for _ in rows))) == 21
        assert sum(r.redeliveries for r in rows) == 0, "a batch was offered more than once"
        assert sum(r.dead_lettered for r in rows) == 1

        letters = [get_codec().decode_as("DeadLetter", value)
                   for _, _, value in read_topic(site_a.bootstrap, cfg.topics.dead_letter("wb"), 1)]
        assert len(letters) == 1, letters
        letter = letters[0]
        assert letter["key"] == b"poisoned" and letter["event"]["key"] == "poisoned"
        assert json.loads(letter["value"]) == {"qty": "lots"}
        assert letter["error_class"] == "InvalidTextRepresentation"
        assert "invalid input syntax for type bigint" in letter["reason"] and "22P02" in letter["reason"]
        assert letter["source_topic"] == cfg.topics.queue("wb")
        assert letter["service"].startswith(f"dispatcher {dispatcher.member_id}")
        assert "poisoned" not in live(postgres, table)
