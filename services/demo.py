"""``sluice demo``: two sites on embedded brokers, every service as a process, a workload with
faults, and a verification computed from what the sites hold.

What runs (``sluice.verify.sites``):

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

Both sites are set up as production sites should be: each signs its gateway
batches and acks with its own Ed25519 key and verifies the other's, and each
region service takes a client token (the writers, readers and the durable
client send it) and a member token (its instances and the receiver).  The
keys and tokens are made at start in the working folder's ``secrets/``, which
the site files name; they go with the folder when the demo ends.

The workload writes creates, updates, put_alls and destroys on both sites,
and conflicting updates of the same keys on both; a live table shows each
queue (size, oldest event, events/s, resends) while it runs, and halfway a
primary of a→b is killed (kill -9) unless ``--no-faults``.

The verification reads the sites: every key's value and version on a and b,
the write-behind table against a's region, the durable client's cache
against b's region, and every acknowledged write in both changelogs, by the
per-key history checker.  Exit status 1 on any divergence.  ``sluice soak``
runs the same sites under every kind of fault.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .core import telemetry
from .verify.checks import Convergence, check_client_cache, converge, verify_sites
from .verify.sites import SESSION_TIMEOUT_MS, Layout, TwoSites
from .verify.workload import Budget, Written, write_site

EXAMPLE = """\
examples:
  sluice demo                       # two sites, a sender primary killed midway, about a minute
  sluice demo --events 6000         # a longer workload
  sluice demo --duration 60         # write for 60 s instead of a number of operations
  sluice demo --no-faults           # no kill -9 of the sender primary
  sluice demo --keep-running        # leave everything up; try `sluice admin -c FILE status`; Ctrl-C stops
  sluice demo --traces spans.jsonl  # every service's spans in one file; prints a trace from a to b
  sluice soak --minutes 2           # the same sites under every kind of fault (the fault harness)
"""

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
    p.add_argument("--engine", choices=("auto", "kafka", "tansu"), default="auto", help="embedded brokers")
    p.add_argument("--keep-running", action="store_true", help="leave the sites up until Ctrl-C")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    p.add_argument("--traces", metavar="FILE", type=Path, default=None,
                   help="every service appends its OpenTelemetry spans to FILE (one JSON span a line); at the "
                        "end, a trace from a put on a to its apply on b and a listener call is printed")
    p.set_defaults(func=run)


def queue_table(sites: TwoSites, previous: dict[tuple[str, int], tuple[float, int]]) -> Table:
    """Per sender and queue: size, oldest event, events/s since the last look, resends, dead letters; and the
    duplicates each site's receivers discarded."""
    from .core.statusread import queue_status, receiver_status

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
    repeats = []
    for site, cfg in sites.cfgs.items():
        try:
            reports = receiver_status(cfg)
        except Exception:  # noqa: BLE001 - as above
            continue
        repeats.append(f"at {site} {sum(r['events_duplicate'] for r in reports):,} events in "
                       f"{sum(r['duplicate_batches'] for r in reports):,} repeated batches")
    table.caption = "duplicates discarded by the receivers (already applied): " + "; ".join(repeats)
    table.caption_justify = "left"
    return table


# --- verification ----------------------------------------------------------------------------


def verify(console: Console, sites: TwoSites, written: Written, client: Any, converged: Convergence,
           failover: str) -> bool:
    """The summary, computed by reading regions, changelogs, the SQLite table and the client's cache."""
    v = verify_sites(sites, written, converged=converged)
    check_client_cache(v, sites, client, DURABLE_PATTERN)
    v.show(console, failed="DIVERGED", extra=[
        ("duplicates discarded (receivers' repeats, the client's repeats)",
         str(v.receiver_repeats + client.processed()["repeats"])),
        ("conflicts resolved (events that lost at the receiving site)", str(v.conflicts)),
        ("failover of the a→b primary", failover),
    ])
    problems = [check for check, _, good in v.rows if good is False]
    ok = not problems
    console.print(f"[{'green' if ok else 'red'}]{'OK' if ok else 'DIVERGED'}[/]: {v.acknowledged} operations "
                  f"acknowledged on two sites, {written.refused} refused; divergent keys {v.divergent}; "
                  f"lost {v.lost}; applied twice {v.duplicated}"
                  + ("" if ok else f"; failed checks: {', '.join(problems)}"))
    return ok


