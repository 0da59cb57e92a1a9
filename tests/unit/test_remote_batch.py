"""A gateway batch handed to its bucket owners, without a broker or a network: the owner applying it
(sluice.region.remote), the guard of its route, the receiver's client of it
(sluice.core.regionclient.BatchClient) and the receiver routing a batch's events to their owners.

The owner is given a GatewayBatch record as bytes: it decodes each event once, merges the sender's
changes in, checks it, hands the rest to the service's ``execute`` without letting it forward, and
answers with counts, the refused events and the last applied one; nothing per applied event.  The
receiver decodes nothing: it routes each event by its key and the directory, keeps a bucket's events
in order when the bucket moves, halves a request refused whole and retries a refused credential.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from sluice.core.regionclient import BatchAnswer, BatchClient, RegionError
from sluice.core.codec import get_codec
from sluice.core.config import parse_config
from sluice.core.errors import InvalidRequest, NotOwner, SluiceError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.eventwire import entry_event_body, gateway_batch, gateway_batch_v2, read_gateway_batch
from sluice.core.kafka import partition_for_key
from sluice.receiver import routing as routing_module
from sluice.receiver.routing import OwnerRouting
from sluice.receiver.service import ReceiverService
from sluice.region.engine import OpResult
from sluice.region.engine import Operation as EngineOperation
from sluice.region.guard import Guard
from sluice.region.remote import apply_batch
from sluice.region.state import Op

NOW_MS = int(time.time() * 1000)
CFG = parse_config({
    "site": "b", "dsid": 2, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "regions": [{"name": "orders", "buckets": 8, "key_max_bytes": 16}],
})


def event(key: str, seq: int, *, visited: tuple[int, ...] = (), duplicate: bool = False, origin: int = 1,
          region: str = "orders") -> EntryEvent:
    return EntryEvent(region, key, Operation.UPDATE, b'{"n":1}', EventID("a-writer", 1, seq),
                      VersionTag(origin, NOW_MS, 1, "a-0"), origin, 0, NOW_MS, visited_dsids=visited,
                      possible_duplicate=duplicate)


def batch(events: list[EntryEvent], *, target: int = 2, duplicates: tuple[int, ...] = (), resend: bool = False,
          traces: tuple[str, ...] = (), bodies: list[bytes] | None = None) -> bytes:
    return gateway_batch(get_codec().header("GatewayBatch"), sender_id="to-b", source_dsid=1, target_dsid=target,
                         queue_partition=0, batch_id=7, first_offset=0, last_offset=len(events) - 1,
                         possible_duplicate=resend, created_at=NOW_MS,
                         bodies=bodies if bodies is not None else [entry_event_body(e) for e in events],
                         duplicate_events=duplicates, visited_added={"orders": [1, 3]}, traceparents=traces)


class Service:
    """What apply_batch uses of a RegionService: its config and ``apply_owned``, which answers each op with
    the engine result ``answer`` gives it (a status, or an error) and records what it was handed."""

    def __init__(self, answer: Any = lambda op: "ok") -> None:
        self.cfg = CFG
        self.answer = answer
        self.handed: list[EngineOperation] = []

    async def apply_owned(self, ops: list[EngineOperation]) -> list[OpResult]:
        self.handed += ops
        results = []
        for op in ops:
            status = self.answer(op)
            if isinstance(status, SluiceError):
                results.append(OpResult(error=status))
            else:
                results.append(OpResult(duplicate=status == "duplicate", conflict_lost=status == "conflict",
                                        skipped=status == "skipped"))
        return results

    def _start_spans(self, ops: list[EngineOperation]) -> list[Any]:
        return []


def run(service: Service, data: bytes) -> dict[str, Any]:
    return asyncio.run(apply_batch(service, data))  # type: ignore[arg-type]


def test_every_event_applied_is_answered_by_counts_and_the_last_one_alone() -> None:
    """Three events applied (one a repeat, one a lost conflict): counts, no refusal, the last index and
    EventID; each handed over as Op.REMOTE with the sender's changes merged in (visited sites without the
    origin, possibleDuplicate from the batch's duplicate_events) and its trace context."""
    statuses = {"k0": "ok", "k1": "duplicate", "k2": "conflict"}
    service = Service(lambda op: statuses[op.key])
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    answer = run(service, batch([event("k0", 1), event("k1", 2, visited=(4,)), event("k2", 3)], duplicates=(1,),
                                traces=(trace, "", "")))
    assert answer == {"count": 3, "applied": 1, "duplicates": 1, "conflicts": 1, "skipped": 0, "refused": [],
                      "last_applied": {"index": 2, "event_id": {"member_id": "a-writer", "thread_id": 1,
                                                                "sequence_id": 3}}}
    assert [op.op for op in service.handed] == [Op.REMOTE] * 3
    remote = [op.remote for op in service.handed]
    assert [(e.visited_dsids, e.possible_duplicate) for e in remote] == [((3,), False), ((3, 4), True), ((3,), False)]
    assert service.handed[0].trace == [("traceparent", trace.encode())] and service.handed[1].trace is None


