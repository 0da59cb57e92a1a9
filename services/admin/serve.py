"""``sluice admin -c FILE serve``: the site's status page, and its pause/resume/stop/start buttons.

The page shows what ``sluice admin status`` prints, kept fresh, plus rates and a
chart of the last minutes.  One process, two threads that share one immutable value:

1. The sampler thread takes a snapshot of the site every ``interval_s`` with
   ``statusdoc.sample``, the builder ``sluice admin status --json`` uses too
   (the very reads ``sluice admin status`` makes for its tables, plus the
   region instances' claims: which instance owns how many buckets of each
   region), so ``/api/status`` and ``--json`` are one document
   (docs/status-json.md).
2. From two snapshots in a row it derives each queue partition's rates: events
   in/s from its end offset moving (the region service enqueueing), events out/s
   from its head moving (batches removed after the listener or the remote site
   accepted them).  Offsets only grow, so a rate needs no counter of any service
   and survives a failover of the primary.
3. It appends queue size and rates per queue to a history bounded by
   ``history_s`` (the chart), renders snapshot and history to JSON bytes once
   (``statusdoc.document``),
   and swaps those bytes in.  Readers take whatever bytes are current: no lock,
   and a hundred open pages cost the brokers nothing more than one.
4. uvicorn serves the page (one static HTML file, its JS and CSS: no build step,
   no CDN, so it works offline) and the JSON it polls every 2 s, ``GET
   /api/status``.  ``POST /api/queues/{queue}/{action}`` writes the queue's desired
   state to the site's control topic exactly as ``sluice admin pause`` does (it
   calls the same ``set_state``), then asks the sampler for an early snapshot.
   ``POST /api/queues/{sender}/clean-start`` is ``sluice admin start SENDER
   --clean-queues`` (clean.py; the page asks for confirmation); the
   document's ``cleans`` lists the clean starts and what each dropped.

A broker that cannot be reached does not stop the page: the snapshot keeps the
last good tables, says since when they are stale and why, and sampling goes on.

With a token (``--token-file`` or ``SLUICE_ADMIN_TOKEN``) every ``/api/`` path
answers 401 unless the request carries ``Authorization: Bearer <token>``,
compared in constant time.  The page itself and its assets hold no data and are
served to anyone; the page asks for the token once and keeps it in the tab's
sessionStorage.

Forged requests.  A browser sends a request to this page for any site the
user visits, and without a token nothing else would tell the two apart.
So, token or not, every request that changes state is refused with 403 and
a JSON error naming why when another site's page may have sent it
(``core/webguard.py``: its ``Sec-Fetch-Site``, ``Origin`` or ``Referer``,
or a content type other than ``application/json``; the page's own script
sends that, with the body ``{}``).

Bodies are capped at ``BODY_BYTES_MAX`` before anything parses them (413);
the actions take no data.  A page without a token answers only to loopback
host names when it listens on a loopback address, so a DNS-rebinding site
(its own name resolved to 127.0.0.1) gets 403 too; and it refuses to start on
any other address unless ``--allow-unauthenticated`` says that is meant.

The sampler is a ``Service`` (core/lifecycle.py), so it moves as every service does::

    NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                        └── the thread died of a bug ──► CRASHED (the command exits 1)

Its thread runs under the service's crash guard: a bug that kills it is kept
as ``crash``, ends the page's server, is shown by ``/healthz`` (503 with the
state and the crash) and makes the command exit 1.  ``stop()`` is idempotent
and may come from any thread.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Path as PathParam, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from ..core.config import SiteConfig, load_config
from ..core.errors import ConfigError, InvalidRequest, SluiceError
from ..core.kafka import make_admin
from ..core.webguard import bearer_matches, digest, forgery_problem, host_and_port, is_loopback
from ..core.health import liveness
from ..core.servicecli import serve_http
from ..core.lifecycle import Service
from ..core.statusread import kind_of
from . import statusdoc
from .clean import NotStopped, issuer, plan_clean
from .cli import STATES, set_state

log = logging.getLogger("sluice.admin.serve")

STATIC_DIR = Path(__file__).resolve().parent / "static"
TOKEN_ENV = "SLUICE_ADMIN_TOKEN"
#: The page's poll period; the sampler never needs to be faster than this.
PAGE_POLL_S = 2.0
#: The largest request body read: the actions take no data (the page sends ``{}``).
BODY_BYTES_MAX = 1024

EXAMPLE = """\
serve (the status page):
  sluice admin -c deploy/sites/site-a.yaml serve --port 7090
  open http://127.0.0.1:7090/                                      # refreshes itself every 2 s
  curl -s 127.0.0.1:7090/api/status                                # the same data as JSON

  # with a bearer token: every /api/ path (status and the buttons) needs it
  head -c 24 /dev/urandom | base64 > admin.token
  sluice admin -c deploy/sites/site-a.yaml serve --host 0.0.0.0 --token-file admin.token
  curl -s -H "Authorization: Bearer $(cat admin.token)" 127.0.0.1:7090/api/status
  curl -s -XPOST -H "Authorization: Bearer $(cat admin.token)" -H "content-type: application/json" -d '{}' \
       127.0.0.1:7090/api/queues/orders-jdbc/pause
  (or SLUICE_ADMIN_TOKEN=... instead of --token-file; the page asks for the token once per tab)

  # on a trusted network only: listen beyond loopback with no token at all
  sluice admin -c deploy/sites/site-a.yaml serve --host 0.0.0.0 --allow-unauthenticated
