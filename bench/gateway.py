"""Gateway benchmarks: site A's parallel gateway sender to site B's receiver, across two brokers.

Both benchmarks run two sites on two brokers: site A on the run's broker
(``ctx.bootstrap``), site B on a second broker of the same engine started
here and stopped in ``finally``.  Site A has region ``orders`` (8 buckets)
with one attached parallel gateway sender ``orders-to-b``; site B has the
same region and a receiver.  Processes: A's region service, A's sender
(``python -m sluice.cli parallel-sender``), B's receiver and B's region
service.  An event counts as *applied on B* when B's region service has
written its changelog record on B's broker (the record every reader of B
sees; the region holds it in memory by then): a consumer in this process
reads B's changelog from the beginning and counts, or times, the records.
README.md says what each figure means.

``gateway.throughput``
    1. Start A's region service and write ``events`` entries through it with
       ``put_all`` while no sender runs: the sender's queue topic on A
       fills.  Stop A's region service (the sender does not need it).
    2. Baseline ``raw.mirror``: one confluent-kafka consumer reads A's queue
       topic from the beginning and one producer writes every record to a
       topic on B (same partition), until ``flush()`` returns with every
       record acknowledged by B; a warm-up pass, then timed passes, the
       median.
    3. Baseline ``mirrormaker2``: Apache Kafka's MirrorMaker 2 (dedicated
       mode, jars from Maven Central through ``deploy/mirror/pom.xml``)
       mirrors the queue topic from A to B (identity replication policy);
       timed from the first record seen on B until B's copy holds
       ``events`` records.
    4. Sluice: start B's region service, B's receiver and A's sender with
       ``manual_start`` (it joins its group and reads, but sends nothing);
       once all 8 queue partitions have a primary, ``sluice admin start``
       (``set_state RUNNING``); the figure is the rate from the first
       event applied on B to the last (MirrorMaker's clock), and the rate
       from the start command and the seconds from it to the first event
       applied are figures of their own (``.from_start``, ``.startup``).
       The CPU each process used from the start command to the last event,
       per event, is a figure of its own; the sum over the
       sender, the receiver, B's region and B's broker is compared with the
       raw mirror's (its copy loop and B's broker) per record.
    5. Verify: B's region holds exactly the keys written, a sample holds the
       values written, B's changelog holds exactly one record per event.

``gateway.latency``
    1. Baseline: a paced producer writes 5,000 records/s to a topic on A; a
       raw mirror (consume, produce; a child process, ``python -m
       bench.gateway raw-mirror``) copies them to B; a consumer on B notes
       when each record arrives.
    2. Sluice: the four services (sender ``batch_time_interval_ms`` 50);
       paced ``put_all`` chunks at 5,000 entries/s on A; the consumer of B's
       changelog notes when each entry arrives.
    Each event's latency is from the start of the call that wrote it (the
    ``produce`` or the ``put_all``) to its arrival on B; warm-up seconds
    first, not counted.  Whether B kept up is measured on both sides: the
    backlog (events A acknowledged, less those on B) is read every
    ``BACKLOG_SAMPLE_S``, and its size when the last write was acknowledged
    is a figure of its own, as are the rate the writers reached and the CPU
    per event, as in gateway.throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from sluice.admin.cli import queue_status, set_state
from sluice.broker import BrokerProcess, start_broker
from sluice.broker.jars import cache_root
from sluice.client import RegionClient
from sluice.core.config import SiteConfig, load_config
from sluice.core.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
    describe_group_members,
    make_admin,
    partition_for_key,
)
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess, die_with_parent
from sluice.core.topics import apply_topics

from .aims import KEEP_UP_BACKLOG_S, KEEP_UP_WRITTEN_SHARE, LATENCY_RATE
from .dispatcher import raw_consumer_settings
from .harness import REPO, Context, Result, benchmark
from .region import (
    BATCH_ENTRIES,
    RawProducer,
    count_records,
    create_topic,
    make_key,
    make_value,
    percentile,
    raw_producer_settings,
    send_batches,
)

REGION = "orders"
BUCKETS = 8
SENDER = "orders-to-b"
DSID_A = 1
DSID_B = 2
#: The sender's batches: a backlog fills batches of BATCH_SIZE at once;
#: at a steady rate they are cut every BATCH_TIME_INTERVAL_MS (the issue's 50 ms).
BATCH_SIZE = 1000
BATCH_TIME_INTERVAL_MS = 50
#: Client threads writing the backlog through A's region service (as region.put_all.ingest).
FILL_THREADS = 2
#: Timed passes of the raw mirror (after a warm-up pass); the median is reported.
RAW_PASSES = 3
#: Entries read back from B's region to compare values.
VERIFY_SAMPLE = 2000
#: Seconds to wait for a drain, a mirror or the last event before failing.
DRAIN_TIMEOUT_S = 180.0

# The latency workload: a steady rate (the 5,000 events/s, LATENCY_RATE), in chunks paced by the clock.
LATENCY_CHUNK = 50
#: A chunk is due every 10 ms; a put_all of 50 waits for two acknowledged
#: records per entry and took 20–70 ms here with the gateway's four
#: processes sharing the 2 cores (five threads reached only ~3,800/s): ten
#: threads take turns so that the writers keep the schedule.
LATENCY_THREADS = 10

#: consume() waits for its whole timeout unless it gets all the records it
#: asked for, so at a steady rate the timeout is added to every record's
#: delay: the measuring consumer and the raw mirror keep it short.
WATCH_POLL_S = 0.002
MIRROR_POLL_S = 0.005

RAW_MIRROR = "raw.mirror"
MIRRORMAKER2 = "mirrormaker2"

#: The processes whose CPU per event the issue sums: what carries an event
#: from A's queue into B's changelog (A's broker and region serve A's side).
CPU_TOTAL = ("sender", "receiver", "region-b", "broker-b")
#: Every Sluice process measured, in the order printed (``region-a`` only in gateway.latency).
CPU_PROCESSES = ("region-a", "sender", "receiver", "region-b", "broker-b", "broker-a")
#: What the raw mirror's CPU per record sums, against CPU_TOTAL: the copy loop and B's broker.
RAW_CPU_TOTAL = ("mirror", "broker-b")
#: Seconds between two readings of the backlog (written on A, not yet applied on B) in gateway.latency.
BACKLOG_SAMPLE_S = 0.5

MIRROR_POM = REPO / "deploy" / "mirror" / "pom.xml"
MIRROR_LOG4J = REPO / "deploy" / "mirror" / "log4j2.properties"
MIRROR_MARKER = ".sluice-complete"
MIRROR_FETCH_TIMEOUT_S = 600.0
#: MirrorMaker's heap; connect-mirror-maker.sh asks for -Xmx2G, which two
#: brokers and four Python services on 2 cores do not need to share.
MIRROR_HEAP = "768m"


# --- two sites on two brokers ---------------------------------------------------------


@dataclass
class Sites:
    """Site A (region + sender) on the run's broker, site B (region + receiver) on a second one."""

    broker_b: BrokerProcess
    path_a: Path
    path_b: Path
    cfg_a: SiteConfig
    cfg_b: SiteConfig

    @property
    def bootstrap_a(self) -> str:
        return self.cfg_a.kafka.bootstrap_servers

    @property
    def bootstrap_b(self) -> str:
        return self.broker_b.bootstrap

    @property
    def queue_topic(self) -> str:
        return self.cfg_a.topics.queue(SENDER)

    @property
    def changelog_b(self) -> str:
        return self.cfg_b.topics.region_changelog(REGION)


