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
from eventstrategies import INT32, INT64, events  # noqa: E402


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


def damaged_body(event: EntryEvent, data: st.DataObject) -> bytes:
    """The event's body truncated, extended, or with one byte changed."""
    body = bytearray(entry_event_body(event))
    how = data.draw(st.sampled_from(["truncate", "extend", "flip"]))
    if how == "truncate":
        return bytes(body[:data.draw(st.integers(min_value=0, max_value=len(body) - 1))])
    if how == "extend":
        return bytes(body) + data.draw(st.binary(min_size=1, max_size=4))
    i = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
    body[i] ^= data.draw(st.integers(min_value=1, max_value=255))
    return bytes(body)


@settings(max_examples=500, deadline=None, database=None)
@given(events, st.data())
def test_damaged_bodies_are_refused_like_fastavro_refuses_them(event: EntryEvent, data: st.DataObject) -> None:
    """A truncated, extended or altered body is either refused with MalformedRecord or, where fastavro
    reads it too, read as fastavro reads it: never another exception, never another event."""
    damaged = damaged_body(event, data)
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


# --- gateway batches (issue 18) ----------------------------------------------------------------

from sluice.core import eventwire as wire  # noqa: E402 - this section's own

DSIDS = st.integers(min_value=1, max_value=255)
TEXT = st.text(max_size=12)


def _batch_fields(batch_id: int = 9, duplicate: bool = False) -> dict:
    return {"sender_id": "to-b", "source_dsid": 1, "target_dsid": 2, "queue_partition": 3, "batch_id": batch_id,
            "first_offset": 100, "last_offset": 101, "possible_duplicate": duplicate, "created_at": 1_700_000_000_000}


def _older_schema(version: int):
    path = schema_dir() / "history" / f"GatewayBatch.v{version}.avsc"
    schema = fastavro.parse_schema(json.loads(path.read_text()), named_schemas={})
    header = MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))
    return schema, header


def _written_with(schema, header: bytes, record: dict) -> bytes:
    buf = io.BytesIO()
    buf.write(header)
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(events, max_size=5), st.data())
def test_a_batch_of_bodies_is_byte_identical_to_fastavro_and_reads_back(evs: list[EntryEvent],
                                                                      data: st.DataObject) -> None:
    """gateway_batch writes what fastavro writes of the same GatewayBatch record (events as bodies, the
    duplicate bitmap, visited_added, traceparents), and read_gateway_batch gives every field back."""
    bodies = [entry_event_body(e) for e in evs]
    flags = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=max(len(evs) - 1, 0)), max_size=len(evs))))
    added = data.draw(st.dictionaries(TEXT, st.lists(DSIDS, max_size=4), max_size=3))
    traces = data.draw(st.just([]) | st.lists(TEXT, min_size=len(evs), max_size=len(evs)))
    quiet = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=max(len(evs) - 1, 0)), max_size=len(evs))))
    fields = {**_batch_fields(data.draw(INT64), data.draw(st.booleans())), "sender_id": data.draw(TEXT)}
    codec = get_codec()
    value = wire.gateway_batch(codec.header("GatewayBatch"), **fields, bodies=bodies, duplicate_events=flags,
                               visited_added=added, traceparents=traces, no_callback_events=quiet)
    record = {**fields, "events": [], "signature": None, "event_bodies": bodies, "duplicate_events": flags,
              "visited_added": added, "traceparents": traces, "no_callback_events": quiet}
    assert value == codec.encode("GatewayBatch", record)
    view = wire.read_gateway_batch(codec, value)
    assert view.current and view.bodies == tuple(bodies) and view.traceparents == tuple(traces)
    assert view.visited_added == {r: tuple(d) for r, d in added.items()}
    assert view.duplicate_events == frozenset(flags) and view.no_callback_events == frozenset(quiet)
    assert {k: getattr(view, k) for k in fields} == fields


def test_a_current_batch_with_events_as_records_reads_them_before_the_bodies() -> None:
    """A current-version record may still carry events as records (a writer that fills only the fields it
    knew): they come first, as bodies equal to the events', then event_bodies."""
    a, b = (EntryEvent("orders", k, Operation.UPDATE, b"1", EventID("m", 1, i), VersionTag(1, 5, 1), 1, 0, 5)
            for i, k in enumerate(("a", "b")))
    codec = get_codec()
    value = codec.encode("GatewayBatch", {**_batch_fields(), "events": [a.to_record()], "signature": b"sig",
                                          "event_bodies": [entry_event_body(b)]})
    view = wire.read_gateway_batch(codec, value)
    assert view.bodies == (entry_event_body(a), entry_event_body(b)) and view.current


