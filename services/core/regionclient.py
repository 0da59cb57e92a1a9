"""``RegionClient``: the region service's Python client (public as ``sluice.client.RegionClient``).

The client library and the gateway receiver both speak to the region service
over HTTP, so its client lives in the core: applications use ``RegionClient``
(and ``RegionError``) through ``sluice.client``; the receiver uses ``BatchClient``.

Every write gets an EventID where it enters the system: this client's member
id, the calling thread's id, and a sequence that increases per operation of
that thread (a put_all of n entries takes n).  A retry keeps the EventID, so
the owner applies the operation once however often it is sent; the answer
to a repeat is ``status == "duplicate"``.

Retries (tenacity) cover what may succeed later: a connection refused or
reset, a timeout, and any answer the service marks ``retriable`` (503: the
bucket is moving between owners, or Kafka did not acknowledge in time).  The
client rotates through every URL it was given, so a dead instance is skipped.

``token`` is the credential sent as ``Authorization: Bearer``: the site's
``region_service.token`` for the region API, its ``member_token`` for
``apply_remote``.  Every request that changes something is sent as JSON
(``{}`` at least), which the service requires.

``BatchClient`` is the gateway receiver's: it hands a ``GatewayBatch`` record,
as bytes, to the one instance that owns its events' buckets
(``POST /internal/apply_batch``, member token), once per call; the receiver
decides what to retry and where.

Example::

    from sluice.client import RegionClient

    with RegionClient(["http://127.0.0.1:7071", "http://127.0.0.1:7072"]) as c:
        c.put("orders", "o-1", {"qty": 3})
        c.get("orders", "o-1")          # {'qty': 3}
        c.put_all("orders", {"o-2": 1, "o-3": 2})
        c.destroy("orders", "o-1")
"""

from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import httpx
import orjson
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from .errors import RegionError, RegionUnavailable, SluiceError
from .events import EntryEvent, EventID
from .remotewire import encode_remote

#: The content type of a GatewayBatch record posted to /internal/apply_batch.
BATCH_CONTENT_TYPE = "application/avro"


