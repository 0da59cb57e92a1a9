"""WAN conflict resolution: Geode's default rule and its pluggable resolver.

An event another site applied meets this site's entry of the same key.  When
the entry was last written by the same distributed system, it is not a
conflict: the newer entry version applies.  Otherwise:

- without a resolver, the later timestamp wins and equal timestamps go to
  the higher dsid (``remote_wins``), so every site picks the same winner
  whatever the order events arrive in;
- with ``gateway_conflict_resolver: "package.module:Class"`` in the site
  file, the class (instantiated once, no arguments) decides::

      class KeepHigherTotal:
          def on_event(self, event: TimestampedEntryEvent, helper: ConflictHelper) -> None:
              if event.new_value["total"] < event.old_value["total"]:
                  helper.disallow_event()            # keep the current entry
              # or helper.change_event_value(merged)  # apply, with this value
              # doing nothing applies the event as it came

  Like Geode's GatewayConflictResolver, it is called only when the dsids
  differ, and must give the same answer whatever the arrival order, or the
  sites diverge.  A resolver that raises leaves the decision to the default
  rule (and the error is logged): an exception must not decide a conflict.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from ..core import jsonvalue
from ..core.asyncevent import import_class
from ..core.errors import ConfigError
from ..core.events import EntryEvent, Operation, VersionTag

log = logging.getLogger("sluice.region.conflicts")


def remote_wins(current: VersionTag, incoming: VersionTag) -> bool:
    """Geode's WAN conflict rule, the same whatever the arrival order.

    An event from the distributed system that wrote the entry last is not a
    conflict: it applies when its entry version is newer.  Otherwise the later
    timestamp wins, and equal timestamps go to the higher dsid.
    """
    if incoming.dsid == current.dsid:
        return incoming.entry_version > current.entry_version
    return (incoming.timestamp, incoming.dsid) > (current.timestamp, current.dsid)


@dataclass(frozen=True, slots=True)
class TimestampedEntryEvent:
    """What a resolver sees (Geode's TimestampedEntryEvent)."""

    region: str
    key: str
    operation: Operation
    new_value: Any  # the incoming value, deserialized (None for a destroy)
    old_value: Any  # the entry's current value (None when destroyed)
    new_timestamp: int
    old_timestamp: int
    new_distributed_system_id: int
    old_distributed_system_id: int
    event: EntryEvent


class ConflictHelper:
    """The resolver's answer (Geode's GatewayConflictHelper)."""

    __slots__ = ("disallowed", "changed", "value")

    def __init__(self) -> None:
        self.disallowed = False
        self.changed = False
        self.value: Any = None

    def disallow_event(self) -> None:
        """Keep the current entry; the event is not applied here."""
        self.disallowed = True

    def change_event_value(self, value: Any) -> None:
        """Apply the event with this value instead (JSON-able; bytes for a raw region)."""
        self.changed = True
        self.value = value


class ConflictResolver(Protocol):
    def on_event(self, event: TimestampedEntryEvent, helper: ConflictHelper) -> None: ...


def load_resolver(path: str | None) -> ConflictResolver | None:
    """The site's resolver instance, or None for the default rule."""
    if path is None:
        return None
    cls = import_class(path, "gateway_conflict_resolver")
    if not callable(getattr(cls, "on_event", None)):
        raise ConfigError([("gateway_conflict_resolver", path, "has no on_event(event, helper) method")])
    return cls()  # type: ignore[no-any-return]


def resolve(resolver: ConflictResolver | None, region: str, current_value: bytes | None, current: VersionTag,
            event: EntryEvent) -> EntryEvent | None:
    """The event to apply (maybe with a changed value), or None when the current entry stays."""
    if resolver is None or event.version.dsid == current.dsid:
        return event if remote_wins(current, event.version) else None
    view = TimestampedEntryEvent(
        region=region, key=event.key, operation=event.operation,
        new_value=jsonvalue.decode(event.value, event.value_encoding),
        old_value=jsonvalue.decode(current_value, event.value_encoding),
        new_timestamp=event.version.timestamp, old_timestamp=current.timestamp,
        new_distributed_system_id=event.version.dsid, old_distributed_system_id=current.dsid, event=event,
    )
    helper = ConflictHelper()
    try:
        resolver.on_event(view, helper)
    except Exception:
        log.exception("conflict resolver raised on %s/%s (%s); the default rule decides", region, event.key,
                      event.event_id)
        return event if remote_wins(current, event.version) else None
    if helper.disallowed:
        return None
    if not helper.changed or event.value is None:
        return event
    try:
        return dataclasses.replace(event, value=jsonvalue.encode(helper.value, event.value_encoding))
    except (TypeError, ValueError) as exc:  # raw value not bytes, or not JSON-able
        log.error("conflict resolver's value for %s/%s: %s; the event is applied unchanged", region, event.key, exc)
        return event


__all__ = ["ConflictHelper", "ConflictResolver", "TimestampedEntryEvent", "load_resolver", "remote_wins", "resolve"]
