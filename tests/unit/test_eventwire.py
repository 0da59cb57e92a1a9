"""The byte-level event helpers (core/eventwire.py) against fastavro as the oracle."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace

import fastavro
import fastavro.validation
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.codec import HEADER_BYTES, MARKER, get_codec, schema_dir
from sluice.core.errors import CodecError, MalformedRecord
from sluice.core.eventwire import (
    FLAG_POSSIBLE_DUPLICATE,
    FLAG_ROUTED,
    decode_entry,
    entry_event_body,
    entry_region_key,
    queued_event,
    read_queued,
    splice_entry,
    varint,
)
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag

FP_ENTRY = get_codec().fingerprint("EntryEvent")
#: What this reader refuses and fastavro reads: a varint beyond 64 bits (fastavro cuts it short), and a
#: negative enum symbol or union branch (fastavro counts it from the end of the list, as Python does).
STRICTER_THAN_FASTAVRO = re.compile(r"does not fit an Avro long|(symbol|branch) -\d")
INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)

events = st.builds(
    EntryEvent,
    region=st.text(max_size=20),
    key=st.text(max_size=40),
    operation=st.sampled_from(list(Operation)),
    value=st.none() | st.binary(max_size=300),
    event_id=st.builds(EventID, st.text(max_size=20), INT64, INT64),
    version=st.builds(VersionTag, INT32, INT64, INT64, st.text(max_size=20)),
    origin_dsid=INT32,
    bucket=INT32,
    event_time=INT64,
    callback_argument=st.none() | st.text(max_size=30),
    possible_duplicate=st.booleans(),
    visited_dsids=st.lists(INT32, max_size=5).map(tuple),
    value_encoding=st.sampled_from(["json", "raw"]),
    transaction=st.none() | st.tuples(st.text(max_size=20), st.booleans()),
)


@settings(max_examples=300, deadline=None, database=None)
@given(events)
def test_entry_event_body_is_byte_identical_to_fastavro(event: EntryEvent) -> None:
    """For any event, the hand-written body equals fastavro's encoding of the same record."""
    expected = get_codec().encode("EntryEvent", event.to_record())[HEADER_BYTES:]
    assert entry_event_body(event) == expected


@settings(max_examples=300, deadline=None, database=None)
@given(INT64)
def test_varint_round_trips_through_the_codec(n: int) -> None:
    """A zig-zag varint written here is read back by fastavro as the same long."""
    event = EntryEvent("r", "k", Operation.CREATE, None, EventID("m", 0, n), VersionTag(1, 0, 0), 1, 0, 0)
    body = entry_event_body(event)
    assert varint(n) in body
    record = get_codec().decode_as("EntryEvent", get_codec().encode("EntryEvent", event.to_record()))
    assert record["event_id"]["sequence_id"] == n


def test_numbers_beyond_their_avro_type_are_refused_not_wrapped() -> None:
    """A long beyond 64 bits, or an int beyond 32, is refused by both writers: never written as another number
    (2**70 would otherwise be read back as 64)."""
    event = EntryEvent("orders", "k", Operation.UPDATE, b"1", EventID("m", 1, 2**70), VersionTag(1, 0, 1), 1, 0, 0)
    with pytest.raises(MalformedRecord, match="does not fit an Avro long"):
        entry_event_body(event)
    with pytest.raises(MalformedRecord):
        get_codec().encode("EntryEvent", event.to_record(), validate=False)
    with pytest.raises(MalformedRecord):
        get_codec().encode("EntryEvent", event.to_record())
    wide_bucket = replace(event, event_id=EventID("m", 1, 5), bucket=2**40)
    with pytest.raises(MalformedRecord, match="does not fit an Avro int"):
        entry_event_body(wide_bucket)
    with pytest.raises(MalformedRecord):
        get_codec().encode("EntryEvent", wide_bucket.to_record())
    for edge in (-(2**63), 2**63 - 1):
        assert get_codec().decode_as("EntryEvent", get_codec().encode("EntryEvent", replace(
            event, event_id=EventID("m", 1, edge)).to_record()))["event_id"]["sequence_id"] == edge
    with pytest.raises(MalformedRecord):
        varint(2**63)


@settings(max_examples=300, deadline=None, database=None)
@given(events)
def test_decode_entry_reads_back_what_fastavro_writes(event: EntryEvent) -> None:
    """The hand-written reader returns the very event of any body fastavro wrote, and the region and
    key from the first two fields alone."""
    body = get_codec().encode("EntryEvent", event.to_record())[HEADER_BYTES:]
    decoded, _ = decode_entry(body)
    assert decoded == EntryEvent.from_record(get_codec().decode_as("EntryEvent", MARKER + FP_ENTRY + body))
    assert decoded == event
    assert entry_region_key(body) == (event.region, event.key)