"""


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options only ``serve`` reads."""
    group = parser.add_argument_group("serve options")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=7090, help="port to listen on, 0 for any free port (default 7090)")
    group.add_argument("--token-file", help=f"file holding the bearer token the page's API requires "
                                            f"(default: ${TOKEN_ENV} when set, else no token)")
    group.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve with no token on an address other than loopback (127.0.0.1, ::1, localhost): "
                            "anyone who reaches it can pause or stop the site's queues; refused without this flag")
    group.add_argument("--interval-s", type=float, default=PAGE_POLL_S,
                       help=f"seconds between two samples of the site (default {PAGE_POLL_S:g}, at least 0.5)")
    group.add_argument("--history-s", type=float, default=600.0,
                       help="seconds of queue size and rates the chart keeps (default 600)")


# --- the sampler -------------------------------------------------------------------


class StatusSampler(Service):
    """Samples the site in a thread of its own; ``status_json`` is the latest rendering.

    Only the sampler thread reads Kafka and touches ``_offsets`` and
    ``_history``; other threads read ``status_json`` (bytes, swapped whole),
    ``state`` and ``crash``, and call ``wake()`` and ``stop()``.
    """

    kind = "status-sampler"
    #: How long ``stop()`` waits for a sample in progress (each read has its own deadline).
    STOP_DEADLINE_S = 10.0

    def __init__(self, cfg: SiteConfig, *, interval_s: float, history_s: float, token_required: bool) -> None:
        if interval_s < 0.5:
            raise InvalidRequest("--interval-s", interval_s, "must be at least 0.5 seconds")
        if history_s < interval_s:
            raise InvalidRequest("--history-s", history_s, "must be at least --interval-s")
        super().__init__()
        self.cfg = cfg
        self.interval_s = interval_s
        self.history_s = history_s
        self.token_required = token_required
        self.status_json: bytes = b""
        self._woken = threading.Event()
        self._thread: threading.Thread | None = None
        self._offsets: dict[tuple[str, int], statusdoc.Offsets] = {}
        # Bounded twice: by count here, and by age in _remember().
        self._history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=int(history_s / interval_s) + 2)
        self._last_good: dict[str, Any] | None = None
        self._stale_since_ms: int | None = None

    def start(self) -> None:
        """NEW → RUNNING, with the empty document in place, and the sampler thread started;
        ``IllegalTransition`` on a sampler started or stopped before."""
        self._check_startable()
        self.status_json = orjson.dumps(self._render(self._empty(), error=None))
        self._set_running()
        self._thread = self.spawn(self._run, "status-sampler")

    def on_stop(self) -> None:
        """The first ``stop()``: wake the thread from its wait, let a sample in progress finish (up to
        ``STOP_DEADLINE_S``), and end STOPPED (a crashed sampler stays CRASHED)."""
        self._woken.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.STOP_DEADLINE_S)
        self._set_stopped()

    def wake(self) -> None:
        """Take the next sample now (after an action, so the page shows its effect soon)."""
        self._woken.set()

    @property
    def ready(self) -> bool:
        return self._last_good is not None

    def _run(self) -> None:
        """The sampler thread (under ``spawn``'s crash guard): sample, wait out the interval or a
        ``wake()``, until stopped."""
        admin = make_admin(self.cfg.kafka.client_settings())
        while not self.stopping.is_set():
            started = time.monotonic()
            self._woken.clear()
            self._sample_once(admin)
            self._woken.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _sample_once(self, admin: Any) -> None:
        try:
            snapshot = self._sample(admin)
        except SluiceError as exc:
            # The broker is away or a topic is missing: keep showing the last good
            # tables, marked stale, and try again next interval.
            log.warning("sampling site %s failed: %s", self.cfg.site, exc)
            if self._stale_since_ms is None:
                self._stale_since_ms = int(time.time() * 1000)
            body = self._last_good or self._empty()
            self.status_json = orjson.dumps(self._render(body, error=f"{type(exc).__name__}: {exc}"))
            return
        self._stale_since_ms = None
        self._last_good = snapshot
        self.status_json = orjson.dumps(self._render(snapshot, error=None))

    def _sample(self, admin: Any) -> dict[str, Any]:
        """One sample, with the same builder as ``sluice admin status --json`` (statusdoc.py); the rates
        from this sample's offsets and the last one's."""
        snapshot = statusdoc.sample(self.cfg, self._offsets)
        self._remember(snapshot["sampled_at_ms"] / 1000, snapshot["queues"])
        return snapshot

    def _remember(self, now_s: float, queues: list[dict[str, Any]]) -> None:
        self._history.append({
            "t_ms": int(now_s * 1000),
            "queues": {q["id"]: [q["size"], q["in_per_s"], q["out_per_s"]] for q in queues},
        })
        while self._history and self._history[0]["t_ms"] < (now_s - self.history_s) * 1000:
            self._history.popleft()

    def _empty(self) -> dict[str, Any]:
        return statusdoc.empty_snapshot()

    def _render(self, snapshot: dict[str, Any], *, error: str | None) -> dict[str, Any]:
        return statusdoc.document(self.cfg, snapshot, error=error, stale_since_ms=self._stale_since_ms,
                                  interval_s=self.interval_s, token_required=self.token_required,
                                  history={"window_s": self.history_s, "points": list(self._history)})


