"""Subscription benchmarks: one writer, 100 subscribed clients, each interested in 10 % of the keys.

``subscriptions.fanout`` runs a site with region ``orders`` (8 buckets, no
queues attached), served by one region-service process, and **two
subscription-service processes** (``sluice subscriptions``) sharing the
clients' registry partitions.  100 ``ClientCache`` clients, in
``CLIENT_PROCESSES`` child processes of 25 (``python -m bench.subscriptions
clients``, so they share no GIL with the runner or each other), each
register interest in a list of 10 % of ``KEYS`` keys; every key is in the
interest of exactly 10 clients.  README.md says what each figure means.

1. Setup (not timed): the services, then the clients (constructed,
   ``register_interest``, ``ready_for_events``, live at the marker).  A
   warm-up chunk (every key written once) goes through the whole path.
2. Throughput: one writer thread (``RegionClient.put_all`` chunks of 1000,
   one after the other) writes ``events`` updates, every key in turn;
   timed from the first ``put_all`` call to the last delivery to a client's
   listener.  The figure is the deliveries (events × 10 clients) per second.
3. Latency: the same writer writes at a steady ``LATENCY_RATE`` (chunks
   paced by the clock, as gateway.latency); each delivery's latency runs
   from the start of the ``put_all`` that wrote it (the time is in the
   value) to the moment the client's listener has it.  A raw confluent-kafka
   consumer in the runner tails the region's changelog during the same
   seconds and times the same updates' arrival there: the latency baseline.
4. The clients close and hand over what they received; verify: every
   client received exactly the updates of its keys (each once, in each
   key's order), nothing else.  The services stop.
5. Throughput baseline, alone on the broker: a raw confluent-kafka consumer
   reads the whole changelog from its beginning (a warm-up pass, then timed
   passes, the median), records/s.

``python -m bench.subscriptions clients …`` is the client process: it
prints ``ready`` once its clients are live, ``count N`` lines while events
arrive, and on ``stop`` (stdin) closes its clients, writes what each
received (update number, arrival time) to a JSON file and prints ``done``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from sluice.client import ClientCache, RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.jsonvalue import decode as decode_value
from sluice.core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    TopicPartition,
    consume_available,
    describe_group_members,
    make_admin,
)
from sluice.core.processes import RegionProcess, SubscriptionsProcess, die_with_parent

from .dispatcher import raw_consumer_settings
from .gateway import paced_writes, watcher_settings
from .harness import REPO, Context, Result, benchmark
from .region import VALUE_BYTES, count_records, percentile
from .site import write_site

REGION = "orders"
BUCKETS = 8
#: Subscription-service instances (processes); they share the registry's partitions.
SUBSCRIPTION_INSTANCES = 2
CLIENTS = 100
#: Client processes (CLIENTS / CLIENT_PROCESSES clients each): 100 ClientCache
#: objects are 100 consumers, producers and admin clients, and every delivery
#: is decoded in Python: in one process they would share one GIL.
CLIENT_PROCESSES = 4
#: Keys of the region; each client registers interest in KEYS / INTEREST_GROUPS
#: of them, and each key is in the interest of CLIENTS / INTEREST_GROUPS clients.
KEYS = 1000
INTEREST_GROUPS = 10
#: Updates written in the throughput part (every key in turn), in put_all chunks.
BATCH_ENTRIES = 1000
#: The latency part: a steady rate, put_all chunks paced by the clock: 100
#: updates/s are 1,000 deliveries/s, about a seventh of what the fan-out
#: delivered flat out on the 2-core machine (~7,600/s), so that the figure is
#: the path's delay, not a backlog's age.  (A put_all of 10 took 35–60 ms here
#: with the 100 clients live: one writer thread reaches ~170 chunks/s.)
LATENCY_RATE = 100
LATENCY_CHUNK = 10
#: Timed passes of the raw consumer (after a warm-up pass); the median is reported.  The
#: changelog holds ~23k records (quick: ~3k), read in tens of milliseconds: passes vary a lot.
RAW_PASSES = 9
#: Seconds to wait for every delivery of a part before failing.
DELIVERY_TIMEOUT_S = 180.0
#: Seconds to wait after the last expected delivery for anything extra (a repeat) to arrive.
SETTLE_S = 1.0
#: Client construction, interest registration and marker, per client process.
SETUP_TIMEOUT_S = 120.0
#: Seconds the CPU of the idle system (clients live, nothing written) is measured.
IDLE_S = 2
IDLE_S_QUICK = 1
#: Clients a client process sets up at the same time (each waits on the service's answers).
SETUP_THREADS = 25

RAW_CONSUMER = "raw.consumer"


# --- the workload ---------------------------------------------------------------------------


def key_name(j: int) -> str:
    return f"fan-{j:09d}"  # 13 bytes


def key_of_seq(seq: int) -> int:
    """Update ``seq`` writes key ``seq % KEYS``: every key in turn, so a chunk of 1000 has no key twice."""
    return seq % KEYS


def interest_of_client(i: int) -> list[int]:
    """Client ``i``'s keys: one in each block of INTEREST_GROUPS consecutive keys.

    In block ``b`` client ``i = 10q + s`` takes offset ``(s + b·q) mod 10``:
    for each ``q`` exactly one ``s`` takes a given offset, so every key is
    in the interest of exactly ``CLIENTS / INTEREST_GROUPS`` clients, and no
    two clients have the same keys.
    """
    g = INTEREST_GROUPS
    s, q = i % g, i // g
    return [b * g + (s + b * q) % g for b in range(KEYS // g)]


def client_id(i: int) -> str:
    return f"fanout-{i:03d}"


_PAD = "x" * VALUE_BYTES


def make_value(seq: int, written_at: float) -> dict[str, Any]:
    """An update of VALUE_BYTES of JSON carrying its number and the wall time its put_all began."""
    value: dict[str, Any] = {"seq": seq, "t": written_at, "note": ""}
    value["note"] = _PAD[: max(0, VALUE_BYTES - len(orjson.dumps(value)))]
    return value


def chunk(first: int, count: int, stamps: list[float]) -> dict[str, Any]:
    """Updates ``first`` … ``first + count - 1`` as one put_all body, stamped now (also in ``stamps[seq]``)."""
    now = time.time()
    body = {}
    for s in range(first, first + count):
        stamps[s] = now
        body[key_name(key_of_seq(s))] = make_value(s, now)
    return body


# --- the client processes ------------------------------------------------------------------


class _Recorder:
    """A client's listener: the update number and wall time of every value it is given, in order."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.arrivals: list[float] = []
        self.keys: list[str] = []
        self.other = 0

    def _keep(self, event: Any) -> None:
        now = time.time()
        value = event.new_value
        if not isinstance(value, dict) or "seq" not in value:
            self.other += 1
            return
        self.seqs.append(value["seq"])
        self.arrivals.append(now)
        self.keys.append(event.key)

    after_create = after_update = _keep

    def _other(self, _event: Any) -> None:
        self.other += 1

    after_destroy = after_invalidate = _other


