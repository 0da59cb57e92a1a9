"""A put_all's operations are built in one pass over its entries, with the checks of a single write.

``RegionService.put_all_operations`` reads the region's limits once per request and checks each key and
value inline; whatever it refuses it hands to ``check_key`` and ``encode_value``, the checks of a single
write.  Its answer must be what building the operations one entry at a time through those checks gives
(the reference here): the same operations (value bytes, EventIDs, buckets), or the same error naming
the same entry.  An op simply applied is answered with the shared ``APPLIED`` outcome when the caller
lists only the others.  No broker is needed.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sluice.core.config import SiteConfig, parse_config
from sluice.core.errors import SluiceError
from sluice.core.events import EntryEvent, EventID
from sluice.core.events import Operation as EventOperation
from sluice.core.events import VersionTag
from sluice.core.kafka import partition_for_key
from sluice.region.engine import Operation, OpResult
from sluice.region.service import APPLIED, RegionService
from sluice.region.state import Op

PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
KEY_MAX, VALUE_MAX, BUCKETS = 12, 40, 7


def site() -> SiteConfig:
    return parse_config({
        "site": "a", "dsid": 1,
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a."},
        "regions": [{"name": "orders", "buckets": BUCKETS, "key_max_bytes": KEY_MAX, "value_max_bytes": VALUE_MAX}],
    })


SERVICE = RegionService(site())


def reference(entries: dict[str, Any], first: EventID | None, cb: str | None, tx: str | None) -> list[Operation]:
    """One entry at a time through the single write's checks (the put_all handler before the one pass)."""
    ops = []
    for i, (key, value) in enumerate(entries.items()):
        SERVICE.check_key("orders", key, f"entries.{key}")
        data = SERVICE.encode_value("orders", value, f"entries.{key}")
        ops.append(Operation(Op.PUT_ALL, "orders", key, data,
                             EventID(first.member_id, first.thread_id, first.sequence_id + i) if first else None,
                             cb, partition_for_key(key.encode("utf-8"), BUCKETS), transaction=tx))
    return ops


def answer(build: Any) -> Any:
    try:
        return build()
    except SluiceError as exc:
        return (type(exc).__name__, exc.to_dict())


keys = st.one_of(st.text(max_size=14), st.sampled_from(["", "\ud800", "k\udfff", "ä" * 7, "x" * 13]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
              st.sampled_from([math.nan, math.inf, "\ud800", 2**70])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
event_ids = st.one_of(st.none(), st.builds(EventID, st.text(min_size=1, max_size=6), st.integers(0, 2**40),
                                           st.integers(0, 2**40)))


@PROPERTY
@given(entries=st.dictionaries(keys, json_values, max_size=6), first=event_ids,
       cb=st.one_of(st.none(), st.text(max_size=5)), tx=st.one_of(st.none(), st.text(max_size=5)))
@example(entries={"a": 1, "": 2}, first=None, cb=None, tx=None)
@example(entries={"a": None}, first=None, cb=None, tx=None)
@example(entries={"a": "x" * 60}, first=None, cb=None, tx=None)
@example(entries={"b": "x" * (VALUE_MAX - 2), "a": "x" * (VALUE_MAX - 1)}, first=None, cb=None, tx=None)
@example(entries={"\ud800": 1}, first=None, cb=None, tx=None)
@example(entries={"a": math.nan}, first=None, cb=None, tx=None)
@example(entries={"a": [None, math.inf]}, first=None, cb=None, tx=None)
def test_put_all_operations_are_what_the_single_write_checks_build(entries: dict[str, Any], first: EventID | None,
                                                                    cb: str | None, tx: str | None) -> None:
    """Same operations, or the same error (class, field, value, reason) for the same first refused entry."""
    fast = answer(lambda: SERVICE.put_all_operations("orders", entries, first, cb, tx))
    assert fast == answer(lambda: reference(entries, first, cb, tx))


def test_an_unknown_region_is_refused_before_any_entry() -> None:
    with pytest.raises(SluiceError) as refused:
        SERVICE.put_all_operations("nowhere", {"": None}, None, None, None)
    assert type(refused.value).__name__ == "UnknownRegion"


class Applying:
    """Stands in for the engine: owns every bucket and answers each op with ``results``."""

    def __init__(self, results: list[OpResult]) -> None:
        self.results = results

    def is_ready(self, region: str, bucket: int) -> bool:
        return True

    def submit(self, ops: list[Operation], on_done: Any) -> None:
        on_done(self.results[:len(ops)])


def test_only_simply_applied_ops_share_the_applied_outcome() -> None:
    """details=False: an applied op is APPLIED; a duplicate, a skip and an error keep outcomes of their own
    (their keys are listed); details=True renders every applied op's own outcome."""
    event = EntryEvent(region="orders", key="a", operation=EventOperation.PUTALL_CREATE, value=b"1",
                       event_id=EventID("m", 1, 1), version=VersionTag(1, 5, 1, "m"), origin_dsid=1, bucket=0,
                       event_time=5)
    results = [OpResult(event=event), OpResult(duplicate=True), OpResult(skipped=True),
               OpResult(error=SluiceError("no"))]
    ops = [Operation(Op.PUT_ALL, "orders", k, b"1", bucket=0) for k in "abcd"]
    SERVICE.engine = Applying(results)  # type: ignore[assignment]
    try:
        outcomes: list[Any] = [None] * 4
        asyncio.run(SERVICE._apply_local(ops, [0, 1, 2, 3], outcomes, details=False))
        assert outcomes[0] is APPLIED
        assert [(o.key, o.status) for o in outcomes[1:]] == [("b", "duplicate"), ("c", "skipped"), ("d", "error")]
        asyncio.run(SERVICE._apply_local(ops, [0, 1, 2, 3], outcomes, details=True))
        assert outcomes[0] is not APPLIED and outcomes[0].to_dict()["version"] == event.version.to_record()
    finally:
        SERVICE.engine = None
