"""The region service: one instance of ``sluice region -c FILE``.

An instance is a bucket owner (``engine.py``) behind an HTTP API (``http.py``).
A request may reach any instance.  The instance splits it by bucket and
routes each part: to its own engine for the buckets it owns, or to the
owner's HTTP address for the others.  Owners are read from the records the
instances publish on the site's status topic (published by ``directory.py``,
read by ``core/directory.py``: signed with the member token, their URLs
within ``member_hosts``), each claim from the consumer group's assignment, so
Kafka is the only source of truth about who owns what.

Lifecycle::

    NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                        │
                        └── a worker thread died ──► CRASHED (exit non-zero)

Retries inside the service are limited to what is certainly not applied: an
owner that answered "not mine" or "loading", or that could not be connected
to.  A forwarded request whose outcome is unknown (timeout) is answered with
a retriable 503; the caller retries with the same EventID and the owner's
duplicate tracking makes the retry safe.

Between instances: an instance forwards to another only under ``/internal/``
(operations, reads, a bucket's keys), with the member token, and only to a
URL the owner directory believes (``directory.MemberTrust``).  The owner
checks what it is handed as strictly as a public request
(``forwarded_operation``): the key's bucket, the value, the EventID bounds,
and ``core.eventchecks.remote_problem`` for another site's events.

Readiness (``/readyz``): an instance is ready when it runs, the group has
assigned it its buckets (possibly none) and each of them is loaded, every
region's changelog topic exists with its partitions (checked every
``TOPIC_CHECK_S`` from the directory thread, never per probe), and no bucket
has been owned by nobody, neither this instance nor a claim it believes, for
``UNOWNED_GRACE_S``.  Buckets move between owners within seconds (a claim
stays until its successor's supersedes it, even from a killed instance), so
a bucket that stays unowned means requests for it cannot be served: its
changelog topic is gone, the group assigns it to nobody, or no claim is
believed (member_token or member_hosts differ between the instances).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import orjson
from opentelemetry.trace import SpanKind

from ..core import jsonvalue, telemetry
from ..core.codec import get_codec
from ..core.framing import frames_for
from ..core.eventchecks import event_id_problem, is_unicode, key_problem, remote_problem, value_problem
from ..core.remotewire import decode_remote, encode_remote
from ..core.config import SiteConfig
from ..core.directory import MemberTrust, OwnerDirectory, read_instances
from ..core.errors import (
    BrokerUnavailable,
    BucketUnavailable,
    ConfigError,
    EntryTooLarge,
    InvalidRequest,
    NotOwnedKeys,
    NotOwner,
    SluiceError,
    TopicMismatch,
    TopicMissing,
    UnknownRegion,
)
from ..core.events import EntryEvent, EventID
from ..core.lifecycle import Service, ServiceState
from ..core.webguard import is_loopback
from ..core.kafka import kafka_errors, make_admin, partition_for_key, topic_ids
from .directory import DirectoryPublisher
from .standby import standby_buckets
from .engine import Operation, OpResult, RegionEngine
from ..core.gatewayfilters import SenderFilters
from .conflicts import load_resolver
from .fanout import QueueTarget
from .state import Op
from .store import LocalStore
from .wancopy import WanCopies

log = logging.getLogger("sluice.region")

CLIENT_ID_PREFIX = "sluice-region@"
#: How long a request waits for a bucket this instance is loading before it is answered with a retriable
#: 503 (``BucketUnavailable``) carrying a retry hint from the load's progress (HTTP ``Retry-After``).
LOADING_WAIT_S = 1.0
#: How often the directory thread checks that every changelog topic exists (one metadata request per topic).
TOPIC_CHECK_S = 5.0
#: How long a bucket may be owned by no instance before the instances stop saying they are ready.
UNOWNED_GRACE_S = 30.0
#: transaction.timeout.ms of the instances' write transactions: the backstop that ends a transaction a
#: dead owner left open when the directory cannot name the owner to fence (loading.py says the choice).
TRANSACTION_TIMEOUT_MS = 10_000
#: How often the directory thread reads the owners' claims, places standbys and heartbeats.
DIRECTORY_REFRESH_S = 0.5
#: How long a stop waits for the directory thread to end.
THREAD_JOIN_DEADLINE_S = 5.0
_JSON = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One operation's answer as the HTTP API reports it."""

    key: str
    status: str  # ok | duplicate | skipped | conflict (a remote event lost) | error
    operation: str | None = None
    version: dict[str, Any] | None = None
    event_id: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    http_status: int = 200
    #: The applied event; its version and EventID are rendered only when asked
    #: (a bulk answer lists only the keys that were not simply applied).
    event: EntryEvent | None = None
    #: A region clear: the entries the bucket had.
    cleared: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "status": self.status}
        if self.cleared is not None:
            d["cleared"] = self.cleared
        if self.operation is not None:
            d["operation"] = self.operation
        if self.event is not None:
            d["version"] = self.event.version.to_record()
            d["event_id"] = self.event.event_id.to_record()
        if self.version is not None:
            d["version"] = self.version
        if self.event_id is not None:
            d["event_id"] = self.event_id
        if self.error is not None:
            d["error"] = self.error
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Outcome":
        status = d["status"]
        http = 200
        if status == "error":
            http = int(d.get("error", {}).get("http_status", 500))
        return cls(d["key"], status, d.get("operation"), d.get("version"), d.get("event_id"), d.get("error"), http,
                   cleared=d.get("cleared"))


