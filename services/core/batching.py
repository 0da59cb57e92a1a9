"""Batch assembly for one queue partition: no I/O, no clock (callers pass ``now_ms``).

The story of a partition's events, step by step:

1. ``add`` appends an event read from the queue to the batch being assembled
   (``extend`` appends a run of them at once where ``add`` would read nothing
   of an event but its offset and size).
   With conflation on, an update of a key replaces an earlier *update* of the
   same key still waiting in that batch (Geode's batch conflation); creates,
   destroys and everything else are never conflated away, and an update never
   replaces a create.  The replaced event's offset is still covered by the
   batch, so its removal removes both.  An event that cannot tell what the
   batcher asks of it (an undecodable body) is refused by ``add`` before
   anything changes; the caller ``skip``s its offset.
2. ``take`` hands out the assembled batch when it is ready: ``batch_size``
   events are waiting, or ``batch_time_interval_ms`` has passed since the
   first of them, whichever comes first (or at once with ``force``, used for
   a flush).  Records that could not be read (dead-lettered) still advance
   the batch's offsets, so a batch may carry no event at all.
3. At most ``max_in_flight`` batches are out at once (1 for an async event
   queue's listener; a gateway sender may have several batches waiting for
   their acks).  An out batch that is refused is handed out again as the
   very same object (``redeliveries`` counts), together with every batch out
   after it, and batches are accepted strictly in order: ``accepted``
   removes the oldest and returns the offset to commit (its last + 1).
   Events its offer found undecodable leave an out batch (``Batch.drop``);
   its offsets stay covered.
4. A clean start of the queue (``drop_below``) forgets what lies below the
   new head, out or assembling, and keeps assembling what lies at or after it.

Back-pressure is the caller's: ``buffered_bytes`` tells how much is held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class QueueItem(Protocol):
    """What the batcher needs of an event."""

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> str: ...

    @property
    def conflatable(self) -> bool:
        """True for updates: they may replace an earlier update of the key."""
        ...

    @property
    def size_bytes(self) -> int: ...


T = TypeVar("T", bound=QueueItem)


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    batch_size: int = 100
    batch_time_interval_ms: int = 5
    conflation: bool = False
    #: How many batches may be out (handed out, not yet accepted) at once.
    max_in_flight: int = 1
    #: Keep the events of one transaction (put_all / remove_all) in one batch.
    group_transactions: bool = False
    transaction_hold_ms: int = 2000

    @property
    def appends_only(self) -> bool:
        """``add`` reads nothing of an event but its offset and size (no conflation, no transaction
        grouping): it refuses none, so events may join a batcher in runs (``PartitionBatcher.extend``)."""
        return not (self.conflation or self.group_transactions)


@dataclass(slots=True)
class Batch(Generic[T]):
    """A batch handed to the listener; the same object is offered again on failure."""

    partition: int
    batch_id: int
    events: list[T]
    first_offset: int
    #: The offset to commit once the batch is accepted: every record below it
    #: is in this batch, in an earlier one, conflated away or dead-lettered.
    commit_offset: int
    conflated: int = 0
    redeliveries: int = 0
    nbytes: int = 0

    @property
    def last_offset(self) -> int:
        return self.commit_offset - 1

    def drop(self, items: list[T]) -> None:
        """Leave ``items`` out of the batch from now on (the offering worker dead-lettered them,
        durably): its offers go on without them, and its removal still covers their offsets."""
        gone = {id(item) for item in items}
        kept = [e for e in self.events if id(e) not in gone]
        self.nbytes -= sum(e.size_bytes for e in self.events if id(e) in gone)
        self.events = kept  # one reference swap: the loop thread may be reading the old list


@dataclass(slots=True)
class _Assembling(Generic[T]):
    """Events waiting for a batch.  ``head`` is where the next batch starts,
    so cutting a batch off a long backlog costs the batch, not the backlog."""

    events: list[T] = field(default_factory=list)
    #: Offset of the event first appended at each index (a conflated
    #: replacement keeps the index but has a higher offset).
    first_offsets: list[int] = field(default_factory=list)
    #: ``size_bytes`` of the event at each index, so cutting a batch sums ints, not properties.
    sizes: list[int] = field(default_factory=list)
    head: int = 0
    by_key: dict[str, int] = field(default_factory=dict)  # key -> index of its conflatable event
    first_offset: int = -1
    last_offset: int = -1
    first_added_ms: int = -1
    conflated: int = 0
    nbytes: int = 0

    def covers_anything(self) -> bool:
        return self.last_offset >= 0

    @property
    def waiting(self) -> int:
        return len(self.events) - self.head


class PartitionBatcher(Generic[T]):
    """Assembles and offers the batches of one queue partition, in order."""

    def __init__(self, partition: int, policy: BatchPolicy, next_batch_id: int = 0) -> None:
        self.partition = partition
        self.policy = policy
        self.next_batch_id = next_batch_id
        #: Batches handed out and not yet accepted, oldest first.
        self.out: list[Batch[T]] = []
        self._assembling: _Assembling[T] = _Assembling()
        self.events_conflated = 0
        self.batches_accepted = 0
        #: The commit offset of the last batch accepted (-1: none yet).
        self._accepted_end = -1
        self.redeliveries = 0

    # --- input -------------------------------------------------------------

    def add(self, item: T, now_ms: int) -> None:
        """Append ``item`` (conflating it when the policy says so).

        Everything the batcher will ever ask of the item (its size; with
        conflation its key and whether it is conflatable; with grouped
        transactions its transaction) is read first, before anything
        changes: an item that cannot say (an event whose body turns out
        undecodable) raises here and is refused whole, and the caller may
        ``skip`` its offset instead."""
        policy = self.policy
        size = item.size_bytes
        if policy.conflation:
            key = item.key
            conflatable = item.conflatable
        if policy.group_transactions:
            getattr(item, "transaction", None)  # take() reads it later, from the loop
        offset = item.offset
        a = self._assembling
        if a.first_offset < 0:
            a.first_offset = offset
        if offset > a.last_offset:
            a.last_offset = offset
        if a.first_added_ms < 0:
            a.first_added_ms = now_ms
        a.nbytes += size
        if policy.conflation:
            if conflatable:
                index = a.by_key.get(key)
                if index is not None and index >= a.head:
                    a.nbytes -= a.sizes[index]
                    a.events[index] = item
                    a.sizes[index] = size
                    a.conflated += 1
                    self.events_conflated += 1
                    return
                a.by_key[key] = len(a.events)
            else:
                # A create or destroy ends the run of updates it could replace.
                a.by_key.pop(key, None)
        a.events.append(item)
        a.first_offsets.append(offset)
        a.sizes.append(size)

    def extend(self, items: list[T], now_ms: int) -> None:
        """``add`` of each of ``items`` in turn, their offsets increasing, for a policy that
        ``appends_only`` (issue 18: one call per run of a poll's records, not one per record).
        With any other policy each item is ``add``-ed, and the first an ``add`` refuses raises
        with those before it added: the caller adds them one by one when it must know which."""
        policy = self.policy
        if not policy.appends_only:
            for item in items:
                self.add(item, now_ms)
            return
        if not items:
            return
        offsets = [item.offset for item in items]
        sizes = [item.size_bytes for item in items]
        a = self._assembling
        if a.first_offset < 0:
            a.first_offset = offsets[0]
        if offsets[-1] > a.last_offset:
            a.last_offset = offsets[-1]
        if a.first_added_ms < 0:
            a.first_added_ms = now_ms
        a.nbytes += sum(sizes)
        a.events += items
        a.first_offsets += offsets
        a.sizes += sizes

    def skip(self, offset: int, now_ms: int) -> None:
        """A record that could not be read (it went to the dead-letter topic)."""
        self._cover(offset, now_ms)

    def _cover(self, offset: int, now_ms: int) -> None:
        a = self._assembling
        if a.first_offset < 0:
            a.first_offset = offset
        a.last_offset = max(a.last_offset, offset)
        if a.first_added_ms < 0:
            a.first_added_ms = now_ms

    # --- output --------------------------------------------------------------

    @property
    def offered(self) -> Batch[T] | None:
        """The oldest batch out, if any."""
        return self.out[0] if self.out else None

    @property
    def full(self) -> bool:
        """``max_in_flight`` batches are out: nothing more is handed out."""
        return len(self.out) >= self.policy.max_in_flight

    @property
    def waiting(self) -> int:
        """Events assembled but not yet handed out."""
        return self._assembling.waiting

    @property
    def unaccepted(self) -> int:
        """Events not yet accepted: those waiting, and those in the batches out."""
        return self._assembling.waiting + sum(len(b.events) for b in self.out)

    @property
    def covered_end(self) -> int:
        """The offset after the last one anything covers (an accepted batch, a batch out, the
        batch assembling); -1 when nothing was ever added or skipped."""
        a = self._assembling
        if a.covers_anything():
            return a.last_offset + 1
        if self.out:
            return self.out[-1].commit_offset
        return self._accepted_end

    def oldest(self) -> T | None:
        """The oldest event not yet accepted: in the batches out, else the first one waiting."""
        for batch in self.out:
            if batch.events:
                return batch.events[0]
        a = self._assembling
        return a.events[a.head] if a.waiting else None

    @property
    def buffered_bytes(self) -> int:
        return self._assembling.nbytes + sum(b.nbytes for b in self.out)

    def due_in_ms(self, now_ms: int) -> int | None:
        """Milliseconds until the assembling batch is due by time (None: nothing waits)."""
        a = self._assembling
        if not a.covers_anything() or self.full:
            return None
        return max(0, a.first_added_ms + self.policy.batch_time_interval_ms - now_ms)

    def ready(self, now_ms: int) -> bool:
        a = self._assembling
        if self.full or not a.covers_anything():
            return False
        if a.waiting >= self.policy.batch_size:
            return True
        return now_ms - a.first_added_ms >= self.policy.batch_time_interval_ms

    def take(self, now_ms: int, force: bool = False) -> Batch[T] | None:
        """The next batch, when ready (or when anything waits, with ``force``)."""
        if self.full:
            return None
        a = self._assembling
        if not a.covers_anything() or not (force or self.ready(now_ms)):
            return None
        stop = a.head + min(self.policy.batch_size, a.waiting)
        if self.policy.group_transactions and stop > a.head:
            stop = self._transaction_boundary(stop, now_ms, force)
            if stop is None:
                return None
        if stop < len(a.events):
            # More than a batch waits (a burst while a batch was out): hand
            # out the next batch_size events and keep the rest assembling.
            # Every event still waiting has an offset at or above the one
            # first appended at its index, and those increase with the index,
            # so the commit stops at the first waiting index's first offset.
            start = a.head
            events = a.events[start:stop]
            nbytes = sum(a.sizes[start:stop])
            commit = a.first_offsets[stop]
            batch = Batch(self.partition, self.next_batch_id, events, a.first_offset, commit, a.conflated, 0, nbytes)
            a.head = stop
            a.first_offset = commit
            a.conflated = 0
            a.nbytes -= nbytes
            if a.head > 4096 and a.head * 2 > len(a.events):
                self._compact()
        else:
            events = a.events[a.head:] if a.head else a.events
            batch = Batch(self.partition, self.next_batch_id, events, a.first_offset, a.last_offset + 1,
                          a.conflated, 0, a.nbytes)
            self._assembling = _Assembling()
        self.next_batch_id += 1
        self.out.append(batch)
        return batch

    def _transaction_boundary(self, stop: int, now_ms: int, force: bool) -> int | None:
        """Where a batch ending before ``stop`` may end without splitting the
        events of one transaction (group-transaction-events): stretched past
        batch_size to the transaction's last event when it is here, else cut
        before the transaction; None when the batch would be nothing but an
        incomplete transaction, held until its last event arrives (at most
        ``transaction_hold_ms``: a writer that died mid-way must not stall the
        queue)."""
        a = self._assembling
        events = a.events
        tx = getattr(events[stop - 1], "transaction", None)
        if tx is None or tx[1]:
            return stop
        while stop < len(events):
            nxt = getattr(events[stop], "transaction", None)
            if nxt is None or nxt[0] != tx[0]:
                return stop  # the transaction ended without its flagged last event: do not wait
            stop += 1
            if nxt[1]:
                return stop
        start = stop - 1
        while start > a.head and (getattr(events[start - 1], "transaction", None) or ("",))[0] == tx[0]:
            start -= 1
        if start > a.head:
            return start
        if force or now_ms - a.first_added_ms >= self.policy.transaction_hold_ms:
            return stop
        return None

    def _compact(self) -> None:
        """Drop the handed-out front of the backlog (amortized: rare, linear)."""
        a = self._assembling
        head = a.head
        a.events = a.events[head:]
        a.first_offsets = a.first_offsets[head:]
        a.sizes = a.sizes[head:]
        a.by_key = {k: i - head for k, i in a.by_key.items() if i >= head}
        a.head = 0

    def rejected(self) -> Batch[T]:
        """The oldest batch out was refused: it and every batch out after it
        stay out, to be handed out again in order.  Returns the oldest."""
        assert self.out, "no batch is out"
        for batch in self.out:
            batch.redeliveries += 1
        self.redeliveries += 1
        return self.out[0]

    def drop_below(self, offset: int, now_ms: int) -> int:
        """A clean of the queue (core/queueclean.py): forget every event below ``offset``, in the batches
        out and assembling, and start the partition there.  The events at or above it assemble again,
        in offset order (conflated as they were); batch ids go on.  Returns how many events were
        forgotten."""
        a = self._assembling
        held = [e for batch in self.out for e in batch.events] + a.events[a.head:]
        kept = sorted((e for e in held if e.offset >= offset), key=lambda e: e.offset)
        self.out = []
        self._assembling = _Assembling()
        self._accepted_end = max(self._accepted_end, offset)
        for item in kept:
            self.add(item, now_ms)
        return len(held) - len(kept)

    def accepted(self) -> int:
        """The oldest batch out was accepted: the offset to commit."""
        assert self.out, "no batch is out"
        batch = self.out.pop(0)
        self.batches_accepted += 1
        self._accepted_end = batch.commit_offset
        return batch.commit_offset
