"""Write-behind through the dispatcher to real databases: failover and conflation."""

from __future__ import annotations

import random
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from sluice.admin.cli import queue_status
from sluice.client import RegionClient
from sluice.core.events import EventID

from recording_listener import read_offers
from regionkit import DispatcherProcess, RegionProcess, queue_size, write_aeq_site
from waiting import read_until

pytestmark = pytest.mark.timeout(400)

#: How long the first offers may take once the writers start, and the queues to drain (and the table to
#: catch up) after the last write.
FLOWING_S = 60
DRAIN_S = 90


def _sql_queue(queue_id: str, log: Path, url: str, table: str, **extra: Any) -> dict[str, Any]:
    return {"id": queue_id, "listener": {"type": "python", "class_path": "recording_listener:RecordingSqlListener",
                                         "settings": {"path": str(log), "url": url, "table": table}}, **extra}


def _live_table(postgres: Any, table: str) -> dict[str, Any]:
    with postgres.connect() as conn:
        rows = conn.execute(f"SELECT key, value FROM {table}_live").fetchall()
    return {k: v for k, v in rows}


def test_kill_9_of_the_primary_dispatcher_mid_run_loses_nothing(site_a, unique_prefix, postgres, tmp_path: Path):
    """A SIGKILLed primary of an 8-bucket parallel queue is replaced; every event arrives, repeats are flagged,
    and the PostgreSQL table equals the region."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    log = tmp_path / "offers.jsonl"
    queue = _sql_queue("wb", log, postgres.url, table, parallel=True, batch_size=50, batch_time_interval_ms=20)
    cfg = write_aeq_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                         prefix=site_a.topic_prefix(unique_prefix), queue=queue)
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    d1 = DispatcherProcess(tmp_path / "site.yaml", "wb", tmp_path / "dispatcher-1.log")
    d2 = DispatcherProcess(tmp_path / "site.yaml", "wb", tmp_path / "dispatcher-2.log")
    try:
        region.wait_ready()
        acked: list[tuple[str, EventID]] = []
        expected: dict[str, Any] = {}
        lock = threading.Lock()
        done = threading.Event()

        def writer(i: int) -> None:
            client = RegionClient([region.url], member_id=f"w{i}-{uuid.uuid4().hex[:6]}")
            rng = random.Random(i)
            for n in range(600):
                key = f"w{i}-k{rng.randrange(40)}"
                eid = client.next_event_id()
                if rng.random() < 0.1 and key in expected:
                    client.destroy("orders", key, event_id=eid)
                    with lock:
                        expected.pop(key, None)
                        acked.append((key, eid))
                else:
                    value = {"w": i, "n": n}
                    client.put("orders", key, value, event_id=eid)
                    with lock:
                        expected[key] = value
                        acked.append((key, eid))
            done.set()

        writers = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
        for w in writers:
            w.start()
        # Kill whichever dispatcher is primary for more partitions, once events flow.
        read_until(lambda: [o for o in read_offers(str(log)) if o["accepted"]], lambda accepted: len(accepted) >= 10,
                   timeout_s=FLOWING_S)
        owners = {r.primary for r in queue_status(cfg, "wb") if r.primary != "—"}
        victim = d1 if d1.member_id in owners else d2
        victim.kill()
        killed_after = len(read_offers(str(log)))
        for w in writers:
            w.join(120)

        # Wait until the queue is drained and the table caught up.
        read_until(lambda: queue_size(cfg, "wb") == 0 and _live_table(postgres, table) == expected, bool,
                   timeout_s=DRAIN_S, poll_s=0.5)
        offers = read_offers(str(log))
        delivered = [e for o in offers if o["accepted"] for e in o["events"]]
        ids = [(e[4], e[5], e[6]) for e in delivered]
        acked_ids = {(e.member_id, e.thread_id, e.sequence_id) for _, e in acked}
        assert acked_ids <= set(ids), f"{len(acked_ids - set(ids))} events never delivered"
        assert set(ids) <= acked_ids
        seen: set[tuple[str, int, int]] = set()
        repeats = 0
        for e in delivered:
            eid = (e[4], e[5], e[6])
            if eid in seen:
                repeats += 1
                assert e[7], f"repeat of {eid} not marked possibleDuplicate"
            seen.add(eid)
        table_now = _live_table(postgres, table)
        assert table_now == expected, f"{len(set(table_now.items()) ^ set(expected.items()))} rows differ"
        region_now = {k: v["value"] for k, v in RegionClient([region.url]).get_all(
            "orders", sorted(set(k for k, _ in acked))).items() if v is not None}
        assert region_now == table_now
        print(f"\n{len(acked)} writes; dispatcher killed after {killed_after} offers; {len(delivered)} delivered, "
              f"{repeats} repeats (all possibleDuplicate); table == region ({len(table_now)} rows)")
    finally:
        for proc in (d1, d2):
            proc.stop()
        region.stop()


def test_conflation_gives_the_same_table_with_fewer_listener_calls(site_a, unique_prefix, tmp_path: Path):
    """Two queues on the same region, conflation on and off: equal SQLite tables, fewer offers when on."""
    import sqlite3

    import yaml

    from sluice.core.config import load_config
    from sluice.core.topics import apply_topics

    prefix = site_a.topic_prefix(unique_prefix)
    queues = []
    for qid, conflation in (("on", True), ("off", False)):
        queues.append(_sql_queue(qid, tmp_path / f"{qid}.jsonl", f"sqlite:///{tmp_path}/{qid}.db", "orders",
                                 parallel=False, dispatcher_threads=1, batch_size=50, batch_time_interval_ms=300,
                                 batch_conflation=conflation))
    data = {
        "site": "a", "dsid": 1,
        "kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4, "async_event_queues": ["on", "off"]}],
        "async_event_queues": queues,
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(tmp_path / "site.yaml")
    assert apply_topics(cfg).ok
    region = RegionProcess(tmp_path / "site.yaml", tmp_path / "region.log")
    dispatchers = [DispatcherProcess(tmp_path / "site.yaml", q, tmp_path / f"d-{q}.log") for q in ("on", "off")]
    try:
        region.wait_ready()
        client = RegionClient([region.url])
        for n in range(20):
            client.put_all("orders", {f"k{i}": {"n": n, "i": i} for i in range(30)})
        client.destroy("orders", "k3")
        read_until(lambda: all(queue_size(cfg, q) == 0 for q in ("on", "off")), bool, timeout_s=DRAIN_S, poll_s=0.3)
        tables = {}
        for q in ("on", "off"):
            with sqlite3.connect(tmp_path / f"{q}.db") as conn:
                tables[q] = dict(conn.execute("SELECT key, value FROM orders_live").fetchall())
        assert tables["on"] == tables["off"] and len(tables["on"]) == 29
        events = {q: sum(len(o["events"]) for o in read_offers(str(tmp_path / f"{q}.jsonl"))) for q in ("on", "off")}
        calls = {q: len(read_offers(str(tmp_path / f"{q}.jsonl"))) for q in ("on", "off")}
        assert events["off"] == 601 and calls["off"] >= 601 // 50
        assert events["on"] < events["off"] and calls["on"] < calls["off"]
        print(f"\nconflation on: {calls['on']} calls, {events['on']} events; off: {calls['off']} calls, "
              f"{events['off']} events; tables equal ({len(tables['on'])} rows)")
    finally:
        for d in dispatchers:
            d.stop()
        region.stop()
