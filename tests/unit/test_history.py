"""The per-key history checker: what writers issued against what each observer applied.

``sluice.verify.history.check`` reports, per observer and by key, every
operation lost (expected, had to arrive, never applied nor superseded),
duplicated (one (key, EventID) applied twice), reordered (one writer stream's
sequence ids going back on a key) and unexpected (applied, issued by nobody or
outside the observer's scope), and every key whose final state differs between
sites.  The first tests build small two-site histories by hand; the
properties then generate histories that an observer applies faithfully, and
check that one removed, repeated or swapped record is always caught, as the
right kind, on the right key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sluice.core.events import EventID, Operation, VersionTag
from sluice.region.conflicts import remote_wins
from sluice.verify.history import (FINAL_STATE, Applied, InconsistentHistory, Issued, Kind, Observer, check,
                                   ignore_region_operations, supersedes)

DSID = {"site-a": 1, "site-b": 2}
T0 = 1_700_000_000_000

PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


class Writer:
    """One (member, thread) at one site, issuing operations with increasing sequence ids."""

    def __init__(self, site: str, member: str, thread: int = 1) -> None:
        self.site, self.member, self.thread = site, member, thread
        self.next = 0

    def issue(self, key: str, value: object = "v", kind: str = "put", acknowledged: bool = True) -> Issued:
        event_id = EventID(self.member, self.thread, self.next)
        self.next += 1
        return Issued(key, event_id, self.site, kind, value, acknowledged)


class Site:
    """Stamps version tags the way a site's region does: one entry version per write of a key."""

    def __init__(self, name: str) -> None:
        self.dsid = DSID[name]
        self.entry_versions: dict[str, int] = {}

    def stamp(self, op: Issued, timestamp: int) -> Applied:
        version = self.entry_versions.get(op.key, 0) + 1
        self.entry_versions[op.key] = version
        return Applied(op.key, op.event_id, VersionTag(self.dsid, timestamp, version), Operation.UPDATE, self.dsid)


def everything(op: Issued) -> bool:
    return True


def only(*keys: str) -> Callable[[Issued], bool]:
    return lambda op: op.key in keys


def region(name: str, applied: list[Applied], may_skip_superseded: bool = False) -> Observer:
    return Observer(f"{name} region", applied, everything, may_skip_superseded)


@dataclass
class TwoSites:
    """Writers at A and B on their own keys; both regions apply every write, in issue order."""

    issued: list[Issued]
    a: list[Applied]
    b: list[Applied]


def two_sites() -> TwoSites:
    wa, wb = Writer("site-a", "a-member"), Writer("site-b", "b-member")
    issued = [wa.issue("k1", 1), wa.issue("k2", 2), wb.issue("k3", 3), wa.issue("k1", 4), wb.issue("k3", 5)]
    origin = {"site-a": Site("site-a"), "site-b": Site("site-b")}
    stamped = [origin[op.site].stamp(op, T0 + i) for i, op in enumerate(issued)]
    # A remote apply keeps the origin's version tag, so both regions hold the same records.
    return TwoSites(issued, list(stamped), list(stamped))


def final_state(history: TwoSites) -> dict[str, tuple[object, VersionTag]]:
    state = {}
    for op, applied in zip(history.issued, history.a):
        state[op.key] = (op.value, applied.version)
    return state


# --- hand-made histories ------------------------------------------------------------------------


def test_a_clean_history_passes() -> None:
    """Every write applied once, in order, at both sites, with equal final states: no finding at all."""
    h = two_sites()
    report = check(h.issued, [region("site-a", h.a), region("site-b", h.b)],
                   {"site-a": final_state(h), "site-b": final_state(h)})
    assert report.ok and report.findings == ()
    c = report.counts
    assert (c.issued, c.acknowledged, c.lost, c.duplicated, c.reordered, c.divergent) == (5, 5, 0, 0, 0, 0)
    assert c.observers["site-b region"].applied == 5 and c.final_keys == 3
    assert report.render().startswith("history OK: 0 lost")


def test_a_dropped_acknowledged_op_is_lost_for_exactly_that_key_and_observer() -> None:
    h = two_sites()
    dropped = h.b.pop(1)  # site-a's k2 never reached site B
    report = check(h.issued, [region("site-a", h.a), region("site-b", h.b)])
    assert not report.ok
    [lost] = report.findings
    assert (lost.kind, lost.observer, lost.key, lost.event_ids) == (Kind.LOST, "site-b region", "k2",
                                                                    (dropped.event_id,))
    assert "applied by site-a region" in lost.detail
    assert list(report.by_key()) == ["k2"] and report.counts.lost == 1


