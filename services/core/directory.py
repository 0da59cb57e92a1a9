"""Who owns which bucket: each region-service instance's claims, on the site's compacted status topic.

Every instance publishes a ``RegionInstance`` record under ``region/<instance>``
(``sluice.region.directory.DirectoryPublisher``): its URL and the buckets it
owns, each with the time it was assigned it (``since``), whenever its
assignment changes and every few seconds.  The records, the trust put in them
and their readers are here, in the core, because the region service, the
gateway receiver and ``sluice admin`` all read them.  Readers
(the other instances, which forward a write to its bucket's owner; gateway
receivers, which need any instance; the status page) tail the topic and take,
for each bucket, the claim with the latest ``since``: a new owner is assigned
a bucket after its old owner lost it, so a dead instance's claim is
superseded as soon as its successor is assigned, and an instance that left
cleanly says so (``state: stopped``).

This replaces describing the region's consumer group with the admin API:
librdkafka's coordinator-bound admin requests abort the process when the
broker connection drops under them (confluentinc/librdkafka#4605), and a
broker restart is exactly when every instance would be asking.

Anyone who can write the status topic could claim every bucket with a URL of
their own; instances would then forward writes there with the member token,
and receivers would post their batches there.  So a reader believes a record
only when (``MemberTrust``):

1. it is signed: with ``region_service.member_token`` set, each record carries
   an HMAC-SHA256 of its key and value bytes, keyed by the member token, in
   the header ``sluice-hmac-sha256``; the reader checks the bytes it received,
   and ignores unsigned and badly signed records (tombstones included).
   Without a member token (a loopback-only development site) records are
   taken unsigned;
2. its URL is an ``http(s)://host[:port][/path]`` whose host
   ``region_service.member_hosts`` allows (IP networks, or host names with
   ``*``; empty: loopback and this process's own host), signed or not;
3. it is keyed by the instance it names.

An ignored record leaves the instance's previous record in place.  No token
is ever sent to a URL that did not pass these checks: every URL the owner
table or ``live_urls`` returns did, and the region service checks each
request's host again before sending it.  A holder of the member token can
still claim buckets for an allowed host: the member token is the members'
credential, and member_hosts bounds where it can point.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .codec import get_codec
from .errors import CodecError, SluiceError
from .kafka import FOLLOW_FETCH_WAIT_MS, OFFSET_BEGINNING, Consumer, TopicPartition, kafka_errors, make_consumer, read_to_end

if TYPE_CHECKING:
    from .config import SiteConfig

log = logging.getLogger("sluice.directory")

KEY_PREFIX = b"region/"
#: The record header holding the HMAC-SHA256 of a record (see ``MemberTrust.signature``).
SIGNATURE_HEADER = "sluice-hmac-sha256"
_SIGNED_CONTEXT = b"sluice RegionInstance v1\n"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
#: How often a running instance publishes its claims again, and how old a record may be before its
#: instance counts as gone for ``live_urls`` (a killed instance publishes nothing more).
HEARTBEAT_S = 5.0
LIVE_WITHIN_S = 4 * HEARTBEAT_S


@dataclass(frozen=True, slots=True)
class Instance:
    """One ``RegionInstance`` record."""

    instance: str
    url: str
    state: str
    claims: tuple[tuple[str, int, int], ...]  # (region, bucket, since_ms)
    updated_at: int
    #: (region, bucket, lag, entries, value bytes) of each standby copy it keeps (standby.py).
    standbys: tuple[tuple[str, int, int, int, int], ...] = ()

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "Instance":
        return cls(r["instance"], r["url"], r["state"],
                   tuple((c["region"], c["bucket"], c["since"]) for c in r["buckets"]), r["updated_at"],
                   tuple((c["region"], c["bucket"], c["lag"], c["entries"], c["value_bytes"])
                         for c in r.get("standbys", ())))


class MemberTrust:
    """Which directory records and member URLs this process believes (see the module docstring)."""

    def __init__(self, member_token: str | None, member_hosts: tuple[str, ...] = (),
                 own_hosts: tuple[str, ...] = ()) -> None:
        self._key = None if member_token is None else member_token.encode("utf-8")
        self._networks = [ipaddress.ip_network(h, strict=False) for h in member_hosts if "/" in h]
        self._names = [h.lower() for h in member_hosts if "/" not in h]
        self._default = not member_hosts
        self._own = frozenset(h.lower().strip("[]") for h in own_hosts if h)
        self._verdicts: dict[str, str | None] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: SiteConfig, own_url: str | None = None) -> "MemberTrust":
        """From the site file: its member token and member_hosts; own hosts: ``own_url``'s, the advertised
        URL's and region_service.host."""
        rs = cfg.region_service
        own = [rs.host]
        for url in (own_url, rs.advertised_url):
            if url:
                host = urlsplit(url).hostname
                if host:
                    own.append(host)
        token = rs.member_token.get_secret_value() if rs.member_token is not None else None
        return cls(token, tuple(rs.member_hosts), tuple(own))

    @property
    def signs(self) -> bool:
        return self._key is not None

    def signature(self, key: bytes, value: bytes | None) -> bytes:
        assert self._key is not None
        mac = hmac.new(self._key, _SIGNED_CONTEXT, hashlib.sha256)
        mac.update(len(key).to_bytes(4, "big") + key)
        mac.update(b"" if value is None else value)
        return mac.digest()

    def headers(self, key: bytes, value: bytes | None) -> list[tuple[str, bytes]] | None:
        """The headers a record published by this process carries (None without a member token)."""
        return None if self._key is None else [(SIGNATURE_HEADER, self.signature(key, value))]

    def verified(self, key: bytes, value: bytes | None, headers: list[tuple[str, bytes]] | None) -> bool:
        """Whether a record read from the topic is signed with the member token (always, without one)."""
        if self._key is None:
            return True
        expected = self.signature(key, value)
        for name, given in headers or ():
            if name == SIGNATURE_HEADER and given is not None and hmac.compare_digest(expected, bytes(given)):
                return True
        return False

    def url_problem(self, url: str) -> str | None:
        """Why requests (and tokens) must not go to ``url``, or None when they may."""
        with self._lock:
            if url in self._verdicts:
                return self._verdicts[url]
        verdict = self._judge(url)
        with self._lock:
            if len(self._verdicts) < 10_000:
                self._verdicts[url] = verdict
        return verdict

    def allows(self, url: str) -> bool:
        return self.url_problem(url) is None

    def host_problem(self, host: str) -> str | None:
        """Why ``host`` is not a member host, or None."""
        host = host.lower().strip("[]")
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if self._default:
            if (ip is not None and ip.is_loopback) or host in _LOOPBACK_NAMES or host in self._own:
                return None
            return f"host {host!r} is neither loopback nor this instance's own host (member_hosts is empty)"
        if ip is not None and any(ip.version == net.version and ip in net for net in self._networks):
            return None
        if any(fnmatch.fnmatchcase(host, name) for name in self._names):
            return None
        return f"host {host!r} is not in region_service.member_hosts"

    def _judge(self, url: str) -> str | None:
        try:
            parts = urlsplit(url)
            host = parts.hostname
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError as exc:
            return f"not a URL: {exc}"
        if parts.scheme not in ("http", "https") or not host:
            return "not an http:// or https:// URL with a host"
        if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
            return "a member URL has no user, query or fragment"
        return self.host_problem(host)


