"""A subscription primary's decisions as a pure protocol: table records and assignments in, actions out.

``SubscriptionProtocol`` holds what one instance knows as the primary of its
registry partitions (the clients of those partitions, their interest in the
index, each partition's changelog positions, queue starts and the offsets
below which a refill is possibly a duplicate) and the fill checkpoints every
instance reads.  It never touches Kafka, a thread or a clock (``now_ms`` is
passed in); the service (service.py) reads the tables, performs the actions
and feeds the outcomes back, in the manner of etcd raft's ``Ready``/``Advance``.

1. ``take_checkpoint(record)``: a checkpoint read from the fill topic.  For a
   partition this instance is primary of, the table says nothing newer than
   what it wrote itself (it is that partition's only writer): its own records
   read back, or those of a primary that lost the partition and wrote late,
   are left out, so the positions a refill or a successor starts from never
   go back.
2. ``assign(gained, ends, registry)``: the group made this instance primary
   for registry partitions.  Each starts filling at its last checkpoint (or
   the changelogs' ends, for a partition never checkpointed); what lies below
   the ends now may have been filled by the previous primary and is flagged
   possibleDuplicate; its clients are taken on, with their interest.
3. ``rule(client, ack, now_ms)`` per client each turn: disconnected, silent
   longer than ``maximum-time-between-pings`` or away longer than its
   durable-client-timeout, the client is to be unregistered (an ``Unregister``
   with the reason); a durable client away keeps only its durable interest,
   and all of it once back.  ``answer_due``/``marker_due`` say when a
   registration's REGISTERED answer and the marker are to be written.
4. ``takers`` and ``deliveries``: which owned partitions a changelog record at
   ``offset`` is for, and which of the clients its interest reaches get it
   (not before their queue's start, never their own writes, one delivery per
   bucket of a region clear, possibleDuplicate below the refill mark, not past
   ``maximum-message-count``: counted, and the client unregistered next turn).
   ``advance`` moves the takers' positions past the record.
5. ``checkpoint(partitions, now_ms)``: the FillCheckpoint records to write
   (positions and queue starts); ``refill(partitions, ends)`` when a queue
   write failed: positions back to the last checkpoint, flagged below ``ends``.
6. ``revoking(partitions)``: the owned ones, to checkpoint a last time before
   the next primary starts; ``release(partitions)`` forgets them.  ``lost``
   forgets them with no last checkpoint: another instance may be primary
   already, and a checkpoint written now could move its successor back.

Invariants, asserted where they can break (our own bugs, not bad input): a
registry partition's checkpointed positions never go back, within one
primary and from one primary to the next; a changelog position only moves
forward except by a refill, which never goes below the last checkpoint; the
index holds the interest in force of exactly the clients taken on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..core.clientregistry import CLOSED, DURABLE_CLIENT_TIMEOUT, NO_PING, interest_of, last_heard, registry_partition
from ..core.interest import RegionInterest
from .index import InterestIndex

#: A changelog partition: (topic, partition).
Changelog = tuple[str, int]
#: A changelog position per changelog partition.
Positions = dict[Changelog, int]


@dataclass
class Client:
    """A client of one of this instance's registry partitions, as the primary tends it."""

    record: dict[str, Any]
    interest: dict[str, RegionInterest] = field(default_factory=dict)
    queue_ready: bool = False
    answered: tuple[str, int] | None = None  # (session, version) of the last REGISTERED written
    marked: str | None = None  # session whose marker is written
    away_since_ms: int | None = None  # durable client disconnected (or silent) since
    filled: int = 0
    #: (member, thread, sequence, bucket) of the last region clear or destroy part sent.
    last_clear: tuple[str, int, int, int] | None = None
    #: The bound of ``maximum-message-count``.  ``queue_end``: the end offset of the client's queue, read
    #: from the broker once (``end_known``) and then moved by each message this primary writes to it;
    #: ``acked``: the client's acknowledged position in it; ``room``: how many more events it takes before
    #: it holds maximum-message-count messages not acknowledged (unbounded while the end is not known).
    queue_end: int = 0
    end_known: bool = False
    acked: int = 0
    room: int = sys.maxsize
    #: Since when its queue is full, and how many events were not queued since (then it is unregistered).
    full_since_ms: int | None = None
    not_queued: int = 0

    partition: int = -1  # its registry partition

    @property
    def id(self) -> str:
        return self.record["client_id"]


