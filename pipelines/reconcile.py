"""Cross-site reconciliation: do two sites hold the same entries, and who should win where they do not?

The operator's proof that WAN replication converged (DESIGN §2, data
pipeline).  For each region both site files declare, step by step:

1. read each site's changelog whole (a batch read through Spark's Kafka
   source) and rebuild its state as the region service does
   (``BucketState.replay``): the last record of each key, in changelog
   order, is the key's entry; a destroy or a region clear/destroy leaves a
   tombstone (the key is absent but its version still counts in a
   conflict).  Records that cannot be decoded are skipped, as the region
   service skips them, and counted;
2. join the two states on the key and classify every key present on either
   side:

   ``only_in_a`` / ``only_in_b``
       present on one site only (absent or destroyed on the other);
   ``value_differs``
       present on both, different values (or value encodings);
   ``version_differs``
       present on both with the same value, different version tags (a stale
       copy that happens to hold the same value);

3. for each divergent key, name the site whose write should win by Geode's
   WAN rule (``sluice.region.conflicts.remote_wins``): the same dsid wrote
   both → the higher entry version; else the later timestamp, ties to the
   higher dsid; a key only one site ever saw → that site.  When neither
   wins (same dsid and entry version, different entries) the winner is
   null: a person must look.  A site's pluggable conflict resolver is not
   consulted (it may also change values); the report says when one is
   configured.

The report (one row per divergent key, both sides' entries and the winner)
is written as Parquet; a summary per region is printed; the exit status is
1 when any region diverges, 0 when the sites agree.

``reconcile(spark, cfg_a, cfg_b)`` is the same as a function, for a program
(the demo's verification) that wants the result rather than the command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from sluice.core.config import SiteConfig
from sluice.core.errors import InvalidRequest
from sluice.core.events import DESTROYS, REGION_OPERATIONS
from sluice.pipelines.jobcli import (
    EXIT_DIVERGED,
    EXIT_OK,
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
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["KINDS", "Reconciliation", "RegionSummary", "add_arguments", "choose_regions", "main", "reconcile",
           "region_state", "run", "winner_side"]

#: What a divergent key can be, in the order the summary shows them.
KINDS = ("only_in_a", "only_in_b", "value_differs", "version_differs")
#: Operations after which the key is absent (its tombstone keeps the version): as ``BucketState.replay``.
ABSENT_AFTER = sorted(op.value for op in DESTROYS | REGION_OPERATIONS)
#: Divergent keys printed per region and kind (``--show``).
SHOW_DEFAULT = 10

EXAMPLE = """\
examples:
  sluice pipeline reconcile --site-a deploy/sites/site-a.yaml --site-b deploy/sites/site-b.yaml \\
      --output /data/reconciliation
  sluice pipeline reconcile --site-a a.yaml --site-b b.yaml --region orders --output recon --show 50

  Prints, per region, the keys on each site, how many agree, and each kind of
  divergence with the site whose write should win (Geode's rule: the same
  site wrote both → higher entry version; else the later timestamp, ties to
  the higher dsid), then up to --show keys of each kind.  The full report
  (one row per divergent key) is Parquet in --output:

    spark.read.parquet("/data/reconciliation").where("kind = 'value_differs'")

