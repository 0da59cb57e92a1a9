"""What a client does with each subscription message: repeats, replay up to the marker, cache, listeners.

The story of one message:

1. A repeat (``cache.EventTracker``: at or below the highest sequence seen
   for its writer thread and key) is discarded and counted.
2. Before the marker (``ready_for_events`` places it; a client's first start
   too), a message is *replayed*: its listeners see it with
   ``replayed=True`` and the cache is left as it is; except that once a
   registration of this connection is answered (its load follows), what
   comes after the answer also updates the cache, since the load may
   predate it.  At the marker each region's listeners get
   ``after_region_live`` and normal processing starts.
3. Afterwards the message is applied to the local cache and its listeners
   called: values put (``after_create`` when the client did not hold the
   key, else ``after_update``), invalidates invalidate an entry the client
   holds (``after_invalidate``; nothing when it holds none), destroys destroy
   (``after_destroy``), a region clear empties the region bucket by bucket
   as its parts arrive and is announced once (``after_region_clear``), a
   region destroy empties it (``after_region_destroy``).

A listener is any object with some of those methods; one that raises is
logged and the others still run: a listener's bug never stops the stream.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..core.events import CREATES, DESTROYS, EventID, Operation
from ..core.interest import Delivery
from ..core.jsonvalue import decode as decode_value
from ..core.subscriptionwire import read_client_event
from .cache import EventTracker, RegionCache

log = logging.getLogger("sluice.client")


@dataclass(frozen=True, slots=True)
class ClientEvent:
    """What a client's listener sees."""

    region: str
    key: str | None  # None for region operations
    operation: Operation
    new_value: Any
    event_id: EventID
    delivery: Delivery
    replayed: bool = False  # before the marker: shown, not applied
    possible_duplicate: bool = False
    callback_argument: str | None = None


def event_of_message(message: dict[str, Any]) -> ClientEvent:
    """The event of a decoded ClientMessage of kind EVENT (``Codec.decode_as``), as listeners see it."""
    e = message["event"]
    return ClientEvent(
        region=e["region"], key=e["key"], operation=Operation(e["operation"]),
        new_value=None if e["value"] is None else decode_value(e["value"], e["value_encoding"]),
        event_id=EventID.from_record(e["event_id"]),
        delivery=Delivery.VALUES if message["receive_values"] else Delivery.INVALIDATES,
        possible_duplicate=message["possible_duplicate"] or e["possible_duplicate"],
        callback_argument=e["callback_argument"],
    )


def read_event(header: bytes, data: bytes | None) -> ClientEvent | None:
    """The event of a ClientMessage of kind EVENT as the subscription service writes it, read from its
    bytes (``subscriptionwire.read_client_event``), equal to ``event_of_message`` of its decoded record;
    None for any other message (the codec reads it).  ``header``: ``codec.header("ClientMessage")``."""
    read = read_client_event(header, data)
    if read is None:
        return None
    e, values, duplicate = read
    return ClientEvent(e.region, e.key, e.operation,
                       None if e.value is None else decode_value(e.value, e.value_encoding),
                       e.event_id, Delivery.VALUES if values else Delivery.INVALIDATES, False,
                       duplicate or e.possible_duplicate, e.callback_argument)


