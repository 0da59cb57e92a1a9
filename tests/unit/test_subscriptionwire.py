"""A client's read of its subscription messages from their bytes, against fastavro as the oracle.

``subscriptionwire.read_client_event`` reads the ClientMessages the service splices
(``eventwire.client_event_message``); ``messages.read_event`` turns one into the event listeners
see.  Whatever they read must be what fastavro reads of the same bytes (through the codec and
``messages.event_of_message``), and anything they do not read exactly so they leave to the codec
(None), damaged or not.
"""

from __future__ import annotations

from dataclasses import replace

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.client.messages import event_of_message, read_event
from sluice.core.codec import get_codec
from sluice.core.errors import CodecError
from sluice.core.events import EntryEvent
from sluice.core.eventwire import client_event_message, entry_event_body, entry_without_value, read_entry_head
from sluice.core.subscriptionwire import EVENT_HEAD, read_client_event

from eventstrategies import INT64, entry_events, events  # noqa: E402

CODEC = get_codec()
HEADER = CODEC.header("ClientMessage")
#: What the service writes as ``filled_at``: a wall time in ms, and any long that fits 9 bytes.
FILLED_AT = st.integers(min_value=-(2**62), max_value=2**62 - 1)
#: Values a listener can be given: JSON documents, or raw bytes.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**53), max_value=2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10).map(orjson.dumps)
LISTENED_EVENTS = (entry_events(values=st.none() | JSON_VALUES, value_encodings=st.just("json"))
                   | entry_events(values=st.none() | st.binary(max_size=100), value_encodings=st.just("raw")))


def spliced(event: EntryEvent, values: bool, duplicate: bool, filled_at: int) -> bytes:
    """The message the service writes of ``event`` for a client (its value cut for invalidates)."""
    body = entry_event_body(event)
    sent = body if values else entry_without_value(body, read_entry_head(body))
    return client_event_message(HEADER, sent, receive_values=values, possible_duplicate=duplicate,
                                filled_at=filled_at)


def fastavro_read(data: bytes) -> tuple[EntryEvent, bool, bool] | None:
    """(event, receive_values, possible_duplicate) as the codec reads ``data``; None when it refuses
    it or it is no event."""
    try:
        message = CODEC.decode_as("ClientMessage", data)
    except CodecError:
        return None
    if message["kind"] != "EVENT" or message["event"] is None:
        return None
    return EntryEvent.from_record(message["event"]), message["receive_values"], message["possible_duplicate"]


@settings(max_examples=400, deadline=None, database=None)
@given(events, st.booleans(), st.booleans(), FILLED_AT)
def test_a_spliced_message_is_read_as_fastavro_reads_it(event: EntryEvent, values: bool, duplicate: bool,
                                                         filled_at: int) -> None:
    """Every message the service writes is read from its bytes, and read as fastavro reads it."""
    data = spliced(event, values, duplicate, filled_at)
    read = read_client_event(HEADER, data)
    assert read is not None
    assert read == fastavro_read(data)
    assert read[0] == (event if values else replace(event, value=None))
    assert read[1:] == (values, duplicate)


@settings(max_examples=200, deadline=None, database=None)
@given(events, st.booleans(), st.booleans(), INT64)
def test_a_filled_at_of_any_long_is_read_as_fastavro_reads_it_or_left_to_it(
        event: EntryEvent, values: bool, duplicate: bool, filled_at: int) -> None:
    """A ``filled_at`` of 10 bytes (a long beyond 2**62) is left to the codec; any other is read."""
    data = spliced(event, values, duplicate, filled_at)
    read = read_client_event(HEADER, data)
    if read is None:
        assert not -(2**62) <= filled_at < 2**62
    else:
        assert read == fastavro_read(data)


