"""``sluice dispatcher -c FILE --queue ID``: one dispatcher of an async event queue."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

from ..core.config import SiteConfig
from ..core.servicecli import add_loop_service
from .service import DispatcherService

EXAMPLE = """\
example:
  sluice dispatcher -c deploy/sites/site-a.yaml --queue orders-jdbc
  sluice admin -c deploy/sites/site-a.yaml status orders-jdbc

Run it twice: both join the queue's consumer group, each partition has one
primary, and the other takes over when a primary dies.
"""


def add_parser(subparsers: Any) -> None:
    p = add_loop_service(subparsers, "dispatcher", _build, _banner, example=EXAMPLE,
                         help="run a dispatcher of an async event queue (batches to its listener)",
                         description="Deliver the events of an async event queue in batches to its listener; a "
                         "batch leaves the queue only when the listener accepts it.")
    p.add_argument("--queue", required=True, metavar="ID", help="async event queue id from the site file")


#: Young objects between two collections of the youngest generation (Python's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def _banner(service: DispatcherService, cfg: SiteConfig, args: argparse.Namespace) -> str:
    return f"dispatcher {service.member_id} of queue {args.queue} (site {cfg.site})"


def _build(cfg: SiteConfig, args: argparse.Namespace) -> DispatcherService:
    service = DispatcherService(cfg, args.queue, site_dir=str(Path(args.config).resolve().parent))
    # A dispatcher makes an object per event and holds thousands at a time.  With
    # Python's default thresholds the collector ran every ~700 events and its full
    # passes walked every object the imports made (the listener's modules too,
    # imported by now): 0.7 µs of CPU per event, a quarter of the process's.  Those
    # objects live as long as the process, so they are moved out of the collector's
    # sight, and the youngest generation is collected less often: 0.1 µs.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    return service