def owners_of(instances: dict[str, Instance], by_name: bool = False) -> dict[tuple[str, int], str]:
    """(region, bucket) → URL (or, ``by_name``, the name) of the instance with the latest claim among
    running instances."""
    best: dict[tuple[str, int], tuple[int, str]] = {}
    for inst in instances.values():
        if inst.state != "running":
            continue
        for region, bucket, since in inst.claims:
            if (region, bucket) not in best or since > best[(region, bucket)][0]:
                best[(region, bucket)] = (since, inst.instance if by_name else inst.url)
    return {rb: owner for rb, (_, owner) in best.items()}


def live_instances(instances: dict[str, Instance], now_ms: int | None = None) -> list[Instance]:
    """The running instances heard from within ``LIVE_WITHIN_S`` (all running ones when none is)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    running = [i for i in instances.values() if i.state == "running"]
    return [i for i in running if now_ms - i.updated_at <= LIVE_WITHIN_S * 1000] or running


def standbys_of(instances: dict[str, Instance]) -> dict[tuple[str, int], list[tuple[Instance, int, int, int]]]:
    """(region, bucket) → (instance, lag, entries, value bytes) of each standby copy the live instances
    report, in instance-name order."""
    out: dict[tuple[str, int], list[tuple[Instance, int, int, int]]] = {}
    for inst in sorted(live_instances(instances), key=lambda i: i.instance):
        for region, bucket, lag, entries, size in inst.standbys:
            out.setdefault((region, bucket), []).append((inst, lag, entries, size))
    return out


def live_urls(instances: dict[str, Instance], now_ms: int | None = None,
              trust: MemberTrust | None = None) -> list[str]:
    """URLs of the running instances heard from lately (all running ones when none is that fresh).

    ``instances`` from ``read_instances`` hold only believed records; ``trust`` filters others."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return sorted({i.url for i in live_instances(
        {k: i for k, i in instances.items() if trust is None or trust.allows(i.url)}, now_ms)})


