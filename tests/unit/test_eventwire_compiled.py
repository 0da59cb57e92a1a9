"""The compiled per-event readers (core/_eventwire.pyx) against their Python reference (core/eventwire.py).

The Python readers are themselves checked against fastavro (test_eventwire.py); here every answer of
the compiled twin must equal theirs, for bodies that read and for damaged ones (where the compiled
reader must give up, so the Python reader can refuse them with its reason).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core import eventwire as wire
from sluice.core import kafka
from sluice.core.codec import get_codec
from sluice.core.errors import MalformedRecord
from sluice.core.events import EntryEvent

sys.path.insert(0, str(Path(__file__).parent))
from eventstrategies import events  # noqa: E402
from test_eventwire import damaged_body  # noqa: E402

compiled = wire._compiled  # noqa: SLF001 - the module under test
needs_compiled = pytest.mark.skipif(compiled is None, reason="SLUICE_PURE_PYTHON is set")


def test_make_built_the_compiled_module() -> None:
    """`make` (pip install -e .) builds the module; only SLUICE_PURE_PYTHON turns it off."""
    if os.environ.get("SLUICE_PURE_PYTHON", "") not in ("", "0"):
        assert not wire.COMPILED
        return
    assert wire.COMPILED, "services/core/_eventwire.pyx is not built: run `make install` (pip install -e .)"


@needs_compiled
@settings(max_examples=300, deadline=None, database=None)
@given(events)
def test_a_body_reads_the_same(event: EntryEvent) -> None:
    body = wire.entry_event_body(event)
    assert compiled.decode_entry(body) == wire.decode_entry_py(body)
    assert compiled.decode_entry(body)[0] == event


@needs_compiled
@settings(max_examples=800, deadline=None, database=None)
@given(events, st.data())
def test_a_damaged_body_reads_the_same_or_is_left_to_the_python_reader(event: EntryEvent,
                                                                      data: st.DataObject) -> None:
    damaged = damaged_body(event, data)
    try:
        expected = wire.decode_entry_py(damaged)
    except MalformedRecord:
        expected = None
    assert compiled.decode_entry(damaged) == expected


@needs_compiled
@pytest.mark.parametrize("body", [b"", b"\x02", b"\x80" * 12, b"\x02a\x02b" + b"\xff" * 11,
                                  b"\x04\xff\xfe\x02b\x00\x00"])
def test_bodies_that_are_not_events_are_left_to_the_python_reader(body: bytes) -> None:
    assert compiled.decode_entry(body) is None
    with pytest.raises(MalformedRecord):
        wire.decode_entry(body)


DSIDS = st.integers(min_value=1, max_value=255)


@needs_compiled
@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(events, min_size=1, max_size=4), st.data())
def test_a_batch_event_reads_the_same(evs: list[EntryEvent], data: st.DataObject) -> None:
    """The sender's changes (visited sites per region, the batch's and each event's duplicate flag) merge
    into event and body as the Python reference merges them."""
    bodies = [wire.entry_event_body(e) for e in evs]
    regions = sorted({e.region for e in evs})
    added = data.draw(st.dictionaries(st.sampled_from(regions), st.lists(DSIDS, max_size=4), max_size=len(regions)))
    flags = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=len(evs) - 1))))
    value = wire.gateway_batch(get_codec().header("GatewayBatch"), sender_id="to-b", source_dsid=data.draw(DSIDS),
                               target_dsid=2, queue_partition=0, batch_id=1, first_offset=0, last_offset=1,
                               possible_duplicate=data.draw(st.booleans()), created_at=0, bodies=bodies,
                               duplicate_events=flags, visited_added=added, traceparents=[])
    view = wire.read_gateway_batch(get_codec(), value)
    for i in range(len(evs)):
        assert compiled.batch_event_body(view, i) == wire.batch_event_body_py(view, i)


@needs_compiled
@settings(max_examples=500, deadline=None, database=None)
@given(st.binary(max_size=40))
def test_murmur2_is_kafkas(data: bytes) -> None:
    assert compiled.murmur2(data) == kafka.murmur2_py(data)
    assert kafka.murmur2(data) == kafka.murmur2_py(data)


def test_murmur2_of_known_keys() -> None:
    """Kafka's own values (its ``UtilsTest.testMurmur2``), whichever implementation is in use."""
    assert kafka.murmur2(b"21") == -973932308
    assert kafka.murmur2(b"foobar") == -790332482
    assert kafka.murmur2(b"a-little-bit-long-string") == -985981536
    assert kafka.murmur2(b"a-little-bit-longer-string") == -1486304829
    assert kafka.murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") == -58897971
    assert kafka.murmur2(b"abc") == 479470107


