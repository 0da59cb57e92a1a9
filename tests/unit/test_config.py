"""Site files: Geode's defaults, the example sites, and a precise error for every kind of mistake."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from sluice.core import sitekeys
from sluice.core.config import (
    AsyncEventQueueConfig,
    AttachedQueue,
    GatewaySenderConfig,
    ReceiverConfig,
    RegionConfig,
    SiteConfig,
    SubscriptionsConfig,
    load_config,
    parse_config,
)
from sluice.core.errors import ConfigError, InvalidRequest, UnknownRegion

SITES = Path(__file__).resolve().parents[2] / "deploy" / "sites"


def minimal() -> dict[str, Any]:
    """A small valid site: one region with a parallel sender, a serial sender and an AEQ."""
    return {
        "site": "site-x",
        "dsid": 1,
        "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
        "regions": [
            {"name": "orders", "buckets": 8, "gateway_senders": ["to-b", "serial-b"], "async_event_queues": ["jdbc"]},
            {"name": "customers", "buckets": 8, "gateway_senders": ["to-b"]},
        ],
        "gateway_senders": [
            {"id": "to-b", "remote_dsid": 2, "parallel": True},
            {"id": "serial-b", "remote_dsid": 2},
        ],
        "async_event_queues": [{"id": "jdbc", "listener": {"type": "sql", "settings": {"table": "orders"}}}],
        "receiver": {"accepted_dsids": [2]},
    }


def problems_of(data: dict[str, Any], base_dir: Path | None = None) -> list[tuple[str, Any, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source="test.yaml", base_dir=base_dir)
    return caught.value.problems


def find(problems: list[tuple[str, Any, str]], field: str) -> tuple[str, Any, str]:
    matches = [p for p in problems if p[0] == field]
    assert matches, f"no problem for {field!r} in {problems}"
    return matches[0]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- defaults -----------------------------------------------------------------

GEODE_DEFAULTS = [
    # (section, field, Geode's default)
    ("sender", "parallel", False),
    ("sender", "batch_size", 100),
    ("sender", "batch_time_interval_ms", 1000),
    ("sender", "batch_conflation", False),
    ("sender", "dispatcher_threads", 5),
    ("sender", "order_policy", "KEY"),
    ("sender", "maximum_queue_memory_mb", 100),
    ("sender", "alert_threshold_ms", 0),
    ("sender", "socket_read_timeout_ms", 0),
    ("sender", "manual_start", False),
    ("sender", "group_transaction_events", False),
    ("sender", "retry_interval_ms", 5000),
    ("aeq", "parallel", False),
    ("aeq", "batch_size", 100),
    ("aeq", "batch_time_interval_ms", 5),
    ("aeq", "batch_conflation", False),
    ("aeq", "dispatcher_threads", 5),
    ("aeq", "order_policy", "KEY"),
    ("aeq", "maximum_queue_memory_mb", 100),
    ("aeq", "pause_event_processing", False),
    ("aeq", "forward_expiration_destroy", False),
    ("receiver", "max_time_between_pings_ms", 60000),
    ("receiver", "manual_start", False),
    ("subscriptions", "durable_client_timeout_s", 300),
    ("subscriptions", "message_sync_interval_s", 1),
    ("subscriptions", "message_time_to_live_s", 180),
    ("subscriptions", "subscription_message_tracking_timeout_ms", 900000),
    ("subscriptions", "subscription_ack_interval_ms", 100),
    ("subscriptions", "maximum_message_count", 230000),
    ("region", "buckets", 113),
]


@pytest.mark.parametrize(("section", "field", "expected"), GEODE_DEFAULTS)
def test_defaults_are_geodes(section: str, field: str, expected: Any) -> None:
    """A setting left out of the file takes Apache Geode's default."""
    cfg = parse_config(
        {
            "site": "s",
            "dsid": 1,
            "kafka": {"bootstrap_servers": "k:9092"},
            "regions": [{"name": "r", "gateway_senders": ["g"], "async_event_queues": ["q"]}],
            "gateway_senders": [{"id": "g", "remote_dsid": 2}],
            "async_event_queues": [{"id": "q"}],
            "receiver": {},
        }
    )
    target = {
        "sender": cfg.sender("g"),
        "aeq": cfg.queue("q"),
        "receiver": cfg.receiver,
        "subscriptions": cfg.subscriptions,
        "region": cfg.region("r"),
    }[section]
    assert getattr(target, field) == expected


