"""Other sites' events, a gateway batch at a time: ``POST /internal/apply_batch`` (issue 18).

The gateway receiver verifies a batch (its signature over the bytes received,
its source, target and age), finds each event's bucket from its key alone
and the bucket's owner from the signed directory, and hands each owner, in
one request per ``receiver.apply_events_max`` events, a ``GatewayBatch``
record of the events that owner holds: the record it received when the owner
holds them all, else one written around their bodies as they came
(``application/avro``, the member token, the body cap of every request).
Nothing on the way decodes an event; the owner does, once, here:

1. The record is read down to its events' bodies (``eventwire.read_gateway_batch``);
   one that does not read, or names another target site, is refused whole (400).
2. Each body is decoded and the sender's changes merged in: possibleDuplicate
   and the visited sites (``eventwire.batch_event_body``), spliced into the
   body too where they change it.  The event is checked
   as every event of another site is (``core/eventchecks.remote_problem``).
   One that does not decode or fails a check is a refusal of its own and
   never stops the others.
3. The rest go to the service's ``execute`` as ``Op.REMOTE`` operations
   for the buckets this instance owns, and only those: an event whose bucket
   another instance owns now (it moved since the receiver looked) is refused
   as retriable (``NotOwner``), never forwarded; the receiver asks the
   directory again and hands it to the new owner.  Repeats (by EventID, per
   key) and lost WAN conflicts are answered as applied, counted apart.
4. The answer (JSON, small whatever the batch's size) holds counts, the
   refused events (index in the record, error class, message, whether a
   retry may help, the EventID when the body says it) and the index and
   EventID of the last event applied: nothing per event that simply applied.

An event applied as it came (no conflict resolver changed it) is written to
the changelog and the queues as that body, spliced, not encoded again
(``Operation.remote_body``).

An event the batch says fires no callbacks (``no_callback_events``: an entry
another site copied with wan-copy region, Geode's generateCallbacks false)
is applied to the region and its changelog, which subscription clients
follow, and queued for none of the region's async event queues and gateway
senders: no listener hears of it, and it goes to no other site.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..core import telemetry
from ..core.codec import get_codec
from ..core.errors import CodecError, InvalidRequest, MalformedRecord, RejectedBatch, SluiceError
from ..core.eventchecks import remote_problem
from ..core.events import EventID
from ..core.eventwire import batch_event_body, entry_event_id, read_gateway_batch
from .engine import OpResult, Operation
from .state import Op

if TYPE_CHECKING:
    from .service import RegionService

#: The media types the route takes (the guard lets them through as it lets JSON through).
BATCH_MEDIA_TYPES = ("application/avro", "application/octet-stream")


def _refusal(index: int, error: SluiceError, event_id: EventID | None) -> dict[str, Any]:
    return {"index": index, "error": type(error).__name__, "message": str(error), "retriable": error.retriable,
            "event_id": None if event_id is None else event_id.to_record()}


async def apply_batch(service: RegionService, data: bytes) -> dict[str, Any]:
    """Apply the events of one GatewayBatch record in this instance's buckets; the answer (module
    docstring).  ``InvalidRequest`` when the record is refused whole."""
    cfg = service.cfg
    try:
        view = read_gateway_batch(get_codec(), data)
    except CodecError as exc:
        raise InvalidRequest("body", f"{len(data)} bytes", f"not a GatewayBatch record: {exc}") from None
    if view.target_dsid != cfg.dsid:
        raise RejectedBatch("target_dsid", view.target_dsid, f"batch {view.batch_id} is for dsid {view.target_dsid}, "
                                                             f"this site is dsid {cfg.dsid}")
    now_ms = int(time.time() * 1000)
    refused: list[dict[str, Any]] = []
    ops: list[Operation] = []
    where: list[int] = []
    traces = view.traceparents
    for i in range(len(view.bodies)):
        try:
            event, body = batch_event_body(view, i)
        except MalformedRecord as exc:
            refused.append(_refusal(i, MalformedRecord(f"events[{i}]: not an EntryEvent: {exc.reason}"),
                                    _event_id_or_none(view.bodies[i])))
            continue
        problem = remote_problem(cfg, event, now_ms, f"events[{i}]")
        if problem is not None:
            refused.append(_refusal(i, problem, event.event_id))
            continue
        trace = traces[i] if i < len(traces) else ""
        ops.append(Operation(Op.REMOTE, event.region, event.key, remote=event, remote_body=body,
                             trace=[(telemetry.TRACEPARENT, trace.encode())] if trace else None,
                             generate_callbacks=i not in view.no_callback_events))
        where.append(i)
    applied = duplicates = conflicts = skipped = 0
    last: tuple[int, EventID] | None = None
    if ops:
        for i, op, result in zip(where, ops, await _apply(service, ops)):
            error = result.error
            if error is not None:
                assert op.remote is not None
                refused.append(_refusal(i, error, op.remote.event_id))
                continue
            if result.duplicate:
                duplicates += 1
            elif result.conflict_lost:
                conflicts += 1
            elif result.skipped:
                skipped += 1
            else:
                applied += 1
            last = (i, op.remote.event_id)  # type: ignore[union-attr]
    refused.sort(key=lambda r: r["index"])
    return {"count": len(view.bodies), "applied": applied, "duplicates": duplicates,
            "conflicts": conflicts, "skipped": skipped, "refused": refused,
            "last_applied": None if last is None else {"index": last[0], "event_id": last[1].to_record()}}


async def _apply(service: RegionService, ops: list[Operation]) -> list[OpResult]:
    """The operations applied in the buckets this instance owns, never forwarded: each of another
    owner's bucket comes back NotOwner.  With tracing on, each event that came with a trace context
    gets its ``region.apply_remote`` span, as ``execute`` makes them for a request it may route (it
    makes none for one it may not)."""
    if not telemetry.tracing():
        return await service.apply_owned(ops)
    spans = service._start_spans(ops)  # noqa: SLF001 - the service's span rule, not a copy of it
    try:
        return await service.apply_owned(ops)
    finally:
        for span in spans:
            span.end()


def _event_id_or_none(body: bytes) -> EventID | None:
    """The EventID of a body that does not decode, when it reaches that far."""
    try:
        return entry_event_id(body)
    except MalformedRecord:
        return None


__all__ = ["BATCH_MEDIA_TYPES", "apply_batch"]
