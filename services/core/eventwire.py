"""Events as bytes: write, read, scan and splice Avro bodies without a full decode.

Every Sluice record is Avro in the single-object encoding (``codec.py``:
``C3 01``, the schema's 8-byte fingerprint, the body).  The hot paths move
an ``EntryEvent`` from the region service through queues, senders and
receivers to another site's changelog; only the ends need its fields.  This
module is the one place that knows the byte layout, so the stages between
can route, batch and forward events as the bytes they arrived as:

* ``entry_event_body`` writes an ``EntryEvent``'s body by hand, byte for
  byte what fastavro writes (``fastavro`` is the test oracle), at a fraction
  of its cost;
* ``decode_entry`` reads one back, with ``EntryLayout``: where the fields a
  stage may change (possibleDuplicate, visited sites, bucket) lie, so that
  ``splice_entry`` can change them by copying the bytes around them rather
  than encoding the event again;
* ``entry_region_key`` reads only the first two fields (region and key),
  which is all a router needs;
* ``queued_event`` writes a ``QueuedEvent`` (a queue record) around an event
  body, and ``read_queued`` reads one back down to its event body without
  decoding the event: the ``flags`` field comes first, so possibleDuplicate
  and "routed" (the gateway's loop check was done when the event was queued)
  are read from the byte after the header.  A record of an older
  ``QueuedEvent`` version is read through the codec's schema resolution and
  its event re-encoded: slower, and only met during an upgrade.

Avro binary, as used here: int and long are zig-zag varints; a string or
bytes is its length then its bytes; a union is the branch index then the
value; an enum is the symbol's index; an array is blocks of a count then the
items, ending with a count of 0 (a negative count is followed by the block's
size in bytes); a record is its fields in order.  Every reader here refuses
what fastavro would refuse (a truncated body, a bad union branch, an unknown
enum symbol, invalid UTF-8, trailing bytes) with ``MalformedRecord``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import MalformedRecord
from .events import EntryEvent, EventID, Operation, VersionTag

if TYPE_CHECKING:
    from .codec import Codec

_OPERATIONS = tuple(Operation)
_OPERATION_INDEX = {op: i for i, op in enumerate(_OPERATIONS)}

LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
INT_MIN, INT_MAX = -(2**31), 2**31 - 1

#: QueuedEvent ``flags``: the event may have been queued before (a new owner re-enqueued it).
FLAG_POSSIBLE_DUPLICATE = 1
#: QueuedEvent ``flags``: the gateway loop check (origin, visited sites) was done when it was queued.
FLAG_ROUTED = 2
#: QueuedEvent ``flags``: the remote site fires no callbacks for the event (Geode's generateCallbacks
#: false): an entry wan-copy region queued for one gateway sender (region/wancopy.py).
FLAG_NO_CALLBACKS = 4

# --- writing ---------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    """Avro's zig-zag varint of a long; ``MalformedRecord`` for a number no long holds.

    Python's ints are unbounded and the zig-zag step silently wraps one
    beyond 64 bits (2**70 would be read back as 64), so the range is checked
    here, where every hand-written long is made."""
    if not LONG_MIN <= n <= LONG_MAX:
        raise MalformedRecord(f"{n} does not fit an Avro long ({LONG_MIN}..{LONG_MAX})")
    z = (n << 1) ^ (n >> 63)
    if z < 0x80:
        return bytes((z,))
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def varint32(n: int) -> bytes:
    """Avro's varint of an int (32 bits): the same encoding as a long, within the int's range."""
    if not INT_MIN <= n <= INT_MAX:
        raise MalformedRecord(f"{n} does not fit an Avro int ({INT_MIN}..{INT_MAX})")
    return varint(n)


def string(s: str) -> bytes:
    b = s.encode("utf-8")
    return varint(len(b)) + b


@lru_cache(maxsize=4096)
def _cached_string(s: str) -> bytes:
    """Region names, member ids, encodings: few distinct values, encoded once."""
    return string(s)


@lru_cache(maxsize=4096)
def _cached_int_array(items: tuple[int, ...]) -> bytes:
    """Visited-site lists: few distinct values, encoded once."""
    return _int_array(items)


def _int_array(items: tuple[int, ...] | list[int]) -> bytes:
    if not items:
        return b"\x00"
    return varint(len(items)) + b"".join(varint32(d) for d in items) + b"\x00"


def entry_event_body(ev: EntryEvent) -> bytes:
    """The Avro body (no single-object header) of an ``EntryEvent``."""
    if _compiled is not None:
        body = _compiled.entry_event_body(ev)
        if body is not None:
            return body  # type: ignore[no-any-return]
    return entry_event_body_py(ev)


def entry_event_body_py(ev: EntryEvent) -> bytes:
    """``entry_event_body`` in Python: the reference of the compiled writer, and the error for every
    event it leaves to this one."""
    eid = ev.event_id
    ver = ev.version
    tx = ev.transaction
    return b"".join((
        _cached_string(ev.region),
        string(ev.key),
        varint(_OPERATION_INDEX[ev.operation]),
        b"\x00" if ev.value is None else b"\x02" + varint(len(ev.value)) + ev.value,
        _cached_string(ev.value_encoding),
        b"\x00" if ev.callback_argument is None else b"\x02" + string(ev.callback_argument),
        b"\x01" if ev.possible_duplicate else b"\x00",
        _cached_string(eid.member_id),
        varint(eid.thread_id),
        varint(eid.sequence_id),
        varint32(ver.dsid),
        varint(ver.timestamp),
        varint(ver.entry_version),
        _cached_string(ver.member_id),
        varint32(ev.origin_dsid),
        _int_array(ev.visited_dsids),
        varint32(ev.bucket),
        varint(ev.event_time),
        b"\x00" if tx is None else b"\x02" + string(tx[0]) + (b"\x01" if tx[1] else b"\x00"),
    ))


# --- reading ---------------------------------------------------------------------------------


def read_long(buf: bytes, pos: int) -> tuple[int, int]:
    """(the zig-zag varint at ``pos``, the position after it).  IndexError past the end."""
    b = buf[pos]
    pos += 1
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos
    n = b & 0x7F
    shift = 7
    while True:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            if n >> 64:
                raise MalformedRecord(f"the varint before byte {pos} does not fit an Avro long")
            return (n >> 1) ^ -(n & 1), pos
        shift += 7
        if shift > 63:
            raise MalformedRecord(f"a varint at byte {pos} runs past 10 bytes")


def _read_bytes(buf: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = read_long(buf, pos)
    end = pos + n
    if n < 0 or end > len(buf):
        raise MalformedRecord(f"a length of {n} at byte {pos} runs past the end ({len(buf)} bytes)")
    return buf[pos:end], end


def _read_string(buf: bytes, pos: int) -> tuple[str, int]:
    raw, pos = _read_bytes(buf, pos)
    try:
        return raw.decode("utf-8"), pos
    except UnicodeDecodeError as exc:
        raise MalformedRecord(f"a string before byte {pos} is not UTF-8: {exc.reason}") from None


def _skip_bytes(buf: bytes, pos: int) -> int:
    n, pos = read_long(buf, pos)
    end = pos + n
    if n < 0 or end > len(buf):
        raise MalformedRecord(f"a length of {n} at byte {pos} runs past the end ({len(buf)} bytes)")
    return end


def _union_branch(buf: bytes, pos: int, what: str) -> tuple[int, int]:
    branch, pos = read_long(buf, pos)
    if branch not in (0, 1):
        raise MalformedRecord(f"{what}: union branch {branch} at byte {pos - 1} (the schema has 0 and 1)")
    return branch, pos


def _read_boolean(buf: bytes, pos: int) -> tuple[bool, int]:
    # Any byte but 0 is true, as fastavro reads it.
    return buf[pos] != 0, pos + 1


def _read_int(buf: bytes, pos: int, what: str) -> tuple[int, int]:
    n, pos = read_long(buf, pos)
    if not INT_MIN <= n <= INT_MAX:
        raise MalformedRecord(f"{what}: {n} does not fit an Avro int")
    return n, pos


def _read_int_array(buf: bytes, pos: int, what: str) -> tuple[tuple[int, ...], int]:
    items: list[int] = []
    while True:
        count, pos = read_long(buf, pos)
        if count == 0:
            return tuple(items), pos
        if count < 0:
            count = -count
            _size, pos = read_long(buf, pos)
        for _ in range(count):
            item, pos = _read_int(buf, pos, what)
            items.append(item)


@dataclass(frozen=True, slots=True)
class EntryLayout:
    """Where, in an EntryEvent body, the fields a forwarding stage may change lie (byte offsets)."""

    #: The possibleDuplicate boolean (one byte).
    possible_duplicate_at: int
    #: The visited_dsids array, from its first count to after its closing 0.
    visited_start: int
    visited_end: int
    #: The bucket int; it ends where event_time begins.
    bucket_end: int


def decode_entry(body: bytes, pos: int = 0) -> tuple[EntryEvent, EntryLayout]:
    """The ``EntryEvent`` whose body is ``body[pos:]`` (to its very end), and its ``EntryLayout``
    (offsets relative to ``body``).  ``MalformedRecord`` for anything fastavro would refuse."""
    if pos == 0 and _compiled is not None:
        decoded = _compiled.decode_entry(body)
        if decoded is not None:
            return decoded  # type: ignore[no-any-return]
    return decode_entry_py(body, pos)


def decode_entry_py(body: bytes, pos: int = 0) -> tuple[EntryEvent, EntryLayout]:
    """``decode_entry`` in Python: the reference of the compiled reader, and the reason for every
    body it refuses."""
    try:
        event, layout, end = _decode_entry(body, pos)
    except IndexError:
        raise MalformedRecord(f"EntryEvent body of {len(body) - pos} bytes is truncated") from None
    if end != len(body):
        raise MalformedRecord(f"EntryEvent body has {len(body) - end} trailing bytes")
    return event, layout


def _decode_entry(buf: bytes, pos: int) -> tuple[EntryEvent, EntryLayout, int]:
    region, pos = _read_string(buf, pos)
    key, pos = _read_string(buf, pos)
    op_index, pos = read_long(buf, pos)
    if not 0 <= op_index < len(_OPERATIONS):
        raise MalformedRecord(f"EntryEvent.operation: symbol {op_index} is not one of the {len(_OPERATIONS)}")
    branch, pos = _union_branch(buf, pos, "EntryEvent.value")
    value = None
    if branch:
        value, pos = _read_bytes(buf, pos)
    encoding, pos = _read_string(buf, pos)
    branch, pos = _union_branch(buf, pos, "EntryEvent.callback_argument")
    callback = None
    if branch:
        callback, pos = _read_string(buf, pos)
    duplicate_at = pos
    duplicate, pos = _read_boolean(buf, pos)
    # Member ids interned: a region holds an EventID and a version tag per entry, and their member ids
    # are a few strings, not one per entry.
    member, pos = _read_string(buf, pos)
    member = sys.intern(member)
    thread, pos = read_long(buf, pos)
    sequence, pos = read_long(buf, pos)
    dsid, pos = _read_int(buf, pos, "VersionTag.dsid")
    timestamp, pos = read_long(buf, pos)
    entry_version, pos = read_long(buf, pos)
    version_member, pos = _read_string(buf, pos)
    version_member = sys.intern(version_member)
    origin, pos = _read_int(buf, pos, "EntryEvent.origin_dsid")
    visited_start = pos
    visited, pos = _read_int_array(buf, pos, "EntryEvent.visited_dsids")
    visited_end = pos
    bucket, pos = _read_int(buf, pos, "EntryEvent.bucket")
    bucket_end = pos
    event_time, pos = read_long(buf, pos)
    branch, pos = _union_branch(buf, pos, "EntryEvent.transaction")
    transaction = None
    if branch:
        tx_id, pos = _read_string(buf, pos)
        last, pos = _read_boolean(buf, pos)
        transaction = (tx_id, last)
    event = EntryEvent(region, key, _OPERATIONS[op_index], value, EventID(member, thread, sequence),
                       VersionTag(dsid, timestamp, entry_version, version_member), origin, bucket, event_time,
                       callback, duplicate, visited, encoding, transaction)
    return event, EntryLayout(duplicate_at, visited_start, visited_end, bucket_end), pos


def entry_region_key(body: bytes, pos: int = 0) -> tuple[str, str]:
    """(region, key) of an EntryEvent body, from its first two fields only."""
    try:
        region, pos = _read_string(body, pos)
        key, _ = _read_string(body, pos)
    except IndexError:
        raise MalformedRecord(f"EntryEvent body of {len(body) - pos} bytes is truncated") from None
    return region, key


def splice_entry(body: bytes, layout: EntryLayout, *, possible_duplicate: bool | None = None,
                 visited_dsids: tuple[int, ...] | None = None, bucket: int | None = None) -> bytes:
    """``body`` with the fields given changed, the bytes around them copied as they are.  Equal to
    ``entry_event_body`` of the event with those fields replaced (the unit tests check it)."""
    parts = []
    start = layout.possible_duplicate_at
    if possible_duplicate is None:
        parts.append(body[:layout.visited_start])
    else:
        parts += [body[:start], b"\x01" if possible_duplicate else b"\x00", body[start + 1:layout.visited_start]]
    if visited_dsids is None and bucket is None:
        parts.append(body[layout.visited_start:])
        return b"".join(parts)
    parts.append(body[layout.visited_start:layout.visited_end] if visited_dsids is None
                 else _cached_int_array(tuple(visited_dsids)))
    parts.append(body[layout.visited_end:layout.bucket_end] if bucket is None else varint32(bucket))
    parts.append(body[layout.bucket_end:])
    return b"".join(parts)


# --- queue records -----------------------------------------------------------------------------


def queued_event(header: bytes, flags: int, queue_id: str, changelog_partition: int, changelog_offset: int,
                 enqueued_at: int, event_body: bytes) -> bytes:
    """A ``QueuedEvent`` record (``header``: the marker and the current QueuedEvent fingerprint,
    ``codec.header("QueuedEvent")``) around an event body, as fastavro would write it."""
    if _compiled is not None:
        record = _compiled.queued_event(header, flags, queue_id, changelog_partition, changelog_offset,
                                        enqueued_at, event_body)
        if record is not None:
            return record  # type: ignore[no-any-return]
    return queued_event_py(header, flags, queue_id, changelog_partition, changelog_offset, enqueued_at, event_body)


def queued_event_py(header: bytes, flags: int, queue_id: str, changelog_partition: int, changelog_offset: int,
                    enqueued_at: int, event_body: bytes) -> bytes:
    """``queued_event`` in Python: the reference of the compiled writer."""
    return b"".join((header, varint32(flags), _cached_string(queue_id), varint32(changelog_partition),
                     varint(changelog_offset), varint(enqueued_at), event_body))


@dataclass(frozen=True, slots=True)
class QueuedView:
    """A queue record read down to its event body, the event itself not decoded."""

    flags: int
    queue_id: str
    changelog_partition: int
    changelog_offset: int
    enqueued_at: int
    #: The EntryEvent's Avro body (``decode_entry`` reads it).
    event_body: bytes

    @property
    def possible_duplicate(self) -> bool:
        return bool(self.flags & FLAG_POSSIBLE_DUPLICATE)

    @property
    def routed(self) -> bool:
        return bool(self.flags & FLAG_ROUTED)

    @property
    def generate_callbacks(self) -> bool:
        return not self.flags & FLAG_NO_CALLBACKS


def read_queued(codec: Codec, data: bytes | None) -> QueuedView:
    """A queue record's fields and event body; ``CodecError`` when it is not a QueuedEvent.

    The event body is not checked here: its first reader (``decode_entry``)
    finds a damaged one.  A record of an older QueuedEvent version (no
    ``flags``) is decoded whole with schema resolution and its event written
    again, so what it returns is the same for every version."""
    header = codec.header("QueuedEvent")
    if data is not None and data[:len(header)] == header:
        try:
            pos = len(header)
            flags, pos = _read_int(data, pos, "QueuedEvent.flags")
            queue_id, pos = _read_string(data, pos)
            partition, pos = _read_int(data, pos, "QueuedEvent.changelog_partition")
            offset, pos = read_long(data, pos)
            enqueued_at, pos = read_long(data, pos)
        except IndexError:
            raise MalformedRecord(f"QueuedEvent of {len(data)} bytes is truncated") from None
        return QueuedView(flags, queue_id, partition, offset, enqueued_at, data[pos:])
    record = codec.decode_as("QueuedEvent", data)
    event = EntryEvent.from_record(record["event"])
    return QueuedView(record["flags"], record["queue_id"], record["changelog_partition"], record["changelog_offset"],
                      record["enqueued_at"], entry_event_body(event))


__all__ = ["FLAG_NO_CALLBACKS", "FLAG_POSSIBLE_DUPLICATE", "FLAG_ROUTED", "EntryLayout", "QueuedView", "decode_entry",
           "entry_event_body", "entry_region_key", "queued_event", "read_long", "read_queued", "splice_entry",
           "string", "varint", "varint32"]


# --- gateway batches (issue 18) ----------------------------------------------------------------
#
# A GatewayBatch of version 3 carries its events as the EntryEvent bodies they were queued as
# (``event_bodies``), with what the sender changes beside them: the indexes of the events that are
# possibleDuplicate (``duplicate_events``) and, per region, the dsids added to visited_dsids
# (``visited_added``).  The sender writes one without decoding an event (``gateway_batch``); the
# receiver reads one down to its bodies (``read_gateway_batch``), routes each by its key
# (``entry_region_key``) and hands the region's bucket owners the record, or a record of the events
# each owns, again as bytes; only the owner decodes an event, and it merges the sender's changes in
# (``visited_after``).  Version 4 adds the indexes of the events that fire no callbacks on the
# receiving site (``no_callback_events``: wan-copy's entries).  A receiver that has not said it reads
# version 4 (GatewayAck.batch_versions) gets version 3, without them; one that has not said it reads
# version 3 gets version 2, events as records with the changes spliced in (``gateway_batch_v2``).

#: The GatewayBatch versions this release reads (GatewayAck.batch_versions): 1 and 2 carry their
#: events as records, 3 and 4 as queued bodies.
BATCH_VERSIONS_READ = (1, 2, 3, 4)
#: The first GatewayBatch version whose events travel as bodies.
BATCH_VERSION_BODIES = 3
#: The version of the current GatewayBatch schema: version 3 and ``no_callback_events``.
BATCH_VERSION_CALLBACKS = 4
#: The single-object header of GatewayBatch version 2 (``avro/history/GatewayBatch.v2.avsc``): the
#: schema is frozen, so its fingerprint is too (a unit test checks it against the file).
GATEWAY_BATCH_V2_HEADER = b"\xc3\x01" + bytes.fromhex("caf45773c95cd177")
#: The single-object header of GatewayBatch version 3 (``avro/history/GatewayBatch.v3.avsc``), frozen too.
GATEWAY_BATCH_V3_HEADER = b"\xc3\x01" + bytes.fromhex("d1397a0613676b89")
#: An EventID for an event whose body does not say its own (damaged): no real one has negative ids.
UNKNOWN_EVENT_ID = EventID("", -1, -1)


@dataclass(frozen=True, slots=True)
class BatchView:
    """A GatewayBatch read down to its events' bodies, the events themselves not decoded."""

    sender_id: str
    source_dsid: int
    target_dsid: int
    queue_partition: int
    batch_id: int
    first_offset: int
    last_offset: int
    #: The batch was sent before: every event of it is possibleDuplicate.
    possible_duplicate: bool
    created_at: int
    #: Each event's EntryEvent body: those of ``events`` (records, as versions 1 and 2 carry them) then
    #: those of ``event_bodies``.
    bodies: tuple[bytes, ...]
    #: The indexes of the events the sender flagged possibleDuplicate (the batch's own flag aside).
    duplicate_events: frozenset[int]
    visited_added: dict[str, tuple[int, ...]]
    traceparents: tuple[str, ...]
    #: Written with the current schema (else an older version, read through schema resolution).
    current: bool
    #: The indexes of the events that fire no callbacks here (wan-copy's entries; version 4 on).
    no_callback_events: frozenset[int] = frozenset()

    def events(self) -> list[EntryEvent]:
        """Every event as the receiving site applies it (``batch_event``); ``MalformedRecord`` for a
        damaged body."""
        return [batch_event(self, i) for i in range(len(self.bodies))]