exit status: 0 the sites agree; 1 they diverge; 2 bad input (site files,
region names, missing topics); 3 the job failed (Spark, Java or Kafka trouble).
"""

DESCRIPTION = ("Compare two sites' regions, rebuilt from their changelogs: keys on one side only, keys with "
               "different values or version tags, and which site's write should win by the conflict rule.  "
               "Writes the report as Parquet, prints a summary, exits 1 on divergence.")


# --- one site's state ------------------------------------------------------------------------


def region_state(spark: SparkSession, cfg: SiteConfig, region: str) -> DataFrame:
    """One row per key the site's changelog of ``region`` ever held: its last record, as the region replays it.

    Columns: ``key``, ``present`` (false for a tombstone, or when only
    corrupt records were read), ``operation``, ``value``, ``value_encoding``,
    ``version``, ``event_id``, ``partition``, ``offset`` (of that last
    record) and ``corrupt_records`` (undecodable records of the key, skipped).
    """
    from pyspark.sql import functions as F

    records = read_topics(spark, cfg.kafka, [cfg.topics.region_changelog(region)], stream=False)
    decoded = decode(records, "value", "EntryEvent", record="event")
    event = F.col("event")
    good = F.col("corrupt").isNull()
    entry = F.struct(
        event["operation"].alias("operation"), event["value"].alias("value"),
        event["value_encoding"].alias("value_encoding"), event["version"].alias("version"),
        event["event_id"].alias("event_id"), F.col("partition"), F.col("offset"),
    )
    # A key's records are all in its bucket's partition, in the order the owner applied them;
    # max_by skips the rows whose ordering is null, the corrupt ones.
    order = F.when(good, F.struct(F.col("partition"), F.col("offset")))
    latest = (decoded
              .groupBy(F.coalesce(event["key"], F.col("key").cast("string")).alias("key"))
              .agg(F.max_by(entry, order).alias("last"), F.count_if(~good).alias("corrupt_records")))
    last = F.col("last")
    return latest.select(
        "key",
        (last.isNotNull() & ~last["operation"].isin(ABSENT_AFTER)).alias("present"),
        *[last[name].alias(name) for name in ("operation", "value", "value_encoding", "version", "event_id",
                                               "partition", "offset")],
        "corrupt_records",
    )


# --- the rule -------------------------------------------------------------------------------------


def winner_side(a: Column, b: Column) -> tuple[Column, Column]:
    """("a" | "b" | null, the rule's reason) for two version tags (either may be null: never seen there).

    The same decision as ``sluice.region.conflicts.remote_wins``, taken from
    both sides: "b" when b's write would win at a, "a" when a's would win at
    b, null when neither would (same dsid and entry version).
    """
    from pyspark.sql import functions as F

    same_dsid = a["dsid"] == b["dsid"]
    later = F.struct(b["timestamp"], b["dsid"]) > F.struct(a["timestamp"], a["dsid"])
    side = (F.when(a.isNull() & b.isNull(), F.lit(None))
            .when(a.isNull(), F.lit("b"))
            .when(b.isNull(), F.lit("a"))
            .when(same_dsid & (b["entry_version"] > a["entry_version"]), F.lit("b"))
            .when(same_dsid & (a["entry_version"] > b["entry_version"]), F.lit("a"))
            .when(same_dsid, F.lit(None))
            .when(later, F.lit("b"))
            .otherwise(F.lit("a")))
    rule = (F.when(a.isNull() | b.isNull(), F.lit("only one site has a record of the key"))
            .when(same_dsid & (a["entry_version"] != b["entry_version"]),
                  F.lit("same site wrote both: the higher entry version"))
            .when(same_dsid, F.lit("same site and entry version, different entries: undecidable"))
            .when(a["timestamp"] != b["timestamp"], F.lit("the later timestamp"))
            .otherwise(F.lit("same timestamp: the higher dsid")))
    return side, rule


# --- both sites ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionSummary:
    """The counts of one region."""

    region: str
    keys_a: int
    keys_b: int
    agree: int
    kinds: dict[str, int]
    winners: dict[str, int]
    corrupt_a: int
    corrupt_b: int
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def divergent(self) -> int:
        return sum(self.kinds.values())


@dataclass
class Reconciliation:
    """The result of ``reconcile``: the report (divergent keys) and a summary per region."""

    site_a: SiteConfig
    site_b: SiteConfig
    regions: list[str]
    #: Regions declared by one site file only: (region, the site that has it).
    unmatched: list[tuple[str, str]]
    #: One row per divergent key (columns in the module docstring); cached, ``release()`` frees it.
    report: DataFrame
    summaries: list[RegionSummary]
    _keys: DataFrame

    @property
    def diverged(self) -> bool:
        return any(s.divergent for s in self.summaries)

    def write(self, path: str) -> None:
        """The report as Parquet in ``path`` (replaced), sorted by region and key."""
        self.report.orderBy("region", "key").coalesce(1).write.mode("overwrite").parquet(path)

    def release(self) -> None:
        self._keys.unpersist()


def reconcile(spark: SparkSession, site_a: SiteConfig, site_b: SiteConfig, regions: Sequence[str] | None = None,
              *, show: int = SHOW_DEFAULT, say: Callable[[str], None] | None = None) -> Reconciliation:
    """Compare the regions both site files declare (or ``regions``); see the module docstring.

    ``InvalidRequest`` names a region one of the site files lacks;
    ``TopicMissing`` a changelog that does not exist.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    say = say or (lambda _text: None)
    chosen, unmatched = choose_regions(site_a, site_b, regions)

    frames = []
    for region in chosen:
        a = region_state(spark, site_a, region).alias("a")
        b = region_state(spark, site_b, region).alias("b")
        frames.append(_compare(a, b, region, site_a.site, site_b.site))
    keys = frames[0]
    for frame in frames[1:]:
        keys = keys.unionByName(frame)
    # Every key, classified: the summary counts it, the report keeps the divergent ones.  Cached so
    # the changelogs are read once for both (a few hundred bytes per key).
    keys = keys.persist(StorageLevel.MEMORY_AND_DISK)
    say(f"reading the changelogs of {', '.join(chosen)} at {site_a.site} and {site_b.site}, comparing key by key")
    counts = (keys.groupBy("region", "kind", "winner")
              .agg(F.count(F.lit(1)).alias("keys"), F.sum(F.col("a_present").cast("long")).alias("on_a"),
                   F.sum(F.col("b_present").cast("long")).alias("on_b"),
                   F.sum("a_corrupt_records").alias("corrupt_a"), F.sum("b_corrupt_records").alias("corrupt_b"))
              .collect())
    say(f"compared {sum(row['keys'] for row in counts):,} keys")
    report = keys.where(F.col("kind").isin(list(KINDS)))
    examples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    if show > 0:
        ranked = report.withColumn("n", F.row_number().over(_by_region_kind()))
        for row in ranked.where(F.col("n") <= show).orderBy("region", "kind", "key").collect():
            examples.setdefault((row["region"], row["kind"]), []).append(row.asDict(recursive=True))
    summaries = []
    for region in chosen:
        mine = [row for row in counts if row["region"] == region]
        kinds = {kind: sum(r["keys"] for r in mine if r["kind"] == kind) for kind in KINDS}
        winners: dict[str, int] = {}
        for row in mine:
            if row["kind"] in KINDS:
                label = row["winner"] or "undecided"
                winners[label] = winners.get(label, 0) + row["keys"]
        summaries.append(RegionSummary(
            region=region,
            keys_a=sum(r["on_a"] or 0 for r in mine), keys_b=sum(r["on_b"] or 0 for r in mine),
            agree=sum(r["keys"] for r in mine if r["kind"] == "agree"),
            kinds=kinds, winners=winners,
            corrupt_a=sum(r["corrupt_a"] or 0 for r in mine), corrupt_b=sum(r["corrupt_b"] or 0 for r in mine),
            examples={kind: examples.get((region, kind), []) for kind in KINDS},
        ))
    return Reconciliation(site_a, site_b, chosen, unmatched, report.drop("a_corrupt_records", "b_corrupt_records"),
                          summaries, keys)


def choose_regions(site_a: SiteConfig, site_b: SiteConfig,
                   regions: Sequence[str] | None) -> tuple[list[str], list[tuple[str, str]]]:
    """(the regions to compare, the regions only one site declares) for ``regions`` (default: all in common).

    Raises ``InvalidRequest`` for a region a site file lacks, or no region in
    common, and ``TopicMissing`` for a changelog the cluster does not have.
    """
    names_a = [r.name for r in site_a.regions]
    names_b = [r.name for r in site_b.regions]
    unmatched: list[tuple[str, str]] = []
    if regions:
        for region in regions:
            for cfg, names in ((site_a, names_a), (site_b, names_b)):
                if region not in names:
                    raise InvalidRequest("--region", region, f"no such region in site {cfg.site}'s file "
                                         f"(it has {', '.join(names)})")
        chosen = list(dict.fromkeys(regions))
    else:
        chosen = [r for r in names_a if r in names_b]
        unmatched = [(r, site_a.site) for r in names_a if r not in names_b]
        unmatched += [(r, site_b.site) for r in names_b if r not in names_a]
        if not chosen:
            raise InvalidRequest("regions", f"{site_a.site}: {names_a}, {site_b.site}: {names_b}",
                                 "the two site files declare no region in common")
    for cfg in (site_a, site_b):
        require_topics(cfg, [cfg.topics.region_changelog(r) for r in chosen])
    return chosen, unmatched


def _by_region_kind() -> Any:
    from pyspark.sql import Window

    return Window.partitionBy("region", "kind").orderBy("key")


def _compare(a: DataFrame, b: DataFrame, region: str, name_a: str, name_b: str) -> DataFrame:
    """The two states joined on the key, each key classified (``agree``, ``absent``, or one of ``KINDS``)."""
    from pyspark.sql import functions as F

    joined = a.join(b, F.col("a.key") == F.col("b.key"), "full_outer")
    a_present = F.coalesce(F.col("a.present"), F.lit(False))
    b_present = F.coalesce(F.col("b.present"), F.lit(False))
    same_value = (F.col("a.value").eqNullSafe(F.col("b.value"))
                  & F.col("a.value_encoding").eqNullSafe(F.col("b.value_encoding")))
    kind = (F.when(~a_present & ~b_present, F.lit("absent"))
            .when(~b_present, F.lit("only_in_a"))
            .when(~a_present, F.lit("only_in_b"))
            .when(~same_value, F.lit("value_differs"))
            .when(~F.col("a.version").eqNullSafe(F.col("b.version")), F.lit("version_differs"))
            .otherwise(F.lit("agree")))
    side, rule = winner_side(F.col("a.version"), F.col("b.version"))
    divergent = kind.isin(list(KINDS))
    columns: list[Column] = [
        F.lit(region).alias("region"),
        F.coalesce(F.col("a.key"), F.col("b.key")).alias("key"),
        kind.alias("kind"),
        F.when(divergent, side).alias("winner"),
        F.when(divergent, F.when(side == "a", F.lit(name_a)).when(side == "b", F.lit(name_b))).alias("winner_site"),
        F.when(divergent, rule).alias("rule"),
        a_present.alias("a_present"),
        b_present.alias("b_present"),
    ]
    for prefix in ("a", "b"):
        for name in ("operation", "value", "value_encoding", "version", "event_id", "partition", "offset"):
            columns.append(F.col(f"{prefix}.{name}").alias(f"{prefix}_{name}"))
        columns.append(F.coalesce(F.col(f"{prefix}.corrupt_records"), F.lit(0)).alias(f"{prefix}_corrupt_records"))
    return joined.select(*columns)


# --- the command --------------------------------------------------------------------------------


def print_summary(result: Reconciliation, console: Console, output: str | None) -> None:
    """The per-region table, the example keys, and the verdict."""
    a, b = result.site_a, result.site_b
    console.print(f"reconciliation of site {a.site} (dsid {a.dsid}, {a.kafka.bootstrap_servers}) "
                  f"and site {b.site} (dsid {b.dsid}, {b.kafka.bootstrap_servers})")
    table = Table(title_justify="left")
    for column in ("region", f"keys on {a.site}", f"keys on {b.site}", "agree", f"only on {a.site}",
                   f"only on {b.site}", "value differs", "version differs",
                   f"should win: {a.site} / {b.site} / undecided", "corrupt records"):
        table.add_column(column, justify="left" if column == "region" else "right")
    for s in result.summaries:
        table.add_row(s.region, f"{s.keys_a:,}", f"{s.keys_b:,}", f"{s.agree:,}",
                      *[f"{s.kinds[kind]:,}" for kind in KINDS],
                      f"{s.winners.get('a', 0):,} / {s.winners.get('b', 0):,} / {s.winners.get('undecided', 0):,}",
                      f"{s.corrupt_a:,} / {s.corrupt_b:,}")
    console.print(table)
    for s in result.summaries:
        for kind in KINDS:
            rows = s.examples.get(kind, [])
            if not rows:
                continue
            more = s.kinds[kind] - len(rows)
            console.print(f"{s.region}: {kind.replace('_', ' ')} ({s.kinds[kind]:,})"
                          + (f", first {len(rows)}" if more > 0 else ""))
            for row in rows:
                winner = row["winner_site"] or "nobody"
                console.print(f"  {row['key']!r}: {winner} wins ({row['rule']}); "
                              f"{a.site} {_entry(row, 'a')}, {b.site} {_entry(row, 'b')}", markup=False)
    for region, site in result.unmatched:
        console.print(f"region {region} is declared by site {site} only: not compared")
    for cfg in (a, b):
        if cfg.gateway_conflict_resolver:
            console.print(f"site {cfg.site} resolves conflicts with {cfg.gateway_conflict_resolver}; "
                          "the winners above follow the default rule")
    if any(s.corrupt_a or s.corrupt_b for s in result.summaries):
        console.print("some changelog records could not be decoded and were skipped (as the region service "
                      "skips them): the lake's events dataset keeps them with the reason")
    divergent = sum(s.divergent for s in result.summaries)
    where = f"; report in {output}" if output else ""
    if divergent:
        regions = sum(1 for s in result.summaries if s.divergent)
        console.print(f"DIVERGED: {divergent:,} keys in {regions} of {len(result.summaries)} regions{where}")
    else:
        agree = sum(s.agree for s in result.summaries)
        regions = len(result.summaries)
        console.print(f"OK: the sites agree on {agree:,} keys in {regions} region{'' if regions == 1 else 's'}{where}")


def _entry(row: dict[str, Any], side: str) -> str:
    """One side's entry of a report row, briefly: present or not, the value, the version tag."""
    version = row[f"{side}_version"]
    if version is None:
        return "never had it"
    tag = f"v{version['entry_version']} dsid {version['dsid']} at {version['timestamp'].isoformat(' ', 'milliseconds')}"
    if not row[f"{side}_present"]:
        return f"destroyed ({row[f'{side}_operation']}, {tag})"
    value = row[f"{side}_value"]
    shown = "null" if value is None else bytes(value)[:40].decode("utf-8", "replace")
    return f"{shown} ({tag})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site-a", required=True, metavar="FILE", help="the first site's file")
    parser.add_argument("--site-b", required=True, metavar="FILE", help="the second site's file")
    parser.add_argument("--bootstrap-a", metavar="HOST:PORT", help="override site a's kafka.bootstrap_servers")
    parser.add_argument("--bootstrap-b", metavar="HOST:PORT", help="override site b's kafka.bootstrap_servers")
    parser.add_argument("--region", action="append", metavar="NAME",
                        help="compare only this region (repeatable; default every region both files declare)")
    parser.add_argument("--output", metavar="DIR", help="write the report (divergent keys) as Parquet here")
    parser.add_argument("--show", type=int, default=SHOW_DEFAULT, metavar="N",
                        help=f"print up to N keys of each kind of divergence per region (default {SHOW_DEFAULT})")
    add_spark_options(parser)


