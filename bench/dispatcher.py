"""Dispatcher benchmarks: an async event queue drained by one dispatcher process.

Both benchmarks isolate the dispatcher from the region service: the queue
topic of a parallel async event queue (8 partitions) is filled *before* the
dispatcher starts, with ``QueuedEvent`` records encoded by ``sluice.core.codec``
exactly as the region service writes them, by a plain confluent-kafka
producer.  Then one ``python -m sluice.cli dispatcher`` process is started
and watched from its spawn until the queue is drained: every event offered,
accepted and covered by a durable removal record, which is when ``sluice
admin status`` (``queue_status``) counts every partition's size as 0.  The
bench follows the removals topic to see that moment within milliseconds,
then confirms it with ``queue_status``.  The figure is the steady state,
from the first batch the listener accepted to the last (the listener writes
a line per batch); the start-up, from the spawn to the first accepted batch,
is a figure of its own; the CPU each process used per event is taken over
the steady state too.  README.md says what each figure means.

``dispatcher.noop.throughput``
    1. Build ``events`` records (varied keys, 200-byte JSON values) for two
       queues, ``noop`` (batch_size 1000) and ``noop-b100`` (Geode's default
       batch_size 100), and fill both topics.
    2. Baseline ``raw.consumer``: one confluent-kafka consumer assigned all 8
       partitions from the beginning reads the ``noop`` topic to its end with
       ``consume(1000, …)`` (a warm-up pass, then timed passes; the median),
       timed from its first records to its last.  Baseline
       ``raw.consumer.startup``: a Python process that joins a group on the
       topic and reads (``bench/first_record.py``), from its spawn to its
       first record.
    3. One dispatcher per queue, one after the other, with the no-op
       ``CountingListener``; the listener's batch lines must tile every
       partition's offsets exactly (nothing lost, nothing offered twice).

``dispatcher.sql.postgres``
    1. Start a private PostgreSQL 15 server (as tests/pg.py does: initdb as
       the postgres user, ``-A trust``, ``fsync=off``, a private port), as a
       child of the runner.
    2. Build ``events`` records over ``events / 5`` keys (5 versions per key,
       in shuffled rounds) for queue ``writebehind`` (batch_size 1000) and fill
       its topic.
    3. Baselines: ``raw.consumer`` on that topic as above, and
       ``raw.psycopg.upsert``: one psycopg connection upserting the same
       events as rows, partition by partition in queue order, with
       ``executemany`` in transactions of 1000 rows, timed per batch.
    4. One dispatcher with the built-in SQL listener (wrapped by
       ``TimedSqlListener`` to time each ``process_events``); then the table
       must hold exactly the keys written, a sample with their last values
       and versions.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import os
import random
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from sluice.admin.cli import queue_status
from sluice.core.codec import HEADER_BYTES, get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import FETCH_QUEUE_BACKOFF_MS, OFFSET_BEGINNING, Consumer, TopicPartition, partition_for_key
from sluice.core.topics import apply_topics

from sluice.core import processes

from .harness import REPO, Context, CpuSource, CpuUse, Result, benchmark, cpu_seconds, die_with_parent
from .region import RawProducer, count_records, end_offsets, make_value, percentile

REGION = "orders"
BUCKETS = 8
BATCH_SIZE = 1000
GEODE_BATCH_SIZE = 100
NOOP_QUEUE = "noop"
NOOP100_QUEUE = "noop-b100"
SQL_QUEUE = "writebehind"
SQL_TABLE = "bench_orders"
RAW_TABLE = "bench_raw_upsert"
#: Records built between two steps of the build's progress bar.
BUILD_STEP = 10_000
#: Events per key in the SQL workload (5 shuffled rounds over every key).
VERSIONS_PER_KEY = 5
#: Seconds between ``queue_status`` calls (and batch-line reads) while waiting for the drain.
STATUS_POLL_S = 0.2
RAW_CONSUMER_PASSES = 5
RAW_CONSUMER_PASSES_QUICK = 5
#: Events decoded in this process to note what decoding alone costs.
DECODE_SAMPLE = 20_000
#: Spawns of the start-up baseline (a raw consumer process, ``bench/first_record.py``); the median.
STARTUP_PASSES = 3
STARTUP_PASSES_QUICK = 1
#: Seconds the start-up baseline may take to read its first record.
FIRST_RECORD_TIMEOUT_S = 90.0
#: A steady state shorter than this (seconds), or than half the run, is noted as too short to stand for the rate.
STEADY_MIN_S = 1.0
#: Keys read back from PostgreSQL to check their values.
VERIFY_SAMPLE = 1000
WRITER = "bench-writer"
LISTENERS = "bench.dispatcher_listeners"
RAW_CONSUMER = "raw.consumer"
RAW_UPSERT = "raw.psycopg.upsert"


# --- the workload -------------------------------------------------------------------


@dataclass
class Workload:
    """Queue records (key, encoded QueuedEvent, partition) and what they hold."""

    queue_id: str
    records: list[tuple[bytes, bytes, int]]
    #: Records per partition: the end offset each partition must reach.
    per_partition: dict[int, int]
    value_bytes: int
    #: key -> (value, entry_version) of the last event of each key.
    last: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    #: The version timestamp of every event.
    timestamp_ms: int = 0

    def __len__(self) -> int:
        return len(self.records)


def build_workload(queue_id: str, events: list[tuple[str, bytes, Operation, int]],
                   advance: Callable[[int], None] | None = None) -> Workload:
    """``events`` (key, JSON value, operation, entry version) as the region service would enqueue them.

    ``advance(n)`` is called every ``BUILD_STEP`` records (a progress bar: 400,000 take ~10 s).
    """
    codec = get_codec()
    now_ms = int(time.time() * 1000)
    changelog_offsets = [0] * BUCKETS
    records = []
    last: dict[str, tuple[bytes, int]] = {}
    value_bytes = 0
    for seq, (key, value, op, entry_version) in enumerate(events):
        key_bytes = key.encode("utf-8")
        bucket = partition_for_key(key_bytes, BUCKETS)
        event = EntryEvent(
            region=REGION, key=key, operation=op, value=value,
            event_id=EventID(WRITER, 1, seq),
            version=VersionTag(1, now_ms, entry_version, WRITER),
            origin_dsid=1, bucket=bucket, event_time=now_ms,
        )
        record = {"queue_id": queue_id, "changelog_partition": bucket,
                  "changelog_offset": changelog_offsets[bucket], "enqueued_at": now_ms, "event": event.to_record()}
        changelog_offsets[bucket] += 1
        records.append((key_bytes, codec.encode("QueuedEvent", record, validate=False), bucket))
        last[key] = (value, entry_version)
        value_bytes += len(value)
        if advance is not None and (seq + 1) % BUILD_STEP == 0:
            advance(BUILD_STEP)
    return Workload(queue_id, records, dict(enumerate(changelog_offsets)), value_bytes // max(1, len(events)), last,
                    now_ms)


def avro_string(text: str) -> bytes:
    """``text`` as Avro encodes a string: its UTF-8 length as a zig-zag varint, then the bytes."""
    data = text.encode("utf-8")
    n = len(data) << 1  # zig-zag of a non-negative length
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + data


def for_queue(workload: Workload, queue_id: str) -> Workload:
    """The same records for another queue: only the ``queue_id`` field of the Avro body differs.

    The field's place is found in the first record (the fields before it, if
    any, are the same in every record of the workload: ``build_workload``
    sets none of them per record), checked in every record, and the first and
    last new records are decoded to be sure.
    """
    old, new = avro_string(workload.queue_id), avro_string(queue_id)
    at = workload.records[0][1].find(old, HEADER_BYTES)
    if at < 0:
        raise RuntimeError(f"queue id {workload.queue_id!r} not found in a QueuedEvent record")
    end = at + len(old)
    records = []
    for key, value, partition in workload.records:
        if value[at:end] != old:
            raise RuntimeError(f"queue id {workload.queue_id!r} not at byte {at} of every QueuedEvent record")
        records.append((key, value[:at] + new + value[end:], partition))
    codec = get_codec()
    for _, value, _ in (records[0], records[-1]):
        if codec.decode_as("QueuedEvent", value)["queue_id"] != queue_id:
            raise RuntimeError(f"re-addressing QueuedEvent records to {queue_id!r} failed")
    return Workload(queue_id, records, workload.per_partition, workload.value_bytes, workload.last,
                    workload.timestamp_ms)


def noop_events(n: int) -> list[tuple[str, bytes, Operation, int]]:
    """``n`` distinct keys in no particular order, 200-byte JSON values."""
    rng = random.Random(11)
    ids = rng.sample(range(10 * n), n)
    return [(f"order-{i:08d}", orjson.dumps(make_value(i)), Operation.PUTALL_CREATE, 1) for i in ids]


def versioned_events(n: int, keys: int) -> list[tuple[str, bytes, Operation, int]]:
    """``n`` events over ``keys`` keys: rounds over every key in a fresh shuffled order, newer versions each round."""
    rng = random.Random(13)
    out: list[tuple[str, bytes, Operation, int]] = []
    round_ = 0
    while len(out) < n:
        order = list(range(keys))
        rng.shuffle(order)
        for k in order[: n - len(out)]:
            value = make_value(k)
            value["qty"] = round_ + 1
            op = Operation.CREATE if round_ == 0 else Operation.UPDATE
            out.append((f"order-{k:08d}", orjson.dumps(value), op, round_ + 1))
        round_ += 1
    return out


def write_queue_site(path: Path, ctx: Context, queues: list[dict[str, Any]]) -> SiteConfig:
    """Region ``orders`` (8 buckets) feeding the parallel async event queues ``queues``; creates the topics."""
    data: dict[str, Any] = {
        "site": "bench",
        "dsid": 1,
        "kafka": {"bootstrap_servers": ctx.bootstrap, "topic_prefix": ctx.topic_prefix()},
        "regions": [{"name": REGION, "buckets": BUCKETS, "async_event_queues": [q["id"] for q in queues]}],
        "async_event_queues": [{"parallel": True, **q} for q in queues],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    report = apply_topics(cfg)
    if not report.ok:
        raise RuntimeError(f"creating the topics of {path} failed: {report}")
    return cfg


def fill_queue(ctx: Context, cfg: SiteConfig, workload: Workload) -> None:
    """Produce the workload's records to its queue topic, every delivery checked."""
    topic = cfg.topics.queue(workload.queue_id)
    producer = RawProducer(ctx.bootstrap, topic)
    try:
        t0 = time.perf_counter()
        with ctx.counting(f"filling {workload.queue_id}", len(workload)) as advance:
            producer.write_all(workload.records, advance)
        ctx.step(f"filled {topic} with {len(workload):,} records ({workload.value_bytes} B values on average) "
                 f"in {time.perf_counter() - t0:.1f}s")
    finally:
        producer.close()
    if ctx.engine == "kafka":
        held = end_offsets(ctx.bootstrap, topic, BUCKETS)
        if held != len(workload):
            raise RuntimeError(f"{topic} holds {held} records, expected {len(workload)}")


