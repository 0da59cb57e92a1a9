"""Queue health: how fast events enter and leave each queue, and how long they wait, minute by minute.

For each gateway sender and async event queue of a site (or those named),
from two topics read whole (or from ``--since``) through Spark's Kafka source:

* the queue topic: every ``QueuedEvent`` (its partition, offset and
  ``enqueued_at``);
* the queue's removals topic: every ``RemovalRecord`` (partition,
  ``last_removed_offset``, ``removed_at``), DESIGN §1's record of the
  acknowledged head.

Step by step:

1. each event is matched to the first removal that covers it: the earliest
   ``removed_at`` among the partition's removal records whose
   ``last_removed_offset`` is at or past the event's offset (one pass over
   the partition sorted by offset, newest first, keeping the running
   minimum).  No such record: the event is still pending;
2. its wait is ``removed_at - enqueued_at``;
3. per queue, partition and minute (UTC): events enqueued that minute,
   events removed that minute, the backlog at the minute's end (of the
   events read), and the wait of the events enqueued that minute (p50, p90,
   p99, max; the pending ones are counted apart).

Written: the per-minute table as Parquet (``--output DIR``:
``DIR/queue_health``), a PNG chart (``DIR/queue_health.png``: per queue,
events per minute in and out with the backlog, and the waits), and a summary
printed per queue and partition plus the last minutes of each queue.

The removals topic is compacted: once a segment rolls (``segment.ms``, an
hour) only the last removal record of each partition survives in it.  An
event whose covering removal was compacted away is matched to a later one,
so its wait reads longer than it was; run the report over the last hour
(``--since 1h``), or regularly, for exact waits.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from sluice.core.config import SiteConfig
from sluice.core.errors import InvalidRequest
from sluice.pipelines.jobcli import (
    EXIT_OK,
    EXIT_STATUS_HELP,
    Progress,
    add_spark_options,
    console,
    load_site,
    require_topics,
    run_job,
    standalone_main,
)
from sluice.pipelines.records import decode
from sluice.pipelines.session import parse_conf, read_topics, spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

__all__ = ["QueueHealth", "add_arguments", "main", "parse_since", "queue_health", "run", "write_chart"]

#: Minutes of each queue printed (``--show``), the latest.
SHOW_DEFAULT = 15
PERCENTILES = (0.5, 0.9, 0.99)

EXAMPLE = """\
examples:
  sluice pipeline queue-health -c deploy/sites/site-a.yaml --output /data/health
  sluice pipeline queue-health -c deploy/sites/site-a.yaml --queue orders-to-site-b --since 2h --output health
  sluice pipeline queue-health -c site-a.yaml --since 2026-11-22T10:00:00Z --output health --show 60

  Writes health/queue_health (Parquet: queue, partition, minute, enqueued,
  removed, backlog, pending, wait_p50_ms, wait_p90_ms, wait_p99_ms,
  wait_max_ms) and health/queue_health.png, and prints a summary.

