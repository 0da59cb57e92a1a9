"""The embedded brokers start, keep (or lose) data as documented, and obey signals.

These tests talk to the brokers with confluent_kafka directly: they test the
brokers, not Sluice's client layer.  Timings are printed (``pytest -s``)
because they are the figures KAFKA-NOTES.md asks for.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, IsolationLevel, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from sluice.broker import BrokerProcess, BrokerState, EmbeddedKafka, probe_metadata
from waiting import wait_for

if TYPE_CHECKING:
    from conftest import Site

BrokerFactory = Callable[..., BrokerProcess]


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(timeout=15)


def produce_values(bootstrap: str, topic: str, values: list[str]) -> None:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5}
    )
    for index, value in enumerate(values):
        producer.produce(topic, key=str(index).encode(), value=value.encode())
    assert producer.flush(15) == 0, "records still undelivered after 15 s"


def read_values(bootstrap: str, topic: str, partitions: int, count: int, timeout_s: float = 15.0) -> list[str]:
    """Read ``count`` records from the start of every partition, without a group join."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    values: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < count and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            assert message.error() is None, message.error()
            value = message.value()
            assert value is not None
            values.append(value.decode())
    finally:
        consumer.close()
    return values


@pytest.mark.tansu
def test_round_trip(any_site: Site, unique_prefix: str) -> None:
    """Records produced to a three-partition topic are all read back, on Apache Kafka and on Tansu."""
    topic = any_site.topic_prefix(unique_prefix) + "round-trip"
    create_topic(any_site.bootstrap, topic, partitions=3)
    values = [f"value-{i}" for i in range(100)]
    produce_values(any_site.bootstrap, topic, values)
    assert sorted(read_values(any_site.bootstrap, topic, 3, len(values))) == sorted(values)


