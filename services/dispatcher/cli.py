"""``sluice dispatcher -c FILE --queue ID``: one dispatcher of an async event queue."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from typing import Any

from ..core.config import load_config
from ..core.errors import ConfigError, SluiceError
from .service import DispatcherService, ServiceState

EXAMPLE = """\
example:
  sluice dispatcher -c deploy/sites/site-a.yaml --queue orders-jdbc
  sluice admin -c deploy/sites/site-a.yaml status orders-jdbc

Run it twice: both join the queue's consumer group, each partition has one
primary, and the other takes over when a primary dies.
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "dispatcher",
        help="run a dispatcher of an async event queue (batches to its listener)",
        description="Deliver the events of an async event queue in batches to its listener; a batch leaves "
        "the queue only when the listener accepts it.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-c", "--config", required=True, help="site configuration file (YAML or TOML)")
    p.add_argument("--queue", required=True, metavar="ID", help="async event queue id from the site file")
    p.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config)
        if args.bootstrap:
            cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
        service = DispatcherService(cfg, args.queue)
        service.start()
    except ConfigError as exc:
        print(f"sluice dispatcher: {exc}", file=sys.stderr)
        return 2
    except SluiceError as exc:
        print(f"sluice dispatcher: cannot start: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, _frame: Any) -> None:
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(f"dispatcher {service.member_id} of queue {args.queue} (site {cfg.site})", flush=True)
    try:
        service.run()
    except SluiceError as exc:
        print(f"sluice dispatcher: crashed: {exc}", file=sys.stderr)
        return 1
    return 1 if service.state is ServiceState.CRASHED else 0