@needs_compiled
@settings(max_examples=300, deadline=None, database=None)
@given(events)
def test_a_body_is_written_the_same(event: EntryEvent) -> None:
    assert compiled.entry_event_body(event) == wire.entry_event_body_py(event)


@needs_compiled
@pytest.mark.parametrize("change", [
    {"bucket": 2**31}, {"origin_dsid": -(2**31) - 1}, {"visited_dsids": (1, 2**40)}, {"visited_dsids": [1, 2]},
    {"value": bytearray(b"{}")}, {"key": "\ud800"}, {"event_time": 2**63},
])
def test_an_event_no_body_holds_is_left_to_the_python_writer(change: dict) -> None:
    """Numbers beyond their Avro type, and fields of unexpected types: the compiled writer gives up, and
    the Python writer gives the answer (an error naming what is wrong, or the body of a list)."""
    from dataclasses import replace

    from sluice.core.events import EventID, Operation, VersionTag

    event = replace(EntryEvent("r", "k", Operation.CREATE, b"1", EventID("m", 1, 2), VersionTag(1, 3, 1, "m"), 1, 0,
                               4), **change)
    assert compiled.entry_event_body(event) is None
    try:
        expected: object = wire.entry_event_body_py(event)
    except (MalformedRecord, UnicodeEncodeError, TypeError) as exc:
        expected = type(exc)
    try:
        got: object = wire.entry_event_body(event)
    except (MalformedRecord, UnicodeEncodeError, TypeError) as exc:
        got = type(exc)
    assert got == expected


@needs_compiled
@settings(max_examples=300, deadline=None, database=None)
@given(events, st.integers(min_value=0, max_value=3), st.text(max_size=30), st.integers(-(2**31), 2**31 - 1),
       st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1))
def test_a_queue_record_is_written_the_same(event: EntryEvent, flags: int, queue_id: str, partition: int,
                                            offset: int, at: int) -> None:
    header = get_codec().header("QueuedEvent")
    body = wire.entry_event_body(event)
    assert compiled.queued_event(header, flags, queue_id, partition, offset, at, body) == \
        wire.queued_event_py(header, flags, queue_id, partition, offset, at, body)


@needs_compiled
def test_a_queue_record_no_record_holds_is_left_to_the_python_writer() -> None:
    header = get_codec().header("QueuedEvent")
    assert compiled.queued_event(header, 0, "q", 2**31, 0, 0, b"") is None
    with pytest.raises(MalformedRecord):
        wire.queued_event(header, 0, "q", 2**31, 0, 0, b"")


@needs_compiled
@settings(max_examples=200, deadline=None, database=None)
@given(events)
def test_an_event_built_without_its_init_equals_the_dataclass(event: EntryEvent) -> None:
    """Every field set, in order: equal, hashed and shown as the dataclass's own."""
    from dataclasses import astuple, fields

    made = compiled.new_entry_event(*(getattr(event, f.name) for f in fields(EntryEvent)))
    assert made == event and astuple(made) == astuple(event) and repr(made) == repr(event)
    version = compiled.new_version_tag(event.version.dsid, event.version.timestamp, event.version.entry_version,
                                       event.version.member_id)
    assert version == event.version and hash(version) == hash(event.version)
