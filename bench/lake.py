"""Lake benchmark: the event lake's ingest on a local Spark with 2 cores, against a raw consumer.

``lake.ingest``
    1. Build the changelog before any clock starts: 1,000,000 ``EntryEvent``
       records (quick: 20,000), one per key, 200-byte JSON values, encoded
       as the region service encodes them (``sluice.core.eventwire``), and
       produce them with the raw producer of ``bench.region`` into the
       changelog of region ``orders`` (8 buckets), each in its bucket's
       partition.
    2. Baseline: one confluent-kafka consumer (``bench.subscriptions.raw_read``)
       reads the changelog from its beginning to its end, after a warm-up
       pass; the median of the timed passes is reported.
    3. Figure: a ``local[2]`` Spark session is started (not timed; its start
       and the packages' resolution are noted) and warmed up by a lake run
       over another site's changelog of 50,000 records, as the raw consumer
       gets a warm-up pass (not under ``--quick``, which must fit the CI
       smoke test's time: its figure includes the JVM's first-run costs).  Then the lake's two queries
       run with ``--available-now`` (``sluice.pipelines.lake.start_lake``):
       the events query reads the changelog, decodes every record with
       ``from_avro`` and writes Parquet partitioned by region and date,
       committing through its checkpoint; the dead-letter query finds its
       topics empty.  Timed from ``start_lake`` until both queries have
       stopped, so query planning and the commit are in the figure.
    4. Check: the lake's events dataset (read through its metadata log) holds
       exactly one row per changelog record (count and distinct positions),
       none corrupt.

The figure is rows/s; the baseline records/s; the ratio is the share of a
hand-written consumer's read rate the lake keeps while decoding and writing
Parquet.  The notes give the steady rate of the micro-batch itself (Spark's
own ``processedRowsPerSecond``) and the CPU each process used.
"""

from __future__ import annotations

import shutil
import statistics
import time
from typing import Any

import orjson

from sluice.core.eventwire import entry_event_body
from sluice.core.codec import MARKER, get_codec
from sluice.core.config import SiteConfig
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import partition_for_key

from .harness import Context, Result, benchmark
from .region import RawProducer, make_key, make_value
from .site import write_site
from .subscriptions import raw_read

REGION = "orders"
BUCKETS = 8
#: Timed passes of the raw consumer (after a warm-up pass); the median is reported.
RAW_PASSES = 3
RAW_CONSUMER = "raw.consumer"
#: Records of the lake's warm-up run (another site), before the timed one (none under --quick).
WARM_EVENTS = 50_000
#: Spark as the benchmark runs it: 2 cores (the machines have 2), no UI, room for one big micro-batch.
SPARK_MASTER = "local[2]"
SPARK_CONF = {"spark.ui.enabled": "false", "spark.driver.memory": "2g"}


def write_changelog(ctx: Context, name: str,
                    records: list[tuple[bytes, bytes, int]]) -> tuple[SiteConfig, dict[int, int]]:
    """A site (file ``name``.yaml, fresh topics) whose changelog holds ``records``; its end offset per partition."""
    cfg = write_site(ctx.workdir / f"{name}.yaml", bootstrap=ctx.bootstrap, prefix=ctx.topic_prefix(), region=REGION,
                     buckets=BUCKETS, parallel_senders=1)
    producer = RawProducer(ctx.bootstrap, cfg.topics.region_changelog(REGION))
    try:
        with ctx.counting(f"writing the {name} changelog", len(records)) as advance:
            producer.write_all(records, advance)
    finally:
        producer.close()
    ends: dict[int, int] = {}
    for _, _, partition in records:
        ends[partition] = ends.get(partition, 0) + 1
    return cfg, ends


def changelog_records(count: int, now_ms: int) -> list[tuple[bytes, bytes, int]]:
    """(key, EntryEvent record, partition) of ``count`` puts of distinct keys, as the region service writes them."""
    header = MARKER + get_codec().fingerprint("EntryEvent")
    out = []
    for seq in range(count):
        key = make_key("order", seq)
        key_bytes = key.encode()
        bucket = partition_for_key(key_bytes, BUCKETS)
        event = EntryEvent(region=REGION, key=key, operation=Operation.PUTALL_CREATE,
                           value=orjson.dumps(make_value(seq)), event_id=EventID("bench-writer", 1, seq),
                           version=VersionTag(1, now_ms, 1, "bench-0"), origin_dsid=1, bucket=bucket,
                           event_time=now_ms + seq)
        out.append((key_bytes, header + entry_event_body(event), bucket))
    return out


