"""Client libraries: ``RegionClient`` for the region service's HTTP API; ``interest`` and ``cache``,
the client side of subscriptions (interest matching, register-interest load rules, repeat tracking,
replay up to the marker: ``messages``)."""

from .interest import ALL_KEYS, ResultPolicy
from .region import RegionClient, RegionError
from .subscriber import PENDING_NO_QUEUE, PENDING_QUEUE_DROPPED, ClientCache, ClientRegion, RegistrationRefused

__all__ = ["ALL_KEYS", "PENDING_NO_QUEUE", "PENDING_QUEUE_DROPPED", "ClientCache", "ClientRegion", "RegionClient",
           "RegionError", "RegistrationRefused", "ResultPolicy"]