def test_an_acknowledged_op_applied_nowhere_is_lost_at_every_observer_even_when_skipping_is_allowed() -> None:
    h = two_sites()
    h.a.pop(1), h.b.pop(1)
    report = check(h.issued, [region("site-a", h.a, may_skip_superseded=True), region("site-b", h.b, True)])
    assert [(f.kind, f.observer, f.key) for f in report.findings] == [
        (Kind.LOST, "site-a region", "k2"), (Kind.LOST, "site-b region", "k2")]
    assert "applied by no observer" in report.findings[0].detail


def test_an_unacknowledged_op_missing_everywhere_is_not_lost() -> None:
    w = Writer("site-a", "a-member")
    applied_op, timed_out = w.issue("k1", 1), w.issue("k1", 2, acknowledged=False)
    a = [Site("site-a").stamp(applied_op, T0)]
    report = check([applied_op, timed_out], [region("site-a", a), region("site-b", list(a))])
    assert report.ok and report.findings == ()
    assert report.counts.observers["site-b region"].unacknowledged_missing == 1
    assert report.counts.acknowledged == 1


def test_an_unacknowledged_op_applied_at_one_observer_must_reach_every_observer_in_scope() -> None:
    """It timed out at the writer, but site A applied it: it happened, so site B must see it too."""
    w = Writer("site-a", "a-member")
    timed_out = w.issue("k1", 1, acknowledged=False)
    report = check([timed_out], [region("site-a", [Site("site-a").stamp(timed_out, T0)]), region("site-b", [])])
    [lost] = report.findings
    assert (lost.kind, lost.observer, lost.key) == (Kind.LOST, "site-b region", "k1")
    assert "not acknowledged, applied by site-a region" in lost.detail


def test_retries_of_one_write_merge_and_a_reused_event_id_is_refused() -> None:
    """A retry keeps its EventID: the write is acknowledged when any attempt was, and counted once."""
    w = Writer("site-a", "a-member")
    first = w.issue("k1", 1, acknowledged=False)
    retry = Issued(first.key, first.event_id, first.site, first.kind, first.value, acknowledged=True)
    report = check([first, retry], [region("site-a", [])])
    assert report.counts.issued == 1 and report.counts.acknowledged == 1
    assert [f.kind for f in report.findings] == [Kind.LOST]
    other = Issued(first.key, first.event_id, first.site, "put", 99, acknowledged=True)
    with pytest.raises(InconsistentHistory) as caught:
        check([first, other], [])
    assert caught.value.key == "k1" and caught.value.event_id == first.event_id
    with pytest.raises(ValueError, match="kind"):
        Issued("k1", first.event_id, "site-a", "invalidate", None, True)


def test_an_op_applied_twice_is_duplicated() -> None:
    h = two_sites()
    h.b.append(h.b[0])  # a redelivery after the rest
    report = check(h.issued, [region("site-a", h.a), region("site-b", h.b)])
    [dup] = report.findings
    assert (dup.kind, dup.observer, dup.key, dup.event_ids) == (Kind.DUPLICATED, "site-b region", "k1",
                                                                (h.b[0].event_id,))
    assert dup.detail == "applied 2 times, at 0, 5"
    assert not report.ok and report.counts.duplicated == 1


def test_two_ops_of_one_stream_applied_out_of_order_on_a_key_are_reordered() -> None:
    h = two_sites()
    # k1's two writes (positions 0 and 3) swap at site B; the swap carries k2 along, which is fine.
    h.b[0], h.b[3] = h.b[3], h.b[0]
    report = check(h.issued, [region("site-a", h.a), region("site-b", h.b)])
    [late] = report.findings
    assert (late.kind, late.observer, late.key) == (Kind.REORDERED, "site-b region", "k1")
    assert late.event_ids == (h.issued[0].event_id, h.issued[3].event_id), "the late one, then the one ahead"


def test_one_stream_may_interleave_across_keys_and_streams_may_interleave_on_a_key() -> None:
    """Order is kept per key and stream: a thread's writes to different keys travel different partitions."""
    w1, w2 = Writer("site-a", "m", 1), Writer("site-a", "m", 2)
    x1, y1, x2, z = w1.issue("x"), w1.issue("y"), w1.issue("x"), w2.issue("x")
    site = Site("site-a")
    applied = [site.stamp(op, T0 + i) for i, op in enumerate([z, y1, x1, x2])]  # y1 before x1; z first
    assert check([x1, y1, x2, z], [region("site-a", applied)]).findings == ()


