"""Client libraries: ``RegionClient`` for the region service's HTTP API; ``interest`` and ``cache``,
the client side of subscriptions (interest matching, register-interest load rules, repeat tracking,
replay up to the marker: ``messages``)."""

from .region import RegionClient, RegionError

__all__ = ["RegionClient", "RegionError"]
