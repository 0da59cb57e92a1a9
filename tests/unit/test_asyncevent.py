"""AsyncEvent: an event made from its queued bytes shows what the decoded event shows, decodes on first
touch only what needs decoding, and a damaged body is refused with its reason on every touch."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core import asyncevent
from sluice.core.asyncevent import AsyncEvent, undecodable
from sluice.core.codec import HEADER_BYTES, get_codec
from sluice.core.errors import MalformedRecord
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import entry_event_body
from sluice.core.queueloop import TracedEvent, event_traceparent

from eventstrategies import entry_events  # noqa: E402

events = entry_events(values=st.none() | st.just(b'{"qty": 3}') | st.binary(max_size=50), value_encodings=st.just("raw"))

FIELDS = ("operation", "region", "key", "raw_value", "value", "callback_argument", "event_id", "sequence_id",
          "version", "transaction", "conflatable", "queue_id", "partition", "offset", "possible_duplicate")


def sample(key: str = "order-1", op: Operation = Operation.UPDATE) -> EntryEvent:
    return EntryEvent(region="orders", key=key, operation=op, value=b'{"qty": 1}', event_id=EventID("m", 1, 7),
                      version=VersionTag(1, 1_700_000_000_000, 2, "m"), origin_dsid=1, bucket=3,
                      event_time=1_700_000_000_000)


@pytest.fixture()
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every body AsyncEvent decodes in full, in order."""
    seen: list[bytes] = []
    real = asyncevent.decode_entry

    def counting(body: bytes, pos: int = 0) -> Any:
        seen.append(body)
        return real(body, pos)

    monkeypatch.setattr(asyncevent, "decode_entry", counting)
    return seen


@settings(max_examples=200, deadline=None, database=None)
@given(events, st.booleans())
def test_an_event_made_from_its_body_shows_every_field_the_decoded_event_shows(event: EntryEvent,
                                                                                 duplicate: bool) -> None:
    """For any event, every property of ``of_body`` equals that of the event built decoded, the body is
    the one it was made from, and the two are equal values."""
    body = entry_event_body(event)
    lazy = AsyncEvent.of_body(body, "q", 3, 41, duplicate)
    decoded = AsyncEvent(event, "q", 3, 41, duplicate)
    for name in FIELDS:
        assert getattr(lazy, name) == getattr(decoded, name), name
    assert lazy.event == event and lazy.body is body and decoded.body == body
    assert lazy == decoded and hash(lazy) == hash(decoded)


def test_routing_fields_and_size_are_read_without_decoding_the_event(decodes: list[bytes]) -> None:
    """Region, key, conflatable, size, body and where it was queued need no full decode; the first field
    that does decodes the body once, and every later touch reuses it."""
    body = entry_event_body(sample())
    event = AsyncEvent.of_body(body, "q", 3, 41, True)
    assert (event.region, event.key, event.conflatable, event.body) == ("orders", "order-1", True, body)
    assert (event.queue_id, event.partition, event.offset, event.possible_duplicate) == ("q", 3, 41, True)
    assert event.size_bytes == len(body) + 64
    assert decodes == []
    assert event.operation is Operation.UPDATE and event.value == {"qty": 1} and event.sequence_id == 7
    assert event.event_id == EventID("m", 1, 7) and event.version.entry_version == 2
    assert decodes == [body]
    assert event.size_bytes == len(body) + 64, "the size an event was added with never changes"


def test_a_damaged_body_raises_malformed_record_with_its_reason_on_every_touch(decodes: list[bytes]) -> None:
    """A body cut short reads its region and key (they are whole) but refuses every decoded field with
    MalformedRecord naming where the event was queued and why; it is decoded once and remembered."""
    body = entry_event_body(sample())[:-3]
    event = AsyncEvent.of_body(body, "q", 5, 99, False)
    assert event.key == "order-1" and event.decode_error is None
    for name in ("operation", "value", "event_id", "transaction", "event"):
        with pytest.raises(MalformedRecord, match=r"the event at q\[5\]@99 does not decode: .*truncated"):
            getattr(event, name)
    assert len(decodes) == 1
    assert event.decode_error is not None and "truncated" in event.decode_error.reason
    assert undecodable([AsyncEvent.of_body(entry_event_body(sample()), "q", 5, 98, False), event]) == [event]
    assert "undecodable @q[5]:99" in repr(event)


