"""What every service command shares: the site-file options, logging, the site file itself,
telemetry, and the health and metrics server (core/health.py)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

from . import telemetry
from .config import SiteConfig, load_config
from .errors import ConfigError, InvalidRequest, SluiceError
from .health import HealthServer


def add_service_parser(subparsers: Any, command: str, *, help: str, description: str,
                       example: str) -> argparse.ArgumentParser:
    """The parser of one service command: its help, its description, an example as its epilog
    (kept as written), and the site-file options every service takes."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        command, help=help, description=description, epilog=example,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_site_options(parser)
    return parser


def add_loop_service(subparsers: Any, command: str, build: Callable[[SiteConfig, argparse.Namespace], Any],
                     banner: Callable[[Any, SiteConfig, argparse.Namespace], str], **texts: str) -> argparse.ArgumentParser:
    """A loop service's command (``add_service_parser`` with ``texts``: help, description, example),
    run by ``run_loop_service``: ``build(cfg, args)`` makes the service, ``banner(service, cfg, args)``
    is the line that says it started.  The caller adds the command's own options to the parser."""
    parser = add_service_parser(subparsers, command, **texts)

    def run(args: argparse.Namespace) -> int:
        return run_loop_service(command, args, lambda cfg: build(cfg, args),
                                lambda service, cfg: banner(service, cfg, args))

    parser.set_defaults(func=run)
    return parser


def member_banner(kind: str) -> Callable[[Any, SiteConfig, argparse.Namespace], str]:
    """The started line of a service known by its member id: ``receiver ID of site a (dsid 1)``."""
    return lambda service, cfg, args: f"{kind} {service.member_id} of site {cfg.site} (dsid {cfg.dsid})"


def add_site_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="site configuration file (YAML or TOML)")
    parser.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    telemetry.add_options(parser)


def setup_logging(level: str, fmt: str = "text") -> None:
    telemetry.setup_logging(level, fmt)


#: The cyclic garbage collector's thresholds in a service process (Python's: 700, 10, 10).
GC_THRESHOLDS = (200_000, 50, 100)


def tune_gc() -> None:
    """Collect cyclic garbage far less often than Python does by default.

    A service allocates a few objects per event, nearly none of them in a
    cycle (reference counting frees them), while a region instance keeps
    several long-lived objects per entry.  With Python's thresholds a
    collection ran every 700 allocations and the older generations, which
    hold the region's entries, were scanned again and again: in runs of the
    gateway benchmark region B spent 24.4 µs of CPU per event with Python's
    thresholds, 14.4 with (50,000, 20, 100) and 12.3 with these.
    Young objects are still collected every 200,000 allocations (a pause of
    at most ~6 ms when all of them survive); the oldest generation when 100
    middle-generation collections have run and it has grown by a quarter
    (Python's own rule), so cyclic garbage that outlives two collections
    waits longer to be freed."""
    gc.set_threshold(*GC_THRESHOLDS)


def telemetry_options(command: str, args: argparse.Namespace) -> tuple[str, int | None] | None:
    """The log format and the health port from the flags and environment; None (after
    saying why on stderr) when either is malformed."""
    try:
        return telemetry.log_format(args.log_format), telemetry.metrics_port(args.metrics_port)
    except ValueError as exc:
        print(f"sluice {command}: {exc}", file=sys.stderr)
        return None


def install_telemetry(command: str, cfg: SiteConfig) -> None:
    """The process's meter and tracer providers, before the service is built (it
    asks whether spans are exported as it is built)."""
    telemetry.install(command, site=cfg.site, dsid=cfg.dsid)


def serve_health(command: str, service: Any, cfg: SiteConfig, port: int | None) -> HealthServer | None:
    """Serve /healthz, /readyz and /metrics on ``port`` (None: no server).  The chosen
    port is logged and printed on stdout as ``metrics on URL``, before the service's
    banner (ServiceProcess reads it).  Raises OSError when the port cannot be bound."""
    installed = telemetry.install(command, site=cfg.site, dsid=cfg.dsid)
    if port is None:
        return None
    host = os.environ.get(telemetry.METRICS_HOST_ENV) or "0.0.0.0"
    server = HealthServer(service, port, host, registry=installed.registry).start()
    print(f"metrics on {server.url}", flush=True)
    return server


