"""Every Kafka login a site file can give reaches librdkafka as it should, and nothing else does.

OAUTHBEARER (OIDC client credentials, or the unsecured JWT for development), GSSAPI and the
``librdkafka:`` passthrough are followed from the site file to the configuration each kind of client
is made with: the producers, transactional producers, consumers and admin clients of every
connection (the site's ``kafka:``, a gateway sender's ``remote:``, a Kafka forwarder's other
cluster), recorded by stand-ins for confluent_kafka's classes; then the same configurations are
handed to the real classes, so librdkafka itself accepts every name and value.  The passthrough's
checks are followed to the errors `sluice config check` prints, with secrets never shown.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from pydantic import SecretStr

from recorded_clients import Recorded

from sluice.core import kafka as core_kafka
from sluice.core.config import load_config, parse_config
from sluice.core.config.librdkafka import OWNED, SECRET_PROPERTIES
from sluice.core.config.models import kafka as kafka_models
from sluice.core.configcli import main as config_main
from sluice.core.errors import ConfigError
from sluice.core.librdkafka_properties import PROPERTIES
from sluice.listeners.kafka_forwarder import parse_settings

SERVICES = Path(__file__).resolve().parents[2] / "services"

#: The OAuth client secret, which must appear in no output.
CLIENT_SECRET = "oidc-client-secret-7f3a"

OIDC_EXPECTED = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "OAUTHBEARER",
    "sasl.oauthbearer.method": "oidc",
    "sasl.oauthbearer.client.id": "sluice-london",
    "sasl.oauthbearer.client.secret": CLIENT_SECRET,
    "sasl.oauthbearer.token.endpoint.url": "http://127.0.0.1:1/oauth2/token",
    "sasl.oauthbearer.scope": "kafka",
    "sasl.oauthbearer.extensions": "logicalCluster=lkc-abc123,identityPoolId=pool-XyZ",
}


def oidc(folder: Path) -> dict[str, Any]:
    """An OAUTHBEARER/OIDC login whose client secret is a mounted file beside the site file."""
    (folder / "client-secret").write_text(CLIENT_SECRET + "\n")
    return {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_oauthbearer_method": "oidc",
        "sasl_oauthbearer_client_id": "sluice-london", "sasl_oauthbearer_client_secret_file": "client-secret",
        "sasl_oauthbearer_token_endpoint_url": "http://127.0.0.1:1/oauth2/token",
        "sasl_oauthbearer_scope": "kafka",
        "sasl_oauthbearer_extensions": {"logicalCluster": "lkc-abc123", "identityPoolId": "pool-XyZ"},
        # One property of each scope: any client, producers only, consumers only.
        "librdkafka": {"ssl.endpoint.identification.algorithm": "https", "compression.type": "zstd",
                       "fetch.max.bytes": 10_485_760, "client.rack": "use1-az1"},
    }


def site(folder: Path, kafka: dict[str, Any], remote: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "site": "london", "dsid": 1,
        "kafka": {"bootstrap_servers": "k1:9093", "topic_prefix": "a.", **kafka},
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"], "async_event_queues": ["q"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True,
                             "remote": {"bootstrap_servers": "r1:9094", "topic_prefix": "b.", **(remote or kafka)}}],
        "async_event_queues": [{"id": "q", "parallel": True, "listener": {"type": "python", "class_path": "x:Y"}}],
    }


def write(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def problems_of(data: dict[str, Any], folder: Path) -> list[tuple[str, Any, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source="site.yaml", base_dir=folder)
    return caught.value.problems


def reason(problems: list[tuple[str, Any, str]], field: str) -> str:
    matches = [p for p in problems if p[0] == field]
    assert matches, f"no problem for {field!r} in {problems}"
    return matches[0][2]


def every_client(base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The configuration of each kind of client the services make from one connection's settings."""
    made: list[tuple[str, dict[str, Any]]] = Recorded.made
    start = len(made)
    core_kafka.make_producer(base)
    core_kafka.make_transactional_producer(base, "london.region.orders.0", 10_000)
    core_kafka.make_consumer(base, "sluice.london.queue.q")
    core_kafka.make_consumer(base, None, **{"fetch.wait.max.ms": 10})
    core_kafka.make_admin(base)
    names = ("producer", "transactional producer", "group consumer", "reader", "admin")
    return {name: conf for name, (_, conf) in zip(names, made[start:], strict=True)}