def test_refused_events_are_listed_alone_and_never_stop_the_others() -> None:
    """A key too long for this site, a body that does not decode (its EventID still read), an event from this
    very site and one the service refuses for good are each a refusal, in index order; a bucket owned
    elsewhere is refused as retriable; the others apply."""
    damaged = entry_event_body(event("k3", 4))[:-3]
    refused_by_engine = InvalidRequest("key", "k5", "refused by the engine")

    def answer(op: EngineOperation) -> Any:
        return {"k5": refused_by_engine, "k6": NotOwner("orders", 3, None)}.get(op.key, "ok")

    service = Service(answer)
    events = [event("k0", 1), event("x" * 17, 2), event("k2", 3), event("k3", 4), event("k4", 5, origin=2),
              event("k5", 6), event("k6", 7), event("k7", 8)]
    bodies = [entry_event_body(e) for e in events]
    bodies[3] = damaged
    answer_ = run(service, batch(events, bodies=bodies))
    refused = [(r["index"], r["error"], r["retriable"], r["event_id"] and r["event_id"]["sequence_id"])
               for r in answer_["refused"]]
    assert refused == [(1, "EntryTooLarge", False, 2), (3, "MalformedRecord", False, 4),
                       (4, "InvalidRequest", False, 5), (5, "InvalidRequest", False, 6), (6, "NotOwner", True, 7)]
    assert "events[1].key" in answer_["refused"][0]["message"]
    assert "events[3]: not an EntryEvent" in answer_["refused"][1]["message"]
    assert (answer_["applied"], answer_["last_applied"]["index"]) == (3, 7)
    assert [op.key for op in service.handed] == ["k0", "k2", "k5", "k6", "k7"]


def test_a_record_that_does_not_read_or_names_another_site_is_refused_whole() -> None:
    """Bytes that are no GatewayBatch are a 400 naming the body; a batch for another dsid is RejectedBatch;
    nothing is handed to the service."""
    service = Service()
    with pytest.raises(InvalidRequest, match="not a GatewayBatch"):
        run(service, b"\xc3\x01garbage")
    with pytest.raises(InvalidRequest, match="for dsid 3"):
        run(service, batch([event("k0", 1)], target=3))
    assert service.handed == []


def test_an_older_version_applies_as_it_was_sent() -> None:
    """A version-2 record (events as records, the old sender's changes already in them) applies with those
    events unchanged: merging the sender's dsid into an event of its own site changes nothing."""
    sent = event("k0", 1, visited=(3,), duplicate=True)
    record = gateway_batch_v2(sender_id="to-b", source_dsid=1, target_dsid=2, queue_partition=0, batch_id=7,
                              first_offset=0, last_offset=0, possible_duplicate=False, created_at=NOW_MS,
                              bodies=[entry_event_body(sent)])
    service = Service()
    assert run(service, record)["applied"] == 1
    assert service.handed[0].remote == sent


# --- the guard of the binary route ------------------------------------------------------------

MEMBER_TOKEN = "member-token-0123456789"


class Echo:
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def guarded() -> Iterator[TestClient]:
    yield TestClient(Guard(Echo(), token="client-token-0123456789", member_token=MEMBER_TOKEN, body_max_bytes=1024),
                     base_url="http://region:7071")


