"""The region service's HTTP API against a real broker and a real service process.

On Apache Kafka only: the region's writes are Kafka transactions, and Tansu shows aborted records to
read_committed readers (tests/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from sluice.client import RegionClient
from sluice.core.codec import get_codec

from regionkit import RegionProcess, end_offsets, read_queue, write_site


@pytest.fixture
def region(any_site, unique_prefix, tmp_path: Path) -> Iterator[tuple[Any, RegionProcess, Any]]:
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=any_site.bootstrap,
                     prefix=any_site.topic_prefix(unique_prefix))
    proc = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    try:
        proc.wait_ready()
        yield cfg, proc, any_site
    finally:
        proc.stop()


def _post(url: str, path: str, body: Any = None, raw: bytes | None = None, json_type: bool = True) -> httpx.Response:
    headers = {"content-type": "application/json"} if json_type else {}
    if raw is not None:
        return httpx.post(url + path, content=raw, headers=headers, timeout=30)
    return httpx.post(url + path, json=body, timeout=30)


def test_entry_operations_follow_geode(region):
    """create/put/get/invalidate/destroy/put_all/remove_all behave as Geode's region API."""
    cfg, proc, site = region
    url = proc.url
    r = _post(url, "/regions/orders/create", {"key": "a", "value": {"n": 1}})
    assert r.status_code == 201 and r.json()["operation"] == "CREATE"
    assert r.json()["version"]["entry_version"] == 1
    r = _post(url, "/regions/orders/put", {"key": "a", "value": {"n": 2}})
    assert r.json()["operation"] == "UPDATE" and r.json()["version"]["entry_version"] == 2
    assert httpx.get(f"{url}/regions/orders/entries/a").json()["value"] == {"n": 2}
    r = _post(url, "/regions/orders/invalidate", {"key": "a"})
    assert r.json()["operation"] == "INVALIDATE"
    entry = httpx.get(f"{url}/regions/orders/entries/a").json()
    assert entry["value"] is None and entry["invalid"] is True
    assert httpx.get(f"{url}/regions/orders/contains/a").json()["contains"] is True
    r = _post(url, "/regions/orders/destroy", {"key": "a"})
    assert r.json()["operation"] == "DESTROY"
    assert httpx.get(f"{url}/regions/orders/entries/a").status_code == 404
    assert httpx.get(f"{url}/regions/orders/contains/a").json()["contains"] is False

    big = {"n": -(2**70 + 1), "f": 1.5e300}  # beyond 64-bit integers (not a float): still exact
    assert _post(url, "/regions/orders/put", {"key": "big", "value": big}).status_code == 200
    assert httpx.get(f"{url}/regions/orders/entries/big").json()["value"] == big
    _post(url, "/regions/orders/destroy", {"key": "big"})

    r = _post(url, "/regions/orders/put_all?outcomes=all", {"entries": {f"k{i}": i for i in range(50)}})
    assert r.status_code == 200 and r.json()["failed"] == 0 and r.json()["applied"] == 50
    assert {o["operation"] for o in r.json()["outcomes"]} == {"PUTALL_CREATE"}
    r = _post(url, "/regions/orders/put_all", {"entries": {"k0": 0, "k1": 1}})
    assert r.json()["applied"] == 2 and r.json()["outcomes"] == []
    r = _post(url, "/regions/orders/remove_all", {"keys": ["k1", "k2", "absent"]})
    assert (r.json()["applied"], r.json()["skipped"]) == (2, 1)
    assert [(o["key"], o["status"]) for o in r.json()["outcomes"]] == [("absent", "skipped")]
    keys = httpx.get(f"{url}/regions/orders/keys").json()["keys"]
    assert sorted(keys) == sorted(f"k{i}" for i in range(50) if i not in (1, 2))
    per_bucket = [httpx.get(f"{url}/regions/orders/keys", params={"bucket": b}).json()["keys"] for b in range(8)]
    assert sorted(k for ks in per_bucket for k in ks) == sorted(keys)

    # The queues got what Geode forwards: the invalidate reached neither.
    for queue in cfg.attached_queues("orders"):
        ops = [r.event.operation.value for r in read_queue(site.bootstrap, queue.topic, queue.partitions)]
        assert "INVALIDATE" not in ops
        assert ops.count("CREATE") == 2 and ops.count("UPDATE") == 1 and ops.count("DESTROY") == 2
        assert ops.count("PUTALL_CREATE") == 50 and ops.count("PUTALL_UPDATE") == 2
        assert ops.count("REMOVEALL_DESTROY") == 2


