"""The hand-written EntryEvent encoder writes exactly what fastavro writes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.avrowire import entry_event_body, varint
from sluice.core.codec import HEADER_BYTES, get_codec
from sluice.core.errors import MalformedRecord
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag

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
