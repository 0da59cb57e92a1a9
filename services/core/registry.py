"""Confluent's wire format for Sluice records, with schemas in a Confluent-compatible registry.

Sluice's own topics frame every record in Avro's single-object encoding
(``codec.py``: ``C3 01``, the 8-byte fingerprint, the body).  Confluent's
deserializers, Kafka Connect's ``AvroConverter``, ksqlDB and Flink expect
the registry's framing instead::

    00 | schema id (4 bytes, big-endian) | Avro binary body

where the id is the one a schema registry gave the writer's schema.  A
writer set to ``serializer: confluent`` (the Kafka forwarder's target) uses
``ConfluentAvroWriter``; the framing and the registry calls are
confluent-kafka's own (``SchemaRegistryClient``, ``AvroSerializer``), not
written here.  Step by step:

1. the schema (``avro/<Name>.avsc``, made self-contained: every named type
   it uses spelled out, logical types kept so readers see timestamps) is
   the one Sluice's codec writes, so the body is the same Avro binary;
2. the subject of a topic comes from the configured strategy, as Confluent's
   serializers name it: ``TopicNameStrategy`` ``<topic>-value``,
   ``RecordNameStrategy`` ``<record full name>``, ``TopicRecordNameStrategy``
   ``<topic>-<record full name>``;
3. on start (``check_subjects``) each subject the writer will use is
   checked: with ``auto_register`` the registry's compatibility endpoint
   must accept the schema against the subject's latest version (an empty
   subject accepts anything), then the schema is registered; without it the
   schema must be registered already.  Either failure is a ``ConfigError``
   naming the subject and why, so the service does not start;
4. ``encode`` frames one record.  confluent-kafka caches the id per subject,
   so only the first record of a subject not checked on start asks the
   registry.  A registry that cannot be reached is ``RegistryUnavailable``
   (retriable); a refusal (the schema incompatible with a subject's new
   version) is ``RegistryRefused``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka.schema_registry import (
    Schema,
    SchemaRegistryClient,
    SchemaRegistryError,
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError

try:  # the HTTP client confluent-kafka's registry client uses: httpx2 where installed, else httpx
    from httpx2 import HTTPError as _HTTPError
except ImportError:  # pragma: no cover - depends on the installed extras
    from httpx import HTTPError as _HTTPError

from .codec import Codec, _collect_named, _self_contained, get_codec
from .config.models.registry import SchemaRegistryConnection
from .errors import ConfigError, MalformedRecord, RegistryRefused, RegistryUnavailable, UnknownSchema

__all__ = ["MAGIC_BYTE", "SERIALIZERS", "ConfluentAvroWriter", "registered_schema", "registry_client", "registry_schema",
           "registry_schema_text"]

#: The first byte of a record in Confluent's wire format.
MAGIC_BYTE = 0
#: The framings a writer can choose: Avro's single-object encoding (Sluice's own), or Confluent's.
SERIALIZERS = ("single-object", "confluent")

#: confluent-kafka's subject name strategies, by the names its serializers' settings use.
_STRATEGIES: dict[str, Callable[[SerializationContext, str], str]] = {
    "TopicNameStrategy": topic_subject_name_strategy,
    "RecordNameStrategy": record_subject_name_strategy,
    "TopicRecordNameStrategy": topic_record_subject_name_strategy,
}

#: The registry's error code for "no such subject" (Confluent's REST API: 40401).
SUBJECT_NOT_FOUND = 40401
#: ... and for "the schema is not registered under the subject" (40403).
SCHEMA_NOT_FOUND = 40403


def registry_schema(name: str, codec: Codec | None = None) -> dict[str, Any]:
    """The schema ``name`` as a registry holds it: self-contained, with its full name and logical types."""
    codec = codec or get_codec()
    named: dict[str, Any] = {}
    for each in codec.names:
        _collect_named(codec.schema_json(each), "", named)
    return _self_contained(copy.deepcopy(codec.schema_json(name)), named, set())  # type: ignore[no-any-return]


def registry_schema_text(name: str, codec: Codec | None = None) -> str:
    """``registry_schema`` as the text the writer registers and looks up (compact JSON).

    Where ``auto_register`` is off, register exactly this text: Confluent's
    registry compares schemas by their canonical form, but others (Apicurio
    Registry 2.x by default) look a schema up by its text."""
    return json.dumps(registry_schema(name, codec), separators=(",", ":"))


def registry_client(connection: SchemaRegistryConnection, field: str = "schema_registry") -> SchemaRegistryClient:
    """confluent-kafka's client of the registry ``connection`` names; ``ConfigError`` when it refuses the settings."""
    try:
        return SchemaRegistryClient(connection.client_settings())
    except (ValueError, TypeError) as exc:
        raise ConfigError([(field, connection.url, f"the registry client refuses it: {exc}")]) from None


