"""Trust boundaries of the WAN gateway (issue 17), through real brokers and service processes.

* Batches are signed with their site's Ed25519 key over the bytes on the wire:
  a receiver applies a batch only when the key of the dsid it claims to come
  from signed exactly those bytes, whatever schema version wrote them, and
  only while it is fresh (``created_at``).
* Acks are signed by the receiving site: a sender ignores the others, and
  does not trust a ``duplicate_batch`` for a batch the receiver cannot have
  applied (its tracking ahead of the sender's epoch): it alerts, opens an
  epoch above it and loses nothing.
* With the region's tokens on, the receiver applies through the member token;
  an event the site refuses comes back in the ack and is dead-lettered at its
  origin while the lane goes on, and a batch of any size is applied.
"""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path
from typing import Any, Callable

import fastavro
import httpx
import pytest
import yaml
from confluent_kafka import Producer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from sluice.client import RegionClient
from sluice.core import sitekeys
from sluice.core.codec import MARKER, get_codec, schema_dir
from sluice.core.config import load_config
from sluice.core.kafka import partition_for_key
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess
from sluice.core.signing import SIGNATURE_HEADER, SIGNER_HEADER, Signer, Verifier, sign
from sluice.core.topics import apply_topics

from regionkit import read_records, remote, write_two_sites
from waiting import wait_for

pytestmark = pytest.mark.timeout(240)

KEYS = {site: sitekeys.generate() for site in ("a", "b", "c", "intruder")}
TOKEN = "client-token-0123456789"
MEMBER_TOKEN = "member-token-9876543210"

Record = tuple[int, bytes, list[tuple[str, bytes]]]


def _signer(site: str, dsid: int) -> Signer:
    return Signer(dsid, sitekeys.load_private_key(KEYS[site][0]))


def _verifier(site: str, dsid: int) -> Verifier:
    return Verifier({dsid: sitekeys.load_public_keys(KEYS[site][1])})


def _write_site(path: Path, data: dict[str, Any]) -> Any:
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


def _kafka(bootstrap: str, prefix: str) -> dict[str, Any]:
    return {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
            "heartbeat_interval_ms": 500}


def _event(key: str, seq: int, *, source: int = 1, value: bytes = b'{"v": 1}', thread: int = 1) -> dict[str, Any]:
    now = int(time.time() * 1000)
    return {"region": "orders", "key": key, "operation": "CREATE", "value": value, "value_encoding": "json",
            "callback_argument": None, "possible_duplicate": False,
            "event_id": {"member_id": f"site-{source}-writer", "thread_id": thread, "sequence_id": seq},
            "version": {"dsid": source, "timestamp": now, "entry_version": 1, "member_id": "m"},
            "origin_dsid": source, "visited_dsids": [], "bucket": 0, "event_time": now, "transaction": None}


def _batch(batch_id: int, events: list[dict[str, Any]], *, source: int = 1, target: int = 3, sender: str = "to-c",
           created_at: int | None = None) -> dict[str, Any]:
    return {"sender_id": sender, "source_dsid": source, "target_dsid": target, "queue_partition": 0,
            "batch_id": batch_id, "first_offset": 0, "last_offset": len(events) - 1, "possible_duplicate": False,
            "created_at": int(time.time() * 1000) if created_at is None else created_at, "events": events,
            "signature": None}


def _encode_v1(record: dict[str, Any]) -> bytes:
    """A GatewayBatch as a sender of the release before (avro/history/GatewayBatch.v1.avsc) wrote it."""
    old = fastavro.parse_schema(json.loads((schema_dir() / "history" / "GatewayBatch.v1.avsc").read_text()),
                                named_schemas={})
    buf = io.BytesIO()
    buf.write(MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(old), "CRC-64-AVRO")))
    fastavro.schemaless_writer(buf, old, {**record, "events": [
        {k: v for k, v in e.items() if k != "transaction"} for e in record["events"]]})
    return buf.getvalue()


def _produce(bootstrap: str, topic: str,
             records: list[tuple[int, bytes, bytes, list[tuple[str, bytes]] | None]]) -> None:
    """(partition, key, value, headers) each, in order."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for partition, key, value, headers in records:
        producer.produce(topic, value, key, partition=partition, headers=headers)
    assert producer.flush(10) == 0


def _read(bootstrap: str, topic: str, partitions: int) -> list[Record]:
    """(partition, value, headers) of every record of a topic (committed ones: the changelog is transactional)."""
    return [(p, value, headers) for p, _, value, headers in read_records(bootstrap, topic, partitions)]


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
    """Poll ``check`` until it returns something true, with a deadline."""
    return wait_for(check, timeout_s=timeout_s, what=what, poll_s=0.2)


def _alerts(proc: Any, name: str) -> float:
    """The process's sluice.alerts counter for one alert name (Prometheus text from its /metrics)."""
    text = httpx.get(f"{proc.metrics_url}/metrics", timeout=5).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("sluice_alerts_total{") and f'sluice_alert_name="{name}"' in line)


