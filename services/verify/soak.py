"""``sluice soak``: the fault harness.  Two sites under load, faults injected on a seeded schedule, then the
convergence check and a report of everything lost, applied twice, dead-lettered and how long failovers took.

Faults (``--faults``, all by default; ``--list`` describes each): kill -9 of each service type,
a paused broker, a killed broker, a whole site restarted, a hanging receiver, corrupt records.

All the while the ``orders-ledger`` queue's listener fails on a share of its
batches (``--listener-failures``), and a durable subscription client on b
stays connected.  After the last write the run waits for the queues to drain
and the sites to agree, then reads both sites and runs the per-key history
checker (``sluice.verify.history``).  Exit status 1 when anything was lost,
applied twice or reordered, any key diverged, an injected corrupt record was
not dead-lettered, or a service crashed by itself.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .checks import Verification, check_client_cache, converge, verify_sites
from .failover import Failover, held, measure, percentile
from .sites import HEARTBEAT_INTERVAL_MS, SESSION_TIMEOUT_MS, Layout, Service, TwoSites
from .workload import Budget, Written, write_site

KILLS = {
    "kill-region": ("region", None),
    "kill-parallel": ("sender", "orders-to-b"),
    "kill-serial": ("sender", "customers-to-b"),
    "kill-receiver": ("receiver", None),
    "kill-dispatcher": ("dispatcher", None),
    "kill-subscriptions": ("subscriptions", None),
}
DURABLE_PATTERN = r"order-00\d\d"  # the durable client's 100 keys
#: How long the sites get, after the last write, to empty their queues and agree.
CONVERGE_S = 180

FAULT_HELP = {
    "kill-region": "kill -9 a region-service instance that owns buckets (a region owner), start it again",
    "kill-parallel": "kill -9 a primary of the parallel sender orders a→b, start it again",
    "kill-serial": "kill -9 the primary of the serial sender customers a→b (its secondary takes over)",
    "kill-receiver": "kill -9 a gateway receiver, start it again",
    "kill-dispatcher": "kill -9 the primary dispatcher of an async event queue (its secondary takes over), start it again",
    "kill-subscriptions": "kill -9 a subscription-service primary, start it again",
    "pause-broker": "SIGSTOP a site's broker for 4-10 s, then SIGCONT; both sites keep writing the same keys",
    "kill-broker": "kill -9 a site's broker and start it again on its data directory",
    "restart-site": "stop every service of a site (SIGTERM) and start them all again; the other keeps writing",
    "hang-receiver": "SIGSTOP a receiver for 1-5 s, three times: a receiver failing intermittently",
    "corrupt": "undecodable records into the write-behind queue, the a→b sender's queue and b's gateway "
               "inbound topic: each must be dead-lettered with its reason",
}
FAULTS = tuple(FAULT_HELP)

EXAMPLE = """\
examples:
  sluice soak --seed 1 --minutes 10           # every fault, one every ~20 s, for 10 minutes (make soak)
  sluice soak --seed 7 --minutes 2 --faults kill-parallel,pause-broker
  sluice soak --seed 3 --faults kill-region,kill-receiver --interval 8 --report run.json
  sluice soak --list                          # the faults, one line each
"""


# --- what happened ------------------------------------------------------------------------------


@dataclass
class Injected:
    """One fault as injected: when, what, and (kills) the victim's log for the failover."""

    fault: str
    at: float  # wall clock
    detail: str
    kind: str = ""  # the killed service's kind, for kills
    victim: Service | None = None
    victim_log: Path | None = None


@dataclass
class Corrupted:
    site: str
    topic: str
    partition: int
    offset: int


@dataclass
class RunReport:
    """What ``sluice soak`` prints and writes with ``--report``."""

    seed: int
    minutes: float
    engine: str
    faults: list[dict[str, Any]] = field(default_factory=list)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    dead_lettered: list[dict[str, Any]] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# --- the faults ---------------------------------------------------------------------------------


