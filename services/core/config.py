"""The site configuration: one declarative file per site (DESIGN §5).

``load_config(path)`` reads a YAML (``.yaml``/``.yml``) or TOML (``.toml``)
file and returns a frozen ``SiteConfig``; ``parse_config(data)`` does the same
for a mapping already in memory.  A bad file never half-loads: the result is
a ``ConfigError`` whose ``problems`` list *every* problem found, each as
``(dotted field path, value, reason)``, for example::

    gateway_senders[0].batch_size: must be >= 1 (got 0)

Validation happens in three layers, and all three report in that shape:

1. per field (types, ranges, patterns, unknown keys with a "did you mean"),
   done by pydantic and translated by ``_problems_from_validation``;
2. per section (Geode's own rules, e.g. a parallel sender cannot use the
   THREAD order policy), raised by the section's model as a list of problems;
3. across sections (unique ids, references from regions to senders and
   queues, colocation of parallel queues, topic name collisions), done by
   ``_site_problems`` on plain data, so it runs even when layer 1 failed
   elsewhere in the file and the user sees everything at once.

Defaults are Geode's (see GEODE-FACTS.md) except where Kafka needs its own
(consumer-group timeouts tuned for fast failover).  Values are strict: a
quoted ``"8"`` is not a number and ``yes`` is not a boolean, because a site
file that says something other than what it means is worse than one that
does not load.
"""

from __future__ import annotations

import copy
import difflib
import hmac
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from . import sitekeys
from .errors import ConfigError, InvalidRequest, UnknownRegion
from .topics import TopicNames

__all__ = [
    "AsyncEventQueueConfig",
    "AttachedQueue",
    "GatewaySenderConfig",
    "KafkaConfig",
    "KafkaConnection",
    "ListenerConfig",
    "OrderPolicy",
    "Problem",
    "ReceiverConfig",
    "RegionConfig",
    "RegionServiceConfig",
    "RemoteSiteConfig",
    "SiteConfig",
    "SubscriptionsConfig",
    "check_import_path",
    "load_config",
    "parse_config",
]

Problem = tuple[str, Any, str]
"""(dotted field path, value, reason) — the shape ``ConfigError.problems`` holds."""

OrderPolicy = Literal["KEY", "THREAD", "PARTITION"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

SITE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,40}$"
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,100}$"
# Kafka's legal topic characters; 100 keeps every derived name under Kafka's
# 249-character limit (the longest suffix is "queue.<101 chars>.removals").
TOPIC_PREFIX_PATTERN = r"^[A-Za-z0-9._-]{0,100}$"
# POSIX's portable environment variable names (what Kubernetes' env: accepts).
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

_PATTERN_REASONS = {
    SITE_PATTERN: "must be 1 to 41 lowercase letters, digits or '-', starting with a letter or digit",
    NAME_PATTERN: "must start with a letter and hold only letters, digits, '_' or '-' (at most 101 characters)",
    TOPIC_PREFIX_PATTERN: "may hold only letters, digits, '.', '_' or '-' (legal Kafka topic characters), at most 100",
    ENV_NAME_PATTERN: "must be an environment variable name: letters, digits and '_', not starting with a digit",
}

#: Fields whose values are never shown, not even in an error.  Each may
#: instead be given as ``<field>_file`` (a file holding it) or ``<field>_env``
#: (the name of an environment variable holding it): see "Secrets" below.
_SECRET_FIELDS = frozenset({"sasl_password", "ssl_key_password", "token", "member_token", "gateway_private_key",
                            # Removed settings, still never shown when a file gives them.
                            "gateway_signing_key", "sender_keys"})
_HIDDEN = "**********"

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# "pkg.mod:Class" (attribute path after the colon) or "pkg.mod.Class".
_IMPORT_PATH = re.compile(rf"^{_IDENT}(\.{_IDENT})*(:{_IDENT}(\.{_IDENT})*|\.{_IDENT})$")
_MEMBER_HOST = re.compile(r"^([0-9A-Fa-f:.]+/\d{1,3}|[0-9A-Fa-f:.]+|[A-Za-z0-9*]([A-Za-z0-9*_.-]*[A-Za-z0-9*])?)$")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)$")


def _invalid(reason: str) -> PydanticCustomError:
    """A field-level error whose text is ``reason`` (braces in it are safe)."""
    return PydanticCustomError("sluice_invalid", "{reason}", {"reason": reason})


def _raise_rules(problems: list[Problem]) -> None:
    """Raise a section's rule problems, each naming a field relative to the section."""
    if problems:
        raise PydanticCustomError("sluice_problems", "{count} problem(s)", {"count": len(problems), "problems": problems})


class _Model(BaseModel):
    # strict: no "8" → 8 or "yes" → True coercion (see the module docstring).
    # Sequence fields relax strictness for the container only (``_seq``) so a
    # YAML list can fill a tuple; their items stay strict.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=False)


def _seq(default: Any = (), **kwargs: Any) -> Any:
    """A tuple field that accepts a list (YAML and TOML have no tuples)."""
    return Field(default, strict=False, **kwargs)


def check_import_path(value: str) -> str:
    """Accept ``pkg.mod:Class`` or ``pkg.mod.Class``; the target is not imported here."""
    if not _IMPORT_PATH.match(value):
        raise _invalid("must be an import path like 'package.module:ClassName' or 'package.module.ClassName'")
    return value


# --- secrets -----------------------------------------------------------------
#
# Every secret X of a site file (the fields in _SECRET_FIELDS) may come from
# one of three sources, whichever suits the deployment:
#
#   X:       the value, in the site file itself (then keep the file secret);
#   X_file:  a file holding it (a mounted Kubernetes secret), relative to the
#            site file: its content without the trailing newline;
#   X_env:   the name of an environment variable holding it (Kubernetes'
#            env.valueFrom.secretKeyRef), which must be set and not empty.
#
# Giving two is an error.  The Kafka passwords are read from their source each
# time a client is made (KafkaConnection.client_settings), so a rotated
# mounted secret reaches the next client; the services' tokens and
# gateway_private_key are read once, when the file is loaded (a service reads
# them when it starts).  Either way a source that cannot be read is a
# ConfigError naming the field and the file or variable, and the value is
# never shown: SecretStr masks it in reprs and _shown in errors.  The other
# sites' public keys are not secret: gateway_public_keys (dsid → key) has the
# map gateway_public_keys_file (dsid → file) beside it, each dsid in one of them.


def _existing_file(value: str, info: ValidationInfo) -> str:
    """``value`` as an absolute path to an existing file, relative to the site file's folder."""
    # Relative paths are taken from the site file's folder, not from wherever
    # the service happens to be started, and stored absolute because
    # librdkafka would resolve them against the working directory.
    base = Path((info.context or {}).get("base_dir") or Path.cwd())
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    if not path.is_file():
        raise _invalid(f"no such file: {path}")
    return str(path.resolve())


def _read_secret(path: str, field: str) -> str:
    """A secret kept in a file: its content without the trailing newline."""
    try:
        value = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ConfigError([(field, path, f"cannot be read: {exc.strerror or exc}")]) from None
    if not value:
        raise ConfigError([(field, path, "the file is empty")])
    return value


def _read_env(variable: str, field: str) -> str:
    """A secret kept in the environment variable ``variable``, without a trailing newline."""
    value = os.environ.get(variable)
    if value is None:
        raise ConfigError([(field, variable, f"the environment variable {variable} is not set")])
    value = value.rstrip("\r\n")
    if not value:
        raise ConfigError([(field, variable, f"the environment variable {variable} is empty")])
    return value


def _secret_source_problems(section: Mapping[str, Any], name: str) -> list[Problem]:
    """At most one source for the secret ``name``, and its environment variable set.

    The file's existence is checked by the field itself; the variable is
    checked here so that ``sluice config check`` run where the service runs
    (the chart's init step) finds a missing one before the service does.
    """
    sources = (name, f"{name}_file", f"{name}_env")
    given = [source for source in sources if section.get(source) is not None]
    problems: list[Problem] = []
    if len(given) == 2:
        problems.append((given[1], section[given[1]], f"give {given[0]} or {given[1]}, not both"))
    elif len(given) == 3:
        problems.append((given[2], section[given[2]], f"give one of {', '.join(sources)}, not several"))
    variable = section.get(f"{name}_env")
    if isinstance(variable, str) and re.match(ENV_NAME_PATTERN, variable):
        try:
            _read_env(variable, f"{name}_env")
        except ConfigError as exc:
            problems.extend(exc.problems)
    return problems


