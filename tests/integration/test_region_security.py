"""Trust boundaries of the region service: no client, topic writer or forged request can destroy,
redirect or pin a site's data (issue 17).

One site on the session's broker with the client token and the member token set and
``member_hosts: [127.0.0.1]``, two region-service instances A and B sharing region ``orders`` (8
buckets) and region ``scratch`` (2 buckets), and a request body limit of 256 KiB.  The tests share
them; the last one deletes ``scratch``'s changelog topic.
"""

from __future__ import annotations

import http.server
import json
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig
from sluice.core.eventchecks import ID_MAX
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import make_consumer, partition_for_key, read_to_end
from sluice.core.remotewire import encode_remote
from sluice.core.directory import MemberTrust, live_urls, read_instances

from regionkit import RegionProcess, write_site
from waiting import read_until
from waiting import wait_for as _wait_for

#: One worker of `pytest -n` runs the whole module: its services are started once, in a module-scoped fixture.
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("region_security")]

TOKEN = "client-" + uuid.uuid4().hex
MEMBER_TOKEN = "member-" + uuid.uuid4().hex
BODY_MAX = 256 * 1024
CLIENT_AUTH = {"authorization": f"Bearer {TOKEN}"}
MEMBER_AUTH = {"authorization": f"Bearer {MEMBER_TOKEN}"}


class Site:
    def __init__(self, cfg: SiteConfig, path: Path, bootstrap: str, a: RegionProcess, b: RegionProcess) -> None:
        self.cfg, self.path, self.bootstrap, self.a, self.b = cfg, path, bootstrap, a, b

    def client(self, url: str | None = None, token: str = TOKEN, **kwargs: Any) -> RegionClient:
        return RegionClient([url or self.a.url], token=token, **kwargs)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return _wait_for(condition, timeout_s=timeout_s, what=what, poll_s=0.2)


