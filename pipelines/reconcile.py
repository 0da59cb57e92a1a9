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

``--repair`` then sends exactly the winners through the gateway, and
compares again:

4. group the divergent keys with a winner by region and by the site holding
   it (``plan_repair``); for each group, the gateway sender of that region
   at that site whose remote site is the other one (a region without one
   cannot be repaired that way, and the report says so; keys without a
   winner are left to a person);
5. for each group, a wan-copy of those keys only, from the site holding the
   winners (``sluice.admin.wancopy.run_copy``: the region service queues
   each key's current entry, a tombstone as a destroy, with its own version
   tag and EventID, for that sender alone);
6. wait until each sender has delivered what was queued (its queue head past
   where the queue ended after the copy): the other site applied the
   winners, through its receiver and its usual conflict checks;
7. read both changelogs again and compare; the exit status is that of this
   second comparison.

``reconcile(spark, cfg_a, cfg_b)`` is the same as a function, for a program
(the demo's verification) that wants the result rather than the command;
``plan_repair`` and ``repair`` are the repair's two halves.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from sluice.core.config import SiteConfig
from sluice.core.errors import InvalidRequest, SluiceError
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

__all__ = ["KINDS", "Reconciliation", "RegionSummary", "RepairCopy", "RepairPlan", "add_arguments", "choose_regions",
           "main", "plan_repair", "reconcile", "region_state", "repair", "run", "winner_side"]

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
  sluice pipeline reconcile --site-a a.yaml --site-b b.yaml --repair --max-rate 5000

  Prints, per region, the keys on each site, how many agree, and each kind of
  divergence with the site whose write should win (Geode's rule: the same
  site wrote both → higher entry version; else the later timestamp, ties to
  the higher dsid), then up to --show keys of each kind.  The full report
  (one row per divergent key) is Parquet in --output:

    spark.read.parquet("/data/reconciliation").where("kind = 'value_differs'")

  --repair sends the winner of every divergent key through the gateway: a
  wan-copy of exactly those keys from the site holding each winner, through
  its sender to the other site; it waits until they are delivered, compares
  again and prints that comparison.  --output keeps the first one.

exit status: 0 the sites agree (with --repair: after it); 1 they diverge; 2 bad
input (site files, region names, missing topics); 3 the job failed (Spark, Java
or Kafka trouble, a copy or its delivery that did not finish).
"""

DESCRIPTION = ("Compare two sites' regions, rebuilt from their changelogs: keys on one side only, keys with "
               "different values or version tags, and which site's write should win by the conflict rule.  "
               "Writes the report as Parquet, prints a summary, exits 1 on divergence.  With --repair, sends the "
               "winners through the gateway and compares again.")


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


# --- the repair ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepairCopy:
    """The winners one site holds for one region, and the sender that takes them to the other site."""

    side: str  # "a" or "b": the site holding the winners
    site: SiteConfig
    region: str
    sender_id: str
    keys: list[str]


@dataclass
class RepairPlan:
    """What ``--repair`` sends, and what it cannot."""

    copies: list[RepairCopy]
    #: (region, site holding the winners, keys, why they cannot be sent) of the groups without a sender.
    unsendable: list[tuple[str, str, int, str]] = field(default_factory=list)
    #: Divergent keys with no winner (same dsid and entry version, different entries), per region.
    undecided: dict[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> int:
        return sum(len(c.keys) for c in self.copies)


def plan_repair(rows: Sequence[tuple[str, str, str | None]], site_a: SiteConfig, site_b: SiteConfig) -> RepairPlan:
    """The copies that send each divergent key's winner to the other site: ``rows`` are (region, key,
    winner "a" | "b" | None) of the report.  Each site's copy of a region goes through the first gateway
    sender of that region whose remote dsid is the other site's."""
    sites = {"a": (site_a, site_b), "b": (site_b, site_a)}
    groups: dict[tuple[str, str], list[str]] = {}
    undecided: dict[str, int] = {}
    for region, key, winner in rows:
        if winner is None:
            undecided[region] = undecided.get(region, 0) + 1
        else:
            groups.setdefault((region, winner), []).append(key)
    plan = RepairPlan(copies=[], undecided=undecided)
    for (region, side), keys in sorted(groups.items()):
        holder, other = sites[side]
        senders = [s for s in holder.region(region).gateway_senders if holder.sender(s).remote_dsid == other.dsid]
        if not senders:
            plan.unsendable.append((region, holder.site, len(keys), f"site {holder.site} has no gateway sender of "
                                    f"region {region} to site {other.site} (dsid {other.dsid})"))
            continue
        plan.copies.append(RepairCopy(side, holder, region, senders[0], sorted(keys)))
    return plan


