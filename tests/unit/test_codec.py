"""The codec: Avro single-object encoding of every schema in ``avro/`` (DESIGN §4).

Three claims are checked here:

1. Every schema round-trips: what ``Codec.encode`` writes, ``Codec.decode``
   gives back unchanged, for any valid record (property-based).
2. Any Avro library can read it: the Apache ``avro`` package (not fastavro)
   decodes the body, and the 8 header bytes are the CRC-64-AVRO fingerprint
   of the schema's Parsing Canonical Form, computed here independently.
3. Bad input is refused with a ``CodecError`` that names the problem, and
   nothing else ever escapes ``decode``.
"""

from __future__ import annotations

import datetime
import io
import json
from pathlib import Path
from typing import Any

import avro.errors
import avro.io
import avro.name
import avro.schema
import fastavro
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.core.codec import HEADER_BYTES, MARKER, get_codec, schema_dir
from sluice.core.errors import CodecError, MalformedRecord, UnknownSchema
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag

AVRO_DIR = Path(__file__).resolve().parents[2] / "avro"
SCHEMA_FILES = {p.stem: json.loads(p.read_text()) for p in sorted(AVRO_DIR.glob("*.avsc"))}

PROPERTY = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies for valid records -------------------------------------------------------

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1

# The millisecond range a datetime can hold (years 1 to 9999): the Apache reader turns
# timestamp-millis into datetimes, so records read by it keep their timestamps in range.
DATETIME_MILLIS = st.integers(-62_135_596_800_000, 253_402_300_799_999)

texts = st.text(max_size=24)
ints = st.integers(INT_MIN, INT_MAX)
longs = st.integers(LONG_MIN, LONG_MAX)
optional_bytes = st.none() | st.binary(max_size=32)
OPERATION_SYMBOLS = next(
    f["type"]["symbols"] for f in SCHEMA_FILES["EntryEvent"]["fields"] if f["name"] == "operation"
)
RECEIVER_COUNTS = [f["name"] for f in next(
    f["type"]["fields"] for f in SCHEMA_FILES["ReceiverPartitionTotals"]["fields"] if f["name"] == "carried")]