def run_clients(site: Path, region_url: str, first: int, count: int, out: Path) -> int:
    """``python -m bench.subscriptions clients``: clients ``first`` … ``first + count - 1`` of the benchmark.

    stdout: ``ready SECONDS`` once every client is live, then ``count N``
    (events received so far, all clients of this process) every 50 ms while
    it changes; ``done`` once closed and written.  stdin: ``stop``.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cfg = load_config(site)
    started = time.monotonic()
    ids = list(range(first, first + count))
    caches: dict[int, ClientCache] = {}
    recorders = {i: _Recorder() for i in ids}
    lock = threading.Lock()

    def setup(i: int) -> None:
        cache = ClientCache(cfg, client_id(i), region_urls=[region_url])
        with lock:
            caches[i] = cache
        region = cache.region(REGION)
        region.add_listener(recorders[i])
        region.register_interest([key_name(j) for j in interest_of_client(i)])
        cache.ready_for_events()
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while not cache.live:
            if cache.error is not None:
                raise RuntimeError(f"client {client_id(i)}: {cache.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"client {client_id(i)}: no marker in {SETUP_TIMEOUT_S:.0f}s")
            time.sleep(0.01)

    try:
        with ThreadPoolExecutor(min(SETUP_THREADS, count)) as pool:
            for f in [pool.submit(setup, i) for i in ids]:
                f.result()
        print(f"ready {time.monotonic() - started:.2f}", flush=True)
        stop = threading.Event()

        def read_stdin() -> None:
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            stop.set()

        threading.Thread(target=read_stdin, daemon=True).start()
        last = -1
        while not stop.wait(0.05):
            n = sum(len(r.seqs) for r in recorders.values())
            if n != last:
                print(f"count {n}", flush=True)
                last = n
            failed = [c for c in caches.values() if c.error is not None]
            if failed:
                raise RuntimeError(f"client {failed[0].client_id}'s queue reader stopped: {failed[0].error!r}")
        result = {}
        for i in ids:
            cache, rec = caches[i], recorders[i]
            result[client_id(i)] = {"seqs": rec.seqs, "arrivals": rec.arrivals, "keys": rec.keys,
                                    "other": rec.other, "processed": cache.processed(),
                                    "error": None if cache.error is None else repr(cache.error)}
        out.write_bytes(orjson.dumps(result))
    finally:
        with ThreadPoolExecutor(min(SETUP_THREADS, max(1, len(caches)))) as pool:
            list(pool.map(lambda c: c.close(), list(caches.values())))
    print("done", flush=True)
    return 0


class ClientProcess:
    """One client process of the benchmark: its stdout read by a thread, counts summed by the caller."""

    def __init__(self, n: int, site: Path, region_url: str, first: int, count: int, workdir: Path) -> None:
        self.n = n
        self.out = workdir / f"clients-{n}.json"
        self.log_path = workdir / f"clients-{n}.log"
        self._log = open(self.log_path, "ab")
        self.count = 0
        self.ready_s: float | None = None
        self.done = threading.Event()
        self.ready = threading.Event()
        self.on_count: Callable[[int], None] = lambda _delta: None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.subscriptions", "clients", str(site), region_url, str(first), str(count),
             str(self.out)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True, preexec_fn=die_with_parent,  # noqa: PLW1509 - only calls prctl
        )
        self._reader = threading.Thread(target=self._read, name=f"clients-{n}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("count "):
                n = int(line.split()[1])
                delta, self.count = n - self.count, n
                self.on_count(delta)
            elif line.startswith("ready "):
                self.ready_s = float(line.split()[1])
                self.ready.set()
            elif line == "done":
                self.done.set()
        self.ready.set()
        self.done.set()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def exited(self) -> str | None:
        if self.proc.poll() is not None and not self.done.is_set():
            return f"client process {self.n} exited ({self.proc.returncode}); log:\n{self.log_tail()}"
        return None

    def request_stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b"stop\n")
                self.proc.stdin.flush()

    def results(self, timeout_s: float) -> dict[str, Any]:
        """After ``request_stop``: what its clients received (client id → seqs, arrivals, …)."""
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"client process {self.n} did not finish in {timeout_s:.0f}s; log:\n{self.log_tail()}")
        self.proc.wait(30)
        if self.proc.returncode != 0 or not self.out.is_file():
            raise RuntimeError(f"client process {self.n} failed (exit {self.proc.returncode}); log:\n{self.log_tail()}")
        return dict(orjson.loads(self.out.read_bytes()))

    def stop(self) -> None:
        """SIGTERM (then SIGKILL) if still running.  Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()