def test_a_body_damaged_in_its_first_fields_refuses_key_and_conflation() -> None:
    """A body whose key or operation does not read refuses ``key`` and ``conflatable`` (what the batcher
    asks) with MalformedRecord, and is then known undecodable."""
    body = entry_event_body(sample())
    cut = AsyncEvent.of_body(body[:9], "q", 0, 1, False)  # inside the key
    with pytest.raises(MalformedRecord, match="runs past the end"):
        cut.key
    assert cut.decode_error is not None
    bad_op = bytearray(body)
    bad_op[len("orders") + 1 + len("order-1") + 1] = 0x7E  # symbol 63: no such operation
    event = AsyncEvent.of_body(bytes(bad_op), "q", 0, 2, False)
    assert event.key == "order-1"
    with pytest.raises(MalformedRecord, match="EntryEvent.operation: symbol 63"):
        event.conflatable
    assert undecodable([cut, event]) == [cut, event]


def test_a_decoded_event_gives_its_body_encoded_once_as_fastavro_writes_it() -> None:
    """``body`` of an event built decoded is fastavro's encoding of it, made on first touch and kept."""
    event = AsyncEvent(sample(), "q", 0, 1, False)
    assert event.body == get_codec().encode("EntryEvent", sample().to_record())[HEADER_BYTES:]
    assert event.body is event.body
    assert event.size_bytes == len("order-1") + len(b'{"qty": 1}') + 64


def test_an_event_is_a_value_its_fields_cannot_be_set() -> None:
    """Every field is read-only, for an event built either way."""
    for event in (AsyncEvent(sample(), "q", 0, 1, False),
                  AsyncEvent.of_body(entry_event_body(sample()), "q", 0, 1, False)):
        for name in ("offset", "possible_duplicate", "event", "key", "body"):
            with pytest.raises(AttributeError):
                setattr(event, name, None)


def test_a_traced_event_keeps_its_records_trace_context_either_way() -> None:
    """TracedEvent, made decoded or from its body, carries the record's traceparent and shows the same
    event; equal events with different trace contexts are not equal."""
    parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    lazy = TracedEvent.of_body(entry_event_body(sample()), "q", 2, 8, False, parent)
    decoded = TracedEvent(sample(), "q", 2, 8, False, parent)
    assert isinstance(lazy, TracedEvent) and event_traceparent(lazy) == event_traceparent(decoded) == parent
    assert lazy.event == decoded.event and lazy == decoded
    assert lazy != TracedEvent(sample(), "q", 2, 8, False, None)
    assert event_traceparent(AsyncEvent(sample(), "q", 2, 8, False)) is None


def test_flagging_an_event_possible_duplicate_copies_it_and_leaves_the_original_as_it_was() -> None:
    """``as_possible_duplicate`` gives an equal event but for the flag (a traced one keeps its trace
    context, a damaged one its reason); the event a listener kept from an earlier offer still says False,
    and an event already flagged is returned as it is."""
    parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    original = TracedEvent.of_body(entry_event_body(sample()), "q", 2, 8, False, parent)
    flagged = original.as_possible_duplicate()
    assert flagged.possible_duplicate and not original.possible_duplicate
    assert isinstance(flagged, TracedEvent) and event_traceparent(flagged) == parent
    assert (flagged.offset, flagged.key, flagged.body, flagged.event) == (original.offset, original.key,
                                                                          original.body, original.event)
    assert flagged.as_possible_duplicate() is flagged
    damaged = AsyncEvent.of_body(entry_event_body(sample())[:-3], "q", 0, 1, False)
    with pytest.raises(MalformedRecord):
        damaged.event  # noqa: B018
    assert undecodable([damaged.as_possible_duplicate()]), "the copy forgot why its body does not decode"
    events_ = [AsyncEvent(sample(), "q", 0, 1, True)]
    assert asyncevent.possible_duplicates(events_) is events_