# --- the HTTP face -----------------------------------------------------------------


def exposure_problem(host: str, token: str | None, allow_unauthenticated: bool) -> str | None:
    """Why the page must not start on ``host``, or None."""
    if token is not None or allow_unauthenticated or is_loopback(host):
        return None
    return (f"--host {host} is reachable beyond this machine and no token is set: anyone who reaches it could pause "
            f"or stop the site's queues. Give --token-file FILE (or ${TOKEN_ENV}), listen on 127.0.0.1, or add "
            "--allow-unauthenticated if the network is trusted")


def _refusal(status: int, error: str, field: str, value: Any, reason: str) -> JSONResponse:
    shown = value if not isinstance(value, str) or len(value) <= 200 else value[:200] + "…"
    return JSONResponse({"error": error, "field": field, "value": shown, "reason": reason,
                         "message": f"{field}: {reason}", "retriable": False}, status_code=status)


async def _read_body(request: Request) -> bytes | None:
    """The body, or None once it grows past BODY_BYTES_MAX (nothing more is read)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > BODY_BYTES_MAX:
            return None
    return bytes(body)


async def _empty_body(request: Request) -> JSONResponse | None:
    """The refusal of a body other than ``{}`` (the actions take no data), or None."""
    body = await _read_body(request)
    if body is None:
        return _refusal(413, "InvalidRequest", "body", None, f"is larger than {BODY_BYTES_MAX} bytes "
                                                             "(the actions take no data)")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if data != {}:
        shown = body.decode("utf-8", "replace")
        return _refusal(400, "InvalidRequest", "body", shown, "must be the JSON object {} (the actions take "
                                                              "no data)")
    return None


def _action_openapi(clean: bool = False) -> dict[str, Any]:
    """The action's body and answers, for /api/openapi.json (FastAPI does not read the body itself:
    it is capped and parsed by hand).  ``clean``: the clean start's, which may also find the sender
    running (409)."""
    def answer(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}

    extra = {"409": answer("the sender is not stopped: stop it first (a clean start starts a stopped sender)")} \
        if clean else {}
    return {
        "requestBody": {"required": True, "description": "the actions take no data: {}", "content": {
            "application/json": {"schema": {"type": "object", "additionalProperties": False, "maxProperties": 0}}}},
        "responses": {
            "400": answer("the body is not the JSON object {}"),
            "401": answer("missing or wrong bearer token"),
            "403": answer("refused: the request may come from another site (origin, referer, sec-fetch-site, "
                          "content-type), or a host name this page does not answer to"),
            "404": answer("no such queue or action"),
            "413": answer(f"the body is larger than {BODY_BYTES_MAX} bytes"),
            "500": answer("the control record could not be written"),
            "503": answer("Kafka did not take the control record; try again"),
            **extra,
        },
    }


def create_app(sampler: StatusSampler, token: str | None, *, loopback_only: bool = False) -> FastAPI:
    """The page's app.  ``loopback_only``: answer only requests whose Host names a loopback
    address (a page without a token on loopback; see the module docstring)."""
    cfg = sampler.cfg
    # Compare digests: equal length whatever is offered, so the comparison's
    # time says nothing about the token's length either.
    expected = digest(token) if token else None
    app = FastAPI(title=f"Sluice status page of site {cfg.site}", version="1", docs_url=None, redoc_url=None,
                  openapi_url="/api/openapi.json")
    queue_ids = sorted(q.id for q in cfg.all_attached_queues())

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if loopback_only and not is_loopback(host_and_port(request.headers.get("host", ""))[0]):
            return _refusal(403, "Forbidden", "host", request.headers.get("host"),
                            "this page has no token and answers only to localhost or a loopback address (another "
                            "name may be a DNS-rebinding site)")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > BODY_BYTES_MAX):
            return _refusal(413 if length.isdigit() else 400, "InvalidRequest", "content-length", length,
                            f"a body is at most {BODY_BYTES_MAX} bytes (the actions take no data)")
        if expected is not None and request.url.path.startswith("/api/"):
            if not bearer_matches(request.headers.get("authorization"), expected):
                return JSONResponse({"error": "Unauthorized", "message": "missing or wrong bearer token",
                                     "retriable": False}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        has_body = "transfer-encoding" in request.headers or (length is not None and length.strip() not in ("", "0"))
        if (problem := forgery_problem(request.headers.get, request.method, has_body)) is not None:
            log.warning("refused %s %s: %s %r: %s", request.method, request.url.path, *problem)
            return _refusal(403, "Forbidden", *problem)
        return await call_next(request)

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        """200 while the sampler has not stopped or crashed; 503 otherwise, with its state and crash."""
        alive, body = liveness(sampler)
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """200 once a first snapshot of the site has been taken."""
        return JSONResponse({"ready": sampler.ready}, status_code=200 if sampler.ready else 503)

    @app.get("/api/status")
    def status() -> Response:
        """The latest snapshot and the chart's history (what the page polls)."""
        return Response(sampler.status_json, media_type="application/json", headers={"Cache-Control": "no-store"})

    queue_schema = {"enum": queue_ids} if queue_ids else {}

    sender_schema = {"enum": sorted(s.id for s in cfg.gateway_senders)} if cfg.gateway_senders else {}

    @app.post("/api/queues/{queue_id}/clean-start", openapi_extra=_action_openapi(clean=True))
    async def clean_start(request: Request,
                          queue_id: str = PathParam(json_schema_extra=sender_schema)) -> JSONResponse:
        """Start a stopped gateway sender with its queue emptied, as ``sluice admin start SENDER --clean-queues``
        does: what the queue holds now is dropped by its primaries, through its removals, before they send."""
        try:
            if kind_of(cfg, queue_id) != "gateway-sender":
                raise InvalidRequest("queue", queue_id, "is an async event queue: a clean start is a gateway "
                                     "sender's (Geode's start gateway-sender --clean-queues)")
        except InvalidRequest as exc:
            return JSONResponse(exc.to_dict(), status_code=404)
        refused = await _empty_body(request)
        if refused is not None:
            return refused
        client = request.client.host if request.client else "?"
        try:
            plan = await run_in_threadpool(plan_clean, cfg, queue_id, issuer(f"sluice admin serve, page at {client}"))
        except NotStopped as exc:
            return JSONResponse(exc.to_dict(), status_code=409)
        except SluiceError as exc:
            return JSONResponse(exc.to_dict(), status_code=503 if exc.retriable else 500)
        try:
            await run_in_threadpool(set_state, cfg, queue_id, "RUNNING", issued_by=plan.request.issued_by,
                                    clean=plan.request)
        except SluiceError as exc:
            return JSONResponse(exc.to_dict(), status_code=503 if exc.retriable else 500)
        sampler.wake()
        events = f"{plan.events}" if plan.counted else f"up to {plan.events}"
        return JSONResponse({"queue": queue_id, "action": "clean-start", "state": "RUNNING",
                             "request_id": plan.request.request_id, "events": plan.events,
                             "offsets": list(plan.request.offsets),
                             "message": f"start with clean queues requested: {events} events queued now are dropped "
                                        "by the sender's primaries before they send; see Clean starts"})

    @app.post("/api/queues/{queue_id}/{action}", openapi_extra=_action_openapi())
    async def act(request: Request, queue_id: str = PathParam(json_schema_extra=queue_schema),
                  action: str = PathParam(json_schema_extra={"enum": sorted(STATES)})) -> JSONResponse:
        """pause, resume, stop or start a gateway sender or async event queue, as ``sluice admin`` does."""
        if action not in STATES:
            err = InvalidRequest("action", action, f"not one of {sorted(STATES)}")
            return JSONResponse(err.to_dict(), status_code=404)
        try:
            kind_of(cfg, queue_id)
        except InvalidRequest as exc:
            return JSONResponse(exc.to_dict(), status_code=404)
        refused = await _empty_body(request)
        if refused is not None:
            return refused
        try:
            await run_in_threadpool(set_state, cfg, queue_id, STATES[action], issued_by="sluice admin serve")
        except SluiceError as exc:
            return JSONResponse(exc.to_dict(), status_code=503 if exc.retriable else 500)
        sampler.wake()
        return JSONResponse({"queue": queue_id, "action": action, "state": STATES[action],
                             "message": f"{action} requested; the queue's dispatchers follow within a poll"})

    if expected is not None:
        # Say so in the document too: every /api/ operation needs the bearer token.
        build_openapi = app.openapi

        def openapi_with_bearer() -> dict[str, Any]:
            if app.openapi_schema is None:
                document = build_openapi()
                document.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in document.get("paths", {}).items():
                    if path.startswith("/api/"):
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
                            operation["responses"].setdefault("401", {
                                "description": "missing or wrong bearer token",
                                "content": {"application/json": {"schema": {"type": "object"}}}})
                app.openapi_schema = document
            return app.openapi_schema

        app.openapi = openapi_with_bearer  # type: ignore[method-assign]

    return app


