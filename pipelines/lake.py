"""The event lake: every record of a site's region changelogs and dead-letter topics, in Parquet, exactly once.

``sluice pipeline lake -c SITE --lake DIR`` runs two Structured Streaming
queries over the site's topics (names from ``cfg.topics``), each with a
checkpoint of its own:

* ``events``: the region changelogs → ``DIR/events``, one row per changelog
  record: the entry event in typed columns (``key``, ``operation``,
  ``value``, ``event_id``, ``version``, ``origin_dsid``, ``event_time``…)
  and where it was read (``topic``, ``partition``, ``offset``,
  ``kafka_timestamp``);
* ``dead_letters``: the dead-letter topics (every attached queue's and the
  region service's) → ``DIR/dead_letters``, one row per dead letter (the
  ``DeadLetter`` fields, the queue it belongs to, the decoded event when
  there is one).

Both datasets are partitioned by ``region`` and ``date`` (the UTC date of the
event time; of the failure time for a dead letter).  A record that cannot be
decoded is a row as well: its reason in ``corrupt``, its bytes in ``raw``, the
region of the topic it came from (when the topic says), the date of its Kafka
timestamp, and nulls elsewhere.  Nothing is dropped; ``corrupt IS NULL``
selects the decoded rows.

Exactly once, step by step (Spark's file sink and Kafka source, per query):

1. before micro-batch N reads anything, its Kafka offset ranges are written
   to ``CHECKPOINT/<query>/offsets/N``;
2. the batch's rows are written as new Parquet files under their
   ``region=…/date=…`` directories;
3. the names of those files are committed to the dataset's log,
   ``DIR/<dataset>/_spark_metadata/N``; then the batch is marked done
   (``CHECKPOINT/<query>/commits/N``).

A job killed before step 3 leaves files no log entry names: readers that go
through the log (Spark reading the dataset's directory) never see them, and
the restarted job reads batch N again from the same offsets.  Killed after
step 3, the restarted job finds N in the sink's log and does not write it
again.  So every Kafka record is in exactly one committed file.  Read the
lake with Spark, at the dataset's top directory (``spark.read.parquet(DIR +
"/events")``, then filter by region or date); a tool that lists the files
itself (or Spark pointed at a ``region=`` directory) bypasses the log and may
see the leftovers of a killed batch.

Progress: a line per micro-batch on stderr (rows, rows/s, records still
behind the topics' ends).  ``--available-now`` reads what the topics hold,
then stops (a catch-up run from cron); without it the job runs until SIGTERM
or Ctrl-C, which stop the queries (an unfinished batch is redone next time).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.core.config import SiteConfig
from sluice.core.errors import InvalidRequest
from sluice.core.kafka import translate
from sluice.pipelines.errors import PipelineError
from sluice.pipelines.jobcli import (
    EXIT_OK,
    EXIT_STATUS_HELP,
    Progress,
    add_spark_options,
    load_site,
    require_topics,
    run_job,
    standalone_main,
)
from sluice.pipelines.records import decode
from sluice.pipelines.session import packages_hint, parse_conf, read_topics, spark_session

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = ["LakePlan", "LakeRun", "add_arguments", "dead_letters_frame", "events_frame", "main", "run",
           "start_lake"]

#: Default bound on the records one micro-batch reads from all its topics together.
MAX_OFFSETS_PER_TRIGGER = 1_000_000
#: Default time between micro-batches when the job runs on (not ``--available-now``).
TRIGGER_S = 10.0
#: How often the driver looks at the queries' progress.
POLL_S = 0.25

EXAMPLE = """\
examples:
  sluice pipeline lake -c deploy/sites/site-a.yaml --lake /data/lake              # runs until Ctrl-C
  sluice pipeline lake -c deploy/sites/site-a.yaml --lake /data/lake --available-now
  sluice pipeline lake -c site-a.yaml --lake s3a://bucket/lake --master spark://host:7077
  spark-submit --packages PACKAGES pipelines/lake.py -c site-a.yaml --lake /data/lake

  (PACKAGES: {packages})

Then, in Spark:  spark.read.parquet("/data/lake/events").where("region = 'orders' AND corrupt IS NULL")

