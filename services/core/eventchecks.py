"""The checks every event passes before a region applies it, wherever it comes from.

A client's write, an operation another instance forwards and an event
another site applied are checked by the same rules, so no path is more
trusting than the public API.  The gateway receiver runs ``remote_problem``
before it hands a batch to the region service, and the region service runs
it again on what it is handed: a refused event becomes a per-event exception
in the ack (dead-lettered at its origin) and never stops the events after it.

The rules:

* the region is configured here and the key fits it (not empty, at most
  ``key_max_bytes``); the value fits ``value_max_bytes`` and, encoded as
  JSON, is JSON that round-trips (no NaN or Infinity);
* an EventID's fields are bounded (``event_id_problem``): a member id of 1 to
  200 characters, a thread id and a sequence id within ``ID_MAX``, far below
  Avro's long, so that a sequence plus the entries of a put_all never wraps;
* an event from another site is an operation that crosses sites, did not
  come from this site, carries dsids in 1..255, and is not stamped later
  than now + ``region_service.max_clock_skew_ms``: a timestamp in the future
  would win every WAN conflict on its key until that time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from . import jsonvalue
from .errors import EntryTooLarge, InvalidRequest, UnknownRegion
from .events import EntryEvent, EventID, goes_to_gateway

if TYPE_CHECKING:
    from .config import SiteConfig

#: The largest thread or sequence id accepted: 2^53 - 1, exact in JSON and far from Avro's 2^63 - 1.
ID_MAX = 2**53 - 1
MEMBER_ID_MAX_CHARS = 200
DSID_RANGE = range(1, 256)


def event_id_problem(event_id: EventID, field: str = "event_id") -> InvalidRequest | None:
    """Why an EventID is refused, or None."""
    member = event_id.member_id
    if not isinstance(member, str) or not 1 <= len(member) <= MEMBER_ID_MAX_CHARS:
        return InvalidRequest(f"{field}.member_id", member, f"must be 1 to {MEMBER_ID_MAX_CHARS} characters")
    for name in ("thread_id", "sequence_id"):
        value = getattr(event_id, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= ID_MAX:
            return InvalidRequest(f"{field}.{name}", value, f"must be a whole number from 0 to {ID_MAX}")
    return None


def key_problem(cfg: SiteConfig, region: str, key: Any, field: str = "key") -> InvalidRequest | None:
    """Why a key is refused in ``region`` (unknown region included), or None."""
    try:
        limit = cfg.region(region).key_max_bytes
    except UnknownRegion as exc:
        return exc
    if not isinstance(key, str) or key == "":
        return InvalidRequest(field, key, "must be a non-empty string")
    n = len(key.encode("utf-8", "surrogatepass"))
    if n > limit:
        return EntryTooLarge(field, key, f"{n} bytes, larger than key_max_bytes={limit}")
    return None


def value_problem(cfg: SiteConfig, region: str, value: bytes | None, encoding: str,
                  field: str = "value") -> InvalidRequest | None:
    """Why a stored value is refused in ``region``, or None (None itself: no value, always fine)."""
    if value is None:
        return None
    limit = cfg.region(region).value_max_bytes
    if len(value) > limit:
        return EntryTooLarge(field, f"{len(value)} bytes", f"larger than value_max_bytes={limit}")
    if encoding == "json":
        try:
            parsed = jsonvalue.loads(value)
        except ValueError as exc:
            return InvalidRequest(field, value[:80].decode("utf-8", "replace"), f"not JSON: {exc}")
        if _has_non_finite(parsed):
            return InvalidRequest(field, value[:80].decode("utf-8", "replace"),
                                  "holds NaN or Infinity, which JSON cannot hold")
    return None


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


def remote_problem(cfg: SiteConfig, event: EntryEvent, now_ms: int, field: str = "event") -> InvalidRequest | None:
    """Why this site refuses an event another site applied, or None."""
    problem = key_problem(cfg, event.region, event.key, f"{field}.key")
    if problem is not None:
        return problem
    if not goes_to_gateway(event.operation):
        return InvalidRequest(f"{field}.operation", event.operation.value,
                              "only create, update and destroy cross sites")
    if event.origin_dsid == cfg.dsid or event.version.dsid == cfg.dsid:
        return InvalidRequest(f"{field}.origin_dsid", event.origin_dsid,
                              f"an event of this site (dsid {cfg.dsid}) cannot come back to it")
    for name, dsid in (("origin_dsid", event.origin_dsid), ("version.dsid", event.version.dsid)):
        if dsid not in DSID_RANGE:
            return InvalidRequest(f"{field}.{name}", dsid, "must be a dsid from 1 to 255")
    skew_ms = cfg.region_service.max_clock_skew_ms
    if event.version.timestamp > now_ms + skew_ms:
        return InvalidRequest(f"{field}.version.timestamp", event.version.timestamp,
                              f"{event.version.timestamp - now_ms} ms in the future, beyond max_clock_skew_ms="
                              f"{skew_ms}: it would win every conflict on its key")
    if not 0 <= event.version.entry_version <= ID_MAX or event.version.timestamp < 0:
        return InvalidRequest(f"{field}.version", event.version.to_record(), "entry version or timestamp out of range")
    problem = event_id_problem(event.event_id, f"{field}.event_id")
    if problem is not None:
        return problem
    return value_problem(cfg, event.region, event.value, event.value_encoding, f"{field}.value")


__all__ = ["ID_MAX", "event_id_problem", "key_problem", "remote_problem", "value_problem"]