def registered_schema(client: SchemaRegistryClient, schema_id: int, url: str) -> str:
    """The text of the Avro schema the registry holds under ``schema_id`` (what a reader of a Confluent
    frame needs, ``framing.py``).  ``UnknownSchema`` when the registry does not know the id or it is no
    Avro schema (the record is unreadable: dead-lettered), ``RegistryUnavailable`` when it cannot answer."""
    try:
        schema = client.get_schema(schema_id)
    except SchemaRegistryError as exc:
        status = exc.http_status_code
        if status is not None and 400 <= status < 500 and status not in (401, 403, 408, 429):
            raise UnknownSchema(f"schema id {schema_id}: the registry at {url} does not know it "
                                f"({exc.error_message}, HTTP {status})") from None
        raise RegistryUnavailable(url, f"looking schema id {schema_id} up: {exc.error_message} (HTTP {status})") \
            from exc
    except (_HTTPError, OSError, ValueError) as exc:  # no answer, or not the registry's JSON
        raise RegistryUnavailable(url, f"looking schema id {schema_id} up: {type(exc).__name__}: {exc}") from exc
    if (schema.schema_type or "AVRO") != "AVRO" or not schema.schema_str:
        raise UnknownSchema(f"schema id {schema_id} is a {schema.schema_type} schema, not Avro")
    return str(schema.schema_str)