def _resolve_secret(data: Any, name: str, info: ValidationInfo) -> Any:
    """``data`` with the secret ``name`` read from ``name_file`` or ``name_env`` when one is given.

    For a model's before-validator: the value lands in the field the services
    read, so they need not know where it came from.  A value of the wrong type
    is left for the field's own check to report.
    """
    if not isinstance(data, Mapping):
        return data
    _raise_rules(_secret_source_problems(data, name))
    path, variable = data.get(f"{name}_file"), data.get(f"{name}_env")
    try:
        if isinstance(path, str):
            return {**data, name: _read_secret(_existing_file(path, info), f"{name}_file")}
        if isinstance(variable, str) and re.match(ENV_NAME_PATTERN, variable):
            return {**data, name: _read_env(variable, f"{name}_env")}
    except PydanticCustomError as exc:  # _existing_file: no such file
        _raise_rules([(f"{name}_file", path, str(exc))])
    except ConfigError as exc:
        _raise_rules(exc.problems)
    return data


_PUBLIC_KEY_MAPS = ("gateway_public_keys", "gateway_public_keys_file")


def _resolve_public_keys(data: Any, info: ValidationInfo) -> Any:
    """The site's ``data`` with gateway_public_keys completed from gateway_public_keys_file."""
    if not isinstance(data, Mapping):
        return data
    data = {name: _by_dsid(value) if name in _PUBLIC_KEY_MAPS else value for name, value in data.items()}
    keys, files = (data.get(name) for name in _PUBLIC_KEY_MAPS)
    if not all(value is None or isinstance(value, Mapping) for value in (keys, files)) or not files:
        return data  # the fields' own checks report a map that is not one
    _raise_rules(_public_key_problems(data))
    merged = dict(keys or {})
    problems: list[Problem] = []
    # A dsid that is not a number, or a path that is not text, is left for the field's own check to report.
    for dsid, path in files.items():
        if isinstance(dsid, int) and isinstance(path, str):
            try:
                merged[dsid] = _read_secret(_existing_file(path, info), f"gateway_public_keys_file[{dsid}]")
            except PydanticCustomError as exc:  # _existing_file: no such file
                problems.append((f"gateway_public_keys_file[{dsid}]", path, str(exc)))
            except ConfigError as exc:
                problems.extend(exc.problems)
    _raise_rules(problems)
    return {**data, "gateway_public_keys": merged}


def _public_key_problems(section: Mapping[str, Any]) -> list[Problem]:
    """Each dsid's public key given once, in gateway_public_keys or gateway_public_keys_file."""
    maps = [(name, section.get(name)) for name in _PUBLIC_KEY_MAPS]
    if any(value is not None and not isinstance(value, Mapping) for _, value in maps):
        return []  # the field's own check reports a map that is not one
    given_in: dict[Any, str] = {}
    problems: list[Problem] = []
    for name, sources in maps:
        for dsid, source in (sources or {}).items():
            if _dsid_key(dsid) in given_in:
                problems.append((f"{name}[{dsid}]", source, f"dsid {dsid} already has its key in "
                                 f"{given_in[_dsid_key(dsid)]}; give each dsid's key once"))
                continue
            given_in[_dsid_key(dsid)] = name
    return problems


#: Settings a site file may no longer give, each with what replaced it.
_REMOVED = {
    "gateway_signing_key": "gateway batches are signed with the site's Ed25519 key: set gateway_private_key "
                           "(`sluice keys generate`) and give the other sites its public key in their "
                           "gateway_public_keys",
    "receiver.sender_keys": "the receiver verifies batches with the sending sites' Ed25519 public keys: "
                            "give them in gateway_public_keys (dsid -> key) at the top of the site file",
}


def _removed_problems(data: Mapping[str, Any]) -> list[Problem]:
    """A problem for each removed setting the raw file data still gives."""
    problems: list[Problem] = []
    for name in ("gateway_signing_key", "gateway_signing_key_file", "gateway_signing_key_env"):
        if name in data:
            problems.append((name, _shown("gateway_signing_key", data[name]),
                             f"was removed: {_REMOVED['gateway_signing_key']}"))
    receiver = data.get("receiver")
    if isinstance(receiver, Mapping):
        for name in ("sender_keys", "sender_keys_file", "sender_keys_env"):
            if name in receiver:
                problems.append((f"receiver.{name}", _shown("sender_keys", receiver[name]),
                                 f"was removed: {_REMOVED['receiver.sender_keys']}"))
    return problems


def _by_dsid(value: Any) -> Any:
    """A map keyed by dsid with TOML's string keys ("2", TOML has no other) made numbers."""
    return {_dsid_key(k): v for k, v in value.items()} if isinstance(value, Mapping) else value


def _dsid_key(dsid: Any) -> Any:
    """A dsid as YAML (1) and TOML ("1") write a map key, made comparable."""
    return int(dsid) if isinstance(dsid, str) and dsid.isdigit() else dsid


# --- Kafka -----------------------------------------------------------------


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


# --- regions and queues -----------------------------------------------------


class RegionConfig(_Model):
    """A region: a keyed map whose buckets are its topics' partitions."""

    name: str = Field(pattern=NAME_PATTERN, description="the region's name, unique in the site; names its "
                      "changelog topic", json_schema_extra={"geode": "region name"})
    buckets: int = Field(
        113, ge=1, le=1024, description="buckets: the partitions of the region's changelog (and of every "
        "parallel queue attached to it); a key's bucket is Kafka's murmur2 partition of the key",
        json_schema_extra={"geode": "total-num-buckets"})
    gateway_senders: tuple[str, ...] = _seq(
        description="ids of the gateway senders this region's events go to",
        json_schema_extra={"geode": "gateway-sender-ids"})
    async_event_queues: tuple[str, ...] = _seq(
        description="ids of the async event queues this region's events go to",
        json_schema_extra={"geode": "async-event-queue-ids"})
    redundant_copies: int = Field(
        0, ge=0, le=3, description="standby copies of each bucket kept by other region-service instances, which "
        "tail the bucket's changelog; on failover the group's new owner, when it holds a copy, reads only what "
        "its copy has not read yet instead of the whole bucket. Each copy costs the bucket's memory again on "
        "its instance", json_schema_extra={"geode": "redundant-copies"})
    key_max_bytes: int = Field(1024, ge=1, description="the largest key accepted, in UTF-8 bytes")
    value_max_bytes: int = Field(
        900_000, ge=1, description="the largest value accepted, in bytes (under Kafka's default 1 MB message size)")


def _refuse_persistent(value: Any) -> Any:
    """Geode's queue persistence is not a setting here, in either direction: a queue is a Kafka topic,
    replicated and durable whatever the file says (what Geode's persistent queue gives), and a queue held
    in memory only (Geode's default) cannot be had.  A file that gives it is refused, whatever the value,
    rather than have it accepted and change nothing."""
    raise _invalid(PERSISTENT_REFUSED)


#: Why ``forward_expiration_destroy: true`` of an async event queue is refused.
EXPIRATION_REFUSED = ("not supported, because regions have no entry expiration (no entry-time-to-live or "
                      "entry-idle-time), so no expiration destroy ever happens to forward; leave it false")

#: Why ``persistent`` of a gateway sender or async event queue is refused.
PERSISTENT_REFUSED = ("not supported, because a queue is a Kafka topic and always durable: it outlives every "
                      "restart, as Geode's persistent=true queue does; Geode's default false, a queue in memory "
                      "that a restart of every member loses, has no equivalent. Remove the setting")