@contextlib.contextmanager
def second_broker(ctx: Context) -> Iterator[BrokerProcess]:
    """Site B's broker: the run's engine, its data in the benchmark's work directory; stopped on exit."""
    ctx.step(f"starting site B's broker ({ctx.engine})")
    broker = start_broker("bench-b", 0, ctx.engine, data_dir=ctx.workdir / "broker-b")
    try:
        ctx.step(f"site B's broker: {broker.engine_label} on {broker.bootstrap} "
                 f"(started in {broker.last_start_s or 0:.1f}s)")
        yield broker
    finally:
        broker.stop()


def write_sites(ctx: Context, broker_b: BrokerProcess, sender: dict[str, Any]) -> Sites:
    """Both site files (as tests/integration/test_gateway.py ``_sites``, on two brokers); creates the topics."""
    prefix = ctx.topic_prefix()
    prefix_a, prefix_b = f"{prefix}a.", f"{prefix}b."
    site_a = {
        "site": "a", "dsid": DSID_A,
        "kafka": {"bootstrap_servers": ctx.bootstrap, "topic_prefix": prefix_a},
        "regions": [{"name": REGION, "buckets": BUCKETS, "gateway_senders": [SENDER]}],
        "gateway_senders": [{
            "id": SENDER, "remote_dsid": DSID_B, "parallel": True, "socket_read_timeout_ms": 30_000,
            **sender,
            "remote": {"bootstrap_servers": broker_b.bootstrap, "topic_prefix": prefix_b},
        }],
    }
    site_b = {
        "site": "b", "dsid": DSID_B,
        "kafka": {"bootstrap_servers": broker_b.bootstrap, "topic_prefix": prefix_b},
        "regions": [{"name": REGION, "buckets": BUCKETS}],
        "receiver": {"accepted_dsids": [DSID_A]},
    }
    paths, cfgs = [], []
    for name, data in (("a", site_a), ("b", site_b)):
        path = ctx.workdir / f"site-{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        cfg = load_config(path)
        report = apply_topics(cfg)
        if not report.ok:
            raise RuntimeError(f"creating the topics of {path} failed: {report}")
        paths.append(path)
        cfgs.append(cfg)
    return Sites(broker_b, paths[0], paths[1], cfgs[0], cfgs[1])


def start_region(ctx: Context, sites: Sites, site: str) -> RegionProcess:
    path = sites.path_a if site == "a" else sites.path_b
    region = RegionProcess(path, ctx.workdir / f"region-{site}.log")
    try:
        waited = region.wait_ready()
    except BaseException:
        region.stop()
        raise
    ctx.step(f"site {site.upper()}'s region service {region.url} (pid {region.pid}) ready in "
             f"{region.ready_s + waited:.1f}s")
    return region


def wait_sender_assigned(sites: Sites, sender: SenderProcess, timeout_s: float = 60.0) -> float:
    """Wait until the sender is primary of every queue partition; returns the seconds waited.

    A primary reports each partition to the status topic once it has taken
    it over (``sluice admin status`` shows it).  On Tansu that report is not
    always read back (its high watermarks lag, KAFKA-NOTES quirk 3), so the
    sender's own log line ``primary for partitions [...]``, written at the
    same moment, counts too.
    """
    started = time.monotonic()
    pattern = re.compile(rf"queue {re.escape(SENDER)}: primary for partitions \[([0-9, ]*)\]")
    while True:
        rows = queue_status(sites.cfg_a, SENDER)
        if rows and all(r.primary != "—" for r in rows):
            return time.monotonic() - started
        logged = {int(p) for m in pattern.finditer(sender.log_tail(200_000)) for p in m.group(1).split(",") if p.strip()}
        if logged >= set(range(BUCKETS)):
            return time.monotonic() - started
        if sender.proc.poll() is not None:
            raise RuntimeError(f"the sender exited ({sender.proc.returncode}); log:\n{sender.log_tail()}")
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the sender is not primary of every partition after {timeout_s:.0f}s: status "
                               f"{[(r.partition, r.primary) for r in rows]}, log {sorted(logged)}")
        time.sleep(0.1)


def wait_receiver_assigned(sites: Sites, receiver: ReceiverProcess, timeout_s: float = 60.0) -> float:
    """Wait until the receiver holds inbound partitions; returns the seconds waited.

    The receiver's group says so; on Tansu, whose group descriptions lag,
    the receiver's log line ``inbound partitions [...]`` counts too.
    """
    started = time.monotonic()
    admin = make_admin({"bootstrap.servers": sites.bootstrap_b})
    group = f"{sites.cfg_b.kafka.topic_prefix}gateway.receiver"
    while True:
        with contextlib.suppress(Exception):  # the group may not exist yet
            if any(tps for _, tps in describe_group_members(admin, group)):
                return time.monotonic() - started
        if re.search(r"inbound partitions \[[0-9]", receiver.log_tail(200_000)):
            return time.monotonic() - started
        if receiver.proc.poll() is not None:
            raise RuntimeError(f"the receiver exited ({receiver.proc.returncode}); log:\n{receiver.log_tail()}")
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the receiver holds no inbound partition after {timeout_s:.0f}s")
        time.sleep(0.1)


# --- watching a topic on B -------------------------------------------------------------


def watcher_settings(bootstrap: str) -> dict[str, Any]:
    """The measuring consumer: assign only, answers within ~5 ms of a record's arrival."""
    return {**raw_consumer_settings(bootstrap), "fetch.wait.max.ms": 5, "isolation.level": "read_committed"}


