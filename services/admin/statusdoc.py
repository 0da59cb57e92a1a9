"""The site's status as one JSON document: ``sluice admin status --json`` and the page's ``GET /api/status``.

Both build it the same way, so a script may read either:

1. ``sample(cfg, offsets)`` makes one pass of reads, the very reads ``sluice
   admin status`` makes for its tables (``queue_status`` of every queue,
   ``receiver_status``, ``receivertotals.site_totals``, ``client_status``,
   ``bucket_status``, the region instances' claims), into the document's
   data sections.  Rates need the offsets of the sample before: the page's
   sampler keeps them between samples (``offsets``), a single command has
   none and its rates are null.  Queues are the document's point: if they
   cannot be read the sample fails; any other section that cannot be read is
   empty, and ``section_errors`` says why.
2. ``document(cfg, snapshot, ...)`` wraps a sample with the site, the
   version, and what only the page has (its sampling interval, its chart's
   history, whether its API needs a token, the last error while sampling).

Every field is described in docs/status-json.md.  ``version`` grows only when
a field changes meaning or goes away; new fields may appear in any version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..core.config import SiteConfig
from ..core.directory import owners_of, read_instances, standbys_of
from ..core.errors import SluiceError
from ..core.kafka import kafka_errors
from ..core.receivertotals import PartitionTotals, site_totals, summed
from ..core.statusread import PartitionStatus, queue_status, receiver_status
from .clean import clean_history
from .cli import STATES, bucket_status, client_status

log = logging.getLogger("sluice.admin.status")

#: The document's version (docs/status-json.md).
STATUS_VERSION = 1
#: A receiver whose last report is older than this is not counted as running.
RECEIVER_REPORT_FRESH_S = 30.0
#: The data sections of a sample, in the order the document lists them.
SECTIONS = ("sites", "regions", "queues", "receivers", "receiver_partitions", "receiver_totals", "senders",
            "clients", "buckets", "cleans")


@dataclass(frozen=True)
class Offsets:
    """Where one queue partition stood at one sample (for the rates of the next)."""

    at_s: float
    head: int
    end: int


def empty_snapshot() -> dict[str, Any]:
    """A sample with nothing in it (the page before its first sample)."""
    return {"sampled_at_ms": None, "sample_s": None, "sites": [], "regions": [], "queues": [], "receivers": [],
            "receiver_partitions": [], "receiver_totals": None, "senders": [], "clients": [], "buckets": [],
            "cleans": [], "section_errors": {}}


def sample(cfg: SiteConfig, offsets: dict[tuple[str, int], Offsets] | None = None) -> dict[str, Any]:
    """One pass of reads of the site (module docstring).  ``offsets`` are the previous sample's, updated
    in place; None: no rates.  Raises SluiceError when the queues cannot be read."""
    started = time.monotonic()
    now_s = time.time()
    queues = []
    for attached in cfg.all_attached_queues():
        rows = queue_status(cfg, attached.id)
        queues.append(_queue_entry(cfg, attached.id, attached.kind, attached.parallel, rows, now_s, offsets))
    errors: dict[str, str] = {}
    receivers = _section(cfg, "receivers", errors,
                         lambda: _receivers(receiver_status(cfg)) if cfg.receiver is not None else [])
    partitions = _section(cfg, "receiver_partitions", errors,
                          lambda: [_partition_row(t) for t in site_totals(cfg)])
    return {
        "sampled_at_ms": int(now_s * 1000),
        "sites": _sites(cfg, queues),
        "regions": _regions(cfg),
        "queues": queues,
        "receivers": receivers,
        "receiver_partitions": partitions,
        "receiver_totals": _receiver_totals(cfg, partitions) if cfg.receiver is not None else None,
        "senders": _senders(receivers),
        "clients": _section(cfg, "clients", errors, lambda: [asdict(c) for c in client_status(cfg)]),
        "buckets": _section(cfg, "buckets", errors, lambda: [_bucket_row(b) for b in bucket_status(cfg)]),
        # Clean starts of the senders and what each partition dropped (clean.py).
        "cleans": _section(cfg, "cleans", errors, lambda: [r.to_dict() for r in clean_history(cfg)]),
        "section_errors": errors,
        "sample_s": round(time.monotonic() - started, 3),
    }


def document(cfg: SiteConfig, snapshot: dict[str, Any], *, error: str | None = None,
             stale_since_ms: int | None = None, interval_s: float | None = None, token_required: bool = False,
             history: dict[str, Any] | None = None) -> dict[str, Any]:
    """The document of ``snapshot``: what ``GET /api/status`` answers and ``status --json`` prints."""
    return {
        "version": STATUS_VERSION,
        "site": {"name": cfg.site, "dsid": cfg.dsid, "bootstrap": cfg.kafka.bootstrap_servers},
        **snapshot,
        "error": error,
        "stale_since_ms": stale_since_ms,
        "interval_s": interval_s,
        "actions": sorted(STATES),
        "token_required": token_required,
        "history": history if history is not None else {"window_s": 0, "points": []},
    }


def _section(cfg: SiteConfig, name: str, errors: dict[str, str], read: Callable[[], list[Any]]) -> list[Any]:
    try:
        with kafka_errors(f"reading the {name}"):
            return read()
    except SluiceError as exc:
        log.warning("reading the %s of site %s failed: %s", name, cfg.site, exc)
        errors[name] = f"{type(exc).__name__}: {exc}"
        return []


def _queue_entry(cfg: SiteConfig, queue_id: str, kind: str, parallel: bool, rows: list[PartitionStatus],
                 now_s: float, offsets: dict[tuple[str, int], Offsets] | None) -> dict[str, Any]:
    partitions = []
    for r in rows:
        before = offsets.get((queue_id, r.partition)) if offsets is not None else None
        in_per_s = out_per_s = None
        if before is not None and now_s > before.at_s:
            elapsed_s = now_s - before.at_s
            # Offsets only grow; a recreated topic starts again from 0: no rate then.
            in_per_s = max(0, r.end - before.end) / elapsed_s
            out_per_s = max(0, r.head - before.head) / elapsed_s
        if offsets is not None:
            offsets[(queue_id, r.partition)] = Offsets(now_s, r.head, r.end)
        partitions.append({**asdict(r), "size": r.size, "size_counted": r.counted is not None,
                           "in_per_s": in_per_s, "out_per_s": out_per_s})
    ages = [p["oldest_age_s"] for p in partitions if p["oldest_age_s"] is not None]
    acks = [p["last_delivered_age_s"] for p in partitions if p["last_delivered_age_s"] is not None]
    sender = next((s for s in cfg.gateway_senders if s.id == queue_id), None)
    return {
        "id": queue_id,
        "kind": kind,
        "parallel": parallel,
        "remote_dsid": sender.remote_dsid if sender else None,
        "regions": [r.name for r in cfg.regions_of(queue_id)],
        "states": sorted({p["state"] for p in partitions}),
        "primaries": sorted({p["primary"] for p in partitions if p["primary"] != "—"}),
        "size": sum(p["size"] for p in partitions),
        "size_counted": all(p["size_counted"] for p in partitions),
        "oldest_age_s": max(ages) if ages else None,
        "in_per_s": sum_rates(p["in_per_s"] for p in partitions),
        "out_per_s": sum_rates(p["out_per_s"] for p in partitions),
        "resends": sum(p["redeliveries"] for p in partitions),
        "dead_lettered": sum(p["dead_lettered"] for p in partitions),
        "last_ack_age_s": min(acks) if acks else None,
        "partitions": partitions,
    }


def sum_rates(rates: Any) -> float | None:
    """The sum of the rates known; None when none is known yet (the first sample)."""
    known = [r for r in rates if r is not None]
    return sum(known) if known else None


def _sites(cfg: SiteConfig, queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This site, then every site it sends to or accepts from, with what is queued for it."""
    remote_dsids = sorted({s.remote_dsid for s in cfg.gateway_senders}
                          | set(cfg.receiver.accepted_dsids if cfg.receiver else ()))
    sites = [{"dsid": cfg.dsid, "name": cfg.site, "role": "this site",
              "bootstrap": cfg.kafka.bootstrap_servers, "senders": [], "queued": None, "out_per_s": None,
              "accepted_by_receiver": None}]
    for dsid in remote_dsids:
        senders = [s for s in cfg.gateway_senders if s.remote_dsid == dsid]
        to_it = [q for q in queues if q["remote_dsid"] == dsid]
        remote = next((s.remote for s in senders if s.remote is not None), None)
        sites.append({
            "dsid": dsid, "name": None, "role": "remote",
            "bootstrap": remote.bootstrap_servers if remote else None,
            "senders": [s.id for s in senders],
            "queued": sum(q["size"] for q in to_it) if to_it else None,
            "out_per_s": sum_rates(q["out_per_s"] for q in to_it) if to_it else None,
            "accepted_by_receiver": dsid in cfg.receiver.accepted_dsids if cfg.receiver else False,
        })
    return sites


