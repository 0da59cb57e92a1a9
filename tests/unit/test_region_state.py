"""The state of one bucket: Geode's preconditions, version tags, duplicate tracking.

``BucketState.prepare`` turns a request into the event to write, following
Geode's ``Region`` contract:

* ``create`` of a key that has an entry (valid or invalid) raises
  ``EntryExistsException``; ``destroy`` and ``invalidate`` of a key with no
  entry raise ``EntryNotFoundException``; ``removeAll`` skips absent keys;
* ``put``/``putAll`` report CREATE or UPDATE from the entry's presence;
* the version tag's ``entry_version`` grows by one per write of the key,
  across destroys (a tombstone keeps it), and its timestamp never goes back;
* an EventID at or below the highest sequence applied for its (member,
  thread) is a retry (Geode's EventTracker): answered ``Duplicate``, not
  applied.  An operation that raised was not applied, so its EventID is not
  tracked and a retry of it is judged afresh.

A new owner rebuilds the bucket with ``replay``; the last tests check that
replaying the prepared events gives back exactly the live state.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.core.errors import EntryExists, EntryNotFound
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.region.state import BucketState, Duplicate, Entry, Op, Skipped

REGION = "orders"
BUCKET = 3
DSID = 7
MEMBER = "site-a-0123456789ab"
T0 = 1_700_000_000_000

PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def new_state() -> BucketState:
    return BucketState(REGION, BUCKET, DSID, MEMBER)


class Client:
    """One (member, thread) issuing operations with increasing sequence ids."""

    def __init__(self, member: str = "client-1", thread: int = 1, first: int = 0) -> None:
        self.member = member
        self.thread = thread
        self.next = first

    def eid(self) -> EventID:
        event_id = EventID(self.member, self.thread, self.next)
        self.next += 1
        return event_id


def apply(state: BucketState, client: Client, op: Op, key: str, value: bytes | None = b'"v"', now_ms: int = T0):
    return state.prepare(op, key, value, client.eid(), now_ms)


def bring(state: BucketState, client: Client, key: str, condition: str) -> None:
    """Put ``key`` in ``condition``: absent, valid, invalid or destroyed (a tombstone)."""
    if condition == "absent":
        return
    apply(state, client, Op.PUT, key, b'"old"')
    if condition == "invalid":
        apply(state, client, Op.INVALIDATE, key, None)
    elif condition == "destroyed":
        apply(state, client, Op.DESTROY, key, None)
    else:
        assert condition == "valid", condition


# (op, condition of the key before) -> the event's Operation, Skipped, or the exception raised.
OUTCOMES: dict[tuple[Op, str], object] = {
    (Op.CREATE, "absent"): Operation.CREATE,
    (Op.CREATE, "valid"): EntryExists,
    (Op.CREATE, "invalid"): EntryExists,
    (Op.CREATE, "destroyed"): Operation.CREATE,
    (Op.PUT, "absent"): Operation.CREATE,
    (Op.PUT, "valid"): Operation.UPDATE,
    (Op.PUT, "invalid"): Operation.UPDATE,
    (Op.PUT, "destroyed"): Operation.CREATE,
    (Op.PUT_ALL, "absent"): Operation.PUTALL_CREATE,
    (Op.PUT_ALL, "valid"): Operation.PUTALL_UPDATE,
    (Op.PUT_ALL, "invalid"): Operation.PUTALL_UPDATE,
    (Op.PUT_ALL, "destroyed"): Operation.PUTALL_CREATE,
    (Op.DESTROY, "absent"): EntryNotFound,
    (Op.DESTROY, "valid"): Operation.DESTROY,
    (Op.DESTROY, "invalid"): Operation.DESTROY,
    (Op.DESTROY, "destroyed"): EntryNotFound,
    (Op.REMOVE_ALL, "absent"): Skipped,
    (Op.REMOVE_ALL, "valid"): Operation.REMOVEALL_DESTROY,
    (Op.REMOVE_ALL, "invalid"): Operation.REMOVEALL_DESTROY,
    (Op.REMOVE_ALL, "destroyed"): Skipped,
    (Op.INVALIDATE, "absent"): EntryNotFound,
    (Op.INVALIDATE, "valid"): Operation.INVALIDATE,
    (Op.INVALIDATE, "invalid"): Operation.INVALIDATE,
    (Op.INVALIDATE, "destroyed"): EntryNotFound,
}

CONDITIONS = ("absent", "valid", "invalid", "destroyed")
#: The operations on one key (``prepare``); the others take an event or a whole bucket.
KEY_OPS = [op for op in Op if op not in (Op.REMOTE, Op.CLEAR, Op.DESTROY_REGION)]
WHOLE_REGION = {Op.CLEAR: Operation.REGION_CLEAR, Op.DESTROY_REGION: Operation.REGION_DESTROY}


def prepare_any(state: BucketState, op: Op, key: str, value: bytes | None, eid: EventID, now_ms: int):
    """``prepare`` for a key's operation; ``prepare_clear`` (a list of events, or Duplicate) for a
    whole-region one."""
    if op in WHOLE_REGION:
        return state.prepare_clear(eid, now_ms, WHOLE_REGION[op])
    return state.prepare(op, key, value, eid, now_ms)


def test_clear_tombstones_every_live_entry_of_the_bucket_once() -> None:
    """Each live entry (valid or invalid) gets a REGION_CLEAR tombstone with the clear's EventID and its
    next version; destroyed entries are left alone; the same EventID again is a Duplicate."""
    state, client = new_state(), Client()
    for key, condition in (("v", "valid"), ("i", "invalid"), ("d", "destroyed")):
        bring(state, client, key, condition)
    eid = client.eid()
    events = state.prepare_clear(eid, T0 + 10)
    assert sorted(e.key for e in events) == ["i", "v"]
    assert {e.operation for e in events} == {Operation.REGION_CLEAR} and {e.event_id for e in events} == {eid}
    assert all(e.value is None for e in events)
    assert {e.key: e.version.entry_version for e in events} == {"v": 2, "i": 3}, "put, (invalidate,) clear"
    assert list(state.keys()) == [] and state.prepare_clear(eid, T0 + 20) == Duplicate(eid)
    assert state.prepare_clear(client.eid(), T0 + 30) == [], "an empty bucket has nothing to clear"
    destroyed = state.prepare_clear(client.eid(), T0 + 40, Operation.REGION_DESTROY)
    assert destroyed == []
    apply(state, client, Op.PUT, "v", b'"back"')
    assert state.get("v").version.entry_version == 3, "a key written after the clear goes on counting"


def test_outcome_table_covers_every_op_and_condition() -> None:
    """The outcome table below has a row for every local Op in every prior condition of the key.

    ``Op.REMOTE`` (an event another site applied) goes through ``prepare_remote``, and the whole-region
    ``Op.CLEAR`` / ``Op.DESTROY_REGION`` through ``prepare_clear``; both are tested further down.
    """
    assert set(OUTCOMES) == {(op, c) for op in KEY_OPS for c in CONDITIONS}


@pytest.mark.parametrize(("op", "condition"), sorted(OUTCOMES, key=lambda k: (k[0].value, k[1])))
def test_prepare_follows_geode_preconditions(op: Op, condition: str) -> None:
    """Each Op on a key in each condition gives Geode's operation, Skipped, or Geode's exception."""
    state, client = new_state(), Client()
    bring(state, client, "k", condition)
    expected = OUTCOMES[(op, condition)]
    before = {k: Entry(e.value, e.version, e.event_id, e.destroyed) for k, e in state.entries.items()}
    if isinstance(expected, type) and issubclass(expected, Exception):
        with pytest.raises(expected) as info:
            apply(state, client, op, "k")
        assert info.value.region == REGION and info.value.key == "k"
        assert state.entries == before
    elif expected is Skipped:
        assert apply(state, client, op, "k") == Skipped("k")
        assert state.entries == before
    else:
        event = apply(state, client, op, "k")
        assert isinstance(event, EntryEvent)
        assert event.operation is expected
        assert (event.region, event.key, event.bucket, event.origin_dsid) == (REGION, "k", BUCKET, DSID)


def test_create_on_absent_key_is_create_version_one() -> None:
    """create() of a key never seen is a CREATE with entry_version 1, stamped with this site and member."""
    state = new_state()
    eid = EventID("client-1", 1, 0)
    event = state.prepare(Op.CREATE, "k", b'"v"', eid, T0, callback_argument="cb")
    assert event == EntryEvent(
        region=REGION,
        key="k",
        operation=Operation.CREATE,
        value=b'"v"',
        event_id=eid,
        version=VersionTag(DSID, T0, 1, MEMBER),
        origin_dsid=DSID,
        bucket=BUCKET,
        event_time=T0,
        callback_argument="cb",
    )
    assert state.get("k") == Entry(b'"v"', VersionTag(DSID, T0, 1, MEMBER), eid)


@pytest.mark.parametrize("condition", ["valid", "invalid"])
def test_create_on_present_entry_raises_entry_exists(condition: str) -> None:
    """create() of a key with an entry, valid or invalid, raises EntryExists and changes nothing."""
    state, client = new_state(), Client()
    bring(state, client, "k", condition)
    entry_before = state.get("k")
    snapshot = (entry_before.value, entry_before.version, entry_before.event_id)
    with pytest.raises(EntryExists):
        apply(state, client, Op.CREATE, "k", b'"new"')
    entry = state.get("k")
    assert (entry.value, entry.version, entry.event_id) == snapshot


def test_create_after_destroy_continues_the_tombstone_version() -> None:
    """create() after destroy() is a CREATE whose entry_version continues from the tombstone's."""
    state, client = new_state(), Client()
    apply(state, client, Op.PUT, "k")  # v1
    apply(state, client, Op.PUT, "k")  # v2
    destroy = apply(state, client, Op.DESTROY, "k", None)  # v3, tombstone
    assert destroy.version.entry_version == 3
    assert state.entries["k"].destroyed and state.entries["k"].version.entry_version == 3
    event = apply(state, client, Op.CREATE, "k", b'"again"')
    assert event.operation is Operation.CREATE
    assert event.version.entry_version == 4
    assert state.get("k").value == b'"again"'


