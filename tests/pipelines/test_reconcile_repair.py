"""``sluice pipeline reconcile --repair``: the winners of the divergent keys, and only they, cross the gateway.

Two sites on one broker, each with its region service, a receiver and a
gateway sender to the other.  Their changelogs are written directly before
the services start: the same entries on both, and five keys changed on one
site's changelog only (as a site that lost events would hold them).  Their
checkpoints are committed as the region service commits its own, so the
loads queue nothing again: the sites stay divergent until something sends
the winners.  The Spark session is the folder's shared one, and the test
runs the job in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from sluice.cli import main as sluice_main
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig
from sluice.core.events import EntryEvent, Operation
from sluice.core.kafka import make_consumer, read_to_end
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess
from sluice.pipelines.reconcile import plan_repair
from sluice.region.fanout import TRANSACTIONAL_CHECKPOINT

from pipelinekit import encode, entry_event, produce, write_site

pytestmark = pytest.mark.timeout(420)

T0 = 1_700_000_000_000
BUCKETS = 4


def _write(bootstrap: str, cfg: SiteConfig, events: list[EntryEvent]) -> None:
    produce(bootstrap, [(cfg.topics.region_changelog(e.region), e.key.encode(), encode("EntryEvent", e.to_record()),
                         e.bucket) for e in events])


def _checkpoint(cfg: SiteConfig) -> None:
    """Commit the region group's offsets at each changelog partition's end, marked as the region service
    marks a checkpoint written in its transactions: the records below were queued already."""
    topic = cfg.topics.region_changelog("orders")
    consumer = Consumer({"bootstrap.servers": cfg.kafka.bootstrap_servers,
                         "group.id": f"{cfg.kafka.topic_prefix}region", "enable.auto.commit": False})
    try:
        ends = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(BUCKETS)]
        consumer.commit(offsets=[TopicPartition(topic, p, end, metadata=TRANSACTIONAL_CHECKPOINT)
                                 for p, end in enumerate(ends)], asynchronous=False)
    finally:
        consumer.close()


def _queued(cfg: SiteConfig, sender: str) -> list[EntryEvent]:
    """Every committed event in a sender's queue."""
    codec = get_codec()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"isolation.level": "read_committed"})
    try:
        return [EntryEvent.from_record(codec.decode_as("QueuedEvent", m.value())["event"])
                for p in range(BUCKETS) for m in read_to_end(consumer, cfg.topics.queue(sender), p)]
    finally:
        consumer.close()


