"""The queue loop's read path without a broker: records become events of their queued bytes (nothing
decoded but the flags), possibleDuplicate and the ``routed`` flag are taken from the record, the
``accepts`` hook sees only unrouted records, and unreadable records or event bodies are dead-lettered
with their reasons while everything else goes on."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fastavro
import pytest
import yaml
from fastavro.schema import fingerprint, to_parsing_canonical_form

from sluice.core import asyncevent
from sluice.core.asyncevent import AsyncEvent
from sluice.core.batching import Batch, PartitionBatcher
from sluice.core.codec import MARKER, get_codec, schema_dir
from sluice.core.config import load_config
from sluice.core.errors import MalformedRecord
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import FLAG_POSSIBLE_DUPLICATE, FLAG_ROUTED, entry_event_body, queued_event
from sluice.core.kafka import TopicPartition
from sluice.core.queueclean import APPLIED, APPLYING, CleanAudit
from sluice.core.queueloop import DesiredState, QueuePartition, QueuePrimary

QUEUE = "q"


class FakeMessage:
    """What the loop reads of a confluent-kafka Message."""

    def __init__(self, value: bytes | None, partition: int, offset: int, key: bytes | None = b"k") -> None:
        self._value, self._partition, self._offset, self._key = value, partition, offset, key

    def error(self) -> None:
        return None

    def value(self) -> bytes | None:
        return self._value

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def topic(self) -> str:
        return "a.queue.q"

    def headers(self) -> None:
        return None


class FakeProducer:
    """Acknowledges every record at once."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes | None]] = []

    def produce(self, topic: str, value: bytes, key: bytes | None = None, on_delivery: Any = None,
                **_: Any) -> None:
        self.records.append((topic, value, key))
        if on_delivery is not None:
            on_delivery(None, None)

    def flush(self, _timeout: float = 0) -> int:
        return 0

    def poll(self, _timeout: float = 0) -> int:
        return 0


class FakeConsumer:
    """Records the offsets committed."""

    def __init__(self) -> None:
        self.commits: list[list[tuple[int, int]]] = []
        self.positions: dict[int, int] = {}

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        self.commits.append([(tp.partition, tp.offset) for tp in offsets])

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.positions.get(tp.partition, -1001)) for tp in partitions]


class Loop(QueuePrimary):
    kind = "async-event-queue"