@dataclass
class RepairOutcome:
    """What one copy of the repair did."""

    copy: RepairCopy
    state: str
    copied: int
    skipped: dict[str, int]
    copy_s: float
    delivered_s: float | None = None
    error: str | None = None


def repair(plan: RepairPlan, *, max_rate: int = 0, timeout_s: float = 600.0,
           say: Callable[[str], None] | None = None) -> list[RepairOutcome]:
    """Run the plan's copies (each in chunks of the region service's ``KEYS_MAX`` keys), then wait until each
    sender has delivered them.  A copy that fails is reported, not raised; one whose delivery does not
    come within ``timeout_s`` raises ``SluiceError``."""
    import httpx

    from sluice.admin.wancopy import queue_ends, run_copy, wait_delivered
    from sluice.core.wancopy import KEYS_MAX

    say = say or (lambda _text: None)
    outcomes: list[RepairOutcome] = []
    ends: dict[tuple[str, str], tuple[SiteConfig, list[int]]] = {}
    for copy in plan.copies:
        started = time.monotonic()
        say(f"repair: sending {len(copy.keys):,} winners of region {copy.region} from site {copy.site.site} "
            f"through sender {copy.sender_id}")
        outcome = RepairOutcome(copy, "done", 0, {}, 0.0)
        for i in range(0, len(copy.keys), KEYS_MAX):
            try:
                done = run_copy(copy.site, copy.region, copy.sender_id, max_rate=max_rate,
                                keys=copy.keys[i:i + KEYS_MAX], timeout_s=timeout_s, on_progress=_copy_lines(say))
            except (SluiceError, httpx.HTTPError) as exc:
                outcome.state, outcome.error = "failed", str(exc)
                break
            outcome.copied += done["copied"]
            for reason, n in done["skipped"].items():
                outcome.skipped[reason] = outcome.skipped.get(reason, 0) + n
            if done["state"] != "done":
                outcome.state, outcome.error = done["state"], done.get("error")
                break
        outcome.copy_s = time.monotonic() - started
        outcomes.append(outcome)
        if outcome.copied:
            ends[(copy.site.site, copy.sender_id)] = (copy.site, queue_ends(copy.site, copy.sender_id))
    started = time.monotonic()
    for (site, sender_id), (cfg, queue_end) in ends.items():
        say(f"repair: waiting until sender {sender_id} of site {site} has delivered the winners")
        wait_delivered(cfg, sender_id, queue_end, timeout_s, say)
        for outcome in outcomes:
            if outcome.copy.site.site == site and outcome.copy.sender_id == sender_id:
                outcome.delivered_s = time.monotonic() - started
    return outcomes


def _copy_lines(say: Callable[[str], None]) -> Callable[[dict[str, Any]], None]:
    """A copy's progress as a line every few seconds."""
    last = [0.0]

    def show(copy: dict[str, Any]) -> None:
        if copy["state"] == "running" and time.monotonic() - last[0] < 2.0:
            return
        last[0] = time.monotonic()
        say(f"repair: {copy['region']} → {copy['sender_id']}: {copy['copied']:,} of {copy['total']:,} winners "
            f"queued ({copy['state']})")
    return show


