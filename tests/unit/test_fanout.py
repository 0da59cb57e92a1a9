"""Fan-out of applied events: routing, partitions, completion and checkpoints.

What is checked here, without a broker:

1. ``QueueTarget.accepts`` routes each Operation as Geode does for its kind
   (gateway sender vs async event queue, with and without
   ``forward-expiration-destroy``), and ``partition_for`` keeps the order
   Geode's order policies promise (parallel: the bucket; serial: KEY, THREAD,
   PARTITION).
2. ``Pending`` answers a request exactly once, after ``arm()`` and when every
   record is acknowledged, under concurrent delivery reports too.
3. ``BucketProgress`` only moves the fan-out checkpoint over a contiguous
   prefix of fully fanned-out changelog records.
4. A queue record built by prefixing the changelog body (``_varint``,
   ``_avro_string``) is a valid ``QueuedEvent`` for any event and any long.
5. ``FanoutWriter`` driven by a fake producer writes the changelog first and
   the queues only after its acknowledgement.
"""

from __future__ import annotations

import io
import sys
import threading
from types import SimpleNamespace
from typing import Any, Callable

import fastavro
import pytest
from confluent_kafka import KafkaError
from hypothesis import HealthCheck, example, given, settings
from test_events import ROUTING
from hypothesis import strategies as st

from sluice.core.codec import HEADER_BYTES, MARKER, get_codec
from sluice.core.errors import BrokerUnavailable, SluiceError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import FLAG_POSSIBLE_DUPLICATE
from sluice.core.kafka import partition_for_key
from sluice.region import fanout
from sluice.region.fanout import BucketProgress, FanoutWriter, Pending, QueueTarget, _avro_string, _varint

PROPERTY = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1


def make_event(
    key: str = "k",
    operation: Operation = Operation.CREATE,
    bucket: int = 5,
    member: str = "client-1",
    thread: int = 1,
    seq: int = 0,
    region: str = "orders",
) -> EntryEvent:
    return EntryEvent(
        region=region,
        key=key,
        operation=operation,
        value=None if operation.removes_value else b'"v"',
        event_id=EventID(member, thread, seq),
        version=VersionTag(1, 1_700_000_000_000, 1, "site-a-0"),
        origin_dsid=1,
        bucket=bucket,
        event_time=1_700_000_000_000,
    )


def target(kind: str = "gateway-sender", parallel: bool = False, partitions: int = 8, order_policy: str = "KEY",
           forward_expiration_destroy: bool = False, id: str = "q1") -> QueueTarget:
    return QueueTarget(id=id, topic=f"sluice.queue.{id}", kind=kind, parallel=parallel, partitions=partitions,
                       order_policy=order_policy, forward_expiration_destroy=forward_expiration_destroy)


# --- 1. routing and partitions ---------------------------------------------------------

# ROUTING: operation → (gateway sender, AEQ, AEQ forwarding expiration destroys), shared with test_events.


def test_routing_table_covers_every_operation() -> None:
    """The routing table below has a row for every Operation."""
    assert set(ROUTING) == set(Operation)


@pytest.mark.parametrize("op", list(Operation), ids=lambda op: op.value)
def test_queue_target_accepts_follows_geode_per_kind(op: Operation) -> None:
    """A gateway sender takes only create/put/distributed destroy; an AEQ adds expiration destroy when forwarded."""
    gateway, aeq, aeq_forwarding = ROUTING[op]
    for parallel in (False, True):
        assert target("gateway-sender", parallel).accepts(op) is gateway
        # forward-expiration-destroy is an AEQ attribute: a gateway sender ignores it.
        assert target("gateway-sender", parallel, forward_expiration_destroy=True).accepts(op) is gateway
        assert target("async-event-queue", parallel).accepts(op) is aeq
        assert target("async-event-queue", parallel, forward_expiration_destroy=True).accepts(op) is aeq_forwarding


@pytest.mark.parametrize("order_policy", ["KEY", "THREAD", "PARTITION"])
def test_parallel_queue_partition_is_the_bucket(order_policy: str) -> None:
    """A parallel queue keeps the bucket as its partition whatever the order policy (one queue per bucket)."""
    t = target(parallel=True, partitions=113, order_policy=order_policy)
    for bucket in (0, 1, 57, 112):
        event = make_event(key=f"k{bucket}", bucket=bucket, thread=bucket * 3)
        assert t.partition_for(event, event.key.encode()) == bucket


