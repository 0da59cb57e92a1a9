"""The Kafka forwarder: an async event listener that writes each batch to a downstream topic.

Site file::

    async_event_queues:
      - id: orders-downstream
        listener:
          type: kafka
          settings:
            topic: "{topic_prefix}downstream.{region}"   # required
            # bootstrap_servers: "other-cluster:9093"    # default: this site's cluster
            # partitions_by: key                         # the only choice: keyed by entry key
            # flush_timeout_s: 30                        # bound on one process_events call

Another cluster (``bootstrap_servers``) takes the connection settings a
site's ``kafka:`` section takes, checked by the same model
(``KafkaConnection``), with the same errors::

            security_protocol: SASL_SSL                 # PLAINTEXT (default), SSL, SASL_PLAINTEXT
            ssl_ca_location: certs/other-ca.pem         # relative to the site file
            ssl_certificate_location: certs/me.pem      # mutual TLS: certificate and key
            ssl_key_location: certs/me.key
            ssl_key_password_file: /run/secrets/key-pw  # or ssl_key_password(_env)
            sasl_mechanism: SCRAM-SHA-512               # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
            sasl_username: forwarder
            sasl_password_env: OTHER_KAFKA_PASSWORD     # or sasl_password(_file)

Records are Avro ``EntryEvent``s in Sluice's own framing, the Avro
specification's single-object encoding (``serializer: single-object``, the
default), or in Confluent's wire format with the schema in a
Confluent-compatible schema registry, which Confluent's deserializers, Kafka
Connect's ``AvroConverter``, ksqlDB and Flink read (docs/schema-registry.md)::

            serializer: confluent                       # single-object (default) or confluent
            schema_registry:                            # required with confluent, refused without
              url: http://registry:8081                 # Apicurio: http://host:8080/apis/ccompat/v6
              subject_name_strategy: TopicNameStrategy  # or RecordNameStrategy, TopicRecordNameStrategy
              auto_register: true                       # false: the schema must be registered already
              basic_auth_username: sluice               # or bearer_token(_file/_env)
              basic_auth_password_file: /run/secrets/registry-pw   # or basic_auth_password(_env)
              # ssl_ca_location: certs/registry-ca.pem  # timeout_s: 10

With ``confluent`` the schema is checked against each subject the forwarder
will write (one per region of the queue when the topic names ``{region}``)
when it starts: the registry's compatibility endpoint must accept it, or the
start fails with a configuration error naming the subject and why; then it
is registered (``sluice.core.registry``).

Passwords from a file or a variable are read each time the producer is
built, so a rotated secret reaches the next one; no password is logged or
shown in an error.  Without ``bootstrap_servers`` the forwarder writes to the
site's own cluster with the site's ``kafka:`` connection, and these settings
are refused.

A batch goes out step by step:

1. every event is encoded first (``EntryEvent`` in Avro single-object
   encoding, DESIGN §4, or in Confluent's wire format), so a record that
   cannot be encoded, or a schema registry that cannot be reached, fails the
   offer before anything is written;
2. each record is produced to its topic (``{region}`` and ``{topic_prefix}``
   filled in), keyed by the entry key in UTF-8 so Kafka's murmur2 partitioner
   puts every event of a key in one partition, in the queue's order; headers
   carry the queue, operation, region, EventID, possibleDuplicate flag and
   origin dsid;
3. the producer (idempotent, acks=all) is flushed with ``flush_timeout_s``;
   the offer returns True only when every record of the batch was
   acknowledged.  Anything else — a delivery error, a record still pending at
   the deadline, a fatal producer error — returns False, and the dispatcher
   offers the very same batch again.  Except (issue 17) a record the
   producer refuses for its size (``MSG_SIZE_TOO_LARGE`` from ``produce``,
   past ``message.max.bytes``): no retry makes it fit, so when the dispatcher
   keeps dead letters (``dead_letter_topic`` in the init config) its event is
   returned in ``Accepted(dead_letters)`` once every other record is
   acknowledged, instead of wedging the queue.  The broker's own refusal
   (a topic whose ``max.message.bytes`` is lower) is not one: it names a whole
   request of several records, so the batch is offered again.

Delivery is at least once.  A failed offer may have written part of the batch
(and a record pending at the deadline may still land later), so the re-offer
can write some events twice.  After a failed offer the forwarder remembers
which of its events may be downstream already (acknowledged, timed out, or
still in flight: every outcome except a certain refusal) and marks those
possibleDuplicate, in the header and in the Avro record, when the batch comes
again; events the dispatcher re-offers after a failover carry the flag
already.  **Downstream consumers deduplicate by EventID**: an event
whose sequence is at or below the highest already seen for its (member,
thread) on that entry key is a repeat (``deploy/downstream/faust_app.py`` does
this).  The key matters: one key's events stay in order end to end, but one
writer thread's events spread over partitions and arrive interleaved.

Lifecycle::

    NEW ──init()──► READY ──close()──► CLOSED
                     │  ▲
      process_events │  │ True / False (a fatal producer error rebuilds the
                     └──┘ producer on the next offer)

``close()`` is idempotent; ``process_events`` after it raises ``ClosedError``.
All producer callbacks run inside ``flush``/``poll`` on the caller's thread,
so the listener holds no locks.
"""

