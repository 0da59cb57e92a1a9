"""A bucket reloaded while records of its own are still on their way applies a client's retry once.

When a write of a bucket fails, or the instance gets its buckets back after a
lost session (a broker killed and restarted), the owner rebuilds the bucket
from its changelog.  Records it produced before may still be in the
producer, retried until ``delivery.timeout.ms``: if the reload read the
changelog before they landed, it would not know their EventIDs, and the
client's retry of such a write (answered with a retriable error) would be
applied a second time.  The engine runs here in the test's process against a
real broker; a long ``linger.ms`` keeps the first attempt in the producer
while the bucket reloads.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sluice.core.codec import get_codec
from sluice.core.errors import BrokerUnavailable
from sluice.core.events import EntryEvent, EventID
from sluice.region.engine import Operation, OpResult, RegionEngine
from sluice.region.fanout import QueueTarget
from sluice.region.state import Op

from regionkit import read_topic, write_site

LINGER_MS = 3000


def _engine(cfg, member: str) -> RegionEngine:
    kafka = cfg.kafka
    return RegionEngine(
        site=cfg.site,
        dsid=cfg.dsid,
        member_id=member,
        client_id=f"reload-test-{member}",
        kafka_settings=kafka.client_settings(),
        group_settings=kafka.group_settings(),
        producer_settings={**kafka.producer_settings(), "linger.ms": LINGER_MS},
        group_id=f"{cfg.kafka.topic_prefix}region",
        regions={"orders": 1},
        changelog_topics={"orders": cfg.topics.region_changelog("orders")},
        targets={"orders": [QueueTarget(id=q.id, topic=q.topic, kind=q.kind, parallel=q.parallel,
                                        partitions=q.partitions, order_policy=q.order_policy)
                            for q in cfg.attached_queues("orders")]},
        codec=get_codec(),
        load_timeout_s=30,
    )


def _submit(engine: RegionEngine, op: Operation) -> OpResult:
    answered = threading.Event()
    out: list[OpResult] = []

    def on_done(results: list[OpResult]) -> None:
        out.extend(results)
        answered.set()

    engine.submit([op], on_done)
    assert answered.wait(30), "the write was not answered"
    return out[0]


def _wait_ready(engine: RegionEngine) -> None:
    assert engine.wait_ready("orders", 0, 30), "bucket orders[0] never became ready"


def test_a_reload_waits_for_its_own_records_in_flight(site_a, unique_prefix, tmp_path: Path):
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), buckets=1)
    engine = _engine(cfg, "m1")
    engine.start()
    try:
        assert engine.assigned_once.wait(30)
        _wait_ready(engine)
        event_id = EventID("client-1", 1, 0)
        op = Operation(op=Op.PUT, region="orders", key="k", value=b'{"n":1}', event_id=event_id, bucket=0)

        first: list[OpResult] = []
        writer = threading.Thread(target=lambda: first.append(_submit(engine, op)))
        writer.start()
        # The first attempt is now lingering in the producer.  A failed write of the bucket (as a
        # broker killed under load causes) reloads it while that record is still on its way.
        time.sleep(0.3)
        engine._bucket_failed("orders", 0, BrokerUnavailable("a write of the bucket failed (test)"))
        started = time.monotonic()
        _wait_ready(engine)
        reloaded_after_s = time.monotonic() - started
        # The client's retry of the same operation, as after a retriable answer.
        retry = _submit(engine, Operation(op=Op.PUT, region="orders", key="k", value=b'{"n":1}',
                                          event_id=event_id, bucket=0))
        writer.join(30)
        assert first and first[0].error is None, first
        assert retry.error is None and retry.duplicate, retry
        assert reloaded_after_s > (LINGER_MS / 1000) * 0.5, (
            f"the bucket was ready again {reloaded_after_s:.2f}s after the failure, before its record landed")
    finally:
        engine.stop()

    codec = get_codec()
    applied = [EntryEvent.from_record(codec.decode_as("EntryEvent", value)).event_id
               for _, _, value in read_topic(site_a.bootstrap, cfg.topics.region_changelog("orders"), 1)
               if value is not None]
    assert applied.count(event_id) == 1, f"{event_id} in the changelog {applied.count(event_id)} times: {applied}"
