"""The rules every event passes before a region applies it (sluice.core.eventchecks), and JSON values
without NaN or Infinity (sluice.core.jsonvalue)."""

from __future__ import annotations

import pytest

from sluice.core import jsonvalue
from sluice.core.config import parse_config
from sluice.core.errors import EntryTooLarge, UnknownRegion
from sluice.core.eventchecks import ID_MAX, event_id_problem, key_problem, remote_problem, value_problem
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag

NOW_MS = 1_700_000_000_000

CFG = parse_config({
    "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "regions": [{"name": "orders", "buckets": 8, "key_max_bytes": 16, "value_max_bytes": 64}],
    "region_service": {"max_clock_skew_ms": 60_000},
})


def remote(**changes: object) -> EntryEvent:
    fields: dict[str, object] = dict(
        region="orders", key="k", operation=Operation.UPDATE, value=b'{"n":1}', event_id=EventID("m", 1, 2),
        version=VersionTag(2, NOW_MS, 3, "m2"), origin_dsid=2, bucket=0, event_time=NOW_MS, visited_dsids=(2,))
    fields.update(changes)
    return EntryEvent(**fields)  # type: ignore[arg-type]


def test_event_id_bounds_keep_sequences_far_from_avros_largest_long() -> None:
    """Member ids of 1..200 characters, thread and sequence ids in 0..2^53-1; a put_all's last sequence too."""
    assert event_id_problem(EventID("m", 0, ID_MAX)) is None
    for eid, field in ((EventID("", 0, 0), "event_id.member_id"), (EventID("m" * 201, 0, 0), "event_id.member_id"),
                       (EventID("m", -1, 0), "event_id.thread_id"), (EventID("m", 0, 2**63 - 1), "event_id.sequence_id"),
                       (EventID("m", 0, ID_MAX + 1), "event_id.sequence_id"), (EventID("\ud800", 0, 0),
                                                                               "event_id.member_id")):
        problem = event_id_problem(eid)
        assert problem is not None and problem.field == field, eid
    assert event_id_problem(EventID("m", 0, ID_MAX - 2), count=3) is None
    problem = event_id_problem(EventID("m", 0, ID_MAX - 1), count=3)
    assert problem is not None and problem.field == "event_id.sequence_id" and str(ID_MAX + 1) in problem.reason


def test_keys_must_be_known_region_non_empty_unicode_within_the_limit() -> None:
    """An unknown region, an empty or non-string key, a lone surrogate and an oversized key are refused."""
    assert key_problem(CFG, "orders", "fine") is None
    assert isinstance(key_problem(CFG, "nope", "k"), UnknownRegion)
    assert key_problem(CFG, "orders", "").field == "key"  # type: ignore[union-attr]
    assert key_problem(CFG, "orders", 5).field == "key"  # type: ignore[union-attr]
    assert "surrogate" in key_problem(CFG, "orders", "a\ud800").reason  # type: ignore[union-attr]
    assert isinstance(key_problem(CFG, "orders", "k" * 17), EntryTooLarge)


@pytest.mark.parametrize("value", [b"NaN", b"[1, Infinity]", b'{"a": -Infinity}', b"1e999", b"[12345678901234567890123, NaN]",
                                   b"[12345678901234567890123, 1e999]", b"not json", b"\xff"])
def test_values_that_are_not_json_are_refused(value: bytes) -> None:
    """NaN, Infinity, numbers beyond a double and non-JSON bytes, whichever parser reads them."""
    problem = value_problem(CFG, "orders", value, "json", "value")
    assert problem is not None and problem.field == "value"


def test_values_must_fit_and_be_json() -> None:
    """A value within value_max_bytes in JSON passes; too large, another encoding, or no region does not."""
    assert value_problem(CFG, "orders", b'{"n": 12345678901234567890123}', "json") is None
    assert value_problem(CFG, "orders", None, "json") is None
    assert isinstance(value_problem(CFG, "orders", b"1" * 65, "json"), EntryTooLarge)
    assert value_problem(CFG, "orders", b"1", "raw").field == "value_encoding"  # type: ignore[union-attr]
    assert isinstance(value_problem(CFG, "nope", b"1", "json"), UnknownRegion)


def test_remote_events_from_the_future_or_with_impossible_dsids_are_refused() -> None:
    """A timestamp beyond now + max_clock_skew_ms would win every conflict; dsids out of 1..255, this
    site's own events and operations that do not cross sites are refused, each naming its field."""
    assert remote_problem(CFG, remote(), NOW_MS) is None
    assert remote_problem(CFG, remote(version=VersionTag(2, NOW_MS + 60_000, 1)), NOW_MS) is None
    cases = [
        (remote(version=VersionTag(2, 4_102_444_800_000, 1)), "event.version.timestamp"),
        (remote(origin_dsid=0), "event.origin_dsid"),
        (remote(version=VersionTag(256, NOW_MS, 1)), "event.version.dsid"),
        (remote(origin_dsid=1), "event.origin_dsid"),
        (remote(visited_dsids=(2, 300)), "event.visited_dsids[1]"),
        (remote(operation=Operation.INVALIDATE), "event.operation"),
        (remote(event_id=EventID("m", 1, 2**63 - 1)), "event.event_id.sequence_id"),
        (remote(value=b"[NaN]"), "event.value"),
        (remote(key=""), "event.key"),
        (remote(version=VersionTag(2, NOW_MS, -1)), "event.version"),
    ]
    for event, field in cases:
        problem = remote_problem(CFG, event, NOW_MS)
        assert problem is not None and problem.field == field, (field, problem)


def test_json_values_never_turn_nan_into_null() -> None:
    """orjson writes NaN as null: dumps refuses it instead, anywhere in the value; null itself stays."""
    for value in (float("nan"), [1, float("inf")], {"a": {"b": float("-inf")}}, [2**70, float("nan")]):
        with pytest.raises(ValueError):
            jsonvalue.dumps(value)
    assert jsonvalue.dumps({"a": None, "b": [1.5, None]}) == b'{"a":null,"b":[1.5,null]}'
    assert jsonvalue.loads(jsonvalue.dumps([2**70])) == [2**70]