def test_model_defaults_match_the_file_defaults() -> None:
    """Building a section directly gives the same defaults as leaving it out of a file."""
    assert GatewaySenderConfig(id="g", remote_dsid=2).batch_time_interval_ms == 1000
    assert AsyncEventQueueConfig(id="q").batch_time_interval_ms == 5
    assert ReceiverConfig().inbound_partitions == 8
    assert SubscriptionsConfig().durable_client_timeout_s == 300
    assert RegionConfig(name="r").buckets == 113


def test_kafka_defaults_and_settings() -> None:
    """Kafka defaults suit fast failover, and the librdkafka settings carry them under Kafka's names."""
    cfg = parse_config(minimal())
    assert cfg.kafka.topic_prefix == "sluice."
    assert cfg.kafka.replication_factor == 1
    assert cfg.kafka.client_settings() == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "PLAINTEXT",
                                           "metadata.recovery.rebootstrap.trigger.ms": 10_000}
    assert cfg.kafka.group_settings() == {
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 30000,
    }
    assert cfg.kafka.producer_settings() == {"linger.ms": 0, "delivery.timeout.ms": 120000, "request.timeout.ms": 30000}
    assert cfg.region_service.port == 7070 and cfg.region_service.host == "127.0.0.1"


# --- the example sites ------------------------------------------------------------

EXAMPLES = sorted(p for p in SITES.iterdir() if p.suffix in (".yaml", ".yml", ".toml"))


