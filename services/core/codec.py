"""Avro single-object encoding of every Sluice record (DESIGN §4).

A record on the wire is::

    C3 01 | CRC-64-AVRO fingerprint of the schema's Parsing Canonical Form (8 bytes, little-endian) | Avro binary body

exactly as the Avro specification's single-object encoding, so any Avro
library holding the schema can read it.  Schemas live in ``avro/`` and are
parsed once.  Decoding refuses, with a ``CodecError`` naming the problem,
bytes without the marker, an unknown fingerprint, a truncated body, trailing
bytes, or a record of another schema than the caller expected.

Schemas evolve the Avro way: an older version of a schema is kept in
``avro/history/<Name>.v<N>.avsc`` (self-contained: the named types it
uses spelled out as they were), and a record written with it (its
fingerprint) is read with Avro schema resolution into the current schema,
new fields taking their defaults.  So a service of a newer release reads
what an older one wrote (changelogs, queues, status), and a schema change
must add fields with defaults, never remove or retype one.

Timestamps are ``timestamp-millis`` in the schemas (so Spark and other
readers see timestamps) but plain ints in Python: records are read with a
copy of the schema stripped of logical types, which has the same canonical
form and therefore the same fingerprint.
"""

from __future__ import annotations

import copy
import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import fastavro
import fastavro.validation
from fastavro.schema import fingerprint, to_parsing_canonical_form

from .errors import MalformedRecord, UnknownSchema

MARKER = b"\xc3\x01"
HEADER_BYTES = 10

# Dependency order: named types must be parsed before the schemas that use them.
SCHEMA_ORDER = (
    "EventID",
    "VersionTag",
    "EntryEvent",
    "QueuedEvent",
    "GatewayBatch",
    "GatewayAck",
    "RemovalRecord",
    "DeadLetter",
    "ControlRecord",
    "QueueStatus",
    "QueueCleanAudit",
    "ReceiverStatus",
    "ReceiverPartitionTotals",
    "ClientInterest",
    "ClientRegistration",
    "ClientMessage",
    "ClientAck",
    "FillCheckpoint",
    "RegionInstance",
)


