"""What every request passes before the region API reads it (sluice.region.guard): the credential
of its path, the cross-site checks of state-changing requests, and the body size limit."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from sluice.region.guard import CLIENT, MEMBER, OPEN, Guard, credential_of

CLIENT_TOKEN = "client-token-0123456789"
MEMBER_TOKEN = "member-token-0123456789"
LIMIT = 1024


class Echo:
    """The app behind the guard: answers 200 with how many body bytes it was given."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        size = 0
        more = True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = str(size).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def guarded() -> Iterator[tuple[TestClient, Echo]]:
    echo = Echo()
    app = Guard(echo, token=CLIENT_TOKEN, member_token=MEMBER_TOKEN, body_max_bytes=LIMIT)
    yield TestClient(app, base_url="http://region:7071"), echo


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "content-type": "application/json"}


def test_each_path_takes_one_credential() -> None:
    """Probes are open; /internal/* and apply_remote take the member token; everything else the client's."""
    assert [credential_of(p) for p in ("/healthz", "/readyz")] == [OPEN, OPEN]
    for path in ("/internal/ops", "/internal/read", "/internal/keys", "/regions/orders/apply_remote"):
        assert credential_of(path) == MEMBER, path
    for path in ("/regions/orders/put", "/regions/orders/entries/x/apply_remote", "/openapi.json", "/docs", "/stats",
                 "/buckets", "/internal", "/healthz/x"):
        assert credential_of(path) == CLIENT, path


def test_a_token_opens_only_its_own_paths(guarded: tuple[TestClient, Echo]) -> None:
    """The client token never opens a member path nor the member token a client path; a missing or
    malformed header is a 401 in the error shape, and the app behind never runs."""
    client, echo = guarded
    assert client.post("/regions/orders/put", content=b"{}", headers=auth(CLIENT_TOKEN)).status_code == 200
    assert client.post("/internal/ops", content=b"{}", headers=auth(MEMBER_TOKEN)).status_code == 200
    calls = echo.calls
    for path, token in (("/regions/orders/put", MEMBER_TOKEN), ("/internal/ops", CLIENT_TOKEN),
                        ("/regions/orders/apply_remote", CLIENT_TOKEN), ("/regions/orders/put", CLIENT_TOKEN + "x"),
                        ("/regions/orders/put", "")):
        r = client.post(path, content=b"{}", headers=auth(token))
        assert r.status_code == 401, (path, token)
        assert set(r.json()) == {"error", "message", "field", "reason", "retriable"}
        assert CLIENT_TOKEN not in r.text and MEMBER_TOKEN not in r.text
    assert client.post("/regions/orders/put", content=b"{}", headers={"content-type": "application/json"}
                       ).status_code == 401
    assert client.get("/healthz").status_code == 200
    assert echo.calls == calls + 1


@pytest.mark.parametrize(("headers", "field"), [
    ({"origin": "http://evil.example"}, "origin"),
    ({"origin": "null"}, "origin"),
    ({"referer": "https://evil.example/x"}, "referer"),
    ({"origin": "http://region:7072"}, "origin"),
    ({"sec-fetch-site": "cross-site"}, "sec-fetch-site"),
    ({"content-type": "text/plain"}, "content-type"),
    ({"content-type": "application/x-www-form-urlencoded"}, "content-type"),
    ({"content-type": "multipart/form-data; boundary=x"}, "content-type"),
])
def test_state_changing_requests_from_another_site_are_refused(guarded: tuple[TestClient, Echo],
                                                               headers: dict[str, str], field: str) -> None:
    """A request a web page could make a browser send (a foreign origin, a form's content type) is 403."""
    client, echo = guarded
    r = client.post("/regions/orders/clear", content=b"{}", headers={**auth(CLIENT_TOKEN), **headers})
    assert r.status_code == 403 and r.json()["field"] == field, r.text
    assert echo.calls == 0


def test_same_origin_json_and_bodiless_deletes_pass(guarded: tuple[TestClient, Echo]) -> None:
    """The service's own origin, same-site fetches and a DELETE without a body go through; a body-less
    POST without a content type does not."""
    client, _ = guarded
    own = {**auth(CLIENT_TOKEN), "origin": "http://region:7071", "sec-fetch-site": "same-origin"}
    assert client.post("/regions/orders/clear", content=b"{}", headers=own).status_code == 200
    assert client.put("/regions/orders/entries/k", content=b"1", headers=own).status_code == 200
    assert client.delete("/regions/orders/entries/k", headers={"authorization": f"Bearer {CLIENT_TOKEN}"}
                         ).status_code == 200
    r = client.post("/regions/orders/clear", headers={"authorization": f"Bearer {CLIENT_TOKEN}"})
    assert r.status_code == 403 and r.json()["field"] == "content-type"


def test_bodies_over_the_limit_are_refused_before_the_app_reads_them(guarded: tuple[TestClient, Echo]) -> None:
    """By Content-Length at once, and chunked as soon as the count passes the limit: 413 naming it."""
    client, echo = guarded
    assert client.post("/regions/orders/put", content=b"x" * LIMIT, headers=auth(CLIENT_TOKEN)).text == str(LIMIT)
    calls = echo.calls
    r = client.post("/regions/orders/put", content=b"x" * (LIMIT + 1), headers=auth(CLIENT_TOKEN))
    assert r.status_code == 413 and f"request_body_max_bytes={LIMIT}" in r.json()["reason"]
    assert r.headers["connection"] == "close"

    def chunks(total: int) -> Iterator[bytes]:
        for start in range(0, total, 100):
            yield b"x" * min(100, total - start)

    r = client.post("/regions/orders/put", content=chunks(LIMIT * 10), headers=auth(CLIENT_TOKEN))
    assert r.status_code == 413 and r.json()["field"] == "body"
    assert echo.calls == calls
    assert client.post("/regions/orders/put", content=chunks(LIMIT), headers=auth(CLIENT_TOKEN)).text == str(LIMIT)


def test_without_credentials_configured_every_path_is_open() -> None:
    """A loopback-only development site: no token, no member token; the cross-site checks still apply."""
    echo = Echo()
    client = TestClient(Guard(echo, token=None, member_token=None, body_max_bytes=LIMIT))
    assert client.post("/internal/ops", content=b"{}", headers={"content-type": "application/json"}).status_code == 200
    assert client.post("/regions/orders/clear", headers={"origin": "http://evil.example"}).status_code == 403


@pytest.mark.parametrize(("settings", "refused"), [
    ({}, True),
    ({"token": CLIENT_TOKEN, "member_token": MEMBER_TOKEN}, False),
    ({"member_token": MEMBER_TOKEN}, True),
    ({"allow_unauthenticated": True}, False),
])
def test_listening_beyond_loopback_needs_both_tokens_or_consent(settings: dict[str, Any], refused: bool) -> None:
    """The address actually bound decides (``--host`` included): 0.0.0.0 without token and member_token
    is refused naming the settings, unless allow_unauthenticated; loopback is always allowed."""
    from sluice.core.config import parse_config
    from sluice.core.errors import ConfigError
    from sluice.region.service import RegionService

    cfg = parse_config({"site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
                        "regions": [{"name": "orders", "buckets": 2}], "region_service": settings})
    wide = RegionService(cfg, host="0.0.0.0", port=0)
    if refused:
        with pytest.raises(ConfigError) as error:
            wide.bind()
        assert "allow_unauthenticated" in str(error.value) and "member_token" in str(error.value)
    else:
        wide.bind().close()
    RegionService(cfg, host="127.0.0.1", port=0).bind().close()