# --- the raw consumer ---------------------------------------------------------------------


def raw_consumer_settings(bootstrap: str) -> dict[str, Any]:
    """The baseline consumer: what a user writes to read a topic (assign only, no commits), with the
    local-queue backoff of Sluice's own consumers (librdkafka's default of 1000 ms idles a reader
    that drains its queue fast: core/kafka.py, ``FETCH_QUEUE_BACKOFF_MS``)."""
    return {
        "bootstrap.servers": bootstrap,
        "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
    }


@dataclass(frozen=True, slots=True)
class RawRead:
    """One raw consumer pass: seconds from ``assign`` to the last record, to the first, and what came first."""

    seconds: float
    first_s: float
    #: Records the first ``consume`` returned (already read when the steady clock starts).
    first_count: int
    records: int

    @property
    def rate(self) -> float:
        """Records/s from ``assign`` to the last record."""
        return self.records / self.seconds

    @property
    def steady_rate(self) -> float:
        """Records/s from the first ``consume`` that returned records to the last (the dispatcher's clock)."""
        span = self.seconds - self.first_s
        return (self.records - self.first_count) / span if span > 0 else 0.0


def raw_consume(bootstrap: str, topic: str, workload: Workload, advance: Any = None,
                warm: bool = True) -> RawRead:
    """Read every record of ``topic`` with one consumer.

    ``warm``: the topic's metadata is fetched before the clock starts.  A
    cold client assigned ``OFFSET_BEGINNING`` before it knows the partition
    leaders parks each offset query on librdkafka's retry timer (~0.5 s on
    the 2-core machines) before it reads anything: a constant, not reading.
    """
    ends = {p: n for p, n in workload.per_partition.items() if n > 0}
    expected_bytes = sum(len(v) for _, v, _ in workload.records)
    consumer = Consumer(raw_consumer_settings(bootstrap))
    try:
        if warm:
            consumer.list_topics(topic, timeout=10)
        count = 0
        nbytes = 0
        first_s = None
        first_count = 0
        remaining = dict(ends)
        deadline = time.monotonic() + 120
        t0 = time.perf_counter()
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(BUCKETS)])
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw consumer: {count} of {len(workload)} records read in 120s")
            msgs = consumer.consume(1000, 1.0)
            for msg in msgs:
                if msg.error() is not None:
                    raise RuntimeError(f"raw consumer: {msg.error()}")
                count += 1
                nbytes += len(msg.value())
                p = msg.partition()
                if msg.offset() >= ends.get(p, 0) - 1:
                    remaining.pop(p, None)
            if msgs:
                if first_s is None:
                    first_s = time.perf_counter() - t0
                    first_count = len(msgs)
                if advance is not None:
                    advance(len(msgs))
        elapsed = time.perf_counter() - t0
    finally:
        consumer.close()
    if count != len(workload) or nbytes != expected_bytes:
        raise RuntimeError(f"raw consumer read {count} records ({nbytes} bytes), "
                           f"expected {len(workload)} ({expected_bytes} bytes)")
    return RawRead(elapsed, first_s or 0.0, first_count, count)


