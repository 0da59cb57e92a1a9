"""Region benchmarks: put_all ingest and single-put latency, each against a raw producer.

Both run a site with region ``orders`` (8 buckets) and one attached parallel
gateway sender, served by one region-service process.  Every applied entry
costs the service two acknowledged records (the changelog record, then the
queue record, DESIGN §2); the baselines are a plain confluent-kafka producer
writing one record per entry, because that is what a user would otherwise
write by hand.

``region.put_all.ingest``
    1. Build the workload before any clock starts: ``entries`` keys with
       200-byte JSON values, cut into put_all batches of 1000, and the same
       entries as encoded ``EntryEvent`` records for the raw producer.
    2. Raw producer (before the region service starts, so nothing else
       competes for the CPUs): a warm-up pass, then every record, keyed, to
       its bucket's partition of an 8-partition topic, timed from the first
       produce until ``flush()`` returns with every record delivered.
    3. Region service: start it, wait for /readyz, warm up with two batches,
       then ``INGEST_THREADS`` client threads send their share of the
       batches; timed from the first request to the last answer.
    4. Verify: the region holds exactly the keys written (``keys``), a
       sample read back with ``get_all`` holds the values written, and on
       Apache Kafka the changelog and queue topics hold one record per entry.

``region.put.latency``
    Sequential single puts through ``RegionClient`` (after a warm-up), and a
    raw producer's produce + flush of one record, measured the same way.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import (
    OFFSET_BEGINNING,
    KafkaError,
    Message,
    NewTopic,
    Producer,
    TopicPartition,
    make_admin,
    make_consumer,
    partition_for_key,
    wait_futures,
)

from .harness import Context, Result, benchmark
from sluice.core.processes import RegionProcess

from .site import write_site

REGION = "orders"
BUCKETS = 8
VALUE_BYTES = 200
BATCH_ENTRIES = 1000
#: Client threads sending put_all batches.  Measured on a 2-core machine
#: (client, service and broker sharing it): 1 thread 9.7k–11.6k entries/s,
#: 2 threads 9.9k–14.4k, 3 9.8k, 4 9.9k–12.9k.  With one thread the service
#: idles while the client encodes and reads; from two on, the service's one
#: GIL-bound process is the limit.
INGEST_THREADS = 2
#: The raw producer writes the records this many times and reports the median
#: rate: one pass of 200k records takes well under a second and varies ±25 %
#: (quick: more passes of its 20k records, which take under 0.1 s each).
RAW_PASSES = 3
RAW_PASSES_QUICK = 5
#: Entries read back with get_all to check values (every key is counted).
VERIFY_SAMPLE = 2000

RAW_PRODUCER = "raw.producer"


def raw_producer_settings(bootstrap: str) -> dict[str, Any]:
    """The baseline producer: what a careful user writes by hand (stated, not defaulted)."""
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "max.in.flight.requests.per.connection": 5,
        "compression.type": "none",
        "batch.size": 1_000_000,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "delivery.timeout.ms": 120_000,
    }


# --- the workload ----------------------------------------------------------------


def make_value(i: int) -> dict[str, Any]:
    """An order whose JSON (as the service stores it, orjson) is VALUE_BYTES long."""
    value: dict[str, Any] = {
        "order_id": i,
        "customer": f"customer-{i % 9973:05d}",
        "status": ("NEW", "PAID", "SHIPPED")[i % 3],
        "qty": i % 17 + 1,
        "price_cents": (i * 7919) % 100_000,
        "note": "",
    }
    value["note"] = "x" * (VALUE_BYTES - len(orjson.dumps(value)))
    return value


def make_key(prefix: str, i: int) -> str:
    return f"{prefix}-{i:08d}"


def encode_events(keys: list[str], values: list[bytes], member_id: str) -> list[tuple[bytes, bytes, int]]:
    """(key, EntryEvent record, partition) as the region service would write them."""
    codec = get_codec()
    now_ms = int(time.time() * 1000)
    out = []
    for seq, (key, value) in enumerate(zip(keys, values)):
        key_bytes = key.encode("utf-8")
        bucket = partition_for_key(key_bytes, BUCKETS)
        event = EntryEvent(
            region=REGION,
            key=key,
            operation=Operation.PUTALL_CREATE,
            value=value,
            event_id=EventID(member_id, 1, seq),
            version=VersionTag(1, now_ms, 1, member_id),
            origin_dsid=1,
            bucket=bucket,
            event_time=now_ms,
        )
        out.append((key_bytes, codec.encode("EntryEvent", event.to_record(), validate=False), bucket))
    return out


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = make_admin({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, partitions, 1)], operation_timeout=30)
    wait_futures(futures, "creating topic", 30)


def end_offsets(bootstrap: str, topic: str, partitions: int) -> int:
    """Sum of the high watermarks of a topic (exact on Apache Kafka; see KAFKA-NOTES quirk 3 for Tansu).

    The records a non-transactional producer wrote; a transactional one's
    commit markers take offsets too: count those topics with ``count_records``.
    """
    consumer = make_consumer({"bootstrap.servers": bootstrap}, None)
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions))
    finally:
        consumer.close()


def count_records(bootstrap: str, topic: str, partitions: int, timeout_s: float = 120.0) -> dict[int, int]:
    """Records per partition of ``topic``, counted by reading it from its beginning to its end.

    Offsets do not count records once a service writes in Kafka
    transactions: each commit (or abort) leaves a marker that takes an
    offset in every partition the transaction wrote, and aborted records
    are never read.  One read_committed consumer reads every partition at
    once until librdkafka reports its end (``enable.partition.eof``: the
    fetch position, past markers and aborted records, reached the last
    stable offset).  (``read_to_end`` of the services reads one partition
    at a time, ~0.4 s each even when small.)
    """
    # A fetch at a partition's end waits fetch.wait.max.ms for more before the end is told: keep it short.
    consumer = make_consumer({"bootstrap.servers": bootstrap}, None,
                             **{"enable.partition.eof": True, "fetch.wait.max.ms": 10})
    try:
        # Known leaders first: assigned cold, each offset query waits ~0.5 s on a retry timer.
        consumer.list_topics(topic, timeout=10)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        counts = dict.fromkeys(range(partitions), 0)
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_end) < partitions:
            if time.monotonic() > deadline:
                raise TimeoutError(f"counting {topic}: partitions {sorted(set(counts) - at_end)} not read to their "
                                   f"end in {timeout_s:.0f}s ({sum(counts.values())} records so far)")
            for msg in consumer.consume(1000, 0.2):
                err = msg.error()
                if err is None:
                    counts[msg.partition()] += 1
                elif err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                else:
                    raise RuntimeError(f"counting {topic}: {err}")
        return counts
    finally:
        consumer.close()


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of unsorted samples."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(p / 100 * len(ordered))))
    return ordered[rank - 1]


# --- the raw producer -------------------------------------------------------------


class RawProducer:
    """One confluent-kafka producer that checks every delivery report."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.producer = Producer(raw_producer_settings(bootstrap))
        self.delivered = 0
        self.errors: list[KafkaError] = []

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self.errors.append(err)
        else:
            self.delivered += 1

    def produce(self, key: bytes, value: bytes, partition: int) -> None:
        while True:
            try:
                self.producer.produce(self.topic, value, key, partition=partition, on_delivery=self._on_delivery)
                return
            except BufferError:
                # Back-pressure: serve delivery reports until there is room.
                self.producer.poll(0.05)

    def write_all(self, records: list[tuple[bytes, bytes, int]], advance: Any = None) -> float:
        """Produce ``records`` and flush; returns the seconds from first produce to flush's return."""
        before = self.delivered
        t0 = time.perf_counter()
        for n, (key, value, partition) in enumerate(records, 1):
            self.produce(key, value, partition)
            if n % 1000 == 0:
                self.producer.poll(0)
                if advance is not None:
                    advance(1000)
        remaining = self.producer.flush(120)
        elapsed = time.perf_counter() - t0
        self.check(remaining, before + len(records))
        return elapsed

    def check(self, remaining: int, expected_delivered: int) -> None:
        if remaining or self.errors or self.delivered != expected_delivered:
            raise RuntimeError(f"raw producer lost records: {remaining} unflushed, {self.delivered} of "
                               f"{expected_delivered} delivered, errors {self.errors[:3]}")

    def close(self) -> None:
        self.producer.flush(30)


