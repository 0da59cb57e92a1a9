"""The Kafka topics a site needs, and how to make a cluster have them.

Every topic name comes from ``TopicNames``; no other module spells one.  A
site's file implies a fixed set of topics (``plan_topics``):

* one compacted **changelog** per region, with one partition per bucket: the
  region's write-ahead truth (DESIGN §2);
* per gateway sender and async event queue attached to a region, the
  **queue** topic (its partitions are the queue's buckets: the region's
  buckets for a parallel queue, ``dispatcher_threads`` for a serial one), the
  compacted **removals** topic that records each partition's acknowledged
  head, and a **dead-letter** topic;
* with a receiver, the **gateway inbound** topic remote senders write batches
  to, and the **gateway acks** topic the receiver answers on;
* one **region dead-letter** topic for records the region service cannot read;
* the subscription service's compacted **registry**, **acks** and **fill**
  topics, and its **dead-letter** topic for the records of those and of the
  changelogs it cannot read or refuses.

``apply_topics`` makes a cluster match the plan, step by step:

1. list the cluster's topics (one metadata request) and describe the
   ``cleanup.policy`` of the planned ones that exist;
2. an existing topic whose partition count or cleanup policy differs from the
   plan is reported as a mismatch and left exactly as it is: a queue or a
   region whose buckets silently changed would send keys to other partitions,
   so a person must decide (there is no "fix it" mode on purpose);
3. missing topics are created in one ``create_topics`` call, with the
   configured replication factor (-1: the broker's default).

Running it again is harmless: everything then reports "exists".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .errors import BrokerUnavailable, TopicMismatch
from .kafka import (
    AdminClient,
    ConfigResource,
    KafkaError,
    NewTopic,
    ResourceType,
    kafka_errors,
    make_admin,
    wait_future,
    wait_futures,
)

if TYPE_CHECKING:  # config imports this module; the reverse import is for types only.
    from .config import SiteConfig

__all__ = [
    "TopicAction",
    "TopicNames",
    "TopicReport",
    "TopicResult",
    "TopicSpec",
    "apply_topics",
    "plan_topics",
]

DAY_MS = 24 * 60 * 60 * 1000
HOUR_MS = 60 * 60 * 1000
#: Dead letters are kept a week: long enough for someone to look at them.
DEAD_LETTER_RETENTION_MS = 7 * DAY_MS
#: The gateway inbound/acks topics only carry batches in flight; a week covers
#: any outage a sender would still resend across.
GATEWAY_RETENTION_MS = 7 * DAY_MS
#: How often to look again for a topic the broker says exists but does not list yet.
VISIBILITY_POLL_S = 0.1


class TopicNames:
    """Every topic name of a site, derived from ``kafka.topic_prefix``."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"TopicNames({self.prefix!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TopicNames) and other.prefix == self.prefix

    def __hash__(self) -> int:
        return hash(self.prefix)

    def region_changelog(self, region: str) -> str:
        return f"{self.prefix}region.{region}.changelog"

    def queue(self, queue_id: str) -> str:
        return f"{self.prefix}queue.{queue_id}"

    def removals(self, queue_id: str) -> str:
        return f"{self.prefix}queue.{queue_id}.removals"

    def dead_letter(self, queue_id: str) -> str:
        return f"{self.prefix}queue.{queue_id}.dlq"

    def gateway_inbound(self) -> str:
        return f"{self.prefix}gateway.inbound"

    def gateway_acks(self) -> str:
        return f"{self.prefix}gateway.acks"

    def region_dead_letter(self) -> str:
        return f"{self.prefix}region.dlq"

    def subscription_registry(self) -> str:
        """Every subscription client: identity, durability, interest, connection (compacted, by client id)."""
        return f"{self.prefix}subscriptions.registry"

    def subscription_acks(self) -> str:
        """Each client's acknowledged queue position and last ping (compacted, by client id)."""
        return f"{self.prefix}subscriptions.acks"

    def subscription_fill(self) -> str:
        """How far each registry partition's clients' queues are filled (compacted, by registry partition)."""
        return f"{self.prefix}subscriptions.fill"

    def subscription_dead_letter(self) -> str:
        """Registry, acks, fill and changelog records the subscription service could not read or refused."""
        return f"{self.prefix}subscriptions.dlq"

    def client_queue(self, client_id: str, incarnation: str) -> str:
        """One client's subscription queue; a new incarnation per new (or timed-out and returning) client."""
        return f"{self.prefix}subscription.{client_id}.{incarnation}"

    def control(self) -> str:
        """Desired state of queues (``sluice admin pause|resume|stop|start``)."""
        return f"{self.prefix}control"

    def status(self) -> str:
        """What each queue partition's primary reports (``sluice admin status``)."""
        return f"{self.prefix}status"


@dataclass(frozen=True)
class TopicSpec:
    """One topic the configuration implies."""

    name: str
    partitions: int
    compacted: bool
    config: dict[str, str]
    purpose: str

    @property
    def cleanup_policy(self) -> str:
        return self.config["cleanup.policy"]


def _compacted() -> dict[str, str]:
    # min.compaction.lag.ms=0: the newest record per key is what readers need,
    # older ones may go as soon as the cleaner runs.  segment.ms of an hour
    # lets the cleaner reach records at all (it never touches the active
    # segment), so the topic stays small without a flood of tiny segments.
    return {
        "cleanup.policy": "compact",
        "min.compaction.lag.ms": "0",
        "segment.ms": str(HOUR_MS),
    }


def _deleted(retention_ms: int, retention_bytes: int = -1) -> dict[str, str]:
    return {
        "cleanup.policy": "delete",
        "retention.ms": str(retention_ms),
        "retention.bytes": str(retention_bytes),
    }


def plan_topics(cfg: SiteConfig) -> list[TopicSpec]:
    """The topics ``cfg`` needs, in a stable order (regions, queues, gateway, dead letters).

    Queue topics are planned for every sender and async event queue attached
    to at least one region; one attached to none receives no events, and a
    parallel one would have no bucket count to take.
    """
    names = cfg.topics
    specs: list[TopicSpec] = []
    for region in cfg.regions:
        specs.append(
            TopicSpec(
                name=names.region_changelog(region.name),
                partitions=region.buckets,
                compacted=True,
                config=_compacted(),
                purpose=f"region changelog of {region.name}",
            )
        )
    for queue in cfg.all_attached_queues():
        what = "gateway sender" if queue.kind == "gateway-sender" else "async event queue"
        specs.append(
            TopicSpec(
                name=queue.topic,
                partitions=queue.partitions,
                compacted=False,
                # The removal records, not retention, empty a queue: an event
                # must stay until it is acknowledged, however long a remote
                # site is away.
                config=_deleted(retention_ms=-1, retention_bytes=-1),
                purpose=f"queue of {what} {queue.id}",
            )
        )
        specs.append(
            TopicSpec(
                name=names.removals(queue.id),
                partitions=1,
                compacted=True,
                config=_compacted(),
                purpose=f"acknowledged head per partition of {what} {queue.id}",
            )
        )
        specs.append(
            TopicSpec(
                name=names.dead_letter(queue.id),
                partitions=1,
                compacted=False,
                config=_deleted(DEAD_LETTER_RETENTION_MS),
                purpose=f"dead letters of {what} {queue.id}",
            )
        )
    if cfg.receiver is not None:
        partitions = cfg.receiver.inbound_partitions
        specs.append(
            TopicSpec(
                name=names.gateway_inbound(),
                partitions=partitions,
                compacted=False,
                config=_deleted(GATEWAY_RETENTION_MS),
                purpose="batches from remote sites to this site's receiver",
            )
        )
        specs.append(
            TopicSpec(
                name=names.gateway_acks(),
                partitions=partitions,
                compacted=False,
                config=_deleted(GATEWAY_RETENTION_MS),
                purpose="acknowledgements from this site's receiver",
            )
        )
    specs.append(
        TopicSpec(
            name=names.region_dead_letter(),
            partitions=1,
            compacted=False,
            config=_deleted(DEAD_LETTER_RETENTION_MS),
            purpose="region operations that could not be read or applied",
        )
    )
    partitions = cfg.subscriptions.registry_partitions
    for name, purpose in ((names.subscription_registry(), "subscription clients: interest, durability, connection"),
                          (names.subscription_acks(), "subscription clients' acknowledged queue positions and pings"),
                          (names.subscription_fill(), "how far subscription queues are filled, per registry partition")):
        specs.append(TopicSpec(name=name, partitions=partitions, compacted=True, config=_compacted(),
                               purpose=purpose))
    specs.append(
        TopicSpec(
            name=names.subscription_dead_letter(),
            partitions=1,
            compacted=False,
            config=_deleted(DEAD_LETTER_RETENTION_MS),
            purpose="subscription records that could not be read or were refused",
        )
    )
    for name, purpose in ((names.control(), "desired state of each queue, set by sluice admin"),
                          (names.status(), "status reported by queue primaries (per partition) and gateway receivers")):
        specs.append(TopicSpec(name=name, partitions=1, compacted=True, config=_compacted(), purpose=purpose))
    return specs


TopicAction = Literal["created", "exists", "mismatch", "would create"]


@dataclass(frozen=True)
class TopicResult:
    """What ``apply_topics`` found or did for one planned topic."""

    name: str
    action: TopicAction
    detail: str
    spec: TopicSpec
    #: One entry per way the existing topic disagrees with the plan.
    mismatches: tuple[TopicMismatch, ...] = ()


@dataclass(frozen=True)
class TopicReport:
    """The outcome of ``apply_topics``: one result per planned topic, in plan order."""

    bootstrap: str
    results: tuple[TopicResult, ...]
    dry_run: bool = False
    replication_factor: int = -1

    @property
    def ok(self) -> bool:
        """False when any existing topic disagrees with the configuration."""
        return not any(r.action == "mismatch" for r in self.results)

    @property
    def mismatches(self) -> list[TopicMismatch]:
        return [m for r in self.results for m in r.mismatches]

    def by_action(self, action: TopicAction) -> list[TopicResult]:
        return [r for r in self.results if r.action == action]

    def __getitem__(self, name: str) -> TopicResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(name)


@dataclass
class _Existing:
    partitions: int
    cleanup_policy: str | None = None


def apply_topics(
    cfg: SiteConfig,
    admin: AdminClient | None = None,
    dry_run: bool = False,
    timeout_s: float | None = None,
) -> TopicReport:
    """Create the planned topics that are missing; report the ones that disagree.

    Never alters an existing topic.  ``admin`` defaults to one built from
    ``cfg.kafka.client_settings()``.  Raises ``BrokerUnavailable`` when the
    cluster cannot be reached within ``timeout_s`` (default: the configured
    request timeout).
    """
    if timeout_s is None:
        timeout_s = cfg.kafka.request_timeout_ms / 1000
    if admin is None:
        admin = make_admin(cfg.kafka.client_settings())
    bootstrap = cfg.kafka.bootstrap_servers
    plan = plan_topics(cfg)
    existing = _describe_existing(admin, bootstrap, [s.name for s in plan], timeout_s)

    results: dict[str, TopicResult] = {}
    missing: list[TopicSpec] = []
    for spec in plan:
        found = existing.get(spec.name)
        if found is None:
            missing.append(spec)
        else:
            results[spec.name] = _check_existing(spec, found)

    rf = cfg.kafka.replication_factor
    if missing and dry_run:
        for spec in missing:
            results[spec.name] = TopicResult(spec.name, "would create", _describe(spec, rf), spec)
    elif missing:
        new_topics = [
            NewTopic(spec.name, num_partitions=spec.partitions, replication_factor=rf, config=dict(spec.config))
            for spec in missing
        ]
        futures = admin.create_topics(new_topics, operation_timeout=timeout_s, request_timeout=timeout_s)
        # A topic created by someone else between our listing and our create
        # (another `topics apply`, a service starting) is not an error: it is
        # checked like any topic that already existed.
        raced = _wait_creates(futures, timeout_s)
        # Wait (bounded) until every topic is listed, so that a service
        # started right after `topics apply` finds its topics.
        again = _wait_visible(admin, bootstrap, [spec.name for spec in missing], timeout_s)
        for spec in missing:
            if spec.name not in raced:
                results[spec.name] = TopicResult(spec.name, "created", _describe(spec, rf), spec)
            elif spec.name in again:
                results[spec.name] = _check_existing(spec, again[spec.name])
            else:  # The broker says it exists but never showed it: say so rather than guess.
                results[spec.name] = TopicResult(
                    spec.name,
                    "mismatch",
                    f"exists according to the broker but not visible in its metadata after {timeout_s:g} s",
                    spec,
                    (TopicMismatch(spec.name, "visible", True, False),),
                )

    return TopicReport(
        bootstrap=cfg.kafka.bootstrap_servers,
        results=tuple(results[s.name] for s in plan),
        dry_run=dry_run,
        replication_factor=rf,
    )


def _describe(spec: TopicSpec, replication_factor: int | None = None) -> str:
    if replication_factor is None:
        return spec.purpose
    replication = "broker default" if replication_factor == -1 else str(replication_factor)
    return f"{spec.purpose} (replication {replication})"


def _check_existing(spec: TopicSpec, found: _Existing) -> TopicResult:
    mismatches = _compare(spec, found)
    if not mismatches:
        return TopicResult(spec.name, "exists", _describe(spec), spec)
    detail = "; ".join(f"{m.field} is {m.actual!r}, configuration needs {m.expected!r}" for m in mismatches)
    return TopicResult(spec.name, "mismatch", f"{detail} (left unchanged)", spec, tuple(mismatches))


def _compare(spec: TopicSpec, found: _Existing) -> list[TopicMismatch]:
    out = []
    if found.partitions != spec.partitions:
        out.append(TopicMismatch(spec.name, "partitions", spec.partitions, found.partitions))
    if found.cleanup_policy is not None and _policy_set(found.cleanup_policy) != _policy_set(spec.cleanup_policy):
        out.append(TopicMismatch(spec.name, "cleanup.policy", spec.cleanup_policy, found.cleanup_policy))
    return out


def _policy_set(policy: str) -> frozenset[str]:
    # Kafka accepts "compact,delete" and "delete,compact" alike.
    return frozenset(p.strip() for p in policy.split(",") if p.strip())


def _describe_existing(admin: AdminClient, bootstrap: str, names: list[str], timeout_s: float) -> dict[str, _Existing]:
    """Partition count and cleanup.policy of each of ``names`` that exists."""
    with kafka_errors(f"listing topics on {bootstrap}"):
        metadata = admin.list_topics(timeout=timeout_s)
    wanted = set(names)
    existing: dict[str, _Existing] = {}
    for name, topic in metadata.topics.items():
        if name in wanted and topic.error is None:
            existing[name] = _Existing(partitions=len(topic.partitions))
    if not existing:
        return existing
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in existing]
    futures = admin.describe_configs(resources, request_timeout=timeout_s)
    for resource, entries in wait_futures(futures, "describing topic configuration of", timeout_s).items():
        entry = entries.get("cleanup.policy")
        if entry is not None:
            existing[resource.name].cleanup_policy = entry.value
    return existing


def _wait_visible(admin: AdminClient, bootstrap: str, names: list[str], timeout_s: float) -> dict[str, _Existing]:
    """``_describe_existing`` until every name shows up or ``timeout_s`` passes.

    A broker answers CreateTopics from the controller's state but Metadata
    from its own cache, which can lag by a moment (KRaft propagates it
    asynchronously): a topic created just before us can be "already exists"
    yet absent from the listing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        existing = _describe_existing(admin, bootstrap, names, timeout_s)
        if all(name in existing for name in names) or time.monotonic() >= deadline:
            return existing
        time.sleep(VISIBILITY_POLL_S)


def _wait_creates(futures: dict[str, Any], timeout_s: float) -> list[str]:
    """Wait for create_topics; return the names that already existed (a race)."""
    raced = []
    for name, fut in futures.items():
        try:
            wait_future(fut, f"creating topic {name}", timeout_s)
        except BrokerUnavailable as exc:
            if exc.code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            raced.append(name)
    return raced