class Harness:
    """Two sites, the writers, and the faults, injected from the thread that started the services."""

    def __init__(self, sites: TwoSites, rng: random.Random, console: Console) -> None:
        self.sites = sites
        self.rng = rng
        self.console = console
        self.injected: list[Injected] = []
        self.corrupted: list[Corrupted] = []

    def note(self, fault: str, detail: str, **kw: Any) -> Injected:
        item = Injected(fault, time.time(), detail, **kw)
        self.injected.append(item)
        self.console.log(f"{fault}: {detail}")
        return item

    def inject(self, fault: str) -> None:
        if fault in KILLS:
            self.kill(fault, *KILLS[fault])
        else:
            getattr(self, fault.replace("-", "_"))()

    def _primaries(self, kind: str, name: str | None) -> list[Service]:
        """The live services of a kind that hold work now (the primaries), by their logs."""
        now = time.time()
        live = [s for s in self.sites.of(kind, name=name) if s.alive]
        return [s for s in live if held(kind, s.logs[-1], now)] or live

    def kill(self, fault: str, kind: str, name: str | None) -> None:
        candidates = self._primaries(kind, name)
        if not candidates:  # every one of them crashed: the run report lists them
            self.note(fault, f"nothing to kill: no {kind} process{f' of {name}' if name else ''} is alive")
            return
        victim = self.rng.choice(candidates)
        log = victim.logs[-1]
        parts = sorted(held(kind, log, time.time()))
        at = self.sites.kill(victim)
        self.injected.append(Injected(fault, at, f"kill -9 of {victim.label} (held {', '.join(parts) or 'nothing'})",
                                      kind=kind, victim=victim, victim_log=log))
        self.console.log(f"{fault}: kill -9 of {victim.label}")
        time.sleep(1.0)  # a supervisor's restart delay
        self.sites.start_again(victim)

    def pause_broker(self, seconds: float | None = None) -> None:
        site = self.rng.choice(("a", "b"))
        hold = seconds if seconds is not None else self.rng.uniform(4, 10)
        self.note("pause-broker", f"SIGSTOP of site {site}'s broker for {hold:.1f}s")
        self.sites.brokers[site].pause()
        time.sleep(hold)
        self.sites.brokers[site].resume()

    def kill_broker(self) -> None:
        site = self.rng.choice(("a", "b"))
        broker = self.sites.brokers[site]
        self.note("kill-broker", f"kill -9 of site {site}'s broker, started again on {broker.data_dir} once its "
                                 "controller fenced it")
        broker.kill()
        time.sleep(1.0)
        broker.start()

    def restart_site(self) -> None:
        site = self.rng.choice(("a", "b"))
        services = [s for s in self.sites.services if s.site == site]
        self.note("restart-site", f"every service of site {site} stopped ({len(services)} processes) "
                                  "and started again")
        self.sites.stop_site(site)
        self.sites.start_services(services)

    def hang_receiver(self) -> None:
        receivers = [s for s in self.sites.of("receiver") if s.alive]
        victim = self.rng.choice(receivers)
        holds = [self.rng.uniform(1, 5) for _ in range(3)]
        self.note("hang-receiver", f"SIGSTOP of {victim.label} for {', '.join(f'{h:.1f}s' for h in holds)}")
        for h in holds:
            assert victim.proc is not None
            victim.proc.pause()
            time.sleep(h)
            victim.proc.resume()
            time.sleep(2.0)

    def corrupt(self) -> None:
        """Undecodable records into a queue topic of each kind and an inbound topic."""
        from ..core.kafka import make_producer

        a, b = self.sites.cfgs["a"], self.sites.cfgs["b"]
        targets = [("a", a, a.topics.queue("orders-jdbc")), ("a", a, a.topics.queue("orders-to-b")),
                   ("b", b, b.topics.gateway_inbound())]
        for site, cfg, topic in targets:
            producer = make_producer(cfg.kafka.client_settings())
            meta = producer.list_topics(topic, timeout=10).topics[topic]
            partition = self.rng.choice(sorted(meta.partitions))
            delivered: list[Any] = []
            producer.produce(topic, b"\x00not an avro record " + bytes(self.rng.randrange(256) for _ in range(16)),
                             b"corrupt", partition=partition, on_delivery=lambda err, msg: delivered.append(msg))
            producer.flush(30)
            if delivered and delivered[0].error() is None:
                self.corrupted.append(Corrupted(site, topic, partition, delivered[0].offset()))
        self.note("corrupt", "undecodable records written to " + ", ".join(
            f"{c.topic}[{c.partition}]@{c.offset}" for c in self.corrupted[-len(targets):]))

    def failovers(self) -> list[Failover]:
        """Each kill's failover, from the logs of the victim and of the other processes of its service."""
        found = []
        for item in self.injected:
            if item.victim is None or item.victim_log is None:
                continue
            group = [s for s in self.sites.services if (s.kind, s.site, s.name) ==
                     (item.victim.kind, item.victim.site, item.victim.name)]
            logs = [log for s in group for log in s.logs if log != item.victim_log]
            found.append(measure(item.kind, item.victim.label, item.victim_log, logs, item.at))
        return found