@pytest.fixture(scope="module")
def site(site_a, tmp_path_factory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("security")
    prefix = site_a.topic_prefix(f"t{uuid.uuid4().hex[:8]}.")
    regions = [
        {"name": "orders", "buckets": 8, "gateway_senders": ["to-b"], "key_max_bytes": 128, "value_max_bytes": 4096},
        {"name": "scratch", "buckets": 2},
    ]
    cfg = write_site(tmp / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix, extra={
        "regions": regions, "async_event_queues": [],
        "region_service": {"request_timeout_s": 20, "load_timeout_s": 30, "token": TOKEN,
                           "member_token": MEMBER_TOKEN, "member_hosts": ["127.0.0.1"],
                           "request_body_max_bytes": BODY_MAX}})
    a = RegionProcess(tmp / "site.yaml", tmp / "region-a.log", wait=False)
    b = RegionProcess(tmp / "site.yaml", tmp / "region-b.log", wait=False)
    try:
        for proc in (a, b):
            proc.wait_started()
        for proc in (a, b):
            proc.wait_ready()
        yield Site(cfg, tmp / "site.yaml", site_a.bootstrap, a, b)
    finally:
        a.stop()
        b.stop()


def stats(proc: RegionProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{proc.url}/stats", headers=CLIENT_AUTH, timeout=10).json())


def post(url: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         content: bytes | None = None) -> httpx.Response:
    sent = {"content-type": "application/json", **(headers if headers is not None else CLIENT_AUTH)}
    if content is None and body is not None:
        content = json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=sent, timeout=30)


def remote_event(key: str, *, dsid: int = 2, ts: int | None = None, seq: int = 0, value: bytes = b'{"r":1}',
                 member: str = "site-2-m") -> EntryEvent:
    ts = int(time.time() * 1000) if ts is None else ts
    return EntryEvent(region="orders", key=key, operation=Operation.CREATE, value=value,
                      event_id=EventID(member, 1, seq), version=VersionTag(dsid, ts, 1, "m2"), origin_dsid=dsid,
                      bucket=0, event_time=ts)


class FakeMember:
    """An HTTP server that records every request it gets and answers each 'ok'."""

    def __init__(self, host: str) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                owner.requests.append(("POST", self.path, dict(self.headers)))
                data = b'{"outcomes": [], "entries": {}, "not_owned": [], "keys": []}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def instance_record(name: str, url: str, cfg: SiteConfig) -> bytes:
    now = int(time.time() * 1000)
    claims = [{"region": r.name, "bucket": b, "since": now + 3_600_000} for r in cfg.regions for b in range(r.buckets)]
    return get_codec().encode("RegionInstance", {"instance": name, "url": url, "state": "running",
                                                 "buckets": claims, "updated_at": now})


def test_each_path_takes_its_own_credential_compared_in_constant_time(site: Site) -> None:
    """Client paths take the client token only, /internal/* and apply_remote the member token only; a
    missing or non-ASCII header is a 401, not an error; the probes are open."""
    url = site.a.url
    put = {"key": "auth-k", "value": 1}
    assert post(url, "/regions/orders/put", put, headers={}).status_code == 401
    assert post(url, "/regions/orders/put", put, headers=MEMBER_AUTH).status_code == 401
    refused = httpx.post(f"{url}/regions/orders/put", content=b'{"key":"auth-k","value":1}',
                         headers=[(b"content-type", b"application/json"), (b"authorization", b"Bearer \xff\xfe")])
    assert refused.status_code == 401 and refused.json()["field"] == "authorization"
    forwarded = {"ops": [{"op": "put", "region": "orders", "key": "auth-k", "value": "1"}]}
    for path, body in (("/internal/ops", forwarded), ("/internal/read", {"region": "orders", "keys": ["auth-k"]}),
                       ("/internal/keys", {"region": "orders", "bucket": 0}),
                       ("/regions/orders/apply_remote", {"events": [encode_remote(remote_event("auth-r"))]})):
        for headers in ({}, CLIENT_AUTH):
            r = post(url, path, body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert set(r.json()) >= {"error", "message", "field", "reason", "retriable"}
    assert "client token does not open it" in post(url, "/internal/ops", forwarded).json()["reason"]
    assert post(url, "/regions/orders/apply_remote", {"events": [encode_remote(remote_event("auth-r"))]},
                headers=MEMBER_AUTH).status_code == 200
    assert post(url, "/regions/orders/put", put).status_code == 200
    for path in ("/healthz", "/readyz"):
        assert httpx.get(url + path).status_code == 200
    assert httpx.get(f"{url}/openapi.json").status_code == 401
    assert httpx.get(f"{url}/openapi.json", headers=CLIENT_AUTH).status_code == 200


def test_a_cross_site_request_changes_nothing(site: Site) -> None:
    """A body-less POST to /clear with a foreign Origin (what a web page can make a browser send), a
    cross-site fetch and a form's content type are refused 403 naming why, even carrying the
    token; nothing is cleared.  clear with ``{}`` works."""
    client = site.client()
    client.put("orders", "csrf-k", 1)
    url = site.a.url
    attempts = [
        ({**CLIENT_AUTH, "origin": "http://evil.example"}, None, "origin"),
        ({**CLIENT_AUTH, "referer": "http://evil.example/page"}, b"{}", "referer"),
        ({**CLIENT_AUTH, "sec-fetch-site": "cross-site"}, b"{}", "sec-fetch-site"),
        ({**CLIENT_AUTH, "content-type": "text/plain"}, b"{}", "content-type"),
        ({**CLIENT_AUTH, "content-type": "application/x-www-form-urlencoded"}, b"a=b", "content-type"),
    ]
    for headers, content, field in attempts:
        sent = dict(headers)
        if "content-type" not in sent and content is not None:
            sent["content-type"] = "application/json"
        r = httpx.post(f"{url}/regions/orders/clear", content=content, headers=sent, timeout=30)
        assert r.status_code == 403 and r.json()["field"] == field, (headers, r.text)
    r = httpx.post(f"{url}/regions/orders/clear", headers=CLIENT_AUTH, timeout=30)
    assert r.status_code == 403 and r.json()["field"] == "content-type", r.text
    assert client.get("orders", "csrf-k") == 1
    own = {**CLIENT_AUTH, "content-type": "application/json", "origin": url}
    r = httpx.delete(f"{url}/regions/orders/entries/csrf-k", headers=own, timeout=30)
    assert r.status_code == 200, r.text
    assert post(url, "/regions/scratch/clear", {}).json()["status"] == "ok"
    assert client.clear("scratch")["status"] == "ok"


def test_forged_wan_events_are_refused_one_by_one_and_pin_nothing(site: Site) -> None:
    """An event claiming dsid 2 stamped in the year 2100 is an error outcome of its own (the good event
    beside it applies), so the key is not pinned: a local write after it wins."""
    member = site.client(token=MEMBER_TOKEN)
    future = remote_event("pinned", ts=4_102_444_800_000)
    good = remote_event("landed")
    answer = member.apply_remote("orders", [future, good], outcomes="all")
    assert [o["status"] for o in answer["outcomes"]] == ["error", "ok"], answer
    assert answer["outcomes"][0]["error"]["field"] == "events[0].version.timestamp"
    client = site.client()
    assert client.get_entry("orders", "pinned") is None and client.get("orders", "landed") == {"r": 1}
    assert client.put("orders", "pinned", "local")["status"] == "ok"
    assert client.get("orders", "pinned") == "local"
    # dsids out of range and a value that is not JSON: refused the same way.
    bad = [remote_event("d0", dsid=0), remote_event("nan", value=b"[NaN]"), remote_event("big", seq=2**62)]
    answer = member.apply_remote("orders", bad, outcomes="all")
    assert [o["error"]["field"] for o in answer["outcomes"]] == \
        ["events[0].origin_dsid", "events[1].value", "events[2].event_id.sequence_id"], answer


def test_forwarded_operations_are_checked_like_a_clients(site: Site) -> None:
    """/internal/ops with the member token: a value that is not JSON, a key in another bucket than the one
    named and an EventID beyond the bounds are error outcomes, stored nowhere; GET stays a 404."""
    key = "fwd-k"
    owner_bucket = partition_for_key(key.encode(), 8)
    ops = [
        {"op": "put", "region": "orders", "key": key, "value": "not json"},
        {"op": "put", "region": "orders", "key": key, "value": "1", "bucket": (owner_bucket + 1) % 8},
        {"op": "put", "region": "orders", "key": key, "value": "[1e999]"},
        {"op": "remote", "region": "orders", "key": key, "remote": encode_remote(remote_event("another-key"))},
        {"op": "remote", "region": "orders", "key": key,
         "remote": encode_remote(remote_event(key, ts=4_102_444_800_000))},
        {"op": "destroy", "region": "orders", "key": key, "value": "1"},
    ]
    for url in (site.a.url, site.b.url):  # one of them owns the bucket
        r = post(url, "/internal/ops", {"ops": ops}, headers=MEMBER_AUTH)
        assert r.status_code == 200, r.text
        fields = [o.get("error", {}).get("field") for o in r.json()["outcomes"]]
        assert fields == ["ops[0].value", "ops[1].bucket", "ops[2].value", "ops[3].remote",
                          "ops[4].remote.version.timestamp", "ops[5].value"], r.text
    r = post(site.a.url, "/internal/ops", {"ops": [{**ops[0], "value": "1", "event_id": {
        "member_id": "m", "thread_id": 0, "sequence_id": ID_MAX + 1}}]}, headers=MEMBER_AUTH)
    assert r.status_code == 400 and r.json()["field"] == "ops.0.event_id.sequence_id", r.text
    assert httpx.get(f"{site.a.url}/regions/orders/entries/{key}", headers=CLIENT_AUTH).status_code == 404


def test_no_caller_pins_another_members_event_id_stream(site: Site) -> None:
    """Sequences beyond 2^53 - 1 (2^63 - 1 included), a put_all running past it, and a jump of more than
    2^32 past the stream's highest sequence in the bucket are refused: the victim's next write applies."""
    client = site.client()
    victim = EventID("victim-member", 1, 5)
    assert client.put("orders", "victim-k", 1, event_id=victim)["status"] == "ok"
    url = site.a.url
    for seq, field in ((2**63 - 1, "event_id.sequence_id"), (ID_MAX + 1, "event_id.sequence_id"),
                       (5 + 2**32 + 1, "event_id.sequence_id")):
        r = post(url, "/regions/orders/put", {"key": "victim-k", "value": 2, "event_id": {
            "member_id": "victim-member", "thread_id": 1, "sequence_id": seq}})
        assert r.status_code == 400 and r.json()["field"] == field, (seq, r.text)
    r = post(url, "/regions/orders/put_all", {"entries": {"p1": 1, "p2": 2, "p3": 3}, "event_id": {
        "member_id": "victim-member", "thread_id": 2, "sequence_id": ID_MAX - 1}})
    assert r.status_code == 400 and r.json()["field"] == "event_id.sequence_id", r.text
    assert client.put("orders", "victim-k", 3, event_id=EventID("victim-member", 1, 6))["status"] == "ok"
    assert client.get("orders", "victim-k") == 3


def test_nan_and_infinity_are_refused_naming_the_field(site: Site) -> None:
    """NaN, Infinity and 1e999 (which Python reads as Infinity) are refused with 400, not stored as null."""
    url = site.a.url
    for raw, field in ((b'{"key": "nan-k", "value": NaN}', "value"),
                       (b'{"key": "nan-k", "value": {"a": [1, -Infinity]}}', "value"),
                       (b'{"key": "nan-k", "value": 1e999}', "value"),
                       (b'{"entries": {"nan-k": NaN}}', "entries.nan-k")):
        path = "/regions/orders/put_all" if b"entries" in raw else "/regions/orders/put"
        r = post(url, path, content=raw)
        assert r.status_code == 400 and r.json()["field"] == field, (raw, r.text)
    r = httpx.put(f"{url}/regions/orders/entries/nan-k", content=b"NaN",
                  headers={**CLIENT_AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert httpx.get(f"{url}/regions/orders/entries/nan-k", headers=CLIENT_AUTH).status_code == 404


def _vm_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _send_huge(url: str, total: int, chunked: bool) -> bytes:
    """POST a ``total``-byte body to /regions/orders/put_all until the service answers; its answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    framing = "transfer-encoding: chunked" if chunked else f"content-length: {total}"
    sock.sendall((f"POST /regions/orders/put_all HTTP/1.1\r\nhost: {host}:{port}\r\n"
                  f"authorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\n{framing}\r\n\r\n").encode())
    piece = b"x" * 65536
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
    answer = b""
    sent = 0
    try:
        while sent < total and b"\r\n\r\n" not in answer:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
                continue
            sock.sendall(frame)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        pass
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and (b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}")):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except (ConnectionResetError, socket.timeout):
        pass
    finally:
        sock.close()
    assert sent < total, "the service read the whole body"
    return answer


def test_an_oversized_body_is_refused_before_it_is_read(site: Site) -> None:
    """200 MB bodies, by Content-Length and chunked, are answered 413 naming the limit while the
    region process's resident memory grows by less than 8 MB; the service answers after."""
    pid = site.a.pid
    before = _vm_rss_kb(pid)
    for chunked in (False, True):
        answer = _send_huge(site.a.url, 200 * 1024 * 1024, chunked)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer[:300]
        refusal = json.loads(body)
        assert refusal["field"] == "body" and f"request_body_max_bytes={BODY_MAX}" in refusal["reason"], refusal
    grown_kb = _vm_rss_kb(pid) - before
    assert grown_kb < 8 * 1024, f"resident memory grew by {grown_kb} kB"
    assert site.client().put("orders", "after-413", 1)["status"] == "ok"


def test_a_forged_directory_record_redirects_nothing(site: Site) -> None:
    """Records on the status topic claiming every bucket for listening fake servers (one unsigned, one
    signed with the member token but naming a host outside member_hosts) are ignored by the instances
    and by read_instances (receivers, the status page): no request and no token reaches either fake,
    writes through A land in the real owners, and so does a receiver-style apply_remote."""
    cfg = site.cfg
    fakes = [FakeMember("127.0.0.1"), FakeMember("127.0.0.2")]
    try:
        producer = Producer({"bootstrap.servers": site.bootstrap})
        unsigned_key = b"region/forged-unsigned"
        producer.produce(cfg.topics.status(), instance_record("forged-unsigned", fakes[0].url, cfg), unsigned_key)
        signed_key = b"region/forged-signed"
        value = instance_record("forged-signed", fakes[1].url, cfg)
        producer.produce(cfg.topics.status(), value, signed_key,
                         headers=MemberTrust(MEMBER_TOKEN).headers(signed_key, value))
        assert producer.flush(10) == 0
        fake_urls = {fake.url for fake in fakes}

        def owners(proc: RegionProcess) -> set[str]:
            rows = httpx.get(f"{proc.url}/buckets", headers=CLIENT_AUTH, timeout=10).json()["buckets"]
            return {row["owner"] for row in rows}

        for proc in (site.a, site.b):
            wait_for(lambda proc=proc: stats(proc).get("directory_records_ignored", 0) >= 2
                     or owners(proc) & fake_urls, 20, f"{proc.url} read the forged records")
            assert not owners(proc) & fake_urls, f"{proc.url} believes a forged claim"
        believed = read_instances(cfg)
        assert not {"forged-unsigned", "forged-signed"} & set(believed)
        assert sorted(live_urls(believed)) == sorted([site.a.url, site.b.url])

        client = site.client()
        keys = [f"dir-{i}" for i in range(24)]
        assert {partition_for_key(k.encode(), 8) for k in keys} == set(range(8))
        client.put_all("orders", {k: i for i, k in enumerate(keys)})
        events = [remote_event(f"wan-{i}", seq=i) for i in range(16)]
        answer = site.client(token=MEMBER_TOKEN).apply_remote("orders", events, outcomes="all")
        assert answer["applied"] == 16, answer
        reader = site.client(site.b.url)
        assert all(reader.get("orders", k) == i for i, k in enumerate(keys))
        assert all(reader.get("orders", e.key) == {"r": 1} for e in events)
        assert [fake.requests for fake in fakes] == [[], []]
    finally:
        for fake in fakes:
            fake.close()


def test_a_non_loopback_bind_without_credentials_is_refused(site: Site, tmp_path: Path) -> None:
    """``--host 0.0.0.0`` on a site file without token and member_token stops the instance at start,
    naming the settings, before it contacts Kafka."""
    data = yaml.safe_load(site.path.read_text())
    data["region_service"] = {"request_timeout_s": 20}
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "region", "-c", str(path), "--host", "0.0.0.0",
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    for name in ("region_service.token", "region_service.member_token", "allow_unauthenticated"):
        assert name in done.stderr, done.stderr


def test_an_unreadable_changelog_record_is_dead_lettered_once_and_the_bucket_loads(site: Site, tmp_path: Path
                                                                                   ) -> None:
    """A corrupt record in a changelog partition goes to the region .dlq with its reason when the
    bucket loads (a third instance joins and loads the buckets it takes), not again when it reloads
    (the third leaves, and A and B load them back), and the bucket answers reads and writes throughout."""
    cfg = site.cfg
    topic = cfg.topics.region_changelog("orders")
    keys = {b: next(f"dl-{i}" for i in range(1000) if partition_for_key(f"dl-{i}".encode(), 8) == b)
            for b in range(8)}
    client = site.client()
    producer = Producer({"bootstrap.servers": site.bootstrap})
    sources: dict[bytes, int] = {}
    for bucket, key in keys.items():  # every bucket: whichever the third takes holds one
        client.put("orders", key, "before")
        # Where the record landed, from its delivery report (the put's commit marker may land after it).
        producer.produce(topic, b"\x00 not an event", b"corrupt", partition=bucket,
                         on_delivery=lambda err, msg: sources.setdefault(
                             f"{msg.topic()}/{msg.partition()}/{msg.offset()}".encode(), msg.offset()))
        assert producer.flush(10) == 0
    assert len(sources) == 8

    def dead_letters() -> list[dict[str, Any]]:
        consumer = make_consumer({"bootstrap.servers": site.bootstrap}, None)
        try:
            return [get_codec().decode_as("DeadLetter", m.value())
                    for m in read_to_end(consumer, cfg.topics.region_dead_letter(), 0) if m.key() in sources]
        finally:
            consumer.close()

    def owned_by(url: str) -> set[int]:
        rows = httpx.get(f"{site.a.url}/buckets", headers=CLIENT_AUTH, timeout=10).json()["buckets"]
        return {row["bucket"] for row in rows if row["region"] == "orders" and row["owner"] == url}

    third = RegionProcess(site.path, tmp_path / "region-c.log")
    third_url = third.url
    try:
        third.wait_ready()
        # The directory lists the third's buckets as it loads each, so its share is read until it
        # matches the dead letters: exactly one for each bucket the third took, none from A or B.
        taken, found = read_until(lambda: (owned_by(third_url), dead_letters()), lambda seen: seen[0] and sorted(
            letter["source_partition"] for letter in seen[1]) == sorted(seen[0]), timeout_s=60, poll_s=0.2)
        assert taken and sorted(letter["source_partition"] for letter in found) == sorted(taken), \
            f"the region .dlq holds the corrupt records of buckets " \
            f"{sorted(letter['source_partition'] for letter in found)}; the third took {sorted(taken)}"
        for letter in found:
            bucket = letter["source_partition"]
            assert letter["source_topic"] == topic
            assert f"{topic}/{bucket}/{letter['source_offset']}".encode() in sources  # the corrupt record's place
            assert letter["value"] == b"\x00 not an event" and letter["key"] == b"corrupt"
            assert "unreadable" in letter["reason"] and letter["error_class"] in ("MalformedRecord", "UnknownSchema")
            assert client.get("orders", keys[bucket]) == "before"
    finally:
        third.stop()

    def owners() -> set[str]:
        rows = httpx.get(f"{site.a.url}/buckets", headers=CLIENT_AUTH, timeout=10).json()["buckets"]
        return {row["owner"] for row in rows if row["region"] == "orders"}

    # The third's clean leave moves its buckets back to A and B, which load them.
    wait_for(lambda: third_url not in owners() and owners() == {site.a.url, site.b.url}, 60,
             "A and B own every bucket again")
    for proc in (site.a, site.b):
        proc.wait_ready()
    for bucket in taken:
        assert client.put("orders", keys[bucket], "after")["status"] == "ok"
        assert site.client(site.b.url).get("orders", keys[bucket]) == "after"
    assert len(dead_letters()) == len(taken), "dead-lettered again on reload"


def test_readyz_says_why_when_a_changelog_topic_is_gone(site: Site) -> None:
    """Deleting region scratch's changelog topic turns /readyz to 503 naming the topic on both instances
    (reads of scratch could no longer be served)."""
    topic = site.cfg.topics.region_changelog("scratch")
    admin = AdminClient({"bootstrap.servers": site.bootstrap})
    admin.delete_topics([topic])[topic].result(30)

    def not_ready(proc: RegionProcess) -> dict[str, Any] | None:
        r = httpx.get(f"{proc.url}/readyz", timeout=5)
        return r.json() if r.status_code == 503 and topic in r.json()["not_ready"].get("topics", "") else None

    for proc in (site.a, site.b):
        body = wait_for(lambda proc=proc: not_ready(proc), 30, f"{proc.url} not ready, naming {topic}")
        assert body["ready"] is False and "topic missing" in body["not_ready"]["topics"], body
    assert all(not_ready(proc) for proc in (site.a, site.b)), "nothing recreates the topic"
