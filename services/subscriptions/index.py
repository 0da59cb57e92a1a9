"""The interest index: which of a primary's clients an event on a region's key reaches, and how.

Every subscription instance reads every changelog record.  Asking each of its clients' interest in
turn cost 0.5–1 µs per client per event, most of them not interested (issue 18); the index turns
the question around.  Per region it holds:

* each key some client listed → those clients;
* the clients of ``ALL_KEYS``;
* the regexes of every client as one RE2 set, matched once per key (``match_which``), each
  pattern → the clients that registered it;
* every client with any interest in the region: a region clear or destroy reaches them all.

Each client in those maps carries whether it receives values (True) or invalidates (False) there.
An event's clients are the union of its key's, the ALL_KEYS clients and its matching patterns'; a
client reached by a registration of values and one of invalidates gets values, as
``RegionInterest.delivery`` decides for one client.

The service keeps the index equal to the interest in force of its clients (``_Client.interest``):
``put`` whenever that changes (a client taken over or registered, a registration answered, a
durable client away keeping only its durable interest, or back with all of it) and ``remove`` when
the client goes (unregistered, a registry tombstone, its partition handed over).  What is not
interest stays in the service's routing: where the client's queue starts, a client's own writes,
the registry partitions this instance fills, the one delivery per bucket of a region clear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..core.interest import RegionInterest, match_which

#: What a region or key no client is interested in maps to (never changed).
_NONE: Mapping[str, bool] = {}


@dataclass(slots=True)
class _Region:
    """One region's part of the index."""

    keys: dict[str, dict[str, bool]] = field(default_factory=dict)
    all_keys: dict[str, bool] = field(default_factory=dict)
    regexes: dict[str, dict[str, bool]] = field(default_factory=dict)
    clients: dict[str, None] = field(default_factory=dict)
    #: The patterns of ``regexes`` in the order the set knows them, and the set (made on first use
    #: after they change).
    patterns: list[str] = field(default_factory=list)
    matches: Callable[[str], Iterable[int]] | None = None

    def match(self, key: str) -> Iterable[int]:
        if self.matches is None:
            self.patterns = list(self.regexes)
            self.matches = match_which(self.patterns)
        return self.matches(key)

    def empty(self) -> bool:
        return not self.clients


@dataclass(slots=True)
class _Share:
    """What one client put into one region's part: its keys, ALL_KEYS and regexes, each with values or not."""

    keys: dict[str, bool]
    all_keys: bool | None
    regexes: dict[str, bool]


class InterestIndex:
    """Key → interested clients, per region, over the interest of many clients (module docstring)."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._shares: dict[str, dict[str, _Share]] = {}  # client id -> region -> its share

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._shares

    def __len__(self) -> int:
        return len(self._shares)

    def put(self, client_id: str, interest: Mapping[str, RegionInterest]) -> None:
        """``client_id``'s interest is now ``interest`` (per region), whatever it was before."""
        self.remove(client_id)
        shares: dict[str, _Share] = {}
        for region_name, region_interest in interest.items():
            share = _share_of(region_interest)
            if share is None:
                continue
            region = self._regions.setdefault(region_name, _Region())
            region.clients[client_id] = None
            for key, values in share.keys.items():
                region.keys.setdefault(key, {})[client_id] = values
            if share.all_keys is not None:
                region.all_keys[client_id] = share.all_keys
            for pattern, values in share.regexes.items():
                if pattern not in region.regexes:
                    region.regexes[pattern] = {}
                    region.matches = None
                region.regexes[pattern][client_id] = values
            shares[region_name] = share
        self._shares[client_id] = shares

    def remove(self, client_id: str) -> None:
        """``client_id`` has no interest any more (nothing happens if it had none)."""
        for region_name, share in self._shares.pop(client_id, {}).items():
            region = self._regions[region_name]
            region.clients.pop(client_id, None)
            for key in share.keys:
                clients = region.keys[key]
                del clients[client_id]
                if not clients:
                    del region.keys[key]
            region.all_keys.pop(client_id, None)
            for pattern in share.regexes:
                clients = region.regexes[pattern]
                del clients[client_id]
                if not clients:
                    del region.regexes[pattern]
                    region.matches = None
            if region.empty():
                del self._regions[region_name]

    def clients_of(self, region_name: str, key: str) -> Mapping[str, bool]:
        """The clients an event on ``key`` reaches → whether each receives values (else an invalidate).
        The mapping may be the index's own: read it, never change it."""
        region = self._regions.get(region_name)
        if region is None:
            return _NONE
        listed = region.keys.get(key)
        if not region.all_keys and not region.regexes:
            return listed or _NONE
        found = dict(listed) if listed else {}
        for client_id, values in region.all_keys.items():
            found[client_id] = values or found.get(client_id, False)
        if region.regexes:
            patterns = region.regexes
            for i in region.match(key):
                for client_id, values in patterns[region.patterns[i]].items():
                    found[client_id] = values or found.get(client_id, False)
        return found

    def clients_in(self, region_name: str) -> Iterable[str]:
        """Every client with interest in the region: a region clear or destroy reaches them all."""
        region = self._regions.get(region_name)
        return () if region is None else region.clients


def _share_of(interest: RegionInterest) -> _Share | None:
    """One client's interest in one region, merged over its kinds of registration (values win)."""
    if interest.empty():
        return None
    keys: dict[str, bool] = {}
    all_keys: bool | None = None
    regexes: dict[str, bool] = {}
    for values, kind_keys, kind_all, kind_regexes in interest.parts():
        for key in kind_keys:
            keys[key] = values or keys.get(key, False)
        if kind_all:
            all_keys = values or bool(all_keys)
        for pattern in kind_regexes:
            regexes[pattern] = values or regexes.get(pattern, False)
    return _Share(keys, all_keys, regexes)


__all__ = ["InterestIndex"]