def schedule(faults: list[str], minutes: float, interval_s: float, rng: random.Random) -> list[tuple[float, str]]:
    """(seconds after the start, fault): every fault once in a shuffled round, again and again, one every
    ``interval_s`` (±25 %), leaving the last 15 % of the run quiet."""
    plan: list[tuple[float, str]] = []
    at = interval_s / 2
    end = minutes * 60 * 0.85
    round_: list[str] = []
    while at < end:
        if not round_:
            round_ = list(faults)
            rng.shuffle(round_)
        plan.append((at, round_.pop()))
        at += interval_s * rng.uniform(0.75, 1.25)
    return plan


# --- the run ------------------------------------------------------------------------------------


def run_soak(*, seed: int, minutes: float, faults: list[str], interval_s: float, engine: str = "auto",
             listener_failures: float = 0.1, rate_per_s: float = 150.0, console: Console | None = None,
             workdir: Path | None = None, plan: list[tuple[float, str]] | None = None) -> RunReport:
    """Start two sites, write for ``minutes`` while injecting ``faults``, verify, report.

    ``plan`` replaces the seeded schedule: (seconds after the start, fault).
    """
    from ..client import ClientCache

    console = console or Console()
    rng = random.Random(seed)
    own_dir = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="sluice-soak-"))
    # Geode's redundancy: a secondary beside every primary, so a kill -9 fails over to a running process.
    layout = Layout(receivers=2, serial_senders=2, dispatchers=2, ledger_failure_rate=listener_failures, seed=seed)
    sites = TwoSites(workdir, layout)
    report = RunReport(seed=seed, minutes=minutes, engine=engine)
    client = None
    ok = False
    try:
        with console.status("starting two embedded brokers, each with a controller of its own…"):
            # A controller apart from its broker: a kill -9 or a pause of the broker then leaves no
            # transaction open for ever (EmbeddedKafka says how one JVM does).
            sites.start_brokers(engine, separate_controllers=True)
            sites.configure()
            sites.plan()
        report.engine = " / ".join(sorted({b.engine_label for b in sites.brokers.values()}))
        with console.status(f"starting {layout.process_count} service processes…") as status:
            sites.start_services(progress=status.update)
        console.log(f"two sites on {report.engine}: {len(sites.services)} service processes; logs in {workdir}")
        client = ClientCache(sites.cfgs["b"], "soak-durable", durable=True, region_urls=sites.urls("b"))
        client.region("orders").register_interest_regex(DURABLE_PATTERN, durable=True)
        client.ready_for_events()

        harness = Harness(sites, rng, console)
        budget = Budget(0, minutes * 60)
        written = Written()
        writers = [threading.Thread(target=write_site, args=(s, sites.urls(s), random.Random(f"{seed}{s}"), budget,
                                                             written, rate_per_s, sites.token(s)), daemon=True)
                   for s in ("a", "b")]
        for w in writers:
            w.start()
        todo = list(plan) if plan is not None else schedule(faults, minutes, interval_s, rng)
        started = time.monotonic()
        progress = Progress(TextColumn("soak"), BarColumn(), TextColumn("{task.fields[ops]:,} ops, {task.fields[faults]} faults"),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=console)
        with progress:
            task = progress.add_task("soak", total=minutes * 60, ops=0, faults=0)
            while any(w.is_alive() for w in writers):
                elapsed = time.monotonic() - started
                if todo and elapsed >= todo[0][0]:
                    harness.inject(todo.pop(0)[1])
                progress.update(task, completed=min(elapsed, minutes * 60), ops=written.operations,
                                faults=len(harness.injected))
                time.sleep(0.2)
            for _, fault in todo:  # a plan longer than the writing: what is left still runs
                harness.inject(fault)
        with console.status("waiting for the queues to drain and the sites to agree…"):
            converged = converge(sites, CONVERGE_S)
        if converged.seconds is None:
            console.log(f"[red]the sites did not agree within {CONVERGE_S} s[/]; last seen: {converged.waiting_on}")
        with console.status("reading both sites and checking every key's history…"):
            try:
                verification = verify_sites(sites, written, converged=converged)
            except Exception as exc:
                if converged.seconds is None:
                    exc.add_note(f"the sites had not agreed within {CONVERGE_S} s; last seen: {converged.waiting_on}")
                raise
            check_client_cache(verification, sites, client, DURABLE_PATTERN)
        failovers = harness.failovers()
        report = build_report(report, harness, written, verification, failovers, client, sites)
        print_report(console, report, verification)
        ok = report.ok
        return report
    finally:
        if client is not None and not client.closed:
            client.close()
        if not ok and sites.dump_stacks():
            time.sleep(0.5)  # the stacks reach the logs before the services stop
            for service in sites.of("region"):  # where a region that stopped answering waits
                if service.proc is not None:
                    console.print(f"--- the end of {service.label}'s log ---\n{service.proc.log_tail(4000)}",
                                  markup=False, highlight=False)
        sites.stop()
        if own_dir and ok:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            console.print(f"logs and data kept in {workdir}")