from __future__ import annotations

import difflib
import enum
import logging
import math
import re
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import ValidationError

from sluice.core.asyncevent import Accepted, AsyncEvent, DeadLetter
from sluice.core.codec import get_codec
from sluice.core.config import KafkaConnection, _problems_from_validation, _shown
from sluice.core.config.models.registry import SchemaRegistryConnection
from sluice.core.errors import ClosedError, ConfigError, KafkaCallFailed, SluiceError
from sluice.core.registry import SERIALIZERS, ConfluentAvroWriter
from sluice.core.events import EventID
from sluice.core.kafka import KafkaError, Message, Producer, error_from_kafka_error, kafka_errors, make_producer

__all__ = ["ForwarderSettings", "KafkaForwarderListener", "TargetCluster", "build_headers", "parse_settings"]

log = logging.getLogger(__name__)

SETTINGS_PREFIX = "listener.settings"
PLACEHOLDERS = ("region", "topic_prefix")
PARTITIONS_BY = ("key",)
FLUSH_TIMEOUT_S_DEFAULT = 30.0
FLUSH_TIMEOUT_S_MAX = 3600.0
#: Kafka's limit on a topic name, and the longest region name the site file allows.
TOPIC_NAME_CHARS_MAX = 249
REGION_NAME_CHARS_MAX = 101
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
_LOOKS_SECRET = re.compile(r"pass|pw|secret|token|key", re.IGNORECASE)
#: librdkafka's delivery timeout is the offer's deadline plus this (see _new_producer).
DELIVERY_TIMEOUT_MARGIN_MS = 1000
#: How long to wait for room in the producer queue before trying again.
BUFFER_WAIT_S = 0.05

HEADER_QUEUE = "sluice.queue"
HEADER_OPERATION = "sluice.operation"
HEADER_REGION = "sluice.region"
HEADER_EVENT_ID = "sluice.event_id"
HEADER_POSSIBLE_DUPLICATE = "sluice.possible_duplicate"
HEADER_ORIGIN_DSID = "sluice.origin_dsid"


class TargetCluster(KafkaConnection):
    """Another cluster the forwarder writes to: a site's ``kafka:`` connection
    settings, given in ``listener.settings`` (errors name them there)."""

    _SECTION: ClassVar[str] = SETTINGS_PREFIX


#: The connection settings of another cluster, as a site's kafka: section names them.
CONNECTION_FIELDS = tuple(name for name in KafkaConnection.model_fields
                          if name not in ("bootstrap_servers", "topic_prefix"))


@dataclass(frozen=True, slots=True)
class ForwarderSettings:
    """The listener's validated ``settings`` block."""

    topic: str
    bootstrap_servers: str | None = None
    partitions_by: str = "key"
    flush_timeout_s: float = FLUSH_TIMEOUT_S_DEFAULT
    #: How to reach ``bootstrap_servers`` (None: the site's own cluster).
    cluster: TargetCluster | None = None
    #: The records' framing: ``single-object`` (Sluice's own) or ``confluent``.
    serializer: str = "single-object"
    #: The schema registry of the ``confluent`` serializer (None otherwise).
    schema_registry: SchemaRegistryConnection | None = None

    def topic_for(self, region: str, topic_prefix: str = "") -> str:
        """The downstream topic of an event of ``region``."""
        return self.topic.format(region=region, topic_prefix=topic_prefix)


_FIELDS = ("topic", "bootstrap_servers", "partitions_by", "flush_timeout_s", "serializer", "schema_registry",
           *CONNECTION_FIELDS)


