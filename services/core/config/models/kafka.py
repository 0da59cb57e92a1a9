"""The Kafka sections: how to reach a cluster, and the client tuning every service shares.

``KafkaConnection`` is a cluster's address, security and topic prefix, and
the only place its secrets are revealed (``client_settings``);
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

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from ...topics import TopicNames
from ..base import (
    ENV_NAME_PATTERN,
    TOPIC_PREFIX_PATTERN,
    Problem,
    _as_int,
    _existing_file,
    _get,
    _invalid,
    _Model,
    _raise_rules,
)
from ..secrets import _read_env, _read_secret, _secret_source_problems, _shown

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

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
        None, description="required with SASL_PLAINTEXT and SASL_SSL", json_schema_extra={"kafka": "sasl.username"})
    sasl_password: SecretStr | None = Field(
        None, description="the SASL password; with SASL, exactly one of sasl_password, sasl_password_file or "
        "sasl_password_env is required", json_schema_extra={"kafka": "sasl.password"})
    sasl_password_file: str | None = Field(
        None, description="a file holding the SASL password (a mounted Kubernetes secret), read each time a "
        "client is made, so a rotated secret is picked up")
    sasl_password_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="the name of an environment variable holding the SASL password "
        "(e.g. set from a Kubernetes secret with secretKeyRef); it must be set and not empty")
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
    ssl_key_password_file: str | None = Field(
        None, description="a file holding ssl_key_password, read each time a client is made")
    ssl_key_password_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="the name of an environment variable holding ssl_key_password")
    topic_prefix: str = Field(
        "sluice.", pattern=TOPIC_PREFIX_PATTERN, description="the start of every Sluice topic name on this cluster, "
        "so several sites or installations can share one")

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

    @field_validator("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "sasl_password_file",
                     "ssl_key_password_file")
    @classmethod
    def _check_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _existing_file(value, info)

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
        }
        if self.sasl_mechanism is not None:
            settings["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            settings["sasl.username"] = self.sasl_username
        sasl_password = self._secret("sasl_password")
        if sasl_password is not None:
            settings["sasl.password"] = sasl_password
        if self.ssl_ca_location is not None:
            settings["ssl.ca.location"] = self.ssl_ca_location
        if self.ssl_certificate_location is not None:
            settings["ssl.certificate.location"] = self.ssl_certificate_location
        if self.ssl_key_location is not None:
            settings["ssl.key.location"] = self.ssl_key_location
        ssl_key_password = self._secret("ssl_key_password")
        if ssl_key_password is not None:
            settings["ssl.key.password"] = ssl_key_password
        return settings

    def _secret(self, name: str) -> str | None:
        """The secret ``name`` read now from whichever of its three sources the file gives, or None."""
        value: SecretStr | None = getattr(self, name)
        if value is not None:
            return value.get_secret_value()
        path: str | None = getattr(self, f"{name}_file")
        if path is not None:
            return _read_secret(path, f"{self._SECTION}.{name}_file")
        variable: str | None = getattr(self, f"{name}_env")
        if variable is not None:
            return _read_env(variable, f"{self._SECTION}.{name}_env")
        return None

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
    """SASL settings only with SASL, and all of them there; TLS settings only with TLS, certificate with key."""
    protocol = _get(section, KafkaConnection, "security_protocol")
    if not isinstance(protocol, str):
        return []
    problems: list[Problem] = []
    sasl = ("sasl_mechanism", "sasl_username", "sasl_password", "sasl_password_file", "sasl_password_env")
    ssl = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password",
           "ssl_key_password_file", "ssl_key_password_env")
    if protocol.startswith("SASL_"):
        for name in ("sasl_mechanism", "sasl_username"):
            if section.get(name) is None:
                problems.append((name, None, f"is required when security_protocol is {protocol}"))
        if all(section.get(n) is None for n in ("sasl_password", "sasl_password_file", "sasl_password_env")):
            problems.append(("sasl_password", None, f"is required when security_protocol is {protocol} "
                                                    "(or sasl_password_file: a file holding it, or "
                                                    "sasl_password_env: an environment variable holding it)"))
        problems += _secret_source_problems(section, "sasl_password")
    else:
        for name in sasl:
            if section.get(name) is not None:
                problems.append(
                    (
                        name,
                        _shown(name, section[name]),
                        f"is only used with SASL_PLAINTEXT or SASL_SSL, and security_protocol is {protocol}",
                    )
                )
    if protocol not in ("SSL", "SASL_SSL"):
        for name in ssl:
            if section.get(name) is not None:
                problems.append(
                    (
                        name,
                        _shown(name, section[name]),
                        f"is only used with SSL or SASL_SSL, and security_protocol is {protocol}",
                    )
                )
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
