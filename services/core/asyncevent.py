"""What an async event queue's listener sees: ``AsyncEvent`` and the listener contract.

Geode's ``AsyncEventListener.processEvents(List<AsyncEvent>)`` on Kafka::

    class MyListener(AsyncEventListener):
        def init(self, config: dict) -> None: ...          # once, before the first batch
        def process_events(self, events: list[AsyncEvent]) -> bool | Accepted:
            ...                                            # True: the batch is removed
        def close(self) -> None: ...                       # once, on stop

``process_events`` returning ``False`` or raising means the very same batch is
offered again (with backoff), and nothing after it is offered first.  A
listener must therefore be idempotent: the events of a batch offered again
come with ``possible_duplicate`` set, every one of them (as Geode's
``handleUnSuccessfulBatchDispatch`` sets possibleDuplicate on each event of a
batch whose dispatch failed), so a write-behind listener that applied part of
a batch before it failed knows to check; so do the events after the last
removal after a failover or restart.

Dead letters (issue 17).  Offering a batch again only helps when the failure
can go away (a database away, a lock, a deadlock).  An event the listener can
never take (a value that does not fit the table, a constraint its data
violates, bytes that do not decode) would refuse its batch for ever and wedge
the queue.  When the host says it can keep such events (``init``'s config has
``dead_letter_topic``, as the dispatcher's does), ``process_events`` may
return ``Accepted(dead_letters=[DeadLetter(event, reason, error_class)])``:
the rest of the batch is taken, and the dispatcher writes each dead letter to
``dead_letter_topic`` and waits until the broker has it before the batch
leaves the queue (a crash in between offers the batch again: the listener
must reject the same events again, idempotently).  Without
``dead_letter_topic`` (a listener called directly, or an older host) a
listener must refuse the batch instead, so that nothing is dropped unseen.

Events as bytes (issue 18).  The dispatcher hands a listener events made
from their queue records' bytes (``AsyncEvent.of_body``): each is decoded
the first time a field that needs it is touched.  Should that body be
damaged, the touch raises ``MalformedRecord``; the listener need not catch
it: the dispatcher dead-letters such an event with its reason and offers the
rest of the batch again, at once, without it.

A listener is named in the site file by ``listener.type``: ``sql`` and
``kafka`` are the ones shipped with Sluice; ``python`` loads
``listener.class_path`` ("package.module:Class"), or an entry point of the
group ``sluice.listeners`` when the path has no dot or colon.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from . import jsonvalue
from .errors import ConfigError, MalformedRecord
from .events import UPDATES, EntryEvent, EventID, Operation, VersionTag
from .eventwire import decode_entry, entry_event_body, entry_event_id, entry_operation, entry_region_key

if TYPE_CHECKING:
    from .batching import Batch

LISTENER_ENTRY_POINT_GROUP = "sluice.listeners"

BUILTIN_LISTENERS = {
    "sql": "sluice.listeners.sql:SqlWriteBehindListener",
    "kafka": "sluice.listeners.kafka_forwarder:KafkaForwarderListener",
}


class AsyncEvent:
    """One event of a batch, as Geode's AsyncEvent shows it.

    Events travel as bytes (issue 18): the queue loop builds each one from
    its queue record's EntryEvent body (``of_body``) without decoding it.
    The body is decoded on first touch of a field that needs it (``event``,
    ``operation``, ``value``, ``event_id``, ...), once, and kept; ``region``
    and ``key`` read only the body's first two fields, ``conflatable`` its
    first three, and ``size_bytes`` is the body's length, so a listener that
    looks at nothing (or a stage that only forwards ``body``) never pays for
    a decode.  A body that does not decode raises ``MalformedRecord`` on
    every touch that needs it, and the event remembers it
    (``decode_error``): the dispatcher dead-letters such an event with its
    reason and offers the rest of the batch without it.

    An event is a value: its fields are read-only.  The decoded event is a
    cache of what the body says, so two threads touching it at once at worst
    both decode it, and get equal results.
    """

    __slots__ = ("_queue_id", "_partition", "_offset", "_duplicate", "_event", "_body", "_head", "_error", "_size")

    #: False for an event the remote site applies without firing callbacks (Geode's generateCallbacks):
    #: an entry wan-copy region queued for a gateway sender.  A class attribute: such events are
    #: ``queueloop.CopiedEvent``s, so reading a record costs nothing more.
    generate_callbacks = True

    def __init__(self, event: EntryEvent, queue_id: str, partition: int, offset: int,
                 possible_duplicate: bool) -> None:
        """An event already decoded (listeners' tests, filters at enqueue)."""
        self._queue_id = queue_id
        self._partition = partition
        self._offset = offset
        self._duplicate = possible_duplicate
        self._event: EntryEvent | None = event
        self._body: bytes | None = None
        self._head: tuple[str, str] | None = None
        self._error: MalformedRecord | None = None
        self._size = len(event.key) + (len(event.value) if event.value is not None else 0) + 64

    @classmethod
    def of_body(cls, body: bytes, queue_id: str, partition: int, offset: int,
                possible_duplicate: bool) -> AsyncEvent:
        """An event from its EntryEvent's Avro body as queued (``eventwire.read_queued``'s
        ``event_body``), decoded on first touch."""
        self = cls.__new__(cls)
        self._queue_id = queue_id
        self._partition = partition
        self._offset = offset
        self._duplicate = possible_duplicate
        self._event = None
        self._body = body
        self._head = None
        self._error = None
        self._size = len(body) + 64
        return self

    # --- where it was queued ------------------------------------------------------------

    @property
    def queue_id(self) -> str:
        return self._queue_id

    @property
    def partition(self) -> int:
        return self._partition

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def possible_duplicate(self) -> bool:
        """Set when the event may have been offered before: re-enqueued by a new
        region owner, offered again after its batch was refused (False, an
        exception, no ack), or after a dispatcher failover or restart."""
        return self._duplicate

    def as_possible_duplicate(self) -> AsyncEvent:
        """This event flagged possibleDuplicate: itself when it is already, else a copy (what it
        caches of its body too).  An event is a value: one a listener kept from an earlier offer
        keeps saying what that offer said."""
        if self._duplicate:
            return self
        flagged = copy.copy(self)
        flagged._duplicate = True
        return flagged

    # --- the bytes and the decoded event ---------------------------------------------

    @property
    def body(self) -> bytes:
        """The EntryEvent's Avro body (no single-object header): as queued, or encoded once from the event."""
        body = self._body
        if body is None:
            body = self._body = entry_event_body(self._event)  # type: ignore[arg-type]
        return body

    @property
    def event(self) -> EntryEvent:
        """The ``EntryEvent``, decoded on first touch; ``MalformedRecord`` when the body is damaged."""
        event = self._event
        if event is None:
            event = self._decode()
        return event

    @property
    def decode_error(self) -> MalformedRecord | None:
        """Why the body did not decode, once a touch found out (None: not found undecodable)."""
        return self._error

    def _decode(self) -> EntryEvent:
        if self._error is not None:
            raise self._error.with_traceback(None)
        try:
            event, _ = decode_entry(self._body)  # type: ignore[arg-type]
        except MalformedRecord as exc:
            raise self._refuse(exc) from None
        self._event = event
        return event

    def _refuse(self, exc: MalformedRecord) -> MalformedRecord:
        error = MalformedRecord(f"the event at {self._queue_id}[{self._partition}]@{self._offset} does not "
                                f"decode: {exc.reason}")
        if self._error is None:
            self._error = error  # the first reason found is the one kept
        return error

    def _region_key(self) -> tuple[str, str]:
        head = self._head
        if head is None:
            event = self._event
            if event is not None:
                head = (event.region, event.key)
            else:
                # Read even when a full decode failed: the first fields may well be whole.
                try:
                    head = entry_region_key(self._body)  # type: ignore[arg-type]
                except MalformedRecord as exc:
                    raise self._refuse(exc) from None
            self._head = head
        return head

    # --- Geode's AsyncEvent ------------------------------------------------------------

    @property
    def region(self) -> str:
        return self._region_key()[0]

    @property
    def key(self) -> str:
        return self._region_key()[1]

    @property
    def operation(self) -> Operation:
        return self.event.operation

    @property
    def raw_value(self) -> bytes | None:
        return self.event.value

    @property
    def value(self) -> Any:
        """The deserialized value (None for destroy and invalidate)."""
        event = self.event
        return jsonvalue.decode(event.value, event.value_encoding)

    @property
    def callback_argument(self) -> str | None:
        return self.event.callback_argument

    @property
    def event_id(self) -> EventID:
        return self.event.event_id

    @property
    def sequence_id(self) -> int:
        return self.event.event_id.sequence_id

    @property
    def version(self) -> VersionTag:
        return self.event.version

    @property
    def transaction(self) -> tuple[str, bool] | None:
        """(id, last in its bucket) for the events of a put_all / remove_all, when marked."""
        return self.event.transaction

    @property
    def conflatable(self) -> bool:
        """Updates may replace an earlier update of the key (batch conflation).  Read from the
        body's first three fields when not decoded yet: conflation does not decode the event."""
        event = self._event
        if event is not None:
            return event.operation in UPDATES
        try:
            return entry_operation(self._body) in UPDATES  # type: ignore[arg-type]
        except MalformedRecord as exc:
            raise self._refuse(exc) from None

    @property
    def size_bytes(self) -> int:
        """What holding the event costs, roughly: its body's length (its key's and value's for an
        event built decoded), plus 64.  Fixed when the event is made."""
        return self._size

    # --- a value --------------------------------------------------------------------------

    def _identity(self) -> tuple[Any, ...]:
        return (self.queue_id, self.partition, self.offset, self.possible_duplicate, self.body)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._identity() == other._identity()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.queue_id, self.partition, self.offset))

    def __repr__(self) -> str:
        where = (f"@{self.queue_id}[{self.partition}]:{self.offset}"
                 f"{' possibleDuplicate' if self.possible_duplicate else ''}")
        try:
            event = self.event
        except MalformedRecord as exc:
            return f"{type(self).__name__}(undecodable {where}: {exc.reason})"
        return f"{type(self).__name__}({event.operation.value} {event.region}/{event.key} {event.event_id} {where})"