def conflict() -> tuple[list[Issued], Applied, Applied]:
    """A writes k at t=100 and B at t=200: B's write wins everywhere."""
    a_write = Writer("site-a", "a-member").issue("k", "from a")
    b_write = Writer("site-b", "b-member").issue("k", "from b")
    return [a_write, b_write], Site("site-a").stamp(a_write, 100), Site("site-b").stamp(b_write, 200)


def test_a_conflict_loser_missing_at_the_other_site_is_superseded_only_where_skipping_is_allowed() -> None:
    issued, a_applied, b_applied = conflict()
    at_a = [a_applied, b_applied]  # A applied its own write, then B's, which won
    at_b = [b_applied]  # A's write reached B after B's own and lost the conflict
    report = check(issued, [region("site-a", at_a), region("site-b", at_b, may_skip_superseded=True)])
    assert report.ok and report.findings == ()
    assert report.counts.observers["site-b region"].superseded == 1
    strict = check(issued, [region("site-a", at_a), region("site-b", at_b, may_skip_superseded=False)])
    [lost] = strict.findings
    assert (lost.kind, lost.observer, lost.key, lost.event_ids) == (Kind.LOST, "site-b region", "k",
                                                                    (a_applied.event_id,))


def test_the_last_op_applied_on_the_key_decides_what_it_superseded() -> None:
    """A's older write reached B first (it cannot supersede A's newer one); B's own write, applied
    last, does."""
    wa, wb = Writer("site-a", "a-member"), Writer("site-b", "b-member")
    a_old, a_new, b_write = wa.issue("k", 1), wa.issue("k", 2), wb.issue("k", 3)
    site_a = Site("site-a")
    old, new = site_a.stamp(a_old, 100), site_a.stamp(a_new, 150)
    b_applied = Site("site-b").stamp(b_write, 200)
    report = check([a_old, a_new, b_write], [region("site-a", [old, new, b_applied]),
                                             region("site-b", [old, b_applied], may_skip_superseded=True)])
    assert report.ok and report.counts.observers["site-b region"].superseded == 1
    only_old = check([a_old, a_new], [region("site-a", [old, new]),
                                      region("site-b", [old], may_skip_superseded=True)])
    assert [(f.kind, f.event_ids) for f in only_old.findings] == [(Kind.LOST, (a_new.event_id,))]


def test_a_missing_op_that_would_have_won_is_lost_even_where_skipping_is_allowed() -> None:
    issued, a_applied, b_applied = conflict()
    # Site A kept its own, older write and never applied B's newer one; B rightly skipped A's.
    report = check(issued, [region("site-a", [a_applied], may_skip_superseded=True),
                            region("site-b", [b_applied], may_skip_superseded=True)])
    [lost] = report.findings
    assert (lost.kind, lost.observer, lost.event_ids) == (Kind.LOST, "site-a region", (b_applied.event_id,))
    assert "does not supersede" in lost.detail


def test_equal_timestamps_go_to_the_higher_dsid() -> None:
    issued, a_applied, b_applied = conflict()
    tie = Applied(b_applied.key, b_applied.event_id, VersionTag(2, 100, 1), Operation.UPDATE, 2)
    skip = check(issued, [region("site-a", [a_applied, tie]), region("site-b", [tie], may_skip_superseded=True)])
    assert skip.ok, "B (dsid 2) beats A (dsid 1) at the same timestamp"
    lose = check(issued, [region("site-a", [a_applied], may_skip_superseded=True),
                          region("site-b", [tie], may_skip_superseded=True)])
    assert [f.observer for f in lose.findings] == ["site-a region"]


def test_an_observer_without_version_tags_borrows_them_from_the_others() -> None:
    """A listener records no versions; the regions' tags decide whether its skips were superseded."""
    issued, a_applied, b_applied = conflict()
    bare = [Applied(b_applied.key, b_applied.event_id)]
    listener = Observer("listener X", bare, only("k"), may_skip_superseded=True)
    report = check(issued, [region("site-a", [a_applied, b_applied]), listener])
    assert report.ok and report.counts.observers["listener X"].superseded == 1


def test_supersedes_is_geodes_rule_as_the_region_applies_it() -> None:
    """The checker keeps its own copy of the rule; it must answer as region.conflicts does between
    sites, and within one site on a timestamp tie."""

    @given(st.builds(VersionTag, st.integers(1, 3), st.integers(0, 3), st.integers(1, 3)),
           st.builds(VersionTag, st.integers(1, 3), st.integers(0, 3), st.integers(1, 3)))
    @PROPERTY
    def agree(winner: VersionTag, loser: VersionTag) -> None:
        if winner.dsid != loser.dsid or winner.timestamp == loser.timestamp:
            assert supersedes(winner, loser) == remote_wins(loser, winner)

    agree()


