"""Per-key history checker: what the writers issued against what each observer applied.

A fault run (kill -9 of services, paused brokers) drives writers against two
sites.  Afterwards it holds three kinds of record, and this module judges
them, in the spirit of Jepsen's queue and set checkers, by key rather than by
totals:

* the writers' log: every operation issued (``Issued``), acknowledged or not.
  An acknowledged operation was answered OK by the region service, so it was
  applied at its own site; an unacknowledged one (the call failed or timed
  out) may or may not have been applied, but at most once;
* per observer (a site's region changelog, a write-behind table, a listener,
  a durable client), what it applied, in order (``Applied``), and which issued
  operations it should see at all (``Observer.expects``);
* optionally, each site's final state: key → (value, version tag).

``check`` goes step by step:

1. It indexes the writers' log by (key, EventID).  A retry keeps its EventID
   (Geode's rule, kept by the region service), so records of the same write
   merge into one operation, acknowledged when any attempt was.
2. It walks each observer's applied list once, in order.  A (key, EventID)
   seen before is *duplicated*.  One nobody issued is *unexpected*, unless the
   caller's ``ignore`` accepts it (internal operations such as a region clear);
   an issued one outside the observer's scope is *unexpected* too.  Per key and
   writer stream (member, thread), sequence ids must grow in the order applied:
   one below the highest already applied is *reordered*.
3. For each operation the observer expects and did not apply, it decides
   whether the operation had to arrive.  It had to when it was acknowledged,
   or when some observer applied it: an operation that happened anywhere must
   reach everyone in scope.  Such an operation is *lost*, unless the observer
   may skip superseded operations (WAN conflicts, conflation) and its last
   applied operation on the key wins over the missing one by Geode's rule.
4. It compares the sites' final states key by key: *divergent*.

The walk touches each applied record a constant number of times (dicts keyed
by (key, EventID)), so a million records check in seconds.  Nothing here does
I/O; the harness reads the records and prints ``Report.render()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.events import REGION_OPERATIONS, EventID, Operation, VersionTag

#: What a writer may issue (the region service's write calls).
ISSUED_KINDS = ("put", "create", "destroy", "put_all", "remove_all")

#: The ``Finding.observer`` of a divergence, which belongs to no observer.
FINAL_STATE = "final state"

#: The final state of one key at one site: (value, version tag), or None when absent.
State = tuple[Any, VersionTag] | None

#: (key, member, thread, sequence): an issued operation's identity, hashed in C.
_Flat = tuple[str, str, int, int]


class Kind(str, enum.Enum):
    """What a finding says; the order is the order ``Report.render`` groups by."""

    LOST = "lost"
    DUPLICATED = "duplicated"
    REORDERED = "reordered"
    UNEXPECTED = "unexpected"
    DIVERGENT = "divergent"


#: Kinds that make a report fail.  Unexpected operations are reported only:
#: some are legitimate internal operations the caller did not tell us about.
FAILING = frozenset({Kind.LOST, Kind.DUPLICATED, Kind.REORDERED, Kind.DIVERGENT})


class InconsistentHistory(ValueError):
    """The writers' log contradicts itself: one (key, EventID) issued as two different writes."""

    def __init__(self, key: str, event_id: EventID, reason: str) -> None:
        self.key = key
        self.event_id = event_id
        self.reason = reason
        super().__init__(f"key {key!r}, event {event_id}: {reason}")


@dataclass(frozen=True, slots=True)
class Issued:
    """One operation a writer issued, on one key (a put_all issues one per entry)."""

    key: str
    event_id: EventID
    site: str
    kind: str
    value: Any
    acknowledged: bool

    def __post_init__(self) -> None:
        if self.kind not in ISSUED_KINDS:
            raise ValueError(f"Issued.kind {self.kind!r} is not one of {', '.join(ISSUED_KINDS)}")


@dataclass(frozen=True, slots=True)
class Applied:
    """One operation an observer applied, as it recorded it (a listener may not know the version)."""

    key: str
    event_id: EventID
    version: VersionTag | None = None
    operation: Operation | None = None
    origin_dsid: int | None = None


