"""Client subscriptions against a real broker, region service and subscription-service processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

from sluice.client import ALL_KEYS, ClientCache, RegionClient, RegionError, ResultPolicy
from sluice.core.codec import get_codec
from sluice.core.config import SiteConfig, load_config
from sluice.core.events import EntryEvent
from sluice.core.processes import SubscriptionsProcess
from sluice.core.topics import apply_topics

from regionkit import RegionProcess, read_topic
from waiting import holds_for
from waiting import wait_for as _wait_for

pytestmark = pytest.mark.timeout(240)

#: The window in which an event that should not come (a repeat, a replay, an event sent back to its writer)
#: would arrive if it were going to: many poll intervals of the client.
QUIET_S = 1.0
#: The HA test: how many write rounds must be acknowledged before the primary is killed, and the pace of
#: the writes (part of the workload: the rounds must span the kill and the failover).
ROUNDS_BEFORE_KILL = 20
WRITE_INTERVAL_S = 0.05
#: How long the slow client's listener takes per event (part of the workload, not a wait).
SLOW_LISTENER_S = 0.05


def _site(path: Path, bootstrap: str, prefix: str, **subscriptions: Any) -> SiteConfig:
    data = {
        "site": "b", "dsid": 2,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "session_timeout_ms": 3000,
                  "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 4}, {"name": "prices", "buckets": 2}],
        "subscriptions": {"registry_partitions": 4, "ping_interval_ms": 500,
                          "maximum_time_between_pings_ms": 4000, **subscriptions},
    }
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert apply_topics(cfg).ok
    return cfg


class Recorder:
    """A listener that keeps every event it is given, in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.live_at: int | None = None
        self.lock = threading.Lock()

    def _keep(self, event: Any) -> None:
        with self.lock:
            self.events.append(event)

    after_create = after_update = after_destroy = after_invalidate = _keep

    def after_region_live(self, region: str) -> None:
        with self.lock:
            self.live_at = len(self.events)

    def keys(self, *, replayed: bool | None = None) -> Counter[str]:
        with self.lock:
            return Counter(e.key for e in self.events if replayed is None or e.replayed == replayed)


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    _wait_for(predicate, timeout_s=timeout_s, what=what, poll_s=0.05)


@contextlib.contextmanager
def running_site(tmp_path: Path, site_a: Any, unique_prefix: str, **subscriptions: Any) -> Iterator[Any]:
    """(site config, site file, its running region service); ``subscriptions``: that section's settings."""
    path = tmp_path / "site-b.yaml"
    cfg = _site(path, site_a.bootstrap, unique_prefix, **subscriptions)
    with RegionProcess(path, tmp_path / "region.log") as region:
        region.wait_ready()
        yield cfg, path, region


@pytest.fixture
def site(tmp_path: Path, site_a: Any, unique_prefix: str) -> Any:
    with running_site(tmp_path, site_a, unique_prefix) as running:
        yield running


def test_smoke_register_write_receive(site: Any, tmp_path: Path) -> None:
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"):
        with RegionClient(region.url) as writer:
            writer.put("orders", "k1", 1)
            cache = ClientCache(cfg, "c1", region_urls=[region.url])
            try:
                orders = cache.region("orders")
                rec = Recorder()
                orders.add_listener(rec)
                assert orders.register_interest(["k1", "k2"]) == 1
                assert orders.get_local("k1") == 1
                cache.ready_for_events()
                wait_for(lambda: cache.live, 20, "the marker")
                writer.put("orders", "k2", 2)
                writer.put("orders", "k3", 3)
                writer.put("orders", "k1", 11)
                wait_for(lambda: orders.get_local("k1") == 11, 20, "k1 = 11")
                assert orders.get_local("k2") == 2
                assert orders.get_local("k3") is None
                assert [(e.key, e.new_value) for e in rec.events] == [("k2", 2), ("k1", 11)]
            finally:
                cache.close()


# --- what the region's history says each client should receive -------------------------------


def history(cfg: SiteConfig, bootstrap: str, region: str = "orders") -> list[EntryEvent]:
    """Every event the region applied, from its changelog (per key in order)."""
    codec = get_codec()
    buckets = cfg.region(region).buckets
    return [EntryEvent.from_record(codec.decode_as("EntryEvent", v))
            for _p, _o, v in read_topic(bootstrap, cfg.topics.region_changelog(region), buckets) if v is not None]


def expected_for(cache: ClientCache, events: list[EntryEvent], region: str = "orders") -> dict[str, list[Any]]:
    """Per key, the (EventID, values?) a client's interest calls for: never its own writes."""
    interest = cache.region(region).interest
    out: dict[str, list[Any]] = {}
    for e in events:
        delivery = interest.delivery(e.key)
        if delivery is None or e.event_id.member_id == cache.member_id:
            continue
        out.setdefault(e.key, []).append((e.event_id, delivery.value))
    return out