@pytest.mark.parametrize("version", [1, 2])
def test_a_batch_of_an_older_version_reads_as_bodies(version: int) -> None:
    """Versions 1 and 2 carry events as records: read through schema resolution, each event becomes the body
    of the same event (version 1's events lack the transaction, which reads as none)."""
    event = EntryEvent("orders", "k", Operation.CREATE, b'{"v":1}', EventID("m", 1, 2), VersionTag(1, 5, 1, "x"), 1,
                       0, 5, visited_dsids=(1, 2), possible_duplicate=True)
    record = event.to_record()
    if version == 1:
        del record["transaction"]
    schema, header = _older_schema(version)
    value = _written_with(schema, header, {**_batch_fields(), "events": [record, record], "signature": None})
    view = wire.read_gateway_batch(get_codec(), value)
    assert view.bodies == (entry_event_body(event),) * 2 and not view.current
    assert (view.duplicate_events, view.visited_added, view.traceparents) == (frozenset(), {}, ())
    assert (view.batch_id, view.sender_id, view.created_at) == (9, "to-b", 1_700_000_000_000)


def test_the_version_2_and_3_headers_are_the_fingerprints_of_their_history_files() -> None:
    """GATEWAY_BATCH_V2_HEADER and _V3_ are frozen in code: each must be the fingerprint of its file in
    avro/history."""
    assert wire.GATEWAY_BATCH_V2_HEADER == _older_schema(2)[1]
    assert wire.GATEWAY_BATCH_V3_HEADER == _older_schema(3)[1]
    for header in (wire.GATEWAY_BATCH_V2_HEADER, wire.GATEWAY_BATCH_V3_HEADER):
        assert get_codec().schema_of(header) == "GatewayBatch"


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(events, max_size=4), st.data())
def test_a_version_3_batch_for_an_older_receiver_is_fastavro_with_the_old_schema(evs: list[EntryEvent],
                                                                               data: st.DataObject) -> None:
    """With no_callback_events None, gateway_batch writes version 3 (what a receiver that does not read 4
    takes): byte for byte fastavro with avro/history/GatewayBatch.v3.avsc; it reads back with no event
    quiet."""
    schema, header = _older_schema(3)
    bodies = [entry_event_body(e) for e in evs]
    flags = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=max(len(evs) - 1, 0)), max_size=len(evs))))
    fields = _batch_fields(duplicate=data.draw(st.booleans()))
    value = wire.gateway_batch(wire.GATEWAY_BATCH_V3_HEADER, **fields, bodies=bodies, duplicate_events=flags,
                               visited_added={"orders": [1, 2]}, no_callback_events=None)
    assert value == _written_with(schema, header, {**fields, "events": [], "signature": None, "event_bodies": bodies,
                                                   "duplicate_events": flags, "visited_added": {"orders": [1, 2]},
                                                   "traceparents": []})
    view = wire.read_gateway_batch(get_codec(), value)
    assert view.bodies == tuple(bodies) and view.duplicate_events == frozenset(flags)
    assert view.no_callback_events == frozenset() and not view.current


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(events, max_size=4), st.booleans())
def test_a_version_2_batch_is_byte_identical_to_fastavro_with_the_old_schema(evs: list[EntryEvent],
                                                                           duplicate: bool) -> None:
    """gateway_batch_v2 writes what a version-2 sender wrote: fastavro with avro/history/GatewayBatch.v2.avsc,
    each body an EntryEvent record of ``events``."""
    schema, header = _older_schema(2)
    fields = _batch_fields(duplicate=duplicate)
    value = wire.gateway_batch_v2(**fields, bodies=[entry_event_body(e) for e in evs])
    assert value == _written_with(schema, header, {**fields, "events": [e.to_record() for e in evs],
                                                   "signature": None})