class TopicWatcher:
    """Reads a topic from its beginning in a thread of its own, counting records and timing arrivals.

    The topic may not exist yet (MirrorMaker creates its copy when it
    starts): the thread waits for it.  With ``seq_of`` (a record key →
    event number) it notes the ``time.monotonic()`` at which each event was
    first read, and counts events read more than once.
    """

    def __init__(self, bootstrap: str, topic: str, target: int, *,
                 seq_of: Callable[[bytes], int] | None = None, advance: Callable[[int], None] | None = None) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.target = target
        self.seq_of = seq_of
        self.advance = advance
        self.count = 0
        self.first_at: float | None = None
        #: Records already there when the first ones were read.
        self.first_count = 0
        self.reached_at: float | None = None
        self.arrivals: list[float | None] = [None] * target if seq_of is not None else []
        self.repeats = 0
        self.failure: BaseException | None = None
        self._stopping = threading.Event()
        self._reached = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{topic}", daemon=True)

    def start(self) -> "TopicWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        consumer = Consumer(watcher_settings(self.bootstrap))
        try:
            partitions: list[int] = []
            while not partitions and not self._stopping.is_set():
                topic = consumer.list_topics(self.topic, timeout=5).topics.get(self.topic)
                if topic is not None and topic.error is None and topic.partitions:
                    partitions = sorted(topic.partitions)
                else:
                    self._stopping.wait(0.05)
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in partitions])
            while not self._stopping.is_set():
                # consume() returns early only with 1000 records: under a
                # steady flow it waits out its whole timeout, which would be
                # counted as latency.  A 2 ms timeout bounds that error.
                msgs = consumer.consume(1000, WATCH_POLL_S)
                if not msgs:
                    continue
                now = time.monotonic()
                for msg in msgs:
                    if msg.error() is not None:
                        raise RuntimeError(f"reading {self.topic}: {msg.error()}")
                    if self.seq_of is not None:
                        seq = self.seq_of(msg.key())
                        if self.arrivals[seq] is None:
                            self.arrivals[seq] = now
                        else:
                            self.repeats += 1
                if self.first_at is None:
                    self.first_at, self.first_count = now, len(msgs)
                self.count += len(msgs)
                if self.advance is not None:
                    self.advance(len(msgs))
                if self.count >= self.target and self.reached_at is None:
                    self.reached_at = now
                    self._reached.set()
        except BaseException as exc:  # noqa: BLE001 - the top of a thread: handed to the waiter
            self.failure = exc
            self._reached.set()
        finally:
            consumer.close()

    def wait_reached(self, timeout_s: float, alive: Callable[[], str | None] = lambda: None) -> float:
        """Wait until ``target`` records were read; returns the monotonic time they were.

        ``alive`` returns why waiting is pointless (a process died), or None.
        """
        end = time.monotonic() + timeout_s
        while not self._reached.wait(0.1):
            dead = alive()
            if dead is not None:
                raise RuntimeError(f"{dead}; {self.count} of {self.target} records on {self.topic}")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.count} of {self.target} records on {self.topic} after {timeout_s:.0f}s")
        if self.failure is not None:
            raise RuntimeError(f"watching {self.topic} failed: {self.failure!r}") from self.failure
        assert self.reached_at is not None
        return self.reached_at

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)


@contextlib.contextmanager
def logs_on_timeout(sender: SenderProcess, receiver: ReceiverProcess) -> Iterator[None]:
    """A drain that times out says why, as far as the sender's and the receiver's logs tell."""
    try:
        yield
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\nsender log (end):\n{sender.log_tail(1500)}\n"
                           f"receiver log (end):\n{receiver.log_tail(1500)}") from None


def process_gone(*procs: Any) -> Callable[[], str | None]:
    """For ``wait_reached``: names the first of ``procs`` (ServiceProcess or Popen) that exited."""

    def check() -> str | None:
        for p in procs:
            popen = getattr(p, "proc", p)
            if popen.poll() is not None:
                tail = p.log_tail(1500) if hasattr(p, "log_tail") else ""
                return f"{' '.join(map(str, popen.args[:4]))}… exited ({popen.returncode}) {tail}"
        return None

    return check


# --- the raw mirror ---------------------------------------------------------------------


def raw_mirror_consumer_settings(bootstrap: str) -> dict[str, Any]:
    """The raw mirror's consumer: what a user writes to copy a topic (assign only, no commits)."""
    # librdkafka's default fetch wait, stated: under a steady flow a fetch
    # returns as soon as a record is there (fetch.min.bytes 1).
    return {**raw_consumer_settings(bootstrap), "fetch.wait.max.ms": 500}