def test_a_later_write_of_the_same_site_supersedes_though_its_entry_version_is_lower() -> None:
    """B writes k (entry version 40), A's later write lands on B and resets the entry version to A's
    count (12), B writes k again (13): that last write is later than the first, whatever the versions."""
    first, last = VersionTag(2, T0 + 10, 40), VersionTag(2, T0 + 30, 13)
    assert supersedes(last, first) and not supersedes(first, last)


def test_a_divergent_final_state_is_reported_with_both_sides() -> None:
    h = two_sites()
    a_state = final_state(h)
    b_state = dict(a_state)
    b_state["k1"] = ("stale", VersionTag(1, T0, 1))
    del b_state["k3"]
    report = check(h.issued, [region("site-a", h.a), region("site-b", h.b)], {"site-a": a_state, "site-b": b_state})
    assert not report.ok and report.counts.divergent == 2
    k1, k3 = report.findings
    assert (k1.kind, k1.observer, k1.key) == (Kind.DIVERGENT, FINAL_STATE, "k1")
    assert k1.sides == (("site-a", a_state["k1"]), ("site-b", ("stale", VersionTag(1, T0, 1))))
    assert k3.key == "k3" and k3.sides == (("site-a", a_state["k3"]), ("site-b", None))
    assert "site-b: absent" in k3.detail


def test_unexpected_ops_are_reported_unless_ignored_and_do_not_fail_the_report() -> None:
    h = two_sites()
    clear = Applied("k1", EventID("a-0-CLEAR", 0, 17), VersionTag(1, T0 + 9, 3), Operation.REGION_CLEAR, 1)
    stray = Applied("k9", h.issued[0].event_id, VersionTag(1, T0 + 9, 1), Operation.UPDATE, 1)
    h.a += [clear, stray]
    observers = [region("site-a", h.a), region("site-b", h.b)]
    report = check(h.issued, observers)
    assert report.ok, "unexpected records are reported, not failed"
    assert [(f.kind, f.key, f.event_ids) for f in report.findings] == [
        (Kind.UNEXPECTED, "k1", (clear.event_id,)), (Kind.UNEXPECTED, "k9", (stray.event_id,))]
    assert "issued for key 'k1'" in report.findings[1].detail
    quiet = check(h.issued, observers, ignore=ignore_region_operations)
    assert [f.key for f in quiet.findings] == ["k9"]
    assert quiet.counts.observers["site-a region"].ignored == 1


def test_an_issued_op_outside_the_observers_scope_is_unexpected() -> None:
    """A client that registered interest in k1 only hears of k3: reported, not failed."""
    h = two_sites()
    client = Observer("durable client", [h.a[0], h.a[2], h.a[3]], only("k1"))
    report = check(h.issued, [region("site-a", h.a), client])
    [extra] = report.findings
    assert (extra.kind, extra.observer, extra.key) == (Kind.UNEXPECTED, "durable client", "k3")
    assert "outside this observer's scope" in extra.detail
    assert report.counts.observers["durable client"].expected == 2


def test_render_lists_findings_grouped_by_observer_and_kind_then_the_counts() -> None:
    h = two_sites()
    h.b.append(h.b.pop(0))  # k1's first write now after its second: reordered
    h.b.append(h.b[0])  # k2 twice
    h.a.pop()  # k3's second write lost at A
    report = check(h.issued, [region("site-a", h.a), region("site-b", h.b)])
    text = report.render()
    lines = text.splitlines()
    assert lines[0] == "history FAILED: 1 lost, 1 duplicated, 1 reordered, 0 divergent; 0 unexpected"
    assert lines[2].split() == ["observer", "kind", "key", "event", "detail"]
    rows = [line.split()[:4] for line in lines[3:6]]
    assert rows == [["site-a", "region", "lost", "k3"], ["site-b", "region", "duplicated", "k2"],
                    ["site-b", "region", "reordered", "k1"]]
    assert any(line.startswith("site-b region") and line.split()[2:4] == ["6", "5"] for line in lines[6:])
    assert lines[-1] == "issued 5, acknowledged 5; final state: 0 divergent of 0 keys"
    assert sorted(report.by_key()) == ["k1", "k2", "k3"]


def test_observer_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        check([], [region("site-a", []), region("site-a", [])])