def schema_dir() -> Path:
    """``$SLUICE_AVRO_DIR``, else ``avro/`` at the top of the source tree."""
    env = os.environ.get("SLUICE_AVRO_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "avro"


_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


def _self_contained(node: Any, named: dict[str, Any], seen: set[str], ns: str = "") -> Any:
    """The schema with every named type from another file spelled out where it first appears."""
    if isinstance(node, str):
        if node in _PRIMITIVES:
            return node
        full = node if "." in node or not ns else f"{ns}.{node}"
        return full if full in seen else _self_contained(named[full], named, seen, ns)
    if isinstance(node, list):
        return [_self_contained(n, named, seen, ns) for n in node]
    kind = node["type"]
    if kind in ("record", "enum", "fixed"):
        name = node["name"]
        space = node.get("namespace", ns)
        full = name if "." in name or not space else f"{space}.{name}"
        seen.add(full)
        out = {k: v for k, v in node.items() if k != "namespace"}
        out["name"] = full
        if kind == "record":
            inner = full.rpartition(".")[0]
            out["fields"] = [dict(f, type=_self_contained(f["type"], named, seen, inner)) for f in node["fields"]]
        return out
    if kind == "array":
        return dict(node, items=_self_contained(node["items"], named, seen, ns))
    if kind == "map":
        return dict(node, values=_self_contained(node["values"], named, seen, ns))
    if kind in _PRIMITIVES:
        return node
    return dict(node, type=_self_contained(kind, named, seen, ns))


def _collect_named(node: Any, ns: str, out: dict[str, Any]) -> None:
    if isinstance(node, list):
        for n in node:
            _collect_named(n, ns, out)
    elif isinstance(node, dict):
        if node.get("type") in ("record", "enum", "fixed"):
            space = node.get("namespace", ns)
            full = node["name"] if "." in node["name"] or not space else f"{space}.{node['name']}"
            out[full] = node
            ns = full.rpartition(".")[0]
        for v in node.values():
            _collect_named(v, ns, out)


def _strip_logical_types(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [_strip_logical_types(v) for v in node]
    return node


class Codec:
    """Encodes and decodes the schemas in one directory.  Thread-safe, immutable."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = directory or schema_dir()
        raw: dict[str, dict[str, Any]] = {}
        for name in SCHEMA_ORDER:
            path = directory / f"{name}.avsc"
            try:
                raw[name] = json.loads(path.read_text())
            except FileNotFoundError as exc:
                raise UnknownSchema(f"schema file {path} is missing") from exc
        self._writers: dict[str, Any] = {}
        self._readers: dict[str, Any] = {}
        self._fingerprints: dict[str, bytes] = {}
        self._by_fingerprint: dict[bytes, str] = {}
        self._raw = raw
        named_w: dict[str, Any] = {}
        named_r: dict[str, Any] = {}
        named_json: dict[str, Any] = {}
        for name in SCHEMA_ORDER:
            _collect_named(raw[name], "", named_json)
        for name in SCHEMA_ORDER:
            self._writers[name] = fastavro.parse_schema(copy.deepcopy(raw[name]), named_schemas=named_w)
            self._readers[name] = fastavro.parse_schema(_strip_logical_types(raw[name]), named_schemas=named_r)
            canonical = to_parsing_canonical_form(
                fastavro.parse_schema(_self_contained(copy.deepcopy(raw[name]), named_json, set()), named_schemas={})
            )
            # fastavro renders the 64-bit Rabin fingerprint little-endian,
            # the byte order the single-object encoding puts on the wire.
            fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
            self._fingerprints[name] = fp
            self._by_fingerprint[fp] = name
        # Older versions: fingerprint -> the writer schema to resolve from.
        self._older: dict[bytes, Any] = {}
        for path in sorted((directory / "history").glob("*.avsc")):
            name = path.name.split(".", 1)[0]
            if name not in raw:
                raise UnknownSchema(f"{path}: no current schema named {name!r} in {directory}")
            # Self-contained: every named type it uses spelled out, as it was then.
            old = json.loads(path.read_text())
            canonical = to_parsing_canonical_form(fastavro.parse_schema(copy.deepcopy(old), named_schemas={}))
            fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
            if fp in self._by_fingerprint:
                continue  # identical to the current version
            self._older[fp] = fastavro.parse_schema(_strip_logical_types(old), named_schemas={})
            self._by_fingerprint[fp] = name

    @property
    def names(self) -> tuple[str, ...]:
        return SCHEMA_ORDER

    def fingerprint(self, name: str) -> bytes:
        """The 8 fingerprint bytes as they appear on the wire."""
        try:
            return self._fingerprints[name]
        except KeyError:
            raise UnknownSchema(f"no schema named {name!r}") from None

    def schema_named(self, fp: bytes) -> str | None:
        """The name of the schema (any version this release reads) whose fingerprint is ``fp``, else None."""
        return self._by_fingerprint.get(bytes(fp))

    def header(self, name: str) -> bytes:
        """The single-object header of a record of schema ``name``: the marker and its fingerprint."""
        return MARKER + self.fingerprint(name)

    def schema_json(self, name: str) -> dict[str, Any]:
        """The schema as written in ``avro/`` (for other Avro libraries)."""
        return copy.deepcopy(self._raw[name])

    def parsed_schema(self, name: str) -> Any:
        return self._writers[name]

    def encode(self, name: str, record: dict[str, Any], validate: bool = True) -> bytes:
        """Frame ``record``.  ``validate=False`` skips the type check, for hot
        paths whose records are built from typed values (about half the cost).
        Without it, fastavro still refuses a long beyond 64 bits but writes an
        int field beyond 32 bits as if it were a long, which other readers
        reject: numbers from outside are range-checked where they enter
        (``core/eventchecks.py``), so such records hold only checked values."""
        try:
            schema = self._writers[name]
        except KeyError:
            raise UnknownSchema(f"no schema named {name!r}") from None
        buf = io.BytesIO()
        buf.write(MARKER)
        buf.write(self._fingerprints[name])
        if validate:
            try:
                fastavro.validation.validate(record, schema, raise_errors=True)
            except fastavro.validation.ValidationError as exc:
                raise MalformedRecord(f"cannot encode {name}: {exc}") from exc
        try:
            fastavro.schemaless_writer(buf, schema, record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise MalformedRecord(f"cannot encode {name}: {exc}") from exc
        return buf.getvalue()

    def schema_of(self, data: bytes) -> str:
        """The schema name of an encoded record, from its header alone."""
        if len(data) < HEADER_BYTES:
            raise MalformedRecord(f"record of {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
        if data[:2] != MARKER:
            raise MalformedRecord(f"missing single-object marker C3 01 (starts with {data[:2].hex()})")
        fp = bytes(data[2:HEADER_BYTES])
        try:
            return self._by_fingerprint[fp]
        except KeyError:
            raise UnknownSchema(f"unknown schema fingerprint {fp.hex()}") from None

    def decode(self, data: bytes | None, expected: str | None = None) -> tuple[str, dict[str, Any]]:
        """(schema name, record) of an encoded record; ``expected`` pins the schema."""
        if data is None:
            raise MalformedRecord("record has no value")
        name = self.schema_of(data)
        if expected is not None and name != expected:
            raise MalformedRecord(f"expected a {expected} record, got a {name} record")
        buf = io.BytesIO(data)
        buf.seek(HEADER_BYTES)
        older = self._older.get(bytes(data[2:HEADER_BYTES])) if self._older else None
        try:
            if older is None:
                record = fastavro.schemaless_reader(buf, self._readers[name], None)
            else:
                record = fastavro.schemaless_reader(buf, older, self._readers[name])
        except (EOFError, StopIteration, ValueError, IndexError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise MalformedRecord(f"{name} body cannot be read: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise MalformedRecord(f"{name} body has {len(data) - buf.tell()} trailing bytes")
        return name, record

    def decode_as(self, name: str, data: bytes | None) -> dict[str, Any]:
        return self.decode(data, expected=name)[1]


_default: Codec | None = None
_lock = threading.Lock()


def get_codec() -> Codec:
    """The process-wide codec over ``schema_dir()``, parsed on first use."""
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = Codec()
    return _default
