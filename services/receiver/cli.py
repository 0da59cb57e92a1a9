"""``sluice receiver -c FILE``: one gateway-receiver instance of a site."""

from __future__ import annotations

from typing import Any

from ..core.servicecli import add_loop_service, member_banner
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
    add_loop_service(subparsers, "receiver", lambda cfg, args: ReceiverService(cfg), member_banner("receiver"),
                     example=EXAMPLE,
                     help="run a gateway receiver (applies batches from remote sites)",
                     description="Apply gateway batches from remote sites through the local region service and "
                     "acknowledge them: duplicates discarded, WAN conflicts resolved, per-event exceptions reported.")