def test_put_on_absent_is_create_and_on_present_is_update() -> None:
    """put() reports CREATE for a new key and UPDATE for an existing one, storing the new value."""
    state, client = new_state(), Client()
    first = apply(state, client, Op.PUT, "k", b"1")
    second = apply(state, client, Op.PUT, "k", b"2")
    assert (first.operation, second.operation) == (Operation.CREATE, Operation.UPDATE)
    assert state.get("k").value == b"2"


def test_put_all_is_putall_create_then_putall_update() -> None:
    """putAll() entries report PUTALL_CREATE for a new key and PUTALL_UPDATE for an existing one."""
    state, client = new_state(), Client()
    first = apply(state, client, Op.PUT_ALL, "k", b"1")
    second = apply(state, client, Op.PUT_ALL, "k", b"2")
    assert (first.operation, second.operation) == (Operation.PUTALL_CREATE, Operation.PUTALL_UPDATE)
    assert state.get("k").value == b"2"


def test_destroy_absent_key_raises_entry_not_found() -> None:
    """destroy() of a key with no entry raises EntryNotFound naming the region and key."""
    state = new_state()
    with pytest.raises(EntryNotFound) as info:
        state.prepare(Op.DESTROY, "nope", None, EventID("c", 1, 0), T0)
    assert (info.value.region, info.value.key) == (REGION, "nope")
    assert state.entries == {} and state.streams == {}