class Clients:
    """The client processes together: summed counts, waiting for a total, results."""

    def __init__(self, procs: list[ClientProcess]) -> None:
        self.procs = procs
        self._advance: Callable[[int], None] | None = None
        for p in procs:
            p.on_count = self._counted

    def _counted(self, delta: int) -> None:
        if self._advance is not None:
            self._advance(delta)

    @property
    def total(self) -> int:
        return sum(p.count for p in self.procs)

    @contextlib.contextmanager
    def advancing(self, advance: Callable[[int], None]) -> Iterator[None]:
        self._advance = advance
        try:
            yield
        finally:
            self._advance = None

    def wait_total(self, target: int, timeout_s: float, alive: Callable[[], str | None]) -> None:
        end = time.monotonic() + timeout_s
        while self.total < target:
            for p in self.procs:
                dead = p.exited()
                if dead is not None:
                    raise RuntimeError(dead)
            dead = alive()
            if dead is not None:
                raise RuntimeError(f"{dead}; {self.total:,} of {target:,} deliveries")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.total:,} of {target:,} deliveries after {timeout_s:.0f}s")
            time.sleep(0.01)


# --- the raw consumer ------------------------------------------------------------------------


class ChangelogWatcher:
    """The latency baseline: a raw consumer tailing the changelog from its current end, in a thread.

    ``arrivals[i]`` is the wall time update ``first_seq + i`` was read (the
    update number is in the value: each record is decoded, after its arrival
    time is taken).  Records of earlier updates are skipped: on Tansu the
    "current end" can lie before the last records written (KAFKA-NOTES quirk 3).
    """

    def __init__(self, bootstrap: str, topic: str, first_seq: int, total: int) -> None:
        self.topic = topic
        self.first_seq = first_seq
        self.total = total
        self.arrivals: list[float | None] = [None] * total
        self.count = 0
        self.extra = 0
        self.failure: BaseException | None = None
        self._codec = get_codec()
        self._consumer = Consumer(watcher_settings(bootstrap))
        self._stopping = threading.Event()
        self._reached = threading.Event()
        parts = []
        for p in range(BUCKETS):
            _low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            parts.append(TopicPartition(topic, p, high))
        self._consumer.assign(parts)
        self._thread = threading.Thread(target=self._run, name="changelog-watcher", daemon=True)
        self._thread.start()

    def _seq(self, raw: bytes) -> int:
        record = self._codec.decode_as("EntryEvent", raw)
        return int(decode_value(record["value"], record["value_encoding"])["seq"])

    def _run(self) -> None:
        consumer = self._consumer
        try:
            while not self._stopping.is_set():
                # What a user writes to follow a topic: wait for the first record, take what else came.
                first = consumer.poll(0.1)
                if first is None:
                    continue
                msgs = [first, *consumer.consume(999, 0)]
                now = time.time()
                for msg in msgs:
                    if msg.error() is not None:
                        raise RuntimeError(f"reading {self.topic}: {msg.error()}")
                    i = self._seq(msg.value()) - self.first_seq
                    if i < 0:
                        continue  # written before this part
                    if i >= self.total or self.arrivals[i] is not None:
                        self.extra += 1
                        continue
                    self.arrivals[i] = now
                    self.count += 1
                if self.count >= self.total:
                    self._reached.set()
        except BaseException as exc:  # noqa: BLE001 - the top of a thread: handed to the waiter
            self.failure = exc
            self._reached.set()

    def wait_reached(self, timeout_s: float) -> None:
        if not self._reached.wait(timeout_s):
            raise TimeoutError(f"raw consumer: {self.count} of {self.total} updates read from {self.topic}")
        if self.failure is not None:
            raise RuntimeError(f"raw consumer on {self.topic} failed: {self.failure!r}") from self.failure

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)
        self._consumer.close()


