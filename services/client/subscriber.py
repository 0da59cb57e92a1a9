"""``ClientCache``: a downstream service's subscribed, locally cached view of a site's regions.

Geode's client cache with a subscription-enabled pool, on Kafka:

* region operations (create, put, destroy) pass the region's cache writer,
  go to the region service, then into the local cache, and the region's
  listeners hear of them; ``local_invalidate`` stays local;
* ``register_interest`` / ``register_interest_regex`` record interest with
  the subscription service (in its registry), wait until the service
  answers that the interest is in force, then load the cache (keys and
  values, keys, or nothing) following Geode's rules;
* a thread reads the client's queue: repeats are discarded by EventID,
  messages before the marker are replayed to listeners without touching
  the cache, ``after_region_live`` fires at the marker, then events update
  the cache and reach the listeners; what was read is acknowledged every
  ``subscription-ack-interval`` (an idle client pings);
* ``ready_for_events`` is synchronous, as Geode's ``readyForEvents``: it
  returns once the service has placed the marker in the client's queue, so
  every event written after it returns is live, never replayed;
* a durable client (``durable=True``) that closes with ``keep_alive=True``,
  crashes or loses its connection keeps its queue and durable interest until
  its ``durable-client-timeout``; reconnecting with the same id resumes the
  queue where it was acknowledged, and ``pending_event_count()`` says how
  many events wait in it (Geode's ``getPendingEventCount``).  A queue found
  gone (timed out, dropped full, or its unacknowledged head expired) makes
  the client start over as a new one: its interest is fetched again into
  the cache, with no events.

Example::

    from sluice.client import ALL_KEYS, PENDING_QUEUE_DROPPED, ClientCache

    cache = ClientCache("deploy/sites/site-b.yaml", client_id="pricing-1", durable=True)
    orders = cache.region("orders")
    orders.add_listener(MyListener())               # after_create, after_update, after_destroy, ...
    orders.register_interest(ALL_KEYS, durable=True)
    if cache.pending_event_count() == PENDING_QUEUE_DROPPED:
        ...                                         # events were lost while away: resynchronise
    cache.ready_for_events()                        # returns once the marker is in the queue
    orders.get("o-1")                               # from the local cache
    orders.put("o-2", {"qty": 1})                   # through the region service
    cache.close(keep_alive=True)                    # the queue keeps filling while away
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from ..core.clientregistry import (
    CLIENT_ID,
    QUEUE_DROPPED,
    bearer,
    configured_token,
    create_queue,
    new_queue_topic,
    queue_topic_problem,
    read_latest,
    read_latest_record,
    registry_partition,
    unregistered_reason,
)
from ..core.codec import get_codec
from ..core.config import SiteConfig, load_config
from ..core.errors import (
    CacheWriterAbort,
    ClosedError,
    CodecError,
    InvalidRequest,
    KafkaCallFailed,
    NoServersAvailable,
    RegionUnavailable,
    RegistrationRefused,
    SluiceError,
)
from ..core.events import Operation
from ..core.interest import ALL_KEYS, Delivery, Registration, RegionInterest, ResultPolicy, compile_regex
from ..core.kafka import (
    TOPIC_MISSING,
    KafkaError,
    TopicPartition,
    consume_available,
    kafka_errors,
    make_admin,
    partition_for_key,
    make_consumer,
    make_producer,
    read_to_end,
)
from ..core.regionclient import RegionClient
from .cache import EventTracker, RegionCache
from .messages import ClientEvent, MessageProcessor, event_of_message, read_event

log = logging.getLogger("sluice.client")
#: What a deleted queue looks like to a consumer.
MISSING = TOPIC_MISSING | {getattr(KafkaError, "UNKNOWN_TOPIC_ID", 100)}
#: How long the broker holds an idle client's fetch (a message ends the wait at once): an idle
#: client costs two fetches a second, not fifty.
IDLE_FETCH_WAIT_MS = 500
#: Keys asked of the region service per get_all during a load.
LOAD_CHUNK = 1000
#: Refused registration versions remembered (the newest), for the registrations waiting on them.
REFUSALS_KEPT = 64
#: ``pending_event_count()`` of a durable client that found no queue of its own: it connected for the first
#: time, or after closing without keep-alive (Geode's PoolImpl.PRIMARY_QUEUE_NOT_AVAILABLE).
PENDING_NO_QUEUE = -2
#: ``pending_event_count()`` of a durable client whose queue the service dropped while it was away, after its
#: durable-client-timeout or because the queue reached maximum-message-count: events were lost, and the client
#: resynchronises (Geode's PoolImpl.PRIMARY_QUEUE_TIMED_OUT, said there for the timeout only).
PENDING_QUEUE_DROPPED = -1
#: How long reading a resumed queue's waiting events (to count them) may take.
PENDING_READ_S = 120.0


class ClientRegion:
    """One region as a client sees it: the local cache, interest, writer and listeners."""

    def __init__(self, owner: "ClientCache", name: str) -> None:
        self._owner = owner
        self.name = name
        self.cache = RegionCache(name)
        self.interest = RegionInterest()
        self.registrations: list[Registration] = []
        self.listeners: list[Any] = []
        self.cache_writer: Any = None
        self.destroyed = False

    # --- listeners and writer -----------------------------------------------------------

    def add_listener(self, listener: Any) -> None:
        """A listener: any object with some of after_create, after_update, after_invalidate,
        after_destroy, after_region_clear, after_region_destroy, after_region_live."""
        self.listeners.append(listener)

    def set_cache_writer(self, writer: Any) -> None:
        """A writer with before_create / before_update / before_destroy(event); raising aborts the operation."""
        self.cache_writer = writer

    # --- reads ---------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The local value; a key not held (or invalid) is fetched from the region service
        and kept; unreachable servers: the local cache's answer."""
        with self._owner._lock:
            if self.cache.contains_value_for_key(key):
                return self.cache.get(key)
        try:
            entry = self._owner._region_client().get_entry(self.name, key)
        except SluiceError as exc:
            if not exc.retriable:
                raise  # the region service refused the read
            return default  # no server answered: the local cache's answer
        if entry is None or entry.get("invalid"):
            return default
        with self._owner._lock:
            if not self.cache.contains_value_for_key(key):
                self.cache.put(key, entry["value"])
            return self.cache.get(key)

    def get_local(self, key: str, default: Any = None) -> Any:
        with self._owner._lock:
            return self.cache.get(key) if self.cache.contains_value_for_key(key) else default

    def keys(self) -> list[str]:
        with self._owner._lock:
            return list(self.cache.entries)

    def snapshot(self) -> dict[str, Any]:
        """Key → value (None for an invalid entry) of everything held locally."""
        with self._owner._lock:
            return {k: e.value if e.valid else None for k, e in self.cache.entries.items()}

    def __len__(self) -> int:
        return len(self.cache)

    # --- writes: writer → region service → local cache → listeners -------------------------

    def create(self, key: str, value: Any, *, callback_argument: str | None = None) -> None:
        self._write(Operation.CREATE, key, value, callback_argument)

    def put(self, key: str, value: Any, *, callback_argument: str | None = None) -> None:
        self._write(None, key, value, callback_argument)

    def destroy(self, key: str, *, callback_argument: str | None = None) -> None:
        """Destroy on the server, whether or not this client holds the key."""
        self._write(Operation.DESTROY, key, None, callback_argument)

    def clear(self, *, callback_argument: str | None = None) -> None:
        """Clear the region on the server (every entry), then locally; other clients with interest
        in the region hear of it, this one's listeners get ``after_region_clear`` now."""
        owner = self._owner
        client = owner._region_client()
        event_id = client.next_event_id()
        event = ClientEvent(self.name, None, Operation.REGION_CLEAR, None, event_id, Delivery.VALUES,
                            callback_argument=callback_argument)
        self._writer_check("before_region_clear", event)
        owner._send_or_unconnected(lambda: client.clear(self.name, event_id=event_id), f"clear of {self.name}")
        with owner._lock:
            self.cache.clear()
            owner._processor._call(self.name, "after_region_clear", event)

    def destroy_region(self, *, callback_argument: str | None = None) -> None:
        """Destroy the region on the server (its entries go; subscribed clients drop it), then here:
        this client forgets the region, its listeners get ``after_region_destroy``."""
        owner = self._owner
        client = owner._region_client()
        event_id = client.next_event_id()
        event = ClientEvent(self.name, None, Operation.REGION_DESTROY, None, event_id, Delivery.VALUES,
                            callback_argument=callback_argument)
        self._writer_check("before_region_destroy", event)
        owner._send_or_unconnected(lambda: client.destroy_region(self.name, event_id=event_id),
                                   f"destroy of region {self.name}")
        with owner._lock:
            self.cache.clear()
            owner._processor._call(self.name, "after_region_destroy", event)
            owner._drop_region(self.name)

    def local_invalidate(self, key: str) -> bool:
        """Invalidate the local entry only (nothing is sent)."""
        with self._owner._lock:
            return self.cache.invalidate(key)

    def _check_alive(self) -> None:
        if self.destroyed:
            raise InvalidRequest("region", self.name, "was destroyed; cache.region(name) starts it again")

    def _write(self, op: Operation | None, key: str, value: Any, callback_argument: str | None) -> None:
        self._check_alive()
        owner = self._owner
        with owner._lock:
            held = self.cache.contains_key(key)
        is_put = op is None
        if op is None:
            op = Operation.UPDATE if held else Operation.CREATE
        client = owner._region_client()
        event_id = client.next_event_id()
        event = ClientEvent(self.name, key, op, value, event_id, Delivery.VALUES, callback_argument=callback_argument)
        self._writer_check({Operation.CREATE: "before_create", Operation.UPDATE: "before_update",
                            Operation.DESTROY: "before_destroy"}[op], event)

        def send() -> Any:
            if op is Operation.DESTROY:
                return client.destroy(self.name, key, event_id=event_id)
            if not is_put:
                return client.create(self.name, key, value, callback_argument=callback_argument, event_id=event_id)
            return client.put(self.name, key, value, callback_argument=callback_argument, event_id=event_id)

        owner._send_or_unconnected(send, f"{op.value} of {self.name}/{key}")
        with owner._lock:
            if op is Operation.DESTROY:
                existed = self.cache.destroy(key)
                callback = "after_destroy" if existed else None
            else:
                self.cache.put(key, value)
                callback = "after_update" if held else "after_create"
            if callback is not None:
                owner._processor._call(self.name, callback, event)

    def _writer_check(self, method: str, event: ClientEvent) -> None:
        """The cache writer's ``method``: raising aborts the operation (nothing sent)."""
        writer = self.cache_writer
        hook = getattr(writer, method, None) if writer is not None else None
        if hook is None:
            return
        try:
            hook(event)
        except Exception as exc:
            what = event.operation.value + " of " + self.name + (f"/{event.key}" if event.key is not None else "")
            raise CacheWriterAbort(f"{type(writer).__name__}.{method} refused {what}: {exc}") from exc

    # --- interest ---------------------------------------------------------------------------

    def register_interest(self, keys: str | list[str] | tuple[str, ...], *,
                          policy: ResultPolicy | str = ResultPolicy.KEYS_VALUES, durable: bool = False,
                          receive_values: bool = True) -> int:
        """Interest in a key, a list of keys or ``ALL_KEYS``; the number of entries the load set."""
        reg = Registration.of_keys(keys, durable=durable, receive_values=receive_values,
                                   result_policy=ResultPolicy(policy))
        return self._owner._register(self, reg)

    def register_interest_regex(self, pattern: str, *, policy: ResultPolicy | str = ResultPolicy.KEYS_VALUES,
                                durable: bool = False, receive_values: bool = True) -> int:
        """Interest in every key the regular expression matches as a whole."""
        reg = Registration.of_regex(pattern, durable=durable, receive_values=receive_values,
                                    result_policy=ResultPolicy(policy))
        return self._owner._register(self, reg)

    def unregister_interest(self, keys: str | list[str] | tuple[str, ...]) -> None:
        self._owner._unregister(self, Registration.of_keys(keys))

    def unregister_interest_regex(self, pattern: str) -> None:
        self._owner._unregister(self, Registration.of_regex(pattern))

    def covered(self, key: str) -> bool:
        return self.interest.delivery(key) is not None


