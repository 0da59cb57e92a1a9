"""``sluice demo``: two sites on embedded brokers, every service as a process, a workload with
faults, and a verification computed from what the sites hold.

What runs:

* site **a** (dsid 1) and site **b** (dsid 2), one embedded broker each
  (Apache Kafka, or Tansu where no JDK exists);
* per site two region-service instances and a gateway receiver;
* region ``orders``: a parallel gateway sender a→b (two instances, so that
  one can take over) and b→a; an async event queue on a writing behind to
  SQLite;
* region ``customers`` on a: a serial gateway sender a→b;
* on b: two subscription-service instances and a durable client subscribed
  to part of ``orders``, which disconnects (keep-alive) and comes back
  midway.

The workload writes creates, updates, put_alls and destroys on both sites,
and conflicting updates of the same keys on both; a live table shows each
queue (size, oldest event, events/s, resends) while it runs, and halfway the
primary of a→b is killed (kill -9) unless ``--no-faults``.

The verification reads the sites: every key's value and version on a and b,
the write-behind table against a's region, the durable client's cache
against b's region, each changelog for events applied twice, and each
acknowledged write's EventID in the changelogs.  Exit status 1 on any
divergence.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import socket
import sqlite3
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .core.processes import (
    DispatcherProcess,
    ReceiverProcess,
    RegionProcess,
    SenderProcess,
    ServiceProcess,
    SubscriptionsProcess,
)

EXAMPLE = """\
examples:
  sluice demo                       # two sites, faults included, about two minutes
  sluice demo --events 6000         # a longer workload
  sluice demo --duration 60         # write for 60 s instead of a number of operations
  sluice demo --no-faults           # no kill -9 of the sender primary
  sluice demo --all-faults          # kill -9 one process of every service type, one after another
  sluice demo --keep-running        # leave everything up; try `sluice admin -c FILE status`; Ctrl-C stops
