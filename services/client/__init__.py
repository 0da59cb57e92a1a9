"""Client libraries: ``RegionClient`` for the region service's HTTP API."""

from .region import RegionClient, RegionError

__all__ = ["RegionClient", "RegionError"]
