"""Two Sluice sites on embedded brokers, every service a process: what ``sluice demo`` and ``sluice soak`` run.

* site **a** (dsid 1) and site **b** (dsid 2), one embedded broker each
  (Apache Kafka, or Tansu where no JDK exists);
* per site region-service instances and gateway receivers;
* region ``orders``: a parallel gateway sender a→b and b→a; an async event
  queue on a writing behind to SQLite (``orders-jdbc``) and, for the fault
  harness, one feeding the ledger listener (``orders-ledger``);
* region ``customers`` on a: a serial gateway sender a→b;
* on b: subscription-service instances.

Both sites run as a production site should (issue 17): each signs its
gateway batches and acks with an Ed25519 key of its own and verifies the
other's, and each region service takes a client token and a member token.
``site_files`` makes the keys and tokens in the working folder's ``secrets/``
(the private keys and tokens readable by their owner only) and the site
files name them (``*_file``): nothing secret is written into a site file.

``TwoSites`` knows how to start each service again, so faults can kill -9 it,
stop a whole site and start it again, or kill and restart a site's broker.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.processes import (
    DispatcherProcess,
    ReceiverProcess,
    RegionProcess,
    SenderProcess,
    ServiceProcess,
    SubscriptionsProcess,
)

#: Group timeouts of every service: a dead member's work moves after this.
SESSION_TIMEOUT_MS = 3000
HEARTBEAT_INTERVAL_MS = 500


@dataclass
class Layout:
    """How many processes of each kind, and what the fault harness adds."""

    region_instances: int = 2
    receivers: int = 1
    parallel_senders: int = 2  # orders a→b; b→a always has one
    serial_senders: int = 1  # customers a→b: a primary and, with 2, a secondary
    dispatchers: int = 1  # per async event queue: a primary and, with 2, a secondary
    subscriptions: int = 2
    #: The ``orders-ledger`` queue on a, delivering to a LedgerListener failing this often (None: no ledger).
    ledger_failure_rate: float | None = None
    seed: int = 0

    @property
    def process_count(self) -> int:
        queues = 1 + (self.ledger_failure_rate is not None)
        return (2 * self.region_instances + 2 * self.receivers + self.parallel_senders + 1 + self.serial_senders
                + queues * self.dispatchers + self.subscriptions)


SECRETS_DIR = "secrets"


def _write_secret(path: Path, text: str) -> None:
    """A file only its owner can read, from the moment it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text + "\n")


def site_secrets(workdir: Path, sites: tuple[str, ...] = ("a", "b")) -> dict[str, dict[str, str]]:
    """Per site, its Ed25519 key pair (``sluice keys generate``'s files: ``<site>.key``, ``<site>.pub``), a
    region client token and a member token, made in ``workdir/secrets``: each site's settings naming them,
    relative to a site file in ``workdir``.  Made once; a site started again finds them there."""
    from ..core import sitekeys

    folder = workdir / SECRETS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    settings = {}
    for site in sites:
        private_path = folder / f"site-{site}.key"
        if not private_path.exists():
            private, public = sitekeys.generate()
            _write_secret(private_path, private)
            (folder / f"site-{site}.pub").write_text(public + "\n", encoding="ascii")
            _write_secret(folder / f"site-{site}.token", secrets.token_urlsafe(24))
            _write_secret(folder / f"site-{site}.member-token", secrets.token_urlsafe(24))
        settings[site] = {
            "gateway_private_key_file": f"{SECRETS_DIR}/site-{site}.key",
            "token_file": f"{SECRETS_DIR}/site-{site}.token",
            "member_token_file": f"{SECRETS_DIR}/site-{site}.member-token",
            "public_key_file": f"{SECRETS_DIR}/site-{site}.pub",
        }
    return settings