def test_a_retry_with_the_same_event_id_is_applied_once(region):
    """The same EventID sent twice is answered 'duplicate' and reaches each queue once."""
    cfg, proc, site = region
    client = RegionClient(proc.url)
    eid = client.next_event_id()
    assert client.put("orders", "x", 1, event_id=eid)["status"] == "ok"
    assert client.put("orders", "x", 2, event_id=eid)["status"] == "duplicate"
    assert client.get("orders", "x") == 1
    for queue in cfg.attached_queues("orders"):
        events = [r.event for r in read_queue(site.bootstrap, queue.topic, queue.partitions)]
        assert [e.event_id for e in events] == [eid]


def test_region_clear_empties_every_bucket_once_and_stays_local(region):
    """Clear removes every entry of every bucket (a retry with its EventID clears nothing twice), the
    changelog keeps each key's tombstone (a new instance loads an empty region), and neither the
    gateway sender nor the async event queue gets it."""
    cfg, proc, site = region
    client = RegionClient(proc.url)
    client.put_all("orders", {f"c{i}": i for i in range(40)})
    eid = client.next_event_id()
    answer = client.clear("orders", event_id=eid)
    assert (answer["status"], answer["cleared"], answer["buckets"]) == ("ok", 40, 8)
    assert client.clear("orders", event_id=eid)["duplicates"] == 8, "a retried clear is applied once"
    assert client.keys("orders") == [] and client.get_entry("orders", "c1") is None
    client.put("orders", "after", 1)
    proc.stop()
    again = RegionProcess(proc.log_path.parent / "site.yaml", proc.log_path.parent / "region-2.log")
    try:
        again.wait_ready()
        assert RegionClient(again.url).keys("orders") == ["after"], "the clear survives a reload"
    finally:
        again.stop()
    for queue in cfg.attached_queues("orders"):
        ops = [r.event.operation.value for r in read_queue(site.bootstrap, queue.topic, queue.partitions)]
        assert "REGION_CLEAR" not in ops and ops.count("PUTALL_CREATE") == 40


BAD_INPUTS = [
    # (name, path, body or raw bytes, status, error, field)
    ("create on an existing key", "/regions/orders/create", {"key": "present", "value": 1}, 409, "EntryExists", "key"),
    ("destroy of a missing key", "/regions/orders/destroy", {"key": "missing"}, 404, "EntryNotFound", "key"),
    ("invalidate of a missing key", "/regions/orders/invalidate", {"key": "missing"}, 404, "EntryNotFound", "key"),
    ("unknown region", "/regions/nope/put", {"key": "k", "value": 1}, 404, "UnknownRegion", "region"),
    ("oversized key", "/regions/orders/put", {"key": "k" * 200, "value": 1}, 413, "EntryTooLarge", "key"),
    ("oversized value", "/regions/orders/put", {"key": "k", "value": "v" * 5000}, 413, "EntryTooLarge", "value"),
    ("null value", "/regions/orders/put", {"key": "k", "value": None}, 400, "InvalidRequest", "value"),
    ("empty key", "/regions/orders/put", {"key": "", "value": 1}, 400, "InvalidRequest", "key"),
    ("missing field", "/regions/orders/put", {"key": "k"}, 400, "InvalidRequest", "value"),
    ("unknown field", "/regions/orders/put", {"key": "k", "value": 1, "colour": "red"}, 400, "InvalidRequest", "colour"),
    ("wrong type", "/regions/orders/put", {"key": 5, "value": 1}, 400, "InvalidRequest", "key"),
    ("malformed JSON", "/regions/orders/put", b'{"key": "k", "value": ', 400, "InvalidRequest", "body"),
    ("not a JSON object", "/regions/orders/put_all", b"[1, 2]", 400, "InvalidRequest", "body"),
    ("bad event id", "/regions/orders/put", {"key": "k", "value": 1, "event_id": {"member_id": "m", "thread_id": -1,
                                                                                  "sequence_id": 0}},
     400, "InvalidRequest", "event_id.thread_id"),
    ("oversized value in put_all", "/regions/orders/put_all", {"entries": {"a": 1, "b": "v" * 5000}}, 413,
     "EntryTooLarge", "entries.b"),
]


