"""The Kafka sections: how to reach a cluster, and the client tuning every service shares.

``KafkaConnection`` is a cluster's address, login, TLS and topic prefix,
and the only place its secrets are revealed (``client_settings``).  A login
is a SASL mechanism with its own settings: PLAIN and SCRAM (user name and
password), OAUTHBEARER (OIDC's client credentials against a token endpoint,
Amazon MSK's IAM token signed by AWS's library, or librdkafka's unsecured
JWT for development), GSSAPI (Kerberos); any other
librdkafka property goes in ``librdkafka:``, checked in
``..librdkafka`` (docs/kafka-logins.md shows each with Strimzi, Confluent
Cloud and Amazon MSK);
``KafkaConfig`` (the site's ``kafka:``) adds the consumer-group and producer
timing; ``RemoteSiteConfig`` is a gateway sender's ``remote:`` cluster.  The
rules between a connection's fields (SASL and TLS settings that go together)
and between the timeouts are below the models, as functions of plain data, so
they also run on a raw file that failed elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from ...kafka import sasl_mechanism_problem
from ...mskiam import MskIamToken, signer_problem
from ...topics import TopicNames
from ..base import TOPIC_PREFIX_PATTERN, Problem, _as_int, _get, _invalid, _Model, _raise_rules
from ..librdkafka import passthrough_problems, passthrough_value, revealed
from ..secrets import _secret_source_problems, _shown, secret_of
from .secretfields import READ_PER_CLIENT, existing_files, secret_env, secret_file

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]
OauthbearerMethod = Literal["oidc", "unsecured_jwt", "aws_msk_iam"]

#: The mechanisms that log in with a user name and password.
_PASSWORD_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_PASSWORD_FIELDS = ("sasl_username", "sasl_password", "sasl_password_file", "sasl_password_env")
_OIDC_FIELDS = ("sasl_oauthbearer_client_id", "sasl_oauthbearer_client_secret",
                "sasl_oauthbearer_client_secret_file", "sasl_oauthbearer_client_secret_env",
                "sasl_oauthbearer_token_endpoint_url", "sasl_oauthbearer_scope", "sasl_oauthbearer_extensions")
_OAUTHBEARER_FIELDS = ("sasl_oauthbearer_method", *_OIDC_FIELDS, "sasl_oauthbearer_config", "aws_region")
_KERBEROS_FIELDS = ("sasl_kerberos_service_name", "sasl_kerberos_principal", "sasl_kerberos_keytab",
                    "sasl_kerberos_kinit_cmd")
#: librdkafka's ``metadata.recovery.rebootstrap.trigger.ms`` on every client, unless the connection's
#: ``librdkafka:`` passthrough sets it: after this long with no metadata from any broker, the client
#: starts again from ``bootstrap.servers``.  librdkafka forgets a broker that a metadata response leaves
#: out, as the only broker of a single-node cluster can be right after a pause; with every broker
#: forgotten, a group member then looks for its coordinator among no brokers, and a transactional
#: producer's ``send_offsets_to_transaction`` waits for a coordinator it no longer connects to
#: (confluentinc/librdkafka#5511), until the re-bootstrap, 300 s by default.  Measured on the paused
#: broker gateway test: a receiver left out of its group for good in 2 of 12 runs at 300 s; at 10 s
#: every member is back within seconds of the broker.
REBOOTSTRAP_TRIGGER_MS = 10_000

#: RFC 7628 §3.1: an extension's key is letters only, and "auth" is the token's own.
_EXTENSION_KEY = re.compile(r"^[A-Za-z]+$")
_URL = re.compile(r"^https?://[^\s/?#]+[^\s]*$")
#: AWS's region names: us-east-1, eu-central-2, us-gov-west-1, cn-north-1, ap-southeast-4 …
_AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]{1,2}$")

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)$")


class KafkaConnection(_Model):
    """How to reach a Kafka cluster, and the prefix of Sluice's topics on it."""

    #: How errors name this section's fields when a client is made.
    _SECTION: ClassVar[str] = "kafka"

    bootstrap_servers: str = Field(
        description="host:port[,host:port…] of the cluster's brokers",
        json_schema_extra={"kafka": "bootstrap.servers"})
    security_protocol: SecurityProtocol = Field(
        "PLAINTEXT", description="how clients talk to the brokers: plain or TLS, with or without SASL",
        json_schema_extra={"kafka": "security.protocol"})
    sasl_mechanism: SaslMechanism | None = Field(
        None, description="required with SASL_PLAINTEXT and SASL_SSL", json_schema_extra={"kafka": "sasl.mechanism"})
    sasl_username: str | None = Field(
        None, description="required with PLAIN and SCRAM", json_schema_extra={"kafka": "sasl.username"})
    sasl_password: SecretStr | None = Field(
        None, description="the PLAIN or SCRAM password; with those, exactly one of sasl_password, "
        "sasl_password_file or sasl_password_env is required", json_schema_extra={"kafka": "sasl.password"})
    sasl_password_file: str | None = secret_file("sasl_password", READ_PER_CLIENT)
    sasl_password_env: str | None = secret_env("sasl_password", READ_PER_CLIENT)
    sasl_oauthbearer_method: OauthbearerMethod | None = Field(
        None, description="with OAUTHBEARER: oidc (the default) fetches tokens from "
        "sasl_oauthbearer_token_endpoint_url with OAuth client credentials; unsecured_jwt makes unsigned tokens "
        "from sasl_oauthbearer_config, for development and tests against a broker with Kafka's unsecured "
        "validator only; aws_msk_iam signs Amazon MSK's IAM token with the AWS credentials botocore finds "
        "(needs aws_region, SASL_SSL and the package aws-msk-iam-sasl-signer-python: pip install sluice[msk])",
        json_schema_extra={"kafka": "sasl.oauthbearer.method"})
    sasl_oauthbearer_client_id: str | None = Field(
        None, min_length=1, description="with OAUTHBEARER oidc, required: the client's id at the identity provider",
        json_schema_extra={"kafka": "sasl.oauthbearer.client.id"})
    sasl_oauthbearer_client_secret: SecretStr | None = Field(
        None, description="with OAUTHBEARER oidc, exactly one of sasl_oauthbearer_client_secret, "
        "sasl_oauthbearer_client_secret_file or sasl_oauthbearer_client_secret_env is required",
        json_schema_extra={"kafka": "sasl.oauthbearer.client.secret"})
    sasl_oauthbearer_client_secret_file: str | None = secret_file("sasl_oauthbearer_client_secret", READ_PER_CLIENT)
    sasl_oauthbearer_client_secret_env: str | None = secret_env("sasl_oauthbearer_client_secret", READ_PER_CLIENT)
    sasl_oauthbearer_token_endpoint_url: str | None = Field(
        None, description="with OAUTHBEARER oidc, required: the identity provider's token endpoint, "
        "http(s)://…; its CA, if private, in librdkafka's https.ca.location",
        json_schema_extra={"kafka": "sasl.oauthbearer.token.endpoint.url"})
    sasl_oauthbearer_scope: str | None = Field(
        None, min_length=1, description="with OAUTHBEARER oidc: the scope the token is asked for, if the provider "
        "wants one", json_schema_extra={"kafka": "sasl.oauthbearer.scope"})
    sasl_oauthbearer_extensions: dict[str, str] | None = Field(
        None, description="with OAUTHBEARER oidc: SASL extensions sent with the token (name: value; names of "
        "letters only), e.g. Confluent Cloud's logicalCluster and identityPoolId",
        json_schema_extra={"kafka": "sasl.oauthbearer.extensions"})
    sasl_oauthbearer_config: str | None = Field(
        None, min_length=1, description="with OAUTHBEARER unsecured_jwt, required: the unsigned token's claims as "
        "space-separated name=value pairs, at least principal=<name> (e.g. 'principal=alice lifeSeconds=3600')",
        json_schema_extra={"kafka": "sasl.oauthbearer.config"})
    aws_region: str | None = Field(
        None, description="with OAUTHBEARER aws_msk_iam, required: the AWS region of the Amazon MSK cluster "
        "(e.g. eu-west-1), which its IAM token is signed for")
    sasl_kerberos_service_name: str | None = Field(
        None, min_length=1, description="with GSSAPI: the brokers' Kerberos service name (default kafka)",
        json_schema_extra={"kafka": "sasl.kerberos.service.name"})
    sasl_kerberos_principal: str | None = Field(
        None, min_length=1, description="with GSSAPI, required: this client's Kerberos principal",
        json_schema_extra={"kafka": "sasl.kerberos.principal"})
    sasl_kerberos_keytab: str | None = Field(
        None, description="with GSSAPI: the principal's keytab, used by the kinit command; required unless "
        "sasl_kerberos_kinit_cmd is given; relative to the site file", json_schema_extra={"kafka": "sasl.kerberos.keytab"})
    sasl_kerberos_kinit_cmd: str | None = Field(
        None, description="with GSSAPI: the command that gets or refreshes the ticket (librdkafka's default runs "
        "kinit with the keytab); an empty string runs none, for a ticket cache kept by another process",
        json_schema_extra={"kafka": "sasl.kerberos.kinit.cmd"})
    ssl_ca_location: str | None = Field(
        None, description="CA bundle (PEM) that signed the brokers' certificates; relative to the site file",
        json_schema_extra={"kafka": "ssl.ca.location"})
    ssl_certificate_location: str | None = Field(
        None, description="client certificate (PEM), for mutual TLS; relative to the site file",
        json_schema_extra={"kafka": "ssl.certificate.location"})
    ssl_key_location: str | None = Field(
        None, description="client private key (PEM), for mutual TLS; relative to the site file",
        json_schema_extra={"kafka": "ssl.key.location"})
    ssl_key_password: SecretStr | None = Field(
        None, description="the password of ssl_key_location's key, if it has one; at most one of ssl_key_password, "
        "ssl_key_password_file or ssl_key_password_env", json_schema_extra={"kafka": "ssl.key.password"})
    ssl_key_password_file: str | None = secret_file("ssl_key_password", READ_PER_CLIENT)
    ssl_key_password_env: str | None = secret_env("ssl_key_password", READ_PER_CLIENT)
    topic_prefix: str = Field(
        "sluice.", pattern=TOPIC_PREFIX_PATTERN, description="the start of every Sluice topic name on this cluster, "
        "so several sites or installations can share one")
    librdkafka: dict[str, Any] = Field(
        default_factory=dict, description="other librdkafka properties for every client of this connection "
        "(name: value), e.g. ssl.endpoint.identification.algorithm or compression.type; an unknown name, a value "
        "librdkafka would refuse, and a property Sluice sets itself are errors (docs/kafka-logins.md); "
        "producer-only properties reach producers only, consumer-only ones consumers only; "
        "metadata.recovery.rebootstrap.trigger.ms is 10000 unless set here")

    @field_validator("bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",")]
        if not value.strip() or any(not s for s in servers):
            raise _invalid("must be host:port, or several separated by commas")
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host:
                raise _invalid(f"{server!r} has no port: write host:port, e.g. 127.0.0.1:9092")
            if not _HOST.match(host):
                raise _invalid(f"{host!r} is not a host name or address")
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise _invalid(f"port {port!r} of {server!r} must be a number from 1 to 65535")
        return ",".join(servers)

    @field_validator("sasl_oauthbearer_token_endpoint_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not _URL.match(value):
            raise _invalid("must be an http:// or https:// URL, e.g. https://idp.example.com/oauth2/token")
        return value

    @field_validator("aws_region")
    @classmethod
    def _check_aws_region(cls, value: str | None) -> str | None:
        if value is not None and not _AWS_REGION.match(value):
            raise _invalid("must be an AWS region name, e.g. eu-west-1 or us-east-1")
        return value

    @field_validator("sasl_oauthbearer_extensions")
    @classmethod
    def _check_extensions(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for name, text in (value or {}).items():
            if not _EXTENSION_KEY.match(name) or name == "auth":
                raise _invalid(f"extension name {name!r} must be letters only, and not 'auth' (RFC 7628)")
            if not text or "," in text or "=" in text or not text.isprintable():
                raise _invalid(f"extension {name}'s value must be printable text without ',' or '=' "
                               "(librdkafka joins the extensions as name=value,…)")
        return value

    @field_validator("librdkafka", mode="before")
    @classmethod
    def _check_librdkafka(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _invalid("must be a map of librdkafka property names to values")
        problems = passthrough_problems(value)
        if problems:
            # Named relative to this field, as pydantic names the section.
            _raise_rules([(where.removeprefix("librdkafka."), shown, reason) for where, shown, reason in problems])
        return {name: passthrough_value(name, v) for name, v in value.items()}

    _check_files = existing_files("ssl_ca_location", "ssl_certificate_location", "ssl_key_location",
                                  "sasl_password_file", "ssl_key_password_file",
                                  "sasl_oauthbearer_client_secret_file", "sasl_kerberos_keytab")

    @model_validator(mode="after")
    def _check_connection(self) -> KafkaConnection:
        _raise_rules(_connection_rules(self.model_dump()))
        return self

    def client_settings(self) -> dict[str, Any]:
        """librdkafka connection settings; the only place Kafka secrets are revealed.

        A password from a file or an environment variable is read here, each
        time, so the next client made after a secret is rotated gets the new one.
        """
        settings: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
            "metadata.recovery.rebootstrap.trigger.ms": REBOOTSTRAP_TRIGGER_MS,
        }
        if self.sasl_mechanism is not None:
            settings["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            settings["sasl.username"] = self.sasl_username
        sasl_password = self._secret("sasl_password")
        if sasl_password is not None:
            settings["sasl.password"] = sasl_password
        if self.sasl_mechanism == "OAUTHBEARER":
            settings.update(self._oauthbearer_settings())
        if self.sasl_mechanism == "GSSAPI":
            settings["sasl.kerberos.service.name"] = self.sasl_kerberos_service_name or "kafka"
            settings["sasl.kerberos.principal"] = self.sasl_kerberos_principal
            if self.sasl_kerberos_keytab is not None:
                settings["sasl.kerberos.keytab"] = self.sasl_kerberos_keytab
            if self.sasl_kerberos_kinit_cmd is not None:
                settings["sasl.kerberos.kinit.cmd"] = self.sasl_kerberos_kinit_cmd
        if self.ssl_ca_location is not None:
            settings["ssl.ca.location"] = self.ssl_ca_location
        if self.ssl_certificate_location is not None:
            settings["ssl.certificate.location"] = self.ssl_certificate_location
        if self.ssl_key_location is not None:
            settings["ssl.key.location"] = self.ssl_key_location
        ssl_key_password = self._secret("ssl_key_password")
        if ssl_key_password is not None:
            settings["ssl.key.password"] = ssl_key_password
        # Last: the passthrough refuses every property set above but the re-bootstrap trigger, a default.
        settings.update(revealed(self.librdkafka))
        return settings

    def _oauthbearer_settings(self) -> dict[str, Any]:
        """librdkafka's OAUTHBEARER settings: OIDC client credentials, Amazon MSK's IAM token made by
        confluent-kafka's ``oauth_cb`` (core/mskiam.py), or the unsecured JWT for development."""
        if self.sasl_oauthbearer_method == "aws_msk_iam":
            assert self.aws_region is not None, "the connection's rules require aws_region"
            return {"sasl.oauthbearer.method": "default", "oauth_cb": MskIamToken(self.aws_region)}
        if self.sasl_oauthbearer_method == "unsecured_jwt":
            return {
                "sasl.oauthbearer.method": "default",
                "enable.sasl.oauthbearer.unsecure.jwt": True,
                "sasl.oauthbearer.config": self.sasl_oauthbearer_config,
            }
        settings: dict[str, Any] = {
            "sasl.oauthbearer.method": "oidc",
            "sasl.oauthbearer.client.id": self.sasl_oauthbearer_client_id,
            "sasl.oauthbearer.client.secret": self._secret("sasl_oauthbearer_client_secret"),
            "sasl.oauthbearer.token.endpoint.url": self.sasl_oauthbearer_token_endpoint_url,
        }
        if self.sasl_oauthbearer_scope is not None:
            settings["sasl.oauthbearer.scope"] = self.sasl_oauthbearer_scope
        if self.sasl_oauthbearer_extensions:
            settings["sasl.oauthbearer.extensions"] = ",".join(
                f"{name}={value}" for name, value in self.sasl_oauthbearer_extensions.items())
        return settings

    def _secret(self, name: str) -> str | None:
        """The secret ``name`` read now from whichever of its three sources the file gives, or None."""
        return secret_of(self, name, self._SECTION)

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.topic_prefix)


class KafkaConfig(KafkaConnection):
    """This site's cluster, plus the client tuning every service shares."""

    replication_factor: int = Field(
        1, description="replicas of every topic `sluice topics apply` creates: >= 1, or -1 for the broker's "
        "default.replication.factor", json_schema_extra={"kafka": "replication.factor"})
    # Tuned for fast failover (DESIGN §1: group membership is the primary
    # lock): a dead member is noticed after session_timeout_ms.  6000 is the
    # smallest session Kafka's default group.min.session.timeout.ms allows.
    session_timeout_ms: int = Field(
        6000, ge=1, description="a consumer-group member silent this long is taken as dead and its partitions "
        "(buckets, queue partitions) move to another member: the failover time",
        json_schema_extra={"kafka": "session.timeout.ms"})
    heartbeat_interval_ms: int = Field(
        1000, ge=1, description="how often members tell the group they are alive; lower than session_timeout_ms",
        json_schema_extra={"kafka": "heartbeat.interval.ms"})
    max_poll_interval_ms: int = Field(
        30000, ge=1, description="a member that does not poll this long leaves the group; at least "
        "session_timeout_ms", json_schema_extra={"kafka": "max.poll.interval.ms"})
    producer_linger_ms: int = Field(
        0, ge=0, description="0 sends at once: a write waits for two sequential records (changelog, then "
        "queues); batches still form under load. The subscription service fills client queues with a linger of "
        "its own", json_schema_extra={"kafka": "linger.ms"})
    delivery_timeout_ms: int = Field(
        120000, ge=1, description="how long a produced record may take to be acknowledged before the write "
        "fails; at least producer_linger_ms + request_timeout_ms. A region's transactional writes take at most "
        "their transaction timeout (10 s)", json_schema_extra={"kafka": "delivery.timeout.ms"})
    request_timeout_ms: int = Field(
        30000, ge=1, description="how long a client waits for a broker's answer to one request; a region's "
        "transactional writes take at most 9 s", json_schema_extra={"kafka": "request.timeout.ms"})

    @field_validator("replication_factor")
    @classmethod
    def _check_replication(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise _invalid("must be >= 1, or -1 for the broker's default")
        return value

    @model_validator(mode="after")
    def _check_timing(self) -> KafkaConfig:
        _raise_rules(_timing_rules(self.model_dump()))
        return self

    def group_settings(self) -> dict[str, Any]:
        """librdkafka consumer-group settings (failure detection and poll deadline)."""
        return {
            "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": self.heartbeat_interval_ms,
            "max.poll.interval.ms": self.max_poll_interval_ms,
        }

    def producer_settings(self) -> dict[str, Any]:
        """librdkafka producer timing settings from this file."""
        return {
            "linger.ms": self.producer_linger_ms,
            "delivery.timeout.ms": self.delivery_timeout_ms,
            "request.timeout.ms": self.request_timeout_ms,
        }


class RemoteSiteConfig(KafkaConnection):
    """How a gateway sender reaches the remote site's Kafka cluster."""

    _SECTION: ClassVar[str] = "remote"


# --- rules within a connection and its timing, on plain data ---------------------


def _connection_rules(section: Mapping[str, Any]) -> list[Problem]:
    """A login's settings only with its mechanism, and all it needs there; TLS settings only with TLS."""
    protocol = _get(section, KafkaConnection, "security_protocol")
    if not isinstance(protocol, str):
        return []
    problems: list[Problem] = []
    ssl = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password",
           "ssl_key_password_file", "ssl_key_password_env")
    if protocol.startswith("SASL_"):
        mechanism = section.get("sasl_mechanism")
        if mechanism is None:
            problems.append(("sasl_mechanism", None, f"is required when security_protocol is {protocol}"))
        elif isinstance(mechanism, str):
            problems += _login_rules(section, mechanism, protocol)
    else:
        sasl = ("sasl_mechanism", *_PASSWORD_FIELDS, *_OAUTHBEARER_FIELDS, *_KERBEROS_FIELDS)
        problems += _unused(section, sasl, f"is only used with SASL_PLAINTEXT or SASL_SSL, and security_protocol "
                                           f"is {protocol}")
    if protocol not in ("SSL", "SASL_SSL"):
        problems += _unused(section, ssl, f"is only used with SSL or SASL_SSL, and security_protocol is {protocol}")
        return problems
    certificate = section.get("ssl_certificate_location")
    key = section.get("ssl_key_location")
    if certificate is not None and key is None:
        problems.append(("ssl_key_location", None, "is required with ssl_certificate_location (mutual TLS needs both)"))
    if key is not None and certificate is None:
        problems.append(("ssl_certificate_location", None, "is required with ssl_key_location (mutual TLS needs both)"))
    for name in ("ssl_key_password", "ssl_key_password_file", "ssl_key_password_env"):
        if section.get(name) is not None and key is None:
            problems.append((name, _shown(name, section[name]), "is only used with ssl_key_location"))
    problems += _secret_source_problems(section, "ssl_key_password")
    return problems


def _login_rules(section: Mapping[str, Any], mechanism: str, protocol: str) -> list[Problem]:
    """What ``mechanism`` needs, and no other mechanism's settings."""
    problems: list[Problem] = []

    def require(name: str, why: str) -> None:
        if section.get(name) is None:
            problems.append((name, None, f"is required {why}"))

    def require_secret(name: str, why: str) -> None:
        if all(section.get(n) is None for n in (name, f"{name}_file", f"{name}_env")):
            problems.append((name, None, f"is required {why} (or {name}_file: a file holding it, or {name}_env: "
                                         "an environment variable holding it)"))
        problems.extend(_secret_source_problems(section, name))

    own: tuple[str, ...]
    if mechanism in _PASSWORD_MECHANISMS:
        own = _PASSWORD_FIELDS
        require("sasl_username", f"when security_protocol is {protocol}")
        require_secret("sasl_password", f"when security_protocol is {protocol}")
    elif mechanism == "OAUTHBEARER":
        method = section.get("sasl_oauthbearer_method") or "oidc"
        if method == "aws_msk_iam":
            own = ("sasl_oauthbearer_method", "aws_region")
            require("aws_region", "with sasl_oauthbearer_method aws_msk_iam")
            if protocol != "SASL_SSL":
                problems.append(("security_protocol", protocol, "must be SASL_SSL with sasl_oauthbearer_method "
                                                                "aws_msk_iam: Amazon MSK's IAM listeners take TLS only"))
            unavailable = signer_problem()
            if unavailable is not None:
                problems.append(("sasl_oauthbearer_method", method, unavailable))
        elif method == "unsecured_jwt":
            own = ("sasl_oauthbearer_method", "sasl_oauthbearer_config")
            require("sasl_oauthbearer_config", "with sasl_oauthbearer_method unsecured_jwt")
            config = section.get("sasl_oauthbearer_config")
            if isinstance(config, str) and not any(pair.startswith("principal=") and len(pair) > len("principal=")
                                                   for pair in config.split()):
                problems.append(("sasl_oauthbearer_config", config,
                                 "must name the token's principal: principal=<name> (space-separated name=value)"))
        else:
            own = ("sasl_oauthbearer_method", *_OIDC_FIELDS)
            why = "with sasl_mechanism OAUTHBEARER (sasl_oauthbearer_method oidc)"
            require("sasl_oauthbearer_client_id", why)
            require_secret("sasl_oauthbearer_client_secret", why)
            require("sasl_oauthbearer_token_endpoint_url", why)
    elif mechanism == "GSSAPI":
        own = _KERBEROS_FIELDS
        require("sasl_kerberos_principal", "with sasl_mechanism GSSAPI")
        if section.get("sasl_kerberos_keytab") is None and section.get("sasl_kerberos_kinit_cmd") is None:
            problems.append(("sasl_kerberos_keytab", None, "is required with sasl_mechanism GSSAPI, unless "
                                                           "sasl_kerberos_kinit_cmd says how the ticket is got "
                                                           "(\"\" when another process keeps the ticket cache)"))
    else:
        return problems  # the field's own check names the mechanisms
    missing = sasl_mechanism_problem(mechanism)
    if missing is not None:
        problems.append(("sasl_mechanism", mechanism, f"cannot be used with the librdkafka installed here "
                                                      f"(confluent-kafka's): {missing}"))
    others = [name for name in (*_PASSWORD_FIELDS, *_OAUTHBEARER_FIELDS, *_KERBEROS_FIELDS) if name not in own]
    method = section.get("sasl_oauthbearer_method") or "oidc"
    problems += _unused(section, others, f"is not used with sasl_mechanism {mechanism}"
                        + (f" and sasl_oauthbearer_method {method}" if mechanism == "OAUTHBEARER" else ""))
    return problems


def _unused(section: Mapping[str, Any], names: Any, reason: str) -> list[Problem]:
    """A problem for each of ``names`` the section gives: a setting that would do nothing."""
    return [(name, _shown(name, section[name]), reason) for name in names if section.get(name) is not None]


def _timing_rules(section: Mapping[str, Any]) -> list[Problem]:
    """Heartbeat below the session timeout, poll interval at least it, delivery timeout past linger + request."""
    def value(name: str) -> int | None:
        return _as_int(_get(section, KafkaConfig, name))

    session, heartbeat, max_poll = value("session_timeout_ms"), value("heartbeat_interval_ms"), value("max_poll_interval_ms")
    linger, delivery, request = value("producer_linger_ms"), value("delivery_timeout_ms"), value("request_timeout_ms")
    problems: list[Problem] = []
    if session is not None and heartbeat is not None and heartbeat >= session:
        problems.append(
            (
                "heartbeat_interval_ms",
                heartbeat,
                f"must be lower than session_timeout_ms ({session}); Kafka recommends at most a third of it",
            )
        )
    if session is not None and max_poll is not None and max_poll < session:
        problems.append(("max_poll_interval_ms", max_poll, f"must be at least session_timeout_ms ({session})"))
    if None not in (linger, delivery, request) and delivery < linger + request:  # type: ignore[operator]
        problems.append(
            (
                "delivery_timeout_ms",
                delivery,
                f"must be at least producer_linger_ms + request_timeout_ms ({linger + request})",  # type: ignore[operator]
            )
        )
    return problems