@given(key=st.text(max_size=40), partitions=st.integers(1, 64), bucket=st.integers(0, 1000),
       thread=st.integers(0, 1 << 40), seq=st.integers(0, 1 << 40))
@PROPERTY
def test_serial_key_policy_partitions_by_key(key: str, partitions: int, bucket: int, thread: int, seq: int) -> None:
    """Serial KEY: the partition is Kafka's partition_for_key(key, n), whatever the bucket or EventID."""
    t = target(partitions=partitions, order_policy="KEY")
    key_bytes = key.encode("utf-8")
    p = t.partition_for(make_event(key=key, bucket=bucket, thread=thread, seq=seq), key_bytes)
    assert p == partition_for_key(key_bytes, partitions)
    assert 0 <= p < partitions
    assert t.partition_for(make_event(key=key, bucket=bucket + 1, thread=thread + 1, seq=seq + 1), key_bytes) == p


@given(member=st.text(max_size=20), thread=st.integers(LONG_MIN, LONG_MAX), partitions=st.integers(1, 64),
       keys=st.lists(st.text(max_size=10), min_size=2, max_size=5), seqs=st.lists(st.integers(0, 1 << 40), min_size=2, max_size=5))
@PROPERTY
def test_serial_thread_policy_keeps_a_thread_on_one_partition(member: str, thread: int, partitions: int,
                                                              keys: list[str], seqs: list[int]) -> None:
    """Serial THREAD: every event of one (member, thread) goes to the same partition, whatever its key or bucket."""
    t = target(partitions=partitions, order_policy="THREAD")
    chosen = {
        t.partition_for(make_event(key=k, bucket=i, member=member, thread=thread, seq=s), k.encode())
        for i, (k, s) in enumerate(zip(keys, seqs))
    }
    assert len(chosen) == 1
    assert 0 <= chosen.pop() < partitions


def test_serial_thread_policy_spreads_threads() -> None:
    """Serial THREAD: different threads are not all pinned to one partition (the policy uses the thread)."""
    t = target(partitions=8, order_policy="THREAD")
    partitions = {t.partition_for(make_event(key="same", thread=th), b"same") for th in range(64)}
    assert len(partitions) > 1


@pytest.mark.parametrize("partitions", [1, 3, 8])
def test_serial_partition_policy_is_bucket_modulo_partitions(partitions: int) -> None:
    """Serial PARTITION: the queue partition is the bucket modulo the queue's partition count."""
    t = target(partitions=partitions, order_policy="PARTITION")
    for bucket in range(0, 40):
        event = make_event(key=f"key-{bucket}", bucket=bucket)
        assert t.partition_for(event, event.key.encode()) == bucket % partitions


# --- 2. Pending --------------------------------------------------------------------------


class Recorder:
    """An on_done callback that remembers every call, and optionally a shared order log."""

    def __init__(self, name: str = "", log: list[str] | None = None) -> None:
        self.calls: list[SluiceError | None] = []
        self.name = name
        self.log = log
        self._lock = threading.Lock()

    def __call__(self, error: SluiceError | None) -> None:
        with self._lock:
            self.calls.append(error)
        if self.log is not None:
            self.log.append(self.name)


def test_pending_fires_only_after_arm_and_all_done() -> None:
    """Pending fires once, with no error, only when armed and nothing is outstanding."""
    rec = Recorder()
    p = Pending(rec)
    p.add(2)
    p.done()
    p.done()
    assert rec.calls == []  # nothing outstanding, but not armed yet
    p.add(1)
    p.arm()
    assert rec.calls == []  # armed, one outstanding
    p.done()
    assert rec.calls == [None]
    p.done()
    p.arm()
    p.add(1)
    p.done()
    assert rec.calls == [None]  # never twice


def test_pending_armed_with_nothing_outstanding_fires_at_once() -> None:
    """arm() on a Pending with no records fires it immediately."""
    rec = Recorder()
    Pending(rec).arm()
    assert rec.calls == [None]


def test_pending_counts_done_in_batches() -> None:
    """done(n) counts n records; firing waits for the last one."""
    rec = Recorder()
    p = Pending(rec)
    p.add(5)
    p.arm()
    p.done(4)
    assert rec.calls == []
    p.done(1)
    assert rec.calls == [None]