@dataclass(frozen=True, slots=True)
class Observer:
    """Something that applies operations, in ``applied`` order, and the issued ones it should see.

    ``may_skip_superseded``: an expected operation it never applied is not lost
    when its last applied operation on the key wins over it (a WAN conflict
    loser, or an update conflated away).
    """

    name: str
    applied: Sequence[Applied]
    expects: Callable[[Issued], bool]
    may_skip_superseded: bool = False


@dataclass(frozen=True, slots=True)
class Finding:
    """One violation (or, for ``UNEXPECTED``, one oddity) on one key.

    ``event_ids``: lost, duplicated, unexpected: the event; reordered: the late
    event, then the one of the same stream applied before it with a higher
    sequence id; divergent: none.  ``sides``: divergent only, (site, state) per site.
    """

    kind: Kind
    observer: str
    key: str
    event_ids: tuple[EventID, ...]
    detail: str
    sides: tuple[tuple[str, State], ...] = ()


@dataclass(frozen=True, slots=True)
class ObserverCounts:
    """One observer's tallies.

    ``superseded``: expected, missing, and forgiven because a later version won.
    ``unacknowledged_missing``: expected, missing, never acknowledged and applied
    nowhere, so possibly never applied at all: allowed.
    """

    applied: int
    expected: int
    lost: int
    duplicated: int
    reordered: int
    unexpected: int
    ignored: int
    superseded: int
    unacknowledged_missing: int


@dataclass(frozen=True, slots=True)
class Counts:
    """``issued`` counts distinct (key, EventID) writes, retries merged."""

    issued: int
    acknowledged: int
    observers: Mapping[str, ObserverCounts]
    final_keys: int
    divergent: int

    @property
    def lost(self) -> int:
        return sum(c.lost for c in self.observers.values())

    @property
    def duplicated(self) -> int:
        return sum(c.duplicated for c in self.observers.values())

    @property
    def reordered(self) -> int:
        return sum(c.reordered for c in self.observers.values())

    @property
    def unexpected(self) -> int:
        return sum(c.unexpected for c in self.observers.values())


@dataclass(frozen=True, slots=True)
class Report:
    findings: tuple[Finding, ...]
    counts: Counts

    @property
    def ok(self) -> bool:
        """No lost, duplicated or reordered operation and no divergent key."""
        return not any(f.kind in FAILING for f in self.findings)

    def by_key(self) -> dict[str, list[Finding]]:
        """Key → its findings, in report order."""
        keyed: dict[str, list[Finding]] = {}
        for finding in self.findings:
            keyed.setdefault(finding.key, []).append(finding)
        return keyed

    def render(self, limit: int | None = None) -> str:
        """A plain-text table: one line per finding (the first ``limit``), grouped by observer and kind; then
        the counts."""
        c = self.counts
        verdict = "OK" if self.ok else "FAILED"
        lines = [f"history {verdict}: {c.lost} lost, {c.duplicated} duplicated, {c.reordered} reordered, "
                 f"{c.divergent} divergent; {c.unexpected} unexpected"]
        if self.findings:
            lines.append("")
            lines += _table(("observer", "kind", "key", "event", "detail"),
                            [(f.observer, f.kind.value, f.key, ", ".join(map(str, f.event_ids)) or "-", f.detail)
                             for f in self.findings[:limit]])
            if limit is not None and len(self.findings) > limit:
                lines.append(f"… and {len(self.findings) - limit} more findings")
        lines.append("")
        names = ("applied", "expected", "lost", "duplicated", "reordered", "unexpected", "ignored", "superseded",
                 "unacked missing")
        lines += _table(("observer",) + names,
                        [(name, *(str(n) for n in (o.applied, o.expected, o.lost, o.duplicated, o.reordered,
                                                   o.unexpected, o.ignored, o.superseded, o.unacknowledged_missing)))
                         for name, o in c.observers.items()],
                        right_aligned=range(1, len(names) + 1))
        lines.append("")
        lines.append(f"issued {c.issued}, acknowledged {c.acknowledged}; "
                     f"final state: {c.divergent} divergent of {c.final_keys} keys")
        return "\n".join(lines)


