"""wan-copy region: a region's current entries, sent to a remote site through one gateway sender.

Geode's ``gfsh wan-copy region --region --sender-id [--max-rate] [--batch-size]
[--cancel]`` brings a new or repaired site up to date: each member copies the
entries of its primary buckets in batches of its own, straight to the remote
receiver.  Sluice puts the copy where every other write goes, into the
sender's queue, so that nothing new is needed downstream:

1. ``POST /regions/{region}/wan_copy`` (any instance; ``http.py``) starts a
   copy, and that instance coordinates it (``WanCopies``): one per region and
   sender at a time.  The copy has an id; ``GET`` reads its progress and
   ``POST …/wan_copy/cancel`` stops it.  ``sluice admin wan-copy`` drives
   these.
2. The coordinator asks the owner of each bucket how many entries it holds,
   then copies bucket by bucket (``WORKERS`` buckets at a time), one batch
   per request: ``batch_size`` keys after the last one copied.  A batch for a
   bucket this instance owns is copied here; any other goes to its owner
   (``POST /internal/wan_copy_batch``, the member token), found as every
   forwarded request finds it, and is asked again (with the same keys) while
   the bucket moves or Kafka fails the write.
3. The owner scans its own bucket: on the first batch it takes the bucket's
   live keys, sorted (``Snapshots``; a new owner takes its own and goes on
   after the last key copied), and for each batch reads each key's entry as
   it is at that moment and queues it for the sender alone
   (``RegionEngine.copy_entries``): the entry's own EventID and version tag,
   possibleDuplicate, no changelog record, no other queue, one Kafka
   transaction per batch.  The batch is answered once it is committed.
4. So a copied entry is in the sender's queue partition after every earlier
   write of its key and before every later one, and the remote site applies
   it as it applies any event: a copy of an entry it already has is a repeat
   (same EventID) or loses the conflict check (same version), and an entry
   written again after its copy is copied supersedes it.  A key created after
   the bucket's keys were taken, or destroyed since, is the live stream's.
5. ``max_rate`` (entries per second, 0 for no limit) holds for the whole
   copy, whatever the number of instances: each batch waits for its turn
   (``_pace``), and the copy ends no sooner than ``copied / max_rate``
   seconds after it started, so its mean rate never exceeds it.  Geode
   applies the rate per member.
6. Cancel: no batch starts after it, the batch being written commits or not
   as a whole, and the answer comes once the copy has stopped.

A copy of the whole region leaves out, and counts, what Geode's leaves out:
tombstones and invalid entries.  A copy of given keys (``keys``: the repair
that ``sluice pipeline reconcile --repair`` makes) sends a tombstone as a
DESTROY with its version.  Entries the sender's remote site wrote are never
copied to it (the loop check; the remote site refuses its own events anyway).

Like Geode's, a copy fires no callbacks at the remote site (Geode's
"generate callbacks: false"): its queue records carry ``FLAG_NO_CALLBACKS``,
the sender lists those events in the batch (GatewayBatch
``no_callback_events``), and the remote site applies them to its region and
changelog and queues them for none of its async event queues and senders.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from ..core.errors import (
    BrokerUnavailable,
    InvalidRequest,
    MemberRefused,
    NotOwner,
    SluiceError,
    WanCopyRunning,
)
from ..core.wancopy import BATCH_SIZE_MAX

if TYPE_CHECKING:
    from .service import RegionService

log = logging.getLogger("sluice.region.wancopy")

#: Buckets a coordinator copies at once.
WORKERS = 4
#: How long a batch is asked again while its bucket moves or its write fails, before the copy fails.
RETRY_FOR_S = 120.0
#: Bucket key lists an owner keeps for copies in progress, and how long an unused one stays.
SNAPSHOTS_MAX = 256
SNAPSHOT_IDLE_S = 600.0
#: Finished copies a coordinator keeps for ``GET``.
FINISHED_KEPT = 16
#: Why a key was not copied (``RegionEngine.copy_entries``), in the order reports show them.
SKIP_REASONS = ("absent", "destroyed", "invalid", "remote_site", "filtered")


class CopyState(str, enum.Enum):
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(slots=True)
class BucketProgress:
    """One bucket of a copy: its entries (as its owner counted them), those copied and skipped."""

    bucket: int
    total: int = 0
    copied: int = 0
    skipped: int = 0
    done: bool = False
    #: A copy of given keys: this bucket's, sorted (None: every live key of the bucket).
    keys: list[str] | None = None


@dataclass
class WanCopy:
    """One copy, as its coordinator runs it::

        RUNNING ──every bucket copied, and the pace's end reached──► DONE
           ├──── cancel, between two batches ──────────────────────► CANCELLED
           └──── a batch refused for good, or retried past RETRY_FOR_S ► FAILED

    ``stopped`` is set once it is in any of the last three."""

    copy_id: str
    region: str
    sender_id: str
    remote_dsid: int | None
    max_rate: int
    batch_size: int
    coordinator: str
    restricted: bool
    buckets: dict[int, BucketProgress]
    started_at_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    started: float = field(default_factory=time.monotonic)
    finished_at_ms: int | None = None
    finished: float | None = None
    state: CopyState = CopyState.RUNNING
    error: str | None = None
    skipped: Counter[str] = field(default_factory=Counter)
    #: Entries the pace has let through so far (``_pace``).
    reserved: int = 0
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def copied(self) -> int:
        return sum(b.copied for b in self.buckets.values())

    @property
    def total(self) -> int:
        return sum(b.total for b in self.buckets.values())

    def elapsed_s(self) -> float:
        return (self.finished if self.finished is not None else time.monotonic()) - self.started

    def to_dict(self) -> dict[str, Any]:
        elapsed = self.elapsed_s()
        return {
            "copy_id": self.copy_id, "region": self.region, "sender_id": self.sender_id,
            "remote_dsid": self.remote_dsid, "state": self.state.value, "coordinator": self.coordinator,
            "max_rate": self.max_rate, "batch_size": self.batch_size, "restricted": self.restricted,
            "started_at": self.started_at_ms, "finished_at": self.finished_at_ms, "elapsed_s": round(elapsed, 3),
            "total": self.total, "copied": self.copied, "skipped": {r: self.skipped.get(r, 0) for r in SKIP_REASONS},
            "rate": round(self.copied / elapsed, 1) if elapsed > 0 else 0.0,
            "buckets_done": sum(b.done for b in self.buckets.values()), "error": self.error,
            "buckets": [{"bucket": b.bucket, "total": b.total, "copied": b.copied, "skipped": b.skipped,
                         "done": b.done} for b in sorted(self.buckets.values(), key=lambda b: b.bucket)],
        }


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """What one batch did at the bucket's owner."""

    total: int
    copied: int
    skipped: dict[str, int]
    #: The last key of the batch, where the next one starts (None: the bucket is done).
    next: str | None
    done: bool

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "copied": self.copied, "skipped": self.skipped, "next": self.next,
                "done": self.done}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BatchAnswer":
        return cls(int(d["total"]), int(d["copied"]), {str(k): int(v) for k, v in d["skipped"].items()},
                   d["next"], bool(d["done"]))