def build_report(report: RunReport, harness: Harness, written: Written, v: Verification, failovers: list[Failover],
                 client: Any, sites: TwoSites) -> RunReport:
    report.faults = [{"fault": i.fault, "at": i.at, "detail": i.detail} for i in harness.injected]
    report.failovers = [{**asdict(f), "held": list(f.held)} for f in failovers]
    measured = [f.seconds for f in failovers if f.seconds is not None]
    by_kind: dict[str, list[float]] = {}
    for f in failovers:
        if f.seconds is not None:
            by_kind.setdefault(f.kind, []).append(f.seconds)
    dead = {(c.topic, c.partition, c.offset) for c in harness.corrupted}
    dead_found = {(d["source_topic"], d["source_partition"], d["source_offset"]) for d in v.dead_letter_records}
    report.dead_lettered = [{"site": site, "error_class": cls, "count": n, "example": v.dead_letter_reasons[(site, cls)]}
                            for (site, cls), n in sorted(v.dead_lettered.items())]
    report.crashed = sites.crashed()
    report.figures = {
        "operations_issued": v.issued,
        "operations_acknowledged": v.acknowledged,
        "applied_per_site": v.applied,
        "delivered_to_listeners": {"orders-ledger (ledger listener)": v.listener_delivered,
                                   "orders-jdbc (SQLite rows)": v.sql_rows,
                                   "durable client (events)": client.processed()["applied"] if client else 0},
        "listener_failures_injected": v.listener_failures,
        "duplicates_discarded": {"receivers": v.receiver_repeats, "ledger listener": v.listener_discarded,
                                 "durable client": client.processed()["repeats"] if client else 0},
        "conflicts_resolved": v.conflicts,
        "dead_lettered": sum(v.dead_lettered.values()),
        "corrupt_injected": len(dead),
        "corrupt_not_dead_lettered": len(dead - dead_found),
        "lost": v.lost,
        "applied_twice": v.duplicated,
        "reordered": v.reordered,
        "divergent_keys": v.divergent,
        "failovers_measured": len(measured),
        "failovers_not_resumed": len(failovers) - len(measured),
        "failover_p50_s": percentile(measured, 0.5),
        "failover_max_s": max(measured, default=None),
        "failover_by_kind": {k: {"n": len(x), "p50_s": percentile(x, 0.5), "max_s": max(x)} for k, x in by_kind.items()},
        "longest_write_gap_s": dict(written.longest_gap),
        "session_timeout_ms": SESSION_TIMEOUT_MS,
        "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
        "converged": v.ok,
    }
    problems = [f"{check}: {result}" for check, result, good in v.rows if good is False]
    if dead - dead_found:
        problems.append(f"{len(dead - dead_found)} injected corrupt records not dead-lettered")
    if report.crashed:
        problems.append("services crashed by themselves: " + ", ".join(report.crashed))
    if len(failovers) > len(measured):
        problems.append(f"{len(failovers) - len(measured)} killed primaries' work never resumed in the logs")
    report.problems = problems
    return report


