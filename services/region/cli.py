"""``sluice region -c FILE``: run one region-service instance in the foreground."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import socket
import sys
import threading
from typing import Any

import uvicorn

from ..core.config import SiteConfig
from ..core.servicecli import (
    add_service_parser,
    install_telemetry,
    load_site,
    serve_health,
    setup_logging,
    stop_telemetry,
    telemetry_options,
    tune_gc,
)
from ..core.errors import ConfigError, SluiceError
from .http import create_app
from .service import RegionService, ServiceState

EXAMPLE = """\
example:
  sluice region -c deploy/sites/site-a.yaml --port 7071
  curl -s -XPOST localhost:7071/regions/orders/put -H 'content-type: application/json' \
       -d '{"key": "o-1", "value": {"qty": 3}}'
  curl -s localhost:7071/regions/orders/entries/o-1
  curl -s localhost:7071/buckets            # who owns which bucket
  open http://localhost:7071/docs           # the API, from its OpenAPI document

Start a second instance (another --port) and the buckets are shared between
them through Kafka's consumer group; a request to either is served.

With a local store, a restarted instance reads only what its buckets'
changelogs gained while it was away (one directory per instance):
  sluice region -c deploy/sites/site-a.yaml --port 7072 --store-dir /var/lib/sluice/a-1

Beyond loopback (--host 0.0.0.0, a pod IP) an instance starts only with
region_service.token and member_token set (or allow_unauthenticated: true);
clients then send `Authorization: Bearer <token>`.
"""


def add_parser(subparsers: Any) -> None:
    p = add_service_parser(
        subparsers, "region",
        help="run a region-service instance (bucket owner + HTTP API)",
        description="Run one region-service instance: owns buckets through the consumer group, applies "
        "operations in order, writes the region changelog and every attached queue.",
        example=EXAMPLE,
    )
    p.add_argument("--host", help="address to listen on (default: region_service.host)")
    p.add_argument("--port", type=int, help="port to listen on, 0 for any (default: region_service.port)")
    p.add_argument("--store-dir", help="this instance's local store of bucket state (default: "
                   "region_service.store_dir; none: state on the heap only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = telemetry_options("region", args)
    if options is None:
        return 2
    fmt, metrics_port = options
    setup_logging(args.log_level, fmt)
    tune_gc()
    try:
        cfg = load_site(args)
    except ConfigError as exc:
        print(f"sluice region: {exc}", file=sys.stderr)
        return 2
    install_telemetry("region", cfg)
    service = RegionService(cfg, host=args.host, port=args.port, store_dir=args.store_dir)
    try:
        sock = service.bind()
    except OSError as exc:
        print(f"sluice region: cannot listen on {service.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"sluice region: {exc}", file=sys.stderr)
        return 2
    try:
        health = serve_health("region", service, cfg, metrics_port)
    except OSError as exc:
        print(f"sluice region: cannot serve /metrics on port {metrics_port}: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(service, sock, cfg)
    finally:
        stop_telemetry(health)


def _serve(service: RegionService, sock: socket.socket, cfg: SiteConfig) -> int:
    # log_config=None: uvicorn's loggers go through the root handler, in text or JSON as the others.
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=5, log_config=None))

    def on_signal(signum: int, _frame: Any) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 PID` prints every thread's stack to stderr, for operators.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # uvicorn installs its own handlers in serve(); ours stay because we run
    # the server in this thread with signals already routed to should_exit.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]

    def watch_crash() -> None:
        # A crash sets the service's stop flag (core/lifecycle.py), as a stop does: either ends the server.
        service.stopping.wait()
        server.should_exit = True

    try:
        service.start()
    except SluiceError as exc:
        print(f"sluice region: cannot start: {exc}", file=sys.stderr)
        return 1
    print(f"region service {service.instance_id} on {service.url} (site {cfg.site}, dsid {cfg.dsid})", flush=True)
    threading.Thread(target=watch_crash, name="crash-watch", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
    if service.state is ServiceState.CRASHED:
        print(f"sluice region: crashed: {service.crash!r}", file=sys.stderr)
        return 1
    return 0