def raw_read(bootstrap: str, topic: str, counts: dict[int, int]) -> float:
    """One raw consumer reads ``topic`` from its beginning until it has ``counts`` records of each partition;
    seconds from ``assign`` to the last record.

    Records are counted, not offsets: a transactional writer's commit
    markers take offsets too.  The topic's metadata is fetched before the
    clock starts (a cold consumer waits ~0.5 s on librdkafka's offset-query
    retry timer first, see bench/dispatcher.py).
    """
    remaining = {p: n for p, n in counts.items() if n > 0}
    expected = sum(remaining.values())
    consumer = Consumer(raw_consumer_settings(bootstrap))
    try:
        consumer.list_topics(topic, timeout=10)
        read = 0
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        t0 = time.perf_counter()
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in counts])
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw consumer: {read} of {expected} records of {topic} read")
            # What has arrived, as soon as anything has (consume(n, t) would wait out t for the last few).
            for msg in consume_available(consumer, 1000, 1.0):
                if msg.error() is not None:
                    raise RuntimeError(f"raw consumer: {msg.error()}")
                p = msg.partition()
                read += 1
                left = remaining.get(p)
                if left is None:
                    raise RuntimeError(f"raw consumer: {topic}[{p}] holds more records than the {counts.get(p, 0)} "
                                       "counted")
                if left == 1:
                    del remaining[p]
                else:
                    remaining[p] = left - 1
        elapsed = time.perf_counter() - t0
        if read != expected:
            raise RuntimeError(f"raw consumer: read {read} records of {topic}, expected {expected}")
        return elapsed
    finally:
        consumer.close()