def outcome_of(op: Operation, result: OpResult) -> Outcome:
    if result.error is not None:
        err = result.error.to_dict()
        err["http_status"] = result.error.http_status
        return Outcome(op.key, "error", error=err, http_status=result.error.http_status)
    if result.conflict_lost:
        return Outcome(op.key, "conflict", event_id=op.remote.event_id.to_record() if op.remote else None)
    if result.duplicate:
        eid = op.remote.event_id if op.remote is not None else op.event_id
        return Outcome(op.key, "duplicate", event_id=eid.to_record() if eid else None)
    if op.op in (Op.CLEAR, Op.DESTROY_REGION) and not result.duplicate:
        name = "REGION_CLEAR" if op.op is Op.CLEAR else "REGION_DESTROY"
        return Outcome(op.key, "ok", operation=name, cleared=result.cleared)
    if result.skipped:
        return Outcome(op.key, "skipped")
    event = result.event
    assert event is not None
    return Outcome(op.key, "ok", operation=event.operation.value, event=event)


#: The outcome of every operation simply applied, for a caller that lists only the others (a bulk
#: answer with ``outcomes=exceptions``): counted, never rendered, so one object serves them all.
APPLIED = Outcome("", "ok")


def error_outcome(key: str, error: SluiceError) -> Outcome:
    """The outcome of an operation refused before it reached an engine."""
    return outcome_of(Operation(Op.PUT, "", key), OpResult(error=error))


def _retry_routing(outcome: Outcome) -> bool:
    """Certainly not applied, and likely to succeed soon: a bucket on the move."""
    return outcome.status == "error" and outcome.error is not None and outcome.error.get("error") in (
        "NotOwner",
        "BucketUnavailable",
    )