def site_files(workdir: Path, bootstrap: dict[str, str], prefix: str, layout: Layout,
               region_ports: dict[str, int] | None = None) -> dict[str, Path]:
    """Site files for a and b; a's write-behind database is ``workdir/orders.db``, the ledger
    ``workdir/ledger.db``.  ``region_ports``: fixed region-service ports, for brokers whose groups do not
    list their members (the receiver then finds the region service by the site file)."""
    kafka = {"session_timeout_ms": SESSION_TIMEOUT_MS, "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS}
    fast = {"batch_size": 100, "batch_time_interval_ms": 50, "socket_read_timeout_ms": 10000}

    def remote(site: str) -> dict[str, Any]:
        return {"bootstrap_servers": bootstrap[site], "topic_prefix": f"{prefix}{site}."}

    queues_a = ["orders-jdbc"] + (["orders-ledger"] if layout.ledger_failure_rate is not None else [])
    aeqs: list[dict[str, Any]] = [{
        "id": "orders-jdbc", "parallel": False, "dispatcher_threads": 3,
        "listener": {"type": "sql", "settings": {"url": f"sqlite:///{workdir / 'orders.db'}", "table": "orders"}},
    }]
    if layout.ledger_failure_rate is not None:
        aeqs.append({
            "id": "orders-ledger", "parallel": True, "batch_size": 50, "batch_time_interval_ms": 50,
            "listener": {"type": "python", "class_path": "sluice.verify.ledger:LedgerListener",
                         "settings": {"path": str(workdir / "ledger.db"),
                                      "failure_rate": layout.ledger_failure_rate, "seed": layout.seed}},
        })
    sites = {
        "a": {
            "site": "a", "dsid": 1,
            "kafka": {**kafka, "bootstrap_servers": bootstrap["a"], "topic_prefix": f"{prefix}a."},
            "regions": [
                {"name": "orders", "buckets": 8, "gateway_senders": ["orders-to-b"], "async_event_queues": queues_a},
                {"name": "customers", "buckets": 4, "gateway_senders": ["customers-to-b"]},
            ],
            "gateway_senders": [
                {"id": "orders-to-b", "remote_dsid": 2, "parallel": True, "remote": remote("b"), **fast},
                {"id": "customers-to-b", "remote_dsid": 2, "parallel": False, "dispatcher_threads": 2,
                 "remote": remote("b"), **fast},
            ],
            "async_event_queues": aeqs,
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
    made = site_secrets(workdir)
    dsids = {"a": 1, "b": 2}
    for name, data in sites.items():
        mine = made[name]
        data["gateway_private_key_file"] = mine["gateway_private_key_file"]
        data["gateway_public_keys_file"] = {dsids[other]: made[other]["public_key_file"]
                                            for other in sites if other != name}
        data["region_service"] = {"token_file": mine["token_file"], "member_token_file": mine["member_token_file"]}
    for name, port in (region_ports or {}).items():
        sites[name]["region_service"]["port"] = port
    paths = {}
    for name, data in sites.items():
        paths[name] = workdir / f"site-{name}.yaml"
        paths[name].write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


@dataclass
class Service:
    """One service process of a site, and how to start it again.

    ``kind``: region, receiver, sender, dispatcher or subscriptions; ``name``: the sender or queue id (the
    kind for the others).  Every incarnation logs to a file of its own (``logs``), so a fault's victim and
    its successors can be told apart afterwards.
    """

    kind: str
    site: str
    name: str
    instance: int
    make: Callable[[Path], ServiceProcess]  # spawns, given the log path; does not wait for the banner
    log_dir: Path
    proc: ServiceProcess | None = None
    logs: list[Path] = field(default_factory=list)
    #: The current process was killed or stopped on purpose.
    ended_on_purpose: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}#{self.instance}@{self.site}" if self.kind in ("sender", "dispatcher") \
            else f"{self.kind}#{self.instance}@{self.site}"

    def spawn(self) -> ServiceProcess:
        log = self.log_dir / f"{self.kind}-{self.name}-{self.site}{self.instance}.{len(self.logs)}.log"
        self.logs.append(log)
        self.ended_on_purpose = False
        self.proc = self.make(log)
        return self.proc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None


class TwoSites:
    """Brokers, site configs and files, and every service process of the two sites."""

    def __init__(self, workdir: Path, layout: Layout | None = None) -> None:
        self.workdir = workdir
        self.layout = layout or Layout()
        self.brokers: dict[str, Any] = {}
        self.paths: dict[str, Path] = {}
        self.cfgs: dict[str, Any] = {}
        self.services: list[Service] = []
        self.ports: dict[str, int] = {}

    # --- starting ----------------------------------------------------------------------------

    def start_brokers(self, engine: str, *, separate_controllers: bool = False) -> None:
        """Each site's broker; ``separate_controllers`` for runs that kill or pause brokers (see EmbeddedKafka)."""
        from ..broker import start_broker

        for name in ("a", "b"):
            self.brokers[name] = start_broker(f"demo-{name}", 0, engine, data_dir=self.workdir / f"broker-{name}",
                                              separate_controller=separate_controllers)

    @property
    def tansu(self) -> bool:
        """Tansu describes consumer groups without their members, so region instances cannot find each other's
        buckets there, nor receivers the region service: one region instance per site, on a fixed port."""
        return any(b.engine == "tansu" for b in self.brokers.values())

    def configure(self) -> None:
        """Write the site files and create every topic."""
        from ..core.config import load_config
        from ..core.topics import apply_topics

        prefix = f"demo{uuid.uuid4().hex[:6]}."
        self.ports = {name: free_port() for name in ("a", "b")} if self.tansu else {}
        self.paths = site_files(self.workdir, {n: b.bootstrap for n, b in self.brokers.items()}, prefix,
                                self.layout, self.ports)
        for name, path in self.paths.items():
            self.cfgs[name] = load_config(path)
            apply_topics(self.cfgs[name])

    def plan(self) -> None:
        """The services, not yet started."""
        lay = self.layout
        p = self.paths
        instances = 1 if self.tansu else lay.region_instances

        def add(kind: str, site: str, name: str, count: int, make: Callable[[Path], ServiceProcess]) -> None:
            for i in range(count):
                self.services.append(Service(kind, site, name, i, make, self.workdir))

        # Each region instance keeps its port across restarts: writers hold the site's URLs.
        for site in ("a", "b"):
            for i in range(instances):
                port = self.ports[site] if self.tansu else free_port()
                self.services.append(Service("region", site, "region", i, lambda log, s=site, n=port: RegionProcess(
                    p[s], log, port=n, wait=False), self.workdir))
        for site in ("a", "b"):
            add("receiver", site, "receiver", lay.receivers, lambda log, s=site: ReceiverProcess(p[s], log, wait=False))
        add("sender", "a", "orders-to-b", lay.parallel_senders,
            lambda log: SenderProcess(p["a"], "orders-to-b", log, wait=False))
        add("sender", "a", "customers-to-b", lay.serial_senders,
            lambda log: SenderProcess(p["a"], "customers-to-b", log, parallel=False, wait=False))
        add("sender", "b", "orders-to-a", 1, lambda log: SenderProcess(p["b"], "orders-to-a", log, wait=False))
        add("dispatcher", "a", "orders-jdbc", lay.dispatchers,
            lambda log: DispatcherProcess(p["a"], "orders-jdbc", log, wait=False))
        if lay.ledger_failure_rate is not None:
            add("dispatcher", "a", "orders-ledger", lay.dispatchers,
                lambda log: DispatcherProcess(p["a"], "orders-ledger", log, wait=False))
        add("subscriptions", "b", "subscriptions", lay.subscriptions,
            lambda log: SubscriptionsProcess(p["b"], log, wait=False))

    def start_services(self, services: list[Service] | None = None, *,
                       progress: Callable[[str], None] = lambda _: None) -> None:
        """Spawn every service (side by side), then wait for each to run and for the region services to be ready.

        Region instances go first: the others find the region service through its group.
        """
        chosen = self.services if services is None else services
        regions = [s for s in chosen if s.kind == "region"]
        rest = [s for s in chosen if s.kind != "region"]
        for group in (regions, rest):
            for service in group:
                service.spawn()
            for service in group:
                progress(f"waiting for {service.label}…")
                assert service.proc is not None
                service.proc.wait_started()
            for service in group:
                if isinstance(service.proc, RegionProcess):
                    service.proc.wait_ready()

    # --- faults --------------------------------------------------------------------------------

    def kill(self, service: Service) -> float:
        """kill -9 the service's process; returns the wall-clock time of the kill."""
        assert service.proc is not None
        service.ended_on_purpose = True
        at = time.time()
        service.proc.kill()
        service.proc.stop(5)  # closes its pipes and log
        return at

    def start_again(self, service: Service) -> None:
        service.spawn()
        assert service.proc is not None
        service.proc.wait_started()
        if isinstance(service.proc, RegionProcess):
            service.proc.wait_ready()

    def stop_site(self, site: str) -> None:
        """SIGTERM every service of a site (each leaves its group and flushes), side by side."""
        victims = [s for s in self.services if s.site == site and s.alive]
        for s in victims:
            s.ended_on_purpose = True
        threads = [threading.Thread(target=s.proc.stop, args=(15,)) for s in victims if s.proc is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # --- looking up ------------------------------------------------------------------------------

    def of(self, kind: str, site: str | None = None, name: str | None = None) -> list[Service]:
        return [s for s in self.services if s.kind == kind and (site is None or s.site == site)
                and (name is None or s.name == name)]

    def urls(self, site: str) -> list[str]:
        return [s.proc.url for s in self.of("region", site) if isinstance(s.proc, RegionProcess) and s.proc.url]

    def token(self, site: str) -> str | None:
        """The site's region client token (what its writers and readers send), None when it has none."""
        token = self.cfgs[site].region_service.token
        return None if token is None else token.get_secret_value()

    def processes(self) -> Iterator[ServiceProcess]:
        for s in self.services:
            if s.proc is not None:
                yield s.proc

    def crashed(self) -> list[str]:
        """Services whose process ended by itself (not by a fault): a bug, reported with its exit status."""
        return [f"{s.label} (exit {s.proc.proc.poll()})" for s in self.services
                if s.proc is not None and not s.ended_on_purpose and s.proc.proc.poll() is not None]

    def dump_stacks(self) -> list[str]:
        """Have every running service print its threads' stacks to its log (SIGUSR1): after a failed run,
        the log of a service that stopped answering shows where it waits.  The labels of those that did."""
        return [s.label for s in self.services if s.proc is not None and s.proc.dump_stacks(settle_s=0.0)]

    def stop_services(self) -> None:
        """SIGTERM every service process, side by side, and wait for them (idempotent)."""
        procs = list(self.processes())
        threads = [threading.Thread(target=p.stop, args=(15,)) for p in reversed(procs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stop(self) -> None:
        self.stop_services()
        for broker in self.brokers.values():
            broker.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