def test_destroy_present_key_removes_it_from_reads() -> None:
    """destroy() is a DESTROY with no value, and the key leaves get(), keys() and size()."""
    state, client = new_state(), Client()
    apply(state, client, Op.PUT, "k", b"1")
    apply(state, client, Op.PUT, "other", b"2")
    event = apply(state, client, Op.DESTROY, "k", b"ignored")
    assert event.operation is Operation.DESTROY
    assert event.value is None
    assert state.get("k") is None
    assert list(state.keys()) == ["other"]
    assert state.size() == 1


def test_remove_all_skips_absent_and_destroys_present() -> None:
    """removeAll() skips an absent key without tracking it, and destroys a present one (REMOVEALL_DESTROY)."""
    state, client = new_state(), Client()
    skipped_eid = client.eid()
    assert state.prepare(Op.REMOVE_ALL, "k", None, skipped_eid, T0) == Skipped("k")
    assert state.entries == {} and state.streams == {}
    apply(state, client, Op.PUT, "k", b"1")
    event = apply(state, client, Op.REMOVE_ALL, "k", None)
    assert event.operation is Operation.REMOVEALL_DESTROY
    assert event.value is None
    assert state.get("k") is None and state.size() == 0 and list(state.keys()) == []


def test_invalidate_absent_key_raises_entry_not_found() -> None:
    """invalidate() of a key with no entry raises EntryNotFound."""
    state = new_state()
    with pytest.raises(EntryNotFound):
        state.prepare(Op.INVALIDATE, "nope", None, EventID("c", 1, 0), T0)
    assert state.entries == {}