def print_report(console: Console, report: RunReport, v: Verification) -> None:
    f = report.figures
    v.show(console)

    figures = Table(title="run report", title_justify="left")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    rows = [
        ("operations issued / acknowledged", f"{f['operations_issued']:,} / {f['operations_acknowledged']:,}"),
        ("applied per site (changelog events)", ", ".join(f"{s} {n:,}" for s, n in f["applied_per_site"].items())),
        ("delivered to listeners", ", ".join(f"{k} {n:,}" for k, n in f["delivered_to_listeners"].items())),
        ("listener failures injected (batches offered again)", f"{f['listener_failures_injected']:,}"),
        ("duplicates discarded", ", ".join(f"{k} {n:,}" for k, n in f["duplicates_discarded"].items())),
        ("conflicts resolved", f"{f['conflicts_resolved']:,}"),
        ("dead-lettered", f"{f['dead_lettered']} ({f['corrupt_injected']} corrupt records injected, "
                          f"{f['corrupt_not_dead_lettered']} of them not dead-lettered)"),
        ("lost", str(f["lost"])),
        ("applied twice", str(f["applied_twice"])),
        ("reordered", str(f["reordered"])),
        ("divergent keys", str(f["divergent_keys"])),
        ("failover p50 / max (kill -9 → successor's first work)",
         f"{_s(f['failover_p50_s'])} / {_s(f['failover_max_s'])} over {f['failovers_measured']} kills "
         f"(session timeout {SESSION_TIMEOUT_MS} ms, heartbeat {HEARTBEAT_INTERVAL_MS} ms)"),
        ("longest gap between acknowledged writes", ", ".join(f"{s} {g:.1f}s" for s, g in
                                                              sorted(f["longest_write_gap_s"].items()))),
    ]
    for name, value in rows:
        figures.add_row(name, value)
    console.print(figures)
    if report.dead_lettered:
        dl = Table(title="dead-lettered, by reason", title_justify="left")
        for col in ("site", "error", "count", "example"):
            dl.add_column(col, justify="right" if col == "count" else "left")
        for d in report.dead_lettered:
            dl.add_row(d["site"], d["error_class"], str(d["count"]), d["example"][:100])
        console.print(dl)
    if report.failovers:
        fo = Table(title="failovers (from the logs)", title_justify="left")
        for col in ("fault", "victim", "held", "successor's first work after"):
            fo.add_column(col, justify="right" if col.startswith("successor") else "left")
        for item in report.failovers:
            fo.add_row(item["kind"], item["victim"], ", ".join(item["held"]) or "—", _s(item["seconds"]))
        console.print(fo)
    ok = report.ok
    console.print(f"[{'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/]: seed {report.seed}, "
                  f"{len(report.faults)} faults, {f['operations_acknowledged']:,} acknowledged operations; "
                  f"lost {f['lost']}, applied twice {f['applied_twice']}, divergent {f['divergent_keys']}"
                  + ("" if ok else "; " + "; ".join(report.problems)))


def _s(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.1f}s"


# --- the command ----------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("soak", help="the fault harness: two sites under load and faults, then verified",
                              description=__doc__, epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1, help="seeds the schedule, the victims and the workload (default 1)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to write (default 10)")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated faults (default: all; see --list)")
    p.add_argument("--interval", type=float, default=20.0, help="seconds between faults, ±25%% (default 20)")
    p.add_argument("--listener-failures", type=float, default=0.1,
                   help="share of batches the ledger listener fails (default 0.1)")
    p.add_argument("--rate", type=float, default=150.0, help="write calls a second per site (default 150)")
    p.add_argument("--engine", choices=("auto", "kafka", "tansu"), default="auto", help="embedded brokers")
    p.add_argument("--report", type=Path, help="also write the run report as JSON to this file")
    p.add_argument("--list", action="store_true", help="list the faults and exit")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    console = Console() if Console().is_terminal else Console(width=140)
    if args.list:
        table = Table(title="faults")
        table.add_column("fault")
        table.add_column("what it does")
        for name, what in FAULT_HELP.items():
            table.add_row(name, what)
        console.print(table)
        return 0
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        console.print(f"[red]--faults[/]: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(FAULTS)}")
        return 2
    if args.minutes <= 0 or args.interval <= 0 or not 0 <= args.listener_failures < 1:
        console.print("[red]--minutes and --interval must be positive, --listener-failures in [0, 1)[/]")
        return 2
    if engine_tansu(args.engine):
        console.print("[red]the fault harness needs Apache Kafka (Tansu lists no group members, so instances "
                      "cannot take over each other's work); install a JDK and Maven[/]")
        return 2

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        report = run_soak(seed=args.seed, minutes=args.minutes, faults=faults, interval_s=args.interval,
                          engine=args.engine, listener_failures=args.listener_failures, rate_per_s=args.rate,
                          console=console)
    except KeyboardInterrupt:
        return 130
    if args.report:
        args.report.write_text(json.dumps(asdict(report), indent=2, default=str))
        console.print(f"report written to {args.report}")
    return 0 if report.ok else 1


def engine_tansu(engine: str) -> bool:
    from ..broker import resolve_engine

    return resolve_engine(engine, notice=False) == "tansu"