def batch_event(view: BatchView, index: int) -> EntryEvent:
    """Event ``index`` of a batch as the receiving site applies it: its body decoded, the sender's
    changes merged in: possibleDuplicate when its body, ``duplicate_events`` or the batch says so, and
    ``visited_added`` of its region (the batch's source_dsid for a region not listed) joined to its
    visited_dsids, never its origin (``visited_after``).  For a batch of version 1 or 2 the sender
    merged them already, and merging again changes nothing.  ``MalformedRecord`` for a damaged body."""
    return batch_event_body(view, index)[0]


def batch_event_body(view: BatchView, index: int) -> tuple[EntryEvent, bytes]:
    """``batch_event`` and its body: the body received, the sender's changes spliced in where they
    change it (``splice_entry``), byte for byte ``entry_event_body`` of the event."""
    if _compiled is not None:
        made = _compiled.batch_event_body(view, index)
        if made is not None:
            return made  # type: ignore[no-any-return]
    return batch_event_body_py(view, index)


def batch_event_body_py(view: BatchView, index: int) -> tuple[EntryEvent, bytes]:
    """``batch_event_body`` in Python: the reference of the compiled one."""
    body = view.bodies[index]
    event, layout = decode_entry_py(body)
    added = view.visited_added.get(event.region)
    visited = _visited_after(event.visited_dsids, (view.source_dsid,) if added is None else tuple(added),
                             event.origin_dsid)
    duplicate = event.possible_duplicate or view.possible_duplicate or index in view.duplicate_events
    if visited == event.visited_dsids and duplicate == event.possible_duplicate:
        return event, body
    return (replace(event, visited_dsids=visited, possible_duplicate=duplicate),
            splice_entry(body, layout, possible_duplicate=duplicate, visited_dsids=visited))