def event_id_of(event: AsyncEvent) -> EventID:
    """An event's EventID without decoding it: the decoded event's when there is one, else read
    from its body (``eventwire.entry_event_id``); ``MalformedRecord`` when the body does not reach it."""
    decoded = event._event
    if decoded is not None:
        return decoded.event_id
    return entry_event_id(event._body)  # type: ignore[arg-type]


def possible_duplicates(events: list[AsyncEvent]) -> list[AsyncEvent]:
    """``events`` flagged possibleDuplicate, in order (the same list when every one is already)."""
    if all(e._duplicate for e in events):
        return events
    return [e.as_possible_duplicate() for e in events]


def flag_possible_duplicates(batch: Batch[AsyncEvent]) -> None:
    """Every event of ``batch`` possibleDuplicate from now on: the batch (the same object, offered
    again) holds flagged copies, in one reference swap, as ``Batch.drop`` does, since the loop
    thread may be reading the old list."""
    batch.events = possible_duplicates(batch.events)


def undecodable(events: list[AsyncEvent]) -> list[AsyncEvent]:
    """The events of ``events`` a touch found undecodable (``decode_error`` set), in order."""
    return [e for e in events if e._error is not None]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An event of the batch the listener can never take, and why: retrying cannot help."""

    event: AsyncEvent
    reason: str
    #: What kind of failure, for whoever reads the dead-letter topic (e.g. the driver's exception class).
    error_class: str = "Rejected"


@dataclass(frozen=True, slots=True)
class Accepted:
    """What ``process_events`` may return instead of ``True`` when ``init``'s config has
    ``dead_letter_topic``: the batch is taken except ``dead_letters``, which the
    dispatcher writes durably to that topic before it removes the batch."""

    dead_letters: tuple[DeadLetter, ...] = ()

    def __post_init__(self) -> None:
        # A list is the natural thing to hand over; keep the value immutable.
        object.__setattr__(self, "dead_letters", tuple(self.dead_letters))


@runtime_checkable
class AsyncEventListener(Protocol):
    """The listener contract (a class need not inherit from this)."""

    def init(self, config: dict[str, Any]) -> None: ...

    def process_events(self, events: list[AsyncEvent]) -> bool | Accepted: ...

    def close(self) -> None: ...


def load_listener_class(kind: str, class_path: str | None) -> type:
    """The listener class for a site file's ``listener`` block."""
    if kind in BUILTIN_LISTENERS:
        path = BUILTIN_LISTENERS[kind]
    elif class_path is None:
        raise ConfigError([("listener.class_path", None, "required for a python listener")])
    elif ":" not in class_path and "." not in class_path:
        found = [ep for ep in entry_points(group=LISTENER_ENTRY_POINT_GROUP) if ep.name == class_path]
        if not found:
            raise ConfigError([("listener.class_path", class_path,
                                f"no entry point named so in group {LISTENER_ENTRY_POINT_GROUP!r}")])
        return found[0].load()  # type: ignore[no-any-return]
    else:
        path = class_path
    cls = import_class(path, "listener.class_path")
    for method in ("process_events",):
        if not callable(getattr(cls, method, None)):
            raise ConfigError([("listener.class_path", path, f"has no {method}() method")])
    return cls  # type: ignore[no-any-return]


def import_class(path: str, field: str) -> Any:
    """The object at ``package.module:Name`` (or ``package.module.Name``); a
    ConfigError naming ``field`` when it cannot be imported."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError([(field, path, f"cannot import: {exc}")]) from exc
