"""Hypothesis strategies for events, shared by the unit tests of the byte-level code."""

from __future__ import annotations

from hypothesis import strategies as st

from sluice.core.events import EntryEvent, EventID, Operation, VersionTag

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def entry_events(values: st.SearchStrategy[bytes | None] = st.none() | st.binary(max_size=300),
                 value_encodings: st.SearchStrategy[str] = st.sampled_from(["json", "raw"])
                 ) -> st.SearchStrategy[EntryEvent]:
    """Any EntryEvent the schema can hold: every int and long at its bounds, any text."""
    return st.builds(
        EntryEvent,
        region=st.text(max_size=20),
        key=st.text(max_size=40),
        operation=st.sampled_from(list(Operation)),
        value=values,
        event_id=st.builds(EventID, st.text(max_size=20), INT64, INT64),
        version=st.builds(VersionTag, INT32, INT64, INT64, st.text(max_size=20)),
        origin_dsid=INT32,
        bucket=INT32,
        event_time=INT64,
        callback_argument=st.none() | st.text(max_size=30),
        possible_duplicate=st.booleans(),
        visited_dsids=st.lists(INT32, max_size=5).map(tuple),
        value_encoding=value_encodings,
        transaction=st.none() | st.tuples(st.text(max_size=20), st.booleans()),
    )


events = entry_events()
