"""``sluice parallel-sender`` / ``sluice serial-sender -c FILE --sender ID``."""

from __future__ import annotations

import argparse
from typing import Any

from ..core.config import SiteConfig
from ..core.errors import InvalidRequest
from ..core.servicecli import add_loop_service
from .service import GatewaySenderService

EXAMPLE = """\
example:
  sluice {command} -c deploy/sites/site-a.yaml --sender {sender}
  sluice admin -c deploy/sites/site-a.yaml status {sender}

Run it on several machines: they share the queue's partitions through its
consumer group ({what}); a secondary takes over when a primary dies.
"""


def add_parser(subparsers: Any) -> None:
    for command, parallel, sender, what in (
        ("parallel-sender", True, "orders-to-site-b", "one primary per bucket"),
        ("serial-sender", False, "customers-to-site-b", "one primary per dispatcher thread's partition"),
    ):
        p = add_loop_service(
            subparsers, command, _build, _banner, example=EXAMPLE.format(command=command, sender=sender, what=what),
            help=f"run a {'parallel' if parallel else 'serial'} gateway sender (batches to a remote site)",
            description="Send a gateway sender's queue in batches to the remote site's receiver, through Kafka, "
            "and remove each batch once the remote site acknowledged it.",
        )
        p.add_argument("--sender", required=True, metavar="ID", help="gateway sender id from the site file")
        p.set_defaults(parallel=parallel)


def _build(cfg: SiteConfig, args: argparse.Namespace) -> GatewaySenderService:
    sender = cfg.sender(args.sender)
    if sender.parallel is not args.parallel:
        kind = "parallel" if sender.parallel else "serial"
        raise InvalidRequest("--sender", args.sender, f"is a {kind} sender: run it with `sluice {kind}-sender`")
    return GatewaySenderService(cfg, args.sender)


def _banner(service: GatewaySenderService, cfg: SiteConfig, args: argparse.Namespace) -> str:
    return (f"sender {service.member_id} of gateway sender {args.sender} to dsid {service.remote_dsid} "
            f"(site {cfg.site})")