def _field(name: str) -> str:
    return f"{SETTINGS_PREFIX}.{name}"


def _topic_problems(template: Any, topic_prefix: str) -> list[tuple[str, Any, str]]:
    if not isinstance(template, str) or not template:
        return [(_field("topic"), template, "is required: the downstream topic name, e.g. \"orders-events\" or \"downstream.{region}\"")]
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return [(_field("topic"), template, f"is not a valid template: {exc}")]
    unknown = [name for name, _, _ in fields if name not in PLACEHOLDERS]
    if unknown:
        return [(_field("topic"), template,
                 f"unknown placeholder {{{unknown[0]}}}{_suggest(unknown[0], PLACEHOLDERS)}")]
    if any(spec or conv for _, spec, conv in fields):
        return [(_field("topic"), template, "placeholders take no format spec or conversion")]
    longest = template.format(region="r" * REGION_NAME_CHARS_MAX, topic_prefix=topic_prefix)
    sample = template.format(region="r", topic_prefix=topic_prefix)
    if not _TOPIC_CHARS.match(sample) or sample in (".", ".."):
        return [(_field("topic"), template,
                 "is not a legal Kafka topic name: letters, digits, '.', '_' and '-' only, and not '.' or '..'")]
    if "{region}" in template and len(longest) > TOPIC_NAME_CHARS_MAX:
        return [(_field("topic"), template,
                 f"is longer than Kafka's {TOPIC_NAME_CHARS_MAX} characters for a region name of {REGION_NAME_CHARS_MAX}")]
    if len(sample) > TOPIC_NAME_CHARS_MAX:
        return [(_field("topic"), template, f"is longer than Kafka's {TOPIC_NAME_CHARS_MAX} characters")]
    return []


def _suggest(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(choices)}"


def _unknown_shown(key: Any, value: Any, known: tuple[str, ...]) -> Any:
    """The value of an unknown setting as an error shows it: a misspelt password setting is still a password."""
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    secret = _LOOKS_SECRET.search(str(key)) or (close and _LOOKS_SECRET.search(close[0]))
    return "**********" if secret else _shown(str(key), value)


def _cluster_problems(settings: dict[str, Any], site_dir: str | Path | None) -> tuple[TargetCluster | None,
                                                                                      list[tuple[str, Any, str]]]:
    """Another cluster's connection, checked as a site's ``kafka:`` section is."""
    servers = settings.get("bootstrap_servers")
    given = {name: settings[name] for name in CONNECTION_FIELDS if settings.get(name) is not None}
    if servers is None:
        return None, [(_field(name), _shown(name, value),
                       "is only for another cluster, named by bootstrap_servers; this site's own cluster is reached "
                       "with the kafka: section's settings") for name, value in given.items()]
    if not isinstance(servers, str):
        return None, [(_field("bootstrap_servers"), servers, "must be host:port, or several separated by commas")]
    try:
        # Relative file paths are taken from the site file's folder, as in its kafka: section.
        cluster = TargetCluster.model_validate({"bootstrap_servers": servers, **given},
                                               context={"base_dir": str(site_dir) if site_dir else None})
    except ValidationError as exc:
        return None, [(_field(field), value, reason) for field, value, reason in _problems_from_validation(exc)]
    return cluster, []


def _registry_problems(settings: dict[str, Any], site_dir: str | Path | None) -> tuple[
        str, SchemaRegistryConnection | None, list[tuple[str, Any, str]]]:
    """The serializer, and the schema registry the ``confluent`` one needs (and no other takes)."""
    serializer = settings.get("serializer", "single-object")
    block = settings.get("schema_registry")
    if serializer not in SERIALIZERS:
        return "single-object", None, [(_field("serializer"), serializer,
                                        f"must be one of {', '.join(SERIALIZERS)}" + (
                                            _suggest(serializer, SERIALIZERS) if isinstance(serializer, str) else ""))]
    if serializer == "single-object":
        if block is not None:
            return serializer, None, [(_field("schema_registry"), _shown("schema_registry", block),
                                       "is only for serializer: confluent (single-object records carry their "
                                       "schema's fingerprint and need no registry)")]
        return serializer, None, []
    if block is None:
        return serializer, None, [(_field("schema_registry"), None,
                                   "is required with serializer: confluent: the registry's url, at least")]
    if not isinstance(block, dict):
        return serializer, None, [(_field("schema_registry"), _shown("schema_registry", block), "must be a mapping")]
    known = tuple(SchemaRegistryConnection.model_fields)
    unknown = [(f"{_field('schema_registry')}.{key}", _unknown_shown(key, block[key], known),
                "unknown setting of the schema registry" + _suggest(str(key), known))
               for key in block if key not in known]
    try:
        registry = SchemaRegistryConnection.model_validate(
            {key: value for key, value in block.items() if key in known},
            context={"base_dir": str(site_dir) if site_dir else None})
    except ValidationError as exc:
        return serializer, None, unknown + [(f"{_field('schema_registry')}.{field}", value, reason)
                                            for field, value, reason in _problems_from_validation(exc)]
    return serializer, (registry if not unknown else None), unknown