def record_strategies(millis: st.SearchStrategy[int] = longs) -> dict[str, st.SearchStrategy[dict[str, Any]]]:
    """One strategy per schema, each drawing every field (defaults included)."""
    event_id = st.fixed_dictionaries({"member_id": texts, "thread_id": longs, "sequence_id": longs})
    version_tag = st.fixed_dictionaries(
        {"dsid": ints, "timestamp": millis, "entry_version": longs, "member_id": texts}
    )
    entry_event = st.fixed_dictionaries(
        {
            "region": texts,
            "key": texts,
            "operation": st.sampled_from(OPERATION_SYMBOLS),
            "value": optional_bytes,
            "value_encoding": st.sampled_from(["json", "raw"]) | texts,
            "callback_argument": st.none() | texts,
            "possible_duplicate": st.booleans(),
            "event_id": event_id,
            "version": version_tag,
            "origin_dsid": ints,
            "visited_dsids": st.lists(ints, max_size=6),
            "bucket": ints,
            "event_time": millis,
            "transaction": st.none() | st.fixed_dictionaries({"id": texts, "last": st.booleans()}),
        }
    )
    receiver_counts = st.fixed_dictionaries(dict.fromkeys(RECEIVER_COUNTS, longs))
    batch_exception = st.fixed_dictionaries(
        {"index": ints, "event_id": event_id, "exception_class": texts, "message": texts}
    )
    client_interest = st.fixed_dictionaries(
        {"region": texts, "keys": st.lists(texts, max_size=4), "all_keys": st.booleans(),
         "regex": st.none() | texts, "durable": st.booleans(), "receive_values": st.booleans()}
    )
    return {
        "ClientInterest": client_interest,
        "ClientRegistration": st.fixed_dictionaries(
            {"client_id": texts, "member_id": texts, "durable": st.booleans(), "durable_timeout_s": ints,
             "redundancy": ints, "queue_topic": texts, "session": texts, "version": longs,
             "interest": st.lists(client_interest, max_size=3), "connected": st.booleans(),
             "keep_alive": st.booleans(), "ready": st.booleans(), "changed_at": millis}
        ),
        "ClientMessage": st.fixed_dictionaries(
            {"kind": st.sampled_from(["EVENT", "REGISTERED", "MARKER", "UNKNOWN", "REFUSED"]), "session": texts,
             "version": longs, "event": st.none() | entry_event, "receive_values": st.booleans(),
             "possible_duplicate": st.booleans(), "filled_at": millis, "reason": texts}
        ),
        "ClientAck": st.fixed_dictionaries(
            {"client_id": texts, "session": texts, "queue_topic": texts, "next_offset": longs, "received": longs,
             "repeats": longs, "at": millis}
        ),
        "FillCheckpoint": st.fixed_dictionaries(
            {"registry_partition": ints, "member": texts, "updated_at": millis,
             "positions": st.lists(st.fixed_dictionaries({"topic": texts, "partition": ints, "offset": longs}),
                                   max_size=4),
             "queues": st.none() | st.lists(st.fixed_dictionaries({
                 "queue_topic": texts,
                 "positions": st.lists(st.fixed_dictionaries({"topic": texts, "partition": ints, "offset": longs}),
                                       max_size=2)}), max_size=2)}
        ),
        "RegionInstance": st.fixed_dictionaries(
            {"instance": texts, "url": texts, "state": st.sampled_from(["running", "stopped"]),
             "buckets": st.lists(st.fixed_dictionaries({"region": texts, "bucket": ints, "since": millis}),
                                 max_size=4),
             "updated_at": millis,
             "standbys": st.lists(st.fixed_dictionaries({"region": texts, "bucket": ints, "lag": longs,
                                                         "entries": longs, "value_bytes": longs}), max_size=3)}
        ),
        "EventID": event_id,
        "VersionTag": version_tag,
        "EntryEvent": entry_event,
        "QueuedEvent": st.fixed_dictionaries(
            {
                "flags": st.integers(min_value=0, max_value=3),
                "queue_id": texts,
                "changelog_partition": ints,
                "changelog_offset": longs,
                "enqueued_at": millis,
                "event": entry_event,
            }
        ),
        "GatewayBatch": st.fixed_dictionaries(
            {
                "sender_id": texts,
                "source_dsid": ints,
                "target_dsid": ints,
                "queue_partition": ints,
                "batch_id": longs,
                "first_offset": longs,
                "last_offset": longs,
                "possible_duplicate": st.booleans(),
                "created_at": millis,
                "events": st.lists(entry_event, max_size=4),
                "signature": optional_bytes,
                "event_bodies": st.lists(st.binary(max_size=32), max_size=4),
                "duplicate_events": st.lists(ints, max_size=4),
                "visited_added": st.dictionaries(texts, st.lists(ints, max_size=3), max_size=3),
                "traceparents": st.lists(texts, max_size=4),
                "no_callback_events": st.lists(ints, max_size=4),
            }
        ),
        "GatewayAck": st.fixed_dictionaries(
            {
                "sender_id": texts,
                "source_dsid": ints,
                "receiver_dsid": ints,
                "queue_partition": ints,
                "batch_id": longs,
                "last_applied_index": ints,
                "last_applied_event_id": st.none() | event_id,
                "duplicate_batch": st.booleans(),
                "exceptions": st.lists(batch_exception, max_size=4),
                "acked_at": millis,
                "last_batch_id": longs,
                "batch_versions": st.lists(ints, max_size=4),
            }
        ),
        "RemovalRecord": st.fixed_dictionaries(
            {
                "queue_id": texts,
                "queue_partition": ints,
                "batch_id": longs,
                "last_removed_offset": longs,
                "last_event_id": st.none() | event_id,
                "removed_count": longs,
                "removed_at": millis,
            }
        ),
        "DeadLetter": st.fixed_dictionaries(
            {
                "source_topic": texts,
                "source_partition": ints,
                "source_offset": longs,
                "key": optional_bytes,
                "value": optional_bytes,
                "reason": texts,
                "error_class": texts,
                "event": st.none() | entry_event,
                "service": texts,
                "failed_at": millis,
            }
        ),
        "ControlRecord": st.fixed_dictionaries(
            {
                "kind": texts,
                "target_id": texts,
                "state": st.sampled_from(["RUNNING", "PAUSED", "STOPPED"]),
                "issued_by": texts,
                "issued_at": millis,
                "clean": st.none() | st.fixed_dictionaries({"request_id": texts, "offsets": st.lists(longs, max_size=4),
                                                            "issued_by": texts, "issued_at": millis}),
            }
        ),
        "QueueCleanAudit": st.fixed_dictionaries(
            {"kind": texts, "queue_id": texts, "request_id": texts, "partition": ints,
             "state": st.sampled_from(["APPLYING", "APPLIED"]), "head_offset": longs, "cut_offset": longs,
             "dropped": longs, "issued_by": texts, "issued_at": millis, "applied_by": texts, "applied_at": millis}
        ),
        "QueueStatus": st.fixed_dictionaries(
            {
                "kind": texts,
                "queue_id": texts,
                "partition": ints,
                "primary": texts,
                "state": texts,
                "batches_dispatched": longs,
                "events_dispatched": longs,
                "redeliveries": longs,
                "events_conflated": longs,
                "dead_lettered": longs,
                "last_removed_offset": longs,
                "in_flight": ints,
                "last_accepted_at": longs,
                "waiting": longs,
                "updated_at": millis,
            }
        ),
        "ReceiverStatus": st.fixed_dictionaries(
            {
                "member": texts,
                "dsid": ints,
                "partitions": st.lists(ints, max_size=8),
                "batches": longs,
                "duplicate_batches": longs,
                "rejected_batches": longs,
                "bad_signatures": longs,
                "events_applied": longs,
                "events_duplicate": longs,
                "conflicts": longs,
                "exceptions": longs,
                "dead_lettered": longs,
                "updated_at": millis,
                "state": texts,
                "senders": st.lists(st.fixed_dictionaries({"source_dsid": ints, "sender_id": texts,
                                                           "last_heard_at": millis, "connected": st.booleans(),
                                                           "batches": longs}), max_size=3),
            }
        ),
        "ReceiverPartitionTotals": st.fixed_dictionaries(
            {
                "partition": ints,
                "dsid": ints,
                "offset": longs,
                "member": texts,
                "owned_since": millis,
                "carried_from": texts,
                "carried": receiver_counts,
                "totals": receiver_counts,
                "updated_at": millis,
            }
        ),
    }