# --- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    console = Console() if Console().is_terminal else Console(width=120)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-demo-"))
    sites = TwoSites(workdir, Layout())
    interrupted = False
    client = None

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    if args.traces is not None:
        # The services inherit it: each appends its spans to the one file.
        args.traces = args.traces.resolve()
        args.traces.write_bytes(b"")
        os.environ[telemetry.TRACES_FILE_ENV] = str(args.traces)
    try:
        try:
            with console.status("starting two embedded brokers…"):
                sites.start_brokers(args.engine)
                sites.configure()
                sites.plan()
            for name, broker in sites.brokers.items():
                console.print(f"[bold]site {name}[/]: {broker.engine} broker on {broker.bootstrap}")
            with console.status(f"starting the services ({len(sites.services)} processes)…") as status:
                sites.start_services(progress=status.update)
        except RuntimeError as exc:
            console.print(f"[red]a service did not start[/]: {exc}")
            return 1
        instances = len(sites.of("region", "a"))
        console.print(f"services: {len(sites.services)} processes ({instances} region instance(s) and a receiver "
                      "per site; senders orders a→b ×2, customers a→b (serial), orders b→a; a SQLite write-behind "
                      "on a; 2 subscription instances on b); logs in " + str(workdir))
        console.print(f"signed gateway batches and acks (Ed25519), region tokens on: keys and tokens in "
                      f"{workdir / 'secrets'}")
        cfg_b = sites.cfgs["b"]
        client = reconnect(cfg_b, sites)
        console.print(f"durable client demo-durable on b: interest /{DURABLE_PATTERN}/ in orders")

        budget = Budget(args.events, args.duration)
        written = Written()
        writers = [threading.Thread(target=write_site, args=(s, sites.urls(s), random.Random(f"{args.seed}{s}"),
                                                               budget, written), kwargs={"token": sites.token(s)},
                                    daemon=True) for s in ("a", "b")]
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
                if not args.no_faults and killed_at is None and f >= 0.5:
                    victim = sites.of("sender", "a", "orders-to-b")[0]
                    killed_at = sites.kill(victim)
                    events.append(f"kill -9 of an orders a→b sender ({victim.proc.member_id}) at {f:.0%}")
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
        if args.traces is not None and not args.keep_running:
            sites.stop_services()  # each flushes its spans as it stops
            show_trace(console, args.traces)
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


def show_trace(console: Console, path: Path) -> None:
    """One trace id that goes from a put on a through the sender and receiver to the apply on b
    and a listener call."""
    spans = telemetry.read_spans(path)
    traces = telemetry.wan_traces(spans, "a", "b")
    console.print(f"traces: {len(spans):,} spans in {path}; {len(traces):,} traces go from a put on a to its "
                  "apply on b and a listener")
    if not traces:
        return
    trace_id = traces[0]
    console.print(f"  trace id [bold]{trace_id.removeprefix('0x')}[/]:")
    for span in sorted((s for s in spans if s["context"]["trace_id"] == trace_id), key=lambda s: s["start_time"]):
        service = (span.get("resource") or {}).get("attributes", {}).get("service.name", "?")
        console.print(f"    {span['start_time']}  {span['name']:<24} site {telemetry.span_site(span)}  ({service})")


def reconnect(cfg_b: Any, sites: TwoSites) -> Any:
    """The durable client comes back: same id, its queue resumed, its interest registered again."""
    from .client import ClientCache

    client = ClientCache(cfg_b, "demo-durable", durable=True, region_urls=sites.urls("b"))
    client.region("orders").register_interest_regex(DURABLE_PATTERN, durable=True)
    client.ready_for_events()
    return client


def failover_time(sites: TwoSites, killed_wall: float) -> str:
    """From the kill to the surviving sender's log line taking all 8 partitions of orders a→b."""
    survivor = sites.of("sender", "a", "orders-to-b")[1]
    assert survivor.proc is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in survivor.proc.log_tail(200_000).splitlines():
            if "primary for partitions [0, 1, 2, 3, 4, 5, 6, 7]" not in line:
                continue
            try:
                stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
            except ValueError:
                continue
            if stamp >= killed_wall:
                return f"{stamp - killed_wall:.1f}s from kill -9 to the other sender owning all 8 partitions " \
                       f"(group session timeout {SESSION_TIMEOUT_MS / 1000:g} s)"
        time.sleep(0.5)
    return "the other sender had not taken every partition 30 s after the kill"