class RegionClient:
    """Thread-safe client of one site's region service (any of its instances)."""

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        token: str | None = None,
        member_id: str | None = None,
        timeout_s: float = 30.0,
        retry_for_s: float = 60.0,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("RegionClient needs at least one URL")
        self.member_id = member_id or f"client-{uuid.uuid4().hex[:12]}"
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(timeout=timeout_s, headers=headers)
        self._retry_for_s = retry_for_s
        self._rotation = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._thread_ids = itertools.count(1)
        self.retries = 0

    # --- EventIDs -------------------------------------------------------------

    def next_event_id(self, count: int = 1) -> EventID:
        """The calling thread's next EventID (reserving ``count`` sequences)."""
        local = self._local
        if not hasattr(local, "thread_id"):
            with self._lock:
                local.thread_id = next(self._thread_ids)
            local.sequence = 0
        eid = EventID(self.member_id, local.thread_id, local.sequence)
        local.sequence += count
        return eid

    # --- operations --------------------------------------------------------------

    def create(self, region: str, key: str, value: Any, *, callback_argument: str | None = None,
               event_id: EventID | None = None) -> dict[str, Any]:
        return self._write(region, "create", {"key": key, "value": value, "callback_argument": callback_argument},
                           event_id)

    def put(self, region: str, key: str, value: Any, *, callback_argument: str | None = None,
            event_id: EventID | None = None) -> dict[str, Any]:
        return self._write(region, "put", {"key": key, "value": value, "callback_argument": callback_argument},
                           event_id)

    def destroy(self, region: str, key: str, *, event_id: EventID | None = None) -> dict[str, Any]:
        return self._write(region, "destroy", {"key": key}, event_id)

    def invalidate(self, region: str, key: str, *, event_id: EventID | None = None) -> dict[str, Any]:
        return self._write(region, "invalidate", {"key": key}, event_id)

    def put_all(self, region: str, entries: dict[str, Any], *, event_id: EventID | None = None) -> dict[str, Any]:
        """Put many entries; raises RegionError if any failed after retries."""
        eid = event_id or self.next_event_id(len(entries))
        body = {"entries": entries, "event_id": eid.to_record()}
        return self._request("POST", f"/regions/{region}/put_all", body, bulk=True)

    def remove_all(self, region: str, keys: list[str], *, event_id: EventID | None = None) -> dict[str, Any]:
        eid = event_id or self.next_event_id(len(keys))
        return self._request("POST", f"/regions/{region}/remove_all", {"keys": keys, "event_id": eid.to_record()},
                             bulk=True)

    def clear(self, region: str, *, event_id: EventID | None = None) -> dict[str, Any]:
        """Clear the region (every bucket); retried with the same EventID until every bucket answered."""
        eid = event_id or self.next_event_id()
        return self._request("POST", f"/regions/{region}/clear", {"event_id": eid.to_record()}, bulk=True)

    def destroy_region(self, region: str, *, event_id: EventID | None = None) -> dict[str, Any]:
        """Destroy the region: its entries go, and subscribed clients drop it."""
        eid = event_id or self.next_event_id()
        return self._request("POST", f"/regions/{region}/destroy_region", {"event_id": eid.to_record()}, bulk=True)

    def apply_remote(self, region: str, events: list[EntryEvent], *, outcomes: str = "exceptions",
                     traces: list[str | None] | None = None) -> dict[str, Any]:
        """Apply events another site applied, as JSON (a gateway receiver hands its batches over as
        bytes instead: ``BatchClient.apply_batch``).

        Retried until acknowledged: each event keeps its EventID, so a repeat is
        answered ``duplicate``; events that lose the WAN conflict are counted in
        ``conflicts`` and listed as ``conflict``.  ``traces``: each event's W3C
        ``traceparent`` (or None), the parent of its apply on this site.

        An event the site refuses for good (its checks: key, value, dsids,
        EventID bounds, clock skew) is an ``error`` outcome in the answer, not
        an exception: the other events of the request are applied, and the
        caller reports the refused ones (a receiver puts them in its ack).
        Only a retriable failure of some event sends the request again.
        """
        body: dict[str, Any] = {"events": [encode_remote(e) for e in events]}
        if traces is not None:
            assert len(traces) == len(events), "one trace context (or None) per event"
            body["traceparents"] = traces
        return self._request("POST", f"/regions/{region}/apply_remote?outcomes={outcomes}", body, bulk=True,
                             refused_ok=True)

    def get(self, region: str, key: str, default: Any = None) -> Any:
        entry = self.get_entry(region, key)
        return default if entry is None else entry["value"]

    def get_entry(self, region: str, key: str) -> dict[str, Any] | None:
        """The entry (value, invalid, version, event_id) or None when absent."""
        try:
            return self._request("GET", f"/regions/{region}/entries/{key}", None)
        except RegionError as exc:
            if exc.status == 404 and exc.error == "EntryNotFound":
                return None
            raise

    def get_all(self, region: str, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        return self._request("POST", f"/regions/{region}/get_all", {"keys": keys})["entries"]

    def contains(self, region: str, key: str) -> bool:
        return bool(self._request("GET", f"/regions/{region}/contains/{key}", None)["contains"])

    def keys(self, region: str, bucket: int | None = None) -> list[str]:
        path = f"/regions/{region}/keys" + (f"?bucket={bucket}" if bucket is not None else "")
        return list(self._request("GET", path, None)["keys"])

    def buckets(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/buckets", None)["buckets"])

    # --- plumbing ------------------------------------------------------------------

    def _write(self, region: str, op: str, body: dict[str, Any], event_id: EventID | None) -> dict[str, Any]:
        eid = event_id or self.next_event_id()
        body = {k: v for k, v in body.items() if v is not None or k == "value"}
        body["event_id"] = eid.to_record()
        return self._request("POST", f"/regions/{region}/{op}", body)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, bulk: bool = False,
                 refused_ok: bool = False) -> Any:
        for attempt in Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, SluiceError) and e.retriable),
            stop=stop_after_delay(self._retry_for_s),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        ):
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    self.retries += 1
                return self._once(method, path, body, bulk, refused_ok)
        raise AssertionError("unreachable")  # pragma: no cover

    def _once(self, method: str, path: str, body: dict[str, Any] | None, bulk: bool, refused_ok: bool) -> Any:
        with self._lock:
            url = self.urls[next(self._rotation)]
        if body is None and method != "GET":
            body = {}
        try:
            resp = self._http.request(method, url + path, json=body)
        except (httpx.TransportError,) as exc:
            raise RegionUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
        try:
            data = resp.json()
        except ValueError:
            raise RegionUnavailable(f"{url}: {resp.status_code} with a body that is not JSON") from None
        if bulk and resp.status_code in (200, 207) or (bulk and resp.status_code >= 400 and "outcomes" in data):
            failed = [o for o in data.get("outcomes", []) if o["status"] == "error"]
            if failed:
                retriable = [o for o in failed if o["error"].get("retriable")]
                if refused_ok and retriable:
                    # Retrying the whole request is safe: applied events come back as duplicates.
                    raise RegionUnavailable(f"{url}: {len(retriable)} events failed: "
                                            f"{retriable[0]['error'].get('message')}")
                if refused_ok:
                    return data
                refusals = [o for o in failed if not o["error"].get("retriable")]
                if not refusals:
                    # Retrying the whole bulk is safe: applied entries come back as duplicates.
                    raise RegionUnavailable(f"{url}: {len(failed)} entries failed: {failed[0]['error'].get('message')}")
                raise RegionError(resp.status_code, refusals[0]["error"])
            return data
        if resp.status_code >= 400:
            error = RegionError(resp.status_code, data if isinstance(data, dict) else {"message": str(data)})
            if error.retriable or resp.status_code in (502, 503, 504):
                raise RegionUnavailable(str(error)) from error
            raise error
        return data

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RegionClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """A bucket owner's answer to one ``apply_batch``: counts, the events it refused (each a dict:
    ``index`` in the record posted, ``error``, ``message``, ``retriable``, ``event_id`` or None) and the
    last event it applied (index in the record posted, EventID), None when none."""

    count: int
    applied: int
    duplicates: int
    conflicts: int
    refused: list[dict[str, Any]]
    last_applied: tuple[int, EventID] | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BatchAnswer":
        last = data.get("last_applied")
        return cls(data["count"], data["applied"], data["duplicates"], data["conflicts"], list(data["refused"]),
                   None if last is None else (last["index"], EventID.from_record(last["event_id"])))