def test_there_are_example_sites() -> None:
    """The two-site demo's files are where the docs say they are."""
    assert {p.name for p in EXAMPLES} >= {"site-a.yaml", "site-b.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_site_loads(path: Path) -> None:
    """Every file shipped in deploy/sites is valid."""
    cfg = load_config(path)
    assert cfg.regions


def test_example_sites_mirror_each_other() -> None:
    """Site A and site B send to each other and accept each other, as the two-site demo needs."""
    a = load_config(SITES / "site-a.yaml")
    b = load_config(SITES / "site-b.yaml")
    assert (a.dsid, b.dsid) == (1, 2)
    assert a.kafka.bootstrap_servers == "127.0.0.1:9092" and b.kafka.bootstrap_servers == "127.0.0.1:9093"
    assert {s.remote_dsid for s in a.gateway_senders} == {2} and {s.remote_dsid for s in b.gateway_senders} == {1}
    assert a.receiver is not None and a.receiver.accepted_dsids == (2,)
    assert b.receiver is not None and b.receiver.accepted_dsids == (1,)
    assert (a.region_service.port, b.region_service.port) == (7071, 7072)
    for cfg in (a, b):
        assert [(r.name, r.buckets) for r in cfg.regions] == [("orders", 8), ("customers", 8)]
        orders_sender = cfg.attached_queues("orders")[0]
        assert orders_sender.kind == "gateway-sender" and orders_sender.parallel and orders_sender.partitions == 8
        (customers_sender,) = cfg.attached_queues("customers")
        assert not customers_sender.parallel and customers_sender.partitions == 5
    jdbc = a.queue("orders-jdbc")
    assert jdbc.listener is not None and jdbc.listener.type == "sql"
    assert jdbc.listener.settings == {
        "url": "sqlite:///.sluice/site-a/orders.db",
        "table": "orders",
        "key_column": "id",
        "value_column": "doc",
    }
    assert [q.id for q in a.attached_queues("orders")] == ["orders-to-site-b", "orders-jdbc"]
    assert b.async_event_queues == ()


# --- lookups ------------------------------------------------------------------------


def test_attached_queues_lists_senders_then_queues_with_their_partitions() -> None:
    """A region's queues come senders first, then AEQs, in listed order; parallel ones take the region's buckets."""
    cfg = parse_config(minimal())
    assert cfg.attached_queues("orders") == [
        AttachedQueue("to-b", "gateway-sender", True, 8, "KEY", "sluice.queue.to-b"),
        AttachedQueue("serial-b", "gateway-sender", False, 5, "KEY", "sluice.queue.serial-b"),
        AttachedQueue("jdbc", "async-event-queue", False, 5, "KEY", "sluice.queue.jdbc"),
    ]
    assert [q.id for q in cfg.all_attached_queues()] == ["to-b", "serial-b", "jdbc"]
    assert [r.name for r in cfg.regions_of("to-b")] == ["orders", "customers"]
    assert cfg.topics.region_changelog("orders") == "sluice.region.orders.changelog"


def test_unknown_names_raise_typed_errors() -> None:
    """Looking up a region, sender or queue that is not configured raises an InvalidRequest naming it."""
    cfg = parse_config(minimal())
    with pytest.raises(UnknownRegion) as caught:
        cfg.region("nope")
    assert caught.value.value == "nope"
    with pytest.raises(UnknownRegion):
        cfg.attached_queues("nope")
    with pytest.raises(InvalidRequest):
        cfg.sender("jdbc")
    with pytest.raises(InvalidRequest):
        cfg.queue("to-b")


def test_config_is_frozen() -> None:
    """A loaded configuration cannot be changed in place."""
    cfg = parse_config(minimal())
    with pytest.raises(ValidationError):
        cfg.dsid = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.regions[0].buckets = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.regions.append(cfg.regions[0])  # type: ignore[attr-defined]


def test_with_overrides_revalidates() -> None:
    """Overrides (how tests and the demo point a site at their broker) merge deeply and are validated."""
    cfg = parse_config(minimal())
    moved = cfg.with_overrides({"kafka": {"bootstrap_servers": "10.0.0.1:19000", "topic_prefix": "t1."}})
    assert moved.kafka.bootstrap_servers == "10.0.0.1:19000"
    assert moved.kafka.topic_prefix == "t1."
    assert moved.regions == cfg.regions
    with pytest.raises(ConfigError) as caught:
        cfg.with_overrides({"kafka": {"bootstrap_servers": "nohost"}})
    assert caught.value.problems[0][0] == "kafka.bootstrap_servers"


# --- mistakes, each with its field, value and reason --------------------------------


def set_path(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Copy of ``data`` with ``a.b[0].c`` set (or deleted when value is DELETE)."""
    out = copy.deepcopy(data)
    parts: list[str | int] = []
    for piece in path.replace("]", "").split("."):
        name, *indexes = piece.split("[")
        parts.append(name)
        parts.extend(int(i) for i in indexes)
    node: Any = out
    for part in parts[:-1]:
        node = node[part]
    if value is DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return out


DELETE = object()

MISTAKES = [
    # (id, path to set, value, expected field, expected value, words in the reason)
    ("wrong type", "regions[0].buckets", "8", "regions[0].buckets", "8", "whole number"),
    ("bool for int", "regions[0].buckets", True, "regions[0].buckets", True, "whole number"),
    ("string for bool", "gateway_senders[0].parallel", "yes", "gateway_senders[0].parallel", "yes", "true or false"),
    ("out of range low", "gateway_senders[0].batch_size", 0, "gateway_senders[0].batch_size", 0, "must be >= 1"),
    ("out of range high", "dsid", 256, "dsid", 256, "must be <= 255"),
    ("buckets over 1024", "regions[0].buckets", 2000, "regions[0].buckets", 2000, "must be <= 1024"),
    ("bad name", "regions[0].name", "9lives", "regions[0].name", "9lives", "must start with a letter"),
    ("bad site", "site", "Site A", "site", "Site A", "lowercase"),
    ("bad order policy", "gateway_senders[1].order_policy", "FIFO", "gateway_senders[1].order_policy", "FIFO", "'KEY'"),
    ("missing", "gateway_senders[0].remote_dsid", DELETE, "gateway_senders[0].remote_dsid", None, "is required"),
    ("no regions", "regions", [], "regions", [], "at least 1 item"),
    ("bad bootstrap", "kafka.bootstrap_servers", "localhost", "kafka.bootstrap_servers", "localhost", "host:port"),
    ("bad port", "kafka.bootstrap_servers", "a:1,b:99999", "kafka.bootstrap_servers", "a:1,b:99999", "65535"),
    ("replication 0", "kafka.replication_factor", 0, "kafka.replication_factor", 0, "-1 for the broker's default"),
    ("bad prefix", "kafka.topic_prefix", "sluice/", "kafka.topic_prefix", "sluice/", "legal Kafka topic characters"),
    ("heartbeat", "kafka.heartbeat_interval_ms", 6000, "kafka.heartbeat_interval_ms", 6000, "lower than session"),
    ("max poll", "kafka.max_poll_interval_ms", 5000, "kafka.max_poll_interval_ms", 5000, "at least session"),
    ("null section", "receiver", 3, "receiver", 3, "mapping of settings"),
    ("bad filter", "gateway_senders[0].event_filters", ["not a path"], "gateway_senders[0].event_filters", ["not a path"], "import path"),
    ("python listener", "async_event_queues[0].listener", {"type": "python"}, "async_event_queues[0].listener.class_path", None, "required when type is python"),
    ("accepted own dsid", "receiver.accepted_dsids", [1], "receiver.accepted_dsids[0]", 1, "own dsid"),
    ("accepted bad dsid", "receiver.accepted_dsids", [2, 0], "receiver.accepted_dsids[1]", 0, "must be >= 1"),
    ("sender to itself", "gateway_senders[1].remote_dsid", 1, "gateway_senders[1].remote_dsid", 1, "must differ from this site's dsid (1)"),
    ("bad url", "region_service", {"advertised_url": "orders:7070"}, "region_service.advertised_url", "orders:7070", "http://"),
    ("port", "region_service", {"port": 70000}, "region_service.port", 70000, "must be <= 65535"),
]


@pytest.mark.parametrize(
    ("path", "value", "field", "shown", "words"),
    [m[1:] for m in MISTAKES],
    ids=[m[0] for m in MISTAKES],
)
def test_mistake_is_reported_with_field_value_and_reason(path: str, value: Any, field: str, shown: Any, words: str) -> None:
    """Each kind of mistake names the field by its dotted path, shows the value, and says why."""
    problems = problems_of(set_path(minimal(), path, value))
    got_field, got_value, reason = find(problems, field)
    assert got_value == shown
    assert words in reason, reason


def test_error_message_reads_well() -> None:
    """The ConfigError's text is `file: field: reason (got value)` for each problem."""
    with pytest.raises(ConfigError) as caught:
        parse_config(set_path(minimal(), "gateway_senders[0].batch_size", 0), source="site.yaml")
    assert str(caught.value) == "site.yaml: gateway_senders[0].batch_size: must be >= 1 (got 0)"
    assert caught.value.source == "site.yaml"


def test_unknown_key_suggests_the_right_one() -> None:
    """A misspelt key is an error with a did-you-mean, also for Geode's dashed spelling."""
    data = minimal()
    data["gateway_senders"][0]["batch_sise"] = 10
    data["gateway_senders"][1]["batch-time-interval-ms"] = 10
    data["recevier"] = {}
    data["kafka"]["zzz"] = 1
    problems = problems_of(data)
    assert find(problems, "gateway_senders[0].batch_sise") == (
        "gateway_senders[0].batch_sise",
        10,
        "unknown key; did you mean 'batch_size'?",
    )
    assert "did you mean 'batch_time_interval_ms'?" in find(problems, "gateway_senders[1].batch-time-interval-ms")[2]
    assert "did you mean 'receiver'?" in find(problems, "recevier")[2]
    assert "known keys:" in find(problems, "kafka.zzz")[2]


def test_duplicate_ids_share_one_namespace() -> None:
    """Sender and AEQ ids must be unique together (each names a topic), as must region names."""
    data = minimal()
    data["async_event_queues"][0]["id"] = "to-b"
    data["regions"][1]["name"] = "orders"
    data["regions"][0]["async_event_queues"] = ["to-b"]
    problems = problems_of(data)
    field, value, reason = find(problems, "async_event_queues[0].id")
    assert value == "to-b" and "duplicate id" in reason and "gateway_senders[0]" in reason
    assert "duplicate region name" in find(problems, "regions[1].name")[2]


def test_unknown_sender_reference() -> None:
    """A region naming a sender that does not exist gets a did-you-mean; a queue in the wrong list is pointed out."""
    data = minimal()
    data["regions"][0]["gateway_senders"] = ["to-c", "jdbc"]
    data["regions"][1]["async_event_queues"] = ["zzzzzz"]
    problems = problems_of(data)
    assert find(problems, "regions[0].gateway_senders[0]") == (
        "regions[0].gateway_senders[0]",
        "to-c",
        "no gateway sender has this id; did you mean 'to-b'?",
    )
    assert "list it under async_event_queues" in find(problems, "regions[0].gateway_senders[1]")[2]
    assert "configured: jdbc" in find(problems, "regions[1].async_event_queues[0]")[2]


def test_thread_order_policy_on_a_parallel_sender() -> None:
    """THREAD is rejected on a parallel sender and a parallel AEQ, as Geode does; it is fine on a serial one."""
    data = minimal()
    data["gateway_senders"][0]["order_policy"] = "THREAD"
    data["gateway_senders"][1]["order_policy"] = "THREAD"
    data["async_event_queues"][0].update(parallel=True, order_policy="THREAD")
    problems = problems_of(data)
    field, value, reason = find(problems, "gateway_senders[0].order_policy")
    assert value == "THREAD" and "parallel gateway sender" in reason and "KEY or PARTITION" in reason
    assert "parallel async event queue" in find(problems, "async_event_queues[0].order_policy")[2]
    assert not [p for p in problems if p[0].startswith("gateway_senders[1]")]


def test_conflation_with_group_transaction_events() -> None:
    """batch_conflation and group_transaction_events together are rejected, as Geode does."""
    data = minimal()
    data["gateway_senders"][0].update(batch_conflation=True, group_transaction_events=True)
    field, value, reason = find(problems_of(data), "gateway_senders[0].group_transaction_events")
    assert "batch_conflation" in reason


def test_group_transaction_events_needs_one_dispatcher_when_serial() -> None:
    """A serial sender grouping transactions needs one dispatcher thread (GEODE-7971)."""
    data = minimal()
    data["gateway_senders"][1]["group_transaction_events"] = True
    reason = find(problems_of(data), "gateway_senders[1].group_transaction_events")[2]
    assert "dispatcher_threads 1" in reason
    data["gateway_senders"][1]["dispatcher_threads"] = 1
    assert parse_config(data).sender("serial-b").group_transaction_events


def test_sasl_without_username() -> None:
    """SASL_SSL without a username (or mechanism, or password) names each missing field."""
    data = minimal()
    data["kafka"].update(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_password="hunter2")
    problems = problems_of(data)
    assert find(problems, "kafka.sasl_username") == (
        "kafka.sasl_username",
        None,
        "is required when security_protocol is SASL_SSL",
    )
    assert [p[0] for p in problems] == ["kafka.sasl_username"]


def test_secrets_are_never_shown() -> None:
    """Passwords and tokens appear in client settings only, never in errors or reprs."""
    data = minimal()
    data["kafka"].update(security_protocol="PLAINTEXT", sasl_password="hunter2")
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert "hunter2" not in str(caught.value)
    assert find(caught.value.problems, "kafka.sasl_password")[1] == "**********"

    data["kafka"].update(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="hunter2"
    )
    data["region_service"] = {"token": "s3cret", "member_token": "member-s3cret-0123456789"}
    cfg = parse_config(data)
    assert "hunter2" not in repr(cfg) and "s3cret" not in repr(cfg)
    assert cfg.kafka.client_settings()["sasl.password"] == "hunter2"
    assert cfg.kafka.client_settings()["sasl.mechanism"] == "PLAIN"


def test_passwords_can_come_from_files_that_are_read_when_a_client_is_made(tmp_path: Path) -> None:
    """sasl_password_file (a mounted secret) instead of sasl_password: beside the site file, read when
    client settings are made (a rotated secret is picked up), never shown; both at once, or a missing file,
    is named."""
    secret = tmp_path / "password"
    secret.write_text("hunter2\n")
    data = minimal()
    data["kafka"].update(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                         sasl_password_file="password")
    cfg = parse_config(data, base_dir=tmp_path)
    assert cfg.kafka.sasl_password_file == str(secret)
    assert cfg.kafka.client_settings()["sasl.password"] == "hunter2"
    secret.write_text("rotated")
    assert cfg.kafka.client_settings()["sasl.password"] == "rotated"
    assert "rotated" not in repr(cfg)

    data["kafka"]["sasl_password"] = "other"
    assert find(problems_of(data, base_dir=tmp_path), "kafka.sasl_password_file")[2] == \
        "give sasl_password or sasl_password_file, not both"
    del data["kafka"]["sasl_password"], data["kafka"]["sasl_password_file"]
    assert "sasl_password_file" in find(problems_of(data, base_dir=tmp_path), "kafka.sasl_password")[2]
    data["kafka"]["sasl_password_file"] = "absent"
    assert find(problems_of(data, base_dir=tmp_path), "kafka.sasl_password_file")[2].startswith("no such file:")


def test_security_settings_must_fit_the_protocol() -> None:
    """TLS files must exist, are found next to the site file, and are refused with a protocol that ignores them."""
    data = minimal()
    data["kafka"]["ssl_ca_location"] = "ca.pem"
    reasons = [reason for field, _, reason in problems_of(data) if field == "kafka.ssl_ca_location"]
    assert any(r.startswith("no such file:") for r in reasons)
    assert any("only used with SSL or SASL_SSL" in r for r in reasons)


def test_tls_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    """A relative ssl_ca_location is looked up beside the site file and handed to librdkafka absolute."""
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    path = write(
        tmp_path,
        "site.yaml",
        """\
        site: s
        dsid: 1
        kafka:
          bootstrap_servers: "broker:9093"
          security_protocol: SSL
          ssl_ca_location: certs/ca.pem
        regions: [{name: r}]
        """,
    )
    cfg = load_config(path)
    assert cfg.kafka.client_settings()["ssl.ca.location"] == str(tmp_path / "certs" / "ca.pem")

    path.write_text(path.read_text().replace("certs/ca.pem", "certs/missing.pem"))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    field, value, reason = caught.value.problems[0]
    assert field == "kafka.ssl_ca_location" and "no such file" in reason


def test_parallel_queue_needs_colocated_regions() -> None:
    """A parallel sender attached to regions with different bucket counts is rejected (Geode's colocation)."""
    data = minimal()
    data["regions"][1]["buckets"] = 16
    field, value, reason = find(problems_of(data), "regions[1].buckets")
    assert value == 16 and "'to-b'" in reason and "same buckets" in reason


def test_colliding_topic_names() -> None:
    """An id whose topics collide with another's once '.' equals '_' (Kafka refuses those) is rejected."""
    data = minimal()
    data["async_event_queues"].append({"id": "to-b_dlq"})
    reason = find(problems_of(data), "async_event_queues[1].id")[2]
    assert "collides" in reason and "sluice.queue.to-b.dlq" in reason


def test_every_problem_is_reported_at_once() -> None:
    """A file with mistakes in several sections reports all of them in one error."""
    data = minimal()
    data["dsid"] = 0
    data["regions"][0]["buckets"] = "eight"
    data["gateway_senders"][0].update(order_policy="THREAD", batch_size=0)
    data["regions"][1]["gateway_senders"] = ["nope"]
    data["kafka"]["security_protocol"] = "SASL_SSL"
    fields = {p[0] for p in problems_of(data)}
    assert {
        "dsid",
        "regions[0].buckets",
        "gateway_senders[0].batch_size",
        "gateway_senders[0].order_policy",
        "regions[1].gateway_senders[0]",
        "kafka.sasl_mechanism",
    } <= fields


def test_not_a_mapping() -> None:
    """An empty file or a top-level list is refused with one clear problem."""
    assert problems_of(None) == [("", None, "must be a mapping of settings (site:, dsid:, …), not an empty file")]  # type: ignore[arg-type]
    assert "not a list" in problems_of([1, 2])[0][2]  # type: ignore[arg-type]


# --- files ---------------------------------------------------------------------------


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    """A YAML syntax error is one problem giving the line, column and the offending text."""
    path = write(
        tmp_path,
        "bad.yaml",
        """\
        site: s
        dsid: 1
        kafka:
          bootstrap_servers: "k:9092
        regions: []
        """,
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    field, value, reason = problem
    assert field.startswith("line ")
    assert reason.startswith("YAML syntax error")
    assert caught.value.source == str(path)

    path.write_text("site: s\ndsid: 1\n  bad: indent\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems[0][0] == "line 3, column 6"


def test_duplicate_yaml_key_is_reported(tmp_path: Path) -> None:
    """A key written twice in YAML is reported with its line instead of the last one silently winning."""
    path = write(
        tmp_path,
        "dup.yaml",
        """\
        site: s
        dsid: 1
        dsid: 2
        kafka: {bootstrap_servers: "k:9092"}
        regions: [{name: r}]
        """,
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [("line 3", "dsid", "duplicate key (first on line 2); a key may appear once")]


def test_toml_site_equals_yaml_site(tmp_path: Path) -> None:
    """The same site written in TOML loads to an equal configuration."""
    toml = write(
        tmp_path,
        "site.toml",
        """\
        site = "site-x"
        dsid = 1

        [kafka]
        bootstrap_servers = "127.0.0.1:9092"

        [[regions]]
        name = "orders"
        buckets = 8
        gateway_senders = ["to-b", "serial-b"]
        async_event_queues = ["jdbc"]

        [[regions]]
        name = "customers"
        buckets = 8
        gateway_senders = ["to-b"]

        [[gateway_senders]]
        id = "to-b"
        remote_dsid = 2
        parallel = true

        [[gateway_senders]]
        id = "serial-b"
        remote_dsid = 2

        [[async_event_queues]]
        id = "jdbc"
        listener = { type = "sql", settings = { table = "orders" } }

        [receiver]
        accepted_dsids = [2]
        """,
    )
    assert load_config(toml) == parse_config(minimal())


def test_toml_errors_name_the_line(tmp_path: Path) -> None:
    """TOML syntax errors give the line; TOML type errors give the field like YAML ones."""
    path = write(tmp_path, "bad.toml", 'site = "s"\ndsid = \n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    field, value, reason = caught.value.problems[0]
    assert field.startswith("line 2") and reason.startswith("TOML syntax error")

    path.write_text('site = "s"\ndsid = "1"\n[kafka]\nbootstrap_servers = "k:1"\n[[regions]]\nname = "r"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [("dsid", "1", "must be a whole number (without quotes)")]


def test_file_type_and_missing_file(tmp_path: Path) -> None:
    """Only .yaml, .yml and .toml are read; a missing file is a ConfigError, not an OSError."""
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "site.json")
    assert "unknown file type" in caught.value.problems[0][2]
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "absent.yaml")
    assert caught.value.problems[0][2] == "no such file"


def test_site_config_validates_when_built_directly() -> None:
    """Building SiteConfig in code applies the same cross-section rules as loading a file."""
    with pytest.raises(ValidationError):
        SiteConfig.model_validate(set_path(minimal(), "gateway_senders[1].remote_dsid", 1))


def test_a_signing_site_needs_every_peer_key_and_errors_never_show_its_private_key() -> None:
    """A site with a private key verifies every site it exchanges events with: each accepted dsid and each
    sender's remote dsid needs a public key; a malformed key is named, never shown."""
    private, _ = sitekeys.generate()
    _, public_1 = sitekeys.generate()
    _, public_3 = sitekeys.generate()
    base = f"site: b\ndsid: 2\nkafka: {{bootstrap_servers: 'x:1'}}\nregions: [{{name: orders}}]\n" \
           f"gateway_private_key: '{private}'\n"
    ok = parse_config(yaml.safe_load(base + f"receiver: {{accepted_dsids: [1, 3]}}\n"
                                            f"gateway_public_keys: {{1: '{public_1}', 3: '{public_3}'}}\n"))
    assert ok.gateway_public_keys[1] == public_1
    for more, needle in (
        (f"receiver: {{accepted_dsids: [1, 3]}}\ngateway_public_keys: {{1: '{public_1}'}}\n",
         "no key for accepted dsid(s) [3]"),
        (f"gateway_public_keys: {{2: '{public_1}'}}\n", "this site's own dsid"),
        ("gateway_public_keys: {1: 'short'}\n", "not an Ed25519 public key"),
    ):
        with pytest.raises(ConfigError) as err:
            parse_config(yaml.safe_load(base + more))
        assert needle in str(err.value) and private not in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_load(base.replace(private, "tiny-private-key")))
    assert "gateway_private_key" in str(err.value) and "tiny" not in str(err.value)