def test_invalidate_keeps_the_entry_without_a_value() -> None:
    """invalidate() is an INVALIDATE; the entry stays (get, keys, size) with value None."""
    state, client = new_state(), Client()
    apply(state, client, Op.PUT, "k", b"1")
    event = apply(state, client, Op.INVALIDATE, "k", b"ignored")
    assert event.operation is Operation.INVALIDATE
    assert event.value is None
    entry = state.get("k")
    assert entry is not None and entry.value is None and not entry.destroyed
    assert list(state.keys()) == ["k"] and state.size() == 1


# --- version tags ---------------------------------------------------------------------


def test_entry_version_grows_by_one_per_write_of_the_key() -> None:
    """Every applied write of a key, whatever its kind, adds one to that key's entry_version only."""
    state, client = new_state(), Client()
    ops = [Op.CREATE, Op.PUT, Op.PUT_ALL, Op.INVALIDATE, Op.PUT, Op.DESTROY, Op.PUT_ALL, Op.REMOVE_ALL, Op.CREATE]
    versions = []
    for i, op in enumerate(ops):
        versions.append(apply(state, client, op, "k", now_ms=T0 + i).version.entry_version)
        apply(state, client, Op.PUT, f"noise{i}")  # other keys do not move k's version
    assert versions == list(range(1, len(ops) + 1))


def test_timestamp_never_goes_backwards_for_a_key() -> None:
    """A write stamped with an earlier clock than the key's last write keeps the last timestamp."""
    state, client = new_state(), Client()
    assert apply(state, client, Op.PUT, "k", now_ms=T0).version.timestamp == T0
    behind = apply(state, client, Op.PUT, "k", now_ms=T0 - 5_000)
    assert behind.version.timestamp == T0
    assert behind.event_time == T0 - 5_000  # the event time is the owner's clock, as given
    ahead = apply(state, client, Op.PUT, "k", now_ms=T0 + 10)
    assert ahead.version.timestamp == T0 + 10
    # Through a tombstone as well.
    apply(state, client, Op.DESTROY, "k", now_ms=T0 + 20)
    assert apply(state, client, Op.CREATE, "k", now_ms=T0).version.timestamp == T0 + 20
    # Another key has its own clock.
    assert apply(state, client, Op.PUT, "j", now_ms=T0 - 1).version.timestamp == T0 - 1


def test_timestamp_stays_monotonic_after_replay_on_a_new_owner_behind_in_time() -> None:
    """A new owner whose clock is behind the previous owner's still never moves a key's timestamp back."""
    old, client = new_state(), Client()
    events = [apply(old, client, Op.PUT, "k", now_ms=T0 + 60_000)]
    new = BucketState(REGION, BUCKET, DSID, "site-a-new-owner")
    for e in events:
        new.replay(e)
    event = new.prepare(Op.PUT, "k", b"x", client.eid(), T0)
    assert event.version == VersionTag(DSID, T0 + 60_000, 2, "site-a-new-owner")


def test_version_tag_is_stamped_with_dsid_and_member() -> None:
    """Every event's version tag names this site's dsid and the owner's member id."""
    state, client = new_state(), Client()
    for op in (Op.CREATE, Op.PUT, Op.INVALIDATE, Op.PUT_ALL, Op.DESTROY):
        event = apply(state, client, op, "k")
        assert (event.version.dsid, event.version.member_id) == (DSID, MEMBER)
        assert event.origin_dsid == DSID


# --- duplicate tracking (Geode's EventTracker) -------------------------------------------


def test_same_event_id_again_is_duplicate_and_changes_nothing() -> None:
    """A retry with an already applied EventID is Duplicate, even when it now would fail or differ."""
    state = new_state()
    eid = EventID("client-1", 1, 0)
    first = state.prepare(Op.CREATE, "k", b"1", eid, T0)
    entries = dict(state.entries)
    streams = dict(state.streams)
    # A create retry would raise EntryExists if it were judged again: it must not be.
    assert state.prepare(Op.CREATE, "k", b"1", eid, T0 + 1) == Duplicate(eid)
    assert state.prepare(Op.PUT, "k", b"other", eid, T0 + 2) == Duplicate(eid)
    assert state.entries == entries and state.streams == streams
    assert state.get("k").version == first.version