class BatchClient:
    """Hands gateway batches to region-service instances (``POST /internal/apply_batch``), each call to
    the instance it names, once: no retry, no rotation (the caller knows the owners).  Thread-safe."""

    def __init__(self, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        headers = {"content-type": BATCH_CONTENT_TYPE}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def apply_batch(self, url: str, record: bytes) -> BatchAnswer:
        """The owner's answer to ``record``.  Raises ``RegionError`` when it refuses the request as a
        whole (a 4xx: 400 or 413 for the record, 401 or 403 for the credential), and a retriable
        ``SluiceError`` when there is no answer (not connected, a timeout, a 5xx): the events may or may
        not have been applied, and a retry is safe (repeats are answered as duplicates)."""
        try:
            resp = self._http.post(f"{url.rstrip('/')}/internal/apply_batch", content=record)
        except httpx.TransportError as exc:
            raise RegionUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
        try:
            data = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            raise RegionUnavailable(f"{url}: {resp.status_code} with a body that is not JSON") from None
        if resp.status_code != 200 or not isinstance(data, dict):
            error = RegionError(resp.status_code, data if isinstance(data, dict) else {"message": str(data)})
            if error.retriable or resp.status_code >= 500:
                raise RegionUnavailable(str(error)) from error
            raise error
        try:
            return BatchAnswer.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise RegionUnavailable(f"{url}: an answer without {exc}: {str(data)[:200]}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "BatchClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
