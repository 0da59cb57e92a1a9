"""A downstream service of the Kafka forwarder, in faust-streaming.

It reads the topic(s) a ``type: kafka`` listener writes, and step by step:

1. decodes each record's value, an ``EntryEvent`` in Avro single-object
   encoding, with the project's schemas (``sluice.core.codec``); a record that
   cannot be decoded is logged at ERROR with its topic, partition and offset,
   and counted, never silently skipped;
2. drops repeats by EventID.  The forwarder delivers at least once, so an
   event may arrive twice (the second copy usually flagged possibleDuplicate).
   An event is a repeat when its sequence is at or below the highest sequence
   already seen for its (member, thread) *on the same entry key* (table
   ``seen``).  Per key, because that is the stream whose order holds end to
   end: a key's events share one queue partition and one downstream
   partition, while one writer thread's events spread over partitions that
   are consumed in no particular order across each other;
3. applies the rest: table ``latest`` holds the latest value per
   ``region/key`` (a destroy removes it), and a per-region count of applied
   events is kept in memory and logged every ``SLUICE_DOWNSTREAM_REPORT_S``.

Both tables are Faust tables: their changelog topics (created by Faust)
restore them when a partition moves to another worker, and they are written
to the partition of the record being processed, so they shard exactly like
the source topic.  The per-region count is per worker and since its start (a
table keyed by region would need a repartition; this example does not).

Run (the topic must exist; its partition count is read from the broker)::

    SLUICE_DOWNSTREAM_BROKER=127.0.0.1:9092 SLUICE_DOWNSTREAM_TOPIC=downstream.orders \\
        python deploy/downstream/faust_app.py worker -l info --without-web

Environment:

==============================  =============================================  =====================
``SLUICE_DOWNSTREAM_BROKER``    bootstrap servers, host:port[,host:port]       ``127.0.0.1:9092``
``SLUICE_DOWNSTREAM_TOPIC``     forwarder topic(s), comma-separated            required
``SLUICE_DOWNSTREAM_APP_ID``    Faust app id: consumer group, changelog names  ``sluice-downstream``
``SLUICE_DOWNSTREAM_DATA_DIR``  Faust's data directory                         ``.sluice/downstream``
``SLUICE_DOWNSTREAM_REPORT_S``  seconds between two summary lines              ``10``
``SLUICE_DOWNSTREAM_REPLICAS``  replication factor of the changelog topics      ``1``
==============================  =============================================  =====================
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.core.codec import get_codec
from sluice.core.errors import CodecError
from sluice.core.events import EntryEvent

log = logging.getLogger("sluice.downstream")


# --- processing: plain functions over mappings (a Faust Table is one) ---------


def decode_event(value: bytes | None) -> EntryEvent:
    """The forwarded EntryEvent; raises ``CodecError`` naming what is wrong."""
    return EntryEvent.from_record(get_codec().decode_as("EntryEvent", value))


def table_key(event: EntryEvent) -> str:
    # Region names hold no '/' (the site file's name pattern), so this is unambiguous.
    return f"{event.region}/{event.key}"


def is_repeat(seen: MutableMapping[str, Any], event: EntryEvent) -> bool:
    """True when an event of this key from the same (member, thread) at or above this sequence was applied."""
    streams = seen.get(table_key(event)) or {}
    eid = event.event_id
    highest = streams.get(f"{eid.member_id}/{eid.thread_id}")
    return highest is not None and eid.sequence_id <= highest


def _value_of(event: EntryEvent) -> Any:
    if event.value is None:
        return None
    if event.value_encoding == "json":
        try:
            return json.loads(event.value)
        except ValueError:
            log.warning("value of %s/%s %s is not JSON; kept as base64", event.region, event.key, event.event_id)
    return {"base64": base64.b64encode(event.value).decode()}


@dataclass
class Stats:
    """What this worker did since it started."""

    applied: int = 0
    repeats: int = 0
    undecodable: int = 0
    regions: Counter[str] = field(default_factory=Counter)

    def summary(self, keys: int) -> str:
        return json.dumps({"applied": self.applied, "repeats": self.repeats, "undecodable": self.undecodable,
                           "regions": dict(sorted(self.regions.items())), "keys": keys}, sort_keys=True)


def apply_event(event: EntryEvent, seen: MutableMapping[str, Any], latest: MutableMapping[str, Any],
                stats: Stats) -> bool:
    """Apply one decoded event unless it is a repeat; True when applied."""
    if is_repeat(seen, event):
        stats.repeats += 1
        log.info("repeat %s %s/%s %s%s", event.operation.value, event.region, event.key, event.event_id,
                 " (possibleDuplicate)" if event.possible_duplicate else " (NOT flagged possibleDuplicate)")
        return False
    tk = table_key(event)
    eid = event.event_id
    # A Faust table sees a change only through __setitem__: copy, change, store.
    streams = dict(seen.get(tk) or {})
    streams[f"{eid.member_id}/{eid.thread_id}"] = eid.sequence_id
    seen[tk] = streams
    if event.operation.removes_value:
        if tk in latest:
            del latest[tk]
    else:
        latest[tk] = {"value": _value_of(event), "operation": event.operation.value,
                      "event_id": str(eid), "entry_version": event.version.entry_version}
    stats.applied += 1
    stats.regions[event.region] += 1
    log.info("applied %s %s/%s %s", event.operation.value, event.region, event.key, eid)
    return True


# --- the Faust application ------------------------------------------------------


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if not value:
        sys.exit(f"faust_app: set {name}")
    return value


def source_partitions(bootstrap: str, topics: list[str]) -> int:
    """The partition count shared by the source topics (the tables must match it)."""
    from sluice.core.kafka import make_admin

    metadata = make_admin({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    counts = {}
    for topic in topics:
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None:
            sys.exit(f"faust_app: topic {topic!r} does not exist on {bootstrap}; create it first "
                     "(the forwarder does not create topics either)")
        counts[topic] = len(meta.partitions)
    if len(set(counts.values())) != 1:
        sys.exit(f"faust_app: the source topics must have the same number of partitions, got {counts}")
    return next(iter(counts.values()))


def create_app() -> Any:
    import faust

    bootstrap = _env("SLUICE_DOWNSTREAM_BROKER", "127.0.0.1:9092")
    topics = [t.strip() for t in _env("SLUICE_DOWNSTREAM_TOPIC").split(",") if t.strip()]
    partitions = source_partitions(bootstrap, topics)
    report_s = float(_env("SLUICE_DOWNSTREAM_REPORT_S", "10"))
    datadir = Path(_env("SLUICE_DOWNSTREAM_DATA_DIR", ".sluice/downstream"))
    datadir.mkdir(parents=True, exist_ok=True)  # Faust creates the last level only

    app = faust.App(
        _env("SLUICE_DOWNSTREAM_APP_ID", "sluice-downstream"),
        broker=[f"kafka://{server.strip()}" for server in bootstrap.split(",")],
        store="memory://",
        datadir=str(datadir),
        # Tables shard like the source: same partition count for their changelogs.
        topic_partitions=partitions,
        topic_replication_factor=int(_env("SLUICE_DOWNSTREAM_REPLICAS", "1")),
        consumer_auto_offset_reset="earliest",
    )
    source = app.topic(*topics, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    seen = app.Table("seen", default=dict, partitions=partitions)
    latest = app.Table("latest", default=None, partitions=partitions)
    stats = Stats()

    # One agent instance (concurrency 1): records of a partition are applied in order.
    @app.agent(source)
    async def forwarded(stream: Any) -> None:
        async for record in stream.events():
            message = record.message
            try:
                event = decode_event(record.value)
            except CodecError as exc:
                stats.undecodable += 1
                log.error("undecodable record %s[%d]@%d skipped: %s", message.topic, message.partition,
                          message.offset, exc)
                continue
            apply_event(event, seen, latest, stats)

    @app.timer(interval=report_s)
    async def report() -> None:
        log.info("downstream stats %s", stats.summary(keys=len(latest)))

    return app


if __name__ == "__main__":
    create_app().main()