""".format(packages=packages_hint()) + EXIT_STATUS_HELP


# --- what the lake reads ------------------------------------------------------------------------


@dataclass(frozen=True)
class LakePlan:
    """The topics the lake of one site reads, and what each says about its records' region or queue."""

    site: str
    #: Changelog topic → its region.
    changelogs: dict[str, str]
    #: Dead-letter topic → the queue it belongs to (None: the region service's).
    dead_letters: dict[str, str | None]

    @classmethod
    def from_config(cls, cfg: SiteConfig, regions: Sequence[str] | None = None) -> LakePlan:
        """Every region of ``cfg`` (or those named), and the dead-letter topics of their queues.

        ``InvalidRequest`` names a region the site file does not have.
        """
        names = cfg.topics
        chosen = list(regions) if regions else [r.name for r in cfg.regions]
        for region in chosen:
            if region not in {r.name for r in cfg.regions}:
                raise InvalidRequest("--region", region, f"no such region in site {cfg.site}'s file "
                                     f"(it has {', '.join(r.name for r in cfg.regions)})")
        queues = {q.id: q for region in chosen for q in cfg.attached_queues(region)}
        dead_letters: dict[str, str | None] = {names.dead_letter(queue_id): queue_id for queue_id in queues}
        dead_letters[names.region_dead_letter()] = None
        return cls(site=cfg.site, changelogs={names.region_changelog(r): r for r in chosen},
                   dead_letters=dead_letters)

    @property
    def topics(self) -> list[str]:
        return [*self.changelogs, *self.dead_letters]


def _lookup(mapping: dict[str, Any], key: Column) -> Column:
    """``mapping[key]`` as a column (null for a key not in it)."""
    from pyspark.sql import functions as F

    pairs = [F.lit(x) for item in mapping.items() for x in item]
    return F.create_map(*pairs)[key] if pairs else F.lit(None)


def _kafka_columns() -> list[Column]:
    from pyspark.sql import functions as F

    return [F.col("topic"), F.col("partition"), F.col("offset"), F.col("timestamp").alias("kafka_timestamp")]


#: The EntryEvent fields, in schema order, as lake columns (``region`` is a partition column).
EVENT_FIELDS = ("key", "operation", "value", "value_encoding", "callback_argument", "possible_duplicate",
                "event_id", "version", "origin_dsid", "visited_dsids", "bucket", "event_time", "transaction")


def events_frame(records: DataFrame, plan: LakePlan) -> DataFrame:
    """Changelog records (Spark's Kafka columns) as lake rows: see the module docstring."""
    from pyspark.sql import functions as F

    decoded = decode(records, "value", "EntryEvent", record="event")
    event = F.col("event")
    corrupt = F.col("corrupt")
    columns = [F.coalesce(event["region"], _lookup(plan.changelogs, F.col("topic"))).alias("region")]
    for name in EVENT_FIELDS:
        column = event[name]
        if name == "key":
            # A corrupt record keeps the changelog record's key (the entry key, as the region service keys it).
            column = F.coalesce(column, F.col("key").cast("string"))
        columns.append(column.alias(name))
    columns += _kafka_columns()
    columns += [
        corrupt,
        F.when(corrupt.isNotNull(), F.col("value")).alias("raw"),
        F.to_date(F.coalesce(event["event_time"], F.col("timestamp"))).alias("date"),
    ]
    return decoded.select(*columns)


#: The DeadLetter fields, in schema order, as lake columns.
DEAD_LETTER_FIELDS = ("source_topic", "source_partition", "source_offset", "key", "value", "reason", "error_class",
                      "event", "service", "failed_at")


def dead_letters_frame(records: DataFrame, plan: LakePlan) -> DataFrame:
    """Dead-letter records (Spark's Kafka columns) as lake rows: see the module docstring."""
    from pyspark.sql import functions as F

    decoded = decode(records, "value", "DeadLetter", record="letter")
    letter = F.col("letter")
    corrupt = F.col("corrupt")
    # The region: the event's when it was decoded, else the changelog's the letter came from, else unknown.
    region = F.coalesce(letter["event"]["region"], _lookup(plan.changelogs, letter["source_topic"]))
    columns = [region.alias("region"), _lookup(plan.dead_letters, F.col("topic")).alias("queue")]
    columns += [letter[name].alias(name) for name in DEAD_LETTER_FIELDS]
    columns += _kafka_columns()
    columns += [
        corrupt,
        F.when(corrupt.isNotNull(), F.col("value")).alias("raw"),
        F.to_date(F.coalesce(letter["failed_at"], F.col("timestamp"))).alias("date"),
    ]
    return decoded.select(*columns)


# --- running it ---------------------------------------------------------------------------------


def _join(root: str, *parts: str) -> str:
    """A path under ``root``, which may be a URI (s3a://…, hdfs://…) or a local directory."""
    return "/".join([root.rstrip("/"), *parts])


def _absolute(location: str) -> str:
    """A local path made absolute (Spark would take a relative one from its working directory); URIs as given."""
    if "://" in location or location.startswith("file:"):
        return location
    from pathlib import Path

    return str(Path(location).expanduser().resolve())