def test_every_strict_prefix_of_a_batch_and_trailing_bytes_are_refused() -> None:
    """A truncated GatewayBatch, or one with bytes after its end, is MalformedRecord, never anything else."""
    event = EntryEvent("orders", "k", Operation.CREATE, b"1", EventID("m", 1, 2), VersionTag(1, 5, 1), 1, 0, 5)
    codec = get_codec()
    value = wire.gateway_batch(codec.header("GatewayBatch"), **_batch_fields(), bodies=[entry_event_body(event)],
                               duplicate_events=[0], visited_added={"orders": [1, 2]}, traceparents=["t"])
    for cut in range(HEADER_BYTES, len(value)):
        with pytest.raises(MalformedRecord):
            wire.read_gateway_batch(codec, value[:cut])
    with pytest.raises(MalformedRecord, match="trailing"):
        wire.read_gateway_batch(codec, value + b"\x00")
    with pytest.raises(CodecError):
        wire.read_gateway_batch(codec, codec.encode("EntryEvent", event.to_record()))


def test_visited_after_adds_the_sites_sorted_never_the_origin() -> None:
    """The sender's sites join an event's visited_dsids, sorted, without repeats, and without its origin."""
    assert wire.visited_after((4, 2), (1, 3, 4), origin=3) == (1, 2, 4)
    assert wire.visited_after((), (1,), origin=1) == ()


@settings(max_examples=300, deadline=None, database=None)
@given(events, st.integers(min_value=0, max_value=400))
def test_the_event_id_is_read_without_decoding_and_a_short_body_is_refused(event: EntryEvent, cut: int) -> None:
    """entry_event_id gives the EventID decode_entry gives; a body cut before the EventID's end is refused."""
    body = entry_event_body(event)
    assert wire.entry_event_id(body) == decode_entry(body)[0].event_id
    end = decode_entry(body)[1].possible_duplicate_at + 1
    end += len(wire.string(event.event_id.member_id)) + len(varint(event.event_id.thread_id))
    end += len(varint(event.event_id.sequence_id))
    if cut < end:
        with pytest.raises(MalformedRecord):
            wire.entry_event_id(body[:cut])
    else:
        assert wire.entry_event_id(body[:end]) == event.event_id


def test_a_batch_event_is_its_body_with_the_senders_changes_merged_in() -> None:
    """batch_event decodes one body and merges what the sender carried beside it: visited_added of its region
    (the source dsid for a region not listed) without the origin, and possibleDuplicate from the body, the
    batch's duplicate_events or the batch itself; an event nothing changes is the decoded one as it is."""
    def event(region: str, key: str, visited: tuple[int, ...] = (), duplicate: bool = False) -> EntryEvent:
        return EntryEvent(region, key, Operation.UPDATE, b"1", EventID("m", 1, 1), VersionTag(1, 5, 1), 1, 0, 5,
                          visited_dsids=visited, possible_duplicate=duplicate)

    evs = [event("orders", "a", (4,)), event("orders", "b"), event("other", "c", (3,)), event("orders", "d", (1, 2, 3))]
    codec = get_codec()
    value = wire.gateway_batch(codec.header("GatewayBatch"), **_batch_fields(), bodies=[entry_event_body(e) for e in evs],
                               duplicate_events=[1], visited_added={"orders": [1, 2, 3]})
    view = wire.read_gateway_batch(codec, value)
    merged = view.events()
    assert [(e.visited_dsids, e.possible_duplicate) for e in merged] == [
        ((2, 3, 4), False), ((2, 3), True), ((3,), False), ((2, 3), False)]
    assert merged[0] == replace(evs[0], visited_dsids=(2, 3, 4))
    again = wire.read_gateway_batch(codec, wire.gateway_batch(codec.header("GatewayBatch"), **_batch_fields(duplicate=True),
                                                              bodies=[entry_event_body(evs[2])]))
    assert again.events() == [replace(evs[2], possible_duplicate=True)]
    damaged = wire.read_gateway_batch(codec, wire.gateway_batch(codec.header("GatewayBatch"), **_batch_fields(),
                                                                bodies=[entry_event_body(evs[0])[:-1]]))
    with pytest.raises(MalformedRecord):
        wire.batch_event(damaged, 0)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(events, min_size=1, max_size=4), st.lists(st.integers(min_value=0, max_value=3), max_size=3),
       st.lists(INT32, max_size=3), st.booleans())