"""

KEYS = 200
HOT_KEYS = 10  # written by both sites: the conflicts
DURABLE_PATTERN = r"order-00\d\d"  # the durable client's 100 keys


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the two-site demo on embedded brokers",
        description=__doc__,
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--events", type=int, default=3000, help="operations to write, both sites together (default 3000)")
    p.add_argument("--duration", type=float, default=None,
                   help="write for this many seconds instead of --events operations")
    p.add_argument("--no-faults", action="store_true", help="do not kill the sender primary midway")
    p.add_argument("--all-faults", action="store_true",
                   help="also kill -9 (and restart) one process of every other service type during the workload: "
                        "a region instance, the serial sender, a receiver, the write-behind dispatcher and a "
                        "subscription instance")
    p.add_argument("--engine", choices=("auto", "kafka", "tansu"), default="auto", help="embedded brokers")
    p.add_argument("--keep-running", action="store_true", help="leave the sites up until Ctrl-C")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    p.set_defaults(func=run)


# --- the two sites -------------------------------------------------------------------------


def site_files(workdir: Path, bootstrap: dict[str, str], prefix: str,
               region_ports: dict[str, int] | None = None) -> dict[str, Path]:
    """Site files for a and b; a's write-behind database is ``workdir/orders.db``.  ``region_ports``: fixed
    region-service ports, for brokers whose groups do not list their members (the receiver then finds the
    region service by the site file)."""
    kafka = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
    fast = {"batch_size": 100, "batch_time_interval_ms": 50, "socket_read_timeout_ms": 10000}

    def remote(site: str) -> dict[str, Any]:
        return {"bootstrap_servers": bootstrap[site], "topic_prefix": f"{prefix}{site}."}

    sites = {
        "a": {
            "site": "a", "dsid": 1,
            "kafka": {**kafka, "bootstrap_servers": bootstrap["a"], "topic_prefix": f"{prefix}a."},
            "regions": [
                {"name": "orders", "buckets": 8, "gateway_senders": ["orders-to-b"],
                 "async_event_queues": ["orders-jdbc"]},
                {"name": "customers", "buckets": 4, "gateway_senders": ["customers-to-b"]},
            ],
            "gateway_senders": [
                {"id": "orders-to-b", "remote_dsid": 2, "parallel": True, "remote": remote("b"), **fast},
                {"id": "customers-to-b", "remote_dsid": 2, "parallel": False, "dispatcher_threads": 2,
                 "remote": remote("b"), **fast},
            ],
            "async_event_queues": [{
                "id": "orders-jdbc", "parallel": False, "dispatcher_threads": 3,
                "listener": {"type": "sql", "settings": {"url": f"sqlite:///{workdir / 'orders.db'}",
                                                         "table": "orders"}},
            }],
            "receiver": {"inbound_partitions": 4, "accepted_dsids": [2]},
        },
        "b": {
            "site": "b", "dsid": 2,
            "kafka": {**kafka, "bootstrap_servers": bootstrap["b"], "topic_prefix": f"{prefix}b."},
            "regions": [
                {"name": "orders", "buckets": 8, "gateway_senders": ["orders-to-a"]},
                {"name": "customers", "buckets": 4},
            ],
            "gateway_senders": [
                {"id": "orders-to-a", "remote_dsid": 1, "parallel": True, "remote": remote("a"), **fast},
            ],
            "receiver": {"inbound_partitions": 4, "accepted_dsids": [1]},
            "subscriptions": {"registry_partitions": 4, "ping_interval_ms": 1000,
                              "maximum_time_between_pings_ms": 10000},
        },
    }
    for name, port in (region_ports or {}).items():
        sites[name]["region_service"] = {"port": port}
    paths = {}
    for name, data in sites.items():
        paths[name] = workdir / f"site-{name}.yaml"
        paths[name].write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


@dataclass
class Sites:
    """What the demo started: brokers, site configs and files, service processes."""

    workdir: Path
    brokers: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)
    cfgs: dict[str, Any] = field(default_factory=dict)
    procs: list[ServiceProcess] = field(default_factory=list)
    #: How to start each process again (after a kill -9), by the process.
    restart: dict[int, Any] = field(default_factory=dict)
    regions: dict[str, list[RegionProcess]] = field(default_factory=dict)
    senders: dict[str, list[SenderProcess]] = field(default_factory=dict)
    receivers: dict[str, ReceiverProcess] = field(default_factory=dict)
    dispatcher: Any = None
    subscriptions: list[SubscriptionsProcess] = field(default_factory=list)

    def kill_and_restart(self, proc: ServiceProcess) -> ServiceProcess:
        """kill -9, then the same service again (a new process)."""
        proc.kill()
        fresh = self.restart[id(proc)]()
        self.procs.append(fresh)
        self.restart[id(fresh)] = self.restart[id(proc)]
        def swap(items: list[Any]) -> list[Any]:
            return [fresh if item is proc else item for item in items]

        self.regions = {name: swap(regions) for name, regions in self.regions.items()}
        self.senders = {name: swap(senders) for name, senders in self.senders.items()}
        self.receivers = {name: fresh if r is proc else r for name, r in self.receivers.items()}
        self.subscriptions = swap(self.subscriptions)
        if self.dispatcher is proc:
            self.dispatcher = fresh
        return fresh

    def urls(self, site: str) -> list[str]:
        return [p.url for p in self.regions[site]]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(15)
        for broker in self.brokers.values():
            broker.stop()


def start_sites(console: Console, sites: Sites, engine: str) -> None:
    from .broker import start_broker
    from .core.config import load_config
    from .core.topics import apply_topics

    with console.status("starting two embedded brokers…"):
        for name in ("a", "b"):
            sites.brokers[name] = start_broker(f"demo-{name}", 0, engine, data_dir=sites.workdir / f"broker-{name}")
    for name, broker in sites.brokers.items():
        console.print(f"[bold]site {name}[/]: {broker.engine} broker on {broker.bootstrap}")
    prefix = f"demo{uuid.uuid4().hex[:6]}."
    # Tansu describes consumer groups without their members, so region instances cannot find each
    # other's buckets there, nor receivers the region service: one instance per site, on a fixed port.
    tansu = any(b.engine == "tansu" for b in sites.brokers.values())
    ports = {name: free_port() for name in ("a", "b")} if tansu else {}
    sites.paths = site_files(sites.workdir, {n: b.bootstrap for n, b in sites.brokers.items()}, prefix, ports)
    for name, path in sites.paths.items():
        sites.cfgs[name] = load_config(path)
        apply_topics(sites.cfgs[name])
    log = sites.workdir

    def started(proc: ServiceProcess) -> ServiceProcess:
        sites.procs.append(proc)
        return proc

    def again(make: Any) -> Any:
        proc = started(make())
        sites.restart[id(proc)] = make
        return proc

    with console.status("starting the services (15 processes)…") as status:
        instances = 1 if tansu else 2
        for name in ("a", "b"):
            sites.regions[name] = [
                again(lambda n=name, i=i: RegionProcess(sites.paths[n], log / f"region-{n}{i}.log",
                                                        port=ports.get(n, 0)))
                for i in range(instances)]
        for name in ("a", "b"):
            status.update(f"starting site {name}'s receiver and senders…")
            sites.receivers[name] = again(lambda n=name: ReceiverProcess(sites.paths[n], log / f"receiver-{n}.log"))
        sites.senders["orders-to-b"] = [
            started(SenderProcess(sites.paths["a"], "orders-to-b", log / f"orders-to-b-{i}.log")) for i in range(2)]
        sites.senders["customers-to-b"] = [again(lambda: SenderProcess(
            sites.paths["a"], "customers-to-b", log / "customers-to-b.log", parallel=False))]
        sites.senders["orders-to-a"] = [
            started(SenderProcess(sites.paths["b"], "orders-to-a", log / "orders-to-a.log"))]
        status.update("starting the write-behind dispatcher and the subscription services…")
        sites.dispatcher = again(lambda: DispatcherProcess(sites.paths["a"], "orders-jdbc", log / "dispatcher.log"))
        sites.subscriptions = [again(lambda i=i: SubscriptionsProcess(sites.paths["b"], log / f"subscriptions-{i}.log"))
                               for i in range(2)]
        status.update("waiting for every bucket to have a ready owner…")
        for region in sites.regions["a"] + sites.regions["b"]:
            region.wait_ready()
    console.print(f"services: {len(sites.procs)} processes ({instances} region instance(s) and a receiver per "
                  "site; senders orders a→b ×2, customers a→b (serial), orders b→a; a SQLite write-behind on a; "
                  "2 subscription instances on b); logs in " + str(sites.workdir))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the workload ----------------------------------------------------------------------------


@dataclass
class Written:
    """What the writers were told was applied (acknowledged), and what failed."""

    acknowledged: list[tuple[str, str, str, Any, str]] = field(default_factory=list)  # site, region, key, EventID, kind
    failed: int = 0
    operations: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, site: str, region: str, kind: str, keys: list[str], first: Any) -> None:
        from .core.events import EventID

        with self.lock:
            self.operations += len(keys)
            for i, key in enumerate(keys):
                self.acknowledged.append((site, region, key, EventID(first.member_id, first.thread_id,
                                                                     first.sequence_id + i), kind))


def write_site(site: str, urls: list[str], rng: random.Random, budget: "Budget", written: Written) -> None:
    """One site's writer: puts, put_alls and destroys of ``orders``, puts of ``customers``, and updates of the
    hot keys both sites write."""
    from .client import RegionClient, RegionError

    # Each site writes its own half of the keys past the hot ones: no conflicts there.
    lo = HOT_KEYS if site == "a" else (HOT_KEYS + KEYS) // 2
    hi = (HOT_KEYS + KEYS) // 2 if site == "a" else KEYS
    with RegionClient(urls, member_id=f"demo-writer-{site}", retry_for_s=60) as client:
        present: set[str] = set()
        while budget.take(1):
            roll = rng.random()
            try:
                if roll < 0.15:
                    key = f"order-{rng.randrange(HOT_KEYS):04d}"  # contested: both sites write these
                    eid = client.next_event_id()
                    client.put("orders", key, {"site": site, "t": time.time()}, event_id=eid)
                    written.note(site, "orders", "put", [key], eid)
                elif roll < 0.25:
                    entries = {f"order-{rng.randrange(lo, hi):04d}": {"site": site, "qty": rng.randrange(9)}
                               for _ in range(10)}
                    eid = client.next_event_id(len(entries))
                    client.put_all("orders", entries, event_id=eid)
                    written.note(site, "orders", "put_all", list(entries), eid)
                    present.update(entries)
                    budget.take(len(entries) - 1)
                elif roll < 0.32 and present:
                    key = rng.choice(sorted(present))
                    present.discard(key)
                    eid = client.next_event_id()
                    client.destroy("orders", key, event_id=eid)
                    written.note(site, "orders", "destroy", [key], eid)
                elif roll < 0.40 and site == "a":
                    key = f"customer-{rng.randrange(50):03d}"
                    eid = client.next_event_id()
                    client.put("customers", key, {"n": rng.randrange(1000)}, event_id=eid)
                    written.note(site, "customers", "put", [key], eid)
                else:
                    key = f"order-{rng.randrange(lo, hi):04d}"
                    eid = client.next_event_id()
                    client.put("orders", key, {"site": site, "qty": rng.randrange(100)}, event_id=eid)
                    written.note(site, "orders", "put", [key], eid)
                    present.add(key)
            except RegionError as exc:
                if exc.error != "EntryNotFound":  # a destroy racing the other site's: expected
                    with written.lock:
                        written.failed += 1


class Budget:
    """Operations left to write (or seconds left, with ``--duration``)."""

    def __init__(self, events: int, duration_s: float | None) -> None:
        self.left = events
        self.until = None if duration_s is None else time.monotonic() + duration_s
        self.duration_s = duration_s
        self.started = time.monotonic()
        self.done = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.until is not None:
                if time.monotonic() >= self.until:
                    return False
            elif self.left <= 0:
                return False
            self.left -= n
            self.done += n
            return True

    @property
    def fraction(self) -> float:
        if self.until is not None and self.duration_s:
            return min(1.0, (time.monotonic() - self.started) / self.duration_s)
        total = self.done + max(self.left, 0)
        return self.done / total if total else 1.0


def queue_table(sites: Sites, previous: dict[tuple[str, int], tuple[float, int]]) -> Table:
    """Per sender and queue: size, oldest event, events/s since the last look, resends."""
    from .admin.cli import queue_status

    table = Table(title="queues (live)", title_justify="left")
    for col in ("site", "queue", "primaries", "queue size", "oldest event", "events/s", "resends", "dead letters"):
        table.add_column(col, justify="left" if col in ("site", "queue", "primaries") else "right")
    now = time.monotonic()
    for site, cfg in sites.cfgs.items():
        for queue in cfg.all_attached_queues():
            try:
                rows = queue_status(cfg, queue.id)
            except Exception as exc:  # noqa: BLE001 - a broker busy for a moment: show it, go on
                table.add_row(site, queue.id, f"({type(exc).__name__})", "", "", "", "", "")
                continue
            events = sum(r.events for r in rows)
            before = previous.get((queue.id, id(cfg)))
            rate = (events - before[1]) / (now - before[0]) if before and now > before[0] else 0.0
            previous[(queue.id, id(cfg))] = (now, events)
            oldest = max((r.oldest_age_s or 0.0 for r in rows), default=0.0)
            table.add_row(site, queue.id, str(len({r.primary for r in rows if r.primary != "—"})),
                          str(sum(r.size for r in rows)), f"{oldest:.1f}s", f"{rate:,.0f}",
                          str(sum(r.redeliveries for r in rows)), str(sum(r.dead_lettered for r in rows)))
    return table


# --- verification ----------------------------------------------------------------------------


def changelog(cfg: Any, region: str) -> list[Any]:
    """Every event a site's region applied, from its changelog."""
    from .core.codec import get_codec
    from .core.events import EntryEvent
    from .core.kafka import make_consumer, read_to_end

    codec = get_codec()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    try:
        return [EntryEvent.from_record(codec.decode_as("EntryEvent", m.value()))
                for p in range(cfg.region(region).buckets)
                for m in read_to_end(consumer, cfg.topics.region_changelog(region), p, deadline_s=60)
                if m.value() is not None]
    finally:
        consumer.close()


