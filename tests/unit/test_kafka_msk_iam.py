"""Amazon MSK's IAM login (``sasl_oauthbearer_method: aws_msk_iam``) reaches every Kafka client as
SASL/OAUTHBEARER over TLS with confluent-kafka's ``oauth_cb``, whose token is AWS's signer's presigned
``kafka-cluster:Connect`` URL for the cluster's region, expiring in the future; librdkafka itself calls
it when a client is made.  The signer presigns locally: fake credentials in the environment, no network.
A site file that asks for it without the signer installed, without its region, or without TLS is
refused by ``sluice config check`` with the reason."""

from __future__ import annotations

import base64
import logging
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from recorded_clients import Recorded

from sluice.core import kafka as core_kafka
from sluice.core.config import parse_config
from sluice.core.configcli import main as config_main
from sluice.core.errors import ConfigError
from sluice.core.mskiam import MskIamToken
from sluice.listeners.kafka_forwarder import parse_settings

ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE"
MSK_IAM = {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER",
           "sasl_oauthbearer_method": "aws_msk_iam", "aws_region": "eu-west-1"}


@pytest.fixture
def aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials in the environment, the first link of botocore's chain; no shared files, no
    instance metadata, so nothing is looked up beyond this process."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEXAMPLE")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def site(kafka: dict[str, Any]) -> dict[str, Any]:
    return {
        "site": "london", "dsid": 1,
        "kafka": {"bootstrap_servers": "b-1.orders.abc123.c2.kafka.eu-west-1.amazonaws.com:9098", **kafka},
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "remote": {
            "bootstrap_servers": "b-1.paris.def456.c3.kafka.eu-west-3.amazonaws.com:9098",
            **kafka, "aws_region": "eu-west-3"}}],
    }