def test_pending_fail_keeps_the_first_error_and_counts_as_done() -> None:
    """fail() counts its record as finished and the Pending reports the first error only."""
    rec = Recorder()
    p = Pending(rec)
    p.add(3)
    p.arm()
    first, second = BrokerUnavailable("first"), BrokerUnavailable("second")
    p.fail(first)
    p.fail(second)
    assert rec.calls == []
    p.done()
    assert len(rec.calls) == 1 and rec.calls[0] is first


def test_then_on_unfired_pending_waits_for_it() -> None:
    """A dependent chained on an unfired Pending fires only after it, and after its own records."""
    log: list[str] = []
    original = Pending(Recorder("original", log))
    original.add(1)
    original.arm()
    retry_rec = Recorder("retry", log)
    retry = Pending(retry_rec)
    retry.add(1)  # held while the request is being prepared, as the engine does
    original.then(retry)
    retry.arm()
    retry.done()
    assert log == []
    original.done()
    assert log == ["original", "retry"]
    assert retry_rec.calls == [None]


def test_then_on_fired_pending_counts_done_at_once() -> None:
    """A dependent chained on an already fired Pending is not held back by it."""
    original = Pending(Recorder())
    original.arm()
    assert original.fired
    retry_rec = Recorder()
    retry = Pending(retry_rec)
    retry.add(1)
    original.then(retry)
    assert retry.remaining == 1
    retry.arm()
    retry.done()
    assert retry_rec.calls == [None]


def test_then_many_dependents_each_fire_once() -> None:
    """Every dependent chained on one Pending fires exactly once when it fires."""
    original = Pending(Recorder())
    original.add(1)
    recs = [Recorder() for _ in range(5)]
    for rec in recs:
        dep = Pending(rec)
        original.then(dep)
        dep.arm()
    original.arm()
    assert all(r.calls == [] for r in recs)
    original.done()
    assert all(r.calls == [None] for r in recs)


def test_then_dependent_of_a_failed_pending_learns_the_failure() -> None:
    """A retry answered "when the first attempt is durable" must not be answered success when that attempt failed."""
    original = Pending(Recorder())
    original.add(1)
    original.arm()
    retry_rec = Recorder()
    retry = Pending(retry_rec)
    retry.add(1)
    original.then(retry)
    retry.arm()
    retry.done()
    error = BrokerUnavailable("the changelog write failed")
    original.fail(error)
    assert retry_rec.calls == [error]