def mirror_once(bootstrap_a: str, bootstrap_b: str, topic: str, target_topic: str,
                counts: dict[int, int], advance: Callable[[int], None] | None = None) -> float:
    """Copy ``topic`` on A (``counts``: its records per partition) into ``target_topic`` on B, each
    record to its own partition; returns the seconds from ``assign`` until ``flush()`` returned with
    every record acknowledged by B.  Metadata of both topics is fetched before the clock starts.

    The end is counted, not read from high watermarks, which Tansu reports
    too low under batched load (KAFKA-NOTES, quirk 3).
    """
    expected = sum(counts.values())
    consumer = Consumer(raw_mirror_consumer_settings(bootstrap_a))
    sink = RawProducer(bootstrap_b, target_topic)
    try:
        consumer.list_topics(topic, timeout=10)
        sink.producer.list_topics(target_topic, timeout=10)
        remaining = {p: n for p, n in counts.items() if n > 0}
        copied = 0
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        t0 = time.perf_counter()
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in counts])
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw mirror: {copied} of {expected} records copied in {DRAIN_TIMEOUT_S:.0f}s")
            msgs = consumer.consume(1000, MIRROR_POLL_S)
            for msg in msgs:
                if msg.error() is not None:
                    raise RuntimeError(f"raw mirror: {msg.error()}")
                p = msg.partition()
                left = remaining.get(p)
                if left is None:
                    raise RuntimeError(f"raw mirror: {topic}[{p}] holds more records than the {counts[p]} written")
                sink.produce(msg.key(), msg.value(), p)
                copied += 1
                if left == 1:
                    del remaining[p]
                else:
                    remaining[p] = left - 1
            sink.producer.poll(0)
            if advance is not None and msgs:
                advance(len(msgs))
        unflushed = sink.producer.flush(DRAIN_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        sink.check(unflushed, expected)
        return elapsed
    finally:
        consumer.close()
        sink.close()


def run_raw_mirror(bootstrap_a: str, bootstrap_b: str, topic: str, target_topic: str) -> int:
    """``python -m bench.gateway raw-mirror``: copy ``topic`` (from its beginning) until SIGTERM.

    A child process, so that the mirror does not share a GIL with the
    paced producer and the watcher that measure it.  Prints ``raw mirror
    ready`` once it is assigned and has metadata of both topics.
    """
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    consumer = Consumer(raw_mirror_consumer_settings(bootstrap_a))
    sink = RawProducer(bootstrap_b, target_topic)
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        sink.producer.list_topics(target_topic, timeout=10)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        print("raw mirror ready", flush=True)
        copied = 0
        while not stopping.is_set():
            for msg in consumer.consume(1000, MIRROR_POLL_S):
                if msg.error() is not None:
                    raise RuntimeError(f"raw mirror: {msg.error()}")
                sink.produce(msg.key(), msg.value(), msg.partition())
                copied += 1
            sink.producer.poll(0)
        sink.check(sink.producer.flush(30), copied)
        return 0
    finally:
        consumer.close()
        sink.close()


class _Child:
    """A child process of the benchmark with a log file: its pid, log tail, and a SIGTERM stop."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    _log: Any

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, SIGKILL after 30 s; its exit status.  Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


class RawMirrorProcess(_Child):
    """The raw mirror as a child process (``run_raw_mirror``); SIGTERM makes it flush and check its deliveries."""

    def __init__(self, bootstrap_a: str, bootstrap_b: str, topic: str, target_topic: str, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gateway", "raw-mirror", bootstrap_a, bootstrap_b, topic, target_topic],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
            start_new_session=True, preexec_fn=die_with_parent,  # noqa: PLW1509 - only calls prctl
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("raw mirror ready"):
            self.stop()
            raise RuntimeError(f"the raw mirror did not start (exit {self.proc.poll()}): {self.log_tail()}")
        return self.proc.returncode


# --- MirrorMaker 2 --------------------------------------------------------------------------


def mirror_version() -> str:
    """The Kafka version deploy/mirror/pom.xml names for MirrorMaker (its ``kafka.version``)."""
    found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", MIRROR_POM.read_text())
    if found is None:
        raise RuntimeError(f"{MIRROR_POM} names no <kafka.version>")
    return found.group(1).strip()


def ensure_mirror_jars(ctx: Context) -> tuple[Path, str]:
    """The MirrorMaker 2 jars (fetched once with Maven, cached under ``~/.cache/sluice``) and their version.

    As services/broker/jars.py does for the broker: Maven copies into a
    temporary sibling that is renamed into place, with a marker holding the
    pom's SHA-256, so a half-done fetch or an edited pom fetches again.
    """
    if shutil.which("java") is None:
        raise RuntimeError("MirrorMaker 2 needs a Java runtime (java on PATH); none found")
    version = mirror_version()
    digest = hashlib.sha256(MIRROR_POM.read_bytes()).hexdigest()
    libs = cache_root() / f"mirrormaker-{version}" / "libs"
    with contextlib.suppress(OSError):
        if (libs / MIRROR_MARKER).read_text().splitlines()[0] == f"mirrormaker {version} pom-sha256 {digest}":
            return libs, version
    if shutil.which("mvn") is None:
        raise RuntimeError(f"MirrorMaker 2 {version} is not cached in {libs} and Maven (mvn) is not on PATH "
                           "to fetch it from Maven Central")
    ctx.step(f"fetching MirrorMaker 2 {version} jars from Maven Central into {libs}")
    libs.parent.mkdir(parents=True, exist_ok=True)
    staging = libs.parent / f"libs.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    command = ["mvn", "-q", "-B", "-f", str(MIRROR_POM), "dependency:copy-dependencies",
               f"-DoutputDirectory={staging}", "-DincludeScope=runtime"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=MIRROR_FETCH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"mvn did not fetch MirrorMaker 2 {version} within {MIRROR_FETCH_TIMEOUT_S:.0f}s") from exc
    jars = sorted(staging.glob("*.jar")) if staging.is_dir() else []
    if done.returncode != 0 or not any(j.name.startswith("connect-mirror-") for j in jars):
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"mvn could not fetch MirrorMaker 2 {version} (org.apache.kafka:connect-mirror) "
                           f"from Maven Central (exit {done.returncode}):\n{tail}")
    (staging / MIRROR_MARKER).write_text(f"mirrormaker {version} pom-sha256 {digest}\n"
                                         + "".join(f"{j.name}\n" for j in jars))
    stale = libs.parent / f"libs.stale-{os.getpid()}"
    if libs.exists():
        os.rename(libs, stale)
    os.rename(staging, libs)
    shutil.rmtree(stale, ignore_errors=True)
    ctx.step(f"fetched {len(jars)} jars")
    return libs, version


def mm2_properties(bootstrap_a: str, bootstrap_b: str, topic: str) -> dict[str, str]:
    """MirrorMaker 2 (dedicated mode) copying ``topic`` from cluster a to cluster b, and nothing else."""
    return {
        "clusters": "a, b",
        "a.bootstrap.servers": bootstrap_a,
        "b.bootstrap.servers": bootstrap_b,
        "a->b.enabled": "true",
        "a->b.topics": re.escape(topic),
        "b->a.enabled": "false",
        # The copy keeps the topic's name (the default policy would call it "a.<topic>").
        "replication.policy.class": "org.apache.kafka.connect.mirror.IdentityReplicationPolicy",
        # One broker per cluster: one replica for the copy and Connect's own topics.
        "replication.factor": "1",
        "offset.storage.replication.factor": "1",
        "status.storage.replication.factor": "1",
        "config.storage.replication.factor": "1",
        "heartbeats.topic.replication.factor": "1",
        "checkpoints.topic.replication.factor": "1",
        # Copy records, nothing more: no heartbeats, checkpoints, offset
        # syncs, group offsets, topic configs or ACLs.  With checkpoints and
        # offset syncs off MirrorMaker logs once that MirrorCheckpointConnector
        # "can't run": expected, it is the connector switched off.
        "emit.heartbeats.enabled": "false",
        "emit.checkpoints.enabled": "false",
        "emit.offset-syncs.enabled": "false",
        "sync.group.offsets.enabled": "false",
        "sync.topic.configs.enabled": "false",
        "sync.topic.acls.enabled": "false",
        "refresh.groups.enabled": "false",
        # MirrorMaker's default: one task (one consumer, one producer), as
        # the raw mirror and Sluice's one sender process.
        "tasks.max": "1",
        "dedicated.mode.enable.internal.rest": "false",
        # Read the plugins' ServiceLoader manifests instead of scanning every
        # jar's classes (MirrorMaker suggests it at start): ~2 s less start-up,
        # nothing else changes.
        "plugin.discovery": "service_load",
    }


class MirrorMakerProcess(_Child):
    """``org.apache.kafka.connect.mirror.MirrorMaker mm2.properties`` in a JVM of its own."""

    def __init__(self, libs: Path, properties: dict[str, str], workdir: Path) -> None:
        self.config_path = workdir / "mm2.properties"
        self.config_path.write_text("".join(f"{k} = {v}\n" for k, v in properties.items()))
        self.log_path = workdir / "mirrormaker.log"
        self._log = open(self.log_path, "ab")
        command = [
            "java", "-Xms256m", f"-Xmx{MIRROR_HEAP}",
            # kafka-run-class.sh's KAFKA_JVM_PERFORMANCE_OPTS, what a user gets.
            "-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={MIRROR_LOG4J}",
            "-cp", str(libs / "*"), "org.apache.kafka.connect.mirror.MirrorMaker", str(self.config_path),
        ]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509


# --- helpers ----------------------------------------------------------------------------------


def fill_queue(ctx: Context, sites: Sites, events: int) -> dict[str, Any]:
    """Write ``events`` entries through A's region service (no sender runs); returns key → value."""
    keys = [make_key("gw", i) for i in range(events)]
    values = [make_value(i) for i in range(events)]
    batches = [dict(zip(keys[i:i + BATCH_ENTRIES], values[i:i + BATCH_ENTRIES]))
               for i in range(0, events, BATCH_ENTRIES)]
    region_a = start_region(ctx, sites, "a")
    try:
        with ctx.counting("put_all on A", events) as advance:
            seconds, _ = send_batches(region_a.url, batches, FILL_THREADS, advance)
        ctx.step(f"{events:,} entries written on A in {seconds:.1f}s ({events / seconds:,.0f}/s)")
    finally:
        region_a.stop()
    if ctx.engine == "kafka":
        queued = sum(count_records(sites.bootstrap_a, sites.queue_topic, BUCKETS).values())
        if queued != events:
            raise RuntimeError(f"{sites.queue_topic} holds {queued} records, expected {events}")
    return dict(zip(keys, values))


def verify_b(ctx: Context, sites: Sites, region_b: RegionProcess, expected: dict[str, Any],
             watcher: TopicWatcher) -> None:
    """B's region holds exactly the keys written, a sample their values; B's changelog one record each."""
    with RegionClient(region_b.url, timeout_s=120) as client:
        keys = client.keys(REGION)
        if len(keys) != len(expected) or set(keys) != set(expected):
            missing = len(set(expected) - set(keys))
            raise RuntimeError(f"B's region holds {len(keys)} keys, expected {len(expected)} ({missing} missing)")
        sample = random.Random(7).sample(sorted(expected), min(VERIFY_SAMPLE, len(expected)))
        got = client.get_all(REGION, sample)
        wrong = [k for k in sample if (got.get(k) or {}).get("value") != expected[k]]
        if wrong:
            raise RuntimeError(f"{len(wrong)} of {len(sample)} sampled entries differ on B, e.g. {wrong[0]}")
    # Anything applied twice would add changelog records after the target was reached.
    time.sleep(0.5)
    if watcher.count != len(expected):
        raise RuntimeError(f"B's changelog holds {watcher.count} records, expected {len(expected)}")
    ctx.step(f"verified on B: {len(keys):,} keys, {len(sample)} values, one changelog record each")


def rss_mb(pid: int | None) -> str:
    """A process's resident memory, e.g. "146 MB" ("?" when unknown)."""
    if pid is None:
        return "?"
    with contextlib.suppress(OSError, IndexError, ValueError):
        return f"{int(Path(f'/proc/{pid}/status').read_text().split('VmRSS:')[1].split()[0]) // 1024} MB"
    return "?"


# --- gateway.throughput -----------------------------------------------------------------------


@benchmark("gateway.throughput", "parallel sender A→B (8 buckets), events/s vs a raw mirror and MirrorMaker 2")
def gateway_throughput(ctx: Context) -> list[Result]:
    events = ctx.sized(200_000, 10_000)
    # MirrorMaker first: a missing jar fails the benchmark before anything else runs.
    libs, mm2_version = ensure_mirror_jars(ctx)
    with second_broker(ctx) as broker_b:
        sender_settings = {"batch_size": BATCH_SIZE, "batch_time_interval_ms": BATCH_TIME_INTERVAL_MS,
                           "manual_start": True}
        sites = write_sites(ctx, broker_b, sender_settings)
        ctx.step(f"filling {sites.queue_topic} on A with {events:,} events through A's region service")
        expected = fill_queue(ctx, sites, events)
        # A parallel sender's queue partition is the entry's bucket.
        counts = Counter(partition_for_key(k.encode(), BUCKETS) for k in expected)
        raw_rate, raw_cpu = measure_raw_mirror(ctx, sites, dict(counts), events)
        mm2_rate, mm2_startup = measure_mirrormaker(ctx, sites, libs, mm2_version, events)
        drain = measure_sluice_drain(ctx, sites, expected)
    ctx.note(f"events/s, from the first on B to the last: Sluice {drain.rate:,.0f}, raw mirror {raw_rate:,.0f}, "
             f"MirrorMaker 2 {mm2_version} {mm2_rate:,.0f}; Sluice from the start command {drain.from_start:,.0f}")
    return [
        Result("gateway.throughput", drain.rate, "events/s", RAW_MIRROR, raw_rate),
        Result("gateway.throughput", drain.rate, "events/s", MIRRORMAKER2, mm2_rate),
        Result("gateway.throughput.from_start", drain.from_start, "events/s", MIRRORMAKER2, mm2_rate),
        Result("gateway.throughput.startup", drain.startup_s, "s", f"{MIRRORMAKER2}.startup", mm2_startup),
        *gateway_cpu_results(ctx, "gateway.throughput", drain.cpu_s, events, raw_cpu),
    ]


def raw_cpu_per_record(ctx: Context, cpu_s: dict[str, float], records: int) -> dict[str, float]:
    """The raw mirror's µs of CPU per record: the copy loop (``mirror``), B's broker, and their total; noted."""
    us = {name: cpu_s[name] * 1e6 / records for name in RAW_CPU_TOTAL if name in cpu_s}
    if len(us) == len(RAW_CPU_TOTAL):
        us["+".join(RAW_CPU_TOTAL)] = sum(us[name] for name in RAW_CPU_TOTAL)
    ctx.note("raw mirror: CPU per record, µs: " + ", ".join(f"{name} {v:,.1f}" for name, v in us.items()))
    return us


def gateway_cpu_results(ctx: Context, figure: str, cpu_s: dict[str, float], events: int,
                        raw_us: dict[str, float]) -> list[Result]:
    """CPU per event of every Sluice process and of CPU_TOTAL, against the raw mirror's where it has a match."""
    total = "+".join(CPU_TOTAL)
    raw_total = "+".join(RAW_CPU_TOTAL)
    baselines: dict[str, tuple[str, float | None]] = {}
    if raw_total in raw_us:
        baselines[total] = (f"{RAW_MIRROR}.cpu.{raw_total}", raw_us[raw_total])
    if "broker-b" in raw_us:
        baselines["broker-b"] = (f"{RAW_MIRROR}.cpu.broker-b", raw_us["broker-b"])
    return ctx.cpu_per_event(figure, cpu_s, events, processes=[p for p in CPU_PROCESSES if p in cpu_s],
                             total=CPU_TOTAL, baselines=baselines)


def measure_raw_mirror(ctx: Context, sites: Sites, counts: dict[int, int],
                       events: int) -> tuple[float, dict[str, float]]:
    """Warm-up pass, then timed passes of the raw mirror, each into a fresh topic on B.

    Returns the median rate and the CPU per record (``raw_cpu_per_record``)
    over the timed passes; the mirror runs in this process.
    """
    passes = RAW_PASSES
    targets = [f"{sites.cfg_b.kafka.topic_prefix}raw-mirror-{n}" for n in range(passes + 1)]
    for t in targets:
        create_topic(sites.bootstrap_b, t, BUCKETS)
    ctx.step(f"raw mirror A→B: a warm-up pass, then {passes} timed passes of {events:,} records")
    mirror_once(sites.bootstrap_a, sites.bootstrap_b, sites.queue_topic, targets[0], counts)
    rates = []
    with ctx.counting("raw mirror", events * passes) as advance, \
            ctx.cpu_use("raw mirror", {"broker-b": sites.broker_b.pid}, broker="broker-a") as cpu:
        for target in targets[1:]:
            rates.append(events / mirror_once(sites.bootstrap_a, sites.bootstrap_b, sites.queue_topic, target,
                                              counts, advance))
    rate = statistics.median(rates)
    ctx.step(f"raw mirror: {rate:,.0f} records/s (median; passes: {', '.join(f'{r:,.0f}' for r in rates)})")
    used = cpu.seconds()
    if "bench" in used:
        used["mirror"] = used.pop("bench")
    return rate, raw_cpu_per_record(ctx, used, events * passes)


def measure_mirrormaker(ctx: Context, sites: Sites, libs: Path, version: str, events: int) -> tuple[float, float]:
    """MirrorMaker 2 copies the queue topic to B: records/s from the first record on B to the last, and
    the seconds from its JVM's spawn to that first record."""
    ctx.step(f"MirrorMaker 2 {version} (dedicated mode, 1 task) mirroring {sites.queue_topic} A→B")
    mm2 = MirrorMakerProcess(libs, mm2_properties(sites.bootstrap_a, sites.bootstrap_b, sites.queue_topic),
                             ctx.workdir)
    try:
        with ctx.counting("MirrorMaker 2", events) as advance:
            watcher = TopicWatcher(sites.bootstrap_b, sites.queue_topic, events, advance=advance).start()
            try:
                with ctx.cpu_use("MirrorMaker 2, from its spawn", {"mirrormaker": mm2.pid,
                                                                    "broker-b": sites.broker_b.pid},
                                 broker="broker-a") as cpu:
                    reached = watcher.wait_reached(DRAIN_TIMEOUT_S, alive=_mm2_alive(mm2))
            finally:
                watcher.stop()
        assert watcher.first_at is not None
        seconds = reached - watcher.first_at
        copied = events - watcher.first_count
        if seconds <= 0 or copied <= 0:
            raise RuntimeError(f"MirrorMaker 2's copy appeared at once ({watcher.first_count} records in the first "
                               "read): too few events to time it")
        rate = copied / seconds
        startup = watcher.first_at - mm2.started
        ctx.note(f"MirrorMaker 2 {version}: first record on B {startup:.1f}s after the JVM was spawned, then "
                 f"{copied:,} records in {seconds:.2f}s; resident {rss_mb(mm2.pid)} (heap -Xmx{MIRROR_HEAP})")
        # Its JVM's start is left out, as from the clock: CPU from its first record on B to the last.
        copying = cpu.between(watcher.first_at, reached)
        ctx.note(f"MirrorMaker 2: CPU per record from its first record on B to the last, µs: " + ", ".join(
            f"{n} {copying[n] * 1e6 / copied:,.1f}" for n in ("mirrormaker", "broker-b", "broker-a") if n in copying)
            + "; CPU seconds from its spawn: " + ", ".join(f"{n} {v:.1f}" for n, v in cpu.seconds().items()
                                                          if n != "bench"))
        if watcher.count != events:
            raise RuntimeError(f"MirrorMaker 2's copy holds {watcher.count} records, expected {events}")
        return rate, startup
    except BaseException:
        ctx.step(f"MirrorMaker 2 log (end):\n{mm2.log_tail(1500)}")
        raise
    finally:
        mm2.stop()


def _mm2_alive(mm2: MirrorMakerProcess) -> Callable[[], str | None]:
    def check() -> str | None:
        if mm2.proc.poll() is not None:
            return f"MirrorMaker 2 exited ({mm2.proc.returncode}); log:\n{mm2.log_tail()}"
        return None
    return check


@dataclass(frozen=True)
class Drain:
    """What ``measure_sluice_drain`` measured."""

    #: Events/s from the first event applied on B to the last: MirrorMaker's clock.
    rate: float
    #: Events/s from ``sluice admin start`` to the last event applied on B.
    from_start: float
    #: Seconds from ``sluice admin start`` to the first event applied on B.
    startup_s: float
    #: CPU seconds of each process from the start command to the last event.
    cpu_s: dict[str, float]


def measure_sluice_drain(ctx: Context, sites: Sites, expected: dict[str, Any]) -> Drain:
    """B's services and A's (stopped) sender; ``sluice admin start``; events/s until all are applied on B."""
    events = len(expected)
    procs: list[Any] = []
    try:
        region_b = start_region(ctx, sites, "b")
        procs.append(region_b)
        receiver = ReceiverProcess(sites.path_b, ctx.workdir / "receiver-b.log")
        procs.append(receiver)
        sender = SenderProcess(sites.path_a, SENDER, ctx.workdir / "sender-a.log")
        procs.append(sender)
        waited_r = wait_receiver_assigned(sites, receiver)
        waited_s = wait_sender_assigned(sites, sender)
        ctx.step(f"receiver assigned in {receiver.ready_s + waited_r:.1f}s, sender (manual start, stopped) "
                 f"primary of all {BUCKETS} partitions in {sender.ready_s + waited_s:.1f}s")
        with ctx.counting("applied on B", events) as advance:
            watcher = TopicWatcher(sites.bootstrap_b, sites.changelog_b, events, advance=advance).start()
            try:
                with ctx.profiling(sender.pid, "sender"), ctx.profiling(receiver.pid, "receiver"), \
                        ctx.profiling(region_b.pid, "region-b"), ctx.cpu_use("Sluice A→B", {
                        "sender": sender.pid, "receiver": receiver.pid, "region-b": region_b.pid,
                        "broker-b": sites.broker_b.pid}, broker="broker-a") as cpu:
                    t0 = time.monotonic()
                    set_state(sites.cfg_a, SENDER, "RUNNING", issued_by="bench")
                    with logs_on_timeout(sender, receiver):
                        reached = watcher.wait_reached(DRAIN_TIMEOUT_S, alive=process_gone(sender, receiver, region_b))
                seconds = reached - t0
                assert watcher.first_at is not None
                first_to_last = (events - watcher.first_count) / max(1e-9, reached - watcher.first_at)
                ctx.note(f"Sluice: {events:,} events applied on B in {seconds:.2f}s from `sluice admin start`; "
                         f"first applied after {watcher.first_at - t0:.2f}s; {first_to_last:,.0f} events/s from the "
                         "first to the last (the MirrorMaker figure's clock)")
                verify_b(ctx, sites, region_b, expected, watcher)
                stats = region_b.stats()
                windows = max(1, stats["windows"])
                ctx.note(f"region B wrote {stats['windows']:,} windows (Kafka transactions), "
                         f"{stats['window_records'] / windows:,.0f} records each on average")
            finally:
                watcher.stop()
        ctx.note(f"resident: sender {rss_mb(sender.pid)}, receiver {rss_mb(receiver.pid)}, "
                 f"region B {rss_mb(region_b.pid)}, broker B {rss_mb(sites.broker_b.pid)}")
        return Drain(first_to_last, events / seconds, watcher.first_at - t0, cpu.seconds())
    finally:
        for proc in reversed(procs):
            proc.stop()


# --- gateway.latency ------------------------------------------------------------------------------


def paced_writes(total: int, rate: int, chunk: int, threads: int,
                 write: Callable[[int, int], None], sent_at: list[float]) -> tuple[float, float]:
    """Call ``write(first_seq, count)`` for chunks of ``chunk`` events at ``rate`` events/s.

    Chunk k is due ``k * chunk / rate`` seconds after the start; ``threads``
    threads take turns (thread i the chunks k ≡ i mod threads), so one slow
    call does not hold the next one back.  A chunk that is late goes at
    once.  ``sent_at[seq]`` gets the ``time.monotonic()`` at which its
    chunk's call began.  Returns the achieved rate and the latest a chunk
    started after its due time (seconds).
    """
    chunks = (total + chunk - 1) // chunk
    interval = chunk / rate
    start = time.monotonic() + 0.05
    late = [0.0] * threads
    failures: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for k in range(i, chunks, threads):
                if failures:
                    return
                due = start + k * interval
                now = time.monotonic()
                if now < due:
                    time.sleep(due - now)
                    now = time.monotonic()
                late[i] = max(late[i], now - due)
                first = k * chunk
                count = min(chunk, total - first)
                for seq in range(first, first + count):
                    sent_at[seq] = now
                write(first, count)
        except BaseException as exc:  # noqa: BLE001 - the top of a thread: handed to the caller below
            failures.append(exc)

    workers = [threading.Thread(target=worker, args=(i,), name=f"bench-paced-{i}", daemon=True)
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if failures:
        raise RuntimeError(f"a writer thread failed: {failures[0]!r}") from failures[0]
    elapsed = time.monotonic() - start
    return total / elapsed, max(late)


class Tally:
    """A count several threads add to (events whose write A acknowledged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class BacklogTimeline:
    """How far B is behind A over the run, read every ``BACKLOG_SAMPLE_S`` by a thread of its own.

    Each reading is (seconds since the start, events written on A and
    acknowledged, events applied on B); the backlog is their difference.
    A path that keeps up holds it about level (its latency times the rate);
    one that does not lets it grow for as long as the writes last.
    """

    def __init__(self, written: Callable[[], int], applied: Callable[[], int]) -> None:
        self._written = written
        self._applied = applied
        self.samples: list[tuple[float, int, int]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backlog", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> "BacklogTimeline":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stopping.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stopping.wait(BACKLOG_SAMPLE_S):
            # Applied first: an event is never counted on B before it is counted written on A.
            applied = self._applied()
            self.samples.append((time.monotonic() - self._t0, self._written(), applied))

    def describe(self, shown_max: int = 12) -> str:
        """The backlog at up to ``shown_max`` evenly spaced readings, e.g. ``2s 410, 4s 380, …``."""
        if not self.samples:
            return "no reading"
        every_s = max(BACKLOG_SAMPLE_S, self.samples[-1][0] / shown_max)
        shown, next_at = [], every_s
        for at, written, applied in self.samples:
            if at >= next_at:
                shown.append(f"{at:.1f}s {max(0, written - applied):,}")
                next_at += every_s
        return ", ".join(shown) or "no reading"


@dataclass(frozen=True, slots=True)
class PacedRun:
    """One side of gateway.latency: each event's latency, and whether B kept up with the writes."""

    latencies_ms: list[float]
    #: Events/s the writers reached (all writes acknowledged by A).
    written_rate: float
    #: Events written on A and not yet applied on B when the last write was acknowledged.
    backlog_end: int
    #: Seconds from then until B held every event.
    drain_s: float


def note_pace(ctx: Context, side: str, run: PacedRun, late_s: float, timeline: BacklogTimeline) -> None:
    """Say whether the writers kept the schedule and B kept up with them (README: "B keeps up").

    A path slower than the rate it is fed builds a backlog, and its
    "latency" is then the backlog's age, growing with the run's length.
    """
    ctx.note(f"{side}: written at {run.written_rate:,.0f}/s (the latest chunk started {late_s * 1000:,.0f} ms after "
             f"its time); when the writes ended {run.backlog_end:,} events were not yet on B "
             f"({run.backlog_end / LATENCY_RATE:.2f}s of input), all were {run.drain_s * 1000:,.0f} ms later; "
             f"backlog (written on A, not yet on B) over the run: {timeline.describe()}")
    if run.written_rate < KEEP_UP_WRITTEN_SHARE * LATENCY_RATE:
        ctx.note(f"{side}: the writers did not keep {LATENCY_RATE:,}/s ({run.written_rate:,.0f}/s)")
    if run.backlog_end > KEEP_UP_BACKLOG_S * LATENCY_RATE:
        ctx.note(f"{side}: B did not keep up: {run.backlog_end / LATENCY_RATE:.1f}s of input behind A when the writes "
                 "ended, so its latency is the age of a growing backlog")


def latencies_ms(sent_at: list[float], watcher: TopicWatcher, skip: int) -> list[float]:
    """Per event from ``skip`` on: arrival on B minus the start of its write, in ms."""
    out = []
    for seq in range(skip, len(sent_at)):
        arrived = watcher.arrivals[seq]
        assert arrived is not None
        out.append((arrived - sent_at[seq]) * 1000)
    return out


def seq_from_key(key: bytes) -> int:
    """``lat-00001234`` → 1234 (the latency workload's keys)."""
    return int(key[4:])


def latency_key(seq: int) -> str:
    return f"lat-{seq:08d}"


@benchmark("gateway.latency", "put on A → visible on B at 5,000 events/s, p50/p99 vs a raw mirror")
def gateway_latency(ctx: Context) -> list[Result]:
    measured_s = ctx.sized(20, 2)
    warm_s = ctx.sized(2, 1)
    warm = LATENCY_RATE * warm_s
    total = warm + LATENCY_RATE * measured_s
    with second_broker(ctx) as broker_b:
        sites = write_sites(ctx, broker_b, {"batch_size": BATCH_SIZE,
                                            "batch_time_interval_ms": BATCH_TIME_INTERVAL_MS})
        # The aim is stated at this interval: check the site file the sender reads says so.
        bti = sites.cfg_a.sender(SENDER).batch_time_interval_ms
        if bti != BATCH_TIME_INTERVAL_MS:
            raise RuntimeError(f"the sender's batch_time_interval_ms is {bti}, not {BATCH_TIME_INTERVAL_MS}")
        raw, raw_cpu = measure_raw_latency(ctx, sites, total, warm)
        sluice, cpu_s = measure_sluice_latency(ctx, sites, total, warm)
    sluice_ms, raw_ms = sluice.latencies_ms, raw.latencies_ms
    ctx.note(f"latency ms p50/p99/max: Sluice {percentile(sluice_ms, 50):.1f}/{percentile(sluice_ms, 99):.1f}/"
             f"{max(sluice_ms):.1f}, raw mirror {percentile(raw_ms, 50):.1f}/{percentile(raw_ms, 99):.1f}/"
             f"{max(raw_ms):.1f}")
    return [
        Result("gateway.latency.p50", percentile(sluice_ms, 50), "ms", f"{RAW_MIRROR}.latency.p50",
               percentile(raw_ms, 50)),
        Result("gateway.latency.p99", percentile(sluice_ms, 99), "ms", f"{RAW_MIRROR}.latency.p99",
               percentile(raw_ms, 99)),
        Result("gateway.latency.written", sluice.written_rate, "events/s", "raw.producer.written", raw.written_rate),
        Result("gateway.latency.backlog_end", sluice.backlog_end, "events", f"{RAW_MIRROR}.backlog_end",
               raw.backlog_end),
        *gateway_cpu_results(ctx, "gateway.latency", cpu_s, total, raw_cpu),
    ]


def measure_raw_latency(ctx: Context, sites: Sites, total: int, warm: int) -> tuple[PacedRun, dict[str, float]]:
    """Paced produce to A, raw mirror (child process) to B, watcher on B; the mirror's CPU per record."""
    source = f"{sites.cfg_a.kafka.topic_prefix}raw-latency"
    target = f"{sites.cfg_b.kafka.topic_prefix}raw-latency"
    create_topic(sites.bootstrap_a, source, BUCKETS)
    create_topic(sites.bootstrap_b, target, BUCKETS)
    keys = [latency_key(i).encode() for i in range(total)]
    partitions = [partition_for_key(k, BUCKETS) for k in keys]
    values = [orjson.dumps(make_value(i)) for i in range(total)]
    sent_at = [0.0] * total
    ctx.step(f"raw mirror latency: {total:,} records at {LATENCY_RATE:,}/s ({warm:,} warm-up)")
    mirror = RawMirrorProcess(sites.bootstrap_a, sites.bootstrap_b, source, target, ctx.workdir / "raw-mirror.log")
    producer = Producer(raw_producer_settings(sites.bootstrap_a))
    errors: list[KafkaError] = []
    delivered = Tally()

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.add(1)

    lock = threading.Lock()

    def write(first: int, count: int) -> None:
        with lock:
            for seq in range(first, first + count):
                producer.produce(source, values[seq], keys[seq], partition=partitions[seq], on_delivery=on_delivery)
            producer.poll(0)

    try:
        producer.list_topics(source, timeout=10)
        with ctx.counting("raw mirror: on B", total) as advance:
            watcher = TopicWatcher(sites.bootstrap_b, target, total, seq_of=seq_from_key, advance=advance).start()
            try:
                with ctx.cpu_use("raw mirror latency", {"mirror": mirror.pid, "broker-b": sites.broker_b.pid},
                                 broker="broker-a") as cpu, \
                        BacklogTimeline(lambda: delivered.value, lambda: watcher.count) as timeline:
                    achieved, late = paced_writes(total, LATENCY_RATE, LATENCY_CHUNK, 1, write, sent_at)
                    unflushed = producer.flush(30)
                    if unflushed or errors:
                        raise RuntimeError(f"raw producer: records not delivered to A: {errors[:3]}")
                    written_at, backlog_end = time.monotonic(), total - watcher.count
                    reached = watcher.wait_reached(60, alive=process_gone(mirror.proc))
                if watcher.repeats:
                    raise RuntimeError(f"{watcher.repeats} records reached B twice through the raw mirror")
            finally:
                watcher.stop()
    finally:
        status = mirror.stop()
    if status != 0:
        raise RuntimeError(f"the raw mirror failed (exit {status}): {mirror.log_tail()}")
    run = PacedRun(latencies_ms(sent_at, watcher, warm), achieved, backlog_end, max(0.0, reached - written_at))
    note_pace(ctx, "raw mirror", run, late, timeline)
    return run, raw_cpu_per_record(ctx, cpu.seconds(), total)


def measure_sluice_latency(ctx: Context, sites: Sites, total: int, warm: int) -> tuple[PacedRun, dict[str, float]]:
    """Paced put_all on A through the four services; watcher on B's changelog; the CPU each process used."""
    values = [make_value(i) for i in range(total)]
    sent_at = [0.0] * total
    procs: list[Any] = []
    try:
        region_a = start_region(ctx, sites, "a")
        procs.append(region_a)
        region_b = start_region(ctx, sites, "b")
        procs.append(region_b)
        receiver = ReceiverProcess(sites.path_b, ctx.workdir / "receiver-b.log")
        procs.append(receiver)
        sender = SenderProcess(sites.path_a, SENDER, ctx.workdir / "sender-a.log")
        procs.append(sender)
        wait_receiver_assigned(sites, receiver)
        wait_sender_assigned(sites, sender)
        clients = [RegionClient(region_a.url, timeout_s=30) for _ in range(LATENCY_THREADS)]
        by_thread = threading.local()
        pool = iter(clients)
        pool_lock = threading.Lock()
        acknowledged = Tally()

        def write(first: int, count: int) -> None:
            client = getattr(by_thread, "client", None)
            if client is None:
                with pool_lock:
                    client = by_thread.client = next(pool)
            client.put_all(REGION, {latency_key(s): values[s] for s in range(first, first + count)})
            acknowledged.add(count)

        ctx.step(f"Sluice latency: {total:,} entries put on A at {LATENCY_RATE:,}/s in chunks of {LATENCY_CHUNK} "
                 f"from {LATENCY_THREADS} threads ({warm:,} warm-up); sender batch_time_interval_ms "
                 f"{BATCH_TIME_INTERVAL_MS}")
        try:
            with ctx.counting("Sluice: applied on B", total) as advance:
                watcher = TopicWatcher(sites.bootstrap_b, sites.changelog_b, total, seq_of=seq_from_key,
                                       advance=advance).start()
                try:
                    with ctx.profiling(sender.pid, "sender"), ctx.cpu_use("Sluice latency", {
                            "region-a": region_a.pid, "sender": sender.pid, "receiver": receiver.pid,
                            "region-b": region_b.pid, "broker-b": sites.broker_b.pid}, broker="broker-a") as cpu, \
                            BacklogTimeline(lambda: acknowledged.value, lambda: watcher.count) as timeline:
                        achieved, late = paced_writes(total, LATENCY_RATE, LATENCY_CHUNK, LATENCY_THREADS, write,
                                                      sent_at)
                        # Every put_all has returned: all is written on A.  What is not on B yet is the backlog.
                        written_at, backlog_end = time.monotonic(), total - watcher.count
                        with logs_on_timeout(sender, receiver):
                            reached = watcher.wait_reached(DRAIN_TIMEOUT_S,
                                                           alive=process_gone(sender, receiver, region_a, region_b))
                    if watcher.repeats:
                        raise RuntimeError(f"{watcher.repeats} events were applied on B twice")
                    verify_b(ctx, sites, region_b, {latency_key(i): v for i, v in enumerate(values)}, watcher)
                finally:
                    watcher.stop()
        finally:
            for c in clients:
                c.close()
        run = PacedRun(latencies_ms(sent_at, watcher, warm), achieved, backlog_end, max(0.0, reached - written_at))
        note_pace(ctx, "Sluice", run, late, timeline)
        return run, cpu.seconds()
    finally:
        for proc in reversed(procs):
            proc.stop()


# --- python -m bench.gateway raw-mirror ---------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway",
                                     description="The raw mirror of gateway.latency, as a process of its own.")
    sub = parser.add_subparsers(dest="command", required=True)
    mirror = sub.add_parser("raw-mirror", help="copy TOPIC on A to TARGET on B until SIGTERM")
    mirror.add_argument("bootstrap_a")
    mirror.add_argument("bootstrap_b")
    mirror.add_argument("topic")
    mirror.add_argument("target")
    args = parser.parse_args(argv)
    return run_raw_mirror(args.bootstrap_a, args.bootstrap_b, args.topic, args.target)


if __name__ == "__main__":
    sys.exit(main())
