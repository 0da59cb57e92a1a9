"""Sluice records in Spark: the Avro single-object encoding decoded into typed columns.

A record on a Sluice topic is ``C3 01 | CRC-64-AVRO fingerprint (8 bytes) |
Avro body`` (DESIGN §4, ``sluice.core.codec``).  ``decode`` does in Spark SQL
what ``Codec.decode_as`` does in Python, step by step:

1. check the header: a value, at least 10 bytes, the marker ``C3 01``;
2. look the fingerprint up among the versions of the expected schema: the
   current one in ``avro/`` and the older ones in ``avro/history/``.  A
   fingerprint of another Sluice schema, or of none, is refused;
3. read the body with ``from_avro`` and the writer's schema.  A record an
   older release wrote is resolved into the current schema (Avro schema
   resolution, ``from_avro``'s ``avroSchema`` option), so every row has the
   current columns, new fields at their defaults;
4. a record refused at any step gets a null record and its reason in the
   ``corrupt`` column, worded as the Python codec words it.  A corrupt record
   never fails the job: the caller routes it (the lake keeps it, with its raw
   bytes, in a row of its own; the reports count it).

Why ``from_avro`` (spark-avro) rather than fastavro in a ``mapInArrow``: the
body is read in the executors' JVM, row by row inside Spark's generated code,
with no Python worker, no Arrow round trip and no pickling, which makes it
several times faster per core than fastavro; the executors need nothing but
the two Maven packages (no sluice, no fastavro on the workers), so the jobs
run on any Spark cluster unchanged; and ``PERMISSIVE`` mode turns an
unreadable body into a null that becomes a reason instead of a failed task.
The price: ``from_avro`` does not notice bytes left over after a valid body
(the Python codec refuses them), so such a record reads as its valid prefix.

Timestamps (``timestamp-millis`` in the schemas) become Spark timestamps;
enums become strings; unions with null become nullable columns.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from sluice.core.codec import HEADER_BYTES, MARKER, Codec, get_codec, schema_dir

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = ["WriterVersion", "decode", "self_contained_schema", "writer_versions"]

#: ``from_avro`` options for every version: a body it cannot read is a null, not a failed task.
#: ``datetimeRebaseMode``: timestamps are proleptic Gregorian as written; a garbled body that
#: happens to hold a date before 1582 must not raise Spark's calendar-rebase error.
_FROM_AVRO_OPTIONS = {"mode": "PERMISSIVE", "datetimeRebaseMode": "CORRECTED"}

_NAMED_KINDS = ("record", "enum", "fixed")


@dataclass(frozen=True)
class WriterVersion:
    """One version of a schema that records on the wire may have been written with."""

    fingerprint: bytes
    schema: dict[str, Any]
    current: bool

    @property
    def fingerprint_hex(self) -> str:
        """Upper-case hex, as Spark's ``hex()`` renders the 8 bytes."""
        return self.fingerprint.hex().upper()


def _full_name(node: dict[str, Any], namespace: str) -> str:
    name = str(node["name"])
    space = node.get("namespace", namespace)
    return name if "." in name or not space else f"{space}.{name}"


def self_contained_schema(name: str, codec: Codec | None = None) -> dict[str, Any]:
    """Schema ``name`` as JSON with every named type from another file spelled out where it first appears.

    The files in ``avro/`` refer to each other by name (``io.sluice.EventID``);
    ``from_avro`` takes one schema, so the references are inlined, each named
    type defined once and referred to by name after that, as Avro requires.
    """
    codec = codec or get_codec()
    named = {}
    for other in codec.names:
        raw = codec.schema_json(other)
        named[_full_name(raw, "")] = raw
    defined: set[str] = set()

    def inline(node: Any, namespace: str) -> Any:
        if isinstance(node, str):
            full = node if "." in node or not namespace else f"{namespace}.{node}"
            if full in named and full not in defined:
                return inline(copy.deepcopy(named[full]), namespace)
            if node in named and node not in defined:
                return inline(copy.deepcopy(named[node]), namespace)
            return node
        if isinstance(node, list):
            return [inline(branch, namespace) for branch in node]
        out = dict(node)
        kind = node.get("type")
        if kind in _NAMED_KINDS:
            full = _full_name(node, namespace)
            defined.add(full)
            namespace = full.rpartition(".")[0]
            if kind == "record":
                out["fields"] = [dict(field, type=inline(field["type"], namespace)) for field in node["fields"]]
        elif kind == "array":
            out["items"] = inline(node["items"], namespace)
        elif kind == "map":
            out["values"] = inline(node["values"], namespace)
        elif isinstance(kind, (dict, list)):
            out["type"] = inline(kind, namespace)
        return out

    schema: dict[str, Any] = inline(codec.schema_json(name), "")
    return schema


def _fingerprint_of(schema: dict[str, Any]) -> bytes:
    """The wire fingerprint of a self-contained schema, computed as ``Codec`` computes it."""
    canonical = to_parsing_canonical_form(fastavro.parse_schema(copy.deepcopy(schema), named_schemas={}))
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