def test_a_batch_events_body_is_the_body_of_the_event_as_applied(evs: list[EntryEvent], duplicates: list[int],
                                                                 added: list[int], duplicate: bool) -> None:
    """batch_event_body gives the event batch_event gives and a body equal to entry_event_body of it (the
    receiving owner writes that body to its changelog), the received body itself when nothing changed."""
    codec = get_codec()
    bodies = [entry_event_body(e) for e in evs]
    value = wire.gateway_batch(codec.header("GatewayBatch"), **_batch_fields(duplicate=duplicate), bodies=bodies,
                               duplicate_events=duplicates, visited_added={evs[0].region: added})
    view = wire.read_gateway_batch(codec, value)
    for i in range(len(evs)):
        event, body = wire.batch_event_body(view, i)
        assert event == wire.batch_event(view, i)
        assert body == entry_event_body(event)
        if event == evs[i]:
            assert body is view.bodies[i] or body == bodies[i]


# --- subscriptions: routing heads and spliced client messages -------------------------------------

from sluice.core.eventwire import (  # noqa: E402 - this section's own
    EntryHead,
    check_entry_tail,
    client_event_message,
    entry_without_value,
    read_entry_head,
)


def _head_and_tail(body: bytes) -> tuple[EntryHead, tuple[int, int, int]]:
    head = read_entry_head(body)
    return head, check_entry_tail(body, head)


@settings(max_examples=300, deadline=None, database=None)
@given(events)
def test_an_entry_head_and_tail_read_what_decode_entry_reads(event: EntryEvent) -> None:
    """The routing fields of a body, and its tail's thread, sequence and bucket, are the event's."""
    head, tail = _head_and_tail(entry_event_body(event))
    assert (head.region, head.key, head.operation, head.member_id) == \
        (event.region, event.key, event.operation, event.event_id.member_id)
    assert tail == (event.event_id.thread_id, event.event_id.sequence_id, event.bucket)


@settings(max_examples=500, deadline=None, database=None)
@given(events, st.data())
def test_a_damaged_body_is_refused_by_head_and_tail_exactly_when_decode_entry_refuses_it(
        event: EntryEvent, data: st.DataObject) -> None:
    """Read together, head and tail are as strict as decode_entry: one refuses what the other refuses,
    with MalformedRecord and nothing else, and what both read agrees."""
    damaged = damaged_body(event, data)
    try:
        expected, _ = decode_entry(damaged)
    except MalformedRecord:
        expected = None
    try:
        head, tail = _head_and_tail(damaged)
    except MalformedRecord:
        assert expected is None
        return
    assert expected is not None
    assert (head.region, head.key, head.operation, head.member_id) == \
        (expected.region, expected.key, expected.operation, expected.event_id.member_id)
    assert tail == (expected.event_id.thread_id, expected.event_id.sequence_id, expected.bucket)


@settings(max_examples=300, deadline=None, database=None)
@given(events, st.booleans(), st.booleans(), INT64)
def test_a_spliced_client_message_is_what_fastavro_writes(event: EntryEvent, values: bool, duplicate: bool,
                                                          filled_at: int) -> None:
    """A ClientMessage spliced around a changelog body (its value cut out for a client of invalidates)
    is byte for byte the one the codec encodes from the event's record."""
    codec = get_codec()
    body = entry_event_body(event)
    head = read_entry_head(body)
    sent = body if values else entry_without_value(body, head)
    assert sent == entry_event_body(event if values else replace(event, value=None))
    spliced = client_event_message(codec.header("ClientMessage"), sent, receive_values=values,
                                   possible_duplicate=duplicate, filled_at=filled_at)
    record = event.to_record()
    if not values:
        record["value"] = None
    assert spliced == codec.encode("ClientMessage", {
        "kind": "EVENT", "session": "", "version": 0, "event": record, "receive_values": values,
        "possible_duplicate": duplicate, "filled_at": filled_at, "reason": ""})


@settings(max_examples=300, deadline=None, database=None)
@given(events, st.integers(min_value=0, max_value=40))
def test_the_operation_is_read_from_the_first_three_fields_alone(event: EntryEvent, cut: int) -> None:
    """entry_operation gives the operation fastavro reads from a body, and needs nothing past it: the body
    cut anywhere after the operation still gives it, cut before gives MalformedRecord."""
    from sluice.core.eventwire import entry_operation, string

    body = get_codec().encode("EntryEvent", event.to_record())[HEADER_BYTES:]
    record = get_codec().decode_as("EntryEvent", MARKER + FP_ENTRY + body)
    assert entry_operation(body) is Operation(record["operation"])
    head = len(string(event.region)) + len(string(event.key)) + 1  # fewer than 64 symbols: a one-byte index
    assert entry_operation(body[:head + cut]) is event.operation
    with pytest.raises(MalformedRecord):
        entry_operation(body[:min(cut, head - 1)])