def connections(folder: Path, kafka: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each connection a site file gives, as the services read it: kafka:, a sender's remote:, a
    forwarder's other cluster (whose settings sit in its listener's settings:)."""
    cfg = load_config(write(folder, site(folder, kafka)))
    remote = cfg.sender("to-b").remote
    assert remote is not None
    forwarder = parse_settings({"topic": "orders-out", "bootstrap_servers": "f1:9095", **kafka}, site_dir=folder)
    assert forwarder.cluster is not None
    return {"kafka": cfg.kafka.client_settings(), "remote": remote.client_settings(),
            "forwarder": forwarder.cluster.client_settings()}


def test_oidc_reaches_every_client_of_every_connection(tmp_path: Path,
                                                      recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """OAUTHBEARER with OIDC becomes librdkafka's sasl.oauthbearer.* settings (the client secret read from
    its file, the extensions joined as name=value,…) on the producers, transactional producers, consumers
    and admin clients of the kafka:, remote: and forwarder connections; the passthrough's producer-only
    property reaches producers only, its consumer-only one consumers only, an any-client one every client."""
    for where, base in connections(tmp_path, oidc(tmp_path)).items():
        for kind, conf in every_client(base).items():
            extensions = set(conf.pop("sasl.oauthbearer.extensions").split(","))
            assert extensions == {"logicalCluster=lkc-abc123", "identityPoolId=pool-XyZ"}, (where, kind)
            assert {k: conf.get(k) for k in OIDC_EXPECTED if k != "sasl.oauthbearer.extensions"} == \
                {k: v for k, v in OIDC_EXPECTED.items() if k != "sasl.oauthbearer.extensions"}, (where, kind)
            assert conf["ssl.endpoint.identification.algorithm"] == "https", (where, kind)
            assert conf["client.rack"] == "use1-az1", (where, kind)
            assert ("compression.type" in conf) == ("producer" in kind), (where, kind)
            assert ("fetch.max.bytes" in conf) == (kind in ("group consumer", "reader")), (where, kind)
            if "producer" in kind:
                assert conf["compression.type"] == "zstd"
            # What Sluice's guarantees rest on is still Sluice's.
            if kind == "group consumer":
                assert conf["isolation.level"] == "read_committed" and conf["enable.auto.commit"] is False
            if "producer" in kind:
                assert conf["enable.idempotence"] is True and conf["acks"] == "all"


def test_librdkafka_itself_accepts_the_oidc_configuration_of_every_client(tmp_path: Path) -> None:
    """The configurations above, given to confluent_kafka's real Producer, Consumer and AdminClient: each is
    made (librdkafka refuses an unknown name or bad value at once), with no broker or token endpoint up."""
    made: list[tuple[str, dict[str, Any]]] = []
    original = core_kafka.Producer, core_kafka.Consumer, core_kafka.AdminClient

    def keep(cls: Any) -> Any:
        def make(conf: dict[str, Any]) -> Any:
            quiet = {**conf, "log_level": 0}
            made.append((cls.__name__, quiet))
            return cls(quiet)
        return make

    base = connections(tmp_path, oidc(tmp_path))["kafka"]
    core_kafka.Producer, core_kafka.Consumer, core_kafka.AdminClient = keep(Producer), keep(Consumer), keep(AdminClient)
    try:
        clients = [core_kafka.make_producer(base), core_kafka.make_consumer(base, "g"), core_kafka.make_admin(base),
                   core_kafka.make_transactional_producer(base, "t", 10_000)]
    finally:
        core_kafka.Producer, core_kafka.Consumer, core_kafka.AdminClient = original
    assert [kind for kind, _ in made] == ["Producer", "Consumer", "AdminClient", "Producer"]
    assert all(conf["sasl.oauthbearer.method"] == "oidc" for _, conf in made)
    clients[1].close()


def test_config_check_accepts_oidc_and_shows_where_the_secret_comes_from_never_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`sluice config check` on a site whose kafka: logs in with OIDC (secret in a file) and whose remote:
    takes its client secret from an environment variable: valid (exit 0), each secret's source named, the
    secret itself nowhere in the output."""
    monkeypatch.setenv("REMOTE_OIDC_SECRET", CLIENT_SECRET)
    monkeypatch.setenv("COLUMNS", "400")  # one line per secret, however long its path
    remote = {**oidc(tmp_path), "sasl_oauthbearer_client_secret_env": "REMOTE_OIDC_SECRET"}
    del remote["sasl_oauthbearer_client_secret_file"]
    path = write(tmp_path, site(tmp_path, oidc(tmp_path), remote))
    assert config_main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and CLIENT_SECRET not in out
    assert f"secret kafka.sasl_oauthbearer_client_secret: from file {tmp_path / 'client-secret'}" in out
    assert "secret gateway_senders[0].remote.sasl_oauthbearer_client_secret: from environment variable " \
           "REMOTE_OIDC_SECRET" in out
    cfg = load_config(path)
    assert CLIENT_SECRET not in repr(cfg) and CLIENT_SECRET not in str(cfg.kafka.model_dump())