def raw_consumer_rate(ctx: Context, cfg: SiteConfig, workload: Workload) -> float:
    """The raw consumer's steady rate on the workload's topic: a cold warm-up pass, then timed passes, the median."""
    topic = cfg.topics.queue(workload.queue_id)
    passes = ctx.sized(RAW_CONSUMER_PASSES, RAW_CONSUMER_PASSES_QUICK)
    cold = raw_consume(ctx.bootstrap, topic, workload, warm=False)  # also the warm-up
    reads = []
    with ctx.counting("raw consumer", len(workload) * passes) as advance, ctx.cpu_use("raw consumer", {}):
        for _ in range(passes):
            reads.append(raw_consume(ctx.bootstrap, topic, workload, advance))
    rate = statistics.median(r.steady_rate for r in reads)
    ctx.step(f"raw consumer: {rate:,.0f} records/s from its first records to the last (median; passes: "
             f"{', '.join(f'{r.steady_rate:,.0f}' for r in reads)})")
    ctx.note(f"raw consumer: {rate:,.0f} records/s steady, {statistics.median(r.rate for r in reads):,.0f} from "
             f"assign; first records {statistics.median(r.first_s for r in reads) * 1000:.0f} ms after assign "
             f"(metadata known); a cold consumer (the warm-up pass) took {cold.seconds:.2f}s, its first record "
             f"after {cold.first_s:.2f}s")
    return rate


def raw_consumer_startup(ctx: Context, topic: str, passes: int) -> float:
    """Seconds from spawning ``python -m bench.first_record`` until it holds a record of ``topic``; the median."""
    times = []
    for _ in range(passes):
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "bench.first_record", ctx.bootstrap, topic], cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509 - only calls prctl
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], FIRST_RECORD_TIMEOUT_S)
            line = proc.stdout.readline() if ready else b""
            at = time.monotonic()
            if line.strip() != b"first":
                proc.kill()
                _, err = proc.communicate(timeout=10)
                raise RuntimeError(f"the raw consumer process read no record in {FIRST_RECORD_TIMEOUT_S:.0f}s "
                                   f"(exit {proc.returncode}): {err.decode(errors='replace')[-1000:]}")
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        times.append(at - t0)
    median = statistics.median(times)
    ctx.note(f"raw consumer process: first record {median:.2f}s after its spawn (median of "
             f"{', '.join(f'{t:.2f}' for t in times)}): interpreter, Kafka client, group join, first fetch")
    return median