class Sender(Loop):
    """A kind of queue with a loop check: keeps events whose key does not start with "x"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def accepts(self, event: EntryEvent) -> bool:
        self.asked.append(event.key)
        return not event.key.startswith("x")


def make_loop(tmp_path: Path, cls: type[QueuePrimary] = Loop, **queue: Any) -> QueuePrimary:
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a."},
        "regions": [{"name": "orders", "buckets": 2, "async_event_queues": [QUEUE]}],
        "async_event_queues": [{"id": QUEUE, "parallel": True, "batch_size": 100,
                                "listener": {"type": "python", "class_path": "x:Y"}, **queue}],
    }))
    cfg = load_config(path)
    loop = cls(cfg, QUEUE, cfg.queue(QUEUE))
    loop._producer = FakeProducer()
    loop._consumer = FakeConsumer()  # type: ignore[assignment]
    for p in range(2):
        loop._partitions[p] = QueuePartition(tp=TopicPartition(loop.topic, p),
                                             batcher=PartitionBatcher(p, loop.policy), duplicate_below=0)
    return loop


def entry(key: str, seq: int, op: Operation = Operation.UPDATE) -> EntryEvent:
    return EntryEvent(region="orders", key=key, operation=op, value=b'{"n": %d}' % seq,
                      event_id=EventID("m", 1, seq), version=VersionTag(1, 1_700_000_000_000, seq, "m"),
                      origin_dsid=1, bucket=0, event_time=1_700_000_000_000)


def record(event: EntryEvent | bytes, flags: int = 0) -> bytes:
    body = event if isinstance(event, bytes) else entry_event_body(event)
    return queued_event(get_codec().header("QueuedEvent"), flags, QUEUE, 0, 5, 1_700_000_000_000, body)


def waiting(loop: QueuePrimary, partition: int = 0) -> Batch[AsyncEvent]:
    batch = loop._partitions[partition].batcher.take(0, force=True)
    assert batch is not None
    return batch


def dead_letters(loop: QueuePrimary) -> list[dict[str, Any]]:
    return [get_codec().decode_as("DeadLetter", value) for topic, value, _ in loop._producer.records
            if topic == loop.dlq_topic]


@pytest.fixture()
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    seen: list[bytes] = []
    real = asyncevent.decode_entry
    monkeypatch.setattr(asyncevent, "decode_entry", lambda body, pos=0: seen.append(body) or real(body, pos))
    return seen


def test_records_become_events_of_their_bytes_with_possible_duplicate_from_the_flag_or_the_offset(
        tmp_path: Path, decodes: list[bytes]) -> None:
    """Each record is an event of its queued body, not decoded; possibleDuplicate is the flag's bit, or
    set for offsets a previous primary may have offered (below ``duplicate_below``)."""
    loop = make_loop(tmp_path)
    loop._partitions[0].duplicate_below = 2
    values = [record(entry(f"k{i}", i), FLAG_POSSIBLE_DUPLICATE if i == 3 else 0) for i in range(5)]
    loop._read([FakeMessage(v, 0, i) for i, v in enumerate(values)], now_ms=0)
    batch = waiting(loop)
    assert [(e.offset, e.possible_duplicate) for e in batch.events] == \
        [(0, True), (1, True), (2, False), (3, True), (4, False)]
    assert [e.body for e in batch.events] == [entry_event_body(entry(f"k{i}", i)) for i in range(5)]
    assert decodes == [], "nothing was decoded on the read path"
    assert batch.events[4].event == entry("k4", 4)


def test_the_loop_check_sees_only_records_the_region_did_not_route(tmp_path: Path,
                                                                   decodes: list[bytes]) -> None:
    """``accepts`` is asked about records without the routed flag only (decoding those); a routed record
    is never decoded for it; a refused event is left out and its offset still covered."""
    loop = make_loop(tmp_path, Sender)
    events = [entry("a", 0), entry("x-looped", 1), entry("x-routed", 2), entry("b", 3)]
    flags = [0, 0, FLAG_ROUTED, FLAG_ROUTED]
    loop._read([FakeMessage(record(e, f), 0, i) for i, (e, f) in enumerate(zip(events, flags))], now_ms=0)
    assert loop.asked == ["a", "x-looped"]  # type: ignore[attr-defined]
    assert len(decodes) == 2
    batch = waiting(loop)
    assert [e.key for e in batch.events] == ["a", "x-routed", "b"] and batch.commit_offset == 4
    assert loop.stats["filtered"] == 1


def test_a_queue_without_a_loop_check_never_decodes_for_one(tmp_path: Path, decodes: list[bytes]) -> None:
    """An async event queue (``accepts`` left as it is) reads unrouted records without decoding them."""
    loop = make_loop(tmp_path)
    loop._read([FakeMessage(record(entry("a", 0)), 1, 0)], now_ms=0)
    assert decodes == [] and len(waiting(loop, 1).events) == 1


def test_records_that_are_not_queued_events_are_dead_lettered_and_the_rest_read_on(tmp_path: Path) -> None:
    """A record of no known schema, a truncated QueuedEvent and an empty value each go to the dead-letter
    topic with their record bytes and reason; the events around them are read and their offsets covered."""
    loop = make_loop(tmp_path)
    good = record(entry("a", 0))
    bad = [b"\x01not avro at all", b"\x00not avro at all", good[:14], None]
    msgs = [FakeMessage(good, 0, 0), *(FakeMessage(v, 0, i + 1) for i, v in enumerate(bad)),
            FakeMessage(record(entry("b", 4)), 0, 5)]
    loop._read(msgs, now_ms=0)
    letters = dead_letters(loop)
    assert [(d["source_offset"], d["value"]) for d in letters] == [(1, bad[0]), (2, bad[1]), (3, bad[2]), (4, None)]
    # A first byte 00 is Confluent's framing (core/framing.py): here a site with no registry to read it.
    assert "marker" in letters[0]["reason"] and "names no schema_registry" in letters[1]["reason"]
    assert "truncated" in letters[2]["reason"]
    assert all(d["error_class"] == "MalformedRecord" for d in letters) and letters[3]["reason"]
    batch = waiting(loop)
    assert [e.key for e in batch.events] == ["a", "b"] and batch.commit_offset == 6
    assert loop._partitions[0].dead_lettered == 4


def test_with_conflation_an_undecodable_event_body_is_dead_lettered_when_read(tmp_path: Path) -> None:
    """Batch conflation reads each event's key and operation: a record whose QueuedEvent fields are valid
    but whose event's operation does not read is dead-lettered at once with its reason, the update before
    and after it conflated as usual."""
    loop = make_loop(tmp_path, batch_conflation=True)
    damaged = bytearray(entry_event_body(entry("a", 1)))
    damaged[len("orders") + 1 + len("a") + 1] = 0x7E
    values = [record(entry("a", 0)), record(bytes(damaged)), record(entry("a", 2))]
    loop._read([FakeMessage(v, 0, i) for i, v in enumerate(values)], now_ms=0)
    [letter] = dead_letters(loop)
    assert letter["source_offset"] == 1 and letter["value"] == values[1]
    assert "EntryEvent.operation: symbol 63" in letter["reason"]
    batch = waiting(loop)
    assert [e.offset for e in batch.events] == [2] and batch.conflated == 1 and batch.commit_offset == 3


def test_records_of_the_previous_queued_event_version_read_with_their_events_possible_duplicate(
        tmp_path: Path) -> None:
    """A QueuedEvent written with avro/history/QueuedEvent.v2.avsc (no flags) reads through schema
    resolution: the same event, possibleDuplicate as its event says (how v2 said it), never routed."""
    loop = make_loop(tmp_path, Sender)
    old = fastavro.parse_schema(json.loads((schema_dir() / "history" / "QueuedEvent.v2.avsc").read_text()),
                                named_schemas={})
    header = MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(old), "CRC-64-AVRO"))
    events = [entry("a", 0), entry("b", 1).as_possible_duplicate()]
    msgs = []
    for i, event in enumerate(events):
        buf = io.BytesIO()
        buf.write(header)
        fastavro.schemaless_writer(buf, old, {"queue_id": QUEUE, "changelog_partition": 0, "changelog_offset": i,
                                              "enqueued_at": 1, "event": event.to_record()})
        msgs.append(FakeMessage(buf.getvalue(), 0, i))
    loop._read([*msgs, FakeMessage(record(entry("c", 2), FLAG_ROUTED), 0, 2)], now_ms=0)
    batch = waiting(loop)
    assert [e.event for e in batch.events] == [*events, entry("c", 2)]
    assert [e.possible_duplicate for e in batch.events] == [False, True, False]
    assert loop.asked == ["a", "b"]  # type: ignore[attr-defined]


def test_events_found_undecodable_during_an_offer_are_dead_lettered_once_and_leave_the_batch(
        tmp_path: Path) -> None:
    """After an offer, the events a touch found undecodable go to the dead-letter topic (their body, the
    key when it reads, the reason) and leave the batch; one the listener dead-lettered itself is not
    written twice (it stays, like any of its dead letters); a batch with none is left as it is."""
    loop = make_loop(tmp_path)
    damaged = entry_event_body(entry("b", 1))[:-2]
    loop._read([FakeMessage(record(entry("a", 0)), 0, 0), FakeMessage(record(damaged), 0, 1),
                FakeMessage(record(damaged), 0, 2), FakeMessage(record(entry("c", 3)), 0, 3)], now_ms=0)
    batch = waiting(loop)
    assert not loop.dead_letter_undecodable(batch, "test")
    for e in batch.events:
        try:
            e.value
        except Exception:
            pass
    assert loop.dead_letter_undecodable(batch, "test", already=[batch.events[2]])
    [letter] = dead_letters(loop)
    assert (letter["source_offset"], letter["key"], letter["value"], letter["event"]) == (1, b"b", damaged, None)
    assert "does not decode" in letter["reason"] and letter["service"] == "test"
    assert [e.offset for e in batch.events] == [0, 2, 3] and batch.commit_offset == 4
    loop._drain_inbox()
    assert loop.stats["dead_lettered"] == 1


def test_the_removal_record_names_the_newest_event_id_it_can_read(tmp_path: Path, decodes: list[bytes]) -> None:
    """The removal record of an accepted batch is written once, as fastavro would, naming the EventID of the
    newest event whose EventID reads, without decoding any event (one cut off before its EventID, never
    looked at by its listener, is passed over); its delivery commits the partition once."""
    loop = make_loop(tmp_path)
    loop._read([FakeMessage(record(entry("a", 0)), 0, 0), FakeMessage(record(entry("b", 1)), 0, 1),
                FakeMessage(record(entry_event_body(entry("c", 2))[:12]), 0, 2)], now_ms=0)
    part = loop._partitions[0]
    batch = waiting(loop)
    loop._write_removal(part, batch, part.batcher.accepted())
    [(topic, value, key)] = loop._producer.records
    removal = get_codec().decode_as("RemovalRecord", value)
    assert (topic, key) == (loop.removals_topic, b"0")
    assert removal["last_removed_offset"] == 2 and removal["removed_count"] == 3
    assert removal["last_event_id"] == EventID("m", 1, 1).to_record()
    assert decodes == []
    loop._drain_inbox()
    assert part.last_removed_offset == 2 and loop._consumer.commits == [[(0, 3)]]  # type: ignore[union-attr]


class Scripted(Loop):
    """deliver_group answers from a script: an exception to raise, or how many batches were delivered;
    with ``touch``, it first reads every event's value, as a listener would."""

    script: list[Any] = []
    touch = False

    def deliver_group(self, part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> int:
        self.offers = getattr(self, "offers", []) + [[e.offset for b in batches for e in b.events]]
        if self.touch:
            for b in batches:
                for e in b.events:
                    e.value
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return int(answer)


def test_a_refused_or_failing_offer_goes_again_until_accepted_and_counts_its_attempts(tmp_path: Path) -> None:
    """The first offer is made directly; one that raises, then one refused, are made again with backoff,
    the very same events each time, until accepted; the loop hears of it once, with 3 attempts."""
    loop = make_loop(tmp_path, Scripted)
    loop.backoff_max_s = 0.001
    loop.script = [RuntimeError("database away"), 0, 1]  # type: ignore[attr-defined]
    loop._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(3)], now_ms=0)
    part = loop._partitions[0]
    batch = waiting(loop)
    loop._offer(part, [batch])
    kind, done = loop._inbox.get_nowait()
    assert kind == "done" and (done.accepted, done.attempts) == (1, 3)
    assert loop.offers == [[0, 1, 2]] * 3  # type: ignore[attr-defined]