def test_config_check_names_each_missing_oidc_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OAUTHBEARER (oidc by default) without client id, secret and token endpoint: `sluice config check`
    exits 1 naming the three."""
    path = write(tmp_path, site(tmp_path, {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}))
    assert config_main(["config", "check", str(path)]) == 1
    out = capsys.readouterr().out
    for name in ("sasl_oauthbearer_client_id", "sasl_oauthbearer_client_secret",
                 "sasl_oauthbearer_token_endpoint_url"):
        assert f"kafka.{name}" in out


def test_unsecured_jwt_becomes_librdkafkas_builtin_unsecured_token(tmp_path: Path) -> None:
    """sasl_oauthbearer_method unsecured_jwt sets librdkafka's default method with its unsecured JWT handler
    and the claims given; without principal=… it is refused."""
    login = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "OAUTHBEARER",
             "sasl_oauthbearer_method": "unsecured_jwt", "sasl_oauthbearer_config": "principal=alice lifeSeconds=600"}
    settings = parse_config(site(tmp_path, login), base_dir=tmp_path).kafka.client_settings()
    assert {k: v for k, v in settings.items() if k.startswith(("sasl", "enable.sasl"))} == {
        "sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "default",
        "enable.sasl.oauthbearer.unsecure.jwt": True, "sasl.oauthbearer.config": "principal=alice lifeSeconds=600"}
    problems = problems_of(site(tmp_path, {**login, "sasl_oauthbearer_config": "scope=x"}), tmp_path)
    assert "principal=<name>" in reason(problems, "kafka.sasl_oauthbearer_config")


@pytest.mark.parametrize(("extra", "field", "expected"), [
    ({"sasl_username": "u"}, "sasl_username", "is not used with sasl_mechanism OAUTHBEARER"),
    ({"sasl_kerberos_principal": "p"}, "sasl_kerberos_principal", "is not used with sasl_mechanism OAUTHBEARER"),
    ({"sasl_oauthbearer_config": "principal=a"}, "sasl_oauthbearer_config", "sasl_oauthbearer_method oidc"),
    ({"sasl_oauthbearer_client_secret": "inline"}, "sasl_oauthbearer_client_secret_file", "not both"),
    ({"sasl_oauthbearer_token_endpoint_url": "idp.example.com/token"}, "sasl_oauthbearer_token_endpoint_url",
     "http:// or https:// URL"),
    ({"sasl_oauthbearer_extensions": {"auth": "x"}}, "sasl_oauthbearer_extensions", "not 'auth'"),
    ({"sasl_oauthbearer_extensions": {"pool": "a,b"}}, "sasl_oauthbearer_extensions", "without ','"),
    ({"sasl_oauthbearer_method": "device_code"}, "sasl_oauthbearer_method", "oidc"),
])
def test_an_oidc_login_with_a_wrong_setting_is_refused(tmp_path: Path, extra: dict[str, Any], field: str,
                                                       expected: str) -> None:
    """Each setting that would do nothing, or that librdkafka would misread, is named with why."""
    problems = problems_of(site(tmp_path, {**oidc(tmp_path), **extra}), tmp_path)
    assert expected in reason(problems, f"kafka.{field}")
    assert all(p[1] != "inline" for p in problems)


def test_oauthbearer_settings_without_the_mechanism_are_refused(tmp_path: Path) -> None:
    """OIDC settings on a SCRAM login, or on a connection without SASL, would do nothing: refused."""
    scram = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u",
             "sasl_password": "p", "sasl_oauthbearer_client_id": "c"}
    assert "is not used with sasl_mechanism SCRAM-SHA-512" in reason(
        problems_of(site(tmp_path, scram), tmp_path), "kafka.sasl_oauthbearer_client_id")
    plain = {"sasl_oauthbearer_client_id": "c"}
    assert "is only used with SASL_PLAINTEXT or SASL_SSL" in reason(
        problems_of(site(tmp_path, plain), tmp_path), "kafka.sasl_oauthbearer_client_id")


def test_gssapi_settings_reach_librdkafka(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GSSAPI becomes sasl.kerberos.* (the service name kafka unless given, the keytab absolute); the
    principal is required, and the keytab unless a kinit command says how the ticket is got."""
    monkeypatch.setattr(kafka_models, "sasl_mechanism_problem", lambda mechanism: None)
    (tmp_path / "sluice.keytab").write_bytes(b"\x05\x02")
    login = {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI",
             "sasl_kerberos_principal": "sluice/london@EXAMPLE.COM", "sasl_kerberos_keytab": "sluice.keytab"}
    settings = parse_config(site(tmp_path, login), base_dir=tmp_path).kafka.client_settings()
    assert {k: v for k, v in settings.items() if k.startswith("sasl")} == {
        "sasl.mechanism": "GSSAPI", "sasl.kerberos.service.name": "kafka",
        "sasl.kerberos.principal": "sluice/london@EXAMPLE.COM", "sasl.kerberos.keytab": str(tmp_path / "sluice.keytab")}
    cached = {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_kerberos_principal": "p@R",
              "sasl_kerberos_service_name": "kafka-prod", "sasl_kerberos_kinit_cmd": ""}
    settings = parse_config(site(tmp_path, cached), base_dir=tmp_path).kafka.client_settings()
    assert (settings["sasl.kerberos.service.name"], settings["sasl.kerberos.kinit.cmd"]) == ("kafka-prod", "")
    problems = problems_of(site(tmp_path, {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI"}), tmp_path)
    assert "is required" in reason(problems, "kafka.sasl_kerberos_principal")
    assert "unless sasl_kerberos_kinit_cmd" in reason(problems, "kafka.sasl_kerberos_keytab")


def test_a_mechanism_the_installed_librdkafka_cannot_use_is_refused_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mechanism librdkafka has no provider for (GSSAPI in confluent-kafka's wheels, which carry no
    Kerberos library) is refused when the file is checked, with librdkafka's own words, not when a service
    first makes a client."""
    login = {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_kerberos_principal": "p@R",
             "sasl_kerberos_kinit_cmd": ""}
    real = core_kafka.sasl_mechanism_problem("GSSAPI")
    if real is not None:
        assert "GSSAPI" in reason(problems_of(site(tmp_path, login), tmp_path), "kafka.sasl_mechanism")
    monkeypatch.setattr(kafka_models, "sasl_mechanism_problem", lambda mechanism: "No provider for SASL mechanism")
    text = reason(problems_of(site(tmp_path, login), tmp_path), "kafka.sasl_mechanism")
    assert text.startswith("cannot be used with the librdkafka installed here") and "No provider" in text
    assert core_kafka.sasl_mechanism_problem("OAUTHBEARER") is None
    assert core_kafka.sasl_mechanism_problem("SCRAM-SHA-512") is None


# --- the librdkafka: passthrough -------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "expected"), [
    ({"compresion.type": "zstd"}, "is not a librdkafka property; did you mean 'compression.type'?"),
    ({"logger": "x"}, "is not a librdkafka property"),
    ({"error_cb": "x"}, "C API"),
    ({"group.id": "mine"}, "cannot be passed through: Sluice sets it on each client: each consumer group"),
    ({"isolation.level": "read_uncommitted"}, "committed records only"),
    ({"enable.auto.commit": True}, "only after the work is durable"),
    ({"transactional.id": "x"}, "fences a zombie"),
    ({"partitioner": "random"}, "murmur2"),
    ({"bootstrap.servers": "x:1"}, "set it with the section's bootstrap_servers field"),
    ({"sasl.password": "x"}, "sasl_password (or sasl_password_file, sasl_password_env)"),
    ({"session.timeout.ms": 1000}, "kafka.session_timeout_ms"),
    ({"oauthbearer_token_refresh_cb": "x"}, "C API"),
    ({"compression.type": "brotli"}, "must be one of none, gzip, snappy, lz4, zstd"),
    ({"fetch.max.bytes": "10MB"}, "must be an integer"),
    ({"fetch.max.bytes": -1}, "must be from"),
    ({"socket.keepalive.enable": "yes"}, "must be true or false"),
    ({"debug": "broker,tls"}, "tls not known"),
    ({"client.rack": ["a"]}, "must be a single value"),
])
def test_the_passthrough_refuses_what_librdkafka_or_sluice_would(tmp_path: Path, settings: dict[str, Any],
                                                                  expected: str) -> None:
    """An unknown name (with the nearest known one), a property Sluice sets (with why, or the field that
    sets it), a C API property, and a value of the wrong type, range or set are each named."""
    data = site(tmp_path, {"librdkafka": settings})
    [name] = settings
    problems = problems_of(data, tmp_path)
    text = reason(problems, f"kafka.librdkafka.{name}")
    if name == "fetch.max.bytes" and settings[name] == -1:
        low, _, high = PROPERTIES["fetch.max.bytes"][2].partition(" .. ")
        expected = f"must be from {low} to {high}"
    assert expected in text, text
    # The same check for a sender's remote cluster, named there.
    assert reason(problems, f"gateway_senders[0].remote.librdkafka.{name}") == text


def test_every_owned_property_is_one_librdkafka_knows() -> None:
    """The refusals name real properties (a typo there would refuse nothing)."""
    assert set(OWNED) <= set(PROPERTIES) and SECRET_PROPERTIES <= set(PROPERTIES)


def test_a_passthrough_secret_is_never_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """ssl.keystore.password in librdkafka: is kept hidden (repr, dump, config check output, an error
    elsewhere in the section) and revealed only to librdkafka."""
    monkeypatch.setenv("COLUMNS", "400")
    secret = "keystore-pw-91c2"
    (tmp_path / "client.p12").write_bytes(b"0")
    kafka = {"security_protocol": "SSL",
             "librdkafka": {"ssl.keystore.location": str(tmp_path / "client.p12"), "ssl.keystore.password": secret}}
    path = write(tmp_path, site(tmp_path, kafka))
    cfg = load_config(path)
    assert isinstance(cfg.kafka.librdkafka["ssl.keystore.password"], SecretStr)
    assert secret not in repr(cfg) and secret not in str(cfg.model_dump())
    assert cfg.kafka.client_settings()["ssl.keystore.password"] == secret
    assert config_main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert secret not in out and "secret kafka.librdkafka.ssl.keystore.password: from the site file" in out
    broken = site(tmp_path, {**kafka, "librdkafka": {**kafka["librdkafka"], "fetch.max.bytes": "x"}})
    problems = problems_of(broken, tmp_path)
    assert secret not in repr(problems)
    path.write_text(yaml.safe_dump(broken))
    assert config_main(["config", "check", str(path)]) == 1
    assert secret not in capsys.readouterr().out


def test_the_properties_table_is_the_installed_librdkafkas() -> None:
    """services/core/librdkafka_properties.py lists exactly the properties, scopes, types and ranges of the
    librdkafka confluent-kafka loads (read from the library's own CONFIGURATION.md); after an upgrade,
    write it again with tests/tools/librdkafka_properties.py --write."""
    tools = Path(__file__).resolve().parents[1] / "tools"
    import importlib.util
    spec = importlib.util.spec_from_file_location("librdkafka_properties_tool", tools / "librdkafka_properties.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.properties() == PROPERTIES
    assert len(PROPERTIES) > 150 and PROPERTIES["sasl.oauthbearer.method"] == ("*", "enum value", "default, oidc")


def test_every_client_a_service_makes_goes_through_core_kafka() -> None:
    """No module but core/kafka.py makes a confluent_kafka client, so the connection settings (login and
    passthrough, scoped per client) reach every producer, consumer and admin client of every service."""
    makers = {"Producer", "Consumer", "AdminClient", "SerializingProducer", "DeserializingConsumer"}
    offenders = []
    for path in SERVICES.rglob("*.py"):
        if path == SERVICES / "core" / "kafka.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in makers:
                offenders.append(f"{path.relative_to(SERVICES)}:{node.lineno}")
    assert offenders == []


def test_the_kafka_logins_document_covers_every_mechanism() -> None:
    """docs/kafka-logins.md gives every mechanism the site file accepts, and the three platforms."""
    text = (SERVICES.parent / "docs" / "kafka-logins.md").read_text(encoding="utf-8")
    for word in ("PLAIN", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI", "librdkafka:", "Strimzi", "Confluent Cloud",
                 "Amazon MSK", "sasl_oauthbearer_client_secret_file", "aws_msk_iam", "pip install sluice[msk]"):
        assert word in text, word
    for block in text.split("```yaml")[1:]:
        yaml.safe_load(textwrap.dedent(block.split("```")[0]))