def supersedes(winner: VersionTag, loser: VersionTag) -> bool:
    """Whether an entry at ``winner`` is later in the key's history than an event at ``loser``.

    The later timestamp wins (a site never moves a key's timestamp back, and a
    remote event applies only with a later one, or on a tie by Geode's rule);
    on equal timestamps, from the same distributed system the newer entry
    version, otherwise the higher dsid.  Unlike Geode's rule at the moment of
    application (``region.conflicts.remote_wins``), entry versions are not
    compared across other timestamps: between two writes of one site, the
    other site's events may have reset the entry version to its own count.
    Written here rather than imported, so the checker does not trust the code
    it checks; a unit test holds it to ``remote_wins`` where the two must agree.
    """
    if winner.timestamp != loser.timestamp:
        return winner.timestamp > loser.timestamp
    if winner.dsid == loser.dsid:
        return winner.entry_version > loser.entry_version
    return winner.dsid > loser.dsid


def ignore_nothing(applied: Applied) -> bool:
    return False


def ignore_region_operations(applied: Applied) -> bool:
    """Region clear and destroy: one tombstone per entry, under an EventID no writer issued."""
    return applied.operation in REGION_OPERATIONS


def check(issued: Iterable[Issued], observers: Sequence[Observer],
          final_states: Mapping[str, Mapping[str, State]] | None = None,
          ignore: Callable[[Applied], bool] = ignore_nothing) -> Report:
    """Judge a run: every lost, duplicated, reordered and unexpected operation per observer, by key,
    and every key whose final state differs between sites.

    ``ignore`` sees only applied records nobody issued; the ones it accepts are
    counted, not reported.  They still count as duplicates when applied twice.
    """
    names = [o.name for o in observers]
    if len(set(names)) != len(names):
        raise ValueError(f"observer names must be unique: {names}")
    log = _Log(issued)
    walks = [_walk(o, log, ignore) for o in observers]
    findings: list[Finding] = []
    counts: dict[str, ObserverCounts] = {}
    for walk in walks:
        lost, superseded, unacknowledged_missing = _missing(walk, walks, log)
        findings += lost
        findings += walk.duplicated
        findings += walk.reordered
        findings += walk.unexpected
        counts[walk.observer.name] = ObserverCounts(
            applied=len(walk.observer.applied), expected=sum(walk.expected), lost=len(lost),
            duplicated=len(walk.duplicated), reordered=len(walk.reordered), unexpected=len(walk.unexpected),
            ignored=walk.ignored, superseded=superseded, unacknowledged_missing=unacknowledged_missing)
    divergent, final_keys = _diverge(final_states or {})
    findings += divergent
    return Report(findings=tuple(findings),
                  counts=Counts(issued=len(log.ops), acknowledged=sum(op.acknowledged for op in log.ops),
                                observers=counts, final_keys=final_keys, divergent=len(divergent)))


# --- the steps -------------------------------------------------------------------------------
#
# Speed: an applied record costs one dict lookup, by a flat (key, member,
# thread, sequence) tuple, which hashes in C where an EventID's dataclass hash
# runs Python.  The lookup gives the operation's number in the log; everything
# else about the operation (expected here? applied where? which stream?) is a
# list indexed by that number.


def _flat(key: str, event_id: EventID) -> _Flat:
    return (key, event_id.member_id, event_id.thread_id, event_id.sequence_id)


class _Log:
    """The writers' log: each (key, EventID) numbered once, its retries merged
    (acknowledged when any attempt was); and each (key, stream) numbered too."""

    __slots__ = ("ops", "number", "lane", "lanes", "_keys_by_event")

    def __init__(self, issued: Iterable[Issued]) -> None:
        self.ops: list[Issued] = []
        self.number: dict[_Flat, int] = {}
        #: op number → number of its (key, member, thread).
        self.lane: list[int] = []
        lanes: dict[tuple[str, str, int], int] = {}
        for op in issued:
            n = self.number.setdefault(_flat(op.key, op.event_id), len(self.ops))
            if n == len(self.ops):
                self.ops.append(op)
                self.lane.append(lanes.setdefault((op.key, op.event_id.member_id, op.event_id.thread_id),
                                                  len(lanes)))
                continue
            known = self.ops[n]
            if (known.site, known.kind) != (op.site, op.kind) or known.value != op.value:
                raise InconsistentHistory(op.key, op.event_id,
                                          f"issued as {known.kind} {known.value!r} at {known.site} "
                                          f"and as {op.kind} {op.value!r} at {op.site}")
            if op.acknowledged and not known.acknowledged:
                self.ops[n] = op
        self.lanes = len(lanes)
        self._keys_by_event: dict[EventID, str] | None = None

    def key_of(self, event_id: EventID) -> str | None:
        """A key this EventID was issued for (indexed on first use: only unexpected records ask)."""
        if self._keys_by_event is None:
            self._keys_by_event = {op.event_id: op.key for op in reversed(self.ops)}
        return self._keys_by_event.get(event_id)