class ConfluentAvroWriter:
    """Frames records of one Sluice schema in Confluent's wire format; see the module docstring.

    ``field`` names the settings block in errors (e.g. ``listener.settings.schema_registry``).
    Not thread-safe: one per writer thread, as confluent-kafka's serializer is.
    """

    def __init__(self, connection: SchemaRegistryConnection, schema_name: str = "EntryEvent", *,
                 field: str = "schema_registry", client: SchemaRegistryClient | None = None) -> None:
        self.connection = connection
        self.field = field
        #: The record's full name, what RecordNameStrategy names the subject by.
        self.record_name: str = registry_schema(schema_name)["name"]
        self.schema = Schema(registry_schema_text(schema_name), "AVRO")
        self._strategy = _STRATEGIES[connection.subject_name_strategy]
        self.client = client or registry_client(connection, field)
        self._serializer = AvroSerializer(self.client, self.schema.schema_str, conf={
            "auto.register.schemas": connection.auto_register,
            # The id of this very schema, never "the subject's latest": the
            # body is written with this schema, so its id must be this one's.
            "use.latest.version": False,
            "normalize.schemas": False,
            "subject.name.strategy": self._strategy,
        })
        #: subject -> schema id, of the subjects checked (and registered) so far.
        self.ids: dict[str, int] = {}

    def subject_for(self, topic: str) -> str:
        """The subject of this writer's records on ``topic``, by the configured strategy."""
        return self._strategy(SerializationContext(topic, MessageField.VALUE), self.record_name)

    def check_subjects(self, topics: Iterable[str]) -> dict[str, int]:
        """Check (and with auto_register, register) the schema in the subject of each topic: step 3.

        Returns subject -> schema id.  Raises ``ConfigError`` naming the
        subject when it refuses the schema, ``RegistryUnavailable`` when the
        registry cannot be asked.
        """
        for subject in dict.fromkeys(self.subject_for(topic) for topic in topics):
            if subject not in self.ids:
                self.ids[subject] = self._check_subject(subject)
        return dict(self.ids)

    def encode(self, topic: str, record: dict[str, Any]) -> bytes:
        """``record`` framed for ``topic``: ``00``, its schema id, the Avro body (step 4)."""
        try:
            data = self._serializer(record, SerializationContext(topic, MessageField.VALUE))
        except SchemaRegistryError as exc:
            raise self._registry_error(exc, self.subject_for(topic), "registering the schema") from exc
        except SerializationError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, SchemaRegistryError):
                raise self._registry_error(cause, self.subject_for(topic), "registering the schema") from exc
            raise MalformedRecord(f"cannot encode {self.record_name} for {topic}: {exc}") from exc
        except (_HTTPError, OSError) as exc:  # no answer: connection refused, timeout, TLS
            raise RegistryUnavailable(self.connection.url, f"{type(exc).__name__}: {exc}") from exc
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise MalformedRecord(f"cannot encode {self.record_name} for {topic}: {exc}") from exc
        assert data is not None and data[0] == MAGIC_BYTE, "confluent-kafka's serializer wrote no Confluent frame"
        return data

    # --- internals ---------------------------------------------------------

    def _check_subject(self, subject: str) -> int:
        try:
            if not self.connection.auto_register:
                return self._lookup(subject)
            self._check_compatible(subject)
            return self.client.register_schema(subject, self.schema)  # type: ignore[no-any-return]
        except SchemaRegistryError as exc:
            raise self._registry_error(exc, subject, "checking the subject") from exc
        except (_HTTPError, OSError) as exc:  # no answer: connection refused, timeout, TLS
            raise RegistryUnavailable(self.connection.url, f"{type(exc).__name__}: {exc}") from exc
        except ValueError as exc:  # an answer that is not the registry's JSON: another service at the URL
            raise RegistryUnavailable(self.connection.url, f"no registry answer while checking {subject!r}: "
                                      f"{exc}") from exc

    def _lookup(self, subject: str) -> int:
        try:
            return self.client.lookup_schema(subject, self.schema).schema_id  # type: ignore[no-any-return]
        except SchemaRegistryError as exc:
            if exc.error_code in (SUBJECT_NOT_FOUND, SCHEMA_NOT_FOUND) or exc.http_status_code == 404:
                raise ConfigError([(f"{self.field}.auto_register", False,
                                    f"subject {subject!r} does not hold Sluice's {self.record_name} schema "
                                    f"({exc.error_message}); register it there (its text: "
                                    f"sluice.core.registry.registry_schema_text), or set auto_register: true")]) from None
            raise

    def _check_compatible(self, subject: str) -> None:
        """The registry's compatibility endpoint, against the subject's latest version (an empty subject passes)."""
        try:
            compatible = self.client.test_compatibility(subject, self.schema, verbose=True)
        except SchemaRegistryError as exc:
            if exc.error_code == SUBJECT_NOT_FOUND or exc.http_status_code == 404:
                return  # nothing registered yet: the first version
            raise
        if compatible:
            return
        level = self._compatibility_level(subject)
        latest = self.client.get_latest_version(subject)
        raise ConfigError([(self.field, subject,
                            f"Sluice's {self.record_name} schema is not {level}-compatible with version "
                            f"{latest.version} (schema id {latest.schema_id}) of subject {subject!r}, so the "
                            f"registry would refuse to register it; point the writer at another subject "
                            f"(subject_name_strategy, topic) or change the subject's compatibility level")])

    def _compatibility_level(self, subject: str) -> str:
        """The subject's compatibility level, else the registry's own; "the subject's" when neither answers."""
        for scope in (subject, None):
            try:
                return str(self.client.get_compatibility(scope))
            except SchemaRegistryError:
                continue
        return "the subject's"

    def _registry_error(self, exc: SchemaRegistryError, subject: str, doing: str) -> Exception:
        """A registry's answer as Sluice's error: a refusal (4xx) or a registry that cannot answer (5xx, none)."""
        status = exc.http_status_code
        if status in (401, 403):
            return ConfigError([(self.field, self.connection.url,
                                 f"the registry refused the credentials while {doing} {subject!r}: "
                                 f"{exc.error_message} (HTTP {status})")])
        if status is not None and 400 <= status < 500:
            return RegistryRefused(subject, f"{exc.error_message} (HTTP {status}, error {exc.error_code})")
        return RegistryUnavailable(self.connection.url, f"{doing} {subject!r}: {exc.error_message} (HTTP {status})")
