"""The client library, ``sluice.client``: ``RegionClient`` for the region service's HTTP API, and
``ClientCache``, the client side of subscriptions (``subscriber``; register-interest load rules and
repeat tracking: ``cache``; replay up to the marker: ``messages``).

What the client shares with a service lives in the core and is shown here as part of this API:
``RegionClient`` and ``RegionError`` (``sluice.core.regionclient``, which the gateway receiver uses
too), ``ALL_KEYS`` and ``ResultPolicy`` (``sluice.core.interest``, the interest the subscription
service matches)."""

from ..core.interest import ALL_KEYS, ResultPolicy
from ..core.regionclient import RegionClient, RegionError
from .subscriber import PENDING_NO_QUEUE, PENDING_QUEUE_DROPPED, ClientCache, ClientRegion, RegistrationRefused

__all__ = ["ALL_KEYS", "PENDING_NO_QUEUE", "PENDING_QUEUE_DROPPED", "ClientCache", "ClientRegion", "RegionClient",
           "RegionError", "RegistrationRefused", "ResultPolicy"]