@pytest.mark.tansu
@pytest.mark.serial  # a bound in seconds: runs alone (make test)
def test_first_group_assignment_is_fast(any_site: Site, unique_prefix: str) -> None:
    """A new consumer group (session 3 s, heartbeat 0.5 s) gets its partitions quickly."""
    topic = any_site.topic_prefix(unique_prefix) + "group"
    create_topic(any_site.bootstrap, topic, partitions=2)
    consumer = Consumer(
        {
            "bootstrap.servers": any_site.bootstrap,
            "group.id": f"{unique_prefix}group",
            "session.timeout.ms": 3000,
            "heartbeat.interval.ms": 500,
            "max.poll.interval.ms": 10000,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    assigned: list[TopicPartition] = []
    started = time.monotonic()
    consumer.subscribe([topic], on_assign=lambda _consumer, partitions: assigned.extend(partitions))
    try:
        while not assigned and time.monotonic() - started < 30:
            consumer.poll(0.05)
        elapsed_s = time.monotonic() - started
    finally:
        consumer.close()
    print(f"\nfirst group assignment on {any_site.engine} ({any_site.bootstrap}): {elapsed_s:.2f} s")
    assert sorted(tp.partition for tp in assigned) == [0, 1]
    # Apache Kafka with group.initial.rebalance.delay.ms=0 assigns in ~1 s (the first
    # group also creates __consumer_offsets); Tansu took ~2 s with these settings.
    assert elapsed_s < (10.0 if any_site.is_tansu else 5.0)


def test_embedded_kafka_restart_keeps_records(
    broker_factory: BrokerFactory, tmp_path_factory: pytest.TempPathFactory, unique_prefix: str
) -> None:
    """A new EmbeddedKafka on a used data directory serves the topics and records written before."""
    data_dir = tmp_path_factory.mktemp("restart") / "kafka"
    first = broker_factory("r", "kafka", data_dir=data_dir)
    assert isinstance(first, EmbeddedKafka)
    rss_mb = (first.rss_bytes() or 0) / 2**20
    print(f"\nApache Kafka first start (format + start): {first.last_start_s:.2f} s, {rss_mb:.0f} MB resident")
    cluster_id = first.cluster_id
    topic = unique_prefix + "kept"
    create_topic(first.bootstrap, topic, partitions=2)
    values = [f"kept-{i}" for i in range(50)]
    produce_values(first.bootstrap, topic, values)
    first.stop()

    second = broker_factory("r", "kafka", data_dir=data_dir)
    assert isinstance(second, EmbeddedKafka)
    print(f"Apache Kafka restart on formatted storage: {second.last_start_s:.2f} s")
    assert second.cluster_id == cluster_id
    assert sorted(read_values(second.bootstrap, topic, 2, len(values))) == sorted(values)


@pytest.mark.serial  # a bound in seconds: runs alone (make test)
def test_sigterm_stops_embedded_kafka_within_seconds(broker_factory: BrokerFactory, unique_prefix: str) -> None:
    """stop() shuts Apache Kafka down by SIGTERM in a few seconds, without needing SIGKILL."""
    broker = broker_factory("s", "kafka", stop_timeout_s=20.0)
    topic = unique_prefix + "before-stop"
    create_topic(broker.bootstrap, topic)
    produce_values(broker.bootstrap, topic, ["x"])
    started = time.monotonic()
    broker.stop()
    elapsed_s = time.monotonic() - started
    print(f"\nApache Kafka SIGTERM to exit: {elapsed_s:.2f} s (exit status {broker.returncode})")
    assert broker.state is BrokerState.STOPPED
    assert broker.returncode != -9, "the broker had to be SIGKILLed"
    assert elapsed_s < 5.0
    broker.stop()  # Idempotent.


def test_pause_and_resume_embedded_kafka(broker_factory: BrokerFactory, unique_prefix: str) -> None:
    """A paused broker answers nothing and delivers after resume(); a paused broker still stops."""
    broker = broker_factory("p", "kafka", stop_timeout_s=10.0)
    topic = unique_prefix + "paused"
    create_topic(broker.bootstrap, topic)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all", "linger.ms": 0})
    producer.produce(topic, value=b"before")
    assert producer.flush(10) == 0

    broker.pause()
    assert broker.state is BrokerState.PAUSED
    with pytest.raises(OSError):
        probe_metadata("127.0.0.1", broker.port, timeout_s=0.5)
    producer.produce(topic, value=b"while-paused")
    assert producer.flush(1.0) == 1, "a paused broker acknowledged a record"

    broker.resume()
    resumed = time.monotonic()
    assert producer.flush(15) == 0
    print(f"\nrecord delivered {time.monotonic() - resumed:.2f} s after SIGCONT")
    assert read_values(broker.bootstrap, topic, 1, 2) == ["before", "while-paused"]

    broker.pause()
    started = time.monotonic()
    broker.stop()
    assert broker.returncode != -9 and time.monotonic() - started < 5.0


def test_tansu_restart_loses_data(broker_factory: BrokerFactory, unique_prefix: str) -> None:
    """Tansu's memory storage starts empty after a restart, as documented."""
    broker = broker_factory("m", "tansu")
    print(f"\nTansu start: {broker.last_start_s:.3f} s, {(broker.rss_bytes() or 0) / 2**20:.0f} MB resident")
    topic = unique_prefix + "lost"
    create_topic(broker.bootstrap, topic)
    broker.stop()
    broker.start()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    assert topic not in admin.list_topics(timeout=10).topics


def test_container_round_trip(container_site: Site, unique_prefix: str) -> None:
    """The testcontainers apache/kafka broker round-trips records (runs only where Docker answers)."""
    topic = container_site.topic_prefix(unique_prefix) + "container"
    create_topic(container_site.bootstrap, topic)
    produce_values(container_site.bootstrap, topic, ["a", "b"])
    assert read_values(container_site.bootstrap, topic, 1, 2) == ["a", "b"]


@pytest.mark.slow  # a 10 s pause and a kill waited out for its 12 s fence: the long tier (tests/README.md)
def test_a_separate_controller_leaves_no_transaction_open_through_a_pause_and_a_kill(
    broker_factory: BrokerFactory, unique_prefix: str
) -> None:
    """With its controller apart, a broker paused 10 s is not fenced, and a killed one starts again only once
    its controller fenced it: transactions committing all along leave no partition with one open (in one JVM,
    the node fences itself after such a pause, and Kafka 4.4.0 skips the markers of a partition without a
    leader: docs/regions.md, "Hanging transactions")."""
    broker = broker_factory("t", "kafka", separate_controller=True)
    assert isinstance(broker, EmbeddedKafka)
    topic = unique_prefix + "txn"
    create_topic(broker.bootstrap, topic, partitions=4)
    stop = threading.Event()
    commits = [0]

    def commit_in_a_loop() -> None:
        while not stop.is_set():
            producer = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": uuid.uuid4().hex,
                                 "transaction.timeout.ms": 60_000})
            try:
                producer.init_transactions(30)
                while not stop.is_set():
                    producer.begin_transaction()
                    for i in range(16):
                        producer.produce(topic, value=b"v", partition=i % 4)
                    producer.commit_transaction(30)
                    commits[0] += 1
            except KafkaException:
                time.sleep(0.2)  # a new producer, as an application would

    def controller_log_from(offset: int) -> str:
        with open(broker.controller_log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", "replace")

    loop = threading.Thread(target=commit_in_a_loop, daemon=True)
    loop.start()
    def commits_after(count: int, what: str) -> None:
        wait_for(lambda: commits[0] >= count, timeout_s=30, what=what)

    try:
        commits_after(10, "transactions committing")
        before_pause = broker.controller_log_path.stat().st_size
        broker.pause()
        time.sleep(10)  # the fault: the harness's longest pause
        broker.resume()
        commits_after(commits[0] + 20, "transactions committing after the pause")
        assert "Fencing broker 1" not in controller_log_from(before_pause), "a 10 s pause fenced the broker"

        before_kill = broker.controller_log_path.stat().st_size
        controller_pid = broker._controller.pid if broker._controller is not None else None
        broker.kill()
        broker.start()
        assert broker._controller is not None and broker._controller.pid == controller_pid, "the controller restarted"
        assert "because its session has timed out" in controller_log_from(before_kill), \
            "the broker started again before its controller fenced the killed incarnation"
        commits_after(commits[0] + 20, "transactions committing after the broker came back")
    finally:
        stop.set()
        loop.join(40)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    partitions = [TopicPartition(topic, p) for p in range(4)]

    def ends(level: IsolationLevel) -> dict[int, int]:
        answers = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions}, isolation_level=level)
        return {tp.partition: future.result(10).offset for tp, future in answers.items()}

    assert ends(IsolationLevel.READ_COMMITTED) == ends(IsolationLevel.READ_UNCOMMITTED), "a transaction is open"
    assert "Couldn't find leader endpoint" not in broker.log_path.read_text(errors="replace")
    controller = broker._controller
    broker.stop()
    assert controller is not None and controller.poll() is not None, "stop() left the controller running"