class RegionService(Service):
    """One region-service instance: engine, router and HTTP face."""

    def __init__(self, cfg: SiteConfig, *, host: str | None = None, port: int | None = None,
                 store_dir: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        #: The local store's directory (``region_service.store_dir`` unless given; None: no store).
        self.store_dir = store_dir or cfg.region_service.store_dir
        self.store: LocalStore | None = None
        self.host = host or cfg.region_service.host
        self._port = cfg.region_service.port if port is None else port
        self.instance_id = f"{cfg.site}-{uuid.uuid4().hex[:12]}"
        rs = cfg.region_service
        #: The clients' credential (the public API) and the members' (/internal/*, apply_remote).
        self.token = rs.token.get_secret_value() if rs.token else None
        self.member_token = rs.member_token.get_secret_value() if rs.member_token else None
        self.request_timeout_s = cfg.region_service.request_timeout_s
        self.regions = {r.name: r for r in cfg.regions}
        names = cfg.topics
        self.changelog_topics = {r.name: names.region_changelog(r.name) for r in cfg.regions}
        self.group_id = f"{cfg.kafka.topic_prefix}region"
        self._sock: socket.socket | None = None
        self.url = ""
        self.engine: RegionEngine | None = None
        self.directory: OwnerDirectory | None = None
        self._publisher: DirectoryPublisher | None = None
        self._http: httpx.AsyncClient | None = None
        self._directory_thread: threading.Thread | None = None
        #: Kept by the directory thread for readiness(): changelog topics missing or resized, and since
        #: when (monotonic) each bucket owned by nobody has been so.
        self._topic_problems: dict[str, str] = {}
        self._unowned_since: dict[tuple[str, int], float] = {}
        self._next_topic_check = 0.0
        self._last_clear_us = 0
        #: The wan-copy runs this instance coordinates, and the bucket key lists it keeps for them as an owner.
        self.wan_copies = WanCopies(self)

    # --- lifecycle -----------------------------------------------------------

    def bind(self) -> socket.socket:
        """Bind the listening socket (port 0 picks one) so the URL is known early."""
        if self._sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted connections inherit TCP_NODELAY; without it a keep-alive
            # client waits ~40 ms per response (Nagle against delayed ACK).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.bind((self.host, self._port))
                self._check_exposure(sock.getsockname()[0])
            except (OSError, ConfigError):
                sock.close()
                raise
            sock.listen(512)
            sock.set_inheritable(True)
            self._sock = sock
            port = sock.getsockname()[1]
            self.url = self.cfg.region_service.advertised_url or f"http://{self.host}:{port}"
        return self._sock

    def _check_exposure(self, bound: str) -> None:
        """Refuse to listen beyond loopback without both credentials, unless the site file allows it."""
        rs = self.cfg.region_service
        if rs.allow_unauthenticated or (self.token and self.member_token):
            return
        if is_loopback(bound):
            return
        missing = " and ".join(name for name, v in (("token", self.token), ("member_token", self.member_token))
                               if not v)
        raise ConfigError([("region_service.host", bound,
                            "listening beyond loopback needs region_service.token and region_service.member_token "
                            f"(missing: {missing}); without them anyone who reaches the port reads and writes every "
                            "region and forges other sites' events. Set them, or set "
                            "region_service.allow_unauthenticated: true to accept that")])

    def start(self) -> None:
        self._check_startable()
        self.bind()
        targets: dict[str, list[QueueTarget]] = {}
        self._grouping_regions = {
            r.name for r in self.cfg.regions
            if any(self.cfg.sender(s).group_transaction_events for s in r.gateway_senders)
        }
        gates = {f.sender_id: f for f in (SenderFilters(s) for s in self.cfg.gateway_senders) if f.at_enqueue}
        for region in self.cfg.regions:
            targets[region.name] = [
                QueueTarget(
                    id=q.id,
                    topic=q.topic,
                    kind=q.kind,
                    parallel=q.parallel,
                    partitions=q.partitions,
                    order_policy=q.order_policy,
                    forward_expiration_destroy=(
                        self.cfg.queue(q.id).forward_expiration_destroy if q.kind == "async-event-queue" else False
                    ),
                    enqueue=gates[q.id].on_enqueue if q.id in gates else None,
                    # The gateway loop check happens at enqueue (fanout.py): not sent back where it came from.
                    remote_dsid=self.cfg.sender(q.id).remote_dsid if q.kind == "gateway-sender" else None,
                )
                for q in self.cfg.attached_queues(region.name)
            ]
        kafka = self.cfg.kafka
        cluster_id, topic_ids = self._check_topics()
        rs = self.cfg.region_service
        if self.store_dir is not None:
            self.store = LocalStore(self.store_dir, max_mb=rs.store_max_mb, buffer_entries=rs.store_buffer_entries,
                                    buckets=sum(r.buckets for r in self.cfg.regions), cluster_id=cluster_id,
                                    site=self.cfg.site, dsid=self.cfg.dsid)
        self.engine = RegionEngine(
            site=self.cfg.site,
            dsid=self.cfg.dsid,
            member_id=self.instance_id,
            client_id=CLIENT_ID_PREFIX + self.url,
            kafka_settings=kafka.client_settings(),
            group_settings=kafka.group_settings(),
            producer_settings=kafka.producer_settings(),
            group_id=self.group_id,
            regions={r.name: r.buckets for r in self.cfg.regions},
            changelog_topics=self.changelog_topics,
            targets=targets,
            codec=get_codec(),
            frames=frames_for(self.cfg),
            load_timeout_s=self.cfg.region_service.load_timeout_s,
            event_tracking_timeout_s=self.cfg.region_service.event_tracking_timeout_s,
            conflict_resolver=load_resolver(self.cfg.gateway_conflict_resolver),
            on_crash=self._crashed,
            on_ownership=self._owned_changed,
            dead_letter_topic=self.cfg.topics.region_dead_letter(),
            transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
            gone_owners=self._gone_owners,
            standbys=any(r.redundant_copies for r in self.cfg.regions),
            load_threads=rs.load_threads,
            store=self.store,
            topic_ids=topic_ids,
            checkpoint_interval_s=rs.store_checkpoint_interval_s,
        )
        trust = MemberTrust.from_config(self.cfg, self.url)
        self._publisher = DirectoryPublisher(self.cfg, self.instance_id, self.url, trust)
        self.directory = OwnerDirectory(self.cfg, trust)
        self.engine.start()
        self._directory_thread = self.spawn(self._directory_loop, name="region-directory")
        self._set_running()
        self._instrument()
        log.info("region service %s listening on %s", self.instance_id, self.url)

    def _instrument(self) -> None:
        for name, stat in ((telemetry.EVENTS_APPLIED, "applied"), (telemetry.DUPLICATES_DISCARDED, "duplicates"),
                           (telemetry.CONFLICTS_RESOLVED, "conflicts_lost")):
            telemetry.observe(name, self._read_engine(stat))
        telemetry.observe(telemetry.EVENTS_QUEUED, telemetry.events_queued_reader(
            self, lambda service: None if service.engine is None else service.engine.records_written,
            telemetry.queue_attributes(self.cfg, **{"sluice.component": "region"})))

    def _read_engine(self, stat: str) -> Callable[[], telemetry.Reading]:
        """A metric reader of the engine's counter ``stat`` (nothing before the engine exists)."""
        return telemetry.reader(
            self, lambda service: None if service.engine is None else service.engine.stats.get(stat, 0),
            lambda service: {**telemetry.base_attributes(service.cfg.site), "sluice.component": "region",
                             "messaging.consumer.group.name": service.group_id})

    def _check_topics(self) -> tuple[str, dict[str, str]]:
        """Refuse to start without the topics (and partition counts) the site implies; the Kafka
        cluster's id and each region's changelog topic id (what the local store's checkpoints name)."""
        admin = make_admin(self.cfg.kafka.client_settings())
        with kafka_errors(f"connecting to {self.cfg.kafka.bootstrap_servers}"):
            metadata = admin.list_topics(timeout=self.cfg.kafka.request_timeout_ms / 1000)
        needed = [(t, self.regions[r].buckets) for r, t in self.changelog_topics.items()]
        needed += [(q.topic, q.partitions) for r in self.cfg.regions for q in self.cfg.attached_queues(r.name)]
        needed.append((self.cfg.topics.region_dead_letter(), 1))
        for topic, partitions in needed:
            found = metadata.topics.get(topic)
            if found is None or found.error is not None:
                raise TopicMissing(topic)
            if len(found.partitions) != partitions:
                raise TopicMismatch(topic, "partitions", partitions, len(found.partitions))
        return metadata.cluster_id or "", topic_ids(admin, self.changelog_topics, self.cfg.kafka.request_timeout_ms)

    def _gone_owners(self, region: str, bucket: int, since_ms: int) -> list[str]:
        """The instances whose believed directory record still claims the bucket but was written
        before this instance was assigned it at ``since_ms``: a live member republishes its claims at
        every rebalance, so these are dead or frozen (the engine fences their transactions)."""
        with kafka_errors("reading the owner directory"):
            instances = read_instances(self.cfg, deadline_s=5.0)
        return sorted(i.instance for i in instances.values()
                      if i.instance != self.instance_id and i.state == "running" and i.updated_at < since_ms
                      and any(r == region and b == bucket for r, b, _ in i.claims))

    def _owned_changed(self, claims: list[tuple[str, int, int]]) -> None:
        if self._publisher is not None:
            self._publisher.publish(claims)

    def _directory_loop(self) -> None:
        assert self.directory is not None and self._publisher is not None
        while not self._stopping.is_set():
            try:
                self.directory.refresh()
                self._place_standbys()
                self._publisher.heartbeat()
                self._watch_readiness(time.monotonic())
            except SluiceError as exc:
                log.debug("owner directory refresh failed: %s", exc)
            self._stopping.wait(DIRECTORY_REFRESH_S)

    def _place_standbys(self) -> None:
        """Directory thread: the standby copies this instance keeps (standby.py's placement over the
        directory's live instances), and what the next directory record says of them."""
        engine, directory, publisher = self.engine, self.directory, self._publisher
        assert engine is not None and directory is not None and publisher is not None
        copies = {r.name: r.redundant_copies for r in self.cfg.regions}
        if not any(copies.values()) or not engine.assigned_once.is_set():
            return
        members, owners = directory.placement_view()
        engine.set_standbys(standby_buckets(self.instance_id, members, owners,
                                            {r.name: r.buckets for r in self.cfg.regions}, copies))
        publisher.set_standbys([(c.region, c.bucket, c.lag, c.entries, c.value_bytes)
                                for c in engine.standby_status()])

    def _watch_readiness(self, now: float) -> None:
        """Directory thread: what readiness() reports beyond the engine's own state (module docstring)."""
        engine, directory = self.engine, self.directory
        assert engine is not None and directory is not None
        if now >= self._next_topic_check:
            self._next_topic_check = now + TOPIC_CHECK_S
            problems = directory.topic_problems({t: self.regions[r].buckets for r, t in self.changelog_topics.items()},
                                                timeout_s=2.0)
            if problems is not None:  # None: the broker did not answer; keep what was known
                if problems != self._topic_problems and problems:
                    log.warning("changelog topics: %s", problems)
                self._topic_problems = problems
        if not engine.assigned_once.is_set():
            return
        self._unowned_since = unowned_since(
            self._unowned_since, now, {(r.name, r.buckets) for r in self.cfg.regions},
            {(region, bucket) for region, bucket, _ in engine.claims()}, directory.table())

    def _crashed(self, exc: BaseException) -> None:
        """An engine thread died of ``exc``: the instance is crashed (the CLI stops it and exits 1)."""
        self.record_crash(exc)

    def on_stop(self) -> None:
        """The first ``stop()``: leave the group cleanly, flush, close (a crashed instance too)."""
        try:
            if self.engine is not None:
                self.engine.stop()
        finally:
            if self.store is not None:
                self.store.close()
            if self._directory_thread is not None:
                self._directory_thread.join(THREAD_JOIN_DEADLINE_S)
            if self._publisher is not None:
                self._publisher.close()
            if self.directory is not None:
                self.directory.close()
            if self._sock is not None:
                self._sock.close()
            self._set_stopped()

    @property
    def ready(self) -> bool:
        """Running, and nothing in readiness()."""
        return self.state is ServiceState.RUNNING and not self.readiness()

    def readiness(self) -> dict[str, str]:
        """What keeps this instance from serving (empty when ready), for /readyz: cheap, from what the
        engine and the directory thread already know (the module docstring says the rule)."""
        if self.engine is None:
            return {"engine": "not started"}
        not_ready: dict[str, str] = {}
        if self._topic_problems:
            not_ready["topics"] = "; ".join(f"{t}: {p}" for t, p in sorted(self._topic_problems.items()))
        if not self.engine.assigned_once.is_set():
            not_ready["kafka"] = f"no buckets assigned yet by consumer group {self.group_id}"
            return not_ready
        loading = [f"{region}[{bucket}]" for region, buckets in self.engine.owned_buckets().items()
                   for bucket, status in buckets if status != "ready"]
        if loading:
            not_ready["buckets"] = f"{len(loading)} bucket(s) still loading: {', '.join(loading[:10])}"
        hanging = self.engine.hanging_transactions()
        if hanging:
            not_ready["hanging_transactions"] = (
                f"{len(hanging)} bucket(s) held by a transaction the broker never ended: "
                + ", ".join(f"{r}[{b}] from offset {o} ({s:.0f} s)" for r, b, o, s in hanging[:10])
                + " (docs/regions.md, \"Hanging transactions\")")
        now = time.monotonic()
        unowned = sorted(rb for rb, since in self._unowned_since.items() if now - since >= UNOWNED_GRACE_S)
        if unowned:
            not_ready["unowned"] = (
                f"{len(unowned)} bucket(s) owned by no instance for {UNOWNED_GRACE_S:g} s or more: "
                f"{', '.join(f'{r}[{b}]' for r, b in unowned[:10])} (the consumer group assigns them to nobody, "
                "or no instance's claim is believed: check the changelog topics, member_token and member_hosts)")
        return not_ready

    # --- request handling -----------------------------------------------------

    def region_config(self, region: str) -> Any:
        try:
            return self.regions[region]
        except KeyError:
            raise UnknownRegion(region) from None

    def encode_value(self, region: str, value: Any, field: str = "value") -> bytes:
        if value is None:
            raise InvalidRequest(field, None, "must not be null (use invalidate to clear a value)")
        try:
            data = jsonvalue.dumps(value)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(field, str(value)[:80], f"cannot be stored as JSON: {exc}") from None
        limit = self.region_config(region).value_max_bytes
        if len(data) > limit:
            raise EntryTooLarge(field, f"{len(data)} bytes", f"larger than value_max_bytes={limit}")
        return data

    def transaction_for(self, region: str, first: EventID | None) -> str | None:
        """The transaction id of a put_all / remove_all, when a gateway sender of
        the region groups transaction events (else None: nothing to mark)."""
        if region not in self._grouping_regions:
            return None
        return str(first) if first is not None else f"{self.instance_id}/{uuid.uuid4().hex}"

    def check_key(self, region: str, key: Any, field: str = "key") -> str:
        if not isinstance(key, str) or key == "":
            raise InvalidRequest(field, key, "must be a non-empty string")
        limit = self.region_config(region).key_max_bytes
        try:
            n = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequest(field, key.encode("utf-8", "backslashreplace").decode()[:80],
                                 "must be valid Unicode (it holds a lone surrogate)") from None
        if n > limit:
            raise EntryTooLarge(field, key, f"{n} bytes, larger than key_max_bytes={limit}")
        return key

    def put_all_operations(self, region: str, entries: dict[str, Any], first: EventID | None,
                           callback_argument: str | None, transaction: str | None) -> list[Operation]:
        """The operations of a put_all: entry i gets ``first``'s sequence + i, its value as stored JSON,
        its bucket.  Each key and value is checked as ``check_key`` and ``encode_value`` check them
        (the first refused raises their error, naming ``entries.<key>``), with the region's limits
        read once for the request rather than once per entry."""
        config = self.region_config(region)
        key_max, value_max, buckets = config.key_max_bytes, config.value_max_bytes, config.buckets
        dumps = jsonvalue.dumps
        member, thread, sequence = (first.member_id, first.thread_id, first.sequence_id) if first else ("", 0, 0)
        ops = []
        append = ops.append
        for i, (key, value) in enumerate(entries.items()):
            try:
                key_bytes = key.encode("utf-8") if type(key) is str else None
                data = dumps(value) if value is not None else None
            except (UnicodeEncodeError, ValueError, TypeError):
                key_bytes = data = None
            if not key_bytes or len(key_bytes) > key_max or data is None or len(data) > value_max:
                # Refused: the checks of a single write raise the error they would.
                field = f"entries.{key}"
                key_bytes = self.check_key(region, key, field).encode("utf-8")
                data = self.encode_value(region, value, field)
            append(Operation(Op.PUT_ALL, region, key, data,
                             EventID(member, thread, sequence + i) if first is not None else None,
                             callback_argument, partition_for_key(key_bytes, buckets), transaction=transaction))
        return ops

    def forwarded_operation(self, *, op: Op, region: str, key: str, value: str | None, event_id: EventID | None,
                            callback_argument: str | None, remote: str | None, transaction: str | None,
                            bucket: int, traceparent: str | None, field: str, now_ms: int) -> Operation:
        """An operation another instance forwarded, checked as strictly as a public request;
        InvalidRequest (naming ``field``) when it is refused."""
        config = self.region_config(region)
        engine = self.engine
        assert engine is not None
        if op in (Op.CLEAR, Op.DESTROY_REGION):
            if key != "" or value is not None or remote is not None:
                raise InvalidRequest(f"{field}.key", key, "a region clear or destroy names a bucket, not a key")
            if not 0 <= bucket < config.buckets:
                raise InvalidRequest(f"{field}.bucket", bucket, f"region {region!r} has buckets 0..{config.buckets - 1}")
            if event_id is None:
                raise InvalidRequest(f"{field}.event_id", None, "a forwarded region clear carries its EventID")
        else:
            problem = key_problem(self.cfg, region, key, f"{field}.key")
            if problem is not None:
                raise problem
            own = engine.bucket_of(region, key)
            if bucket not in (-1, own):
                raise InvalidRequest(f"{field}.bucket", bucket, f"key {key[:80]!r} is in bucket {own}")
            bucket = own
        if op is Op.REMOTE:
            if remote is None:
                raise InvalidRequest(f"{field}.remote", None, "an event of another site is required")
            event = decode_remote(remote, f"{field}.remote")
            if event.region != region or event.key != key:
                raise InvalidRequest(f"{field}.remote", f"{event.region}/{event.key[:80]}",
                                     f"the event is not for {region}/{key[:80]}")
            problem = remote_problem(self.cfg, event, now_ms, f"{field}.remote")
            if problem is not None:
                raise problem
            return Operation(Op.REMOTE, region, key, remote=event, bucket=bucket,
                             trace=[(telemetry.TRACEPARENT, traceparent.encode())] if traceparent else None)
        if remote is not None:
            raise InvalidRequest(f"{field}.remote", remote[:40], "only a remote operation carries an event")
        data: bytes | None = None
        if op in (Op.CREATE, Op.PUT, Op.PUT_ALL):
            if value is None:
                raise InvalidRequest(f"{field}.value", None, "must not be null (use invalidate to clear a value)")
            data = value.encode("utf-8", "surrogatepass")
            problem = value_problem(self.cfg, region, data, "json", f"{field}.value")
            if problem is not None:
                raise problem
        elif value is not None:
            raise InvalidRequest(f"{field}.value", value[:80], f"a {op.value} carries no value")
        if event_id is not None:
            problem = event_id_problem(event_id, f"{field}.event_id")
            if problem is not None:
                raise problem
        for name, text in (("callback_argument", callback_argument), ("transaction", transaction)):
            if text is not None and not is_unicode(text):
                raise InvalidRequest(f"{field}.{name}", text[:80], "must be valid Unicode (it holds a lone surrogate)")
        return Operation(op, region, key, data, event_id, callback_argument, bucket=bucket, transaction=transaction,
                         trace=[(telemetry.TRACEPARENT, traceparent.encode())] if traceparent else None)

    def clear_event_id(self, op: Op) -> EventID:
        """A region clear's EventID when the caller sent none: a stream of its own (the microsecond it
        was asked), so no clear ever continues, or jumps ahead in, another's stream."""
        self._last_clear_us = max(self._last_clear_us + 1, time.time_ns() // 1000)
        return EventID(f"{self.instance_id}-{op.value}", self._last_clear_us, 0)

    def http_client(self) -> httpx.AsyncClient:
        """The client for requests to other instances (always under /internal/, with the member token)."""
        if self._http is None:
            headers = dict(_JSON)
            if self.member_token:
                headers["authorization"] = f"Bearer {self.member_token}"
            self._http = httpx.AsyncClient(timeout=self.request_timeout_s, headers=headers)
        return self._http

    async def _to_member(self, url: str, path: str, body: dict[str, Any], *,
                         deadline: float | None = None) -> httpx.Response:
        """POST ``body`` to another instance, answered by ``deadline`` (monotonic; the client's timeout
        without one); a URL the directory would not believe is never sent anything (ConnectError:
        certainly not applied)."""
        assert self.directory is not None
        problem = self.directory.trust.url_problem(url)
        if problem is not None:
            raise httpx.ConnectError(f"not sending to {url}: {problem}")
        timeout = httpx.USE_CLIENT_DEFAULT if deadline is None else max(0.05, deadline - time.monotonic())
        return await self.http_client().post(f"{url_join(url)}{path}", content=orjson.dumps(body), timeout=timeout)

    async def execute(self, ops: list[Operation], forwarded: bool, details: bool = True) -> list[Outcome]:
        """Apply ``ops`` wherever their buckets are owned; one outcome per op, in order.  With
        ``details`` False, an op applied here is answered ``APPLIED`` (its key and version are not
        rendered) rather than an outcome of its own.

        With tracing on, the request is a span (``region.put`` ...) and each event
        another site applied is a span ``region.apply_remote``, child of the
        trace it came with; each op carries its span's ``traceparent``, which the
        engine writes as a header of its changelog and queue records."""
        if forwarded or not telemetry.tracing():
            return await self._execute(ops, forwarded, details)
        spans = self._start_spans(ops)
        try:
            outcomes = await self._execute(ops, forwarded, details)
        finally:
            for span in spans:
                span.end()
        return outcomes

    def _start_spans(self, ops: list[Operation]) -> list[Any]:
        attributes = {"sluice.site": self.cfg.site, "sluice.region": ops[0].region if ops else "",
                      "sluice.instance": self.instance_id}
        spans = []
        local: Any = None
        for op in ops:
            # An event another site applied, with the trace it came in: a span in that trace.
            parent = telemetry.header(op.trace, telemetry.TRACEPARENT) if op.op is Op.REMOTE else None
            if parent is not None:
                span = telemetry.start_span("region.apply_remote", parent=parent, kind=SpanKind.SERVER,
                                            attributes={**attributes, "sluice.key": op.key})
                spans.append(span)
            else:
                if local is None:
                    name = "region.apply_remote" if op.op is Op.REMOTE else f"region.{op.op.value}"
                    # Inside FastAPI's server span of the request.
                    local = telemetry.start_span(name, kind=SpanKind.INTERNAL,
                                                 attributes={**attributes, "sluice.operations": len(ops)})
                    spans.append(local)
                span = local
            traceparent = telemetry.traceparent_of(span)
            op.trace = None if traceparent is None else [(telemetry.TRACEPARENT, traceparent.encode())]
        return spans

    async def _execute(self, ops: list[Operation], forwarded: bool, details: bool = True) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(ops)
        todo = list(range(len(ops)))
        deadline = time.monotonic() + self.request_timeout_s
        delay = 0.02
        while todo:
            await self._route(ops, todo, outcomes, forwarded, details)
            retry = [i for i in todo if _retry_routing(outcomes[i])]  # type: ignore[arg-type]
            if forwarded or not retry or time.monotonic() + delay > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            todo = retry
        return [o for o in outcomes if o is not None]

    async def _route(self, ops: list[Operation], todo: list[int], outcomes: list[Outcome | None], forwarded: bool,
                     details: bool = True) -> None:
        engine, directory = self.engine, self.directory
        assert engine is not None and directory is not None
        local: list[int] = []
        remote: dict[str, list[int]] = {}
        # Asked once per bucket of the request (each ask takes the engine's lock); the engine checks
        # ownership again, under its lock, when it applies the op.
        owned: dict[tuple[str, int], bool] = {}
        for i in todo:
            op = ops[i]
            if op.bucket < 0:
                op.bucket = engine.bucket_of(op.region, op.key)
            bucket = op.bucket
            where = (op.region, bucket)
            owns = owned.get(where)
            if owns is None:
                owns = owned[where] = engine.owns(op.region, bucket)
            if owns:
                local.append(i)
                continue
            owner = directory.owner(op.region, bucket)
            if forwarded or owner is None or owner == self.url:
                outcomes[i] = outcome_of(op, OpResult(error=NotOwner(op.region, bucket, owner)))
            else:
                remote.setdefault(owner, []).append(i)
        tasks = []
        if local:
            tasks.append(self._apply_local(ops, local, outcomes, details))
        for url, idx in remote.items():
            tasks.append(self._forward(url, ops, idx, outcomes))
        await asyncio.gather(*tasks)

    async def _apply_local(self, ops: list[Operation], idx: list[int], outcomes: list[Outcome | None],
                           details: bool = True) -> None:
        results = await self._submit_local(ops, idx)
        for i, res in zip(idx, results):
            if details or res.event is None or res.error is not None or res.duplicate or res.conflict_lost \
                    or res.skipped or ops[i].op in (Op.CLEAR, Op.DESTROY_REGION):
                outcomes[i] = outcome_of(ops[i], res)
            else:
                outcomes[i] = APPLIED

    async def _submit_local(self, ops: list[Operation], idx: list[int]) -> list[OpResult]:
        """``ops[i]`` for each ``i`` of ``idx`` handed to this instance's engine, waiting (bounded) for
        buckets still loading; their results, in the order of ``idx``."""
        engine = self.engine
        assert engine is not None
        # Wait (bounded) for buckets that are loading rather than bouncing the caller.
        for region, bucket in {(ops[i].region, ops[i].bucket) for i in idx}:
            if not engine.is_ready(region, bucket):
                await asyncio.to_thread(engine.wait_ready, region, bucket, min(LOADING_WAIT_S, self.request_timeout_s))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[OpResult]] = loop.create_future()

        def done(results: list[OpResult]) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(results))

        mine = [ops[i] for i in idx]
        engine.submit(mine, done)
        try:
            results = await asyncio.wait_for(fut, self.request_timeout_s)
        except asyncio.TimeoutError:
            err = BrokerUnavailable("the write was not acknowledged by Kafka in time; retry with the same EventID")
            results = [OpResult(error=err) for _ in mine]
        return results

    async def apply_owned(self, ops: list[Operation]) -> list[OpResult]:
        """``ops`` applied in the buckets this instance owns, never forwarded: the engine's result of
        each, in order (a bucket another instance owns: NotOwner).  For a caller that answers for a
        whole batch at once (``remote.apply_batch``), without an ``Outcome`` per operation."""
        engine = self.engine
        assert engine is not None
        for op in ops:
            if op.bucket < 0:
                op.bucket = engine.bucket_of(op.region, op.key)
        return await self._submit_local(ops, list(range(len(ops)))) if ops else []

    async def _forward(self, url: str, ops: list[Operation], idx: list[int], outcomes: list[Outcome | None]) -> None:
        body = {"ops": [_op_to_json(ops[i]) for i in idx]}
        try:
            resp = await self._to_member(url, "/internal/ops", body)
            data = resp.json()
            if resp.status_code != 200:
                raise BrokerUnavailable(f"owner {url} answered {resp.status_code}: {data}")
            for i, d in zip(idx, data["outcomes"]):
                outcomes[i] = Outcome.from_dict(d)
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            # Not connected: certainly not applied.  Ask the directory again.
            if self.directory is not None:
                await asyncio.to_thread(self._refresh_quietly)
            for i in idx:
                op = ops[i]
                err = BucketUnavailable(op.region, op.bucket,
                                        f"owner {url} unreachable: {type(exc).__name__}")
                outcomes[i] = outcome_of(op, OpResult(error=err))
        except (httpx.HTTPError, ValueError, KeyError, BrokerUnavailable) as exc:
            err = BrokerUnavailable(f"forwarding to {url} failed, outcome unknown ({exc}); retry with the same EventID")
            for i in idx:
                outcomes[i] = outcome_of(ops[i], OpResult(error=err))

    def _refresh_quietly(self) -> None:
        try:
            if self.directory is not None:
                self.directory.refresh()
        except SluiceError:
            pass

    async def read(self, region: str, keys: list[str], forwarded: bool) -> dict[str, dict[str, Any] | None]:
        """Entries of ``keys`` from their owners: {key: {value, version, invalid} or None}."""
        engine = self.engine
        assert engine is not None
        out: dict[str, dict[str, Any] | None] = {}
        deadline = time.monotonic() + self.request_timeout_s
        todo = list(keys)
        delay = 0.02
        while todo:
            retry: list[str] = []
            remote: dict[str, list[str]] = {}
            for key in todo:
                bucket = engine.bucket_of(region, key)
                if engine.owns(region, bucket):
                    if not engine.is_ready(region, bucket):
                        await asyncio.to_thread(engine.wait_ready, region, bucket,
                                                min(LOADING_WAIT_S, self.request_timeout_s))
                        loading = engine.loading(region, bucket)
                        if loading is not None:
                            raise loading
                    try:
                        state = engine.read(region, bucket)
                    except SluiceError as exc:
                        if not exc.retriable:
                            raise
                        retry.append(key)  # moving or loading: asked again below
                        continue
                    with engine.read_lock:
                        entry = state.get(key)
                        out[key] = None if entry is None else _entry_json(entry)
                    continue
                owner = None if forwarded else self.directory.owner(region, bucket) if self.directory else None
                if owner is None or owner == self.url:
                    retry.append(key)
                else:
                    remote.setdefault(owner, []).append(key)
            for url, ks in remote.items():
                try:
                    resp = await self._to_member(url, "/internal/read", {"region": region, "keys": ks})
                    if resp.status_code != 200:
                        retry.extend(ks)
                        continue
                    data = resp.json()
                    out.update(data["entries"])
                    retry.extend(data.get("not_owned", []))
                except httpx.HTTPError:
                    retry.extend(ks)
            if not retry:
                break
            if forwarded:
                raise NotOwnedKeys(retry, out)
            if time.monotonic() + delay > deadline:
                raise BucketUnavailable(region, engine.bucket_of(region, retry[0]), "no ready owner in time")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            todo = retry
        return out

    async def keys(self, region: str, bucket: int | None, forwarded: bool) -> list[str]:
        engine = self.engine
        assert engine is not None
        buckets = range(self.region_config(region).buckets) if bucket is None else [bucket]
        deadline = time.monotonic() + self.request_timeout_s  # one for the request, not one per bucket
        out: list[str] = []
        for b in buckets:
            out.extend(await self._bucket_keys(region, b, forwarded, deadline))
        return out

    async def _bucket_keys(self, region: str, bucket: int, forwarded: bool, deadline: float) -> list[str]:
        engine = self.engine
        assert engine is not None
        delay = 0.02
        while True:
            if engine.owns(region, bucket):
                if not engine.is_ready(region, bucket):
                    await asyncio.to_thread(engine.wait_ready, region, bucket,
                                            min(LOADING_WAIT_S, self.request_timeout_s))
                    loading = engine.loading(region, bucket)
                    if loading is not None:
                        raise loading
                try:
                    state = engine.read(region, bucket)
                    with engine.read_lock:
                        return sorted(state.keys())
                except SluiceError as exc:
                    if not exc.retriable:
                        raise  # moving or loading (retriable): asked again below
            elif not forwarded and self.directory is not None:
                owner = self.directory.owner(region, bucket)
                if owner is not None and owner != self.url:
                    try:
                        resp = await self._to_member(owner, "/internal/keys", {"region": region, "bucket": bucket},
                                                     deadline=deadline)
                        if resp.status_code == 200:
                            return list(resp.json()["keys"])
                    except httpx.HTTPError:
                        pass
            if forwarded:
                raise NotOwner(region, bucket)
            if time.monotonic() + delay > deadline:
                raise BucketUnavailable(region, bucket, "no ready owner in time")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def bucket_table(self) -> list[dict[str, Any]]:
        """Per region and bucket: the owner's URL, and this instance's view of it."""
        engine, directory = self.engine, self.directory
        assert engine is not None and directory is not None
        owners = directory.table()
        mine = {(r, b): s for r, bs in engine.owned_buckets().items() for b, s in bs}
        standbys = directory.standbys()
        # This instance's own copies as they are now, not as its last directory record said.
        for copy in engine.standby_status():
            others = [(url, lag) for url, lag in standbys.get((copy.region, copy.bucket), []) if url != self.url]
            standbys[(copy.region, copy.bucket)] = sorted([*others, (self.url, copy.lag)])
        for rb in mine:
            standbys[rb] = [(url, lag) for url, lag in standbys.get(rb, []) if url != self.url]
        rows = []
        for region in self.cfg.regions:
            for b in range(region.buckets):
                rows.append({
                    "region": region.name,
                    "bucket": b,
                    "owner": self.url if (region.name, b) in mine else owners.get((region.name, b)),
                    "status": mine.get((region.name, b), "remote" if (region.name, b) in owners else "unowned"),
                    "standbys": [{"url": url, "lag": lag} for url, lag in standbys.get((region.name, b), [])],
                })
        return rows


