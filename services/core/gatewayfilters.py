"""Gateway event filters and the event substitution filter (Geode's
``GatewayEventFilter`` and ``GatewayEventSubstitutionFilter``).

A sender's ``event_filters`` are class paths ("package.module:Class"); each
class is instantiated once per process with no arguments, and may define any
of the three callbacks (a missing one lets everything through)::

    class NoAudit:
        def before_enqueue(self, event: AsyncEvent) -> bool: ...
            # region service, before the event enters this sender's queue;
            # False: it never enters it (other queues still get it).
            # True lets it through; any other answer is logged as a bug and
            # lets it through too (an event is never dropped by mistake)
        def before_transmit(self, event: AsyncEvent) -> bool: ...
            # sender, as the batch is built; False: not sent, removed with its batch
        def after_acknowledgement(self, event: AsyncEvent) -> None: ...
            # sender, once the remote site acknowledged the event's batch

Filters run in the order listed; the first False wins.  The substitution
filter (``event_substitution_filter``) runs at the region service, for the
events that entered the queue::

    class Redact:
        def get_substitute_value(self, event: AsyncEvent) -> Any: ...
            # the value to queue and send instead (JSON-able, or bytes for a
            # raw-encoded region); None keeps the original

The region's own entry keeps the original value: only what this sender
queues and sends changes.  A filter that raises is a bug in the filter; the
event is then let through unchanged (never dropped on an error) and the
error is logged with the filter's name.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from . import jsonvalue
from .asyncevent import AsyncEvent, import_class
from .config import GatewaySenderConfig
from .errors import ConfigError
from .events import EntryEvent

log = logging.getLogger("sluice.gatewayfilters")

CALLBACKS = ("before_enqueue", "before_transmit", "after_acknowledgement")


def _load(path: str, field: str, wanted: tuple[str, ...]) -> Any:
    cls = import_class(path, field)
    if not any(callable(getattr(cls, name, None)) for name in wanted):
        raise ConfigError([(field, path, f"defines none of {', '.join(wanted)}")])
    return cls()


class SenderFilters:
    """The filters of one gateway sender, loaded once."""

    def __init__(self, sender: GatewaySenderConfig) -> None:
        self.sender_id = sender.id
        self.filters = [_load(p, f"gateway_senders[{sender.id}].event_filters", CALLBACKS)
                        for p in sender.event_filters]
        self.substitution = None
        if sender.event_substitution_filter is not None:
            self.substitution = _load(sender.event_substitution_filter,
                                      f"gateway_senders[{sender.id}].event_substitution_filter",
                                      ("get_substitute_value",))
        self._enqueue = [f.before_enqueue for f in self.filters if callable(getattr(f, "before_enqueue", None))]
        self._transmit = [f.before_transmit for f in self.filters if callable(getattr(f, "before_transmit", None))]
        self._acked = [f.after_acknowledgement for f in self.filters
                       if callable(getattr(f, "after_acknowledgement", None))]

    @property
    def at_enqueue(self) -> bool:
        """Whether the region service has anything to call for this sender."""
        return bool(self._enqueue) or self.substitution is not None

    @property
    def at_transmit(self) -> bool:
        return bool(self._transmit)

    @property
    def after_ack(self) -> bool:
        return bool(self._acked)

    # --- region service ---------------------------------------------------------------------

    def on_enqueue(self, event: EntryEvent, partition: int) -> EntryEvent | None:
        """The event this sender's queue gets (substituted), or None when a filter keeps it out."""
        view = AsyncEvent(event, self.sender_id, partition, -1, event.possible_duplicate)
        if not _all_pass(self._enqueue, view, "before_enqueue"):
            return None
        if self.substitution is None or event.value is None:
            return event
        try:
            substitute = self.substitution.get_substitute_value(view)
        except Exception:  # a user's filter: its bug must not lose the event
            log.exception("substitution filter of sender %s raised on %s; the original value is sent",
                          self.sender_id, event.event_id)
            return event
        if substitute is None:
            return event
        try:
            return dataclasses.replace(event, value=jsonvalue.encode(substitute, event.value_encoding))
        except (TypeError, ValueError) as exc:  # raw value not bytes, or not JSON-able
            log.error("substitution filter of sender %s: %s; the original is sent", self.sender_id, exc)
            return event

    # --- sender -----------------------------------------------------------------------------

    def transmits(self, event: AsyncEvent) -> bool:
        return _all_pass(self._transmit, event, "before_transmit")

    def acknowledged(self, events: list[AsyncEvent]) -> None:
        for event in events:
            for callback in self._acked:
                try:
                    callback(event)
                except Exception:
                    log.exception("after_acknowledgement of sender %s raised on %s", self.sender_id, event.event_id)


def _all_pass(callbacks: list[Callable[[AsyncEvent], Any]], event: AsyncEvent, name: str) -> bool:
    for callback in callbacks:
        try:
            answer = callback(event)
        except Exception:
            log.exception("%s filter %s raised on %s; the event is let through", name,
                          getattr(callback, "__qualname__", callback), event.event_id)
            continue
        if answer is False:
            return False
        if answer is not True:
            log.error("%s filter %s returned %r, not True or False; the event is let through", name,
                      getattr(callback, "__qualname__", callback), answer)
    return True


__all__ = ["SenderFilters"]