@pytest.fixture
def tight_switching() -> Any:
    """Switch threads as often as the interpreter allows, to shake out races (no sleeps)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def run_together(*fns: Callable[[], None]) -> None:
    """Start every function in its own thread behind one barrier and wait for all; re-raise a failure."""
    barrier = threading.Barrier(len(fns))
    errors: list[BaseException] = []

    def body(fn: Callable[[], None]) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_pending_concurrent_done_fires_exactly_once(tight_switching: Any) -> None:
    """Many threads calling done() and one calling arm() at the same time fire the Pending exactly once, at the end."""
    threads, per_thread = 8, 300
    for _ in range(20):
        rec = Recorder()
        p = Pending(rec)
        p.add(threads * per_thread)

        def worker() -> None:
            for _ in range(per_thread):
                p.done()

        run_together(p.arm, *[worker] * threads)
        assert rec.calls == [None]
        assert p.remaining == 0


def test_pending_concurrent_then_and_fire_counts_dependent_once(tight_switching: Any) -> None:
    """then() racing with the original firing still fires the dependent exactly once."""
    for _ in range(300):
        original = Pending(Recorder())
        original.add(1)
        original.arm()
        dep_rec = Recorder()
        dep = Pending(dep_rec)
        dep.add(1)
        run_together(lambda: original.then(dep), original.done)
        dep.arm()
        assert dep_rec.calls == []
        dep.done()
        assert dep_rec.calls == [None]


# --- 3. BucketProgress ----------------------------------------------------------------------


def test_checkpoint_advances_over_a_completed_prefix_only() -> None:
    """A record completed out of order does not move the checkpoint past an earlier incomplete one."""
    progress = BucketProgress(10)
    s10 = progress.opened(10, 2)
    s11 = progress.opened(11, 1)
    s12 = progress.opened(12, 1)
    progress.closed_one(s11)
    progress.closed_one(s12)
    assert progress.checkpoint == 10
    progress.closed_one(s10)
    assert progress.checkpoint == 10  # one queue record of 10 still outstanding
    progress.closed_one(s10)
    assert progress.checkpoint == 13
    assert not progress.inflight


def test_zero_outstanding_slot_advances_at_once() -> None:
    """A changelog record no queue takes moves the checkpoint past itself immediately, if nothing is before it."""
    progress = BucketProgress(0)
    progress.opened(0, 0)
    assert progress.checkpoint == 1
    slot = progress.opened(1, 1)
    progress.opened(2, 0)
    assert progress.checkpoint == 1  # waits behind offset 1
    progress.closed_one(slot)
    assert progress.checkpoint == 3


# Each step: ("open", offset, outstanding) or ("close", offset); then the expected checkpoint.
PROGRESS_TRACES = {
    "in-order": [(("open", 0, 1), 0), (("open", 1, 1), 0), (("close", 0), 1), (("close", 1), 2)],
    "reverse-close": [(("open", 0, 1), 0), (("open", 1, 1), 0), (("open", 2, 1), 0),
                      (("close", 2), 0), (("close", 1), 0), (("close", 0), 3)],
    "gap-in-offsets": [(("open", 5, 1), 5), (("open", 9, 0), 5), (("close", 5), 10)],
    "zero-then-wait": [(("open", 7, 0), 8), (("open", 8, 2), 8), (("close", 8), 8), (("close", 8), 9)],
    "hole-in-the-middle": [(("open", 0, 1), 0), (("open", 1, 1), 0), (("open", 2, 1), 0),
                           (("close", 0), 1), (("close", 2), 1), (("close", 1), 3)],
}


@pytest.mark.parametrize("trace", list(PROGRESS_TRACES), ids=list(PROGRESS_TRACES))
def test_checkpoint_traces(trace: str) -> None:
    """Recorded open/close traces give the expected checkpoint after every step."""
    progress = BucketProgress(PROGRESS_TRACES[trace][0][0][1])
    slots: dict[int, list[int]] = {}
    for step, expected in PROGRESS_TRACES[trace]:
        if step[0] == "open":
            slots[step[1]] = progress.opened(step[1], step[2])
        else:
            progress.closed_one(slots[step[1]])
        assert progress.checkpoint == expected, (step, progress.checkpoint)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.randoms(use_true_random=False))
@PROPERTY
def test_checkpoint_is_one_past_the_longest_completed_prefix(outstanding: list[int], rnd: Any) -> None:
    """For any completion order, the checkpoint is one past the longest prefix of fully fanned-out records."""
    base = 100
    progress = BucketProgress(base)
    slots = [progress.opened(base + i, n) for i, n in enumerate(outstanding)]
    remaining = list(outstanding)
    closes = [i for i, n in enumerate(outstanding) for _ in range(n)]
    rnd.shuffle(closes)

    def expected() -> int:
        done = 0
        while done < len(remaining) and remaining[done] == 0:
            done += 1
        return base + done

    assert progress.checkpoint == expected()
    for i in closes:
        progress.closed_one(slots[i])
        remaining[i] -= 1
        assert progress.checkpoint == expected()
    assert progress.checkpoint == base + len(outstanding)


# --- 4. QueuedEvent by prefixing --------------------------------------------------------------

int32 = st.integers(INT_MIN, INT_MAX)
int64 = st.integers(LONG_MIN, LONG_MAX)
text = st.text(max_size=20)

events = st.builds(
    EntryEvent,
    region=text,
    key=text,
    operation=st.sampled_from(list(Operation)),
    value=st.one_of(st.none(), st.binary(max_size=40)),
    event_id=st.builds(EventID, text, int64, int64),
    version=st.builds(VersionTag, int32, int64, int64, text),
    origin_dsid=int32,
    bucket=int32,
    event_time=int64,
    callback_argument=st.one_of(st.none(), text),
    possible_duplicate=st.booleans(),
    visited_dsids=st.lists(int32, max_size=4).map(tuple),
    value_encoding=st.sampled_from(["json", "raw"]),
)


def encode_long(n: int) -> bytes:
    """An Avro long as fastavro writes it (an independent encoder)."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema("long"), n)
    return buf.getvalue()