def test_bad_input_is_refused_with_its_reason_and_changes_nothing(region):
    """Each bad request gets a 4xx naming what was wrong; the region and the queues are unchanged."""
    cfg, proc, site = region
    url = proc.url
    client = RegionClient(url)
    client.put("orders", "present", {"v": 1})
    topics = [(q.topic, q.partitions) for q in cfg.attached_queues("orders")]
    topics.append((cfg.topics.region_changelog("orders"), 8))
    before_offsets = [end_offsets(site.bootstrap, t, n) for t, n in topics]
    before_keys = sorted(client.keys("orders"))
    for name, path, body, status, error, field in BAD_INPUTS:
        r = _post(url, path, raw=body) if isinstance(body, bytes) else _post(url, path, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        data = r.json()
        assert data["error"] == error, (name, data)
        assert data.get("field") == field, (name, data)
        assert data["message"], name
    # A body sent without a JSON content type is refused, as a web page's form would send it.
    r = _post(url, "/regions/orders/put", raw=b'{"key": "k", "value": 1}', json_type=False)
    assert r.status_code == 403 and r.json()["field"] == "content-type", r.text
    assert "application/json" in r.json()["reason"]
    # The service is still up and nothing moved.
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert sorted(client.keys("orders")) == before_keys
    assert client.get("orders", "present") == {"v": 1}
    assert [end_offsets(site.bootstrap, t, n) for t, n in topics] == before_offsets


def test_openapi_document_lists_every_operation(region):
    """The OpenAPI document describes the entry, bulk and operations endpoints."""
    _, proc, _ = region
    doc = httpx.get(f"{proc.url}/openapi.json").json()
    paths = set(doc["paths"])
    for path in ("/regions/{region}/create", "/regions/{region}/put", "/regions/{region}/destroy",
                 "/regions/{region}/invalidate", "/regions/{region}/put_all", "/regions/{region}/remove_all",
                 "/regions/{region}/get_all", "/regions/{region}/entries/{key}", "/regions/{region}/keys",
                 "/buckets", "/healthz", "/readyz"):
        assert path in paths, path


def test_a_service_stopped_while_a_check_fails_leaves_its_stacks_in_its_log(region):
    """A test's ``finally`` that stops a service after a failed check first has it print its threads'
    stacks (SIGUSR1, faulthandler) to its log, so a service that stopped answering can be read afterwards."""
    _, proc, _ = region
    before = proc.log_tail(10_000_000)
    assert "Current thread" not in before and "most recent call first" not in before
    try:
        raise AssertionError("a check failed")
    except AssertionError:
        proc.stop()
    log = proc.log_tail(10_000_000)
    assert "most recent call first" in log, log[-2000:]
    assert "Thread 0x" in log or "Current thread 0x" in log, log[-2000:]


def test_changelog_records_are_single_object_avro(region):
    """The changelog holds EntryEvents framed in Avro single-object encoding, keyed by the entry key."""
    cfg, proc, site = region
    RegionClient(proc.url).put("orders", "framed", {"v": 1})
    from regionkit import read_topic

    records = read_topic(site.bootstrap, cfg.topics.region_changelog("orders"), 8)
    assert records
    codec = get_codec()
    for _, _, value in records:
        assert value[:2] == b"\xc3\x01"
        assert codec.schema_of(value) == "EntryEvent"


def test_a_region_instance_refuses_to_start_without_its_topics(site_a, unique_prefix, tmp_path: Path):
    """Without `sluice topics apply` the service exits non-zero naming the missing topic."""
    import subprocess
    import sys

    import yaml

    site = {
        "site": "a", "dsid": 1,
        "kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": site_a.topic_prefix(unique_prefix)},
        "regions": [{"name": "orders", "buckets": 4}],
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "region", "-c", str(tmp_path / "site.yaml"),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "region.orders.changelog" in done.stderr and "sluice topics apply" in done.stderr