def test_only_batches_signed_by_their_site_over_their_bytes_and_fresh_are_applied(site_a, unique_prefix, tmp_path):
    """Site C takes batches from A and B.  A's batch written with the older schema and signed over its bytes
    is applied; unsigned, signed by B as A, signed by B but claiming A as source, altered after signing, too
    old or stamped in the future are rejected (dead-lettered with the reason, never applied nor acked); acks
    are signed by C; forged acks left in C's acks topic do not make C drop A's batches as repeats."""
    prefix = site_a.topic_prefix(unique_prefix)
    cfg = _write_site(tmp_path / "site-c.yaml", {
        "site": "c", "dsid": 3, "kafka": _kafka(site_a.bootstrap, prefix),
        "regions": [{"name": "orders", "buckets": 2}],
        "receiver": {"inbound_partitions": 1, "accepted_dsids": [1, 2], "batch_max_age_ms": 60_000},
        "gateway_private_key": KEYS["c"][0], "gateway_public_keys": {1: KEYS["a"][1], 2: KEYS["b"][1]},
    })
    codec = get_codec()
    kafka_key = b"1/to-c/0"
    # Forged acks of A's sender partition (unsigned, and signed by an intruder as C): were they believed,
    # every batch of A up to batch 2^62 would be acknowledged as a repeat and never applied.
    forged_ack = codec.encode("GatewayAck", {
        "sender_id": "to-c", "source_dsid": 1, "receiver_dsid": 3, "queue_partition": 0, "batch_id": 1 << 62,
        "last_applied_index": 0, "last_applied_event_id": None, "duplicate_batch": False, "exceptions": [],
        "acked_at": 1, "last_batch_id": 1 << 62})
    _produce(site_a.bootstrap, cfg.topics.gateway_acks(), [
        (0, kafka_key, forged_ack, None), (0, kafka_key, forged_ack, _signer("intruder", 3).headers(forged_ack))])

    now = int(time.time() * 1000)

    def signed(record: dict[str, Any], site: str = "a", dsid: int = 1) -> tuple[bytes, list[tuple[str, bytes]]]:
        value = codec.encode("GatewayBatch", record)
        return value, _signer(site, dsid).headers(value)

    v1 = _encode_v1(_batch(1, [_event("old-schema", 1)]))
    altered, altered_headers = signed(_batch(5, [_event("altered", 5)]))
    altered = altered.replace(b'{"v": 1}', b'{"v": 9}')
    forged = codec.encode("GatewayBatch", _batch(3, [_event("forged", 3)]))
    batches = [
        (v1, _signer("a", 1).headers(v1)),                                            # applied
        (codec.encode("GatewayBatch", _batch(2, [_event("unsigned", 2)])), None),     # not signed
        (forged, [(SIGNER_HEADER, b"1"), (SIGNATURE_HEADER, sign(sitekeys.load_private_key(KEYS["b"][0]),
                                                                 forged))]),          # B signing as A
        signed(_batch(4, [_event("relabelled", 4)]), "b", 2),                         # B's key, A as source
        (altered, altered_headers),                                                   # changed after signing
        signed(_batch(6, [_event("replayed", 6)], created_at=now - 3_600_000)),       # older than 60 s
        signed(_batch(7, [_event("future", 7)], created_at=now + 3_600_000)),         # beyond the clock skew
        signed(_batch(8, [_event("current-schema", 8)])),                             # applied
    ]
    _produce(site_a.bootstrap, cfg.topics.gateway_inbound(), [(0, kafka_key, v, h) for v, h in batches])

    region = RegionProcess(tmp_path / "site-c.yaml", tmp_path / "region.log")
    receiver = ReceiverProcess(tmp_path / "site-c.yaml", tmp_path / "receiver.log")
    try:
        region.wait_ready()

        def receivers_acks() -> list[Record] | None:
            found = [r for r in _read(site_a.bootstrap, cfg.topics.gateway_acks(), 1) if r[1] != forged_ack]
            return found if len(found) >= 2 else None

        acks = _wait("two acks", receivers_acks)
        verifier = _verifier("c", 3)
        assert all(verifier.signer(value, headers) == 3 for _, value, headers in acks), "an ack not signed by C"
        decoded = [codec.decode_as("GatewayAck", value) for _, value, _ in acks]
        assert [(a["batch_id"], a["duplicate_batch"], a["last_batch_id"], a["exceptions"]) for a in decoded] == \
            [(1, False, 1, []), (8, False, 8, [])]

        letters = _wait("six dead letters", lambda: (found := [
            codec.decode_as("DeadLetter", v) for _, v, _ in _read(site_a.bootstrap, cfg.topics.region_dead_letter(), 1)
        ]) and len(found) >= 6 and found)
        assert [(lt["error_class"], lt["source_offset"]) for lt in letters] == [
            ("BadSignature", 1), ("BadSignature", 2), ("BadSignature", 3), ("BadSignature", 4), ("StaleBatch", 5),
            ("StaleBatch", 6)]
        reasons = [lt["reason"] for lt in letters]
        assert "not signed" in reasons[0] and "does not match" in reasons[1] and "signed by dsid 2" in reasons[2]
        assert "does not match" in reasons[3] and "batch_max_age_ms" in reasons[4] and "future" in reasons[5]

        client = RegionClient([region.url])
        entries = client.get_all("orders", ["old-schema", "current-schema", "unsigned", "forged", "relabelled",
                                            "altered", "replayed", "future"])
        assert sorted(k for k, e in entries.items() if e is not None) == ["current-schema", "old-schema"]
        client.close()
    finally:
        receiver.stop()
        region.stop()


