"""``region.failover``: what losing or starting a region instance costs, by region size.

Measured as an operator sizing a production region would: region ``orders``
(8 buckets, no queues attached), two region-service instances, 200-byte
values, session timeout 6 s, for each size N of ``SIZES`` (where the
machine's memory allows):

1. Both instances start; two client threads load N entries with put_all
   batches of 1000 (not timed: ``region.put_all.ingest`` measures that).
2. Resident memory of each instance, and the bytes per entry that loading
   added (the growth of both instances ÷ N).  The writes leave freed memory
   the allocator keeps, so step 4 also gives the bytes per entry of an
   instance that read the region from its changelog (its resident memory
   less an empty instance's, ÷ N).
3. **Failover gap**: instance 0 is killed (``kill -9``); the clock runs
   from the kill until a ``get_all`` of one key per bucket through the
   survivor answers with all of them.
4. **Cold start**: the survivor stops; a fresh instance starts alone and
   the clock runs from its spawn until ``/readyz`` answers (every bucket
   loaded).
5. **Failover with redundant copies**: that instance stops; two instances
   start on the same region with ``redundant_copies: 1``, and once each
   holds a caught-up standby copy of every bucket the other owns, their
   resident memory is taken and one is killed (``kill -9``); the clock runs
   as in 3.
6. **Rejoin stall**: an instance starts again beside the survivor.  While
   it joins, each probe key is read through the survivor every 20 ms (a
   thread per key); the
   stall is the longest time a key of a bucket the survivor keeps went
   unanswered (the buckets that move to the new instance answer once it
   has loaded them, and are not counted).
7. **With the local store** (``--store-dir``, one per instance, the
   defaults of ``region_service.store_*``): two instances start on the
   region and load it into their stores; their resident memory is taken,
   and the private (anonymous) part of it per entry held, since the
   store's pages are the operating system's file cache.  One is killed
   (``kill -9``) and the gap timed as in 3; it then starts again on its
   store beside the survivor, and the clock runs from its spawn until
   ``/readyz`` answers, while the survivor's kept buckets are probed as
   in 6.

Baselines, measured in the same run on the same broker:

* ``kafka.group.failover``: a consumer group of two plain confluent-kafka
  consumers over an 8-partition topic with the same session and heartbeat
  settings; one is killed (a child process, ``kill -9``), the clock runs
  until the other holds all 8 partitions.  What Kafka's group alone costs:
  no failover can be faster.
* ``raw.consumer.read.N``: one consumer reading the N changelog records
  from the beginning to the end: what reading the state back costs at the
  least.
* ``value.bytes``: the size of one value, so memory per entry reads as a
  ratio to the data held.

``python -m bench --only region.failover``; left out of ``--quick`` runs
(its sizes are what it measures) and so of ``make test``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from sluice.client import RegionClient
from sluice.core.config import load_config
from sluice.core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    TopicPartition,
    make_consumer,
    partition_for_key,
)
from sluice.core.processes import RegionProcess

from .harness import Context, Result, benchmark
from .region import BATCH_ENTRIES, BUCKETS, REGION, create_topic, make_key, make_value
from .site import write_site

#: Region sizes measured, where memory allows (``fits``).
SIZES = (100_000, 1_000_000, 3_000_000)
SESSION_TIMEOUT_MS = 6000
HEARTBEAT_INTERVAL_MS = 1000
#: Client threads loading the entries.
LOAD_THREADS = 2
#: Memory per entry assumed for the first size, when deciding whether it fits (``fits``); each
#: later size is judged by the bytes per entry the size before it measured.
ASSUMED_BYTES_PER_ENTRY = 3000
#: How long an instance may take to load a region alone.
READY_TIMEOUT_S = 900.0
PROBE_TIMEOUT_S = 1.0


def fits(entries: int, bytes_per_entry: float) -> bool:
    """Whether the region's copies (two instances holding half each, then one holding all, and the
    stopping survivor's memory not yet freed; two instances holding all with redundant copies: twice the
    region) fit in half the memory available now."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return entries <= SIZES[0]
    return entries * bytes_per_entry * 2 < available / 2


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of a process (``RssAnon``: its private part, without mapped files)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0]) * 1024