@dataclass
class LakeRun:
    """The two running queries of a lake, and what has been reported of them."""

    queries: dict[str, StreamingQuery]
    #: Per query, with ``--available-now``: each partition's end when the run started, the end it reads
    #: to.  (The Kafka source then reports the batch's own end as the latest offset.)
    targets: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    #: Per query: the last batch id reported, and the rows written so far (this run).
    reported: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def report(self, say: Callable[[str], None]) -> None:
        """One line per micro-batch finished since the last call."""
        from py4j.protocol import Py4JJavaError

        for name, query in self.queries.items():
            try:
                recent = query.recentProgress
            except Py4JJavaError:
                # PySpark walks the JVM's progress buffer while the query appends to it, which can
                # fail (NoSuchElementException); the next call reports what this one missed.
                continue
            for progress in recent:
                batch = progress.batchId
                if batch <= self.reported.get(name, -1) or progress.numInputRows == 0:
                    continue
                self.reported[name] = batch
                rows = int(progress.numInputRows)
                self.rows[name] = self.rows.get(name, 0) + rows
                behind = _records_behind(progress.sources, self.targets.get(name))
                say(f"{name} batch {batch}: {rows:,} rows ({progress.processedRowsPerSecond:,.0f} rows/s), "
                    f"{self.rows[name]:,} this run; {behind:,} records behind the topics' ends")

    def failure(self) -> PipelineError | None:
        """The first query that stopped with an error, as a ``PipelineError``."""
        for name, query in self.queries.items():
            if not query.isActive:
                error = query.exception()
                if error is not None:
                    return PipelineError(f"the lake's {name} query failed: {str(error).strip().splitlines()[0]}")
        return None

    @property
    def active(self) -> bool:
        return any(query.isActive for query in self.queries.values())

    def stop(self) -> None:
        """Stop every query (idempotent); an unfinished micro-batch is redone by the next run."""
        for query in self.queries.values():
            if query.isActive:
                query.stop()


def _records_behind(sources: Sequence[Any], target: dict[str, dict[str, int]] | None = None) -> int:
    """Offsets between where the batch ended and each partition's latest (or ``target``) offset."""
    behind = 0
    for source in sources:
        try:
            end = json.loads(source.endOffset or "{}")
            latest = target or json.loads(source.latestOffset or "{}")
        except (TypeError, ValueError):
            continue
        for topic, partitions in latest.items():
            for partition, offset in partitions.items():
                behind += max(0, int(offset) - int(end.get(topic, {}).get(partition, offset)))
    return behind


def start_lake(
    spark: SparkSession,
    cfg: SiteConfig,
    lake: str,
    *,
    checkpoint: str | None = None,
    regions: Sequence[str] | None = None,
    available_now: bool = False,
    trigger_s: float = TRIGGER_S,
    max_offsets_per_trigger: int | None = MAX_OFFSETS_PER_TRIGGER,
) -> LakeRun:
    """Start the lake's two queries on ``spark``; see the module docstring.

    ``checkpoint`` defaults to ``LAKE/_checkpoints``.  A query restarted with
    the same checkpoint goes on after the last committed batch.  Raises
    ``TopicMissing`` for a topic the site's cluster lacks.
    """
    plan = LakePlan.from_config(cfg, regions)
    require_topics(cfg, plan.topics)
    lake = _absolute(lake)
    checkpoint = _absolute(checkpoint) if checkpoint else _join(lake, "_checkpoints")
    options = {} if max_offsets_per_trigger is None else {"maxOffsetsPerTrigger": str(max_offsets_per_trigger)}
    sources = {
        "events": (list(plan.changelogs), events_frame),
        "dead_letters": (list(plan.dead_letters), dead_letters_frame),
    }
    # Read before the queries start, as near as can be to the ends Spark pins for --available-now.
    targets = {name: end_offsets(cfg, topics) for name, (topics, _) in sources.items()} if available_now else {}
    queries: dict[str, StreamingQuery] = {}
    try:
        for name, (topics, frame) in sources.items():
            records = read_topics(spark, cfg.kafka, topics, stream=True, options=options)
            writer = (frame(records, plan).writeStream.format("parquet")
                      .queryName(f"sluice-lake-{plan.site}-{name}")
                      .option("path", _join(lake, name))
                      .option("checkpointLocation", _join(checkpoint, name))
                      .partitionBy("region", "date")
                      .outputMode("append"))
            writer = writer.trigger(availableNow=True) if available_now else \
                writer.trigger(processingTime=f"{trigger_s:g} seconds")
            queries[name] = writer.start()
    except BaseException:
        LakeRun(queries).stop()
        raise
    return LakeRun(queries, targets)