def test_two_clients_overlapping_interest_receive_exactly_their_events(site: Any, site_a: Any, tmp_path: Path) -> None:
    """Keys and a regex per client, overlapping; values for some, invalidates for others; each
    client's own writes never come back; checked against the region's changelog."""
    cfg, path, region = site
    keys = [f"k-{i:02d}" for i in range(60)]
    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        writer.put_all("orders", {k: 0 for k in keys})
        a = ClientCache(cfg, "client-a", region_urls=[region.url])
        b = ClientCache(cfg, "client-b", region_urls=[region.url])
        try:
            recorders = {}
            for cache in (a, b):
                recorders[cache.client_id] = Recorder()
                cache.region("orders").add_listener(recorders[cache.client_id])
            ao, bo = a.region("orders"), b.region("orders")
            ao.register_interest(keys[:20])                                    # k-00..k-19: values
            ao.register_interest_regex(r"k-[2-3]\d", receive_values=False)     # k-20..k-39: invalidates
            bo.register_interest_regex(r"k-(1|2)\d")                           # k-10..k-29: values
            bo.register_interest(keys[35:45], receive_values=False, policy=ResultPolicy.KEYS)  # invalidates
            assert len(ao) == 40 and len(bo) == 30
            a.ready_for_events()
            b.ready_for_events()
            wait_for(lambda: a.live and b.live, 20, "both markers")
            earlier = {e.event_id for e in history(cfg, site_a.bootstrap)}

            for round_ in range(1, 6):
                writer.put_all("orders", {k: round_ for k in keys})
                for i, k in enumerate(keys[::7]):
                    (ao if i % 2 else bo).put(k, -round_)                      # own writes: never sent back
                writer.destroy("orders", keys[round_])
                writer.put("orders", keys[round_], round_ * 100)
                writer.invalidate("orders", keys[30 + round_])
            events = [e for e in history(cfg, site_a.bootstrap) if e.event_id not in earlier]
            for cache in (a, b):
                want = expected_for(cache, events)
                want_total = sum(map(len, want.values()))
                rec = recorders[cache.client_id]

                def received(c: ClientCache = cache, r: Recorder = rec) -> dict[str, list[Any]]:
                    out: dict[str, list[Any]] = {}
                    with r.lock:
                        for e in r.events:
                            if e.event_id.member_id != c.member_id:  # its own writes fire its listeners locally
                                out.setdefault(e.key, []).append((e.event_id, e.delivery.value))
                    return out

                wait_for(lambda: sum(map(len, received().values())) >= want_total, 30, f"{cache.client_id}'s events")
                holds_for(lambda: sum(map(len, received().values())) == want_total, window_s=QUIET_S,
                          what=f"{cache.client_id} receives no event beyond the {want_total} of the history")
                got = received()
                assert got == want, f"{cache.client_id}: events received differ from the region's history"
                assert all(not e.replayed for e in rec.events)
                assert all(e.new_value is None for e in rec.events if e.delivery.value == "invalidates")
                assert cache.processed()["repeats"] == 0
                print(f"{cache.client_id}: {want_total} events over {len(want)} keys, as the history says; "
                      f"stats {cache.processed()}")
            # Caches: values keys equal the region; invalidates keys hold no stale value.
            region_now = writer.get_all("orders", keys)
            for key in keys[:20]:
                entry = region_now[key]
                assert ao.get_local(key) == (None if entry is None or entry["invalid"] else entry["value"]), key
            for key in keys[20:40]:
                assert ao.get_local(key) in (None, region_now[key]["value"] if region_now[key] else None), key
        finally:
            a.close()
            b.close()


