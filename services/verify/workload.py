"""The two sites' writers: creates, updates, put_alls and destroys, and updates of keys both sites write.

Every operation is logged as ``Issued`` before its answer is known, with the
EventID it carries (retries keep it), and marked acknowledged when the region
service answered OK: the writers' log the history checker judges against.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.events import EventID
from .history import Issued

KEYS = 200
HOT_KEYS = 10  # written by both sites: the conflicts


@dataclass
class Written:
    """The writers' log: every operation issued, and whether it was acknowledged."""

    issued: list[tuple[str, Issued]] = field(default_factory=list)  # (region, operation)
    refused: int = 0  # answered with an error (not a destroy racing the other site's)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Wall-clock time of each site's last acknowledged write, and the longest gap between two.
    last_ack: dict[str, float] = field(default_factory=dict)
    longest_gap: dict[str, float] = field(default_factory=dict)

    def note(self, site: str, region: str, kind: str, keys: list[str], first: EventID, acknowledged: bool) -> None:
        now = time.time()
        with self.lock:
            for i, key in enumerate(keys):
                eid = EventID(first.member_id, first.thread_id, first.sequence_id + i)
                self.issued.append((region, Issued(key, eid, site, kind, None, acknowledged)))
            if acknowledged:
                if site in self.last_ack:
                    self.longest_gap[site] = max(self.longest_gap.get(site, 0.0), now - self.last_ack[site])
                self.last_ack[site] = now

    def of_region(self, region: str) -> list[Issued]:
        """The issued operations on ``region``."""
        return [op for r, op in self.issued if r == region]

    @property
    def operations(self) -> int:
        return len(self.issued)

    @property
    def acknowledged(self) -> int:
        return sum(1 for _, op in self.issued if op.acknowledged)


class Budget:
    """Operations left to write (or seconds left, with ``duration_s``), shared by the writers."""

    def __init__(self, events: int, duration_s: float | None) -> None:
        self.left = events
        self.until = None if duration_s is None else time.monotonic() + duration_s
        self.duration_s = duration_s
        self.started = time.monotonic()
        self.done = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.until is not None:
                if time.monotonic() >= self.until:
                    return False
            elif self.left <= 0:
                return False
            self.left -= n
            self.done += n
            return True

    @property
    def fraction(self) -> float:
        if self.until is not None and self.duration_s:
            return min(1.0, (time.monotonic() - self.started) / self.duration_s)
        total = self.done + max(self.left, 0)
        return self.done / total if total else 1.0


def write_site(site: str, urls: list[str], rng: random.Random, budget: Budget, written: Written,
               rate_per_s: float | None = None, token: str | None = None) -> None:
    """One site's writer: puts, put_alls and destroys of ``orders``, puts of ``customers``, and updates of the
    hot keys both sites write.  ``urls``: the site's region-service instances (restarted on the same ports
    under faults).  ``rate_per_s``: at most this many calls a second.  ``token``: the region's client token."""
    from ..client import RegionClient, RegionError
    from ..core.errors import SluiceError

    # Each site writes its own half of the keys past the hot ones: no conflicts there.
    lo = HOT_KEYS if site == "a" else (HOT_KEYS + KEYS) // 2
    hi = (HOT_KEYS + KEYS) // 2 if site == "a" else KEYS
    client = RegionClient(urls, token=token, member_id=f"demo-writer-{site}", retry_for_s=60)
    present: set[str] = set()
    pace = 1.0 / rate_per_s if rate_per_s else 0.0
    next_at = time.monotonic()
    try:
        while budget.take(1):
            if pace:
                next_at += pace
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            roll = rng.random()
            if roll < 0.15:
                region, kind = "orders", "put"
                keys = [f"order-{rng.randrange(HOT_KEYS):04d}"]  # contested: both sites write these
                call: Any = lambda eid, k=keys[0]: client.put("orders", k, {"site": site, "t": time.time()},
                                                              event_id=eid)
            elif roll < 0.25:
                region, kind = "orders", "put_all"
                entries = {f"order-{rng.randrange(lo, hi):04d}": {"site": site, "qty": rng.randrange(9)}
                           for _ in range(10)}
                keys = list(entries)
                call = lambda eid, e=entries: client.put_all("orders", e, event_id=eid)
                budget.take(len(keys) - 1)
            elif roll < 0.32 and present:
                region, kind = "orders", "destroy"
                keys = [rng.choice(sorted(present))]
                call = lambda eid, k=keys[0]: client.destroy("orders", k, event_id=eid)
            elif roll < 0.40 and site == "a":
                region, kind = "customers", "put"
                keys = [f"customer-{rng.randrange(50):03d}"]
                call = lambda eid, k=keys[0]: client.put("customers", k, {"n": rng.randrange(1000)}, event_id=eid)
            else:
                region, kind = "orders", "put"
                keys = [f"order-{rng.randrange(lo, hi):04d}"]
                call = lambda eid, k=keys[0]: client.put("orders", k, {"site": site, "qty": rng.randrange(100)},
                                                         event_id=eid)
            eid = client.next_event_id(len(keys))
            try:
                call(eid)
            except RegionError as exc:
                written.note(site, region, kind, keys, eid, acknowledged=False)
                if kind == "destroy":
                    present.discard(keys[0])
                if exc.error != "EntryNotFound":  # a destroy racing the other site's: expected
                    with written.lock:
                        written.refused += 1
                continue
            except SluiceError:
                # Not answered in time (a site down longer than the retries): maybe applied, at most once.
                written.note(site, region, kind, keys, eid, acknowledged=False)
                continue
            written.note(site, region, kind, keys, eid, acknowledged=True)
            if kind == "destroy":
                present.discard(keys[0])
            elif region == "orders" and kind in ("put", "put_all") and roll >= 0.15:
                present.update(keys)
    finally:
        client.close()