def du_bytes(path: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in path.rglob("*") if p.is_file())


def site_file(path: Path, bootstrap: str, prefix: str, redundant_copies: int = 0) -> Path:
    """bench/site.py's site without queues, with the session settings of this benchmark."""
    write_site(path, bootstrap=bootstrap, prefix=prefix, parallel_senders=0)
    data = yaml.safe_load(path.read_text())
    data["kafka"].update(session_timeout_ms=SESSION_TIMEOUT_MS, heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS)
    data["region_service"] = {"load_timeout_s": READY_TIMEOUT_S}
    for region in data["regions"]:
        region["redundant_copies"] = redundant_copies
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- the baselines ------------------------------------------------------------------------------


def group_settings(bootstrap: str, group: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": HEARTBEAT_INTERVAL_MS, "enable.auto.commit": False,
            "partition.assignment.strategy": "range"}


def run_member(bootstrap: str, topic: str, group: str) -> int:
    """``python -m bench.region_failover member``: a group member that polls until killed, saying
    ``assigned N`` at each assignment."""
    consumer = Consumer(group_settings(bootstrap, group))

    def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
        print(f"assigned {len(partitions)}", flush=True)

    consumer.subscribe([topic], on_assign=on_assign)
    while True:
        consumer.poll(0.2)


class Member:
    """An in-process member of the group, polled by a thread, whose assignment size is watched."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        self.held = 0
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._consumer = Consumer(group_settings(bootstrap, group))
        self._consumer.subscribe([topic], on_assign=self._on_assign)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with self.changed:
            self.held = len(partitions)
            self.changed.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._consumer.poll(0.05)

    def wait_holding(self, count: int, timeout_s: float) -> float:
        """Until this member holds ``count`` partitions; the monotonic time it did."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.held == count, timeout_s):
                raise TimeoutError(f"the member held {self.held} partitions, not {count}, in {timeout_s:g}s")
        return time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


def group_failover(ctx: Context) -> float:
    """``kafka.group.failover``: seconds from kill -9 of one of two members to the other holding all."""
    topic = f"{ctx.topic_prefix()}group-failover"
    create_topic(ctx.bootstrap, topic, BUCKETS)
    group = f"{topic}.group"
    child = subprocess.Popen([sys.executable, "-m", "bench.region_failover", "member", ctx.bootstrap, topic, group],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    member = Member(ctx.bootstrap, topic, group)
    try:
        deadline = time.monotonic() + 60
        assert child.stdout is not None
        while True:
            line = child.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"the child member never got its share (exit {child.poll()})")
            if line.strip() == f"assigned {BUCKETS // 2}":
                break
        member.wait_holding(BUCKETS // 2, 60)
        killed = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        gap = member.wait_holding(BUCKETS, 60) - killed
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
        member.close()
    ctx.step(f"kafka.group.failover: {gap:.1f}s from kill -9 to the survivor holding all {BUCKETS} partitions")
    return gap


def raw_read(bootstrap: str, topic: str, expected: int) -> float:
    """Seconds for one consumer to read ``topic``'s ``expected`` records from its beginning."""
    consumer = make_consumer({"bootstrap.servers": bootstrap}, None)
    try:
        consumer.list_topics(topic, timeout=10)
        started = time.monotonic()
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(BUCKETS)])
        read = 0
        deadline = started + READY_TIMEOUT_S
        while read < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"read {read} of {expected} records of {topic}")
            for msg in consumer.consume(10_000, 0.2):
                if msg.error() is None:
                    read += 1
                elif msg.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading {topic}: {msg.error()}")
        return time.monotonic() - started
    finally:
        consumer.close()


# --- one size ----------------------------------------------------------------------------------


def load(urls: list[str], entries: int, advance: Any) -> None:
    """put_all of ``entries`` entries in batches of BATCH_ENTRIES from LOAD_THREADS threads."""

    def worker(first: int) -> None:
        client = RegionClient(urls, retry_for_s=120)
        for start in range(first * BATCH_ENTRIES, entries, LOAD_THREADS * BATCH_ENTRIES):
            end = min(start + BATCH_ENTRIES, entries)
            client.put_all(REGION, {make_key("k", i): make_value(i) for i in range(start, end)})
            advance(end - start)

    with concurrent.futures.ThreadPoolExecutor(LOAD_THREADS) as pool:
        for future in [pool.submit(worker, i) for i in range(LOAD_THREADS)]:
            future.result()


