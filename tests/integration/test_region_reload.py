"""A bucket reloaded while a transaction of its own is still open applies a client's retry once.

When a write of a bucket fails, or the instance gets its buckets back after a
lost session (a broker killed and restarted), the owner rebuilds the bucket
from its changelog.  A window of its own may still be on its way: its
records in the changelog, its transaction not yet decided.  If the reload read
the changelog only up to the open transaction and the transaction then
committed, the bucket would not know those EventIDs, and the client's retry of
such a write would be applied a second time.  So the load waits until no
transaction is open on the partition.  The engine runs here in the test's
process against a real broker; a gate holds the window's commit while the
bucket reloads.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from sluice.core.codec import get_codec
from sluice.core.errors import BrokerUnavailable
from sluice.core.events import EntryEvent, EventID
from sluice.region.engine import Operation, OpResult, RegionEngine
from sluice.region.fanout import QueueTarget
from sluice.region.state import Op

from regionkit import read_topic, write_site

def _engine(cfg, member: str) -> RegionEngine:
    kafka = cfg.kafka
    return RegionEngine(
        site=cfg.site,
        dsid=cfg.dsid,
        member_id=member,
        client_id=f"reload-test-{member}",
        kafka_settings=kafka.client_settings(),
        group_settings=kafka.group_settings(),
        producer_settings=kafka.producer_settings(),
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


class HeldCommit:
    """The engine's producer, whose commit_transaction waits for the test to open a gate."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def commit_transaction(self, timeout: float) -> None:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        self._producer.commit_transaction(timeout)


def test_a_reload_waits_for_its_own_open_transaction(site_a, unique_prefix, tmp_path: Path):
    """The first attempt's window is written and held before its commit; the bucket fails and reloads;
    it is not ready while that transaction is open, the first attempt is answered once it commits, and
    the client's retry is a duplicate: the event is in the changelog once."""
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), buckets=1)
    engine = _engine(cfg, "m1")
    engine.start()
    try:
        assert engine.assigned_once.wait(30)
        _wait_ready(engine)
        held = HeldCommit(engine._writer.producer)
        engine._writer.producer = held
        event_id = EventID("client-1", 1, 0)
        op = Operation(op=Op.PUT, region="orders", key="k", value=b'{"n":1}', event_id=event_id, bucket=0)

        first: list[OpResult] = []
        writer = threading.Thread(target=lambda: first.append(_submit(engine, op)))
        writer.start()
        # The first attempt's records are in the changelog, its transaction open.  A failed write
        # of the bucket (as a broker killed under load causes) reloads it now.
        assert held.entered.wait(30), "the window never reached its commit"
        engine._bucket_failed("orders", 0, BrokerUnavailable("a write of the bucket failed (test)"))
        assert not engine.wait_ready("orders", 0, 2.0), "the bucket was ready while its own transaction was open"
        held.gate.set()
        _wait_ready(engine)
        # The client's retry of the same operation, as after a retriable answer.
        retry = _submit(engine, Operation(op=Op.PUT, region="orders", key="k", value=b'{"n":1}',
                                          event_id=event_id, bucket=0))
        writer.join(30)
        assert first and first[0].error is None, first
        assert retry.error is None and retry.duplicate, retry
    finally:
        engine._writer.producer = getattr(engine._writer.producer, "_producer", engine._writer.producer)
        engine.stop()

    codec = get_codec()
    applied = [EntryEvent.from_record(codec.decode_as("EntryEvent", value)).event_id
               for _, _, value in read_topic(site_a.bootstrap, cfg.topics.region_changelog("orders"), 1)
               if value is not None]
    assert applied.count(event_id) == 1, f"{event_id} in the changelog {applied.count(event_id)} times: {applied}"