def test_durable_client_away_during_5000_updates_gets_each_once_before_the_marker(
        site: Any, site_a: Any, tmp_path: Path) -> None:
    cfg, path, region = site
    keys = [f"d-{i:03d}" for i in range(200)]
    mine = keys[:100]
    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        writer.put_all("orders", {k: 0 for k in keys})
        first = ClientCache(cfg, "durable-1", durable=True, region_urls=[region.url])
        first.region("orders").register_interest_regex(r"d-0\d\d", durable=True)
        first.ready_for_events()
        wait_for(lambda: first.live, 20, "the first marker")
        first.close(keep_alive=True)

        before = {e.event_id for e in history(cfg, site_a.bootstrap)}
        for round_ in range(50):                  # 50 × 100 = 5,000 updates of its keys, 500 of others between
            writer.put_all("orders", {k: {"round": round_, "key": k} for k in mine})
            if round_ % 10 == 0:
                writer.put_all("orders", {k: {"round": round_} for k in keys[100:]})
        away = [e for e in history(cfg, site_a.bootstrap) if e.event_id not in before]
        assert len(away) == 5500
        shown = subprocess.run([sys.executable, "-m", "sluice.cli", "admin", "-c", str(path), "status"],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        row = next(line for line in shown.stdout.splitlines() if "durable-1" in line)
        print(row)
        assert "away since" in row and " 5000 " in row and "durable" in row
        want = {k: [e.event_id for e in away if e.key == k] for k in mine}

        again = ClientCache(cfg, "durable-1", durable=True, region_urls=[region.url])
        try:
            assert again.replayed_queue, "the durable queue was not found"
            orders = again.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            puts_before_live: list[str] = []
            real_put = orders.cache.put

            def watched_put(key: str, value: Any) -> None:
                if not again.live:
                    puts_before_live.append(key)
                real_put(key, value)

            orders.cache.put = watched_put  # type: ignore[method-assign]
            orders.register_interest_regex(r"d-0\d\d", durable=True)
            puts_before_live.clear()  # the load's entries are set by finish_load, not put
            again.ready_for_events()
            wait_for(lambda: again.live, 60, "the marker after reconnecting")
            replayed = [e for e in rec.events[:rec.live_at]]
            assert all(e.replayed for e in replayed)
            got = {k: [e.event_id for e in replayed if e.key == k] for k in mine}
            assert got == want, "the queued events, each once and in order, before the marker"
            assert len(replayed) == 5000
            assert not puts_before_live, "replayed events must not be applied to the cache"
            assert again.processed()["applied"] == 0

            live = {k: {"live": True, "key": k} for k in mine[::3]}
            writer.put_all("orders", live)
            wait_for(lambda: all(orders.get_local(k) == v for k, v in live.items()), 30, "live events in the cache")
            assert sorted(e.key for e in rec.events[rec.live_at:]) == sorted(live)
            assert all(not e.replayed for e in rec.events[rec.live_at:])
            region_now = writer.get_all("orders", mine)
            assert orders.snapshot() == {k: region_now[k]["value"] for k in mine}, "cache equals the region"
            print(f"replayed {len(replayed)} queued events once each; live {len(live)}; stats {again.processed()}")
            # Acknowledged messages leave the queue.
            probe = Consumer({"bootstrap.servers": site_a.bootstrap, "group.id": "probe"})
            try:
                wait_for(lambda: probe.get_watermark_offsets(TopicPartition(again.queue_topic, 0), timeout=5)[0] > 5000,
                         20, "the acknowledged head removed from the queue")
            finally:
                probe.close()
        finally:
            again.close()


def _topic_exists(bootstrap: str, topic: str) -> bool:
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        return topic in probe.list_topics(timeout=10).topics
    finally:
        probe.close()


def test_durable_client_back_after_its_timeout_is_a_new_client_and_an_alert_is_logged(
        site: Any, site_a: Any, tmp_path: Path) -> None:
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs, RegionClient(region.url) as writer:
        first = ClientCache(cfg, "late-1", durable=True, durable_timeout_s=2, region_urls=[region.url])
        first.region("orders").register_interest(ALL_KEYS, durable=True)
        first.ready_for_events()
        wait_for(lambda: first.live, 20, "the marker")
        old_queue = first.queue_topic
        first.close(keep_alive=True)
        writer.put_all("orders", {f"x-{i}": i for i in range(50)})  # queued while away
        wait_for(lambda: "ALERT durable client late-1 timed out" in subs.log_tail(20000), 20, "the timeout alert")
        wait_for(lambda: not _topic_exists(site_a.bootstrap, old_queue), 20, "the queue deleted")

        again = ClientCache(cfg, "late-1", durable=True, region_urls=[region.url])
        try:
            assert not again.replayed_queue and again.queue_topic != old_queue
            rec = Recorder()
            orders = again.region("orders")
            orders.add_listener(rec)
            assert orders.register_interest(ALL_KEYS, durable=True) == 50  # loaded, not replayed
            again.ready_for_events()
            wait_for(lambda: again.live, 20, "the marker")
            holds_for(lambda: rec.events == [], window_s=QUIET_S, what="a new client gets no replay")
            assert rec.events == [] and again.processed()["replayed"] == 0, "a new client gets no replay"
        finally:
            again.close()
    alert = [line for line in subs.log_tail(20000).splitlines() if "ALERT durable client late-1" in line]
    print(alert[0])


def test_non_durable_client_that_crashes_loses_its_queue(site: Any, site_a: Any, tmp_path: Path) -> None:
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs:
        cache = ClientCache(cfg, "gone-1", region_urls=[region.url])
        cache.region("orders").register_interest(ALL_KEYS)
        queue = cache.queue_topic
        cache.abandon()  # no close, no more pings
        wait_for(lambda: "client gone-1 unregistered (no ping" in subs.log_tail(20000), 20, "the unregistration")
        wait_for(lambda: not _topic_exists(site_a.bootstrap, queue), 20, "the queue deleted")


def test_register_interest_rules_against_the_region_service(site: Any, tmp_path: Path) -> None:
    """During a registration's load: an entry the application made valid keeps its value, one it
    destroyed is not revived, an invalid one takes the loaded value; nothing fires listeners."""
    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        writer.put_all("orders", {"r-valid": "server", "r-gone": "server", "r-invalid": "server", "r-plain": "server"})
        cache = ClientCache(cfg, "rules-1", region_urls=[region.url])
        try:
            orders = cache.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            real_load = cache._load

            def load_then_race(region_: Any, reg: Any) -> Any:
                loaded = real_load(region_, reg)
                # The application acts while the load is in flight (its answer already read).
                orders.cache.put("r-valid", "application")
                orders.cache.put("r-invalid", "x")
                orders.cache.invalidate("r-invalid")
                orders.cache.put("r-gone", "x")
                orders.cache.destroy("r-gone")
                return loaded

            cache._load = load_then_race  # type: ignore[method-assign]
            assert orders.register_interest_regex(r"r-.*") == 2
            assert orders.get_local("r-valid") == "application", "a valid local entry survives the load"
            assert not orders.cache.contains_key("r-gone"), "a destroyed entry is not revived"
            assert orders.get_local("r-invalid") == "server", "an invalid entry takes the loaded value"
            assert orders.get_local("r-plain") == "server"
            assert rec.events == [], "the load fires no events"
        finally:
            cache.close()


#: Fill checkpoints far apart in the failover test: none covers what the client received before the kill,
#: so the standby's refill repeats it however the kill and the checkpoints fall on a loaded machine.
FAILOVER_SYNC_INTERVAL_S = 120


def test_kill_9_of_the_primary_subscription_instance_loses_nothing(site_a: Any, unique_prefix: str,
                                                                   tmp_path: Path) -> None:
    """Redundancy 1 (two instances): the primary feeding the client is killed mid-stream; the standby
    takes over from the last checkpoint; the client sees every event once, repeats discarded."""
    from sluice.core.kafka import describe_group_members, make_admin
    from sluice.core.clientregistry import registry_partition

    path = tmp_path / "site-b.yaml"
    cfg = _site(path, site_a.bootstrap, unique_prefix, message_sync_interval_s=FAILOVER_SYNC_INTERVAL_S)
    keys = [f"h-{i:02d}" for i in range(40)]
    region = RegionProcess(path, tmp_path / "region.log")
    try:
        region.wait_ready()
    except BaseException:
        region.stop()
        raise
    one = SubscriptionsProcess(path, tmp_path / "subs-1.log")
    two = SubscriptionsProcess(path, tmp_path / "subs-2.log")
    with region, one, two, RegionClient(region.url) as writer:
        writer.put_all("orders", {k: -1 for k in keys})  # held, so that invalidates reach the listener
        cache = ClientCache(cfg, "ha-1", subscription_redundancy=1, region_urls=[region.url])
        try:
            orders = cache.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            orders.register_interest(keys[:20])
            orders.register_interest(keys[20:], receive_values=False)
            cache.ready_for_events()
            wait_for(lambda: cache.live, 20, "the marker")
            before = {e.event_id for e in history(cfg, site_a.bootstrap)}

            admin = make_admin(cfg.kafka.client_settings())
            wanted = registry_partition("ha-1", cfg.subscriptions.registry_partitions)
            owners = {member: {p for t, p in tps if t == cfg.topics.subscription_registry()}
                      for member, tps in describe_group_members(admin, f"{cfg.kafka.topic_prefix}subscriptions")}
            primary = next(proc for proc in (one, two) if wanted in owners.get(proc.member_id, set()))

            done = threading.Event()
            rounds = [0]

            def write() -> None:
                for round_ in range(60):
                    writer.put_all("orders", {k: round_ for k in keys})
                    rounds[0] += 1
                    time.sleep(WRITE_INTERVAL_S)
                done.set()

            writing = threading.Thread(target=write)
            writing.start()
            wait_for(lambda: rounds[0] >= ROUNDS_BEFORE_KILL, 60, f"{ROUNDS_BEFORE_KILL} write rounds acknowledged")
            # Mid-stream for the client too: it has events of this stream that no checkpoint covers.
            wait_for(lambda: any(e.event_id not in before for e in list(rec.events)), 60,
                     "the client's first event of the stream")
            primary.kill()
            killed_at = time.monotonic()
            writing.join(120)
            assert done.is_set()
            events = [e for e in history(cfg, site_a.bootstrap) if e.event_id not in before]
            assert len(events) == 60 * 40
            want = expected_for(cache, events)
            got: dict[str, list[Any]] = {}

            def received() -> int:
                got.clear()
                with rec.lock:
                    for e in rec.events:
                        got.setdefault(e.key, []).append(e.event_id)
                return sum(map(len, got.values()))

            wait_for(lambda: received() >= len(events), 60,
                     f"every event after the failover ({received()} of {len(events)}; {cache.processed()})")
            gap_s = time.monotonic() - killed_at
            holds_for(lambda: received() == len(events), window_s=QUIET_S,
                      what=f"no event beyond the {len(events)} written arrives after the failover")
            received()
            want_ids = {k: [eid for eid, _ in v] for k, v in want.items()}
            wrong = {k: (len(want_ids.get(k, [])), len(got.get(k, [])),
                         [str(e) for e in got.get(k, []) if e not in want_ids.get(k, [])][:3],
                         [str(e) for e in want_ids.get(k, []) if e not in got.get(k, [])][:3])
                     for k in set(want_ids) | set(got) if got.get(k) != want_ids.get(k)}
            assert not wrong, f"every event once, in order per key; (wanted, got, extra, missing): {wrong}"
            stats = cache.processed()
            print(f"kill -9 of {primary.member_id}: {len(events)} events, each once; repeats discarded "
                  f"{stats['repeats']}; all delivered {gap_s:.1f} s after the kill; stats {stats}")
            assert stats["repeats"] > 0, "the standby refilled from its checkpoint: repeats were expected"
        finally:
            cache.close()


def _old_fill_checkpoints(cfg: SiteConfig, bootstrap: str) -> None:
    """Fill checkpoints at the changelogs' starts for every registry partition: the last ones a
    previous primary wrote before the region's writes, as one taken while it was behind can be."""
    from confluent_kafka import Producer

    codec = get_codec()
    positions = [{"topic": cfg.topics.region_changelog(r.name), "partition": p, "offset": 0}
                 for r in cfg.regions for p in range(r.buckets)]
    producer = Producer({"bootstrap.servers": bootstrap})
    for r in range(cfg.subscriptions.registry_partitions):
        record = {"registry_partition": r, "member": "b-subscriptions-gone", "updated_at": int(time.time() * 1000),
                  "positions": positions, "queues": []}
        producer.produce(cfg.topics.subscription_fill(), codec.encode("FillCheckpoint", record), str(r).encode(),
                         partition=r)
    assert producer.flush(30) == 0


def test_a_new_client_hears_of_nothing_written_before_its_registration_from_a_primary_behind(
        site: Any, site_a: Any, tmp_path: Path) -> None:
    """Events older than a client's registration are in its initial load, never in its queue, even
    when its primary's fill is behind the registration (it starts from an old checkpoint)."""
    from sluice.core.clientregistry import read_latest, registry_partition

    cfg, path, region = site
    keys = [f"p-{i:02d}" for i in range(20)]
    with RegionClient(region.url) as writer:
        writer.put_all("orders", {k: 0 for k in keys})
        _old_fill_checkpoints(cfg, site_a.bootstrap)
        cache = ClientCache(cfg, "late-1", region_urls=[region.url], registration_timeout_s=60)
        try:
            orders = cache.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            answered: list[Any] = []
            registering = threading.Thread(target=lambda: answered.append(orders.register_interest(keys)))
            registering.start()
            partition = registry_partition("late-1", cfg.subscriptions.registry_partitions)

            def recorded() -> bool:
                raw = read_latest(cfg, cfg.topics.subscription_registry(), partition, "late-1")
                return raw is not None and bool(get_codec().decode_as("ClientRegistration", raw)["interest"])

            wait_for(recorded, 20, "the registration in the registry")
            with SubscriptionsProcess(path, tmp_path / "subs.log"):
                registering.join(60)
                assert answered == [len(keys)], f"the registration was answered and loaded: {answered}"
                assert all(orders.get_local(k) == 0 for k in keys)
                cache.ready_for_events()
                wait_for(lambda: cache.live, 20, "the marker")
                writer.put("orders", keys[0], 1)
                wait_for(lambda: orders.get_local(keys[0]) == 1, 20, f"{keys[0]} = 1")
                holds_for(lambda: len(rec.events) == 1, window_s=QUIET_S,
                          what="only the write after the registration reaches the listener")
                with rec.lock:
                    heard = [(e.key, e.new_value, e.replayed) for e in rec.events]
                assert heard == [(keys[0], 1, False)], (
                    f"only the write after the registration reaches the listener, not the {len(keys)} "
                    f"before it: {heard[:5]}{' …' if len(heard) > 5 else ''} ({len(heard)} events)")
        finally:
            cache.close()


class Refuser:
    """A cache writer that refuses destroys of keys starting with 'keep-'."""

    def before_destroy(self, event: Any) -> None:
        if event.key.startswith("keep-"):
            raise ValueError("keep-* entries are never destroyed from this client")


def test_client_writes_pass_the_cache_writer_and_fail_clearly_without_servers(site: Any, tmp_path: Path) -> None:
    """Creates, puts and destroys go through the writer to the region service and into the cache; with no
    server reachable reads come from the cache and writes raise NoServersAvailable, applying nothing."""
    from sluice.core.errors import CacheWriterAbort, NoServersAvailable

    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as reader:
        cache = ClientCache(cfg, "writer-1", region_urls=[region.url], request_retry_s=2)
        try:
            orders = cache.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            orders.set_cache_writer(Refuser())
            orders.register_interest(ALL_KEYS)
            cache.ready_for_events()
            orders.create("keep-1", 1)
            orders.put("drop-1", 2)
            orders.destroy("drop-1")
            with pytest.raises(CacheWriterAbort, match="keep-"):
                orders.destroy("keep-1")
            assert reader.get("orders", "keep-1") == 1 and reader.get_entry("orders", "drop-1") is None
            assert orders.get_local("keep-1") == 1 and not orders.cache.contains_key("drop-1")
            assert [(e.operation.value, e.key) for e in rec.events] == [
                ("CREATE", "keep-1"), ("CREATE", "drop-1"), ("DESTROY", "drop-1")]
            with pytest.raises(RegionError, match="EntryNotFound"):
                orders.destroy("never-held")  # sent although the client does not hold the key
            orders.local_invalidate("keep-1")
            assert orders.get_local("keep-1") is None and reader.get("orders", "keep-1") == 1, "local only"
            orders.put("keep-2", 2)
            region.kill()
            assert orders.get("keep-2") == 2, "reads come from the local cache"
            with pytest.raises(NoServersAvailable, match="was not applied"):
                orders.put("keep-3", 3)
            assert orders.get_local("keep-3") is None
        finally:
            cache.close()


def test_a_client_whose_queue_is_gone_refetches_its_interest_without_events(
        site: Any, site_a: Any, tmp_path: Path) -> None:
    from sluice.core.kafka import make_admin

    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        writer.put_all("orders", {f"g-{i}": i for i in range(20)})
        cache = ClientCache(cfg, "lost-1", region_urls=[region.url])
        try:
            orders = cache.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            orders.register_interest_regex(r"g-\d+")
            cache.ready_for_events()
            wait_for(lambda: cache.live, 20, "the marker")
            old = cache.queue_topic
            admin = make_admin(cfg.kafka.client_settings())
            for fut in admin.delete_topics([old]).values():
                fut.result(15)
            writer.put_all("orders", {f"g-{i}": -i for i in range(20)})  # while the client has no queue
            wait_for(lambda: cache.stats["reinitialized"] == 1 and cache.queue_topic != old, 30, "starting over")
            wait_for(lambda: all(orders.get_local(f"g-{i}") == -i for i in range(20)), 30, "the refetch")
            assert [e for e in rec.events if e.key and e.new_value is not None and e.new_value < 0] == [], \
                "the refetch fires no events"
            writer.put("orders", "g-1", 100)
            wait_for(lambda: orders.get_local("g-1") == 100, 20, "events on the new queue")
        finally:
            cache.close()


@pytest.mark.serial  # a bound in seconds on the fast client: runs alone (make test)
def test_a_slow_client_does_not_slow_the_others(site: Any, tmp_path: Path) -> None:
    cfg, path, region = site

    class Slow(Recorder):
        def _keep(self, event: Any) -> None:
            time.sleep(SLOW_LISTENER_S)  # the slow client: its listener takes this long per event
            super()._keep(event)

        after_create = after_update = _keep

    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        slow = ClientCache(cfg, "slow-1", region_urls=[region.url])
        fast = ClientCache(cfg, "fast-1", region_urls=[region.url])
        try:
            recs = {}
            for cache, rec in ((slow, Slow()), (fast, Recorder())):
                recs[cache.client_id] = rec
                cache.region("orders").add_listener(rec)
                cache.region("orders").register_interest(ALL_KEYS)
                cache.ready_for_events()
            wait_for(lambda: slow.live and fast.live, 20, "the markers")
            started = time.monotonic()
            for round_ in range(10):
                writer.put_all("orders", {f"s-{i}": round_ for i in range(50)})
            wait_for(lambda: len(recs["fast-1"].events) == 500, 30, "the fast client's events")
            fast_s = time.monotonic() - started
            slow_count = len(recs["slow-1"].events)
            print(f"fast client: 500 events in {fast_s:.1f} s; the slow one had {slow_count} by then")
            assert slow_count < 400, "the slow client was not slow: the test proves nothing"
            assert fast_s < 15
        finally:
            slow.close()
            fast.close()


def test_a_region_clear_from_one_client_reaches_the_others_once(site: Any, tmp_path: Path) -> None:
    cfg, path, region = site

    class Clears(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.clears: list[Any] = []

        def after_region_clear(self, event: Any) -> None:
            self.clears.append(event)

    with SubscriptionsProcess(path, tmp_path / "subs.log"), RegionClient(region.url) as writer:
        writer.put_all("orders", {f"z-{i}": i for i in range(30)})
        a = ClientCache(cfg, "clear-a", region_urls=[region.url])
        b = ClientCache(cfg, "clear-b", region_urls=[region.url])
        try:
            recs = {}
            for cache in (a, b):
                recs[cache.client_id] = Clears()
                cache.region("orders").add_listener(recs[cache.client_id])
                cache.region("orders").register_interest_regex(r"z-1\d")   # 10 of the 30 keys
                cache.ready_for_events()
            wait_for(lambda: a.live and b.live, 20, "the markers")
            assert len(b.region("orders")) == 10
            a.region("orders").clear()
            assert len(a.region("orders")) == 0 and len(recs["clear-a"].clears) == 1, "local at once"
            assert writer.keys("orders") == [], "cleared on the server"
            wait_for(lambda: len(b.region("orders")) == 0, 20, "the clear at the other client")
            writer.put("orders", "z-15", "after")
            wait_for(lambda: b.region("orders").get_local("z-15") == "after", 20, "a write after the clear")
            holds_for(lambda: len(recs["clear-b"].clears) == 1, window_s=QUIET_S,
                      what="the clear announced once, though it spans every bucket")
            assert len(recs["clear-b"].clears) == 1, "announced once, though it spans every bucket"
            assert recs["clear-b"].clears[0].key is None and not recs["clear-b"].clears[0].replayed
            assert len(recs["clear-a"].clears) == 1, "a client's own clear is not sent back to it"

            # Region destroy: the other client drops the region (cache and interest), once.
            destroyed: list[Any] = []
            recs["clear-b"].after_region_destroy = destroyed.append  # type: ignore[attr-defined]
            old_b = b.region("orders")
            a.region("orders").destroy_region()
            wait_for(lambda: old_b.destroyed, 20, "the destroy at the other client")
            assert len(destroyed) == 1 and len(old_b) == 0
            assert b._record["interest"] == [], "its interest in the region is gone"
            with pytest.raises(Exception, match="destroyed"):
                old_b.put("z-1", 1)
            fresh = b.region("orders")
            assert fresh is not old_b and len(fresh) == 0
            fresh.register_interest(["z-15"])
            assert fresh.get_local("z-15") is None and writer.keys("orders") == []
        finally:
            a.close()
            b.close()


def test_a_crashed_durable_client_keeps_only_its_durable_interest_while_away(
        site: Any, site_a: Any, tmp_path: Path) -> None:
    """No close, no more pings: after maximum-time-between-pings the client is away; its queue keeps
    filling for its durable interest only; reconnecting replays exactly those events."""
    cfg, path, region = site
    kept, dropped = [f"dk-{i}" for i in range(10)], [f"nd-{i}" for i in range(10)]
    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs, RegionClient(region.url) as writer:
        first = ClientCache(cfg, "crashy-1", durable=True, region_urls=[region.url])
        first.region("orders").register_interest(kept, durable=True)
        first.region("orders").register_interest(dropped)                  # not durable
        first.ready_for_events()
        wait_for(lambda: first.live, 20, "the marker")
        first.abandon()
        wait_for(lambda: "durable client crashy-1 is away" in subs.log_tail(20000), 20, "the crash noticed")
        before = {e.event_id for e in history(cfg, site_a.bootstrap)}
        for round_ in range(5):
            writer.put_all("orders", {k: round_ for k in kept + dropped})
        away = [e for e in history(cfg, site_a.bootstrap) if e.event_id not in before]

        again = ClientCache(cfg, "crashy-1", durable=True, region_urls=[region.url])
        try:
            assert again.replayed_queue
            rec = Recorder()
            orders = again.region("orders")
            orders.add_listener(rec)
            orders.register_interest(kept, durable=True)
            again.ready_for_events()
            wait_for(lambda: again.live, 20, "the marker")
            replayed = rec.events[:rec.live_at]
            assert sorted(str(e.event_id) for e in replayed) == sorted(str(e.event_id) for e in away if e.key in kept)
            assert all(e.replayed and e.key in kept for e in replayed), "non-durable interest was dropped"
        finally:
            again.close()


# --- the fill path of issue 18: transactional changelogs, batched queue writes ------------------


def _changelog_event(key: str, value: int, sequence: int) -> bytes:
    """An update of ``key`` as a changelog record of bucket 0, written by a writer no client is."""
    from sluice.core.events import EventID, Operation, VersionTag

    now = int(time.time() * 1000)
    event = EntryEvent("orders", key, Operation.UPDATE, str(value).encode(), EventID("txn-writer", 1, sequence),
                       VersionTag(2, now, sequence, "txn-writer"), 2, 0, now)
    return get_codec().encode("EntryEvent", event.to_record())


def test_changelog_records_written_in_transactions_reach_clients_once_committed_and_never_aborted(
        site: Any, site_a: Any, tmp_path: Path) -> None:
    """Changelog records in Kafka transactions, as a transactional region writes them: the service reads at
    read_committed, so committed events reach the client and aborted ones never do, and a registration made
    when the changelog ends with a transaction marker is answered at once (the catch-up compares the reader's
    position with the end, which the marker's offset would never let the last record's offset reach)."""
    from confluent_kafka import Producer

    from sluice.subscriptions.service import CATCH_UP_S

    if site_a.is_tansu:
        pytest.skip("needs a broker that keeps aborted records from read_committed readers (Apache Kafka)")
    cfg, path, region = site
    changelog = cfg.topics.region_changelog("orders")
    txn = Producer({"bootstrap.servers": site_a.bootstrap, "transactional.id": f"{cfg.kafka.topic_prefix}txn-writer"})
    txn.init_transactions(30)
    sequence = iter(range(1, 100))

    def transaction(records: list[tuple[str, int]], *, commit: bool) -> None:
        txn.begin_transaction()
        for key, value in records:
            txn.produce(changelog, _changelog_event(key, value, next(sequence)), key.encode(), partition=0)
        assert txn.flush(30) == 0, "the records are on the broker before the transaction ends"
        (txn.commit_transaction if commit else txn.abort_transaction)(30)

    with SubscriptionsProcess(path, tmp_path / "subs.log"):
        transaction([("t-1", 1)], commit=True)
        transaction([("t-2", 2)], commit=False)
        cache = ClientCache(cfg, "txn-1", region_urls=[region.url])
        try:
            orders = cache.region("orders")
            rec = Recorder()
            orders.add_listener(rec)
            started = time.monotonic()
            orders.register_interest(["t-1", "t-2", "t-3"], policy=ResultPolicy.NONE)
            assert time.monotonic() - started < CATCH_UP_S / 2, "answered without waiting out the catch-up bound"
            cache.ready_for_events()
            wait_for(lambda: cache.live, 20, "the marker")
            transaction([("t-1", 10)], commit=True)
            transaction([("t-2", 20), ("t-1", 11)], commit=False)
            transaction([("t-3", 30)], commit=True)
            wait_for(lambda: orders.get_local("t-3") == 30, 20, "the last committed event")
            with rec.lock:
                heard = [(e.key, e.new_value) for e in rec.events]
            assert heard == [("t-1", 10), ("t-3", 30)], "committed events once each, in order; aborted ones never"
        finally:
            cache.close()
            txn.flush(10)


def test_a_queue_deleted_under_the_service_is_noted_gone_and_nothing_is_filled_again(
        site: Any, tmp_path: Path) -> None:
    """Queue writes are batched and only a failed one reaches the service's callback: the writes to a
    queue deleted under the service (here a durable client's, away) are noted as the queue being gone,
    not taken as a failed write that would fill every queue again from the last checkpoint, and the
    service goes on; another client's events keep coming, none of them filled again (possibleDuplicate)."""
    from sluice.core.kafka import make_admin

    cfg, path, region = site
    with SubscriptionsProcess(path, tmp_path / "subs.log") as subs, RegionClient(region.url) as writer:
        away = ClientCache(cfg, "gone-1", durable=True, region_urls=[region.url])
        kept = ClientCache(cfg, "kept-1", region_urls=[region.url])
        try:
            rec = Recorder()
            kept.region("orders").add_listener(rec)
            for cache in (away, kept):
                cache.region("orders").register_interest(ALL_KEYS, durable=True)
                cache.ready_for_events()
            wait_for(lambda: away.live and kept.live, 20, "the markers")
            gone = away.queue_topic
            away.close(keep_alive=True)
            wait_for(lambda: "durable client gone-1 is away" in subs.log_tail(50000), 20, "gone-1 away")
            admin = make_admin(cfg.kafka.client_settings())
            for fut in admin.delete_topics([gone]).values():
                fut.result(15)
            round_ = 0
            while f"queue {gone} is gone" not in subs.log_tail(50000):
                round_ += 1
                writer.put("orders", "d-1", round_)
                wait_for(lambda: kept.region("orders").get_local("d-1") == round_, 20, f"d-1 = {round_} at kept-1")
                assert round_ < 200, f"the service never noted {gone} gone:\n{subs.log_tail(3000)}"
            assert "a queue write failed" not in subs.log_tail(50000)
            writer.put("orders", "d-1", round_ + 1)
            wait_for(lambda: kept.region("orders").get_local("d-1") == round_ + 1, 20, "an event after")
            with rec.lock:
                assert [e.new_value for e in rec.events if e.key == "d-1"] == list(range(1, round_ + 2))
                assert not any(e.possible_duplicate for e in rec.events)
        finally:
            kept.close()
