"""The gateway receiver against a real broker and region service: batches as a remote sender writes them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from sluice.admin.cli import receiver_status
from sluice.client import RegionClient
from sluice.core.codec import get_codec
from sluice.core.config import load_config
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.core.kafka import partition_for_key
from sluice.core.processes import ReceiverProcess
from sluice.core.topics import apply_topics
from sluice.core.receivertotals import site_totals, summed

from regionkit import RegionProcess, read_topic
from waiting import read_until, wait_for

pytestmark = pytest.mark.timeout(180)


def _site_b(path: Path, bootstrap: str, prefix: str) -> Any:
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4, "key_max_bytes": 64}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


def _event(key: str, op: Operation, value: bytes | None, seq: int, dsid: int = 1, ts: int = 1_000,
           version: int = 1) -> dict[str, Any]:
    return EntryEvent(region="orders", key=key, operation=op, value=value, event_id=EventID("site-a-client", 1, seq),
                      version=VersionTag(dsid, ts + seq, version, "a-0"), origin_dsid=dsid, bucket=0, event_time=ts + seq,
                      visited_dsids=(2,)).to_record()


def _send(cfg: Any, bootstrap: str, batch_id: int, events: list[dict[str, Any]], source: int = 1) -> None:
    key = f"{source}/orders-to-b/0"
    record = {"sender_id": "orders-to-b", "source_dsid": source, "target_dsid": 2, "queue_partition": 0,
              "batch_id": batch_id, "first_offset": 0, "last_offset": len(events) - 1, "possible_duplicate": False,
              "created_at": int(time.time() * 1000), "events": events, "signature": None}
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(cfg.topics.gateway_inbound(), get_codec().encode("GatewayBatch", record), key.encode(),
                     partition=partition_for_key(key.encode(), 2))
    assert producer.flush(10) == 0


#: How long an ack or a dead letter may take after its batch was sent, and a status report to follow.
ACK_S = 60
DEAD_LETTER_S = 30
STATUS_S = 15


def _acks(cfg: Any, bootstrap: str, count: int, timeout_s: float = ACK_S) -> list[dict[str, Any]]:
    def acks() -> list[dict[str, Any]]:
        return [get_codec().decode_as("GatewayAck", v) for _, _, v in read_topic(bootstrap, cfg.topics.gateway_acks(), 2)]

    seen = read_until(acks, lambda seen: len(seen) >= count, timeout_s=timeout_s, poll_s=0.2)
    assert len(seen) >= count, f"fewer than {count} acks in {timeout_s}s"
    return sorted(seen, key=lambda a: a["acked_at"])


def test_batches_are_applied_acknowledged_deduplicated_and_screened(site_a, unique_prefix, tmp_path: Path):
    """Applied then acked; a repeated batch is acked again and not re-applied; a poison event is an exception
    in the ack while the rest applies; a batch from an unconfigured dsid is rejected and applies nothing."""
    cfg = _site_b(tmp_path / "site-b.yaml", site_a.bootstrap, site_a.topic_prefix(unique_prefix))
    region = RegionProcess(tmp_path / "site-b.yaml", tmp_path / "region.log")
    receiver = ReceiverProcess(tmp_path / "site-b.yaml", tmp_path / "receiver.log")
    try:
        region.wait_ready()
        client = RegionClient([region.url])

        _send(cfg, site_a.bootstrap, 1, [_event(f"k{i}", Operation.CREATE, b'{"v":%d}' % i, i) for i in range(5)])
        first = _acks(cfg, site_a.bootstrap, 1)[0]
        assert (first["batch_id"], first["last_applied_index"], first["exceptions"]) == (1, 4, [])
        assert first["duplicate_batch"] is False
        assert [client.get("orders", f"k{i}") for i in range(5)] == [{"v": i} for i in range(5)]

        # The same batch again (a sender that missed the ack): acked again, not applied again.
        _send(cfg, site_a.bootstrap, 1, [_event("k0", Operation.UPDATE, b'{"v":"again"}', 99)])
        again = _acks(cfg, site_a.bootstrap, 2)[1]
        assert again["duplicate_batch"] is True and client.get("orders", "k0") == {"v": 0}

        # A poison event (its key is too long for this site): an exception in the ack, the rest applies.
        poison = [_event("k5", Operation.CREATE, b"5", 5), _event("x" * 100, Operation.CREATE, b"6", 6),
                  _event("k7", Operation.CREATE, b"7", 7), _event("k1", Operation.DESTROY, None, 8, version=2)]
        _send(cfg, site_a.bootstrap, 2, poison)
        third = _acks(cfg, site_a.bootstrap, 3)[2]
        assert [(e["index"], e["exception_class"]) for e in third["exceptions"]] == [(1, "EntryTooLarge")]
        assert third["last_applied_index"] == 3
        assert client.get("orders", "k5") == 5 and client.get("orders", "k7") == 7
        assert client.get_entry("orders", "k1") is None

        # A batch from dsid 9, which site b does not accept: rejected, dead-lettered, nothing applied, no ack.
        _send(cfg, site_a.bootstrap, 1, [_event("rogue", Operation.CREATE, b"1", 1, dsid=9)], source=9)
        dead = wait_for(lambda: read_topic(site_a.bootstrap, cfg.topics.region_dead_letter(), 1),
                        timeout_s=DEAD_LETTER_S, what="the rejected batch dead-lettered", poll_s=0.2)
        letter = get_codec().decode_as("DeadLetter", dead[0][2])
        assert letter["error_class"] == "RejectedBatch" and "dsid 9" in letter["reason"]
        assert client.get_entry("orders", "rogue") is None
        assert len(_acks(cfg, site_a.bootstrap, 3)) == 3

        # The receiver reports its counts where `sluice admin status` shows them.
        report = read_until(lambda: next(iter(receiver_status(cfg)), {}),
                            lambda report: report.get("rejected_batches") == 1, timeout_s=STATUS_S, poll_s=0.5)
        assert (report["batches"], report["duplicate_batches"], report["rejected_batches"],
                report["events_applied"], report["exceptions"]) == (2, 1, 1, 8, 1), report
        assert sorted(report["partitions"]) == [0, 1]
        shown = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(tmp_path / "site-b.yaml"),
                                "status"], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "gateway receivers" in shown.stdout and report["member"] in shown.stdout, \
            shown.stdout + shown.stderr

        # A restarted receiver still knows batch 2 of that sender partition was applied.
        receiver.stop()
        receiver = ReceiverProcess(tmp_path / "site-b.yaml", tmp_path / "receiver-2.log")
        _send(cfg, site_a.bootstrap, 2, [_event("k5", Operation.UPDATE, b'"late"', 50)])
        fourth = _acks(cfg, site_a.bootstrap, 4)[3]
        assert fourth["duplicate_batch"] is True and client.get("orders", "k5") == 5

        # The inbound partitions' figures went on from where the stopped receiver left them: the site's
        # sum counts everything once, whichever process did it.
        # The partition without an ack since the restart: its figures are published every few seconds.
        rows = read_until(lambda: site_totals(cfg),
                          lambda rows: {r.member for r in rows if r.offset >= 0} == {receiver.member_id},
                          timeout_s=STATUS_S, poll_s=0.3)
        site = summed(rows)
        assert (site["batches"], site["duplicate_batches"], site["rejected_batches"], site["events_applied"],
                site["exceptions"], site["dead_lettered"]) == (2, 2, 1, 8, 1, 1), rows
        assert {r.member for r in rows if r.offset >= 0} == {receiver.member_id}
        assert {r.carried_from for r in rows if r.offset >= 0} == {report["member"]}
    finally:
        receiver.stop()
        region.stop()


# Signed batches and acks (Ed25519, core/signing.py): tests/integration/test_gateway_security.py.