def print_repair(plan: RepairPlan, outcomes: list[RepairOutcome], console: Console) -> None:
    """A row per copy: where from, through which sender, keys sent and skipped, times."""
    table = Table(title="repair: the winners of the divergent keys, sent through the gateway", title_justify="left")
    for column in ("region", "from site", "sender", "to dsid", "winners", "sent", "skipped", "queued in",
                   "delivered in", "state"):
        table.add_column(column, justify="left" if column in ("region", "from site", "sender", "state") else "right")
    for o in outcomes:
        c = o.copy
        skipped = ", ".join(f"{n:,} {reason.replace('_', ' ')}" for reason, n in o.skipped.items() if n) or "0"
        table.add_row(c.region, c.site.site, c.sender_id, str(c.site.sender(c.sender_id).remote_dsid),
                      f"{len(c.keys):,}", f"{o.copied:,}", skipped, f"{o.copy_s:.1f}s",
                      "—" if o.delivered_s is None else f"{o.delivered_s:.1f}s",
                      o.state + (f": {o.error}" if o.error else ""))
    console.print(table)
    for region, site, keys, why in plan.unsendable:
        console.print(f"not repaired: {keys:,} keys of region {region} whose winner is on site {site}: {why}")
    for region, keys in sorted(plan.undecided.items()):
        console.print(f"not repaired: {keys:,} keys of region {region} with no winner (same site and entry "
                      "version, different entries): a person must look")


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
    repairing = parser.add_argument_group("repair")
    repairing.add_argument("--repair", action="store_true",
                           help="send each divergent key's winner through the gateway (a wan-copy of those keys "
                                "from the site holding it), wait for its delivery, and compare again")
    repairing.add_argument("--max-rate", type=int, default=0, metavar="N",
                           help="with --repair: most entries per second each copy sends (default 0: no limit)")
    repairing.add_argument("--repair-timeout-s", type=float, default=600.0, metavar="S",
                           help="with --repair: how long a copy and its delivery may take (default 600)")
    add_spark_options(parser)


def _run(args: argparse.Namespace) -> int:
    if args.show < 0:
        raise InvalidRequest("--show", args.show, "must be 0 or more")
    if args.max_rate < 0:
        raise InvalidRequest("--max-rate", args.max_rate, "entries per second: 0 (no limit) or more")
    if args.repair_timeout_s <= 0:
        raise InvalidRequest("--repair-timeout-s", args.repair_timeout_s, "must be more than 0")
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
            rows = _winners(result) if args.repair and result.diverged else None
        finally:
            result.release()
        if rows is not None:
            plan = plan_repair(rows, site_a, site_b)
            outcomes = repair(plan, max_rate=args.max_rate, timeout_s=args.repair_timeout_s, say=say)
            print_repair(plan, outcomes, console())
            say("comparing the sites again")
            result = reconcile(session.spark, site_a, site_b, args.region, show=args.show, say=say)
            try:
                print_summary(result, console(), None)
            finally:
                result.release()
            if any(o.state != "done" for o in outcomes):
                raise SluiceError("the repair did not finish: "
                                  + "; ".join(f"{o.copy.region} from {o.copy.site.site}: {o.state} ({o.error})"
                                              for o in outcomes if o.state != "done"))
    finally:
        session.stop()
    return EXIT_DIVERGED if result.diverged else EXIT_OK


def _winners(result: Reconciliation) -> list[tuple[str, str, str | None]]:
    """(region, key, winner) of every divergent key of the report."""
    return [(row["region"], row["key"], row["winner"])
            for row in result.report.select("region", "key", "winner").collect()]


def run(args: argparse.Namespace) -> int:
    """``sluice pipeline reconcile``; the exit status."""
    return run_job("reconcile", args, _run)


def main(argv: list[str] | None = None) -> int:
    """``spark-submit pipelines/reconcile.py …`` (or ``python -m sluice.pipelines.reconcile``)."""
    return standalone_main("reconcile.py", DESCRIPTION, EXAMPLE, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
