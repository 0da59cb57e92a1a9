"""Bucket ownership of one region instance as a pure protocol: group events and load facts in, actions out.

``RegionOwnership`` holds what an instance knows of the buckets it owns (one
``OwnedBucket`` each), the revoked buckets it keeps (``Parked``), the group
generation its windows commit under, and the epochs that name each ownership.
It never touches Kafka, a thread or a clock (``now_ms`` and waits are passed
in).  The engine (engine.py) calls it under its lock, performs the actions it
answers and feeds the outcomes back, in the manner of etcd raft's
``Ready``/``Advance``:

1. ``assign(keys, now_ms, membership, standbys)``: the group gave this member
   buckets (cooperative: only those added).  Each gets a new epoch and starts
   LOADING; the answer is an ``OfferStandby`` per kept bucket this assignment
   did not give back (the start of a standby copy), ``PublishClaims`` when the
   owned buckets changed, and a ``Load`` per bucket.
2. The load of ``(region, bucket, epoch)`` reports what it finds:
   ``load_blocked(key, epoch, waited_s, fenced)`` while a transaction is open
   on the changelog (a ``Fence`` of the earlier owners, once per attempt, past
   ``fence_after_s``); ``resume_parked`` when the changelog did not move while
   the bucket was revoked (READY at once); else ``load_reading`` and
   ``load_progress`` as it reads, ``loaded`` with the state, checkpoint and end
   it read to, and ``answering`` once its re-enqueued records are committed
   (READY: requests are applied).  A fact for an epoch that has ended (the
   bucket went, or was reloaded) is dropped: an old ownership never answers.
3. Windows: ``stale(slots)`` names the slots of a closed window whose
   ownership ended (not written: their requests fail); ``window_committed``
   moves each bucket's end past its last record and notes the checkpoint
   committed; ``window_failed`` marks its buckets dirty, and
   ``bucket_failed(key, epoch)`` sends a READY bucket back to LOADING under a
   new epoch (another ``Load``).
4. ``revoking(keys, membership)``: the group takes buckets back.  They stop
   answering (REVOKING); the engine waits (bounded) for the windows holding
   their records, then ``revoked(keys, windows_committed)`` forgets them and
   answers a ``Park`` for each one READY, clean and fully committed (the
   engine reads its changelog's bounds and hands back ``park(key, parked)``).
5. ``lost(keys)``: the session expired and someone else owns them already:
   forgotten at once with nothing kept, and no generation to commit under
   (a window still holding their records is refused by the group coordinator).

Invariants, asserted where they can break (our own bugs, not bad input):
epochs only grow, for the instance and for each bucket; a load's position and
a bucket's end (where its changelog ends with everything its memory holds)
only move forward within an epoch; and the checkpoint a bucket commits never
moves backward while this member owns it (its tenure, across reloads: the
group refuses offset resets while the member is in it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.events import EventID
from .state import BucketState

if TYPE_CHECKING:
    from .fanout import Pending
    from .standby import StandbyCopy

#: (region, bucket)
BucketKey = tuple[str, int]
#: (region, bucket, epoch): one ownership of a bucket (fanout.Slot).
Slot = tuple[str, int, int]


class BucketStatus(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    REVOKING = "revoking"


@dataclass(slots=True)
class OwnedBucket:
    region: str
    bucket: int
    epoch: int
    status: BucketStatus = BucketStatus.LOADING
    state: BucketState | None = None
    #: The offset every window of this ownership commits for the bucket (fanout.py: from where the
    #: changelog is transactional), set by the load.
    checkpoint: int = -1
    inflight: dict[EventID, Pending] = field(default_factory=dict)
    # A server-assigned EventID stream (member = this instance, thread = bucket).
    next_sequence: int = 0
    since_ms: int = 0  # when this instance was assigned the bucket (its claim in the directory)
    #: A window holding its records failed: the memory may be ahead of the changelog.
    dirty: bool = False
    #: Where the bucket's changelog partition ends with everything the memory holds: the end the
    #: load read to, then after each committed window its last record's offset + 2 (the record,
    #: then the window's marker).  A partition that ends elsewhere holds what someone else wrote.
    end: int = -1
    #: The standby copy this instance kept of the bucket before it was assigned it (standby.py), until
    #: the load takes it.
    standby: StandbyCopy | None = None
    #: The load's progress: it reads offsets load_start..load_end and is at load_position (-1: not reading).
    load_start: int = -1
    load_position: int = -1
    load_end: int = -1
    load_began: float = 0.0
    #: Where the bucket's local store was last made clean (-1: not since it was loaded).
    stored_at: int = -1


@dataclass(frozen=True, slots=True)
class Parked:
    """A revoked bucket's state, kept for the assignment that follows the revocation.

    A bucket revoked from this member can come back to it (a member that joined
    leaves again), or become one of its standby copies (standby.py).  A bucket is
    kept only when its changelog partition
    ends where this member's own last write left it (``OwnedBucket.end``: nobody
    else appended to it while it was owned here), and it is not read again when
    the partition is exactly as it was at the revocation: the same low offset and end
    (the high watermark counts every record and marker, so a write by anyone,
    committed or aborted, moves it), no transaction open, and the same committed
    checkpoint.  Anything else, and the bucket loads from the changelog.
    """

    state: BucketState
    checkpoint: int
    next_sequence: int
    low: int
    high: int

    def still_current(self, low: int, high: int, committed: int, transactional: bool) -> bool:
        """Whether the changelog partition, decided at (low, high) with ``committed``, is as it was."""
        return transactional and (low, high, committed) == (self.low, self.high, self.checkpoint)


# --- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """Load the bucket for ``epoch`` (from its changelog, a standby copy, the local store, or kept)."""

    region: str
    bucket: int
    epoch: int


@dataclass(frozen=True, slots=True)
class OfferStandby:
    """A kept bucket the group did not give back: the start of a standby copy, current to ``high``."""

    region: str
    bucket: int
    state: BucketState
    high: int


@dataclass(frozen=True, slots=True)
class PublishClaims:
    """The owned buckets changed: publish (region, bucket, since_ms) of each to the owner directory."""

    claims: list[tuple[str, int, int]]


@dataclass(frozen=True, slots=True)
class Park:
    """A revoked bucket whose every window is committed: read its changelog's bounds once its last
    markers land, and ``park`` its state if the changelog ends at ``ob.end``."""

    ob: OwnedBucket


@dataclass(frozen=True, slots=True)
class Fence:
    """A load blocked by an open transaction: fence the earlier owners of the bucket the directory
    shows gone (a claim not renewed since ``since_ms``, when this member was assigned it)."""

    region: str
    bucket: int
    since_ms: int


Action = Load | OfferStandby | PublishClaims | Park | Fence


@dataclass(slots=True)
class RegionOwnership:
    """The decisions of one region instance over the buckets it owns (module docstring)."""

    #: How long a load waits on an open transaction before it fences the earlier owners.
    fence_after_s: float
    owned: dict[BucketKey, OwnedBucket] = field(default_factory=dict)
    #: Revoked buckets' state, until the assignment after the revocation (``Parked``).
    parked: dict[BucketKey, Parked] = field(default_factory=dict)
    #: The group metadata of the current generation (None: no generation to commit under).
    membership: bytes | None = None
    #: The last epoch handed out (by this instance, to any bucket).
    epoch: int = 0
    #: The last epoch of each bucket ever owned here (epochs of a bucket only grow).
    epochs: dict[BucketKey, int] = field(default_factory=dict)
    #: The highest checkpoint committed for each bucket during this member's current tenure of it.
    committed: dict[BucketKey, int] = field(default_factory=dict)

    # --- reads ------------------------------------------------------------------------------------

    def current(self, region: str, bucket: int, epoch: int) -> OwnedBucket | None:
        """The bucket when it is still owned under ``epoch`` (None: that ownership ended)."""
        ob = self.owned.get((region, bucket))
        return ob if ob is not None and ob.epoch == epoch else None

    def claims(self) -> list[tuple[str, int, int]]:
        return [(ob.region, ob.bucket, ob.since_ms) for ob in self.owned.values()]

    def stale(self, slots: object) -> set[Slot]:
        """Step 3: the slots of a window whose ownership has ended (lost, revoked, reloaded)."""
        return {slot for slot in slots if self.current(*slot) is None}  # type: ignore[misc, union-attr]

    # --- the group (steps 1, 4, 5) -----------------------------------------------------------------

    def assign(self, keys: list[BucketKey], now_ms: int, membership: bytes | None,
               standbys: dict[BucketKey, StandbyCopy | None] | None = None) -> list[Action]:
        """Step 1: the group gave this member ``keys`` in the generation ``membership``; ``standbys``
        the standby copy this instance kept of each (taken from the keeper)."""
        self.membership = membership
        assigned = set(keys)
        actions: list[Action] = []
        for key in list(self.parked):
            if key not in assigned:
                parked = self.parked.pop(key)
                actions.append(OfferStandby(key[0], key[1], parked.state, parked.high))
        loads: list[Action] = []
        for region, bucket in keys:
            key = (region, bucket)
            if key not in self.owned:
                self.committed.pop(key, None)  # a new tenure
            epoch = self._next_epoch(key)
            self.owned[key] = OwnedBucket(region, bucket, epoch, since_ms=now_ms,
                                          standby=None if standbys is None else standbys.get(key))
            loads.append(Load(region, bucket, epoch))
        if loads:
            # The claims go out before the loads begin (a load may ask the directory for earlier owners).
            actions.append(PublishClaims(self.claims()))
        return actions + loads

    def revoking(self, keys: list[BucketKey], membership: bytes | None) -> set[BucketKey]:
        """Step 4: the group takes ``keys`` back, in the generation ``membership`` (the buckets that
        stay are this member's in it too).  They stop answering; answers those that were READY."""
        self.membership = membership
        ready = set()
        for key in keys:
            ob = self.owned.get(key)
            if ob is not None:
                if ob.status is BucketStatus.READY:
                    ready.add(key)
                ob.status = BucketStatus.REVOKING
        return ready

    def revoked(self, keys: list[BucketKey], ready: set[BucketKey], windows_committed: bool
                ) -> tuple[list[OwnedBucket], list[Action]]:
        """Step 4, once the windows holding their records are done (``windows_committed``: all of them
        committed): forget ``keys``; answers the buckets revoked and the actions (a ``Park`` for each
        one that was READY, clean and fully committed; ``PublishClaims``)."""
        revoked = []
        for key in keys:
            ob = self.owned.pop(key, None)
            self.committed.pop(key, None)
            if ob is not None:
                revoked.append(ob)
        if not self.owned:
            self.membership = None
        actions: list[Action] = [PublishClaims(self.claims())]
        if windows_committed:
            actions += [Park(ob) for ob in revoked
                        if (ob.region, ob.bucket) in ready and not ob.dirty and ob.state is not None]
        return revoked, actions

    def park(self, key: BucketKey, parked: Parked) -> None:
        """Step 4: a revoked bucket's state kept (the engine found its changelog as it left it)."""
        assert key not in self.owned, f"{key[0]}[{key[1]}] is parked while owned"
        self.parked[key] = parked

    def lost(self, keys: list[BucketKey]) -> list[Action]:
        """Step 5: someone else owns ``keys`` already: forget them, keep nothing."""
        self.parked.clear()
        for key in keys:
            self.owned.pop(key, None)
            self.committed.pop(key, None)
        # A lost member may be a zombie: whatever it still writes is refused by the group coordinator
        # (a stale generation) and aborted.
        self.membership = None
        return [PublishClaims(self.claims())]

    def left(self) -> None:
        """The member left the group (its consumer closed): no generation to commit under."""
        self.membership = None

    def _next_epoch(self, key: BucketKey) -> int:
        self.epoch += 1
        last = self.epochs.get(key, 0)
        assert self.epoch > last, f"{key[0]}[{key[1]}]: the epoch goes back from {last} to {self.epoch}"
        self.epochs[key] = self.epoch
        return self.epoch

    # --- loads (step 2) ----------------------------------------------------------------------------

    def load_blocked(self, region: str, bucket: int, epoch: int, waited_s: float, fenced: bool) -> Fence | None:
        """A transaction still open holds an attempt to load ``epoch`` for ``waited_s`` (``fenced``: it
        fenced already): a ``Fence`` once that passes ``fence_after_s``, once per attempt; None
        otherwise, or when the epoch ended."""
        ob = self.current(region, bucket, epoch)
        if ob is None or fenced or waited_s < self.fence_after_s:
            return None
        return Fence(region, bucket, ob.since_ms)

    def take_standby(self, region: str, bucket: int, epoch: int) -> tuple[bool, StandbyCopy | None]:
        """The load of ``epoch`` begins: whether it is still current, and the standby copy it may use
        (handed out once)."""
        ob = self.current(region, bucket, epoch)
        if ob is None:
            return False, None
        standby, ob.standby = ob.standby, None
        return True, standby

    def resume_parked(self, region: str, bucket: int, epoch: int, low: int, high: int, committed: int,
                      transactional: bool) -> tuple[bool, StandbyCopy | None] | None:
        """The load of ``epoch`` found the changelog decided at (low, high) with ``committed``: the
        bucket's kept state serves again when it is still current (READY at once: True), else the load
        reads (False, with the standby copy it may use).  None when the epoch ended."""
        parked = self.parked.pop((region, bucket), None)
        current, standby = self.take_standby(region, bucket, epoch)
        if not current:
            return None
        if parked is None or not parked.still_current(low, high, committed, transactional):
            return False, standby
        ob = self.owned[(region, bucket)]
        self._set_checkpoint(ob, parked.checkpoint)
        ob.state, ob.next_sequence = parked.state, parked.next_sequence
        ob.end = high
        ob.status = BucketStatus.READY
        return True, standby

    def load_reading(self, region: str, bucket: int, epoch: int, start: int, end: int, now: float) -> None:
        """The load of ``epoch`` reads offsets ``start..end`` from ``now`` (monotonic seconds)."""
        ob = self.current(region, bucket, epoch)
        if ob is not None:
            ob.load_start, ob.load_position, ob.load_end, ob.load_began = start, start, end, now

    def load_progress(self, region: str, bucket: int, epoch: int, position: int) -> None:
        """The load of ``epoch`` read up to ``position``."""
        ob = self.current(region, bucket, epoch)
        if ob is None:
            return
        assert position >= ob.load_position, (
            f"{region}[{bucket}]: the load moves back from {ob.load_position} to {position}")
        ob.load_position = position

    def loaded(self, region: str, bucket: int, epoch: int, state: BucketState, checkpoint: int, end: int,
               next_sequence: int) -> OwnedBucket | None:
        """The load of ``epoch`` read the changelog to ``end``: the state, the checkpoint its windows
        commit, this instance's next sequence.  Not READY yet (its re-enqueued records are written
        first: ``answering``).  None when the epoch ended."""
        ob = self.current(region, bucket, epoch)
        if ob is None:
            return None
        self._set_checkpoint(ob, checkpoint)
        ob.state = state
        ob.end = end
        ob.next_sequence = next_sequence
        return ob

    def answering(self, region: str, bucket: int, epoch: int, stored_at: int) -> bool:
        """The load of ``epoch`` is done (its local store clean at ``stored_at``): READY.  False when
        the epoch ended."""
        ob = self.current(region, bucket, epoch)
        if ob is None:
            return False
        assert ob.state is not None and ob.checkpoint >= 0, f"{region}[{bucket}] answers before it is loaded"
        ob.stored_at = stored_at
        ob.status = BucketStatus.READY
        return True

    def _set_checkpoint(self, ob: OwnedBucket, checkpoint: int) -> None:
        key = (ob.region, ob.bucket)
        last = self.committed.get(key, -1)
        assert checkpoint >= last, (
            f"{ob.region}[{ob.bucket}]: the checkpoint moves back from {last} to {checkpoint} while owned here")
        ob.checkpoint = checkpoint

    # --- windows (step 3) -------------------------------------------------------------------------

    def window_committed(self, checkpoints: dict[Slot, int], last_offsets: dict[Slot, int]) -> None:
        """A window committed ``checkpoints`` for its slots, and its records of each slot end at
        ``last_offsets``: each bucket's end moves past them (record, then marker)."""
        for slot, checkpoint in checkpoints.items():
            ob = self.current(*slot)
            if ob is None:
                continue
            key = (ob.region, ob.bucket)
            last = self.committed.get(key, -1)
            assert checkpoint >= last, (
                f"{ob.region}[{ob.bucket}]: a window commits {checkpoint}, below {last} committed before")
            self.committed[key] = checkpoint
        for slot, offset in last_offsets.items():
            ob = self.current(*slot)
            if ob is None:
                continue
            assert offset + 2 > ob.end, (
                f"{ob.region}[{ob.bucket}]: the end moves back from {ob.end} to {offset + 2}")
            ob.end = offset + 2

    def window_failed(self, slots: list[Slot]) -> None:
        """A window of ``slots`` failed: the memory of those still owned may be ahead of the changelog."""
        for slot in slots:
            ob = self.current(*slot)
            if ob is not None:
                ob.dirty = True

    def bucket_failed(self, region: str, bucket: int, epoch: int | None = None) -> Load | None:
        """A write of the bucket failed (``epoch``: only if still owned under it): a READY bucket
        loads again under a new epoch.  None when it is not READY, or that ownership ended."""
        ob = self.owned.get((region, bucket))
        if ob is None or ob.status is not BucketStatus.READY or (epoch is not None and ob.epoch != epoch):
            return None
        ob.epoch = self._next_epoch((region, bucket))
        ob.status = BucketStatus.LOADING
        ob.state = None
        return Load(region, bucket, ob.epoch)


__all__ = ["Action", "BucketKey", "BucketStatus", "Fence", "Load", "OfferStandby", "OwnedBucket", "Park", "Parked",
           "PublishClaims", "RegionOwnership", "Slot"]