class GatewaySenderConfig(_Model):
    """A gateway sender (Geode defaults): a queue whose events go to a remote site."""

    id: str = Field(pattern=NAME_PATTERN, description="the sender's id, unique among the site's senders and "
                    "async event queues; names its queue topics", json_schema_extra={"geode": "id"})
    remote_dsid: int = Field(ge=1, le=255, description="the dsid of the site this sender sends to",
                             json_schema_extra={"geode": "remote-distributed-system-id"})
    parallel: bool = Field(
        False, description="true: one queue partition per region bucket, every member primary for some; "
        "false (serial): one primary for the whole queue", json_schema_extra={"geode": "parallel"})
    batch_size: int = Field(100, ge=1, description="a batch is sent when it holds this many events",
                            json_schema_extra={"geode": "batch-size"})
    batch_time_interval_ms: int = Field(
        1000, ge=0, description="… or when this long has passed since its first event, whichever comes first",
        json_schema_extra={"geode": "batch-time-interval"})
    batch_conflation: bool = Field(
        False, description="an update of a key replaces the earlier update of that key still waiting in the batch",
        json_schema_extra={"geode": "enable-batch-conflation"})
    dispatcher_threads: int = Field(
        5, ge=1, le=1024, description="a serial sender's queue partitions (a parallel one has its region's buckets)",
        json_schema_extra={"geode": "dispatcher-threads"})
    order_policy: OrderPolicy = Field(
        "KEY", description="how a serial queue's events are spread over its partitions: by key, by writing "
        "thread, or by the region bucket; a parallel sender cannot use THREAD",
        json_schema_extra={"geode": "order-policy"})
    persistent: bool | None = Field(
        None, description="refused, whatever its value: a queue is a Kafka topic and always durable (Geode's "
        "enable-persistence true); a queue kept in memory only (Geode's default false) cannot be had",
        json_schema_extra={"geode": "enable-persistence"})
    maximum_queue_memory_mb: int = Field(
        100, ge=1, description="what a sender holds in memory; beyond it, it stops reading until batches are "
        "removed (the rest waits in Kafka)", json_schema_extra={"geode": "maximum-queue-memory"})
    alert_threshold_ms: int = Field(
        0, ge=0, description="log an alert while the queue's oldest event is older than this; 0 = no alert",
        json_schema_extra={"geode": "alert-threshold"})
    socket_read_timeout_ms: int = Field(
        0, ge=0, description="a batch not acknowledged within this is sent again; 0 = wait for an ack forever",
        json_schema_extra={"geode": "socket-read-timeout"})
    manual_start: bool = Field(
        False, description="true: the sender starts stopped, until `sluice admin start`",
        json_schema_extra={"geode": "manual-start"})
    group_transaction_events: bool = Field(
        False, description="the events of one put_all / remove_all in a bucket travel in one batch; not with "
        "batch_conflation, and a serial sender needs dispatcher_threads 1",
        json_schema_extra={"geode": "group-transaction-events"})
    retry_interval_ms: int = Field(
        5000, ge=1, description="longest wait between two attempts to send a batch the remote site did not take "
        "(Geode: 5 s)")
    max_batches_in_flight: int = Field(
        4, ge=1, le=64,
        description="batches of a queue partition sent and waiting for their acks at once; removal stays in order")
    event_filters: tuple[str, ...] = _seq(
        description="import paths of classes with before_enqueue, before_transmit and/or after_acknowledgement",
        json_schema_extra={"geode": "gateway-event-filter"})
    event_substitution_filter: str | None = Field(
        None, description="import path of a class whose get_substitute_value(event) replaces the value queued "
        "and sent", json_schema_extra={"geode": "gateway-event-substitution-filter"})
    remote: RemoteSiteConfig | None = Field(
        None, description="the remote site's Kafka cluster and topic prefix, where batches are written and acks "
        "read (Geode finds the remote site through its locators)")

    _check_persistent = field_validator("persistent", mode="before")(_refuse_persistent)

    @field_validator("event_filters")
    @classmethod
    def _check_filters(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [v for v in value if not _IMPORT_PATH.match(v)]
        if bad:
            raise _invalid(
                f"{bad[0]!r} is not an import path like 'package.module:ClassName' or 'package.module.ClassName'"
            )
        return value

    @field_validator("event_substitution_filter")
    @classmethod
    def _check_substitution(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value)

    @model_validator(mode="after")
    def _check_geode_rules(self) -> GatewaySenderConfig:
        _raise_rules(_sender_rules(self.model_dump()))
        return self


class ListenerConfig(_Model):
    """The async event listener an async event queue delivers batches to."""

    type: Literal["sql", "kafka", "python"] = Field(
        description="sql: write-behind to PostgreSQL or SQLite; kafka: forward to a downstream topic; python: "
        "your class")
    class_path: str | None = Field(
        None, description="with type python: import path of the listener class, or an entry point of the group "
        "sluice.listeners", json_schema_extra={"geode": "async-event-listener class-name"})
    settings: dict[str, Any] = Field(
        default_factory=dict, strict=False, description="handed to the listener's init(config) as "
        "config['settings']; the sql and kafka listeners check theirs",
        json_schema_extra={"geode": "async-event-listener parameter"})

    @field_validator("class_path")
    @classmethod
    def _check_class_path(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value)

    @model_validator(mode="after")
    def _check_type(self) -> ListenerConfig:
        _raise_rules(_listener_rules(self.model_dump()))
        return self


class AsyncEventQueueConfig(_Model):
    """An async event queue (Geode defaults): a queue whose events go to a listener."""

    id: str = Field(pattern=NAME_PATTERN, description="the queue's id, unique among the site's senders and "
                    "async event queues; names its topics", json_schema_extra={"geode": "id"})
    parallel: bool = Field(
        False, description="true: one queue partition per region bucket, every dispatcher primary for some; "
        "false (serial): dispatcher_threads partitions", json_schema_extra={"geode": "parallel"})
    batch_size: int = Field(100, ge=1, description="a batch is offered to the listener when it holds this many "
                            "events", json_schema_extra={"geode": "batch-size"})
    batch_time_interval_ms: int = Field(
        5, ge=0, description="… or when this long has passed since its first event, whichever comes first",
        json_schema_extra={"geode": "batch-time-interval"})
    batch_conflation: bool = Field(
        False, description="an update of a key replaces the earlier update of that key still waiting in the batch",
        json_schema_extra={"geode": "enable-batch-conflation"})
    dispatcher_threads: int = Field(
        5, ge=1, le=1024, description="a serial queue's partitions; batches offered at once",
        json_schema_extra={"geode": "dispatcher-threads"})
    order_policy: OrderPolicy = Field(
        "KEY", description="how a serial queue's events are spread over its partitions: by key, by writing "
        "thread, or by the region bucket; a parallel queue cannot use THREAD",
        json_schema_extra={"geode": "order-policy"})
    persistent: bool | None = Field(
        None, description="refused, whatever its value: a queue is a Kafka topic and always durable (Geode's "
        "persistent true); a queue kept in memory only (Geode's default false) cannot be had",
        json_schema_extra={"geode": "persistent"})
    maximum_queue_memory_mb: int = Field(
        100, ge=1, description="what a dispatcher holds in memory; beyond it, it stops reading until batches are "
        "removed (the rest waits in Kafka)", json_schema_extra={"geode": "maximum-queue-memory"})
    pause_event_processing: bool = Field(
        False, description="true: the queue starts paused (events queue up) until `sluice admin resume`",
        json_schema_extra={"geode": "pause-event-processing"})
    forward_expiration_destroy: bool = Field(
        False, description="true is refused: regions have no entry expiration (no entry-time-to-live or "
        "entry-idle-time), so there is no expiration destroy to forward; false, Geode's default, is what happens",
        json_schema_extra={"geode": "forward-expiration-destroy"})
    listener: ListenerConfig | None = Field(
        None, description="where the batches go", json_schema_extra={"geode": "async-event-listener"})

    _check_persistent = field_validator("persistent", mode="before")(_refuse_persistent)

    @field_validator("forward_expiration_destroy")
    @classmethod
    def _refuse_expiration(cls, value: bool) -> bool:
        if value:
            raise _invalid(EXPIRATION_REFUSED)
        return value

    @model_validator(mode="after")
    def _check_geode_rules(self) -> AsyncEventQueueConfig:
        _raise_rules(_queue_rules(self.model_dump()))
        return self


# --- receiver, subscriptions, region service ---------------------------------


class ReceiverConfig(_Model):
    """This site's gateway receiver: the only entry point for remote sites."""

    inbound_partitions: int = Field(
        8, ge=1, le=1024, description="partitions of this site's inbound topic, which remote senders write "
        "batches to: the receiver's lanes working side by side (Geode: the receiver's port range)")
    accepted_dsids: tuple[Annotated[int, Field(ge=1, le=255)], ...] = _seq(
        description="dsids whose batches are applied; batches from any other site are rejected and counted"
    )
    max_time_between_pings_ms: int = Field(
        60000, ge=1, description="a remote sender none of whose batches reached a receiver process for this long "
        "is shown not connected (sluice admin status, the gauge sluice.gateway.sender.connected) until its next "
        "batch. Senders reach the receiver through Kafka and send nothing while their queue is empty: a batch is "
        "the ping, so an idle sender shows as not connected too",
        json_schema_extra={"geode": "maximum-time-between-pings"})
    manual_start: bool = Field(
        False, description="true: receiver processes start stopped, outside the inbound topic's consumer group, "
        "applying nothing until `sluice admin -c FILE start --receiver` (which `stop --receiver` undoes); the "
        "control topic's last word wins over this at every start", json_schema_extra={"geode": "manual-start"})
    batch_max_age_ms: int = Field(
        86_400_000, ge=1000, description="a batch sent longer ago than this (its created_at; every send, resends "
        "included, stamps it anew) is rejected and dead-lettered, and so is one stamped later than now + "
        "region_service.max_clock_skew_ms: a signed batch recorded from the wire cannot be replayed once the acks "
        "that mark it a duplicate have expired. Keep it below the gateway acks topic's retention")
    apply_events_max: int = Field(
        1000, ge=1, le=10_000, description="the most events the receiver hands the region service in one call; a "
        "larger batch (a sender's batch_size, or a grouped transaction) is applied in several calls, in order, "
        "never refused for its size")

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            _raise_rules([(field.removeprefix("receiver."), value, reason)
                          for field, value, reason in _removed_problems({"receiver": data})])
        return data


class SubscriptionsConfig(_Model):
    """Client subscription queues (Geode's client/server messaging defaults)."""

    durable_client_timeout_s: int = Field(
        300, ge=1, description="how long a durable client's queue and durable interest outlive its disconnect; "
        "then they are deleted and an alert is logged", json_schema_extra={"geode": "durable-client-timeout"})
    message_sync_interval_s: int = Field(
        1, ge=1, description="how often a primary checkpoints what it filled and deletes from each queue what "
        "its client acknowledged", json_schema_extra={"geode": "message-sync-interval"})
    message_time_to_live_s: int = Field(
        180, ge=1, description="a non-durable client's queue whose unacknowledged head is older than this is "
        "dropped; the client re-fetches its interest", json_schema_extra={"geode": "message-time-to-live"})
    subscription_message_tracking_timeout_ms: int = Field(
        900000, ge=1, description="how long a client remembers a writer thread's EventIDs to discard repeats",
        json_schema_extra={"geode": "subscription-message-tracking-timeout"})
    subscription_ack_interval_ms: int = Field(
        100, ge=1, description="how often a client acknowledges what it received",
        json_schema_extra={"geode": "subscription-ack-interval"})
    maximum_message_count: int = Field(
        230000, ge=1, description="the most messages a client's queue holds that its client has not acknowledged; "
        "an event that finds it full is not queued (counted), and the client is unregistered with an alert and "
        "resynchronises (a durable client away finds its queue dropped: pending_event_count -1)",
        json_schema_extra={"geode": "maximum-message-count"})
    maximum_time_between_pings_ms: int = Field(
        60000, ge=1, description="a connected client silent this long is taken as crashed",
        json_schema_extra={"geode": "maximum-time-between-pings"})
    ping_interval_ms: int = Field(10000, ge=1, description="how often an idle client pings",
                                  json_schema_extra={"geode": "ping-interval"})
    registry_partitions: int = Field(
        8, ge=1, le=1024, description="partitions of the client registry: the units subscription instances share "
        "as primaries")
    token: SecretStr | None = Field(
        None, description="when set, a client registration (its record on the registry topic) is taken only with "
        "the record header `authorization: Bearer <token>`, and refused with a message to the client otherwise; "
        "the site's clients send it")
    token_file: str | None = Field(
        None, description="a file holding token (relative to the site file), read when the site file is loaded")
    token_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="the name of an environment variable holding token, read when "
        "the site file is loaded")

    @model_validator(mode="before")
    @classmethod
    def _read_token(cls, data: Any, info: ValidationInfo) -> Any:
        return _resolve_secret(data, "token", info)

    @field_validator("token_file")
    @classmethod
    def _check_token_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _existing_file(value, info)