def note_decode_cost(ctx: Context, workload: Workload) -> None:
    """What decoding alone costs in one Python process (what the dispatcher does per record, at least)."""
    codec = get_codec()
    sample = [v for _, v, _ in workload.records[:DECODE_SAMPLE]]
    t0 = time.perf_counter()
    for value in sample:
        EntryEvent.from_record(codec.decode_as("QueuedEvent", value)["event"])
    rate = len(sample) / (time.perf_counter() - t0)
    ctx.note(f"decoding alone (codec.decode_as QueuedEvent + EntryEvent.from_record, {len(sample):,} records "
             f"in this process): {rate:,.0f} records/s")


# --- the dispatcher process -------------------------------------------------------------------


class DispatcherProcess(processes.DispatcherProcess):
    """The dispatcher, with the repository on its ``PYTHONPATH`` so the site file
    can name listeners in ``bench.dispatcher_listeners``.  ``started_wall`` /
    ``started`` are taken just before the spawn: the clock of the timed run."""

    def __init__(self, config_path: Path, queue_id: str, log_path: Path, start_timeout_s: float = 60.0) -> None:
        super().__init__(config_path, queue_id, log_path, start_timeout_s=start_timeout_s, extra_path=[str(REPO)])

    def assigned_s(self) -> float | None:
        """Seconds from spawn to the first "primary for partitions" log line (the group join), if logged."""
        match = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO sluice\.queue queue \S+: primary for",
                          self.log_tail(200_000), re.MULTILINE)
        if match is None:
            return None
        logged = dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
        return logged - self.started_wall


@dataclass(frozen=True, slots=True)
class BatchLine:
    partition: int
    first: int
    last: int
    events: int
    duplicates: int
    accepted: bool
    seconds: float
    wall: float


class BatchLog:
    """Reads the batch lines the bench listeners write (bench/dispatcher_listeners.py), incrementally."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lines: list[BatchLine] = []
        self.accepted_events = 0
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, str] = {}

    def refresh(self) -> None:
        for path in sorted(glob.glob(str(self.directory / "*.batches"))):
            with open(path, encoding="ascii") as f:
                f.seek(self._offsets.get(path, 0))
                text = self._partial.pop(path, "") + f.read()
                self._offsets[path] = f.tell()
            complete, _, rest = text.rpartition("\n")
            if rest:
                self._partial[path] = rest
            for row in filter(None, complete.split("\n")):
                p, first, last, n, dups, ok, seconds, wall = row.split()
                line = BatchLine(int(p), int(first), int(last), int(n), int(dups), ok == "1", float(seconds),
                                 float(wall))
                self.lines.append(line)
                if line.accepted:
                    self.accepted_events += line.events

    def check_exactly_once(self, workload: Workload) -> list[BatchLine]:
        """The accepted batches tile every partition's offsets [0, end) exactly; returns them."""
        accepted = [b for b in self.lines if b.accepted]
        by_partition: dict[int, list[BatchLine]] = defaultdict(list)
        for b in accepted:
            by_partition[b.partition].append(b)
        for p in range(BUCKETS):
            expect = 0
            for b in sorted(by_partition.get(p, []), key=lambda b: b.first):
                if b.first != expect:
                    what = "offered twice" if b.first < expect else "never offered"
                    raise RuntimeError(f"partition {p}: offsets from {min(b.first, expect)} {what} "
                                       f"(batch {b.first}..{b.last} after {expect - 1})")
                if b.last - b.first + 1 != b.events:
                    raise RuntimeError(f"partition {p}: batch {b.first}..{b.last} holds {b.events} events")
                expect = b.last + 1
            if expect != workload.per_partition[p]:
                raise RuntimeError(f"partition {p}: accepted up to offset {expect}, the queue holds "
                                   f"{workload.per_partition[p]}")
        return accepted


class RemovalTail:
    """Follows a queue's removals topic: when every partition's head reached its end, the queue is drained.

    ``queue_status`` computes a partition's size as its end offset minus the
    head from this topic; following the topic sees the last removal within a
    few milliseconds, where a ``queue_status`` call takes ~0.2 s.
    """

    def __init__(self, bootstrap: str, topic: str, ends: dict[int, int]) -> None:
        self.ends = ends
        self.heads = {p: 0 for p in ends}
        self.complete_at: float | None = None
        self._codec = get_codec()
        self._consumer = Consumer({**raw_consumer_settings(bootstrap), "fetch.wait.max.ms": 10})
        self._consumer.list_topics(topic, timeout=10)
        self._consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])

    def poll(self) -> bool:
        for msg in self._consumer.consume(1000, 0):
            if msg.error() is not None or msg.value() is None:
                continue
            record = self._codec.decode_as("RemovalRecord", msg.value())
            p = record["queue_partition"]
            self.heads[p] = max(self.heads.get(p, 0), record["last_removed_offset"] + 1)
        if self.complete_at is None and all(self.heads[p] >= end for p, end in self.ends.items()):
            self.complete_at = time.monotonic()
        return self.complete_at is not None

    def close(self) -> None:
        self._consumer.close()


