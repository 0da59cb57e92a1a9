"""The status page's actions against forged requests (issue 17), with the real app and a real broker.

The actions (pause, resume, stop, start) write the site's control topic, so
a refused request is checked where it would show: the control topic gets
no record.  The app runs in process behind FastAPI's TestClient (its origin
is ``http://testserver``), and once as a real ``sluice admin serve``
process (uvicorn on a free port) listening beyond loopback with
``--allow-unauthenticated``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from sluice.admin import serve
from sluice.cli import main as sluice_main
from sluice.core.config import SiteConfig
from sluice.core.processes import ServiceProcess

from regionkit import control_records, write_site

pytestmark = pytest.mark.timeout(120)

OWN = "http://testserver"
TOKEN = "csrf-test-token"
JSON = {"content-type": "application/json"}


@pytest.fixture
def site(site_a: Any, unique_prefix: str, tmp_path: Path) -> tuple[Path, SiteConfig]:
    """A site file with the serial async event queue ``writer`` (no dispatcher runs: only its control record
    matters), its topics made on the test's broker."""
    path = tmp_path / "site.yaml"
    return path, write_site(path, site="a", bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
                            buckets=2)


def client_for(cfg: SiteConfig, token: str | None = None, **options: Any) -> TestClient:
    sampler = serve.StatusSampler(cfg, interval_s=1, history_s=10, token_required=token is not None)
    return TestClient(serve.create_app(sampler, token, **options), base_url=OWN)


@pytest.fixture
def page(site: tuple[Path, SiteConfig]) -> Iterator[TestClient]:
    with client_for(site[1]) as client:
        yield client


FORGED: list[tuple[dict[str, str], Any, str]] = [
    # (headers, body, the field the refusal names)
    ({"origin": "http://evil.example", **JSON}, b"{}", "origin"),
    ({"origin": "http://testserver:8080", **JSON}, b"{}", "origin"),  # another port of the same host
    ({"origin": "null", **JSON}, b"{}", "origin"),  # a sandboxed frame, a file: page
    ({"referer": "http://evil.example/cats.html", **JSON}, b"{}", "referer"),
    ({"sec-fetch-site": "cross-site", **JSON}, b"{}", "sec-fetch-site"),
    ({"sec-fetch-site": "same-site", "origin": OWN, **JSON}, b"{}", "sec-fetch-site"),
    ({"origin": OWN, "content-type": "application/x-www-form-urlencoded"}, b"a=1", "content-type"),
    ({"origin": OWN, "content-type": "text/plain"}, b"{}", "content-type"),
    ({"origin": OWN, "content-type": "multipart/form-data; boundary=x"}, b"--x--", "content-type"),
    ({}, None, "content-type"),
]


def test_forged_actions_without_a_token_change_nothing_and_the_pages_own_work(
        page: TestClient, site: tuple[Path, SiteConfig]) -> None:
    """Without a token, a POST another site could make (foreign Origin or Referer, Sec-Fetch-Site cross-site or
    same-site, a form's content type, no content type) is refused with 403 naming why, and the control topic gets
    no record; the page's own request (same origin, JSON {}) and a script's (no Origin, JSON {}) are carried out."""
    cfg = site[1]
    for headers, body, field in FORGED:
        answer = page.post("/api/queues/writer/pause", headers=headers, content=body)
        assert answer.status_code == 403, (headers, answer.text)
        assert answer.json()["field"] == field and answer.json()["reason"], answer.json()
    assert control_records(cfg) == [], "a refused action reached the control topic"

    own = page.post("/api/queues/writer/pause", json={},
                    headers={"origin": OWN, "referer": f"{OWN}/", "sec-fetch-site": "same-origin"})
    assert own.status_code == 200 and own.json()["state"] == "PAUSED", own.text
    script = page.post("/api/queues/writer/resume", content=b"{}", headers=JSON)
    assert script.status_code == 200, script.text
    assert control_records(cfg) == [("writer", "PAUSED"), ("writer", "RUNNING")]