@lru_cache(maxsize=4096)
def _visited_after(visited: tuple[int, ...], added: tuple[int, ...], origin: int) -> tuple[int, ...]:
    """``visited_after`` of hashable arguments, remembered: a batch's events share a few of them."""
    return visited_after(visited, added, origin)


def visited_after(visited: Sequence[int], added: Iterable[int], origin: int) -> tuple[int, ...]:
    """An event's visited_dsids once the sites ``added`` are in: sorted, without its origin."""
    merged = set(visited)
    merged.update(added)
    merged.discard(origin)
    return tuple(sorted(merged))


def _batch_head(sender_id: str, source_dsid: int, target_dsid: int, queue_partition: int, batch_id: int,
                first_offset: int, last_offset: int, possible_duplicate: bool, created_at: int) -> bytes:
    """The fields every GatewayBatch version begins with, up to ``events``."""
    return b"".join((string(sender_id), varint32(source_dsid), varint32(target_dsid), varint32(queue_partition),
                     varint(batch_id), varint(first_offset), varint(last_offset),
                     b"\x01" if possible_duplicate else b"\x00", varint(created_at)))


def gateway_batch(header: bytes, *, sender_id: str, source_dsid: int, target_dsid: int, queue_partition: int,
                  batch_id: int, first_offset: int, last_offset: int, possible_duplicate: bool, created_at: int,
                  bodies: Sequence[bytes], duplicate_events: Sequence[int] = (),
                  visited_added: Mapping[str, Sequence[int]] | None = None,
                  traceparents: Sequence[str] = (), no_callback_events: Sequence[int] | None = ()) -> bytes:
    """A GatewayBatch of the current version (``header``: ``codec.header("GatewayBatch")``) carrying
    ``bodies`` as they are, byte for byte what fastavro writes of the same record.  With
    ``no_callback_events`` None, a batch of version 3 (``header``: ``GATEWAY_BATCH_V3_HEADER``), for a
    receiver that does not read version 4."""
    parts = [header, _batch_head(sender_id, source_dsid, target_dsid, queue_partition, batch_id, first_offset,
                                 last_offset, possible_duplicate, created_at),
             b"\x00\x00"]  # events: none as records; signature: null
    if bodies:
        parts.append(varint(len(bodies)))
        for body in bodies:
            parts.append(varint(len(body)))
            parts.append(body)
    parts.append(b"\x00")
    parts.append(_int_array(tuple(duplicate_events)))
    if visited_added:
        parts.append(varint(len(visited_added)))
        for region, dsids in visited_added.items():
            parts.append(_cached_string(region))
            parts.append(_int_array(tuple(dsids)))
    parts.append(b"\x00")
    if traceparents:
        parts.append(varint(len(traceparents)))
        parts.extend(string(t) for t in traceparents)
    parts.append(b"\x00")
    if no_callback_events is not None:
        parts.append(_int_array(tuple(no_callback_events)))
    return b"".join(parts)


