"""What the two sites hold after a run, read from them (not counted along the way), and judged.

``verify_sites`` reads every key of both sites' regions, both changelogs, the
write-behind table, the ledger listener's ledger and every dead-letter topic,
runs the per-key history checker over them, and returns a ``Verification``:
the figures a run reports and the rows of its summary table.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.events import EntryEvent, VersionTag
from .history import Applied, Observer, Report, check, ignore_region_operations
from .ledger import read_ledger
from .sites import TwoSites
from .workload import Written

REGIONS = ("orders", "customers")


def changelog(cfg: Any, region: str) -> list[EntryEvent]:
    """Every event a site's region applied, from its changelog, bucket by bucket."""
    from ..core.framing import frames_for
    from ..core.kafka import make_consumer, read_to_end

    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    try:
        frames = frames_for(cfg)  # either framing: the site's serializer may be confluent
        return [EntryEvent.from_record(frames.decode_as("EntryEvent", m.value()))
                for p in range(cfg.region(region).buckets)
                for m in read_to_end(consumer, cfg.topics.region_changelog(region), p, deadline_s=60)
                if m.value() is not None]
    finally:
        consumer.close()


def region_state(urls: list[str], region: str, token: str | None = None) -> dict[str, tuple[Any, Any]]:
    """key → (value, version record) of every entry, read from the site's region service (with its client
    ``token``)."""
    from ..client import RegionClient

    with RegionClient(urls, token=token) as client:
        keys = client.keys(region)
        entries = client.get_all(region, keys) if keys else {}
    return {k: (e["value"], e["version"]) for k, e in entries.items() if e is not None}


def dead_letters(cfg: Any) -> list[dict[str, Any]]:
    """Every record of the site's dead-letter topics (each queue's, the region DLQ of the receiver and the
    region service, and the subscription service's)."""
    from ..core.codec import get_codec
    from ..core.kafka import make_consumer, read_to_end

    codec = get_codec()
    topics = [cfg.topics.dead_letter(q.id) for q in cfg.all_attached_queues()] + [
        cfg.topics.region_dead_letter(), cfg.topics.subscription_dead_letter()]
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    found = []
    try:
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
            if meta is None or meta.error is not None:
                continue
            for p in meta.partitions:
                for m in read_to_end(consumer, topic, p, deadline_s=30):
                    found.append({**codec.decode_as("DeadLetter", m.value()), "topic": topic})
    finally:
        consumer.close()
    return found


def queue_backlog(sites: TwoSites) -> dict[str, int]:
    """Events held by each attached queue that is not empty, as ``site:queue`` → count."""
    from ..core.statusread import queue_status

    sizes = {f"{site}:{q.id}": sum(r.size for r in queue_status(cfg, q.id))
             for site, cfg in sites.cfgs.items() for q in cfg.all_attached_queues()}
    return {name: size for name, size in sizes.items() if size}


def differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose entry differs between two sites' states (or that one of them lacks), sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@dataclass(frozen=True)
class Convergence:
    """How a wait for the sites to agree ended: after ``seconds``, or not in time (None) with what it last
    saw unsettled (a queue's backlog, keys that differ, or a site that did not answer)."""

    seconds: float | None
    waiting_on: str = ""


