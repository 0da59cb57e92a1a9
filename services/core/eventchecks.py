"""The checks every event passes before a region applies it, wherever it comes from.

A client's write, an operation another instance forwards and an event
another site applied are checked by the same rules, so no path is more
trusting than the public API.  The gateway receiver runs ``remote_problem``
before it hands a batch to the region service, and the region service runs
it again on what it is handed: a refused event becomes a per-event exception
in the ack (dead-lettered at its origin) and never stops the events after it.

The rules:

* the region is configured here and the key fits it (not empty, at most
  ``key_max_bytes``); the value fits ``value_max_bytes`` and is JSON (a
  region stores JSON values: no other encoding, no NaN or Infinity);
* an EventID's fields are bounded (``event_id_problem``): a member id of 1 to
  200 characters, a thread id and a sequence id within ``ID_MAX``, far below
  Avro's long, and a put_all or remove_all of n entries (sequences
  ``sequence_id .. sequence_id + n - 1``) ends within it too, so no sequence
  ever wraps or pins a stream at Avro's largest long;
* an event from another site is an operation that crosses sites, did not
  come from this site, carries dsids in 1..255 (its visited sites too), and
  is not stamped later than now + ``region_service.max_clock_skew_ms``: a
  timestamp in the future would win every WAN conflict on its key until
  that time.

What these rules cannot see is whose EventID an event carries: a caller may
send another member's (member, thread).  The region service bounds how far
ahead of a stream's highest sequence a local write may jump
(``region/state.py``); the rest is the credential's business.
"""

from __future__ import annotations

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


