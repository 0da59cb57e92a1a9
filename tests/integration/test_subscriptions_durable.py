"""Durable-client contracts of Geode's client API against a real broker, region service and
subscription-service processes: ``ready_for_events`` returns once the marker is in the client's
queue, ``pending_event_count`` tells a reconnecting durable client what waits for it (or that its
queue was dropped), and ``maximum_message_count`` bounds a client's queue."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from sluice.client import ALL_KEYS, ClientCache, RegionClient
from sluice.core.codec import get_codec
from sluice.core.errors import InvalidRequest, NoServersAvailable
from sluice.core.processes import SubscriptionsProcess

from test_subscriptions import Recorder, running_site, site, wait_for  # noqa: F401 - site: a fixture

pytestmark = pytest.mark.timeout(300)


# --- ready_for_events: synchronous, as Geode's readyForEvents ------------------------------------


def test_events_written_once_ready_for_events_returns_are_live_every_time(site: Any, tmp_path: Path) -> None:
    """``ready_for_events`` returns only once the marker is in the client's queue, so the writes made
    right after it returns come after the marker: the listener hears them live, never replayed.  Three
    clients, a new one, one resuming a durable queue with a backlog, and a new durable one."""
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        first = ClientCache(cfg, "ready-durable", durable=True, region_urls=[region.url])
        first.region("orders").register_interest_regex(r"b-\d+", durable=True)
        first.ready_for_events()
        wait_for(lambda: first.live, 30, "the first connection's marker")
        first.close(keep_alive=True)
        writer.put_all("orders", {f"b-{i}": i for i in range(200)})  # the backlog of the durable client

        for client_id, durable, backlog in (("ready-new", False, 0), ("ready-durable", True, 200),
                                            ("ready-new-durable", True, 0)):
            cache = ClientCache(cfg, client_id, durable=durable, region_urls=[region.url])
            try:
                orders = cache.region("orders")
                rec = Recorder()
                orders.add_listener(rec)
                orders.register_interest_regex(r"b-\d+", durable=durable)
                orders.register_interest([f"{client_id}-{i}" for i in range(5)], durable=durable)
                cache.ready_for_events()
                for i in range(5):
                    writer.put("orders", f"{client_id}-{i}", i)   # right after it returned

                def heard_all(prefix: str = client_id) -> bool:
                    return sum(n for k, n in rec.keys().items() if k.startswith(prefix)) >= 5

                wait_for(heard_all, 30, f"{client_id}: the five writes")
                with rec.lock:
                    heard = [(e.key, e.replayed) for e in rec.events if e.key.startswith(client_id)]
                    replayed = [e for e in rec.events if e.replayed]
                assert heard == [(f"{client_id}-{i}", False) for i in range(5)], (
                    f"{client_id}: writes made after ready_for_events returned must be live: {heard}")
                assert len(replayed) == backlog and all(e.key.startswith("b-") for e in replayed)
                assert cache.live
            finally:
                cache.close()


def test_ready_for_events_without_a_subscription_service_fails_clearly(site: Any, tmp_path: Path) -> None:
    """No subscription service runs: ``ready_for_events`` gives up after its timeout with an error that
    says so; the readiness stays recorded, and the marker comes once a service runs."""
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"):
        cache = ClientCache(cfg, "ready-alone", region_urls=[region.url])
        cache.region("orders").register_interest(["k"])
    try:
        started = time.monotonic()
        with pytest.raises(NoServersAvailable, match="marker was not placed in its queue within 2 s"):
            cache.ready_for_events(timeout_s=2)
        assert time.monotonic() - started < 30
        assert not cache.live
        with SubscriptionsProcess(path, tmp_path / "subs-2.log"):
            cache.ready_for_events()
            wait_for(lambda: cache.live, 30, "the marker once a service runs")
    finally:
        cache.close()


# --- pending_event_count: Geode's getPendingEventCount ------------------------------------------


def _waiting(cfg: Any, bootstrap: str, client_id: str, queue: str) -> int:
    """Messages in a client's queue past its acknowledged position, as the broker holds them."""
    from sluice.core.clientregistry import read_latest, registry_partition

    raw = read_latest(cfg, cfg.topics.subscription_acks(),
                      registry_partition(client_id, cfg.subscriptions.registry_partitions), client_id)
    ack = None if raw is None else get_codec().decode_as("ClientAck", raw)
    acked = ack["next_offset"] if ack is not None and ack["queue_topic"] == queue else 0
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        return probe.get_watermark_offsets(TopicPartition(queue, 0), timeout=10)[1] - acked
    finally:
        probe.close()