def stop_telemetry(server: HealthServer | None) -> None:
    """At exit: stop the health server, flush the spans and metrics not yet exported."""
    if server is not None:
        server.stop()
    installed = telemetry.installed()
    if installed is not None:
        installed.shutdown()


def load_site(args: argparse.Namespace) -> SiteConfig:
    """The site file named by ``-c``, with ``--bootstrap`` applied; raises ConfigError."""
    cfg = load_config(args.config)
    if args.bootstrap:
        cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
    return cfg


def run_loop_service(command: str, args: argparse.Namespace, build: Callable[[SiteConfig], Any],
                     banner: Callable[[Any, SiteConfig], str]) -> int:
    """Start a loop service (``start()``, ``run()``, ``stop()``), announce it with one line on
    stdout, and run it until SIGTERM or Ctrl-C (``run_service``)."""
    return run_service(command, args, build, lambda service, cfg: _run_started(command, service, cfg, banner))


def run_service(command: str, args: argparse.Namespace, build: Callable[[SiteConfig], Any],
                serve: Callable[[Any, SiteConfig], int]) -> int:
    """A service command: logging and telemetry from the flags, the site file, the service
    ``build(cfg)`` makes, then ``serve(service, cfg)``'s exit status.  Exit status: 0 stopped,
    1 crashed or could not start, 2 bad configuration (or flags).

    /healthz, /readyz and /metrics are served (``serve_health``) from before
    ``start()``, so probes see a starting service as alive and not ready."""
    options = telemetry_options(command, args)
    if options is None:
        return 2
    fmt, port = options
    setup_logging(args.log_level, fmt)
    tune_gc()
    try:
        cfg = load_site(args)
        install_telemetry(command, cfg)
        service = build(cfg)
    except (ConfigError, InvalidRequest) as exc:
        print(f"sluice {command}: {exc}", file=sys.stderr)
        return 2
    except SluiceError as exc:
        print(f"sluice {command}: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        health = serve_health(command, service, cfg, port)
    except OSError as exc:
        print(f"sluice {command}: cannot serve /metrics on port {port}: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(service, cfg)
    finally:
        stop_telemetry(health)


def serve_http(command: str, service: Any, app: Any, sock: socket.socket, announce: Callable[[], None]) -> int:
    """Start ``service``, serve ``app`` on the bound ``sock`` (uvicorn, in this thread) and stop the
    service when the server ends: on SIGTERM or Ctrl-C, or once the service stops on its own (its
    crash sets its stop flag, core/lifecycle.py).  ``announce()`` prints its banner once it started.
    Exit status: 0 stopped, 1 could not start or crashed."""
    import uvicorn  # only the HTTP services need it

    # log_config=None: uvicorn's loggers go through the root handler, in text or JSON as the others.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5, log_config=None))

    def on_signal(signum: int, _frame: Any) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 PID` prints every thread's stack to stderr, for operators.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Our handlers route both signals to should_exit; uvicorn must not replace them in serve().
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]

    def watch_crash() -> None:
        service.stopping.wait()
        server.should_exit = True

    try:
        service.start()
    except SluiceError as exc:
        print(f"sluice {command}: cannot start: {exc}", file=sys.stderr)
        return 1
    announce()
    threading.Thread(target=watch_crash, name="crash-watch", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
    if service.state.value == "crashed":
        print(f"sluice {command}: crashed: {service.crash!r}", file=sys.stderr)
        return 1
    return 0


def _run_started(command: str, service: Any, cfg: SiteConfig, banner: Callable[[Any, SiteConfig], str]) -> int:
    try:
        service.start()
    except SluiceError as exc:
        print(f"sluice {command}: cannot start: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, _frame: Any) -> None:
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 PID` prints every thread's stack to stderr, for operators.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(banner(service, cfg), flush=True)
    try:
        service.run()
    except SluiceError as exc:
        print(f"sluice {command}: crashed: {exc}", file=sys.stderr)
        return 1
    return 1 if service.state.value == "crashed" else 0