def gateway_batch_v2(*, sender_id: str, source_dsid: int, target_dsid: int, queue_partition: int, batch_id: int,
                     first_offset: int, last_offset: int, possible_duplicate: bool, created_at: int,
                     bodies: Sequence[bytes]) -> bytes:
    """A GatewayBatch of version 2, as a sender of that version wrote it: each body (the sender's
    changes already spliced in, ``splice_entry``) is an EntryEvent record of its ``events``."""
    parts = [GATEWAY_BATCH_V2_HEADER, _batch_head(sender_id, source_dsid, target_dsid, queue_partition, batch_id,
                                                  first_offset, last_offset, possible_duplicate, created_at)]
    if bodies:
        parts.append(varint(len(bodies)))
        parts.extend(bodies)
    parts.append(b"\x00\x00")  # the end of events; signature: null
    return b"".join(parts)


def read_gateway_batch(codec: Codec, data: bytes | None) -> BatchView:
    """A GatewayBatch's fields and its events' bodies; ``CodecError`` when it is not a GatewayBatch.

    The current version is read by hand, its ``event_bodies`` not decoded (a damaged one is found by
    whoever decodes it); an event carried as a record (``events``) is read to find where it ends, so
    a damaged one refuses the batch, as the codec would.  An older version is decoded whole with
    schema resolution and its events written again as bodies."""
    header = codec.header("GatewayBatch")
    if data is not None and data[:len(header)] == header:
        try:
            return _read_batch(data, len(header))
        except IndexError:
            raise MalformedRecord(f"GatewayBatch of {len(data)} bytes is truncated") from None
    record = codec.decode_as("GatewayBatch", data)
    bodies = [entry_event_body(EntryEvent.from_record(e)) for e in record["events"]]
    bodies += record["event_bodies"]
    return BatchView(record["sender_id"], record["source_dsid"], record["target_dsid"], record["queue_partition"],
                     record["batch_id"], record["first_offset"], record["last_offset"],
                     record["possible_duplicate"], record["created_at"], tuple(bodies),
                     frozenset(record["duplicate_events"]),
                     {r: tuple(d) for r, d in record["visited_added"].items()}, tuple(record["traceparents"]),
                     current=False, no_callback_events=frozenset(record["no_callback_events"]))