def test_pending_event_count_follows_geodes_contract(site: Any, site_a: Any, tmp_path: Path) -> None:
    """A durable client's first connect: -2.  Reconnecting with N events waiting: N, on every call, and
    then N events replayed.  After ``ready_for_events``, and for a client that is not durable: refused,
    as Geode's IllegalStateException.  Reconnecting after the durable-client-timeout dropped the queue:
    -1 (once: the next reconnect finds the new queue, 0 waiting)."""
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs, RegionClient(region.url) as writer:
        first = ClientCache(cfg, "pending-1", durable=True, region_urls=[region.url])
        assert first.pending_event_count() == -2, "a durable client's first connect"
        first.region("orders").register_interest_regex(r"p-\d+", durable=True)
        first.ready_for_events()
        with pytest.raises(InvalidRequest, match="before ready_for_events"):
            first.pending_event_count()
        wait_for(lambda: first.live, 30, "the marker")
        queue = first.queue_topic
        first.close(keep_alive=True)

        writer.put_all("orders", {f"p-{i}": i for i in range(30)})
        for i in range(7):
            writer.put("orders", "p-1", 100 + i)                          # each update of a key counts
        writer.put_all("orders", {f"other-{i}": i for i in range(10)})  # not its interest
        wait_for(lambda: _waiting(cfg, site_a.bootstrap, "pending-1", queue) == 37, 30, "37 events queued")

        again = ClientCache(cfg, "pending-1", durable=True, region_urls=[region.url])
        try:
            assert again.replayed_queue and again.queue_topic == queue
            assert again.pending_event_count() == 37
            assert again.pending_event_count() == 37, "the same value on every call of a connection"
            rec = Recorder()
            orders = again.region("orders")
            orders.add_listener(rec)
            orders.register_interest_regex(r"p-\d+", durable=True)
            again.ready_for_events()
            wait_for(lambda: again.live, 30, "the marker")
            assert len(rec.events[:rec.live_at]) == 37 and all(e.replayed for e in rec.events[:rec.live_at])
        finally:
            again.close()

        plain = ClientCache(cfg, "pending-plain", region_urls=[region.url])
        try:
            with pytest.raises(InvalidRequest, match="only a durable client"):
                plain.pending_event_count()
        finally:
            plain.close()

        late = ClientCache(cfg, "pending-late", durable=True, durable_timeout_s=2, region_urls=[region.url])
        late.region("orders").register_interest(ALL_KEYS, durable=True)
        late.ready_for_events()
        wait_for(lambda: late.live, 30, "the marker")
        late_queue = late.queue_topic
        late.close(keep_alive=True)
        writer.put_all("orders", {f"l-{i}": i for i in range(20)})      # queued, then dropped with the queue
        wait_for(lambda: "ALERT durable client pending-late timed out" in subs.log_tail(50000), 30, "the timeout")
        wait_for(lambda: not _topic_exists(site_a.bootstrap, late_queue), 30, "the queue deleted")
        back = ClientCache(cfg, "pending-late", durable=True, region_urls=[region.url])
        try:
            assert back.pending_event_count() == -1, "its queue was dropped while it was away: resynchronise"
            assert not back.replayed_queue
            assert back.region("orders").register_interest(ALL_KEYS, durable=True) >= 20, "fetched again"
            back.ready_for_events()
            wait_for(lambda: back.live, 30, "the marker")
        finally:
            back.close(keep_alive=True)
        once_more = ClientCache(cfg, "pending-late", durable=True, region_urls=[region.url])
        try:
            assert once_more.pending_event_count() == 0, "-1 is said once: this queue is new and holds nothing"
        finally:
            once_more.close()


def _topic_exists(bootstrap: str, topic: str) -> bool:
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        return topic in probe.list_topics(timeout=10).topics
    finally:
        probe.close()


# --- maximum_message_count: a bounded queue, and a client that resynchronises ----------------------