def test_the_batch_route_takes_the_member_token_and_an_avro_body_only(guarded: TestClient) -> None:
    """/internal/apply_batch opens with the member token and application/avro (or octet-stream); without the
    token it is 401, a form or text body is 403 as anywhere, another origin is 403, a body past the cap is
    413; other paths still refuse a binary body."""
    member = {"authorization": f"Bearer {MEMBER_TOKEN}"}
    for media in ("application/avro", "application/octet-stream", "Application/Avro; charset=binary"):
        assert guarded.post("/internal/apply_batch", content=b"\xc3\x01", headers={**member, "content-type": media}
                            ).status_code == 200, media
    assert guarded.post("/internal/apply_batch", content=b"x", headers={"content-type": "application/avro"}
                        ).status_code == 401
    for media in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**member, **({"content-type": media} if media else {})}
        assert guarded.post("/internal/apply_batch", content=b"x", headers=headers).status_code == 403, media
    assert guarded.post("/internal/apply_batch", content=b"x", headers={
        **member, "content-type": "application/avro", "origin": "http://evil.example"}).status_code == 403
    assert guarded.post("/internal/apply_batch", content=b"x" * 2000, headers={
        **member, "content-type": "application/avro"}).status_code == 413
    assert guarded.post("/internal/ops", content=b"{}", headers={**member, "content-type": "application/avro"}
                        ).status_code == 403


# --- the receiver's client ---------------------------------------------------------------------


def client_answering(handler: Any) -> BatchClient:
    client = BatchClient(token=MEMBER_TOKEN)
    client._http = httpx.Client(transport=httpx.MockTransport(handler), headers=client._http.headers)
    return client


def test_the_batch_client_posts_the_record_as_it_is_and_reads_the_answer() -> None:
    """One POST of the bytes given, application/avro with the member token; the answer's last applied event
    comes back as (index, EventID)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"count": 2, "applied": 2, "duplicates": 0, "conflicts": 0, "skipped": 0,
                                         "refused": [], "last_applied": {"index": 1, "event_id": {
                                             "member_id": "m", "thread_id": 1, "sequence_id": 9}}})

    with client_answering(handler) as client:
        answer = client.apply_batch("http://owner:7071/", b"\xc3\x01record")
    assert answer.last_applied == (1, EventID("m", 1, 9)) and answer.applied == 2 and answer.refused == []
    [request] = seen
    assert (str(request.url), request.content) == ("http://owner:7071/internal/apply_batch", b"\xc3\x01record")
    assert request.headers["content-type"] == "application/avro"
    assert request.headers["authorization"] == f"Bearer {MEMBER_TOKEN}"


@pytest.mark.parametrize(("status", "body", "raised", "retriable"), [
    (400, {"error": "InvalidRequest", "message": "body: not a GatewayBatch"}, RegionError, False),
    (413, {"error": "RequestTooLarge", "message": "too large"}, RegionError, False),
    (401, {"error": "Unauthorized", "message": "member token"}, RegionError, False),
    (503, {"error": "BrokerUnavailable", "message": "later", "retriable": True}, SluiceError, True),
    (500, "not json at all", SluiceError, True),
])
def test_a_refused_or_unanswered_request_is_told_apart(status: int, body: Any, raised: type, retriable: bool) -> None:
    """A 4xx refuses the request (RegionError with its status: the receiver halves it, or alerts on 401/403);
    a 5xx, an answer that is not JSON and no connection are retriable."""
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, content=body.encode())
        return httpx.Response(status, json=body)

    with client_answering(handler) as client, pytest.raises(raised) as info:
        client.apply_batch("http://owner:7071", b"x")
    assert info.value.retriable is retriable
    if isinstance(info.value, RegionError):
        assert info.value.status == status

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with client_answering(refuse) as client, pytest.raises(SluiceError) as info:
        client.apply_batch("http://owner:7071", b"x")
    assert info.value.retriable


# --- the receiver handing a batch to its owners ----------------------------------------------------
RECEIVING = parse_config({
    "site": "b", "dsid": 2, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "regions": [{"name": "orders", "buckets": 8}],
    "receiver": {"accepted_dsids": [1], "apply_events_max": 3},
})


class Owners:
    """The directory: (region, bucket) -> URL, changed by the test as buckets move."""

    def __init__(self, table: dict[int, str]) -> None:
        self.table = table

    def owner(self, region: str, bucket: int) -> str | None:
        return self.table.get(bucket)

    def refresh(self) -> None:
        pass


class Owner:
    """The instances behind the URLs: each request's (url, keys), answered by ``answer(url, keys)``: a dict of
    key -> (error, retriable) for the events it refuses, or an exception to raise."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.requests: list[tuple[str, list[str]]] = []
        self.records: list[bytes] = []

    def apply_batch(self, url: str, record: bytes) -> BatchAnswer:
        view = read_gateway_batch(get_codec(), record)
        keys = [e.key for e in view.events()]
        self.requests.append((url, keys))
        self.records.append(record)
        result = self.answer(url, keys)
        if isinstance(result, Exception):
            raise result
        refused = [{"index": i, "error": result[k][0], "message": f"{k} refused", "retriable": result[k][1],
                    "event_id": None} for i, k in enumerate(keys) if k in result]
        applied = [i for i, k in enumerate(keys) if k not in result]
        last = (applied[-1], view.events()[applied[-1]].event_id) if applied else None
        return BatchAnswer(len(keys), len(applied), 0, 0, refused, last)


