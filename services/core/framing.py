"""The two framings of a site's data records, read and written in one place.

A site's changelog and queue records are Avro (``codec.py``), framed one of
two ways, chosen by the site's ``serializer``:

* ``single-object`` (the default): Avro's single-object encoding, ``C3 01``,
  the schema's 8-byte CRC-64-AVRO fingerprint, the body (10 header bytes);
* ``confluent``: Confluent's wire format, ``00``, the 4-byte big-endian id a
  schema registry gave the schema, the same body (5 header bytes), so that
  Confluent's deserializers, Kafka Connect's ``AvroConverter``, ksqlDB and
  Flink read the site's changelog and queue topics with only the registry's
  URL.

Only the header differs: the Avro body is the same bytes either way, so a
body moves between framings (another site's event into this site's
changelog, a queued event into a GatewayBatch) by swapping the header, never
by encoding it again.  Sluice's own protocol records (RemovalRecord,
GatewayBatch, GatewayAck, status and control records) are always
single-object: no other tool reads them.

Reading, step by step (``Frames``):

1. the first byte says the framing: ``C3`` single-object, ``00`` Confluent,
   anything else is refused with ``MalformedRecord`` (as a truncated header);
2. a Confluent frame's schema id is looked up in the site's registry once
   (then cached), and the schema the registry holds is matched to the local
   one by the fingerprint of its Parsing Canonical Form: so a frame of either
   framing has a fingerprint, and the codec's readers (older versions read
   through schema resolution) and the hand-written fast readers
   (``eventwire``) work on its body unchanged;
3. an id the registry does not know, or whose schema is none of Sluice's, is
   ``UnknownSchema``; a Confluent frame where the site names no registry is
   ``MalformedRecord`` saying so.  Both are ``CodecError``: the reader
   dead-letters the record as any other unreadable one.  A registry that
   cannot be reached is ``RegistryUnavailable`` (retriable): the record is
   not dead-lettered for a registry's outage; its reader asks again (the
   queue loop and the subscription service with ``kafka.until_answered``,
   a bucket load and a standby copy by reading the record again).

Writing: ``header(name, topic)`` is the header a record of schema ``name``
on ``topic`` gets.  Confluent ids come from registering the schema in the
topic's subject (``registry.ConfluentAvroWriter``, the configured subject
name strategy); ``check_writes`` does that for every topic on start, so an
unreachable registry or a subject that refuses the schema stops the start
with an error naming the subject.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import fastavro
from pydantic import SecretStr
from fastavro.schema import fingerprint, to_parsing_canonical_form

from .codec import HEADER_BYTES, MARKER, Codec, get_codec
from .errors import ConfigError, MalformedRecord, RegistryUnavailable, UnknownSchema

if TYPE_CHECKING:
    from .config.models.registry import SchemaRegistryConnection

__all__ = ["CONFLUENT_HEADER_BYTES", "CONFLUENT_MAGIC", "DATA_SCHEMAS", "Frame", "Frames", "frames_for"]

#: The first byte of a Confluent frame, then its 4-byte big-endian schema id.
CONFLUENT_MAGIC = 0x00
CONFLUENT_HEADER_BYTES = 5
#: The first byte of a single-object frame (``C3 01``).
SINGLE_OBJECT_MAGIC = MARKER[0]
#: The schemas of a site's data records: the only ones a site's ``serializer`` frames.
DATA_SCHEMAS = ("EntryEvent", "QueuedEvent")


class Frame(NamedTuple):
    """A record's header: how many bytes it takes, and the fingerprint of its writer's schema."""

    header_bytes: int
    fingerprint: bytes
    #: The registry's schema id (Confluent frames), else None.
    schema_id: int | None = None


def confluent_header(schema_id: int) -> bytes:
    """The 5 header bytes of a Confluent frame of schema ``schema_id``."""
    return bytes((CONFLUENT_MAGIC,)) + schema_id.to_bytes(4, "big")


class Frames:
    """Reads frames of either framing, and writes the site's own; see the module docstring.

    ``registry`` is the site's ``schema_registry`` block: required to write
    Confluent frames, and to read them.  Thread-safe: a cache miss asks the
    registry under a lock.
    """

    def __init__(self, codec: Codec | None = None, registry: SchemaRegistryConnection | None = None, *,
                 serializer: str = "single-object", field: str = "schema_registry", client: Any = None) -> None:
        if serializer not in ("single-object", "confluent"):
            raise ConfigError([("serializer", serializer, "must be single-object or confluent")])
        if serializer == "confluent" and registry is None:
            raise ConfigError([(field, None, "is required with serializer: confluent: the registry's url, at least")])
        self.codec = codec or get_codec()
        self.registry = registry
        self.serializer = serializer
        self._field = field
        self._client = client
        self._lock = threading.Lock()
        #: Confluent schema id → the fingerprint of the schema the registry holds under it.
        self._fingerprints: dict[int, bytes] = {}
        #: Schema name → its ConfluentAvroWriter (writing only).
        self._writers: dict[str, Any] = {}
        #: (schema name, topic) → the header its records get.
        self._headers: dict[tuple[str, str], bytes] = {}
        #: Schema name → its single-object header (the readers' per-record check).
        self._single_headers = {name: self.codec.header(name) for name in self.codec.names}

    # --- reading ---------------------------------------------------------------

    def frame(self, data: bytes) -> Frame:
        """The header of ``data`` (steps 1 to 3); ``CodecError`` for one that is none of the two framings."""
        if not data:
            raise MalformedRecord("record of 0 bytes has no header")
        first = data[0]
        if first == SINGLE_OBJECT_MAGIC:
            if len(data) < HEADER_BYTES:
                raise MalformedRecord(f"single-object record of {len(data)} bytes is shorter than its "
                                      f"{HEADER_BYTES}-byte header")
            if data[:2] != MARKER:
                raise MalformedRecord(f"missing single-object marker C3 01 (starts with {bytes(data[:2]).hex()})")
            return Frame(HEADER_BYTES, bytes(data[2:HEADER_BYTES]))
        if first == CONFLUENT_MAGIC:
            if len(data) < CONFLUENT_HEADER_BYTES:
                raise MalformedRecord(f"Confluent-framed record of {len(data)} bytes is shorter than its "
                                      f"{CONFLUENT_HEADER_BYTES}-byte header")
            schema_id = int.from_bytes(data[1:CONFLUENT_HEADER_BYTES], "big")
            return Frame(CONFLUENT_HEADER_BYTES, self._fingerprint_of(schema_id), schema_id)
        raise MalformedRecord(f"neither a single-object (C3 01) nor a Confluent (00) frame: starts with "
                              f"{bytes(data[:2]).hex()}")

    def current_header(self, data: bytes | None, name: str) -> bytes | None:
        """The header of ``data`` when it frames a record of the current version of ``name``, else None.

        What the fast readers need: the body starts after it.  None also for
        a record of another schema or an older version (``decode`` reads
        those, or says why not); ``CodecError`` for an unknown schema id."""
        if not data:
            return None
        if data[0] == SINGLE_OBJECT_MAGIC:
            header = self._single_headers[name]
            return header if data[:HEADER_BYTES] == header else None
        if data[0] != CONFLUENT_MAGIC:
            return None
        frame = self.frame(data)
        return bytes(data[:frame.header_bytes]) if frame.fingerprint == self.codec.fingerprint(name) else None

    def single_object(self, data: bytes | None) -> bytes | None:
        """``data`` with a Confluent header swapped for the single-object one (the body untouched)."""
        if not data or data[0] != CONFLUENT_MAGIC:
            return data
        frame = self.frame(data)
        return MARKER + frame.fingerprint + bytes(data[frame.header_bytes:])

    def decode(self, data: bytes | None, expected: str | None = None) -> tuple[str, dict[str, Any]]:
        """``Codec.decode`` of a frame of either framing."""
        return self.codec.decode(self.single_object(data), expected)

    def decode_as(self, name: str, data: bytes | None) -> dict[str, Any]:
        return self.decode(data, expected=name)[1]

    # --- writing ---------------------------------------------------------------

    def header(self, name: str, topic: str) -> bytes:
        """The header of a record of schema ``name`` written to ``topic`` by this site."""
        if self.serializer == "single-object" or name not in DATA_SCHEMAS:
            return self.codec.header(name)
        key = (name, topic)
        header = self._headers.get(key)
        if header is None:
            self.check_writes({name: [topic]})
            header = self._headers[key]
        return header

    def check_writes(self, topics: dict[str, Iterable[str]]) -> None:
        """Register (or look up) the schema of each name in the subject of each of its topics: the
        start's check.  ``ConfigError`` naming the subject when the registry refuses it or cannot be
        reached; nothing to do for single-object."""
        if self.serializer != "confluent":
            return
        from .registry import ConfluentAvroWriter  # imports confluent_kafka's registry client

        assert self.registry is not None
        with self._lock:
            for name, names in topics.items():
                writer = self._writers.get(name)
                if writer is None:
                    writer = self._writers[name] = ConfluentAvroWriter(
                        self.registry, name, field=self._field, client=self._registry_client())
                for topic in names:
                    if (name, topic) in self._headers:
                        continue
                    subject = writer.subject_for(topic)
                    try:
                        ids = writer.check_subjects([topic])
                    except RegistryUnavailable as exc:
                        raise ConfigError([(self._field, subject, f"the schema registry at {self.registry.url} "
                                            f"could not be asked about subject {subject!r}: {exc}")]) from exc
                    schema_id = ids[subject]
                    self._fingerprints.setdefault(schema_id, self.codec.fingerprint(name))
                    self._headers[(name, topic)] = confluent_header(schema_id)

    # --- internals -------------------------------------------------------------

    def _registry_client(self) -> Any:
        if self._client is None:
            from .registry import registry_client  # imports confluent_kafka's registry client

            assert self.registry is not None
            self._client = registry_client(self.registry, self._field)
        return self._client

    def _fingerprint_of(self, schema_id: int) -> bytes:
        found = self._fingerprints.get(schema_id)
        if found is not None:
            return found
        if self.registry is None and self._client is None:
            raise MalformedRecord(f"a record in Confluent's wire format (00, schema id {schema_id}), but the site "
                                  f"names no schema_registry to look the id up: set schema_registry.url in the "
                                  f"site file")
        from .registry import registered_schema

        url = self.registry.url if self.registry is not None else "the schema registry"
        with self._lock:
            found = self._fingerprints.get(schema_id)
            if found is None:
                text = registered_schema(self._registry_client(), schema_id, url)
                found = self._fingerprints[schema_id] = self._known(schema_id, text)
        return found

    def _known(self, schema_id: int, text: str) -> bytes:
        """The fingerprint of a registry's schema text, if it is one of Sluice's schemas (any version read)."""
        try:
            canonical = to_parsing_canonical_form(fastavro.parse_schema(json.loads(text), named_schemas={}))
        except (ValueError, TypeError, KeyError, AttributeError, fastavro.schema.SchemaParseException) as exc:
            raise UnknownSchema(f"schema id {schema_id}: the registry's schema cannot be parsed: {exc}") from None
        found = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
        if self.codec.schema_named(found) is None:
            raise UnknownSchema(f"schema id {schema_id} is no Sluice schema this release knows (fingerprint "
                                f"{found.hex()}), so its records cannot be read")
        return found


_sites: dict[str, Frames] = {}
_sites_lock = threading.Lock()


def frames_for(cfg: Any) -> Frames:
    """The ``Frames`` of a site (its ``serializer`` and ``schema_registry``), one per process and setting,
    so that every component of a service shares its registry cache."""
    registry = getattr(cfg, "schema_registry", None)
    serializer = getattr(cfg, "serializer", "single-object")
    # Secrets in the key too: two blocks that differ only in a password are two registries' logins.
    shown = None if registry is None else {
        k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in registry.model_dump().items()}
    key = json.dumps([serializer, shown], sort_keys=True, default=str)
    with _sites_lock:
        frames = _sites.get(key)
        if frames is None:
            frames = _sites[key] = Frames(get_codec(), registry, serializer=serializer)
        return frames
