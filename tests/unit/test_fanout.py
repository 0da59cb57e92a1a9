"""The write path of a bucket owner: routing, records, windows and their transactions.

What is checked here, without a broker:

1. ``QueueTarget.accepts`` routes each Operation as Geode does for its kind
   (gateway sender vs async event queue, with and without
   ``forward-expiration-destroy``), ``loops_back`` keeps an event away from
   the site it came from or visited, and ``partition_for`` keeps the order
   Geode's order policies promise (parallel: the bucket; serial: KEY, THREAD,
   PARTITION).
2. ``Pending`` answers a request exactly once, after ``arm()`` and when
   everything it waits for is done, under concurrent completions too.
3. ``Window`` keeps records in acceptance order, tagged with their bucket's
   ownership epoch, with the checkpoint each bucket's offset commits.
4. A queue record built around the changelog body is a valid ``QueuedEvent``
   for any event and any long; ``RecordBuilder`` writes the flags
   (possibleDuplicate, routed), leaves looping events and filtered ones out.
5. ``WindowWriter`` driven by a fake transactional producer writes a window
   as one transaction whose offsets are the marked checkpoints, and aborts it
   (or asks for a new producer) on every failure, so nothing of a failed
   window is committed.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import fastavro
import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import HealthCheck, example, given, settings
from test_events import ROUTING
from hypothesis import strategies as st

from sluice.core.codec import HEADER_BYTES, MARKER, get_codec
from sluice.core.errors import BrokerUnavailable, OwnershipUnconfirmed, SluiceError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import FLAG_POSSIBLE_DUPLICATE, FLAG_ROUTED
from sluice.core.kafka import partition_for_key
from sluice.region import fanout
from sluice.region.fanout import (
    TRANSACTIONAL_CHECKPOINT,
    Pending,
    QueueTarget,
    RecordBuilder,
    Window,
    WindowOutcome,
    WindowWriter,
    _avro_string,
    _varint,
)

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


# --- 3. Window -------------------------------------------------------------------------------

CL = ("sluice.changelog.orders", 5, b"k", b"c", None)
Q1 = ("sluice.queue.q1", 1, b"k", b"q", None)


def test_window_keeps_acceptance_order_and_each_slots_checkpoint() -> None:
    """Records keep the order they were accepted in across buckets; each slot written is known with
    the checkpoint its offset commits, in first-write order (a load's re-enqueue writes no changelog
    record, and its slot is there all the same)."""
    w = Window()
    assert w.empty()
    w.add(("orders", 5, 1), 40, CL, [Q1])
    w.add(("orders", 2, 3), 7, ("sluice.changelog.orders", 2, b"j", b"c2", None), [])
    w.add(("orders", 5, 1), 40, ("sluice.changelog.orders", 5, b"k", b"c3", None), [Q1])
    w.add(("orders", 7, 4), 99, None, [Q1])
    assert [r[0][3] for r in w.records] == [b"c", b"q", b"c2", b"c3", b"q", b"q"]
    assert w.checkpoints == {("orders", 5, 1): 40, ("orders", 2, 3): 7, ("orders", 7, 4): 99}
    assert list(w.checkpoints) == [("orders", 5, 1), ("orders", 2, 3), ("orders", 7, 4)]
    assert not w.empty()


def test_a_window_tells_two_ownerships_of_a_bucket_apart() -> None:
    """Records of a bucket prepared before and after it was reloaded are different slots."""
    w = Window()
    w.add(("orders", 5, 1), 0, CL, [])
    w.add(("orders", 5, 2), 3, CL, [])
    assert list(w.checkpoints) == [("orders", 5, 1), ("orders", 5, 2)]
    assert [slot for _, slot in w.records] == [("orders", 5, 1), ("orders", 5, 2)]


# --- 4. QueuedEvent by prefixing --------------------------------------------------------------

int64 = st.integers(LONG_MIN, LONG_MAX)
text = st.text(max_size=20)

from eventstrategies import events  # noqa: E402


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
    """A queue record around the changelog record's body, as RecordBuilder lays it out."""
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


# --- 4b. RecordBuilder ---------------------------------------------------------------------------