class _Walk:
    """One observer's applied list, indexed by one pass, and what that pass found."""

    __slots__ = ("observer", "expected", "first", "first_unissued", "last", "duplicated", "reordered",
                 "unexpected", "ignored")

    def __init__(self, observer: Observer, log: _Log) -> None:
        self.observer = observer
        #: op number → whether the observer should see it.
        self.expected = [observer.expects(op) for op in log.ops]
        #: op number → position of its first application, or -1.
        self.first = [-1] * len(log.ops)
        #: The same for records nobody issued, by (key, EventID).
        self.first_unissued: dict[tuple[str, EventID], int] = {}
        #: key → the last record applied on it.
        self.last: dict[str, Applied] = {}
        self.duplicated: list[Finding] = []
        self.reordered: list[Finding] = []
        self.unexpected: list[Finding] = []
        self.ignored = 0

    def version(self, log: _Log, key: str, event_id: EventID) -> VersionTag | None:
        """The version tag this observer recorded for (key, event_id), if it applied it."""
        n = log.number.get(_flat(key, event_id))
        position = self.first_unissued.get((key, event_id), -1) if n is None else self.first[n]
        return None if position < 0 else self.observer.applied[position].version


def _walk(observer: Observer, log: _Log, ignore: Callable[[Applied], bool]) -> _Walk:
    walk = _Walk(observer, log)
    name = observer.name
    number, lane_of, ops = log.number, log.lane, log.ops
    expected, first, last = walk.expected, walk.first, walk.last
    repeats: dict[int, list[int]] = {}  # op number → positions applied
    repeats_unissued: dict[tuple[str, EventID], list[int]] = {}
    # lane number → the op applied so far with the highest sequence id, or -1.
    highest = [-1] * log.lanes
    for position, applied in enumerate(observer.applied):
        key, event_id = applied.key, applied.event_id
        last[key] = applied
        n = number.get((key, event_id.member_id, event_id.thread_id, event_id.sequence_id))  # _flat, inlined
        if n is None:
            _unissued(walk, log, ignore, repeats_unissued, position, applied)
            continue
        if first[n] >= 0:
            repeats.setdefault(n, [first[n]]).append(position)
            continue
        first[n] = position
        if not expected[n]:
            op = ops[n]
            walk.unexpected.append(Finding(Kind.UNEXPECTED, name, key, (event_id,),
                                           f"{op.kind} at {position}, issued at {op.site}, "
                                           f"outside this observer's scope"))
        lane = lane_of[n]
        top = highest[lane]
        if top < 0 or ops[top].event_id.sequence_id < event_id.sequence_id:
            highest[lane] = n
        else:
            ahead = ops[top].event_id
            walk.reordered.append(Finding(Kind.REORDERED, name, key, (event_id, ahead),
                                          f"applied at {position}, after {ahead} (applied at {first[top]})"))
    twice = [(positions, ops[n].key, ops[n].event_id) for n, positions in repeats.items()]
    twice += [(positions, key, event_id) for (key, event_id), positions in repeats_unissued.items()]
    for positions, key, event_id in sorted(twice, key=lambda t: t[0]):
        walk.duplicated.append(Finding(Kind.DUPLICATED, name, key, (event_id,),
                                       f"applied {len(positions)} times, at {', '.join(map(str, positions))}"))
    return walk


