"""The region service's HTTP API (FastAPI; the OpenAPI document is at /openapi.json).

Writes answer only when the changelog record and every queue record are
durable.  Every write accepts an optional ``event_id`` (member_id,
thread_id, sequence_id): a client that retries with the same EventID gets
``"status": "duplicate"`` instead of a second application.  Errors are JSON
``{"error", "message", "field", "reason", "retriable"}`` with a 4xx status for
bad input (Geode's EntryExists is 409, EntryNotFound 404, unknown region 404,
oversized key or value 413, malformed body 400) and 503 when a retry may help.

Credentials (``Authorization: Bearer <token>``; the checks are in guard.py):

- ``/healthz`` and ``/readyz``: none.
- ``/internal/*`` (operations, reads, bucket keys and wan-copy batches
  forwarded between instances; ``apply_batch``, a gateway batch from this
  site's receiver) and
  ``POST /regions/{region}/apply_remote`` (other sites' events as JSON):
  ``region_service.member_token`` only.
- every other path (entries, bulk operations, ``/regions``, ``/buckets``,
  ``/stats``, ``wan_copy`` (wancopy.py), this document):
  ``region_service.token`` only.

A credential that is not configured leaves its paths open (a loopback-only
development site).  State-changing requests (POST, PUT, DELETE) must be
``content-type: application/json`` (``/internal/apply_batch``: ``application/avro``)
and not come from another origin (403);
a body larger than ``region_service.request_body_max_bytes`` is refused
before it is read (413).  Forwarded operations and other sites' events are
checked as strictly as a client's write; an event refused by those checks is
an ``error`` outcome of its own and never fails the other events of its
request.
"""

import json
import math
import time
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.errors import InvalidRequest, NotOwner, SluiceError
from ..core.eventchecks import ID_MAX, MEMBER_ID_MAX_CHARS, event_id_problem, is_unicode, remote_problem
from ..core.events import EventID
from ..core.remotewire import decode_remote
from ..core.telemetry import TRACEPARENT
from ..core.wancopy import BATCH_SIZE_DEFAULT, BATCH_SIZE_MAX, KEYS_MAX
from .engine import Operation
from .guard import Guard
from .remote import BATCH_MEDIA_TYPES, apply_batch
from .service import NotOwnedKeys, Outcome, RegionService, error_outcome
from .state import Op
from .wancopy import WanCopy


def _unicode(text: str) -> str:
    if not is_unicode(text):
        raise ValueError("must be valid Unicode (it holds a lone surrogate)")
    return text


#: A string that can go into a record: JSON's "\ud800" escapes make Python strings that cannot.
Text = Annotated[str, AfterValidator(_unicode)]


class EventIdBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    member_id: Text = Field(min_length=1, max_length=MEMBER_ID_MAX_CHARS)
    thread_id: int = Field(ge=0, le=ID_MAX)
    sequence_id: int = Field(ge=0, le=ID_MAX)

    def to_event_id(self, offset: int = 0) -> EventID:
        return EventID(self.member_id, self.thread_id, self.sequence_id + offset)