# --- the region service ------------------------------------------------------------


@dataclass
class RegionSite:
    cfg: SiteConfig
    config_path: Path

    @classmethod
    def create(cls, ctx: Context) -> "RegionSite":
        path = ctx.workdir / "site.yaml"
        cfg = write_site(path, bootstrap=ctx.bootstrap, prefix=ctx.topic_prefix(), region=REGION,
                         buckets=BUCKETS, parallel_senders=1)
        return cls(cfg, path)

    def start_region(self, ctx: Context) -> RegionProcess:
        ctx.step("starting the region service")
        region = RegionProcess(self.config_path, ctx.workdir / "region.log")
        try:
            waited = region.wait_ready()
        except BaseException:
            region.stop()
            raise
        ctx.step(f"region service {region.url} (pid {region.pid}) ready in {waited:.1f}s")
        return region


def send_batches(url: str, batches: list[dict[str, Any]], threads: int, advance: Any) -> tuple[float, int]:
    """Send ``batches`` from ``threads`` client threads, one ``RegionClient`` each.

    Returns the seconds from the first request to the last answer, and how
    many requests the clients retried (a retry keeps its EventIDs, so it is
    applied once, but it is worth knowing about).
    """
    shares = [batches[i::threads] for i in range(threads)]
    start = threading.Barrier(threads + 1)
    finished = [0.0] * threads
    retries = [0] * threads
    failures: list[Exception] = []

    def worker(n: int) -> None:
        try:
            with RegionClient(url, timeout_s=60, retry_for_s=60) as client:
                start.wait()
                for batch in shares[n]:
                    client.put_all(REGION, batch)
                    advance(len(batch))
                finished[n] = time.perf_counter()
                retries[n] = client.retries
        except Exception as exc:  # noqa: BLE001 - the top of a thread: handed to the caller below
            failures.append(exc)
            start.abort()

    workers = [threading.Thread(target=worker, args=(n,), name=f"bench-client-{n}", daemon=True)
               for n in range(threads)]
    for w in workers:
        w.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass  # a worker failed before the start; its exception is raised below
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    if failures:
        raise RuntimeError(f"a client thread failed: {failures[0]!r}") from failures[0]
    return max(finished) - t0, sum(retries)