def _read_count(buf: bytes, pos: int) -> tuple[int, int]:
    """An array or map block's item count (0: the end), its byte size skipped when it is given."""
    count, pos = read_long(buf, pos)
    if count < 0:
        count = -count
        _size, pos = read_long(buf, pos)
    return count, pos


def _read_items(buf: bytes, pos: int, read_item: Callable[[bytes, int], tuple[Any, int]]) -> tuple[list[Any], int]:
    """An array's items (or a map's pairs), each read by ``read_item``, block by block."""
    items: list[Any] = []
    while True:
        count, pos = _read_count(buf, pos)
        if count == 0:
            return items, pos
        for _ in range(count):
            item, pos = read_item(buf, pos)
            items.append(item)


def _entry_span(buf: bytes, pos: int) -> tuple[bytes, int]:
    """An EntryEvent written as a record: its bytes, read through (so checked) but not kept decoded."""
    _event, _layout, end = _decode_entry(buf, pos)
    return buf[pos:end], end


def _visited_added_pair(buf: bytes, pos: int) -> tuple[tuple[str, tuple[int, ...]], int]:
    region, pos = _read_string(buf, pos)
    visited, pos = _read_int_array(buf, pos, "GatewayBatch.visited_added")
    return (region, visited), pos


def _read_batch(buf: bytes, pos: int) -> BatchView:
    sender_id, pos = _read_string(buf, pos)
    source, pos = _read_int(buf, pos, "GatewayBatch.source_dsid")
    target, pos = _read_int(buf, pos, "GatewayBatch.target_dsid")
    partition, pos = _read_int(buf, pos, "GatewayBatch.queue_partition")
    batch_id, pos = read_long(buf, pos)
    first, pos = read_long(buf, pos)
    last, pos = read_long(buf, pos)
    duplicate, pos = _read_boolean(buf, pos)
    created, pos = read_long(buf, pos)
    bodies, pos = _read_items(buf, pos, _entry_span)
    branch, pos = _union_branch(buf, pos, "GatewayBatch.signature")
    if branch:
        pos = _skip_bytes(buf, pos)
    more, pos = _read_items(buf, pos, _read_bytes)
    bodies += more
    flags, pos = _read_int_array(buf, pos, "GatewayBatch.duplicate_events")
    pairs, pos = _read_items(buf, pos, _visited_added_pair)
    added: dict[str, tuple[int, ...]] = dict(pairs)
    traces, pos = _read_items(buf, pos, _read_string)
    quiet, pos = _read_int_array(buf, pos, "GatewayBatch.no_callback_events")
    if pos != len(buf):
        raise MalformedRecord(f"GatewayBatch body has {len(buf) - pos} trailing bytes")
    return BatchView(sender_id, source, target, partition, batch_id, first, last, duplicate, created,
                     tuple(bodies), frozenset(flags), added, tuple(traces), current=True,
                     no_callback_events=frozenset(quiet))