@settings(max_examples=300, deadline=None, database=None)
@given(events, st.booleans(), st.none() | st.lists(INT32, max_size=6).map(tuple), st.none() | INT32)
def test_a_spliced_body_is_the_body_of_the_changed_event(event: EntryEvent, duplicate: bool,
                                                           visited: tuple[int, ...] | None, bucket: int | None) -> None:
    """Changing possibleDuplicate, the visited sites or the bucket by splicing gives the bytes fastavro
    writes for the event with those fields changed, and the bytes around them are copied untouched."""
    body = entry_event_body(event)
    _, layout = decode_entry(body)
    changed = replace(event, possible_duplicate=duplicate,
                      visited_dsids=event.visited_dsids if visited is None else visited,
                      bucket=event.bucket if bucket is None else bucket)
    spliced = splice_entry(body, layout, possible_duplicate=duplicate, visited_dsids=visited, bucket=bucket)
    assert spliced == get_codec().encode("EntryEvent", changed.to_record())[HEADER_BYTES:]
    assert splice_entry(body, layout) == body


@settings(max_examples=200, deadline=None, database=None)
@given(events, st.integers(min_value=0, max_value=3), st.text(max_size=30), INT32, INT64, INT64)
def test_a_queue_record_reads_down_to_its_event_body(event: EntryEvent, flags: int, queue_id: str, partition: int,
                                                      offset: int, at: int) -> None:
    """queued_event writes what fastavro writes for a QueuedEvent, and read_queued gives its fields and
    the event's body without decoding the event."""
    codec = get_codec()
    body = entry_event_body(event)
    data = queued_event(codec.header("QueuedEvent"), flags, queue_id, partition, offset, at, body)
    record = {"flags": flags, "queue_id": queue_id, "changelog_partition": partition, "changelog_offset": offset,
              "enqueued_at": at, "event": event.to_record()}
    assert data == codec.encode("QueuedEvent", record)
    view = read_queued(codec, data)
    assert (view.flags, view.queue_id, view.changelog_partition, view.changelog_offset, view.enqueued_at,
            view.event_body) == (flags, queue_id, partition, offset, at, body)
    assert view.possible_duplicate == bool(flags & FLAG_POSSIBLE_DUPLICATE)
    assert view.routed == bool(flags & FLAG_ROUTED)


def test_a_queue_record_of_an_older_version_reads_the_same() -> None:
    """A QueuedEvent written before ``flags`` existed (avro/history/QueuedEvent.v2.avsc) reads as flags 0
    with the same event body."""
    codec = get_codec()
    old = fastavro.parse_schema(json.loads((schema_dir() / "history" / "QueuedEvent.v2.avsc").read_text()),
                                named_schemas={})
    fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(old), "CRC-64-AVRO"))
    event = EntryEvent("orders", "k", Operation.UPDATE, b"{}", EventID("m", 1, 2), VersionTag(1, 5, 1, "m"), 1, 3, 9,
                       visited_dsids=(2,), transaction=("m/1/2", True))
    buf = io.BytesIO()
    buf.write(MARKER + fp)
    fastavro.schemaless_writer(buf, old, {"queue_id": "q", "changelog_partition": 3, "changelog_offset": 7,
                                          "enqueued_at": 11, "event": event.to_record()})
    view = read_queued(codec, buf.getvalue())
    assert (view.flags, view.queue_id, view.changelog_partition, view.changelog_offset, view.enqueued_at) == \
        (0, "q", 3, 7, 11)
    assert view.event_body == entry_event_body(event)


@settings(max_examples=500, deadline=None, database=None)
@given(events, st.data())
def test_damaged_bodies_are_refused_like_fastavro_refuses_them(event: EntryEvent, data: st.DataObject) -> None:
    """A truncated, extended or altered body is either refused with MalformedRecord or, where fastavro
    reads it too, read as fastavro reads it: never another exception, never another event."""
    body = bytearray(entry_event_body(event))
    how = data.draw(st.sampled_from(["truncate", "extend", "flip"]))
    if how == "truncate":
        damaged = bytes(body[:data.draw(st.integers(min_value=0, max_value=len(body) - 1))])
    elif how == "extend":
        damaged = bytes(body) + data.draw(st.binary(min_size=1, max_size=4))
    else:
        i = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
        body[i] ^= data.draw(st.integers(min_value=1, max_value=255))
        damaged = bytes(body)
    try:
        record = get_codec().decode_as("EntryEvent", MARKER + FP_ENTRY + damaged)
        # fastavro does not check an int's range when it reads; the hand-written reader does.
        fastavro.validation.validate(record, get_codec().parsed_schema("EntryEvent"), raise_errors=True)
        expected = EntryEvent.from_record(record)
    except (CodecError, fastavro.validation.ValidationError):
        expected = None
    except (KeyError, ValueError):
        expected = None  # a record fastavro reads but an EntryEvent cannot hold (an unknown operation)
    try:
        decoded, _ = decode_entry(damaged)
    except MalformedRecord as exc:
        if STRICTER_THAN_FASTAVRO.search(str(exc)):
            return
        decoded = None
    assert decoded == expected