def test_lower_sequence_of_same_stream_is_duplicate() -> None:
    """An EventID below the highest applied sequence of its (member, thread) is Duplicate."""
    state = new_state()
    state.prepare(Op.PUT, "a", b"1", EventID("c", 1, 5), T0)
    state.prepare(Op.PUT, "b", b"1", EventID("c", 1, 9), T0)
    before = dict(state.entries)
    for seq in (0, 5, 8, 9):
        eid = EventID("c", 1, seq)
        assert state.prepare(Op.PUT, "z", b"x", eid, T0) == Duplicate(eid)
        assert state.is_duplicate(eid)
    assert state.entries == before
    assert state.streams == {("c", 1): 9}
    assert isinstance(state.prepare(Op.PUT, "z", b"x", EventID("c", 1, 10), T0), EntryEvent)


@pytest.mark.parametrize("other", [EventID("c", 2, 0), EventID("d", 1, 0)], ids=["other-thread", "other-member"])
def test_other_streams_are_tracked_independently(other: EventID) -> None:
    """Another thread of the member, or another member, has its own sequence: low ids are not duplicates."""
    state = new_state()
    state.prepare(Op.PUT, "a", b"1", EventID("c", 1, 100), T0)
    event = state.prepare(Op.PUT, "b", b"2", other, T0)
    assert isinstance(event, EntryEvent)
    assert state.streams == {("c", 1): 100, other.stream: 0}


@pytest.mark.parametrize(
    ("failing_op", "setup", "fix"),
    [
        (Op.CREATE, Op.PUT, Op.DESTROY),  # EntryExists; fixed by destroying the key
        (Op.DESTROY, None, Op.PUT),  # EntryNotFound; fixed by creating the key
        (Op.INVALIDATE, None, Op.PUT),  # EntryNotFound; fixed by creating the key
    ],
    ids=["create-exists", "destroy-not-found", "invalidate-not-found"],
)
def test_failed_precondition_does_not_track_the_event_id(failing_op: Op, setup: Op | None, fix: Op) -> None:
    """An operation that raised was not applied: its EventID is not tracked, and its retry is applied."""
    state = new_state()
    other = Client("other-client", 9)
    if setup is not None:
        apply(state, other, setup, "k")
    streams_before = dict(state.streams)
    eid = EventID("client-1", 1, 0)
    with pytest.raises((EntryExists, EntryNotFound)):
        state.prepare(failing_op, "k", b'"v"', eid, T0)
    assert state.streams == streams_before
    assert not state.is_duplicate(eid)
    apply(state, other, fix, "k")  # someone else makes the operation possible
    retried = state.prepare(failing_op, "k", b'"v"', eid, T0 + 1)
    assert isinstance(retried, EntryEvent)
    assert retried.event_id == eid
    assert state.streams[eid.stream] == 0


# --- replay: what a new owner relies on -------------------------------------------------


def test_replay_applies_a_changelog_in_order() -> None:
    """Replaying create, invalidate, destroy, create rebuilds the entries and the stream high-water marks."""
    live, client = new_state(), Client()
    events = [
        apply(live, client, Op.CREATE, "k", b"1", now_ms=T0),
        apply(live, client, Op.PUT, "j", b"2", now_ms=T0 + 1),
        apply(live, client, Op.INVALIDATE, "k", None, now_ms=T0 + 2),
        apply(live, client, Op.DESTROY, "j", None, now_ms=T0 + 3),
    ]
    rebuilt = new_state()
    for e in events:
        rebuilt.replay(e)
    assert rebuilt.entries == live.entries
    assert rebuilt.streams == live.streams == {("client-1", 1): 3}
    assert rebuilt.get("k").value is None and rebuilt.get("j") is None
    assert rebuilt.entries["j"].destroyed and rebuilt.entries["j"].version.entry_version == 2


@dataclass(frozen=True)
class Step:
    op: Op
    key: str
    value: bytes | None
    member: str
    thread: int
    seq_delta: int  # <= 0: reuse an older sequence of the stream (a retry); > 0: go ahead
    clock_delta: int


steps = st.builds(
    Step,
    op=st.sampled_from([op for op in Op if op is not Op.REMOTE]),  # clear and destroy_region included
    key=st.sampled_from(["a", "b", "c"]),
    value=st.one_of(st.none(), st.binary(max_size=8)),
    member=st.sampled_from(["m1", "m2"]),
    thread=st.integers(0, 2),
    seq_delta=st.integers(-3, 3),
    clock_delta=st.integers(-1_000, 1_000),
)