@dataclass
class Drained:
    """One timed dispatcher run: from spawn until the queue was drained.

    Times are seconds from the spawn.  The steady state runs from the first
    accepted batch to the last: the process's start-up (interpreter,
    imports, Kafka clients, group join, first fetch) lies before it, the
    drain's tail (the last removal record) after it.
    """

    seconds: float
    ready_s: float
    assigned_s: float | None
    first_batch_s: float
    last_batch_s: float
    confirmed_s: float
    batches: list[BatchLine]
    rejected: int
    #: The CPU the processes used from the spawn until the queue was drained.
    cpu: CpuUse
    #: ``time.monotonic()`` of the spawn.
    started: float

    @property
    def steady_events(self) -> int:
        """Events accepted after the first batch (those the steady clock times)."""
        first = min(self.batches, key=lambda b: b.wall)
        return sum(b.events for b in self.batches) - first.events

    @property
    def steady_s(self) -> float:
        return self.last_batch_s - self.first_batch_s

    @property
    def steady_rate(self) -> float:
        """Events per second from the first accepted batch to the last (start-up and the drain's tail left out)."""
        return self.steady_events / self.steady_s if self.steady_s > 0 else 0.0

    def steady_cpu(self) -> dict[str, float]:
        """CPU seconds each process used from the first accepted batch to the last."""
        return self.cpu.between(self.started + self.first_batch_s, self.started + self.last_batch_s)

    def describe(self) -> str:
        sizes = [b.events for b in self.batches]
        joined = "?" if self.assigned_s is None else f"{self.assigned_s:.2f}s"
        return (f"banner after {self.ready_s:.2f}s, partitions assigned after {joined}, first batch accepted after "
                f"{self.first_batch_s:.2f}s, last after {self.last_batch_s:.2f}s, last removal durable after "
                f"{self.seconds:.2f}s (queue_status said empty at {self.confirmed_s:.2f}s); "
                f"{self.steady_rate:,.0f} events/s from the first batch to the last, "
                f"{sum(sizes) / self.seconds:,.0f} from the spawn to the last removal; "
                f"{len(sizes)} batches, {statistics.mean(sizes):.0f} events on average (min {min(sizes)}, "
                f"max {max(sizes)})"
                + (f"; {self.rejected} offers refused and offered again" if self.rejected else ""))

    def note_steadiness(self, ctx: Context) -> None:
        """Say so when the steady state is too short, or too small a part of the run, to stand for it."""
        if self.steady_s < STEADY_MIN_S or self.steady_s < 0.5 * self.seconds:
            ctx.note(f"the steady state lasted {self.steady_s:.2f}s of the "
                     f"{self.seconds:.2f}s from the spawn to the drain: too short to stand for the rate "
                     "(a larger workload would)")


def run_dispatcher(ctx: Context, config_path: Path, cfg: SiteConfig, workload: Workload, batch_dir: Path,
                   label: str, postgres_pid: int | None = None) -> Drained:
    """Start one dispatcher for the workload's queue, time it until the queue is drained, verify the batches.

    Drained: the removal records cover every partition to its end (followed
    on the removals topic), then confirmed by ``queue_status`` (every size 0
    and, on Apache Kafka, the ends adding up to the events written).
    """
    queue_id = workload.queue_id
    total = len(workload)
    log = BatchLog(batch_dir)
    timeout_s = 60 + total / 1000
    tail = RemovalTail(ctx.bootstrap, cfg.topics.removals(queue_id), workload.per_partition)
    measured: dict[str, CpuSource] = {} if postgres_pid is None else {"postgres": TreeCpu(postgres_pid)}
    try:
        ctx.step(f"{label}: starting one dispatcher of queue {queue_id} ({total:,} events waiting)")
        with DispatcherProcess(config_path, queue_id, ctx.workdir / f"dispatcher-{queue_id}.log") as proc:
            with ctx.counting(label, total) as advance, ctx.profiling(proc.pid, queue_id), \
                    ctx.cpu_use(label, {"dispatcher": proc.pid, **measured}) as cpu:
                next_refresh = 0.0
                while not tail.poll():
                    now = time.monotonic()
                    if proc.proc.poll() is not None:
                        raise RuntimeError(f"the dispatcher exited ({proc.proc.returncode}); log:\n{proc.log_tail()}")
                    if now - proc.started > timeout_s:
                        raise TimeoutError(f"queue {queue_id} not drained after {timeout_s:.0f}s: heads "
                                           f"{tail.heads}, ends {workload.per_partition}, {log.accepted_events} "
                                           f"events accepted; log:\n{proc.log_tail()}")
                    if now >= next_refresh:
                        before = log.accepted_events
                        log.refresh()
                        advance(log.accepted_events - before)
                        next_refresh = now + STATUS_POLL_S
                    time.sleep(0.01)
            assert tail.complete_at is not None
            while True:
                rows = queue_status(cfg, queue_id)
                # On Tansu the ends (high watermarks) may be too low (KAFKA-NOTES quirk 3).
                exact = ctx.engine != "kafka" or sum(r.end for r in rows) == total
                if all(r.size == 0 for r in rows) and exact:
                    confirmed = time.monotonic()
                    break
                if time.monotonic() - proc.started > timeout_s:
                    raise RuntimeError(f"the removals cover queue {queue_id}, but queue_status says sizes "
                                       f"{[r.size for r in rows]}, ends {[r.end for r in rows]}")
                time.sleep(STATUS_POLL_S)
            assigned_s = proc.assigned_s()
    finally:
        tail.close()
    log.refresh()
    batches = log.check_exactly_once(workload)
    return Drained(
        seconds=tail.complete_at - proc.started, ready_s=proc.ready_s, assigned_s=assigned_s,
        first_batch_s=min(b.wall for b in batches) - proc.started_wall,
        last_batch_s=max(b.wall for b in batches) - proc.started_wall,
        confirmed_s=confirmed - proc.started, batches=batches,
        rejected=sum(1 for b in log.lines if not b.accepted), cpu=cpu, started=proc.started,
    )