def history_check(console: Console, written: Written, logs: dict[tuple[str, str], list[Any]],
                  sites: Sites) -> tuple[int, int, int]:
    """The per-key history checker over each region: the writers' acknowledged operations against both
    sites' changelogs (a conflict loser may be missing at the other site), and the final states."""
    from .verify.history import Applied, Issued, Observer, check, ignore_region_operations

    totals = [0, 0, 0]
    for region in ("orders", "customers"):
        issued = [Issued(key, eid, site, kind, None, True)
                  for site, reg, key, eid, kind in written.acknowledged if reg == region]
        observers = [Observer(f"site {site} {region} changelog",
                              [Applied(e.key, e.event_id, e.version, e.operation, e.origin_dsid)
                               for e in logs[(site, region)]],
                              expects=lambda op: True, may_skip_superseded=True)
                     for site in ("a", "b")]
        finals = {site: {k: (v, _version(tag)) for k, (v, tag) in region_state(sites.urls(site), region).items()}
                  for site in ("a", "b")}
        report = check(issued, observers, finals, ignore=ignore_region_operations)
        c = report.counts
        totals[0] += c.lost
        totals[1] += c.duplicated
        totals[2] += c.reordered
        if not report.ok:
            console.print(report.render())
    return totals[0], totals[1], totals[2]


