"""The only module that imports confluent_kafka.

Everything else asks this module for producers, consumers and admin clients,
and gets Sluice errors instead of ``KafkaException``: the translation happens
once, here, using librdkafka's own classification (``fatal()``,
``retriable()``, ``txn_requires_abort()``).  A service makes its Kafka calls
inside ``with kafka_errors("reading the acks"):``, which raises

* ``KafkaFatal`` for a fatal error (the client must be rebuilt),
* ``TransactionAbortable`` when the transaction must be aborted,
* ``BrokerUnavailable`` otherwise, ``retriable`` as librdkafka says (and for
  the codes of a broker briefly away, ``_TRANSIENT``), and for a full producer
  queue (``BufferError``, back-pressure: retriable),

each with ``__cause__`` set, ``what`` in its message and librdkafka's error
code as ``code``: a caller that handles one code (a topic gone, a topic that
already exists, a stale group generation) compares ``exc.code`` with the
code sets here (``TOPIC_MISSING``, ``GROUP_FENCING``) or ``KafkaError``'s
constants.  Nothing outside this module catches ``KafkaException``.

Settings are passed explicitly: a service states the librdkafka options it
relies on (idempotence, acks, offset storage, isolation level) rather than
leaning on defaults.  A client's ``base`` is its connection's settings
(``KafkaConnection.client_settings``: address, login, TLS and the
``librdkafka:`` passthrough), laid over Sluice's defaults and under the
caller's own settings; a producer takes none of its consumer-only properties
and a consumer none of its producer-only ones (librdkafka would warn that it
ignores them), an admin client only those of any client.

Transactional records (the region changelogs and the queue topics are
written in Kafka transactions, DESIGN §2) change two things for a reader:

* a ``read_committed`` consumer (every consumer made here, unless told
  otherwise) sees only committed records, and its end of a partition is the
  last stable offset (LSO): the first offset of the oldest transaction still
  open, where a ``read_uncommitted`` one's is the high watermark;
* transaction markers occupy offsets and are never delivered, so the last
  record of a partition may sit below ``end - 1``.  "Read to the end" must
  compare the consumer's position (which librdkafka moves past markers and
  aborted records) with the end, never the last message's offset with it.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

import confluent_kafka
from confluent_kafka import (  # re-exported for the services
    OFFSET_BEGINNING,
    ConsumerGroupTopicPartitions,
    OFFSET_END,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from .errors import BrokerUnavailable, KafkaFatal, SluiceError, Stopping, TransactionAbortable
from .librdkafka_properties import PROPERTIES

log = logging.getLogger("sluice.kafka")

__all__ = [
    "OFFSET_BEGINNING",
    "OFFSET_END",
    "OFFSET_INVALID",
    "AdminClient",
    "ConfigResource",
    "close_consumer",
    "close_producer",
    "Consumer",
    "ConsumerGroupTopicPartitions",
    "GROUP_FENCING",
    "KafkaError",
    "Message",
    "NewTopic",
    "Producer",
    "ResourceType",
    "TopicPartition",
    "consume_available",
    "consumed_position",
    "consumer_group_generation",
    "connection_settings",
    "FLUSH_DEADLINE_S",
    "FOLLOW_FETCH_WAIT_MS",
    "OFFSETS_REQUEST_DEADLINE_S",
    "fence_transactional_id",
    "TOPIC_MISSING",
    "error_from_kafka_error",
    "kafka_errors",
    "make_admin",
    "make_consumer",
    "make_producer",
    "make_transactional_producer",
    "murmur2",
    "partition_end",
    "partition_for_key",
    "produce_durably",
    "read_to_end",
    "sasl_mechanism_problem",
    "translate",
    "until_answered",
]


def translate(exc: BaseException, what: str) -> SluiceError:
    """A confluent-kafka exception (or a full producer queue's ``BufferError``) as a Sluice error,
    ``exc`` its cause.  Use ``kafka_errors``; this is its translation, for the few places that
    hold an exception already (a future's, a callback's)."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    out: SluiceError
    if isinstance(error, KafkaError):
        code = error.code()
        if error.fatal():
            out = KafkaFatal(f"{what}: {error.str()}", code=code)
        elif error.txn_requires_abort():
            out = TransactionAbortable(f"{what}: {error.str()}", code=code)
        else:
            out = BrokerUnavailable(f"{what}: {error.str()}", code=code,
                                    retriable=bool(error.retriable()) or code in _TRANSIENT)
    elif isinstance(exc, BufferError):
        # librdkafka's local queue is full: back-pressure, over once the broker takes what it holds.
        out = BrokerUnavailable(f"{what}: the producer queue is full ({exc})", code=KafkaError._QUEUE_FULL,
                                retriable=True)
    else:
        out = BrokerUnavailable(f"{what}: {exc}")
    out.__cause__ = exc
    return out


class kafka_errors:  # noqa: N801 - used as a statement, as contextlib.suppress
    """``with kafka_errors("reading the acks"):`` -- the Kafka calls of the block raise Sluice errors
    (module docstring): a ``KafkaException`` or a ``BufferError`` leaving the block is raised as
    ``translate(exc, what)``, from it.  Anything else passes unchanged (a ``SluiceError`` raised
    inside keeps its own message).  As httpx's ``map_httpcore_exceptions``.

    A class, not a generator: entering and leaving costs two plain calls, so a hot loop may hold
    one made once (``WRITING = kafka_errors("writing ...")``) and enter it per record."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and isinstance(exc, (KafkaException, BufferError)):
            raise translate(exc, self.what) from exc
        return False


_TRANSIENT = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TIMED_OUT,
    KafkaError._MSG_TIMED_OUT,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.REBALANCE_IN_PROGRESS,
    # A broker back from a pause or a restart: for a moment the client's
    # metadata lacks partitions it knew, or a broker handle is replaced.
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._DESTROY_BROKER,
    # Retriable in Kafka's own protocol (the Java client's RetriableException): a
    # coordinator, a leader or enough replicas not there yet, a request timed out.
    # librdkafka flags retriable() only on the errors of its transactional calls, so
    # every loop that reads ``retriable`` depends on this list for the rest.
    KafkaError._WAIT_COORD,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._RESOLVE,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    KafkaError.KAFKA_STORAGE_ERROR,
    KafkaError.OFFSET_NOT_AVAILABLE,
    KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.PREFERRED_LEADER_NOT_AVAILABLE,
    KafkaError.UNSTABLE_OFFSET_COMMIT,
    KafkaError.CONCURRENT_TRANSACTIONS,
    KafkaError.THROTTLING_QUOTA_EXCEEDED,
}


def error_from_kafka_error(error: KafkaError, what: str) -> SluiceError:
    """The same translation for a ``KafkaError`` handed to a callback (a delivery report, ``error_cb``)."""
    return translate(KafkaException(error), what)


#: Error codes of a topic or partition that does not exist (any more): the broker's, and librdkafka's
#: own once its metadata lacks it.
TOPIC_MISSING = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION})


#: librdkafka refreshes its metadata every 5 minutes by default; a client that cached a broker's answer
#: from the moment it came back from a pause or a restart (partitions without a leader, or missing) would
#: fail "Unknown partition" on them for that long.
METADATA_REFRESH_MS = 10_000


def connection_settings(base: dict[str, Any], scope: str) -> dict[str, Any]:
    """``base`` as a client of ``scope`` takes it: "P" a producer, "C" a consumer, "*" an admin client.

    A property's scope is librdkafka's (``PROPERTIES``); a name it does not
    list (confluent-kafka's own, such as ``error_cb`` or ``logger``) is kept.
    """
    return {name: value for name, value in base.items() if PROPERTIES.get(name, ("*",))[0] in ("*", scope)}


#: The least a client needs to log in with each mechanism, for ``sasl_mechanism_problem``'s throw-away
#: client: no broker to reach, no command to run.
_SASL_PROBES: dict[str, dict[str, Any]] = {
    "PLAIN": {"sasl.username": "probe", "sasl.password": "probe"},
    "SCRAM-SHA-256": {"sasl.username": "probe", "sasl.password": "probe"},
    "SCRAM-SHA-512": {"sasl.username": "probe", "sasl.password": "probe"},
    "OAUTHBEARER": {"enable.sasl.oauthbearer.unsecure.jwt": True, "sasl.oauthbearer.config": "principal=probe"},
    "GSSAPI": {"sasl.kerberos.kinit.cmd": "", "sasl.kerberos.min.time.before.relogin": 0},
}


@functools.cache
def sasl_mechanism_problem(mechanism: str) -> str | None:
    """Why the librdkafka loaded here cannot log in with ``mechanism``, or None when it can.

    librdkafka lists its mechanisms in ``builtin.features`` whether or not a
    provider is linked: the wheels of confluent-kafka carry no Kerberos
    library, and a GSSAPI client fails only when made ("No provider for SASL
    mechanism GSSAPI").  A throw-away producer with no broker to reach finds
    that out once, when a site file asks for the mechanism.
    """
    conf = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mechanism, "log_level": 0,
            **_SASL_PROBES.get(mechanism, {})}
    try:
        # confluent_kafka's own class, whatever stands in for ``Producer`` here (the tests record clients).
        probe = confluent_kafka.Producer(conf)
    except KafkaException as exc:
        text = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
        return text.removeprefix("Failed to create producer: ")
    probe.flush(0)
    return None


def make_producer(base: dict[str, Any], **settings: Any) -> Producer:
    """An idempotent, acks=all producer: a delivered record is durable and in order.

    ``base`` holds the connection settings of the site (bootstrap, TLS, SASL).
    """
    conf: dict[str, Any] = {
        "enable.idempotence": True,
        "acks": "all",
        "max.in.flight.requests.per.connection": 5,
        "linger.ms": 2,
        "compression.type": "none",
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "delivery.timeout.ms": 120_000,
        "partitioner": "murmur2_random",
        "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
    }
    conf.update(connection_settings(base, "P"))
    conf.update({k.replace("_", "."): v for k, v in settings.items()})
    with kafka_errors("creating a producer"):
        return Producer(conf)


#: How long librdkafka waits before fetching a partition again once its local queue is over
#: ``queued.min.messages`` / ``queued.max.messages.kbytes`` (librdkafka's default: 1000 ms).  A reader
#: that drains its queue faster than that otherwise idles for the rest of each second: a bucket's
#: changelog of 1M records of 300 bytes read in 5.6 s by one consumer at the default, in 1.2 s at 10 ms.
FETCH_QUEUE_BACKOFF_MS = 10


def make_consumer(base: dict[str, Any], group_id: str | None = None, **settings: Any) -> Consumer:
    """A consumer that never commits or stores offsets on its own.

    With ``group_id=None`` the consumer is for ``assign()`` only (a random,
    never-committed group id is set because librdkafka requires one).
    """
    conf: dict[str, Any] = {
        "group.id": group_id or "sluice-reader",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        "isolation.level": "read_committed",
        "partition.assignment.strategy": "range",
        "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
    }
    conf.update(connection_settings(base, "C"))
    conf.update({k.replace("_", "."): v for k, v in settings.items()})
    with kafka_errors("creating a consumer"):
        return Consumer(conf)


#: How long the broker holds an idle fetch of a consumer that follows a topic for as long as it runs (the
#: owner directory, a control follower).  A record, or a transaction's commit marker, ends the wait at
#: once (measured: produced → consumed p50 6.2 ms, max 9.5 ms, at 500 as at 50), so the wait costs no
#: latency; it sets how often an idle follower asks, and each ask costs the broker (an idle region
#: service's directory at 50 ms: 0.03 of a core of its broker).
FOLLOW_FETCH_WAIT_MS = 500

#: A transactional producer's ``retry.backoff.ms``.  The coordinator answers a
#: transaction's first AddPartitionsToTxn with CONCURRENT_TRANSACTIONS while it
#: still writes the previous transaction's markers; librdkafka asks again after
#: this backoff (growing to ``retry.backoff.max.ms``).  At the default 100 ms
#: every back-to-back transaction waited ~100 ms (measured: one record per
#: transaction, p50 93 ms at 100, 3.5 ms at 2 ms, 21 ms at 20).
TRANSACTION_RETRY_BACKOFF_MS = 2


def make_transactional_producer(base: dict[str, Any], transactional_id: str, transaction_timeout_ms: int,
                                **settings: Any) -> Producer:
    """A producer for Kafka transactions under ``transactional_id``, not yet initialized
    (``init_transactions`` is the caller's, with its own deadline).

    librdkafka refuses a delivery or socket timeout above the transaction
    timeout (a record may not outlive its transaction), so both are capped by
    it; ``settings`` (a site's producer settings) may lower them.
    """
    delivery_ms = min(int(settings.pop("delivery.timeout.ms", settings.pop("delivery_timeout_ms", transaction_timeout_ms))),
                      transaction_timeout_ms)
    conf = {
        "transactional.id": transactional_id,
        "transaction.timeout.ms": transaction_timeout_ms,
        "delivery.timeout.ms": delivery_ms,
        "socket.timeout.ms": max(1000, transaction_timeout_ms - 1000),
        "retry.backoff.ms": TRANSACTION_RETRY_BACKOFF_MS,
        "retry.backoff.max.ms": 1000,
        **{k.replace("_", "."): v for k, v in settings.items()},
    }
    if int(conf.get("request.timeout.ms", 0)) > conf["socket.timeout.ms"]:
        conf["request.timeout.ms"] = conf["socket.timeout.ms"]
    return make_producer(base, **conf)


def fence_transactional_id(base: dict[str, Any], transactional_id: str, timeout_s: float) -> None:
    """Fence every other producer of ``transactional_id``: initialize it once and close it.

    ``init_transactions`` bumps the id's producer epoch and aborts its open
    transaction at once (rather than at ``transaction.timeout.ms``); the old
    producer's next transactional request fails fatally.  For a writer that is
    dead or frozen (see region/engine.py).
    """
    producer = make_transactional_producer(base, transactional_id, max(1000, int(timeout_s * 1000)),
                                           **{"client.id": f"fence-{transactional_id}"})
    try:
        with kafka_errors(f"fencing transactional.id {transactional_id}"):
            producer.init_transactions(timeout_s)
    finally:
        close_producer(producer, min(timeout_s, 5.0))


def close_producer(producer: Producer, timeout_s: float) -> None:
    """Close a producer, whatever state it is in: closing a fenced transactional producer raises
    (its open transaction cannot be ended), and there is nothing more to do with it then."""
    try:
        producer.close(max(0.1, timeout_s))
    except KafkaException as exc:
        log.debug("closing a producer: %s", exc)


def close_consumer(consumer: Consumer, what: str, logger: logging.Logger = log, level: int = logging.WARNING) -> None:
    """Close a consumer (leaving its group: its revoke callback runs), whatever state it is in: a
    failure to leave cleanly (the broker away, the consumer closed already) is logged to ``logger``
    as ``what: why``, and there is nothing more to do with the consumer then.  What its callbacks
    raise is raised."""
    try:
        consumer.close()
    except (KafkaException, RuntimeError) as exc:
        logger.log(level, "%s: %s", what, exc)


#: Error codes with which the group coordinator refuses a transaction's offsets
#: (KIP-447): the member is no longer in the group, or not in this generation.
GROUP_FENCING = frozenset({
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.FENCED_INSTANCE_ID,
    KafkaError.REBALANCE_IN_PROGRESS,
})


_CGMD_MAGIC = b"CGMDv2:"


def consumer_group_generation(metadata: bytes) -> tuple[int, str]:
    """(generation, member id) of a ``consumer_group_metadata()``.

    librdkafka serializes it as ``CGMDv2:``, the generation (int32, host
    order), the group id and the member id, each NUL-terminated.  A
    transactional offset commit with generation -1 and no member id is not
    checked against the group at all (KIP-447 keeps it for old clients), so a
    writer must never send its offsets with such metadata: callers check the
    generation here first.  (-1, "") for anything else.
    """
    if not isinstance(metadata, bytes) or not metadata.startswith(_CGMD_MAGIC) or len(metadata) < 13:
        return -1, ""
    generation = int.from_bytes(metadata[7:11], sys.byteorder, signed=True)
    rest = metadata[11:].split(b"\0")
    member = rest[1].decode("utf-8", "replace") if len(rest) > 2 else ""
    return generation, member


def partition_end(committed: Consumer, uncommitted: Consumer, tp: TopicPartition,
                  timeout_s: float = 10.0) -> tuple[int, int, int]:
    """(low, last stable offset, high watermark) of a partition, asked in that order.

    ``committed`` is a read_committed consumer, ``uncommitted`` a
    read_uncommitted one.  When the LSO equals the high watermark no
    transaction was open on the partition at the first request and nothing
    was appended before the second: reading to it reads everything written.
    """
    low, lso = committed.get_watermark_offsets(tp, timeout=timeout_s)
    _, high = uncommitted.get_watermark_offsets(tp, timeout=timeout_s)
    return low, lso, high


def make_admin(base: dict[str, Any]) -> AdminClient:
    with kafka_errors("creating an admin client"):
        return AdminClient({"topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
                            **connection_settings(base, "*")})


def wait_futures(futures: dict[Any, Any], what: str, timeout_s: float = 30.0) -> dict[Any, Any]:
    """Resolve an admin call's futures, translating each failure."""
    results: dict[Any, Any] = {}
    for key, fut in futures.items():
        with kafka_errors(f"{what} {key}"):
            results[key] = fut.result(timeout=timeout_s)
    return results


def wait_future(future: Any, what: str, timeout_s: float) -> Any:
    """An admin call's future resolved, its failure translated (``kafka_errors``)."""
    with kafka_errors(what):
        return future.result(timeout=timeout_s)


# --- murmur2, exactly as Kafka's default partitioner -----------------------
#
# DESIGN §1: the bucket of a key is murmur2(serialized key) mod buckets, as
# the Java client's default partitioner computes it, so any Kafka producer
# keyed the same way lands on the same partition as Sluice.

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` (seed 0x9747b28c), as a signed 32-bit int."""
    if _compiled_murmur2 is not None:
        h = _compiled_murmur2(data)
        if h is not None:
            return h  # type: ignore[no-any-return]
    return murmur2_py(data)


def murmur2_py(data: bytes) -> int:
    """``murmur2`` in Python: the reference of the compiled one (``core/_eventwire.pyx``)."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    n4 = length // 4
    for i in range(n4):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    rest = length % 4
    tail = 4 * n4
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def _load_compiled_murmur2() -> Callable[[bytes], int | None] | None:
    from . import eventwire  # noqa: PLC0415 - it decides whether the compiled module is used

    return eventwire._compiled.murmur2 if eventwire._compiled is not None else None  # noqa: SLF001


_compiled_murmur2 = _load_compiled_murmur2()


def partition_for_key(key: bytes, partitions: int) -> int:
    """Kafka's ``toPositive(murmur2(key)) % partitions``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def topic_ids(admin: AdminClient, topics: dict[str, str], timeout_ms: int) -> dict[str, str]:
    """For each name → topic, the topic's id (Kafka gives a topic created again a new one)."""
    if not topics:
        return {}
    futures = admin.describe_topics(TopicCollection(sorted(set(topics.values()))), request_timeout=timeout_ms / 1000)
    described = wait_futures(futures, "describing topics", timeout_ms / 1000)
    return {name: str(described[topic].topic_id) for name, topic in topics.items()}


def describe_group_members(admin: AdminClient, group_id: str, timeout_s: float = 5.0) -> list[tuple[str, list[tuple[str, int]]]]:
    """(client_id, [(topic, partition), …]) for every member of a group."""
    futures = admin.describe_consumer_groups([group_id], request_timeout=timeout_s)
    desc = wait_futures(futures, "describing group", timeout_s)[group_id]
    out = []
    for member in desc.members:
        tps = member.assignment.topic_partitions if member.assignment else []
        out.append((member.client_id, [(tp.topic, tp.partition) for tp in tps]))
    return out


def consume_available(consumer: Consumer, max_messages: int, timeout_s: float) -> list[Message]:
    """What has arrived, as soon as anything has: up to ``timeout_s`` for the
    first message, then whatever else is already fetched.  (``consume(n, t)``
    waits out all of ``t`` unless ``n`` messages arrive, which delays every
    message of a slow stream by up to ``t``.)"""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(max_messages - 1, 0)] if max_messages > 1 else [first]


def iter_messages(consumer: Consumer, timeout_s: float, batch: int = 1000) -> Iterable[Message]:
    """Yield messages from ``consume`` until a call returns none within ``timeout_s``."""
    while True:
        with kafka_errors("consuming"):
            msgs = consumer.consume(batch, timeout_s)
        if not msgs:
            return
        yield from msgs


Callback = Callable[[KafkaError | None, Message], None]


def read_to_end(consumer: Consumer, topic: str, partition: int = 0, deadline_s: float = 15.0,
                start: int | None = None) -> Iterator[Message]:
    """Every readable record of one partition, from its start (or ``start``) to its end as of the call.

    ``consumer`` is assigned the partition for the read and unassigned after.
    Used for the small compacted topics (removals, status) and a partition's
    acks, which services read whole when they take something over, and for
    changelog partitions.  The end is the consumer's: the last stable offset
    for a read_committed consumer (records of transactions still open are not
    read), the high watermark for a read_uncommitted one.  The read ends when
    the consumer's position reaches it: markers and aborted records occupy
    offsets but are never delivered, so the last record read may lie below
    ``end - 1`` (module docstring).  A read that does not reach the end within
    ``deadline_s`` (a broker paused or restarting) raises a retriable
    ``KafkaException`` (``_TIMED_OUT``) rather than end short: what a service
    rebuilds from such a topic (its epochs, the batches it acknowledged) must
    be whole.
    """
    tp = TopicPartition(topic, partition)
    low, high = watermarks(consumer, tp)
    if start is not None:
        low = max(low, start)
    if high <= low:
        return
    consumer.assign([TopicPartition(topic, partition, low)])
    try:
        position, end = low, time.monotonic() + deadline_s
        while position < high:
            if time.monotonic() >= end:
                raise KafkaException(KafkaError(
                    KafkaError._TIMED_OUT, f"read of {topic}[{partition}] reached offset {position} of {high} "
                                           f"in {deadline_s:g} s", retriable=True))
            # consume() waits its whole timeout for a partial batch: keep it short.
            for msg in consumer.consume(1000, 0.05):
                if msg.error() is None:
                    position = max(position, msg.offset() + 1)
                    yield msg
            position = max(position, consumed_position(consumer, tp))
    finally:
        consumer.unassign()


#: How long a producer may take to deliver what it holds when a service waits for it (a queue's clean
#: or revoke, any service's shutdown).
FLUSH_DEADLINE_S = 10.0
#: How long one request for a committed offset or a partition's watermarks may take (asked again after).
OFFSETS_REQUEST_DEADLINE_S = 10.0
#: watermarks: how long one request may take, how long a retriable refusal is asked again, the pause between.
WATERMARKS_REQUEST_S = 10.0
WATERMARKS_RETRY_DEADLINE_S = 10.0
WATERMARKS_RETRY_PAUSE_S = 0.1


def watermarks(consumer: Consumer, tp: TopicPartition) -> tuple[int, int]:
    """``tp``'s low and high watermarks, asked again for ``WATERMARKS_RETRY_DEADLINE_S`` while the
    broker refuses retriably: a topic created a moment ago whose partition has no leader yet ('Not
    leader for partition'), a leader moving.  Any other failure, or one past the deadline, raises."""
    deadline = time.monotonic() + WATERMARKS_RETRY_DEADLINE_S
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=WATERMARKS_REQUEST_S)
            return int(low), int(high)
        except KafkaException as exc:
            refusal = translate(exc, f"{tp.topic}[{tp.partition}] watermarks")
            if not refusal.retriable or time.monotonic() >= deadline:
                raise
            log.info("%s; asking again", refusal)
            time.sleep(WATERMARKS_RETRY_PAUSE_S)


def consumed_position(consumer: Consumer, tp: TopicPartition) -> int:
    """The offset the consumer reads next in ``tp`` (past markers and aborted records), -1 before any."""
    for found in consumer.position([tp]):
        if found.topic == tp.topic and found.partition == tp.partition:
            return found.offset if found.offset >= 0 else -1
    return -1


T = TypeVar("T")

#: until_answered: the pause before asking the broker again.
ASK_AGAIN_AFTER_S = 1.0


def until_answered(ask: Callable[[], T], what: str, *, stopping: threading.Event) -> T:
    """``ask()``, asked again while it fails retriably (the broker does not answer: paused,
    restarting, 'Unknown partition' while its metadata comes back; its Kafka errors are translated
    here, ``kafka_errors(what)``).  For reads a service cannot go on without, in a rebalance callback
    above all, where an exception would leave the callback and end the service.  A failure that is
    not ``retriable`` is raised at once; ``stopping`` set raises ``Stopping``."""
    while True:
        try:
            with kafka_errors(what):
                return ask()
        except SluiceError as error:
            if not error.retriable:
                raise
            log.warning("%s; asking again", error)
            if stopping.wait(ASK_AGAIN_AFTER_S):
                raise Stopping(what) from error


#: produce_durably: one flush's wait, when to warn that the broker is not
#: answering, and the pause before producing a failed record again.
WRITE_WAIT_STEP_S = 0.5
WRITE_WARN_AFTER_S = 5.0
WRITE_RETRY_BACKOFF_S = 1.0


def produce_durably(producer: Producer, topic: str, value: bytes, key: bytes | None, *, what: str,
                    stopping: threading.Event, partition: int | None = None,
                    headers: list[tuple[str, bytes]] | None = None) -> None:
    """Produce one record and wait until the broker has it, for as long as that takes.

    A site's broker may be unreachable for any length of time (paused,
    partitioned, restarting), and a fixed deadline turns an outage longer
    than it into a crashed service.  So: wait in short flushes; a delivery
    that fails retriably (``_MSG_TIMED_OUT`` once ``delivery.timeout.ms``
    runs out, ``_TRANSPORT``, …) is produced again, so callers must write
    records whose repetition changes nothing (acks, dead letters, removal
    and epoch records).  A full producer queue is back-pressure: it waits.
    Only a failure that is not ``retriable`` raises (a ``SluiceError``);
    ``stopping`` set raises ``Stopping``.
    """
    extra: dict[str, Any] = {} if partition is None else {"partition": partition}
    if headers is not None:
        extra["headers"] = headers
    started = time.monotonic()
    warned = False
    while True:
        outcome: list[KafkaError | None] = []
        while True:
            try:
                producer.produce(topic, value, key, on_delivery=lambda err, _m: outcome.append(err), **extra)
                break
            except BufferError:  # back-pressure: waited out while the broker takes what the producer holds
                if stopping.is_set():
                    raise Stopping(what) from None
                producer.poll(WRITE_WAIT_STEP_S)
            except KafkaException as exc:
                refused = translate(exc, what)
                if not refused.retriable:
                    raise refused from exc
                log.warning("%s; producing it again", refused)
                if stopping.wait(WRITE_RETRY_BACKOFF_S):
                    raise Stopping(what) from refused
        while not outcome:
            if stopping.is_set():
                raise Stopping(what)
            producer.flush(WRITE_WAIT_STEP_S)
            waited_s = time.monotonic() - started
            if not outcome and not warned and waited_s >= WRITE_WARN_AFTER_S:
                warned = True
                log.warning("%s: not written after %.0f s; waiting for the broker", what, waited_s)
        error = outcome[0]
        if error is None:
            if warned:
                log.info("%s: written after %.1f s", what, time.monotonic() - started)
            return
        failure = error_from_kafka_error(error, what)
        if not failure.retriable:
            raise failure
        log.warning("%s: %s; producing it again", what, error.str())
        if stopping.wait(WRITE_RETRY_BACKOFF_S):
            raise Stopping(what) from failure
