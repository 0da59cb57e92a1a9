"""The state of one bucket, and the rules that turn a request into an event.

Pure code: no I/O, no clock (the caller passes ``now_ms``).  The owner of a
bucket calls ``prepare`` for each operation, in the order it accepts them;
``prepare`` checks Geode's preconditions, assigns the version tag, updates
the entries and returns the event to write.  A new owner rebuilds the same
state by feeding every changelog record of the bucket to ``replay``.

Duplicate detection follows Geode's EventTracker: the highest sequence id
applied per (member, thread) is remembered, and an operation at or below it
is a retry of something already applied.  It is answered, not applied again.
The tracking is part of the changelog (every record carries its EventID), so
it survives a change of owner.

An EventID is whatever the caller sends, so a caller could send another
member's (member, thread) with a sequence far ahead of that stream: every
later write of that member would then be a "duplicate", never applied.  Two
rules keep one caller from pinning another's stream:

* a local write may not jump more than ``STREAM_AHEAD_MAX`` (2^32) past the
  highest sequence of its stream in the bucket (a stream the bucket has not
  seen starts anywhere; the EventID bounds of ``core/eventchecks.py`` apply);
* events another site applied keep their own EventIDs but are not tracked
  as streams of this site (their repeats are recognised per key, see
  ``prepare_remote``), so a remote event cannot pin a local writer either.

What remains: a caller holding the client token can still replay another
client's EventIDs within that window, and can start a stream the bucket has
not seen yet (another client's member id is visible in every entry it
wrote).  Member ids are not bound to credentials.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Iterator, MutableMapping

from ..core.framing import Frames
from ..core.errors import EntryExists, EntryNotFound, InvalidRequest
from ..core.events import DESTROYS, REGION_OPERATIONS, EntryEvent, EventID, Operation, VersionTag
from ..core.eventwire import decode_entry, new_entry_event, new_version_tag
from .conflicts import ConflictResolver, resolve


#: How far past the highest sequence of its (member, thread) stream in a bucket a local write may jump.
STREAM_AHEAD_MAX = 2**32


def changelog_event(value: bytes | None, frames: Frames) -> EntryEvent:
    """The EntryEvent of a changelog record's value, in either framing (``core/framing.py``).
    Records of the current EntryEvent schema are read by the codec module's EntryEvent reader
    (compiled where built), records of earlier schema versions through the codec, which resolves them;
    anything else raises ``CodecError``."""
    header = frames.current_header(value, "EntryEvent")
    if header is not None:
        return decode_entry(value[len(header):])[0]  # type: ignore[index]
    return EntryEvent.from_record(frames.decode_as("EntryEvent", value))


class Op(str, enum.Enum):
    """What a caller asks for (the event's Operation is decided by the state)."""

    CREATE = "create"
    PUT = "put"
    PUT_ALL = "put_all"
    DESTROY = "destroy"
    REMOVE_ALL = "remove_all"
    INVALIDATE = "invalidate"
    REMOTE = "remote"  # an event another site applied, through the gateway receiver
    CLEAR = "clear"  # region clear: every entry of the bucket
    DESTROY_REGION = "destroy_region"  # region destroy: as clear, and clients drop the region


class Entry(tuple):  # type: ignore[type-arg]
    """A key's state: its value (None: invalid, or destroyed), the version tag and the EventID of the
    event that last wrote it, and whether that event destroyed it (a tombstone keeps the version for
    conflict checks).

    A region holds one per key, so it is one flat tuple of the fields rather than an object holding a
    VersionTag and an EventID: about 120 bytes less per entry.  ``version`` and ``event_id`` are
    built when asked for; the state's own checks read the fields.
    """

    __slots__ = ()

    def __new__(cls, value: bytes | None, version: VersionTag, event_id: EventID, destroyed: bool = False) -> "Entry":
        return tuple.__new__(cls, (value, version.dsid, version.timestamp, version.entry_version, version.member_id,
                                   event_id.member_id, event_id.thread_id, event_id.sequence_id, destroyed))

    value: bytes | None = property(itemgetter(0))  # type: ignore[assignment]
    dsid: int = property(itemgetter(1))  # type: ignore[assignment]
    timestamp: int = property(itemgetter(2))  # type: ignore[assignment]
    entry_version: int = property(itemgetter(3))  # type: ignore[assignment]
    member_id: str = property(itemgetter(5))  # type: ignore[assignment]  # the EventID's
    thread_id: int = property(itemgetter(6))  # type: ignore[assignment]
    sequence_id: int = property(itemgetter(7))  # type: ignore[assignment]
    destroyed: bool = property(itemgetter(8))  # type: ignore[assignment]

    @property
    def version(self) -> VersionTag:
        return new_version_tag(self[1], self[2], self[3], self[4])

    @property
    def event_id(self) -> EventID:
        return EventID(self[5], self[6], self[7])

    def __repr__(self) -> str:
        return (f"Entry(value={self.value!r}, version={self.version!r}, event_id={self.event_id!r}, "
                f"destroyed={self.destroyed!r})")


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The operation was applied before (a retry with the same EventID)."""

    event_id: EventID


@dataclass(frozen=True, slots=True)
class ConflictLost:
    """A remote event lost the WAN conflict against the entry's current version."""

    event_id: EventID
    current: VersionTag
    incoming: VersionTag


@dataclass(frozen=True, slots=True)
class Skipped:
    """The operation has nothing to do (remove_all of an absent key)."""

    key: str


class BucketState:
    """Entries and duplicate tracking of one bucket of one region."""

    __slots__ = ("region", "bucket", "dsid", "member_id", "entries", "streams", "stream_seen_ms")

    def __init__(self, region: str, bucket: int, dsid: int, member_id: str,
                 entries: MutableMapping[str, Entry] | None = None) -> None:
        self.region = region
        self.bucket = bucket
        self.dsid = dsid
        self.member_id = member_id
        #: A dict, or the bucket's part of the local store (store.StoredEntries).
        self.entries: MutableMapping[str, Entry] = {} if entries is None else entries
        self.streams: dict[tuple[str, int], int] = {}
        self.stream_seen_ms: dict[tuple[str, int], int] = {}

    # --- reads -------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The live entry (valid or invalid), or None when absent or destroyed."""
        entry = self.entries.get(key)
        if entry is None or entry.destroyed:
            return None
        return entry

    def keys(self) -> Iterator[str]:
        return (k for k, e in self.entries.items() if not e.destroyed)

    def size(self) -> int:
        return sum(1 for e in self.entries.values() if not e.destroyed)

    def is_duplicate(self, event_id: EventID) -> bool:
        return event_id.sequence_id <= self.streams.get(event_id.stream, -1)

    def _check_stream(self, event_id: EventID) -> bool:
        """True when ``event_id`` was applied before (a duplicate); InvalidRequest when it jumps
        more than ``STREAM_AHEAD_MAX`` past its stream's highest sequence in this bucket."""
        highest = self.streams.get(event_id.stream)
        if highest is None:
            return False
        if event_id.sequence_id <= highest:
            return True
        if event_id.sequence_id - highest > STREAM_AHEAD_MAX:
            raise InvalidRequest("event_id.sequence_id", event_id.sequence_id,
                                 f"{event_id.sequence_id - highest} past the highest sequence ({highest}) of stream "
                                 f"{event_id.member_id}/{event_id.thread_id} in this bucket; at most "
                                 f"{STREAM_AHEAD_MAX} ahead")
        return False

    # --- writes ------------------------------------------------------------

    def prepare(
        self,
        op: Op,
        key: str,
        value: bytes | None,
        event_id: EventID,
        now_ms: int,
        callback_argument: str | None = None,
    ) -> EntryEvent | Duplicate | Skipped:
        """Check, version and apply one operation; return the event to write."""
        if self._check_stream(event_id):
            return Duplicate(event_id)
        previous = self.entries.get(key)  # a tombstone included: its version orders the next one
        current = None if previous is None or previous.destroyed else previous
        if op is Op.CREATE:
            if current is not None:
                raise EntryExists(self.region, key)
            operation = Operation.CREATE
        elif op is Op.PUT:
            operation = Operation.UPDATE if current is not None else Operation.CREATE
        elif op is Op.PUT_ALL:
            operation = Operation.PUTALL_UPDATE if current is not None else Operation.PUTALL_CREATE
        elif op is Op.DESTROY:
            if current is None:
                raise EntryNotFound(self.region, key)
            operation, value = Operation.DESTROY, None
        elif op is Op.REMOVE_ALL:
            if current is None:
                return Skipped(key)
            operation, value = Operation.REMOVEALL_DESTROY, None
        elif op is Op.INVALIDATE:
            if current is None:
                raise EntryNotFound(self.region, key)
            operation, value = Operation.INVALIDATE, None
        else:  # pragma: no cover - REMOTE goes through prepare_remote
            raise AssertionError(op)

        version = self._next_version(previous, now_ms)
        event = new_entry_event(self.region, key, operation, value, event_id, version, self.dsid, self.bucket,
                                now_ms, callback_argument)
        # replay(event), with what is known here: an event of this site, a destroy only as DESTROY or
        # REMOVEALL_DESTROY (their value is None already).
        destroyed = operation is Operation.DESTROY or operation is Operation.REMOVEALL_DESTROY
        self.entries[key] = tuple.__new__(Entry, (
            value, version.dsid, version.timestamp, version.entry_version, version.member_id,
            event_id.member_id, event_id.thread_id, event_id.sequence_id, destroyed))
        stream = (event_id.member_id, event_id.thread_id)
        if event_id.sequence_id > self.streams.get(stream, -1):
            self.streams[stream] = event_id.sequence_id
        self.stream_seen_ms[stream] = now_ms
        return event

    def _next_version(self, previous: Entry | None, now_ms: int) -> VersionTag:
        """The version of this site's next write of a key last written at ``previous``.

        Timestamps never go backwards for a key, even when a new owner's clock
        is behind the previous owner's.  And a write supersedes, everywhere,
        the version it overwrote: over another site's version with the same
        timestamp and a higher dsid, which would win the conflict at that site,
        the write takes the next millisecond.  So a key's versions at a site
        grow in (timestamp, dsid, entry version) order, which is what
        downstream copies (the SQL write-behind) rely on.
        """
        if previous is None:
            return new_version_tag(self.dsid, now_ms, 1, self.member_id)
        timestamp = max(now_ms, previous.timestamp)
        if timestamp == previous.timestamp and previous.dsid > self.dsid:
            timestamp += 1
        return new_version_tag(self.dsid, timestamp, previous.entry_version + 1, self.member_id)

    def prepare_clear(self, event_id: EventID, now_ms: int,
                      operation: Operation = Operation.REGION_CLEAR) -> list[EntryEvent] | Duplicate:
        """Region clear (or destroy), for this bucket: a REGION_CLEAR (REGION_DESTROY) event per live
        entry (the changelog keeps each key's tombstone), all with the operation's EventID.  Not sent
        to gateway senders or async event queues, as in Geode; subscription clients hear of it."""
        if self._check_stream(event_id):
            return Duplicate(event_id)
        events = []
        for key in list(self.keys()):
            version = self._next_version(self.entries[key], now_ms)
            event = EntryEvent(region=self.region, key=key, operation=operation, value=None,
                               event_id=event_id, version=version, origin_dsid=self.dsid, bucket=self.bucket,
                               event_time=now_ms)
            self.replay(event)
            events.append(event)
        return events

    def prepare_remote(self, event: EntryEvent, resolver: ConflictResolver | None = None
                       ) -> EntryEvent | Duplicate | ConflictLost:
        """An event another site applied, received by this site's gateway receiver.

        Repeats (an EventID at or below the one that last wrote the key, from
        the same member and thread) are answered, not applied.  Against an existing
        entry (a tombstone included) the event applies only when it wins the
        WAN conflict (``conflicts.resolve``: Geode's rule, or the site's
        resolver); it keeps its origin's version tag, so every site ends with
        the same winner.  Only create, update and destroy
        cross sites; a destroy of an absent key or a create of a present one
        is applied as the origin applied it (the sites converge on its version).
        """
        # Repeats are recognised per key, not per (member, thread): one writer
        # thread's events for different keys reach this bucket through
        # different queue partitions (a serial sender's KEY policy), so their
        # sequences interleave here; per key, the order is kept end to end.
        current = self.entries.get(event.key)
        if current is not None:
            incoming = event.event_id
            if (current.member_id == incoming.member_id and current.thread_id == incoming.thread_id
                    and incoming.sequence_id <= current.sequence_id):
                return Duplicate(event.event_id)
            resolved = resolve(resolver, self.region, current.value, current.version, event)
            if resolved is None:
                return ConflictLost(event.event_id, current.version, event.version)
            event = resolved
        if event.region == self.region and event.bucket == self.bucket and (
                event.value is None or not event.operation.removes_value):
            applied = event  # as received: its body, when the caller has it, is its changelog body
        else:
            applied = replace(event, region=self.region, bucket=self.bucket,
                              value=None if event.operation.removes_value else event.value)
        self.replay(applied)
        return applied

    def replay(self, event: EntryEvent) -> None:
        """Apply an event already in the changelog (load) or just prepared."""
        version, event_id = event.version, event.event_id
        destroyed = event.operation in DESTROYS or event.operation in REGION_OPERATIONS
        self.entries[event.key] = tuple.__new__(Entry, (
            None if destroyed else event.value, version.dsid, version.timestamp, version.entry_version,
            version.member_id, event_id.member_id, event_id.thread_id, event_id.sequence_id, destroyed))
        if event.origin_dsid != self.dsid:
            # Another site's event: its repeats are found per key (prepare_remote); as a stream of
            # this site it could only make a local writer's next writes look like repeats.
            return
        stream = event.event_id.stream
        if event.event_id.sequence_id > self.streams.get(stream, -1):
            self.streams[stream] = event.event_id.sequence_id
        self.stream_seen_ms[stream] = event.event_time

    def expire_streams(self, now_ms: int, idle_ms: int) -> int:
        """Forget EventID streams idle for longer than ``idle_ms`` (Geode's
        EventTracker expiry), so tracking stays bounded; returns how many.

        A retry arriving after its stream expired is applied again, as in Geode.
        """
        cutoff = now_ms - idle_ms
        stale = [s for s, seen in self.stream_seen_ms.items() if seen < cutoff]
        for stream in stale:
            del self.stream_seen_ms[stream]
            self.streams.pop(stream, None)
        return len(stale)
