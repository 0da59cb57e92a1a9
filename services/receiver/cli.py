"""``sluice receiver -c FILE``: one gateway-receiver instance of a site."""

from __future__ import annotations

import argparse
from typing import Any

from ..core.servicecli import add_service_parser, run_loop_service
from .service import ReceiverService

EXAMPLE = """\
example:
  sluice receiver -c deploy/sites/site-b.yaml

Applies the batches remote sites' gateway senders write into this site's
inbound topic (only from receiver.accepted_dsids), through the local region
service, and acknowledges each.  Run several: they share the inbound
topic's partitions through a consumer group.
"""


def add_parser(subparsers: Any) -> None:
    p = add_service_parser(
        subparsers, "receiver",
        help="run a gateway receiver (applies batches from remote sites)",
        description="Apply gateway batches from remote sites through the local region service and acknowledge "
        "them: duplicates discarded, WAN conflicts resolved, per-event exceptions reported.",
        example=EXAMPLE,
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_loop_service(
        "receiver", args, ReceiverService,
        lambda service, cfg: f"receiver {service.member_id} of site {cfg.site} (dsid {cfg.dsid})",
    )