@PROPERTY
@given(st.lists(steps, max_size=60))
def test_replaying_prepared_events_rebuilds_the_same_state(script: list[Step]) -> None:
    """For any run of operations, replaying the events prepare returned, in order, gives the same state."""
    live = new_state()
    changelog: list[EntryEvent] = []
    last_seq: dict[tuple[str, int], int] = {}
    now_ms = T0
    for step in script:
        stream = (step.member, step.thread)
        seq = max(0, last_seq.get(stream, -1) + step.seq_delta)
        last_seq[stream] = max(seq, last_seq.get(stream, -1))
        now_ms += step.clock_delta
        eid = EventID(step.member, step.thread, seq)
        was_duplicate = live.is_duplicate(eid)
        try:
            outcome = prepare_any(live, step.op, step.key, step.value, eid, now_ms)
        except (EntryExists, EntryNotFound):
            continue
        if isinstance(outcome, list):
            assert not was_duplicate
            changelog.extend(outcome)
        elif isinstance(outcome, EntryEvent):
            assert not was_duplicate
            changelog.append(outcome)
        elif isinstance(outcome, Duplicate):
            assert was_duplicate
        else:
            assert isinstance(outcome, Skipped)
    rebuilt = BucketState(REGION, BUCKET, DSID, "site-a-new-owner")
    for event in changelog:
        rebuilt.replay(event)
    assert rebuilt.entries == live.entries
    assert rebuilt.streams == live.streams
    assert rebuilt.stream_seen_ms == live.stream_seen_ms
    assert sorted(rebuilt.keys()) == sorted(live.keys())
    assert rebuilt.size() == live.size()
    # Each key's versions in the changelog count 1, 2, 3, … and timestamps never go back.
    by_key: dict[str, list[VersionTag]] = {}
    for event in changelog:
        by_key.setdefault(event.key, []).append(event.version)
    for versions in by_key.values():
        assert [v.entry_version for v in versions] == list(range(1, len(versions) + 1))
        assert all(a.timestamp <= b.timestamp for a, b in zip(versions, versions[1:]))


@PROPERTY
@given(st.lists(steps, max_size=40), st.lists(steps, max_size=20))
def test_new_owner_continues_exactly_like_the_old_one(before: list[Step], after: list[Step]) -> None:
    """After replay, the new owner answers every further operation as the old owner would (same events, errors, duplicates)."""
    old = new_state()
    changelog: list[EntryEvent] = []
    seqs: dict[tuple[str, int], int] = {}

    def run(state: BucketState, step: Step, now_ms: int):
        stream = (step.member, step.thread)
        seq = max(0, seqs.get(stream, -1) + step.seq_delta)
        eid = EventID(step.member, step.thread, seq)
        try:
            return seq, prepare_any(state, step.op, step.key, step.value, eid, now_ms)
        except (EntryExists, EntryNotFound) as exc:
            return seq, type(exc)

    now_ms = T0
    for step in before:
        now_ms += step.clock_delta
        seq, outcome = run(old, step, now_ms)
        seqs[(step.member, step.thread)] = max(seq, seqs.get((step.member, step.thread), -1))
        if isinstance(outcome, EntryEvent):
            changelog.append(outcome)
        elif isinstance(outcome, list):
            changelog.extend(outcome)
    new = BucketState(REGION, BUCKET, DSID, MEMBER)
    for event in changelog:
        new.replay(event)
    for step in after:
        now_ms += step.clock_delta
        seq_old, outcome_old = run(old, step, now_ms)
        seq_new, outcome_new = run(new, step, now_ms)
        seqs[(step.member, step.thread)] = max(seq_old, seqs.get((step.member, step.thread), -1))
        assert outcome_new == outcome_old
    assert new.entries == old.entries and new.streams == old.streams


def test_idle_event_id_streams_expire_and_busy_ones_stay():
    """Streams idle longer than the tracking timeout are forgotten; a retry after that is applied again."""
    state = BucketState("orders", 0, 1, "m")
    old, busy = EventID("old", 1, 5), EventID("busy", 1, 7)
    assert not isinstance(state.prepare(Op.PUT, "a", b"1", old, now_ms=1_000), Duplicate)
    assert not isinstance(state.prepare(Op.PUT, "b", b"1", busy, now_ms=900_000), Duplicate)
    assert state.expire_streams(now_ms=1_000_000, idle_ms=500_000) == 1
    assert ("old", 1) not in state.streams and ("busy", 1) in state.streams
    assert isinstance(state.prepare(Op.PUT, "b", b"2", busy, now_ms=1_000_001), Duplicate)
    assert not isinstance(state.prepare(Op.PUT, "a", b"2", old, now_ms=1_000_002), Duplicate)


# --- WAN conflicts (events applied by another site) ------------------------------