def check_dead_letters(ctx: Context, cfg: SiteConfig, queue_id: str) -> None:
    if ctx.engine == "kafka" and (n := sum(count_records(ctx.bootstrap, cfg.topics.dead_letter(queue_id), 1).values())):
        raise RuntimeError(f"queue {queue_id}: {n} records were dead-lettered")


def noop_queue(queue_id: str, batch_size: int, batch_dir: Path) -> dict[str, Any]:
    batch_dir.mkdir(parents=True, exist_ok=True)
    return {"id": queue_id, "batch_size": batch_size,
            "listener": {"type": "python", "class_path": f"{LISTENERS}:CountingListener",
                         "settings": {"directory": str(batch_dir)}}}


@benchmark("dispatcher.noop.throughput", "parallel queue, 8 buckets, no-op listener, events/s vs a raw consumer")
def noop_throughput(ctx: Context) -> list[Result]:
    n = ctx.sized(400_000, 20_000)
    ctx.step(f"building {n:,} queue records (200-byte values) for queues {NOOP_QUEUE} and {NOOP100_QUEUE}")
    with ctx.counting("building the workload", n) as advance:
        workload = build_workload(NOOP_QUEUE, noop_events(n), advance)
    workload100 = for_queue(workload, NOOP100_QUEUE)
    batches, batches100 = ctx.workdir / "batches-noop", ctx.workdir / "batches-noop-b100"
    config_path = ctx.workdir / "site.yaml"
    cfg = write_queue_site(config_path, ctx, [noop_queue(NOOP_QUEUE, BATCH_SIZE, batches),
                                              noop_queue(NOOP100_QUEUE, GEODE_BATCH_SIZE, batches100)])
    fill_queue(ctx, cfg, workload)
    fill_queue(ctx, cfg, workload100)

    raw_rate = raw_consumer_rate(ctx, cfg, workload)
    startup_baseline = raw_consumer_startup(ctx, cfg.topics.queue(NOOP_QUEUE),
                                            ctx.sized(STARTUP_PASSES, STARTUP_PASSES_QUICK))
    note_decode_cost(ctx, workload)

    results = []
    for wl, batch_dir, size, name in ((workload, batches, BATCH_SIZE, "dispatcher.noop.throughput"),
                                      (workload100, batches100, GEODE_BATCH_SIZE,
                                       "dispatcher.noop.throughput.batch100")):
        run = run_dispatcher(ctx, config_path, cfg, wl, batch_dir, f"dispatch, batch_size {size}")
        check_dead_letters(ctx, cfg, wl.queue_id)
        duplicates = sum(b.duplicates for b in run.batches)
        ctx.note(f"batch_size {size}: {run.steady_rate:,.0f} events/s steady; start-up {run.first_batch_s:.2f}s; "
                 f"{run.describe()}; {duplicates:,} of {n:,} events flagged possibleDuplicate")
        run.note_steadiness(ctx)
        results.append(Result(name, run.steady_rate, "events/s", RAW_CONSUMER, raw_rate))
        if size == BATCH_SIZE:
            results.append(Result("dispatcher.noop.startup", run.first_batch_s, "s", f"{RAW_CONSUMER}.startup",
                                  startup_baseline))
        results += ctx.cpu_per_event(name, run.steady_cpu(), run.steady_events, processes=("dispatcher", "broker"),
                                     what="steady state")
    return results


# --- PostgreSQL ------------------------------------------------------------------------------


def find_pg_bin() -> Path | None:
    """The directory holding initdb and postgres (PATH first, else the newest /usr/lib/postgresql/*/bin)."""
    initdb, postgres = shutil.which("initdb"), shutil.which("postgres")
    if initdb and postgres:
        return Path(os.path.realpath(initdb)).parent
    candidates = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")
                  if (Path(p) / "initdb").exists() and (Path(p) / "postgres").exists()]
    if not candidates:
        return None
    return max(candidates, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def install_postgresql(ctx: Context) -> None:
    """Debian's postgresql package, as tests/pg.py installs it on a fresh CI machine (root only)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError("PostgreSQL is not installed (no initdb); install Debian's postgresql package")
    ctx.step("PostgreSQL is not installed: apt-get install postgresql")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """A private PostgreSQL server, a child of the runner (SIGTERMed should the runner die).

    As tests/pg.py: ``initdb -A trust`` in a directory of its own under /tmp,
    as the ``postgres`` user when running as root (initdb and postgres refuse
    root), listening on 127.0.0.1 at a free port with ``fsync=off``.  The
    server runs in the foreground (``postgres``, not ``pg_ctl``) so it is
    this process's child and dies with it; ``stop()`` asks for a fast
    shutdown and removes the directory.
    """

    start_attempts = 3

    def __init__(self, bin_dir: Path, log_copy: Path) -> None:
        self.bin_dir = bin_dir
        self.log_copy = log_copy
        self.root = Path(tempfile.mkdtemp(prefix="sluice-bench-pg-", dir="/tmp"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "server.log"
        as_root = os.geteuid() == 0
        self._ids: dict[str, Any] = {"user": "postgres", "group": "postgres", "extra_groups": []} if as_root else {}
        if as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 60.0) -> float:
        """initdb and start; returns the seconds taken."""
        import psycopg

        t0 = time.monotonic()
        done = subprocess.run(
            [str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-A", "trust", "-U", "postgres", "-E", "UTF8",
             "--locale=C", "--no-sync"],
            capture_output=True, text=True, timeout=120, cwd=self.root, check=False, **self._ids,
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb exited {done.returncode}: {(done.stderr or done.stdout).strip()[-1000:]}")
        for _ in range(self.start_attempts):
            port = _free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), "-p", str(port), "-k", str(self.root),
                     "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=50"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                    start_new_session=True,
                    preexec_fn=die_with_parent,  # noqa: PLW1509 - only calls prctl (after the user switch)
                    **self._ids,
                )
            url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and self.proc.poll() is None:
                try:
                    psycopg.connect(url, connect_timeout=2).close()
                    self.url = url
                    return time.monotonic() - t0
                except psycopg.OperationalError:
                    time.sleep(0.1)
            # Exited (another process may have taken the port: try another) or never answered.
            self._stop_server()
        raise RuntimeError(f"PostgreSQL did not start; log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _stop_server(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        # SIGINT: fast shutdown (clients disconnected, no checkpoint wait beyond a shutdown checkpoint).
        for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        """Stop the server, keep its log in the benchmark's work directory, remove its directory.  Idempotent."""
        try:
            self._stop_server()
        finally:
            with contextlib.suppress(OSError):
                if self.log_path.exists():
                    shutil.copyfile(self.log_path, self.log_copy)
            shutil.rmtree(self.root, ignore_errors=True)

    def connect(self, **kwargs: Any) -> Any:
        import psycopg

        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.url, **kwargs)