def end_offsets(cfg: SiteConfig, topics: list[str]) -> dict[str, dict[str, int]]:
    """Each partition's end offset, keyed as the Kafka source's progress keys them (topic → "partition" → offset)."""
    from sluice.core.kafka import KafkaException, TopicPartition, make_consumer

    consumer = make_consumer(cfg.kafka.client_settings(), None)
    try:
        metadata = consumer.list_topics(timeout=15)
        ends: dict[str, dict[str, int]] = {}
        for topic in topics:
            for partition in metadata.topics[topic].partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=15)
                ends.setdefault(topic, {})[str(partition)] = high
        return ends
    except KafkaException as exc:
        raise translate(exc, f"reading the end offsets of {', '.join(topics)}") from exc
    finally:
        consumer.close()


def wait_lake(run: LakeRun, say: Callable[[str], None], stopping: threading.Event | None = None) -> None:
    """Report progress until every query has finished (``--available-now``) or ``stopping`` is set.

    Raises ``PipelineError`` when a query fails; the other one is stopped first.
    """
    stopping = stopping or threading.Event()
    try:
        while run.active and not stopping.is_set():
            run.report(say)
            failure = run.failure()
            if failure is not None:
                raise failure
            stopping.wait(POLL_S)
        run.report(say)
        failure = run.failure()
        if failure is not None:
            raise failure
    finally:
        run.stop()


# --- the command --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="the site file (YAML or TOML)")
    parser.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    parser.add_argument("--lake", required=True, metavar="DIR",
                        help="where the lake's datasets go: DIR/events and DIR/dead_letters (a path or a URI)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="the queries' checkpoints (default DIR/_checkpoints); keep it with the lake")
    parser.add_argument("--region", action="append", metavar="NAME",
                        help="only this region's changelog and its queues' dead letters (repeatable; default all)")
    parser.add_argument("--available-now", action="store_true",
                        help="read what the topics hold now, in as many micro-batches as it takes, then stop")
    parser.add_argument("--trigger-s", type=float, default=TRIGGER_S, metavar="S",
                        help=f"seconds between micro-batches when running on (default {TRIGGER_S:g})")
    parser.add_argument("--max-offsets-per-trigger", type=int, default=MAX_OFFSETS_PER_TRIGGER, metavar="N",
                        help=f"at most N records per micro-batch and query (default {MAX_OFFSETS_PER_TRIGGER:,})")
    add_spark_options(parser)


def _check_arguments(args: argparse.Namespace) -> None:
    if args.trigger_s <= 0:
        raise InvalidRequest("--trigger-s", args.trigger_s, "must be more than 0 seconds")
    if args.max_offsets_per_trigger is not None and args.max_offsets_per_trigger < 1:
        raise InvalidRequest("--max-offsets-per-trigger", args.max_offsets_per_trigger, "must be at least 1")


def _run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    say = Progress("lake")
    cfg = load_site(args.config, args.bootstrap)
    # Bad input is answered before Spark takes its ten seconds to start.
    plan = LakePlan.from_config(cfg, args.region)
    require_topics(cfg, plan.topics)
    # Adaptive execution is for batch queries: Spark turns it off in streaming ones, with a warning each.
    conf = {"spark.sql.adaptive.enabled": "false", **parse_conf(args.conf)}
    say("starting Spark")
    session = spark_session(f"sluice-lake-{cfg.site}", args.master, conf)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        say(f"{signal.Signals(signum).name}: stopping the queries")
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        run = start_lake(session.spark, cfg, args.lake, checkpoint=args.checkpoint, regions=args.region,
                         available_now=args.available_now, trigger_s=args.trigger_s,
                         max_offsets_per_trigger=args.max_offsets_per_trigger)
        say(f"site {cfg.site}: events from {', '.join(plan.changelogs)} and dead letters from "
            f"{', '.join(plan.dead_letters)} into {_absolute(args.lake)}"
            + (" (what is there now, then stop)" if args.available_now else f" every {args.trigger_s:g} s"))
        wait_lake(run, say, stopping)
        total = ", ".join(f"{n} {run.rows.get(n, 0):,} rows" for n in run.queries)
        say(f"{'stopped' if stopping.is_set() else 'done'} after {say.elapsed_s:.1f}s: {total}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        session.stop()
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """``sluice pipeline lake``; the exit status."""
    return run_job("lake", args, _run)


DESCRIPTION = ("Keep a site's event lake: Structured Streaming from the region changelogs and the dead-letter "
               "topics into Parquet partitioned by region and date, exactly once through a checkpoint.")


def main(argv: list[str] | None = None) -> int:
    """``spark-submit pipelines/lake.py …`` (or ``python -m sluice.pipelines.lake``)."""
    return standalone_main("lake.py", DESCRIPTION, EXAMPLE, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