class RegionServiceConfig(_Model):
    """The region service's HTTP face."""

    host: str = Field("127.0.0.1", min_length=1, description="the address the HTTP API listens on",
                      json_schema_extra={"geode": "bind-address"})
    port: int = Field(7070, ge=0, le=65535, description="the HTTP API's port; 0 = any free port",
                      json_schema_extra={"geode": "port"})
    advertised_url: str | None = Field(
        None, description="URL other members and clients use to reach this one (default: http://host:port)",
        json_schema_extra={"geode": "hostname-for-clients"})
    token: SecretStr | None = Field(
        None, description="when set, every request but /healthz and /readyz needs `Authorization: Bearer <token>`; "
        "members and clients of the site send it")
    token_file: str | None = Field(
        None, description="a file holding token (relative to the site file), read when the site file is loaded")
    token_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="the name of an environment variable holding token, read when "
        "the site file is loaded")
    member_token: SecretStr | None = Field(
        None, min_length=16, description="the credential region-service instances use between themselves "
        "(forwarded operations and reads, /internal/*) and gateway receivers use to apply other sites' events "
        "(apply_remote); it also signs each instance's record of the buckets it owns on the status topic, so "
        "that no other writer of that topic can redirect requests. 16 characters or more, not the same as token; "
        "required when token is set")
    member_token_file: str | None = Field(
        None, description="a file holding member_token (relative to the site file), read when the site file is "
        "loaded")
    member_token_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="the name of an environment variable holding member_token, "
        "read when the site file is loaded")
    member_hosts: tuple[str, ...] = _seq(
        description="the hosts an instance's announced URL may name: IP networks (10.0.0.0/8) or host names, "
        "`*` matching any characters (*.orders.svc.cluster.local); a claim naming another host is ignored, so "
        "requests and the member token never go there. Empty: loopback and this instance's own host")
    allow_unauthenticated: bool = Field(
        False, description="let an instance bound to a host other than loopback start without token and "
        "member_token (anyone who reaches the port can then read and write every region)")
    max_clock_skew_ms: int = Field(
        60_000, ge=0, description="an event from another site stamped later than now + this is refused (and "
        "dead-lettered at its origin): a timestamp in the future would win every WAN conflict on its key")
    request_body_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="the largest request body accepted, checked before it is read "
        "(413 beyond it)")
    load_timeout_s: float = Field(
        60, gt=0, description="how long a member may take to rebuild a bucket from its changelog before it gives up")
    load_threads: int = Field(
        1, ge=1, le=32, description="buckets an instance loads from their changelogs at once (a thread and two "
        "Kafka readers each). Applying records holds Python's GIL, so more threads help only while loads wait "
        "on the broker: with the broker on the same 2 cores, 2 and 4 threads loaded 3-9 % slower than 1")
    store_dir: str | None = Field(
        None, description="the directory of this instance's local store of bucket state (relative paths: to the "
        "working directory). Unset: every bucket's entries are on the heap and a restart reads its buckets' "
        "changelogs from their start. Set: entries live in the store, only store_buffer_entries per bucket in "
        "memory, and a restart reads only what the changelog gained since the store was last clean. One "
        "instance per directory (sluice region --store-dir)", json_schema_extra={"geode": "disk-dirs"})
    store_max_mb: int = Field(
        65536, ge=16, le=1 << 24, description="the most the local store may grow to, in MiB: LMDB's map size "
        "(address space reserved, disk used only as written). Past it, writes stay in memory (counted "
        "in /stats as store_write_errors) and the buckets concerned are read from their changelogs on the next "
        "start", json_schema_extra={"geode": "disk-dir-size"})
    store_buffer_entries: int = Field(
        4096, ge=1, le=1_000_000, description="recent writes per bucket held in memory before they are written "
        "to the local store together: with the store, an instance's memory is about this times the buckets it "
        "owns or copies, whatever the region's size")
    store_checkpoint_interval_s: float = Field(
        5.0, gt=0, le=3600, description="how often each owned bucket whose writes are all committed is marked "
        "clean in the local store at its changelog position; a restart after a crash reads from there (a "
        "bucket handed over, or an instance stopped, is marked clean at once)")
    request_timeout_s: float = Field(
        30, gt=0, description="how long one request may take, including forwarding it to the bucket's owner")
    event_tracking_timeout_s: float = Field(
        900, gt=0, description="how long a (member, thread) EventID stream is remembered after its last operation"
    )

    @model_validator(mode="before")
    @classmethod
    def _read_token(cls, data: Any, info: ValidationInfo) -> Any:
        return _resolve_secret(_resolve_secret(data, "token", info), "member_token", info)

    @field_validator("token_file", "member_token_file")
    @classmethod
    def _check_token_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _existing_file(value, info)

    @field_validator("member_hosts")
    @classmethod
    def _check_member_hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for i, host in enumerate(value):
            if not _MEMBER_HOST.match(host):
                raise _invalid(f"member_hosts[{i}] {host!r} is neither an IP network (10.0.0.0/8, fd00::/8) nor a "
                               "host name (letters, digits, '.', '-', '*')")
            if "/" in host:
                try:
                    ipaddress.ip_network(host, strict=False)
                except ValueError as exc:
                    raise _invalid(f"member_hosts[{i}] {host!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _check_tokens(self) -> RegionServiceConfig:
        if self.token is not None and self.member_token is None:
            _raise_rules([("member_token", None, "is required when token is set (or member_token_file, "
                           "member_token_env): instances and receivers call one another with it, never with the "
                           "clients' token")])
        if (self.token is not None and self.member_token is not None
                and hmac.compare_digest(self.token.get_secret_value(), self.member_token.get_secret_value())):
            _raise_rules([("member_token", _HIDDEN, "must differ from token: a client holding token must not be "
                           "able to forge other sites' events or another instance's requests")])
        return self

    @field_validator("advertised_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s:]+(:\d{1,5})?(/\S*)?$", value):
            raise _invalid("must be an http:// or https:// URL, e.g. http://orders-0.example:7070")
        return value


# --- the site ----------------------------------------------------------------


@dataclass(frozen=True)
class AttachedQueue:
    """A gateway sender or async event queue as a region's events see it."""

    id: str
    kind: Literal["gateway-sender", "async-event-queue"]
    parallel: bool
    #: The queue topic's partitions: the region's buckets for a parallel
    #: queue (co-partitioned), ``dispatcher_threads`` for a serial one.
    partitions: int
    order_policy: str
    topic: str


class SiteConfig(_Model):
    """One site: its dsid, its Kafka cluster, regions, queues, receiver and services."""

    site: str = Field(pattern=SITE_PATTERN, description="the site's name, in logs, metrics, member and client ids")
    dsid: int = Field(ge=1, le=255, description="the site's id, unique among the sites that exchange events",
                      json_schema_extra={"geode": "distributed-system-id"})
    kafka: KafkaConfig = Field(description="this site's Kafka cluster and the client settings every service shares")
    regions: tuple[RegionConfig, ...] = _seq(
        ..., min_length=1, description="the site's regions: at least one", json_schema_extra={"geode": "region"})
    gateway_senders: tuple[GatewaySenderConfig, ...] = _seq(
        description="queues whose events go to other sites", json_schema_extra={"geode": "gateway-sender"})
    async_event_queues: tuple[AsyncEventQueueConfig, ...] = _seq(
        description="queues whose events go to a listener", json_schema_extra={"geode": "async-event-queue"})
    receiver: ReceiverConfig | None = Field(
        None, description="this site's gateway receiver; none: the site takes no events from other sites",
        json_schema_extra={"geode": "gateway-receiver"})
    subscriptions: SubscriptionsConfig = Field(
        default_factory=SubscriptionsConfig, description="client subscription queues",
        json_schema_extra={"geode": "cache-server and pool subscription settings"})
    region_service: RegionServiceConfig = Field(
        default_factory=RegionServiceConfig, description="the region service's HTTP API",
        json_schema_extra={"geode": "cache-server"})
    gateway_private_key: SecretStr | None = Field(
        None, description="this site's Ed25519 private key (base64 of its 32-byte seed, or PEM): its gateway "
        "senders sign every batch and its receiver every ack with it; the other sites hold its public key in "
        "their gateway_public_keys (`sluice keys generate` makes a pair)")
    gateway_private_key_file: str | None = Field(
        None, description="a file holding gateway_private_key (relative to the site file), read when the site file "
        "is loaded")
    gateway_private_key_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="the name of an environment variable holding "
        "gateway_private_key, read when the site file is loaded")
    gateway_public_keys: dict[Annotated[int, Field(ge=1, le=255)], str] = Field(
        default_factory=dict, strict=False,
        description="dsid -> that site's Ed25519 public key (base64 of 32 bytes, or PEM; during a key rotation "
        "the old and the new, one per line, either verifies). The receiver applies "
        "only batches signed by their site's key (with any key given, every accepted dsid needs one); a gateway "
        "sender takes only acks signed by its remote site's key, when that key is given")
    gateway_public_keys_file: dict[Annotated[int, Field(ge=1, le=255)], str] = Field(
        default_factory=dict, strict=False,
        description="dsid -> a file holding that site's public key (relative to the site file), read when the "
        "site file is loaded; each dsid's key in one of gateway_public_keys, gateway_public_keys_file")
    gateway_conflict_resolver: str | None = Field(
        None, description="import path of a WAN conflict resolver class with on_event(event, helper); "
        "unset: the later timestamp wins, ties go to the higher dsid",
        json_schema_extra={"geode": "gateway-conflict-resolver"})

    @model_validator(mode="before")
    @classmethod
    def _read_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, Mapping):
            _raise_rules([p for p in _removed_problems(data) if not p[0].startswith("receiver.")])
        return _resolve_public_keys(_resolve_secret(data, "gateway_private_key", info), info)

    @field_validator("gateway_private_key_file")
    @classmethod
    def _check_key_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _existing_file(value, info)

    @field_validator("gateway_public_keys_file")
    @classmethod
    def _check_public_key_files(cls, value: dict[int, str], info: ValidationInfo) -> dict[int, str]:
        return {dsid: _existing_file(path, info) for dsid, path in value.items()}

    @field_validator("gateway_private_key")
    @classmethod
    def _check_private_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            try:
                sitekeys.load_private_key(value.get_secret_value())
            except sitekeys.KeyFormatError as exc:
                raise _invalid(str(exc)) from None
        return value

    @field_validator("gateway_public_keys")
    @classmethod
    def _check_public_keys(cls, value: dict[int, str]) -> dict[int, str]:
        for dsid, text in value.items():
            try:
                sitekeys.load_public_key(text)
            except sitekeys.KeyFormatError as exc:
                raise _invalid(f"the key of dsid {dsid}: {exc}") from None
        return value

    @field_validator("gateway_conflict_resolver")
    @classmethod
    def _check_resolver(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value)

    @model_validator(mode="after")
    def _check_site(self) -> SiteConfig:
        _raise_rules(_site_problems(self.model_dump()))
        return self

    # -- lookups --

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.kafka.topic_prefix)

    def region(self, name: str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise UnknownRegion(name)

    def sender(self, sender_id: str) -> GatewaySenderConfig:
        for sender in self.gateway_senders:
            if sender.id == sender_id:
                return sender
        raise InvalidRequest("gateway_sender", sender_id, "no such gateway sender in this site's configuration")

    def queue(self, queue_id: str) -> AsyncEventQueueConfig:
        """The async event queue ``queue_id``."""
        for queue in self.async_event_queues:
            if queue.id == queue_id:
                return queue
        raise InvalidRequest("async_event_queue", queue_id, "no such async event queue in this site's configuration")

    def attached_queues(self, region_name: str) -> list[AttachedQueue]:
        """The queues a region's events go to: its senders, then its async event queues, as listed."""
        region = self.region(region_name)
        names = self.topics
        out: list[AttachedQueue] = []
        for sender_id in region.gateway_senders:
            sender = self.sender(sender_id)
            out.append(
                AttachedQueue(
                    id=sender.id,
                    kind="gateway-sender",
                    parallel=sender.parallel,
                    partitions=region.buckets if sender.parallel else sender.dispatcher_threads,
                    order_policy=sender.order_policy,
                    topic=names.queue(sender.id),
                )
            )
        for queue_id in region.async_event_queues:
            queue = self.queue(queue_id)
            out.append(
                AttachedQueue(
                    id=queue.id,
                    kind="async-event-queue",
                    parallel=queue.parallel,
                    partitions=region.buckets if queue.parallel else queue.dispatcher_threads,
                    order_policy=queue.order_policy,
                    topic=names.queue(queue.id),
                )
            )
        return out

    def all_attached_queues(self) -> list[AttachedQueue]:
        """Every queue attached to at least one region, once: senders, then async event queues, in file order."""
        attached = {q.id: q for region in self.regions for q in self.attached_queues(region.name)}
        order = [s.id for s in self.gateway_senders] + [q.id for q in self.async_event_queues]
        return [attached[queue_id] for queue_id in order if queue_id in attached]

    def regions_of(self, queue_id: str) -> list[RegionConfig]:
        """The regions whose events go to the sender or async event queue ``queue_id``."""
        return [r for r in self.regions if queue_id in r.gateway_senders or queue_id in r.async_event_queues]

    def with_overrides(self, overrides: Mapping[str, Any]) -> SiteConfig:
        """A new, fully validated config with ``overrides`` deep-merged in.

        For tests and ``sluice demo``, e.g.
        ``cfg.with_overrides({"kafka": {"bootstrap_servers": broker.bootstrap}})``.
        Mappings merge key by key; anything else (lists included) replaces.
        """
        data = _deep_merge(_without_loaded_secrets(self.model_dump(exclude_unset=True)), overrides)
        return parse_config(data, source="<overrides>")

    def secret_sources(self) -> list[tuple[str, str]]:
        """(field, where its value comes from) for every secret this file sets; never the value itself."""
        out: list[tuple[str, str]] = []

        def add(field: str, section: BaseModel, name: str) -> None:
            variable, path = getattr(section, f"{name}_env"), getattr(section, f"{name}_file")
            if variable is not None:
                out.append((field, f"environment variable {variable}"))
            elif path is not None:
                out.append((field, f"file {path}"))
            elif getattr(section, name) is not None:
                out.append((field, "the site file"))

        connections: list[tuple[str, KafkaConnection]] = [("kafka", self.kafka)]
        connections += [(f"gateway_senders[{i}].remote", s.remote) for i, s in enumerate(self.gateway_senders)
                        if s.remote is not None]
        for where, connection in connections:
            add(f"{where}.sasl_password", connection, "sasl_password")
            add(f"{where}.ssl_key_password", connection, "ssl_key_password")
        add("region_service.token", self.region_service, "token")
        add("region_service.member_token", self.region_service, "member_token")
        add("subscriptions.token", self.subscriptions, "token")
        add("gateway_private_key", self, "gateway_private_key")
        return out


# --- rules within a section, on plain data -------------------------------------
#
# Each takes a section as a mapping: the model's dump when the model validates
# it, or the raw file data when something else in the file failed (then any
# value of the wrong type is skipped; the field check reports it).


def _get(section: Mapping[str, Any], model: type[BaseModel], name: str) -> Any:
    if name in section:
        return section[name]
    return model.model_fields[name].get_default(call_default_factory=True)


def _connection_rules(section: Mapping[str, Any]) -> list[Problem]:
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


def _order_policy_rules(kind: str, model: type[BaseModel], section: Mapping[str, Any]) -> list[Problem]:
    # Geode: "Parallel Gateway Sender / Async Event Queue can not be created
    # with OrderPolicy THREAD": a parallel queue is ordered per bucket, and a
    # thread's operations span buckets.
    if _get(section, model, "parallel") is True and _get(section, model, "order_policy") == "THREAD":
        return [
            (
                "order_policy",
                "THREAD",
                f"THREAD is not supported by a parallel {kind} (as in Geode): use KEY or PARTITION, or make it serial",
            )
        ]
    return []


def _sender_rules(section: Mapping[str, Any]) -> list[Problem]:
    problems = _order_policy_rules("gateway sender", GatewaySenderConfig, section)
    grouped = _get(section, GatewaySenderConfig, "group_transaction_events") is True
    if grouped and _get(section, GatewaySenderConfig, "batch_conflation") is True:
        problems.append(
            (
                "group_transaction_events",
                True,
                "cannot be combined with batch_conflation (as in Geode): conflation would drop events of a transaction",
            )
        )
    # GEODE-7971: grouping needs one dispatcher on a serial sender, or the
    # events of one transaction could leave through different threads.
    threads = _as_int(_get(section, GatewaySenderConfig, "dispatcher_threads"))
    if grouped and _get(section, GatewaySenderConfig, "parallel") is False and threads is not None and threads > 1:
        problems.append(
            (
                "group_transaction_events",
                True,
                f"needs dispatcher_threads 1 on a serial sender (as in Geode), not {threads}",
            )
        )
    return problems


def _queue_rules(section: Mapping[str, Any]) -> list[Problem]:
    return _order_policy_rules("async event queue", AsyncEventQueueConfig, section)


def _listener_rules(section: Mapping[str, Any]) -> list[Problem]:
    kind = section.get("type")
    class_path = section.get("class_path")
    if kind == "python" and class_path is None:
        return [("class_path", None, "is required when type is python")]
    if kind in ("sql", "kafka") and class_path is not None:
        return [("class_path", class_path, f"is only used when type is python, not {kind}")]
    return []


def _all_rule_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Every rule of every section of raw file data, with full field paths."""

    def under(prefix: str, problems: list[Problem]) -> list[Problem]:
        return [(_join(prefix, field), value, reason) for field, value, reason in problems]

    problems: list[Problem] = []
    kafka = data.get("kafka")
    if isinstance(kafka, Mapping):
        problems += under("kafka", _connection_rules(kafka) + _timing_rules(kafka))
    # The sources of the secrets read at load time (see "secrets" above).
    problems += _removed_problems(data)
    problems += _secret_source_problems(data, "gateway_private_key")
    problems += _public_key_problems(data)
    region_service = data.get("region_service")
    if isinstance(region_service, Mapping):
        problems += under("region_service", _secret_source_problems(region_service, "token")
                          + _secret_source_problems(region_service, "member_token"))
    subscriptions = data.get("subscriptions")
    if isinstance(subscriptions, Mapping):
        problems += under("subscriptions", _secret_source_problems(subscriptions, "token"))
    for i, sender in _entries(data, "gateway_senders"):
        problems += under(f"gateway_senders[{i}]", _sender_rules(sender))
        remote = sender.get("remote")
        if isinstance(remote, Mapping):
            problems += under(f"gateway_senders[{i}].remote", _connection_rules(remote))
    for i, queue in _entries(data, "async_event_queues"):
        problems += under(f"async_event_queues[{i}]", _queue_rules(queue))
        listener = queue.get("listener")
        if isinstance(listener, Mapping):
            problems += under(f"async_event_queues[{i}].listener", _listener_rules(listener))
    return problems + _site_problems(data)


# --- rules across sections, on plain data --------------------------------------


def _key_problems(data: Mapping[str, Any], dsid: int | None,
                  senders: list[tuple[int, Mapping[str, Any]]]) -> list[Problem]:
    """Signing is all or nothing for a site: once it has a private key or any other site's public key, it
    signs what it sends and verifies everything it takes, so every site it exchanges events with needs a key."""
    keys = {_dsid_key(d) for name in _PUBLIC_KEY_MAPS if isinstance(data.get(name), Mapping) for d in data[name]}
    private = any(data.get(f"gateway_private_key{s}") is not None for s in ("", "_file", "_env"))
    if not keys and not private:
        return []
    problems: list[Problem] = []
    if not private:
        problems.append(("gateway_private_key", None, "is required with gateway_public_keys: a site that "
                         "verifies others signs its own batches and acks (`sluice keys generate`)"))
    if dsid is not None and dsid in keys:
        problems.append((f"gateway_public_keys[{dsid}]", "...", "is this site's own dsid: list the other sites' "
                         "public keys; this site's own comes from gateway_private_key"))
    receiver = data.get("receiver")
    accepted = receiver.get("accepted_dsids") if isinstance(receiver, Mapping) else None
    missing = sorted({d for d in accepted if isinstance(d, int)} - keys) if isinstance(accepted, (list, tuple)) else []
    if missing:
        problems.append(("gateway_public_keys", sorted(keys), f"has no key for accepted dsid(s) {missing}: a "
                         "signing site verifies every batch it applies (receiver.accepted_dsids)"))
    for i, sender in senders:
        remote = _as_int(sender.get("remote_dsid"))
        if remote is not None and remote not in keys:
            problems.append((f"gateway_senders[{i}].remote_dsid", remote, f"has no key in gateway_public_keys: "
                             "a signing site verifies the acks of every site it sends to"))
    return problems


def _site_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Problems that span sections.

    Works on raw, possibly invalid data (anything of the wrong shape is
    skipped; layer 1 reports it), so these checks run even when a field
    elsewhere is wrong.
    """
    problems: list[Problem] = []
    dsid = _as_int(data.get("dsid"))
    regions = _entries(data, "regions")
    senders = _entries(data, "gateway_senders")
    aeqs = _entries(data, "async_event_queues")

    problems += _key_problems(data, dsid, senders)

    first_region: dict[str, int] = {}
    for i, region in regions:
        name = region.get("name")
        if not isinstance(name, str):
            continue
        if name in first_region:
            problems.append((f"regions[{i}].name", name, f"duplicate region name (regions[{first_region[name]}] has it)"))
        else:
            first_region[name] = i

    # Sender and queue ids share one namespace: each becomes a topic name.
    owner: dict[str, str] = {}
    sender_ids: dict[str, Mapping[str, Any]] = {}
    aeq_ids: dict[str, Mapping[str, Any]] = {}
    for key, entries, by_id in (("gateway_senders", senders, sender_ids), ("async_event_queues", aeqs, aeq_ids)):
        for i, entry in entries:
            queue_id = entry.get("id")
            if not isinstance(queue_id, str):
                continue
            if queue_id in owner:
                problems.append(
                    (
                        f"{key}[{i}].id",
                        queue_id,
                        f"duplicate id ({owner[queue_id]} has it; sender and async event queue ids share "
                        "one namespace because each names a topic)",
                    )
                )
                continue
            owner[queue_id] = f"{key}[{i}]"
            by_id[queue_id] = entry

    for i, sender in senders:
        remote = _as_int(sender.get("remote_dsid"))
        if remote is not None and remote == dsid:
            problems.append(
                (f"gateway_senders[{i}].remote_dsid", remote, f"must differ from this site's dsid ({dsid})")
            )

    # References from regions, and which regions each parallel queue spans.
    spans: dict[str, list[tuple[int, str, int]]] = {}
    for i, region in regions:
        for key, known, other, kind, other_key in (
            ("gateway_senders", sender_ids, aeq_ids, "gateway sender", "async_event_queues"),
            ("async_event_queues", aeq_ids, sender_ids, "async event queue", "gateway_senders"),
        ):
            refs = region.get(key)
            if not isinstance(refs, (list, tuple)):
                continue
            seen: set[str] = set()
            for j, ref in enumerate(refs):
                if not isinstance(ref, str):
                    continue
                where = f"regions[{i}].{key}[{j}]"
                if ref in seen:
                    problems.append((where, ref, "listed twice"))
                    continue
                seen.add(ref)
                if ref in known:
                    if known[ref].get("parallel") is True:
                        buckets = region.get("buckets", RegionConfig.model_fields["buckets"].default)
                        if _as_int(buckets) is not None:
                            spans.setdefault(ref, []).append((i, str(region.get("name")), buckets))
                elif ref in other:
                    problems.append(
                        (where, ref, f"is {_article(other_key)}, not {_article(key)}: list it under {other_key}")
                    )
                else:
                    problems.append((where, ref, f"no {kind} has this id{_suggest(ref, list(known))}"))

    # Geode's colocation rule: a parallel queue's buckets are its regions'
    # buckets, so every region it serves must have the same number.
    for queue_id, regions_using in spans.items():
        first_i, first_name, first_buckets = regions_using[0]
        for i, name, buckets in regions_using[1:]:
            if buckets != first_buckets:
                problems.append(
                    (
                        f"regions[{i}].buckets",
                        buckets,
                        f"parallel queue {queue_id!r} also serves region {first_name!r} with {first_buckets} "
                        "buckets; regions sharing a parallel queue must have the same buckets (colocation, "
                        "as in Geode)",
                    )
                )

    receiver = data.get("receiver")
    if isinstance(receiver, Mapping):
        accepted = receiver.get("accepted_dsids")
        if isinstance(accepted, (list, tuple)):
            seen_dsids: set[int] = set()
            for k, value in enumerate(accepted):
                other_dsid = _as_int(value)
                if other_dsid is None:
                    continue
                if other_dsid == dsid:
                    problems.append((f"receiver.accepted_dsids[{k}]", other_dsid, "is this site's own dsid"))
                elif other_dsid in seen_dsids:
                    problems.append((f"receiver.accepted_dsids[{k}]", other_dsid, "listed twice"))
                seen_dsids.add(other_dsid)

    problems.extend(_topic_collisions(data, regions, senders, aeqs))
    return problems


def _topic_collisions(
    data: Mapping[str, Any],
    regions: list[tuple[int, Mapping[str, Any]]],
    senders: list[tuple[int, Mapping[str, Any]]],
    aeqs: list[tuple[int, Mapping[str, Any]]],
) -> list[Problem]:
    # Kafka refuses a topic whose name equals an existing one once '.' and
    # '_' are made the same (they collide in metric names): queue "a_dlq"
    # would clash with queue "a"'s dead-letter topic "…queue.a.dlq".
    kafka = data.get("kafka")
    prefix = kafka.get("topic_prefix", "sluice.") if isinstance(kafka, Mapping) else "sluice."
    if not isinstance(prefix, str):
        return []
    names = TopicNames(prefix)
    claimed: dict[str, tuple[str, str]] = {}
    for fixed in (names.gateway_inbound(), names.gateway_acks(), names.region_dead_letter()):
        claimed[fixed.replace(".", "_")] = (fixed, "Sluice itself")
    problems: list[Problem] = []

    def claim(topics: list[str], field: str, value: str) -> None:
        for topic in topics:
            normal = topic.replace(".", "_")
            # Identical names are duplicates, reported as such above.
            if normal in claimed and claimed[normal][1] != field and claimed[normal][0] != topic:
                other_topic, other_field = claimed[normal]
                problems.append(
                    (
                        field,
                        value,
                        f"its topic {topic!r} collides with {other_topic!r} of {other_field} "
                        "(Kafka treats '.' and '_' in topic names as the same)",
                    )
                )
                return
            claimed.setdefault(normal, (topic, field))

    for i, region in regions:
        if isinstance(region.get("name"), str):
            claim([names.region_changelog(region["name"])], f"regions[{i}].name", region["name"])
    for key, entries in (("gateway_senders", senders), ("async_event_queues", aeqs)):
        for i, entry in entries:
            queue_id = entry.get("id")
            if isinstance(queue_id, str):
                topics = [names.queue(queue_id), names.removals(queue_id), names.dead_letter(queue_id)]
                claim(topics, f"{key}[{i}].id", queue_id)
    return problems


def _entries(data: Mapping[str, Any], key: str) -> list[tuple[int, Mapping[str, Any]]]:
    items = data.get(key)
    if not isinstance(items, (list, tuple)):
        return []
    return [(i, item) for i, item in enumerate(items) if isinstance(item, Mapping)]


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _article(key: str) -> str:
    return {"async_event_queues": "an async event queue", "gateway_senders": "a gateway sender"}[key]


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    if choices:
        return "; configured: " + ", ".join(sorted(choices))
    return " (none are configured)"


def _shown(field: str, value: Any) -> Any:
    """The value as an error message may show it: secrets hidden, also inside a section."""
    if field in _SECRET_FIELDS or isinstance(value, SecretStr):
        return _HIDDEN
    if isinstance(value, Mapping):
        return {k: _shown(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_shown("", v) for v in value)
    return value


# --- pydantic errors → problems ----------------------------------------------


def _path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _join(prefix: str, field: str) -> str:
    if not prefix:
        return field
    return prefix + field if field.startswith("[") else f"{prefix}.{field}"


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model class that the location ``loc`` (from SiteConfig) points into."""
    model: type[BaseModel] | None = SiteConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _reason(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "missing":
        return "is required"
    if kind == "sluice_invalid":
        return ctx["reason"]
    if value is None and kind.endswith("_type"):
        return "has no value (an empty YAML value is null)"
    simple = {
        "greater_than_equal": lambda: f"must be >= {ctx['ge']}",
        "greater_than": lambda: f"must be > {ctx['gt']}",
        "less_than_equal": lambda: f"must be <= {ctx['le']}",
        "less_than": lambda: f"must be < {ctx['lt']}",
        "int_type": lambda: "must be a whole number" + (" (without quotes)" if isinstance(value, str) else ""),
        "int_from_float": lambda: "must be a whole number",
        "float_type": lambda: "must be a number" + (" (without quotes)" if isinstance(value, str) else ""),
        "bool_type": lambda: "must be true or false" + (" (without quotes)" if isinstance(value, str) else ""),
        "string_type": lambda: "must be text",
        "string_pattern_mismatch": lambda: _PATTERN_REASONS.get(ctx.get("pattern"), f"must match {ctx.get('pattern')}"),
        "string_too_short": lambda: "must not be empty" if ctx.get("min_length") == 1 else f"must have at least {ctx['min_length']} characters",
        "string_too_long": lambda: f"must have at most {ctx['max_length']} characters",
        "literal_error": lambda: f"must be one of {ctx['expected']}",
        "enum": lambda: f"must be one of {ctx['expected']}",
        "model_type": lambda: "must be a mapping of settings (key: value)",
        "model_attributes_type": lambda: "must be a mapping of settings (key: value)",
        "dict_type": lambda: "must be a mapping (key: value)",
        "list_type": lambda: "must be a list",
        "tuple_type": lambda: "must be a list",
        "too_short": lambda: f"must have at least {ctx['min_length']} item{'s' if ctx.get('min_length') != 1 else ''}",
        "too_long": lambda: f"must have at most {ctx['max_length']} items",
    }
    if kind in simple:
        return simple[kind]()
    return str(error.get("msg", kind))


def _problems_from_validation(exc: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        kind = error["type"]
        where = _path(loc)
        if kind == "sluice_problems":
            for field, value, reason in error["ctx"]["problems"]:
                problems.append((_join(where, field), value, reason))
            continue
        value = error.get("input")
        if kind == "missing":
            value = None
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            key = str(loc[-1])
            known = list(model.model_fields) if model else []
            reason = "unknown key"
            if key.replace("-", "_") in known:
                reason += f"; did you mean {key.replace('-', '_')!r}? (keys use '_', not '-')"
            else:
                reason += _suggest(key, known).replace("; configured: ", "; known keys: ")
            problems.append((where, _shown(key, value), reason))
            continue
        if loc and isinstance(loc[-1], str):
            value = _shown(loc[-1], value)
        problems.append((where, value, _reason(error)))
    return problems


def _dedupe(problems: list[Problem]) -> list[Problem]:
    out: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for field, value, reason in problems:
        if (field, reason) not in seen:
            seen.add((field, reason))
            out.append((field, value, reason))
    return out


# --- loading -----------------------------------------------------------------


def parse_config(
    data: Any,
    source: str = "",
    *,
    base_dir: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SiteConfig:
    """Validate ``data`` (a mapping, as read from a site file) into a ``SiteConfig``.

    ``base_dir`` is where relative file paths (TLS material) are looked up:
    the file's folder when loading a file, else the working directory.
    ``overrides`` are deep-merged into ``data`` first (see ``with_overrides``).
    Raises ``ConfigError`` listing every problem.
    """
    if not isinstance(data, Mapping):
        what = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError([("", _short(data), f"must be a mapping of settings (site:, dsid:, …), not {what}")], source)
    if overrides:
        data = _deep_merge(data, overrides)
    context = {"base_dir": str(base_dir) if base_dir is not None else None}
    try:
        return SiteConfig.model_validate(data, context=context)
    except ValidationError as exc:
        problems = _problems_from_validation(exc)
        # A model's rules only run when all of its own fields are valid; run
        # every rule on the raw data too, so the user sees everything at once.
        problems.extend(_all_rule_problems(data))
        raise ConfigError(_dedupe(problems), source) from None


def load_config(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> SiteConfig:
    """Read and validate a site file (``.yaml``, ``.yml`` or ``.toml``)."""
    path = Path(path)
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError([("", source, "unknown file type: a site file ends in .yaml, .yml or .toml")], source)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([("", source, "no such file")], source) from None
    except OSError as exc:
        raise ConfigError([("", source, f"cannot be read: {exc.strerror or exc}")], source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([("", f"byte {exc.start}", "is not UTF-8 text")], source) from None

    if suffix == ".toml":
        data = _read_toml(text, source)
        problems: list[Problem] = []
    else:
        data, problems = _read_yaml(text, source)
    try:
        cfg = parse_config(data, source, base_dir=path.parent.resolve(), overrides=overrides)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _read_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        match = re.search(r"\(at line (\d+), column (\d+)\)", message)
        if match:
            line = int(match.group(1))
            reason = message[: match.start()].strip()
            where = f"line {line}, column {match.group(2)}"
            raise ConfigError([(where, _line(text, line), f"TOML syntax error: {reason}")], source) from None
        raise ConfigError([("", None, f"TOML syntax error: {message}")], source) from None


class _Loader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys instead of keeping the last silently."""

    duplicates: list[Problem]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    self.duplicates.append(
                        (f"line {line}", key, f"duplicate key (first on line {seen[key]}); a key may appear once")
                    )
                else:
                    seen[key] = line
            except TypeError:  # an unhashable key; construct_mapping reports it below
                pass
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str, source: str) -> tuple[Any, list[Problem]]:
    loader = _Loader(text)
    loader.duplicates = []
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = f"YAML syntax error: {exc.problem or exc.context or 'unreadable'}"
        if exc.context and exc.problem:
            # The context is where the broken construct began, often the
            # line the user must fix (an unclosed quote found at the end).
            began = f" that starts on line {exc.context_mark.line + 1}" if exc.context_mark else ""
            reason = f"YAML syntax error: {exc.problem} ({exc.context}{began})"
        if mark is None:
            raise ConfigError([("", None, reason)], source) from None
        line = mark.line + 1
        shown = _line(text, line) or (_line(text, exc.context_mark.line + 1) if exc.context_mark else "")
        raise ConfigError([(f"line {line}, column {mark.column + 1}", shown, reason)], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", None, f"YAML syntax error: {exc}")], source) from None
    finally:
        loader.dispose()
    return data, loader.duplicates


def _line(text: str, line: int) -> str:
    lines = text.splitlines()
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."


def _without_loaded_secrets(data: dict[str, Any]) -> dict[str, Any]:
    """A SiteConfig dump without the secrets read from a file or variable, which validation reads again."""
    def without_loaded(section: dict[str, Any], name: str) -> dict[str, Any]:
        if section.get(f"{name}_file") is not None or section.get(f"{name}_env") is not None:
            return {k: v for k, v in section.items() if k != name}
        return section

    data = without_loaded(dict(data), "gateway_private_key")
    if isinstance(data.get("gateway_public_keys"), dict):
        loaded = set(data.get("gateway_public_keys_file") or {})
        data["gateway_public_keys"] = {dsid: key for dsid, key in data["gateway_public_keys"].items()
                                       if dsid not in loaded}
    for section, names in (("region_service", ("token", "member_token")), ("subscriptions", ("token",))):
        if isinstance(data.get(section), dict):
            for name in names:
                data[section] = without_loaded(data[section], name)
    return data


def _deep_merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
