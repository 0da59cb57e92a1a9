"""Client-side semantics of subscriptions: interest matching, register-interest load rules, repeat tracking."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.client.cache import EventTracker, RegionCache
from sluice.core.interest import ALL_KEYS, Delivery, RegionInterest, Registration, ResultPolicy
from sluice.client.messages import ClientEvent, MessageProcessor
from sluice.core.errors import InvalidRequest
from sluice.core.events import EventID, Operation


def test_interest_is_the_union_of_registrations_and_values_win_over_invalidates() -> None:
    """Keys, key lists and whole-key regexes add up; a key matched both ways gets values."""
    interest = RegionInterest()
    interest.register(Registration.of_keys("k1"))
    interest.register(Registration.of_keys(["k2", "k3"], receive_values=False))
    interest.register(Registration.of_regex(r"order-\d+", receive_values=False))
    interest.register(Registration.of_keys("order-7"))
    assert interest.delivery("k1") is Delivery.VALUES
    assert interest.delivery("k2") is Delivery.INVALIDATES
    assert interest.delivery("order-12") is Delivery.INVALIDATES
    assert interest.delivery("order-7") is Delivery.VALUES
    assert interest.delivery("xorder-12") is None and interest.delivery("order-12x") is None, "regex is whole-key"
    assert interest.delivery("never-written-yet") is None


def test_unregister_removes_what_was_registered_and_all_keys_covers_everything() -> None:
    interest = RegionInterest()
    interest.register(Registration.of_keys(["a", "b"]))
    interest.register(Registration.of_regex("z.*"))
    interest.unregister(Registration.of_keys("a"))
    interest.unregister(Registration.of_regex("z.*"))
    assert interest.delivery("a") is None and interest.delivery("b") is Delivery.VALUES
    assert interest.delivery("zed") is None
    interest.register(Registration.of_keys(ALL_KEYS))
    assert interest.delivery("anything") is Delivery.VALUES
    interest.unregister(Registration.of_keys(ALL_KEYS))
    assert interest.delivery("anything") is None and interest.delivery("b") is Delivery.VALUES


def test_a_disconnected_durable_client_keeps_only_its_durable_interest() -> None:
    interest = RegionInterest()
    interest.register(Registration.of_keys("kept", durable=True))
    interest.register(Registration.of_keys("dropped"))
    interest.drop_non_durable()
    assert interest.delivery("kept") is Delivery.VALUES and interest.delivery("dropped") is None


def test_bad_registrations_name_what_is_wrong() -> None:
    with pytest.raises(InvalidRequest, match="regex"):
        Registration.of_regex("(unclosed")
    with pytest.raises(InvalidRequest, match="keys"):
        Registration.of_keys([])


def test_registration_destroys_covered_entries_then_the_load_loses_to_application_operations() -> None:
    """A key put during the load keeps its value, an invalidated one takes the loaded value, a destroyed one
    is not revived; untouched keys take the load; entries outside the interest stay."""
    cache = RegionCache("orders")
    for key in ("a", "b", "c", "d", "outside"):
        cache.put(key, f"old-{key}")
    cache.begin_registration(["a", "b", "c", "d"])
    assert not cache.contains_key("a") and cache.get("outside") == "old-outside"
    cache.put("a", "app-a")           # valid since step 1: kept
    cache.put("b", "app-b")
    cache.invalidate("b")             # invalid: takes the loaded value
    cache.put("c", "app-c")
    cache.destroy("c")                # destroyed: not revived
    applied = cache.finish_load({"a": "load-a", "b": "load-b", "c": "load-c", "d": "load-d"},
                                ResultPolicy.KEYS_VALUES)
    assert (cache.get("a"), cache.get("b"), cache.contains_key("c"), cache.get("d")) == \
        ("app-a", "load-b", False, "load-d")
    assert applied == 2 and cache.get("outside") == "old-outside"


def test_result_policies_keys_make_invalid_entries_and_none_loads_nothing() -> None:
    cache = RegionCache("orders")
    cache.begin_registration(None)
    cache.finish_load({"a": 1}, ResultPolicy.KEYS)
    assert cache.contains_key("a") and not cache.contains_value_for_key("a") and cache.get("a") is None
    cache.begin_registration(None)
    assert len(cache) == 0, "ALL_KEYS destroys every local entry first"
    assert cache.finish_load({"a": 1}, ResultPolicy.NONE) == 0 and len(cache) == 0
    cache.put("o-1", 1)
    cache.put("p-1", 1)
    cache.begin_registration(re.compile(r"o-.*").fullmatch)
    assert not cache.contains_key("o-1") and cache.contains_key("p-1"), "a regex destroys the keys it matches"
    cache.finish_load({}, ResultPolicy.NONE)
    cache.put("late", 1)
    cache.begin_registration(["x"])
    cache.destroy("late")
    cache.finish_load({"late": 2}, ResultPolicy.KEYS_VALUES)
    assert not cache.contains_key("late"), "a key destroyed during any load is not revived"


def test_the_tracker_discards_repeats_per_key_even_when_a_threads_keys_interleave() -> None:
    """One thread's events for two keys arrive out of sequence order across keys: none is a repeat;
    the resent ones after a failover are, and are counted."""
    tracker = EventTracker(timeout_ms=900_000)
    stream = [("k2", 6), ("k1", 5), ("k2", 8), ("k1", 7)]
    assert [tracker.is_repeat(EventID("m", 1, s), k, 0) for k, s in stream] == [False] * 4
    assert [tracker.is_repeat(EventID("m", 1, s), k, 10) for k, s in stream] == [True] * 4
    assert tracker.repeats == 4
    assert not tracker.is_repeat(EventID("m", 2, 1), "k1", 10), "another thread is another stream"


def test_tracking_idle_longer_than_the_timeout_is_forgotten() -> None:
    tracker = EventTracker(timeout_ms=1000)
    tracker.is_repeat(EventID("m", 1, 5), "k", now_ms=0)
    tracker.is_repeat(EventID("m", 2, 5), "k", now_ms=900)
    assert tracker.expire(now_ms=1500) == 1 and len(tracker) == 1
    assert not tracker.is_repeat(EventID("m", 1, 5), "k", now_ms=1600), "forgotten, so applied again (Geode too)"


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3)), max_size=40), st.randoms())
def test_replaying_any_suffix_of_a_per_key_ordered_stream_is_all_repeats(events, rng) -> None:
    """Events numbered in order per thread; after any prefix is seen, resending it yields only repeats."""
    stream = [(key, thread, seq) for seq, (key, thread) in enumerate(events)]
    tracker = EventTracker(timeout_ms=10**9)
    for key, thread, seq in stream:
        assert not tracker.is_repeat(EventID("m", thread, seq), key, 0)
    cut = rng.randint(0, len(stream))
    assert all(tracker.is_repeat(EventID("m", t, s), k, 0) for k, t, s in stream[cut:])


# --- the message stream -------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str):
        if not name.startswith("after_"):
            raise AttributeError(name)
        return lambda arg: self.calls.append((name, getattr(arg, "key", arg), getattr(arg, "replayed", None)))


def _event(key: str | None, op: Operation, value: object, seq: int, delivery: Delivery = Delivery.VALUES,
           thread: int = 1) -> ClientEvent:
    return ClientEvent("orders", key, op, value, EventID("writer", thread, seq), delivery)


def test_before_the_marker_events_are_replayed_not_applied_then_applied_after_it() -> None:
    """A durable client's queued events reach its listeners marked replayed and leave the cache alone; at the
    marker after_region_live fires; then the cache follows the stream; repeats are dropped all along."""
    cache, listener = RegionCache("orders"), Recorder()
    proc = MessageProcessor({"orders": cache}, EventTracker(900_000), {"orders": [listener]})
    proc.on_event(_event("a", Operation.CREATE, 1, 1), 0)
    proc.on_event(_event("a", Operation.UPDATE, 2, 2), 0)
    assert len(cache) == 0 and [c[2] for c in listener.calls] == [True, True]
    proc.on_marker()
    assert listener.calls[-1] == ("after_region_live", "orders", None)
    assert not proc.on_event(_event("a", Operation.UPDATE, 2, 2), 0), "a repeat after the marker"
    proc.on_event(_event("a", Operation.UPDATE, 3, 3), 0)
    proc.on_event(_event("b", Operation.UPDATE, 9, 4), 0)
    assert cache.get("a") == 3 and cache.get("b") == 9
    assert listener.calls[-2:] == [("after_create", "a", False), ("after_create", "b", False)], \
        "an update of a key the client does not hold creates it locally"
    proc.on_event(_event("a", Operation.UPDATE, 4, 5, delivery=Delivery.INVALIDATES), 0)
    assert cache.contains_key("a") and cache.get("a") is None
    assert not proc.on_event(_event("zz", Operation.UPDATE, 1, 6, delivery=Delivery.INVALIDATES), 0), \
        "an invalidate of an entry the client does not hold does nothing"
    proc.on_event(_event("b", Operation.DESTROY, None, 7), 0)
    proc.on_event(_event(None, Operation.REGION_CLEAR, None, 8), 0)
    assert len(cache) == 0
    assert [c[0] for c in listener.calls[-3:]] == ["after_invalidate", "after_destroy", "after_region_clear"]
    assert proc.stats == {"applied": 5, "replayed": 2, "repeats": 1, "ignored": 1}


def test_a_listener_that_raises_does_not_stop_the_stream() -> None:
    class Broken:
        def after_create(self, event: ClientEvent) -> None:
            raise RuntimeError("listener bug")

    cache, good = RegionCache("orders"), Recorder()
    proc = MessageProcessor({"orders": cache}, EventTracker(900_000), {"orders": [Broken(), good]})
    proc.on_marker()
    assert proc.on_event(_event("a", Operation.CREATE, 1, 1), 0)
    assert cache.get("a") == 1 and good.calls[-1] == ("after_create", "a", False)


def test_a_region_clear_arrives_bucket_by_bucket_and_is_announced_once() -> None:
    """Each bucket's part empties that bucket's entries only (later writes of other buckets survive);
    listeners hear of the clear once; before the marker it is only shown."""
    buckets = {"a": 0, "b": 1, "c": 1, "d": 0}
    cache, listener = RegionCache("orders"), Recorder()
    proc = MessageProcessor({"orders": cache}, EventTracker(900_000), {"orders": [listener]},
                            bucket_of=lambda _region, key: buckets[key])
    proc.on_event(_event("x", Operation.REGION_CLEAR, None, 1, thread=9), 0)
    assert listener.calls == [("after_region_clear", None, True)], "before the marker: shown, not applied"
    proc.on_marker()
    for i, key in enumerate("abcd"):
        cache.put(key, i)
    clear = EventID("other", 3, 50)
    assert proc.on_event(ClientEvent("orders", "a", Operation.REGION_CLEAR, None, clear, Delivery.VALUES), 0)
    assert sorted(cache.entries) == ["b", "c"], "bucket 0 cleared, bucket 1 not yet"
    proc.on_event(_event("d", Operation.UPDATE, "new", 2), 0)  # written after the clear
    assert not proc.on_event(ClientEvent("orders", "c", Operation.REGION_CLEAR, None, clear, Delivery.VALUES), 0)
    assert sorted(cache.entries) == ["d"] and cache.get("d") == "new"
    assert [c for c in listener.calls if c[0] == "after_region_clear"] == [
        ("after_region_clear", None, True), ("after_region_clear", None, False)], "announced once per clear"


def test_after_a_registration_is_answered_events_before_the_marker_also_update_the_cache() -> None:
    """The backlog before the answer is only replayed; what follows the answer is replayed and applied,
    since the registration's load may predate it."""
    cache, listener = RegionCache("orders"), Recorder()
    proc = MessageProcessor({"orders": cache}, EventTracker(900_000), {"orders": [listener]})
    proc.on_event(_event("a", Operation.UPDATE, "backlog", 1), 0)
    assert not cache.contains_key("a")
    proc.applying = True
    proc.on_event(_event("a", Operation.UPDATE, "after the answer", 2), 0)
    assert cache.get("a") == "after the answer" and not proc.live
    assert [c[2] for c in listener.calls] == [True, True], "both shown as replayed"