def verify_region(ctx: Context, url: str, expected: dict[str, Any], cfg: SiteConfig) -> None:
    """Every key written is in the region, a sample holds its value, and nothing extra is there."""
    with RegionClient(url, timeout_s=120) as client:
        keys = client.keys(REGION)
        if len(keys) != len(expected) or set(keys) != set(expected):
            missing = len(set(expected) - set(keys))
            raise RuntimeError(f"the region holds {len(keys)} keys, expected {len(expected)} ({missing} missing)")
        sample = random.Random(7).sample(sorted(expected), min(VERIFY_SAMPLE, len(expected)))
        got = client.get_all(REGION, sample)
        wrong = [k for k in sample if (got.get(k) or {}).get("value") != expected[k]]
        if wrong:
            raise RuntimeError(f"{len(wrong)} of {len(sample)} sampled entries differ, e.g. {wrong[0]}")
    changelog = cfg.topics.region_changelog(REGION)
    queue = cfg.attached_queues(REGION)[0]
    if ctx.engine == "kafka":
        counts = {t: sum(count_records(ctx.bootstrap, t, n).values())
                  for t, n in ((changelog, BUCKETS), (queue.topic, queue.partitions))}
        for topic, count in counts.items():
            if count != len(expected):
                raise RuntimeError(f"{topic} holds {count} records, expected {len(expected)}")
        ctx.step(f"verified: {len(keys)} keys, {len(sample)} values, changelog and queue hold one record each")
    else:
        # Tansu under-reports high watermarks under batched load (KAFKA-NOTES, quirk 3).
        ctx.step(f"verified: {len(keys)} keys, {len(sample)} values (topic counts not checked on {ctx.engine})")


@benchmark("region.put_all.ingest", "put_all ingest, 1 parallel sender, 8 buckets, vs a raw producer")
def put_all_ingest(ctx: Context) -> list[Result]:
    entries = ctx.sized(200_000, 20_000)
    warm_batches = 2
    ctx.step(f"building {entries:,} entries of {VALUE_BYTES} B (+{warm_batches} warm-up batches)")
    keys = [make_key("order", i) for i in range(entries)]
    values = [make_value(i) for i in range(entries)]
    batches = [dict(zip(keys[i:i + BATCH_ENTRIES], values[i:i + BATCH_ENTRIES]))
               for i in range(0, entries, BATCH_ENTRIES)]
    warm = [{make_key(f"warm{b}", i): make_value(i) for i in range(BATCH_ENTRIES)} for b in range(warm_batches)]
    records = encode_events(keys, [orjson.dumps(v) for v in values], "bench-raw")
    warm_records = records[: min(20_000, entries)]

    site = RegionSite.create(ctx)
    raw_topic = f"{site.cfg.kafka.topic_prefix}raw"
    create_topic(ctx.bootstrap, raw_topic, BUCKETS)

    passes = ctx.sized(RAW_PASSES, RAW_PASSES_QUICK)
    ctx.step(f"raw producer: {len(warm_records):,} warm-up records, then {passes} timed passes of {entries:,}")
    raw = RawProducer(ctx.bootstrap, raw_topic)
    rates = []
    try:
        raw.write_all(warm_records)
        with ctx.counting("raw producer", entries * passes) as advance, ctx.cpu_use("raw producer", {}):
            for _ in range(passes):
                rates.append(entries / raw.write_all(records, advance))
    finally:
        raw.close()
    raw_rate = statistics.median(rates)
    ctx.step(f"raw producer: {raw_rate:,.0f} records/s (median; passes: "
             f"{', '.join(f'{r:,.0f}' for r in rates)})")

    region = site.start_region(ctx)
    try:
        with RegionClient(region.url) as client:
            for batch in warm:
                client.put_all(REGION, batch)
        ctx.step(f"put_all: {entries:,} entries in batches of {BATCH_ENTRIES} from {INGEST_THREADS} threads")
        with ctx.counting("region put_all", entries) as advance, ctx.profiling(region.pid, "region"), \
                ctx.cpu_use("put_all", {"region": region.pid}) as cpu:
            region_s, retries = send_batches(region.url, batches, INGEST_THREADS, advance)
        if retries:
            ctx.note(f"the clients retried {retries} put_all requests")
        region_rate = entries / region_s
        ctx.step(f"put_all: {region_rate:,.0f} entries/s ({region_s:.2f}s)")
        expected = {k: v for b in warm for k, v in b.items()}
        expected.update(zip(keys, values))
        verify_region(ctx, region.url, expected, site.cfg)
    finally:
        region.stop()
    return [Result("region.put_all.ingest", region_rate, "entries/s", RAW_PRODUCER, raw_rate),
            *ctx.cpu_per_event("region.put_all.ingest", renamed(cpu.seconds(), bench="clients"), entries,
                               processes=("region", "broker", "clients"), what="per entry")]


