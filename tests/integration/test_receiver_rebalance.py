"""A receiver whose lane fell behind (its partition paused) and that went through a rebalance still reads on.

librdkafka keeps a partition's pause across a rebalance.  A receiver pauses an
inbound partition while that partition's lane is more than a few batches
behind (here: no region service to apply to yet); if the group rebalances
meanwhile (a receiver joins and leaves, a broker restarts and every session
expires), the partition comes back paused, and without an explicit resume its
batches would never be read again: the senders resend forever, nothing is
acknowledged.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.processes import ReceiverProcess
from sluice.core.topics import apply_topics

from regionkit import RegionProcess, read_topic
from waiting import read_until

pytestmark = pytest.mark.timeout(240)

#: How long every batch may take to be acknowledged across the rebalance.
ACKS_S = 90

BATCHES = 14


def _site_b(path: Path, bootstrap: str, prefix: str) -> Any:
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4}],
        "receiver": {"inbound_partitions": 1, "accepted_dsids": [1]},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


def _batch(batch_id: int) -> bytes:
    event = EntryEvent(region="orders", key=f"k{batch_id}", operation=Operation.CREATE, value=b"%d" % batch_id,
                       event_id=EventID("site-a-client", 1, batch_id),
                       version=VersionTag(1, 1_000 + batch_id, 1, "a-0"), origin_dsid=1, bucket=0,
                       event_time=1_000 + batch_id, visited_dsids=(2,))
    record = {"sender_id": "orders-to-b", "source_dsid": 1, "target_dsid": 2, "queue_partition": 0,
              "batch_id": batch_id, "first_offset": batch_id, "last_offset": batch_id, "possible_duplicate": False,
              "created_at": int(time.time() * 1000), "events": [event.to_record()], "signature": None}
    return get_codec().encode("GatewayBatch", record)


def _wait_for_line(log: Path, pattern: str, count: int = 1, timeout_s: float = 60) -> None:
    text = read_until(lambda: log.read_text() if log.exists() else "",
                      lambda text: len(re.findall(pattern, text)) >= count, timeout_s=timeout_s, poll_s=0.2)
    if len(re.findall(pattern, text)) < count:
        pytest.fail(f"{log.name}: {pattern!r} seen fewer than {count} times in {timeout_s}s:\n{text[-3000:]}")


def test_a_partition_paused_before_a_rebalance_is_read_again_after_it(site_a, unique_prefix, tmp_path: Path):
    cfg = _site_b(tmp_path / "site-b.yaml", site_a.bootstrap, site_a.topic_prefix(unique_prefix))
    first_log = tmp_path / "receiver-1.log"
    first = ReceiverProcess(tmp_path / "site-b.yaml", first_log)
    second = region = None
    try:
        _wait_for_line(first_log, r"inbound partitions \[0\]")
        producer = Producer({"bootstrap.servers": site_a.bootstrap})
        for batch_id in range(1, BATCHES + 1):
            producer.produce(cfg.topics.gateway_inbound(), _batch(batch_id), b"1/orders-to-b/0", partition=0)
        assert producer.flush(10) == 0
        # No region service yet: the lane holds the first batch, the rest wait, the partition is paused.
        _wait_for_line(first_log, r"inbound partition 0 paused")

        # A second receiver joins and leaves: two rebalances, and the partition is the first one's again.
        second = ReceiverProcess(tmp_path / "site-b.yaml", tmp_path / "receiver-2.log")
        _wait_for_line(tmp_path / "receiver-2.log", r"inbound partitions \[")
        second.stop()
        second = None
        _wait_for_line(first_log, r"inbound partitions \[0\]", count=2)

        region = RegionProcess(tmp_path / "site-b.yaml", tmp_path / "region.log")
        region.wait_ready()
        acked = read_until(lambda: {get_codec().decode_as("GatewayAck", value)["batch_id"]
                                    for _, _, value in read_topic(site_a.bootstrap, cfg.topics.gateway_acks(), 1)},
                           lambda acked: len(acked) >= BATCHES, timeout_s=ACKS_S, poll_s=0.5)
        assert acked == set(range(1, BATCHES + 1)), (
            f"acknowledged {sorted(acked)} of 1..{BATCHES}\n{first_log.read_text()[-3000:]}")
    finally:
        for process in (second, first, region):
            if process is not None:
                process.stop()