def _run(args: argparse.Namespace) -> int:
    if args.show < 0:
        raise InvalidRequest("--show", args.show, "must be 0 or more")
    say = Progress("reconcile")
    site_a = load_site(args.site_a, args.bootstrap_a)
    site_b = load_site(args.site_b, args.bootstrap_b)
    choose_regions(site_a, site_b, args.region)  # bad input is answered before Spark starts
    say("starting Spark")
    session = spark_session(f"sluice-reconcile-{site_a.site}-{site_b.site}", args.master, parse_conf(args.conf))
    try:
        result = reconcile(session.spark, site_a, site_b, args.region, show=args.show, say=say)
        try:
            if args.output:
                say(f"writing the report to {args.output}")
                result.write(args.output)
            print_summary(result, console(), args.output)
        finally:
            result.release()
    finally:
        session.stop()
    return EXIT_DIVERGED if result.diverged else EXIT_OK


def run(args: argparse.Namespace) -> int:
    """``sluice pipeline reconcile``; the exit status."""
    return run_job("reconcile", args, _run)


def main(argv: list[str] | None = None) -> int:
    """``spark-submit pipelines/reconcile.py …`` (or ``python -m sluice.pipelines.reconcile``)."""
    return standalone_main("reconcile.py", DESCRIPTION, EXAMPLE, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