def _history(directory: Path, name: str) -> list[tuple[bytes, dict[str, Any]]]:
    out = []
    for path in sorted((directory / "history").glob(f"{name}.v*.avsc")):
        schema = json.loads(path.read_text())
        out.append((_fingerprint_of(schema), schema))
    return out


def writer_versions(name: str, codec: Codec | None = None, directory: Path | None = None) -> list[WriterVersion]:
    """Every version of schema ``name`` a record may carry: the current one first, then ``avro/history``.

    Each older fingerprint is checked against the codec (``schema_of``), so
    Spark and the Python services accept exactly the same writers.
    """
    codec = codec or get_codec()
    directory = directory or schema_dir()
    current = WriterVersion(codec.fingerprint(name), self_contained_schema(name, codec), current=True)
    versions = [current]
    for fp, schema in _history(directory, name):
        if fp == current.fingerprint:
            continue  # identical to the current version
        known = codec.schema_of(MARKER + fp)
        assert known == name, f"avro/history: a {name} version the codec reads as {known}"
        versions.append(WriterVersion(fp, schema, current=False))
    return versions


def _known_fingerprints(codec: Codec, directory: Path) -> dict[str, str]:
    """Upper-case hex fingerprint → schema name, for every schema and version the codec knows."""
    known = {codec.fingerprint(name).hex().upper(): name for name in codec.names}
    for name in codec.names:
        for fp, _ in _history(directory, name):
            known.setdefault(fp.hex().upper(), name)
    return known


def decode(frame: DataFrame, column: str, name: str, *, record: str = "record", corrupt: str = "corrupt",
           codec: Codec | None = None, directory: Path | None = None) -> DataFrame:
    """``frame`` with two columns added from its binary column ``column`` of ``name`` records.

    ``record``: a struct of the current schema's fields, null when the
    record was refused; ``corrupt``: null, or why it was refused (see the
    module docstring).  The body is parsed once per row: the parse is a
    column of its own that the reason and the record then refer to (Spark
    does not inline an expensive expression referred to twice).
    """
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    codec = codec or get_codec()
    directory = directory or schema_dir()
    versions = writer_versions(name, codec, directory)
    current_json = json.dumps(versions[0].schema)
    value = F.col(column)
    length = F.octet_length(value)
    marker = F.substring(value, 1, 2)
    fp_hex = F.hex(F.substring(value, 3, HEADER_BYTES - 2))
    body = F.substr(value, F.lit(HEADER_BYTES + 1))

    # CASE WHEN evaluates only the branch whose condition holds, so from_avro
    # never sees a body whose header was refused.
    parse: Column | None = None
    for version in versions:
        options = dict(_FROM_AVRO_OPTIONS)
        if not version.current:
            options["avroSchema"] = current_json
        parsed = from_avro(body, json.dumps(version.schema), options)
        matches = (length >= HEADER_BYTES) & (marker == F.lit(MARKER)) & (fp_hex == F.lit(version.fingerprint_hex))
        parse = F.when(matches, parsed) if parse is None else parse.when(matches, parsed)
    assert parse is not None
    parsed_column = f"__{record}_parsed"
    frame = frame.withColumn(parsed_column, parse)
    parsed_record = F.col(parsed_column)
    # PERMISSIVE from_avro answers an unreadable body with a struct of nulls
    # (not a null struct): a field no valid record leaves null tells them apart.
    unreadable = parsed_record.isNull() | parsed_record.getField(_required_field(versions[0].schema)).isNull()

    mine = [v.fingerprint_hex for v in versions]
    others = {fp: other for fp, other in _known_fingerprints(codec, directory).items() if fp not in mine}
    other_name = F.create_map(*[F.lit(x) for pair in others.items() for x in pair])[fp_hex] if others else F.lit(None)
    reason = (
        F.when(value.isNull(), F.lit("record has no value"))
        .when(length < HEADER_BYTES,
              F.format_string(f"record of %d bytes is shorter than the {HEADER_BYTES}-byte header", length))
        .when(marker != F.lit(MARKER),
              F.format_string("missing single-object marker C3 01 (starts with %s)", F.lower(F.hex(marker))))
        .when(other_name.isNotNull(), F.format_string(f"expected a {name} record, got a %s record", other_name))
        .when(~fp_hex.isin(mine), F.format_string("unknown schema fingerprint %s", F.lower(fp_hex)))
        .when(unreadable, F.lit(f"{name} body cannot be read"))
    )
    return (frame.withColumn(corrupt, reason)
            .withColumn(record, F.when(F.col(corrupt).isNull(), parsed_record))
            .drop(parsed_column))


def _required_field(schema: dict[str, Any]) -> str:
    """The first field of a record schema that cannot be null (not a union with "null")."""
    for field in schema["fields"]:
        kind = field["type"]
        if not (isinstance(kind, list) and "null" in kind) and kind != "null":
            return str(field["name"])
    raise ValueError(f"schema {schema['name']} has no field that cannot be null; cannot tell unreadable bodies")
