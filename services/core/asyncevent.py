"""What an async event queue's listener sees: ``AsyncEvent`` and the listener contract.

Geode's ``AsyncEventListener.processEvents(List<AsyncEvent>)`` on Kafka::

    class MyListener(AsyncEventListener):
        def init(self, config: dict) -> None: ...          # once, before the first batch
        def process_events(self, events: list[AsyncEvent]) -> bool | Accepted:
            ...                                            # True: the batch is removed
        def close(self) -> None: ...                       # once, on stop

``process_events`` returning ``False`` or raising means the very same batch is
offered again (with backoff), and nothing after it is offered first.  A
listener must therefore be idempotent: after a failover or restart, events
after the last removal are offered again with ``possible_duplicate`` set.

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

A listener is named in the site file by ``listener.type``: ``sql`` and
``kafka`` are the ones shipped with Sluice; ``python`` loads
``listener.class_path`` ("package.module:Class"), or an entry point of the
group ``sluice.listeners`` when the path has no dot or colon.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from . import jsonvalue
from .errors import ConfigError
from .events import UPDATES, EntryEvent, EventID, Operation, VersionTag

LISTENER_ENTRY_POINT_GROUP = "sluice.listeners"

BUILTIN_LISTENERS = {
    "sql": "sluice.listeners.sql:SqlWriteBehindListener",
    "kafka": "sluice.listeners.kafka_forwarder:KafkaForwarderListener",
}


@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """One event of a batch, as Geode's AsyncEvent shows it."""

    event: EntryEvent
    queue_id: str
    partition: int
    offset: int
    #: Set when the event may have been offered before: re-enqueued by a new
    #: region owner, or offered again after a dispatcher failover or restart.
    possible_duplicate: bool

    @property
    def operation(self) -> Operation:
        return self.event.operation

    @property
    def region(self) -> str:
        return self.event.region

    @property
    def key(self) -> str:
        return self.event.key

    @property
    def raw_value(self) -> bytes | None:
        return self.event.value

    @property
    def value(self) -> Any:
        """The deserialized value (None for destroy and invalidate)."""
        return jsonvalue.decode(self.event.value, self.event.value_encoding)

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
        """Updates may replace an earlier update of the key (batch conflation)."""
        return self.event.operation in UPDATES

    @property
    def size_bytes(self) -> int:
        return len(self.event.key) + (len(self.event.value) if self.event.value is not None else 0) + 64

    def __repr__(self) -> str:
        return (f"AsyncEvent({self.operation.value} {self.region}/{self.key} {self.event_id} "
                f"@{self.queue_id}[{self.partition}]:{self.offset}{' possibleDuplicate' if self.possible_duplicate else ''})")


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
