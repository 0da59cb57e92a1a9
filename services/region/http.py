"""The region service's HTTP API (FastAPI; the OpenAPI document is at /openapi.json).

Writes answer only when the changelog record and every queue record are
durable.  Every write accepts an optional ``event_id`` (member_id,
thread_id, sequence_id): a client that retries with the same EventID gets
``"status": "duplicate"`` instead of a second application.  Errors are JSON
``{"error", "message", "field", "reason", "retriable"}`` with a 4xx status for
bad input (Geode's EntryExists is 409, EntryNotFound 404, unknown region 404,
oversized key or value 413, malformed body 400) and 503 when a retry may help.
"""

import time
from typing import Any

import orjson
from typing import Annotated

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, ORJSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.errors import InvalidRequest, SluiceError
from ..core.telemetry import TRACEPARENT
from ..core.events import EventID, goes_to_gateway
from .engine import Operation
from ..core.remotewire import decode_remote
from .service import FORWARDED_HEADER, Outcome, RegionService, _NotOwnedKeys, op_from_json
from .state import Op


class EventIdBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    member_id: str = Field(min_length=1, max_length=200)
    thread_id: int = Field(ge=0)
    sequence_id: int = Field(ge=0)

    def to_event_id(self, offset: int = 0) -> EventID:
        return EventID(self.member_id, self.thread_id, self.sequence_id + offset)