RECORDS = record_strategies()
RECORDS_IN_DATETIME_RANGE = record_strategies(DATETIME_MILLIS)
SCHEMAS = sorted(SCHEMA_FILES)

entry_events = st.builds(
    EntryEvent,
    region=texts,
    key=texts,
    operation=st.sampled_from(Operation),
    value=optional_bytes,
    event_id=st.builds(EventID, texts, longs, longs),
    version=st.builds(VersionTag, ints, longs, longs, texts),
    origin_dsid=ints,
    bucket=ints,
    event_time=longs,
    callback_argument=st.none() | texts,
    possible_duplicate=st.booleans(),
    visited_dsids=st.lists(ints, max_size=6).map(tuple),
    value_encoding=st.sampled_from(["json", "raw"]),
    transaction=st.none() | st.tuples(texts, st.booleans()),
)


# Fixed, hand-written records of every schema, for the checks that need one record.

EVENT_ID = {"member_id": "m-1", "thread_id": 7, "sequence_id": 42}
VERSION_TAG = {"dsid": 1, "timestamp": 1_700_000_000_000, "entry_version": 3, "member_id": "m-1"}
ENTRY_EVENT = {
    "region": "orders",
    "key": "k1",
    "operation": "CREATE",
    "value": b'{"qty": 1}',
    "value_encoding": "json",
    "callback_argument": None,
    "possible_duplicate": False,
    "event_id": EVENT_ID,
    "version": VERSION_TAG,
    "origin_dsid": 1,
    "visited_dsids": [1, 2],
    "bucket": 5,
    "event_time": 1_700_000_000_000,
    "transaction": {"id": "m-1/7/40", "last": False},
}
GATEWAY_BATCH = {
    "sender_id": "site1-sender", "source_dsid": 1, "target_dsid": 2, "queue_partition": 0, "batch_id": 9,
    "first_offset": 100, "last_offset": 101, "possible_duplicate": False, "created_at": 1_700_000_000_000,
    "events": [ENTRY_EVENT, {**ENTRY_EVENT, "operation": "DESTROY", "value": None}], "signature": None,
    "event_bodies": [b"\x0corders\x04k2"], "duplicate_events": [1, 2], "visited_added": {"orders": [1, 2]},
    "traceparents": ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "", ""],
    "no_callback_events": [2],
}
SAMPLES: dict[str, dict[str, Any]] = {
    "EventID": EVENT_ID,
    "VersionTag": VERSION_TAG,
    "EntryEvent": ENTRY_EVENT,
    "QueuedEvent": {"flags": 3, "queue_id": "q", "changelog_partition": 5, "changelog_offset": 77,
                    "enqueued_at": 1_700_000_000_001, "event": ENTRY_EVENT},
    "GatewayBatch": GATEWAY_BATCH,
    "GatewayAck": {
        "sender_id": "site1-sender", "source_dsid": 1, "receiver_dsid": 2, "queue_partition": 0, "batch_id": 9,
        "last_applied_index": 0, "last_applied_event_id": EVENT_ID, "duplicate_batch": False,
        "exceptions": [{"index": 1, "event_id": EVENT_ID, "exception_class": "EntryNotFound", "message": "k1"}],
        "acked_at": 1_700_000_000_002, "last_batch_id": 9, "batch_versions": [1, 2, 3],
    },
    "RemovalRecord": {"queue_id": "q", "queue_partition": 0, "batch_id": 9, "last_removed_offset": 101,
                      "last_event_id": EVENT_ID, "removed_count": 2, "removed_at": 1_700_000_000_003},
    "DeadLetter": {"source_topic": "t", "source_partition": 0, "source_offset": 3, "key": b"k1",
                   "value": b"\x00", "reason": "missing marker", "error_class": "MalformedRecord",
                   "event": ENTRY_EVENT, "service": "region", "failed_at": 1_700_000_000_004},
    "ControlRecord": {"kind": "gateway-sender", "target_id": "q", "state": "RUNNING", "issued_by": "admin",
                      "issued_at": 1_700_000_000_005,
                      "clean": {"request_id": "r-1", "offsets": [12, 0, 7], "issued_by": "ops@host",
                                "issued_at": 1_700_000_000_004}},
    "QueueCleanAudit": {"kind": "gateway-sender", "queue_id": "q", "request_id": "r-1", "partition": 2,
                        "state": "APPLIED", "head_offset": 3, "cut_offset": 7, "dropped": 4, "issued_by": "ops@host",
                        "issued_at": 1_700_000_000_004, "applied_by": "a-sender-1", "applied_at": 1_700_000_000_006},
    "QueueStatus": {"kind": "async-event-queue", "queue_id": "q", "partition": 3, "primary": "m-1",
                    "state": "running", "batches_dispatched": 10, "events_dispatched": 1000, "redeliveries": 2,
                    "events_conflated": 0, "dead_lettered": 1, "last_removed_offset": 999, "in_flight": 1,
                    "last_accepted_at": 1_700_000_000_005, "waiting": 12, "updated_at": 1_700_000_000_006},
    "ClientInterest": {"region": "orders", "keys": ["k1"], "all_keys": False, "regex": None, "durable": True,
                       "receive_values": False},
    "ClientRegistration": {"client_id": "c-1", "member_id": "c-1-ab", "durable": True, "durable_timeout_s": 300,
                           "redundancy": 1, "queue_topic": "subscription.c-1.ab", "session": "s1", "version": 4,
                           "interest": [{"region": "orders", "keys": [], "all_keys": False, "regex": "k.*",
                                         "durable": True, "receive_values": True}],
                           "connected": True, "keep_alive": False, "ready": True, "changed_at": 1_700_000_000_008},
    "ClientMessage": {"kind": "EVENT", "session": "", "version": 0, "event": ENTRY_EVENT, "receive_values": True,
                      "possible_duplicate": True, "filled_at": 1_700_000_000_009, "reason": ""},
    "ClientAck": {"client_id": "c-1", "session": "s1", "queue_topic": "subscription.c-1.ab", "next_offset": 12,
                  "received": 12, "repeats": 1, "at": 1_700_000_000_010},
    "FillCheckpoint": {"registry_partition": 3, "member": "b-subscriptions-1", "updated_at": 1_700_000_000_011,
                       "positions": [{"topic": "region.orders.changelog", "partition": 0, "offset": 99}],
                       "queues": [{"queue_topic": "subscription.c-1.ab",
                                   "positions": [{"topic": "region.orders.changelog", "partition": 0, "offset": 97}]}]},
    "RegionInstance": {"instance": "a-1f2e3d4c5b6a", "url": "http://10.0.0.7:7070", "state": "running",
                       "buckets": [{"region": "orders", "bucket": 3, "since": 1_700_000_000_012}],
                       "updated_at": 1_700_000_000_013,
                       "standbys": [{"region": "orders", "bucket": 5, "lag": 2, "entries": 1200,
                                     "value_bytes": 240_000}]},
    "ReceiverStatus": {"member": "b-receiver-1", "dsid": 2, "partitions": [0, 3], "batches": 40,
                       "duplicate_batches": 2, "rejected_batches": 1, "bad_signatures": 0, "events_applied": 3990,
                       "events_duplicate": 10, "conflicts": 3, "exceptions": 1, "dead_lettered": 1,
                       "updated_at": 1_700_000_000_007, "state": "running",
                       "senders": [{"source_dsid": 1, "sender_id": "to-b", "last_heard_at": 1_700_000_000_006,
                                    "connected": True, "batches": 40}]},
    "ReceiverPartitionTotals": {"partition": 3, "dsid": 2, "offset": 41, "member": "b-receiver-2",
                                "owned_since": 1_700_000_000_001, "carried_from": "b-receiver-1",
                                "carried": dict.fromkeys(RECEIVER_COUNTS, 1),
                                "totals": dict.fromkeys(RECEIVER_COUNTS, 2), "updated_at": 1_700_000_000_014},
}