def url_join(base: str) -> str:
    return base.rstrip("/")


def unowned_since(before: dict[tuple[str, int], float], now: float, regions: set[tuple[str, int]],
                  mine: set[tuple[str, int]], claimed: dict[tuple[str, int], str]) -> dict[tuple[str, int], float]:
    """Each bucket of ``regions`` ((name, buckets)) that neither this instance (``mine``) nor a believed
    claim owns, with since when (the time it was first seen so, from ``before``, else ``now``)."""
    out: dict[tuple[str, int], float] = {}
    for region, buckets in regions:
        for bucket in range(buckets):
            rb = (region, bucket)
            if rb not in mine and rb not in claimed:
                out[rb] = before.get(rb, now)
    return out


def _entry_json(entry: Any) -> dict[str, Any]:
    return {
        "value": None if entry.value is None else jsonvalue.loads(entry.value),
        "invalid": entry.value is None,
        "version": entry.version.to_record(),
        "event_id": entry.event_id.to_record(),
    }


def _op_to_json(op: Operation) -> dict[str, Any]:
    return {
        "op": op.op.value,
        "region": op.region,
        "key": op.key,
        "value": None if op.value is None else op.value.decode("utf-8"),
        "event_id": op.event_id.to_record() if op.event_id else None,
        "callback_argument": op.callback_argument,
        "remote": None if op.remote is None else encode_remote(op.remote),
        "transaction": op.transaction,
        "bucket": op.bucket,
        "traceparent": (telemetry.header(op.trace, telemetry.TRACEPARENT) or b"").decode() or None,
    }


__all__ = ["EntryEvent", "NotOwnedKeys", "Outcome", "RegionService", "ServiceState", "error_outcome", "unowned_since"]