class EntryBody(BaseModel):
    """create / put: one key and its value."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(description="The entry's key.")
    value: Any = Field(description="Any JSON value (not null).")
    callback_argument: str | None = None
    event_id: EventIdBody | None = Field(None, description="Keep it on retries: the write is applied once.")


class KeyBody(BaseModel):
    """destroy / invalidate: one key."""

    model_config = ConfigDict(extra="forbid")
    key: str
    callback_argument: str | None = None
    event_id: EventIdBody | None = None


class PutAllBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entries: dict[str, Any] = Field(description="key → value; entry i gets sequence_id + i.")
    callback_argument: str | None = None
    event_id: EventIdBody | None = None


class RemoteBody(BaseModel):
    """Events applied by another site, each its Avro single-object encoding in base64."""

    model_config = ConfigDict(extra="forbid")
    events: list[str] = Field(min_length=1, max_length=10_000)
    #: Each event's W3C trace context (or null), when the sending site traced it.
    traceparents: list[str | None] | None = None


class ClearBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event_id: EventIdBody | None = Field(None, description="Keep it on retries: each bucket is cleared once.")


class KeysBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[str]
    callback_argument: str | None = None
    event_id: EventIdBody | None = None


def _error(exc: SluiceError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.http_status)


def _single(outcome: Outcome, created: bool = False) -> JSONResponse:
    if outcome.status == "error":
        assert outcome.error is not None
        body = {k: v for k, v in outcome.error.items() if k != "http_status"}
        return JSONResponse(body, status_code=outcome.http_status)
    status = 201 if created and outcome.status == "ok" else 200
    return JSONResponse(outcome.to_dict(), status_code=status)


def _bulk(outcomes: list[Outcome], detail: str = "exceptions") -> JSONResponse:
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
    return ORJSONResponse(body, status_code=status)


#: Requests FastAPI's telemetry leaves out: the probes and the status polls.
UNTRACED_PATHS = frozenset({"/healthz", "/readyz", "/stats", "/buckets"})


def create_app(service: RegionService) -> FastAPI:
    names = [r.name for r in service.cfg.regions]
    # Every route's {region}: documented with this site's regions as examples;
    # any other name is answered 404 UnknownRegion by the handler.
    RegionName = Annotated[str, Path(description=f"a region of this site: {', '.join(names)}", examples=names)]
    app = FastAPI(
        title="Sluice region service",
        version="1",
        description=__doc__,
        openapi_tags=[{"name": "entries"}, {"name": "bulk"}, {"name": "gateway"}, {"name": "operations"},
                      {"name": "internal"}],
        # FastAPI's own OpenTelemetry spans and HTTP metrics, through this process's providers
        # (core/telemetry.py): one server span a request, none for the probes.
        telemetry={"operation_spans": False, "exclude": lambda scope: scope.get("path") in UNTRACED_PATHS},
    )

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if service.token and request.url.path not in ("/healthz", "/readyz"):
            if request.headers.get("authorization") != f"Bearer {service.token}":
                return JSONResponse(
                    {"error": "Unauthorized", "message": "missing or wrong bearer token", "retriable": False},
                    status_code=401,
                )
        return await call_next(request)

    @app.exception_handler(SluiceError)
    async def sluice_error(_: Request, exc: SluiceError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid", "input": None}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        value = first.get("input")
        if isinstance(value, bytes):
            err = InvalidRequest("body", value[:80].decode("utf-8", "replace"),
                                 "expected a JSON object; send it with content-type: application/json")
            return JSONResponse(err.to_dict(), status_code=400)
        if first.get("type") == "json_invalid":
            err = InvalidRequest("body", None, f"not valid JSON ({first.get('ctx', {}).get('error', 'syntax error')} "
                                               f"at position {first.get('loc', ('', '?'))[-1]})")
            return JSONResponse(err.to_dict(), status_code=400)
        if isinstance(value, (dict, list)):
            value = orjson.dumps(value).decode()[:80]
        err = InvalidRequest(field, value, first.get("msg", "invalid"))
        body = err.to_dict()
        body["problems"] = [
            {"field": ".".join(str(p) for p in e.get("loc", ()) if p != "body"), "reason": e.get("msg")}
            for e in exc.errors()
        ]
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": "HTTPError", "message": str(exc.detail), "retriable": False},
                            status_code=exc.status_code)

    def forwarded(request: Request) -> bool:
        return request.headers.get(FORWARDED_HEADER) == "1"

    async def one(request: Request, region: str, op: Op, key: str, value: Any, cb: str | None,
                  eid: EventIdBody | None, created: bool = False) -> JSONResponse:
        service.region_config(region)
        service.check_key(region, key)
        data = service.encode_value(region, value) if op in (Op.CREATE, Op.PUT) else None
        operation = Operation(op, region, key, data, eid.to_event_id() if eid else None, cb)
        outcome = (await service.execute([operation], forwarded(request)))[0]
        return _single(outcome, created)

    # --- entries -------------------------------------------------------------

    @app.post("/regions/{region}/create", tags=["entries"], status_code=201,
              summary="Create an entry; 409 EntryExists when the key is present")
    async def create(region: RegionName, body: EntryBody, request: Request) -> JSONResponse:
        return await one(request, region, Op.CREATE, body.key, body.value, body.callback_argument, body.event_id, True)

    @app.post("/regions/{region}/put", tags=["entries"], summary="Create or update an entry")
    async def put(region: RegionName, body: EntryBody, request: Request) -> JSONResponse:
        return await one(request, region, Op.PUT, body.key, body.value, body.callback_argument, body.event_id)

    @app.post("/regions/{region}/destroy", tags=["entries"],
              summary="Destroy an entry; 404 EntryNotFound when absent")
    async def destroy(region: RegionName, body: KeyBody, request: Request) -> JSONResponse:
        return await one(request, region, Op.DESTROY, body.key, None, body.callback_argument, body.event_id)

    @app.post("/regions/{region}/invalidate", tags=["entries"],
              summary="Invalidate an entry (the key stays, the value goes); 404 when absent")
    async def invalidate(region: RegionName, body: KeyBody, request: Request) -> JSONResponse:
        return await one(request, region, Op.INVALIDATE, body.key, None, body.callback_argument, body.event_id)

    @app.get("/regions/{region}/entries/{key:path}", tags=["entries"],
             summary="Get an entry: its value (null when invalid) and version; 404 when absent")
    async def get(region: RegionName, key: str, request: Request) -> JSONResponse:
        service.region_config(region)
        service.check_key(region, key)
        entries = await _read(request, region, [key])
        entry = entries.get(key)
        if entry is None:
            return JSONResponse({"error": "EntryNotFound", "key": key, "message": f"no entry {key!r} in region {region!r}",
                                 "retriable": False}, status_code=404)
        return JSONResponse({"key": key, **entry})

    @app.put("/regions/{region}/entries/{key:path}", tags=["entries"], summary="Put (REST form): the body is the value")
    async def put_rest(region: RegionName, key: str, request: Request) -> JSONResponse:
        try:
            value = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest("body", None, f"not JSON: {exc}") from None
        return await one(request, region, Op.PUT, key, value, None, None)

    @app.delete("/regions/{region}/entries/{key:path}", tags=["entries"], summary="Destroy (REST form)")
    async def destroy_rest(region: RegionName, key: str, request: Request) -> JSONResponse:
        return await one(request, region, Op.DESTROY, key, None, None, None)

    @app.get("/regions/{region}/contains/{key:path}", tags=["entries"], summary="Whether the key is present")
    async def contains(region: RegionName, key: str, request: Request) -> dict[str, Any]:
        service.region_config(region)
        service.check_key(region, key)
        entries = await _read(request, region, [key])
        return {"key": key, "contains": entries.get(key) is not None}

    @app.get("/regions/{region}/keys", tags=["entries"], summary="Keys of one bucket, or of the whole region")
    async def keys(region: RegionName, request: Request, bucket: int | None = Query(None, ge=0)) -> dict[str, Any]:
        cfg = service.region_config(region)
        if bucket is not None and bucket >= cfg.buckets:
            raise InvalidRequest("bucket", bucket, f"region {region!r} has buckets 0..{cfg.buckets - 1}")
        return {"region": region, "bucket": bucket, "keys": await service.keys(region, bucket, forwarded(request))}

    # --- bulk --------------------------------------------------------------------

    @app.post("/regions/{region}/put_all", tags=["bulk"], summary="Put many entries (not atomic, as Geode's putAll)")
    async def put_all(region: RegionName, body: PutAllBody, request: Request,
                      outcomes: str = Query("exceptions", pattern="^(exceptions|all)$",
                                            description="all: one outcome per key; exceptions: only keys not applied")
                      ) -> JSONResponse:
        service.region_config(region)
        ops = []
        tx = service.transaction_for(region, body.event_id.to_event_id() if body.event_id else None)
        for i, (key, value) in enumerate(body.entries.items()):
            service.check_key(region, key, f"entries.{key}")
            data = service.encode_value(region, value, f"entries.{key}")
            ops.append(Operation(Op.PUT_ALL, region, key, data,
                                 body.event_id.to_event_id(i) if body.event_id else None, body.callback_argument,
                                 transaction=tx))
        return _bulk(await service.execute(ops, forwarded(request)), outcomes)

    @app.post("/regions/{region}/remove_all", tags=["bulk"], summary="Destroy many entries; absent keys are skipped")
    async def remove_all(region: RegionName, body: KeysBody, request: Request,
                         outcomes: str = Query("exceptions", pattern="^(exceptions|all)$")) -> JSONResponse:
        service.region_config(region)
        ops = []
        tx = service.transaction_for(region, body.event_id.to_event_id() if body.event_id else None)
        for i, key in enumerate(body.keys):
            service.check_key(region, key, f"keys[{i}]")
            ops.append(Operation(Op.REMOVE_ALL, region, key, None,
                                 body.event_id.to_event_id(i) if body.event_id else None, body.callback_argument,
                                 transaction=tx))
        return _bulk(await service.execute(ops, forwarded(request)), outcomes)

    @app.post("/regions/{region}/clear", tags=["bulk"],
              summary="Clear the region: every entry of every bucket, each bucket at once; not sent to other "
                      "sites or async event queues (as Geode); subscription clients hear of it")
    async def clear(region: RegionName, request: Request, body: ClearBody | None = None) -> JSONResponse:
        return await whole_region(Op.CLEAR, region, request, body)

    @app.post("/regions/{region}/destroy_region", tags=["bulk"],
              summary="Destroy the region: its entries go as with clear, and subscription clients drop the "
                      "region; it stays declared by the site file, so a later write starts it again")
    async def destroy_region(region: RegionName, request: Request, body: ClearBody | None = None) -> JSONResponse:
        return await whole_region(Op.DESTROY_REGION, region, request, body)

    async def whole_region(op: Op, region: str, request: Request, body: ClearBody | None) -> JSONResponse:
        config = service.region_config(region)
        event_id = body.event_id.to_event_id() if body is not None and body.event_id is not None else \
            EventID(f"{service.instance_id}-{op.value}", 0, time.time_ns() // 1000)
        ops = [Operation(op, region, "", None, event_id, None, bucket=b) for b in range(config.buckets)]
        outcomes = await service.execute(ops, forwarded(request))
        if any(o.status == "error" for o in outcomes):
            return _bulk(outcomes)
        return ORJSONResponse({"status": "ok", "operation": "REGION_CLEAR" if op is Op.CLEAR else "REGION_DESTROY",
                               "buckets": len(outcomes), "cleared": sum(o.cleared or 0 for o in outcomes),
                               "duplicates": sum(o.status == "duplicate" for o in outcomes),
                               "event_id": event_id.to_record()})

    @app.post("/regions/{region}/get_all", tags=["bulk"], summary="Get many entries: key → entry or null")
    async def get_all(region: RegionName, body: KeysBody, request: Request) -> dict[str, Any]:
        service.region_config(region)
        for i, key in enumerate(body.keys):
            service.check_key(region, key, f"keys[{i}]")
        return {"entries": await _read(request, region, body.keys)}

    # --- from other sites ------------------------------------------------------------

    @app.post("/regions/{region}/apply_remote", tags=["gateway"],
              summary="Apply events another site applied (the gateway receiver's entry point)")
    async def apply_remote(region: RegionName, body: RemoteBody, request: Request,
                           outcomes: str = Query("exceptions", pattern="^(exceptions|all)$")) -> JSONResponse:
        """Each event keeps its origin's EventID and version tag.  Repeats are
        answered ``duplicate``; an event that loses the WAN conflict (later
        timestamp wins, then the higher dsid) is answered ``conflict`` and not
        applied.  Only create, update and destroy operations cross sites."""
        service.region_config(region)
        ops = []
        for i, text in enumerate(body.events):
            event = decode_remote(text, f"events[{i}]")
            if event.region != region:
                raise InvalidRequest(f"events[{i}].region", event.region, f"the request is for region {region!r}")
            if not goes_to_gateway(event.operation):
                raise InvalidRequest(f"events[{i}].operation", event.operation.value,
                                     "only create, update and destroy cross sites")
            if event.version.dsid == service.cfg.dsid or event.origin_dsid == service.cfg.dsid:
                raise InvalidRequest(f"events[{i}].origin_dsid", event.origin_dsid,
                                     f"an event of this site (dsid {service.cfg.dsid}) cannot come back to it")
            service.check_key(region, event.key, f"events[{i}].key")
            traceparent = body.traceparents[i] if body.traceparents and i < len(body.traceparents) else None
            ops.append(Operation(Op.REMOTE, region, event.key, remote=event,
                                 trace=[(TRACEPARENT, traceparent.encode())] if traceparent else None))
        return _bulk(await service.execute(ops, forwarded(request)), outcomes)

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

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> JSONResponse:
        ok = service.state.value == "running"
        return JSONResponse({"state": service.state.value}, status_code=200 if ok else 503)

    @app.get("/readyz", tags=["operations"])
    async def readyz() -> JSONResponse:
        ready = service.ready
        return JSONResponse({"ready": ready, "state": service.state.value}, status_code=200 if ready else 503)

    @app.get("/stats", tags=["operations"])
    async def stats() -> dict[str, Any]:
        assert service.engine is not None
        return {"instance": service.instance_id, **service.engine.stats}

    # --- between instances ------------------------------------------------------

    @app.post("/internal/ops", tags=["internal"], include_in_schema=True,
              summary="Apply operations forwarded by another instance (owner only)")
    async def internal_ops(request: Request) -> JSONResponse:
        try:
            data = orjson.loads(await request.body())
            ops = [op_from_json(d) for d in data["ops"]]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest("ops", None, f"malformed forwarded operations: {exc}") from None
        outcomes = await service.execute(ops, forwarded=True)
        return ORJSONResponse({"outcomes": [_with_status(o) for o in outcomes]})

    @app.post("/internal/read", tags=["internal"], summary="Read entries for another instance (owner only)")
    async def internal_read(request: Request) -> JSONResponse:
        try:
            data = orjson.loads(await request.body())
            region, keys_ = data["region"], list(data["keys"])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidRequest("body", None, f"malformed read: {exc}") from None
        try:
            entries = await service.read(region, keys_, forwarded=True)
            return JSONResponse({"entries": entries, "not_owned": []})
        except _NotOwnedKeys as exc:
            return JSONResponse({"entries": exc.found, "not_owned": exc.keys})

    async def _read(request: Request, region: str, keys_: list[str]) -> dict[str, Any]:
        return await service.read(region, keys_, forwarded(request))

    return app


def _with_status(o: Outcome) -> dict[str, Any]:
    d = o.to_dict()
    if o.error is not None:
        d["error"] = dict(o.error)
    return d