class _Ignored:
    """Counts the records a reader did not believe, and logs the first of each kind and key."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[tuple[str, bytes]] = set()

    def __call__(self, why: str, key: bytes, detail: str) -> None:
        self.count += 1
        if len(self._seen) < 1000 and (why, key) not in self._seen:
            self._seen.add((why, key))
            log.warning("status topic: record %r ignored: %s", key[:100], detail)


def _decode(codec: Any, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None,
            trust: MemberTrust | None = None, ignored: _Ignored | None = None
            ) -> tuple[str, Instance | None] | None:
    """(instance name, record or None for a tombstone), or None when the record is not a believed
    instance record."""
    if not key or not key.startswith(KEY_PREFIX):
        return None
    if trust is not None and not trust.verified(key, value, headers):
        if ignored is not None:
            ignored("unsigned", key, "not signed with this site's member token")
        return None
    name = key[len(KEY_PREFIX):].decode("utf-8", "replace")
    if value is None:
        return name, None
    try:
        instance = Instance.from_record(codec.decode_as("RegionInstance", value))
    except (CodecError, KeyError, ValueError):
        return None
    if instance.instance != name:
        if ignored is not None:
            ignored("misnamed", key, f"names instance {instance.instance!r}")
        return None
    problem = None if trust is None else trust.url_problem(instance.url)
    if problem is not None:
        if ignored is not None:
            ignored("url", key, f"URL {instance.url[:200]!r}: {problem}")
        return None
    return name, instance


def read_instances(cfg: SiteConfig, deadline_s: float = 10.0) -> dict[str, Instance]:
    """Every believed instance record (see the module docstring), read once from the start of the
    status topic to its end."""
    codec = get_codec()
    trust = MemberTrust.from_config(cfg)
    ignored = _Ignored()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    found: dict[str, Instance] = {}
    try:
        for msg in read_to_end(consumer, cfg.topics.status(), 0, deadline_s=deadline_s):
            item = _decode(codec, msg.key(), msg.value(), msg.headers(), trust, ignored)
            if item is not None:
                if item[1] is None:
                    found.pop(item[0], None)
                else:
                    found[item[0]] = item[1]
    finally:
        consumer.close()
    return found


class OwnerDirectory:
    """Who owns which bucket, from the instances' records (see the module docstring).

    ``refresh()`` reads what arrived since the last call; the first call reads the topic from its start.
    """

    def __init__(self, cfg: SiteConfig, trust: MemberTrust | None = None) -> None:
        self._codec = get_codec()
        self.trust = trust or MemberTrust.from_config(cfg)
        self.ignored = _Ignored()
        self._topic = cfg.topics.status()
        self._consumer: Consumer = make_consumer(cfg.kafka.client_settings(), None,
                                                 **{"fetch.wait.max.ms": FOLLOW_FETCH_WAIT_MS})
        self._consumer.assign([TopicPartition(self._topic, 0, OFFSET_BEGINNING)])
        self._instances: dict[str, Instance] = {}
        self._owners: dict[tuple[str, int], str] = {}
        #: A copy of ``_instances`` as of the last read that changed it (readers take it under ``_lock``).
        self._snapshot: dict[str, Instance] = {}
        self._lock = threading.Lock()
        self._reading = threading.Lock()

    def refresh(self) -> None:
        with self._reading:
            self._read()

    def _read(self) -> None:
        changed = False
        consuming = kafka_errors(f"reading {self._topic}")
        while True:
            try:
                with consuming:
                    msgs = self._consumer.consume(1000, 0.05)
            except SluiceError as exc:
                log.debug("%s", exc)
                break
            if not msgs:
                break
            for msg in msgs:
                if msg.error() is not None:
                    continue
                item = _decode(self._codec, msg.key(), msg.value(), msg.headers(), self.trust, self.ignored)
                if item is None:
                    continue
                changed = True
                if item[1] is None:
                    self._instances.pop(item[0], None)
                else:
                    self._instances[item[0]] = item[1]
        if changed:
            with self._lock:
                self._owners = owners_of(self._instances)
                self._snapshot = dict(self._instances)

    def owner(self, region: str, bucket: int) -> str | None:
        with self._lock:
            return self._owners.get((region, bucket))

    def table(self) -> dict[tuple[str, int], str]:
        with self._lock:
            return dict(self._owners)

    def placement_view(self) -> tuple[list[str], dict[tuple[str, int], str]]:
        """The live instances' names, and (region, bucket) → the name of the instance owning it (the
        latest claim among running instances), for placing standby copies (standby.py)."""
        with self._lock:
            instances = self._snapshot
        return [i.instance for i in live_instances(instances)], owners_of(instances, by_name=True)

    def standbys(self) -> dict[tuple[str, int], list[tuple[str, int]]]:
        """(region, bucket) → [(instance URL, lag)] of the standby copies the live instances report."""
        with self._lock:
            instances = self._snapshot
        return {rb: [(inst.url, lag) for inst, lag, _, _ in copies] for rb, copies in standbys_of(instances).items()}

    def topic_problems(self, partitions: dict[str, int], timeout_s: float = 5.0) -> dict[str, str] | None:
        """Each of ``partitions``' topics that is missing or has another partition count, with why;
        None when the broker did not answer (one metadata request per topic)."""
        problems: dict[str, str] = {}
        with self._reading:
            for topic, expected in partitions.items():
                try:
                    with kafka_errors(f"metadata of {topic}"):
                        metadata = self._consumer.list_topics(topic, timeout=timeout_s)
                except SluiceError as exc:
                    log.debug("%s", exc)
                    return None
                found = metadata.topics.get(topic)
                if found is None or found.error is not None:
                    problems[topic] = "topic missing" + (f" ({found.error.str()})" if found is not None else "")
                elif len(found.partitions) != expected:
                    problems[topic] = f"{len(found.partitions)} partitions, the site file says {expected}"
        return problems

    def close(self) -> None:
        self._consumer.close()