def test_every_schema_file_has_a_strategy_and_a_codec_entry() -> None:
    """Every schema in avro/ is known to the codec, has a strategy and a sample, and the samples round-trip."""
    assert set(SCHEMA_FILES) == set(get_codec().names) == set(RECORDS) == set(SAMPLES)
    for name, record in SAMPLES.items():
        assert get_codec().decode(get_codec().encode(name, record)) == (name, record)


# --- 1. round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_encode_then_decode_returns_the_same_record(name: str, data: st.DataObject) -> None:
    """Decoding what encode wrote gives back the record unchanged, under its own schema name."""
    record = data.draw(RECORDS[name], label=name)
    codec = get_codec()
    encoded = codec.encode(name, record)
    assert encoded[:2] == MARKER
    assert encoded[2:HEADER_BYTES] == codec.fingerprint(name)
    assert codec.schema_of(encoded) == name
    assert codec.decode(encoded) == (name, record)
    assert codec.decode_as(name, encoded) == record


@PROPERTY
@given(event=entry_events)
def test_entry_event_survives_to_record_encode_decode_from_record(event: EntryEvent) -> None:
    """An EntryEvent taken through to_record, the codec and from_record comes back equal."""
    codec = get_codec()
    decoded = codec.decode_as("EntryEvent", codec.encode("EntryEvent", event.to_record()))
    assert EntryEvent.from_record(decoded) == event