class QueueReader:
    """Reads a client's queue from an offset, all along, until told to stop or the queue is gone: what the
    broker let the queue hold."""

    def __init__(self, bootstrap: str, queue: str, start: int) -> None:
        self.offsets: list[int] = []
        self.kinds: list[str] = []
        self._stop = threading.Event()
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe", "fetch.wait.max.ms": 10,
                                   "enable.auto.commit": False})
        self._consumer.assign([TopicPartition(queue, 0, start)])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        codec = get_codec()
        while not self._stop.is_set():
            try:
                msgs = self._consumer.consume(500, 0.05)
            except KafkaException:
                continue
            for msg in msgs:
                if msg.error() is None:
                    self.offsets.append(msg.offset())
                    self.kinds.append(codec.decode_as("ClientMessage", msg.value())["kind"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


@pytest.fixture
def bounded_site(tmp_path: Path, site_a: Any, unique_prefix: str) -> Any:
    with running_site(tmp_path, site_a, unique_prefix, maximum_message_count=50) as running:
        yield running


def test_a_queue_at_maximum_message_count_takes_no_more_and_its_client_resynchronises(
        bounded_site: Any, site_a: Any, tmp_path: Path) -> None:
    """maximum_message_count 50, a durable client away, 200 events for it.  Its queue never holds more than
    50 messages past the client's position (read all along from the broker); the events that found it full
    are counted (``sluice.subscriptions.events_not_queued``), an ALERT is logged and counted, the queue is
    deleted and the client unregistered, and `sluice admin status` shows it dropped.  Back, the client is
    told its queue was dropped (``pending_event_count()`` -1) and fetches its interest again: its cache
    equals the region, and nothing is replayed."""
    import subprocess
    import sys

    from test_health_endpoints import metric_value, scrape

    cfg, path, region = bounded_site
    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs, RegionClient(region.url) as writer:
        first = ClientCache(cfg, "full-1", durable=True, region_urls=[region.url])
        first.region("orders").register_interest_regex(r"f-\d+", durable=True)
        first.ready_for_events()
        wait_for(lambda: first.live, 30, "the marker")
        queue = first.queue_topic
        first.close(keep_alive=True)
        wait_for(lambda: _waiting(cfg, site_a.bootstrap, "full-1", queue) == 0, 30, "everything acknowledged")
        probe = Consumer({"bootstrap.servers": site_a.bootstrap, "group.id": "probe"})
        acked = probe.get_watermark_offsets(TopicPartition(queue, 0), timeout=10)[1]
        probe.close()
        reader = QueueReader(site_a.bootstrap, queue, acked)
        try:
            writer.put_all("orders", {f"f-{i}": i for i in range(200)})
            wait_for(lambda: "ALERT client full-1" in subs.log_tail(50000), 30, "the queue-full alert")
            wait_for(lambda: not _topic_exists(site_a.bootstrap, queue), 30, "the queue deleted")
        finally:
            reader.stop()
        assert len(reader.offsets) <= 50, f"the queue held {len(reader.offsets)} messages past the client's position"
        assert set(reader.kinds) <= {"EVENT"}
        alert = next(line for line in subs.log_tail(50000).splitlines() if "ALERT client full-1" in line)
        print(alert)
        print(f"read from the queue before it was deleted: {len(reader.offsets)} messages")
        assert "(50 messages not acknowledged, the bound 50)" in alert
        not_queued = int(alert.split(" events could not be queued")[0].rsplit("; ", 1)[1])
        assert 1 <= not_queued <= 150
        metrics = scrape(subs)
        assert metric_value(metrics, "sluice_subscriptions_events_not_queued_total") == not_queued
        assert metric_value(metrics, "sluice_alerts_total", sluice_alert_name="client_queue_full") == 1

        shown = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path), "status"],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        row = next(line for line in shown.stdout.splitlines() if "full-1" in line)
        print(row)
        assert "queue dropped" in row

        again = ClientCache(cfg, "full-1", durable=True, region_urls=[region.url])
        try:
            assert again.pending_event_count() == -1, "its queue was dropped: resynchronise"
            assert not again.replayed_queue and again.queue_topic != queue
            orders = again.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            assert orders.register_interest_regex(r"f-\d+", durable=True) == 200
            assert orders.snapshot() == {f"f-{i}": i for i in range(200)}, "the cache equals the region"
            again.ready_for_events()
            wait_for(lambda: again.live, 30, "the marker")
            assert rec.events == [], "nothing replayed from a dropped queue"
        finally:
            again.close()


def test_a_connected_client_too_slow_for_its_queue_starts_over_with_its_interest_fetched_again(
        bounded_site: Any, tmp_path: Path) -> None:
    """A connected client whose listener holds the queue's reader: its queue reaches 50 messages, is
    dropped, and the client starts over on a new queue with its interest fetched again; events written
    after that reach it, and its cache ends equal to the region."""
    cfg, path, region = bounded_site
    release = threading.Event()

    class Stuck(Recorder):
        def _keep(self, event: Any) -> None:
            release.wait(60)
            super()._keep(event)

        after_create = after_update = _keep

    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs, RegionClient(region.url) as writer:
        cache = ClientCache(cfg, "slow-full", region_urls=[region.url])
        try:
            orders = cache.region("orders")
            orders.add_listener(Stuck())
            orders.register_interest_regex(r"s-\d+")
            cache.ready_for_events()
            wait_for(lambda: cache.live, 30, "the marker")
            old = cache.queue_topic
            writer.put_all("orders", {f"s-{i}": i for i in range(120)})
            wait_for(lambda: "ALERT client slow-full" in subs.log_tail(50000), 30, "the queue-full alert")
            release.set()
            wait_for(lambda: cache.stats["reinitialized"] == 1 and cache.queue_topic != old, 60, "starting over")
            wait_for(lambda: orders.snapshot() == {f"s-{i}": i for i in range(120)}, 30, "the interest fetched again")
            writer.put("orders", "s-7", "after")
            wait_for(lambda: orders.get_local("s-7") == "after", 30, "an event on the new queue")
        finally:
            release.set()
            cache.close()