def test_an_offer_that_fails_over_an_undecodable_event_goes_on_at_once_without_it(tmp_path: Path) -> None:
    """A kind of queue whose delivery touches an undecodable event and raises: the event is dead-lettered
    with its reason and the batch offered again at once without it, within the first attempt."""
    loop = make_loop(tmp_path, Scripted)
    loop.touch = True  # type: ignore[attr-defined]
    loop.script = [1]  # type: ignore[attr-defined]
    loop._read([FakeMessage(record(entry("a", 0)), 0, 0),
                FakeMessage(record(entry_event_body(entry("b", 1))[:-2]), 0, 1),
                FakeMessage(record(entry("c", 2)), 0, 2)], now_ms=0)
    part = loop._partitions[0]
    batch = waiting(loop)
    loop._offer(part, [batch])
    items = [loop._inbox.get_nowait() for _ in range(loop._inbox.qsize())]
    assert [kind for kind, _ in items] == ["dead_lettered", "done"]
    done = items[1][1]
    assert (done.accepted, done.attempts) == (1, 1)
    assert loop.offers == [[0, 1, 2], [0, 2]]  # type: ignore[attr-defined]
    [letter] = dead_letters(loop)
    assert letter["source_offset"] == 1 and "does not decode" in letter["reason"]


def test_offsets_the_consumer_moved_past_without_a_record_are_removed_with_an_empty_batch(tmp_path: Path) -> None:
    """A transaction's commit marker after the last record (its offset never handed over, the consumer's
    position past it) is covered when the loop is idle: an empty batch, no offer, and its removal moves the
    head to the end; a partition whose position is where its records end is left as it is."""
    loop = make_loop(tmp_path)
    loop._read([FakeMessage(record(entry("a", 0)), 0, 0), FakeMessage(record(entry("b", 1)), 0, 1),
                FakeMessage(record(entry("c", 2)), 1, 0)], now_ms=0)
    loop._consumer.positions = {0: 3, 1: 1}  # type: ignore[union-attr]  # partition 0: a marker at offset 2
    loop._cover_skipped_offsets(now_ms=0)
    batch = waiting(loop)
    assert [e.offset for e in batch.events] == [0, 1] and batch.commit_offset == 3
    assert waiting(loop, 1).commit_offset == 1
    part = loop._partitions[0]
    loop._write_removal(part, batch, part.batcher.accepted())
    loop._drain_inbox()
    assert part.head == 3
    loop._cover_skipped_offsets(now_ms=0)
    assert part.batcher.take(0, force=True) is None, "nothing more to cover"
    loop._consumer.positions = {0: 5, 1: 1}  # type: ignore[union-attr]  # an aborted transaction: 3 and 4
    loop._cover_skipped_offsets(now_ms=0)
    empty = part.batcher.take(0, force=True)
    assert empty is not None and empty.events == [] and empty.commit_offset == 5