class EntryBody(BaseModel):
    """create / put: one key and its value."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(description="The entry's key.")
    value: Any = Field(description="Any JSON value (not null).")
    callback_argument: Text | None = None
    event_id: EventIdBody | None = Field(None, description="Keep it on retries: the write is applied once.")


class KeyBody(BaseModel):
    """destroy / invalidate: one key."""

    model_config = ConfigDict(extra="forbid")
    key: str
    callback_argument: Text | None = None
    event_id: EventIdBody | None = None


class PutAllBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entries: dict[str, Any] = Field(description="key → value; entry i gets sequence_id + i.")
    callback_argument: Text | None = None
    event_id: EventIdBody | None = None


class RemoteBody(BaseModel):
    """Events applied by another site, each its Avro single-object encoding in base64."""

    model_config = ConfigDict(extra="forbid")
    events: list[str] = Field(min_length=1, max_length=10_000)
    #: Each event's W3C trace context (or null), when the sending site traced it.
    traceparents: list[Annotated[str, Field(max_length=256)] | None] | None = Field(None, max_length=10_000)


class ClearBody(BaseModel):
    """clear / destroy_region: ``{}`` at least."""

    model_config = ConfigDict(extra="forbid")
    event_id: EventIdBody | None = Field(None, description="Keep it on retries: each bucket is cleared once.")


class KeysBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[str]
    callback_argument: Text | None = None
    event_id: EventIdBody | None = None


class WanCopyBody(BaseModel):
    """Start a wan-copy of the region (or of some of its keys) through one of its gateway senders."""

    model_config = ConfigDict(extra="forbid")
    sender_id: Text = Field(min_length=1, max_length=256, description="A gateway sender the region feeds.")
    max_rate: int = Field(0, ge=0, le=10**9, description="Entries per second for the whole copy; 0: no limit.")
    batch_size: int = Field(BATCH_SIZE_DEFAULT, ge=1, le=BATCH_SIZE_MAX,
                            description="Entries per batch: one Kafka transaction, one request to a bucket's owner.")
    keys: list[str] | None = Field(None, min_length=1, max_length=KEYS_MAX,
                                   description="Copy only these keys, tombstones too (as destroys); "
                                               "default: every live entry.")


class WanCopyCancelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sender_id: Text = Field(min_length=1, max_length=256)


class WanCopyBatchBody(BaseModel):
    """One batch of a wan-copy, for the owner of its bucket."""

    model_config = ConfigDict(extra="forbid")
    copy_id: Text = Field(min_length=1, max_length=64)
    region: str
    sender_id: Text = Field(min_length=1, max_length=256)
    bucket: int = Field(ge=0, le=1023)
    after: str | None = Field(None, description="The last key copied; the batch starts after it.")
    count: int = Field(ge=0, le=BATCH_SIZE_MAX, description="Keys in the batch; 0 only counts the bucket's entries.")
    keys: list[str] | None = Field(None, max_length=BATCH_SIZE_MAX, description="These keys instead.")


class ForwardedOp(BaseModel):
    """One operation an instance forwards to the owner of its bucket."""

    model_config = ConfigDict(extra="forbid")
    op: Op
    region: str
    key: str = Field(description="The entry's key (empty for a region clear or destroy).")
    value: str | None = Field(None, description="The value's JSON text (create, put, put_all).")
    event_id: EventIdBody | None = None
    callback_argument: str | None = None
    remote: str | None = Field(None, description="For op remote: the other site's event, base64 Avro.")
    transaction: str | None = Field(None, max_length=512)
    bucket: int = Field(-1, ge=-1, le=1023, description="The key's bucket (-1: computed by the owner).")
    traceparent: str | None = Field(None, max_length=256)


class ForwardedOps(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ops: list[ForwardedOp] = Field(min_length=1, max_length=100_000)


class ForwardedRead(BaseModel):
    model_config = ConfigDict(extra="forbid")
    region: str
    keys: list[str] = Field(max_length=100_000)


class ForwardedKeys(BaseModel):
    model_config = ConfigDict(extra="forbid")
    region: str
    bucket: int = Field(ge=0, le=1023)


def _printable(value: Any) -> Any:
    """``value`` with what JSON cannot carry (lone surrogates, NaN) made visible text."""
    if isinstance(value, str):
        return value if is_unicode(value) else value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(_printable(k)): _printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return value


class SafeJSON(Response):
    """orjson, and for what it refuses (an echoed lone surrogate, an integer beyond 64 bits) the
    standard library on a printable copy: an error echoing a bad input never becomes a 500."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except orjson.JSONEncodeError:
            return json.dumps(_printable(content), ensure_ascii=False, allow_nan=False,
                              default=str).encode("utf-8")


