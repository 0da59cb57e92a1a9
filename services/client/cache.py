"""A client's local cache of one region, and its tracking of repeated events.

Entries are valid (a value) or invalid (a key without a value); a destroyed
entry is simply absent.

Register interest follows Geode, in three steps:

1. ``begin_registration`` silently destroys the local entries the new
   interest covers (the listed keys; the keys a regex matches; every entry
   for ALL_KEYS)
   and starts noting which keys application operations and events touch;
2. the interest is recorded (``sluice.core.interest.RegionInterest``);
3. ``finish_load`` applies the initial load (per result policy) without
   events, and application operations win over it: a key made valid since
   step 1 keeps its value, a key invalidated takes the loaded value, a key
   destroyed is not revived.

``EventTracker`` recognises repeats (after a failover the new primary
resends from the last acknowledged position): an event whose sequence is at
or below the highest seen for its (member, thread) on the same key is a
repeat.  Per key, not per (member, thread) alone as in Geode: a client's
queue is filled from every bucket of the region, so one writer thread's
events for different keys may reach it out of sequence order, while each
key's events arrive in order.  Tracking idle longer than
``subscription-message-tracking-timeout`` is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.events import EventID
from ..core.interest import ResultPolicy

_VALID, _INVALID, _DESTROYED = "valid", "invalid", "destroyed"


@dataclass(slots=True)
class CachedEntry:
    value: Any
    valid: bool = True


class RegionCache:
    """The entries a client holds for one region."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.entries: dict[str, CachedEntry] = {}
        self._loads = 0  # registrations between begin_registration and finish_load
        self._touched: dict[str, str] = {}

    # --- reads --------------------------------------------------------------------------

    def get(self, key: str) -> Any:
        """The value of a valid entry; None for an invalid or absent one."""
        entry = self.entries.get(key)
        return entry.value if entry is not None and entry.valid else None

    def contains_key(self, key: str) -> bool:
        return key in self.entries

    def contains_value_for_key(self, key: str) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.valid

    def __len__(self) -> int:
        return len(self.entries)

    # --- changes (application operations and events alike) ------------------------------

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = CachedEntry(value)
        self._touch(key, _VALID)

    def invalidate(self, key: str) -> bool:
        """Invalidate an entry held here; False when there is none."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        entry.value, entry.valid = None, False
        self._touch(key, _INVALID)
        return True

    def destroy(self, key: str) -> bool:
        existed = self.entries.pop(key, None) is not None
        self._touch(key, _DESTROYED)
        return existed

    def clear(self) -> None:
        for key in list(self.entries):
            self.destroy(key)

    def _touch(self, key: str, state: str) -> None:
        if self._loads:
            self._touched[key] = state

    # --- register interest ----------------------------------------------------------------

    def begin_registration(self, keys: Iterable[str] | Callable[[str], bool] | None) -> None:
        """Step 1: silently destroy the entries the interest covers: the listed keys, the keys a
        predicate (a regex's match) accepts, or (``None``, ALL_KEYS) all of them."""
        if keys is None:
            self.entries.clear()
        elif callable(keys):
            for key in [k for k in self.entries if keys(k)]:
                del self.entries[key]
        else:
            for key in keys:
                self.entries.pop(key, None)
        self._loads += 1

    def finish_load(self, loaded: Mapping[str, Any], policy: ResultPolicy,
                    invalid: frozenset[str] | set[str] = frozenset()) -> int:
        """Step 3: the initial load, losing to what happened since step 1; how many entries it set.

        ``invalid`` names loaded keys that are invalid in the region (no value).
        """
        applied = 0
        try:
            if policy is ResultPolicy.NONE:
                return 0
            for key, value in loaded.items():
                touched = self._touched.get(key)
                if touched in (_VALID, _DESTROYED):
                    continue
                with_value = policy is ResultPolicy.KEYS_VALUES and key not in invalid
                self.entries[key] = CachedEntry(value if with_value else None, valid=with_value)
                applied += 1
            return applied
        finally:
            self._loads -= 1
            if not self._loads:
                self._touched.clear()

    def drop_where(self, covered: Callable[[str], bool]) -> int:
        """Forget the entries a predicate covers (interest unregistered); how many."""
        gone = [k for k in self.entries if covered(k)]
        for key in gone:
            del self.entries[key]
        return len(gone)


class EventTracker:
    """The highest sequence seen per (member, thread, key), with idle expiry."""

    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self._seen: dict[tuple[str, int, str], list[int]] = {}  # -> [highest sequence, last seen ms]
        self.repeats = 0

    def is_repeat(self, event_id: EventID, key: str, now_ms: int) -> bool:
        """True (and counted) when the event was seen before; else it is noted as seen."""
        slot = self._seen.get((event_id.member_id, event_id.thread_id, key))
        if slot is not None:
            slot[1] = now_ms
            if event_id.sequence_id <= slot[0]:
                self.repeats += 1
                return True
            slot[0] = event_id.sequence_id
            return False
        self._seen[(event_id.member_id, event_id.thread_id, key)] = [event_id.sequence_id, now_ms]
        return False

    def expire(self, now_ms: int) -> int:
        """Forget tracking idle longer than the timeout; how many entries."""
        cutoff = now_ms - self.timeout_ms
        stale = [k for k, (_, seen) in self._seen.items() if seen < cutoff]
        for k in stale:
            del self._seen[k]
        return len(stale)

    def __len__(self) -> int:
        return len(self._seen)


__all__ = ["CachedEntry", "EventTracker", "RegionCache"]