def test_an_offer_refused_over_an_undecodable_event_goes_on_at_once_without_it(tmp_path: Path) -> None:
    """A kind of queue that turns an undecodable event into a refusal (delivers nothing, raises nothing): the
    event is dead-lettered and the batch offered again at once without it, within the first attempt."""
    loop = make_loop(tmp_path, Scripted)
    loop.touch = True  # type: ignore[attr-defined]
    loop.script = [1]  # type: ignore[attr-defined]

    def refusing(part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> int:
        try:
            return Scripted.deliver_group(loop, part, batches)  # type: ignore[arg-type]
        except MalformedRecord:
            return 0

    loop.deliver_group = refusing  # type: ignore[method-assign]
    loop._read([FakeMessage(record(entry("a", 0)), 0, 0),
                FakeMessage(record(entry_event_body(entry("b", 1))[:-2]), 0, 1)], now_ms=0)
    part = loop._partitions[0]
    loop._offer(part, [waiting(loop)])
    items = [loop._inbox.get_nowait() for _ in range(loop._inbox.qsize())]
    done = items[-1][1]
    assert (done.accepted, done.attempts) == (1, 1)
    assert loop.offers == [[0, 1], [0]]  # type: ignore[attr-defined]
    assert [d["source_offset"] for d in dead_letters(loop)] == [1]


class Recording(Loop):
    """Delivers by the script (a number: batches delivered; an exception: raised), recording each offer's
    events as (offset, possibleDuplicate) and keeping the event objects it was handed."""

    script: list[Any] = []

    def deliver_group(self, part: QueuePartition, batches: list[Batch[AsyncEvent]]) -> int:
        self.offers = getattr(self, "offers", []) + [[(e.offset, e.possible_duplicate) for b in batches
                                                      for e in b.events]]
        self.kept = getattr(self, "kept", []) + [[e for b in batches for e in b.events]]
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return int(answer)


@pytest.mark.parametrize("refusal", [0, RuntimeError("the database went away mid-batch")], ids=["false", "raise"])
def test_every_event_of_a_batch_offered_again_is_possible_duplicate_and_the_first_offer_is_not(
        tmp_path: Path, refusal: Any) -> None:
    """Geode's handleUnSuccessfulBatchDispatch: a batch refused (False) or failed (raised) once is offered
    again with every event possibleDuplicate; the first offer's events were not, and the events a listener
    kept from that offer still say so."""
    loop = make_loop(tmp_path, Recording)
    loop.backoff_max_s = 0.001
    loop.script = [refusal, 1]  # type: ignore[attr-defined]
    loop._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(3)], now_ms=0)
    part = loop._partitions[0]
    batch = waiting(loop)
    loop._offer(part, [batch])
    kind, done = loop._inbox.get_nowait()
    assert kind == "done" and (done.accepted, done.attempts) == (1, 2)
    assert loop.offers == [[(0, False), (1, False), (2, False)],  # type: ignore[attr-defined]
                           [(0, True), (1, True), (2, True)]]
    assert [e.possible_duplicate for e in loop.kept[0]] == [False] * 3  # type: ignore[attr-defined]


