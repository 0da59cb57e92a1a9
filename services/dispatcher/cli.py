"""``sluice dispatcher -c FILE --queue ID``: one dispatcher of an async event queue."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..core.servicecli import add_site_options, run_loop_service
from .service import DispatcherService

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
    return run_loop_service(
        "dispatcher", args,
        lambda cfg: DispatcherService(cfg, args.queue, site_dir=str(Path(args.config).resolve().parent)),
        lambda service, cfg: f"dispatcher {service.member_id} of queue {args.queue} (site {cfg.site})",
    )