def _two_sites(tmp_path: Path, bootstrap: str, prefix: str, *, sender: dict[str, Any],
               region_b: dict[str, Any] | None = None) -> tuple[Path, Path, Any, Any]:
    """Site a (dsid 1) with gateway sender to-b and no region service of its own running (the test writes its
    queue); site b (dsid 2) with a receiver.  Each signs with its key and holds the other's public key."""
    two = write_two_sites(tmp_path, bootstrap, prefix, a={
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 50,
                             "batch_time_interval_ms": 20, "remote": remote(bootstrap, prefix, "b"), **sender}],
        "gateway_private_key": KEYS["a"][0], "gateway_public_keys": {2: KEYS["b"][1]},
    }, b={
        "regions": [{"name": "orders", "buckets": 2}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
        "gateway_private_key": KEYS["b"][0], "gateway_public_keys": {1: KEYS["a"][1]},
        **({"region_service": region_b} if region_b else {}),
    })
    return two.path_a, two.path_b, two.cfg_a, two.cfg_b


def _enqueue(bootstrap: str, cfg_a: Any, partition: int, events: list[dict[str, Any]]) -> None:
    """Events into a's sender queue, as a's region service would have put them there."""
    codec = get_codec()
    records = [(partition, e["key"].encode(), codec.encode("QueuedEvent", {
        "queue_id": "to-b", "changelog_partition": partition, "changelog_offset": e["event_id"]["sequence_id"],
        "enqueued_at": int(time.time() * 1000), "event": e}), None) for e in events]
    _produce(bootstrap, cfg_a.topics.queue("to-b"), records)