# --- checks -------------------------------------------------------------------------------------


def verify(results: dict[str, Any], written: int) -> tuple[int, int]:
    """Every client got exactly the updates 0 … written-1 of its keys, each once, in each key's order.

    Returns (deliveries, repeats the clients discarded).  Raises on any loss,
    duplicate, reordering or stranger.
    """
    problems: list[str] = []
    deliveries = repeats = 0
    for i in range(CLIENTS):
        cid = client_id(i)
        got = results.get(cid)
        if got is None:
            problems.append(f"{cid}: no results")
            continue
        if got["error"]:
            problems.append(f"{cid}: queue reader failed: {got['error']}")
        keys = set(interest_of_client(i))
        expected = [s for s in range(written) if key_of_seq(s) in keys]
        seqs = got["seqs"]
        deliveries += len(seqs)
        repeats += got["processed"].get("repeats", 0)
        if got["other"]:
            problems.append(f"{cid}: {got['other']} events other than creates and updates")
        wrong_key = sum(1 for s, k in zip(seqs, got["keys"]) if k != key_name(key_of_seq(s)))
        if wrong_key:
            problems.append(f"{cid}: {wrong_key} events carry another key's value")
        if sorted(seqs) != expected:
            have = set(seqs)
            lost = sum(1 for s in expected if s not in have)
            dups = len(seqs) - len(have)
            strangers = len(have - set(expected))
            problems.append(f"{cid}: {len(seqs)} events, expected {len(expected)}: {lost} lost, {dups} duplicates, "
                            f"{strangers} not of its interest")
            continue
        last: dict[int, int] = {}
        out_of_order = 0
        for s in seqs:
            k = key_of_seq(s)
            if last.get(k, -1) > s:
                out_of_order += 1
            last[k] = s
        if out_of_order:
            problems.append(f"{cid}: {out_of_order} events arrived before an earlier update of their key")
    if problems:
        raise RuntimeError(f"{len(problems)} of {CLIENTS} clients did not receive what they should: "
                           + "; ".join(problems[:5]))
    return deliveries, repeats


# --- helpers ---------------------------------------------------------------------------------


def owned_from_log(text: str) -> set[int]:
    """The registry partitions an instance's log says it is primary of now (its gains minus its losses, in order)."""
    owned: set[int] = set()
    for m in re.finditer(r"(no longer )?primary for registry partitions \[([0-9, ]*)\]", text):
        parts = {int(p) for p in m.group(2).split(",") if p.strip()}
        owned = owned - parts if m.group(1) else owned | parts
    return owned


def wait_primaries(ctx: Context, group: str, subs: list[SubscriptionsProcess], partitions: int,
                   timeout_s: float = 60.0) -> float:
    """Wait until every instance is primary of some registry partitions and all are owned; seconds waited.

    The group's description says so; on Tansu, which describes a group
    without its members, the instances' log lines count too.
    """
    admin = make_admin({"bootstrap.servers": ctx.bootstrap})
    started = time.monotonic()
    owned: list[set[int]] = []

    def settled(sets: list[set[int]]) -> bool:
        return (len(sets) == len(subs) and all(sets) and sum(map(len, sets)) == partitions
                and set().union(*sets) == set(range(partitions)))

    while True:
        for s in subs:
            if s.proc.poll() is not None:
                raise RuntimeError(f"a subscription service exited ({s.proc.returncode}); log:\n{s.log_tail()}")
        with contextlib.suppress(Exception):  # the group may not exist yet
            owned = [{p for _, p in tps} for _, tps in describe_group_members(admin, group)]
            if settled(owned):
                return time.monotonic() - started
        if settled([owned_from_log(s.log_tail(200_000)) for s in subs]):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the subscription services are not primaries of every registry partition after "
                               f"{timeout_s:.0f}s: {owned}")
        time.sleep(0.1)


def process_gone(*procs: Any) -> Callable[[], str | None]:
    def check() -> str | None:
        for p in procs:
            if p.proc.poll() is not None:
                return f"{p.banner.strip()} (pid {p.pid}) exited ({p.proc.returncode}); log:\n{p.log_tail(1500)}"
        return None

    return check