def bucket(key: str) -> int:
    return partition_for_key(key.encode(), 8)


def handed(events: list[EntryEvent], owners: dict[int, str], answer: Any,
           moves: dict[int, str] | None = None) -> tuple[Any, Owner, ReceiverService, bytes]:
    """A receiver handing one batch of ``events`` over; ``moves`` take effect once a request was refused."""
    receiver = ReceiverService(RECEIVING, member_id="b-receiver-test")
    directory = Owners(dict(owners))
    owner = Owner(answer)
    routing = routing_of(receiver, owner, directory, refresh=lambda: directory.table.update(moves or {}))
    value = batch(events)
    view = read_gateway_batch(get_codec(), value)
    return routing.apply(view, value, threading.Event(), [None] * len(events)), owner, receiver, value


def routing_of(receiver: ReceiverService, owner: "Owner", directory: "Owners", refresh: Any = lambda: None) -> Any:
    """The receiver's routing (as ``ReceiverService.start`` makes it) with ``owner`` for its client."""
    return OwnerRouting(RECEIVING, owner, directory, get_codec().header("GatewayBatch"),  # type: ignore[arg-type]
                        refresh=refresh, count=receiver._count, alert_unauthorized=receiver._alert_unauthorized)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing_module, "APPLY_BACKOFF_FIRST_S", 0.0)


def keys_in(owner_url: str, n: int) -> list[str]:
    """``n`` keys whose buckets the test gives to ``owner_url`` (even buckets to x, odd to y)."""
    want = 0 if owner_url == "http://x" else 1
    return [k for k in (f"k{i}" for i in range(200)) if bucket(k) % 2 == want][:n]


SPLIT = {b: "http://x" if b % 2 == 0 else "http://y" for b in range(8)}


def test_one_owner_of_every_event_gets_the_record_as_received_and_the_ack_its_last_event() -> None:
    """Three events of one owner: one request, the batch's bytes as they came; the last applied event is
    the ack's, no exception."""
    events = [event(k, i) for i, k in enumerate(keys_in("http://x", 3))]
    applied, owner, _, value = handed(events, {b: "http://x" for b in range(8)}, lambda url, keys: {})
    assert owner.records == [value] and applied.exceptions == {}
    assert (applied.last_index, applied.last_event_id, applied.applied) == (2, events[2].event_id, 3)


def test_each_owner_gets_its_events_in_order_at_most_apply_events_max_a_request() -> None:
    """Events of two owners: each gets records of its own events only, in batch order, three at most each."""
    xs, ys = keys_in("http://x", 4), keys_in("http://y", 2)
    order = [xs[0], ys[0], xs[1], xs[2], ys[1], xs[3]]
    applied, owner, _, _ = handed([event(k, i) for i, k in enumerate(order)], SPLIT, lambda url, keys: {})
    assert owner.requests == [("http://x", xs[:3]), ("http://x", xs[3:]), ("http://y", ys)]
    assert (applied.last_index, applied.applied, applied.exceptions) == (5, 6, {})