def probe_keys(entries: int) -> list[str]:
    """One loaded key per bucket."""
    found: dict[int, str] = {}
    for i in range(entries):
        key = make_key("k", i)
        found.setdefault(partition_for_key(key.encode(), BUCKETS), key)
        if len(found) == BUCKETS:
            return list(found.values())
    raise RuntimeError(f"{entries} keys do not reach all {BUCKETS} buckets")


def all_answer(url: str, keys: list[str]) -> bool:
    try:
        resp = httpx.post(f"{url}/regions/{REGION}/get_all", json={"keys": keys}, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and all(resp.json()["entries"].get(k) for k in keys)


def kill_and_time(victim: RegionProcess, survivor: RegionProcess, keys: list[str]) -> float:
    """Seconds from the ``kill -9`` of ``victim`` until ``survivor`` answers for every key of ``keys``."""
    # Both ready: each has its assignment, but a bucket the group is moving between them (the second
    # round of a cooperative rebalance) answers once it lands.
    deadline = time.monotonic() + 60
    while not all_answer(survivor.url, keys):
        if time.monotonic() > deadline:
            raise RuntimeError("the region does not answer before the kill")
        time.sleep(0.1)
    killed = time.monotonic()
    victim.kill()
    while not all_answer(survivor.url, keys):
        if time.monotonic() - killed > READY_TIMEOUT_S:
            raise TimeoutError(f"the survivor did not answer for every bucket in {READY_TIMEOUT_S:g}s")
        time.sleep(0.05)
    return time.monotonic() - killed


def copies_ready(instances: list[RegionProcess]) -> bool:
    """Whether each instance holds a caught-up standby copy of every bucket another one owns."""
    for inst in instances:
        try:
            rows = httpx.get(f"{inst.url}/buckets", timeout=PROBE_TIMEOUT_S * 5).json()["buckets"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        for row in rows:
            if row["owner"] != inst.url and not any(c["url"] == inst.url and 0 <= c["lag"] <= 1
                                                    for c in row["standbys"]):
                return False
    return True


def wait_copies_ready(instances: list[RegionProcess]) -> None:
    """Wait until every instance answers and holds its caught-up standby copies (``copies_ready``)."""
    for inst in instances:
        inst.wait_ready(READY_TIMEOUT_S)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not copies_ready(instances):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the standby copies did not catch up in {READY_TIMEOUT_S:g}s")
        time.sleep(0.2)


def standby_failover(ctx: Context, workdir: Path, prefix: str, keys: list[str]) -> tuple[float, list[float], dict[str, Any]]:
    """Step 5: the failover gap with ``redundant_copies: 1``, both instances' RSS (MiB) with their
    copies, and the survivor's stats."""
    path = site_file(workdir / "site-copies.yaml", ctx.bootstrap, prefix, redundant_copies=1)
    instances = [RegionProcess(path, workdir / f"region-copies-{i}.log") for i in range(2)]
    try:
        wait_copies_ready(instances)
        rss = [rss_bytes(inst.pid) / 2**20 for inst in instances]
        victim, survivor = instances
        gap = kill_and_time(victim, survivor, keys)
        stats = survivor.stats()
        instances.append(RegionProcess(path, workdir / "region-copies-rejoined.log"))
        stall, _ = rejoin_stall(survivor, instances[-1], keys)
        return gap, rss, {**stats, "rejoin_stall_s": stall}
    finally:
        for inst in instances:
            inst.stop()


def wait_share_loaded(survivor: RegionProcess, joining: RegionProcess) -> float:
    """Seconds from ``joining``'s spawn until it holds its share of the buckets, loaded.

    ``/readyz`` alone is not that: under cooperative rebalancing the first
    assignment a joining member gets is empty (the owners revoke the buckets
    that move first), and it answers ready with nothing to load.  So: every
    bucket has one owner of the two, as the survivor's ``/buckets`` says,
    ``joining`` owns ``BUCKETS // 2`` of them (cooperative-sticky balances two
    members), and its ``/readyz`` answers 200 (each of them loaded)."""
    end = time.monotonic() + READY_TIMEOUT_S
    while True:
        joining.wait_ready(max(1.0, end - time.monotonic()))
        try:
            rows = httpx.get(f"{survivor.url}/buckets", timeout=5).json()["buckets"]
            owners = [r["owner"] for r in rows]
            settled = (len(owners) == BUCKETS and set(owners) <= {survivor.url, joining.url}
                       and owners.count(joining.url) == BUCKETS // 2
                       and httpx.get(f"{joining.url}/readyz", timeout=5).status_code == 200)
        except httpx.HTTPError:
            settled = False
        if settled:
            return time.monotonic() - joining.started
        if time.monotonic() > end:
            raise TimeoutError(f"{joining.url} did not take and load its share within {READY_TIMEOUT_S:g} s")
        time.sleep(0.05)


def rejoin_stall(survivor: RegionProcess, joining: RegionProcess, keys: list[str]) -> tuple[float, float]:
    """Step 6: the longest a key of a bucket ``survivor`` keeps went unanswered while ``joining`` joined,
    and the seconds from ``joining``'s spawn until it held its share of the buckets, loaded."""
    last_ok = {k: time.monotonic() for k in keys}
    worst = {k: 0.0 for k in keys}
    done = threading.Event()

    def probe(key: str) -> None:
        # One thread per key: a read held on a bucket that moves must not delay the reads of the others.
        with httpx.Client(timeout=PROBE_TIMEOUT_S) as http:
            while not done.is_set():
                try:
                    ok = http.get(f"{survivor.url}/regions/{REGION}/entries/{key}").status_code == 200
                except httpx.HTTPError:
                    ok = False
                # A read held while the bucket was unavailable counts from the last answer before it.
                now = time.monotonic()
                worst[key] = max(worst[key], now - last_ok[key])
                if ok:
                    last_ok[key] = now
                time.sleep(0.02)

    probers = [threading.Thread(target=probe, args=(key,), daemon=True) for key in keys]
    for prober in probers:
        prober.start()
    try:
        ready_s = wait_share_loaded(survivor, joining)
        time.sleep(2.0)  # the last answers of the buckets that moved
    finally:
        done.set()
        for prober in probers:
            prober.join(10)
    rows = httpx.get(f"{survivor.url}/buckets", timeout=10).json()["buckets"]
    kept = {r["bucket"] for r in rows if r["owner"] == survivor.url}
    return max((worst[k] for k in keys if partition_for_key(k.encode(), BUCKETS) in kept), default=0.0), ready_s


def store_failover(ctx: Context, workdir: Path, prefix: str, keys: list[str], entries: int,
                   empty_anon: float) -> dict[str, Any]:
    """Step 7: memory with the local store, the failover gap, and the restart of the killed instance."""
    path = site_file(workdir / "site-store.yaml", ctx.bootstrap, prefix)
    stores = [workdir / f"store-{i}" for i in range(2)]
    instances = [RegionProcess(path, workdir / f"region-store-{i}.log", store_dir=stores[i]) for i in range(2)]
    try:
        for inst in instances:
            inst.wait_ready(READY_TIMEOUT_S)
        rss = [rss_bytes(inst.pid) / 2**20 for inst in instances]
        anon = [rss_bytes(inst.pid, "RssAnon") for inst in instances]
        anon_per_entry = (sum(anon) - 2 * empty_anon) / entries
        disk_per_entry = sum(du_bytes(store) for store in stores) / entries
        victim, survivor = instances
        gap = kill_and_time(victim, survivor, keys)
        instances.append(RegionProcess(path, workdir / "region-store-restarted.log", store_dir=stores[0]))
        stall, restart = rejoin_stall(survivor, instances[-1], keys)
        stats = instances[-1].stats()
        return {"rss": rss, "anon_per_entry": anon_per_entry, "disk_per_entry": disk_per_entry, "gap": gap,
                "restart": restart, "stall": stall, "loads_from_store": stats["loads_from_store"],
                "records_replayed": stats["records_replayed"], "loads": stats["loads"]}
    finally:
        for inst in instances:
            inst.stop()


def store_restart_with_copy(ctx: Context, workdir: Path, prefix: str, keys: list[str]) -> dict[str, Any]:
    """Step 8: the restart of a killed instance with its local store and ``redundant_copies: 1``: its store
    holds every bucket (those it owned and its copies of the others), so whichever buckets the group gives
    it back, it replays only what their changelogs gained since."""
    path = site_file(workdir / "site-store-copies.yaml", ctx.bootstrap, prefix, redundant_copies=1)
    stores = [workdir / f"store-copies-{i}" for i in range(2)]
    instances = [RegionProcess(path, workdir / f"region-store-copies-{i}.log", store_dir=stores[i]) for i in range(2)]
    try:
        wait_copies_ready(instances)
        victim, survivor = instances
        kill_and_time(victim, survivor, keys)
        instances.append(RegionProcess(path, workdir / "region-store-copies-restarted.log", store_dir=stores[0]))
        stall, restart = rejoin_stall(survivor, instances[-1], keys)
        stats = instances[-1].stats()
        return {"restart": restart, "stall": stall, "loads_from_store": stats["loads_from_store"],
                "loads_from_standby": stats["loads_from_standby"], "records_replayed": stats["records_replayed"],
                "loads": stats["loads"]}
    finally:
        for inst in instances:
            inst.stop()


def one_size(ctx: Context, entries: int, group_gap: float) -> list[Result]:
    workdir = ctx.workdir / f"n{entries}"
    workdir.mkdir()
    prefix = ctx.topic_prefix()
    path = site_file(workdir / "site.yaml", ctx.bootstrap, prefix)
    changelog = load_config(path).topics.region_changelog(REGION)
    instances = [RegionProcess(path, workdir / f"region-{i}.log") for i in range(2)]
    late: RegionProcess | None = None
    try:
        for inst in instances:
            inst.wait_ready(120)
        before = sum(rss_bytes(inst.pid) for inst in instances)
        empty_anon = sum(rss_bytes(inst.pid, "RssAnon") for inst in instances) / 2
        with ctx.counting(f"loading {entries:,} entries", entries) as advance:
            load([inst.url for inst in instances], entries, advance)
        rss = [rss_bytes(inst.pid) for inst in instances]
        per_entry = (sum(rss) - before) / entries
        keys = probe_keys(entries)
        victim, survivor = instances
        gap = kill_and_time(victim, survivor, keys)
        stats = survivor.stats()
        survivor.stop()
        reads = [raw_read(ctx.bootstrap, changelog, entries)]
        late = RegionProcess(path, workdir / "region-cold.log")
        late.wait_ready(READY_TIMEOUT_S)
        cold = time.monotonic() - late.started
        cold_per_entry = (rss_bytes(late.pid) - before / 2) / entries
        if not all_answer(late.url, keys):
            raise RuntimeError("the cold-started instance does not answer for every bucket")
        late.stop()
        reads.append(raw_read(ctx.bootstrap, changelog, entries))
        read_s = min(reads)
        copies_gap, copies_rss, copies_stats = standby_failover(ctx, workdir, prefix, keys)
        stored = store_failover(ctx, workdir, prefix, keys, entries, empty_anon)
        kept = store_restart_with_copy(ctx, workdir, prefix, keys)
    finally:
        for inst in [*instances, *([late] if late else [])]:
            inst.stop()
    mib = [r / 2**20 for r in rss]
    ctx.note(f"N={entries:,}: failover gap {gap:.1f}s (the survivor loaded {stats['loads'] - BUCKETS // 2} "
             f"buckets and gave up {stats['buckets_revoked']} of its own); cold start {cold:.1f}s, then {cold_per_entry:,.0f} bytes per entry; resident after the load "
             f"{mib[0]:,.0f} and {mib[1]:,.0f} MiB; {per_entry:,.0f} bytes per entry; a raw consumer read the "
             f"changelog in {reads[0]:.2f}s before the cold start and {reads[1]:.2f}s after it (the faster is the "
             "baseline)")
    ctx.note(f"N={entries:,}, redundant_copies 1: failover gap {copies_gap:.1f}s (the survivor promoted "
             f"{copies_stats['loads_from_standby']} standby copies, replaying {copies_stats['records_replayed']:,} "
             f"records in all its loads); resident with the copies {copies_rss[0]:,.0f} and {copies_rss[1]:,.0f} MiB; "
             f"an instance rejoining stalled the survivor's kept buckets {copies_stats['rejoin_stall_s']:.2f}s at most")
    ctx.note(f"N={entries:,}, local store: {stored['anon_per_entry']:,.0f} private bytes per entry in memory "
             f"(resident {stored['rss'][0]:,.0f} and {stored['rss'][1]:,.0f} MiB with the store's pages), "
             f"{stored['disk_per_entry']:,.0f} bytes per entry on disk; failover gap {stored['gap']:.1f}s; the "
             f"killed instance restarted in {stored['restart']:.1f}s ({stored['loads_from_store']} of its "
             f"{stored['loads']} buckets from its store, {stored['records_replayed']:,} records replayed in all), "
             f"stalling the survivor's kept buckets {stored['stall']:.2f}s at most")
    ctx.note(f"N={entries:,}, local store and redundant_copies 1: the killed instance restarted in "
             f"{kept['restart']:.1f}s ({kept['loads_from_store']} of its {kept['loads']} buckets from its store, "
             f"{kept['loads_from_standby']} from a copy it resumed, {kept['records_replayed']:,} records replayed in "
             f"all), stalling the survivor's kept buckets {kept['stall']:.2f}s at most")
    value_bytes = len(orjson.dumps(make_value(0)))
    return [
        Result(f"region.failover.gap.{entries}", gap, "s", "kafka.group.failover", group_gap),
        Result(f"region.failover.cold_start.{entries}", cold, "s", f"raw.consumer.read.{entries}", read_s),
        Result(f"region.failover.bytes_per_entry.{entries}", per_entry, "bytes", "value.bytes", value_bytes),
        Result(f"region.failover.cold_bytes_per_entry.{entries}", cold_per_entry, "bytes", "value.bytes",
               value_bytes),
        Result(f"region.failover.rss.{entries}", max(mib), "MiB"),
        Result(f"region.failover.gap_with_copy.{entries}", copies_gap, "s", "kafka.group.failover", group_gap),
        Result(f"region.failover.rss_with_copy.{entries}", max(copies_rss), "MiB"),
        Result(f"region.failover.rejoin_stall.{entries}", copies_stats["rejoin_stall_s"], "s"),
        Result(f"region.failover.store_bytes_per_entry.{entries}", stored["anon_per_entry"], "bytes", "value.bytes",
               value_bytes),
        Result(f"region.failover.gap_with_store.{entries}", stored["gap"], "s", "kafka.group.failover", group_gap),
        Result(f"region.failover.restart_with_store.{entries}", stored["restart"], "s",
               f"raw.consumer.read.{entries}", read_s),
        Result(f"region.failover.store_rejoin_stall.{entries}", stored["stall"], "s"),
        Result(f"region.failover.restart_with_store_and_copy.{entries}", kept["restart"], "s",
               f"raw.consumer.read.{entries}", read_s),
        Result(f"region.failover.records_replayed_on_restart.{entries}", kept["records_replayed"], "records"),
    ]


@benchmark("region.failover", "kill -9 of one of two region instances and a cold start, by region size",
           quick=False)
def region_failover(ctx: Context) -> list[Result]:
    group_gap = group_failover(ctx)
    results: list[Result] = []
    per_entry = float(ASSUMED_BYTES_PER_ENTRY)
    for entries in SIZES:
        if not fits(entries, per_entry):
            ctx.note(f"N={entries:,} left out: at {per_entry:,.0f} bytes per entry it would not fit in the "
                     "memory available")
            continue
        measured = one_size(ctx, entries, group_gap)
        results += measured
        per_entry = next(r.value for r in measured if r.name.startswith("region.failover.bytes_per_entry."))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "member":
        sys.exit(run_member(*sys.argv[2:]))
    sys.exit("usage: python -m bench.region_failover member BOOTSTRAP TOPIC GROUP")