@benchmark("lake.ingest", "event lake ingest on local[2] Spark, rows/s vs a raw consumer")
def lake_ingest(ctx: Context) -> list[Result]:
    from sluice.pipelines.lake import start_lake, wait_lake
    from sluice.pipelines.session import spark_session

    events = ctx.sized(1_000_000, 20_000)
    warm_events = ctx.sized(WARM_EVENTS, 0)
    ctx.step(f"building {events:,} changelog records" + (f" (and {warm_events:,} for the warm-up site)"
                                                          if warm_events else ""))
    warm_cfg = write_changelog(ctx, "warm", changelog_records(warm_events, int(time.time() * 1000)))[0] \
        if warm_events else None
    cfg, ends = write_changelog(ctx, "site", changelog_records(events, int(time.time() * 1000)))
    topic = cfg.topics.region_changelog(REGION)

    passes = RAW_PASSES
    ctx.step(f"raw consumer: a warm-up pass, then {passes} timed passes of {events:,} records")
    raw_read(ctx.bootstrap, topic, ends)
    rates = []
    with ctx.cpu_use("raw consumer", {}):
        for _ in range(passes):
            rates.append(events / raw_read(ctx.bootstrap, topic, ends))
    raw_rate = statistics.median(rates)
    ctx.step(f"raw consumer: {raw_rate:,.0f} records/s (median of {', '.join(f'{r:,.0f}' for r in rates)})")

    ctx.step(f"starting Spark ({SPARK_MASTER}; the Kafka and Avro packages come from the Ivy cache or Maven Central)")
    t0 = time.monotonic()
    session = spark_session("bench-lake", SPARK_MASTER, SPARK_CONF)
    try:
        spark = session.spark
        ctx.note(f"Spark {spark.version} session started in {time.monotonic() - t0:.1f}s (not in the figure)")
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        jvm_pid = int(jvm.java.lang.ProcessHandle.current().pid())
        # A first lake run loads and compiles what every run needs (the Kafka client, Avro, Parquet,
        # Spark's generated code: ~10 s on the 2-core machines), as the raw consumer gets a warm-up
        # pass; a lake that runs for days pays that once.  Not under --quick, whose whole run must fit
        # the CI smoke test's budget: its figure includes those first-run costs.
        if warm_cfg is not None:
            ctx.step(f"lake warm-up: {warm_events:,} records of another site")
            wait_lake(start_lake(spark, warm_cfg, str(ctx.workdir / "warm-lake"), available_now=True), ctx.step)
        else:
            ctx.note("quick: no warm-up run, the figure includes the JVM's first-run costs")
        lake = ctx.workdir / "lake"
        shutil.rmtree(lake, ignore_errors=True)
        ctx.step(f"lake: {events:,} changelog records into {lake}")
        with ctx.cpu_use("lake", {"spark": jvm_pid}) as cpu:
            started = time.perf_counter()
            run = start_lake(spark, cfg, str(lake), available_now=True)
            wait_lake(run, ctx.step)
            lake_s = time.perf_counter() - started
        lake_rate = events / lake_s
        steady = [p.processedRowsPerSecond for p in run.queries["events"].recentProgress if p.numInputRows]
        ctx.note(f"lake: {lake_rate:,.0f} rows/s from query start to the last commit ({lake_s:.1f}s); "
                 f"the micro-batches alone: {', '.join(f'{r:,.0f}' for r in steady)} rows/s")
        verify(spark, lake, events)
        ctx.step(f"verified: the lake holds {events:,} rows, one per changelog record, none corrupt")
    finally:
        session.stop()
    return [Result("lake.ingest", lake_rate, "rows/s", RAW_CONSUMER, raw_rate),
            *ctx.cpu_per_event("lake.ingest", cpu.seconds(), events, processes=("spark", "broker"), what="per row")]


def verify(spark: Any, lake: Any, events: int) -> None:
    """The events dataset has exactly one decoded row per changelog record."""
    from pyspark.sql import functions as F

    row = (spark.read.parquet(str(lake / "events"))
           .agg(F.count(F.lit(1)).alias("rows"), F.count_distinct("partition", "offset").alias("positions"),
                F.count_if(F.col("corrupt").isNotNull()).alias("corrupt"))
           .collect()[0])
    if (row["rows"], row["positions"], row["corrupt"]) != (events, events, 0):
        raise RuntimeError(f"the lake holds {row['rows']:,} rows at {row['positions']:,} positions, "
                           f"{row['corrupt']:,} corrupt; expected {events:,} decoded rows")