def is_unicode(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: JSON's "\\ud800" escapes give Python strings that do not,
    and every text that reaches a record must."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(text: str) -> str:
    return text[:80].encode("utf-8", "backslashreplace").decode("utf-8")


def event_id_problem(event_id: EventID, field: str = "event_id", count: int = 1) -> InvalidRequest | None:
    """Why an EventID is refused, or None.  ``count``: the sequences it stands for (a
    put_all or remove_all of n entries takes ``sequence_id`` to ``sequence_id + n - 1``)."""
    member = event_id.member_id
    if not isinstance(member, str) or not 1 <= len(member) <= MEMBER_ID_MAX_CHARS:
        return InvalidRequest(f"{field}.member_id", member, f"must be 1 to {MEMBER_ID_MAX_CHARS} characters")
    if not is_unicode(member):
        return InvalidRequest(f"{field}.member_id", _shown(member), "must be valid Unicode (it holds a lone surrogate)")
    thread, sequence = event_id.thread_id, event_id.sequence_id
    if type(thread) is not int or not 0 <= thread <= ID_MAX:
        return _id_problem(field, "thread_id", thread)
    if type(sequence) is not int or not 0 <= sequence <= ID_MAX:
        return _id_problem(field, "sequence_id", sequence)
    if count > 1 and sequence + count - 1 > ID_MAX:
        return InvalidRequest(f"{field}.sequence_id", sequence,
                              f"with {count} entries the last sequence would be {sequence + count - 1}, "
                              f"beyond {ID_MAX}")
    return None


def _id_problem(field: str, name: str, value: Any) -> InvalidRequest | None:
    """A thread or sequence id that is not an int from 0 to ID_MAX; an int subclass other than bool
    (which no JSON or Avro reader makes) is judged by its value."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= ID_MAX:
        return None
    return InvalidRequest(f"{field}.{name}", value, f"must be a whole number from 0 to {ID_MAX}")


def key_problem(cfg: SiteConfig, region: str, key: Any, field: str = "key") -> InvalidRequest | None:
    """Why a key is refused in ``region`` (unknown region included), or None."""
    try:
        limit = cfg.region(region).key_max_bytes
    except UnknownRegion as exc:
        return exc
    return _key_problem(limit, key, field, "")


def _key_problem(limit: int, key: Any, field: str, suffix: str) -> InvalidRequest | None:
    """``key_problem`` within a region whose key_max_bytes is ``limit``; the field named
    ``field + suffix`` (joined only when there is a problem to name)."""
    if not isinstance(key, str) or key == "":
        return InvalidRequest(field + suffix, key, "must be a non-empty string")
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return InvalidRequest(field + suffix, _shown(key), "must be valid Unicode (it holds a lone surrogate)")
    if n > limit:
        return EntryTooLarge(field + suffix, key, f"{n} bytes, larger than key_max_bytes={limit}")
    return None


def value_problem(cfg: SiteConfig, region: str, value: bytes | None, encoding: str,
                  field: str = "value") -> InvalidRequest | None:
    """Why a stored value is refused in ``region``, or None (None itself: no value, always fine)."""
    if value is None:
        return None
    try:
        limit = cfg.region(region).value_max_bytes
    except UnknownRegion as exc:
        return exc
    return _value_problem(limit, value, encoding, field, "")


def _value_problem(limit: int, value: bytes | None, encoding: str, field: str, suffix: str) -> InvalidRequest | None:
    """``value_problem`` within a region whose value_max_bytes is ``limit`` (``_key_problem``'s
    ``field + suffix``)."""
    if value is None:
        return None
    if not isinstance(value, (bytes, bytearray)):
        return InvalidRequest(field + suffix, str(value)[:80], "must be the value's JSON text")
    if len(value) > limit:
        return EntryTooLarge(field + suffix, f"{len(value)} bytes", f"larger than value_max_bytes={limit}")
    if encoding != "json":
        return InvalidRequest(f"{field}{suffix}_encoding", encoding,
                              "a region stores JSON values: the encoding must be json")
    try:
        # jsonvalue refuses NaN, Infinity and numbers beyond a double, which JSON cannot hold.
        jsonvalue.check(value)
    except ValueError as exc:
        return InvalidRequest(field + suffix, bytes(value[:80]).decode("utf-8", "replace"), f"not JSON: {exc}")
    return None


def remote_problem(cfg: SiteConfig, event: EntryEvent, now_ms: int, field: str = "event") -> InvalidRequest | None:
    """Why this site refuses an event another site applied, or None."""
    try:
        region = cfg.region(event.region)
    except UnknownRegion as exc:
        return exc
    problem = _key_problem(region.key_max_bytes, event.key, field, ".key")
    if problem is not None:
        return problem
    if not goes_to_gateway(event.operation):
        return InvalidRequest(f"{field}.operation", event.operation.value,
                              "only create, update and destroy cross sites")
    version = event.version
    origin, version_dsid = event.origin_dsid, version.dsid
    if origin == cfg.dsid or version_dsid == cfg.dsid:
        return InvalidRequest(f"{field}.origin_dsid", origin,
                              f"an event of this site (dsid {cfg.dsid}) cannot come back to it")
    for name, dsid in (("origin_dsid", origin), ("version.dsid", version_dsid)):
        if dsid not in DSID_RANGE:
            return InvalidRequest(f"{field}.{name}", dsid, "must be a dsid from 1 to 255")
    for i, dsid in enumerate(event.visited_dsids):
        if dsid not in DSID_RANGE:
            return InvalidRequest(f"{field}.visited_dsids[{i}]", dsid, "must be a dsid from 1 to 255")
    if len(version.member_id) > MEMBER_ID_MAX_CHARS:
        return InvalidRequest(f"{field}.version.member_id", version.member_id,
                              f"must be at most {MEMBER_ID_MAX_CHARS} characters")
    skew_ms = cfg.region_service.max_clock_skew_ms
    if version.timestamp > now_ms + skew_ms:
        return InvalidRequest(f"{field}.version.timestamp", version.timestamp,
                              f"{version.timestamp - now_ms} ms in the future, beyond max_clock_skew_ms="
                              f"{skew_ms}: it would win every conflict on its key")
    if not 0 <= version.entry_version <= ID_MAX or version.timestamp < 0:
        return InvalidRequest(f"{field}.version", version.to_record(), "entry version or timestamp out of range")
    problem = event_id_problem(event.event_id, f"{field}.event_id")
    if problem is not None:
        return problem
    return _value_problem(region.value_max_bytes, event.value, event.value_encoding, field, ".value")


__all__ = ["ID_MAX", "event_id_problem", "is_unicode", "key_problem", "remote_problem", "value_problem"]
