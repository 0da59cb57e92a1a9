"""Step 3 of a batch's story (service.py): the receiver routes, the owner checks and applies.

The batch is read down to its events' bodies (``eventwire.read_gateway_batch``;
an older version's events are written again as bodies), and no event is
decoded here: each one's bucket comes from its key alone
(``eventwire.entry_region_key``, murmur2 modulo the region's buckets, as the
region service computes it), and the bucket's owner from the signed directory
(``core/directory.py OwnerDirectory``, with the member token; the site file's
region-service address when no claim is believed).  Each owner gets one
request (``POST /internal/apply_batch``, member token, ``application/avro``)
per ``receiver.apply_events_max`` of its events: the batch's record as
received when the owner holds every event of it, else a GatewayBatch record
written around the bodies of its events.

The owner decodes each event once, merges the sender's changes in (visited
sites, possibleDuplicate), checks it by the rules of every remote event
(core/eventchecks.py ``remote_problem``: region, key, value, EventID, dsids,
clock skew), discards repeats by EventID, resolves WAN conflicts by version
tag and writes changelog and queues (``region/remote.py``); it answers with
the refused events and the last applied one only.

An event refused for good (a check, a conflict the region refuses, a body
that does not decode) becomes an exception in the ack, dead-lettered at the
sending site; a request refused whole (400, 413) is halved until the refused
events stand alone.  What may succeed later is retried here for as long as it
takes, in order, before the events after it are handed over: no answer or a
503 (the same owner, or whoever the directory names then), and an event of a
bucket that moved (the owner refuses it, it never forwards it: the directory
is asked again).  A 401 or 403 (a wrong member token) is an operator's error,
not the batch's: retried with backoff, with an alert, never dead-lettered.  An
event whose region this site does not have, or whose body does not give its
key, is an exception here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..core.config import SiteConfig
from ..core.directory import OwnerDirectory
from ..core.errors import MalformedRecord, SluiceError, Stopping, UnknownRegion
from ..core.events import EventID
from ..core.eventwire import UNKNOWN_EVENT_ID, BatchView, entry_event_id, entry_region_key, gateway_batch
from ..core.kafka import partition_for_key
from ..core.regionclient import BatchClient, RegionError
from .protocol import Applied, FailureAction, failure_action

log = logging.getLogger("sluice.receiver")

#: The first pause before routing or handing over again, doubled up to the next.
APPLY_BACKOFF_FIRST_S = 0.1
APPLY_BACKOFF_MAX_S = 5.0


class OwnerRouting:
    """Hands the events of a batch to the region-service instances that own their buckets.

    ``refresh`` reads the directory again (a bucket with no owner, or one that moved);
    ``count(name, n)`` adds to the receiver's counters; ``alert_unauthorized`` is called
    each time an owner refuses the receiver's credential."""

    def __init__(self, cfg: SiteConfig, client: BatchClient, directory: OwnerDirectory, batch_header: Any, *,
                 refresh: Callable[[], None], count: Callable[[str, int], None],
                 alert_unauthorized: Callable[[RegionError], None]) -> None:
        assert cfg.receiver is not None
        self.regions = {r.name: r for r in cfg.regions}
        self.fallback = configured_region_url(cfg)
        self.apply_events_max = cfg.receiver.apply_events_max
        self._client = client
        self._directory = directory
        self._batch_header = batch_header
        self._refresh = refresh
        self._count = count
        self._alert_unauthorized = alert_unauthorized

    def apply(self, batch: BatchView, value: bytes, stop: threading.Event, traces: list[str | None],
              maybe_half_applied: bool = False) -> Applied:
        """Every event applied or refused for good: each routed to its bucket's owner, each owner's in
        requests of at most apply_events_max events, each request settled (retried until nothing in it
        may still succeed later) before the owner's next one, so a bucket's events apply in order.
        ``maybe_half_applied``: the owner before may have applied some of the events and died before
        acknowledging the batch (receivertotals.py, step 4)."""
        applied = Applied(unanswered=set(range(len(batch.bodies))) if maybe_half_applied else set())
        buckets: list[tuple[str, int] | None] = []
        for i, body in enumerate(batch.bodies):
            buckets.append(self._bucket_of(i, body, applied))
        todo = [i for i, b in enumerate(buckets) if b is not None]
        for url, indexes in self._owners(batch, todo, buckets, stop).items():
            for start in range(0, len(indexes), self.apply_events_max):
                self._settle(batch, value, url, indexes[start:start + self.apply_events_max], buckets, traces,
                             applied, stop)
        self._count("events_applied", applied.applied + applied.recovered)
        self._count("events_recovered", applied.recovered)
        self._count("events_duplicate", applied.duplicates)
        self._count("conflicts", applied.conflicts)
        self._count("exceptions", len(applied.exceptions))
        for e in sorted(applied.exceptions.values(), key=lambda e: e["index"]):
            log.warning("event %d refused: %s: %s", e["index"], e["exception_class"], e["message"])
        return applied

    def _bucket_of(self, index: int, body: bytes, applied: Applied) -> tuple[str, int] | None:
        """(region, bucket) of an event from its first two fields; None, with its exception noted, when
        its body does not give them or its region is not one of this site's."""
        try:
            region, key = entry_region_key(body)
        except MalformedRecord as exc:
            applied.refuse(index, event_id_of(body), "MalformedRecord",
                           f"events[{index}]: not an EntryEvent: {exc.reason}")
            return None
        config = self.regions.get(region)
        if config is None:
            problem = UnknownRegion(region)
            applied.refuse(index, event_id_of(body), type(problem).__name__, f"events[{index}].region: {problem}")
            return None
        return region, partition_for_key(key.encode("utf-8"), config.buckets)

    def _owners(self, batch: BatchView, indexes: list[int], buckets: list[tuple[str, int] | None],
                stop: threading.Event) -> dict[str, list[int]]:
        """The URL of each event's owner, in order: the directory's, else the site file's region-service
        address; waited for (with backoff, the directory read again) while a bucket has neither."""
        backoff_s = APPLY_BACKOFF_FIRST_S
        while True:
            by_owner: dict[str, list[int]] = {}
            missing: tuple[str, int] | None = None
            for i in indexes:
                where = buckets[i]
                assert where is not None
                url = self._directory.owner(*where) or (self.fallback[0] if self.fallback else None)
                if url is None:
                    missing = where
                    break
                by_owner.setdefault(url, []).append(i)
            if missing is None:
                return by_owner
            log.warning("batch %d from dsid %d: no region-service instance owns %s[%d] yet; trying again in %.1f s",
                        batch.batch_id, batch.source_dsid, missing[0], missing[1], backoff_s)
            if stop.wait(backoff_s):
                raise Stopping(f"routing batch {batch.batch_id} from dsid {batch.source_dsid}")
            self._refresh()
            backoff_s = min(backoff_s * 2, APPLY_BACKOFF_MAX_S)

    def _settle(self, batch: BatchView, value: bytes, url: str, part: list[int],
                buckets: list[tuple[str, int] | None], traces: list[str | None], applied: Applied,
                stop: threading.Event) -> None:
        """Hand ``part`` to its owner(s) until every event of it is applied or refused for good.

        A request without an answer, refused for the credential (401, 403: alerted) or answered with
        events that may succeed later (a bucket that moved, one still loading, a write Kafka did not
        acknowledge in time) is retried with backoff, those events routed again by the directory as it
        is then: applied ones come back as repeats, so a retry is always safe."""
        backoff_s = APPLY_BACKOFF_FIRST_S
        attempt = 0
        targets = {url: part}
        while True:
            if stop.is_set():
                raise Stopping(f"applying batch {batch.batch_id} from dsid {batch.source_dsid}")
            attempt += 1
            again: list[int] = []
            failure: SluiceError | None = None
            for owner, indexes in targets.items():
                # Events an earlier attempt may have applied unanswered go in requests of their own, so that
                # the repeats an answer counts are known to be theirs or not (``Applied.took``).
                unanswered = [i for i in indexes if i in applied.unanswered]
                answered = [i for i in indexes if i not in applied.unanswered]
                for request in (unanswered, answered):
                    if request:
                        retry, problem = self._post(batch, value, owner, request, traces, applied)
                        again += retry
                        failure = failure or problem
            if not again:
                return
            why = failure if failure is not None else f"{len(again)} events refused for now (their bucket moving)"
            log.warning("batch %d from dsid %d: applying %d events to %s, attempt %d: %s; trying again in %.1f s",
                        batch.batch_id, batch.source_dsid, len(again), ", ".join(targets), attempt, why, backoff_s)
            if stop.wait(backoff_s):
                raise Stopping(f"applying batch {batch.batch_id} from dsid {batch.source_dsid}")
            backoff_s = min(backoff_s * 2, APPLY_BACKOFF_MAX_S)
            self._refresh()
            targets = self._owners(batch, sorted(again), buckets, stop)

    def _post(self, batch: BatchView, value: bytes, url: str, part: list[int], traces: list[str | None],
              applied: Applied) -> tuple[list[int], SluiceError | None]:
        """One request of the events ``part`` to ``url``: (the events to try again, why when the request
        got no usable answer).  What the failure says decides: a ``retriable`` one (no answer: the owner
        or this site's broker away, a 5xx) is tried again; the receiver's credential refused (401, 403)
        is alerted and tried again; any other failure is for good (400, 413: an event the region will
        never take, or a record past its body cap; a record that cannot be written), and the request
        is halved until the refused events stand alone, each an exception of the ack."""
        try:
            answer = self._client.apply_batch(url, self._record(batch, value, part, traces))
        except SluiceError as exc:
            action = failure_action(exc)
            if action is FailureAction.RETRY:
                applied.unanswered.update(part)  # it may have applied them all the same
                return part, exc
            if action is FailureAction.ALERT:
                assert isinstance(exc, RegionError)
                self._alert_unauthorized(exc)
                return part, exc
            if len(part) == 1:
                refused_as, message = ((exc.error, str(exc.body.get("message", exc))) if isinstance(exc, RegionError)
                                       else (type(exc).__name__, str(exc)))
                applied.refuse(part[0], event_id_of(batch.bodies[part[0]]), refused_as, message)
                return [], None
            half = len(part) // 2
            first, first_failure = self._post(batch, value, url, part[:half], traces, applied)
            second, second_failure = self._post(batch, value, url, part[half:], traces, applied)
            return first + second, first_failure or second_failure
        # Every event of the request is answered: applied (in the counts), or refused (listed).
        refused = {r["index"] for r in answer.refused}
        assert answer.count == len(part) and refused <= set(range(len(part))), \
            f"an answer for {answer.count} events (refused {sorted(refused)[:5]}) to a request of {len(part)}"
        applied.took(part, answer)
        retry: list[int] = []
        for r in answer.refused:
            index = part[r["index"]]
            if r["retriable"]:
                retry.append(index)
            else:
                event_id = EventID.from_record(r["event_id"]) if r["event_id"] else event_id_of(batch.bodies[index])
                applied.refuse(index, event_id, str(r["error"]), str(r["message"]))
        return retry, None

    def _record(self, batch: BatchView, value: bytes, part: list[int], traces: list[str | None]) -> bytes:
        """The GatewayBatch record of the events ``part``: the one received when it is all of them, as they
        came; else one written around their bodies (the batch's fields, the sender's changes of those
        events, their trace contexts as handed on)."""
        handed = [traces[i] or "" for i in part] if any(traces) else []
        if batch.current and len(part) == len(batch.bodies) and tuple(handed) == batch.traceparents:
            return value
        positions = {i: j for j, i in enumerate(part)}
        return gateway_batch(self._batch_header, sender_id=batch.sender_id, source_dsid=batch.source_dsid,
                             target_dsid=batch.target_dsid, queue_partition=batch.queue_partition,
                             batch_id=batch.batch_id, first_offset=batch.first_offset, last_offset=batch.last_offset,
                             possible_duplicate=batch.possible_duplicate, created_at=batch.created_at,
                             bodies=[batch.bodies[i] for i in part],
                             duplicate_events=sorted(positions[i] for i in batch.duplicate_events if i in positions),
                             visited_added=batch.visited_added, traceparents=handed,
                             no_callback_events=sorted(positions[i] for i in batch.no_callback_events
                                                       if i in positions))


def configured_region_url(cfg: SiteConfig) -> list[str]:
    """When the directory names no owner of a bucket (no claim believed: the receiver's member token
    is not the instances'), the site file's region-service address: ``advertised_url`` (e.g. a
    Kubernetes Service in front of every instance), else ``host:port`` when the port is fixed.  An
    instance there that does not own the bucket refuses its events for now."""
    rs = cfg.region_service
    if rs.advertised_url:
        return [rs.advertised_url]
    return [f"http://{rs.host}:{rs.port}"] if rs.port else []


def event_id_of(body: bytes) -> EventID:
    """An event's EventID for its ack, read without decoding it (``UNKNOWN_EVENT_ID`` from a damaged body)."""
    try:
        return entry_event_id(body)
    except MalformedRecord:
        return UNKNOWN_EVENT_ID