@given(int64)
@example(0)
@example(-1)
@example(1)
@example(63)
@example(-64)
@example(64)
@example(INT_MAX)
@example(INT_MIN)
@example(LONG_MAX)
@example(LONG_MIN)
@PROPERTY
def test_varint_is_avro_zigzag_long(n: int) -> None:
    """_varint writes any long exactly as Avro (fastavro) does, negative and 64-bit ones included."""
    assert _varint(n) == encode_long(n)


@given(st.text(max_size=50))
@PROPERTY
def test_avro_string_is_length_prefixed_utf8(s: str) -> None:
    """_avro_string is Avro's string: the UTF-8 byte length as a long, then the bytes."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema("string"), s)
    assert _avro_string(s) == buf.getvalue()


def queued_bytes(event: EntryEvent, queue_id: str, offset: int, now_ms: int) -> bytes:
    """The queue record exactly as FanoutWriter builds it from the changelog record."""
    codec = get_codec()
    changelog_value = codec.encode("EntryEvent", event.to_record(), validate=False)
    body = changelog_value[HEADER_BYTES:]
    flags = FLAG_POSSIBLE_DUPLICATE if event.possible_duplicate else 0
    return (MARKER + codec.fingerprint("QueuedEvent") + _varint(flags) + _avro_string(queue_id)
            + _varint(event.bucket) + _varint(offset) + _varint(now_ms) + body)


@given(events, text, int64, int64)
@example(make_event(bucket=INT_MIN), "q", LONG_MIN, LONG_MIN)
@example(make_event(bucket=INT_MAX), "q", LONG_MAX, LONG_MAX)
@example(make_event(bucket=0), "", -1, -1)
@PROPERTY
def test_prefixed_queued_event_decodes_to_the_same_event(event: EntryEvent, queue_id: str, offset: int, now_ms: int) -> None:
    """The prefixed bytes decode as a QueuedEvent holding the queue fields and exactly the original event."""
    codec = get_codec()
    data = queued_bytes(event, queue_id, offset, now_ms)
    record = codec.decode_as("QueuedEvent", data)
    assert record["queue_id"] == queue_id
    assert record["changelog_partition"] == event.bucket
    assert record["changelog_offset"] == offset
    assert record["enqueued_at"] == now_ms
    assert EntryEvent.from_record(record["event"]) == event
    # And it is byte for byte what encoding the QueuedEvent from scratch gives.
    scratch = codec.encode("QueuedEvent", {
        "flags": FLAG_POSSIBLE_DUPLICATE if event.possible_duplicate else 0, "queue_id": queue_id, "changelog_partition": event.bucket, "changelog_offset": offset,
        "enqueued_at": now_ms, "event": event.to_record(),
    })
    assert data == scratch


# --- 5. FanoutWriter over a fake producer ------------------------------------------------------


class FakeMessage:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class FakeProducer:
    """Records produce() calls; the test delivers them when it chooses."""

    def __init__(self, buffer_errors: int = 0) -> None:
        self.produced: list[dict[str, Any]] = []
        self.buffer_errors = buffer_errors
        self.polls = 0

    def produce(self, topic: str, value: bytes, key: bytes, partition: int, on_delivery: Any) -> None:
        if self.buffer_errors:
            self.buffer_errors -= 1
            raise BufferError("Local: Queue full")
        self.produced.append(dict(topic=topic, value=value, key=key, partition=partition, cb=on_delivery))

    def poll(self, timeout: float) -> int:
        self.polls += 1
        return 0

    def deliver(self, index: int, offset: int, error: KafkaError | None = None) -> None:
        rec = self.produced[index]
        rec["cb"](error, FakeMessage(rec["topic"], rec["partition"], offset))


NOW_S = 1_700_000_123.456


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fanout, "time", SimpleNamespace(time=lambda: NOW_S))
    return int(NOW_S * 1000)


def make_writer(producer: FakeProducer, failures: list[tuple[str, int, SluiceError]]) -> FanoutWriter:
    targets = {"orders": [
        target("gateway-sender", parallel=False, partitions=4, order_policy="KEY", id="gw-b"),
        target("async-event-queue", parallel=True, partitions=16, id="aeq-db"),
    ]}
    return FanoutWriter(producer, get_codec(), {"orders": "sluice.changelog.orders"}, targets,
                        lambda r, b, e: failures.append((r, b, e)))


def test_writer_fans_out_only_after_the_changelog_ack(frozen_clock: int) -> None:
    """The changelog record goes first; queue records follow its ack, carry its offset, and complete the request."""
    producer, failures = FakeProducer(), []
    writer = make_writer(producer, failures)
    rec = Recorder()
    pending, progress = Pending(rec), BucketProgress(42)
    event = make_event(key="k1", bucket=5)
    writer.write(event, pending, progress)
    pending.arm()
    assert [p["topic"] for p in producer.produced] == ["sluice.changelog.orders"]
    changelog = producer.produced[0]
    assert (changelog["partition"], changelog["key"]) == (5, b"k1")
    assert EntryEvent.from_record(get_codec().decode_as("EntryEvent", changelog["value"])) == event

    producer.deliver(0, offset=42)
    queued = producer.produced[1:]
    assert [q["topic"] for q in queued] == ["sluice.queue.gw-b", "sluice.queue.aeq-db"]
    assert queued[0]["partition"] == partition_for_key(b"k1", 4)
    assert queued[1]["partition"] == 5
    for q, queue_id in zip(queued, ["gw-b", "aeq-db"]):
        assert q["key"] == b"k1"
        record = get_codec().decode_as("QueuedEvent", q["value"])
        assert (record["queue_id"], record["changelog_partition"], record["changelog_offset"]) == (queue_id, 5, 42)
        assert record["enqueued_at"] == frozen_clock
        assert EntryEvent.from_record(record["event"]) == event
    assert rec.calls == [] and progress.checkpoint == 42
    producer.deliver(1, offset=0)
    assert rec.calls == [] and progress.checkpoint == 42
    producer.deliver(2, offset=0)
    assert rec.calls == [None] and progress.checkpoint == 43
    assert failures == []


def test_writer_sends_an_invalidate_to_no_queue(frozen_clock: int) -> None:
    """An invalidate is written to the changelog only; its ack completes the request and passes the checkpoint."""
    producer = FakeProducer()
    writer = make_writer(producer, [])
    rec = Recorder()
    pending, progress = Pending(rec), BucketProgress(7)
    writer.write(make_event(operation=Operation.INVALIDATE), pending, progress)
    pending.arm()
    producer.deliver(0, offset=7)
    assert len(producer.produced) == 1
    assert rec.calls == [None] and progress.checkpoint == 8


def test_writer_changelog_failure_fails_request_and_bucket(frozen_clock: int) -> None:
    """A failed changelog write answers the request with the error, fails the bucket and writes no queue record."""
    producer, failures = FakeProducer(), []
    writer = make_writer(producer, failures)
    rec = Recorder()
    pending, progress = Pending(rec), BucketProgress(0)
    writer.write(make_event(bucket=5), pending, progress)
    pending.arm()
    producer.deliver(0, offset=-1, error=KafkaError(KafkaError._MSG_TIMED_OUT))
    assert len(producer.produced) == 1
    assert len(rec.calls) == 1 and isinstance(rec.calls[0], BrokerUnavailable)
    assert progress.failed
    assert [(r, b) for r, b, _ in failures] == [("orders", 5)]


def test_writer_refanout_marks_possible_duplicate(frozen_clock: int) -> None:
    """A re-enqueued changelog record goes straight to the queues, marked possibleDuplicate, with its old offset."""
    producer = FakeProducer()
    writer = make_writer(producer, [])
    rec = Recorder()
    pending, progress = Pending(rec), BucketProgress(3)
    event = make_event(bucket=2)
    writer.refanout(event, 3, pending, progress)
    pending.arm()
    assert [p["topic"] for p in producer.produced] == ["sluice.queue.gw-b", "sluice.queue.aeq-db"]
    for q in producer.produced:
        record = get_codec().decode_as("QueuedEvent", q["value"])
        assert record["changelog_offset"] == 3
        assert EntryEvent.from_record(record["event"]) == event.as_possible_duplicate()
    producer.deliver(0, 0)
    producer.deliver(1, 0)
    assert rec.calls == [None] and progress.checkpoint == 4


def test_writer_waits_out_a_full_local_queue(frozen_clock: int) -> None:
    """BufferError from produce() is back-pressure: the writer polls and produces the same record again."""
    producer = FakeProducer(buffer_errors=3)
    writer = make_writer(producer, [])
    writer.write(make_event(), Pending(Recorder()), BucketProgress(0))
    assert producer.polls == 3
    assert len(producer.produced) == 1