def _remote(key: str, op: Operation, value: bytes | None, dsid: int, ts: int, version: int, seq: int) -> EntryEvent:
    return EntryEvent(region="orders", key=key, operation=op, value=value, event_id=EventID(f"site{dsid}", 1, seq),
                      version=VersionTag(dsid, ts, version, f"m{dsid}"), origin_dsid=dsid, bucket=0, event_time=ts,
                      visited_dsids=(1,))


def test_a_remote_event_for_an_absent_key_applies_with_its_origins_version():
    """A remote create lands with the origin's version tag and origin dsid."""
    from sluice.region.state import ConflictLost

    state = BucketState("orders", 0, 1, "local")
    applied = state.prepare_remote(_remote("k", Operation.CREATE, b"1", dsid=2, ts=100, version=1, seq=0))
    assert not isinstance(applied, (Duplicate, ConflictLost))
    entry = state.get("k")
    assert entry is not None and entry.value == b"1" and entry.version == VersionTag(2, 100, 1, "m2")
    assert applied.origin_dsid == 2 and applied.visited_dsids == (1,)


@pytest.mark.parametrize(("local_ts", "remote_ts", "remote_dsid", "wins"), [
    (100, 200, 2, True),   # later timestamp wins
    (200, 100, 2, False),  # earlier loses
    (100, 100, 2, True),   # tie: the higher dsid (2 > 1) wins
    (100, 100, 0, False),  # tie against a lower dsid loses (dsid 0 stands for any lower site)
])
def test_wan_conflicts_go_to_the_later_timestamp_then_the_higher_dsid(local_ts, remote_ts, remote_dsid, wins):
    """Geode's rule: later timestamp wins; equal timestamps go to the higher dsid."""
    from sluice.region.state import ConflictLost

    state = BucketState("orders", 0, 1, "local")
    state.prepare(Op.PUT, "k", b"local", EventID("c", 1, 0), now_ms=local_ts)
    outcome = state.prepare_remote(_remote("k", Operation.UPDATE, b"remote", remote_dsid, remote_ts, 1, seq=0))
    assert isinstance(outcome, ConflictLost) is (not wins)
    assert state.get("k").value == (b"remote" if wins else b"local")


@pytest.mark.parametrize(("own_dsid", "other_dsid", "stamped"), [
    (1, 2, 501),  # the other site's version would beat a write stamped 500 there: the write takes 501
    (2, 1, 500),  # a write stamped 500 beats a lower dsid's 500 as it is
])
def test_a_write_over_another_sites_version_of_the_same_millisecond_supersedes_it(own_dsid, other_dsid, stamped):
    """The write's version wins against the one it overwrote at the other site too, so the sites agree on it."""
    from sluice.region.conflicts import remote_wins

    state = BucketState("orders", 0, own_dsid, "local")
    state.prepare_remote(_remote("k", Operation.UPDATE, b"theirs", dsid=other_dsid, ts=500, version=3, seq=0))
    event = state.prepare(Op.PUT, "k", b"ours", EventID("c", 1, 0), now_ms=500)
    assert event.version == VersionTag(own_dsid, stamped, 4, "local")
    assert remote_wins(VersionTag(other_dsid, 500, 3, f"m{other_dsid}"), event.version)


def test_the_conflict_winner_is_the_same_whatever_the_arrival_order():
    """Two sites' concurrent writes, applied in either order, leave the same value and version."""
    a = _remote("k", Operation.UPDATE, b"from-2", dsid=2, ts=500, version=3, seq=0)
    b = _remote("k", Operation.UPDATE, b"from-3", dsid=3, ts=500, version=7, seq=0)
    results = []
    for order in ((a, b), (b, a)):
        state = BucketState("orders", 0, 1, "local")
        for event in order:
            state.prepare_remote(event)
        results.append((state.get("k").value, state.get("k").version))
    assert results[0] == results[1] == (b"from-3", VersionTag(3, 500, 7, "m3"))


def test_updates_from_the_last_writers_site_are_not_conflicts():
    """An update from the dsid that wrote the entry last applies when its entry version is newer."""
    from sluice.region.state import ConflictLost

    state = BucketState("orders", 0, 1, "local")
    state.prepare_remote(_remote("k", Operation.CREATE, b"v1", dsid=2, ts=900, version=1, seq=0))
    # Same site, newer entry version, an older clock reading: still applies.
    assert not isinstance(state.prepare_remote(_remote("k", Operation.UPDATE, b"v2", 2, 800, 2, seq=1)), ConflictLost)
    assert isinstance(state.prepare_remote(_remote("k", Operation.UPDATE, b"old", 2, 950, 1, seq=2)), ConflictLost)
    assert state.get("k").value == b"v2"


