"""``sluice subscriptions -c FILE``: one subscription-service instance of a site."""

from __future__ import annotations

from typing import Any

from ..core.servicecli import add_loop_service, member_banner
from .service import SubscriptionService

EXAMPLE = """\
example:
  sluice subscriptions -c deploy/sites/site-b.yaml

Fills each subscribed client's queue with the region events that match its
interest (values or invalidates), keeps durable clients' queues while they
are away (until their durable-client-timeout), and places the marker when a
client is ready for events.  Run two or more: the instances share the
clients through a consumer group, and a standby takes over a primary's
clients when it dies.  `sluice admin -c FILE status` lists the clients.
"""


def add_parser(subparsers: Any) -> None:
    add_loop_service(subparsers, "subscriptions", lambda cfg, args: SubscriptionService(cfg), member_banner("subscriptions"),
                     example=EXAMPLE,
                     help="run a subscription-service instance (client interest, durable and HA client queues)",
                     description="Feed subscribed clients: per-client queues in Kafka filled from the region "
                     "changelogs by interest, durable clients kept across disconnects, failover between instances.")