@settings(max_examples=1000, deadline=None, database=None)
@given(events, st.booleans(), st.booleans(), FILLED_AT, st.data())
def test_a_damaged_message_is_read_as_fastavro_reads_it_or_left_to_it(
        event: EntryEvent, values: bool, duplicate: bool, filled_at: int, data: st.DataObject) -> None:
    """A message truncated, extended or with one byte changed (anywhere: header, body, the fields
    after it) is either left to the codec (None) or read exactly as fastavro reads it: never another
    event, never an exception."""
    message = bytearray(spliced(event, values, duplicate, filled_at))
    how = data.draw(st.sampled_from(["truncate", "extend", "flip", "flip-tail"]))
    if how == "truncate":
        damaged = bytes(message[:data.draw(st.integers(min_value=0, max_value=len(message) - 1))])
    elif how == "extend":
        damaged = bytes(message) + data.draw(st.binary(min_size=1, max_size=4))
    else:
        low = len(message) - 12 if how == "flip-tail" else 0
        i = data.draw(st.integers(min_value=max(0, low), max_value=len(message) - 1))
        message[i] ^= data.draw(st.integers(min_value=1, max_value=255))
        damaged = bytes(message)
    read = read_client_event(HEADER, damaged)
    if read is not None:
        assert read == fastavro_read(damaged)


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(["REGISTERED", "MARKER", "REFUSED", "UNKNOWN", "EVENT"]), st.text(max_size=20),
       st.integers(min_value=0, max_value=2**40), st.none() | events, st.booleans(), st.booleans(), FILLED_AT,
       st.text(max_size=40))
def test_any_other_message_is_left_to_the_codec_or_read_as_it_reads_it(
        kind: str, session: str, version: int, event: EntryEvent | None, values: bool, duplicate: bool,
        filled_at: int, reason: str) -> None:
    """Answers, markers, refusals, and events with a session, version or reason (which the service
    does not write) are left to the codec; what is read is what fastavro reads."""
    data = CODEC.encode("ClientMessage", {
        "kind": kind, "session": session, "version": version, "event": event and event.to_record(),
        "receive_values": values, "possible_duplicate": duplicate, "filled_at": filled_at, "reason": reason})
    read = read_client_event(HEADER, data)
    if kind != "EVENT" or event is None or session or version or reason:
        assert read is None
    else:
        assert read == fastavro_read(data)


def test_what_is_not_a_current_client_message_is_left_to_the_codec() -> None:
    """None, an empty record, another schema's header, or the event head alone."""
    event_bytes = spliced(next_event(), True, False, 1_764_000_000_000)
    assert read_client_event(HEADER, None) is None
    assert read_client_event(HEADER, b"") is None
    assert read_client_event(HEADER, HEADER + EVENT_HEAD) is None
    other = CODEC.header("EntryEvent")
    assert read_client_event(HEADER, other + event_bytes[len(HEADER):]) is None
    assert read_client_event(HEADER, event_bytes) is not None


def next_event() -> EntryEvent:
    from sluice.core.events import EventID, Operation, VersionTag

    return EntryEvent("orders", "o-1", Operation.UPDATE, b'{"qty":1}', EventID("m", 1, 2),
                      VersionTag(1, 2, 3, "m"), 1, 0, 5)


@settings(max_examples=300, deadline=None, database=None)
@given(LISTENED_EVENTS, st.booleans(), st.booleans(), FILLED_AT)
def test_the_client_makes_the_same_event_of_the_bytes_as_of_the_decoded_record(
        event: EntryEvent, values: bool, duplicate: bool, filled_at: int) -> None:
    """``read_event`` (the client's read of every event) gives the ClientEvent the codec's path gives:
    same fields, values parsed, delivery and possibleDuplicate as the message says."""
    data = spliced(event, values, duplicate, filled_at)
    fast = read_event(HEADER, data)
    assert fast is not None
    assert fast == event_of_message(CODEC.decode_as("ClientMessage", data))
    assert fast.possible_duplicate == (duplicate or event.possible_duplicate)