def parse_settings(settings: Any, topic_prefix: str = "", site_dir: str | Path | None = None) -> ForwarderSettings:
    """Validate a ``listener.settings`` block; every problem is reported at once.  ``site_dir``:
    the site file's folder, where relative certificate and secret paths are looked up (default:
    the working directory)."""
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise ConfigError([(SETTINGS_PREFIX, settings, "must be a mapping")])
    problems: list[tuple[str, Any, str]] = []
    for key in settings:
        if key not in _FIELDS:
            problems.append((_field(str(key)), _unknown_shown(key, settings[key], _FIELDS),
                             "unknown setting of the kafka listener" + _suggest(str(key), _FIELDS)))

    topic = settings.get("topic")
    problems += _topic_problems(topic, topic_prefix)

    cluster, found = _cluster_problems(settings, site_dir)
    problems += found

    serializer, registry, found = _registry_problems(settings, site_dir)
    problems += found

    partitions_by = settings.get("partitions_by", "key")
    if partitions_by not in PARTITIONS_BY:
        problems.append((_field("partitions_by"), partitions_by,
                         "must be 'key' (records are keyed by the entry key so each key stays in order)"))

    flush_timeout_s = settings.get("flush_timeout_s", FLUSH_TIMEOUT_S_DEFAULT)
    if (isinstance(flush_timeout_s, bool) or not isinstance(flush_timeout_s, (int, float))
            or not math.isfinite(flush_timeout_s) or not 1 <= flush_timeout_s <= FLUSH_TIMEOUT_S_MAX):
        problems.append((_field("flush_timeout_s"), flush_timeout_s,
                         f"must be a number of seconds from 1 to {FLUSH_TIMEOUT_S_MAX:.0f}"))
    if problems:
        raise ConfigError(problems)
    return ForwarderSettings(
        topic=topic,
        bootstrap_servers=cluster.bootstrap_servers if cluster is not None else None,
        partitions_by=partitions_by,
        flush_timeout_s=float(flush_timeout_s),
        cluster=cluster,
        serializer=serializer,
        schema_registry=registry,
    )


def build_headers(event: AsyncEvent, possible_duplicate: bool) -> list[tuple[str, bytes]]:
    """The record headers of one forwarded event (values are UTF-8 text)."""
    return [
        (HEADER_QUEUE, event.queue_id.encode()),
        (HEADER_OPERATION, event.operation.value.encode()),
        (HEADER_REGION, event.region.encode()),
        (HEADER_EVENT_ID, str(event.event_id).encode()),
        (HEADER_POSSIBLE_DUPLICATE, b"true" if possible_duplicate else b"false"),
        (HEADER_ORIGIN_DSID, str(event.event.origin_dsid).encode()),
    ]


class ListenerState(enum.Enum):
    NEW = "new"
    READY = "ready"
    CLOSED = "closed"


#: Delivery errors after which the record is certainly not on the topic (the
#: broker refused it, or it never left the producer).  Any other outcome —
#: acknowledged, timed out, no report yet — may have written it.
NOT_WRITTEN = frozenset({
    KafkaError._PURGE_QUEUE,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
})


#: produce() errors no retry can fix, for that one record: larger than message.max.bytes.
NEVER_FITS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE})