def test_with_tokens_on_a_refused_event_is_dead_lettered_at_its_origin_and_any_batch_size_applies(
        site_a, unique_prefix, tmp_path):
    """Site b's region service takes the member token only: the receiver applies through it.  A batch with an
    event of an empty key (written into a's queue by another writer of that topic) applies its good events;
    the bad one comes back in the ack and lands in a's .dlq with its reason, and the batches after it apply.
    A batch of 12,000 events (more than a region call takes) applies whole, in calls of apply_events_max."""
    path_a, path_b, cfg_a, cfg_b = _two_sites(
        tmp_path, site_a.bootstrap, unique_prefix, sender={"socket_read_timeout_ms": 20000},
        region_b={"token": TOKEN, "member_token": MEMBER_TOKEN})
    codec = get_codec()
    procs: list[Any] = []
    try:
        region_b = RegionProcess(path_b, tmp_path / "region-b.log")
        procs.append(region_b)
        region_b.wait_ready()
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        procs.append(SenderProcess(path_a, "to-b", tmp_path / "sender-a.log"))
        client = RegionClient([region_b.url], token=TOKEN)

        def present(keys: list[str]) -> bool:
            return all(e is not None for e in client.get_all("orders", keys).values())

        _enqueue(site_a.bootstrap, cfg_a, 0, [_event("k1", 1, source=1), _event("", 2, source=1),
                                              _event("k2", 3, source=1)])
        letters = _wait("the refused event in a's .dlq", lambda: [
            codec.decode_as("DeadLetter", v) for _, v, _ in
            _read(site_a.bootstrap, cfg_a.topics.dead_letter("to-b"), 1)])
        [letter] = letters
        assert letter["event"]["key"] == "" and letter["error_class"] == "InvalidRequest"
        assert "dsid 2 refused it" in letter["reason"] and "non-empty" in letter["reason"], letter["reason"]
        _wait("k1 and k2 at b", lambda: present(["k1", "k2"]))
        _enqueue(site_a.bootstrap, cfg_a, 0, [_event("k3", 4, source=1), _event("k4", 5, source=1)])
        _wait("the batch after the refused event at b", lambda: present(["k3", "k4"]))

        # 12,000 events in one batch (under Kafka's 1 MB record), signed by a, as a sender with batch_size
        # 12000 would send them.
        keys = [f"bulk-{i:05d}" for i in range(12_000)]
        bulk = codec.encode("GatewayBatch", _batch(1, [_event(k, 100 + i, value=b"1") for i, k in enumerate(keys)],
                                                   target=2, sender="bulk"))
        _produce(site_a.bootstrap, cfg_b.topics.gateway_inbound(), [(0, b"1/bulk/0", bulk,
                                                                     _signer("a", 1).headers(bulk))])

        def bulk_ack() -> dict[str, Any] | None:
            acks = [codec.decode_as("GatewayAck", v) for _, v, _ in
                    _read(site_a.bootstrap, cfg_b.topics.gateway_acks(), 2)]
            return next((a for a in acks if a["sender_id"] == "bulk"), None)

        ack = _wait("the ack of the 12,000-event batch", bulk_ack, timeout_s=120)
        assert (ack["last_applied_index"], ack["exceptions"]) == (11_999, [])
        assert len([k for k in client.keys("orders") if k.startswith("bulk-")]) == 12_000
        client.close()
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_receiver_ahead_of_the_senders_epoch_is_alerted_and_nothing_is_lost(site_a, unique_prefix, tmp_path):
    """b's acks topic holds, from a previous run, acks of batch ids far above a's new epoch (a's removals topic
    was lost): b would answer every batch duplicate_batch.  Acks not signed by b (unsigned, or by an intruder)
    are ignored and alerted.  When b's receiver answers duplicate_batch to batches a sent once, a alerts
    (sluice.alerts unexpected_duplicate_ack), removes nothing, opens an epoch above b's last_batch_id and sends
    again: every event reaches b."""
    path_a, path_b, cfg_a, cfg_b = _two_sites(tmp_path, site_a.bootstrap, unique_prefix,
                                              sender={"socket_read_timeout_ms": 60000})
    codec = get_codec()
    inbound = lambda p: (partition_for_key(b"1/to-b", 2) + p) % 2  # noqa: E731 - the sender's mapping
    ahead = (7 << 32) + 5
    previous_run = []
    for p in (0, 1):
        ack = codec.encode("GatewayAck", {
            "sender_id": "to-b", "source_dsid": 1, "receiver_dsid": 2, "queue_partition": p, "batch_id": ahead,
            "last_applied_index": 0, "last_applied_event_id": None, "duplicate_batch": False, "exceptions": [],
            "acked_at": 1, "last_batch_id": ahead})
        previous_run.append((inbound(p), f"1/to-b/{p}".encode(), ack, _signer("b", 2).headers(ack)))
    _produce(site_a.bootstrap, cfg_b.topics.gateway_acks(), previous_run)

    procs: list[Any] = []
    try:
        region_b = RegionProcess(path_b, tmp_path / "region-b.log")
        procs.append(region_b)
        sender = SenderProcess(path_a, "to-b", tmp_path / "sender-a.log")
        procs.append(sender)
        events = {p: [_event(f"p{p}-k{i}", i, thread=p + 1) for i in range(10)] for p in (0, 1)}
        for p, evs in events.items():
            _enqueue(site_a.bootstrap, cfg_a, p, evs)
        sent = _wait("a's first batches at b", lambda: (found := [
            codec.decode_as("GatewayBatch", v) for _, v, _ in _read(site_a.bootstrap, cfg_b.topics.gateway_inbound(), 2)
        ]) and {b["queue_partition"] for b in found} == {0, 1} and found)
        assert all(b["batch_id"] >> 32 == 1 for b in sent), "a's removals were empty: its epoch is 1"

        # Acks that b did not sign, claiming a's batches applied: believed, a would remove them unsent.
        forged = []
        for b in sent:
            ack = codec.encode("GatewayAck", {
                "sender_id": "to-b", "source_dsid": 1, "receiver_dsid": 2, "queue_partition": b["queue_partition"],
                "batch_id": b["batch_id"], "last_applied_index": len(b["events"]) - 1, "last_applied_event_id": None,
                "duplicate_batch": False, "exceptions": [], "acked_at": 1, "last_batch_id": b["batch_id"]})
            key = f"1/to-b/{b['queue_partition']}".encode()
            forged += [(inbound(b["queue_partition"]), key, ack, None),
                       (inbound(b["queue_partition"]), key, ack, _signer("intruder", 2).headers(ack))]
        _produce(site_a.bootstrap, cfg_b.topics.gateway_acks(), forged)
        _wait("the unverified acks alerted", lambda: _alerts(sender, "unverified_ack") >= 1)

        region_b.wait_ready()
        procs.append(ReceiverProcess(path_b, tmp_path / "receiver-b.log"))
        client = RegionClient([region_b.url])
        keys = [e["key"] for evs in events.values() for e in evs]
        _wait("every event at b", lambda: all(e is not None for e in client.get_all("orders", keys).values()),
              timeout_s=90)
        assert _alerts(sender, "unexpected_duplicate_ack") >= 1
        removals = [codec.decode_as("RemovalRecord", v) for _, v, _ in
                    _read(site_a.bootstrap, cfg_a.topics.removals("to-b"), 1)]
        epochs = {r["queue_partition"]: r["batch_id"] >> 32 for r in removals if r["removed_count"] == 0
                  and r["batch_id"] >> 32 > 1}
        assert epochs == {0: 8, 1: 8}, f"no epoch above b's tracking (7) was opened: {removals}"
        log = (tmp_path / "sender-a.log").read_text()
        assert "ALERT" in log and "answered batch" in log and "as a duplicate" in log
        client.close()
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_wrong_member_token_is_alerted_and_retried_never_dead_lettered(site_a, unique_prefix, tmp_path):
    """A receiver whose member token the region service refuses (401) applies nothing, dead-letters nothing
    and acks nothing: it keeps retrying the batch with backoff and raises sluice.alerts region_unauthorized."""
    prefix = site_a.topic_prefix(unique_prefix)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    site = {"site": "c", "dsid": 3, "kafka": _kafka(site_a.bootstrap, prefix),
            "regions": [{"name": "orders", "buckets": 2}],
            "receiver": {"inbound_partitions": 1, "accepted_dsids": [1]},
            "gateway_private_key": KEYS["c"][0], "gateway_public_keys": {1: KEYS["a"][1]},
            "region_service": {"port": port, "token": TOKEN, "member_token": MEMBER_TOKEN}}
    cfg = _write_site(tmp_path / "site-c.yaml", site)
    # With another member token the receiver cannot trust the instances' signed records on the status topic:
    # it finds the region service at the site file's address (region_service.port) instead.
    _write_site(tmp_path / "receiver-c.yaml", {**site, "region_service": {
        "port": port, "token": TOKEN, "member_token": "not-the-member-token-0123"}})
    value = get_codec().encode("GatewayBatch", _batch(1, [_event("held", 1)]))
    _produce(site_a.bootstrap, cfg.topics.gateway_inbound(), [(0, b"1/to-c/0", value, _signer("a", 1).headers(value))])
    region = RegionProcess(tmp_path / "site-c.yaml", tmp_path / "region.log", port=port)
    receiver = None
    try:
        region.wait_ready()
        receiver = ReceiverProcess(tmp_path / "receiver-c.yaml", tmp_path / "receiver.log")
        _wait("the region_unauthorized alert", lambda: _alerts(receiver, "region_unauthorized") >= 1)
        _wait("a few attempts", lambda: (tmp_path / "receiver.log").read_text().count("trying again") >= 3)
        assert _read(site_a.bootstrap, cfg.topics.region_dead_letter(), 1) == []
        assert _read(site_a.bootstrap, cfg.topics.gateway_acks(), 1) == []
        with RegionClient([region.url], token=TOKEN) as client:
            assert client.get_entry("orders", "held") is None
        assert "not-the-member-token" not in (tmp_path / "receiver.log").read_text()
    finally:
        if receiver is not None:
            receiver.stop()
        region.stop()