def entry_event_id(body: bytes, pos: int = 0) -> EventID:
    """The EventID of an EntryEvent body, read past the fields before it without decoding them;
    ``MalformedRecord`` when the body does not reach it."""
    try:
        pos = _skip_bytes(body, pos)  # region
        pos = _skip_bytes(body, pos)  # key
        _op, pos = read_long(body, pos)
        branch, pos = _union_branch(body, pos, "EntryEvent.value")
        if branch:
            pos = _skip_bytes(body, pos)
        pos = _skip_bytes(body, pos)  # value_encoding
        branch, pos = _union_branch(body, pos, "EntryEvent.callback_argument")
        if branch:
            pos = _skip_bytes(body, pos)
        member, pos = _read_string(body, pos + 1)  # past possible_duplicate
        thread, pos = read_long(body, pos)
        sequence, _ = read_long(body, pos)
    except IndexError:
        raise MalformedRecord(f"EntryEvent body of {len(body) - pos} bytes is truncated") from None
    return EventID(member, thread, sequence)


__all__ += ["BATCH_VERSIONS_READ", "BATCH_VERSION_BODIES", "BATCH_VERSION_CALLBACKS", "GATEWAY_BATCH_V2_HEADER",
            "GATEWAY_BATCH_V3_HEADER", "UNKNOWN_EVENT_ID", "BatchView",
            "batch_event", "batch_event_body", "entry_event_id", "gateway_batch", "gateway_batch_v2",
            "read_gateway_batch", "visited_after"]


# --- subscriptions: routing an event and splicing client messages (issue 18) -------------------
#
# The subscription service reads every changelog record to route it to the clients interested in
# its key.  ``read_entry_head`` reads what routing needs from the body's first eight fields (region,
# key, operation, where the value lies, and the EventID's member: a client never hears of its own
# writes); ``check_entry_tail`` reads the rest only where it is needed (a record delivered, or
# checked for the dead-letter topic), with the thread and sequence and the bucket a region clear's
# routing needs.  Together they refuse exactly what ``decode_entry`` refuses.  A client's message
# is then the body spliced into a ``ClientMessage`` (``client_event_message``), and, for a client
# that receives invalidates rather than values, the body with its value cut out first
# (``entry_without_value``): no event is decoded into objects or encoded again.


class EntryHead(NamedTuple):
    """The first fields of an EntryEvent body, and where its value and the rest lie (byte offsets)."""

    region: str
    key: str
    operation: Operation
    #: EventID.member_id: who wrote the event.
    member_id: str
    #: The value union's first byte (its branch), and where value_encoding begins after it.
    value_at: int
    value_end: int
    #: Where EventID.thread_id begins: what ``check_entry_tail`` reads from.
    tail_at: int