# --- the command -------------------------------------------------------------------


def read_token(args: argparse.Namespace) -> str | None:
    """``--token-file``, else ``$SLUICE_ADMIN_TOKEN``, else None; InvalidRequest for an empty or unreadable one."""
    if args.token_file:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise InvalidRequest("--token-file", args.token_file, f"cannot be read: {exc.strerror}") from exc
        if not token:
            raise InvalidRequest("--token-file", args.token_file, "is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def run(args: argparse.Namespace) -> int:
    """Serve the page until SIGTERM or Ctrl-C.  Exit status: 0 stopped, 1 crashed, 2 bad input."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.queue:
        print("sluice admin serve: takes no queue (the page shows every queue)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
        if args.bootstrap:
            cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
        token = read_token(args)
        sampler = StatusSampler(cfg, interval_s=args.interval_s, history_s=args.history_s,
                                token_required=token is not None)
    except (ConfigError, InvalidRequest) as exc:
        print(f"sluice admin serve: {exc}", file=sys.stderr)
        return 2
    problem = exposure_problem(args.host, token, args.allow_unauthenticated)
    if problem is not None:
        print(f"sluice admin serve: {problem}", file=sys.stderr)
        return 2
    # Without a token on loopback, only loopback names: a DNS-rebinding site
    # (its own name resolved to 127.0.0.1) is then another host.
    loopback_only = token is None and is_loopback(args.host)
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as exc:
        print(f"sluice admin serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]

    def announce() -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"admin page on http://{shown}:{port}/ (site {cfg.site}, dsid {cfg.dsid}; "
              f"{'bearer token required' if token else 'no token'})", flush=True)
        if token is None and not loopback_only:
            log.warning("serving on %s with no token (--allow-unauthenticated): anyone who reaches it can pause or "
                        "stop the site's queues", args.host)

    return serve_http("admin serve", sampler, create_app(sampler, token, loopback_only=loopback_only), sock, announce)