def write_chunks(client: RegionClient, first: int, count: int, size: int, stamps: list[float]) -> None:
    """Updates ``first`` … ``first + count - 1`` in put_all chunks of ``size``, one after the other."""
    for s in range(first, first + count, size):
        client.put_all(REGION, chunk(s, min(size, first + count - s), stamps))


# --- the benchmark ---------------------------------------------------------------------------


@benchmark("subscriptions.fanout", "1 writer → 100 clients with 10% key interest: deliveries/s and "
           "update → client p50/p99 vs a raw changelog consumer")
def fanout(ctx: Context) -> list[Result]:
    events = ctx.sized(20_000, 2_000)
    latency_s = ctx.sized(20, 3)
    latency_warm_s = 1
    warm = KEYS  # one chunk: every key once
    latency_warm = LATENCY_RATE * latency_warm_s
    latency_events = LATENCY_RATE * latency_s
    per_key = CLIENTS // INTEREST_GROUPS
    assert events % BATCH_ENTRIES == 0 and KEYS % LATENCY_CHUNK == 0 and CLIENTS % CLIENT_PROCESSES == 0
    first, first_lat = warm, warm + events
    total_lat = latency_warm + latency_events
    written = first_lat + total_lat
    #: The wall time each update's put_all began.
    stamps = [0.0] * written

    path = ctx.workdir / "site.yaml"
    cfg = write_site(path, bootstrap=ctx.bootstrap, prefix=ctx.topic_prefix(), region=REGION, buckets=BUCKETS,
                     parallel_senders=0)
    changelog = cfg.topics.region_changelog(REGION)
    procs: list[Any] = []
    clients: list[ClientProcess] = []
    try:
        region = RegionProcess(path, ctx.workdir / "region.log")
        procs.append(region)
        region.wait_ready()
        subs = []
        for n in range(SUBSCRIPTION_INSTANCES):
            s = SubscriptionsProcess(path, ctx.workdir / f"subscriptions-{n}.log")
            procs.append(s)
            subs.append(s)
        waited = wait_primaries(ctx, f"{cfg.kafka.topic_prefix}subscriptions", subs,
                                cfg.subscriptions.registry_partitions)
        ctx.step(f"region service (pid {region.pid}) and {len(subs)} subscription services "
                 f"(pids {', '.join(str(s.pid) for s in subs)}) up; primaries of the "
                 f"{cfg.subscriptions.registry_partitions} registry partitions after {waited:.1f}s")

        ctx.step(f"starting {CLIENTS} clients in {CLIENT_PROCESSES} processes, each interested in "
                 f"{KEYS // INTEREST_GROUPS} of {KEYS} keys")
        t_setup = time.monotonic()
        size = CLIENTS // CLIENT_PROCESSES
        for n in range(CLIENT_PROCESSES):
            clients.append(ClientProcess(n, path, region.url, n * size, size, ctx.workdir))
        group = Clients(clients)
        alive = process_gone(region, *subs)
        for c in clients:
            if not c.ready.wait(SETUP_TIMEOUT_S) or c.ready_s is None:
                raise RuntimeError(f"client process {c.n} did not get ready (exit {c.proc.poll()}); "
                                   f"log:\n{c.log_tail()}")
        ctx.note(f"{CLIENTS} clients live (constructed, interest registered, marker seen) in "
                 f"{time.monotonic() - t_setup:.1f}s")
        measured = {"region": region.pid, "subscriptions": [s.pid for s in subs], "clients": [c.pid for c in clients]}
        idle_s = ctx.sized(IDLE_S, IDLE_S_QUICK)
        with ctx.cpu_use(f"idle ({idle_s:.0f}s, {CLIENTS} clients live, nothing written)", measured):
            time.sleep(idle_s)
        with RegionClient(region.url, timeout_s=60, retry_for_s=60) as writer:
            # Warm-up: every key once, through the whole path.
            with ctx.counting("warm-up deliveries", warm * per_key) as advance, group.advancing(advance):
                write_chunks(writer, 0, warm, BATCH_ENTRIES, stamps)
                group.wait_total(warm * per_key, DELIVERY_TIMEOUT_S, alive)

            # Throughput: as fast as one writer thread goes.
            target = (warm + events) * per_key
            ctx.step(f"throughput: {events:,} updates in put_all chunks of {BATCH_ENTRIES} from one thread "
                     f"→ {events * per_key:,} deliveries")
            with ctx.counting("deliveries", events * per_key) as advance, group.advancing(advance), \
                    contextlib.ExitStack() as stack:
                for n, s in enumerate(subs):
                    stack.enter_context(ctx.profiling(s.pid, f"subscriptions-{n}"))
                stack.enter_context(ctx.profiling(clients[0].pid, "clients-0"))
                cpu = stack.enter_context(ctx.cpu_use("throughput", measured))
                t0 = time.time()
                write_chunks(writer, first, events, BATCH_ENTRIES, stamps)
                written_s = time.time() - t0
                group.wait_total(target, DELIVERY_TIMEOUT_S, alive)
            ctx.step(f"throughput: written in {written_s:.2f}s ({events / written_s:,.0f} updates/s)")
            throughput_cpu = cpu.seconds()

            # Latency: a steady rate, with the raw consumer tailing the changelog.
            target = written * per_key
            ctx.step(f"latency: {total_lat:,} updates at {LATENCY_RATE:,}/s in chunks of {LATENCY_CHUNK} "
                     f"({latency_warm:,} warm-up) → {LATENCY_RATE * per_key:,} deliveries/s")
            watcher = ChangelogWatcher(ctx.bootstrap, changelog, first_lat, total_lat)
            try:
                sent_at = [0.0] * total_lat

                def write(first_i: int, count: int) -> None:
                    writer.put_all(REGION, chunk(first_lat + first_i, count, stamps))

                with ctx.counting("latency deliveries", total_lat * per_key) as advance, group.advancing(advance), \
                        ctx.cpu_use("latency", measured):
                    achieved, late = paced_writes(total_lat, LATENCY_RATE, LATENCY_CHUNK, 1, write, sent_at)
                    watcher.wait_reached(DELIVERY_TIMEOUT_S)
                    group.wait_total(target, DELIVERY_TIMEOUT_S, alive)
                time.sleep(SETTLE_S)  # anything extra (a repeat) would arrive now
            finally:
                watcher.stop()
            if watcher.extra:
                raise RuntimeError(f"the raw consumer read {watcher.extra} changelog records more than the updates written")
            ctx.note(f"latency: written at {achieved:,.0f} updates/s (the latest chunk started "
                     f"{late * 1000:,.0f} ms after its time)")
            if achieved < 0.95 * LATENCY_RATE:
                ctx.note(f"latency: the writer did not keep {LATENCY_RATE:,}/s ({achieved:,.0f}/s)")

        for c in clients:
            c.request_stop()
        results: dict[str, Any] = {}
        for c in clients:
            results.update(c.results(60))
        deliveries, repeats = verify(results, written)
        ctx.step(f"verified: {deliveries:,} deliveries to {CLIENTS} clients, each exactly the updates of its "
                 f"keys, once, in order; {repeats} repeats discarded by the clients")
        if repeats:
            ctx.note(f"the clients discarded {repeats} repeated events")
    finally:
        for c in clients:
            c.stop()
        for p in reversed(procs):
            p.stop()

    # The figures.  Arrivals and write times are wall clock (time.time()), in
    # every process of this machine alike.
    throughput_seqs = range(first, first + events)
    arrivals = [at for got in results.values() for s, at in zip(got["seqs"], got["arrivals"])
                if first <= s < first + events]
    delivered_s = max(arrivals) - t0
    delivered = len(arrivals) / delivered_s
    ctx.note(f"throughput: {len(arrivals):,} deliveries in {delivered_s:.2f}s from the first put_all (writing "
             f"took {written_s:.2f}s; the first delivery came {(min(arrivals) - t0) * 1000:,.0f} ms after the first "
             f"put_all); {len(throughput_seqs) / delivered_s:,.0f} updates/s fanned out to {per_key} clients each")
    measured_from = first_lat + latency_warm
    sluice_ms = [(at - stamps[s]) * 1000 for got in results.values() for s, at in zip(got["seqs"], got["arrivals"])
                 if s >= measured_from]
    raw_ms = []
    for i in range(latency_warm, total_lat):
        at = watcher.arrivals[i]
        assert at is not None
        raw_ms.append((at - stamps[first_lat + i]) * 1000)
    lag_s = max(at for got in results.values() for s, at in zip(got["seqs"], got["arrivals"])
                if s >= measured_from) - stamps[written - 1]
    ctx.note(f"latency ms p50/p99/max: clients {percentile(sluice_ms, 50):.1f}/{percentile(sluice_ms, 99):.1f}/"
             f"{max(sluice_ms):.1f} ({len(sluice_ms):,} deliveries), raw consumer on the changelog "
             f"{percentile(raw_ms, 50):.1f}/{percentile(raw_ms, 99):.1f}/{max(raw_ms):.1f} ({len(raw_ms):,} updates); "
             f"the last delivery came {lag_s * 1000:,.0f} ms after the last put_all began")
    if lag_s > 2.0:
        ctx.note(f"latency: the clients ended {lag_s:.1f}s behind the writer: the fan-out did not keep up with "
                 f"{LATENCY_RATE * per_key:,} deliveries/s, so the latency is the age of a growing backlog")

    # The throughput baseline, alone on the broker: the whole changelog, read from its beginning.
    counts = raw_counts(ctx, changelog, written)
    ctx.step(f"raw consumer: {written:,} changelog records from the beginning, a warm-up pass and "
             f"{RAW_PASSES} timed passes")
    raw_read(ctx.bootstrap, changelog, counts)
    rates = []
    with ctx.counting("raw consumer passes", RAW_PASSES) as advance, ctx.cpu_use("raw consumer", {}):
        for _ in range(RAW_PASSES):
            rates.append(written / raw_read(ctx.bootstrap, changelog, counts))
            advance(1)
    raw_rate = statistics.median(rates)
    ctx.step(f"raw consumer: {raw_rate:,.0f} records/s (median; passes: {', '.join(f'{r:,.0f}' for r in rates)})")
    return [
        Result("subscriptions.fanout.delivered", delivered, "events/s", RAW_CONSUMER, raw_rate),
        Result("subscriptions.fanout.latency.p50", percentile(sluice_ms, 50), "ms", f"{RAW_CONSUMER}.latency.p50",
               percentile(raw_ms, 50)),
        Result("subscriptions.fanout.latency.p99", percentile(sluice_ms, 99), "ms", f"{RAW_CONSUMER}.latency.p99",
               percentile(raw_ms, 99)),
        # Over the throughput part, per delivery (an update costs per_key of them).
        *ctx.cpu_per_event("subscriptions.fanout.delivered", throughput_cpu, events * per_key,
                           processes=("region", "subscriptions", "clients", "broker"), what="per delivery"),
    ]


