"""Schemathesis against the region service's OpenAPI document, with authentication on.

One region-service instance with the client token and the member token set.  Every operation of
/openapi.json, the /internal routes and apply_remote included, gets generated requests, valid and
invalid ones, each with the credential its path takes (``guard.credential_of``).  Hypothesis runs
derandomized with a bounded example count, so the run is the same every time and fits in the time
a 2-core machine gives it.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from sluice.region.guard import CLIENT, MEMBER, credential_of

from regionkit import RegionProcess, write_site
from waiting import read_until

#: One worker of `pytest -n` runs the whole module: its services are started once, in a module-scoped fixture.
pytestmark = [pytest.mark.timeout(480), pytest.mark.xdist_group("region_fuzz")]

TOKEN = "client-" + uuid.uuid4().hex
MEMBER_TOKEN = "member-" + uuid.uuid4().hex
BUCKETS = 4
#: Examples per operation and generation mode: about 25 operations × 2 modes × this.
EXAMPLES = 40


def credential(path: str) -> dict[str, str]:
    kind = credential_of(path)
    if kind == CLIENT:
        return {"authorization": f"Bearer {TOKEN}"}
    if kind == MEMBER:
        return {"authorization": f"Bearer {MEMBER_TOKEN}"}
    return {}


@pytest.fixture(scope="module")
def region(site_a, tmp_path_factory) -> Iterator[tuple[Any, RegionProcess, str]]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    prefix = site_a.topic_prefix(f"t{uuid.uuid4().hex[:8]}.")
    cfg = write_site(tmp / "site.yaml", site="a", bootstrap=site_a.bootstrap, prefix=prefix, buckets=BUCKETS,
                     extra={"async_event_queues": [], "regions": [
                         {"name": "orders", "buckets": BUCKETS, "gateway_senders": ["to-b"], "key_max_bytes": 128,
                          "value_max_bytes": 4096}],
                            "region_service": {"request_timeout_s": 10, "load_timeout_s": 30, "token": TOKEN,
                                               "member_token": MEMBER_TOKEN, "request_body_max_bytes": 65536}})
    proc = RegionProcess(tmp / "site.yaml", tmp / "region.log")
    try:
        proc.wait_ready()
        yield cfg, proc, site_a.bootstrap
    finally:
        proc.stop()


class Observer:
    """The region's keys and the end offsets of its changelog and queue: what a refused request must
    leave as it found it.

    The ends are read once every transaction on those partitions is decided (last stable offset = high
    watermark): a write is answered when its transaction commits, and Kafka writes the commit markers
    to the partitions just after, so an end read at once may still move by a marker of the request
    before.  A wan-copy a generated request started runs on after its answer; it is cancelled, and
    the state read once it has stopped."""

    def __init__(self, cfg: Any, url: str, bootstrap: str) -> None:
        self.url = url
        self.partitions = [TopicPartition(cfg.topics.region_changelog("orders"), p) for p in range(BUCKETS)]
        self.partitions += [TopicPartition(q.topic, p) for q in cfg.attached_queues("orders")
                            for p in range(q.partitions)]
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.http = httpx.Client(headers=credential("/regions/orders/keys"), timeout=30)

    def ends(self, isolation: IsolationLevel) -> list[int]:
        """Every partition's end as a reader of ``isolation`` sees it, in one request: the last stable
        offset (read_committed) or the high watermark."""
        asked = self.admin.list_offsets({tp: OffsetSpec.latest() for tp in self.partitions},
                                        isolation_level=isolation, request_timeout=10)
        return [asked[tp].result(timeout=10).offset for tp in self.partitions]

    def bounds(self) -> list[tuple[int, int]]:
        """(last stable offset, high watermark) of each partition, asked in that order (as partition_end)."""
        return list(zip(self.ends(IsolationLevel.READ_COMMITTED), self.ends(IsolationLevel.READ_UNCOMMITTED)))

    def state(self) -> tuple[list[str], list[int]]:
        keys = self.http.get(f"{self.url}/regions/orders/keys").json()["keys"]
        bounds = read_until(self.bounds, lambda bounds: all(stable >= high for stable, high in bounds), timeout_s=10,
                            poll_s=0.01)
        return sorted(keys), [high for _, high in bounds]

    def stop_copies(self) -> None:
        """Cancel a wan-copy a generated request started (answered once it has stopped)."""
        response = self.http.post(f"{self.url}/regions/orders/wan_copy/cancel", json={"sender_id": "to-b"})
        assert response.status_code in (200, 404), response.text

    def close(self) -> None:
        self.http.close()


def test_generated_requests_never_fail_the_server_nor_change_state_when_refused(region) -> None:
    """No generated request gets a 5xx (but a retriable 503), and none refused with a 4xx changes the
    region's keys or its changelog and queue offsets; the service is alive after."""
    cfg, proc, bootstrap = region
    url = proc.url
    document = httpx.get(f"{url}/openapi.json", headers=credential("/openapi.json"), timeout=10).json()
    paths = set(document["paths"])
    assert {"/internal/ops", "/internal/read", "/internal/keys", "/regions/{region}/apply_remote"} <= paths
    for path in ("/internal/ops", "/internal/read", "/internal/keys", "/regions/{region}/apply_remote",
                 "/regions/{region}/clear", "/regions/{region}/entries/{key}"):
        operations = document["paths"][path]
        assert any("requestBody" in op for op in operations.values()), f"{path} documents no body"
    schema = schemathesis.openapi.from_dict(document)
    observer = Observer(cfg, url, bootstrap)
    failures: list[str] = []
    seen = {"cases": 0, "refused": 0, "not negatable": 0}
    last = [observer.state()]

    def check(case: Any) -> None:
        response = case.call(base_url=url, headers=credential(case.path), timeout=30)
        seen["cases"] += 1
        text = response.content.decode("utf-8", "replace")
        what = f"{case.method} {case.formatted_path} {response.status_code}: {text[:300]}"
        if response.status_code >= 500:
            retriable = response.status_code == 503 and _json(response.content).get("retriable") is True
            if not retriable:
                failures.append(f"server error: {what}")
        if case.path.startswith("/regions/{region}/wan_copy"):
            observer.stop_copies()
        now = observer.state()
        if 400 <= response.status_code < 500:
            seen["refused"] += 1
            if now != last[0]:
                failures.append(f"refused but changed the region: {what}")
        last[0] = now

    started = time.monotonic()
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            # Valid requests go to the region that exists, invalid ones anywhere.
            in_region = {"region": "orders"} if any(p.name == "region" for p in operation.path_parameters) else None
            for mode, fixed in ((GenerationMode.POSITIVE, in_region), (GenerationMode.NEGATIVE, None)):
                strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed)

                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case: Any) -> None:
                    check(case)

                try:
                    run()
                except Unsatisfiable:
                    # Nothing to make invalid (an operation with no parameters and no body).
                    assert mode is GenerationMode.NEGATIVE, operation.label
                    seen["not negatable"] += 1
    finally:
        observer.close()
    elapsed = time.monotonic() - started
    assert seen["cases"] > 200 and seen["refused"] > 50, seen
    assert failures == [], "\n".join(failures[:20])
    assert httpx.get(f"{url}/healthz").status_code == 200
    print(f"{seen['cases']} requests ({seen['refused']} refused) in {elapsed:.1f} s")


def _json(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