def test_repair_sends_exactly_the_winners_and_the_sites_agree_after(
        spark: Any, site_a: Any, unique_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Five divergent keys: three whose winner is on a (a key b never got, a stale version on b, a destroy b
    missed) and two on b (a later concurrent write, a key a never got).  --repair queues exactly those winners
    at the site holding each, with their versions, delivers them, and the comparison after it finds the sites
    agreeing (exit 0)."""
    prefix = site_a.topic_prefix(unique_prefix)
    files = {name: tmp_path / f"{name}.yaml" for name in ("a", "b")}
    cfg_a = write_site(files["a"], site="a", dsid=1, bootstrap=site_a.bootstrap, prefix=f"{prefix}a.",
                       regions={"orders": BUCKETS}, sender="to-b", remote_prefix=f"{prefix}b.", accepted_dsids=[2])
    cfg_b = write_site(files["b"], site="b", dsid=2, bootstrap=site_a.bootstrap, prefix=f"{prefix}b.",
                       regions={"orders": BUCKETS}, sender="to-a", remote_prefix=f"{prefix}a.", accepted_dsids=[1])

    def event(key: str, seq: int, *, dsid: int = 1, at: int = 0, version: int = 1,
              op: Operation = Operation.UPDATE) -> EntryEvent:
        return entry_event("orders", key, seq, buckets=BUCKETS, op=op, value=f'{{"{key}": {seq}}}'.encode(),
                           dsid=dsid, timestamp=T0 + at, entry_version=version, member=f"site{dsid}")

    common = [event(f"same-{n:02d}", n, dsid=1 + n % 2, at=n) for n in range(40)]
    winners_a = {
        "missing-on-b": [event("missing-on-b", 100, at=100)],
        "stale-on-b": [event("stale-on-b", 101, at=101), event("stale-on-b", 102, at=102, version=2)],
        "destroyed-on-a": [event("destroyed-on-a", 103, at=103),
                           event("destroyed-on-a", 104, at=104, version=2, op=Operation.DESTROY)],
    }
    winners_b = {"later-on-b": event("later-on-b", 7, dsid=2, at=300), "missing-on-a": event("missing-on-a", 8, dsid=2)}
    _write(site_a.bootstrap, cfg_a, [*common, *[e for es in winners_a.values() for e in es],
                                     event("later-on-b", 105, at=200)])
    _write(site_a.bootstrap, cfg_b, [*common, winners_a["stale-on-b"][0], winners_a["destroyed-on-a"][0],
                                     *winners_b.values()])
    for cfg in (cfg_a, cfg_b):
        _checkpoint(cfg)

    procs: list[Any] = []
    try:
        regions = [RegionProcess(files[s], tmp_path / f"region-{s}.log") for s in ("a", "b")]
        procs += regions
        for region in regions:
            region.wait_ready(120)
        procs += [ReceiverProcess(files[s], tmp_path / f"receiver-{s}.log") for s in ("a", "b")]
        procs += [SenderProcess(files["a"], "to-b", tmp_path / "sender-a.log"),
                  SenderProcess(files["b"], "to-a", tmp_path / "sender-b.log")]
        args = ["pipeline", "reconcile", "--site-a", str(files["a"]), "--site-b", str(files["b"])]

        assert sluice_main([*args, "--repair"]) == 0
        captured = capsys.readouterr()
        printed = captured.out
        assert "DIVERGED: 5 keys in 1 of 1 regions" in printed, printed
        assert "OK: the sites agree on 44 keys in 1 region" in printed, printed
        assert "repair: the winners of the divergent keys" in printed, printed

        # Exactly the winners were queued, each at the site holding it, as that site holds it.
        sent_a = {e.key: e for e in _queued(cfg_a, "to-b")}
        sent_b = {e.key: e for e in _queued(cfg_b, "to-a")}
        assert sorted(sent_a) == sorted(winners_a) and sorted(sent_b) == sorted(winners_b), (sent_a, sent_b)
        for key, events in winners_a.items():
            assert (sent_a[key].version, sent_a[key].event_id) == (events[-1].version, events[-1].event_id)
        assert sent_a["destroyed-on-a"].operation is Operation.DESTROY and sent_a["destroyed-on-a"].value is None
        for key, won in winners_b.items():
            assert (sent_b[key].version, sent_b[key].value) == (won.version, won.value)
        assert all(e.possible_duplicate and e.origin_dsid == 1 for e in sent_a.values())
        with capsys.disabled():
            print(f"\n{captured.err}{printed}")
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_the_plan_names_each_winner_s_site_and_sender_and_what_it_cannot_send(tmp_path: Path) -> None:
    """Keys go to the copy of the site holding their winner, through its sender to the other site; a region
    with no such sender is reported unsendable, and keys without a winner undecided."""
    from sluice.core.config import load_config

    import yaml

    def site(name: str, dsid: int, senders: dict[str, list[str]]) -> SiteConfig:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "site": name, "dsid": dsid, "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": f"{name}."},
            "regions": [{"name": r, "buckets": 2, "gateway_senders": ss} for r, ss in senders.items()],
            "gateway_senders": [{"id": s, "remote_dsid": 3 if s.endswith("-c") else 3 - dsid, "parallel": True}
                                for ss in senders.values() for s in ss],
        }))
        return load_config(path)

    a = site("a", 1, {"orders": ["orders-to-c", "orders-to-b"], "customers": []})
    b = site("b", 2, {"orders": ["orders-to-a"], "customers": ["customers-to-a"]})
    plan = plan_repair([("orders", "k2", "a"), ("orders", "k1", "a"), ("orders", "k3", "b"),
                        ("customers", "c1", "a"), ("customers", "c2", "b"), ("orders", "k4", None)], a, b)
    assert [(c.side, c.region, c.sender_id, c.keys) for c in plan.copies] == [
        ("b", "customers", "customers-to-a", ["c2"]),
        ("a", "orders", "orders-to-b", ["k1", "k2"]),
        ("b", "orders", "orders-to-a", ["k3"]),
    ]
    assert plan.unsendable == [("customers", "a", 1, "site a has no gateway sender of region customers to site b "
                                                      "(dsid 2)")]
    assert plan.undecided == {"orders": 1} and plan.keys == 4