def _regions(cfg: SiteConfig) -> list[dict[str, Any]]:
    """Each region and the region-service instances that own its buckets (their published claims,
    ``sluice.core.directory``)."""
    try:
        with kafka_errors("reading the owner directory"):
            records = read_instances(cfg)
        owners = owners_of(records)
        standbys: dict[tuple[str, int], list[dict[str, Any]]] | None = {
            rb: [{"instance": inst.instance, "lag": lag, "entries": entries, "value_bytes": size}
                 for inst, lag, entries, size in copies]
            for rb, copies in standbys_of(records).items()}
        members: list[tuple[str, list[tuple[str, int]]]] | None = [
            (url, [(cfg.topics.region_changelog(r), b) for (r, b), u in owners.items() if u == url])
            for url in sorted(set(owners.values()))]
    except SluiceError as exc:
        log.warning("cannot read the region-service instances: %s", exc)
        members = None
        standbys = None
    regions = []
    for region in cfg.regions:
        changelog = cfg.topics.region_changelog(region.name)
        instances: list[dict[str, Any]] | None = None if members is None else []
        for client_id, tps in members or ():
            owned = sum(1 for topic, _ in tps if topic == changelog)
            if owned and instances is not None:
                instances.append({"instance": client_id, "buckets": owned})
        regions.append({
            "name": region.name,
            "buckets": region.buckets,
            "buckets_owned": None if instances is None else sum(i["buckets"] for i in instances),
            "instances": None if instances is None else sorted(instances, key=lambda i: i["instance"]),
            "gateway_senders": list(region.gateway_senders),
            "async_event_queues": list(region.async_event_queues),
            "redundant_copies": region.redundant_copies,
            # Per bucket: its standby copies (instance, lag, entries, value bytes); None when unknown.
            "standbys": None if standbys is None else [standbys.get((region.name, b), [])
                                                       for b in range(region.buckets)],
        })
    return regions