def test_operation_enum_matches_the_schema_symbols_in_order() -> None:
    """Python's Operation and the Avro enum list the same symbols in the same order (the wire index)."""
    assert [op.value for op in Operation] == OPERATION_SYMBOLS


# --- 2. a plain Avro reader -------------------------------------------------------------
#
# CRC-64-AVRO, exactly as the specification's reference code ("Schema Fingerprints"):
# a 64-bit Rabin fingerprint with EMPTY = 0xc15d213aa4d7a795.  Single-object encoding
# puts it on the wire little-endian.

EMPTY64 = 0xC15D213AA4D7A795


def _fp_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY64 & -(fp & 1))
        table.append(fp)
    return table


FP_TABLE = _fp_table()


def rabin64(data: bytes) -> int:
    fp = EMPTY64
    for byte in data:
        fp = (fp >> 8) ^ FP_TABLE[(fp ^ byte) & 0xFF]
    return fp


def strip_logical_types(node: Any) -> Any:
    """The schema without logicalType attributes, which the canonical form drops anyway.

    The canonical form keeps only name, type, fields, symbols, items, values and size
    ([STRIP]) and writes primitives as bare names ([PRIMITIVES]).  avro 1.12.2 renders a
    logical-typed long as {"type":"long"} instead of "long", so it is handed the schema
    without logical types; that does not change what the specification's form is.
    """
    if isinstance(node, dict):
        return {k: strip_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [strip_logical_types(v) for v in node]
    return node


def parse_all(transform: Any = lambda s: s) -> dict[str, avro.schema.Schema]:
    """Every avro/ file parsed by the Apache package, named types resolved across files."""
    names = avro.name.Names()
    parsed: dict[str, avro.schema.Schema] = {}
    pending = dict(SCHEMA_FILES)
    while pending:
        before = len(pending)
        errors: dict[str, str] = {}
        for stem, schema_json in list(pending.items()):
            # A failed parse leaves half its names behind, so each attempt gets a copy.
            trial = avro.name.Names()
            trial.names = dict(names.names)
            try:
                parsed[stem] = avro.schema.make_avsc_object(transform(schema_json), trial)
            except avro.errors.SchemaParseException as exc:
                errors[stem] = str(exc)  # Perhaps a type from a file not parsed yet.
                continue
            names = trial
            del pending[stem]
        assert len(pending) < before, f"schemas that cannot be parsed: {errors}"
    return parsed


APACHE_SCHEMAS = parse_all()
APACHE_SCHEMAS_WITHOUT_LOGICAL_TYPES = parse_all(strip_logical_types)


@pytest.mark.parametrize(
    ("schema_text", "canonical", "java_fingerprint"),
    [
        ('"null"', '"null"', 7195948357588979594),
        ('{"type":"int"}', '"int"', 8247732601305521295),
        ('{"fields":[], "type":"record", "name":"foo", "doc":"Useful info"}',
         '{"name":"foo","type":"record","fields":[]}', -4824392279771201922),
        ('{"namespace":"x.y.z", "type":"enum", "name":"foo", "doc":"foo bar", "symbols":["A1", "A2"]}',
         '{"name":"x.y.z.foo","type":"enum","symbols":["A1","A2"]}', -4448647247586288245),
        ('{"name":"PigValue","type":"record",'
         ' "fields":[{"name":"value", "type":["null", "int", "long", "PigValue"]}]}',
         '{"name":"PigValue","type":"record","fields":[{"name":"value","type":["null","int","long","PigValue"]}]}',
         -1759257747318642341),
    ],
)
def test_independent_fingerprint_matches_the_avro_project_vectors(
    schema_text: str, canonical: str, java_fingerprint: int
) -> None:
    """The test's Rabin fingerprint and the avro package's canonical form agree with Avro's own test vectors."""
    # Vectors from apache/avro share/test/data/schema-tests.txt, checked there against Java.
    form = avro.schema.parse(schema_text).canonical_form
    assert form == canonical
    assert rabin64(form.encode()) == java_fingerprint & 0xFFFF_FFFF_FFFF_FFFF


@pytest.mark.parametrize("name", SCHEMAS)
def test_header_is_the_crc64_avro_fingerprint_of_the_parsing_canonical_form(name: str) -> None:
    """The 8 bytes after C3 01 are the spec's CRC-64-AVRO of the self-contained schema, little-endian."""
    encoded = get_codec().encode(name, SAMPLES[name])
    schema = APACHE_SCHEMAS_WITHOUT_LOGICAL_TYPES[name]
    # The canonical form of a schema that uses a type from another file spells that
    # type out in full where it first appears, as Java's SchemaNormalization does.
    canonical = schema.canonical_form
    expected = rabin64(canonical.encode()).to_bytes(8, "little")
    assert expected == schema.fingerprint("CRC-64-AVRO")
    assert encoded[2:HEADER_BYTES].hex() == expected.hex(), f"canonical form: {canonical}"


def millis_of(value: Any) -> Any:
    """The Apache reader's datum with timestamp-millis datetimes turned back into ints."""
    if isinstance(value, datetime.datetime):
        epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
        return (value - epoch) // datetime.timedelta(milliseconds=1)
    if isinstance(value, dict):
        return {k: millis_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [millis_of(v) for v in value]
    return value


@pytest.mark.parametrize("name", SCHEMAS)
@FEW
@given(data=st.data())
def test_apache_avro_reader_decodes_the_body_sluice_wrote(name: str, data: st.DataObject) -> None:
    """avro.io.DatumReader, given only the schema from avro/, reads back every field Sluice wrote."""
    record = data.draw(RECORDS_IN_DATETIME_RANGE[name], label=name)
    encoded = get_codec().encode(name, record)
    assert encoded[:2] == b"\xc3\x01"
    body = io.BytesIO(encoded[HEADER_BYTES:])
    datum = avro.io.DatumReader(APACHE_SCHEMAS[name]).read(avro.io.BinaryDecoder(body))
    assert body.tell() == len(encoded) - HEADER_BYTES, "the reader left bytes unread"
    assert millis_of(datum) == record


# --- 3. refusals ------------------------------------------------------------------------

def test_empty_bytes_are_refused_as_shorter_than_the_header() -> None:
    """Zero bytes are a MalformedRecord whose message says the header is missing."""
    with pytest.raises(MalformedRecord, match="0 bytes.*header"):
        get_codec().decode(b"")


def test_none_is_refused_as_a_record_without_value() -> None:
    """A tombstone (None value) is a MalformedRecord, not a TypeError."""
    with pytest.raises(MalformedRecord, match="no value"):
        get_codec().decode(None)


@pytest.mark.parametrize(
    "prefix",
    [b"\x00\x00", b"\xc3\x00", b"\x01\xc3", b"Ob"],
    ids=["zeros", "half-marker", "swapped-marker", "container-file-magic"],
)
def test_bytes_without_the_single_object_marker_are_refused(prefix: bytes) -> None:
    """A record whose first two bytes are not C3 01 is a MalformedRecord that names the marker."""
    encoded = get_codec().encode("EventID", EVENT_ID)
    with pytest.raises(MalformedRecord, match="marker C3 01"):
        get_codec().decode(prefix + encoded[2:])


def test_unknown_fingerprint_is_refused_naming_the_fingerprint() -> None:
    """A marker followed by a fingerprint of no known schema is an UnknownSchema quoting it in hex."""
    codec = get_codec()
    encoded = codec.encode("EventID", EVENT_ID)
    unknown = bytes(b ^ 0xFF for b in encoded[2:HEADER_BYTES])
    assert unknown not in {codec.fingerprint(n) for n in codec.names}
    with pytest.raises(UnknownSchema, match=unknown.hex()):
        codec.decode(MARKER + unknown + encoded[HEADER_BYTES:])


@pytest.mark.parametrize("name", SCHEMAS)
@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data())
def test_every_strict_prefix_of_a_record_is_refused(name: str, data: st.DataObject) -> None:
    """Truncating a real record anywhere raises a CodecError naming the cut; it never returns."""
    codec = get_codec()
    encoded = codec.encode(name, data.draw(RECORDS[name], label=name))
    for length in range(len(encoded)):
        with pytest.raises(CodecError) as info:
            codec.decode(encoded[:length])
        message = str(info.value)
        if length < HEADER_BYTES:
            assert "header" in message
        else:
            assert name in message and "cannot be read" in message


@pytest.mark.parametrize("name", SCHEMAS)
@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data(), extra=st.binary(min_size=1, max_size=16))
def test_trailing_bytes_after_the_body_are_refused(name: str, data: st.DataObject, extra: bytes) -> None:
    """Bytes after a complete body are a MalformedRecord that counts them, never silently ignored."""
    encoded = get_codec().encode(name, data.draw(RECORDS[name], label=name))
    with pytest.raises(MalformedRecord, match=f"{len(extra)} trailing bytes"):
        get_codec().decode(encoded + extra)


