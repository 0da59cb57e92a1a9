"""The event model: which operations reach which queues, EventID streams, duplicates.

Routing follows Geode (``AbstractGatewaySender.checkForDistribution``; GEODE-FACTS
"Loops and topologies"): only entry create, put and distributed destroy cross sites;
async event queues see the same, plus expiration destroys when the queue sets
``forward-expiration-destroy``; invalidates, local operations and region operations
reach neither.
"""

from __future__ import annotations

import dataclasses

import pytest

from sluice.core.events import (
    EntryEvent,
    EventID,
    Operation,
    VersionTag,
    goes_to_async_queue,
    goes_to_gateway,
)

# operation: (gateway sender, async event queue, async event queue with forward-expiration-destroy)
ROUTING = {
    Operation.CREATE: (True, True, True),
    Operation.UPDATE: (True, True, True),
    Operation.DESTROY: (True, True, True),
    Operation.PUTALL_CREATE: (True, True, True),
    Operation.PUTALL_UPDATE: (True, True, True),
    Operation.REMOVEALL_DESTROY: (True, True, True),
    Operation.INVALIDATE: (False, False, False),
    Operation.EXPIRE_DESTROY: (False, False, True),
    Operation.EXPIRE_INVALIDATE: (False, False, False),
    Operation.LOCAL_DESTROY: (False, False, False),
    Operation.REGION_CLEAR: (False, False, False),
    Operation.REGION_DESTROY: (False, False, False),
    Operation.UNKNOWN: (False, False, False),
}

# operation: (is_create, is_update, is_destroy, removes_value)
KINDS = {
    Operation.CREATE: (True, False, False, False),
    Operation.UPDATE: (False, True, False, False),
    Operation.DESTROY: (False, False, True, True),
    Operation.PUTALL_CREATE: (True, False, False, False),
    Operation.PUTALL_UPDATE: (False, True, False, False),
    Operation.REMOVEALL_DESTROY: (False, False, True, True),
    Operation.INVALIDATE: (False, False, False, True),
    Operation.EXPIRE_DESTROY: (False, False, True, True),
    Operation.EXPIRE_INVALIDATE: (False, False, False, True),
    Operation.LOCAL_DESTROY: (False, False, True, True),
    Operation.REGION_CLEAR: (False, False, False, False),
    Operation.REGION_DESTROY: (False, False, False, False),
    Operation.UNKNOWN: (False, False, False, False),
}


def test_routing_table_covers_every_operation() -> None:
    """The tables below name every Operation, so a new one cannot slip through unrouted."""
    assert set(ROUTING) == set(Operation) == set(KINDS)


@pytest.mark.parametrize(("op", "expected"), ROUTING.items(), ids=[op.value for op in ROUTING])
def test_operation_reaches_the_queues_geode_sends_it_to(op: Operation, expected: tuple[bool, bool, bool]) -> None:
    """Each operation goes to gateway senders and async event queues exactly as in Geode."""
    to_gateway, to_queue, to_queue_forwarding_expiration = expected
    assert goes_to_gateway(op) is to_gateway
    assert goes_to_async_queue(op) is to_queue
    assert goes_to_async_queue(op, forward_expiration_destroy=False) is to_queue
    assert goes_to_async_queue(op, forward_expiration_destroy=True) is to_queue_forwarding_expiration


def test_forward_expiration_destroy_never_reaches_gateways() -> None:
    """forward-expiration-destroy is an async-event-queue setting: an expiration destroy never crosses sites."""
    assert goes_to_async_queue(Operation.EXPIRE_DESTROY, forward_expiration_destroy=True)
    assert not goes_to_gateway(Operation.EXPIRE_DESTROY)
    assert not goes_to_async_queue(Operation.EXPIRE_INVALIDATE, forward_expiration_destroy=True)


@pytest.mark.parametrize(("op", "expected"), KINDS.items(), ids=[op.value for op in KINDS])
def test_operation_kind_flags(op: Operation, expected: tuple[bool, bool, bool, bool]) -> None:
    """is_create / is_update / is_destroy / removes_value classify each operation as Geode's Operation does."""
    assert (op.is_create, op.is_update, op.is_destroy, op.removes_value) == expected


def test_event_ids_of_one_stream_order_by_sequence() -> None:
    """Within one (member, thread) stream, EventIDs sort by sequence_id, numerically."""
    ids = [EventID("m-1", 7, seq) for seq in (10, 2, 9, 100, 1)]
    assert [e.sequence_id for e in sorted(ids)] == [1, 2, 9, 10, 100]
    assert EventID("m-1", 7, 2) < EventID("m-1", 7, 10)
    assert max(ids) == EventID("m-1", 7, 100)


def test_event_id_stream_is_member_and_thread() -> None:
    """stream is (member_id, thread_id): same stream across sequences, different across threads or members."""
    a1, a2 = EventID("m-1", 7, 1), EventID("m-1", 7, 2)
    assert a1.stream == a2.stream == ("m-1", 7)
    assert EventID("m-1", 8, 1).stream != a1.stream
    assert EventID("m-2", 7, 1).stream != a1.stream


def test_event_id_is_a_frozen_hashable_value() -> None:
    """EventIDs compare and hash by value (dedup keys) and cannot be mutated."""
    a, b = EventID("m-1", 7, 3), EventID("m-1", 7, 3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sequence_id = 4  # type: ignore[misc]


def test_event_id_record_round_trip_and_text_form() -> None:
    """to_record/from_record is lossless and str() is member/thread/sequence."""
    eid = EventID("client-9", -1, 2**63 - 1)
    assert EventID.from_record(eid.to_record()) == eid
    assert eid.to_record() == {"member_id": "client-9", "thread_id": -1, "sequence_id": 2**63 - 1}
    assert str(EventID("m-1", 7, 42)) == "m-1/7/42"


def _event(**changes: object) -> EntryEvent:
    base = EntryEvent(
        region="orders",
        key="k1",
        operation=Operation.UPDATE,
        value=b'{"qty": 2}',
        event_id=EventID("m-1", 7, 42),
        version=VersionTag(dsid=1, timestamp=1_700_000_000_000, entry_version=3, member_id="m-1"),
        origin_dsid=1,
        bucket=5,
        event_time=1_700_000_000_000,
        callback_argument="cb",
        visited_dsids=(1, 2),
    )
    return dataclasses.replace(base, **changes)


def test_as_possible_duplicate_sets_only_the_flag() -> None:
    """as_possible_duplicate returns a copy marked possible_duplicate, every other field (EventID too) unchanged."""
    event = _event()
    assert event.possible_duplicate is False
    duplicate = event.as_possible_duplicate()
    assert duplicate.possible_duplicate is True
    assert duplicate is not event
    assert dataclasses.replace(duplicate, possible_duplicate=False) == event
    assert duplicate.event_id == event.event_id and duplicate.version == event.version


def test_as_possible_duplicate_leaves_the_original_and_is_idempotent() -> None:
    """The original event is not touched, and marking twice is the same as marking once."""
    event = _event()
    once = event.as_possible_duplicate()
    assert event.possible_duplicate is False
    assert once.as_possible_duplicate() == once
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.possible_duplicate = True  # type: ignore[misc]


def test_entry_event_record_round_trip_keeps_possible_duplicate() -> None:
    """to_record/from_record carries possible_duplicate and the visited sites (tuple <-> list)."""
    duplicate = _event().as_possible_duplicate()
    record = duplicate.to_record()
    assert record["possible_duplicate"] is True
    assert record["operation"] == "UPDATE" and record["visited_dsids"] == [1, 2]
    assert EntryEvent.from_record(record) == duplicate