NOW_S = 1_700_000_123.456


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fanout, "time", SimpleNamespace(time=lambda: NOW_S, monotonic=lambda: 0.0))
    return int(NOW_S * 1000)


def make_builder(**gateway: Any) -> RecordBuilder:
    targets = {"orders": [
        QueueTarget(id="gw-b", topic="sluice.queue.gw-b", kind="gateway-sender", parallel=False, partitions=4,
                    order_policy="KEY", remote_dsid=2, **gateway),
        target("async-event-queue", parallel=True, partitions=16, id="aeq-db"),
    ]}
    return RecordBuilder(get_codec(), {"orders": "sluice.changelog.orders"}, targets)


def test_builder_writes_the_changelog_record_and_every_queue_record(frozen_clock: int) -> None:
    """The changelog record (partition = bucket) and one QueuedEvent per queue that takes the operation:
    the gateway's marked routed, offsets -1 (unknown in the same transaction), the event byte for byte."""
    event = make_event(key="k1", bucket=5)
    (topic, partition, key, value, headers), queued = make_builder().records(event, [("traceparent", b"00-x")])
    assert (topic, partition, key, headers) == ("sluice.changelog.orders", 5, b"k1", [("traceparent", b"00-x")])
    assert EntryEvent.from_record(get_codec().decode_as("EntryEvent", value)) == event
    assert [(q[0], q[1]) for q in queued] == [("sluice.queue.gw-b", partition_for_key(b"k1", 4)),
                                              ("sluice.queue.aeq-db", 5)]
    for (_, _, qkey, qvalue, qheaders), queue_id, flags in zip(queued, ["gw-b", "aeq-db"], [FLAG_ROUTED, 0]):
        assert qkey == b"k1" and qheaders == [("traceparent", b"00-x")]
        record = get_codec().decode_as("QueuedEvent", qvalue)
        assert (record["flags"], record["queue_id"], record["changelog_partition"], record["changelog_offset"]) == \
            (flags, queue_id, 5, -1)
        assert record["enqueued_at"] == frozen_clock
        assert EntryEvent.from_record(record["event"]) == event


def test_builder_sends_an_invalidate_to_no_queue(frozen_clock: int) -> None:
    """An invalidate is a changelog record only."""
    changelog, queued = make_builder().records(make_event(operation=Operation.INVALIDATE))
    assert changelog[0] == "sluice.changelog.orders" and queued == []


@pytest.mark.parametrize("origin,visited,to_gateway", [
    (1, (), True), (2, (), False), (3, (2,), False), (3, (1, 4), True),
], ids=["local", "from-the-remote-site", "visited-the-remote-site", "visited-others"])
def test_builder_keeps_the_gateway_loop_check_at_enqueue(frozen_clock: int, origin: int, visited: tuple[int, ...],
                                                        to_gateway: bool) -> None:
    """An event from the sender's remote site, or that visited it, is not queued for that sender
    (Geode: no loops in a mesh); the async event queue still gets it."""
    event = replace_event(make_event(), origin_dsid=origin, visited_dsids=visited)
    _, queued = make_builder().records(event)
    assert [q[0] for q in queued] == (["sluice.queue.gw-b"] if to_gateway else []) + ["sluice.queue.aeq-db"]


def test_builder_applies_before_enqueue_filters(frozen_clock: int) -> None:
    """A filter that keeps an event out leaves no record in its queue; a substitution is queued instead."""
    kept_out = make_builder(enqueue=lambda e, p: None).records(make_event())[1]
    assert [q[0] for q in kept_out] == ["sluice.queue.aeq-db"]
    changed = replace_event(make_event(), value=b'"changed"')
    substituted = make_builder(enqueue=lambda e, p: changed).records(make_event())[1]
    record = get_codec().decode_as("QueuedEvent", substituted[0][3])
    assert EntryEvent.from_record(record["event"]) == changed