# Runs the page's act() in node with fetch and the DOM stubbed, and prints the POSTs it makes.
ACT_IN_NODE = """
const fs = require("fs");
const vm = require("vm");
const element = () => ({ textContent: "", hidden: false, addEventListener() {} });
globalThis.document = { addEventListener() {}, getElementById: element };
globalThis.sessionStorage = { getItem: () => process.argv[3] || null, setItem() {}, removeItem() {} };
globalThis.confirm = () => true;
const sent = [];
globalThis.fetch = async (url, options) => {
  sent.push({ url, ...(options || {}) });
  return { status: 200, ok: true, json: async () => ({ message: "ok" }) };
};
vm.runInThisContext(fs.readFileSync(process.argv[2], "utf8") + "\\nglobalThis.__act = act;");
globalThis.__act("writer", "stop").then(() => console.log(JSON.stringify(sent.filter((r) => r.method === "POST"))));
"""


def test_the_pages_own_script_sends_what_the_guard_takes(site: tuple[Path, SiteConfig], tmp_path: Path) -> None:
    """The page's act() (app.js, run in node with fetch stubbed) sends JSON {} with its token; sent as a browser
    sends it from the page (same origin), the guard carries it out."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run the page's script")
    script = tmp_path / "act.js"
    script.write_text(ACT_IN_NODE)
    done = subprocess.run([node, str(script), str(serve.STATIC_DIR / "app.js"), TOKEN], capture_output=True,
                          text=True, timeout=30, check=True)
    [request] = json.loads(done.stdout)
    assert request["headers"]["Content-Type"] == "application/json" and request["body"] == "{}", request
    browser = {"origin": OWN, "referer": f"{OWN}/", "sec-fetch-site": "same-origin", "sec-fetch-mode": "cors"}
    with client_for(site[1], TOKEN) as client:
        answer = client.post("/" + request["url"], content=request["body"].encode(),
                             headers={**request["headers"], **browser})
    assert answer.status_code == 200, answer.text
    assert control_records(site[1]) == [("writer", "STOPPED")]


def test_bodies_are_capped_before_parsing_and_must_be_the_empty_object(
        page: TestClient, site: tuple[Path, SiteConfig]) -> None:
    """A body over the cap is refused with 413 before it is parsed, whether its length is declared or it comes
    chunked; a body that is not the JSON object {} is 400; none of them writes a control record."""
    big = b"{" + b" " * (serve.BODY_BYTES_MAX + 10) + b"}"
    declared = page.post("/api/queues/writer/stop", content=big, headers=JSON)
    assert declared.status_code == 413 and declared.json()["field"] == "content-length"

    def chunks() -> Iterator[bytes]:
        yield b"{"
        for _ in range(64):
            yield b" " * 512  # far past the cap: the server stops reading at it
        yield b"}"

    chunked = page.post("/api/queues/writer/stop", content=chunks(), headers=JSON)
    assert chunked.status_code == 413 and chunked.json()["field"] == "body", chunked.text
    for body in (b"", b"[]", b"{", b'{"state": "STOPPED"}', b"null", b"\xff"):
        answer = page.post("/api/queues/writer/stop", content=body, headers=JSON)
        assert answer.status_code == 400 and answer.json()["field"] == "body", (body, answer.text)
    assert control_records(site[1]) == []


def test_with_a_token_forged_actions_are_refused_too(site: tuple[Path, SiteConfig]) -> None:
    """The token does not replace the checks: a cross-site POST carrying the right token is 403, a wrong token is
    401 (compared as before), and the page's own request with the token is carried out."""
    cfg = site[1]
    auth = {"authorization": f"Bearer {TOKEN}", **JSON}
    with client_for(cfg, TOKEN) as client:
        forged = client.post("/api/queues/writer/stop", content=b"{}",
                             headers={**auth, "origin": "http://evil.example"})
        assert forged.status_code == 403 and forged.json()["field"] == "origin"
        wrong = client.post("/api/queues/writer/stop", content=b"{}",
                            headers={**auth, "authorization": f"Bearer {TOKEN}x", "origin": OWN})
        assert wrong.status_code == 401
        assert control_records(cfg) == []
        own = client.post("/api/queues/writer/stop", content=b"{}", headers={**auth, "origin": OWN})
        assert own.status_code == 200, own.text
    assert control_records(cfg) == [("writer", "STOPPED")]