def _version(tag: dict[str, Any]) -> Any:
    from .core.events import VersionTag

    return VersionTag.from_record(tag)


def region_state(urls: list[str], region: str) -> dict[str, tuple[Any, Any]]:
    from .client import RegionClient

    with RegionClient(urls) as client:
        keys = client.keys(region)
        entries = client.get_all(region, keys) if keys else {}
    return {k: (e["value"], e["version"]) for k, e in entries.items() if e is not None}


def converge(sites: Sites, timeout_s: float) -> float | None:
    """Seconds until every queue is empty and both sites hold the same orders and customers."""
    from .admin.cli import queue_status

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            empty = all(sum(r.size for r in queue_status(cfg, q.id)) == 0
                        for cfg in sites.cfgs.values() for q in cfg.all_attached_queues())
            if empty and all(region_state(sites.urls("a"), r) == region_state(sites.urls("b"), r)
                             for r in ("orders", "customers")):
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - keep trying until the deadline
            pass
        time.sleep(1.0)
    return None


def verify(console: Console, sites: Sites, written: Written, client: Any, converged_s: float | None,
           failover: str) -> bool:
    """The summary, computed by reading regions, changelogs, the SQLite table and the client's cache."""
    from .admin.cli import receiver_status

    problems: list[str] = []
    table = Table(title="verification (read from the sites, not counted)", title_justify="left")
    table.add_column("check")
    table.add_column("result", justify="right")
    table.add_column("")

    def row(check: str, result: str, good: bool) -> None:
        table.add_row(check, result, "[green]ok[/]" if good else "[red]DIVERGED[/]")
        if not good:
            problems.append(check)

    divergent = 0
    for region in ("orders", "customers"):
        a, b = region_state(sites.urls("a"), region), region_state(sites.urls("b"), region)
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        divergent += len(diff)
        row(f"{region}: keys equal on a and b (value and version)", f"{len(a) - len(diff)} of {len(set(a) | set(b))}",
            not diff)
    logs = {(site, region): changelog(cfg, region) for site, cfg in sites.cfgs.items()
            for region in ("orders", "customers")}
    lost, twice, reordered = history_check(console, written, logs, sites)
    row("events applied twice at a site", str(twice), twice == 0)
    row("acknowledged writes lost (at their own site, or at the other unless they lost a conflict)",
        f"{lost} of {len(written.acknowledged)}", lost == 0)
    row("writes applied out of their writer's order", str(reordered), reordered == 0)

    orders_a = region_state(sites.urls("a"), "orders")
    with sqlite3.connect(sites.workdir / "orders.db") as db:
        sql = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM orders_live")}
    sql_diff = sorted(k for k in set(sql) | set(orders_a) if sql.get(k) != (orders_a.get(k) or (None,))[0])
    row("SQLite write-behind table equals a's orders", f"{len(sql)} rows, {len(sql_diff)} differ", not sql_diff)

    deadline = time.monotonic() + 30  # the client's queue may still hold the last events
    while True:
        orders_b = region_state(sites.urls("b"), "orders")
        mine = {k: v for k, (v, _) in orders_b.items() if re.fullmatch(DURABLE_PATTERN, k)}
        cache = client.region("orders").snapshot()
        cache_diff = sorted(k for k in set(mine) | set(cache) if mine.get(k) != cache.get(k))
        if not cache_diff or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    row("durable client's cache equals b's orders for its keys", f"{len(cache)} keys, {len(cache_diff)} differ",
        not cache_diff)

    receivers = receiver_status(sites.cfgs["a"]) + receiver_status(sites.cfgs["b"])
    duplicates = sum(r["events_duplicate"] for r in receivers) + client.processed()["repeats"]
    conflicts = sum(r["conflicts"] for r in receivers)
    table.add_row("duplicates discarded (receivers' repeats, the client's repeats)", str(duplicates), "")
    table.add_row("conflicts resolved (events that lost at the receiving site)", str(conflicts), "")
    table.add_row("failover of the a→b primary", failover, "")
    row("time to converge after the last write", "never" if converged_s is None else f"{converged_s:.1f}s",
        converged_s is not None)
    console.print(table)
    ok = not problems
    console.print(f"[{'green' if ok else 'red'}]{'OK' if ok else 'DIVERGED'}[/]: {written.operations} operations "
                  f"acknowledged on two sites, {written.failed} refused; divergent keys {divergent}; "
                  f"lost {lost}; applied twice {twice}"
                  + ("" if ok else f"; failed checks: {', '.join(problems)}"))
    return ok


