"""The queue loop's per-record path (issue 18) keeps what the slower path gave: the compiled queue-record
reader answers exactly what its Python reference answers or leaves the record to it, a run of records
joins a batcher exactly as the same records added one by one, and a record skipped in the middle of a
poll (dead-lettered, filtered) or a change of partition never reorders what a batch covers."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core import eventwire as wire
from sluice.core.batching import BatchPolicy, PartitionBatcher
from sluice.core.codec import get_codec
from sluice.core.errors import MalformedRecord
from sluice.core.events import EntryEvent
from sluice.core.eventwire import entry_event_body, queued_event

sys.path.insert(0, str(Path(__file__).parent))
from eventstrategies import INT32, INT64, events  # noqa: E402
from test_queueloop import FakeMessage, Sender, dead_letters, entry, make_loop, record, waiting  # noqa: E402

compiled = wire._compiled  # noqa: SLF001 - the module under test
needs_compiled = pytest.mark.skipif(compiled is None, reason="SLUICE_PURE_PYTHON is set")


def python_answer(header: bytes, data: bytes | None) -> tuple[int, bytes] | None:
    """What the Python reference says of a record; None also where it refuses it."""
    try:
        return wire.queued_flags_body_py(header, data)
    except MalformedRecord:
        return None


@needs_compiled
@settings(max_examples=300, deadline=None, database=None)
@given(events, st.integers(min_value=-(2**31), max_value=2**31 - 1), st.text(max_size=30), INT32, INT64, INT64)
def test_the_compiled_queue_reader_reads_every_current_record_as_the_python_one(
        event: EntryEvent, flags: int, queue_id: str, partition: int, offset: int, at: int) -> None:
    header = get_codec().header("QueuedEvent")
    data = queued_event(header, flags, queue_id, partition, offset, at, entry_event_body(event))
    assert compiled.queued_flags_body(header, data) == wire.queued_flags_body_py(header, data) is not None
    assert wire.queued_flags_body_lean(header, data) == wire.queued_flags_body(header, data)


@needs_compiled
@settings(max_examples=1000, deadline=None, database=None)
@given(events, st.data())
def test_the_compiled_queue_reader_answers_a_damaged_record_as_the_python_one_or_leaves_it(
        event: EntryEvent, data: st.DataObject) -> None:
    """Cut short, a byte altered, a long varint or a bad length anywhere in the fields it reads: the compiled
    reader gives the Python reader's answer, or None where that one refuses or sees another header."""
    header = get_codec().header("QueuedEvent")
    record_ = bytearray(queued_event(header, data.draw(st.integers(0, 7)), data.draw(st.text(max_size=8)),
                                     data.draw(INT32), data.draw(INT64), data.draw(INT64), entry_event_body(event)))
    how = data.draw(st.sampled_from(["cut", "flip", "varint"]))
    if how == "cut":
        record_ = record_[:data.draw(st.integers(min_value=0, max_value=len(record_) - 1))]
    elif how == "flip":
        i = data.draw(st.integers(min_value=0, max_value=min(len(record_) - 1, len(header) + 40)))
        record_[i] ^= data.draw(st.integers(min_value=1, max_value=255))
    else:
        i = data.draw(st.integers(min_value=len(header), max_value=len(header) + 30))
        record_[i:i] = b"\xff" * data.draw(st.integers(min_value=1, max_value=12))
    damaged = bytes(record_)
    assert compiled.queued_flags_body(header, damaged) == python_answer(header, damaged)


@needs_compiled
def test_the_compiled_queue_reader_leaves_what_is_not_bytes_to_the_python_one() -> None:
    header = get_codec().header("QueuedEvent")
    data = record(entry("a", 0))
    assert compiled.queued_flags_body(header, None) is None
    assert compiled.queued_flags_body(header, bytearray(data)) is None
    assert compiled.queued_flags_body(header, data[:5]) is None
    assert compiled.queued_flags_body(header, data) is not None


@dataclass(frozen=True)
class Item:
    offset: int
    key: str
    conflatable: bool
    size_bytes: int