def tree_pids(pid: int) -> set[int]:
    """``pid`` and each of its descendants now alive (PostgreSQL works in child processes).

    Read from ``/proc/PID/task/TID/children`` (a few µs each), not by
    scanning every process of the machine.
    """
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for children in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                found = [int(c) for c in Path(children).read_text().split()]
            except (OSError, ValueError):
                continue  # the thread or the process is gone
            for child in found:
                if child not in tree:
                    tree.add(child)
                    frontier.append(child)
    return tree


class TreeCpu:
    """The CPU seconds of a process and its descendants now alive: a ``CpuSource`` for ``ctx.cpu_use``.

    A process born during a measured block counts in full (all its CPU was
    used during the block); one that exits during it stops counting.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __call__(self) -> float | None:
        root = cpu_seconds(self.pid)
        if root is None:
            return None
        return root + sum(used for p in tree_pids(self.pid) - {self.pid} if (used := cpu_seconds(p)) is not None)


# --- the raw psycopg baseline --------------------------------------------------------------------

RAW_DDL = f"""CREATE TABLE {RAW_TABLE} (
  key text NOT NULL PRIMARY KEY,
  value jsonb,
  sluice_version_dsid integer NOT NULL,
  sluice_version_timestamp bigint NOT NULL,
  sluice_entry_version bigint NOT NULL,
  sluice_deleted boolean NOT NULL DEFAULT false,
  sluice_operation text NOT NULL
)"""

RAW_UPSERT_SQL = (
    f"INSERT INTO {RAW_TABLE} AS stored (key, value, sluice_version_dsid, sluice_version_timestamp, "
    "sluice_entry_version, sluice_deleted, sluice_operation) VALUES (%s, %s::jsonb, %s, %s, %s, false, %s) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value, sluice_version_dsid = excluded.sluice_version_dsid, "
    "sluice_version_timestamp = excluded.sluice_version_timestamp, "
    "sluice_entry_version = excluded.sluice_entry_version, sluice_deleted = excluded.sluice_deleted, "
    "sluice_operation = excluded.sluice_operation "
    "WHERE stored.sluice_entry_version < excluded.sluice_entry_version"
)


def raw_rows(workload: Workload, events: list[tuple[str, bytes, Operation, int]]) -> list[list[tuple[Any, ...]]]:
    """The workload's ``events`` as rows, partition by partition in queue order, cut in batches of BATCH_SIZE."""
    by_partition: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for (key, value, op, entry_version), (_, _, partition) in zip(events, workload.records, strict=True):
        by_partition[partition].append((key, value.decode("utf-8"), 1, workload.timestamp_ms, entry_version, op.value))
    return [rows[i:i + BATCH_SIZE] for p in sorted(by_partition) for rows in [by_partition[p]]
            for i in range(0, len(rows), BATCH_SIZE)]


def raw_upsert(ctx: Context, server: PostgresServer, batches: list[list[tuple[Any, ...]]],
               measure: bool = True) -> tuple[float, list[float]]:
    """Upsert every batch (executemany + commit, one connection); total seconds and seconds per batch."""
    with server.connect() as conn:
        conn.execute(f"DROP TABLE IF EXISTS {RAW_TABLE}")
        conn.execute(RAW_DDL)
    per_batch = []
    label = "raw psycopg upsert"
    with server.connect(autocommit=False) as conn, ctx.counting(label, sum(map(len, batches))) as advance, \
            (ctx.cpu_use(label, {"postgres": TreeCpu(server.pid)}) if measure and server.pid is not None
             else contextlib.nullcontext()):
        t0 = time.perf_counter()
        for rows in batches:
            b0 = time.perf_counter()
            with conn.cursor() as cursor:
                cursor.executemany(RAW_UPSERT_SQL, rows)
            conn.commit()
            per_batch.append(time.perf_counter() - b0)
            advance(len(rows))
        total = time.perf_counter() - t0
    return total, per_batch


