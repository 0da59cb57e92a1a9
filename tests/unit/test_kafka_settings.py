"""The ``kafka`` section and a sender's ``remote`` section reach the Kafka clients the services make.

Each setting is given a value other than its default and followed to where it acts: the librdkafka
configuration handed to ``confluent_kafka.Producer`` / ``Consumer`` (recorded by stand-ins for those
two classes, so no broker is needed), or the admin calls ``topics apply`` and a client's queue make.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from sluice.core import kafka as core_kafka
from sluice.core.config import SiteConfig, load_config, parse_config
from sluice.core.config.models.kafka import REBOOTSTRAP_TRIGGER_MS
from sluice.core.errors import ConfigError
from sluice.core.queueloop import QueuePrimary
from sluice.core.topics import apply_topics, plan_topics
from sluice.core.clientregistry import create_queue

#: Every timing setting of the kafka section, none at its default.
TIMING = {"session_timeout_ms": 7000, "heartbeat_interval_ms": 1500, "max_poll_interval_ms": 45000,
          "producer_linger_ms": 7, "delivery_timeout_ms": 90000, "request_timeout_ms": 25000}


def tls_sasl(folder: Path) -> dict[str, Any]:
    """A SASL_SSL connection with mutual TLS whose passwords come from files beside the site file."""
    for name in ("ca.pem", "client.crt", "client.key"):
        (folder / name).write_text("-----BEGIN-----\n")
    (folder / "sasl.txt").write_text("sasl-secret\n")
    (folder / "key.txt").write_text("key-secret\n")
    return {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "sluice",
            "sasl_password_file": "sasl.txt", "ssl_ca_location": "ca.pem",
            "ssl_certificate_location": "client.crt", "ssl_key_location": "client.key",
            "ssl_key_password_file": "key.txt"}


def site(folder: Path, **kafka: Any) -> dict[str, Any]:
    return {
        "site": "a", "dsid": 1,
        "kafka": {"bootstrap_servers": "k1:9093,k2:9093", "topic_prefix": "a.", **kafka},
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"], "async_event_queues": ["q"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True,
                             "remote": {"bootstrap_servers": "r1:9094", "topic_prefix": "b.", **tls_sasl(folder)}}],
        "async_event_queues": [{"id": "q", "parallel": True, "listener": {"type": "python", "class_path": "x:Y"}}],
    }


def write(folder: Path, data: dict[str, Any]) -> SiteConfig:
    path = folder / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_every_connection_setting_reaches_librdkafka_under_its_kafka_name(tmp_path: Path) -> None:
    """bootstrap, protocol, SASL and TLS settings of the kafka and remote sections become librdkafka's
    bootstrap.servers, security.protocol, sasl.*, ssl.* (paths absolute, passwords read from their files)."""
    cfg = write(tmp_path, site(tmp_path, **tls_sasl(tmp_path)))
    expected = {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "sluice",
        "sasl.password": "sasl-secret", "ssl.ca.location": str(tmp_path / "ca.pem"),
        "ssl.certificate.location": str(tmp_path / "client.crt"), "ssl.key.location": str(tmp_path / "client.key"),
        "ssl.key.password": "key-secret", "metadata.recovery.rebootstrap.trigger.ms": REBOOTSTRAP_TRIGGER_MS,
    }
    assert cfg.kafka.client_settings() == {"bootstrap.servers": "k1:9093,k2:9093", **expected}
    remote = cfg.sender("to-b").remote
    assert remote is not None
    assert remote.client_settings() == {"bootstrap.servers": "r1:9094", **expected}


def test_every_client_re_bootstraps_after_10_s_without_metadata_unless_the_passthrough_says_otherwise(
        tmp_path: Path) -> None:
    """librdkafka forgets a broker a metadata response leaves out (a fenced single-node KRaft broker after a
    pause); with all of them forgotten a group member and a transactional producer wait for the re-bootstrap,
    which Sluice starts after 10 s instead of librdkafka's 300 s.  A site that wants another figure says so."""
    cfg = write(tmp_path, site(tmp_path))
    assert REBOOTSTRAP_TRIGGER_MS == 10_000
    assert cfg.kafka.client_settings()["metadata.recovery.rebootstrap.trigger.ms"] == 10_000
    own = write(tmp_path, site(tmp_path, librdkafka={"metadata.recovery.rebootstrap.trigger.ms": 60_000}))
    assert own.kafka.client_settings()["metadata.recovery.rebootstrap.trigger.ms"] == 60_000