@benchmark("region.put.latency", "single-entry put latency p50/p99 vs a raw produce + flush")
def put_latency(ctx: Context) -> list[Result]:
    puts = ctx.sized(2000, 300)
    warm = ctx.sized(100, 30)
    site = RegionSite.create(ctx)
    raw_topic = f"{site.cfg.kafka.topic_prefix}raw"
    create_topic(ctx.bootstrap, raw_topic, BUCKETS)
    keys = [make_key("latency", i) for i in range(puts + warm)]
    values = [make_value(i) for i in range(puts + warm)]
    records = encode_events(keys, [orjson.dumps(v) for v in values], "bench-raw")

    ctx.step(f"raw producer: {puts} x (produce one record + flush), after {warm} warm-up")
    raw = RawProducer(ctx.bootstrap, raw_topic)
    raw_ms: list[float] = []
    try:
        with ctx.counting("raw produce+flush", puts + warm) as advance:
            for n, (key, value, partition) in enumerate(records):
                t0 = time.perf_counter()
                raw.produce(key, value, partition)
                remaining = raw.producer.flush(30)
                elapsed = time.perf_counter() - t0
                raw.check(remaining, n + 1)
                if n >= warm:
                    raw_ms.append(elapsed * 1000)
                advance(1)
    finally:
        raw.close()

    region = site.start_region(ctx)
    put_ms: list[float] = []
    try:
        ctx.step(f"region: {puts} sequential puts, after {warm} warm-up")
        with RegionClient(region.url) as client, ctx.counting("region put", puts + warm) as advance, \
                ctx.profiling(region.pid, "region"):
            for key, value in zip(keys[:warm], values[:warm]):
                client.put(REGION, key, value)
                advance(1)
            with ctx.cpu_use("put", {"region": region.pid}) as cpu:
                for key, value in zip(keys[warm:], values[warm:]):
                    t0 = time.perf_counter()
                    client.put(REGION, key, value)
                    put_ms.append((time.perf_counter() - t0) * 1000)
                    advance(1)
            if client.retries:
                ctx.note(f"{client.retries} puts were retried")
        verify_region(ctx, region.url, dict(zip(keys, values)), site.cfg)
    finally:
        region.stop()
    ctx.step(f"raw p50 {statistics.median(raw_ms):.2f} ms, put p50 {statistics.median(put_ms):.2f} ms")
    return [
        Result("region.put.latency.p50", percentile(put_ms, 50), "ms", f"{RAW_PRODUCER}.flush.p50",
               percentile(raw_ms, 50)),
        Result("region.put.latency.p99", percentile(put_ms, 99), "ms", f"{RAW_PRODUCER}.flush.p99",
               percentile(raw_ms, 99)),
        *ctx.cpu_per_event("region.put.latency", renamed(cpu.seconds(), bench="client"), puts,
                           processes=("region", "broker", "client"), what="per put"),
    ]


def renamed(cpu_s: dict[str, float], **names: str) -> dict[str, float]:
    """``cpu_s`` with some processes named for what they do in the benchmark (``bench`` runs the clients)."""
    return {names.get(name, name): seconds for name, seconds in cpu_s.items()}