class _Delivery:
    """Delivery reports of one offer, one slot per record, filled in by the producer's callbacks."""

    __slots__ = ("outcomes",)

    def __init__(self, records: int) -> None:
        #: None: no report yet; True: acknowledged; else the delivery error (or produce()'s refusal).
        self.outcomes: list[bool | KafkaError | KafkaCallFailed | None] = [None] * records

    def callback(self, index: int) -> Callable[[KafkaError | None, Message], None]:
        def on_delivery(error: KafkaError | None, _msg: Message) -> None:
            self.outcomes[index] = True if error is None else error
        return on_delivery

    @property
    def acked(self) -> int:
        return sum(1 for outcome in self.outcomes if outcome is True)

    @property
    def errors(self) -> list[KafkaError]:
        return [outcome for outcome in self.outcomes if isinstance(outcome, KafkaError)]


    def maybe_written(self, produced: int) -> list[int]:
        """Indexes of the records that may be on the topic (the first ``produced`` were handed to the producer)."""
        return [i for i, outcome in enumerate(self.outcomes[:produced]) if _code_of(outcome) not in NOT_WRITTEN]


def _code_of(outcome: bool | KafkaError | KafkaCallFailed | None) -> int | None:
    """The Kafka error code of a record's outcome; None when it has none (acknowledged, no report yet)."""
    if isinstance(outcome, KafkaError):
        return outcome.code()  # type: ignore[no-any-return]
    return outcome.code if isinstance(outcome, KafkaCallFailed) else None