def _receivers(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each receiver process's last report, with ``running``: reported within RECEIVER_REPORT_FRESH_S."""
    return [{**r, "running": r["age_s"] < RECEIVER_REPORT_FRESH_S} for r in reports]


def _partition_row(totals: PartitionTotals) -> dict[str, Any]:
    return {**totals.to_record(), "own": totals.own}


def _receiver_totals(cfg: SiteConfig, partitions: list[dict[str, Any]]) -> dict[str, Any]:
    """The site's figures: the sum of its inbound partitions'."""
    rows = [PartitionTotals(p["partition"], p["dsid"], totals=p["totals"]) for p in partitions]
    return {"dsid": cfg.dsid, "partitions": len(rows), **summed(rows)}


def _senders(receivers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each remote sender the running receivers heard from: connected when one of them says so."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for r in receivers:
        if not r["running"]:
            continue
        for s in r.get("senders", ()):
            key = (s["source_dsid"], s["sender_id"])
            row = merged.setdefault(key, {"source_dsid": key[0], "sender_id": key[1], "connected": False,
                                          "last_heard_at": 0, "batches": 0, "heard_by": []})
            row["connected"] = row["connected"] or s["connected"]
            row["last_heard_at"] = max(row["last_heard_at"], s["last_heard_at"])
            row["batches"] += s["batches"]
            row["heard_by"].append(r["member"])
    return [merged[k] for k in sorted(merged)]


def _bucket_row(bucket: Any) -> dict[str, Any]:
    return {"region": bucket.region, "bucket": bucket.bucket, "primary": bucket.primary,
            "redundant_copies": bucket.redundant_copies,
            "standbys": [{"instance": name, "lag": lag, "entries": entries, "value_bytes": size}
                         for name, lag, entries, size in bucket.standbys]}


__all__ = ["SECTIONS", "STATUS_VERSION", "Offsets", "document", "empty_snapshot", "sample", "sum_rates"]