class MessageProcessor:
    """One client's handling of its subscription stream."""

    def __init__(self, caches: dict[str, RegionCache], tracker: EventTracker,
                 listeners: dict[str, list[Any]] | None = None,
                 bucket_of: Callable[[str, str], int] | None = None) -> None:
        self.caches = caches
        self.tracker = tracker
        self.listeners = listeners or {}
        #: (region, key) -> bucket: a region clear arrives bucket by bucket.
        self.bucket_of = bucket_of
        self._clears: dict[EventID, None] = {}  # region clears and destroys already announced (the latest few)
        #: Called with the region's name once a region destroy is applied.
        self.on_region_destroyed: Callable[[str], None] | None = None
        self.live = False
        #: Set once a registration of this connection is answered: events after that answer are applied
        #: to the cache even before the marker (the backlog before it is only replayed).
        self.applying = False
        self.stats = {"applied": 0, "replayed": 0, "repeats": 0, "ignored": 0}

    def on_event(self, event: ClientEvent, now_ms: int) -> bool:
        """Steps 1–3 for one event; True when it reached the listeners."""
        if event.key is not None and self.tracker.is_repeat(event.event_id, event.key, now_ms):
            self.stats["repeats"] += 1
            return False
        cache = self.caches.get(event.region)
        if cache is None:
            self.stats["ignored"] += 1
            return False
        if event.operation is Operation.REGION_CLEAR:
            return self._region_clear(cache, event)
        if event.operation is Operation.REGION_DESTROY:
            return self._region_destroy(cache, event)
        if not self.live:
            self.stats["replayed"] += 1
            replayed = dataclasses.replace(event, replayed=True)
            if self.applying:
                # Queued after the client's registration was answered: newer than the backlog, and the
                # load may predate it, so the cache takes it too (the stream after the answer, applied
                # over the load, ends where the region is).
                callback = self._apply(cache, event)
                if callback is not None:
                    self._call(event.region, callback, replayed)
                return True
            self._call(event.region, self._callback_for(event, held=event.operation not in CREATES), replayed)
            return True
        callback = self._apply(cache, event)
        if callback is None:
            self.stats["ignored"] += 1
            return False
        self.stats["applied"] += 1
        self._call(event.region, callback, event)
        return True

    def on_marker(self) -> None:
        """The marker: what came before was replay; now the cache follows the stream."""
        self.live = True
        for region in self.caches:
            self._call(region, "after_region_live", region)

    def _region_clear(self, cache: RegionCache, event: ClientEvent) -> bool:
        """One bucket's part of a region clear: its entries go (once live); listeners hear of the
        clear once, at its first bucket."""
        if self.live:
            if event.key is None or self.bucket_of is None:
                cache.clear()
            else:
                bucket = self.bucket_of(event.region, event.key)
                cache.drop_where(lambda k: self.bucket_of(event.region, k) == bucket)  # type: ignore[misc]
        self.stats["applied" if self.live else "replayed"] += 1
        if event.event_id in self._clears:
            return False
        self._clears[event.event_id] = None
        while len(self._clears) > 64:
            del self._clears[next(iter(self._clears))]
        shown = dataclasses.replace(event, key=None, new_value=None, replayed=not self.live)
        self._call(event.region, "after_region_clear", shown)
        return True

    def _region_destroy(self, cache: RegionCache, event: ClientEvent) -> bool:
        """A region destroy, at its first part: the region's entries go, its listeners hear of it
        (``after_region_destroy``) and ``on_region_destroyed`` drops the region; before the marker
        it is only shown."""
        if event.event_id in self._clears:
            return False
        self._clears[event.event_id] = None
        self.stats["applied" if self.live else "replayed"] += 1
        shown = dataclasses.replace(event, key=None, new_value=None, replayed=not self.live)
        if self.live:
            cache.clear()
        self._call(event.region, "after_region_destroy", shown)
        if self.live and self.on_region_destroyed is not None:
            self.on_region_destroyed(event.region)
        return True

    # --- applying -------------------------------------------------------------------------

    def _apply(self, cache: RegionCache, event: ClientEvent) -> str | None:
        op = event.operation
        if op is Operation.REGION_CLEAR:
            cache.clear()
            return "after_region_clear"
        if op is Operation.REGION_DESTROY:
            cache.clear()
            return "after_region_destroy"
        assert event.key is not None
        if op in DESTROYS:
            cache.destroy(event.key)
            return "after_destroy"
        if event.delivery is Delivery.INVALIDATES or op in (Operation.INVALIDATE, Operation.EXPIRE_INVALIDATE):
            return "after_invalidate" if cache.invalidate(event.key) else None
        held = cache.contains_key(event.key)
        cache.put(event.key, event.new_value)
        return "after_update" if held else "after_create"

    @staticmethod
    def _callback_for(event: ClientEvent, held: bool) -> str:
        op = event.operation
        if op is Operation.REGION_CLEAR:
            return "after_region_clear"
        if op is Operation.REGION_DESTROY:
            return "after_region_destroy"
        if op in DESTROYS:
            return "after_destroy"
        if event.delivery is Delivery.INVALIDATES or op in (Operation.INVALIDATE, Operation.EXPIRE_INVALIDATE):
            return "after_invalidate"
        return "after_update" if held else "after_create"

    def _call(self, region: str, name: str, arg: Any) -> None:
        for listener in self.listeners.get(region, ()):
            method = getattr(listener, name, None)
            if method is None:
                continue
            try:
                method(arg)
            except Exception:
                log.exception("listener %s.%s raised on %s", type(listener).__name__, name, arg)


__all__ = ["ClientEvent", "MessageProcessor", "event_of_message", "read_event"]