def verify_table(ctx: Context, server: PostgresServer, table: str, workload: Workload) -> None:
    """The table holds exactly the workload's keys, live, and a sample holds each key's last value and version."""
    with server.connect() as conn:
        live = conn.execute(f"SELECT count(*) FROM {table}_live" if table == SQL_TABLE
                            else f"SELECT count(*) FROM {table} WHERE NOT sluice_deleted").fetchone()[0]
        rows = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        if live != len(workload.last) or rows != len(workload.last):
            raise RuntimeError(f"{table} holds {rows} rows ({live} live), expected {len(workload.last)} keys")
        sample = random.Random(7).sample(sorted(workload.last), min(VERIFY_SAMPLE, len(workload.last)))
        got = {k: (v, ver) for k, v, ver in conn.execute(
            f"SELECT key, value, sluice_entry_version FROM {table} WHERE key = ANY(%s)", (sample,))}
    wrong = [k for k in sample
             if k not in got or got[k] != (orjson.loads(workload.last[k][0]), workload.last[k][1])]
    if wrong:
        raise RuntimeError(f"{table}: {len(wrong)} of {len(sample)} sampled rows differ, e.g. {wrong[0]}: "
                           f"{got.get(wrong[0])} != {workload.last[wrong[0]]}")
    ctx.step(f"verified {table}: {rows:,} rows, all live, {len(sample)} sampled values and versions")


@benchmark("dispatcher.sql.postgres", "parallel queue, 8 buckets, SQL write-behind to PostgreSQL: rows/s and "
           "batch latency vs raw psycopg")
def sql_postgres(ctx: Context) -> list[Result]:
    n = ctx.sized(100_000, 10_000)
    keys = n // VERSIONS_PER_KEY
    bin_dir = find_pg_bin()
    if bin_dir is None:
        install_postgresql(ctx)
        bin_dir = find_pg_bin()
        if bin_dir is None:
            raise RuntimeError("installed Debian's postgresql, but found no initdb/postgres")
    ctx.step(f"building {n:,} queue records over {keys:,} keys ({VERSIONS_PER_KEY} versions each)")
    events = versioned_events(n, keys)
    workload = build_workload(SQL_QUEUE, events)
    batches = raw_rows(workload, events)
    del events

    server = PostgresServer(bin_dir, ctx.workdir / "postgres.log")
    try:
        started_s = server.start()
        ctx.step(f"PostgreSQL ({bin_dir}) on {server.url}, pid {server.pid}, ready in {started_s:.1f}s")
        batch_dir = ctx.workdir / "batches-sql"
        batch_dir.mkdir()
        config_path = ctx.workdir / "site.yaml"
        queue = {"id": SQL_QUEUE, "batch_size": BATCH_SIZE,
                 "listener": {"type": "python", "class_path": f"{LISTENERS}:TimedSqlListener",
                              "settings": {"url": server.url, "table": SQL_TABLE, "batch_log_dir": str(batch_dir)}}}
        cfg = write_queue_site(config_path, ctx, [queue])
        fill_queue(ctx, cfg, workload)
        consumer_rate = raw_consumer_rate(ctx, cfg, workload)

        ctx.step(f"raw psycopg: a warm-up, then {n:,} upserts in {len(batches)} transactions of up to {BATCH_SIZE}")
        raw_upsert(ctx, server, batches[:3], measure=False)
        raw_s, raw_batch_s = raw_upsert(ctx, server, batches)
        upsert_rate = n / raw_s
        verify_table(ctx, server, RAW_TABLE, workload)
        ctx.step(f"raw psycopg: {upsert_rate:,.0f} rows/s")
        with server.connect() as conn:
            # Leave the server nothing to do (autovacuum of the baseline's table) while the dispatcher runs.
            conn.execute(f"DROP TABLE {RAW_TABLE}")
            conn.execute("CHECKPOINT")

        run = run_dispatcher(ctx, config_path, cfg, workload, batch_dir, "write-behind", server.pid)
        check_dead_letters(ctx, cfg, SQL_QUEUE)
        verify_table(ctx, server, SQL_TABLE, workload)
    finally:
        server.stop()

    rate = run.steady_rate
    full = [b.seconds * 1000 for b in run.batches if b.events == BATCH_SIZE]
    if not full:
        raise RuntimeError(f"no batch of {BATCH_SIZE} events was offered: {run.describe()}")
    raw_full = [s * 1000 for s, rows in zip(raw_batch_s, batches) if len(rows) == BATCH_SIZE]
    ctx.note(f"write-behind: {rate:,.0f} rows/s steady; start-up {run.first_batch_s:.2f}s; {run.describe()}; "
             f"latency from the {len(full)} batches of {BATCH_SIZE} events (raw psycopg: {len(raw_full)} batches)")
    run.note_steadiness(ctx)
    return [
        Result("dispatcher.sql.postgres.throughput", rate, "rows/s", RAW_UPSERT, upsert_rate),
        Result("dispatcher.sql.postgres.throughput", rate, "rows/s", RAW_CONSUMER, consumer_rate),
        Result("dispatcher.sql.postgres.batch_latency.p50", percentile(full, 50), "ms",
               f"{RAW_UPSERT}.batch.p50", percentile(raw_full, 50)),
        Result("dispatcher.sql.postgres.batch_latency.p99", percentile(full, 99), "ms",
               f"{RAW_UPSERT}.batch.p99", percentile(raw_full, 99)),
        *ctx.cpu_per_event("dispatcher.sql.postgres.throughput", run.steady_cpu(), run.steady_events,
                           processes=("dispatcher", "broker", "postgres"), what="per row, steady state"),
    ]