def test_an_operation_symbol_outside_the_enum_is_refused() -> None:
    """A symbol index the Operation enum does not have is MalformedRecord, naming the field."""
    from sluice.core.eventwire import entry_operation, string

    with pytest.raises(MalformedRecord, match="EntryEvent.operation: symbol 13"):
        entry_operation(string("orders") + string("k") + varint(13))
    with pytest.raises(MalformedRecord, match="EntryEvent.operation: symbol -1"):
        entry_operation(string("orders") + string("k") + varint(-1))



@settings(max_examples=300, deadline=None, database=None)
@given(events, st.integers(min_value=0, max_value=2**31 - 1), st.text(max_size=30), INT32, INT64, INT64)
def test_the_lean_queue_reader_gives_what_read_queued_gives(event: EntryEvent, flags: int, queue_id: str,
                                                            partition: int, offset: int, at: int) -> None:
    """queued_flags_body gives the flags and event body read_queued gives, for any current queue record."""
    from sluice.core.eventwire import queued_flags_body

    codec = get_codec()
    header = codec.header("QueuedEvent")
    data = queued_event(header, flags, queue_id, partition, offset, at, entry_event_body(event))
    view = read_queued(codec, data)
    assert queued_flags_body(header, data) == (view.flags, view.event_body)


@settings(max_examples=300, deadline=None, database=None)
@given(events, st.data())
def test_the_lean_queue_reader_refuses_what_read_queued_refuses(event: EntryEvent, data: st.DataObject) -> None:
    """A queue record cut short or altered: where queued_flags_body answers, read_queued answers the same or
    refuses only what the lean reader skips unread (the queue id's UTF-8, a number's range); where it refuses,
    read_queued refuses too; a record of another header is left to read_queued (None)."""
    from sluice.core.eventwire import queued_flags_body

    codec = get_codec()
    header = codec.header("QueuedEvent")
    record = bytearray(queued_event(header, data.draw(st.integers(0, 3)), data.draw(st.text(max_size=8)),
                                    data.draw(INT32), data.draw(INT64), data.draw(INT64), entry_event_body(event)))
    if data.draw(st.booleans()):
        record = record[:data.draw(st.integers(min_value=0, max_value=len(record) - 1))]
    else:
        i = data.draw(st.integers(min_value=0, max_value=min(len(record) - 1, len(header) + 40)))
        record[i] ^= data.draw(st.integers(min_value=1, max_value=255))
    record = bytes(record)
    try:
        lean = queued_flags_body(header, record)
    except MalformedRecord:
        with pytest.raises(CodecError):
            read_queued(codec, record)
        return
    if lean is None:
        assert record[:len(header)] != header
        return
    try:
        view = read_queued(codec, record)
    except MalformedRecord as exc:
        assert re.search(r"not UTF-8|does not fit an Avro (int|long)", str(exc)), exc
        return
    assert lean == (view.flags, view.event_body)


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=30), INT32, INT64, INT64, st.none() | st.builds(EventID, st.text(max_size=20), INT64, INT64),
       INT64, INT64)
def test_a_removal_record_is_what_fastavro_writes(queue_id: str, partition: int, batch_id: int, last: int,
                                                   event_id: EventID | None, count: int, at: int) -> None:
    """removal_record writes, for any fields, the bytes fastavro writes of the same RemovalRecord, and they
    read back as that record."""
    from sluice.core.eventwire import removal_record

    codec = get_codec()
    record = {"queue_id": queue_id, "queue_partition": partition, "batch_id": batch_id, "last_removed_offset": last,
              "last_event_id": None if event_id is None else event_id.to_record(), "removed_count": count,
              "removed_at": at}
    written = removal_record(codec.header("RemovalRecord"), queue_id, partition, batch_id, last, event_id, count, at)
    assert written == codec.encode("RemovalRecord", record)
    assert codec.decode_as("RemovalRecord", written) == record