def raw_counts(ctx: Context, topic: str, written: int) -> dict[int, int]:
    """Each changelog partition's records; they must add up to the updates written.

    Counted by reading the topic (``bench.region.count_records``: offsets
    also hold transaction markers).  On Tansu, whose high watermarks run low
    under batched load (KAFKA-NOTES quirk 3), the topic is read until
    nothing more comes for 2 s.
    """
    if ctx.engine == "kafka":
        counts = count_records(ctx.bootstrap, topic, BUCKETS)
    else:
        counts = dict.fromkeys(range(BUCKETS), 0)
        consumer = Consumer(raw_consumer_settings(ctx.bootstrap))
        try:
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(BUCKETS)])
            idle_until = time.monotonic() + 5
            while time.monotonic() < idle_until:
                msgs = consumer.consume(1000, 0.5)
                for msg in msgs:
                    if msg.error() is None:
                        counts[msg.partition()] += 1
                if msgs:
                    idle_until = time.monotonic() + 2
        finally:
            consumer.close()
    if sum(counts.values()) != written:
        raise RuntimeError(f"{topic} holds {sum(counts.values())} records, expected one per update ({written})")
    return counts


# --- python -m bench.subscriptions clients ----------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.subscriptions",
                                     description="The client processes of subscriptions.fanout.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("clients", help="run clients FIRST … FIRST+COUNT-1 until 'stop' on stdin")
    c.add_argument("site", type=Path)
    c.add_argument("region_url")
    c.add_argument("first", type=int)
    c.add_argument("count", type=int)
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    return run_clients(args.site, args.region_url, args.first, args.count, args.out)


if __name__ == "__main__":
    sys.exit(main())
