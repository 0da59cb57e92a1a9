"""The region sections: a region (its buckets, queues and limits) and the region service's HTTP face.

``RegionServiceConfig`` also holds the credentials of that face (the clients'
token and the members' member_token, read when the file is loaded) and which
hosts an instance's announced URL may name.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from typing import Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from ..base import NAME_PATTERN, _invalid, _Model, _raise_rules, _seq
from ..secrets import _HIDDEN, _resolve_secret
from .secretfields import existing_files, secret_env, secret_file

_MEMBER_HOST = re.compile(r"^([0-9A-Fa-f:.]+/\d{1,3}|[0-9A-Fa-f:.]+|[A-Za-z0-9*]([A-Za-z0-9*_.-]*[A-Za-z0-9*])?)$")


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
    token_file: str | None = secret_file("token")
    token_env: str | None = secret_env("token")
    member_token: SecretStr | None = Field(
        None, min_length=16, description="the credential region-service instances use between themselves "
        "(forwarded operations and reads, /internal/*) and gateway receivers use to apply other sites' events "
        "(apply_remote); it also signs each instance's record of the buckets it owns on the status topic, so "
        "that no other writer of that topic can redirect requests. 16 characters or more, not the same as token; "
        "required when token is set")
    member_token_file: str | None = secret_file("member_token")
    member_token_env: str | None = secret_env("member_token")
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

    _check_token_files = existing_files("token_file", "member_token_file")

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
