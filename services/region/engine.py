"""Bucket ownership, the ordered application of operations, and their transactions.

Ownership is Kafka's: every region instance is a member of one consumer group
subscribed to every region changelog, and the member assigned partition *b*
of a changelog owns bucket *b* of that region (consumer-group leadership is
the primary lock, DESIGN §1).  The engine does not read its assigned
partitions through the group; it pauses them and keeps polling only to stay
in the group and to hear about rebalances.  On each assignment it keeps the
group metadata of that generation (``consumer_group_metadata``): the offsets
of every transaction it writes for those buckets carry it, and the group
coordinator refuses them once the generation is gone (KIP-447).

The group rebalances incrementally (``cooperative-sticky``, KIP-429): a
member joining or leaving moves only the buckets that change owner, and a
member keeps serving the others throughout.  Each rebalance still starts a
new generation, and a window whose offsets carry the one that ended is
refused by the group coordinator and aborted; the committer then writes the
same window again under the new generation (its records were never
visible), so the buckets that stayed are neither failed nor reloaded
(``windows_rewritten`` in the stats).  The revocation of buckets that move
happens in the new generation, so their last windows commit under it.
Cooperative and eager assignors cannot share a group: instances of a
release that used the range assignor must all stop before instances of
this one join.

Gaining a bucket (``on_assign``)::

    LOADING ── load: read the committed offset of the changelog partition
       │       (read_committed: librdkafka waits while a transaction's
       │       offsets for it are pending), wait until no transaction is
       │       open on it (its last stable offset is its high watermark),
       │       read it at read_committed from its start to that end, replay
       │       every record into a fresh BucketState (or, from a standby copy
       │       this instance kept, only the records past the copy's position:
       │       standby.py; or from the local store, clean at a position,
       │       only the records past it: store.py), and re-enqueue
       │       (possibleDuplicate) the records past an offset not marked
       │       transactional, in a transaction of its own (fanout.py, "The
       │       checkpoint")
       ▼
    READY ──── requests are applied in arrival order (one lock, so bucket order
       │       is the order of the changelog); their records join the open
       │       group-commit window, and the committer thread writes each
       │       window as one transaction with the buckets' offsets
       │       (fanout.py tells that story)
       ▼
    REVOKING ─ on_revoke: stop accepting, wait (bounded) until every window
       │       holding the bucket's records is committed, with this
       │       generation's metadata still valid
       ▼
    gone ───── on_lost (session expired): dropped at once; a window still
               holding its records is refused by the group coordinator and
               aborted.

A failed window sends its buckets back to LOADING: their in-memory state may
be ahead of the changelog, so it is rebuilt from it.  Records of a later
window prepared on that state are dropped (their ownership epoch is gone)
and their requests answered with a retriable error.

How a bucket loads (why it waits until every transaction on its changelog
partition is decided, how the earlier owner a dead instance was is fenced,
what becomes of a record it cannot read) is loading.py's story; what the
group thread does on an assignment, a revocation or a loss is membership.py's.

A fenced or timed-out producer is fatal in librdkafka: the engine builds a new
one under the same transactional.id (which fences the old one for good) and
reloads the buckets of the failed window.

Who decides what.  Ownership itself (which buckets, under which epoch and
generation, what a revocation keeps, when a blocked load fences) is the pure
protocol of ownership.py: the engine feeds it the group's events and the
loads' and windows' outcomes under its lock, and performs the actions it
answers (load, publish the claims, park, offer a standby copy, fence).  Its
takeovers are replayed without a broker in tests/unit/test_region_ownership.py.

Threads: the callers' (``submit``), the committer (the transactional producer
and its windows), the group thread (the partition loop of core/loop.py over
the group consumer: membership, generation metadata), the loaders
(``load_threads`` of them, each loading one bucket at a time with readers of
its own, so the buckets owed after a failover load in parallel) and the
standby keeper (standby.py).  The engine's threads are the workers of its
``Service`` (core/lifecycle.py): the first to die is its crash.  They share
the ``self._lock``-guarded ownership, bucket tables and open window; the
loaders share the dead-letter path under a lock of its own; everything else
is owned by one thread.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..core import telemetry
from ..core.codec import Codec
from ..core.framing import Frames
from ..core.errors import (
    BrokerUnavailable,
    BucketUnavailable,
    InvalidRequest,
    NotOwner,
    OwnershipUnconfirmed,
    SluiceError,
)
from ..core.events import EntryEvent, EventID
from ..core.events import Operation as EventOperation
from ..core.kafka import (
    Consumer,
    Producer,
    close_producer,
    kafka_errors,
    make_consumer,
    make_transactional_producer,
    partition_for_key,
)
from ..core.lifecycle import Service
from .conflicts import ConflictResolver
from .fanout import Pending, QueueTarget, RecordBuilder, Slot, Window, WindowOutcome, WindowWriter
from .loading import BucketLoading, HangingWatch, transactional_id_of
from .membership import GroupMembership
from .ownership import BucketStatus, OwnedBucket, Parked, RegionOwnership
from .standby import StandbyKeeper, StandbyStatus
from .state import BucketState, ConflictLost, Duplicate, Op, Skipped
from .store import LocalStore

log = logging.getLogger("sluice.region.engine")

#: How long a load waits on a transaction someone left open before fencing the earlier owners the
#: directory shows gone: longer than any window of a live owner takes to commit.
FENCE_AFTER_S = 1.0
#: Wedged producers (fanout.WindowWriter) an instance keeps before it stops as crashed.
WEDGED_PRODUCERS_MAX = 8
#: The group's assignor: incremental cooperative rebalancing (KIP-429), so a member joining or leaving
#: moves only the buckets that change owner, and the others go on answering (the module docstring).
ASSIGNMENT_STRATEGY = "cooperative-sticky"
#: How long the committer waits for the group's next generation before writing again a window the
#: group refused for a generation that had ended (``_next_generation``).
GENERATION_WAIT_S = 30.0
#: How often the committer looks for that next generation while it waits (``_next_generation``).
GENERATION_POLL_S = 0.02
#: The pause before the committer builds its producer again after failing to.
PRODUCER_RETRY_S = 1.0
#: How often a broker aborts the transactions past their timeout
#: (``transaction.abort.timed.out.transaction.cleanup.interval.ms``, Kafka's default).
KAFKA_ABORT_CHECK_S = 10.0
#: Beyond the transaction timeout and that check, how long before an open transaction is called hanging.
HANGING_GRACE_S = 20.0
#: How long ``stop`` waits, in all, for the engine's threads and clients unless told otherwise.
STOP_DEADLINE_S = 10.0


@dataclass(slots=True)
class Operation:
    """One requested operation on one key (value already serialized).

    ``bucket`` is computed once, by whoever routes the operation first.
    """

    op: Op
    region: str
    key: str
    value: bytes | None = None
    event_id: EventID | None = None
    callback_argument: str | None = None
    bucket: int = -1
    #: For ``Op.REMOTE``: the event another site applied (its own EventID and version).
    remote: EntryEvent | None = None
    #: For ``Op.REMOTE``, when known: the EntryEvent body of ``remote``, byte for byte; the records of
    #: the event, when applied as it came, are written around it instead of encoding it again.
    remote_body: bytes | None = None
    #: put_all / remove_all for a region whose gateway senders group
    #: transaction events: the id its events carry (see ``submit``).
    transaction: str | None = None
    #: Kafka headers for the event's changelog and queue records (its W3C
    #: ``traceparent``); None when tracing is off.
    trace: list[tuple[str, bytes]] | None = None
    #: For ``Op.REMOTE``: False when the sending site said the event fires no callbacks here (an
    #: entry it copied with wan-copy region): applied and written to the changelog, queued nowhere.
    generate_callbacks: bool = True


@dataclass(slots=True)
class OpResult:
    """What happened to one operation: an event, a duplicate, a skip or an error."""

    event: EntryEvent | None = None
    duplicate: bool = False
    skipped: bool = False
    error: SluiceError | None = None
    #: A remote event that lost the WAN conflict: not applied, not an error.
    conflict_lost: bool = False
    #: Entries a region clear removed from the bucket.
    cleared: int = 0


class RegionEngine(BucketLoading, GroupMembership, Service):
    """The bucket owner of one region-service instance.

    Its lifecycle is core/lifecycle.py's (``Service``)::

        NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                            │
                            └── a thread died ──► CRASHED (``on_crash`` told)

    Its threads (committer, group, loaders) are the service's workers: the first
    crash is recorded, every wait ends, and ``on_crash`` hands it to the owner.
    The group thread is the partition loop of core/loop.py over the group
    consumer, with this engine as its handler (``on_assign``, ``on_revoke``,
    ``on_lost``, ``turn``); what ownership means is ownership.py's
    ``RegionOwnership``, which the engine asks under ``_lock`` and whose
    actions it performs.
    """

    kind = "region engine"

    def __init__(
        self,
        *,
        site: str,
        dsid: int,
        member_id: str,
        client_id: str,
        kafka_settings: dict[str, Any],
        group_settings: dict[str, Any],
        producer_settings: dict[str, Any],
        group_id: str,
        regions: dict[str, int],
        changelog_topics: dict[str, str],
        targets: dict[str, list[QueueTarget]],
        codec: Codec,
        load_timeout_s: float = 60.0,
        event_tracking_timeout_s: float = 900.0,
        conflict_resolver: ConflictResolver | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        on_ownership: Callable[[list[tuple[str, int, int]]], None] | None = None,
        dead_letter_topic: str | None = None,
        transaction_timeout_ms: int = 10_000,
        window_linger_s: float = 0.0,
        window_records_max: int = 200_000,
        gone_owners: Callable[[str, int, int], list[str]] | None = None,
        standbys: bool = False,
        load_threads: int = 1,
        store: LocalStore | None = None,
        topic_ids: dict[str, str] | None = None,
        checkpoint_interval_s: float = 5.0,
        frames: Frames | None = None,
    ) -> None:
        super().__init__()
        self.site = site
        self.dsid = dsid
        self.member_id = member_id
        self.client_id = client_id
        self.group_id = group_id
        self.regions = regions
        self.conflict_resolver = conflict_resolver
        self.changelog_topics = changelog_topics
        self._topic_region = {t: r for r, t in changelog_topics.items()}
        self._kafka_settings = kafka_settings
        self._group_settings = group_settings
        self._producer_settings = producer_settings
        self._codec = codec
        #: The site's framing of changelog and queue records (core/framing.py): read either, write its own.
        self._frames = frames or Frames(codec)
        self._targets = targets
        self._load_timeout_s = load_timeout_s
        self._tracking_timeout_ms = int(event_tracking_timeout_s * 1000)
        self._on_crash = on_crash
        #: Called (in the group thread) with [(region, bucket, since_ms)] whenever the owned buckets change.
        self._on_ownership = on_ownership
        #: Where unreadable changelog records go (None: they are only logged).
        self._dead_letter_topic = dead_letter_topic
        #: Keys of the dead letters this instance knows are written (loader thread only).
        self._dead_lettered: set[bytes] = set()
        #: This instance's transactional.id, for its whole life (the module docstring says why).
        self.transactional_id = transactional_id_of(group_id, member_id)
        self._transaction_timeout_ms = transaction_timeout_ms
        #: How long a window stays open after its first record (0: until the previous one is committed).
        self._window_linger_s = window_linger_s
        #: Records the open window may hold before writes are refused (retriable) until it is written.
        self._window_records_max = window_records_max
        #: (region, bucket, since_ms) → the instance ids the directory shows gone that claimed the
        #: bucket before this instance was assigned it at since_ms (None: no directory, no fencing).
        self._gone_owners = gone_owners

        self._lock = threading.Lock()
        #: Signalled (under ``_lock``) when the open window gets its first records, and when a window is done.
        self._window_changed = threading.Condition(self._lock)
        self._window = Window()
        self._windows_taken = 0
        self._windows_done = 0
        #: When the committer began writing its current window (None: not writing).
        self._writing_since: float | None = None
        #: Producers left in a call that never returned (kept: closing one would wait on it).
        self._wedged_producers: list[Producer] = []
        #: What this instance owns, under which epoch and group generation (ownership.py; under ``_lock``:
        #: the group thread changes it, the committer and the loaders report to it, callers read it).
        self._ownership = RegionOwnership(fence_after_s=FENCE_AFTER_S)
        self._loads: queue.Queue[tuple[str, int, int] | None] = queue.Queue(maxsize=100_000)
        #: Loader threads: buckets loaded at once, each thread with readers of its own.
        self._load_threads = load_threads
        #: Held while a loader writes dead letters (``_dead_letter``: the set of those written, the producer).
        self._dead_letter_lock = threading.Lock()
        self._committer_stopping = False
        self._threads: list[threading.Thread] = []
        self._writer: WindowWriter | None = None
        self._builder = RecordBuilder(codec, changelog_topics, targets, self._frames)
        self._group: Consumer | None = None
        self._offsets: Consumer | None = None
        self._dead_letter_producer: Producer | None = None
        #: The group thread's read_uncommitted reader of high watermarks (``_park``).
        self._high_reader: Consumer | None = None
        #: How long ``stop`` waits, in all (set by ``stop``).
        self._stop_deadline_s = STOP_DEADLINE_S
        #: When the group loop next makes the local store clean for the quiet buckets (``turn``).
        self._next_checkpoint = 0.0
        self.assigned_once = threading.Event()
        self.stats = {"applied": 0, "duplicates": 0, "conflicts_lost": 0, "loads": 0, "refanned_out": 0,
                      "bucket_failures": 0, "dead_lettered": 0, "windows": 0, "windows_failed": 0,
                      "window_records": 0, "producers_rebuilt": 0, "producers_wedged": 0, "owners_fenced": 0,
                      "hanging_transactions": 0, "loads_skipped": 0,
                      "loads_from_standby": 0, "loads_from_store": 0, "records_replayed": 0,
                      "buckets_revoked": 0, "windows_rewritten": 0, "windows_absorbed": 0, "wan_copied": 0}
        #: Records of committed windows by topic: a queue topic's count is its events queued (metrics).
        self.records_written: collections.Counter[str] = collections.Counter()
        #: Standby copies of buckets other instances own (a region with redundant_copies; standby.py).
        self._standby = StandbyKeeper(kafka_settings=kafka_settings, client_id=client_id,
                                      changelog_topics=changelog_topics, dsid=dsid, member_id=member_id,
                                      codec=codec, frames=self._frames, new_copy=self._copy_state if store else None
                                      ) if standbys else None
        #: The local store of bucket state (store.py; None: state on the heap only), with the id of each
        #: region's changelog topic that its checkpoints name.
        self._store = store
        self._topic_ids = topic_ids or {}
        self._checkpoint_interval_s = checkpoint_interval_s
        self._hanging = HangingWatch(transaction_timeout_ms / 1000 + KAFKA_ABORT_CHECK_S + HANGING_GRACE_S)

    # --- lifecycle -----------------------------------------------------------

    @property
    def _owned(self) -> dict[tuple[str, int], OwnedBucket]:
        """The buckets this instance owns (``RegionOwnership.owned``; under ``_lock``)."""
        return self._ownership.owned

    @property
    def _parked(self) -> dict[tuple[str, int], Parked]:
        """Revoked buckets' state, until the assignment after the revocation (under ``_lock``)."""
        return self._ownership.parked

    def start(self) -> None:
        self._check_startable()
        self._writer = WindowWriter(self._new_producer(), self.changelog_topics,
                                    timeout_s=self._transaction_timeout_ms / 1000)
        # Committed checkpoints are read through a consumer of the group that never subscribes (the group
        # member belongs to the group thread): not through the admin API, whose coordinator requests can
        # abort the process when the broker connection drops (confluentinc/librdkafka#4605).  It reads at
        # read_committed, so librdkafka asks for stable offsets: it waits for transactional offsets
        # still pending (KIP-447).
        self._offsets = make_consumer(self._kafka_settings, self.group_id,
                                      **{"client.id": f"{self.client_id}-offsets", "enable.auto.commit": False,
                                         "isolation.level": "read_committed"})
        self._high_reader = make_consumer(self._kafka_settings, None,
                                          **{"client.id": f"{self.client_id}-watermarks",
                                             "isolation.level": "read_uncommitted"})
        self._group = make_consumer(
            self._kafka_settings,
            self.group_id,
            **{"client.id": self.client_id},
            **{**self._group_settings, "partition.assignment.strategy": ASSIGNMENT_STRATEGY},
        )
        workers = [("commit", self._commit_loop), ("group", self._group_loop)]
        workers += [(f"loader-{i}", self._load_loop) for i in range(self._load_threads)]
        for name, target in workers:
            self._threads.append(self.spawn(target, name=f"region-{name}"))
        if self._standby is not None:
            self._standby.start()
        self._set_running()

    def _new_producer(self) -> Producer:
        """A transactional producer under this instance's id, initialized: any open transaction of an
        earlier producer of the id is aborted and that producer fenced."""
        producer = make_transactional_producer(
            self._kafka_settings, self.transactional_id, self._transaction_timeout_ms,
            **{"client.id": self.client_id, **self._producer_settings})
        try:
            with kafka_errors(f"initializing transactions of {self.transactional_id}"):
                producer.init_transactions(self._load_timeout_s)
        except SluiceError:
            close_producer(producer, 1.0)
            raise
        return producer

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """Stop loading, leave the group (revoking cleanly: the open windows are committed), then stop
        the committer and close the producer, within ``deadline_s``.  Idempotent (``Service.stop``)."""
        self._stop_deadline_s = deadline_s
        super().stop()

    def on_stop(self) -> None:
        """The first ``stop()``.  A crashed engine releases nothing: its process exits, and a thread
        wedged in a Kafka call (``_check_committer``) would hold a close for ever."""
        if self.crash is not None:
            return
        try:
            self._release(self._stop_deadline_s)
        finally:
            self._set_stopped()

    def _release(self, deadline_s: float) -> None:
        for _ in range(self._load_threads):
            self._loads.put_nowait(None)
        end = time.monotonic() + deadline_s
        for t in self._threads:
            if t.name != "region-commit":
                t.join(max(0.1, end - time.monotonic()))
        with self._lock:
            self._committer_stopping = True
            self._window_changed.notify_all()
        for t in self._threads:
            if t.name == "region-commit":
                t.join(max(0.1, end - time.monotonic()))
        if self._writer is not None:
            if self._writer.producer is not None:
                close_producer(self._writer.producer, end - time.monotonic())
            self._writer.close()
        if self._offsets is not None:
            self._offsets.close()
        if self._high_reader is not None:
            self._high_reader.close()
        with self._lock:
            self._parked.clear()
        if self._standby is not None:
            self._standby.stop(max(0.1, end - time.monotonic()))
        if self._dead_letter_producer is not None:
            self._dead_letter_producer.flush(max(0.1, end - time.monotonic()))
            close_producer(self._dead_letter_producer, 0.1)

    def record_crash(self, exc: BaseException) -> bool:
        """A thread of the engine died (``Service.record_crash``): the committer stops waiting, and the
        owner hears of the first crash."""
        first = super().record_crash(exc)
        with self._lock:
            self._committer_stopping = True
            self._window_changed.notify_all()
        if first and self._on_crash is not None:
            self._on_crash(exc)
        return first

    # --- reads of ownership --------------------------------------------------

    def bucket_of(self, region: str, key: str) -> int:
        return partition_for_key(key.encode("utf-8"), self.regions[region])

    def owned_buckets(self) -> dict[str, list[tuple[int, str]]]:
        with self._lock:
            out: dict[str, list[tuple[int, str]]] = {}
            for (region, bucket), ob in sorted(self._owned.items()):
                out.setdefault(region, []).append((bucket, ob.status.value))
            return out

    def claims(self) -> list[tuple[str, int, int]]:
        """(region, bucket, since_ms) of every bucket this instance owns, loaded or loading."""
        with self._lock:
            return self._ownership.claims()

    def _ownership_changed(self, claims: list[tuple[str, int, int]]) -> None:
        if self._on_ownership is not None:
            try:
                self._on_ownership(claims)
            except Exception:  # noqa: BLE001 - the directory is advisory: never fail a rebalance over it
                log.exception("publishing the owned buckets failed")

    def owns(self, region: str, bucket: int) -> bool:
        with self._lock:
            ob = self._owned.get((region, bucket))
            return ob is not None and ob.status is not BucketStatus.REVOKING

    def set_standbys(self, buckets: set[tuple[str, int]]) -> None:
        """Keep standby copies of these buckets (``standby.standby_buckets``), but of none this instance
        owns."""
        if self._standby is None:
            return
        with self._lock:
            self._standby.want({key for key in buckets if key not in self._owned})

    def standby_status(self) -> list[StandbyStatus]:
        """Each standby copy: its position, lag, entries and value bytes."""
        return [] if self._standby is None else self._standby.status()

    def all_stats(self) -> dict[str, int]:
        """The engine's counters, with the standby keeper's."""
        return {**self.stats, **({} if self._standby is None else self._standby.stats),
                **({} if self._store is None else self._store.stats)}

    def loading(self, region: str, bucket: int) -> BucketUnavailable | None:
        """Why an owned bucket does not answer yet, with when to ask again (from the load's progress
        so far: 1 s while the load has not started reading or cannot tell); None when it is ready or
        not owned here."""
        with self._lock:
            ob = self._owned.get((region, bucket))
            if ob is None or ob.status is BucketStatus.READY:
                return None
            return _loading_error(ob)

    def is_ready(self, region: str, bucket: int) -> bool:
        with self._lock:
            ob = self._owned.get((region, bucket))
            return ob is not None and ob.status is BucketStatus.READY

    # --- writes --------------------------------------------------------------

    def submit(self, ops: list[Operation], on_done: Callable[[list[OpResult]], None]) -> None:
        """Apply ``ops`` in order; ``on_done(results)`` runs (in the committer
        thread, or here) once every applied event's window is committed: its
        changelog record and its queue records are durable and visible.

        Every op must be for a bucket this instance owns; others get a
        ``NotOwner`` or ``BucketUnavailable`` result and are not applied.
        """
        results = [OpResult() for _ in ops]

        def finished(error: SluiceError | None) -> None:
            with self._lock:
                for r in results:
                    if r.event is not None:
                        ob = self._owned.get((r.event.region, r.event.bucket))
                        if ob is not None:
                            ob.inflight.pop(r.event.event_id, None)
            if error is not None:
                _fail_results(results, error)
            on_done(results)

        pending = Pending(finished)
        pending.add(1)  # held until every op is in the window, so it cannot fire early
        now_ms = int(time.time() * 1000)
        grouped: list[tuple[OpResult, OwnedBucket, str]] = []
        group_trace: list[tuple[str, bytes]] | None = None
        written: set[Slot] = set()
        with self._lock:
            window = self._window
            was_empty = window.empty()
            owned = self._owned
            for op, result in zip(ops, results):
                bucket = op.bucket if op.bucket >= 0 else self.bucket_of(op.region, op.key)
                ob = owned.get((op.region, bucket))
                if ob is None or ob.status is BucketStatus.REVOKING:
                    result.error = NotOwner(op.region, bucket)
                    continue
                if ob.status is not BucketStatus.READY or ob.state is None:
                    result.error = _loading_error(ob)
                    continue
                if len(window.records) >= self._window_records_max:
                    result.error = BucketUnavailable(op.region, bucket, "the owner's writes wait for Kafka "
                                                     f"({len(window.records)} records not yet committed)")
                    continue
                remote = op.remote
                event_id = op.event_id if remote is None else remote.event_id
                if event_id is None:
                    # A caller may have written with this instance's member id (it is in every entry
                    # the instance stamped): continue past whatever the bucket has seen of the stream.
                    sequence = max(ob.next_sequence, ob.state.streams.get((self.member_id, bucket), -1) + 1)
                    event_id = EventID(self.member_id, bucket, sequence)
                    ob.next_sequence = sequence + 1
                try:
                    if op.op is Op.REMOTE:
                        assert remote is not None
                        outcome = ob.state.prepare_remote(remote, self.conflict_resolver)
                    elif op.op is Op.CLEAR:
                        outcome = ob.state.prepare_clear(event_id, now_ms)
                    elif op.op is Op.DESTROY_REGION:
                        outcome = ob.state.prepare_clear(event_id, now_ms, EventOperation.REGION_DESTROY)
                    else:
                        outcome = ob.state.prepare(op.op, op.key, op.value, event_id, now_ms, op.callback_argument)
                except InvalidRequest as exc:
                    result.error = exc
                    continue
                if isinstance(outcome, ConflictLost):
                    result.conflict_lost = True
                    self.stats["conflicts_lost"] += 1
                    continue
                if isinstance(outcome, Duplicate):
                    result.duplicate = True
                    self.stats["duplicates"] += 1
                    original = ob.inflight.get(event_id)
                    if original is not None and original is not pending:
                        # The first attempt is still being written: answer
                        # this retry when that one is committed.  (The same
                        # event twice in one request, as a batch may hold it
                        # after a queue re-enqueued it, is already waited for:
                        # chaining the request to itself would never answer.)
                        original.then(pending)
                    continue
                if isinstance(outcome, Skipped):
                    result.skipped = True
                    continue
                slot = (op.region, bucket, ob.epoch)
                if isinstance(outcome, list):  # a region clear: one event per entry of the bucket
                    result.cleared = len(outcome)
                    if not outcome:
                        result.skipped = True
                        continue
                    result.event = outcome[-1]
                    ob.inflight[event_id] = pending
                    self.stats["applied"] += len(outcome)
                    for event in outcome:
                        changelog, queued = self._builder.records(event)
                        window.add(slot, ob.checkpoint, changelog, queued)
                    written.add(slot)
                    continue
                result.event = outcome
                ob.inflight[event_id] = pending
                self.stats["applied"] += 1
                written.add(slot)
                if op.transaction is None:
                    body = op.remote_body if outcome is op.remote else None
                    changelog, queued = self._builder.records(outcome, op.trace, body, op.generate_callbacks)
                    window.add(slot, ob.checkpoint, changelog, queued)
                else:
                    grouped.append((result, ob, op.transaction))
                    group_trace = op.trace  # one put_all / remove_all request: one trace
            if grouped:
                self._write_grouped(window, grouped, group_trace)
            if written:
                pending.add(1)
                window.waiting.append((pending, frozenset(written)))
                if was_empty:
                    self._window_changed.notify_all()
        pending.arm()
        pending.done()

    def _write_grouped(self, window: Window, grouped: list[tuple[OpResult, OwnedBucket, str]],
                       trace: list[tuple[str, bytes]] | None = None) -> None:
        """The events of one put_all / remove_all, marked with its transaction
        id, the last of each bucket flagged: contiguous in each changelog and
        queue partition (written under the lock), so a sender can keep them in
        one batch.  Called with the lock held.  ``trace``: the request's trace headers."""
        last_of_bucket = {(r.event.region, r.event.bucket): i for i, (r, _, _) in enumerate(grouped)
                          if r.event is not None}
        for i, (result, ob, tx) in enumerate(grouped):
            event = result.event
            assert event is not None
            event = replace(event, transaction=(tx, last_of_bucket[(event.region, event.bucket)] == i))
            result.event = event
            changelog, queued = self._builder.records(event, trace)
            window.add((ob.region, ob.bucket, ob.epoch), ob.checkpoint, changelog, queued)

    def copy_entries(self, region: str, bucket: int, keys: list[str], sender_id: str, *, destroyed: bool,
                     on_done: Callable[[SluiceError | None], None]) -> dict[str, int]:
        """Queue the current entries of ``keys`` (of one bucket this instance owns) for gateway sender
        ``sender_id``, and nothing else: a wan-copy batch (``wancopy.py``).

        Each entry goes as it is now, read under the lock that orders the
        bucket's writes, so its record lands in the sender's queue partition
        after every earlier write of the key and before every later one: an
        UPDATE (a DESTROY for a tombstone when ``destroyed``), possibleDuplicate,
        with the entry's own EventID and version tag and this site as origin.
        No changelog record is written and no other queue gets it.  Left out,
        and counted by reason: ``absent`` keys, tombstones (``destroyed``,
        unless asked for), ``invalid`` entries (an invalidate never crosses
        sites), entries the sender's remote site wrote (``remote_site``: the
        loop check), and those a before_enqueue filter keeps out
        (``filtered``).  Returns the counts (``copied`` and the reasons) once
        the records are in the open window; ``on_done(error or None)`` runs
        when that window is committed (or failed).  ``NotOwner``,
        ``BucketUnavailable`` (loading, or the window full) and ``InvalidRequest``
        (a sender not attached to the region) are raised before anything is queued.
        """
        target = next((t for t in self._targets.get(region, ()) if t.id == sender_id and t.kind == "gateway-sender"),
                      None)
        if target is None:
            raise InvalidRequest("sender_id", sender_id, f"region {region!r} is not attached to a gateway sender "
                                 "of that id")
        counts = {"copied": 0, "absent": 0, "destroyed": 0, "invalid": 0, "remote_site": 0, "filtered": 0}
        now_ms = int(time.time() * 1000)
        with self._lock:
            ob = self._owned.get((region, bucket))
            if ob is None or ob.status is BucketStatus.REVOKING:
                raise NotOwner(region, bucket)
            if ob.status is not BucketStatus.READY or ob.state is None:
                raise _loading_error(ob)
            window = self._window
            if len(window.records) + len(keys) > self._window_records_max:
                raise BucketUnavailable(region, bucket, "the owner's writes wait for Kafka "
                                        f"({len(window.records)} records not yet committed)")
            slot = (region, bucket, ob.epoch)
            entries = ob.state.entries
            records = []
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    counts["absent"] += 1
                    continue
                if entry.destroyed and not destroyed:
                    counts["destroyed"] += 1
                    continue
                if entry.value is None and not entry.destroyed:
                    counts["invalid"] += 1
                    continue
                if entry.dsid == target.remote_dsid:
                    counts["remote_site"] += 1
                    continue
                event = EntryEvent(region=region, key=key,
                                   operation=EventOperation.DESTROY if entry.destroyed else EventOperation.UPDATE,
                                   value=entry.value, event_id=entry.event_id, version=entry.version,
                                   origin_dsid=self.dsid, bucket=bucket, event_time=now_ms, possible_duplicate=True)
                record = self._builder.copied(event, target)
                if record is None:
                    counts["filtered"] += 1
                    continue
                records.append(record)
            counts["copied"] = len(records)
            if records:
                was_empty = window.empty()
                window.add(slot, ob.checkpoint, None, records)
                pending = Pending(on_done)
                pending.add(1)
                window.waiting.append((pending, frozenset({slot})))
                if was_empty:
                    self._window_changed.notify_all()
                pending.arm()
                self.stats["wan_copied"] += len(records)
        if not records:
            on_done(None)
        return counts

    def read(self, region: str, bucket: int) -> BucketState:
        """The state of a READY bucket (callers read under ``read_lock``)."""
        with self._lock:
            ob = self._owned.get((region, bucket))
            if ob is None:
                raise NotOwner(region, bucket)
            if ob.status is not BucketStatus.READY or ob.state is None:
                raise BucketUnavailable(region, bucket, "the owner is loading the bucket")
            return ob.state

    @property
    def read_lock(self) -> threading.Lock:
        return self._lock

    def wait_ready(self, region: str, bucket: int, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                ob = self._owned.get((region, bucket))
                if ob is None:
                    return False
                if ob.status is BucketStatus.READY:
                    return True
            time.sleep(0.01)
        return False

    # --- committer thread ----------------------------------------------------------

    def _commit_loop(self) -> None:
        """Close a window, write it as one transaction, answer its requests; again (fanout.py)."""
        while True:
            with self._lock:
                while self._window.empty() and not self._committer_stopping:
                    self._window_changed.wait(0.5)
                if self._window.empty():
                    return  # stopping, and nothing left to write
                if self._window_linger_s > 0:
                    wait_s = self._window.opened_at + self._window_linger_s - time.monotonic()
                    if wait_s > 0 and not self._committer_stopping:
                        self._window_changed.wait(wait_s)
                window, self._window = self._window, Window()
                self._windows_taken += 1
                membership = self._ownership.membership
                # Records prepared under an ownership that has ended since (lost,
                # revoked, reloaded) must not be written: their state is gone.
                skip = self._ownership.stale(window.checkpoints)
            outcome = self._write_window(window, skip, membership)
            while outcome.stale_generation and not outcome.producer_broken:
                # A rebalance ended the generation the window was written under (the group refused its
                # offsets, and it was aborted): once this member is in the next one, the window's
                # buckets it still owns are written again, and it answers for those it gave up.
                membership, skip = self._next_generation(window, membership)
                if membership is None:
                    break
                self.stats["windows_rewritten"] += 1
                outcome = self._write_window(window, skip, membership)
            self._finish_window(window, skip, outcome)

    def _next_generation(self, window: Window, ended: bytes | None) -> tuple[bytes | None, set[Slot]]:
        """The group metadata of the generation after ``ended`` (None if it does not come within
        GENERATION_WAIT_S, or the engine stops), and the window's slots whose ownership ended since."""
        deadline = time.monotonic() + GENERATION_WAIT_S
        with self._lock:
            while (self._ownership.membership == ended and not self._committer_stopping
                   and time.monotonic() < deadline):
                self._window_changed.wait(GENERATION_POLL_S)
            membership = self._ownership.membership
            return None if membership == ended else membership, self._ownership.stale(window.checkpoints)

    def _write_window(self, window: Window, skip: set[Slot], membership: bytes | None) -> WindowOutcome:
        writer = self._writer
        assert writer is not None
        if writer.producer is None:
            return WindowOutcome(error=BrokerUnavailable("the owner is rebuilding its Kafka producer"))
        self._writing_since = time.monotonic()
        try:
            outcome = writer.write(window, skip, membership, lambda w: self._absorb(w, membership))
        finally:
            self._writing_since = None
        self.stats["windows"] += 1
        self.stats["window_records"] += len(window.records)
        if outcome.producer_broken:
            self._rebuild_producer(outcome.error, wedged=outcome.producer_wedged)
        return outcome

    def _absorb(self, writing: Window, membership: bytes | None) -> Window | None:
        """The window accepted since ``writing`` was taken, handed to the committer to join the
        transaction being written (``WindowWriter.write``); None when it is empty, when any of its
        ownerships has ended or the generation changed since ``writing`` was taken (it waits for a
        transaction of its own, which checks those), or when both together pass the records a
        window may hold."""
        with self._lock:
            window = self._window
            if window.empty() or self._committer_stopping or self._ownership.membership != membership:
                return None
            if len(writing.records) + len(window.records) > self._window_records_max:
                return None
            if self._ownership.stale(window.checkpoints):
                return None
            self._window = Window()
            self._windows_taken += 1
            self.stats["windows_absorbed"] += 1
            return window

    def _rebuild_producer(self, why: SluiceError | None, wedged: bool = False) -> None:
        """A fatal producer (fenced, or its transaction timed out at the coordinator): a new one
        under the same transactional.id, asked again until it comes or the engine stops.  A wedged
        one (a call that never returned: fanout.WindowWriter) is not closed, as closing it would wait
        on that call; it is kept, fenced by the new one, and more than WEDGED_PRODUCERS_MAX of them
        stop the engine as crashed, for a clean start of the process."""
        writer = self._writer
        assert writer is not None
        log.warning("transactional producer %s unusable (%s); building a new one", self.transactional_id, why)
        if wedged:
            self._wedged_producers.append(writer.producer)
            self.stats["producers_wedged"] += 1
            if len(self._wedged_producers) > WEDGED_PRODUCERS_MAX:
                raise BrokerUnavailable(f"{len(self._wedged_producers)} transactional producers wedged in calls "
                                        "that never returned")
        else:
            close_producer(writer.producer, 1.0)
        writer.replace_producer(None, wedged)
        while not self._stopping.is_set():
            try:
                writer.replace_producer(self._new_producer(), wedged=False)
                self.stats["producers_rebuilt"] += 1
                return
            except SluiceError as exc:
                if not exc.retriable:
                    raise  # the thread's crash: no new producer can be built
                log.warning("building the transactional producer again failed (%s); retrying", exc)
                self._stopping.wait(PRODUCER_RETRY_S)

    def _finish_window(self, window: Window, skip: set[Slot], outcome: WindowOutcome) -> None:
        """Step 3 or 4 of fanout.py: answer the window's requests; a failed window's buckets reload."""
        failed: list[Slot] = []
        with self._lock:
            if outcome.committed is None:
                failed = [slot for slot in window.checkpoints if slot not in skip]
                self._ownership.window_failed(failed)
            else:
                self._ownership.window_committed(outcome.committed, outcome.last_offsets)
            self._windows_done += 1 + window.absorbed
            self._window_changed.notify_all()
        if outcome.committed is not None:  # outside the lock: the callers' writes need it
            telemetry.count_topics(self.records_written, window.records, skip)
        error = outcome.error
        if error is not None:
            self.stats["windows_failed"] += 1
            log.warning("a window of %d records for %d buckets failed: %s", len(window.records),
                        len(window.checkpoints), error)
        for region, bucket, epoch in failed:
            assert error is not None
            self._bucket_failed(region, bucket, error, epoch)
        moved = OwnershipUnconfirmed("the bucket changed owner or was reloaded before the write was committed")
        for pending, buckets in window.waiting:
            if error is not None:
                pending.fail(error)
            elif buckets & skip:
                pending.fail(moved)
            else:
                pending.done()

    def _bucket_failed(self, region: str, bucket: int, error: SluiceError, epoch: int | None = None) -> None:
        """A write of the bucket failed: its memory may be ahead of the changelog.  ``epoch``: only if
        the bucket is still owned under it."""
        log.warning("bucket %s[%d] failed (%s); reloading it from the changelog", region, bucket, error)
        self.stats["bucket_failures"] += 1
        with self._lock:
            load = self._ownership.bucket_failed(region, bucket, epoch)
        if load is not None:
            self._loads.put((load.region, load.bucket, load.epoch))

    def _wait_windows(self, timeout_s: float) -> bool:
        """Until every window holding records accepted so far is done (committed or failed)."""
        end = time.monotonic() + timeout_s
        with self._lock:
            target = self._windows_taken + (0 if self._window.empty() else 1)
            while self._windows_done < target:
                left = end - time.monotonic()
                if left <= 0 or self._committer_stopping:
                    return False
                self._window_changed.wait(min(left, 0.5))
        return True

    # --- bucket states for the loaders and the standby copies ------------------

    def _new_state(self, region: str, bucket: int) -> BucketState:
        """An empty state for a load from the changelog (its store emptied first)."""
        entries = None if self._store is None else self._store.fresh(region, bucket, self._topic_ids[region])
        return BucketState(region, bucket, self.dsid, self.member_id, entries)

    def _stored_state(self, region: str, bucket: int, low: int = 0, high: int | None = None
                      ) -> tuple[BucketState, int] | None:
        """The bucket's state from the local store and the changelog position it is current to, when
        the store is clean at a position within ``low..high`` (None: no high bound known yet)."""
        assert self._store is not None
        resumed = self._store.resume(region, bucket, self._topic_ids[region])
        if resumed is None:
            return None
        entries, checkpoint = resumed
        if not low <= checkpoint.position <= (checkpoint.position if high is None else high):
            log.warning("the store of %s[%d] is clean at %d, outside its changelog's offsets %d..%s: not used",
                        region, bucket, checkpoint.position, low, high)
            self._store.stats["store_rebuilt"] += 1
            return None
        state = BucketState(region, bucket, self.dsid, self.member_id, entries)
        state.streams.update(checkpoint.streams)
        state.stream_seen_ms.update(checkpoint.stream_seen_ms)
        return state, checkpoint.position

    def _copy_state(self, region: str, bucket: int, low: int, high: int) -> tuple[BucketState, int]:
        """The start of a standby copy (standby.py): the local store's, or an empty one at ``low``."""
        stored = self._stored_state(region, bucket, low, high)
        return stored if stored is not None else (self._new_state(region, bucket), low)








def _loading_error(ob: OwnedBucket) -> BucketUnavailable:
    """Why the bucket does not answer yet, with when to ask again: the load's time so far per offset
    read, times the offsets left (at least 0.5 s, at most 60 s); 1 s before it reads."""
    region, bucket = ob.region, ob.bucket
    if ob.status is BucketStatus.REVOKING:
        return BucketUnavailable(region, bucket, "the bucket is moving to another owner", 1.0)
    start, position, end = ob.load_start, ob.load_position, ob.load_end
    if position < 0 or end <= start:
        return BucketUnavailable(region, bucket, "the owner is loading the bucket (waiting until no transaction "
                                 "is open on its changelog)", 1.0)
    done, left = position - start, max(0, end - position)
    elapsed = time.monotonic() - ob.load_began
    retry = left * elapsed / done if done > 0 and elapsed > 0 else 1.0
    return BucketUnavailable(region, bucket, f"the owner is loading the bucket: {done:,} of {end - start:,} changelog "
                             "offsets read", min(max(retry, 0.5), 60.0))


def _fail_results(results: list[OpResult], error: SluiceError) -> None:
    """Nothing a failed request did is reported as done; the caller retries
    with the same EventIDs and the owner's duplicate tracking keeps that safe."""
    for r in results:
        if r.error is None and not r.skipped:
            r.error = error
            r.event = None
            r.duplicate = False
