"""What every request to the region service passes before FastAPI reads it.

An ASGI middleware (``Guard``), outermost, so nothing is parsed or buffered
before these checks, in this order:

1. **Credential.**  Each path takes one credential (``credential_of``):

   ======================================  ==========================================
   path                                    credential
   ======================================  ==========================================
   ``/healthz``, ``/readyz``               none (the probes)
   ``/internal/*`` (ops, read, keys)       member token: instances forward with it
   ``/internal/apply_batch``               member token: gateway receivers hand
                                           their batches to bucket owners with it
   ``POST /regions/{r}/apply_remote``      member token: gateway receivers apply
                                           other sites' events with it
   everything else (``/regions/...``,      client token
   ``/buckets``, ``/stats``, ``/openapi.
   json``, ``/docs``)
   ======================================  ==========================================

   A path is open when its credential is not configured (a loopback-only
   development site; ``RegionService.bind`` refuses to listen beyond
   loopback without both).  The client token never opens a member path and
   the member token never opens a client path.  Tokens are compared with
   ``webguard.bearer_matches`` (constant time); a missing header matches none.
   Refused: 401.

2. **Cross-site requests.**  A state-changing request (POST, PUT, DELETE,
   PATCH) that another site's page may have sent (``core/webguard.py``:
   ``Sec-Fetch-Site``, ``Origin`` or ``Referer`` of another origin, or a
   POST or PUT without ``content-type: application/json``) is refused
   (403), so a web page cannot make a developer's browser clear a region on
   localhost.  ``/internal/apply_batch`` takes a binary body instead
   (``application/avro`` or ``application/octet-stream``): neither is a type
   a page may send to another site without a preflight, which Sluice never
   grants, so it is as safe as JSON there.

3. **Size.**  A body larger than ``region_service.request_body_max_bytes`` is
   refused (413) by its ``Content-Length`` before a byte of it is read; a
   chunked body is counted as it arrives and refused as soon as it passes
   the limit, so no more than the limit is ever held.  A refused request's
   connection is closed rather than read to its end.

Every refusal is JSON in the API's error shape (``error``, ``message``,
``field``, ``reason``, ``retriable``).
"""

from __future__ import annotations

import re
from typing import Any, Awaitable, Callable

import orjson

from ..core.webguard import bearer_matches, digest, forgery_problem

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN, CLIENT, MEMBER = "open", "client", "member"
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_APPLY_REMOTE = re.compile(r"^/regions/[^/]+/apply_remote/?$")
#: Paths whose body is binary, and the media types they take in place of JSON.
BINARY_PATHS = frozenset({"/internal/apply_batch"})
BINARY_MEDIA_TYPES = frozenset({"application/avro", "application/octet-stream"})
_WANTED = frozenset({b"authorization", b"origin", b"referer", b"sec-fetch-site", b"content-type",
                     b"content-length", b"transfer-encoding", b"host"})


def credential_of(path: str) -> str:
    """Which credential ``path`` takes: OPEN, CLIENT or MEMBER (see the module docstring)."""
    if path in OPEN_PATHS:
        return OPEN
    if path.startswith("/internal/") or _APPLY_REMOTE.match(path):
        return MEMBER
    return CLIENT


def _refusal(error: str, field: str, value: Any, reason: str) -> dict[str, Any]:
    shown = value if not isinstance(value, str) or len(value) <= 80 else value[:80] + "…"
    return {"error": error, "message": f"{field}: {reason} (got {shown!r})", "field": field, "reason": reason,
            "retriable": False}


class Guard:
    """The credential, cross-site and size checks of every request (see the module docstring)."""

    def __init__(self, app: App, *, token: str | None, member_token: str | None, body_max_bytes: int) -> None:
        self.app = app
        self._expected = {CLIENT: None if token is None else digest(token),
                          MEMBER: None if member_token is None else digest(member_token)}
        self.body_max_bytes = body_max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            if name in _WANTED and name not in headers:
                headers[name] = value
        chunked = b"transfer-encoding" in headers
        length = headers.get(b"content-length")
        has_body = chunked or (length is not None and length.strip() not in (b"", b"0"))

        kind = credential_of(scope["path"])
        expected = self._expected.get(kind)
        given = headers.get(b"authorization")
        if expected is not None and not bearer_matches(given, expected):
            other = CLIENT if kind == MEMBER else MEMBER
            reason = f"this path takes the {kind} token as `Authorization: Bearer <token>`"
            other_expected = self._expected[other]
            if other_expected is not None and bearer_matches(given, other_expected):
                reason += f"; the {other} token does not open it"
            await _answer(send, 401, _refusal("Unauthorized", "authorization", "(hidden)", reason), close=has_body,
                          extra=[(b"www-authenticate", b"Bearer")])
            return

        header = _header_reader(headers, scope["path"] in BINARY_PATHS)
        refused = forgery_problem(header, scope["method"], has_body)
        if refused is not None:
            await _answer(send, 403, _refusal("Forbidden", *refused), close=has_body)
            return

        limit = self.body_max_bytes
        if length is not None and not chunked:
            try:
                size = int(length)
            except ValueError:
                await _answer(send, 400, _refusal("InvalidRequest", "content-length", length.decode("latin-1"),
                                                  "not a number of bytes"), close=True)
                return
            if size > limit:
                await _answer(send, 413, _too_large(f"{size} bytes (Content-Length)", limit), close=True)
                return
        elif chunked:
            body = await _read_capped(receive, limit)
            if isinstance(body, _Gone):
                return  # the client went away mid-body: nobody to answer
            if body is None:
                await _answer(send, 413, _too_large(f"more than {limit} bytes (chunked)", limit), close=True)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _too_large(value: str, limit: int) -> dict[str, Any]:
    return _refusal("RequestTooLarge", "body", value, f"larger than region_service.request_body_max_bytes={limit}")


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _header_reader(headers: dict[bytes, bytes], binary: bool) -> Callable[[str], str | None]:
    """The request's headers as ``forgery_problem`` reads them.  On a binary path a binary media type
    stands where that check asks for JSON (module docstring); any other content type is shown as
    it is, and refused as it would be anywhere."""
    def header(name: str) -> str | None:
        value = _text(headers.get(name.encode()))
        if binary and name == "content-type" and value is not None and \
                value.partition(";")[0].strip().lower() in BINARY_MEDIA_TYPES:
            return "application/json"
        return value

    return header


class _Gone:
    """The client disconnected before the end of its body."""


_GONE = _Gone()


async def _read_capped(receive: Receive, limit: int) -> bytes | _Gone | None:
    """The whole body, None as soon as it passes ``limit`` bytes (nothing more is read), or ``_GONE``
    when the client disconnected before its end."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _GONE
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, body: dict[str, Any], *, close: bool,
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    data = orjson.dumps(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:
        # The body was not read: closing is cheaper than reading it to its end to keep the connection.
        headers.append((b"connection", b"close"))
    headers.extend(extra or ())
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


__all__ = ["BINARY_MEDIA_TYPES", "BINARY_PATHS", "CLIENT", "MEMBER", "OPEN", "Guard", "credential_of"]
