"""The status page (``sluice admin serve``) on a real site: its JSON, its bearer token, and what Chromium draws.

The site: region ``orders`` (4 buckets) feeding the parallel gateway sender
``to-b``, whose sender is not running (its queue only grows, so its size is
exact), and the serial async event queue ``writer``, drained by a real
dispatcher into the recording listener (so it has a primary and throughput).
The page runs as a real ``sluice admin serve`` process with a token; headless
Chromium (Debian's, installed by tests/tools/ensure_chromium.sh when missing)
loads it, and the test reads the DOM after the page's JavaScript ran and the
screenshot's pixels.  The screenshot is kept at .sluice/status-page.png.
"""

from __future__ import annotations

import contextlib
import re
import struct
import subprocess
import threading
import time
import uuid
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.kafka import make_consumer, read_to_end
from sluice.core.processes import REPO, ServiceProcess

from regionkit import DispatcherProcess, RegionProcess, read_topic, write_site
from waiting import read_until

pytestmark = pytest.mark.timeout(180)

ENSURE_CHROMIUM = Path(__file__).resolve().parents[1] / "tools" / "ensure_chromium.sh"
SCREENSHOT = REPO / ".sluice" / "status-page.png"
WINDOW = (1280, 900)
TOKEN = "s3cret-" + uuid.uuid4().hex
WRITTEN = 120  # puts before the JSON check; to-b holds exactly these


class AdminPageProcess(ServiceProcess):
    """``sluice admin -c FILE serve --port 0 …``; ``url`` is where the page is."""

    banner = "admin page on "

    def __init__(self, config_path: Path, log_path: Path, *extra: str) -> None:
        super().__init__(["admin", "-c", str(config_path), "serve", "--port", "0", *extra], log_path)
        self.url = self.announcement.split(" on ", 1)[1].split(" ", 1)[0].rstrip("/")