class Snapshots:
    """The sorted live keys of buckets being copied, at their owner, per (copy, region, bucket).

    Taken on a copy's first batch of the bucket here and dropped when the
    bucket is done, after ``SNAPSHOT_IDLE_S`` unused, or beyond
    ``SNAPSHOTS_MAX`` (the least recently used).  Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: OrderedDict[tuple[str, str, int], tuple[list[str], float]] = OrderedDict()

    def get(self, copy_id: str, region: str, bucket: int) -> list[str] | None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (_, used) in self._keys.items() if now - used > SNAPSHOT_IDLE_S]:
                del self._keys[k]
            found = self._keys.get((copy_id, region, bucket))
            if found is None:
                return None
            self._keys[(copy_id, region, bucket)] = (found[0], now)
            self._keys.move_to_end((copy_id, region, bucket))
            return found[0]

    def put(self, copy_id: str, region: str, bucket: int, keys: list[str]) -> None:
        with self._lock:
            self._keys[(copy_id, region, bucket)] = (keys, time.monotonic())
            while len(self._keys) > SNAPSHOTS_MAX:
                self._keys.popitem(last=False)

    def drop(self, copy_id: str, region: str, bucket: int) -> None:
        with self._lock:
            self._keys.pop((copy_id, region, bucket), None)


class WanCopies:
    """The copies this instance coordinates, and the batches it copies as a bucket owner."""

    def __init__(self, service: RegionService) -> None:
        self.service = service
        self.snapshots = Snapshots()
        #: copy id → copy, the running ones and the last FINISHED_KEPT finished ones.
        self._copies: OrderedDict[str, WanCopy] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- the coordinator ---------------------------------------------------------------------

    def start(self, region: str, sender_id: str, *, max_rate: int, batch_size: int,
              keys: list[str] | None = None) -> WanCopy:
        """A copy of ``region`` (or of ``keys`` only) through ``sender_id``, running from now on.
        ``InvalidRequest`` for a sender the region does not feed or bad numbers; ``WanCopyRunning``
        when this instance already runs a copy of the region through that sender."""
        service = self.service
        config = service.region_config(region)
        sender = self.sender_of(region, sender_id)
        if max_rate < 0:
            raise InvalidRequest("max_rate", max_rate, "entries per second: 0 (no limit) or more")
        if not 1 <= batch_size <= BATCH_SIZE_MAX:
            raise InvalidRequest("batch_size", batch_size, f"from 1 to {BATCH_SIZE_MAX}")
        running = self.running(region, sender_id)
        if running is not None:
            raise WanCopyRunning(running)
        engine = service.engine
        assert engine is not None
        if keys is None:
            buckets = {b: BucketProgress(b) for b in range(config.buckets)}
        else:
            by_bucket: dict[int, set[str]] = {}
            for key in keys:
                by_bucket.setdefault(engine.bucket_of(region, key), set()).add(key)
            buckets = {b: BucketProgress(b, total=len(ks), keys=sorted(ks)) for b, ks in sorted(by_bucket.items())}
        copy = WanCopy(copy_id=uuid.uuid4().hex[:16], region=region, sender_id=sender_id,
                       remote_dsid=sender.remote_dsid, max_rate=max_rate, batch_size=batch_size,
                       coordinator=service.url, restricted=keys is not None, buckets=buckets)
        self._copies[copy.copy_id] = copy
        self._forget_finished()
        task = asyncio.get_running_loop().create_task(self._run(copy), name=f"wan-copy-{copy.copy_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("wan-copy %s of %s through %s started: %s, max rate %s/s, batches of %d", copy.copy_id, region,
                 sender_id, f"{len(keys):,} keys" if keys is not None else "every entry",
                 max_rate or "no limit", batch_size)
        return copy

    def sender_of(self, region: str, sender_id: str) -> Any:
        """The gateway sender ``sender_id``, when it is attached to ``region``; else ``InvalidRequest``."""
        config = self.service.region_config(region)
        if sender_id not in config.gateway_senders:
            attached = ", ".join(config.gateway_senders) or "none"
            raise InvalidRequest("sender_id", sender_id, f"not a gateway sender of region {region!r} "
                                                         f"(its senders: {attached})")
        return self.service.cfg.sender(sender_id)

    def running(self, region: str, sender_id: str) -> WanCopy | None:
        return next((c for c in self._copies.values() if c.region == region and c.sender_id == sender_id
                     and c.state is CopyState.RUNNING), None)

    def latest(self, region: str, sender_id: str) -> WanCopy | None:
        """The running copy of the region through the sender, else the last finished one."""
        found = [c for c in self._copies.values() if c.region == region and c.sender_id == sender_id]
        running = [c for c in found if c.state is CopyState.RUNNING]
        return (running or found or [None])[-1]

    def get(self, copy_id: str) -> WanCopy | None:
        return self._copies.get(copy_id)

    async def cancel(self, region: str, sender_id: str, wait_s: float) -> WanCopy | None:
        """Stop the running copy of the region through the sender (None: none runs here); returns it once
        it has stopped, or after ``wait_s`` still stopping."""
        copy = self.running(region, sender_id)
        if copy is None:
            return None
        copy.cancel_requested.set()
        try:
            await asyncio.wait_for(copy.stopped.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
        return copy

    def _forget_finished(self) -> None:
        finished = [k for k, c in self._copies.items() if c.state is not CopyState.RUNNING]
        for k in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            del self._copies[k]

    async def _run(self, copy: WanCopy) -> None:
        try:
            if not copy.restricted:
                await self._size(copy)
            todo: asyncio.Queue[BucketProgress] = asyncio.Queue()
            for progress in copy.buckets.values():
                todo.put_nowait(progress)
            await asyncio.gather(*(self._worker(copy, todo) for _ in range(min(WORKERS, len(copy.buckets)) or 1)))
            if copy.cancel_requested.is_set() and not all(b.done for b in copy.buckets.values()):
                copy.state = CopyState.CANCELLED
            else:
                await self._pace_end(copy)
                copy.state = CopyState.DONE
        except (SluiceError, httpx.HTTPError) as exc:
            copy.state = CopyState.FAILED
            copy.error = str(exc)
            log.warning("wan-copy %s of %s through %s failed after %d entries: %s", copy.copy_id, copy.region,
                        copy.sender_id, copy.copied, exc)
        except asyncio.CancelledError:
            copy.state = CopyState.FAILED
            copy.error = "the coordinating instance stopped"
            raise
        except Exception as exc:  # the top of the copy's task: recorded, never left RUNNING
            log.exception("wan-copy %s of %s through %s crashed", copy.copy_id, copy.region, copy.sender_id)
            copy.state = CopyState.FAILED
            copy.error = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            copy.finished = time.monotonic()
            copy.finished_at_ms = int(time.time() * 1000)
            copy.stopped.set()
            for progress in copy.buckets.values():
                if not progress.done:
                    self.snapshots.drop(copy.copy_id, copy.region, progress.bucket)
            log.info("wan-copy %s of %s through %s %s: %d of %d entries copied in %.1f s (%.0f/s), skipped %s",
                     copy.copy_id, copy.region, copy.sender_id, copy.state.value, copy.copied, copy.total,
                     copy.elapsed_s(), copy.copied / max(copy.elapsed_s(), 1e-9), dict(copy.skipped))

    async def _size(self, copy: WanCopy) -> None:
        """Each bucket's live entries, as its owner counts them (a batch of no keys)."""
        answers = await asyncio.gather(*(self._batch(copy, b, None, 0, None) for b in copy.buckets))
        for bucket, answer in zip(copy.buckets, answers):
            copy.buckets[bucket].total = answer.total

    async def _worker(self, copy: WanCopy, todo: asyncio.Queue[BucketProgress]) -> None:
        while not todo.empty() and not copy.cancel_requested.is_set():
            progress = todo.get_nowait()
            after: str | None = None
            position = 0
            while not progress.done and not copy.cancel_requested.is_set():
                keys = None
                if progress.keys is not None:
                    keys = progress.keys[position:position + copy.batch_size]
                count = len(keys) if keys is not None else copy.batch_size
                # The pace counts what the batch should copy (the bucket's last one may hold fewer), and
                # then what it did copy.
                left = progress.total - progress.copied - progress.skipped
                expected = min(count, left) if left > 0 else count
                if not await self._pace(copy, expected):
                    break
                answer = await self._batch(copy, progress.bucket, after, count, keys)
                copy.reserved += answer.copied - expected
                progress.copied += answer.copied
                progress.skipped += sum(answer.skipped.values())
                copy.skipped.update(answer.skipped)
                if keys is not None:
                    position += len(keys)
                    progress.done = position >= len(progress.keys)  # type: ignore[arg-type]
                else:
                    progress.total = answer.total
                    after, progress.done = answer.next, answer.done

    async def _pace(self, copy: WanCopy, count: int) -> bool:
        """Wait for the turn of a batch of up to ``count`` entries under ``max_rate``; False when the copy
        is cancelled meanwhile."""
        if copy.max_rate <= 0:
            return True
        due = copy.started + copy.reserved / copy.max_rate
        copy.reserved += count
        return await self._sleep_until(copy, due)

    async def _pace_end(self, copy: WanCopy) -> None:
        """The copy ends no sooner than ``copied / max_rate`` after it started (module docstring, step 5)."""
        if copy.max_rate > 0:
            await self._sleep_until(copy, copy.started + copy.reserved / copy.max_rate)

    @staticmethod
    async def _sleep_until(copy: WanCopy, due: float) -> bool:
        delay = due - time.monotonic()
        if delay <= 0:
            return not copy.cancel_requested.is_set()
        try:
            await asyncio.wait_for(copy.cancel_requested.wait(), delay)
            return False
        except asyncio.TimeoutError:
            return True

    async def _batch(self, copy: WanCopy, bucket: int, after: str | None, count: int,
                     keys: list[str] | None) -> BatchAnswer:
        """One batch at the bucket's owner, asked again (the same keys) while a retry may help, for at most
        ``RETRY_FOR_S``."""
        service = self.service
        engine, directory = service.engine, service.directory
        assert engine is not None and directory is not None
        deadline = time.monotonic() + RETRY_FOR_S
        delay = 0.05
        while True:
            try:
                if engine.owns(copy.region, bucket):
                    return await self.copy_owned(copy.copy_id, copy.region, copy.sender_id, bucket, after, count, keys)
                owner = directory.owner(copy.region, bucket)
                if owner is None or owner == service.url:
                    raise NotOwner(copy.region, bucket, owner)
                return await self._forward(owner, copy, bucket, after, count, keys)
            except SluiceError as exc:
                if not exc.retriable or time.monotonic() + delay > deadline:
                    raise
                why = str(exc)
            log.debug("wan-copy %s: %s[%d] asked again: %s", copy.copy_id, copy.region, bucket, why)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _forward(self, url: str, copy: WanCopy, bucket: int, after: str | None, count: int,
                       keys: list[str] | None) -> BatchAnswer:
        body = {"copy_id": copy.copy_id, "region": copy.region, "sender_id": copy.sender_id, "bucket": bucket,
                "after": after, "count": count, "keys": keys}
        try:
            resp = await self.service._to_member(url, "/internal/wan_copy_batch", body)  # noqa: SLF001
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.TimeoutException) as exc:
            # Not connected, or no answer in time: worth asking again (the directory may name another owner).
            raise MemberRefused(f"owner {url} unreachable: {type(exc).__name__}: {exc}", True) from exc
        try:
            data = resp.json()
        except ValueError:
            raise MemberRefused(f"owner {url} answered {resp.status_code} without JSON",
                                resp.status_code >= 500) from None
        if resp.status_code != 200 or not isinstance(data, dict):
            message = data.get("message", data) if isinstance(data, dict) else data
            retriable = data.get("retriable", resp.status_code >= 500) if isinstance(data, dict) else False
            raise MemberRefused(f"owner {url} answered {resp.status_code}: {message}", bool(retriable))
        try:
            return BatchAnswer.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MemberRefused(f"owner {url} answered a batch with {data!r:.200}: {exc}", False) from None

    # --- the bucket's owner ---------------------------------------------------------------------

    async def copy_owned(self, copy_id: str, region: str, sender_id: str, bucket: int, after: str | None,
                         count: int, keys: list[str] | None) -> BatchAnswer:
        """One batch of a bucket this instance owns (module docstring, step 3): ``keys``, or the next
        ``count`` live keys after ``after``; answered once the batch is committed.  ``count`` 0 only
        counts the bucket's live entries."""
        engine = self.service.engine
        assert engine is not None
        if not engine.is_ready(region, bucket):
            await asyncio.to_thread(engine.wait_ready, region, bucket, 1.0)
        if keys is not None:
            batch, total, last, done = keys, len(keys), None, True
        else:
            snapshot = self.snapshots.get(copy_id, region, bucket)
            if snapshot is None:
                if count == 0:
                    return BatchAnswer(await asyncio.to_thread(self._live_count, region, bucket), 0, {}, None, False)
                snapshot = await asyncio.to_thread(self._live_keys, region, bucket)
                self.snapshots.put(copy_id, region, bucket, snapshot)
            start = 0 if after is None else bisect.bisect_right(snapshot, after)
            batch = snapshot[start:start + count]
            total = len(snapshot)
            done = start + count >= len(snapshot)
            last = None if done or not batch else batch[-1]
        if not batch:
            if done and keys is None:
                self.snapshots.drop(copy_id, region, bucket)
            return BatchAnswer(total, 0, {}, last, done)
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[SluiceError | None] = loop.create_future()

        def on_done(error: SluiceError | None) -> None:
            loop.call_soon_threadsafe(lambda: committed.done() or committed.set_result(error))

        counts = await asyncio.to_thread(engine.copy_entries, region, bucket, batch, sender_id,
                                         destroyed=keys is not None, on_done=on_done)
        try:
            error = await asyncio.wait_for(committed, self.service.request_timeout_s)
        except asyncio.TimeoutError:
            error = BrokerUnavailable("the copied entries were not committed by Kafka in time")
        if error is not None:
            raise error
        if done and keys is None:
            self.snapshots.drop(copy_id, region, bucket)
        copied = counts.pop("copied")
        return BatchAnswer(total, copied, {k: v for k, v in counts.items() if v}, last, done)

    def _live_keys(self, region: str, bucket: int) -> list[str]:
        engine = self.service.engine
        assert engine is not None
        state = engine.read(region, bucket)
        with engine.read_lock:
            keys = list(state.keys())
        keys.sort()
        return keys

    def _live_count(self, region: str, bucket: int) -> int:
        engine = self.service.engine
        assert engine is not None
        state = engine.read(region, bucket)
        with engine.read_lock:
            return state.size()


__all__ = ["BatchAnswer", "CopyState", "SKIP_REASONS", "Snapshots", "WanCopies", "WanCopy", "WanCopyRunning"]