def test_a_remote_destroy_leaves_a_tombstone_that_an_older_remote_create_cannot_revive():
    """A winning remote destroy removes the entry; an older create from elsewhere loses to its tombstone."""
    from sluice.region.state import ConflictLost

    state = BucketState("orders", 0, 1, "local")
    state.prepare(Op.PUT, "k", b"local", EventID("c", 1, 0), now_ms=100)
    state.prepare_remote(_remote("k", Operation.DESTROY, None, dsid=2, ts=300, version=2, seq=0))
    assert state.get("k") is None
    late = state.prepare_remote(_remote("k", Operation.CREATE, b"late", dsid=3, ts=200, version=1, seq=0))
    assert isinstance(late, ConflictLost) and state.get("k") is None


def test_a_remote_event_seen_before_is_a_duplicate():
    """The receiver's retries are answered by EventID, not applied twice."""
    state = BucketState("orders", 0, 1, "local")
    event = _remote("k", Operation.CREATE, b"1", dsid=2, ts=100, version=1, seq=4)
    state.prepare_remote(event)
    assert isinstance(state.prepare_remote(event), Duplicate)


def test_one_writers_remote_events_for_different_keys_may_arrive_in_any_order():
    """Sequences of one writer thread interleave across keys at a remote site; none is taken for a repeat."""
    from sluice.region.state import ConflictLost

    state = BucketState("orders", 0, 2, "b")
    later = _remote("k2", Operation.CREATE, b"2", dsid=1, ts=200, version=1, seq=9)
    earlier = _remote("k1", Operation.CREATE, b"1", dsid=1, ts=100, version=1, seq=3)
    for event in (later, earlier):
        outcome = state.prepare_remote(event)
        assert not isinstance(outcome, (Duplicate, ConflictLost))
    assert state.get("k1").value == b"1" and state.get("k2").value == b"2"
    # An older event of k1 from the same thread arriving late is a repeat, not applied.
    old = _remote("k1", Operation.UPDATE, b"old", dsid=1, ts=50, version=1, seq=2)
    assert isinstance(state.prepare_remote(old), Duplicate)


# --- EventID streams nobody can pin ------------------------------------------------------


def test_a_local_write_may_not_jump_far_ahead_of_its_stream():
    """A sequence more than 2^32 past the stream's highest in the bucket is refused (and not tracked), so
    one caller cannot make another member's next writes look like repeats; a new stream starts anywhere."""
    from sluice.core.errors import InvalidRequest
    from sluice.region.state import STREAM_AHEAD_MAX

    state = new_state()
    assert not isinstance(state.prepare(Op.PUT, "k", b"1", EventID("victim", 1, 10), T0), Duplicate)
    with pytest.raises(InvalidRequest) as refused:
        state.prepare(Op.PUT, "k", b"2", EventID("victim", 1, 10 + STREAM_AHEAD_MAX + 1), T0)
    assert refused.value.field == "event_id.sequence_id"
    with pytest.raises(InvalidRequest):
        state.prepare_clear(EventID("victim", 1, 10 + STREAM_AHEAD_MAX + 1), T0)
    assert state.streams[("victim", 1)] == 10
    assert not isinstance(state.prepare(Op.PUT, "k", b"3", EventID("victim", 1, 10 + STREAM_AHEAD_MAX), T0),
                          Duplicate)
    assert not isinstance(state.prepare(Op.PUT, "k", b"4", EventID("fresh", 1, 2**50), T0), Duplicate)


def test_events_of_another_site_do_not_pin_a_local_writers_stream():
    """A remote event carrying a local client's (member, thread) with a huge sequence is applied, but a
    later local write of that client is not taken for a repeat, here or after a reload."""
    state = new_state()
    pin = EntryEvent(region=REGION, key="r", operation=Operation.CREATE, value=b"1", event_id=EventID("client-1", 1, 2**52),
                     version=VersionTag(2, T0, 1, "m2"), origin_dsid=2, bucket=BUCKET, event_time=T0)
    applied = state.prepare_remote(pin)
    assert isinstance(applied, EntryEvent)
    local = state.prepare(Op.PUT, "k", b"1", EventID("client-1", 1, 0), T0)
    assert isinstance(local, EntryEvent)
    reloaded = new_state()
    reloaded.replay(applied)
    reloaded.replay(local)
    assert reloaded.streams == {("client-1", 1): 0}