def converge(sites: TwoSites, timeout_s: float) -> Convergence:
    """Wait until every queue is empty and both sites hold the same entries, at most ``timeout_s``."""
    started = time.monotonic()
    waiting_on = "nothing read yet"
    while time.monotonic() - started < timeout_s:
        try:
            waiting_on = _unsettled(sites)
            if not waiting_on:
                return Convergence(time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - a service still coming back: keep trying until the deadline
            waiting_on = f"{type(exc).__name__}: {exc}"
        time.sleep(1.0)
    return Convergence(None, waiting_on)


def _unsettled(sites: TwoSites) -> str:
    """What keeps the sites from agreeing now: '' when nothing does."""
    backlog = queue_backlog(sites)
    if backlog:
        return "queues not empty: " + ", ".join(f"{name} {size:,}" for name, size in sorted(backlog.items()))
    for region in REGIONS:
        a, b = (region_state(sites.urls(site), region, sites.token(site)) for site in ("a", "b"))
        differ = differing_keys(a, b)
        if differ:
            return f"{region}: {len(differ)} keys differ between a and b (first {differ[0]!r})"
    return ""


@dataclass
class Verification:
    """The figures of a run, read from the sites, and its summary rows (check, result, ok or None)."""

    reports: dict[str, Report] = field(default_factory=dict)
    issued: int = 0
    acknowledged: int = 0
    applied: dict[str, int] = field(default_factory=dict)  # site → changelog events (both regions)
    divergent: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    sql_rows: int = 0
    sql_differ: int = 0
    listener_delivered: int = 0
    listener_discarded: int = 0
    listener_failures: int = 0
    receiver_repeats: int = 0  # events and batches a receiver discarded as already applied
    conflicts: int = 0
    dead_lettered: Counter[tuple[str, str]] = field(default_factory=Counter)  # (site, error class) → count
    dead_letter_reasons: dict[tuple[str, str], str] = field(default_factory=dict)  # one example reason each
    dead_letter_records: list[dict[str, Any]] = field(default_factory=list)
    rows: list[tuple[str, str, bool | None]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(good is not False for _, _, good in self.rows)

    def row(self, check: str, result: str, good: bool | None) -> None:
        self.rows.append((check, result, good))

    def show(self, console: Any, failed: str = "FAILED", extra: Sequence[tuple[str, str]] = ()) -> None:
        """Print the findings of every failed history check (the first 40 each), then the summary table
        with ``extra`` rows (figures without a verdict)."""
        from rich.table import Table

        for region, report in self.reports.items():
            if not report.ok:
                console.print(f"{region}:\n" + report.render(limit=40), markup=False, highlight=False)
        table = Table(title="verification (read from the sites, not counted)", title_justify="left")
        table.add_column("check")
        table.add_column("result", justify="right")
        table.add_column("")
        for name, result, good in self.rows:
            table.add_row(name, result, "" if good is None else "[green]ok[/]" if good else f"[red]{failed}[/]")
        for name, result in extra:
            table.add_row(name, result, "")
        console.print(table)


def verify_sites(sites: TwoSites, written: Written, *, converged: Convergence) -> Verification:
    """Read both sites and judge the run (see the module docstring)."""
    from ..core.statusread import receiver_status

    v = Verification(issued=written.operations, acknowledged=written.acknowledged)
    finals = {region: {site: region_state(sites.urls(site), region, sites.token(site)) for site in ("a", "b")}
              for region in REGIONS}
    for region in REGIONS:
        a, b = finals[region]["a"], finals[region]["b"]
        diff = differing_keys(a, b)
        v.divergent += len(diff)
        v.row(f"{region}: keys equal on a and b (value and version)", f"{len(a) - len(diff)} of {len(set(a) | set(b))}",
              not diff)
    logs = {(site, region): changelog(cfg, region) for site, cfg in sites.cfgs.items() for region in REGIONS}
    for site in ("a", "b"):
        v.applied[site] = sum(len(logs[(site, r)]) for r in REGIONS)
    ledger_path = sites.workdir / "ledger.db"
    ledger, counters = read_ledger(ledger_path)
    v.listener_delivered = len(ledger)
    v.listener_discarded = counters.get("discarded", 0)
    v.listener_failures = counters.get("failures", 0)
    for region in REGIONS:
        observers = [Observer(f"site {site} {region} changelog",
                              [Applied(e.key, e.event_id, e.version, e.operation, e.origin_dsid)
                               for e in logs[(site, region)]],
                              expects=lambda op: True, may_skip_superseded=True)
                     for site in ("a", "b")]
        if region == "orders" and sites.layout.ledger_failure_rate is not None:
            observers.append(Observer("ledger listener on a (orders-ledger)",
                                      [Applied(e.key, e.event_id, e.version, e.operation, e.origin_dsid)
                                       for e in ledger if e.region == region],
                                      expects=lambda op: True, may_skip_superseded=True))
        states = {site: {k: (val, VersionTag.from_record(tag)) for k, (val, tag) in finals[region][site].items()}
                  for site in ("a", "b")}
        report = check(written.of_region(region), observers, states, ignore=ignore_region_operations)
        v.reports[region] = report
        v.lost += report.counts.lost
        v.duplicated += report.counts.duplicated
        v.reordered += report.counts.reordered
    v.row("events applied twice (a site's changelog" + (", the ledger listener" if ledger else "") + ")",
          str(v.duplicated), v.duplicated == 0)
    v.row("acknowledged writes lost (at their own site, or at the other unless they lost a conflict)",
          f"{v.lost} of {v.acknowledged}", v.lost == 0)
    v.row("writes applied out of their writer's order", str(v.reordered), v.reordered == 0)

    orders_a = {k: val for k, (val, _) in finals["orders"]["a"].items()}
    with sqlite3.connect(sites.workdir / "orders.db") as db:
        sql = {k: json.loads(val) for k, val in db.execute("SELECT key, value FROM orders_live")}
    v.sql_rows = len(sql)
    v.sql_differ = sum(1 for k in set(sql) | set(orders_a) if sql.get(k) != orders_a.get(k))
    v.row("SQLite write-behind table equals a's orders", f"{len(sql)} rows, {v.sql_differ} differ", v.sql_differ == 0)

    receivers = receiver_status(sites.cfgs["a"]) + receiver_status(sites.cfgs["b"])
    v.receiver_repeats = sum(r["events_duplicate"] for r in receivers)
    v.conflicts = sum(r["conflicts"] for r in receivers)
    for site, cfg in sites.cfgs.items():
        for dl in dead_letters(cfg):
            v.dead_letter_records.append(dl)
            v.dead_lettered[(site, dl["error_class"])] += 1
            v.dead_letter_reasons.setdefault((site, dl["error_class"]), f"{dl['topic']}: {dl['reason']}")
    v.row("time to converge after the last write",
          f"never (last seen: {converged.waiting_on})" if converged.seconds is None else f"{converged.seconds:.1f}s",
          converged.seconds is not None)
    return v


def check_client_cache(v: Verification, sites: TwoSites, client: Any, pattern: str, wait_s: float = 30.0) -> None:
    """A subscription client's cache against b's region for the keys of its interest (``pattern``), given
    ``wait_s`` for the last events still in its queue."""
    deadline = time.monotonic() + wait_s
    while True:
        orders_b = region_state(sites.urls("b"), "orders", sites.token("b"))
        mine = {k: val for k, (val, _) in orders_b.items() if re.fullmatch(pattern, k)}
        cache = client.region("orders").snapshot()
        differ = sorted(k for k in set(mine) | set(cache) if mine.get(k) != cache.get(k))
        if not differ or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    v.row(f"{'durable ' if client.durable else ''}client's cache equals b's orders for its keys",
          f"{len(cache)} keys, {len(differ)} differ", not differ)