def _retry_after(body: dict[str, Any]) -> dict[str, str] | None:
    """HTTP ``Retry-After`` (whole seconds) for an error that carries a retry hint (a loading bucket)."""
    hint = body.get("retry_after_s")
    return None if hint is None else {"Retry-After": str(max(1, math.ceil(hint)))}


def _error(exc: SluiceError) -> Response:
    body = exc.to_dict()
    return SafeJSON(body, status_code=exc.http_status, headers=_retry_after(body))


def _single(outcome: Outcome, created: bool = False) -> Response:
    if outcome.status == "error":
        assert outcome.error is not None
        body = {k: v for k, v in outcome.error.items() if k != "http_status"}
        return SafeJSON(body, status_code=outcome.http_status, headers=_retry_after(body))
    status = 201 if created and outcome.status == "ok" else 200
    return SafeJSON(outcome.to_dict(), status_code=status)


def _bulk(outcomes: list[Outcome], detail: str = "exceptions") -> Response:
    """A bulk operation is not atomic (as Geode's putAll): a summary, and the
    outcome of every key that was not simply applied (``detail=all``: of every key)."""
    counts = {"ok": 0, "duplicate": 0, "skipped": 0, "conflict": 0, "error": 0}
    listed = []
    worst = 0
    for o in outcomes:
        counts[o.status] += 1
        if detail == "all" or o.status != "ok":
            listed.append(o.to_dict())
        if o.status == "error":
            worst = max(worst, o.http_status)
    status = 200
    if counts["error"] and counts["error"] == len(outcomes):
        status = worst
    elif counts["error"]:
        status = 207
    body = {
        "count": len(outcomes),
        "applied": counts["ok"],
        "duplicates": counts["duplicate"],
        "skipped": counts["skipped"],
        "conflicts": counts["conflict"],
        "failed": counts["error"],
        "outcomes": listed,
    }
    return SafeJSON(body, status_code=status)


#: Requests FastAPI's telemetry leaves out: the probes and the status polls.
UNTRACED_PATHS = frozenset({"/healthz", "/readyz", "/stats", "/buckets"})