class KafkaForwarderListener:
    """Forwards every accepted event to a downstream Kafka topic; see the module docstring."""

    def __init__(self) -> None:
        self.state = ListenerState.NEW
        self.settings: ForwarderSettings | None = None
        self._queue_id = ""
        self._topic_prefix = ""
        #: Where the dispatcher keeps dead letters; None: it keeps none.
        self._dead_letter_topic: str | None = None
        #: The site's own connection (resolved by the dispatcher), when there is no other cluster.
        self._connection: dict[str, Any] = {}
        self._cluster: TargetCluster | None = None
        self._client_id = "sluice-forwarder"
        self._producer: Producer | None = None
        #: Frames records in Confluent's wire format (serializer: confluent); None: single-object.
        self._confluent: ConfluentAvroWriter | None = None
        self._fatal: SluiceError | None = None
        self._topics: dict[str, str] = {}
        #: ``kafka_errors`` of the writes to each downstream topic, made once.
        self._producing: dict[str, kafka_errors] = {}
        #: EventIDs of the failed batch that may be downstream already:
        #: marked possibleDuplicate when offered again.  At most one batch.
        self._maybe_written: frozenset[EventID] = frozenset()
        self.batches_forwarded = 0
        self.records_forwarded = 0
        self.offers_failed = 0

    # --- lifecycle ---------------------------------------------------------

    def init(self, config: dict[str, Any]) -> None:
        """Validate the settings and build the producer (it connects lazily)."""
        assert self.state is ListenerState.NEW, f"init() on a {self.state.value} forwarder"
        self._topic_prefix = str(config.get("topic_prefix", ""))
        settings = parse_settings(config.get("settings"), self._topic_prefix, config.get("site_dir"))
        self._queue_id = str(config.get("queue_id", ""))
        self._dead_letter_topic = config.get("dead_letter_topic") or None
        if settings.cluster is not None:
            # Another cluster: read its secrets now, so one that cannot be read stops the start, saying which.
            settings.cluster.client_settings()
            self._cluster = settings.cluster
            log.info("queue %s: forwarding to %s over %s", self._queue_id, settings.cluster.bootstrap_servers,
                     settings.cluster.security_protocol)
        else:
            kafka = config.get("kafka")
            if not isinstance(kafka, dict) or "bootstrap.servers" not in kafka:
                raise ConfigError([(_field("bootstrap_servers"), None,
                                    "is required when the dispatcher passes no site connection")])
            self._connection = dict(kafka)
        self._client_id = f"sluice-{config.get('site', 'site')}-{self._queue_id or 'queue'}-forwarder"
        self.settings = settings
        if settings.schema_registry is not None:
            self._confluent = self._check_registry(settings, config.get("regions"))
        self._producer = self._new_producer()
        self.state = ListenerState.READY

    def close(self) -> None:
        """Flush what is still pending (bounded) and free the producer.  Idempotent."""
        if self.state is ListenerState.CLOSED:
            return
        self.state = ListenerState.CLOSED
        producer, self._producer = self._producer, None
        if producer is None:
            return
        assert self.settings is not None
        with kafka_errors("flushing the forwarder's producer"):
            remaining = producer.flush(self.settings.flush_timeout_s)
        if remaining:
            log.warning("queue %s: forwarder closed with %d records unacknowledged; their batch was not "
                        "accepted, so it is offered again to the next dispatcher", self._queue_id, remaining)

    # --- the listener contract ---------------------------------------------

    def process_events(self, events: list[AsyncEvent]) -> bool | Accepted:
        """Write the batch downstream; True only when every record is acknowledged (or
        ``Accepted`` naming the records too large to ever be, see step 3)."""
        if self.state is ListenerState.CLOSED:
            raise ClosedError(f"the kafka forwarder of queue {self._queue_id!r} is closed")
        assert self.state is ListenerState.READY and self.settings is not None, "process_events() before init()"
        if not events:
            return True
        if self._fatal is not None or self._producer is None:
            self._rebuild_producer()
        producer = self._producer
        assert producer is not None
        deadline = time.monotonic() + self.settings.flush_timeout_s

        # Step 1: encode everything before writing anything.
        codec = get_codec()
        records = []
        for event in events:
            duplicate = event.possible_duplicate or event.event_id in self._maybe_written
            entry = event.event.as_possible_duplicate() if duplicate and not event.event.possible_duplicate else event.event
            topic = self._topic_for(event.region)
            if self._confluent is None:
                value = codec.encode("EntryEvent", entry.to_record())
            else:
                try:
                    value = self._confluent.encode(topic, entry.to_record())
                except SluiceError as exc:
                    # The registry cannot be reached, or refuses a subject first
                    # met here: nothing was written, the same batch comes again.
                    self.offers_failed += 1
                    log.error("queue %s: encoding %r for %s failed, the batch will be offered again: %s",
                              self._queue_id, event, topic, exc)
                    return False
            records.append((topic, event.key.encode(), value, build_headers(event, duplicate), entry.event_time))

        # Step 2: produce; BufferError is back-pressure, waited out until the deadline.
        delivery = _Delivery(len(records))
        produced = 0  # records handed to the producer (or refused by it for their size), from the first
        too_large: list[int] = []  # refused by produce() for their size: never left, certainly not written
        failure: str | None = None
        for index, (topic, key, value, headers, timestamp) in enumerate(records):
            producing = self._producing.get(topic) or self._producing.setdefault(topic, kafka_errors(
                f"producing to {topic}"))
            while failure is None:
                try:
                    with producing:
                        producer.produce(topic, value=value, key=key, headers=headers, timestamp=max(timestamp, 0),
                                         on_delivery=delivery.callback(index))
                    break
                except KafkaCallFailed as exc:
                    if exc.code == KafkaError._QUEUE_FULL:
                        # Back-pressure: waited out until the flush deadline.
                        if time.monotonic() >= deadline:
                            failure = "the producer queue stayed full until the flush deadline"
                        else:
                            producer.poll(BUFFER_WAIT_S)
                    elif exc.code in NEVER_FITS:
                        delivery.outcomes[index] = exc
                        too_large.append(index)
                        break
                    else:
                        failure = str(exc)
            if failure is not None:
                break
            produced = index + 1
            producer.poll(0)

        # Step 3: wait for the acknowledgements of what was produced.
        remaining = producer.flush(max(0.0, deadline - time.monotonic()))
        if remaining:
            # Records not yet sent are dropped from the producer's queue so
            # they cannot land after the re-offer; records in flight cannot
            # be recalled and may still land (they count as maybe written).
            producer.purge(in_queue=True, in_flight=False, blocking=True)
            producer.poll(0)
            failure = failure or f"{remaining} records unacknowledged after {self.settings.flush_timeout_s:g} s"
        if self._fatal is not None:
            failure = failure or str(self._fatal)
        errors = [error for i, error in enumerate(delivery.outcomes)
                  if isinstance(error, KafkaError) and i not in too_large]
        if failure is None and errors:
            failure = f"{len(errors)} delivery errors, first: {errors[0].str()}"
        if failure is None and too_large and self._dead_letter_topic is None:
            failure = (f"{len(too_large)} records too large for the producer or the topic, first "
                       f"{events[too_large[0]]!r} (this host keeps no dead letters)")
        acked = delivery.acked
        if failure is None and acked + len(too_large) == len(events):
            self._maybe_written = frozenset()
            self.batches_forwarded += 1
            self.records_forwarded += acked
            if not too_large:
                return True
            letters = []
            for i in too_large:
                error = delivery.outcomes[i]
                reason = (f"the record for {records[i][0]} ({len(records[i][2])} bytes) is larger than the "
                          f"producer's message.max.bytes: {error.str() if isinstance(error, KafkaError) else error}")
                log.error("queue %s: %r can never be forwarded: %s; it goes to %s", self._queue_id, events[i],
                          reason, self._dead_letter_topic)
                letters.append(DeadLetter(events[i], reason, "MSG_SIZE_TOO_LARGE"))
            return Accepted(tuple(letters))

        # The re-offer is the same batch: remember which of its events may
        # already be downstream (from this offer or an earlier failed one).
        batch_ids = frozenset(event.event_id for event in events)
        self._maybe_written = (self._maybe_written & batch_ids) | frozenset(
            events[i].event_id for i in delivery.maybe_written(produced))
        self.offers_failed += 1
        log.warning("queue %s: forwarding %d events failed (%d acknowledged): %s; the batch will be offered again",
                    self._queue_id, len(events), acked, failure or "not every record acknowledged")
        return False

    # --- internals ---------------------------------------------------------

    def _topic_for(self, region: str) -> str:
        topic = self._topics.get(region)
        if topic is None:
            assert self.settings is not None
            topic = self._topics[region] = self.settings.topic_for(region, self._topic_prefix)
        return topic

    def _check_registry(self, settings: ForwarderSettings, regions: Any) -> ConfluentAvroWriter:
        """The Confluent writer, with the schema checked and registered in every subject known now.

        The dispatcher names the queue's regions (``regions`` in the init
        config), so a topic per region is known on start; a host that names
        none leaves a ``{region}`` topic's subjects to their first record,
        where the registry itself refuses an incompatible schema.
        """
        assert settings.schema_registry is not None
        writer = ConfluentAvroWriter(settings.schema_registry, "EntryEvent", field=_field("schema_registry"))
        if "{region}" not in settings.topic:
            topics = [settings.topic_for("", self._topic_prefix)]
        elif isinstance(regions, (list, tuple)):
            topics = [self._topic_for(str(region)) for region in regions]
        else:
            topics = []
        ids = writer.check_subjects(topics)
        log.info("queue %s: Confluent wire format, schema registry %s, subjects %s", self._queue_id,
                 settings.schema_registry.url, ", ".join(f"{subject} (id {id_})" for subject, id_ in ids.items()) or
                 "checked at their first record")
        return writer

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's error callback: fatal errors condemn the producer, the rest are logged."""
        if error.fatal():
            self._fatal = error_from_kafka_error(error, "forwarder producer")
            log.error("queue %s: fatal producer error, the producer is rebuilt: %s", self._queue_id, error.str())
        else:
            log.debug("queue %s: producer: %s", self._queue_id, error.str())

    def _new_producer(self) -> Producer:
        assert self.settings is not None
        timeout_ms = int(self.settings.flush_timeout_s * 1000)
        # Another cluster's passwords are read from their file or variable each time (rotation).
        conf = self._cluster.client_settings() if self._cluster is not None else dict(self._connection)
        conf.update({
            "client.id": self._client_id,
            "enable.idempotence": True,
            "acks": "all",
            # Kafka's default partitioner (murmur2 of the key): the partition
            # of a key matches any Java producer and Sluice's own buckets.
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            # The offer's deadline comes just before librdkafka's own: what
            # was never sent is then purged from the queue (certainly not
            # written, so not flagged when offered again) instead of timing
            # out (maybe written).  In-flight records give up shortly after.
            "delivery.timeout.ms": timeout_ms + DELIVERY_TIMEOUT_MARGIN_MS,
            "request.timeout.ms": min(30_000, timeout_ms),
            "error_cb": self._on_error,
            # librdkafka's own log lines go to this module's logger, not stderr.
            "logger": log,
        })
        return make_producer(conf)

    def _rebuild_producer(self) -> None:
        old, self._producer = self._producer, None
        if old is not None:
            # A producer after a fatal error sends nothing more; what it
            # still holds is failed (reported maybe-written by the last offer).
            try:
                with kafka_errors("discarding the old producer"):
                    old.purge(in_queue=True, in_flight=True, blocking=True)
                    old.flush(0)
            except KafkaCallFailed as exc:
                log.debug("queue %s: %s", self._queue_id, exc)
        self._fatal = None
        self._producer = self._new_producer()