def test_events_of_a_bucket_that_moved_go_to_the_new_owner_before_the_next_request() -> None:
    """x refuses the events of a bucket it no longer owns (retriable); the directory then names y, which gets
    them before x gets its next request: a bucket's events apply in order."""
    xs = keys_in("http://x", 6)
    moved = bucket(xs[1])

    def answer(url: str, keys: list[str]) -> dict[str, tuple[str, bool]]:
        return {k: ("NotOwner", True) for k in keys if url == "http://x" and bucket(k) == moved}

    applied, owner, _, _ = handed([event(k, i) for i, k in enumerate(xs)], {b: "http://x" for b in range(8)},
                                  answer, moves={moved: "http://y"})
    first = owner.requests[0]
    assert first == ("http://x", xs[:3])
    assert owner.requests[1] == ("http://y", [k for k in xs[:3] if bucket(k) == moved])
    assert all(url == "http://x" or bucket(k) == moved for url, ks in owner.requests for k in ks)
    assert applied.exceptions == {} and applied.applied == 6 and applied.last_index == 5


def test_a_request_refused_whole_is_halved_until_the_refused_event_stands_alone() -> None:
    """An owner that refuses every request holding one bad event (400): the others apply, the bad one is an
    exception of its own with its EventID."""
    keys = keys_in("http://x", 3)

    def answer(url: str, ks: list[str]) -> Exception | dict[str, Any]:
        return RegionError(400, {"error": "InvalidRequest", "message": "bad"}) if keys[1] in ks else {}

    applied, owner, _, _ = handed([event(k, i) for i, k in enumerate(keys)], {b: "http://x" for b in range(8)}, answer)
    assert [e["exception_class"] for e in applied.exceptions.values()] == ["InvalidRequest"]
    assert applied.exceptions[1]["event_id"] == {"member_id": "a-writer", "thread_id": 1, "sequence_id": 1}
    assert (applied.applied, applied.last_index) == (2, 2)


def test_a_refused_credential_is_alerted_and_retried_never_an_exception() -> None:
    """401: the alert is counted, the request goes again, and nothing becomes an exception."""
    calls = {"n": 0}

    def answer(url: str, ks: list[str]) -> Exception | dict[str, Any]:
        calls["n"] += 1
        return RegionError(401, {"error": "Unauthorized", "message": "member token"}) if calls["n"] < 3 else {}

    keys = keys_in("http://x", 2)
    applied, _, receiver, _ = handed([event(k, i) for i, k in enumerate(keys)], {b: "http://x" for b in range(8)},
                                     answer)
    assert calls["n"] == 3 and applied.exceptions == {} and applied.applied == 2
    assert receiver.stats["unauthorized_alerts"] == 1


def test_events_the_receiver_cannot_route_are_exceptions_without_a_request() -> None:
    """An event of a region this site does not have, and a body that does not give its key: exceptions in
    the ack (the first with its EventID); the others are handed over."""
    good = keys_in("http://x", 1)[0]
    bodies = [entry_event_body(event(good, 0)), entry_event_body(event("k", 1, region="nowhere")), b"\x02"]
    receiver = ReceiverService(RECEIVING, member_id="b-receiver-test")
    owner = Owner(lambda url, keys: {})
    routing = routing_of(receiver, owner, Owners({b: "http://x" for b in range(8)}))
    value = batch([], bodies=bodies)
    applied = routing.apply(read_gateway_batch(get_codec(), value), value, threading.Event(), [None] * 3)
    assert {i: e["exception_class"] for i, e in applied.exceptions.items()} == {1: "UnknownRegion",
                                                                               2: "MalformedRecord"}
    assert applied.exceptions[1]["event_id"]["sequence_id"] == 1
    assert applied.exceptions[2]["event_id"] == {"member_id": "", "thread_id": -1, "sequence_id": -1}
    assert owner.requests == [("http://x", [good])]