@pytest.mark.parametrize(("written", "expected"), [(w, e) for w in SCHEMAS for e in SCHEMAS if e != w])
def test_decoding_with_another_expected_schema_is_refused(written: str, expected: str) -> None:
    """decode(expected=X) of a record of schema Y is a MalformedRecord naming both schemas."""
    encoded = get_codec().encode(written, SAMPLES[written])
    with pytest.raises(MalformedRecord, match=f"expected a {expected} record, got a {written} record"):
        get_codec().decode(encoded, expected=expected)
    with pytest.raises(MalformedRecord):
        get_codec().decode_as(expected, encoded)


@settings(max_examples=300, deadline=None, database=None)
@given(garbage=st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_codec_error(garbage: bytes) -> None:
    """decode of arbitrary bytes either returns a record of a known schema or raises a CodecError."""
    codec = get_codec()
    try:
        name, record = codec.decode(garbage)
    except CodecError:
        return
    assert name in codec.names and isinstance(record, dict)


@settings(max_examples=300, deadline=None, database=None)
@given(name=st.sampled_from(SCHEMAS), body=st.binary(max_size=96))
def test_garbage_body_behind_a_valid_header_never_raises_anything_but_codec_error(
    name: str, body: bytes
) -> None:
    """A valid marker and fingerprint followed by random bytes decodes or raises a CodecError, nothing else."""
    codec = get_codec()
    try:
        decoded_name, record = codec.decode(MARKER + codec.fingerprint(name) + body)
    except CodecError as exc:
        assert name in str(exc)
        return
    assert decoded_name == name and isinstance(record, dict)


def _without(record: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != field}


@pytest.mark.parametrize(
    ("name", "record", "mentions"),
    [
        pytest.param("EventID", _without(EVENT_ID, "sequence_id"), "sequence_id", id="missing-long"),
        pytest.param("EntryEvent", _without(ENTRY_EVENT, "event_id"), "event_id", id="missing-record"),
        pytest.param("EventID", {**EVENT_ID, "member_id": 5}, "member_id", id="int-for-string"),
        pytest.param("EventID", {**EVENT_ID, "thread_id": "7"}, "thread_id", id="string-for-long"),
        pytest.param("EventID", {**EVENT_ID, "thread_id": None}, "thread_id", id="none-for-long"),
        pytest.param("EntryEvent", {**ENTRY_EVENT, "operation": "UPSERT"}, "UPSERT", id="unknown-enum-symbol"),
        pytest.param("EntryEvent", {**ENTRY_EVENT, "value": "text"}, "value", id="string-for-bytes"),
        pytest.param("EntryEvent", {**ENTRY_EVENT, "visited_dsids": None}, "visited_dsids", id="none-for-array"),
        pytest.param("EntryEvent", {**ENTRY_EVENT, "visited_dsids": ["a"]}, "visited_dsids", id="string-in-int-array"),
        pytest.param("EntryEvent", {**ENTRY_EVENT, "event_id": None}, "event_id", id="none-for-record"),
        # The cases below are accepted, or leak OverflowError, in the codec as it is today.
        pytest.param("EventID", {**EVENT_ID, "sequence_id": 2**63}, "sequence_id", id="long-above-2**63-1"),
        pytest.param("EventID", {**EVENT_ID, "sequence_id": -(2**63) - 1}, "sequence_id", id="long-below-minus-2**63"),
        pytest.param("VersionTag", {**VERSION_TAG, "dsid": 2**31}, "dsid", id="int-above-2**31-1"),
        pytest.param("EntryEvent", {**ENTRY_EVENT, "possible_duplicate": "no"}, "possible_duplicate",
                     id="string-for-boolean"),
        pytest.param("VersionTag", {**VERSION_TAG, "entry_version": 2.5}, "entry_version", id="float-for-long"),
    ],
)
def test_encoding_a_record_with_a_missing_or_mistyped_field_is_refused(
    name: str, record: dict[str, Any], mentions: str
) -> None:
    """encode refuses a missing or mistyped field with a CodecError naming the schema and the field."""
    with pytest.raises(CodecError) as info:
        get_codec().encode(name, record)
    assert name in str(info.value) and mentions in str(info.value)


def test_encoding_under_an_unknown_schema_name_is_refused() -> None:
    """encode with a schema name not in avro/ is an UnknownSchema naming it."""
    with pytest.raises(UnknownSchema, match="'Nope'"):
        get_codec().encode("Nope", EVENT_ID)


def _with_defaults_of_new_fields(name: str, record: Any) -> Any:
    """The sample as an older writer could have written it: fields added since at their defaults."""
    added = {"EntryEvent": {"transaction": None}, "QueueStatus": {"last_accepted_at": 0, "waiting": 0},
             "ControlRecord": {"clean": None},
             "FillCheckpoint": {"queues": None}, "GatewayAck": {"last_batch_id": -1, "batch_versions": []},
             "QueuedEvent": {"flags": 0}, "RegionInstance": {"standbys": []},
             "ReceiverStatus": {"state": "running", "senders": []},
             "GatewayBatch": {"event_bodies": [], "duplicate_events": [], "visited_added": {}, "traceparents": [],
                              "no_callback_events": []}}
    out = {**record, **added.get(name, {})}
    if name == "QueuedEvent":
        out["event"] = _with_defaults_of_new_fields("EntryEvent", record["event"])
    if name == "GatewayBatch":
        out["events"] = [_with_defaults_of_new_fields("EntryEvent", e) for e in record["events"]]
    if name == "DeadLetter" and record.get("event") is not None:
        out["event"] = _with_defaults_of_new_fields("EntryEvent", record["event"])
    return out


@pytest.mark.parametrize("path", sorted((schema_dir() / "history").glob("*.avsc")), ids=lambda p: p.name)
def test_a_record_written_with_an_older_schema_version_is_read_into_the_current_one(path) -> None:
    """avro/history keeps older versions: their records decode, fields added since taking their defaults."""
    name = path.name.split(".", 1)[0]
    old = fastavro.parse_schema(json.loads(path.read_text()), named_schemas={})
    fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(old), "CRC-64-AVRO"))
    expected = _with_defaults_of_new_fields(name, SAMPLES[name])
    buf = io.BytesIO()
    buf.write(MARKER + fp)
    fastavro.schemaless_writer(buf, old, expected)
    codec = get_codec()
    assert fp != codec.fingerprint(name)
    assert codec.decode_as(name, buf.getvalue()) == expected
