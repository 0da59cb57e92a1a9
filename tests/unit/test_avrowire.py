"""The hand-written EntryEvent encoder writes exactly what fastavro writes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.avrowire import entry_event_body, varint
from sluice.core.codec import HEADER_BYTES, get_codec
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