""" + EXIT_STATUS_HELP

DESCRIPTION = ("Per queue and partition, from the queue topics and their removal records: events per minute "
               "enqueued and removed, the backlog, and how long events waited, as a table (Parquet and printed) "
               "and a PNG chart.")


# --- options ----------------------------------------------------------------------------------


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: dt.datetime | None = None) -> int:
    """``--since`` as epoch milliseconds: a duration back from ``now`` (``90s``, ``30m``, ``2h``, ``1d``)
    or an ISO time (``2026-11-22T10:00:00Z``; no zone means UTC)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    match = _DURATION.match(text.strip())
    if match:
        return int((now.timestamp() - float(match.group(1)) * _UNIT_S[match.group(2)]) * 1000)
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest("--since", text, "must be a duration (90s, 30m, 2h, 1d) or an ISO time "
                             "(2026-11-22T10:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


# --- the computation --------------------------------------------------------------------------


def _queue_ids(cfg: SiteConfig, queues: Sequence[str] | None) -> list[str]:
    attached = [q.id for q in cfg.all_attached_queues()]
    if not queues:
        if not attached:
            raise InvalidRequest("--queue", None, f"site {cfg.site} has no queue attached to a region")
        return attached
    for queue in queues:
        if queue not in attached:
            raise InvalidRequest("--queue", queue, f"no gateway sender or async event queue of site {cfg.site} "
                                 f"by that id is attached to a region (there are: {', '.join(attached) or 'none'})")
    return list(dict.fromkeys(queues))


def _topics(cfg: SiteConfig, queue_ids: list[str]) -> list[str]:
    return [t for q in queue_ids for t in (cfg.topics.queue(q), cfg.topics.removals(q))]


def queue_events(spark: SparkSession, cfg: SiteConfig, queue_ids: list[str],
                 since_ms: int | None = None) -> tuple[DataFrame, DataFrame]:
    """(one row per queued event read: ``queue``, ``partition``, ``offset``, ``enqueued_at``,
    ``removed_at`` (null: pending), ``wait_ms``; undecodable records per topic: ``topic``, ``records``)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    names = cfg.topics
    queue_of = {names.queue(q): q for q in queue_ids}
    removals_of = {names.removals(q): q for q in queue_ids}
    queued = decode(read_topics(spark, cfg.kafka, list(queue_of), stream=False, starting_timestamp_ms=since_ms),
                    "value", "QueuedEvent", record="queued")
    removals = decode(read_topics(spark, cfg.kafka, list(removals_of), stream=False,
                                  starting_timestamp_ms=since_ms),
                      "value", "RemovalRecord", record="removal")
    corrupt = (queued.select("topic", "corrupt").unionByName(removals.select("topic", "corrupt"))
               .where(F.col("corrupt").isNotNull()).groupBy("topic").agg(F.count(F.lit(1)).alias("records")))
    queue_map = F.create_map(*[F.lit(x) for item in queue_of.items() for x in item])
    events = queued.where(F.col("corrupt").isNull()).select(
        queue_map[F.col("topic")].alias("queue"), "partition", "offset",
        F.col("queued.enqueued_at").alias("at"), F.lit(0).alias("kind"))
    removal = F.col("removal")
    heads = removals.where(F.col("corrupt").isNull() & (removal["last_removed_offset"] >= 0)).select(
        removal["queue_id"].alias("queue"), removal["queue_partition"].alias("partition"),
        removal["last_removed_offset"].alias("offset"), removal["removed_at"].alias("at"), F.lit(1).alias("kind"))
    # Newest first, a removal ahead of the event at its own offset: the running minimum of the
    # removal times seen so far is the earliest removal at or past each event.
    newest_first = (Window.partitionBy("queue", "partition").orderBy(F.col("offset").desc(), F.col("kind").desc())
                    .rowsBetween(Window.unboundedPreceding, Window.currentRow))
    covered = (events.unionByName(heads)
               .withColumn("removed_at", F.min(F.when(F.col("kind") == 1, F.col("at"))).over(newest_first))
               .where(F.col("kind") == 0)
               .select("queue", "partition", "offset", F.col("at").alias("enqueued_at"), "removed_at"))
    return (covered.withColumn("wait_ms", F.unix_millis("removed_at") - F.unix_millis("enqueued_at")), corrupt)


def per_minute(events: DataFrame, by: Sequence[str]) -> DataFrame:
    """Per ``by`` (e.g. queue, partition) and minute: enqueued, removed, backlog, pending and the waits."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    keys = [*by, "minute"]
    wait = F.col("wait_ms")
    entered = (events.groupBy(*by, F.date_trunc("minute", "enqueued_at").alias("minute"))
               .agg(F.count(F.lit(1)).alias("enqueued"), F.count_if(F.col("removed_at").isNull()).alias("pending"),
                    F.percentile_approx(wait, list(PERCENTILES)).alias("waits"), F.max(wait).alias("wait_max_ms")))
    left = (events.where(F.col("removed_at").isNotNull())
            .groupBy(*by, F.date_trunc("minute", "removed_at").alias("minute"))
            .agg(F.count(F.lit(1)).alias("removed")))
    table = entered.join(left, keys, "full_outer").fillna(0, subset=["enqueued", "removed", "pending"])
    running = Window.partitionBy(*by).orderBy("minute").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    waits = [F.col("waits")[i].alias(f"wait_p{round(p * 100)}_ms") for i, p in enumerate(PERCENTILES)]
    return table.select(
        *keys, "enqueued", "removed",
        (F.sum("enqueued").over(running) - F.sum("removed").over(running)).alias("backlog"),
        "pending", *waits, "wait_max_ms",
    )


@dataclass
class QueueHealth:
    """What ``queue_health`` computed; the frames are cached until ``release()``."""

    site: str
    queues: list[str]
    #: Per queue, partition and minute (the Parquet table).
    table: DataFrame
    #: Per queue and minute, all partitions together (the chart, the printed minutes).
    totals: list[Row]
    #: Per queue and partition over the whole window.
    partitions: list[Row]
    #: (topic, undecodable records).
    corrupt: list[tuple[str, int]]
    _cached: list[DataFrame]

    def release(self) -> None:
        for frame in self._cached:
            frame.unpersist()


def queue_health(spark: SparkSession, cfg: SiteConfig, queues: Sequence[str] | None = None,
                 since_ms: int | None = None) -> QueueHealth:
    """Compute the report (see the module docstring); ``InvalidRequest`` names an unknown queue."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    queue_ids = _queue_ids(cfg, queues)
    require_topics(cfg, _topics(cfg, queue_ids))
    events, corrupt = queue_events(spark, cfg, queue_ids, since_ms)
    # Read the topics once for the three aggregations below.
    events = events.persist(StorageLevel.MEMORY_AND_DISK)
    table = per_minute(events, ["queue", "partition"]).persist(StorageLevel.MEMORY_AND_DISK)
    totals = per_minute(events, ["queue"]).orderBy("queue", "minute").collect()
    wait = F.col("wait_ms")
    partitions = (events.groupBy("queue", "partition")
                  .agg(F.count(F.lit(1)).alias("enqueued"),
                       F.count_if(F.col("removed_at").isNotNull()).alias("removed"),
                       F.count_if(F.col("removed_at").isNull()).alias("pending"),
                       F.min("enqueued_at").alias("first"), F.max("enqueued_at").alias("last"),
                       F.percentile_approx(wait, [0.5, 0.99]).alias("waits"), F.max(wait).alias("wait_max_ms"))
                  .orderBy("queue", "partition").collect())
    bad = [(row["topic"], int(row["records"])) for row in corrupt.collect()]
    return QueueHealth(cfg.site, queue_ids, table, totals, partitions, bad, [events, table])


# --- the chart ----------------------------------------------------------------------------------


def write_chart(health: QueueHealth, path: Path) -> None:
    """One row per queue: events per minute in and out with the backlog (left), the waits (right)."""
    from matplotlib.dates import DateFormatter
    from matplotlib.figure import Figure

    queues = health.queues
    figure = Figure(figsize=(13, 3.6 * len(queues)), layout="constrained")
    axes = figure.subplots(len(queues), 2, squeeze=False)
    for row, queue in enumerate(queues):
        points = [r for r in health.totals if r["queue"] == queue]
        flow, waits = axes[row][0], axes[row][1]
        flow.set_title(f"{queue}: events per minute (site {health.site})", loc="left", fontsize=10)
        waits.set_title(f"{queue}: wait from enqueue to removal, by minute enqueued", loc="left", fontsize=10)
        if not points:
            for ax in (flow, waits):
                ax.text(0.5, 0.5, "no events in the window", ha="center", va="center", transform=ax.transAxes)
            continue
        waits.sharex(flow)  # the same minutes on both sides, however few have waits
        minutes = [r["minute"] for r in points]
        flow.plot(minutes, [r["enqueued"] for r in points], marker=".", label="enqueued")
        flow.plot(minutes, [r["removed"] for r in points], marker=".", label="removed")
        backlog = flow.twinx()
        backlog.fill_between(minutes, [r["backlog"] for r in points], step="post", alpha=0.15, color="grey",
                             label="backlog")
        backlog.set_ylabel("backlog (events)")
        flow.set_ylabel("events / minute")
        lines, labels = flow.get_legend_handles_labels()
        more, more_labels = backlog.get_legend_handles_labels()
        flow.legend(lines + more, labels + more_labels, loc="upper left", fontsize=8)
        for name, style in (("wait_p50_ms", "-"), ("wait_p90_ms", "--"), ("wait_p99_ms", ":"), ("wait_max_ms", "-.")):
            seconds = [None if r[name] is None else r[name] / 1000 for r in points]
            waits.plot(minutes, seconds, linestyle=style, marker=".", label=name.removeprefix("wait_")
                       .removesuffix("_ms"))
        waits.set_ylabel("seconds")
        waits.legend(loc="upper left", fontsize=8)
        for ax in (flow, waits):
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_formatter(DateFormatter("%m-%d %H:%M"))  # type: ignore[no-untyped-call]
            ax.set_xlabel("minute (UTC)", fontsize=8)
            ax.tick_params(axis="x", labelsize=8, labelrotation=30)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


# --- the command --------------------------------------------------------------------------------


def print_summary(health: QueueHealth, console: Console, show: int) -> None:
    table = Table(title=f"queue health of site {health.site}, per partition", title_justify="left")
    for column in ("queue", "partition", "first enqueued", "last enqueued", "enqueued", "removed", "pending",
                   "wait p50", "wait p99", "wait max"):
        table.add_column(column, justify="left" if column == "queue" else "right")
    for r in health.partitions:
        waits = r["waits"] or [None, None]
        table.add_row(r["queue"], str(r["partition"]), f"{r['first']:%Y-%m-%d %H:%M:%S}",
                      f"{r['last']:%Y-%m-%d %H:%M:%S}", f"{r['enqueued']:,}", f"{r['removed']:,}", f"{r['pending']:,}",
                      _seconds(waits[0]), _seconds(waits[1]), _seconds(r["wait_max_ms"]))
    console.print(table)
    for queue in health.queues:
        points = [r for r in health.totals if r["queue"] == queue]
        if not points:
            console.print(f"{queue}: no events in the window")
            continue
        minutes = Table(title=f"{queue}: the last {min(show, len(points))} of {len(points)} minutes, all partitions",
                        title_justify="left")
        for column in ("minute (UTC)", "enqueued", "removed", "backlog", "pending", "wait p50", "wait p90",
                       "wait p99", "wait max"):
            minutes.add_column(column, justify="right")
        for r in points[-show:] if show else []:
            minutes.add_row(f"{r['minute']:%Y-%m-%d %H:%M}", f"{r['enqueued']:,}", f"{r['removed']:,}",
                            f"{r['backlog']:,}", f"{r['pending']:,}", _seconds(r["wait_p50_ms"]),
                            _seconds(r["wait_p90_ms"]), _seconds(r["wait_p99_ms"]), _seconds(r["wait_max_ms"]))
        if show:
            console.print(minutes)
    for topic, count in health.corrupt:
        console.print(f"{topic}: {count:,} records could not be decoded and were left out")


def _seconds(ms: Any) -> str:
    return "–" if ms is None else f"{ms / 1000:,.3f}s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="the site file (YAML or TOML)")
    parser.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    parser.add_argument("--queue", action="append", metavar="ID",
                        help="only this gateway sender or async event queue (repeatable; default all attached)")
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="write DIR/queue_health (Parquet) and DIR/queue_health.png")
    parser.add_argument("--chart", metavar="FILE", help="the PNG chart's file (default DIR/queue_health.png; "
                        "required when DIR is a URI such as s3a://…)")
    parser.add_argument("--since", metavar="WHEN",
                        help="only records from then on: 90s, 30m, 2h, 1d back, or an ISO time (default all)")
    parser.add_argument("--show", type=int, default=SHOW_DEFAULT, metavar="N",
                        help=f"print the last N minutes of each queue (default {SHOW_DEFAULT})")
    add_spark_options(parser)


def _run(args: argparse.Namespace) -> int:
    if args.show < 0:
        raise InvalidRequest("--show", args.show, "must be 0 or more")
    since_ms = parse_since(args.since) if args.since else None
    if args.chart:
        chart = Path(args.chart)
    elif "://" in args.output:
        raise InvalidRequest("--chart", None, f"give a local file for the chart: --output {args.output} is a URI")
    else:
        chart = Path(args.output) / "queue_health.png"
    say = Progress("queue-health")
    cfg = load_site(args.config, args.bootstrap)
    queue_ids = _queue_ids(cfg, args.queue)
    require_topics(cfg, _topics(cfg, queue_ids))  # bad input is answered before Spark starts
    say("starting Spark")
    session = spark_session(f"sluice-queue-health-{cfg.site}", args.master, parse_conf(args.conf))
    try:
        since = "" if since_ms is None else \
            f" since {dt.datetime.fromtimestamp(since_ms / 1000, dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
        say(f"reading {', '.join(queue_ids)}: queue topics and removal records{since}")
        health = queue_health(session.spark, cfg, queue_ids, since_ms)
        try:
            table_path = args.output.rstrip("/") + "/queue_health"
            say(f"writing {table_path}")
            health.table.orderBy("queue", "partition", "minute").coalesce(1).write.mode("overwrite").parquet(table_path)
            write_chart(health, chart)
            say(f"chart written to {chart}")
            print_summary(health, console(), args.show)
        finally:
            health.release()
    finally:
        session.stop()
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """``sluice pipeline queue-health``; the exit status."""
    return run_job("queue-health", args, _run)


def main(argv: list[str] | None = None) -> int:
    """``spark-submit pipelines/queue_health.py …`` (or ``python -m sluice.pipelines.queue_health``)."""
    return standalone_main("queue_health.py", DESCRIPTION, EXAMPLE, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
