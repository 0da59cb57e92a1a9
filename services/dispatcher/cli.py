"""``sluice dispatcher -c FILE --queue ID``: one dispatcher of an async event queue."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from typing import Any

from ..core.servicecli import add_site_options, load_site, setup_logging
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
    add_site_options(p)
    p.add_argument("--queue", required=True, metavar="ID", help="async event queue id from the site file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        cfg = load_site(args)
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