# --- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from .client import ClientCache

    console = Console() if Console().is_terminal else Console(width=120)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-demo-"))
    sites = Sites(workdir)
    interrupted = False
    client = None

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        try:
            start_sites(console, sites, args.engine)
        except RuntimeError as exc:
            console.print(f"[red]a service did not start[/]: {exc}")
            return 1
        cfg_b = sites.cfgs["b"]
        client = ClientCache(cfg_b, "demo-durable", durable=True, region_urls=sites.urls("b"))
        client.region("orders").register_interest_regex(DURABLE_PATTERN, durable=True)
        client.ready_for_events()
        console.print(f"durable client demo-durable on b: interest /{DURABLE_PATTERN}/ in orders")

        budget = Budget(args.events, args.duration)
        written = Written()
        writers = [threading.Thread(target=write_site, args=(s, sites.urls(s), random.Random(f"{args.seed}{s}"),
                                                               budget, written), daemon=True) for s in ("a", "b")]
        for w in writers:
            w.start()
        progress = Progress(TextColumn("writing on a and b"), BarColumn(), TextColumn("{task.fields[done]} ops"),
                            TimeElapsedColumn(), console=console)
        task = progress.add_task("writing", total=1.0, done=0)
        failover = "not tried (--no-faults)" if args.no_faults else "—"
        events: list[str] = []
        rates: dict[tuple[str, int], tuple[float, int]] = {}
        killed_at = None
        durable_away = durable_back = False
        schedule: list[tuple[float, str, Any]] = [] if not args.all_faults else [
            (0.15, "a region instance of a", lambda: sites.regions["a"][0]),
            (0.25, "the serial sender customers a→b", lambda: sites.senders["customers-to-b"][-1]),
            (0.40, "the receiver of b", lambda: sites.receivers["b"]),
            (0.60, "the write-behind dispatcher", lambda: sites.dispatcher),
            (0.80, "a subscription instance of b", lambda: sites.subscriptions[0]),
        ]
        shown = [queue_table(sites, rates)]
        watching = threading.Event()

        def watch() -> None:  # the table takes a second or two to read: off the loop that injects faults
            while not watching.is_set():
                shown[0] = queue_table(sites, rates)
                watching.wait(1.0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        away_at = 0.0
        with Live(Group(progress, shown[0]), console=console, refresh_per_second=4) as live:
            while any(w.is_alive() for w in writers):
                f = budget.fraction
                progress.update(task, completed=f, done=written.operations)
                for at, what, victim in list(schedule):
                    if f >= at:
                        schedule.remove((at, what, victim))
                        proc = victim()
                        sites.kill_and_restart(proc)
                        events.append(f"kill -9 of {what} ({getattr(proc, 'member_id', '') or proc.pid}) at {f:.0%}, "
                                      "started again")
                if not args.no_faults and killed_at is None and f >= 0.5:
                    victim = sites.senders["orders-to-b"][0]
                    victim.kill()
                    killed_at = time.time()
                    events.append(f"kill -9 of an orders a→b sender ({victim.member_id}) at {f:.0%}")
                if not durable_away and f >= 0.3:
                    client.close(keep_alive=True)
                    durable_away, away_at = True, time.monotonic()
                    events.append(f"durable client away (keep-alive close) at {f:.0%}")
                if durable_away and not durable_back and f >= 0.7 and time.monotonic() - away_at >= 1.0:
                    client = reconnect(cfg_b, sites)
                    durable_back = True
                    events.append(f"durable client back at {f:.0%}: its queue replayed before the marker")
                live.update(Group(progress, shown[0]))
                time.sleep(0.2)
            watching.set()
            watcher.join(10)
            if durable_away and not durable_back:
                client = reconnect(cfg_b, sites)
                events.append("durable client back after the writes: its queue replayed before the marker")
            progress.update(task, completed=1.0, done=written.operations)
            live.update(Group(progress, queue_table(sites, rates)))
        console.print()
        for line in events:
            console.print(f"  · {line}")
        if killed_at is not None:
            failover = failover_time(sites, killed_at)
        with console.status("waiting for the sites to converge…"):
            converged = converge(sites, 90)
        if not client.live:
            time.sleep(2)
        ok = verify(console, sites, written, client, converged, failover)
        if args.keep_running:
            console.print(f"running; try: sluice admin -c {sites.paths['a']} status   (Ctrl-C stops everything)")
            while True:
                time.sleep(1)
        return 0 if ok else 1
    except KeyboardInterrupt:
        interrupted = True
        return 130
    finally:
        if client is not None and not client.closed:
            client.close()
        sites.stop()
        if not interrupted and not args.keep_running:
            shutil.rmtree(workdir, ignore_errors=True)


def reconnect(cfg_b: Any, sites: Sites) -> Any:
    """The durable client comes back: same id, its queue resumed, its interest registered again."""
    from .client import ClientCache

    client = ClientCache(cfg_b, "demo-durable", durable=True, region_urls=sites.urls("b"))
    client.region("orders").register_interest_regex(DURABLE_PATTERN, durable=True)
    client.ready_for_events()
    return client


def failover_time(sites: Sites, killed_wall: float) -> str:
    """From the kill to the surviving sender's log line taking all 8 partitions of orders a→b."""
    survivor = sites.senders["orders-to-b"][1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in survivor.log_tail(200_000).splitlines():
            if "primary for partitions [0, 1, 2, 3, 4, 5, 6, 7]" not in line:
                continue
            try:
                stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
            except ValueError:
                continue
            if stamp >= killed_wall:
                return f"{stamp - killed_wall:.1f}s from kill -9 to the other sender owning all 8 partitions " \
                       f"(group session timeout 3 s)"
        time.sleep(0.5)
    return "the other sender had not taken every partition 30 s after the kill"