def test_builder_requeues_marked_possible_duplicate_with_the_changelog_offset(frozen_clock: int) -> None:
    """A re-enqueued changelog record goes to the queues only, flagged possibleDuplicate, with its offset."""
    event = make_event(bucket=2)
    queued = make_builder().requeued(event, 3)
    assert [q[0] for q in queued] == ["sluice.queue.gw-b", "sluice.queue.aeq-db"]
    for q, flags in zip(queued, [FLAG_POSSIBLE_DUPLICATE | FLAG_ROUTED, FLAG_POSSIBLE_DUPLICATE]):
        record = get_codec().decode_as("QueuedEvent", q[3])
        assert (record["flags"], record["changelog_offset"]) == (flags, 3)
        assert EntryEvent.from_record(record["event"]) == event.as_possible_duplicate()


def replace_event(event: EntryEvent, **changes: Any) -> EntryEvent:
    from dataclasses import replace
    return replace(event, **changes)


# --- 5. WindowWriter over a fake transactional producer -------------------------------------------

GENERATION_3 = b"CGMDv2:" + (3).to_bytes(4, sys.byteorder, signed=True) + b"region\0member-1\0\x01"
NO_GENERATION = b"CGMDv2:" + (-1).to_bytes(4, sys.byteorder, signed=True) + b"region\0\0\x01"


def kafka_error(code: int, *, fatal: bool = False, abortable: bool = False, retriable: bool = False) -> KafkaException:
    return KafkaException(KafkaError(code, "injected", fatal=fatal, retriable=retriable, txn_requires_abort=abortable))