def test_a_page_without_a_token_on_loopback_answers_only_loopback_names(site: tuple[Path, SiteConfig]) -> None:
    """A tokenless page on loopback refuses a Host that is not a loopback name (a DNS-rebinding site: its own name
    resolved to 127.0.0.1, so its requests are same-origin to the browser), for reading and acting alike."""
    cfg = site[1]
    with client_for(cfg, loopback_only=True) as client:
        for host in ("evil.example:7090", "evil.example", "127.0.0.1.evil.example"):
            rebound = {"host": host, "origin": f"http://{host}", **JSON}
            assert client.get("/api/status", headers={"host": host}).status_code == 403
            answer = client.post("/api/queues/writer/pause", content=b"{}", headers=rebound)
            assert answer.status_code == 403 and answer.json()["field"] == "host", answer.text
        for host in ("127.0.0.1:7090", "localhost:7090", "[::1]:7090", "localhost"):
            assert client.get("/api/status", headers={"host": host}).status_code == 200, host
    assert control_records(cfg) == []


def test_a_non_loopback_bind_without_a_token_does_not_start(site: tuple[Path, SiteConfig],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --host 0.0.0.0`` with no token exits 2 before listening, saying why and what to give instead;
    loopback binds, a token or --allow-unauthenticated pass the check; --help shows the flag."""
    code = sluice_main(["admin", "-c", str(site[0]), "serve", "--host", "0.0.0.0", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--allow-unauthenticated" in err and "--token-file" in err and "0.0.0.0" in err, err
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        assert serve.exposure_problem(host, None, False) is None, host
    assert serve.exposure_problem("0.0.0.0", TOKEN, False) is None
    assert serve.exposure_problem("10.1.2.3", None, True) is None
    assert serve.exposure_problem("admin.example", None, False) is not None
    with pytest.raises(SystemExit):
        sluice_main(["admin", "--help"])
    assert "--allow-unauthenticated" in capsys.readouterr().out


class AdminPageProcess(ServiceProcess):
    """``sluice admin -c FILE serve --port 0 …``; ``port`` is where it listens."""

    banner = "admin page on "

    def __init__(self, config_path: Path, log_path: Path, *extra: str) -> None:
        super().__init__(["admin", "-c", str(config_path), "serve", "--port", "0", *extra], log_path)
        self.port = int(self.announcement.split(" on ", 1)[1].split(" ", 1)[0].rstrip("/").rsplit(":", 1)[1])


def test_the_real_page_beyond_loopback_with_allow_unauthenticated(site: tuple[Path, SiteConfig],
                                                                  tmp_path: Path) -> None:
    """``serve --host 0.0.0.0 --allow-unauthenticated`` starts (uvicorn on a free port) and warns; over real HTTP a
    cross-origin POST is 403 and writes nothing, the same-origin one pauses the queue."""
    path, cfg = site
    with AdminPageProcess(path, tmp_path / "admin.log", "--host", "0.0.0.0", "--allow-unauthenticated") as proc:
        url = f"http://127.0.0.1:{proc.port}"
        forged = httpx.post(f"{url}/api/queues/writer/pause", content=b"{}", timeout=30,
                            headers={"origin": "http://evil.example", **JSON})
        assert forged.status_code == 403 and forged.json()["field"] == "origin"
        assert control_records(cfg) == []
        own = httpx.post(f"{url}/api/queues/writer/pause", content=b"{}", timeout=30,
                         headers={"origin": url, "sec-fetch-site": "same-origin", **JSON})
        assert own.status_code == 200, own.text
        assert control_records(cfg) == [("writer", "PAUSED")]
        assert "no token (--allow-unauthenticated)" in proc.log_tail()