def _unissued(walk: _Walk, log: _Log, ignore: Callable[[Applied], bool],
              repeats: dict[tuple[str, EventID], list[int]], position: int, applied: Applied) -> None:
    """A record no writer issued: a duplicate, ignored, or unexpected."""
    ident = (applied.key, applied.event_id)
    first = walk.first_unissued.setdefault(ident, position)
    if first != position:
        repeats.setdefault(ident, [first]).append(position)
        return
    if ignore(applied):
        walk.ignored += 1
        return
    what = applied.operation.value if applied.operation is not None else "operation"
    detail = f"{what} at {position}, issued by no writer"
    elsewhere = log.key_of(applied.event_id)
    if elsewhere is not None:
        detail += f" (its EventID was issued for key {elsewhere!r})"
    walk.unexpected.append(Finding(Kind.UNEXPECTED, walk.observer.name, applied.key, (applied.event_id,), detail))


def _missing(walk: _Walk, walks: list[_Walk], log: _Log) -> tuple[list[Finding], int, int]:
    """The observer's lost findings, and how many missing operations were superseded or may never have happened."""
    lost: list[Finding] = []
    superseded = unacknowledged_missing = 0
    name = walk.observer.name
    for n, op in enumerate(log.ops):
        if not walk.expected[n] or walk.first[n] >= 0:
            continue
        witnesses = [w for w in walks if w.first[n] >= 0]
        if not witnesses:
            if op.acknowledged:
                lost.append(Finding(Kind.LOST, name, op.key, (op.event_id,),
                                    f"acknowledged {op.kind} at {op.site}, applied by no observer"))
            else:
                unacknowledged_missing += 1
            continue
        why = "acknowledged" if op.acknowledged else "not acknowledged"
        detail = f"{op.kind} at {op.site}, {why}, applied by {witnesses[0].observer.name} but not here"
        if walk.observer.may_skip_superseded:
            missing_version = _version(walks, log, op.key, op.event_id)
            last = walk.last.get(op.key)
            last_version = None if last is None else last.version or _version(walks, log, last.key, last.event_id)
            if last is None:
                detail += "; nothing applied on the key"
            elif missing_version is None or last_version is None:
                detail += f"; cannot tell whether {last.event_id} supersedes it: no version tag known"
            elif supersedes(last_version, missing_version):
                superseded += 1
                continue
            else:
                detail += (f"; last applied {last.event_id} [{_tag(last_version)}] does not supersede "
                           f"[{_tag(missing_version)}]")
        lost.append(Finding(Kind.LOST, name, op.key, (op.event_id,), detail))
    return lost, superseded, unacknowledged_missing


def _version(walks: list[_Walk], log: _Log, key: str, event_id: EventID) -> VersionTag | None:
    """The version tag any observer recorded for (key, event_id); the first observer listed wins."""
    return next((v for w in walks if (v := w.version(log, key, event_id)) is not None), None)


def _diverge(final_states: Mapping[str, Mapping[str, State]]) -> tuple[list[Finding], int]:
    """Keys whose (value, version) is not the same at every site (absent counts as a state)."""
    sites = list(final_states)
    keys: set[str] = set()
    for states in final_states.values():
        keys.update(states)
    if len(sites) < 2:
        return [], len(keys)
    findings = []
    for key in sorted(keys):
        sides = tuple((site, final_states[site].get(key)) for site in sites)
        reference = sides[0][1]
        if any(state != reference for _, state in sides[1:]):
            detail = "; ".join(f"{site}: {_state(state)}" for site, state in sides)
            findings.append(Finding(Kind.DIVERGENT, FINAL_STATE, key, (), detail, sides))
    return findings, len(keys)
# --- text ------------------------------------------------------------------------------------


def _tag(v: VersionTag) -> str:
    return f"dsid {v.dsid} ts {v.timestamp} v{v.entry_version}"


def _state(state: State) -> str:
    if state is None:
        return "absent"
    value, version = state
    return f"{value!r} [{_tag(version)}]"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], right_aligned: Iterable[int] = ()) -> list[str]:
    """Columns padded to their widest cell; a last column aligned left is not padded."""
    right = set(right_aligned)
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        if len(header) - 1 not in right:
            cells[-1] = row[-1]
        return "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


__all__ = ["Applied", "Counts", "FAILING", "FINAL_STATE", "Finding", "ISSUED_KINDS", "InconsistentHistory", "Issued",
           "Kind", "Observer", "ObserverCounts", "Report", "State", "check", "ignore_nothing",
           "ignore_region_operations", "supersedes"]