class ClientCache:
    """A client of one site: its regions' local caches and its subscription."""

    def __init__(
        self,
        site: SiteConfig | str | Path,
        client_id: str | None = None,
        *,
        durable: bool = False,
        durable_timeout_s: int | None = None,
        subscription_redundancy: int = 0,
        region_urls: Iterable[str] | None = None,
        token: str | None = None,
        subscription_token: str | None = None,
        registration_timeout_s: float = 30.0,
        request_retry_s: float = 10.0,
    ) -> None:
        self.cfg = site if isinstance(site, SiteConfig) else load_config(site)
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        if not CLIENT_ID.fullmatch(self.client_id):
            raise InvalidRequest("client_id", self.client_id,
                                 "1–100 letters, digits, '_' or '-', starting with a letter or digit")
        if subscription_redundancy < 0:
            raise InvalidRequest("subscription_redundancy", subscription_redundancy, "must be 0 or more")
        self.durable = durable
        self.durable_timeout_s = durable_timeout_s or self.cfg.subscriptions.durable_client_timeout_s
        self.redundancy = subscription_redundancy
        urls = list(region_urls or [])
        if not urls and self.cfg.region_service.advertised_url:
            urls = [self.cfg.region_service.advertised_url]
        if not urls:
            urls = [f"http://{self.cfg.region_service.host}:{self.cfg.region_service.port}"]
        self.region_urls = urls
        self._token = token or (self.cfg.region_service.token.get_secret_value()
                                if self.cfg.region_service.token else None)
        # Sent with every registry record when the subscription service requires one.
        self._subscription_token = subscription_token or configured_token(self.cfg)
        #: Why the subscription service refused this client's registration, once it did (the latest refusal).
        self.refused: str | None = None
        self._refusals: dict[int, str] = {}  # registration version of this session -> why it was refused
        self._registration_timeout_s = registration_timeout_s
        self._request_retry_s = request_retry_s
        names = self.cfg.topics
        self._registry_topic = names.subscription_registry()
        self._acks_topic = names.subscription_acks()
        self._partition = registry_partition(self.client_id, self.cfg.subscriptions.registry_partitions)
        self._codec = get_codec()
        self._message_header = self._codec.header("ClientMessage")
        self._lock = threading.RLock()
        self._answered = threading.Condition(self._lock)
        self._regions: dict[str, ClientRegion] = {}
        self._tracker = EventTracker(self.cfg.subscriptions.subscription_message_tracking_timeout_ms)
        self._processor = MessageProcessor({}, self._tracker, {}, bucket_of=self._bucket_of)
        self._processor.on_region_destroyed = self._drop_region
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: RegionClient | None = None
        self.member_id = f"{self.client_id}-{uuid.uuid4().hex[:8]}"
        self.stats = {"received": 0, "events": 0, "reinitialized": 0, "acks": 0}
        self.error: BaseException | None = None
        self.replayed_queue = False  # this connection resumed a durable queue
        self.closed = False
        #: Geode's pending event count, fixed when this client connected (``pending_event_count``).
        self._pending = PENDING_NO_QUEUE
        self._ready_called = False
        #: (session, queue offset): where a marker of that session can first be in the queue (its end before
        #: the session's first record that asked for one).
        self._marker_from: tuple[str, int] | None = None
        #: The session whose marker is known to be in the queue.
        self._marker_queued: str | None = None

        base = self.cfg.kafka.client_settings()
        self._producer = make_producer(base, **{"client.id": self.client_id})
        self._admin = make_admin(base)
        self._consumer = make_consumer(base, None,
                                       **{"client.id": self.client_id, "fetch.wait.max.ms": IDLE_FETCH_WAIT_MS})
        self._connect()
        self._thread = threading.Thread(target=self._run, name=f"client-{self.client_id}", daemon=True)
        self._thread.start()

    # --- regions -------------------------------------------------------------------------

    def region(self, name: str) -> ClientRegion:
        """The client's view of ``name`` (a region of the site)."""
        self.cfg.region(name)  # UnknownRegion names the region and the site's regions
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                region = ClientRegion(self, name)
                self._regions[name] = region
                self._processor.caches[name] = region.cache
                self._processor.listeners[name] = region.listeners
            return region

    def _drop_region(self, name: str) -> None:
        """The region was destroyed: this client forgets it (cache, interest); ``region(name)`` starts
        it anew.  Called with the lock held."""
        region = self._regions.pop(name, None)
        self._processor.caches.pop(name, None)
        self._processor.listeners.pop(name, None)
        if region is not None:
            region.destroyed = True
            if region.registrations:
                self._record["interest"] = self._interest_records()
                self._publish()

    def _bucket_of(self, region: str, key: str) -> int:
        return partition_for_key(key.encode(), self.cfg.region(region).buckets)

    def ready_for_events(self, timeout_s: float | None = None) -> None:
        """Listeners are in place: the service places the marker in this client's queue; the messages
        before it are replayed, those after it are live.

        Synchronous, as Geode's ``readyForEvents``: it returns once the marker is in the queue, so an event
        written after it returns comes after the marker and reaches the listeners live (``replayed`` False).
        The replay before the marker may still be reaching the listeners (``live`` turns True at the
        marker).  ``NoServersAvailable`` when no subscription service placed the marker within
        ``timeout_s`` (default: the client's ``registration_timeout_s``): the readiness stays recorded and
        the marker comes once a service runs (call again to wait for it); ``RegistrationRefused`` when the
        service refused the record.  Calling it again once the marker is placed returns at once."""
        wait_s = self._registration_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self.closed:
                raise ClosedError(f"client {self.client_id} is closed")
            self._ready_called = True
            if self._marker_queued == self._session:
                return
            session = self._session
            if self._marker_from is None or self._marker_from[0] != session:
                # No marker of this session can be before the queue's end now: the service places it
                # only after reading a record of this session that asks for it, published next.
                self._marker_from = (session, self._queue_end(self.queue_topic))
            self._record["ready"] = True
            self._publish()
            version = self._record["version"]
        self._wait_marker(session, version, wait_s)

    def pending_event_count(self) -> int:
        """Geode's ``getPendingEventCount``: how many events waited in this durable client's queue when it
        connected, for it to weigh before ``ready_for_events``: each event once (a message filled again
        after a failover of the service counts once), a region clear once.  ``PENDING_NO_QUEUE`` (-2): no
        queue of its own was found, it connected for the first time (or as a new client after closing
        without keep-alive); ``PENDING_QUEUE_DROPPED`` (-1): the service dropped its queue while it was
        away (its durable-client-timeout passed, or the queue reached ``maximum_message_count``), so events
        were lost and the client starts over with its interest fetched again (resynchronise).  The same
        value on every call of a connection; ``InvalidRequest`` for a client that is not durable or once
        ``ready_for_events`` was called, as in Geode."""
        if not self.durable:
            raise InvalidRequest("durable", False, "only a durable client has a pending event count")
        if self._ready_called:
            raise InvalidRequest("pending_event_count", "after ready_for_events",
                                 "it is read before ready_for_events(), while the queue waits")
        return self._pending

    @property
    def live(self) -> bool:
        return self._processor.live

    @property
    def queue_topic(self) -> str:
        return self._record["queue_topic"]

    def processed(self) -> dict[str, int]:
        """What the message stream did: applied, replayed, repeats, ignored, received."""
        with self._lock:
            return {**self._processor.stats, "received": self.stats["received"]}

    # --- connecting ----------------------------------------------------------------------

    def _connect(self) -> None:
        """Resume a durable client's queue, or start as a new client."""
        existing, dropped = self._read_registration()
        ack = self._read_record(self._acks_topic, "ClientAck")
        if existing is not None and (existing["client_id"] != self.client_id or
                                     queue_topic_problem(self.cfg, self.client_id, existing["queue_topic"])):
            # Not this client's record (a forgery, issue 17): neither resumed nor deleted.
            log.warning("client %s: its registry record names client %r and queue %r, not a queue of its own "
                        "(%s); it is ignored, and the client starts as a new one", self.client_id,
                        existing["client_id"], existing["queue_topic"],
                        queue_topic_problem(self.cfg, self.client_id, existing["queue_topic"]) or "another client")
            existing = None
        if existing is not None and existing["durable"] and self.durable:
            self.replayed_queue = True
            queue_topic = existing["queue_topic"]
            interest = [r for r in existing["interest"] if r["durable"]]
            version = existing["version"]
            self._next = (ack["next_offset"] if ack is not None and ack["client_id"] == self.client_id
                          and ack["queue_topic"] == queue_topic and ack["next_offset"] >= 0 else 0)
            self._pending = self._count_waiting(queue_topic)
            log.info("client %s: durable queue %s resumed at %d, %d events waiting", self.client_id, queue_topic,
                     self._next, self._pending)
        else:
            if existing is not None:
                self._drop_queue(existing["queue_topic"])
            elif dropped is not None and self.durable:
                self._pending = PENDING_QUEUE_DROPPED
                log.warning("client %s: the subscription service dropped its durable queue while it was away (%s); "
                            "it starts as a new client, its events since are lost: resynchronise "
                            "(pending_event_count() is -1)", self.client_id, dropped)
            queue_topic = new_queue_topic(self.cfg, self.client_id)
            interest, version, self._next = [], 0, 0
        create_queue(self._admin, self.cfg, queue_topic, self.durable)
        self._session = uuid.uuid4().hex[:12]
        self._record: dict[str, Any] = {
            "client_id": self.client_id, "member_id": self.member_id, "durable": self.durable,
            "durable_timeout_s": self.durable_timeout_s, "redundancy": self.redundancy,
            "queue_topic": queue_topic, "session": self._session, "version": version,
            "interest": interest, "connected": True, "keep_alive": False, "ready": False, "changed_at": 0,
        }
        self._answered_version = -1
        self._loading_from: int | None = None  # the first registration version of this connection that loads
        with self._lock:
            self._publish()
        self._consumer.assign([TopicPartition(queue_topic, 0, self._next)])

    def _read_registration(self) -> tuple[dict[str, Any] | None, str | None]:
        """This client's registration in force (None: none), and, when its newest registry record is the
        service's tombstone of a dropped queue (``QUEUE_DROPPED``), why it was dropped."""
        latest = read_latest_record(self.cfg, self._registry_topic, self._partition, self.client_id,
                                    token=self._subscription_token)
        if latest is None:
            return None, None
        raw, headers = latest
        if raw is None:
            reason = unregistered_reason(headers)
            return None, reason if reason in QUEUE_DROPPED else None
        return self._decoded(raw, "ClientRegistration"), None

    def _count_waiting(self, queue_topic: str) -> int:
        """The events waiting in a resumed queue, from this client's acknowledged position to the queue's
        end now: each EventID once (a refill after a failover repeats messages; a region clear is one
        message per bucket)."""
        events: set[tuple[str, int, int]] = set()
        with kafka_errors(f"counting the events waiting in {queue_topic}"):
            for msg in read_to_end(self._consumer, queue_topic, 0, deadline_s=PENDING_READ_S, start=self._next):
                try:
                    message = self._codec.decode_as("ClientMessage", msg.value())
                except CodecError:
                    continue  # the reader logs it when it reaches it
                if message["kind"] == "EVENT" and message["event"] is not None:
                    e = message["event"]["event_id"]
                    events.add((e["member_id"], e["thread_id"], e["sequence_id"]))
        return len(events)

    def _queue_end(self, queue_topic: str) -> int:
        """The queue's end offset now (0 when it cannot be read: the search for the marker starts at its start)."""
        probe = make_consumer(self.cfg.kafka.client_settings(), None, **{"client.id": f"{self.client_id}-ready"})
        try:
            with kafka_errors(f"reading the end of {queue_topic}"):
                return int(probe.get_watermark_offsets(TopicPartition(queue_topic, 0), timeout=10)[1])
        except SluiceError as exc:
            log.warning("client %s: %s; looking for the marker from its start", self.client_id, exc)
            return 0
        finally:
            probe.close()

    def _wait_marker(self, session: str, version: int, wait_s: float) -> None:
        """Until the marker of ``session`` is in the queue: read by a consumer of its own from where it can
        first be (``_marker_from``), or seen by the queue's reader.  A session started over meanwhile (the
        queue was lost) is followed: its record asks for a marker too."""
        deadline = time.monotonic() + wait_s
        finder = make_consumer(self.cfg.kafka.client_settings(), None,
                               **{"client.id": f"{self.client_id}-ready", "fetch.wait.max.ms": 50})
        assigned: tuple[str, str, int] | None = None
        try:
            while True:
                with self._lock:
                    if self._marker_queued == self._session:
                        return
                    if self._session != session:
                        session, version = self._session, self._record["version"]
                    if version in self._refusals:
                        raise RegistrationRefused(self.client_id, self._refusals[version])
                    if self.closed:
                        raise ClosedError(f"client {self.client_id} closed while waiting for its marker")
                    topic = self.queue_topic
                    start = self._marker_from[1] if self._marker_from and self._marker_from[0] == session else 0
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoServersAvailable(
                        f"client {self.client_id}: the marker was not placed in its queue within {wait_s:g} s: no "
                        f"subscription service instance answered (is `sluice subscriptions` running?); the client "
                        f"is recorded ready and turns live once one places the marker")
                if assigned != (session, topic, start):
                    finder.assign([TopicPartition(topic, 0, start)])
                    assigned = (session, topic, start)
                with kafka_errors(f"reading {topic} for the marker"):
                    msgs = consume_available(finder, 500, min(left, 0.25))
                for msg in msgs:
                    if msg.error() is not None:
                        continue  # a queue gone is the reader's to handle (it starts over)
                    try:
                        message = self._codec.decode_as("ClientMessage", msg.value())
                    except CodecError:
                        continue
                    if message["session"] != session:
                        continue
                    if message["kind"] == "MARKER":
                        with self._lock:
                            if self._session == session:
                                self._marker_queued = session
                                return
                    elif message["kind"] == "REFUSED" and message["version"] == version:
                        raise RegistrationRefused(self.client_id, message["reason"])
        finally:
            finder.close()

    def _read_record(self, topic: str, schema: str) -> dict[str, Any] | None:
        """This client's newest record of ``topic`` (with a token, the newest that carries it)."""
        raw = read_latest(self.cfg, topic, self._partition, self.client_id, token=self._subscription_token)
        return None if raw is None else self._decoded(raw, schema)

    def _decoded(self, raw: bytes, schema: str) -> dict[str, Any] | None:
        try:
            return self._codec.decode_as(schema, raw)
        except CodecError as exc:
            log.error("client %s: its %s record cannot be read (%s); starting as a new client",
                      self.client_id, schema, exc)
            return None

    def _drop_queue(self, topic: str) -> None:
        """Delete this client's previous queue (only ever a queue of its own: checked by the caller)."""
        assert queue_topic_problem(self.cfg, self.client_id, topic) is None, topic
        try:
            with kafka_errors(f"deleting {topic}"):
                for fut in self._admin.delete_topics([topic], operation_timeout=10).values():
                    fut.result(timeout=15)
        except SluiceError:
            pass  # already gone

    def _publish(self) -> None:
        """Write the registry record (caller holds the lock)."""
        self._record["version"] += 1
        self._record["changed_at"] = int(time.time() * 1000)
        value = self._codec.encode("ClientRegistration", self._record)
        self._producer.produce(self._registry_topic, value, self.client_id.encode(), partition=self._partition,
                               headers=bearer(self._subscription_token))
        self._producer.flush(30)

    # --- interest ---------------------------------------------------------------------------

    def _register(self, region: ClientRegion, reg: Registration) -> int:
        region._check_alive()
        with self._lock:
            region.cache.begin_registration(self._covered(reg))
            region.interest.register(reg)
            region.registrations.append(reg)
            self._record["interest"] = self._interest_records()
            self._publish()
            version = self._record["version"]
            if self._loading_from is None:
                self._loading_from = version
        try:
            self._wait_answer(version)
            loaded, invalid = self._load(region, reg)
        except BaseException:
            with self._lock:
                region.cache.finish_load({}, ResultPolicy.NONE)
            raise
        with self._lock:
            return region.cache.finish_load(loaded, reg.result_policy, invalid)

    @staticmethod
    def _covered(reg: Registration) -> list[str] | Callable[[str], bool] | None:
        """What a registration's step 1 destroys: its keys, its regex's matches, or everything."""
        if reg.all_keys:
            return None
        if reg.regex is not None:
            return compile_regex(reg.regex).fullmatch  # type: ignore[no-any-return]
        return list(reg.keys)

    def _unregister(self, region: ClientRegion, reg: Registration) -> None:
        with self._lock:
            region.interest.unregister(reg)
            region.registrations = [r for r in region.registrations
                                    if not (r.keys == reg.keys and r.all_keys == reg.all_keys and r.regex == reg.regex)]
            region.cache.drop_where(lambda k: region.interest.delivery(k) is None)
            self._record["interest"] = self._interest_records()
            self._publish()

    def _interest_records(self) -> list[dict[str, Any]]:
        return [{"region": region.name, "keys": list(r.keys), "all_keys": r.all_keys, "regex": r.regex,
                 "durable": r.durable, "receive_values": r.receive_values}
                for region in self._regions.values() for r in region.registrations]

    def _wait_answer(self, version: int) -> None:
        deadline = time.monotonic() + self._registration_timeout_s
        with self._answered:
            while self._answered_version < version:
                if version in self._refusals:
                    raise RegistrationRefused(self.client_id, self._refusals[version])
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise NoServersAvailable(
                        f"client {self.client_id}: no subscription service instance answered its registration "
                        f"in {self._registration_timeout_s:.0f} s (is `sluice subscriptions` running?); the "
                        f"interest is recorded and applies once one runs")
                self._answered.wait(min(left, 0.5))

    def _load(self, region: ClientRegion, reg: Registration) -> tuple[dict[str, Any], set[str]]:
        if reg.result_policy is ResultPolicy.NONE:
            return {}, set()
        client = self._region_client()
        if reg.all_keys or reg.regex is not None:
            pattern = compile_regex(reg.regex) if reg.regex is not None else None
            keys = [k for k in client.keys(region.name) if pattern is None or pattern.fullmatch(k)]
        else:
            keys = list(reg.keys)
        loaded: dict[str, Any] = {}
        invalid: set[str] = set()
        for i in range(0, len(keys), LOAD_CHUNK):
            for key, entry in client.get_all(region.name, keys[i:i + LOAD_CHUNK]).items():
                if entry is None:
                    continue
                loaded[key] = entry["value"]
                if entry.get("invalid"):
                    invalid.add(key)
        return loaded, invalid

    def _send_or_unconnected(self, send: Callable[[], Any], what: str) -> Any:
        """Send to the region service; no instance reachable → NoServersAvailable (nothing applied)."""
        try:
            return send()
        except RegionUnavailable as exc:
            raise NoServersAvailable(
                f"no region service instance answered ({', '.join(self.region_urls)}): {what} was not "
                f"applied; reads are served from the local cache ({exc})") from exc

    def _region_client(self) -> RegionClient:
        with self._lock:
            if self._client is None:
                self._client = RegionClient(self.region_urls, token=self._token, member_id=self.member_id,
                                            retry_for_s=self._request_retry_s)
            return self._client

    # --- the queue --------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self.cfg.subscriptions
        acked, last_ack = self._next, 0.0
        try:
            while not self._stopping.is_set():
                with kafka_errors(f"reading {self.queue_topic}"):
                    msgs = consume_available(self._consumer, 500, 0.1)
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() in MISSING or err.code() == KafkaError.OFFSET_OUT_OF_RANGE:
                            self._start_over(f"its queue is gone or its head expired ({err.str()})")
                            acked = self._next
                            break
                        continue
                    self._handle(msg.value())
                    self._next = msg.offset() + 1
                now = time.monotonic()
                due_ack = self._next != acked and now - last_ack >= sub.subscription_ack_interval_ms / 1000
                due_ping = now - last_ack >= sub.ping_interval_ms / 1000
                if due_ping and not msgs:
                    lost = self._queue_lost()
                    if lost is not None:
                        self._start_over(lost)
                        acked = self._next
                if due_ack or due_ping:
                    self._ack()
                    acked, last_ack = self._next, now
        except BaseException as exc:  # noqa: BLE001 - kept for the owner to see
            self.error = exc
            log.exception("client %s: its queue reader stopped", self.client_id)

    def _queue_lost(self) -> str | None:
        """Why the queue can no longer be read from where this client is, or None when it can."""
        try:
            with kafka_errors(f"reading the ends of {self.queue_topic}"):
                low, high = self._consumer.get_watermark_offsets(TopicPartition(self.queue_topic, 0), timeout=5)
        except KafkaCallFailed as exc:
            if exc.code not in MISSING:
                return None  # the broker is away: nothing to conclude
            try:  # the cluster's own answer, not a cached one
                with kafka_errors(f"listing {self.queue_topic}"):
                    listed = self._consumer.list_topics(self.queue_topic, timeout=5).topics.get(self.queue_topic)
            except SluiceError:
                return None
            if listed is None or (listed.error is not None and listed.error.code() in MISSING):
                return f"its queue {self.queue_topic} is gone"
            return None
        if low > self._next:
            return f"its queue's head expired before it was read (offsets {self._next}–{low - 1})"
        if high < self._next:
            return f"its queue {self.queue_topic} was deleted and made again"
        return None

    def _handle(self, raw: bytes | None) -> None:
        self.stats["received"] += 1
        event = read_event(self._message_header, raw)
        if event is not None:
            # An event as the service writes it, read from its bytes, its value parsed before the lock.
            with self._lock:
                self.stats["events"] += 1
                self._processor.on_event(event, int(time.time() * 1000))
            return
        try:
            message = self._codec.decode_as("ClientMessage", raw)
        except CodecError as exc:
            log.error("client %s: a message of %s cannot be read and is skipped: %s", self.client_id,
                      self.queue_topic, exc)
            return
        kind = message["kind"]
        with self._lock:
            if kind == "REGISTERED":
                if message["session"] == self._session:
                    self._answered_version = max(self._answered_version, message["version"])
                    if self._loading_from is not None and message["version"] >= self._loading_from:
                        self._processor.applying = True
                    self._answered.notify_all()
            elif kind == "REFUSED":
                # Per version: a refusal is of that registration only (the one in force stays).
                if message["session"] == self._session:
                    self._refusals[message["version"]] = self.refused = message["reason"]
                    while len(self._refusals) > REFUSALS_KEPT:
                        del self._refusals[min(self._refusals)]
                    log.error("client %s: %s", self.client_id, message["reason"])
                    self._answered.notify_all()
            elif kind == "MARKER":
                if message["session"] == self._session:
                    self._marker_queued = self._session
                    if not self._processor.live:
                        self._processor.on_marker()
            elif kind == "EVENT" and message["event"] is not None:
                self.stats["events"] += 1
                self._processor.on_event(event_of_message(message), int(time.time() * 1000))

    def _ack(self) -> None:
        record = {"client_id": self.client_id, "session": self._session, "queue_topic": self.queue_topic,
                  "next_offset": self._next, "received": self.stats["received"],
                  "repeats": self._processor.stats["repeats"], "at": int(time.time() * 1000)}
        self._producer.produce(self._acks_topic, self._codec.encode("ClientAck", record), self.client_id.encode(),
                               partition=self._partition, headers=bearer(self._subscription_token))
        self._producer.poll(0)
        self.stats["acks"] += 1
        self._tracker.expire(int(time.time() * 1000))

    def _start_over(self, why: str) -> None:
        """The queue is lost: become a new client, fetch the interest again without events."""
        try:
            dropped = self._read_registration()[1]
        except SluiceError:
            dropped = None  # only the log's wording depends on it
        if dropped is not None:
            why += f": the subscription service dropped it ({dropped})"
        log.warning("client %s: %s; starting over as a new client and fetching its interest again",
                    self.client_id, why)
        self.stats["reinitialized"] += 1
        with self._lock:
            queue_topic = new_queue_topic(self.cfg, self.client_id)
            create_queue(self._admin, self.cfg, queue_topic, self.durable)
            self._record["queue_topic"] = queue_topic
            self._session = self._record["session"] = uuid.uuid4().hex[:12]
            # The new queue's marker (its record asks for one when this client was ready) is from its start.
            self._marker_from = (self._session, 0)
            self._refusals.clear()
            self._answered_version = -1
            self._loading_from = None
            self._processor.applying = False
            self._next = 0
            self._consumer.assign([TopicPartition(queue_topic, 0, 0)])
            self._publish()
            regions = list(self._regions.values())
        threading.Thread(target=self._refetch, args=(regions,), daemon=True).start()

    def _refetch(self, regions: list[ClientRegion]) -> None:
        try:
            self._wait_answer(self._record["version"])
            for region in regions:
                for reg in list(region.registrations):
                    loaded, invalid = self._load(region, reg)
                    with self._lock:
                        region.cache.begin_registration(self._covered(reg))
                        region.cache.finish_load(loaded, reg.result_policy, invalid)
        except SluiceError as exc:
            log.error("client %s: fetching its interest again failed: %s", self.client_id, exc)

    # --- closing ----------------------------------------------------------------------------

    def close(self, keep_alive: bool = False) -> None:
        """Disconnect.  A durable client with ``keep_alive`` keeps its queue (filling) and durable
        interest until its durable-client-timeout; otherwise the service drops them."""
        if self.closed:
            return
        self.closed = True
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)
        try:
            self._ack()
            with self._lock:
                self._record["connected"] = False
                self._record["keep_alive"] = keep_alive and self.durable
                self._publish()
        finally:
            self._producer.flush(10)
            self._consumer.close()
            if self._client is not None:
                self._client.close()
            # librdkafka's handles go now, not whenever this object is collected.
            self._producer = self._admin = None

    def abandon(self) -> None:
        """Stop without a word to the service, as a crashed process would (for tests and drills)."""
        self.closed = True
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)
        self._consumer.close()

    def __enter__(self) -> "ClientCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ALL_KEYS", "PENDING_NO_QUEUE", "PENDING_QUEUE_DROPPED", "ClientCache", "ClientRegion", "ResultPolicy"]