def create_app(service: RegionService) -> Any:
    """The region API: FastAPI behind the request guard (guard.py)."""
    names = [r.name for r in service.cfg.regions]
    # Every route's {region}: documented with this site's regions as examples;
    # any other name is answered 404 UnknownRegion by the handler.
    RegionName = Annotated[str, Path(description=f"a region of this site: {', '.join(names)}", examples=names)]
    app = FastAPI(
        title="Sluice region service",
        version="1",
        description=__doc__,
        default_response_class=SafeJSON,
        openapi_tags=[{"name": "entries"}, {"name": "bulk"}, {"name": "gateway"}, {"name": "operations"},
                      {"name": "internal"}],
        # FastAPI's own OpenTelemetry spans and HTTP metrics, through this process's providers
        # (core/telemetry.py): one server span a request, none for the probes.
        telemetry={"operation_spans": False, "exclude": lambda scope: scope.get("path") in UNTRACED_PATHS},
    )

    @app.exception_handler(SluiceError)
    async def sluice_error(_: Request, exc: SluiceError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid", "input": None}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        value = first.get("input")
        if isinstance(value, bytes):
            err = InvalidRequest("body", value[:80].decode("utf-8", "replace"),
                                 "expected a JSON object; send it with content-type: application/json")
            return SafeJSON(err.to_dict(), status_code=400)
        if first.get("type") == "json_invalid":
            err = InvalidRequest("body", None, f"not valid JSON ({first.get('ctx', {}).get('error', 'syntax error')} "
                                               f"at position {first.get('loc', ('', '?'))[-1]})")
            return SafeJSON(err.to_dict(), status_code=400)
        if isinstance(value, (dict, list)):
            value = SafeJSON(value).body.decode("utf-8")[:80]
        err = InvalidRequest(field, value, first.get("msg", "invalid"))
        body = err.to_dict()
        body["problems"] = [
            {"field": ".".join(str(p) for p in e.get("loc", ()) if p != "body"), "reason": e.get("msg")}
            for e in exc.errors()
        ]
        return SafeJSON(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return SafeJSON({"error": "HTTPError", "message": str(exc.detail), "field": None, "reason": str(exc.detail),
                         "retriable": False}, status_code=exc.status_code)

    async def one(region: str, op: Op, key: str, value: Any, cb: str | None,
                  eid: EventIdBody | None, created: bool = False) -> Response:
        service.region_config(region)
        service.check_key(region, key)
        data = service.encode_value(region, value) if op in (Op.CREATE, Op.PUT) else None
        operation = Operation(op, region, key, data, eid.to_event_id() if eid else None, cb)
        outcome = (await service.execute([operation], False))[0]
        return _single(outcome, created)

    # --- entries -------------------------------------------------------------

    @app.post("/regions/{region}/create", tags=["entries"], status_code=201,
              summary="Create an entry; 409 EntryExists when the key is present")
    async def create(region: RegionName, body: EntryBody) -> Response:
        return await one(region, Op.CREATE, body.key, body.value, body.callback_argument, body.event_id, True)

    @app.post("/regions/{region}/put", tags=["entries"], summary="Create or update an entry")
    async def put(region: RegionName, body: EntryBody) -> Response:
        return await one(region, Op.PUT, body.key, body.value, body.callback_argument, body.event_id)

    @app.post("/regions/{region}/destroy", tags=["entries"],
              summary="Destroy an entry; 404 EntryNotFound when absent")
    async def destroy(region: RegionName, body: KeyBody) -> Response:
        return await one(region, Op.DESTROY, body.key, None, body.callback_argument, body.event_id)

    @app.post("/regions/{region}/invalidate", tags=["entries"],
              summary="Invalidate an entry (the key stays, the value goes); 404 when absent")
    async def invalidate(region: RegionName, body: KeyBody) -> Response:
        return await one(region, Op.INVALIDATE, body.key, None, body.callback_argument, body.event_id)

    @app.get("/regions/{region}/entries/{key:path}", tags=["entries"],
             summary="Get an entry: its value (null when invalid) and version; 404 when absent")
    async def get(region: RegionName, key: str) -> Response:
        service.region_config(region)
        service.check_key(region, key)
        entries = await service.read(region, [key], False)
        entry = entries.get(key)
        if entry is None:
            return SafeJSON({"error": "EntryNotFound", "key": key, "message": f"no entry {key!r} in region {region!r}",
                             "field": "key", "reason": f"no entry in region {region!r}", "retriable": False},
                            status_code=404)
        return SafeJSON({"key": key, **entry})

    @app.put("/regions/{region}/entries/{key:path}", tags=["entries"], summary="Put (REST form): the body is the value",
             openapi_extra={"requestBody": {"required": True, "description": "The value: any JSON (not null).",
                                            "content": {"application/json": {"schema": {}}}}})
    async def put_rest(region: RegionName, key: str, request: Request) -> Response:
        try:
            value = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest("body", None, f"not JSON: {exc}") from None
        return await one(region, Op.PUT, key, value, None, None)

    @app.delete("/regions/{region}/entries/{key:path}", tags=["entries"], summary="Destroy (REST form)")
    async def destroy_rest(region: RegionName, key: str) -> Response:
        return await one(region, Op.DESTROY, key, None, None, None)

    @app.get("/regions/{region}/contains/{key:path}", tags=["entries"], summary="Whether the key is present")
    async def contains(region: RegionName, key: str) -> dict[str, Any]:
        service.region_config(region)
        service.check_key(region, key)
        entries = await service.read(region, [key], False)
        return {"key": key, "contains": entries.get(key) is not None}

    @app.get("/regions/{region}/keys", tags=["entries"], summary="Keys of one bucket, or of the whole region")
    async def keys(region: RegionName, bucket: int | None = Query(None, ge=0)) -> dict[str, Any]:
        cfg = service.region_config(region)
        if bucket is not None and bucket >= cfg.buckets:
            raise InvalidRequest("bucket", bucket, f"region {region!r} has buckets 0..{cfg.buckets - 1}")
        return {"region": region, "bucket": bucket, "keys": await service.keys(region, bucket, False)}

    # --- bulk --------------------------------------------------------------------

    def first_event_id(body_event_id: EventIdBody | None, count: int) -> EventID | None:
        if body_event_id is None:
            return None
        eid = body_event_id.to_event_id()
        problem = event_id_problem(eid, "event_id", count=count)
        if problem is not None:
            raise problem
        return eid

    @app.post("/regions/{region}/put_all", tags=["bulk"], summary="Put many entries (not atomic, as Geode's putAll)")
    async def put_all(region: RegionName, body: PutAllBody,
                      outcomes: str = Query("exceptions", pattern="^(exceptions|all)$",
                                            description="all: one outcome per key; exceptions: only keys not applied")
                      ) -> Response:
        service.region_config(region)
        first = first_event_id(body.event_id, len(body.entries))
        ops = service.put_all_operations(region, body.entries, first, body.callback_argument,
                                         service.transaction_for(region, first))
        return _bulk(await service.execute(ops, False, details=outcomes == "all"), outcomes)

    @app.post("/regions/{region}/remove_all", tags=["bulk"], summary="Destroy many entries; absent keys are skipped")
    async def remove_all(region: RegionName, body: KeysBody,
                         outcomes: str = Query("exceptions", pattern="^(exceptions|all)$")) -> Response:
        service.region_config(region)
        first = first_event_id(body.event_id, len(body.keys))
        ops = []
        tx = service.transaction_for(region, first)
        for i, key in enumerate(body.keys):
            service.check_key(region, key, f"keys[{i}]")
            ops.append(Operation(Op.REMOVE_ALL, region, key, None,
                                 body.event_id.to_event_id(i) if body.event_id else None, body.callback_argument,
                                 transaction=tx))
        return _bulk(await service.execute(ops, False, details=outcomes == "all"), outcomes)

    @app.post("/regions/{region}/clear", tags=["bulk"],
              summary="Clear the region: every entry of every bucket, each bucket at once; not sent to other "
                      "sites or async event queues (as Geode); subscription clients hear of it")
    async def clear(region: RegionName, body: ClearBody) -> Response:
        return await whole_region(Op.CLEAR, region, body)

    @app.post("/regions/{region}/destroy_region", tags=["bulk"],
              summary="Destroy the region: its entries go as with clear, and subscription clients drop the "
                      "region; it stays declared by the site file, so a later write starts it again")
    async def destroy_region(region: RegionName, body: ClearBody) -> Response:
        return await whole_region(Op.DESTROY_REGION, region, body)

    async def whole_region(op: Op, region: str, body: ClearBody) -> Response:
        config = service.region_config(region)
        event_id = body.event_id.to_event_id() if body.event_id is not None else service.clear_event_id(op)
        ops = [Operation(op, region, "", None, event_id, None, bucket=b) for b in range(config.buckets)]
        outcomes = await service.execute(ops, False)
        if any(o.status == "error" for o in outcomes):
            return _bulk(outcomes)
        return SafeJSON({"status": "ok", "operation": "REGION_CLEAR" if op is Op.CLEAR else "REGION_DESTROY",
                         "buckets": len(outcomes), "cleared": sum(o.cleared or 0 for o in outcomes),
                         "duplicates": sum(o.status == "duplicate" for o in outcomes),
                         "event_id": event_id.to_record()})

    @app.post("/regions/{region}/get_all", tags=["bulk"], summary="Get many entries: key → entry or null")
    async def get_all(region: RegionName, body: KeysBody) -> dict[str, Any]:
        service.region_config(region)
        for i, key in enumerate(body.keys):
            service.check_key(region, key, f"keys[{i}]")
        return {"entries": await service.read(region, body.keys, False)}

    # --- from other sites (member token) ------------------------------------------------

    @app.post("/regions/{region}/apply_remote", tags=["gateway"],
              summary="Apply events another site applied (the gateway receiver's entry point; member token)")
    async def apply_remote(region: RegionName, body: RemoteBody,
                           outcomes: str = Query("exceptions", pattern="^(exceptions|all)$")) -> Response:
        """Each event keeps its origin's EventID and version tag.  Repeats are
        answered ``duplicate``; an event that loses the WAN conflict (later
        timestamp wins, then the higher dsid) is answered ``conflict`` and not
        applied.  Only create, update and destroy operations cross sites.  An
        event refused by the checks of ``core.eventchecks.remote_problem``
        (key, value, dsids, EventID bounds, a timestamp beyond the allowed
        clock skew) is an ``error`` outcome of its own: the others apply."""
        service.region_config(region)
        now_ms = int(time.time() * 1000)
        answers: list[Outcome | None] = [None] * len(body.events)
        ops: list[Operation] = []
        where: list[int] = []
        for i, text in enumerate(body.events):
            field = f"events[{i}]"
            try:
                event = decode_remote(text, field)
            except InvalidRequest as exc:
                answers[i] = error_outcome("", exc)
                continue
            problem = (InvalidRequest(f"{field}.region", event.region, f"the request is for region {region!r}")
                       if event.region != region else remote_problem(service.cfg, event, now_ms, field))
            if problem is not None:
                answers[i] = error_outcome(event.key, problem)
                continue
            traceparent = body.traceparents[i] if body.traceparents and i < len(body.traceparents) else None
            ops.append(Operation(Op.REMOTE, region, event.key, remote=event,
                                 trace=[(TRACEPARENT, traceparent.encode())] if traceparent else None))
            where.append(i)
        if ops:
            for i, outcome in zip(where, await service.execute(ops, False, details=outcomes == "all")):
                answers[i] = outcome
        return _bulk([o for o in answers if o is not None], outcomes)

    # --- wan-copy (wancopy.py) ----------------------------------------------------------

    def no_copy(region: str, sender_id: str, what: str) -> Response:
        return SafeJSON({"error": "NoWanCopy", "message": f"no {what} wan-copy of region {region!r} through sender "
                         f"{sender_id!r} on this instance", "field": "sender_id", "reason": f"no {what} copy",
                         "retriable": False}, status_code=404)

    @app.post("/regions/{region}/wan_copy", tags=["operations"], status_code=202,
              summary="Start copying the region's entries to a remote site through one of its gateway senders "
                      "(Geode's wan-copy region); 409 when one runs here for that sender")
    async def wan_copy(region: RegionName, body: WanCopyBody) -> Response:
        """This instance coordinates the copy; each bucket's owner copies its own entries into the sender's
        queue, in batches, at most ``max_rate`` entries per second in all.  Answers at once with the copy's
        state; ``GET`` the same path follows it, ``POST …/wan_copy/cancel`` stops it."""
        service.region_config(region)
        keys = None
        if body.keys is not None:
            keys = [service.check_key(region, key, f"keys[{i}]") for i, key in enumerate(body.keys)]
        copy = service.wan_copies.start(region, body.sender_id, max_rate=body.max_rate, batch_size=body.batch_size,
                                        keys=keys)
        return SafeJSON(copy.to_dict(), status_code=202)

    @app.get("/regions/{region}/wan_copy", tags=["operations"],
             summary="A wan-copy this instance coordinates: the running one for the sender, else the last one")
    async def wan_copy_status(region: RegionName, sender_id: str = Query(min_length=1, max_length=256),
                              copy_id: str | None = Query(None, max_length=64)) -> Response:
        service.region_config(region)
        copy: WanCopy | None = service.wan_copies.get(copy_id) if copy_id else \
            service.wan_copies.latest(region, sender_id)
        if copy is None or copy.region != region or copy.sender_id != sender_id:
            return no_copy(region, sender_id, "such")
        return SafeJSON(copy.to_dict())

    @app.post("/regions/{region}/wan_copy/cancel", tags=["operations"],
              summary="Stop the running wan-copy of the region through the sender; answered once it has stopped")
    async def wan_copy_cancel(region: RegionName, body: WanCopyCancelBody) -> Response:
        service.region_config(region)
        copy = await service.wan_copies.cancel(region, body.sender_id, wait_s=service.request_timeout_s)
        if copy is None:
            return no_copy(region, body.sender_id, "running")
        return SafeJSON(copy.to_dict())

    # --- operations ------------------------------------------------------------------

    @app.get("/regions", tags=["operations"], summary="Regions of this site")
    async def regions() -> dict[str, Any]:
        return {"regions": [
            {"name": r.name, "buckets": r.buckets,
             "gateway_senders": list(r.gateway_senders), "async_event_queues": list(r.async_event_queues)}
            for r in service.cfg.regions
        ]}

    @app.get("/buckets", tags=["operations"], summary="Owner of every bucket, as the consumer group says")
    async def buckets() -> dict[str, Any]:
        return {"instance": service.instance_id, "url": service.url, "buckets": service.bucket_table()}

    @app.get("/healthz", tags=["operations"], summary="Alive (no credential)")
    async def healthz() -> Response:
        ok = service.state.value == "running"
        return SafeJSON({"state": service.state.value}, status_code=200 if ok else 503)

    @app.get("/readyz", tags=["operations"], summary="Ready to serve, or what keeps it from it (no credential)")
    async def readyz() -> Response:
        not_ready = service.readiness() if service.state.value == "running" else \
            {"state": f"the service is {service.state.value}"}
        body: dict[str, Any] = {"ready": not not_ready, "state": service.state.value}
        if not_ready:
            body["not_ready"] = not_ready
        return SafeJSON(body, status_code=503 if not_ready else 200)

    @app.get("/stats", tags=["operations"])
    async def stats() -> dict[str, Any]:
        assert service.engine is not None
        directory = service.directory
        return {"instance": service.instance_id, **service.engine.all_stats(),
                "directory_records_ignored": directory.ignored.count if directory is not None else 0}

    # --- between instances (member token) ---------------------------------------------

    @app.post("/internal/ops", tags=["internal"],
              summary="Apply operations forwarded by another instance (owner only; member token)")
    async def internal_ops(body: ForwardedOps) -> Response:
        """Each operation is checked as a client's would be (key, the key's bucket, value, EventID
        bounds; another site's event by ``remote_problem``); a refused one is an error outcome."""
        now_ms = int(time.time() * 1000)
        answers: list[Outcome | None] = [None] * len(body.ops)
        ops: list[Operation] = []
        where: list[int] = []
        for i, f in enumerate(body.ops):
            try:
                ops.append(service.forwarded_operation(
                    op=f.op, region=f.region, key=f.key, value=f.value,
                    event_id=f.event_id.to_event_id() if f.event_id else None,
                    callback_argument=f.callback_argument, remote=f.remote, transaction=f.transaction,
                    bucket=f.bucket, traceparent=f.traceparent, field=f"ops[{i}]", now_ms=now_ms))
            except InvalidRequest as exc:
                answers[i] = error_outcome(f.key, exc)
                continue
            where.append(i)
        if ops:
            for i, outcome in zip(where, await service.execute(ops, forwarded=True)):
                answers[i] = outcome
        return SafeJSON({"outcomes": [_with_status(o) for o in answers if o is not None]})

    @app.post("/internal/apply_batch", tags=["internal"],
              summary="Apply a gateway batch of other sites' events in the buckets this instance owns (owner only; "
                      "member token; the gateway receiver's entry point)",
              openapi_extra={"requestBody": {"required": True, "content": {
                  media: {"schema": {"type": "string", "format": "binary"}} for media in BATCH_MEDIA_TYPES},
                  "description": "A GatewayBatch record (Avro single-object encoding, any version) whose events "
                                 "this instance's buckets hold, as the receiver got it or a record of some of its "
                                 "events; verified by the receiver, checked event by event here."}})
    async def internal_apply_batch(request: Request) -> Response:
        """Each event is decoded once, the sender's changes (visited sites, possibleDuplicate) merged in,
        checked by ``core.eventchecks.remote_problem`` and applied as ``apply_remote`` applies it; an event
        of a bucket this instance does not own is refused as retriable (``NotOwner``), never forwarded.
        The answer lists only the refused events (index, error, message, retriable, EventID) beside the
        counts and the last applied event (index, EventID); see ``region/remote.py``."""
        return SafeJSON(await apply_batch(service, await request.body()))

    @app.post("/internal/read", tags=["internal"], summary="Read entries for another instance (owner only; "
                                                           "member token)")
    async def internal_read(body: ForwardedRead) -> Response:
        service.region_config(body.region)
        for i, key in enumerate(body.keys):
            service.check_key(body.region, key, f"keys[{i}]")
        try:
            entries = await service.read(body.region, body.keys, forwarded=True)
            return SafeJSON({"entries": entries, "not_owned": []})
        except NotOwnedKeys as exc:
            return SafeJSON({"entries": exc.found, "not_owned": exc.keys})

    @app.post("/internal/keys", tags=["internal"], summary="Keys of a bucket for another instance (owner only; "
                                                           "member token)")
    async def internal_keys(body: ForwardedKeys) -> dict[str, Any]:
        config = service.region_config(body.region)
        if body.bucket >= config.buckets:
            raise InvalidRequest("bucket", body.bucket, f"region {body.region!r} has buckets 0..{config.buckets - 1}")
        return {"region": body.region, "bucket": body.bucket,
                "keys": await service.keys(body.region, body.bucket, forwarded=True)}

    @app.post("/internal/wan_copy_batch", tags=["internal"],
              summary="Copy one batch of a bucket this instance owns into a gateway sender's queue (owner only; "
                      "member token; a wan-copy's coordinator sends it)")
    async def internal_wan_copy_batch(body: WanCopyBatchBody) -> Response:
        config = service.region_config(body.region)
        service.wan_copies.sender_of(body.region, body.sender_id)
        if body.bucket >= config.buckets:
            raise InvalidRequest("bucket", body.bucket, f"region {body.region!r} has buckets 0..{config.buckets - 1}")
        engine = service.engine
        assert engine is not None
        if body.after is not None:
            service.check_key(body.region, body.after, "after")
        for i, key in enumerate(body.keys or ()):
            service.check_key(body.region, key, f"keys[{i}]")
            if engine.bucket_of(body.region, key) != body.bucket:
                raise InvalidRequest(f"keys[{i}]", key[:80], f"not a key of bucket {body.bucket}")
        if not engine.owns(body.region, body.bucket):
            raise NotOwner(body.region, body.bucket)
        answer = await service.wan_copies.copy_owned(body.copy_id, body.region, body.sender_id, body.bucket,
                                                     body.after, body.count, body.keys)
        return SafeJSON(answer.to_dict())

    rs = service.cfg.region_service
    return Guard(app, token=service.token, member_token=service.member_token,
                 body_max_bytes=rs.request_body_max_bytes)


def _with_status(o: Outcome) -> dict[str, Any]:
    d = o.to_dict()
    if o.error is not None:
        d["error"] = dict(o.error)
    return d
