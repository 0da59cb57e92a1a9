"""The site: one file's dsid, Kafka cluster, regions, queues, receiver and services, and lookups over them.

``SiteConfig`` is what ``load_config`` returns.  Its before-validator reads
the secrets and public keys given by file or variable and refuses removed
settings; its after-validator runs the rules across sections (``rules``).
``AttachedQueue`` is a sender or async event queue as a region's events see
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationInfo, field_validator, model_validator

from ... import sitekeys
from ...errors import InvalidRequest, UnknownRegion
from ...topics import TopicNames
from ..base import (
    SITE_PATTERN,
    _existing_file,
    _invalid,
    _Model,
    _raise_rules,
    _seq,
    check_import_path,
)
from ..rules import _site_problems
from ..librdkafka import SECRET_PROPERTIES
from ..secrets import _removed_problems, _resolve_public_keys, _resolve_secret, _without_loaded_secrets
from .kafka import KafkaConfig, KafkaConnection
from .queues import AsyncEventQueueConfig, GatewaySenderConfig
from .receiver import ReceiverConfig
from .region import RegionConfig, RegionServiceConfig
from .registry import SchemaRegistryConnection
from .secretfields import secret_env, secret_file
from .subscriptions import SubscriptionsConfig


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
    gateway_private_key_file: str | None = secret_file("gateway_private_key")
    gateway_private_key_env: str | None = secret_env("gateway_private_key")
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
    serializer: Literal["single-object", "confluent"] = Field(
        "single-object", description="how the site frames its changelog and queue records: single-object (Avro's "
        "single-object encoding, C3 01 and the schema's fingerprint) or confluent (Confluent's wire format, 00 and "
        "a schema id from schema_registry, which Confluent's deserializers, Kafka Connect, ksqlDB and Flink read); "
        "Sluice's own protocol records (removals, gateway batches and acks, status, control) stay single-object. "
        "Readers take either framing, so a site can switch")
    schema_registry: SchemaRegistryConnection | None = Field(
        None, description="the Confluent-compatible schema registry of serializer: confluent (required with it); "
        "with single-object, where to look up the schema ids of Confluent-framed records the topics still hold")

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
    def _check_serializer(self) -> SiteConfig:
        if self.serializer == "confluent" and self.schema_registry is None:
            _raise_rules([("schema_registry", None, "is required with serializer: confluent: the registry's url, "
                           "at least (the changelog and queue records' schema ids come from it)")])
        return self

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
        # Imported here, not above: loading validates into SiteConfig, so it imports this module.
        from ..loading import _deep_merge, parse_config

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
            add(f"{where}.sasl_oauthbearer_client_secret", connection, "sasl_oauthbearer_client_secret")
            for name in connection.librdkafka:
                if name in SECRET_PROPERTIES:
                    out.append((f"{where}.librdkafka.{name}", "the site file"))
        add("region_service.token", self.region_service, "token")
        add("region_service.member_token", self.region_service, "member_token")
        add("subscriptions.token", self.subscriptions, "token")
        add("gateway_private_key", self, "gateway_private_key")
        if self.schema_registry is not None:
            add("schema_registry.basic_auth_password", self.schema_registry, "basic_auth_password")
            add("schema_registry.bearer_token", self.schema_registry, "bearer_token")
        return out