def _read_text(buf: bytes, pos: int, what: str) -> tuple[str, int]:
    """``_read_string`` with the one-byte length of a short string read inline (most are short)."""
    n = buf[pos]
    if n < 0x80:
        n = (n >> 1) ^ -(n & 1)
        pos += 1
    else:
        n, pos = read_long(buf, pos)
    end = pos + n
    if n < 0 or end > len(buf):
        raise MalformedRecord(f"{what}: a length of {n} at byte {pos} runs past the end ({len(buf)} bytes)")
    try:
        return buf[pos:end].decode("utf-8"), end
    except UnicodeDecodeError as exc:
        raise MalformedRecord(f"{what}: the string before byte {end} is not UTF-8: {exc.reason}") from None


def read_entry_head(body: bytes, pos: int = 0) -> EntryHead:
    """The ``EntryHead`` of the EntryEvent body ``body[pos:]`` (offsets relative to ``body``), read as
    strictly as ``decode_entry`` reads those fields; ``MalformedRecord`` otherwise."""
    try:
        region, pos = _read_text(body, pos, "EntryEvent.region")
        key, pos = _read_text(body, pos, "EntryEvent.key")
        op_index, pos = read_long(body, pos)
        if not 0 <= op_index < len(_OPERATIONS):
            raise MalformedRecord(f"EntryEvent.operation: symbol {op_index} is not one of the {len(_OPERATIONS)}")
        value_at = pos
        branch, pos = _union_branch(body, pos, "EntryEvent.value")
        if branch:
            pos = _skip_bytes(body, pos)
        value_end = pos
        _encoding, pos = _read_text(body, pos, "EntryEvent.value_encoding")
        branch, pos = _union_branch(body, pos, "EntryEvent.callback_argument")
        if branch:
            _callback, pos = _read_text(body, pos, "EntryEvent.callback_argument")
        if pos >= len(body):
            raise IndexError  # possible_duplicate: any byte is a boolean, but one must be there
        member, pos = _read_text(body, pos + 1, "EventID.member_id")
    except IndexError:
        raise MalformedRecord(f"EntryEvent body of {len(body)} bytes is truncated") from None
    return EntryHead(region, key, _OPERATIONS[op_index], member, value_at, value_end, pos)


def check_entry_tail(body: bytes, head: EntryHead) -> tuple[int, int, int]:
    """(EventID.thread_id, EventID.sequence_id, bucket) of the body whose head is ``head``, having read
    the rest of it to its very end as strictly as ``decode_entry`` does; ``MalformedRecord`` otherwise."""
    pos = head.tail_at
    try:
        thread, pos = read_long(body, pos)
        sequence, pos = read_long(body, pos)
        _dsid, pos = _read_int(body, pos, "VersionTag.dsid")
        _timestamp, pos = read_long(body, pos)
        _entry_version, pos = read_long(body, pos)
        _version_member, pos = _read_text(body, pos, "VersionTag.member_id")
        _origin, pos = _read_int(body, pos, "EntryEvent.origin_dsid")
        if body[pos] == 0:
            pos += 1  # no visited sites: the array's closing count alone
        else:
            _visited, pos = _read_int_array(body, pos, "EntryEvent.visited_dsids")
        bucket, pos = _read_int(body, pos, "EntryEvent.bucket")
        _event_time, pos = read_long(body, pos)
        branch, pos = _union_branch(body, pos, "EntryEvent.transaction")
        if branch:
            _tx_id, pos = _read_text(body, pos, "TransactionMark.id")
            if pos >= len(body):
                raise IndexError  # TransactionMark.last
            pos += 1
    except IndexError:
        raise MalformedRecord(f"EntryEvent body of {len(body)} bytes is truncated") from None
    if pos != len(body):
        raise MalformedRecord(f"EntryEvent body has {len(body) - pos} trailing bytes")
    return thread, sequence, bucket


def entry_without_value(body: bytes, head: EntryHead) -> bytes:
    """The body (``read_entry_head(body)`` gave ``head``) with its value null: what a client that
    receives invalidates is sent.  Equal to ``entry_event_body`` of the event without its value."""
    if body[head.value_at] == 0:
        return body
    return b"".join((body[:head.value_at], b"\x00", body[head.value_end:]))


#: A ClientMessage's fields before its event, for an EVENT: kind EVENT (symbol 0), session "",
#: version 0, and the event union's branch 1 (an EntryEvent follows).
_CLIENT_EVENT_HEAD = b"\x00\x00\x00\x02"


def client_event_message(header: bytes, event_body: bytes, *, receive_values: bool, possible_duplicate: bool,
                         filled_at: int) -> bytes:
    """A ClientMessage of kind EVENT around an EntryEvent body (``header``: the marker and the current
    ClientMessage fingerprint, ``codec.header("ClientMessage")``), byte for byte what fastavro writes
    of ``{"kind": "EVENT", "event": …, "receive_values": …, "possible_duplicate": …, "filled_at": …}``
    with the other fields at their defaults (the unit tests check it)."""
    return b"".join((header, _CLIENT_EVENT_HEAD, event_body, b"\x01" if receive_values else b"\x00",
                     b"\x01" if possible_duplicate else b"\x00", varint(filled_at), b"\x00"))


__all__ += ["COMPILED", "batch_event_body_py", "decode_entry_py", "entry_event_body_py", "new_entry_event",
            "new_version_tag", "queued_event_py"]