@pytest.mark.parametrize("section", ["kafka", "remote"])
def test_a_key_password_file_is_read_each_time_a_client_is_made(tmp_path: Path, section: str) -> None:
    """ssl_key_password_file (a mounted secret) is read when client settings are made, not when the file
    loads: a rotated password reaches the next client, and a file gone since is named then."""
    cfg = write(tmp_path, site(tmp_path, **tls_sasl(tmp_path)))
    connection = cfg.kafka if section == "kafka" else cfg.sender("to-b").remote
    assert connection is not None
    assert connection.client_settings()["ssl.key.password"] == "key-secret"
    (tmp_path / "key.txt").write_text("rotated-key-secret\n")
    assert connection.client_settings()["ssl.key.password"] == "rotated-key-secret"
    (tmp_path / "key.txt").unlink()
    with pytest.raises(ConfigError) as caught:
        connection.client_settings()
    [(field, path, reason)] = caught.value.problems
    where = "kafka" if section == "kafka" else "remote"
    assert (field, path) == (f"{where}.ssl_key_password_file", str(tmp_path / "key.txt"))
    assert reason.startswith("cannot be read")


@pytest.mark.parametrize("source", ["ssl_key_password", "ssl_key_password_env"])
def test_a_remote_key_password_from_the_site_file_or_a_variable_reaches_librdkafka(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """A sender's remote ssl_key_password, given in the site file or as the name of an environment
    variable (read each time a client is made), is librdkafka's ssl.key.password for the remote cluster."""
    data = site(tmp_path)
    remote = data["gateway_senders"][0]["remote"]
    del remote["ssl_key_password_file"]
    monkeypatch.setenv("REMOTE_KEY_PASSWORD", "from-variable")
    remote[source] = "from-file" if source == "ssl_key_password" else "REMOTE_KEY_PASSWORD"
    connection = write(tmp_path, data).sender("to-b").remote
    assert connection is not None
    expected = "from-file" if source == "ssl_key_password" else "from-variable"
    assert connection.client_settings()["ssl.key.password"] == expected
    monkeypatch.setenv("REMOTE_KEY_PASSWORD", "rotated")
    assert connection.client_settings()["ssl.key.password"] == ("from-file" if source == "ssl_key_password"
                                                                 else "rotated")


class Loop(QueuePrimary):
    kind = "async-event-queue"


def test_group_and_producer_timing_reach_the_clients_a_queue_primary_makes(
        tmp_path: Path, recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """A queue primary's group consumer gets session.timeout.ms, heartbeat.interval.ms and
    max.poll.interval.ms from the file, its producer linger.ms, delivery.timeout.ms and request.timeout.ms;
    both get the connection settings."""
    cfg = write(tmp_path, site(tmp_path, **TIMING))
    loop = Loop(cfg, "q", cfg.queue("q"))
    try:
        loop.start()
    finally:
        loop._pool.shutdown(wait=True)
    [producer] = [conf for kind, conf in recorded if kind == "RecordedProducer"]
    [group] = [conf for kind, conf in recorded if kind == "RecordedConsumer" and conf["group.id"] == loop.group_id]
    assert {k: producer[k] for k in ("linger.ms", "delivery.timeout.ms", "request.timeout.ms")} == \
        {"linger.ms": 7, "delivery.timeout.ms": 90000, "request.timeout.ms": 25000}
    assert {k: group[k] for k in ("session.timeout.ms", "heartbeat.interval.ms", "max.poll.interval.ms")} == \
        {"session.timeout.ms": 7000, "heartbeat.interval.ms": 1500, "max.poll.interval.ms": 45000}
    for conf in (producer, group):
        assert conf["bootstrap.servers"] == "k1:9093,k2:9093" and conf["security.protocol"] == "PLAINTEXT"


def test_a_transactional_producer_takes_the_site_timing_within_its_transaction_timeout(
        tmp_path: Path, recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """The region service's changelog producer gets linger.ms, delivery.timeout.ms and request.timeout.ms
    from the file; librdkafka refuses a delivery timeout above the transaction timeout, so a longer one is
    cut to it (and request.timeout.ms to the socket timeout) while a shorter one is kept."""
    short = write(tmp_path, site(tmp_path, producer_linger_ms=3, delivery_timeout_ms=8000, request_timeout_ms=4000))
    core_kafka.make_transactional_producer(short.kafka.client_settings(), "t-1", 10_000,
                                           **short.kafka.producer_settings())
    long = parse_config(site(tmp_path, **TIMING), base_dir=tmp_path)
    core_kafka.make_transactional_producer(long.kafka.client_settings(), "t-2", 10_000,
                                           **long.kafka.producer_settings())
    (_, kept), (_, cut) = recorded
    assert (kept["linger.ms"], kept["delivery.timeout.ms"], kept["request.timeout.ms"]) == (3, 8000, 4000)
    assert (cut["linger.ms"], cut["delivery.timeout.ms"], cut["request.timeout.ms"]) == (7, 10_000, 9_000)


class Done:
    """A resolved admin future."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class Admin:
    """An AdminClient over an empty cluster that keeps what it was asked to create, and the timeouts."""

    def __init__(self) -> None:
        self.topics: dict[str, Any] = {}
        self.timeouts: list[tuple[str, float | None]] = []

    def list_topics(self, timeout: float | None = None) -> Any:
        self.timeouts.append(("list_topics", timeout))
        listed = {name: SimpleNamespace(error=None, partitions=dict.fromkeys(range(t.num_partitions)))
                  for name, t in self.topics.items()}
        return SimpleNamespace(topics=listed, cluster_id="c")

    def describe_configs(self, resources: list[Any], request_timeout: float | None = None) -> dict[Any, Done]:
        policy = {name: t.config.get("cleanup.policy", "delete") for name, t in self.topics.items()}
        return {r: Done({"cleanup.policy": SimpleNamespace(value=policy[r.name])}) for r in resources}

    def create_topics(self, new_topics: list[Any], operation_timeout: float | None = None,
                      request_timeout: float | None = None) -> dict[str, Done]:
        self.timeouts.append(("create_topics", request_timeout))
        for topic in new_topics:
            self.topics[topic.topic] = topic
        return {topic.topic: Done() for topic in new_topics}


@pytest.mark.parametrize("replication", [3, -1])
def test_topics_and_client_queues_are_created_with_the_replication_factor(tmp_path: Path, replication: int) -> None:
    """Every topic `topics apply` creates, and every client queue, has kafka.replication_factor replicas
    (-1: the broker's default.replication.factor); `topics apply` waits kafka.request_timeout_ms for Kafka."""
    cfg = parse_config(site(tmp_path, replication_factor=replication, request_timeout_ms=4500), base_dir=tmp_path)
    admin = Admin()
    report = apply_topics(cfg, admin=admin)  # type: ignore[arg-type]
    assert report.ok and report.replication_factor == replication
    assert sorted(admin.topics) == sorted(spec.name for spec in plan_topics(cfg))
    assert {t.replication_factor for t in admin.topics.values()} == {replication}
    assert set(admin.timeouts) == {("list_topics", 4.5), ("create_topics", 4.5)}

    queue = cfg.topics.client_queue("c-1", "0123abcd")
    create_queue(admin, cfg, queue, durable=False)
    assert admin.topics[queue].replication_factor == replication