# --- properties ---------------------------------------------------------------------------------


@dataclass
class Generated:
    issued: list[Issued]
    observers: list[Observer]


@st.composite
def faithful_histories(draw: st.DrawFn) -> Generated:
    """Writers on a few keys; a region sees everything and a client a subset of keys, each applying
    exactly what it expects, in issue order.  An unacknowledged write is applied everywhere or nowhere."""
    keys = [f"k{i}" for i in range(draw(st.integers(1, 3)))]
    writers = [Writer("site-a", f"m{i // 2}", i % 2) for i in range(draw(st.integers(1, 2)))]
    shape = st.tuples(st.sampled_from(keys), st.sampled_from(writers), st.sampled_from([True, True, True, False]),
                      st.booleans())
    issued, happened = [], []
    for key, writer, acknowledged, applied_anyway in draw(st.lists(shape, min_size=7, max_size=40)):
        op = writer.issue(key, len(issued), acknowledged=acknowledged)
        issued.append(op)
        happened.append(acknowledged or applied_anyway)
    interest = draw(st.sets(st.sampled_from(keys), min_size=1))
    site = Site("site-a")
    stamped = [site.stamp(op, T0 + i) for i, op in enumerate(issued)]
    scopes = [("site-a region", everything), ("client", lambda op: op.key in interest)]
    observers = [Observer(name, [a for op, a, ok in zip(issued, stamped, happened) if ok and expects(op)], expects)
                 for name, expects in scopes]
    return Generated(issued, observers)


@given(faithful_histories())
@PROPERTY
def test_a_faithful_history_always_passes(history: Generated) -> None:
    report = check(history.issued, history.observers)
    assert report.ok and report.findings == (), report.render()


@given(faithful_histories(), st.sampled_from(["remove", "duplicate", "swap"]), st.integers(0, 1), st.data())
@PROPERTY
def test_one_removed_repeated_or_swapped_record_is_always_caught_on_its_key(
        history: Generated, mutation: str, which: int, data: st.DataObject) -> None:
    observer = history.observers[which]
    applied = list(observer.applied)
    acknowledged = {op.event_id for op in history.issued if op.acknowledged}
    if mutation == "remove":
        candidates = [i for i, a in enumerate(applied) if a.event_id in acknowledged]
        assume(candidates)
        victim = applied.pop(data.draw(st.sampled_from(candidates)))
        expected = {(Kind.LOST, victim.key, victim.event_id)}
    elif mutation == "duplicate":
        assume(applied)
        i = data.draw(st.integers(0, len(applied) - 1))
        victim = applied[i]
        applied.insert(data.draw(st.integers(i + 1, len(applied))), victim)  # redelivered later
        expected = {(Kind.DUPLICATED, victim.key, victim.event_id)}
    else:
        pairs = [(i, j) for i in range(len(applied)) for j in range(i + 1, len(applied))
                 if applied[i].key == applied[j].key and
                 applied[i].event_id.stream == applied[j].event_id.stream]
        assume(pairs)
        i, j = data.draw(st.sampled_from(pairs))
        victim = applied[i]
        applied[i], applied[j] = applied[j], applied[i]
        expected = None
    observers = list(history.observers)
    observers[which] = Observer(observer.name, applied, observer.expects, observer.may_skip_superseded)
    report = check(history.issued, observers)
    assert not report.ok
    assert {f.observer for f in report.findings} == {observer.name}
    if expected is not None:
        assert {(f.kind, f.key, f.event_ids[0]) for f in report.findings} == expected, report.render()
    else:
        # Every op of that stream and key between the two positions now comes after a higher sequence id.
        assert {(f.kind, f.key) for f in report.findings} == {(Kind.REORDERED, victim.key)}, report.render()
        assert victim.event_id in {f.event_ids[0] for f in report.findings}


# --- size ---------------------------------------------------------------------------------------


def test_two_hundred_thousand_applied_records_check_whole() -> None:
    """A large history is checked whole: every record counted, none reported lost or twice.
    (How fast the check runs is a benchmark's business, not a test's.)"""
    issued, applied = [], []
    writers = [Writer("site-a", f"m{i}", t) for i in range(8) for t in range(3)]
    site = Site("site-a")
    for i in range(200_000):
        op = writers[i % len(writers)].issue(f"k{i % 5000}", i)
        issued.append(op)
        applied.append(site.stamp(op, T0 + i))
    report = check(issued, [region("site-a", applied)])
    assert report.ok and report.counts.observers["site-a region"].applied == 200_000