def ensure_chromium() -> str:
    """Debian's chromium, installed on first use (tests/tools/ensure_chromium.sh); skips, naming why, without it."""
    done = subprocess.run(["bash", str(ENSURE_CHROMIUM)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        pytest.skip(f"no headless Chromium: {reason}")
    return done.stdout.strip().splitlines()[-1]


def chromium(binary: str, url: str, profile: Path, *, screenshot: Path | None = None) -> str:
    """The DOM after the page's scripts ran for a few (virtual) seconds; a screenshot too when asked."""
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=5000", "--dump-dom"]
    if screenshot is not None:
        args.append(f"--screenshot={screenshot}")
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


class Dom(HTMLParser):
    """Just enough of a DOM: every element's tag, attributes, enclosing ids, and text."""

    VOID = {"meta", "link", "input", "br", "img", "hr", "col", "source"}

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[dict[str, Any]] = []
        self._open: list[dict[str, Any]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {"tag": tag, "attrs": dict(attrs), "within": [e["attrs"].get("id") for e in self._open], "text": ""}
        self.elements.append(element)
        if tag not in self.VOID:
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i]["tag"] == tag:
                del self._open[i:]
                return

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element["text"] += data

    def by_id(self, element_id: str) -> dict[str, Any]:
        return next(e for e in self.elements if e["attrs"].get("id") == element_id)

    def find(self, tag: str, within: str, **attrs: str) -> list[dict[str, Any]]:
        return [e for e in self.elements if e["tag"] == tag and within in e["within"]
                and all(e["attrs"].get(k.replace("_", "-")) == v for k, v in attrs.items())]


def png_pixels(path: Path) -> tuple[int, int, set[tuple[int, ...]]]:
    """(width, height, distinct colours of every 4th pixel) of an 8-bit RGB/RGBA PNG, decoded with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, colour_type, _, _, interlace = header
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, f"unexpected PNG format {header}"
    bpp = 4 if colour_type == 6 else 3
    raw = zlib.decompress(idat)
    stride = width * bpp
    # Byte lanes of a big int: adding two rows lane by lane without carries (the Up filter) in one go.
    high = int.from_bytes(b"\x80" * stride, "big")
    low = int.from_bytes(b"\x7f" * stride, "big")
    previous = bytearray(stride)
    colours: set[tuple[int, ...]] = set()
    for y in range(height):
        start = y * (stride + 1)
        filter_type, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        if filter_type == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif filter_type == 2:
            a, b = int.from_bytes(line, "big"), int.from_bytes(previous, "big")
            line = bytearray((((a & low) + (b & low)) ^ ((a ^ b) & high)).to_bytes(stride, "big"))
        elif filter_type == 3:
            for i in range(stride):
                line[i] = (line[i] + (((line[i - bpp] if i >= bpp else 0) + previous[i]) >> 1)) & 0xFF
        elif filter_type == 4:
            for i in range(bpp):
                line[i] = (line[i] + previous[i]) & 0xFF
            for i in range(bpp, stride):
                a, b, c = line[i - bpp], previous[i], previous[i - bpp]
                # Flat areas (most of a page) take the two short cuts: b == c picks a, a == c picks b.
                if b == c:
                    predicted = a
                elif a == c:
                    predicted = b
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - c - c)
                    predicted = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + predicted) & 0xFF
        for x in range(0, stride, bpp * 4):
            colours.add(tuple(line[x:x + 3]))
        previous = line
    return width, height, colours


def control_records(cfg: Any, queue_id: str) -> list[dict[str, Any]]:
    """Every record of the control topic about ``queue_id``, oldest first."""
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        records = [get_codec().decode_as("ControlRecord", m.value())
                   for m in read_to_end(consumer, cfg.topics.control()) if m.value() is not None]
    finally:
        consumer.close()
    return [r for r in records if r["target_id"] == queue_id]


def wait_status(url: str, condition: Any, what: str, timeout_s: float = 30) -> dict[str, Any]:
    status = read_until(lambda: httpx.get(f"{url}/api/status", headers={"Authorization": f"Bearer {TOKEN}"},
                                          timeout=10).json(),
                        lambda status: status.get("queues") and condition(status), timeout_s=timeout_s, poll_s=0.3)
    if status.get("queues") and condition(status):
        return status
    pytest.fail(f"status page never showed {what}; last: error={status.get('error')}, "
                f"queues={[(q['id'], q['size'], q['states']) for q in status.get('queues', [])]}")


def queue_of(status: dict[str, Any], queue_id: str) -> dict[str, Any]:
    return next(q for q in status["queues"] if q["id"] == queue_id)


def test_status_page_shows_the_site_guards_its_api_and_renders_in_chromium(site_a, unique_prefix,
                                                                           tmp_path: Path) -> None:
    """The JSON has every queue with exact sizes; without the token nothing is shown or changed; Chromium draws
    the tables and the chart from it, and the screenshot is a page, not a blank; with the token a button's
    action pauses the dispatcher and resumes it."""
    browser = ensure_chromium()
    phases: list[tuple[str, float]] = [("start", time.monotonic())]

    def phase(name: str) -> None:
        phases.append((name, time.monotonic()))

    site_file = tmp_path / "site.yaml"
    cfg = write_site(site_file, site="a", bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
                     buckets=4, extra={"async_event_queues": [{
                         "id": "writer", "parallel": False, "dispatcher_threads": 2,
                         "listener": {"type": "python", "class_path": "recording_listener:RecordingListener",
                                      "settings": {"path": str(tmp_path / "offers.jsonl")}}}]})
    (tmp_path / "admin.token").write_text(TOKEN + "\n")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    stop_writing = threading.Event()
    write_errors: list[BaseException] = []
    with contextlib.ExitStack() as stack:
        region = stack.enter_context(RegionProcess(site_file, tmp_path / "region.log"))
        dispatcher = stack.enter_context(DispatcherProcess(site_file, "writer", tmp_path / "dispatcher.log"))
        page = stack.enter_context(AdminPageProcess(site_file, tmp_path / "admin.log", "--token-file",
                                                    str(tmp_path / "admin.token"), "--interval-s", "1"))
        region.wait_ready()
        phase("services up")
        client = RegionClient([region.url], member_id=f"page-{uuid.uuid4().hex[:6]}")
        for n in range(WRITTEN):
            client.put("orders", f"k{n % 40}", {"n": n})

        # (1) The JSON: every queue, per partition, with exact sizes (to-b has no sender: it holds all).
        status = wait_status(page.url, lambda s: queue_of(s, "to-b")["size"] == WRITTEN
                             and queue_of(s, "writer")["size"] == 0, f"to-b holding {WRITTEN} events, writer drained")
        queues = {q["id"]: q for q in status["queues"]}
        assert set(queues) == {"to-b", "writer"}
        assert [p["partition"] for p in queues["to-b"]["partitions"]] == [0, 1, 2, 3]
        assert sum(p["size"] for p in queues["to-b"]["partitions"]) == WRITTEN
        # Every write went through the writer's queue (its records: offsets count transaction markers too).
        assert len(read_topic(site_a.bootstrap, cfg.topics.queue("writer"),
                              len(queues["writer"]["partitions"]))) == WRITTEN
        assert queues["writer"]["states"] == ["running"] and queues["writer"]["primaries"] == [dispatcher.member_id]
        assert queues["to-b"]["kind"] == "gateway-sender" and queues["to-b"]["remote_dsid"] == 2
        assert [(s["dsid"], s["role"]) for s in status["sites"]] == [(1, "this site"), (2, "remote")]
        assert status["sites"][1]["queued"] == WRITTEN
        assert status["regions"][0]["name"] == "orders" and status["regions"][0]["buckets"] == 4
        assert status["error"] is None and status["section_errors"] == {} and status["token_required"] is True
        assert sorted(status["actions"]) == ["pause", "resume", "start", "stop"]
        phase("JSON")

        # Writes go on while the chart fills: its lines then move.
        def write_slowly() -> None:
            n = 0
            try:
                while not stop_writing.wait(0.02):
                    client.put("orders", f"t{n % 40}", {"n": n})
                    n += 1
            except BaseException as exc:  # the test's thread: hand the failure to the test
                write_errors.append(exc)

        trickle = threading.Thread(target=write_slowly, name="trickle", daemon=True)
        trickle.start()
        stack.callback(trickle.join, 10)
        stack.callback(stop_writing.set)

        # (2) The token: nothing without it, nothing with a wrong one, and a refused action changes nothing.
        assert httpx.get(f"{page.url}/api/status", timeout=10).status_code == 401
        for wrong in ("Bearer nope", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x"):
            assert httpx.get(f"{page.url}/api/status", headers={"Authorization": wrong}, timeout=10).status_code == 401
        refused = httpx.post(f"{page.url}/api/queues/writer/pause",
                             headers={"Authorization": f"Bearer {TOKEN[:-1]}"}, timeout=10)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert httpx.post(f"{page.url}/api/queues/writer/stop", timeout=10).status_code == 401
        assert control_records(cfg, "writer") == [], "a refused action reached the control topic"
        assert httpx.get(f"{page.url}/", timeout=10).status_code == 200  # the page shell holds no data
        unknown = httpx.post(f"{page.url}/api/queues/nope/pause", headers=auth, json={}, timeout=10)
        assert unknown.status_code == 404 and unknown.json()["field"] == "queue"
        phase("token")

        # (3) Chromium: without the token the page asks for it and shows no data ...
        dom = Dom(chromium(browser, f"{page.url}/", tmp_path / "profile-none"))
        assert "hidden" not in dom.by_id("token-panel")["attrs"], "the page did not ask for the token"
        assert dom.find("tr", "queues-table", data_queue="to-b") == []
        phase("Chromium without token")

        # ... with it (handed over in the fragment, which never reaches the server) it draws everything.
        wait_status(page.url, lambda s: len(s["history"]["points"]) >= 6 and (queue_of(s, "writer")["out_per_s"] or 0),
                    "six samples and writer delivering")
        SCREENSHOT.parent.mkdir(exist_ok=True)
        SCREENSHOT.unlink(missing_ok=True)
        dom = Dom(chromium(browser, f"{page.url}/#token={TOKEN}", tmp_path / "profile-token", screenshot=SCREENSHOT))
        print(f"\nstatus page screenshot: {SCREENSHOT}")
        assert dom.by_id("token-panel")["attrs"].get("hidden") is not None
        assert dom.by_id("site-name")["text"] == "a" and dom.by_id("site-dsid")["text"] == "1"
        assert "hidden" in dom.by_id("error-banner")["attrs"], dom.by_id("error-banner")["text"]
        rows = {r["attrs"]["data-queue"]: r for r in dom.find("tr", "queues-table") if "data-queue" in r["attrs"]}
        assert set(rows) == {"to-b", "writer"}
        assert int(rows["to-b"]["attrs"]["data-size"]) >= WRITTEN
        assert "gateway sender → dsid 2" in rows["to-b"]["text"] and "running" in rows["writer"]["text"]
        buttons = [(b["attrs"]["data-queue"], b["attrs"]["data-action"]) for b in dom.find("button", "queues-table")]
        assert ("writer", "pause") in buttons and ("writer", "stop") in buttons and ("to-b", "resume") in buttons
        partition_rows = [r for r in dom.find("tr", "partitions-table") if "data-partition" in r["attrs"]]
        assert sorted((r["attrs"]["data-queue"], int(r["attrs"]["data-partition"])) for r in partition_rows) == \
            [("to-b", p) for p in range(4)] + [("writer", p) for p in range(2)]
        assert any(dispatcher.member_id in r["text"] for r in partition_rows if r["attrs"]["data-queue"] == "writer")
        assert [r["attrs"]["data-dsid"] for r in dom.find("tr", "sites-table") if "data-dsid" in r["attrs"]] \
            == ["1", "2"]
        regions = [r for r in dom.find("tr", "regions-table") if "data-region" in r["attrs"]]
        assert [r["attrs"]["data-region"] for r in regions] == ["orders"] and region.url in regions[0]["text"]
        assert "no subscription client" in dom.by_id("clients-table")["text"]
        for chart in ("chart-size", "chart-rate"):
            lines = dom.find("polyline", chart)
            assert {line["attrs"]["data-queue"] for line in lines} == {"to-b", "writer"}, chart
            assert all(len(line["attrs"]["points"].split()) >= 2 for line in lines), chart
        assert re.search(r"−\d+ min", dom.by_id("chart-size")["text"]), "no time axis"

        width, height, colours = png_pixels(SCREENSHOT)
        assert (width, height) == WINDOW
        assert len(colours) > 50, f"the screenshot looks blank: {len(colours)} colours"
        # The two queues' colours (app.js PALETTE) are drawn: swatches, legend and lines.
        assert (0x1F, 0x77, 0xB4) in colours and (0xD6, 0x27, 0x28) in colours
        phase("Chromium with token, screenshot")

        # With the token an action is carried out: the dispatcher pauses, then runs again.
        paused = httpx.post(f"{page.url}/api/queues/writer/pause", headers=auth, json={}, timeout=30)
        assert paused.status_code == 200 and paused.json()["state"] == "PAUSED", paused.text
        assert [(r["state"], r["issued_by"]) for r in control_records(cfg, "writer")] == \
            [("PAUSED", "sluice admin serve")]
        wait_status(page.url, lambda s: queue_of(s, "writer")["states"] == ["paused"], "writer paused")
        assert httpx.post(f"{page.url}/api/queues/writer/resume", headers=auth, json={}, timeout=30).status_code == 200
        wait_status(page.url, lambda s: queue_of(s, "writer")["states"] == ["running"], "writer running again")
        phase("pause and resume")
    assert write_errors == []
    print("phases: " + ", ".join(f"{name} {t - before:.1f} s" for (_, before), (name, t) in zip(phases, phases[1:])))