def test_a_batch_refused_when_dispatch_must_stop_is_flagged_for_the_offer_after_the_resume(tmp_path: Path) -> None:
    """A first offer refused while the queue is being paused is not retried now; when it is offered again
    after the resume, every event of it is possibleDuplicate."""
    loop = make_loop(tmp_path, Recording)
    loop.script = [0, 1]  # type: ignore[attr-defined]
    loop._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(2)], now_ms=0)
    part = loop._partitions[0]
    batch = waiting(loop)
    loop.desired = DesiredState.PAUSED
    loop._offer(part, [batch])
    assert loop._inbox.get_nowait()[1].accepted == 0
    loop.desired = DesiredState.RUNNING
    loop._offer(part, [batch])
    assert loop.offers == [[(0, False), (1, False)], [(0, True), (1, True)]]  # type: ignore[attr-defined]


# --- clean starts (core/queueclean.py) ---------------------------------------------------------------


def produced(loop: QueuePrimary, topic: str) -> list[tuple[bytes | None, dict[str, Any]]]:
    schema = "QueueCleanAudit" if topic == loop.status_topic else "RemovalRecord"
    return [(key, get_codec().decode_as(schema, value)) for t, value, key in loop._producer.records if t == topic]


def cleaning(tmp_path: Path, audits: list[CleanAudit], heads: dict[int, int]) -> QueuePrimary:
    """A loop whose reads of the audits and of the partitions' heads are these; counting the events between
    head and cut gives cut - head."""
    loop = make_loop(tmp_path)
    loop._read_clean_audits = lambda request_id: list(audits)  # type: ignore[method-assign]
    loop._head_for_clean = lambda part: heads[part.tp.partition]  # type: ignore[method-assign]
    loop._count_dropped = lambda partition, head, cut: cut - head  # type: ignore[method-assign]
    return loop


