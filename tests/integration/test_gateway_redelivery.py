"""A gateway batch sent again (no ack) carries every event of it as possibleDuplicate, as Geode's
``handleUnSuccessfulBatchDispatch`` flags them; its first send does not.  A→B through Kafka only."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest

from sluice.admin.cli import queue_status
from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.eventwire import read_gateway_batch
from sluice.core.processes import ReceiverProcess, SenderProcess

from regionkit import RegionProcess, read_topic, remote, write_two_sites
from transmit_recorder import read_transmits
from waiting import wait_for

pytestmark = pytest.mark.timeout(300)

HERE = str(Path(__file__).resolve().parent)
KEYS = [f"r{i}" for i in range(12)]


def _sites(tmp_path: Path, bootstrap: str, prefix: str) -> tuple[Path, Path, Any, Any]:
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{
            "id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 4, "batch_time_interval_ms": 20,
            # No receiver runs at first: each batch waits 1.5 s for its ack, then goes again.
            "socket_read_timeout_ms": 1500, "retry_interval_ms": 300,
            "event_filters": ["transmit_recorder:RecordTransmits"],
            "remote": remote(bootstrap, prefix, "b"),
        }],
    }, b={
        "regions": [{"name": "orders", "buckets": 2}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    })
    return two.path_a, two.path_b, two.cfg_a, two.cfg_b


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 90) -> None:
    wait_for(check, timeout_s=timeout_s, what=what, poll_s=0.2)


def test_a_batch_sent_again_after_no_ack_has_every_event_possible_duplicate(site_a, unique_prefix, tmp_path: Path):
    """With B's receiver down, A's sender sends each batch, gets no ack, and sends it again: the first send
    of every batch carries no possibleDuplicate event and every later send carries all of them so, both as
    the sender's before_transmit filter sees the events and as B reads them off its inbound topic; once the
    receiver runs, B has every event and A's queue drains."""
    path_a, path_b, cfg_a, cfg_b = _sites(tmp_path, site_a.bootstrap, unique_prefix)
    transmits = tmp_path / "transmits.jsonl"
    procs: list[Any] = []
    try:
        region_a = RegionProcess(path_a, tmp_path / "region-a.log", extra_path=[HERE])
        region_b = RegionProcess(path_b, tmp_path / "region-b.log")
        procs += [region_a, region_b]
        region_a.wait_ready()
        region_b.wait_ready()
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log", extra_path=[HERE],
                                   env={"SLUICE_TEST_TRANSMITS": str(transmits)}))
        a, b = RegionClient([region_a.url]), RegionClient([region_b.url])
        for i, key in enumerate(KEYS):
            a.put("orders", key, {"n": i})

        def sends() -> dict[str, list[bool]]:
            per_key: dict[str, list[bool]] = defaultdict(list)
            for key, duplicate in read_transmits(str(transmits)):
                per_key[key].append(duplicate)
            return per_key

        # No receiver: the batch at the head of each partition is sent, not acknowledged, and sent again.
        _wait("a batch sent twice without an ack", lambda: any(len(v) >= 2 for v in sends().values()))
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        _wait("B has every key", lambda: sum(e is not None for e in b.get_all("orders", KEYS).values()) == len(KEYS))
        _wait("A's queue is empty", lambda: sum(r.size for r in queue_status(cfg_a, "to-b")) == 0)

        per_key = sends()
        assert set(per_key) == set(KEYS)
        for key, flags in per_key.items():
            assert flags[0] is False, f"{key}: its first send was flagged possibleDuplicate: {flags}"
            assert all(flags[1:]), f"{key}: sent again without possibleDuplicate: {flags}"
        resent = [k for k, flags in per_key.items() if len(flags) > 1]
        assert resent, "no batch was sent twice"

        # What B received: per batch, in the order written.
        codec = get_codec()
        writes: dict[tuple[int, int], list[Any]] = defaultdict(list)
        for _, _, value in sorted(read_topic(site_a.bootstrap, cfg_b.topics.gateway_inbound(), 2)):
            view = read_gateway_batch(codec, value)
            writes[(view.queue_partition, view.batch_id)].append(view)
        assert any(len(w) > 1 for w in writes.values()), "B's inbound topic holds no batch written twice"
        for batch, views in writes.items():
            first = [e.possible_duplicate for e in views[0].events()]
            assert not any(first) and not views[0].possible_duplicate, f"batch {batch}: first send flagged"
            for again in views[1:]:
                events = again.events()
                assert events and all(e.possible_duplicate for e in events), f"batch {batch}: a resend not flagged"
                if again.current:  # version 3: the events' own flags travel beside their bodies
                    assert again.duplicate_events == frozenset(range(len(events))), f"batch {batch}"
        print(f"\n{len(resent)} of {len(KEYS)} events sent more than once, every repeat possibleDuplicate; "
              f"{sum(len(v) for v in writes.values())} batch records for {len(writes)} batches")
    finally:
        for proc in reversed(procs):
            proc.stop()