def problems_of(kafka: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(site(kafka), source="site.yaml")
    return {field: reason for field, _, reason in caught.value.problems}


def presigned(token: str) -> tuple[str, dict[str, list[str]]]:
    """The URL a token carries (base64url without padding), and its query."""
    url = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("utf-8")
    return url, parse_qs(urlsplit(url).query)


def test_every_client_of_every_connection_gets_the_msk_iam_token(
        aws_credentials: None, recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """The kafka:, remote: and forwarder connections' producers, consumers and admin clients: OAUTHBEARER
    over SASL_SSL, and an oauth_cb whose token is a presigned kafka-cluster:Connect URL of the connection's
    region, signed with the environment's access key, expiring within the signer's 15 minutes."""
    cfg = parse_config(site(MSK_IAM), source="site.yaml")
    remote = cfg.sender("to-b").remote
    assert remote is not None
    forwarder = parse_settings({"topic": "orders-out", "bootstrap_servers": "f1:9098", **MSK_IAM,
                                "aws_region": "us-east-1"}, site_dir=Path.cwd())
    assert forwarder.cluster is not None
    for base, region in ((cfg.kafka.client_settings(), "eu-west-1"), (remote.client_settings(), "eu-west-3"),
                         (forwarder.cluster.client_settings(), "us-east-1")):
        start = len(Recorded.made)
        core_kafka.make_producer(base)
        core_kafka.make_consumer(base, "sluice.london.queue.q")
        core_kafka.make_admin(base)
        for kind, conf in recorded[start:]:
            assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.mechanism"] == "OAUTHBEARER", kind
            assert conf["sasl.oauthbearer.method"] == "default", kind
            assert "enable.sasl.oauthbearer.unsecure.jwt" not in conf and "sasl.oauthbearer.config" not in conf
            before = time.time()
            token, expiry_s = conf["oauth_cb"](None)
            url, query = presigned(token)
            assert urlsplit(url).scheme == "https" and urlsplit(url).hostname == f"kafka.{region}.amazonaws.com"
            assert query["Action"] == ["kafka-cluster:Connect"], url
            assert query["X-Amz-Algorithm"] == ["AWS4-HMAC-SHA256"]
            key, _, scope_region, service, _ = query["X-Amz-Credential"][0].split("/")
            assert (key, scope_region, service) == (ACCESS_KEY, region, "kafka-cluster")
            assert len(query["X-Amz-Signature"][0]) == 64
            assert before < expiry_s <= before + 900 + 5, (expiry_s, before)


def test_librdkafka_itself_calls_the_token_callback_when_each_client_is_made(
        aws_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given to confluent_kafka's real Producer, Consumer and AdminClient (no broker up), each client is made
    and asks the signer for a token while it is made, so a login never waits for a first poll."""
    regions: list[str] = []
    sign = MSKAuthTokenProvider.generate_auth_token

    def counted(region: str, *args: Any) -> tuple[str, int]:
        regions.append(region)
        return sign(region, *args)

    monkeypatch.setattr(MSKAuthTokenProvider, "generate_auth_token", counted)
    base = {**parse_config(site(MSK_IAM), source="site.yaml").kafka.client_settings(), "log_level": 0}
    consumer = Consumer({**base, "group.id": "g"})
    clients = [Producer(base), consumer, AdminClient(base)]
    assert len(clients) == 3 and regions == ["eu-west-1"] * 3
    consumer.close()


def test_without_credentials_the_callback_says_why_and_fails_the_login(
        aws_credentials: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No credentials anywhere in botocore's chain: the callback logs the reason and raises, so librdkafka
    fails the login instead of sending an empty token."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with caplog.at_level(logging.ERROR, logger="sluice.mskiam"), pytest.raises(Exception):
        MskIamToken("eu-west-1")(None)
    assert "no usable AWS credentials" in caplog.text and "eu-west-1" in caplog.text


def test_config_check_refuses_aws_msk_iam_without_the_signer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the package is not installed, `sluice config check` exits 1 naming the package and
    `pip install sluice[msk]`; with it, the same file is valid."""
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site(MSK_IAM)))
    monkeypatch.setenv("COLUMNS", "400")
    assert config_main(["config", "check", str(path)]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "aws_msk_iam_sasl_signer", None)
    monkeypatch.setitem(sys.modules, "aws_msk_iam_sasl_signer.MSKAuthTokenProvider", None)
    assert config_main(["config", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "kafka.sasl_oauthbearer_method" in out
    assert "aws-msk-iam-sasl-signer-python" in out and "pip install sluice[msk]" in out


@pytest.mark.parametrize(("change", "field", "expected"), [
    ({"aws_region": None}, "kafka.aws_region", "is required with sasl_oauthbearer_method aws_msk_iam"),
    ({"aws_region": "Ireland"}, "kafka.aws_region", "must be an AWS region name"),
    ({"security_protocol": "SASL_PLAINTEXT"}, "kafka.security_protocol", "must be SASL_SSL"),
    ({"sasl_oauthbearer_client_id": "c"}, "kafka.sasl_oauthbearer_client_id",
     "is not used with sasl_mechanism OAUTHBEARER and sasl_oauthbearer_method aws_msk_iam"),
])
def test_an_msk_iam_login_with_a_missing_or_wrong_setting_is_refused(change: dict[str, Any], field: str,
                                                                     expected: str) -> None:
    login = {k: v for k, v in {**MSK_IAM, **change}.items() if v is not None}
    assert expected in problems_of(login)[field]


def test_aws_region_on_another_login_is_refused() -> None:
    """aws_region does nothing with OIDC or without SASL: refused rather than ignored."""
    plain = {"security_protocol": "SSL", "aws_region": "eu-west-1"}
    assert "is only used with SASL_PLAINTEXT or SASL_SSL" in problems_of(plain)["kafka.aws_region"]


def test_the_image_installs_and_checks_the_signer() -> None:
    """The msk extra is in deploy/requirements.lock at pyproject's version with hashes, with the packages
    it needs (boto3, botocore), and the image's build proves it imports."""
    from test_supply_chain import DOCKERFILE, LOCK, PYPROJECT, locked

    lock = locked(LOCK)
    for spec in PYPROJECT["project"]["optional-dependencies"]["msk"]:
        requirement = Requirement(spec)
        name = str(canonicalize_name(requirement.name))
        assert name in lock and requirement.specifier.contains(lock[name][0]), f"{spec}: run `make lock`"
        assert lock[name][1], f"{name} has no hashes in {LOCK.name}"
    assert {"boto3", "botocore"} <= set(lock)
    assert "from sluice.core.mskiam import signer_problem" in DOCKERFILE.read_text(encoding="utf-8")


def test_a_token_callback_in_the_passthrough_is_refused_pointing_at_the_methods() -> None:
    """``librdkafka: {oauth_cb: …}`` cannot be a callable from a file: refused naming aws_msk_iam."""
    problems = problems_of({"librdkafka": {"oauth_cb": "mymodule:token"}})
    assert "sasl_oauthbearer_method aws_msk_iam" in problems["kafka.librdkafka.oauth_cb"]
