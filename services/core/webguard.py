"""What Sluice's HTTP faces (the region service, the status page) check before they act on a request.

Both take state-changing requests (POST, PUT, DELETE, PATCH) from programs
and, on a developer's machine or an operator's desk, share it with a
browser.  A page on another site can make that browser send a request to
``localhost`` or to an internal address, with the browser's cookies but
without reading the answer (cross-site request forgery).  Sluice sets no
cookies and grants no CORS, so such a request can only be a "simple" one:
no custom headers and a form or text body.  A state-changing request is
therefore refused (``forgery_problem``) when

* ``Sec-Fetch-Site`` says another site sent it (anything but ``same-origin``
  or ``none``, the latter being what a user typing a URL sends),
* its ``Origin`` (or, without one, its ``Referer``) is not the server's own
  origin, the host and port of the ``Host`` header, or
* it is a POST, PUT or PATCH (or carries a body) and its content type is not
  ``application/json``, which a page cannot send to another site without a
  preflight.

Programs send neither ``Origin`` nor ``Sec-Fetch-Site`` and pass.  Bearer
tokens are compared in constant time (``bearer_matches``), over digests so
that the time says nothing about the token's length either.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Callable
from urllib.parse import urlsplit

#: Methods that change nothing: never refused as forgeries.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Sec-Fetch-Site values of a request the server's own page sent, or a user typed.
OWN_FETCH_SITES = frozenset({"same-origin", "none"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback(host: str) -> bool:
    """``host`` (an address or a name, as --host takes it, IPv6 with or without brackets) is loopback only."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_and_port(netloc: str) -> tuple[str, int | None]:
    """(lowercase host name, explicit port or None) of ``host[:port]``, IPv6 in brackets or not."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port = netloc.rpartition(":")
        if not sep or not port.isdigit() or ":" in host:
            host, port = netloc, ""
    return host, int(port) if port.isdigit() else None


def same_origin(url: str, host_header: str) -> bool:
    """``url``'s origin is the server's: the host and port the browser addressed (the Host header).

    A Host without a port means the default port of the scheme the browser
    used, which behind a TLS proxy is not the scheme this server sees; so
    any default port then matches, and only a default port does.
    """
    try:
        parts = urlsplit(url)
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    own_host, own_port = host_and_port(host_header)
    if parts.hostname.lower() != own_host:
        return False
    effective = origin_port if origin_port is not None else (443 if parts.scheme == "https" else 80)
    return effective == own_port if own_port is not None else effective in (80, 443)


def forgery_problem(header: Callable[[str], str | None], method: str,
                    has_body: bool) -> tuple[str, str | None, str] | None:
    """(field, value, reason) when a state-changing request may have been sent by another site's page,
    else None.  ``header(name)`` gives a request header (lowercase name) or None."""
    if method.upper() in SAFE_METHODS:
        return None
    fetch_site = header("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() not in OWN_FETCH_SITES:
        return ("sec-fetch-site", fetch_site, "the browser says another site sent this state-changing request")
    own = header("host") or ""
    origin = header("origin")
    if origin is not None:
        if not same_origin(origin, own):
            return ("origin", origin, f"is not this server's own origin (host {own!r}): a state-changing request "
                                      "is taken only from it, or from a program that sends no Origin")
    elif (referer := header("referer")) is not None and not same_origin(referer, own):
        return ("referer", referer, f"is not on this server's own origin (host {own!r})")
    if method.upper() in _BODY_METHODS or has_body:
        content_type = header("content-type")
        if (content_type or "").partition(";")[0].strip().lower() != "application/json":
            return ("content-type", content_type, "a state-changing request is sent as application/json (with a "
                                                  "JSON body, {} at least): a page cannot send that to another site")
    return None


def digest(token: str | bytes) -> bytes:
    """What a bearer token is compared by (``bearer_matches``)."""
    return hashlib.sha256(token.encode("utf-8") if isinstance(token, str) else token).digest()


def bearer_matches(authorization: str | bytes | None, expected_digest: bytes) -> bool:
    """``Authorization: Bearer <token>`` carries the token whose ``digest`` is ``expected_digest``;
    constant-time, and a missing or malformed header is simply no match."""
    if authorization is None:
        return False
    raw = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
    scheme, _, credential = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(digest(credential.strip()), expected_digest)


__all__ = ["OWN_FETCH_SITES", "SAFE_METHODS", "bearer_matches", "digest", "forgery_problem", "host_and_port",
           "is_loopback", "same_origin"]