class FakeTransactionalProducer:
    """Records the calls; a step named in ``fail`` raises its error (once)."""

    def __init__(self, fail: dict[str, KafkaException] | None = None, buffer_errors: int = 0) -> None:
        self.calls: list[str] = []
        self.produced: list[tuple[str, int, bytes]] = []
        self.offsets: list[tuple[str, int, int, str | None]] = []
        self.metadata: bytes | None = None
        self.fail = fail or {}
        self.buffer_errors = buffer_errors
        self.polls = 0
        self.unflushed = 0
        #: (topic, partition) → the next offset; delivery callbacks waiting for flush().
        self.next_offset: dict[tuple[str, int], int] = {}
        self.reports: list[tuple[Any, int]] = []

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail.pop(name)

    def begin_transaction(self) -> None:
        self._step("begin")

    def produce(self, topic: str, value: bytes, key: bytes, partition: int, headers: Any = None,
                on_delivery: Any = None) -> None:
        if self.buffer_errors:
            self.buffer_errors -= 1
            raise BufferError("Local: Queue full")
        self.produced.append((topic, partition, value))
        offset = self.next_offset.get((topic, partition), 100)
        self.next_offset[(topic, partition)] = offset + 1
        if on_delivery is not None:
            self.reports.append((on_delivery, offset))

    def poll(self, timeout: float) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float) -> int:
        self._step("flush")
        for report, offset in self.reports:
            report(None, SimpleNamespace(offset=lambda offset=offset: offset))
        self.reports.clear()
        return self.unflushed

    def send_offsets_to_transaction(self, offsets: list[Any], metadata: bytes, timeout: float) -> None:
        self._step("send_offsets")
        self.offsets = [(tp.topic, tp.partition, tp.offset, tp.metadata) for tp in offsets]
        self.metadata = metadata

    def commit_transaction(self, timeout: float) -> None:
        self._step("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._step("abort")


def a_window() -> Window:
    """Bucket 5 (two events, both queued, checkpoint 40) and bucket 2 (one event, no queue, checkpoint 0)."""
    w = Window()
    w.add(("orders", 5, 1), 40, ("sluice.changelog.orders", 5, b"a", b"a1", None),
          [("sluice.queue.q", 0, b"a", b"qa1", None)])
    w.add(("orders", 2, 1), 0, ("sluice.changelog.orders", 2, b"b", b"b1", None), [])
    w.add(("orders", 5, 1), 40, ("sluice.changelog.orders", 5, b"a", b"a2", None),
          [("sluice.queue.q", 0, b"a", b"qa2", None)])
    return w


def write(producer: FakeTransactionalProducer, window: Window, skip: set[Any] | None = None,
          metadata: bytes | None = GENERATION_3) -> WindowOutcome:
    return WindowWriter(producer, {"orders": "sluice.changelog.orders"}, timeout_s=5).write(window, skip or set(), metadata)


def test_a_window_is_one_transaction_whose_offsets_are_the_marked_checkpoints() -> None:
    """begin, every record in acceptance order (a delivery callback only on each bucket's last changelog
    record, whose offset comes back with the commit), flush, each bucket's checkpoint as the group's offset
    marked transactional, with the generation's metadata, commit."""
    producer = FakeTransactionalProducer()
    outcome = write(producer, a_window())
    assert producer.calls == ["begin", "flush", "send_offsets", "commit"]
    assert [v for _, _, v in producer.produced] == [b"a1", b"qa1", b"b1", b"a2", b"qa2"]
    assert producer.offsets == [("sluice.changelog.orders", 5, 40, TRANSACTIONAL_CHECKPOINT),
                                ("sluice.changelog.orders", 2, 0, TRANSACTIONAL_CHECKPOINT)]
    assert producer.metadata == GENERATION_3
    # bucket 5's changelog records went to offsets 100 and 101, bucket 2's one to 100
    assert outcome == WindowOutcome(committed={("orders", 5, 1): 40, ("orders", 2, 1): 0},
                                    last_offsets={("orders", 5, 1): 101, ("orders", 2, 1): 100})


def test_records_of_an_ownership_that_ended_are_left_out() -> None:
    """Slots in ``skip`` are neither written nor given offsets; a window of nothing else writes nothing."""
    producer = FakeTransactionalProducer()
    outcome = write(producer, a_window(), skip={("orders", 5, 1)})
    assert [v for _, _, v in producer.produced] == [b"b1"]
    assert producer.offsets == [("sluice.changelog.orders", 2, 0, TRANSACTIONAL_CHECKPOINT)]
    assert outcome.committed == {("orders", 2, 1): 0}
    idle = FakeTransactionalProducer()
    assert write(idle, a_window(), skip={("orders", 5, 1), ("orders", 2, 1)}) == WindowOutcome(committed={})
    assert idle.calls == []


def test_no_window_is_written_without_a_generation_of_the_group() -> None:
    """Offsets with generation -1 are not checked by the group coordinator (KIP-447 keeps them for old
    clients): a writer without a generation writes nothing."""
    for metadata in (None, NO_GENERATION, b"not metadata"):
        producer = FakeTransactionalProducer()
        outcome = write(producer, a_window(), metadata=metadata)
        assert isinstance(outcome.error, OwnershipUnconfirmed) and outcome.committed is None
        assert producer.calls == []


@pytest.mark.parametrize("code", [KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID,
                                  KafkaError.FENCED_INSTANCE_ID])
def test_offsets_refused_by_the_group_abort_the_window(code: int) -> None:
    """A member no longer in the generation (a paused owner that lost its buckets) has its window's
    offsets refused; the window is aborted and its callers told to retry (OwnershipUnconfirmed)."""
    producer = FakeTransactionalProducer(fail={"send_offsets": kafka_error(code, abortable=True)})
    outcome = write(producer, a_window())
    assert producer.calls == ["begin", "flush", "send_offsets", "abort"]
    assert outcome.committed is None and not outcome.producer_broken
    assert isinstance(outcome.error, OwnershipUnconfirmed) and outcome.error.retriable


def test_an_abortable_commit_failure_aborts_the_window() -> None:
    """A record the broker refused fails the commit; the window is aborted, its error retriable."""
    producer = FakeTransactionalProducer(fail={"commit": kafka_error(KafkaError.NOT_ENOUGH_REPLICAS, abortable=True)})
    outcome = write(producer, a_window())
    assert producer.calls[-2:] == ["commit", "abort"]
    assert outcome.committed is None and outcome.error is not None and outcome.error.retriable


def test_a_retriable_commit_failure_is_committed_again() -> None:
    """librdkafka says a timed-out commit may be asked again: it is, and the window commits."""
    producer = FakeTransactionalProducer(fail={"commit": kafka_error(KafkaError._TIMED_OUT, retriable=True)})
    outcome = write(producer, a_window())
    assert producer.calls == ["begin", "flush", "send_offsets", "commit", "commit"]
    assert outcome.committed is not None


def test_a_fenced_producer_is_rebuilt_without_an_abort() -> None:
    """A fatal error (another producer initialized the id, or the coordinator timed the transaction
    out) leaves the producer unusable: the outcome asks for a new one."""
    producer = FakeTransactionalProducer(fail={"commit": kafka_error(KafkaError._FENCED, fatal=True)})
    outcome = write(producer, a_window())
    assert outcome.producer_broken and outcome.committed is None
    assert "abort" not in producer.calls


def test_records_not_acknowledged_in_time_abort_the_window() -> None:
    """A flush that leaves records unacknowledged at the window's deadline aborts it before any offset is sent."""
    producer = FakeTransactionalProducer()
    producer.unflushed = 2
    outcome = write(producer, a_window())
    assert producer.calls == ["begin", "flush", "abort"]
    assert isinstance(outcome.error, BrokerUnavailable) and outcome.committed is None


def test_an_abort_that_fails_asks_for_a_new_producer() -> None:
    """When even the abort fails, only a new producer's init_transactions can end the transaction."""
    producer = FakeTransactionalProducer(fail={"send_offsets": kafka_error(KafkaError.ILLEGAL_GENERATION, abortable=True),
                                               "abort": kafka_error(KafkaError._TIMED_OUT, retriable=True)})
    outcome = write(producer, a_window())
    assert outcome.producer_broken and isinstance(outcome.error, OwnershipUnconfirmed)


def test_a_full_local_queue_is_waited_out() -> None:
    """BufferError from produce() is back-pressure: the writer polls and produces the same record again."""
    producer = FakeTransactionalProducer(buffer_errors=3)
    outcome = write(producer, a_window())
    assert outcome.committed is not None and len(producer.produced) == 5 and producer.polls == 3


def test_a_coordinator_call_that_never_returns_fails_the_window_as_wedged(monkeypatch: pytest.MonkeyPatch) -> None:
    """send_offsets_to_transaction that does not return (librdkafka with a gone group coordinator) fails
    the window within its timeout and the grace, with the producer marked wedged, not closed or aborted;
    a new producer then writes through a new calling thread."""
    monkeypatch.setattr(fanout, "CALL_GRACE_S", 0.1)
    release = threading.Event()

    class Hanging(FakeTransactionalProducer):
        def send_offsets_to_transaction(self, offsets: list[Any], metadata: bytes, timeout: float) -> None:
            self._step("send_offsets")
            release.wait(30)

    hanging = Hanging()
    writer = WindowWriter(hanging, {"orders": "sluice.changelog.orders"}, timeout_s=0.2)
    started = time.monotonic()
    outcome = writer.write(a_window(), set(), GENERATION_3)
    assert time.monotonic() - started < 5
    assert outcome.producer_broken and outcome.producer_wedged and outcome.committed is None
    assert isinstance(outcome.error, BrokerUnavailable) and "did not return" in str(outcome.error)
    assert hanging.calls == ["begin", "flush", "send_offsets"]
    fresh = FakeTransactionalProducer()
    writer.replace_producer(fresh, wedged=True)
    assert writer.write(a_window(), set(), GENERATION_3).committed is not None
    assert fresh.calls == ["begin", "flush", "send_offsets", "commit"]
    release.set()
    writer.close()



# --- 6. a transaction takes in the window accepted while its records are acknowledged ----------------


class SlowAcks(FakeTransactionalProducer):
    """A producer whose flush waits, up to its timeout, until ``acked`` is set (the partitions of a
    transaction wait for the coordinator to register them), and leaves a record unacknowledged if not."""

    def __init__(self) -> None:
        super().__init__()
        self.acked = threading.Event()

    def flush(self, timeout: float) -> int:
        self.acked.wait(timeout)
        super().flush(timeout)
        return 0 if self.acked.is_set() else 1


def a_later_window() -> Window:
    """Bucket 5 again (its changelog's next record) and bucket 7, with a request waiting on each."""
    w = Window()
    w.add(("orders", 5, 1), 40, ("sluice.changelog.orders", 5, b"a", b"a3", None), [])
    w.add(("orders", 7, 1), 12, ("sluice.changelog.orders", 7, b"c", b"c1", None),
          [("sluice.queue.q", 1, b"c", b"qc1", None)])
    w.waiting.append((Pending(lambda _: None), frozenset({("orders", 5, 1), ("orders", 7, 1)})))
    return w


def test_a_window_absorbs_a_later_one_after_its_own_records() -> None:
    """Window.absorb: the later window's records follow in their order, its last changelog indexes move
    with them, checkpoints and waiting requests join, and it counts as a window absorbed."""
    window, later = a_window(), a_later_window()
    window.absorb(later)
    assert [r[3] for r, _ in window.records] == [b"a1", b"qa1", b"b1", b"a2", b"qa2", b"a3", b"c1", b"qc1"]
    assert window.last_changelog == {("orders", 5, 1): 5, ("orders", 2, 1): 2, ("orders", 7, 1): 6}
    assert window.checkpoints == {("orders", 5, 1): 40, ("orders", 2, 1): 0, ("orders", 7, 1): 12}
    assert len(window.waiting) == 1 and window.absorbed == 1


def test_records_accepted_while_a_window_is_acknowledged_join_its_transaction() -> None:
    """While the first records wait to be acknowledged, the window accepted since is taken in: one
    begin and one commit for both, its records produced after the first ones, every bucket's checkpoint
    sent, and each bucket's last changelog offset the later window's."""
    producer = SlowAcks()
    window = a_window()
    later = [a_later_window()]
    asked: list[int] = []

    def absorb(writing: Window) -> Window | None:
        asked.append(len(writing.records))
        if later:
            return later.pop()
        producer.acked.set()
        return None

    outcome = WindowWriter(producer, {"orders": "sluice.changelog.orders"}, timeout_s=5).write(
        window, set(), GENERATION_3, absorb)
    assert producer.calls.count("begin") == 1 and producer.calls[-2:] == ["send_offsets", "commit"]
    assert asked[:2] == [5, 8]
    assert [v for _, _, v in producer.produced] == [b"a1", b"qa1", b"b1", b"a2", b"qa2", b"a3", b"c1", b"qc1"]
    assert producer.offsets == [("sluice.changelog.orders", 5, 40, TRANSACTIONAL_CHECKPOINT),
                                ("sluice.changelog.orders", 2, 0, TRANSACTIONAL_CHECKPOINT),
                                ("sluice.changelog.orders", 7, 12, TRANSACTIONAL_CHECKPOINT)]
    assert outcome.committed == {("orders", 5, 1): 40, ("orders", 2, 1): 0, ("orders", 7, 1): 12}
    assert outcome.last_offsets == {("orders", 5, 1): 102, ("orders", 2, 1): 100, ("orders", 7, 1): 100}
    assert window.absorbed == 1 and len(window.waiting) == 1


def test_a_window_with_nothing_to_take_in_commits_as_it_is() -> None:
    """Nothing accepted since: the window's own records, its own checkpoints."""
    producer = SlowAcks()

    def absorb(_: Window) -> Window | None:
        producer.acked.set()
        return None

    outcome = WindowWriter(producer, {"orders": "sluice.changelog.orders"}, timeout_s=5).write(
        a_window(), set(), GENERATION_3, absorb)
    assert [v for _, _, v in producer.produced] == [b"a1", b"qa1", b"b1", b"a2", b"qa2"]
    assert outcome.committed == {("orders", 5, 1): 40, ("orders", 2, 1): 0}


def test_a_transaction_takes_records_in_only_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records never acknowledged: the writer stops asking for later windows after ABSORB_FOR_S and
    aborts the window at its deadline, with nothing sent as offsets."""
    monkeypatch.setattr(fanout, "ABSORB_FOR_S", 0.05)
    producer = SlowAcks()
    asked: list[float] = []
    started = time.monotonic()

    def absorb(_: Window) -> Window | None:
        asked.append(time.monotonic() - started)
        return None

    outcome = WindowWriter(producer, {"orders": "sluice.changelog.orders"}, timeout_s=0.5).write(
        a_window(), set(), GENERATION_3, absorb)
    assert asked and max(asked) < 0.25
    assert isinstance(outcome.error, BrokerUnavailable) and outcome.committed is None
    assert "send_offsets" not in producer.calls and producer.calls[-1] == "abort"