__all__ += ["EntryHead", "check_entry_tail", "client_event_message", "entry_without_value", "read_entry_head"]


# --- partial reads (added for the queue loop) --------------------------------------------------


def entry_operation(body: bytes, pos: int = 0) -> Operation:
    """The operation of an EntryEvent body, from its first three fields only (region and key are
    skipped, not decoded): what batch conflation needs, without a full decode."""
    try:
        pos = _skip_bytes(body, pos)
        pos = _skip_bytes(body, pos)
        op_index, _ = read_long(body, pos)
    except IndexError:
        raise MalformedRecord(f"EntryEvent body of {len(body) - pos} bytes is truncated") from None
    if not 0 <= op_index < len(_OPERATIONS):
        raise MalformedRecord(f"EntryEvent.operation: symbol {op_index} is not one of the {len(_OPERATIONS)}")
    return _OPERATIONS[op_index]


__all__ += ["entry_operation"]


def queued_flags_body(header: bytes, data: bytes | None) -> tuple[int, bytes] | None:
    """``queued_flags_body_py``, through the compiled reader where it is built (issue 18: the
    queue loop calls it for every record)."""
    if _compiled is not None:
        read = _compiled.queued_flags_body(header, data)
        if read is not None:
            return read  # type: ignore[no-any-return]
    return queued_flags_body_py(header, data)


def queued_flags_body_py(header: bytes, data: bytes | None) -> tuple[int, bytes] | None:
    """(flags, event body) of a queue record of the current QueuedEvent version (``header``:
    ``codec.header("QueuedEvent")``), the fields between skipped: what the queue loop needs of
    every record, at a third of ``read_queued``'s cost (no view, no strings made).  None when the
    record does not start with ``header``: ``read_queued`` reads it (an older version) or says why
    it is refused.  ``MalformedRecord`` when the fields run past the end.  It does not check what
    it skips (the queue id's UTF-8, the partition's range), which no reader of the event uses;
    otherwise it equals ``read_queued`` (the unit tests check it)."""
    if data is None or data[:len(header)] != header:
        return None
    pos = len(header)
    try:
        b = data[pos]
        if b < 0x80:
            flags = (b >> 1) ^ -(b & 1)
            pos += 1
        else:
            flags, pos = read_long(data, pos)
            if not INT_MIN <= flags <= INT_MAX:
                raise MalformedRecord(f"QueuedEvent.flags: {flags} does not fit an Avro int")
        n, pos = read_long(data, pos)  # the queue id's length
        if n < 0:
            raise MalformedRecord(f"QueuedEvent.queue_id: a length of {n}")
        pos += n
        for _ in range(3):  # changelog_partition, changelog_offset, enqueued_at
            start = pos
            while data[pos] & 0x80:
                pos += 1
            pos += 1
            if pos - start > 10:
                raise MalformedRecord(f"a varint at byte {start} runs past 10 bytes")
    except IndexError:
        raise MalformedRecord(f"QueuedEvent of {len(data)} bytes is truncated") from None
    return flags, data[pos:]


__all__ += ["queued_flags_body", "queued_flags_body_py"]


def removal_record(header: bytes, queue_id: str, queue_partition: int, batch_id: int, last_removed_offset: int,
                   last_event_id: EventID | None, removed_count: int, removed_at: int) -> bytes:
    """A ``RemovalRecord`` (``header``: ``codec.header("RemovalRecord")``), written once per
    delivered batch by the queue loop, byte for byte what fastavro writes of the same record
    (the unit tests check it) without its validation pass or its dictionaries."""
    if last_event_id is None:
        eid = b"\x00"
    else:
        eid = b"".join((b"\x02", _cached_string(last_event_id.member_id), varint(last_event_id.thread_id),
                        varint(last_event_id.sequence_id)))
    return b"".join((header, _cached_string(queue_id), varint32(queue_partition), varint(batch_id),
                     varint(last_removed_offset), eid, varint(removed_count), varint(removed_at)))


__all__ += ["removal_record"]


def _load_compiled() -> Any:
    """The compiled twin of this module's per-event readers (``_eventwire.pyx``), bound to this
    module's pieces; None where it is not built or ``SLUICE_PURE_PYTHON`` is set (the Python readers
    then do everything, as fast as Python goes)."""
    if os.environ.get("SLUICE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from . import _eventwire  # type: ignore[attr-defined]  # noqa: PLC0415 - optional, compiled
    except ImportError:
        return None
    _eventwire.bind(EntryLayout, _visited_after, _cached_int_array)
    return _eventwire


_compiled = _load_compiled()
#: ``EntryEvent(...)`` and ``VersionTag(...)`` with positional fields, built by the compiled module
#: where it is in use (without the frozen dataclasses' ``__init__``): for the region's write path.
new_entry_event: Callable[..., EntryEvent] = EntryEvent if _compiled is None else _compiled.new_entry_event
new_version_tag: Callable[..., VersionTag] = VersionTag if _compiled is None else _compiled.new_version_tag
#: The compiled ``queued_flags_body`` without its Python wrapper, for the queue loop's read of every
#: record: it answers None for a record it leaves to ``queued_flags_body`` (another version, a damaged
#: one), and for every record where the compiled module is not in use.
queued_flags_body_lean: Callable[[bytes, bytes | None], tuple[int, bytes] | None] = (
    (lambda header, data: None) if _compiled is None else _compiled.queued_flags_body)
#: Whether the compiled readers are in use (tests/unit/test_eventwire_compiled.py checks that ``make`` built them).
COMPILED = _compiled is not None