@dataclass(frozen=True, slots=True)
class Unregister:
    """Action: unregister the client (tombstones, queue deleted); ``reason`` goes on the tombstone."""

    client: Client
    why: str
    reason: str
    #: Seconds a durable client was away, when its durable-client-timeout is why (an ALERT).
    timed_out_after_s: float | None = None


@dataclass
class SubscriptionProtocol:
    """The decisions of one subscription instance as primary (module docstring)."""

    member: str
    registry_partitions: int
    maximum_message_count: int
    maximum_time_between_pings_ms: int
    #: The service's counters (shared: the protocol counts takeovers, events not queued, stale checkpoints).
    stats: dict[str, int] = field(default_factory=dict)
    #: Fill checkpoints as the table holds them (every instance), and what this primary wrote.
    checkpoints: dict[int, Positions] = field(default_factory=dict)
    #: Per registry partition, the queues answered and the changelog offsets each takes events from
    #: (None: the checkpoint predates them).
    table_starts: dict[int, dict[str, Positions] | None] = field(default_factory=dict)
    owned: set[int] = field(default_factory=set)
    clients: dict[str, Client] = field(default_factory=dict)
    #: The interest in force of ``clients``, by region and key (``index.py``).
    index: InterestIndex = field(default_factory=InterestIndex)
    positions: dict[int, Positions] = field(default_factory=dict)  # next changelog offset, per owned partition
    duplicates_below: dict[int, Positions] = field(default_factory=dict)  # filled again after a takeover
    starts: dict[int, dict[str, Positions]] = field(default_factory=dict)  # queue starts, per owned partition
    #: Something changed that the clients' rules must see at the next turn.
    dirty: bool = False

    def __post_init__(self) -> None:
        for name in ("takeovers", "events_not_queued", "stale_checkpoints"):
            self.stats.setdefault(name, 0)

    # --- the fill table (step 1) -----------------------------------------------------------------

    def take_checkpoint(self, record: Mapping[str, Any]) -> bool:
        """A checkpoint read from the fill topic; False when left out (a partition this instance is
        primary of: it wrote its newest checkpoint itself)."""
        r = record["registry_partition"]
        if r in self.owned:
            if record["member"] != self.member:
                self.stats["stale_checkpoints"] += 1
            return False
        self.checkpoints[r] = positions_of(record["positions"])
        self.table_starts[r] = (None if record["queues"] is None else
                                {q["queue_topic"]: positions_of(q["positions"]) for q in record["queues"]})
        return True

    # --- ownership (steps 2 and 6) -----------------------------------------------------------------

    def assign(self, gained: Iterable[int], ends: Positions, registry: Mapping[str, dict[str, Any]]) -> set[int]:
        """This instance is primary for ``gained`` too; ``ends``: the changelogs' ends now.  Answers the
        partitions it was not primary for already."""
        new = set(gained) - self.owned
        for r in new:
            checkpoint = self.checkpoints.get(r, {})
            self.positions[r] = {tp: checkpoint.get(tp, end) for tp, end in ends.items()}
            self.duplicates_below[r] = dict(ends)
            self.starts[r] = dict(self.table_starts.get(r) or {})
            if r in self.checkpoints:
                self.stats["takeovers"] += 1  # a primary before this one checkpointed it
        self.owned |= new
        for client_id, record in registry.items():
            r = registry_partition(client_id, self.registry_partitions)
            if r in new:
                self.add_client(Client(record, partition=r))
                if r in self.table_starts and self.table_starts[r] is None:
                    # Answered by a release that did not record queue starts: the queue takes what
                    # is filled from the checkpoint on.
                    self.starts[r].setdefault(record["queue_topic"], {})
        if new:
            self.dirty = True  # the new clients are tended (queues, registrations) before anything is filled
        return new

    def revoking(self, partitions: Iterable[int]) -> set[int]:
        """The owned ones among ``partitions``: checkpointed a last time, then ``release``d."""
        return set(partitions) & self.owned

    def release(self, partitions: Iterable[int]) -> None:
        """Forget ``partitions`` and their clients."""
        gone = set(partitions) & self.owned
        self.owned -= gone
        for r in gone:
            self.positions.pop(r, None)
            self.duplicates_below.pop(r, None)
            self.starts.pop(r, None)
        for client_id in [c.id for c in self.clients.values() if c.partition not in self.owned]:
            self.drop_client(client_id)

    def lost(self, partitions: Iterable[int]) -> set[int]:
        """Someone else may be primary already: forget them with no last checkpoint."""
        gone = set(partitions) & self.owned
        self.release(gone)
        return gone

    # --- clients (step 3) ------------------------------------------------------------------------

    def add_client(self, client: Client) -> None:
        """A client of an owned partition, with the interest its record holds (answered or not: the
        queue's start keeps anything from it until it is answered)."""
        self.clients[client.id] = client
        self.set_interest(client, interest_of(client.record))

    def set_interest(self, client: Client, interest: dict[str, RegionInterest]) -> None:
        client.interest = interest
        self.index.put(client.id, interest)

    def drop_client(self, client_id: str) -> None:
        self.clients.pop(client_id, None)
        self.index.remove(client_id)

    def registration(self, partition: int, record: dict[str, Any]) -> None:
        """A registration of a client of an owned partition: taken on, or its record replaced."""
        self.dirty = True
        client = self.clients.get(record["client_id"])
        if client is None:
            self.add_client(Client(record, partition=partition))
            return
        if record["queue_topic"] != client.record["queue_topic"]:
            # A new queue (the client started over): its end is read before anything is written to it.
            client.end_known, client.acked, client.room = False, 0, sys.maxsize
            client.full_since_ms, client.not_queued = None, 0
        client.record = record

    def acked(self, client_id: str, record: Mapping[str, Any]) -> None:
        """A client's ack: room in its queue again."""
        client = self.clients.get(client_id)
        if client is not None and record["queue_topic"] == client.record["queue_topic"]:
            client.acked = record["next_offset"]
            self.reckon_room(client)

    def rule(self, client: Client, ack: Mapping[str, Any] | None, now_ms: int) -> Unregister | None:
        """The unregistration rules for a client whose queue exists and is not full."""
        record = client.record
        if not record["connected"]:
            if not (record["durable"] and record["keep_alive"]):
                return Unregister(client, "closed" if not record["durable"] else "closed without keep-alive",
                                  CLOSED)
            self.away(client, record["changed_at"])
        else:
            heard = last_heard(record, ack)
            silent_ms = now_ms - heard
            if silent_ms > self.maximum_time_between_pings_ms:
                if not record["durable"]:
                    return Unregister(client, f"no ping for {silent_ms / 1000:.1f} s", NO_PING)
                self.away(client, heard)
            elif client.away_since_ms is not None:
                client.away_since_ms = None
                self.set_interest(client, interest_of(record))
        if client.away_since_ms is not None:
            away_s = (now_ms - client.away_since_ms) / 1000
            if away_s > record["durable_timeout_s"]:
                return Unregister(client, "durable-client-timeout", DURABLE_CLIENT_TIMEOUT, away_s)
        return None

    def away(self, client: Client, since_ms: int) -> bool:
        """A durable client is away: it keeps only its durable interest.  True when it just went."""
        if client.away_since_ms is not None:
            return False
        client.away_since_ms = since_ms
        self.set_interest(client, interest_of(client.record, durable_only=True))
        return True

    def answer_due(self, client: Client) -> bool:
        record = client.record
        return record["connected"] and client.answered != (record["session"], record["version"])

    def answered(self, client: Client) -> None:
        """Its REGISTERED is written: the registration's interest is in force (unless it is away)."""
        record = client.record
        if client.away_since_ms is None:
            self.set_interest(client, interest_of(record))
        client.answered = (record["session"], record["version"])

    def marker_due(self, client: Client) -> bool:
        record = client.record
        return record["ready"] and record["connected"] and client.marked != record["session"]

    def queue_started(self, client: Client) -> bool:
        return client.record["queue_topic"] in self.starts[client.partition]

    def start_queue(self, client: Client) -> int:
        """Before a queue's first registration is answered: its events start where the fill is now.
        Answers the registry partition to checkpoint before the answer is written."""
        r = client.partition
        self.starts[r][client.record["queue_topic"]] = dict(self.positions[r])
        return r

    def start_failed(self, client: Client) -> None:
        """The checkpoint of the queue's start was not written: the start waits for the next turn."""
        del self.starts[client.partition][client.record["queue_topic"]]

    def reckon_room(self, client: Client) -> None:
        """How many more events the client's queue takes (``maximum-message-count`` minus the messages it
        holds that the client has not acknowledged)."""
        if client.end_known:
            client.room = self.maximum_message_count - (client.queue_end - min(client.acked, client.queue_end))

    def queue_end_read(self, client: Client, end: int, ack: Mapping[str, Any] | None) -> None:
        client.queue_end, client.end_known = end, True
        client.acked = ack["next_offset"] if ack is not None and ack["queue_topic"] == client.record["queue_topic"] \
            else 0
        self.reckon_room(client)

    def wrote_control(self, client: Client) -> None:
        """A registration's answer or a marker is written (always, a full queue included): it counts."""
        client.room -= 1
        client.queue_end += 1

    # --- filling (step 4) ------------------------------------------------------------------------

    def takers(self, tp: Changelog, offset: int) -> list[int]:
        """The owned registry partitions whose position the record at ``offset`` is at or past."""
        positions = self.positions
        return [r for r in self.owned if positions[r].get(tp, 0) <= offset]

    def advance(self, takers: list[int], tp: Changelog, offset: int) -> None:
        for r in takers:
            self.positions[r][tp] = offset + 1

    def deliveries(self, reached: Mapping[str, bool], takers: list[int], tp: Changelog, offset: int, writer: str,
                   clear: tuple[str, int, int, int] | None, now_ms: int) -> list[tuple[Client, bool, bool]]:
        """(client, values, possibleDuplicate) for each client the record reaches and is to get, in the
        order reached; each counted in its queue (its end moves, its room shrinks)."""
        every_taker = len(takers) == len(self.owned)
        clients, starts, duplicates_below = self.clients, self.starts, self.duplicates_below
        out = []
        for client_id, values in reached.items():
            client = clients[client_id]
            r = client.partition
            if not every_taker and r not in takers:
                continue
            record = client.record
            start = starts[r].get(record["queue_topic"])
            if start is None or offset < start.get(tp, 0):
                continue  # older than the queue's first registration: the client's initial load has it
            if writer == record["member_id"]:
                continue  # a client's own update is never sent back to it
            if clear is not None:
                if client.last_clear == clear:
                    continue
                client.last_clear = clear
            below = duplicates_below.get(r)
            duplicate = below is not None and offset < below.get(tp, 0)
            if client.room <= 0:
                self.queue_full(client, now_ms)
                continue
            client.room -= 1
            client.queue_end += 1
            out.append((client, values, duplicate))
        return out

    def queue_full(self, client: Client, now_ms: int) -> None:
        """An event the client's queue has no room for: not written, counted; the client is unregistered on
        the next turn."""
        client.not_queued += 1
        self.stats["events_not_queued"] += 1
        if client.full_since_ms is None:
            client.full_since_ms = now_ms
            self.dirty = True

    # --- checkpoints (step 5) ----------------------------------------------------------------------

    def checkpoint(self, partitions: Iterable[int], now_ms: int) -> list[dict[str, Any]]:
        """The FillCheckpoint record of each owned partition of ``partitions``; taken as written (the
        service writes them all, or refills)."""
        records = []
        for r in sorted(set(partitions) & self.owned):
            queues = {c.record["queue_topic"] for c in self.clients.values() if c.partition == r}
            starts = self.starts[r] = {q: at for q, at in self.starts[r].items() if q in queues}
            positions = self.positions[r]
            before = self.checkpoints.get(r, {})
            back = {tp: (before[tp], at) for tp, at in positions.items() if at < before.get(tp, at)}
            assert not back, f"registry partition {r}: a checkpoint moves back: {back}"
            records.append({"registry_partition": r, "member": self.member, "updated_at": now_ms,
                            "positions": position_records(positions),
                            "queues": [{"queue_topic": q, "positions": position_records(at)}
                                       for q, at in sorted(starts.items())]})
            self.checkpoints[r] = dict(positions)
            self.table_starts[r] = dict(starts)
        return records

    def refill(self, partitions: Iterable[int], ends: Positions) -> None:
        """A queue write failed: fill again from the last checkpoints (repeats are discarded by the clients,
        flagged below ``ends``), rather than checkpoint past a hole."""
        owned = set(partitions) & self.owned
        for r in owned:
            positions = self.positions[r]
            checkpoint = self.checkpoints.get(r, {})
            for tp in positions:
                positions[tp] = min(positions[tp], checkpoint.get(tp, positions[tp]))
            self.duplicates_below[r] = dict(ends)
        for client in self.clients.values():
            if client.partition in owned:
                # Some of what was counted in the queue never reached it: its end is read again.
                client.end_known, client.room = False, sys.maxsize
        self.dirty = True


def positions_of(records: list[dict[str, Any]]) -> Positions:
    return {(p["topic"], p["partition"]): p["offset"] for p in records}


def position_records(positions: Positions) -> list[dict[str, Any]]:
    return [{"topic": t, "partition": p, "offset": o} for (t, p), o in sorted(positions.items())]


__all__ = ["Client", "SubscriptionProtocol", "Unregister", "position_records", "positions_of"]
