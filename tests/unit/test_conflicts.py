"""WAN conflict resolution: Geode's rule, and a pluggable resolver's keep / override / merge."""

from __future__ import annotations

from typing import Any

from sluice.core import jsonvalue
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.region.conflicts import ConflictHelper, TimestampedEntryEvent, remote_wins, resolve


def _event(value: Any, dsid: int, ts: int, version: int = 1) -> EntryEvent:
    return EntryEvent(region="orders", key="k", operation=Operation.UPDATE, value=jsonvalue.dumps(value),
                      value_encoding="json", callback_argument=None, possible_duplicate=False,
                      event_id=EventID(f"m{dsid}", 1, ts), version=VersionTag(dsid, ts, version),
                      origin_dsid=dsid, visited_dsids=(), bucket=0, event_time=ts)


class Recorder:
    def __init__(self, answer: str, value: Any = None) -> None:
        self.answer, self.value, self.seen = answer, value, []

    def on_event(self, event: TimestampedEntryEvent, helper: ConflictHelper) -> None:
        self.seen.append(event)
        if self.answer == "disallow":
            helper.disallow_event()
        elif self.answer == "change":
            helper.change_event_value(self.value)
        elif self.answer == "raise":
            raise RuntimeError("resolver bug")


def test_default_rule_picks_the_same_winner_in_either_order() -> None:
    """Later timestamp wins; equal timestamps go to the higher dsid; same dsid: newer entry version."""
    a, b = VersionTag(1, 100, 3), VersionTag(2, 100, 1)
    assert remote_wins(a, b) and not remote_wins(b, a)
    assert remote_wins(VersionTag(2, 100, 1), VersionTag(1, 101, 1))
    assert remote_wins(VersionTag(1, 200, 1), VersionTag(1, 100, 2)), "same dsid: the entry version decides"


def test_without_a_resolver_the_default_rule_decides() -> None:
    current = _event({"n": 1}, dsid=2, ts=200)
    assert resolve(None, "orders", current.value, current.version, _event({"n": 9}, dsid=1, ts=100)) is None
    late = _event({"n": 0}, dsid=1, ts=300)
    assert resolve(None, "orders", current.value, current.version, late) is late


def test_a_resolver_keeps_overrides_or_merges_and_sees_both_sides() -> None:
    current = _event({"n": 5}, dsid=2, ts=200)
    incoming = _event({"n": 3}, dsid=1, ts=300)
    keep = Recorder("disallow")
    assert resolve(keep, "orders", current.value, current.version, incoming) is None
    seen = keep.seen[0]
    assert (seen.new_value, seen.old_value) == ({"n": 3}, {"n": 5})
    assert (seen.new_distributed_system_id, seen.old_distributed_system_id, seen.new_timestamp) == (1, 2, 300)
    merged = resolve(Recorder("change", {"n": 8}), "orders", current.value, current.version, incoming)
    assert merged is not None and jsonvalue.loads(merged.value) == {"n": 8}
    assert merged.version == incoming.version and merged.event_id == incoming.event_id
    early = _event({"n": 1}, dsid=1, ts=100)
    assert resolve(Recorder("apply"), "orders", current.value, current.version, early) is early, \
        "a resolver that lets the event through overrides the timestamp rule"


def test_a_resolver_is_not_asked_about_the_same_dsid_and_its_errors_fall_back_to_the_rule() -> None:
    current = _event({"n": 5}, dsid=1, ts=200, version=1)
    asked = Recorder("disallow")
    newer = _event({"n": 6}, dsid=1, ts=100, version=2)
    assert resolve(asked, "orders", current.value, current.version, newer) is newer and asked.seen == []
    broken = Recorder("raise")
    late = _event({"n": 7}, dsid=2, ts=300)
    assert resolve(broken, "orders", current.value, current.version, late) is late
    assert resolve(broken, "orders", current.value, current.version, _event({"n": 7}, dsid=2, ts=50)) is None
