"""Mixed versions across the WAN hop (issue 18), through real brokers and service processes.

GatewayBatch version 3 carries the queued event bodies untouched; versions 1
and 2 carry events as records, the sender's changes already in them.  A
site is upgraded before the other:

* today's receiver applies a batch written as a sender of the release before
  wrote it (version 2, signed over its bytes), exactly as that sender meant
  it, and says in its ack which versions it reads;
* today's sender writes version 2 until its receiver says it reads version 3
  (a receiver of the release before says nothing: its acks have no
  ``batch_versions``), version 3 while it says it reads no later one, and
  version 4 (``no_callback_events``) once it has; a queue holding records of
  the QueuedEvent version before is read and sent like any other.  Every
  event lands at the remote site with the same visited sites either way.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import fastavro
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form

from sluice.client import RegionClient
from sluice.core.codec import MARKER, get_codec, schema_dir
from sluice.core.events import EventID
from sluice.core.eventwire import (
    BATCH_VERSIONS_READ,
    GATEWAY_BATCH_V2_HEADER,
    GATEWAY_BATCH_V3_HEADER,
    read_gateway_batch,
)
from sluice.core.kafka import partition_for_key
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess

from waiting import wait_for

from test_gateway_security import _enqueue, _event, _produce, _read, _signer, _two_sites, _verifier, _wait

pytestmark = pytest.mark.timeout(240)

INBOUND_PARTITIONS = 2


def _older(name: str, version: int) -> tuple[Any, bytes]:
    """The parsed schema of avro/history/<name>.v<version>.avsc and its single-object header."""
    schema = fastavro.parse_schema(json.loads((schema_dir() / "history" / f"{name}.v{version}.avsc").read_text()),
                                   named_schemas={})
    return schema, MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))


def _written_with(name: str, version: int, record: dict[str, Any]) -> bytes:
    """``record`` as a writer of that schema version wrote it."""
    schema, header = _older(name, version)
    buf = io.BytesIO()
    buf.write(header)
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def _inbound(partition: int) -> int:
    """Where sender to-b of dsid 1 writes the batches of a queue partition (the sender's mapping)."""
    return (partition_for_key(b"1/to-b", INBOUND_PARTITIONS) + partition) % INBOUND_PARTITIONS


def _changelog(bootstrap: str, cfg: Any) -> list[dict[str, Any]]:
    """Every record of B's changelog of orders."""
    codec = get_codec()
    return [codec.decode_as("EntryEvent", v) for _, v, _ in _read(bootstrap, cfg.topics.region_changelog("orders"), 2)]


def test_a_version_2_batch_signed_over_its_bytes_is_applied_by_todays_receiver(site_a, unique_prefix, tmp_path):
    """A batch written as the sender of the release before wrote it (events as records, visited sites and
    possibleDuplicate already set, signed over its bytes) is applied by today's receiver as it was meant:
    every event in B's changelog with the visited sites and flags it was sent with, and a signed ack of it
    that says which batch versions this receiver reads."""
    path_a, path_b, cfg_a, cfg_b = _two_sites(tmp_path, site_a.bootstrap, unique_prefix, sender={})
    events = [{**_event("old-1", 1), "visited_dsids": [2]},
              {**_event("old-2", 2), "visited_dsids": [2, 3], "possible_duplicate": True},
              {**_event("old-3", 3), "operation": "UPDATE", "visited_dsids": [2]}]
    batch = {"sender_id": "to-b", "source_dsid": 1, "target_dsid": 2, "queue_partition": 0, "batch_id": 4,
             "first_offset": 10, "last_offset": 12, "possible_duplicate": False,
             "created_at": int(time.time() * 1000), "events": events, "signature": None}
    value = _written_with("GatewayBatch", 2, batch)
    assert value[:10] == GATEWAY_BATCH_V2_HEADER
    _produce(site_a.bootstrap, cfg_b.topics.gateway_inbound(), [(_inbound(0), b"1/to-b/0", value,
                                                                  _signer("a", 1).headers(value))])
    procs: list[Any] = []
    try:
        region = RegionProcess(path_b, tmp_path / "region-b.log")
        procs.append(region)
        region.wait_ready()
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        [(_, ack_value, headers)] = _wait("the ack", lambda: _read(site_a.bootstrap, cfg_b.topics.gateway_acks(),
                                                                    INBOUND_PARTITIONS))
        assert _verifier("b", 2).signer(ack_value, headers) == 2
        ack = get_codec().decode_as("GatewayAck", ack_value)
        assert (ack["batch_id"], ack["last_applied_index"], ack["exceptions"], ack["duplicate_batch"]) == \
            (4, 2, [], False)
        assert ack["last_applied_event_id"] == events[2]["event_id"]
        assert ack["batch_versions"] == list(BATCH_VERSIONS_READ) and 3 in ack["batch_versions"]
        changelog = _wait("the three events in B's changelog", lambda: (found := _changelog(site_a.bootstrap, cfg_b))
                          and len(found) == 3 and found)
        assert sorted((r["key"], r["visited_dsids"], r["possible_duplicate"], r["operation"]) for r in changelog) \
            == [("old-1", [2], False, "CREATE"), ("old-2", [2, 3], True, "CREATE"), ("old-3", [2], False, "UPDATE")]
        with RegionClient([region.url]) as client:
            assert all(e is not None for e in client.get_all("orders", ["old-1", "old-2", "old-3"]).values())
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_sender_writes_version_2_until_its_receiver_says_it_reads_version_3(site_a, unique_prefix, tmp_path):
    """Site a's sender starts while b runs a receiver of the release before (played here: it reads version 2
    batches, applies their events through apply_remote and acknowledges with GatewayAck version 2, which
    has no batch_versions): a's batches are version 2, its queue's first records of the QueuedEvent version
    before included.  Once today's receiver runs at b and acknowledges, the sender logs the switch and its
    next batches are version 3.  Every event is at b, once, with the same visited sites whatever the version
    that carried it."""
    path_a, path_b, cfg_a, cfg_b = _two_sites(tmp_path, site_a.bootstrap, unique_prefix,
                                              sender={"socket_read_timeout_ms": 60000})
    codec = get_codec()
    inbound, acks = cfg_b.topics.gateway_inbound(), cfg_b.topics.gateway_acks()
    handled: set[tuple[int, bytes]] = set()

    def play_old_receiver(client: RegionClient, keys: list[str], reads: list[int] | None = None) -> list[bytes]:
        """Apply and acknowledge, as a receiver of the release before, every batch until ``keys`` are all
        acknowledged; the headers of the batches it took.  With ``reads``, as a receiver that reads those
        batch versions (acks of today's version saying so)."""
        acked: set[str] = set()
        headers_seen: list[bytes] = []

        def take_batches() -> bool:
            """Apply and acknowledge every batch not handled yet; True once ``keys`` are all acknowledged."""
            for partition, value, headers in _read(site_a.bootstrap, inbound, INBOUND_PARTITIONS):
                if (partition, value) in handled:
                    continue
                handled.add((partition, value))
                assert _verifier("a", 1).signer(value, headers) == 1
                headers_seen.append(value[:10])
                view = read_gateway_batch(codec, value)
                events = view.events()
                answer = client.apply_remote("orders", events, outcomes="all")
                assert answer["failed"] == 0, answer
                fields = {
                    "sender_id": "to-b", "source_dsid": 1, "receiver_dsid": 2,
                    "queue_partition": view.queue_partition, "batch_id": view.batch_id,
                    "last_applied_index": len(events) - 1,
                    "last_applied_event_id": events[-1].event_id.to_record(), "duplicate_batch": False,
                    "exceptions": [], "acked_at": int(time.time() * 1000), "last_batch_id": view.batch_id}
                ack = (_written_with("GatewayAck", 2, fields) if reads is None
                       else codec.encode("GatewayAck", {**fields, "batch_versions": reads}))
                key = f"1/to-b/{view.queue_partition}".encode()
                _produce(site_a.bootstrap, acks, [(partition, key, ack, _signer("b", 2).headers(ack))])
                acked.update(e.key for e in events)
            return set(keys) <= acked

        wait_for(take_batches, timeout_s=60, poll_s=0.2,
                 what=f"the old receiver acknowledges every one of {len(keys)} keys")
        return headers_seen

    procs: list[Any] = []
    try:
        region = RegionProcess(path_b, tmp_path / "region-b.log")
        procs.append(region)
        region.wait_ready()
        sender = SenderProcess(path_a, "to-b", tmp_path / "sender-a.log")
        procs.append(sender)
        client = RegionClient([region.url])

        # The queue's first records as a region of the release before wrote them (QueuedEvent version 2).
        first = [_event(f"v2q-{i}", i) for i in range(5)]
        _produce(site_a.bootstrap, cfg_a.topics.queue("to-b"), [(0, e["key"].encode(), _written_with(
            "QueuedEvent", 2, {"queue_id": "to-b", "changelog_partition": 0, "changelog_offset": i,
                               "enqueued_at": int(time.time() * 1000), "event": e}), None)
            for i, e in enumerate(first)])
        assert set(play_old_receiver(client, [e["key"] for e in first])) == {GATEWAY_BATCH_V2_HEADER}
        second = [_event(f"old-rx-{i}", 10 + i) for i in range(5)]
        _enqueue(site_a.bootstrap, cfg_a, 0, second)
        assert set(play_old_receiver(client, [e["key"] for e in second])) == {GATEWAY_BATCH_V2_HEADER}, \
            "an ack without batch_versions must keep the sender on version 2"

        # A receiver that reads versions up to 3: once it has said so, version 3 (no_callback_events unsaid).
        told = [_event(f"tell-v3-{i}", 40 + i) for i in range(2)]
        _enqueue(site_a.bootstrap, cfg_a, 0, told)
        play_old_receiver(client, [e["key"] for e in told], reads=[1, 2, 3])
        _wait("the sender hearing version 3", lambda: "reads GatewayBatch version 3" in sender.log_tail(200_000))
        v3 = [_event(f"v3rx-{i}", 50 + i) for i in range(3)]
        _enqueue(site_a.bootstrap, cfg_a, 0, v3)
        assert set(play_old_receiver(client, [e["key"] for e in v3], reads=[1, 2, 3])) == \
            {GATEWAY_BATCH_V3_HEADER}, "a receiver reading up to version 3 must get version 3"

        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        _enqueue(site_a.bootstrap, cfg_a, 0, [_event("to-new-rx", 20)])
        _wait("the sender hearing version 4", lambda: "reads GatewayBatch version 4" in sender.log_tail(200_000))
        third = [_event(f"v3-{i}", 30 + i) for i in range(5)]
        _enqueue(site_a.bootstrap, cfg_a, 0, third)
        keys = [e["key"] for e in first + second + told + v3 + third] + ["to-new-rx"]
        _wait("every event at b", lambda: all(e is not None for e in client.get_all("orders", keys).values()))

        carried: dict[str, bytes] = {}
        for _, value, _ in _read(site_a.bootstrap, inbound, INBOUND_PARTITIONS):
            for event in read_gateway_batch(codec, value).events():
                carried.setdefault(event.key, value[:10])
        assert {carried[e["key"]] for e in third} == {codec.header("GatewayBatch")}, "not sent as version 4"
        changelog = _changelog(site_a.bootstrap, cfg_b)
        assert {r["key"]: (r["visited_dsids"], r["origin_dsid"]) for r in changelog} == \
            {k: ([2], 1) for k in keys}, "the visited sites differ between versions"
        ids = [EventID.from_record(r["event_id"]) for r in changelog]
        assert len(ids) == len(set(ids)) == len(keys), "an event applied twice at b"
        client.close()
    finally:
        for proc in reversed(procs):
            proc.stop()