def batches(batcher: PartitionBatcher[Item]) -> list[tuple[int, int, list[int], int, int]]:
    out = []
    while (batch := batcher.take(10**9, force=True)) is not None:
        out.append((batch.batch_id, batch.first_offset, [i.offset for i in batch.events], batch.commit_offset,
                    batch.nbytes))
        batcher.accepted()
    return out


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 4), st.booleans(), st.integers(0, 500)), max_size=40),
       st.integers(1, 7), st.booleans(), st.lists(st.integers(0, 40), max_size=5))
def test_a_run_joins_a_batcher_as_the_same_events_added_one_by_one(
        steps: list[tuple[int, int, bool, int]], batch_size: int, conflation: bool, cuts: list[int]) -> None:
    """``extend`` (runs cut anywhere) leaves the batcher as ``add`` of each event does, conflating or not:
    the same batches, offsets, commits and sizes."""
    policy = BatchPolicy(batch_size=batch_size, conflation=conflation)
    items, offset = [], 0
    for gap, key, update, size in steps:
        offset += gap
        items.append(Item(offset, f"k{key}", update, size))
    one_by_one: PartitionBatcher[Item] = PartitionBatcher(0, policy)
    for item in items:
        one_by_one.add(item, 0)
    in_runs: PartitionBatcher[Item] = PartitionBatcher(0, policy)
    bounds = sorted({0, len(items), *(c for c in cuts if c <= len(items))})
    for start, end in zip(bounds, bounds[1:]):
        in_runs.extend(items[start:end], 0)
    assert in_runs.buffered_bytes == one_by_one.buffered_bytes and in_runs.waiting == one_by_one.waiting
    assert batches(in_runs) == batches(one_by_one)


def test_a_record_dead_lettered_in_the_middle_of_a_run_leaves_the_batch_covering_from_the_first(
        tmp_path: Path) -> None:
    """Events read before an unreadable record are in the batcher before its offset is skipped: the
    batch starts at the first record, holds every event in order and ends after the last."""
    loop = make_loop(tmp_path)
    good = [record(entry(f"k{i}", i)) for i in range(8)]
    msgs = [FakeMessage(good[i], 0, i) for i in range(3)] + [FakeMessage(b"\x00not avro", 0, 3)] + \
        [FakeMessage(good[i], 0, i) for i in range(4, 8)]
    loop._read(msgs, now_ms=0)
    batch = waiting(loop)
    assert (batch.first_offset, [e.offset for e in batch.events], batch.commit_offset) == \
        (0, [0, 1, 2, 4, 5, 6, 7], 8)
    assert [d["source_offset"] for d in dead_letters(loop)] == [3]


def test_records_of_two_partitions_interleaved_each_join_their_own_batch_in_order(tmp_path: Path) -> None:
    """A poll hands over runs of one partition after another: each run goes to its own partition."""
    loop = make_loop(tmp_path)
    msgs = [FakeMessage(record(entry(f"p{p}-{o}", o)), p, o)
            for p, offsets in ((0, (0, 1)), (1, (0, 1, 2)), (0, (2,)), (1, (3,)), (0, (3, 4)))
            for o in offsets]
    loop._read(msgs, now_ms=0)
    for partition, count in ((0, 5), (1, 4)):
        batch = waiting(loop, partition)
        assert [e.key for e in batch.events] == [f"p{partition}-{o}" for o in range(count)]
        assert (batch.first_offset, batch.commit_offset) == (0, count)


def test_a_sender_batches_routed_records_in_runs_around_those_its_loop_check_refuses(tmp_path: Path) -> None:
    """Routed records join in runs; an unrouted one refused by ``accepts`` is skipped after them, in order."""
    loop = make_loop(tmp_path, Sender)
    keys = ["a", "b", "x-looped", "c", "d"]
    msgs = [FakeMessage(record(entry(k, i), 0 if k.startswith("x") else wire.FLAG_ROUTED), 0, i)
            for i, k in enumerate(keys)]
    loop._read(msgs, now_ms=0)
    batch = waiting(loop)
    assert ([e.key for e in batch.events], batch.first_offset, batch.commit_offset) == (["a", "b", "c", "d"], 0, 5)
    assert loop.asked == ["x-looped"]  # type: ignore[attr-defined]