def test_a_clean_is_applied_through_an_audit_and_a_removal_before_anything_of_the_partition_goes_out(
        tmp_path: Path) -> None:
    """A control record with a clean: nothing of a named partition is dispatched until it is applied; then the
    audit (APPLYING, with the count), the removal record at cut - 1 and the group offset, and the audit
    APPLIED; what was read below the cut is forgotten and never read again; a partition already at its cut
    gets an audit of 0 and no removal; a later record carrying the same clean changes nothing."""
    loop = cleaning(tmp_path, [], heads={0: 0, 1: 5})
    loop._read([FakeMessage(record(entry(f"k{i}", i)), 0, i) for i in range(5)], now_ms=0)
    loop._apply_control({"state": "RUNNING", "issued_by": "ops",
                         "clean": {"request_id": "r1", "offsets": [3, 5], "issued_by": "ops@host", "issued_at": 7}})
    part = loop._partitions[0]
    assert part.clean_due and part.skip_below == 3
    loop._dispatch_ready()
    assert part.batcher.out == [] and not part.in_flight, "a partition with a clean due was dispatched"

    loop._apply_due_cleans()
    audits = produced(loop, loop.status_topic)
    assert [(a["partition"], a["state"], a["head_offset"], a["cut_offset"], a["dropped"]) for _, a in audits] == [
        (0, "APPLYING", 0, 3, 3), (0, "APPLIED", 0, 3, 3), (1, "APPLYING", 5, 5, 0), (1, "APPLIED", 5, 5, 0)]
    assert audits[0][0] == b"clean/async-event-queue/q/r1/0" and audits[1][1]["issued_by"] == "ops@host"
    [(key, removal)] = produced(loop, loop.removals_topic)
    assert key == b"0" and (removal["last_removed_offset"], removal["removed_count"]) == (2, 3)
    assert loop._consumer.commits == [[(0, 3)]]  # type: ignore[union-attr]
    assert not part.clean_due and part.head == 3 and part.last_removed_offset == 2
    assert [e.offset for e in part.batcher.take(0, force=True).events] == [3, 4]  # type: ignore[union-attr]

    loop._read([FakeMessage(record(entry("again", 9)), 0, 1)], now_ms=0)  # a record below the cut, read again
    assert part.batcher.take(0, force=True) is None
    loop._producer.records.clear()
    loop._apply_control({"state": "PAUSED", "issued_by": "ops",
                         "clean": {"request_id": "r1", "offsets": [3, 5], "issued_by": "ops@host", "issued_at": 7}})
    loop._apply_due_cleans()
    assert loop._producer.records == [] and not part.clean_due


def test_a_clean_left_applying_by_a_dead_primary_is_finished_with_its_count_and_one_applied_is_left_alone(
        tmp_path: Path) -> None:
    """The next primary finds the audit APPLYING: the removal is written only if the head has not reached the
    cut yet (never back), nothing is counted again, and the audit goes APPLIED with the first count; a
    partition whose audit says APPLIED gets nothing more written."""
    def audit(partition: int, state: str) -> CleanAudit:
        return CleanAudit("async-event-queue", QUEUE, "r2", partition, state, 10, 17, 7, "ops", 1, "old", 2)

    loop = cleaning(tmp_path, [audit(0, APPLYING), audit(1, APPLIED)], heads={0: 17, 1: 17})
    loop._count_dropped = None  # type: ignore[assignment,method-assign]  # a recount would fail here
    loop._apply_control({"state": "RUNNING", "issued_by": "ops",
                         "clean": {"request_id": "r2", "offsets": [17, 17], "issued_by": "ops", "issued_at": 1}})
    loop._apply_due_cleans()
    [(_, finished)] = produced(loop, loop.status_topic)
    assert (finished["partition"], finished["state"], finished["dropped"]) == (0, "APPLIED", 7)
    assert finished["applied_by"] == loop.member_id
    assert produced(loop, loop.removals_topic) == [], "a removal was written at or below the head"
    assert not loop._partitions[0].clean_due and not loop._partitions[1].clean_due
